// The flat-stream decode GEMM kernel (dense and grouped; the decode kernel wherever the K-slab kernel does not run):
// CTA constants of the decode layout, the activation fragment loads, the per-warp stream ranges and their ticketed
// end (stream_reduce_shared, shared with the pair kernel), and gemm_w4_decode_stream_kernel.
// Part of the small-M decode GEMM translation unit: csrc/gemm_w4_decode_sm90.cu includes it and holds the design notes
// and the host side (launchers, the TRACE_EXT_DECODE_IMPL dispatch).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "trace_ext/fp4_numerics.cuh"
#include "trace_ext/gemm_w4_common.cuh"
#include "trace_ext/gemm_w4_decode_units.cuh"

namespace trace_ext {
namespace gemm_w4 {

constexpr int kDecWarps = 8;
constexpr int kDecThreads = kDecWarps * 32;
constexpr int kSuperK = 256;                       // K per packed super-tile
constexpr int kTileBytes = 16 * kSuperK / 2 + 16 * kSuperK / 16;  // 2304
constexpr int kCodeBytes = 16 * kSuperK / 2;       // 2048
static_assert(kTileBytes == 2304 && kCodeBytes == 2048, "packed super-tile layout (reference_gemm.to_decode_layout)");

// decode_word (one decode-layout word -> bf16x2 of pairs 0..3): trace_ext/gemm_w4_common.cuh (shared with the
// kslab kernel of gemm_w4_decode_kslab_sm90.cu).

// decode_word2 (the second packed form) and decode_word_form<kForm2>: trace_ext/gemm_w4_common.cuh as well.


// Activation fragments of lane (g, t) for one 64-K step: rows m0 + 8i + g (i < MT8), elements
// k .. k + 15 (contiguous, see the k-slot permutation above) as 8 bf16x2 registers per row; bf16 activations are
// loaded as they are, FP4 ones (W4A4) converted to bf16 q * s * 2^-7. Rows at or past m_hi are zero.
template <int MT8, bool kAFp4>
__device__ __forceinline__ void load_act_frags(const GemmParams& p, int K, int k, int m0, int m_hi, int g,
                                               uint32_t (&bq)[MT8][8]) {
#pragma unroll
  for (int i = 0; i < MT8; ++i) {
    const int m = m0 + 8 * i + g;
    if (m < m_hi) {
      if constexpr (!kAFp4) {
        const uint4* src =
            reinterpret_cast<const uint4*>(reinterpret_cast<const __nv_bfloat16*>(p.a) + (int64_t)m * K + k);
        const uint4 x0 = __ldg(src), x1 = __ldg(src + 1);
        bq[i][0] = x0.x; bq[i][1] = x0.y; bq[i][2] = x0.z; bq[i][3] = x0.w;
        bq[i][4] = x1.x; bq[i][5] = x1.y; bq[i][6] = x1.z; bq[i][7] = x1.w;
      } else {
        const uint8_t* ac = reinterpret_cast<const uint8_t*>(p.a) + (int64_t)m * (K / 2) + k / 2;
        const uint2 c = __ldg(reinterpret_cast<const uint2*>(ac));
        const uint32_t sc = scale_bf16x2_folded(__ldg(p.a_scales + (int64_t)m * (K / 16) + k / 16));
        const uint32_t cw[2] = {c.x, c.y};
#pragma unroll
        for (int j = 0; j < 8; ++j)
          bq[i][j] = bf16x2_mul(fp4x2_to_bf16x2_biased((cw[j >> 2] >> (8 * (j & 3))) & 0xFFu), sc);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) bq[i][j] = 0u;
    }
  }
}

// ---- dense: flat per-warp weight streams (default dense path) -------------------------------------------------
// The packed tiles of a dense weight are stored nb-major ((nb * KT + kt) * kTileBytes), so the flat tile index
// j = nb * KT + kt is also the byte order. Warp w of the grid (W warps, one resident wave) streams tiles
// [T * w / W, T * (w + 1) / W) of the T = n_blocks * KT tiles: one contiguous byte range per warp, equal shares
// (+-1 tile) whatever N and K are, and the warp's cp.async ring stays full across 16-row block boundaries. A
// block covered by one warp is finished by it; a block shared by several warps gets one fp32 partial per warp
// (fragment layout, slot 2w + (warp started before the block)), and the last of them to arrive (one ticket per
// block, self-resetting) adds them in warp order, i.e. in K order (deterministic). Arrivals come after the whole
// stream (one fence per warp, no CTA barrier anywhere), so the fence never drains a ring that is still needed.
__device__ __forceinline__ int stream_warp_of(int64_t j, int64_t T, int W) {  // the warp whose range holds tile j
  return (int)(((j + 1) * W - 1) / T);
}
__device__ __forceinline__ int64_t stream_first_tile(int w, int64_t T, int W) { return T * w / W; }

// A segment's end in the stream and pair kernels: the warp's partial of a shared 16-row block (MT8 fragments of 4
// floats per lane) goes to its slot dst (lane-strided, the layout stream_reduce_shared reads), then the accumulators
// restart at zero.
template <int MT8>
__device__ __forceinline__ void stash_partial(float* dst, const float (&v)[MT8][4]) {
#pragma unroll
  for (int i = 0; i < MT8; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) __stcg(dst + (i * 4 + c) * 32, v[i][c]);
}
// A-fragment registers of one 64-K step (MT8 8-row groups), copied (the hoisted-A kernels' per-step and per-item
// moves).
template <int MT8>
__device__ __forceinline__ void copy_frags(uint32_t (&dst)[MT8][8], const uint32_t (&src)[MT8][8]) {
#pragma unroll
  for (int i = 0; i < MT8; ++i)
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) dst[i][jj] = src[i][jj];
}
template <int MT8>
__device__ __forceinline__ void zero_frags(float (&v)[MT8][4]) {
#pragma unroll
  for (int i = 0; i < MT8; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) v[i][c] = 0.f;
}

// The end of a flat stream (stream and pair kernels): for each of the warp's shared work units b (pending0 / pending1,
// < 0: none; a unit = NB 16-row blocks of KT tiles), arrive (one acq_rel ticket per unit, after all of this warp's
// partial stores) and, in the last warp to arrive, add the partials of its warps in warp order (= K order) and
// store_y(b, v). Partials: ws[(2 ww + slot) * NB * MT8 * 4 * 32 + ...], slot 1 for a warp that started in an earlier
// unit (the fragment layout of the stores before).
template <int NB, int MT8, typename TileCount, typename StoreY>
__device__ __forceinline__ void stream_reduce_shared(int pending0, int pending1, int KT, TileCount T, int W,
                                                     int lane, int* tickets, const float* ws, StoreY&& store_y) {
  constexpr int kFrag = NB * MT8 * 4;  // fp32 accumulators per lane
  if (pending0 < 0 && pending1 < 0) return;
  __syncwarp();
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int b = q == 0 ? pending0 : pending1;
    if (b < 0) continue;
    const int wf = stream_warp_of((int64_t)b * KT, T, W), wl = stream_warp_of((int64_t)b * KT + KT - 1, T, W);
    int last = 0;
    if (lane == 0) {
      int ticket;
      // release: this warp's partial stores (ordered before lane 0 by the warp barrier) before the ticket
      asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], 1;\n" : "=r"(ticket) : "l"(tickets + b) : "memory");
      last = ticket == wl - wf;
      if (last) tickets[b] = 0;  // self-reset for the next launch on this stream
    }
    last = __shfl_sync(0xffffffffu, last, 0);
    if (!last) continue;
    // acquire (lane 0's acq_rel atomic, then the warp barrier): the other warps' partials are visible in L2
    __syncwarp();
    float v[NB][MT8][4];
#pragma unroll
    for (int bb = 0; bb < NB; ++bb) zero_frags(v[bb]);
    for (int ww = wf; ww <= wl; ++ww) {
      const int slot = stream_first_tile(ww, T, W) < (int64_t)b * KT ? 1 : 0;  // started in an earlier unit
      const float* src = ws + ((int64_t)ww * 2 + slot) * (kFrag * 32) + lane;
#pragma unroll
      for (int bb = 0; bb < NB; ++bb)
#pragma unroll
        for (int i = 0; i < MT8; ++i)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            v[bb][i][c] = __fadd_rn(v[bb][i][c], __ldcg(src + ((bb * MT8 + i) * 4 + c) * 32));
    }
    store_y(b, v);
  }
}

template <int MT8, bool kAFp4, int kStages, int kMinBlocks, bool kGrouped, bool kForm2>
__global__ void __launch_bounds__(kDecThreads, kMinBlocks)
    gemm_w4_decode_stream_kernel(const GemmParams p, float* __restrict__ ws, int* __restrict__ tickets, int n_warps) {
  static_assert(kStages >= 2, "a cp.async ring needs at least 2 slots");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ != 900
  if constexpr (kForm2) return;  // second packed form: sm_90a-only experiment (the host raises on other devices)
#endif
  constexpr int kFrag = MT8 * 4;  // fp32 accumulators per lane
  constexpr int R = 8 * MT8;      // rows of a unit (grouped: an expert with more rows is several units)
  // [warp][kStages][kTileBytes] rings, then (grouped) s_pref[E + 1]: units of the experts before e
  extern __shared__ __align__(16) uint8_t dec_ring[];
  int* const s_pref = reinterpret_cast<int*>(dec_ring + kDecWarps * kStages * kTileBytes);
  const int warp_id = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int K = p.K, N = p.N;
  const int KT = K / kSuperK;
  const int n_blocks = N / 16;
  const int Tu = n_blocks * KT;  // tiles of one unit (< 2^31, checked on the host)
  const int64_t exp_bytes = (int64_t)Tu * kTileBytes;  // one expert's packed weight
  int n_units = 1;
  if constexpr (kGrouped) {
    // units = (expert with rows, chunk of R rows), numbered expert by expert (gemm_w4_decode_units.cuh)
    __shared__ int s_wsum[kDecWarps];
    // at most the host's bound (launch_decode: its tickets and workspace), which holds for offsets that rise within
    // [0, M]; unchecked offsets that do not (validate=False) lose units past it instead of writing out of bounds
    n_units = min(decode_number_units<kDecWarps, R>(p, s_pref, s_wsum), min(p.E, p.M) + p.M / R + 1);
    if (threadIdx.x == 0) s_pref[p.E] = n_units;
    __syncthreads();
  }
  // unit u -> its expert (grouped: the last expert e with s_pref[e] <= u, which has rows) and its rows
  auto unit_expert = [&](int u) {
    if constexpr (!kGrouped) {
      return 0;
    } else {
      return decode_unit_expert(p, s_pref, u);
    }
  };
  auto unit_rows = [&](int u, int e, int& r_lo, int& r_hi) {
    if constexpr (!kGrouped) {
      r_lo = 0;
      r_hi = p.M;
    } else {
      decode_unit_rows<R>(p, s_pref, u, e, r_lo, r_hi);
    }
  };
  const int64_t T = (int64_t)n_units * Tu;
  // at most one warp per 2 tiles, never more warps than tiles (the ticket counts rely on every warp owning one)
  const int W = (int)min((int64_t)n_warps, max((int64_t)1, T / 2));
  const int w = blockIdx.x * kDecWarps + warp_id;
  if (T == 0 || w >= W) return;  // warp-uniform; no barrier below
  const int j0 = (int)stream_first_tile(w, T, W), j1 = (int)stream_first_tile(w + 1, T, W);  // T < 2^31
  const float fold = kAFp4 ? kUnfoldW4A4 : kUnfoldW4A16;
  uint8_t* const ring = dec_ring + warp_id * kStages * kTileBytes;

  // tile j -> ring slot (j - j0) % kStages; each lane copies and reads back only its own 72 bytes, so
  // cp.async.wait_group alone orders copy before read (no barrier)
  // issue cursor: tile loc_i of unit u_i (weights of expert unit_expert(u_i) at wb_i)
  int j_issue = j0;
  int slot_issue = 0;
  int u_i = j0 / Tu, loc_i = j0 - u_i * Tu;
  const uint8_t* wb_i = p.w_packed + (kGrouped ? unit_expert(u_i) * exp_bytes : 0);
  auto issue_next = [&]() {
    if (j_issue < j1) {
      const uint8_t* src = wb_i + (int64_t)loc_i * kTileBytes;
      uint8_t* dst = ring + slot_issue * kTileBytes;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) cp_async16(dst + kk * 512 + lane * 16, src + kk * 512 + lane * 16, true);
      cp_async8(dst + kCodeBytes + lane * 8, src + kCodeBytes + lane * 8, true);
      if (++loc_i == Tu) {  // next unit
        loc_i = 0;
        ++u_i;
        if (kGrouped && j_issue + 1 < j1) wb_i = p.w_packed + unit_expert(u_i) * exp_bytes;
      }
    }
    cp_async_commit();  // possibly empty: one group per tile for wait_group
    ++j_issue;
    slot_issue = slot_issue + 1 == kStages ? 0 : slot_issue + 1;
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue_next();

  float acc[MT8][4];
  zero_frags(acc);

  // y = bf16(sum * fold * g_a[m] * g_w[e, n]) for the lane's fragment of global block b (unit b / n_blocks)
  auto store_y = [&](int b, const float (&v)[MT8][4]) {
    const int u = b / n_blocks, nbl = b - u * n_blocks;
    const int e = unit_expert(u);
    int r_lo, r_hi;
    unit_rows(u, e, r_lo, r_hi);
    const float* gw = p.g_w + (int64_t)e * p.gw_stride_e;
#pragma unroll
    for (int i = 0; i < MT8; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int n = nbl * 16 + g + (c >> 1) * 8, m = r_lo + 8 * i + 2 * t + (c & 1);
        if (m >= r_hi) continue;
        const float ga = p.g_a != nullptr ? p.g_a[m] : 1.0f;
        const float y = __fmul_rn(__fmul_rn(v[i][c], fold), __fmul_rn(ga, gw[(int64_t)n * p.gw_stride_n]));
        p.y[(int64_t)m * N + n] = __float2bfloat16_rn(y);
      }
  };

  // compute cursor: global block nb (= unit * n_blocks + block in the unit), k tile kt; rows of its unit
  int nb = j0 / KT, kt = j0 - nb * KT;
  int nbl = nb % n_blocks, u_c = nb / n_blocks;
  int r_lo, r_hi;
  unit_rows(u_c, unit_expert(u_c), r_lo, r_hi);
  const int kt_first = kt;          // first k tile of the warp's first block
  int pending0 = -1, pending1 = -1;  // blocks whose partial this warp wrote (slot 0: first block, 1: last block)
  int slot_rd = 0;
  for (int j = j0; j < j1; ++j) {
    auto load_a = [&](int kk, uint32_t (&bq)[MT8][8]) {
      load_act_frags<MT8, kAFp4>(p, K, kt * kSuperK + kk * 64 + 16 * t, r_lo, r_hi, g, bq);
    };
    // up to 8 rows of bf16: the tile's activation fragments (4 x 8 registers) are loaded before the wait for its
    // weights, so that their latency (L1 / L2 hits) overlaps it
    constexpr bool kHoistA = MT8 == 1 && !kAFp4 && !kGrouped;  // (grouped: no registers left)
    uint32_t bqh[kHoistA ? 4 : 1][MT8][8];
    if constexpr (kHoistA) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) load_a(kk, bqh[kk]);
    }
    asm volatile("" ::: "memory");  // the reads of the slot refilled here (previous tile) stay before it
    issue_next();
    cp_async_wait<kStages - 1>();   // the group of tile j is complete
    asm volatile("" ::: "memory");  // and the reads below stay after the wait
    const uint8_t* const srd = ring + slot_rd * kTileBytes;
    slot_rd = slot_rd + 1 == kStages ? 0 : slot_rd + 1;
    const uint2 sv = *reinterpret_cast<const uint2*>(srd + kCodeBytes + lane * 8);

    constexpr int kKkUnroll = MT8 >= 4 ? 1 : 4 / MT8;  // 16 / 32 rows: 2 / 1 64-K steps per trip (no spills)
#pragma unroll kKkUnroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t bq[MT8][8];
      if constexpr (kHoistA) {
        copy_frags(bq, bqh[kk]);
      } else {
        load_a(kk, bq);
      }
      const uint32_t sw = kk < 2 ? sv.x : sv.y;
      const uint4 wq = *reinterpret_cast<const uint4*>(srd + kk * 512 + lane * 16);
      decode_mma_step<MT8, kForm2>(wq, sw, kk, bq, acc);
    }

    // ---- end of a block segment: the whole block -> Y; part of it -> partial slot
    if (kt == KT - 1 || j == j1 - 1) {
      const bool first_seg = nb * KT <= j0;  // the warp's first block
      if (kt == KT - 1 && (!first_seg || kt_first == 0)) {
        store_y(nb, acc);
      } else {
        float* dst = ws + ((int64_t)w * 2 + (first_seg ? 0 : 1)) * (kFrag * 32) + lane;
        stash_partial(dst, acc);
        if (first_seg) pending0 = nb; else pending1 = nb;
      }
      zero_frags(acc);
      ++nb;
      kt = 0;
      if (++nbl == n_blocks) {  // next unit
        nbl = 0;
        ++u_c;
        if (kGrouped && j + 1 < j1) unit_rows(u_c, unit_expert(u_c), r_lo, r_hi);
      }
    } else {
      ++kt;
    }
  }
  cp_async_wait<0>();  // no copy outlives the kernel's shared memory

  // ---- shared blocks: arrive, the last warp reduces in warp order
  stream_reduce_shared<1, MT8>(pending0, pending1, KT, T, W, lane, tickets, ws,
                               [&](int b, const float (&v)[1][MT8][4]) { store_y(b, v[0]); });
}

}  // namespace gemm_w4
}  // namespace trace_ext
