// FP4 KV-cache decode attention: the swapped-operand kernel for G <= 8 (tokens and head_dim as the MMA rows, the
// heads as the N = 8 columns; TRACE_EXT_KV_DECODE_IMPL=g8).
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

// ---- G <= 8: the swapped-operand kernel ---------------------------------------------------------------------
// With at most 8 query heads per KV head, half of the M = 16 rows of the kernel above are padding. Here the
// roles swap: S^T = K.Q^T (A = 16 tokens of K, B = Q^T with the heads as the N = 8 columns) and O^T = V^T.P^T
// (A = 16 head_dim rows of V^T, B = P^T), so every MMA row is real: half the MMAs, half the O accumulators
// (D/4 floats per thread instead of D/2), softmax on 4 instead of 8 scores per thread, and Q fits in
// registers (D/8 per thread). The split bounds, the cp.async pipeline steps, the Q row exponent and fp16 packing,
// the K and V code loads, the V code expansion and the cross-warp combine layout are helpers shared with the
// kernel above (the same code); the fragments map as follows:
// - S^T A fragment (rows = tokens r and r + 8, k = head_dim in the same permutation): the registers that were the
//   B fragments of n8 tiles 0 and 1. Q's B fragment (k, n = head r): the a0a1 / a4a5 halves of its old A.
// - S^T accumulator: lane (r, c) holds tokens r, r + 8 of heads 2c, 2c + 1; the per-head max and sum reduce over
//   r (shuffles 4, 8, 16). P^T as the B operand of O^T needs P[head r][tokens 2c, 2c + 1 (+ 8)], the transpose of
//   what the lane holds: one movmatrix.trans per 8x8 half of the 16-token tile.
// - O^T A fragment for M tile m: head_dim rows r and r + 8 are elements 2m and 2m + 1 of the lane's V block
//   (d = r * D/8 + 2m and + 1): exactly the old B fragments of n8 tiles 2m and 2m + 1.
// - Scores are the same sums over the same products in the same k-step order as the kernel above; P, O and the
//   cross-warp merge use the same formulas (only the per-lane bookkeeping differs).

__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// The swapped-operand tile step, shared by the g8 and heads kernels: (1) S^T = K.Q^T from the staged K code words w and
// their half2 block scales sc (load_k) into s: rows tokens r (half 0) and 8 + r (half 1), columns heads 2c, 2c + 1.
template <int D>
__device__ __forceinline__ void swapped_scores(const uint32_t (&w)[2][Geo<D>::kKWords],
                                               const uint32_t (&sc)[2][Geo<D>::kKWords],
                                               const uint32_t (&qb)[Geo<D>::kKSteps][2], float (&s)[4]) {
#pragma unroll
  for (int wi = 0; wi < Geo<D>::kKWords; ++wi) {
    uint32_t hb[2], lb[2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      hb[nt] = e2m1_hi_nibbles_to_f16_hibytes(w[nt][wi]);  // nibbles 1, 3, 5, 7
      lb[nt] = e2m1_lo_nibbles_to_f16_hibytes(w[nt][wi]);  // nibbles 0, 2, 4, 6
    }
    // k-step 2 wi: (n0, n2) for k = 2c, 2c+1 and (n1, n3) for k = 2c+8, 2c+9; k-step 2 wi + 1: n4..n7
    const uint32_t a0[4] = {dequant_pair(lb[0], kPairLo, sc[0][wi]), dequant_pair(lb[1], kPairLo, sc[1][wi]),
                            dequant_pair(hb[0], kPairLo, sc[0][wi]), dequant_pair(hb[1], kPairLo, sc[1][wi])};
    mma_f16(s, a0, qb[2 * wi][0], qb[2 * wi][1]);
    const uint32_t a1[4] = {dequant_pair(lb[0], kPairHi, sc[0][wi]), dequant_pair(lb[1], kPairHi, sc[1][wi]),
                            dequant_pair(hb[0], kPairHi, sc[0][wi]), dequant_pair(hb[1], kPairHi, sc[1][wi])};
    mma_f16(s, a1, qb[2 * wi + 1][0], qb[2 * wi + 1][1]);
  }
}

// (2) The online softmax (log2 domain) per head (column) over the tile's 16 tokens (rows): scale, mask tokens at or
// past `end` (the split's last tile), lazy rescaling of (m, l, O) when a head's max grows by more than kRescaleSlack,
// P = 2^(s - m) summed into l (this lane's tokens; summed over r after the loop) and transposed into P^T's B
// fragment pb: P[head r][tokens 2c, 2c+1] and [2c+8, 2c+9].
template <int kMTiles, class Refs>
__device__ __forceinline__ void swapped_softmax(float (&s)[4], const float (&head_scale)[2], int t0, int end, int r,
                                                float (&m_run)[2], Refs& refs, float (&l_run)[2],
                                                float (&o)[kMTiles][4], uint32_t (&pb)[2]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) s[e] *= head_scale[e & 1];
  if (t0 + kTile > end) {  // the last tile of the split: mask tokens past its end (warp-uniform branch)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (t0 + r + 8 * (e >> 1) >= end) s[e] = -INFINITY;
    }
  }
  // The rescale test on this lane's own scores: some lane's exceed m_run + slack iff the head's max over the tile
  // does (m_run is the same in the 8 lanes of a head), so the max over the tile's rows (3 shuffles per head) is only
  // formed when the warp rescales.
  float mx[2] = {fmaxf(s[0], s[2]), fmaxf(s[1], s[3])};
  const bool grow = mx[0] > refs.thr(m_run, 0) || mx[1] > refs.thr(m_run, 1);
  if (__any_sync(0xffffffffu, grow)) {
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 4));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 8));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 16));
      const float m_new = fmaxf(m_run[h], mx[h]);
      alpha[h] = m_new == -INFINITY ? 1.0f : exp2f(m_run[h] - m_new);
      m_run[h] = m_new;
      refs.set(h, m_new);
      l_run[h] *= alpha[h];
    }
#pragma unroll
    for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[m][e] *= alpha[e & 1];
    }
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) s[e] = exp2_ftz(s[e] - refs.ref(m_run, e & 1));
  l_run[0] += s[0] + s[2];
  l_run[1] += s[1] + s[3];
  __half2 h0 = __floats2half2_rn(s[0], s[1]);  // token r, heads 2c, 2c+1
  __half2 h1 = __floats2half2_rn(s[2], s[3]);  // token r + 8
  pb[0] = movmatrix_trans(*reinterpret_cast<uint32_t*>(&h0));
  pb[1] = movmatrix_trans(*reinterpret_cast<uint32_t*>(&h1));
}

// (3) O^T += V^T.P^T from the staged V code words vw and the token pairs' half2 scales vs2 (load_v): tokens (2c,
// 2c+1) and (2c+8, 2c+9); d rows r, r + 8 of M tile m are elements 2m, 2m + 1 of this lane's head_dim block.
template <int D>
__device__ __forceinline__ void swapped_pv(const uint32_t (&vw)[4][Geo<D>::kVWords], const uint32_t (&vs2)[2],
                                           const uint32_t (&pb)[2], float (&o)[D / 16][4]) {
#pragma unroll
  for (int wi = 0; wi < Geo<D>::kVWords; ++wi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint32_t hb[2], lb[2];
      expand_v_pairs<D>(vw, wi, half, hb, lb);
      // element j = 8 wi + 4 half + n of the block: n = 0 (lb, lo), 1 (hb, lo), 2 (lb, hi), 3 (hb, hi);
      // M tile j0 / 2 takes elements j0, j0 + 1, M tile j0 / 2 + 1 takes j0 + 2, j0 + 3
      const int m0 = (8 * wi + 4 * half) / 2;
      const uint32_t a0[4] = {dequant_pair(lb[0], kPairLo, vs2[0]), dequant_pair(hb[0], kPairLo, vs2[0]),
                              dequant_pair(lb[1], kPairLo, vs2[1]), dequant_pair(hb[1], kPairLo, vs2[1])};
      mma_f16(o[m0], a0, pb[0], pb[1]);
      const uint32_t a1[4] = {dequant_pair(lb[0], kPairHi, vs2[0]), dequant_pair(hb[0], kPairHi, vs2[0]),
                              dequant_pair(lb[1], kPairHi, vs2[1]), dequant_pair(hb[1], kPairHi, vs2[1])};
      mma_f16(o[m0 + 1], a1, pb[0], pb[1]);
    }
  }
}

// The swapped-operand kernels' Q^T B fragments of head r of KV head kv_head (k-step ks: qb[ks][0] for k = 2c, 2c + 1,
// qb[ks][1] for k = 2c + 8, 2c + 9; Q scaled by the row's power of two, SPEC 8) and the score scales of heads 2c and
// 2c + 1.
template <int D>
__device__ __forceinline__ void swapped_q_fragments(const DecodeParams& p, int b, int kv_head, int r, int c,
                                                    uint32_t (&qb)[Geo<D>::kKSteps][2], float (&head_scale)[2]) {
  float qv[D / 4];
  const float amax = load_q_quarter<D>(p, b, kv_head, r, c, qv);
  const int e2 = q_row_exponent(amax);
  const float up = exp2_exact(e2);
  const float rs = __fmul_rn(p.score_scale, exp2_exact(-e2));  // head r's score scale
#pragma unroll
  for (int e = 0; e < D / 4; ++e) qv[e] = __fmul_rn(qv[e], up);
#pragma unroll
  for (int ks = 0; ks < Geo<D>::kKSteps; ++ks) {
    const uint2 f = q_frag<D>(qv, ks);
    qb[ks][0] = f.x;
    qb[ks][1] = f.y;
  }
  head_scale[0] = __shfl_sync(0xffffffffu, rs, 8 * c);      // lane of head 2c (r = 2c, c = 0)
  head_scale[1] = __shfl_sync(0xffffffffu, rs, 8 * c + 4);  // head 2c + 1
}

// One swapped-operand tile step over the stage st (tokens t0 .. t0 + 15, the split ends at end): S^T = K.Q^T, the
// online softmax, O^T += V^T.P^T, with this thread's K / V code and scale offsets inside the stage.
template <int D, class Refs>
__device__ __forceinline__ void swapped_tile(const uint8_t* st, const int (&k_off)[2], const int (&ks_off)[2],
                                             const int (&v_off)[4], const int (&vs_off)[4],
                                             const uint32_t (&qb)[Geo<D>::kKSteps][2], const float (&head_scale)[2],
                                             int t0, int end, int r, float (&m_run)[2], Refs& refs,
                                             float (&l_run)[2], float (&o)[D / 16][4]) {
  float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  {
    uint32_t w[2][Geo<D>::kKWords];
    uint32_t sc[2][Geo<D>::kKWords];  // half2 (s, s) per word
    load_k<D>(st, k_off, ks_off, w, sc);
    swapped_scores<D>(w, sc, qb, s);
  }
  uint32_t pb[2];
  swapped_softmax<D / 16>(s, head_scale, t0, end, r, m_run, refs, l_run, o, pb);
  {
    uint32_t vw[4][Geo<D>::kVWords];
    uint32_t vs2[2];
    load_v<D>(st, v_off, vs_off, vw, vs2);
    swapped_pv<D>(vw, vs2, pb, o);
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads, kMinBlocksSwap) fp4kv_decode_kernel_g8(const DecodeParams p) {
  using G = Geo<D>;
  constexpr int kMTiles = D / 16;  // M tiles of O^T
  extern __shared__ __align__(128) uint8_t smem[];

  const int split = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane / 4, c = lane % 4;  // MMA fragment row / column group

  const SplitTiles sp = split_tiles(p, split, b, warp);
  const int start = sp.start, end = sp.end, my_tiles = sp.my_tiles;

  float o[kMTiles][4];  // O^T: [m][0] (d row r, head 2c), [1] (r, 2c + 1), [2] (r + 8, 2c), [3] (r + 8, 2c + 1)
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) o[m][0] = o[m][1] = o[m][2] = o[m][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY};  // heads 2c, 2c + 1
  RunRefsRecomputed refs;
  float l_run[2] = {0.0f, 0.0f};

  uint8_t* wsmem = smem + warp * kStages * G::kStageBytes;
  WarpLoader<D> ld{p.k_codes, p.v_codes, p.k_scales, p.v_scales, p.block_table + (int64_t)b * p.max_pages,
                   p.page_size, p.heads_kv, kv_head, lane};
  auto tile_start = [&](int i) { return start + (warp + kWarps * i) * kTile; };
  ld.init(tile_start(0));
  ld.prepare();
  const uint32_t wsmem_addr = smem_addr(wsmem);

  int2 next_ps = pipeline_prologue<D>(ld, wsmem_addr, tile_start, end, my_tiles);

  // ---- Q^T fragments of head r (same scaling and head_dim permutation as the kernel above) ----
  uint32_t qb[G::kKSteps][2];
  float head_scale[2];  // score scale of heads 2c, 2c + 1
  swapped_q_fragments<D>(p, b, kv_head, r, c, qb, head_scale);

  // Per-thread shared-memory offsets inside a stage, as in the kernel above.
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
    const int voff = r * G::kVBytes;
    v_off[k] = G::kCodeTile + code_offset<D>(t, voff / 16) + voff % 16;
    vs_off[k] = 2 * G::kCodeTile + G::kScaleTile + t * G::kScaleBytes + r * (D / 8) / kNvfp4Block;
  }

  for (int i = 0; i < my_tiles; ++i) {
    pipeline_step<D>(ld, wsmem_addr, tile_start, i, end, my_tiles, next_ps);
    const uint8_t* st = wsmem + (i % kStages) * G::kStageBytes;
    const int t0 = tile_start(i);

    // ---- S^T = K.Q^T, the online softmax, O^T += V^T.P^T (the swapped-operand tile step) ----
    swapped_tile<D>(st, k_off, ks_off, v_off, vs_off, qb, head_scale, t0, end, r, m_run, refs, l_run, o);
    __syncwarp();
  }
  cp_async_wait<0>();

  // ---- combine the 4 warps' (m, l, O) in shared memory (layout of the kernel above, heads 0..7 only) ----
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 4);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 8);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 16);
  }
  __syncthreads();
  const CombineSmem cs = combine_smem(smem);
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int head = 2 * c + (e & 1);
      const int j = 2 * m + (e >> 1);  // d = r * D/8 + j
      cs.o[(warp * kMaxGroup + head) * kOStride + r * kOGroup + j] = o[m][e];
    }
  }
  if (r == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      cs.m[warp * kMaxGroup + 2 * c + h] = m_run[h];
      cs.l[warp * kMaxGroup + 2 * c + h] = l_run[h];
    }
  }
  __syncthreads();
  merge_warps<D>(p, cs.o, cs.m, cs.l, split, kv_head, b);
}

// A register the compiler must keep: ptxas otherwise rematerializes thread-id-derived offsets (swizzle math,
// ~20 instructions) inside the main loop under the register cap of 5 CTAs per SM.
__device__ __forceinline__ uint32_t pinned(uint32_t x) {
  uint32_t y;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ const uint8_t* pinned_ptr(const uint8_t* x) {
  const uint8_t* y;
  asm volatile("mov.b64 %0, %1;\n" : "=l"(y) : "l"(x));
  return y;
}

}  // namespace
}  // namespace trace_ext
