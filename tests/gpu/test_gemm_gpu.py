"""GPU tests of the sm_90a NVFP4 GEMM kernels and MoE routing against the float64 reference (SPEC 7).

Acceptance per output: |y - ref| <= 1 bf16 ulp of ref + sqrt(K) * 2^-24 * sum_k |a_k w_k| (the probabilistic
float32-accumulation bound; without it, outputs that cancel to ~0 cannot be held to an ulp of themselves by any
fp32-accumulating kernel). Each test also reports the fraction of outputs equal to the reference bit for bit.
Shapes: Qwen3-30B-A3B experts, OLMoE, Mixtral, DeepSeek-V3; M from 1 to 16384 incl. odd M.
Run: pytest tests/gpu/test_gemm_gpu.py -q (H200, < 3 minutes).
"""
import os

import pytest
import torch

import trace_ext.ops as O
from trace_ext import reference as ref
from trace_ext import reference_gemm as R
from trace_ext.tensor import NVFP4Tensor

pytestmark = pytest.mark.gpu
DEV = "cuda"

# (name, N, K) of real projections
QWEN_GATE_UP = ("qwen3_30b_a3b.gate_up", 1536, 2048)
QWEN_DOWN = ("qwen3_30b_a3b.down", 2048, 768)
OLMOE_GATE_UP = ("olmoe.gate_up", 2048, 2048)
OLMOE_DOWN = ("olmoe.down", 2048, 1024)
MIXTRAL_UP = ("mixtral.w1", 14336, 4096)
MIXTRAL_DOWN = ("mixtral.w2", 4096, 14336)
DSV3_GATE_UP = ("deepseek_v3.gate_up", 4096, 7168)
DSV3_DOWN = ("deepseek_v3.down", 7168, 2048)


def _quant_w(N, K, E=None):
    """Random NVFP4 weight: every code byte and every finite E4M3 scale byte (0x00..0x7E) uniformly, g_w per matrix
    ([1] dense, [E] grouped). Covers all values, and needs no float copy of the weight (DeepSeek E=256)."""
    lead = (E, N) if E else (N,)
    codes = torch.randint(0, 256, (*lead, K // 2), device=DEV, dtype=torch.uint8)
    scales = torch.randint(0, 0x7F, (*lead, K // 16), device=DEV, dtype=torch.uint8)
    g = torch.rand(E if E else 1, device=DEV) * 1e-3 + 1e-4
    return NVFP4Tensor(codes, scales, g, shape=(*lead, K))


def _quantized_w(N, K):
    """A weight from the real quantizer (RTN, per-tensor g), for the tests of the end-to-end numbers."""
    return ref.nvfp4_quantize(torch.randn(N, K, device=DEV) * 0.02, scope="tensor")


def _check(y, a64, w64, what):
    exact = a64 @ w64.T
    ref_bf16 = R.round_to_bf16(exact)
    tol = R.gemm_tolerance(a64, w64, ref_bf16)
    err = (y.double() - ref_bf16.double()).abs()
    bad = ~(err <= tol)
    both_nan = torch.isnan(y.double()) & torch.isnan(ref_bf16.double())
    bad &= ~both_nan
    n_bad = int(bad.sum())
    equal = float((y == ref_bf16).double().mean()) if y.numel() else 1.0
    print(f"{what}: {y.numel()} outputs, bit-equal {equal:.4f}, violations {n_bad}")
    if n_bad:
        idx = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: {n_bad} outputs off; first at {idx}: y={float(y[tuple(idx)])} ref={float(ref_bf16[tuple(idx)])} "
            f"tol={float(tol[tuple(idx)])}"
        )


def _w64(w: NVFP4Tensor, e: int | None = None):
    """float64 dequantized weight (of expert e for a grouped weight); g per matrix / expert or per channel."""
    if e is None:
        codes, scales, g = w.codes, w.scales, w.g
    else:  # g [E] or [E, N]
        codes, scales, g = w.codes[e], w.scales[e], w.g.reshape(w.codes.shape[0], -1)[e]
    g = g.double().reshape(-1)
    return R.dequantize_f64(codes, scales) * (g[:, None] if g.numel() > 1 else g)


def _a64(a):
    if isinstance(a, NVFP4Tensor):
        return R.dequantize_f64(a.codes, a.scales) * a.g.double()[:, None]
    return a.double()


def _offsets(counts):
    """Grouped offsets [E + 1] (int32, on the GPU) of per-expert row counts."""
    counts = torch.as_tensor(counts, dtype=torch.int64)
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(counts, 0).to(torch.int32)
    return offsets.to(DEV)


def _check_experts(y, a, w, offsets, what):
    """Every expert's rows of a grouped output within the f64 contract of _check."""
    a64 = _a64(a)
    off = offsets.tolist()
    for e in range(len(off) - 1):
        lo, hi = off[e], off[e + 1]
        if hi > lo:
            _check(y[lo:hi], a64[lo:hi], _w64(w, e), f"{what} expert {e}")


DENSE_CASES = [
    (QWEN_GATE_UP, [1, 2, 3, 8, 16, 17, 32, 33, 64, 100, 257, 1024, 4096]),
    (QWEN_DOWN, [1, 7, 16, 31, 128, 1000]),
    (OLMOE_DOWN, [1, 16, 333]),
    (MIXTRAL_UP, [1, 8, 16, 32, 129]),
    (MIXTRAL_DOWN, [1, 16, 32, 65, 1000, 4097]),
    (DSV3_GATE_UP, [1, 13, 32, 2048]),
    (DSV3_DOWN, [1, 16, 300]),
]


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("shape,Ms", DENSE_CASES, ids=[c[0][0] for c in DENSE_CASES])
def test_dense_matches_f64_reference(shape, Ms, mode):
    """Protects fp4_linear (tiled and decode paths, raw and prepared weights) at real shapes and odd M."""
    name, N, K = shape
    w = _quant_w(N, K)
    wp = O.prepare_fp4_weight(w)
    w64 = _w64(w)
    for M in Ms:
        a = torch.randn(M, K, device=DEV).bfloat16()
        if mode == "w4a4":
            a = ref.nvfp4_quantize(a)
        a64 = _a64(a)
        for wt, tag in ((w, "raw"), (wp, "prepared")):
            y = O.fp4_linear(a, wt, backend="cuda")
            assert y.shape == (M, N) and y.dtype == torch.bfloat16
            _check(y, a64, w64, f"{name} {mode} M={M} {tag}")


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_dense_large_m_16384(mode):
    """Protects the large-M (wgmma) path at M = 16384 on the Mixtral w1 shape."""
    _, N, K = MIXTRAL_UP
    M = 16384
    w = _quant_w(N, K)
    a = torch.randn(M, K, device=DEV).bfloat16()
    if mode == "w4a4":
        a = ref.nvfp4_quantize(a)
    y = O.fp4_linear(a, w, backend="cuda")
    _check(y, _a64(a), _w64(w), f"large-M {mode} M={M}")


def test_w4a4_act_quant_prologue_equals_prequantized():
    """Protects act_quant='nvfp4': the same as quantizing A (RTN, per-row g) then the W4A4 GEMM."""
    name, N, K = QWEN_GATE_UP
    w = _quantized_w(N, K)
    a = torch.randn(37, K, device=DEV).bfloat16()
    y1 = O.fp4_linear(a, w, act_quant="nvfp4", backend="cuda")
    y2 = O.fp4_linear(ref.nvfp4_quantize(a), w, backend="cuda")
    assert torch.equal(y1, y2)


def _grouped_case(E, N, K, counts, mode, w=None, prepared=False, what=""):
    assert len(counts) == E
    M = int(sum(counts))
    offsets = _offsets(counts)
    w = w if w is not None else _quant_w(N, K, E)
    a = torch.randn(M, K, device=DEV).bfloat16()
    if mode == "w4a4":
        a = ref.nvfp4_quantize(a)
    wt = O.prepare_fp4_weight(w) if prepared else w
    y = O.fp4_grouped_linear(a, wt, offsets, backend="cuda")
    assert y.shape == (M, N)
    _check_experts(y, a, w, offsets, what)
    return w


def _routed_counts(T, E, k, gen):
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
    return torch.bincount(ids.reshape(-1), minlength=E).tolist()


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_grouped_qwen3_experts_token_batches(mode):
    """Protects fp4_grouped_linear at Qwen3-30B-A3B (E=128, top-8) decode and prefill batches (decode kernel,
    tiled kernel, wgmma kernel at T=4096), raw and prepared weights (empty experts occur at every T < 16)."""
    gen = torch.Generator().manual_seed(1)
    E, k = 128, 8
    w_gu = _quant_w(1536, 2048, E)
    w_dn = _quant_w(2048, 768, E)
    for T in (1, 3, 16, 64, 256, 1000, 4096):
        counts = _routed_counts(T, E, k, gen)
        for name, (N, K), w in (("gate_up", (1536, 2048), w_gu), ("down", (2048, 768), w_dn)):
            if T == 4096 and name == "down":
                continue  # one prefill projection is enough for the grouped wgmma path (256 rows per expert)
            for prepared in (False, True):
                _grouped_case(E, N, K, counts, mode, w=w, prepared=prepared, what=f"qwen3 {name} {mode} T={T} prep={prepared}")


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_grouped_olmoe_and_deepseek(mode):
    """Protects the grouped op at OLMoE (E=64) and DeepSeek-V3 (E=256, N=7168 down) expert shapes."""
    gen = torch.Generator().manual_seed(2)
    _grouped_case(64, 2048, 1024, _routed_counts(40, 64, 8, gen), mode, what=f"olmoe down {mode}")
    _grouped_case(256, 7168, 2048, _routed_counts(4, 256, 8, gen), mode, prepared=True, what=f"dsv3 down {mode}")


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_grouped_all_tokens_on_one_expert_and_empty(mode):
    """Protects the edge distributions: every row on one (middle / last) expert, raw and prepared weights (prepared
    small M runs the decode kernel, whose experts with more rows than one 8/16/32-row chunk become several units);
    all experts empty."""
    E, N, K = 16, 1536, 2048
    w = _quant_w(N, K, E)
    for M, e in ((1, 7), (9, 3), (40, 7), (300, 7), (4096, 15), (33, 0)):
        counts = [0] * E
        counts[e] = M
        for prepared in (False, True):
            what = f"one-expert {mode} M={M} e={e} prep={prepared}"
            _grouped_case(E, N, K, counts, mode, w=w, prepared=prepared, what=what)
    offsets = torch.zeros(E + 1, dtype=torch.int32, device=DEV)
    y = O.fp4_grouped_linear(torch.empty(0, K, device=DEV, dtype=torch.bfloat16), w, offsets, backend="cuda")
    assert y.shape == (0, N)


def test_nan_block_propagates():
    """Protects SPEC 2 through the kernels: a NaN weight block makes its output column NaN, others stay finite."""
    N, K = 256, 2048
    w = _quantized_w(N, K)
    w.scales[5, 3] = 0x7F
    for M in (1, 8, 200):
        a = torch.randn(M, K, device=DEV).bfloat16()
        for wt in (w, O.prepare_fp4_weight(w)):
            y = O.fp4_linear(a, wt, backend="cuda")
            assert torch.isnan(y[:, 5]).all() and torch.isfinite(y[:, :5]).all() and torch.isfinite(y[:, 6:]).all()


def test_k_not_multiple_of_64():
    """Protects the unaligned-K loaders (K % 16 == 0 only, as SPEC allows): K = 272 and 80."""
    for N, K in ((48, 272), (130, 80)):
        w = _quant_w(N, K)
        for M in (1, 5, 70, 130):
            a = torch.randn(M, K, device=DEV).bfloat16()
            _check(O.fp4_linear(a, w, backend="cuda"), a.double(), _w64(w), f"K={K} M={M} w4a16")
            aq = ref.nvfp4_quantize(a)
            _check(O.fp4_linear(aq, w, backend="cuda"), _a64(aq), _w64(w), f"K={K} M={M} w4a4")


def test_tile_edges_every_path():
    """Protects the row / column edges of each kernel: N not a multiple of any tile (200, 48), M just past the
    decode / tiled / wgmma thresholds, prepared and raw weights."""
    for N, K in ((200, 256), (48, 512)):
        w = _quant_w(N, K)
        wp = O.prepare_fp4_weight(w)
        for M in (1, 31, 33, 255, 256, 257, 513):
            a = torch.randn(M, K, device=DEV).bfloat16()
            aq = ref.nvfp4_quantize(a)
            for wt in (w, wp):
                _check(O.fp4_linear(a, wt, backend="cuda"), a.double(), _w64(w), f"edge N={N} K={K} M={M} w4a16")
                _check(O.fp4_linear(aq, wt, backend="cuda"), _a64(aq), _w64(w), f"edge N={N} K={K} M={M} w4a4")


def test_results_are_deterministic():
    """Protects the fixed summation orders (split-K partials added in split order, K-split warps in warp order):
    the same call twice gives the same bits on every path (decode dense / grouped, tiled, wgmma)."""
    w = _quant_w(4096, 14336)
    wp = O.prepare_fp4_weight(w)
    for M in (1, 16, 32, 100, 512):
        a = torch.randn(M, 14336, device=DEV).bfloat16()
        assert torch.equal(O.fp4_linear(a, wp, backend="cuda"), O.fp4_linear(a, wp, backend="cuda")), M
    E = 128
    wg = O.prepare_fp4_weight(_quant_w(1536, 2048, E))
    gen = torch.Generator().manual_seed(3)
    for T in (1, 16, 64):
        offsets = _offsets(_routed_counts(T, E, 8, gen))
        a = torch.randn(T * 8, 2048, device=DEV).bfloat16()
        y1 = O.fp4_grouped_linear(a, wg, offsets, backend="cuda")
        assert torch.equal(y1, O.fp4_grouped_linear(a, wg, offsets, backend="cuda")), T


# ---- large-M scheduler: data-parallel grid vs stream-K (TRACE_EXT_WGMMA_SCHED / TRACE_EXT_WGMMA_SK_CTAS) ---------

# (N, K, M, stream-K CTAs; 0: one per SM), all with a partial last wave of the data-parallel grid (tiles of 128
# weight rows x 256 activation rows, KT = K / 64 k steps per tile) and split tiles under stream-K:
SK_CASES = [
    (136, 192, 257, 3),     # 2 x 2 tiles, KT 3, 4 steps per CTA: the middle CTA has a tail and a head, no whole tile
    (200, 320, 513, 5),     # 2 x 3 tiles, KT 5 (odd: the peeled step), N and M not tile multiples
    (1000, 1024, 777, 7),   # 8 x 4 tiles, KT 16, 73-74 steps per CTA (heads / tails of every length parity)
    (4096, 14336, 300, 3),  # Mixtral w2, 32 x 2 tiles, KT 224: long ranges, 44 rows in the last activation tile
    (1536, 2048, 4096, 0),  # Qwen3 gate_up: 12 x 16 tiles on every SM (auto picks stream-K: 192 tiles, 1.45 waves)
    (14336, 4096, 1024, 0),  # Mixtral w1 at M = 1024, the benchmark row stream-K is for (448 tiles, 3.39 waves)
]


def _sched(monkeypatch, sched, ctas=0):
    monkeypatch.setenv("TRACE_EXT_WGMMA_SCHED", sched)
    if ctas:
        monkeypatch.setenv("TRACE_EXT_WGMMA_SK_CTAS", str(ctas))
    else:
        monkeypatch.delenv("TRACE_EXT_WGMMA_SK_CTAS", raising=False)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("N,K,M,ctas", SK_CASES, ids=[f"N{c[0]}_K{c[1]}_M{c[2]}_ctas{c[3]}" for c in SK_CASES])
def test_wgmma_stream_k_equals_data_parallel(monkeypatch, N, K, M, ctas, mode):
    """Protects the stream-K schedule of the large-M kernel (accumulators handed between CTAs, ring and barriers
    reset per job): bit-identical to the one-CTA-per-tile grid (the fp32 accumulation order is the same), within the
    f64 contract, repeatable (flags reset per call), and also from a CUDA graph replayed twice."""
    w = _quant_w(N, K)
    a = torch.randn(M, K, device=DEV).bfloat16()
    if mode == "w4a4":
        a = ref.nvfp4_quantize(a)
    _sched(monkeypatch, "dp")
    y_dp = O.fp4_linear(a, w, backend="cuda")
    _sched(monkeypatch, "streamk", ctas)
    y_sk = O.fp4_linear(a, w, backend="cuda")
    _check(y_sk, _a64(a), _w64(w), f"stream-K N={N} K={K} M={M} ctas={ctas} {mode}")
    assert torch.equal(y_sk, y_dp), "stream-K differs from the data-parallel grid"
    assert torch.equal(O.fp4_linear(a, w, backend="cuda"), y_dp), "second stream-K call differs"
    if N <= 1000:
        O.fp4_linear(a, w, backend="cuda")  # warm-up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_g = O.fp4_linear(a, w, backend="cuda")
        for _ in range(2):
            y_g.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y_g, y_dp), "stream-K replayed from a CUDA graph differs"


def test_wgmma_scheduler_switch_and_grouped(monkeypatch):
    """Protects the scheduler switch: auto equals both forced schedules on a shape where the rule picks stream-K;
    the grouped op ignores 'streamk' (data-parallel only); an unknown value is a RuntimeError."""
    N, K, M = 7168, 4096, 1024  # 56 x 4 = 224 tiles: 1.70 waves on 132 SMs
    w = _quant_w(N, K)
    a = torch.randn(M, K, device=DEV).bfloat16()
    ys = {}
    for s in ("auto", "dp", "streamk"):
        _sched(monkeypatch, s)
        ys[s] = O.fp4_linear(a, w, backend="cuda")
    assert torch.equal(ys["auto"], ys["dp"]) and torch.equal(ys["streamk"], ys["dp"])
    E = 4
    wg = _quant_w(1536, 2048, E)
    offsets = torch.tensor([0, 300, 300, 811, 1100], dtype=torch.int32, device=DEV)
    ag = torch.randn(1100, 2048, device=DEV).bfloat16()
    _sched(monkeypatch, "dp")
    yg = O.fp4_grouped_linear(ag, wg, offsets, backend="cuda")
    _sched(monkeypatch, "streamk", 3)
    assert torch.equal(O.fp4_grouped_linear(ag, wg, offsets, backend="cuda"), yg)
    if os.environ.get("TRACE_EXT_WGMMA_IMPL") != "old":  # the shared-memory-operand fallback has one schedule
        monkeypatch.setenv("TRACE_EXT_WGMMA_SCHED", "bogus")
        with pytest.raises(RuntimeError, match="TRACE_EXT_WGMMA_SCHED"):
            O.fp4_linear(a, w, backend="cuda")


# ---- routing -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,k,E", [(1, 8, 128), (7, 8, 128), (256, 8, 128), (4096, 8, 128), (300, 8, 256), (50, 2, 8)])
def test_moe_permute_unpermute_match_reference(T, k, E):
    """Protects the routing kernels: bit-identical to the stable-sort reference and the slot-order fp32 sum."""
    H = 2048
    x = torch.randn(T, H, device=DEV).bfloat16()
    scores = torch.randn(T, E, device=DEV)
    wts, ids = torch.topk(torch.softmax(scores, -1), k, dim=-1)
    p = O.moe_permute(x, ids, E, backend="cuda")
    q = O.moe_permute(x, ids, E, backend="reference")
    assert torch.equal(p.offsets, q.offsets) and torch.equal(p.dest_of, q.dest_of)
    assert torch.equal(p.src_row, q.src_row) and torch.equal(p.x_sorted, q.x_sorted)
    out = O.moe_unpermute(p.x_sorted, p, wts, backend="cuda")
    assert torch.equal(out, O.moe_unpermute(q.x_sorted, q, wts, backend="reference"))
    ids32 = ids.int()
    assert torch.equal(O.moe_permute(x, ids32, E, backend="cuda").dest_of, p.dest_of)


def test_moe_unpermute_drops_unchecked_out_of_range_rows():
    """Protects the un-permute kernel against dest_of values past y_sorted (validate=False on CUDA): they are dropped
    like -1, as the reference does, instead of read out of bounds; validate=True raises ValueError."""
    T, k, H = 300, 4, 96
    y = torch.randn(T * k, H, device=DEV).bfloat16()
    wts = torch.rand(T, k, device=DEV)
    dest = torch.randperm(T * k, device=DEV).int()
    dest[::7] = -1
    dest[3::11] = T * k + 5
    dest[5::13] = 1 << 30
    out = O.moe_unpermute(y, dest, wts, backend="cuda")
    assert torch.equal(out, O.moe_unpermute(y, dest, wts, backend="reference"))
    with pytest.raises(ValueError, match="dest_of"):
        O.moe_unpermute(y, dest, wts, validate=True, backend="cuda")


def test_moe_layer_end_to_end_on_gpu():
    """Protects permute -> grouped W4A16 GEMM -> unpermute on the GPU against the same chain on the reference."""
    T, k, E, N, K = 64, 8, 128, 1536, 2048
    x = torch.randn(T, K, device=DEV).bfloat16()
    wts, ids = torch.topk(torch.softmax(torch.randn(T, E, device=DEV), -1), k, dim=-1)
    w = _quant_w(N, K, E)
    p = O.moe_permute(x, ids, E, backend="cuda")
    y = O.fp4_grouped_linear(p.x_sorted, w, p.offsets, backend="cuda")
    y_ref = O.fp4_grouped_linear(p.x_sorted, w, p.offsets, backend="reference")
    _check_experts(y, p.x_sorted, w, p.offsets, "e2e")
    assert y_ref.shape == y.shape
    out = O.moe_unpermute(y, p, wts, backend="cuda")
    assert out.shape == (T, N) and torch.isfinite(out).all()


# ---- errors ----------------------------------------------------------------------------------------------------------


def test_gpu_errors():
    """Protects SPEC 10 on the CUDA path: device mismatch RuntimeError, dtype TypeError, shape ValueError (raised
    by the C++ entry too, when called directly)."""
    w = _quant_w(64, 128)
    a = torch.randn(4, 128, device=DEV).bfloat16()
    with pytest.raises(RuntimeError):
        O.fp4_linear(a.cpu(), w, backend="cuda")
    ops = torch.ops.trace_ext
    g = w.g[:1].contiguous()
    with pytest.raises(TypeError):
        ops.fp4_linear(a.float(), None, None, w.codes, w.scales, g, None)
    with pytest.raises(ValueError):
        ops.fp4_linear(a[:, :64].contiguous(), None, None, w.codes, w.scales, g, None)
    with pytest.raises(ValueError):
        ops.fp4_linear(a, None, None, w.codes, w.scales[:, :4].contiguous(), g, None)
    with pytest.raises(RuntimeError):
        ops.fp4_linear(a, None, None, w.codes.cpu(), w.scales, g, None)
    wg = _quant_w(64, 128, 2)
    with pytest.raises(ValueError):
        ops.fp4_grouped_linear(a, None, None, wg.codes, wg.scales, wg.g.contiguous(),
                               torch.zeros(2, dtype=torch.int32, device=DEV), None)
    with pytest.raises(TypeError):
        ops.fp4_grouped_linear(a, None, None, wg.codes, wg.scales, wg.g.contiguous(),
                               torch.zeros(3, dtype=torch.int64, device=DEV), None)
    with pytest.raises(ValueError):
        O.fp4_grouped_linear(a, wg, torch.tensor([0, 5, 4], dtype=torch.int32, device=DEV), validate=True)
    qa = O.nvfp4_quantize(a)
    with pytest.raises(ValueError, match="g_a"):  # W4A4 activations without their per-row g
        ops.fp4_linear(qa.codes, qa.scales, None, w.codes, w.scales, g, None)


def test_grouped_decode_kernels_stay_in_bounds_on_unchecked_offsets(monkeypatch):
    """Protects the grouped decode kernels' bound on work units (validate=False skips the offsets' value check):
    offsets that fall and rise again give every expert all M rows, more units than the host sized the tickets for;
    the K-slab and stream kernels both cap the units at that bound, so the call finishes without a CUDA error and
    the stream stays usable (the result of such offsets is undefined)."""
    E, N, K, M = 16, 2048, 768, 64  # even experts get all 64 rows: 4-8 units each, the bound is 21-25
    wp = O.prepare_fp4_weight(_quant_w(N, K, E))
    a = torch.randn(M, K, device=DEV).bfloat16()
    bad = torch.tensor([0, M] * (E // 2) + [M], dtype=torch.int32, device=DEV)
    for impl in ("stream", None):
        _impl(monkeypatch, impl)
        y = O.fp4_grouped_linear(a, wp, bad, backend="cuda")
        torch.cuda.synchronize()
        assert y.shape == (M, N)
    good = _offsets([M // E + (e < M % E) for e in range(E)])
    ok = O.fp4_grouped_linear(a, wp, good, backend="cuda")
    assert torch.equal(ok, O.fp4_grouped_linear(a, wp, good, backend="cuda"))


# ---- dense decode: opt-in pair-stream kernel (TRACE_EXT_DECODE_IMPL=pair, read at every call) ------------------

# (N, K): the three dense decode shapes of the benchmark, the real projections above that the decode layout takes,
# and small ones where one 32-row group is split over several warps (few items: the shared-group tickets and the
# partial sums of every split position) or where N % 32 != 0 (the default kernel runs instead)
PAIR_SHAPES = [
    (14336, 4096), (4096, 14336), (7168, 4096),
    (1536, 2048), (2048, 768), (2048, 1024), (4096, 7168), (7168, 2048),
    (32, 256), (64, 1024), (96, 2304), (48, 512),
]
PAIR_MS = [1, 2, 3, 7, 8, 9, 13, 16, 17, 24, 31, 32]
PAIR_IMPLS = ("pair", "pair2")  # 3 CTAs per SM / 2 CTAs per SM with activation prefetch (<= 8 rows)


def _impl(monkeypatch, impl):
    if impl is None:
        monkeypatch.delenv("TRACE_EXT_DECODE_IMPL", raising=False)
    else:
        monkeypatch.setenv("TRACE_EXT_DECODE_IMPL", impl)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("N,K", PAIR_SHAPES, ids=[f"N{n}_K{k}" for n, k in PAIR_SHAPES])
def test_decode_pair_kernel_matches_f64_reference(monkeypatch, N, K, mode):
    """Protects the pair-stream decode kernels (pair, pair2): every dense decode shape of the benchmark and the real projections,
    M = 1..32 incl. odd M (8 / 16 / 32-row configurations and their zero-padded rows), within the f64 contract;
    same shape and dtype as the default kernel; repeatable bits (tickets self-reset, fixed reduction order), also
    when calls of the default kernel on the same stream come in between."""
    w = _quant_w(N, K)
    wp = O.prepare_fp4_weight(w)
    w64 = _w64(w)
    for M in PAIR_MS:
        a = torch.randn(M, K, device=DEV).bfloat16()
        if mode == "w4a4":
            a = ref.nvfp4_quantize(a)
        a64 = _a64(a)
        _impl(monkeypatch, None)
        y0 = O.fp4_linear(a, wp, backend="cuda")
        for impl in PAIR_IMPLS:
            _impl(monkeypatch, impl)
            y1 = O.fp4_linear(a, wp, backend="cuda")
            assert y1.shape == y0.shape == (M, N) and y1.dtype == y0.dtype == torch.bfloat16
            _check(y1, a64, w64, f"{impl} N={N} K={K} M={M} {mode}")
            _impl(monkeypatch, None)
            O.fp4_linear(a, wp, backend="cuda")
            _impl(monkeypatch, impl)
            assert torch.equal(O.fp4_linear(a, wp, backend="cuda"), y1), f"second {impl} call differs (M={M})"


def _prefers_pair(N, K):
    """decode_prefers_pair of gemm_w4_decode_sm90.cu: pair2 items (32 rows x 256 K) >= 2.5 x its resident warps."""
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    return N % 32 == 0 and 2 * (N // 32) * (K // 256) >= 5 * 2 * sms * 8


@pytest.mark.parametrize("N,K", PAIR_SHAPES[:8], ids=[f"N{n}_K{k}" for n, k in PAIR_SHAPES[:8]])
def test_decode_default_follows_the_shape_rule(monkeypatch, N, K):
    """Protects the default dense decode choice: on sm_90 bit for bit the K-slab kernel (TRACE_EXT_DECODE_IMPL=kslab);
    TRACE_EXT_DECODE_IMPL=auto (the default elsewhere): the pair2 kernel for bf16 activations where every resident
    pair2 warp gets >= 2.5 items (on the H200: 14336 x 4096, 4096 x 14336), else the stream kernel (7168 x 4096 and
    the smaller projections; W4A4 always), at every M of the pair tests; TRACE_EXT_DECODE_IMPL=stream forces the
    stream kernel."""
    w = _quant_w(N, K)
    wp = O.prepare_fp4_weight(w)
    for mode in ("w4a16", "w4a4"):
        for M in PAIR_MS:
            a = torch.randn(M, K, device=DEV).bfloat16()
            if mode == "w4a4":
                a = ref.nvfp4_quantize(a)
            ys = {}
            for impl in (None, "kslab", "auto", "stream", "pair2"):
                _impl(monkeypatch, impl)
                ys[impl] = O.fp4_linear(a, wp, backend="cuda")
            want = "pair2" if mode == "w4a16" and _prefers_pair(N, K) else "stream"
            assert torch.equal(ys["auto"], ys[want]), f"auto is not {want}: N={N} K={K} M={M} {mode}"
            assert torch.equal(ys[None], ys["kslab"]), f"default is not kslab: N={N} K={K} M={M} {mode}"
    if torch.cuda.get_device_properties(DEV).multi_processor_count == 132:  # the H200 of the benchmarks
        assert _prefers_pair(14336, 4096) and _prefers_pair(4096, 14336) and not _prefers_pair(7168, 4096)


def test_decode_pair_kernel_adversarial(monkeypatch):
    """Protects the pair kernel on adversarial data: the largest codes (+-6) with the largest scale (448) in every
    block against large activations of both signs (outputs that cancel to ~0 and outputs near the bf16 range),
    a NaN scale byte (its output column NaN, SPEC 2, the rest finite), all-zero activations rows among nonzero
    ones, and subnormal-scale blocks (E4M3 0x01)."""
    N, K = 1536, 2048
    codes = torch.randint(0, 256, (N, K // 2), device=DEV, dtype=torch.uint8)
    codes[: N // 4] = 0x77  # +6, +6
    codes[N // 4 : N // 2] = 0xFF  # -6, -6
    scales = torch.randint(0, 0x7F, (N, K // 16), device=DEV, dtype=torch.uint8)
    scales[: N // 2] = 0x7E  # 448
    scales[N // 2 : N // 2 + 64] = 0x01  # smallest subnormal scale
    w = NVFP4Tensor(codes, scales, torch.full((1,), 1e-2, device=DEV), shape=(N, K))
    w64 = _w64(w)
    for M in (1, 5, 16, 29, 32):
        a = (torch.randn(M, K, device=DEV) * 1e3).bfloat16()
        a[:, K // 2 :] = -a[:, : K // 2]  # exact cancellation of the two halves against repeated codes
        if M > 1:
            a[M // 2] = 0
        for impl in (None, *PAIR_IMPLS):
            _impl(monkeypatch, impl)
            _check(O.fp4_linear(a, O.prepare_fp4_weight(w), backend="cuda"), a.double(), w64, f"adv M={M} {impl}")
    wn = _quantized_w(256, 2048)
    wn.scales[37, 5] = 0x7F
    for impl in PAIR_IMPLS:
        _impl(monkeypatch, impl)
        for M in (1, 8, 16, 32):
            y = O.fp4_linear(torch.randn(M, 2048, device=DEV).bfloat16(), O.prepare_fp4_weight(wn), backend="cuda")
            assert torch.isnan(y[:, 37]).all() and torch.isfinite(y[:, :37]).all() and torch.isfinite(y[:, 38:]).all()


def test_decode_pair_switch_keeps_errors_and_grouped(monkeypatch):
    """Protects the switch: under TRACE_EXT_DECODE_IMPL=pair the errors of the dense entry are those of the default
    (SPEC 10 types), and grouped calls (not covered by the pair kernel) still run the default and match it bit for
    bit."""
    w = _quant_w(64, 256)
    wp = O.prepare_fp4_weight(w)
    a = torch.randn(4, 256, device=DEV).bfloat16()
    ops = torch.ops.trace_ext
    g = w.g[:1].contiguous()
    bad_calls = [
        lambda: O.fp4_linear(a.cpu(), wp, backend="cuda"),
        lambda: ops.fp4_linear(a.float(), None, None, w.codes, w.scales, g, wp.packed),
        lambda: ops.fp4_linear(a[:, :128].contiguous(), None, None, w.codes, w.scales, g, wp.packed),
        lambda: ops.fp4_linear(a, None, None, w.codes, w.scales, g, wp.packed[:-1].contiguous()),
    ]
    for call in bad_calls:
        kinds = []
        for impl in (None, *PAIR_IMPLS):
            _impl(monkeypatch, impl)
            with pytest.raises(Exception) as ei:
                call()
            kinds.append(type(ei.value))
        assert all(k is kinds[0] for k in kinds), kinds
    E, N, K = 128, 1536, 2048
    wg = O.prepare_fp4_weight(_quant_w(N, K, E))
    offsets = _offsets(_routed_counts(4, E, 8, torch.Generator().manual_seed(5)))
    ag = torch.randn(32, K, device=DEV).bfloat16()
    _impl(monkeypatch, None)
    y0 = O.fp4_grouped_linear(ag, wg, offsets, backend="cuda")
    for impl in PAIR_IMPLS:
        _impl(monkeypatch, impl)
        assert torch.equal(O.fp4_grouped_linear(ag, wg, offsets, backend="cuda"), y0), impl


# ---- dense decode: second packed form (TRACE_EXT_DECODE_IMPL=pair3 / stream2 / auto2, read at every call) --------
# pair3 is pair2's kernel and stream2 the default's kernel, reading prepare_fp4_weight(decode_form2=True).packed2
# (9 instead of 11 integer ops per 8 weights); same products and sums, so they must equal those bit for bit.
# quad3 (items of 4 blocks, <= 16 rows) splits K differently: within the contract, repeatable.
FORM2_IMPLS = ("pair3", "stream2", "auto2", "quad3")


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("N,K", PAIR_SHAPES, ids=[f"N{n}_K{k}" for n, k in PAIR_SHAPES])
def test_decode_form2_kernels_equal_their_form1_twins(monkeypatch, N, K, mode):
    """Protects the second packed form end to end (to_decode_layout2 + decode_word2 in the pair and stream kernels):
    pair3 equals pair2 and stream2 equals the stream kernel bit for bit, auto2 equals one of them, for every shape and
    M of the pair tests (incl. N % 32 != 0, where pair3 falls back to stream2), all within the f64 contract; quad3
    (4-block items up to 16 rows, else pair3) within the contract and repeatable with other kernels in between."""
    w = _quant_w(N, K)
    wp = O.prepare_fp4_weight(w, decode_form2=True)
    assert wp.packed2 is not None and wp.packed2.shape == wp.packed.shape
    w64 = _w64(w)
    for M in PAIR_MS:
        a = torch.randn(M, K, device=DEV).bfloat16()
        if mode == "w4a4":
            a = ref.nvfp4_quantize(a)
        a64 = _a64(a)
        ys = {}
        for impl in ("stream", "pair2", *FORM2_IMPLS):
            _impl(monkeypatch, impl)
            ys[impl] = O.fp4_linear(a, wp, backend="cuda")
        pair_ok = N % 32 == 0
        assert torch.equal(ys["stream2"], ys["stream"]), f"stream2 N={N} K={K} M={M} {mode}"
        assert torch.equal(ys["pair3"], ys["pair2"] if pair_ok else ys["stream"]), f"pair3 N={N} K={K} M={M} {mode}"
        assert torch.equal(ys["auto2"], ys["pair3"]) or torch.equal(ys["auto2"], ys["stream2"]), f"auto2 M={M}"
        _check(ys["auto2"], a64, w64, f"auto2 N={N} K={K} M={M} {mode}")
        _check(ys["quad3"], a64, w64, f"quad3 N={N} K={K} M={M} {mode}")
        if M > 16 or N % 64 != 0:
            assert torch.equal(ys["quad3"], ys["pair3"]), f"quad3 outside its domain M={M}"
        _impl(monkeypatch, "quad3")
        assert torch.equal(O.fp4_linear(a, wp, backend="cuda"), ys["quad3"]), f"second quad3 call differs (M={M})"


def test_decode_form2_adversarial_and_unprepared(monkeypatch):
    """Protects the form-2 kernels on the adversarial data of the pair test (+-6 codes with scale 448, cancelling
    activations, zero rows, subnormal scales, a NaN scale byte -> NaN column) and the fallback of fp4_linear: a
    prepared weight without packed2 (re-laid out per call) gives the same bits as one prepared with it."""
    N, K = 1536, 2048
    codes = torch.randint(0, 256, (N, K // 2), device=DEV, dtype=torch.uint8)
    codes[: N // 4] = 0x77
    codes[N // 4 : N // 2] = 0xFF
    scales = torch.randint(0, 0x7F, (N, K // 16), device=DEV, dtype=torch.uint8)
    scales[: N // 2] = 0x7E
    scales[N // 2 : N // 2 + 64] = 0x01
    w = NVFP4Tensor(codes, scales, torch.full((1,), 1e-2, device=DEV), shape=(N, K))
    w64 = _w64(w)
    wp2 = O.prepare_fp4_weight(w, decode_form2=True)
    wp1 = O.prepare_fp4_weight(w, decode_form2=False)
    for M in (1, 5, 16, 29, 32):
        a = (torch.randn(M, K, device=DEV) * 1e3).bfloat16()
        a[:, K // 2 :] = -a[:, : K // 2]
        if M > 1:
            a[M // 2] = 0
        for impl in FORM2_IMPLS:
            _impl(monkeypatch, impl)
            y = O.fp4_linear(a, wp2, backend="cuda")
            _check(y, a.double(), w64, f"adv M={M} {impl}")
            assert torch.equal(O.fp4_linear(a, wp1, backend="cuda"), y), f"unprepared packed2 M={M} {impl}"
    wn = _quantized_w(256, 2048)
    wn.scales[37, 5] = 0x7F
    wn2 = O.prepare_fp4_weight(wn, decode_form2=True)
    for impl in FORM2_IMPLS:
        _impl(monkeypatch, impl)
        for M in (1, 8, 16, 32):
            y = O.fp4_linear(torch.randn(M, 2048, device=DEV).bfloat16(), wn2, backend="cuda")
            assert torch.isnan(y[:, 37]).all() and torch.isfinite(y[:, :37]).all() and torch.isfinite(y[:, 38:]).all()


def test_decode_form2_switch_keeps_grouped(monkeypatch):
    """Protects the switch: grouped calls (no form-2 kernel; fp4_grouped_linear passes the form-1 layout) under
    pair3 / stream2 / auto2 run the default and match it bit for bit."""
    E, N, K = 128, 1536, 2048
    wg = O.prepare_fp4_weight(_quant_w(N, K, E), decode_form2=True)
    assert wg.packed2 is None  # grouped: not built (no grouped form-2 kernel)
    offsets = _offsets(_routed_counts(4, E, 8, torch.Generator().manual_seed(5)))
    ag = torch.randn(32, K, device=DEV).bfloat16()
    _impl(monkeypatch, None)
    y0 = O.fp4_grouped_linear(ag, wg, offsets, backend="cuda")
    for impl in FORM2_IMPLS:
        _impl(monkeypatch, impl)
        assert torch.equal(O.fp4_grouped_linear(ag, wg, offsets, backend="cuda"), y0), impl


# ---- dense decode: K-slab kernel (TRACE_EXT_DECODE_IMPL=kslab, read at every call) ------------------------------
# gemm_w4_decode_kslab_sm90.cu: a CTA (one per SM, 16 warps) owns a K slab of L super-tiles and a range of 16-row
# blocks, stages A[:, slab] in shared memory once (W4A4: dequantized to bf16 there), and reduces the slabs through
# fp32 partials + one self-resetting ticket per block (last slab adds them in slab order). Shapes: the pair shapes
# plus two whose plans (kslab_plan below) have a partial last slab at every row count. kslab2 is the same kernel on the
# second packed form (decode_word2), so it must equal kslab bit for bit.
KSLAB_SHAPES = PAIR_SHAPES + [(256, 8448), (64, 5376)]
KSLAB_MAX_L = {1: 20, 2: 14, 4: 9}  # kslab_max_l(MT8) of the kernel file: A slab beside the rings in 227 KB


def _kslab_plan(N, K, M, sms):
    """kslab_plan of gemm_w4_decode_kslab_sm90.cu (slab length L, slabs S, N chunks C), to show which reduction
    paths the shapes of the tests reach (whole K in one slab, several slabs, a partial last slab)."""
    mt8 = 1 if M <= 8 else 2 if M <= 16 else 4
    nbk, KT, rows = N // 16, K // 256, 8 * mt8
    best, best_cost = None, None
    for S in range(1, KT + 1):
        L = -(-KT // S)
        if L > KSLAB_MAX_L[mt8] or -(-KT // L) != S:
            continue
        C = max(1, min(nbk, sms // S))
        bpc = -(-nbk // C)
        cost = bpc * L * 2304 + (bpc * (16.0 * rows * 4 + 1024) if S > 1 else 0.0)
        if best_cost is None or cost < best_cost:
            best, best_cost = (L, S, C), cost
    return best


def test_decode_kslab_shapes_reach_every_reduction_path():
    """Protects the coverage of the kslab tests below: on this GPU their shapes run with the whole K in one slab
    (direct store), with several equal slabs (tickets + slab partials) and with a partial last slab, for each of the
    8 / 16 / 32-row configurations."""
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    for M in (1, 16, 32):
        kinds = set()
        for N, K in KSLAB_SHAPES:
            L, S, C = _kslab_plan(N, K, M, sms)
            KT = K // 256
            kinds.add("one" if S == 1 else "partial" if KT % L else "equal")
        assert kinds == {"one", "partial", "equal"}, (M, kinds)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("N,K", KSLAB_SHAPES, ids=[f"N{n}_K{k}" for n, k in KSLAB_SHAPES])
def test_decode_kslab_matches_f64_reference(monkeypatch, N, K, mode):
    """Protects the K-slab decode kernel: every shape of the pair tests plus partial-last-slab shapes, M = 1..32
    incl. odd M (rows M .. 8 / 16 / 32 of the MMA width unwritten in the shared A slab), W4A16 and W4A4 (A dequantized once into shared memory),
    within the f64 contract; same shape and dtype as the default; repeatable bits (self-resetting tickets, slab-order
    and warp-order sums) also when calls of the default and the stream kernel come in between on the same stream;
    kslab2 (second packed form) equal to kslab bit for bit."""
    w = _quant_w(N, K)
    wp = O.prepare_fp4_weight(w, decode_form2=True)
    w64 = _w64(w)
    for M in PAIR_MS:
        a = torch.randn(M, K, device=DEV).bfloat16()
        if mode == "w4a4":
            a = ref.nvfp4_quantize(a)
        a64 = _a64(a)
        _impl(monkeypatch, None)
        y0 = O.fp4_linear(a, wp, backend="cuda")
        _impl(monkeypatch, "kslab")
        y1 = O.fp4_linear(a, wp, backend="cuda")
        assert y1.shape == y0.shape == (M, N) and y1.dtype == y0.dtype == torch.bfloat16
        _check(y1, a64, w64, f"kslab N={N} K={K} M={M} {mode}")
        _impl(monkeypatch, "kslab2")
        assert torch.equal(O.fp4_linear(a, wp, backend="cuda"), y1), f"kslab2 differs from kslab (M={M})"
        for other in (None, "stream"):
            _impl(monkeypatch, other)
            O.fp4_linear(a, wp, backend="cuda")
            _impl(monkeypatch, "kslab")
            assert torch.equal(O.fp4_linear(a, wp, backend="cuda"), y1), f"kslab call after {other} differs (M={M})"


def test_decode_kslab_adversarial(monkeypatch):
    """Protects the kslab kernel on the adversarial data of the pair test: +-6 codes with scale 448 against large
    cancelling activations (outputs near 0 and near the bf16 range), zero activation rows, subnormal scales (E4M3
    0x01), and a NaN scale byte (its output column NaN, SPEC 2, every other column finite), at K = 2048 (one slab)
    and K = 8448 (several slabs, partial last one: the NaN travels through the slab partials); kslab2 bit-equal."""

    def both(a, wp):
        _impl(monkeypatch, "kslab")
        y = O.fp4_linear(a, wp, backend="cuda")
        _impl(monkeypatch, "kslab2")
        y2 = O.fp4_linear(a, wp, backend="cuda")
        assert torch.equal(torch.nan_to_num(y2, nan=7.0), torch.nan_to_num(y, nan=7.0)), "kslab2 differs from kslab"
        assert torch.equal(torch.isnan(y2), torch.isnan(y))
        return y

    for N, K in ((1536, 2048), (512, 8448)):
        codes = torch.randint(0, 256, (N, K // 2), device=DEV, dtype=torch.uint8)
        codes[: N // 4] = 0x77  # +6, +6
        codes[N // 4 : N // 2] = 0xFF  # -6, -6
        scales = torch.randint(0, 0x7F, (N, K // 16), device=DEV, dtype=torch.uint8)
        scales[: N // 2] = 0x7E  # 448
        scales[N // 2 : N // 2 + 64] = 0x01  # smallest subnormal scale
        w = NVFP4Tensor(codes, scales, torch.full((1,), 1e-2, device=DEV), shape=(N, K))
        w64 = _w64(w)
        wp = O.prepare_fp4_weight(w, decode_form2=True)
        for M in (1, 5, 16, 29, 32):
            a = (torch.randn(M, K, device=DEV) * 1e3).bfloat16()
            a[:, K // 2 :] = -a[:, : K // 2]  # exact cancellation of the two halves against repeated codes
            if M > 1:
                a[M // 2] = 0
            _check(both(a, wp), a.double(), w64, f"kslab adv N={N} K={K} M={M}")
            aq = ref.nvfp4_quantize(a.float() * 1e-3)
            _check(both(aq, wp), _a64(aq), w64, f"kslab adv w4a4 N={N} K={K} M={M}")
        wn = _quantized_w(256, K)
        wn.scales[37, 5] = 0x7F
        wn.scales[200, K // 16 - 1] = 0x7F  # last NVFP4 block of K: in the last slab
        wnp = O.prepare_fp4_weight(wn, decode_form2=True)
        for M in (1, 8, 16, 32):
            y = both(torch.randn(M, K, device=DEV).bfloat16(), wnp)
            nan_cols = torch.isnan(y).all(0)
            assert nan_cols[37] and nan_cols[200] and int(nan_cols.sum()) == 2, f"NaN columns K={K} M={M}"
            assert torch.isfinite(y[:, ~nan_cols]).all(), f"non-NaN columns K={K} M={M}"


def test_decode_kslab_switch_keeps_errors_and_grouped(monkeypatch):
    """Protects the switch: under TRACE_EXT_DECODE_IMPL=kslab / kslab2 the dense entry raises the default's error
    types (SPEC 10), and grouped calls (not covered by kslab; fp4_grouped_linear passes the first packed form) run the
    default and match it bit for bit."""
    w = _quant_w(64, 256)
    wp = O.prepare_fp4_weight(w)
    a = torch.randn(4, 256, device=DEV).bfloat16()
    ops = torch.ops.trace_ext
    g = w.g[:1].contiguous()
    bad_calls = [
        lambda: O.fp4_linear(a.cpu(), wp, backend="cuda"),
        lambda: ops.fp4_linear(a.float(), None, None, w.codes, w.scales, g, wp.packed),
        lambda: ops.fp4_linear(a[:, :128].contiguous(), None, None, w.codes, w.scales, g, wp.packed),
        lambda: ops.fp4_linear(a, None, None, w.codes, w.scales, g, wp.packed[:-1].contiguous()),
    ]
    for call in bad_calls:
        kinds = []
        for impl in (None, "kslab", "kslab2"):
            _impl(monkeypatch, impl)
            with pytest.raises(Exception) as ei:
                call()
            kinds.append(type(ei.value))
        assert all(k is kinds[0] for k in kinds), kinds
    E, N, K = 128, 1536, 2048
    wg = O.prepare_fp4_weight(_quant_w(N, K, E))
    offsets = _offsets(_routed_counts(4, E, 8, torch.Generator().manual_seed(5)))
    ag = torch.randn(32, K, device=DEV).bfloat16()
    _impl(monkeypatch, None)
    y0 = O.fp4_grouped_linear(ag, wg, offsets, backend="cuda")
    for impl in ("kslab", "kslab2"):
        _impl(monkeypatch, impl)
        assert torch.equal(O.fp4_grouped_linear(ag, wg, offsets, backend="cuda"), y0), impl


# ---- K-slab decode: forced slab counts (TRACE_EXT_KSLAB_S, read per call; an A/B knob) -----------------------------


def test_kslab_forced_slab_counts(monkeypatch):
    """Protects every slab count the K-slab plan can be forced to (bench/bench_decode_kslab_plan.py times them): for
    each valid S (slab length fits the shared memory, no smaller S with the same length) of 4096 x 14336 and 2048 x
    2048 at M = 1 / 9 / 32, W4A16 and W4A4: within the f64 contract (other partial sums per slab, other N chunks per
    CTA), repeatable with model-planned calls in between; an invalid S falls back to the model."""
    import sys  # noqa: PLC0415

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
    from bench_decode_kslab_plan import valid_slab_counts  # noqa: PLC0415

    monkeypatch.delenv("TRACE_EXT_DECODE_IMPL", raising=False)
    for N, K in ((4096, 14336), (2048, 2048)):
        w = _quant_w(N, K)
        wp = O.prepare_fp4_weight(w)
        w64 = _w64(w)
        for M in (1, 9, 32):
            for mode in ("w4a16", "w4a4"):
                a = torch.randn(M, K, device=DEV).bfloat16()
                if mode == "w4a4":
                    a = ref.nvfp4_quantize(a)
                monkeypatch.delenv("TRACE_EXT_KSLAB_S", raising=False)
                y_model = O.fp4_linear(a, wp, backend="cuda")
                for S in valid_slab_counts(K, M):
                    monkeypatch.setenv("TRACE_EXT_KSLAB_S", str(S))
                    y = O.fp4_linear(a, wp, backend="cuda")
                    _check(y, _a64(a), w64, f"kslab S={S} N={N} K={K} M={M} {mode}")
                    monkeypatch.delenv("TRACE_EXT_KSLAB_S")
                    O.fp4_linear(a, wp, backend="cuda")
                    monkeypatch.setenv("TRACE_EXT_KSLAB_S", str(S))
                    assert torch.equal(O.fp4_linear(a, wp, backend="cuda"), y), f"second S={S} call differs"
                monkeypatch.setenv("TRACE_EXT_KSLAB_S", "5000")  # not a valid count: the model's plan
                assert torch.equal(O.fp4_linear(a, wp, backend="cuda"), y_model), f"invalid S M={M} {mode}"


# ---- grouped decode: the K-slab kernel (the default on sm_90; TRACE_EXT_DECODE_IMPL=kslab-grouped / kslab-flat) -----
# gemm_w4_decode_kslab_grouped_kernel: units = expert chunks of 8 / 16 / 32 rows, the unit's A rows staged once per job
# in shared memory. Only the K split into partial sums differs from the stream kernel, so it is held to the f64
# contract (not to the stream kernel's bits), and to its own bits on every call.


# Two work orders of the grouped K-slab kernel: whole (unit, slab, N chunk) jobs (kslab-grouped) and one contiguous
# range of (unit, slab, 16-row block) per CTA (kslab-flat); their K splits over warps differ, so each is held to the
# f64 contract and to its own bits. An unset TRACE_EXT_DECODE_IMPL picks one of them per call on the host
# (grouped_flat_pays): its output must equal one of theirs bit for bit.
GROUPED_KSLAB_IMPLS = ("kslab-grouped", "kslab-flat")


def _kslab_grouped_case(monkeypatch, E, N, K, counts, mode, w, what, impl="kslab-grouped"):
    assert len(counts) == E
    M = int(sum(counts))
    offsets = _offsets(counts)
    a = torch.randn(M, K, device=DEV).bfloat16()
    if mode == "w4a4":
        a = ref.nvfp4_quantize(a)
    wp = O.prepare_fp4_weight(w)
    what = f"{what} [{impl}]"
    _impl(monkeypatch, impl)
    y1 = O.fp4_grouped_linear(a, wp, offsets, backend="cuda")
    assert y1.shape == (M, N) and y1.dtype == torch.bfloat16
    _check_experts(y1, a, w, offsets, what)
    for other in (None, "stream", None):
        _impl(monkeypatch, other)
        y0 = O.fp4_grouped_linear(a, wp, offsets, backend="cuda")
        assert y0.shape == y1.shape and y0.dtype == y1.dtype
        if other is None:  # the default on sm_90 runs one of the two work orders
            twin = [i for i in GROUPED_KSLAB_IMPLS if i != impl][0]
            _impl(monkeypatch, twin)
            y_twin = O.fp4_grouped_linear(a, wp, offsets, backend="cuda")
            assert torch.equal(y0, y1) or torch.equal(y0, y_twin), f"{what}: the default is neither work order"
        _impl(monkeypatch, impl)
        assert torch.equal(O.fp4_grouped_linear(a, wp, offsets, backend="cuda"), y1), f"{what}: call after {other}"


@pytest.mark.parametrize("impl", GROUPED_KSLAB_IMPLS)
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_decode_kslab_grouped_qwen3_token_batches(monkeypatch, mode, impl):
    """Protects the grouped K-slab kernel at Qwen3-30B-A3B (E=128, top-8) decode batches T = 1 .. 256 (units of 8 / 16
    / 24 rows; empty experts at T < 16; at T = 256 the default decides the order on the device, and must equal one of
    the two forced orders), W4A16 and W4A4 (A dequantized once per job), within the f64 contract, with repeatable bits
    when default / stream calls come in between on the same stream (self-resetting tickets, slab-order and warp-order
    sums; several slabs: the K = 8448 cases of the other tests and the forced 32-row units)."""
    gen = torch.Generator().manual_seed(11)
    E, k = 128, 8
    w_gu = _quant_w(1536, 2048, E)
    w_dn = _quant_w(2048, 768, E)
    for T in (1, 3, 16, 64, 256):
        counts = _routed_counts(T, E, k, gen)
        for name, (N, K), w in (("gate_up", (1536, 2048), w_gu), ("down", (2048, 768), w_dn)):
            _kslab_grouped_case(monkeypatch, E, N, K, counts, mode, w, f"qwen3 {name} {mode} T={T}", impl)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_decode_stream_grouped_qwen3_token_batches(monkeypatch, mode):
    """Protects the grouped stream kernel (TRACE_EXT_DECODE_IMPL=stream on sm_90; the grouped decode kernel wherever
    the K-slab kernel does not run, e.g. sm_100a) at Qwen3-30B-A3B (E=128, top-8) T = 1 .. 256 (8-, 16- and 32-row
    units by rows_hint, empty experts at T < 16): within the f64 contract, the same bits on a second call."""
    gen = torch.Generator().manual_seed(21)
    E, k = 128, 8
    w_gu = _quant_w(1536, 2048, E)
    w_dn = _quant_w(2048, 768, E)
    _impl(monkeypatch, "stream")
    for T in (1, 3, 16, 64, 256):
        counts = _routed_counts(T, E, k, gen)
        for name, (N, K), w in (("gate_up", (1536, 2048), w_gu), ("down", (2048, 768), w_dn)):
            _grouped_case(E, N, K, counts, mode, w=w, prepared=True, what=f"stream qwen3 {name} {mode} T={T}")
    offsets = _offsets(counts)
    a = torch.randn(int(sum(counts)), 768, device=DEV).bfloat16()
    wp = O.prepare_fp4_weight(w_dn)
    assert torch.equal(O.fp4_grouped_linear(a, wp, offsets, backend="cuda"),
                       O.fp4_grouped_linear(a, wp, offsets, backend="cuda")), "second grouped stream call differs"


@pytest.mark.parametrize("impl", GROUPED_KSLAB_IMPLS)
def test_decode_kslab_grouped_previous_plan(monkeypatch, impl):
    """Protects the previous grouped plan kept for A/B timing (TRACE_EXT_KSLAB_GRP_PLAN=v1: fewer, longer jobs at
    Qwen3 T = 1 and down T = 16) in both work orders: f64 contract, repeatable bits, the default one of the two."""
    monkeypatch.setenv("TRACE_EXT_KSLAB_GRP_PLAN", "v1")
    gen = torch.Generator().manual_seed(14)
    E, k = 128, 8
    for name, (N, K) in (("gate_up", (1536, 2048)), ("down", (2048, 768))):
        w = _quant_w(N, K, E)
        for T in (1, 16):
            _kslab_grouped_case(monkeypatch, E, N, K, _routed_counts(T, E, k, gen), "w4a16", w,
                                f"plan v1 qwen3 {name} T={T}", impl)


@pytest.mark.parametrize("rows", ["8", "16", "24", "32"])
@pytest.mark.parametrize("impl", GROUPED_KSLAB_IMPLS)
def test_decode_kslab_grouped_forced_unit_rows(monkeypatch, impl, rows):
    """Protects TRACE_EXT_KSLAB_GRP_ROWS (an A/B knob: rows per unit of the grouped K-slab kernel instead of the
    rows_hint rule; 24: three 8-row groups, a unit size the rule never takes) in both work orders: Qwen3 T = 16 / 64
    (8-row units split the experts with more than 8 rows), W4A16 and W4A4, T = 256 at 24 rows (experts above 24 rows
    split), and all 40 rows on one expert: f64 contract, repeatable bits, the default one of the two orders."""
    monkeypatch.setenv("TRACE_EXT_KSLAB_GRP_ROWS", rows)
    gen = torch.Generator().manual_seed(17)
    E, k = 128, 8
    for name, (N, K) in (("gate_up", (1536, 2048)), ("down", (2048, 768))):
        w = _quant_w(N, K, E)
        for T, mode in ((16, "w4a16"), (64, "w4a4"), (64, "w4a16")) + (((256, "w4a16"),) if rows == "24" else ()):
            _kslab_grouped_case(monkeypatch, E, N, K, _routed_counts(T, E, k, gen), mode, w,
                                f"rows={rows} qwen3 {name} T={T}", impl)
    one = [0] * 5 + [40] + [0] * 10
    _kslab_grouped_case(monkeypatch, 16, 1536, 2048, one, "w4a16", _quant_w(1536, 2048, 16),
                        f"rows={rows} one expert 40 rows", impl)


@pytest.mark.parametrize("auto16", ["default", "0"])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_decode_kslab_grouped_auto16(monkeypatch, mode, auto16):
    """Protects the 16-row units' work order (5..8 rows per expert): the default (decided on the device) and
    TRACE_EXT_KSLAB_GRP_AUTO16=0 (the host's estimate, an A/B knob): Qwen3 T = 80, 96, 128 with uniform routing (whole
    jobs fit one round) and with a few experts of 20-60 rows (more units than CTAs: flat ranges), both projections: the
    f64 contract, repeatable bits, the default equal to one of the two forced orders bit for bit."""
    if auto16 == "default":
        monkeypatch.delenv("TRACE_EXT_KSLAB_GRP_AUTO16", raising=False)
    else:
        monkeypatch.setenv("TRACE_EXT_KSLAB_GRP_AUTO16", auto16)
    gen = torch.Generator().manual_seed(61)
    E, k = 128, 8
    for name, (N, K) in (("gate_up", (1536, 2048)), ("down", (2048, 768))):
        w = _quant_w(N, K, E)
        for T in (80, 96, 128):
            counts = _routed_counts(T, E, k, gen)
            for impl in GROUPED_KSLAB_IMPLS:
                _kslab_grouped_case(monkeypatch, E, N, K, counts, mode, w, f"auto16 qwen3 {name} T={T}", impl)
        counts = _routed_counts(96, E, k, gen)
        heavy = [int(c) for c in counts]
        for e, extra in ((3, 50), (17, 40), (40, 30), (77, 20), (90, 20), (101, 20)):
            heavy[e] += extra
        for impl in GROUPED_KSLAB_IMPLS:
            _kslab_grouped_case(monkeypatch, E, N, K, heavy, mode, w, f"auto16 qwen3 {name} T=96 skewed", impl)


@pytest.mark.parametrize("impl", GROUPED_KSLAB_IMPLS)
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_decode_kslab_grouped_other_models_and_edges(monkeypatch, mode, impl):
    """Protects the grouped K-slab kernel at OLMoE (E=64 down), DeepSeek-V3 (E=256, N=7168 down), a K of 33 super-tiles
    (several slabs with a partial last one), and the edge distributions: every row on one expert (1, 9, 33, 40, 200
    rows: experts of several units, the first / middle / last expert), all experts empty (M = 0)."""
    gen = torch.Generator().manual_seed(12)
    _kslab_grouped_case(monkeypatch, 64, 2048, 1024, _routed_counts(40, 64, 8, gen), mode, _quant_w(2048, 1024, 64),
                        f"olmoe down {mode}", impl)
    _kslab_grouped_case(monkeypatch, 256, 7168, 2048, _routed_counts(4, 256, 8, gen), mode, _quant_w(7168, 2048, 256),
                        f"dsv3 down {mode}", impl)
    _kslab_grouped_case(monkeypatch, 8, 512, 8448, _routed_counts(3, 8, 2, gen), mode, _quant_w(512, 8448, 8),
                        f"K=8448 {mode}", impl)
    E, N, K = 16, 1536, 2048
    w = _quant_w(N, K, E)
    for M, e in ((1, 7), (9, 3), (33, 0), (40, 7), (200, 15)):
        counts = [0] * E
        counts[e] = M
        _kslab_grouped_case(monkeypatch, E, N, K, counts, mode, w, f"one-expert {mode} M={M} e={e}", impl)
    _impl(monkeypatch, impl)
    offsets = torch.zeros(E + 1, dtype=torch.int32, device=DEV)
    a0 = torch.empty(0, K, device=DEV, dtype=torch.bfloat16)
    y = O.fp4_grouped_linear(a0, O.prepare_fp4_weight(w), offsets, backend="cuda")
    assert y.shape == (0, N)


# ---- K-slab segment slots in shared memory (the default up to 16 rows, but for the grouped whole-job order at 3..4
# rows per expert; TRACE_EXT_KSLAB_SEG=l2 / =smem forces the L2 / shared-memory slots) -----------------------------
# The same partial sums added in the same order as the L2 slots, so the outputs must be the same bits.


def _seg_smem(monkeypatch, on):
    """on: shared-memory slots (TRACE_EXT_KSLAB_SEG=smem), off: L2 slots (=l2), None: unset (the defaults)."""
    if on is None:
        monkeypatch.delenv("TRACE_EXT_KSLAB_SEG", raising=False)
    else:
        monkeypatch.setenv("TRACE_EXT_KSLAB_SEG", "smem" if on else "l2")


def _dense_kslab_inputs(mode, Ms):
    """The dense K-slab tests' inputs: every kslab test shape (whole K in one slab, several slabs, a partial last one),
    its weight prepared in both packed forms, and for each M in Ms a bf16 A (mode "w4a16") or its NVFP4 quantization
    ("w4a4"): yields (N, K, M, prepared weight, A)."""
    for N, K in KSLAB_SHAPES:
        wp = O.prepare_fp4_weight(_quant_w(N, K), decode_form2=True)
        for M in Ms:
            a = torch.randn(M, K, device=DEV).bfloat16()
            yield N, K, M, wp, ref.nvfp4_quantize(a) if mode == "w4a4" else a


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_decode_kslab_seg_smem_dense_equals_l2_slots(monkeypatch, mode):
    """Protects the shared-memory segment slots of the dense K-slab kernel (the default): on every kslab test shape
    (whole K in one slab, several slabs, a partial last one) at M = 1, 5, 8, 9, 13, 16 (8 and 16 rows: the ring
    slots; 32: L2 slots whatever the switch), kslab and kslab2, W4A16 and W4A4, the output equals the L2 slots'
    (TRACE_EXT_KSLAB_SEG=l2) bit for bit, and again after L2-slot calls in between (the ring slots are rewritten by
    every call)."""
    for N, K, M, wp, a in _dense_kslab_inputs(mode, (1, 5, 8, 9, 13, 16, 32)):
        for impl in (None, "kslab2"):
            _impl(monkeypatch, impl)
            _seg_smem(monkeypatch, False)
            y0 = O.fp4_linear(a, wp, backend="cuda")
            _seg_smem(monkeypatch, True)
            y1 = O.fp4_linear(a, wp, backend="cuda")
            assert torch.equal(y1, y0), f"seg smem N={N} K={K} M={M} {mode} {impl}"
            _seg_smem(monkeypatch, False)
            O.fp4_linear(a, wp, backend="cuda")
            _seg_smem(monkeypatch, None)
            assert torch.equal(O.fp4_linear(a, wp, backend="cuda"), y0), f"repeat N={N} K={K} M={M}"


def _grouped_kslab_inputs(seed, Ts, one_expert_rows):
    """The grouped K-slab tests' inputs: Qwen3 gate_up / down experts (E = 128, top-8) at T tokens for T in Ts,
    K = 8448 (several slabs) over 8 experts, and all rows on one expert of 16; per case W4A16 and W4A4 activations:
    yields (label, prepared weight, offsets, A)."""
    gen = torch.Generator().manual_seed(seed)
    E, k = 128, 8
    cases = []
    for N, K in ((1536, 2048), (2048, 768)):
        w = _quant_w(N, K, E)
        cases += [(w, _routed_counts(T, E, k, gen), f"qwen3 N={N} T={T}") for T in Ts]
    cases.append((_quant_w(512, 8448, 8), _routed_counts(12, 8, 2, gen), "K=8448"))
    one = [0] * 7 + [one_expert_rows] + [0] * 8
    cases.append((_quant_w(1536, 2048, 16), one, f"one expert {one_expert_rows} rows"))
    for w, counts, what in cases:
        offsets = _offsets(counts)
        wp = O.prepare_fp4_weight(w)
        for mode in ("w4a16", "w4a4"):
            a = torch.randn(int(sum(counts)), w.shape[-1], device=DEV).bfloat16()
            if mode == "w4a4":
                a = ref.nvfp4_quantize(a)
            yield f"{what} {mode}", wp, offsets, a


@pytest.mark.parametrize("impl", GROUPED_KSLAB_IMPLS)
def test_decode_kslab_seg_smem_grouped_equals_l2_slots(monkeypatch, impl):
    """Protects the shared-memory segment slots of the grouped K-slab kernel (the default) in both work orders
    (several jobs per CTA reuse the ring: the next job's barrier orders the finisher's reads before the ring refills):
    Qwen3 T = 1, 3, 16, 48, 64, 96 (8- and 16-row units) and 256 (32-row units: L2 slots), both projections, W4A16 and
    W4A4, K = 8448 (several slabs), one expert with 40 rows; forced shared-memory slots and the default's choice
    (L2 for whole jobs at 3..4 rows per expert) equal the L2 slots bit for bit."""
    _impl(monkeypatch, impl)
    for what, wp, offsets, a in _grouped_kslab_inputs(31, (1, 3, 16, 48, 64, 96, 256), 40):
        _seg_smem(monkeypatch, False)
        y0 = O.fp4_grouped_linear(a, wp, offsets, backend="cuda")
        _seg_smem(monkeypatch, True)
        assert torch.equal(O.fp4_grouped_linear(a, wp, offsets, backend="cuda"), y0), f"{what} {impl}"
        _seg_smem(monkeypatch, None)
        assert torch.equal(O.fp4_grouped_linear(a, wp, offsets, backend="cuda"), y0), f"{what} {impl} default"


@pytest.mark.parametrize("impl", GROUPED_KSLAB_IMPLS)
def test_decode_kslab_grouped_nan_scale_and_dense_default(monkeypatch, impl):
    """Protects NaN propagation through the grouped K-slab kernel (an E4M3 NaN scale byte of one expert: its output
    column NaN for that expert's rows only, SPEC 2; at K = 8448 the NaN travels through the slab partials), and that
    dense calls under TRACE_EXT_DECODE_IMPL=kslab-grouped / kslab-flat run the dense default bit for bit."""
    E, N = 4, 256
    gen = torch.Generator().manual_seed(13)
    for K in (2048, 8448):
        w = _quant_w(N, K, E)
        w.scales[2, 37, 5] = 0x7F
        w.scales[2, 200, K // 16 - 1] = 0x7F
        wp = O.prepare_fp4_weight(w)
        offsets = _offsets([3, 0, 5, 2])
        a = torch.randn(10, K, generator=gen).bfloat16().to(DEV)
        _impl(monkeypatch, impl)
        y = O.fp4_grouped_linear(a, wp, offsets, backend="cuda")
        nan = torch.isnan(y)
        assert nan[3:8, 37].all() and nan[3:8, 200].all() and int(nan.sum()) == 10, f"NaN cells K={K}"
    wd = _quant_w(1536, 2048)
    wdp = O.prepare_fp4_weight(wd)
    ad = torch.randn(5, 2048, device=DEV).bfloat16()
    _impl(monkeypatch, None)
    y0 = O.fp4_linear(ad, wdp, backend="cuda")
    _impl(monkeypatch, impl)
    assert torch.equal(O.fp4_linear(ad, wdp, backend="cuda"), y0)


# ---- K-slab ring depth (TRACE_EXT_KSLAB_STAGES=prev, read per call; an A/B knob) -----------------------------------
# At <= 16 rows the K-slab kernels run a 2-slot cp.async ring per warp since round 20; =prev runs the depth before (4
# slots at <= 8 rows, 3 at 16), same plan, same sums: the outputs must be the same bits. At 32 rows (2 slots since
# round 37, with longer slabs) =prev also takes the previous plans: other sums, the same f64 contract.
def _ring(monkeypatch, value):
    """TRACE_EXT_KSLAB_STAGES=value ("prev"), or unset (None: the default ring)."""
    if value:
        monkeypatch.setenv("TRACE_EXT_KSLAB_STAGES", value)
    else:
        monkeypatch.delenv("TRACE_EXT_KSLAB_STAGES", raising=False)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_kslab_ring_depth_equals_prev(monkeypatch, mode):
    """Protects the 2-slot ring of the dense K-slab kernel (the default at <= 16 rows): every kslab shape (one slab,
    several, a partial last one) at M = 1, 2, 3, 5, 8 (8-row groups) and 9, 16 (16-row groups), both packed forms,
    W4A16 and W4A4, with the shared-memory and the L2 segment slots: the bits of the previous ring depth, also on a
    repeated call after a call of the other kernel."""
    for N, K, M, wp, a in _dense_kslab_inputs(mode, (1, 2, 3, 5, 8, 9, 16)):
        for impl in (None, "kslab2"):
            for seg in (True, False):
                tag = f"N={N} K={K} M={M} {mode} {impl} seg_smem={seg}"
                _impl(monkeypatch, impl)
                _seg_smem(monkeypatch, seg)
                _ring(monkeypatch, "prev")
                y0 = O.fp4_linear(a, wp, backend="cuda").view(torch.int16)
                _ring(monkeypatch, None)
                assert torch.equal(O.fp4_linear(a, wp, backend="cuda").view(torch.int16), y0), tag
                _ring(monkeypatch, "prev")
                O.fp4_linear(a, wp, backend="cuda")
                _ring(monkeypatch, None)
                assert torch.equal(O.fp4_linear(a, wp, backend="cuda").view(torch.int16), y0), tag
    monkeypatch.delenv("TRACE_EXT_KSLAB_SEG", raising=False)


@pytest.mark.parametrize("impl", GROUPED_KSLAB_IMPLS)
def test_kslab_ring_depth_grouped_equals_prev(monkeypatch, impl):
    """Protects the 2-slot ring of the grouped K-slab kernel (the default for 8- and 16-row units) in both work
    orders: Qwen3 T = 1, 3, 16, 64, both projections, W4A16 and W4A4, K = 8448 (several slabs), one expert with 12
    rows (a 16-row unit): the bits of the previous ring depth, with shared-memory and L2 segment slots."""
    _impl(monkeypatch, impl)
    for what, wp, offsets, a in _grouped_kslab_inputs(37, (1, 3, 16, 64), 12):
        for seg in (True, False):
            _seg_smem(monkeypatch, seg)
            _ring(monkeypatch, "prev")
            y0 = O.fp4_grouped_linear(a, wp, offsets, backend="cuda").view(torch.int16)
            _ring(monkeypatch, None)
            y = O.fp4_grouped_linear(a, wp, offsets, backend="cuda").view(torch.int16)
            assert torch.equal(y, y0), f"{what} {impl} seg_smem={seg}"
    monkeypatch.delenv("TRACE_EXT_KSLAB_SEG", raising=False)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_kslab_per_channel_g_w(monkeypatch, mode):
    """Protects the K-slab kernels' block-end store (kslab_store_y: g_a / g_w loaded before the stores) with a
    per-channel g_w (gw_stride_n = 1; the other K-slab tests use one g_w per matrix): dense [N] at M = 1, 9, 32 (8 / 16
    / 32-row kernels) and grouped [E, N] at Qwen3 T = 1, 64, 256 (8 / 16 / 24-row units) in the default and both
    forced work orders, W4A16 and W4A4, within the f64 contract."""
    gen = torch.Generator().manual_seed(43)
    for lead in ((4096,), (128, 1536)):
        grouped = len(lead) == 2
        w = _quant_w(lead[-1], 2048, lead[0] if grouped else None)
        g = torch.rand(lead, device=DEV) * 1e-3 + 1e-4
        w = NVFP4Tensor(w.codes, w.scales, g, shape=w.shape)
        wp = O.prepare_fp4_weight(w)
        for rows in ((1, 64, 256) if grouped else (1, 9, 32)):
            counts = _routed_counts(rows, 128, 8, gen) if grouped else None
            M = int(sum(counts)) if grouped else rows
            a = torch.randn(M, 2048, device=DEV).bfloat16()
            if mode == "w4a4":
                a = ref.nvfp4_quantize(a)
            if not grouped:
                _impl(monkeypatch, None)
                _check(O.fp4_linear(a, wp, backend="cuda"), _a64(a), _w64(w), f"dense g_w [N] M={M} {mode}")
                continue
            offsets = _offsets(counts)
            for impl in (None,) + GROUPED_KSLAB_IMPLS:
                _impl(monkeypatch, impl)
                _check_experts(O.fp4_grouped_linear(a, wp, offsets, backend="cuda"), a, w, offsets,
                               f"grouped g_w [E, N] T={rows} {mode} {impl}")
    _impl(monkeypatch, None)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_kslab_prev_ring_at_32_rows(monkeypatch, mode):
    """Protects TRACE_EXT_KSLAB_STAGES=prev at 32 rows (the 3-slot ring with the shorter slabs of the plans before round
    37; the default since: 2 slots, slabs up to 9 super-tiles): dense, every kslab shape at M = 17, 24, 32, both packed
    forms, and grouped (both work orders) at Qwen3 T = 256 (gate_up: 2 slabs under prev, 1 by default), K = 8448 and
    one expert with 40 rows, W4A16 and W4A4: both within the f64 contract, each repeatable, also after calls of the
    other in between (self-resetting tickets of different slab counts on one stream)."""
    for N, K in KSLAB_SHAPES:
        w = _quant_w(N, K)
        wp = O.prepare_fp4_weight(w, decode_form2=True)
        w64 = _w64(w)
        for M in (17, 24, 32):
            a = torch.randn(M, K, device=DEV).bfloat16()
            if mode == "w4a4":
                a = ref.nvfp4_quantize(a)
            a64 = _a64(a)
            for impl in (None, "kslab2"):
                _impl(monkeypatch, impl)
                ys = {}
                for ring in ("prev", None, "prev", None):
                    _ring(monkeypatch, ring)
                    y = O.fp4_linear(a, wp, backend="cuda")
                    if ring in ys:
                        assert torch.equal(y, ys[ring]), f"repeat ring={ring} N={N} K={K} M={M} {impl}"
                    else:
                        _check(y, a64, w64, f"ring={ring} N={N} K={K} M={M} {mode} {impl}")
                        ys[ring] = y
    gen = torch.Generator().manual_seed(41)
    for impl in GROUPED_KSLAB_IMPLS:
        _ring(monkeypatch, "prev")
        for name, (N, K) in (("gate_up", (1536, 2048)), ("down", (2048, 768))):
            _kslab_grouped_case(monkeypatch, 128, N, K, _routed_counts(256, 128, 8, gen), mode, _quant_w(N, K, 128),
                                f"ring=prev qwen3 {name} T=256", impl)
        _kslab_grouped_case(monkeypatch, 8, 512, 8448, _routed_counts(40, 8, 2, gen), mode, _quant_w(512, 8448, 8),
                            "ring=prev K=8448", impl)
        one = [0] * 7 + [40] + [0] * 8
        _kslab_grouped_case(monkeypatch, 16, 1536, 2048, one, mode, _quant_w(1536, 2048, 16), "ring=prev one expert 40",
                            impl)
    _ring(monkeypatch, None)
