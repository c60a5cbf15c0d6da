"""The quantize kernels' RTN of TRACE_EXT_QUANT_IMPL=lean (fp4_numerics.cuh: e2m1_rn_grid_pow2_x2m14, one magic add
with a power-of-two magic number M = 2^max(e(u), -14) * 2^22 picked from u's exponent bits, by two FMAs), then the
same saturating pack as the default (e2m1_pack8_abs_x2m14<true>), emulated in numpy against the reference rounding of
SPEC 1 (formats.e2m1_rn, codes with sign). Protects the algorithm on machines without a GPU; the GPU tests check the
kernel. Domain: the RTN fast path's quotients, |v| up to 2^100.

FMA emulation: fl32(E * 2^22 + u) is computed as float32(float64 sum). For u >= 2^-14 the sum is exact in float64
(M = 2^(e+22), u's ulp 2^(e-23): 45 bits). For u < 2^-14 (M = 256) it is exact when u >= 2^-21 (ulp >= 2^-44); below,
the exact sum lies in (256, 256 + 2^-21), float64 rounding keeps it there (both ends are float64 numbers), far below
the first float32 rounding boundary 256 + 2^-16, so float32 gives 256, the correctly rounded sum, either way.
fl(u + M) - M is exact (asserted), so its emulation is too.
"""
import numpy as np

from test_rtn_sat_pack_emulation import pack8_abs, reference_codes, rows_with_random_signs

F = np.float32
SCALE = F(2.0**-14)


def grid_pow2(u: np.ndarray) -> np.ndarray:
    """e2m1_rn_grid_pow2_x2m14 for float32 u >= 0 (two FMAs emulated through float64)."""
    e = np.maximum(u.view(np.uint32) & np.uint32(0x7F800000), np.uint32(0x38800000)).view(F)
    m = e.astype(np.float64) * 2.0**22
    s = (m + u.astype(np.float64)).astype(F)
    out = (s.astype(np.float64) - m).astype(F)
    assert np.array_equal(out.astype(np.float64), s.astype(np.float64) - m), "fl(u + M) - M must be exact"
    return out


def kernel_codes(v: np.ndarray) -> np.ndarray:
    """Codes (with sign) of rows of 8 quotients v [n, 8] as the lean RTN fast path forms them."""
    u = (np.abs(v) * SCALE).astype(F)
    words = pack8_abs(grid_pow2(u), v.view(np.uint32))
    return ((words[:, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF).astype(np.int64)


def check(mags: np.ndarray, seed: int) -> None:
    v = rows_with_random_signs(mags, seed)
    got, want = kernel_codes(v), reference_codes(v)
    bad = got != want
    assert not bad.any(), (v[bad][:4], got[bad][:4], want[bad][:4])


def test_pow2_magic_strided_sweep_up_to_2_pow_100():
    bits = np.arange(0, int(np.array([2.0**100], dtype=F).view(np.uint32)[0]), 127, dtype=np.uint32)
    check(bits.view(F), 0)


def test_pow2_magic_every_float_near_each_midpoint_binade_edge_and_saturation_edge():
    """Every rounding midpoint, every binade edge of the grid (0.5 .. 8, where M changes), 6, 7 (rounds to 8 before
    saturating), the 2^-14 edge of u (v = 1: E stops at 2^-14 below), and the fp16 overflow edge of u."""
    centers = (0.25, 0.5, 0.75, 1.0, 1.25, 1.75, 2.0, 2.5, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 65504.0 * 2**14,
               65520.0 * 2**14)
    for i, m in enumerate(centers):
        c = int(np.array([m], dtype=F).view(np.uint32)[0])
        check(np.arange(c - 8192, c + 8193, dtype=np.uint32).view(F), i + 1)


def test_pow2_magic_every_float_below_one_eighth_in_steps_and_subnormals():
    """Zeros, subnormal quotients and tiny u (M = 256 there): every 61st float below 0.125, all subnormals near 0."""
    lo = np.arange(0, 1 << 16, dtype=np.uint32)
    mid = np.arange(0, int(np.array([0.125], dtype=F).view(np.uint32)[0]), 61, dtype=np.uint32)
    check(np.concatenate([lo, mid]).view(F), 99)


def test_pow2_magic_grid_equals_the_default_rounding_below_six():
    """Below the saturation point the grid values themselves (not only the codes) equal e2m1_rn_grid_unsat_x2m14's."""
    from test_rtn_sat_pack_emulation import grid_unsat

    bits = np.arange(0, int(np.array([6.0 * 2**-14], dtype=F).view(np.uint32)[0]), 7, dtype=np.uint32)
    u = bits.view(F)
    assert np.array_equal(grid_pow2(u), grid_unsat(u))
