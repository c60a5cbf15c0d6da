// Timeline marks for the standalone probes (tools/probes/timeline.cu): each CTA's thread 0 records %globaltimer at
// its start, at chosen points of its walk and at its end, so a probe can see when CTAs start and end (launch ramp,
// waves, tail) and how long each step takes. The marks compile to nothing unless the including translation unit
// defines TRACE_EXT_TIMELINE before it includes a trace_ext header, so the extension's kernels are unchanged by them.
//   TRACE_EXT_TIMELINE_BEGIN(k)  at the top of a kernel: records into buffer k (0: the main kernel, 1: a dependent
//                                one such as a combine pass), slot 0 = start, the last slot = the SM id
//   TRACE_EXT_TIMELINE_MARK()    the next slot (uniform control flow: every thread counts, thread 0 writes)
//   TRACE_EXT_TIMELINE_END()     the next slot, then the slot count into the SM id word's high half
// Records are indexed by the linear CTA id (x fastest).
#pragma once

#ifdef TRACE_EXT_TIMELINE
#include <cstdint>

namespace trace_ext {
constexpr int kTimelineSlots = 16;  // per CTA: start, up to 13 marks, end, SM id and slot count
// two [grid][kTimelineSlots] record buffers (set by the probe with cudaMemcpyToSymbol; null: no records)
__device__ unsigned long long* timeline_records[2];

__device__ __forceinline__ unsigned long long timeline_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned long long* timeline_cta_records(int which) {
  unsigned long long* r = timeline_records[which];
  const size_t cta = blockIdx.x + (size_t)gridDim.x * (blockIdx.y + (size_t)gridDim.y * blockIdx.z);
  return r == nullptr || threadIdx.x != 0 ? nullptr : r + cta * kTimelineSlots;
}
__device__ __forceinline__ void timeline_mark(unsigned long long* r, uint32_t& slot) {
  if (r != nullptr && slot < kTimelineSlots - 1) r[slot] = timeline_now();
  ++slot;
}
__device__ __forceinline__ void timeline_end(unsigned long long* r, uint32_t& slot) {
  timeline_mark(r, slot);
  if (r != nullptr) {
    uint32_t sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    r[kTimelineSlots - 1] = ((unsigned long long)slot << 32) | sm;
  }
}
}  // namespace trace_ext

#define TRACE_EXT_TIMELINE_BEGIN(which)                                                        \
  unsigned long long* const timeline_cta_ = ::trace_ext::timeline_cta_records(which);         \
  uint32_t timeline_slot_ = 0;                                                                 \
  ::trace_ext::timeline_mark(timeline_cta_, timeline_slot_)
#define TRACE_EXT_TIMELINE_MARK() ::trace_ext::timeline_mark(timeline_cta_, timeline_slot_)
#define TRACE_EXT_TIMELINE_END() ::trace_ext::timeline_end(timeline_cta_, timeline_slot_)
#else
#define TRACE_EXT_TIMELINE_BEGIN(which) \
  do {                                  \
  } while (0)
#define TRACE_EXT_TIMELINE_MARK() \
  do {                            \
  } while (0)
#define TRACE_EXT_TIMELINE_END() \
  do {                           \
  } while (0)
#endif
