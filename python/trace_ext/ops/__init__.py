"""trace_ext.ops: one public function per op; each takes backend="auto" | "cuda" | "reference"."""
from ..formats import from_swizzled, to_swizzled
from .quant import (
    mxfp4_dequantize,
    mxfp4_quantize,
    nvfp4_dequantize,
    nvfp4_fake_quantize,
    nvfp4_quantize,
)

__all__ = [
    "nvfp4_quantize",
    "nvfp4_dequantize",
    "nvfp4_fake_quantize",
    "mxfp4_quantize",
    "mxfp4_dequantize",
    "to_swizzled",
    "from_swizzled",
]

# FP4 KV cache (SPEC 8)
from .kv import (  # noqa: E402
    fp4kv_append,
    fp4kv_decode_attention,
    fp4kv_gather,
    fp4kv_gather_guidance,
    fp4kv_prefill_attention,
)

__all__ += [
    "fp4kv_append",
    "fp4kv_decode_attention",
    "fp4kv_gather",
    "fp4kv_gather_guidance",
    "fp4kv_prefill_attention",
]

# NVFP4 GEMM and MoE routing (SPEC 7)
from .gemm import (  # noqa: E402
    MoePermutation,
    PreparedFP4Weight,
    fp4_grouped_linear,
    fp4_linear,
    moe_permute,
    moe_unpermute,
    prepare_fp4_weight,
)

__all__ += [
    "fp4_linear",
    "fp4_grouped_linear",
    "prepare_fp4_weight",
    "PreparedFP4Weight",
    "moe_permute",
    "moe_unpermute",
    "MoePermutation",
]
