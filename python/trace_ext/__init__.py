"""trace_ext: FP4 (NVFP4 / MXFP4) kernels and the TRACE train-rollout alignment layer for MoE RL.

Import never fails because the compiled extension is missing: ``trace_ext.backends()`` says what is
usable, and every op falls back to the pure-torch reference (SPEC.md) unless ``backend="cuda"`` is forced.
"""
from ._loader import backends, build_config
from . import formats, reference, ops
from .tensor import GuidanceRecord, MXFP4Tensor, NVFP4Tensor

__version__ = "0.1.0"

__all__ = ["backends", "build_config", "formats", "reference", "ops", "GuidanceRecord", "MXFP4Tensor", "NVFP4Tensor"]

# Alignment layer (TRACE): autograd fake-quant, FP4 modules, RL sessions / guidance / metrics, HF integration.
try:
    from . import autograd, nn, rl, integrations  # noqa: E402

    __all__ += ["autograd", "nn", "rl", "integrations"]
except ImportError as _e:  # never let an optional layer break `import trace_ext`
    import warnings as _w

    _w.warn(f"trace_ext alignment layer unavailable: {_e}")
