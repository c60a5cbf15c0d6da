// Split-KV decode attention over the paged NVFP4 KV cache (SPEC 8), Hopper (sm_90a; the code uses only
// mma.sync / cp.async / cvt.e4m3x2, so the same source also runs on sm_100a).
//
// One query token per sequence, GQA (G = Hq / H_kv query heads per KV head, 1..16), over the whole cached
// length. Output bf16 [B, Hq, D] and the natural-log LSE [B, Hq].
//
// Design (decode is bandwidth-bound: 0.5625 B per cached element, 3.56x less than bf16):
// - Grid (split, kv head, sequence). A CTA owns one KV head of one sequence and a contiguous slice of its
//   tokens, and serves all G query heads of that KV head from one read of K/V: the G heads are the M rows of
//   an m16n8k16 MMA, so the FLOPs of GQA ride on tensor cores (at G = 8 the CUDA-core FMA rate alone would
//   be slower than the memory stream). Splits make batch 1 at 128K fill the GPU; a combine kernel merges the
//   per-split (output, LSE) pairs. Since round 87 it is launched as a programmatic dependent of the decode kernel
//   (griddepcontrol.wait), which hides its launch gap. Before that, the last CTA to finish a (sequence, KV head)
//   combined the pairs in the same launch (arrival counter, threadFenceReduction pattern; =fused keeps it), because the
//   plainly launched combine kernel cost 5.5 us of 74 plus a launch gap at B32 S8K.
// - Split count: the H200 sweeps showed an SM's throughput saturating at 2 resident CTAs and every extra
//   split costing time (5 splits 83 us vs 4 splits 79 us at B32 S8K; 5 vs 1 split 88 vs 76 us at B64 S4K;
//   82 vs 32 splits 94 vs 81 us at B1 S128K), so choose_splits takes the fewest splits whose busiest SM
//   holds no more work than the best split count's (within 5%), instead of filling every CTA slot.
// - Each of the 4 warps runs its own flash-decoding loop over 16-token tiles (tiles w, w+4, ...) with a
//   private 4-stage cp.async pipeline: no CTA barrier in the main loop. Page ids for the next tile are
//   loaded one iteration ahead so the cp.async issue never waits on the block table, and page column / slot
//   advance by constants (no integer division per tile). Any page size works (a tile may straddle pages).
// - Dequantization happens once per tile, from the staged code bytes straight into MMA fragments (no
//   per-fragment global byte loads, which is what made earlier FP4/FP8-KV decode kernels lose to bf16):
//   an E2M1 nibble is turned into the fp16 pattern of q * 2^-14 with two masks and a shift per 4 codes
//   (sign to bit 15, exponent+mantissa to bits 11..9) and a byte permute, then one HMUL2 by the E4M3 block
//   scale (cvt.f16x2.e4m3x2). q * s_b * 2^-14 is exact in fp16 (<= 6 significant bits, a multiple of
//   2^-24), so K and V enter the MMAs exactly; 2^14 and g_k go into the score scale, 2^14 and g_v into the
//   output.
// - Q is scaled per row by a power of two so its amax lands in [2^14, 2^15) and converted to fp16: exact
//   for every element within 2^28 of the row max; the power of two is undone in the score scale.
// - K fragments: the Q.K^T reduction index (head_dim) may be permuted freely as long as Q uses the same
//   permutation, so each thread dequantizes one contiguous quarter row of K (one 16- or 8-byte shared
//   load) and Q is gathered in the matching order. P.V: V is the B operand (k = token, n = head_dim); a
//   thread needs two tokens per register, so two rows' code words are interleaved with a byte permute
//   before the nibble expansion; the n index is again a free permutation of head_dim (each thread owns one
//   16-element scale block of head_dim), undone when the output is written.
// - Shared code tiles use an XOR swizzle on 16-byte chunks, chosen so that both the K reads (whole quarter
//   rows) and the V reads (four tokens 2c, 2c+1, 2c+8, 2c+9 per thread) are bank-conflict free.
// - Measured (H200, first version): 1.3-1.9 TB/s (31-45% of copy). Split sweeps showed a per-CTA cost (the
//   cross-warp combine stored O with a 32-way bank conflict, ~5 us per CTA; now conflict free), and going
//   from 4 to 12 warps per SM raised throughput only 1.3x: the main loop is bound by the integer pipe
//   (nibble expansion ~1.4 LOP/PRMT per element, plus copy addressing), not by memory. Further speedups
//   need fewer integer instructions per element (a cache layout pre-interleaved for the fragments, or the
//   Blackwell cvt.e2m1x2 path on sm_100a).
// - Occupancy: Nsight Compute (B32 Hq32 Hkv4 S8K, 157 registers, 3 CTAs = 12 warps per SM) showed the warps
//   latency-bound rather than pipe-bound: ALU 51%, issue slots 57%, 4.5 cycles per issued instruction per
//   warp, DRAM 44%. The Q fragments (D/4 registers per thread, identical in the 4 warps) therefore live in
//   shared memory behind the cp.async stages ([k-step][lane] uint4: one conflict-free 16-byte load per k-step
//   and tile, feeding both n8 tiles), which brings the kernel to 127 registers and 4 CTAs = 16 warps per SM
//   (the split heuristic only asks the occupancy for >= 2 CTAs per SM). The Q region lies inside
//   the footprint of the cross-warp combine, so the dynamic shared memory per CTA is unchanged.
//   TRACE_EXT_KV_DECODE_IMPL=old selects the register-resident variant for A/B timing (the same arithmetic
//   per split, every MMA chain keeps its k-step order; outputs agree bit for bit at equal num_splits).
// - G <= 8 (every benchmarked model shape: G = 4, 8) runs a swapped-operand kernel (fp4kv_decode_kernel_g8,
//   notes at its definition): tokens and head_dim are the MMA rows and the heads the N = 8 columns, so no MMA
//   row is padding: half the MMAs, D/4 accumulators per thread, Q back in registers, ~100 registers, 5 CTAs
//   per SM. Same code expansion, same score / softmax / output formulas. TRACE_EXT_KV_DECODE_IMPL=qsmem forces
//   the M = 16 kernel above for any G.
// - Measured (H200, 38bcf7f, g8 kernel, 5 splits): B32 S8K 68 us in the kernel + 5.5 us combine, 83 us per
//   call. Nsight: 96 registers, 5 CTAs = 20 warps per SM theoretical, 16 achieved (640 CTAs for 660 slots),
//   issue slots 58%, ALU 56% (top pipe), 6.3 cycles per issued instruction per warp (stalls: fixed-latency
//   dependencies 25%, not selected 20%, pipe throttle 14%, memory 8%), DRAM 47%, L2 64%. Per 16-token tile a
//   warp issues ~560 instructions: ~250 nibble expansion (per 8 codes 7 LOP/SHF, 4 PRMT, 4 HMUL2), 16 HMMA,
//   ~110 cp.async issue + page walk (lane constants rematerialized from the thread id each tile), ~70
//   softmax. But split sweeps give the same time with 8 and 16 warps per SM (2 vs 4 splits: 80 vs 79 us),
//   so a memory-side limit is likely as well: per tile a warp reads 64-byte code rows 256 bytes apart (the
//   other KV heads' CTAs read the rest of each line) and 8-byte scale pieces (one 32-byte sector each), 96
//   sector requests per 2304 bytes. Next steps: the 4 warps of a CTA on 4 KV heads of the same tokens (one
//   contiguous page block per tile, 16-byte scale copies), and fewer loader instructions per tile.
// - That restructure is fp4kv_decode_kernel_heads (the default where it applies since the H200 A/B at 9bba77a:
//   1.06-1.26x over g8, B8 S32K 58%, B1 S128K 50% of copy; TRACE_EXT_KV_DECODE_IMPL=g8 selects the g8 kernel; notes
//   at its definition and in notes/GPU_RESULTS.md): grid (split, H_kv / 4, sequence), warp w = KV head
//   4 hg + w, the CTA copies each 16-token tile as 16-byte pieces of the contiguous 4-head runs (one address per
//   thread per tile, one table load per page) into a shared 4-stage ring, one __syncthreads per tile, no
//   cross-warp merge. SASS (sm_90a, D = 128), static loop body per warp and 16-token tile: 475 instructions vs
//   561 (g8), both including the rarely taken O rescale (58); before a tile's first shared load (copy issue, page
//   walk, stage offsets) 56 vs 139. The nibble
//   expansion is unchanged: per 8 K codes 1 SHF + 2 IMAD.SHL + 4 LOP3 + 4 PRMT + 4 HMUL2 (15; V adds 1 PRMT
//   interleave: 16). No exact cheaper sm_90 sequence was found: sign and magnitude need different shifts, so each
//   fp16 high byte costs a shift and a mask per source plus a merge, and the byte placement needs a zero source
//   (PRMT with 0); a PRMT lookup table needs masked selectors and a separate sign merge (more instructions). The
//   cheaper path is sm_100a's cvt.rn.f16x2.e2m1x2 (1 instruction per 2 codes), which pairs the two nibbles of a
//   byte and so needs Q gathered in that k order.
// - heads8 (opt-in, TRACE_EXT_KV_DECODE_IMPL=heads8, where the heads kernel applies): Nsight Compute of the heads
//   kernel (B32 Hq32 Hkv4 S8K, 8 splits = 256 CTAs = 0.39 waves of its 5 CTAs per SM) showed 1.9 CTAs = 7.5 warps
//   resident per SM, 50% of cycles without an eligible warp, fixed-latency dependencies the top stall, DRAM 46%:
//   latency / issue bound with too few warps, and more splits do not help (8 / 12 / 16 splits: 49 / 49 / 48% of
//   copy: shorter streams, more partial writes). heads8 = fp4kv_decode_kernel_heads<D, 2>: the same grid and split
//   model, 8 warps per CTA, two per KV head (warp sets 0 and 1) on alternate 16-token tiles: a ring stage holds 32
//   tokens (two tiles in the 4-warp layout, back to back), 256 threads copy it (same per-thread copy plan, one
//   __syncthreads per stage), set s computes tile 2 i + s of stage i with the unchanged per-tile code. At the end set
//   1's (m, l, O) is merged into set 0's registers through shared memory (merge_warp_sets: rescale both to the common
//   max, as merge_warps does; set 0 then runs the 4-warp epilogue, and the fused split finish is the same
//   heads_split_finish, so fused == combine kernel bit for bit still holds). So every SM holds 2 x 8 = 16 warps on the
//   same 256-CTA grid (2x the warps, same stream lengths, no extra partials). Budget: __launch_bounds__(256, 2) =
//   128 registers (121 used at D = 128, no spills; the loop body per warp and tile is 476 SASS instructions vs 475),
//   78 KB dynamic shared memory at D = 128 (4 stages x 2 tiles; 2 CTAs = 156 KB of the 228 KB). choose_splits is
//   unchanged: with its cost model every benchmarked case picks a split count with 2 CTAs on the busiest SM (B32 S8K
//   8, B64 S4K 4, B8 S32K 16, B1 S128K 126), i.e. all CTAs resident for both variants; bench/bench_kv_heads_ab.py
//   sweeps the splits of heads8 to check it. Same split bounds as the 4-warp kernel, but a set sums every other tile
//   and the two sets are merged at the end, so heads8 agrees with it to rounding, not bit for bit.
// - Stage ring of heads8: 3 stages (of two 16-token tiles) since the H200 A/B of round 22 (notes/GPU_RESULTS.md):
//   1.01-1.03x over the 4 stages above on all four bench_kv decode cases in both passes, 2 stages 0.98-0.99x; 59 KB
//   of dynamic shared memory at D = 128; same split count and arithmetic, bit-equal (TRACE_EXT_KV_DECODE_RING=4 / 2,
//   read per call, select the others). The K-slab GEMM's 2-slot finding (round 20) carried over only in part: this
//   ring is CTA-wide with one barrier per stage, so 2 stages leave a stage's copies exposed behind every barrier.
// - H_kv = 1 or 2, the KV heads per GPU of tensor-parallel rollouts (Qwen3-30B-A3B at TP 2 / 4, Mixtral-like models at
//   TP 4 / 8), ran the g8 kernel until session 20: the heads kernels need 4 KV heads of one token in a 16-byte-aligned
//   contiguous run. heads8 over folded tokens (heads8_fold, fp4kv_decode_kernel_heads<D, 2, 3, kFold>): 4 / H_kv
//   consecutive tokens of all heads are such a run, so the kernel reads the cache as 4 pseudo KV heads of pseudo tokens
//   (page size P / kFold; the copy plan, the tile step and the swizzle unchanged); pseudo head j * H_kv + h holds
//   tokens kFold t + j of head h, each warp masks at its own last token, and the kFold pseudo heads of a head (both
//   warp sets) are merged in shared memory (merge_fold_states). The splits merge in the separate combine kernel (no
//   fused finish), the wide one past 16 splits. Split model: choose_splits with fold (shorter splits, a second CTA per
//   SM counted only where each split keeps >= 256 pseudo tokens and the splits stay <= the SM count), fitted to the
//   H200 sweeps. H200 (bench/results/kv_tp_splits_h200.md, 28 shapes, B 1-128, S 4K-128K): 1.16x over g8 at the median
//   (0.96-2.22x; B1 S128K 1.5-2.2x, one shape 0.96x), 1.02-2.47x torch SDPA on bf16 K/V; 127 registers, no spills.
// - Measured and reverted (session 20, round 93): the swapped softmax with the raw-score maxima scaled once and each
//   exponent one FFMA (2 instructions and one dependent op fewer per tile): 0.993-1.000x on the four bench_kv cases.
// - Measured and reverted (session 21, round 97): the heads kernels signalling the combine kernel at the end of their
//   main loop (griddepcontrol.launch_dependents): the combine CTAs then start before the decode grid ends, but the
//   decode's loop ran ~5% longer beside them, 0.995-1.00x. Per-CTA timelines of these kernels: tools/probes/timeline.py
//   (marks of trace_ext/timeline.cuh, empty here; notes/NEXT_kv_fixed_cost.md, session 21).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#include "trace_ext/fp4_numerics.cuh"
#include "trace_ext/host_checks.h"
// the kernels, in the order they were written (each file's header says what it holds)
#include "trace_ext/attn_decode_fp4kv_common.cuh"  // constants, parameters, fragment expansion, shared pieces
#include "trace_ext/attn_decode_fp4kv_m16.cuh"     // M = 16 kernel (qsmem / old)
#include "trace_ext/attn_decode_fp4kv_g8.cuh"      // G <= 8 swapped-operand kernel
#include "trace_ext/attn_decode_fp4kv_heads.cuh"   // heads kernels (the default where they apply)
#include "trace_ext/attn_decode_fp4kv_combine.cuh"  // the split combine kernels

namespace trace_ext {
namespace {

// ---- host ------------------------------------------------------------------------------------------------

// TRACE_EXT_KV_DECODE_PDL=0 (read per call; an A/B knob): the combine kernels are launched plainly. Default: as
// programmatic dependents of the decode kernel (pdl.cuh), so that their launch overlaps the decode grid's end; they
// wait for its completion and memory flush with griddepcontrol.wait before they read the partials.
bool combine_pdl() { return env_switch("TRACE_EXT_KV_DECODE_PDL", true); }

// Kernel variants, read per call so that one process can time them all: the heads kernels (4 KV heads per CTA,
// CTA-shared contiguous tile copies) where they apply (G <= 8, H_kv % 4 == 0, 16-byte aligned cache bases): by
// default heads8 (two warps per KV head on alternate tiles, 8 warps per CTA; H200 A/B at 2071576: 1.04-1.08x over the
// 4-warp kernel, bench/results/kv_heads_ab_h200.md; also at H_kv = 1, 2 over folded tokens where the page size is a
// multiple of 4 / H_kv: heads8_fold), TRACE_EXT_KV_DECODE_IMPL=heads the 4-warp kernel (1.06-1.26x over g8; H_kv % 4
// == 0 only); the G <= 8 swapped-operand kernel (default for other G <= 8 shapes; TRACE_EXT_KV_DECODE_IMPL=g8 selects
// it wherever G <= 8), the M = 16 kernel with Q in shared memory (default for G > 8; =qsmem forces it) and with Q in
// registers (=old: the kernel before the occupancy work). Any other value selects the default.
enum DecodeImpl : int { kImplRegQ = 0, kImplSmemQ = 1, kImplSwap = 2, kImplHeads = 3, kImplHeads8 = 4 };
using DecodeKernelFn = void (*)(DecodeParams);

template <int D, int kImpl>
DecodeKernelFn decode_kernel() {
  if constexpr (kImpl == kImplSwap) {
    return fp4kv_decode_kernel_g8<D>;
  } else if constexpr (kImpl == kImplHeads) {
    return fp4kv_decode_kernel_heads<D, 1>;
  } else if constexpr (kImpl == kImplHeads8) {
    return fp4kv_decode_kernel_heads<D, 2, kHeads8Ring>;
  } else {
    return fp4kv_decode_kernel<D, kImpl == kImplSmemQ>;
  }
}

// Dynamic shared memory of a kernel variant.
template <int D, int kImpl>
constexpr int decode_smem() {
  return kImpl == kImplHeads ? HGeo<D>::kSmem : kImpl == kImplHeads8 ? heads8_smem<D>(kHeads8Ring) : Geo<D>::kSmem;
}

// Threads per CTA of a kernel variant.
template <int kImpl>
constexpr int decode_threads() {
  return kImpl == kImplHeads8 ? 2 * kThreads : kThreads;
}

// CTAs along grid.y: KV heads, or groups of kHeadsPerCta KV heads for the heads kernel.
template <int kImpl>
int head_ctas(int heads_kv) {
  return kImpl == kImplHeads || kImpl == kImplHeads8 ? heads_kv / kHeadsPerCta : heads_kv;
}

// fold_ok: H_kv = 1 or 2 with pages of whole pseudo tokens, where heads8 runs over folded tokens (heads8_fold below).
int decode_impl(int group, bool heads_ok, bool fold_ok) {
  const char* env = std::getenv("TRACE_EXT_KV_DECODE_IMPL");
  if (env != nullptr && std::strcmp(env, "old") == 0) return kImplRegQ;
  if (env != nullptr && std::strcmp(env, "qsmem") == 0) return kImplSmemQ;
  if (env != nullptr && std::strcmp(env, "g8") == 0 && group <= 8) return kImplSwap;
  if (group > 8) return kImplSmemQ;
  if (env != nullptr && std::strcmp(env, "heads") == 0 && heads_ok) return kImplHeads;
  return heads_ok || fold_ok ? kImplHeads8 : kImplSwap;
}

// heads8 over folded tokens (H_kv = 1 or 2, the KV heads per GPU of tensor-parallel rollouts, where H_kv % 4 != 0 ruled
// the heads kernels out): kFold = 4 / H_kv consecutive tokens of all H_kv heads are one contiguous 4-head run of the
// [page, token, head, D/2] layout, so the cache is read as H_kv = 4 pseudo heads of pseudo tokens (page size P /
// kFold), with heads8's copy plan unchanged; pseudo head j * H_kv + head holds tokens kFold t + j of `head`, masked per
// warp at the sequence's end, and the kFold pseudo heads of a head are merged in the CTA (merge_fold_states). The fused
// split finish does not apply (the separate combine kernel merges the splits).
int heads8_fold(int64_t heads_kv, int64_t page_size) {
  if (heads_kv != 1 && heads_kv != 2) return 1;
  const int fold = 4 / (int)heads_kv;
  return page_size % fold == 0 ? fold : 1;
}

// fold > 1 (heads8 over folded tokens; max_len in pseudo tokens): the H200 sweeps of bench/bench_kv_tp_splits.py
// (bench/results/kv_tp_splits_r94_h200.md) at H_kv = 1, 2 want shorter splits where a CTA per SM is all the grid gives
// (B = 8 at S = 4K: 8 splits of 128 pseudo tokens, 16.4 us against 25.6 us for 2 of 512), and the second CTA per SM
// only pays when each split keeps >= 256 pseudo tokens and the splits stay <= the SM count (B = 1 at S = 128K:
// 132 splits 23.3 us, 256 splits 27.2 us). So there the shortest split is 128 pseudo tokens and the model counts a
// second resident CTA as a speedup only under those two conditions.
constexpr int kFoldMinSplitTokens = 128;
constexpr int kFoldSecondCtaMinTokens = 256;

template <int D, int kImpl>
int choose_splits(int batch_heads, int64_t max_len, int device, int fold = 1) {
  static int cached_per_sm[64] = {0};  // per device: occupancy of this kernel
  const int slot = device & 63;
  if (cached_per_sm[slot] == 0) {
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decode_kernel<D, kImpl>(), decode_threads<kImpl>(),
                                                  decode_smem<D, kImpl>());
    cached_per_sm[slot] = std::max(per_sm, 1);
  }
  const int sms = sm_count(device), per_sm = cached_per_sm[slot];
  // Makespan model from the H200 split sweeps (bench/results/kv_h200.md, 38bcf7f): an SM's K/V throughput
  // saturates at 2 resident CTAs (8 warps; 1 CTA runs at ~0.75 of it: B32 S8K 1 split 107 us, 2 splits 80 us,
  // 4 splits 79 us), so a split count costs ~ k / s / rate(k) (k = CTAs on the busiest SM, each 1/s of a
  // (sequence, KV head) pair's work), and every split beyond that costs on its own (partial writes, the combine,
  // more concurrent streams: B32 S8K 4 -> 5 -> 8 splits 79 -> 83 -> 90 us; B64 S4K 1-2 splits 76 us, 5 splits
  // 88 us; B1 S128K 32 splits 81 us, 82 splits 94 us). Take the smallest split count within 5% of the best
  // modelled makespan, without splits shorter than kMinSplitTokens.
  // (the scan is a few hundred steps: the last answer per device is kept, decode repeats its shapes every layer)
  static int64_t memo_bh[64] = {0}, memo_len[64] = {0};
  static int memo_splits[64] = {0}, memo_fold[64] = {0};
  if (memo_splits[slot] > 0 && memo_bh[slot] == batch_heads && memo_len[slot] == max_len && memo_fold[slot] == fold)
    return memo_splits[slot];
  const int64_t min_split = fold > 1 ? kFoldMinSplitTokens : kMinSplitTokens;
  const int64_t max_splits = std::max<int64_t>(1, std::min<int64_t>(max_len / min_split, 4 * (int64_t)sms));
  auto cost = [&](int64_t s) {
    const int64_t k = ((int64_t)batch_heads * s + sms - 1) / sms;
    bool second_cta_pays = k >= 2 && per_sm >= 2;
    if (fold > 1) second_cta_pays = second_cta_pays && max_len / s >= kFoldSecondCtaMinTokens && s <= sms;
    return (double)k / (double)s / (second_cta_pays ? 1.0 : 0.75);
  };
  double best_cost = cost(1);
  for (int64_t s = 2; s <= max_splits; ++s) best_cost = std::min(best_cost, cost(s));
  int splits = 1;
  while (splits < max_splits && cost(splits) > 1.05 * best_cost) ++splits;
  memo_bh[slot] = batch_heads;
  memo_len[slot] = max_len;
  memo_fold[slot] = fold;
  memo_splits[slot] = splits;
  return splits;
}

// TRACE_EXT_KV_DECODE_COMBINE=fused (read per call): the last CTA of each (sequence, KV head) combines the splits in
// the decode kernel (no second launch; the default before round 88). Default (or =kernel): the separate combine kernel,
// launched as a programmatic dependent of the decode kernel (combine_pdl): H200 round 87, heads8, 1.03x at B32 S8K and
// B64 S4K, 1.01x at B8 S32K against the fused finish, bit-equal (bench/results/kv_pdl_ab_r87_h200.md).
bool fused_combine() {
  const char* env = std::getenv("TRACE_EXT_KV_DECODE_COMBINE");
  return env != nullptr && std::strcmp(env, "fused") == 0;
}

// Arrival counters of the fused split-K finish: zeroed once, kept per (device, stream) (launches on one stream
// are ordered, so they never share counters concurrently), grown on demand. Every launch leaves them at 0.
unsigned int* split_counters(int64_t n, const at::Tensor& like) {
  struct Entry {
    int device;
    cudaStream_t stream;
    at::Tensor buf;
  };
  static std::mutex mu;
  static auto* entries = new std::vector<Entry>();  // never destroyed: no CUDA frees during process exit
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int device = like.get_device();
  std::lock_guard<std::mutex> lock(mu);
  for (Entry& e : *entries) {
    if (e.device == device && e.stream == stream) {
      if (e.buf.numel() < n) e.buf = at::zeros({std::max<int64_t>(n, 2 * e.buf.numel())}, like.options().dtype(at::kInt));
      return reinterpret_cast<unsigned int*>(e.buf.data_ptr<int32_t>());
    }
  }
  entries->push_back({device, stream, at::zeros({std::max<int64_t>(n, 1024)}, like.options().dtype(at::kInt))});
  return reinterpret_cast<unsigned int*>(entries->back().buf.data_ptr<int32_t>());
}

// TRACE_EXT_KV_DECODE_RING (read per call; an A/B knob): "4" runs heads8 with the 4-stage ring of the kernel before
// round 22, "2" with a 2-stage ring (same split count, same arithmetic: bit-equal to the default's 3 stages).
int heads_ring_selected() {
  const char* env = std::getenv("TRACE_EXT_KV_DECODE_RING");
  if (env == nullptr) return 0;
  return std::strcmp(env, "2") == 0 ? 2 : std::strcmp(env, "4") == 0 ? 4 : 0;
}

// The largest shared-memory carveout, so that the register limit (not the L1 / shared split) sets the CTAs per SM,
// and the dynamic shared-memory limit where a kernel takes more than the 48 KB default (heads8: 59 KB at D = 128).
// TRACE_EXT_KV_CARVEOUT=driver (read once per process, at the first launch of each kernel; a probe knob): leave the
// carveout to the driver (tests whether the launch after a kernel of another L1 / shared split pays a reconfiguration).
void set_decode_kernel_attrs(DecodeKernelFn kernel, int smem) {
  const char* env = std::getenv("TRACE_EXT_KV_CARVEOUT");
  if (!(env != nullptr && std::strcmp(env, "driver") == 0)) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  }
  if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
}

// A heads8 variant other than the default (another stage ring, or tokens folded into pseudo heads), its launch
// attributes set once per device.
template <int D, int kRing, int kFold = 1>
DecodeKernelFn heads8_variant_kernel(int device) {
  static bool attr_set[64] = {false};
  const DecodeKernelFn kernel = fp4kv_decode_kernel_heads<D, 2, kRing, kFold>;
  if (!attr_set[device & 63]) {
    set_decode_kernel_attrs(kernel, heads8_smem<D>(kRing));
    attr_set[device & 63] = true;
  }
  return kernel;
}

// fold > 1 (heads8 only): tokens folded into pseudo heads (heads8_fold).
template <int D, int kImpl>
void launch(const DecodeParams& base, int batch, int num_splits_arg, int64_t max_len, const at::Tensor& q,
            at::Tensor& out, at::Tensor& lse, int fold = 1) {
  DecodeParams p = base;
  if (fold > 1) {  // the kernel's view: 4 pseudo KV heads, pages of P / fold pseudo tokens
    p.heads_kv = kHeadsPerCta;
    p.page_size /= fold;
    max_len /= fold;
  }
  const int device = q.get_device();
  static bool carveout_set[64] = {false};  // per device (the caller's guard made `device` current)
  if (!carveout_set[device & 63]) {
    set_decode_kernel_attrs(decode_kernel<D, kImpl>(), decode_smem<D, kImpl>());  // before choose_splits' occupancy
    carveout_set[device & 63] = true;
  }
  const int splits = num_splits_arg > 0
                         ? num_splits_arg
                         : choose_splits<D, kImpl>(batch * head_ctas<kImpl>(p.heads_kv), max_len, device, fold);
  p.num_splits = splits;
  at::Tensor o_part, lse_part;
  bool wide = false;
  if (splits > 1) {
    o_part = at::empty({batch, p.heads_q, splits, D}, q.options().dtype(at::kFloat));
    lse_part = at::empty({batch, p.heads_q, splits}, q.options().dtype(at::kFloat));
    p.o_part = o_part.data_ptr<float>();
    p.lse_part = lse_part.data_ptr<float>();
    // heads kernels past kHeadsFusedMax partial floats per head group (e.g. 2 groups x 126 splits at B = 1): the wide
    // combine kernel (a CTA per (sequence, query head), splits spread over its warps), also under =fused, where the
    // fused finish's serial tail (one CTA per head group) would cost more
    // Folded tokens take it past 16 splits at any G (H200 round 95, Mixtral TP4 B8 S16K, G = 4: 31 splits through the
    // combine kernel 31.9 us, 33 through the wide one 26.6 us).
    const int64_t wide_rows = (int64_t)kHeadsPerCta * (fold > 1 ? std::max(p.group, 8) : p.group);
    wide = (kImpl == kImplHeads || kImpl == kImplHeads8) && (int64_t)splits * wide_rows * D > kHeadsFusedMax;
    p.split_counters = fused_combine() && !wide && fold == 1 ? split_counters((int64_t)batch * p.heads_kv, q) : nullptr;
  }
  DecodeKernelFn kernel = decode_kernel<D, kImpl>();
  int smem = decode_smem<D, kImpl>();
  if constexpr (kImpl == kImplHeads8) {  // TRACE_EXT_KV_DECODE_RING=2 / 4: another stage ring, same splits
    const int ring = fold > 1 ? 0 : heads_ring_selected();
    if (fold > 1) {
      kernel = fold == 2 ? heads8_variant_kernel<D, kHeads8Ring, 2>(device)
                         : heads8_variant_kernel<D, kHeads8Ring, 4>(device);
    }
    if (ring != 0) {
      kernel = ring == 2 ? heads8_variant_kernel<D, 2>(device) : heads8_variant_kernel<D, 4>(device);
      smem = heads8_smem<D>(ring);
    }
  }
  require_kernel_image(kernel, "fp4kv_decode_attention");
  auto stream = c10::cuda::getCurrentCUDAStream();
  dim3 grid(splits, head_ctas<kImpl>(p.heads_kv), batch);
  kernel<<<grid, decode_threads<kImpl>(), smem, stream>>>(p);
  check_launch("fp4kv_decode_attention");
  if (splits > 1 && p.split_counters == nullptr) {  // not merged in the decode kernel (wide: never)
    const float* op = o_part.data_ptr<float>();
    const float* lp = lse_part.data_ptr<float>();
    uint16_t* outp = reinterpret_cast<uint16_t*>(out.data_ptr());
    float* lsep = lse.data_ptr<float>();
    const unsigned int ctas = (unsigned int)(batch * p.heads_q);
    const char* what = "fp4kv_decode_attention (combine)";
    if (wide) {
      launch_kernel(fp4kv_decode_combine_wide_kernel<D>, dim3(ctas), kWideWarps * 32, 0, stream.stream(),
                    combine_pdl(), what, op, lp, outp, lsep, splits);
    } else {
      launch_kernel(fp4kv_decode_combine_kernel<D>, dim3(ctas), D, 0, stream.stream(), combine_pdl(), what, op, lp,
                    outp, lsep, splits);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> fp4kv_decode_attention_cuda(const at::Tensor& q, const at::Tensor& k_codes,
                                                               const at::Tensor& k_scales, const at::Tensor& v_codes,
                                                               const at::Tensor& v_scales,
                                                               const at::Tensor& block_table,
                                                               const at::Tensor& seq_lens, double softmax_scale,
                                                               double g_k, double g_v, int64_t num_splits) {
  check_cuda(q, "q");
  check_dtype(q, at::kBFloat16, "q");
  TORCH_CHECK_VALUE(q.dim() == 3, "trace_ext: q must be [B, Hq, D], got ", q.sizes());
  check_contiguous(q, "q");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  TORCH_CHECK_VALUE(D == 64 || D == 128, "trace_ext: fp4kv_decode_attention: head_dim must be 64 or 128, got ", D);
  const char* names[4] = {"k_codes", "k_scales", "v_codes", "v_scales"};
  const at::Tensor* cache[4] = {&k_codes, &k_scales, &v_codes, &v_scales};
  for (int i = 0; i < 4; ++i) {
    check_dtype(*cache[i], at::kByte, names[i]);
    check_contiguous(*cache[i], names[i]);
    check_same_device(*cache[i], q, names[i], "q");
  }
  TORCH_CHECK_VALUE(k_codes.dim() == 4 && k_codes.size(3) == D / 2, "trace_ext: k_codes must be [pages, P, H_kv, ",
                    D / 2, "], got ", k_codes.sizes());
  const int64_t pages = k_codes.size(0), P = k_codes.size(1), Hkv = k_codes.size(2);
  check_shape(v_codes, k_codes.sizes(), "v_codes");
  check_shape(k_scales, {pages, P, Hkv, D / kNvfp4Block}, "k_scales");
  check_shape(v_scales, {pages, P, Hkv, D / kNvfp4Block}, "v_scales");
  TORCH_CHECK_VALUE(Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv <= kMaxGroup, "trace_ext: Hq (", Hq,
                    ") must be a multiple of H_kv (", Hkv, ") with at most ", kMaxGroup, " query heads per KV head");
  check_dtype(block_table, at::kInt, "block_table");
  check_dtype(seq_lens, at::kInt, "seq_lens");
  TORCH_CHECK_VALUE(block_table.dim() == 2 && block_table.size(0) == B, "trace_ext: block_table must be [", B,
                    ", max_pages], got ", block_table.sizes());
  check_shape(seq_lens, {B}, "seq_lens");
  check_contiguous(block_table, "block_table");
  check_contiguous(seq_lens, "seq_lens");
  check_same_device(block_table, q, "block_table", "q");
  check_same_device(seq_lens, q, "seq_lens", "q");
  TORCH_CHECK_VALUE(num_splits >= 0 && num_splits <= 65535, "trace_ext: num_splits must be in [0, 65535], got ",
                    num_splits);
  TORCH_CHECK_VALUE(std::isfinite(softmax_scale), "trace_ext: softmax_scale must be finite");
  TORCH_CHECK_VALUE(std::isfinite(g_k) && g_k > 0 && std::isfinite(g_v) && g_v > 0,
                    "trace_ext: g_k and g_v must be finite and > 0");
  TORCH_CHECK_VALUE(pages * P * Hkv < (int64_t(1) << 31), "trace_ext: fp4kv_decode_attention: at most 2^31 cache rows "
                    "(pages * page_size * H_kv)");
  TORCH_CHECK_VALUE(P > 0, "trace_ext: fp4kv_decode_attention: page_size must be > 0, got k_codes ", k_codes.sizes());
  // the cache is read in place: every kernel copies 16-byte code pieces and (g8 / m16) one head's D/16 scale bytes
  const auto aligned = [](const at::Tensor& t, int64_t a) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % a == 0; };
  TORCH_CHECK_VALUE(aligned(k_codes, 16) && aligned(v_codes, 16) && aligned(k_scales, D / kNvfp4Block) &&
                        aligned(v_scales, D / kNvfp4Block),
                    "trace_ext: fp4kv_decode_attention: k_codes / v_codes must start 16-byte aligned and k_scales / "
                    "v_scales ", D / kNvfp4Block, "-byte aligned (a uint8 view at an odd offset?)");

  c10::cuda::CUDAGuard guard(q.device());
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.get_device());
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, q.get_device());
  TORCH_CHECK(major * 10 + minor >= 89, "trace_ext: fp4kv_decode_attention needs sm_89 or newer (cvt.e4m3x2, built for ",
              TRACE_EXT_ARCHS_STR, "), this GPU is sm_", major, minor);

  TORCH_CHECK_VALUE(B <= 65535 && Hkv <= 65535, "trace_ext: fp4kv_decode_attention takes at most 65535 sequences and KV heads");
  at::Tensor out = at::empty({B, Hq, D}, q.options());
  at::Tensor lse = at::empty({B, Hq}, q.options().dtype(at::kFloat));
  if (B == 0 || Hq == 0) return {out, lse};

  // Q rows are read with 16-byte loads: an offset view gets an aligned copy
  const at::Tensor q_src = reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 ? q.clone() : q;
  DecodeParams p{};
  p.q = reinterpret_cast<const uint16_t*>(q_src.data_ptr());
  p.out = reinterpret_cast<uint16_t*>(out.data_ptr());
  p.lse = lse.data_ptr<float>();
  p.k_codes = k_codes.data_ptr<uint8_t>();
  p.k_scales = k_scales.data_ptr<uint8_t>();
  p.v_codes = v_codes.data_ptr<uint8_t>();
  p.v_scales = v_scales.data_ptr<uint8_t>();
  p.block_table = block_table.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.heads_q = (int)Hq;
  p.heads_kv = (int)Hkv;
  p.group = (int)(Hq / Hkv);
  p.page_size = (int)P;
  p.max_pages = (int)block_table.size(1);
  p.score_scale = (float)(softmax_scale * g_k * (double)kTwo14 * (double)kLog2e);
  p.out_scale = (float)(g_v * (double)kTwo14);
  const int64_t max_len = block_table.size(1) * P;  // an upper bound of seq_lens without a host sync
  // the heads kernels copy 16-byte pieces of 4-head runs (of 4 / H_kv tokens at H_kv = 1, 2: heads8_fold):
  // 16-byte aligned cache bases
  bool aligned16 = true;
  for (int i = 0; i < 4; ++i) aligned16 = aligned16 && aligned(*cache[i], 16);
  const bool heads_ok = aligned16 && Hkv % kHeadsPerCta == 0;
  const int fold = aligned16 ? heads8_fold(Hkv, P) : 1;
  const int impl = decode_impl(p.group, heads_ok, fold > 1);
  auto go = [&](auto d_tag) {
    constexpr int kD = decltype(d_tag)::value;
    if (impl == kImplHeads) {
      launch<kD, kImplHeads>(p, (int)B, (int)num_splits, max_len, q, out, lse);
    } else if (impl == kImplHeads8) {
      launch<kD, kImplHeads8>(p, (int)B, (int)num_splits, max_len, q, out, lse, fold);
    } else if (impl == kImplSwap) {
      launch<kD, kImplSwap>(p, (int)B, (int)num_splits, max_len, q, out, lse);
    } else if (impl == kImplSmemQ) {
      launch<kD, kImplSmemQ>(p, (int)B, (int)num_splits, max_len, q, out, lse);
    } else {
      launch<kD, kImplRegQ>(p, (int)B, (int)num_splits, max_len, q, out, lse);
    }
  };
  if (D == 64) {
    go(std::integral_constant<int, 64>{});
  } else {
    go(std::integral_constant<int, 128>{});
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(trace_ext, CUDA, m) { m.impl("fp4kv_decode_attention", &fp4kv_decode_attention_cuda); }

}  // namespace trace_ext
