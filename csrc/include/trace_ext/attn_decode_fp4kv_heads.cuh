// FP4 KV-cache decode attention: the heads kernels (the warps of a CTA on 4 KV heads of the same tokens; heads8:
// two warp sets on alternate tiles, the default where it applies) and their fused split finish.
// Part of the FP4 KV-cache decode attention translation unit: csrc/attn_decode_fp4kv_sm90.cu includes it and
// holds the design notes; the definitions live in that unit's anonymous namespace.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "trace_ext/fp4_numerics.cuh"
#include "trace_ext/attn_decode_fp4kv_common.cuh"
#include "trace_ext/attn_decode_fp4kv_g8.cuh"
#include "trace_ext/timeline.cuh"

namespace trace_ext {
namespace {

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

// Dynamic shared memory of heads8 with a ring of `ring` stages (a stage: two 16-token tiles).
template <int D>
constexpr int heads8_smem(int ring) {
  return 2 * ring * HGeo<D>::kStageBytes;
}

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

// A warp's (O, m, l) at buf lane-major ([value][lane] floats, buf = the warp's slot + lane: conflict free), for the
// cross-warp merges below.
template <int D>
__device__ __forceinline__ void store_warp_state(float* buf, const float (&o)[D / 16][4], const float (&m_run)[2],
                                                 const float (&l_run)[2]) {
  constexpr int kVals = D / 16 * 4 + 4;  // O accumulators, m[2], l[2]
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
  if (set == 1) store_warp_state<D>(buf, o, m_run, l_run);
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

// heads8 over folded tokens (kFold > 1, see the kernel): the kFold x 2 warps of one KV head (pseudo heads j, warp sets)
// merged into warp (j = 0, set 0): every other warp stores its (O, m, l) lane-major in the drained ring, then each
// merging warp rescales all states to their common max (weights 2^(m_i - m), 0 for a state that saw no token, as in
// merge_warp_sets) and sums them in the order (j, set). Called by all threads of the CTA.
template <int D, int kFold, int kRing>
__device__ __forceinline__ void merge_fold_states(uint8_t* smem, int warp, int set, int lane, float (&o)[D / 16][4],
                                                  float (&m_run)[2], float (&l_run)[2]) {
  constexpr int kVals = D / 16 * 4 + 4;  // O accumulators, m[2], l[2]
  constexpr int kHeads = kHeadsPerCta / kFold;  // real KV heads per CTA; warp = j * kHeads + head
  static_assert(2 * kWarps * kVals * 32 * 4 <= 2 * kRing * HGeo<D>::kStageBytes, "the merge buffer fits in the ring");
  float* all = reinterpret_cast<float*>(smem);
  const int w_id = set * kWarps + warp;  // this warp's slot
  __syncthreads();  // every warp is done with its last stage
  // not a merging warp (those are j = 0 of set 0: warps 0 .. kHeads - 1)
  if (w_id >= kHeads) store_warp_state<D>(all + w_id * kVals * 32 + lane, o, m_run, l_run);
  __syncthreads();
  if (w_id >= kHeads) return;
  // the other states of this head: (j, set) = (0, 1) and (j >= 1, set 0 / 1), slots set * kWarps + j * kHeads + warp
  constexpr int kOthers = 2 * kFold - 1;
  int slots[kOthers];
#pragma unroll
  for (int i = 0; i < kOthers; ++i) {
    const int st = i + 1;  // state index (j, set) = (st / 2, st % 2)
    slots[i] = (st % 2) * kWarps + (st / 2) * kHeads + warp;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float m_all = m_run[h];
#pragma unroll
    for (int i = 0; i < kOthers; ++i) m_all = fmaxf(m_all, all[(slots[i] * kVals + kVals - 4 + h) * 32 + lane]);
    const float f0 = m_run[h] == -INFINITY ? 0.0f : exp2f(m_run[h] - m_all);
    float l = __fmul_rn(f0, l_run[h]);
    float f[kOthers];
#pragma unroll
    for (int i = 0; i < kOthers; ++i) {
      const float mi = all[(slots[i] * kVals + kVals - 4 + h) * 32 + lane];
      f[i] = mi == -INFINITY ? 0.0f : exp2f(mi - m_all);
      l = __fadd_rn(l, __fmul_rn(f[i], all[(slots[i] * kVals + kVals - 2 + h) * 32 + lane]));
    }
#pragma unroll
    for (int m = 0; m < D / 16; ++m) {
#pragma unroll
      for (int e = h; e < 4; e += 2) {
        float acc = __fmul_rn(f0, o[m][e]);
#pragma unroll
        for (int i = 0; i < kOthers; ++i)
          acc = __fadd_rn(acc, __fmul_rn(f[i], all[(slots[i] * kVals + 4 * m + e) * 32 + lane]));
        o[m][e] = acc;
      }
    }
    l_run[h] = l;
    m_run[h] = m_all;
  }
}

template <int D, int kSets, int kRing = kStages, int kFold = 1>
__global__ void __launch_bounds__(kSets * kThreads, kSets == 1 ? kMinBlocksHeads : kMinBlocksHeads8)
    fp4kv_decode_kernel_heads(const DecodeParams p) {
  using G = Geo<D>;
  using H = HGeo<D>;
  constexpr int kMTiles = D / 16;  // M tiles of O^T
  static_assert(kSets == 1 || kSets == 2, "one or two warps per KV head");
  constexpr int kSetTokens = kSets * kTile;               // tokens per stage (one 16-token tile per warp set)
  constexpr int kSetStage = kSets * H::kStageBytes;        // a stage: kSets tiles of the 4-warp layout, back to back
  extern __shared__ __align__(128) uint8_t smem[];
  TRACE_EXT_TIMELINE_BEGIN(0);  // (probes only: empty in the extension)

  const int split = blockIdx.x, hg = blockIdx.y, b = blockIdx.z;
  // warp = the KV head inside the group; set = which tile of a stage this warp computes (heads8: two warps per head)
  const int warp = kSets == 1 ? threadIdx.x / 32 : (threadIdx.x / 32) % kWarps, lane = threadIdx.x % 32;
  const int set = kSets == 1 ? 0 : (int)(threadIdx.x / 32) / kWarps;
  const int r = lane / 4, c = lane % 4;  // MMA fragment row / column group
  // kFold > 1 (heads8 only): H_kv = 4 / kFold KV heads, the cache viewed as 4 pseudo KV heads of ceil(len / kFold)
  // pseudo tokens (the host passes heads_kv = 4 and page_size = P / kFold): pseudo token t holds tokens kFold t + j of
  // every head, so pseudo head warp = j * (4 / kFold) + head; the kFold pseudo heads of a head are merged at the end
  static_assert(kFold == 1 || (kSets == 2 && (kFold == 2 || kFold == 4)),
                "folded tokens: heads8, 2 or 4 tokens per pseudo token");
  constexpr int kHeads = kHeadsPerCta / kFold;  // real KV heads per CTA
  const int fold_j = kFold == 1 ? 0 : warp / kHeads;
  const int kv_head = kFold == 1 ? hg * kHeadsPerCta + warp : warp % kHeads;

  const int len_tokens = __ldg(p.seq_lens + b);
  const int len = kFold == 1 ? len_tokens : (len_tokens + kFold - 1) / kFold;
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
  swapped_q_fragments<D>(p, b, kv_head, r, c, qb, head_scale);
  TRACE_EXT_TIMELINE_MARK();  // prologue issued, Q in registers

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
  // heads8 (<= 128 registers) keeps the softmax references; the 4-warp kernel (<= 102) spilled them
  std::conditional_t<kSets == 2, RunRefs, RunRefsRecomputed> refs;
  float l_run[2] = {0.0f, 0.0f};

  // folded tokens: this warp's pseudo token t is token kFold t + fold_j, valid for t < ceil((len - fold_j) / kFold)
  const int warp_end = kFold == 1 ? end : min(end, (len_tokens - fold_j + kFold - 1) / kFold);
  for (int i = 0; i < n_stages; ++i) {
    cp_async_wait<kRing - 2>();
    __syncthreads();  // stage i landed for all threads; every warp is done with stage i - 1
    if (i == 0) TRACE_EXT_TIMELINE_MARK();  // the first stage landed
    if (i + kRing - 1 < n_stages) issue();
    cp_async_commit();

    const uint8_t* st = smem + (i % kRing) * kSetStage;
    const int tile = kSets * i + set;  // heads8: set 1's tile of the last stage may lie past the split
    if (kSets > 1 && tile >= n_tiles) continue;
    const int t0 = start + tile * kTile;

    // ---- S^T = K.Q^T, the online softmax, O^T += V^T.P^T (the g8 kernel's tile step) ----
    swapped_tile<D>(st, k_off, ks_off, v_off, vs_off, qb, head_scale, t0, warp_end, r, m_run, refs, l_run, o);
  }
  cp_async_wait<0>();
  TRACE_EXT_TIMELINE_MARK();  // the loop's end

  // ---- this warp's heads 2c, 2c + 1 (if < G): lane (r, c) holds d = r * D/8 + j, j = 0 .. D/8 - 1 ----
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 4);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 8);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 16);
  }
  // heads8: set 1's (m, l, O) joins set 0's warp of the same head; set 0 writes the result
  if constexpr (kFold > 1) {
    merge_fold_states<D, kFold, kRing>(smem, warp, set, lane, o, m_run, l_run);
    if (fold_j != 0 || set != 0) return;
  } else if constexpr (kSets > 1) {
    merge_warp_sets<D>(smem, warp, set, lane, o, m_run, l_run);
  }
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
  TRACE_EXT_TIMELINE_END();
  // (folded tokens: the host always takes the separate combine kernel)
  if (kFold > 1 || p.num_splits == 1 || p.split_counters == nullptr) return;
  // Fused split-K finish, as in merge_warps: the last CTA of the (sequence, head group) combines all splits of its
  // 4 G query heads.
  if (!arrived_last(p.split_counters + (int64_t)b * p.heads_kv + hg, p.num_splits)) return;
  heads_split_finish<D, kSets * kThreads>(p, smem, hg, b);
}

}  // namespace
}  // namespace trace_ext
