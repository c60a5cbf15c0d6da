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
//   a grid of several waves instead of one persistent wave (rowg_lean_plan); same bits. Since round 101 that grid is
//   rounded up to whole waves of CTA slots (lean_whole_waves; TRACE_EXT_QUANT_LEAN_WHOLE_WAVES=0 keeps it as it was).
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
//   Default since H200 round 81 for the lean3 kernel (TRACE_EXT_QUANT_SWZ_STAGED=0 keeps the scattered stores; same
//   bits): a CTA takes rows_per_cta rows of each 32-row phase of one 128-row tile, stages its scale bytes in shared
//   memory (zeros for rows past R and blocks past K / 16) and stores whole 16-byte chunks, 1.006-1.040x.
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
#include "trace_ext/quant_nvfp4_blocks.cuh"  // launch parameters, variant ids, per-block quantization
#include "trace_ext/quant_nvfp4_flat.cuh"    // kernels over flat tiles of blocks
#include "trace_ext/quant_nvfp4_rowg.cuh"    // kernels over rows
#include "trace_ext/quant_sr_elems.cuh"

namespace trace_ext {
namespace {

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

// TRACE_EXT_QUANT_LEAN_ITERS=n (read per call; an A/B knob): at most n row groups per CTA instead of kLeanItersMax;
// n = 0: no limit (one persistent wave, the grid before round 52).
int64_t lean_iters_cap() {
  const char* v = std::getenv("TRACE_EXT_QUANT_LEAN_ITERS");
  return v != nullptr ? std::max<int64_t>(std::atoll(v), 0) : kLeanItersMax;
}

// Swizzled scales of the per-row lean3 quantize kernel staged in shared memory and stored as whole 16-byte chunks of
// the 128x4 layout (SWZ_STAGED; the CTA's rows are 4 groups 32 rows apart in one 128-row tile) instead of one byte per
// block scattered over 8 sectors per warp store. TRACE_EXT_QUANT_SWZ_STAGED (read per call; an A/B knob): =0 keeps
// the scattered byte stores.
bool swz_staged_selected() { return env_switch("TRACE_EXT_QUANT_SWZ_STAGED", true); }

// The capped grid rounded up to whole waves of CTA slots (where that keeps at least one row group per CTA), so that
// the walk's stride leaves the CTAs launched last one row group fewer: the last wave ends sooner. The timeline probe
// (tools/probes/timeline.py) showed wave boundaries that stay synchronized and a ragged last wave at 2^26. Default
// since H200 round 101 (bench/results/quant_whole_waves_ab{,_run2}_h200.md, two passes): 2^26 per-row RTN 1.02x, g
// given 1.00-1.01x, capture 1.01-1.02x, fake quantization 1.01-1.02x; 2^28 0.993-1.01x. TRACE_EXT_QUANT_LEAN_WHOLE_WAVES
// (read per call; an A/B knob): =0 keeps the grid before round 101.
bool lean_whole_waves() { return env_switch("TRACE_EXT_QUANT_LEAN_WHOLE_WAVES", true); }

// The grid of the lean per-row kernels for bpl blocks per lane (plan_row_lean, with this device's SM count and the
// knobs above): the team (2^shift threads, the smallest with 2^shift * bpl >= kb), rows per CTA, a balanced grid where
// every CTA walks iters or iters - 1 row groups, and its stride in rows; false where a 32-bit index could overflow.
// iters is at most kLeanItersMax: the grid is then several waves of the block scheduler rather than one persistent wave of ctas_per_sm CTAs per SM. H200 round 52
// (bench/results/lean_iters_ab_h200.md): with one wave the kernel waits for its slowest CTAs (a static split of the
// rows); at most 4 row groups per CTA ran per-row RTN 1.03x (2^26) / 1.06x (2^28), swizzled 1.06x / 1.06x, capture
// 1.03x / 1.06x at K 4096, 1.04-1.05x at K 7168 (2^26); 1 group per CTA (no next-row prefetch) 0.92-0.97x, 8 groups
// 1.00-1.06x.
bool rowg_lean_plan(const QuantParams& p, int bpl, int ctas_per_sm, RowLeanPlan& plan) {
  return plan_row_lean(p, bpl, int64_t(current_sm_count()) * ctas_per_sm, lean_iters_cap(), lean_whole_waves(), plan);
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
  const RowLean3Walk w = row_lean3_walk(p, plan, kBpl);
  auto launch = [&](auto kernel, int64_t grid, const RowLean3Walk& walk) {
    require_kernel_image(kernel, op);
    kernel<<<(unsigned)grid, kRowLeanThreads, 0, stream>>>(p, walk);
    check_launch(op);
  };
  auto go = [&](auto kernel) { launch(kernel, plan.grid, w); };
  // swizzled scales staged per CTA (swz_staged_selected): the CTA takes rows_per_cta rows of each 32-row phase of
  // one 128-row tile, so rows_per_cta <= 32 (teams of >= 8 threads); every tile of rows_pad gets its CTAs
  auto go_staged = [&](auto kernel) {
    RowLean3Walk ws = w;
    ws.swz_cta_shift = 5u - (uint32_t)__builtin_ctzll((unsigned long long)plan.rows_per_cta);
    ws.row_stride = 32u;
    launch(kernel, (p.rows_pad / 128) << ws.swz_cta_shift, ws);
  };
  const bool staged = !FAKE && !kGuided && p.swizzle && plan.rows_per_cta <= 32 && swz_staged_selected();
  const bool capture = p.mbits != nullptr;
  if constexpr (kGuided) {
    capture ? go(nvfp4_quant_rowg_lean3_kernel<T, kBpl, false, true, FAKE, true, MODE>)
            : go(nvfp4_quant_rowg_lean3_kernel<T, kBpl, false, false, FAKE, true, MODE>);
  } else if constexpr (FAKE) {
    capture ? go(nvfp4_quant_rowg_lean3_kernel<T, kBpl, false, true, true, GIVEN, kRTN, TEAM_BAR>)
            : go(nvfp4_quant_rowg_lean3_kernel<T, kBpl, false, false, true, GIVEN, kRTN, TEAM_BAR>);
  } else if (staged) {
    capture ? go_staged(nvfp4_quant_rowg_lean3_kernel<T, kBpl, true, true, false, GIVEN, kRTN, TEAM_BAR, true>)
            : go_staged(nvfp4_quant_rowg_lean3_kernel<T, kBpl, true, false, false, GIVEN, kRTN, TEAM_BAR, true>);
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
        if (rounding == kGuidedCompact || rounding == kGuidedFull) {  // guided quantize / fake quantization
          const bool lean3 = FAKE ? fake_guided_lean3()
                                  : guided_lean3((int)rounding, std::is_same_v<T, __nv_bfloat16>);
          if (lean3 && (rounding == kGuidedCompact ? launch_rowg_lean3<T, FAKE, true, kGuidedCompact>(p, stream, op)
                                                   : launch_rowg_lean3<T, FAKE, true, kGuidedFull>(p, stream, op)))
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
