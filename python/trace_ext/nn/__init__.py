"""FP4 modules of the alignment layer: fused routed experts (transformers 5.x) and FP4Linear, each in the
session's mode (bf16 / rollout / qat / guided), plus the SPEC 7 GEMM helpers of the rollout path."""
from .experts import ExpertsSpec, expert_weights, fp4_experts_forward, pack_expert_weights
from .gemm import fp4_grouped_linear, fp4_linear, grouped_linear_reference
from .linear import FP4Linear

__all__ = [
    "ExpertsSpec",
    "FP4Linear",
    "expert_weights",
    "fp4_experts_forward",
    "fp4_grouped_linear",
    "fp4_linear",
    "grouped_linear_reference",
    "pack_expert_weights",
]
