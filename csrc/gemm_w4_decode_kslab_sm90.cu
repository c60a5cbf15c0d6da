// Dense small-M (decode) NVFP4-weight GEMM for sm_90a with the activations staged in shared memory ("kslab"): the
// default dense decode kernel on sm_90 since the H200 A/B at 7b3e763 (1.08-1.88x the stream kernel on every bench row,
// W4A16 and W4A4; bench/results/decode_ab_h200_s*.md, decode_kslab_w4a4_h200.md), also named by
// TRACE_EXT_DECODE_IMPL=kslab (read at every call; hooked into run_decode_new of gemm_w4_decode_sm90.cu; kslab2: the
// same kernel on the second packed form of reference_gemm.to_decode_layout2, decode_word2: 9 instead of 11 integer ops
// per 8 weights, bit-equal to kslab; trace_ext.ops.fp4_linear passes packed2 for it, ops/gemm.py DECODE_FORM2_IMPLS).
// Y[M, N] = A[M, K] @ W[N, K]^T, M <= 32, W packed by reference_gemm.to_decode_layout (prepare_fp4_weight).
//
// Design note:
//  - Why: every kernel of gemm_w4_decode_sm90.cu streams consecutive 256-K tiles of a 16-row block per warp and
//    re-loads the activation fragments of each tile from L1 / L2 (LDG). ncu at c7928a5 (14336 x 4096): at M = 1 the
//    tile's first HMMA waiting on that LDG is 19 % of all stall samples; at M = 16 / 32 the activation traffic from
//    L2 is 3-4x the weight bytes (L2 hit 81 %, long_sb 43 %).
//  - Work order: CTA (c, s) owns K slab s (super-tiles [s L, s L + Ls), Ls = min(L, KT - s L)) and the contiguous
//    16-row blocks [nbk c / C, nbk (c + 1) / C) of N. It first copies A[:, slab] once into shared memory (cp.async;
//    W4A4: dequantized once into bf16 q * s * 2^-7, the same values load_act_frags builds per tile, so the W4A4 path
//    loses its per-tile activation conversion). Rows M .. 8 MT8 - 1 of the MMA width are left unwritten rather than
//    zero-filled: an MMA column only feeds its own accumulator column, and those of rows >= M are never stored, so
//    at M = 1 the CTA copies 1 row instead of 8 (no per-tile row guards either way).
//    Row stride Ls * 512 + 16 bytes (= 16 mod 128): a quarter warp's LDS.128 (lanes g = 2q, 2q + 1, t = 0..3 at
//    byte 32 t of two consecutive rows) covers all 32 banks once, so the fragment reads are conflict free.
//  - Weights: the CTA's items (block, k tile), block-major, are split flat over its 16 warps (equal shares +-1
//    tile whatever N, K and M), each warp streaming its contiguous range through its own cp.async ring exactly like
//    the stream kernel (each lane copies / reads back only its own 72 bytes, cp.async.wait_group orders, no
//    barrier); within the slab a block's tiles are contiguous bytes. Activation fragments come from shared memory
//    (2 LDS.128 per 8 rows per 64-K step, constant offsets), so no L2 latency per tile and no row guards.
//  - One CTA of 16 warps per SM (<= 128 registers, __launch_bounds__(512, 1)) rather than 2 CTAs of 8: the same 16
//    warps per SM, but one A slab shared by all of them, i.e. twice the slab length L for the same shared memory.
//    Rings: 2 slots (one 2.3 KB tile ahead per warp); up to 16 rows the slab length bound (and so every plan) is that
//    of the rings before (4 slots = 147 KB per SM up to 8 rows, 3 = 110 KB at 16 rows), at 32 rows that of the 2 slots
//    (74 KB; since round 37, kslab_ring_bytes): the rest of the 227 KB holds the slab, L <= 20 / 14 / 9 super-tiles at
//    8 / 16 / 32 rows. Ring depth, H200 A/B with
//    the same plans, bit-equal (rounds 18-20 of notes/GPU_RESULTS.md): 2 slots 1.06-1.08x at M = 1 and 1.08-1.14x at
//    M = 8 (14336x4096, 4096x14336), 1.01-1.05x at M = 16, grouped Qwen3 T = 1..64 1.02-1.06x over the 4 / 3 slots
//    before; 3 slots at <= 8 rows in between; 5-6 slots 0.93-0.98x; a slow start (one tile before the loop, then two
//    per item up to 3 ahead) no better than 4. Fewer tiles in flight per warp is faster here: with 2112 warps in one
//    wave asking at once, a deeper ring only makes each warp wait behind more of the other warps' tiles. 32 rows:
//    2 slots with the 3-slot plans 1.01-1.07x (round 23), with plans sized for them (L <= 9 instead of 7) 1.09x /
//    1.12x at M = 32 on 7168 / 14336 x 4096 (S = 2 instead of 4 slabs) and 1.37x at grouped Qwen3 gate_up T = 256
//    (K = 2048 in one slab instead of two: 128 whole jobs in one round instead of 256 in two), two timings (round 37).
//  - Reduction (deterministic, same bits on every call): a block whose slab tiles one warp covers is finished by it;
//    a block split between warps of the CTA gets one fp32 partial per warp segment (workspace, 2 slots per warp,
//    fragment layout), and after one CTA barrier the warp holding the block's first tile adds them in warp order
//    (= K order). A finished block is stored to Y directly when the slab is the whole K (S = 1: y = bf16(sum * fold *
//    g_a[m] * g_w[n]), the epilogue of store_y); else its fp32 slab partial goes to the workspace and one
//    self-resetting ticket per block (atom.add.acq_rel.gpu, the ticket buffer of the stream kernel) elects the last
//    arriving slab, which adds all S partials in slab order and stores Y. Arrivals come after the whole stream.
//  - Shape choice (host, kslab_plan): among the slab counts S whose L = ceil(KT / S) fits the shared memory, the
//    one minimizing the largest CTA's bytes (blocks per CTA x L tiles + its partial / ticket traffic) with
//    C = min(blocks, SMs / S) chunks, i.e. at most one resident wave. E.g. 132 SMs, M = 1: 14336 x 4096 -> S = 1,
//    132 CTAs of 7 blocks x 16 tiles (no workspace); 4096 x 14336 -> S = 4, L = 14; 7168 x 4096 -> S = 2, L = 8.
//    Weight copies carry an L2 evict_first policy (read once), so that the slab partials and A stay in L2.
//  - Static SASS of the main loop per 256-K tile (4096 weights; sm_90a, whole tile unrolled, no spills; registers
//    63 / 74 / 100 at 8 / 16 / 32 rows, W4A4 56 / 71 / 94): W4A16 364 / 391 / 442 instructions per tile against
//    417 / 522 / 664 for the stream kernel and 389 / 561 / 526 for pair2 (per tile of its 2-tile item); W4A4
//    381 / 408 / 460 against the stream kernel's 732 / 1145 / 1841 (its per-tile FP4 -> bf16 activation conversion).
//    Per tile at 8 rows: 16 HMMA, 64 HMUL2, 104 LOP3 + 46 SHF + 50 IMAD (FP4 expansion: the layout's 11 ops per
//    word), 16 LDS (8 x 128-bit activations, 4 weights, 1 scale word), 5 LDGSTS, ~28 scale conversion.
//    kslab2 (second packed form): W4A16 332 / 359 / 410, W4A4 350 / 377 / 428 per tile (registers 64 / 76 / 96,
//    W4A4 56 / 71 / 90).
//  - Numbers: the exact products and fp32 MMA chains of the stream kernel; only the K split into partial sums
//    differs (within the SPEC 7 bound, like pair2). sm_90a only (the body is empty elsewhere; the host raises).
//  - Risks: at 32 rows L <= 9 (16 KB of A per super-tile), so 14336 x 4096 runs S = 2 slabs: 2 fp32 partials of
//    2 KB per 16-row block (3.7 MB written + read through L2 against 33 MB of weights); one CTA per SM means its
//    prologue (A slab, 2 ring slots per warp) is not overlapped by a second CTA; the plan assumes one resident CTA
//    per SM of up to 224 / 220 / 221 KB (rings reserved 144 / 108 / 72 KB + A); M = 1 still runs 8-wide MMAs (7/8 of
//    the B operand unused).
//
// Grouped (MoE) decode: the default on sm_90 since the H200 A/B at f062b32 (bench/results/decode_grouped_ab_h200.md:
// 1.0-1.65x the grouped stream kernel on the Qwen3 rows, T = 64 gate_up 64.5 % of copy, 3.3x grouped_mm), also named
// by TRACE_EXT_DECODE_IMPL=kslab-grouped (whole jobs) / kslab-flat (flat ranges; see "Work order" below) (read at every
// call; hooked into run_decode_new's grouped branch; dense calls under those values keep the dense default; named on
// other archs: RuntimeError; =stream / =auto: the stream kernel):
//  - Why: the grouped stream kernel re-reads every tile's activation fragments from L2 (Qwen3 T = 256, ~16 rows per
//    expert: ~3.5x the weight bytes); it reached 10-49 % of copy on the Qwen3 expert shapes.
//  - Work order: units = (expert with rows, chunk of R = 8 / 16 / 24 rows; R by rows_hint: 8 up to 4 rows per expert on
//    average, 16 up to 8, else 24; 32 by TRACE_EXT_KSLAB_GRP_ROWS), numbered on the device by the stream kernel's
//    block-wide scan of offsets
//    (decode_number_units / decode_unit_expert / decode_unit_rows of gemm_w4_decode_units.cuh: s_pref in shared memory,
//    unit -> expert by binary search; empty experts cost nothing). Jobs (unit u, slab s, N chunk c), job = (u S + s) C
//    + c; one resident CTA of 16 warps per SM loops over jobs blockIdx-strided. Per job: a CTA barrier (the previous
//    job's A / segment reads are done), the unit's rows r_lo .. r_hi - 1 of A[:, slab] staged in shared memory, then
//    the dense kernel's job body (the same functions, kslab_job_start / kslab_job_stream) on the expert's weights
//    (w_packed + e * N/16 * K/256 * 2304): per-warp cp.async rings, warp segments + warp-order sums, slab partials per
//    (unit, block) + self-resetting tickets [max_units][N / 16] (last slab sums in slab order: deterministic). Y rows
//    r_lo .. r_hi - 1, g_w of expert e.
//  - Plan (host, kslab_grouped_plan): S and C minimizing max(all job bytes without the ramp / SMs, busiest CTA's job
//    bytes / 1.5), a job = its weight tiles + half its A bytes + 32 KB of ramp + its slab partials, from an estimate
//    of the unit count (E (1 - (1 - 1/E)^M) experts with rows + rows beyond R); buffers sized by the bound
//    min(E, M) + M / R + 1. Qwen3 (132 SMs): gate_up T = 1 / 16 / 64 / 256 -> (S, C) = (1, 16) / (1, 3) / (1, 1) /
//    (1, 1) (T = 256: (2, 1) before round 37, with the 3-slot ring's reservation); down (1, 16) / (1, 4) / (1, 1) /
//    (1, 1) (TRACE_EXT_KSLAB_GRP_PLAN=v1, the plan before: T = 1 C = 12 / 11, down T = 16 C = 1).
//  - Static SASS (sm_90a, no spills): registers 78 / 95 / 126 at 8 / 16 / 32 rows (W4A4 80 / 96 / 124); the j loop
//    (tile + block-end code) 608 / 837 / 1294 instructions against 591 / 815 / 1264 for the dense kernel (same
//    per-tile body; the difference is the per-expert g_w / row bounds of the block-end store).
//  - Work order (since the H200 A/B at 7b11f15; kGrpJobs / kGrpFlat at grouped_flat_pays): Nsight at
//    b6a5cdb showed the whole-job order leaving SMs idle where the device's unit count quantizes badly against the
//    CTAs: Qwen3 down T = 16 ran 81 jobs on 132 SMs (SM active 51% of the kernel), gate_up T = 16 89 x 3 jobs (3
//    rounds on 3 SMs, 2 on the rest; 67%). Flat ranges (each CTA one contiguous range of the (unit, slab, block)
//    triples, equal to +-1 block) fix that: 1.12x / 1.26x there (61% of copy, 3.3x grouped_mm at gate_up T = 16), but
//    a range crossing a unit boundary runs two jobs with their own A staging, ramp and drain, so flat lost 0.89-0.98x
//    where whole jobs filled their rounds (T = 64, 256) or were short (T = 1). The default decides per call on the
//    host, by the smaller estimated makespan at the plan's unit estimate (grouped_flat_pays; deciding on the device
//    from the real unit count cost 1-6% of codegen). TRACE_EXT_DECODE_IMPL=kslab-grouped / kslab-flat force one order.
//    Above 4 rows per expert (16- and 24-row units; 24 since rounds 40-42, 16 since rounds 43-44) the order is decided
//    on the device after the unit scan (kGrpAuto: whole jobs when the real unit count fits one round, else flat
//    ranges; one job loop, so one copy of the job body): whole jobs there are one unit per expert in one round until
//    skewed routing gives some expert a second unit, and then they ran 1.5-1.7x slower than flat ranges (rounds 39,
//    43; see run_decode_kslab_grouped).
//  - Risks: one barrier-separated job at a time per CTA: the A staging and ring ramp of each job are not overlapped
//    (jobs are large: >= 64 tiles; flat ranges run up to 1 + range / unit jobs); the plan's unit estimate (for C, and
//    for the order up to 4 rows per expert) assumes uniform routing; 126 registers at 32 rows (112 at 24).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "trace_ext/fp4_numerics.cuh"
#include "trace_ext/gemm_w4_common.cuh"
#include "trace_ext/gemm_w4_decode_units.cuh"
#include "trace_ext/gemm_w4_decode_kslab.h"
#include "trace_ext/gemm_w4_decode_kslab_job.cuh"
#include "trace_ext/host_checks.h"

namespace trace_ext {
namespace gemm_w4 {

// ws_slab: [S][N / 16][kFrag][32] fp32 slab partials (S > 1); ws_seg: [C * S][kKsWarps][2][kFrag][32] fp32 partials
// of the blocks split between warps of a CTA. Grid (C, S).
template <int MT8, bool kAFp4, int kStages, bool kForm2, bool kSegSmem>
__global__ void __launch_bounds__(kKsThreads, 1)
    gemm_w4_decode_kslab_kernel(const GemmParams p, float* __restrict__ ws_slab, float* __restrict__ ws_seg,
                                int* __restrict__ tickets, int L) {
  static_assert(kStages >= 2, "a cp.async ring needs at least 2 slots");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
  constexpr int kFrag = MT8 * 4;  // fp32 accumulators per lane
  extern __shared__ __align__(16) uint8_t ks_smem[];  // [warp][kStages][kKsTileBytes] rings, then A [8 MT8][a_stride]
  const int warp_id = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int K = p.K, N = p.N, M = p.M;
  const int KT = K / kKsSuperK, n_blocks = N / 16;
  const int C = gridDim.x, c = blockIdx.x, s = blockIdx.y, S = gridDim.y;
  const int kt0 = s * L, Ls = min(L, KT - kt0);
  const int nb0 = (int)((int64_t)n_blocks * c / C), nb1 = (int)((int64_t)n_blocks * (c + 1) / C);
  const int I = (nb1 - nb0) * Ls;  // items (block, k tile) of this CTA, block-major
  const int a_stride = Ls * kKsRowBytes + kKsRowPad;
  uint8_t* const ring = ks_smem + warp_id * kStages * kKsTileBytes;
  uint8_t* const a_s = ks_smem + kKsWarps * kStages * kKsTileBytes;
  const int i0 = kslab_first(warp_id, I), i1 = kslab_first(warp_id + 1, I);
  const float fold = kAFp4 ? kUnfoldW4A4 : kUnfoldW4A16;

  // ---- A slab -> shared memory (bf16: cp.async; W4A4: dequantized in the job body while the weights stream in)
  if constexpr (!kAFp4)
    kslab_stage_a_bf16(a_s, [&] { return reinterpret_cast<const uint8_t*>(p.a) + (int64_t)kt0 * kKsRowBytes; }, M, K,
                       a_stride, Ls);

  const KsJob jb{s, S, kt0, Ls, nb0, I, a_stride, i0, i1};
  KsRing<kStages> wr;
  kslab_job_start<kAFp4, kStages>(wr, p, jb, p.w_packed, 0, M, ring, a_s, lane,
                                                       [] { return ks_evict_first_policy(); });
  if constexpr (kAFp4) kslab_stage_a_fp4(p, a_s, 0, M, kt0, Ls, a_stride);
  if constexpr (!kAFp4) cp_async_wait<kStages - 1>();  // this thread's A group (the oldest) is complete
  __syncthreads();                                     // and every thread's A chunks are visible

  // y = bf16(sum * fold * g_a[m] * g_w[n]) for the lane's fragment of block nb (store_y of the stream kernel)
  auto store_y = [&](int nb, const float (&v)[MT8][4]) {
    kslab_store_y<MT8, kAFp4>(p, p.g_w, nb, 0, M, lane, fold, v);
  };
  auto slab_partial = [&](int ss, int nb) { return ws_slab + ((int64_t)ss * n_blocks + nb) * (kFrag * 32) + lane; };
  auto arrive = [&](int nb) {  // lane 0's arrival at block nb's ticket
    int last = 0;
    if (lane == 0) {
      last = ks_ticket_add(tickets + nb) == S - 1;
      if (last) tickets[nb] = 0;  // self-reset for the next launch on this stream
    }
    return last;
  };
  float* const seg_base = ws_seg + ((int64_t)(s * C + c) * kKsWarps) * 2 * (kFrag * 32) + lane;
  kslab_job_stream<MT8, kStages, kForm2, kSegSmem>(jb, wr, a_s, seg_base, warp_id, lane, store_y, slab_partial,
                                                    arrive);
#endif
}

// ---- grouped (MoE) decode (the default on sm_90; TRACE_EXT_DECODE_IMPL=kslab-grouped / kslab-flat, read per call) --
// Units = (expert with rows, chunk of R = 8 MT8 rows), numbered on the device exactly as the grouped stream kernel
// (decode_number_units of gemm_w4_decode_units.cuh: one block-wide scan of offsets -> s_pref, unit -> expert by binary
// search). Jobs = (unit u, slab s, N chunk c), job = (u S + s) C + c; one resident CTA per SM loops over jobs
// (blockIdx-strided), or over the jobs of its flat range (kGrpFlat). Per job the CTA stages the unit's rows
// r_lo .. r_hi - 1 of A[:, slab] in shared memory (behind a barrier: the previous job's reads are done), then runs the
// dense kernel's job body (kslab_job_start /
// kslab_job_stream) on the expert's weights (w_packed + e * exp_bytes). Workspace: ws_slab
// [max_units][S][N / 16][kFrag][32], ws_seg [gridDim.x][kKsWarps][2][kFrag][32] (reused job after job: the barrier
// opening the next job orders the finisher's reads before the next writes), tickets [max_units][N / 16].
constexpr int kKsGrpPrefBytes = ((kMaxExperts + 1) * 4 + kKsWarps * 4 + 15) / 16 * 16;  // s_pref + scan sums
constexpr int kslab_grp_max_l(int mt8, bool prev = false) {
  return ((kKsSmemMax - kslab_ring_bytes(mt8, prev) - kKsGrpPrefBytes) / (8 * mt8) - kKsRowPad) / kKsRowBytes;
}
static_assert(kslab_grp_max_l(1, true) >= 16 && kslab_grp_max_l(2, true) >= 8 && kslab_grp_max_l(3, true) >= 4 &&
                  kslab_grp_max_l(4, true) >= 4,
              "grouped: the A slab must hold at least 4 super-tiles beside the rings and the unit prefix");

// Work order of the grouped kernel: whole jobs (unit, slab, N chunk), blockIdx-strided (kGrpJobs, named
// kslab-grouped); flat ranges (kGrpFlat, named kslab-flat): the n_units * S * n_blocks (unit, slab, 16-row block)
// triples, unit-major, cut into gridDim.x equal contiguous ranges (+-1 block), a range run as one job per (unit, slab)
// it touches. Up to 4 rows per expert (8-row units) the default picks one per call on the host (grouped_flat_pays at
// the plan's unit estimate).
constexpr int kGrpJobs = 0, kGrpFlat = 1;
// kGrpAuto (the default above 4 rows per expert: 24-row units since round 42, 16-row units since round 44): whole
// jobs when the device's unit count gives at most one job per CTA (one round), else flat ranges, decided in the kernel
// after the unit scan (one job loop, one call of the job body). Launched with the flat order's grid.
constexpr int kGrpAuto = 2;

// The default's choice: the order with the smaller estimated makespan in tiles of the busiest CTA, counting
// kGrpRampTiles per job it runs (A staging, ring ramp and drain, the finisher barrier):
//   whole jobs: rounds * (blocks per job * L + ramp), rounds = ceil(n_units S C / CTAs);
//   flat:       ceil(n_units S n_blocks / CTAs) * L + (1 + ceil(range / n_blocks)) * ramp (a range touches that many
//               (unit, slab) jobs at most).
// Calibrated on the H200 A/B at 7b11f15 (bench/results/previous/decode_grouped_ab_h200_7b11f15.md, Qwen3 T = 1 .. 256):
// every row's faster order agrees with any ramp between 52 and 148 tiles. Flat put every SM to work where whole jobs
// quantized badly against the CTAs (Nsight at b6a5cdb: down T = 16 ran 81 jobs on 132 SMs, SM active 51%; gate_up
// T = 16 89 x 3 jobs in 3 rounds on 3 SMs, 2 on the rest, 67%): 1.12x / 1.26x; whole jobs won (1.02-1.11x) where
// they filled their rounds (T = 64, 256) or were short (T = 1), since a range crossing a unit boundary runs two jobs.
// The unit count is known only on the device; deciding there (one kernel holding both orders, a specialized copy of
// the job body each) ran 1-6% behind the single-order kernels on every Qwen3 row (H200 rounds 10 / 11 at 336dd39 /
// 6ed7114), so the host decides from the plan's estimate (units under uniform routing) and launches a single-order
// kernel. Far from the estimate both orders stay correct; only the speed differs.
constexpr int kGrpRampTiles = 100;
bool grouped_flat_pays(int64_t n_units, int S, int C, int n_blocks, int L, int ctas) {
  const int64_t rounds = (n_units * S * C + ctas - 1) / ctas;
  const int64_t job_cost = rounds * ((int64_t)(n_blocks + C - 1) / C * L + kGrpRampTiles);
  const int64_t range = (n_units * S * n_blocks + ctas - 1) / ctas;  // blocks of the largest flat range
  const int64_t flat_cost = range * L + (1 + (range + n_blocks - 1) / n_blocks) * kGrpRampTiles;
  return flat_cost < job_cost;
}

template <int MT8, bool kAFp4, int kStages, int kOrder, bool kSegSmem>
__global__ void __launch_bounds__(kKsThreads, 1)
    gemm_w4_decode_kslab_grouped_kernel(const GemmParams p, float* __restrict__ ws_slab, float* __restrict__ ws_seg,
                                        int* __restrict__ tickets, int L, int S, int C, int max_units) {
  static_assert(kStages >= 2, "a cp.async ring needs at least 2 slots");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
  constexpr int kFrag = MT8 * 4;  // fp32 accumulators per lane
  constexpr int R = 8 * MT8;      // rows of a unit
  // [warp][kStages][kKsTileBytes] rings, then A [8 MT8][L * 512 + 16], then s_pref[E + 1], s_wsum[kKsWarps]
  extern __shared__ __align__(16) uint8_t ks_smem[];
  const int warp_id = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int K = p.K, N = p.N;
  const int KT = K / kKsSuperK, n_blocks = N / 16;
  const int64_t exp_bytes = (int64_t)n_blocks * KT * kKsTileBytes;  // one expert's packed weight
  uint8_t* const ring = ks_smem + warp_id * kStages * kKsTileBytes;
  uint8_t* const a_s = ks_smem + kKsWarps * kStages * kKsTileBytes;
  int* const s_pref = reinterpret_cast<int*>(a_s + R * (L * kKsRowBytes + kKsRowPad));
  int* const s_wsum = s_pref + kMaxExperts + 1;
  const float fold = kAFp4 ? kUnfoldW4A4 : kUnfoldW4A16;

  // ---- units, numbered expert by expert (the grouped stream kernel's scan)
  const int base = decode_number_units<kKsWarps, R>(p, s_pref, s_wsum);
  const int n_units = min(base, max_units);  // (the host bound holds for offsets within [0, M])
  float* const seg_base = ws_seg + (int64_t)blockIdx.x * kKsWarps * 2 * (kFrag * 32) + lane;
  const uint64_t pol = ks_evict_first_policy();

  // one job: unit u, slab s, 16-row blocks nb0 .. nb1 - 1
  auto run_job = [&](int u, int s, int nb0, int nb1) {
    const int e = decode_unit_expert(p, s_pref, u);  // the last expert with s_pref[e] <= u (it has rows)
    int r_lo, r_hi;
    decode_unit_rows<R>(p, s_pref, u, e, r_lo, r_hi);
    const int rows = r_hi - r_lo;
    const int kt0 = s * L, Ls = min(L, KT - kt0);
    const int I = (nb1 - nb0) * Ls;  // items (block, k tile) of this job, block-major
    const int a_stride = Ls * kKsRowBytes + kKsRowPad;
    const int i0 = kslab_first(warp_id, I), i1 = kslab_first(warp_id + 1, I);
    const uint8_t* const w_e = p.w_packed + e * exp_bytes;
    const float* const gw = p.g_w + (int64_t)e * p.gw_stride_e;
    __syncthreads();  // the previous job's A reads and segment reads are done

    // ---- the unit's A rows of the slab -> shared memory (rows >= rows: never stored, see kslab_stage_a_bf16)
    if constexpr (!kAFp4)
      kslab_stage_a_bf16(
          a_s, [&] { return reinterpret_cast<const uint8_t*>(p.a) + ((int64_t)r_lo * K + (int64_t)kt0 * kKsSuperK) * 2; },
          rows, K, a_stride, Ls);

    const KsJob jb{s, S, kt0, Ls, nb0, I, a_stride, i0, i1};
    KsRing<kStages> wr;
    kslab_job_start<kAFp4, kStages>(wr, p, jb, w_e, r_lo, rows, ring, a_s, lane, [&] { return pol; });
    if constexpr (kAFp4) kslab_stage_a_fp4(p, a_s, r_lo, rows, kt0, Ls, a_stride);
    if constexpr (!kAFp4) cp_async_wait<kStages - 1>();
    __syncthreads();

    // y rows r_lo .. r_hi - 1 of the unit (store_y of the grouped stream kernel)
    auto store_y = [&](int nb, const float (&v)[MT8][4]) {
      kslab_store_y<MT8, kAFp4>(p, gw, nb, r_lo, r_hi, lane, fold, v);
    };
    float* const slab_u = ws_slab + (int64_t)u * S * n_blocks * (kFrag * 32) + lane;  // this unit's slab partials
    auto slab_partial = [&](int ss, int nb) { return slab_u + ((int64_t)ss * n_blocks + nb) * (kFrag * 32); };
    auto arrive = [&](int nb) {
      int* const tk = tickets + (int64_t)u * n_blocks + nb;
      int last = 0;
      if (lane == 0) {
        last = ks_ticket_add(tk) == S - 1;
        if (last) *tk = 0;  // self-reset for the next launch on this stream
      }
      return last;
    };
    kslab_job_stream<MT8, kStages, false, kSegSmem>(jb, wr, a_s, seg_base, warp_id, lane, store_y, slab_partial,
                                                    arrive);
  };

  if constexpr (kOrder == kGrpAuto) {
    // whole jobs if they fit one round, else flat ranges (the same sums as the kernel of that order on this grid)
    const int n_jobs = n_units * S * C;
    const bool whole = n_jobs <= (int)gridDim.x;
    const int64_t total = (int64_t)n_units * S * n_blocks;
    int64_t f = whole ? blockIdx.x : total * blockIdx.x / gridDim.x;
    const int64_t f_end = whole ? (blockIdx.x < n_jobs ? blockIdx.x + 1 : 0) : total * (blockIdx.x + 1) / gridDim.x;
    while (f < f_end) {
      int u, s, nb0, nb1;
      if (whole) {  // job f
        const int c = (int)(f % C);
        s = (int)((f / C) % S);
        u = (int)(f / (C * S));
        nb0 = (int)((int64_t)n_blocks * c / C);
        nb1 = (int)((int64_t)n_blocks * (c + 1) / C);
        f = f_end;
      } else {
        const int us = (int)(f / n_blocks);
        nb0 = (int)(f - (int64_t)us * n_blocks);
        nb1 = (int)min((int64_t)n_blocks, nb0 + (f_end - f));
        u = us / S;
        s = us % S;
        f += nb1 - nb0;
      }
      run_job(u, s, nb0, nb1);
    }
  } else if constexpr (kOrder == kGrpFlat) {
    // flat range [f, f_end) of the (unit, slab, block) triples
    const int64_t total = (int64_t)n_units * S * n_blocks;
    int64_t f = total * blockIdx.x / gridDim.x;
    const int64_t f_end = total * (blockIdx.x + 1) / gridDim.x;
    while (f < f_end) {
      const int us = (int)(f / n_blocks);
      const int nb0 = (int)(f - (int64_t)us * n_blocks);
      const int nb1 = (int)min((int64_t)n_blocks, nb0 + (f_end - f));
      run_job(us / S, us % S, nb0, nb1);
      f += nb1 - nb0;
    }
  } else {
    // whole jobs blockIdx.x, blockIdx.x + gridDim.x, ...
    const int n_jobs = n_units * S * C;
    for (int job = blockIdx.x; job < n_jobs; job += gridDim.x) {
      const int c = job % C, s = (job / C) % S, u = job / (C * S);
      run_job(u, s, (int)((int64_t)n_blocks * c / C), (int)((int64_t)n_blocks * (c + 1) / C));
    }
  }
#endif
}

// Whether a launch keeps its segment slots in shared memory (kSegSmem; they fit up to 16 rows). Default: yes, unless
// l2_by_default (the grouped whole-job order at 3..4 rows per expert). TRACE_EXT_KSLAB_SEG (read per call): =l2 keeps
// them in L2 everywhere (the kernels before 0c439e6), =smem in shared memory wherever they fit.
bool kslab_seg_in_smem(int mt8, bool l2_by_default) {
  const char* v = std::getenv("TRACE_EXT_KSLAB_SEG");
  if (mt8 > 2 || (v != nullptr && std::strcmp(v, "l2") == 0)) return false;
  return (v != nullptr && std::strcmp(v, "smem") == 0) || !l2_by_default;
}

int decode_kslab_selected() {
  const char* v = std::getenv("TRACE_EXT_DECODE_IMPL");
  if (v == nullptr || *v == '\0') return 0;
  const std::string sel = v;
  // kslab-grouped / kslab-flat name the grouped K-slab kernel; dense calls keep the default (0)
  return sel == "kslab" ? 1 : sel == "kslab2" ? 2 : sel == "kslab-grouped" || sel == "kslab-flat" ? 0 : -1;
}

int decode_kslab_grouped_selected() {
  const char* v = std::getenv("TRACE_EXT_DECODE_IMPL");
  if (v == nullptr || *v == '\0') return 0;
  const std::string sel = v;
  if (sel == "kslab-grouped") return 1;
  if (sel == "kslab-flat") return 2;
  if (sel == "stream" || sel == "auto") return -1;  // the grouped stream kernel (the default before f062b32)
  return 0;  // values that name a dense kernel keep the grouped default
}

// Slab count S (slab length L = ceil(KT / S) <= max_l) and N chunks C for one CTA per SM: one resident wave
// (C * S <= SMs; more only where K needs more than SMs slabs), minimizing the largest CTA's weight bytes plus its
// slab-partial traffic (S > 1).
struct KslabPlan {
  int L, S, C;
};
// TRACE_EXT_KSLAB_S (read per call; an A/B knob, bench/bench_decode_kslab_plan.py): the slab count to use instead of
// the cost model's, when it is a valid count for the shape (L = ceil(KT / S) fits, and no smaller S has that L);
// unset or 0: the model.
int kslab_forced_slabs() {
  const char* v = std::getenv("TRACE_EXT_KSLAB_S");
  return v != nullptr ? std::max(0, std::atoi(v)) : 0;
}

KslabPlan kslab_plan(int n_blocks, int KT, int rows, int max_l, int sms) {
  KslabPlan best{0, 0, 0};  // S = 0: no plan
  double best_cost = -1.0;
  const int forced = kslab_forced_slabs();
  for (int S = 1; S <= KT; ++S) {
    const int L = (KT + S - 1) / S;
    if (L > max_l || (KT + L - 1) / L != S) continue;  // too long, or the same L as a smaller S
    if (forced > 0 && S == forced) return {L, S, std::max(1, std::min(n_blocks, sms / S))};
    const int C = std::max(1, std::min(n_blocks, sms / S));  // S > SMs: one chunk, several waves
    const int64_t bpc = (n_blocks + C - 1) / C;  // blocks of the largest CTA
    // a slab partial (fp32, 16 x rows) is written to and read back from L2 (about half the cost of DRAM bytes),
    // plus about 1 KB worth of ticket round trip
    const double cost = (double)bpc * L * kKsTileBytes + (S > 1 ? (double)bpc * (16.0 * rows * 4 + 1024) : 0.0);
    if (S > 65535) break;  // grid.y limit
    if (best_cost < 0 || cost < best_cost) {
      best_cost = cost;
      best = {L, S, C};
    }
  }
  return best;
}

// the largest dense CTA: the longest slab beside the rings of either reservation (default, TRACE_EXT_KSLAB_STAGES=prev)
constexpr int kKsDenseSmem(int mt8, bool prev) {
  return kslab_ring_bytes(mt8, prev) + 8 * mt8 * (kslab_max_l(mt8, prev) * kKsRowBytes + kKsRowPad);
}
constexpr int kKsDenseSmemMax(int mt8) { return std::max(kKsDenseSmem(mt8, false), kKsDenseSmem(mt8, true)); }

// A K-slab kernel (dense or grouped) with its shared-memory attributes (kSmemMax bytes, largest carveout) set once
// per device: one flag set per kernel instantiation.
template <auto kKernel, int kSmemMax>
auto kslab_kernel_ready(int dev, const char* op) {
  static_assert(kSmemMax <= kKsSmemMax, "a K-slab CTA's shared memory must fit the SM");
  static bool attr_set[kMaxDevices] = {};
  if (dev >= kMaxDevices || !attr_set[dev]) {
    require_kernel_image(kKernel, op);
    C10_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemMax));
    C10_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        (int)cudaSharedmemCarveoutMaxShared));
    if (dev < kMaxDevices) attr_set[dev] = true;
  }
  return kKernel;
}

// The dense kernel (rings + A slab).
template <int MT8, bool kAFp4, bool kForm2, bool kSegSmem, int kStages = kslab_stages(MT8)>
auto dense_kernel_ready(int dev) {
  return kslab_kernel_ready<gemm_w4_decode_kslab_kernel<MT8, kAFp4, kStages, kForm2, kSegSmem>,
                            kKsDenseSmemMax(MT8)>(dev, "fp4_linear (decode kslab)");
}

// The dense kernel of a launch: shared-memory segment slots if seg_smem (<= 16 rows), kStages ring slots.
template <int MT8, bool kAFp4, bool kForm2, int kStages>
auto dense_kernel_pick(int dev, bool seg_smem) {
  return seg_smem ? dense_kernel_ready<MT8, kAFp4, kForm2, MT8 <= 2, kStages>(dev)
                  : dense_kernel_ready<MT8, kAFp4, kForm2, false, kStages>(dev);
}

// TRACE_EXT_KSLAB_STAGES=prev (read per call; an A/B knob) selects the previous ring of the K-slab kernels (dense and
// grouped), kslab_alt_stages slots: 4 at <= 8 rows, 3 at 16 (the depth before round 20: same plan, same sums,
// bit-equal) and 3 at 32 rows with the 32-row plans before round 37 (shorter slabs: other sums, same f64 contract).
constexpr int kslab_alt_stages(int mt8) { return kslab_prev_stages(mt8); }
bool kslab_alt_ring_selected() {
  const char* v = std::getenv("TRACE_EXT_KSLAB_STAGES");
  return v != nullptr && std::strcmp(v, "prev") == 0;
}
// Shared-memory bytes of the weight rings a launch takes (the default depth or, alt, kslab_alt_stages).
constexpr int kslab_ring_smem(int mt8, bool alt) {
  return kKsWarps * (alt ? kslab_alt_stages(mt8) : kslab_stages(mt8)) * kKsTileBytes;
}

template <int MT8, bool kAFp4, bool kForm2>
bool launch_decode_kslab(const GemmParams& p, const at::Tensor& like, cudaStream_t stream) {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const int n_blocks = p.N / 16, KT = p.K / kKsSuperK;
  const bool alt = kslab_alt_ring_selected();
  const KslabPlan plan = kslab_plan(n_blocks, KT, 8 * MT8, kslab_max_l(MT8, alt), sm_count(dev));
  if (plan.S == 0) return false;
  const int smem = kslab_ring_smem(MT8, alt) + 8 * MT8 * (plan.L * kKsRowBytes + kKsRowPad);
  constexpr int64_t kFragFloats = MT8 * 4 * 32;
  const int64_t slab_floats = plan.S > 1 ? (int64_t)plan.S * n_blocks * kFragFloats : 0;
  const int64_t seg_floats = (int64_t)plan.C * plan.S * kKsWarps * 2 * kFragFloats;
  at::Tensor ws = at::empty({slab_floats + seg_floats}, like.options().dtype(at::kFloat));
  float* const ws_p = ws.data_ptr<float>();
  int* tickets = plan.S > 1 ? ticket_buffer(like, stream, n_blocks) : nullptr;
  const bool seg_smem = kslab_seg_in_smem(MT8, false);
  auto kernel = alt ? dense_kernel_pick<MT8, kAFp4, kForm2, kslab_alt_stages(MT8)>(dev, seg_smem)
                    : dense_kernel_pick<MT8, kAFp4, kForm2, kslab_stages(MT8)>(dev, seg_smem);
  kernel<<<dim3(plan.C, plan.S), kKsThreads, smem, stream>>>(p, ws_p, ws_p + slab_floats, tickets, plan.L);
  check_launch("fp4_linear (decode kslab)");
  return true;
}

template <bool kForm2>
bool run_decode_kslab_form(const GemmParams& p, const at::Tensor& like, cudaStream_t stream) {
  const bool a4 = p.a_scales != nullptr;
  if (p.M <= 8) {
    return a4 ? launch_decode_kslab<1, true, kForm2>(p, like, stream) : launch_decode_kslab<1, false, kForm2>(p, like, stream);
  }
  if (p.M <= 16) {
    return a4 ? launch_decode_kslab<2, true, kForm2>(p, like, stream) : launch_decode_kslab<2, false, kForm2>(p, like, stream);
  }
  return a4 ? launch_decode_kslab<4, true, kForm2>(p, like, stream) : launch_decode_kslab<4, false, kForm2>(p, like, stream);
}

bool run_decode_kslab(const GemmParams& p, const at::Tensor& like, cudaStream_t stream, bool form2, bool named) {
  if (p.offsets != nullptr || p.M <= 0 || p.M > 32 || p.w_packed == nullptr || p.N % 16 != 0 || p.K % kKsSuperK != 0)
    return false;  // grouped or outside the decode layout: the default runs
  if ((int64_t)(p.N / 16) * (p.K / kKsSuperK) >= (int64_t{1} << 31)) return false;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const int major = cc_major(dev);
  if (!named && major != 9) return false;  // the default elsewhere: the stream / pair kernels
  TORCH_CHECK(major == 9, "trace_ext: TRACE_EXT_DECODE_IMPL=kslab / kslab2 is an sm_90a kernel; unset it on this ",
              "device (compute capability ", major, ".x)");
  return form2 ? run_decode_kslab_form<true>(p, like, stream) : run_decode_kslab_form<false>(p, like, stream);
}

// Grouped plan: slab count S (L = ceil(KT / S) <= max_l) and N chunks C per unit, for jobs (unit, slab, chunk) over
// one resident wave of CTAs looping over jobs. A job costs its weight tiles + its A rows (from L2: half weight) +
// ~32 KB worth of ramp / barriers (one CTA per SM: nothing overlaps them) + its slab partials; the plan minimizes
// max(all jobs' bytes without the ramp / SMs (DRAM-bound), the busiest CTA's jobs / 1.5 (one SM streams at most ~1.5x
// its DRAM share)), with units_est units (the unit count is only known on the device). The ramp is latency, not DRAM
// traffic: counting it in the first term too (the plan before 2026-11-30 11:40, TRACE_EXT_KSLAB_GRP_PLAN=v1, read per
// call) kept jobs few and long at Qwen3 T = 1 (C = 12 / 11 chunks: 96 / 88 of 132 SMs busy; now 16: 128).
bool kslab_grouped_plan_v1() {
  const char* v = std::getenv("TRACE_EXT_KSLAB_GRP_PLAN");
  return v != nullptr && std::strcmp(v, "v1") == 0;
}

KslabPlan kslab_grouped_plan(int n_blocks, int KT, int rows, int max_l, int sms, double units_est) {
  KslabPlan best{0, 0, 0};
  double best_cost = -1.0;
  const double U = std::max(1.0, units_est);
  const bool v1 = kslab_grouped_plan_v1();
  for (int S = 1; S <= KT && S <= 64; ++S) {
    const int L = (KT + S - 1) / S;
    if (L > max_l || (KT + L - 1) / L != S) continue;
    const int c_max = (int)std::max(1.0, std::min((double)n_blocks, std::ceil(8.0 * sms / (U * S))));
    for (int C = 1; C <= c_max; ++C) {
      const double jobs = std::ceil(U) * S * C;
      const double waves = std::ceil(jobs / sms);
      const int64_t bpc = (n_blocks + C - 1) / C;
      constexpr double kRampBytes = 32768.0;
      const double job = (double)bpc * L * kKsTileBytes + 0.5 * rows * L * kKsRowBytes + kRampBytes +
                         (S > 1 ? (double)bpc * (16.0 * rows * 4 + 1024) : 0.0);
      const double dram_job = v1 ? job : job - kRampBytes;
      const double cost = std::max(jobs * dram_job / sms, waves * job / 1.5);
      if (best_cost < 0 || cost < best_cost) {
        best_cost = cost;
        best = {L, S, C};
      }
    }
  }
  return best;
}

constexpr int kKsGrpSmem(int mt8, bool prev) {
  return kslab_ring_bytes(mt8, prev) + 8 * mt8 * (kslab_grp_max_l(mt8, prev) * kKsRowBytes + kKsRowPad) +
         kKsGrpPrefBytes;
}
constexpr int kKsGrpSmemMax(int mt8) { return std::max(kKsGrpSmem(mt8, false), kKsGrpSmem(mt8, true)); }

// The grouped kernel of one work order (rings + A slab + unit prefix).
template <int MT8, bool kAFp4, int kOrder, bool kSegSmem, int kStages = kslab_stages(MT8)>
auto grouped_kernel_ready(int dev) {
  return kslab_kernel_ready<gemm_w4_decode_kslab_grouped_kernel<MT8, kAFp4, kStages, kOrder, kSegSmem>,
                            kKsGrpSmemMax(MT8)>(dev, "fp4_grouped_linear (decode kslab-grouped)");
}

// The grouped kernel of a launch: work order `order`, shared-memory segment slots if seg_smem (<= 16 rows), kStages
// ring slots.
template <int MT8, bool kAFp4, int kStages>
auto grouped_kernel_pick(int dev, int order, bool seg_smem) {
  if constexpr (MT8 == 2 || MT8 == 3) {  // the unit sizes that run the device-side order
    if (order == kGrpAuto)
      return seg_smem ? grouped_kernel_ready<MT8, kAFp4, kGrpAuto, MT8 <= 2, kStages>(dev)
                      : grouped_kernel_ready<MT8, kAFp4, kGrpAuto, false, kStages>(dev);
  }
  return order == kGrpFlat ? (seg_smem ? grouped_kernel_ready<MT8, kAFp4, kGrpFlat, MT8 <= 2, kStages>(dev)
                                       : grouped_kernel_ready<MT8, kAFp4, kGrpFlat, false, kStages>(dev))
                           : (seg_smem ? grouped_kernel_ready<MT8, kAFp4, kGrpJobs, MT8 <= 2, kStages>(dev)
                                       : grouped_kernel_ready<MT8, kAFp4, kGrpJobs, false, kStages>(dev));
}

// order: kGrpJobs, kGrpFlat, or -1 (the default: grouped_flat_pays at the plan's unit estimate); seg_l2_jobs: the
// whole-job order keeps its segment slots in L2 unless TRACE_EXT_KSLAB_SEG=smem (H200 round 34, 8-row units at 3..4
// rows per expert: 1.03-1.05x over the shared-memory slots at Qwen3 T = 48 / 64, two timings; the flat order at
// T = 16 lost 0.98-0.99x with L2 slots, so it keeps shared memory).
template <int MT8, bool kAFp4>
bool launch_decode_kslab_grouped(const GemmParams& p, const at::Tensor& like, cudaStream_t stream, int order,
                                 bool seg_l2_jobs) {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  constexpr int R = 8 * MT8;
  const int n_blocks = p.N / 16, KT = p.K / kKsSuperK;
  // units: at most one per expert with rows plus one per further R rows (the stream kernel's bound); estimate for the
  // plan: the expected experts with rows under uniform routing, E (1 - (1 - 1/E)^M), plus the rows beyond R each
  const int64_t max_units = std::min<int64_t>(p.E, p.M) + p.M / R + 1;
  const double nonempty = std::min<double>(std::min(p.E, p.M), p.E * (1.0 - std::pow(1.0 - 1.0 / p.E, (double)p.M)));
  const double units_est = nonempty + std::max(0.0, p.M - nonempty * R) / R;
  if (max_units * n_blocks >= (int64_t{1} << 30)) return false;
  const int sms = sm_count(dev);
  const bool alt = kslab_alt_ring_selected();  // TRACE_EXT_KSLAB_STAGES=prev: the previous ring (and 32-row plan)
  const KslabPlan plan = kslab_grouped_plan(n_blocks, KT, R, kslab_grp_max_l(MT8, alt), sms, units_est);
  if (plan.S == 0 || max_units * plan.S * plan.C >= (int64_t{1} << 31)) return false;
  const int smem = kslab_ring_smem(MT8, alt) + R * (plan.L * kKsRowBytes + kKsRowPad) + kKsGrpPrefBytes;
  if (order < 0) {
    const bool flat = grouped_flat_pays((int64_t)std::ceil(units_est), plan.S, plan.C, n_blocks, plan.L, sms);
    order = flat ? kGrpFlat : kGrpJobs;
  }
  // flat ranges: one contiguous range of (unit, slab, block) per CTA, on every SM
  const int ctas = (int)std::max<int64_t>(
      1, std::min<int64_t>(sms, order == kGrpJobs ? max_units * plan.S * plan.C : max_units * plan.S * n_blocks));
  // (kGrpAuto: the flat grid; its whole-job branch then runs at most one job per CTA)
  constexpr int64_t kFragFloats = MT8 * 4 * 32;
  const int64_t slab_floats = plan.S > 1 ? max_units * plan.S * n_blocks * kFragFloats : 0;
  const int64_t seg_floats = (int64_t)ctas * kKsWarps * 2 * kFragFloats;
  at::Tensor ws = at::empty({slab_floats + seg_floats}, like.options().dtype(at::kFloat));
  float* const ws_p = ws.data_ptr<float>();
  int* tickets = plan.S > 1 ? ticket_buffer(like, stream, (int)(max_units * n_blocks)) : nullptr;
  const bool seg_smem = kslab_seg_in_smem(MT8, seg_l2_jobs && order == kGrpJobs);
  auto kernel = alt ? grouped_kernel_pick<MT8, kAFp4, kslab_alt_stages(MT8)>(dev, order, seg_smem)
                    : grouped_kernel_pick<MT8, kAFp4, kslab_stages(MT8)>(dev, order, seg_smem);
  kernel<<<ctas, kKsThreads, smem, stream>>>(p, ws_p, ws_p + slab_floats, tickets, plan.L, plan.S, plan.C,
                                             (int)max_units);
  check_launch("fp4_grouped_linear (decode kslab-grouped)");
  return true;
}

// TRACE_EXT_KSLAB_GRP_ROWS=8 / 16 / 24 / 32 (read per call; an A/B knob): the grouped K-slab kernel's rows per unit
// instead of the rows_hint rule (8 up to kKsGrp8RowsMaxHint rows per expert on average, 16 up to 8, else 24 with the
// order decided on the device); a forced value takes the work order of grouped_flat_pays. Any value is correct (units
// of any size cover every expert's rows); only the speed differs. 0: not set (or another value).
constexpr int kKsGrp8RowsMaxHint = 4;  // 2 before the H200 rounds 30-32
int kslab_grp_rows_forced() {
  const char* v = std::getenv("TRACE_EXT_KSLAB_GRP_ROWS");
  if (v == nullptr) return 0;
  const std::string sel = v;
  return sel == "8" ? 8 : sel == "16" ? 16 : sel == "24" ? 24 : sel == "32" ? 32 : 0;
}

bool run_decode_kslab_grouped(const GemmParams& p, int64_t rows_hint, const at::Tensor& like, cudaStream_t stream,
                              int selected) {
  const bool named = selected > 0;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const int major = cc_major(dev);
  if (!named && major != 9) return false;  // the default elsewhere: the grouped stream kernel
  TORCH_CHECK(major == 9, "trace_ext: TRACE_EXT_DECODE_IMPL=kslab-grouped / kslab-flat is an sm_90a kernel; ",
              "unset it on this device (compute capability ", major, ".x)");
  if (p.offsets == nullptr || p.M <= 0 || p.w_packed == nullptr || p.N % 16 != 0 || p.K % kKsSuperK != 0 ||
      p.E <= 0 || p.E > kMaxExperts)
    return false;  // the stream kernel runs
  if ((int64_t)(p.N / 16) * (p.K / kKsSuperK) >= (int64_t{1} << 31)) return false;
  const int order = selected == 1 ? kGrpJobs : selected == 2 ? kGrpFlat : -1;
  const bool a4 = p.a_scales != nullptr;
  // rows per unit: 8 up to 4 rows per expert on average (rows_hint), 16 up to 8, else 24 (the device's order), unless
  // TRACE_EXT_KSLAB_GRP_ROWS names them (8 / 16 / 24 / 32). 8-row units up to 4 (the grouped stream kernel's rule stops
  // at 2): H200 rounds 30-32, Qwen3 T = 48 / 64 (3 / 4 rows per expert) 1.12-1.15x over 16-row units (half the MMA
  // columns are padding there), uniform and skewed routing. At 5 rows per expert they lose 0.62-0.64x: the experts
  // above 8 rows add units beyond the plan's estimate (experts with rows, units_est) and whole jobs spill into a second
  // round. At 4 that happens in ~1-3% of uniformly routed calls (host emulation of the plan:
  // tools/emulate_grouped_plan.py).
  // Above 8 rows per expert: 24-row units (three 8-row groups; 32 before round 40) with the order decided on the device
  // (kGrpAuto: whole jobs when the real unit count fits one round, else flat ranges). Whole jobs of one unit per expert
  // fill one round only while no expert needs a second unit, which skewed routing breaks: at Qwen3 T = 128 .. 256
  // with skewed router scores (bench_gemm.routed_offsets skew 0.25 / 0.5: the busiest expert at 2.6-4.5x the mean)
  // whole jobs ran 1.5-1.7x slower than flat ranges (round 39, grp_skew*_ab_h200.md), and 24-row whole jobs spilled in
  // 1 of 4 uniform routings at T = 256 (round 41: down 107 us against 60). Without a spill 24-row whole jobs ran 1.09-
  // 1.10x the 32-row ones at uniform T = 256 (both projections, round 41), flat ranges 1.01-1.09x (gate_up) and
  // 0.95-0.96x (down).
  const int forced = kslab_grp_rows_forced();
  const int R = forced != 0 ? forced : rows_hint <= kKsGrp8RowsMaxHint ? 8 : rows_hint <= 8 ? 16 : 24;
  // the rule's 16- and 24-row units take the device's order unless TRACE_EXT_DECODE_IMPL names one; forced rows the
  // estimate's. 16-row units since round 43/44 (uniform Qwen3 T = 64..128: 0.98-1.00x the host's estimate; skewed
  // routing where whole jobs spill: 1.52-1.66x). TRACE_EXT_KSLAB_GRP_AUTO16=0 (A/B knob, read per call): the host's
  // estimate for 16-row units, as before.
  const char* auto16 = std::getenv("TRACE_EXT_KSLAB_GRP_AUTO16");
  const bool dev_order = R == 24 || (R == 16 && !(auto16 != nullptr && std::strcmp(auto16, "0") == 0));
  const int ord = order < 0 && forced == 0 && dev_order ? kGrpAuto : order;
  // the rule's 8-row units at 3..4 rows per expert (added in rounds 30-32) keep whole jobs' segment slots in L2
  const bool seg_l2_jobs = forced == 0 && R == 8 && rows_hint > 2;
  switch (R) {
    case 8: return a4 ? launch_decode_kslab_grouped<1, true>(p, like, stream, ord, seg_l2_jobs)
                      : launch_decode_kslab_grouped<1, false>(p, like, stream, ord, seg_l2_jobs);
    case 16: return a4 ? launch_decode_kslab_grouped<2, true>(p, like, stream, ord, false)
                       : launch_decode_kslab_grouped<2, false>(p, like, stream, ord, false);
    case 24: return a4 ? launch_decode_kslab_grouped<3, true>(p, like, stream, ord, false)
                       : launch_decode_kslab_grouped<3, false>(p, like, stream, ord, false);
    default: return a4 ? launch_decode_kslab_grouped<4, true>(p, like, stream, ord, false)
                       : launch_decode_kslab_grouped<4, false>(p, like, stream, ord, false);
  }
}

}  // namespace gemm_w4
}  // namespace trace_ext
