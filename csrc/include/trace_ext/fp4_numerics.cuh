// Device numerics shared by every trace_ext kernel: the E2M1 / E4M3 / E8M0 codecs, the NVFP4 block
// scale, the three rounding modes of SPEC sections 2, 4 and 5, and Philox4x32-10.
//
// Every function here is the CUDA twin of a function in python/trace_ext/formats.py or reference.py and
// must stay bit-identical to it. All float arithmetic is spelled with __f*_rn intrinsics so that nvcc can
// never contract it into an FMA (SPEC preamble: fl(.) is one IEEE binary32 operation, RNE, no FTZ).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

namespace trace_ext {

constexpr float kE2M1Max = 6.0f;            // largest E2M1 magnitude
constexpr float kE4M3Max = 448.0f;          // largest finite E4M3
constexpr float kNvfp4GlobalDiv = 2688.0f;  // 6 * 448: maps the scope amax onto the top of both grids
constexpr int kNvfp4Block = 16;             // NVFP4 elements per E4M3 block scale
constexpr int kMxfp4Block = 32;             // MXFP4 elements per E8M0 block scale
constexpr uint8_t kE4M3NaN = 0x7F;          // scale byte of a non-finite NVFP4 block
constexpr uint8_t kE8M0NaN = 0xFF;          // scale byte of a non-finite MXFP4 block

// Rounding modes, numbered as in the op schemas (trace_ext::nvfp4_quantize's `rounding`).
enum Rounding : int { kRTN = 0, kSR = 1, kGuidedCompact = 2, kGuidedFull = 3 };

// ---- E2M1 ---------------------------------------------------------------------------------------
// Magnitudes times two, one nibble per 3-bit code: {0, 1, 2, 3, 4, 6, 8, 12} / 2.
constexpr uint32_t kE2M1TwiceMagnitudes = 0xC8643210u;

__device__ __forceinline__ float e2m1_magnitude(uint32_t mag_code) {
  return __uint2float_rn((kE2M1TwiceMagnitudes >> (4u * mag_code)) & 0xFu) * 0.5f;  // exact
}

__device__ __forceinline__ float e2m1_value(uint32_t code) {
  float m = e2m1_magnitude(code & 7u);
  return (code & 8u) ? -m : m;
}

// Round to nearest, ties to the even code, saturate to 6 (SPEC 1). Returns the 3-bit magnitude code.
__device__ __forceinline__ uint32_t e2m1_rn_magnitude(float a) {
  return (uint32_t)(a > 0.25f) + (uint32_t)(a >= 0.75f) + (uint32_t)(a > 1.25f) + (uint32_t)(a >= 1.75f) +
         (uint32_t)(a > 2.5f) + (uint32_t)(a >= 3.5f) + (uint32_t)(a > 5.0f);
}

__device__ __forceinline__ uint32_t sign_nibble(float v) { return signbit(v) ? 8u : 0u; }

// Largest grid magnitude code whose value is <= a (a in [0, 6]).
__device__ __forceinline__ uint32_t e2m1_floor_magnitude(float a) {
  return (uint32_t)(a >= 0.5f) + (uint32_t)(a >= 1.0f) + (uint32_t)(a >= 1.5f) + (uint32_t)(a >= 2.0f) +
         (uint32_t)(a >= 3.0f) + (uint32_t)(a >= 4.0f) + (uint32_t)(a >= 6.0f);
}

// The adjacent grid bracket lo <= a <= hi of SPEC 4/5 (lo == hi when a is on the grid).
struct E2M1Bracket {
  uint32_t lo, hi;      // magnitude codes
  float lo_val, hi_val;  // their values
};

__device__ __forceinline__ E2M1Bracket e2m1_bracket(float a) {
  E2M1Bracket b;
  b.lo = e2m1_floor_magnitude(a);
  b.lo_val = e2m1_magnitude(b.lo);
  b.hi = b.lo + (uint32_t)(a > b.lo_val);
  b.hi_val = e2m1_magnitude(b.hi);
  return b;
}

// SPEC 4: magnitude hi iff u < (a - lo) / (hi - lo); both operations are exact in fp32.
__device__ __forceinline__ uint32_t e2m1_sr_magnitude(float a, uint32_t random_word) {
  E2M1Bracket b = e2m1_bracket(a);
  if (b.lo == b.hi) return b.lo;
  float u = __uint2float_rn(random_word >> 8) * 0x1p-24f;
  float p = __fdiv_rn(__fsub_rn(a, b.lo_val), __fsub_rn(b.hi_val, b.lo_val));
  return (u < p) ? b.hi : b.lo;
}

// Same result as e2m1_sr_magnitude, cheaper: the bracket width hi - lo is 0.5, 1 or 2 (a power of two), so
// fl((a - lo) / (hi - lo)) equals (a - lo) times the exact reciprocal power of two (a - lo is exact by Sterbenz
// and at least 2^-21 when lo >= 4, so the product never underflows).
__device__ __forceinline__ uint32_t e2m1_sr_magnitude_pow2(float a, uint32_t random_word) {
  E2M1Bracket b = e2m1_bracket(a);
  float inv_width = b.lo < 4u ? 2.0f : (b.lo < 6u ? 1.0f : 0.5f);
  float u = __uint2float_rn(random_word >> 8) * 0x1p-24f;
  float p = __fmul_rn(__fsub_rn(a, b.lo_val), inv_width);
  return (b.lo != b.hi && u < p) ? b.hi : b.lo;
}

// The code LSBs (mantissa bits) of the eight 4-bit codes packed in w, as one byte (code i -> bit i).
__device__ __forceinline__ uint32_t nibble_lsbs(uint32_t w) {
  w &= 0x11111111u;
  w = (w | (w >> 3)) & 0x03030303u;
  w = (w | (w >> 6)) & 0x000F000Fu;
  return (w | (w >> 12)) & 0xFFu;
}

// ---- The same three roundings read off the float's bits (no compare chains; used by the quantize kernels) ----
// Each returns exactly what its reference twin above returns; tools: for a >= 1 the E2M1 grid is "1 mantissa
// bit", for a < 1 it is "multiples of 0.5". Exhaustively / randomly checked against reference.py.

// e2m1_rn_magnitude for a >= 0 (finite or +inf): RNE to 1 mantissa bit for a >= 1 (saturating at code 7),
// and round(2a) via the ulp of 2^22 (0.5) for a < 1.
__device__ __forceinline__ uint32_t e2m1_rn_magnitude_bits(float a) {
  const uint32_t b = __float_as_uint(a);
  const uint32_t sub = __float_as_uint(__fadd_rn(a, 4194304.0f)) - 0x4A800000u;
  const uint32_t nrm = min((b + 0x1FFFFFu + ((b >> 22) & 1u)) >> 22, 259u) - 252u;
  return a < 1.0f ? sub : nrm;
}

// Floor bracket end (largest grid magnitude code <= a) and whether a lies on the grid, a in [0, 6].
__device__ __forceinline__ uint32_t e2m1_floor_magnitude_bits(float a) {
  const uint32_t b = __float_as_uint(a);
  return a < 1.0f ? (uint32_t)(a >= 0.5f) : (b >> 22) - 252u;
}
__device__ __forceinline__ bool e2m1_on_grid(float a) {
  return a < 1.0f ? (a == 0.0f || a == 0.5f) : (__float_as_uint(a) & 0x3FFFFFu) == 0u;
}

// e2m1_sr_magnitude for a in [0, 6]: u < (a - lo) / (hi - lo) as an integer comparison of the 24 random bits
// with the position of a inside its bracket (exact); for a < 0.25 the position 2a * 2^24 is compared through
// its ceiling (k < X <=> k < ceil(X) for integer k), taken with one round-up add at the ulp-1 binade.
__device__ __forceinline__ uint32_t e2m1_sr_magnitude_bits(float a, uint32_t random_word) {
  const uint32_t b = __float_as_uint(a);
  const uint32_t k = random_word >> 8;
  const int be = (int)(b >> 23);
  const int sh = max(min(be - 125, 2), 0);  // 0: a in [0.25, 0.5), 1: [0.5, 1), 2: [1, 6]
  const uint32_t lo = (uint32_t)max((int)(b >> 22) - 252, sh);
  const uint32_t frac = (b | 0x800000u) & (0xFFFFFFu >> sh);
  const uint32_t up = (k >> sh) < frac ? 1u : 0u;
  const uint32_t ceil_x = __float_as_uint(__fadd_ru(__fmul_rn(a, 0x1p25f), 0x1p23f)) - 0x4B000000u;
  const uint32_t up_small = k < ceil_x ? 1u : 0u;
  return be >= 125 ? lo + up : up_small;
}

// SPEC 5 guided roundings from the bits: compact picks the bracket end with the rollout's mantissa bit; full
// lands on hi iff the rollout's value, seen on v's side of zero, reaches hi (a -0 rollout only reaches hi == 0,
// where lo == hi anyway).
__device__ __forceinline__ uint32_t e2m1_guided_compact_magnitude_bits(float a, uint32_t mantissa_bit) {
  const uint32_t lo = e2m1_floor_magnitude_bits(a);
  const uint32_t hi = lo + (e2m1_on_grid(a) ? 0u : 1u);
  return (lo & 1u) == mantissa_bit ? lo : hi;
}
__device__ __forceinline__ uint32_t e2m1_guided_full_magnitude_bits(uint32_t v_sign_nibble, float a,
                                                                    uint32_t rollout_code) {
  const uint32_t lo = e2m1_floor_magnitude_bits(a);
  const uint32_t hi = lo + (e2m1_on_grid(a) ? 0u : 1u);
  const bool same_side = (rollout_code & 8u) == v_sign_nibble;
  return (same_side && (rollout_code & 7u) >= hi) ? hi : lo;
}

// e2m1_value(code) * 2^-14, exactly, without an int->float conversion: the 3 magnitude bits placed at bits 9..11
// of an fp16 (and the sign at bit 15) are the E2M1 value scaled by 2^-14 (code 1 lands on the fp16 subnormal 2^-15).
__device__ __forceinline__ float e2m1_value_x2m14(uint32_t code) {
  return __half2float(__ushort_as_half((unsigned short)(((code & 7u) << 9) | ((code & 8u) << 12))));
}

// __frcp_rn(x) for x with |x| in [2^-100, 2^100] (callers test the range), without __frcp_rn's own range test and
// slow-path call: MUFU.RCP and one FMA Newton step, the sequence ptxas 13.0 emits for rcp.rn.f32 there. Equal to
// __frcp_rn for every significand at exponents 0, +-50, +-99, both signs (H200, tools/probes/rcp_sequence.cu).
__device__ __forceinline__ float frcp_rn_mid(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  const float e = __fmaf_rn(r, x, -1.0f);
  return __fmaf_rn(r, -e, r);
}

// fl(a / t) for a >= 0 with r = fl(1 / t) precomputed (Markstein: q = fl(a r), the remainder a - q t is exact
// in one FMA, q + rem * r rounds correctly). Valid when t and r are normal, a / t cannot overflow, and both a
// and the quotient are >= 2^-100 (callers check; outside that use __fdiv_rn). Checked in exact arithmetic.
__device__ __forceinline__ float div_rn_with_rcp(float a, float t, float r) {
  const float q = __fmul_rn(a, r);
  const float rem = __fmaf_rn(-q, t, a);
  return __fmaf_rn(rem, r, q);
}

// ---- RTN in the 2^-14-scaled domain (the quantize kernels' fast path) ------------------------------------------
// With u = v * 2^-14 every E2M1 grid value q becomes q * 2^-14, which is an fp16 number whose bits 9..11 are the
// 3-bit magnitude code (code 1 = 2^-15 is the fp16 subnormal with mantissa 0x200; codes 2..7 have exponent field
// 1..3 and mantissa bit 9). So RTN is done in fp32 arithmetic (FMA pipe) and the codes are read off fp16 bits,
// eight at a time. Dividing by t * 2^14 with the reciprocal r * 2^-14 gives u = fl(x / t) * 2^-14 exactly wherever
// the unscaled reciprocal division is exact and v >= 2^-102 (smaller quotients round to code 0 either way).

// RTN(v) * 2^-14 from u = v * 2^-14 >= 0: saturate at 6; below 2 (u < 2^-13) round to a multiple of 2^-15 with the
// magic add (the ulp of 256 is 2^-15, ties to even = even code); from 1 up, round to 2 significant bits with the
// Veltkamp split (p = u (2^22 + 1), u - ... keeps the top 2 bits, RNE, ties to even). Exhaustively checked: the fp16
// code of the result equals e2m1_rn_magnitude(v) for every non-negative float v and +inf.
__device__ __forceinline__ float e2m1_rn_grid_x2m14(float u) {
  const float a = fminf(u, 6.0f * 0x1p-14f);
  const float small = __fsub_rn(__fadd_rn(a, 256.0f), 256.0f);
  const float p = __fmul_rn(a, 4194305.0f);
  const float big = __fsub_rn(p, __fsub_rn(p, a));
  return a < 0x1p-13f ? small : big;
}

// Eight signed grid values q_i * 2^-14 (sign = the element's sign, -0 included) -> one word of eight 4-bit codes,
// nibble i = element i. The even and the odd elements are packed into fp16 pairs; their high bytes (sign at bit 7,
// code at bits 1..3, all other bits zero) are gathered with two byte permutes and moved into the nibbles.
__device__ __forceinline__ uint32_t e2m1_pack8_x2m14(const float (&q)[8]) {
  const __half2 h02 = __floats2half2_rn(q[0], q[2]), h46 = __floats2half2_rn(q[4], q[6]);
  const __half2 h13 = __floats2half2_rn(q[1], q[3]), h57 = __floats2half2_rn(q[5], q[7]);
  const uint32_t even = __byte_perm(*reinterpret_cast<const uint32_t*>(&h02),
                                    *reinterpret_cast<const uint32_t*>(&h46), 0x7531);  // bytes: q0 q2 q4 q6
  const uint32_t odd = __byte_perm(*reinterpret_cast<const uint32_t*>(&h13),
                                   *reinterpret_cast<const uint32_t*>(&h57), 0x7531);   // bytes: q1 q3 q5 q7
  const uint32_t lo = ((even >> 1) | (even >> 4)) & 0x0F0F0F0Fu;  // code bits 1..3 -> 0..2, sign bit 7 -> 3
  const uint32_t hi = ((odd << 3) | odd) & 0xF0F0F0F0u;           // code bits 1..3 -> 4..6, sign stays at 7
  return lo | hi;
}

// prmt.b32 (byte permute) with PTX's full selector: bit 3 of a selector nibble replicates the sign (bit 7) of the
// selected byte over the result byte.
__device__ __forceinline__ uint32_t prmt_b32(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

// min of two pairs of unsigned 16-bit lanes (one instruction on sm_90+).
__device__ __forceinline__ uint32_t min_u16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("min.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Per 16-bit lane of two packed pairs of T (bf16 / fp16): max(|a|, |b|), NaN when either is NaN, the sign bit the XOR
// of the inputs' (max.NaN.xorsign.abs: one HMNMX2 on sm_90 with the |.| folded into its operands; no flush of
// subnormals). Finite magnitudes order like their bits, so the magnitude bits are the max of the magnitudes' bits.
template <typename T>
__device__ __forceinline__ uint32_t max_abs_nan_x2(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  } else {
    asm("max.NaN.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  }
  return d;
}

// max of two pairs of unsigned 16-bit lanes (one instruction on sm_90+).
__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// The RTN fast path's saturation is a no-op for a block when q_max = fl(amax * r) < 6.5 (r = fl(1 / t)): then amax / t
// < 6.5 (1 + 2^-22) (two roundings of relative size <= 2^-24), so every quotient fl(|x| / t) <= fl(amax / t) < 7 rounds
// to at most 6 and e2m1_pack8_abs_x2m14 may skip its clamp (one min.u16x2 per two elements). Every block with a normal,
// unsaturated scale byte has q_max <= ~6.4 (the E4M3 rounding of d / g is within 2^-4 of it), so in practice all blocks
// but those with subnormal or clamped scales take the shorter code; the codes are the same either way.
constexpr float kRtnNoClampQuotient = 6.5f;
__device__ __forceinline__ bool rtn_needs_no_clamp(float q_max) { return q_max < kRtnNoClampQuotient; }

// RTN as e2m1_rn_grid_x2m14 but without the saturation: u >= 6 * 2^-14 (finite) rounds to a value >= 6 * 2^-14 that
// e2m1_pack8_abs_x2m14<true> saturates. (Rounding is monotone and 6 * 2^-14 is on the grid, so saturating after
// rounding equals rounding the saturated u; u * (2^22 + 1) stays finite for u < 2^100.) Checked in numpy emulation
// (tests/test_rtn_sat_pack_emulation.py).
__device__ __forceinline__ float e2m1_rn_grid_unsat_x2m14(float u) {
  const float small = __fsub_rn(__fadd_rn(u, 256.0f), 256.0f);
  const float p = __fmul_rn(u, 4194305.0f);
  const float big = __fsub_rn(p, __fsub_rn(p, u));
  return u < 0x1p-13f ? small : big;
}

// The same rounding as e2m1_rn_grid_unsat_x2m14 (equal results below 6 * 2^-14, >= 6 * 2^-14 above) in four
// instructions instead of six: one magic add whose magic number is a power of two picked from u's binade. With
// E = 2^max(e(u), -14) (u's exponent bits, at least those of 2^-14; +0 and subnormals take 2^-14) and M = E * 2^22,
// u + M lies in [M, 2M) whose ulp is E / 2, so fl(u + M) is u rounded to a multiple of E / 2, ties to the even
// multiple (M / ulp = 2^23 is even): 2 significant bits for u >= 2^-14 (RNE to one mantissa bit), multiples of 2^-15
// below (the magic add of 256). E * 2^22 is exact, so each FMA is one rounding of u + M and of fl(u + M) - M (the
// latter exact: a multiple of E / 2 in [0, 2E]). u < 2^86 (quotients < 2^100) keeps M finite. Checked in numpy
// emulation (tests/test_rtn_pow2_magic_emulation.py) against the reference rounding.
__device__ __forceinline__ float e2m1_rn_grid_pow2_x2m14(float u) {
  const float e = __uint_as_float(max(__float_as_uint(u) & 0x7F800000u, 0x38800000u));  // 0x38800000 = 2^-14
  const float s = __fmaf_rn(e, 4194304.0f, u);
  return __fmaf_rn(-e, 4194304.0f, s);
}

// The signs (bit 31) of eight sign sources s_i as bytes of 0x00 / 0xFF: .even = s0 s2 s4 s6, .odd = s1 s3 s5 s7.
// prmt selector 0xFB: byte 0 = sign of a's byte 3, byte 1 = sign of b's byte 3; 0x5410 joins two such pairs.
// (Taken before the element math, so that two words instead of eight sources stay live.)
struct SignBytes8 {
  uint32_t even, odd;
};
__device__ __forceinline__ SignBytes8 sign_bytes8(const uint32_t (&s)[8]) {
  return SignBytes8{prmt_b32(prmt_b32(s[0], s[2], 0xFBu), prmt_b32(s[4], s[6], 0xFBu), 0x5410u),
                    prmt_b32(prmt_b32(s[1], s[3], 0xFBu), prmt_b32(s[5], s[7], 0xFBu), 0x5410u)};
}

// sign_bytes8 of the eight 16-bit values in raw words w[0..3] (value 2i in the low half of w[i], 2i + 1 in the high
// half): four byte permutes instead of six (selector 0xFDB9 replicates the sign bits 15 and 31 of both words).
__device__ __forceinline__ SignBytes8 sign_bytes8_raw16(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
  const uint32_t s03 = prmt_b32(w0, w1, 0xFDB9u), s47 = prmt_b32(w2, w3, 0xFDB9u);  // bytes: signs 0 1 2 3 / 4 5 6 7
  return SignBytes8{prmt_b32(s03, s47, 0x6420u), prmt_b32(s03, s47, 0x7531u)};
}

// sign_bytes8 of elements 8 k .. 8 k + 7 of x.
template <int N>
__device__ __forceinline__ SignBytes8 sign_bytes8_at(const float (&x)[N], int k) {
  uint32_t s[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = __float_as_uint(x[8 * k + i]);
  return sign_bytes8(s);
}

// The smallest nonzero |x_i| minus one ulp, on the bits (+-0 map to 0xFFFFFFFF: all zero gives 0xFFFFFFFF), for the
// quantizers' test that no nonzero quotient of a block is tiny.
template <int N>
__device__ __forceinline__ uint32_t min_nonzero_abs_bits_m1(const float (&x)[N]) {
  uint32_t min_m1 = 0xFFFFFFFFu;
#pragma unroll
  for (int i = 0; i < N; ++i) min_m1 = min(min_m1, (__float_as_uint(x[i]) & 0x7FFFFFFFu) - 1u);
  return min_m1;
}

// Four fp16x2 words of non-negative 2^-14-scaled magnitudes saturated at 6 * 2^-14 (one min.u16x2 per word: for
// non-negative fp16 the bit order is the value order).
__device__ __forceinline__ void saturate_x2m14_halves(uint32_t& a, uint32_t& b, uint32_t& c, uint32_t& d) {
  constexpr uint32_t kSat = 0x0E000E00u;  // fp16 bits of 6 * 2^-14, twice
  a = min_u16x2(a, kSat);
  b = min_u16x2(b, kSat);
  c = min_u16x2(c, kSat);
  d = min_u16x2(d, kSat);
}

// Eight non-negative grid values g_i * 2^-14 and their signs (sign_bytes8) -> one word of eight 4-bit codes, nibble
// i = element i. kSaturate: the g_i may be unsaturated (any value >= 6 * 2^-14, +inf included, means code 7); the
// fp16 pairs are then saturated by one unsigned 16-bit min per pair (fp16 bits of non-negative values order like the
// values; 6 * 2^-14 is 0x0E00). Otherwise every g_i must be <= 6 * 2^-14. Packed as in e2m1_pack8_x2m14 (the high
// bytes now hold only code bits 1..3, so no masks); the sign bytes give bit 3 of each nibble (instead of one OR per
// element into the float).
template <bool kSaturate>
__device__ __forceinline__ uint32_t e2m1_pack8_abs_x2m14(const float (&g)[8], SignBytes8 sb) {
  const __half2 f02 = __floats2half2_rn(g[0], g[2]), f46 = __floats2half2_rn(g[4], g[6]);
  const __half2 f13 = __floats2half2_rn(g[1], g[3]), f57 = __floats2half2_rn(g[5], g[7]);
  uint32_t h02 = *reinterpret_cast<const uint32_t*>(&f02), h46 = *reinterpret_cast<const uint32_t*>(&f46);
  uint32_t h13 = *reinterpret_cast<const uint32_t*>(&f13), h57 = *reinterpret_cast<const uint32_t*>(&f57);
  if constexpr (kSaturate) saturate_x2m14_halves(h02, h46, h13, h57);
  const uint32_t even = __byte_perm(h02, h46, 0x7531);  // bytes: q0 q2 q4 q6, code at bits 1..3, nothing else
  const uint32_t odd = __byte_perm(h13, h57, 0x7531);   // bytes: q1 q3 q5 q7
  return (even >> 1) | (odd << 3) | (sb.even & 0x08080808u) | (sb.odd & 0x80808080u);
}

// ---- SR and guided rounding in the same 2^-14-scaled domain ----------------------------------------------------
// Inputs: a = min(v * 2^-14, 6 * 2^-14) with v >= 2^-100 or v == 0 (the quantize kernels' fast path guarantees it,
// so a is zero or a normal float). Grid values q * 2^-14 come back as floats for e2m1_pack8_abs_x2m14<false>; guided
// rounding then works on eight packed codes at once. All checked in numpy emulation
// (tests/test_scaled_sr_guided_emulation.py, and once exhaustively: tools/exhaustive_scaled_sr_guided.py).

// The lower bracket end lo (largest grid value <= a). Below 2 (a < 2^-13) the grid is the multiples of 2^-15: floor
// by a round-down add of 256 (ulp 2^-15); from 1 up (a >= 2^-14) it is "2 significant bits": floor by masking the low
// 22 mantissa bits. Each is >= the true floor outside its own range (a floor to a finer grid, or a mask that leaves a
// value <= a), so the smaller of the two is the floor everywhere.
__device__ __forceinline__ float e2m1_floor_grid_x2m14(float a) {
  const float small = __fsub_rn(__fadd_rd(a, 256.0f), 256.0f);
  const float big = __uint_as_float(__float_as_uint(a) & 0xFFC00000u);
  return fminf(small, big);
}

// SPEC 4 from a and the random word: with lo = floor, w the width of the bracket above lo and k = word >> 8, the
// magnitude is hi = lo + w iff k 2^-24 < (a - lo) / w, i.e. iff the real number lo + k (w 2^-24) is < a. k (w 2^-24)
// is exact, so one round-down FMA decides it exactly: fl_rd(y) < a <=> y < a for a float a. On the grid (a == lo, the
// reference's lo == hi) fl_rd(lo + ...) >= a, so lo is kept without a test. w is 2^-15 below 2^-13, else half of the
// binade of a (which is lo's binade there): w 2^-24 = max(2^e(a) 2^-25, 2^-39), taken from a so that it does not
// wait for lo.
__device__ __forceinline__ float e2m1_sr_grid_x2m14(float a, uint32_t random_word) {
  const float lo = e2m1_floor_grid_x2m14(a);
  const float w24 = fmaxf(__fmul_rn(__uint_as_float(__float_as_uint(a) & 0x7F800000u), 0x1p-25f), 0x1p-39f);
  const float k = __uint2float_rn(random_word >> 8);  // exact (< 2^24)
  return __fmaf_rd(k, w24, lo) < a ? __fmaf_rn(w24, 16777216.0f, lo) : lo;
}

// The 8 bits b (element i = bit i) as the code LSBs of eight nibbles (nibble i = element i); inverse of nibble_lsbs.
__device__ __forceinline__ uint32_t bits_to_nibble_lsbs(uint32_t b) {
  b &= 0xFFu;
  b = (b | (b << 12)) & 0x000F000Fu;
  b = (b | (b << 6)) & 0x03030303u;
  return (b | (b << 3)) & 0x11111111u;
}

// Guided rounding on eight packed codes. lo_codes: the codes of the lower bracket ends with v's signs
// (e2m1_pack8_x2m14 of the signed floors); off_grid: nibble i = 1 iff element i is off the grid (a != lo, so
// hi = lo + 1 <= 7 and adding 1 never carries out of the nibble), else 0.
// Compact (SPEC 5): hi iff off the grid and the rollout's bit differs from lo's LSB (then it equals hi's LSB).
__device__ __forceinline__ uint32_t e2m1_guided_compact_pack8(uint32_t lo_codes, uint32_t off_grid,
                                                              uint32_t rollout_lsbs) {
  return lo_codes + (off_grid & (lo_codes ^ rollout_lsbs));
}
// Full (SPEC 5): hi iff off the grid, the rollout's code has v's sign and its magnitude reaches hi = lo + 1, i.e. is
// > lo. Per nibble (8 + R_m) - L_m - 1 lies in [0, 14] (no borrow between nibbles) and has bit 3 set iff R_m > L_m.
// (A rollout of the other sign reaches hi only when hi == 0, which is on the grid.)
__device__ __forceinline__ uint32_t e2m1_guided_full_pack8(uint32_t lo_codes, uint32_t off_grid,
                                                           uint32_t rollout_codes) {
  const uint32_t gt = (rollout_codes | 0x88888888u) - (lo_codes & 0x77777777u) - 0x11111111u;
  const uint32_t take = gt & ~(rollout_codes ^ lo_codes);  // bit 3 of each nibble: R_m > L_m and same sign
  return lo_codes + (off_grid & (take >> 3));
}

// ---- Guided rounding through fp16 round-toward-zero (TRACE_EXT_QUANT_IMPL=guided-lean) --------------------------
// Same inputs as above (a = min(u, 6 * 2^-14), zero or normal). The floors come from one cvt.rz.f16x2.f32 per pair
// and one mask per pair instead of four instructions per element: every grid value q * 2^-14 is an fp16 number
// (bits 9..11 = code), rounding toward zero is the floor to fp16 (a >= 0), and clearing fp16 mantissa bits 0..8 floors
// that to the grid (normal fp16: keeps one mantissa bit = 2 significant bits, a >= 2^-14; subnormal fp16, a < 2^-14:
// keeps multiples of 2^-15); the grid is a subset of fp16, so the two floors compose to the grid's floor. Back in fp32
// (exact), lo - a is exact (Sterbenz for a >= 2^-15, lo = 0 below) and negative exactly when a is off the grid (+0
// on it), so the off-grid bits are the sign bits of the eight differences, gathered like x's signs (sign_bytes8).
// Checked in numpy emulation against the reference (tests/test_guided_rz_emulation.py; every float in [0, 6 * 2^-14]
// once by tools/exhaustive_guided_rz.py).

// cvt.rz.f16x2.f32: (lo, hi) -> fp16 pair rounded toward zero, lo in bits 0..15.
__device__ __forceinline__ uint32_t cvt_rz_f16x2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rz.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// Grid floors of a pair (each in [0, 6 * 2^-14]) as fp16 bits: code at bits 9..11 (and 25..27), nothing else.
__device__ __forceinline__ uint32_t e2m1_floor_pair_rz_x2m14(float a_lo, float a_hi) {
  return cvt_rz_f16x2(a_lo, a_hi) & 0xFE00FE00u;
}

// Lower bracket codes of eight elements with x's signs (what e2m1_pack8_abs_x2m14<false> of the floors gives) and the
// off-grid nibbles (nibble i = 1 iff a_i != lo_i) for e2m1_guided_{compact,full}_pack8.
// kSaturate (guided full only): the a_i may be unsaturated (any finite u >= 0); the floors are saturated as fp16 pairs by
// one min.u16x2 each (rounding toward zero never overflows to inf, and flooring is monotone, so this is the floor of
// min(u, 6 * 2^-14)). An element above 6 * 2^-14 then gets code 7 with its off-grid bit set, which full guidance never
// uses: it takes hi only when the rollout's magnitude exceeds lo's, and no magnitude exceeds 7.
struct GuidedLo8 {
  uint32_t lo, off;
};
template <bool kSaturate = false>
__device__ __forceinline__ GuidedLo8 e2m1_guided_lo8_rz_x2m14(const float (&a)[8], SignBytes8 sb) {
  uint32_t h02 = e2m1_floor_pair_rz_x2m14(a[0], a[2]), h46 = e2m1_floor_pair_rz_x2m14(a[4], a[6]);
  uint32_t h13 = e2m1_floor_pair_rz_x2m14(a[1], a[3]), h57 = e2m1_floor_pair_rz_x2m14(a[5], a[7]);
  if constexpr (kSaturate) saturate_x2m14_halves(h02, h46, h13, h57);
  const uint32_t h[4] = {h02, h13, h46, h57};  // element i: half (i / 2) % 2 of h[(i % 2) + 2 * (i / 4)]
  uint32_t d[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const __half2 p = *reinterpret_cast<const __half2*>(&h[(i % 2) + 2 * (i / 4)]);
    const float lo = ((i / 2) % 2) ? __high2float(p) : __low2float(p);
    d[i] = __float_as_uint(__fsub_rn(lo, a[i]));  // sign bit: a > lo
  }
  const SignBytes8 ob = sign_bytes8(d);
  const uint32_t even = __byte_perm(h02, h46, 0x7531);  // bytes: lo0 lo2 lo4 lo6, code at bits 1..3, nothing else
  const uint32_t odd = __byte_perm(h13, h57, 0x7531);   // bytes: lo1 lo3 lo5 lo7
  return GuidedLo8{(even >> 1) | (odd << 3) | (sb.even & 0x08080808u) | (sb.odd & 0x80808080u),
                   (ob.even & 0x01010101u) | (ob.odd & 0x10101010u)};
}

// bits_to_nibble_lsbs by two multiplies: bit 2j (bit 2j + 1) of b moves by 6j (6j + 3) to bit 8j (8j + 4). Each product
// sums shifted copies of b's even (odd) bits at even bit positions only, at most two per position, so carries land on
// otherwise empty odd positions and never propagate; the target positions hold exactly one term (checked over every
// byte in tests/test_guided_rz_emulation.py).
__device__ __forceinline__ uint32_t bits_to_nibble_lsbs_mul(uint32_t b) {
  return (((b & 0x55u) * 0x00041041u) & 0x01010101u) | (((b & 0xAAu) * 0x00208208u) & 0x10101010u);
}

// SPEC 5, compact guidance: the bracket end whose mantissa bit (code LSB) equals the rollout's bit.
__device__ __forceinline__ uint32_t e2m1_guided_compact_magnitude(float a, uint32_t mantissa_bit) {
  E2M1Bracket b = e2m1_bracket(a);
  return ((b.lo & 1u) == mantissa_bit) ? b.lo : b.hi;
}

// SPEC 5, full guidance: clamp the rollout's signed value into the signed bracket of v. The clamp lands on
// hi exactly when the rollout's value, seen on v's side of zero, reaches hi; the sign is always v's.
__device__ __forceinline__ uint32_t e2m1_guided_full_magnitude(float v, float a, uint32_t rollout_code) {
  E2M1Bracket b = e2m1_bracket(a);
  float r = e2m1_value(rollout_code);
  float r_on_v_side = signbit(v) ? -r : r;
  return (r_on_v_side >= b.hi_val) ? b.hi : b.lo;
}

// ---- E4M3 (OCP E4M3FN) -----------------------------------------------------------------------------
// Round to nearest even, saturate finite values to 448 (cvt.rn.satfinite.e4m3x2.f32 on sm_89+).
__device__ __forceinline__ uint8_t e4m3_rn(float x) {
  return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ float e4m3_to_float(uint8_t byte) {
  __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)byte, __NV_E4M3);  // exact, NaN -> NaN
  return __half2float(*reinterpret_cast<__half*>(&h));
}

// ---- NVFP4 block scale (SPEC 2) -----------------------------------------------------------------------
// Decode scale of a whole scope from its finite amax: g = fl(A / 2688), or 1 when A == 0 / nothing finite.
__device__ __forceinline__ float nvfp4_global_scale(float finite_amax) {
  return finite_amax > 0.0f ? __fdiv_rn(finite_amax, kNvfp4GlobalDiv) : 1.0f;
}

// fl(1 / 2688), correctly rounded.
constexpr float kRcpNvfp4GlobalDiv = 0x1.861862p-12f;

// nvfp4_global_scale by the correctly rounded reciprocal (div_rn_with_rcp) where that division is exact: for a
// finite amax >= 2^-80 the dividend and the quotient (>= 2^-92) are >= 2^-100, 2688 and fl(1/2688) are normal and the
// quotient cannot overflow. Below (and for 0, no finite value) nvfp4_global_scale itself.
__device__ __forceinline__ float nvfp4_global_scale_rcp(float finite_amax) {
  if (finite_amax >= 0x1p-80f) return div_rn_with_rcp(finite_amax, kNvfp4GlobalDiv, kRcpNvfp4GlobalDiv);
  return nvfp4_global_scale(finite_amax);
}

// s_b = e4m3_rn(fl(fl(amax_b / 6) / g)).
__device__ __forceinline__ uint8_t nvfp4_scale_byte(float block_amax, float g) {
  return e4m3_rn(__fdiv_rn(__fdiv_rn(block_amax, kE2M1Max), g));
}

// t_b = fl(float(s_b) * g): the divisor applied to every element of the block.
__device__ __forceinline__ float nvfp4_block_divisor(uint8_t scale_byte, float g) {
  return __fmul_rn(e4m3_to_float(scale_byte), g);
}

// v_i = fl(x_i / t_b), and 0 when t_b == 0.
__device__ __forceinline__ float nvfp4_scaled(float x, float t) { return t == 0.0f ? 0.0f : __fdiv_rn(x, t); }

// x^_i = fl(fl(q_i * s_b) * g).
__device__ __forceinline__ float nvfp4_dequant(uint32_t code, float scale, float g) {
  return __fmul_rn(__fmul_rn(e2m1_value(code), scale), g);
}

// ---- E8M0 / MXFP4 (SPEC 3) -------------------------------------------------------------------------------
// 2^e as an exact fp32 value for e in [-127, 127] (2^-127 is subnormal, still exact).
__device__ __forceinline__ float exp2_exact(int e) {
  return e >= -126 ? __int_as_float((e + 127) << 23) : __int_as_float(1 << (e + 149));
}

__device__ __forceinline__ int floor_log2_bits(float a) {  // a > 0 finite; exponent read from the bits
  int biased = (__float_as_int(a) >> 23) & 0xFF;
  return biased - 127;
}

// Default (OCP "floor") scale exponent, or the never-saturating "ceil" variant.
__device__ __forceinline__ int mxfp4_scale_exponent(float block_amax, bool ceil_mode) {
  if (block_amax == 0.0f) return -127;
  int e;
  if (!ceil_mode) {
    e = floor_log2_bits(block_amax) - 2;
  } else {
    // smallest e with 6 * 2^e >= amax (exact comparisons in double; 6 * 2^e is exact there)
    e = floor_log2_bits(block_amax) - 2;  // 6 * 2^e <= 1.5 * 2^(floor+1) ... start just below and step up
    if (e < -127) e = -127;
    while ((double)block_amax > 6.0 * ldexp(1.0, e)) ++e;
  }
  return e < -127 ? -127 : (e > 127 ? 127 : e);
}

// ---- Philox4x32-10 (Random123), SPEC 4 -----------------------------------------------------------------------
struct Philox4 {
  uint32_t w[4];
};

__device__ __forceinline__ Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                                 uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0 = __umulhi(kM0, c0), lo0 = kM0 * c0;
    uint32_t hi1 = __umulhi(kM1, c2), lo1 = kM1 * c2;
    uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    k0 += kW0; k1 += kW1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The four random words of elements 4n .. 4n+3 of a tensor quantized with (seed, offset).
__device__ __forceinline__ Philox4 sr_words(uint64_t n, uint64_t seed, uint64_t offset) {
  return philox4x32_10((uint32_t)n, (uint32_t)(n >> 32), (uint32_t)offset, (uint32_t)(offset >> 32), (uint32_t)seed,
                       (uint32_t)(seed >> 32));
}

// philox4x32_10 with the key schedule precomputed: round r uses (k0 + r * 0x9E3779B9, k1 + r * 0xBB67AE85) mod 2^32,
// exactly the keys philox4x32_10 derives as it goes. Kernels keep the table in their launch parameters, so the
// key words are constant-bank operands of the XORs and the 20 key additions leave the per-call work.
struct PhiloxKeySchedule {
  uint32_t k0[10], k1[10];
};

__host__ __device__ inline PhiloxKeySchedule philox_key_schedule(uint64_t seed) {
  PhiloxKeySchedule s;
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    s.k0[round] = k0;
    s.k1[round] = k1;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return s;
}

__device__ __forceinline__ Philox4 philox4x32_10_scheduled(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                                           const PhiloxKeySchedule& ks) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0 = __umulhi(kM0, c0), lo0 = kM0 * c0;
    uint32_t hi1 = __umulhi(kM1, c2), lo1 = kM1 * c2;
    uint32_t n0 = hi1 ^ c1 ^ ks.k0[round], n2 = hi0 ^ c3 ^ ks.k1[round];
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// sr_words with the seed's key schedule precomputed (same four words).
__device__ __forceinline__ Philox4 sr_words_scheduled(uint64_t n, uint64_t offset, const PhiloxKeySchedule& ks) {
  return philox4x32_10_scheduled((uint32_t)n, (uint32_t)(n >> 32), (uint32_t)offset, (uint32_t)(offset >> 32), ks);
}

// ---- Swizzled 128x4 scale layout (SPEC 6) -----------------------------------------------------------------------
__host__ __device__ __forceinline__ int64_t swizzled_scale_offset(int64_t m, int64_t k, int64_t kb_padded) {
  return (m / 128) * (kb_padded / 4) * 512 + (k / 4) * 512 + (m % 32) * 16 + ((m % 128) / 32) * 4 + (k % 4);
}

}  // namespace trace_ext
