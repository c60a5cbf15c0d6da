"""Hugging Face MoE models in FP4: convert / unconvert / verify (transformers 5.x and 4.x layouts).

transformers 5.x keeps routed experts as fused 3-D parameters (``gate_up_proj`` [E, 2I, H], ``down_proj``
[E, H, I]; gpt-oss transposed with interleaved gate/up and biases) behind ``@use_experts_implementation``.
``convert`` binds ``trace_ext.nn.fp4_experts_forward`` as each experts module's forward (parameters, names and
state_dict untouched) and also registers it as the "trace_fp4" experts backend; it hooks every top-k router
for routing replay (R3); it replaces nn.Linear by FP4Linear where the config asks (attention projections,
shared experts, dense MLPs, and 4.x ``ModuleList`` experts); and it installs the FP4 KV attention
(``hf_kvcache.install_fp4_kv``) when "kv" is a quantized site. Router, lm_head and embeddings stay bf16.
"""
from __future__ import annotations

import re
import types

import torch

from ..nn.experts import ExpertsSpec, fp4_experts_forward
from ..nn.linear import FP4Linear
from ..rl.config import FP4Config
from ..rl.guidance import LayerSite
from ..rl.routing import router_hook, router_kind

BACKEND_NAME = "trace_fp4"
SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ATTN_PARTS = ("self_attn", "attention", "attn")
_SHARED_PARTS = ("shared_expert", "shared_experts", "shared_mlp")
_V4_EXPERT_RE = re.compile(r"(?:^|\.)experts\.(\d+)\.")


def _layer_of(name: str) -> int | None:
    m = _LAYER_RE.search(name + ".")
    return int(m.group(1)) if m else None


def is_fused_experts(module) -> bool:
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gu, torch.nn.Parameter) and isinstance(dn, torch.nn.Parameter) and gu.dim() == 3 and dn.dim() == 3


def is_router(module) -> bool:
    try:
        router_kind(module)
    except ValueError:
        return False
    return isinstance(getattr(module, "weight", None), torch.nn.Parameter)


def _text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _fused_spec(name: str, module, layer: int, block: int) -> ExpertsSpec:
    transposed = bool(getattr(module, "is_transposed", type(module).__name__.startswith("GptOss")))
    has_bias = bool(getattr(module, "has_bias", getattr(module, "gate_up_proj_bias", None) is not None))
    E = module.gate_up_proj.shape[0]
    if transposed:
        H, I2 = module.gate_up_proj.shape[1], module.gate_up_proj.shape[2]
        I = module.down_proj.shape[1]
    else:
        I2, H = module.gate_up_proj.shape[1], module.gate_up_proj.shape[2]
        I = module.down_proj.shape[2]
    if I2 != 2 * I:
        raise ValueError(f"{name}: gate_up_proj has {I2} outputs, expected 2 * intermediate ({2 * I})")
    for what, K in (("hidden_size (gate_up K)", H), ("intermediate_size (down K)", I)):
        if K % block:
            raise ValueError(f"{name}: {what} = {K} must be a multiple of the {block}-element FP4 block")
    if E >= 2**15:
        raise ValueError(f"{name}: {E} experts; routing replay stores expert ids as int16 (< 32768)")
    return ExpertsSpec(layer, transposed, has_bias, E, H, I)


def _linear_group(name: str, module, parent_names: set, fused_parents: set) -> str | None:
    """The site group of an nn.Linear by its place in the model, or None when it stays bf16."""
    parts = name.split(".")
    if parts[-1] in ("gate", "router", "lm_head", "shared_expert_gate") or _layer_of(name) is None:
        return None
    if _V4_EXPERT_RE.search(name):
        return "experts"
    if any(p in _SHARED_PARTS for p in parts[:-1]):
        return "shared_experts"
    if any(p in _ATTN_PARTS for p in parts[:-1]):
        return "attn_proj"
    parent = ".".join(parts[:-1])
    if parts[-2:-1] and parts[-2] in ("mlp", "feed_forward") and parent not in fused_parents:
        return "dense_mlp"
    return None


def convert(model, config: FP4Config | None = None, *, linear_filter=None):
    """Swap FP4 compute into a Hugging Face MoE model in place; returns the model.

    config: FP4Config (default FP4Config()); ``num_layers`` is filled from the model.
    linear_filter(module, name) -> bool: optional extra filter over the nn.Linear candidates.
    Raises ValueError for a model without recognisable MoE experts, or a K that is not a multiple of the block.
    """
    if config is not None and not isinstance(config, FP4Config):
        raise TypeError(f"config must be a trace_ext.rl.FP4Config or None, got {type(config).__name__}")
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model must be a Hugging Face model (an nn.Module with a .config), got {type(model).__name__}")
    config = config or FP4Config()
    if getattr(model, "_trace_fp4_converted", False):
        raise ValueError("model is already converted; call unconvert(model) first")
    text = _text_config(model)
    model_type = getattr(text, "model_type", type(model).__name__)
    n_layers = getattr(text, "num_hidden_layers", None)
    if n_layers is None:
        raise ValueError(f"unsupported model type {model_type!r}: its config has no num_hidden_layers")
    config = config.with_(num_layers=int(n_layers)) if config.num_layers is None else config
    block = config.block
    named = dict(model.named_modules())

    fused = [(n, m) for n, m in named.items() if is_fused_experts(m)]
    v4 = [n for n, m in named.items() if isinstance(m, torch.nn.ModuleList) and n.split(".")[-1] == "experts"]
    if not fused and not v4:
        raise ValueError(
            f"unsupported model type {model_type!r} ({type(model).__name__}): no routed experts found (expected transformers "
            f"5.x fused experts with 3-D gate_up_proj/down_proj, or 4.x ModuleList experts). Supported: {SUPPORTED_MODEL_TYPES}"
        )
    layout: list[LayerSite] = []
    top_k = getattr(text, "num_experts_per_tok", None) or getattr(text, "num_experts_per_token", 1)
    plans = []
    for n, m in fused:
        layer = _layer_of(n)
        if layer is None:
            raise ValueError(f"{n}: cannot tell the decoder layer of this experts module (expected '...layers.<i>...')")
        plans.append((n, m, _fused_spec(n, m, layer, block)))
    routers = [(n, m) for n, m in named.items() if is_router(m) and _layer_of(n) is not None]
    router_layers = {_layer_of(n) for n, _ in routers}
    unrouted = [n for n, _, spec in plans if spec.layer not in router_layers]
    if unrouted and config.routing_replay:
        raise ValueError(
            f"unsupported model type {model_type!r}: no known top-k router next to {unrouted[0]} (routing replay knows "
            f"the routers of {SUPPORTED_MODEL_TYPES}); pass FP4Config(routing_replay=False) to convert without R3"
        )

    fused_parents = {n.rsplit(".", 1)[0] for n, _ in fused} | {n.rsplit(".", 1)[0] for n in v4}
    linears = []
    for n, m in named.items():
        if not isinstance(m, torch.nn.Linear):
            continue
        group = _linear_group(n, m, set(named), fused_parents)
        if group is None or not config.quantizes(group):
            continue
        if linear_filter is not None and not linear_filter(m, n):
            continue
        if m.in_features % block:
            raise ValueError(f"{n}: in_features = {m.in_features} must be a multiple of the {block}-element FP4 block")
        linears.append((n, m, group))

    # nothing has been changed yet: every check above raises before the model is touched; the KV install comes
    # first because it may still refuse the model (no attention modules, unsupported head_dim)
    if config.quantizes("kv"):
        from .hf_kvcache import install_fp4_kv

        install_fp4_kv(model, config)
    if config.quantizes("experts"):
        for n, m, spec in plans:
            m._trace_fp4 = spec
            m.forward = types.MethodType(fp4_experts_forward, m)
            layout.append(LayerSite("expert_in", spec.layer, spec.hidden_size, 1))
            layout.append(LayerSite("expert_down_in", spec.layer, spec.intermediate_size, int(top_k)))
    handles = []
    for n, m in routers:
        m._trace_fp4_layer = _layer_of(n)
        handles.append(m.register_forward_hook(router_hook))
    for n, m, group in linears:
        layer = _layer_of(n)
        short = n.split(".")[-1]
        site = f"{group}.{short}"
        _set_module(model, n, FP4Linear(m, site, layer, group, block))
        if group != "experts" or not _V4_EXPERT_RE.search(n):
            key = LayerSite(site, layer, m.in_features, 1)
            if key not in layout:
                layout.append(key)
    if config.quantizes("kv"):
        kvh = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads")
        hd = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        for layer in range(config.num_layers):
            layout.append(LayerSite("kv_k", layer, int(hd), int(kvh)))
            layout.append(LayerSite("kv_v", layer, int(hd), int(kvh)))
    _register_backend()
    model._trace_fp4_config = config
    model._trace_fp4_layout = layout
    model._trace_fp4_converted = True
    model._trace_fp4_routers = len(routers)
    model._trace_fp4_handles = handles
    return model


def unconvert(model):
    """Inverse of ``convert``: original forwards, nn.Linear modules and attention; packed weights dropped."""
    if not getattr(model, "_trace_fp4_converted", False):
        raise ValueError("model is not converted")
    for n, m in list(model.named_modules()):
        if hasattr(m, "_trace_fp4") and is_fused_experts(m):
            if "forward" in m.__dict__:
                del m.forward
            del m._trace_fp4
            if hasattr(m, "_trace_fp4_packed"):
                del m._trace_fp4_packed
        if hasattr(m, "_trace_fp4_layer"):
            del m._trace_fp4_layer
        if isinstance(m, FP4Linear):
            _set_module(model, n, m.to_linear())
    for h in model._trace_fp4_handles:
        h.remove()
    if model._trace_fp4_config.quantizes("kv"):
        from .hf_kvcache import uninstall_fp4_kv

        uninstall_fp4_kv(model)
    for a in ("_trace_fp4_config", "_trace_fp4_layout", "_trace_fp4_converted", "_trace_fp4_routers", "_trace_fp4_handles"):
        delattr(model, a)
    return model


def verify(model) -> dict:
    """Raise if any targeted expert (or router, or targeted Linear) of a converted model was missed.

    Returns counts: {"fused_experts", "v4_expert_linears", "routers", "fp4_linears"}.
    """
    if not getattr(model, "_trace_fp4_converted", False):
        raise ValueError("verify: the model was not converted (trace_ext.integrations.hf_moe.convert)")
    config = model._trace_fp4_config
    missed = []
    counts = {"fused_experts": 0, "v4_expert_linears": 0, "routers": 0, "fp4_linears": 0}
    for n, m in model.named_modules():
        if is_fused_experts(m):
            if config.quantizes("experts"):
                if getattr(m, "_trace_fp4", None) is None or m.__dict__.get("forward") is None:
                    missed.append(f"{n} ({type(m).__name__}: fused experts not converted)")
                else:
                    counts["fused_experts"] += 1
        elif isinstance(m, torch.nn.Linear) and config.quantizes("experts") and _V4_EXPERT_RE.search(n) and _layer_of(n) is not None:
            missed.append(f"{n} (4.x expert nn.Linear not replaced)")
        elif isinstance(m, FP4Linear):
            counts["fp4_linears"] += 1
            counts["v4_expert_linears"] += int(m.group == "experts")
        if is_router(m) and _layer_of(n) is not None:
            if getattr(m, "_trace_fp4_layer", None) is None:
                missed.append(f"{n} ({type(m).__name__}: router not hooked for routing replay)")
            else:
                counts["routers"] += 1
    if missed:
        raise RuntimeError("FP4 conversion missed targeted modules:\n  " + "\n  ".join(missed))
    if config.quantizes("experts") and counts["fused_experts"] + counts["v4_expert_linears"] == 0:
        raise RuntimeError("FP4 conversion found no converted experts")
    return counts


def _set_module(model, name: str, new) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _backend_forward(self, hidden_states, top_k_index, top_k_weights):
    if getattr(self, "_trace_fp4", None) is None:
        raise ValueError(f"experts_implementation '{BACKEND_NAME}' needs a converted model (trace_ext.integrations.hf_moe.convert)")
    return fp4_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def _register_backend() -> bool:
    """Register "trace_fp4" in transformers' ExpertsInterface (5.x); False where the interface does not exist."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    ALL_EXPERTS_FUNCTIONS.register(BACKEND_NAME, _backend_forward)
    return True
