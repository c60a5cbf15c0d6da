"""RTN quantize and fake quantization of 16-bit x with g given (per row, or one value: scope="tensor" / "matrix"
weights) through nvfp4_quant_rowg_lean3_kernel's GIVEN instantiations (the per-row kernel's walk and next-row
prefetch, g read with the next row's x instead of reduced over the team): the default since H200 rounds 58-59 for
64 <= K / 16 <= 512 where at least 3/4 of the row team's lanes own two blocks (given_default);
TRACE_EXT_QUANT_GIVEN_LEAN3=1 takes it for every 2 <= K / 16 <= 512, =0 never (the flat kernels).

Protects: every output - codes, scale bytes, g, capture mbits, swizzled scales with their zero padding, fake-quantized
y and its emitted record - equals the flat kernels' (=0) bit for bit and the reference's, on the lean3 team shapes and
row counts (lean3_input's adversarial rows: zero rows, NaN / +-Inf, no finite value, ties, subnormal x and scale
bytes) with g per row spread over factors of the row's own g and edge values (2^-50 / 2^50 where 1/g is taken and one
binade beyond, subnormal g, 2^100), and with one g for all rows; the lean3 kernel runs exactly where it should under
each setting (16-bit x, RTN).
Run: pytest tests/gpu/test_quant_given_lean3_gpu.py -q   (on the H200, with the extension built; ~1 min)
"""
from __future__ import annotations

import pytest
import torch

from trace_ext import ops
from trace_ext import reference as ref

from test_quant_fake_lean3_gpu import assert_same_as_reference, assert_same_fake
from test_quant_rowg_lean3_gpu import (DEV, assert_same_all, assert_same_q, dirty_allocator, launched, lean3_input,
                                      lean3_takes, set_switch)

pytestmark = pytest.mark.gpu

ENV = "TRACE_EXT_QUANT_GIVEN_LEAN3"
KERNEL = "nvfp4_quant_rowg_lean3_kernel"
# (R, K): teams of 2 (shuffles), 32 (one warp), 128 / 256 threads (2..8 warps, with and without lanes lacking a second
# block), odd row counts over several waves; K 16 and 8208 fall back to the flat kernels
SHAPES = ((3, 48), (4099, 64), (1031, 1024), (2001, 768), (9001, 4096), (1001, 4112), (1201, 7168), (7, 8192), (65, 16),
          (33, 8208))
G_EDGES = (2.0**-50, 2.0**50, 2.0**-51, 2.0**51, 2.0**-140, 2.0**100)  # g must be > 0 (SPEC 10)


@pytest.fixture(autouse=True)
def _default_impl(monkeypatch):
    monkeypatch.delenv("TRACE_EXT_QUANT_IMPL", raising=False)
    monkeypatch.delenv(ENV, raising=False)


def given_g(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Per-row g: the row's own g (SPEC 2) times a factor in [1/4, 4) (scale bytes saturate at 448 or underflow
    differently than with the row's g), every G_EDGES value in some rows."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    g = ref.nvfp4_global_scale(x, "row").reshape(-1).float()
    g = g * torch.exp2(torch.rand(g.shape, generator=gen, device=DEV) * 4.0 - 2.0)
    g = torch.where(g > 0, g, torch.full_like(g, 2.0**-140))  # fp32 rows whose own g underflows to 0 (g must be > 0)
    for i, v in enumerate(G_EDGES):
        if i < g.numel():
            g[(7 * i + 3) % g.numel()] = v
    return g.contiguous()


def quantize_all_g(x: torch.Tensor, g: torch.Tensor):
    """Linear, capture (codes + mbits) and swizzled outputs with g given, under the current environment."""
    R, K = x.shape
    lin = ops.nvfp4_quantize(x, g, backend="cuda")
    cap, rec = ops.nvfp4_quantize(x, g, capture=True, backend="cuda")
    dirty_allocator(2 * ((R + 127) // 128 * 128) * ((K // 16 + 3) // 4 * 4))
    swz = ops.nvfp4_quantize(x, g, swizzle=True, backend="cuda")
    return lin, cap, rec.payload, swz


def fake_all_g(x: torch.Tensor, g: torch.Tensor):
    """y without and with emit_guidance (and the record's mbits, scales, g) with g given."""
    y = ops.nvfp4_fake_quantize(x, g, backend="cuda")
    y2, rec = ops.nvfp4_fake_quantize(x, g, capture=True, backend="cuda")
    return y, y2, rec.payload, rec.scales, rec.g


def given_default(K: int) -> bool:
    """Where the default takes the GIVEN kernel (16-bit x): 64 <= kb <= 512 and at least 3/4 of the team's lanes (the
    power of two >= kb / 2) own a second block."""
    kb = K // 16
    team = 1
    while 2 * team < kb:
        team *= 2
    return 64 <= kb <= 512 and 4 * (kb - team) >= 3 * team


def test_given_default_rule():
    """The K of the timed rows: 1024 / 2048 / 4096 / 7168 / 8192 take the GIVEN kernel, 768 does not (0.87-0.96x)."""
    assert [K for K in (768, 1024, 1536, 2048, 3072, 4096, 5120, 7168, 8192, 4112, 8208) if given_default(K)] == [
        1024, 2048, 4096, 7168, 8192]


def lean3_runs(monkeypatch, setting, fn) -> bool:
    """Whether fn launches the lean3 kernel with TRACE_EXT_QUANT_GIVEN_LEAN3 = setting (None: unset)."""
    set_switch(monkeypatch, ENV, setting)
    return any(KERNEL in n for n in launched(fn))


@pytest.mark.parametrize("R,K", SHAPES)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
@pytest.mark.parametrize("per_row", (True, False))
def test_given_lean3_matches_flat(monkeypatch, R, K, dtype, per_row):
    """The default and =1 give the flat kernels' (=0) quantize and fake-quantize outputs bit for bit, g per row and one
    g, and each setting runs the lean3 kernel exactly where it should."""
    x = lean3_input(R, K, dtype, 11 * R + K)
    g = given_g(x, R + K) if per_row else torch.tensor([0.37], device=DEV)
    monkeypatch.setenv(ENV, "0")
    want_q, want_f = quantize_all_g(x, g), fake_all_g(x, g)
    takes = lean3_takes(K, dtype)
    calls = (lambda: ops.nvfp4_quantize(x, g, backend="cuda"), lambda: ops.nvfp4_fake_quantize(x, g, backend="cuda"))
    for setting, runs in (("0", False), ("1", takes), (None, takes and given_default(K))):
        for call in calls:
            assert lean3_runs(monkeypatch, setting, call) == runs, (R, K, dtype, setting)
        what = f"{ENV}={setting} {R}x{K} {dtype} per_row={per_row}"
        assert_same_all(quantize_all_g(x, g), want_q, what)
        assert_same_fake(fake_all_g(x, g), want_f, f"fake {what}")


@pytest.mark.parametrize("R,K", ((4099, 64), (1031, 1024), (130, 4096), (61, 4112), (45, 7168)))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_given_lean3_against_reference(monkeypatch, R, K, dtype):
    """The variant's outputs equal the reference's (SPEC 2), g per row with its edge values: linear, capture, swizzled,
    fake quantization."""
    x = lean3_input(R, K, dtype, 5 * R + 3 * K)
    g = given_g(x, 3 * R + K)
    qr = ops.nvfp4_quantize(x, g, backend="reference")
    mbits = ref.guidance_from_quantized(qr, "compact").payload
    qsr = ops.nvfp4_quantize(x, g, swizzle=True, backend="reference")
    yr = ops.nvfp4_fake_quantize(x, g, backend="reference")
    monkeypatch.setenv(ENV, "1")
    lin, cap, mb, swz = quantize_all_g(x, g)
    what = f"{R}x{K} {dtype}"
    assert_same_q(lin, qr, f"{what} linear")
    assert_same_q(cap, qr, f"{what} capture")
    assert torch.equal(mb, mbits), f"{what}: capture mbits"
    assert_same_q(swz, qsr, f"{what} swizzled")
    assert_same_as_reference(ops.nvfp4_fake_quantize(x, g, backend="cuda"), yr, f"{what} fake")


@pytest.mark.parametrize("scope", ("tensor", "matrix"))
def test_given_lean3_weight_scopes(monkeypatch, scope):
    """Weights: scope="tensor" (one g) and "matrix" (one g per expert of [E, N, K]) through the variant equal the
    reference."""
    x = lean3_input(4 * 768, 2048, torch.bfloat16, 99).reshape(4, 768, 2048)
    x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)  # a weight: finite
    want = ops.nvfp4_quantize(x, scope=scope, backend="reference")
    monkeypatch.setenv(ENV, "1")
    assert any(KERNEL in n for n in launched(lambda: ops.nvfp4_quantize(x, scope=scope, backend="cuda")))
    assert_same_q(ops.nvfp4_quantize(x, scope=scope, backend="cuda"), want, f"scope {scope}")
