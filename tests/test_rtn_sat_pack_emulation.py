"""The quantize kernels' RTN with saturation after packing (fp4_numerics.cuh: e2m1_rn_grid_unsat_x2m14,
sign_bytes8 + e2m1_pack8_abs_x2m14<true>: unsigned fp16 pairs saturated by min.u16x2, signs placed by prmt with sign
replication), emulated in numpy float32 / float16 (IEEE round-to-nearest-even, overflow to inf as cvt.rn.f16x2.f32)
and a literal model of PTX prmt.b32, against the reference rounding of SPEC 1 (formats.e2m1_rn, codes with sign).
Protects the algorithm on machines without a GPU; the GPU tests check the kernel. Domain: the RTN fast path's
quotients, |v| up to 2^100 (beyond the fp16 range after scaling: those convert to +inf and saturate).
"""
import numpy as np
import torch

from trace_ext import formats

F = np.float32
SCALE = F(2.0**-14)


def grid_unsat(u: np.ndarray) -> np.ndarray:
    """e2m1_rn_grid_unsat_x2m14 for float32 u >= 0."""
    small = ((u + F(256)).astype(F) - F(256)).astype(F)
    p = (u * F(4194305)).astype(F)
    big = (p - (p - u).astype(F)).astype(F)
    return np.where(u < F(2.0**-13), small, big)


def prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    """PTX prmt.b32 default mode: selector nibble n picks byte (nibble & 7) of {b:a}; bit 3 replicates its bit 7."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = np.zeros_like(a)
    for n in range(4):
        nib = (sel >> (4 * n)) & 0xF
        byte = src[nib & 7]
        if nib & 8:
            byte = np.where(byte & 0x80, 0xFF, 0x00).astype(a.dtype)
        out |= byte << (8 * n)
    return out


def pack8_abs(g: np.ndarray, s: np.ndarray, saturate: bool = True) -> np.ndarray:
    """e2m1_pack8_abs_x2m14<saturate>(g, sign_bytes8(s)) on rows of 8: g [n, 8] float32 >= 0, s [n, 8] uint32."""
    with np.errstate(over="ignore"):
        h = g.astype(np.float16).view(np.uint16).astype(np.uint32)
    if saturate:
        h = np.minimum(h, 0x0E00)  # min.u16x2 with 0x0E000E00, lane by lane
    else:
        assert np.array_equal(h.view(np.uint32).astype(np.uint16).view(np.float16).astype(F), g), "exact grid values"
    hb = h >> 8  # byte_perm 0x7531 keeps the high bytes
    even = hb[:, 0] | hb[:, 2] << 8 | hb[:, 4] << 16 | hb[:, 6] << 24
    odd = hb[:, 1] | hb[:, 3] << 8 | hb[:, 5] << 16 | hb[:, 7] << 24
    se = prmt(prmt(s[:, 0], s[:, 2], 0xFB), prmt(s[:, 4], s[:, 6], 0xFB), 0x5410)
    so = prmt(prmt(s[:, 1], s[:, 3], 0xFB), prmt(s[:, 5], s[:, 7], 0xFB), 0x5410)
    return ((even >> 1) | ((odd << 3) & 0xFFFFFFFF) | (se & 0x08080808) | (so & 0x80808080)).astype(np.uint32)


def kernel_codes(v: np.ndarray) -> np.ndarray:
    """Codes (with sign) of rows of 8 quotients v [n, 8] as the RTN fast path forms them."""
    u = (np.abs(v) * SCALE).astype(F)
    words = pack8_abs(grid_unsat(u), v.view(np.uint32))
    return ((words[:, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF).astype(np.int64)


def reference_codes(v: np.ndarray) -> np.ndarray:
    return formats.e2m1_rn(torch.from_numpy(v.reshape(-1))).numpy().astype(np.int64).reshape(v.shape)


def rows_with_random_signs(mags: np.ndarray, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    v = mags.astype(F)
    v = np.where(rng.integers(0, 2, v.size) > 0, -v, v).astype(F)  # -0.0 included where mags has 0
    v = v[rng.permutation(v.size)]
    v = np.concatenate([v, np.zeros((-v.size) % 8, dtype=F)])
    return v.reshape(-1, 8)


def check(mags: np.ndarray, seed: int) -> None:
    v = rows_with_random_signs(mags, seed)
    got, want = kernel_codes(v), reference_codes(v)
    bad = got != want
    assert not bad.any(), (v[bad][:4], got[bad][:4], want[bad][:4])


def test_rtn_sat_strided_sweep_up_to_2_pow_100():
    bits = np.arange(0, int(np.array([2.0**100], dtype=F).view(np.uint32)[0]), 131, dtype=np.uint32)
    check(bits.view(F), 0)


def test_rtn_sat_every_float_near_each_midpoint_and_the_saturation_edges():
    """Every rounding midpoint, 6 (grid top), 7 (the tie that rounds to 8 before saturating), 8, and the fp16
    overflow edge of u (u = 65504 .. 65520, v near 2^30)."""
    centers = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 8.0, 65504.0 * 2**14, 65520.0 * 2**14)
    for i, m in enumerate(centers):
        c = int(np.array([m], dtype=F).view(np.uint32)[0])
        check(np.arange(c - 4096, c + 4097, dtype=np.uint32).view(F), i + 1)


def test_rtn_sat_zeros_keep_their_sign():
    v = np.array([[0.0, -0.0, 0.1, -0.1, 6.0, -6.0, 1e30, -1e30]], dtype=F)
    assert np.array_equal(kernel_codes(v), reference_codes(v))
    assert list(kernel_codes(v)[0]) == [0, 8, 0, 8, 7, 15, 7, 15]


def test_prmt_model_sign_replication():
    a = np.array([0x80000000, 0x7FFFFFFF], dtype=np.uint32)
    b = np.array([0x00000000, 0xFF000000], dtype=np.uint32)
    assert list(prmt(a, b, 0xFB) & 0xFFFF) == [0x00FF, 0xFF00]  # bytes 2, 3 (selector 0: a's byte 0) are unused
    assert list(prmt(a, b, 0x5410)) == [0x00000000, 0x0000FFFF]
