// NVFP4 quantizer kernels that walk rows (per-row g computed in the launch, and the lean3 walk for g given,
// guided and fake quantization), and the first pass of rows too long for one team.
// Part of the NVFP4 quantizer translation unit: csrc/quant_nvfp4.cu includes it and holds the design notes; the
// definitions live in that unit's anonymous namespace.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "trace_ext/fp4_numerics.cuh"
#include "trace_ext/quant_common.cuh"
#include "trace_ext/quant_sr_elems.cuh"
#include "trace_ext/quant_nvfp4_blocks.cuh"
#include "trace_ext/timeline.cuh"

namespace trace_ext {
namespace {

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
// (SR with one block per lane fits 64 registers for 16-bit x, but at 4 CTAs per SM it ran 0.96-0.99x of two blocks per
// lane at 3: H200 round 92. More warps do not pay for the doubled per-row work and the halved per-thread ILP.)
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
                                                            make_uint2(0u, 0u), codes,
                                                            sizeof(T) == 2 ? cur[q].v : nullptr);  // signs: raw halves
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

// quantize_block<kRTN, 16, kImplLean>: the same fast-path test (t in [2^-100, 2^100], amax / t far from overflow),
// the same element code (without the clamp where rtn_needs_no_clamp) with 1/t by frcp_rn_mid, else its zeros (t == 0
// or NaN) or its division path.
// The signs come from the floats: reading them off the raw halves (4 byte permutes per 8 elements instead of 6, as the
// SR lean path does) made most lean3 instantiations spill at 64 registers; per-row, swizzled, capture and fake rows ran
// 0.92-0.98x, g given 0.99-1.02x (H200 round 90).
__device__ __forceinline__ void quantize_block_rtn_mid(const float (&x)[kNvfp4Block], uint32_t max_bits, float t,
                                                       const QuantParams& p, uint32_t (&w)[kNvfp4Block / 8]) {
  if (t >= 0x1p-100f && t <= 0x1p100f) {
    const float r = frcp_rn_mid(t);
    const float q_max = __fmul_rn(__uint_as_float(max_bits), r);
    if (rtn_needs_no_clamp(q_max)) {  // every block with a normal, unclamped scale byte: no clamp (same codes)
      quantize_rtn_abs_x2m14<true, kNvfp4Block, false>(x, t, r, w);
      return;
    }
    if (q_max <= 0x1p100f) {
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
  uint32_t swz_cta_shift;  // SWZ_STAGED: log2 of the CTAs per 128-row tile (32 / rows_per_cta)
};

// The grid of the lean per-row kernels (host side; quant_nvfp4.cu's rowg_lean_plan supplies the SM count and the A/B
// knobs, tools/probes/timeline.cu the defaults): bpl blocks per lane, a team of 2^shift threads (the smallest with
// 2^shift * bpl >= kb), rows_per_cta rows per row group, a grid whose CTAs walk iters or iters - 1 row groups (iters
// at most `cap`, 0: no cap) with a stride of row_stride rows. See rowg_lean_plan for the measurements behind it.
constexpr int64_t kLeanItersMax = 4;  // the default cap

struct RowLeanPlan {
  uint32_t shift;
  int64_t rows_per_cta, grid, row_stride;
};

// log2 of the row team of the lean per-row kernels: the smallest power of two of threads with team * bpl >= kb.
inline uint32_t lean_team_shift(int64_t kb, int bpl) {
  uint32_t shift = 0;
  while ((int64_t(1) << shift) * bpl < kb) ++shift;
  return shift;
}

// The plan for `slots` resident CTAs: the capped grid, rounded up to whole waves of slots where whole_waves (the CTAs
// launched last then walk one row group fewer), where its stride keeps 32-bit row, block and swizzled indices; else the
// capped grid, else the one-wave grid; false if none does.
inline bool plan_row_lean(const QuantParams& p, int bpl, int64_t slots, int64_t cap, bool whole_waves,
                          RowLeanPlan& plan) {
  const auto div_up = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const uint32_t shift = lean_team_shift(p.kb, bpl);
  const int64_t rows_per_cta = kRowLeanThreads >> shift;
  const int64_t groups = div_up(p.rows, rows_per_cta);
  const int64_t one_wave_iters = div_up(groups, slots);
  const auto fits = [&](int64_t row_stride) {
    return p.rows + row_stride < (int64_t(1) << 31) && (p.rows + row_stride) * p.kb < (int64_t(1) << 31) &&
           !(p.swizzle && p.rows_pad * p.kb_pad >= (int64_t(1) << 31));
  };
  const int64_t iters = cap > 0 ? std::min(one_wave_iters, cap) : one_wave_iters;
  const int64_t capped = div_up(groups, iters);
  const int64_t rounded =
      iters < one_wave_iters && whole_waves ? std::min(div_up(capped, slots) * slots, groups) : capped;
  for (const int64_t grid : {rounded, capped, div_up(groups, one_wave_iters)}) {
    if (fits(grid * rows_per_cta)) {
      plan = RowLeanPlan{shift, rows_per_cta, grid, grid * rows_per_cta};
      return true;
    }
  }
  return false;
}

// The walk constants of nvfp4_quant_rowg_lean3_kernel for a plan with bpl blocks per lane (swz_cta_shift 0: the
// staged swizzled launch sets it).
inline RowLean3Walk row_lean3_walk(const QuantParams& p, const RowLeanPlan& plan, int bpl) {
  const uint32_t team = 1u << plan.shift, team_warps = team / 32u;
  return RowLean3Walk{(uint32_t)p.rows,
                      (uint32_t)(p.rows - 1),
                      (uint32_t)p.kb,
                      plan.shift,
                      team,
                      team - 1u,
                      team_warps,
                      team_warps > 0u ? team_warps - 1u : 0u,
                      (uint32_t)(p.kb - (bpl - 1) * int64_t(team)),
                      (uint32_t)plan.rows_per_cta,
                      (uint32_t)plan.row_stride,
                      (uint32_t)(p.kb_pad / 4 * 512),
                      team >= 4u ? team * 128u : team,
                      0u};
}

// SWZ_STAGED: a CTA's swizzled scale bytes, staged in shared memory as the 16-byte chunks of the 128x4 layout it owns
// (rows_per_cta <= 32 rows of a tile's 32-row phase x kb_pad / 4 column chunks; rows_per_cta * kb_pad * 4 <= 2 KB,
// since kb_pad <= 2 team = 512 / rows_per_cta).
constexpr int kSwzStageChunks = 128;

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
          bool TEAM_BAR = false, bool SWZ_STAGED = false>
__global__ void __launch_bounds__(kRowLeanThreads, kRowLeanCtasPerSm)
    nvfp4_quant_rowg_lean3_kernel(const QuantParams p, const RowLean3Walk w) {
  constexpr bool kGuided = MODE == kGuidedCompact || MODE == kGuidedFull;
  static_assert(BPL == 1 || BPL == 2, "one or two blocks per lane");
  static_assert(!(FAKE && SWIZZLE), "fake quantization emits linear scales");
  static_assert(MODE == kRTN || (kGuided && GIVEN && !SWIZZLE), "guided: the rollout's g, linear outputs");
  static_assert(!SWZ_STAGED || SWIZZLE, "staged scale stores are the swizzled layout's");
  constexpr bool kScalesOut = !FAKE || CAPTURE;  // scale bytes and g_out exist
  __shared__ uint32_t warp_max[2][kRowLeanThreads / 32];
  __shared__ uint4 swz_stage[SWZ_STAGED ? kSwzStageChunks : 1];
  TRACE_EXT_TIMELINE_BEGIN(0);  // (probes only: empty in the extension)
  const uint32_t lane = threadIdx.x & w.team_mask;
  const bool has_last = lane < w.last_lanes;  // blocks q < BPL - 1 always exist (the host's team: team * BPL >= kb)
  const T* xp = reinterpret_cast<const T*>(p.x);
  // The CTA's row groups (uniform: every thread runs every iteration): base, base + stride, ... below row_end.
  // SWZ_STAGED: the CTA owns rows_per_cta consecutive rows of each 32-row phase of one 128-row tile (4 groups, 32 rows
  // apart), i.e. whole 16-byte chunks of the tile's swizzled scales; loads past row_end read row R - 1 (L2 hits).
  uint32_t base, row_end, stride;
  if constexpr (SWZ_STAGED) {
    const uint32_t tile0 = (blockIdx.x >> w.swz_cta_shift) * 128u;
    base = tile0 + (blockIdx.x & ((1u << w.swz_cta_shift) - 1u)) * w.rows_per_cta;
    row_end = min(w.rows, tile0 + 128u);
    stride = 32u;
  } else {
    base = blockIdx.x * w.rows_per_cta;
    row_end = w.rows;
    stride = w.row_stride;
  }
  const uint32_t base0 = base;
  uint32_t row = base + (threadIdx.x >> w.team_shift);
  auto clamp_row = [&](uint32_t r) { return SWZ_STAGED ? (r < row_end ? r : w.last_row) : min(r, w.last_row); };
  auto load = [&](uint32_t r, BlockRaw<T>(&buf)[BPL]) {
    const uint32_t i0 = clamp_row(r) * w.kb + lane;
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
    const uint32_t rc = clamp_row(r);
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
    TRACE_EXT_TIMELINE_MARK();
    load(row + stride, nxt);
    load_side(row + stride, side_nxt);
    uint32_t mb[BPL];
#pragma unroll
    for (int q = 0; q < BPL; ++q) mb[q] = block_max_abs_bits<T, !kGuided>(cur[q]);  // (raw_max_abs_bits)
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
          if constexpr (SWZ_STAGED) {
            // chunk (team row, column chunk kbi / 4) of the stage, byte 4 (row group) + kbi % 4
            const uint32_t kbi = lane + q * w.team, it = (base - base0) >> 5;
            const uint32_t chunk = (tid_in_loop() >> w.team_shift) * (w.tile_bytes >> 9) + (kbi >> 2);
            reinterpret_cast<uint8_t*>(swz_stage)[chunk * 16u + it * 4u + (kbi & 3u)] = s;
          } else if constexpr (SWIZZLE) {
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
    base += stride;
    row += stride;
  };
  BlockRaw<T> buf0[BPL], buf1[BPL];
  buf0[BPL - 1] = BlockRaw<T>{};  // a lane without a last block never loads it (its amax is masked)
  buf1[BPL - 1] = BlockRaw<T>{};
  RowSide<BPL> side0{}, side1{};  // (a lane without a last block never loads its guidance)
  load(row, buf0);
  load_side(row, side0);
  // SWZ_STAGED: the stage's chunks of rows past R and of blocks past kb (up to kb_pad) are zeros
  const uint32_t stage_chunks = SWZ_STAGED ? w.rows_per_cta * (w.tile_bytes >> 9) : 0u;
  const uint32_t tile0 = base0 & ~127u;
  if constexpr (SWZ_STAGED) {
    if (row_end < tile0 + 128u || (w.kb & 3u) != 0u) {
      for (uint32_t ch = threadIdx.x; ch < stage_chunks; ch += kRowLeanThreads) swz_stage[ch] = make_uint4(0u, 0u, 0u, 0u);
      __syncthreads();
    }
  }
  while (base < row_end) {
    step(std::integral_constant<int, 0>{}, buf0, buf1, side0, side1);
    if (base >= row_end) break;
    step(std::integral_constant<int, 1>{}, buf1, buf0, side1, side0);
  }
  if constexpr (SWZ_STAGED) {
    // the CTA's chunks: column chunk kt of team row j to tile offset kt * 512 + (its row in the 32-row phase) * 16
    __syncthreads();
    const uint32_t kt_n = w.tile_bytes >> 9;
    uint8_t* dst = p.scales + (size_t)(tile0 >> 7) * w.tile_bytes + (base0 - tile0) * 16u;
    for (uint32_t ch = threadIdx.x; ch < stage_chunks; ch += kRowLeanThreads) {
      const uint32_t j = ch / kt_n, kt = ch - j * kt_n;
      *reinterpret_cast<uint4*>(dst + kt * 512u + j * 16u) = swz_stage[ch];
    }
  } else if constexpr (SWIZZLE) {
    swizzle_pad_zero(p, (int64_t)blockIdx.x * blockDim.x + threadIdx.x, (int64_t)gridDim.x * blockDim.x);
  }
  TRACE_EXT_TIMELINE_END();
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

}  // namespace
}  // namespace trace_ext
