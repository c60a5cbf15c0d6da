// MXFP4 quantize / dequantize (SPEC 3, 4), bit-exact against reference.py.
//
// Design: memory-bound, and on the H200 bound by instruction issue, so the quantize kernel counts instructions (RTN of
// 16-bit x: mxfp4_quant_half32_kernel, two lanes per block and a 32-bit two-buffer walk, below; the rest as follows): a
// lane owns whole 32-element blocks (bf16: four 16-byte loads; the warp's loads of one block index cover one contiguous
// span), so the block amax (two magnitudes per HMNMX2 on the raw words), the E8M0 exponent and the scale byte are
// per-thread work done once per 32 elements, and a lane stores its 16 code bytes with one 16-byte store (contiguous
// across the warp). Warps loop over tiles of 32 blocks (grid stride) and issue the next tile's loads before quantizing
// the current one. v = x * 2^-e is one fl multiply (exact unless it underflows, exactly as in the reference). RTN
// multiplies by 2^(-e-14) instead and rounds in the scaled fp32 domain with the codes read off fp16 bits, by the NVFP4
// lean kernels' element code since H200 round 62 (e2m1_rn_grid_pow2_x2m14 / e2m1_pack8_abs_x2m14<true>: 1.05-1.09x over
// e2m1_rn_grid_x2m14 / e2m1_pack8_x2m14 with a sign OR per element). SR: one philox4x32_10 call per 4 elements (SPEC 4
// counters); the lean element routine of the NVFP4 kernels (quant_sr_elems.cuh, t = 2^e) wherever its preconditions
// hold (mx_block_codes_sr_lean), else per element. Dequantize: lanes own 8-element chunks, one 16-byte store per chunk.
// Every numeric step comes from fp4_numerics.cuh.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <tuple>

#include "trace_ext/fp4_numerics.cuh"
#include "trace_ext/host_checks.h"
#include "trace_ext/quant_common.cuh"
#include "trace_ext/quant_sr_elems.cuh"

namespace trace_ext {
namespace {

constexpr int kThreads = 256;          // CTA size
constexpr int kChunkElems = 8;         // dequantize: elements per thread chunk
constexpr int kChunksPerThread = 4;    // dequantize: independent chunks per thread
constexpr int kWarpChunks = 32 * kChunksPerThread;
static_assert(kChunkElems * 4 / 8 == 4, "dequantize: a chunk's codes are exactly one 32-bit load");
static_assert(kMxfp4Block * 4 / 8 == 16, "quantize: a block's codes are exactly one 16-byte store");

struct MxParams {
  const void* x;        // [R, K]
  int64_t total_blocks;  // R * K / 32
  uint64_t seed, offset;
  bool scale_ceil;
  PhiloxKeySchedule keys;  // the seed's Philox key schedule
  uint8_t* codes;   // [R, K/2]
  uint8_t* scales;  // [R, K/32]
};

// Raw 16-byte vectors of one MX block (zeros when it does not exist).
template <typename T>
using MxBlockRaw = RawBlock<T, kMxfp4Block>;

// SR (lean; the default since the H200 A/B at aed970c: 1.20x) of one finite MX block: sr_elems_lean_x2m14 with the
// divisor t = 2^e and r = 2^-e (so its division is the exact product x 2^-e) where that routine's preconditions hold: e
// in [-100, 100] (t and 1 / t far from under / overflow; amax 2^-e < 8) and every nonzero |x| >= 2^-100 with fl(|x|
// 2^-e) >= 2^-99 (all quotients exact and normal after the 2^-14 scaling). Returns false (nothing written) otherwise:
// the caller then runs the per-element code. m = the block's smallest nonzero |x| (+0: all zero).
__device__ __forceinline__ bool mx_block_codes_sr_lean(const float (&x)[kMxfp4Block], int e, uint64_t b, float m,
                                                       const MxParams& p, uint32_t (&w)[4]) {
  if (e < -100 || e > 100) return false;
  const float r = exp2_exact(-e);
  if (m < 0x1p-100f || __fmul_rn(m, r) < 0x1p-99f) return false;
  const uint64_t n0 = 8 * b;  // SPEC 4 counter of element 0: flat index 32 b over 4 (a multiple of 8: no carry)
  sr_elems_lean_x2m14<kMxfp4Block>(x, exp2_exact(e), r, (uint32_t)n0, (uint32_t)(n0 >> 32), (uint32_t)p.offset,
                                   (uint32_t)(p.offset >> 32), p.keys, w);
  return true;
}

// RTN codes of N elements of a finite MX block with scale exponent e, the NVFP4 lean kernels' element code: the grid
// value by one power-of-two magic add (e2m1_rn_grid_pow2_x2m14, unsaturated), the signs by byte permutes, saturated
// when packed (e2m1_pack8_abs_x2m14<true>); u = |x| 2^(-e-14) < 8 2^-14 is the pow2 routine's range. Nibble i % 8 of
// w[i / 8] = element i.
template <int N>
__device__ __forceinline__ void mx_rtn_lean_words(const float (&x)[N], int e, uint32_t (&w)[N / 8]) {
  const float inv14 = exp2_exact(-e - 14);
#pragma unroll
  for (int k = 0; k < N / 8; ++k) {
    const SignBytes8 sb = sign_bytes8_at(x, k);
    float g[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) g[i] = e2m1_rn_grid_pow2_x2m14(__fmul_rn(fabsf(x[8 * k + i]), inv14));
    w[k] = e2m1_pack8_abs_x2m14<true>(g, sb);
  }
}

// Codes of one finite MX block with scale exponent e (SPEC 3, 4): 4 words of 8 codes. RTN: mx_rtn_lean_words. SR:
// through mx_block_codes_sr_lean where it applies (kSrLean), else per element.
template <int MODE, bool kSrLean = false>
__device__ __forceinline__ uint4 mx_block_codes(const float (&x)[kMxfp4Block], int e, uint64_t b, const MxParams& p) {
  uint32_t w[4];
  if constexpr (MODE == kSR && kSrLean) {
    const float m = __uint_as_float(min_nonzero_abs_bits_m1(x) + 1u);  // +0 when the block is all zero
    if (mx_block_codes_sr_lean(x, e, b, m, p, w)) return make_uint4(w[0], w[1], w[2], w[3]);
  }
  if constexpr (MODE == kRTN) {
    mx_rtn_lean_words(x, e, w);
  } else {
    const float inv = exp2_exact(-e);
    Philox4 rnd;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      w[k] = 0u;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        // SPEC 4 counter: flat element index / 4 = 8 b + (8 k + i) / 4
        if (i % 4 == 0) rnd = sr_words_scheduled(8 * b + 2 * k + i / 4, p.offset, p.keys);
        const float v = __fmul_rn(x[8 * k + i], inv);
        const uint32_t mag = e2m1_sr_magnitude_bits(fminf(fabsf(v), kE2M1Max), rnd.w[i % 4]);
        w[k] |= (mag | sign_nibble(v)) << (4 * i);
      }
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The scale exponent e of a finite block or half block (amax bits mb < 0x7F800000; SPEC 3), returned, with its E8M0
// byte in scale and the N raw values as floats in x.
template <typename T, int N>
__device__ __forceinline__ int mx_finite_block(uint32_t mb, const RawBlock<T, N>& raw, bool scale_ceil, uint8_t& scale,
                                               float (&x)[N]) {
  const int e = mxfp4_scale_exponent(__uint_as_float(mb), scale_ceil);
  scale = (uint8_t)(e + 127);
#pragma unroll
  for (int i = 0; i < RawBlock<T, N>::kVecs; ++i) vec_to_float<T>(raw.v[i], x + i * ElemTraits<T>::kPerVec);
  return e;
}

// Tiles of 32 consecutive blocks: lane l owns block 32 tile + l; warps loop over tiles with a grid stride.
template <typename T, int MODE, bool kSrLean = false>
__global__ void __launch_bounds__(kThreads) mxfp4_quant_kernel(const MxParams p) {
  const uint64_t total = (uint64_t)p.total_blocks;
  const uint64_t n_tiles = (total + 31) / 32;
  const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uint64_t n_warps = (uint64_t)gridDim.x * blockDim.x / 32;
  const uint32_t lane = threadIdx.x % 32;
  const T* xp = reinterpret_cast<const T*>(p.x);
  uint64_t tile = tid / 32;
  MxBlockRaw<T> cur;
  if (tile < n_tiles) cur = load_raw_block<T, kMxfp4Block>(xp, tile * 32 + lane, tile * 32 + lane < total);
  for (; tile < n_tiles; tile += n_warps) {
    const uint64_t nb = (tile + n_warps) * 32 + lane;
    MxBlockRaw<T> next;
    if (tile + n_warps < n_tiles) next = load_raw_block<T, kMxfp4Block>(xp, nb, nb < total);
    const uint64_t b = tile * 32 + lane;
    if (b < total) {
      const uint32_t mb = raw_max_abs_bits<T>(cur.v);
      uint4 w = make_uint4(0u, 0u, 0u, 0u);
      uint8_t scale = kE8M0NaN;
      if (mb < 0x7F800000u) {
        float x[kMxfp4Block];
        const int e = mx_finite_block(mb, cur, p.scale_ceil, scale, x);
        w = mx_block_codes<MODE, kSrLean>(x, e, b, p);
      }
      reinterpret_cast<uint4*>(p.codes)[b] = w;
      p.scales[b] = scale;
    }
    cur = next;
  }
}

// One tile of the half-block kernel for the lane's half c (16 elements of block c / 2): the block amax with the
// partner lane's (every lane of the warp calls this), then, if c < halves, its 8 code bytes and (even lanes) the
// block's scale byte.
template <typename T>
__device__ __forceinline__ void mx_half_tile(const MxParams& p, const RawBlock<T, kMxfp4Block / 2>& cur, uint32_t c,
                                             uint32_t halves, uint32_t lane) {
  uint32_t mb = raw_max_abs_bits<T>(cur.v);
  mb = max(mb, __shfl_xor_sync(0xFFFFFFFFu, mb, 1));
  if (c < halves) {
    uint32_t q[2] = {0u, 0u};
    uint8_t scale = kE8M0NaN;
    if (mb < 0x7F800000u) {
      float x[kMxfp4Block / 2];
      mx_rtn_lean_words(x, mx_finite_block(mb, cur, p.scale_ceil, scale, x), q);
    }
    reinterpret_cast<uint2*>(p.codes)[c] = make_uint2(q[0], q[1]);
    if ((lane & 1u) == 0u) p.scales[c / 2] = scale;
  }
}

// RTN (mx_rtn_lean_words) of 16-bit x with two lanes per 32-element block (H200 rounds 66-67: 1.06-1.07x at 2^26 over
// one lane per block; the 32-bit walk since round 79: 1.014-1.035x over the 64-bit walk it replaced): lane l of a warp
// owns half l % 2 of block 16 tile + l / 2 (16 elements, 32 bytes), so a warp's loads of one vector index cover 1 KB
// with 32-byte lane strides, as in the NVFP4 lean kernels and the stream probes (tools/probes); the block amax takes
// the partner lane's by one shuffle, each lane stores its 8 code bytes and the even lane the scale byte. Tiles of 16
// blocks; 32-bit half indices (the host checks halves + 2 * stride < 2^31, else mxfp4_quant_kernel runs), two tiles per
// loop iteration with the two register buffers swapped (no copy of the next tile's 8 words per tile), the next tile's
// loads issued before the current one is quantized, from the clamped index min(c, halves - 1) (always in bounds: no
// predicate, no zero fill; lanes past the end quantize nothing). Same codes and scales as mxfp4_quant_kernel<T, kRTN>.
struct MxHalfWalk {
  uint32_t halves;  // 2 * blocks
  uint32_t last;    // halves - 1
  uint32_t stride;  // halves between a warp's consecutive tiles: warps in the grid * 32
};

template <typename T>
__global__ void __launch_bounds__(kThreads) mxfp4_quant_half32_kernel(const MxParams p, const MxHalfWalk w) {
  static_assert(sizeof(T) == 2, "16-bit x");
  constexpr int kHalf = kMxfp4Block / 2;
  const uint32_t lane = threadIdx.x % 32;
  uint32_t c = blockIdx.x * (uint32_t)kThreads + threadIdx.x;  // the lane's half in the warp's first tile
  const T* xp = reinterpret_cast<const T*>(p.x);
  auto load = [&](uint32_t i, RawBlock<T, kHalf>& buf) { buf = load_raw_block<T, kHalf>(xp, min(i, w.last), true); };
  // one tile: the next tile's loads in flight, this one's amax (with the partner lane's), codes and scale
  auto step = [&](const RawBlock<T, kHalf>& cur, RawBlock<T, kHalf>& nxt) {
    load(c + w.stride, nxt);
    mx_half_tile<T>(p, cur, c, w.halves, lane);
    c += w.stride;
  };
  RawBlock<T, kHalf> b0, b1;
  load(c, b0);
  while (c - lane < w.halves) {  // the warp's tile start: warp-uniform, so the shuffle sees every lane
    step(b0, b1);
    if (c - lane >= w.halves) break;
    step(b1, b0);
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

// MXFP4 RTN of 16-bit x runs mxfp4_quant_half32_kernel where its indices fit. TRACE_EXT_MX_HALF=0 (read per call)
// runs the one-lane-per-block kernel instead, the kernel that takes 16-bit x past the half kernel's 32-bit indices
// (2^31 halves: 2^36 elements), so that its 16-bit instantiations are tested; 1.06-1.07x slower at 2^26 (round 66).
bool mx_half_selected() { return env_switch("TRACE_EXT_MX_HALF", true); }

// Tiles per warp the quantize grid aims at (never fewer warps than the GPU holds): RTN 4, SR 2 (H200 round 74, two
// timings, bit-equal: SR 1.04-1.06x at 2^26 and 1.03x at 2^28 elements with 2; RTN with 1 / 2 / 3 / 6 / 8 / 16:
// 0.81-1.02x, 4 kept). TRACE_EXT_MX_TILES=n (read per call; an A/B knob, 1..64) sets n for both: 1 = one tile per
// warp, no next-tile loads in flight; large n = one persistent wave.
int mx_tiles_per_warp(int rounding) {
  const char* v = std::getenv("TRACE_EXT_MX_TILES");
  const int n = v != nullptr ? std::atoi(v) : 0;
  return n >= 1 && n <= 64 ? n : rounding == kSR ? 2 : 4;
}

// SR through mx_block_codes_sr_lean: the default (TRACE_EXT_QUANT_IMPL unset, "rowg-lean3", "fake-lean3", "sr-row" or
// "sr-lean", read per call); any other value (the NVFP4 variants from before it, e.g. "guided-lean") keeps the
// per-element code.
bool mx_sr_lean_selected() {
  const char* v = std::getenv("TRACE_EXT_QUANT_IMPL");
  return v == nullptr || *v == '\0' || std::strcmp(v, "sr-lean") == 0 || std::strcmp(v, "sr-row") == 0 ||
         std::strcmp(v, "rowg-lean3") == 0 || std::strcmp(v, "fake-lean3") == 0;
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
  dispatch_float_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const bool half = sizeof(T) == 2 && rounding == kRTN && mx_half_selected();  // tiles of 16 blocks instead of 32
    auto kernel = rounding == kRTN ? mxfp4_quant_kernel<T, kRTN>
                  : mx_sr_lean_selected() ? mxfp4_quant_kernel<T, kSR, true>
                                          : mxfp4_quant_kernel<T, kSR>;
    // a few tiles per warp (mx_tiles_per_warp), but never fewer warps than the GPU holds
    const int64_t n_tiles = div_up(p.total_blocks, half ? 16 : 32);
    const int64_t warps =
        std::max(div_up(n_tiles, mx_tiles_per_warp(rounding)), std::min(n_tiles, int64_t(current_sm_count()) * 64));
    const unsigned grid = (unsigned)div_up(warps * 32, kThreads);
    if constexpr (sizeof(T) == 2) {
      const int64_t halves = 2 * p.total_blocks, stride = int64_t(grid) * kThreads;
      if (half && halves + 2 * stride < (int64_t(1) << 31)) {
        auto k32 = mxfp4_quant_half32_kernel<T>;
        require_kernel_image(k32, op);
        k32<<<grid, kThreads, 0, stream>>>(p, MxHalfWalk{(uint32_t)halves, (uint32_t)(halves - 1), (uint32_t)stride});
        check_launch(op);
        return;
      }
    }
    require_kernel_image(kernel, op);
    kernel<<<grid, kThreads, 0, stream>>>(p);
    check_launch(op);
  });
  return {codes, scales};
}

at::Tensor mxfp4_dequantize_cuda(const at::Tensor& codes, const at::Tensor& scales, at::ScalarType dtype) {
  const char* op = "mxfp4_dequantize";
  const int64_t K = check_dequantize_args(codes, scales, dtype, kMxfp4Block, op), R = codes.size(0);
  const c10::cuda::CUDAGuard guard(codes.device());
  at::Tensor y = at::empty({R, K}, codes.options().dtype(dtype));
  if (R == 0 || K == 0) return y;
  const int64_t total = R * (K / kMxfp4Block);
  const at::Tensor codes_v = aligned_for_vectors(codes, 16);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_dtype(dtype, [&](auto tag) {
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
