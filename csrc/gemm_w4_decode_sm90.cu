// Small-M (decode) NVFP4-weight GEMM for sm_90a: Y[M, N] = A[M, K] @ W[N, K]^T with M <= 32 per expert, dense and
// grouped (MoE), W4A16 and W4A4. Needs the packed weight of trace_ext.ops.prepare_fp4_weight
// (reference_gemm.to_decode_layout); shapes outside it (N % 16, K % 256) use the tiled kernel.
//
// Design note:
//  - Weight-stationary, swapped operands: the weight fills the MMA M side (m16 = 16 weight rows), the few tokens
//    the N side (n8), so an M = 1 decode wastes 7/8 of the tiny B operand instead of 15/16 of the weight tile.
//    mma.sync m16n8k16 bf16 -> fp32.
//  - The MMA's k slots are permuted (sum order is free): lane (g, t) covers elements 16t + 4ks + {0..3} of each
//    64-wide K step, so its 16 weight elements per row are ONE NVFP4 block (one scale per row per step) and its
//    16 activation elements are contiguous (two 16-byte loads of bf16, one 8-byte load of FP4 codes).
//  - Packed layout: per (16-row block, 256-K super-tile) 2304 bytes, 72 per lane (4 x 16 B codes + 8 B scales),
//    blocks nb-major, so the flat tile index j = nb * KT + kt is also the byte order of a dense weight.
//  - Default (dense, sm_90): the K-slab kernel of gemm_w4_decode_kslab_sm90.cu (A staged once per CTA in shared
//    memory; H200 A/B at 7b3e763: 1.08-1.88x the stream kernel on every bench row, W4A16 and W4A4). Shapes it does
//    not take, other archs and TRACE_EXT_DECODE_IMPL=auto: the pair2 kernel below where every resident warp gets
//    >= 2.5 items (decode_prefers_pair, W4A16), else the flat-stream kernel (TRACE_EXT_DECODE_IMPL=stream: the stream
//    kernel for dense calls too). Grouped calls: on sm_90 the grouped K-slab kernel (same file as the dense one),
//    with TRACE_EXT_DECODE_IMPL=stream / auto, on other archs and for shapes it does not take the stream kernel.
//  - Flat per-warp streams. One resident wave (3 CTAs of 8 warps per SM up to 16 rows per unit, 2 for
//    32); the work is units x 16-row blocks x 256-K tiles (dense: one unit; grouped: one unit per (expert with
//    rows, chunk of 8 / 16 / 32 rows), numbered by one block-wide scan of offsets, so empty experts cost nothing);
//    warp w of W streams tiles [T w / W, T (w + 1) / W) of all T tiles: one contiguous byte range per warp (per
//    expert), equal shares (+-1 tile) for any N, K and routing, through its own cp.async ring (4 slots: 3 tiles =
//    6.9 KB ahead per warp, 166 KB per SM; 32 rows: 6 slots, 16 warps). A 16-row block covered by one warp is
//    stored by it; a block shared by several warps gets one fp32 partial per warp, and after its whole stream
//    each warp arrives (one acq_rel atomic per shared block, self-resetting tickets); the last adds the partials
//    in warp order, i.e. K order (deterministic). Why: counters of the ring path at de2a673 (M = 1, 14336 x 4096:
//    896 CTAs of 2 tiles per warp, 25.6 us, DRAM 27.6 %, issue 32 %) showed each warp loading its whole share at
//    once and then waiting a full DRAM latency (no steady-state overlap), 2.26 waves of CTAs, and the split-K
//    epilogue (__threadfence = MEMBAR.SC + ERRBAR + L1 invalidate in every thread, CTA barriers, ticket round
//    trips) among the top stalls; grouped CTAs (one per N tile and expert, 2 tiles per warp) had the same short
//    streams. The stream kernel has no CTA barrier after its prologue, one launch wave and its arrivals at the end.
//  - TRACE_EXT_DECODE_IMPL=pair / pair2 (dense only, N % 32 == 0; read at every call so that one process
//    can time them against the default; pair2 is the default where decode_prefers_pair holds): the flat streams of the default, but each item is a PAIR of adjacent
//    16-row blocks at one 256-K super-tile (2 x 2304 B in one ring slot). Why, from the static SASS of the default
//    stream kernel at <= 8 rows (sm_90a, 80 registers): 416 instructions per 4096-weight tile = 3.25 thread
//    instructions per weight (LOP3 0.88, IMAD 0.50, SHF 0.40, HMUL2 0.50; HMMA 0.12), all 16 MMAs of a tile
//    chained on ONE accumulator, and the activation fragments reloaded for every tile (8 x LDG.128 per lane at
//    8 rows: 4 KB per 2.3 KB of weights, 8 / 16 KB at 16 / 32 rows, K = 4096 of 32 rows = 256 KB, far beyond the L1
//    left beside the rings: the L2 hit rate of 48 % and the LDG stalls), their latency exposed once per tile.
//    The pair item loads each activation fragment once for both blocks (half the activation traffic per weight),
//    runs two independent MMA chains per warp, and halves the per-item bookkeeping: 736 instructions per 8192
//    weights = 2.88 per weight (static, <= 8 rows). pair: 3 CTAs per SM (80 registers, one item = 4.6 KB ahead
//    per warp, 110 KB per SM); pair2: 2 CTAs per SM (<= 128 registers, 2 items ahead) with the bf16 activation
//    fragments of the NEXT item (<= 8 rows) / 64-K step (<= 16 rows) in flight while this one is computed;
//    32 rows: both 2 CTAs, 2 items ahead. CTAs are rounded up to whole rounds over the SMs when fewer than the
//    resident wave (the default's one-warp-per-2-tiles cap leaves 7168 x 4096 unbalanced: 2 CTAs on some SMs,
//    1 on others). Numbers: the same exact products and fp32 MMA sums as the default; only the K split between
//    warps differs, so a few outputs round differently (both within the SPEC 7 bound; deterministic).
//    Not done here: the FP4 expansion is still 11 integer ops per 8 weights (pairs 0-2: 1-2 ops, pair 3: 6); no
//    single-word (nor two-word funnel) re-encoding expands every pair with one shift + one AND (the bf16 bit
//    positions {6,7,8,15} + 16 cannot tile 32 bits by shifts), but one that splits pair 3 into two shift classes
//    (4 ops) is a change of reference_gemm.to_decode_layout (a second packed form), not of this file.
//  - TRACE_EXT_DECODE_IMPL=pair3 / stream2 / auto2 (opt-in, dense; read at every call): the second packed form
//    (reference_gemm.to_decode_layout2, built by prepare_fp4_weight(decode_form2=True); trace_ext.ops.fp4_linear
//    passes it instead of the first for exactly these values): the same bytes per lane, another bit order in each
//    32-bit word, so that decode_word2 expands 8 weights with 9 integer ops instead of 11: pairs 0-2 one shift
//    (or rotate) + AND each, pair 3 two shift classes (shl 2 & 0x00400040 | rotl 10 & 0x81808180). No 4 translates
//    of the bf16 bit set {6, 7, 8, 15} tile Z_16 (one class per pair is impossible), 3 translates + one 2-class
//    split do (12 solutions, all needing a rotate = SHF.L.W). The CPU proof is tests/test_decode_form2_emulation.py.
//    pair3 = pair2's kernel (kForm2), stream2 = the default's stream kernel (kForm2), bit-equal to them;
//    auto2 = pair3 when every resident pair2 warp gets >= 2.5 items (decode_prefers_pair), else stream2 (the
//    default rule of the first form, timed twice). quad3 (<= 16 rows, N % 64 == 0; else pair3):
//    the pair kernel with items of 4 adjacent blocks (kNB = 4): each activation fragment feeds 4 blocks (a quarter
//    of the default's activation loads per weight, half of pair2's), 4 independent MMA chains; its 3 ring slots of
//    9.2 KB per warp (216 KB) leave one CTA of 8 warps per SM (same 147 KB in flight per SM as pair2), registers
//    still capped at 128 (launch bound of 2 CTAs). Static main loop at <= 8 rows (sm_90a, whole item unrolled):
//    pair2 1207 -> pair3 1143 -> quad3 1910 instructions per 8192 / 8192 / 16384 weights (4.71 / 4.46 / 3.73 thread
//    instructions per weight); stream 579 -> stream2 547 per 4096 (4.52 / 4.27).
//  - Earlier paths, removed on 2026-12-01 (their code is in git before that date; numbers in notes/GPU_RESULTS.md):
//    TRACE_EXT_DECODE_IMPL=ring (de2a673: CTAs of 8 warps = warp columns of 16-row blocks x warps splitting K, dense
//    problems split over CTAs with a ticketed fp32 workspace, grouped ones one CTA per (N tile, expert); every warp
//    streamed its super-tiles through its own cp.async ring) and =old (0847752: the same CTAs with the next
//    super-tile's weights in registers: 124-138 registers, DRAM at 16-37 % of peak, latency bound).
//  - Codes are re-encoded offline so FP4 -> bf16 costs 1 AND (pair 0), a shift + AND (pairs 1, 2) and 3 shifts +
//    3 ANDs/ORs (pair 3) per 8 elements; values come out as q * 2^-126 and one bf16x2 multiply by (s * 2^119)
//    gives the exact q * s * 2^-7 (see gemm_w4_sm90.cu).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include "trace_ext/fp4_numerics.cuh"
#include "trace_ext/gemm_w4_common.cuh"
#include "trace_ext/gemm_w4_decode_kslab.h"
#include "trace_ext/gemm_w4_decode_pair.cuh"
#include "trace_ext/gemm_w4_decode_stream.cuh"
#include "trace_ext/gemm_w4_decode_units.cuh"
#include "trace_ext/host_checks.h"

namespace trace_ext {
namespace gemm_w4 {

bool decode_supported(const GemmParams& p) {
  return p.w_packed != nullptr && p.N % 16 == 0 && p.K % kSuperK == 0 && p.K > 0;
}

// Split-K tickets: one int per N tile, reset to zero by the last CTA of each tile, so a buffer is reused by every
// later launch on the same stream without a memset. One buffer per (device, stream): launches on different
// streams never share tickets.
int* ticket_buffer(const at::Tensor& like, cudaStream_t stream, int n) {
  static std::mutex mu;
  // never destroyed: freeing device memory from a static destructor can run after the CUDA runtime is gone
  static auto* buffers = new std::map<std::pair<int, cudaStream_t>, at::Tensor>();
  std::lock_guard<std::mutex> lock(mu);
  at::Tensor& buf = (*buffers)[{like.device().index(), stream}];
  if (!buf.defined() || buf.numel() < n) {
    buf = at::zeros({std::max<int64_t>(n, 4096)}, like.options().dtype(at::kInt));  // on the current stream
  }
  return buf.data_ptr<int>();
}

// Flat-stream launch: one resident wave (kMinBlocks CTAs per SM); the kernel uses at most one warp per 2 tiles
// (grouped: the tile count is only known on the device, from offsets).
template <int MT8, bool kAFp4, int kStages, int kMinBlocks, bool kGrouped, bool kForm2 = false>
void launch_decode_stream(const GemmParams& p, const at::Tensor& like, cudaStream_t stream) {
  auto kernel = gemm_w4_decode_stream_kernel<MT8, kAFp4, kStages, kMinBlocks, kGrouped, kForm2>;
  constexpr int kRing = kDecWarps * kStages * kTileBytes;  // the warps' cp.async rings
  // dense: no other shared memory; grouped: + s_pref[E + 1] (0.5 KB at E = 128) and 32 B of scan sums
  static_assert(kMinBlocks * (kRing + 1024) <= 228 * 1024,
                "decode stream rings of kMinBlocks CTAs (+1 KB driver reserve each) must fit one SM's shared memory");
  constexpr int kSmemMax = kRing + (kGrouped ? ((kMaxExperts + 1) * 4 + 15) / 16 * 16 : 0);
  TORCH_CHECK(!kGrouped || p.E <= kMaxExperts, "trace_ext: decode GEMM takes at most ", kMaxExperts, " experts");
  const int smem = kRing + (kGrouped ? ((p.E + 1) * 4 + 15) / 16 * 16 : 0);
  static bool attr_set[kMaxDevices] = {};
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= kMaxDevices || !attr_set[dev]) {
    require_kernel_image(kernel, "fp4_linear (decode)");
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemMax));
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        (int)cudaSharedmemCarveoutMaxShared));
    if (dev < kMaxDevices) attr_set[dev] = true;
  }
  const int n_blocks = p.N / 16;
  const int64_t Tu = (int64_t)n_blocks * (p.K / kSuperK);
  // units: dense 1; grouped at most one per expert with rows plus one per further 8 * MT8 rows
  const int64_t max_units = kGrouped ? std::min<int64_t>(p.E, p.M) + p.M / (8 * MT8) + 1 : 1;
  TORCH_CHECK(max_units * Tu < (int64_t{1} << 31), "trace_ext: weight too large for the decode GEMM (2^31 tiles)");
  const int64_t warps = std::max<int64_t>(
      1, std::min<int64_t>((int64_t)kMinBlocks * sm_count(dev) * kDecWarps, std::max<int64_t>(1, max_units * Tu / 2)));
  const int ctas = (int)((warps + kDecWarps - 1) / kDecWarps);
  at::Tensor ws = at::empty({warps * 2 * MT8 * 4 * 32}, like.options().dtype(at::kFloat));  // 2 partials / warp
  int* tickets = ticket_buffer(like, stream, (int)(max_units * n_blocks));
  kernel<<<ctas, kDecThreads, smem, stream>>>(p, ws.data_ptr<float>(), tickets, (int)warps);
  check_launch("fp4_linear (decode)");
}

// Pair-stream launch (TRACE_EXT_DECODE_IMPL=pair / pair2, dense): one resident wave.
template <int MT8, bool kAFp4, int kStages, int kMinBlocks, bool kPrefA = false, bool kForm2 = false,
          int kNB = kPairNB>
void launch_decode_pair(const GemmParams& p, const at::Tensor& like, cudaStream_t stream) {
  auto kernel = gemm_w4_decode_pair_kernel<MT8, kAFp4, kStages, kMinBlocks, kPrefA, kForm2, kNB>;
  constexpr int kRing = kDecWarps * kStages * kNB * kTileBytes;  // the warps' cp.async rings
  // resident CTAs per SM: kMinBlocks (the register cap of __launch_bounds__) unless the rings allow fewer (quad3:
  // 3 slots of 4 tiles = 216 KB, one CTA per SM, still capped at 128 registers by kMinBlocks = 2)
  constexpr int kResident = std::min(kMinBlocks, (228 * 1024) / (kRing + 1024));
  static_assert(kResident >= 1 && kRing <= 227 * 1024,
                "decode pair rings (+1 KB driver reserve per CTA) must fit one SM's shared memory");
  static bool attr_set[kMaxDevices] = {};
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= kMaxDevices || !attr_set[dev]) {
    require_kernel_image(kernel, "fp4_linear (decode)");
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kRing));
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        (int)cudaSharedmemCarveoutMaxShared));
    if (dev < kMaxDevices) attr_set[dev] = true;
  }
  const int n_groups = p.N / (16 * kNB);
  const int64_t T = (int64_t)n_groups * (p.K / kSuperK);
  TORCH_CHECK(T < (int64_t{1} << 31), "trace_ext: weight too large for the decode GEMM (2^31 tiles)");
  // about one warp per 2 items, but with whole rounds of CTAs over the SMs when that is less than the resident
  // wave (e.g. M = 1, 7168 x 4096: 3584 items -> 224 CTAs would put 2 CTAs on 92 SMs and 1 on 40; 264 CTAs of
  // 1.7 items per warp put 2 on each), and never more warps than items
  const int64_t sms = sm_count(dev);
  const int64_t cap = (int64_t)kResident * sms;  // resident CTAs
  int64_t ctas = std::min<int64_t>(cap, ((T + 1) / 2 + kDecWarps - 1) / kDecWarps);
  ctas = std::min<int64_t>(cap, (ctas + sms - 1) / sms * sms);
  const int64_t warps = std::max<int64_t>(1, std::min<int64_t>(ctas * kDecWarps, T));
  ctas = (warps + kDecWarps - 1) / kDecWarps;
  at::Tensor ws = at::empty({warps * 2 * kNB * MT8 * 4 * 32}, like.options().dtype(at::kFloat));
  int* tickets = ticket_buffer(like, stream, n_groups);
  kernel<<<(int)ctas, kDecThreads, kRing, stream>>>(p, ws.data_ptr<float>(), tickets, (int)warps);
  check_launch("fp4_linear (decode)");
}

// TRACE_EXT_DECODE_IMPL=pair / pair2 / stream (dense decode only; grouped calls keep the default): read at every
// call, so that one process can time the default and the pair kernels interleaved (1: pair, 2: pair2, -1: stream =
// the flat-stream kernel everywhere; 0: anything else, e.g. auto = the rule decode_prefers_pair). The second packed form (w_packed = reference_gemm.to_decode_layout2, passed
// by trace_ext.ops.fp4_linear for exactly these values, ops/gemm.py DECODE_FORM2_IMPLS): 3: pair3 (pair2's
// kernel), 4: stream2 (the default's stream kernel), 5: auto2 (decode_prefers_pair: pair3 or stream2 by shape),
// 6: quad3 (items of 4 blocks, <= 16 rows and N % 64 == 0; else pair3).
int decode_pair_selected() {
  const char* v = std::getenv("TRACE_EXT_DECODE_IMPL");
  if (v == nullptr) return 0;
  const std::string s = v;
  return s == "pair" ? 1 : s == "pair2" ? 2 : s == "pair3" ? 3 : s == "stream2" ? 4 : s == "auto2" ? 5
       : s == "quad3" ? 6 : s == "stream" ? -1 : 0;
}

// The rule of TRACE_EXT_DECODE_IMPL=auto (the default where the K-slab kernel does not run; auto2 on the second
// packed form), for bf16 activations: the pair2
// kernel when every resident pair2 warp gets >= 2.5 items (14336 x 4096 and 4096 x 14336: 7168 items for 2112
// warps = 3.4), else the stream kernel (7168 x 4096: 3584 items = 1.7 per warp: too few items per warp to fill
// pair2's 2-item ring and to amortize the split-group reduction). Timed twice on the H200 (decode_ab_h200*.md, runs
// at ab46e90 and c7928a5): pair2 1.0-1.34x the stream kernel on the first two shapes at M = 1..32, 0.78-0.95x on the
// third. W4A4 keeps the stream kernel (pair2 is tested there, not timed).
bool decode_prefers_pair(const GemmParams& p) {
  if (p.N % (16 * kPairNB) != 0) return false;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const int64_t items = (int64_t)(p.N / (16 * kPairNB)) * (p.K / kSuperK);
  const int64_t warps = 2LL * sm_count(dev) * kDecWarps;  // pair2: 2 CTAs of 8 warps per SM
  return 2 * items >= 5 * warps;
}

// Default: pair2 for dense W4A16 where decode_prefers_pair holds; else flat per-warp streams (3 tiles = 6.9 KB
// ahead per warp, 24 warps per SM up to 16 rows per unit; 5 tiles ahead, 16 warps per SM for 32 rows), dense and
// grouped.
template <bool kAFp4>
void run_decode_new(const GemmParams& p, int64_t rows_hint, const at::Tensor& like, cudaStream_t stream) {
  if (p.M <= 0) return;
  if (p.offsets != nullptr) {
    // the grouped K-slab kernel (gemm_w4_decode_kslab_sm90.cu): the default on sm_90, or named (kslab-grouped);
    // TRACE_EXT_DECODE_IMPL=stream / auto, other archs and shapes it does not take run the stream kernel below
    if (const int kg = decode_kslab_grouped_selected();
        kg >= 0 && run_decode_kslab_grouped(p, rows_hint, like, stream, kg))
      return;
    // grouped: rows per unit a little above the average rows per expert (rows_hint), as the removed ring path did
    if (rows_hint <= 2) {
      launch_decode_stream<1, kAFp4, 4, 3, true>(p, like, stream);
    } else if (rows_hint <= 8) {
      launch_decode_stream<2, kAFp4, 4, 3, true>(p, like, stream);
    } else {
      launch_decode_stream<4, kAFp4, 6, 2, true>(p, like, stream);
    }
    return;
  }
  TORCH_CHECK(p.M <= 32, "trace_ext: dense decode GEMM takes at most 32 rows");
  // the K-slab kernel (gemm_w4_decode_kslab_sm90.cu): the default on sm_90 (W4A16 and W4A4), or named (kslab2: on
  // the second packed form); shapes it does not take run the stream / pair kernels below
  if (const int ks = decode_kslab_selected(); ks >= 0) {
    if (run_decode_kslab(p, like, stream, ks == 2, ks > 0)) return;
    TORCH_CHECK(ks != 2, "trace_ext: TRACE_EXT_DECODE_IMPL=kslab2 (second packed form) cannot take this shape");
  }
  int pair = decode_pair_selected();
  if (pair == 0 && !kAFp4 && decode_prefers_pair(p)) pair = 2;  // the rule of auto (the default where kslab did not run)
  if (pair >= 3) {
    int dev = 0;
    C10_CUDA_CHECK(cudaGetDevice(&dev));
    const int major = cc_major(dev);
    TORCH_CHECK(major == 9, "trace_ext: TRACE_EXT_DECODE_IMPL=pair3 / stream2 / auto2 / quad3 (second packed form) ",
                "are sm_90a experiments; unset it on this device (compute capability ", major, ".x)");
  }
  if (pair == 6 && p.M <= 16 && p.N % (16 * 4) == 0) {
    // quad3: 4 blocks per item, one CTA of 8 warps per SM (3 ring slots of 9.2 KB per warp), <= 128 registers
    if (p.M <= 8) {
      // no activation prefetch: the next item's 32 registers of fragments spill beside 4 blocks (ptxas 9.0a)
      launch_decode_pair<1, kAFp4, 3, 2, false, true, 4>(p, like, stream);
    } else {
      launch_decode_pair<2, kAFp4, 3, 2, !kAFp4, true, 4>(p, like, stream);
    }
    return;
  }
  if (pair >= 3) {
    // second packed form (opt-in): pair3 = pair2's configurations, stream2 = the default's, auto2 = either
    // (quad3 outside its domain runs pair3)
    const bool use_pair =
        pair == 3 || pair == 6 ? p.N % (16 * kPairNB) == 0 : pair == 5 ? decode_prefers_pair(p) : false;
    if (use_pair) {
      if (p.M <= 8) {
        launch_decode_pair<1, kAFp4, 3, 2, !kAFp4, true>(p, like, stream);
      } else if (p.M <= 16) {
        launch_decode_pair<2, kAFp4, 3, 2, !kAFp4, true>(p, like, stream);
      } else {
        launch_decode_pair<4, kAFp4, 3, 2, false, true>(p, like, stream);
      }
    } else if (p.M <= 8) {
      launch_decode_stream<1, kAFp4, 4, 3, false, true>(p, like, stream);
    } else if (p.M <= 16) {
      launch_decode_stream<2, kAFp4, 4, 3, false, true>(p, like, stream);
    } else {
      launch_decode_stream<4, kAFp4, 6, 2, false, true>(p, like, stream);
    }
    return;
  }
  if (pair > 0 && p.N % (16 * kPairNB) == 0) {
    // opt-in pair streams. pair: 3 CTAs per SM (1 item = 4.6 KB ahead per warp, 80 registers) up to 16 rows;
    // pair2: 2 CTAs per SM (2 items = 9.2 KB ahead per warp, 128 registers), bf16 activation fragments in flight
    // one item (<= 8 rows) / one 64-K step (<= 16 rows) ahead; both: 2 CTAs (2 items ahead) for 32 rows
    if (p.M <= 8) {
      if (pair == 1) {
        launch_decode_pair<1, kAFp4, 2, 3>(p, like, stream);
      } else {
        launch_decode_pair<1, kAFp4, 3, 2, !kAFp4>(p, like, stream);
      }
    } else if (p.M <= 16) {
      if (pair == 1) {
        launch_decode_pair<2, kAFp4, 2, 3>(p, like, stream);
      } else {
        launch_decode_pair<2, kAFp4, 3, 2, !kAFp4>(p, like, stream);
      }
    } else {
      launch_decode_pair<4, kAFp4, 3, 2>(p, like, stream);
    }
    return;
  }
  if (p.M <= 8) {
    launch_decode_stream<1, kAFp4, 4, 3, false>(p, like, stream);
  } else if (p.M <= 16) {
    launch_decode_stream<2, kAFp4, 4, 3, false>(p, like, stream);
  } else {
    launch_decode_stream<4, kAFp4, 6, 2, false>(p, like, stream);
  }
}

void run_decode(const GemmParams& p, int64_t rows_hint, const at::Tensor& like, cudaStream_t stream) {
  const bool a4 = p.a_scales != nullptr;
  if (a4) run_decode_new<true>(p, rows_hint, like, stream); else run_decode_new<false>(p, rows_hint, like, stream);
}

}  // namespace gemm_w4
}  // namespace trace_ext
