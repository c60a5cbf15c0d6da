// FP4 KV-cache decode attention: the split-KV kernel with the G query heads as the M = 16 rows of the MMAs
// (TRACE_EXT_KV_DECODE_IMPL=qsmem / old; the default for G > 8 where the heads kernels do not apply).
// Part of the FP4 KV-cache decode attention translation unit: csrc/attn_decode_fp4kv_sm90.cu includes it and
// holds the design notes; the definitions live in that unit's anonymous namespace.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "trace_ext/fp4_numerics.cuh"
#include "trace_ext/attn_decode_fp4kv_common.cuh"

namespace trace_ext {
namespace {

// kQSmem: the Q fragments live in shared memory ([k-step][lane], one 16-byte load per k-step, reloaded every tile)
// instead of D/4 registers, so the kernel fits 128 registers and 4 CTAs (16 warps) per SM; false keeps them in
// registers (157 registers, 3 CTAs per SM), selectable with TRACE_EXT_KV_DECODE_IMPL=old.
template <int D, bool kQSmem>
__global__ void __launch_bounds__(kThreads, kQSmem ? kMinBlocks : kMinBlocksQReg)
    fp4kv_decode_kernel(const DecodeParams p) {
  using G = Geo<D>;
  extern __shared__ __align__(128) uint8_t smem[];

  const int split = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane / 4, c = lane % 4;  // MMA fragment row / column group

  const SplitTiles sp = split_tiles(p, split, b, warp);
  const int start = sp.start, end = sp.end, my_tiles = sp.my_tiles;

  float o[G::kONTiles][4];
#pragma unroll
  for (int j = 0; j < G::kONTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.0f, 0.0f};

  uint8_t* wsmem = smem + warp * kStages * G::kStageBytes;
  WarpLoader<D> ld{p.k_codes, p.v_codes, p.k_scales, p.v_scales, p.block_table + (int64_t)b * p.max_pages,
                   p.page_size, p.heads_kv, kv_head, lane};
  auto tile_start = [&](int i) { return start + (warp + kWarps * i) * kTile; };
  ld.init(tile_start(0));
  ld.prepare();
  const uint32_t wsmem_addr = smem_addr(wsmem);

  int2 next_ps = pipeline_prologue<D>(ld, wsmem_addr, tile_start, end, my_tiles);

  // ---- Q fragments (fp16, row-scaled by a power of two, head_dim permuted like the K fragments); loaded
  // after the pipeline prologue so its latency overlaps the first K/V tiles ----
  uint32_t qa[kQSmem ? 1 : G::kKSteps][4];  // register-resident Q (kQSmem == false)
  uint4* q_sm = reinterpret_cast<uint4*>(smem + G::kSmemBytes);  // [k-step][lane] (kQSmem)
  float row_scale[2];
  {
    float qv[2][D / 4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int head = r + 8 * h;
      const float amax = load_q_quarter<D>(p, b, kv_head, head, c, qv[h]);
      const int e2 = q_row_exponent(amax);
      const float up = exp2_exact(e2);
      row_scale[h] = __fmul_rn(p.score_scale, exp2_exact(-e2));
#pragma unroll
      for (int e = 0; e < D / 4; ++e) qv[h][e] = __fmul_rn(qv[h][e], up);
    }
    // k-step 2i + s takes elements 8i + 4s + {0, 2} (k = 2c, 2c+1) and 8i + 4s + {1, 3} (k = 2c+8, 2c+9)
#pragma unroll
    for (int ks = 0; ks < G::kKSteps; ++ks) {
      uint32_t a[4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint2 f = q_frag<D>(qv[h], ks);
        a[h] = f.x;      // a0a1 (row r), a2a3 (row r + 8)
        a[2 + h] = f.y;  // a4a5, a6a7
      }
      if constexpr (kQSmem) {
        // every warp computed the same fragments (same Q rows); warp 0 publishes them
        if (warp == 0) q_sm[ks * 32 + lane] = make_uint4(a[0], a[1], a[2], a[3]);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) qa[ks][e] = a[e];
      }
    }
  }
  if constexpr (kQSmem) __syncthreads();  // Q fragments visible to all warps (the only CTA barrier before the combine)

  // Per-thread shared-memory offsets inside a stage (loop invariant): K rows 8 nt + r (quarter row c), their
  // scale bytes; V rows 2c, 2c+1, 2c+8, 2c+9 (the block of head_dim column r) and their scale bytes.
  int k_off[2], ks_off[2], v_off[4], vs_off[4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int t = 8 * nt + r;
    k_off[nt] = D == 128 ? code_offset<D>(t, c) : code_offset<D>(t, c / 2) + (c % 2) * 8;
    ks_off[nt] = 2 * G::kCodeTile + t * G::kScaleBytes + (D == 128 ? 2 * c : c);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int t = 2 * c + (k & 1) + 8 * (k >> 1);
    const int voff = r * G::kVBytes;  // byte offset of this thread's block inside a row
    v_off[k] = G::kCodeTile + code_offset<D>(t, voff / 16) + voff % 16;
    vs_off[k] = 2 * G::kCodeTile + G::kScaleTile + t * G::kScaleBytes + r * (D / 8) / kNvfp4Block;
  }

  for (int i = 0; i < my_tiles; ++i) {
    pipeline_step<D>(ld, wsmem_addr, tile_start, i, end, my_tiles, next_ps);
    const uint8_t* st = wsmem + (i % kStages) * G::kStageBytes;
    const int t0 = tile_start(i);

    // ---- S = Q.K^T for tokens 8 nt + r (B operand rows), two n8 tiles ----
    // k-steps outermost (each Q fragment is loaded once per tile and feeds both n8 tiles); every s[nt] still
    // accumulates its k-steps in the order 0, 1, ..., so the scores do not depend on kQSmem.
    float s[2][4];
    uint32_t w[2][G::kKWords];
    uint32_t sc[2][G::kKWords];  // half2 (s, s) per word
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
    load_k<D>(st, k_off, ks_off, w, sc);
#pragma unroll
    for (int wi = 0; wi < G::kKWords; ++wi) {
      uint32_t qlo[4], qhi[4];  // Q fragments of k-steps 2 wi and 2 wi + 1
      if constexpr (kQSmem) {
        const uint4 a = q_sm[(2 * wi) * 32 + lane];
        const uint4 b = q_sm[(2 * wi + 1) * 32 + lane];
        qlo[0] = a.x, qlo[1] = a.y, qlo[2] = a.z, qlo[3] = a.w;
        qhi[0] = b.x, qhi[1] = b.y, qhi[2] = b.z, qhi[3] = b.w;
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) qlo[e] = qa[2 * wi][e], qhi[e] = qa[2 * wi + 1][e];
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const uint32_t hb = e2m1_hi_nibbles_to_f16_hibytes(w[nt][wi]);  // nibbles 1, 3, 5, 7
        const uint32_t lb = e2m1_lo_nibbles_to_f16_hibytes(w[nt][wi]);  // nibbles 0, 2, 4, 6
        // k-step 2 wi: b0b1 = (n0, n2), b2b3 = (n1, n3); k-step 2 wi + 1: (n4, n6), (n5, n7)
        mma_f16(s[nt], qlo, dequant_pair(lb, kPairLo, sc[nt][wi]), dequant_pair(hb, kPairLo, sc[nt][wi]));
        mma_f16(s[nt], qhi, dequant_pair(lb, kPairHi, sc[nt][wi]), dequant_pair(hb, kPairHi, sc[nt][wi]));
      }
    }

    // ---- online softmax (log2 domain), rows r and r + 8 ----
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] *= row_scale[e >> 1];
    }
    if (t0 + kTile > end) {  // the last tile of the split: mask tokens past its end (warp-uniform branch)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (t0 + 8 * nt + 2 * c + (e & 1) >= end) s[nt][e] = -INFINITY;
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
    }
    // Lazy rescaling: the running max only moves (and O, l are rescaled) when a row's max grew by more than
    // kRescaleSlack (log2 units); otherwise P = 2^(x - m_run) <= 2^kRescaleSlack, still exact enough in fp16
    // and harmless in the fp32 accumulators. Saves the D/2 multiplies per thread per tile of the O rescale. The test
    // runs on this lane's own scores (some lane's exceed m_run + slack iff the row's max does: m_run is the same in
    // the row's 4 lanes); the row max over the tile (2 shuffles per row) is formed only when the warp rescales.
    // Also true on the first finite max (m_run = -inf).
    const RunRefsRecomputed refs{};
    const bool grow = mx[0] > refs.thr(m_run, 0) || mx[1] > refs.thr(m_run, 1);
    if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        const float m_new = fmaxf(m_run[h], mx[h]);
        const float alpha = m_new == -INFINITY ? 1.0f : exp2f(m_run[h] - m_new);
        m_run[h] = m_new;
        l_run[h] *= alpha;
#pragma unroll
        for (int j = 0; j < G::kONTiles; ++j) o[j][2 * h] *= alpha, o[j][2 * h + 1] *= alpha;
      }
    }
    float psum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float m_ref = refs.ref(m_run, e >> 1);
        const float pe = exp2_ftz(s[nt][e] - m_ref);
        s[nt][e] = pe;
        psum[e >> 1] += pe;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) l_run[h] += psum[h];
    uint32_t pa[4];
    {
      __half2 h0 = __floats2half2_rn(s[0][0], s[0][1]);  // row r, tokens 2c, 2c+1
      __half2 h1 = __floats2half2_rn(s[0][2], s[0][3]);  // row r+8
      __half2 h2 = __floats2half2_rn(s[1][0], s[1][1]);  // row r, tokens 8+2c, 9+2c
      __half2 h3 = __floats2half2_rn(s[1][2], s[1][3]);
      pa[0] = *reinterpret_cast<uint32_t*>(&h0);
      pa[1] = *reinterpret_cast<uint32_t*>(&h1);
      pa[2] = *reinterpret_cast<uint32_t*>(&h2);
      pa[3] = *reinterpret_cast<uint32_t*>(&h3);
    }

    // ---- O += P.V: tokens (2c, 2c+1) and (2c+8, 2c+9); head_dim column r owns d = r * D/8 + j ----
    {
      uint32_t vw[4][G::kVWords];
      uint32_t vs2[2];
      load_v<D>(st, v_off, vs_off, vw, vs2);
#pragma unroll
      for (int wi = 0; wi < G::kVWords; ++wi) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          uint32_t hb[2], lb[2];
          expand_v_pairs<D>(vw, wi, half, hb, lb);
          // nibble n of the 4-byte group -> output column j = 8 wi + 4 half + n
          const int j0 = 8 * wi + 4 * half;
          mma_f16(o[j0 + 0], pa, dequant_pair(lb[0], kPairLo, vs2[0]), dequant_pair(lb[1], kPairLo, vs2[1]));
          mma_f16(o[j0 + 1], pa, dequant_pair(hb[0], kPairLo, vs2[0]), dequant_pair(hb[1], kPairLo, vs2[1]));
          mma_f16(o[j0 + 2], pa, dequant_pair(lb[0], kPairHi, vs2[0]), dequant_pair(lb[1], kPairHi, vs2[1]));
          mma_f16(o[j0 + 3], pa, dequant_pair(hb[0], kPairHi, vs2[0]), dequant_pair(hb[1], kPairHi, vs2[1]));
        }
      }
    }
    __syncwarp();
  }
  cp_async_wait<0>();

  // ---- combine the 4 warps' (m, l, O) in shared memory ----
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  __syncthreads();
  const CombineSmem cs = combine_smem(smem);
#pragma unroll
  for (int j = 0; j < G::kONTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = r + 8 * (e >> 1);
      const int n = 2 * c + (e & 1);  // head_dim d = n * D/8 + j
      cs.o[(warp * kMaxGroup + row) * kOStride + n * kOGroup + j] = o[j][e];
    }
  }
  if (c == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      cs.m[warp * kMaxGroup + r + 8 * h] = m_run[h];
      cs.l[warp * kMaxGroup + r + 8 * h] = l_run[h];
    }
  }
  __syncthreads();

  merge_warps<D>(p, cs.o, cs.m, cs.l, split, kv_head, b);
}

}  // namespace
}  // namespace trace_ext
