"""Guided quantize of 16-bit x with linear scales through nvfp4_quant_rowg_lean3_kernel's guided instantiations (the
per-row kernel's walk; the rollout's g, scale bytes and bits / codes loaded with the next row's x; the blocks by the
guided lean kernel's block code) instead of nvfp4_quant_guided_lean_kernel: the default for compact records of bf16 x
since H200 round 59; TRACE_EXT_QUANT_GUIDED_LEAN3=1 for compact and full, bf16 and fp16; =0 never.

Protects: codes, scales, g and capture mbits equal the guided lean kernel's (=0) and the reference's bit for
bit, on every dense value with every payload (t = 1), the guided lean tests' adversarial records and inputs (subnormal,
zero and NaN scale bytes, tiny and huge g, zero / -0 / NaN / +-Inf blocks, tiny |x|, ties, saturation), random and own
records on the lean3 team shapes (teams of 2 .. 256 threads, lanes without a second block, odd row counts over
several waves); the variant runs the lean3 kernel exactly where it should (16-bit x, 2 <= K / 16 <= 512, linear
scales) and nothing else changes.
Run: pytest tests/gpu/test_quant_guided_lean3_gpu.py -q   (on the H200, with the extension built; ~1 min)
"""
from __future__ import annotations

import pytest
import torch

from trace_ext import ops
from trace_ext import reference as ref

from test_quant_given_lean3_gpu import SHAPES
from test_quant_guided_lean_gpu import adversarial, random_record
from test_quant_impl_gpu import assert_same, guided_inputs
from test_quant_rowg_lean3_gpu import DEV, launched, lean3_input, lean3_takes, set_switch

pytestmark = pytest.mark.gpu

ENV = "TRACE_EXT_QUANT_GUIDED_LEAN3"
KERNEL = "nvfp4_quant_rowg_lean3_kernel"


@pytest.fixture(autouse=True)
def _default_impl(monkeypatch):
    monkeypatch.delenv("TRACE_EXT_QUANT_IMPL", raising=False)
    monkeypatch.delenv(ENV, raising=False)


def guided(monkeypatch, setting, x, rec, capture=False, swizzle=False):
    """Guided quantize with TRACE_EXT_QUANT_GUIDED_LEAN3 = setting (None: unset)."""
    set_switch(monkeypatch, ENV, setting)
    return ops.nvfp4_quantize(x, rounding="guided", guidance=rec, capture=capture, swizzle=swizzle, backend="cuda")


def check(monkeypatch, x, rec, what):
    """=1 and the default == the guided lean kernel (=0) == the reference (codes, scales, g); capture mbits equal; the
    lean3 kernel runs exactly where each setting says."""
    want = ops.nvfp4_quantize(x, rounding="guided", guidance=rec, backend="reference")
    flat = guided(monkeypatch, "0", x, rec)
    assert_same(flat, want, f"{what}: =0 vs reference")
    qf, rf = guided(monkeypatch, "0", x, rec, True)
    takes = lean3_takes(x.shape[-1], x.dtype)
    default = takes and rec.kind == "compact" and x.dtype == torch.bfloat16
    for setting, runs in (("1", takes), (None, default), ("0", False)):
        assert_same(guided(monkeypatch, setting, x, rec), want, f"{what}: {ENV}={setting} vs reference")
        qc, rc = guided(monkeypatch, setting, x, rec, True)
        assert_same(qc, qf, f"{what}: {ENV}={setting} capture")
        assert torch.equal(rc.payload, rf.payload), f"{what}: {ENV}={setting} capture mbits"
        for cap in (False, True):
            names = launched(lambda: guided(monkeypatch, setting, x, rec, cap))
            assert any(KERNEL in n for n in names) == runs, (what, setting, cap, names)


@pytest.mark.parametrize("kind", ("compact", "full"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_dense_values_every_payload(monkeypatch, kind, dtype):
    x, rec = guided_inputs(kind, dtype)
    check(monkeypatch, x, rec, f"dense {kind} {dtype}")


@pytest.mark.parametrize("kind", ("compact", "full"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("seed", (0, 1))
def test_adversarial_records_and_inputs(monkeypatch, kind, dtype, seed):
    x, rec = adversarial(kind, dtype, 200 + seed)
    check(monkeypatch, x, rec, f"adversarial {kind} {dtype} seed {seed}")


@pytest.mark.parametrize("R,K", SHAPES)
@pytest.mark.parametrize("kind", ("compact", "full"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_records_on_lean3_shapes(monkeypatch, R, K, kind, dtype):
    """A random record (not derived from x) and the rollout's own record of a nearby x, on lean3_input's rows."""
    gen = torch.Generator(device=DEV).manual_seed(R + K)
    x = lean3_input(R, K, dtype, 7 * R + K)
    check(monkeypatch, x, random_record(kind, R, K, gen), f"random record {kind} {R}x{K} {dtype}")
    q = ops.nvfp4_quantize(x, backend="reference")
    x_train = (x.float() * (1 + 1e-2 * torch.randn(R, K, generator=gen, device=DEV))).to(dtype)
    check(monkeypatch, x_train, ref.guidance_from_quantized(q, kind), f"own record {kind} {R}x{K} {dtype}")


def test_other_paths_unchanged(monkeypatch):
    """The switch changes guided quantize with linear scales only: guided swizzled quantize and guided fake
    quantization keep their kernels and bits. (Guided fake quantization through lean3 is its own switch, off here:
    tests/gpu/test_quant_fake_guided_lean3_gpu.py.)"""
    monkeypatch.setenv("TRACE_EXT_QUANT_FAKE_GUIDED_LEAN3", "0")
    gen = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(333, 4096, generator=gen, device=DEV).to(torch.bfloat16)
    rec = ref.guidance_from_quantized(ref.nvfp4_quantize((x.float() * 1.001).to(torch.bfloat16)), "compact")
    assert_same(guided(monkeypatch, "1", x, rec, swizzle=True), guided(monkeypatch, "0", x, rec, swizzle=True),
                "swizzled")
    monkeypatch.setenv(ENV, "1")
    assert not any(KERNEL in n for n in launched(
        lambda: ops.nvfp4_quantize(x, rounding="guided", guidance=rec, swizzle=True, backend="cuda")))
    fake = lambda: ops.nvfp4_fake_quantize(x, rounding="guided", guidance=rec, backend="cuda")  # noqa: E731
    fa = fake()
    assert not any(KERNEL in n for n in launched(fake))
    monkeypatch.delenv(ENV, raising=False)
    assert torch.equal(fake().view(torch.int16), fa.view(torch.int16)), "fake quantization"
