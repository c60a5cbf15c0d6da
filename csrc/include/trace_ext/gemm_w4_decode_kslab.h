// Host entry of the opt-in K-slab decode GEMM (gemm_w4_decode_kslab_sm90.cu), called from run_decode_new of
// gemm_w4_decode_sm90.cu when TRACE_EXT_DECODE_IMPL=kslab (read at every call).
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include "trace_ext/gemm_w4_common.cuh"

namespace trace_ext {
namespace gemm_w4 {

// TRACE_EXT_DECODE_IMPL (read at every call, so that one process can time it against the default): 1 for "kslab",
// 2 for "kslab2" (the same kernel on the second packed form, reference_gemm.to_decode_layout2), else 0.
int decode_kslab_selected();

// Dense decode Y = A @ W^T through the K-slab kernel (form2: p.w_packed is the second packed form). Returns false
// (nothing launched) for shapes it does not take, so that the caller runs the default; raises RuntimeError on a
// device other than sm_90.
bool run_decode_kslab(const GemmParams& p, const at::Tensor& like, cudaStream_t stream, bool form2);

// Self-resetting split tickets, one buffer per (device, stream) (defined in gemm_w4_decode_sm90.cu).
int* ticket_buffer(const at::Tensor& like, cudaStream_t stream, int n);

}  // namespace gemm_w4
}  // namespace trace_ext
