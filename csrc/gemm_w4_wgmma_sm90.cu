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
#include "trace_ext/gemm_w4_wgmma_common.cuh"
#include "trace_ext/gemm_w4_wgmma_rs.cuh"
#include "trace_ext/gemm_w4_wgmma_ss.cuh"
#include "trace_ext/host_checks.h"

namespace trace_ext {
namespace gemm_w4 {

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

// the accumulator operand macros of gemm_w4_wgmma_common.cuh end with this translation unit
#undef TRACE_EXT_WGMMA_ACC128_REGS
#undef TRACE_EXT_WGMMA_ACC128
