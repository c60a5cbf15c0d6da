// FP4 KV-cache decode attention: the split combine kernels (the separate pass after the decode kernel, launched as its
// programmatic dependent).
// Part of the FP4 KV-cache decode attention translation unit: csrc/attn_decode_fp4kv_sm90.cu includes it and holds the
// design notes; the definitions live in that unit's anonymous namespace. (tools/probes/timeline.cu includes it too.)
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "trace_ext/attn_decode_fp4kv_common.cuh"
#include "trace_ext/pdl.cuh"
#include "trace_ext/timeline.cuh"

namespace trace_ext {
namespace {

// Combine the splits of one (sequence, query head): the separate pass (the default; TRACE_EXT_KV_DECODE_COMBINE=fused
// merges them in the decode kernel instead).
template <int D>
__global__ void __launch_bounds__(D) fp4kv_decode_combine_kernel(const float* __restrict__ o_part,
                                                                  const float* __restrict__ lse_part, uint16_t* out,
                                                                  float* lse, int num_splits) {
  TRACE_EXT_TIMELINE_BEGIN(1);  // (probes only: empty in the extension)
  griddep_wait();  // launched as a programmatic dependent of the decode kernel: its partials are complete
  TRACE_EXT_TIMELINE_MARK();
  const int64_t bh = blockIdx.x;
  const int d = threadIdx.x;
  const Combined cmb = combine_splits<D>(o_part, lse_part, bh, d, num_splits);
  __nv_bfloat16 ob = __float2bfloat16_rn(cmb.out);
  out[bh * D + d] = *reinterpret_cast<uint16_t*>(&ob);
  if (d == 0) lse[bh] = cmb.lse;
  TRACE_EXT_TIMELINE_END();
}

// The combine for many splits (heads kernel past kHeadsFusedMax, e.g. B = 1, 2 head groups x ~128 splits): one
// CTA of 4 warps per (sequence, query head); the max LSE by a block reduction, then warp w sums splits w, w + 4,
// ... with a lane owning D/32 consecutive head_dim values (one 16- or 8-byte load per split), and the 4 warps'
// sums are added in shared memory. Same weights 2^(lse_s - max) as combine_splits, summed in a different order
// (so not bit-equal to it): ~n/4 dependent rounds per warp instead of n per thread.
constexpr int kWideWarps = 4;
template <int D>
__global__ void __launch_bounds__(kWideWarps * 32) fp4kv_decode_combine_wide_kernel(const float* __restrict__ o_part,
                                                                                   const float* __restrict__ lse_part,
                                                                                   uint16_t* out, float* lse,
                                                                                   int num_splits) {
  constexpr int kPer = D / 32;  // head_dim values per lane
  static_assert(kPer == 2 || kPer == 4, "a lane loads one float2 / float4 per split");
  using Vec = std::conditional_t<kPer == 4, float4, float2>;
  __shared__ float sm_red[kWideWarps];
  __shared__ float sm_acc[kWideWarps][D];
  __shared__ float sm_l[kWideWarps];
  TRACE_EXT_TIMELINE_BEGIN(1);  // (probes only: empty in the extension)
  griddep_wait();  // launched as a programmatic dependent of the decode kernel: its partials are complete
  TRACE_EXT_TIMELINE_MARK();
  const int64_t bh = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* lp = lse_part + bh * num_splits;
  float m = -INFINITY;
  for (int s = threadIdx.x; s < num_splits; s += kWideWarps * 32) m = fmaxf(m, lp[s]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (lane == 0) sm_red[warp] = m;
  __syncthreads();
  m = fmaxf(fmaxf(sm_red[0], sm_red[1]), fmaxf(sm_red[2], sm_red[3]));
  float l = 0.0f, acc[kPer] = {};
  if (m != -INFINITY) {
#pragma unroll 4
    for (int s = warp; s < num_splits; s += kWideWarps) {
      const float ls = lp[s];
      const Vec v = *reinterpret_cast<const Vec*>(o_part + (bh * num_splits + s) * D + lane * kPer);
      if (ls == -INFINITY) continue;
      const float f = exp2f(ls - m);
      l += f;
      const float* pv = reinterpret_cast<const float*>(&v);
#pragma unroll
      for (int e = 0; e < kPer; ++e) acc[e] += f * pv[e];
    }
  }
#pragma unroll
  for (int e = 0; e < kPer; ++e) sm_acc[warp][lane * kPer + e] = acc[e];
  if (lane == 0) sm_l[warp] = l;
  __syncthreads();
  for (int d = threadIdx.x; d < D; d += kWideWarps * 32) {
    float a = 0.0f, lt = 0.0f;
#pragma unroll
    for (int w = 0; w < kWideWarps; ++w) a += sm_acc[w][d], lt += sm_l[w];
    const bool empty = !(lt > 0.0f);
    __nv_bfloat16 ob = __float2bfloat16_rn(empty ? 0.0f : a / lt);
    out[bh * D + d] = *reinterpret_cast<uint16_t*>(&ob);
    if (d == 0) lse[bh] = empty ? -INFINITY : (m + log2f(lt)) * kLn2;
  }
  TRACE_EXT_TIMELINE_END();
}

}  // namespace
}  // namespace trace_ext
