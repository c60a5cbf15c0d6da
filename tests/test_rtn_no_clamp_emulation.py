"""The RTN fast path's clamp skip (fp4_numerics.cuh: rtn_needs_no_clamp): a block whose q_max = fl(amax * r),
r = fl(1 / t), is below 6.5 has every quotient fl(|x| / t) below 7, so the RTN grid values stay <= 6 and
e2m1_pack8_abs_x2m14 may skip its min.u16x2 clamp. Emulated in numpy float32 (IEEE round-to-nearest-even) on divisors
t over every binade of the fast path's range [2^-100, 2^100] with random significands, and, for each t, the largest
amax that passes the test (found by stepping one ulp at a time from fl(6.5 t)) and its neighbours: fl(amax / t) < 7
and the reference rounding (formats.e2m1_rn) of every quotient up to it is at most 6. Also: blocks with a normal,
unclamped scale byte pass the test (SPEC 2 per-row g: q_max is about 6), so the shorter code is the common one.
"""
import numpy as np
import torch

from trace_ext import formats

F = np.float32


def _divisors(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    e = rng.integers(-100, 100, n)
    m = rng.uniform(1.0, 2.0, n)
    t = np.ldexp(m, e).astype(F)
    edges = np.array([1.0, 1.5, 2.0 - 2.0**-23, 1.0 + 2.0**-23, 6.0, 448.0 * 2.0**-20], dtype=F)
    return np.concatenate([t, edges])


def _largest_passing_amax(t: np.ndarray) -> np.ndarray:
    """For each t the largest float32 amax with fl(amax * fl(1 / t)) < 6.5 (a few ulp steps from fl(6.5 t))."""
    r = (F(1) / t).astype(F)
    a = (F(6.5) * t).astype(F)
    for _ in range(8):  # step down while the test fails, then up while the next float still passes
        bad = (a * r).astype(F) >= F(6.5)
        a = np.where(bad, np.nextafter(a, F(0)), a)
    for _ in range(8):
        nxt = np.nextafter(a, F(np.inf))
        ok = (nxt * r).astype(F) < F(6.5)
        a = np.where(ok, nxt, a)
    assert bool(((a * r).astype(F) < F(6.5)).all())
    assert bool(((np.nextafter(a, F(np.inf)) * r).astype(F) >= F(6.5)).all())
    return a


def test_no_quotient_reaches_seven_below_the_test():
    t = _divisors(200_000, 1)
    a = _largest_passing_amax(t)
    q = (a / t).astype(F)  # the largest quotient of a block that skips the clamp
    assert bool((q < F(7.0)).all()), float(q.max())
    assert float(q.max()) < 6.5 * (1 + 2.0**-21)
    # every quotient of such a block rounds to at most 6 (RTN is monotone: the largest one decides)
    codes = formats.e2m1_rn(torch.from_numpy(q))
    assert bool((formats.e2m1_to_float(codes) <= 6.0).all())
    # without the saturation of e2m1_rn (which the kernels' grid rounding does not have), 7 and above would give 8
    assert bool((torch.from_numpy(q) < 7.0).all())
    # and the quotients just above the test's boundary are the ones the clamp path keeps
    q_up = (np.nextafter(a, F(np.inf)) / t).astype(F)
    assert bool((q_up >= F(6.5) * F(1 - 2.0**-22)).all())


def test_normal_scale_bytes_pass_the_test():
    """SPEC 2 with per-row g: each block's q_max = fl(amax_b * fl(1 / t_b)) stays below 6.5 when its scale byte is a
    normal E4M3 value (the E4M3 rounding of d / g is within 2^-4 of it), including the row's largest block."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(512, 4096, generator=gen) * torch.exp2(torch.randint(-30, 30, (512, 1), generator=gen).float())
    x = x.reshape(512, 256, 16) * torch.exp2(-torch.randint(0, 14, (512, 256, 1), generator=gen).float())
    x = x.reshape(512, 4096)
    from trace_ext import reference as ref

    q = ref.nvfp4_quantize(x)
    s = formats.e4m3_to_float(q.scales).numpy().astype(F)
    g = q.g.numpy().astype(F)[:, None]
    t = (s * g).astype(F)
    amax = x.reshape(512, 256, 16).abs().amax(-1).numpy().astype(F)
    normal = (q.scales >= 8).numpy()
    r = (F(1) / t[normal]).astype(F)
    q_max = (amax[normal] * r).astype(F)
    assert normal.mean() > 0.9
    assert bool((q_max < F(6.5)).all()), float(q_max.max())
