// SASS probe of the NVFP4 quantize element loops (quantize_elems in csrc/include/trace_ext/quant_nvfp4_blocks.cuh) in
// isolation: one kernel per (rounding mode, implementation) that feeds one block of 16 floats, its divisor and
// reciprocal (and the guidance / Philox inputs) from memory into quantize_elems<MODE, FAST=true, 16, IMPL> and stores
// the two code words, plus a baseline kernel with the same loads and stores only. (count - baseline) / 16 = static instructions per element of
// the loop. Compiled only as an object by tools/sass_quant_elems.sh (it includes the kernel source; never linked).
#include "../csrc/quant_nvfp4.cu"

namespace trace_ext {
namespace {

struct ProbeIn {
  float x[16];
  float t, r;
  uint32_t guide_bits;
  uint2 guide_codes;
};

__device__ __forceinline__ void probe_load(const ProbeIn* in, float (&x)[16], float& t, float& r, uint32_t& gb,
                                           uint2& gc) {
  const ProbeIn* me = in + threadIdx.x;
#pragma unroll
  for (int i = 0; i < 16; ++i) x[i] = me->x[i];
  t = me->t;
  r = me->r;
  gb = me->guide_bits;
  gc = me->guide_codes;
}

__global__ void probe_baseline(const ProbeIn* in, uint2* out) {
  float x[16], t, r;
  uint32_t gb;
  uint2 gc;
  probe_load(in, x, t, r, gb, gc);
  uint32_t a = gb ^ gc.x ^ __float_as_uint(t), b = gc.y ^ __float_as_uint(r);
#pragma unroll
  for (int i = 0; i < 16; ++i) (i < 8 ? a : b) ^= __float_as_uint(x[i]);
  out[threadIdx.x] = make_uint2(a, b);
}

template <int MODE, int IMPL>
__global__ void probe_elems(const ProbeIn* in, const QuantParams p, uint2* out) {
  float x[16], t, r;
  uint32_t gb;
  uint2 gc;
  probe_load(in, x, t, r, gb, gc);
  uint32_t w[2];
  quantize_elems<MODE, true, 16, IMPL>(x, t, r, 4u * threadIdx.x, p, gb, gc, w);
  out[threadIdx.x] = make_uint2(w[0], w[1]);
}

// Referenced once so that every probe is emitted.
__attribute__((used)) const void* const kProbes[] = {
    (const void*)probe_baseline,
    (const void*)probe_elems<kRTN, kImplScaled>,
    (const void*)probe_elems<kRTN, kImplRtnSat>,
    (const void*)probe_elems<kSR, kImplBits>,
    (const void*)probe_elems<kSR, kImplScaled>,
    (const void*)probe_elems<kGuidedCompact, kImplBits>,
    (const void*)probe_elems<kGuidedCompact, kImplScaled>,
    (const void*)probe_elems<kGuidedFull, kImplBits>,
    (const void*)probe_elems<kGuidedFull, kImplScaled>,
    (const void*)probe_elems<kSR, kImplSrLean>,
};

}  // namespace
}  // namespace trace_ext
