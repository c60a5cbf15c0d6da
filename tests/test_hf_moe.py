"""Hugging Face MoE integration: convert / unconvert / verify on tiny models of every supported family (built from
configs, all dims multiples of 32), each mode's numerics against a hand-computed reference, guidance capture and
replay, routing replay (R3), the 4.x nn.Linear path, and the errors for misuse."""
import pytest
import torch
import transformers as tf

from trace_ext import reference as ref
from trace_ext import reference_gemm as RG
from trace_ext.integrations import hf_moe
from trace_ext.nn import FP4Linear, expert_weights
from trace_ext.rl import FP4Config, GuidanceCache, GuidanceError, rollout, train
from trace_ext.rl.metrics import router_flip_rate, site_agreement
from trace_ext.rl.routing import replay_weights
from trace_ext.rl.session import Session

BF16 = torch.bfloat16
_COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
FAMILIES = {
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM,
                  dict(intermediate_size=128, moe_intermediate_size=32, head_dim=32, num_experts=8, num_experts_per_tok=2,
                       norm_topk_prob=True)),
    "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM,
                  dict(intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
                       num_experts_per_tok=2)),
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM,
                dict(intermediate_size=32, head_dim=32, num_local_experts=8, num_experts_per_tok=2)),
    "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM,
              dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, eos_token_id=1, pad_token_id=0)),
    "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM,
                    dict(num_hidden_layers=3, num_key_value_heads=2, intermediate_size=128, moe_intermediate_size=32,
                         n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                         n_shared_experts=1, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=32, qk_nope_head_dim=32,
                         v_head_dim=32)),
    "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM,
                dict(intermediate_size=32, head_dim=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=8)),
}
ALL_LINEAR_SITES = frozenset({"experts", "attn_proj", "shared_experts", "dense_mlp"})
EXPERTS = frozenset({"experts"})


def tiny(family="qwen3_moe", seed=0, **overrides):
    cfg_cls, model_cls, kw = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**_COMMON, **kw, **overrides})).to(BF16).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def ids(B=2, S=6, seed=1):
    return torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(seed))


def logits(model, x, **kw):
    with torch.no_grad():
        return model(x, **kw).logits


def moe_layers(model):
    return [m for m in model.modules() if hf_moe.is_fused_experts(m)]


# ---- convert / unconvert / verify ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_convert_verify_unconvert(family):
    """Protects: every family converts (experts, routers, Linear sites), bf16 mode is the untouched model, rollout
    is FP4 (different but close), parameters are shared, and unconvert restores the original forward exactly."""
    model = tiny(family)
    x = ids()
    want = logits(model, x)
    state = {k: v for k, v in model.state_dict().items()}
    hf_moe.convert(model, FP4Config(sites=ALL_LINEAR_SITES))
    counts = hf_moe.verify(model)
    n_moe = len(moe_layers(model))
    assert counts["fused_experts"] == n_moe == counts["routers"] and n_moe >= 2
    assert counts["fp4_linears"] > 0
    assert set(model.state_dict()) == set(state)
    assert all(model.state_dict()[k].data_ptr() == v.data_ptr() for k, v in state.items())
    assert torch.equal(logits(model, x), want)  # no session: bf16
    with train(model, mode="bf16"):
        assert torch.equal(logits(model, x), want)
    with rollout(model):
        got = logits(model, x)
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert 1e-3 < rel < 0.3
    hf_moe.unconvert(model)
    assert not any(isinstance(m, FP4Linear) for m in model.modules())
    assert torch.equal(logits(model, x), want)
    with pytest.raises(ValueError, match="not converted"):
        hf_moe.verify(model)


def test_linear_sites_are_found_by_role():
    """Protects: attention projections, shared experts and dense MLPs become FP4Linear with their group, and the
    router / lm_head / embeddings stay bf16."""
    model = hf_moe.convert(tiny("deepseek_v3"), FP4Config(sites=ALL_LINEAR_SITES))
    groups = {m.site for m in model.modules() if isinstance(m, FP4Linear)}
    assert {"dense_mlp.gate_proj", "shared_experts.down_proj", "attn_proj.q_a_proj", "attn_proj.o_proj"} <= groups
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, FP4Linear)
    assert type(model.model.layers[1].mlp.gate).__name__ == "DeepseekV3TopkRouter"
    only_experts = hf_moe.convert(tiny("qwen2_moe"), FP4Config(sites=EXPERTS))
    assert not any(isinstance(m, FP4Linear) for m in only_experts.modules())


def test_verify_names_a_missed_expert():
    """Protects: the verifier raises when a targeted expert module was not converted."""
    model = hf_moe.convert(tiny(), FP4Config(sites=EXPERTS))
    missed = model.model.layers[1].mlp.experts
    del missed.forward
    with pytest.raises(RuntimeError, match=r"layers\.1\.mlp\.experts"):
        hf_moe.verify(model)


def test_kv_site_installs_the_fp4_kv_attention():
    """Protects: the default config (experts + KV) hands attention to the FP4 KV integration and unconvert undoes it."""
    from trace_ext.integrations import hf_kvcache

    model = hf_moe.convert(tiny(), FP4Config())
    assert hf_kvcache.is_installed(model)
    assert {"kv_k", "kv_v"} <= {s.site for s in model._trace_fp4_layout}
    hf_moe.unconvert(model)
    assert not hf_kvcache.is_installed(model)


# ---- numerics of each mode against a hand-computed reference -------------------------------------------------------


def _route(T, E, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=g), -1)
    return idx, w


def _fp4_w(w, fmt):
    return ref.nvfp4_quantize(w.float(), scope="tensor") if fmt == "nvfp4" else ref.mxfp4_quantize(w.float())


def _spec7(a_row, w, fmt, act):
    """SPEC 7 for one token row and one expert matrix, written out with the references."""
    if fmt == "nvfp4":
        qw = _fp4_w(w, fmt)
        if act == "w4a4":
            qa = ref.nvfp4_quantize(a_row)
            return RG.fp4_linear(qa.codes, qw.codes, qw.scales, qw.g[0], a_scales=qa.scales, g_a=qa.g)
        return RG.fp4_linear(a_row, qw.codes, qw.scales, qw.g[0])
    a64 = ref.mxfp4_dequantize(ref.mxfp4_quantize(a_row.float())).double() if act == "w4a4" else a_row.double()
    w64 = ref.mxfp4_dequantize(_fp4_w(w, fmt)).double()
    return RG.round_to_bf16(a64 @ w64.T)


def _qat_linear(a_row, w, fmt, act):
    fq = (lambda t, **kw: ref.nvfp4_dequantize(ref.nvfp4_quantize(t.float(), **kw))) if fmt == "nvfp4" else (
        lambda t, **kw: ref.mxfp4_dequantize(ref.mxfp4_quantize(t.float())))
    a = fq(a_row) if act == "w4a4" else a_row.float()
    wq = fq(w, scope="tensor") if fmt == "nvfp4" else fq(w)
    return (a @ wq.T).to(BF16)


def _hand_experts(module, x, idx, w, fmt, act, mode):
    """Token by token, slot by slot: gate_up GEMM (+bias), activation, down GEMM (+bias), weighted fp32 sum."""
    w_gu, w_dn = expert_weights(module)
    spec = module._trace_fp4
    lin = _spec7 if mode == "rollout" else _qat_linear
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h1 = lin(x[t:t + 1], w_gu[e], fmt, act)
            if spec.has_bias:
                h1 = h1 + module.gate_up_proj_bias[e]
            h = module._apply_gate(h1).to(BF16)
            h2 = lin(h, w_dn[e], fmt, act)
            if spec.has_bias:
                h2 = h2 + module.down_proj_bias[e]
            out[t] += h2[0].float() * w[t, j].float()
    return out.to(BF16)


@pytest.mark.parametrize("family,fmt,act", [
    ("qwen3_moe", "nvfp4", "w4a4"), ("qwen3_moe", "nvfp4", "w4a16"), ("qwen3_moe", "mxfp4", "w4a4"), ("gpt_oss", "nvfp4", "w4a4"),
])
@pytest.mark.parametrize("mode", ["rollout", "qat"])
def test_expert_numerics_match_hand_reference(family, fmt, act, mode):
    """Protects: rollout = SPEC 7 (FP4 weights per expert matrix, per-row FP4 activations, fp32-accumulated q*s
    products times g_a*g_w, bf16 out) and qat = fake-quant weights and activations with fp32 matmuls; incl. the
    gpt-oss layout (transposed, interleaved gate/up, biases, clamped activation)."""
    cfg = FP4Config(format=fmt, activation=act, sites=EXPERTS)
    model = hf_moe.convert(tiny(family), cfg)
    module = moe_layers(model)[1]
    T, H = 7, module._trace_fp4.hidden_size
    x = (torch.randn(T, H, generator=torch.Generator().manual_seed(3)) * 2).to(BF16)
    idx, w = _route(T, module._trace_fp4.num_experts, 2)
    with torch.no_grad():
        with Session(model, model._trace_fp4_config, mode, None, role="rollout" if mode == "rollout" else "train"):
            got = module(x, idx, w)
        plain = module(x, idx, w)
        want = _hand_experts(module, x, idx, w, fmt, act, mode)
    if mode == "rollout":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-5)
    assert (got.float() - plain.float()).abs().max() > 10 * (got.float() - want.float()).abs().max()


def test_converted_experts_check_the_router_output():
    """Protects SPEC 10 at the converted experts forward: expert ids outside [0, E) were a scatter RuntimeError deep
    inside (a device-side assert on CUDA), float ids and mismatched weights went through; now ValueError / TypeError."""
    model = hf_moe.convert(tiny(), FP4Config(sites=EXPERTS))
    module = moe_layers(model)[1]
    T, E = 5, module._trace_fp4.num_experts
    x = torch.randn(T, module._trace_fp4.hidden_size).to(BF16)
    idx, w = _route(T, E, 2)
    bad = idx.clone()
    bad[2, 1] = E
    with torch.no_grad(), Session(model, model._trace_fp4_config, "rollout", None, role="rollout"):
        with pytest.raises(ValueError, match="top_k_index"):
            module(x, bad, w)
        with pytest.raises(TypeError, match="top_k_index"):
            module(x, idx.float(), w)
        with pytest.raises(ValueError, match="top_k_weights"):
            module(x, idx, w[:, :1])
        assert module(x, idx, w).shape == x.shape


def test_rollout_packs_weights_once_and_repacks_after_an_update():
    """Protects: rollout weights are quantized once per weight version (load / weight sync), not every forward."""
    model = hf_moe.convert(tiny(), FP4Config(sites=EXPERTS))
    experts = moe_layers(model)[0]
    with rollout(model):
        logits(model, ids())
        first = experts._trace_fp4_packed
        logits(model, ids(seed=2))
        assert experts._trace_fp4_packed is first
        with torch.no_grad():
            experts.down_proj.mul_(2.0)  # an optimizer step / weight sync
        logits(model, ids())
        assert experts._trace_fp4_packed is not first


def test_qat_backward_is_straight_through():
    """Protects: in qat mode expert weights, routers and inputs get gradients (STE), none of them NaN."""
    model = hf_moe.convert(tiny(), FP4Config(sites=EXPERTS))
    model.train()
    with train(model, mode="qat"):
        loss = model(ids()).logits.float().square().mean()
    loss.backward()
    experts = moe_layers(model)[1]
    router = model.model.layers[1].mlp.gate
    for p in (experts.gate_up_proj, experts.down_proj, router.weight, model.model.embed_tokens.weight):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


# ---- guidance capture / replay ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["compact", "full"])
def test_guided_replay_of_identical_input_agrees_everywhere(kind):
    """Protects: the TRACE core end to end: rollout capture, then guided replay of the same tokens reproduces every
    code and scale byte of the guided sites (SPEC 5: 100%), on every layer and both expert sites."""
    model = hf_moe.convert(tiny(), FP4Config(sites=EXPERTS, guidance_layers=None, guidance_kind=kind))
    x = ids()
    with rollout(model, capture_codes=True) as rec:
        logits(model, x)
    assert {s for s, _ in rec.cache.records} == {"expert_in", "expert_down_in"}
    with train(model, mode="guided", guidance=rec.cache, capture_codes=True) as sess:
        logits(model, x)
    agree = site_agreement(rec.codes, sess.codes)
    # layer 0 sees bit-identical inputs (bf16 attention): every code and scale byte must match
    for site in ("expert_in@0", "expert_down_in@0"):
        assert agree[site]["code_agreement"] == 1.0 and agree[site]["scale_agreement"] == 1.0
    # deeper layers see the trainer's own (fp32-accumulated) expert outputs: nearly identical, and the scales are
    # the rollout's by construction
    for site in ("expert_in@1", "expert_down_in@1"):
        assert agree[site]["code_agreement"] >= 0.99 and agree[site]["scale_agreement"] == 1.0
    assert agree["expert_down_in@1"]["rows"] == x.numel() * 2  # every (token, top-k slot)


def _perturb_attention(model, eps=2e-2, seed=5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.self_attn.o_proj.weight
            w.add_(torch.randn(w.shape, generator=g).to(w.dtype) * eps * w.abs().mean())


def test_guided_replay_of_perturbed_input_beats_rtn():
    """Protects: when the trainer's activations differ slightly (other kernels), guided rounding agrees with the
    rollout's codes at least as often as RTN, and always reuses its block scales."""
    model = hf_moe.convert(tiny(), FP4Config(sites=EXPERTS, guidance_layers=None))
    x = ids(B=4, S=8)
    with rollout(model, capture_codes=True) as rec:
        logits(model, x)
    _perturb_attention(model)
    with train(model, mode="qat", guidance=rec.cache, capture_codes=True) as rtn:  # routes replayed in both arms
        logits(model, x)
    with train(model, mode="guided", guidance=rec.cache, capture_codes=True) as gd:
        logits(model, x)
    a_rtn, a_gd = site_agreement(rec.codes, rtn.codes), site_agreement(rec.codes, gd.codes)
    assert min(a_rtn[s]["code_agreement"] for s in ("expert_in", "expert_down_in")) < 1.0
    for s in ("expert_in", "expert_down_in"):
        assert a_gd[s]["code_agreement"] >= a_rtn[s]["code_agreement"]
        assert a_gd[s]["scale_agreement"] == 1.0


def test_policy_excluded_layers_use_the_fallback_rounding():
    """Protects: layers outside the policy keep no guidance and are rounded RTN (or SR when configured)."""
    model = hf_moe.convert(tiny(), FP4Config(sites=EXPERTS, guidance_layers=[1]))
    x = ids()
    with rollout(model) as rec:
        logits(model, x)
    assert {l for _, l in rec.cache.records} == {1}
    with train(model, mode="qat", capture_codes=True) as q:
        logits(model, x)
    with train(model, mode="guided", guidance=rec.cache, capture_codes=True) as g:
        logits(model, x)
    codes = lambda s: s.codes.records[("expert_in", 0)].columns["payload"]  # noqa: E731
    assert torch.equal(codes(g), codes(q))
    sr = model._trace_fp4_config.with_(fallback_rounding="sr")
    with train(model, sr, mode="guided", guidance=rec.cache, capture_codes=True) as s:
        logits(model, x)
    assert not torch.equal(codes(s), codes(q))


def test_byte_budget_policy_and_bytes_per_token():
    """Protects: a per-token byte budget picks the deepest layers that fit, and the cache reports SPEC 6 sizes."""
    per_layer = (64 // 8 + 64 // 16 + 4) + 2 * (32 // 8 + 32 // 16 + 4)  # expert_in + 2 down rows: 36 bytes
    model = hf_moe.convert(tiny(), FP4Config(sites=EXPERTS, guidance_budget_bytes_per_token=per_layer + 10))
    with rollout(model) as rec:
        logits(model, ids())
    assert {l for _, l in rec.cache.records} == {1}
    assert rec.bytes_per_token() == pytest.approx(per_layer)


def test_generate_rollout_then_trainer_forward():
    """Protects: capture through model.generate (prefill and decode rows, positions from the cache) covers every
    position the trainer sees in seqs[:, :-1]; the last sampled token was never processed, so feeding it is an error."""
    model = hf_moe.convert(tiny(), FP4Config(sites=EXPERTS))
    prompt = ids(B=2, S=4)
    with rollout(model) as rec:
        with torch.no_grad():
            seqs = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                                  pad_token_id=0)
    L = seqs.shape[1]
    assert rec.cache.sequence_lengths() == {0: L - 1, 1: L - 1}
    with train(model, mode="guided", guidance=rec.cache) as sess:
        logits(model, seqs[:, :-1])
    assert sess.forward_calls == 1
    with pytest.raises(GuidanceError, match=f"first missing key \\(seq=0, pos={L - 1}"):
        with train(model, mode="guided", guidance=rec.cache):
            logits(model, seqs)


def test_split_micro_batches_and_save_load_give_the_same_trainer_output(tmp_path):
    """Protects: a cache split by sequence for data-parallel micro-batches, or saved and loaded, guides exactly as
    the whole cache does."""
    model = hf_moe.convert(tiny(), FP4Config(sites=EXPERTS))
    x = ids(B=4, S=5)
    with rollout(model) as rec:
        logits(model, x)
    with train(model, mode="guided", guidance=rec.cache):
        whole = logits(model, x)
    a, b = rec.cache.split([[0, 1], [2, 3]])
    with train(model, mode="guided", guidance=b, sequence_ids=[2, 3]):
        part = logits(model, x[2:])
    assert torch.equal(part, whole[2:])
    path = str(tmp_path / "rollout.safetensors")
    rec.save(path)
    with train(model, mode="guided", guidance=GuidanceCache.load(path)):
        assert torch.equal(logits(model, x), whole)


# ---- routing replay (R3) ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_replayed_weights_equal_the_routers_own(family):
    """Protects: replaying the router's own choice recomputes exactly its top-k weights (each router kind's rule)."""
    model = hf_moe.convert(tiny(family), FP4Config(sites=EXPERTS))
    x = ids()
    with rollout(model, mode="bf16") as rec:
        logits(model, x)
    with train(model, mode="bf16"):
        free = logits(model, x)
    with train(model, mode="bf16", guidance=rec.cache):
        replayed = logits(model, x)
    assert torch.equal(free, replayed)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_routing_replay_reproduces_rollout_topk_and_router_gets_gradients(family):
    """Protects: with a drifted router the trainer still uses the rollout's top-k per (token, layer), with weights
    recomputed from the current logits, so the router receives gradients."""
    model = hf_moe.convert(tiny(family), FP4Config(sites=EXPERTS))
    x = ids(B=2, S=8)
    with rollout(model) as rec:
        logits(model, x)
    routers = [m for m in model.modules() if hf_moe.is_router(m)]
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for r in routers:
            r.weight.add_(torch.randn(r.weight.shape, generator=g).to(r.weight.dtype) * 0.5)
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[1].clone()))
             for i, m in enumerate(moe_layers(model))]
    model.train()
    with train(model, mode="qat", guidance=rec.cache, capture_codes=True) as sess:
        loss = model(x).logits.float().square().mean()
    for h in hooks:
        h.remove()
    assert router_flip_rate(rec.cache, sess.codes) > 0  # the routers alone would now choose differently
    for i, layer in enumerate(sorted(rec.cache.routes)):
        store = rec.cache.routes[layer]
        assert torch.equal(seen[i], store.columns["topk"].long().reshape(seen[i].shape))
    loss.backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers)


def test_replay_weights_are_differentiable_per_rule():
    """Protects: the weights of replayed experts follow each router's rule (softmax-renorm, sigmoid-scaled, top-k
    softmax) and carry gradients to the logits."""
    logit = torch.randn(3, 8, requires_grad=True)
    idx = torch.tensor([[0, 1], [2, 3], [7, 4]])
    model = tiny("deepseek_v3")
    ds = model.model.layers[1].mlp.gate
    w = replay_weights(ds, logit, idx, torch.float32)
    s = logit.sigmoid().gather(1, idx)
    torch.testing.assert_close(w, s / (s.sum(-1, keepdim=True) + 1e-20) * ds.routed_scaling_factor)
    w.sum().backward()
    assert logit.grad.abs().sum() > 0



def test_replay_weights_arguments_are_checked():
    """Protects SPEC 10 for replay_weights: fewer idx rows than logits rows returned a [1, k] result, an integer dtype
    returned zeros, and out-of-range ids were a raw gather error (checked on CPU; on CUDA router_hook checks the
    recorded ids once, so replay_weights adds no host sync)."""
    router = tiny().model.layers[0].mlp.gate
    logit = torch.randn(3, 8)
    idx = torch.tensor([[0, 1], [2, 3], [7, 4]])
    with pytest.raises(ValueError, match="idx must be"):
        replay_weights(router, logit, idx[:1], torch.float32)
    with pytest.raises(ValueError, match="idx must be"):
        replay_weights(router, logit, idx[:, 0], torch.float32)
    with pytest.raises(ValueError, match="logits must be"):
        replay_weights(router, logit[None], idx, torch.float32)
    for dt in (torch.int32, torch.bool, "float32"):
        with pytest.raises(TypeError, match="dtype"):
            replay_weights(router, logit, idx, dt)
    for bad in (torch.tensor([[0, 8], [2, 3], [7, 4]]), torch.tensor([[0, -1], [2, 3], [7, 4]])):
        with pytest.raises(ValueError, match=r"expert ids in idx must be in \[0, 8\)"):
            replay_weights(router, logit, bad, torch.float32)
    with pytest.raises(TypeError, match="idx must be an integer"):
        replay_weights(router, logit, idx.float(), torch.float32)
    with pytest.raises(TypeError, match="logits"):
        replay_weights(router, logit.long(), idx, torch.float32)
    with pytest.raises(TypeError, match="router"):
        replay_weights("gate", logit, idx, torch.float32)
    # int32 ids are widened (lossless), not refused
    torch.testing.assert_close(replay_weights(router, logit, idx.int(), torch.float32),
                               replay_weights(router, logit, idx, torch.float32))


# ---- misuse and bad inputs -------------------------------------------------------------------------------------------


def test_unsupported_model_type():
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="unsupported model type 'llama'"):
        hf_moe.convert(tf.LlamaForCausalLM(cfg), FP4Config(sites=EXPERTS))


def test_convert_and_sessions_reject_wrong_argument_types():
    """Protects SPEC 10: a non-HF module or a dict config is a TypeError (was an AttributeError from inside convert),
    and float sequence ids are refused (as_tensor(..., int64) truncated 0.5 to 0 silently)."""
    with pytest.raises(TypeError, match="Hugging Face model"):
        hf_moe.convert(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="FP4Config"):
        hf_moe.convert(tiny(), {"format": "nvfp4"})
    model = hf_moe.convert(tiny(), FP4Config(sites=EXPERTS))
    with pytest.raises(TypeError, match="sequence_ids must be integers"):
        with rollout(model, sequence_ids=torch.tensor([0.5, 1.0])):
            pass
    with pytest.raises(TypeError, match="sequence_ids must be integers"):
        with rollout(model, sequence_ids=[0.5, 1.5]):
            pass
    with pytest.raises(TypeError, match="nn.Linear"):
        FP4Linear(torch.nn.Conv1d(2, 2, 1), "attn_proj.q_proj", 0, "attn_proj")
    with pytest.raises(ValueError, match="block must be 16"):
        FP4Linear(torch.nn.Linear(48, 8), "attn_proj.q_proj", 0, "attn_proj", block=24)
    with rollout(model, sequence_ids=torch.tensor([3, 4], dtype=torch.int32)) as rec:
        logits(model, ids())
    assert rec.cache.sequence_ids().tolist() == [3, 4]


def test_unknown_router_is_refused_unless_routing_replay_is_off():
    """Protects: a MoE whose router we cannot replay is an error, not a model silently trained without R3."""

    class MyGate(torch.nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = weight

        def forward(self, h):
            logits = torch.nn.functional.linear(h, self.weight)
            w, idx = torch.topk(torch.softmax(logits.float(), -1), 2, -1)
            return logits, w.to(h.dtype), idx

    model = tiny()
    model.model.layers[1].mlp.gate = MyGate(model.model.layers[1].mlp.gate.weight)
    with pytest.raises(ValueError, match=r"no known top-k router next to model\.layers\.1\.mlp\.experts"):
        hf_moe.convert(model, FP4Config(sites=EXPERTS))
    hf_moe.convert(model, FP4Config(sites=EXPERTS, routing_replay=False))


def test_k_not_a_multiple_of_the_block():
    with pytest.raises(ValueError, match=r"intermediate_size \(down K\) = 40 must be a multiple of the 16"):
        hf_moe.convert(tiny(moe_intermediate_size=40), FP4Config(sites=EXPERTS))
    with pytest.raises(ValueError, match="= 48 must be a multiple of the 32"):
        hf_moe.convert(tiny(moe_intermediate_size=48), FP4Config(format="mxfp4", sites=EXPERTS))
    model = tiny()
    hf_moe.convert(model, FP4Config(sites=EXPERTS))
    with pytest.raises(ValueError, match="already converted"):
        hf_moe.convert(model, FP4Config(sites=EXPERTS))


def test_guidance_from_another_model_or_other_sequences():
    """Protects: guidance recorded on another architecture, for other sequence ids, or without routes is refused."""
    a = hf_moe.convert(tiny(), FP4Config(sites=EXPERTS))
    b = hf_moe.convert(tiny(hidden_size=96), FP4Config(sites=EXPERTS))
    x = ids()
    with rollout(a) as rec:
        logits(a, x)
    with pytest.raises(GuidanceError, match="another model"):
        with train(b, mode="guided", guidance=rec.cache):
            pass
    with pytest.raises(GuidanceError, match="no rollout record"):
        with train(a, mode="guided", guidance=rec.cache, sequence_ids=[5, 6]):
            logits(a, x)
    with rollout(a, a._trace_fp4_config.with_(routing_replay=False)) as rec2:
        logits(a, x)
    with pytest.raises(GuidanceError, match="routes"):
        with train(a, mode="guided", guidance=rec2.cache):
            pass


# ---- transformers 4.x layout: ModuleList experts of nn.Linear --------------------------------------------------------


class _V4Config:
    model_type = "v4_moe"
    num_hidden_layers = 2
    hidden_size = 64
    num_experts_per_tok = 2


class _V4Expert(torch.nn.Module):
    def __init__(self, H, I):
        super().__init__()
        self.gate_proj = torch.nn.Linear(H, I, bias=False)
        self.up_proj = torch.nn.Linear(H, I, bias=False)
        self.down_proj = torch.nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _V4Block(torch.nn.Module):
    """The 4.x Qwen3MoeSparseMoeBlock shape: gate nn.Linear, experts ModuleList, routing inside forward."""

    def __init__(self, H=64, I=32, E=4, k=2):
        super().__init__()
        self.k = k
        self.gate = torch.nn.Linear(H, E, bias=False)
        self.experts = torch.nn.ModuleList([_V4Expert(H, I) for _ in range(E)])

    def forward(self, h):
        B, S, H = h.shape
        x = h.reshape(-1, H)
        w, idx = torch.topk(torch.softmax(self.gate(x).float(), -1), self.k, -1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                out.index_add_(0, tok, (expert(x[tok]) * w[tok, slot, None]).to(x.dtype))
        return out.reshape(B, S, H)


class _V4Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = _V4Block()


class _V4Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = _V4Config()
        self.embed = torch.nn.Embedding(128, 64)
        self.layers = torch.nn.ModuleList([_V4Layer() for _ in range(2)])

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer.mlp(h)
        return h


def test_v4_modulelist_experts_linear_replacement():
    """Protects: the nn.Linear path (4.x ModuleList experts): every expert Linear is replaced and verified, qat is
    fake-quant(x) @ fake-quant(W)^T, unconvert restores nn.Linear, and guidance for these unkeyed rows is refused."""
    torch.manual_seed(0)
    model = _V4Model().to(BF16)
    x = ids()
    want = model(x)
    hf_moe.convert(model, FP4Config(sites=EXPERTS, guided_sites=frozenset()))
    counts = hf_moe.verify(model)
    assert counts["v4_expert_linears"] == 2 * 4 * 3 and counts["fused_experts"] == 0
    lin = model.layers[0].mlp.experts[1].up_proj
    assert isinstance(lin, FP4Linear) and lin.site == "experts.up_proj" and lin.layer == 0
    a = (torch.randn(5, 64) * 3).to(BF16)
    with train(model, mode="qat"):
        got = lin(a)
        full = model(x)
    fq = lambda t, **kw: ref.nvfp4_dequantize(ref.nvfp4_quantize(t.float(), **kw))  # noqa: E731
    torch.testing.assert_close(got, (fq(a) @ fq(lin.weight, scope="tensor").T).to(BF16), rtol=2**-7, atol=1e-5)
    assert not torch.equal(full, want)
    with rollout(model):
        model(x)
    hf_moe.unconvert(model)
    assert type(model.layers[0].mlp.experts[1].up_proj) is torch.nn.Linear
    assert torch.equal(model(x), want)
    fresh = _V4Model()
    with pytest.raises(ValueError, match="no attention module"):  # default sites include the KV cache
        hf_moe.convert(fresh, FP4Config())
    assert not any(isinstance(m, FP4Linear) for m in fresh.modules()) and not hasattr(fresh, "_trace_fp4_converted")
    guided = hf_moe.convert(_V4Model().to(BF16), FP4Config(sites=EXPERTS, guidance_layers=None))
    with pytest.raises(GuidanceError, match="no token identity"):
        with rollout(guided):
            guided(x)


def test_registered_experts_backend_is_the_same_computation():
    """Protects: "trace_fp4" registered in transformers' ExpertsInterface computes what the bound forward does, and
    its bf16 mode falls back to the eager body (no recursion through the dispatcher)."""
    model = hf_moe.convert(tiny(), FP4Config(sites=EXPERTS))
    x = ids()
    want_bf16 = logits(model, x)
    with rollout(model):
        want = logits(model, x)
    for m in moe_layers(model):
        del m.forward  # leave only the class forward, which dispatches on config._experts_implementation
    model.set_experts_implementation(hf_moe.BACKEND_NAME)
    with rollout(model):
        assert torch.equal(logits(model, x), want)
    assert torch.equal(logits(model, x), want_bf16)


def test_guided_linear_sites_replay_per_token():
    """Protects: optional Linear sites (here attention projections, gpt-oss with biases) record and replay guidance
    per (seq, pos) like the experts: identical first-layer inputs give identical codes."""
    sites = frozenset({"experts", "attn_proj"})
    model = hf_moe.convert(tiny("gpt_oss"), FP4Config(sites=sites, guided_sites=sites, guidance_layers=None))
    x = ids()
    with rollout(model, capture_codes=True) as rec:
        logits(model, x)
    assert ("attn_proj.q_proj", 0) in rec.cache.records and ("attn_proj.o_proj", 1) in rec.cache.records
    with train(model, mode="guided", guidance=rec.cache, capture_codes=True) as sess:
        logits(model, x)
    agree = site_agreement(rec.codes, sess.codes)
    for site in ("attn_proj.q_proj@0", "attn_proj.k_proj@0", "attn_proj.o_proj@0"):
        assert agree[site]["code_agreement"] == 1.0 and agree[site]["scale_agreement"] == 1.0
    assert agree["attn_proj.q_proj@1"]["scale_agreement"] == 1.0
