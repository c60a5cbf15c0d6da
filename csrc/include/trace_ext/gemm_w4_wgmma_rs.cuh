// The register-operand (RS) large-M wgmma kernel (the default): Y^T = W * A^T with the dequantized weight as
// wgmma's register A operand, the data-parallel grid (gemm_w4_wgmma_rs_kernel) and the stream-K schedule
// (gemm_w4_wgmma_rs_sk_kernel).
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

// ---- W4A16 register-operand (RS) kernel ---------------------------------------------------------------------
// Computes Y^T = W * A^T: the dequantized weight is wgmma's A operand straight from registers, the bf16 activation
// tile is the smem B operand. CTA tile 128 weight rows (2 warpgroups x m64) x 256 activation rows (n256) x 64 K.
constexpr int kRsBN = 128;     // weight rows per CTA (wgmma M side)
constexpr int kRsBM = 256;     // activation rows per CTA (wgmma N side)
constexpr int kRsStages = 5;   // cp.async ring; tiles are requested kRsStages - 2 k steps ahead
static_assert(kRsStages >= 3, "the ring needs the tile in use, the one in flight and one being refilled");
static_assert(kRsBN == 2 * 64, "2 warpgroups x m64 weight rows");
static_assert(kRsBM * 8 % kWgThreads == 0, "whole 16-byte activation chunks per thread");
static_assert(kRsBN * 2 == kWgThreads, "one 16-byte weight-code chunk per thread");
constexpr int kRsAct = kRsBM * kSwRow;                         // 32 KB swizzled bf16 activation tile
constexpr int kRsWCodes = kRsBN * 32;                          // 4 KB codes (64 K = 32 bytes per weight row)
constexpr int kRsWScales = kRsBN * 4;                          // 512 B scale bytes
constexpr int kRsStage = (kRsAct + kRsWCodes + kRsWScales + 1023) / 1024 * 1024;
constexpr int kRsSmem = 1024 + kRsStages * kRsStage;          // + 1 KB for 1024-byte alignment
static_assert(kRsAct % 1024 == 0, "the swizzled activation tile must stay 1024-byte aligned");
static_assert(kRsSmem <= 227 * 1024 - 8 * 1024, "ring + static shared memory must fit one CTA per SM");

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// d[0..127] += A(registers a[0..3]: 64 x 16 fragment) * B(desc_b: 256 x 16, K-major, 128B swizzle)^T.
__device__ __forceinline__ void wgmma_m64n256k16_bf16_rs(float d[128], const uint32_t a[4], uint64_t desc_b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " TRACE_EXT_WGMMA_ACC128_REGS
      ", {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n"
      "}\n"
      : TRACE_EXT_WGMMA_ACC128(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
#endif
}

// Four E4M3 scale bytes (one word) -> out[h] = bf16x2 of (s_2h, s_2h+1) * 2^119 (each half bit-identical to
// scale_bf16x2_folded for every non-NaN byte; NaN stays NaN): two bytes per fp8x2 -> f16x2 conversion; s * 2^119 has
// at most 4 significant bits, so its bf16 is the upper half of the fp32 product (one prmt packs two scales).
__device__ __forceinline__ void scales4_bf16x2_pairs(uint32_t w, uint32_t out[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w >> (16 * h)), __NV_E4M3);
    const float f0 = __fmul_rn(__half2float(__ushort_as_half(r.x)), kScaleFold);  // byte 2h
    const float f1 = __fmul_rn(__half2float(__ushort_as_half(r.y)), kScaleFold);  // byte 2h + 1
    out[h] = __byte_perm(__float_as_uint(f0), __float_as_uint(f1), 0x7632);
  }
}

// a * (half `hsel` of s broadcast to both halves) on bf16x2, exact for our operands as bf16x2_mul; the broadcast
// is an operand selector of the multiply, not an instruction.
__device__ __forceinline__ uint32_t bf16x2_mul_bcast(uint32_t a, uint32_t s, int hsel) {
  const __nv_bfloat162 sv = *reinterpret_cast<const __nv_bfloat162*>(&s);
  const __nv_bfloat162 b = hsel ? __high2bfloat162(sv) : __low2bfloat162(sv);
  return bf16x2_mul(a, *reinterpret_cast<const uint32_t*>(&b));
}

// Byte offset of 16-byte chunk c (0 / 1) of weight row r in a stage's code area: the chunk index is XORed with
// bit 2 of the row so that the 8 rows one LDS.128 of a warp reads (rows g, 32-byte stride) hit distinct banks.
__device__ __forceinline__ int rs_code_off(int r, int c) { return r * 32 + ((c ^ ((r >> 2) & 1)) << 4); }

// The wgmma A fragments of one k step (64 K = 4 x k16) for weight rows r0 and r0 + 8 of the stage: fr[4j + b] is
// register b of k16 step j: b = 0: (r0, k 2t..2t+1), 1: (r0 + 8, k 2t..), 2: (r0, k 2t+8..), 3: (r0 + 8, k 2t+8..),
// each bf16x2 q * s * 2^-7 (exact, as in dequant32_to_swizzled). Element k of a row is nibble k & 1 of code byte
// k / 2, so register b of step j comes from byte t of code word 2j (b = 0, 1) or 2j + 1 (b = 2, 3).
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void sts16(uint32_t addr, unsigned short v) {
  asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr), "h"(v) : "memory");
}
// cp.async with a shared-window address (no generic -> shared conversion per copy).
__device__ __forceinline__ void cp_async16_s(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async16_s(uint32_t dst, const void* src, uint32_t src_bytes) {  // zero-fills
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async4_s(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// ca0 / ca1: shared addresses of code chunks 0 / 1 of row r0 in the stage (those of row r0 + 8 are 256 bytes
// further: rows r0 and r0 + 8 share bit 2); sc: address of row r0's 4 scale bytes (row r0 + 8: 32 bytes further).
__device__ __forceinline__ void rs_fragments(uint32_t ca0, uint32_t ca1, uint32_t sc, int t, uint32_t fr[16]) {
  const uint4 a0 = lds128(ca0);
  const uint4 a1 = lds128(ca1);
  const uint4 b0 = lds128(ca0 + 8 * 32);
  const uint4 b1 = lds128(ca1 + 8 * 32);
  const uint32_t sa = lds32(sc);
  const uint32_t sb = lds32(sc + 8 * 4);
  const uint32_t wa[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
  const uint32_t wb[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
  const uint32_t sel = (uint32_t)t | ((uint32_t)(4 + t) << 4);  // byte t of the first word, byte t of the second
  uint32_t sca[2], scb[2];
  scales4_bf16x2_pairs(sa, sca);
  scales4_bf16x2_pairs(sb, scb);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t sc_a = sca[j >> 1], sc_b = scb[j >> 1];
    // x bytes: (r0, k 2t..2t+1), (r0 + 8, same), (r0, k 2t+8..2t+9), (r0 + 8, same)
    const uint32_t x = prmt(prmt(wa[2 * j], wb[2 * j], sel), prmt(wa[2 * j + 1], wb[2 * j + 1], sel), 0x5410u);
    const uint32_t lo = x & 0x0F0F0F0Fu;
    const uint32_t hi = (x >> 4) & 0x0F0F0F0Fu;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      // bytes (lo nibble of byte b, 0, hi nibble of byte b, 0): selector bit 3 replicates the (clear) sign bit of
      // a nibble byte, so the odd bytes come out zero without a mask
      const uint32_t q = prmt(lo, hi, (uint32_t)(b | ((8 | b) << 4) | ((4 + b) << 8) | ((12 + b) << 12)));
      fr[4 * j + b] = bf16x2_mul_bcast((q * 4160u) & 0x81C081C0u, (b & 1) ? sc_b : sc_a, j & 1);  // 4160: 2^12 + 2^6
    }
  }
}

// Stream-K schedule of the dense RS launch (see the design note): the tiles * KT k steps of the problem, tile
// T = n_tile * m_tiles + m_tile (the activation-row tiles of one weight tile consecutive), are cut into `ctas`
// contiguous ranges of floor or ceil(tiles * KT / ctas) steps, range c to CTA c. ctas <= tiles, so every range spans
// at least KT steps and a tile is shared by at most two CTAs: the tile split at the start of range c is begun by
// CTA c - 1 (k steps [0, x), the end of its range), which hands its fp32 accumulator over in slot c of `partials`
// and then sets flags[c]; CTA c continues that accumulator over [x, KT) and writes Y.
struct RsStreamK {
  float* partials;  // [ctas][kRsSlot] fp32 accumulators handed over (slot 0 unused)
  int* flags;       // [ctas], zero at launch; flags[c] = 1 once slot c is complete
  int64_t total;    // tiles * KT
  int m_tiles;      // activation-row tiles, ceil(M / kRsBM)
  int ctas;         // grid size
};
constexpr int kRsSlot = kRsBN * kRsBM;  // one CTA accumulator: 128 fp32 per thread
static_assert(kRsSlot == kWgThreads * 128, "a hand-off slot holds exactly the accumulators of one CTA");

__device__ __forceinline__ void wait_flag_acquire(const int* f) {
  int v;
  for (;;) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(f) : "memory");
    if (v != 0) break;
    __nanosleep(128);
  }
}
__device__ __forceinline__ void set_flag_release(int* f) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(f), "r"(1) : "memory");
}

// d[0..3] = *src (global, L2 only) when pred != 0, else zeros; one asm statement, so that no branch or select
// defines the accumulator registers.
__device__ __forceinline__ void ld_cg_or_zero(float d[4], const float4* src, uint32_t pred) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %5, 0;\n"
      "mov.b32 %0, 0;\n"
      "mov.b32 %1, 0;\n"
      "mov.b32 %2, 0;\n"
      "mov.b32 %3, 0;\n"
      "@p ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];\n"
      "}\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "l"(src), "r"(pred)
      : "memory");
}

// One output tile of the RS kernel: weight rows n0 .. n0 + kRsBN - 1 of expert e, activation rows [m_begin, m_end),
// k steps [kb, ke). The accumulator starts at zero or, when carry_in != nullptr, at the fp32 accumulator of k steps
// [0, kb) handed over by another CTA (the same values the unsplit loop holds at that point: the per-element fp32
// accumulation order is the unsplit one). It ends in Y or, when carry_out() != nullptr, is handed over unchanged
// (carry_out is evaluated after the k loop, so that the stream-K kernel keeps nothing of its job live across it).
// On entry every ring slot is free (the caller's barrier); on exit the ring is drained (cp.async.wait_group 0) but
// may still be read by other threads (epilogue copy-out): the caller syncs before the next tile.
template <bool kCarryIn, class CarryOut>
__device__ __forceinline__ void rs_tile(const GemmParams& p, uint8_t* ring, int e, int m_begin, int m_end, int n0,
                                        int kb, int ke, const float* carry_in, CarryOut carry_out) {
  const int K = p.K;
  const int KT = ke - kb;  // k steps of this call; the copy plan below starts at k step kb
  const int tid = threadIdx.x;
  const int wg = tid >> 7, warp_in_wg = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int r0 = wg * 64 + warp_in_wg * 16 + g;  // this thread's weight rows in the tile: r0 and r0 + 8

  // ---- per-thread copy plan, set up once; every k step only advances three global pointers and the two ring
  // slots (shared-window addresses, so that no copy or fragment load goes through a generic pointer).
  // Activation: thread copies chunk (tid & 7) of rows (tid >> 3) + 32 it, it = 0..7 (8 threads per 128-byte row:
  // coalesced), to the 128B-swizzled B tile; rows >= m_end (only in the last tile of an expert / of M) are
  // zero-filled.
  const int arow = tid >> 3, achunk = tid & 7;
  const uint8_t* a_ptr =
      reinterpret_cast<const uint8_t*>(p.a) + ((int64_t)(m_begin + arow) * K + kb * kWgBK + achunk * 8) * 2;
  const int64_t a_rows32 = (int64_t)32 * K * 2;  // bytes between the rows of consecutive `it`
  const uint32_t a_dst = (uint32_t)(arow * kSwRow + ((achunk ^ (arow & 7)) << 4));  // + it * 32 rows
  const int a_valid = m_end - m_begin - arow;  // row it is in range while 32 it < a_valid
  const bool a_full = m_end - m_begin >= kRsBM;  // CTA-uniform: no per-row checks
  // Weight codes: 16-byte chunk (tid & 1) of row (tid >> 1); scale word of row tid (tid < kRsBN). Rows >= N read
  // row 0 with 0 source bytes (zero fill), so the pointers stay in bounds as they advance.
  const int wrow = tid >> 1;
  const bool w_ok = n0 + wrow < p.N;
  const uint8_t* w_ptr =
      p.w_codes + ((int64_t)e * p.N + (w_ok ? n0 + wrow : 0)) * (K / 2) + kb * (kWgBK / 2) + (tid & 1) * 16;
  const uint32_t w_bytes = w_ok ? 16u : 0u;
  const uint32_t w_dst = (uint32_t)(kRsAct + rs_code_off(wrow, tid & 1));
  const bool s_ok = n0 + tid < p.N;
  const uint8_t* s_ptr = p.w_scales + ((int64_t)e * p.N + (s_ok ? n0 + tid : 0)) * (K / 16) + kb * (kWgBK / 16);
  const uint32_t s_bytes = s_ok ? 4u : 0u;
  const uint32_t s_dst = (uint32_t)(kRsAct + kRsWCodes + tid * 4);
  // Fragment reads of this thread (offsets inside a stage), see rs_fragments.
  const uint32_t f_c0 = (uint32_t)(kRsAct + rs_code_off(r0, 0)), f_c1 = (uint32_t)(kRsAct + rs_code_off(r0, 1));
  const uint32_t f_sc = (uint32_t)(kRsAct + kRsWCodes + r0 * 4);

  const uint32_t ring_lo = smem_u32(ring), ring_hi = ring_lo + kRsStages * kRsStage;
  // Copies one k step into the slot at `st` and advances the pointers to the next k step.
  auto load = [&](uint32_t st) {
    if (a_full) {
      const uint8_t* q = a_ptr;
#pragma unroll
      for (int it = 0; it < kRsBM / 32; ++it, q += a_rows32) cp_async16_s(st + a_dst + it * 32 * kSwRow, q);
    } else {
      const uint8_t* q = a_ptr;
#pragma unroll
      for (int it = 0; it < kRsBM / 32; ++it, q += a_rows32) {
        const bool ok = 32 * it < a_valid;
        cp_async16_s(st + a_dst + it * 32 * kSwRow, ok ? (const void*)q : p.a, ok ? 16u : 0u);
      }
    }
    cp_async16_s(st + w_dst, w_ptr, w_bytes);
    if (tid < kRsBN) cp_async4_s(st + s_dst, s_ptr, s_bytes);
    a_ptr += kWgBK * 2;
    w_ptr += kWgBK / 2;
    s_ptr += kWgBK / 16;
  };
  auto next_slot = [&](uint32_t s) { return s + kRsStage == ring_hi ? ring_lo : s + kRsStage; };

  float acc[128];
  if constexpr (!kCarryIn) {
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    fence_acc(acc, 128);
  }

  uint32_t rd = ring_lo, wr = ring_lo;  // slot of the step being computed / of the next refill
#pragma unroll
  for (int s = 0; s < kRsStages - 2; ++s) {
    if (s < KT) load(wr);
    cp_async_commit();
    wr += kRsStage;
  }

  if constexpr (kCarryIn) {
    // Stream-K: the handed-over accumulator when carry_in != nullptr, else zeros; loaded after the first copies are
    // requested, so that it arrives while they are in flight. Thread tid's acc[4 i .. 4 i + 3] is float4
    // i * kWgThreads + tid of the slot (coalesced). Predicated loads, no branch: ptxas serializes the wgmma
    // pipeline when the accumulators are defined on two control paths.
    const float4* src = reinterpret_cast<const float4*>(carry_in) + tid;
    const uint32_t carry = carry_in != nullptr;
#pragma unroll
    for (int i = 0; i < 32; ++i) ld_cg_or_zero(acc + 4 * i, src + i * kWgThreads, carry);
    fence_acc(acc, 128);
  }

  // One barrier per k step. At the barrier of step kt every thread has passed wgmma.wait_group 1 of step kt - 1,
  // so the wgmmas of step kt - 2 are complete and their slot (that of step kt + kRsStages - 2) can be refilled
  // (issued right after the wgmmas of step kt).
  // The fragments of step kt are converted while the wgmmas of step kt - 1 run; they live in one of two register
  // sets (the other one is still read by the wgmmas of step kt - 1), hence the 2-way unrolled loop.
  auto step = [&](int kt, uint32_t (&fr)[16]) {
    cp_async_wait<kRsStages - 3>();
    fence_proxy_async();
    __syncthreads();
    rs_fragments(rd + f_c0, rd + f_c1, rd + f_sc, t, fr);
    // pin the conversion before the wgmmas: an instruction defining a fragment register between two wgmmas of
    // the batch makes ptxas serialize the whole wgmma pipeline
#pragma unroll
    for (int i = 0; i < 16; ++i) asm volatile("" : "+r"(fr[i])::"memory");
    const uint64_t desc = sw128_desc(rd);  // K advances 32 bytes (2 in the descriptor's start field) per k16
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kWgBK / 16; ++ks) wgmma_m64n256k16_bf16_rs(acc, fr + 4 * ks, desc + 2 * ks);
    wgmma_commit();
    // the refill is issued after the wgmmas: it is needed 3 steps later, the wgmmas now
    if (kt + kRsStages - 2 < KT) load(wr);
    cp_async_commit();
    wgmma_wait<1>();
    rd = next_slot(rd);
    wr = next_slot(wr);
  };
  uint32_t fr0[16], fr1[16];
  int kt = 0;
  for (; kt + 1 < KT; kt += 2) {
    step(kt, fr0);
    step(kt + 1, fr1);
  }
  if (kt < KT) step(kt, fr0);
  wgmma_wait<0>();
  fence_acc(acc, 128);
  cp_async_wait<0>();
  if (float* out = carry_out()) {  // hand the accumulator over as it is (same layout as the carry_in load)
    float4* dst = reinterpret_cast<float4*>(out) + tid;
#pragma unroll
    for (int i = 0; i < 32; ++i)
      __stcg(dst + i * kWgThreads, make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]));
    return;
  }

  // ---- epilogue: acc[4c + 2h + u] = Y[m_begin + 8c + 2t + u][n0 + r0 + 8h], scaled by fold * g_a[m] * g_w[n]
  // (fold * g_w folded once per thread: fold is a power of two, so acc * (g_a * (fold * g_w)) has the same bits as
  // (acc * fold) * (g_a * g_w)), rounded to bf16 and stored as single bf16 values into a 256 x 128 staging tile in
  // the (now idle) ring: row m = 256 bytes, 16-byte chunk q of a row stored at q ^ (m & 7), so one store of a warp
  // (4 rows 2t + u, 8 adjacent columns g) hits 4 distinct 16-byte bank groups; the four store addresses of a
  // thread (u, h) are fixed, c adds 8 rows (an immediate). Then every thread copies whole 16-byte chunks to Y.
  __syncthreads();  // both warpgroups' wgmmas (wait_group 0) and fragment reads are done with the ring
  const float fold = p.g_a != nullptr ? kUnfoldW4A4 : kUnfoldW4A16;  // W4A4: the activation carries 2^-7 too
  const float* gw = p.g_w + (int64_t)e * p.gw_stride_e;
  float gwf[2];
  uint32_t ya[2][2];
  const uint32_t ys = ring_lo;  // [kRsBM][kRsBN] bf16
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int n = n0 + r0 + 8 * h;
    gwf[h] = __fmul_rn(fold, gw[(int64_t)(n < p.N ? n : p.N - 1) * p.gw_stride_n]);
#pragma unroll
    for (int u = 0; u < 2; ++u)
      ya[u][h] = ys + (2 * t + u) * (kRsBN * 2) + ((((r0 >> 3) + h) ^ (2 * t + u)) << 4) + g * 2;
  }
  auto stage_out = [&](auto with_ga) {
#pragma unroll
    for (int c = 0; c < kRsBM / 8; ++c) {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        float ga = 1.0f;
        if constexpr (decltype(with_ga)::value) {
          const int m = m_begin + 8 * c + 2 * t + u;
          ga = m < m_end ? p.g_a[m] : 1.0f;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float sc = decltype(with_ga)::value ? __fmul_rn(ga, gwf[h]) : gwf[h];
          const __nv_bfloat16 v = __float2bfloat16_rn(__fmul_rn(acc[4 * c + 2 * h + u], sc));
          sts16(ya[u][h] + c * 8 * (kRsBN * 2), __bfloat16_as_ushort(v));
        }
      }
    }
  };
  if (p.g_a != nullptr) stage_out(std::true_type{});
  else stage_out(std::false_type{});
  __syncthreads();
  const bool vec_ok = (p.N & 7) == 0;  // rows of Y 16-byte aligned (the base is)
#pragma unroll 4
  for (int i = 0; i < kRsBM * kRsBN / 8 / kWgThreads; ++i) {
    const int idx = tid + i * kWgThreads;
    const int ml = idx >> 4, q = idx & 15;  // kRsBN / 8 == 16 chunks per row
    const int m = m_begin + ml, n = n0 + 8 * q;
    if (m >= m_end || n >= p.N) continue;
    const uint4 v = lds128(ys + ml * (kRsBN * 2) + ((q ^ (ml & 7)) << 4));
    __nv_bfloat16* dst = p.y + (int64_t)m * p.N + n;
    if (vec_ok && n + 8 <= p.N) {
      *reinterpret_cast<uint4*>(dst) = v;
    } else {
      const uint32_t w4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (n + j < p.N) dst[j] = __ushort_as_bfloat16((unsigned short)(w4[j >> 1] >> (16 * (j & 1))));
    }
  }
}

// Data-parallel launch: one CTA per output tile (grid x: weight tiles, so that concurrently running CTAs share the
// activation tile in L2; grid y: activation-row tiles, grouped: numbered across experts).
__global__ void __launch_bounds__(kWgThreads, 1) gemm_w4_wgmma_rs_kernel(const GemmParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  __shared__ int s_tile[3];
  __shared__ int s_off[kMaxExperts + 1];
  uint8_t* ring = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));

  load_group_tile<kWgThreads>(p, kRsBM, s_off, s_tile);
  const int e = s_tile[0], m_begin = s_tile[1], m_end = s_tile[2];
  if (e < 0 || m_begin >= m_end) return;
  rs_tile<false>(p, ring, e, m_begin, m_end, blockIdx.x * kRsBN, 0, p.K / kWgBK, nullptr,
                 [] { return (float*)nullptr; });
#endif
}

// Job j of stream-K CTA c (see gemm_w4_wgmma_rs_sk_kernel); false when the CTA has no job j.
struct SkJob {
  int64_t tile;
  int kb, ke;
  bool head, tail;  // hands its accumulator over to CTA c + 1 / continues the one of CTA c - 1
};
__device__ __forceinline__ bool sk_job(const RsStreamK& sk, int KT, int c, int j, SkJob& jb) {
  const int64_t s = (int64_t)c * sk.total / sk.ctas, e = (int64_t)(c + 1) * sk.total / sk.ctas;
  const int head = (int)(e % KT);  // head: k steps [0, head) of tile e / KT (0: the range ends on a tile edge)
  const int tail = (int)(s % KT);  // tail: k steps [tail, KT) of tile s / KT (0: the range starts on a tile edge)
  const int64_t whole0 = (s + KT - 1) / KT, whole1 = e / KT;  // whole tiles [whole0, whole1)
  const int64_t w = (int64_t)j - (head != 0);
  jb.head = w < 0;
  jb.tail = !jb.head && whole0 + w >= whole1;
  jb.tile = jb.head ? whole1 : jb.tail ? s / KT : whole0 + w;
  jb.kb = jb.tail ? tail : 0;
  jb.ke = jb.head ? head : KT;
  return jb.head || whole0 + w < whole1 || (whole0 + w == whole1 && tail != 0);
}
// blockIdx.x through an opaque read: the job fields are recomputed from it after the k loop instead of being kept in
// registers across it (the RS k loop uses all 255 registers).
__device__ __forceinline__ int cta_x_opaque() {
  int v;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(v));
  return v;
}

// Stream-K launch (dense): CTA c computes the k-step range c of RsStreamK as jobs, in this order: the head (k steps
// [0, x) of the tile split at the end of the range; handed over to CTA c + 1), the whole tiles in between, the tail
// (k steps [y, KT) of the tile split at the start of the range; continues CTA c - 1's head). The head comes first
// so that its hand-off is ready long before CTA c + 1 reaches its tail (which comes last): CTA c - 1 finishes its
// head after y steps, CTA c starts its tail after (range - (KT - y)) >= y steps, as range >= KT.
__global__ void __launch_bounds__(kWgThreads, 1) gemm_w4_wgmma_rs_sk_kernel(const GemmParams p, const RsStreamK sk) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* ring = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int KT = p.K / kWgBK;
  for (int j = 0;; ++j) {
    SkJob jb;
    const int c = cta_x_opaque();
    if (!sk_job(sk, KT, c, j, jb)) break;
    if (jb.tail) {
      if (threadIdx.x == 0) wait_flag_acquire(sk.flags + c);
      __syncthreads();  // CTA c - 1's hand-off is visible to every thread (acquire by thread 0, then the barrier)
    }
    const int m_begin = (int)(jb.tile % sk.m_tiles) * kRsBM;
    const int n0 = (int)(jb.tile / sk.m_tiles) * kRsBN;
    rs_tile<true>(p, ring, 0, m_begin, min(p.M, m_begin + kRsBM), n0, jb.kb, jb.ke,
            jb.tail ? sk.partials + (int64_t)c * kRsSlot : nullptr, [&] {
              SkJob again;
              const int c2 = cta_x_opaque();
              sk_job(sk, KT, c2, j, again);
              return again.head ? sk.partials + (int64_t)(c2 + 1) * kRsSlot : (float*)nullptr;
            });
    const bool handed = j == 0 && (int)(((int64_t)(cta_x_opaque() + 1) * sk.total / sk.ctas) % KT) != 0;
    if (handed) __threadfence();
    __syncthreads();  // the ring is free for the next job (epilogue staging read, last fragments read)
    if (handed && threadIdx.x == 0) set_flag_release(sk.flags + cta_x_opaque() + 1);  // after every thread's stores
  }
#endif
}

}  // namespace gemm_w4
}  // namespace trace_ext
