"""Public FP4 KV-cache ops (SPEC 8): append, decode attention, gather, trainer-side guidance and prefill.

Every function checks its arguments (SPEC 10), picks a backend (``backend="auto" | "cuda" | "reference"``)
and calls either the compiled kernel (``torch.ops.trace_ext.fp4kv_*``: csrc/kv_append_fp4.cu,
csrc/attn_decode_fp4kv_sm90.cu) or the reference (``trace_ext.reference_kv``).

Decode and prefill read the same numbers: the decode kernel dequantizes the cache (x^ = q * s_b * g), and
the prefill / trainer path fake-quantizes K/V with the same static g (RTN, which is exactly what append
stores) or guided by the cache's own codes (``fp4kv_gather_guidance``, kind "full"), then runs torch SDPA.
"""
from __future__ import annotations

import math
import numbers

import torch

from .. import reference_kv as rkv
from .._loader import extension_loaded
from ..formats import NVFP4_BLOCK
from .._args import check_bool, is_int
from ..kvcache import PagedFP4KVCache, _check_static_g
from ..tensor import GuidanceRecord
from ._backend import resolve_backend, torch_op
from .quant import nvfp4_fake_quantize

CUDA_HEAD_DIMS = (64, 128)  # head dims the CUDA kernels are built for
CUDA_MAX_GQA = 16  # query heads per KV head handled by one decode CTA (one m16 MMA tile)


# ---- argument checks (SPEC 10) ----------------------------------------------------------------------------------


def _check_cache(cache) -> None:
    if not isinstance(cache, PagedFP4KVCache):
        raise TypeError(f"cache must be a trace_ext.kvcache.PagedFP4KVCache, got {type(cache).__name__}")


def _check_int32(t, name: str, shape: tuple | None = None, dims: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")


def _check_device(cache: PagedFP4KVCache, **tensors) -> None:
    for name, t in tensors.items():
        if t.device != cache.k_codes.device:
            raise RuntimeError(f"{name} is on {t.device} but the cache is on {cache.k_codes.device}")


def _check_bf16(x, name: str, shape: tuple) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be bfloat16, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def _value_checks_possible(*tensors: torch.Tensor) -> bool:
    """Data-dependent checks need a host sync; skip them while a CUDA graph is being captured or compiled."""
    if torch.compiler.is_compiling():
        return False
    if any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing():
        return False
    return True


def _check_table(cache: PagedFP4KVCache, block_table: torch.Tensor, end_pos: torch.Tensor, what: str) -> None:
    """Every position < end_pos[b] must have a page in the table, and every used page id must be in range."""
    B, max_pages = block_table.shape
    if B == 0:
        return
    P = cache.page_size
    used_pages = (end_pos.long() + P - 1) // P  # [B]
    cols = torch.arange(max_pages, device=block_table.device)[None, :]
    used = cols < used_pages[:, None]
    bad_page = used & ((block_table < 0) | (block_table >= cache.num_pages))
    flags = torch.stack([(used_pages > max_pages).any(), bad_page.any(), (end_pos < 0).any()]).cpu()
    if flags[0]:
        raise ValueError(
            f"block_table [{B}, {max_pages}] holds {max_pages * P} tokens per sequence (page_size {P}) but {what} needs "
            f"up to {int(end_pos.max())}"
        )
    if flags[1]:
        raise ValueError(f"block_table holds page ids outside [0, {cache.num_pages}) in the pages {what} uses")
    if flags[2]:
        raise ValueError(f"{what}: negative positions")


# ---- append ----------------------------------------------------------------------------------------------------


def fp4kv_append(
    cache: PagedFP4KVCache,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_new: torch.Tensor,
    start_pos: torch.Tensor,
    backend: str = "auto",
    *,
    validate: bool = True,
) -> None:
    """Quantize new K/V rows into the cache, in place (one launch for all sequences and heads on CUDA).

    k_new, v_new: bfloat16 [T_new, H_kv, D], the new tokens of all sequences concatenated.
    block_table: int32 [B, max_pages]; cu_seqlens_new: int32 [B + 1] (offsets of each sequence's new rows,
    cu[0] = 0, cu[B] = T_new, non-decreasing); start_pos: int32 [B], tokens already cached per sequence.
    Token j of sequence b goes to position start_pos[b] + j. Any number of new tokens per sequence (a prefill
    chunk, one decode token, or none). Each (token, head) row is quantized exactly as
    ``reference.nvfp4_quantize(row, g=cache.g_k / g_v)`` (RTN, SPEC 2), bit for bit.
    validate: check cu_seqlens and that every target position has a valid page (one host sync); pass False
    in a decode loop whose allocator guarantees it (checks are skipped anyway under CUDA-graph capture and
    torch.compile).
    """
    _check_cache(cache)
    H, D = cache.num_kv_heads, cache.head_dim
    if not isinstance(k_new, torch.Tensor):
        raise TypeError(f"k_new must be a torch.Tensor, got {type(k_new).__name__}")
    if k_new.dim() != 3:
        raise ValueError(f"k_new must be [T_new, {H}, {D}], got shape {tuple(k_new.shape)}")
    T = k_new.shape[0]
    _check_bf16(k_new, "k_new", (T, H, D))
    _check_bf16(v_new, "v_new", (T, H, D))
    _check_int32(block_table, "block_table", dims=2)
    B = block_table.shape[0]
    _check_int32(cu_seqlens_new, "cu_seqlens_new", (B + 1,))
    _check_int32(start_pos, "start_pos", (B,))
    _check_device(cache, k_new=k_new, v_new=v_new, block_table=block_table, cu_seqlens_new=cu_seqlens_new, start_pos=start_pos)
    which = resolve_backend(backend, cache.k_codes, k_new, v_new, block_table, cu_seqlens_new, start_pos)
    check_bool(validate=validate)
    if validate and _value_checks_possible(k_new):
        cu = cu_seqlens_new.long()
        counts = cu[1:] - cu[:-1]
        bad = torch.stack([cu[0] != 0, cu[-1] != T, (counts < 0).any(), (start_pos < 0).any()]).cpu()
        if bad[:3].any():
            raise ValueError(
                f"cu_seqlens_new must start at 0, end at T_new={T} and be non-decreasing, got {cu_seqlens_new.tolist()}"
            )
        if bad[3]:  # position -1 would take the table's last column
            raise ValueError(f"start_pos must be >= 0 (tokens already cached), got {start_pos.tolist()}")
        _check_table(cache, block_table, start_pos.long() + counts, "the appended tokens")
    if T == 0:
        return
    if which == "reference":
        rkv.append(*cache.tensors(), cache.g_k, cache.g_v, k_new, v_new, block_table, cu_seqlens_new, start_pos)
        return
    torch_op("fp4kv_append")(
        cache.k_codes,
        cache.k_scales,
        cache.v_codes,
        cache.v_scales,
        k_new.contiguous(),
        v_new.contiguous(),
        block_table.contiguous(),
        cu_seqlens_new.contiguous(),
        start_pos.contiguous(),
        cache.g_k,
        cache.g_v,
    )


# ---- decode attention --------------------------------------------------------------------------------------------


def fp4kv_decode_attention(
    q: torch.Tensor,
    cache: PagedFP4KVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float | None = None,
    num_splits: int = 0,
    backend: str = "auto",
    *,
    validate: bool = True,
):
    """Attention of one query token per sequence over its whole cached length (the query is the newest token).

    q: bfloat16 [B, Hq, D], Hq a multiple of H_kv (GQA; query head i uses KV head i // (Hq / H_kv)).
    block_table: int32 [B, max_pages]; seq_lens: int32 [B], cached tokens per sequence (0 allowed).
    softmax_scale: default 1 / sqrt(D). num_splits: KV-length splits per (sequence, KV head) on CUDA
    (0 = heuristic that fills the GPU; combined by a second pass); ignored by the reference.
    Returns (out bfloat16 [B, Hq, D], lse float32 [B, Hq]): lse = log sum_j exp(softmax_scale * q.k_j)
    (natural log; -inf and out = 0 for an empty sequence). K/V are read dequantized: g_k is folded into the
    score scale and g_v into the output.
    validate: check that every cached position has a valid page (one host sync); pass False in a decode loop
    whose allocator guarantees it.
    """
    _check_cache(cache)
    H, D = cache.num_kv_heads, cache.head_dim
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3 or q.shape[2] != D or q.shape[1] % H or q.shape[1] == 0:
        raise ValueError(f"q must be [B, Hq, {D}] with Hq a positive multiple of H_kv={H}, got shape {tuple(q.shape)}")
    B, Hq = q.shape[0], q.shape[1]
    _check_bf16(q, "q", (B, Hq, D))
    _check_int32(block_table, "block_table", dims=2)
    if block_table.shape[0] != B:
        raise ValueError(f"block_table must be [{B}, max_pages], got shape {tuple(block_table.shape)}")
    _check_int32(seq_lens, "seq_lens", (B,))
    check_bool(validate=validate)
    if not is_int(num_splits):
        raise TypeError(f"num_splits must be an int >= 0 (0: automatic), got {type(num_splits).__name__} {num_splits!r}")
    if num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
    num_splits = int(num_splits)
    scale = _softmax_scale(softmax_scale, D)
    _check_device(cache, q=q, block_table=block_table, seq_lens=seq_lens)
    which = resolve_backend(backend, cache.k_codes, q, block_table, seq_lens)
    if which == "cuda" and (D not in CUDA_HEAD_DIMS or Hq // H > CUDA_MAX_GQA):
        if backend == "cuda":
            raise ValueError(
                f"the CUDA decode kernel takes head_dim in {CUDA_HEAD_DIMS} and <= {CUDA_MAX_GQA} query heads per KV "
                f"head, got head_dim={D}, {Hq // H}"
            )
        which = "reference"
    if validate and _value_checks_possible(q):
        _check_table(cache, block_table, seq_lens, "seq_lens")
    if B == 0:
        return q.new_empty((0, Hq, D)), q.new_empty((0, Hq), dtype=torch.float32)
    if which == "reference":
        out, lse = rkv.decode_attention(q, *cache.tensors(), cache.g_k, cache.g_v, block_table, seq_lens, scale)
        return out.to(torch.bfloat16), lse
    return torch_op("fp4kv_decode_attention")(
        q.contiguous(),
        cache.k_codes,
        cache.k_scales,
        cache.v_codes,
        cache.v_scales,
        block_table.contiguous(),
        seq_lens.contiguous(),
        scale,
        cache.g_k,
        cache.g_v,
        num_splits,
    )


# ---- trainer side: gather, guidance, prefill ------------------------------------------------------------------------


def _check_read_args(cache, block_table, seq_lens) -> None:
    _check_cache(cache)
    _check_int32(block_table, "block_table", dims=2)
    _check_int32(seq_lens, "seq_lens", (block_table.shape[0],))
    _check_device(cache, block_table=block_table, seq_lens=seq_lens)
    if _value_checks_possible(seq_lens):
        _check_table(cache, block_table, seq_lens, "seq_lens")


def fp4kv_gather(
    cache: PagedFP4KVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
):
    """Dequantized (K, V), each [B, H_kv, S_max, D] in ``dtype`` (S_max = max(seq_lens)); zeros past each length.

    Values are x^ = fl(fl(q * s_b) * g) (SPEC 2) rounded to ``dtype`` (float32 is exact).
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    _check_read_args(cache, block_table, seq_lens)
    return rkv.gather(*cache.tensors(), cache.g_k, cache.g_v, block_table, seq_lens, dtype)


def fp4kv_gather_guidance(
    cache: PagedFP4KVCache, block_table: torch.Tensor, seq_lens: torch.Tensor, which: str = "k"
) -> GuidanceRecord:
    """The cache's own quantization of K (which="k") or V ("v") as a "full" GuidanceRecord (SPEC 5).

    Rows in [B, H_kv, S_max] order (R = B * H_kv * S_max): payload = codes uint8 [R, D/2], scales uint8
    [R, D/16], g float32 [R] (the layer's static g). Rows past a sequence's length: zero codes, zero scale.
    Guided fake-quantization of the trainer's K/V [B, H_kv, S_max, D] with this record lands on the cache's
    codes wherever the trainer's values are the rollout's (and as close as possible elsewhere).
    """
    if which not in ("k", "v"):
        raise ValueError(f"which must be 'k' or 'v', got {which!r}")
    _check_read_args(cache, block_table, seq_lens)
    codes, scales = (cache.k_codes, cache.k_scales) if which == "k" else (cache.v_codes, cache.v_scales)
    g = cache.g_k if which == "k" else cache.g_v
    c, s = rkv.gather_codes(codes, scales, block_table, seq_lens)
    R = c.shape[0] * c.shape[1] * c.shape[2]
    D = cache.head_dim
    return GuidanceRecord(
        "full",
        payload=c.reshape(R, D // 2),
        scales=s.reshape(R, D // NVFP4_BLOCK),
        g=torch.full((R,), g, dtype=torch.float32, device=c.device),
    )


def fp4kv_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g_k: float,
    g_v: float,
    guidance_k: GuidanceRecord | None = None,
    guidance_v: GuidanceRecord | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention over fake-quantized K/V, the prefill / trainer-side twin of the FP4 cache (SPEC 8).

    q: bfloat16 [B, Hq, S_q, D]; k, v: bfloat16 [B, H_kv, S, D] (Hq a multiple of H_kv, S_q <= S).
    K and V are NVFP4 fake-quantized row by row with the layer's static g (RTN: exactly what
    ``fp4kv_append`` stores), or guided by the cache's records (``fp4kv_gather_guidance``, rows in
    [B, H_kv, S] order; their g is used), then torch SDPA runs in bfloat16 with GQA. causal: query i sits at
    position S - S_q + i (bottom-right aligned), so the last query sees every key and matches
    ``fp4kv_decode_attention`` over the same cache. Returns bfloat16 [B, Hq, S_q, D].
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{name} must be bfloat16, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, heads, seq, head_dim], got shape {tuple(t.shape)}")
    B, Hq, Sq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if tuple(k.shape) != (B, Hkv, S, D) or tuple(v.shape) != (B, Hkv, S, D) or Hkv == 0 or Hq % Hkv:
        raise ValueError(
            f"k and v must be [B={B}, H_kv, S, D={D}] with Hq={Hq} a multiple of H_kv, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if D % NVFP4_BLOCK:
        raise ValueError(f"head_dim must be a multiple of {NVFP4_BLOCK}, got {D}")
    if causal and Sq > S:
        raise ValueError(f"causal prefill needs S_q <= S, got S_q={Sq}, S={S}")
    if len({q.device, k.device, v.device}) != 1:
        raise RuntimeError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    check_bool(causal=causal)
    g_k = _check_static_g(g_k, "g_k")
    g_v = _check_static_g(g_v, "g_v")
    scale = _softmax_scale(softmax_scale, D)
    if D == 0:  # empty rows: an empty result (SPEC 10)
        return q.new_empty(B, Hq, Sq, 0)
    kq = _fake_quantize_kv(k, g_k, guidance_k, "guidance_k", backend)
    vq = _fake_quantize_kv(v, g_v, guidance_v, "guidance_v", backend)
    mask = None
    if causal and Sq != S:
        mask = rkv.bottom_right_causal_mask(Sq, S, q.device)
    return torch.nn.functional.scaled_dot_product_attention(
        q, kq, vq, attn_mask=mask, is_causal=causal and Sq == S, scale=scale, enable_gqa=Hq != Hkv
    )


def _softmax_scale(softmax_scale, D: int) -> float:
    """The attention's score scale (decode and prefill): a finite real number, 1 / sqrt(D) when None."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(D) if D else 1.0
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__} {softmax_scale!r}")
    if not math.isfinite(float(softmax_scale)):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    return float(softmax_scale)


def _fake_quantize_kv(x: torch.Tensor, g: float, guidance: GuidanceRecord | None, name: str, backend: str) -> torch.Tensor:
    if guidance is None:
        return nvfp4_fake_quantize(x, torch.tensor(g, dtype=torch.float32, device=x.device), backend=backend)
    if not isinstance(guidance, GuidanceRecord):
        raise TypeError(f"{name} must be a GuidanceRecord, got {type(guidance).__name__}")
    R = x.numel() // x.shape[-1]
    if guidance.rows != R:
        raise ValueError(f"{name} must have one row per [B, H_kv, S] row ({R}), got {guidance.rows}")
    return nvfp4_fake_quantize(x, rounding="guided", guidance=guidance, backend=backend)


# ---- fake and CPU implementations of the compiled ops ----------------------------------------------------------


def _register_compiled_op_impls() -> None:
    lib = "trace_ext::"

    @torch.library.register_fake(lib + "fp4kv_append")
    def _(k_codes, k_scales, v_codes, v_scales, k_new, v_new, block_table, cu_seqlens, start_pos, g_k, g_v):
        return None

    @torch.library.register_fake(lib + "fp4kv_decode_attention")
    def _(q, k_codes, k_scales, v_codes, v_scales, block_table, seq_lens, softmax_scale, g_k, g_v, num_splits):
        B, Hq, D = q.shape
        return torch.empty_like(q), q.new_empty((B, Hq), dtype=torch.float32)

    def _cpu_append(k_codes, k_scales, v_codes, v_scales, k_new, v_new, block_table, cu_seqlens, start_pos, g_k, g_v):
        rkv.append(k_codes, k_scales, v_codes, v_scales, g_k, g_v, k_new, v_new, block_table, cu_seqlens, start_pos)

    def _cpu_decode(q, k_codes, k_scales, v_codes, v_scales, block_table, seq_lens, softmax_scale, g_k, g_v, num_splits):
        out, lse = rkv.decode_attention(q, k_codes, k_scales, v_codes, v_scales, g_k, g_v, block_table, seq_lens, softmax_scale)
        return out.to(q.dtype), lse

    torch.library.register_kernel(lib + "fp4kv_append", "cpu", _cpu_append)
    torch.library.register_kernel(lib + "fp4kv_decode_attention", "cpu", _cpu_decode)


if extension_loaded() and hasattr(torch.ops.trace_ext, "fp4kv_append"):
    _register_compiled_op_impls()
