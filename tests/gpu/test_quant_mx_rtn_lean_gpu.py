"""MXFP4 RTN with the NVFP4 lean kernels' element code (the grid value by one power-of-two magic add, signs by byte
permutes, saturation when packing). 16-bit x runs with two lanes per block and a 32-bit two-buffer walk with clamped
next-tile loads (mxfp4_quant_half32_kernel); TRACE_EXT_MX_HALF=0 runs one lane per block (mxfp4_quant_kernel, the
kernel of fp32 x and of 16-bit x past the half kernel's 32-bit indices).

Protects: codes and E8M0 scales of both kernels equal the reference's bit for bit, floor and ceil scales, bf16 / fp16 /
fp32, on every float within 64 ulps of each grid point, tie and binade edge of [0, 8) in blocks whose scale is 2^0 (led
by +-6 or by +-7.99: quotients up to 8 saturate), the same blocks moved through the binades (quotients that underflow in
the exact multiply), random activations, the quantizer tests' adversarial rows (zero / -0 / NaN / +-Inf blocks, huge
and tiny values), partial tiles, warps walking one, two and three tiles (odd counts end the two-tile loop early) and
2^26 elements; each kernel runs exactly where the switch and the dtype say.
Run: pytest tests/gpu/test_quant_mx_rtn_lean_gpu.py -q   (on the H200, with the extension built; ~20 s)
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from trace_ext import ops

from test_quant_gpu import BIG, adversarial_x, assert_same, random_x
from test_quant_impl_gpu import dense_magnitudes
from test_quant_rowg_lean3_gpu import launched, set_switch

pytestmark = pytest.mark.gpu

DEV = "cuda"
HALF = "TRACE_EXT_MX_HALF"
# TRACE_EXT_MX_HALF: the default, one lane per block, the half-block kernel named
SETTINGS = (None, "0", "1")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
EXP_RANGE = {torch.bfloat16: (-130, 120), torch.float16: (-14, 12), torch.float32: (-140, 120)}


def mx_blocks_dense(lead: float, seed: int) -> torch.Tensor:
    """Rows of 32-element MX blocks: element 0 = +-lead (scale 2^0 for lead in [4, 8)), the others +-every float within
    64 ulps of each grid point, tie and binade edge below 8."""
    rng = np.random.default_rng(seed)
    mags = dense_magnitudes(64, top=7.99, extra=(6.5, 7.0, 7.5, 7.99))
    mags = mags[rng.permutation(mags.size)]
    mags = np.concatenate([mags, np.zeros((-mags.size) % 31, dtype=np.float32)]).reshape(-1, 31)
    b = np.concatenate([np.full((mags.shape[0], 1), lead, dtype=np.float32), mags], axis=1)
    b = np.where(rng.integers(0, 2, b.shape) > 0, -b, b).astype(np.float32)
    b = np.concatenate([b, np.zeros(((-b.shape[0]) % 32, 32), dtype=np.float32)])  # 32 blocks per row
    return torch.from_numpy(b.reshape(-1, 1024)).to(DEV)


def check(monkeypatch, x, scale_rounding, what):
    """Every setting == the reference (codes, scales)."""
    want = ops.mxfp4_quantize(x, scale_rounding=scale_rounding, backend="reference")
    for half in SETTINGS:
        set_switch(monkeypatch, HALF, half)
        got = ops.mxfp4_quantize(x, scale_rounding=scale_rounding, backend="cuda")
        tag = f"{what}: {HALF}={half}"
        assert_same(got.codes, want.codes, f"{tag} codes vs reference")
        assert_same(got.scales, want.scales, f"{tag} scales vs reference")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_rounding", ("floor", "ceil"))
@pytest.mark.parametrize("lead", (6.0, 7.99, 4.0))
def test_dense_values(monkeypatch, dtype, scale_rounding, lead):
    x = mx_blocks_dense(lead, 3).to(dtype)
    check(monkeypatch, x, scale_rounding, f"dense lead {lead} {dtype} {scale_rounding}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_values_through_the_binades(monkeypatch, dtype):
    """The dense blocks times 2^k per row, k over the dtype's range (products that underflow included)."""
    x = mx_blocks_dense(6.0, 5)
    lo, hi = EXP_RANGE[dtype]
    gen = torch.Generator(device=DEV).manual_seed(7)
    k = torch.randint(lo, hi, (x.shape[0], 1), generator=gen, device=DEV).float()
    check(monkeypatch, (x.double() * torch.exp2(k.double())).to(dtype), "floor", f"binades {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_rounding", ("floor", "ceil"))
def test_random_and_adversarial(monkeypatch, dtype, scale_rounding):
    for i, x in enumerate((random_x((33, 2048), dtype), adversarial_x(dtype), random_x((1, 7168), dtype, seed=4))):
        check(monkeypatch, x, scale_rounding, f"input {i} {dtype} {scale_rounding}")


def test_large(monkeypatch):
    check(monkeypatch, random_x(BIG, torch.bfloat16, seed=3), "floor", "2^26 bf16")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,K", ((1, 32), (3, 160), (7, 4096), (5, 7168), (1000, 544), (1100, 4096), (3125, 4096)))
def test_half_kernel_shapes(monkeypatch, dtype, R, K):
    """Partial tiles (1, 15, 112, 1120 and 17000 blocks: tiles of 16 blocks, grids of one to many waves; 140800 and
    400000 blocks: warps walking one to three tiles), the half-block kernel runs exactly for 16-bit x with the switch
    not off, the one-lane kernel otherwise."""
    x = random_x((R, K), dtype, seed=R + K)
    x[0, :32] = 0.0  # a zero block
    if R > 1:
        x[1, 32:64] = float("nan")  # a NaN block next to a finite one
    check(monkeypatch, x, "floor", f"half-block shapes {R}x{K} {dtype}")
    for half in SETTINGS:
        set_switch(monkeypatch, HALF, half)
        names = launched(lambda: ops.mxfp4_quantize(x, backend="cuda"))
        halves = half != "0" and dtype != torch.float32
        runs_half = any("mxfp4_quant_half32_kernel" in n for n in names)
        runs_lane = any("mxfp4_quant_kernel" in n for n in names)
        assert (runs_half, runs_lane) == (halves, not halves), (half, names)
