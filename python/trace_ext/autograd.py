"""Fake quantization with the straight-through estimator (SPEC 2-5): the trainer side of TRACE.

``fake_quantize(x)`` returns dequantize(quantize(x)) and passes gradients through unchanged
(d x^ / d x = identity, SPEC 5). Rounding: "rtn", "sr" (explicit seed / offset) or "guided" (the rollout's
GuidanceRecord: its scale bytes and g, its mantissa bits or codes). ``capture=True`` also returns the
record of the rounding that was made (what a rollout keeps, or what the trainer made, for agreement metrics).
Quantization goes through ``trace_ext.ops`` (CUDA kernel when built, reference otherwise).
"""
from __future__ import annotations

import torch

from . import ops
from ._args import check_bool, is_int
from .reference import check_float_input
from .tensor import GuidanceRecord

FORMATS = ("nvfp4", "mxfp4")


def quantize_with_record(x: torch.Tensor, *, kind: str = "compact", rounding: str = "rtn", guidance=None, g=None,
                         scope: str = "row", seed: int = 0, offset: int = 0, backend: str = "auto"):
    """NVFP4-quantize ``x`` [..., K] and return (NVFP4Tensor, GuidanceRecord of ``kind`` with rows flattened)."""
    if kind not in ("compact", "full"):
        raise ValueError(f"kind must be 'compact' or 'full', got {kind!r}")
    if kind == "compact":
        return ops.nvfp4_quantize(x, g, scope=scope, rounding=rounding, seed=seed, offset=offset, guidance=guidance,
                                  capture=True, backend=backend)
    q = ops.nvfp4_quantize(x, g, scope=scope, rounding=rounding, seed=seed, offset=offset, guidance=guidance, backend=backend)
    K, R = x.shape[-1], q.g.numel()  # rows from g: reshape(-1, 0) cannot infer them when K = 0
    rec = GuidanceRecord("full", q.codes.reshape(R, K // 2), q.scales.reshape(R, K // 16), q.g.reshape(-1))
    return q, rec


def _check_format_options(fmt: str, g, scope: str, scale_rounding: str) -> None:
    """Options of one format given to the other are errors, not ignored (SPEC 10): g and scope are NVFP4's (MXFP4 has
    no global scale), scale_rounding is MXFP4's (NVFP4 block scales are always round-to-nearest E4M3; its values are
    checked by ops.mxfp4_quantize)."""
    if fmt == "mxfp4" and (g is not None or scope != "row"):
        raise ValueError("g and scope are NVFP4 options (MXFP4 has no global scale); leave them unset for format='mxfp4'")
    if fmt == "nvfp4" and scale_rounding != "floor":
        raise ValueError("scale_rounding is an MXFP4 option (NVFP4 scales are E4M3 round-to-nearest)")


def _fake_quant_values(x, fmt, rounding, guidance, g, scope, seed, offset, capture, kind, backend, scale_rounding):
    """float32 dequantized values of quantize(x) (exact fl(fl(q*s)*g)), and the record when capturing."""
    xf = x.float()
    if fmt == "mxfp4":
        if rounding == "guided" or guidance is not None:
            raise ValueError("guided rounding is defined for NVFP4 (SPEC 5); MXFP4 takes rounding='rtn' or 'sr'")
        if capture:
            raise ValueError("capture (guidance records) is defined for NVFP4 (SPEC 6)")
        q = ops.mxfp4_quantize(xf, rounding=rounding, seed=seed, offset=offset, scale_rounding=scale_rounding, backend=backend)
        return ops.mxfp4_dequantize(q, torch.float32, backend=backend), None
    if capture:
        q, rec = quantize_with_record(xf, kind=kind, rounding=rounding, guidance=guidance, g=g, scope=scope, seed=seed,
                                      offset=offset, backend=backend)
        return ops.nvfp4_dequantize(q, torch.float32, backend=backend), rec
    y = ops.nvfp4_fake_quantize(xf, g, scope=scope, rounding=rounding, seed=seed, offset=offset, guidance=guidance, backend=backend)
    return y, None


class _FakeQuantSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_dtype, box, *args):
        y, rec = _fake_quant_values(x, *args)
        box.append(rec)
        ctx.in_dtype = x.dtype
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx, gy):
        # straight-through estimator: the gradient of the rounding is taken as the identity
        return (gy.to(ctx.in_dtype), None, None) + (None,) * 11


def fake_quantize(
    x: torch.Tensor,
    format: str = "nvfp4",
    *,
    rounding: str = "rtn",
    guidance: GuidanceRecord | None = None,
    g: torch.Tensor | float | None = None,
    scope: str = "row",
    seed: int = 0,
    offset: int = 0,
    capture: bool = False,
    kind: str = "compact",
    out_dtype: torch.dtype | None = None,
    scale_rounding: str = "floor",
    backend: str = "auto",
):
    """Differentiable fake quantization of ``x`` [..., K] along its last dim (gradient = identity).

    format: "nvfp4" (scope "row" for activations, "matrix" per [.., N, K] expert matrix, "tensor") or "mxfp4".
    rounding: "rtn" | "sr" (seed, offset) | "guided" (guidance: the rollout's record of these rows, NVFP4 only).
    capture: also return the GuidanceRecord ("compact" or "full", ``kind``) of the rounding made (NVFP4 only).
    out_dtype: dtype of the result (default x.dtype). float32 keeps the dequantized values exact.
    Returns y, or (y, record) with capture.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    check_float_input(x, 16 if format == "nvfp4" else 32, "x")
    _check_format_options(format, g, scope, scale_rounding)
    check_bool(capture=capture)
    if not capture and kind != "compact":
        raise ValueError(f"kind={kind!r} names the record of capture=True; leave it unset without capture")
    if out_dtype is not None and (not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point):
        raise TypeError(f"out_dtype must be a floating dtype, got {out_dtype}")
    out_dtype = out_dtype or x.dtype
    box: list = []
    y = _FakeQuantSTE.apply(x, out_dtype, box, format, rounding, guidance, g, scope, seed, offset, capture, kind, backend,
                            scale_rounding)
    return (y, box[0]) if capture else y


def _quantized_weight(w: torch.Tensor, fmt: str, dtype: torch.dtype, backend: str) -> torch.Tensor:
    scope = {"scope": "matrix"} if fmt == "nvfp4" else {}
    y, _ = _fake_quant_values(w.detach().contiguous(), fmt, "rtn", None, None, scope.get("scope", "row"), 0, 0, False,
                              "compact", backend, "floor")
    return y.to(dtype)


def _grouped(x, wq, bounds, transpose=False):
    parts = []
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            parts.append(x[lo:hi] @ (wq[e] if transpose else wq[e].T))
    n = wq.shape[2] if transpose else wq.shape[1]
    return torch.cat(parts) if parts else x.new_zeros(0, n)


class _FakeQuantGroupedMatmul(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ fq(w[e])^T. fq(w) is recomputed in backward instead of saved: the trainer then
    holds no fake-quantized copy of every expert matrix between forward and backward (only x and the parameter)."""

    @staticmethod
    def forward(ctx, x, w, bounds, fmt, backend):
        wq = _quantized_weight(w, fmt, x.dtype, backend)
        ctx.save_for_backward(x, w)
        ctx.meta = (bounds, fmt, backend)
        return _grouped(x, wq, bounds)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        bounds, fmt, backend = ctx.meta
        gy = gy.contiguous()
        gx = gw = None
        wq = _quantized_weight(w, fmt, gy.dtype, backend) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[0]:
            gx = _grouped(gy, wq, bounds, transpose=True)
        if ctx.needs_input_grad[1]:
            # straight-through: d fq(w) / d w = identity
            gw = torch.zeros(w.shape, dtype=gy.dtype, device=gy.device)
            for e in range(len(bounds) - 1):
                lo, hi = bounds[e], bounds[e + 1]
                if hi > lo:
                    gw[e] = gy[lo:hi].T @ x[lo:hi]
            gw = gw.to(w.dtype)
        return gx, gw, None, None, None


def fake_quant_grouped_matmul(x: torch.Tensor, w: torch.Tensor, bounds: list[int], format: str = "nvfp4",
                              backend: str = "auto") -> torch.Tensor:
    """QAT GEMM of the experts: rows of ``x`` [M, K] sorted by expert (``bounds`` = offsets as a list, E + 1 entries)
    times the RTN fake-quantized ``w`` [E, N, K] (NVFP4 one g per expert matrix, or MXFP4), in x's dtype.

    Gradients: d/dx through fq(w) (recomputed in backward), d/dw straight-through (SPEC 5). A dense layer is E = 1.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    block = 16 if format == "nvfp4" else 32
    check_float_input(x, block, "x")
    check_float_input(w, block, "w")
    if w.dim() != 3 or x.dim() != 2 or x.shape[1] != w.shape[2]:
        raise ValueError(f"expected x [M, K] and w [E, N, K] with the same K, got x {tuple(x.shape)} and w {tuple(w.shape)}")
    if isinstance(bounds, torch.Tensor):
        if bounds.is_floating_point() or bounds.is_complex() or bounds.dtype == torch.bool:
            raise TypeError(f"bounds must hold integers, got {bounds.dtype}")
        bounds = bounds.tolist()
    if not isinstance(bounds, (list, tuple)) or not all(is_int(b) for b in bounds):
        raise TypeError(f"bounds must be a list of ints (the offsets), got {bounds!r}")
    bounds = [int(b) for b in bounds]
    if (len(bounds) != w.shape[0] + 1 or bounds[0] != 0 or bounds[-1] != x.shape[0]
            or any(b > c for b, c in zip(bounds, bounds[1:]))):
        raise ValueError(
            f"bounds must have E + 1 = {w.shape[0] + 1} non-decreasing entries from 0 to M = {x.shape[0]}, got {bounds}")
    # contiguous rows: torch's matmul may take another path (another summation order) for a strided x
    return _FakeQuantGroupedMatmul.apply(x.contiguous(), w, bounds, format, backend)
