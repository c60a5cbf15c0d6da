"""CPU tests of the NVFP4 GEMM contract (SPEC 7): the float64 reference, the kernels' exact FP4 -> bf16 register
conversion (emulated bit for bit), the decode weight layout, the MoE routing helpers, SPEC 10 errors, and opcheck of
the compiled ops' schemas / fakes / CPU kernels when the extension is loaded."""
import pytest
import torch

import trace_ext.ops as O
from trace_ext import formats as F
from trace_ext import reference as ref
from trace_ext import reference_gemm as R
from trace_ext._loader import extension_loaded
from trace_ext.ops._backend import have_op
from trace_ext.tensor import NVFP4Tensor


def _weights(N, K, E=None, scale=1.0):
    shape = (E, N, K) if E else (N, K)
    x = torch.randn(shape) * scale
    return ref.nvfp4_quantize(x, scope="matrix" if E else "tensor")


# ---- reference semantics -----------------------------------------------------------------------------------


def test_reference_matches_dequantize_then_matmul():
    """Protects SPEC 7: Y = round_bf16(A @ dequant(W)^T) with W dequantized as fl(fl(q*s)*g) (exact in f64)."""
    w = _weights(48, 64)
    a = torch.randn(7, 64).bfloat16()
    y = O.fp4_linear(a, w, backend="reference")
    wd = R.dequantize_f64(w.codes, w.scales) * w.g.double()[:, None]
    want = R.round_to_bf16(a.double() @ wd.T)
    assert torch.equal(y, want)


def test_w4a4_reference_uses_per_row_activation_scale():
    """Protects W4A4: A dequantized per row with its own g_a; act_quant='nvfp4' equals quantizing first."""
    w = _weights(32, 128)
    a = torch.randn(5, 128).bfloat16() * torch.tensor([1, 10, 100, 0.01, 3.0]).bfloat16()[:, None]
    aq = ref.nvfp4_quantize(a)
    y = O.fp4_linear(aq, w, backend="reference")
    a64 = R.dequantize_f64(aq.codes, aq.scales, aq.g)
    want = R.round_to_bf16(a64 @ (R.dequantize_f64(w.codes, w.scales) * w.g.double()[:, None]).T)
    assert torch.equal(y, want)
    assert torch.equal(O.fp4_linear(a, w, act_quant="nvfp4", backend="reference"), y)


def test_round_to_bf16_is_single_rounding():
    """Protects the oracle: float64 -> bf16 rounds once (torch's cast double-rounds through float32)."""
    # 1 + 2^-8 + 2^-30: float32 rounding drops 2^-30 to a tie (1 + 2^-8), then RNE goes down to 1; the true
    # nearest bf16 is 1 + 2^-7.
    v = torch.tensor([1 + 2**-8 + 2**-30, -(1 + 2**-8 + 2**-30), 1 + 2**-8, 3.0, 0.0], dtype=torch.float64)
    out = R.round_to_bf16(v).double()
    assert out.tolist() == [1 + 2**-7, -(1 + 2**-7), 1.0, 3.0, 0.0]
    x = torch.randn(10000, dtype=torch.float64) * 1e3
    r = R.round_to_bf16(x).double()
    assert torch.all((r - x).abs() <= R.bf16_ulp(r) / 2 + 1e-300)


def test_grouped_reference_matches_per_expert_dense_and_empty_experts():
    """Protects the MoE form: rows of expert e use W[e]; empty experts (zero rows) are legal."""
    E, N, K = 4, 32, 64
    w = _weights(N, K, E)
    counts = [3, 0, 5, 0]
    offsets = torch.tensor([0, 3, 3, 8, 8], dtype=torch.int32)
    a = torch.randn(8, K).bfloat16()
    y = O.fp4_grouped_linear(a, w, offsets, backend="reference")
    for e in range(E):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if counts[e]:
            we = ref.NVFP4Tensor(w.codes[e], w.scales[e], w.g[e])
            assert torch.equal(y[lo:hi], O.fp4_linear(a[lo:hi], we, backend="reference"))


def test_nan_scale_block_poisons_outputs():
    """Protects SPEC 2 through the GEMM: a NaN block scale (non-finite weight block) gives NaN outputs."""
    w = _weights(16, 64)
    w.scales[3, 1] = F.E4M3_NAN
    y = O.fp4_linear(torch.randn(2, 64).bfloat16(), w, backend="reference")
    assert torch.isnan(y[:, 3]).all() and not torch.isnan(y[:, :3]).any()


# ---- kernel numerics emulated on the CPU ------------------------------------------------------------------------


def _biased_pair(byte: torch.Tensor) -> torch.Tensor:
    """fp4x2_to_bf16x2_biased of csrc/include/trace_ext/gemm_w4_common.cuh, in int64."""
    x = byte | (byte << 12)
    return ((x & 0x00080008) << 12) | ((x & 0x00070007) << 6)


def _bf16_bits_to_f64(bits: torch.Tensor) -> torch.Tensor:
    return (bits.to(torch.int32) << 16).view(torch.float32).double()


def test_kernel_fp4_to_bf16_bit_trick_is_exact_for_every_code_and_scale():
    """Protects the kernels' dequantization: bits(q) read as bf16 = q * 2^-126, times bf16(s * 2^119), times 2^7
    equals q * s exactly, for all 256 code bytes x all 256 E4M3 scale bytes (NaN scale -> NaN)."""
    b = torch.arange(256, dtype=torch.int64)
    r = _biased_pair(b)
    lo = _bf16_bits_to_f64(r & 0xFFFF)
    hi = _bf16_bits_to_f64((r >> 16) & 0xFFFF)
    codes = F.unpack_nibbles(b.to(torch.uint8)[:, None]).long()
    want_lo = F.e2m1_to_float(codes[:, 0]).double()
    want_hi = F.e2m1_to_float(codes[:, 1]).double()
    assert torch.equal(lo, want_lo * 2.0**-126) and torch.equal(hi, want_hi * 2.0**-126)
    s = F.e4m3_to_float(torch.arange(256, dtype=torch.int64).to(torch.uint8)).double()
    s_fold = (s * 2.0**119).to(torch.bfloat16).double()  # exact (s has <= 4 significant bits)
    finite = torch.isfinite(s)
    assert torch.equal(s_fold[finite], s[finite] * 2.0**119) and torch.isnan(s_fold[~finite]).all()
    prod = (lo[:, None] * s_fold[None, :]).to(torch.bfloat16).double()  # the bf16x2 multiply
    want = want_lo[:, None] * s[None, :] * 2.0**-7
    ok = torch.isfinite(s)[None, :].expand_as(prod)
    assert torch.equal(prod[ok], want[ok])
    assert torch.isnan(prod[~ok]).all()


def test_decode_word_extraction_recovers_every_pair():
    """Protects the decode kernel's FP4 -> bf16 extraction from the re-encoded words: for random bytes, pair j of
    the word (shift/AND as in gemm_w4_decode_sm90.cu) equals the linear pair (elements 2j, 2j+1)."""
    b = torch.randint(0, 256, (4096, 4), dtype=torch.uint8)
    w = R.encode_decode_word(b)
    pairs = R.decode_word_pairs(w)
    for j in range(4):
        want = _biased_pair(b[:, j].long())  # byte j holds elements 2j (low nibble) and 2j + 1
        assert torch.equal(pairs[j], want), j


def test_decode_layout_is_a_permutation_that_the_kernel_indexing_inverts():
    """Protects prepare_fp4_weight: the packed bytes hold every code and scale once, where the decode kernel
    (lane = 4g + t, 16 code bytes per k64 step, 8 scale bytes per 256 K) looks for them."""
    E, N, K = 2, 32, 512
    codes = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8)
    scales = torch.randint(0, 256, (E, N, K // 16), dtype=torch.uint8)
    packed = R.to_decode_layout(codes, scales)
    assert packed.shape == (E, N * K // 2 + N * K // 16)
    tile = 16 * 256 // 2 + 16 * 256 // 16
    for e in range(E):
        for nb in range(N // 16):
            for kb in range(K // 256):
                base = (nb * (K // 256) + kb) * tile
                for lane in (0, 5, 31):
                    g, t = lane // 4, lane % 4
                    for kt in range(4):
                        v = packed[e, base + kt * 512 + lane * 16 : base + kt * 512 + lane * 16 + 16]
                        c0 = kb * 128 + kt * 32 + t * 8
                        for half, row in ((0, nb * 16 + g), (1, nb * 16 + g + 8)):
                            for wi in range(2):
                                got = v[half * 8 + wi * 4 : half * 8 + wi * 4 + 4].long()
                                word = int((got << torch.arange(0, 32, 8)).sum())
                                lin = codes[e, row, c0 + wi * 4 : c0 + wi * 4 + 4]
                                assert word == int(R.encode_decode_word(lin[None])[0])
                        sv = packed[e, base + 2048 + lane * 8 + 2 * kt : base + 2048 + lane * 8 + 2 * kt + 2]
                        blk = kb * 16 + kt * 4 + t
                        assert int(sv[0]) == int(scales[e, nb * 16 + g, blk])
                        assert int(sv[1]) == int(scales[e, nb * 16 + g + 8, blk])


def test_prepare_keeps_linear_weight_and_is_usable():
    """Protects prepare_fp4_weight: the prepared weight gives the same results as the raw one."""
    w = _weights(32, 256)
    p = O.prepare_fp4_weight(w)
    assert p.packed is not None and p.prepare_ms >= 0
    a = torch.randn(3, 256).bfloat16()
    assert torch.equal(O.fp4_linear(a, p, backend="reference"), O.fp4_linear(a, w, backend="reference"))
    assert O.prepare_fp4_weight(_weights(24, 48)).packed is None  # shape outside the decode layout


# ---- routing ---------------------------------------------------------------------------------------------------------


def test_moe_permute_is_stable_sort_by_expert():
    """Protects routing: sorted rows grouped by expert, ties in (token, slot) order, offsets = counts prefix."""
    T, k, E, H = 9, 3, 5, 8
    x = torch.randn(T, H).bfloat16()
    ids = torch.randint(0, E, (T, k))
    ids[0] = torch.tensor([4, 4, 4])  # duplicates within a token keep slot order
    p = O.moe_permute(x, ids, E, backend="reference")
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    assert torch.equal(p.dest_of[order].long(), torch.arange(T * k))
    assert torch.equal(p.src_row.long(), order // k)
    assert torch.equal(p.x_sorted, x[order // k])
    counts = torch.bincount(flat, minlength=E)
    assert p.offsets.tolist() == [0] + torch.cumsum(counts, 0).tolist()


def test_moe_unpermute_weights_in_slot_order_fp32():
    """Protects un-permute: out[t] = fl(... fl(fl(w0*y0) + fl(w1*y1)) ...) in slot order, back in y's dtype."""
    T, k, E, H = 6, 2, 3, 16
    x = torch.randn(T, H).bfloat16()
    ids = torch.randint(0, E, (T, k))
    w = torch.rand(T, k)
    p = O.moe_permute(x, ids, E, backend="reference")
    out = O.moe_unpermute(p.x_sorted, p, w, backend="reference")
    want = torch.zeros(T, H)
    for j in range(k):
        want = want + w[:, j : j + 1] * x.float()
    assert torch.equal(out, want.bfloat16())


def test_moe_unpermute_checks_dest_of_values_on_cpu():
    """Protects SPEC 10 for un-permute: dest_of values outside [-1, T*k) raise ValueError naming dest_of (CPU tensors
    are always checked); -1 is a dropped pair."""
    T, k, H = 4, 2, 8
    y = torch.randn(T * k, H)
    w = torch.rand(T, k)
    ok = torch.arange(T * k, dtype=torch.int32)
    ok[3] = -1
    O.moe_unpermute(y, ok, w)
    for bad in (T * k, -2):
        d = ok.clone()
        d[0] = bad
        with pytest.raises(ValueError, match="dest_of"):
            O.moe_unpermute(y, d, w)


def test_end_to_end_moe_layer_reference():
    """Protects the composition permute -> grouped GEMM -> unpermute against a per-token loop."""
    T, k, E, N, K = 5, 2, 4, 16, 64
    x = torch.randn(T, K).bfloat16()
    ids = torch.randint(0, E, (T, k))
    wts = torch.rand(T, k)
    w = _weights(N, K, E)
    p = O.moe_permute(x, ids, E, backend="reference")
    y = O.fp4_grouped_linear(p.x_sorted, w, p.offsets, backend="reference")
    out = O.moe_unpermute(y, p, wts, backend="reference")
    for t in range(T):
        acc = torch.zeros(N)
        for j in range(k):
            e = int(ids[t, j])
            we = ref.NVFP4Tensor(w.codes[e], w.scales[e], w.g[e])
            acc = acc + wts[t, j] * O.fp4_linear(x[t : t + 1], we, backend="reference")[0].float()
        assert torch.equal(out[t], acc.bfloat16())


# ---- errors (SPEC 10) -------------------------------------------------------------------------------------------------


def test_errors():
    """Protects SPEC 10: wrong dtype TypeError, wrong shape / bad offsets ValueError."""
    w = _weights(16, 64)
    with pytest.raises(TypeError):
        O.fp4_linear(torch.randn(2, 64), w)  # float32 A
    with pytest.raises(ValueError):
        O.fp4_linear(torch.randn(2, 48).bfloat16(), w)  # K mismatch
    with pytest.raises(TypeError):
        O.fp4_linear(torch.randn(2, 64).bfloat16(), (w.codes.int(), w.scales, w.g))
    with pytest.raises(ValueError):
        O.fp4_linear(torch.randn(2, 64).bfloat16(), (w.codes, w.scales[:, :2], w.g))
    with pytest.raises(ValueError):
        O.fp4_linear(torch.randn(2, 64).bfloat16(), (w.codes, w.scales, torch.ones(3)))
    with pytest.raises(ValueError):
        O.fp4_linear(torch.randn(2, 64).bfloat16(), w, act_quant="mxfp4")
    wg = _weights(16, 64, 3)
    a = torch.randn(4, 64).bfloat16()
    with pytest.raises(TypeError):
        O.fp4_grouped_linear(a, wg, torch.tensor([0, 1, 2, 4]))  # int64 offsets
    with pytest.raises(ValueError):
        O.fp4_grouped_linear(a, wg, torch.tensor([0, 1, 4], dtype=torch.int32))  # wrong length
    with pytest.raises(ValueError):
        O.fp4_grouped_linear(a, wg, torch.tensor([0, 3, 1, 4], dtype=torch.int32))  # decreasing
    with pytest.raises(ValueError):
        O.fp4_grouped_linear(a, wg, torch.tensor([0, 1, 2, 3], dtype=torch.int32))  # does not end at M
    with pytest.raises(ValueError):
        O.moe_permute(a, torch.tensor([[0], [1], [5], [2]]), 3)  # id out of range
    with pytest.raises(TypeError):
        O.moe_permute(a, torch.zeros(4, 1), 3)
    with pytest.raises(ValueError):
        O.fp4_linear(a, w, backend="nope")
    # an NVFP4 activation whose parts disagree with its shape: ValueError naming the part (was torch's reshape error)
    a4 = ref.nvfp4_quantize(a)
    with pytest.raises(ValueError, match="codes must have shape"):
        O.fp4_linear(NVFP4Tensor(a4.codes[:3], a4.scales, a4.g, a4.shape), w)
    with pytest.raises(ValueError, match="g must have one value per row"):
        O.fp4_linear(NVFP4Tensor(a4.codes, a4.scales, a4.g[:2], a4.shape), w)


def test_empty_inputs_give_empty_results():
    """Protects SPEC 10: M = 0 gives [0, N]; grouped with all experts empty too."""
    w = _weights(16, 64)
    assert O.fp4_linear(torch.empty(0, 64, dtype=torch.bfloat16), w).shape == (0, 16)
    wg = _weights(16, 64, 2)
    y = O.fp4_grouped_linear(torch.empty(0, 64, dtype=torch.bfloat16), wg, torch.zeros(3, dtype=torch.int32))
    assert y.shape == (0, 16)


# ---- compiled op schemas ------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not (extension_loaded() and have_op("fp4_linear")), reason="compiled extension not loaded")
def test_opcheck_gemm_and_routing_ops():
    """Protects torch.compile / dispatcher integration: schemas, fakes and CPU kernels agree (opcheck)."""
    w = _weights(16, 64)
    a = torch.randn(3, 64).bfloat16()
    aq = ref.nvfp4_quantize(a)
    ops = torch.ops.trace_ext
    torch.library.opcheck(ops.fp4_linear, (a, None, None, w.codes, w.scales, w.g[:1].contiguous(), None))
    torch.library.opcheck(ops.fp4_linear, (aq.codes, aq.scales, aq.g, w.codes, w.scales, w.g[:1].contiguous(), None))
    wg = _weights(16, 64, 2)
    off = torch.tensor([0, 1, 3], dtype=torch.int32)
    torch.library.opcheck(ops.fp4_grouped_linear, (a, None, None, wg.codes, wg.scales, wg.g[:, 0].contiguous(), off, None))
    ids = torch.randint(0, 4, (3, 2), dtype=torch.int32)
    torch.library.opcheck(ops.moe_permute, (a, ids, 4))
    p = R.moe_permute(a, ids, 4)
    torch.library.opcheck(ops.moe_unpermute, (p[0], p[2], torch.rand(3, 2)))
