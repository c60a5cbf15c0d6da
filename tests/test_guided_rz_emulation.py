"""Guided rounding of TRACE_EXT_QUANT_IMPL=guided-lean (nvfp4_quant_guided_lean_kernel; fp4_numerics.cuh:
e2m1_floor_pair_rz_x2m14, e2m1_guided_lo8_rz_x2m14; quant_nvfp4_flat.cuh: raw_min_nonzero_abs_bits) emulated in numpy
(float16 round-toward-zero, float32 RNE subtraction, byte permutes) against the scaled-domain floor it replaces
(test_scaled_sr_guided_emulation.floor_grid, checked there against the reference) and against the reference's guided
rounding itself. Protects the formulas on machines without a GPU; the GPU tests check the kernel.

Domain as in test_scaled_sr_guided_emulation: v = +-0 or |v| in [2^-100, 2^100] (quantize_block's fast path), a =
min(|v| 2^-14, 6 2^-14). tools/exhaustive_guided_rz.py runs the floor / off-grid check over every float a in
[0, 6 2^-14] (once, when the path was written: all agree).
"""
from __future__ import annotations

import numpy as np

import test_scaled_sr_guided_emulation as E
from test_rtn_sat_pack_emulation import prmt

F = np.float32
H = np.float16


# ---- kernel emulation -----------------------------------------------------------------------------------------


def rz_f16_bits(a: np.ndarray) -> np.ndarray:
    """cvt.rz.f16 of finite float32 values a >= 0: the largest float16 <= a (65504 above it), as uint32 bits."""
    with np.errstate(over="ignore"):
        h = a.astype(H)  # RNE (subnormals included; inf above 65520)
    h = np.where(h.astype(F) > a, np.nextafter(h, H(0)), h)
    return h.view(np.uint16).astype(np.uint32)


def floor_rz(a: np.ndarray) -> np.ndarray:
    """e2m1_floor_pair_rz_x2m14, one lane: fp16 bits of the floor (mantissa bits 0..8 cleared)."""
    return rz_f16_bits(a) & np.uint32(0xFE00)


def half_bits_to_f32(h: np.ndarray) -> np.ndarray:
    return h.astype(np.uint16).view(H).astype(F)  # exact


def off_sign_words(a: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Bits of fl(lo - a): the sign bit is the off-grid bit."""
    return (half_bits_to_f32(h) - a).astype(F).view(np.uint32)


def sign_bytes8(s: np.ndarray):
    se = prmt(prmt(s[:, 0], s[:, 2], 0xFB), prmt(s[:, 4], s[:, 6], 0xFB), 0x5410)
    so = prmt(prmt(s[:, 1], s[:, 3], 0xFB), prmt(s[:, 5], s[:, 7], 0xFB), 0x5410)
    return se, so


def guided_lo8(a: np.ndarray, s: np.ndarray, saturate: bool = False):
    """e2m1_guided_lo8_rz_x2m14<saturate> on rows of 8: a [n, 8] float32 in [0, 6 2^-14] (saturate: any finite a >= 0),
    s [n, 8] sign sources -> (lo, off)."""
    h = floor_rz(a)
    if saturate:
        h = np.minimum(h, 0x0E00)  # min.u16x2 with 0x0E000E00, lane by lane
    hb = h >> 8  # byte_perm 0x7531 keeps the high byte of each half
    even = hb[:, 0] | hb[:, 2] << 8 | hb[:, 4] << 16 | hb[:, 6] << 24
    odd = hb[:, 1] | hb[:, 3] << 8 | hb[:, 5] << 16 | hb[:, 7] << 24
    se, so = sign_bytes8(s)
    oe, oo = sign_bytes8(off_sign_words(a, h))
    lo = ((even >> 1) | ((odd << 3) & 0xFFFFFFFF) | (se & 0x08080808) | (so & 0x80808080)).astype(np.uint32)
    off = ((oe & 0x01010101) | (oo & 0x10101010)).astype(np.uint32)
    return lo, off


def kernel_guided_codes(v: np.ndarray, payload: np.ndarray, kind: str) -> np.ndarray:
    """The kernel's path: compact saturates a before the floor, full after it (e2m1_guided_lo8_rz_x2m14<true>)."""
    if kind == "compact":
        lo, off = guided_lo8(E.scaled_a(v), v.view(np.uint32))
    else:
        lo, off = guided_lo8((np.abs(v) * E.SCALE).astype(F), v.view(np.uint32), saturate=True)
    if kind == "compact":
        byte = (payload.astype(np.uint32) << np.arange(8, dtype=np.uint32)).sum(axis=1).astype(np.uint32)
        words = E.guided_compact_pack8(lo, off, E.bits_to_nibble_lsbs(byte))
    else:
        words = E.guided_full_pack8(lo, off, E.to_nibble_words(payload))
    return E.nibbles(words)


def check_floor_and_off(a: np.ndarray) -> None:
    """The rz floor is the scaled floor (same fp16 bits) and the sign of lo - a is exactly a != lo."""
    want = E.floor_grid(a)
    h = floor_rz(a)
    assert np.array_equal(half_bits_to_f32(h), want), a[half_bits_to_f32(h) != want][:4]
    assert np.array_equal(h, want.astype(H).view(np.uint16).astype(np.uint32))
    off = (off_sign_words(a, h) >> 31).astype(bool)
    assert np.array_equal(off, a != want), a[off != (a != want)][:4]


# ---- tests ------------------------------------------------------------------------------------------------------


def test_rz_floor_and_off_grid_sign_dense_and_strided():
    v = np.concatenate([E.dense_values(), E.strided_values(4099)])
    check_floor_and_off(E.scaled_a(v))


def test_rz_floor_every_float_of_the_fp16_subnormal_and_first_binades_strided():
    """a in [0, 2^-12): the fp16 subnormals (v < 1) and the first normal binades, every 101st float."""
    a = np.arange(0, int(np.array([2.0**-12], dtype=F).view(np.uint32)[0]), 101, dtype=np.uint32).view(F)
    check_floor_and_off(a)


def check_guided(v: np.ndarray, kind: str, seed: int) -> None:
    vv, pay = E.guided_inputs(v, kind, seed)
    got = kernel_guided_codes(vv, pay, kind)
    want = E.ref_guided_codes(vv.reshape(-1), pay.reshape(-1), kind).reshape(-1, 8)
    bad = got != want
    assert not bad.any(), (kind, vv[bad][:4], pay[bad][:4], got[bad][:4], want[bad][:4])


def test_guided_compact_rz_every_bit_both_signs():
    check_guided(np.concatenate([E.dense_values(512), E.strided_values(65537)]), "compact", 12)


def test_guided_full_rz_every_rollout_code_both_signs():
    check_guided(np.concatenate([E.dense_values(128), E.strided_values(262147)]), "full", 13)


def test_saturated_floor_of_unsaturated_quotients():
    """Full's saturation after the floor: min(rz floor of u, 0x0E00) is the floor of min(u, 6 2^-14) for u up to the
    largest quotient of the fast path (v < 2^100), and every u above 6 2^-14 is off the grid only in the off bit."""
    v = np.concatenate([E.dense_values(), E.strided_values(4099), np.array([2.0**99, 2.0**100], dtype=F)])
    u = (np.abs(v) * E.SCALE).astype(F)
    h = np.minimum(floor_rz(u), 0x0E00)
    assert np.array_equal(h, floor_rz(E.scaled_a(v)))
    off = (off_sign_words(u, h) >> 31).astype(bool)
    sat = u > F(6 * 2.0**-14)
    assert np.array_equal(off[~sat], (E.scaled_a(v) != E.floor_grid(E.scaled_a(v)))[~sat]) and off[sat].all()


def test_guided_rz_zeros_grid_points_ties_and_saturation():
    v = np.array([0.0] + list(E.GRID[1:]) + list(E.TIES) + [6.5, 7.0, 1e30, 2.0**-100, 2.0**-99], dtype=F)
    for kind, seed in (("compact", 14), ("full", 15)):
        check_guided(v, kind, seed)
    neg_zero = np.full((1, 8), -0.0, dtype=F)
    lo, off = guided_lo8(E.scaled_a(neg_zero), neg_zero.view(np.uint32))
    assert int(lo[0]) == 0x88888888 and int(off[0]) == 0, "-0: code 8 (sign kept), on the grid"


# ---- raw_min_nonzero_abs_bits: the block's smallest nonzero |x| of 16-bit inputs, two halves at a time --------------


def min_s16x2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    def lanes(w):
        return [((w >> s) & 0xFFFF).astype(np.uint16).view(np.int16).astype(np.int32) for s in (0, 16)]

    (a0, a1), (b0, b1) = lanes(a), lanes(b)
    lo = np.minimum(a0, b0).astype(np.int16).view(np.uint16).astype(np.uint32)
    hi = np.minimum(a1, b1).astype(np.int16).view(np.uint16).astype(np.uint32)
    return (lo | (hi << 16)).astype(np.uint32)


def raw_min_bf16(words: np.ndarray) -> np.ndarray:
    """raw_min_nonzero_abs_bits<bf16> on rows of 8 raw words [n, 8] (16 bf16 values)."""
    m = np.full(words.shape[0], 0x7FFF7FFF, dtype=np.uint32)
    for i in range(words.shape[1]):
        w = ((words[:, i] & np.uint32(0x7FFF7FFF)).astype(np.uint64) + 0x7FFF7FFF).astype(np.uint32)
        m = min_s16x2(m, w)
    m = min_s16x2(m, m >> 16)
    return (((m.astype(np.uint64) << 16) + 0x80010000) & 0xFFFFFFFF).astype(np.uint32)


def raw_min_f16(words: np.ndarray) -> np.ndarray:
    m = np.full(words.shape[0], 0x7FFF7FFF, dtype=np.uint32)
    for i in range(words.shape[1]):
        w = ((words[:, i] & np.uint32(0x7FFF7FFF)).astype(np.uint64) + 0x7FFF7FFF).astype(np.uint32)
        m = min_s16x2(m, w)
    m = min_s16x2(m, m >> 16)
    h = ((m + 0x8001) & 0xFFFF).astype(np.uint16)
    return h.view(H).astype(F).view(np.uint32)


def want_min(halves: np.ndarray, dtype) -> np.ndarray:
    """Float bits of the smallest nonzero |x| per row of 16 halves (0 if none), from the decoded values."""
    if dtype == "bf16":
        vals = (halves.astype(np.uint32) << 16).view(F)
    else:
        vals = halves.astype(np.uint16).view(H).astype(F)
    mag = np.abs(vals)
    mag = np.where(mag == 0, np.inf, mag)
    m = mag.min(axis=1)
    return np.where(np.isinf(m), F(0), m).astype(F).view(np.uint32)


def test_raw_min_nonzero_every_finite_half_in_every_lane():
    """Every finite 16-bit magnitude (and +-0) of bf16 / fp16 in every one of the 16 lanes of a block, with random
    larger / zero / negative companions, and all-zero blocks (0)."""
    rng = np.random.default_rng(21)
    for dtype, top in (("bf16", 0x7F7F), ("f16", 0x7BFF)):
        raw_min = raw_min_bf16 if dtype == "bf16" else raw_min_f16
        h = np.arange(0, top + 1, dtype=np.uint32)
        for lane in range(16):
            halves = rng.integers(0, top + 1, (h.size, 16)).astype(np.uint32)
            halves = np.where(rng.random((h.size, 16)) < 0.3, 0, halves)  # zeros are skipped
            halves[:, lane] = h
            halves |= (rng.integers(0, 2, halves.shape).astype(np.uint32) << 15)  # signs are ignored
            words = (halves[:, 0::2] | (halves[:, 1::2] << 16)).astype(np.uint32)
            assert np.array_equal(raw_min(words), want_min(halves & 0x7FFF, dtype)), (dtype, lane)
        zeros = np.zeros((3, 8), dtype=np.uint32)
        zeros[1] = 0x80008000  # -0
        assert np.array_equal(raw_min(zeros), np.zeros(3, dtype=np.uint32)), dtype


# ---- sign_bytes8_raw16 and bits_to_nibble_lsbs_mul (guided-lean's packing helpers) ----------------------------------


def sign_bytes8_raw16(w: np.ndarray):
    """quant_nvfp4_flat.cuh sign_bytes8_raw16 on raw words [n, 4] (value 2i in the low half of word i)."""
    s03 = prmt(w[:, 0], w[:, 1], 0xFDB9)
    s47 = prmt(w[:, 2], w[:, 3], 0xFDB9)
    return prmt(s03, s47, 0x6420), prmt(s03, s47, 0x7531)


def test_sign_bytes8_raw16_equals_sign_bytes8_of_the_widened_values():
    rng = np.random.default_rng(22)
    halves = rng.integers(0, 1 << 16, (4096, 8)).astype(np.uint32)
    halves[:16] = np.arange(256, dtype=np.uint32).reshape(16, 16)[:, :8] * 0x101  # every sign pattern
    halves[16:272] = ((np.arange(256, dtype=np.uint32)[:, None] >> np.arange(8, dtype=np.uint32)) & 1) << 15  # +-0
    words = (halves[:, 0::2] | (halves[:, 1::2] << 16)).astype(np.uint32)
    want = sign_bytes8((halves << 16).astype(np.uint32))  # the bf16 values widened to float bits
    got = sign_bytes8_raw16(words)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def bits_to_nibble_lsbs_mul(b: np.ndarray) -> np.ndarray:
    b = b.astype(np.uint64)
    even = ((b & 0x55) * 0x00041041) & 0x01010101
    odd = ((b & 0xAA) * 0x00208208) & 0x10101010
    assert int(((b & 0x55) * 0x00041041).max()) < 2**32 and int(((b & 0xAA) * 0x00208208).max()) < 2**32
    return (even | odd).astype(np.uint32)


def test_bits_to_nibble_lsbs_mul_every_byte():
    b = np.arange(256, dtype=np.uint32)
    assert np.array_equal(bits_to_nibble_lsbs_mul(b), E.bits_to_nibble_lsbs(b))
