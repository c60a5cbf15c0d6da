"""The quantize kernels' RTN fast path (fp4_numerics.cuh: e2m1_rn_grid_x2m14 + e2m1_pack8_x2m14) emulated in
numpy float32 / float16 (IEEE round-to-nearest-even, like the __f*_rn intrinsics and cvt.rn.f16x2.f32), against
the reference rounding of SPEC 1. Protects the algorithm on machines without a GPU; the GPU tests check the kernel.
A strided sweep of every non-negative float plus every float in [0, 8) near the rounding midpoints (the full
exhaustive sweep, ~1 min, was run once when the path was written).
"""
import numpy as np
import torch

from trace_ext import formats

F = np.float32


def grid_x2m14(v):
    """e2m1_rn_grid_x2m14(v * 2^-14) for float32 v >= 0 (the kernel computes u directly by the scaled division)."""
    u = (v * F(2.0**-14)).astype(F)
    a = np.minimum(u, F(6 * 2.0**-14))
    small = ((a + F(256)).astype(F) - F(256)).astype(F)
    p = (a * F(4194305)).astype(F)
    big = (p - (p - a).astype(F)).astype(F)
    return np.where(a < F(2.0**-13), small, big)


def codes_of(v):
    g = grid_x2m14(v)
    h = g.astype(np.float16)
    assert np.array_equal(h.astype(F), g), "grid values must be exact in fp16"
    return (h.view(np.uint16) >> 9) & 7


def reference_codes(v):
    return formats.e2m1_rn_magnitude(torch.from_numpy(v.astype(np.float32))).numpy()


def test_rtn_x2m14_strided_sweep_of_all_nonnegative_floats():
    bits = np.arange(0, 0x7F800001, 127, dtype=np.uint32)
    v = bits.view(F)
    assert np.array_equal(codes_of(v), reference_codes(v))


def test_rtn_x2m14_every_float_near_each_midpoint():
    for m in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0):
        c = int(np.array([m], dtype=F).view(np.uint32)[0])
        v = np.arange(c - 4096, c + 4097, dtype=np.uint32).view(F)
        assert np.array_equal(codes_of(v), reference_codes(v)), m


def test_pack8_layout_matches_nibble_order():
    rng = np.random.default_rng(0)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=F) * F(2.0**-14)
    for _ in range(200):
        codes = rng.integers(0, 16, 8)
        q = grid[codes & 7].copy()
        q[(codes & 8) > 0] *= F(-1)  # -0.0 for a negative zero code
        h = q.astype(np.float16).view(np.uint16).astype(np.uint32)
        w02, w46 = h[0] | h[2] << 16, h[4] | h[6] << 16
        w13, w57 = h[1] | h[3] << 16, h[5] | h[7] << 16
        hb = lambda w: [(w >> 8) & 0xFF, (w >> 24) & 0xFF]  # noqa: E731 - bytes 1 and 3 (byte_perm 0x7531)
        even = sum(int(b) << (8 * i) for i, b in enumerate(hb(w02) + hb(w46)))
        odd = sum(int(b) << (8 * i) for i, b in enumerate(hb(w13) + hb(w57)))
        word = (((even >> 1) | (even >> 4)) & 0x0F0F0F0F) | (((odd << 3) | odd) & 0xF0F0F0F0)
        assert word == sum(int(c) << (4 * i) for i, c in enumerate(codes))
