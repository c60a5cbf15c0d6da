"""The grid of the lean per-row quantize kernels (rowg_lean_plan): since H200 round 52 every CTA walks at most 4 row
groups (a grid of several waves of the block scheduler); TRACE_EXT_QUANT_LEAN_ITERS=n sets another limit, =0 none
(one persistent wave of CTAs, the grid before round 52). Since round 101 a capped grid is rounded up to whole waves of
CTA slots (TRACE_EXT_QUANT_LEAN_WHOLE_WAVES=0: not).

Protects: the outputs do not depend on the grid. Under every limit (1, 2, 3, the default 4, none) the lean3 kernel's
RTN quantize (linear, capture mbits, swizzled scales with their padding), its fake quantization (y, and with
emit_guidance the record) and SR through the per-row lean kernel give the same bits, and the default's equal the
reference's. Shapes are chosen so that the default grid is really several waves (more row groups than 4 x the
CTAs one wave holds) and the row groups do not divide evenly (some CTAs walk one group fewer; odd rows leave the
last group part empty), at teams of 32 (K 768: 8 rows per CTA), 128 (K 4096: 2 rows) and 256 threads (K 7168,
one row, lanes without a second block). The kernel names recorded by the profiler show that the lean kernels ran.
Run: pytest tests/gpu/test_quant_lean_grid_gpu.py -q   (on the H200, with the extension built; ~1 min)
"""
from __future__ import annotations

import pytest
import torch

from trace_ext import ops
from trace_ext import reference as ref

from test_quant_fake_lean3_gpu import assert_same_as_reference, assert_same_fake, fake_all
from test_quant_rowg_lean3_gpu import (DEV, assert_same_all, assert_same_q, launched, lean3_input, quantize_all,
                                      set_switch)

pytestmark = pytest.mark.gpu

ENV = "TRACE_EXT_QUANT_LEAN_ITERS"
WHOLE_WAVES = "TRACE_EXT_QUANT_LEAN_WHOLE_WAVES"
LIMITS = ("1", "2", "3", None, "0")  # None: the default (4)
LEAN3 = "nvfp4_quant_rowg_lean3_kernel"
SR_ROW = "nvfp4_quant_rowg_lean_kernel"
# (R, K): row groups past 4 x 4 CTAs x 132 SMs = 2112 at the default, not a multiple of 4, odd R
SHAPES = ((30001, 768), (9001, 4096), (2501, 7168))


def one_wave_groups(R: int, K: int) -> int:
    """Row groups of the shape (rows per CTA = 256 threads / team, team = the power of two >= kb / 2)."""
    kb = K // 16
    team = 1
    while team * 2 < kb:
        team *= 2
    return -(-R // (256 // team))


def _limit(monkeypatch, value):
    set_switch(monkeypatch, ENV, value)


def assert_same_under_every_limit(monkeypatch, run, want, assert_same, what):
    """run()'s outputs equal want (by assert_same) under every grid limit, with the capped grids rounded up to whole
    waves (the default since round 101: the CTAs launched last walk one group fewer) and without
    (TRACE_EXT_QUANT_LEAN_WHOLE_WAVES=0)."""
    for value in LIMITS:
        _limit(monkeypatch, value)
        assert_same(run(), want, f"{ENV}={value} {what}")
    for value in (None, "2"):
        _limit(monkeypatch, value)
        set_switch(monkeypatch, WHOLE_WAVES, "0")
        assert_same(run(), want, f"{WHOLE_WAVES}=0 {ENV}={value} {what}")
        set_switch(monkeypatch, WHOLE_WAVES, None)


@pytest.fixture(autouse=True)
def _default_impl(monkeypatch):
    monkeypatch.delenv("TRACE_EXT_QUANT_IMPL", raising=False)


def test_shapes_need_several_waves():
    """The test shapes have more row groups than the default's one wave of 4 CTAs per SM walking 4 groups each."""
    ctas = 4 * torch.cuda.get_device_properties(0).multi_processor_count
    for R, K in SHAPES:
        assert one_wave_groups(R, K) > 4 * ctas and one_wave_groups(R, K) % 4 != 0, (R, K)


@pytest.mark.parametrize("R,K", SHAPES)
def test_quantize_same_under_every_grid(monkeypatch, R, K):
    """RTN quantize through lean3: linear, capture and swizzled outputs equal under every limit and the reference's."""
    x = lean3_input(R, K, torch.bfloat16, 7 * R + K)
    _limit(monkeypatch, None)
    want = quantize_all(x)
    assert any(LEAN3 in n for n in launched(lambda: ops.nvfp4_quantize(x, backend="cuda")))
    assert_same_q(want[0], ops.nvfp4_quantize(x, backend="reference"), f"default {R}x{K} vs reference")
    assert torch.equal(want[2], ref.guidance_from_quantized(want[0], "compact").payload), f"{R}x{K} mbits"
    assert_same_q(want[3], ops.nvfp4_quantize(x, swizzle=True, backend="reference"), f"{R}x{K} swizzled vs reference")
    assert_same_under_every_limit(monkeypatch, lambda: quantize_all(x), want, assert_same_all, f"{R}x{K}")


@pytest.mark.parametrize("R,K", SHAPES)
def test_fake_quantize_same_under_every_grid(monkeypatch, R, K):
    """RTN fake quantization through lean3, with and without emit_guidance."""
    x = lean3_input(R, K, torch.float16, 3 * R + K)
    _limit(monkeypatch, None)
    want = fake_all(x)
    assert any(LEAN3 in n for n in launched(lambda: ops.nvfp4_fake_quantize(x, backend="cuda")))
    assert_same_as_reference(want[0], ops.nvfp4_fake_quantize(x, backend="reference"), f"fake {R}x{K}")
    assert_same_under_every_limit(monkeypatch, lambda: fake_all(x), want, assert_same_fake, f"fake {R}x{K}")


def test_sr_same_under_every_grid(monkeypatch):
    """SR quantize with g None through the per-row lean kernel (3 CTAs per SM), linear and swizzled."""
    R, K = 9001, 4096
    x = lean3_input(R, K, torch.bfloat16, 41)

    def sr(swizzle=False):
        return ops.nvfp4_quantize(x, rounding="sr", seed=1234, offset=77, swizzle=swizzle, backend="cuda")

    _limit(monkeypatch, None)
    want, want_swz = sr(), sr(True)
    assert any(SR_ROW in n for n in launched(sr))
    want_ref = ops.nvfp4_quantize(x, rounding="sr", seed=1234, offset=77, backend="reference")
    assert_same_q(want, want_ref, "sr vs reference")
    assert_same_under_every_limit(monkeypatch, sr, want, assert_same_q, "sr")
    assert_same_under_every_limit(monkeypatch, lambda: sr(True), want_swz, assert_same_q, "sr swizzled")
