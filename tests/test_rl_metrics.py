"""SPEC 9 mismatch metrics against hand-computed values, router flip rate, per-site code / scale agreement."""
import math

import pytest
import torch

from trace_ext import reference as ref
from trace_ext.rl import FP4Config, GuidanceCache, GuidanceError
from trace_ext.rl.guidance import encode_keys
from trace_ext.rl.metrics import guidance_bytes_per_token, mismatch_metrics, router_flip_rate, site_agreement


def test_panel_matches_hand_computation():
    """Protects: each SPEC 9 formula (k1, k3, |dlogp|, mult error, prob diffs, ratio band, ESS) and the mask."""
    lr = torch.log(torch.tensor([[0.5, 0.25, 0.9, 0.1]]))
    r = torch.tensor([[0.1, -0.2, 0.0, 1.0]])  # log ratios; the last token is masked out
    lt = lr + r
    mask = torch.tensor([[True, True, True, False]])
    m = mismatch_metrics(lt, lr, mask)
    rr = [0.1, -0.2, 0.0]
    assert m["tokens"] == 3
    assert m["kl"] == pytest.approx(sum(-x for x in rr) / 3)
    assert m["k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in rr) / 3)
    assert m["logprob_abs_diff"] == pytest.approx(0.1)
    assert m["logprob_abs_diff_max"] == pytest.approx(0.2)
    assert m["token_mult_prob_error"] == pytest.approx(sum(math.exp(abs(x)) for x in rr) / 3)
    pr = [0.5, 0.25, 0.9]
    pt = [p * math.exp(x) for p, x in zip(pr, rr)]
    d = [abs(a - b) for a, b in zip(pt, pr)]
    assert m["prob_abs_diff_mean"] == pytest.approx(sum(d) / 3)
    assert m["prob_abs_diff_max"] == pytest.approx(max(d))
    w = [math.exp(x) for x in rr]
    mw = sum(w) / 3
    assert m["ess"] == pytest.approx(1 / (sum((x / mw) ** 2 for x in w) / 3))
    assert m["ratio_outside_[0.5,2]"] == 0.0
    assert m["prob_pearson"] == pytest.approx(torch.corrcoef(torch.tensor([pt, pr], dtype=torch.float64))[0, 1].item())


def test_identical_logprobs_are_perfect_and_outliers_show():
    """Protects: zero mismatch gives the ideal values; a ratio outside [0.5, 2] is counted."""
    lp = torch.log(torch.rand(4, 8) * 0.9 + 0.05)
    m = mismatch_metrics(lp, lp)
    assert m["kl"] == 0 and m["k3_kl"] == 0 and m["token_mult_prob_error"] == 1.0 and m["ess"] == pytest.approx(1.0)
    assert m["prob_pearson"] == pytest.approx(1.0)
    lt = lp.clone()
    lt[0, 0] += math.log(3.0)
    assert mismatch_metrics(lt, lp)["ratio_outside_[0.5,2]"] == pytest.approx(1 / 32)


def test_metric_errors():
    with pytest.raises(ValueError, match="shape"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="no tokens"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool))


def test_router_flip_rate_ignores_slot_order():
    """Protects: a flip is a different top-k *set*; the same experts in another order is no flip."""
    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])  # [T=2, L=2, k=2]
    b = torch.tensor([[[1, 0], [2, 4]], [[4, 5], [6, 7]]])
    assert router_flip_rate(a, b) == pytest.approx(0.25)


def _codes_cache(codes_rows: dict, routes: dict | None = None):
    c = GuidanceCache(FP4Config(num_layers=2, guidance_kind="full", offload="none"))
    for (site, layer), x in codes_rows.items():
        q = ref.nvfp4_quantize(x)
        n = x.shape[0]
        c.add_record(site, layer, encode_keys((torch.zeros(n, dtype=torch.int64), torch.arange(n))), ref.guidance_from_quantized(q, "full"))
    for layer, idx in (routes or {}).items():
        n = idx.shape[0]
        c.add_routes(layer, encode_keys((torch.zeros(n, dtype=torch.int64), torch.arange(n))), idx)
    return c


def test_site_agreement_and_cache_flip_rate():
    """Protects: code / scale agreement counts elements and block scales per site and layer, on shared rows."""
    x = torch.randn(4, 32) * 4
    y = x.clone()
    y[0, 0] = -y[0, 0]  # one code differs in sign (block scale unchanged)
    y[1, :16] *= 4  # a block rescaled: the scale bytes of row 1 differ (its g moves too)
    a = _codes_cache({("expert_in", 1): x}, {1: torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])})
    b = _codes_cache({("expert_in", 1): y}, {1: torch.tensor([[1, 0], [1, 2], [2, 4], [3, 0]])})
    s = site_agreement(a, b)
    qa, qb = ref.nvfp4_quantize(x), ref.nvfp4_quantize(y)
    from trace_ext import formats as F

    want_codes = (F.unpack_nibbles(qa.codes) == F.unpack_nibbles(qb.codes)).double().mean().item()
    want_scales = (qa.scales == qb.scales).double().mean().item()
    assert s["expert_in"]["code_agreement"] == pytest.approx(want_codes) and want_codes < 1
    assert s["expert_in"]["scale_agreement"] == pytest.approx(want_scales) and want_scales < 1
    assert s["expert_in@1"]["rows"] == 4
    rate, per_layer = router_flip_rate(a, b, per_layer=True)
    assert rate == pytest.approx(0.25) and per_layer == {1: pytest.approx(0.25)}
    assert guidance_bytes_per_token(a) == pytest.approx(32 // 2 + 32 // 16 + 4)


def test_agreement_needs_full_codes_and_overlap():
    c = GuidanceCache(FP4Config(num_layers=2, offload="none"))
    c.add_record("expert_in", 1, encode_keys((torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))),
                 ref.guidance_from_quantized(ref.nvfp4_quantize(torch.randn(1, 32)), "compact"))
    with pytest.raises(GuidanceError, match="full codes"):
        site_agreement(c, c)
    a = _codes_cache({("expert_in", 1): torch.randn(2, 32)})
    b = _codes_cache({("expert_in", 0): torch.randn(2, 32)})
    with pytest.raises(GuidanceError, match="share no"):
        site_agreement(a, b)


def test_mask_and_logprob_types_are_checked():
    """Protects SPEC 10 for mismatch_metrics: a 0/1 float or int mask selects like a bool one, but a mask value of 0.5
    or 2 is a ValueError (.bool() counted both as selected); integer / bool log-probs and lists are TypeErrors."""
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.3, 0.6]]))
    lt = lp + 0.1
    want = mismatch_metrics(lt, lp, torch.tensor([[True, False, True], [True, True, False]]))
    for m in (torch.tensor([[1.0, 0, 1], [1, 1, 0]]), torch.tensor([[1, 0, 1], [1, 1, 0]])):
        assert mismatch_metrics(lt, lp, m) == want
    for bad in (torch.full((2, 3), 0.5), torch.full((2, 3), 2), torch.tensor([[1.0, 0, float("nan")], [1, 1, 0]])):
        with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
            mismatch_metrics(lt, lp, bad)
    for a, b in ((lt.long(), lp.long()), (lt, lp.bool()), (lt.int(), lp)):
        with pytest.raises(TypeError, match="floating"):
            mismatch_metrics(a, b)
    with pytest.raises(TypeError, match="logp_train"):
        mismatch_metrics(lt.tolist(), lp)
    with pytest.raises(TypeError, match="mask"):
        mismatch_metrics(lt, lp, [[1, 0, 1], [1, 1, 0]])


def test_router_flip_rate_tensor_arguments_are_checked():
    """Protects: index tensors must have the same shape (a (2,3,2) and a (3,2,2) used to be compared after reshaping,
    pairing unrelated rows), integer dtype (float ids were compared as floats), and both be tensors (a list was an
    AttributeError)."""
    a = torch.randint(0, 8, (2, 3, 2), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="same shape"):
        router_flip_rate(a, a.reshape(3, 2, 2))
    with pytest.raises(TypeError, match="integer expert ids"):
        router_flip_rate(a.float(), a.float())
    with pytest.raises(TypeError, match="trainer"):
        router_flip_rate(a, a.tolist())
    with pytest.raises(TypeError, match="rollout"):
        router_flip_rate(a.tolist(), a)
    assert router_flip_rate(a, a.int()) == 0.0
