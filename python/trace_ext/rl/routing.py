"""Routing replay (R3, Ma et al. 2025): the rollout's top-k experts per (token, layer), replayed in the trainer.

A forward hook on each transformers 5.x router (``(router_logits, top_k_weights, top_k_index)`` outputs)
records the top-k ids during rollout. In the trainer it swaps in the recorded ids and recomputes their
weights from the router logits of this forward, with the router's own scoring rule, so the router still
receives gradients (only the selection is replayed, never the probabilities).
"""
from __future__ import annotations

import torch

from .guidance import GuidanceError

ROUTER_KINDS = ("softmax_topk", "sigmoid_group", "topk_softmax")


def router_kind(router: torch.nn.Module) -> str:
    """How the router turns logits into top-k weights.

    softmax_topk: softmax over all experts, gather, renormalise if ``norm_topk_prob`` (Qwen2/3-MoE, OLMoE;
        Mixtral always renormalises). sigmoid_group: DeepSeek-V3 (sigmoid scores, grouped choice with
        ``e_score_correction_bias``, renormalise, * routed_scaling_factor). topk_softmax: gpt-oss (softmax over
        the top-k logits).
    """
    name = type(router).__name__
    if name.endswith(("TopKRouter", "TopkRouter")):
        if hasattr(router, "e_score_correction_bias"):
            return "sigmoid_group"
        if name.startswith("GptOss"):
            return "topk_softmax"
        return "softmax_topk"
    raise ValueError(f"unsupported router {name}: routing replay knows Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3 and gpt-oss")


def replay_weights(router: torch.nn.Module, logits: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Top-k weights of the experts ``idx`` [T, k] under this router's rule, differentiable in ``logits`` [T, E].

    ``dtype``: a floating dtype for the weights. Expert ids outside [0, E) are a ValueError on CPU; on a GPU that
    check would cost a host sync per router call, so device ids are checked by the caller (``router_hook`` checks the
    recorded ids once before replaying them), and an out-of-range device id fails in ``gather``.
    """
    if not isinstance(router, torch.nn.Module):
        raise TypeError(f"router must be a torch.nn.Module (the MoE router), got {type(router).__name__}")
    kind = router_kind(router)
    _check_replay_args(logits, idx, dtype)
    idx = idx.long()
    if kind == "softmax_topk":
        w = torch.softmax(logits.float(), dim=-1).gather(1, idx)
        if getattr(router, "norm_topk_prob", True):
            w = w / w.sum(dim=-1, keepdim=True)
    elif kind == "sigmoid_group":
        w = logits.float().sigmoid().gather(1, idx)
        if getattr(router, "norm_topk_prob", True):
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        w = w * router.routed_scaling_factor
    else:
        w = torch.softmax(logits.gather(1, idx), dim=1)
    return w.to(dtype)


def _check_replay_args(logits, idx, dtype) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        got = getattr(logits, "dtype", type(logits).__name__)
        raise TypeError(f"replay_weights: logits must be a floating tensor [T, E], got {got}")
    if not isinstance(idx, torch.Tensor) or idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        got = getattr(idx, "dtype", type(idx).__name__)
        raise TypeError(f"replay_weights: idx must be an integer tensor of expert ids [T, k], got {got}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"replay_weights: dtype must be a floating torch.dtype (the weights' dtype), got {dtype!r}")
    if logits.dim() != 2:
        raise ValueError(f"replay_weights: logits must be [T, E], got shape {tuple(logits.shape)}")
    if idx.dim() != 2 or idx.shape[0] != logits.shape[0]:
        raise ValueError(
            f"replay_weights: idx must be [T, k] with T = {logits.shape[0]} (the rows of logits), got shape {tuple(idx.shape)}"
        )
    if idx.device != logits.device:
        raise RuntimeError(f"replay_weights: idx is on {idx.device} but logits on {logits.device}; move them to one device")
    E = logits.shape[1]
    if idx.device.type == "cpu" and idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < E):
        raise ValueError(f"replay_weights: expert ids in idx must be in [0, {E}), got [{int(idx.min())}, {int(idx.max())}]")


def router_hook(module, args, output):
    """Forward hook installed on routers by ``convert``: record (rollout) or replay (trainer) the top-k ids."""
    from .session import current_session

    sess = current_session()
    if sess is None or not (sess.record_routes_on or sess.replay_routes_on or sess.codes is not None):
        return None
    if not (isinstance(output, tuple) and len(output) == 3):
        raise RuntimeError(f"{type(module).__name__}: expected (router_logits, top_k_weights, top_k_index), got {type(output).__name__}")
    logits, weights, idx = output
    layer = module._trace_fp4_layer
    keys = sess.row_keys()
    if keys[0].numel() != idx.shape[0]:
        raise GuidanceError(f"router of layer {layer}: {idx.shape[0]} token rows, but the forward call has {keys[0].numel()} tokens")
    if sess.role == "train":
        sess.capture_routes(layer, keys, idx)  # the router's own choice, for router_flip_rate
    if sess.record_routes_on:
        sess.record_routes(layer, keys, idx)
        return None
    if not sess.replay_routes_on:
        return None
    rep = sess.replay_routes(layer, keys)
    if rep.shape != idx.shape:
        raise GuidanceError(f"routes[{layer}]: recorded top-k shape {tuple(rep.shape)} != router output {tuple(idx.shape)}")
    if bool(((rep >= logits.shape[-1]) | (rep < 0)).any()):  # one host sync per router call
        raise GuidanceError(f"routes[{layer}]: recorded expert ids outside [0, {logits.shape[-1]}): guidance from another model?")
    rep = rep.to(device=idx.device, dtype=idx.dtype)  # (the router's device: a sharded model's layer)
    return logits, replay_weights(module, logits, rep, weights.dtype), rep


def topk_sets_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bool [T]: whether the top-k sets (order ignored) of two [T, k] index tensors differ."""
    if a.shape != b.shape:
        raise ValueError(f"top-k shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)
