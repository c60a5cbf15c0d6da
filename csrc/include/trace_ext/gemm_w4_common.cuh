// Shared pieces of the NVFP4-weight GEMM kernels (gemm_w4_{,decode_,wgmma_}sm90.cu): the flat params
// struct, the exact FP4 -> bf16 register conversion, cp.async / ldmatrix / mma wrappers and the grouped tile
// lookup. See the design note of gemm_w4_sm90.cu for the numerics of the conversion.
#pragma once

#include <ATen/ATen.h>
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "trace_ext/fp4_numerics.cuh"

namespace trace_ext {
namespace gemm_w4 {

constexpr int kMaxExperts = 1024;       // offsets of up to this many experts fit the lookup's shared buffer
constexpr int kMaxDevices = 64;         // per-device caches of one-time launch setup
constexpr float kScaleFold = 0x1p119f;  // block scale * 2^119: exact, and 448 * 2^119 < 2^128 (bf16 max)
constexpr float kUnfoldW4A16 = 0x1p7f;  // q bits read as q * 2^-126; * s * 2^119 = q * s * 2^-7
constexpr float kUnfoldW4A4 = 0x1p14f;  // both operands carry 2^-7

// Flat parameters of every GEMM kernel. Dense: offsets == nullptr, E == 1.
struct GemmParams {
  const void* a;             // bf16 [M, K] (W4A16) or uint8 codes [M, K/2] (W4A4)
  const uint8_t* a_scales;   // uint8 [M, K/16] (W4A4) or nullptr
  const float* g_a;          // float [M] (W4A4) or nullptr
  const uint8_t* w_codes;    // uint8 [E, N, K/2]
  const uint8_t* w_scales;   // uint8 [E, N, K/16]
  const uint8_t* w_packed;   // decode layout from prepare (see gemm_w4_decode_sm90.cu) or nullptr
  const float* g_w;          // g_w[e * gw_stride_e + n * gw_stride_n]
  int64_t gw_stride_e;
  int64_t gw_stride_n;
  const int* offsets;        // int32 [E + 1] (grouped) or nullptr
  __nv_bfloat16* y;          // bf16 [M, N]
  int M, N, K, E;
};

constexpr int kDecodeMaxRows = 32;         // dense: M at most this -> decode kernel (when the weight is prepared)
constexpr int kDecodeMaxRowsGrouped = 16;  // grouped: average rows per expert at most this -> decode kernel

// Host-side dispatch targets (each defined in its own translation unit).
void run_tiled(const GemmParams& p, int64_t rows_hint, cudaStream_t stream);
bool decode_supported(const GemmParams& p);
void run_decode(const GemmParams& p, int64_t rows_hint, const at::Tensor& like, cudaStream_t stream);
constexpr int kWgmmaMinRows = 256;  // rows (per expert on average, grouped) from which the wgmma kernel runs
bool wgmma_supported(const GemmParams& p);
void run_wgmma(const GemmParams& p, cudaStream_t stream);

// ---- exact FP4 -> bf16 ------------------------------------------------------------------------------------
// One packed byte (element 2i low nibble, 2i+1 high) -> bf16x2 (low half = element 2i) with values q * 2^-126.
__device__ __forceinline__ uint32_t fp4x2_to_bf16x2_biased(uint32_t byte) {
  const uint32_t x = byte | (byte << 12);
  return ((x & 0x00080008u) << 12) | ((x & 0x00070007u) << 6);
}

// One word of the decode layout (reference_gemm.to_decode_layout) -> bf16x2 of pairs 0..3 (values q * 2^-126),
// reference_gemm.decode_word_pairs (the decode kernels of gemm_w4_decode_sm90.cu and gemm_w4_decode_kslab_sm90.cu).
__device__ __forceinline__ void decode_word(uint32_t q, uint32_t r[4]) {
  constexpr uint32_t kM = 0x81C081C0u;
  r[0] = q & kM;
  r[1] = (q << 3) & kM;
  r[2] = (q << 6) & kM;
  r[3] = ((q << 2) & 0x80008000u) | ((q >> 4) & 0x00C000C0u) | ((q >> 6) & 0x01000100u);
}

// One word of the SECOND packed form (reference_gemm.to_decode_layout2, decode_word_pairs2) -> bf16x2 of pairs
// 0..3: 9 integer ops per 8 elements instead of 11 (pair 3 = two shift classes, one a rotate: SHF.L.W).
__device__ __forceinline__ void decode_word2(uint32_t q, uint32_t r[4]) {
  constexpr uint32_t kM = 0x81C081C0u;
  r[0] = q & kM;
  r[1] = (q << 6) & kM;
  r[2] = __funnelshift_l(q, q, 12) & kM;
  r[3] = ((q << 2) & 0x00400040u) | (__funnelshift_l(q, q, 10) & 0x81808180u);
}

template <bool kForm2>
__device__ __forceinline__ void decode_word_form(uint32_t q, uint32_t r[4]) {
  if constexpr (kForm2) {
    decode_word2(q, r);
  } else {
    decode_word(q, r);
  }
}

// E4M3 scale byte -> bf16x2 of s * 2^119 (exact; NaN byte -> NaN, which then poisons the block as SPEC 2 asks).
__device__ __forceinline__ uint32_t scale_bf16x2_folded(uint8_t s) {
  const float f = __fmul_rn(e4m3_to_float(s), kScaleFold);
  const uint32_t u = __bfloat16_as_ushort(__float2bfloat16_rn(f));
  return u | (u << 16);
}

// a * b on bf16x2, exact for our operands (fma with -0 addend keeps -0 products and subnormals).
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }

// ---- async copies / tensor-core wrappers ----------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(ok ? 8 : 0));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(ok ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void mma_bf16_16816(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// One 64-K step of a 16-row weight block in the decode layout (the stream, pair and K-slab decode kernels): the lane's
// code word wq (rows g and g + 8, one 16-element NVFP4 block each), its two scale bytes (step kk's half of the scale
// word sw) -> bf16 q * s * 2^-7 A fragments, times the activation fragments bq of MT8 8-row groups into acc.
template <int MT8, bool kForm2>
__device__ __forceinline__ void decode_mma_step(uint4 wq, uint32_t sw, int kk, const uint32_t (&bq)[MT8][8],
                                                float (&acc)[MT8][4]) {
  const uint32_t s_lo = scale_bf16x2_folded((uint8_t)((sw >> (16 * (kk & 1))) & 0xFF));
  const uint32_t s_hi = scale_bf16x2_folded((uint8_t)((sw >> (16 * (kk & 1) + 8)) & 0xFF));
  uint32_t rg[8], rh[8];  // rows g and g+8: pairs 0..7 of the 16-element block
  decode_word_form<kForm2>(wq.x, rg);
  decode_word_form<kForm2>(wq.y, rg + 4);
  decode_word_form<kForm2>(wq.z, rh);
  decode_word_form<kForm2>(wq.w, rh + 4);
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
    rg[jj] = bf16x2_mul(rg[jj], s_lo);
    rh[jj] = bf16x2_mul(rh[jj], s_hi);
  }
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    const uint32_t af[4] = {rg[2 * ks], rh[2 * ks], rg[2 * ks + 1], rh[2 * ks + 1]};
#pragma unroll
    for (int i = 0; i < MT8; ++i) {
      const uint32_t bf[2] = {bq[i][2 * ks], bq[i][2 * ks + 1]};
      mma_bf16_16816(acc[i], af, bf);
    }
  }
}

// Stores y[n], y[n+1] (bf16) of one row, guarding the N edge; a 4-byte store when both are in range and aligned.
__device__ __forceinline__ void store_bf16_pair(__nv_bfloat16* ptr, const float v[2], bool both, bool first, int N) {
  if (both && (reinterpret_cast<uintptr_t>(ptr) & 3u) == 0) {
    *reinterpret_cast<__nv_bfloat162*>(ptr) = __floats2bfloat162_rn(v[0], v[1]);
  } else {
    if (first) ptr[0] = __float2bfloat16_rn(v[0]);
    if (both) ptr[1] = __float2bfloat16_rn(v[1]);
  }
}

// Grouped lookup, run by one full warp: offsets (already in shared memory, E + 1 entries) give expert e the rows
// [offsets[e], offsets[e+1]) (clamped to [0, M]); its M tiles of `bm` rows are numbered after those of experts
// < e. Finds the expert owning tile `tile` (e = -1 when the tile is past the last one).
__device__ __forceinline__ void find_group_tile(const int* s_off, int E, int M, int bm, int tile, int* e_out,
                                                int* mb_out, int* me_out) {
  const int lane = threadIdx.x & 31;
  int base = 0;
  *e_out = -1;
  *mb_out = 0;
  *me_out = 0;
  for (int c = 0; c < E; c += 32) {
    const int j = c + lane;
    int lo = 0, hi = 0, cnt = 0;
    if (j < E) {
      lo = min(max(s_off[j], 0), M);
      hi = min(max(s_off[j + 1], lo), M);
      cnt = (hi - lo + bm - 1) / bm;
    }
    int inc = cnt;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, inc, d);
      if (lane >= d) inc += v;
    }
    const int excl = inc - cnt;
    const bool mine = cnt > 0 && tile >= base + excl && tile < base + inc;
    const unsigned ball = __ballot_sync(0xffffffffu, mine);
    if (ball) {
      const int src = __ffs(ball) - 1;
      const int mb = lo + (tile - base - excl) * bm;
      *e_out = __shfl_sync(0xffffffffu, j, src);
      *mb_out = __shfl_sync(0xffffffffu, mb, src);
      *me_out = __shfl_sync(0xffffffffu, hi, src);
      return;
    }
    base += __shfl_sync(0xffffffffu, inc, 31);
  }
}

// CTA prologue of the tiled kernels (kThreads threads): M tile blockIdx.y of `bm` rows -> s_tile[0..2] = expert,
// m_begin, m_end (dense: expert 0; grouped: offsets[0..E] staged in s_off, the tile found by find_group_tile,
// expert -1 past the last tile), visible to the whole CTA on return.
template <int kThreads>
__device__ __forceinline__ void load_group_tile(const GemmParams& p, int bm, int* s_off, int* s_tile) {
  if (p.offsets != nullptr) {
    for (int i = threadIdx.x; i <= p.E; i += kThreads) s_off[i] = p.offsets[i];
    __syncthreads();
  }
  if (threadIdx.x < 32) {
    int e = 0, mb = blockIdx.y * bm, me = p.M;
    if (p.offsets != nullptr) find_group_tile(s_off, p.E, p.M, bm, blockIdx.y, &e, &mb, &me);
    if (threadIdx.x == 0) { s_tile[0] = e; s_tile[1] = mb; s_tile[2] = me; }
  }
  __syncthreads();
}

}  // namespace gemm_w4
}  // namespace trace_ext
