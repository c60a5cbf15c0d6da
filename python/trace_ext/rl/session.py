"""Sessions: the mode of every FP4 module's forward, and the keys that tie rollout rows to trainer rows.

A session is entered with ``rollout(model, ...)`` (engine path: packed FP4 weights, records guidance and
routes) or ``train(model, ..., mode=...)`` (trainer: "bf16", "qat" fake-quant + STE, or "guided": qat whose
activation rounding follows the rollout's records, with routing replay). Outside any session converted
modules compute exactly what the original bf16 model computes.

Rows are identified by (sequence id, position in the padded sequence[, sub-key]). A forward-pre-hook on the
top model learns each call's positions: ``cache_position`` when given, else the KV cache's length
(``cache=`` / ``past_key_values=``) + arange(S): the index in the padded sequence. ``position_ids`` are not
used on purpose: with left padding they are not unique per row.
Rollout and trainer must therefore feed the same padded token sequences with the same sequence ids.
"""
from __future__ import annotations

import contextlib
import zlib

import torch

from .._args import check_bool
from ..tensor import GuidanceRecord
from .config import MODES, FP4Config, site_group
from .guidance import (MAX_POS, MAX_SEQ, GuidanceCache, GuidanceError, GuidanceRecorder, encode_keys, guided_layers,
                       sequence_id_tensor)

_STACK: list["Session"] = []


def current_session() -> "Session | None":
    """The innermost active session, or None (converted modules then behave as the bf16 model)."""
    return _STACK[-1] if _STACK else None


def model_signature(model) -> dict:
    """Architecture facts that guidance must agree on (rollout and trainer run the same model)."""
    cfg = getattr(model, "config", None)
    sig = {}
    if cfg is not None:
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        for k in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size", "num_key_value_heads", "head_dim"):
            v = getattr(text, k, None)
            if isinstance(v, (int, str)):
                sig[k] = v
    layout = getattr(model, "_trace_fp4_layout", None)
    if layout:
        sig["sites"] = sorted(f"{s.site}@{s.layer}:K{s.K}x{s.rows_per_token}" for s in layout)
    return sig


class Session:
    """State of one rollout or training forward region. Modules reach it through ``current_session()``."""

    def __init__(self, model, config: FP4Config, mode: str, cache: GuidanceCache | None, sequence_ids=None, role="train",
                 capture_codes: bool = False):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        _check_model_config(model, config)
        if config is None:
            raise TypeError("config must be a trace_ext.rl.FP4Config, got None")
        check_bool(capture_codes=capture_codes)
        self.model = model
        self.config = config
        self.mode = mode
        self.role = role  # "rollout" | "train"
        self.cache = cache
        self.sequence_ids = None if sequence_ids is None else sequence_id_tensor(sequence_ids)
        if self.sequence_ids is not None and self.sequence_ids.numel():
            if int(self.sequence_ids.min()) < 0 or int(self.sequence_ids.max()) >= MAX_SEQ:
                raise ValueError(f"sequence_ids must be in [0, 2^31), got {self.sequence_ids.tolist()[:8]}...")
            if torch.unique(self.sequence_ids).numel() != self.sequence_ids.numel():
                raise ValueError("sequence_ids must be distinct")
        layout = getattr(model, "_trace_fp4_layout", None)
        self.signature = model_signature(model)
        if mode == "guided" and config.format != "nvfp4":
            raise ValueError(f"guided rounding (SPEC 5) is defined for NVFP4; format={config.format!r} supports bf16, rollout and qat")
        # an MXFP4 rollout records routes but no activation guidance (there is none to give, SPEC 5)
        guide = (role == "rollout" and mode == "rollout" and config.format == "nvfp4") or mode == "guided"
        self.layers = guided_layers(config, layout) if guide and _guides_any(config) else frozenset()
        # routing: the rollout records the top-k of every MoE layer; the trainer replays them (R3)
        self.record_routes_on = role == "rollout" and config.routing_replay
        self.replay_routes_on = role == "train" and cache is not None and (config.routing_replay or mode == "guided")
        if mode == "guided":
            if cache is None:
                raise GuidanceError("mode='guided' needs guidance=<the rollout's GuidanceCache> (rec.cache or GuidanceCache.load)")
            if not cache.routes and getattr(model, "_trace_fp4_routers", 0):
                raise GuidanceError("guided mode needs the rollout's routes (routing replay): record with routing_replay=True")
        if cache is not None and role == "train":
            cache.check_compatible(config, self.signature)
        if (self.record_routes_on or self.replay_routes_on) and not getattr(model, "_trace_fp4_converted", False):
            raise ValueError("routing record/replay needs a converted model: trace_ext.integrations.hf_moe.convert(model, config)")
        # diagnostics: full codes of every quantized activation site and layer, for code / scale agreement metrics
        self.codes = GuidanceCache(config.with_(guidance_kind="full", offload="none"), self.signature) if capture_codes else None
        self._seq: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None
        self._rows: tuple | None = None
        self.forward_calls = 0
        self._hook = None

    # position tracking -------------------------------------------------------------------------------------------
    def _pre_hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        emb = kwargs.get("inputs_embeds")
        src = ids if isinstance(ids, torch.Tensor) else emb
        if not isinstance(src, torch.Tensor):
            raise ValueError("trace_ext session: the model was called without input_ids or inputs_embeds")
        B, S = src.shape[0], src.shape[1]
        device = src.device
        cp = kwargs.get("cache_position")
        if isinstance(cp, torch.Tensor):
            pos = cp.to(device=device, dtype=torch.int64).reshape(1, -1).expand(B, S)
            start = None
        else:
            past = kwargs.get("cache")  # transformers >= 5.24 ("past_key_values" before, still accepted)
            past = past if past is not None else kwargs.get("past_key_values")
            start = int(past.get_seq_length()) if past is not None and hasattr(past, "get_seq_length") else 0
            pos = (torch.arange(S, device=device, dtype=torch.int64) + start).reshape(1, S).expand(B, S)
        if start is not None and start + S > MAX_POS:
            raise ValueError(f"positions up to {start + S} exceed the key range 2^24")
        if self.sequence_ids is None:
            seq = torch.arange(B, device=device, dtype=torch.int64)
        else:
            if self.sequence_ids.numel() != B:
                raise ValueError(f"sequence_ids has {self.sequence_ids.numel()} ids but the batch has {B} sequences")
            seq = self.sequence_ids.to(device)
        self._seq, self._pos, self._rows = seq, pos, None
        self.forward_calls += 1

    def token_keys(self):
        """(seq_ids int64 [B], positions int64 [B, S]) of the current forward call."""
        if self._seq is None:
            raise RuntimeError("no forward call is in progress in this session (call the model the session was opened on)")
        return self._seq, self._pos

    def row_keys(self):
        """Keys of the flattened [B * S] token rows (b-major, as MoE blocks flatten hidden states)."""
        if self._rows is None:
            seq, pos = self.token_keys()
            self._rows = (seq.reshape(-1, 1).expand_as(pos).reshape(-1), pos.reshape(-1))
        return self._rows

    # guidance ------------------------------------------------------------------------------------------------------
    def wants_record(self, site: str, layer: int) -> bool:
        """True when the rollout keeps guidance for this site and layer (so the caller should capture it)."""
        return (
            self.role == "rollout" and self.mode == "rollout" and self.cache is not None
            and layer in self.layers and self.config.guides(site_group(site))
        )

    def record(self, site: str, layer: int, keys, record: GuidanceRecord) -> bool:
        """Rollout: store ``record`` for the rows ``keys``; False (nothing stored) when the policy skips the layer."""
        if not self.wants_record(site, layer):
            return False
        if not isinstance(record, GuidanceRecord):
            raise TypeError(f"record must be a GuidanceRecord, got {type(record).__name__}")
        self.cache.add_record(site, layer, encode_keys(keys), record)
        return True

    def wants_capture(self) -> bool:
        return self.codes is not None and self.mode in ("rollout", "qat", "guided") and self.config.format == "nvfp4"

    def capture(self, site: str, layer: int, keys, record: GuidanceRecord) -> bool:
        """Keep the full codes of a quantized site (diagnostics; see rl.metrics.site_agreement)."""
        if not self.wants_capture():
            return False
        if not isinstance(record, GuidanceRecord):
            raise TypeError(f"record must be a GuidanceRecord, got {type(record).__name__}")
        if record.kind != "full":
            raise ValueError("capture needs a 'full' record (the codes)")
        self.codes.add_record(site, layer, encode_keys(keys), record)
        return True

    def is_guided(self, site: str, layer: int) -> bool:
        return self.mode == "guided" and layer in self.layers and self.config.guides(site_group(site))

    def guidance(self, site: str, layer: int, keys, K: int) -> GuidanceRecord | None:
        """Guided mode: the rollout's record of these rows, in key order; None where the policy keeps no guidance.

        Raises GuidanceError when the rollout has no record for a row, or its K / format differ.
        """
        if not self.is_guided(site, layer):
            return None
        device = keys[0].device
        return self.cache.get_record(site, layer, encode_keys(keys), K, device)

    def rounding_kwargs(self, site: str, layer: int, keys, K: int) -> dict:
        """Keyword arguments of an NVFP4 quantizer for this site: guided when guidance exists, else the fallback."""
        rec = self.guidance(site, layer, keys, K)
        if rec is not None:
            return {"rounding": "guided", "guidance": rec}
        if self.mode == "guided" and self.config.fallback_rounding == "sr":
            return {"rounding": "sr", **self.sr_args(site, layer)}
        return {"rounding": "rtn"}

    def sr_args(self, site: str, layer: int) -> dict:
        """Seed / offset of stochastic rounding, distinct per (site, layer) and per forward call."""
        seed = (int(self.config.sr_seed) ^ (zlib.crc32(f"{site}@{layer}".encode()) << 20)) % (2**62)
        return {"seed": seed, "offset": self.forward_calls << 32}

    # routes (R3) ---------------------------------------------------------------------------------------------------
    def record_routes(self, layer: int, keys, topk_idx: torch.Tensor) -> bool:
        if not self.record_routes_on or self.cache is None:
            return False
        self.cache.add_routes(layer, encode_keys(keys), topk_idx.detach())
        return True

    def capture_routes(self, layer: int, keys, topk_idx: torch.Tensor) -> bool:
        """Keep the router's own top-k (before any replay) in ``self.codes`` (diagnostics: router_flip_rate)."""
        if self.codes is None:
            return False
        self.codes.add_routes(layer, encode_keys(keys), topk_idx.detach())
        return True

    def replay_routes(self, layer: int, keys) -> torch.Tensor | None:
        """The rollout's top-k expert ids for these rows (int64 [R, k]), or None when not replaying."""
        if not self.replay_routes_on:
            return None
        return self.cache.get_routes(layer, encode_keys(keys), keys[0].device)

    # entering / leaving --------------------------------------------------------------------------------------------
    def __enter__(self):
        self._hook = self.model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        _STACK.append(self)
        return self

    def __exit__(self, *exc):
        if _STACK and _STACK[-1] is self:
            _STACK.pop()
        elif self in _STACK:
            _STACK.remove(self)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._seq = self._pos = self._rows = None
        return False


def _guides_any(config: FP4Config) -> bool:
    return any(config.guides(g) for g in config.guided_sites)


def _check_model_config(model, config) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a Hugging Face model), got {type(model).__name__}")
    if config is not None and not isinstance(config, FP4Config):
        raise TypeError(f"config must be a trace_ext.rl.FP4Config or None, got {type(config).__name__}")


def _config_for(model, config: FP4Config | None) -> FP4Config:
    _check_model_config(model, config)
    if config is None:
        config = getattr(model, "_trace_fp4_config", None)
        if config is None:
            raise ValueError("no FP4Config given and the model was not converted (trace_ext.integrations.hf_moe.convert)")
    if config.num_layers is None:
        cfg = getattr(model, "config", None)
        text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
        n = getattr(text, "num_hidden_layers", None)
        if n is not None:
            config = config.with_(num_layers=int(n))
    return config


@contextlib.contextmanager
def rollout(model, config: FP4Config | None = None, sequence_ids=None, mode: str = "rollout", capture_codes: bool = False):
    """Engine-path region: FP4 weights (packed once) and activations, FP4 KV; records guidance and routes.

    Yields a GuidanceRecorder whose ``cache`` the trainer passes to ``train(..., guidance=...)``.
    ``mode="bf16"`` rolls out the untouched model (records routes only): the BF16 baseline arm.
    ``capture_codes=True`` also keeps the full codes of every quantized site in ``rec.codes`` (for
    ``rl.metrics.site_agreement``; costs 4 bits per element).
    """
    if mode not in ("rollout", "bf16"):
        raise ValueError(f"rollout mode must be 'rollout' or 'bf16', got {mode!r}")
    config = _config_for(model, config)
    sess = Session(model, config, mode, None, sequence_ids, role="rollout", capture_codes=capture_codes)
    sess.cache = GuidanceCache(config, sess.signature, sess.layers)
    with sess:
        yield GuidanceRecorder(sess.cache, sess.codes)
    if config.offload != "none":
        sess.cache.offload()


@contextlib.contextmanager
def train(model, config: FP4Config | None = None, mode: str = "qat", guidance: GuidanceCache | None = None, sequence_ids=None,
          capture_codes: bool = False):
    """Trainer region: mode "bf16" | "qat" (RTN fake-quant + STE) | "guided" (rounding and routes replayed).

    ``guidance``: the rollout's cache (``rec.cache``, or ``GuidanceCache.load(path)``, or one ``split`` part);
    with it, top-k routes are replayed whenever ``config.routing_replay`` (always in guided mode).
    ``capture_codes=True`` keeps the trainer's full codes in ``sess.codes`` (compare with the rollout's ``rec.codes``).
    """
    if mode not in ("bf16", "qat", "guided"):
        raise ValueError(f"train mode must be 'bf16', 'qat' or 'guided', got {mode!r}")
    if guidance is not None and not isinstance(guidance, GuidanceCache):
        if isinstance(guidance, GuidanceRecorder):
            guidance = guidance.cache
        else:
            raise TypeError(f"guidance must be a GuidanceCache (rec.cache), got {type(guidance).__name__}")
    config = _config_for(model, config)
    with Session(model, config, mode, guidance, sequence_ids, role="train", capture_codes=capture_codes) as sess:
        yield sess
