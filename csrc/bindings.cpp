// Schemas of every trace_ext op. Implementations: the CUDA kernels register themselves next to their code
// (TORCH_LIBRARY_IMPL(trace_ext, CUDA, m) in each *.cu file); python/trace_ext/ops registers the fake
// (meta) implementations and reference-backed CPU kernels.
#include <Python.h>
#include <torch/library.h>

// A dummy module init: `import trace_ext._C` loads this library, which registers the ops.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(trace_ext, m) {
  // ---- quantization (quant_nvfp4.cu, quant_mxfp4.cu); x is [R, K] contiguous, rounding: 0 RTN, 1 SR,
  // 2 guided compact, 3 guided full; g None = per-row scale computed in the kernel.
  m.def(
      "nvfp4_quantize(Tensor x, Tensor? g, int rounding, int seed, int offset, Tensor? guide_scales, "
      "Tensor? guide_g, Tensor? guide_payload, bool swizzle, bool emit_mbits) -> (Tensor codes, Tensor scales, "
      "Tensor g_out, Tensor mbits)");
  m.def(
      "nvfp4_fake_quantize(Tensor x, Tensor? g, int rounding, int seed, int offset, Tensor? guide_scales, "
      "Tensor? guide_g, Tensor? guide_payload, bool emit_guidance) -> (Tensor y, Tensor mbits, Tensor scales, "
      "Tensor g_out)");
  m.def("nvfp4_dequantize(Tensor codes, Tensor scales, Tensor g, ScalarType dtype) -> Tensor");
  m.def("mxfp4_quantize(Tensor x, int rounding, int seed, int offset, bool scale_ceil) -> (Tensor codes, Tensor scales)");
  m.def("mxfp4_dequantize(Tensor codes, Tensor scales, ScalarType dtype) -> Tensor");

  // ---- FP4 GEMM (gemm_w4_sm90.cu ...): schemas added by that kernel family.
  // Y[M, N] = A @ W^T (SPEC 7). a: bf16 [M, K] (W4A16) or NVFP4 codes [M, K/2] with a_scales [M, K/16] and
  // g_a [M] (W4A4). W: codes [(E,) N, K/2], scales [(E,) N, K/16], g_w [1 | N] ([E | E*N] grouped);
  // w_packed: the decode layout of trace_ext.ops.prepare_fp4_weight (optional). Grouped rows are sorted by expert,
  // offsets [E+1].
  m.def(
      "fp4_linear(Tensor a, Tensor? a_scales, Tensor? g_a, Tensor w_codes, Tensor w_scales, Tensor g_w, "
      "Tensor? w_packed) -> Tensor");
  m.def(
      "fp4_grouped_linear(Tensor a, Tensor? a_scales, Tensor? g_a, Tensor w_codes, Tensor w_scales, Tensor g_w, "
      "Tensor offsets, Tensor? w_packed) -> Tensor");
  // MoE routing (moe_routing.cu): stable sort of the T*k (token, slot) pairs by expert; x_sorted[i] =
  // x[src_row[i]], dest_of[t*k + j] = sorted position of pair (t, j); unpermute sums the k rows of each token
  // weighted by topk_weights, in slot order, in fp32.
  m.def(
      "moe_permute(Tensor x, Tensor topk_ids, int num_experts) -> (Tensor x_sorted, Tensor src_row, "
      "Tensor dest_of, Tensor offsets)");
  m.def("moe_unpermute(Tensor y_sorted, Tensor dest_of, Tensor topk_weights) -> Tensor");

  // ---- FP4 KV cache (kv_append_fp4.cu, attn_decode_fp4kv_sm90.cu): schemas added by that kernel family.
  // Paged NVFP4 cache (SPEC 8): codes uint8 [pages, P, H_kv, D/2], scales uint8 [pages, P, H_kv, D/16].
  m.def(
      "fp4kv_append(Tensor(a!) k_codes, Tensor(b!) k_scales, Tensor(c!) v_codes, Tensor(d!) v_scales, Tensor k_new, "
      "Tensor v_new, Tensor block_table, Tensor cu_seqlens, Tensor start_pos, float g_k, float g_v) -> ()");
  m.def(
      "fp4kv_decode_attention(Tensor q, Tensor k_codes, Tensor k_scales, Tensor v_codes, Tensor v_scales, "
      "Tensor block_table, Tensor seq_lens, float softmax_scale, float g_k, float g_v, int num_splits) -> "
      "(Tensor out, Tensor lse)");
}
