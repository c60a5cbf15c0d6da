"""The TRACE alignment demo: ``python -m trace_ext.rl.demo [--device cpu|cuda] [--out DIR] [--quick] [--retrain]``.

1. A small Qwen3-MoE (built from a config, trained briefly on a synthetic reversal task so that it is peaked;
   weights cached under ``--cache-dir``, default ~/.cache/trace_ext/demo, keyed by a config hash).
2. Rollouts, sampled at temperature 1: a BF16 one and an FP4 one (W4A4 routed experts + FP4 KV cache),
   recording guidance (all layers, full codes) and routes.
3. The trainer recomputes log-probs of the sampled tokens under six arms (SPEC 9 panel per arm):
     bf16 rollout + bf16 trainer        the engine-noise floor
     fp4 rollout + bf16 trainer         naive low-precision rollout
     fp4 rollout + RTN-QAT trainer      unguided QAT (the trainer re-quantizes on its own)
     TRACE deeper half (compact)        guided rounding on layers >= L/2
     TRACE all layers (compact)
     TRACE all layers (full codes)
   Every MoE arm replays the rollout's routes (R3).
4. One table, per-layer code agreement, a JSON report and a PNG plot in ``--out``.

Rollout engine vs trainer differ the way real stacks do: the rollout prefills the prompt and decodes token by
token with a KV cache (the FP4 cache in the FP4 rollout) and computes RMSNorm like a fused inference kernel
(fp32 throughout, one rounding); the trainer runs one full-sequence forward of the Hugging Face modules. The FP4 GEMMs differ too (the engine
multiplies packed FP4 operands, the trainer fake-quantized ones). These tiny differences flip FP4 roundings
near grid boundaries; TRACE's guidance makes the trainer land on the rollout's codes anyway.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import formats as F
from .config import FP4Config
from .demo_model import FULL_SPEC, QUICK_SPEC, DemoModelSpec, load_or_train, set_experts_implementation
from .guidance import GuidanceCache, RowStore, guided_layers, to_compact
from .metrics import mismatch_metrics, router_flip_rate, site_agreement

ARMS = (
    ("bf16_floor", "bf16 rollout + bf16 trainer", "bf16", "bf16", None),
    ("fp4_bf16", "fp4 rollout + bf16 trainer", "fp4", "bf16", None),
    ("fp4_rtn_qat", "fp4 rollout + RTN-QAT trainer", "fp4", "qat", None),
    ("trace_deep_compact", "TRACE deeper half (compact)", "fp4", "guided", ("deeper_half", "compact")),
    ("trace_all_compact", "TRACE all layers (compact)", "fp4", "guided", (None, "compact")),
    ("trace_all_full", "TRACE all layers (full codes)", "fp4", "guided", (None, "full")),
)
SHORT_LABELS = {
    "bf16_floor": "bf16 roll\nbf16 train",
    "fp4_bf16": "fp4 roll\nbf16 train",
    "fp4_rtn_qat": "fp4 roll\nRTN-QAT",
    "trace_deep_compact": "TRACE\ndeep half",
    "trace_all_compact": "TRACE all\ncompact",
    "trace_all_full": "TRACE all\nfull codes",
}

@dataclass(frozen=True)
class RunSpec:
    model: DemoModelSpec
    num_samples: int
    temperature: float = 1.0
    seed: int = 1234


FULL_RUN = RunSpec(FULL_SPEC, num_samples=1024)
QUICK_RUN = RunSpec(QUICK_SPEC, num_samples=384)


# ---- the rollout engine's numerics -------------------------------------------------------------------------------


def _fused_rmsnorm_forward(self, x):
    """RMSNorm as fused inference kernels compute it: fp32 throughout, one rounding at the end."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight.float()
    return y.to(x.dtype)


@contextlib.contextmanager
def engine_numerics(model):
    """Run the model's RMSNorms the way fused inference kernels do (vLLM's fused RMSNorm: fp32 throughout, one
    rounding), where Hugging Face rounds the normalized value to bf16 before the weight multiply. Experts
    (converted) and routers are left alone; the rest of the engine / trainer difference is the decode loop
    (KV cache, one token per step) against one full-sequence forward."""
    patched = []
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon"):
            patched.append(m)
            m.forward = types.MethodType(_fused_rmsnorm_forward, m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


# ---- rollout ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def decode(model, prompts: torch.Tensor, steps: int, cache, temperature: float, gen: torch.Generator, bar=None):
    """Prefill then sample ``steps`` tokens one at a time. Returns (sequences [B, P + steps], logp [B, steps])."""
    dev = next(model.parameters()).device
    seq = prompts.to(dev)
    logps = []
    inp = seq
    for _ in range(steps):
        logits = model(inp, past_key_values=cache, use_cache=True).logits[:, -1].float()
        lp = torch.log_softmax(logits / temperature, dim=-1)
        tok = torch.multinomial(lp.exp().cpu(), 1, generator=gen).to(dev)
        logps.append(lp.gather(-1, tok)[:, 0])
        seq = torch.cat([seq, tok], dim=1)
        inp = tok
        if bar is not None:
            bar.update(1)
    return seq, torch.stack(logps, dim=1)


def response_logprobs(model, seqs: torch.Tensor, prompt_len: int, temperature: float) -> torch.Tensor:
    """The trainer's log-probs of the sampled tokens: one forward over ``seqs[:, :-1]`` (the last sampled
    token was never fed to the rollout either)."""
    with torch.no_grad():
        logits = model(seqs[:, :-1]).logits[:, prompt_len - 1 :].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(-1, seqs[:, prompt_len:, None])[..., 0]


# ---- guidance for each arm ---------------------------------------------------------------------------------------


def derive_guidance(full: GuidanceCache, config: FP4Config, layout) -> GuidanceCache:
    """What a rollout run with ``config`` would have recorded, cut from an all-layers full-codes recording:
    the policy's layers only, in the config's kind (compact = the codes' mantissa bits). Routes are shared."""
    layers = guided_layers(config, layout)
    out = GuidanceCache(config, full.model_signature, layers)
    for (site, layer), st in full.records.items():
        if layer not in layers:
            continue
        cols = st.columns
        rec = to_compact_cols(cols) if config.guidance_kind == "compact" else cols
        out.records[(site, layer)] = RowStore({"K": st.meta["K"], "kind": config.guidance_kind}, dict(rec), st.keys)
    out.routes = full.routes
    return out


def to_compact_cols(cols: dict) -> dict:
    from ..tensor import GuidanceRecord

    r = to_compact(GuidanceRecord("full", cols["payload"], cols["scales"], cols["g"]))
    return {"payload": r.payload, "scales": r.scales, "g": r.g}


def merge_signed_zero(codes: GuidanceCache) -> GuidanceCache:
    """A copy of captured full codes with -0 (code 0x8) written as +0 (0x0): both decode to the value 0.

    Guided rounding (SPEC 5) takes the sign of a zero from the trainer's own value, so a value that rounds to 0
    and changes sign between rollout and trainer gives 0x8 vs 0x0; comparing these copies counts FP4 values."""
    out = GuidanceCache(codes.config, codes.model_signature, codes.layers)
    for key, st in codes.records.items():
        nib = F.unpack_nibbles(st.columns["payload"])
        cols = dict(st.columns)
        cols["payload"] = F.pack_nibbles(torch.where(nib == 0x8, torch.zeros_like(nib), nib))
        out.records[key] = RowStore(st.meta, cols, st.keys)
    out.routes = codes.routes
    return out


def guidance_bytes_per_token(cache: GuidanceCache, num_tokens: int) -> float:
    """Guidance record bytes (payload + scales + g; routes excluded) per token processed by the rollout."""
    return cache.nbytes(include_routes=False) / max(1, num_tokens)


def route_bytes_per_token(cache: GuidanceCache, num_tokens: int) -> float:
    return sum(s.nbytes() for s in cache.routes.values()) / max(1, num_tokens)


# ---- the demo -----------------------------------------------------------------------------------------------------


def run(run_spec: RunSpec, device="cpu", out_dir=None, cache_dir=None, retrain=False, progress=True, log=print) -> dict:
    """Runs the whole demo; returns the report dict (also written to ``out_dir`` with a PNG when given)."""
    with warnings.catch_warnings():  # transformers 5.24 deprecates past_key_values= (5.17 needs it)
        warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
        return _run(run_spec, device, out_dir, cache_dir, retrain, progress, log)


def _run(run_spec: RunSpec, device, out_dir, cache_dir, retrain, progress, log) -> dict:
    from tqdm.auto import tqdm

    from ..integrations.hf_kvcache import FP4KVCache
    from ..integrations.hf_moe import convert
    from .session import rollout, train

    t_start = time.time()
    device = torch.device(device)
    spec = run_spec.model
    model, info = load_or_train(spec, cache_dir=cache_dir, device=device, retrain=retrain, progress=progress)
    log(
        f"model: Qwen3-MoE {spec.model.num_hidden_layers} layers, hidden {spec.model.hidden_size}, {spec.model.num_experts} "
        f"experts top-{spec.model.num_experts_per_tok}, head_dim {spec.model.head_dim}; "
        f"{'cached weights' if info.get('cached') else 'trained now'} (greedy token accuracy {info.get('greedy_token_accuracy', float('nan')):.3f})"
    )
    set_experts_implementation(model, "eager")
    model = model.to(device=device, dtype=torch.bfloat16).eval()
    record_cfg = FP4Config(guidance_layers=None, guidance_kind="full")
    convert(model, record_cfg)
    record_cfg = model._trace_fp4_config
    layout = model._trace_fp4_layout
    task = spec.task
    gen = torch.Generator().manual_seed(run_spec.seed)
    prompts = task.prompts(run_spec.num_samples, gen)
    steps = task.response_len
    n_arms = len(ARMS)
    bar = tqdm(total=2 * steps + n_arms, desc="rollouts + trainer arms", disable=not progress)
    t0 = time.time()
    seq_ids = torch.arange(run_spec.num_samples)
    # 1. rollouts (same prompts, independent samples)
    with rollout(model, record_cfg, sequence_ids=seq_ids, mode="bf16") as rec_bf16, engine_numerics(model):
        from transformers import DynamicCache

        seqs_bf16, lp_roll_bf16 = decode(model, prompts, steps, DynamicCache(), run_spec.temperature,
                                         torch.Generator().manual_seed(run_spec.seed + 1), bar)
    with rollout(model, record_cfg, sequence_ids=seq_ids, capture_codes=True) as rec_fp4, engine_numerics(model):
        seqs_fp4, lp_roll_fp4 = decode(model, prompts, steps, FP4KVCache(model), run_spec.temperature,
                                       torch.Generator().manual_seed(run_spec.seed + 2), bar)
    t_rollout = time.time() - t0
    rec_fp4.cache.synchronize()
    rollout_tokens = run_spec.num_samples * (task.seq_len - 1)
    rollout_values = merge_signed_zero(rec_fp4.codes)
    # 2. trainer arms
    arms = []
    for key, label, roll, mode, guide in ARMS:
        seqs, lp_roll, rec = (seqs_bf16, lp_roll_bf16, rec_bf16) if roll == "bf16" else (seqs_fp4, lp_roll_fp4, rec_fp4)
        cfg = record_cfg
        guidance = rec.cache
        if guide is not None:
            cfg = record_cfg.with_(guidance_layers=guide[0], guidance_kind=guide[1])
            guidance = derive_guidance(rec.cache, cfg, layout)
        with train(model, cfg, mode=mode, guidance=guidance, sequence_ids=seq_ids, capture_codes=True) as sess:
            lp_train = response_logprobs(model, seqs, task.prompt_len, run_spec.temperature)
        panel = mismatch_metrics(lp_train.cpu(), lp_roll.cpu())
        panel["router_flip_rate"] = router_flip_rate(rec.cache, sess.codes)
        agreement = {}
        if mode != "bf16":
            raw = site_agreement(rec_fp4.codes, sess.codes)
            agreement = {k: v for k, v in site_agreement(rollout_values, merge_signed_zero(sess.codes)).items() if "@" in k}
            for k, v in agreement.items():
                v["code_agreement_raw"] = raw[k]["code_agreement"]
        guided_layers_set = sorted(guided_layers(cfg, layout)) if mode == "guided" else []
        gb = guidance_bytes_per_token(guidance, rollout_tokens) if mode == "guided" else 0.0
        arms.append({
            "key": key,
            "label": label,
            "rollout": roll,
            "trainer": mode,
            "guidance_layers": guided_layers_set,
            "guidance_kind": guide[1] if guide else None,
            "guidance_bytes_per_token": gb,
            "route_bytes_per_token": route_bytes_per_token(rec.cache, rollout_tokens),
            "metrics": panel,
            "agreement": dict(sorted(agreement.items(), key=lambda kv: (_layer_of(kv[0]), kv[0]))),
            "guided_code_agreement_min": min(
                [v["code_agreement"] for k, v in agreement.items() if _layer_of(k) in guided_layers_set] or [float("nan")]
            ),
        })
        bar.update(1)
    bar.close()
    report = {
        "demo": "trace_ext TRACE alignment",
        "device": str(device),
        "model": spec.to_dict(),
        "model_info": {k: v for k, v in info.items() if k != "spec"},
        "num_samples": run_spec.num_samples,
        "response_tokens_per_arm": int(lp_roll_fp4.numel()),
        "temperature": run_spec.temperature,
        "fp4_config": record_cfg.to_dict(),
        "agreement_note": "code_agreement counts +0 and -0 (E2M1 codes 0x0 / 0x8) as one value; code_agreement_raw "
                          "compares the 4-bit codes as they are (SPEC 5 takes the sign of a zero from the trainer's value)",
        "rollout_seconds": t_rollout,
        "total_seconds": time.time() - t_start,
        "arms": arms,
    }
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=1, default=float))
        plot(report, out / "mismatch.png")
    return report


def _layer_of(site_key: str) -> int:
    return int(site_key.rsplit("@", 1)[1])


# ---- output -----------------------------------------------------------------------------------------------------------


TABLE_COLUMNS = (  # (header, metric, format): the SPEC 9 panel
    ("k3_kl", "k3_kl", "{:.2e}"),
    ("kl", "kl", "{:+.2e}"),
    ("|dlogp|", "logprob_abs_diff", "{:.2e}"),
    ("mult_err", "token_mult_prob_error", "{:.4f}"),
    ("mean|dp|", "prob_abs_diff_mean", "{:.2e}"),
    ("max|dp|", "prob_abs_diff_max", "{:.3f}"),
    ("pearson", "prob_pearson", "{:.5f}"),
    ("out[.5,2]", "ratio_outside_[0.5,2]", "{:.4f}"),
    ("ess", "ess", "{:.4f}"),
    ("rflip", "router_flip_rate", "{:.4f}"),
)


def format_table(report: dict) -> str:
    """One row per arm: the SPEC 9 panel on sampled tokens, router flips (before replay), guidance bytes/token."""
    cols = ("arm",) + tuple(h for h, _, _ in TABLE_COLUMNS) + ("guide B/tok",)
    rows = []
    for a in report["arms"]:
        m = a["metrics"]
        rows.append((a["label"],) + tuple(f.format(m[k]) for _, k, f in TABLE_COLUMNS) + (f"{a['guidance_bytes_per_token']:.0f}",))
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    line = lambda r: "  ".join(s.ljust(w) if i == 0 else s.rjust(w) for i, (s, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([line(cols), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def format_agreement(report: dict) -> str:
    """Per-layer FP4 code agreement (trainer vs rollout) of the arms that quantize, over all sites of a layer."""
    arms = [a for a in report["arms"] if a["agreement"]]
    if not arms:
        return ""
    layers = sorted({int(k.split("@")[1]) for a in arms for k in a["agreement"]})
    head = ["layer"] + [a["key"] for a in arms]
    rows = []
    for layer in layers:
        r = [str(layer)]
        for a in arms:
            items = [v for k, v in a["agreement"].items() if int(k.split("@")[1]) == layer]
            n = sum(v["rows"] for v in items)
            agree = sum(v["code_agreement"] * v["rows"] for v in items) / n if n else float("nan")
            mark = "*" if layer in a["guidance_layers"] else " "
            r.append(f"{100 * agree:8.4f}%{mark}")
        rows.append(r)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(s.rjust(w) for s, w in zip(head, widths))] + ["  ".join(s.rjust(w) for s, w in zip(r, widths)) for r in rows]
    return ("agreement with the rollout's FP4 codes, +0 and -0 as one value (all quantized sites of the layer; "
            "* = guided layer)\n" + "\n".join(lines))


def plot(report: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = report["arms"]
    labels = [SHORT_LABELS.get(a["key"], a["key"]) for a in arms]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, (m, title) in zip(axes[:2], (("k3_kl", "k3 KL (train vs rollout)"), ("logprob_abs_diff", "mean |dlogp|"))):
        vals = [max(a["metrics"][m], 1e-12) for a in arms]
        ax.bar(range(len(arms)), vals, color=["#888"] + ["#c44"] * 2 + ["#48c"] * 3)
        ax.set_yscale("log")
        ax.set_xticks(range(len(arms)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(title)
    ax = axes[2]
    for a in arms:
        if not a["agreement"]:
            continue
        layers = sorted({int(k.split("@")[1]) for k in a["agreement"]})
        vals = []
        for layer in layers:
            items = [v for k, v in a["agreement"].items() if int(k.split("@")[1]) == layer]
            n = sum(v["rows"] for v in items)
            vals.append(100 * (1 - sum(v["code_agreement"] * v["rows"] for v in items) / n))
        ax.plot(layers, [max(v, 1e-4) for v in vals], marker="o", label=a["label"])
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_xticks(sorted({int(k.split("@")[1]) for a in arms for k in a["agreement"]}))
    ax.set_title("FP4 values differing from the rollout's (%; 0 drawn at 1e-4)")
    ax.legend(fontsize=7)
    fig.suptitle(f"TRACE demo: {report['response_tokens_per_arm']} sampled response tokens per arm ({report['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m trace_ext.rl.demo",
        description="TRACE alignment demo: FP4 rollout vs trainer log-prob mismatch on a small Qwen3-MoE, six arms "
        "(bf16 floor, naive FP4, RTN-QAT, TRACE deeper half / all layers compact / all layers full codes).",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--out", default="demo_out", help="directory for report.json and mismatch.png")
    p.add_argument("--cache-dir", default=None, help="trained-weights cache (default ~/.cache/trace_ext/demo)")
    p.add_argument("--quick", action="store_true", help="smaller model and fewer samples (tests)")
    p.add_argument("--retrain", action="store_true", help="retrain the demo model even when cached")
    p.add_argument("--samples", type=int, default=None, help="sampled completions per rollout")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's; 1 is far faster on a machine busy with other jobs)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(max(1, args.threads))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rs = QUICK_RUN if args.quick else FULL_RUN
    if args.samples is not None:
        rs = RunSpec(rs.model, args.samples, rs.temperature, rs.seed)
    report = run(rs, device=device, out_dir=args.out, cache_dir=args.cache_dir, retrain=args.retrain, progress=not args.no_progress)
    print()
    print(format_table(report))
    print()
    print(format_agreement(report))
    print(f"\nreport: {Path(args.out) / 'report.json'}, plot: {Path(args.out) / 'mismatch.png'}; "
          f"rollouts {report['rollout_seconds']:.0f} s, total {report['total_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
