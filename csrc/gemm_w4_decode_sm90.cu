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
#include "trace_ext/gemm_w4_decode_units.cuh"
#include "trace_ext/host_checks.h"

namespace trace_ext {
namespace gemm_w4 {

constexpr int kDecWarps = 8;
constexpr int kDecThreads = kDecWarps * 32;
constexpr int kSuperK = 256;                       // K per packed super-tile
constexpr int kTileBytes = 16 * kSuperK / 2 + 16 * kSuperK / 16;  // 2304
constexpr int kCodeBytes = 16 * kSuperK / 2;       // 2048
static_assert(kTileBytes == 2304 && kCodeBytes == 2048, "packed super-tile layout (reference_gemm.to_decode_layout)");

// decode_word (one decode-layout word -> bf16x2 of pairs 0..3): trace_ext/gemm_w4_common.cuh (shared with the
// kslab kernel of gemm_w4_decode_kslab_sm90.cu).

// decode_word2 (the second packed form) and decode_word_form<kForm2>: trace_ext/gemm_w4_common.cuh as well.


// Activation fragments of lane (g, t) for one 64-K step: rows m0 + 8i + g (i < MT8), elements
// k .. k + 15 (contiguous, see the k-slot permutation above) as 8 bf16x2 registers per row; bf16 activations are
// loaded as they are, FP4 ones (W4A4) converted to bf16 q * s * 2^-7. Rows at or past m_hi are zero.
template <int MT8, bool kAFp4>
__device__ __forceinline__ void load_act_frags(const GemmParams& p, int K, int k, int m0, int m_hi, int g,
                                               uint32_t (&bq)[MT8][8]) {
#pragma unroll
  for (int i = 0; i < MT8; ++i) {
    const int m = m0 + 8 * i + g;
    if (m < m_hi) {
      if constexpr (!kAFp4) {
        const uint4* src =
            reinterpret_cast<const uint4*>(reinterpret_cast<const __nv_bfloat16*>(p.a) + (int64_t)m * K + k);
        const uint4 x0 = __ldg(src), x1 = __ldg(src + 1);
        bq[i][0] = x0.x; bq[i][1] = x0.y; bq[i][2] = x0.z; bq[i][3] = x0.w;
        bq[i][4] = x1.x; bq[i][5] = x1.y; bq[i][6] = x1.z; bq[i][7] = x1.w;
      } else {
        const uint8_t* ac = reinterpret_cast<const uint8_t*>(p.a) + (int64_t)m * (K / 2) + k / 2;
        const uint2 c = __ldg(reinterpret_cast<const uint2*>(ac));
        const uint32_t sc = scale_bf16x2_folded(__ldg(p.a_scales + (int64_t)m * (K / 16) + k / 16));
        const uint32_t cw[2] = {c.x, c.y};
#pragma unroll
        for (int j = 0; j < 8; ++j)
          bq[i][j] = bf16x2_mul(fp4x2_to_bf16x2_biased((cw[j >> 2] >> (8 * (j & 3))) & 0xFFu), sc);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) bq[i][j] = 0u;
    }
  }
}

// ---- dense: flat per-warp weight streams (default dense path) -------------------------------------------------
// The packed tiles of a dense weight are stored nb-major ((nb * KT + kt) * kTileBytes), so the flat tile index
// j = nb * KT + kt is also the byte order. Warp w of the grid (W warps, one resident wave) streams tiles
// [T * w / W, T * (w + 1) / W) of the T = n_blocks * KT tiles: one contiguous byte range per warp, equal shares
// (+-1 tile) whatever N and K are, and the warp's cp.async ring stays full across 16-row block boundaries. A
// block covered by one warp is finished by it; a block shared by several warps gets one fp32 partial per warp
// (fragment layout, slot 2w + (warp started before the block)), and the last of them to arrive (one ticket per
// block, self-resetting) adds them in warp order, i.e. in K order (deterministic). Arrivals come after the whole
// stream (one fence per warp, no CTA barrier anywhere), so the fence never drains a ring that is still needed.
__device__ __forceinline__ int stream_warp_of(int64_t j, int64_t T, int W) {  // the warp whose range holds tile j
  return (int)(((j + 1) * W - 1) / T);
}
__device__ __forceinline__ int64_t stream_first_tile(int w, int64_t T, int W) { return T * w / W; }

// The end of a flat stream (stream and pair kernels): for each of the warp's shared work units b (pending0 / pending1,
// < 0: none; a unit = NB 16-row blocks of KT tiles), arrive (one acq_rel ticket per unit, after all of this warp's
// partial stores) and, in the last warp to arrive, add the partials of its warps in warp order (= K order) and
// store_y(b, v). Partials: ws[(2 ww + slot) * NB * MT8 * 4 * 32 + ...], slot 1 for a warp that started in an earlier
// unit (the fragment layout of the stores before).
template <int NB, int MT8, typename TileCount, typename StoreY>
__device__ __forceinline__ void stream_reduce_shared(int pending0, int pending1, int KT, TileCount T, int W,
                                                     int lane, int* tickets, const float* ws, StoreY&& store_y) {
  constexpr int kFrag = NB * MT8 * 4;  // fp32 accumulators per lane
  if (pending0 < 0 && pending1 < 0) return;
  __syncwarp();
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int b = q == 0 ? pending0 : pending1;
    if (b < 0) continue;
    const int wf = stream_warp_of((int64_t)b * KT, T, W), wl = stream_warp_of((int64_t)b * KT + KT - 1, T, W);
    int last = 0;
    if (lane == 0) {
      int ticket;
      // release: this warp's partial stores (ordered before lane 0 by the warp barrier) before the ticket
      asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], 1;\n" : "=r"(ticket) : "l"(tickets + b) : "memory");
      last = ticket == wl - wf;
      if (last) tickets[b] = 0;  // self-reset for the next launch on this stream
    }
    last = __shfl_sync(0xffffffffu, last, 0);
    if (!last) continue;
    // acquire (lane 0's acq_rel atomic, then the warp barrier): the other warps' partials are visible in L2
    __syncwarp();
    float v[NB][MT8][4];
#pragma unroll
    for (int bb = 0; bb < NB; ++bb)
#pragma unroll
      for (int i = 0; i < MT8; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) v[bb][i][c] = 0.f;
    for (int ww = wf; ww <= wl; ++ww) {
      const int slot = stream_first_tile(ww, T, W) < (int64_t)b * KT ? 1 : 0;  // started in an earlier unit
      const float* src = ws + ((int64_t)ww * 2 + slot) * (kFrag * 32) + lane;
#pragma unroll
      for (int bb = 0; bb < NB; ++bb)
#pragma unroll
        for (int i = 0; i < MT8; ++i)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            v[bb][i][c] = __fadd_rn(v[bb][i][c], __ldcg(src + ((bb * MT8 + i) * 4 + c) * 32));
    }
    store_y(b, v);
  }
}

template <int MT8, bool kAFp4, int kStages, int kMinBlocks, bool kGrouped, bool kForm2>
__global__ void __launch_bounds__(kDecThreads, kMinBlocks)
    gemm_w4_decode_stream_kernel(const GemmParams p, float* __restrict__ ws, int* __restrict__ tickets, int n_warps) {
  static_assert(kStages >= 2, "a cp.async ring needs at least 2 slots");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ != 900
  if constexpr (kForm2) return;  // second packed form: sm_90a-only experiment (the host raises on other devices)
#endif
  constexpr int kFrag = MT8 * 4;  // fp32 accumulators per lane
  constexpr int R = 8 * MT8;      // rows of a unit (grouped: an expert with more rows is several units)
  // [warp][kStages][kTileBytes] rings, then (grouped) s_pref[E + 1]: units of the experts before e
  extern __shared__ __align__(16) uint8_t dec_ring[];
  int* const s_pref = reinterpret_cast<int*>(dec_ring + kDecWarps * kStages * kTileBytes);
  const int warp_id = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int K = p.K, N = p.N;
  const int KT = K / kSuperK;
  const int n_blocks = N / 16;
  const int Tu = n_blocks * KT;  // tiles of one unit (< 2^31, checked on the host)
  const int64_t exp_bytes = (int64_t)Tu * kTileBytes;  // one expert's packed weight
  int n_units = 1;
  if constexpr (kGrouped) {
    // units = (expert with rows, chunk of R rows), numbered expert by expert (gemm_w4_decode_units.cuh)
    __shared__ int s_wsum[kDecWarps];
    n_units = decode_number_units<kDecWarps, R>(p, s_pref, s_wsum);
    if (threadIdx.x == 0) s_pref[p.E] = n_units;
    __syncthreads();
  }
  // unit u -> its expert (grouped: the last expert e with s_pref[e] <= u, which has rows) and its rows
  auto unit_expert = [&](int u) {
    if constexpr (!kGrouped) {
      return 0;
    } else {
      return decode_unit_expert(p, s_pref, u);
    }
  };
  auto unit_rows = [&](int u, int e, int& r_lo, int& r_hi) {
    if constexpr (!kGrouped) {
      r_lo = 0;
      r_hi = p.M;
    } else {
      decode_unit_rows<R>(p, s_pref, u, e, r_lo, r_hi);
    }
  };
  const int64_t T = (int64_t)n_units * Tu;
  // at most one warp per 2 tiles, never more warps than tiles (the ticket counts rely on every warp owning one)
  const int W = (int)min((int64_t)n_warps, max((int64_t)1, T / 2));
  const int w = blockIdx.x * kDecWarps + warp_id;
  if (T == 0 || w >= W) return;  // warp-uniform; no barrier below
  const int j0 = (int)stream_first_tile(w, T, W), j1 = (int)stream_first_tile(w + 1, T, W);  // T < 2^31
  const float fold = kAFp4 ? kUnfoldW4A4 : kUnfoldW4A16;
  uint8_t* const ring = dec_ring + warp_id * kStages * kTileBytes;

  // tile j -> ring slot (j - j0) % kStages; each lane copies and reads back only its own 72 bytes, so
  // cp.async.wait_group alone orders copy before read (no barrier)
  // issue cursor: tile loc_i of unit u_i (weights of expert unit_expert(u_i) at wb_i)
  int j_issue = j0;
  int slot_issue = 0;
  int u_i = j0 / Tu, loc_i = j0 - u_i * Tu;
  const uint8_t* wb_i = p.w_packed + (kGrouped ? unit_expert(u_i) * exp_bytes : 0);
  auto issue_next = [&]() {
    if (j_issue < j1) {
      const uint8_t* src = wb_i + (int64_t)loc_i * kTileBytes;
      uint8_t* dst = ring + slot_issue * kTileBytes;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) cp_async16(dst + kk * 512 + lane * 16, src + kk * 512 + lane * 16, true);
      cp_async8(dst + kCodeBytes + lane * 8, src + kCodeBytes + lane * 8, true);
      if (++loc_i == Tu) {  // next unit
        loc_i = 0;
        ++u_i;
        if (kGrouped && j_issue + 1 < j1) wb_i = p.w_packed + unit_expert(u_i) * exp_bytes;
      }
    }
    cp_async_commit();  // possibly empty: one group per tile for wait_group
    ++j_issue;
    slot_issue = slot_issue + 1 == kStages ? 0 : slot_issue + 1;
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue_next();

  float acc[MT8][4];
#pragma unroll
  for (int i = 0; i < MT8; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[i][c] = 0.f;

  // y = bf16(sum * fold * g_a[m] * g_w[e, n]) for the lane's fragment of global block b (unit b / n_blocks)
  auto store_y = [&](int b, const float (&v)[MT8][4]) {
    const int u = b / n_blocks, nbl = b - u * n_blocks;
    const int e = unit_expert(u);
    int r_lo, r_hi;
    unit_rows(u, e, r_lo, r_hi);
    const float* gw = p.g_w + (int64_t)e * p.gw_stride_e;
#pragma unroll
    for (int i = 0; i < MT8; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int n = nbl * 16 + g + (c >> 1) * 8, m = r_lo + 8 * i + 2 * t + (c & 1);
        if (m >= r_hi) continue;
        const float ga = p.g_a != nullptr ? p.g_a[m] : 1.0f;
        const float y = __fmul_rn(__fmul_rn(v[i][c], fold), __fmul_rn(ga, gw[(int64_t)n * p.gw_stride_n]));
        p.y[(int64_t)m * N + n] = __float2bfloat16_rn(y);
      }
  };

  // compute cursor: global block nb (= unit * n_blocks + block in the unit), k tile kt; rows of its unit
  int nb = j0 / KT, kt = j0 - nb * KT;
  int nbl = nb % n_blocks, u_c = nb / n_blocks;
  int r_lo, r_hi;
  unit_rows(u_c, unit_expert(u_c), r_lo, r_hi);
  const int kt_first = kt;          // first k tile of the warp's first block
  int pending0 = -1, pending1 = -1;  // blocks whose partial this warp wrote (slot 0: first block, 1: last block)
  int slot_rd = 0;
  for (int j = j0; j < j1; ++j) {
    auto load_a = [&](int kk, uint32_t (&bq)[MT8][8]) {
      load_act_frags<MT8, kAFp4>(p, K, kt * kSuperK + kk * 64 + 16 * t, r_lo, r_hi, g, bq);
    };
    // up to 8 rows of bf16: the tile's activation fragments (4 x 8 registers) are loaded before the wait for its
    // weights, so that their latency (L1 / L2 hits) overlaps it
    constexpr bool kHoistA = MT8 == 1 && !kAFp4 && !kGrouped;  // (grouped: no registers left)
    uint32_t bqh[kHoistA ? 4 : 1][MT8][8];
    if constexpr (kHoistA) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) load_a(kk, bqh[kk]);
    }
    asm volatile("" ::: "memory");  // the reads of the slot refilled here (previous tile) stay before it
    issue_next();
    cp_async_wait<kStages - 1>();   // the group of tile j is complete
    asm volatile("" ::: "memory");  // and the reads below stay after the wait
    const uint8_t* const srd = ring + slot_rd * kTileBytes;
    slot_rd = slot_rd + 1 == kStages ? 0 : slot_rd + 1;
    const uint2 sv = *reinterpret_cast<const uint2*>(srd + kCodeBytes + lane * 8);

    constexpr int kKkUnroll = MT8 >= 4 ? 1 : 4 / MT8;  // 16 / 32 rows: 2 / 1 64-K steps per trip (no spills)
#pragma unroll kKkUnroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t bq[MT8][8];
      if constexpr (kHoistA) {
#pragma unroll
        for (int i = 0; i < MT8; ++i)
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) bq[i][jj] = bqh[kk][i][jj];
      } else {
        load_a(kk, bq);
      }
      const uint32_t sw = kk < 2 ? sv.x : sv.y;
      const uint32_t s_lo = scale_bf16x2_folded((uint8_t)((sw >> (16 * (kk & 1))) & 0xFF));
      const uint32_t s_hi = scale_bf16x2_folded((uint8_t)((sw >> (16 * (kk & 1) + 8)) & 0xFF));
      const uint4 wq = *reinterpret_cast<const uint4*>(srd + kk * 512 + lane * 16);
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

    // ---- end of a block segment: the whole block -> Y; part of it -> partial slot
    if (kt == KT - 1 || j == j1 - 1) {
      const bool first_seg = nb * KT <= j0;  // the warp's first block
      if (kt == KT - 1 && (!first_seg || kt_first == 0)) {
        store_y(nb, acc);
      } else {
        float* dst = ws + ((int64_t)w * 2 + (first_seg ? 0 : 1)) * (kFrag * 32) + lane;
#pragma unroll
        for (int i = 0; i < MT8; ++i)
#pragma unroll
          for (int c = 0; c < 4; ++c) __stcg(dst + (i * 4 + c) * 32, acc[i][c]);
        if (first_seg) pending0 = nb; else pending1 = nb;
      }
#pragma unroll
      for (int i = 0; i < MT8; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[i][c] = 0.f;
      ++nb;
      kt = 0;
      if (++nbl == n_blocks) {  // next unit
        nbl = 0;
        ++u_c;
        if (kGrouped && j + 1 < j1) unit_rows(u_c, unit_expert(u_c), r_lo, r_hi);
      }
    } else {
      ++kt;
    }
  }
  cp_async_wait<0>();  // no copy outlives the kernel's shared memory

  // ---- shared blocks: arrive, the last warp reduces in warp order
  stream_reduce_shared<1, MT8>(pending0, pending1, KT, T, W, lane, tickets, ws,
                               [&](int b, const float (&v)[1][MT8][4]) { store_y(b, v[0]); });
}

// ---- dense, opt-in (TRACE_EXT_DECODE_IMPL=pair, read per call): flat streams of 16-row block PAIRS ------------
// Same flat per-warp streams as above, but the unit of work is an item = (pair of adjacent 16-row blocks, 256-K
// super-tile): both tiles (2 x 2304 B, KT * 2304 B apart) go into one ring slot, each activation fragment is loaded
// once per item and used by both blocks (half the activation traffic per weight: at M = 8..32 and K = 4096 the
// fragments of one tile are 4-16 KB through L1 / L2 against 2.3 KB of weights), and each warp runs two independent
// MMA accumulator chains (the default's 16 MMAs per tile all chain on one accumulator at M <= 8). Half the
// per-item bookkeeping (ring cursor, waits, segment ends) per weight. Items j = group * KT + kt, warp w streams
// items [T w / W, T (w + 1) / W); shared groups are reduced exactly as in the stream kernel (partials per warp,
// one self-resetting ticket per group, the last warp adds them in warp order = K order). Dense only; needs
// N % 32 == 0 (else the default runs).
constexpr int kPairNB = 2;

// kPrefA (bf16 activations; needs the 128 registers of 2 CTAs per SM): <= 8 rows: the next item's activation
// fragments (4 x 8 registers) are loaded while this item is converted and multiplied; <= 16 rows: those of the
// next 64-K step (2 x 8), so that no L1 / L2 latency is exposed per item / step; otherwise they are loaded per
// 64-K step right before use.
// kForm2: the second packed form (decode_word2). kNB: 16-row blocks per item (2: pair; 4: quad3, each activation
// fragment used by 4 blocks, a quarter of the default's activation traffic per weight).
template <int MT8, bool kAFp4, int kStages, int kMinBlocks, bool kPrefA, bool kForm2, int kNB>
__global__ void __launch_bounds__(kDecThreads, kMinBlocks)
    gemm_w4_decode_pair_kernel(const GemmParams p, float* __restrict__ ws, int* __restrict__ tickets, int n_warps) {
  static_assert(kStages >= 2, "a cp.async ring needs at least 2 slots");
  static_assert(kNB == 2 || kNB == 4, "items of 2 or 4 adjacent 16-row blocks");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ != 900
  if constexpr (kForm2) return;  // second packed form: sm_90a-only experiment (the host raises on other devices)
#endif
  constexpr int NB = kNB;
  constexpr int kFrag = NB * MT8 * 4;           // fp32 accumulators per lane
  constexpr int kItemBytes = NB * kTileBytes;   // one ring slot
  extern __shared__ __align__(16) uint8_t dec_ring[];  // [warp][kStages][NB][kTileBytes]
  const int warp_id = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int K = p.K, N = p.N;
  const int KT = K / kSuperK;
  const int n_groups = N / (16 * NB);
  const int T = n_groups * KT;  // items (< 2^31, checked on the host)
  const int W = min(n_warps, T);  // never more warps than items (the ticket counts rely on every warp owning one)
  const int w = blockIdx.x * kDecWarps + warp_id;
  if (T == 0 || w >= W) return;  // warp-uniform; no barrier below
  const int j0 = (int)stream_first_tile(w, T, W), j1 = (int)stream_first_tile(w + 1, T, W);
  const float fold = kAFp4 ? kUnfoldW4A4 : kUnfoldW4A16;
  const int64_t blk_bytes = (int64_t)KT * kTileBytes;  // block 2 gb -> 2 gb + 1
  uint8_t* const ring = dec_ring + warp_id * kStages * kItemBytes;

  // issue cursor: item j_issue = gb_i * KT + kt_i; each lane copies and later reads back only its own bytes
  int j_issue = j0, slot_issue = 0;
  int gb_i = j0 / KT, kt_i = j0 - gb_i * KT;
  auto issue_next = [&]() {
    if (j_issue < j1) {
      const uint8_t* src = p.w_packed + ((int64_t)gb_i * NB * KT + kt_i) * kTileBytes;
      uint8_t* dst = ring + slot_issue * kItemBytes;
#pragma unroll
      for (int b = 0; b < NB; ++b) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          cp_async16(dst + b * kTileBytes + kk * 512 + lane * 16, src + b * blk_bytes + kk * 512 + lane * 16, true);
        cp_async8(dst + b * kTileBytes + kCodeBytes + lane * 8, src + b * blk_bytes + kCodeBytes + lane * 8, true);
      }
      if (++kt_i == KT) {
        kt_i = 0;
        ++gb_i;
      }
    }
    cp_async_commit();  // possibly empty: one group per item for wait_group
    ++j_issue;
    slot_issue = slot_issue + 1 == kStages ? 0 : slot_issue + 1;
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue_next();

  float acc[NB][MT8][4];
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int i = 0; i < MT8; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[b][i][c] = 0.f;

  auto store_y = [&](int gb, const float (&v)[NB][MT8][4]) {
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int i = 0; i < MT8; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int n = (gb * NB + b) * 16 + g + (c >> 1) * 8, m = 8 * i + 2 * t + (c & 1);
          if (m >= p.M) continue;
          const float ga = p.g_a != nullptr ? p.g_a[m] : 1.0f;
          const float y = __fmul_rn(__fmul_rn(v[b][i][c], fold), __fmul_rn(ga, p.g_w[(int64_t)n * p.gw_stride_n]));
          p.y[(int64_t)m * N + n] = __float2bfloat16_rn(y);
        }
  };

  int gb = j0 / KT, kt = j0 - gb * KT;  // compute cursor
  const int kt_first = kt;
  int pending0 = -1, pending1 = -1;  // groups whose partial this warp wrote (slot 0: first group, 1: last group)
  int slot_rd = 0;
  // activation fragments of one 64-K step, super-tile kt_a (dense: they depend on kt only)
  auto load_a_kt = [&](int kt_a, int kk, uint32_t (&bq)[MT8][8]) {
    load_act_frags<MT8, kAFp4>(p, K, kt_a * kSuperK + kk * 64 + 16 * t, 0, p.M, g, bq);
  };
  constexpr bool kHoistA = kPrefA && MT8 == 1 && !kAFp4;  // whole next item ahead (4 x 8 registers)
  constexpr bool kStepA = kPrefA && MT8 == 2 && !kAFp4;   // one 64-K step ahead (2 x 8 registers)
  static_assert(!kPrefA || kHoistA || kStepA, "activation prefetch: <= 16 rows of bf16 only");
  uint32_t bqh[kHoistA ? 4 : 1][MT8][8];  // this item's fragments (kHoistA)
  if constexpr (kHoistA) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) load_a_kt(kt, kk, bqh[kk]);
  }
  uint32_t bqs[MT8][8];  // the next 64-K step's fragments (kStepA), in flight during this step
  if constexpr (kStepA) load_a_kt(kt, 0, bqs);
  for (int j = j0; j < j1; ++j) {
    auto load_a = [&](int kk, uint32_t (&bq)[MT8][8]) { load_a_kt(kt, kk, bq); };
    uint32_t bqn[kHoistA ? 4 : 1][MT8][8];  // the next item's fragments, in flight during this item
    if constexpr (kHoistA) {
      const int kt_n = kt + 1 == KT ? 0 : kt + 1;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) load_a_kt(kt_n, kk, bqn[kk]);
    }
    asm volatile("" ::: "memory");  // the reads of the slot refilled here (previous item) stay before it
    issue_next();
    cp_async_wait<kStages - 1>();   // the group of item j is complete
    asm volatile("" ::: "memory");  // and the reads below stay after the wait
    const uint8_t* const srd = ring + slot_rd * kItemBytes;
    slot_rd = slot_rd + 1 == kStages ? 0 : slot_rd + 1;
    uint2 sv[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) sv[b] = *reinterpret_cast<const uint2*>(srd + b * kTileBytes + kCodeBytes + lane * 8);

    constexpr int kKkUnroll = MT8 >= 2 ? 1 : 4;
#pragma unroll kKkUnroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t bq[MT8][8];
      if constexpr (kHoistA) {
#pragma unroll
        for (int i = 0; i < MT8; ++i)
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) bq[i][jj] = bqh[kk][i][jj];
      } else if constexpr (kStepA) {
#pragma unroll
        for (int i = 0; i < MT8; ++i)
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) bq[i][jj] = bqs[i][jj];
        // next step: this item's kk + 1, or step 0 of the next item (whose k tile follows kt; past the warp's last
        // item the loads are in range and unused)
        if (kk < 3) {
          load_a(kk + 1, bqs);
        } else {
          load_a_kt(kt + 1 == KT ? 0 : kt + 1, 0, bqs);
        }
      } else {
        load_a(kk, bq);
      }
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        const uint32_t sw = kk < 2 ? sv[b].x : sv[b].y;
        const uint32_t s_lo = scale_bf16x2_folded((uint8_t)((sw >> (16 * (kk & 1))) & 0xFF));
        const uint32_t s_hi = scale_bf16x2_folded((uint8_t)((sw >> (16 * (kk & 1) + 8)) & 0xFF));
        const uint4 wq = *reinterpret_cast<const uint4*>(srd + b * kTileBytes + kk * 512 + lane * 16);
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
            mma_bf16_16816(acc[b][i], af, bf);
          }
        }
      }
    }

    // ---- end of a group segment: the whole group -> Y; part of it -> partial slot
    if (kt == KT - 1 || j == j1 - 1) {
      const bool first_seg = gb * KT <= j0;  // the warp's first group
      if (kt == KT - 1 && (!first_seg || kt_first == 0)) {
        store_y(gb, acc);
      } else {
        float* dst = ws + ((int64_t)w * 2 + (first_seg ? 0 : 1)) * (kFrag * 32) + lane;
#pragma unroll
        for (int b = 0; b < NB; ++b)
#pragma unroll
          for (int i = 0; i < MT8; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c) __stcg(dst + ((b * MT8 + i) * 4 + c) * 32, acc[b][i][c]);
        if (first_seg) pending0 = gb; else pending1 = gb;
      }
#pragma unroll
      for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int i = 0; i < MT8; ++i)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[b][i][c] = 0.f;
      ++gb;
      kt = 0;
    } else {
      ++kt;
    }
    if constexpr (kHoistA) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int i = 0; i < MT8; ++i)
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) bqh[kk][i][jj] = bqn[kk][i][jj];
    }
  }
  cp_async_wait<0>();  // no copy outlives the kernel's shared memory

  // ---- shared groups: arrive, the last warp reduces in warp order
  stream_reduce_shared<NB, MT8>(pending0, pending1, KT, T, W, lane, tickets, ws, store_y);
}

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
