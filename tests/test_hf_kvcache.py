"""FP4 KV cache for generate and the FP4-KV attention function (SPEC 8, 5): CPU tests on the reference path.

Shapes: a small Qwen3-MoE built from a config (head_dim 32 and 64, 2 KV heads, GQA 2) and the KV shapes of
Qwen3-30B-A3B (4 KV heads x head_dim 128) for the storage tests.
"""
import warnings

import pytest
import torch

from trace_ext import formats as F
from trace_ext import reference as ref
from trace_ext.integrations import hf_kvcache as kv
from trace_ext.rl import FP4Config, rollout, train

warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: one thread is as fast, and immune to a busy 2-core runner (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(head_dim=32, layers=2, seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = "sdpa"
    return Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()


def _decode(model, ids, prefill, cache):
    """Prefill ``ids[:, :prefill]`` then one token at a time; logits of every position."""
    out = [model(ids[:, :prefill], past_key_values=cache, use_cache=True).logits]
    for s in range(prefill, ids.shape[1]):
        out.append(model(ids[:, s : s + 1], past_key_values=cache, use_cache=True).logits)
    return torch.cat(out, dim=1).float()


@pytest.mark.parametrize("H,D", [(2, 32), (4, 128)])
def test_layer_stores_spec8_codes_and_returns_their_dequantization(H, D):
    """Protects SPEC 8: per (token, kv head) NVFP4 codes with the static g, and attention reading exactly
    the dequantized cache, in prefill (8 tokens) and decode (one token) alike."""
    g_k, g_v = 0.5, 2.0
    layer = kv.FP4KVLayer(0, g_k, g_v, backend="reference", paged=False)
    torch.manual_seed(1)
    chunks = [torch.randn(2, H, 8, D) * 3, torch.randn(2, H, 1, D), torch.randn(2, H, 1, D) * 40]
    vchunks = [torch.randn_like(c) for c in chunks]
    for k, v in zip(chunks, vchunks):
        keys, values = layer.update(k.bfloat16(), v.bfloat16())
    K = torch.cat(chunks, 2).bfloat16()
    V = torch.cat(vchunks, 2).bfloat16()
    qk = ref.nvfp4_quantize(K, torch.tensor(g_k))
    qv = ref.nvfp4_quantize(V, torch.tensor(g_v))
    codes, scales, g = layer.codes("k")
    assert torch.equal(codes, qk.codes) and torch.equal(scales, qk.scales) and g == g_k
    assert torch.equal(layer.codes("v")[0], qv.codes) and torch.equal(layer.codes("v")[1], qv.scales)
    assert torch.equal(keys, ref.nvfp4_dequantize(qk, torch.bfloat16))
    assert torch.equal(values, ref.nvfp4_dequantize(qv, torch.bfloat16))
    assert layer.get_seq_length() == 10
    assert layer.nbytes() == 2 * 2 * H * 10 * (D // 2 + D // 16)


def test_paged_store_matches_dense_store():
    """Protects the GPU layout path (PagedFP4KVCache + fp4kv_append / gather / decode attention, run here on
    the reference backend): same codes as the dense store, growth past the first pages, decode output close to
    SDPA over the dequantized cache."""
    torch.manual_seed(2)
    dense = kv.FP4KVLayer(0, 1.0, 1.0, backend="reference", paged=False)
    paged = kv.FP4KVLayer(0, 1.0, 1.0, backend="reference", paged=True)
    B, H, D = 2, 2, 64
    steps = [20] + [1] * 14  # 34 tokens: three 16-token pages, two re-layouts
    for n in steps:
        k = torch.randn(B, H, n, D).bfloat16()
        v = torch.randn(B, H, n, D).bfloat16()
        dk, dv = dense.update(k, v)
        pk, pv = paged.update(k, v)
    for w in ("k", "v"):
        assert torch.equal(dense.codes(w)[0], paged.codes(w)[0])
        assert torch.equal(dense.codes(w)[1], paged.codes(w)[1])
    gk, gv = paged.store.gather(torch.bfloat16)
    assert torch.equal(gk, dk) and torch.equal(gv, dv)
    q = torch.randn(B, 4, 1, D).bfloat16()
    out = paged.store.decode(q, None)  # [B, 1, Hq, D]
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), dk.float(), dv.float(), enable_gqa=True)
    assert out.shape == (B, 1, 4, D)
    assert (out.float() - want.transpose(1, 2)).abs().max() < 2e-2


def test_install_registers_attention_and_uninstall_restores():
    """Protects install_fp4_kv / uninstall_fp4_kv (used by hf_moe.convert): the model's attention goes through
    trace_fp4_sdpa and back to its previous implementation; a bad head_dim is refused."""
    model = _model()
    kv.install_fp4_kv(model, FP4Config())
    assert model.config._attn_implementation == kv.ATTN_NAME and kv.is_installed(model)
    kv.uninstall_fp4_kv(model)
    assert model.config._attn_implementation == "sdpa" and not kv.is_installed(model)
    with pytest.raises(ValueError, match="head_dim"):
        kv.install_fp4_kv(_model(head_dim=24), FP4Config())
    with pytest.raises(TypeError, match="FP4Config"):
        kv.install_fp4_kv(model, {"kv_g_k": 1.0})
    # a cache built directly: its g must be usable decode scales, its layer count and backend real ones
    for bad in (dict(g_k=0.0), dict(g_v=float("nan")), dict(num_layers=0), dict(backend="gpu")):
        with pytest.raises(ValueError, match="FP4KVCache"):
            kv.FP4KVCache(**{"num_layers": 2, **bad})


@torch.no_grad()
def test_no_session_is_plain_sdpa_and_fp4_cache_quantizes():
    """Protects the contract outside sessions: with trace_fp4_sdpa installed the model computes exactly what
    sdpa computes; the FP4 cache changes the logits (its K/V are FP4) but stays close."""
    model = _model()
    ids = torch.randint(0, 64, (2, 12))
    base = model(ids).logits
    kv.install_fp4_kv(model, FP4Config())
    assert torch.equal(model(ids).logits, base)
    fp4 = _decode(model, ids, 6, kv.FP4KVCache(model))
    assert not torch.equal(fp4, base.float())
    assert (fp4 - base.float()).abs().max() < 0.5


@torch.no_grad()
def test_rollout_records_the_cache_codes_and_qat_trainer_reproduces_them():
    """Protects the TRACE KV path: the rollout records the cache's own codes (keys (seq, pos, kv_head), prefill
    and decode rows), and a full-sequence qat trainer forward over the same tokens lands on the same codes
    (its K/V are fake-quantized with the same static g)."""
    model = _model()
    cfg = FP4Config(routing_replay=False, guidance_layers=None, guidance_kind="full", kv_g_k=0.25, kv_g_v=1.0)
    kv.install_fp4_kv(model, cfg)
    ids = torch.randint(0, 64, (3, 11))
    with rollout(model, cfg, sequence_ids=[7, 8, 9], capture_codes=True) as rec:
        cache = kv.FP4KVCache(model)
        _decode(model, ids, 5, cache)
    for layer in range(2):
        st = rec.cache.records[("kv_k", layer)]
        assert len(st) == 3 * 11 * 2  # every (seq, pos, kv_head) row, prefill and decode
        codes = cache.layers[layer].codes("k")[0]  # [B, H, S, D/2]
        # store keys are sorted (seq, pos, head): the same order as [B, S, H]
        assert torch.equal(st.columns["payload"], codes.transpose(1, 2).reshape(-1, codes.shape[-1]))
        assert torch.all(st.columns["g"] == 0.25)
    with train(model, cfg, mode="qat", sequence_ids=[7, 8, 9], capture_codes=True) as sess:
        model(ids)
    agree = []
    for key, st in rec.codes.records.items():
        a, b = st.columns["payload"], sess.codes.records[key].columns["payload"]
        assert a.shape == b.shape
        agree.append((a == b).float().mean().item())
    assert min(agree) > 0.999


def test_cache_refuses_head_dim_off_the_block():
    """Protects SPEC 10 for the cache: head_dim not a multiple of 16 is a ValueError naming it."""
    layer = kv.FP4KVLayer(0, paged=False)
    with pytest.raises(ValueError, match="head_dim"):
        layer.update(torch.zeros(1, 1, 1, 24, dtype=torch.bfloat16), torch.zeros(1, 1, 1, 24, dtype=torch.bfloat16))


@pytest.mark.parametrize("kind", ["compact", "full"])
def test_guided_trainer_lands_on_the_cache_codes(kind):
    """Protects guided KV rounding through the HF model: the trainer's K/V differ slightly from the rollout's
    (k_proj / v_proj weights nudged by 0.2%), RTN then disagrees with the cache's codes on many elements, while
    guided rounding with the rollout's records (compact or full) reproduces >= 99.9% of them."""
    from trace_ext.integrations.hf_moe import convert

    model = _model(head_dim=64)
    cfg = FP4Config(guidance_layers=None, guidance_kind=kind)
    convert(model, cfg)
    ids = torch.randint(0, 64, (4, 12))
    with torch.no_grad():
        with rollout(model, sequence_ids=[0, 1, 2, 3], capture_codes=True) as rec:
            _decode(model, ids, 6, kv.FP4KVCache(model))
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(1.002)
            layer.self_attn.v_proj.weight.mul_(0.998)
        agreement = {}
        for mode in ("qat", "guided"):
            with train(model, mode=mode, guidance=rec.cache, sequence_ids=[0, 1, 2, 3], capture_codes=True) as sess:
                model(ids[:, :-1])  # the rollout never processed the last token
            agree = []
            for (site, layer), st in sess.codes.records.items():
                if site not in kv.KV_SITES:
                    continue
                ro = rec.codes.records[(site, layer)]
                idx, found = ro.find(st.keys)
                assert bool(found.all())
                mine, theirs = F.unpack_nibbles(st.columns["payload"]), F.unpack_nibbles(ro.columns["payload"][idx])
                agree.append((mine == theirs).float().mean().item())
            agreement[mode] = min(agree)
    assert agreement["guided"] >= 0.999
    assert agreement["qat"] < 0.99


def _kv(B=1, H=2, S=3, D=32, dtype=torch.bfloat16):
    return torch.randn(B, H, S, D).to(dtype)


def test_cache_update_refuses_misaligned_or_changing_kv():
    """Protects SPEC 10 for FP4KVCache.update: k and v of different lengths used to be stored misaligned (keys 3
    long, values 2), a float32 step into a bf16 cache promoted it silently, a batch / heads / head_dim mismatch was a
    raw torch.cat RuntimeError and a 3-D k 'not enough values to unpack': each is now a TypeError / ValueError
    naming k or v and the expected shape, and a refused update leaves the cache as it was."""
    def cache():
        c = kv.FP4KVCache(num_layers=1)
        c.update(_kv(), _kv(), 0)
        return c

    with pytest.raises(ValueError, match=r"v must be \[B, H_v, S, D_v\] with the B=1 and S=3"):
        kv.FP4KVCache(num_layers=1).update(_kv(S=3), _kv(S=2), 0)
    with pytest.raises(ValueError, match="B=1"):
        kv.FP4KVCache(num_layers=1).update(_kv(B=1), _kv(B=2), 0)
    with pytest.raises(ValueError, match=r"k must be \[B, H, S, D\]"):
        kv.FP4KVCache(num_layers=1).update(_kv()[0], _kv()[0], 0)
    with pytest.raises(TypeError, match="floating"):
        kv.FP4KVCache(num_layers=1).update(_kv().long(), _kv().long(), 0)
    with pytest.raises(TypeError, match="share one dtype"):
        kv.FP4KVCache(num_layers=1).update(_kv(), _kv(dtype=torch.float32), 0)
    c = cache()
    with pytest.raises(TypeError, match=r"cache holds torch.bfloat16"):
        c.update(_kv(S=1, dtype=torch.float32), _kv(S=1, dtype=torch.float32), 0)
    with pytest.raises(ValueError, match=r"k must be \[1, 2, S, 32\]"):
        c.update(_kv(S=1, H=4), _kv(S=1, H=4), 0)
    with pytest.raises(ValueError, match=r"v must be \[1, 2, S, 32\]"):
        c.update(_kv(S=1), _kv(S=1, D=64), 0)
    with pytest.raises(ValueError, match=r"k must be \[1, 2, S, 32\]"):
        c.update(_kv(S=1, B=2), _kv(S=1, B=2), 0)
    with pytest.raises(ValueError, match="layer_idx"):
        c.update(_kv(S=1), _kv(S=1), 1)
    assert c.get_seq_length() == 3 and c.layers[0].keys.shape == c.layers[0].values.shape == (1, 2, 3, 32)
    keys, values = c.update(_kv(S=1), _kv(S=1), 0)
    assert keys.shape == values.shape == (1, 2, 4, 32)
    # V may have its own head_dim (DeepSeek's MLA): fixed per cache like K's
    c = kv.FP4KVCache(num_layers=1)
    c.update(_kv(), _kv(D=16), 0)
    assert c.update(_kv(S=1), _kv(S=1, D=16), 0)[1].shape == (1, 2, 4, 16)
    # a first update refused for its head_dim leaves the layer uninitialized, ready for a good one
    c = kv.FP4KVCache(num_layers=1)
    with pytest.raises(ValueError, match="head_dim"):
        c.update(_kv(D=24), _kv(D=24), 0)
    assert c.update(_kv(), _kv(), 0)[0].shape == (1, 2, 3, 32)


def test_cache_constructor_argument_types():
    """Protects: a non-model first argument (a string, an FP4Config) was an AttributeError, g_k="a" a ValueError from
    float() and g_k="2.0" / True were accepted: all TypeErrors, as PagedFP4KVCache's g check."""
    for bad in ("x", FP4Config()):
        with pytest.raises(TypeError, match="model must be"):
            kv.FP4KVCache(bad)
    for name in ("g_k", "g_v"):
        for bad in ("a", "2.0", True):
            with pytest.raises(TypeError, match=f"FP4KVCache: {name}"):
                kv.FP4KVCache(num_layers=1, **{name: bad})
    with pytest.raises(TypeError, match="num_layers"):
        kv.FP4KVCache(num_layers=2.0)
    with pytest.raises(TypeError, match="paged"):
        kv.FP4KVCache(num_layers=1, paged="no")
    assert kv.FP4KVCache(num_layers=1, g_k=torch.tensor(0.5), g_v=2).layers[0].codes("v")[2] == 2.0
