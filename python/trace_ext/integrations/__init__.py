"""Framework integrations: Hugging Face MoE models in FP4 (``hf_moe``) and the FP4 KV cache for generate
(``hf_kvcache``). transformers is imported only when a function needs it."""
from .hf_moe import BACKEND_NAME, SUPPORTED_MODEL_TYPES, convert, unconvert, verify

__all__ = ["BACKEND_NAME", "SUPPORTED_MODEL_TYPES", "convert", "unconvert", "verify"]
