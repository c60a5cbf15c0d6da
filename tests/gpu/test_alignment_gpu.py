"""The alignment layer on the GPU: guidance records offloaded to pinned memory without host syncs, and the
rollout / guided path of a tiny HF MoE running the compiled kernels, held against the CPU reference path.
Run: pytest tests/gpu/test_alignment_gpu.py -q   (on the H200, with the extension built)
"""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from trace_ext import reference as ref
from trace_ext.integrations import hf_moe
from trace_ext.rl import FP4Config, GuidanceCache, rollout, train
from trace_ext.rl.guidance import encode_keys
from trace_ext.rl.metrics import site_agreement

pytestmark = pytest.mark.gpu
DEV = "cuda"


def test_records_offload_to_pinned_memory_without_host_sync():
    """Protects: recording during generation never synchronizes the host; full chunks move to pinned memory on a
    side stream, and lookups after the copies return the recorded rows."""
    cfg = FP4Config(num_layers=2, offload="async", offload_chunk_bytes=4096)
    cache = GuidanceCache(cfg)
    rows, K = 32, 2048
    recs = [ref.guidance_from_quantized(ref.nvfp4_quantize(torch.randn(rows, K, device=DEV)), "compact") for _ in range(8)]
    seq = torch.arange(rows, device=DEV)
    pos = [torch.full((rows,), step, device=DEV, dtype=torch.int64) for step in range(8)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(8):  # 8 decode steps of 32 sequences
            cache.add_record("expert_in", 1, encode_keys((seq, pos[step])), recs[step])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    store = cache.records[("expert_in", 1)]
    assert any(not k.is_cuda and k.is_pinned() for k, _ in store._chunks)
    cache.synchronize()
    seq = torch.arange(rows, device=DEV).repeat(8)
    pos = torch.arange(8, device=DEV).repeat_interleave(rows)
    got = cache.get_record("expert_in", 1, encode_keys((seq, pos)), K, DEV)
    assert torch.equal(got.payload, torch.cat([r.payload for r in recs]))
    assert torch.equal(got.g, torch.cat([r.g for r in recs]))
    assert cache.bytes_per_token() == pytest.approx(K // 8 + K // 16 + 4)


def _tiny():
    cfg = tf.Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
                            num_experts_per_tok=4, norm_topk_prob=True)
    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def test_kernel_rollout_matches_reference_rollout_and_guided_replays_it():
    """Protects: the GPU rollout (compiled quantize + grouped GEMM) agrees with the CPU reference path up to fp32
    accumulation, and guided replay of the GPU rollout reproduces its codes on the first layer (identical inputs)."""
    model = _tiny()
    x = torch.randint(0, 512, (4, 32))
    hf_moe.convert(model, FP4Config(sites=frozenset({"experts"}), guidance_layers=None))
    with torch.no_grad(), rollout(model):
        cpu = model(x).logits.float()
    model.to(DEV)
    with torch.no_grad(), rollout(model, capture_codes=True) as rec:
        gpu = model(x.to(DEV)).logits.float()
    rel = ((gpu.cpu() - cpu).norm() / cpu.norm()).item()
    assert rel < 2e-2, f"GPU rollout deviates from the reference rollout by {rel:.3g}"
    with torch.no_grad(), train(model, mode="guided", guidance=rec.cache.to(DEV), capture_codes=True) as sess:
        model(x.to(DEV))  # lookups on the GPU
    agree = site_agreement(rec.codes, sess.codes)
    assert agree["expert_in@0"]["code_agreement"] == 1.0 and agree["expert_in@0"]["scale_agreement"] == 1.0
    assert agree["expert_down_in"]["scale_agreement"] == 1.0


def test_generate_with_fp4_kv_then_guided_training_beats_rtn():
    """Protects: the full GPU loop (FP4 experts + FP4 KV cache in generate, capture, guided trainer forward): the
    guided trainer agrees with the rollout's codes at least as well as RTN QAT, site by site, and covers every row."""
    model = _tiny()
    hf_moe.convert(model, FP4Config(guidance_layers=None))
    model.to(DEV)
    prompt = torch.randint(0, 512, (4, 16), device=DEV)
    with torch.no_grad(), rollout(model, capture_codes=True) as rec:
        seqs = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False,
                              pad_token_id=0)
    x = seqs[:, :-1]
    agree = {}
    for mode in ("qat", "guided"):
        with torch.no_grad(), train(model, mode=mode, guidance=rec.cache, capture_codes=True) as sess:
            model(x)
        agree[mode] = site_agreement(rec.codes, sess.codes)
    for site in ("expert_in", "expert_down_in", "kv_k", "kv_v"):
        assert agree["guided"][site]["code_agreement"] >= agree["qat"][site]["code_agreement"], site
        assert agree["guided"][site]["rows"] == agree["qat"][site]["rows"] > 0
