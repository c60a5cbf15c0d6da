// Host entry of the K-slab decode GEMM (gemm_w4_decode_kslab_sm90.cu), called from run_decode_new of
// gemm_w4_decode_sm90.cu: the default dense decode kernel on sm_90 (TRACE_EXT_DECODE_IMPL unset), or named by
// TRACE_EXT_DECODE_IMPL=kslab / kslab2 (read at every call).
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include "trace_ext/gemm_w4_common.cuh"

namespace trace_ext {
namespace gemm_w4 {

// TRACE_EXT_DECODE_IMPL (read at every call, so that one process can time the kernels interleaved): 0 when unset
// (the default: kslab where it applies), 1 for "kslab", 2 for "kslab2" (the same kernel on the second packed form,
// reference_gemm.to_decode_layout2), -1 for any other value (another kernel named).
int decode_kslab_selected();

// Dense decode Y = A @ W^T through the K-slab kernel (form2: p.w_packed is the second packed form). Returns false
// (nothing launched) for shapes it does not take, so that the caller runs the stream / pair kernels; on a device
// other than sm_90 returns false when not named (named: raises RuntimeError).
bool run_decode_kslab(const GemmParams& p, const at::Tensor& like, cudaStream_t stream, bool form2, bool named);

// Grouped decode through the K-slab kernel generalized to units (expert, chunk of rows): the default on sm_90.
// TRACE_EXT_DECODE_IMPL (read at every call): 0 unset or naming a dense kernel (the grouped default: per call whole
// jobs or flat ranges, decided on the host from the expected unit count), 1 for "kslab-grouped" (whole (unit, slab,
// N chunk) jobs), 2 for "kslab-flat" (each CTA on one contiguous range of (unit, slab, block)) (dense calls under both
// keep the dense default), -1 for "stream" / "auto" (the grouped stream kernel).
int decode_kslab_grouped_selected();

// Grouped decode (p.offsets != nullptr, prepared weight) through the grouped K-slab kernel. Returns false (nothing
// launched) for shapes it does not take (the caller runs the stream kernel); on a device other than sm_90 returns
// false when not named (named: raises RuntimeError).
// selected: decode_kslab_grouped_selected() (>= 0; > 0 = named).
bool run_decode_kslab_grouped(const GemmParams& p, int64_t rows_hint, const at::Tensor& like, cudaStream_t stream,
                              int selected);

// Self-resetting split tickets, one buffer per (device, stream) (defined in gemm_w4_decode_sm90.cu).
int* ticket_buffer(const at::Tensor& like, cudaStream_t stream, int n);

}  // namespace gemm_w4
}  // namespace trace_ext
