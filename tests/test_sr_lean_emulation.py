"""The lean SR element routine (csrc/include/trace_ext/quant_sr_elems.cuh: sr_elems_lean_x2m14, sr_lean_pre_floor_x2m14,
philox4x32_10_scheduled_not) emulated in numpy with its exact arithmetic (the add-and-max on u's exponent bits, the
subnormal multiplier 2^24 - k, one round-up FMA done exactly by TwoSum, the bit predecessor, cvt.rz.f16, min.u16x2,
byte permutes) against the reference's SR decision (python/trace_ext/reference.py: _sr_magnitude) and the current
scaled path (test_scaled_sr_guided_emulation.sr_grid). Protects the formulas on machines without a GPU.

Domain as in test_scaled_sr_guided_emulation: v = +-0 or |v| in [2^-100, 2^100] (quantize_block's fast path), u =
|v| 2^-14 (exact), not clamped. The routine's decision is "k below a threshold" (y = fl_ru(u + (2^24 - k) c) falls as k
grows, and the code is a monotone function of y), as is the reference's (hi iff k < K = ceil(p 2^24)); so k = K - 1 and
k = K decide every word of a value. tools/exhaustive_sr_lean.py runs that check over every float v in [2^-100, 8].
"""
from __future__ import annotations

import numpy as np
import torch

import test_scaled_sr_guided_emulation as E
from test_guided_rz_emulation import rz_f16_bits, sign_bytes8
from trace_ext import formats, philox
from trace_ext import reference as ref

F = np.float32
U32 = np.uint32
SAT16 = 0x0E00  # fp16 bits of 6 * 2^-14


# ---- kernel emulation -----------------------------------------------------------------------------------------


def c_bits(u: np.ndarray) -> np.ndarray:
    """__viaddmax_s32(bits(u) & 0x7F800000, 124 << 23, 0x76800000): max(2^e(u) 2^124, 2^110) as float bits (int32
    arithmetic: an exponent field past 255 wraps to a negative int and takes 2^110; exactly 255 gives +inf)."""
    e = (u.view(U32) & U32(0x7F800000)).astype(np.int64)
    s = (e + (124 << 23) + 2**31) % 2**32 - 2**31  # 32-bit wrap-around add, signed
    return np.maximum(s, 0x76800000).astype(np.int64).astype(U32)


def fma_ru_f32(b: np.ndarray, c: np.ndarray, u: np.ndarray) -> np.ndarray:
    """fl_ru(b * c + u) in float32 for b, c, u float32 >= 0 with b * c exact in float64 (b a subnormal, c a power of
    two or +inf). The exact sum is s + err (TwoSum in float64); round it up to float32."""
    bc = b.astype(np.float64) * c.astype(np.float64)
    u64 = u.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = u64 + bc
        bb = s - u64
        err = (u64 - (s - bb)) + (bc - bb)
        f = s.astype(F)  # RNE
        below = (f.astype(np.float64) - s) < err  # f < s + err (the difference f - s is exact: Sterbenz)
    f = np.where(below, np.nextafter(f, F(np.inf)), f)
    return np.where(np.isinf(bc), F(np.inf), f).astype(F)


def pre_floor(u: np.ndarray, nw: np.ndarray) -> np.ndarray:
    """sr_lean_pre_floor_x2m14(u, nw): pred(fl_ru(u + B 2^-149 C)), B = (nw >> 8) + 1, as float32."""
    b = ((nw.astype(U32) >> U32(8)) + U32(1)).astype(U32).view(F)  # the float with bits B: B 2^-149 (exact)
    y = fma_ru_f32(b, c_bits(u).view(F), u)
    return (y.view(U32) - U32(1)).view(F)


def lean_h(v: np.ndarray, words: np.ndarray) -> np.ndarray:
    """One lane: min.u16x2(cvt.rz.f16(pre_floor), 0x0E00), the fp16 bits before the pack (code at bits 9..11)."""
    u = (np.abs(v) * E.SCALE).astype(F)
    nw = ~words.astype(U32)
    return np.minimum(rz_f16_bits(pre_floor(u, nw)), U32(SAT16))


def lean_codes(v: np.ndarray, words: np.ndarray) -> np.ndarray:
    """Magnitude codes of the lean routine, element by element (no pack)."""
    return ((lean_h(v, words) >> U32(9)) & U32(7)).astype(np.int64)


def lean_pack8(v: np.ndarray, words: np.ndarray) -> np.ndarray:
    """sr_elems_lean_x2m14's word for rows of 8 elements: v [n, 8] float32, words [n, 8] (the Philox words)."""
    h = lean_h(v.reshape(-1), words.reshape(-1)).reshape(v.shape)
    hb = h >> U32(8)  # byte_perm 0x7531 keeps the high byte of each half: [0000 c2 c1 c0 g]
    even = hb[:, 0] | hb[:, 2] << U32(8) | hb[:, 4] << U32(16) | hb[:, 6] << U32(24)
    odd = hb[:, 1] | hb[:, 3] << U32(8) | hb[:, 5] << U32(16) | hb[:, 7] << U32(24)
    codes = ((even >> U32(1)).astype(np.int64) + ((odd << U32(3)) & U32(0xFFFFFFFF)).astype(np.int64)) & 0xFFFFFFFF
    assert not np.any((even >> U32(1)).astype(np.int64) & ((odd << U32(3)) & U32(0xFFFFFFFF)).astype(np.int64))
    se, so = sign_bytes8(v.view(U32))
    return ((codes.astype(U32) & U32(0x77777777)) | (se & U32(0x08080808)) | (so & U32(0x80808080))).astype(U32)


# ---- reference --------------------------------------------------------------------------------------------------


def ref_codes(v: np.ndarray, words: np.ndarray) -> np.ndarray:
    """Reference codes with sign (SPEC 4)."""
    mag = E.ref_sr_codes(v, words)
    return mag | (np.signbit(v).astype(np.int64) << 3)


def thresholds(v: np.ndarray):
    """(lo code, hi code, K): the reference rounds to hi iff k < K (K = ceil(p 2^24), exact in float64)."""
    a64 = np.minimum(np.abs(v).astype(np.float64), 6.0)
    lo_code, hi_code, lo_val, hi_val = (t.numpy() for t in formats.e2m1_bracket(E.ref_a(v)))
    width = np.where(hi_code == lo_code, 1.0, hi_val.astype(np.float64) - lo_val)
    K = np.ceil((a64 - lo_val) / width * 2.0**24).astype(np.int64)
    return lo_code.astype(np.int64), hi_code.astype(np.int64), K


def check_threshold_words(v: np.ndarray) -> None:
    """k = K - 1 (hi) and k = K (lo), and k = 0 / 2^24 - 1, each with low bytes 0x00 and 0xFF, element by element."""
    lo, hi, K = thresholds(v)
    for k in (K - 1, K, np.zeros_like(K), np.full_like(K, 2**24 - 1)):
        ok = (k >= 0) & (k < 2**24)
        want = np.where(k[ok] < K[ok], hi[ok], lo[ok])
        for low in (0x00, 0xFF):
            got = lean_codes(v[ok], ((k[ok] << 8) | low).astype(U32))
            bad = got != want
            assert not bad.any(), (v[ok][bad][:4], k[ok][bad][:4], got[bad][:4], want[bad][:4])


def rows_of_8(v: np.ndarray, words: np.ndarray, seed: int):
    """Shuffle values / words into rows of 8 (every nibble position sees every case); pad with +0."""
    perm = np.random.default_rng(seed).permutation(v.size)
    v, words = v[perm], words[perm]
    pad = (-v.size) % 8
    v = np.concatenate([v, np.zeros(pad, dtype=F)])
    words = np.concatenate([words, np.zeros(pad, dtype=words.dtype)])
    return v.reshape(-1, 8), words.reshape(-1, 8)


def check_packed(v: np.ndarray, words: np.ndarray, seed: int) -> None:
    vv, ww = rows_of_8(v, words, seed)
    got = E.nibbles(lean_pack8(vv, ww.astype(U32)))
    want = ref_codes(vv.reshape(-1), ww.reshape(-1).astype(np.int64)).reshape(-1, 8)
    bad = got != want
    assert not bad.any(), (vv[bad][:4], ww[bad][:4], got[bad][:4], want[bad][:4])


# ---- tests ------------------------------------------------------------------------------------------------------


def test_threshold_words_dense_around_grid_ties_binade_edges_and_strided():
    """Every float within 1024 ulps of each grid point, tie, binade edge and domain end, plus a strided sweep of
    [2^-100, 2^100]: the decision at k = K - 1, K (and k = 0, 2^24 - 1) equals the reference's."""
    check_threshold_words(np.concatenate([E.dense_values(1024), E.strided_values(16411)]))


def test_small_range_down_to_2m100():
    """v < 0.25 (lo = 0, p = v 2^25 not an integer in general: the threshold is its ceiling): dense runs at the
    binade edges 2^-k down to 2^-100 and random values."""
    edges = [2.0**-e for e in range(2, 101)]
    out = []
    for c in edges:
        b = E.f32_bits(c)
        out.append(np.arange(b - 64, b + 65, dtype=U32).view(F))
    rng = np.random.default_rng(11)
    lo, hi = E.f32_bits(2.0**-100), E.f32_bits(0.25)
    out.append(rng.integers(lo, hi, 200_000, dtype=np.int64).astype(U32).view(F))
    v = np.concatenate(out)
    check_threshold_words(v[(v >= F(2.0**-100)) & (v <= F(0.25))])


def test_saturation_and_wrapped_exponents_up_to_2p100():
    """v >= 6 is code 7 for every word: through the unclamped u, including the exponents where C becomes +inf (u's
    field 131) or wraps to a negative int (fields >= 132), and v up to 2^100."""
    rng = np.random.default_rng(12)
    fields = np.arange(E.f32_bits(6.0) >> 23, (E.f32_bits(2.0**100) >> 23) + 1)
    v = ((fields[:, None] << 23) | rng.integers(0, 2**23, (fields.size, 64))).reshape(-1).astype(U32).view(F)
    v = np.concatenate([v[(v >= F(6.0)) & (v <= F(2.0**100))], np.array([6.0, 2.0**100], dtype=F)])
    for w in (0, 0xFF, 0x7FFFFF00, 0xFFFFFFFF):
        words = np.full(v.shape, w, dtype=U32)
        assert np.array_equal(lean_codes(v, words), np.full(v.shape, 7))
    u = (v * E.SCALE).astype(F)
    assert (c_bits(u).view(F) == np.inf).any() and ((c_bits(u) == 0x76800000) & (v > 64)).any()


def test_packed_words_with_signs_and_zeros_random_words():
    """Full words (pack, signs of x, -0 included) on rows of 8 with random Philox words and threshold words."""
    rng = np.random.default_rng(13)
    v = np.concatenate([E.dense_values(256), E.strided_values(65537), np.array([0.0, 6.0, 7.0, 1e30], dtype=F)])
    v = E.with_signs(v)
    check_packed(v, rng.integers(0, 2**32, v.shape, dtype=np.int64), 14)
    _, _, K = thresholds(v)
    for k in (K - 1, K):
        kk = np.clip(k, 0, 2**24 - 1)
        check_packed(v, (kk << 8) | rng.integers(0, 256, v.shape), 15)


def test_same_codes_as_the_current_scaled_path():
    """Element by element equal to e2m1_sr_grid_x2m14 (what quantize_elems' scaled SR path produces) on random words."""
    rng = np.random.default_rng(16)
    v = E.with_signs(np.concatenate([E.dense_values(256), E.strided_values(65537)]))
    words = rng.integers(0, 2**32, v.shape, dtype=np.int64)
    old = E.codes_of(E.sr_grid(E.scaled_a(v), words))
    assert np.array_equal(lean_codes(v, words.astype(U32)), old)


def philox_not_emulated(counter, key):
    """philox4x32_10_scheduled_not: nine rounds as philox4x32_10, the last with lop3 0x69 = ~(a ^ b ^ c) and the
    complemented low products."""
    m = 0xFFFFFFFF
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for rnd in range(10):
        hi0, lo0 = philox._mulhilo(c0, philox.PHILOX_M0)
        hi1, lo1 = philox._mulhilo(c2, philox.PHILOX_M1)
        if rnd < 9:
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        else:
            c0, c1, c2, c3 = ~(hi1 ^ c1 ^ k0) & m, ~lo1 & m, ~(hi0 ^ c3 ^ k1) & m, ~lo0 & m
        k0 = (k0 + philox.PHILOX_W0) & m
        k1 = (k1 + philox.PHILOX_W1) & m
    return c0, c1, c2, c3


def test_philox_not_is_the_complement_of_spec_philox():
    """The complemented Philox gives ~w of SPEC 4's words: known-answer vectors and random counters / keys."""
    kat = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
           ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
           ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, out in kat:
        got = philox_not_emulated(tuple(torch.tensor([c]) for c in ctr), tuple(torch.tensor([k]) for k in key))
        assert [int(g[0]) for g in got] == [~o & 0xFFFFFFFF for o in out]
    rng = np.random.default_rng(17)
    ctr = tuple(torch.from_numpy(rng.integers(0, 2**32, 4096, dtype=np.int64)) for _ in range(4))
    key = tuple(torch.from_numpy(rng.integers(0, 2**32, 4096, dtype=np.int64)) for _ in range(2))
    for a, b in zip(philox_not_emulated(ctr, key), philox.philox4x32_10(ctr, key)):
        assert torch.equal(a, ~b & 0xFFFFFFFF)
