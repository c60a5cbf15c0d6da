// NVFP4 quantize / fake-quantize / dequantize (SPEC 2, 4, 5, 6), bit-exact against reference.py.
//
// Design (memory-bound: 2 B read + 0.5625 B written per bf16 element; on the H200 the limit is instruction issue,
// so every choice below counts instructions per element):
// - A lane owns whole 16-element blocks and loads each with its own 16-byte vectors (for bf16 two loads, 32 B
//   apart across lanes: the warp's pair of loads covers one contiguous span, sectors are fetched once). Per-block
//   work (amax, scale byte, reciprocal, stores) happens once per 16 elements in one thread; code / scale / mbits
//   stores of a warp are contiguous. No shuffles.
// - g given (per row or one value), guided rounding, and the second pass of long rows: the flat kernel. Warps loop
//   over tiles of 64 blocks (kFlatTilesPerWarp tiles each, grid stride) so that the per-thread setup is amortized.
// - g None (per-row scale, activations): a team of threads per row (power of two, 1..512 threads), lane l owning
//   blocks l + team q (q < 2), loads its row into registers once (kept as packed raw vectors), reduces the row's
//   finite amax (shuffles, plus shared memory across warps of a team), derives g and quantizes from the registers:
//   one HBM read of x, one launch. Rows up to kFusedMaxK = 16384 elements fit (512 threads x 32). Longer rows take a documented
//   two-pass path: kernel 1 writes the per-row g (finite amax / 2688), kernel 2 is the flat kernel reading it.
// - Dequantize: warp tiles of 8-element chunks, one 16-byte store of bf16 / fp16 per chunk, contiguous across the warp.
// - Every numeric step comes from fp4_numerics.cuh; all float ops are __f*_rn (no contraction, no FTZ).
// - Amax of 16-bit inputs: two magnitudes per max.u16x2 on the raw halves (their bits order like the values).
// - Scale byte: fl(amax / 6) and fl(y / g) by correctly rounded reciprocals (fl(1/6) and one fl(1/g) per row) in the
//   range where that division is exact (nvfp4_scale_byte_rcp), __fdiv_rn outside it.
// - Elements: v = fl(x / t) is one FMUL and two FMAs with the block's correctly rounded reciprocal (Markstein; exact
//   where t, 1/t and the quotients are far from under/overflow, checked per block, __fdiv_rn otherwise). RTN works
//   on u = v * 2^-14 (divisor t * 2^14, reciprocal r * 2^-14: same quotient, scaled exactly): saturate, round in fp32
//   (magic add below 2, Veltkamp split from 1 up), convert pairs to fp16, whose bits 9..11 are the code
//   (e2m1_rn_grid_x2m14, e2m1_pack8_x2m14; exhaustively checked against reference.py's rounding). SR / guided work
//   in the same domain: floor = min(round-down magic add, 2-bit mask); SR keeps lo or takes lo + w by one round-down
//   FMA (lo + k w 2^-24 < a, exact); guided combines the packed floor codes, one off-grid bit per nibble and the
//   rollout's bits / codes eight at a time (e2m1_floor_grid_x2m14, e2m1_sr_grid_x2m14, e2m1_guided_*_pack8; signs
//   by prmt sign replication). All were checked against reference.py: RTN over every non-negative float, the
//   scaled SR / guided floor, off-grid test and SR threshold over every float in [2^-100, 8] (numpy emulation), the
//   division in exact arithmetic near every rounding midpoint. TRACE_EXT_QUANT_IMPL=bits keeps the previous SR /
//   guided code (codes read off the float's bits, e2m1_*_bits); RTN saturates after packing (one min.u16x2 per
//   fp16 pair), =rtn-fminf keeps the per-element fminf saturation (A/B; bench/results/quant_impl_h200.md).
// - SR: one philox4x32_10 call per 4 elements (counter = flat element index / 4, SPEC 4), with the seed's key
//   schedule precomputed on the host (philox4x32_10_scheduled: keys are constant-bank operands of the XORs).
//   SR / guided skip the per-element tiny-quotient test when a block-level bound on the smallest nonzero |x|
//   proves it false for every element (quantize_block).
// - Default since the H200 A/B at 2071576 ("lean"; TRACE_EXT_QUANT_IMPL=rtn-sat keeps the previous code; RTN g
//   given 70.5% -> 82.1% of copy at 2^28, guided full 64.8% -> 70.8%): RTN by one magic add whose magic number is a power of two taken
//   from u's exponent bits (e2m1_rn_grid_pow2_x2m14: LOP3, VIMNMX, two FFMAs per element instead of four FADDs, an FMUL,
//   an FSETP and a predicated FADD), in the flat, lean and per-row kernels. Quantize (not fake) with linear scales
//   and a 32-bit block walk goes through nvfp4_quant_lean_kernel (RTN, guided; SR stays on the flat kernel, where
//   ptxas keeps it within 64 registers without spilling): per-tile row division replaced by a grid-stride step, one
//   g hoisted, rollout scale bytes loaded with x, no per-block output-pointer tests. Per-row kernel: the warp's row
//   amax by one redux.sync (teams of >= 32 threads), codes / scales stores untested. Static SASS of the bf16 RTN
//   flat tile (2 blocks of 16 per lane) on sm_90a: ~565 instructions on the hot path instead of ~712 (profile of
//   the default), no spills (the default RTN flat kernel: 16 / 48 bytes).
// - Default since the H200 A/B at c7928a5 (TRACE_EXT_QUANT_IMPL=rowg-lean2; =lean keeps the previous default; per-row
//   g 1.03-1.06x, swizzled 1.12-1.16x, capture 1.03-1.05x): RTN quantize with g
//   None (the rollout's activation quantization, linear or swizzled scales, capture) through
//   nvfp4_quant_rowg_lean_kernel: persistent 256-thread CTAs (4 per SM, <= 64 registers), a team per row walking rows
//   by a grid stride with the next row's loads issued before the current row's amax reduction, 32-bit indices, g by
//   the correctly rounded reciprocal of 2688 (nvfp4_global_scale_rcp). Everything else runs the default's kernels.
// - Default since the H200 A/B at 7b3e763 (TRACE_EXT_QUANT_IMPL=guided-lean; =rowg-lean2 keeps the previous default;
//   guided compact 1.29-1.31x -> 72.0% / 81.9% of copy at 2^26 / 2^28, full 1.26x -> 79.2% / 88.3%): guided
//   quantize of 16-bit x through nvfp4_quant_guided_lean_kernel (the lean kernel's walk and loads). Floors by one
//   cvt.rz.f16x2 and a mask per pair (e2m1_floor_pair_rz_x2m14), off-grid bits as the signs of lo - a gathered by byte
//   permutes (e2m1_guided_lo8_rz_x2m14), the tiny-quotient test's minimum on packed halves (min.s16x2), x's signs
//   from the raw words, compact bits spread by two multiplies; full saturates the fp16 floors (min.u16x2 per pair)
//   instead of each quotient. Static SASS per 16-element bf16 block (sm_90a, fast path with stores): compact 343 -> 266
//   (ALU-pipe 213 -> 141), full 338 -> 257 (215 -> 136); per 32-element tile with the walk 760 -> 608 / 750 -> 590.
//   60 / 58 registers, no spills. Checked: tests/test_guided_rz_emulation.py,
//   tools/exhaustive_guided_rz.py (every float a in [0, 6 * 2^-14]), tests/gpu/test_quant_guided_lean_gpu.py.
// - Default since the H200 A/B at aed970c (TRACE_EXT_QUANT_IMPL=sr-lean; =guided-lean keeps the previous default; SR
//   per-row 1.15x -> 34.5% of copy at 2^28, g given 1.17x, fake-quant SR 1.11x, MXFP4 SR 1.20x, timed twice): SR's
//   fast-path element code is sr_elems_lean_x2m14 (quant_sr_elems.cuh: one round-up FFMA per element decides lo / hi,
//   one cvt.rz.f16x2 per pair floors; 22.6 instead of 30.7 static instructions per element in the probe; exhaustively
//   checked by tools/exhaustive_sr_lean.py). Nsight of the previous SR kernel (nvfp4_quant_rowg_kernel, 2^26 bf16):
//   45.6 thread instructions per element, IPC 2.70, ALU pipe 69%, 76 registers; the persistent per-row kernel with
//   the same element code ran at 1.00x (branch next/srrow), so the element code is what SR's time is made of.
// - Default since the H200 A/B at fa48a9d (TRACE_EXT_QUANT_IMPL=sr-row; =sr-lean keeps the per-row kernel below): SR
//   quantize with g None through nvfp4_quant_rowg_lean_kernel (MODE = kSR, the lean SR element code: the same bits), 3
//   CTAs per SM (79 registers, no spills; the default per-row kernel ran SR at 64 registers with spills): 1.03-1.04x,
//   timed twice (35.8% of copy at 2^28). 4 CTAs per SM at the 64-register cap: 0.93-0.95x (spills). With the previous
//   SR element code the persistent kernel ran at 1.00x (round 14).
// - Default since the H200 rounds 45-47 (TRACE_EXT_QUANT_IMPL=rowg-lean3; =sr-row keeps the previous default; 1.08-
//   1.17x in three timings, per-row 82.5% / capture 81.0% / swizzled 78.3% of copy at 2^28): RTN quantize of 16-bit x
//   with g None through nvfp4_quant_rowg_lean3_kernel, the previous per-row kernel's walk with less per-row work (its
//   comment lists what changed; same bits). Static SASS of one row step of the bf16 kernels (32 elements per thread,
//   team 128, sm_90a, fast path): the previous kernel 650 instructions (20.3 per element; Nsight 20.4 executed), of
//   which ~491 are the per-block work the g-given lean kernel also does (elements 2 x 158, unpack, amax, scale byte,
//   1/t, tests, stores; 15.3 per element) and ~159 per-row overhead (5.0: next-row copy and zero fill 24, cross-warp
//   amax 36, 1/g 17, team / lane / index values rederived per block at 64 registers, row and mbits tests); rowg-lean3
//   541-543 (16.9; overhead ~51), swizzled 666 -> 555-558, capture 682 -> 573-575, both 698 -> 587-590. 64 registers,
//   no spills (sm_90a, sm_100a); the loop holds two row steps (3413 instructions with the slow paths, the previous
//   kernel's 1808).
// - Default since the H200 rounds 48-49 (TRACE_EXT_QUANT_IMPL=sr-row keeps the previous kernel, =fake-lean3 takes the
//   lean3 kernel for every kb): RTN fake quantization (the trainer's QAT forward, with or without emit_guidance) of
//   16-bit x with g None where the row's block count is not a power of two runs nvfp4_quant_rowg_lean3_kernel's FAKE
//   instantiation (y = the dequantized codes, as process_block's FAKE path): K 5120 1.20-1.23x, K 7168 1.07-1.10x,
//   K 768 0.99-1.05x; at powers of two the previous kernel stayed (0.94-1.04x there) until round 54: with the grid
//   of round 52 below, lean3 fake quantization at kb a power of two ran 1.03-1.15x the previous kernel (K 1024 to
//   8192, 2^26 and 2^28 elements, with / without emit_guidance, two timings; fake_lean3_pow2_ab_h200{,_run2}.md),
//   so the default takes it for every kb; =fake-lean3 names the default.
// - Default since the H200 round 52 (TRACE_EXT_QUANT_LEAN_ITERS=0 keeps the previous grid): the lean per-row kernels
//   (lean3 quantize / fake quantization, SR's per-row lean kernel) walk at most kLeanItersMax = 4 row groups per CTA,
//   a grid of several waves instead of one persistent wave (rowg_lean_plan); same bits.
// - Defaults since H200 rounds 58-60 (each with its knob, read per call; same bits): RTN quantize / fake quantization
//   with g given (given_lean3) and guided compact quantize of bf16 x (guided_lean3) walk rows through the lean3
//   kernel (its GIVEN / guided instantiations: the next row's x, g and guidance in flight) instead of the flat tile
//   walk, 1.05-1.12x / 1.02-1.04x; the lean3 fake quantization waits on per-team named barriers (team_bar_selected),
//   1.01-1.04x.
// - Default since H200 rounds 63-65 (TRACE_EXT_QUANT_FAKE_GUIDED_LEAN3=0 keeps the flat kernel): guided fake
//   quantization of 16-bit x (the trainer's TRACE forward) through the lean3 kernel's FAKE guided instantiations
//   (fake_guided_lean3), 1.03-1.33x.
// - Swizzled scales: written at their 128x4 offsets; the zero padding is written by the same launch
//   (a grid-stride pass over the padded bytes of the last row tile and the last column chunk of each tile).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>

#include "trace_ext/fp4_numerics.cuh"
#include "trace_ext/host_checks.h"
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
// e2m1_pack8_abs_x2m14<true>.
template <bool POW2, int N>
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
    w[k] = e2m1_pack8_abs_x2m14<true>(g, sb);
  }
}

// Element loop over N elements of one block; FAST: v = fl(x / t) from the block reciprocal (div_rn_with_rcp),
// else __fdiv_rn. IMPL (FAST only): kImplScaled, kImplBits or kImplRtnSat (alternatives kept for A/B timing).
template <int MODE, bool FAST, int N, int IMPL>
__device__ __forceinline__ void quantize_elems(const float (&x)[N], float t, float r, uint64_t ctr0,
                                               const QuantParams& p, uint32_t guide_bits, uint2 guide_codes,
                                               uint32_t (&w)[N / 8]) {
  // ctr0: Philox counter of element 0 (flat element index / 4, SPEC 4)
  if constexpr (MODE == kSR && FAST && IMPL == kImplSrLean) {
    // SR (lean): one round-up FFMA per element and one cvt.rz.f16x2 per pair (quant_sr_elems.cuh). ctr0 = 4 * flat
    // block index, a multiple of 4: its low word + 3 never carries.
    static_assert(N % 16 == 0, "whole blocks: the counter of element 0 is a multiple of 4");
    sr_elems_lean_x2m14<N>(x, t, r, (uint32_t)ctr0, (uint32_t)(ctr0 >> 32), (uint32_t)p.offset,
                           (uint32_t)(p.offset >> 32), p.keys, w);
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
template <int MODE, int N, int IMPL>
__device__ __forceinline__ void quantize_block(const float (&x)[N], uint32_t max_bits, float t, uint64_t ctr0,
                                               const QuantParams& p, uint32_t guide_bits, uint2 guide_codes,
                                               uint32_t (&w)[N / 8]) {
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
    quantize_elems<MODE, true, N, IMPL>(x, t, r, ctr0, p, guide_bits, guide_codes, w);
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
// guide_bits: the rollout's 16 mantissa bits (compact); guide_codes: its 16 rollout codes (full).
template <typename T, int MODE, bool FAKE, int IMPL>
__device__ __forceinline__ void process_block(const QuantParams& p, const float (&x)[kNvfp4Block], uint32_t max_bits,
                                              float g, float rg, uint64_t fb, int64_t row, int64_t kbi,
                                              uint32_t guide_bits, uint2 guide_codes) {
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
    quantize_block<MODE, kNvfp4Block, IMPL>(x, max_bits, t, 4 * fb, p, guide_bits, guide_codes, codes);
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

// max |x| of a block as float bits (raw_max_abs_bits over its vectors).
template <typename T>
__device__ __forceinline__ uint32_t block_max_abs_bits(const BlockRaw<T>& raw) {
  return raw_max_abs_bits<T>(raw.v);
}

// The block's 16 values as floats (exact); returns block_max_abs_bits.
template <typename T>
__device__ __forceinline__ uint32_t unpack_block(const BlockRaw<T>& raw, float (&x)[kNvfp4Block]) {
  constexpr int kV = ElemTraits<T>::kPerVec;
#pragma unroll
  for (int v = 0; v < BlockRaw<T>::kVecs; ++v) vec_to_float<T>(raw.v[v], x + v * kV);
  return block_max_abs_bits<T>(raw);
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

// ---- flat kernel: g known per block (given, guided, or the second pass of long rows) -----------------------
// Work is cut into warp tiles of kWarpBlocks consecutive blocks; warps loop over tiles with a grid stride (the
// per-thread setup is paid once for several tiles). In a tile, lane l owns blocks l + 32 q (q < kBlocksPerLane) and
// loads each with its own 16-byte vectors (the warp's two loads of one q cover a contiguous span), so every
// per-block step (scale, reciprocal, stores) happens once per 16 elements in one thread, and the code, scale and
// mbits stores of a warp are contiguous.
template <typename T, int MODE, bool FAKE, int IMPL>
__global__ void __launch_bounds__(kFlatThreads) nvfp4_quant_flat_kernel(const QuantParams p) {
  const uint64_t total_blocks = (uint64_t)p.rows * p.kb;
  const uint64_t n_tiles = (total_blocks + kWarpBlocks - 1) / kWarpBlocks;
  const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uint64_t n_warps = (uint64_t)gridDim.x * blockDim.x / 32;
  const uint32_t lane = threadIdx.x % 32;
  const T* xp = reinterpret_cast<const T*>(p.x);
  for (uint64_t tile = tid / 32; tile < n_tiles; tile += n_warps) {
    const uint64_t fb0 = tile * kWarpBlocks + lane;
    BlockRaw<T> raw[kBlocksPerLane];
#pragma unroll
    for (int q = 0; q < kBlocksPerLane; ++q) raw[q] = load_block<T>(xp, fb0 + 32 * q, fb0 + 32 * q < total_blocks);
    uint32_t gbits[kBlocksPerLane];
    uint2 gcodes[kBlocksPerLane];
#pragma unroll
    for (int q = 0; q < kBlocksPerLane; ++q) {
      const uint64_t fb = fb0 + 32 * q;
      gbits[q] = 0u;
      gcodes[q] = make_uint2(0u, 0u);
      if constexpr (MODE == kGuidedCompact) {
        if (fb < total_blocks) gbits[q] = __ldg(reinterpret_cast<const uint16_t*>(p.guide_payload) + fb);
      } else if constexpr (MODE == kGuidedFull) {
        if (fb < total_blocks) gcodes[q] = __ldg(reinterpret_cast<const uint2*>(p.guide_payload) + fb);
      }
    }
    // Rows / block columns of the lane's blocks: one division, then a carry (one step when kb >= 32).
    int64_t rows[kBlocksPerLane], kbis[kBlocksPerLane];
    {
      int64_t row = row_of(fb0, p.kb);
      int64_t kbi = (int64_t)fb0 - row * p.kb;
#pragma unroll
      for (int q = 0; q < kBlocksPerLane; ++q) {
        rows[q] = row;
        kbis[q] = kbi;
        kbi += 32;
        while (kbi >= p.kb) {
          kbi -= p.kb;
          ++row;
        }
      }
    }
    float g[kBlocksPerLane], rg[kBlocksPerLane];
#pragma unroll
    for (int q = 0; q < kBlocksPerLane; ++q) {
      g[q] = 0.0f;
      if (fb0 + 32 * q < total_blocks) {
        if constexpr (MODE == kGuidedCompact || MODE == kGuidedFull) {
          g[q] = __ldg(p.guide_g + rows[q]);
        } else {
          g[q] = __ldg(p.g + rows[q] * p.g_stride);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kBlocksPerLane; ++q) {
      if constexpr (MODE == kRTN || MODE == kSR) {
        rg[q] = q > 0 && g[q] == g[q - 1] ? rg[q - 1] : rcp_g_in_range(g[q]);  // one reciprocal per row, mostly
      } else {
        rg[q] = 0.0f;  // guided: the scale byte is the rollout's
      }
    }
#pragma unroll
    for (int q = 0; q < kBlocksPerLane; ++q) {
      const uint64_t fb = fb0 + 32 * q;
      if (fb < total_blocks) {
        float x[kNvfp4Block];
        const uint32_t mb = unpack_block<T>(raw[q], x);
        process_block<T, MODE, FAKE, IMPL>(p, x, mb, g[q], rg[q], fb, rows[q], kbis[q], gbits[q], gcodes[q]);
      }
    }
  }
  // g_out[r]: the g each block of row r used (given or the rollout's), copied once per row.
  if (p.g_out != nullptr && p.g_out != p.g) {
    for (int64_t r = (int64_t)tid; r < p.rows; r += (int64_t)gridDim.x * blockDim.x) {
      if constexpr (MODE == kGuidedCompact || MODE == kGuidedFull) {
        p.g_out[r] = __ldg(p.guide_g + r);
      } else {
        p.g_out[r] = __ldg(p.g + r * p.g_stride);
      }
    }
  }
  if (p.swizzle && p.scales != nullptr) swizzle_pad_zero(p, (int64_t)tid, (int64_t)gridDim.x * blockDim.x);
}

// ---- lean flat kernel (default; TRACE_EXT_QUANT_IMPL=lean): the flat kernel's tiling with less per-tile / per-block work ----
// Taken for quantize (not fake) with linear scales when every block index of the walk fits 32 bits. Differences
// from nvfp4_quant_flat_kernel, all outside the element arithmetic: 32-bit block indices; each thread divides once
// and then steps its (row, block column) by the grid stride (LeanWalk: stride / kb and stride % kb from the host)
// instead of a 64-bit division per tile; one g (g_stride 0) and its reciprocal are loaded / formed once per thread
// (GSCALAR); the rollout's scale bytes are loaded with x (their first use no longer waits a second latency); codes
// and scales are known to exist (no per-block pointer tests, no swizzle / fake-quant branches). RTN elements use
// e2m1_rn_grid_pow2_x2m14 (quantize_elems, kImplLean).
struct LeanWalk {
  uint32_t total_blocks;   // rows * kb; total_blocks + stride_blocks < 2^31 (host-checked)
  uint32_t stride_blocks;  // blocks between a warp's consecutive tiles: warps in the grid * kWarpBlocks
  uint32_t kb;             // blocks per row
  uint32_t step_rows;      // stride_blocks / kb
  uint32_t step_kbi;       // stride_blocks % kb
};

template <typename T, int MODE, bool GSCALAR>
__global__ void __launch_bounds__(kFlatThreads, 4) nvfp4_quant_lean_kernel(const QuantParams p, const LeanWalk w) {
  constexpr bool kGuided = MODE == kGuidedCompact || MODE == kGuidedFull;
  static_assert(!(GSCALAR && kGuided), "guided rounding reads the rollout's g per row");
  const uint32_t lane = threadIdx.x % 32;
  uint32_t fb0 = (blockIdx.x * (uint32_t)kFlatThreads + threadIdx.x) / 32 * kWarpBlocks + lane;
  uint32_t row0 = fb0 / w.kb;
  uint32_t kbi0 = fb0 - row0 * w.kb;
  const T* xp = reinterpret_cast<const T*>(p.x);
  float g_one = 0.0f, rg_one = 0.0f;
  if constexpr (GSCALAR) {
    g_one = __ldg(p.g);
    rg_one = rcp_g_in_range(g_one);
  }
  for (; fb0 < w.total_blocks; fb0 += w.stride_blocks) {
    BlockRaw<T> raw[kBlocksPerLane];
#pragma unroll
    for (int q = 0; q < kBlocksPerLane; ++q) raw[q] = load_block<T>(xp, fb0 + 32 * q, fb0 + 32 * q < w.total_blocks);
    uint32_t gbits[kBlocksPerLane];
    uint2 gcodes[kBlocksPerLane];
    uint8_t gscale[kBlocksPerLane];
#pragma unroll
    for (int q = 0; q < kBlocksPerLane; ++q) {
      const uint32_t fb = fb0 + 32 * q;
      const bool ok = fb < w.total_blocks;
      gbits[q] = 0u;
      gcodes[q] = make_uint2(0u, 0u);
      gscale[q] = 0;
      if constexpr (MODE == kGuidedCompact) {
        if (ok) gbits[q] = __ldg(reinterpret_cast<const uint16_t*>(p.guide_payload) + fb);
      } else if constexpr (MODE == kGuidedFull) {
        if (ok) gcodes[q] = __ldg(reinterpret_cast<const uint2*>(p.guide_payload) + fb);
      }
      if constexpr (kGuided) {
        if (ok) gscale[q] = __ldg(p.guide_scales + fb);
      }
    }
    float g[kBlocksPerLane], rg[kBlocksPerLane];
    if constexpr (GSCALAR) {
#pragma unroll
      for (int q = 0; q < kBlocksPerLane; ++q) {
        g[q] = g_one;
        rg[q] = rg_one;
      }
    } else {
      // rows of the lane's blocks: block q = 1 is 32 further (one carry step when kb >= 32)
      uint32_t rows[kBlocksPerLane];
      uint32_t row = row0, kbi = kbi0;
#pragma unroll
      for (int q = 0; q < kBlocksPerLane; ++q) {
        rows[q] = row;
        kbi += 32;
        while (kbi >= w.kb) {
          kbi -= w.kb;
          ++row;
        }
      }
#pragma unroll
      for (int q = 0; q < kBlocksPerLane; ++q) {
        g[q] = 0.0f;
        if (fb0 + 32 * q < w.total_blocks) g[q] = __ldg((kGuided ? p.guide_g : p.g) + rows[q]);
      }
#pragma unroll
      for (int q = 0; q < kBlocksPerLane; ++q) {
        if constexpr (kGuided) {
          rg[q] = 0.0f;  // the scale byte is the rollout's
        } else {
          rg[q] = q > 0 && g[q] == g[q - 1] ? rg[q - 1] : rcp_g_in_range(g[q]);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kBlocksPerLane; ++q) {
      const uint32_t fb = fb0 + 32 * q;
      if (fb < w.total_blocks) {
        float x[kNvfp4Block];
        const uint32_t mb = unpack_block<T>(raw[q], x);
        bool finite = mb < 0x7F800000u;
        uint8_t s;
        float t;
        if constexpr (kGuided) {
          s = gscale[q];
          t = nvfp4_block_divisor(s, g[q]);
          finite = finite && isfinite(t);  // a rollout NaN scale makes the block NaN
        } else {
          s = nvfp4_scale_byte_rcp(mb, g[q], rg[q]);
          t = nvfp4_block_divisor(s, g[q]);
        }
        uint32_t codes[2] = {0u, 0u};
        if (finite) {
          quantize_block<MODE, kNvfp4Block, kImplLean>(x, mb, t, 4 * (uint64_t)fb, p, gbits[q], gcodes[q], codes);
        } else {
          s = kE4M3NaN;
        }
        reinterpret_cast<uint2*>(p.codes)[fb] = make_uint2(codes[0], codes[1]);
        if (p.mbits != nullptr) {
          reinterpret_cast<uint16_t*>(p.mbits)[fb] = (uint16_t)(nibble_lsbs(codes[0]) | (nibble_lsbs(codes[1]) << 8));
        }
        p.scales[fb] = s;
      }
    }
    if constexpr (!GSCALAR) {
      row0 += w.step_rows;
      kbi0 += w.step_kbi;
      if (kbi0 >= w.kb) {
        kbi0 -= w.kb;
        ++row0;
      }
    }
  }
  // g_out[r]: the g each block of row r used (given or the rollout's), copied once per row.
  if (p.g_out != nullptr && p.g_out != p.g) {
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int64_t r = tid; r < p.rows; r += (int64_t)gridDim.x * blockDim.x) {
      if constexpr (kGuided) {
        p.g_out[r] = __ldg(p.guide_g + r);
      } else {
        p.g_out[r] = __ldg(p.g + r * p.g_stride);
      }
    }
  }
}

// ---- guided lean kernel (TRACE_EXT_QUANT_IMPL=guided-lean): guided quantize with fewer instructions per element ----
// Taken where nvfp4_quant_lean_kernel is (guided quantize, linear scales, 32-bit block walk); the same walk, loads and
// stores. Differences, all in the per-block / per-element work (the results are the same bits):
// - Floors and off-grid bits by e2m1_guided_lo8_rz_x2m14 (one cvt.rz.f16x2 + one mask per pair, the floor back in
//   fp32 by a half conversion, the off-grid bit as the sign of lo - a gathered by byte permutes) instead of
//   e2m1_floor_grid_x2m14 (four instructions per element), an FSETP, a select and an add per element, and the fp16
//   conversion of the floors for packing (the floors already are fp16).
// - The block's smallest nonzero |x| (the tiny-quotient test of quantize_block) for 16-bit x on the raw halves, two
//   at a time: h - 1 (mod 2^16) orders +0 last, and with h = |x| bits <= 0x7FFF, (h + 0x7FFF) read as a signed 16-bit
//   number is h - 1 - 2^15 for h > 0 and 2^15 - 1 for h = 0: one add (no carry between the halves: h + 0x7FFF <
//   2^16) and one signed min.s16x2 per pair instead of a mask, an add and a min per element (raw_min_nonzero_abs_bits;
//   the masked halves are the amax's).
// - x's signs gathered from the raw 16-bit words (sign_bytes8_raw16: four byte permutes per 8 elements instead of six);
//   the rollout's compact bits spread to nibble LSBs by two multiplies (bits_to_nibble_lsbs_mul).
// - Loads: the rollout's payload and scale bytes of both blocks are issued with x, before the row arithmetic (g's
//   loads depend on it).
// 16-bit x only (fp32 x: ptxas spills this kernel at 64 registers; fp32 keeps the default's kernels).

// min.s16x2: signed min of two pairs of 16-bit lanes.
__device__ __forceinline__ uint32_t min_s16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("min.s16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Float bits of the smallest nonzero |x| of a block, 0 when every element is +-0 (any finite block).
template <typename T>
__device__ __forceinline__ uint32_t raw_min_nonzero_abs_bits(const BlockRaw<T>& raw) {
  if constexpr (std::is_same_v<T, float>) {
    uint32_t min_m1 = 0xFFFFFFFFu;  // m - 1 on the bits maps +-0 to 0xFFFFFFFF
#pragma unroll
    for (int v = 0; v < BlockRaw<T>::kVecs; ++v) {
      const uint32_t w[4] = {raw.v[v].x, raw.v[v].y, raw.v[v].z, raw.v[v].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) min_m1 = min(min_m1, (w[i] & 0x7FFFFFFFu) - 1u);
    }
    return min_m1 + 1u;
  } else {
    uint32_t m = 0x7FFF7FFFu;  // the biased value of +0, twice
#pragma unroll
    for (int v = 0; v < BlockRaw<T>::kVecs; ++v) {
      const uint32_t w[4] = {raw.v[v].x, raw.v[v].y, raw.v[v].z, raw.v[v].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) m = min_s16x2(m, (w[i] & 0x7FFF7FFFu) + 0x7FFF7FFFu);
    }
    m = min_s16x2(m, m >> 16);  // low half: the block's minimum (h - 1 - 2^15, or 2^15 - 1 for all zeros)
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      return (m << 16) + 0x80010000u;  // (h - 1 - 2^15 + 2^15 + 1) << 16 = h << 16; all zeros: 2^32 = 0
    } else {
      return __float_as_uint(__half2float(__ushort_as_half((unsigned short)((m + 0x8001u) & 0xFFFFu))));
    }
  }
}

// sign_bytes8 of the eight 16-bit values in raw words w[0..3] (value 2i in the low half of w[i], 2i + 1 in the high
// half): four byte permutes instead of six (selector 0xFDB9 replicates the sign bits 15 and 31 of both words).
__device__ __forceinline__ SignBytes8 sign_bytes8_raw16(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
  const uint32_t s03 = prmt_b32(w0, w1, 0xFDB9u), s47 = prmt_b32(w2, w3, 0xFDB9u);  // bytes: signs 0 1 2 3 / 4 5 6 7
  return SignBytes8{prmt_b32(s03, s47, 0x6420u), prmt_b32(s03, s47, 0x7531u)};
}

// Codes of one finite guided block (quantize_block<MODE, 16, kImplLean>'s results): the fast path when t, 1/t and the
// quotients are far from under/overflow and no nonzero quotient is tiny (judged from the block's amax and smallest
// nonzero |x| bits, 0 = none), else quantize_elems' __fdiv_rn path.
template <int MODE, typename T>
__device__ __forceinline__ void quantize_guided_block_rz(const BlockRaw<T>& raw, const float (&x)[kNvfp4Block],
                                                         uint32_t max_bits,
                                                         uint32_t min_bits, float t, const QuantParams& p,
                                                         uint32_t guide_bits, uint2 guide_codes, uint32_t (&w)[2]) {
  if (!(t > 0.0f)) {  // t == 0, or NaN (g underflowed to 0 and the block is all zero: s_b = e4m3(0 / 0)); codes 0
    w[0] = w[1] = 0u;
    return;
  }
  const float r = __frcp_rn(t);
  const float m = __uint_as_float(min_bits);
  const bool fast = t >= 0x1p-100f && t <= 0x1p100f && __fmul_rn(__uint_as_float(max_bits), r) <= 0x1p100f &&
                    (min_bits == 0u || (m >= 0x1p-100f && __fmul_rn(m, r) >= 0x1p-99f));
  if (!fast) {
    quantize_elems<MODE, false, kNvfp4Block, kImplLean>(x, t, r, 0u, p, guide_bits, guide_codes, w);
    return;
  }
  const float t14 = __fmul_rn(t, 16384.0f), r14 = __fmul_rn(r, 0x1p-14f);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    // compact: a = min(u, 6 * 2^-14); full: a = u, saturated after the floor (e2m1_guided_lo8_rz_x2m14<true>)
    constexpr bool kSatAfter = MODE == kGuidedFull;
    float a[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      a[i] = div_rn_with_rcp(fabsf(x[8 * k + i]), t14, r14);
      if constexpr (!kSatAfter) a[i] = fminf(a[i], kE2M1Max * 0x1p-14f);
    }
    const uint4 v = raw.v[k];  // 16-bit x: elements 8k .. 8k + 7; t > 0, so v's signs are x's (-0.0 included)
    const GuidedLo8 g = e2m1_guided_lo8_rz_x2m14<kSatAfter>(a, sign_bytes8_raw16(v.x, v.y, v.z, v.w));
    if constexpr (MODE == kGuidedCompact) {
      w[k] = e2m1_guided_compact_pack8(g.lo, g.off, bits_to_nibble_lsbs_mul((guide_bits >> (8 * k)) & 0xFFu));
    } else {
      w[k] = e2m1_guided_full_pack8(g.lo, g.off, k == 0 ? guide_codes.x : guide_codes.y);
    }
  }
}

template <typename T, int MODE>
__global__ void __launch_bounds__(kFlatThreads, 4)
    nvfp4_quant_guided_lean_kernel(const QuantParams p, const LeanWalk w) {
  static_assert(MODE == kGuidedCompact || MODE == kGuidedFull, "guided rounding only");
  static_assert(sizeof(T) == 2, "16-bit x only: the element signs are read off the raw halves (sign_bytes8_raw16)");
  const uint32_t lane = threadIdx.x % 32;
  uint32_t fb0 = (blockIdx.x * (uint32_t)kFlatThreads + threadIdx.x) / 32 * kWarpBlocks + lane;
  uint32_t row0 = fb0 / w.kb;
  uint32_t kbi0 = fb0 - row0 * w.kb;
  const T* xp = reinterpret_cast<const T*>(p.x);
  for (; fb0 < w.total_blocks; fb0 += w.stride_blocks) {
    BlockRaw<T> raw[kBlocksPerLane];
#pragma unroll
    for (int q = 0; q < kBlocksPerLane; ++q) raw[q] = load_block<T>(xp, fb0 + 32 * q, fb0 + 32 * q < w.total_blocks);
    uint32_t gbits[kBlocksPerLane];
    uint2 gcodes[kBlocksPerLane];
    uint8_t gscale[kBlocksPerLane];
#pragma unroll
    for (int q = 0; q < kBlocksPerLane; ++q) {
      const uint32_t fb = fb0 + 32 * q;
      gbits[q] = 0u;
      gcodes[q] = make_uint2(0u, 0u);
      gscale[q] = 0;
      if (fb < w.total_blocks) {
        if constexpr (MODE == kGuidedCompact) {
          gbits[q] = __ldg(reinterpret_cast<const uint16_t*>(p.guide_payload) + fb);
        } else {
          gcodes[q] = __ldg(reinterpret_cast<const uint2*>(p.guide_payload) + fb);
        }
        gscale[q] = __ldg(p.guide_scales + fb);
      }
    }
    float g[kBlocksPerLane];
    uint32_t row = row0, kbi = kbi0;
#pragma unroll
    for (int q = 0; q < kBlocksPerLane; ++q) {
      g[q] = fb0 + 32 * q < w.total_blocks ? __ldg(p.guide_g + row) : 0.0f;
      kbi += 32;  // block q + 1 is 32 further (one carry step when kb >= 32)
      while (kbi >= w.kb) {
        kbi -= w.kb;
        ++row;
      }
    }
#pragma unroll
    for (int q = 0; q < kBlocksPerLane; ++q) {
      const uint32_t fb = fb0 + 32 * q;
      if (fb < w.total_blocks) {
        float x[kNvfp4Block];
        const uint32_t mb = unpack_block<T>(raw[q], x);
        uint8_t s = gscale[q];
        const float t = nvfp4_block_divisor(s, g[q]);
        uint32_t codes[2] = {0u, 0u};
        if (mb < 0x7F800000u && isfinite(t)) {  // a rollout NaN scale makes the block NaN
          quantize_guided_block_rz<MODE, T>(raw[q], x, mb, raw_min_nonzero_abs_bits<T>(raw[q]), t, p, gbits[q],
                                            gcodes[q], codes);
        } else {
          s = kE4M3NaN;
        }
        reinterpret_cast<uint2*>(p.codes)[fb] = make_uint2(codes[0], codes[1]);
        if (p.mbits != nullptr) {
          reinterpret_cast<uint16_t*>(p.mbits)[fb] = (uint16_t)(nibble_lsbs(codes[0]) | (nibble_lsbs(codes[1]) << 8));
        }
        p.scales[fb] = s;
      }
    }
    row0 += w.step_rows;
    kbi0 += w.step_kbi;
    if (kbi0 >= w.kb) {
      kbi0 -= w.kb;
      ++row0;
    }
  }
  // g_out[r]: the rollout's g, copied once per row.
  if (p.g_out != nullptr) {
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int64_t r = tid; r < p.rows; r += (int64_t)gridDim.x * blockDim.x) p.g_out[r] = __ldg(p.guide_g + r);
  }
}

// ---- fused kernel: per-row g computed in the same launch (rows up to kFusedMaxK) ------------------------------
// A team (power of two, kMinTeam..512 threads) per row: lane l of the team owns the blocks l + team q
// (q < kRowBlocksPerLane) of its row and loads them with its own 16-byte vectors (contiguous across the team). The
// raw vectors stay packed in registers until their block is quantized (half the registers of floats for 16-bit x).

template <typename T, int MODE, bool FAKE, int IMPL>
__global__ void __launch_bounds__(kMaxTeam) nvfp4_quant_rowg_kernel(const QuantParams p, int team) {
  static_assert(MODE == kRTN || MODE == kSR, "guided rounding never recomputes g");
  __shared__ uint32_t warp_max[kMaxTeam / 32];
  const int rows_per_cta = blockDim.x / team;
  const int lane_in_team = threadIdx.x % team;
  const int64_t row = (int64_t)blockIdx.x * rows_per_cta + threadIdx.x / team;
  const bool row_ok = row < p.rows;
  const uint64_t fb_row = (uint64_t)(row_ok ? row : 0) * (uint64_t)p.kb;
  const T* xp = reinterpret_cast<const T*>(p.x);

  BlockRaw<T> raw[kRowBlocksPerLane];
#pragma unroll
  for (int q = 0; q < kRowBlocksPerLane; ++q) {
    const int64_t kbi = lane_in_team + (int64_t)team * q;
    raw[q] = load_block<T>(xp, fb_row + kbi, row_ok && kbi < p.kb);
  }
  uint32_t mb[kRowBlocksPerLane];
  uint32_t finite_max = 0;
#pragma unroll
  for (int q = 0; q < kRowBlocksPerLane; ++q) {
    mb[q] = block_max_abs_bits<T>(raw[q]);  // absent blocks are zeros
    fold_block_finite_max<T>(finite_max, mb[q], raw[q]);
  }
  // Row reduction of the finite amax: shuffles within a warp (or a sub-warp team), then across the team's warps.
  const int width = team < 32 ? team : 32;
  if (IMPL == kImplLean && team >= 32) {
    finite_max = __reduce_max_sync(0xFFFFFFFFu, finite_max);  // lean: one redux.sync instead of 5 shuffles + maxes
  } else {
    for (int off = width / 2; off > 0; off /= 2) {
      finite_max = max(finite_max, __shfl_xor_sync(0xFFFFFFFFu, finite_max, off, width));
    }
  }
  if (team > 32) {
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) warp_max[warp] = finite_max;
    __syncthreads();
    const int first = (threadIdx.x / team) * (team / 32);
    finite_max = 0;
    for (int w = 0; w < team / 32; ++w) finite_max = max(finite_max, warp_max[first + w]);
  }
  const float g = nvfp4_global_scale(__uint_as_float(finite_max));
  const float rg = rcp_g_in_range(g);
  if (row_ok && lane_in_team == 0 && p.g_out != nullptr) p.g_out[row] = g;

#pragma unroll
  for (int q = 0; q < kRowBlocksPerLane; ++q) {
    const int64_t kbi = lane_in_team + (int64_t)team * q;
    if (row_ok && kbi < p.kb) {
      float x[kNvfp4Block];
      unpack_block<T>(raw[q], x);
      process_block<T, MODE, FAKE, IMPL>(p, x, mb[q], g, rg, fb_row + kbi, row, kbi, 0u, make_uint2(0u, 0u));
    }
  }
  if (p.swizzle && p.scales != nullptr) {
    swizzle_pad_zero(p, (int64_t)blockIdx.x * blockDim.x + threadIdx.x, (int64_t)gridDim.x * blockDim.x);
  }
}

// ---- lean per-row-g kernel (default, two blocks per lane; TRACE_EXT_QUANT_IMPL=rowg-lean: one) ----------------
// RTN quantize (not fake) with g None and rows of up to kRowLeanThreads * 2 blocks (bf16 / fp16: K <= 8192) or
// kRowLeanThreads blocks (fp32: K <= 4096); linear or swizzled scales, mbits (capture) optional. Differences from
// nvfp4_quant_rowg_kernel: CTAs of kRowLeanThreads threads (4 per SM, <= 64 registers) walk row groups with a grid
// stride (persistent until round 52, now at most kLeanItersMax groups each: rowg_lean_plan), and each thread issues the
// loads of its next row before it reduces and quantizes the current one (two rows in flight per team: the load latency
// the profile showed at the first use of x and at the amax reduction overlaps the previous row's work); lane l of a
// team of 2^team_shift threads owns blocks l + team q (q < BPL) of its row; all indices 32-bit (host-checked), the
// swizzled offset split into a per-row and a per-block part (no 64-bit divisions); the cross-warp amax in
// double-buffered shared memory (one __syncthreads per row group); codes, scales and g_out always exist (no pointer
// tests). Elements: quantize_block<kRTN, ..., kImplLean>, the default's element code, so the results are the default's
// bit for bit.
constexpr int kRowLeanThreads = 256;  // CTA of the lean per-row kernel (4 resident per SM at <= 64 registers)
constexpr int kRowLeanCtasPerSm = 4;
constexpr int kRowLeanSrCtasPerSm = 3;  // SR: > 64 registers without spills (4 CTAs at 64 spilled: 0.93-0.95x)
static_assert(kRowLeanThreads % 32 == 0 && kRowLeanThreads <= kMaxTeam, "lean per-row CTA: whole warps, <= kMaxTeam");

struct RowLeanWalk {
  uint32_t rows;          // R; rows + row_stride < 2^31 (host-checked)
  uint32_t kb;            // blocks per row; rows * kb < 2^31 (host-checked)
  uint32_t team_shift;    // log2 of the threads per row
  uint32_t rows_per_cta;  // kRowLeanThreads >> team_shift
  uint32_t row_stride;    // rows between a thread's consecutive rows: gridDim.x * rows_per_cta
  uint32_t tile_bytes;    // swizzled scales: bytes of one 128-row tile (kb_pad / 4 * 512); rows_pad * kb_pad < 2^31
};

// Blocks l + team q (q < BPL) of row `row` (zeros for blocks past the row, or a row >= rows).
template <typename T, int BPL>
__device__ __forceinline__ void load_row_blocks(const T* xp, const RowLeanWalk& w, uint32_t row, uint32_t lane_in_team,
                                                BlockRaw<T> (&raw)[BPL]) {
  const bool row_ok = row < w.rows;
#pragma unroll
  for (int q = 0; q < BPL; ++q) {
    const uint32_t kbi = lane_in_team + ((uint32_t)q << w.team_shift);
    raw[q] = load_block<T>(xp, row_ok ? row * w.kb + kbi : 0u, row_ok && kbi < w.kb);
  }
}

template <typename T, int BPL, bool SWIZZLE, int MODE = kRTN>
__global__ void __launch_bounds__(kRowLeanThreads, MODE == kRTN ? kRowLeanCtasPerSm : kRowLeanSrCtasPerSm)
    nvfp4_quant_rowg_lean_kernel(const QuantParams p, const RowLeanWalk w) {
  static_assert(MODE == kRTN || MODE == kSR, "guided rounding never recomputes g");
  __shared__ uint32_t warp_max[2][kRowLeanThreads / 32];
  const uint32_t team = 1u << w.team_shift;
  const uint32_t lane_in_team = threadIdx.x & (team - 1u);
  const uint32_t first_warp = (threadIdx.x >> w.team_shift) * (team / 32u);  // team > 32: the team's first warp
  const T* xp = reinterpret_cast<const T*>(p.x);
  uint32_t base = blockIdx.x * w.rows_per_cta;  // the CTA's row group (uniform: every thread runs every iteration)
  uint32_t row = base + (threadIdx.x >> w.team_shift);
  uint32_t parity = 0u;
  // One row group: loads of the thread's next row into nxt (in flight during this row's work), then cur's row.
  // With one block per lane the loop below alternates the two buffers (no register copies between iterations).
  auto step = [&](BlockRaw<T>(&cur)[BPL], BlockRaw<T>(&nxt)[BPL]) {
    load_row_blocks<T, BPL>(xp, w, row + w.row_stride, lane_in_team, nxt);
    uint32_t mb[BPL];
    uint32_t finite_max = 0u;
#pragma unroll
    for (int q = 0; q < BPL; ++q) {
      mb[q] = block_max_abs_bits<T>(cur[q]);  // absent blocks are zeros
      if (mb[q] < 0x7F800000u) {  // fold_block_finite_max's body, inline: the call changed this kernel's SASS
        finite_max = max(finite_max, mb[q]);
      } else {
        float x[kNvfp4Block];
        unpack_block<T>(cur[q], x);
        finite_max = max(finite_max, max_abs_bits_finite(x));
      }
    }
    if (team >= 32u) {
      finite_max = __reduce_max_sync(0xFFFFFFFFu, finite_max);
      if (team > 32u) {
        if (threadIdx.x % 32 == 0) warp_max[parity][threadIdx.x / 32] = finite_max;
        __syncthreads();  // the other buffer is rewritten only after the next iteration's barrier: no second barrier
#pragma unroll
        for (uint32_t k = 0; k < kRowLeanThreads / 32; ++k) {  // predicated: no runtime-trip-count loop
          if (k < team / 32u) finite_max = max(finite_max, warp_max[parity][first_warp + k]);
        }
        parity ^= 1u;
      }
    } else {
      for (uint32_t off = team / 2u; off > 0u; off /= 2u) {
        finite_max = max(finite_max, __shfl_xor_sync(0xFFFFFFFFu, finite_max, off, team));
      }
    }
    const float g = nvfp4_global_scale_rcp(__uint_as_float(finite_max));
    const float rg = rcp_g_in_range(g);
    if (row < w.rows) {
      if (lane_in_team == 0u) p.g_out[row] = g;
      uint32_t swz_row = 0u;
      if constexpr (SWIZZLE) swz_row = (row >> 7) * w.tile_bytes + (row & 31u) * 16u + ((row >> 5) & 3u) * 4u;
#pragma unroll
      for (int q = 0; q < BPL; ++q) {
        const uint32_t kbi = lane_in_team + ((uint32_t)q << w.team_shift);
        if (kbi < w.kb) {
          const uint32_t fb = row * w.kb + kbi;
          float x[kNvfp4Block];
          unpack_block<T>(cur[q], x);
          const bool finite = mb[q] < 0x7F800000u;
          uint8_t s = nvfp4_scale_byte_rcp(mb[q], g, rg);
          const float t = nvfp4_block_divisor(s, g);
          uint32_t codes[2] = {0u, 0u};
          if (finite) {
            if constexpr (MODE == kRTN) {
              quantize_block<kRTN, kNvfp4Block, kImplLean>(x, mb[q], t, 0u, p, 0u, make_uint2(0u, 0u), codes);
            } else {  // SR: Philox counter of the block's element 0 = flat element index / 4 (SPEC 4)
              quantize_block<kSR, kNvfp4Block, kImplSrLean>(x, mb[q], t, (uint64_t)fb * 4u, p, 0u,
                                                            make_uint2(0u, 0u), codes);
            }
          } else {
            s = kE4M3NaN;
          }
          reinterpret_cast<uint2*>(p.codes)[fb] = make_uint2(codes[0], codes[1]);
          if (p.mbits != nullptr) {
            reinterpret_cast<uint16_t*>(p.mbits)[fb] =
                (uint16_t)(nibble_lsbs(codes[0]) | (nibble_lsbs(codes[1]) << 8));
          }
          if constexpr (SWIZZLE) {
            p.scales[swz_row + (kbi >> 2) * 512u + (kbi & 3u)] = s;
          } else {
            p.scales[fb] = s;
          }
        }
      }
    }
    base += w.row_stride;
    row += w.row_stride;
  };
  BlockRaw<T> buf0[BPL], buf1[BPL];
  load_row_blocks<T, BPL>(xp, w, row, lane_in_team, buf0);
  if constexpr (BPL == 1) {
    while (base < w.rows) {
      step(buf0, buf1);
      if (base >= w.rows) break;
      step(buf1, buf0);
    }
  } else {  // two blocks per lane: the alternating form spills at 64 registers (swizzle); copy nxt to cur instead
    while (base < w.rows) {
      step(buf0, buf1);
#pragma unroll
      for (int q = 0; q < BPL; ++q) buf0[q] = buf1[q];
    }
  }
  if constexpr (SWIZZLE) {
    swizzle_pad_zero(p, (int64_t)blockIdx.x * blockDim.x + threadIdx.x, (int64_t)gridDim.x * blockDim.x);
  }
}

// ---- lean per-row-g kernel with less per-row work (TRACE_EXT_QUANT_IMPL=rowg-lean3) ------------------------------
// nvfp4_quant_rowg_lean_kernel's walk, grid, loads in flight and element code (RTN quantize with g None, linear or
// swizzled scales, capture optional; the same launch shapes), with the per-row work its SASS showed cut down (every
// output is the default's bit for bit):
// - two row steps per loop iteration with the two buffers swapped: no copy of the next row's 16 registers per row,
//   the shared-memory parity a constant;
// - the team's constants (mask, warps, lanes that have a last block, the swizzled offset of team blocks) precomputed
//   by the host (RowLean3Walk): what ptxas rederives per use at 64 registers (lane, "the lane's last block exists",
//   the shared-memory slots) costs one or two instructions with constant-bank operands, not a chain per block;
//   blocks q < BPL - 1 always exist (the host takes the smallest team with team * BPL >= kb);
// - the next row's loads from row min(row, R - 1): a team whose row is past R quantizes nothing, so what it loads is
//   never used (no zero fill, no row test); the last block's load predicated, its amax masked;
// - the cross-warp amax by a store from every lane (no lane test), one shared-memory read per thread (lane l reads its
//   team's slot l % warps per team) and a second redux.sync, instead of warps-per-team predicated reads and maxes;
//   teams within one warp by xor shuffles, 32 included (K = 1024 for 16-bit x; its redux.sync spilled on sm_100a);
// - one non-finite test for the thread's blocks together (the per-block finite-max fallback behind it);
// - capture (mbits) a template parameter: no per-block pointer test.
// - 1/g and each block's 1/t by frcp_rn_mid where g lies in [2^-50, 2^50] and t in [2^-100, 2^100], the ranges where
//   rcp_g_in_range and quantize_block take the reciprocal (__frcp_rn's bits without its range test: equal for every
//   significand at exponents 0, +-50, +-99, both signs, H200 probe tools/probes/rcp_sequence.cu, round 46; with
//   __frcp_rn instead the kernel ran 0.93-0.95x, round 46 against round 45).
// 16-bit x only (launch_quant): the fp32 instantiation has not been timed. Its one disagreement with the reference in
// round 45 (fp32 257 x 64) was a pre-existing edge of every quantize kernel: a row with amax < 2688 * 2^-149 has g = 0,
// an all-zero block of it s_b = e4m3(0 / 0) = NaN and t = NaN, which gave codes 7 where the reference gives 0; the
// three block quantizers now treat t NaN as t == 0 (round 47).

// quantize_block<kRTN, 16, kImplLean>: the same fast-path test (t in [2^-100, 2^100], amax / t far from overflow)
// and element code with 1/t by frcp_rn_mid, else its zeros (t == 0 or NaN) or its division path.
__device__ __forceinline__ void quantize_block_rtn_mid(const float (&x)[kNvfp4Block], uint32_t max_bits, float t,
                                                       const QuantParams& p, uint32_t (&w)[kNvfp4Block / 8]) {
  if (t >= 0x1p-100f && t <= 0x1p100f) {
    const float r = frcp_rn_mid(t);
    if (__fmul_rn(__uint_as_float(max_bits), r) <= 0x1p100f) {
      quantize_elems<kRTN, true, kNvfp4Block, kImplLean>(x, t, r, 0u, p, 0u, make_uint2(0u, 0u), w);
      return;
    }
  }
  if (!(t > 0.0f)) {  // t == 0, or NaN (g underflowed to 0 and the block is all zero: s_b = e4m3(0 / 0)); codes 0
    w[0] = w[1] = 0u;
  } else {  // quantize_block's division path (its reciprocal is not used there)
    quantize_elems<kRTN, false, kNvfp4Block, kImplLean>(x, t, 0.0f, 0u, p, 0u, make_uint2(0u, 0u), w);
  }
}

// The walk of nvfp4_quant_rowg_lean3_kernel: RowLeanWalk's, with the team constants the kernel would otherwise
// rederive per row (ptxas rematerializes them at 64 registers) precomputed.
struct RowLean3Walk {
  uint32_t rows;          // R; rows + row_stride < 2^31 (host-checked)
  uint32_t last_row;      // R - 1: the row the loads of rows past R read
  uint32_t kb;            // blocks per row; (rows + row_stride) * kb < 2^31 (host-checked)
  uint32_t team_shift;    // log2 of the threads per row
  uint32_t team;          // 1 << team_shift
  uint32_t team_mask;     // team - 1
  uint32_t team_warps;    // team / 32 (0 for teams within one warp)
  uint32_t slot_mask;     // team_warps - 1 (teams of several warps)
  uint32_t last_lanes;    // lanes whose last block exists: kb - (BPL - 1) * team
  uint32_t rows_per_cta;  // kRowLeanThreads >> team_shift
  uint32_t row_stride;    // rows between a thread's consecutive rows: gridDim.x * rows_per_cta
  uint32_t tile_bytes;    // swizzled scales: bytes of one 128-row tile (kb_pad / 4 * 512); rows_pad * kb_pad < 2^31
  uint32_t swz_team;      // swizzled offset of block kbi + team minus that of kbi (team >= 4: team * 128, else team)
};

// threadIdx.x read where it is used: values derived from it are recomputed in the loop instead of being hoisted out
// of it and kept live (at 64 registers ptxas then spills them).
__device__ __forceinline__ uint32_t tid_in_loop() {
  uint32_t t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

// FAKE (the default for RTN fake quantization with g None): fake quantization instead (y = the dequantized codes in
// x's dtype, as process_block's FAKE path; no codes); CAPTURE then means emit_guidance (mbits, linear scales and
// g_out), and without it only y is written.
// GIVEN (the default for g given since H200 rounds 58-59 where given_lean3 says so): RTN with g given (p.g, per row or
// one for all rows through p.g_stride) instead of g from the row's amax: the same walk, loads and element code without
// the team's amax reduction (no shared memory, no barrier); the next row's g is loaded with its x.
// MODE kGuidedCompact / kGuidedFull (GIVEN, linear scales; guided_lean3: the default for compact quantize of bf16 x):
// guided quantize, the rollout's g, scale bytes and bits / codes loaded with the next row's x, the blocks quantized by
// nvfp4_quant_guided_lean_kernel's block code (quantize_guided_block_rz). With FAKE (fake_guided_lean3: the default
// since round 65): the trainer's guided fake quantization, y and with CAPTURE the emitted record.
template <int BPL>
struct RowSide {  // a row's inputs besides x, loaded with it: GIVEN: g; guided: the rollout's guidance of its blocks
  float g;
  uint32_t bits[BPL];   // compact: the rollout's mantissa bits of the block
  uint2 codes[BPL];     // full: the rollout's codes of the block
  uint32_t scale[BPL];  // the rollout's scale byte
};

// TEAM_BAR (team_bar_selected: the default for fake quantization since H200 round 60): the cross-warp amax waits on a
// named barrier of the row's team (bar.sync 1 + team, team threads) instead of the CTA's __syncthreads: the 2 / 4 teams
// of a CTA at K 4096 / 2048 no longer wait for each other.
template <typename T, int BPL, bool SWIZZLE, bool CAPTURE, bool FAKE = false, bool GIVEN = false, int MODE = kRTN,
          bool TEAM_BAR = false>
__global__ void __launch_bounds__(kRowLeanThreads, kRowLeanCtasPerSm)
    nvfp4_quant_rowg_lean3_kernel(const QuantParams p, const RowLean3Walk w) {
  constexpr bool kGuided = MODE == kGuidedCompact || MODE == kGuidedFull;
  static_assert(BPL == 1 || BPL == 2, "one or two blocks per lane");
  static_assert(!(FAKE && SWIZZLE), "fake quantization emits linear scales");
  static_assert(MODE == kRTN || (kGuided && GIVEN && !SWIZZLE), "guided: the rollout's g, linear outputs");
  constexpr bool kScalesOut = !FAKE || CAPTURE;  // scale bytes and g_out exist
  __shared__ uint32_t warp_max[2][kRowLeanThreads / 32];
  const uint32_t lane = threadIdx.x & w.team_mask;
  const bool has_last = lane < w.last_lanes;  // blocks q < BPL - 1 always exist (the host's team: team * BPL >= kb)
  const T* xp = reinterpret_cast<const T*>(p.x);
  uint32_t base = blockIdx.x * w.rows_per_cta;  // the CTA's row group (uniform: every thread runs every iteration)
  uint32_t row = base + (threadIdx.x >> w.team_shift);
  auto load = [&](uint32_t r, BlockRaw<T>(&buf)[BPL]) {
    const uint32_t i0 = min(r, w.last_row) * w.kb + lane;
#pragma unroll
    for (int q = 0; q < BPL - 1; ++q) buf[q] = load_block<T>(xp, i0 + q * w.team, true);
    if (has_last) buf[BPL - 1] = load_block<T>(xp, i0 + (BPL - 1) * w.team, true);
  };
  // g of the thread's row from its team's finite amax (SPEC 2): the blocks' max |x| bits mb, reduced over the team
  auto row_g = [&](auto parity, const BlockRaw<T>(&cur)[BPL], const uint32_t (&mb)[BPL]) {
    constexpr int kPar = decltype(parity)::value;
    uint32_t finite_max = mb[0];
#pragma unroll
    for (int q = 1; q < BPL; ++q) finite_max = max(finite_max, mb[q]);
    if (finite_max >= 0x7F800000u) {  // a NaN / Inf: the finite max block by block
      finite_max = 0u;
#pragma unroll
      for (int q = 0; q < BPL; ++q) {
        fold_block_finite_max<T>(finite_max, mb[q], cur[q]);
      }
    }
    if (w.team_warps > 1u) {  // the common case first: one compare on the way
      finite_max = __reduce_max_sync(0xFFFFFFFFu, finite_max);
      const uint32_t tid = tid_in_loop();
      warp_max[kPar][tid / 32] = finite_max;  // every lane stores the warp's max (no lane test)
      if constexpr (TEAM_BAR) {  // the team's warps only (their slots are the only ones the team reads)
        asm volatile("bar.sync %0, %1;" ::"r"(1u + (tid >> w.team_shift)), "r"(w.team) : "memory");
      } else {
        __syncthreads();  // the other half is rewritten only after the next step's barrier: no second barrier
      }
      // lane l reads its team's slot first_warp + l % team_warps (first_warp: the warp index with the low bits
      // cleared; every slot of the team is read by some lane)
      finite_max = __reduce_max_sync(0xFFFFFFFFu, warp_max[kPar][((tid / 32) & ~w.slot_mask) | (tid & w.slot_mask)]);
    } else {  // a team within one warp (up to 32 threads: K <= 1024 for 16-bit x)
      for (uint32_t off = w.team / 2u; off > 0u; off /= 2u) {
        finite_max = max(finite_max, __shfl_xor_sync(0xFFFFFFFFu, finite_max, off, w.team));
      }
    }
    return nvfp4_global_scale_rcp(__uint_as_float(finite_max));
  };
  // The side inputs of row r (rows past R read row R - 1's, as the loads of x do): GIVEN: its g; guided: the
  // rollout's g and its guidance of the thread's blocks
  auto load_side = [&](uint32_t r, RowSide<BPL>& sd) {
    const uint32_t rc = min(r, w.last_row);
    if constexpr (kGuided) {
      sd.g = __ldg(p.guide_g + rc);
      const uint32_t i0 = rc * w.kb + lane;
#pragma unroll
      for (int q = 0; q < BPL; ++q) {
        if (q < BPL - 1 || has_last) {
          const uint32_t fb = i0 + q * w.team;
          if constexpr (MODE == kGuidedCompact) {
            sd.bits[q] = __ldg(reinterpret_cast<const uint16_t*>(p.guide_payload) + fb);
          } else {
            sd.codes[q] = __ldg(reinterpret_cast<const uint2*>(p.guide_payload) + fb);
          }
          sd.scale[q] = __ldg(p.guide_scales + fb);
        }
      }
    } else if constexpr (GIVEN) {
      sd.g = __ldg(p.g + rc * p.g_stride);
    }
  };
  // One row group with the shared-memory half `parity`: the thread's next row (and its side inputs) loaded into nxt
  // and side_nxt (in flight during this row's work), cur's row reduced and quantized.
  auto step = [&](auto parity, BlockRaw<T>(&cur)[BPL], BlockRaw<T>(&nxt)[BPL], const RowSide<BPL>& side,
                  RowSide<BPL>& side_nxt) {
    load(row + w.row_stride, nxt);
    load_side(row + w.row_stride, side_nxt);
    uint32_t mb[BPL];
#pragma unroll
    for (int q = 0; q < BPL; ++q) mb[q] = block_max_abs_bits<T>(cur[q]);
    if (!has_last) mb[BPL - 1] = 0u;
    float g;
    if constexpr (GIVEN) {
      g = side.g;
    } else {
      g = row_g(parity, cur, mb);
    }
    const float rg = g >= 0x1p-50f && g <= 0x1p50f ? frcp_rn_mid(g) : 0.0f;  // rcp_g_in_range(g)
    if (row < w.rows) {
      if (kScalesOut && lane == 0u) p.g_out[row] = g;
      const uint32_t fb0 = row * w.kb + lane;
#pragma unroll
      for (int q = 0; q < BPL; ++q) {
        if (q < BPL - 1 || has_last) {
          const uint32_t fb = fb0 + q * w.team;
          float x[kNvfp4Block];
          unpack_block<T>(cur[q], x);
          uint32_t codes[2] = {0u, 0u};
          uint8_t s;
          if constexpr (kGuided) {
            s = (uint8_t)side.scale[q];
            const float t = nvfp4_block_divisor(s, g);
            if (mb[q] < 0x7F800000u && isfinite(t)) {  // a rollout NaN scale makes the block NaN
              quantize_guided_block_rz<MODE, T>(cur[q], x, mb[q], raw_min_nonzero_abs_bits<T>(cur[q]), t, p,
                                                side.bits[q], side.codes[q], codes);
            } else {
              s = kE4M3NaN;
            }
          } else {
            s = nvfp4_scale_byte_rcp(mb[q], g, rg);
            const float t = nvfp4_block_divisor(s, g);
            if (mb[q] < 0x7F800000u) {
              quantize_block_rtn_mid(x, mb[q], t, p, codes);
            } else {
              s = kE4M3NaN;
            }
          }
          if constexpr (FAKE) {
            float y[kNvfp4Block];
            dequant_codes<kNvfp4Block>(codes, s, g, y);
            store_floats<T, kNvfp4Block>(reinterpret_cast<T*>(p.y) + uint64_t(fb) * kNvfp4Block, y);
          } else {
            reinterpret_cast<uint2*>(p.codes)[fb] = make_uint2(codes[0], codes[1]);
          }
          if constexpr (CAPTURE) {
            reinterpret_cast<uint16_t*>(p.mbits)[fb] =
                (uint16_t)(nibble_lsbs(codes[0]) | (nibble_lsbs(codes[1]) << 8));
          }
          if constexpr (SWIZZLE) {
            // the swizzled offset of block lane of the row, computed here (kept across the element code, it spilled)
            const uint32_t swz = (row >> 7) * w.tile_bytes + (row & 31u) * 16u + ((row >> 5) & 3u) * 4u +
                                 (lane >> 2) * 512u + (lane & 3u);
            p.scales[swz + q * w.swz_team] = s;
          } else if constexpr (kScalesOut) {
            p.scales[fb] = s;
          }
        }
      }
    }
    base += w.row_stride;
    row += w.row_stride;
  };
  BlockRaw<T> buf0[BPL], buf1[BPL];
  buf0[BPL - 1] = BlockRaw<T>{};  // a lane without a last block never loads it (its amax is masked)
  buf1[BPL - 1] = BlockRaw<T>{};
  RowSide<BPL> side0{}, side1{};  // (a lane without a last block never loads its guidance)
  load(row, buf0);
  load_side(row, side0);
  while (base < w.rows) {
    step(std::integral_constant<int, 0>{}, buf0, buf1, side0, side1);
    if (base >= w.rows) break;
    step(std::integral_constant<int, 1>{}, buf1, buf0, side1, side0);
  }
  if constexpr (SWIZZLE) {
    swizzle_pad_zero(p, (int64_t)blockIdx.x * blockDim.x + threadIdx.x, (int64_t)gridDim.x * blockDim.x);
  }
}

// ---- long rows, pass 1: per-row g from the finite amax -------------------------------------------------------

constexpr int kAmaxThreads = 512;

template <typename T>
__global__ void __launch_bounds__(kAmaxThreads) nvfp4_row_g_kernel(const void* x_, int64_t K, float* g_out) {
  __shared__ uint32_t warp_max[kAmaxThreads / 32];
  constexpr int kV = ElemTraits<T>::kPerVec;
  const T* x = reinterpret_cast<const T*>(x_) + (int64_t)blockIdx.x * K;
  uint32_t m = 0;
  for (int64_t i = (int64_t)threadIdx.x * kV; i < K; i += (int64_t)blockDim.x * kV) {
    float v[kV];
    vec_to_float<T>(ld_vec(x + i), v);
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      const uint32_t b = __float_as_uint(v[j]) & 0x7FFFFFFFu;
      if (b < 0x7F800000u) m = max(m, b);
    }
  }
  for (int off = 16; off > 0; off /= 2) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < (int)(blockDim.x / 32); ++w) m = max(m, warp_max[w]);
    g_out[blockIdx.x] = nvfp4_global_scale(__uint_as_float(m));
  }
}

// ---- dequantize ---------------------------------------------------------------------------------------------
// Same warp tiling as the flat quantize kernel: lane l of warp w dequantizes chunks w * kWarpChunks + l + 32 j
// (4 code bytes in, 8 values out: one 16-byte store of bf16 / fp16 per chunk, contiguous across the warp).

template <typename T>
__global__ void __launch_bounds__(kFlatThreads) nvfp4_dequant_kernel(const uint8_t* codes, const uint8_t* scales,
                                                                     const float* g, int64_t g_stride, int64_t rows,
                                                                     int64_t kb, T* y) {
  const uint64_t total_chunks = (uint64_t)rows * kb * 2;
  const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uint64_t c0 = (tid / 32) * kWarpChunks + tid % 32;
  uint32_t w[kChunksPerThread];
  uint8_t s[kChunksPerThread];
  float gv[kChunksPerThread];
  int64_t row = row_of(c0 >> 1, kb);
  int64_t kbi = (int64_t)(c0 >> 1) - row * kb;
#pragma unroll
  for (int j = 0; j < kChunksPerThread; ++j) {
    const uint64_t c = c0 + 32 * j;
    const bool ok = c < total_chunks;
    w[j] = ok ? __ldg(reinterpret_cast<const uint32_t*>(codes) + c) : 0u;
    s[j] = ok ? __ldg(scales + (c >> 1)) : (uint8_t)0;
    gv[j] = ok ? __ldg(g + row * g_stride) : 0.0f;
    kbi += 32 / 2;  // the next chunk's block is 16 further: carry into the row (one step when kb >= 16)
    while (kbi >= kb) {
      kbi -= kb;
      ++row;
    }
  }
#pragma unroll
  for (int j = 0; j < kChunksPerThread; ++j) {
    const uint64_t c = c0 + 32 * j;
    if (c < total_chunks) {
      const uint32_t wj[1] = {w[j]};
      float yv[kChunkElems];
      dequant_codes<kChunkElems>(wj, s[j], gv[j], yv);
      store_floats<T, kChunkElems>(y + c * kChunkElems, yv);
    }
  }
}

// ---- host side -----------------------------------------------------------------------------------------------

void check_float_x(const at::Tensor& x, int64_t block, const char* op) {
  check_cuda(x, "x");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
                   "trace_ext.", op, ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2, "trace_ext.", op, ": x must be 2-D [R, K], got shape ", x.sizes());
  TORCH_CHECK_VALUE(x.size(1) % block == 0, "trace_ext.", op, ": x must have shape [R, K] with K a multiple of ", block,
                    ", got ", x.sizes());
  check_contiguous(x, "x");
}


// Warps of the flat kernels: about kFlatTilesPerWarp tiles each, but never fewer warps than the GPU holds.
int64_t flat_warps(const QuantParams& p) {
  const int64_t n_tiles = div_up(p.rows * p.kb, kWarpBlocks);
  const int64_t resident_warps = int64_t(current_sm_count()) * 64;
  return std::max(div_up(n_tiles, kFlatTilesPerWarp), std::min(n_tiles, resident_warps));
}

// nvfp4_quant_lean_kernel where it applies (quantize with codes and linear scales, 32-bit block walk); false if not.
template <int MODE, typename T>
bool launch_lean(const QuantParams& p, cudaStream_t stream, const char* op) {
  if (p.swizzle || p.codes == nullptr || p.scales == nullptr || p.y != nullptr) return false;
  const int64_t total = p.rows * p.kb;
  const int64_t grid = std::max<int64_t>(1, div_up(flat_warps(p) * 32, kFlatThreads));
  const int64_t stride = grid * (kFlatThreads / 32) * kWarpBlocks;
  if (total + stride >= (int64_t(1) << 31)) return false;  // also keeps kbi + step_kbi < 2 kb < 2^32
  const LeanWalk w{(uint32_t)total, (uint32_t)stride, (uint32_t)p.kb, (uint32_t)(stride / p.kb),
                   (uint32_t)(stride % p.kb)};
  constexpr bool kGuided = MODE == kGuidedCompact || MODE == kGuidedFull;
  if (!kGuided && p.g_stride == 0) {
    auto kernel = nvfp4_quant_lean_kernel<T, MODE, !kGuided>;
    require_kernel_image(kernel, op);
    kernel<<<(unsigned)grid, kFlatThreads, 0, stream>>>(p, w);
  } else {
    auto kernel = nvfp4_quant_lean_kernel<T, MODE, false>;
    require_kernel_image(kernel, op);
    kernel<<<(unsigned)grid, kFlatThreads, 0, stream>>>(p, w);
  }
  check_launch(op);
  return true;
}

// nvfp4_quant_guided_lean_kernel where nvfp4_quant_lean_kernel would run (guided quantize with codes and linear
// scales, 32-bit block walk; the same grid); false if not.
template <int MODE, typename T>
bool launch_guided_lean(const QuantParams& p, cudaStream_t stream, const char* op) {
  if constexpr (std::is_same_v<T, float>) return false;  // fp32: the default's kernels (see the kernel's note)
  if (p.swizzle || p.codes == nullptr || p.scales == nullptr || p.y != nullptr) return false;
  const int64_t total = p.rows * p.kb;
  const int64_t grid = std::max<int64_t>(1, div_up(flat_warps(p) * 32, kFlatThreads));
  const int64_t stride = grid * (kFlatThreads / 32) * kWarpBlocks;
  if (total + stride >= (int64_t(1) << 31)) return false;  // also keeps kbi + step_kbi < 2 kb < 2^32
  const LeanWalk w{(uint32_t)total, (uint32_t)stride, (uint32_t)p.kb, (uint32_t)(stride / p.kb),
                   (uint32_t)(stride % p.kb)};
  if constexpr (!std::is_same_v<T, float>) {
    auto kernel = nvfp4_quant_guided_lean_kernel<T, MODE>;
    require_kernel_image(kernel, op);
    kernel<<<(unsigned)grid, kFlatThreads, 0, stream>>>(p, w);
    check_launch(op);
  }
  return true;
}

template <int MODE, bool FAKE, typename T, int IMPL>
void launch_flat(const QuantParams& p, cudaStream_t stream, const char* op) {
  if constexpr (IMPL == kImplLean && !FAKE && MODE != kSR) {  // SR: ptxas spills the lean kernel at 64 registers
    if (launch_lean<MODE, T>(p, stream, op)) return;
  }
  // lean elsewhere: RTN keeps its element code, SR / guided are kImplScaled (no duplicate kernels)
  constexpr int kImpl = IMPL == kImplLean && MODE != kRTN ? kImplScaled : IMPL;
  auto kernel = nvfp4_quant_flat_kernel<T, MODE, FAKE, kImpl>;
  require_kernel_image(kernel, op);
  const int64_t warps = flat_warps(p);
  const int64_t work_threads = warps * 32;
  int64_t pad_jobs = p.swizzle ? (p.kb_pad / 4) * 512 + (p.rows_pad / 128) * 512 : 0;
  int64_t threads = std::max<int64_t>(work_threads, std::min<int64_t>(pad_jobs, int64_t(1) << 20));
  kernel<<<(unsigned)std::max<int64_t>(1, div_up(threads, kFlatThreads)), kFlatThreads, 0, stream>>>(p);
  check_launch(op);
}

template <int MODE, bool FAKE, typename T, int IMPL>
void launch_rowg(const QuantParams& p, cudaStream_t stream, const char* op) {
  if (p.K > kFusedMaxK) {
    // Two-pass path for rows that do not fit on chip: per-row g first, then the flat kernel reads it.
    auto k1 = nvfp4_row_g_kernel<T>;
    require_kernel_image(k1, op);
    k1<<<(unsigned)p.rows, kAmaxThreads, 0, stream>>>(p.x, p.K, p.g_out);
    check_launch(op);
    QuantParams q = p;
    q.g = p.g_out;
    q.g_stride = 1;
    launch_flat<MODE, FAKE, T, IMPL>(q, stream, op);
    return;
  }
  constexpr int kImpl = IMPL == kImplLean && MODE != kRTN ? kImplScaled : IMPL;  // lean: RTN's element code only
  auto kernel = nvfp4_quant_rowg_kernel<T, MODE, FAKE, kImpl>;
  require_kernel_image(kernel, op);
  int team = kMinTeam;
  while ((int64_t)team * kRowBlocksPerLane < p.kb) team *= 2;
  const int cta = std::max(team, kFlatThreads);
  const int64_t rows_per_cta = cta / team;
  kernel<<<(unsigned)div_up(p.rows, rows_per_cta), cta, 0, stream>>>(p, team);
  check_launch(op);
}

// The grid of the lean per-row kernels for bpl blocks per lane: the team (2^shift threads, the smallest with
// 2^shift * bpl >= kb), rows per CTA, a balanced grid where every CTA walks iters or iters - 1 row groups, and its
// stride in rows; false where a 32-bit index could overflow. iters is at most kLeanItersMax: the grid is then several
// waves of the block scheduler rather than one persistent wave of ctas_per_sm CTAs per SM. H200 round 52
// (bench/results/lean_iters_ab_h200.md): with one wave the kernel waits for its slowest CTAs (a static split of the
// rows); at most 4 row groups per CTA ran per-row RTN 1.03x (2^26) / 1.06x (2^28), swizzled 1.06x / 1.06x, capture
// 1.03x / 1.06x at K 4096, 1.04-1.05x at K 7168 (2^26); 1 group per CTA (no next-row prefetch) 0.92-0.97x, 8 groups
// 1.00-1.06x.
struct RowLeanPlan {
  uint32_t shift;
  int64_t rows_per_cta, grid, row_stride;
};

constexpr int64_t kLeanItersMax = 4;

// TRACE_EXT_QUANT_LEAN_ITERS=n (read per call; an A/B knob): at most n row groups per CTA instead of kLeanItersMax;
// n = 0: no limit (one persistent wave, the grid before round 52).
int64_t lean_iters_cap() {
  const char* v = std::getenv("TRACE_EXT_QUANT_LEAN_ITERS");
  return v != nullptr ? std::max<int64_t>(std::atoll(v), 0) : kLeanItersMax;
}

// log2 of the row team of the lean per-row kernels: the smallest power of two of threads with team * bpl >= kb.
uint32_t lean_team_shift(int64_t kb, int bpl) {
  uint32_t shift = 0;
  while ((int64_t(1) << shift) * bpl < kb) ++shift;
  return shift;
}

bool rowg_lean_plan(const QuantParams& p, int bpl, int ctas_per_sm, RowLeanPlan& plan) {
  const uint32_t shift = lean_team_shift(p.kb, bpl);
  const int64_t rows_per_cta = kRowLeanThreads >> shift;
  const int64_t groups = div_up(p.rows, rows_per_cta);
  const int64_t one_wave_iters = div_up(groups, int64_t(current_sm_count()) * ctas_per_sm);
  const int64_t cap = lean_iters_cap();
  const auto fits = [&](int64_t row_stride) {  // 32-bit row and block indices of the walk, and swizzled offsets
    return p.rows + row_stride < (int64_t(1) << 31) && (p.rows + row_stride) * p.kb < (int64_t(1) << 31) &&
           !(p.swizzle && p.rows_pad * p.kb_pad >= (int64_t(1) << 31));
  };
  // the capped grid where its longer stride keeps 32-bit indices, else the one-wave grid
  for (const int64_t iters : {cap > 0 ? std::min(one_wave_iters, cap) : one_wave_iters, one_wave_iters}) {
    const int64_t grid = div_up(groups, iters);
    if (fits(grid * rows_per_cta)) {
      plan = RowLeanPlan{shift, rows_per_cta, grid, grid * rows_per_cta};
      return true;
    }
  }
  return false;
}

// nvfp4_quant_rowg_lean_kernel where it applies (TRACE_EXT_QUANT_IMPL=rowg-lean; RTN quantize with g None, rows of
// <= kRowLeanThreads * BPL blocks, 32-bit indices); false if not (the caller then runs the default's kernels).
// prefer_two (=rowg-lean2, 16-bit x): two blocks per lane for every kb >= 2 (half the team, half the per-row work per
// element, twice the bytes in flight per thread), else only where one block per lane would need more than 256 threads.
template <typename T, int MODE = kRTN>
bool launch_rowg_lean(const QuantParams& p, cudaStream_t stream, const char* op, bool prefer_two) {
  if (p.y != nullptr || p.codes == nullptr || p.scales == nullptr || p.g_out == nullptr) return false;
  constexpr int64_t kMaxBpl = sizeof(T) == 2 ? 2 : 1;  // fp32: two rows of 2 blocks in flight would exceed 64 registers
  if (p.kb > kRowLeanThreads * kMaxBpl) return false;
  const int bpl = p.kb > kRowLeanThreads || (prefer_two && kMaxBpl == 2 && p.kb >= 2) ? 2 : 1;
  RowLeanPlan plan;
  if (!rowg_lean_plan(p, bpl, MODE == kRTN ? kRowLeanCtasPerSm : kRowLeanSrCtasPerSm, plan)) return false;
  const RowLeanWalk w{(uint32_t)p.rows, (uint32_t)p.kb, plan.shift, (uint32_t)plan.rows_per_cta,
                      (uint32_t)plan.row_stride, (uint32_t)(p.kb_pad / 4 * 512)};
  auto go = [&](auto kernel) {
    require_kernel_image(kernel, op);
    kernel<<<(unsigned)plan.grid, kRowLeanThreads, 0, stream>>>(p, w);
    check_launch(op);
  };
  if (bpl == 1) {
    p.swizzle ? go(nvfp4_quant_rowg_lean_kernel<T, 1, true, MODE>)
              : go(nvfp4_quant_rowg_lean_kernel<T, 1, false, MODE>);
  } else if constexpr (kMaxBpl == 2) {
    p.swizzle ? go(nvfp4_quant_rowg_lean_kernel<T, 2, true, MODE>)
              : go(nvfp4_quant_rowg_lean_kernel<T, 2, false, MODE>);
  }
  return true;
}

// nvfp4_quant_rowg_lean3_kernel (the default; TRACE_EXT_QUANT_IMPL=sr-row takes nvfp4_quant_rowg_lean_kernel) for RTN
// quantize of 16-bit x with g None, 2 <= kb <= 512 (two blocks per lane); the same team, grid and walk. false if not
// (kb = 1 included: the caller then runs the previous kernels). fp32 x is not launched here (the kernel's one-block-
// per-lane form has not been timed).
// FAKE: RTN fake quantization with g None (the default), linear outputs; with emit_guidance (mbits, scales and g_out
// all present) or without (only y).
// GIVEN (given_lean3): RTN with g given (p.g) through the kernel's GIVEN instantiations instead.
// MODE guided (guided_lean3 / fake_guided_lean3; GIVEN): guided quantize with linear scales, or guided fake
// quantization, through the kernel's guided instantiations.
// TEAM_BAR: the per-row (g None) instantiations with per-team named barriers (team_bar_selected).
template <typename T, bool FAKE = false, bool GIVEN = false, int MODE = kRTN, bool TEAM_BAR = false>
bool launch_rowg_lean3(const QuantParams& p, cudaStream_t stream, const char* op) {
  static_assert(sizeof(T) == 2, "rowg-lean3 runs 16-bit x only");
  constexpr bool kGuided = MODE == kGuidedCompact || MODE == kGuidedFull;
  static_assert(!kGuided || GIVEN, "guided: the rollout's g");
  if (kGuided ? p.swizzle || p.guide_g == nullptr : GIVEN != (p.g != nullptr)) return false;
  if constexpr (FAKE) {
    const bool emit = p.mbits != nullptr;
    if (p.y == nullptr || p.codes != nullptr || p.swizzle || (p.scales != nullptr) != emit ||
        (p.g_out != nullptr) != emit)
      return false;
  } else if (p.y != nullptr || p.codes == nullptr || p.scales == nullptr || p.g_out == nullptr) {
    return false;
  }
  constexpr int kBpl = 2;  // as the previous kernel for 16-bit x
  if (p.kb > int64_t(kRowLeanThreads) * kBpl || p.kb < kBpl) return false;
  RowLeanPlan plan;
  if (!rowg_lean_plan(p, kBpl, kRowLeanCtasPerSm, plan)) return false;
  const uint32_t team = 1u << plan.shift, team_warps = team / 32u;
  const RowLean3Walk w{(uint32_t)p.rows,
                       (uint32_t)(p.rows - 1),
                       (uint32_t)p.kb,
                       plan.shift,
                       team,
                       team - 1u,
                       team_warps,
                       team_warps > 0u ? team_warps - 1u : 0u,
                       (uint32_t)(p.kb - (kBpl - 1) * int64_t(team)),
                       (uint32_t)plan.rows_per_cta,
                       (uint32_t)plan.row_stride,
                       (uint32_t)(p.kb_pad / 4 * 512),
                       team >= 4u ? team * 128u : team};
  auto go = [&](auto kernel) {
    require_kernel_image(kernel, op);
    kernel<<<(unsigned)plan.grid, kRowLeanThreads, 0, stream>>>(p, w);
    check_launch(op);
  };
  const bool capture = p.mbits != nullptr;
  if constexpr (kGuided) {
    capture ? go(nvfp4_quant_rowg_lean3_kernel<T, kBpl, false, true, FAKE, true, MODE>)
            : go(nvfp4_quant_rowg_lean3_kernel<T, kBpl, false, false, FAKE, true, MODE>);
  } else if constexpr (FAKE) {
    capture ? go(nvfp4_quant_rowg_lean3_kernel<T, kBpl, false, true, true, GIVEN, kRTN, TEAM_BAR>)
            : go(nvfp4_quant_rowg_lean3_kernel<T, kBpl, false, false, true, GIVEN, kRTN, TEAM_BAR>);
  } else if (p.swizzle) {
    capture ? go(nvfp4_quant_rowg_lean3_kernel<T, kBpl, true, true, false, GIVEN, kRTN, TEAM_BAR>)
            : go(nvfp4_quant_rowg_lean3_kernel<T, kBpl, true, false, false, GIVEN, kRTN, TEAM_BAR>);
  } else {
    capture ? go(nvfp4_quant_rowg_lean3_kernel<T, kBpl, false, true, false, GIVEN, kRTN, TEAM_BAR>)
            : go(nvfp4_quant_rowg_lean3_kernel<T, kBpl, false, false, false, GIVEN, kRTN, TEAM_BAR>);
  }
  return true;
}

template <bool FAKE, typename T, int IMPL>
void launch_quant_impl(const QuantParams& p, int64_t rounding, bool rowg, cudaStream_t stream, const char* op) {
  // SR / guided: two element codes (lean: kImplScaled's, through the lean kernel where it applies)
  constexpr int kSrGuided = IMPL == kImplBits || IMPL == kImplLean ? IMPL : kImplScaled;
  switch (rounding) {
    case kRTN: {
      constexpr int kRtn = IMPL == kImplRtnSat || IMPL == kImplLean ? IMPL : kImplScaled;  // RTN's three variants
      rowg ? launch_rowg<kRTN, FAKE, T, kRtn>(p, stream, op) : launch_flat<kRTN, FAKE, T, kRtn>(p, stream, op);
      break;
    }
    case kSR:
      rowg ? launch_rowg<kSR, FAKE, T, kSrGuided>(p, stream, op) : launch_flat<kSR, FAKE, T, kSrGuided>(p, stream, op);
      break;
    case kGuidedCompact:
      launch_flat<kGuidedCompact, FAKE, T, kSrGuided>(p, stream, op);
      break;
    default:
      launch_flat<kGuidedFull, FAKE, T, kSrGuided>(p, stream, op);
      break;
  }
}

// TRACE_EXT_QUANT_IMPL, read per call so that one process can time the variants: "bits" selects the previous SR /
// guided element code (e2m1_*_bits), "rtn-fminf" the RTN saturated per element by fminf, "rtn-sat" the RTN saturated
// after packing; "lean" kImplLean (the default before 2026-11-30): RTN by the power-of-two magic add, quantize with
// linear scales through nvfp4_quant_lean_kernel, the scaled-domain SR / guided code; "rowg-lean": kImplLean except
// RTN quantize with g None through nvfp4_quant_rowg_lean_kernel (one block per lane); "rowg-lean2": the same with two
// blocks per lane (the default before the A/B at 7b3e763); "guided-lean": kImplGuidedLean = rowg-lean2 except guided
// quantize through nvfp4_quant_guided_lean_kernel (the default before 2026-11-30 12:45); "sr-lean": kImplSrLean =
// guided-lean except SR's element code (sr_elems_lean_x2m14; the default from 12:45 to 13:00); "sr-row": kImplSrRow =
// sr-lean except SR quantize with g None through nvfp4_quant_rowg_lean_kernel (the default until round 46); unset (or
// anything else, e.g. "rowg-lean3"): kImplRowgLean3 = sr-row except RTN quantize of 16-bit x with g None through
// nvfp4_quant_rowg_lean3_kernel, and RTN fake quantization of 16-bit x with g None through the same kernel (its FAKE
// instantiation); "fake-lean3" names the default (the A/B name of that fake path).
int quant_impl() {
  const char* v = std::getenv("TRACE_EXT_QUANT_IMPL");
  if (v != nullptr && std::strcmp(v, "bits") == 0) return kImplBits;
  if (v != nullptr && std::strcmp(v, "rtn-fminf") == 0) return kImplScaled;
  if (v != nullptr && std::strcmp(v, "rtn-sat") == 0) return kImplRtnSat;
  if (v != nullptr && std::strcmp(v, "rowg-lean") == 0) return kImplRowgLean;
  if (v != nullptr && std::strcmp(v, "lean") == 0) return kImplLean;
  if (v != nullptr && std::strcmp(v, "rowg-lean2") == 0) return kImplRowgLean2;
  if (v != nullptr && std::strcmp(v, "guided-lean") == 0) return kImplGuidedLean;
  if (v != nullptr && std::strcmp(v, "sr-lean") == 0) return kImplSrLean;
  if (v != nullptr && std::strcmp(v, "sr-row") == 0) return kImplSrRow;
  return kImplRowgLean3;
}

// The lean3 kernel's per-row (g None) fake quantization waits on per-team named barriers (TEAM_BAR). H200 round 60
// (bench/results/team_bar_ab_h200{,_run2}.md, two timings): fake quantization 1.03-1.04x at K 2048, 1.01-1.02x at
// K 4096; RTN quantize (linear, swizzled, capture) 0.99-1.02x, so it keeps the CTA barrier. TRACE_EXT_QUANT_TEAM_BAR
// (read per call; an A/B knob): =0 never, =1 for quantize too.
bool team_bar_selected(bool fake) { return env_switch("TRACE_EXT_QUANT_TEAM_BAR", fake); }

// RTN quantize and fake quantization of 16-bit x with g given (per row or one g) go through
// nvfp4_quant_rowg_lean3_kernel's GIVEN instantiations for rows of 64..512 blocks where at least 3/4 of the team's
// lanes own two blocks (K 1024, 2048, 4096, 7168, 8192; not 768, 1536, 3072, 5120), the flat kernels elsewhere. H200
// rounds 58-59 (bench/results/given_lean3_ab_h200{,_run2}.md, given_lean3_k_ab_h200.md): g per row 1.09-1.12x at
// K 1024 / 2048 / 4096 / 7168 / 8192 (2^26 and 2^28), one g 1.03-1.07x, fake quantization with g 1.04-1.10x; at
// K 768 (a team of 32 lanes, half of them without a second block) 0.87-0.96x. TRACE_EXT_QUANT_GIVEN_LEAN3 (read per
// call; an A/B knob): =0 never (the flat kernels), =1 for every kb the kernel takes (2..512).
bool given_lean3(int64_t kb) {
  const int64_t team = int64_t(1) << lean_team_shift(kb, 2);  // launch_rowg_lean3's team (two blocks per lane)
  return env_switch("TRACE_EXT_QUANT_GIVEN_LEAN3", kb >= 64 && 4 * (kb - team) >= 3 * team);  // kb - team: 2 blocks
}

// Guided compact quantize of bf16 x with linear scales goes through nvfp4_quant_rowg_lean3_kernel's guided
// instantiation (2 <= kb <= 512) instead of nvfp4_quant_guided_lean_kernel. H200 round 59
// (guided_lean3_ab_h200{,_run2}.md, two timings): compact 1.02-1.04x at K 2048 / 4096 / 7168 / 8192 (72.4% -> 75.4%
// of copy at 2^26, 83.8% -> 87.4% at 2^28); full 0.95-0.99x (it stays on the guided lean kernel). fp16 x keeps the
// guided lean kernel too (its compact instantiation spills 60 B at 64 registers; untimed). TRACE_EXT_QUANT_GUIDED_LEAN3
// (read per call; an A/B knob): =0 never, =1 for compact and full, bf16 and fp16.
bool guided_lean3(int mode, bool bf16) {
  return env_switch("TRACE_EXT_QUANT_GUIDED_LEAN3", mode == kGuidedCompact && bf16);
}

// Guided fake quantization of 16-bit x (the trainer's TRACE forward, with or without emit_guidance; compact and full)
// goes through nvfp4_quant_rowg_lean3_kernel's FAKE guided instantiations (2 <= kb <= 512) instead of the generic flat
// kernel. H200 rounds 63-65, bit-equal. bf16 (fake_guided_lean3_ab_h200{,_run2}.md, fake_guided_lean3_k_ab_h200.md):
// compact 1.30-1.33x at K 2048 / 4096 / 7168 (62.8% -> 83.5% of copy at 2^26, 70.0% -> 92.2% at 2^28), 1.09-1.13x at
// K 768, with emit_guidance 1.05-1.32x, full 1.03-1.25x. fp16 (its instantiations spill 48-88 B at 64 registers;
// fp16_lean3_guided_ab_h200.md, fp16_fake_guided_default_ab_h200.md): 1.06-1.15x at K 4096 / 7168.
// TRACE_EXT_QUANT_FAKE_GUIDED_LEAN3 (read per call; an A/B knob): =0 keeps the flat kernel.
bool fake_guided_lean3() { return env_switch("TRACE_EXT_QUANT_FAKE_GUIDED_LEAN3", true); }

template <bool FAKE, typename T>
void launch_quant(const QuantParams& p, int64_t rounding, bool rowg, cudaStream_t stream, const char* op) {
  const int impl = quant_impl();
  const bool rtn_fused_g = rowg && rounding == kRTN && p.K <= kFusedMaxK;  // RTN, per-row g, rows fit on chip
  switch (impl) {
    case kImplBits:
      launch_quant_impl<FAKE, T, kImplBits>(p, rounding, rowg, stream, op);
      break;
    case kImplRtnSat:
      launch_quant_impl<FAKE, T, kImplRtnSat>(p, rounding, rowg, stream, op);
      break;
    case kImplLean:
      launch_quant_impl<FAKE, T, kImplLean>(p, rounding, rowg, stream, op);
      break;
    case kImplRowgLean3:  // the default: sr-row, except RTN quantize and RTN fake quantization of 16-bit x with
                          // g None (and g given: given_lean3; guided compact quantize of bf16 x: guided_lean3;
                          // guided fake quantization: fake_guided_lean3) through the lean3 kernel
      if constexpr (sizeof(T) == 2) {
        if (rtn_fused_g && team_bar_selected(FAKE) && launch_rowg_lean3<T, FAKE, false, kRTN, true>(p, stream, op))
          break;
        if (rtn_fused_g && launch_rowg_lean3<T, FAKE>(p, stream, op)) break;
        if (!rowg && rounding == kRTN && given_lean3(p.kb) && launch_rowg_lean3<T, FAKE, true>(p, stream, op)) break;
        constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
        if constexpr (FAKE) {
          if (rounding == kGuidedCompact && fake_guided_lean3() &&
              launch_rowg_lean3<T, true, true, kGuidedCompact>(p, stream, op))
            break;
          if (rounding == kGuidedFull && fake_guided_lean3() &&
              launch_rowg_lean3<T, true, true, kGuidedFull>(p, stream, op))
            break;
        } else {
          if (rounding == kGuidedCompact && guided_lean3(kGuidedCompact, kBf16) &&
              launch_rowg_lean3<T, false, true, kGuidedCompact>(p, stream, op))
            break;
          if (rounding == kGuidedFull && guided_lean3(kGuidedFull, kBf16) &&
              launch_rowg_lean3<T, false, true, kGuidedFull>(p, stream, op))
            break;
        }
      }
      [[fallthrough]];
    case kImplSrRow:  // sr-lean, except SR quantize with g None through the persistent per-row kernel
      if (!FAKE && rowg && rounding == kSR && p.K <= kFusedMaxK &&
          launch_rowg_lean<T, kSR>(p, stream, op, true))
        break;
      [[fallthrough]];
    case kImplSrLean:  // the default's kernels, SR with the lean element code (same kernels, other instantiations)
      if (rounding == kSR) {
        rowg ? launch_rowg<kSR, FAKE, T, kImplSrLean>(p, stream, op)
             : launch_flat<kSR, FAKE, T, kImplSrLean>(p, stream, op);
        break;
      }
      [[fallthrough]];
    case kImplGuidedLean:  // the default's kernels except guided quantize (where the lean kernel would take it)
      if (!FAKE && rounding == kGuidedCompact && launch_guided_lean<kGuidedCompact, T>(p, stream, op)) break;
      if (!FAKE && rounding == kGuidedFull && launch_guided_lean<kGuidedFull, T>(p, stream, op)) break;
      [[fallthrough]];
    case kImplRowgLean:  // the default's kernels except RTN quantize with g None (no duplicate instantiations)
    case kImplRowgLean2:
      if (!(!FAKE && rtn_fused_g &&
            launch_rowg_lean<T>(p, stream, op, impl != kImplRowgLean))) {  // two blocks per lane but =rowg-lean
        launch_quant_impl<FAKE, T, kImplLean>(p, rounding, rowg, stream, op);
      }
      break;
    default:
      launch_quant_impl<FAKE, T, kImplScaled>(p, rounding, rowg, stream, op);
      break;
  }
}

struct Prepared {
  QuantParams p;
  bool rowg;
};

// Argument checks shared by nvfp4_quantize and nvfp4_fake_quantize (SPEC 10), and the params they share.
Prepared prepare(at::Tensor& x, const std::optional<at::Tensor>& g, int64_t rounding, int64_t seed, int64_t offset,
                 const std::optional<at::Tensor>& gs, const std::optional<at::Tensor>& gg,
                 const std::optional<at::Tensor>& gp, at::Tensor& payload, const char* op) {
  check_float_x(x, kNvfp4Block, op);
  x = aligned_for_vectors(x, 16);
  TORCH_CHECK_VALUE(rounding >= kRTN && rounding <= kGuidedFull, "trace_ext.", op,
                    ": rounding must be 0 (rtn), 1 (sr), 2 (guided compact) or 3 (guided full), got ", rounding);
  TORCH_CHECK_VALUE(seed >= 0 && offset >= 0, "trace_ext.", op, ": seed and offset must be >= 0, got ", seed, ", ",
                    offset);
  const int64_t R = x.size(0), K = x.size(1);
  Prepared out{};
  QuantParams& p = out.p;
  p.x = x.data_ptr();
  p.rows = R;
  p.K = K;
  p.kb = K / kNvfp4Block;
  p.seed = (uint64_t)seed;
  p.offset = (uint64_t)offset;
  p.keys = philox_key_schedule(p.seed);
  const bool guided = rounding >= kGuidedCompact;
  if (guided) {
    TORCH_CHECK_VALUE(gs.has_value() && gg.has_value() && gp.has_value(), "trace_ext.", op,
                      ": guided rounding needs guide_scales, guide_g and guide_payload");
    const at::Tensor &s = *gs, &gr = *gg, &pl = *gp;
    for (auto* t : {&s, &gr, &pl}) check_same_device(*t, x, "guidance", "x");
    check_dtype(s, at::kByte, "guide_scales");
    check_dtype(pl, at::kByte, "guide_payload");
    check_dtype(gr, at::kFloat, "guide_g");
    check_shape(s, {R, p.kb}, "guide_scales");
    check_shape(gr, {R}, "guide_g");
    check_shape(pl, {R, rounding == kGuidedCompact ? K / 8 : K / 2}, "guide_payload");
    check_contiguous(s, "guide_scales");
    check_contiguous(gr, "guide_g");
    check_contiguous(pl, "guide_payload");
    p.guide_scales = s.data_ptr<uint8_t>();
    p.guide_g = gr.data_ptr<float>();
    payload = aligned_for_vectors(pl, 8);
    p.guide_payload = payload.data_ptr<uint8_t>();
    out.rowg = false;
  } else {
    TORCH_CHECK_VALUE(!gs.has_value() && !gg.has_value() && !gp.has_value(), "trace_ext.", op,
                      ": guidance tensors were given but rounding is ", rounding, " (not guided)");
    if (g.has_value()) {
      const at::Tensor& gt = *g;
      check_same_device(gt, x, "g", "x");
      check_dtype(gt, at::kFloat, "g");
      TORCH_CHECK_VALUE(gt.numel() == 1 || (gt.dim() == 1 && gt.size(0) == R), "trace_ext.", op,
                        ": g must have shape [", R, "] (one per row) or [1], got ", gt.sizes());
      check_contiguous(gt, "g");
      p.g = gt.data_ptr<float>();
      p.g_stride = gt.numel() == 1 ? 0 : 1;
      out.rowg = false;
    } else {
      out.rowg = true;
    }
  }
  return out;
}

// g_out of an empty-K input (no launch): per-row g of an empty row is 1 (SPEC 2), else the given / rollout g.
at::Tensor g_for_empty(const at::Tensor& x, const std::optional<at::Tensor>& g, int64_t rounding,
                       const std::optional<at::Tensor>& gg) {
  const int64_t R = x.size(0);
  if (rounding >= kGuidedCompact) return gg->clone();
  if (g.has_value()) return g->reshape({-1}).expand({R}).contiguous();
  return at::ones({R}, x.options().dtype(at::kFloat));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> nvfp4_quantize_cuda(
    const at::Tensor& x_in, const std::optional<at::Tensor>& g, int64_t rounding, int64_t seed, int64_t offset,
    const std::optional<at::Tensor>& guide_scales, const std::optional<at::Tensor>& guide_g,
    const std::optional<at::Tensor>& guide_payload, bool swizzle, bool emit_mbits) {
  const char* op = "nvfp4_quantize";
  at::Tensor x = x_in, payload;
  Prepared pr = prepare(x, g, rounding, seed, offset, guide_scales, guide_g, guide_payload, payload, op);
  const int64_t R = x.size(0), K = x.size(1), kb = K / kNvfp4Block;
  const c10::cuda::CUDAGuard guard(x.device());
  auto u8 = x.options().dtype(at::kByte);
  at::Tensor codes = at::empty({R, K / 2}, u8);
  const int64_t rows_pad = div_up(R, 128) * 128, kb_pad = div_up(kb, 4) * 4;
  at::Tensor scales = swizzle ? at::empty({rows_pad, kb_pad}, u8) : at::empty({R, kb}, u8);
  at::Tensor g_out = at::empty({R}, x.options().dtype(at::kFloat));
  at::Tensor mbits = emit_mbits ? at::empty({R, K / 8}, u8) : at::empty({0}, u8);
  if (R == 0) return {codes, scales, g_out, mbits};
  if (K == 0) {
    if (swizzle) scales.zero_();
    return {codes, scales, g_for_empty(x, g, rounding, guide_g), mbits};
  }
  QuantParams& p = pr.p;
  p.codes = codes.data_ptr<uint8_t>();
  p.scales = scales.data_ptr<uint8_t>();
  p.g_out = g_out.data_ptr<float>();
  p.mbits = emit_mbits ? mbits.data_ptr<uint8_t>() : nullptr;
  p.swizzle = swizzle;
  p.rows_pad = rows_pad;
  p.kb_pad = kb_pad;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    launch_quant<false, T>(p, rounding, pr.rowg, stream, op);
  });
  return {codes, scales, g_out, mbits};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> nvfp4_fake_quantize_cuda(
    const at::Tensor& x_in, const std::optional<at::Tensor>& g, int64_t rounding, int64_t seed, int64_t offset,
    const std::optional<at::Tensor>& guide_scales, const std::optional<at::Tensor>& guide_g,
    const std::optional<at::Tensor>& guide_payload, bool emit_guidance) {
  const char* op = "nvfp4_fake_quantize";
  at::Tensor x = x_in, payload;
  Prepared pr = prepare(x, g, rounding, seed, offset, guide_scales, guide_g, guide_payload, payload, op);
  const int64_t R = x.size(0), K = x.size(1), kb = K / kNvfp4Block;
  const c10::cuda::CUDAGuard guard(x.device());
  auto u8 = x.options().dtype(at::kByte);
  at::Tensor y = at::empty_like(x);
  at::Tensor mbits = emit_guidance ? at::empty({R, K / 8}, u8) : at::empty({0}, u8);
  at::Tensor scales = emit_guidance ? at::empty({R, kb}, u8) : at::empty({0}, u8);
  // g_buf doubles as the pass-1 buffer of long rows, so it exists whenever the kernel needs g in memory
  const bool need_g = emit_guidance || (pr.rowg && K > kFusedMaxK);
  auto f32 = x.options().dtype(at::kFloat);
  at::Tensor g_buf = need_g ? at::empty({R}, f32) : at::empty({0}, f32);
  at::Tensor g_out = emit_guidance ? g_buf : at::empty({0}, f32);
  if (R == 0) return {y, mbits, scales, g_out};
  if (K == 0) return {y, mbits, scales, emit_guidance ? g_for_empty(x, g, rounding, guide_g) : g_out};
  QuantParams& p = pr.p;
  p.y = y.data_ptr();
  p.mbits = emit_guidance ? mbits.data_ptr<uint8_t>() : nullptr;
  p.scales = emit_guidance ? scales.data_ptr<uint8_t>() : nullptr;
  p.g_out = need_g ? g_buf.data_ptr<float>() : nullptr;
  p.swizzle = false;
  p.rows_pad = R;
  p.kb_pad = kb;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    launch_quant<true, T>(p, rounding, pr.rowg, stream, op);
  });
  return {y, mbits, scales, g_out};
}

at::Tensor nvfp4_dequantize_cuda(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& g,
                                 at::ScalarType dtype) {
  const char* op = "nvfp4_dequantize";
  const int64_t K = check_dequantize_args(codes, scales, dtype, kNvfp4Block, op), R = codes.size(0);
  const int64_t kb = K / kNvfp4Block;
  check_same_device(g, codes, "g", "codes");
  check_dtype(g, at::kFloat, "g");
  TORCH_CHECK_VALUE(g.numel() == 1 || (g.dim() == 1 && g.size(0) == R), "trace_ext.", op, ": g must have shape [", R,
                    "] or [1], got ", g.sizes());
  check_contiguous(g, "g");
  const c10::cuda::CUDAGuard guard(codes.device());
  at::Tensor y = at::empty({R, K}, codes.options().dtype(dtype));
  if (R == 0 || K == 0) return y;
  const at::Tensor codes_v = aligned_for_vectors(codes, 16);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t work_threads = div_up(R * kb * 2, kWarpChunks) * 32;
  dispatch_float_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto kernel = nvfp4_dequant_kernel<T>;
    require_kernel_image(kernel, op);
    kernel<<<(unsigned)div_up(work_threads, kFlatThreads), kFlatThreads, 0, stream>>>(
        codes_v.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), g.data_ptr<float>(), g.numel() == 1 ? 0 : 1, R, kb,
        reinterpret_cast<T*>(y.data_ptr()));
    check_launch(op);
  });
  return y;
}

}  // namespace
}  // namespace trace_ext

TORCH_LIBRARY_IMPL(trace_ext, CUDA, m) {
  m.impl("nvfp4_quantize", &trace_ext::nvfp4_quantize_cuda);
  m.impl("nvfp4_fake_quantize", &trace_ext::nvfp4_fake_quantize_cuda);
  m.impl("nvfp4_dequantize", &trace_ext::nvfp4_dequantize_cuda);
}
