// FP4 KV-cache decode attention: constants, launch parameters, PTX helpers, FP4 -> fp16 fragment expansion, the
// per-warp tile loader and the pieces shared by the split-KV kernels (split ranges, softmax steps, merges).
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
#include "trace_ext/pdl.cuh"

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

// The fused split-K finish's election (threadFenceReduction pattern), called by every thread of the CTA after it
// stored its split's partials: publish them, count this CTA's arrival on `counter` (cycles 0 .. num_splits - 1, so it
// is back at 0 after every launch); true in the last CTA to arrive, which then sees every split's partials.
__device__ __forceinline__ bool arrived_last(unsigned int* counter, int num_splits) {
  __shared__ bool last_split;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last_split = atomicInc(counter, num_splits - 1) == (unsigned int)(num_splits - 1);
  __syncthreads();
  if (!last_split) return false;
  __threadfence();
  return true;
}

// Lane quarter c of query row `head` of KV head kv_head in sequence b as floats (qv[e] = q[.., c * D / 4 + e]; zeros
// for head >= group); returns max |qv|. The kernels scale it into fp16 MMA fragments by a power of two.
template <int D>
__device__ __forceinline__ float load_q_quarter(const DecodeParams& p, int b, int kv_head, int head, int c,
                                                float (&qv)[D / 4]) {
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
  return amax;
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
  // Fused split-K finish: the last CTA of the (sequence, KV head) combines all splits of its G query heads.
  if (!arrived_last(p.split_counters + (int64_t)b * p.heads_kv + kv_head, p.num_splits)) return;
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

// What the online softmax derives from the running max m of two rows (heads 2c, 2c + 1 in the g8 and heads kernels,
// rows r, r + 8 in the M = 16 kernel): the rescale threshold m + kRescaleSlack and the exponent reference (m, or 0
// while m = -inf). RunRefs forms them only when m changes (the rescale path); RunRefsRecomputed per tile, two
// registers fewer (the g8, 4-warp heads and M = 16 kernels; the first two, at <= 102 registers, spilled with RunRefs).
struct RunRefs {
  float t[2] = {-INFINITY, -INFINITY};
  float r[2] = {0.0f, 0.0f};
  __device__ __forceinline__ float thr(const float (&)[2], int h) const { return t[h]; }
  __device__ __forceinline__ float ref(const float (&)[2], int h) const { return r[h]; }
  __device__ __forceinline__ void set(int h, float m) {
    t[h] = m + kRescaleSlack;
    r[h] = m == -INFINITY ? 0.0f : m;
  }
};
struct RunRefsRecomputed {
  __device__ __forceinline__ float thr(const float (&m)[2], int h) const { return m[h] + kRescaleSlack; }
  __device__ __forceinline__ float ref(const float (&m)[2], int h) const { return m[h] == -INFINITY ? 0.0f : m[h]; }
  __device__ __forceinline__ void set(int, float) {}
};

// The cross-warp combine's shared memory (over the stages): O [warps][16][kOStride], m and l [warps][16].
struct CombineSmem {
  float *o, *m, *l;
};
__device__ __forceinline__ CombineSmem combine_smem(uint8_t* smem) {
  float* o = reinterpret_cast<float*>(smem);
  float* m = o + kWarps * kMaxGroup * kOStride;
  return {o, m, m + kWarps * kMaxGroup};
}

}  // namespace
}  // namespace trace_ext
