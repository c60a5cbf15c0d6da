"""FP4 KV cache for Hugging Face ``generate`` and the FP4-KV attention function (SPEC 8, 5).

Rollout side: ``FP4KVCache`` (a transformers ``Cache``) stores, per (token, kv head), the NVFP4 codes
(head_dim/2 bytes) and E4M3 block scales (head_dim/16 bytes) of K and V, blocks of 16 along head_dim, with a
static per-layer decode scale g_k / g_v (``FP4Config.kv_g_k`` / ``kv_g_v``, default 1.0). Every ``update``
quantizes the new rows and hands attention the dequantized K/V of the whole cache, in prefill and decode
alike (SPEC 8: attention always reads K/V from the cache). In a rollout session it records the cache's own
codes and scales as guidance (sites "kv_k" / "kv_v", keys (seq, pos, kv_head)).

Trainer side: the attention function ``trace_fp4_sdpa`` (registered with transformers' AttentionInterface)
fake-quantizes K/V before SDPA: RTN with the static g in qat mode; in guided mode rounded with the rollout's
records (``sess.guidance``, compact or full per config), RTN/SR where the policy keeps no guidance; the
backward pass is the straight-through estimator. Outside a session, or in bf16 mode, it is plain SDPA.

On CUDA, when the FP4 KV kernels are built (``trace_ext.ops.kv``), the cache appends through
``fp4kv_append`` and single-token decode steps attend with ``fp4kv_decode_attention`` straight from the
codes; everything else runs the reference path here (quantize + dequantize + SDPA), which is the oracle.
The KV cache always uses NVFP4 (SPEC 8), whatever ``FP4Config.format`` says about the experts.
"""
from __future__ import annotations

import threading

import torch

from .. import formats as F
from .._args import is_int
from ..kvcache import _check_static_g
from ..ops import quant as Q
from ..ops._backend import BACKENDS
from ..tensor import GuidanceRecord

ATTN_NAME = "trace_fp4_sdpa"
KV_SITES = ("kv_k", "kv_v")


# ---- session access (the session lives in trace_ext.rl; imported lazily, it imports integrations) ----------------


def _current_session():
    from ..rl.session import current_session

    return current_session()


def _kv_enabled(sess) -> bool:
    return sess is not None and sess.mode != "bf16" and sess.config.quantizes("kv")


def _row_keys(sess, batch: int, q_len: int, heads: int, device) -> tuple:
    """(seq, pos, kv_head) int64 keys of K/V rows laid out [batch, q_len, heads] for the current forward call."""
    seq_ids, positions = sess.token_keys()
    seq_ids = seq_ids.to(device)
    positions = positions.to(device)
    if positions.shape[0] != batch or positions.shape[-1] != q_len:
        raise ValueError(
            f"FP4 KV attention: the session's positions have shape {tuple(positions.shape)}, the attention call has "
            f"batch {batch} and {q_len} new tokens"
        )
    seq = seq_ids.reshape(batch, 1, 1).expand(batch, q_len, heads)
    pos = positions.reshape(batch, q_len, 1).expand(batch, q_len, heads)
    head = torch.arange(heads, device=device).reshape(1, 1, heads).expand(batch, q_len, heads)
    return tuple(t.reshape(-1).to(torch.int64) for t in (seq, pos, head))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] -> rows [B*S*H, D] in (batch, position, head) order, the order of the guidance keys."""
    B, H, S, D = x.shape
    return x.transpose(1, 2).reshape(B * S * H, D)


def _unrows(r: torch.Tensor, B: int, H: int, S: int) -> torch.Tensor:
    return r.reshape(B, S, H, -1).transpose(1, 2)


def _g_tensor(g: float, device) -> torch.Tensor:
    return torch.tensor(float(g), dtype=torch.float32, device=device)


def _check_head_dim(D: int) -> None:
    if D % F.NVFP4_BLOCK:
        raise ValueError(f"FP4 KV cache: head_dim must be a multiple of {F.NVFP4_BLOCK} (NVFP4 blocks), got {D}")


# ---- the cache --------------------------------------------------------------------------------------------------

try:  # transformers >= 5 cache layers
    from transformers.cache_utils import Cache, DynamicLayer
except ImportError as e:  # pragma: no cover - transformers is a dependency of this module
    raise ImportError("trace_ext.integrations.hf_kvcache needs transformers >= 5.17") from e

PAGE_SIZE = 16  # tokens per page of the paged store


def kv_kernels_available(device) -> bool:
    """True when the compiled FP4 KV append and decode kernels can run on ``device``."""
    from .._loader import kernels_usable_on
    from ..ops._backend import have_op

    device = torch.device(device)
    return (
        device.type == "cuda"
        and have_op("fp4kv_append")
        and have_op("fp4kv_decode_attention")
        and kernels_usable_on(device)[0]
    )


class _PagedStore:
    """K/V of a batch in a ``PagedFP4KVCache`` with a contiguous block table (sequence b owns pages
    [b * max_pages, (b + 1) * max_pages)); grows by re-layout when a sequence outgrows its pages."""

    def __init__(self, batch: int, heads: int, head_dim: int, device, g_k: float, g_v: float, backend: str):
        self.B, self.H, self.D = batch, heads, head_dim
        self.device, self.g_k, self.g_v, self.backend = torch.device(device), g_k, g_v, backend
        self.max_pages = 0
        self.length = 0
        self.cache = None
        self.block_table = None

    def _grow(self, total: int) -> None:
        from ..kvcache import PagedFP4KVCache

        need = -(-total // PAGE_SIZE)
        if need <= self.max_pages:
            return
        new_max = max(need, 2 * self.max_pages)
        new = PagedFP4KVCache(self.B * new_max, PAGE_SIZE, self.H, self.D, device=self.device, g_k=self.g_k, g_v=self.g_v)
        if self.cache is not None:
            for old_t, new_t in zip(self.cache.tensors(), new.tensors()):
                new_t.view(self.B, new_max, *new_t.shape[1:])[:, : self.max_pages] = old_t.view(
                    self.B, self.max_pages, *old_t.shape[1:]
                )
        self.cache, self.max_pages = new, new_max
        b = torch.arange(self.B, device=self.device, dtype=torch.int32)[:, None]
        self.block_table = (b * new_max + torch.arange(new_max, device=self.device, dtype=torch.int32)[None, :]).contiguous()

    def seq_lens(self) -> torch.Tensor:
        return torch.full((self.B,), self.length, dtype=torch.int32, device=self.device)

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        from ..ops.kv import fp4kv_append

        S = k_new.shape[2]
        self._grow(self.length + S)
        rows = lambda x: x.transpose(1, 2).reshape(self.B * S, self.H, self.D).contiguous()  # noqa: E731
        cu = (torch.arange(self.B + 1, device=self.device, dtype=torch.int32) * S).contiguous()
        # the table and offsets are built here (always valid): skip the host-syncing checks in the decode loop
        fp4kv_append(self.cache, rows(k_new), rows(v_new), self.block_table, cu, self.seq_lens(), backend=self.backend,
                     validate=False)
        self.length += S

    def gather(self, dtype):
        from ..ops.kv import fp4kv_gather

        return fp4kv_gather(self.cache, self.block_table, self.seq_lens(), dtype)

    def decode(self, query: torch.Tensor, scale) -> torch.Tensor:
        """query [B, Hq, 1, D] -> attention output [B, 1, Hq, D] straight from the codes."""
        from ..ops.kv import fp4kv_decode_attention

        out, _ = fp4kv_decode_attention(
            query[:, :, 0].contiguous(), self.cache, self.block_table, self.seq_lens(), scale, backend=self.backend,
            validate=False,
        )
        return out.unsqueeze(1)

    def codes(self, which: str):
        from ..ops.kv import fp4kv_gather_guidance

        rec = fp4kv_gather_guidance(self.cache, self.block_table, self.seq_lens(), which)
        S = self.length
        return rec.payload.reshape(self.B, self.H, S, -1), rec.scales.reshape(self.B, self.H, S, -1)

    def select_batch(self, idx: torch.Tensor) -> None:
        idx = idx.to(self.device).long()
        for t in self.cache.tensors():
            v = t.view(self.B, self.max_pages, *t.shape[1:])
            sel = v[idx].clone()
            if sel.shape[0] != self.B:
                raise ValueError("the paged FP4 KV store keeps its batch size; reorder only (beam search)")
            v.copy_(sel)


class FP4KVLayer(DynamicLayer):
    """One decoder layer's FP4 K/V (SPEC 8).

    Dense store (reference path): codes uint8 [B, Hkv, S, D/2] and scales uint8 [B, Hkv, S, D/16] in
    ``k_codes`` / ``k_scales`` / ``v_codes`` / ``v_scales``, and their dequantized values in ``keys`` /
    ``values`` (what attention reads). Paged store (``paged=True``; the default on a GPU with the FP4 KV
    kernels, bf16 K/V and ``trace_fp4_sdpa`` installed): a ``PagedFP4KVCache`` written by ``fp4kv_append``;
    prefill attends over ``fp4kv_gather``, single-token decode runs ``fp4kv_decode_attention``.
    """

    is_croppable = False

    def __init__(self, layer_idx: int, g_k: float = 1.0, g_v: float = 1.0, backend: str = "auto", paged: bool | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.g_k, self.g_v = float(g_k), float(g_v)
        self.backend = backend
        self.paged_request = paged
        self.paged = None
        self.k_codes = self.k_scales = self.v_codes = self.v_scales = None
        self.store = None
        self._length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # checked before the layer counts as initialized: a refused first update leaves it empty, not half-built
        _check_head_dim(key_states.shape[-1])
        _check_head_dim(value_states.shape[-1])
        B, H, _, D = key_states.shape
        if self.paged_request is None:
            paged = kv_kernels_available(key_states.device) and key_states.dtype == torch.bfloat16
        else:
            paged = bool(self.paged_request)
        if paged and (key_states.dtype != torch.bfloat16 or value_states.shape != key_states.shape):
            raise TypeError("the paged FP4 KV store takes bfloat16 K and V of one shape")
        super().lazy_initialization(key_states, value_states)
        if paged:
            self.store = _PagedStore(B, H, D, key_states.device, self.g_k, self.g_v, self.backend)
        else:
            u8 = dict(dtype=torch.uint8, device=key_states.device)
            Hv, Dv = value_states.shape[1], value_states.shape[-1]
            self.k_codes = torch.empty(B, H, 0, D // 2, **u8)
            self.k_scales = torch.empty(B, H, 0, D // F.NVFP4_BLOCK, **u8)
            self.v_codes = torch.empty(B, Hv, 0, Dv // 2, **u8)
            self.v_scales = torch.empty(B, Hv, 0, Dv // F.NVFP4_BLOCK, **u8)
        self.paged = paged

    def _quantize(self, x: torch.Tensor, g: float):
        return Q.nvfp4_quantize(x, _g_tensor(g, x.device), backend=self.backend)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self._check_update(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        S = key_states.shape[-2]
        if self.paged:
            self.store.append(key_states, value_states)
            self._length += S
            if _recording():
                _record_rollout(self.layer_idx, (self._quantize(key_states, self.g_k), self._quantize(value_states, self.g_v)))
            if S == 1:
                # decode: trace_fp4_sdpa attends from the codes; hand it the new rows only
                keys = Q.nvfp4_fake_quantize(key_states, _g_tensor(self.g_k, key_states.device), backend=self.backend)
                values = Q.nvfp4_fake_quantize(value_states, _g_tensor(self.g_v, value_states.device), backend=self.backend)
            else:
                keys, values = self.store.gather(key_states.dtype)
            _LAST_UPDATE.mark(self, keys, values, S)
            return keys, values
        qk, qv = self._quantize(key_states, self.g_k), self._quantize(value_states, self.g_v)
        self.k_codes = torch.cat([self.k_codes, qk.codes], dim=-2)
        self.k_scales = torch.cat([self.k_scales, qk.scales], dim=-2)
        self.v_codes = torch.cat([self.v_codes, qv.codes], dim=-2)
        self.v_scales = torch.cat([self.v_scales, qv.scales], dim=-2)
        dk = Q.nvfp4_dequantize(qk, key_states.dtype, backend=self.backend)
        dv = Q.nvfp4_dequantize(qv, value_states.dtype, backend=self.backend)
        self.keys = torch.cat([self.keys, dk], dim=-2)
        self.values = torch.cat([self.values, dv], dim=-2)
        self._length += S
        _record_rollout(self.layer_idx, (qk, qv))
        _LAST_UPDATE.mark(self, self.keys, self.values, S)
        return self.keys, self.values

    def _check_update(self, k, v) -> None:
        """SPEC 10 for one update: k / v are floating [B, H, S, D] tensors of one dtype, device, batch and length; after
        the first update their dtype, device, batch, heads and head_dim must stay those of the cache (a float32 step
        into a bf16 cache would promote it, a shorter v would leave keys and values misaligned)."""
        where = f"FP4KVCache layer {self.layer_idx}"
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{where}: {name} must be a tensor [B, H, S, D], got {type(t).__name__}")
            if not t.is_floating_point():
                raise TypeError(f"{where}: {name} must be a floating tensor (bfloat16, float16 or float32), got {t.dtype}")
            if t.dim() != 4:
                raise ValueError(f"{where}: {name} must be [B, H, S, D], got shape {tuple(t.shape)}")
        if v.dtype != k.dtype:
            raise TypeError(f"{where}: k is {k.dtype} but v is {v.dtype}; they must share one dtype")
        if v.device != k.device:
            raise RuntimeError(f"{where}: k is on {k.device} but v on {v.device}; move them to one device")
        if v.shape[0] != k.shape[0] or v.shape[2] != k.shape[2]:
            raise ValueError(
                f"{where}: v must be [B, H_v, S, D_v] with the B={k.shape[0]} and S={k.shape[2]} of k {tuple(k.shape)}, "
                f"got {tuple(v.shape)}"
            )
        if not self.is_initialized:
            return
        if k.dtype != self.keys.dtype:
            raise TypeError(f"{where}: the cache holds {self.keys.dtype} (its first update); got k of {k.dtype}")
        if k.device != self.device:
            raise RuntimeError(f"{where}: the cache lives on {self.device}; got k on {k.device}")
        if self.paged:
            want_k = want_v = (self.store.B, self.store.H, self.store.D)
        else:
            want_k = (self.k_codes.shape[0], self.k_codes.shape[1], 2 * self.k_codes.shape[-1])
            want_v = (self.v_codes.shape[0], self.v_codes.shape[1], 2 * self.v_codes.shape[-1])
        for name, t, want in (("k", k, want_k), ("v", v, want_v)):
            got = (t.shape[0], t.shape[1], t.shape[3])
            if got != want:
                raise ValueError(
                    f"{where}: {name} must be [{want[0]}, {want[1]}, S, {want[2]}] (the cache's batch, heads and head_dim), "
                    f"got {tuple(t.shape)}"
                )

    def get_seq_length(self) -> int:
        return self._length

    def reset(self) -> None:
        super().reset()
        self.k_codes = self.k_scales = self.v_codes = self.v_scales = None
        self.store = None
        self.paged = None
        self._length = 0

    def _select_batch(self, idx: torch.Tensor) -> None:
        if self.paged:
            self.store.select_batch(idx)
            return
        for name in ("keys", "values", "k_codes", "k_scales", "v_codes", "v_scales"):
            t = getattr(self, name)
            if t is not None and t.dim() == 4:
                setattr(self, name, t.index_select(0, idx.to(t.device)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            self._select_batch(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            if self.paged:
                raise NotImplementedError("the paged FP4 KV store keeps its batch size (expand inputs before prefill)")
            B = self.k_codes.shape[0]
            self._select_batch(torch.arange(B).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            if self.paged:
                raise NotImplementedError("the paged FP4 KV store keeps its batch size")
            self._select_batch(torch.as_tensor(indices).reshape(-1).long())

    def codes(self, which: str = "k"):
        """(codes uint8 [B, H, S, D/2], scales uint8 [B, H, S, D/16], g) of K ("k") or V ("v") as stored."""
        if which not in ("k", "v"):
            raise ValueError(f"which must be 'k' or 'v', got {which!r}")
        g = self.g_k if which == "k" else self.g_v
        if self.paged:
            c, s = self.store.codes(which)
            return c, s, g
        if which == "k":
            return self.k_codes, self.k_scales, g
        return self.v_codes, self.v_scales, g

    def nbytes(self) -> int:
        """Bytes of the FP4 payload (codes + scales) held for K and V."""
        if not self.is_initialized:
            return 0
        return sum(t.numel() for w in ("k", "v") for t in self.codes(w)[:2])


class FP4KVCache(Cache):
    """A transformers Cache whose layers store NVFP4 K/V (SPEC 8); pass it as ``past_key_values`` / ``cache``.

    ``FP4KVCache(model)`` takes the g_k / g_v of the FP4Config given to ``install_fp4_kv`` (or ``convert``);
    ``FP4KVCache(num_layers=..., g_k=..., g_v=...)`` builds one directly. ``paged``: None picks the paged
    store with the CUDA kernels when they can run (and ``trace_fp4_sdpa`` is installed on ``model``).
    """

    def __init__(self, model=None, *, num_layers: int | None = None, g_k: float | None = None, g_v: float | None = None,
                 backend: str | None = None, paged: bool | None = None):
        if model is not None and not (isinstance(model, torch.nn.Module) and hasattr(model, "config")):
            hint = " (pass the model; the config's g comes from install_fp4_kv / convert)" if _is_fp4_config(model) else ""
            raise TypeError(
                f"FP4KVCache: model must be a Hugging Face model (an nn.Module with a .config) or None, got "
                f"{type(model).__name__}{hint}"
            )
        cfg = _installed_config(model) if model is not None else None
        if num_layers is None:
            if model is None:
                raise ValueError("FP4KVCache needs a model or num_layers")
            num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        if not is_int(num_layers):
            raise TypeError(f"FP4KVCache: num_layers must be a positive int, got {type(num_layers).__name__} {num_layers!r}")
        if num_layers < 1:
            raise ValueError(f"FP4KVCache: num_layers must be a positive int, got {num_layers!r}")
        num_layers = int(num_layers)
        # the paged cache's own check (a float, finite and > 0 as a float32), here before any layer exists
        g_k = _check_static_g(g_k if g_k is not None else (cfg.kv_g_k if cfg is not None else 1.0), "FP4KVCache: g_k")
        g_v = _check_static_g(g_v if g_v is not None else (cfg.kv_g_v if cfg is not None else 1.0), "FP4KVCache: g_v")
        backend = backend or (cfg.backend if cfg is not None else "auto")
        if backend not in BACKENDS:
            raise ValueError(f"FP4KVCache: backend must be one of {BACKENDS}, got {backend!r}")
        if paged is not None and not isinstance(paged, bool):
            raise TypeError(f"FP4KVCache: paged must be True, False or None, got {type(paged).__name__} {paged!r}")
        if paged is None and (model is None or cfg is None):
            paged = False  # decode from the codes needs trace_fp4_sdpa as the model's attention
        super().__init__(layers=[FP4KVLayer(i, g_k, g_v, backend, paged) for i in range(num_layers)])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if not is_int(layer_idx):
            raise TypeError(f"FP4KVCache.update: layer_idx must be an int, got {type(layer_idx).__name__} {layer_idx!r}")
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"FP4KVCache.update: layer_idx must be in [0, {len(self.layers)}) (its layers), got {layer_idx}")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


def _is_fp4_config(x) -> bool:
    from ..rl.config import FP4Config

    return isinstance(x, FP4Config)


def _recording() -> bool:
    sess = _current_session()
    return sess is not None and sess.mode == "rollout" and sess.config.quantizes("kv")


def _record_rollout(layer_idx: int, quantized) -> None:
    """In a rollout session, hand the cache's own codes of the new rows to the recorder (full records), and to
    the session's code capture (diagnostics)."""
    sess = _current_session()
    if not (sess is not None and sess.mode == "rollout" and sess.config.quantizes("kv")):
        return
    for site, q in zip(KV_SITES, quantized):
        want_rec = sess.wants_record(site, layer_idx)
        want_cap = sess.wants_capture()
        if not (want_rec or want_cap):
            continue
        B, H, S = q.codes.shape[:3]
        keys = _row_keys(sess, B, S, H, q.codes.device)
        rec = _full_record(q)
        if want_rec:
            sess.record(site, layer_idx, keys, rec)
        if want_cap:
            sess.capture(site, layer_idx, keys, rec)


def _full_record(q) -> GuidanceRecord:
    """The full GuidanceRecord of an NVFP4Tensor [B, H, S, D] with rows in (batch, position, head) order."""
    return GuidanceRecord("full", _rows(q.codes).contiguous(), _rows(q.scales).contiguous(), q.g.transpose(1, 2).reshape(-1).contiguous())


class _LastUpdate(threading.local):
    """Which FP4 cache layer produced the K/V tensors that the next attention call receives."""

    def __init__(self):
        self.layer = None
        self.keys = None
        self.values = None

    def mark(self, layer, keys, values, new):
        self.layer, self.keys, self.values = layer, keys, values

    def take(self, key, value):
        layer = self.layer if (self.keys is key and self.values is value) else None
        self.layer = self.keys = self.values = None
        return layer


_LAST_UPDATE = _LastUpdate()


# ---- the attention function --------------------------------------------------------------------------------------


def _sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _ste(x: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
    """Straight-through estimator: the value of xq, the gradient of x."""
    return x + (xq - x).detach() if x.requires_grad else xq


def fake_quantize_kv(x: torch.Tensor, site: str, layer: int, sess, g: float) -> torch.Tensor:
    """The trainer's K or V [B, H, S, D] (one full-sequence forward): fake-quantized per (token, head) with the
    static g (SPEC 8). qat: RTN. guided: the rollout's record of these rows (``sess.guidance``), the config's
    fallback rounding where the policy keeps none. Backward: straight-through."""
    B, H, S, D = x.shape
    _check_head_dim(D)
    rows = _rows(x.detach())
    cfg = sess.config
    capture = sess.wants_capture()
    keys = _row_keys(sess, B, S, H, x.device) if (sess.mode == "guided" or capture) else None
    if sess.mode == "guided" and cfg.guides("kv"):
        kwargs = sess.rounding_kwargs(site, layer, keys, D)
    else:
        kwargs = {"rounding": "rtn"}
    # guided rows take the rollout's g from their record (the same static g); the other roundings take it here
    gt = None if kwargs["rounding"] == "guided" else _g_tensor(g, x.device)
    if capture:
        q = Q.nvfp4_quantize(rows, gt, backend=cfg.backend, **kwargs)
        sess.capture(site, layer, keys, GuidanceRecord("full", q.codes, q.scales, q.g.reshape(-1)))
        y = Q.nvfp4_dequantize(q, x.dtype, backend=cfg.backend)
    else:
        y = Q.nvfp4_fake_quantize(rows, gt, backend=cfg.backend, **kwargs)
    return _ste(x, _unrows(y, B, H, S))


def trace_fp4_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers attention function: SDPA over FP4 K/V as the session's mode asks (see the module doc)."""
    cache_layer = _LAST_UPDATE.take(key, value)
    if cache_layer is not None:
        # K/V came out of an FP4KVCache (the rollout engine path): already dequantized from the codes
        if cache_layer.paged:
            if query.shape[2] == 1 and attention_mask is None:
                return cache_layer.store.decode(query, kwargs.get("scaling")), None
            if query.shape[2] == 1:  # padded batch: attend over the whole dequantized cache with the mask
                key, value = cache_layer.store.gather(query.dtype)
        return _sdpa(module, query, key, value, attention_mask, **kwargs)
    sess = _current_session()
    if not _kv_enabled(sess):
        return _sdpa(module, query, key, value, attention_mask, **kwargs)
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError("FP4 KV attention needs the attention module's layer_idx")
    cfg = sess.config
    q_len, kv_len = query.shape[2], key.shape[2]
    if sess.mode == "rollout":
        # rollout without an FP4KVCache (a full forward, or a bf16 DynamicCache): quantize with the cache's
        # numerics, record the rows of this call (the last q_len), attend over the dequantized K/V
        qk = Q.nvfp4_quantize(key, _g_tensor(cfg.kv_g_k, key.device), backend=cfg.backend)
        qv = Q.nvfp4_quantize(value, _g_tensor(cfg.kv_g_v, value.device), backend=cfg.backend)
        _record_rollout(layer, [_slice_new(q, q_len) for q in (qk, qv)])
        key = Q.nvfp4_dequantize(qk, key.dtype, backend=cfg.backend)
        value = Q.nvfp4_dequantize(qv, value.dtype, backend=cfg.backend)
        return _sdpa(module, query, key, value, attention_mask, **kwargs)
    if kv_len != q_len:
        raise ValueError(
            f"FP4 KV attention in {sess.mode} mode expects one full-sequence forward without a KV cache (got {q_len} "
            f"queries over {kv_len} keys): the trainer recomputes the whole sequence"
        )
    key = fake_quantize_kv(key, "kv_k", layer, sess, cfg.kv_g_k)
    value = fake_quantize_kv(value, "kv_v", layer, sess, cfg.kv_g_v)
    return _sdpa(module, query, key, value, attention_mask, **kwargs)


def _slice_new(q, n: int):
    from ..tensor import NVFP4Tensor

    return NVFP4Tensor(q.codes[..., -n:, :], q.scales[..., -n:, :], q.g[..., -n:])


# ---- install / uninstall ---------------------------------------------------------------------------------------


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, trace_fp4_sdpa)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def _attention_modules(model):
    for m in model.modules():
        if hasattr(m, "layer_idx") and hasattr(m, "k_proj") and hasattr(m, "v_proj"):
            yield m


def _installed_config(model):
    state = getattr(model, "_trace_fp4_kv", None)
    return state["config"] if state else None


def install_fp4_kv(model, config) -> None:
    """Route the model's attention through ``trace_fp4_sdpa`` (FP4 K/V per session mode); keeps the config's g."""
    from ..rl.config import FP4Config

    if not isinstance(config, FP4Config):
        raise TypeError(f"install_fp4_kv: config must be a trace_ext.rl.FP4Config, got {type(config).__name__}")
    if not any(True for _ in _attention_modules(model)):
        raise ValueError(f"install_fp4_kv: no attention module with layer_idx/k_proj/v_proj found in {type(model).__name__}")
    head_dim = getattr(model.config.get_text_config(decoder=True), "head_dim", None)
    if head_dim is not None:
        _check_head_dim(int(head_dim))
    _register()
    prev = getattr(model, "_trace_fp4_kv", None)
    previous_impl = prev["previous_attn"] if prev else model.config._attn_implementation
    _set_attn(model, ATTN_NAME)
    model._trace_fp4_kv = {"config": config, "previous_attn": previous_impl}


def uninstall_fp4_kv(model) -> None:
    """Undo ``install_fp4_kv`` (restores the previous attention implementation)."""
    state = getattr(model, "_trace_fp4_kv", None)
    if state is None:
        return
    _set_attn(model, state["previous_attn"] or "sdpa")
    del model._trace_fp4_kv


def _set_attn(model, name: str) -> None:
    try:
        model.set_attn_implementation(name)
    except (ValueError, AttributeError, ImportError):
        pass
    if model.config._attn_implementation != name:
        for m in model.modules():
            cfg = getattr(m, "config", None)
            if cfg is not None and hasattr(cfg, "_attn_implementation_internal"):
                cfg._attn_implementation_internal = name


def is_installed(model) -> bool:
    return getattr(model, "_trace_fp4_kv", None) is not None
