"""Element and scale formats of SPEC sections 1 and 6, in plain torch.

E2M1 (the FP4 element), E4M3 (the NVFP4 block scale), E8M0 (the MX block scale), nibble packing and the
swizzled 128x4 scale layout. Everything here is exact integer or single-operation float32 arithmetic, so
it computes the same bits on any device; the CUDA header ``csrc/include/trace_ext/fp4_numerics.cuh`` is
its twin.
"""
from __future__ import annotations

import math

import torch

from ._args import is_int

E2M1_MAX = 6.0  # largest E2M1 magnitude
E4M3_MAX = 448.0  # largest finite E4M3 (OCP E4M3FN)
E4M3_MIN_SUBNORMAL = 2.0**-9  # smallest positive E4M3
NVFP4_GLOBAL_DIV = 2688.0  # 6 * 448: the scope amax maps onto the top of both grids
NVFP4_BLOCK = 16  # elements per E4M3 block scale
MXFP4_BLOCK = 32  # elements per E8M0 block scale
E4M3_NAN = 0x7F  # scale byte of a non-finite NVFP4 block
E8M0_NAN = 0xFF  # scale byte of a non-finite MXFP4 block

# Magnitude of each 3-bit E2M1 code; adjacent values differ in the code's LSB (the mantissa bit).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Signed value of each 4-bit code (code = sign << 3 | magnitude code).
E2M1_VALUES = E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES)

# RTN thresholds of SPEC 1 as (bound, inclusive): a magnitude code is the number of bounds ``a`` passes.
_RN_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _lut(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def e2m1_rn_magnitude(a: torch.Tensor) -> torch.Tensor:
    """Round |v| to nearest (ties to the even code, saturating at 6); returns int32 magnitude codes."""
    mag = torch.zeros(a.shape, dtype=torch.int32, device=a.device)
    for bound, inclusive in _RN_BOUNDS:
        mag += (a >= bound if inclusive else a > bound).to(torch.int32)
    return mag


def e2m1_rn(v: torch.Tensor) -> torch.Tensor:
    """E2M1 round-to-nearest of float32 ``v``: 4-bit codes (uint8), sign = signbit(v)."""
    return (e2m1_rn_magnitude(v.abs()) | (torch.signbit(v).to(torch.int32) << 3)).to(torch.uint8)


def e2m1_floor_magnitude(a: torch.Tensor) -> torch.Tensor:
    """Largest magnitude code whose value is <= a, for a in [0, 6]."""
    mag = torch.zeros(a.shape, dtype=torch.int32, device=a.device)
    for m in E2M1_MAGNITUDES[1:]:
        mag += (a >= m).to(torch.int32)
    return mag


def e2m1_bracket(a: torch.Tensor):
    """Adjacent grid magnitudes lo <= a <= hi (lo == hi on the grid): (lo_code, hi_code, lo_val, hi_val)."""
    mags = _lut(E2M1_MAGNITUDES, a.device)
    lo = e2m1_floor_magnitude(a)
    lo_val = mags[lo.long()]
    hi = lo + (a > lo_val).to(torch.int32)
    return lo, hi, lo_val, mags[hi.long()]


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Value of each 4-bit code (uint8 tensor holding one code per element)."""
    return _lut(E2M1_VALUES, codes.device)[codes.long() & 0xF]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dim: element 2i in the LOW nibble, 2i+1 in the HIGH nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: last dim must be even, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles: uint8 [..., K/2] -> one code per uint8 [..., K]."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ---- E4M3 ------------------------------------------------------------------------------------------------


def e4m3_rn(x: torch.Tensor) -> torch.Tensor:
    """OCP E4M3FN round-to-nearest-even with saturation of finite values to 448; uint8 bit patterns.

    Written with integer arithmetic on purpose (not torch's cast), so the tests can hold it against
    torch.float8_e4m3fn. Input: non-negative float32 (block scales); NaN maps to 0x7F.
    """
    x = x.float()
    nan = torch.isnan(x)
    x = torch.where(nan, torch.zeros_like(x), x).clamp(max=E4M3_MAX)
    mant, exp = torch.frexp(x)  # x = mant * 2^exp, mant in [0.5, 1)
    e = exp - 1  # floor(log2 x) for x > 0
    # Subnormal range (x < 2^-6): the byte is round_half_even(x / 2^-9); a result of 8 is 2^-6, byte 0x08.
    sub = torch.round(x * 2.0**9)
    # Normal range: byte = (e + 7) << 3 | round_half_even((x / 2^e - 1) * 8); a mantissa carry bumps e.
    frac = torch.round((torch.ldexp(x, -e) - 1.0) * 8.0)
    normal = (e + 7).to(torch.float32) * 8.0 + frac
    byte = torch.where(x < 2.0**-6, sub, normal).clamp(max=0x7E)
    byte = torch.where(nan, torch.full_like(byte, E4M3_NAN), byte)
    return byte.to(torch.uint8)


def e4m3_to_float(b: torch.Tensor) -> torch.Tensor:
    """Decode E4M3 bit patterns (uint8) to float32 (0x7F / 0xFF -> NaN)."""
    return b.contiguous().view(torch.float8_e4m3fn).float()


# ---- E8M0 ------------------------------------------------------------------------------------------------


def e8m0_to_float(b: torch.Tensor) -> torch.Tensor:
    """Byte b -> 2^(b - 127); 0xFF -> NaN. 2^-127 is an fp32 subnormal, still exact."""
    val = torch.ldexp(torch.ones(b.shape, dtype=torch.float32, device=b.device), b.to(torch.int32) - 127)
    return torch.where(b == E8M0_NAN, torch.full_like(val, float("nan")), val)


def exp2_exact(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for integer e in [-127, 127] (exact)."""
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device), e.to(torch.int32))


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2 a) from the float's bits for a > 0 finite (subnormals report at most -127)."""
    return torch.frexp(a)[1] - 1


# ---- swizzled 128x4 scale layout (SPEC 6) ----------------------------------------------------------------


def _ceil_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def swizzled_shape(rows: int, scale_cols: int) -> tuple[int, int]:
    """Padded (rows, scale columns) of the 128x4 layout: rows to 128, scale columns to 4."""
    return _ceil_to(rows, 128), _ceil_to(scale_cols, 4)


def swizzle_offsets(rows: int, scale_cols: int, device=None) -> torch.Tensor:
    """Byte offset of every linear scale (m, k), shape [rows, scale_cols], in the swizzled buffer."""
    _, kb_pad = swizzled_shape(rows, scale_cols)
    m = torch.arange(rows, device=device).view(-1, 1)
    k = torch.arange(scale_cols, device=device).view(1, -1)
    return (m // 128) * (kb_pad // 4) * 512 + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + (k % 4)


def to_swizzled(scales: torch.Tensor) -> torch.Tensor:
    """Linear scales [..., rows, Kb] -> swizzled [..., rows_pad, Kb_pad] (same bytes, 128x4 order, zero fill)."""
    if scales.dim() < 2:
        raise ValueError(f"to_swizzled: scales must be [..., rows, Kb], got shape {tuple(scales.shape)}")
    *lead, rows, cols = scales.shape
    r_pad, c_pad = swizzled_shape(rows, cols)
    flat = scales.reshape(math.prod(lead), rows * cols)  # (not -1: rows * cols may be 0)
    out = torch.zeros(flat.shape[0], r_pad * c_pad, dtype=scales.dtype, device=scales.device)
    out[:, swizzle_offsets(rows, cols, scales.device).reshape(-1)] = flat
    return out.reshape(*lead, r_pad, c_pad)


def from_swizzled(swizzled: torch.Tensor, rows: int, scale_cols: int) -> torch.Tensor:
    """Inverse of to_swizzled: swizzled [..., rows_pad, Kb_pad] -> linear [..., rows, scale_cols]."""
    for name, v in (("rows", rows), ("scale_cols", scale_cols)):
        if not is_int(v):
            raise TypeError(f"from_swizzled: {name} must be an int, got {type(v).__name__} {v!r}")
        if v < 0:
            raise ValueError(f"from_swizzled: {name} must be >= 0, got {v}")
    if swizzled.dim() < 2:
        raise ValueError(f"from_swizzled: swizzled must be [..., rows_pad, Kb_pad], got shape {tuple(swizzled.shape)}")
    *lead, r_pad, c_pad = swizzled.shape
    if (r_pad, c_pad) != swizzled_shape(rows, scale_cols):
        raise ValueError(
            f"from_swizzled: expected padded shape {swizzled_shape(rows, scale_cols)} for {rows}x{scale_cols}, "
            f"got {(r_pad, c_pad)}"
        )
    flat = swizzled.reshape(math.prod(lead), r_pad * c_pad)
    out = flat[:, swizzle_offsets(rows, scale_cols, swizzled.device).reshape(-1)]
    return out.reshape(*lead, rows, scale_cols)
