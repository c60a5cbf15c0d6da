"""One activation quantization site in each mode (SPEC 2, 5): what the rollout quantizes and records, and
what the trainer fake-quantizes (RTN, SR, or guided by the rollout's record).

``keys_fn`` returns the rows' keys (only called when a record is kept or read, so unkeyed callers pay nothing).
"""
from __future__ import annotations

import torch

from .. import ops
from ..autograd import fake_quantize, quantize_with_record
from ..rl.guidance import GuidanceError


def rollout_quantize(sess, site: str, layer: int, x: torch.Tensor, keys_fn):
    """Engine path: quantize rows of ``x`` [R, K] (RTN, per-row g) and record them when the policy keeps this site."""
    cfg = sess.config
    if cfg.format == "mxfp4":
        return ops.mxfp4_quantize(x, backend=cfg.backend)
    want_rec = sess.wants_record(site, layer)
    want_cap = sess.wants_capture()
    if not (want_rec or want_cap):
        return ops.nvfp4_quantize(x, backend=cfg.backend)
    keys = _keys(keys_fn, site, layer) if want_rec else keys_fn()
    if keys is None:  # unkeyed rows (4.x experts) are not captured for diagnostics
        return ops.nvfp4_quantize(x, backend=cfg.backend)
    # the kernel emits compact records itself; full codes only when the config or the diagnostics need them
    kind = "full" if (want_cap or cfg.guidance_kind == "full") else "compact"
    q, rec = quantize_with_record(x, kind=kind, backend=cfg.backend)
    if want_rec:
        sess.record(site, layer, keys, rec)
    if want_cap:
        sess.capture(site, layer, keys, rec)
    return q


def train_fake_quantize(sess, site: str, layer: int, x: torch.Tensor, keys_fn, out_dtype: torch.dtype) -> torch.Tensor:
    """Trainer path: fake-quantize rows of ``x`` [R, K] with STE; guided where the session has guidance."""
    cfg = sess.config
    if cfg.format == "mxfp4":
        return fake_quantize(x, "mxfp4", out_dtype=out_dtype, backend=cfg.backend)
    keys = None
    kwargs = {"rounding": "rtn"}
    if sess.is_guided(site, layer):
        keys = _keys(keys_fn, site, layer)
        kwargs = sess.rounding_kwargs(site, layer, keys, x.shape[-1])
    elif sess.mode == "guided" and cfg.fallback_rounding == "sr":
        kwargs = {"rounding": "sr", **sess.sr_args(site, layer)}
    if sess.wants_capture():
        keys = keys if keys is not None else keys_fn()
    if keys is not None and sess.wants_capture():
        y, rec = fake_quantize(x, "nvfp4", capture=True, kind="full", out_dtype=out_dtype, backend=cfg.backend, **kwargs)
        sess.capture(site, layer, keys, rec)
        return y
    return fake_quantize(x, "nvfp4", out_dtype=out_dtype, backend=cfg.backend, **kwargs)


def _keys(keys_fn, site, layer):
    keys = keys_fn()
    if keys is None:
        raise GuidanceError(
            f"{site}[{layer}]: these rows carry no token identity (e.g. transformers 4.x ModuleList experts see routed "
            "subsets), so they cannot be recorded or guided; use 5.x fused experts or drop the group from guided_sites"
        )
    return keys
