"""SR and guided rounding of the quantize kernels' scaled-domain path (fp4_numerics.cuh: e2m1_floor_grid_x2m14,
e2m1_sr_grid_x2m14, e2m1_pack8_abs_x2m14<false>, e2m1_guided_{compact,full}_pack8) emulated in numpy float32 /
float16 with IEEE round-to-nearest-even and the directed roundings of __fadd_rd / __fmaf_rd done exactly, against the
reference (python/trace_ext/reference.py: _sr_magnitude, _guided_magnitude on formats.e2m1_bracket). Protects the
algorithm on machines without a GPU; the GPU tests check the kernels.

Domain: the kernels take this path only when every nonzero quotient v = fl(x / t) is >= 2^-99 (quantize_block), and
then u = fl(|x| / t) * 2^-14 = |v| * 2^-14 exactly; so inputs here are v = +-0 and |v| in [2^-100, 2^100].
SR: the kernel's decision fl_rd(lo + k w 2^-24) < a and the reference's u < p are both "k below a threshold"; checking
k = K - 1 and K at the reference's threshold K = ceil(p 2^24) proves agreement for every word of that a. The sweeps
below are strided / dense; tools/exhaustive_scaled_sr_guided.py runs the same checks over every float in [2^-100, 8]
(once, when the path was written: all agree).
"""
from __future__ import annotations

import numpy as np
import torch

from trace_ext import formats
from trace_ext import reference as ref
from test_rtn_sat_pack_emulation import pack8_abs

F = np.float32
SCALE = F(2.0**-14)
SAT = F(6 * 2.0**-14)
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# ---- kernel emulation -----------------------------------------------------------------------------------------


def down_to_f32(exact: np.ndarray) -> np.ndarray:
    """Round float64 values (exact results) down to float32 (IEEE round toward -inf), for values >= 0."""
    r = exact.astype(F)
    return np.where(r.astype(np.float64) > exact, np.nextafter(r, F(-np.inf)), r)


def scaled_a(v: np.ndarray) -> np.ndarray:
    """a = min(|v| * 2^-14, 6 * 2^-14) (exact scaling in the kernels' domain)."""
    return np.minimum((np.abs(v) * SCALE).astype(F), SAT)


def floor_grid(a: np.ndarray) -> np.ndarray:
    """e2m1_floor_grid_x2m14: min(fl_rd(a + 256) - 256, a with the low 22 mantissa bits cleared)."""
    small = (down_to_f32(a.astype(np.float64) + 256.0) - F(256)).astype(F)  # a + 256 is exact in float64 here
    big = (a.view(np.uint32) & np.uint32(0xFFC00000)).view(F)
    return np.minimum(small, big)


def width24(a: np.ndarray) -> np.ndarray:
    """max(2^e(a) 2^-25, 2^-39): the bracket width above lo times 2^-24."""
    expo = (a.view(np.uint32) & np.uint32(0x7F800000)).view(F)
    return np.maximum((expo * F(2.0**-25)).astype(F), F(2.0**-39))


def sr_grid(a: np.ndarray, words: np.ndarray) -> np.ndarray:
    """e2m1_sr_grid_x2m14(a, word): hi = lo + w iff fl_rd(k * w24 + lo) < a."""
    lo = floor_grid(a)
    w24 = width24(a)
    k = (words.astype(np.uint32) >> np.uint32(8)).astype(F)  # exact, like __uint2float_rn
    # k * w24 + lo is exact in float64 (a multiple of w24 below 2^26 w24), so one rounding down gives __fmaf_rd
    y = down_to_f32(k.astype(np.float64) * w24.astype(np.float64) + lo.astype(np.float64))
    hi = (w24.astype(np.float64) * 2.0**24 + lo.astype(np.float64)).astype(F)  # exact: a grid value
    return np.where(y < a, hi, lo)


def nibbles(words: np.ndarray) -> np.ndarray:
    return ((words[:, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF).astype(np.int64)


def to_nibble_words(vals: np.ndarray) -> np.ndarray:
    shifted = vals.astype(np.uint32) << (4 * np.arange(8, dtype=np.uint32))
    return shifted.sum(axis=1, dtype=np.uint64).astype(np.uint32)


def bits_to_nibble_lsbs(b: np.ndarray) -> np.ndarray:
    b = b.astype(np.uint32) & 0xFF
    b = (b | (b << 12)) & 0x000F000F
    b = (b | (b << 6)) & 0x03030303
    return (b | (b << 3)) & 0x11111111


def guided_compact_pack8(lo, off, lsbs):
    return ((lo + (off & (lo ^ lsbs))) & 0xFFFFFFFF).astype(np.uint32)


def guided_full_pack8(lo, off, rollout):
    gt = ((rollout | 0x88888888) - (lo & 0x77777777) - 0x11111111) & 0xFFFFFFFF
    take = gt & ~(rollout ^ lo) & 0xFFFFFFFF
    return ((lo + (off & (take >> 3))) & 0xFFFFFFFF).astype(np.uint32)


def kernel_guided_codes(v: np.ndarray, payload: np.ndarray, kind: str) -> np.ndarray:
    """quantize_elems' scaled guided path on rows of 8 values v [n, 8] with the rollout's bits (0/1) or codes."""
    a = scaled_a(v)
    lo = floor_grid(a)
    off = to_nibble_words((a != lo).astype(np.uint32))
    L = pack8_abs(lo, v.view(np.uint32), saturate=False)
    if kind == "compact":
        byte = (payload.astype(np.uint32) << np.arange(8, dtype=np.uint32)).sum(axis=1).astype(np.uint32)
        words = guided_compact_pack8(L, off, bits_to_nibble_lsbs(byte))
    else:
        words = guided_full_pack8(L, off, to_nibble_words(payload))
    return nibbles(words)


# ---- reference --------------------------------------------------------------------------------------------------


def ref_a(v: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.abs(v)).clamp(max=6.0)


def ref_guided_codes(v: np.ndarray, payload: np.ndarray, kind: str) -> np.ndarray:
    vt = torch.from_numpy(v)
    mag = ref._guided_magnitude(vt, ref_a(v), kind, torch.from_numpy(payload.astype(np.int32)))
    return (mag | (torch.signbit(vt).to(torch.int32) << 3)).numpy().astype(np.int64)


def ref_sr_codes(v: np.ndarray, words: np.ndarray) -> np.ndarray:
    return ref._sr_magnitude(ref_a(v), torch.from_numpy(words.astype(np.int64))).numpy().astype(np.int64)


def codes_of(grid: np.ndarray) -> np.ndarray:
    return ((grid.astype(np.float16).view(np.uint16) >> 9) & 7).astype(np.int64)


# ---- inputs -----------------------------------------------------------------------------------------------------


def f32_bits(x: float) -> int:
    return int(np.array([x], dtype=F).view(np.uint32)[0])


def dense_values(ulps: int = 2048) -> np.ndarray:
    """Every float within `ulps` of each grid point, tie, binade edge of the scaled grid and the domain's ends."""
    centers = [g for g in GRID if g > 0] + list(TIES) + [0.125, 0.0625, 8.0, 12.0, 2.0**-99, 2.0**-100, 2.0**99]
    out = [np.array([0.0], dtype=F)]
    for c in centers:
        b = f32_bits(c)
        out.append(np.arange(b - ulps, b + ulps + 1, dtype=np.uint32).view(F))
    v = np.concatenate(out)
    return v[(v == 0) | ((v >= F(2.0**-100)) & (v <= F(2.0**100)))]


def strided_values(step: int) -> np.ndarray:
    return np.arange(f32_bits(2.0**-100), f32_bits(2.0**100), step, dtype=np.uint32).view(F)


def with_signs(v: np.ndarray) -> np.ndarray:
    return np.concatenate([v, -v])


# ---- tests ------------------------------------------------------------------------------------------------------


def test_floor_and_off_grid_match_reference_bracket_dense_and_strided():
    v = np.concatenate([dense_values(), strided_values(4099)])
    lo = floor_grid(scaled_a(v))
    lo_code, hi_code, _, _ = formats.e2m1_bracket(ref_a(v))
    assert np.array_equal(codes_of(lo), lo_code.numpy())
    assert np.array_equal(scaled_a(v) != lo, (hi_code != lo_code).numpy())


def test_sr_matches_reference_at_every_threshold_word_dense_and_strided():
    """Per value: words at the reference's threshold (k = K - 1 and K, low byte 0x00 and 0xFF), and 0 / 0xFFFFFFFF."""
    v = np.concatenate([dense_values(1024), strided_values(16411)])
    a64 = np.minimum(np.abs(v).astype(np.float64), 6.0)
    lo_code, hi_code, lo_val, hi_val = (t.numpy() for t in formats.e2m1_bracket(ref_a(v)))
    width = np.where(hi_code == lo_code, 1.0, hi_val.astype(np.float64) - lo_val)
    p = (a64 - lo_val) / width  # exact (the reference's float32 quotient is exact, see SPEC 4)
    K = np.ceil(p * 2.0**24).astype(np.int64)  # smallest k with k 2^-24 >= p: hi exactly for k < K
    ks = [np.clip(K - 1, 0, 2**24 - 1), np.clip(K, 0, 2**24 - 1), np.zeros_like(K), np.full_like(K, 2**24 - 1)]
    for k in ks:
        for low in (0x00, 0xFF):
            words = (k << 8) | low
            vv = with_signs(v)
            ww = np.concatenate([words, words])
            got = codes_of(sr_grid(scaled_a(vv), ww))
            assert np.array_equal(got, ref_sr_codes(vv, ww)), (hex(int(low)), int(k[0]))
    for extreme in (0, 0xFFFFFFFF):
        words = np.full(v.shape, extreme, dtype=np.int64)
        assert np.array_equal(codes_of(sr_grid(scaled_a(v), words)), ref_sr_codes(v, words))


def test_sr_random_words():
    rng = np.random.default_rng(1)
    v = np.concatenate([dense_values(256), strided_values(65537)])
    v = with_signs(v)
    words = rng.integers(0, 2**32, v.shape, dtype=np.int64)
    assert np.array_equal(codes_of(sr_grid(scaled_a(v), words)), ref_sr_codes(v, words))


def guided_inputs(v: np.ndarray, kind: str, seed: int):
    """Every value with every payload (compact: bits 0 / 1; full: all 16 codes) and both signs, shuffled into rows of 8
    so that every nibble position sees every case."""
    n_pay = 2 if kind == "compact" else 16
    vv = np.repeat(with_signs(v), n_pay)
    pay = np.tile(np.arange(n_pay), 2 * v.size)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(vv.size)
    vv, pay = vv[perm], pay[perm]
    pad = (-vv.size) % 8
    vv = np.concatenate([vv, np.zeros(pad, dtype=F)])
    pay = np.concatenate([pay, np.zeros(pad, dtype=pay.dtype)])
    return vv.reshape(-1, 8), pay.reshape(-1, 8)


def check_guided(v: np.ndarray, kind: str, seed: int) -> None:
    vv, pay = guided_inputs(v, kind, seed)
    got = kernel_guided_codes(vv, pay, kind)
    want = ref_guided_codes(vv.reshape(-1), pay.reshape(-1), kind).reshape(-1, 8)
    bad = got != want
    assert not bad.any(), (kind, vv[bad][:4], pay[bad][:4], got[bad][:4], want[bad][:4])


def test_guided_compact_every_bit_both_signs():
    check_guided(np.concatenate([dense_values(512), strided_values(65537)]), "compact", 2)


def test_guided_full_every_rollout_code_both_signs():
    check_guided(np.concatenate([dense_values(128), strided_values(262147)]), "full", 3)


def test_guided_zeros_and_grid_points_exactly():
    """+-0, every grid point and every tie, with each payload: on the grid nothing moves; -0 keeps its sign."""
    v = np.array([0.0] + list(GRID[1:]) + list(TIES) + [6.5, 7.0, 1e30], dtype=F)
    for kind, seed in (("compact", 4), ("full", 5)):
        check_guided(v, kind, seed)


def test_bits_to_nibble_lsbs_is_the_inverse_of_nibble_lsbs():
    b = np.arange(256, dtype=np.uint32)
    w = bits_to_nibble_lsbs(b)
    assert np.array_equal(nibbles(w), ((b[:, None] >> np.arange(8)) & 1).astype(np.int64))


def test_full_pack8_nibble_arithmetic_over_all_code_pairs():
    """Every (lo code with sign, rollout code, off-grid bit) in every nibble position, against the SPEC 5 rule."""
    lo_m, sgn, r, off = np.meshgrid(np.arange(7), np.arange(2), np.arange(16), np.arange(2), indexing="ij")
    lo_m, sgn, r, off = (t.reshape(-1) for t in (lo_m, sgn, r, off))
    rng = np.random.default_rng(6)
    for pos in range(8):
        fill = rng.integers(0, 7, (lo_m.size, 8)) | (rng.integers(0, 2, (lo_m.size, 8)) << 3)
        rfill = rng.integers(0, 16, (lo_m.size, 8))
        offfill = rng.integers(0, 2, (lo_m.size, 8))
        L, R, O = fill.copy(), rfill.copy(), offfill.copy()
        L[:, pos], R[:, pos], O[:, pos] = lo_m | (sgn << 3), r, off
        got = nibbles(guided_full_pack8(to_nibble_words(L), to_nibble_words(O), to_nibble_words(R)))
        same = (R >> 3) == (L >> 3)
        want = L + (O & same & ((R & 7) > (L & 7)))
        assert np.array_equal(got, want), pos
