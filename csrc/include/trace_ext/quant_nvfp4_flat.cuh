// NVFP4 quantizer kernels that walk flat tiles of blocks with g known per block (given, guided, or the second pass
// of long rows): the flat kernel, the lean flat kernel and the guided lean kernel.
// Part of the NVFP4 quantizer translation unit: csrc/quant_nvfp4.cu includes it and holds the design notes; the
// definitions live in that unit's anonymous namespace.
#pragma once

#include <cstdint>
#include <type_traits>

#include "trace_ext/fp4_numerics.cuh"
#include "trace_ext/quant_common.cuh"
#include "trace_ext/quant_sr_elems.cuh"
#include "trace_ext/quant_nvfp4_blocks.cuh"

namespace trace_ext {
namespace {

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
        const uint32_t mb = unpack_block<T, MODE == kRTN || MODE == kSR>(raw[q], x);
        // the SR lean element code reads the signs off 16-bit x's raw halves (fp32 x: from the floats, as before)
        constexpr bool kRawSigns = MODE == kSR && IMPL == kImplSrLean && sizeof(T) == 2;
        process_block<T, MODE, FAKE, IMPL>(p, x, mb, g[q], rg[q], fb, rows[q], kbis[q], gbits[q], gcodes[q],
                                           kRawSigns ? raw[q].v : nullptr);
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
        const uint32_t mb = unpack_block<T, !kGuided>(raw[q], x);
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
        const uint32_t mb = unpack_block<T, false>(raw[q], x);
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

}  // namespace
}  // namespace trace_ext
