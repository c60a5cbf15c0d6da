"""Public quantization ops (SPEC 2-6): NVFP4 / MXFP4 quantize, dequantize, fake-quantize, with capture.

Each function checks its arguments, picks a backend (``backend="auto" | "cuda" | "reference"``) and calls
either the compiled kernel ``torch.ops.trace_ext.*`` or the pure-torch reference. The compiled ops get
fake (meta) implementations here, so ``torch.compile(fullgraph=True)`` traces through them, and CPU
implementations built on the reference, so ``torch.library.opcheck`` can exercise them without a GPU.
"""
from __future__ import annotations

import torch

from .. import formats as F
from .. import reference as ref
from .._args import check_bool, is_int
from .._loader import extension_loaded
from ..tensor import GuidanceRecord, MXFP4Tensor, NVFP4Tensor
from ._backend import resolve_backend, torch_op

# Rounding codes shared with the kernels (csrc/include/trace_ext/fp4_numerics.cuh, enum Rounding).
ROUNDING_CODE = {"rtn": 0, "sr": 1, ("guided", "compact"): 2, ("guided", "full"): 3}
_SEED_LIMIT = 2**63  # seeds and offsets travel as int64 through the op schemas


def _rounding_code(rounding: str, guidance: GuidanceRecord | None) -> int:
    if rounding not in ref.ROUNDINGS:
        raise ValueError(f"rounding must be one of {ref.ROUNDINGS}, got {rounding!r}")
    if guidance is not None and not isinstance(guidance, GuidanceRecord):
        raise TypeError(f"guidance must be a GuidanceRecord, got {type(guidance).__name__}")
    if rounding == "guided":
        if guidance is None:
            raise ValueError("rounding='guided' needs a guidance record")
        return ROUNDING_CODE[("guided", guidance.kind)]
    if guidance is not None:
        raise ValueError(f"guidance was given but rounding={rounding!r}; use rounding='guided'")
    return ROUNDING_CODE[rounding]


def _check_seed(seed: int, offset: int) -> None:
    for name, v in (("seed", seed), ("offset", offset)):
        if not is_int(v):
            raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if not (0 <= seed < _SEED_LIMIT and 0 <= offset < _SEED_LIMIT):
        raise ValueError(f"seed and offset must be in [0, 2^63), got seed={seed}, offset={offset}")


def _rows_g(x: torch.Tensor, g, scope: str) -> torch.Tensor | None:
    """g as one float32 per row for the kernel; None means 'per-row, computed by the kernel'."""
    R = ref.rows_of(x.shape)
    if g is not None:
        if not isinstance(g, torch.Tensor):
            g = torch.tensor(float(g), dtype=torch.float32, device=x.device)
        if g.device != x.device:
            raise RuntimeError(f"g is on {g.device} but x is on {x.device}")
        return ref.check_g(g, R).contiguous()
    if scope == "row":
        return None
    # the amax reduction of a per-tensor / per-matrix scale is a first pass in torch (same float ops)
    return ref.expand_g_to_rows(ref.nvfp4_global_scale(x, scope), x.shape, scope).reshape(R)


def _guide_args(guidance: GuidanceRecord | None, R: int, K: int, device):
    if guidance is None:
        return None, None, None
    ref._check_guidance(guidance, R, K)
    if guidance.payload.device != device:
        raise RuntimeError(f"guidance is on {guidance.payload.device} but x is on {device}")
    return guidance.scales.contiguous(), guidance.g.contiguous(), guidance.payload.contiguous()


def _check_fp4_parts(q, block: int) -> None:
    """The parts of an NVFP4Tensor / MXFP4Tensor agree with its logical shape [..., K] (SPEC 10: ValueError naming the
    part): codes [..., K/2], linear scales [..., K/block] (NVFP4 swizzled: checked by from_swizzled), NVFP4 g with one
    value per row or one for all."""
    want = NVFP4Tensor if block == F.NVFP4_BLOCK else MXFP4Tensor
    if not isinstance(q, want):
        raise TypeError(f"q must be an {want.__name__}, got {type(q).__name__}")
    shape = tuple(q.shape)
    if len(shape) < 1 or shape[-1] % block:
        raise ValueError(f"shape must be [..., K] with K a multiple of {block}, got {shape}")
    lead, K = shape[:-1], shape[-1]
    ref.check_uint8(q.codes, "codes", (*lead, K // 2))
    if not getattr(q, "swizzled", False):
        ref.check_uint8(q.scales, "scales", (*lead, K // block))
    elif q.scales.dtype != torch.uint8:
        raise TypeError(f"scales must be uint8 (E4M3 bytes, swizzled), got {q.scales.dtype}")
    if block == F.NVFP4_BLOCK:
        if not isinstance(q.g, torch.Tensor) or q.g.dtype != torch.float32:
            raise TypeError(f"g must be a float32 tensor, got {getattr(q.g, 'dtype', type(q.g).__name__)}")
        R = ref.rows_of(shape)
        if q.g.numel() not in (1, R):
            raise ValueError(f"g must have one value per row ({R}) or one in all, got shape {tuple(q.g.shape)}")


def _empty_rows_to_reference(which: str, shape) -> str:
    """K = 0 (rows without blocks) runs the reference on x's device: empty tensors give empty results (SPEC 10); the
    kernels take K > 0."""
    return "reference" if shape[-1] == 0 else which


def _x_backend(backend: str, x: torch.Tensor, g=None, guidance: GuidanceRecord | None = None) -> str:
    """The backend of a quantize call on x (with its tensor g and guidance on the same device)."""
    tensors = (t for t in (g, guidance and guidance.payload) if isinstance(t, torch.Tensor))
    return _empty_rows_to_reference(resolve_backend(backend, x, *tensors), x.shape)


def _check_nvfp4_args(x, g, scope: str, rounding: str, guidance, seed: int, offset: int) -> int:
    """The argument checks of nvfp4_quantize and nvfp4_fake_quantize (SPEC 10), the same for both and for every
    backend (scope is checked even when g is given and does not use it); returns the op's rounding code."""
    ref.check_float_input(x, F.NVFP4_BLOCK)
    code = _rounding_code(rounding, guidance)
    ref.check_no_g_when_guided(g, rounding)
    _check_seed(seed, offset)
    if scope not in ref.SCOPES:
        raise ValueError(f"scope must be one of {ref.SCOPES}, got {scope!r}")
    return code


def nvfp4_quantize(
    x: torch.Tensor,
    g: torch.Tensor | float | None = None,
    *,
    scope: str = "row",
    rounding: str = "rtn",
    seed: int = 0,
    offset: int = 0,
    guidance: GuidanceRecord | None = None,
    swizzle: bool = False,
    capture: bool = False,
    backend: str = "auto",
):
    """NVFP4-quantize ``x`` [..., K] (SPEC 2, 4, 5).

    g: decode scale per row (or one value); None computes it over ``scope`` ("row": activations,
    "tensor": weights, "matrix": per expert matrix of an [E, N, K] weight).
    rounding: "rtn" | "sr" (``seed``, ``offset``) | "guided" (``guidance``: the rollout's record).
    swizzle: return scales in the 128x4 layout of the Blackwell kernels.
    capture: also return the compact GuidanceRecord of what was produced (the rollout side).
    """
    code = _check_nvfp4_args(x, g, scope, rounding, guidance, seed, offset)
    check_bool(swizzle=swizzle, capture=capture)
    shape = tuple(x.shape)
    K = shape[-1]
    R = ref.rows_of(x.shape)
    which = _x_backend(backend, x, g, guidance)

    if which == "reference":
        q = ref.nvfp4_quantize(x, g, scope=scope, rounding=rounding, seed=seed, offset=offset, guidance=guidance)
        rec = ref.guidance_from_quantized(q, "compact") if capture else None
        if swizzle:
            q.scales = F.to_swizzled(q.scales.reshape(R, K // F.NVFP4_BLOCK))
            q.swizzled = True
    else:
        g_rows = _rows_g(x, g, scope)
        gs, gg, gp = _guide_args(guidance, R, K, x.device)
        codes, scales, g_out, mbits = torch_op("nvfp4_quantize")(
            x.reshape(R, K).contiguous(), g_rows, code, seed, offset, gs, gg, gp, swizzle, capture
        )
        lead = shape[:-1]
        q = NVFP4Tensor(
            codes=codes.reshape(*lead, K // 2),
            scales=scales if swizzle else scales.reshape(*lead, K // F.NVFP4_BLOCK),
            g=g_out.reshape(lead),
            shape=shape,
            swizzled=swizzle,
        )
        rec = None
        if capture:
            lin = scales if not swizzle else F.from_swizzled(scales, R, K // F.NVFP4_BLOCK)
            rec = GuidanceRecord("compact", mbits, lin, g_out)
    return (q, rec) if capture else q


def nvfp4_dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16, *, backend: str = "auto") -> torch.Tensor:
    """x^ = fl(fl(q * s) * g), cast to ``dtype`` (bfloat16, float16 or float32)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    _check_fp4_parts(q, F.NVFP4_BLOCK)
    which = _empty_rows_to_reference(resolve_backend(backend, q.codes, q.scales, q.g), q.shape)
    K = q.shape[-1]
    R = ref.rows_of(q.shape)
    scales = q.scales if not q.swizzled else F.from_swizzled(q.scales, R, K // F.NVFP4_BLOCK)
    if which == "reference":
        return ref.nvfp4_dequantize(NVFP4Tensor(q.codes, scales, q.g, q.shape), dtype)
    g = q.g.reshape(-1).expand(R).contiguous()
    out = torch_op("nvfp4_dequantize")(q.codes.reshape(R, K // 2).contiguous(), scales.reshape(R, -1).contiguous(), g, dtype)
    return out.reshape(q.shape)


def nvfp4_fake_quantize(
    x: torch.Tensor,
    g: torch.Tensor | float | None = None,
    *,
    scope: str = "row",
    rounding: str = "rtn",
    seed: int = 0,
    offset: int = 0,
    guidance: GuidanceRecord | None = None,
    capture: bool = False,
    backend: str = "auto",
):
    """dequantize(quantize(x)) in x's dtype, fused into one pass on the GPU (no autograd here).

    capture=True also returns the compact GuidanceRecord of the rounding it made (trainer-side capture).
    """
    code = _check_nvfp4_args(x, g, scope, rounding, guidance, seed, offset)
    check_bool(capture=capture)
    which = _x_backend(backend, x, g, guidance)
    if which == "reference":
        q = ref.nvfp4_quantize(x, g, scope=scope, rounding=rounding, seed=seed, offset=offset, guidance=guidance)
        y = ref.nvfp4_dequantize(q, x.dtype)
        return (y, ref.guidance_from_quantized(q, "compact")) if capture else y
    K = x.shape[-1]
    R = ref.rows_of(x.shape)
    g_rows = _rows_g(x, g, scope)
    gs, gg, gp = _guide_args(guidance, R, K, x.device)
    y, mbits, scales, g_out = torch_op("nvfp4_fake_quantize")(
        x.reshape(R, K).contiguous(), g_rows, code, seed, offset, gs, gg, gp, capture
    )
    y = y.reshape(x.shape)
    return (y, GuidanceRecord("compact", mbits, scales, g_out)) if capture else y


def mxfp4_quantize(
    x: torch.Tensor,
    *,
    rounding: str = "rtn",
    seed: int = 0,
    offset: int = 0,
    scale_rounding: str = "floor",
    backend: str = "auto",
) -> MXFP4Tensor:
    """MXFP4-quantize ``x`` [..., K] (SPEC 3): E8M0 scale per 32 elements, RTN or SR."""
    ref.check_float_input(x, F.MXFP4_BLOCK)
    if rounding not in ("rtn", "sr"):
        raise ValueError(f"MXFP4 rounding must be 'rtn' or 'sr', got {rounding!r}")
    if scale_rounding not in ("floor", "ceil"):
        raise ValueError(f"scale_rounding must be 'floor' or 'ceil', got {scale_rounding!r}")
    _check_seed(seed, offset)
    which = _x_backend(backend, x)
    if which == "reference":
        return ref.mxfp4_quantize(x, rounding=rounding, seed=seed, offset=offset, scale_rounding=scale_rounding)
    K = x.shape[-1]
    R = ref.rows_of(x.shape)
    codes, scales = torch_op("mxfp4_quantize")(
        x.reshape(R, K).contiguous(), ROUNDING_CODE[rounding], seed, offset, scale_rounding == "ceil"
    )
    lead = x.shape[:-1]
    return MXFP4Tensor(codes.reshape(*lead, K // 2), scales.reshape(*lead, K // F.MXFP4_BLOCK), tuple(x.shape))


def mxfp4_dequantize(q: MXFP4Tensor, dtype: torch.dtype = torch.bfloat16, *, backend: str = "auto") -> torch.Tensor:
    """x^ = q * 2^(b - 127), cast to ``dtype``."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    _check_fp4_parts(q, F.MXFP4_BLOCK)
    which = _empty_rows_to_reference(resolve_backend(backend, q.codes, q.scales), q.shape)
    if which == "reference":
        return ref.mxfp4_dequantize(q, dtype)
    K = q.shape[-1]
    R = ref.rows_of(q.shape)
    out = torch_op("mxfp4_dequantize")(q.codes.reshape(R, K // 2).contiguous(), q.scales.reshape(R, -1).contiguous(), dtype)
    return out.reshape(q.shape)


# ---- fake and CPU implementations of the compiled ops --------------------------------------------------------


def _guidance_from_args(code, gs, gg, gp):
    if code < 2:
        return None
    return GuidanceRecord("compact" if code == 2 else "full", gp, gs, gg)


def _rounding_name(code: int) -> str:
    return {0: "rtn", 1: "sr"}.get(code, "guided")


def _cpu_nvfp4_quantize(x, g, rounding, seed, offset, gs, gg, gp, swizzle, emit_mbits):
    q = ref.nvfp4_quantize(
        x, g, rounding=_rounding_name(rounding), seed=seed, offset=offset, guidance=_guidance_from_args(rounding, gs, gg, gp)
    )
    mbits = ref.mantissa_bits_of_codes(q.codes) if emit_mbits else x.new_empty((0,), dtype=torch.uint8)
    scales = F.to_swizzled(q.scales) if swizzle else q.scales
    return q.codes, scales, q.g, mbits


def _cpu_nvfp4_fake_quantize(x, g, rounding, seed, offset, gs, gg, gp, emit):
    q = ref.nvfp4_quantize(
        x, g, rounding=_rounding_name(rounding), seed=seed, offset=offset, guidance=_guidance_from_args(rounding, gs, gg, gp)
    )
    y = ref.nvfp4_dequantize(q, x.dtype)
    if not emit:
        e = x.new_empty((0,), dtype=torch.uint8)
        return y, e, e.clone(), x.new_empty((0,), dtype=torch.float32)
    return y, ref.mantissa_bits_of_codes(q.codes), q.scales, q.g


def _register_compiled_op_impls() -> None:
    """Fakes for every compiled quantization op, and reference-backed CPU kernels (for opcheck / CPU calls)."""
    lib = "trace_ext::"

    @torch.library.register_fake(lib + "nvfp4_quantize")
    def _(x, g, rounding, seed, offset, gs, gg, gp, swizzle, emit_mbits):
        R, K = x.shape
        if swizzle:
            rp, cp = F.swizzled_shape(R, K // F.NVFP4_BLOCK)
            scales = x.new_empty((rp, cp), dtype=torch.uint8)
        else:
            scales = x.new_empty((R, K // F.NVFP4_BLOCK), dtype=torch.uint8)
        mbits = x.new_empty((R, K // 8) if emit_mbits else (0,), dtype=torch.uint8)
        return x.new_empty((R, K // 2), dtype=torch.uint8), scales, x.new_empty((R,), dtype=torch.float32), mbits

    @torch.library.register_fake(lib + "nvfp4_fake_quantize")
    def _(x, g, rounding, seed, offset, gs, gg, gp, emit):
        R, K = x.shape
        if emit:
            return (
                torch.empty_like(x),
                x.new_empty((R, K // 8), dtype=torch.uint8),
                x.new_empty((R, K // F.NVFP4_BLOCK), dtype=torch.uint8),
                x.new_empty((R,), dtype=torch.float32),
            )
        e = x.new_empty((0,), dtype=torch.uint8)
        return torch.empty_like(x), e, x.new_empty((0,), dtype=torch.uint8), x.new_empty((0,), dtype=torch.float32)

    @torch.library.register_fake(lib + "nvfp4_dequantize")
    def _(codes, scales, g, dtype):
        return codes.new_empty((codes.shape[0], codes.shape[1] * 2), dtype=dtype)

    @torch.library.register_fake(lib + "mxfp4_quantize")
    def _(x, rounding, seed, offset, scale_ceil):
        R, K = x.shape
        return x.new_empty((R, K // 2), dtype=torch.uint8), x.new_empty((R, K // F.MXFP4_BLOCK), dtype=torch.uint8)

    @torch.library.register_fake(lib + "mxfp4_dequantize")
    def _(codes, scales, dtype):
        return codes.new_empty((codes.shape[0], codes.shape[1] * 2), dtype=dtype)

    torch.library.register_kernel(lib + "nvfp4_quantize", "cpu", _cpu_nvfp4_quantize)
    torch.library.register_kernel(lib + "nvfp4_fake_quantize", "cpu", _cpu_nvfp4_fake_quantize)
    torch.library.register_kernel(
        lib + "nvfp4_dequantize",
        "cpu",
        lambda codes, scales, g, dtype: ref.nvfp4_dequantize(NVFP4Tensor(codes, scales, g), dtype),
    )
    torch.library.register_kernel(
        lib + "mxfp4_quantize",
        "cpu",
        lambda x, rounding, seed, offset, ceil: (
            lambda q: (q.codes, q.scales)
        )(ref.mxfp4_quantize(x, rounding=_rounding_name(rounding), seed=seed, offset=offset, scale_rounding="ceil" if ceil else "floor")),
    )
    torch.library.register_kernel(
        lib + "mxfp4_dequantize", "cpu", lambda codes, scales, dtype: ref.mxfp4_dequantize(MXFP4Tensor(codes, scales), dtype)
    )


if extension_loaded():
    _register_compiled_op_impls()
