"""RTN fake quantization of 16-bit x with g None (the trainer's QAT forward, with or without emit_guidance) through
nvfp4_quant_rowg_lean3_kernel's FAKE instantiation (the rollout quantizer's walk: persistent CTAs, two row steps per
loop, next row in flight) instead of the one-row-group-per-CTA nvfp4_quant_rowg_kernel: the default (where the row's
block count kb is not a power of two since H200 rounds 48-49, for every kb since round 54), also named
TRACE_EXT_QUANT_IMPL=fake-lean3; =sr-row never (the previous kernel).

Protects: y (every bit, NaN included) and, with emit_guidance, the compact record (mbits, scale bytes, g) equal the
previous kernel's and the reference's, on the team shapes, row counts and adversarial rows of the lean3 quantize tests
(lean3_input: zero rows, NaN / +-Inf, rows with no finite value, g at the edges of the reciprocal's range, ties,
subnormal x and scale bytes), g from 2^-133 to 2^116; the kernel runs exactly where it should (16-bit x,
2 <= K / 16 <= 512), and SR / guided / g-given fake quantization and plain
quantization keep their kernels.
Run: pytest tests/gpu/test_quant_fake_lean3_gpu.py -q   (on the H200, with the extension built; ~1 min)
"""
from __future__ import annotations

import pytest
import torch

from trace_ext import ops
from trace_ext import reference as ref

from test_quant_gpu import assert_same as assert_same_as_reference  # bit equality, NaN where the other has NaN
from test_quant_rowg_lean3_gpu import (DEV, SHAPES, _set_impl, launched, lean3_input, lean3_takes,
                                      scale_edge_input)

pytestmark = pytest.mark.gpu

VARIANT = "fake-lean3"
PREVIOUS = "sr-row"  # the previous default: fake quantization through nvfp4_quant_rowg_kernel
KERNEL = "nvfp4_quant_rowg_lean3_kernel"


def fake_all(x: torch.Tensor):
    """y without and with emit_guidance, and the emitted record's mbits, scales and g."""
    y = ops.nvfp4_fake_quantize(x, backend="cuda")
    y2, rec = ops.nvfp4_fake_quantize(x, capture=True, backend="cuda")
    return y, y2, rec.payload, rec.scales, rec.g


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def assert_same_fake(got, want, what):
    names = ("y", "y (emit)", "mbits", "scales", "g")
    for name, a, b in zip(names, got, want):
        a, b = (bits(a), bits(b)) if a.is_floating_point() else (a, b)
        assert torch.equal(a, b), f"{what}: {name} differs in {int((a != b).sum())} places"


@pytest.mark.parametrize("R,K", SHAPES)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_fake_lean3_matches_previous(monkeypatch, R, K, dtype):
    """=fake-lean3 and the default give the previous default's (=sr-row) y and emitted record bit for bit, and run the
    lean3 kernel exactly where they should (never for fp32 x, K = 16 or K > 8192)."""
    x = lean3_input(R, K, dtype, 13 * R + K)
    _set_impl(monkeypatch, PREVIOUS)
    want = fake_all(x)
    assert not any(KERNEL in n for n in launched(lambda: ops.nvfp4_fake_quantize(x, backend="cuda")))
    for variant in (VARIANT, None):
        _set_impl(monkeypatch, variant)
        assert_same_fake(fake_all(x), want, f"{variant} {R}x{K} {dtype}")
        for capture in (False, True):
            names = launched(lambda: ops.nvfp4_fake_quantize(x, capture=capture, backend="cuda"))
            assert any(KERNEL in n for n in names) == lean3_takes(K, dtype), (R, K, dtype, capture, variant, names)


@pytest.mark.parametrize("R,K", ((257, 64), (129, 1024), (77, 2048), (130, 4096), (61, 4112), (45, 7168), (9, 8192),
                                 (99, 768), (50, 5120)))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("variant", (VARIANT, None))
def test_fake_lean3_against_reference(monkeypatch, R, K, dtype, variant):
    """y equals the reference's dequantize(quantize(x)) (SPEC 2; NaN where the reference has NaN) and the emitted
    record the reference's compact record, forced (=fake-lean3) and by default."""
    x = lean3_input(R, K, dtype, 7 * R + 5 * K)
    qr = ref.nvfp4_quantize(x)
    y_ref = ref.nvfp4_dequantize(qr, dtype)
    rec_ref = ref.guidance_from_quantized(qr, "compact")
    _set_impl(monkeypatch, variant)
    y, y2, mbits, scales, g = fake_all(x)
    what = f"{variant} {R}x{K} {dtype}"
    for name, got in (("y", y), ("y (emit)", y2)):
        assert_same_as_reference(got, y_ref, f"{what}: {name}")
    assert torch.equal(mbits, rec_ref.payload), f"{what}: mbits"
    assert torch.equal(scales, rec_ref.scales), f"{what}: scales"
    assert torch.equal(bits(g), bits(rec_ref.g)), f"{what}: g"


def test_fake_lean3_scale_edges(monkeypatch):
    """Rows whose g sweeps 2^-133 .. 2^116 by quarter binades with blocks up to 2^-24 below their row (1/g and 1/t
    outside their fast ranges, t = 0) and rows of exact ties: the variant equals the previous default and the
    reference."""
    x = scale_edge_input(2048, -133.0, 5, torch.bfloat16)
    _set_impl(monkeypatch, PREVIOUS)
    want = fake_all(x)
    _set_impl(monkeypatch, VARIANT)
    got = fake_all(x)
    assert_same_fake(got, want, f"{VARIANT} scale edges")
    assert_same_as_reference(got[0], ref.nvfp4_dequantize(ref.nvfp4_quantize(x), torch.bfloat16), "scale edges: y")


def test_fake_lean3_changes_nothing_else(monkeypatch):
    """The switch changes only RTN fake quantization with g None: SR, guided and g-given fake quantization and RTN
    quantize give the default's outputs, and none of the fake ones runs the lean3 kernel. (g given through lean3 is
    its own switch, off here: tests/gpu/test_quant_given_lean3_gpu.py; so is guided fake quantization through lean3:
    tests/gpu/test_quant_fake_guided_lean3_gpu.py.)"""
    monkeypatch.setenv("TRACE_EXT_QUANT_GIVEN_LEAN3", "0")
    monkeypatch.setenv("TRACE_EXT_QUANT_FAKE_GUIDED_LEAN3", "0")
    gen = torch.Generator(device=DEV).manual_seed(23)
    x = torch.randn(333, 2048, generator=gen, device=DEV).to(torch.bfloat16)
    rec = ref.guidance_from_quantized(ref.nvfp4_quantize((x.float() * 1.001).to(torch.bfloat16)), "compact")
    g = ref.nvfp4_global_scale(x, "row").contiguous()
    calls = (lambda: ops.nvfp4_fake_quantize(x, g, backend="cuda"),
             lambda: ops.nvfp4_fake_quantize(x, rounding="sr", seed=3, offset=1, backend="cuda"),
             lambda: ops.nvfp4_fake_quantize(x, rounding="guided", guidance=rec, backend="cuda"),
             lambda: ops.nvfp4_fake_quantize(x, rounding="guided", guidance=rec, capture=True, backend="cuda")[0])
    for i, call in enumerate(calls):
        _set_impl(monkeypatch, PREVIOUS)
        a = call()
        _set_impl(monkeypatch, VARIANT)
        assert torch.equal(bits(call()), bits(a)), f"call {i}"
        assert not any(KERNEL in n for n in launched(call)), f"call {i} ran {KERNEL}"
    _set_impl(monkeypatch, PREVIOUS)
    q = ops.nvfp4_quantize(x, backend="cuda")
    _set_impl(monkeypatch, VARIANT)
    q2 = ops.nvfp4_quantize(x, backend="cuda")
    assert torch.equal(q.codes, q2.codes) and torch.equal(q.scales, q2.scales), "RTN quantize"


def test_fake_lean3_activations(monkeypatch):
    """Model-shaped bf16 activations (Qwen3-30B-A3B hidden 2048 at 4099 tokens and its expert width 768, DeepSeek-V3
    hidden 7168 at 601, K 5120 and K 4096 at 8191; randn with per-token scales), 3-D input included: the variant
    equals the previous default."""
    gen = torch.Generator(device=DEV).manual_seed(31)
    for shape in ((4099, 2048), (4099, 768), (601, 7168), (333, 5120), (4, 2048, 4096)):
        x = torch.randn(*shape, generator=gen, device=DEV)
        x = (x * torch.exp2(torch.randn(*shape[:-1], 1, generator=gen, device=DEV) * 4)).to(torch.bfloat16)
        _set_impl(monkeypatch, PREVIOUS)
        want = fake_all(x)
        _set_impl(monkeypatch, VARIANT)
        assert_same_fake(fake_all(x), want, f"{VARIANT} activations {shape}")
