// Units of grouped (MoE) decode for the grouped K-slab kernel (gemm_w4_decode_kslab_sm90.cu) and the grouped stream
// kernel (gemm_w4_decode_sm90.cu): a unit is (expert with rows, chunk of R rows), numbered expert by expert on the
// device, so empty experts cost nothing and an expert with more than R rows is several units.
//  - decode_number_units: one block-wide scan of the offsets; s_pref[e] = units of the experts before e (e < E);
//    returns the unit count (every thread). Offsets are clamped to [0, M] and made non-decreasing, as everywhere.
//  - decode_unit_expert: unit u -> the last expert e with s_pref[e] <= u (it has rows), by binary search.
//  - decode_unit_rows: the rows r_lo .. r_hi - 1 of unit u of expert e.
#pragma once

#include <cuda_runtime.h>

#include "trace_ext/gemm_w4_common.cuh"

namespace trace_ext {
namespace gemm_w4 {

// kWarps: warps of the block (all of them call it); s_wsum: kWarps ints of shared memory for the per-warp sums
template <int kWarps, int R>
__device__ __forceinline__ int decode_number_units(const GemmParams& p, int* s_pref, int* s_wsum) {
  const int warp_id = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int base = 0;
  for (int c0 = 0; c0 < p.E; c0 += kWarps * 32) {
    const int e = c0 + threadIdx.x;
    int cnt = 0;
    if (e < p.E) {
      const int lo = min(max(p.offsets[e], 0), p.M);
      cnt = (min(max(p.offsets[e + 1], lo), p.M) - lo + R - 1) / R;
    }
    int inc = cnt;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, inc, d);
      if (lane >= d) inc += v;
    }
    if (lane == 31) s_wsum[warp_id] = inc;
    __syncthreads();
    int before = base, total = base;
#pragma unroll
    for (int q = 0; q < kWarps; ++q) {
      before += q < warp_id ? s_wsum[q] : 0;
      total += s_wsum[q];
    }
    if (e < p.E) s_pref[e] = before + inc - cnt;
    __syncthreads();
    base = total;
  }
  return base;
}

__device__ __forceinline__ int decode_unit_expert(const GemmParams& p, const int* s_pref, int u) {
  int lo = 0, hi = p.E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (s_pref[mid] <= u) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <int R>
__device__ __forceinline__ void decode_unit_rows(const GemmParams& p, const int* s_pref, int u, int e, int& r_lo,
                                                 int& r_hi) {
  const int m0 = min(max(p.offsets[e], 0), p.M), m1 = min(max(p.offsets[e + 1], m0), p.M);
  r_lo = m0 + (u - s_pref[e]) * R;
  r_hi = min(m1, r_lo + R);
}

}  // namespace gemm_w4
}  // namespace trace_ext
