"""The TRACE alignment demo (python -m trace_ext.rl.demo --quick) on the CPU reference path.

One module-scoped run of the quick demo (a 4-layer, 8-expert top-2 Qwen3-MoE trained for a few seconds on
the reversal task, its weights cached in a tmp dir; 384 sampled completions per rollout) feeds every test.
They check what the method predicts on this model: guided rounding lands the trainer on the rollout's FP4
codes, and the mismatch orders TRACE all layers <= TRACE deeper half < RTN-QAT < FP4 rollout + BF16 trainer.
"""
import json

import pytest
import torch

from trace_ext.rl import demo
from trace_ext.rl.demo_model import QUICK_SPEC, load_or_train
from trace_ext.rl.guidance import record_bytes_per_row


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("demo_weights")
    out = tmp_path_factory.mktemp("demo_out")
    threads = torch.get_num_threads()
    try:  # one thread: the demo's matrices are small, and 2 threads on a busy 2-core runner spin for minutes
        rc = demo.main(["--quick", "--device", "cpu", "--out", str(out), "--cache-dir", str(cache_dir), "--no-progress",
                        "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    return report, out, cache_dir


def _arm(report, key):
    return next(a for a in report["arms"] if a["key"] == key)


@pytest.mark.parametrize("metric", ["k3_kl", "logprob_abs_diff"])
def test_mismatch_ordering_predicted_by_trace(quick_run, metric):
    """Protects the demo's claim: TRACE all layers <= TRACE deeper half < RTN-QAT < FP4 rollout + BF16 trainer,
    on k3 KL and mean |dlogp| over the sampled tokens (all arms replay routes)."""
    report, _, _ = quick_run
    m = {a["key"]: a["metrics"][metric] for a in report["arms"]}
    assert m["trace_all_compact"] <= m["trace_deep_compact"] < m["fp4_rtn_qat"] < m["fp4_bf16"], m
    assert m["trace_all_full"] <= m["trace_deep_compact"], m


def test_guided_sites_reproduce_rollout_codes(quick_run):
    """Protects SPEC 5 end to end: with guidance on every layer, >= 99.9% of the trainer's FP4 codes at every
    guided site (expert inputs, expert down inputs, K, V) equal the rollout's (+0 and -0 counted as one value:
    guided rounding takes a zero's sign from the trainer's value); unguided RTN-QAT does worse."""
    report, _, _ = quick_run
    for key in ("trace_all_compact", "trace_all_full"):
        arm = _arm(report, key)
        sites = {s for s in arm["agreement"]}
        assert {f"{s}@0" for s in ("expert_in", "expert_down_in", "kv_k", "kv_v")} <= sites
        for site, v in arm["agreement"].items():
            assert v["code_agreement"] >= 0.999, (key, site, v)
            assert 0.99 <= v["code_agreement_raw"] <= v["code_agreement"], (key, site, v)
            assert v["scale_agreement"] >= 0.999, (key, site, v)
            assert v["rows"] > 0
        assert arm["guided_code_agreement_min"] >= 0.999
    qat = _arm(report, "fp4_rtn_qat")
    worst_qat = min(v["code_agreement"] for v in qat["agreement"].values())
    assert worst_qat < _arm(report, "trace_all_compact")["guided_code_agreement_min"]


def test_guidance_bytes_per_token_follow_spec6(quick_run):
    """Protects the guidance accounting: bytes per token = sum over guided layers and sites of rows per token x
    record bytes per row (SPEC 6: compact K/8 + K/16 + 4, full K/2 + K/16 + 4)."""
    report, _, _ = quick_run
    ms = QUICK_SPEC.model
    L = ms.num_hidden_layers

    def per_layer(kind):
        return (
            record_bytes_per_row(ms.hidden_size, kind)
            + ms.num_experts_per_tok * record_bytes_per_row(ms.moe_intermediate_size, kind)
            + 2 * ms.num_key_value_heads * record_bytes_per_row(ms.head_dim, kind)
        )

    assert _arm(report, "trace_all_compact")["guidance_bytes_per_token"] == pytest.approx(L * per_layer("compact"))
    assert _arm(report, "trace_all_full")["guidance_bytes_per_token"] == pytest.approx(L * per_layer("full"))
    assert _arm(report, "trace_deep_compact")["guidance_bytes_per_token"] == pytest.approx((L - L // 2) * per_layer("compact"))
    assert _arm(report, "trace_deep_compact")["guidance_layers"] == list(range(L // 2, L))
    for key in ("bf16_floor", "fp4_bf16", "fp4_rtn_qat"):
        assert _arm(report, key)["guidance_bytes_per_token"] == 0


def test_report_table_and_plot(quick_run):
    """Protects the demo's outputs: a SPEC 9 panel per arm, the printed table and agreement table, the PNG."""
    report, out, _ = quick_run
    assert [a["key"] for a in report["arms"]] == [a[0] for a in demo.ARMS]
    for a in report["arms"]:
        for name in ("kl", "k3_kl", "logprob_abs_diff", "token_mult_prob_error", "prob_abs_diff_mean", "prob_abs_diff_max",
                     "prob_pearson", "ratio_outside_[0.5,2]", "ess", "router_flip_rate"):
            assert name in a["metrics"], (a["key"], name)
        assert a["route_bytes_per_token"] > 0  # every arm replays routes (R3)
    table = demo.format_table(report)
    for a in report["arms"]:
        assert a["label"] in table
    assert "layer" in demo.format_agreement(report)
    png = (out / "mismatch.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert report["response_tokens_per_arm"] == demo.QUICK_RUN.num_samples * QUICK_SPEC.task.response_len


def test_trained_weights_are_cached(quick_run):
    """Protects the weight cache: a second load finds the checkpoint by its config hash (no retraining) and the
    model is peaked on its task."""
    _, _, cache_dir = quick_run
    model, info = load_or_train(QUICK_SPEC, cache_dir=cache_dir, progress=False)
    assert info["cached"] is True and info["key"] == QUICK_SPEC.cache_key()
    assert info["greedy_token_accuracy"] > 0.95
    assert (cache_dir / QUICK_SPEC.cache_key() / "model.safetensors").exists()
    again, _ = load_or_train(QUICK_SPEC, cache_dir=cache_dir, progress=False)
    for (n, p), (_, q) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(p, q), n


def test_engine_numerics_differ_from_trainer_but_floor_is_small(quick_run):
    """Protects the noise floor arm: the rollout engine really differs from the trainer (bf16 rollout + bf16
    trainer mismatch > 0, so FP4 flips can occur), yet stays well below the naive FP4 arm."""
    report, _, _ = quick_run
    floor = _arm(report, "bf16_floor")["metrics"]
    naive = _arm(report, "fp4_bf16")["metrics"]
    assert 0 < floor["logprob_abs_diff"] < naive["logprob_abs_diff"] / 3
    assert 0 < floor["k3_kl"] < naive["k3_kl"] / 3
