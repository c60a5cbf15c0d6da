"""One layer's paged FP4 (NVFP4) KV cache (SPEC 8).

Per (token, kv head) the cache holds ``head_dim/2`` code bytes (two E2M1 codes per byte, element 2i in the
low nibble) and ``head_dim/16`` E4M3 block-scale bytes (blocks of 16 along head_dim), plus one static fp32
decode scale per layer for K (``g_k``) and one for V (``g_v``). Dequantized value:
``x^ = fl(fl(q * s_b) * g)`` (SPEC 2).

Layout (token-major inside a page, as vLLM / FlashInfer "NHD" pages):

    k_codes, v_codes    uint8 [num_pages, page_size, num_kv_heads, head_dim // 2]
    k_scales, v_scales  uint8 [num_pages, page_size, num_kv_heads, head_dim // 16]

A sequence is addressed through a block table ``int32 [batch, max_pages]`` of page ids and its length:
token ``t`` of sequence ``b`` lives in page ``block_table[b, t // page_size]``, slot ``t % page_size``.
A contiguous cache is the special case of an identity table. Which pages belong to which sequence is the
caller's business (a page allocator); this class only owns the storage.

The ops that read and write it live in ``trace_ext.ops.kv`` (append, decode attention, gather, guidance,
prefill attention); the methods below are thin conveniences over them.
"""
from __future__ import annotations

import numbers

import torch

from .formats import NVFP4_BLOCK

SUPPORTED_HEAD_DIMS = (64, 128)  # the CUDA kernels are built for these; the reference takes any multiple of 16


class PagedFP4KVCache:
    """One layer's paged NVFP4 KV cache.

    Args:
        num_pages: pages in the pool.
        page_size: tokens per page (P), >= 1.
        num_kv_heads: H_kv.
        head_dim: D, a multiple of 16 (the CUDA kernels take 64 and 128).
        device: where the storage lives.
        g_k, g_v: the layer's static fp32 decode scales for K and V (SPEC 2, 8), finite and > 0.

    Attributes:
        k_codes, v_codes: uint8 [num_pages, page_size, num_kv_heads, head_dim // 2], zero-initialised.
        k_scales, v_scales: uint8 [num_pages, page_size, num_kv_heads, head_dim // 16], zero-initialised
            (a never-written slot dequantizes to 0).
        g_k, g_v: float.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        device,
        g_k: float = 1.0,
        g_v: float = 1.0,
    ):
        for name, v in (("num_pages", num_pages), ("page_size", page_size), ("num_kv_heads", num_kv_heads)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(head_dim, int) or head_dim < NVFP4_BLOCK or head_dim % NVFP4_BLOCK:
            raise ValueError(f"head_dim must be a positive multiple of {NVFP4_BLOCK}, got {head_dim!r}")
        self.g_k = _check_static_g(g_k, "g_k")
        self.g_v = _check_static_g(g_v, "g_v")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        code_shape = (num_pages, page_size, num_kv_heads, head_dim // 2)
        scale_shape = (num_pages, page_size, num_kv_heads, head_dim // NVFP4_BLOCK)
        self.k_codes = torch.zeros(code_shape, dtype=torch.uint8, device=self.device)
        self.v_codes = torch.zeros(code_shape, dtype=torch.uint8, device=self.device)
        self.k_scales = torch.zeros(scale_shape, dtype=torch.uint8, device=self.device)
        self.v_scales = torch.zeros(scale_shape, dtype=torch.uint8, device=self.device)

    # ---- sizes -------------------------------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        """Cache bytes per token (K and V, all heads): 2 * H_kv * (D/2 + D/16)."""
        return 2 * self.num_kv_heads * (self.head_dim // 2 + self.head_dim // NVFP4_BLOCK)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k_codes, k_scales, v_codes, v_scales)."""
        return self.k_codes, self.k_scales, self.v_codes, self.v_scales

    # ---- conveniences over trace_ext.ops.kv ----------------------------------------------------------------------
    def append(
        self, k_new, v_new, block_table, cu_seqlens_new, start_pos, backend: str = "auto", *, validate=True
    ) -> None:
        """Quantize and store new K/V rows; see ``trace_ext.ops.kv.fp4kv_append``."""
        from .ops.kv import fp4kv_append

        fp4kv_append(self, k_new, v_new, block_table, cu_seqlens_new, start_pos, backend=backend, validate=validate)

    def decode_attention(
        self, q, block_table, seq_lens, softmax_scale=None, num_splits: int = 0, backend: str = "auto", *, validate=True
    ):
        """Decode attention of one query token per sequence; see ``trace_ext.ops.kv.fp4kv_decode_attention``."""
        from .ops.kv import fp4kv_decode_attention

        return fp4kv_decode_attention(
            q, self, block_table, seq_lens, softmax_scale, num_splits, backend=backend, validate=validate
        )

    def gather(self, block_table, seq_lens, dtype: torch.dtype = torch.bfloat16):
        """Dequantized (K, V) [B, H_kv, S_max, D]; see ``trace_ext.ops.kv.fp4kv_gather``."""
        from .ops.kv import fp4kv_gather

        return fp4kv_gather(self, block_table, seq_lens, dtype)

    def __repr__(self) -> str:
        return (
            f"PagedFP4KVCache(num_pages={self.num_pages}, page_size={self.page_size}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, g_k={self.g_k}, g_v={self.g_v}, device={self.device})"
        )


def _check_static_g(g, name: str) -> float:
    """A layer's static decode scale (SPEC 8): one real number, finite and > 0 as the float32 the kernels see."""
    if isinstance(g, torch.Tensor):
        if g.numel() != 1:
            raise ValueError(f"{name} is one static value per layer, got a tensor of shape {tuple(g.shape)}")
        g = g.item()
    if isinstance(g, bool) or not isinstance(g, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(g).__name__} {g!r}")
    try:
        g = float(torch.tensor(float(g), dtype=torch.float32))  # the value the kernels see (fp32)
    except OverflowError:  # an int beyond float64
        g = float("inf")
    if not (g > 0 and g < float("inf")):
        raise ValueError(f"{name} must be finite and > 0, got {g}")
    return g
