"""The numerics contract in plain torch: SPEC sections 2 (NVFP4), 3 (MXFP4), 4 (stochastic rounding),
5 (rollout-guided rounding) and 6 (guidance records). This is the oracle every kernel is tested against.

Shapes: quantizers take ``x`` [..., K] and work on its rows (all leading dims flattened). Per-row decode
scales ``g`` therefore have shape x.shape[:-1]. Every float operation is one float32 op (torch CPU and
CUDA elementwise ops are IEEE-754 RNE), matching ``fl(.)`` of the SPEC.
"""
from __future__ import annotations

import math

import torch

from . import formats as F
from .philox import sr_random_words
from .tensor import GuidanceRecord, MXFP4Tensor, NVFP4Tensor

ROUNDINGS = ("rtn", "sr", "guided")
SCOPES = ("row", "tensor", "matrix")


# ---- argument checks (SPEC 10) -----------------------------------------------------------------------------


def check_float_input(x: torch.Tensor, block: int, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] % block != 0:
        raise ValueError(
            f"{name}: the last dimension (K) must be a multiple of the {block}-element block, got shape {tuple(x.shape)}"
        )


def rows_of(shape) -> int:
    """Rows R of a [..., K] tensor: the product of the leading dimensions (also when K = 0, where numel() // K and
    reshape(-1, K) cannot tell)."""
    return math.prod(tuple(shape)[:-1])


def check_uint8(t: torch.Tensor, name: str, shape: tuple) -> None:
    if t.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_g(g: torch.Tensor, rows: int, name: str = "g") -> torch.Tensor:
    """A decode scale given per row ([rows] or anything broadcastable to it); float32, finite, > 0."""
    if not isinstance(g, torch.Tensor):
        g = torch.tensor(float(g), dtype=torch.float32)
    if g.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {g.dtype}")
    if g.numel() not in (1, rows):
        raise ValueError(f"{name} must have 1 or {rows} elements (one per row), got shape {tuple(g.shape)}")
    if g.numel() and not bool(torch.all(torch.isfinite(g) & (g > 0))):
        raise ValueError(f"{name} must be finite and > 0")
    return g.reshape(-1).expand(rows)


# ---- decode scales --------------------------------------------------------------------------------------------


def finite_amax(x: torch.Tensor, dims) -> torch.Tensor:
    """max |x| over finite values only (0 where nothing is finite), reduced over ``dims``, float32."""
    a = x.float().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    return a.amax(dim=dims) if a.numel() else a.sum(dim=dims)


def fdiv(a: torch.Tensor, b: float) -> torch.Tensor:
    """fl(a / b) for a Python-float divisor. Spelled tensor / tensor on purpose: torch's CUDA backend turns a
    division by a scalar into a multiplication by its reciprocal, which is not the IEEE quotient (off by 1 ulp)."""
    return a / torch.full_like(a, b)


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """g = fl(A / 2688); 1.0 where A == 0 (or nothing was finite)."""
    return torch.where(amax > 0, fdiv(amax, F.NVFP4_GLOBAL_DIV), torch.ones_like(amax))


def nvfp4_global_scale(x: torch.Tensor, scope: str = "row") -> torch.Tensor:
    """Decode scale g of SPEC 2, per row (shape x.shape[:-1]), per matrix (x.shape[:-2]) or per tensor (())."""
    if scope == "row":
        dims = (-1,)
    elif scope == "matrix":
        if x.dim() < 2:
            raise ValueError(f"scope='matrix' needs x with >= 2 dims, got shape {tuple(x.shape)}")
        dims = (-2, -1)
    elif scope == "tensor":
        dims = tuple(range(x.dim()))
    else:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    return global_scale_from_amax(finite_amax(x, dims))


def expand_g_to_rows(g: torch.Tensor, x_shape, scope: str) -> torch.Tensor:
    """A g of the given scope, as one value per row (shape x_shape[:-1])."""
    rows_shape = tuple(x_shape[:-1])
    if scope == "matrix":
        return g.reshape(*g.shape, 1).expand(rows_shape).contiguous()
    return g.expand(rows_shape).contiguous() if g.dim() == 0 else g.reshape(rows_shape)


# ---- NVFP4 (SPEC 2, 4, 5) ----------------------------------------------------------------------------------------


def _blocks(x2d: torch.Tensor, block: int) -> torch.Tensor:
    return x2d.reshape(x2d.shape[0], x2d.shape[1] // block, block)


def _sr_magnitude(a: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    lo, hi, lo_val, hi_val = F.e2m1_bracket(a)
    u = (words >> 8).to(torch.float32) * 2.0**-24
    p = (a - lo_val) / torch.where(hi == lo, torch.ones_like(a), hi_val - lo_val)
    return torch.where((hi != lo) & (u < p), hi, lo)


def unpack_mantissa_bits(mbits: torch.Tensor) -> torch.Tensor:
    """uint8 [R, K/8] -> int32 [R, K] of 0/1 (element 8j+t is bit t of byte j)."""
    shifts = torch.arange(8, device=mbits.device, dtype=torch.int32)
    return ((mbits.to(torch.int32).unsqueeze(-1) >> shifts) & 1).reshape(*mbits.shape[:-1], mbits.shape[-1] * 8)


def pack_mantissa_bits(bits: torch.Tensor) -> torch.Tensor:
    """int/bool [R, K] of 0/1 -> uint8 [R, K/8], LSB first."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.int32)
    b = bits.to(torch.int32).reshape(*bits.shape[:-1], bits.shape[-1] // 8, 8)
    return (b << shifts).sum(-1).to(torch.uint8)


def mantissa_bits_of_codes(codes_packed: torch.Tensor) -> torch.Tensor:
    """The compact payload of a quantized tensor: its codes' LSBs, uint8 [R, K/8]."""
    return pack_mantissa_bits(F.unpack_nibbles(codes_packed) & 1)


def _guided_magnitude(v: torch.Tensor, a: torch.Tensor, kind: str, payload_elems: torch.Tensor) -> torch.Tensor:
    lo, hi, lo_val, hi_val = F.e2m1_bracket(a)
    if kind == "compact":
        return torch.where((lo & 1) == payload_elems, lo, hi)
    # full: q = clamp(r, L, H) lands on hi iff the rollout value, seen on v's side of zero, reaches hi.
    r = F.e2m1_to_float(payload_elems)
    r_on_v_side = torch.where(torch.signbit(v), -r, r)
    return torch.where(r_on_v_side >= hi_val, hi, lo)


def _check_guidance(guidance: GuidanceRecord, rows: int, K: int) -> None:
    if not isinstance(guidance, GuidanceRecord):
        raise TypeError(f"guidance must be a GuidanceRecord, got {type(guidance).__name__}")
    check_uint8(guidance.scales, "guidance.scales", (rows, K // F.NVFP4_BLOCK))
    width = K // 8 if guidance.kind == "compact" else K // 2
    check_uint8(guidance.payload, f"guidance.payload ({guidance.kind})", (rows, width))
    if guidance.g.dtype != torch.float32:
        raise TypeError(f"guidance.g must be float32, got {guidance.g.dtype}")
    if tuple(guidance.g.shape) != (rows,):
        raise ValueError(f"guidance.g must have shape ({rows},), got {tuple(guidance.g.shape)}")
    devices = {guidance.payload.device, guidance.scales.device, guidance.g.device}
    if len(devices) != 1:
        raise RuntimeError(f"guidance tensors are on different devices: {devices}")


def check_no_g_when_guided(g, rounding: str) -> None:
    """Guided rounding takes the rollout's g from its record (SPEC 5): a g given beside it would be ignored."""
    if rounding == "guided" and g is not None:
        raise ValueError("g must be None with rounding='guided': the guidance record carries the rollout's g")


def nvfp4_quantize(
    x: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scope: str = "row",
    rounding: str = "rtn",
    seed: int = 0,
    offset: int = 0,
    guidance: GuidanceRecord | None = None,
) -> NVFP4Tensor:
    """NVFP4-quantize ``x`` [..., K] (SPEC 2). Returns linear-layout codes and scales and per-row g.

    g: decode scale(s) to use (per row, or one value); when None it is computed over ``scope``.
    rounding: "rtn", "sr" (with ``seed`` / ``offset``) or "guided" (with ``guidance``; the rollout's
    scales and g are used, never recomputed from x).
    """
    check_float_input(x, F.NVFP4_BLOCK)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    shape = tuple(x.shape)
    K = shape[-1]
    R = rows_of(shape)
    x2 = x.reshape(R, K).float()
    xb = _blocks(x2, F.NVFP4_BLOCK)
    finite_block = torch.isfinite(xb).all(-1)  # [R, Kb]

    if rounding == "guided":
        if guidance is None:
            raise ValueError("rounding='guided' needs a guidance record")
        check_no_g_when_guided(g, rounding)
        _check_guidance(guidance, R, K)
        if guidance.payload.device != x.device:
            raise RuntimeError(f"guidance is on {guidance.payload.device} but x is on {x.device}")
        scales = guidance.scales.clone()
        g_rows = guidance.g.clone()
        t = F.e4m3_to_float(scales) * g_rows[:, None]
        finite_block = finite_block & torch.isfinite(t)  # a rollout NaN block stays NaN
    else:
        if guidance is not None:
            raise ValueError(f"guidance was given but rounding={rounding!r}; use rounding='guided'")
        if g is None:
            g_rows = expand_g_to_rows(nvfp4_global_scale(x, scope), shape, scope).reshape(R)
        else:
            g_rows = check_g(g.to(x.device) if isinstance(g, torch.Tensor) else g, R).clone()  # never alias g
        safe = torch.where(finite_block[..., None], xb, torch.zeros_like(xb))
        amax_b = safe.abs().amax(-1) if R * K else safe.abs().sum(-1)
        d = fdiv(amax_b, F.E2M1_MAX)
        scales = F.e4m3_rn(d / g_rows[:, None])
        t = F.e4m3_to_float(scales) * g_rows[:, None]

    t_el = t.repeat_interleave(F.NVFP4_BLOCK, dim=1)
    safe_x = torch.where(finite_block.repeat_interleave(F.NVFP4_BLOCK, dim=1), x2, torch.zeros_like(x2))
    v = torch.where(t_el == 0, torch.zeros_like(safe_x), safe_x / torch.where(t_el == 0, torch.ones_like(t_el), t_el))
    a = v.abs().clamp(max=F.E2M1_MAX)

    if rounding == "rtn":
        mag = F.e2m1_rn_magnitude(v.abs())
    elif rounding == "sr":
        words = sr_random_words(R * K, seed, offset, x.device).reshape(R, K)
        mag = _sr_magnitude(a, words)
    else:
        if guidance.kind == "compact":
            payload = unpack_mantissa_bits(guidance.payload)
        else:
            payload = F.unpack_nibbles(guidance.payload).to(torch.int32)
        mag = _guided_magnitude(v, a, guidance.kind, payload)

    codes = mag | (torch.signbit(v).to(torch.int32) << 3)
    codes = torch.where(finite_block.repeat_interleave(F.NVFP4_BLOCK, dim=1), codes, torch.zeros_like(codes))
    scales = torch.where(finite_block, scales, torch.full_like(scales, F.E4M3_NAN))
    packed = F.pack_nibbles(codes.to(torch.uint8))
    lead = shape[:-1]
    return NVFP4Tensor(
        codes=packed.reshape(*lead, K // 2),
        scales=scales.reshape(*lead, K // F.NVFP4_BLOCK),
        g=g_rows.reshape(lead),
        shape=shape,
    )


def nvfp4_dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x^ = fl(fl(q * s_b) * g) per SPEC 2, then cast (RNE) to ``dtype``. NaN blocks decode to NaN."""
    if q.swizzled:
        raise ValueError("nvfp4_dequantize expects linear scales; convert with formats.from_swizzled first")
    K = q.shape[-1]
    R = rows_of(q.shape)
    codes = F.unpack_nibbles(q.codes.reshape(R, K // 2))
    vals = F.e2m1_to_float(codes)
    s = F.e4m3_to_float(q.scales.reshape(R, K // F.NVFP4_BLOCK)).repeat_interleave(F.NVFP4_BLOCK, dim=1)
    g = q.g.reshape(-1).expand(R)
    out = (vals * s) * g[:, None]
    return out.reshape(q.shape).to(dtype)


def nvfp4_fake_quantize(x: torch.Tensor, g=None, **kwargs) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype (no autograd; see trace_ext.autograd for the STE)."""
    return nvfp4_dequantize(nvfp4_quantize(x, g, **kwargs), x.dtype)


# ---- guidance records (SPEC 5, 6) --------------------------------------------------------------------------------


def guidance_from_quantized(q: NVFP4Tensor, kind: str = "compact") -> GuidanceRecord:
    """The record the rollout keeps of a quantized activation, rows flattened to [R, ...]."""
    if q.swizzled:
        raise ValueError("guidance records hold linear scales; quantize with swizzle=False")
    K = q.shape[-1]
    R = rows_of(q.shape)
    codes = q.codes.reshape(R, K // 2)
    payload = mantissa_bits_of_codes(codes) if kind == "compact" else codes.clone()
    return GuidanceRecord(
        kind=kind, payload=payload, scales=q.scales.reshape(R, K // F.NVFP4_BLOCK).clone(), g=q.g.reshape(-1).clone()
    )


def compact_record_bytes_per_row(K: int) -> int:
    """K/8 mantissa bytes + K/16 scale bytes + 4 bytes of g (SPEC 6)."""
    return K // 8 + K // F.NVFP4_BLOCK + 4


def encode_compact_record(rec: GuidanceRecord) -> torch.Tensor:
    """Serialize a compact record to uint8 [R, K/8 + K/16 + 4]: mantissa bits | scale bytes | g (little endian)."""
    if rec.kind != "compact":
        raise ValueError("encode_compact_record needs a compact record")
    g_bytes = rec.g.contiguous().view(torch.uint8).reshape(-1, 4)
    return torch.cat([rec.payload, rec.scales, g_bytes], dim=1)


def decode_compact_record(buf: torch.Tensor, K: int) -> GuidanceRecord:
    """Inverse of encode_compact_record."""
    if K % F.NVFP4_BLOCK:
        raise ValueError(f"K must be a multiple of {F.NVFP4_BLOCK}, got {K}")
    check_uint8(buf, "buf", (buf.shape[0], compact_record_bytes_per_row(K)))
    mb, sb = K // 8, K // F.NVFP4_BLOCK
    g = buf[:, mb + sb :].contiguous().view(torch.float32).reshape(-1)
    return GuidanceRecord("compact", buf[:, :mb].contiguous(), buf[:, mb : mb + sb].contiguous(), g)


# ---- MXFP4 (SPEC 3) -------------------------------------------------------------------------------------------------


def mxfp4_scale_exponent(amax: torch.Tensor, scale_rounding: str = "floor") -> torch.Tensor:
    """Block exponent e_b (int32): floor(log2 amax) - 2 (OCP), or the smallest e with 6 * 2^e >= amax ("ceil")."""
    if scale_rounding not in ("floor", "ceil"):
        raise ValueError(f"scale_rounding must be 'floor' or 'ceil', got {scale_rounding!r}")
    pos = amax > 0
    safe = torch.where(pos, amax, torch.ones_like(amax))
    e = (F.floor_log2(safe) - 2).clamp(-127, 127)
    if scale_rounding == "ceil":
        # 6 * 2^e is exact in float64; at most one step up from floor(log2 amax) - 2 is ever needed
        too_small = safe.double() > 6.0 * torch.ldexp(torch.ones_like(safe, dtype=torch.float64), e)
        e = (e + too_small.to(torch.int32)).clamp(-127, 127)
    return torch.where(pos, e, torch.full_like(e, -127))


def mxfp4_quantize(
    x: torch.Tensor, *, rounding: str = "rtn", seed: int = 0, offset: int = 0, scale_rounding: str = "floor"
) -> MXFP4Tensor:
    """MXFP4-quantize ``x`` [..., K] (SPEC 3): E8M0 scale per 32 elements, RTN or SR elements."""
    check_float_input(x, F.MXFP4_BLOCK)
    if rounding not in ("rtn", "sr"):
        raise ValueError(f"MXFP4 rounding must be 'rtn' or 'sr', got {rounding!r}")
    shape = tuple(x.shape)
    K = shape[-1]
    R = rows_of(shape)
    x2 = x.reshape(R, K).float()
    xb = _blocks(x2, F.MXFP4_BLOCK)
    finite_block = torch.isfinite(xb).all(-1)
    safe = torch.where(finite_block[..., None], xb, torch.zeros_like(xb))
    amax_b = safe.abs().amax(-1) if R * K else safe.abs().sum(-1)
    e = mxfp4_scale_exponent(amax_b, scale_rounding)
    v = (safe * F.exp2_exact(-e)[..., None]).reshape(R, K)
    if rounding == "rtn":
        mag = F.e2m1_rn_magnitude(v.abs())
    else:
        words = sr_random_words(R * K, seed, offset, x.device).reshape(R, K)
        mag = _sr_magnitude(v.abs().clamp(max=F.E2M1_MAX), words)
    codes = mag | (torch.signbit(v).to(torch.int32) << 3)
    fin_el = finite_block.repeat_interleave(F.MXFP4_BLOCK, dim=1)
    codes = torch.where(fin_el, codes, torch.zeros_like(codes)).to(torch.uint8)
    scales = torch.where(finite_block, (e + 127).to(torch.uint8), torch.full_like(e, F.E8M0_NAN).to(torch.uint8))
    lead = shape[:-1]
    return MXFP4Tensor(
        codes=F.pack_nibbles(codes).reshape(*lead, K // 2),
        scales=scales.reshape(*lead, K // F.MXFP4_BLOCK),
        shape=shape,
    )


def mxfp4_dequantize(q: MXFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x^ = q * 2^(b - 127), exact in float32; NaN blocks decode to NaN."""
    K = q.shape[-1]
    codes = F.unpack_nibbles(q.codes.reshape(rows_of(q.shape), K // 2))
    s = F.e8m0_to_float(q.scales.reshape(codes.shape[0], K // F.MXFP4_BLOCK)).repeat_interleave(F.MXFP4_BLOCK, dim=1)
    return (F.e2m1_to_float(codes) * s).reshape(q.shape).to(dtype)
