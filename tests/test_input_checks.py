"""SPEC 10 on the public Python API (CPU): inputs that were truncated, reinterpreted, ignored or crashed with an
internal error now give the contract's TypeError / ValueError, and empty inputs give empty results."""
import math

import pytest
import torch

from trace_ext import ops
from trace_ext import reference as R
from trace_ext.autograd import fake_quant_grouped_matmul, fake_quantize, quantize_with_record
from trace_ext.nn.gemm import fp4_grouped_linear as nn_grouped_linear
from trace_ext.tensor import MXFP4Tensor, NVFP4Tensor


# ---- quantization ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0.5, True, "3", torch.tensor(3), None])
def test_seed_and_offset_must_be_ints(bad):
    x = torch.randn(2, 32)
    with pytest.raises(TypeError, match="seed"):
        ops.nvfp4_quantize(x, rounding="sr", seed=bad)
    with pytest.raises(TypeError, match="offset"):
        ops.mxfp4_quantize(x, rounding="sr", offset=bad)


def test_guidance_must_be_a_record():
    with pytest.raises(TypeError, match="GuidanceRecord"):
        ops.nvfp4_quantize(torch.randn(2, 32), rounding="guided", guidance={"payload": None})


def test_fake_quantize_takes_what_the_quantizers_take():
    """float64 / float8 x were cast silently (ops.nvfp4_quantize raises TypeError); kind without capture was ignored."""
    for dtype in (torch.float64, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match="x must be"):
            fake_quantize(torch.randn(2, 32).to(dtype))
    with pytest.raises(ValueError, match="kind"):
        fake_quantize(torch.randn(2, 32), kind="full")
    y, rec = fake_quantize(torch.randn(2, 32), capture=True, kind="full")
    assert rec.kind == "full" and y.shape == (2, 32)


def test_full_record_of_empty_rows():
    q, rec = quantize_with_record(torch.randn(3, 0), kind="full")
    assert q.codes.shape == (3, 0) and rec.payload.shape == (3, 0) and rec.scales.shape == (3, 0)
    y, rec = fake_quantize(torch.randn(3, 0), capture=True, kind="full")
    assert y.shape == (3, 0) and rec.g.shape == (3,)


def test_dequantize_names_the_wrong_container_and_swizzled_scale_dtype():
    x = torch.randn(4, 64)
    with pytest.raises(TypeError, match="NVFP4Tensor"):
        ops.nvfp4_dequantize(ops.mxfp4_quantize(x))
    with pytest.raises(TypeError, match="MXFP4Tensor"):
        ops.mxfp4_dequantize(ops.nvfp4_quantize(x))
    q = ops.nvfp4_quantize(x, swizzle=True)
    bad = NVFP4Tensor(q.codes, q.scales.float(), q.g, q.shape, swizzled=True)
    with pytest.raises(TypeError, match="scales"):
        ops.nvfp4_dequantize(bad)


# ---- GEMM and routing -----------------------------------------------------------------------------------------------


def test_fp4_linear_with_empty_rows_of_k():
    """K = 0 (bf16 activations): an empty product, zeros of [M, N], not a reshape error."""
    w = ops.nvfp4_quantize(torch.randn(16, 0))
    y = ops.fp4_linear(torch.randn(4, 0).bfloat16(), w)
    assert y.shape == (4, 16) and torch.equal(y, torch.zeros(4, 16, dtype=torch.bfloat16))


def test_weight_g_shape_says_what_it_scales():
    """g_w was checked by element count only: a transposed per-row g [N, E] was read as [E, N]."""
    E, N, K = 3, 16, 32
    w = ops.nvfp4_quantize(torch.randn(E, N, K), scope="matrix")
    a = torch.randn(6, K).bfloat16()
    off = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    g_en = torch.rand(E, N) + 0.5
    for g in (g_en, g_en.reshape(E, N, 1), g_en[:, 0], g_en[:, :1]):
        ops.fp4_grouped_linear(a, (w.codes, w.scales, g.contiguous()), off)
    with pytest.raises(ValueError, match="g_w"):
        ops.fp4_grouped_linear(a, (w.codes, w.scales, g_en.t().contiguous()), off)
    wd = ops.nvfp4_quantize(torch.randn(N, K), scope="tensor")
    with pytest.raises(ValueError, match="g_w"):
        ops.fp4_linear(a, (wd.codes, wd.scales, torch.ones(4, 4)))
    assert ops.fp4_linear(a, (wd.codes, wd.scales, torch.ones(N, 1))).shape == (6, N)


@pytest.mark.parametrize("bad", [2.5, True, "3"])
def test_moe_permute_num_experts_must_be_an_int(bad):
    with pytest.raises(TypeError, match="num_experts"):
        ops.moe_permute(torch.randn(3, 8), torch.zeros(3, 2, dtype=torch.int64), bad)


def test_nn_grouped_linear_checks_offsets_on_every_path():
    """The MXFP4 / reference path took any offsets (a decreasing pair was read as an empty expert, rows past
    offsets[E] came back as zeros) and the NVFP4 path cast float offsets to int32."""
    a = torch.randn(5, 32)
    w_mx = ops.mxfp4_quantize(torch.randn(3, 8, 32))
    for bad in ([0, 3, 2, 5], [0, 2, 2, 4]):
        with pytest.raises(ValueError, match="offsets"):
            nn_grouped_linear(a, w_mx, torch.tensor(bad))
    with pytest.raises(TypeError, match="offsets"):
        nn_grouped_linear(a, w_mx, torch.tensor([0.0, 1.5, 2.0, 5.0]))
    w_nv = ops.nvfp4_quantize(torch.randn(3, 8, 32), scope="matrix")
    with pytest.raises(TypeError, match="offsets"):
        nn_grouped_linear(a.bfloat16(), w_nv, torch.tensor([0.0, 1.5, 2.0, 5.0]))
    with pytest.raises(ValueError, match="int32"):
        nn_grouped_linear(a.bfloat16(), w_nv, torch.tensor([0, 2**32 + 1, 2**32 + 2, 5]))
    with pytest.raises(TypeError, match="out_dtype"):
        nn_grouped_linear(a, w_mx, torch.tensor([0, 2, 2, 5]), out_dtype=torch.int32)
    with pytest.raises(ValueError, match="backend"):
        nn_grouped_linear(a, w_mx, torch.tensor([0, 2, 2, 5]), backend="foo")
    ok = nn_grouped_linear(a, w_mx, torch.tensor([0, 2, 2, 5]))
    assert ok.shape == (5, 8)


def test_fake_quant_grouped_matmul_types_and_strides():
    """Integer x (the fake-quantized weights were cast to int32), float64 operands and float bounds were accepted;
    a strided x gave values ~1 ulp away from its contiguous copy (another matmul path)."""
    w = torch.randn(2, 8, 32)
    with pytest.raises(TypeError, match="x must be"):
        fake_quant_grouped_matmul(torch.ones(5, 32, dtype=torch.int32), w, [0, 2, 5])
    with pytest.raises(TypeError, match="w must be"):
        fake_quant_grouped_matmul(torch.randn(5, 32), w.double(), [0, 2, 5])
    for bad in ([0, 1.5, 5], [0, "2", 5], [0, True, 5]):
        with pytest.raises(TypeError, match="bounds"):
            fake_quant_grouped_matmul(torch.randn(5, 32), w, bad)
    base = torch.randn(32, 5).t()  # strided [5, 32]
    x1 = base.clone().requires_grad_(True)
    x2 = base.contiguous().requires_grad_(True)
    y1 = fake_quant_grouped_matmul(x1, w, [0, 2, 5])
    y2 = fake_quant_grouped_matmul(x2, w, [0, 2, 5])
    assert torch.equal(y1, y2)
    gy = torch.randn(8, 5).t()
    (g1,) = torch.autograd.grad(y1, x1, gy)
    (g2,) = torch.autograd.grad(y2, x2, gy.contiguous())
    assert torch.equal(g1, g2)


# ---- KV prefill ------------------------------------------------------------------------------------------------------


def test_prefill_attention_checks_scale_and_g():
    q = torch.randn(1, 2, 4, 32).bfloat16()
    k = torch.randn(1, 2, 4, 32).bfloat16()
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="softmax_scale"):
            ops.fp4kv_prefill_attention(q, k, k, g_k=1.0, g_v=1.0, softmax_scale=bad)
    with pytest.raises(TypeError, match="softmax_scale"):
        ops.fp4kv_prefill_attention(q, k, k, g_k=1.0, g_v=1.0, softmax_scale="0.1")
    with pytest.raises(ValueError, match="g_k"):
        ops.fp4kv_prefill_attention(q, k, k, g_k=torch.ones(2), g_v=1.0)
    for bad in ("0.5", True):
        with pytest.raises(TypeError, match="g_k"):
            ops.fp4kv_prefill_attention(q, k, k, g_k=bad, g_v=1.0)
    with pytest.raises(ValueError, match="g_v"):
        ops.fp4kv_prefill_attention(q, k, k, g_k=1.0, g_v=1e-50)  # 0 as a float32
    empty = ops.fp4kv_prefill_attention(q[..., :0], k[..., :0], k[..., :0], g_k=1.0, g_v=1.0)
    assert empty.shape == (1, 2, 4, 0)


def test_option_flags_must_be_bools():
    """A truthy string or number ("no", 2) switched modes on (swizzled scales, capture, validation, causality)."""
    x = torch.randn(2, 32)
    with pytest.raises(TypeError, match="swizzle"):
        ops.nvfp4_quantize(x, swizzle="no")
    with pytest.raises(TypeError, match="capture"):
        ops.nvfp4_fake_quantize(x, capture=1)
    with pytest.raises(TypeError, match="capture"):
        fake_quantize(x, capture="yes")
    with pytest.raises(TypeError, match="validate"):
        ops.moe_permute(torch.randn(3, 8), torch.zeros(3, 2, dtype=torch.int64), 4, validate="no")
    w = ops.nvfp4_quantize(torch.randn(16, 256), scope="tensor")
    for kw in ({"grouped": 1}, {"decode_form2": "yes"}):
        with pytest.raises(TypeError, match=next(iter(kw))):
            ops.prepare_fp4_weight(w, **kw)
    q = torch.randn(1, 2, 4, 32).bfloat16()
    with pytest.raises(TypeError, match="causal"):
        ops.fp4kv_prefill_attention(q, q, q, g_k=1.0, g_v=1.0, causal=0)


def test_containers_layouts_and_modules_check_their_arguments():
    """Internal IndexErrors / AttributeErrors / format errors before: 0-d codes, a shape with a str, float or negative
    row counts for from_swizzled, a list weight for prepare_fp4_weight, FP4Linear's site / layer / group."""
    from trace_ext import formats as F
    from trace_ext.nn import FP4Linear

    with pytest.raises(ValueError, match="0-d"):
        NVFP4Tensor(torch.tensor(1, dtype=torch.uint8), torch.tensor(1, dtype=torch.uint8), torch.ones(1))
    q = ops.nvfp4_quantize(torch.randn(4, 32))
    with pytest.raises(TypeError, match="shape"):
        NVFP4Tensor(q.codes, q.scales, q.g, (4, "32"))
    with pytest.raises(TypeError, match="codes"):
        MXFP4Tensor([1, 2], torch.zeros(1, 1, dtype=torch.uint8))
    sw = ops.nvfp4_quantize(torch.randn(4, 32), swizzle=True).scales
    for bad, exc in ((4.0, TypeError), (2.5, TypeError), (-1, ValueError)):
        with pytest.raises(exc, match="rows"):
            F.from_swizzled(sw, bad, 2)
    with pytest.raises(TypeError, match="tensors"):
        ops.prepare_fp4_weight([1, 2, 3])
    lin = torch.nn.Linear(32, 16)
    with pytest.raises(ValueError, match="group"):
        FP4Linear(lin, "attn_proj.q_proj", 0, "bogus")
    for layer, exc in ((-1, ValueError), ("0", TypeError), (True, TypeError)):
        with pytest.raises(exc, match="layer"):
            FP4Linear(lin, "attn_proj.q_proj", layer, "attn_proj")
    with pytest.raises(TypeError, match="site"):
        FP4Linear(lin, 5, 0, "attn_proj")
