"""FP4 KV cache for generate on the GPU (paged store: fp4kv_append / fp4kv_decode_attention kernels) held
against the dense reference store, and the alignment demo run on CUDA.
Run: pytest tests/gpu/test_hf_kvcache_gpu.py -q   (on the H200, with the extension built)
"""
from __future__ import annotations

import warnings

import pytest
import torch

from trace_ext import formats as F
from trace_ext.integrations import hf_kvcache as kv
from trace_ext.integrations.hf_moe import convert
from trace_ext.rl import FP4Config, rollout

pytestmark = pytest.mark.gpu
DEV = "cuda"
warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.mark.parametrize("D", [64, 128])
def test_paged_kernel_store_matches_dense_reference(D):
    """Protects the kernel path of FP4KVLayer: fp4kv_append stores the reference codes bit for bit (prefill chunk,
    then single tokens across page boundaries and re-layouts); decode attention from the codes stays within
    bf16 rounding of SDPA over the dequantized cache."""
    assert kv.kv_kernels_available(DEV)
    torch.manual_seed(0)
    B, H, Hq = 3, 4, 16
    dense = kv.FP4KVLayer(0, 0.5, 2.0, backend="reference", paged=False)
    paged = kv.FP4KVLayer(0, 0.5, 2.0, backend="auto", paged=True)
    for n in [37] + [1] * 30:
        k = (torch.randn(B, H, n, D, device=DEV) * 3).bfloat16()
        v = torch.randn(B, H, n, D, device=DEV).bfloat16()
        dk, dv = dense.update(k, v)
        paged.update(k, v)
    for w in ("k", "v"):
        assert torch.equal(dense.codes(w)[0], paged.codes(w)[0])
        assert torch.equal(dense.codes(w)[1], paged.codes(w)[1])
    q = torch.randn(B, Hq, 1, D, device=DEV).bfloat16()
    out = paged.store.decode(q, None).float()  # [B, 1, Hq, D]
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), dk.double(), dv.double(), enable_gqa=True)
    base = torch.nn.functional.scaled_dot_product_attention(q, dk, dv, enable_gqa=True)
    err = (out - want.transpose(1, 2)).abs().max()
    base_err = (base.double() - want).abs().max()
    assert err <= 2 * base_err + 1e-3


@torch.no_grad()
def test_model_decode_with_kernel_cache_matches_reference_cache():
    """Protects FP4KVCache(model) on CUDA: the kernel (paged) store and the dense reference store record the same
    KV codes for layer 0 (whose K/V depend on the tokens only), nearly the same deeper (decode attention from the
    codes and SDPA over the dequantized cache round differently), and give logits within bf16 noise."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=128)
    model = Qwen3MoeForCausalLM(cfg).to(DEV, torch.bfloat16).eval()
    convert(model, FP4Config(guidance_layers=None, guidance_kind="full"))
    ids = torch.randint(0, 256, (4, 40), device=DEV)
    logits, records = {}, {}
    for paged in (True, False):
        cache = kv.FP4KVCache(model, paged=paged)
        with rollout(model, sequence_ids=[0, 1, 2, 3]) as rec:
            out = [model(ids[:, :24], past_key_values=cache, use_cache=True).logits]
            for s in range(24, 40):
                out.append(model(ids[:, s : s + 1], past_key_values=cache, use_cache=True).logits)
        assert cache.layers[0].paged is paged
        logits[paged] = torch.cat(out, 1).float()
        records[paged] = {k: st.columns["payload"].cpu() for k, st in rec.cache.records.items()}
    for site in ("kv_k", "kv_v"):
        assert torch.equal(records[True][(site, 0)], records[False][(site, 0)])
        same = F.unpack_nibbles(records[True][(site, 1)]) == F.unpack_nibbles(records[False][(site, 1)])
        assert same.float().mean() > 0.8  # unrelated codes would agree on ~15%
    assert (logits[True] - logits[False]).abs().max() < 0.25


def test_demo_on_cuda(tmp_path):
    """Protects `make demo` on the GPU (kernels for the experts GEMMs, KV append and decode): the mismatch ordering
    TRACE all <= TRACE deeper half < RTN-QAT < FP4 rollout + BF16 trainer, and >= 99.9% value agreement at guided sites."""
    from trace_ext.rl import demo

    report = demo.run(demo.QUICK_RUN, device=DEV, cache_dir=tmp_path / "w", out_dir=tmp_path / "out", progress=False,
                      log=lambda *a: None)
    print(demo.format_table(report))
    for metric in ("k3_kl", "logprob_abs_diff"):
        m = {a["key"]: a["metrics"][metric] for a in report["arms"]}
        assert m["trace_all_compact"] <= m["trace_deep_compact"] < m["fp4_rtn_qat"] < m["fp4_bf16"], (metric, m)
    for a in report["arms"]:
        if a["key"].startswith("trace_all"):
            assert a["guided_code_agreement_min"] >= 0.999, a["agreement"]
