"""The quantizers' block amax on raw 16-bit words (max.NaN.xorsign.abs: two magnitudes per instruction) and the RTN
fast path without the clamp (where every quotient of the block stays below 7), against the reference.

Protects: NVFP4 quantize (per-row g fused: linear, capture, swizzled; g given per row and one g; fake quantization)
and MXFP4 quantize (floor and ceil scales) of bf16 / fp16 x equal the reference bit for bit on
- every 16-bit pattern: x drawn uniformly from all 65536 bit patterns (NaN payloads of both signs, +-Inf, -0,
  subnormals, the largest finite values), so most rows hold a NaN or Inf and the blocks that do not have amax anywhere
  in the dtype's range;
- subnormal-only blocks (exponent field 0 with random mantissas and signs, next to ordinary blocks): the amax of a
  block is a subnormal, which a flush to zero would lose;
- quotients around the clamp: g given so that the block scale byte saturates at 448 while the block's largest quotient
  amax / t is 5.9 .. 6.49 (no clamp), 6.5 .. 7 and far above (the clamp path), and subnormal scale bytes (quotients up
  to ~9).
The lean kernels run at K 4096 (lean3: per-row and given) and K 768 (the flat lean kernel for g given).
Run: pytest tests/gpu/test_quant_raw_bits_gpu.py -q   (on the H200, with the extension built; ~20 s)
"""
from __future__ import annotations

import pytest
import torch

from trace_ext import ops
from test_quant_gpu import assert_same  # bit equality, NaN where the other has NaN
from test_quant_rowg_lean3_gpu import assert_same_q, quantize_all

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPES = (torch.bfloat16, torch.float16)
SHAPES = ((257, 4096), (131, 768), (64, 2048))


def all_patterns(R: int, K: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """x of uniformly random 16-bit patterns (every NaN, Inf, subnormal and finite pattern of the dtype)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, (R, K), generator=gen, device=DEV, dtype=torch.int32).to(torch.int16)
    return bits.view(dtype)


def subnormal_blocks(R: int, K: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Ordinary rows (randn) whose blocks alternate with blocks of subnormals only (exponent field 0), some rows all
    subnormal."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(R, K, generator=gen, device=DEV).to(dtype)
    mant_bits = 7 if dtype == torch.bfloat16 else 10
    mant = torch.randint(0, 2**mant_bits, (R, K), generator=gen, device=DEV, dtype=torch.int32)
    sign = torch.randint(0, 2, (R, K), generator=gen, device=DEV, dtype=torch.int32) << 15
    sub = ((mant | sign) - ((sign >> 15) << 16)).to(torch.int16).view(dtype)  # sign bit set: a negative int16
    blk = (torch.arange(K, device=DEV) // 16) % 2 == 1
    x[:, blk] = sub[:, blk]
    x[::5] = sub[::5]  # rows of subnormals only: g itself comes from a subnormal amax
    return x


def clamp_edge_rows(K: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, g): rows whose blocks lead with |x| = 6 * 448 * f * g for f from 0.98 to 1.25 and 1e3 (scale byte 448, the
    block's largest quotient 6 f), then rows whose blocks lead with 6 * 448 * 2^-k * g, k = 15 .. 21 (subnormal scale
    bytes and 0, quotients up to ~9); the rest of each block random below its lead."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    f = torch.tensor([0.98, 1.0, 1.03, 1.07, 1.08, 1.0816, 1.0834, 1.1, 1.16, 1.1666, 1.17, 1.25, 1e3], device=DEV)
    R1 = f.numel()
    kb = K // 16
    hi = 4 if dtype == torch.bfloat16 else -8  # fp16: the 1e3 rows stay below 65504, the others above its subnormals
    g = torch.cat([torch.exp2(torch.randint(-20, hi, (R1,), generator=gen, device=DEV).float()),
                   torch.exp2(torch.randint(0, 4, (8,), generator=gen, device=DEV).float())])
    x = torch.rand(R1 + 8, kb, 16, generator=gen, device=DEV) * 2 - 1
    lead = torch.ones(R1 + 8, kb, device=DEV)
    lead[:R1] = 6 * 448 * f[:, None]
    lead[R1:] = 6 * 448 * torch.exp2(-torch.randint(15, 22, (8, kb), generator=gen, device=DEV).float())
    x = x * lead[..., None]
    x[..., 0] = lead * torch.where(torch.rand(R1 + 8, kb, generator=gen, device=DEV) < 0.5, -1.0, 1.0)
    x = x * g[:, None, None]
    return x.reshape(R1 + 8, K).to(dtype), g


def check_nvfp4(x: torch.Tensor, g_rows: torch.Tensor | None, what: str) -> None:
    R = x.shape[0]
    # per-row g fused: linear, capture, swizzled (and the capture's mbits) against the reference
    want_lin = ops.nvfp4_quantize(x, backend="reference")
    want_swz = ops.nvfp4_quantize(x, swizzle=True, backend="reference")
    lin, cap, _, swz = quantize_all(x)
    assert_same_q(lin, want_lin, f"{what} per-row linear")
    assert_same_q(cap, want_lin, f"{what} per-row capture")
    assert_same_q(swz, want_swz, f"{what} per-row swizzled")
    # g given: per row and one g for all rows
    g_row = want_lin.g if g_rows is None else g_rows
    for g in (g_row, g_row[:1].clone()):
        got = ops.nvfp4_quantize(x, g=g, backend="cuda")
        assert_same_q(got, ops.nvfp4_quantize(x, g=g, backend="reference"), f"{what} g given ({g.numel()} values)")
    # fake quantization (per-row g)
    assert_same(ops.nvfp4_fake_quantize(x, backend="cuda"), ops.nvfp4_fake_quantize(x, backend="reference"),
                f"{what} fake quantization")
    assert R == lin.codes.shape[0]


def check_mxfp4(x: torch.Tensor, what: str) -> None:
    for rounding in ("floor", "ceil"):
        got = ops.mxfp4_quantize(x, scale_rounding=rounding, backend="cuda")
        want = ops.mxfp4_quantize(x, scale_rounding=rounding, backend="reference")
        assert torch.equal(got.codes, want.codes), f"{what} mxfp4 {rounding} codes"
        assert torch.equal(got.scales, want.scales), f"{what} mxfp4 {rounding} scales"


# the inputs of test_against_reference: generator and seed multiplier
INPUTS = {"all patterns": (all_patterns, 7), "subnormal blocks": (subnormal_blocks, 3)}


@pytest.mark.parametrize("kind", tuple(INPUTS))
@pytest.mark.parametrize("R,K", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_against_reference(kind, R, K, dtype):
    make, m = INPUTS[kind]
    x = make(R, K, dtype, m * R + K)
    check_nvfp4(x, None, f"{kind} {R}x{K} {dtype}")
    check_mxfp4(x, f"{kind} {R}x{K} {dtype}")


@pytest.mark.parametrize("K", (4096, 768))
@pytest.mark.parametrize("dtype", DTYPES)
def test_quotients_around_the_clamp(K, dtype):
    x, g = clamp_edge_rows(K, dtype, K)
    got = ops.nvfp4_quantize(x, g=g, backend="cuda")
    want = ops.nvfp4_quantize(x, g=g, backend="reference")
    assert_same_q(got, want, f"clamp edges K {K} {dtype}")
    assert int((want.scales == 0x7E).sum()) > 0 and int((want.scales < 8).sum()) > 0  # both edges are exercised
    check_nvfp4(x, g, f"clamp edges K {K} {dtype}")
