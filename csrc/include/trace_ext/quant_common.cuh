// Vector load / store helpers shared by the memory-bound quantization kernels (quant_nvfp4.cu,
// quant_mxfp4.cu): 16-byte global accesses, element conversion to float32 (exact for bf16 / fp16) and back
// (round to nearest even, as torch's .to(dtype)); on the host, the launch arithmetic, dtype dispatch and argument
// checks the quantizer entries share.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "trace_ext/fp4_numerics.cuh"
#ifndef __CUDACC_RTC__
#include "trace_ext/host_checks.h"
#endif

namespace trace_ext {

template <typename T>
struct ElemTraits;
template <>
struct ElemTraits<float> {
  static constexpr int kPerVec = 4;  // elements per 16-byte vector
};
template <>
struct ElemTraits<__nv_bfloat16> {
  static constexpr int kPerVec = 8;
};
template <>
struct ElemTraits<__half> {
  static constexpr int kPerVec = 8;
};

__device__ __forceinline__ uint4 ld_vec(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ void st_vec(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

// One 16-byte vector -> floats (exact widening).
template <typename T>
__device__ __forceinline__ void vec_to_float(uint4 v, float* out);

template <>
__device__ __forceinline__ void vec_to_float<float>(uint4 v, float* out) {
  out[0] = __uint_as_float(v.x);
  out[1] = __uint_as_float(v.y);
  out[2] = __uint_as_float(v.z);
  out[3] = __uint_as_float(v.w);
}

template <>
__device__ __forceinline__ void vec_to_float<__nv_bfloat16>(uint4 v, float* out) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}

template <>
__device__ __forceinline__ void vec_to_float<__half>(uint4 v, float* out) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __half2float(__ushort_as_half((unsigned short)(w[i] & 0xFFFFu)));
    out[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(w[i] >> 16)));
  }
}

// Floats -> one 16-byte vector of T (RNE; NaN stays NaN, fp16 overflow gives inf as in torch).
template <typename T>
__device__ __forceinline__ uint4 float_to_vec(const float* in);

template <>
__device__ __forceinline__ uint4 float_to_vec<float>(const float* in) {
  return make_uint4(__float_as_uint(in[0]), __float_as_uint(in[1]), __float_as_uint(in[2]), __float_as_uint(in[3]));
}

template <>
__device__ __forceinline__ uint4 float_to_vec<__nv_bfloat16>(const float* in) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 h = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    w[i] = *reinterpret_cast<uint32_t*>(&h);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <>
__device__ __forceinline__ uint4 float_to_vec<__half>(const float* in) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 h = __floats2half2_rn(in[2 * i], in[2 * i + 1]);
    w[i] = *reinterpret_cast<uint32_t*>(&h);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Load N consecutive elements (N a multiple of the vector width, p 16-byte aligned) as floats.
template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[N]) {
  constexpr int kV = ElemTraits<T>::kPerVec;
  static_assert(N % kV == 0, "a block must be a whole number of 16-byte vectors");
  uint4 v[N / kV];
#pragma unroll
  for (int i = 0; i < N / kV; ++i) v[i] = ld_vec(p + i * kV);
#pragma unroll
  for (int i = 0; i < N / kV; ++i) vec_to_float<T>(v[i], out + i * kV);
}

template <typename T, int N>
__device__ __forceinline__ void store_floats(T* p, const float (&in)[N]) {
  constexpr int kV = ElemTraits<T>::kPerVec;
  static_assert(N % kV == 0, "a block must be a whole number of 16-byte vectors");
#pragma unroll
  for (int i = 0; i < N / kV; ++i) st_vec(p + i * kV, float_to_vec<T>(in + i * kV));
}

// max over |x| as raw bits (non-negative floats order like their bit patterns; >= 0x7F800000 = Inf / NaN).
template <int N>
__device__ __forceinline__ uint32_t max_abs_bits(const float (&x)[N]) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) m = max(m, __float_as_uint(x[i]) & 0x7FFFFFFFu);
  return m;
}

// The raw 16-byte vectors of one scale block of kElems elements of T (a lane's whole block in registers).
template <typename T, int kElems>
struct RawBlock {
  static constexpr int kVecs = kElems / ElemTraits<T>::kPerVec;
  uint4 v[kVecs];
};

// Block `index` of a row-major array of kElems-element blocks (zeros when !ok).
template <typename T, int kElems>
__device__ __forceinline__ RawBlock<T, kElems> load_raw_block(const T* x, uint64_t index, bool ok) {
  RawBlock<T, kElems> raw;
#pragma unroll
  for (int i = 0; i < RawBlock<T, kElems>::kVecs; ++i) {
    raw.v[i] = ok ? ld_vec(x + index * kElems + i * ElemTraits<T>::kPerVec) : make_uint4(0u, 0u, 0u, 0u);
  }
  return raw;
}

// A 16-bit magnitude's bits h (sign clear) of T (bf16 / fp16) as the float bits of the same value (exact).
template <typename T>
__device__ __forceinline__ uint32_t half_magnitude_as_float_bits(uint32_t h) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return h << 16;
  } else {
    return __float_as_uint(__half2float(__ushort_as_half((unsigned short)h)));
  }
}

// max |x| over NV raw 16-byte vectors of T, as float bits (what max_abs_bits gives for the same values; a NaN may come
// back as another NaN: callers only test >= 0x7F800000 for Inf / NaN). 16-bit inputs, kPackedMax (the default): two
// chains of max_abs_nan_x2 over the raw words (2 magnitudes per HMNMX2), then the two halves; H200 round 78: NVFP4 RTN
// quantize 1.01-1.06x, MXFP4 1.00-1.05x. Otherwise (the guided kernels: 0.97-0.98x there at 2^26 in round 78) the sign
// bits masked and the raw halves compared as unsigned integers (their bits order like their magnitudes; NaN / Inf stay
// above every finite value).
template <typename T, int NV, bool kPackedMax = true>
__device__ __forceinline__ uint32_t raw_max_abs_bits(const uint4 (&v)[NV]) {
  if constexpr (std::is_same_v<T, float>) {
    uint32_t m = 0u;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      m = max(m, max(v[i].x & 0x7FFFFFFFu, v[i].y & 0x7FFFFFFFu));
      m = max(m, max(v[i].z & 0x7FFFFFFFu, v[i].w & 0x7FFFFFFFu));
    }
    return m;
  } else if constexpr (!kPackedMax) {
    uint32_t m = 0u;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      m = max_u16x2(m, v[i].x & 0x7FFF7FFFu);
      m = max_u16x2(m, v[i].y & 0x7FFF7FFFu);
      m = max_u16x2(m, v[i].z & 0x7FFF7FFFu);
      m = max_u16x2(m, v[i].w & 0x7FFF7FFFu);
    }
    return half_magnitude_as_float_bits<T>(max(m & 0xFFFFu, m >> 16));
  } else {
    uint32_t a = max_abs_nan_x2<T>(v[0].x, v[0].y), b = max_abs_nan_x2<T>(v[0].z, v[0].w);
#pragma unroll
    for (int i = 1; i < NV; ++i) {
      a = max_abs_nan_x2<T>(a, max_abs_nan_x2<T>(v[i].x, v[i].y));
      b = max_abs_nan_x2<T>(b, max_abs_nan_x2<T>(v[i].z, v[i].w));
    }
    const uint32_t m = max_abs_nan_x2<T>(a, b);
    return half_magnitude_as_float_bits<T>(max_abs_nan_x2<T>(m, __byte_perm(m, 0u, 0x1032u)) & 0x7FFFu);
  }
}

// max over |x| of the finite elements only (slow path for blocks holding a NaN / Inf).
template <int N>
__device__ __forceinline__ uint32_t max_abs_bits_finite(const float (&x)[N]) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    uint32_t b = __float_as_uint(x[i]) & 0x7FFFFFFFu;
    if (b < 0x7F800000u) m = max(m, b);
  }
  return m;
}

// Host: the kernels read inputs with vector loads; a contiguous view starting at an odd offset inside its storage
// is copied once to a fresh (aligned) buffer instead of faulting. Values are never changed.
#ifndef __CUDACC_RTC__
template <typename TensorT>
inline TensorT aligned_for_vectors(const TensorT& t, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0 ? t : t.clone();
}

inline int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Checks shared by the dequantize entries (SPEC 10): codes and scales uint8 on one CUDA device and contiguous,
// codes [R, K/2] with K a multiple of `block`, scales [R, K/block], dtype float32 / bfloat16 / float16. Returns K.
template <typename TensorT, typename ScalarTypeT>
int64_t check_dequantize_args(const TensorT& codes, const TensorT& scales, ScalarTypeT dtype, int64_t block,
                              const char* op) {
  check_cuda(codes, "codes");
  check_same_device(scales, codes, "scales", "codes");
  check_dtype(codes, ScalarTypeT::Byte, "codes");
  check_dtype(scales, ScalarTypeT::Byte, "scales");
  TORCH_CHECK_TYPE(dtype == ScalarTypeT::Float || dtype == ScalarTypeT::BFloat16 || dtype == ScalarTypeT::Half,
                   "trace_ext.", op, ": dtype must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK_VALUE(codes.dim() == 2 && codes.size(1) % (block / 2) == 0, "trace_ext.", op,
                    ": codes must have shape [R, K/2] with K a multiple of ", block, ", got ", codes.sizes());
  const int64_t K = codes.size(1) * 2;
  check_shape(scales, {codes.size(0), K / block}, "scales");
  check_contiguous(codes, "codes");
  check_contiguous(scales, "scales");
  return K;
}

// Calls f with a value of the element type the quantizers take (float32, bfloat16 or float16; checked by the caller).
template <typename ScalarTypeT, typename F>
void dispatch_float_dtype(ScalarTypeT t, F&& f) {
  if (t == ScalarTypeT::Float) {
    f(float{});
  } else if (t == ScalarTypeT::BFloat16) {
    f(__nv_bfloat16{});
  } else {
    f(__half{});
  }
}
#endif

}  // namespace trace_ext
