"""TRACE_EXT_QUANT_FAKE_GUIDED_LEAN3=1 (an A/B variant): guided fake quantization of 16-bit x (the trainer's TRACE
forward, with and without emit_guidance) through nvfp4_quant_rowg_lean3_kernel's FAKE guided instantiations (the per-row
walk with the rollout's g, scale bytes and bits / codes in flight; the guided lean kernel's block code) instead of the
generic flat kernel.

Protects: y (every bit, NaN included) and the emitted record (mbits, scale bytes, g) equal the default's and the
reference's, on every dense value with every payload (t = 1), the guided lean tests' adversarial records and inputs,
random and own records on the lean3 team shapes; the variant runs the lean3 kernel exactly where it should (16-bit x,
2 <= K / 16 <= 512) and the default never does for fake quantization with guidance.
Run: pytest tests/gpu/test_quant_fake_guided_lean3_gpu.py -q   (on the H200, with the extension built; ~1 min)
"""
from __future__ import annotations

import pytest
import torch

from trace_ext import ops
from trace_ext import reference as ref

from test_quant_given_lean3_gpu import SHAPES
from test_quant_gpu import assert_same
from test_quant_guided_lean_gpu import adversarial, random_record
from test_quant_impl_gpu import guided_inputs
from test_quant_rowg_lean3_gpu import DEV, launched, lean3_input, lean3_takes, set_switch

pytestmark = pytest.mark.gpu

ENV = "TRACE_EXT_QUANT_FAKE_GUIDED_LEAN3"
KERNEL = "nvfp4_quant_rowg_lean3_kernel"


@pytest.fixture(autouse=True)
def _default_impl(monkeypatch):
    monkeypatch.delenv("TRACE_EXT_QUANT_IMPL", raising=False)
    monkeypatch.delenv(ENV, raising=False)


def fake(monkeypatch, on, x, rec, capture=False, backend="cuda"):
    set_switch(monkeypatch, ENV, "1" if on else None)
    return ops.nvfp4_fake_quantize(x, rounding="guided", guidance=rec, capture=capture, backend=backend)


def check(monkeypatch, x, rec, what):
    """=1 == the default == the reference: y, and with capture y and the record; the kernel runs where it should."""
    want_y, want_rec = fake(monkeypatch, False, x, rec, True, backend="reference")
    for on in (True, False):
        assert_same(fake(monkeypatch, on, x, rec), want_y, f"{what}: y (variant {on}) vs reference")
        y, got = fake(monkeypatch, on, x, rec, True)
        assert_same(y, want_y, f"{what}: y with capture (variant {on})")
        assert torch.equal(got.payload, want_rec.payload), f"{what}: mbits (variant {on})"
        assert torch.equal(got.scales, want_rec.scales), f"{what}: scales (variant {on})"
        assert_same(got.g.reshape(-1), want_rec.g.reshape(-1).float(), f"{what}: g (variant {on})")
        for cap in (False, True):
            names = launched(lambda: fake(monkeypatch, on, x, rec, cap))
            assert any(KERNEL in n for n in names) == (on and lean3_takes(x.shape[-1], x.dtype)), (what, on, cap)


@pytest.mark.parametrize("kind", ("compact", "full"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_dense_values_every_payload(monkeypatch, kind, dtype):
    x, rec = guided_inputs(kind, dtype)
    check(monkeypatch, x, rec, f"dense {kind} {dtype}")


@pytest.mark.parametrize("kind", ("compact", "full"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("seed", (0, 1))
def test_adversarial_records_and_inputs(monkeypatch, kind, dtype, seed):
    x, rec = adversarial(kind, dtype, 300 + seed)
    check(monkeypatch, x, rec, f"adversarial {kind} {dtype} seed {seed}")


@pytest.mark.parametrize("R,K", SHAPES)
@pytest.mark.parametrize("kind", ("compact", "full"))
def test_records_on_lean3_shapes(monkeypatch, R, K, kind):
    """A random record and the rollout's own record of a nearby x, bf16 rows of lean3_input."""
    gen = torch.Generator(device=DEV).manual_seed(R + 2 * K)
    x = lean3_input(R, K, torch.bfloat16, 5 * R + K)
    check(monkeypatch, x, random_record(kind, R, K, gen), f"random record {kind} {R}x{K}")
    q = ops.nvfp4_quantize(x, backend="reference")
    x_train = (x.float() * (1 + 1e-2 * torch.randn(R, K, generator=gen, device=DEV))).to(torch.bfloat16)
    check(monkeypatch, x_train, ref.guidance_from_quantized(q, kind), f"own record {kind} {R}x{K}")
