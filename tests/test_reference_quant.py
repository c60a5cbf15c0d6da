"""SPEC 2-6 on the pure-torch reference: NVFP4 / MXFP4 quantization, SR, guided rounding, records."""
import math

import pytest
import torch

from trace_ext import formats as F
from trace_ext import reference as R
from trace_ext.tensor import GuidanceRecord


def codes_of(q):
    return F.unpack_nibbles(q.codes.reshape(-1, q.shape[-1] // 2))


def test_nvfp4_scale_formula_by_hand():
    # protects: g = A/2688, s_b = e4m3(amax_b/6/g), v = x/(s_b*g), dequant = q*s*g (SPEC 2)
    x = torch.tensor([[6.0, -3.0, 1.0, 0.4] + [0.0] * 12 + [0.6] * 16])
    q = R.nvfp4_quantize(x)
    assert q.g.item() == (torch.tensor(6.0) / 2688.0).item()
    s0 = F.e4m3_rn(torch.tensor([(6.0 / 6.0) / q.g.item()]))
    assert q.scales[0, 0] == s0[0]
    t0 = F.e4m3_to_float(s0)[0] * q.g[0]
    expect = F.e2m1_rn(torch.tensor([6.0, -3.0, 1.0, 0.4]) / t0)
    assert torch.equal(codes_of(q)[0, :4], expect)
    d = R.nvfp4_dequantize(q)
    assert torch.equal(d[0, :4], F.e2m1_to_float(expect) * F.e4m3_to_float(s0)[0] * q.g[0])


def test_nvfp4_per_row_scope_and_given_g():
    x = torch.randn(5, 64) * torch.tensor([1e-3, 1.0, 10.0, 1e3, 0.0])[:, None]
    q = R.nvfp4_quantize(x)
    assert torch.equal(q.g, torch.where(x.abs().amax(1) > 0, x.abs().amax(1) / 2688.0, torch.ones(5)))
    assert q.g[4] == 1.0  # zero row -> g = 1
    qt = R.nvfp4_quantize(x, scope="tensor")
    assert torch.all(qt.g == x.abs().max() / 2688.0)
    qg = R.nvfp4_quantize(x, torch.tensor(0.5))
    assert torch.all(qg.g == 0.5)


def test_nvfp4_per_matrix_scope_for_expert_weights():
    w = torch.randn(3, 32, 64) * torch.tensor([1.0, 5.0, 0.1])[:, None, None]
    q = R.nvfp4_quantize(w, scope="matrix")
    assert q.g.shape == (3, 32)
    for e in range(3):
        assert torch.all(q.g[e] == w[e].abs().max() / 2688.0)


def test_zero_block_gives_zero_scale_and_codes():
    x = torch.cat([torch.zeros(1, 16), torch.randn(1, 16)], 1)
    q = R.nvfp4_quantize(x)
    assert q.scales[0, 0] == 0 and torch.all(codes_of(q)[0, :16] == 0)
    assert torch.all(R.nvfp4_dequantize(q)[0, :16] == 0)


def test_subnormal_block_scales():
    # protects: tiny blocks next to a large one land on E4M3 subnormal scale bytes, or flush to 0 -> codes 0
    x = torch.zeros(1, 48)
    x[0, :16] = 1000.0
    x[0, 16:32] = 1000.0 * 2.0**-17 * torch.linspace(0.1, 1, 16)
    x[0, 32:48] = 1e-30
    q = R.nvfp4_quantize(x)
    assert 0 < q.scales[0, 1] < 8  # subnormal E4M3 byte
    assert q.scales[0, 2] == 0 and torch.all(codes_of(q)[0, 32:] == 0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("rounding", ["rtn", "sr"])
def test_nonfinite_block_is_nan_scale_zero_codes(bad, rounding):
    # protects: SPEC 2 non-finite rule; the other blocks and the row's g ignore the bad value
    x = torch.randn(2, 32)
    x[0, 5] = bad
    q = R.nvfp4_quantize(x, rounding=rounding)
    assert q.scales[0, 0] == F.E4M3_NAN and torch.all(codes_of(q)[0, :16] == 0)
    assert q.scales[0, 1] != F.E4M3_NAN
    assert q.g[0] == torch.where(torch.isfinite(x[0]), x[0].abs(), torch.zeros(32)).max() / 2688.0
    d = R.nvfp4_dequantize(q)
    assert torch.all(torch.isnan(d[0, :16])) and torch.all(torch.isfinite(d[0, 16:]))


def test_all_nonfinite_row_gets_g_one():
    x = torch.full((1, 16), float("nan"))
    assert R.nvfp4_quantize(x).g.item() == 1.0


def test_dtypes_convert_exactly_to_float32():
    x = torch.randn(4, 32)
    for dt in (torch.bfloat16, torch.float16):
        xd = x.to(dt)
        a, b = R.nvfp4_quantize(xd), R.nvfp4_quantize(xd.float())
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)


def test_rtn_error_bound():
    # protects: quantization is close: |x - x^| <= half a grid step of the block (bounded by ~ amax/12 + scale rounding)
    x = torch.randn(64, 256)
    d = R.nvfp4_dequantize(R.nvfp4_quantize(x))
    blk = x.reshape(64, 16, 16).abs().amax(-1, keepdim=True)
    err = (d - x).reshape(64, 16, 16).abs()
    assert torch.all(err <= blk / 6 * 1.0625 + 1e-6)


# ---- stochastic rounding -----------------------------------------------------------------------------------


def test_sr_is_deterministic_per_seed_and_offset():
    x = torch.randn(8, 64)
    a = R.nvfp4_quantize(x, rounding="sr", seed=7, offset=3)
    b = R.nvfp4_quantize(x, rounding="sr", seed=7, offset=3)
    c = R.nvfp4_quantize(x, rounding="sr", seed=8, offset=3)
    d = R.nvfp4_quantize(x, rounding="sr", seed=7, offset=4)
    assert torch.equal(a.codes, b.codes)
    assert not torch.equal(a.codes, c.codes) and not torch.equal(a.codes, d.codes)
    assert torch.equal(a.scales, R.nvfp4_quantize(x).scales)  # block scales exactly as in RTN


def test_sr_only_picks_bracket_ends():
    x = torch.randn(16, 128)
    rtn = F.e2m1_to_float(codes_of(R.nvfp4_quantize(x)))
    for seed in range(3):
        sr = F.e2m1_to_float(codes_of(R.nvfp4_quantize(x, rounding="sr", seed=seed)))
        assert torch.all((sr - rtn).abs() <= 2.0 + 1e-6)  # at most one grid step (<= 2 at the top)


def test_sr_is_unbiased_within_statistical_bound():
    # protects: E[q] = v for SR. For N independent draws, each error has variance <= (hi-lo)^2/4 <= 1
    # (grid step <= 2), so the mean error of N draws has std <= 1/sqrt(N); we allow 5 sigma.
    torch.manual_seed(0)
    v_target = torch.tensor([0.3, 0.7, 1.1, 2.2, 3.3, 4.9, 5.5, -2.6])
    n = 4096
    # one block holds 6.0 so the scale is exactly 1 * g with g = 6/2688 -> v_i = x_i / (s*g) with s*g = 1
    x = torch.zeros(n, 16)
    x[:, 0] = 6.0
    x[:, 1 : 1 + len(v_target)] = v_target
    g = torch.tensor(1.0 / 448.0)  # s_b = e4m3(1/g) = 448, t = 1 exactly
    q = R.nvfp4_quantize(x, g, rounding="sr", seed=1234, offset=0)
    vals = F.e2m1_to_float(codes_of(q))[:, 1 : 1 + len(v_target)]
    mean_err = (vals.double().mean(0) - v_target.double()).abs()
    assert torch.all(mean_err <= 5.0 / math.sqrt(n)), mean_err
    # and RTN is biased on these values (so the test can fail)
    rtn = F.e2m1_to_float(codes_of(R.nvfp4_quantize(x, g)))[:, 1 : 1 + len(v_target)]
    assert (rtn.double().mean(0) - v_target.double()).abs().max() > 5.0 / math.sqrt(n)


# ---- guided rounding (SPEC 5) ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["compact", "full"])
def test_guided_identical_input_reproduces_rollout_codes(kind):
    x = torch.randn(32, 256)
    q_roll = R.nvfp4_quantize(x)
    rec = R.guidance_from_quantized(q_roll, kind)
    q = R.nvfp4_quantize(x, rounding="guided", guidance=rec)
    assert torch.equal(q.codes, q_roll.codes) and torch.equal(q.scales, q_roll.scales) and torch.equal(q.g, q_roll.g)


def perturbed_pair(rows=64, K=512, eps=2e-3):
    x_roll = torch.randn(rows, K)
    x_train = x_roll * (1 + eps * torch.randn(rows, K)) + eps * torch.randn(rows, K) * 0.1
    return x_roll, x_train


def guided_pair(mode):
    """A rollout / trainer pair: the rollout's quantization, the trainer's guided one, and the rollout's per-element
    divisor t (scale times g)."""
    x_roll, x_train = perturbed_pair()
    q_roll = R.nvfp4_quantize(x_roll)
    qg = R.nvfp4_quantize(x_train, rounding="guided", guidance=R.guidance_from_quantized(q_roll, mode))
    t = (F.e4m3_to_float(q_roll.scales) * q_roll.g[:, None]).repeat_interleave(16, 1)
    return x_roll, x_train, q_roll, qg, t


def test_guided_full_never_worse_than_rtn():
    # protects: |q_guided - q_rollout| <= |q_rtn - q_rollout| elementwise (full mode), both under the rollout's scales
    x_roll, x_train, q_roll, qg, t = guided_pair("full")
    # RTN of the trainer's x under the rollout's scale: the trainer side of naive QAT with shared scales
    rtn = F.e2m1_to_float(F.e2m1_rn(x_train / t))
    r = F.e2m1_to_float(codes_of(q_roll))
    gq = F.e2m1_to_float(codes_of(qg))
    assert torch.all((gq - r).abs() <= (rtn - r).abs())
    assert (gq == r).float().mean() > (rtn == r).float().mean()


def test_guided_compact_matches_rollout_when_value_stays_in_interval():
    x_roll, x_train, q_roll, qg, t = guided_pair("compact")
    a_roll = (x_roll / t).abs().clamp(max=6)
    a_train = (x_train / t).abs().clamp(max=6)
    lo_r, hi_r, _, _ = F.e2m1_bracket(a_roll)
    lo_t, hi_t, _, _ = F.e2m1_bracket(a_train)
    same_interval = (lo_r == lo_t) & (hi_r == hi_t) & (torch.signbit(x_roll) == torch.signbit(x_train))
    agree = codes_of(qg) == codes_of(q_roll)
    assert same_interval.float().mean() > 0.9
    assert torch.all(agree[same_interval])


def test_guided_uses_rollout_scales_not_recomputed():
    x = torch.randn(4, 64)
    rec = R.guidance_from_quantized(R.nvfp4_quantize(x), "compact")
    q = R.nvfp4_quantize(x * 3.0, rounding="guided", guidance=rec)
    assert torch.equal(q.scales, rec.scales) and torch.equal(q.g, rec.g)


def test_guided_nonfinite_trainer_block_or_rollout_nan_scale():
    x = torch.randn(2, 32)
    rec = R.guidance_from_quantized(R.nvfp4_quantize(x), "full")
    y = x.clone()
    y[1, 20] = float("inf")
    q = R.nvfp4_quantize(y, rounding="guided", guidance=rec)
    assert q.scales[1, 1] == F.E4M3_NAN and torch.all(codes_of(q)[1, 16:] == 0)
    rec.scales[0, 0] = F.E4M3_NAN
    q = R.nvfp4_quantize(x, rounding="guided", guidance=rec)
    assert q.scales[0, 0] == F.E4M3_NAN and torch.all(codes_of(q)[0, :16] == 0)


def test_compact_record_bytes_and_round_trip():
    x = torch.randn(6, 2048)
    rec = R.guidance_from_quantized(R.nvfp4_quantize(x), "compact")
    buf = R.encode_compact_record(rec)
    assert buf.shape == (6, 2048 // 8 + 2048 // 16 + 4) == (6, R.compact_record_bytes_per_row(2048))
    back = R.decode_compact_record(buf, 2048)
    assert torch.equal(back.payload, rec.payload) and torch.equal(back.scales, rec.scales)
    assert torch.equal(back.g, rec.g)


def test_mantissa_bit_order_lsb_first():
    codes = torch.zeros(1, 16, dtype=torch.uint8)
    codes[0, 1] = 0x3  # element 1 has mantissa bit 1
    codes[0, 10] = 0xD  # element 10 (byte 1, bit 2)
    mb = R.mantissa_bits_of_codes(F.pack_nibbles(codes))
    assert mb.tolist() == [[0b10, 0b100]]
    assert torch.equal(R.unpack_mantissa_bits(mb)[0], (codes[0] & 1).int())


# ---- MXFP4 (SPEC 3) -----------------------------------------------------------------------------------------------


def test_mxfp4_scale_and_saturation():
    x = torch.zeros(1, 64)
    x[0, 0] = 7.9  # floor(log2 7.9) = 2 -> e = 0 -> v up to 8 saturates to 6
    x[0, 32] = 1.0
    q = R.mxfp4_quantize(x)
    assert q.scales.tolist() == [[127, 125]]
    assert R.mxfp4_dequantize(q)[0, 0] == 6.0
    qc = R.mxfp4_quantize(x, scale_rounding="ceil")
    assert qc.scales[0, 0] == 128 + 0  # 6 * 2^1 >= 7.9 > 6 * 2^0
    assert R.mxfp4_dequantize(qc)[0, 0] == 8.0


def test_mxfp4_ceil_never_saturates():
    x = torch.randn(64, 256) * torch.exp2(torch.randint(-20, 20, (64, 1)).float())
    q = R.mxfp4_quantize(x, scale_rounding="ceil")
    e = q.scales.int() - 127
    amax = x.reshape(64, 8, 32).abs().amax(-1)
    assert torch.all(6.0 * torch.exp2(e.double()) >= amax.double())
    assert torch.all(6.0 * torch.exp2(e.double() - 1) < amax.double())


def test_mxfp4_zero_nan_and_sr():
    x = torch.randn(3, 64)
    x[0, :32] = 0
    x[1, 40] = float("nan")
    q = R.mxfp4_quantize(x)
    assert q.scales[0, 0] == 0 and q.scales[1, 1] == F.E8M0_NAN
    d = R.mxfp4_dequantize(q)
    assert torch.all(torch.isnan(d[1, 32:])) and torch.all(d[0, :32] == 0)
    a = R.mxfp4_quantize(x, rounding="sr", seed=5)
    b = R.mxfp4_quantize(x, rounding="sr", seed=5)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, q.scales)


def test_mxfp4_tiny_values_use_subnormal_exponent_clamp():
    x = torch.full((1, 32), 1e-42)  # float32 subnormal
    q = R.mxfp4_quantize(x)
    assert q.scales.item() == 0  # e clamped to -127
    assert torch.all(R.mxfp4_dequantize(q) == F.e2m1_to_float(codes_of(q)) * 2.0**-127)


# ---- errors (SPEC 10) ----------------------------------------------------------------------------------------------


def test_errors():
    with pytest.raises(ValueError, match="multiple of the 16"):
        R.nvfp4_quantize(torch.randn(2, 24))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        R.nvfp4_quantize(torch.ones(2, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of the 32"):
        R.mxfp4_quantize(torch.randn(2, 48))
    with pytest.raises(ValueError, match="rounding"):
        R.nvfp4_quantize(torch.randn(2, 16), rounding="up")
    with pytest.raises(ValueError, match="guidance"):
        R.nvfp4_quantize(torch.randn(2, 16), rounding="guided")
    rec = R.guidance_from_quantized(R.nvfp4_quantize(torch.randn(2, 32)))
    with pytest.raises(ValueError, match="shape"):
        R.nvfp4_quantize(torch.randn(3, 32), rounding="guided", guidance=rec)
    with pytest.raises(ValueError, match="finite and > 0"):
        R.nvfp4_quantize(torch.randn(2, 16), torch.tensor(0.0))
    with pytest.raises(ValueError, match="1 or 2 elements"):
        R.nvfp4_quantize(torch.randn(2, 16), torch.ones(3))
    with pytest.raises(ValueError, match="kind"):
        GuidanceRecord("half", rec.payload, rec.scales, rec.g)


def test_empty_input_gives_empty_result():
    q = R.nvfp4_quantize(torch.empty(0, 64))
    assert q.codes.shape == (0, 32) and q.scales.shape == (0, 4) and q.g.shape == (0,)
    assert R.nvfp4_dequantize(q).shape == (0, 64)
    m = R.mxfp4_quantize(torch.empty(0, 64))
    assert m.codes.shape == (0, 32)
