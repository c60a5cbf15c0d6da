"""TRACE_EXT_QUANT_IMPL=guided-lean, the default since 7b3e763 (nvfp4_quant_guided_lean_kernel: guided quantize with
the fp16 round-toward-zero floors, the off-grid bits as signs of lo - a, the packed-half minimum for the tiny-quotient
test): codes, scales, g and capture mbits equal to the reference's and to rowg-lean2's (the previous default), bit for
bit, on
- every dense value around each grid point / tie / binade edge with every payload (t = 1, both signs);
- random activations with random rollout records (compact bits and full codes of both signs, not derived from x);
- adversarial records and inputs: subnormal E4M3 scale bytes, zero scales (t = 0), NaN scales, tiny and huge g (the
  __fdiv_rn path), blocks of zeros / -0, blocks holding NaN / +-Inf, bf16 subnormal and tiny |x| (the tiny-quotient
  test), exact ties and grid points times t;
- odd shapes (block counts per row below 32 and not dividing the grid stride, many tiles per warp);
- fp16 x, and fp32 x (falls back to rowg-lean2's kernels).
Run: pytest tests/gpu/test_quant_guided_lean_gpu.py -q   (on the H200, with the extension built; ~20 s)
"""
from __future__ import annotations

import pytest
import torch

from trace_ext import ops
from trace_ext import reference as ref
from trace_ext.tensor import GuidanceRecord

from test_quant_impl_gpu import LEAN_SHAPES, _set_impl, assert_same, guided_inputs, lean_input

pytestmark = pytest.mark.gpu

DEV = "cuda"
VARIANT = "guided-lean"
PREVIOUS = "rowg-lean2"  # the default before guided-lean


def run(monkeypatch, variant, x, rec, capture=False):
    _set_impl(monkeypatch, variant)
    kw = {"rounding": "guided", "guidance": rec}
    return ops.nvfp4_quantize(x, backend="cuda", capture=capture, **kw)


def check(monkeypatch, x, rec, what):
    """guided-lean == reference == rowg-lean2 (the previous default) == the default (codes, scales, g), and capture
    mbits == rowg-lean2's."""
    want = ops.nvfp4_quantize(x, rounding="guided", guidance=rec, backend="reference")
    got = run(monkeypatch, VARIANT, x, rec)
    assert_same(got, want, f"{what}: guided-lean vs reference")
    assert_same(got, run(monkeypatch, PREVIOUS, x, rec), f"{what}: guided-lean vs rowg-lean2")
    assert_same(got, run(monkeypatch, None, x, rec), f"{what}: guided-lean vs the default (guided-lean)")
    (qc, rc), (qd, rd) = run(monkeypatch, VARIANT, x, rec, True), run(monkeypatch, PREVIOUS, x, rec, True)
    assert_same(qc, qd, f"{what}: capture")
    assert torch.equal(rc.payload, rd.payload), f"{what}: capture mbits"


def random_record(kind, R, K, gen, scales=None, g=None):
    """A rollout record with random payload (compact bits / full codes with both signs) and, unless given, random
    normal scale bytes and per-row g."""
    if kind == "compact":
        payload = torch.randint(0, 256, (R, K // 8), generator=gen, device=DEV, dtype=torch.int32).to(torch.uint8)
    else:
        payload = torch.randint(0, 256, (R, K // 2), generator=gen, device=DEV, dtype=torch.int32).to(torch.uint8)
    if scales is None:
        scales = torch.randint(0x08, 0x7F, (R, K // 16), generator=gen, device=DEV, dtype=torch.int32).to(torch.uint8)
    if g is None:
        g = torch.exp2(torch.randint(-12, 4, (R,), generator=gen, device=DEV).float()) * 1.37
    return GuidanceRecord(kind=kind, payload=payload.contiguous(), scales=scales.contiguous(), g=g.contiguous())


@pytest.mark.parametrize("kind", ("compact", "full"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_dense_values_every_payload(monkeypatch, kind, dtype):
    x, rec = guided_inputs(kind, dtype)
    check(monkeypatch, x, rec, f"dense {kind} {dtype}")


@pytest.mark.parametrize("R,K", LEAN_SHAPES + ((2048, 4096),))
@pytest.mark.parametrize("kind", ("compact", "full"))
def test_random_records_odd_shapes(monkeypatch, R, K, kind):
    gen = torch.Generator(device=DEV).manual_seed(R + K)
    x = lean_input(R, K, torch.bfloat16, R * 3 + K)
    rec = random_record(kind, R, K, gen)
    check(monkeypatch, x, rec, f"random record {kind} {R}x{K}")
    # the rollout's own record of a nearby x (most elements land near their rollout code)
    q = ops.nvfp4_quantize(x, backend="reference")
    x_train = (x.float() * (1 + 1e-2 * torch.randn(R, K, generator=gen, device=DEV))).to(torch.bfloat16)
    check(monkeypatch, x_train, ref.guidance_from_quantized(q, kind), f"own record {kind} {R}x{K}")


def adversarial(kind, dtype, seed):
    """Rows of 64 blocks; each row picks one hazard (see the module note)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    R, K = 512, 1024
    kb = K // 16
    x = torch.randn(R, K, generator=gen, device=DEV)
    scales = torch.randint(0x08, 0x7F, (R, kb), generator=gen, device=DEV, dtype=torch.int32)
    g = torch.exp2(torch.randint(-10, 10, (R,), generator=gen, device=DEV).float())
    case = torch.arange(R, device=DEV) % 12
    blk = torch.arange(kb, device=DEV)
    # 0: subnormal E4M3 scale bytes (t = k 2^-9 g)
    scales[case == 0] = torch.randint(0x01, 0x08, (int((case == 0).sum()), kb), generator=gen, device=DEV,
                                      dtype=torch.int32)
    # 1: zero scale bytes on every other block (t = 0: codes 0)
    scales[(case == 1)[:, None] & (blk % 2 == 0)[None, :]] = 0
    # 2: NaN scale bytes (0x7F / 0xFF) on every third block: the block is NaN
    scales[(case == 2)[:, None] & (blk % 3 == 0)[None, :]] = 0x7F
    scales[(case == 2)[:, None] & (blk % 3 == 1)[None, :]] = 0xFF
    # 3 / 4: tiny and huge g (t near the ends of the reciprocal path's range)
    g[case == 3] = 2.0**-110
    g[case == 4] = 2.0**95
    # 5: zero blocks, -0 blocks
    x[case == 5] = 0.0
    x[(case == 5)[:, None] & (torch.arange(K, device=DEV) % 32 < 16)[None, :]] = -0.0
    # 6: NaN / +-Inf in some blocks
    rows6 = (case == 6).nonzero().flatten()
    x[rows6, 17] = float("nan")
    x[rows6, 16 * 5 + 3] = float("inf")
    x[rows6, 16 * 9 + 15] = float("-inf")
    # 7: tiny |x| next to normal values (the tiny-quotient test, bf16 / fp16 subnormals)
    rows7 = (case == 7).nonzero().flatten()
    x[rows7, ::5] = torch.exp2(-torch.randint(100, 140, (rows7.numel(), (K + 4) // 5), generator=gen,
                                              device=DEV).float())
    x[rows7, 1::7] = 2.0**-20
    # 8: exact grid points and ties times t (t = s g with s = 1.0 / 1.5 bytes, g a power of two)
    rows8 = (case == 8).nonzero().flatten()
    pts = torch.tensor((0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 0.0),
                       device=DEV)
    scales[rows8] = 0x38  # 1.0
    scales[rows8, 1::2] = 0x3C  # 1.5
    t8 = torch.where(blk % 2 == 1, 1.5, 1.0)[None, :] * g[rows8][:, None]
    v8 = pts[torch.randint(0, 16, (rows8.numel(), K), generator=gen, device=DEV)]
    x[rows8] = (v8.reshape(-1, kb, 16) * t8[:, :, None]).reshape(-1, K)
    # 9: values far above the scale (saturation at 6)
    x[case == 9] *= 1e4
    # 10: one element per block at 6 t (the rollout's amax) and the rest tiny
    x[case == 10] *= 1e-6
    # 11: plain random rows (every case above shares the grid walk with them)
    signs = torch.randint(0, 2, (R, K), generator=gen, device=DEV).bool()
    x = torch.where(signs & (case == 8)[:, None], -x, x)
    rec = random_record(kind, R, K, gen, scales=scales.to(torch.uint8), g=g)
    return x.to(dtype), rec


@pytest.mark.parametrize("kind", ("compact", "full"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("seed", (0, 1))
def test_adversarial_records_and_inputs(monkeypatch, kind, dtype, seed):
    x, rec = adversarial(kind, dtype, 100 + seed)
    check(monkeypatch, x, rec, f"adversarial {kind} {dtype} seed {seed}")


def test_other_modes_are_the_default(monkeypatch):
    """guided-lean changes guided quantize only: RTN (fused g, g given, swizzled), SR and fake quantization give the
    outputs of rowg-lean2 (the previous default)."""
    gen = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(333, 2048, generator=gen, device=DEV).to(torch.bfloat16)
    g = ref.nvfp4_global_scale(x, "row").contiguous()
    rec = ref.guidance_from_quantized(ref.nvfp4_quantize((x.float() * 1.001).to(torch.bfloat16)), "compact")
    calls = (lambda: ops.nvfp4_quantize(x, backend="cuda"),
             lambda: ops.nvfp4_quantize(x, swizzle=True, backend="cuda"),
             lambda: ops.nvfp4_quantize(x, g, backend="cuda"),
             lambda: ops.nvfp4_quantize(x, rounding="sr", seed=3, offset=1, backend="cuda"),
             lambda: ops.nvfp4_quantize(x, rounding="guided", guidance=rec, swizzle=True, backend="cuda"))
    for i, call in enumerate(calls):
        _set_impl(monkeypatch, PREVIOUS)
        a = call()
        _set_impl(monkeypatch, VARIANT)
        assert_same(call(), a, f"call {i}")
    _set_impl(monkeypatch, PREVIOUS)
    fa = ops.nvfp4_fake_quantize(x, rounding="guided", guidance=rec, backend="cuda")
    _set_impl(monkeypatch, VARIANT)
    fb = ops.nvfp4_fake_quantize(x, rounding="guided", guidance=rec, backend="cuda")
    assert torch.equal(fa.view(torch.int16), fb.view(torch.int16)), "fake quant"
