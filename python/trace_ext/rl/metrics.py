"""Train-rollout mismatch metrics (SPEC 9), with the names verl / slime / NeMo-RL use, plus TRACE's own.

On sampled response tokens (``mask``), ``r_t = logp_train - logp_rollout``:
``kl`` (k1) = mean(-r), ``k3_kl`` = mean(exp(r) - r - 1), ``logprob_abs_diff`` = mean |r|,
``token_mult_prob_error`` = mean exp(|r|), ``prob_abs_diff_mean`` / ``_max`` on exp(logp), ``prob_pearson``,
``ratio_outside_[0.5,2]``, ``ess`` = 1 / mean((w / mean w)^2) with w = exp(r).
MoE: ``router_flip_rate`` = fraction of (token, layer) whose top-k set differs. TRACE: per quantization site,
``code_agreement`` / ``scale_agreement`` = fraction of elements (block scales) equal to the rollout's, and the
guidance bytes per token. Everything is computed in float64 and returned as Python floats.
"""
from __future__ import annotations

import torch

from .. import formats as F
from .guidance import GuidanceCache, GuidanceError
from .routing import topk_sets_differ

RATIO_LOW, RATIO_HIGH = 0.5, 2.0


def mismatch_metrics(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor | None = None) -> dict:
    """SPEC 9 panel over the tokens selected by ``mask`` (same shape as the log-probs; all tokens when None).

    The log-probs are floating tensors. ``mask`` is a bool tensor, or an integer / floating one holding only 0 and 1
    (a response mask as verl builds it); any other value (0.5, 2) is a ValueError rather than a guess.
    """
    for name, t in (("logp_train", logp_train), ("logp_rollout", logp_rollout)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor of log-probs, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor of log-probs, got {t.dtype}")
    if logp_train.shape != logp_rollout.shape:
        raise ValueError(f"logp_train {tuple(logp_train.shape)} and logp_rollout {tuple(logp_rollout.shape)} differ in shape")
    if mask is None:
        mask = torch.ones_like(logp_train, dtype=torch.bool)
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a tensor (bool, or 0/1 values) or None, got {type(mask).__name__}")
    if mask.shape != logp_train.shape:
        raise ValueError(f"mask must have shape {tuple(logp_train.shape)}, got {tuple(mask.shape)}")
    m = _bool_mask(mask)
    lt = logp_train.detach().double()[m]
    lr = logp_rollout.detach().double()[m].to(lt.device)
    if lt.numel() == 0:
        raise ValueError("mask selects no tokens")
    r = lt - lr
    w = torch.exp(r)
    pt, pr = torch.exp(lt), torch.exp(lr)
    dp = (pt - pr).abs()
    wn = w / w.mean()
    return {
        "kl": float((-r).mean()),
        "k3_kl": float((w - r - 1).mean()),
        "logprob_abs_diff": float(r.abs().mean()),
        "logprob_abs_diff_max": float(r.abs().max()),
        "token_mult_prob_error": float(torch.exp(r.abs()).mean()),
        "prob_abs_diff_mean": float(dp.mean()),
        "prob_abs_diff_max": float(dp.max()),
        "prob_pearson": _pearson(pt, pr),
        "ratio_outside_[0.5,2]": float(((w < RATIO_LOW) | (w > RATIO_HIGH)).double().mean()),
        "ess": float(1.0 / (wn * wn).mean()),
        "tokens": int(lt.numel()),
    }


def _bool_mask(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"mask must be bool, integer or floating (0/1 values), got {mask.dtype}")
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        bad = mask[(mask != 0) & (mask != 1)].reshape(-1)[0].item()
        raise ValueError(f"mask must hold only 0 and 1 (or be bool), got the value {bad}")
    return mask != 0


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    den = torch.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / den) if float(den) > 0 else float("nan")


def router_flip_rate(rollout, trainer, per_layer: bool = False):
    """Fraction of (token, layer) whose top-k expert set differs between rollout and trainer.

    Either two index tensors [..., k] of equal shape, or two GuidanceCaches (the rollout's ``rec.cache`` and the
    trainer's ``sess.codes`` from ``train(..., capture_codes=True)``, which keeps the router's own choice before
    replay), compared per layer on the (seq, pos) keys both hold. ``per_layer`` adds {layer: rate}.
    """
    if isinstance(rollout, torch.Tensor) or isinstance(trainer, torch.Tensor):
        _check_topk_pair(rollout, trainer)
        d = topk_sets_differ(rollout.reshape(-1, rollout.shape[-1]), trainer.reshape(-1, trainer.shape[-1]).to(rollout.device))
        return float(d.double().mean()) if d.numel() else float("nan")
    _check_caches(rollout, trainer)
    flips, total, layers = 0, 0, {}
    for layer, store in sorted(rollout.routes.items()):
        other = trainer.routes.get(layer)
        if other is None:
            continue
        idx, found = other.find(store.keys)
        if not bool(found.any()):
            continue
        a = store.columns["topk"][found.to(store.keys.device)].long()
        b = other.columns["topk"][idx[found]].long().to(a.device)
        d = topk_sets_differ(a, b)
        layers[layer] = float(d.double().mean())
        flips += int(d.sum())
        total += d.numel()
    if total == 0:
        raise GuidanceError("router_flip_rate: the caches share no routed (token, layer) rows")
    rate = flips / total
    return (rate, layers) if per_layer else rate


def site_agreement(rollout_codes: GuidanceCache, trainer_codes: GuidanceCache) -> dict:
    """Per site (and per "site@layer"): code_agreement, scale_agreement, rows, over the rows both caches hold.

    Needs full codes on both sides: ``rollout(..., capture_codes=True)`` -> ``rec.codes`` and
    ``train(..., capture_codes=True)`` -> ``sess.codes``.
    """
    _check_caches(rollout_codes, trainer_codes)
    acc: dict = {}
    out: dict = {}
    for (site, layer), store in sorted(rollout_codes.records.items()):
        other = trainer_codes.records.get((site, layer))
        if other is None:
            continue
        if store.meta["kind"] != "full" or other.meta["kind"] != "full":
            raise GuidanceError("site_agreement needs full codes on both sides (capture_codes=True)")
        if store.meta["K"] != other.meta["K"]:
            raise GuidanceError(f"{site}[{layer}]: K differs ({store.meta['K']} vs {other.meta['K']})")
        idx, found = other.find(store.keys)
        if not bool(found.any()):
            continue
        dev = store.keys.device
        ca = F.unpack_nibbles(store.columns["payload"][found.to(dev)])
        cb = F.unpack_nibbles(other.columns["payload"][idx[found]]).to(ca.device)
        sa = store.columns["scales"][found.to(dev)]
        sb = other.columns["scales"][idx[found]].to(sa.device)
        c_eq, c_n = int((ca == cb).sum()), ca.numel()
        s_eq, s_n = int((sa == sb).sum()), sa.numel()
        out[f"{site}@{layer}"] = {"code_agreement": c_eq / c_n, "scale_agreement": s_eq / s_n, "rows": int(found.sum())}
        a = acc.setdefault(site, [0, 0, 0, 0, 0])
        a[0] += c_eq
        a[1] += c_n
        a[2] += s_eq
        a[3] += s_n
        a[4] += int(found.sum())
    if not acc:
        raise GuidanceError("site_agreement: the caches share no (site, layer, row)")
    for site, (ce, cn, se, sn, rows) in acc.items():
        out[site] = {"code_agreement": ce / cn, "scale_agreement": se / sn, "rows": rows}
    return out


def guidance_bytes_per_token(cache: GuidanceCache, include_routes: bool = False) -> float:
    """Guidance payload (records; routes too when asked) per recorded token."""
    return cache.bytes_per_token(include_routes)


def _check_topk_pair(a, b):
    """Two expert-id tensors [..., k] of one shape (compared row by row: a reshape would pair unrelated rows)."""
    for name, t in (("rollout", a), ("trainer", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"router_flip_rate: {name} must be a top-k tensor like the other argument, got {type(t).__name__}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"router_flip_rate: {name} must hold integer expert ids, got {t.dtype}")
        if t.dim() < 1:
            raise ValueError(f"router_flip_rate: {name} must be [..., k] expert ids, got a 0-d tensor")
    if a.shape != b.shape:
        raise ValueError(
            f"router_flip_rate: rollout {tuple(a.shape)} and trainer {tuple(b.shape)} must have the same shape [..., k]"
        )


def _check_caches(a, b):
    for name, c in (("rollout", a), ("trainer", b)):
        if not isinstance(c, GuidanceCache):
            raise TypeError(f"{name} must be a GuidanceCache (or a top-k tensor for router_flip_rate), got {type(c).__name__}")
