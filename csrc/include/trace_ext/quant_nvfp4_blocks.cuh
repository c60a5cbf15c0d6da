// NVFP4 quantizer: launch parameters, variant ids and the per-block quantization (scale byte, divisor, element
// codes, fake-quantize values, guidance) shared by every quantize kernel.
// Part of the NVFP4 quantizer translation unit: csrc/quant_nvfp4.cu includes it and holds the design notes; the
// definitions live in that unit's anonymous namespace.
#pragma once

#include <cstdint>
#include <type_traits>

#include "trace_ext/fp4_numerics.cuh"
#include "trace_ext/quant_common.cuh"
#include "trace_ext/quant_sr_elems.cuh"

namespace trace_ext {
namespace {

constexpr int kChunkElems = 8;                               // dequantize: elements per thread chunk
constexpr int kChunksPerThread = 4;                          // dequantize: independent chunks per thread
constexpr int kWarpChunks = 32 * kChunksPerThread;           // dequantize: chunks of one warp tile (1024 elements)
constexpr int kFlatThreads = 256;                            // CTA size of the flat kernels
constexpr int kBlocksPerLane = 2;                            // quantize: whole blocks per lane and tile (loads in flight)
constexpr int kWarpBlocks = 32 * kBlocksPerLane;             // quantize: blocks of one warp tile (1024 elements)
constexpr int kFlatTilesPerWarp = 4;                         // quantize: tiles each warp loops over (setup amortized)
constexpr int kMaxTeam = 512;                                // largest row team of the fused per-row-g kernel
constexpr int kRowBlocksPerLane = 2;                         // fused per-row g: whole blocks per lane of a row team
constexpr int64_t kFusedMaxK = int64_t(kMaxTeam) * kRowBlocksPerLane * kNvfp4Block;  // 16384: longest row on chip
constexpr int kMinTeam = 1;
constexpr int kImplScaled = 0;   // element code in the 2^-14-scaled domain, RTN saturated per element by fminf
                                 // (TRACE_EXT_QUANT_IMPL=rtn-fminf)
constexpr int kImplBits = 1;     // previous SR / guided code (TRACE_EXT_QUANT_IMPL=bits); RTN as kImplScaled
constexpr int kImplRtnSat = 2;   // RTN saturated after packing (TRACE_EXT_QUANT_IMPL=rtn-sat); else as kImplScaled
constexpr int kImplLean = 3;     // default: RTN by the power-of-two magic add, quantize (not fake) with linear scales
                                 // through nvfp4_quant_lean_kernel; SR / guided code as kImplScaled (H200 A/B at
                                 // 2071576 vs rtn-sat: RTN g given 1.14-1.16x, per-row / swizzled / capture / guided
                                 // 1.06-1.10x, SR equal; bench/results/quant_impl_h200.md)
constexpr int kImplRowgLean = 4;  // TRACE_EXT_QUANT_IMPL=rowg-lean: kImplLean, except RTN quantize with per-row g
                                  // fused through nvfp4_quant_rowg_lean_kernel
constexpr int kImplRowgLean2 = 5;  // TRACE_EXT_QUANT_IMPL=rowg-lean2: as kImplRowgLean, two blocks per lane
                                   // (16-bit x); H200 A/B at c7928a5 vs lean: per-row g 1.03-1.06x, swizzled
                                   // 1.12-1.16x, capture 1.03-1.05x (bench/results/quant_impl_h200.md)
constexpr int kImplGuidedLean = 6;  // TRACE_EXT_QUANT_IMPL=guided-lean: kImplRowgLean2, except guided
                                    // quantize (linear scales, 32-bit walk) through nvfp4_quant_guided_lean_kernel;
                                    // H200 A/B at 7b3e763: guided 1.26-1.31x, codes equal
constexpr int kImplSrLean = 7;  // TRACE_EXT_QUANT_IMPL=sr-lean: kImplGuidedLean, except the SR element code
                                // on the fast path: sr_elems_lean_x2m14 (quant_sr_elems.cuh; same codes)
constexpr int kImplSrRow = 8;   // TRACE_EXT_QUANT_IMPL=sr-row (the default until round 46): kImplSrLean, except SR
                                // quantize with g None through nvfp4_quant_rowg_lean_kernel<..., kSR> (two blocks per
                                // lane, as rowg-lean2)
constexpr int kImplRowgLean3 = 9;  // default (TRACE_EXT_QUANT_IMPL=rowg-lean3): kImplSrRow, except RTN quantize of
                                   // 16-bit x with g None through nvfp4_quant_rowg_lean3_kernel (same walk, less
                                   // per-row work; same bits), and RTN fake quantization of 16-bit x with g None
                                   // through its FAKE instantiation (also named =fake-lean3)
static_assert(kChunkElems % 8 == 0, "a chunk must be whole 16-byte vectors of bf16 / fp16 (and of fp32)");
static_assert(kNvfp4Block % 8 == 0, "a block must be whole 16-byte vectors of bf16 / fp16 (and of fp32)");
static_assert(kFusedMaxK == 16384, "fused per-row path: 512 threads x 2 blocks x 16 elements");

struct QuantParams {
  // input
  const void* x;
  int64_t rows, K, kb;  // kb = K / 16 blocks per row
  // decode scale: given per row (g_stride 1) or one value (g_stride 0); null = per-row, computed here
  const float* g;
  int64_t g_stride;
  // stochastic rounding (keys: the seed's Philox key schedule, filled by the host)
  uint64_t seed, offset;
  PhiloxKeySchedule keys;
  // guided rounding: the rollout's linear scale bytes [R, kb], g [R], payload [R, K/8] or [R, K/2]
  const uint8_t* guide_scales;
  const float* guide_g;
  const uint8_t* guide_payload;
  // outputs (null = not produced)
  uint8_t* codes;   // [R, K/2]
  uint8_t* scales;  // linear [R, kb], or swizzled [rows_pad, kb_pad]
  float* g_out;     // [R]
  uint8_t* mbits;   // [R, K/8]
  void* y;          // fake-quant output [R, K] in x's dtype
  bool swizzle;
  int64_t rows_pad, kb_pad;
};

// Row of flat block fb (32-bit division whenever the index fits, the common case).
__device__ __forceinline__ int64_t row_of(uint64_t fb, int64_t kb) {
  return fb < (uint64_t(1) << 32) ? (int64_t)((uint32_t)fb / (uint32_t)kb) : (int64_t)(fb / (uint64_t)kb);
}

// ---- per-block quantization --------------------------------------------------------------------------------

// Magnitude code of one element from a = |v| (and v's sign nibble, for guided full).
template <int MODE>
__device__ __forceinline__ uint32_t element_magnitude(float va, uint32_t sign, uint32_t word, uint32_t guide_bits,
                                                      uint2 guide_codes, int i) {
  if constexpr (MODE == kRTN) {
    return e2m1_rn_magnitude_bits(va);
  } else {
    const float a = fminf(va, kE2M1Max);
    if constexpr (MODE == kSR) {
      return e2m1_sr_magnitude_bits(a, word);
    } else if constexpr (MODE == kGuidedCompact) {
      return e2m1_guided_compact_magnitude_bits(a, (guide_bits >> i) & 1u);
    } else {
      const uint32_t w = i < 8 ? guide_codes.x : guide_codes.y;
      return e2m1_guided_full_magnitude_bits(sign, a, (w >> (4 * (i % 8))) & 0xFu);
    }
  }
}

template <int MODE, bool FAST, int N>
__device__ __forceinline__ void quantize_elems_bits(const float (&x)[N], float t, float r, uint64_t ctr0,
                                                    const QuantParams& p, uint32_t guide_bits, uint2 guide_codes,
                                                    uint32_t (&w)[N / 8]);

// RTN element loop shared by kImplLean (POW2: grid value by e2m1_rn_grid_pow2_x2m14) and kImplRtnSat (grid value by
// e2m1_rn_grid_unsat_x2m14): u = fl(|x| / t) * 2^-14 by the scaled reciprocal division, packed with the signs of x by
// e2m1_pack8_abs_x2m14<SATURATE>. SATURATE = false only where no quotient of the block reaches 7 (rtn_needs_no_clamp).
template <bool POW2, int N, bool SATURATE = true>
__device__ __forceinline__ void quantize_rtn_abs_x2m14(const float (&x)[N], float t, float r, uint32_t (&w)[N / 8]) {
  const float t14 = __fmul_rn(t, 16384.0f), r14 = __fmul_rn(r, 0x1p-14f);
#pragma unroll
  for (int k = 0; k < N / 8; ++k) {
    const SignBytes8 sb = sign_bytes8_at(x, k);
    float g[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float v = div_rn_with_rcp(fabsf(x[8 * k + i]), t14, r14);
      if constexpr (POW2) {
        g[i] = e2m1_rn_grid_pow2_x2m14(v);
      } else {
        g[i] = e2m1_rn_grid_unsat_x2m14(v);
      }
    }
    w[k] = e2m1_pack8_abs_x2m14<SATURATE>(g, sb);
  }
}

// Element loop over N elements of one block; FAST: v = fl(x / t) from the block reciprocal (div_rn_with_rcp),
// else __fdiv_rn. IMPL (FAST only): kImplScaled, kImplBits or kImplRtnSat (alternatives kept for A/B timing).
// raw16: 16-bit x's raw words for the SR lean path's signs (as quantize_rtn_abs_x2m14's), or nullptr.
template <int MODE, bool FAST, int N, int IMPL>
__device__ __forceinline__ void quantize_elems(const float (&x)[N], float t, float r, uint64_t ctr0,
                                               const QuantParams& p, uint32_t guide_bits, uint2 guide_codes,
                                               uint32_t (&w)[N / 8], const uint4* raw16 = nullptr) {
  // ctr0: Philox counter of element 0 (flat element index / 4, SPEC 4)
  if constexpr (MODE == kSR && FAST && IMPL == kImplSrLean) {
    // SR (lean): one round-up FFMA per element and one cvt.rz.f16x2 per pair (quant_sr_elems.cuh). ctr0 = 4 * flat
    // block index, a multiple of 4: its low word + 3 never carries.
    static_assert(N % 16 == 0, "whole blocks: the counter of element 0 is a multiple of 4");
    sr_elems_lean_x2m14<N>(x, t, r, (uint32_t)ctr0, (uint32_t)(ctr0 >> 32), (uint32_t)p.offset,
                           (uint32_t)(p.offset >> 32), p.keys, w, raw16);
  } else if constexpr (MODE == kRTN && FAST && IMPL == kImplLean) {
    // RTN (lean): as kImplRtnSat below, the grid value by e2m1_rn_grid_pow2_x2m14 (LOP3, VIMNMX and two FFMAs per
    // element instead of four FADDs, an FMUL, an FSETP and a predicated FADD).
    quantize_rtn_abs_x2m14<true>(x, t, r, w);
  } else if constexpr (MODE == kRTN && FAST && IMPL == kImplRtnSat) {
    // RTN: u = fl(|x| / t) * 2^-14 by the scaled reciprocal division, rounded in fp32 without saturation
    // (e2m1_rn_grid_unsat_x2m14); codes read off fp16 bits, saturated two at a time by an unsigned 16-bit min, signs
    // (x's: t > 0, -0.0 included) placed by byte permutes (e2m1_pack8_abs_x2m14<true>). 0.8 fewer instructions per
    // element than the path below, but one more live word per 8 elements: ptxas (13.0) keeps the bf16 flat kernel at
    // 64 registers with 16 / 48 bytes of spill stores / loads (the path below: 64, none), so it is opt-in until timed.
    quantize_rtn_abs_x2m14<false>(x, t, r, w);
  } else if constexpr (MODE == kRTN && FAST) {
    // RTN (default): saturation by fminf per element (e2m1_rn_grid_x2m14), the sign OR-ed into each grid value,
    // e2m1_pack8_x2m14.
    const float t14 = __fmul_rn(t, 16384.0f), r14 = __fmul_rn(r, 0x1p-14f);
#pragma unroll
    for (int k = 0; k < N / 8; ++k) {
      float q[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float xi = x[8 * k + i];
        const float grid = e2m1_rn_grid_x2m14(div_rn_with_rcp(fabsf(xi), t14, r14));
        q[i] = __uint_as_float(__float_as_uint(grid) | (__float_as_uint(xi) & 0x80000000u));
      }
      w[k] = e2m1_pack8_x2m14(q);
    }
  } else if constexpr (FAST && IMPL != kImplBits) {
    // SR / guided in the same scaled domain: a = min(u, 6 * 2^-14). SR: the grid value from e2m1_sr_grid_x2m14.
    // Guided: the floors packed as codes with x's signs (e2m1_pack8_abs_x2m14) plus one "off the grid" bit per nibble
    // (a != lo), combined eight at a time with the rollout's bits / codes (e2m1_guided_{compact,full}_pack8).
    // quantize_block took this path only when every nonzero quotient is >= 2^-99, so a is zero or normal and
    // u = fl(|x| / t) * 2^-14 exactly.
    const float t14 = __fmul_rn(t, 16384.0f), r14 = __fmul_rn(r, 0x1p-14f);
    Philox4 rnd;
#pragma unroll
    for (int k = 0; k < N / 8; ++k) {
      const SignBytes8 sb = sign_bytes8_at(x, k);
      float q[8];
      uint32_t off_grid = 0u;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int e = 8 * k + i;
        if constexpr (MODE == kSR) {
          if (e % 4 == 0) rnd = sr_words_scheduled(ctr0 + e / 4, p.offset, p.keys);
        }
        const float xi = x[e];
        const float a = fminf(div_rn_with_rcp(fabsf(xi), t14, r14), kE2M1Max * 0x1p-14f);
        if constexpr (MODE == kSR) {
          q[i] = e2m1_sr_grid_x2m14(a, rnd.w[e % 4]);
        } else {
          q[i] = e2m1_floor_grid_x2m14(a);
          if (a != q[i]) off_grid |= 1u << (4 * i);
        }
      }
      const uint32_t lo = e2m1_pack8_abs_x2m14<false>(q, sb);
      if constexpr (MODE == kSR) {
        w[k] = lo;
      } else if constexpr (MODE == kGuidedCompact) {
        w[k] = e2m1_guided_compact_pack8(lo, off_grid, bits_to_nibble_lsbs(guide_bits >> (8 * k)));
      } else {
        w[k] = e2m1_guided_full_pack8(lo, off_grid, k == 0 ? guide_codes.x : guide_codes.y);
      }
    }
  } else {
    quantize_elems_bits<MODE, FAST, N>(x, t, r, ctr0, p, guide_bits, guide_codes, w);
  }
}

// The element loop of quantize_elems for SR, guided, and RTN's division path: codes read off the float's bits.
template <int MODE, bool FAST, int N>
__device__ __forceinline__ void quantize_elems_bits(const float (&x)[N], float t, float r, uint64_t ctr0,
                                                    const QuantParams& p, uint32_t guide_bits, uint2 guide_codes,
                                                    uint32_t (&w)[N / 8]) {
#pragma unroll
  for (int k = 0; k < N / 8; ++k) w[k] = 0u;
  Philox4 rnd;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if constexpr (MODE == kSR) {
      if (i % 4 == 0) rnd = sr_words_scheduled(ctr0 + i / 4, p.offset, p.keys);
    }
    float va;
    uint32_t sign;
    if constexpr (FAST) {
      const float ax = fabsf(x[i]);
      va = div_rn_with_rcp(ax, t, r);
      sign = (__float_as_uint(x[i]) >> 28) & 8u;  // t > 0: v has x's sign (-0.0 included)
      // RTN needs no exact tiny quotients (anything below 0.25 is code 0); SR / guided distinguish 0 from > 0 and
      // take this path only when quantize_block proved that no |x| or quotient of the block is tiny.
    } else {
      const float v = __fdiv_rn(x[i], t);
      va = fabsf(v);
      sign = sign_nibble(v);
    }
    const uint32_t word = MODE == kSR ? rnd.w[i % 4] : 0u;
    const uint32_t mag = element_magnitude<MODE>(va, sign, word, guide_bits, guide_codes, i);
    w[i / 8] |= (mag | sign) << (4 * (i % 8));
  }
}

// Codes of N elements of one finite block given the block's divisor t and its amax bits (SPEC 2, 4, 5). guide:
// compact bits (bit i for element i) or full codes (nibble i of .x for i < 8, of .y above). The reciprocal shortcut
// is taken when t, 1/t and every quotient of the block are far from under/overflow (the common case, judged from
// the block's amax); __fdiv_rn otherwise. t == 0 gives v = +0, code 0, in every mode.
// raw16: as quantize_elems'.
template <int MODE, int N, int IMPL>
__device__ __forceinline__ void quantize_block(const float (&x)[N], uint32_t max_bits, float t, uint64_t ctr0,
                                               const QuantParams& p, uint32_t guide_bits, uint2 guide_codes,
                                               uint32_t (&w)[N / 8], const uint4* raw16 = nullptr) {
  if (!(t > 0.0f)) {  // t == 0, or NaN (g underflowed to 0 and the block is all zero: s_b = e4m3(0 / 0)); codes 0
#pragma unroll
    for (int k = 0; k < N / 8; ++k) w[k] = 0u;
    return;
  }
  const float r = __frcp_rn(t);
  bool fast = t >= 0x1p-100f && t <= 0x1p100f && __fmul_rn(__uint_as_float(max_bits), r) <= 0x1p100f;
  if constexpr (MODE != kRTN) {
    // The reciprocal quotient v is exact unless |x| or v is tiny (< 2^-100). Both are >= 2^-100 for every nonzero
    // element when the smallest nonzero |x| of the block, m, has m >= 2^-100 and fl(m * r) >= 2^-99 (each nonzero
    // |x| >= m, q = fl(|x| r) >= 2^-99 and v is within an ulp of q); zeros give v = 0 either way. Otherwise the
    // block takes __fdiv_rn (the reference operation itself). m - 1 on the bits maps +-0 to 0xFFFFFFFF. (The loop is
    // min_nonzero_abs_bits_m1's; calling it here changed the SASS of 76 kernels, so it stays inline until a GPU run.)
    uint32_t min_m1 = 0xFFFFFFFFu;
#pragma unroll
    for (int i = 0; i < N; ++i) min_m1 = min(min_m1, (__float_as_uint(x[i]) & 0x7FFFFFFFu) - 1u);
    const float m = __uint_as_float(min_m1 + 1u);
    fast = fast && (min_m1 == 0xFFFFFFFFu || (m >= 0x1p-100f && __fmul_rn(m, r) >= 0x1p-99f));
  }
  if (fast) {
    if constexpr (MODE == kRTN && IMPL == kImplLean) {
      if (rtn_needs_no_clamp(__fmul_rn(__uint_as_float(max_bits), r))) {  // the lean element code without the clamp
        quantize_rtn_abs_x2m14<true, N, false>(x, t, r, w);
        return;
      }
    }
    quantize_elems<MODE, true, N, IMPL>(x, t, r, ctr0, p, guide_bits, guide_codes, w, raw16);
  } else {
    quantize_elems<MODE, false, N, IMPL>(x, t, r, ctr0, p, guide_bits, guide_codes, w);
  }
}

// Dequantized values of N codes of one block (fake quant, dequantize): fl(fl(q * s) * g), NaN for a non-finite
// block. q * s is formed as (q * 2^-14) * (s * 2^14): both factors and the product are exact, so this is the
// reference's fl(q * s).
template <int N>
__device__ __forceinline__ void dequant_codes(const uint32_t (&w)[N / 8], uint8_t scale, float g, float (&y)[N]) {
  const float s14 = __fmul_rn(e4m3_to_float(scale), 16384.0f);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    y[i] = __fmul_rn(__fmul_rn(e2m1_value_x2m14((w[i / 8] >> (4 * (i % 8))) & 0xFu), s14), g);
  }
}

// fl(1/6), correctly rounded.
constexpr float kRcp6 = 0x1.555556p-3f;

// rg = fl(1 / g) when g lies in [2^-50, 2^50], else 0 (the scale byte then takes the division path).
__device__ __forceinline__ float rcp_g_in_range(float g) {
  return (g >= 0x1p-50f && g <= 0x1p50f) ? __frcp_rn(g) : 0.0f;
}

// s_b = e4m3_rn(fl(fl(amax / 6) / g)) (SPEC 2). When amax is in [2^-47, 2^50] and rg != 0, both divisions go through
// the correctly rounded reciprocals (div_rn_with_rcp with fl(1/6) and rg): every dividend, divisor and quotient then
// lies in [2^-100, 2^100], where that division is exact. Otherwise the reference's two __fdiv_rn.
__device__ __forceinline__ uint8_t nvfp4_scale_byte_rcp(uint32_t amax_bits, float g, float rg) {
  const float amax = __uint_as_float(amax_bits);
  if (rg != 0.0f && amax_bits - 0x28000000u <= 0x58800000u - 0x28000000u) {  // bits of 2^-47 .. 2^50
    return e4m3_rn(div_rn_with_rcp(div_rn_with_rcp(amax, kE2M1Max, kRcp6), g, rg));
  }
  return nvfp4_scale_byte(amax, g);
}

// Everything block fb produces once its 16 x are in one thread's registers and its g is known: the 8 code bytes,
// the mbits, the fake-quant values and the scale byte. (g_out is written by the kernels, once per row.)
// guide_bits: the rollout's 16 mantissa bits (compact); guide_codes: its 16 rollout codes (full). raw16: as
// quantize_block's.
template <typename T, int MODE, bool FAKE, int IMPL>
__device__ __forceinline__ void process_block(const QuantParams& p, const float (&x)[kNvfp4Block], uint32_t max_bits,
                                              float g, float rg, uint64_t fb, int64_t row, int64_t kbi,
                                              uint32_t guide_bits, uint2 guide_codes,
                                              const uint4* raw16 = nullptr) {
  bool finite = max_bits < 0x7F800000u;
  uint8_t s;
  float t;
  if constexpr (MODE == kGuidedCompact || MODE == kGuidedFull) {
    s = __ldg(p.guide_scales + fb);
    t = nvfp4_block_divisor(s, g);
    finite = finite && isfinite(t);  // a rollout NaN scale makes the block NaN
  } else {
    s = nvfp4_scale_byte_rcp(max_bits, g, rg);
    t = nvfp4_block_divisor(s, g);
  }
  uint32_t codes[2] = {0u, 0u};
  if (finite) {
    quantize_block<MODE, kNvfp4Block, IMPL>(x, max_bits, t, 4 * fb, p, guide_bits, guide_codes, codes, raw16);
  } else {
    s = kE4M3NaN;
  }
  constexpr bool kOutputsKnown = IMPL == kImplLean && !FAKE;  // lean quantize: codes and scales always exist
  if (kOutputsKnown || p.codes != nullptr) reinterpret_cast<uint2*>(p.codes)[fb] = make_uint2(codes[0], codes[1]);
  if constexpr (FAKE) {
    float y[kNvfp4Block];
    dequant_codes<kNvfp4Block>(codes, s, g, y);
    store_floats<T, kNvfp4Block>(reinterpret_cast<T*>(p.y) + fb * kNvfp4Block, y);
  }
  if (p.mbits != nullptr) {
    reinterpret_cast<uint16_t*>(p.mbits)[fb] = (uint16_t)(nibble_lsbs(codes[0]) | (nibble_lsbs(codes[1]) << 8));
  }
  if (kOutputsKnown || p.scales != nullptr) {
    if (p.swizzle) {
      p.scales[swizzled_scale_offset(row, kbi, p.kb_pad)] = s;
    } else {
      p.scales[fb] = s;
    }
  }
}

// Zero fill of the swizzled layout's padding (rows >= R or scale columns >= kb), grid-stride.
__device__ void swizzle_pad_zero(const QuantParams& p, int64_t tid, int64_t nthreads) {
  const int64_t chunks = p.kb_pad / 4;
  const int64_t tile_bytes = chunks * 512;
  const int64_t n_tiles = p.rows_pad / 128;
  const int64_t j1 = (p.rows % 128) ? tile_bytes : 0;         // the whole last row tile
  const int64_t j2 = (p.kb % 4) ? n_tiles * 512 : 0;          // the last column chunk of every tile
  for (int64_t j = tid; j < j1 + j2; j += nthreads) {
    int64_t o;
    if (j < j1) {
      o = (n_tiles - 1) * tile_bytes + j;
    } else {
      const int64_t jj = j - j1;
      o = (jj / 512) * tile_bytes + (chunks - 1) * 512 + (jj % 512);
    }
    const int64_t tile = o / tile_bytes, rem = o % tile_bytes;
    const int64_t r = rem % 512;
    const int64_t m = tile * 128 + ((r % 16) / 4) * 32 + r / 16;
    const int64_t k = (rem / 512) * 4 + r % 4;
    if (m >= p.rows || k >= p.kb) p.scales[o] = 0;
  }
}

// Raw 16-byte vectors of one whole NVFP4 block (zeros when the block does not exist).
template <typename T>
using BlockRaw = RawBlock<T, kNvfp4Block>;

template <typename T>
__device__ __forceinline__ BlockRaw<T> load_block(const T* x, uint64_t fb, bool ok) {
  return load_raw_block<T, kNvfp4Block>(x, fb, ok);
}

// max |x| of a block as float bits (raw_max_abs_bits over its vectors; kPackedMax: its choice of instructions).
template <typename T, bool kPackedMax = true>
__device__ __forceinline__ uint32_t block_max_abs_bits(const BlockRaw<T>& raw) {
  return raw_max_abs_bits<T, BlockRaw<T>::kVecs, kPackedMax>(raw.v);
}

// The block's 16 values as floats (exact); returns block_max_abs_bits.
template <typename T, bool kPackedMax = true>
__device__ __forceinline__ uint32_t unpack_block(const BlockRaw<T>& raw, float (&x)[kNvfp4Block]) {
  constexpr int kV = ElemTraits<T>::kPerVec;
#pragma unroll
  for (int v = 0; v < BlockRaw<T>::kVecs; ++v) vec_to_float<T>(raw.v[v], x + v * kV);
  return block_max_abs_bits<T, kPackedMax>(raw);
}

// Folds a block into the row's finite amax (SPEC 2: g over finite values only): its max |x| bits mb, or, for a block
// holding a NaN / Inf (mb >= 0x7F800000), the max over its finite values.
template <typename T>
__device__ __forceinline__ void fold_block_finite_max(uint32_t& finite_max, uint32_t mb, const BlockRaw<T>& raw) {
  if (mb < 0x7F800000u) {
    finite_max = max(finite_max, mb);
  } else {
    float x[kNvfp4Block];
    unpack_block<T>(raw, x);
    finite_max = max(finite_max, max_abs_bits_finite(x));
  }
}

}  // namespace
}  // namespace trace_ext
