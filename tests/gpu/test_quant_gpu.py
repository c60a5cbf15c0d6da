"""CUDA quantization kernels (csrc/quant_nvfp4.cu, csrc/quant_mxfp4.cu) against the reference (SPEC 2-6).

Every kernel output is compared bit for bit with python/trace_ext/reference.py run on the same CUDA tensors
(the reference is device-agnostic torch; one test holds its GPU run against its CPU run). Inputs: random
activations of real model widths plus adversarial blocks (exact ties at every E2M1 threshold, subnormal block
scales, zero / NaN / Inf blocks, huge values, mixed signs and -0.0).
Run: pytest tests/gpu/test_quant_gpu.py -q   (on the H200, with the extension built)
"""
from __future__ import annotations

import pytest
import torch

from trace_ext import formats as F
from trace_ext import ops
from trace_ext import reference as ref
from trace_ext.tensor import GuidanceRecord, MXFP4Tensor, NVFP4Tensor

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (rows, K): one token, odd row counts, Qwen3-30B-A3B moe I 768 / hidden 2048, DeepSeek-V3 hidden 7168,
# K/16 odd (16, 80), and a row longer than the on-chip limit (the two-pass per-row-g path).
SHAPES = ((1, 768), (7, 2048), (33, 7168), (130, 80), (5, 16), (3, 32768))
BIG = (4096, 16384)  # 2^26 elements


# ---- helpers ---------------------------------------------------------------------------------------------------


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit equality (floats compared by bit pattern, NaN positions must agree)."""
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    if a.is_floating_point():
        na, nb = torch.isnan(a), torch.isnan(b)
        assert torch.equal(na, nb), f"{what}: NaN positions differ ({int((na != nb).sum())} elements)"
        ib = {2: torch.int16, 4: torch.int32}[a.element_size()]
        a = torch.where(na, torch.zeros_like(a), a).view(ib)
        b = torch.where(nb, torch.zeros_like(b), b).view(ib)
    bad = a != b
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} of {a.numel()} differ; first at {idx}: {a[tuple(idx)]} vs {b[tuple(idx)]}")


def random_x(shape, dtype, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(shape, generator=gen, device=DEV, dtype=torch.float32)
    # outlier channels and a spread of row magnitudes, as in real activations
    x = x * torch.exp2(torch.randint(-6, 6, (shape[0], 1), generator=gen, device=DEV).float())
    x[..., ::97] *= 40.0
    return x.to(dtype)


def adversarial_x(dtype, rows=8, K=512):
    """Rows of named edge-case blocks (each 16 elements); used with g = 1 so v = x / s exactly."""
    blocks = []
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    # block amax 6 -> d = 1, s = 1.0, t = 1: every element lands exactly on a tie or the grid
    blocks.append(ties + [6.0] + [-t for t in ties] + [-6.0])
    blocks.append(grid + [-g for g in grid])
    eps = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-23}[dtype]
    # just above / below each tie (one ulp of the input format)
    blocks.append([t * (1 + eps) for t in ties] + [6.0] + [t * (1 - eps / 2) for t in ties] + [-6.0])
    blocks.append([1e-3 * (i - 7.5) for i in range(16)])  # subnormal E4M3 block scale
    blocks.append([3e-6 * (i - 7.5) for i in range(16)])  # block scale rounds to 0 -> t = 0
    blocks.append([0.0] * 16)  # zero block
    blocks.append([-0.0] * 8 + [0.0] * 8)  # signed zeros
    blocks.append([float("nan")] + [1.0] * 15)  # NaN block
    blocks.append([2.0] * 15 + [float("inf")])  # Inf block
    blocks.append([-float("inf")] + [0.5] * 15)
    big = {torch.bfloat16: 3.0e38, torch.float16: 60000.0, torch.float32: 3.0e38}[dtype]
    blocks.append([big * ((-1) ** i) / (i + 1) for i in range(16)])  # huge values: s saturates at 448
    blocks.append([(-1) ** i * 2.0 ** (-i) for i in range(16)])  # mixed signs, spread exponents
    # quotients far below 2^-100 next to a large element (the kernels' exact-division fallback)
    blocks.append([1e3, 1e-38, -1e-40, 1e-45, -3e-39, 2.0**-120, 0.0, -0.0] + [1e-30 * i for i in range(8)])
    n_blocks = rows * K // 16
    gen = torch.Generator().manual_seed(1)
    out = torch.randn(n_blocks, 16, generator=gen)
    for i in range(n_blocks):
        if i % 3 == 0:
            out[i] = torch.tensor(blocks[(i // 3) % len(blocks)])
    return out.reshape(rows, K).to(dtype).to(DEV)


def ref_q(x, g=None, **kw):
    return ops.nvfp4_quantize(x, g, backend="reference", **kw)


def cuda_q(x, g=None, **kw):
    return ops.nvfp4_quantize(x, g, backend="cuda", **kw)


def assert_q_equal(qc: NVFP4Tensor, qr: NVFP4Tensor, what: str) -> None:
    assert_same(qc.codes, qr.codes, f"{what} codes")
    assert_same(qc.scales, qr.scales, f"{what} scales")
    assert_same(qc.g.reshape(-1), qr.g.reshape(-1).float(), f"{what} g")


def poison_allocator(nbytes=1 << 26):
    """Fill recently freed device memory with 0xFF so that unwritten outputs (swizzle padding) show up."""
    t = torch.full((nbytes,), 255, dtype=torch.uint8, device=DEV)
    del t


# ---- the oracle itself ---------------------------------------------------------------------------------------


def test_reference_on_gpu_equals_reference_on_cpu():
    """Protects the test method: the reference gives the same bits on CUDA tensors as on CPU."""
    x = adversarial_x(torch.bfloat16, rows=4, K=256)
    for kw in ({}, {"rounding": "sr", "seed": 3, "offset": 5}):
        qg = ref.nvfp4_quantize(x, **kw)
        qc = ref.nvfp4_quantize(x.cpu(), **kw)
        assert_q_equal(qg.to("cpu"), qc, f"reference gpu vs cpu {kw}")
    mg = ref.mxfp4_quantize(x, rounding="sr", seed=9)
    mc = ref.mxfp4_quantize(x.cpu(), rounding="sr", seed=9)
    assert_same(mg.codes.cpu(), mc.codes, "mx codes gpu vs cpu")
    assert_same(mg.scales.cpu(), mc.scales, "mx scales gpu vs cpu")


# ---- NVFP4 quantize ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_nvfp4_rtn_per_row_g_in_kernel(shape, dtype):
    """RTN with the per-row g computed inside the kernel (fused path; two-pass for K > 16384)."""
    x = random_x(shape, dtype)
    assert_q_equal(cuda_q(x), ref_q(x), f"rtn {shape} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_adversarial_blocks(dtype):
    """Ties at every threshold, subnormal / zero scales, NaN / Inf blocks, huge values, -0.0; g = 1 and per row."""
    x = adversarial_x(dtype)
    one = torch.ones(1, device=DEV)
    for g in (one, None):
        for kw in ({}, {"rounding": "sr", "seed": 11, "offset": 0}):
            assert_q_equal(cuda_q(x, g, **kw), ref_q(x, g, **kw), f"adversarial {dtype} g={g is not None} {kw}")
    # decode scales that push t = s * g outside the range of the kernels' reciprocal shortcut
    for gv in (1e-36, 3e-30, 1e30, 2.0**110):
        gt = torch.tensor([gv], device=DEV)
        for kw in ({}, {"rounding": "sr", "seed": 2, "offset": 3}):
            assert_q_equal(cuda_q(x, gt, **kw), ref_q(x, gt, **kw), f"adversarial {dtype} g={gv} {kw}")
    # ties really hit: block 0 of row 0 holds the thresholds exactly
    q = cuda_q(x, one)
    assert q.scales[0, 0].item() == 0x38  # E4M3 1.0


@pytest.mark.parametrize("K", (64, 2048, 32768))
def test_nvfp4_row_g_underflows_to_zero(monkeypatch, K):
    """fp32 rows whose finite amax is below 2688 * 2^-149 (g = fl(A / 2688) = 0, SPEC 2): a block of nonzero
    subnormals gets s_b = e4m3(inf) = 448 and t = 0 (codes 0), an all-zero block s_b = e4m3(0 / 0) = NaN and t = NaN
    (codes 0 as in the reference; the kernels gave code 7 there before round 47). RTN, SR, capture, swizzled and fake
    quantization, per-row kernels (K 64 / 2048) and the long-row two-pass path (K 32768), both TRACE_EXT_QUANT_IMPL
    defaults (sr-row: the previous per-row kernel)."""
    R = 9
    x = torch.zeros(R, K, device=DEV)
    tiny = torch.tensor([1.4e-45, -2.8e-45, 3.36e-44, -1.0e-42], device=DEV)
    for r in range(R - 1):  # rows 0..7 tiny (blocks alternately tiny and all zero), row 8 ordinary
        x[r, 32 * (r % 2): 32 * (r % 2) + 4] = tiny
        x[r, 16 * 3 + 5] = tiny[r % 4]
    x[R - 1] = torch.randn(K, device=DEV)
    for impl in (None, "sr-row"):
        if impl is None:
            monkeypatch.delenv("TRACE_EXT_QUANT_IMPL", raising=False)
        else:
            monkeypatch.setenv("TRACE_EXT_QUANT_IMPL", impl)
        qr = ref_q(x)
        assert float(qr.g[0]) == 0.0  # the edge is really hit
        assert_q_equal(cuda_q(x), qr, f"g = 0 rtn K={K} {impl}")
        kw = {"rounding": "sr", "seed": 5, "offset": 7}
        assert_q_equal(cuda_q(x, **kw), ref_q(x, **kw), f"g = 0 sr K={K} {impl}")
        swz = ops.nvfp4_quantize(x, swizzle=True, backend="cuda")
        assert_same(swz.codes, qr.codes, f"g = 0 swizzled codes K={K} {impl}")
        cq, rec = ops.nvfp4_quantize(x, capture=True, backend="cuda")
        assert_q_equal(cq, qr, f"g = 0 capture K={K} {impl}")
        assert_same(rec.payload, ref.guidance_from_quantized(qr, "compact").payload, f"g = 0 mbits K={K} {impl}")
        fr = ops.nvfp4_fake_quantize(x, backend="reference")
        fc = ops.nvfp4_fake_quantize(x, backend="cuda")
        assert torch.equal(torch.isnan(fc), torch.isnan(fr)), f"g = 0 fake NaNs K={K} {impl}"
        assert torch.equal(torch.nan_to_num(fc), torch.nan_to_num(fr)), f"g = 0 fake K={K} {impl}"
    monkeypatch.delenv("TRACE_EXT_QUANT_IMPL", raising=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_given_g_per_row_tensor_matrix(dtype):
    """g given per row ([R]), as one value ([1]), and by scope='tensor' / 'matrix' (MoE expert weights)."""
    x = random_x((12, 2048), dtype)
    g_row = ref.nvfp4_global_scale(x, "row") * 1.5
    assert_q_equal(cuda_q(x, g_row), ref_q(x, g_row), "g per row")
    g1 = torch.tensor([0.37], device=DEV)
    assert_q_equal(cuda_q(x, g1), ref_q(x, g1), "g [1]")
    assert_q_equal(cuda_q(x, scope="tensor"), ref_q(x, scope="tensor"), "scope tensor")
    w = random_x((4 * 24, 768), dtype).reshape(4, 24, 768)
    assert_q_equal(cuda_q(w, scope="matrix"), ref_q(w, scope="matrix"), "scope matrix")


@pytest.mark.parametrize("shape", ((130, 80), (256, 2048), (1, 16)))
def test_nvfp4_swizzled_scales_equal_to_swizzled_of_linear(shape):
    """Swizzled 128x4 output == formats.to_swizzled(linear), padding zero-filled (poisoned memory before)."""
    x = random_x(shape, torch.bfloat16)
    for g in (None, torch.ones(1, device=DEV)):
        lin = cuda_q(x, g)
        poison_allocator()
        sw = cuda_q(x, g, swizzle=True)
        assert sw.swizzled
        assert_same(sw.codes, lin.codes, "swizzle codes")
        assert_same(sw.scales, F.to_swizzled(lin.scales), f"swizzled scales {shape}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_sr_equals_reference_and_is_deterministic(dtype):
    """SR: same bits as the reference for several (seed, offset), incl. 64-bit ones; reproducible; seed matters."""
    x = random_x((7, 2048), dtype)
    for seed, offset in ((0, 0), (1234, 77), (2**40 + 3, 2**35 + 1)):
        qc = cuda_q(x, rounding="sr", seed=seed, offset=offset)
        assert_q_equal(qc, ref_q(x, rounding="sr", seed=seed, offset=offset), f"sr {seed} {offset}")
        assert_same(cuda_q(x, rounding="sr", seed=seed, offset=offset).codes, qc.codes, "sr determinism")
    a = cuda_q(x, rounding="sr", seed=1).codes
    b = cuda_q(x, rounding="sr", seed=2).codes
    c = cuda_q(x, rounding="sr", seed=1, offset=1).codes
    assert not torch.equal(a, b) and not torch.equal(a, c)


def _rollout_record(x_roll, kind, nan_scales=True):
    q = ref.nvfp4_quantize(x_roll)
    rec = ref.guidance_from_quantized(q, kind)
    if nan_scales:  # a block that was NaN on the rollout side stays NaN
        rec.scales[0, 1] = F.E4M3_NAN
        rec.scales[-1, -1] = F.E4M3_NAN
    return rec


@pytest.mark.parametrize("kind", ("compact", "full"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_guided_with_perturbed_input(kind, dtype):
    """Guided rounding with the rollout's record of a perturbed input (and rollout NaN blocks, NaN in x)."""
    x_roll = random_x((33, 2048), dtype, seed=4)
    x = (x_roll.float() * (1 + 1e-3 * torch.randn_like(x_roll.float()))).to(dtype)
    x[3, 5] = float("nan")
    rec = _rollout_record(x_roll, kind)
    qc = cuda_q(x, rounding="guided", guidance=rec)
    assert_q_equal(qc, ref_q(x, rounding="guided", guidance=rec), f"guided {kind} {dtype}")
    # identical input: the rollout's codes come back on every finite block
    rec2 = _rollout_record(x_roll, kind, nan_scales=False)
    q_same = cuda_q(x_roll, rounding="guided", guidance=rec2)
    assert_same(q_same.codes, ref.nvfp4_quantize(x_roll).codes, "guided on the rollout's own input")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_nvfp4_capture_mbits(dtype):
    """capture=True: the compact record's mantissa bits equal reference.mantissa_bits_of_codes, swizzled or not."""
    x = adversarial_x(dtype, rows=6, K=1024)
    for swizzle in (False, True):
        q, rec = cuda_q(x, capture=True, swizzle=swizzle)
        qr, recr = ref_q(x, capture=True)
        assert_same(rec.payload, ref.mantissa_bits_of_codes(qr.codes), "mbits")
        assert_same(rec.payload, recr.payload, "mbits vs reference record")
        assert_same(rec.scales, recr.scales, "record scales")
        assert_same(rec.g, recr.g, "record g")
    # raw op with a given g and SR
    g = torch.full((6,), 0.01, device=DEV)
    codes, _, _, mbits = torch.ops.trace_ext.nvfp4_quantize(x, g, 1, 5, 6, None, None, None, False, True)
    assert_same(mbits, ref.mantissa_bits_of_codes(codes), "mbits sr")


def test_nvfp4_large_tensors():
    """2^26 elements: fused per-row RTN, SR with given g, guided compact (64-bit indexing of flat blocks)."""
    x = random_x(BIG, torch.bfloat16, seed=7)
    assert_q_equal(cuda_q(x), ref_q(x), "big rtn")
    g = ref.nvfp4_global_scale(x, "row")
    assert_q_equal(cuda_q(x, g, rounding="sr", seed=5, offset=2**33), ref_q(x, g, rounding="sr", seed=5, offset=2**33), "big sr")
    rec = ref.guidance_from_quantized(ref.nvfp4_quantize(x), "compact")
    assert_q_equal(cuda_q(x, rounding="guided", guidance=rec), ref_q(x, rounding="guided", guidance=rec), "big guided")


def test_views_at_unaligned_offsets():
    """Contiguous views starting mid-vector (x, codes, guidance payload) give the same bits (no faulting loads)."""
    R, K = 8, 2048
    x = random_x((1, R * K + 8), torch.bfloat16).reshape(-1)[3 : 3 + R * K].view(R, K)
    assert x.data_ptr() % 16 != 0
    assert_q_equal(cuda_q(x), ref_q(x), "unaligned x")
    mc, mr = ops.mxfp4_quantize(x, backend="cuda"), ops.mxfp4_quantize(x, backend="reference")
    assert_same(mc.codes, mr.codes, "unaligned mx codes")
    q = ref.nvfp4_quantize(x)
    cbuf = torch.zeros(R * K // 2 + 16, dtype=torch.uint8, device=DEV)
    codes = cbuf[5 : 5 + R * K // 2].view(R, K // 2)
    codes.copy_(q.codes)
    y = torch.ops.trace_ext.nvfp4_dequantize(codes, q.scales, q.g, torch.bfloat16)
    assert_same(y, ref.nvfp4_dequantize(q, torch.bfloat16), "unaligned codes")
    rec = ref.guidance_from_quantized(q, "full")
    pbuf = torch.zeros(R * K // 2 + 16, dtype=torch.uint8, device=DEV)
    rec.payload = pbuf[3 : 3 + R * K // 2].view(R, K // 2)
    rec.payload.copy_(q.codes)
    assert_q_equal(cuda_q(x, rounding="guided", guidance=rec), ref_q(x, rounding="guided", guidance=rec), "unaligned payload")


# ---- fake quantize / dequantize -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_fake_quantize(dtype):
    """Fused quantize+dequantize == reference dequantize(quantize(x)) (NaN positions incl.), every mode, with emit."""
    x = adversarial_x(dtype, rows=9, K=2048)
    x_roll = (x.float() * 1.001).to(dtype)
    rec = {k: _rollout_record(x_roll, k) for k in ("compact", "full")}
    cases = [{}, {"rounding": "sr", "seed": 3, "offset": 1}, {"g": torch.tensor([0.5], device=DEV)}]
    cases += [{"rounding": "guided", "guidance": rec["compact"]}, {"rounding": "guided", "guidance": rec["full"]}]
    for kw in cases:
        yc, rc = ops.nvfp4_fake_quantize(x, capture=True, backend="cuda", **kw)
        yr, rr = ops.nvfp4_fake_quantize(x, capture=True, backend="reference", **kw)
        assert_same(yc, yr, f"fake {dtype} {list(kw)}")
        assert_same(rc.payload, rr.payload, "fake mbits")
        assert_same(rc.scales, rr.scales, "fake scales")
        assert_same(rc.g, rr.g, "fake g")
        assert_same(ops.nvfp4_fake_quantize(x, backend="cuda", **kw), yr, "fake without capture")
    xl = random_x((2, 20480), dtype)  # two-pass per-row g
    assert_same(ops.nvfp4_fake_quantize(xl, backend="cuda"), ops.nvfp4_fake_quantize(xl, backend="reference"), "fake long")


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_nvfp4_dequantize(out_dtype):
    """Dequantize to bf16 / fp16 / fp32 == reference, NaN blocks decode to NaN, per-row and [1] g."""
    x = adversarial_x(torch.float32, rows=7, K=2048)
    q = ref.nvfp4_quantize(x)
    assert_same(ops.nvfp4_dequantize(q, out_dtype, backend="cuda"), ref.nvfp4_dequantize(q, out_dtype), "dequant")
    g1 = torch.tensor([1e-3], device=DEV)
    y = torch.ops.trace_ext.nvfp4_dequantize(q.codes, q.scales, g1, out_dtype)
    assert_same(y, ref.nvfp4_dequantize(NVFP4Tensor(q.codes, q.scales, g1.expand(7)), out_dtype), "dequant g[1]")
    qs = ref_q(x, swizzle=True)
    assert_same(ops.nvfp4_dequantize(qs, out_dtype, backend="cuda"), ref.nvfp4_dequantize(q, out_dtype), "dequant swz")


# ---- MXFP4 ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_rounding", ("floor", "ceil"))
def test_mxfp4_quantize(dtype, scale_rounding):
    """MXFP4 RTN and SR, floor and ceil scales, random + adversarial rows, == reference."""
    for x in (random_x((33, 2048), dtype), adversarial_x(dtype), random_x((1, 7168), dtype)):
        for kw in ({}, {"rounding": "sr", "seed": 2**33 + 1, "offset": 9}):
            mc = ops.mxfp4_quantize(x, scale_rounding=scale_rounding, backend="cuda", **kw)
            mr = ops.mxfp4_quantize(x, scale_rounding=scale_rounding, backend="reference", **kw)
            assert_same(mc.codes, mr.codes, f"mx codes {dtype} {scale_rounding} {kw}")
            assert_same(mc.scales, mr.scales, f"mx scales {dtype} {scale_rounding} {kw}")


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_mxfp4_dequantize(out_dtype):
    """MXFP4 dequantize == reference, NaN blocks (scale 0xFF) decode to NaN, subnormal 2^-127 scales exact."""
    x = adversarial_x(torch.float32)
    q = ref.mxfp4_quantize(x)
    q.scales[0, 0] = 0  # 2^-127
    assert_same(ops.mxfp4_dequantize(q, out_dtype, backend="cuda"), ref.mxfp4_dequantize(q, out_dtype), "mx dequant")


def test_mxfp4_large():
    """2^26 elements, bf16, RTN and SR."""
    x = random_x(BIG, torch.bfloat16, seed=3)
    for kw in ({}, {"rounding": "sr", "seed": 1}):
        mc = ops.mxfp4_quantize(x, backend="cuda", **kw)
        mr = ops.mxfp4_quantize(x, backend="reference", **kw)
        assert_same(mc.codes, mr.codes, "mx big codes")
        assert_same(mc.scales, mr.scales, "mx big scales")


@pytest.mark.parametrize("tiles", ["1", "2", "3", "16"])
def test_mxfp4_grid_does_not_change_bits(monkeypatch, tiles):
    """Protects the MXFP4 quantize grid choice (RTN 4 tiles per warp, SR 2; TRACE_EXT_MX_TILES=n): the grid-stride
    walk gives the reference's bits at any tile count, on shapes of one partial wave and of several waves with an
    uneven last one."""
    monkeypatch.setenv("TRACE_EXT_MX_TILES", tiles)
    for shape in ((3, 2048), (1001, 4096), (4097, 7168)):
        x = random_x(shape, torch.bfloat16, seed=5)
        for kw in ({}, {"rounding": "sr", "seed": 11, "offset": 3}):
            mc = ops.mxfp4_quantize(x, backend="cuda", **kw)
            mr = ops.mxfp4_quantize(x, backend="reference", **kw)
            assert_same(mc.codes, mr.codes, f"mx grid {tiles} codes {shape} {kw}")
            assert_same(mc.scales, mr.scales, f"mx grid {tiles} scales {shape} {kw}")


# ---- empty inputs and errors (SPEC 10) ----------------------------------------------------------------------------


def test_empty_inputs_give_empty_outputs():
    """R = 0 returns empty results of the right shapes (no launch)."""
    x = torch.empty(0, 64, device=DEV, dtype=torch.bfloat16)
    codes, scales, g, mbits = torch.ops.trace_ext.nvfp4_quantize(x, None, 0, 0, 0, None, None, None, False, True)
    assert codes.shape == (0, 32) and scales.shape == (0, 4) and g.shape == (0,) and mbits.shape == (0, 8)
    y = torch.ops.trace_ext.nvfp4_fake_quantize(x, None, 0, 0, 0, None, None, None, False)[0]
    assert y.shape == (0, 64)
    c, s = torch.ops.trace_ext.mxfp4_quantize(x, 0, 0, 0, False)
    assert c.shape == (0, 32) and s.shape == (0, 2)
    assert torch.ops.trace_ext.nvfp4_dequantize(codes, scales, g, torch.bfloat16).shape == (0, 64)


def test_errors_on_cuda_tensors():
    """Wrong dtype -> TypeError, bad shape -> ValueError naming the argument, device mismatch -> RuntimeError."""
    op = torch.ops.trace_ext
    x = torch.randn(4, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="x must be"):
        op.nvfp4_quantize(x.int(), None, 0, 0, 0, None, None, None, False, False)
    with pytest.raises(ValueError, match="multiple of 16"):
        op.nvfp4_quantize(x[:, :24].contiguous(), None, 0, 0, 0, None, None, None, False, False)
    with pytest.raises(TypeError, match="g must be"):
        op.nvfp4_quantize(x, torch.ones(4, device=DEV, dtype=torch.float64), 0, 0, 0, None, None, None, False, False)
    with pytest.raises(ValueError, match="g must have shape"):
        op.nvfp4_quantize(x, torch.ones(3, device=DEV), 0, 0, 0, None, None, None, False, False)
    with pytest.raises(RuntimeError, match="g is on"):
        op.nvfp4_quantize(x, torch.ones(4), 0, 0, 0, None, None, None, False, False)
    gs, gg, gp = torch.zeros(4, 4, dtype=torch.uint8, device=DEV), torch.ones(4, device=DEV), torch.zeros(4, 8, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="guide_scales"):
        op.nvfp4_quantize(x, None, 2, 0, 0, gs[:, :3], gg, gp, False, False)
    with pytest.raises(ValueError, match="guide_payload"):
        op.nvfp4_quantize(x, None, 3, 0, 0, gs, gg, gp, False, False)  # full needs [R, K/2]
    with pytest.raises(TypeError, match="guide_g"):
        op.nvfp4_quantize(x, None, 2, 0, 0, gs, gg.double(), gp, False, False)
    with pytest.raises(RuntimeError, match="guidance"):
        op.nvfp4_fake_quantize(x, None, 2, 0, 0, gs.cpu(), gg, gp, False)
    with pytest.raises(ValueError, match="rounding"):
        op.nvfp4_quantize(x, None, 7, 0, 0, None, None, None, False, False)
    with pytest.raises(ValueError, match="scales must have shape"):
        op.nvfp4_dequantize(torch.zeros(4, 32, dtype=torch.uint8, device=DEV), gs[:, :3].contiguous(), gg, torch.bfloat16)
    with pytest.raises(TypeError, match="dtype"):
        op.nvfp4_dequantize(torch.zeros(4, 32, dtype=torch.uint8, device=DEV), gs, gg, torch.int32)
    with pytest.raises(ValueError, match="multiple of 32"):
        op.mxfp4_quantize(x[:, :48].contiguous(), 0, 0, 0, False)
    with pytest.raises(TypeError, match="codes must be"):
        op.mxfp4_dequantize(torch.zeros(4, 32, device=DEV), torch.zeros(4, 2, dtype=torch.uint8, device=DEV), torch.bfloat16)
