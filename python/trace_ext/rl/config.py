"""FP4Config: what the alignment layer quantizes, in which format, and how guidance is kept (SPEC 2, 5, 7, 8).

One object describes both sides of an RL step. The rollout (engine path) and the trainer (QAT path) read the
same config, so the trainer rounds every quantization site exactly where the rollout did.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .._args import check_bool, is_int
from ..kvcache import _check_static_g

FORMATS = ("nvfp4", "mxfp4")
ACTIVATIONS = ("w4a4", "w4a16")
MODES = ("bf16", "rollout", "qat", "guided")
SITE_GROUPS = ("experts", "kv", "attn_proj", "shared_experts", "dense_mlp")
GUIDANCE_KINDS = ("compact", "full")
FALLBACK_ROUNDINGS = ("rtn", "sr")
OFFLOADS = ("auto", "async", "none")

# Activation quantization sites (the keys of guidance records), by site group:
#   experts:        "expert_in" (gate_up input, keys (seq, pos)), "expert_down_in" (keys (seq, pos, top-k slot))
#   kv:             "kv_k", "kv_v" (keys (seq, pos, kv_head)); recorded by the FP4 KV attention
#   attn_proj / shared_experts / dense_mlp: "<group>.<linear name>", e.g. "attn_proj.q_proj" (keys (seq, pos))
EXPERT_SITES = ("expert_in", "expert_down_in")
KV_SITES = ("kv_k", "kv_v")


def site_group(site: str) -> str:
    """The config group a quantization site belongs to ("expert_in" -> "experts", "kv_k" -> "kv", ...)."""
    if site in EXPERT_SITES:
        return "experts"
    if site in KV_SITES:
        return "kv"
    group = site.split(".", 1)[0]
    if group in SITE_GROUPS:
        return group
    raise ValueError(f"unknown quantization site {site!r}; expected one of {EXPERT_SITES + KV_SITES} or '<group>.<name>'")


@dataclass(frozen=True)
class FP4Config:
    """Configuration of the FP4 alignment layer.

    format: "nvfp4" (16-element E4M3 blocks + fp32 second-level scale) or "mxfp4" (32-element E8M0 blocks).
        Rollout guidance (SPEC 5) is defined for NVFP4 only; "mxfp4" supports the bf16, rollout and qat modes.
    activation: "w4a4" (expert activations quantized, SPEC 7 W4A4) or "w4a16" (weights only).
    sites: site groups quantized: "experts" (routed-expert GEMM weights + activations) and "kv" (the KV cache)
        by default, as in TRACE; optionally "attn_proj", "shared_experts", "dense_mlp" (nn.Linear replacement).
    guided_sites: site groups whose activations the trainer rounds with the rollout's guidance in guided mode
        (default: experts and KV, TRACE's scope). Other quantized groups use ``fallback_rounding``.
    guidance_layers: "deeper_half" (layers >= num_layers // 2, TRACE's choice), an explicit list of layer
        indices, or None (all layers). Ignored when ``guidance_budget_bytes_per_token`` is set.
    guidance_budget_bytes_per_token: keep guidance for the deepest layers whose summed record size per token
        stays within this many bytes.
    guidance_kind: "compact" (mantissa bit + scale bytes + g: K/8 + K/16 + 4 bytes per row) or "full" codes.
    fallback_rounding: rounding of activations without guidance in guided mode: "rtn" or "sr" (seed ``sr_seed``).
    routing_replay: replay the rollout's top-k experts in the trainer (R3). Guided mode always replays: expert
        input guidance is keyed by the rollout's expert choice.
    kv_g_k, kv_g_v: static per-layer decode scales of the FP4 KV cache (SPEC 8).
    num_layers: decoder layers of the model; set by ``integrations.hf_moe.convert``.
    offload: "auto" (async to pinned CPU memory when records live on a GPU), "async" or "none" (keep on device).
    offload_chunk_bytes: pending device bytes that trigger one background copy to pinned memory.
    qat_compute_dtype: dtype of the trainer's fake-quantized GEMMs (float32 keeps the fp32 accumulation of SPEC 7).
    backend: "auto" | "cuda" | "reference", passed to every trace_ext.ops call.
    """

    format: str = "nvfp4"
    activation: str = "w4a4"
    sites: frozenset = field(default_factory=lambda: frozenset({"experts", "kv"}))
    guided_sites: frozenset = field(default_factory=lambda: frozenset({"experts", "kv"}))
    guidance_layers: object = "deeper_half"
    guidance_budget_bytes_per_token: int | None = None
    guidance_kind: str = "compact"
    fallback_rounding: str = "rtn"
    sr_seed: int = 0
    routing_replay: bool = True
    kv_g_k: float = 1.0
    kv_g_v: float = 1.0
    num_layers: int | None = None
    offload: str = "auto"
    offload_chunk_bytes: int = 16 << 20
    qat_compute_dtype: torch.dtype = torch.float32
    backend: str = "auto"

    def __post_init__(self):
        _choice("format", self.format, FORMATS)
        _choice("activation", self.activation, ACTIVATIONS)
        _choice("guidance_kind", self.guidance_kind, GUIDANCE_KINDS)
        _choice("fallback_rounding", self.fallback_rounding, FALLBACK_ROUNDINGS)
        _choice("offload", self.offload, OFFLOADS)
        _choice("backend", self.backend, ("auto", "cuda", "reference"))
        object.__setattr__(self, "sites", _site_set("sites", self.sites))
        object.__setattr__(self, "guided_sites", _site_set("guided_sites", self.guided_sites))
        gl = self.guidance_layers
        if isinstance(gl, str):
            if gl != "deeper_half":
                raise ValueError(f"guidance_layers must be 'deeper_half', a list of layer indices or None, got {gl!r}")
        elif gl is not None:
            try:
                items = list(gl)
            except TypeError as e:
                raise TypeError(f"guidance_layers must be 'deeper_half', a list of ints or None, got {gl!r}") from e
            bad = [i for i in items if not is_int(i)]
            if bad:  # int() would truncate 1.5, parse "1" and count True as layer 1
                b0 = bad[0]
                raise TypeError(f"guidance_layers must be layer indices (ints), got {b0!r} ({type(b0).__name__}) in {gl!r}")
            layers = tuple(sorted({int(i) for i in items}))
            if any(i < 0 for i in layers):
                raise ValueError(f"guidance_layers must be non-negative layer indices, got {list(layers)}")
            object.__setattr__(self, "guidance_layers", layers)
        b = self.guidance_budget_bytes_per_token
        if b is not None:
            b = _int_field(self, "guidance_budget_bytes_per_token", "a non-negative int or None")
            if b < 0:
                raise ValueError(f"guidance_budget_bytes_per_token must be a non-negative int or None, got {b!r}")
        check_bool(routing_replay=self.routing_replay)
        for name in ("kv_g_k", "kv_g_v"):  # the KV cache's own rule: a float, finite and > 0 as a float32
            _check_static_g(getattr(self, name), name)
        if self.num_layers is not None:
            _int_field(self, "num_layers", "a positive int or None")
            if self.num_layers <= 0:
                raise ValueError(f"num_layers must be positive, got {self.num_layers}")
        layers = self.guidance_layers
        if self.num_layers is not None and isinstance(layers, tuple) and any(i >= self.num_layers for i in layers):
            raise ValueError(f"guidance_layers {list(layers)} out of range for a model with {self.num_layers} layers")
        if _int_field(self, "offload_chunk_bytes", "a positive int") <= 0:
            raise ValueError(f"offload_chunk_bytes must be a positive int, got {self.offload_chunk_bytes!r}")
        _int_field(self, "sr_seed", "an int in [0, 2^63)")
        if not 0 <= self.sr_seed < 2**63:
            raise ValueError(f"sr_seed must be in [0, 2^63), got {self.sr_seed}")
        if not isinstance(self.qat_compute_dtype, torch.dtype):
            raise TypeError(f"qat_compute_dtype must be a torch.dtype, got {type(self.qat_compute_dtype).__name__}")
        if self.qat_compute_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"qat_compute_dtype must be float32, bfloat16 or float16, got {self.qat_compute_dtype}")

    @property
    def block(self) -> int:
        return 16 if self.format == "nvfp4" else 32

    def quantizes(self, group: str) -> bool:
        return group in self.sites

    def guides(self, group: str) -> bool:
        """Whether guided mode rounds this site group with rollout guidance (it must also be quantized)."""
        return group in self.sites and group in self.guided_sites

    def with_(self, **changes) -> "FP4Config":
        """A copy with some fields changed (the config is frozen)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """JSON-friendly description (saved in guidance files and checked on load)."""
        gl = self.guidance_layers
        return {
            "format": self.format,
            "activation": self.activation,
            "sites": sorted(self.sites),
            "guided_sites": sorted(self.guided_sites),
            "guidance_layers": gl if gl is None or isinstance(gl, str) else list(gl),
            "guidance_budget_bytes_per_token": self.guidance_budget_bytes_per_token,
            "guidance_kind": self.guidance_kind,
            "kv_g_k": float(self.kv_g_k),
            "kv_g_v": float(self.kv_g_v),
            "num_layers": self.num_layers,
        }


def _int_field(cfg, name: str, what: str) -> int:
    """Check that field ``name`` is an int (not a bool); numpy / other Integral values are stored as a Python int."""
    value = getattr(cfg, name)
    if not is_int(value):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
    object.__setattr__(cfg, name, int(value))
    return int(value)


def _choice(name: str, value, allowed) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {allowed} (a str), got {type(value).__name__} {value!r}")
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _site_set(name: str, sites) -> frozenset:
    if isinstance(sites, str):
        raise TypeError(f"{name} must be a set of site groups, got the string {sites!r}")
    try:
        s = frozenset(sites)
    except TypeError as e:
        raise TypeError(f"{name} must be a set of site groups, got {type(sites).__name__} {sites!r}") from e
    odd = [g for g in s if not isinstance(g, str)]
    if odd:
        raise TypeError(f"{name}: site groups are strings from {SITE_GROUPS}, got {odd[0]!r} ({type(odd[0]).__name__})")
    bad = s - set(SITE_GROUPS)
    if bad:
        raise ValueError(f"{name}: unknown site groups {sorted(bad)}; allowed: {SITE_GROUPS}")
    return s
