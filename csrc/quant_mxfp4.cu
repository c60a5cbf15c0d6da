// MXFP4 quantize / dequantize (SPEC 3, 4), bit-exact against reference.py.
//
// Design: memory-bound; a thread owns chunks of 8 elements (a quarter block) and the four quarters of a block sit
// in adjacent lanes: lane l of a warp takes chunks l + 32 j (j < 4) of the warp's tile, so every warp-wide load /
// store is contiguous (512 B of bf16 x, 128 B of codes) with 4 chunk loads in flight per thread; the block amax
// is combined with two shuffles, the E8M0 exponent derived in registers by all four lanes, the first lane
// stores the scale byte. v = x * 2^-e is one fl multiply (exact unless it
// underflows, exactly as in the reference). SR: one philox4x32_10 call per 4 elements (SPEC 4 counters).
// Every numeric step comes from fp4_numerics.cuh.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "trace_ext/fp4_numerics.cuh"
#include "trace_ext/host_checks.h"
#include "trace_ext/quant_common.cuh"

namespace trace_ext {
namespace {

constexpr int kThreads = 256;          // CTA size
constexpr int kChunkElems = 8;         // elements per thread chunk: a quarter of an MX block
constexpr int kChunksPerThread = 4;    // independent chunk loads in flight per thread
constexpr int kWarpChunks = 32 * kChunksPerThread;
static_assert(kMxfp4Block == 4 * kChunkElems, "four adjacent lanes share one 32-element block");
static_assert(kChunkElems * 4 / 8 == 4, "a chunk's codes are exactly one 32-bit store");

struct MxParams {
  const void* x;        // [R, K]
  int64_t total_blocks;  // R * K / 32
  uint64_t seed, offset;
  bool scale_ceil;
  PhiloxKeySchedule keys;  // the seed's Philox key schedule
  uint8_t* codes;   // [R, K/2]
  uint8_t* scales;  // [R, K/32]
};

// Warp tiling: lane l of warp w takes chunks w * kWarpChunks + l + 32 j (j < 4), so every warp-wide access is
// contiguous (512 B of bf16 x, 128 B of codes) and the four quarters of an MX block sit in lanes l ^ {0, 1, 2, 3}
// (their amax is combined with two shuffles; all four lanes then derive the same exponent).
template <typename T, int MODE>
__global__ void __launch_bounds__(kThreads) mxfp4_quant_kernel(const MxParams p) {
  constexpr int kV = ElemTraits<T>::kPerVec;
  const uint64_t total_chunks = (uint64_t)p.total_blocks * 4;
  const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uint64_t c0 = (tid / 32) * kWarpChunks + tid % 32;
  const T* xp = reinterpret_cast<const T*>(p.x);
  uint4 raw[kChunksPerThread][kChunkElems / kV];
#pragma unroll
  for (int j = 0; j < kChunksPerThread; ++j) {
    const uint64_t c = c0 + 32 * j;
#pragma unroll
    for (int v = 0; v < kChunkElems / kV; ++v) {
      raw[j][v] = c < total_chunks ? ld_vec(xp + c * kChunkElems + v * kV) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
#pragma unroll
  for (int j = 0; j < kChunksPerThread; ++j) {
    const uint64_t c = c0 + 32 * j;
    float x[kChunkElems];
#pragma unroll
    for (int v = 0; v < kChunkElems / kV; ++v) vec_to_float<T>(raw[j][v], x + v * kV);
    uint32_t mb = max_abs_bits(x);
    // whole warp: the chunk count is a multiple of 4, so the four lanes of a block agree on being in range
    mb = max(mb, __shfl_xor_sync(0xFFFFFFFFu, mb, 1));
    mb = max(mb, __shfl_xor_sync(0xFFFFFFFFu, mb, 2));
    if (c < total_chunks) {
      uint32_t w = 0u;
      uint8_t scale = kE8M0NaN;
      if (mb < 0x7F800000u) {
        const int e = mxfp4_scale_exponent(__uint_as_float(mb), p.scale_ceil);
        scale = (uint8_t)(e + 127);
        const float inv = exp2_exact(-e);
        Philox4 rnd;
#pragma unroll
        for (int i = 0; i < kChunkElems; ++i) {
          if constexpr (MODE == kSR) {
            // SPEC 4 counter: flat element index / 4 = 8 * block + 2 * quarter + i / 4 = 2 c + i / 4
            if (i % 4 == 0) rnd = sr_words_scheduled(2 * c + i / 4, p.offset, p.keys);
          }
          const float v = __fmul_rn(x[i], inv);
          uint32_t mag;
          if constexpr (MODE == kRTN) {
            mag = e2m1_rn_magnitude_bits(fabsf(v));
          } else {
            mag = e2m1_sr_magnitude_bits(fminf(fabsf(v), kE2M1Max), rnd.w[i % 4]);
          }
          w |= (mag | sign_nibble(v)) << (4 * i);
        }
      }
      reinterpret_cast<uint32_t*>(p.codes)[c] = w;
      if ((c & 3u) == 0u) p.scales[c >> 2] = scale;
    }
  }
}

// Same warp tiling: 4 code bytes in, 8 values out per chunk (one 16-byte store of bf16 / fp16).
template <typename T>
__global__ void __launch_bounds__(kThreads) mxfp4_dequant_kernel(const uint8_t* codes, const uint8_t* scales,
                                                                 int64_t total_blocks, T* y) {
  const uint64_t total_chunks = (uint64_t)total_blocks * 4;
  const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uint64_t c0 = (tid / 32) * kWarpChunks + tid % 32;
  uint32_t w[kChunksPerThread];
  uint8_t b[kChunksPerThread];
#pragma unroll
  for (int j = 0; j < kChunksPerThread; ++j) {
    const uint64_t c = c0 + 32 * j;
    const bool ok = c < total_chunks;
    w[j] = ok ? __ldg(reinterpret_cast<const uint32_t*>(codes) + c) : 0u;
    b[j] = ok ? __ldg(scales + (c >> 2)) : (uint8_t)0;
  }
#pragma unroll
  for (int j = 0; j < kChunksPerThread; ++j) {
    const uint64_t c = c0 + 32 * j;
    if (c < total_chunks) {
      // 2^(b - 127) exactly; 0xFF is NaN (the whole block decodes to NaN)
      const float s = b[j] == kE8M0NaN ? __uint_as_float(0x7FC00000u) : exp2_exact((int)b[j] - 127);
      float out[kChunkElems];
#pragma unroll
      for (int i = 0; i < kChunkElems; ++i) {
        // (q * 2^-14) * 2^14 is exactly q; then one fl multiply by the scale, as in the reference
        const float q = __fmul_rn(e2m1_value_x2m14((w[j] >> (4 * i)) & 0xFu), 16384.0f);
        out[i] = __fmul_rn(q, s);
      }
      store_floats<T, kChunkElems>(y + c * kChunkElems, out);
    }
  }
}

int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename F>
void dispatch_dtype(at::ScalarType t, F&& f) {
  if (t == at::kFloat) {
    f(float{});
  } else if (t == at::kBFloat16) {
    f(__nv_bfloat16{});
  } else {
    f(__half{});
  }
}

std::tuple<at::Tensor, at::Tensor> mxfp4_quantize_cuda(const at::Tensor& x, int64_t rounding, int64_t seed,
                                                       int64_t offset, bool scale_ceil) {
  const char* op = "mxfp4_quantize";
  check_cuda(x, "x");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
                   "trace_ext.", op, ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) % kMxfp4Block == 0, "trace_ext.", op,
                    ": x must have shape [R, K] with K a multiple of 32, got ", x.sizes());
  check_contiguous(x, "x");
  TORCH_CHECK_VALUE(rounding == kRTN || rounding == kSR, "trace_ext.", op,
                    ": rounding must be 0 (rtn) or 1 (sr), got ", rounding);
  TORCH_CHECK_VALUE(seed >= 0 && offset >= 0, "trace_ext.", op, ": seed and offset must be >= 0, got ", seed, ", ",
                    offset);
  const int64_t R = x.size(0), K = x.size(1);
  const c10::cuda::CUDAGuard guard(x.device());
  auto u8 = x.options().dtype(at::kByte);
  at::Tensor codes = at::empty({R, K / 2}, u8);
  at::Tensor scales = at::empty({R, K / kMxfp4Block}, u8);
  if (R == 0 || K == 0) return {codes, scales};
  const at::Tensor xv = aligned_for_vectors(x, 16);
  MxParams p{xv.data_ptr(), R * (K / kMxfp4Block), (uint64_t)seed, (uint64_t)offset, scale_ceil,
             philox_key_schedule((uint64_t)seed), codes.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>()};
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    auto kernel = rounding == kRTN ? mxfp4_quant_kernel<T, kRTN> : mxfp4_quant_kernel<T, kSR>;
    require_kernel_image(kernel, op);
    kernel<<<(unsigned)div_up(div_up(p.total_blocks * 4, kWarpChunks) * 32, kThreads), kThreads, 0, stream>>>(p);
    check_launch(op);
  });
  return {codes, scales};
}

at::Tensor mxfp4_dequantize_cuda(const at::Tensor& codes, const at::Tensor& scales, at::ScalarType dtype) {
  const char* op = "mxfp4_dequantize";
  check_cuda(codes, "codes");
  check_same_device(scales, codes, "scales", "codes");
  check_dtype(codes, at::kByte, "codes");
  check_dtype(scales, at::kByte, "scales");
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "trace_ext.", op,
                   ": dtype must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK_VALUE(codes.dim() == 2 && codes.size(1) % (kMxfp4Block / 2) == 0, "trace_ext.", op,
                    ": codes must have shape [R, K/2] with K a multiple of 32, got ", codes.sizes());
  const int64_t R = codes.size(0), K = codes.size(1) * 2;
  check_shape(scales, {R, K / kMxfp4Block}, "scales");
  check_contiguous(codes, "codes");
  check_contiguous(scales, "scales");
  const c10::cuda::CUDAGuard guard(codes.device());
  at::Tensor y = at::empty({R, K}, codes.options().dtype(dtype));
  if (R == 0 || K == 0) return y;
  const int64_t total = R * (K / kMxfp4Block);
  const at::Tensor codes_v = aligned_for_vectors(codes, 16);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto kernel = mxfp4_dequant_kernel<T>;
    require_kernel_image(kernel, op);
    const int64_t threads = div_up(total * 4, kWarpChunks) * 32;
    kernel<<<(unsigned)div_up(threads, kThreads), kThreads, 0, stream>>>(codes_v.data_ptr<uint8_t>(),
                                                                      scales.data_ptr<uint8_t>(), total,
                                                                      reinterpret_cast<T*>(y.data_ptr()));
    check_launch(op);
  });
  return y;
}

}  // namespace
}  // namespace trace_ext

TORCH_LIBRARY_IMPL(trace_ext, CUDA, m) {
  m.impl("mxfp4_quantize", &trace_ext::mxfp4_quantize_cuda);
  m.impl("mxfp4_dequantize", &trace_ext::mxfp4_dequantize_cuda);
}
