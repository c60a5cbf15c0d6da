"""Rollout guidance: the recorder's store, the layer policy, async offload, bytes/token, save/load, split/merge.

SPEC 5 and 6. During rollout every quantization site of a selected layer hands its rows' GuidanceRecord
(compact: mantissa bits + scale bytes + g; or full codes) to the session, keyed by (sequence, position) and,
for expert-down inputs and the KV cache, a third key (top-k slot, kv head). Prompt (prefill) rows and
generated rows alike. The trainer looks rows up by the same keys; a missing or mismatched row is an error.

Rows are kept as tensors, never per token in Python: a key is one int64 ``seq << 32 | pos << 8 | sub``; each
(site, layer) store appends chunks as they come (on the GPU during generation; flushed to pinned CPU memory
on a side stream) and sorts them once, on first lookup, for ``searchsorted``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from .._args import is_int
from ..reference import _check_guidance
from ..tensor import GuidanceRecord
from .config import FP4Config, site_group

FILE_FORMAT = "trace_ext.guidance"
FILE_VERSION = 1
SEQ_BITS, POS_BITS, SUB_BITS = 31, 24, 8
MAX_SEQ, MAX_POS, MAX_SUB = 1 << SEQ_BITS, 1 << POS_BITS, 1 << SUB_BITS


class GuidanceError(ValueError):
    """Guidance that is missing, or does not match the trainer's forward (site, shape, length, format, model)."""


# ---- keys ------------------------------------------------------------------------------------------------------


def encode_keys(keys) -> torch.Tensor:
    """(seq, pos[, sub]) int64 tensors of one length -> int64 keys seq << 32 | pos << 8 | sub."""
    if not isinstance(keys, (tuple, list)) or len(keys) not in (2, 3):
        raise TypeError("keys must be a tuple (seq, pos) or (seq, pos, sub) of int64 tensors")
    seq, pos = keys[0], keys[1]
    sub = keys[2] if len(keys) == 3 else None
    for name, t in (("seq", seq), ("pos", pos), ("sub", sub)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise TypeError(f"key '{name}' must be an integer tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() != 1 or t.shape[0] != seq.shape[0]:
            raise ValueError(f"keys must be 1-D of equal length; '{name}' has shape {tuple(t.shape)}, seq {tuple(seq.shape)}")
    k = (seq.long() << 32) | (pos.long() << 8)
    if sub is not None:
        k = k | sub.to(device=seq.device, dtype=torch.int64)
    if k.numel() and not k.is_cuda:  # device keys come from the session, which checks ranges once per forward
        lim = ((seq.long() >= 0) & (seq.long() < MAX_SEQ) & (pos.long() >= 0) & (pos.long() < MAX_POS)).all()
        if sub is not None:
            lim = lim & ((sub.long() >= 0) & (sub.long() < MAX_SUB)).all()
        if not bool(lim):
            raise ValueError(f"keys out of range: seq < 2^{SEQ_BITS}, pos < 2^{POS_BITS}, sub < 2^{SUB_BITS}")
    return k


def sequence_id_tensor(ids) -> torch.Tensor:
    """Sequence ids (a list or tensor of integers) as a 1-D int64 tensor; non-integer ids are a TypeError, since
    as_tensor(..., int64) would truncate 0.5 to 0 silently."""
    t = torch.as_tensor(ids)
    if t.numel() and t.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"sequence_ids must be integers, got {t.dtype}")
    return t.to(torch.int64).reshape(-1)


def decode_keys(k: torch.Tensor):
    return k >> 32, (k >> 8) & (MAX_POS - 1), k & (MAX_SUB - 1)


def _describe_key(k: int) -> str:
    return f"(seq={k >> 32}, pos={(k >> 8) & (MAX_POS - 1)}, sub={k & (MAX_SUB - 1)})"


# ---- one keyed table of rows ------------------------------------------------------------------------------------


class RowStore:
    """Rows with int64 keys and named tensor columns of equal length; the last write of a key wins."""

    def __init__(self, meta: dict, columns: dict | None = None, keys: torch.Tensor | None = None):
        self.meta = dict(meta)
        self._chunks: list[tuple[torch.Tensor, dict]] = []  # appended, unsorted
        self._keys = keys  # sorted unique keys once finalized
        self._cols = columns
        self._events: list = []
        self._pending_device_bytes = 0  # bytes of device chunks not yet offloaded (kept incrementally: O(1) per add)

    # appending ----------------------------------------------------------------------------------------------------
    def add(self, keys: torch.Tensor, cols: dict) -> None:
        # checked here, at the one entry of every row: a bad chunk would otherwise surface only at finalize / save
        _check_keys(keys)
        for name, col in cols.items():
            if col.shape[:1] != keys.shape:  # (devices may differ: a layer on another GPU; finalize gathers them)
                raise ValueError(f"{name}: {tuple(col.shape)} rows for {keys.numel()} keys")
        self._chunks.append((keys, cols))
        if keys.is_cuda:
            self._pending_device_bytes += _nbytes(keys, cols)

    def pending_nbytes(self) -> int:
        """Bytes of rows still on the device (waiting for the next offload)."""
        return self._pending_device_bytes

    def offload_async(self, stream) -> None:
        """Concatenate pending device chunks and copy them to pinned CPU memory on ``stream`` (no host sync)."""
        dev = [(k, c) for k, c in self._chunks if k.is_cuda]
        if not dev:
            return
        host = [(k, c) for k, c in self._chunks if not k.is_cuda]
        keys = torch.cat([k for k, _ in dev])
        cols = {n: torch.cat([c[n] for _, c in dev]) for n in dev[0][1]}
        stream.wait_stream(torch.cuda.current_stream(keys.device))
        with torch.cuda.stream(stream):
            out_k = torch.empty(keys.shape, dtype=keys.dtype, pin_memory=True)
            out_k.copy_(keys, non_blocking=True)
            out_c = {}
            for n, t in cols.items():
                out_c[n] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                out_c[n].copy_(t, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        keys.record_stream(stream)
        for t in cols.values():
            t.record_stream(stream)
        self._events.append(ev)
        self._chunks = host + [(out_k, out_c)]
        self._pending_device_bytes = 0

    def synchronize(self) -> None:
        for ev in self._events:
            ev.synchronize()
        self._events = []

    # sorted view ---------------------------------------------------------------------------------------------------
    def finalize(self) -> None:
        if not self._chunks:
            return
        self.synchronize()
        parts = []
        if self._keys is not None:
            parts.append((self._keys, self._cols))
        parts += self._chunks
        # offloaded rows stay in host memory: sort there rather than pull everything back to the device
        devs = {k.device for k, _ in parts}
        dev = torch.device("cpu") if any(d.type == "cpu" for d in devs) else parts[-1][0].device
        keys = torch.cat([k.to(dev) for k, _ in parts])
        names = list(parts[0][1])
        cols = {n: torch.cat([c[n].to(dev) for _, c in parts]) for n in names}
        # stable sort, then keep the last occurrence of every key
        order = torch.sort(keys, stable=True).indices
        keys = keys[order]
        last = torch.ones_like(keys, dtype=torch.bool)
        if keys.numel() > 1:
            last[:-1] = keys[1:] != keys[:-1]
        sel = order[last]
        self._keys = keys[last]
        self._cols = {n: t[sel] for n, t in cols.items()}
        self._chunks = []
        self._pending_device_bytes = 0

    @property
    def keys(self) -> torch.Tensor:
        self.finalize()
        return self._keys if self._keys is not None else torch.empty(0, dtype=torch.int64)

    @property
    def columns(self) -> dict:
        self.finalize()
        return self._cols or {}

    def __len__(self) -> int:
        return int(self.keys.numel())

    def nbytes(self) -> int:
        """Bytes of the column payload (keys excluded: they are the trainer's token ids, not guidance)."""
        n = sum(t.numel() * t.element_size() for t in self.columns.values())
        return n + sum(sum(t.numel() * t.element_size() for t in c.values()) for _, c in self._chunks)

    def find(self, keys: torch.Tensor):
        """(index of each key in the sorted store, found mask), on the store's device."""
        sk = self.keys
        q = keys.to(sk.device)
        if sk.numel() == 0:
            return torch.zeros_like(q), torch.zeros_like(q, dtype=torch.bool)
        idx = torch.searchsorted(sk, q).clamp(max=sk.numel() - 1)
        return idx, sk[idx] == q

    def lookup(self, keys: torch.Tensor, device, what: str) -> dict:
        idx, found = self.find(keys)
        if not bool(found.all()):
            miss = int(keys.to(found.device)[~found][0])
            raise GuidanceError(
                f"{what}: no rollout record for {int((~found).sum())} of {keys.numel()} rows, first missing key "
                f"{_describe_key(miss)}. The trainer must feed the rollout's padded sequences with the same sequence_ids "
                "(and no position the rollout never processed, e.g. the last sampled token: use input_ids[:, :-1])"
            )
        return {n: t[idx].to(device, non_blocking=True) for n, t in self.columns.items()}

    def to(self, device) -> "RowStore":
        k = self.keys
        return RowStore(self.meta, {n: t.to(device) for n, t in self.columns.items()}, k.to(device))

    def select_seqs(self, seqs: torch.Tensor) -> "RowStore":
        k = self.keys
        mask = torch.isin(k >> 32, seqs.to(k.device).long())
        return RowStore(self.meta, {n: t[mask] for n, t in self.columns.items()}, k[mask])


def _nbytes(keys, cols) -> int:
    return keys.numel() * 8 + sum(t.numel() * t.element_size() for t in cols.values())


# ---- argument checks (metadata only: no host sync on the recording path) ------------------------------------------


def _check_keys(keys, what: str = "") -> None:
    """Row keys are the 1-D int64 tensor of ``encode_keys`` (int32 / float keys would corrupt the (seq, pos) packing)."""
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or keys.dim() != 1:
        raise TypeError(f"{what + ': ' if what else ''}keys must be a 1-D int64 tensor (encode_keys), got "
                        f"{getattr(keys, 'dtype', type(keys).__name__)} of shape {tuple(getattr(keys, 'shape', ()))}")


def _check_site_layer(site, layer, label: str = "") -> int:
    if site is not None and not isinstance(site, str):
        raise TypeError(f"{label}site must be a str (e.g. 'expert_in'), got {type(site).__name__} {site!r}")
    if not is_int(layer):
        raise TypeError(f"{label}layer must be an int (the decoder layer index), got {type(layer).__name__} {layer!r}")
    if layer < 0:
        raise ValueError(f"{label}layer must be a non-negative layer index, got {layer}")
    return int(layer)


def _check_record(rec, what: str) -> None:
    """A GuidanceRecord of its kind's dtypes and widths (GuidanceRecord docstring): payload uint8 [R, K/8] (compact)
    or [R, K/2] (full), scales uint8 [R, K/16], g float32 [R], all on one device."""
    if not isinstance(rec, GuidanceRecord):
        raise TypeError(f"{what}: rec must be a GuidanceRecord, got {type(rec).__name__}")
    for name in ("payload", "scales", "g"):
        t = getattr(rec, name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: record {name} must be a tensor, got {type(t).__name__}")
    if rec.scales.dim() != 2:
        raise ValueError(f"{what}: record scales must be uint8 [rows, K/16], got shape {tuple(rec.scales.shape)}")
    try:
        _check_guidance(rec, rec.rows, rec.K)
    except (TypeError, ValueError, RuntimeError) as e:
        raise type(e)(f"{what}: {e}") from None


# ---- layer policy -----------------------------------------------------------------------------------------------


def record_bytes_per_row(K: int, kind: str) -> int:
    """SPEC 6: compact K/8 + K/16 + 4; full K/2 + K/16 + 4."""
    return (K // 8 if kind == "compact" else K // 2) + K // 16 + 4


@dataclass(frozen=True)
class LayerSite:
    """A guided site of one layer: ``rows_per_token`` records of width ``K`` per token."""

    site: str
    layer: int
    K: int
    rows_per_token: int


def guided_layers(config: FP4Config, layout: list[LayerSite] | None) -> frozenset:
    """Layers whose guided sites the rollout records (SPEC 5 scope): deeper half, explicit list, all, or budget."""
    n = config.num_layers
    if config.guidance_budget_bytes_per_token is not None:
        if layout is None or n is None:
            raise ValueError("a guidance byte budget needs the model layout: convert() the model first")
        per_layer = {}
        for s in layout:
            if config.guides(site_group(s.site)):
                per_layer[s.layer] = per_layer.get(s.layer, 0) + s.rows_per_token * record_bytes_per_row(s.K, config.guidance_kind)
        chosen, total = [], 0
        for layer in sorted(per_layer, reverse=True):  # deepest first, as TRACE prefers deep layers
            if total + per_layer[layer] > config.guidance_budget_bytes_per_token:
                break
            chosen.append(layer)
            total += per_layer[layer]
        return frozenset(chosen)
    gl = config.guidance_layers
    if gl is None:
        if n is None:
            raise ValueError("guidance_layers=None (all layers) needs config.num_layers (set by convert())")
        return frozenset(range(n))
    if gl == "deeper_half":
        if n is None:
            raise ValueError("guidance_layers='deeper_half' needs config.num_layers (set by convert())")
        return frozenset(range(n // 2, n))
    if n is not None and any(i >= n for i in gl):
        raise ValueError(f"guidance_layers {list(gl)} out of range for a model with {n} layers")
    return frozenset(gl)


# ---- the cache ---------------------------------------------------------------------------------------------------


class GuidanceCache:
    """Everything the rollout hands to the trainer besides tokens: guidance records and routes (R3).

    ``records[(site, layer)]``: RowStore with columns payload / scales / g (meta: K, kind).
    ``routes[layer]``: RowStore with column topk (meta: k), keys (seq, pos).
    """

    def __init__(self, config: FP4Config, model_signature: dict | None = None, layers=frozenset()):
        self.config = config
        self.model_signature = dict(model_signature or {})
        self.layers = frozenset(layers)  # the policy's layers at record time
        self.records: dict[tuple[str, int], RowStore] = {}
        self.routes: dict[int, RowStore] = {}
        self._stream = None

    # recording (rollout) -----------------------------------------------------------------------------------------
    def add_record(self, site: str, layer: int, keys: torch.Tensor, rec: GuidanceRecord) -> None:
        # everything is checked before a store exists: a rejected add must leave the cache as it was
        layer = _check_site_layer(site, layer)
        what = f"{site}[{layer}]"
        _check_keys(keys, what)
        _check_record(rec, what)
        if rec.rows != keys.numel():
            raise ValueError(f"{what}: {keys.numel()} keys for a record of {rec.rows} rows")
        if rec.kind != self.config.guidance_kind:
            if rec.kind == "full" and self.config.guidance_kind == "compact":
                rec = to_compact(rec)
            else:
                raise GuidanceError(f"{what}: got a {rec.kind!r} record, the config keeps {self.config.guidance_kind!r}")
        store = self.records.get((site, layer))
        if store is None:
            store = self.records[(site, layer)] = RowStore({"K": rec.K, "kind": rec.kind})
        elif store.meta["K"] != rec.K:
            raise GuidanceError(f"{site}[{layer}]: record width K={rec.K} differs from earlier rows (K={store.meta['K']})")
        store.add(keys, {"payload": rec.payload, "scales": rec.scales, "g": rec.g})
        self._maybe_offload(store)

    def add_routes(self, layer: int, keys: torch.Tensor, topk: torch.Tensor) -> None:
        # everything is checked before a store exists: a rejected add must leave the cache as it was
        layer = _check_site_layer(None, layer, "routes: ")
        _check_keys(keys, f"routes[{layer}]")
        if not isinstance(topk, torch.Tensor) or topk.dtype not in (torch.int16, torch.int32, torch.int64):
            raise TypeError(f"routes[{layer}]: topk must be an integer [rows, k] tensor, got "
                            f"{getattr(topk, 'dtype', type(topk).__name__)}")
        if topk.dim() != 2:
            raise ValueError(f"routes[{layer}]: topk must be [rows, k] (one row per key), got shape {tuple(topk.shape)}")
        if topk.shape[0] != keys.numel():
            raise ValueError(f"routes[{layer}]: topk: {tuple(topk.shape)} rows for {keys.numel()} keys")
        store = self.routes.get(layer)
        if store is not None and store.meta["k"] != topk.shape[-1]:
            raise GuidanceError(f"routes[{layer}]: top-k {topk.shape[-1]} differs from earlier rows ({store.meta['k']})")
        if topk.device.type == "cpu" and topk.numel() and not (0 <= int(topk.min()) and int(topk.max()) < 2**15):
            # (device ids: convert checks num_experts < 2^15 once; a per-call check would sync the rollout)
            raise ValueError(f"routes[{layer}]: expert ids must be in [0, 2^15), got [{int(topk.min())}, {int(topk.max())}]")
        if store is None:
            store = self.routes[layer] = RowStore({"k": int(topk.shape[-1])})
        store.add(keys, {"topk": topk.to(torch.int16)})  # expert ids < 2^15 (checked by convert)
        self._maybe_offload(store)

    def _offload_enabled(self, store: RowStore) -> bool:
        if self.config.offload == "none" or not store._chunks or not store._chunks[-1][0].is_cuda:
            return False
        return True

    def _maybe_offload(self, store: RowStore) -> None:
        if self._offload_enabled(store) and store.pending_nbytes() >= self.config.offload_chunk_bytes:
            store.offload_async(self._side_stream(store._chunks[-1][0].device))

    def _side_stream(self, device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def offload(self) -> "GuidanceCache":
        """Flush every store's device rows to pinned CPU memory (asynchronous; ``synchronize`` waits)."""
        for store in self._stores():
            if store._chunks and store._chunks[-1][0].is_cuda and self.config.offload != "none":
                store.offload_async(self._side_stream(store._chunks[-1][0].device))
        return self

    def synchronize(self) -> None:
        for store in self._stores():
            store.synchronize()

    def _stores(self):
        return list(self.records.values()) + list(self.routes.values())

    # lookups (trainer) --------------------------------------------------------------------------------------------
    def check_compatible(self, config: FP4Config, model_signature: dict | None) -> None:
        if config.format != self.config.format or config.guidance_kind != self.config.guidance_kind:
            raise GuidanceError(
                f"guidance was recorded as format={self.config.format!r}, kind={self.config.guidance_kind!r}; the trainer "
                f"uses format={config.format!r}, kind={config.guidance_kind!r}"
            )
        if model_signature and self.model_signature and model_signature != self.model_signature:
            diff = {k: (self.model_signature.get(k), model_signature.get(k)) for k in set(self.model_signature) | set(model_signature)
                    if self.model_signature.get(k) != model_signature.get(k)}
            raise GuidanceError(f"guidance comes from another model: (recorded, trainer) differ in {diff}")

    def get_record(self, site: str, layer: int, keys: torch.Tensor, K: int, device) -> GuidanceRecord:
        _check_keys(keys, f"guidance {site}[{layer}]")
        store = self.records.get((site, layer))
        if store is None:
            have = sorted({s for s, _ in self.records})
            raise GuidanceError(
                f"no guidance for site {site!r} of layer {layer}: the rollout recorded sites {have} for layers "
                f"{sorted({l for _, l in self.records})}"
            )
        if store.meta["K"] != K:
            raise GuidanceError(f"{site}[{layer}]: rollout rows have K={store.meta['K']}, the trainer quantizes K={K}")
        cols = store.lookup(keys, device, f"guidance {site}[{layer}]")
        return GuidanceRecord(store.meta["kind"], cols["payload"], cols["scales"], cols["g"])

    def get_routes(self, layer: int, keys: torch.Tensor, device) -> torch.Tensor:
        _check_keys(keys, f"routes[{layer}]")
        store = self.routes.get(layer)
        if store is None:
            raise GuidanceError(f"no recorded routes for layer {layer} (recorded layers: {sorted(self.routes)})")
        return store.lookup(keys, device, f"routes[{layer}]")["topk"].long()

    # accounting ---------------------------------------------------------------------------------------------------
    def tokens(self) -> torch.Tensor:
        """Distinct (seq, pos) keys (as seq << 32 | pos << 8) seen by any store."""
        ks = [s.keys & ~(MAX_SUB - 1) for s in self._stores()]
        ks = [k.cpu() for k in ks if k.numel()]
        return torch.unique(torch.cat(ks)) if ks else torch.empty(0, dtype=torch.int64)

    def nbytes(self, include_routes: bool = False) -> int:
        n = sum(s.nbytes() for s in self.records.values())
        return n + (sum(s.nbytes() for s in self.routes.values()) if include_routes else 0)

    def bytes_per_token(self, include_routes: bool = False) -> float:
        t = self.tokens().numel()
        return self.nbytes(include_routes) / t if t else 0.0

    def sequence_ids(self) -> torch.Tensor:
        return torch.unique(self.tokens() >> 32)

    def sequence_lengths(self) -> dict:
        """{seq: number of positions recorded (max pos + 1)}."""
        t = self.tokens()
        seq, pos = t >> 32, (t >> 8) & (MAX_POS - 1)
        out = {}
        for s in torch.unique(seq).tolist():
            out[s] = int(pos[seq == s].max()) + 1
        return out

    # split / merge --------------------------------------------------------------------------------------------------
    def select(self, sequence_ids) -> "GuidanceCache":
        """A cache holding only these sequences (e.g. one data-parallel micro-batch). Ids must be integers the cache
        holds (GuidanceError otherwise: a micro-batch that would find no guidance is a mistake made here, not later)."""
        return self._select(sequence_id_tensor(sequence_ids), set(self.sequence_ids().tolist()))

    def _select(self, seqs: torch.Tensor, held: set) -> "GuidanceCache":
        missing = sorted(set(seqs.tolist()) - held)
        if missing:
            raise GuidanceError(f"select: sequence ids {missing[:8]} are not in this cache")
        out = GuidanceCache(self.config, self.model_signature, self.layers)
        out.records = {k: s.select_seqs(seqs) for k, s in self.records.items()}
        out.routes = {k: s.select_seqs(seqs) for k, s in self.routes.items()}
        return out

    def to(self, device) -> "GuidanceCache":
        """A copy with every store on ``device`` (e.g. a micro-batch's part on the trainer's GPU before its forward,
        so lookups run there instead of copying keys to the host)."""
        out = GuidanceCache(self.config, self.model_signature, self.layers)
        out.records = {k: s.to(device) for k, s in self.records.items()}
        out.routes = {k: s.to(device) for k, s in self.routes.items()}
        return out

    def split(self, groups) -> list["GuidanceCache"]:
        """One cache per group of sequence ids: ``split([[0, 1], [2, 3]])``, or ``split(n)`` into n equal parts."""
        if isinstance(groups, bool) or isinstance(groups, (str, bytes)):
            raise TypeError(f"split: groups must be a number of parts (int) or a list of sequence-id groups, got {groups!r}")
        if is_int(groups):
            if groups < 1:
                raise ValueError(f"split: the number of parts must be >= 1, got {groups}")
            groups = int(groups)
        elif not hasattr(groups, "__iter__"):
            raise TypeError(f"split: groups must be a number of parts (int) or a list of sequence-id groups, got "
                            f"{type(groups).__name__}")
        seqs = self.sequence_ids()  # once for all groups (it sorts every store's keys)
        if isinstance(groups, int):
            groups = list(torch.tensor_split(seqs, groups))
        held = set(seqs.tolist())
        return [self._select(sequence_id_tensor(g), held) for g in groups]

    @staticmethod
    def merge(caches: list["GuidanceCache"]) -> "GuidanceCache":
        """Union of caches over disjoint sequences (same config and model); overlapping sequences are an error."""
        if isinstance(caches, GuidanceCache) or not isinstance(caches, (list, tuple)):
            raise TypeError(f"merge takes a list of GuidanceCache, got {type(caches).__name__}")
        for i, c in enumerate(caches):
            if not isinstance(c, GuidanceCache):
                raise TypeError(f"merge: caches[{i}] must be a GuidanceCache, got {type(c).__name__}")
        if not caches:
            raise ValueError("merge needs at least one cache")
        first = caches[0]
        seen = torch.empty(0, dtype=torch.int64)
        for c in caches[1:]:
            c.check_compatible(first.config, first.model_signature)
            if c.config.to_dict() != first.config.to_dict():
                raise GuidanceError("merge: caches were recorded with different configs")
        for c in caches:
            s = c.sequence_ids()
            if torch.isin(s, seen).any():
                raise GuidanceError(f"merge: sequence ids {torch.unique(s[torch.isin(s, seen)]).tolist()} occur in two caches")
            seen = torch.cat([seen, s])
        out = GuidanceCache(first.config, first.model_signature, first.layers)
        for c in caches:
            _merge_stores(out.records, c.records, "")
            _merge_stores(out.routes, c.routes, "routes")
        return out

    # save / load ----------------------------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """safetensors file with a versioned JSON header ("trace_ext_guidance": format, version, config, model, stores)."""
        from safetensors.torch import save_file

        tensors, stores = {}, []
        for (site, layer), s in sorted(self.records.items()):
            name = f"rec.{site}.{layer}"
            stores.append({"name": name, "type": "record", "site": site, "layer": layer, "meta": s.meta})
            tensors[name + ".keys"] = s.keys.cpu().contiguous()
            for c, t in s.columns.items():
                tensors[f"{name}.{c}"] = t.cpu().contiguous()
        for layer, s in sorted(self.routes.items()):
            name = f"routes.{layer}"
            stores.append({"name": name, "type": "routes", "layer": layer, "meta": s.meta})
            tensors[name + ".keys"] = s.keys.cpu().contiguous()
            tensors[name + ".topk"] = s.columns["topk"].cpu().contiguous()
        header = {
            "format": FILE_FORMAT,
            "version": FILE_VERSION,
            "config": self.config.to_dict(),
            "model": self.model_signature,
            "layers": sorted(self.layers),
            "stores": stores,
        }
        save_file(tensors, path, metadata={"trace_ext_guidance": json.dumps(header)})

    @classmethod
    def load(cls, path: str, device="cpu") -> "GuidanceCache":
        """Inverse of ``save``; validates the header, every store's tensors, dtypes and shapes."""
        from safetensors import SafetensorError, safe_open

        try:
            f_ctx = safe_open(path, framework="pt", device=str(device))
        except SafetensorError as e:
            raise GuidanceError(f"{path} is not a trace_ext guidance file (not a safetensors file: {e})") from e
        with f_ctx as f:
            meta = f.metadata() or {}
            if "trace_ext_guidance" not in meta:
                raise GuidanceError(f"{path} is not a trace_ext guidance file (no 'trace_ext_guidance' header)")
            try:
                header = json.loads(meta["trace_ext_guidance"])
            except json.JSONDecodeError as e:
                raise GuidanceError(f"{path}: corrupt guidance header: {e}") from e
            if not isinstance(header, dict):
                raise GuidanceError(f"{path}: corrupt guidance header: a JSON object expected, got {type(header).__name__}")
            if header.get("format") != FILE_FORMAT:
                raise GuidanceError(f"{path}: header format {header.get('format')!r}, expected {FILE_FORMAT!r}")
            if header.get("version") != FILE_VERSION:
                raise GuidanceError(f"{path}: guidance file version {header.get('version')}, this trace_ext reads {FILE_VERSION}")
            names = set(f.keys())
            config = _header_config(path, _hfield(path, header, "config", dict, "the header"))
            model = header.get("model") or {}
            if not isinstance(model, dict):
                raise GuidanceError(f"{path}: corrupt guidance header: 'model' must be an object, got {type(model).__name__}")
            layers = header.get("layers") or []
            if not isinstance(layers, list) or not all(_is_index(i) for i in layers):
                raise GuidanceError(f"{path}: corrupt guidance header: 'layers' must be a list of layer indices, got {layers!r}")
            stores = _hfield(path, header, "stores", list, "the header")
            cache = cls(config, model, layers)

            def get(n):
                if n not in names:
                    raise GuidanceError(f"{path}: tensor {n!r} listed in the header is missing")
                return f.get_tensor(n)

            for i, st in enumerate(stores):
                _check_header_store(path, st, i)
                keys = get(st["name"] + ".keys")
                if keys.dtype != torch.int64 or keys.dim() != 1:
                    raise GuidanceError(f"{path}: {st['name']}.keys must be int64 [R], got {keys.dtype} {tuple(keys.shape)}")
                R = keys.shape[0]
                if st["type"] == "record":
                    K, kind = int(st["meta"]["K"]), st["meta"]["kind"]
                    width = K // 8 if kind == "compact" else K // 2
                    cols = {c: get(f"{st['name']}.{c}") for c in ("payload", "scales", "g")}
                    want = {"payload": (torch.uint8, (R, width)), "scales": (torch.uint8, (R, K // 16)), "g": (torch.float32, (R,))}
                    for c, (dt, shape) in want.items():
                        if cols[c].dtype != dt or tuple(cols[c].shape) != shape:
                            raise GuidanceError(
                                f"{path}: {st['name']}.{c} must be {dt} {shape}, got {cols[c].dtype} {tuple(cols[c].shape)}"
                            )
                    cache.records[(st["site"], int(st["layer"]))] = RowStore({"K": K, "kind": kind}, cols, keys)
                elif st["type"] == "routes":
                    topk = get(st["name"] + ".topk")
                    k = int(st["meta"]["k"])
                    if tuple(topk.shape) != (R, k) or topk.dtype not in (torch.int16, torch.int32, torch.int64):
                        raise GuidanceError(f"{path}: {st['name']}.topk must be int [{R}, {k}], got {topk.dtype} {tuple(topk.shape)}")
                    cache.routes[int(st["layer"])] = RowStore({"k": k}, {"topk": topk}, keys)
                else:
                    raise GuidanceError(f"{path}: unknown store type {st['type']!r}")
                if R > 1 and not bool((keys[1:] > keys[:-1]).all()):
                    raise GuidanceError(f"{path}: {st['name']}.keys are not strictly increasing (corrupt file)")
        return cache


def _is_index(v) -> bool:
    return is_int(v) and v >= 0


def _hfield(path: str, d: dict, key: str, types, where: str):
    """A field of the file's JSON header, of the given type; GuidanceError (a corrupt file) otherwise."""
    if not isinstance(d, dict) or key not in d:
        raise GuidanceError(f"{path}: corrupt guidance header: {where} has no {key!r}")
    v = d[key]
    if not isinstance(v, types) or isinstance(v, bool):  # (JSON true is not a layer index or a K)
        raise GuidanceError(f"{path}: corrupt guidance header: {where}'s {key!r} is {v!r}")
    return v


def _header_config(path: str, cfgd: dict) -> FP4Config:
    """The FP4Config of a file header (FP4Config.to_dict): every field there must be valid; a field the writer did not
    know yet takes its default."""
    cfgd = dict(cfgd)
    for k in ("sites", "guided_sites"):
        if k not in cfgd:
            continue
        if not isinstance(cfgd[k], list):
            raise GuidanceError(f"{path}: corrupt guidance header: config {k!r} must be a list, got {cfgd[k]!r}")
        cfgd[k] = frozenset(cfgd[k])
    try:
        return FP4Config(**cfgd)
    except (TypeError, ValueError) as e:
        raise GuidanceError(f"{path}: corrupt guidance header: invalid config: {e}") from e


def _check_header_store(path: str, st, i: int) -> None:
    where = f"stores[{i}]"
    if not isinstance(st, dict):
        raise GuidanceError(f"{path}: corrupt guidance header: {where} must be an object, got {st!r}")
    _hfield(path, st, "name", str, where)
    kind = _hfield(path, st, "type", str, where)
    if not _is_index(_hfield(path, st, "layer", int, where)):
        raise GuidanceError(f"{path}: corrupt guidance header: {where}'s layer must be >= 0, got {st['layer']}")
    meta = _hfield(path, st, "meta", dict, where)
    if kind == "record":
        _hfield(path, st, "site", str, where)
        K = _hfield(path, meta, "K", int, f"{where}.meta")
        if K <= 0 or K % 16:
            raise GuidanceError(f"{path}: corrupt guidance header: {where}.meta K must be a positive multiple of 16, got {K}")
        if _hfield(path, meta, "kind", str, f"{where}.meta") not in ("compact", "full"):
            raise GuidanceError(
                f"{path}: corrupt guidance header: {where}.meta kind must be 'compact' or 'full', got {meta['kind']!r}"
            )
    elif kind == "routes":
        if not _is_index(_hfield(path, meta, "k", int, f"{where}.meta")):
            raise GuidanceError(f"{path}: corrupt guidance header: {where}.meta k must be >= 0, got {meta['k']}")


def to_compact(rec: GuidanceRecord) -> GuidanceRecord:
    """The compact record (mantissa bits) of a full-codes record: same scales and g."""
    from .. import formats as F
    from ..reference import pack_mantissa_bits

    if rec.kind == "compact":
        return rec
    return GuidanceRecord("compact", pack_mantissa_bits(F.unpack_nibbles(rec.payload) & 1), rec.scales, rec.g)


class GuidanceRecorder:
    """What ``trace_ext.rl.rollout`` yields: the cache being filled, plus its accounting."""

    def __init__(self, cache: GuidanceCache, codes: GuidanceCache | None = None):
        self.cache = cache
        self.codes = codes  # full codes of every quantized site when rollout(..., capture_codes=True)

    def bytes_per_token(self, include_routes: bool = False) -> float:
        return self.cache.bytes_per_token(include_routes)

    def save(self, path: str) -> None:
        self.cache.save(path)


def _merge_stores(dst_map: dict, src_map: dict, label: str) -> None:
    """Append every RowStore of src_map to the one under the same key in dst_map (metas must agree)."""
    for k, s in src_map.items():
        dst = dst_map.setdefault(k, RowStore(s.meta))
        if dst.meta != s.meta:
            name = f"{label}[{k}]" if label else f"{k}"
            raise GuidanceError(f"merge: {name} has meta {s.meta} vs {dst.meta}")
        if len(s):
            dst.add(s.keys, s.columns)
