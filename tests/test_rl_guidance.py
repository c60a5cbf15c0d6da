"""Guidance cache, layer policy, session keys and config (SPEC 5, 6): what the rollout hands the trainer."""
import json

import pytest
import torch

from trace_ext import reference as ref
from trace_ext.rl import FP4Config, GuidanceCache, GuidanceError, guided_layers
from trace_ext.rl.guidance import LayerSite, decode_keys, encode_keys, record_bytes_per_row, to_compact
from trace_ext.rl.session import Session, current_session, rollout, train
from trace_ext.tensor import GuidanceRecord

K = 64


def _rec(rows, K=K, kind="compact", seed=0):
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(seed)) * 2
    q = ref.nvfp4_quantize(x)
    return ref.guidance_from_quantized(q, kind)


def _keys(seqs, positions, sub=None):
    seq = torch.tensor(seqs, dtype=torch.int64)
    pos = torch.tensor(positions, dtype=torch.int64)
    return (seq, pos) if sub is None else (seq, pos, torch.tensor(sub, dtype=torch.int64))


def _cache(kind="compact", **kw):
    return GuidanceCache(FP4Config(num_layers=4, guidance_kind=kind, offload="none", **kw), {"model_type": "t"}, {2, 3})


# ---- keys ----------------------------------------------------------------------------------------------------------


def test_keys_round_trip_and_range():
    """Protects: (seq, pos, sub) pack into one int64 without collisions, and out-of-range keys are refused."""
    k = encode_keys(_keys([0, 5, 2**31 - 1], [0, 2**24 - 1, 17], [0, 255, 3]))
    seq, pos, sub = decode_keys(k)
    assert seq.tolist() == [0, 5, 2**31 - 1] and pos.tolist() == [0, 2**24 - 1, 17] and sub.tolist() == [0, 255, 3]
    with pytest.raises(ValueError, match="out of range"):
        encode_keys(_keys([0], [2**24]))
    with pytest.raises(ValueError, match="out of range"):
        encode_keys(_keys([0], [0], [256]))
    with pytest.raises(TypeError):
        encode_keys((torch.zeros(2), torch.zeros(2)))
    with pytest.raises(ValueError, match="equal length"):
        encode_keys((torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)))


# ---- cache: record / lookup -------------------------------------------------------------------------------------


def test_lookup_returns_rows_in_key_order_across_chunks():
    """Protects: rows recorded in several chunks (prefill, then decode steps) come back in the trainer's key order."""
    c = _cache()
    rec = _rec(6)
    # prefill: seq 0 and 1, positions 0..1; then one decode row each
    c.add_record("expert_in", 2, encode_keys(_keys([0, 0, 1, 1], [0, 1, 0, 1])), rec.index_rows(torch.arange(4)))
    c.add_record("expert_in", 2, encode_keys(_keys([0, 1], [2, 2])), rec.index_rows(torch.tensor([4, 5])))
    want_order = [5, 0, 2, 1]  # (1,2), (0,0), (1,0), (0,1)
    got = c.get_record("expert_in", 2, encode_keys(_keys([1, 0, 1, 0], [2, 0, 0, 1])), K, "cpu")
    exp = rec.index_rows(torch.tensor(want_order))
    assert torch.equal(got.payload, exp.payload) and torch.equal(got.scales, exp.scales) and torch.equal(got.g, exp.g)


def test_last_write_wins():
    """Protects: re-recording a key (e.g. a recomputed step) replaces the earlier row instead of duplicating it."""
    c = _cache()
    a, b = _rec(1, seed=1), _rec(1, seed=2)
    key = encode_keys(_keys([3], [4]))
    c.add_record("expert_in", 2, key, a)
    c.add_record("expert_in", 2, key, b)
    assert len(c.records[("expert_in", 2)]) == 1
    assert torch.equal(c.get_record("expert_in", 2, key, K, "cpu").payload, b.payload)


def test_missing_and_mismatched_guidance_raise():
    """Protects: a missing row / site / layer, another K or another format is a clear error, never a fallback."""
    c = _cache()
    c.add_record("expert_in", 2, encode_keys(_keys([0, 0], [0, 1])), _rec(2))
    with pytest.raises(GuidanceError, match=r"first missing key \(seq=0, pos=7"):
        c.get_record("expert_in", 2, encode_keys(_keys([0, 0], [1, 7])), K, "cpu")
    with pytest.raises(GuidanceError, match="no guidance for site 'expert_down_in'"):
        c.get_record("expert_down_in", 2, encode_keys(_keys([0], [0], [0])), K, "cpu")
    with pytest.raises(GuidanceError, match="no guidance for site 'expert_in' of layer 3"):
        c.get_record("expert_in", 3, encode_keys(_keys([0], [0])), K, "cpu")
    with pytest.raises(GuidanceError, match="K=64, the trainer quantizes K=128"):
        c.get_record("expert_in", 2, encode_keys(_keys([0], [0])), 128, "cpu")
    with pytest.raises(GuidanceError, match="width"):
        c.add_record("expert_in", 2, encode_keys(_keys([0], [5])), _rec(1, K=128))
    with pytest.raises(GuidanceError, match="format"):
        c.check_compatible(FP4Config(format="mxfp4"), None)
    with pytest.raises(GuidanceError, match="another model"):
        c.check_compatible(c.config, {"model_type": "other"})


def test_full_records_are_kept_compact_when_the_config_says_so():
    """Protects: a KV cache hands full codes; a compact config stores just their mantissa bits (SPEC 6 size)."""
    c = _cache("compact")
    full = _rec(3, kind="full")
    c.add_record("kv_k", 2, encode_keys(_keys([0, 0, 0], [0, 0, 0], [0, 1, 2])), full)
    got = c.get_record("kv_k", 2, encode_keys(_keys([0, 0, 0], [0, 0, 0], [0, 1, 2])), K, "cpu")
    assert got.kind == "compact" and torch.equal(got.payload, to_compact(full).payload)
    with pytest.raises(GuidanceError, match="compact"):
        _cache("full").add_record("kv_k", 2, encode_keys(_keys([0], [0], [0])), _rec(1))


def test_bytes_per_token_matches_spec6():
    """Protects: the reported bytes/token is K/8 + K/16 + 4 per compact row (K/2 + K/16 + 4 full), routes excluded."""
    c = _cache()
    T = 5
    c.add_record("expert_in", 2, encode_keys(_keys([0] * T, list(range(T)))), _rec(T))
    c.add_record("expert_down_in", 2, encode_keys(_keys([0] * 2 * T, [p for p in range(T) for _ in (0, 1)], [0, 1] * T)),
                 _rec(2 * T, K=32))
    c.add_routes(2, encode_keys(_keys([0] * T, list(range(T)))), torch.zeros(T, 2, dtype=torch.int64))
    want = record_bytes_per_row(64, "compact") + 2 * record_bytes_per_row(32, "compact")
    assert want == (8 + 4 + 4) + 2 * (4 + 2 + 4)
    assert c.bytes_per_token() == pytest.approx(want)
    assert c.bytes_per_token(include_routes=True) == pytest.approx(want + 2 * 2)  # int16 expert ids


# ---- policy ------------------------------------------------------------------------------------------------------


def test_layer_policy():
    """Protects: default deeper half (TRACE), explicit list, all layers, and the per-token byte budget (deepest first)."""
    assert guided_layers(FP4Config(num_layers=6), None) == {3, 4, 5}
    assert guided_layers(FP4Config(num_layers=7), None) == {3, 4, 5, 6}
    assert guided_layers(FP4Config(num_layers=6, guidance_layers=[0, 5]), None) == {0, 5}
    assert guided_layers(FP4Config(num_layers=3, guidance_layers=None), None) == {0, 1, 2}
    layout = [LayerSite("expert_in", l, 64, 1) for l in range(4)] + [LayerSite("kv_k", l, 64, 2) for l in range(4)]
    per_layer = 3 * record_bytes_per_row(64, "compact")  # 48
    cfg = FP4Config(num_layers=4, guidance_budget_bytes_per_token=2 * per_layer + 1)
    assert guided_layers(cfg, layout) == {2, 3}
    with pytest.raises(ValueError, match="out of range"):
        guided_layers(FP4Config(num_layers=2, guidance_layers=[3]), None)
    with pytest.raises(ValueError, match="num_layers"):
        guided_layers(FP4Config(), None)


def test_config_validation():
    """Protects: bad configuration values fail at construction with the field's name."""
    with pytest.raises(ValueError, match="format"):
        FP4Config(format="fp8")
    with pytest.raises(ValueError, match="sites"):
        FP4Config(sites={"experts", "lm_head"})
    with pytest.raises(TypeError):
        FP4Config(sites="experts")
    with pytest.raises(ValueError, match="guidance_layers"):
        FP4Config(guidance_layers="shallow")
    with pytest.raises(ValueError, match="kv_g_k"):
        FP4Config(kv_g_k=0.0)
    with pytest.raises(ValueError, match="activation"):
        FP4Config(activation="w8a8")
    c = FP4Config(guidance_layers=[3, 1, 3])
    assert c.guidance_layers == (1, 3) and c.with_(format="mxfp4").block == 32
    with pytest.raises(ValueError, match="out of range"):  # known at construction once num_layers is (convert())
        c.with_(num_layers=3)
    for bad, exc in ((0, ValueError), (-1, ValueError), (1.5, TypeError)):
        with pytest.raises(exc, match="offload_chunk_bytes"):
            FP4Config(offload_chunk_bytes=bad)


# ---- save / load ---------------------------------------------------------------------------------------------------


def _filled_cache(seqs=(0, 1, 2, 3)):
    c = _cache()
    for s in seqs:
        c.add_record("expert_in", 2, encode_keys(_keys([s] * 3, [0, 1, 2])), _rec(3, seed=s))
        c.add_record("expert_down_in", 3, encode_keys(_keys([s] * 2, [0, 0], [0, 1])), _rec(2, K=32, seed=10 + s))
        c.add_routes(2, encode_keys(_keys([s] * 3, [0, 1, 2])), torch.full((3, 2), s, dtype=torch.int64))
    return c


def _same(a: GuidanceCache, b: GuidanceCache):
    assert set(a.records) == set(b.records) and set(a.routes) == set(b.routes)
    for k in a.records:
        assert torch.equal(a.records[k].keys, b.records[k].keys)
        for n in ("payload", "scales", "g"):
            assert torch.equal(a.records[k].columns[n], b.records[k].columns[n])
    for k in a.routes:
        assert torch.equal(a.routes[k].keys, b.routes[k].keys)
        assert torch.equal(a.routes[k].columns["topk"], b.routes[k].columns["topk"])


def test_save_load_round_trip(tmp_path):
    """Protects: a saved cache loads bit-identical, with config, model signature and policy layers."""
    c = _filled_cache()
    path = str(tmp_path / "g.safetensors")
    c.save(path)
    d = GuidanceCache.load(path)
    _same(c, d)
    assert d.config.to_dict() == c.config.to_dict() and d.model_signature == c.model_signature and d.layers == {2, 3}


def _saved_cache_parts(tmp_path):
    """A filled cache, and the JSON header and tensors of its saved file (to write altered copies of it)."""
    from safetensors import safe_open

    c = _filled_cache()
    path = str(tmp_path / "g.safetensors")
    c.save(path)
    with safe_open(path, "pt") as f:
        return c, json.loads(f.metadata()["trace_ext_guidance"]), {k: f.get_tensor(k) for k in f.keys()}


def test_load_validates_header_and_tensors(tmp_path):
    """Protects: a wrong version, a foreign file, a missing or mis-shaped tensor are refused on load."""
    from safetensors.torch import save_file

    c, header, tensors = _saved_cache_parts(tmp_path)

    def write(name, t, h):
        p = str(tmp_path / name)
        save_file(t, p, metadata={"trace_ext_guidance": json.dumps(h)})
        return p

    with pytest.raises(GuidanceError, match="version"):
        GuidanceCache.load(write("v.st", tensors, {**header, "version": 99}))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "foreign.st"))
    with pytest.raises(GuidanceError, match="not a trace_ext guidance file"):
        GuidanceCache.load(str(tmp_path / "foreign.st"))
    t2 = dict(tensors)
    del t2["rec.expert_in.2.scales"]
    with pytest.raises(GuidanceError, match="missing"):
        GuidanceCache.load(write("m.st", t2, header))
    t3 = dict(tensors)
    t3["rec.expert_in.2.payload"] = t3["rec.expert_in.2.payload"][:, :2].contiguous()
    with pytest.raises(GuidanceError, match="payload must be"):
        GuidanceCache.load(write("s.st", t3, header))


# ---- split / merge -------------------------------------------------------------------------------------------------


def test_split_and_merge_by_sequence():
    """Protects: data-parallel micro-batches get exactly their sequences; merging the parts restores the cache."""
    c = _filled_cache()
    a, b = c.split([[0, 2], [1, 3]])
    assert a.sequence_ids().tolist() == [0, 2] and b.sequence_ids().tolist() == [1, 3]
    assert torch.equal(a.get_routes(2, encode_keys(_keys([2], [1])), "cpu"), torch.full((1, 2), 2))
    with pytest.raises(GuidanceError):
        a.get_record("expert_in", 2, encode_keys(_keys([1], [0])), K, "cpu")
    _same(GuidanceCache.merge([b, a]), c)
    _same(c.to("cpu"), c)
    assert [p.sequence_ids().tolist() for p in c.split(2)] == [[0, 1], [2, 3]]
    with pytest.raises(GuidanceError, match="occur in two caches"):
        GuidanceCache.merge([a, a])
    # ids the cache does not hold, or non-integer ids (which as_tensor(..., int64) truncated), are refused
    with pytest.raises(GuidanceError, match=r"sequence ids \[9\] are not in this cache"):
        c.split([[0, 9]])
    with pytest.raises(TypeError, match="integers"):
        c.select([1.5])


# ---- session keys ------------------------------------------------------------------------------------------------


class _Tiny(torch.nn.Module):
    """Stands in for a HF model: records the session's token keys at every call."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, input_ids=None, cache=None, past_key_values=None, cache_position=None):
        self.seen.append(tuple(t.clone() for t in current_session().token_keys()))
        return input_ids


class _Len:
    def __init__(self, n):
        self.n = n

    def get_seq_length(self):
        return self.n


def test_session_positions_follow_the_cache_and_sequence_ids():
    """Protects: positions = index in the padded sequence (cache length + arange, or cache_position); seq ids given."""
    m = _Tiny()
    cfg = FP4Config(num_layers=2, sites=frozenset())
    with Session(m, cfg, "qat", None, sequence_ids=[7, 9]):
        m(torch.zeros(2, 3, dtype=torch.long))
        m(torch.zeros(2, 1, dtype=torch.long), cache=_Len(3))
        m(torch.zeros(2, 1, dtype=torch.long), past_key_values=_Len(4))
        m(torch.zeros(2, 2, dtype=torch.long), cache_position=torch.tensor([5, 6]))
    seqs = [s.tolist() for s, _ in m.seen]
    pos = [p.tolist() for _, p in m.seen]
    assert seqs == [[7, 9]] * 4
    assert pos == [[[0, 1, 2]] * 2, [[3]] * 2, [[4]] * 2, [[5, 6]] * 2]
    assert current_session() is None
    with pytest.raises(ValueError, match="2 ids but the batch has 3"):
        with Session(m, cfg, "qat", None, sequence_ids=[0, 1]):
            m(torch.zeros(3, 1, dtype=torch.long))


def test_guided_training_needs_guidance():
    """Protects: guided mode without the rollout's cache is an error, not silent RTN."""
    with pytest.raises(GuidanceError, match="needs guidance"):
        with train(_Tiny(), FP4Config(num_layers=2), mode="guided"):
            pass
    with pytest.raises(ValueError, match="NVFP4"):
        with train(_Tiny(), FP4Config(num_layers=2, format="mxfp4"), mode="guided", guidance=_cache()):
            pass


def test_store_inputs_are_checked_when_added():
    """Protects SPEC 10 at the cache's entry: keys must be the 1-D int64 of encode_keys (int32 / float keys corrupt the
    (seq, pos) packing, 2-D keys used to pass and break save()), route rows must match their keys, CPU expert ids must
    fit the int16 store, and a file that is not safetensors is a GuidanceError."""
    c = _cache()
    keys = encode_keys(_keys([0, 0], [0, 1]))
    for bad in (keys.int(), keys.double(), keys.reshape(2, 1)):
        with pytest.raises(TypeError, match="1-D int64"):
            c.add_record("expert_in", 2, bad, _rec(2))
    with pytest.raises(ValueError, match="rows for 2 keys"):
        c.add_routes(2, keys, torch.tensor([[1, 2]]))
    for ids in ([[40000, 1], [0, 1]], [[-1, 1], [0, 1]]):
        with pytest.raises(ValueError, match="expert ids"):
            c.add_routes(2, keys, torch.tensor(ids))
    with pytest.raises(TypeError, match="integer"):
        c.add_routes(2, keys, torch.tensor([[1.0, 2.0], [0.0, 1.0]]))
    c.add_record("expert_in", 2, keys, _rec(2))
    c.add_routes(2, keys, torch.tensor([[1, 2], [0, 3]]))
    assert len(c.records[("expert_in", 2)]) == 2


def test_load_of_a_non_safetensors_file_is_a_guidance_error(tmp_path):
    p = tmp_path / "g.pt"
    p.write_bytes(b"garbage")
    with pytest.raises(GuidanceError, match="not a trace_ext guidance file"):
        GuidanceCache.load(str(p))


# ---- SPEC 10: argument validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,bad", [
    ("guidance_layers", [1.5]), ("guidance_layers", ["1"]), ("guidance_layers", [True]),
    ("sr_seed", 0.5), ("sr_seed", "5"), ("sr_seed", True),
    ("num_layers", 2.5), ("num_layers", True), ("num_layers", "3"),
    ("kv_g_k", "1.0"), ("kv_g_k", True), ("kv_g_v", "1.0"), ("kv_g_v", True),
    ("routing_replay", "no"), ("routing_replay", 1),
    ("guidance_budget_bytes_per_token", 1.5), ("guidance_budget_bytes_per_token", True),
    ("format", None), ("sites", 3), ("sites", {1}), ("qat_compute_dtype", "float32"),
])
def test_config_field_types_are_checked(field, bad):
    """Protects SPEC 10 for FP4Config: a value of the wrong type is a TypeError naming the field, never truncated
    (guidance_layers=[1.5] and sr_seed=0.5 used to become 1 and 0), parsed ("1", "3") or counted as 1 (True)."""
    with pytest.raises(TypeError, match=field):
        FP4Config(**{field: bad})


def test_config_float_fields_must_survive_float32():
    """Protects: kv_g_k / kv_g_v are checked as the float32 the kernels see (1e-50 underflows to 0, 1e39 overflows)."""
    for name in ("kv_g_k", "kv_g_v"):
        for bad in (1e-50, 1e39, float("nan"), -1.0):
            with pytest.raises(ValueError, match=name):
                FP4Config(**{name: bad})
    c = FP4Config(num_layers=4, guidance_layers=[2, 3], sr_seed=7, kv_g_k=2, routing_replay=False)
    assert c.guidance_layers == (2, 3) and c.sr_seed == 7 and c.kv_g_k == 2 and c.routing_replay is False


def test_add_record_checks_the_record_against_its_kind():
    """Protects SPEC 10 at add_record: a non-record is a TypeError (was AttributeError); payload / scales / g must have
    the record kind's dtypes (uint8, uint8, float32) and widths (K/8 compact or K/2 full, K/16, one g per row)."""
    c = _cache()
    keys = encode_keys(_keys([0, 0], [0, 1]))
    rec = _rec(2)
    with pytest.raises(TypeError, match="GuidanceRecord"):
        c.add_record("expert_in", 2, keys, "x")
    bad = {
        "payload int32": (TypeError, GuidanceRecord("compact", rec.payload.int(), rec.scales, rec.g)),
        "payload width": (ValueError, GuidanceRecord("compact", rec.payload[:, :4], rec.scales, rec.g)),
        "full width": (ValueError, GuidanceRecord("full", rec.payload, rec.scales, rec.g)),
        "scales float": (TypeError, GuidanceRecord("compact", rec.payload, rec.scales.float(), rec.g)),
        "scales 1-D": (ValueError, GuidanceRecord("compact", rec.payload, rec.scales[0], rec.g)),
        "g float64": (TypeError, GuidanceRecord("compact", rec.payload, rec.scales, rec.g.double())),
        "g rows": (ValueError, GuidanceRecord("compact", rec.payload, rec.scales, rec.g[:1])),
    }
    for what, (err, r) in bad.items():
        with pytest.raises(err, match=r"expert_in\[2\]"):
            c.add_record("expert_in", 2, keys, r)
    assert not c.records  # nothing was stored, and no empty store was left behind
    with pytest.raises(TypeError, match="layer"):
        c.add_record("expert_in", True, keys, rec)
    c.add_record("expert_in", 2, keys, rec)
    assert len(c.records[("expert_in", 2)]) == 2


def test_rejected_add_leaves_no_store_behind():
    """Protects: an add refused for its keys or top-k shape used to create the store first, so the next valid add
    failed with 'top-k differs' / 'K differs'; and a 0-d topk is a ValueError naming topk (was IndexError)."""
    c = _cache()
    keys = encode_keys(_keys([0, 0], [0, 1]))
    with pytest.raises(ValueError, match="topk must be"):
        c.add_routes(1, keys, torch.tensor(3))
    with pytest.raises(ValueError, match="topk must be"):
        c.add_routes(1, keys, torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="1-D int64"):
        c.add_routes(1, keys.int(), torch.tensor([[1, 2, 3], [0, 1, 2]]))
    with pytest.raises(TypeError, match="1-D int64"):
        c.add_record("expert_in", 2, keys.int(), _rec(2, K=32))
    assert not c.routes and not c.records
    c.add_routes(1, keys, torch.tensor([[1, 2], [0, 1]]))
    c.add_record("expert_in", 2, keys, _rec(2))
    assert c.routes[1].meta["k"] == 2 and c.records[("expert_in", 2)].meta["K"] == K


def test_lookup_keys_follow_the_add_rule():
    """Protects: get_record / get_routes take the same 1-D int64 keys as add (float or 2-D keys were accepted)."""
    c = _filled_cache()
    keys = encode_keys(_keys([0, 1], [0, 2]))
    for bad in (keys.double(), keys.reshape(1, 2), keys.int()):
        with pytest.raises(TypeError, match="1-D int64"):
            c.get_record("expert_in", 2, bad, K, "cpu")
        with pytest.raises(TypeError, match="1-D int64"):
            c.get_routes(2, bad, "cpu")
    assert c.get_record("expert_in", 2, keys, K, "cpu").rows == 2


def test_split_and_merge_arguments():
    """Protects: split(0) / split(-1) are ValueErrors (were RuntimeError from tensor_split), merge of a non-cache a
    TypeError (was AttributeError)."""
    c = _filled_cache()
    for n in (0, -1):
        with pytest.raises(ValueError, match="split"):
            c.split(n)
    for bad in (True, 1.5, "ab"):
        with pytest.raises(TypeError, match="split"):
            c.split(bad)
    with pytest.raises(TypeError, match=r"caches\[1\]"):
        GuidanceCache.merge([c, "x"])
    with pytest.raises(TypeError, match="list of GuidanceCache"):
        GuidanceCache.merge(c)
    assert [p.sequence_ids().tolist() for p in c.split(1)] == [[0, 1, 2, 3]]


def test_load_refuses_a_header_with_missing_or_odd_fields(tmp_path):
    """Protects: a header lacking config / stores / a store's meta was a KeyError, and layers="abc" became a frozenset
    of characters; all are GuidanceErrors naming the field."""
    from safetensors.torch import save_file

    c, header, tensors = _saved_cache_parts(tmp_path)

    def load(name, h):
        p = str(tmp_path / name)
        save_file(tensors, p, metadata={"trace_ext_guidance": json.dumps(h)})
        return GuidanceCache.load(p)

    without = lambda d, k: {n: v for n, v in d.items() if n != k}  # noqa: E731
    st0 = header["stores"][0]
    cases = {
        "config": without(header, "config"),
        "stores": without(header, "stores"),
        "meta": {**header, "stores": [without(st0, "meta")] + header["stores"][1:]},
        "'K'": {**header, "stores": [{**st0, "meta": {"kind": "compact"}}] + header["stores"][1:]},
        "layers": {**header, "layers": "abc"},
        "guidance_layers": {**header, "config": {**header["config"], "guidance_layers": "abc"}},
        "kv_g_k": {**header, "config": {**header["config"], "kv_g_k": "1.0"}},
    }
    for i, (what, h) in enumerate(cases.items()):
        with pytest.raises(GuidanceError, match=what):
            load(f"h{i}.st", h)
    with pytest.raises(GuidanceError, match="JSON object"):
        load("list.st", [])
    _same(load("ok.st", header), c)
    # a config field the writer did not know yet (an older file of the same format version) takes its default
    older = load("older.st", {**header, "config": without(header["config"], "offload_chunk_bytes")})
    assert older.config.offload_chunk_bytes == FP4Config().offload_chunk_bytes


def test_sessions_reject_a_dict_config_and_a_non_module_model():
    """Protects SPEC 10 for rollout / train: a dict config was an AttributeError inside the session, a string model
    too; both are TypeErrors naming the argument."""
    for ctx in (rollout, train):
        with pytest.raises(TypeError, match="config must be"):
            with ctx(_Tiny(), {"format": "nvfp4"}):
                pass
        with pytest.raises(TypeError, match="model must be"):
            with ctx("model", FP4Config(num_layers=2)):
                pass
    with pytest.raises(TypeError, match="capture_codes"):
        with train(_Tiny(), FP4Config(num_layers=2, sites=frozenset()), capture_codes="yes"):
            pass
