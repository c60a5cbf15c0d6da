"""FP4 KV cache (SPEC 8) on the CPU: reference semantics, paging, append bit-exactness against the reference
quantizer, the prefill / trainer path against decode over the same cache, SPEC 10 errors, opcheck."""
import math

import pytest
import torch

from trace_ext import ops
from trace_ext import reference as R
from trace_ext import reference_kv as RKV
from trace_ext._loader import extension_loaded
from trace_ext.kvcache import PagedFP4KVCache
from trace_ext.ops import kv as KV

needs_ext = pytest.mark.skipif(not extension_loaded(), reason="the compiled extension is not installed (pure-Python install)")


def _setup(lens, H=2, D=64, P=4, g_k=0.02, g_v=0.03, extra_pages=3, seed=0, scale=1.0):
    """A cache with `lens` tokens per sequence written in one append, pages handed out in shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    B = len(lens)
    max_pages = max(1, max(math.ceil(n / P) for n in lens) if lens else 1)
    num_pages = B * max_pages + extra_pages
    cache = PagedFP4KVCache(num_pages, P, H, D, device="cpu", g_k=g_k, g_v=g_v)
    table = torch.randperm(num_pages, generator=gen)[: B * max_pages].reshape(B, max_pages).to(torch.int32)
    T = sum(lens)
    k = (torch.randn(T, H, D, generator=gen) * scale).to(torch.bfloat16)
    v = (torch.randn(T, H, D, generator=gen) * scale).to(torch.bfloat16)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    ops.fp4kv_append(cache, k, v, table, cu, torch.zeros(B, dtype=torch.int32))
    return cache, table, torch.tensor(lens, dtype=torch.int32), k, v, cu


def _per_sequence(x, cu, b):
    return x[int(cu[b]) : int(cu[b + 1])]


# ---- the cache class -------------------------------------------------------------------------------------------


def test_cache_layout_and_sizes():
    """Protects the layout the HF integration and the kernels code against."""
    c = PagedFP4KVCache(10, 16, 8, 128, device="cpu", g_k=0.5, g_v=2.0)
    assert c.k_codes.shape == (10, 16, 8, 64) and c.k_scales.shape == (10, 16, 8, 8)
    assert c.v_codes.shape == c.k_codes.shape and c.v_scales.shape == c.k_scales.shape
    assert c.k_codes.dtype == torch.uint8 and not c.k_codes.any()
    assert c.bytes_per_token == 2 * 8 * (64 + 8) and c.capacity_tokens == 160
    assert isinstance(c.g_k, float) and c.g_k == 0.5 and c.g_v == 2.0


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        (dict(head_dim=72), ValueError),
        (dict(page_size=0), ValueError),
        (dict(g_k=0.0), ValueError),
        (dict(g_v=float("inf")), ValueError),
        (dict(g_k="1"), TypeError),
    ],
)
def test_cache_constructor_errors(kwargs, exc):
    args = dict(num_pages=2, page_size=4, num_kv_heads=1, head_dim=64)
    args.update(kwargs)
    with pytest.raises(exc):
        PagedFP4KVCache(args.pop("num_pages"), args.pop("page_size"), args.pop("num_kv_heads"), args.pop("head_dim"), device="cpu", **args)


# ---- append ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("D", [64, 128])
def test_append_equals_reference_quantizer_row_by_row(D):
    """Append stores exactly reference.nvfp4_quantize(row, g) per (token, head), at the paged position."""
    lens = [5, 1, 9, 0, 16]
    cache, table, seq_lens, k, v, cu = _setup(lens, H=3, D=D, P=4)
    kc, ks = RKV.gather_codes(cache.k_codes, cache.k_scales, table, seq_lens)
    vc, vs = RKV.gather_codes(cache.v_codes, cache.v_scales, table, seq_lens)
    for b, n in enumerate(lens):
        for x, g, codes, scales in ((k, cache.g_k, kc, ks), (v, cache.g_v, vc, vs)):
            q = R.nvfp4_quantize(_per_sequence(x, cu, b), torch.tensor(g))
            assert torch.equal(codes[b, :, :n], q.codes.transpose(0, 1))
            assert torch.equal(scales[b, :, :n], q.scales.transpose(0, 1))
            assert not codes[b, :, n:].any() and not scales[b, :, n:].any()  # zero past the length


def test_append_handles_non_finite_blocks_like_the_quantizer():
    """A NaN / Inf in a block gives scale 0x7F and zero codes, for that (token, head, block) only."""
    cache = PagedFP4KVCache(2, 4, 1, 32, device="cpu")
    k = torch.randn(3, 1, 32).to(torch.bfloat16)
    k[0, 0, 3] = float("nan")
    k[2, 0, 20] = float("inf")
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    ops.fp4kv_append(cache, k, k.clone(), table, torch.tensor([0, 3], dtype=torch.int32), torch.tensor([2], dtype=torch.int32))
    # positions 2, 3 -> page 1 slots 2, 3; position 4 -> page 0 slot 0
    assert cache.k_scales[1, 2, 0, 0] == 0x7F and cache.k_scales[1, 2, 0, 1] != 0x7F
    assert cache.k_scales[0, 0, 0, 1] == 0x7F and not cache.k_codes[0, 0, 0, 8:].any()
    assert not cache.k_codes[1, 0].any() and not cache.k_codes[1, 1].any()  # slots before start_pos untouched


def test_chunked_appends_equal_one_append():
    """Prefill chunks followed by single decode tokens leave the same bytes as one append of everything."""
    lens = [11, 6]
    one, table, seq_lens, k, v, cu = _setup(lens, P=4, extra_pages=0)
    many = PagedFP4KVCache(one.num_pages, 4, 2, 64, device="cpu", g_k=one.g_k, g_v=one.g_v)
    done = [0, 0]
    for step in ([4, 3], [3, 0], [1, 1], [1, 1], [1, 1], [1, 0]):
        ks, vs = [], []
        for b, n in enumerate(step):
            s = int(cu[b]) + done[b]
            ks.append(k[s : s + n])
            vs.append(v[s : s + n])
        ops.fp4kv_append(
            many,
            torch.cat(ks),
            torch.cat(vs),
            table,
            torch.tensor([0, step[0], step[0] + step[1]], dtype=torch.int32),
            torch.tensor(done, dtype=torch.int32),
        )
        done = [d + n for d, n in zip(done, step)]
    assert done == lens
    for a, b in zip(one.tensors(), many.tensors()):
        assert torch.equal(a, b)


# ---- gather, decode reference -------------------------------------------------------------------------------------


def test_gather_dequantizes_with_the_static_g():
    """gather == reference dequantize of the stored codes, in [B, H, S, D] order, zeros past the length."""
    cache, table, seq_lens, k, v, cu = _setup([3, 7], P=4)
    K, V = ops.fp4kv_gather(cache, table, seq_lens, torch.float32)
    assert K.shape == (2, 2, 7, 64)
    for b in range(2):
        ref = R.nvfp4_dequantize(R.nvfp4_quantize(_per_sequence(v, cu, b), torch.tensor(cache.g_v)), torch.float32)
        assert torch.equal(V[b, :, : int(seq_lens[b])], ref.transpose(0, 1))
    assert not K[0, :, 3:].any()
    Kb, _ = ops.fp4kv_gather(cache, table, seq_lens)
    assert Kb.dtype == torch.bfloat16 and torch.equal(Kb, K.to(torch.bfloat16))


def _naive_decode(q, K, V, n, scale):
    """One sequence, float64, written out the textbook way: softmax(q K^T * scale) V, natural-log LSE."""
    Hq, D = q.shape
    G = Hq // K.shape[0]
    out = torch.zeros(Hq, D, dtype=torch.float64)
    lse = torch.full((Hq,), float("-inf"), dtype=torch.float64)
    for h in range(Hq):
        if n == 0:
            continue
        s = (K[h // G, :n].double() @ q[h].double()) * scale
        lse[h] = torch.log(torch.exp(s - s.max()).sum()) + s.max()
        out[h] = torch.softmax(s, 0) @ V[h // G, :n].double()
    return out, lse


@pytest.mark.parametrize("gqa", [1, 4])
def test_reference_decode_matches_textbook_attention(gqa):
    """The oracle itself: per sequence, causal over the cached length, GQA head mapping, LSE, empty sequence."""
    lens = [5, 0, 13]
    cache, table, seq_lens, *_ = _setup(lens, H=2, P=4)
    q = torch.randn(3, 2 * gqa, 64).to(torch.bfloat16)
    out, lse = ops.fp4kv_decode_attention(q, cache, table, seq_lens, softmax_scale=0.3)
    K, V = ops.fp4kv_gather(cache, table, seq_lens, torch.float32)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    for b, n in enumerate(lens):
        o_ref, l_ref = _naive_decode(q[b], K[b], V[b], n, 0.3)
        torch.testing.assert_close(out[b].float(), o_ref.float().to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse[b], l_ref.float(), atol=1e-4, rtol=1e-5)
    assert torch.isneginf(lse[1]).all() and not out[1].any()


def test_paging_does_not_change_attention():
    """Identity table (contiguous cache) and a shuffled table with a different page size give the same result."""
    lens = [9, 4]
    a, ta, sa, k, v, cu = _setup(lens, P=4)
    b = PagedFP4KVCache(8, 16, 2, 64, device="cpu", g_k=a.g_k, g_v=a.g_v)
    tb = torch.tensor([[0], [1]], dtype=torch.int32)
    ops.fp4kv_append(b, k, v, tb, cu, torch.zeros(2, dtype=torch.int32))
    q = torch.randn(2, 4, 64).to(torch.bfloat16)
    oa, la = ops.fp4kv_decode_attention(q, a, ta, sa)
    ob, lb = ops.fp4kv_decode_attention(q, b, tb, sa)
    assert torch.equal(oa, ob) and torch.equal(la, lb)


def test_static_g_is_folded_exactly():
    """Scaling g_v scales the output; g_k enters the scores exactly as the softmax scale would."""
    lens = [6]
    c1, t, s, k, v, cu = _setup(lens, g_k=1.0, g_v=1.0, scale=0.01)
    c2 = PagedFP4KVCache(c1.num_pages, c1.page_size, 2, 64, device="cpu", g_k=0.5, g_v=4.0)
    ops.fp4kv_append(c2, (k.float() * 0.5).to(torch.bfloat16), (v.float() * 4).to(torch.bfloat16), t, cu, torch.zeros(1, dtype=torch.int32))
    # power-of-two g with power-of-two-scaled inputs quantize to the same codes and scale bytes
    assert torch.equal(c1.k_codes, c2.k_codes) and torch.equal(c1.k_scales, c2.k_scales)
    q = torch.randn(1, 2, 64).to(torch.bfloat16)
    o1, l1 = ops.fp4kv_decode_attention(q, c1, t, s, softmax_scale=0.25)
    o2, l2 = ops.fp4kv_decode_attention(q, c2, t, s, softmax_scale=0.5)
    torch.testing.assert_close(o2.float(), o1.float() * 4)
    torch.testing.assert_close(l1, l2)


# ---- prefill / trainer side ---------------------------------------------------------------------------------------------


def _prefill_inputs(cache_k, cu, b, H, Hq, D, q_last):
    kk = cache_k[int(cu[b]) : int(cu[b + 1])].permute(1, 0, 2)[None].contiguous()
    n = kk.shape[2]
    qq = torch.randn(1, Hq, n, D).to(torch.bfloat16)
    qq[0, :, -1] = q_last
    return qq, kk


def test_prefill_rtn_and_guided_equal_decode_over_the_same_cache():
    """The trainer path: fake-quantizing K/V with the static g (RTN) or guided by the cache's own records gives
    exactly the dequantized cache, so its last query matches decode attention over that cache."""
    lens = [7, 12]
    cache, table, seq_lens, k, v, cu = _setup(lens, H=2, P=4)
    Hq = 8
    q = torch.randn(2, Hq, 64).to(torch.bfloat16)
    out, _ = ops.fp4kv_decode_attention(q, cache, table, seq_lens)
    Kc, Vc = ops.fp4kv_gather(cache, table, seq_lens)
    gk = ops.fp4kv_gather_guidance(cache, table, seq_lens, "k")
    gv = ops.fp4kv_gather_guidance(cache, table, seq_lens, "v")
    S = int(seq_lens.max())
    assert gk.kind == "full" and gk.payload.shape == (2 * 2 * S, 32) and gk.scales.shape == (2 * 2 * S, 4)
    for b in range(2):
        qq, kk = _prefill_inputs(k, cu, b, 2, Hq, 64, q[b])
        _, vv = _prefill_inputs(v, cu, b, 2, Hq, 64, q[b])
        n = kk.shape[2]
        # exactness of the fake-quantized K/V (RTN and guided) against the cache
        assert torch.equal(R.nvfp4_fake_quantize(kk, torch.tensor(cache.g_k)), Kc[b : b + 1, :, :n])
        rows = torch.arange(2 * S).reshape(2, S)[:, :n].reshape(-1) + b * 2 * S
        gkb = gk.index_rows(rows)
        assert torch.equal(R.nvfp4_fake_quantize(kk, rounding="guided", guidance=gkb), Kc[b : b + 1, :, :n])
        o_rtn = ops.fp4kv_prefill_attention(qq, kk, vv, g_k=cache.g_k, g_v=cache.g_v)
        o_gd = ops.fp4kv_prefill_attention(
            qq, kk, vv, g_k=cache.g_k, g_v=cache.g_v, guidance_k=gkb, guidance_v=gv.index_rows(rows)
        )
        assert o_rtn.shape == (1, Hq, n, 64) and torch.equal(o_rtn, o_gd)
        torch.testing.assert_close(o_rtn[0, :, -1].float(), out[b].float(), atol=2e-2, rtol=2e-2)


def test_prefill_causal_is_bottom_right_aligned():
    """With fewer queries than keys the queries are the newest tokens: the last one sees every key."""
    B, Hq, H, S, D = 1, 4, 2, 9, 64
    q = torch.randn(B, Hq, 3, D).to(torch.bfloat16)
    k = torch.randn(B, H, S, D).to(torch.bfloat16)
    v = torch.randn(B, H, S, D).to(torch.bfloat16)
    out = ops.fp4kv_prefill_attention(q, k, v, g_k=1.0, g_v=1.0)
    kq = R.nvfp4_fake_quantize(k, torch.tensor(1.0))
    vq = R.nvfp4_fake_quantize(v, torch.tensor(1.0))
    for i in range(3):
        n = S - 3 + i + 1
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, i : i + 1], kq[:, :, :n], vq[:, :, :n], enable_gqa=True
        )
        torch.testing.assert_close(out[:, :, i : i + 1], ref)


# ---- errors (SPEC 10) --------------------------------------------------------------------------------------------------


def test_misuse_gives_spec_errors():
    cache, table, seq_lens, k, v, cu = _setup([4, 3], P=4)
    z = torch.zeros(2, dtype=torch.int32)
    q = torch.randn(2, 4, 64).to(torch.bfloat16)
    with pytest.raises(TypeError, match="cache"):
        ops.fp4kv_append(object(), k, v, table, cu, z)
    with pytest.raises(TypeError, match="k_new must be bfloat16"):
        ops.fp4kv_append(cache, k.float(), v, table, cu, z)
    with pytest.raises(ValueError, match="k_new"):
        ops.fp4kv_append(cache, k[:, :1], v, table, cu, z)
    with pytest.raises(TypeError, match="cu_seqlens_new must be int32"):
        ops.fp4kv_append(cache, k, v, table, cu.long(), z)
    with pytest.raises(ValueError, match="cu_seqlens_new"):
        ops.fp4kv_append(cache, k, v, table, torch.tensor([0, 5, 6], dtype=torch.int32), z)
    with pytest.raises(ValueError, match="block_table"):
        ops.fp4kv_append(cache, k, v, table, cu, torch.tensor([0, 6], dtype=torch.int32))  # 6 + 3 > 2 pages of 4
    # a negative start would put token -1 into the table's last column: rejected, the cache untouched
    before = [t.clone() for t in cache.tensors()]
    with pytest.raises(ValueError, match="start_pos must be >= 0"):
        ops.fp4kv_append(cache, k, v, table, cu, torch.tensor([-1, 0], dtype=torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(before, cache.tensors()))
    bad = table.clone()
    bad[0, 0] = cache.num_pages
    with pytest.raises(ValueError, match="page ids"):
        ops.fp4kv_append(cache, k, v, bad, cu, z)
    with pytest.raises(TypeError, match="q must be bfloat16"):
        ops.fp4kv_decode_attention(q.float(), cache, table, seq_lens)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        ops.fp4kv_decode_attention(q[:, :3], cache, table, seq_lens)
    with pytest.raises(ValueError, match="seq_lens"):
        ops.fp4kv_decode_attention(q, cache, table, seq_lens[:1])
    with pytest.raises(ValueError, match="block_table"):
        ops.fp4kv_decode_attention(q, cache, table, torch.tensor([9, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="num_splits"):
        ops.fp4kv_decode_attention(q, cache, table, seq_lens, num_splits=-1)
    with pytest.raises(RuntimeError, match="backend='cuda' is unavailable"):
        ops.fp4kv_decode_attention(q, cache, table, seq_lens, backend="cuda")
    with pytest.raises(ValueError, match="which"):
        ops.fp4kv_gather_guidance(cache, table, seq_lens, "q")
    with pytest.raises(ValueError, match="S_q <= S"):
        ops.fp4kv_prefill_attention(torch.zeros(1, 2, 5, 64, dtype=torch.bfloat16), k[:4].permute(1, 0, 2)[None], k[:4].permute(1, 0, 2)[None], g_k=1.0, g_v=1.0)


def test_empty_batch_and_no_new_tokens():
    cache, table, seq_lens, *_ = _setup([4], P=4)
    before = [t.clone() for t in cache.tensors()]
    e = torch.zeros(0, 2, 64, dtype=torch.bfloat16)
    ops.fp4kv_append(cache, e, e, table, torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(before, cache.tensors()))
    out, lse = ops.fp4kv_decode_attention(
        torch.zeros(0, 2, 64, dtype=torch.bfloat16), cache, table[:0], seq_lens[:0]
    )
    assert out.shape == (0, 2, 64) and lse.shape == (0, 2)


@needs_ext
def test_opcheck_kv_ops():
    """Schemas, fakes and the reference-backed CPU kernels agree (torch.compile / dispatcher integration)."""
    cache, table, seq_lens, k, v, cu = _setup([5, 3], P=4)
    torch.library.opcheck(
        torch.ops.trace_ext.fp4kv_append.default,
        (*[t.clone() for t in cache.tensors()], k, v, table, cu, torch.zeros(2, dtype=torch.int32), cache.g_k, cache.g_v),
    )
    q = torch.randn(2, 4, 64).to(torch.bfloat16)
    torch.library.opcheck(
        torch.ops.trace_ext.fp4kv_decode_attention.default,
        (q, *cache.tensors(), table, seq_lens, 0.125, cache.g_k, cache.g_v, 0),
    )
