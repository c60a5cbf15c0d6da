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
//   be slower than the memory stream). Splits make batch 1 at 128K fill the GPU; the last CTA to finish
//   a (sequence, KV head) combines the per-split (output, LSE) pairs in the same launch (arrival counter,
//   threadFenceReduction pattern): the separate combine kernel cost 5.5 us of 74 plus a launch gap at B32 S8K
//   (TRACE_EXT_KV_DECODE_COMBINE=kernel keeps it for A/B timing).
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

namespace trace_ext {
namespace {

constexpr int kWarps = 4;                 // independent flash-decoding loops per CTA
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 16;                 // tokens per warp tile: two n8 tiles of Q.K^T, one k16 step of P.V
constexpr int kStages = 4;                // cp.async stages per warp
constexpr int kMinBlocks = 4;             // CTAs per SM (Q fragments in shared memory): 65536 / (128 * 4) = 128 regs
constexpr int kMinBlocksSwap = 5;         // CTAs per SM of the G <= 8 swapped-operand kernel (<= 102 regs)
constexpr int kMinBlocksQReg = 3;         // CTAs per SM of the register-resident-Q variant (TRACE_EXT_KV_DECODE_IMPL=old)
constexpr int kMaxGroup = 16;             // query heads per KV head: the M = 16 rows of one MMA
constexpr int kCtaTokens = kWarps * kTile;  // split lengths are multiples of this
constexpr int kMinSplitTokens = 512;      // heuristic: below this a split's pipeline never fills
constexpr int kQExp = 14;                 // Q row amax is scaled into [2^14, 2^15)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kTwo14 = 16384.0f;        // K and V are held as q * s_b * 2^-14
constexpr float kRescaleSlack = 8.0f;     // log2 growth of a row max tolerated before O is rescaled
// Shared-memory O of the cross-warp combine: column group n (the 8 fragment columns) is kOGroup floats wide
// and a row kOStride floats, so that the 32 lanes' stores of one accumulator register hit 32 distinct banks
// (row stride = 1 mod 32, group stride = 8 mod 32); the natural [16][D] layout was a 32-way conflict.
constexpr int kOGroup = 20;
constexpr int kOStride = 8 * kOGroup + 1;
static_assert(kTile == 16, "a warp tile is one k16 step of the P.V MMA and two n8 tiles of Q.K^T");
static_assert(kMaxGroup == 16, "the query heads of one KV head are the 16 rows of an m16n8k16 MMA");

template <int D>
struct Geo {
  static_assert(D == 64 || D == 128, "head_dim must be 64 or 128");
  static constexpr int kRowBytes = D / 2;               // code bytes per (token, head) row
  static constexpr int kScaleBytes = D / kNvfp4Block;   // scale bytes per row
  static constexpr int kChunks = kRowBytes / 16;        // 16-byte chunks per code row
  static constexpr int kRowsPerLine = 128 / kRowBytes;  // code rows per 128-byte shared-memory line
  static constexpr int kCodeTile = kTile * kRowBytes;
  static constexpr int kScaleTile = kTile * kScaleBytes;
  static constexpr int kStageBytes = 2 * kCodeTile + 2 * kScaleTile;
  static constexpr int kKBytes = D / 8;                 // K code bytes one thread reads per row (a quarter)
  static constexpr int kKWords = kKBytes / 4;
  static constexpr int kVBytes = D / 16;                // V code bytes one thread reads per row (one block)
  static constexpr int kVWords = kVBytes / 4;
  static constexpr int kKSteps = D / 16;                // k16 steps of Q.K^T
  static constexpr int kONTiles = D / 8;                // n8 tiles of the output
  static constexpr int kSmemBytes = kWarps * kStages * kStageBytes;
  static constexpr int kQBytes = kKSteps * 32 * 16;     // Q fragments: [k-step][lane] uint4, behind the stages
  static constexpr int kCombineBytes = (kWarps * kMaxGroup * kOStride + 2 * kWarps * kMaxGroup) * 4;
  static constexpr int kSmem = kSmemBytes + kQBytes > kCombineBytes ? kSmemBytes + kQBytes : kCombineBytes;
  static_assert(kKWords * 8 == D / 4 && kKSteps == 2 * kKWords * 4 / 4, "a thread's K quarter row feeds every k-step");
  static_assert(kStageBytes % 16 == 0, "stages must stay 16-byte aligned for cp.async");
  static_assert(kCodeTile % 128 == 0, "the swizzle works on whole 128-byte lines");
  static_assert(D / 8 <= kOGroup && (kOGroup * 2) % 32 == 8 && kOStride % 32 == 1,
                "combine layout: a column group holds D/8 floats; row / group strides keep the stores conflict free");
};

struct DecodeParams {
  // query and outputs
  const uint16_t* q;   // bf16 [B, Hq, D]
  uint16_t* out;       // bf16 [B, Hq, D] (num_splits == 1)
  float* lse;          // fp32 [B, Hq] (num_splits == 1)
  float* o_part;       // fp32 [B, Hq, splits, D] (num_splits > 1)
  float* lse_part;     // fp32 [B, Hq, splits], log2 units (num_splits > 1)
  // cache
  const uint8_t* k_codes;
  const uint8_t* k_scales;
  const uint8_t* v_codes;
  const uint8_t* v_scales;
  const int32_t* block_table;  // [B, max_pages]
  const int32_t* seq_lens;     // [B]
  // split-K finish in the decode kernel (num_splits > 1): per (sequence, KV head) arrival counters that cycle
  // 0 .. num_splits - 1 (atomicInc), so they are back at 0 after every launch; null: the separate combine kernel
  unsigned int* split_counters;
  int heads_q, heads_kv, group, page_size, max_pages, num_splits;
  float score_scale;  // softmax_scale * g_k * 2^14 * log2(e)
  float out_scale;    // g_v * 2^14
};

// ---- small PTX helpers -------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_small(uint32_t dst, const void* src, int src_bytes) {
  static_assert(N == 4 || N == 8, "cp.async.ca copies 4, 8 or 16 bytes");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(N), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x for the softmax weights of the main loops: MUFU.EX2 alone (exp2f adds a compare and two multiplies per call
// to produce subnormal results). Results below 2^-126 flush to 0, which changes nothing: P is rounded to fp16
// (smallest subnormal 2^-24) before the MMA, and l_run's relative change is below 2^-100.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  __half2 r = __hmul2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

// Two E4M3 scale bytes (lo, hi) -> half2 (exact).
__device__ __forceinline__ uint32_t e4m3x2_to_half2(uint32_t two_bytes) {
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes & 0xFFFFu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// The four E2M1 codes in the high nibbles of w's bytes, as the high bytes of fp16 q * 2^-14:
// sign -> bit 7, exponent and mantissa (3 bits) -> bits 3..1.
__device__ __forceinline__ uint32_t e2m1_hi_nibbles_to_f16_hibytes(uint32_t w) {
  return (w & 0x80808080u) | ((w >> 3) & 0x0E0E0E0Eu);
}
// ... and of the low nibbles.
__device__ __forceinline__ uint32_t e2m1_lo_nibbles_to_f16_hibytes(uint32_t w) {
  return ((w << 4) & 0x80808080u) | ((w << 1) & 0x0E0E0E0Eu);
}
// fp16x2 whose high bytes are bytes 0 and 1 (kPairLo) or 2 and 3 (kPairHi) of x; low bytes zero.
constexpr uint32_t kPairLo = 0x1404u;
constexpr uint32_t kPairHi = 0x3424u;
__device__ __forceinline__ uint32_t f16x2_from_hibytes(uint32_t x, uint32_t sel) { return __byte_perm(x, 0u, sel); }
// fp16x2 of two expanded codes (f16x2_from_hibytes(x, sel)) times their half2 block scale: q * s_b * 2^-14, exact.
__device__ __forceinline__ uint32_t dequant_pair(uint32_t x, uint32_t sel, uint32_t scale2) {
  return hmul2(f16x2_from_hibytes(x, sel), scale2);
}

// Byte offset of 16-byte chunk `chunk` of code row `t` inside a code tile (XOR swizzle, see design note).
template <int D>
__device__ __forceinline__ int code_offset(int t, int chunk) {
  using G = Geo<D>;
  const int line = t / G::kRowsPerLine;
  const int slot = ((t % G::kRowsPerLine) * G::kChunks + chunk) ^ (2 * (line % G::kChunks));
  return line * 128 + slot * 16;
}

// ---- the split-KV kernel -------------------------------------------------------------------------------------

// The combine of the splits of one (sequence, query head) at head_dim d: weights 2^(lse_s - max); returns the
// output and the natural-log LSE. The partials are read through L2 (__ldcg): in the fused finish they were
// written by other CTAs of the same launch.
struct Combined {
  float out, lse;
};
template <int D>
__device__ __forceinline__ Combined combine_splits(const float* o_part, const float* lse_part, int64_t bh, int d,
                                                   int num_splits) {
  const float* lp = lse_part + bh * num_splits;
  float m = -INFINITY;
  // unrolled so that the independent loads of many splits (up to ~80 at batch 1) are in flight together
#pragma unroll 8
  for (int s = 0; s < num_splits; ++s) m = fmaxf(m, __ldcg(lp + s));
  float l = 0.0f, acc = 0.0f;
  if (m != -INFINITY) {
#pragma unroll 8
    for (int s = 0; s < num_splits; ++s) {
      const float ls = __ldcg(lp + s);
      const float op = __ldcg(o_part + (bh * num_splits + s) * D + d);
      if (ls == -INFINITY) continue;
      const float f = exp2f(ls - m);
      l += f;
      acc += f * op;
    }
  }
  const bool empty = !(l > 0.0f);
  return {empty ? 0.0f : acc / l, empty ? -INFINITY : (m + log2f(l)) * kLn2};
}

// The cross-warp merge of a CTA's (m, l, O) from shared memory (sm_o [warps][16][kOStride] with head_dim d at
// (d / (D/8)) * kOGroup + d % (D/8); sm_m, sm_l [warps][16]) and the store of the output (one split) or of the
// split's partial result; all threads of the CTA.
template <int D>
__device__ __forceinline__ void merge_warps(const DecodeParams& p, const float* sm_o, const float* sm_m,
                                            const float* sm_l, int split, int kv_head, int b) {
  for (int idx = threadIdx.x; idx < p.group * D; idx += kThreads) {
    const int row = idx / D, d = idx % D;
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, sm_m[w * kMaxGroup + row]);
    float l_all = 0.0f, o_all = 0.0f;
    if (m_all != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float mw = sm_m[w * kMaxGroup + row];
        if (mw == -INFINITY) continue;
        const float f = exp2f(mw - m_all);
        l_all += f * sm_l[w * kMaxGroup + row];
        o_all += f * sm_o[(w * kMaxGroup + row) * kOStride + (d / (D / 8)) * kOGroup + d % (D / 8)];
      }
    }
    const int64_t bh = (int64_t)b * p.heads_q + (int64_t)kv_head * p.group + row;
    const bool empty = !(l_all > 0.0f);
    const float val = empty ? 0.0f : o_all / l_all * p.out_scale;
    const float lse2 = empty ? -INFINITY : m_all + log2f(l_all);
    if (p.num_splits == 1) {
      __nv_bfloat16 ob = __float2bfloat16_rn(val);
      p.out[bh * D + d] = *reinterpret_cast<uint16_t*>(&ob);
      if (d == 0) p.lse[bh] = empty ? -INFINITY : lse2 * kLn2;
    } else {
      p.o_part[(bh * p.num_splits + split) * D + d] = val;
      if (d == 0) p.lse_part[bh * p.num_splits + split] = lse2;
    }
  }
  if (p.num_splits == 1 || p.split_counters == nullptr) return;
  // Fused split-K finish (threadFenceReduction pattern): publish the partials, count this split's arrival; the
  // last CTA of the (sequence, KV head) combines all splits of its G query heads.
  __shared__ bool last_split;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned int prev = atomicInc(p.split_counters + (int64_t)b * p.heads_kv + kv_head, p.num_splits - 1);
    last_split = prev == (unsigned int)(p.num_splits - 1);
  }
  __syncthreads();
  if (!last_split) return;
  __threadfence();
  for (int idx = threadIdx.x; idx < p.group * D; idx += kThreads) {
    const int row = idx / D, d = idx % D;
    const int64_t bh = (int64_t)b * p.heads_q + (int64_t)kv_head * p.group + row;
    const Combined cmb = combine_splits<D>(p.o_part, p.lse_part, bh, d, p.num_splits);
    __nv_bfloat16 ob = __float2bfloat16_rn(cmb.out);
    p.out[bh * D + d] = *reinterpret_cast<uint16_t*>(&ob);
    if (d == 0) p.lse[bh] = cmb.lse;
  }
}

template <int D>
struct WarpLoader {
  using G = Geo<D>;
  const uint8_t* k_codes;
  const uint8_t* v_codes;
  const uint8_t* k_scales;
  const uint8_t* v_scales;
  const int32_t* table_row;
  int page_size, heads_kv, kv_head, lane;
  // Page-table column and slot of this lane's token (lane % 16) in the next tile to fetch. A warp's tiles are
  // kCtaTokens apart, so both advance by a constant: no integer division in the main loop.
  int col, slot, step_col, step_slot;

  __device__ __forceinline__ void init(int first_tile_start) {
    const int t = first_tile_start + (lane & (kTile - 1));
    col = t / page_size;
    slot = t % page_size;
    step_col = kCtaTokens / page_size;
    step_slot = kCtaTokens % page_size;
  }

  // (page id, slot) of this lane's token in the tile starting at `t0` (page 0 past `end`); tiles must be
  // fetched in order, once each.
  __device__ __forceinline__ int2 fetch(int t0, int end) {
    const int t = t0 + (lane & (kTile - 1));
    const int2 ps = make_int2(t < end ? __ldg(table_row + col) : 0, slot);
    col += step_col;
    slot += step_slot;
    if (slot >= page_size) slot -= page_size, ++col;
    return ps;
  }

  // Lane-invariant parts of the copies (set by prepare): destination offsets inside a stage, the tile row and
  // byte offset of each 16-byte code chunk, and the scale pool this lane copies from.
  static constexpr int kCodeIters = kTile * G::kChunks / 32;
  uint32_t dst_scale, dst_code[kCodeIters];
  int code_row[kCodeIters], code_byte[kCodeIters];
  const uint8_t* scale_pool;

  __device__ __forceinline__ void prepare() {
    const int tl = lane & (kTile - 1);
    const bool is_v = lane >= kTile;  // scale rows: lanes 0..15 K, 16..31 V
    scale_pool = is_v ? v_scales : k_scales;
    dst_scale = 2 * G::kCodeTile + (is_v ? G::kScaleTile : 0) + tl * G::kScaleBytes;
#pragma unroll
    for (int i = 0; i < kCodeIters; ++i) {
      const int q = lane + 32 * i;
      code_row[i] = q / G::kChunks;
      code_byte[i] = (q % G::kChunks) * 16;
      dst_code[i] = code_offset<D>(code_row[i], q % G::kChunks);
    }
  }

  // Copies the tile starting at token t0 into the stage at shared address `stage`. Row indices fit 32 bits
  // (checked on the host); byte offsets are 64-bit.
  __device__ __forceinline__ void issue(uint32_t stage, int t0, int end, int2 ps) const {
    const int tl = lane & (kTile - 1);
    const bool valid = t0 + tl < end;
    const uint32_t row = valid ? ((uint32_t)ps.x * (uint32_t)page_size + (uint32_t)ps.y) * (uint32_t)heads_kv + kv_head : 0u;
    cp_async_small<G::kScaleBytes>(stage + dst_scale, scale_pool + (size_t)row * G::kScaleBytes,
                                   valid ? G::kScaleBytes : 0);
#pragma unroll
    for (int i = 0; i < kCodeIters; ++i) {
      const uint32_t rrow = __shfl_sync(0xffffffffu, row, code_row[i]);
      const int bytes = t0 + code_row[i] < end ? 16 : 0;
      const size_t off = (size_t)rrow * G::kRowBytes + code_byte[i];
      cp_async_16(stage + dst_code[i], k_codes + off, bytes);
      cp_async_16(stage + G::kCodeTile + dst_code[i], v_codes + off, bytes);
    }
  }
};

// ---- pieces shared by the two split-KV kernels ------------------------------------------------------------

// This CTA's split: tokens [start, end), and the number of 16-token tiles this warp owns (tiles warp,
// warp + kWarps, ... of the split).
struct SplitTiles {
  int start, end, my_tiles;
};
__device__ __forceinline__ SplitTiles split_tiles(const DecodeParams& p, int split, int b, int warp) {
  const int len = __ldg(p.seq_lens + b);
  const int per_split = (len + p.num_splits - 1) / p.num_splits;
  const int chunk_len = (per_split + kCtaTokens - 1) / kCtaTokens * kCtaTokens;
  const int start = split * chunk_len;
  const int end = min(len, start + chunk_len);
  const int n_tiles = end > start ? (end - start + kTile - 1) / kTile : 0;
  const int my_tiles = n_tiles > warp ? (n_tiles - warp + kWarps - 1) / kWarps : 0;
  return {start, end, my_tiles};
}

// The power-of-two exponent e2 that puts a Q row's amax (max of the 4 lanes' quarter-row amaxes) into
// [2^14, 2^15); 0 for an all-zero or non-finite row.
__device__ __forceinline__ int q_row_exponent(float amax) {
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  int e2 = 0;
  if (amax > 0.0f && isfinite(amax)) {
    const int field = (int)((__float_as_uint(amax) >> 23) & 0xFFu);
    e2 = kQExp - (field == 0 ? -127 : field - 127);
    e2 = max(-126, min(127, e2));
  }
  return e2;
}

// The fp16 Q words of k-step ks from a scaled quarter row: k-step 2i + s takes elements 8i + 4s + {0, 2}
// (x: k = 2c, 2c+1) and 8i + 4s + {1, 3} (y: k = 2c+8, 2c+9).
template <int D>
__device__ __forceinline__ uint2 q_frag(const float (&qv)[D / 4], int ks) {
  const int base = 8 * (ks / 2) + 4 * (ks % 2);
  __half2 lo = __floats2half2_rn(qv[base + 0], qv[base + 2]);
  __half2 hi = __floats2half2_rn(qv[base + 1], qv[base + 3]);
  return make_uint2(*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
}

// The per-warp cp.async pipeline (tiles warp, warp + kWarps, ... of the split; tile_start(i) is the first token
// of the warp's tile i): the prologue issues the first kStages - 1 tiles and returns the page walk of the next one;
// each iteration issues tile i + kStages - 1 (its page ids loaded one iteration ahead, so the copy issue never
// waits on the block table), walks the page table for the tile after it, and waits for tile i.
template <int D, class TileStart>
__device__ __forceinline__ int2 pipeline_prologue(WarpLoader<D>& ld, uint32_t wsmem_addr, const TileStart& tile_start,
                                                  int end, int my_tiles) {
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < my_tiles) ld.issue(wsmem_addr + s * Geo<D>::kStageBytes, tile_start(s), end, ld.fetch(tile_start(s), end));
    cp_async_commit();
  }
  return (kStages - 1 < my_tiles) ? ld.fetch(tile_start(kStages - 1), end) : make_int2(0, 0);
}
template <int D, class TileStart>
__device__ __forceinline__ void pipeline_step(WarpLoader<D>& ld, uint32_t wsmem_addr, const TileStart& tile_start,
                                              int i, int end, int my_tiles, int2& next_ps) {
  const int nxt = i + kStages - 1;
  if (nxt < my_tiles) ld.issue(wsmem_addr + (nxt % kStages) * Geo<D>::kStageBytes, tile_start(nxt), end, next_ps);
  cp_async_commit();
  if (nxt + 1 < my_tiles) next_ps = ld.fetch(tile_start(nxt + 1), end);
  cp_async_wait<kStages - 1>();
  __syncwarp();
}

// K code words of tokens 8 nt + r (this thread's quarter row) and their block scales, half2 (s, s) per word.
template <int D>
__device__ __forceinline__ void load_k(const uint8_t* st, const int (&k_off)[2], const int (&ks_off)[2],
                                       uint32_t (&w)[2][Geo<D>::kKWords], uint32_t (&sc)[2][Geo<D>::kKWords]) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    if constexpr (D == 128) {
      const uint4 u = *reinterpret_cast<const uint4*>(st + k_off[nt]);
      w[nt][0] = u.x, w[nt][1] = u.y, w[nt][2] = u.z, w[nt][3] = u.w;
      const uint32_t s2 = e4m3x2_to_half2(*reinterpret_cast<const uint16_t*>(st + ks_off[nt]));
      sc[nt][0] = sc[nt][1] = __byte_perm(s2, 0u, 0x1010);
      sc[nt][2] = sc[nt][3] = __byte_perm(s2, 0u, 0x3232);
    } else {
      const uint2 u = *reinterpret_cast<const uint2*>(st + k_off[nt]);
      w[nt][0] = u.x, w[nt][1] = u.y;
      const uint32_t s2 = e4m3x2_to_half2(st[ks_off[nt]]);
      sc[nt][0] = sc[nt][1] = __byte_perm(s2, 0u, 0x1010);
    }
  }
}

// V code words of tokens 2c, 2c+1, 2c+8, 2c+9 (this thread's block of head_dim) and the block scales of the token
// pairs (2c, 2c+1) and (2c+8, 2c+9) as half2.
template <int D>
__device__ __forceinline__ void load_v(const uint8_t* st, const int (&v_off)[4], const int (&vs_off)[4],
                                       uint32_t (&vw)[4][Geo<D>::kVWords], uint32_t (&vs2)[2]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint8_t* src = st + v_off[k];
    if constexpr (Geo<D>::kVWords == 2) {
      const uint2 u = *reinterpret_cast<const uint2*>(src);
      vw[k][0] = u.x, vw[k][1] = u.y;
    } else {
      vw[k][0] = *reinterpret_cast<const uint32_t*>(src);
    }
  }
#pragma unroll
  for (int pr = 0; pr < 2; ++pr) {
    vs2[pr] = e4m3x2_to_half2((uint32_t)st[vs_off[2 * pr]] | ((uint32_t)st[vs_off[2 * pr + 1]] << 8));
  }
}

// Bytes (2 half, 2 half + 1) of V word wi of both tokens of pair pr, interleaved ([t0.b, t1.b, t0.b', t1.b']) and
// expanded: hb = the high nibbles, lb = the low nibbles, as fp16 high bytes.
template <int D>
__device__ __forceinline__ void expand_v_pairs(const uint32_t (&vw)[4][Geo<D>::kVWords], int wi, int half,
                                               uint32_t (&hb)[2], uint32_t (&lb)[2]) {
  const uint32_t sel = half == 0 ? 0x5140u : 0x7362u;
#pragma unroll
  for (int pr = 0; pr < 2; ++pr) {
    const uint32_t z = __byte_perm(vw[2 * pr][wi], vw[2 * pr + 1][wi], sel);
    hb[pr] = e2m1_hi_nibbles_to_f16_hibytes(z);
    lb[pr] = e2m1_lo_nibbles_to_f16_hibytes(z);
  }
}

// The cross-warp combine's shared memory (over the stages): O [warps][16][kOStride], m and l [warps][16].
struct CombineSmem {
  float *o, *m, *l;
};
__device__ __forceinline__ CombineSmem combine_smem(uint8_t* smem) {
  float* o = reinterpret_cast<float*>(smem);
  float* m = o + kWarps * kMaxGroup * kOStride;
  return {o, m, m + kWarps * kMaxGroup};
}

// kQSmem: the Q fragments live in shared memory ([k-step][lane], one 16-byte load per k-step, reloaded every tile)
// instead of D/4 registers, so the kernel fits 128 registers and 4 CTAs (16 warps) per SM; false keeps them in
// registers (157 registers, 3 CTAs per SM), selectable with TRACE_EXT_KV_DECODE_IMPL=old.
template <int D, bool kQSmem>
__global__ void __launch_bounds__(kThreads, kQSmem ? kMinBlocks : kMinBlocksQReg)
    fp4kv_decode_kernel(const DecodeParams p) {
  using G = Geo<D>;
  extern __shared__ __align__(128) uint8_t smem[];

  const int split = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane / 4, c = lane % 4;  // MMA fragment row / column group

  const SplitTiles sp = split_tiles(p, split, b, warp);
  const int start = sp.start, end = sp.end, my_tiles = sp.my_tiles;

  float o[G::kONTiles][4];
#pragma unroll
  for (int j = 0; j < G::kONTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.0f, 0.0f};

  uint8_t* wsmem = smem + warp * kStages * G::kStageBytes;
  WarpLoader<D> ld{p.k_codes, p.v_codes, p.k_scales, p.v_scales, p.block_table + (int64_t)b * p.max_pages,
                   p.page_size, p.heads_kv, kv_head, lane};
  auto tile_start = [&](int i) { return start + (warp + kWarps * i) * kTile; };
  ld.init(tile_start(0));
  ld.prepare();
  const uint32_t wsmem_addr = smem_addr(wsmem);

  int2 next_ps = pipeline_prologue<D>(ld, wsmem_addr, tile_start, end, my_tiles);

  // ---- Q fragments (fp16, row-scaled by a power of two, head_dim permuted like the K fragments); loaded
  // after the pipeline prologue so its latency overlaps the first K/V tiles ----
  uint32_t qa[kQSmem ? 1 : G::kKSteps][4];  // register-resident Q (kQSmem == false)
  uint4* q_sm = reinterpret_cast<uint4*>(smem + G::kSmemBytes);  // [k-step][lane] (kQSmem)
  float row_scale[2];
  {
    float qv[2][D / 4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int head = r + 8 * h;
      float amax = 0.0f;
      if (head < p.group) {
        const uint4* src = reinterpret_cast<const uint4*>(
            p.q + ((int64_t)b * p.heads_q + (int64_t)kv_head * p.group + head) * D + c * (D / 4));
#pragma unroll
        for (int v = 0; v < D / 32; ++v) {
          const uint4 u = __ldg(src + v);
          const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            qv[h][8 * v + 2 * e] = __uint_as_float(w[e] << 16);
            qv[h][8 * v + 2 * e + 1] = __uint_as_float(w[e] & 0xFFFF0000u);
          }
        }
#pragma unroll
        for (int e = 0; e < D / 4; ++e) amax = fmaxf(amax, fabsf(qv[h][e]));
      } else {
#pragma unroll
        for (int e = 0; e < D / 4; ++e) qv[h][e] = 0.0f;
      }
      const int e2 = q_row_exponent(amax);
      const float up = exp2_exact(e2);
      row_scale[h] = __fmul_rn(p.score_scale, exp2_exact(-e2));
#pragma unroll
      for (int e = 0; e < D / 4; ++e) qv[h][e] = __fmul_rn(qv[h][e], up);
    }
    // k-step 2i + s takes elements 8i + 4s + {0, 2} (k = 2c, 2c+1) and 8i + 4s + {1, 3} (k = 2c+8, 2c+9)
#pragma unroll
    for (int ks = 0; ks < G::kKSteps; ++ks) {
      uint32_t a[4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint2 f = q_frag<D>(qv[h], ks);
        a[h] = f.x;      // a0a1 (row r), a2a3 (row r + 8)
        a[2 + h] = f.y;  // a4a5, a6a7
      }
      if constexpr (kQSmem) {
        // every warp computed the same fragments (same Q rows); warp 0 publishes them
        if (warp == 0) q_sm[ks * 32 + lane] = make_uint4(a[0], a[1], a[2], a[3]);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) qa[ks][e] = a[e];
      }
    }
  }
  if constexpr (kQSmem) __syncthreads();  // Q fragments visible to all warps (the only CTA barrier before the combine)

  // Per-thread shared-memory offsets inside a stage (loop invariant): K rows 8 nt + r (quarter row c), their
  // scale bytes; V rows 2c, 2c+1, 2c+8, 2c+9 (the block of head_dim column r) and their scale bytes.
  int k_off[2], ks_off[2], v_off[4], vs_off[4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int t = 8 * nt + r;
    k_off[nt] = D == 128 ? code_offset<D>(t, c) : code_offset<D>(t, c / 2) + (c % 2) * 8;
    ks_off[nt] = 2 * G::kCodeTile + t * G::kScaleBytes + (D == 128 ? 2 * c : c);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int t = 2 * c + (k & 1) + 8 * (k >> 1);
    const int voff = r * G::kVBytes;  // byte offset of this thread's block inside a row
    v_off[k] = G::kCodeTile + code_offset<D>(t, voff / 16) + voff % 16;
    vs_off[k] = 2 * G::kCodeTile + G::kScaleTile + t * G::kScaleBytes + r * (D / 8) / kNvfp4Block;
  }

  for (int i = 0; i < my_tiles; ++i) {
    pipeline_step<D>(ld, wsmem_addr, tile_start, i, end, my_tiles, next_ps);
    const uint8_t* st = wsmem + (i % kStages) * G::kStageBytes;
    const int t0 = tile_start(i);

    // ---- S = Q.K^T for tokens 8 nt + r (B operand rows), two n8 tiles ----
    // k-steps outermost (each Q fragment is loaded once per tile and feeds both n8 tiles); every s[nt] still
    // accumulates its k-steps in the order 0, 1, ..., so the scores do not depend on kQSmem.
    float s[2][4];
    uint32_t w[2][G::kKWords];
    uint32_t sc[2][G::kKWords];  // half2 (s, s) per word
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
    load_k<D>(st, k_off, ks_off, w, sc);
#pragma unroll
    for (int wi = 0; wi < G::kKWords; ++wi) {
      uint32_t qlo[4], qhi[4];  // Q fragments of k-steps 2 wi and 2 wi + 1
      if constexpr (kQSmem) {
        const uint4 a = q_sm[(2 * wi) * 32 + lane];
        const uint4 b = q_sm[(2 * wi + 1) * 32 + lane];
        qlo[0] = a.x, qlo[1] = a.y, qlo[2] = a.z, qlo[3] = a.w;
        qhi[0] = b.x, qhi[1] = b.y, qhi[2] = b.z, qhi[3] = b.w;
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) qlo[e] = qa[2 * wi][e], qhi[e] = qa[2 * wi + 1][e];
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const uint32_t hb = e2m1_hi_nibbles_to_f16_hibytes(w[nt][wi]);  // nibbles 1, 3, 5, 7
        const uint32_t lb = e2m1_lo_nibbles_to_f16_hibytes(w[nt][wi]);  // nibbles 0, 2, 4, 6
        // k-step 2 wi: b0b1 = (n0, n2), b2b3 = (n1, n3); k-step 2 wi + 1: (n4, n6), (n5, n7)
        mma_f16(s[nt], qlo, dequant_pair(lb, kPairLo, sc[nt][wi]), dequant_pair(hb, kPairLo, sc[nt][wi]));
        mma_f16(s[nt], qhi, dequant_pair(lb, kPairHi, sc[nt][wi]), dequant_pair(hb, kPairHi, sc[nt][wi]));
      }
    }

    // ---- online softmax (log2 domain), rows r and r + 8 ----
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] *= row_scale[e >> 1];
    }
    if (t0 + kTile > end) {  // the last tile of the split: mask tokens past its end (warp-uniform branch)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (t0 + 8 * nt + 2 * c + (e & 1) >= end) s[nt][e] = -INFINITY;
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
    }
    // Lazy rescaling: the running max only moves (and O, l are rescaled) when a row's max grew by more than
    // kRescaleSlack (log2 units); otherwise P = 2^(x - m_run) <= 2^kRescaleSlack, still exact enough in fp16
    // and harmless in the fp32 accumulators. Saves the D/2 multiplies per thread per tile of the O rescale.
    bool grow = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      grow = grow || (mx[h] > m_run[h] + kRescaleSlack);  // also true on the first finite max (m_run = -inf)
    }
    if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float m_new = fmaxf(m_run[h], mx[h]);
        const float alpha = m_new == -INFINITY ? 1.0f : exp2f(m_run[h] - m_new);
        m_run[h] = m_new;
        l_run[h] *= alpha;
#pragma unroll
        for (int j = 0; j < G::kONTiles; ++j) o[j][2 * h] *= alpha, o[j][2 * h + 1] *= alpha;
      }
    }
    float psum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float m_ref = m_run[e >> 1] == -INFINITY ? 0.0f : m_run[e >> 1];
        const float pe = exp2_ftz(s[nt][e] - m_ref);
        s[nt][e] = pe;
        psum[e >> 1] += pe;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) l_run[h] += psum[h];
    uint32_t pa[4];
    {
      __half2 h0 = __floats2half2_rn(s[0][0], s[0][1]);  // row r, tokens 2c, 2c+1
      __half2 h1 = __floats2half2_rn(s[0][2], s[0][3]);  // row r+8
      __half2 h2 = __floats2half2_rn(s[1][0], s[1][1]);  // row r, tokens 8+2c, 9+2c
      __half2 h3 = __floats2half2_rn(s[1][2], s[1][3]);
      pa[0] = *reinterpret_cast<uint32_t*>(&h0);
      pa[1] = *reinterpret_cast<uint32_t*>(&h1);
      pa[2] = *reinterpret_cast<uint32_t*>(&h2);
      pa[3] = *reinterpret_cast<uint32_t*>(&h3);
    }

    // ---- O += P.V: tokens (2c, 2c+1) and (2c+8, 2c+9); head_dim column r owns d = r * D/8 + j ----
    {
      uint32_t vw[4][G::kVWords];
      uint32_t vs2[2];
      load_v<D>(st, v_off, vs_off, vw, vs2);
#pragma unroll
      for (int wi = 0; wi < G::kVWords; ++wi) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          uint32_t hb[2], lb[2];
          expand_v_pairs<D>(vw, wi, half, hb, lb);
          // nibble n of the 4-byte group -> output column j = 8 wi + 4 half + n
          const int j0 = 8 * wi + 4 * half;
          mma_f16(o[j0 + 0], pa, dequant_pair(lb[0], kPairLo, vs2[0]), dequant_pair(lb[1], kPairLo, vs2[1]));
          mma_f16(o[j0 + 1], pa, dequant_pair(hb[0], kPairLo, vs2[0]), dequant_pair(hb[1], kPairLo, vs2[1]));
          mma_f16(o[j0 + 2], pa, dequant_pair(lb[0], kPairHi, vs2[0]), dequant_pair(lb[1], kPairHi, vs2[1]));
          mma_f16(o[j0 + 3], pa, dequant_pair(hb[0], kPairHi, vs2[0]), dequant_pair(hb[1], kPairHi, vs2[1]));
        }
      }
    }
    __syncwarp();
  }
  cp_async_wait<0>();

  // ---- combine the 4 warps' (m, l, O) in shared memory ----
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  __syncthreads();
  const CombineSmem cs = combine_smem(smem);
#pragma unroll
  for (int j = 0; j < G::kONTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = r + 8 * (e >> 1);
      const int n = 2 * c + (e & 1);  // head_dim d = n * D/8 + j
      cs.o[(warp * kMaxGroup + row) * kOStride + n * kOGroup + j] = o[j][e];
    }
  }
  if (c == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      cs.m[warp * kMaxGroup + r + 8 * h] = m_run[h];
      cs.l[warp * kMaxGroup + r + 8 * h] = l_run[h];
    }
  }
  __syncthreads();

  merge_warps<D>(p, cs.o, cs.m, cs.l, split, kv_head, b);
}

// ---- G <= 8: the swapped-operand kernel ---------------------------------------------------------------------
// With at most 8 query heads per KV head, half of the M = 16 rows of the kernel above are padding. Here the
// roles swap: S^T = K.Q^T (A = 16 tokens of K, B = Q^T with the heads as the N = 8 columns) and O^T = V^T.P^T
// (A = 16 head_dim rows of V^T, B = P^T), so every MMA row is real: half the MMAs, half the O accumulators
// (D/4 floats per thread instead of D/2), softmax on 4 instead of 8 scores per thread, and Q fits in
// registers (D/8 per thread). The split bounds, the cp.async pipeline steps, the Q row exponent and fp16 packing,
// the K and V code loads, the V code expansion and the cross-warp combine layout are helpers shared with the
// kernel above (the same code); the fragments map as follows:
// - S^T A fragment (rows = tokens r and r + 8, k = head_dim in the same permutation): the registers that were the
//   B fragments of n8 tiles 0 and 1. Q's B fragment (k, n = head r): the a0a1 / a4a5 halves of its old A.
// - S^T accumulator: lane (r, c) holds tokens r, r + 8 of heads 2c, 2c + 1; the per-head max and sum reduce over
//   r (shuffles 4, 8, 16). P^T as the B operand of O^T needs P[head r][tokens 2c, 2c + 1 (+ 8)], the transpose of
//   what the lane holds: one movmatrix.trans per 8x8 half of the 16-token tile.
// - O^T A fragment for M tile m: head_dim rows r and r + 8 are elements 2m and 2m + 1 of the lane's V block
//   (d = r * D/8 + 2m and + 1): exactly the old B fragments of n8 tiles 2m and 2m + 1.
// - Scores are the same sums over the same products in the same k-step order as the kernel above; P, O and the
//   cross-warp merge use the same formulas (only the per-lane bookkeeping differs).

__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

template <int D>
__global__ void __launch_bounds__(kThreads, kMinBlocksSwap) fp4kv_decode_kernel_g8(const DecodeParams p) {
  using G = Geo<D>;
  constexpr int kMTiles = D / 16;  // M tiles of O^T
  extern __shared__ __align__(128) uint8_t smem[];

  const int split = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane / 4, c = lane % 4;  // MMA fragment row / column group

  const SplitTiles sp = split_tiles(p, split, b, warp);
  const int start = sp.start, end = sp.end, my_tiles = sp.my_tiles;

  float o[kMTiles][4];  // O^T: [m][0] (d row r, head 2c), [1] (r, 2c + 1), [2] (r + 8, 2c), [3] (r + 8, 2c + 1)
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) o[m][0] = o[m][1] = o[m][2] = o[m][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY};  // heads 2c, 2c + 1
  float l_run[2] = {0.0f, 0.0f};

  uint8_t* wsmem = smem + warp * kStages * G::kStageBytes;
  WarpLoader<D> ld{p.k_codes, p.v_codes, p.k_scales, p.v_scales, p.block_table + (int64_t)b * p.max_pages,
                   p.page_size, p.heads_kv, kv_head, lane};
  auto tile_start = [&](int i) { return start + (warp + kWarps * i) * kTile; };
  ld.init(tile_start(0));
  ld.prepare();
  const uint32_t wsmem_addr = smem_addr(wsmem);

  int2 next_ps = pipeline_prologue<D>(ld, wsmem_addr, tile_start, end, my_tiles);

  // ---- Q^T fragments of head r (same scaling and head_dim permutation as the kernel above) ----
  uint32_t qb[G::kKSteps][2];
  float head_scale[2];  // score scale of heads 2c, 2c + 1
  {
    float qv[D / 4];
    float amax = 0.0f;
    if (r < p.group) {
      const uint4* src = reinterpret_cast<const uint4*>(
          p.q + ((int64_t)b * p.heads_q + (int64_t)kv_head * p.group + r) * D + c * (D / 4));
#pragma unroll
      for (int v = 0; v < D / 32; ++v) {
        const uint4 u = __ldg(src + v);
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          qv[8 * v + 2 * e] = __uint_as_float(w[e] << 16);
          qv[8 * v + 2 * e + 1] = __uint_as_float(w[e] & 0xFFFF0000u);
        }
      }
#pragma unroll
      for (int e = 0; e < D / 4; ++e) amax = fmaxf(amax, fabsf(qv[e]));
    } else {
#pragma unroll
      for (int e = 0; e < D / 4; ++e) qv[e] = 0.0f;
    }
    const int e2 = q_row_exponent(amax);
    const float up = exp2_exact(e2);
    const float rs = __fmul_rn(p.score_scale, exp2_exact(-e2));  // head r's score scale
#pragma unroll
    for (int e = 0; e < D / 4; ++e) qv[e] = __fmul_rn(qv[e], up);
    // k-step 2i + s takes elements 8i + 4s + {0, 2} (k = 2c, 2c+1) and 8i + 4s + {1, 3} (k = 2c+8, 2c+9)
#pragma unroll
    for (int ks = 0; ks < G::kKSteps; ++ks) {
      const uint2 f = q_frag<D>(qv, ks);
      qb[ks][0] = f.x;  // b0b1: k = 2c, 2c + 1
      qb[ks][1] = f.y;  // b2b3: k = 2c + 8, 2c + 9
    }
    head_scale[0] = __shfl_sync(0xffffffffu, rs, 8 * c);      // lane of head 2c (r = 2c, c = 0)
    head_scale[1] = __shfl_sync(0xffffffffu, rs, 8 * c + 4);  // head 2c + 1
  }

  // Per-thread shared-memory offsets inside a stage, as in the kernel above.
  int k_off[2], ks_off[2], v_off[4], vs_off[4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int t = 8 * nt + r;
    k_off[nt] = D == 128 ? code_offset<D>(t, c) : code_offset<D>(t, c / 2) + (c % 2) * 8;
    ks_off[nt] = 2 * G::kCodeTile + t * G::kScaleBytes + (D == 128 ? 2 * c : c);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int t = 2 * c + (k & 1) + 8 * (k >> 1);
    const int voff = r * G::kVBytes;
    v_off[k] = G::kCodeTile + code_offset<D>(t, voff / 16) + voff % 16;
    vs_off[k] = 2 * G::kCodeTile + G::kScaleTile + t * G::kScaleBytes + r * (D / 8) / kNvfp4Block;
  }

  for (int i = 0; i < my_tiles; ++i) {
    pipeline_step<D>(ld, wsmem_addr, tile_start, i, end, my_tiles, next_ps);
    const uint8_t* st = wsmem + (i % kStages) * G::kStageBytes;
    const int t0 = tile_start(i);

    // ---- S^T = K.Q^T: rows tokens r (half 0) and 8 + r (half 1), columns heads 2c, 2c + 1 ----
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    {
      uint32_t w[2][G::kKWords];
      uint32_t sc[2][G::kKWords];  // half2 (s, s) per word
      load_k<D>(st, k_off, ks_off, w, sc);
#pragma unroll
      for (int wi = 0; wi < G::kKWords; ++wi) {
        uint32_t hb[2], lb[2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          hb[nt] = e2m1_hi_nibbles_to_f16_hibytes(w[nt][wi]);  // nibbles 1, 3, 5, 7
          lb[nt] = e2m1_lo_nibbles_to_f16_hibytes(w[nt][wi]);  // nibbles 0, 2, 4, 6
        }
        // k-step 2 wi: (n0, n2) for k = 2c, 2c+1 and (n1, n3) for k = 2c+8, 2c+9; k-step 2 wi + 1: n4..n7
        const uint32_t a0[4] = {dequant_pair(lb[0], kPairLo, sc[0][wi]), dequant_pair(lb[1], kPairLo, sc[1][wi]),
                                dequant_pair(hb[0], kPairLo, sc[0][wi]), dequant_pair(hb[1], kPairLo, sc[1][wi])};
        mma_f16(s, a0, qb[2 * wi][0], qb[2 * wi][1]);
        const uint32_t a1[4] = {dequant_pair(lb[0], kPairHi, sc[0][wi]), dequant_pair(lb[1], kPairHi, sc[1][wi]),
                                dequant_pair(hb[0], kPairHi, sc[0][wi]), dequant_pair(hb[1], kPairHi, sc[1][wi])};
        mma_f16(s, a1, qb[2 * wi + 1][0], qb[2 * wi + 1][1]);
      }
    }

    // ---- online softmax (log2 domain) per head (column) over the 16 tokens (rows) ----
#pragma unroll
    for (int e = 0; e < 4; ++e) s[e] *= head_scale[e & 1];
    if (t0 + kTile > end) {  // the last tile of the split: mask tokens past its end (warp-uniform branch)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (t0 + r + 8 * (e >> 1) >= end) s[e] = -INFINITY;
      }
    }
    float mx[2] = {fmaxf(s[0], s[2]), fmaxf(s[1], s[3])};
    bool grow = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 4));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 8));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 16));
      grow = grow || (mx[h] > m_run[h] + kRescaleSlack);  // lazy rescaling, as in the kernel above
    }
    if (__any_sync(0xffffffffu, grow)) {
      float alpha[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float m_new = fmaxf(m_run[h], mx[h]);
        alpha[h] = m_new == -INFINITY ? 1.0f : exp2f(m_run[h] - m_new);
        m_run[h] = m_new;
        l_run[h] *= alpha[h];
      }
#pragma unroll
      for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[m][e] *= alpha[e & 1];
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float m_ref = m_run[e & 1] == -INFINITY ? 0.0f : m_run[e & 1];
      s[e] = exp2_ftz(s[e] - m_ref);
    }
    l_run[0] += s[0] + s[2];  // this lane's tokens only; summed over r after the loop
    l_run[1] += s[1] + s[3];
    uint32_t pb[2];  // P^T B fragment: P[head r][tokens 2c, 2c+1] and [2c+8, 2c+9]
    {
      __half2 h0 = __floats2half2_rn(s[0], s[1]);  // token r, heads 2c, 2c+1
      __half2 h1 = __floats2half2_rn(s[2], s[3]);  // token r + 8
      pb[0] = movmatrix_trans(*reinterpret_cast<uint32_t*>(&h0));
      pb[1] = movmatrix_trans(*reinterpret_cast<uint32_t*>(&h1));
    }

    // ---- O^T += V^T.P^T: tokens (2c, 2c+1) and (2c+8, 2c+9); d rows r, r + 8 of M tile m are elements 2m, 2m + 1
    // of this lane's head_dim block (d = r * D/8 + j) ----
    {
      uint32_t vw[4][G::kVWords];
      uint32_t vs2[2];
      load_v<D>(st, v_off, vs_off, vw, vs2);
#pragma unroll
      for (int wi = 0; wi < G::kVWords; ++wi) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          uint32_t hb[2], lb[2];
          expand_v_pairs<D>(vw, wi, half, hb, lb);
          // element j = 8 wi + 4 half + n of the block: n = 0 (lb, lo), 1 (hb, lo), 2 (lb, hi), 3 (hb, hi);
          // M tile j0 / 2 takes elements j0, j0 + 1, M tile j0 / 2 + 1 takes j0 + 2, j0 + 3
          const int m0 = (8 * wi + 4 * half) / 2;
          const uint32_t a0[4] = {dequant_pair(lb[0], kPairLo, vs2[0]), dequant_pair(hb[0], kPairLo, vs2[0]),
                                  dequant_pair(lb[1], kPairLo, vs2[1]), dequant_pair(hb[1], kPairLo, vs2[1])};
          mma_f16(o[m0], a0, pb[0], pb[1]);
          const uint32_t a1[4] = {dequant_pair(lb[0], kPairHi, vs2[0]), dequant_pair(hb[0], kPairHi, vs2[0]),
                                  dequant_pair(lb[1], kPairHi, vs2[1]), dequant_pair(hb[1], kPairHi, vs2[1])};
          mma_f16(o[m0 + 1], a1, pb[0], pb[1]);
        }
      }
    }
    __syncwarp();
  }
  cp_async_wait<0>();

  // ---- combine the 4 warps' (m, l, O) in shared memory (layout of the kernel above, heads 0..7 only) ----
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 4);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 8);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 16);
  }
  __syncthreads();
  const CombineSmem cs = combine_smem(smem);
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int head = 2 * c + (e & 1);
      const int j = 2 * m + (e >> 1);  // d = r * D/8 + j
      cs.o[(warp * kMaxGroup + head) * kOStride + r * kOGroup + j] = o[m][e];
    }
  }
  if (r == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      cs.m[warp * kMaxGroup + 2 * c + h] = m_run[h];
      cs.l[warp * kMaxGroup + 2 * c + h] = l_run[h];
    }
  }
  __syncthreads();
  merge_warps<D>(p, cs.o, cs.m, cs.l, split, kv_head, b);
}

// A register the compiler must keep: ptxas otherwise rematerializes thread-id-derived offsets (swizzle math,
// ~20 instructions) inside the main loop under the register cap of 5 CTAs per SM.
__device__ __forceinline__ uint32_t pinned(uint32_t x) {
  uint32_t y;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ const uint8_t* pinned_ptr(const uint8_t* x) {
  const uint8_t* y;
  asm volatile("mov.b64 %0, %1;\n" : "=l"(y) : "l"(x));
  return y;
}

// ---- heads kernel: the 4 warps of a CTA on 4 KV heads of the same tokens (TRACE_EXT_KV_DECODE_IMPL=heads) ----
// The g8 kernel above reads, per warp and 16-token tile, 16 code rows of D/2 bytes spaced H_kv * D/2 bytes
// apart plus 16 scale pieces of D/16 bytes (one 32-byte sector each), and every warp walks the page table and
// rebuilds its copy addresses per tile (~110 of ~560 instructions per tile). In the [page, token, head, D/2]
// layout the codes of 4 consecutive KV heads of one token are one contiguous 2 D-byte run, and 16 tokens of one
// page are 16 such runs H_kv * D/2 bytes apart (for H_kv = 4: one contiguous 4 KB block per tile). So here a
// CTA owns a group of 4 KV heads (warp w = head 4 hg + w) and a token range, and the 128 threads copy each
// 16-token tile together into a CTA-shared stage:
// - thread tid copies token tid / 8 of the tile: 16-byte chunks tid % 8 (and tid % 8 + 8 at D = 128) of its K
//   and V run, and (threads with tid % 8 < 2 * kScaleChunks) one 16-byte chunk of the token's 4 * D/16 K or V
//   scale bytes: every global access is a whole 16-byte piece of a contiguous run, no 8-byte scale pieces.
// - one address per thread per tile: row = (page * P + slot) * H_kv + 4 hg (two IMADs), the chunk offsets
//   are immediates, the stage offset is a uniform register. The thread's block-table pointer steps with its
//   token; the page id of the next tile is loaded one tile ahead (all threads of a token load the same word: one
//   broadcast request), and only when the column changes: once per page, not per tile.
// - one __syncthreads per tile (the stage ring is shared by the 4 warps); the warps do equal work (same
//   tokens, one head each), so the barrier costs little, and several CTAs per SM hide it.
// - per warp the arithmetic is the g8 kernel's (same expansion, MMAs, k-step order, softmax and output
//   formulas) with stage offsets of the new layout. As a warp owns all tokens of its head, there is no
//   cross-warp merge: each warp writes its G heads' output (or split partial) straight from its accumulators,
//   with the same formulas as merge_warps at one warp (f = 1); the fused split finish does combine_splits'
//   arithmetic in the same order (weights per row once, then float4 columns with 4 splits' loads in flight: the
//   last CTA combines 4 G rows, and one dependent load chain per output element would leave a long serial tail),
//   so the fused and the separate combine agree bit for bit.
// - shared layout of a stage: K codes [16 tokens][4 heads][D/2] as 16-byte chunks, XOR-swizzled per 128-byte
//   line (kHeadsSwz below: conflict-free K quarter-row reads and V 2-token reads), V codes the same, then K and
//   V scales [16 tokens][kScaleRow] (rows padded to 48 bytes at D = 128 so that the 8 tokens of a warp's
//   scale reads hit distinct banks).
// Requirements (else the g8 / qsmem kernels run): G <= 8, H_kv % 4 == 0, 16-byte aligned cache bases.
constexpr int kHeadsPerCta = kWarps;   // KV heads per CTA, one per warp
constexpr int kMinBlocksHeads = 5;     // CTAs per SM (<= 102 registers, 5 x 38 KB shared at D = 128)
constexpr int kMinBlocksHeads8 = 2;    // heads8 (8 warps): CTAs per SM (<= 128 registers, 2 x 59 KB shared at D = 128)
// heads8's stage ring (stages of 2 tiles): 3 since the H200 A/B of round 22 (1.01-1.03x over 4 on the four bench_kv
// decode cases in both passes, bit-equal; 2 stages 0.98-0.99x), TRACE_EXT_KV_DECODE_RING=4 / 2 (read per call) select
// the others.
constexpr int kHeads8Ring = 3;
constexpr int64_t kHeadsFusedMax = 1 << 16;  // partial floats (splits x 4 G x D) the fused finish of one CTA reads

template <int D>
struct HGeo {
  static constexpr int kTokBytes = kHeadsPerCta * D / 2;       // code bytes of one token's 4 heads
  static constexpr int kTokChunks = kTokBytes / 16;            // 16 (D = 128) or 8 (D = 64)
  static constexpr int kChunksPerThread = kTokChunks / 8;      // 8 threads per token
  static constexpr int kScaleTokBytes = kHeadsPerCta * D / kNvfp4Block;  // 32 or 16
  static constexpr int kScaleChunks = kScaleTokBytes / 16;     // 2 or 1
  static constexpr int kScaleRow = D == 128 ? 48 : 16;         // padded scale row in shared memory
  static constexpr int kCodeTile = kTile * kTokBytes;
  static constexpr int kScaleTile = kTile * kScaleRow;
  static constexpr int kStageBytes = 2 * kCodeTile + 2 * kScaleTile;
  static constexpr int kSmem = kStages * kStageBytes;
  static_assert(kThreads == kTile * 8, "8 threads copy one token of a tile");
  static_assert(kTokChunks % 8 == 0 && 2 * kScaleChunks <= 8, "a token's chunks split evenly over its 8 threads");
  static_assert(kScaleRow % 16 == 0 && kScaleRow >= kScaleTokBytes, "scale rows hold 16-byte copies");
  static_assert(kStageBytes % 128 == 0, "stages stay 128-byte aligned (swizzled lines)");
};

// XOR mask of the 16-byte slot inside 128-byte line `l` of a heads-kernel code tile. D = 128 (2 lines per token,
// slot = 4 (head % 2) + chunk): bit 2 = l.1 ^ l.3, bit 1 = l.2, so the K reads (tokens t, t + 1 in one
// 8-lane phase) and the V reads (tokens 2c + k of the 4 column groups) land in 8 distinct slots. D = 64 (one
// line per token, slot = 2 head + chunk): bit 1 = l.0 ^ l.2, bit 2 = l.1 (4 consecutive tokens for K, tokens
// 2c + k for V).
template <int D>
__host__ __device__ constexpr int heads_swz(int line) {
  return D == 128 ? ((((line >> 1) ^ (line >> 3)) & 1) << 2) | (((line >> 2) & 1) << 1)
                  : (((line ^ (line >> 2)) & 1) << 1) | (((line >> 1) & 1) << 2);
}
// Byte offset of chunk `q` (0 .. kTokChunks - 1) of token `t` inside a code tile.
template <int D>
__host__ __device__ constexpr int heads_code_offset(int t, int q) {
  const int lin = t * HGeo<D>::kTokChunks + q;
  const int line = lin / 8;
  return line * 128 + ((lin % 8) ^ heads_swz<D>(line)) * 16;
}

// The offset shortcuts of the heads kernel: chunk q + 8 of a token is chunk q one line later (D = 128), and token
// t + 8 is token t plus 8 token runs, for every token and chunk of a tile.
template <int D>
constexpr bool heads_layout_shortcuts_hold() {
  for (int t = 0; t < kTile; ++t) {
    for (int q = 0; q < HGeo<D>::kTokChunks; ++q) {
      if (q + 8 < HGeo<D>::kTokChunks && heads_code_offset<D>(t, q + 8) != heads_code_offset<D>(t, q) + 128)
        return false;
      if (t + 8 < kTile && heads_code_offset<D>(t + 8, q) != heads_code_offset<D>(t, q) + 8 * HGeo<D>::kTokBytes)
        return false;
    }
  }
  return true;
}
static_assert(heads_layout_shortcuts_hold<64>() && heads_layout_shortcuts_hold<128>(),
              "heads kernel: the swizzle must map chunk q + 8 and token t + 8 to constant offsets");

// The fused split finish of the heads kernel (last CTA of a (sequence, head group)): combine_splits' arithmetic
// (same max, same weights 2^(lse_s - max), l and every output summed in split order, so bit-equal to the combine
// kernel), restructured for 4 G rows: the weights of each row once into shared memory (the drained stage ring;
// rows x splits <= kHeadsFusedMax / D floats), then each thread sums float4 columns with the loads of 4 splits in
// flight, instead of a dependent load chain per output element.
template <int D, int kNT = kThreads>
__device__ __forceinline__ void heads_split_finish(const DecodeParams& p, uint8_t* smem, int hg, int b) {
  const int rows = kHeadsPerCta * p.group, n = p.num_splits;
  const int64_t bh0 = (int64_t)b * p.heads_q + (int64_t)hg * kHeadsPerCta * p.group;
  float* f_sm = reinterpret_cast<float*>(smem);  // [rows][n]
  float* l_sm = f_sm + rows * n;                 // [rows]
  float* m_sm = l_sm + rows;                     // [rows], log2 units
  for (int row = threadIdx.x; row < rows; row += kNT) {
    const float* lp = p.lse_part + (bh0 + row) * n;
    float m = -INFINITY;
#pragma unroll 8
    for (int s = 0; s < n; ++s) m = fmaxf(m, __ldcg(lp + s));
    float l = 0.0f;
#pragma unroll 8
    for (int s = 0; s < n; ++s) {
      const float ls = __ldcg(lp + s);
      float fw = 0.0f;  // empty splits (and rows) weigh 0; their partials are exact zeros
      if (m != -INFINITY && ls != -INFINITY) {
        fw = exp2f(ls - m);
        l += fw;
      }
      f_sm[row * n + s] = fw;
    }
    l_sm[row] = l;
    m_sm[row] = m;
  }
  __syncthreads();
  constexpr int kCols = D / 4;
  for (int idx = threadIdx.x; idx < rows * kCols; idx += kNT) {
    const int row = idx / kCols, c4 = idx % kCols;
    const float* fw = f_sm + row * n;
    const float4* op = reinterpret_cast<const float4*>(p.o_part + (bh0 + row) * n * D) + c4;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
    for (int s = 0; s < n; ++s) {
      const float4 v = __ldcg(op + s * kCols);
      const float w = fw[s];
      acc[0] += w * v.x;
      acc[1] += w * v.y;
      acc[2] += w * v.z;
      acc[3] += w * v.w;
    }
    const float l = l_sm[row];
    const bool empty = !(l > 0.0f);
    const int64_t bh = bh0 + row;
    __nv_bfloat162 lo = __floats2bfloat162_rn(empty ? 0.0f : acc[0] / l, empty ? 0.0f : acc[1] / l);
    __nv_bfloat162 hi = __floats2bfloat162_rn(empty ? 0.0f : acc[2] / l, empty ? 0.0f : acc[3] / l);
    *reinterpret_cast<uint2*>(p.out + bh * D + 4 * c4) =
        make_uint2(*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
    if (c4 == 0) p.lse[bh] = empty ? -INFINITY : (m_sm[row] + log2f(l)) * kLn2;
  }
}

// heads8: the cross-warp merge of the two warps of one KV head (sets 0 and 1, the same lane layout): set 1 stores
// its (O, m, l) lane-major in the drained ring ([head][value][lane] floats: conflict free), set 0 rescales both to
// the common max (weights 2^(m_set - m), 0 for a set that saw no token, as in merge_warps) and adds them in
// registers, then writes the output with the 4-warp kernel's epilogue. Called by all threads of the CTA.
template <int D>
__device__ __forceinline__ void merge_warp_sets(uint8_t* smem, int warp, int set, int lane, float (&o)[D / 16][4],
                                                float (&m_run)[2], float (&l_run)[2]) {
  constexpr int kVals = D / 16 * 4 + 4;  // O accumulators, m[2], l[2]
  static_assert(kWarps * kVals * 32 * 4 <= HGeo<D>::kSmem, "the merge buffer fits in the drained ring");
  float* buf = reinterpret_cast<float*>(smem) + warp * kVals * 32 + lane;
  __syncthreads();  // every warp is done with its last stage
  if (set == 1) {
#pragma unroll
    for (int m = 0; m < D / 16; ++m) {
#pragma unroll
      for (int e = 0; e < 4; ++e) buf[(4 * m + e) * 32] = o[m][e];
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      buf[(kVals - 4 + h) * 32] = m_run[h];
      buf[(kVals - 2 + h) * 32] = l_run[h];
    }
  }
  __syncthreads();
  if (set != 0) return;
  float f0[2], f1[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m1 = buf[(kVals - 4 + h) * 32], l1 = buf[(kVals - 2 + h) * 32];
    const float m_all = fmaxf(m_run[h], m1);
    f0[h] = m_run[h] == -INFINITY ? 0.0f : exp2f(m_run[h] - m_all);
    f1[h] = m1 == -INFINITY ? 0.0f : exp2f(m1 - m_all);
    l_run[h] = __fadd_rn(__fmul_rn(f0[h], l_run[h]), __fmul_rn(f1[h], l1));
    m_run[h] = m_all;
  }
#pragma unroll
  for (int m = 0; m < D / 16; ++m) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      o[m][e] = __fadd_rn(__fmul_rn(f0[e & 1], o[m][e]), __fmul_rn(f1[e & 1], buf[(4 * m + e) * 32]));
  }
}

template <int D, int kSets, int kRing = kStages>
__global__ void __launch_bounds__(kSets * kThreads, kSets == 1 ? kMinBlocksHeads : kMinBlocksHeads8)
    fp4kv_decode_kernel_heads(const DecodeParams p) {
  using G = Geo<D>;
  using H = HGeo<D>;
  constexpr int kMTiles = D / 16;  // M tiles of O^T
  static_assert(kSets == 1 || kSets == 2, "one or two warps per KV head");
  constexpr int kSetTokens = kSets * kTile;               // tokens per stage (one 16-token tile per warp set)
  constexpr int kSetStage = kSets * H::kStageBytes;        // a stage: kSets tiles of the 4-warp layout, back to back
  extern __shared__ __align__(128) uint8_t smem[];

  const int split = blockIdx.x, hg = blockIdx.y, b = blockIdx.z;
  // warp = the KV head inside the group; set = which tile of a stage this warp computes (heads8: two warps per head)
  const int warp = kSets == 1 ? threadIdx.x / 32 : (threadIdx.x / 32) % kWarps, lane = threadIdx.x % 32;
  const int set = kSets == 1 ? 0 : (int)(threadIdx.x / 32) / kWarps;
  const int r = lane / 4, c = lane % 4;  // MMA fragment row / column group
  const int kv_head = hg * kHeadsPerCta + warp;

  const int len = __ldg(p.seq_lens + b);
  const int per_split = (len + p.num_splits - 1) / p.num_splits;
  const int chunk_len = (per_split + kTile - 1) / kTile * kTile;
  const int start = split * chunk_len;
  const int end = min(len, start + chunk_len);
  const int n_tiles = end > start ? (end - start + kTile - 1) / kTile : 0;
  const int n_stages = (n_tiles + kSets - 1) / kSets;  // stages of kSets tiles (the last may hold one)

  // ---- copy plan of this thread: token tt of every stage, chunks sub (+ 8), one scale chunk if sub < 2 kScaleChunks
  const int tt = threadIdx.x / 8, sub = threadIdx.x % 8;
  const int psize = p.page_size;
  const int step_col = kSetTokens / psize, step_slot = kSetTokens % psize;
  // this thread's token in the next tile to issue, its page slot, its block-table entry and page id (loaded one
  // tile ahead, and only when the token moves to another table column)
  int tok = start + tt;
  int slot = tok % psize;
  const int32_t* tp = p.block_table + (int64_t)b * p.max_pages + tok / psize;
  int page = tok < end ? __ldg(tp) : 0;
  const uint32_t row_stride = (uint32_t)p.heads_kv;  // cache rows per token slot
  const uint32_t head0 = (uint32_t)(hg * kHeadsPerCta);
  const bool has_scale = sub < 2 * H::kScaleChunks;
  const uint8_t* scale_src =
      pinned_ptr((sub >= H::kScaleChunks ? p.v_scales : p.k_scales) + (sub % H::kScaleChunks) * 16);
  const uint32_t sub_bytes = pinned(sub * 16);  // this thread's chunk inside a token's run
  uint32_t issue_stage = 0;  // stage offset of the next tile to issue
  // chunk sub + 8 of a token lies one line after chunk sub, under the same swizzle mask: one register
  // (heads8: token tt of a stage is token tt % 16 of its tile tt / 16)
  const int tile_off = kSets == 1 ? 0 : (tt / kTile) * H::kStageBytes;
  const int ttt = kSets == 1 ? tt : tt % kTile;
  const uint32_t dst_code = pinned(tile_off + heads_code_offset<D>(ttt, sub));
  const uint32_t dst_scale = pinned(tile_off + 2 * H::kCodeTile + (sub >= H::kScaleChunks ? H::kScaleTile : 0) +
                                    ttt * H::kScaleRow + (sub % H::kScaleChunks) * 16);
  const uint32_t smem_base = smem_addr(smem);

  // Copies the next tile (tiles are issued in order, once each: tile j goes to stage j % kRing) and steps the
  // plan to the tile after it.
  auto issue = [&]() {
    const bool valid = tok < end;
    const uint32_t row = valid ? ((uint32_t)page * (uint32_t)psize + (uint32_t)slot) * row_stride + head0 : 0u;
    const uint32_t stage = smem_base + issue_stage;
    const int bytes = valid ? 16 : 0;
    const size_t code_off = (size_t)row * G::kRowBytes + sub_bytes;
#pragma unroll
    for (int j = 0; j < H::kChunksPerThread; ++j) {
      cp_async_16(stage + dst_code + 128 * j, p.k_codes + code_off + 128 * j, bytes);
      cp_async_16(stage + H::kCodeTile + dst_code + 128 * j, p.v_codes + code_off + 128 * j, bytes);
    }
    if (has_scale) cp_async_16(stage + dst_scale, scale_src + (size_t)row * G::kScaleBytes, bytes);
    issue_stage = issue_stage == (kRing - 1) * kSetStage ? 0u : issue_stage + kSetStage;
    // next tile of this thread's token: same page unless the column moves (then one table load)
    tok += kSetTokens;
    slot += step_slot;
    tp += step_col;
    bool moved = step_col != 0;
    if (slot >= psize) slot -= psize, ++tp, moved = true;
    if (moved && tok < end) page = __ldg(tp);
  };

#pragma unroll
  for (int s = 0; s < kRing - 1; ++s) {
    if (s < n_stages) issue();
    cp_async_commit();
  }

  // ---- Q^T fragments of head r of this warp's KV head (as in the g8 kernel) ----
  uint32_t qb[G::kKSteps][2];
  float head_scale[2];  // score scale of heads 2c, 2c + 1
  {
    float qv[D / 4];
    float amax = 0.0f;
    if (r < p.group) {
      const uint4* src = reinterpret_cast<const uint4*>(
          p.q + ((int64_t)b * p.heads_q + (int64_t)kv_head * p.group + r) * D + c * (D / 4));
#pragma unroll
      for (int v = 0; v < D / 32; ++v) {
        const uint4 u = __ldg(src + v);
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          qv[8 * v + 2 * e] = __uint_as_float(w[e] << 16);
          qv[8 * v + 2 * e + 1] = __uint_as_float(w[e] & 0xFFFF0000u);
        }
      }
#pragma unroll
      for (int e = 0; e < D / 4; ++e) amax = fmaxf(amax, fabsf(qv[e]));
    } else {
#pragma unroll
      for (int e = 0; e < D / 4; ++e) qv[e] = 0.0f;
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    int e2 = 0;
    if (amax > 0.0f && isfinite(amax)) {
      const int field = (int)((__float_as_uint(amax) >> 23) & 0xFFu);
      e2 = kQExp - (field == 0 ? -127 : field - 127);
      e2 = max(-126, min(127, e2));
    }
    const float up = exp2_exact(e2);
    const float rs = __fmul_rn(p.score_scale, exp2_exact(-e2));
#pragma unroll
    for (int e = 0; e < D / 4; ++e) qv[e] = __fmul_rn(qv[e], up);
#pragma unroll
    for (int ks = 0; ks < G::kKSteps; ++ks) {
      const int base = 8 * (ks / 2) + 4 * (ks % 2);
      __half2 lo = __floats2half2_rn(qv[base + 0], qv[base + 2]);
      __half2 hi = __floats2half2_rn(qv[base + 1], qv[base + 3]);
      qb[ks][0] = *reinterpret_cast<uint32_t*>(&lo);
      qb[ks][1] = *reinterpret_cast<uint32_t*>(&hi);
    }
    head_scale[0] = __shfl_sync(0xffffffffu, rs, 8 * c);
    head_scale[1] = __shfl_sync(0xffffffffu, rs, 8 * c + 4);
  }

  // Per-thread offsets inside a stage: K rows 8 nt + r of head `warp` (quarter row c), their scale bytes; V rows
  // 2c, 2c+1, 2c+8, 2c+9 (the block of head_dim column r) and their scale bytes. Token t + 8 sits kToken8 bytes
  // after token t under the same swizzle mask (heads_swz ignores the line bits that 8 tokens add), so only the
  // offsets of tokens r (K) and 2c, 2c + 1 (V) are registers; the rest are immediates of the shared loads.
  constexpr int kHeadChunks = D / 32;  // 16-byte chunks of one head's code row
  constexpr int kToken8 = 8 * H::kTokBytes;
  const int set_off = set * H::kStageBytes;  // heads8: this warp set's tile inside a stage
  const int k_off0 = pinned(set_off + (D == 128 ? heads_code_offset<D>(r, warp * kHeadChunks + c)
                                                : heads_code_offset<D>(r, warp * kHeadChunks + c / 2) + (c % 2) * 8));
  const int ks_off0 =
      pinned(set_off + 2 * H::kCodeTile + r * H::kScaleRow + warp * G::kScaleBytes + (D == 128 ? 2 * c : c));
  const int k_off[2] = {k_off0, k_off0 + kToken8};
  const int ks_off[2] = {ks_off0, ks_off0 + 8 * H::kScaleRow};
  const int voff = r * G::kVBytes;  // this thread's block inside a head's code row
  const int v_off0 =
      pinned(set_off + H::kCodeTile + heads_code_offset<D>(2 * c, warp * kHeadChunks + voff / 16) + voff % 16);
  const int v_off1 =
      pinned(set_off + H::kCodeTile + heads_code_offset<D>(2 * c + 1, warp * kHeadChunks + voff / 16) + voff % 16);
  const int v_off[4] = {v_off0, v_off1, v_off0 + kToken8, v_off1 + kToken8};
  const int vs_off0 = pinned(set_off + 2 * H::kCodeTile + H::kScaleTile + 2 * c * H::kScaleRow + warp * G::kScaleBytes +
                             r * (D / 8) / kNvfp4Block);
  const int vs_off[4] = {vs_off0, vs_off0 + H::kScaleRow, vs_off0 + 8 * H::kScaleRow, vs_off0 + 9 * H::kScaleRow};

  float o[kMTiles][4];
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) o[m][0] = o[m][1] = o[m][2] = o[m][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY};  // heads 2c, 2c + 1
  float l_run[2] = {0.0f, 0.0f};

  for (int i = 0; i < n_stages; ++i) {
    cp_async_wait<kRing - 2>();
    __syncthreads();  // stage i landed for all threads; every warp is done with stage i - 1
    if (i + kRing - 1 < n_stages) issue();
    cp_async_commit();

    const uint8_t* st = smem + (i % kRing) * kSetStage;
    const int tile = kSets * i + set;  // heads8: set 1's tile of the last stage may lie past the split
    if (kSets > 1 && tile >= n_tiles) continue;
    const int t0 = start + tile * kTile;

    // ---- S^T = K.Q^T (as in the g8 kernel) ----
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    {
      uint32_t w[2][G::kKWords];
      uint32_t sc[2][G::kKWords];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        if constexpr (D == 128) {
          const uint4 u = *reinterpret_cast<const uint4*>(st + k_off[nt]);
          w[nt][0] = u.x, w[nt][1] = u.y, w[nt][2] = u.z, w[nt][3] = u.w;
          const uint32_t s2 = e4m3x2_to_half2(*reinterpret_cast<const uint16_t*>(st + ks_off[nt]));
          sc[nt][0] = sc[nt][1] = __byte_perm(s2, 0u, 0x1010);
          sc[nt][2] = sc[nt][3] = __byte_perm(s2, 0u, 0x3232);
        } else {
          const uint2 u = *reinterpret_cast<const uint2*>(st + k_off[nt]);
          w[nt][0] = u.x, w[nt][1] = u.y;
          const uint32_t s2 = e4m3x2_to_half2(st[ks_off[nt]]);
          sc[nt][0] = sc[nt][1] = __byte_perm(s2, 0u, 0x1010);
        }
      }
#pragma unroll
      for (int wi = 0; wi < G::kKWords; ++wi) {
        uint32_t hb[2], lb[2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          hb[nt] = e2m1_hi_nibbles_to_f16_hibytes(w[nt][wi]);
          lb[nt] = e2m1_lo_nibbles_to_f16_hibytes(w[nt][wi]);
        }
        const uint32_t a0[4] = {hmul2(f16x2_from_hibytes(lb[0], kPairLo), sc[0][wi]),
                                hmul2(f16x2_from_hibytes(lb[1], kPairLo), sc[1][wi]),
                                hmul2(f16x2_from_hibytes(hb[0], kPairLo), sc[0][wi]),
                                hmul2(f16x2_from_hibytes(hb[1], kPairLo), sc[1][wi])};
        mma_f16(s, a0, qb[2 * wi][0], qb[2 * wi][1]);
        const uint32_t a1[4] = {hmul2(f16x2_from_hibytes(lb[0], kPairHi), sc[0][wi]),
                                hmul2(f16x2_from_hibytes(lb[1], kPairHi), sc[1][wi]),
                                hmul2(f16x2_from_hibytes(hb[0], kPairHi), sc[0][wi]),
                                hmul2(f16x2_from_hibytes(hb[1], kPairHi), sc[1][wi])};
        mma_f16(s, a1, qb[2 * wi + 1][0], qb[2 * wi + 1][1]);
      }
    }

    // ---- online softmax (log2 domain) per head over the 16 tokens (as in the g8 kernel) ----
#pragma unroll
    for (int e = 0; e < 4; ++e) s[e] *= head_scale[e & 1];
    if (t0 + kTile > end) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (t0 + r + 8 * (e >> 1) >= end) s[e] = -INFINITY;
      }
    }
    float mx[2] = {fmaxf(s[0], s[2]), fmaxf(s[1], s[3])};
    bool grow = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 4));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 8));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 16));
      grow = grow || (mx[h] > m_run[h] + kRescaleSlack);
    }
    if (__any_sync(0xffffffffu, grow)) {
      float alpha[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float m_new = fmaxf(m_run[h], mx[h]);
        alpha[h] = m_new == -INFINITY ? 1.0f : exp2f(m_run[h] - m_new);
        m_run[h] = m_new;
        l_run[h] *= alpha[h];
      }
#pragma unroll
      for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[m][e] *= alpha[e & 1];
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float m_ref = m_run[e & 1] == -INFINITY ? 0.0f : m_run[e & 1];
      s[e] = exp2_ftz(s[e] - m_ref);
    }
    l_run[0] += s[0] + s[2];
    l_run[1] += s[1] + s[3];
    uint32_t pb[2];
    {
      __half2 h0 = __floats2half2_rn(s[0], s[1]);
      __half2 h1 = __floats2half2_rn(s[2], s[3]);
      pb[0] = movmatrix_trans(*reinterpret_cast<uint32_t*>(&h0));
      pb[1] = movmatrix_trans(*reinterpret_cast<uint32_t*>(&h1));
    }

    // ---- O^T += V^T.P^T (as in the g8 kernel) ----
    {
      uint32_t vw[4][G::kVWords];
      uint32_t vs2[2];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint8_t* src = st + v_off[k];
        if constexpr (G::kVWords == 2) {
          const uint2 u = *reinterpret_cast<const uint2*>(src);
          vw[k][0] = u.x, vw[k][1] = u.y;
        } else {
          vw[k][0] = *reinterpret_cast<const uint32_t*>(src);
        }
      }
#pragma unroll
      for (int pr = 0; pr < 2; ++pr) {
        vs2[pr] = e4m3x2_to_half2((uint32_t)st[vs_off[2 * pr]] | ((uint32_t)st[vs_off[2 * pr + 1]] << 8));
      }
#pragma unroll
      for (int wi = 0; wi < G::kVWords; ++wi) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint32_t sel = half == 0 ? 0x5140u : 0x7362u;
          uint32_t hb[2], lb[2];
#pragma unroll
          for (int pr = 0; pr < 2; ++pr) {
            const uint32_t z = __byte_perm(vw[2 * pr][wi], vw[2 * pr + 1][wi], sel);
            hb[pr] = e2m1_hi_nibbles_to_f16_hibytes(z);
            lb[pr] = e2m1_lo_nibbles_to_f16_hibytes(z);
          }
          const int m0 = (8 * wi + 4 * half) / 2;
          const uint32_t a0[4] = {hmul2(f16x2_from_hibytes(lb[0], kPairLo), vs2[0]),
                                  hmul2(f16x2_from_hibytes(hb[0], kPairLo), vs2[0]),
                                  hmul2(f16x2_from_hibytes(lb[1], kPairLo), vs2[1]),
                                  hmul2(f16x2_from_hibytes(hb[1], kPairLo), vs2[1])};
          mma_f16(o[m0], a0, pb[0], pb[1]);
          const uint32_t a1[4] = {hmul2(f16x2_from_hibytes(lb[0], kPairHi), vs2[0]),
                                  hmul2(f16x2_from_hibytes(hb[0], kPairHi), vs2[0]),
                                  hmul2(f16x2_from_hibytes(lb[1], kPairHi), vs2[1]),
                                  hmul2(f16x2_from_hibytes(hb[1], kPairHi), vs2[1])};
          mma_f16(o[m0 + 1], a1, pb[0], pb[1]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // ---- this warp's heads 2c, 2c + 1 (if < G): lane (r, c) holds d = r * D/8 + j, j = 0 .. D/8 - 1 ----
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 4);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 8);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 16);
  }
  // heads8: set 1's (m, l, O) joins set 0's warp of the same head; set 0 writes the result
  if constexpr (kSets > 1) merge_warp_sets<D>(smem, warp, set, lane, o, m_run, l_run);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = 2 * c + h;
    if (head >= p.group || set != 0) continue;
    const int64_t bh = (int64_t)b * p.heads_q + (int64_t)kv_head * p.group + head;
    // merge_warps' formulas at one warp: f = exp2(m - m) = 1, o_all = 1 * o, l_all = 1 * l
    const bool empty = !(l_run[h] > 0.0f);
    const float lse2 = empty ? -INFINITY : m_run[h] + log2f(l_run[h]);
    float val[D / 8];
#pragma unroll
    for (int m = 0; m < kMTiles; ++m) {
      val[2 * m] = empty ? 0.0f : o[m][h] / l_run[h] * p.out_scale;
      val[2 * m + 1] = empty ? 0.0f : o[m][2 + h] / l_run[h] * p.out_scale;
    }
    if (p.num_splits == 1) {
      uint32_t packed[D / 16];
#pragma unroll
      for (int j = 0; j < D / 16; ++j) {
        __nv_bfloat162 v2 = __floats2bfloat162_rn(val[2 * j], val[2 * j + 1]);
        packed[j] = *reinterpret_cast<uint32_t*>(&v2);
      }
      uint4* dst = reinterpret_cast<uint4*>(p.out + bh * D + r * (D / 8));
#pragma unroll
      for (int j = 0; j < D / 64; ++j)
        dst[j] = make_uint4(packed[4 * j], packed[4 * j + 1], packed[4 * j + 2], packed[4 * j + 3]);
      if (r == 0) p.lse[bh] = empty ? -INFINITY : lse2 * kLn2;
    } else {
      float4* dst = reinterpret_cast<float4*>(p.o_part + (bh * p.num_splits + split) * D + r * (D / 8));
#pragma unroll
      for (int j = 0; j < D / 32; ++j) dst[j] = make_float4(val[4 * j], val[4 * j + 1], val[4 * j + 2], val[4 * j + 3]);
      if (r == 0) p.lse_part[bh * p.num_splits + split] = lse2;
    }
  }
  if (p.num_splits == 1 || p.split_counters == nullptr) return;
  // Fused split-K finish, as in merge_warps: the last CTA of the (sequence, head group) combines all splits of its
  // 4 G query heads.
  __shared__ bool last_split;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned int prev = atomicInc(p.split_counters + (int64_t)b * p.heads_kv + hg, p.num_splits - 1);
    last_split = prev == (unsigned int)(p.num_splits - 1);
  }
  __syncthreads();
  if (!last_split) return;
  __threadfence();
  heads_split_finish<D, kSets * kThreads>(p, smem, hg, b);
}

// Combine the splits of one (sequence, query head) (TRACE_EXT_KV_DECODE_COMBINE=kernel: the separate pass).
template <int D>
__global__ void __launch_bounds__(D) fp4kv_decode_combine_kernel(const float* __restrict__ o_part,
                                                                  const float* __restrict__ lse_part, uint16_t* out,
                                                                  float* lse, int num_splits) {
  const int64_t bh = blockIdx.x;
  const int d = threadIdx.x;
  const Combined cmb = combine_splits<D>(o_part, lse_part, bh, d, num_splits);
  __nv_bfloat16 ob = __float2bfloat16_rn(cmb.out);
  out[bh * D + d] = *reinterpret_cast<uint16_t*>(&ob);
  if (d == 0) lse[bh] = cmb.lse;
}

// The combine for many splits (heads kernel past kHeadsFusedMax, e.g. B = 1, 2 head groups x ~128 splits): one
// CTA of 4 warps per (sequence, query head); the max LSE by a block reduction, then warp w sums splits w, w + 4,
// ... with a lane owning D/32 consecutive head_dim values (one 16- or 8-byte load per split), and the 4 warps'
// sums are added in shared memory. Same weights 2^(lse_s - max) as combine_splits, summed in a different order
// (so not bit-equal to it): ~n/4 dependent rounds per warp instead of n per thread.
constexpr int kWideWarps = 4;
template <int D>
__global__ void __launch_bounds__(kWideWarps * 32) fp4kv_decode_combine_wide_kernel(const float* __restrict__ o_part,
                                                                                   const float* __restrict__ lse_part,
                                                                                   uint16_t* out, float* lse,
                                                                                   int num_splits) {
  constexpr int kPer = D / 32;  // head_dim values per lane
  static_assert(kPer == 2 || kPer == 4, "a lane loads one float2 / float4 per split");
  using Vec = std::conditional_t<kPer == 4, float4, float2>;
  __shared__ float sm_red[kWideWarps];
  __shared__ float sm_acc[kWideWarps][D];
  __shared__ float sm_l[kWideWarps];
  const int64_t bh = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* lp = lse_part + bh * num_splits;
  float m = -INFINITY;
  for (int s = threadIdx.x; s < num_splits; s += kWideWarps * 32) m = fmaxf(m, lp[s]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (lane == 0) sm_red[warp] = m;
  __syncthreads();
  m = fmaxf(fmaxf(sm_red[0], sm_red[1]), fmaxf(sm_red[2], sm_red[3]));
  float l = 0.0f, acc[kPer] = {};
  if (m != -INFINITY) {
#pragma unroll 4
    for (int s = warp; s < num_splits; s += kWideWarps) {
      const float ls = lp[s];
      const Vec v = *reinterpret_cast<const Vec*>(o_part + (bh * num_splits + s) * D + lane * kPer);
      if (ls == -INFINITY) continue;
      const float f = exp2f(ls - m);
      l += f;
      const float* pv = reinterpret_cast<const float*>(&v);
#pragma unroll
      for (int e = 0; e < kPer; ++e) acc[e] += f * pv[e];
    }
  }
#pragma unroll
  for (int e = 0; e < kPer; ++e) sm_acc[warp][lane * kPer + e] = acc[e];
  if (lane == 0) sm_l[warp] = l;
  __syncthreads();
  for (int d = threadIdx.x; d < D; d += kWideWarps * 32) {
    float a = 0.0f, lt = 0.0f;
#pragma unroll
    for (int w = 0; w < kWideWarps; ++w) a += sm_acc[w][d], lt += sm_l[w];
    const bool empty = !(lt > 0.0f);
    __nv_bfloat16 ob = __float2bfloat16_rn(empty ? 0.0f : a / lt);
    out[bh * D + d] = *reinterpret_cast<uint16_t*>(&ob);
    if (d == 0) lse[bh] = empty ? -INFINITY : (m + log2f(lt)) * kLn2;
  }
}

// ---- host ------------------------------------------------------------------------------------------------

// Kernel variants, read per call so that one process can time them all: the heads kernels (4 KV heads per CTA,
// CTA-shared contiguous tile copies) where they apply (G <= 8, H_kv % 4 == 0, 16-byte aligned cache bases): by
// default heads8 (two warps per KV head on alternate tiles, 8 warps per CTA; H200 A/B at 2071576: 1.04-1.08x over the
// 4-warp kernel, bench/results/kv_heads_ab_h200.md), TRACE_EXT_KV_DECODE_IMPL=heads the 4-warp kernel (1.06-1.26x
// over g8); the G <= 8 swapped-operand kernel (default for other G <= 8 shapes; TRACE_EXT_KV_DECODE_IMPL=g8 selects it
// wherever G <= 8), the M = 16 kernel with Q in shared memory (default for G > 8; =qsmem forces it) and with Q in
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

// Dynamic shared memory of heads8 with a ring of `ring` stages (a stage: two 16-token tiles).
template <int D>
constexpr int heads8_smem(int ring) {
  return 2 * ring * HGeo<D>::kStageBytes;
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

int decode_impl(int group, bool heads_ok) {
  const char* env = std::getenv("TRACE_EXT_KV_DECODE_IMPL");
  if (env != nullptr && std::strcmp(env, "old") == 0) return kImplRegQ;
  if (env != nullptr && std::strcmp(env, "qsmem") == 0) return kImplSmemQ;
  if (env != nullptr && std::strcmp(env, "g8") == 0 && group <= 8) return kImplSwap;
  if (group > 8) return kImplSmemQ;
  if (env != nullptr && std::strcmp(env, "heads") == 0 && heads_ok) return kImplHeads;
  return heads_ok ? kImplHeads8 : kImplSwap;
}

template <int D, int kImpl>
int choose_splits(int batch_heads, int64_t max_len, int device) {
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
  static int memo_splits[64] = {0};
  if (memo_splits[slot] > 0 && memo_bh[slot] == batch_heads && memo_len[slot] == max_len) return memo_splits[slot];
  const int64_t max_splits = std::max<int64_t>(1, std::min<int64_t>(max_len / kMinSplitTokens, 4 * (int64_t)sms));
  auto cost = [&](int64_t s) {
    const int64_t k = ((int64_t)batch_heads * s + sms - 1) / sms;
    return (double)k / (double)s / (k >= 2 && per_sm >= 2 ? 1.0 : 0.75);
  };
  double best_cost = cost(1);
  for (int64_t s = 2; s <= max_splits; ++s) best_cost = std::min(best_cost, cost(s));
  int splits = 1;
  while (splits < max_splits && cost(splits) > 1.05 * best_cost) ++splits;
  memo_bh[slot] = batch_heads;
  memo_len[slot] = max_len;
  memo_splits[slot] = splits;
  return splits;
}

// TRACE_EXT_KV_DECODE_COMBINE=kernel: the splits are combined by the separate combine kernel (read per call);
// default: the last CTA of each (sequence, KV head) combines them in the decode kernel (no second launch).
bool fused_combine() {
  const char* env = std::getenv("TRACE_EXT_KV_DECODE_COMBINE");
  return !(env != nullptr && std::strcmp(env, "kernel") == 0);
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

template <int D, int kRing>
DecodeKernelFn heads8_ring_kernel(int device) {
  static bool attr_set[64] = {false};
  const DecodeKernelFn kernel = fp4kv_decode_kernel_heads<D, 2, kRing>;
  if (!attr_set[device & 63]) {
    set_decode_kernel_attrs(kernel, heads8_smem<D>(kRing));
    attr_set[device & 63] = true;
  }
  return kernel;
}

template <int D, int kImpl>
void launch(const DecodeParams& base, int batch, int num_splits_arg, int64_t max_len, const at::Tensor& q,
            at::Tensor& out, at::Tensor& lse) {
  DecodeParams p = base;
  const int device = q.get_device();
  static bool carveout_set[64] = {false};  // per device (the caller's guard made `device` current)
  if (!carveout_set[device & 63]) {
    set_decode_kernel_attrs(decode_kernel<D, kImpl>(), decode_smem<D, kImpl>());  // before choose_splits' occupancy
    carveout_set[device & 63] = true;
  }
  const int splits = num_splits_arg > 0
                         ? num_splits_arg
                         : choose_splits<D, kImpl>(batch * head_ctas<kImpl>(p.heads_kv), max_len, device);
  p.num_splits = splits;
  at::Tensor o_part, lse_part;
  bool wide = false;
  if (splits > 1) {
    o_part = at::empty({batch, p.heads_q, splits, D}, q.options().dtype(at::kFloat));
    lse_part = at::empty({batch, p.heads_q, splits}, q.options().dtype(at::kFloat));
    p.o_part = o_part.data_ptr<float>();
    p.lse_part = lse_part.data_ptr<float>();
    // heads kernel: the last CTA of a (sequence, head group) combines 4 G query heads over all splits; past
    // kHeadsFusedMax partial floats per CTA that serial tail (one CTA per group, e.g. 2 groups x 126 splits at
    // B = 1) would cost more than a launch of the wide combine kernel, which runs B * Hq CTAs in parallel
    wide = (kImpl == kImplHeads || kImpl == kImplHeads8) && (int64_t)splits * kHeadsPerCta * p.group * D > kHeadsFusedMax;
    p.split_counters = fused_combine() && !wide ? split_counters((int64_t)batch * p.heads_kv, q) : nullptr;
  }
  DecodeKernelFn kernel = decode_kernel<D, kImpl>();
  int smem = decode_smem<D, kImpl>();
  if constexpr (kImpl == kImplHeads8) {  // TRACE_EXT_KV_DECODE_RING=2 / 4: another stage ring, same splits
    const int ring = heads_ring_selected();
    if (ring != 0) {
      kernel = ring == 2 ? heads8_ring_kernel<D, 2>(device) : heads8_ring_kernel<D, 4>(device);
      smem = heads8_smem<D>(ring);
    }
  }
  require_kernel_image(kernel, "fp4kv_decode_attention");
  auto stream = c10::cuda::getCurrentCUDAStream();
  dim3 grid(splits, head_ctas<kImpl>(p.heads_kv), batch);
  kernel<<<grid, decode_threads<kImpl>(), smem, stream>>>(p);
  check_launch("fp4kv_decode_attention");
  if (splits > 1 && wide) {
    fp4kv_decode_combine_wide_kernel<D><<<batch * p.heads_q, kWideWarps * 32, 0, stream>>>(
        o_part.data_ptr<float>(), lse_part.data_ptr<float>(), reinterpret_cast<uint16_t*>(out.data_ptr()),
        lse.data_ptr<float>(), splits);
    check_launch("fp4kv_decode_attention (combine)");
  } else if (splits > 1 && p.split_counters == nullptr) {
    fp4kv_decode_combine_kernel<D><<<batch * p.heads_q, D, 0, stream>>>(
        o_part.data_ptr<float>(), lse_part.data_ptr<float>(), reinterpret_cast<uint16_t*>(out.data_ptr()),
        lse.data_ptr<float>(), splits);
    check_launch("fp4kv_decode_attention (combine)");
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

  c10::cuda::CUDAGuard guard(q.device());
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.get_device());
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, q.get_device());
  TORCH_CHECK(major * 10 + minor >= 89, "trace_ext: fp4kv_decode_attention needs sm_89 or newer (cvt.e4m3x2, built for ",
              TRACE_EXT_ARCHS_STR, "), this GPU is sm_", major, minor);

  TORCH_CHECK_VALUE(B <= 65535 && Hkv <= 65535, "trace_ext: fp4kv_decode_attention takes at most 65535 sequences and KV heads");
  at::Tensor out = at::empty({B, Hq, D}, q.options());
  at::Tensor lse = at::empty({B, Hq}, q.options().dtype(at::kFloat));
  if (B == 0) return {out, lse};

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
  // the heads kernel copies 16-byte pieces of 4-head runs: H_kv % 4 == 0 and 16-byte aligned cache bases
  bool heads_ok = Hkv % kHeadsPerCta == 0;
  for (int i = 0; i < 4; ++i) heads_ok = heads_ok && reinterpret_cast<uintptr_t>(cache[i]->data_ptr()) % 16 == 0;
  const int impl = decode_impl(p.group, heads_ok);
  auto go = [&](auto d_tag) {
    constexpr int kD = decltype(d_tag)::value;
    if (impl == kImplHeads) {
      launch<kD, kImplHeads>(p, (int)B, (int)num_splits, max_len, q, out, lse);
    } else if (impl == kImplHeads8) {
      launch<kD, kImplHeads8>(p, (int)B, (int)num_splits, max_len, q, out, lse);
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
