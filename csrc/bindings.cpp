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

  // ---- FP4 KV cache (kv_append_fp4.cu, attn_decode_fp4kv_sm90.cu): schemas added by that kernel family.
}
