// Stochastic rounding (SPEC 4) of one NVFP4 block's elements in the 2^-14-scaled domain, lean: one round-up FFMA per
// element decides lo / hi, one cvt.rz.f16x2 per pair floors to the grid (codes = fp16 bits 9..11), no per-element
// floor, compare or select. Same codes as quantize_elems' scaled SR path (e2m1_sr_grid_x2m14) for every input of its
// fast path; checked in numpy emulation (tests/test_sr_lean_emulation.py; every float once by
// tools/exhaustive_sr_lean.py).
//
// Static SASS (sm_90a, tools/sass_quant_elems.sh, Philox included): 22.6 instructions per element instead of 30.7 for
// the scaled path; per element: 3 division, LOP3 + VIADDMNMX (the step c), LEA.HI (+ LOP3 for words 1 and 3) for
// 2^24 - k, FFMA.RP, VIADD (predecessor); per pair: F2FP.RZ, VIMNMX.U16x2; signs and packing ~1.6.
//
// The math. u = |v| 2^-14 (v = fl(x / t); exact scaling), not clamped; below 6 2^-14 the SPEC's a = min(|v|, 6) scaled
// is u. lo <= u <= hi is the grid bracket, w = hi - lo the grid step above lo (2^-15 below 2^-13, else half of u's
// binade 2^e(u)), k = word >> 8, c = w 2^-24 (a power of two). SPEC 4: hi iff k 2^-24 < (u - lo) / w, i.e. iff
// k c < u - lo, i.e. iff
//     z = u + (2^24 - k) c  >  hi                                                  (exact reals)
// z lies in (u, u + w], and every grid step above hi is >= w, so the code is the largest grid value strictly below z
// (on the grid, u == lo, that keeps u, as the reference does). With y = fl_ru(z) (one FFMA.RP: exact product and sum,
// one rounding up) and any float g: g < z iff g < y iff g <= pred(y), pred(y) = the float just below y (its bits minus
// one; y >= 2^-39). So the code is the grid floor of pred(y): cvt.rz.f16x2 rounds toward zero, i.e. down (values > 0)
// to an fp16, whose bits 9..11 are the code of a grid value; clearing its bits 0..8 floors it to the grid (one
// significant bit kept from 2^-14 up, multiples of 2^-15 below); the pack reads only bits 9..11. A strict test is
// needed: a round-down FFMA with 2^24 - 1 - k decides "z >= hi", which differs from "z > hi" when p 2^24 is not an
// integer (u < 2^-16); the predecessor costs one VIADD per element and is exact everywhere.
//   - Saturation: for u >= 6 2^-14, y > u so pred(y) >= u and its fp16 floor is >= 0x0E00 (cvt.rz never overflows to
//     inf: 65504 above); min.u16x2 with 0x0E00 per pair gives code 7. Below 6 2^-14, pred(y) <= hi + w <= 8 2^-14 and
//     the strict floor is <= hi <= 6 2^-14, unchanged by the clamp.
//   - 2^24 - k in [1, 2^24] without a conversion: the float whose bits are the integer B = 2^24 - k = (~word >> 8) + 1
//     is B 2^-149 exactly (subnormals and the first normal binade share the step 2^-149); the FFMA multiplies it by
//     C = c 2^149 = max(2^e(u) 2^124, 2^110) (c = max(2^e(u) 2^-25, 2^-39)), from u's exponent bits by one mask and
//     one add-and-max (__viaddmax_s32). Exponent fields >= 132 (u >= 2^5, v >= 2^19) wrap to negative ints and take
//     2^110, field 131 gives +inf (y = +inf, pred = FLT_MAX); either way y > u >= 6 2^-14: code 7. ~word comes from
//     philox4x32_10_scheduled_not (free for words 0 and 2).
// Preconditions (those under which quantize_block takes quantize_elems' fast scaled path): t in [2^-100, 2^100],
// r = __frcp_rn(t), fl(amax_bits r) <= 2^100, and every nonzero |x| >= 2^-100 with fl(|x| r) >= 2^-99 (so
// div_rn_with_rcp gives v = fl(|x| / t) exactly and u is zero or normal); x finite. Signs: x's (t > 0), -0 included.
#pragma once

#include <cstdint>

#include "trace_ext/fp4_numerics.cuh"

namespace trace_ext {

// philox4x32_10_scheduled's four words, complemented (~w0, ~w1, ~w2, ~w3): the same rounds, with the last round's
// two three-way XORs as one LOP3 each with the complemented truth table (0x69 = ~(a ^ b ^ c)), so ~w0 and ~w2 cost
// nothing; ~w1 and ~w3 (the low products) one LOP3 each.
__device__ __forceinline__ Philox4 philox4x32_10_scheduled_not(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                                               const PhiloxKeySchedule& ks) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
#pragma unroll
  for (int round = 0; round < 9; ++round) {
    const uint32_t hi0 = __umulhi(kM0, c0), lo0 = kM0 * c0;
    const uint32_t hi1 = __umulhi(kM1, c2), lo1 = kM1 * c2;
    const uint32_t n0 = hi1 ^ c1 ^ ks.k0[round], n2 = hi0 ^ c3 ^ ks.k1[round];
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
  }
  const uint32_t hi0 = __umulhi(kM0, c0), lo0 = kM0 * c0;
  const uint32_t hi1 = __umulhi(kM1, c2), lo1 = kM1 * c2;
  uint32_t n0, n2;
  asm("lop3.b32 %0, %1, %2, %3, 0x69;" : "=r"(n0) : "r"(hi1), "r"(c1), "r"(ks.k0[9]));
  asm("lop3.b32 %0, %1, %2, %3, 0x69;" : "=r"(n2) : "r"(hi0), "r"(c3), "r"(ks.k1[9]));
  return Philox4{{n0, ~lo1, n2, ~lo0}};
}

// pred(fl_ru(u + (2^24 - k) c)) for u = fl(|x| / t) 2^-14 and nw = ~word (k = word >> 8): its fp16 floor (cvt.rz),
// clamped at 0x0E00, has the element's code at bits 9..11.
__device__ __forceinline__ float sr_lean_pre_floor_x2m14(float u, uint32_t nw) {
  const uint32_t e = __float_as_uint(u) & 0x7F800000u;
  const uint32_t cb = (uint32_t)__viaddmax_s32((int)e, 124 << 23, 0x76800000);  // max(2^e 2^124, 2^110) as bits
  const uint32_t b = (nw >> 8) + 1u;                                                 // 2^24 - k, in [1, 2^24]
  const float y = __fmaf_ru(__uint_as_float(b), __uint_as_float(cb), u);            // fl_ru(u + (2^24 - k) c) > 0
  return __uint_as_float(__float_as_uint(y) - 1u);                                   // pred(y)
}

// Codes (with x's signs) of N elements of one block, nibble e % 8 of w[e / 8] = element e. Element e uses word e % 4 of
// Philox4x32-10 at counter (n_lo + e / 4, n_hi, off_lo, off_hi) (n_lo a multiple of 4: no carry into n_hi). raw16:
// 16-bit x's raw words (uint4 k = elements 8 k .. 8 k + 7), whose sign bits give the signs (sign_bytes8_raw16), or
// nullptr to take them from the floats.
template <int N>
__device__ __forceinline__ void sr_elems_lean_x2m14(const float (&x)[N], float t, float r, uint32_t n_lo,
                                                    uint32_t n_hi, uint32_t off_lo, uint32_t off_hi,
                                                    const PhiloxKeySchedule& ks, uint32_t (&w)[N / 8],
                                                    const uint4* raw16 = nullptr) {
  static_assert(N % 8 == 0, "whole words of eight codes");
  constexpr uint32_t kSat = 0x0E000E00u;  // fp16 bits of 6 * 2^-14, twice
  const float t14 = __fmul_rn(t, 16384.0f), r14 = __fmul_rn(r, 0x1p-14f);
  Philox4 rnd;  // complemented words
#pragma unroll
  for (int k = 0; k < N / 8; ++k) {
    const SignBytes8 sb = raw16 != nullptr ? sign_bytes8_raw16(raw16[k].x, raw16[k].y, raw16[k].z, raw16[k].w)
                                           : sign_bytes8_at(x, k);
    float p[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int e = 8 * k + i;
      if (e % 4 == 0) rnd = philox4x32_10_scheduled_not(n_lo + (uint32_t)(e / 4), n_hi, off_lo, off_hi, ks);
      p[i] = sr_lean_pre_floor_x2m14(div_rn_with_rcp(fabsf(x[e]), t14, r14), rnd.w[e % 4]);
    }
    const uint32_t h02 = min_u16x2(cvt_rz_f16x2(p[0], p[2]), kSat), h46 = min_u16x2(cvt_rz_f16x2(p[4], p[6]), kSat);
    const uint32_t h13 = min_u16x2(cvt_rz_f16x2(p[1], p[3]), kSat), h57 = min_u16x2(cvt_rz_f16x2(p[5], p[7]), kSat);
    // High bytes [0000 c2 c1 c0 g] (g = fp16 bit 8): even >> 1 puts the codes at bits 0..2 (g of the next byte at 7),
    // odd << 3 at bits 4..6 (its g at 3); the two have no common bit, and bits 3 / 7 are then the signs.
    const uint32_t even = __byte_perm(h02, h46, 0x7531);  // bytes: e0 e2 e4 e6
    const uint32_t odd = __byte_perm(h13, h57, 0x7531);   // bytes: e1 e3 e5 e7
    const uint32_t codes = (even >> 1) + (odd << 3);
    w[k] = (codes & 0x77777777u) | (sb.even & 0x08080808u) | (sb.odd & 0x80808080u);
  }
}

}  // namespace trace_ext
