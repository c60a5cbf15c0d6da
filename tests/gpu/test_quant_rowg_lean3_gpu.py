"""TRACE_EXT_QUANT_IMPL=rowg-lean3 (the default since round 46): RTN quantize of 16-bit x with g None (the rollout's
activation quantization) through nvfp4_quant_rowg_lean3_kernel, the previous per-row kernel's walk with less per-row
work (two row steps per loop iteration, next-row loads from the clamped row, one shared-memory read per thread for the
cross-warp amax, capture as a template parameter). =sr-row (PREVIOUS) keeps the previous kernel.

Protects: every output - codes, scale bytes, g, capture mbits, swizzled scales with their zero padding - equals the
previous default's (nvfp4_quant_rowg_lean_kernel) bit for bit and the reference's, on every team shape the kernel
takes (teams of 2..256 threads: shuffles, one warp, 2..8 warps; rows that fill the team exactly and rows whose last
lanes have no second block), rows past R in the last walk step (odd row counts), CTAs walking odd and even numbers of
row steps, the fallbacks (16-bit K = 16, K > 8192, every fp32 x: the previous kernels), and rows built to hit the
edges of the shortcuts: zero rows, NaN / +-Inf blocks and rows with no finite value, rows whose g leaves [2^-50, 2^50]
(1/g not taken), blocks whose divisor t leaves [2^-100, 2^100] or is 0 (division path, zero codes), subnormal x and
scale bytes, quotients at every rounding tie. The test also checks, by the kernel names the profiler records, that
the kernel ran where it should (and not where it should not), so that the equalities cannot pass by a silent
fallback.
Run: pytest tests/gpu/test_quant_rowg_lean3_gpu.py -q   (on the H200, with the extension built; ~1-2 min)
"""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from trace_ext import ops
from trace_ext import reference as ref

pytestmark = pytest.mark.gpu

DEV = "cuda"
VARIANT = "rowg-lean3"
KERNEL = "nvfp4_quant_rowg_lean3_kernel"
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# row-binade range of each dtype (x = 2^e * randn stays finite; bf16 / fp32 reach subnormals, fp16 its own)
EXP_RANGE = {torch.bfloat16: (-133, 120), torch.float32: (-140, 120), torch.float16: (-24, 12)}


def set_switch(monkeypatch, name, value):
    """Environment switch `name` = value for the rest of the test (None: unset; the kernels read it per call)."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


def _set_impl(monkeypatch, variant):
    set_switch(monkeypatch, "TRACE_EXT_QUANT_IMPL", variant)


def lean3_input(R: int, K: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of random activations over every binade of the dtype (row scale 2^e, blocks 2^-24 .. 2^6 apart within a
    row, so that scale bytes reach E4M3 subnormals and 0), with adversarial rows mixed in: zero rows, NaN / +-Inf
    elements, a row with no finite value, a row of one NaN block among finite ones, g at the edges 2^-50 / 2^50 of
    the reciprocal's range, and rows whose every quotient is a grid point or a tie (t = 1 exactly: g = 1 from a
    2688 lead, blocks led by +-6)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    kb = K // 16
    lo, hi = EXP_RANGE[dtype]
    x = torch.randn(R, K, generator=gen, device=DEV, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(lo + 8, hi, (R, 1), generator=gen, device=DEV).double())
    blk = torch.randint(-24, 7, (R, kb, 1), generator=gen, device=DEV).double()
    x = (x.reshape(R, kb, 16) * torch.exp2(blk)).reshape(R, K)
    if dtype == torch.float16:
        x = x.clamp(-65000.0, 65000.0)
    x = x.float()
    take = iter(torch.randperm(R, generator=gen, device=DEV)[: R // 2].tolist())  # half the rows stay random
    n = max(1, R // 50)

    def pick(k):
        return [r for _, r in zip(range(k), take)]

    for r in pick(n):  # zero rows: g = 1
        x[r] = 0.0
    for i, r in enumerate(pick(n)):  # one non-finite element (its block NaN, the row's g from the rest)
        x[r, (7 * r + i) % K] = (float("nan"), float("inf"), float("-inf"))[i % 3]
    for r in pick(1):  # no finite value: g = 1, every block NaN
        x[r] = float("inf")
    for r in pick(1):  # a NaN block first, finite blocks after it
        x[r, :16] = float("nan")
    if dtype != torch.float16:
        for i, r in enumerate(pick(4)):  # g = 2^-50 / 2^50 exactly, and one binade beyond each
            e = (-50, 50, -51, 51)[i]
            x[r] = x[r] / x[r].abs().max().clamp_min(1e-30) * 2688.0 * 2.0**e
    for r in pick(max(1, n)):  # every quotient a grid value or a tie: g = 1, t = 1 in the blocks led by 6
        vals = torch.tensor(GRID + TIES, device=DEV)
        row = vals[torch.randint(0, len(vals), (K,), generator=gen, device=DEV)]
        row = row * torch.where(torch.rand(K, generator=gen, device=DEV) < 0.5, -1.0, 1.0)
        row[::16] = 6.0
        row[0] = 2688.0 if K > 16 else 6.0
        x[r] = row
    return x.to(dtype)


def dirty_allocator(nbytes: int) -> None:
    """Leave 0xFF in the caching allocator's free blocks, so that outputs the kernel fails to write (the swizzled
    layout's zero padding) do not read back as zeros by luck."""
    junk = torch.full((max(nbytes, 1),), 255, dtype=torch.uint8, device=DEV)
    del junk


def quantize_all(x: torch.Tensor):
    """Linear, capture (codes + mbits) and swizzled outputs of the current TRACE_EXT_QUANT_IMPL."""
    R, K = x.shape
    pad = ((R + 127) // 128 * 128) * ((K // 16 + 3) // 4 * 4)
    lin = ops.nvfp4_quantize(x, backend="cuda")
    cap, rec = ops.nvfp4_quantize(x, capture=True, backend="cuda")
    dirty_allocator(2 * pad)
    swz = ops.nvfp4_quantize(x, swizzle=True, backend="cuda")
    return lin, cap, rec.payload, swz


def launched(fn) -> list[str]:
    """Names of the CUDA kernels fn launches (CUPTI through torch.profiler)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def assert_same_q(a, b, what):
    assert torch.equal(a.codes, b.codes), f"{what}: {int((a.codes != b.codes).sum())} code bytes differ"
    assert torch.equal(a.scales, b.scales), f"{what}: {int((a.scales != b.scales).sum())} scale bytes differ"
    assert torch.equal(a.g.view(torch.int32), b.g.view(torch.int32)), f"{what}: g differs"


def assert_same_all(got, want, what):
    (lin, cap, mbits, swz), (lin_w, cap_w, mbits_w, swz_w) = got, want
    assert_same_q(lin, lin_w, f"{what} linear")
    assert_same_q(cap, cap_w, f"{what} capture")
    assert torch.equal(mbits, mbits_w), f"{what}: capture mbits differ"
    assert_same_q(swz, swz_w, f"{what} swizzled (padding included)")


PREVIOUS = "sr-row"  # the default before rowg-lean3 (nvfp4_quant_rowg_lean_kernel)


def lean3_takes(K: int, dtype: torch.dtype) -> bool:
    """Where =rowg-lean3 (the default) runs its own kernel: 16-bit x with 2 <= K / 16 <= 512 (fp32 x keeps the
    previous kernel: its lean3 kernel disagreed with the reference at 257 x 64 in H200 round 45)."""
    return dtype != torch.float32 and 2 <= K // 16 <= 512


# (R, K): K 48 / 64 / 512 (teams of 2 / 2 / 16 threads: shuffles), 1024 (one warp: redux only), 2048 / 4096 / 8192
# (2 / 4 / 8 warps, rows fill the team), 4112 / 7168 (8 warps, lanes without a second block: 1 / 64 of 256 have it
# or not), 16 and 8208 (fallbacks for 16-bit x), fp32 past 4096 (fallback). Row counts: odd, below and above one
# row group per CTA, with CTAs walking odd and even numbers of row steps (several thousand rows at K <= 4096).
SHAPES = ((1, 64), (3, 48), (4099, 64), (2049, 512), (1031, 1024), (4097, 2048), (4099, 4096), (129, 4096),
          (1001, 4112), (1201, 7168), (1500, 8192), (7, 8192), (65, 16), (33, 8208))


@pytest.mark.parametrize("R,K", SHAPES)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_rowg_lean3_matches_default(monkeypatch, R, K, dtype):
    """=rowg-lean3 (the default) gives the previous default's (=sr-row) codes, scales, g, mbits and swizzled scales
    (padding included) bit for bit, and runs its own kernel exactly where it should, named or by default."""
    x = lean3_input(R, K, dtype, 17 * R + K)
    _set_impl(monkeypatch, PREVIOUS)
    want = quantize_all(x)
    assert not any(KERNEL in n for n in launched(lambda: ops.nvfp4_quantize(x, backend="cuda")))
    for variant in (VARIANT, None):
        _set_impl(monkeypatch, variant)
        got = quantize_all(x)
        assert_same_all(got, want, f"{variant} {R}x{K} {dtype}")
        names = launched(lambda: ops.nvfp4_quantize(x, backend="cuda"))
        assert any(KERNEL in n for n in names) == lean3_takes(K, dtype), (R, K, dtype, variant, names)


@pytest.mark.parametrize("R,K", ((257, 64), (129, 1024), (77, 2048), (130, 4096), (61, 4112), (45, 7168), (9, 8192)))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_rowg_lean3_against_reference(monkeypatch, R, K, dtype):
    """The variant's outputs equal the reference's (SPEC 2; the oracle), linear, capture and swizzled."""
    x = lean3_input(R, K, dtype, 5 * R + 3 * K)
    qr = ops.nvfp4_quantize(x, backend="reference")
    mbits = ref.guidance_from_quantized(qr, "compact").payload
    qsr = ops.nvfp4_quantize(x, swizzle=True, backend="reference")
    _set_impl(monkeypatch, VARIANT)
    lin, cap, mb, swz = quantize_all(x)
    what = f"{VARIANT} {R}x{K} {dtype}"
    assert_same_q(lin, qr, f"{what} linear")
    assert_same_q(cap, qr, f"{what} capture")
    assert torch.equal(mb, mbits), f"{what}: capture mbits"
    assert_same_q(swz, qsr, f"{what} swizzled")


def scale_edge_input(K: int, e_lo: float, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows whose g = 2^e (e from e_lo to 116 by quarter binades) with every block 2^-0 .. 2^-24 below its row's
    amax, then 8 rows of exact ties at t = 1 (g = 1 from a 2688 lead, blocks led by 6), as dtype."""
    e = torch.arange(e_lo, 116.0, 0.25, device=DEV, dtype=torch.float64)
    R = e.numel()
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(R, K, generator=gen, device=DEV, dtype=torch.float64)
    x = x / x.abs().amax(dim=1, keepdim=True) * torch.exp2(e)[:, None] * 2688.0
    x = x.reshape(R, K // 16, 16) * torch.exp2(-torch.randint(0, 25, (R, K // 16, 1), generator=gen, device=DEV))
    x = x.reshape(R, K).float().to(dtype)
    ties = torch.tensor(TIES, device=DEV).repeat(K // len(TIES) + 1)[:K].reshape(1, K).repeat(8, 1)
    ties = ties * torch.where(torch.rand(8, K, generator=gen, device=DEV) < 0.5, -1.0, 1.0)
    ties[:, ::16] = 6.0
    ties[:, 0] = 2688.0
    return torch.cat([x, ties.to(dtype)])


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_rowg_lean3_scale_edges(monkeypatch, dtype):
    """Rows whose g sweeps every binade from 2^-140 to 2^116 in steps of a quarter binade (g below / above the 1/g
    range [2^-50, 2^50], amax below 2^-80 where g is a true division, block divisors t below 2^-100 and above 2^100,
    t = 0 from a block 2^-24 below its row), and rows of exact ties at t = 1: the previous default, the variant and the reference agree."""
    x = scale_edge_input(4096, -140.0, 3, dtype)
    _set_impl(monkeypatch, PREVIOUS)
    want = quantize_all(x)
    _set_impl(monkeypatch, VARIANT)
    got = quantize_all(x)
    assert_same_all(got, want, f"{VARIANT} scale edges {dtype}")
    assert_same_q(got[0], ops.nvfp4_quantize(x, backend="reference"), f"{VARIANT} scale edges {dtype} vs reference")


def test_rowg_lean3_changes_nothing_else(monkeypatch):
    """The switch changes only RTN quantize with g None (and RTN fake quantization:
    tests/gpu/test_quant_fake_lean3_gpu.py): SR, guided, g given quantization give the previous default's outputs
    (its kernels) under =rowg-lean3, and fake quantization at K 2048 its bits. (g given through lean3 is its own
    switch, off here: tests/gpu/test_quant_given_lean3_gpu.py.)"""
    monkeypatch.setenv("TRACE_EXT_QUANT_GIVEN_LEAN3", "0")
    gen = torch.Generator(device=DEV).manual_seed(11)
    x = torch.randn(333, 2048, generator=gen, device=DEV).to(torch.bfloat16)
    rec = ref.guidance_from_quantized(ref.nvfp4_quantize((x.float() * 1.001).to(torch.bfloat16)), "full")
    g = ref.nvfp4_global_scale(x, "row").contiguous()
    calls = (lambda: ops.nvfp4_quantize(x, g, backend="cuda"),
             lambda: ops.nvfp4_quantize(x, g, swizzle=True, backend="cuda"),
             lambda: ops.nvfp4_quantize(x, rounding="sr", seed=3, offset=1, backend="cuda"),
             lambda: ops.nvfp4_quantize(x, rounding="guided", guidance=rec, backend="cuda"))
    for i, call in enumerate(calls):
        _set_impl(monkeypatch, PREVIOUS)
        a = call()
        _set_impl(monkeypatch, VARIANT)
        assert_same_q(call(), a, f"call {i}")
        assert not any(KERNEL in n for n in launched(call)), f"call {i} ran {KERNEL}"
    _set_impl(monkeypatch, PREVIOUS)
    fa = ops.nvfp4_fake_quantize(x, backend="cuda")
    _set_impl(monkeypatch, VARIANT)
    assert torch.equal(ops.nvfp4_fake_quantize(x, backend="cuda").view(torch.int16), fa.view(torch.int16))


def test_rowg_lean3_activations(monkeypatch):
    """Model-shaped activations (Qwen3-30B-A3B hidden 2048 at 4099 tokens, DeepSeek-V3 hidden 7168 at 601 tokens,
    K 4096 at 8191 tokens; bf16, randn with per-token scales): the variant equals the previous default, all three outputs."""
    gen = torch.Generator(device=DEV).manual_seed(29)
    for R, K in ((4099, 2048), (601, 7168), (8191, 4096)):
        x = torch.randn(R, K, generator=gen, device=DEV) * torch.exp2(torch.randn(R, 1, generator=gen, device=DEV) * 4)
        x = x.to(torch.bfloat16)
        _set_impl(monkeypatch, PREVIOUS)
        want = quantize_all(x)
        _set_impl(monkeypatch, VARIANT)
        assert_same_all(quantize_all(x), want, f"{VARIANT} activations {R}x{K}")
