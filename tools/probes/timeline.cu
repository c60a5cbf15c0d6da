// Per-CTA timelines of the extension's own kernels (the lean3 quantizer, the heads8 KV decode and its combine
// kernels), for tools/probes/timeline.py: this file defines TRACE_EXT_TIMELINE before it includes the kernel headers,
// so their TRACE_EXT_TIMELINE_* marks (trace_ext/timeline.cuh; empty in the extension) record %globaltimer per CTA.
// The kernels are the extension's templates, launched with the extension's launch shapes (the host rules are restated
// here for the probe's shapes). A shared library with C launchers that timeline.py loads with ctypes; built by
// tools/probes/build_timeline.sh (torch's headers: the kernel headers include ATen through host_checks.h; the library
// links no torch symbol). tests/test_probe_build.py builds it on every machine with nvcc and a CUDA build of torch.
#define TRACE_EXT_TIMELINE 1
#include <cuda_runtime.h>

#include <cstdint>

#include "trace_ext/attn_decode_fp4kv_combine.cuh"
#include "trace_ext/attn_decode_fp4kv_heads.cuh"
#include "trace_ext/quant_nvfp4_rowg.cuh"

namespace trace_ext {
namespace {

__global__ void timeline_marker_kernel(unsigned long long* dst) { *dst = timeline_now(); }

}  // namespace
}  // namespace trace_ext

using namespace trace_ext;

extern "C" {

int timeline_slots() { return kTimelineSlots; }

// records0 / records1: device buffers of [grid][kTimelineSlots] uint64 for the main kernel / its dependent (combine)
// kernel (nullptr: that kernel records nothing)
int timeline_set_records(void* records0, void* records1) {
  void* both[2] = {records0, records1};
  return (int)cudaMemcpyToSymbol(timeline_records, both, sizeof(both));
}

// one thread writes %globaltimer to *dst (launched right before a timed kernel: its launch gap)
int timeline_marker(unsigned long long* dst, cudaStream_t stream) {
  timeline_marker_kernel<<<1, 1, 0, stream>>>(dst);
  return (int)cudaGetLastError();
}

// nvfp4 RTN quantize of bf16 x [rows, K] through nvfp4_quant_rowg_lean3_kernel with linear scales, no capture: g given
// (g != nullptr, g_stride 1) or per-row g; the launch shape of launch_rowg_lean3 (two blocks per lane, plan_row_lean
// with at most iters_cap row groups per CTA, rounded up to whole waves where whole_waves). Returns the grid size, or -1.
int launch_quant_lean3(const void* x, const float* g, uint8_t* codes, uint8_t* scales, float* g_out, int64_t rows,
                       int64_t K, int iters_cap, int whole_waves, int sms, cudaStream_t stream) {
  QuantParams p{};
  p.x = x;
  p.rows = rows;
  p.K = K;
  p.kb = K / kNvfp4Block;
  p.g = g;
  p.g_stride = 1;
  p.codes = codes;
  p.scales = scales;
  p.g_out = g_out;
  constexpr int kBpl = 2;
  RowLeanPlan plan;
  if (!plan_row_lean(p, kBpl, int64_t(sms) * kRowLeanCtasPerSm, iters_cap, whole_waves != 0, plan)) return -1;
  const int64_t grid = plan.grid;
  const RowLean3Walk w = row_lean3_walk(p, plan, kBpl);
  if (g != nullptr) {
    nvfp4_quant_rowg_lean3_kernel<__nv_bfloat16, kBpl, false, false, false, true><<<(unsigned)grid, kRowLeanThreads, 0,
                                                                                      stream>>>(p, w);
  } else {
    nvfp4_quant_rowg_lean3_kernel<__nv_bfloat16, kBpl, false, false, false, false><<<(unsigned)grid, kRowLeanThreads,
                                                                                       0, stream>>>(p, w);
  }
  return cudaGetLastError() == cudaSuccess ? (int)grid : -1;
}

// heads8 KV decode at D = 128 (fp4kv_decode_kernel_heads<128, 2, kHeads8Ring>, grid (splits, H_kv / 4, B), 256
// threads) and, for splits > 1, the combine kernel (wide: the wide one) as its programmatic dependent, as the
// extension launches them (the caller picks the split count the extension would). Returns the decode grid size, or -1.
int launch_kv_heads8(const void* q, const uint8_t* kc, const uint8_t* ks, const uint8_t* vc, const uint8_t* vs,
                     const int32_t* table, const int32_t* seq_lens, void* out, float* lse, float* o_part,
                     float* lse_part, int B, int Hq, int Hkv, int page, int max_pages, int splits, int wide,
                     float score_scale, float out_scale, cudaStream_t stream) {
  constexpr int D = 128;
  DecodeParams p{};
  p.q = reinterpret_cast<const uint16_t*>(q);
  p.out = reinterpret_cast<uint16_t*>(out);
  p.lse = lse;
  p.o_part = o_part;
  p.lse_part = lse_part;
  p.k_codes = kc;
  p.k_scales = ks;
  p.v_codes = vc;
  p.v_scales = vs;
  p.block_table = table;
  p.seq_lens = seq_lens;
  p.heads_q = Hq;
  p.heads_kv = Hkv;
  p.group = Hq / Hkv;
  p.page_size = page;
  p.max_pages = max_pages;
  p.num_splits = splits;
  p.score_scale = score_scale;
  p.out_scale = out_scale;
  auto kernel = fp4kv_decode_kernel_heads<D, 2, kHeads8Ring>;
  const int smem = heads8_smem<D>(kHeads8Ring);
  cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const dim3 grid(splits, Hkv / kHeadsPerCta, B);
  kernel<<<grid, 2 * kThreads, smem, stream>>>(p);
  if (cudaGetLastError() != cudaSuccess) return -1;
  if (splits > 1) {
    const unsigned ctas = (unsigned)(B * Hq);
    auto* outp = reinterpret_cast<uint16_t*>(out);
    const cudaError_t err =
        wide ? launch_kernel_status(fp4kv_decode_combine_wide_kernel<D>, dim3(ctas), kWideWarps * 32, 0, stream, true,
                                    (const float*)o_part, (const float*)lse_part, outp, lse, splits)
             : launch_kernel_status(fp4kv_decode_combine_kernel<D>, dim3(ctas), D, 0, stream, true,
                                    (const float*)o_part, (const float*)lse_part, outp, lse, splits);
    if (err != cudaSuccess) return -1;
  }
  return (int)(grid.x * grid.y * grid.z);
}
}
