"""Programmatic dependent launch of the per-row lean3 quantize kernels (TRACE_EXT_QUANT_PDL=1, read per call; an A/B
knob): the kernel is launched as a programmatic dependent of the work before it in the stream and waits with
griddepcontrol.wait at entry before it reads x.

Protects: with PDL every output of the lean3 kernels (linear, capture codes and mbits, swizzled with its padding,
g given per row, fake quantization with and without emitted guidance) equals the plain launch's bit for bit, over
back-to-back calls whose input a copy kernel rewrote just before each call (a kernel that read x before that copy had
finished would quantize the previous call's rows), on shapes of one and of several waves of CTAs.
Run: pytest tests/gpu/test_quant_pdl_gpu.py -q   (on the H200, with the extension built; ~10 s)
"""
from __future__ import annotations

import pytest
import torch

from trace_ext import ops

from test_quant_given_lean3_gpu import given_g
from test_quant_rowg_lean3_gpu import assert_same_q, lean3_input, quantize_all

pytestmark = pytest.mark.gpu

ENV = "TRACE_EXT_QUANT_PDL"


def outputs_of_calls(x, sources, g):
    """Every lean3 output, for 4 calls that each first copy a source into x."""
    outs = []
    for i in range(4):
        x.copy_(sources[i % 2])
        lin, cap, mbits, swz = quantize_all(x)
        given = ops.nvfp4_quantize(x, g, backend="cuda")
        fake = ops.nvfp4_fake_quantize(x, backend="cuda")
        fake_emit, rec = ops.nvfp4_fake_quantize(x, capture=True, backend="cuda")
        outs.append((lin, cap, mbits, swz, given, fake, fake_emit, rec.payload))
    return outs


@pytest.mark.parametrize("R,K", ((4099, 4096), (300, 7168), (129, 2048), (65536, 1024)))
def test_pdl_same_bits(monkeypatch, R, K):
    monkeypatch.delenv("TRACE_EXT_QUANT_IMPL", raising=False)
    monkeypatch.setenv("TRACE_EXT_QUANT_GIVEN_LEAN3", "1")  # g given through the lean3 kernel at every K
    sources = [lean3_input(R, K, torch.bfloat16, 3 * R + K + s) for s in (0, 1)]
    x = torch.empty_like(sources[0])
    g = given_g(sources[0], R)
    monkeypatch.setenv(ENV, "0")
    want = outputs_of_calls(x, sources, g)
    monkeypatch.setenv(ENV, "1")
    got = outputs_of_calls(x, sources, g)
    monkeypatch.delenv(ENV)
    for i, (a, b) in enumerate(zip(got, want)):
        what = f"{R}x{K} call {i}"
        for name, qa, qb in (("linear", a[0], b[0]), ("capture", a[1], b[1]), ("swizzled", a[3], b[3]),
                             ("g given", a[4], b[4])):
            assert_same_q(qa, qb, f"{what} {name}")
        for name, ta, tb in (("mbits", a[2], b[2]), ("fake", a[5], b[5]), ("fake emit", a[6], b[6]),
                             ("fake mbits", a[7], b[7])):
            assert torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)), f"{what} {name}"
    assert not torch.equal(want[0][0].codes, want[1][0].codes), "the two sources must quantize differently"
