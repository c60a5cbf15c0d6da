// FP4 KV cache append (SPEC 2, 8): quantize new K and V rows (bf16 [T_new, H_kv, D]) with the layer's static
// decode scale g and scatter codes + E4M3 scale bytes into their pages, for every sequence and head in one
// launch (prefill chunks and single decode tokens alike).
//
// Design:
// - One thread per pair of 16-element NVFP4 blocks of a row (one block when D/16 is odd or a cache base is
//   not 16-byte aligned): four 16-byte loads of bf16, one 16-byte store of packed codes and one 2-byte store of
//   scales (FlashInfer#3985: thread-per-block with vector loads/stores is what makes NVFP4 KV quantization reach
//   bandwidth; byte-per-thread layouts reach ~20%). The per-item index math (row / token divisions, sequence
//   search, page lookup: ~60 instructions) is shared by the two blocks. Consecutive threads take consecutive
//   block pairs of a row, so the threads of a (token, head) row read D*2 contiguous bytes and write D/2
//   contiguous code bytes and D/16 contiguous scale bytes.
// - The numerics are those of fp4_numerics.cuh (e4m3_rn, nvfp4_block_divisor, nvfp4_scaled,
//   e2m1_rn_magnitude): bit-identical to reference.nvfp4_quantize with g = the static g of the layer.
// - Token -> sequence by binary search in cu_seqlens (B + 1 int32, L1-resident), position = start_pos[b] +
//   (token - cu[b]), page = block_table[b, pos / P]. The kernel trusts the values of cu_seqlens, start_pos and
//   the table: ops.fp4kv_append checks them (validate=True, one host sync; the caller's duty with validate=False
//   or when calling the raw op).
// - Grid-stride loop over 2 * T * H * D/16 blocks (K first, then V) so one launch covers any T. Index
//   arithmetic is 32-bit with host-precomputed multiply-shift division (64-bit division by runtime values
//   costs hundreds of instructions and would make this bandwidth kernel compute-bound).
// - The block amax and the finiteness test run on the bf16 bit patterns (|x| orders like an unsigned int;
//   NaN/Inf are the patterns >= 0x7F80), two elements per integer max.
// - Element codes: the SPEC needs v = fl(x / t) only through e2m1_rn(|v|) and signbit(v) = signbit(x)
//   (t > 0). Blocks whose t, 1 / t and quotients are far from under/overflow (judged once per block from
//   t and the amax, as in the NVFP4 quantizer's RTN path) take that RTN fast path: u = fl(|x| / t) *
//   2^-14 = div_rn_with_rcp(|x|, t 2^14, fl(1 / t) 2^-14) (the correctly rounded quotient, scaled exactly: one
//   FMUL and two FMAs), rounded to the E2M1 grid in fp32 (e2m1_rn_grid_x2m14) and eight codes read off fp16
//   bits at once (e2m1_pack8_x2m14), all from fp4_numerics.cuh and checked there against the reference: branch
//   free, mostly FMA-pipe work. Counted from the SASS (fast path only, per 16-element block): 372 instructions
//   with ~115 on the integer ALU pipe, was 471 with ~204 (e2m1_rn_magnitude_bits per element and one block per
//   thread; Nsight on that version at B8 x 4096: issue slots 73%, DRAM 40%, 84 us). Other blocks (and every
//   block with TRACE_EXT_KV_APPEND_IMPL=old,
//   for A/B timing) take the previous per-element path, also bit-exact: q = fl(|x| * fl(1 / t)) rounded to
//   the E2M1 grid with a magic-number add (RNE on a 0.5 / 1 / 2 step grid); an element whose q lies within
//   2^-18 steps of a rounding tie (where fl(x / t) could round the other way), or any element when 1 / t
//   overflowed, is redone exactly (fl(x / t), e2m1_rn_magnitude) out of line.
//
// Warp-stream kernel: the default, with two blocks per item, for appends of at least 32 items per resident warp
// (prefill chunks; H200 A/B at 2071576: 1.08-1.12x, 69.6% of copy at B8 x 4096), the grid kernel above for smaller
// ones (decode steps, where warp2 measured 0.98x). TRACE_EXT_KV_APPEND_IMPL (read per call): =warp2 / =warp (four
// blocks per item) force it, =grid the grid kernel. Nsight on the grid kernel at B8 x 4096, H_kv 8, D 128: 22.9
// thread instructions per element, issue slots 75% busy, DRAM 55%: issue-bound. The warp-stream kernel cuts the
// instructions per element:
// - Work: each warp appends a contiguous chunk of one tensor's items (four blocks of a (token, head) row where
//   D % 64 == 0, else two), lanes taking items l, l + 32, ...; two waves of warps (occupancy API), chunks of whole
//   warp steps (TRACE_EXT_KV_APPEND_WAVES=1: one wave, chunks equal to within an item). A warp step reads 32
//   consecutive items (4 KB at H_kv * D = 1024, kPer 4) with 16-byte loads issued before any math, and writes 16-byte
//   code stores and one 4-byte (2-byte) scale store per lane, contiguous per token. The token, (head, block),
//   sequence and page advance incrementally (a binary search only when a lane enters another sequence, one
//   block-table load per page per lane) instead of two divisions, a binary search and a table load per item.
// - Scale byte: fl(amax / 6) and fl(. / g) by the exact reciprocal division (fl(1/6) and the host's fl(1/g), as
//   quant_nvfp4_blocks.cuh's nvfp4_scale_byte_rcp, amax in [2^-47, 2^50], g in [2^-50, 2^50]: other g take the default
//   kernel); t * 2^14 and fl(1 / t) * 2^-14 come from a 2 x 128-entry shared table indexed by the scale byte (filled
//   once per CTA: g is fixed per cache), whose reciprocal is NaN where t leaves [2^-100, 2^100], so one compare
//   (fl(amax * r) <= 2^86) admits a block to the fast path only where the default kernel's reciprocal-quotient path
//   applies too (and amax lies in the scale range above).
// - Elements (fast path): u = fl(|x| / t) * 2^-14 by div_rn_with_rcp (one FMUL, two FMAs; |x| as an operand
//   modifier), RTN by one exponent-magic add (e2m1_rn_grid_expmagic_x2m14: integer max, mask, two FMAs, against seven
//   instructions for the Veltkamp / magic-add pair plus select), fp16 pairs saturated by min_u16x2 after packing (as
//   kImplRtnSat), signs straight from the bf16 words by sign-replicating byte permutes (fast_codes8). Every other
//   block (zero, tiny, huge, non-finite, t out of range) calls the default kernel's block path out of line.
// - Static SASS (sm_90a, ptxas 13.0), fast path: 203 instructions per 16-element block (12.7 per element: amax, scale
//   byte, table, codes), and the loop without its rare branches (sequence change, general blocks) 952 instructions per
//   64-element item (14.9 per element) at four blocks per item, 511 per 32 (16.0) at two (default: 22.9 executed).
//   Since session 16 the block amax takes 8 HMNMX2 (max.NaN.xorsign.abs; since session 19 the quantizers' own tree,
//   raw_max_abs_bits) instead of the masked integer maxes, and blocks whose quotients stay below 7 (every normal scale
//   byte below 448) skip the 8 min.u16x2 of the clamp.
//   80 registers at four blocks per item (3 CTAs / SM), 62 at two (=warp2, 4 CTAs / SM); no spills. (A variant
//   keeping the next item's loads in flight during the math needed ~16 more registers and spilled: not kept.)
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "trace_ext/fp4_numerics.cuh"
#include "trace_ext/host_checks.h"
#include "trace_ext/quant_common.cuh"  // raw_max_abs_bits

namespace trace_ext {
namespace {

constexpr int kAppendThreads = 256;
constexpr int kBlockElems = kNvfp4Block;  // elements quantized by one thread
static_assert(kBlockElems == 16, "one thread quantizes exactly one 16-element NVFP4 block (two 16-byte bf16 loads)");

struct AppendParams {
  // new rows, bf16 [T, H, D] each
  const uint16_t* k_new;
  const uint16_t* v_new;
  // cache storage: codes [pages, P, H, D/2], scales [pages, P, H, D/16]
  uint8_t* k_codes;
  uint8_t* k_scales;
  uint8_t* v_codes;
  uint8_t* v_scales;
  // addressing
  const int32_t* block_table;  // [B, max_pages]
  const int32_t* cu_seqlens;   // [B + 1]
  const int32_t* start_pos;    // [B]
  int batch, max_pages, page_size, heads, head_dim;
  int tokens;
  // multiply-shift dividers (see FastDiv)
  uint32_t ni_mul, ni_shr, heads_mul, heads_shr, page_mul, page_shr;  // ni: items (1 or 2 blocks) per row
  // static decode scales
  float g_k, g_v;
  // 1: blocks in range take the reciprocal-quotient element path (default); 0: TRACE_EXT_KV_APPEND_IMPL=old
  int rcp_quotient;
  // warp-stream kernel (TRACE_EXT_KV_APPEND_IMPL=warp) only
  int items_per_token;               // H * (D / 16) / kPer items of one token row of one tensor
  uint32_t it_mul, it_shr;           // FastDiv by items_per_token
  int step_tokens, step_items;       // a warp step of 32 items = step_tokens tokens + step_items items
  int chunk;                         // items per warp, contiguous
  int warps_per_tensor;              // warps [0, w) append K, [w, 2w) append V
  float rg_k, rg_v;                  // fl(1 / g), g in [2^-50, 2^50] (host-checked)
};

__device__ __forceinline__ float bf16_bits_to_float(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

// n / d for 0 <= n < 2^31 as umulhi(n, mul) >> shr (Granlund-Montgomery round-up multiplier; d == 1 has mul 0).
struct FastDiv {
  uint32_t mul, shr;
  static FastDiv make(uint32_t d) {
    if (d == 1) return {0u, 0u};
    uint32_t l = 0;
    while ((1ull << l) < d) ++l;  // ceil(log2 d)
    const uint64_t p = 31 + l;
    return {(uint32_t)(((1ull << p) + d - 1) / d), (uint32_t)(p - 32)};
  }
};
__device__ __forceinline__ int fast_div(int n, uint32_t mul, uint32_t shr) {
  return mul == 0 ? n : (int)(__umulhi((uint32_t)n, mul) >> shr);
}

// The exact path (SPEC 2 literally: e2m1_rn(|fl(x / t)|)); out of line, taken only for elements whose fast
// result could differ from it.
__device__ __noinline__ uint32_t e2m1_magnitude_exact(float x, float t) {
  return e2m1_rn_magnitude(fabsf(nvfp4_scaled(x, t)));
}

// Fast E2M1 code of fl(x / t) (t > 0, r = fl(1 / t) finite), branch free: q = fl(|x| * r) is within 1.5 ulp of
// fl(|x| / t); adding 2^22 / 2^23 / 2^24 rounds q (RNE) to the E2M1 grid of [0,2) / [2,4) / [4,8) (steps 0.5,
// 1, 2), which equals e2m1_rn away from ties; within half_step * 2^-17 of a tie (where the exact quotient
// could round the other way), or when `exact` (1 / t overflowed), the exact path decides. q >= 8 (or inf)
// lands on k >= 4 -> saturated code 7. Sign = signbit(x) (= signbit(fl(x / t)) for t > 0).
__device__ __forceinline__ uint32_t e2m1_code(float x, float t, float r, bool exact) {
  const float q = __fmul_rn(fabsf(x), r);
  const bool step_half = q < 2.0f, step_one = q < 4.0f;
  const float magic = step_half ? 4194304.0f : (step_one ? 8388608.0f : 16777216.0f);
  const float tie_dist = step_half ? 0.24999809265136719f : (step_one ? 0.49999618530273438f : 0.99999237060546875f);
  const float rounded = __fadd_rn(q, magic);
  const uint32_t k = __float_as_uint(rounded) - __float_as_uint(magic);  // grid steps above the regime start
  uint32_t mag = min(k + (step_half ? 0u : (step_one ? 2u : 4u)), 7u);
  if (exact || fabsf(__fsub_rn(q, __fsub_rn(rounded, magic))) >= tie_dist) mag = e2m1_magnitude_exact(x, t);
  return mag | ((__float_as_uint(x) >> 28) & 8u);
}

// Largest b with cu[b] <= token (token < cu[B]); sequences with no new rows are skipped naturally.
__device__ __forceinline__ int sequence_of_token(const int32_t* __restrict__ cu, int batch, int token) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (__ldg(cu + mid) <= token) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Quantizes one 16-element block (its 8 bf16 words): the E4M3 scale byte and two words of packed codes.
__device__ __forceinline__ void quantize_block(const uint32_t (&words)[8], float g, bool rcp_quotient,
                                               uint8_t& scale_out, uint32_t& code_lo, uint32_t& code_hi) {
  // max |x| by the masked integer maxes (|x| as bf16 bits orders like an unsigned int; NaN / Inf: >= 0x7F800000)
  const uint4 block[2] = {make_uint4(words[0], words[1], words[2], words[3]),
                          make_uint4(words[4], words[5], words[6], words[7])};
  const uint32_t amax_bits = raw_max_abs_bits<__nv_bfloat16, 2, false>(block);
  const bool finite = amax_bits < 0x7F800000u;
  const float amax = __uint_as_float(amax_bits);

  uint8_t scale = kE4M3NaN;
  uint32_t w2[2] = {0u, 0u};
  if (finite) {
    scale = nvfp4_scale_byte(amax, g);
    const float t = nvfp4_block_divisor(scale, g);
    if (t != 0.0f) {  // t == 0: v = +0 for every element, all codes 0
      const float r = __frcp_rn(t);
      if (rcp_quotient && t >= 0x1p-100f && t <= 0x1p100f && __fmul_rn(amax, r) <= 0x1p100f) {
        // u = fl(|x| / t) * 2^-14 exactly (Markstein with the block reciprocal, divisor and reciprocal scaled by
        // exact powers of two; RTN needs no exact tiny quotients: every |v| below 0.25 is code 0), rounded to the
        // E2M1 grid in fp32 and the codes read off fp16 bits, eight at a time (e2m1_rn_grid_x2m14,
        // e2m1_pack8_x2m14: the NVFP4 quantizer's RTN path); the sign is x's (t > 0, -0.0 included)
        const float t14 = __fmul_rn(t, 16384.0f), r14 = __fmul_rn(r, 0x1p-14f);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          float q[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int e = 8 * k + i;
            const uint32_t xb = e & 1 ? words[e >> 1] & 0xFFFF0000u : words[e >> 1] << 16;  // x as fp32 bits
            const float grid = e2m1_rn_grid_x2m14(div_rn_with_rcp(fabsf(__uint_as_float(xb)), t14, r14));
            q[i] = __uint_as_float(__float_as_uint(grid) | (xb & 0x80000000u));
          }
          w2[k] = e2m1_pack8_x2m14(q);
        }
      } else {
        const bool exact = !(r <= 3.0e38f);  // t so small that 1/t overflowed
#pragma unroll
        for (int e = 0; e < kBlockElems; ++e) {
          const float x = bf16_bits_to_float(e & 1 ? words[e >> 1] >> 16 : words[e >> 1] & 0xFFFFu);
          w2[e >> 3] |= e2m1_code(x, t, r, exact) << (4 * (e & 7));
        }
      }
    }
  }
  scale_out = scale;
  code_lo = w2[0];
  code_hi = w2[1];
}

// kPer consecutive blocks of one (token, head) row per item: the row / token / sequence / page arithmetic is
// done once per kPer blocks, and the codes and scales go out in one kPer * 8-byte and one kPer-byte store.
template <int kPer>
__global__ void __launch_bounds__(kAppendThreads) fp4kv_append_kernel(const AppendParams p) {
  static_assert(kPer == 1 || kPer == 2, "one or two blocks per item");
  const int nb = p.head_dim / kBlockElems;  // blocks per row
  const int ni = nb / kPer;                 // items per row
  const int per_tensor = p.tokens * p.heads * ni;
  const int total = 2 * per_tensor;  // < 2^31, checked on the host
  for (int64_t item64 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; item64 < total;
       item64 += (int64_t)gridDim.x * blockDim.x) {
    const int item = (int)item64;
    const bool is_v = item >= per_tensor;
    const int i = is_v ? item - per_tensor : item;
    const int row = fast_div(i, p.ni_mul, p.ni_shr);  // token * H + head
    const int blk = (i - row * ni) * kPer;            // first block of the item
    const int token = fast_div(row, p.heads_mul, p.heads_shr);
    const int head = row - token * p.heads;

    const uint4* src = reinterpret_cast<const uint4*>((is_v ? p.v_new : p.k_new) + (int64_t)row * p.head_dim +
                                                      blk * kBlockElems);
    uint4 raw[2 * kPer];
#pragma unroll
    for (int j = 0; j < 2 * kPer; ++j) raw[j] = __ldg(src + j);
    const float g = is_v ? p.g_v : p.g_k;
    uint8_t scale[kPer];
    uint32_t code[2 * kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const uint4 lo = raw[2 * j], hi = raw[2 * j + 1];
      const uint32_t words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      quantize_block(words, g, p.rcp_quotient != 0, scale[j], code[2 * j], code[2 * j + 1]);
    }

    const int b = sequence_of_token(p.cu_seqlens, p.batch, token);
    const int pos = __ldg(p.start_pos + b) + (token - __ldg(p.cu_seqlens + b));
    const int col = fast_div(pos, p.page_mul, p.page_shr);
    const int64_t page = __ldg(p.block_table + (int64_t)b * p.max_pages + col);
    const int64_t cache_row = (page * p.page_size + (pos - col * p.page_size)) * p.heads + head;
    uint8_t* codes = (is_v ? p.v_codes : p.k_codes) + cache_row * (p.head_dim / 2) + blk * (kBlockElems / 2);
    uint8_t* scales = (is_v ? p.v_scales : p.k_scales) + cache_row * nb + blk;
    if constexpr (kPer == 2) {  // 16- and 2-byte aligned: nb even, bases checked on the host
      *reinterpret_cast<uint4*>(codes) = make_uint4(code[0], code[1], code[2], code[3]);
      *reinterpret_cast<uint16_t*>(scales) = (uint16_t)(scale[0] | (scale[1] << 8));
    } else {
      *reinterpret_cast<uint2*>(codes) = make_uint2(code[0], code[1]);
      *scales = scale[0];
    }
  }
}

// ---- warp-stream kernel (TRACE_EXT_KV_APPEND_IMPL=warp) -------------------------------------------------------
constexpr int kWarpsPerCta = kAppendThreads / 32;
constexpr int kScaleTable = 128;  // E4M3 scale bytes 0..127 (a finite block's byte is <= 0x7E)
static_assert(kAppendThreads == 2 * kScaleTable, "one thread fills one (t, 1/t) entry of the K and V tables");

// fl(1/6), correctly rounded (as quant_nvfp4_blocks.cuh's nvfp4_scale_byte_rcp).
constexpr float kRcp6 = 0x1.555556p-3f;

// RTN(v) * 2^-14 from u = v * 2^-14 (0 <= u <= 2^90), unsaturated: u + M rounds u to a multiple of ulp(M) = M 2^-23 in
// one FMA, with M = 2^22 * 2^floor(log2 max(u, 2^-14)): steps 2^-15 below u = 2^-13 (v < 2: step 0.5) and half of
// u's binade above (v in [2, 4): 1, [4, 8): 2), ties to the even multiple = the even E2M1 code; subtracting M is
// exact. Values >= 6 * 2^-14 stand for code 7 (saturated after packing by min_u16x2). Four instructions (integer
// max, mask, two FMAs) against seven for e2m1_rn_grid_unsat_x2m14; exhaustively checked (numpy, every float32 u in
// [0, 2^90]): min(fp16 bits of the result, 0x0E00) >> 9 equals e2m1_rn(u * 2^14) and no other fp16 bit is set.
__device__ __forceinline__ float e2m1_rn_grid_expmagic_x2m14(float u) {
  const float e = __uint_as_float(max(__float_as_uint(u), 0x38800000u) & 0x7F800000u);  // 2^floor(log2 max(u, 2^-14))
  const float r = __fmaf_rn(e, 4194304.0f, u);
  return __fmaf_rn(-e, 4194304.0f, r);
}

// Eight codes (nibble i = element i) of bf16 elements 0..7 held in w0..w3 (element 2j in the low half of w_j):
// unsigned grid values from e2m1_rn_grid_expmagic_x2m14, fp16 pairs saturated by one min_u16x2 each (kClamp; without
// it only where no quotient of the block reaches 7: kFastNoClamp below), code bits gathered by two byte permutes (as
// e2m1_pack8_abs_x2m14); the signs are x's (t > 0, -0.0 included), taken straight from the bf16 words by
// sign-replicating byte permutes (bytes 1 / 3 of w_j carry the signs).
template <bool kClamp>
__device__ __forceinline__ uint32_t fast_codes8(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3, float t14,
                                                float r14) {
  const uint32_t w[4] = {w0, w1, w2, w3};
  float q[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float a = (i & 1) ? __uint_as_float(w[i >> 1] & 0x7FFF0000u) : fabsf(__uint_as_float(w[i >> 1] << 16));
    q[i] = e2m1_rn_grid_expmagic_x2m14(div_rn_with_rcp(a, t14, r14));
  }
  const __half2 f02 = __floats2half2_rn(q[0], q[2]), f46 = __floats2half2_rn(q[4], q[6]);
  const __half2 f13 = __floats2half2_rn(q[1], q[3]), f57 = __floats2half2_rn(q[5], q[7]);
  uint32_t h02 = *reinterpret_cast<const uint32_t*>(&f02), h46 = *reinterpret_cast<const uint32_t*>(&f46);
  uint32_t h13 = *reinterpret_cast<const uint32_t*>(&f13), h57 = *reinterpret_cast<const uint32_t*>(&f57);
  if constexpr (kClamp) saturate_x2m14_halves(h02, h46, h13, h57);
  const uint32_t even = __byte_perm(h02, h46, 0x7531);  // bytes: codes of elements 0 2 4 6 at bits 1..3
  const uint32_t odd = __byte_perm(h13, h57, 0x7531);   // 1 3 5 7
  const uint32_t s01 = prmt_b32(w0, w1, 0xFBD9u);       // sign bytes (0x00 / 0xFF) of elements 0 2 1 3
  const uint32_t s23 = prmt_b32(w2, w3, 0xFBD9u);       // 4 6 5 7
  const uint32_t s_even = __byte_perm(s01, s23, 0x5410), s_odd = __byte_perm(s01, s23, 0x7632);
  return (even >> 1) | (odd << 3) | (s_even & 0x08080808u) | (s_odd & 0x80808080u);
}

// The fast path skips the clamp of its fp16 pairs where q_max = fl(amax * r14) < 6.5 * 2^-14 (r14 = fl(1 / t) 2^-14):
// rtn_needs_no_clamp's bound (fp4_numerics.cuh) in the 2^-14-scaled domain, where e2m1_rn_grid_expmagic_x2m14 then
// gives at most 6 * 2^-14.
constexpr float kFastNoClamp = kRtnNoClampQuotient * 0x1p-14f;

// The general block path (quantize_block above, reciprocal path on) out of line: zero / tiny / huge / non-finite
// blocks, and blocks whose divisor or quotients leave the fast path's range. Returns (codes lo, codes hi, scale).
__device__ __noinline__ uint3 quantize_block_general(uint4 lo, uint4 hi, float g) {
  const uint32_t words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  uint8_t s;
  uint32_t c0, c1;
  quantize_block(words, g, true, s, c0, c1);
  return make_uint3(c0, c1, s);
}

// Largest b in [lo, batch) with cu[b] <= token (cu[lo] <= token).
__device__ __forceinline__ int sequence_of_token_from(const int32_t* __restrict__ cu, int lo, int batch, int token) {
  int hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(cu + mid) <= token) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Each warp appends a contiguous chunk of one tensor's items (kPer consecutive blocks of a (token, head) row each),
// lane l taking items l, l + 32, ...: a warp step reads 32 consecutive items (for H_kv * D = 1024 and kPer 4: 4 KB of
// two or three tokens) and writes their codes and scales contiguously per token. Token, sequence and page advance
// incrementally (binary search only when a lane crosses into another sequence, block-table load once per page).
// Per block: the bf16 amax, the scale byte through fl(1/6) and fl(1/g) (exact in range, as quant_nvfp4_blocks.cuh's
// nvfp4_scale_byte_rcp), t * 2^14 and fl(1/t) * 2^-14 from a shared table indexed by the scale byte, then the
// element codes by fast_codes8; any block outside the range where that is exact takes quantize_block_general.
template <int kPer>
__global__ void __launch_bounds__(kAppendThreads) fp4kv_append_warp_kernel(const AppendParams p) {
  static_assert(kPer == 2 || kPer == 4, "two or four blocks per item (one-block rows take the default kernel)");
  __shared__ float2 table[2][kScaleTable];  // (t * 2^14, fl(1/t) * 2^-14), NaN reciprocal: not in the fast range
  {
    const int i = threadIdx.x;
    const float g = i < kScaleTable ? p.g_k : p.g_v;
    const float t = nvfp4_block_divisor((uint8_t)(i % kScaleTable), g);
    const bool in_range = t >= 0x1p-100f && t <= 0x1p100f;  // t == 0 (byte 0) and NaN (0x7F) excluded too
    table[i / kScaleTable][i % kScaleTable] =
        make_float2(__fmul_rn(t, 16384.0f), in_range ? __fmul_rn(__frcp_rn(t), 0x1p-14f) : __int_as_float(0x7FC00000));
  }
  __syncthreads();
  const int warp = blockIdx.x * kWarpsPerCta + (int)(threadIdx.x / 32);
  const int lane = (int)(threadIdx.x % 32);
  if (warp >= 2 * p.warps_per_tensor) return;
  const bool is_v = warp >= p.warps_per_tensor;
  const int w = is_v ? warp - p.warps_per_tensor : warp;
  const int per_tensor = p.tokens * p.items_per_token;
  int f = w * p.chunk + lane;
  const int end = min(w * p.chunk + p.chunk, per_tensor);
  if (f >= end) return;

  const uint16_t* __restrict__ src_base = is_v ? p.v_new : p.k_new;
  uint8_t* __restrict__ codes_base = is_v ? p.v_codes : p.k_codes;
  uint8_t* __restrict__ scales_base = is_v ? p.v_scales : p.k_scales;
  const float g = is_v ? p.g_v : p.g_k;
  const float rg = is_v ? p.rg_v : p.rg_k;
  const float2* tbl = table[is_v ? 1 : 0];
  const int ni = p.head_dim / (kBlockElems * kPer);  // items per (token, head) row
  const int nb = p.head_dim / kBlockElems;

  int tok = fast_div(f, p.it_mul, p.it_shr);
  int c = f - tok * p.items_per_token;
  int b = sequence_of_token_from(p.cu_seqlens, 0, p.batch, tok);
  int cu_next = __ldg(p.cu_seqlens + b + 1);
  int seq_off = __ldg(p.start_pos + b) - __ldg(p.cu_seqlens + b);  // pos = tok + seq_off
  int pcol = -1;
  int64_t prow = 0;  // page * P - pcol * P
  for (; f < end; f += 32) {
    const int head = fast_div(c, p.ni_mul, p.ni_shr);
    const int blk = (c - head * ni) * kPer;
    const uint4* src =
        reinterpret_cast<const uint4*>(src_base + ((int64_t)tok * p.heads + head) * p.head_dim + blk * kBlockElems);
    uint4 raw[2 * kPer];
#pragma unroll
    for (int j = 0; j < 2 * kPer; ++j) raw[j] = __ldg(src + j);

    if (tok >= cu_next) {  // this lane entered a later sequence
      b = sequence_of_token_from(p.cu_seqlens, b + 1, p.batch, tok);
      cu_next = __ldg(p.cu_seqlens + b + 1);
      seq_off = __ldg(p.start_pos + b) - __ldg(p.cu_seqlens + b);
      pcol = -1;
    }
    const int pos = tok + seq_off;
    const int col = fast_div(pos, p.page_mul, p.page_shr);
    if (col != pcol) {  // a new page: one block-table load
      pcol = col;
      prow = ((int64_t)__ldg(p.block_table + (int64_t)b * p.max_pages + col) - col) * p.page_size;
    }
    const int64_t cache_row = (prow + pos) * p.heads + head;
    uint8_t* codes = codes_base + cache_row * (p.head_dim / 2) + blk * (kBlockElems / 2);
    uint8_t* scales = scales_base + cache_row * nb + blk;

    uint32_t code[2 * kPer];
    uint32_t scale_word = 0u;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const uint4 lo = raw[2 * j], hi = raw[2 * j + 1];
      // float bits of the block's max |x| (NaN / Inf: >= 0x7F800000): two magnitudes per max.NaN.xorsign.abs
      const uint4 block[2] = {lo, hi};
      const uint32_t amax_bits = raw_max_abs_bits<__nv_bfloat16, 2, true>(block);
      const float amax = __uint_as_float(amax_bits);
      // amax in [2^-47, 2^50] (finite, nonzero): fl(amax / 6) and fl(. / g) by the exact reciprocal division
      const bool scale_fast = amax_bits - 0x28000000u <= 0x58800000u - 0x28000000u;
      const uint8_t s = e4m3_rn(div_rn_with_rcp(div_rn_with_rcp(amax, kE2M1Max, kRcp6), g, rg));
      const float2 tr = tbl[s & (kScaleTable - 1)];
      const float q_max = __fmul_rn(amax, tr.y);  // fl(amax / t) 2^-14 within two roundings; NaN entry: NaN
      if (scale_fast && q_max < kFastNoClamp) {  // no quotient reaches 7: codes without the clamp
        code[2 * j] = fast_codes8<false>(lo.x, lo.y, lo.z, lo.w, tr.x, tr.y);
        code[2 * j + 1] = fast_codes8<false>(hi.x, hi.y, hi.z, hi.w, tr.x, tr.y);
        scale_word |= (uint32_t)s << (8 * j);
      } else if (scale_fast && q_max <= 0x1p86f) {  // NaN entry: false
        code[2 * j] = fast_codes8<true>(lo.x, lo.y, lo.z, lo.w, tr.x, tr.y);
        code[2 * j + 1] = fast_codes8<true>(hi.x, hi.y, hi.z, hi.w, tr.x, tr.y);
        scale_word |= (uint32_t)s << (8 * j);
      } else {
        const uint3 r = quantize_block_general(lo, hi, g);
        code[2 * j] = r.x;
        code[2 * j + 1] = r.y;
        scale_word |= r.z << (8 * j);
      }
      if (j % 2 == 1) {  // codes of each block pair as soon as they exist (16-byte aligned: checked on the host)
        reinterpret_cast<uint4*>(codes)[j / 2] =
            make_uint4(code[2 * j - 2], code[2 * j - 1], code[2 * j], code[2 * j + 1]);
      }
    }
    if constexpr (kPer == 4) {  // 4-byte aligned: nb % 4 == 0, bases checked on the host
      *reinterpret_cast<uint32_t*>(scales) = scale_word;
    } else {
      *reinterpret_cast<uint16_t*>(scales) = (uint16_t)scale_word;
    }

    c += p.step_items;  // next item of this lane: 32 items on
    tok += p.step_tokens;
    if (c >= p.items_per_token) {
      c -= p.items_per_token;
      ++tok;
    }
  }
}

// TRACE_EXT_KV_APPEND_WAVES (read per call): waves of warp-stream chunks, 1 .. 64; unset (or out of range): 2.
constexpr int kAppendWaves = 2;
int kv_append_waves() {
  const char* v = std::getenv("TRACE_EXT_KV_APPEND_WAVES");
  const int n = v == nullptr ? kAppendWaves : std::atoi(v);
  return n >= 1 && n <= 64 ? n : kAppendWaves;
}

void check_cache_tensor(const at::Tensor& t, const char* name, int64_t width, const at::Tensor& ref_codes) {
  check_dtype(t, at::kByte, name);
  check_contiguous(t, name);
  TORCH_CHECK_VALUE(t.dim() == 4 && t.size(0) == ref_codes.size(0) && t.size(1) == ref_codes.size(1) &&
                        t.size(2) == ref_codes.size(2) && t.size(3) == width,
                    "trace_ext: ", name, " must be [pages, page_size, H_kv, ", width, "], got ", t.sizes());
  check_same_device(t, ref_codes, name, "k_codes");
}

void fp4kv_append_cuda(at::Tensor& k_codes, at::Tensor& k_scales, at::Tensor& v_codes, at::Tensor& v_scales,
                       const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& block_table,
                       const at::Tensor& cu_seqlens, const at::Tensor& start_pos, double g_k, double g_v) {
  const char* op = "fp4kv_append";
  check_cuda(k_codes, "k_codes");
  check_dtype(k_codes, at::kByte, "k_codes");
  TORCH_CHECK_VALUE(k_codes.dim() == 4, "trace_ext: k_codes must be [pages, page_size, H_kv, D/2], got ",
                    k_codes.sizes());
  const int64_t D = k_codes.size(3) * 2;
  TORCH_CHECK_VALUE(D % kNvfp4Block == 0, "trace_ext: head_dim must be a multiple of 16, got ", D);
  check_cache_tensor(k_codes, "k_codes", D / 2, k_codes);
  check_cache_tensor(v_codes, "v_codes", D / 2, k_codes);
  check_cache_tensor(k_scales, "k_scales", D / kNvfp4Block, k_codes);
  check_cache_tensor(v_scales, "v_scales", D / kNvfp4Block, k_codes);
  const int64_t P = k_codes.size(1), H = k_codes.size(2);
  check_dtype(k_new, at::kBFloat16, "k_new");
  check_dtype(v_new, at::kBFloat16, "v_new");
  TORCH_CHECK_VALUE(k_new.dim() == 3 && k_new.size(1) == H && k_new.size(2) == D, "trace_ext: k_new must be [T, ", H,
                    ", ", D, "], got ", k_new.sizes());
  check_shape(v_new, k_new.sizes(), "v_new");
  check_contiguous(k_new, "k_new");
  check_contiguous(v_new, "v_new");
  check_dtype(block_table, at::kInt, "block_table");
  check_dtype(cu_seqlens, at::kInt, "cu_seqlens");
  check_dtype(start_pos, at::kInt, "start_pos");
  TORCH_CHECK_VALUE(block_table.dim() == 2, "trace_ext: block_table must be [B, max_pages], got ", block_table.sizes());
  const int64_t B = block_table.size(0);
  check_shape(cu_seqlens, {B + 1}, "cu_seqlens");
  check_shape(start_pos, {B}, "start_pos");
  check_contiguous(block_table, "block_table");
  check_contiguous(cu_seqlens, "cu_seqlens");
  check_contiguous(start_pos, "start_pos");
  for (const auto* t : {&k_new, &v_new, &block_table, &cu_seqlens, &start_pos}) {
    check_same_device(*t, k_codes, "an argument", "the cache");
  }
  const int64_t T = k_new.size(0);
  if (k_new.numel() == 0) return;  // no tokens (or H_kv / head_dim 0): nothing to write
  TORCH_CHECK_VALUE(B > 0 && P > 0 && k_codes.size(0) > 0, "trace_ext: fp4kv_append: ", T,
                    " new tokens need at least one sequence and a cache with pages and page_size > 0, got block_table ",
                    block_table.sizes(), " and k_codes ", k_codes.sizes());
  // the caches are written in place (no aligned copy possible): the narrowest kernel stores 8 code bytes per block
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(k_codes.data_ptr()) % 8 == 0 &&
                        reinterpret_cast<uintptr_t>(v_codes.data_ptr()) % 8 == 0,
                    "trace_ext: fp4kv_append: k_codes and v_codes must start 8-byte aligned (a uint8 view at an odd "
                    "offset?)");
  TORCH_CHECK_VALUE(2 * T * H * (D / kNvfp4Block) < (int64_t(1) << 31), "trace_ext: fp4kv_append: at most 2^31 blocks "
                    "per call (T_new * H_kv * D / 8), got T_new=", T);
  TORCH_CHECK_VALUE(block_table.size(1) * P < (int64_t(1) << 31), "trace_ext: fp4kv_append: positions must fit int32");

  c10::cuda::CUDAGuard guard(k_codes.device());
  // two blocks per thread when a row has an even number of blocks and the cache bases allow the 16-byte code and
  // 2-byte scale stores (always, for torch allocations and head dims 64 / 128)
  const int64_t nb = D / kNvfp4Block;
  const bool pair = nb % 2 == 0 && reinterpret_cast<uintptr_t>(k_codes.data_ptr()) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(v_codes.data_ptr()) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(k_scales.data_ptr()) % 2 == 0 &&
                    reinterpret_cast<uintptr_t>(v_scales.data_ptr()) % 2 == 0;
  const int per = pair ? 2 : 1;
  auto kernel = pair ? fp4kv_append_kernel<2> : fp4kv_append_kernel<1>;
  require_kernel_image(kernel, op);
  // the kernel reads bf16 rows with 16-byte loads: an offset view gets an aligned copy
  const at::Tensor k_src = reinterpret_cast<uintptr_t>(k_new.data_ptr()) % 16 ? k_new.clone() : k_new;
  const at::Tensor v_src = reinterpret_cast<uintptr_t>(v_new.data_ptr()) % 16 ? v_new.clone() : v_new;
  AppendParams p;
  p.k_new = reinterpret_cast<const uint16_t*>(k_src.data_ptr());
  p.v_new = reinterpret_cast<const uint16_t*>(v_src.data_ptr());
  p.k_codes = k_codes.data_ptr<uint8_t>();
  p.k_scales = k_scales.data_ptr<uint8_t>();
  p.v_codes = v_codes.data_ptr<uint8_t>();
  p.v_scales = v_scales.data_ptr<uint8_t>();
  p.block_table = block_table.data_ptr<int32_t>();
  p.cu_seqlens = cu_seqlens.data_ptr<int32_t>();
  p.start_pos = start_pos.data_ptr<int32_t>();
  p.batch = (int)B;
  p.max_pages = (int)block_table.size(1);
  p.page_size = (int)P;
  p.heads = (int)H;
  p.head_dim = (int)D;
  p.tokens = (int)T;
  const FastDiv fd_ni = FastDiv::make((uint32_t)(nb / per)), fd_h = FastDiv::make((uint32_t)H),
                fd_p = FastDiv::make((uint32_t)P);
  p.ni_mul = fd_ni.mul, p.ni_shr = fd_ni.shr;
  p.heads_mul = fd_h.mul, p.heads_shr = fd_h.shr;
  p.page_mul = fd_p.mul, p.page_shr = fd_p.shr;
  p.g_k = (float)g_k;
  p.g_v = (float)g_v;
  const char* impl_env = std::getenv("TRACE_EXT_KV_APPEND_IMPL");  // read per call: one process can time both
  p.rcp_quotient = (impl_env != nullptr && std::strcmp(impl_env, "old") == 0) ? 0 : 1;
  TORCH_CHECK_VALUE(std::isfinite(p.g_k) && p.g_k > 0.0f && std::isfinite(p.g_v) && p.g_v > 0.0f,
                    "trace_ext: g_k and g_v must be finite and > 0, got ", g_k, ", ", g_v);

  const int sms = sm_count(k_codes.get_device());  // cached per device (host_checks.h)
  // The warp-stream kernel applies where its scale-byte reciprocals are exact (g in [2^-50, 2^50]) and rows are an
  // even number of blocks (unaligned cache bases: never for torch allocations); elsewhere the grid kernel runs.
  // TRACE_EXT_KV_APPEND_IMPL (read per call): unset = auto: the warp kernel with two blocks per item when every
  // resident warp gets at least 32 items (one item per lane: H200 A/B at 2071576, prefill 8 x 4096 1.12x, 32 x 1024
  // 1.10x), the grid kernel for smaller appends (decode steps: 256 sequences x 1 token, warp2 0.98x); =warp2 / =warp
  // (four blocks per item where rows allow) force the warp kernel, =grid (and =old) the grid kernel.
  const auto g_rcp_ok = [](float g) { return g >= 0x1p-50f && g <= 0x1p50f; };
  const bool warp4 = impl_env != nullptr && std::strcmp(impl_env, "warp") == 0;
  const bool warp2 = impl_env != nullptr && std::strcmp(impl_env, "warp2") == 0;
  const bool auto_impl = impl_env == nullptr || (!warp4 && !warp2 && std::strcmp(impl_env, "grid") != 0 &&
                                                 std::strcmp(impl_env, "old") != 0);
  const auto aligned = [](const at::Tensor& t, uintptr_t a) {
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % a == 0;
  };
  // CTAs per SM of each instantiation (a property of the kernel image, the same on every device of the build's arch)
  const auto ctas_of = [](auto kernel) {
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kAppendThreads, 0);
    return n;
  };
  const int wper = (warp4 && nb % 4 == 0 && aligned(k_scales, 4) && aligned(v_scales, 4)) ? 4 : 2;
  const int64_t resident_warps = [&] {
    static const int occupancy[2] = {ctas_of(fp4kv_append_warp_kernel<2>), ctas_of(fp4kv_append_warp_kernel<4>)};
    return (int64_t)sms * std::max(occupancy[wper == 4 ? 1 : 0], 1) * kWarpsPerCta;
  }();
  const int64_t per_tensor = T * H * (nb / wper);  // items of K (and of V)
  const bool warp_ok = pair && g_rcp_ok(p.g_k) && g_rcp_ok(p.g_v);
  if (warp_ok && (warp4 || warp2 || (auto_impl && per_tensor >= 32 * resident_warps))) {
    auto wkernel = wper == 4 ? fp4kv_append_warp_kernel<4> : fp4kv_append_warp_kernel<2>;
    require_kernel_image(wkernel, op);
    const int64_t ni = nb / wper;
    p.items_per_token = (int)(H * ni);
    const FastDiv fd_it = FastDiv::make((uint32_t)p.items_per_token), fd_ni_w = FastDiv::make((uint32_t)ni);
    p.it_mul = fd_it.mul, p.it_shr = fd_it.shr;
    p.ni_mul = fd_ni_w.mul, p.ni_shr = fd_ni_w.shr;
    p.step_tokens = 32 / p.items_per_token;
    p.step_items = 32 % p.items_per_token;
    p.rg_k = 1.0f / p.g_k;  // IEEE single division on the host: fl(1 / g)
    p.rg_v = 1.0f / p.g_v;
    // Two waves of warps (default since the H200 A/B of rounds 30-32: 1.01-1.03x on the prefill cases, three
    // timings), every warp a contiguous chunk of one tensor rounded up to whole warp steps (no partly idle last step),
    // at least 32 items (small appends: fewer warps, each with all lanes busy); CTAs of the second wave start as
    // those of the first finish, so the hardware balances the tail. TRACE_EXT_KV_APPEND_WAVES=n (1..64, read per
    // call): n waves; 1 is the previous plan (one full wave, chunks equal to within one item, not rounded).
    const int waves = kv_append_waves();
    const int64_t want_per_tensor = std::max<int64_t>(1, resident_warps / 2) * waves;
    int64_t chunk = std::max<int64_t>(32, (per_tensor + want_per_tensor - 1) / want_per_tensor);
    if (waves > 1) chunk = (chunk + 31) / 32 * 32;
    p.chunk = (int)chunk;
    p.warps_per_tensor = (int)((per_tensor + chunk - 1) / chunk);
    const int wgrid = (int)((2 * (int64_t)p.warps_per_tensor + kWarpsPerCta - 1) / kWarpsPerCta);
    wkernel<<<wgrid, kAppendThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(p);
    check_launch(op);
    return;
  }

  const int64_t items = 2 * T * H * (nb / per);
  const int64_t want = (items + kAppendThreads - 1) / kAppendThreads;
  const int grid = (int)std::min<int64_t>(want, (int64_t)sms * 16);
  kernel<<<grid, kAppendThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(p);
  check_launch(op);
}

}  // namespace

TORCH_LIBRARY_IMPL(trace_ext, CUDA, m) { m.impl("fp4kv_append", &fp4kv_append_cuda); }

}  // namespace trace_ext
