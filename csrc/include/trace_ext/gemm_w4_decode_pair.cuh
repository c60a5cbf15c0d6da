// The pair-stream decode GEMM kernel (dense; items of two, or four for quad3, adjacent 16-row blocks at one 256-K
// super-tile): the default where the K-slab kernel does not run and decode_prefers_pair holds, or named by
// TRACE_EXT_DECODE_IMPL=pair / pair2 / pair3 / quad3.
// Part of the small-M decode GEMM translation unit: csrc/gemm_w4_decode_sm90.cu includes it and holds the design notes
// and the host side (launchers, the TRACE_EXT_DECODE_IMPL dispatch).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "trace_ext/fp4_numerics.cuh"
#include "trace_ext/gemm_w4_common.cuh"
#include "trace_ext/gemm_w4_decode_units.cuh"
#include "trace_ext/gemm_w4_decode_stream.cuh"

namespace trace_ext {
namespace gemm_w4 {

// ---- dense, opt-in (TRACE_EXT_DECODE_IMPL=pair, read per call): flat streams of 16-row block PAIRS ------------
// Same flat per-warp streams as above, but the unit of work is an item = (pair of adjacent 16-row blocks, 256-K
// super-tile): both tiles (2 x 2304 B, KT * 2304 B apart) go into one ring slot, each activation fragment is loaded
// once per item and used by both blocks (half the activation traffic per weight: at M = 8..32 and K = 4096 the
// fragments of one tile are 4-16 KB through L1 / L2 against 2.3 KB of weights), and each warp runs two independent
// MMA accumulator chains (the default's 16 MMAs per tile all chain on one accumulator at M <= 8). Half the
// per-item bookkeeping (ring cursor, waits, segment ends) per weight. Items j = group * KT + kt, warp w streams
// items [T w / W, T (w + 1) / W); shared groups are reduced exactly as in the stream kernel (partials per warp,
// one self-resetting ticket per group, the last warp adds them in warp order = K order). Dense only; needs
// N % 32 == 0 (else the default runs).
constexpr int kPairNB = 2;

// kPrefA (bf16 activations; needs the 128 registers of 2 CTAs per SM): <= 8 rows: the next item's activation
// fragments (4 x 8 registers) are loaded while this item is converted and multiplied; <= 16 rows: those of the
// next 64-K step (2 x 8), so that no L1 / L2 latency is exposed per item / step; otherwise they are loaded per
// 64-K step right before use.
// kForm2: the second packed form (decode_word2). kNB: 16-row blocks per item (2: pair; 4: quad3, each activation
// fragment used by 4 blocks, a quarter of the default's activation traffic per weight).
template <int MT8, bool kAFp4, int kStages, int kMinBlocks, bool kPrefA, bool kForm2, int kNB>
__global__ void __launch_bounds__(kDecThreads, kMinBlocks)
    gemm_w4_decode_pair_kernel(const GemmParams p, float* __restrict__ ws, int* __restrict__ tickets, int n_warps) {
  static_assert(kStages >= 2, "a cp.async ring needs at least 2 slots");
  static_assert(kNB == 2 || kNB == 4, "items of 2 or 4 adjacent 16-row blocks");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ != 900
  if constexpr (kForm2) return;  // second packed form: sm_90a-only experiment (the host raises on other devices)
#endif
  constexpr int NB = kNB;
  constexpr int kFrag = NB * MT8 * 4;           // fp32 accumulators per lane
  constexpr int kItemBytes = NB * kTileBytes;   // one ring slot
  extern __shared__ __align__(16) uint8_t dec_ring[];  // [warp][kStages][NB][kTileBytes]
  const int warp_id = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int K = p.K, N = p.N;
  const int KT = K / kSuperK;
  const int n_groups = N / (16 * NB);
  const int T = n_groups * KT;  // items (< 2^31, checked on the host)
  const int W = min(n_warps, T);  // never more warps than items (the ticket counts rely on every warp owning one)
  const int w = blockIdx.x * kDecWarps + warp_id;
  if (T == 0 || w >= W) return;  // warp-uniform; no barrier below
  const int j0 = (int)stream_first_tile(w, T, W), j1 = (int)stream_first_tile(w + 1, T, W);
  const float fold = kAFp4 ? kUnfoldW4A4 : kUnfoldW4A16;
  const int64_t blk_bytes = (int64_t)KT * kTileBytes;  // block 2 gb -> 2 gb + 1
  uint8_t* const ring = dec_ring + warp_id * kStages * kItemBytes;

  // issue cursor: item j_issue = gb_i * KT + kt_i; each lane copies and later reads back only its own bytes
  int j_issue = j0, slot_issue = 0;
  int gb_i = j0 / KT, kt_i = j0 - gb_i * KT;
  auto issue_next = [&]() {
    if (j_issue < j1) {
      const uint8_t* src = p.w_packed + ((int64_t)gb_i * NB * KT + kt_i) * kTileBytes;
      uint8_t* dst = ring + slot_issue * kItemBytes;
#pragma unroll
      for (int b = 0; b < NB; ++b) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          cp_async16(dst + b * kTileBytes + kk * 512 + lane * 16, src + b * blk_bytes + kk * 512 + lane * 16, true);
        cp_async8(dst + b * kTileBytes + kCodeBytes + lane * 8, src + b * blk_bytes + kCodeBytes + lane * 8, true);
      }
      if (++kt_i == KT) {
        kt_i = 0;
        ++gb_i;
      }
    }
    cp_async_commit();  // possibly empty: one group per item for wait_group
    ++j_issue;
    slot_issue = slot_issue + 1 == kStages ? 0 : slot_issue + 1;
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue_next();

  float acc[NB][MT8][4];
#pragma unroll
  for (int b = 0; b < NB; ++b) zero_frags(acc[b]);

  auto store_y = [&](int gb, const float (&v)[NB][MT8][4]) {
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int i = 0; i < MT8; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int n = (gb * NB + b) * 16 + g + (c >> 1) * 8, m = 8 * i + 2 * t + (c & 1);
          if (m >= p.M) continue;
          const float ga = p.g_a != nullptr ? p.g_a[m] : 1.0f;
          const float y = __fmul_rn(__fmul_rn(v[b][i][c], fold), __fmul_rn(ga, p.g_w[(int64_t)n * p.gw_stride_n]));
          p.y[(int64_t)m * N + n] = __float2bfloat16_rn(y);
        }
  };

  int gb = j0 / KT, kt = j0 - gb * KT;  // compute cursor
  const int kt_first = kt;
  int pending0 = -1, pending1 = -1;  // groups whose partial this warp wrote (slot 0: first group, 1: last group)
  int slot_rd = 0;
  // activation fragments of one 64-K step, super-tile kt_a (dense: they depend on kt only)
  auto load_a_kt = [&](int kt_a, int kk, uint32_t (&bq)[MT8][8]) {
    load_act_frags<MT8, kAFp4>(p, K, kt_a * kSuperK + kk * 64 + 16 * t, 0, p.M, g, bq);
  };
  constexpr bool kHoistA = kPrefA && MT8 == 1 && !kAFp4;  // whole next item ahead (4 x 8 registers)
  constexpr bool kStepA = kPrefA && MT8 == 2 && !kAFp4;   // one 64-K step ahead (2 x 8 registers)
  static_assert(!kPrefA || kHoistA || kStepA, "activation prefetch: <= 16 rows of bf16 only");
  uint32_t bqh[kHoistA ? 4 : 1][MT8][8];  // this item's fragments (kHoistA)
  if constexpr (kHoistA) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) load_a_kt(kt, kk, bqh[kk]);
  }
  uint32_t bqs[MT8][8];  // the next 64-K step's fragments (kStepA), in flight during this step
  if constexpr (kStepA) load_a_kt(kt, 0, bqs);
  for (int j = j0; j < j1; ++j) {
    auto load_a = [&](int kk, uint32_t (&bq)[MT8][8]) { load_a_kt(kt, kk, bq); };
    uint32_t bqn[kHoistA ? 4 : 1][MT8][8];  // the next item's fragments, in flight during this item
    if constexpr (kHoistA) {
      const int kt_n = kt + 1 == KT ? 0 : kt + 1;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) load_a_kt(kt_n, kk, bqn[kk]);
    }
    asm volatile("" ::: "memory");  // the reads of the slot refilled here (previous item) stay before it
    issue_next();
    cp_async_wait<kStages - 1>();   // the group of item j is complete
    asm volatile("" ::: "memory");  // and the reads below stay after the wait
    const uint8_t* const srd = ring + slot_rd * kItemBytes;
    slot_rd = slot_rd + 1 == kStages ? 0 : slot_rd + 1;
    uint2 sv[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) sv[b] = *reinterpret_cast<const uint2*>(srd + b * kTileBytes + kCodeBytes + lane * 8);

    constexpr int kKkUnroll = MT8 >= 2 ? 1 : 4;
#pragma unroll kKkUnroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t bq[MT8][8];
      if constexpr (kHoistA) {
        copy_frags(bq, bqh[kk]);
      } else if constexpr (kStepA) {
#pragma unroll
        for (int i = 0; i < MT8; ++i)
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) bq[i][jj] = bqs[i][jj];
        // next step: this item's kk + 1, or step 0 of the next item (whose k tile follows kt; past the warp's last
        // item the loads are in range and unused)
        if (kk < 3) {
          load_a(kk + 1, bqs);
        } else {
          load_a_kt(kt + 1 == KT ? 0 : kt + 1, 0, bqs);
        }
      } else {
        load_a(kk, bq);
      }
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        const uint32_t sw = kk < 2 ? sv[b].x : sv[b].y;
        const uint4 wq = *reinterpret_cast<const uint4*>(srd + b * kTileBytes + kk * 512 + lane * 16);
        decode_mma_step<MT8, kForm2>(wq, sw, kk, bq, acc[b]);
      }
    }

    // ---- end of a group segment: the whole group -> Y; part of it -> partial slot
    if (kt == KT - 1 || j == j1 - 1) {
      const bool first_seg = gb * KT <= j0;  // the warp's first group
      if (kt == KT - 1 && (!first_seg || kt_first == 0)) {
        store_y(gb, acc);
      } else {
        float* dst = ws + ((int64_t)w * 2 + (first_seg ? 0 : 1)) * (kFrag * 32) + lane;
#pragma unroll
        for (int b = 0; b < NB; ++b) stash_partial(dst + b * MT8 * 4 * 32, acc[b]);
        if (first_seg) pending0 = gb; else pending1 = gb;
      }
#pragma unroll
      for (int b = 0; b < NB; ++b) zero_frags(acc[b]);
      ++gb;
      kt = 0;
    } else {
      ++kt;
    }
    if constexpr (kHoistA) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) copy_frags(bqh[kk], bqn[kk]);
    }
  }
  cp_async_wait<0>();  // no copy outlives the kernel's shared memory

  // ---- shared groups: arrive, the last warp reduces in warp order
  stream_reduce_shared<NB, MT8>(pending0, pending1, KT, T, W, lane, tickets, ws, store_y);
}

}  // namespace gemm_w4
}  // namespace trace_ext
