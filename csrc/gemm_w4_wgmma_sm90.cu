// Large-M NVFP4-weight GEMM for sm_90a on bf16 wgmma (dense and grouped, W4A16 and W4A4).
//
// Design note. Two kernels; the register-operand (RS) one is the default, TRACE_EXT_WGMMA_IMPL=old selects the
// shared-memory-operand (SS) one for both W4A16 and W4A4 (A/B timing, test coverage).
//
// RS kernel (gemm_w4_wgmma_rs_kernel): computes Y^T = W * A^T so that the weight, which needs conversion, is
// wgmma's A operand taken from registers, and the bf16 activation is the smem B operand.
//  - Why: the SS kernel (H200, M=4096 N=14336 K=4096, Nsight Compute) ran at 36% tensor-pipe / 37% issue use, two
//    warps per scheduler mostly stalled: every k step dequantized 256 x 64 weights per CTA (64 per thread) through a
//    32 KB swizzled smem round trip and a second barrier before the wgmmas could start. RS converts 128 x 64 weights
//    per CTA (32 per thread, for the same 128 x 256 x 64 MMA work) straight into the wgmma fragments: no smem
//    stores, one barrier per k step.
//  - CTA tile 128 weight rows (2 warpgroups x m64) x 256 activation rows (n256) x 64 K; each warpgroup keeps one
//    m64n256 fp32 accumulator (128 registers per thread). Grid x walks the weight tiles so that concurrently running
//    CTAs share the activation tile in L2.
//  - 5-stage cp.async ring (per stage: 32 KB activation tile, 128B-swizzled as in the SS kernel, plus 4.5 KB raw
//    codes and scale bytes), requested 3 k steps ahead: the stage of step kt - 2 is refilled right after the
//    wgmmas of step kt are issued (the barrier of step kt comes after every thread's wgmma.wait_group 1 of step
//    kt - 1), so the copies stay off the path from the barrier to the wgmma issue.
//  - Integer overhead per k step kept small (the first version spent ~420 warp instructions per k step, ~250 of
//    them on address math: IMAD 24% of the mix, 64-bit row products and zero-fill selects recomputed for all 10
//    copies, kt % 5, and the fragment reads as generic LD.E through a 64-bit pointer, the hottest stall line).
//    Now each thread's copy plan is set up once (source pointers advanced by 128 / 32 / 4 bytes per k step, the
//    activation rows of one thread 32 rows apart: one 64-bit add per copy, destinations as immediate offsets),
//    the ring slots are shared-window addresses advanced with a wrap, every shared access (fragment loads, cp.async
//    destinations, epilogue staging) uses ld/st.shared on 32-bit addresses, and only the last tile of an expert / of
//    M takes the per-row zero-fill path (CTA-uniform branch): ~215 warp instructions per k step, ~115 of them the
//    conversion below.
//  - Fragment conversion: thread (warp w, lane 4g + t) of warpgroup wg owns weight rows r0 = 64 wg + 16 w + g and
//    r0 + 8. Per k step it reads both rows' 32 code bytes (4 LDS.128; the two 16-byte chunks of a row are swapped
//    on bit 2 of the row, so the 8 rows a warp reads are bank-conflict free) and 4-byte scale words, gathers byte t
//    of each code word with prmt (k16 step j, register b: word 2j + (b >> 1), row r0 + 8 (b & 1)), and converts
//    each byte with one prmt (sign-replicate selectors give the zero bytes), one integer multiply, one AND and one
//    bf16x2 multiply by s * 2^119 (exact, as below): the 16 A registers of the 4 k16 wgmmas. Scale bytes go two at
//    a time through the fp8x2 -> f16x2 conversion, are folded in fp32 and packed two per register (upper halves:
//    s * 2^119 has at most 4 significant bits, so no rounding); the multiply broadcasts its half with an operand
//    selector (HMUL2 R.H0_H0 / R.H1_H1), no extra instruction.
//  - Overlap: the fragments of step kt are converted while the wgmmas of step kt - 1 run; two register sets (the
//    loop is unrolled by 2 so both stay in registers), pinned before wgmma.fence (ptxas serializes the wgmma
//    pipeline when a fragment register is defined between wgmmas of one batch, or when the two sets meet in one
//    conditional loop body, hence the peeled odd step).
//  - Epilogue: Y = acc * (g_a[m] * (fold * g_w[n])), the same bits as the SS kernel's (acc * fold) * (g_a * g_w)
//    (fold is a power of two); each value goes as one bf16 into a swizzled 256 x 128 staging tile in the idle ring
//    (per thread 4 fixed store addresses + immediates, no shuffles or selects: the first version's pairing
//    shuffle and its selects made the epilogue ~1500 instructions per warp, during which the tensor cores of the
//    SM idle at 1 CTA per SM; now ~650 for W4A16 with the copy-out), then copied to Y in coalesced 16-byte chunks.
//  - W4A4: the NVFP4 activation is first converted to bf16 q * s * 2^-7 (exact; a temporary [M, K], one small
//    elementwise kernel, ~1-2% of the GEMM time at the bench shapes), then the RS kernel runs with the W4A4 fold
//    and g_a in its epilogue: the same exact products and fp32 accumulation as the fused SS path.
//  - Two schedules of the same tile code (rs_tile). Data-parallel (gemm_w4_wgmma_rs_kernel): one CTA per tile.
//    At 1 CTA per SM its last wave is partial: M = 1024, N = 14336 is 448 tiles = 3.39 waves on 132 SMs (the 4th
//    wave 39% full: ~15% of the time with most SMs idle), N = 7168 is 224 tiles = 1.70 waves. Stream-K
//    (gemm_w4_wgmma_rs_sk_kernel, dense only): grid = one CTA per SM; the tiles * KT k steps, tiles ordered with
//    the activation-row tiles of one weight tile consecutive (a CTA's consecutive tiles reuse its weight tile;
//    the activation of the stream-K shapes, M * K * 2 = 8 MB at M = 1024, stays in L2), are cut into equal
//    contiguous ranges, one per CTA, computed as jobs (one rs_tile call each; the ring is drained and a barrier
//    passed between jobs, so every job starts from an empty ring, as a data-parallel CTA does).
//    Numerics: a tile split between CTAs c - 1 (k steps [0, x)) and c ([x, KT)) is not reduced from two partial
//    sums: CTA c - 1 stores its fp32 accumulator registers (128 KB, slot c of a workspace) and CTA c loads them as
//    its initial accumulator and continues the same wgmma sequence, so every output element sees exactly the fp32
//    operations of the unsplit loop: bit-identical to the data-parallel grid, deterministic. Order: a CTA runs its
//    head (the [0, x) part it hands over) first and its tail (the [x, KT) part it continues) last; with ranges of
//    >= KT steps (ctas <= tiles) the hand-off is ready ~(range - KT) steps before it is needed, and no CTA waits
//    on a CTA that waits. Progress needs CTA c - 1 to get an SM while CTA c spins: true when the whole grid is
//    resident at once (grid <= SMs at 1 CTA per SM, the default) or CTAs start in index order. Flags: one int per CTA in the same stream-ordered temporary, zeroed by cudaMemsetAsync before
//    each launch (graph-capturable; concurrent launches on other streams get their own temporary).
//    The host picks stream-K when the data-parallel wave efficiency tiles / (ceil(tiles / SMs) * SMs) < 0.9,
//    tiles >= SMs and K >= 2048 (plan_rs); TRACE_EXT_WGMMA_SCHED=dp|streamk forces one (read per call).
//    The stream-K kernel keeps its job state out of the k loop (recomputed from blockIdx after it) and loads the
//    handed-over accumulator with predicated loads (no branch defining the accumulators, which makes ptxas
//    serialize the wgmma pipeline): 255 registers, no spills, its k loop as short as the data-parallel one's.
//
// SS kernel (gemm_w4_wgmma_kernel, kept as the fallback):
//  - FA3-FP8 pattern without a dedicated producer: CTA tile 128 (M) x 256 (N) x 64 (K), 2 warpgroups, each
//    owning 64 rows as one m64n256k16 wgmma accumulator (128 fp32 registers per thread).
//  - Raw tiles (bf16 A, FP4 codes + scale bytes) arrive by 16-byte cp.async in a 4-stage ring, requested 2 k
//    steps ahead. Every thread dequantizes its share of the FP4 tile(s) of step kt into a 128B-swizzled bf16
//    buffer (double-buffered) while the tensor cores still run the wgmma of step kt - 1 (wgmma is asynchronous:
//    issue, then wait_group 1). 128B swizzle keeps both the 16-byte dequant stores and the wgmma reads
//    bank-conflict free; K advances inside the swizzle atom by moving the descriptor start 32 bytes per k16.
//  - Generic-proxy shared-memory writes (cp.async and the dequant stores) are published to the async proxy with
//    fence.proxy.async before the barrier that precedes the wgmma (both kernels).
//
// Dequantization (exact, as in gemm_w4_sm90.cu): nibbles split into low / high halves, then per element pair one
// byte-permute, one integer multiply (x * (2^12 + 2^6) places the sign at bit 15 and the magnitude at bits 6-8 of
// each bf16 half, no carries because the fields are disjoint) and one AND give q * 2^-126 in bf16x2; one bf16x2
// multiply by s * 2^119 gives q * s * 2^-7.
//
// Compiled only for sm_90a (wgmma); on other targets the kernel bodies are empty and the host never selects them.
// TRACE_EXT_GEMM_WGMMA=0 in the environment disables this path (the mma.sync tiled kernel runs instead).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "trace_ext/fp4_numerics.cuh"
#include "trace_ext/gemm_w4_common.cuh"
#include "trace_ext/host_checks.h"

namespace trace_ext {
namespace gemm_w4 {

constexpr int kWgBM = 128;       // CTA rows (2 warpgroups x m64)
constexpr int kWgBN = 256;       // CTA columns (wgmma n256)
constexpr int kWgBK = 64;        // one 128-byte swizzle row of bf16
constexpr int kWgStages = 4;     // raw-tile ring depth: tiles are requested 2 k steps ahead (see the loop)
static_assert(kWgStages >= 3, "the ring needs the tile in use, the one in flight and one being refilled");
constexpr int kWgThreads = 256;  // 2 warpgroups
constexpr int kSwRow = 128;      // bytes per bf16 row of a swizzled tile
static_assert(kWgBK * 2 == kSwRow, "a k-tile row is exactly one 128B swizzle row");
static_assert(kWgBM == 2 * 64 && kWgBN == kWgThreads, "2 warpgroups x m64; one W row per thread");

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

// K-major, 128B-swizzle wgmma descriptor: start >> 4, LBO 1 (unused), SBO 1024 B (8-row groups), layout B128.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t smem_addr) {
  return (uint64_t)((smem_addr >> 4) & 0x3FFFu) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
         ((uint64_t)1 << 62);
}

__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Keeps the compiler from moving accumulator reads / writes across the asynchronous wgmma.
__device__ __forceinline__ void fence_acc(float* d, int n) {
#pragma unroll
  for (int i = 0; i < n; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The m64n256 fp32 accumulator d[0..127] as asm operands %0 .. %127 ("+f", read and written): the register list
// of the instruction text and the matching constraint list, shared by the SS and RS wgmma forms below.
#define TRACE_EXT_WGMMA_ACC128_REGS \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define TRACE_EXT_WGMMA_ACC128(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), \
    "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
    "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), \
    "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
    "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
    "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), \
    "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), \
    "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), \
    "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), \
    "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), \
    "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), \
    "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), \
    "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), \
    "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), \
    "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), \
    "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), \
    "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

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
#undef TRACE_EXT_WGMMA_ACC128_REGS
#undef TRACE_EXT_WGMMA_ACC128

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

// W4A4 on the RS kernel: the NVFP4 activation [M, K] becomes bf16 q * s * 2^-7 (exact, same conversion as the
// fused paths; g_a stays for the epilogue), 32 elements per thread: one 16-byte code load, two scale bytes, four
// 16-byte stores.
__global__ void __launch_bounds__(256) nvfp4_act_to_bf16_kernel(const uint8_t* __restrict__ codes,
                                                                const uint8_t* __restrict__ scales,
                                                                __nv_bfloat16* __restrict__ out, int64_t n32) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n32) return;
  const uint4 c = *reinterpret_cast<const uint4*>(codes + i * 16);
  const uint32_t s0 = scale_bf16x2_folded(scales[2 * i]), s1 = scale_bf16x2_folded(scales[2 * i + 1]);
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
  uint4* dst = reinterpret_cast<uint4*>(out + i * 32);
#pragma unroll
  for (int q = 0; q < 4; ++q) {  // word q: elements 8q .. 8q + 7 of the 32
    const uint32_t lo = w[q] & 0x0F0F0F0Fu;
    const uint32_t hi = (w[q] >> 4) & 0x0F0F0F0Fu;
    uint32_t r[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t x = prmt(lo, hi, (uint32_t)(j | ((8 | j) << 4) | ((4 + j) << 8) | ((12 + j) << 12)));
      r[j] = bf16x2_mul((x * 4160u) & 0x81C081C0u, q < 2 ? s0 : s1);
    }
    dst[q] = make_uint4(r[0], r[1], r[2], r[3]);
  }
}

bool wgmma_supported(const GemmParams& p) {
  static const bool enabled = [] {
    const char* v = std::getenv("TRACE_EXT_GEMM_WGMMA");
    return v == nullptr || v[0] != '0';
  }();
  return enabled && p.K % kWgBK == 0 && p.K > 0;
}

template <bool kAFp4>
void launch_wgmma(const GemmParams& p, cudaStream_t stream) {
  using C = WgCfg<kAFp4>;
  auto kernel = gemm_w4_wgmma_kernel<kAFp4>;
  static bool attr_set[kMaxDevices] = {};  // per template instance and device (the attribute is per device)
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= kMaxDevices || !attr_set[dev]) {
    require_kernel_image(kernel, "fp4_linear (wgmma)");
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
    if (dev < kMaxDevices) attr_set[dev] = true;
  }
  const int m_tiles = (p.M + kWgBM - 1) / kWgBM + (p.offsets != nullptr ? p.E : 0);
  TORCH_CHECK(m_tiles <= 65535, "trace_ext: fp4_linear: M = ", p.M, " needs more row tiles than one launch holds");
  dim3 grid((p.N + kWgBN - 1) / kWgBN, m_tiles);
  kernel<<<grid, kWgThreads, C::kSmem, stream>>>(p);
  check_launch("fp4_linear (wgmma)");
}

template <typename Kernel>
void prepare_rs_kernel(Kernel kernel, bool (&attr_set)[kMaxDevices], int dev, const char* what) {
  if (dev >= kMaxDevices || !attr_set[dev]) {
    require_kernel_image(kernel, what);
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kRsSmem));
    if (dev < kMaxDevices) attr_set[dev] = true;
  }
}

// Scheduler of a dense RS launch. TRACE_EXT_WGMMA_SCHED (read per call): "dp" always one CTA per tile, "streamk"
// the stream-K kernel for every dense shape, unset / "auto" the rule below. TRACE_EXT_WGMMA_SK_CTAS=<n> (read per
// call, tests): n stream-K CTAs instead of one per SM (at most one per SM).
// Rule (auto): stream-K when the data-parallel grid would leave the SMs idle for more than 10% of its waves
// (tiles / (ceil(tiles / SMs) * SMs) < 0.9), there is at least one full wave (tiles >= SMs, so that a tile is
// split between at most two CTAs) and K >= 2048 (a tile of >= 32 k steps amortizes the ~2 extra tile prologues and
// the 128 KB accumulator hand-off per CTA). On the H200 (132 SMs) this picks M = 1024 with N = 14336 (448 tiles,
// 3.39 waves) and N = 7168 (224 tiles, 1.70 waves) of the benchmark, and leaves every other benchmark shape
// (>= 97% wave efficiency) on the data-parallel grid.
struct RsPlan {
  bool stream_k = false;
  int ctas = 0;
  int64_t tiles = 0;
  int m_tiles = 0;
};

RsPlan plan_rs(const GemmParams& p, int dev) {
  RsPlan pl;
  if (p.offsets != nullptr) return pl;  // grouped: tiles depend on the offsets (device data); data-parallel
  const char* mode = std::getenv("TRACE_EXT_WGMMA_SCHED");
  const std::string m = mode != nullptr && mode[0] != '\0' ? std::string(mode) : std::string("auto");
  TORCH_CHECK(m == "auto" || m == "dp" || m == "streamk",
              "trace_ext: TRACE_EXT_WGMMA_SCHED must be auto, dp or streamk, got '", m, "'");
  if (m == "dp") return pl;
  pl.m_tiles = (p.M + kRsBM - 1) / kRsBM;
  pl.tiles = (int64_t)pl.m_tiles * ((p.N + kRsBN - 1) / kRsBN);
  const int sms = sm_count(dev);
  int ctas = sms;
  if (const char* v = std::getenv("TRACE_EXT_WGMMA_SK_CTAS")) {
    const int n = std::atoi(v);
    TORCH_CHECK(n > 0, "trace_ext: TRACE_EXT_WGMMA_SK_CTAS must be a positive integer, got '", v, "'");
    ctas = n;
  }
  // at most one CTA per SM (1 CTA per SM fits): the whole grid is resident at once, so a CTA waiting for a hand-off
  // never holds the SM its producer needs
  pl.ctas = (int)std::min<int64_t>(std::min(ctas, sms), pl.tiles);
  if (m == "streamk") {
    pl.stream_k = pl.ctas > 0;
    return pl;
  }
  const int64_t waves = (pl.tiles + sms - 1) / sms;
  pl.stream_k = pl.tiles >= sms && pl.tiles * 10 < 9 * waves * sms && p.K >= 2048;
  return pl;
}

void launch_wgmma_rs(const GemmParams& p, cudaStream_t stream) {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const RsPlan pl = plan_rs(p, dev);
  if (pl.stream_k) {
    static bool attr_sk[kMaxDevices] = {};
    prepare_rs_kernel(gemm_w4_wgmma_rs_sk_kernel, attr_sk, dev, "fp4_linear (wgmma rs stream-K)");
    // hand-off slots (fp32) and flags in one stream-ordered temporary; only the flags need zeros
    const int64_t slot_bytes = (int64_t)pl.ctas * kRsSlot * 4;
    at::Tensor ws = at::empty({slot_bytes + (int64_t)pl.ctas * 4},
                              at::TensorOptions().dtype(at::kByte).device(at::kCUDA, dev));
    uint8_t* base = ws.data_ptr<uint8_t>();
    RsStreamK sk;
    sk.partials = reinterpret_cast<float*>(base);
    sk.flags = reinterpret_cast<int*>(base + slot_bytes);
    sk.total = pl.tiles * (p.K / kWgBK);
    sk.m_tiles = pl.m_tiles;
    sk.ctas = pl.ctas;
    C10_CUDA_CHECK(cudaMemsetAsync(sk.flags, 0, (size_t)pl.ctas * 4, stream));
    gemm_w4_wgmma_rs_sk_kernel<<<pl.ctas, kWgThreads, kRsSmem, stream>>>(p, sk);
    check_launch("fp4_linear (wgmma rs stream-K)");
    return;
  }
  static bool attr_dp[kMaxDevices] = {};
  prepare_rs_kernel(gemm_w4_wgmma_rs_kernel, attr_dp, dev, "fp4_linear (wgmma rs)");
  const int m_tiles = (p.M + kRsBM - 1) / kRsBM + (p.offsets != nullptr ? p.E : 0);
  TORCH_CHECK(m_tiles <= 65535, "trace_ext: fp4_linear: M = ", p.M, " needs more row tiles than one launch holds");
  dim3 grid((p.N + kRsBN - 1) / kRsBN, m_tiles);
  gemm_w4_wgmma_rs_kernel<<<grid, kWgThreads, kRsSmem, stream>>>(p);
  check_launch("fp4_linear (wgmma rs)");
}

// TRACE_EXT_WGMMA_IMPL=old keeps W4A16 and W4A4 on the shared-memory-operand kernel (A/B timing and tests; read
// once per process).
bool use_rs_kernel() {
  static const bool rs = [] {
    const char* v = std::getenv("TRACE_EXT_WGMMA_IMPL");
    return v == nullptr || std::string(v) != "old";
  }();
  return rs;
}

void run_wgmma(const GemmParams& p, cudaStream_t stream) {
  if (!use_rs_kernel()) {
    if (p.a_scales != nullptr) launch_wgmma<true>(p, stream);
    else launch_wgmma<false>(p, stream);
    return;
  }
  if (p.a_scales == nullptr) {
    launch_wgmma_rs(p, stream);
    return;
  }
  // W4A4: activation to bf16 q * s * 2^-7 in a temporary (stream-ordered caching allocation), then the RS kernel
  // with g_a and the W4A4 fold in its epilogue
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  at::Tensor a16 =
      at::empty({(int64_t)p.M, (int64_t)p.K}, at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA, dev));
  const int64_t n32 = (int64_t)p.M * p.K / 32;  // K % 64 == 0 (wgmma_supported)
  if (n32 > 0) {
    static bool checked[kMaxDevices] = {};
    if (dev >= kMaxDevices || !checked[dev]) {
      require_kernel_image(nvfp4_act_to_bf16_kernel, "fp4_linear (W4A4 activation)");
      if (dev < kMaxDevices) checked[dev] = true;
    }
    nvfp4_act_to_bf16_kernel<<<(unsigned)((n32 + 255) / 256), 256, 0, stream>>>(
        reinterpret_cast<const uint8_t*>(p.a), p.a_scales, reinterpret_cast<__nv_bfloat16*>(a16.data_ptr()), n32);
    check_launch("fp4_linear (W4A4 activation)");
  }
  GemmParams q = p;
  q.a = a16.data_ptr();
  q.a_scales = nullptr;
  launch_wgmma_rs(q, stream);
}

}  // namespace gemm_w4
}  // namespace trace_ext
