"""CUDA FP4 KV cache kernels (csrc/kv_append_fp4.cu, csrc/attn_decode_fp4kv_sm90.cu) against the reference.

- append: cache bytes equal the reference append (reference.nvfp4_quantize per (token, head) row with the
  static g) bit for bit, on random and adversarial rows, several sequences with different start positions.
- decode attention: error against a float64 attention over the dequantized cache is at most twice that of
  torch SDPA in bf16 over the same dequantized K/V (same run), LSE within 2e-3; contexts 1, 17, 4096, 131072,
  partly filled pages, mixed lengths (and an empty sequence), GQA 1 / 4 / 8 / 16, head dims 64 and 128,
  explicit and automatic split counts; every decode kernel family (heads8, heads8 over folded tokens at H_kv = 1, 2,
  the 4-warp heads kernel, g8, qsmem), negative and zero softmax scales.
- the prefill / trainer path over the same cache, SPEC 10 errors from the compiled ops, opcheck.
Run: pytest tests/gpu/test_kv_gpu.py -q   (on the H200, with the extension built; < 3 min)
"""
from __future__ import annotations

import math

import pytest
import torch

from trace_ext import ops
from trace_ext import reference_kv as RKV
from trace_ext.kvcache import PagedFP4KVCache

from test_quant_rowg_lean3_gpu import launched

pytestmark = pytest.mark.gpu

DEV = "cuda"


def make_cache(lens, Hkv, D, P, *, g_k=None, g_v=None, seed=0, spare_pages=5, backend="cuda"):
    """A cache holding random K/V for sequences of `lens` tokens, pages in shuffled order; returns what wrote it."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    B = len(lens)
    max_pages = max(1, max(math.ceil(n / P) for n in lens))
    num_pages = B * max_pages + spare_pages
    T = sum(lens)
    k = torch.randn(T, Hkv, D, generator=gen, device=DEV)
    v = torch.randn(T, Hkv, D, generator=gen, device=DEV)
    k[..., ::17] *= 8.0  # outlier channels, as real K has
    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    if g_k is None:
        g_k = float(k.float().abs().max()) / 2688.0
    if g_v is None:
        g_v = float(v.float().abs().max()) / 2688.0
    cache = PagedFP4KVCache(num_pages, P, Hkv, D, device=DEV, g_k=g_k, g_v=g_v)
    perm = torch.randperm(num_pages, generator=gen, device=DEV)[: B * max_pages]
    table = perm.reshape(B, max_pages).to(torch.int32)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    ops.fp4kv_append(cache, k, v, table, cu, torch.zeros(B, dtype=torch.int32, device=DEV), backend=backend)
    return cache, table, torch.tensor(lens, dtype=torch.int32, device=DEV), k, v, cu


def errors_vs_reference(out, lse, q, cache, table, seq_lens, scale):
    """(kernel max error, SDPA-bf16 max error, LSE max error) against float64 attention over the dequantized cache."""
    K, V = ops.fp4kv_gather(cache, table, seq_lens, torch.float32)
    ref_out, ref_lse = RKV.attention_with_lse(q, K, V, seq_lens, scale)
    live = seq_lens > 0
    S = K.shape[2]
    mask = (torch.arange(S, device=DEV)[None, :] < seq_lens[:, None].long())[:, None, None, :]
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q[live][:, :, None], K[live].bfloat16(), V[live].bfloat16(), attn_mask=mask[live], scale=scale, enable_gqa=True
    )[:, :, 0]
    err = (out[live].float() - ref_out[live]).abs().max().item()
    err_sdpa = (sdpa.float() - ref_out[live]).abs().max().item()
    lse_err = (lse[live] - ref_lse[live]).abs().max().item()
    # empty sequences: zero output, -inf LSE
    assert not out[~live].any() and torch.isneginf(lse[~live]).all()
    return err, err_sdpa, lse_err


# ---- append ----------------------------------------------------------------------------------------------------


def adversarial_rows(T, H, D, gen):
    x = torch.randn(T, H, D, generator=gen, device=DEV) * torch.exp2(
        torch.randint(-20, 20, (T, H, 1), generator=gen, device=DEV).float()
    )
    flat = x.view(-1, 16)
    n = flat.shape[0]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -2.5, 0.0, -0.0, 3.0, 1.0, 0.5, -5.0], device=DEV)
    flat[0 : n : 7] = ties  # exact E2M1 ties with g = 1 (s_b = 1 when amax = 6)
    flat[1 : n : 11] = 0.0  # zero block (t = 0)
    flat[2 : n : 13] = -0.0
    flat[3 : n : 17, 5] = float("nan")
    flat[4 : n : 19, 9] = float("inf")
    flat[5 : n : 23] *= 1e30  # saturating scale bytes
    flat[6 : n : 29] *= 1e-30  # subnormal / zero scale bytes
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("D", [64, 128, 48])
@pytest.mark.parametrize("g", [1.0, 0.0123])
def test_append_is_bit_exact(D, g):
    """Codes and scale bytes equal the reference append, for prefill chunks and decode tokens in one launch
    (D = 48: an odd number of blocks per row takes the one-block-per-thread kernel, the others two blocks)."""
    gen = torch.Generator(device=DEV).manual_seed(D)
    H, P = 4, 16
    counts = [300, 1, 0, 17, 64]
    start = [5, 4095, 3, 0, 40]
    B = len(counts)
    max_pages = 4096 // P + 1
    pages = B * max_pages
    table = torch.randperm(pages, generator=gen, device=DEV).reshape(B, max_pages).to(torch.int32)
    T = sum(counts)
    k = adversarial_rows(T, H, D, gen)
    v = torch.randn(T, H, D, generator=gen, device=DEV).to(torch.bfloat16)
    cu = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    sp = torch.tensor(start, dtype=torch.int32, device=DEV)
    a = PagedFP4KVCache(pages, P, H, D, device=DEV, g_k=g, g_v=g * 3)
    b = PagedFP4KVCache(pages, P, H, D, device=DEV, g_k=g, g_v=g * 3)
    ops.fp4kv_append(a, k, v, table, cu, sp, backend="cuda")
    ops.fp4kv_append(b, k, v, table, cu, sp, backend="reference")
    for name, x, y in zip(("k_codes", "k_scales", "v_codes", "v_scales"), a.tensors(), b.tensors()):
        bad = x != y
        assert not bad.any(), f"{name}: {int(bad.sum())} bytes differ, first at {bad.nonzero()[0].tolist()}"
    # read back through gather: the rows are where the table says
    kc, _ = RKV.gather_codes(a.k_codes, a.k_scales, table, sp + torch.tensor(counts, device=DEV, dtype=torch.int32))
    q = RKV.quantize_rows(k[int(cu[3]) : int(cu[4])], g)
    assert torch.equal(kc[3, :, 0:17], q.codes.transpose(0, 1))


def test_append_from_an_offset_view():
    """A k_new that is a view at an odd offset (not 16-byte aligned) is read correctly."""
    H, D, P = 2, 64, 16
    base = torch.randn(1 + 40 * H * D, device=DEV).to(torch.bfloat16)
    k = base[1:].view(40, H, D)
    a = PagedFP4KVCache(4, P, H, D, device=DEV)
    b = PagedFP4KVCache(4, P, H, D, device=DEV)
    table = torch.tensor([[3, 1, 0]], dtype=torch.int32, device=DEV)
    cu = torch.tensor([0, 40], dtype=torch.int32, device=DEV)
    z = torch.zeros(1, dtype=torch.int32, device=DEV)
    ops.fp4kv_append(a, k, k, table, cu, z, backend="cuda")
    ops.fp4kv_append(b, k, k, table, cu, z, backend="reference")
    assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))


# ---- decode attention --------------------------------------------------------------------------------------------

DECODE_CASES = [
    # lens, Hq, Hkv, D, page size
    pytest.param([1], 8, 8, 128, 16, id="ctx1-gqa1-d128"),
    pytest.param([17], 32, 8, 128, 16, id="ctx17-gqa4-d128"),
    pytest.param([4096], 32, 4, 128, 16, id="ctx4096-gqa8-d128"),
    pytest.param([131072], 32, 8, 128, 64, id="ctx131072-gqa4-d128"),
    pytest.param([1, 17, 4096, 300, 0, 77], 32, 4, 64, 16, id="mixed-gqa8-d64-empty"),
    pytest.param([17, 1000, 3], 16, 1, 128, 7, id="mixed-gqa16-page7"),
    pytest.param([33, 4096], 8, 8, 64, 32, id="mixed-gqa1-d64"),
    pytest.param([4096, 16], 12, 4, 64, 16, id="gqa3-d64"),
]


@pytest.mark.parametrize("lens, Hq, Hkv, D, P", DECODE_CASES)
def test_decode_error_at_most_twice_sdpa_bf16(lens, Hq, Hkv, D, P):
    cache, table, seq_lens, *_ = make_cache(lens, Hkv, D, P, seed=len(lens) * 7 + D)
    gen = torch.Generator(device=DEV).manual_seed(1)
    q = (torch.randn(len(lens), Hq, D, generator=gen, device=DEV) * 2).to(torch.bfloat16)
    scale = 1.0 / math.sqrt(D)
    out, lse = ops.fp4kv_decode_attention(q, cache, table, seq_lens, backend="cuda")
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (len(lens), Hq)
    err, err_sdpa, lse_err = errors_vs_reference(out, lse, q, cache, table, seq_lens, scale)
    print(f"lens={lens} Hq={Hq} Hkv={Hkv} D={D}: err {err:.3e} sdpa-bf16 err {err_sdpa:.3e} lse err {lse_err:.2e}")
    assert err <= 2 * err_sdpa + 1e-6, f"decode error {err:.3e} > 2 x SDPA bf16 error {err_sdpa:.3e}"
    assert lse_err <= 2e-3


def assert_split_count_within_bound(num_splits, Hq, Hkv):
    """An explicit split count on sequences of 2000, 5 and 333 tokens (D = 128, page 16) stays within the decode
    bound of the reference."""
    lens = [2000, 5, 333]
    cache, table, seq_lens, *_ = make_cache(lens, Hkv, 128, 16, seed=3)
    q = torch.randn(3, Hq, 128, device=DEV).to(torch.bfloat16)
    out, lse = ops.fp4kv_decode_attention(q, cache, table, seq_lens, 0.1, num_splits=num_splits, backend="cuda")
    err, err_sdpa, lse_err = errors_vs_reference(out, lse, q, cache, table, seq_lens, 0.1)
    assert err <= 2 * err_sdpa + 1e-6 and lse_err <= 2e-3


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64, 1000])
def test_decode_split_counts_agree(num_splits):
    """Explicit split counts (incl. more splits than tiles: empty splits) give the same attention."""
    assert_split_count_within_bound(num_splits, Hq=16, Hkv=4)


def assert_fused_finish_equals_combine_kernel(monkeypatch, shapes, splits):
    """For each (Hq, H_kv, D): the in-kernel split-K finish (TRACE_EXT_KV_DECODE_COMBINE=fused) and the separate combine
    kernel (the default) give the same bits over back-to-back launches with the given split counts (a
    counter left off 0 would pick the wrong last CTA), on sequences of 3000, 5, 0 and 777 tokens; and the last result
    is within the decode bound of the reference."""
    lens = [3000, 5, 0, 777]
    for Hq, Hkv, D in shapes:
        cache, table, seq_lens, *_ = make_cache(lens, Hkv, D, 16, seed=11)
        q = torch.randn(len(lens), Hq, D, device=DEV).to(torch.bfloat16)
        results = {}
        for mode in ("fused", "kernel"):
            monkeypatch.setenv("TRACE_EXT_KV_DECODE_COMBINE", mode)
            results[mode] = [
                ops.fp4kv_decode_attention(q, cache, table, seq_lens, 0.1, num_splits=n, backend="cuda")
                for n in splits
            ]
        for (of, lf), (ok, lk) in zip(results["fused"], results["kernel"]):
            assert torch.equal(of, ok)
            torch.testing.assert_close(lf, lk, rtol=0, atol=1e-6)
        err, err_sdpa, lse_err = errors_vs_reference(*results["fused"][-1], q, cache, table, seq_lens, 0.1)
        assert err <= 2 * err_sdpa + 1e-6 and lse_err <= 2e-3


def test_decode_fused_split_combine_matches_combine_kernel(monkeypatch):
    """The in-kernel split-K finish (last CTA per (sequence, KV head), self-resetting arrival counters) equals the
    separate combine kernel, G = 8 and 16 (H_kv = 2: heads8 over folded tokens, which always takes the combine
    kernel, and the qsmem kernel), empty splits and sequences."""
    assert_fused_finish_equals_combine_kernel(monkeypatch, ((16, 2, 128), (32, 2, 64)), (7, 64, 3, 7, 200))


# The heads kernels (4 KV heads per CTA, CTA-shared contiguous tile copies) run where G <= 8 and H_kv % 4 == 0: by
# default heads8 (8 warps per CTA, two per KV head on alternate tiles, merged in shared memory at the end), the
# 4-warp kernel with TRACE_EXT_KV_DECODE_IMPL=heads; the g8 swapped-operand kernel elsewhere for G <= 8
# (TRACE_EXT_KV_DECODE_IMPL=g8 selects it wherever G <= 8). All three are checked on every case below. Extra cases: page sizes
# that are not multiples of the 16-token tile (tiles straddle pages, several table loads per tile), 8 KV heads
# (two head groups per sequence), and a head group past the first (grid.y > 0) with G = 1.
HEADS_CASES = DECODE_CASES + [
    pytest.param([17, 1000, 3, 0], 16, 4, 128, 7, id="heads-page7-gqa4"),
    pytest.param([4096, 33], 32, 8, 128, 1, id="heads-page1-gqa4"),
    pytest.param([600, 2048], 8, 8, 64, 24, id="heads-page24-gqa1-d64"),
]


@pytest.mark.parametrize("impl", ["heads", "g8", "heads8"])
@pytest.mark.parametrize("lens, Hq, Hkv, D, P", HEADS_CASES)
def test_decode_heads_and_g8_kernels_error_at_most_twice_sdpa_bf16(lens, Hq, Hkv, D, P, impl, monkeypatch):
    """The heads kernel and the g8 kernel meet the same bound on every decode case (each falls back where it does
    not apply)."""
    monkeypatch.setenv("TRACE_EXT_KV_DECODE_IMPL", impl)
    test_decode_error_at_most_twice_sdpa_bf16(lens, Hq, Hkv, D, P)


@pytest.mark.parametrize("impl", ["heads", "g8", "heads8"])
@pytest.mark.parametrize("num_splits", [1, 2, 7, 64, 1000])
def test_decode_heads_and_g8_kernels_split_counts_agree(num_splits, impl, monkeypatch):
    """Explicit split counts with the heads kernel (empty splits, splits shorter than a tile, and past 2^16 partial
    floats per head group, where the separate combine kernel takes over)."""
    monkeypatch.setenv("TRACE_EXT_KV_DECODE_IMPL", impl)
    assert_split_count_within_bound(num_splits, Hq=32, Hkv=8)


@pytest.mark.parametrize("impl", ["heads", "g8", "heads8"])
def test_decode_heads_and_g8_kernels_fused_split_combine_matches_combine_kernel(impl, monkeypatch):
    """The heads kernels' in-kernel split-K finish (last CTA per (sequence, head group)) and the g8 kernel's equal the
    separate combine kernel bit for bit, G = 4 and 8, empty sequences."""
    monkeypatch.setenv("TRACE_EXT_KV_DECODE_IMPL", impl)
    assert_fused_finish_equals_combine_kernel(monkeypatch, ((16, 4, 128), (64, 8, 64)), (7, 64, 3, 7, 20))


@pytest.mark.parametrize("impl", ["default", "heads8"])
def test_decode_with_large_and_tiny_query_rows(impl, monkeypatch):
    """Q rows of very different magnitudes (the kernel rescales each row by a power of two) and a zero row."""
    monkeypatch.setenv("TRACE_EXT_KV_DECODE_IMPL", impl)
    lens = [700]
    cache, table, seq_lens, *_ = make_cache(lens, 2, 128, 16, seed=5)
    q = torch.randn(1, 8, 128, device=DEV)
    q[0, 0] *= 1e4
    q[0, 1] *= 1e-4
    q[0, 2] = 0.0
    q = q.to(torch.bfloat16)
    out, lse = ops.fp4kv_decode_attention(q, cache, table, seq_lens, 0.05, backend="cuda")
    err, err_sdpa, lse_err = errors_vs_reference(out, lse, q, cache, table, seq_lens, 0.05)
    assert err <= 2 * err_sdpa + 1e-6
    ref_lse = RKV.decode_attention(q, *cache.tensors(), cache.g_k, cache.g_v, table, seq_lens, 0.05)[1]
    assert ((lse - ref_lse).abs() <= 2e-3 * ref_lse.abs().clamp(min=1)).all()


def test_decode_after_incremental_appends_matches_reference_cache():
    """Prefill chunk + decode steps through the CUDA append, then decode: same as the reference-built cache."""
    H, D, P, Hq = 4, 128, 16, 16
    a = PagedFP4KVCache(64, P, H, D, device=DEV, g_k=0.01, g_v=0.02)
    b = PagedFP4KVCache(64, P, H, D, device=DEV, g_k=0.01, g_v=0.02)
    table = torch.arange(64, device=DEV, dtype=torch.int32).flip(0).reshape(2, 32)
    lens = torch.zeros(2, dtype=torch.int32, device=DEV)
    for step, n in enumerate([100, 1, 1, 37, 1]):
        k = torch.randn(2 * n, H, D, device=DEV).to(torch.bfloat16)
        v = torch.randn(2 * n, H, D, device=DEV).to(torch.bfloat16)
        cu = torch.tensor([0, n, 2 * n], dtype=torch.int32, device=DEV)
        ops.fp4kv_append(a, k, v, table, cu, lens, backend="cuda")
        ops.fp4kv_append(b, k, v, table, cu, lens, backend="reference")
        lens = lens + n
        q = torch.randn(2, Hq, D, device=DEV).to(torch.bfloat16)
        oa, la = ops.fp4kv_decode_attention(q, a, table, lens, backend="cuda")
        ob, lb = ops.fp4kv_decode_attention(q, b, table, lens, backend="cuda")
        assert torch.equal(oa, ob) and torch.equal(la, lb), f"step {step}"


def test_prefill_path_matches_decode_over_the_same_cache():
    """Trainer side: fake-quantize K/V (RTN with the static g, or guided by the cache's codes) + SDPA gives the
    dequantized cache exactly, and its last query agrees with the decode kernel as closely as SDPA itself."""
    lens = [257, 64]
    Hkv, Hq, D = 4, 16, 128
    cache, table, seq_lens, k, v, cu = make_cache(lens, Hkv, D, 16, seed=11)
    q_last = torch.randn(2, Hq, D, device=DEV).to(torch.bfloat16)
    out, lse = ops.fp4kv_decode_attention(q_last, cache, table, seq_lens, backend="cuda")
    err, err_sdpa, _ = errors_vs_reference(out, lse, q_last, cache, table, seq_lens, 1 / math.sqrt(D))
    Kc, _ = ops.fp4kv_gather(cache, table, seq_lens)
    gk = ops.fp4kv_gather_guidance(cache, table, seq_lens, "k")
    gv = ops.fp4kv_gather_guidance(cache, table, seq_lens, "v")
    S = int(seq_lens.max())
    for b, n in enumerate(lens):
        kk = k[int(cu[b]) : int(cu[b + 1])].permute(1, 0, 2)[None].contiguous()
        vv = v[int(cu[b]) : int(cu[b + 1])].permute(1, 0, 2)[None].contiguous()
        qq = torch.randn(1, Hq, n, D, device=DEV).to(torch.bfloat16)
        qq[0, :, -1] = q_last[b]
        rows = (torch.arange(Hkv * S, device=DEV).reshape(Hkv, S)[:, :n].reshape(-1) + b * Hkv * S)
        o_rtn = ops.fp4kv_prefill_attention(qq, kk, vv, g_k=cache.g_k, g_v=cache.g_v)
        o_gd = ops.fp4kv_prefill_attention(
            qq, kk, vv, g_k=cache.g_k, g_v=cache.g_v, guidance_k=gk.index_rows(rows), guidance_v=gv.index_rows(rows)
        )
        assert torch.equal(o_rtn, o_gd)
        assert torch.equal(ops.nvfp4_fake_quantize(kk, torch.tensor(cache.g_k, device=DEV)), Kc[b : b + 1, :, :n])
        diff = (o_rtn[0, :, -1].float() - out[b].float()).abs().max().item()
        assert diff <= err + 2 * err_sdpa + 1e-6


# ---- errors, opcheck -----------------------------------------------------------------------------------------------


def test_compiled_ops_raise_spec_errors():
    cache, table, seq_lens, *_ = make_cache([40], 2, 128, 16)
    q = torch.randn(1, 4, 128, device=DEV).to(torch.bfloat16)
    op = torch.ops.trace_ext.fp4kv_decode_attention
    args = (cache.k_codes, cache.k_scales, cache.v_codes, cache.v_scales, table, seq_lens, 0.1, 1.0, 1.0, 0)
    with pytest.raises(TypeError):
        op(q.half(), *args)
    with pytest.raises(ValueError):
        op(q[:, :3].contiguous(), *args)
    with pytest.raises(ValueError):
        op(torch.randn(1, 4, 96, device=DEV).bfloat16(), *args)  # head_dim must match the cache
    with pytest.raises(RuntimeError):
        op(q.cpu(), *args)
    with pytest.raises(TypeError):
        op(q, *args[:4], table.long(), *args[5:])
    app = torch.ops.trace_ext.fp4kv_append
    k = torch.randn(3, 2, 128, device=DEV).to(torch.bfloat16)
    cu = torch.tensor([0, 3], dtype=torch.int32, device=DEV)
    z = torch.zeros(1, dtype=torch.int32, device=DEV)
    with pytest.raises(TypeError):
        app(*cache.tensors(), k.float(), k, table, cu, z, 1.0, 1.0)
    with pytest.raises(ValueError):
        app(*cache.tensors(), k[:, :1].contiguous(), k[:, :1].contiguous(), table, cu, z, 1.0, 1.0)
    with pytest.raises(ValueError):
        app(*cache.tensors(), k, k, table, cu[:1], z, 1.0, 1.0)
    # the caches are used in place: a uint8 view at an odd offset is a ValueError, not a misaligned access
    def odd_view(t):
        return torch.empty(t.numel() + 16, dtype=torch.uint8, device=DEV)[1 : 1 + t.numel()].view(t.shape)

    with pytest.raises(ValueError, match="aligned"):
        op(q, odd_view(cache.k_codes), *args[1:])
    with pytest.raises(ValueError, match="aligned"):
        op(q, *args[:3], odd_view(cache.v_scales), *args[4:])
    kc, ks, vc, vs = cache.tensors()
    with pytest.raises(ValueError, match="aligned"):
        app(kc, ks, odd_view(vc), vs, k, k, table, cu, z, 1.0, 1.0)
    # no query heads: empty results; new tokens without a sequence or without pages: ValueError
    out0, lse0 = op(q[:, :0].contiguous(), *args)
    assert out0.shape == (1, 0, 128) and lse0.shape == (1, 0)
    t0 = torch.zeros(0, table.shape[1], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="sequence"):
        app(*cache.tensors(), k, k, t0, cu[:1], z[:0], 1.0, 1.0)
    empty = [t[:0] for t in cache.tensors()]
    with pytest.raises(ValueError, match="pages"):
        app(*empty, k, k, table, cu, z, 1.0, 1.0)
    # the public ops: a head_dim the kernels are not built for is a clear error when CUDA is forced
    c96 = PagedFP4KVCache(4, 16, 1, 96, device=DEV)
    t96 = torch.zeros(1, 1, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="head_dim"):
        ops.fp4kv_decode_attention(torch.zeros(1, 1, 96, device=DEV, dtype=torch.bfloat16), c96, t96, z, backend="cuda")
    with pytest.raises(RuntimeError, match="cache is on"):
        ops.fp4kv_decode_attention(q.cpu(), cache, table, seq_lens)


def test_opcheck_on_cuda():
    cache, table, seq_lens, k, v, cu = make_cache([40, 3], 2, 64, 16)
    q = torch.randn(2, 4, 64, device=DEV).to(torch.bfloat16)
    torch.library.opcheck(
        torch.ops.trace_ext.fp4kv_decode_attention.default,
        (q, *cache.tensors(), table, seq_lens, 0.125, cache.g_k, cache.g_v, 3),
    )
    torch.library.opcheck(
        torch.ops.trace_ext.fp4kv_append.default,
        (*[t.clone() for t in cache.tensors()], k, v, table, cu, torch.zeros_like(seq_lens), cache.g_k, cache.g_v),
    )


# ---- heads8 (the default; TRACE_EXT_KV_DECODE_IMPL=heads8): two warps per KV head, merged at the end -------------


@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("lens", [[1], [16], [17], [32], [48], [4095], [1, 16, 17, 31, 0, 4096]], ids=str)
def test_decode_heads8_matches_heads_and_reference(lens, num_splits, monkeypatch):
    """heads8 against the reference (same bound) and against the 4-warp heads kernel (both are the same arithmetic
    per tile; only the order in which tiles are summed differs, so they agree to a few bf16 ulps): lengths where
    the second warp of a head gets no tile (1, 16), one partial tile (17, 48) or an odd number of tiles, with
    explicit and automatic splits, H_kv = 8 (two head groups), G = 4."""
    cache, table, seq_lens, *_ = make_cache(lens, 8, 128, 16, seed=sum(lens) + 1)
    q = torch.randn(len(lens), 32, 128, device=DEV).to(torch.bfloat16)
    monkeypatch.setenv("TRACE_EXT_KV_DECODE_IMPL", "heads8")
    o8, l8 = ops.fp4kv_decode_attention(q, cache, table, seq_lens, 0.1, num_splits=num_splits, backend="cuda")
    monkeypatch.setenv("TRACE_EXT_KV_DECODE_IMPL", "heads")
    o4, l4 = ops.fp4kv_decode_attention(q, cache, table, seq_lens, 0.1, num_splits=num_splits, backend="cuda")
    err, err_sdpa, lse_err = errors_vs_reference(o8, l8, q, cache, table, seq_lens, 0.1)
    assert err <= 2 * err_sdpa + 1e-6 and lse_err <= 2e-3
    torch.testing.assert_close(o8.float(), o4.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(l8, l4, rtol=0, atol=1e-4)


def assert_dominant_keys_within_bound(Hkv, Hq, tokens, seed):
    """Two sequences of 64 tokens (D = 128, page 16) where key tokens[b] of sequence b is, in every KV head, 40 x the
    query of the head's first query head (one dominant key per sequence): decode with 1 and 2 splits stays within the
    decode bound of the reference."""
    D, P, lens = 128, 16, [64, 64]
    gen = torch.Generator(device=DEV).manual_seed(seed)
    k = torch.randn(sum(lens), Hkv, D, generator=gen, device=DEV)
    v = torch.randn(sum(lens), Hkv, D, generator=gen, device=DEV)
    q = torch.randn(len(lens), Hq, D, generator=gen, device=DEV)
    for b, tok in enumerate(tokens):
        k[64 * b + tok] = q[b].reshape(Hkv, Hq // Hkv, D)[:, 0] * 40.0
    k, v, q = k.to(torch.bfloat16), v.to(torch.bfloat16), q.to(torch.bfloat16)
    g_k = float(k.float().abs().max()) / 2688.0
    g_v = float(v.float().abs().max()) / 2688.0
    cache = PagedFP4KVCache(16, P, Hkv, D, device=DEV, g_k=g_k, g_v=g_v)
    table = torch.arange(16, device=DEV, dtype=torch.int32).reshape(2, 8)
    cu = torch.tensor([0, 64, 128], dtype=torch.int32, device=DEV)
    ops.fp4kv_append(cache, k, v, table, cu, torch.zeros(2, dtype=torch.int32, device=DEV), backend="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    for n in (1, 2):
        out, lse = ops.fp4kv_decode_attention(q, cache, table, seq_lens, 0.1, num_splits=n, backend="cuda")
        err, err_sdpa, lse_err = errors_vs_reference(out, lse, q, cache, table, seq_lens, 0.1)
        assert err <= 2 * err_sdpa + 1e-6 and lse_err <= 2e-3


def test_decode_heads8_merges_sets_with_far_apart_maxima(monkeypatch):
    """One dominant key in a tile of one warp set and none in the other's (then the reverse): the cross-warp merge
    must weight the set with the far smaller max by 2^(m_set - m) (underflowing to 0), not add it unscaled."""
    monkeypatch.setenv("TRACE_EXT_KV_DECODE_IMPL", "heads8")
    assert_dominant_keys_within_bound(4, 16, (5, 21), seed=21)  # tile 0 (set 0) of sequence 0, tile 1 (set 1) of 1


# ---- heads8 over folded tokens (H_kv = 1, 2: the KV heads per GPU of tensor-parallel rollouts): 4 / H_kv consecutive
# tokens of all heads are one contiguous 4-head run of the cache, read as heads8's 4 pseudo KV heads; pseudo head
# j * H_kv + head holds tokens (4 / H_kv) t + j of `head`, masked per warp at the sequence's end and merged in the CTA.
# The default at those H_kv where the page size is a multiple of 4 / H_kv (else the g8 kernel).
FOLD_CASES = [
    # lens (every residue mod 4, empty, one token, partial tiles, pseudo heads without a token), Hq, Hkv, D, P
    pytest.param([1, 2, 3, 4, 5, 0, 17, 63, 4093, 4096], 8, 1, 128, 16, id="fold4-gqa8"),
    pytest.param([1, 2, 3, 5, 0, 30, 4094, 2049], 4, 1, 64, 4, id="fold4-gqa4-d64-page4"),
    pytest.param([1, 2, 3, 0, 33, 4095, 1000], 16, 2, 128, 16, id="fold2-gqa8"),
    pytest.param([7, 1, 2, 999, 8192], 8, 2, 128, 2, id="fold2-gqa4-page2"),
    pytest.param([5, 64, 3001], 2, 2, 64, 64, id="fold2-gqa1-d64-page64"),
    pytest.param([6, 4099], 1, 1, 128, 8, id="fold4-gqa1-page8"),
    pytest.param([6, 4099, 1], 4, 1, 128, 2, id="nofold-page2-g8"),  # 4 tokens per pseudo token do not fit a page
]


def decode_kernel_launched(fn) -> str:
    """The decode kernel fn launches (its name as the profiler records it)."""
    names = [n for n in launched(fn) if "fp4kv_decode_kernel" in n]
    assert len(names) == 1, names
    return names[0]


@pytest.mark.parametrize("num_splits", [0, 1, 3, 40])  # 40: the wide combine kernel
@pytest.mark.parametrize("lens, Hq, Hkv, D, P", FOLD_CASES)
def test_decode_folded_heads8_matches_reference_and_g8(lens, Hq, Hkv, D, P, num_splits, monkeypatch):
    """The default kernel at H_kv = 1, 2 (heads8 over folded tokens where the page holds whole pseudo tokens, checked
    by the launched kernel's name) is within the decode bound of the reference and agrees with the g8 kernel to a
    few bf16 ulps (the same arithmetic per tile, tiles summed in another order)."""
    cache, table, seq_lens, *_ = make_cache(lens, Hkv, D, P, seed=sum(lens) + P)
    q = torch.randn(len(lens), Hq, D, device=DEV).to(torch.bfloat16)
    monkeypatch.delenv("TRACE_EXT_KV_DECODE_IMPL", raising=False)
    def call():
        return ops.fp4kv_decode_attention(q, cache, table, seq_lens, 0.1, num_splits=num_splits, backend="cuda")

    fold = 4 // Hkv if P % (4 // Hkv) == 0 else 1
    name = decode_kernel_launched(call)
    want = f"fp4kv_decode_kernel_heads<{D}, 2, 3, {fold}>" if fold > 1 else f"fp4kv_decode_kernel_g8<{D}>"
    assert want in name, name
    out, lse = call()
    err, err_sdpa, lse_err = errors_vs_reference(out, lse, q, cache, table, seq_lens, 0.1)
    assert err <= 2 * err_sdpa + 1e-6 and lse_err <= 2e-3
    monkeypatch.setenv("TRACE_EXT_KV_DECODE_IMPL", "g8")
    o8, l8 = call()
    torch.testing.assert_close(out.float(), o8.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, l8, rtol=0, atol=1e-4)


def test_decode_folded_heads8_merges_pseudo_heads_with_far_apart_maxima():
    """One dominant key per sequence, in the pseudo head of token residue 1 (then 3) of a head: the CTA's merge of the
    folded pseudo heads must weight the others by 2^(m_j - m), underflowing to 0, not add them unscaled."""
    assert_dominant_keys_within_bound(1, 8, (5, 23), seed=22)


# ---- negative and zero softmax scales on the kernels that share the swapped-operand softmax (heads8, folded heads8,
# the 4-warp heads kernel, g8): scores scaled before the running max, tokens past the split masked after the scaling
@pytest.mark.parametrize("impl, Hkv", [("heads8", 4), ("heads8", 2), ("heads", 4), ("g8", 4)])
@pytest.mark.parametrize("scale", [-0.1, 0.0])
def test_decode_negative_and_zero_softmax_scale(impl, Hkv, scale, monkeypatch):
    lens = [700, 17, 0, 4100]
    cache, table, seq_lens, *_ = make_cache(lens, Hkv, 128, 16, seed=9)
    q = torch.randn(len(lens), 4 * Hkv, 128, device=DEV).to(torch.bfloat16)
    monkeypatch.setenv("TRACE_EXT_KV_DECODE_IMPL", impl)
    for n in (0, 1, 3):
        out, lse = ops.fp4kv_decode_attention(q, cache, table, seq_lens, scale, num_splits=n, backend="cuda")
        err, err_sdpa, lse_err = errors_vs_reference(out, lse, q, cache, table, seq_lens, scale)
        assert err <= 2 * err_sdpa + 1e-6 and lse_err <= 2e-3, (n, err, err_sdpa, lse_err)


# ---- heads8 stage ring depth (default 3 stages since round 22; TRACE_EXT_KV_DECODE_RING=4 / 2, read per call, select
# the 4-stage ring before it and a 2-stage one): the same split count and arithmetic, so the same bits.
@pytest.mark.parametrize("ring", ["4", "2"])
@pytest.mark.parametrize("lens, Hkv, D, P, splits", [
    ([8192] * 4, 4, 128, 16, 0), ([4096] * 6, 4, 128, 16, 0), ([32768], 8, 128, 16, 0), ([131072], 8, 128, 16, 0),
    ([1, 16, 17, 31, 0, 4095, 4096, 777], 8, 128, 16, 0), ([5000, 3], 4, 64, 16, 0), ([2049, 100], 4, 128, 1, 0),
    ([3000, 4100], 8, 128, 64, 3), ([1000], 4, 128, 16, 1), ([65536], 4, 64, 16, 300)], ids=str)
def test_decode_heads8_ring_depth_is_bit_equal(lens, Hkv, D, P, splits, ring, monkeypatch):
    """Protects the heads8 stage rings: output and LSE of the default 3-stage ring bit-equal to the 4- and 2-stage
    rings' on the bench shapes (fewer sequences), lengths with empty / partial / odd tiles, head dims 64 and 128, page
    sizes 1 / 16 / 64, explicit split counts (1, 3, 300: the wide combine) and automatic ones, with the fused finish
    and the combine kernel, and NaN scale bytes in the cache."""
    cache, table, seq_lens, *_ = make_cache(lens, Hkv, D, P, seed=len(lens) + D)
    if D == 128 and P == 16 and len(lens) == 8:
        cache.k_scales[int(table[0, 0]), 0, 0, 0] = 0x7F  # an E4M3 NaN scale on sequence 0's only token
    q = torch.randn(len(lens), 8 * Hkv, D, device=DEV).to(torch.bfloat16)
    monkeypatch.delenv("TRACE_EXT_KV_DECODE_IMPL", raising=False)
    for combine in (None, "fused"):
        if combine is None:
            monkeypatch.delenv("TRACE_EXT_KV_DECODE_COMBINE", raising=False)
        else:
            monkeypatch.setenv("TRACE_EXT_KV_DECODE_COMBINE", combine)
        monkeypatch.delenv("TRACE_EXT_KV_DECODE_RING", raising=False)
        o0, l0 = ops.fp4kv_decode_attention(q, cache, table, seq_lens, 0.1, num_splits=splits, backend="cuda")
        monkeypatch.setenv("TRACE_EXT_KV_DECODE_RING", ring)
        o1, l1 = ops.fp4kv_decode_attention(q, cache, table, seq_lens, 0.1, num_splits=splits, backend="cuda")
        assert torch.equal(o1.view(torch.int16), o0.view(torch.int16)), f"out ring={ring} combine={combine}"
        assert torch.equal(l1.view(torch.int32), l0.view(torch.int32)), f"lse ring={ring} combine={combine}"
    monkeypatch.delenv("TRACE_EXT_KV_DECODE_RING", raising=False)


# ---- programmatic dependent launch (TRACE_EXT_KV_DECODE_PDL, read per call): by default the combine kernels are
# launched as programmatic dependents of the decode kernel and wait for it with griddepcontrol.wait; "0" launches them
# plainly. The same bits either way.
@pytest.mark.parametrize("impl", ["heads8", "heads", "g8", "qsmem"])
@pytest.mark.parametrize("Hq, splits, combine", [(32, 7, None), (32, 300, None), (64, 40, None), (64, 40, "fused")],
                         ids=str)
def test_decode_programmatic_dependent_launch_is_bit_equal(impl, Hq, splits, combine, monkeypatch):
    """The combine kernels (separate; wide: heads kernels past 2^16 partial floats per head group, 300 splits; and the
    fused finish, which launches none) launched as programmatic dependents give the bits of plain launches, over
    back-to-back calls on alternating queries and cache contents rewritten just before each call (a combine that read
    the partials before the decode grid finished would mix two calls' partials), with an empty sequence and G = 4 / 8;
    and the result is within the decode bound of the reference."""
    lens = [20000, 5, 0, 4097]
    cache, table, seq_lens, *_ = make_cache(lens, 8, 128, 16, seed=21)
    qs = [torch.randn(len(lens), Hq, 128, device=DEV).to(torch.bfloat16) for _ in range(2)]
    # two cache contents (the second with other K / V codes), written by a copy kernel before each decode
    contents = [[t.clone() for t in cache.tensors()], [t.clone() for t in cache.tensors()]]
    contents[1][0] ^= 0x35
    contents[1][2] ^= 0x5A
    monkeypatch.setenv("TRACE_EXT_KV_DECODE_IMPL", impl)
    if combine is None:
        monkeypatch.delenv("TRACE_EXT_KV_DECODE_COMBINE", raising=False)
    else:
        monkeypatch.setenv("TRACE_EXT_KV_DECODE_COMBINE", combine)
    results = {}
    for pdl in ("0", None):
        if pdl is None:
            monkeypatch.delenv("TRACE_EXT_KV_DECODE_PDL", raising=False)
        else:
            monkeypatch.setenv("TRACE_EXT_KV_DECODE_PDL", pdl)
        calls = []
        for i in range(6):
            for t, src in zip(cache.tensors(), contents[(i // 2) % 2]):
                t.copy_(src)
            calls.append(ops.fp4kv_decode_attention(qs[i % 2], cache, table, seq_lens, 0.1, num_splits=splits,
                                                    backend="cuda"))
        results[pdl] = calls
    monkeypatch.delenv("TRACE_EXT_KV_DECODE_PDL", raising=False)
    for i, ((o1, l1), (o0, l0)) in enumerate(zip(results[None], results["0"])):
        assert torch.equal(o1.view(torch.int16), o0.view(torch.int16)), f"out call {i}"
        assert torch.equal(l1.view(torch.int32), l0.view(torch.int32)), f"lse call {i}"
    err, err_sdpa, lse_err = errors_vs_reference(*results[None][-1], qs[1], cache, table, seq_lens, 0.1)  # contents 0
    assert err <= 2 * err_sdpa + 1e-6 and lse_err <= 2e-3


# ---- append: warp-stream kernel (TRACE_EXT_KV_APPEND_IMPL=warp / warp2; the default picks warp2 for appends of at
# least 32 items per resident warp, the grid kernel below that: =grid forces the grid kernel) -----------------------
# "warp" takes four blocks per item where D % 64 == 0 (else two, else one), "warp2" at most two; both must write the
# same bytes as the reference (and so as the default kernel). The switch is read per call.

APPEND_WARP_IMPLS = ["warp", "warp2"]


def _append_both(impl, monkeypatch, cache_args, k, v, table, cu, sp):
    """(cache written by the CUDA op under TRACE_EXT_KV_APPEND_IMPL=impl, cache written by the reference)."""
    a = PagedFP4KVCache(*cache_args[:4], device=DEV, **cache_args[4])
    b = PagedFP4KVCache(*cache_args[:4], device=DEV, **cache_args[4])
    monkeypatch.setenv("TRACE_EXT_KV_APPEND_IMPL", impl)
    ops.fp4kv_append(a, k, v, table, cu, sp, backend="cuda")
    monkeypatch.delenv("TRACE_EXT_KV_APPEND_IMPL")
    ops.fp4kv_append(b, k, v, table, cu, sp, backend="reference")
    return a, b


def _assert_same_cache(a, b, what):
    for name, x, y in zip(("k_codes", "k_scales", "v_codes", "v_scales"), a.tensors(), b.tensors()):
        bad = x != y
        assert not bad.any(), f"{what} {name}: {int(bad.sum())} bytes differ, first at {bad.nonzero()[0].tolist()}"


def _paged_append_inputs(counts, start, H, D, P, gen, v_scale):
    """A shuffled block table with room for every sequence's start + count tokens, adversarial K rows and Gaussian V
    rows (times v_scale) for sum(counts) new tokens, cu_seqlens and start positions: (pages, table, k, v, cu, sp)."""
    B = len(counts)
    max_pages = math.ceil((max(s + c for s, c in zip(start, counts)) + 1) / P)
    pages = B * max_pages
    table = torch.randperm(pages, generator=gen, device=DEV).reshape(B, max_pages).to(torch.int32)
    T = sum(counts)
    k = adversarial_rows(T, H, D, gen)
    v = (torch.randn(T, H, D, generator=gen, device=DEV) * v_scale).to(torch.bfloat16)
    cu = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    sp = torch.tensor(start, dtype=torch.int32, device=DEV)
    return pages, table, k, v, cu, sp


@pytest.mark.parametrize("impl", APPEND_WARP_IMPLS)
@pytest.mark.parametrize("D", [128, 64, 96, 48])
@pytest.mark.parametrize("g", [1.0, 0.0123])
def test_append_warp_kernel_is_bit_exact(impl, D, g, monkeypatch):
    """The warp-stream kernel on adversarial K and V rows (ties, zero and -0 blocks, NaN / Inf, saturating and
    subnormal scale bytes, magnitudes 2^-20..2^20): prefill chunks, decode tokens and an empty sequence in one launch,
    starts not page aligned. D = 128 / 64: four blocks per item under "warp"; 96: two; 48 (an odd number of
    blocks per row): the default kernel."""
    gen = torch.Generator(device=DEV).manual_seed(1000 + D)
    H, P = 4, 16
    counts = [300, 1, 0, 17, 64, 1, 1, 129]
    start = [5, 4095, 3, 0, 40, 7, 16, 1]
    B = len(counts)
    max_pages = 4096 // P + 1
    pages = B * max_pages
    table = torch.randperm(pages, generator=gen, device=DEV).reshape(B, max_pages).to(torch.int32)
    T = sum(counts)
    k = adversarial_rows(T, H, D, gen)
    v = adversarial_rows(T, H, D, gen)
    cu = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    sp = torch.tensor(start, dtype=torch.int32, device=DEV)
    a, b = _append_both(impl, monkeypatch, (pages, P, H, D, dict(g_k=g, g_v=g * 3)), k, v, table, cu, sp)
    _assert_same_cache(a, b, f"impl={impl} D={D} g={g}")


@pytest.mark.parametrize("impl", APPEND_WARP_IMPLS)
@pytest.mark.parametrize("P", [1, 7, 16])
@pytest.mark.parametrize("H", [1, 3, 8])
def test_append_warp_kernel_page_sizes_and_head_counts(impl, P, H, monkeypatch):
    """Page sizes 1 / 7 / 16 (a block-table load per token, pages straddled at odd offsets) and H_kv 1 / 3 / 8, so that
    a warp step of 32 items covers 32, 10 2/3 or 4 tokens (D = 64, four blocks per item: H items per token) and lanes
    cross sequence and page boundaries inside one step; 40 one-token sequences (decode) after three prefill chunks."""
    gen = torch.Generator(device=DEV).manual_seed(10 * P + H)
    D = 64
    counts = [97, 33, 0, 250] + [1] * 40
    start = [3, 0, 11, 6] + torch.randint(0, 300, (40,), generator=gen, device=DEV).tolist()  # CUDA gen
    pages, table, k, v, cu, sp = _paged_append_inputs(counts, start, H, D, P, gen, v_scale=7.0)
    a, b = _append_both(impl, monkeypatch, (pages, P, H, D, dict(g_k=0.37, g_v=1.0)), k, v, table, cu, sp)
    _assert_same_cache(a, b, f"impl={impl} P={P} H={H}")


@pytest.mark.parametrize("impl", APPEND_WARP_IMPLS)
@pytest.mark.parametrize("g", [1.0, 3.0e-3, 2.0**-40, 2.0**45, 2.0**-60])
@pytest.mark.parametrize("shuffle", [False, True])
def test_append_warp_kernel_every_bf16_value(impl, g, shuffle, monkeypatch):
    """Every one of the 65536 bf16 bit patterns once in K and once (reversed order) in V, in order (blocks of
    neighbouring magnitudes: every scale byte, the fast path across its whole range) or shuffled (huge and tiny
    values in one block: tiny and overflowing quotients); g from the reciprocal path's range (2^-40, 2^45) and
    outside it (2^-60: the default kernel is used)."""
    H, D, P = 4, 128, 16
    T = 65536 // (H * D)
    bits = torch.arange(65536, dtype=torch.int32, device=DEV)
    if shuffle:
        bits = bits[torch.randperm(65536, generator=torch.Generator(device=DEV).manual_seed(7), device=DEV)]
    as_bf16 = lambda b: (b - (b >= 32768).to(torch.int32) * 65536).to(torch.int16).view(torch.bfloat16)  # noqa: E731
    k = as_bf16(bits).view(T, H, D).contiguous()
    v = as_bf16(bits.flip(0)).view(T, H, D).contiguous()
    B = 2
    max_pages = T // P + 2
    table = torch.arange(B * max_pages, device=DEV, dtype=torch.int32).flip(0).reshape(B, max_pages).contiguous()
    cu = torch.tensor([0, T // 2 + 3, T], dtype=torch.int32, device=DEV)
    sp = torch.tensor([9, 0], dtype=torch.int32, device=DEV)
    a, b = _append_both(impl, monkeypatch, (B * max_pages, P, H, D, dict(g_k=g, g_v=g)), k, v, table, cu, sp)
    _assert_same_cache(a, b, f"impl={impl} g={g} shuffle={shuffle}")


@pytest.mark.parametrize("waves", [2, 3, 64])
@pytest.mark.parametrize("impl", APPEND_WARP_IMPLS)
def test_append_warp_kernel_in_waves_is_bit_exact(impl, waves, monkeypatch):
    """TRACE_EXT_KV_APPEND_WAVES=n (an A/B knob): n waves of warp chunks rounded up to whole warp steps (64: most
    warps get one step or none) on prefill chunks, decode tokens, an empty sequence and odd page offsets."""
    gen = torch.Generator(device=DEV).manual_seed(77 + waves)
    H, D, P = 3, 128, 7
    counts = [700, 1, 0, 33, 2048, 1, 129]
    start = [5, 4000, 3, 0, 40, 7, 1]
    pages, table, k, v, cu, sp = _paged_append_inputs(counts, start, H, D, P, gen, v_scale=3.0)
    monkeypatch.setenv("TRACE_EXT_KV_APPEND_WAVES", str(waves))
    a, b = _append_both(impl, monkeypatch, (pages, P, H, D, dict(g_k=0.05, g_v=1.0)), k, v, table, cu, sp)
    monkeypatch.delenv("TRACE_EXT_KV_APPEND_WAVES")
    _assert_same_cache(a, b, f"impl={impl} waves={waves}")


@pytest.mark.parametrize("impl", APPEND_WARP_IMPLS)
def test_append_warp_kernel_matches_default_kernel_on_the_bench_shape(impl, monkeypatch):
    """The bench's prefill chunk (8 sequences x 4096 tokens, H_kv 8, D 128, written at token 1000 of shuffled pages)
    through the default and the warp-stream kernel: identical cache bytes (K outlier channels, as real K has)."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    B, H, D, P, chunk = 8, 8, 128, 16, 4096
    T = B * chunk
    pages_per_seq = math.ceil(2 * chunk / P)
    table = torch.randperm(B * pages_per_seq, generator=gen, device=DEV).reshape(B, pages_per_seq).to(torch.int32)
    k = torch.randn(T, H, D, generator=gen, device=DEV)
    k[..., ::17] *= 30.0
    k = k.to(torch.bfloat16)
    v = torch.randn(T, H, D, generator=gen, device=DEV).to(torch.bfloat16)
    cu = torch.arange(0, T + 1, chunk, dtype=torch.int32, device=DEV)
    sp = torch.full((B,), 1000, dtype=torch.int32, device=DEV)
    caches = []
    for which in ("grid", impl):
        c = PagedFP4KVCache(B * pages_per_seq, P, H, D, device=DEV, g_k=0.01, g_v=0.02)
        monkeypatch.setenv("TRACE_EXT_KV_APPEND_IMPL", which)
        ops.fp4kv_append(c, k, v, table, cu, sp, backend="cuda")
        caches.append(c)
    monkeypatch.delenv("TRACE_EXT_KV_APPEND_IMPL")
    _assert_same_cache(caches[1], caches[0], f"impl={impl} vs grid")
    # and a slice of it against the reference (the whole chunk is slow on the reference backend)
    ref = PagedFP4KVCache(B * pages_per_seq, P, H, D, device=DEV, g_k=0.01, g_v=0.02)
    ops.fp4kv_append(ref, k[:chunk], v[:chunk], table[:1], cu[:2], sp[:1], backend="reference")
    rows = table[0, 1000 // P : (1000 + chunk) // P + 1].long()
    for x, y in zip(caches[1].tensors(), ref.tensors()):
        assert torch.equal(x[rows], y[rows])


def test_append_warp_kernel_rtn_rounding_is_exhaustively_exact():
    """The warp kernel's RTN (e2m1_rn_grid_expmagic_x2m14: u + M with M = 2^22 * 2^floor(log2 max(u, 2^-14)) in one
    FMA, minus M; fp16 bits saturated at 0x0E00) emulated in torch float32 on the device for every float32
    u = v * 2^-14 in [0, 2^90]: the code bits 9..11 equal SPEC e2m1_rn(v) and no other fp16 bit is set."""
    end, step = 0x6C800000 + 1, 1 << 28
    for start in range(0, end, step):
        b = torch.arange(start, min(end, start + step), dtype=torch.int32, device=DEV)
        u = b.view(torch.float32)
        m = ((b.clamp(min=0x38800000) & 0x7F800000).view(torch.float32)) * 4194304.0  # exact
        g = (u + m) - m
        h = (g.half().view(torch.int16).to(torch.int32) & 0xFFFF).clamp(max=0x0E00)
        a = u * 16384.0  # exact
        ref = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int() + (a > 2.5).int()
               + (a >= 3.5).int() + (a > 5.0).int())
        bad = ((h >> 9) != ref) | ((h & 0xF1FF) != 0)
        assert not bad.any(), f"first mismatch at u bits {hex(int(b[bad.nonzero()[0]]))}"
        del b, u, m, g, h, a, ref, bad
