// The shared-memory-operand (SS) large-M wgmma kernel (TRACE_EXT_WGMMA_IMPL=old): W (and W4A4 A) dequantized
// into 128B-swizzled bf16 tiles in shared memory, both wgmma operands from shared memory.
// Part of the large-M wgmma translation unit: csrc/gemm_w4_wgmma_sm90.cu includes it and holds the design notes, the
// W4A4 activation conversion and the host side.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "trace_ext/fp4_numerics.cuh"
#include "trace_ext/gemm_w4_common.cuh"
#include "trace_ext/gemm_w4_wgmma_common.cuh"

namespace trace_ext {
namespace gemm_w4 {

template <bool kAFp4>
struct WgCfg {
  static constexpr int kABf16 = kWgBM * kSwRow;                       // 16 KB, swizzled bf16 A tile
  static constexpr int kBBf16 = kWgBN * kSwRow;                       // 32 KB, swizzled bf16 W tile
  static constexpr int kARaw = kAFp4 ? kWgBM * (32 + 4) : kABf16;     // FP4 codes + scales, or bf16 A (swizzled)
  static constexpr int kWRaw = kWgBN * (32 + 4);
  static constexpr int kStage = (kARaw + kWRaw + 1023) / 1024 * 1024;  // the bf16 A tile inside must stay aligned
  static constexpr int kDeqA = kAFp4 ? 2 * kABf16 : 0;                // double-buffered dequantized A
  static constexpr int kDeqB = 2 * kBBf16;                            // double-buffered dequantized W
  static constexpr int kSmem = 1024 + kDeqA + kDeqB + kWgStages * kStage;  // + 1 KB for 1024-byte alignment
  static_assert(kABf16 % 1024 == 0 && kBBf16 % 1024 == 0, "swizzled tiles must stay 1024-byte aligned");
};

// d[0..127] += A(desc_a: 64 x 16, K-major, 128B swizzle) * B(desc_b: 256 x 16, K-major, 128B swizzle)^T.
__device__ __forceinline__ void wgmma_m64n256k16_bf16(float d[128], uint64_t desc_a, uint64_t desc_b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " TRACE_EXT_WGMMA_ACC128_REGS
      ", %128, %129, p, 1, 1, 0, 0;\n"
      "}\n"
      : TRACE_EXT_WGMMA_ACC128(d)
      : "l"(desc_a), "l"(desc_b));
#endif
}

// 16 packed code bytes (32 elements, 2 NVFP4 blocks) -> 4 x 16 bytes of bf16 q * s * 2^-7 into a swizzled row.
__device__ __forceinline__ void dequant32_to_swizzled(uint4 c, uint32_t s0, uint32_t s1, uint8_t* row_base, int row,
                                                      int chunk0) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {  // word q: elements 8q .. 8q + 7 of the 32
    const uint32_t lo = w[q] & 0x0F0F0F0Fu;
    const uint32_t hi = (w[q] >> 4) & 0x0F0F0F0Fu;
    const uint32_t sc = q < 2 ? s0 : s1;
    uint32_t r[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t x = __byte_perm(lo, hi, (uint32_t)(j | (j << 4) | ((4 + j) << 8) | ((4 + j) << 12))) & 0x000F000Fu;
      r[j] = bf16x2_mul((x * 4160u) & 0x81C081C0u, sc);  // 4160 = 2^12 + 2^6
    }
    const int chunk = chunk0 + q;
    *reinterpret_cast<uint4*>(row_base + ((chunk ^ (row & 7)) << 4)) = make_uint4(r[0], r[1], r[2], r[3]);
  }
}

template <bool kAFp4>
__device__ __forceinline__ void wg_load_stage(const GemmParams& p, uint8_t* st, int m_begin, int m_end,
                                              const uint8_t* wc, const uint8_t* ws, int n0, int k0) {
  using C = WgCfg<kAFp4>;
  const int tid = threadIdx.x;
  const int K = p.K;
  if constexpr (!kAFp4) {
    const __nv_bfloat16* a = reinterpret_cast<const __nv_bfloat16*>(p.a);
#pragma unroll
    for (int it = 0; it < kWgBM * 8 / kWgThreads; ++it) {
      const int idx = tid + it * kWgThreads;
      const int row = idx >> 3, c = idx & 7;
      const int m = m_begin + row;
      const bool ok = m < m_end;
      cp_async16(st + row * kSwRow + ((c ^ (row & 7)) << 4), ok ? (const void*)(a + (int64_t)m * K + k0 + c * 8) : p.a,
                 ok);
    }
  } else {
    const uint8_t* ac = reinterpret_cast<const uint8_t*>(p.a);
    {
      const int row = tid >> 1, c = tid & 1;  // kWgBM * 2 == kWgThreads chunks
      const int m = m_begin + row;
      const bool ok = m < m_end;
      cp_async16(st + row * 32 + c * 16, ok ? (const void*)(ac + (int64_t)m * (K / 2) + k0 / 2 + c * 16) : p.a, ok);
    }
    if (tid < kWgBM) {
      const int m = m_begin + tid;
      const bool ok = m < m_end;
      cp_async4(st + kWgBM * 32 + tid * 4, ok ? (const void*)(p.a_scales + (int64_t)m * (K / 16) + k0 / 16) : p.a_scales,
                ok);
    }
  }
  uint8_t* sw = st + C::kARaw;
  {
    const int n = n0 + tid;  // one W row per thread: 32 code bytes + one 4-byte scale word
    const bool ok = n < p.N;
#pragma unroll
    for (int c = 0; c < 2; ++c)
      cp_async16(sw + tid * 32 + c * 16, ok ? (const void*)(wc + (int64_t)n * (K / 2) + k0 / 2 + c * 16) : wc, ok);
    cp_async4(sw + kWgBN * 32 + tid * 4, ok ? (const void*)(ws + (int64_t)n * (K / 16) + k0 / 16) : ws, ok);
  }
}

template <bool kAFp4>
__global__ void __launch_bounds__(kWgThreads, 1) gemm_w4_wgmma_kernel(const GemmParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = WgCfg<kAFp4>;
  extern __shared__ uint8_t smem_raw[];
  __shared__ int s_tile[3];
  __shared__ int s_off[kMaxExperts + 1];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* deq_a = smem;                    // [2][kABf16] (W4A4 only)
  uint8_t* deq_b = smem + C::kDeqA;         // [2][kBBf16]
  uint8_t* ring = deq_b + C::kDeqB;         // [kWgStages][kStage]

  load_group_tile<kWgThreads>(p, kWgBM, s_off, s_tile);
  const int e = s_tile[0], m_begin = s_tile[1], m_end = s_tile[2];
  if (e < 0 || m_begin >= m_end) return;

  const int K = p.K;
  const int n0 = blockIdx.x * kWgBN;
  const uint8_t* wc = p.w_codes + (int64_t)e * p.N * (K / 2);
  const uint8_t* ws = p.w_scales + (int64_t)e * p.N * (K / 16);
  const int KT = K / kWgBK;
  const int tid = threadIdx.x;
  const int wg = tid >> 7;

  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  fence_acc(acc, 128);

#pragma unroll
  for (int s = 0; s < kWgStages - 2; ++s) {
    if (s < KT) wg_load_stage<kAFp4>(p, ring + s * C::kStage, m_begin, m_end, wc, ws, n0, s * kWgBK);
    cp_async_commit();
  }

  // Two barriers per k step. At the first one every thread has passed wgmma.wait_group 1 of step kt - 1, so the
  // wgmma of step kt - 2 is complete: its ring stage ((kt + kWgStages - 2) % kWgStages) and its bf16 buffers
  // (kt & 1) are free to refill while the wgmma of step kt - 1 still runs.
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<kWgStages - 3>();
    fence_proxy_async();
    __syncthreads();
    {
      const int nk = kt + kWgStages - 2;
      if (nk < KT)
        wg_load_stage<kAFp4>(p, ring + (nk % kWgStages) * C::kStage, m_begin, m_end, wc, ws, n0, nk * kWgBK);
      cp_async_commit();
    }
    const uint8_t* st = ring + (kt % kWgStages) * C::kStage;
    // ---- dequantize this k step's FP4 tiles into the swizzled bf16 buffers
    {
      const uint8_t* sw = st + C::kARaw;
      const int row = tid;  // one W row per thread: 64 elements
      const uint8_t* sc = sw + kWgBN * 32 + row * 4;
      uint8_t* dst = deq_b + (kt & 1) * C::kBBf16 + row * kSwRow;
      dequant32_to_swizzled(*reinterpret_cast<const uint4*>(sw + row * 32), scale_bf16x2_folded(sc[0]),
                            scale_bf16x2_folded(sc[1]), dst, row, 0);
      dequant32_to_swizzled(*reinterpret_cast<const uint4*>(sw + row * 32 + 16), scale_bf16x2_folded(sc[2]),
                            scale_bf16x2_folded(sc[3]), dst, row, 4);
    }
    if constexpr (kAFp4) {
      const int row = tid >> 1, half = tid & 1;  // half an A row per thread: 32 elements
      const uint8_t* sc = st + kWgBM * 32 + row * 4 + half * 2;
      dequant32_to_swizzled(*reinterpret_cast<const uint4*>(st + row * 32 + half * 16), scale_bf16x2_folded(sc[0]),
                            scale_bf16x2_folded(sc[1]), deq_a + (kt & 1) * C::kABf16 + row * kSwRow, row, half * 4);
    }
    fence_proxy_async();
    __syncthreads();
    // ---- this warpgroup's m64n256 over 4 k16 steps
    {
      const uint8_t* a_tile = kAFp4 ? deq_a + (kt & 1) * C::kABf16 : st;
      const uint32_t a_addr = smem_u32(a_tile + wg * 64 * kSwRow);
      const uint32_t b_addr = smem_u32(deq_b + (kt & 1) * C::kBBf16);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kWgBK / 16; ++ks)
        wgmma_m64n256k16_bf16(acc, sw128_desc(a_addr + ks * 32), sw128_desc(b_addr + ks * 32));
      wgmma_commit();
    }
    // no operand fences inside the loop: one wgmma group is always in flight, and ptxas would serialize the
    // pipeline on any instruction that (even nominally) defines the accumulators meanwhile
    wgmma_wait<1>();
  }
  wgmma_wait<0>();
  fence_acc(acc, 128);
  cp_async_wait<0>();

  // ---- epilogue: accumulator 8-column chunk c: rows wg*64 + 16*warp + g (+8), columns 8c + 2t (+1)
  const int warp_in_wg = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const float fold = kAFp4 ? kUnfoldW4A4 : kUnfoldW4A16;
  const float* gw = p.g_w + (int64_t)e * p.gw_stride_e;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = m_begin + wg * 64 + warp_in_wg * 16 + g + h * 8;
    if (m >= m_end) continue;
    const float ga = p.g_a != nullptr ? p.g_a[m] : 1.0f;
#pragma unroll
    for (int c = 0; c < kWgBN / 8; ++c) {
      const int n = n0 + c * 8 + 2 * t;
      float v[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int nn = n + u < p.N ? n + u : p.N - 1;
        v[u] = __fmul_rn(__fmul_rn(acc[c * 4 + h * 2 + u], fold), __fmul_rn(ga, gw[(int64_t)nn * p.gw_stride_n]));
      }
      store_bf16_pair(p.y + (int64_t)m * p.N + n, v, n + 1 < p.N, n < p.N, p.N);
    }
  }
#endif
}

}  // namespace gemm_w4
}  // namespace trace_ext
