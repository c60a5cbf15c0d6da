"""The lean3 per-row kernel (RTN quantize and fake quantization with g None) waiting for its team's cross-warp amax on
a named barrier of the team's warps instead of the CTA's __syncthreads: the default for fake quantization since H200
round 60; TRACE_EXT_QUANT_TEAM_BAR=1 for quantize too, =0 never.

Protects: every output (codes, scales, g, capture mbits, swizzled scales with padding; fake-quantized y and its
emitted record) is the same under =0, the default and =1, bit for bit, on the lean3 team shapes (teams of 2 .. 256
threads: 1, 2 and 4 teams per CTA on a barrier, odd row counts over several waves, adversarial rows), and equals the
reference's.
Run: pytest tests/gpu/test_quant_team_bar_gpu.py -q   (on the H200, with the extension built; ~30 s)
"""
from __future__ import annotations

import pytest
import torch

from trace_ext import ops

from test_quant_fake_lean3_gpu import assert_same_fake, fake_all
from test_quant_rowg_lean3_gpu import (assert_same_all, assert_same_q, launched, lean3_input, quantize_all,
                                      set_switch)

pytestmark = pytest.mark.gpu

ENV = "TRACE_EXT_QUANT_TEAM_BAR"
KERNEL = "nvfp4_quant_rowg_lean3_kernel"
SHAPES = ((4099, 64), (1031, 1024), (4097, 2048), (9001, 4096), (1001, 4112), (1201, 7168), (7, 8192))


@pytest.fixture(autouse=True)
def _default_impl(monkeypatch):
    monkeypatch.delenv("TRACE_EXT_QUANT_IMPL", raising=False)
    monkeypatch.delenv(ENV, raising=False)


@pytest.mark.parametrize("R,K", SHAPES)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_team_bar_same_bits(monkeypatch, R, K, dtype):
    x = lean3_input(R, K, dtype, 19 * R + K)
    monkeypatch.setenv(ENV, "0")
    want_q, want_f = quantize_all(x), fake_all(x)
    assert_same_q(want_q[0], ops.nvfp4_quantize(x, backend="reference"), f"{ENV}=0 {R}x{K} {dtype} vs reference")
    for setting in (None, "1"):
        set_switch(monkeypatch, ENV, setting)
        assert any(KERNEL in n for n in launched(lambda: ops.nvfp4_fake_quantize(x, backend="cuda")))
        assert_same_all(quantize_all(x), want_q, f"{ENV}={setting} {R}x{K} {dtype}")
        assert_same_fake(fake_all(x), want_f, f"{ENV}={setting} fake {R}x{K} {dtype}")
