"""SPEC 7 GEMMs of the rollout path: the compiled op when it exists, else the float reference.

``Y[M, N] = sum_k A[m, k] * W[n, k]``, both K-major; W is FP4 (NVFP4 codes + E4M3 scales + per-matrix g_w, or
MXFP4); A is bf16 (W4A16) or FP4 (W4A4, per-row g_a). Reference: dequantize both in float64 (the q * s
products are exact; g_a * g_w is applied once, as the kernel's epilogue does), matmul, round to bf16.
Grouped (MoE) form: rows sorted by expert, ``offsets[E + 1]``, weights [E, N, K/2]; an empty expert is legal.
"""
from __future__ import annotations

import torch

from .. import formats as F
from ..tensor import MXFP4Tensor, NVFP4Tensor


def _compiled(name: str):
    """trace_ext.ops.<name> when the GEMM ops module provides it (imported lazily: it may be absent)."""
    try:
        from ..ops import gemm as _gemm
    except ImportError:
        return None
    return getattr(_gemm, name, None)


def _reference_module():
    try:
        from .. import reference_gemm
    except ImportError:
        return None
    return reference_gemm


def round_to_bf16(y: torch.Tensor) -> torch.Tensor:
    """float64 -> bfloat16 with one rounding (SPEC 7 reference); the shared helper when present."""
    rg = _reference_module()
    if rg is not None:
        return rg.round_to_bf16(y)
    # round-to-odd float32 intermediate, then the cast to bf16 rounds once correctly
    y32 = y.float()
    inexact = torch.isfinite(y) & torch.isfinite(y32) & (y32.double() != y)
    bits = y32.view(torch.int32)
    bits = torch.where(inexact & (y32.double().abs() > y.abs()), bits - 1, bits)
    bits = torch.where(inexact, bits | 1, bits)
    return bits.view(torch.float32).to(torch.bfloat16)


def _products(q) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q * s as float64 [..., K], per-row g as float64 [...] or None) of an FP4 tensor."""
    K = q.shape[-1]
    vals = F.e2m1_to_float(F.unpack_nibbles(q.codes)).double()
    if isinstance(q, NVFP4Tensor):
        s = F.e4m3_to_float(q.scales).double().repeat_interleave(F.NVFP4_BLOCK, dim=-1)
        return (vals * s).reshape(*q.shape[:-1], K), q.g.double()
    if isinstance(q, MXFP4Tensor):
        s = F.e8m0_to_float(q.scales).double().repeat_interleave(F.MXFP4_BLOCK, dim=-1)
        return (vals * s).reshape(*q.shape[:-1], K), None
    raise TypeError(f"expected an NVFP4Tensor or MXFP4Tensor, got {type(q).__name__}")


def grouped_linear_reference(a, w, offsets: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """SPEC 7 grouped reference: float64 products of both dequantized operands, g_a * g_w applied per row / expert,
    one rounding to ``out_dtype``. a: FP4 tensor [M, K] or float [M, K]; w: FP4 [E, N, K]; offsets int [E + 1]."""
    if isinstance(a, torch.Tensor):
        qa, ga = a.double(), None
    else:
        qa, ga = _products(a)
    qw, gw = _products(w)
    M, N = qa.shape[0], qw.shape[1]
    out = torch.zeros(M, N, dtype=torch.float64, device=qa.device)
    bounds = offsets.tolist()
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        if hi == lo:
            continue
        acc = qa[lo:hi] @ qw[e].T
        if ga is not None:
            acc = acc * ga[lo:hi, None]
        if gw is not None:
            acc = acc * gw[e].reshape(1, N)
        out[lo:hi] = acc
    return round_to_bf16(out) if out_dtype == torch.bfloat16 else out.to(out_dtype)


def _check_offsets_dtype(offsets) -> None:
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"offsets must be an integer tensor, got {type(offsets).__name__}")
    if offsets.is_floating_point() or offsets.is_complex() or offsets.dtype == torch.bool:
        raise TypeError(f"offsets must be an integer tensor (int32 or int64), got {offsets.dtype}")


def _check(a, w, offsets, out_dtype):
    """The reference path's arguments (SPEC 10); its offsets are read on the host anyway, so their values too."""
    if not isinstance(w, (NVFP4Tensor, MXFP4Tensor)) or len(w.shape) != 3:
        raise TypeError("w must be an FP4 tensor of shape [E, N, K]")
    if isinstance(a, torch.Tensor):
        if not a.is_floating_point():
            raise TypeError(f"a must be a floating tensor or an FP4 tensor, got {a.dtype}")
    elif not isinstance(a, (NVFP4Tensor, MXFP4Tensor)):
        raise TypeError(f"a must be a floating tensor or an FP4 tensor, got {type(a).__name__}")
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise TypeError(f"out_dtype must be a floating dtype, got {out_dtype}")
    E, K = w.shape[0], w.shape[-1]
    if len(a.shape) != 2 or a.shape[-1] != K:
        raise ValueError(f"a must be [M, {K}] (K of w), got shape {tuple(a.shape)}")
    _check_offsets_dtype(offsets)
    if offsets.dim() != 1 or offsets.numel() != E + 1:
        raise ValueError(f"offsets must have shape [{E + 1}], got {tuple(offsets.shape)}")
    bounds = offsets.tolist()
    if bounds[0] != 0 or bounds[-1] != a.shape[0] or any(b > c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"offsets must be non-decreasing from 0 to M = {a.shape[0]}, got {bounds}")


def _check_backend(backend: str) -> None:
    if backend not in ("auto", "cuda", "reference"):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'reference', got {backend!r}")


def _use_op(a, w, out_dtype) -> bool:
    """The compiled-op path covers NVFP4 weights with bf16 (W4A16) or NVFP4 (W4A4) activations and bf16 output."""
    from ..ops.gemm import PreparedFP4Weight

    nv_w = isinstance(w, (NVFP4Tensor, PreparedFP4Weight))
    a_ok = isinstance(a, NVFP4Tensor) or (isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16)
    return nv_w and a_ok and out_dtype == torch.bfloat16


def fp4_grouped_linear(a, w, offsets: torch.Tensor, *, out_dtype=torch.bfloat16, backend: str = "auto") -> torch.Tensor:
    """Grouped SPEC 7 GEMM: rows of ``a`` sorted by expert (``offsets``), FP4 weights ``w`` [E, N, K] -> [M, N].

    NVFP4 weights go through trace_ext.ops.fp4_grouped_linear (kernel when built, its reference otherwise);
    MXFP4 weights, or non-bf16 activations, through ``grouped_linear_reference``.
    """
    _check_backend(backend)
    _check_offsets_dtype(offsets)
    op = _compiled("fp4_grouped_linear")
    if op is not None and _use_op(a, w, out_dtype):
        if offsets.dtype != torch.int32 and not offsets.is_cuda and offsets.numel():
            lo, hi = int(offsets.min()), int(offsets.max())  # the op checks CPU offsets' values, after this cast
            if lo < -(2**31) or hi >= 2**31:
                raise ValueError(f"offsets must fit int32, got values in [{lo}, {hi}]")
        return op(a, w, offsets.to(torch.int32), backend=backend)
    if backend == "cuda":
        raise RuntimeError("backend='cuda': no compiled fp4_grouped_linear for these operands (NVFP4 weights, bf16 out)")
    _check(a, w, offsets, out_dtype)
    return grouped_linear_reference(a, w, offsets, out_dtype)


def fp4_linear(a, w, *, out_dtype=torch.bfloat16, backend: str = "auto") -> torch.Tensor:
    """Dense SPEC 7 GEMM: a [M, K] (FP4 or float), w FP4 [N, K] with one g_w -> [M, N]."""
    _check_backend(backend)
    op = _compiled("fp4_linear")
    if op is not None and _use_op(a, w, out_dtype):
        return op(a, w, backend=backend)
    if backend == "cuda":
        raise RuntimeError("backend='cuda': no compiled fp4_linear for these operands (NVFP4 weights, bf16 out)")
    if not isinstance(w, (NVFP4Tensor, MXFP4Tensor)) or len(w.shape) != 2:
        raise TypeError("w must be an FP4 tensor of shape [N, K]")
    w3 = _unsqueeze0(w)
    M = a.shape[0] if isinstance(a, (torch.Tensor, NVFP4Tensor, MXFP4Tensor)) else 0  # (_check names a bad a)
    offsets = torch.tensor([0, M], dtype=torch.int64, device=w.codes.device)
    _check(a, w3, offsets, out_dtype)
    return grouped_linear_reference(a, w3, offsets, out_dtype)


def _unsqueeze0(w):
    if isinstance(w, NVFP4Tensor):
        return NVFP4Tensor(w.codes.unsqueeze(0), w.scales.unsqueeze(0), w.g.reshape(1, -1), (1, *w.shape))
    return MXFP4Tensor(w.codes.unsqueeze(0), w.scales.unsqueeze(0), (1, *w.shape))
