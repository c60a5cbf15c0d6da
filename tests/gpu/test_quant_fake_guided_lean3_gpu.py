"""Guided fake quantization (the trainer's TRACE forward, with and without emit_guidance) of 16-bit x runs through
nvfp4_quant_rowg_lean3_kernel's FAKE guided instantiations by default (the per-row walk with the rollout's g, scale bytes
and bits / codes in flight; the guided lean kernel's block code); TRACE_EXT_QUANT_FAKE_GUIDED_LEAN3=0 keeps the generic
flat kernel (=1 names the default).

Protects: y (every bit, NaN included) and the emitted record (mbits, scale bytes, g) equal the reference's under every
setting, on every dense value with every payload (t = 1), the guided lean tests' adversarial records and inputs,
random and own records on the lean3 team shapes; the lean3 kernel runs exactly where each setting says (16-bit x,
2 <= K / 16 <= 512; never with =0).
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


def fake(monkeypatch, setting, x, rec, capture=False, backend="cuda"):
    set_switch(monkeypatch, ENV, setting)
    return ops.nvfp4_fake_quantize(x, rounding="guided", guidance=rec, capture=capture, backend=backend)


def takes_lean3(setting, x) -> bool:
    """Where the setting of TRACE_EXT_QUANT_FAKE_GUIDED_LEAN3 (None: unset, the default) runs the lean3 kernel."""
    on = setting != "0"
    return on and lean3_takes(x.shape[-1], x.dtype)


def check(monkeypatch, x, rec, what):
    """Every setting == the reference: y, and with capture y and the record; the kernel runs where it should."""
    want_y, want_rec = fake(monkeypatch, None, x, rec, True, backend="reference")
    for setting in ("1", "0", None):
        assert_same(fake(monkeypatch, setting, x, rec), want_y, f"{what}: y (setting {setting}) vs reference")
        y, got = fake(monkeypatch, setting, x, rec, True)
        assert_same(y, want_y, f"{what}: y with capture (setting {setting})")
        assert torch.equal(got.payload, want_rec.payload), f"{what}: mbits (setting {setting})"
        assert torch.equal(got.scales, want_rec.scales), f"{what}: scales (setting {setting})"
        assert_same(got.g.reshape(-1), want_rec.g.reshape(-1).float(), f"{what}: g (setting {setting})")
        for cap in (False, True):
            names = launched(lambda: fake(monkeypatch, setting, x, rec, cap))
            assert any(KERNEL in n for n in names) == takes_lean3(setting, x), (what, setting, cap)


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
