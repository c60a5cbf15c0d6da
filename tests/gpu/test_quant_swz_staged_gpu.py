"""Swizzled scales of the per-row lean3 quantize kernel staged in shared memory (SWZ_STAGED): a CTA takes rows_per_cta
rows of each 32-row phase of one 128-row tile (4 row groups, 32 rows apart), so that it owns whole 16-byte chunks of
the 128x4 layout and stores them with 16-byte stores, instead of one byte per block scattered over 8 sectors per warp
store. The default where the row team has >= 8 threads (rows_per_cta <= 32); TRACE_EXT_QUANT_SWZ_STAGED=0 keeps the
scattered byte stores.

Protects: the swizzled scales (zero padding included: rows past R in the last tile, blocks past K / 16 up to a multiple
of 4), codes, g and capture mbits of the staged kernel equal the scattered kernel's (=0) and the reference's bit for
bit, with g per row from the row (g None) and g given (per row and one value), on every rows_per_cta the staged kernel
takes (32, 16, 8, 4, 2, 1), row counts that end inside a 32-row phase, at a phase edge, inside the last tile and past
one wave of CTAs (tiles of whole CTAs with no row below R), the lean3 inputs' adversarial rows (zero / NaN / +-Inf
blocks, subnormal scale bytes, ties); and the staged kernel runs exactly where it should (not at rows_per_cta 64,
not with =0), read off the kernel's last template argument in the profiler's kernel names.
Run: pytest tests/gpu/test_quant_swz_staged_gpu.py -q   (on the H200, with the extension built; ~30 s)
"""
from __future__ import annotations

import re

import pytest
import torch

from trace_ext import ops
from trace_ext import reference as ref

from test_quant_given_lean3_gpu import given_g
from test_quant_rowg_lean3_gpu import DEV, assert_same_q, dirty_allocator, launched, lean3_input, set_switch

pytestmark = pytest.mark.gpu

ENV = "TRACE_EXT_QUANT_SWZ_STAGED"
KERNEL = re.compile(r"nvfp4_quant_rowg_lean3_kernel<(.*)>\(")
# K: row teams of 8 .. 256 threads (rows_per_cta 32, 16, 8, 4, 2, 1), K / 16 not a multiple of 4 (37, 257: padded
# columns), K 128 (team 4, rows_per_cta 64: the scattered stores). R: inside a phase, phase / tile edges, past a wave.
SHAPES = ((1, 256), (33, 512), (127, 1024), (128, 2048), (129, 4096), (300, 7168), (4099, 4096), (2001, 592),
          (257, 4112), (200, 8192), (77, 128), (9000, 256))


@pytest.fixture(autouse=True)
def _default_impl(monkeypatch):
    for name in ("TRACE_EXT_QUANT_IMPL", "TRACE_EXT_QUANT_GIVEN_LEAN3", ENV):
        monkeypatch.delenv(name, raising=False)


def team(K: int) -> int:
    """The lean3 row team: the smallest power of two of threads with 2 team >= K / 16."""
    t = 1
    while 2 * t < K // 16:
        t *= 2
    return t


def staged_runs(fn) -> bool:
    """Whether fn launches the lean3 kernel with SWZ_STAGED (its last template argument); fails if no lean3 kernel runs
    or a name does not parse, so that a changed name format cannot pass as "not staged"."""
    args = [KERNEL.search(n) for n in launched(fn) if "nvfp4_quant_rowg_lean3_kernel" in n]
    assert args and all(args), f"lean3 kernel names not found / not parsed: {args}"
    return any(m.group(1).split(",")[-1].strip() == "true" for m in args)


def swizzled(x, g, capture):
    R, K = x.shape
    dirty_allocator(2 * ((R + 127) // 128 * 128) * ((K // 16 + 3) // 4 * 4))
    return ops.nvfp4_quantize(x, g, swizzle=True, capture=capture, backend="cuda")


@pytest.mark.parametrize("R,K", SHAPES)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("g_kind", ("row", "given", "one"))
def test_staged_same_bits(monkeypatch, R, K, dtype, g_kind):
    x = lean3_input(R, K, dtype, 13 * R + K)
    g = {"row": None, "given": given_g(x, R + K), "one": torch.tensor([0.75], device=DEV)}[g_kind]
    if g_kind != "row":
        monkeypatch.setenv("TRACE_EXT_QUANT_GIVEN_LEAN3", "1")  # the lean3 kernel for every K it takes
    want_ref = ops.nvfp4_quantize(x, g, swizzle=True, backend="reference")
    mbits_ref = ref.guidance_from_quantized(ops.nvfp4_quantize(x, g, backend="reference"), "compact").payload
    for capture in (False, True):
        what = f"{R}x{K} {dtype} g {g_kind} capture {capture}"
        monkeypatch.setenv(ENV, "0")
        assert not staged_runs(lambda: swizzled(x, g, capture)), what
        want = swizzled(x, g, capture)
        monkeypatch.delenv(ENV)
        assert staged_runs(lambda: swizzled(x, g, capture)) == (team(K) >= 8), what
        got = swizzled(x, g, capture)
        if capture:
            (want, want_rec), (got, got_rec) = want, got
            assert torch.equal(got_rec.payload, want_rec.payload), f"{what}: mbits vs scattered"
            assert torch.equal(got_rec.payload, mbits_ref), f"{what}: mbits vs reference"
        assert_same_q(got, want, f"{what}: staged vs scattered")
        assert_same_q(got, want_ref, f"{what}: staged vs reference")
