"""NVFP4 quantize element code, every variant: the lean kernel with RTN by the power-of-two magic add (default, also
=lean; its grid-stride row walk is tested on its own below), the scaled-domain code with RTN saturated after packing
(=rtn-sat, the previous default), the previous SR / guided code (=bits) and RTN saturated per element (=rtn-fminf),
all selected by TRACE_EXT_QUANT_IMPL, read per call, bit for
bit against the reference on values dense around every E2M1 grid point and rounding threshold, with every rollout
payload (guided), threshold-adjacent SR draws from many seeds, and saturating quotients (RTN). Blocks are built so
that the divisor t is exactly 1 (rollout scale byte 0x38 with g = 1; or a leading +-6 with g = 1 for RTN / SR), so
v = x and the values hit the thresholds exactly.
Run: pytest tests/gpu/test_quant_impl_gpu.py -q   (on the H200, with the extension built)
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from trace_ext import ops
from trace_ext import reference as ref
from trace_ext.tensor import GuidanceRecord

pytestmark = pytest.mark.gpu

DEV = "cuda"
GRID = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@pytest.fixture(params=("default", "bits", "rtn-fminf", "rtn-sat", "lean", "rowg-lean", "rowg-lean2", "guided-lean",
                        "sr-lean", "sr-row"))
def impl(request, monkeypatch):
    if request.param == "default":
        monkeypatch.delenv("TRACE_EXT_QUANT_IMPL", raising=False)
    else:
        monkeypatch.setenv("TRACE_EXT_QUANT_IMPL", request.param)
    return request.param


def _set_impl(monkeypatch, variant):
    """TRACE_EXT_QUANT_IMPL=variant (None: unset, the default)."""
    if variant is None:
        monkeypatch.delenv("TRACE_EXT_QUANT_IMPL", raising=False)
    else:
        monkeypatch.setenv("TRACE_EXT_QUANT_IMPL", variant)


def dense_magnitudes(ulps: int, top: float = 6.0, extra=()) -> np.ndarray:
    """Every float32 within `ulps` of each grid point, tie and binade edge (<= top), plus 0."""
    centers = [c for c in GRID + TIES + (0.125, 0.0625) if c <= top] + list(extra)
    out = [np.zeros(1, dtype=np.float32)]
    for c in centers:
        b = int(np.array([c], dtype=np.float32).view(np.uint32)[0])
        out.append(np.arange(b - ulps, b + ulps + 1, dtype=np.uint32).view(np.float32))
    v = np.concatenate(out)
    return v[v <= top]


def blocks_led_by_six(mags: np.ndarray, seed: int) -> torch.Tensor:
    """Rows of 16-element blocks, element 0 = +-6 (so s = 1 and t = 1 with g = 1), the others +-mags."""
    rng = np.random.default_rng(seed)
    mags = mags[rng.permutation(mags.size)]
    mags = np.concatenate([mags, np.zeros((-mags.size) % 15, dtype=np.float32)]).reshape(-1, 15)
    lead = np.full((mags.shape[0], 1), 6.0, dtype=np.float32)
    b = np.concatenate([lead, mags], axis=1)
    b = np.where(rng.integers(0, 2, b.shape) > 0, -b, b).astype(np.float32)
    b = np.concatenate([b, np.zeros(((-b.shape[0]) % 64, 16), dtype=np.float32)])  # 64 blocks per row
    return torch.from_numpy(b.reshape(-1, 1024)).to(DEV)


def assert_codes(qc, qr, what):
    assert torch.equal(qc.codes, qr.codes), f"{what}: {int((qc.codes != qr.codes).sum())} code bytes differ"
    assert torch.equal(qc.scales, qr.scales), f"{what}: scales differ"


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_rtn_dense_thresholds_and_saturation(impl, dtype):
    x = blocks_led_by_six(dense_magnitudes(512), 0).to(dtype)
    one = torch.ones(1, device=DEV)
    assert_codes(ops.nvfp4_quantize(x, one, backend="cuda"), ops.nvfp4_quantize(x, one, backend="reference"),
                 f"rtn {impl} {dtype}")
    # tiny g: the scale byte saturates at 448 and quotients reach ~2^40 (fp16 overflow of u; saturation)
    for gv in (2.0**-20, 2.0**-40):
        g = torch.tensor([gv], device=DEV)
        xs = (x.float() * torch.exp2(torch.randint(-8, 8, x.shape, device=DEV).float())).to(dtype)
        assert_codes(ops.nvfp4_quantize(xs, g, backend="cuda"), ops.nvfp4_quantize(xs, g, backend="reference"),
                     f"rtn sat {impl} {dtype} g={gv}")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_sr_dense_thresholds_many_seeds(impl, dtype):
    x = blocks_led_by_six(dense_magnitudes(256), 1).to(dtype)
    one = torch.ones(1, device=DEV)
    for seed, offset in ((0, 0), (7, 3), (2**40 + 1, 2**33), (123456789, 1)):
        kw = {"rounding": "sr", "seed": seed, "offset": offset}
        assert_codes(ops.nvfp4_quantize(x, one, backend="cuda", **kw),
                     ops.nvfp4_quantize(x, one, backend="reference", **kw), f"sr {impl} {dtype} {seed}")


def guided_inputs(kind: str, dtype):
    """x = every dense value (both signs, above 6 too) with every payload, t = 1 through the rollout's record."""
    mags = dense_magnitudes(256, top=1e30, extra=(8.0, 12.0, 2.0**-99, 2.0**-100, 1e30))
    n_pay = 2 if kind == "compact" else 16
    v = np.repeat(np.concatenate([mags, -mags]), n_pay)
    pay = np.tile(np.arange(n_pay), 2 * mags.size)
    perm = np.random.default_rng(2).permutation(v.size)
    v, pay = v[perm], pay[perm]
    pad = (-v.size) % 1024
    v = np.concatenate([v, np.zeros(pad, dtype=np.float32)]).reshape(-1, 1024)
    pay = np.concatenate([pay, np.zeros(pad, dtype=pay.dtype)]).reshape(-1, 1024)
    R, K = v.shape
    p = torch.from_numpy(pay).to(DEV)
    if kind == "compact":
        payload = ref.pack_mantissa_bits(p)
    else:
        payload = (p[:, 0::2] | (p[:, 1::2] << 4)).to(torch.uint8)
    rec = GuidanceRecord(kind=kind, payload=payload.contiguous(),
                         scales=torch.full((R, K // 16), 0x38, dtype=torch.uint8, device=DEV),
                         g=torch.ones(R, device=DEV))
    return torch.from_numpy(v).to(DEV).to(dtype), rec


@pytest.mark.parametrize("kind", ("compact", "full"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_guided_every_payload_dense_values(impl, kind, dtype):
    x, rec = guided_inputs(kind, dtype)
    kw = {"rounding": "guided", "guidance": rec}
    assert_codes(ops.nvfp4_quantize(x, backend="cuda", **kw), ops.nvfp4_quantize(x, backend="reference", **kw),
                 f"guided {kind} {impl} {dtype}")


def test_impls_agree_on_random_activations(monkeypatch):
    """The variants give identical codes on random activations in every mode (the A/B is fair)."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(64, 4096, generator=gen, device=DEV).to(torch.bfloat16)
    rec = {k: ref.guidance_from_quantized(ref.nvfp4_quantize((x.float() * 1.001).to(torch.bfloat16)), k)
           for k in ("compact", "full")}
    cases = [{}, {"rounding": "sr", "seed": 9, "offset": 4}]
    cases += [{"rounding": "guided", "guidance": r} for r in rec.values()]
    for kw in cases:
        monkeypatch.delenv("TRACE_EXT_QUANT_IMPL", raising=False)
        a = ops.nvfp4_quantize(x, backend="cuda", **kw)
        for variant in ("bits", "rtn-fminf", "rtn-sat", "lean", "rowg-lean", "rowg-lean2", "guided-lean", "sr-lean",
                        "sr-row", "rowg-lean3"):
            monkeypatch.setenv("TRACE_EXT_QUANT_IMPL", variant)
            b = ops.nvfp4_quantize(x, backend="cuda", **kw)
            assert torch.equal(a.codes, b.codes), (variant, list(kw))


# ---- TRACE_EXT_QUANT_IMPL=lean: the lean kernel's 32-bit block walk (row / column stepped by the grid stride) -------
# Shapes with more tiles than the GPU holds warps (so warps step over several tiles), block counts per row below 32
# (several carry steps per lane), not dividing the grid stride, and rows past the fused limit (two-pass path: the
# lean kernel reads the per-row g of pass 1). Every row gets its own g (a row mix-up changes the codes) and the
# blocks span many binades.

LEAN_SHAPES = ((40000, 368), (1000, 16016), (3, 16496), (70001, 208))


def lean_input(R, K, dtype, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(R, K, generator=gen, device=DEV)
    x = x * torch.exp2(torch.randint(-20, 20, (R, 1), generator=gen, device=DEV).float())
    x = x * torch.exp2(torch.randint(-6, 6, (R, K // 16, 1), generator=gen, device=DEV).float()).repeat_interleave(
        16, dim=1).reshape(R, K)
    return x.to(dtype)


def assert_same(a, b, what):
    assert torch.equal(a.codes, b.codes), f"{what}: {int((a.codes != b.codes).sum())} code bytes differ"
    assert torch.equal(a.scales, b.scales), f"{what}: scales differ"
    assert torch.equal(a.g, b.g), f"{what}: g differs"


@pytest.mark.parametrize("R,K", LEAN_SHAPES)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_lean_walk_against_reference(monkeypatch, R, K, dtype):
    monkeypatch.setenv("TRACE_EXT_QUANT_IMPL", "lean")
    x = lean_input(R, K, dtype, R + K)
    g_rows = ref.nvfp4_global_scale(x, "row").contiguous() * 1.37  # not the fused g: the given g path
    for what, kw in (("rtn fused g", {}), ("rtn g per row", {"g": g_rows}),
                     ("rtn one g", {"g": torch.tensor([float(g_rows.max())], device=DEV)})):
        g = kw.get("g")
        assert_same(ops.nvfp4_quantize(x, g, backend="cuda"), ops.nvfp4_quantize(x, g, backend="reference"),
                    f"lean {what} {R}x{K} {dtype}")
    x_train = (x.float() * (1 + 1e-3 * torch.randn(R, K, device=DEV))).to(dtype)
    q = ops.nvfp4_quantize(x, backend="reference")
    for kind in ("compact", "full"):
        kw = {"rounding": "guided", "guidance": ref.guidance_from_quantized(q, kind)}
        assert_same(ops.nvfp4_quantize(x_train, backend="cuda", **kw),
                    ops.nvfp4_quantize(x_train, backend="reference", **kw), f"lean guided {kind} {R}x{K} {dtype}")


@pytest.mark.parametrize("R,K", LEAN_SHAPES[:2])
def test_lean_capture_and_swizzle_match_rtn_sat(monkeypatch, R, K):
    """capture (mbits from the lean kernel), swizzle (per-row kernel with the lean RTN) and fake quantization (flat /
    per-row kernels with the lean RTN, bf16 out), per-row g fused and given, equal the previous default (rtn-sat)."""
    x = lean_input(R, K, torch.bfloat16, 3)
    g_rows = ref.nvfp4_global_scale(x, "row").contiguous() * 0.71
    out = {}
    for variant in ("rtn-sat", "lean"):
        monkeypatch.setenv("TRACE_EXT_QUANT_IMPL", variant)
        out[variant] = (ops.nvfp4_quantize(x, capture=True, backend="cuda"),
                        ops.nvfp4_quantize(x, swizzle=True, backend="cuda"),
                        ops.nvfp4_fake_quantize(x, backend="cuda"),
                        ops.nvfp4_fake_quantize(x, g_rows, backend="cuda"),
                        ops.nvfp4_quantize(x, g_rows, swizzle=True, backend="cuda"))
    (qa, reca), qsa, fa, fga, qsga = out["rtn-sat"]
    (qb, recb), qsb, fb, fgb, qsgb = out["lean"]
    assert_same(qa, qb, "capture codes")
    assert torch.equal(reca.payload, recb.payload), "capture mbits"
    assert_same(qsa, qsb, "swizzled")
    assert_same(qsga, qsgb, "swizzled, g given (flat kernel)")
    assert torch.equal(fa.view(torch.int16), fb.view(torch.int16)), "fake quant, fused g"
    assert torch.equal(fga.view(torch.int16), fgb.view(torch.int16)), "fake quant, g given"


# ---- TRACE_EXT_QUANT_IMPL=rowg-lean: the persistent per-row-g kernel (two rows in flight per team) ----------------
# Shapes cover every team size and both blocks-per-lane cases (kb <= 256: one block per lane, team = kb rounded up to a
# power of two, several rows per CTA below 256; 256 < kb <= 512: two, 16-bit inputs only), block counts that are not
# powers of two (lanes past the row), more row groups than CTAs (the grid-stride walk and the prefetch of the next row,
# uneven last iteration), and the fallbacks (fp32 with kb > 256, kb > 512, K > 16384: the default's kernels). Rows get
# amaxes 2^-20 .. 2^20 apart (a wrong row's g changes the codes); some rows carry NaN / +-Inf blocks or are all zero /
# all non-finite (g = 1).

ROWG_SHAPES = ((70001, 208), (4099, 16), (3000, 48), (2053, 368), (1000, 1024), (1500, 4096), (700, 4112),
               (600, 7168), (300, 8192), (200, 8208), (130, 12304), (65, 16384), (7, 16400))


def rowg_input(R, K, dtype, seed):
    x = lean_input(R, K, torch.float32, seed)
    if dtype == torch.float16:
        x = x.clamp(-60000.0, 60000.0)  # keep fp16 rows finite (the injected NaN / Inf below are the non-finite cases)
    gen = torch.Generator(device=DEV).manual_seed(seed + 1)
    n = max(1, R // 97)
    rows = torch.randint(0, R, (n,), generator=gen, device=DEV)
    cols = torch.randint(0, K, (n,), generator=gen, device=DEV)
    vals = torch.tensor((float("nan"), float("inf"), float("-inf")), device=DEV)
    x[rows, cols] = vals[torch.arange(n, device=DEV) % 3]
    x[(rows[: max(1, n // 4)] + 1) % R] = 0.0  # zero rows (g = 1)
    if R > 2:
        x[R - 2] = float("inf")  # a row with no finite value (g = 1, every block NaN)
    return x.to(dtype)


@pytest.mark.parametrize("R,K", ROWG_SHAPES)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_rowg_lean_against_reference(monkeypatch, R, K, dtype):
    """codes, scales, g (linear), capture mbits and swizzled scales of =rowg-lean and =rowg-lean2 (two blocks per
    lane for every K of 16-bit x) equal the reference's."""
    x = rowg_input(R, K, dtype, R + 3 * K)
    qr = ops.nvfp4_quantize(x, backend="reference")
    mbits = ref.guidance_from_quantized(qr, "compact").payload
    qsr = ops.nvfp4_quantize(x, swizzle=True, backend="reference")
    for variant in ("rowg-lean", "rowg-lean2"):
        monkeypatch.setenv("TRACE_EXT_QUANT_IMPL", variant)
        what = f"{variant} {R}x{K} {dtype}"
        assert_same(ops.nvfp4_quantize(x, backend="cuda"), qr, what)
        qc, recc = ops.nvfp4_quantize(x, capture=True, backend="cuda")
        assert_same(qc, qr, f"{what} capture")
        assert torch.equal(recc.payload, mbits), f"{what} capture mbits"
        assert_same(ops.nvfp4_quantize(x, swizzle=True, backend="cuda"), qsr, f"{what} swizzled")


def test_rowg_lean_matches_default_everywhere_else(monkeypatch):
    """=rowg-lean and the default (rowg-lean2) change only RTN quantize with g None: SR, guided, g given and fake
    quantization give the outputs of =lean (the previous default; same kernels), and the per-row path equals lean's
    bit for bit on random activations."""
    gen = torch.Generator(device=DEV).manual_seed(11)
    x = torch.randn(333, 2048, generator=gen, device=DEV).to(torch.bfloat16)
    rec = ref.guidance_from_quantized(ref.nvfp4_quantize((x.float() * 1.001).to(torch.bfloat16)), "full")
    g = ref.nvfp4_global_scale(x, "row").contiguous()
    calls = (lambda: ops.nvfp4_quantize(x, backend="cuda"),
             lambda: ops.nvfp4_quantize(x, swizzle=True, backend="cuda"),
             lambda: ops.nvfp4_quantize(x, g, backend="cuda"),
             lambda: ops.nvfp4_quantize(x, rounding="sr", seed=3, offset=1, backend="cuda"),
             lambda: ops.nvfp4_quantize(x, rounding="guided", guidance=rec, backend="cuda"))
    for i, call in enumerate(calls):
        monkeypatch.setenv("TRACE_EXT_QUANT_IMPL", "lean")
        a = call()
        for variant in ("rowg-lean", None):
            _set_impl(monkeypatch, variant)
            assert_same(call(), a, f"call {i} {variant or 'default'}")
    monkeypatch.setenv("TRACE_EXT_QUANT_IMPL", "lean")
    fa = ops.nvfp4_fake_quantize(x, backend="cuda")
    for variant in ("rowg-lean", None):
        _set_impl(monkeypatch, variant)
        assert torch.equal(ops.nvfp4_fake_quantize(x, backend="cuda").view(torch.int16), fa.view(torch.int16))


# ---- SR's lean element code (the default; TRACE_EXT_QUANT_IMPL=guided-lean keeps the previous one) -------------------
# The dense-threshold SR test above runs it too (impl fixture). Here: magnitudes over every binade down to 2^-100 (the
# small-value range, where the SR probability is not a whole multiple of 2^-24, and the fast path's lower edge), the
# per-row and g-given kernels, fake quantization, and MXFP4 (which takes the same routine with t = 2^e).


def sr_tiny_input(R, K, dtype, seed):
    """Rows of blocks led by +-6 (t = 1 with g = 1) or by a random magnitude, the other elements log-uniform in
    [2^-110, 8) with random signs, zeros and exact grid / tie values mixed in."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    mag = torch.exp2(torch.rand(R, K, generator=gen, device=DEV) * 113.0 - 110.0)
    pick = torch.randint(0, 16, (R, K), generator=gen, device=DEV)
    grid = torch.tensor(GRID + TIES, device=DEV)
    mag = torch.where(pick == 0, grid[torch.randint(0, len(grid), (R, K), generator=gen, device=DEV)], mag)
    mag = torch.where(pick == 1, torch.zeros_like(mag), mag)
    sign = torch.where(torch.rand(R, K, generator=gen, device=DEV) < 0.5, -1.0, 1.0)
    x = (mag * sign).reshape(R, K // 16, 16)
    lead = torch.rand(R, K // 16, generator=gen, device=DEV) < 0.5
    x[:, :, 0] = torch.where(lead, torch.full_like(x[:, :, 0], 6.0), x[:, :, 0])
    return x.reshape(R, K).to(dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_sr_lean_tiny_magnitudes(monkeypatch, dtype):
    """SR's lean element code (the default, also =sr-lean by name) equals the reference on magnitudes down to 2^-110
    (fast path and its fallback), g given (t = 1 on the blocks led by 6) and per row, quantize and fake
    quantize, several seeds / offsets."""
    x = sr_tiny_input(512, 1024, dtype, 3)
    one = torch.ones(1, device=DEV)
    monkeypatch.setenv("TRACE_EXT_QUANT_IMPL", "sr-lean")
    for seed, offset in ((0, 0), (5, 2**35 + 1), (2**50 + 7, 9)):
        kw = {"rounding": "sr", "seed": seed, "offset": offset}
        for g in (one, None):
            what = f"sr-lean {dtype} seed {seed} g {'1' if g is not None else 'row'}"
            assert_codes(ops.nvfp4_quantize(x, g, backend="cuda", **kw),
                         ops.nvfp4_quantize(x, g, backend="reference", **kw), what)
        fc = ops.nvfp4_fake_quantize(x, backend="cuda", **kw)
        fr = ops.nvfp4_fake_quantize(x, backend="reference", **kw)
        assert torch.equal(torch.nan_to_num(fc.float(), nan=7.0), torch.nan_to_num(fr.float(), nan=7.0)), f"fake {seed}"


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("scale_rounding", ("floor", "ceil"))
def test_sr_lean_mxfp4_against_reference(monkeypatch, dtype, scale_rounding):
    """MXFP4 SR with the lean element code (the default) and the per-element code (=guided-lean) equals the reference:
    blocks scaled by 2^-126 .. 2^126 (scale exponents in and out of the fast path's [-100, 100]), tiny elements
    (the fallback), grid values and ties (t = 2^e exactly), NaN / Inf blocks, several seeds."""
    gen = torch.Generator(device=DEV).manual_seed(8)
    R, K = 600, 1024
    x = sr_tiny_input(R, K, torch.float32, 4).reshape(R, K // 32, 32)
    x = x * torch.exp2(torch.randint(-126, 120, (R, K // 32, 1), generator=gen, device=DEV).float())
    x = x.reshape(R, K)
    x[3, 5] = float("nan")
    x[7, 100] = float("inf")
    x = x.to(dtype)
    for seed, offset in ((0, 0), (11, 2**34 + 3)):
        kw = {"rounding": "sr", "seed": seed, "offset": offset, "scale_rounding": scale_rounding}
        mr = ops.mxfp4_quantize(x, backend="reference", **kw)
        for variant in ("guided-lean", None, "sr-lean"):  # the per-element code, the default (lean), lean by name
            _set_impl(monkeypatch, variant)
            assert_codes(ops.mxfp4_quantize(x, backend="cuda", **kw), mr, f"mxfp4 sr {variant} {dtype} {seed}")
# ---- SR quantize with g None through the persistent per-row-g kernel (the default; also =sr-row by name) ---------
# The same shapes and inputs as rowg-lean (every team size, one / two blocks per lane, the grid-stride walk, NaN / Inf
# blocks, zero rows, a row with no finite value, the fallbacks), SR with seeds / offsets whose high words are nonzero
# (the Philox key and counter words beyond 32 bits), linear and swizzled scales and capture.


@pytest.mark.parametrize("R,K", ROWG_SHAPES)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_sr_row_against_reference(monkeypatch, R, K, dtype):
    """codes, scales, g, capture mbits and swizzled scales of SR through the default (the persistent per-row kernel),
    =sr-row and =sr-lean (the previous per-row kernel) equal the reference's."""
    x = rowg_input(R, K, dtype, 5 * R + K)
    seed, offset = 0x1234_5678_9ABC + R, (K << 33) + 7
    qr = ops.nvfp4_quantize(x, rounding="sr", seed=seed, offset=offset, backend="reference")
    mbits = ref.guidance_from_quantized(qr, "compact").payload
    qsr = ops.nvfp4_quantize(x, rounding="sr", seed=seed, offset=offset, swizzle=True, backend="reference")
    for variant in (None, "sr-row", "sr-lean"):
        _set_impl(monkeypatch, variant)
        what = f"{variant or 'default'} {R}x{K} {dtype}"
        assert_same(ops.nvfp4_quantize(x, rounding="sr", seed=seed, offset=offset, backend="cuda"), qr, what)
        qc, recc = ops.nvfp4_quantize(x, rounding="sr", seed=seed, offset=offset, capture=True, backend="cuda")
        assert_same(qc, qr, f"{what} capture")
        assert torch.equal(recc.payload, mbits), f"{what} capture mbits"
        assert_same(ops.nvfp4_quantize(x, rounding="sr", seed=seed, offset=offset, swizzle=True, backend="cuda"), qsr,
                    f"{what} swizzled")


def test_sr_row_matches_default_on_activations(monkeypatch):
    """On random activations (2^22 elements, bf16) =sr-row, =sr-lean and =guided-lean (the previous SR element code)
    give the default's SR codes bit for bit, for several (seed, offset) pairs; RTN is unchanged by the switch."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    x = (torch.randn(1024, 4096, generator=gen, device=DEV) * 3.0).to(torch.bfloat16)
    for seed, offset in ((0, 0), (7, 1), (2**40 + 3, 2**35 + 5)):
        _set_impl(monkeypatch, None)
        a = ops.nvfp4_quantize(x, rounding="sr", seed=seed, offset=offset, backend="cuda")
        for variant in ("sr-row", "sr-lean", "guided-lean"):
            _set_impl(monkeypatch, variant)
            assert_same(ops.nvfp4_quantize(x, rounding="sr", seed=seed, offset=offset, backend="cuda"), a,
                        f"{variant} seed {seed} offset {offset}")
    _set_impl(monkeypatch, None)
    b = ops.nvfp4_quantize(x, backend="cuda")
    _set_impl(monkeypatch, "guided-lean")
    assert_same(ops.nvfp4_quantize(x, backend="cuda"), b, "rtn under guided-lean")
