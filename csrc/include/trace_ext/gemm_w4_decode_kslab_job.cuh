// The job body of the K-slab decode GEMM kernels (dense and grouped): CTA constants and shared-memory budget, the
// per-warp cp.async weight ring, the A slab staging (bf16 / W4A4), kslab_job_start / kslab_job_stream (the per-item
// MMA loop, warp segments, the cross-warp finisher and the slab partials) and the block-end store kslab_store_y.
// Part of the K-slab translation unit: csrc/gemm_w4_decode_kslab_sm90.cu includes it and holds the design notes, the
// two kernels and the host side.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "trace_ext/fp4_numerics.cuh"
#include "trace_ext/gemm_w4_common.cuh"

namespace trace_ext {
namespace gemm_w4 {

constexpr int kKsWarps = 16;                 // warps of a CTA (one CTA per SM)
constexpr int kKsThreads = kKsWarps * 32;
constexpr int kKsSuperK = 256;               // K per packed super-tile
constexpr int kKsTileBytes = 2304;           // one (16-row block, super-tile) of the decode layout
constexpr int kKsCodeBytes = 2048;           // its codes; then 8 scale bytes per lane
constexpr int kKsRowBytes = kKsSuperK * 2;   // bf16 bytes of one A row per super-tile
constexpr int kKsRowPad = 16;                // A row stride = Ls * 512 + 16 (= 16 mod 128: conflict-free LDS.128)
constexpr int kKsSmemMax = 227 * 1024;       // dynamic shared memory of one CTA (sm_90)
static_assert(kKsTileBytes == 16 * kKsSuperK / 2 + 16 * kKsSuperK / 16 && kKsCodeBytes == 16 * kKsSuperK / 2,
              "packed super-tile layout (reference_gemm.to_decode_layout)");
static_assert(kKsRowBytes % 128 == 0 && kKsRowPad % 128 == 16, "A row stride must be 16 mod 128 bytes");

// Ring slots per warp (see the design note): 2 (one tile ahead) for MT8 = 1 .. 4 8-row groups.
constexpr int kslab_stages(int /*mt8*/) { return 2; }
// The depth before the H200 A/Bs of rounds 20 (4 at <= 8 rows, 3 at 16) and 37 (3 at 32 rows);
// TRACE_EXT_KSLAB_STAGES=prev selects it (at 32 rows with the plans before round 37, kslab_ring_bytes).
constexpr int kslab_prev_stages(int mt8) { return mt8 == 1 ? 4 : 3; }
// Shared memory a plan reserves for the rings (the slab length L, so the slabs S and N chunks C follow from it). Up
// to 16 rows that of the previous depth, so the plans are the ones measured with both depths (longer slabs in the
// bytes the 2 slots free measured 0.99-1.02x: round 37). At 32 rows that of the 2 slots: L <= 9 instead of 7, e.g.
// Qwen3 gate_up (K = 2048) in one slab instead of two (grouped T = 256: 1.37x, round 37), dense 14336 x 4096 in 2
// slabs instead of 4 (1.12x). prev: the reservation of the previous depth (with TRACE_EXT_KSLAB_STAGES=prev).
constexpr int kslab_ring_bytes(int mt8, bool prev = false) {
  return kKsWarps * (mt8 <= 2 || prev ? kslab_prev_stages(mt8) : kslab_stages(mt8)) * kKsTileBytes;
}
// longest slab (super-tiles) whose A rows fit beside the rings
constexpr int kslab_max_l(int mt8, bool prev = false) {
  return ((kKsSmemMax - kslab_ring_bytes(mt8, prev)) / (8 * mt8) - kKsRowPad) / kKsRowBytes;
}
static_assert(kslab_max_l(1, true) >= 16 && kslab_max_l(2, true) >= 8 && kslab_max_l(3, true) >= 4 &&
                  kslab_max_l(4, true) >= 4,
              "the A slab must hold at least 4 super-tiles beside the rings");

// shared-memory accesses by 32-bit shared addresses (computed once per warp; a generic pointer makes the compiler
// rebuild the shared window base of every cp.async destination per tile)
// Weight copies carry an L2 evict_first policy: the weights are read once (into shared memory), so they should not
// push the slab partials and the activations out of L2.
__device__ __forceinline__ uint64_t ks_evict_first_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ void ks_cp_async16(uint32_t dst, const void* src, uint64_t pol) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, 16, %2;\n" ::"r"(dst), "l"(src), "l"(pol));
}
__device__ __forceinline__ void ks_cp_async8(uint32_t dst, const void* src, uint64_t pol) {
  asm volatile("cp.async.ca.shared.global.L2::cache_hint [%0], [%1], 8, 8, %2;\n" ::"r"(dst), "l"(src), "l"(pol));
}
// volatile: kept after the cp.async.wait_group that completes the slot (both are volatile asm)
__device__ __forceinline__ uint4 ks_lds128(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ uint2 ks_lds64(uint32_t a) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(a));
  return v;
}

// One slab's arrival at a block's ticket: returns the ticket before the add (S - 1: the last of the S slabs, which
// then resets it for the next launch on this stream). The caller is lane 0 after a __syncwarp, so the release covers
// the warp's partial stores; the acquire (with the warp barrier after it) makes every slab's partial visible.
__device__ __forceinline__ int ks_ticket_add(int* tk) {
  int ticket;
  asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], 1;\n" : "=r"(ticket) : "l"(tk) : "memory");
  return ticket;
}

__device__ __forceinline__ int kslab_first(int w, int I) { return (int)((int64_t)I * w / kKsWarps); }
__device__ __forceinline__ int kslab_warp_of(int j, int I) {  // the warp whose item range holds item j
  return (int)(((int64_t)(j + 1) * kKsWarps - 1) / I);
}

// One job of a K-slab kernel as the CTA sees it: K slab s of S (super-tiles kt0 .. kt0 + Ls - 1) of the 16-row
// blocks nb0 .. nb0 + I / Ls - 1, warp items [i0, i1) of the I items (block, k tile), block-major.
struct KsJob {
  int s, S, kt0, Ls, nb0, I, a_stride, i0, i1;
};

// A warp's weight ring for one job: item j -> slot (j - i0) % kStages; each lane copies and reads back only its own
// 72 bytes (cp.async.wait_group orders copy before read, no barrier).
template <int kStages>
struct KsRing {
  const uint8_t* src_issue;         // the lane's code chunk of item j_issue
  int j_issue, k_issue;             // next item to issue, its k tile in the slab
  int scale_src;                    // the lane's 8 scale bytes, from its code chunk
  uint32_t ring_lane, ring_lane_sc; // the lane's code chunk / scale bytes in slot 0
  uint32_t slot_issue;              // byte offset of the slot being filled
  uint64_t pol;                     // L2 evict_first policy of the weight copies (read once)
  int i1, Ls, KT;                   // end of the warp's items, slab length, super-tiles of K

  __device__ __forceinline__ void issue_next() {
    if (j_issue < i1) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) ks_cp_async16(ring_lane + slot_issue + kk * 512, src_issue + kk * 512, pol);
      ks_cp_async8(ring_lane_sc + slot_issue, src_issue + scale_src, pol);
      src_issue += kKsTileBytes;
      if (++k_issue == Ls) {  // next block: skip the other slabs' tiles
        k_issue = 0;
        src_issue += (int64_t)(KT - Ls) * kKsTileBytes;
      }
    }
    cp_async_commit();  // possibly empty: one group per item for wait_group
    ++j_issue;
    slot_issue = slot_issue + kKsTileBytes == kStages * kKsTileBytes ? 0 : slot_issue + kKsTileBytes;
  }
};

// bf16 A: rows 0 .. rows - 1 of the slab from a_g = a_src() (row stride K) -> a_s (row stride a_stride), one
// cp.async group issued before the weight ring's first groups. Rows rows .. 8 MT8 - 1 are not written: MMA columns are
// independent, so they only feed accumulator columns m >= rows, which are never stored (nor combined with stored
// ones).
template <class ASrc>
__device__ __forceinline__ void kslab_stage_a_bf16(uint8_t* a_s, ASrc&& a_src, int rows, int K, int a_stride, int Ls) {
  const int chunks = Ls * (kKsRowBytes / 16);  // 16-byte chunks per row
  const uint8_t* a_g = a_src();
  for (int r = 0; r < rows; ++r)
    for (int cc = threadIdx.x; cc < chunks; cc += kKsThreads)
      cp_async16(a_s + r * a_stride + cc * 16, a_g + (int64_t)r * K * 2 + cc * 16, true);
  cp_async_commit();
}

// W4A4 A: rows a_row0 .. a_row0 + rows - 1 of the slab dequantized once into a_s (exactly load_act_frags' values:
// bf16 q * s * 2^-7), while the weight groups are in flight
__device__ __forceinline__ void kslab_stage_a_fp4(const GemmParams& p, uint8_t* a_s, int a_row0, int rows, int kt0,
                                                  int Ls, int a_stride) {
  const int K = p.K;
  const int blocks = Ls * (kKsSuperK / 16);  // NVFP4 blocks of 16 per row
  for (int rr = 0; rr < rows; ++rr)
    for (int b = threadIdx.x; b < blocks; b += kKsThreads) {
      const int kb = kt0 * (kKsSuperK / 16) + b;
      const int64_t row = a_row0 + rr;
      const uint2 cw2 = __ldg(reinterpret_cast<const uint2*>(reinterpret_cast<const uint8_t*>(p.a) +
                                                             row * (K / 2) + kb * 8));
      const uint32_t sc = scale_bf16x2_folded(__ldg(p.a_scales + row * (K / 16) + kb));
      const uint32_t cw[2] = {cw2.x, cw2.y};
      uint32_t v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = bf16x2_mul(fp4x2_to_bf16x2_biased((cw[j >> 2] >> (8 * (j & 3))) & 0xFFu), sc);
      uint4* dst = reinterpret_cast<uint4*>(a_s + rr * a_stride + b * 32);
      dst[0] = make_uint4(v[0], v[1], v[2], v[3]);
      dst[1] = make_uint4(v[4], v[5], v[6], v[7]);
    }
}

// The job body shared by the dense and the grouped K-slab kernel, in two parts.
// kslab_job_start: the warp's weight ring (its first kStages - 1 items issued; A bf16 already issued by
// kslab_stage_a_bf16; W4A4 A rows a_row0 .. a_row0 + rows - 1 dequantized here while the weights stream in), then the
// CTA barrier after which A is visible. w: the weights of the job's matrix (the expert's, grouped); pol(): the L2
// policy of the weight copies (dense: created here, grouped: once per CTA).
template <bool kAFp4, int kStages, class PolFn>
__device__ __forceinline__ void kslab_job_start(KsRing<kStages>& r, const GemmParams& p, const KsJob& jb, const uint8_t* w,
                                                           int a_row0, int rows, uint8_t* ring, uint8_t* a_s,
                                                           int lane, PolFn&& pol) {
  const int K = p.K, KT = K / kKsSuperK;
  const int kt0 = jb.kt0, Ls = jb.Ls, nb0 = jb.nb0, i0 = jb.i0, i1 = jb.i1;
  r.j_issue = i0;
  r.k_issue = i0 < i1 ? i0 % Ls : 0;
  r.src_issue = w + lane * 16 +  // the lane's first code chunk of item i0
                ((int64_t)(nb0 + (i0 < i1 ? i0 / Ls : 0)) * KT + kt0 + r.k_issue) * kKsTileBytes;
  r.scale_src = kKsCodeBytes + 8 * lane - 16 * lane;
  r.ring_lane = smem_u32(ring) + lane * 16;
  r.ring_lane_sc = smem_u32(ring) + kKsCodeBytes + lane * 8;
  r.slot_issue = 0;
  r.pol = pol();
  r.i1 = i1;
  r.Ls = Ls;
  r.KT = KT;
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) r.issue_next();
}

// Segment slots in shared memory (kSegSmem; the default up to 16 rows since the H200 A/B at 0c439e6, where they were
// opt-in: 1.01-1.05x at <= 8 rows, dense and grouped (Qwen3 T = 16 gate_up 63.4% of copy, 3.38x grouped_mm), 0.98-1.01x
// at 16 rows; TRACE_EXT_KSLAB_SEG=l2, read per call, keeps the L2 slots of the kernels before): a warp's
// two fp32 segment partials (the block it started inside, the block it stopped inside) go into the first 2 x MT8 x 512
// bytes of its own cp.async ring once its stream is done, instead of through L2 (ws_seg, __stcg / __ldcg), so the
// finisher reads them after the CTA barrier with ld.shared. The first segment ends mid-stream while the ring is still
// filling, so it waits in registers (MT8 x 4 more) until the last item; a segment ending at the last item is written
// after a __syncwarp (every lane's copies into the ring have landed: each waited for its own groups). Same sums in
// the same order: bit-equal to the L2 slots. 32 rows keep the L2 slots (the registers would spill).
__device__ __forceinline__ void ks_sts32(uint32_t a, float v) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(a), "f"(v) : "memory");
}
__device__ __forceinline__ float ks_lds32(uint32_t a) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(a) : "memory");
  return v;
}

// kslab_job_stream: the per-item MMA loop over the warp's items, segment ends, the cross-warp finisher and the
// slab-partial arrival / reduction. seg_base: the CTA's segment slots (+ lane) in L2, or (kSegSmem) unused: the
// slots lie in the warps' rings (warp w's ring at ring0 + w * kStages * kKsTileBytes). The kernel-specific parts:
// store_y(nb, v) (Y of block nb from its fp32 sums), slab_partial(ss, nb) (the lane's slab ss partial of block nb),
// arrive(nb) (lane 0: adds 1 to block nb's self-resetting ticket, ks_ticket_add; 1 for the last of the S slabs).
template <int MT8, int kStages, bool kForm2, bool kSegSmem = false, class StoreY, class SlabPartial, class Arrive>
__device__ __forceinline__ void kslab_job_stream(const KsJob& jb, KsRing<kStages>& r, uint8_t* a_s, float* seg_base,
                                                 int warp_id, int lane, StoreY&& store_y, SlabPartial&& slab_partial,
                                                 Arrive&& arrive) {
  constexpr int kFrag = MT8 * 4;  // fp32 accumulators per lane
  const int g = lane >> 2, t = lane & 3;
  const int s = jb.s, S = jb.S, Ls = jb.Ls, nb0 = jb.nb0, I = jb.I, a_stride = jb.a_stride, i0 = jb.i0, i1 = jb.i1;
  const uint32_t ring_lane = r.ring_lane, ring_lane_sc = r.ring_lane_sc;
  static_assert(!kSegSmem || 2 * kFrag * 32 * 4 <= kStages * kKsTileBytes, "two segment slots must fit a warp's ring");
  // shared-memory segment slot `slot` of warp w, this lane's word of accumulator (i, cc): + (i * 4 + cc) * 128
  const uint32_t ring0 = ring_lane - 16 * lane - (uint32_t)warp_id * (kStages * kKsTileBytes);
  auto seg_smem = [&](int w, int slot) {
    return ring0 + (uint32_t)w * (kStages * kKsTileBytes) + (uint32_t)slot * (kFrag * 128) + 4 * lane;
  };
  auto store_seg_smem = [&](int slot, const float (&v)[MT8][4]) {  // this warp's slot, after a __syncwarp
    const uint32_t dst = seg_smem(warp_id, slot);
#pragma unroll
    for (int i = 0; i < MT8; ++i)
#pragma unroll
      for (int cc = 0; cc < 4; ++cc) ks_sts32(dst + (i * 4 + cc) * 128, v[i][cc]);
  };
  float seg0[kSegSmem ? MT8 : 1][4];  // kSegSmem: the first segment, held until the stream is done
  bool seg0_held = false;

  // a block's sums over this slab: Y (one slab) or its slab partial (arrival after the stream)
  auto finish_block = [&](int nb, const float (&v)[MT8][4]) {
    if (S == 1) {
      store_y(nb, v);
    } else {
      float* dst = slab_partial(s, nb);
#pragma unroll
      for (int i = 0; i < MT8; ++i)
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) __stcg(dst + (i * 4 + cc) * 32, v[i][cc]);
    }
  };

  float acc[MT8][4];
#pragma unroll
  for (int i = 0; i < MT8; ++i)
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) acc[i][cc] = 0.f;

  // compute cursor: block x (of the job), k tile kl (of the slab)
  int x = i0 < i1 ? i0 / Ls : 0, kl = i0 < i1 ? i0 - x * Ls : 0;
  uint32_t slot_rd = 0;  // byte offset of the slot being read
  const uint32_t a_lane = smem_u32(a_s) + g * a_stride + 32 * t;  // row g, elements 16t .. 16t + 15 of a 64-K step
  for (int j = i0; j < i1; ++j) {
    asm volatile("" ::: "memory");  // the reads of the slot refilled here (previous item) stay before it
    r.issue_next();
    cp_async_wait<kStages - 1>();   // the group of item j is complete
    asm volatile("" ::: "memory");  // and the reads below stay after the wait
    const uint32_t srd = ring_lane + slot_rd;
    const uint2 sv = ks_lds64(ring_lane_sc + slot_rd);
    slot_rd = slot_rd + kKsTileBytes == kStages * kKsTileBytes ? 0 : slot_rd + kKsTileBytes;
    const uint32_t a_t = a_lane + kl * kKsRowBytes;

    constexpr int kKkUnroll = 4;  // whole tile unrolled (<= 128 registers at 32 rows: no spills)
#pragma unroll kKkUnroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t bq[MT8][8];
#pragma unroll
      for (int i = 0; i < MT8; ++i) {
        const uint32_t src = a_t + 8 * i * a_stride + kk * 128;
        const uint4 x0 = ks_lds128(src), x1 = ks_lds128(src + 16);
        bq[i][0] = x0.x; bq[i][1] = x0.y; bq[i][2] = x0.z; bq[i][3] = x0.w;
        bq[i][4] = x1.x; bq[i][5] = x1.y; bq[i][6] = x1.z; bq[i][7] = x1.w;
      }
      const uint32_t sw = kk < 2 ? sv.x : sv.y;
      decode_mma_step<MT8, kForm2>(ks_lds128(srd + kk * 512), sw, kk, bq, acc);
    }

    // ---- end of a block segment: the whole slab of the block -> finish; part of it -> segment slot
    if (kl == Ls - 1 || j == i1 - 1) {
      if (kl == Ls - 1 && x * Ls >= i0) {
        finish_block(nb0 + x, acc);
      } else if constexpr (kSegSmem) {
        if (j == i1 - 1) {  // the stream is done: into the ring (slot 1, or slot 0 when the warp saw one block)
          __syncwarp();
          store_seg_smem(i0 < x * Ls ? 1 : 0, acc);
        } else {  // slot 0, mid-stream: held in registers
#pragma unroll
          for (int i = 0; i < MT8; ++i)
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) seg0[i][cc] = acc[i][cc];
          seg0_held = true;
        }
      } else {
        float* dst = seg_base + ((int64_t)warp_id * 2 + (i0 < x * Ls ? 1 : 0)) * (kFrag * 32);
#pragma unroll
        for (int i = 0; i < MT8; ++i)
#pragma unroll
          for (int cc = 0; cc < 4; ++cc) __stcg(dst + (i * 4 + cc) * 32, acc[i][cc]);
      }
#pragma unroll
      for (int i = 0; i < MT8; ++i)
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) acc[i][cc] = 0.f;
      ++x;
      kl = 0;
    } else {
      ++kl;
    }
  }
  cp_async_wait<0>();  // no copy into the job's slots or A outlives the job (nor the kernel's shared memory)
  if constexpr (kSegSmem) {
    if (seg0_held) {  // warp-uniform
      __syncwarp();
      store_seg_smem(0, seg0);
    }
  }
  __syncthreads();     // the segment partials of every warp are visible to the CTA

  // ---- blocks split between warps: the warp holding a block's first tile adds the segments in warp order
  const int xw0 = (i0 + Ls - 1) / Ls, xw1 = i1 / Ls;  // blocks whose slab tiles all lie in [i0, i1)
  const int xl = i1 > i0 ? (i1 - 1) / Ls : -1;
  const bool finisher = i1 > i0 && xl * Ls >= i0 && (xl + 1) * Ls > i1;  // then xl == xw1
  if (finisher) {
    float v[MT8][4];
#pragma unroll
    for (int i = 0; i < MT8; ++i)
#pragma unroll
      for (int cc = 0; cc < 4; ++cc) v[i][cc] = 0.f;
    const int wl = kslab_warp_of((xl + 1) * Ls - 1, I);
    for (int ww = warp_id; ww <= wl; ++ww) {
      const int f = kslab_first(ww, I);
      if (f == kslab_first(ww + 1, I)) continue;  // no items
      if constexpr (kSegSmem) {
        const uint32_t src = seg_smem(ww, f < xl * Ls ? 1 : 0);
#pragma unroll
        for (int i = 0; i < MT8; ++i)
#pragma unroll
          for (int cc = 0; cc < 4; ++cc) v[i][cc] = __fadd_rn(v[i][cc], ks_lds32(src + (i * 4 + cc) * 128));
      } else {
        const float* src = seg_base + ((int64_t)ww * 2 + (f < xl * Ls ? 1 : 0)) * (kFrag * 32);
#pragma unroll
        for (int i = 0; i < MT8; ++i)
#pragma unroll
          for (int cc = 0; cc < 4; ++cc) v[i][cc] = __fadd_rn(v[i][cc], __ldcg(src + (i * 4 + cc) * 32));
      }
    }
    finish_block(nb0 + xl, v);
  }
  if (S == 1) return;

  // ---- slab partials: one arrival per finished block; the last slab adds the S partials in slab order
  __syncwarp();
  const int x_end = finisher ? xw1 + 1 : xw1;
  for (int xb = xw0; xb < x_end; ++xb) {
    const int nb = nb0 + xb;
    int last = arrive(nb);
    last = __shfl_sync(0xffffffffu, last, 0);
    if (!last) continue;
    __syncwarp();  // acquire (lane 0's acq_rel atomic, then the warp barrier): every slab's partial is visible
    float v[MT8][4];
#pragma unroll
    for (int i = 0; i < MT8; ++i)
#pragma unroll
      for (int cc = 0; cc < 4; ++cc) v[i][cc] = 0.f;
    for (int ss = 0; ss < S; ++ss) {
      const float* src = slab_partial(ss, nb);
#pragma unroll
      for (int i = 0; i < MT8; ++i)
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) v[i][cc] = __fadd_rn(v[i][cc], __ldcg(src + (i * 4 + cc) * 32));
    }
    store_y(nb, v);
  }
}

// Y of one 16-row block from the lane's fp32 sums (the stream kernel's epilogue): y = bf16((sum * fold) * (g_a[m] *
// g_w[n])) for rows m = m0 + 8 i + 2 t + (cc & 1) < m_end and columns n = nb * 16 + g + 8 (cc >> 1), gw = the
// matrix's (expert's) g_w; g_a is 1 for W4A16 (GemmParams.g_a is null exactly when A is bf16). The scale loads are
// issued before the first store: as far as the compiler knows y may alias them, so the loads written between the stores
// before (until 43401ee) were issued and waited for output by output, with a branch around each (12 dependent loads of
// g_w and 12 of g_a per block end at 24 rows; the 24-row grouped kernel had 4072 static instructions, now 2488). H200
// A/B (round 44, two timings, bit-equal): grouped Qwen3 1.02-1.12x (down T = 256 1.12x, gate_up T = 256 1.05x, down
// T = 16 / 64 1.07 / 1.08x), dense decode 1.00-1.05x.
template <int MT8, bool kAFp4>
__device__ __forceinline__ void kslab_store_y(const GemmParams& p, const float* gw, int nb, int m0, int m_end, int lane,
                                              float fold, const float (&v)[MT8][4]) {
  const int g = lane >> 2, t = lane & 3;
  const int n0 = nb * 16 + g;
  const float gw_n[2] = {__ldg(gw + (int64_t)n0 * p.gw_stride_n), __ldg(gw + (int64_t)(n0 + 8) * p.gw_stride_n)};
  float ga[MT8][2];
#pragma unroll
  for (int i = 0; i < MT8; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + 8 * i + 2 * t + h;
      ga[i][h] = kAFp4 && m < m_end ? __ldg(p.g_a + m) : 1.0f;
    }
#pragma unroll
  for (int i = 0; i < MT8; ++i)
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
      const int m = m0 + 8 * i + 2 * t + (cc & 1);
      if (m < m_end) {
        const float y = __fmul_rn(__fmul_rn(v[i][cc], fold), __fmul_rn(ga[i][cc & 1], gw_n[cc >> 1]));
        p.y[(int64_t)m * p.N + n0 + 8 * (cc >> 1)] = __float2bfloat16_rn(y);
      }
    }
}

}  // namespace gemm_w4
}  // namespace trace_ext
