"""trace_ext.ops quantization: backend choice, SPEC 10 errors, capture, swizzle, opcheck, torch.compile."""
import pytest
import torch

import trace_ext
from trace_ext import formats as F
from trace_ext import ops
from trace_ext import reference as R
from trace_ext._loader import extension_loaded
from trace_ext.tensor import MXFP4Tensor, NVFP4Tensor

needs_ext = pytest.mark.skipif(not extension_loaded(), reason="the compiled extension is not installed (pure-Python install)")


def test_backends_report_is_complete():
    b = trace_ext.backends()
    for key in ("extension", "compiled_archs", "cuda_available", "gpu_capability", "kernels_usable", "auto_on_cuda_tensors"):
        assert key in b
    assert b["auto_on_cpu_tensors"] == "reference"


def test_forced_cuda_backend_on_cpu_tensor_is_a_clear_runtime_error():
    with pytest.raises(RuntimeError, match="backend='cuda' is unavailable"):
        ops.nvfp4_quantize(torch.randn(2, 32), backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.nvfp4_quantize(torch.randn(2, 32), backend="triton")


def test_ops_equal_reference_on_cpu():
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    q = ops.nvfp4_quantize(x)
    r = R.nvfp4_quantize(x)
    assert torch.equal(q.codes, r.codes) and torch.equal(q.scales, r.scales) and q.codes.shape == (3, 5, 32)
    d = ops.nvfp4_dequantize(q)
    assert d.dtype == torch.bfloat16 and torch.equal(d, R.nvfp4_dequantize(r, torch.bfloat16))
    y = ops.nvfp4_fake_quantize(x)
    assert y.dtype == x.dtype and torch.equal(y, d)


def test_capture_record_replays_to_identical_codes():
    x = torch.randn(7, 128)
    q, rec = ops.nvfp4_quantize(x, capture=True)
    assert rec.kind == "compact" and rec.payload.shape == (7, 16)
    qg = ops.nvfp4_quantize(x, rounding="guided", guidance=rec)
    assert torch.equal(qg.codes, q.codes)
    y, rec2 = ops.nvfp4_fake_quantize(x, rounding="guided", guidance=rec, capture=True)
    assert torch.equal(rec2.payload, rec.payload) and torch.equal(rec2.scales, rec.scales)


def test_guided_rounding_rejects_a_g_beside_the_record():
    """Protects SPEC 10 (nothing ignored silently): guided rounding takes g from the rollout's record, so a g given
    beside it is a ValueError on every entry (ops quantize / fake quantize, the reference), not dropped."""
    x = torch.randn(4, 64)
    _, rec = ops.nvfp4_quantize(x, capture=True)
    g = torch.ones(4)
    for fn in (ops.nvfp4_quantize, ops.nvfp4_fake_quantize, R.nvfp4_quantize):
        with pytest.raises(ValueError, match="g must be None"):
            fn(x, g, rounding="guided", guidance=rec)


def test_swizzled_output_and_dequantize_from_it():
    x = torch.randn(130, 80)
    q = ops.nvfp4_quantize(x, swizzle=True)
    assert q.swizzled and q.scales.shape == F.swizzled_shape(130, 5)
    lin = ops.nvfp4_quantize(x)
    assert torch.equal(F.from_swizzled(q.scales, 130, 5), lin.scales)
    assert torch.equal(ops.nvfp4_dequantize(q, torch.float32), ops.nvfp4_dequantize(lin, torch.float32))


def test_mx_ops_equal_reference():
    x = torch.randn(4, 96)
    for sr in ("floor", "ceil"):
        q = ops.mxfp4_quantize(x, scale_rounding=sr)
        r = R.mxfp4_quantize(x, scale_rounding=sr)
        assert torch.equal(q.codes, r.codes) and torch.equal(q.scales, r.scales)
    assert torch.equal(ops.mxfp4_dequantize(q, torch.float32), R.mxfp4_dequantize(r))


def test_op_errors_spec10():
    with pytest.raises(TypeError):
        ops.nvfp4_quantize(torch.ones(2, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match="multiple"):
        ops.nvfp4_quantize(torch.randn(2, 20))
    with pytest.raises(ValueError, match="seed"):
        ops.nvfp4_quantize(torch.randn(2, 16), rounding="sr", seed=-1)
    # scope is checked by quantize and fake quantize alike, also when g is given (and not used)
    for op in (ops.nvfp4_quantize, ops.nvfp4_fake_quantize):
        for g in (None, torch.ones(2)):
            with pytest.raises(ValueError, match="scope"):
                op(torch.randn(2, 16), g, scope="block")
    with pytest.raises(TypeError, match="dtype"):
        ops.nvfp4_dequantize(ops.nvfp4_quantize(torch.randn(2, 16)), torch.int8)
    with pytest.raises(ValueError, match="MXFP4 rounding"):
        ops.mxfp4_quantize(torch.randn(2, 32), rounding="guided")
    # a tensor whose parts disagree with its logical shape: ValueError naming the part (was torch's reshape error)
    q = ops.nvfp4_quantize(torch.randn(4, 32))
    for part, bad in (("codes", NVFP4Tensor(q.codes[:3], q.scales, q.g, q.shape)),
                      ("scales", NVFP4Tensor(q.codes, q.scales[:, :1], q.g, q.shape)),
                      ("g must have", NVFP4Tensor(q.codes, q.scales, q.g[:2], q.shape))):
        with pytest.raises(ValueError, match=part):
            ops.nvfp4_dequantize(bad)
    with pytest.raises(TypeError, match="float32"):
        ops.nvfp4_dequantize(NVFP4Tensor(q.codes, q.scales, q.g.double(), q.shape))
    assert ops.nvfp4_dequantize(NVFP4Tensor(q.codes, q.scales, q.g[:1], q.shape)).shape == (4, 32)  # one g for all
    m = ops.mxfp4_quantize(torch.randn(4, 64))
    with pytest.raises(ValueError, match="scales"):
        ops.mxfp4_dequantize(MXFP4Tensor(m.codes, m.scales[:, :1], m.shape))


# ---- the compiled ops' registration (schema, fake, CPU kernel) ------------------------------------------------


def _quant_args(R_, K, rounding=0):
    x = torch.randn(R_, K, dtype=torch.bfloat16)
    if rounding < 2:
        return (x, None, rounding, 3, 1, None, None, None, False, True)
    q = R.nvfp4_quantize(x)
    rec = R.guidance_from_quantized(q, "compact" if rounding == 2 else "full")
    return (x, None, rounding, 0, 0, rec.scales, rec.g, rec.payload, False, True)


@needs_ext
@pytest.mark.parametrize("rounding", [0, 1, 2, 3])
def test_opcheck_nvfp4_quantize(rounding):
    torch.library.opcheck(torch.ops.trace_ext.nvfp4_quantize.default, _quant_args(5, 64, rounding))


@needs_ext
def test_opcheck_other_quant_ops():
    x = torch.randn(3, 64)
    torch.library.opcheck(torch.ops.trace_ext.nvfp4_fake_quantize.default, (x, None, 0, 0, 0, None, None, None, True))
    torch.library.opcheck(
        torch.ops.trace_ext.nvfp4_quantize.default, (x, torch.full((3,), 0.01), 0, 0, 0, None, None, None, True, False)
    )
    q = R.nvfp4_quantize(x)
    torch.library.opcheck(torch.ops.trace_ext.nvfp4_dequantize.default, (q.codes, q.scales, q.g, torch.bfloat16))
    torch.library.opcheck(torch.ops.trace_ext.mxfp4_quantize.default, (x, 1, 2, 3, True))
    m = R.mxfp4_quantize(x)
    torch.library.opcheck(torch.ops.trace_ext.mxfp4_dequantize.default, (m.codes, m.scales, torch.float32))


@needs_ext
def test_compiled_op_traces_fullgraph_through_its_fake():
    def f(x):
        codes, scales, g, mbits = torch.ops.trace_ext.nvfp4_quantize(x, None, 0, 0, 0, None, None, None, False, True)
        return torch.ops.trace_ext.nvfp4_dequantize(codes, scales, g, torch.float32), mbits

    x = torch.randn(4, 64)
    got, mb = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    want = R.nvfp4_dequantize(R.nvfp4_quantize(x))
    assert torch.equal(got, want) and mb.shape == (4, 8)


def test_reference_path_compiles_fullgraph():
    def f(x):
        return ops.nvfp4_fake_quantize(x, backend="reference")

    x = torch.randn(8, 64)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(got, R.nvfp4_fake_quantize(x))


@pytest.mark.parametrize("shape", [(4, 0), (2, 3, 0), (0, 0), (0, 32)])
def test_empty_inputs_give_empty_results(shape):
    """Protects SPEC 10's empty tensors, K = 0 included (rows without blocks: reshape(-1, K) cannot count them):
    every quantize / dequantize / fake-quantize / swizzle / capture / guided path returns the empty result with the
    input's leading shape and no error."""
    x = torch.randn(*shape)
    lead, K = shape[:-1], shape[-1]
    q, rec = ops.nvfp4_quantize(x, capture=True)
    assert q.codes.shape == (*lead, K // 2) and q.scales.shape == (*lead, K // 16) and q.g.shape == lead
    assert ops.nvfp4_dequantize(q).shape == shape
    assert ops.nvfp4_fake_quantize(x).shape == shape
    assert ops.nvfp4_quantize(x, rounding="sr", seed=1).codes.shape == (*lead, K // 2)
    assert ops.nvfp4_quantize(x, rounding="guided", guidance=rec).codes.shape == (*lead, K // 2)
    qs = ops.nvfp4_quantize(x, swizzle=True)
    assert qs.swizzled and ops.nvfp4_dequantize(qs).shape == shape
    m = ops.mxfp4_quantize(x)
    assert m.codes.shape == (*lead, K // 2) and m.scales.shape == (*lead, K // 32)
    assert ops.mxfp4_dequantize(m).shape == shape


def test_swizzle_helpers_reject_non_matrices():
    with pytest.raises(ValueError, match="rows_pad"):
        ops.from_swizzled(torch.zeros(10, dtype=torch.uint8), 3, 3)
    with pytest.raises(ValueError, match="rows, Kb"):
        ops.to_swizzled(torch.zeros(10, dtype=torch.uint8))
