"""CPU emulation of nvfp4_global_scale_rcp (fp4_numerics.cuh; the lean per-row-g kernel's g): for a finite amax in
[2^-80, FLT_MAX], Markstein's division by 2688 with the correctly rounded fl(1/2688) (q = fl(a r), rem = fma(-q, 2688,
a), fl(q + rem r) by one FMA) equals the reference's g = fl(amax / 2688) (SPEC 2). Exact rational arithmetic on every
binade's edges, mantissas near every rounding midpoint of the quotient, and random mantissas in every binade.
Protects: the fast path of g against a double rounding or a wrong constant (a wrong g changes every code of the row).
"""
from __future__ import annotations

import random
from fractions import Fraction

import numpy as np

RCP_2688 = float.fromhex("0x1.861862p-12")  # kRcpNvfp4GlobalDiv


def rn_f32(v: Fraction) -> Fraction:
    """v rounded to the nearest float32 (ties to even); |v| in the normal range or v == 0."""
    if v <= 0:
        return -rn_f32(-v) if v < 0 else v
    e = v.numerator.bit_length() - v.denominator.bit_length()
    while Fraction(2) ** e > v:
        e -= 1
    while Fraction(2) ** (e + 1) <= v:
        e += 1
    scale = Fraction(2) ** (23 - e)
    n = round(v * scale)  # Fraction.__round__: half to even
    return Fraction(n) / scale


def markstein(a: Fraction) -> Fraction:
    r = Fraction(RCP_2688)
    q = rn_f32(a * r)
    rem = rn_f32(a - q * 2688)  # exact when the theorem holds; rounded like the FMA otherwise
    return rn_f32(rem * r + q)


def f32(bits: int) -> Fraction:
    return Fraction(float(np.array([bits], dtype=np.uint32).view(np.float32)[0]))


def test_rcp_constant_is_correctly_rounded():
    assert rn_f32(Fraction(1, 2688)) == Fraction(RCP_2688)


def test_markstein_global_scale_is_exact():
    rnd = random.Random(7)
    lo = int(np.array([2.0**-80], dtype=np.float32).view(np.uint32)[0])
    hi = 0x7F7FFFFF
    bits = {lo, lo + 1, hi, hi - 1}
    for e in range(lo >> 23, (hi >> 23) + 1):
        base = e << 23
        bits.update({base, base + 1, base + 0x7FFFFF, base + 0x7FFFFE})
        bits.update(base + rnd.randrange(0x800000) for _ in range(12))
    # amax whose quotient lies next to a float32 rounding midpoint: a = (m + 1/2) ulp * 2688 rounded, m random
    for _ in range(3000):
        e = rnd.randrange(-90, 115)
        m = rnd.randrange(1 << 23, 1 << 24)
        mid = (Fraction(2 * m + 1, 2) * Fraction(2) ** (e - 23)) * 2688
        a = rn_f32(mid)
        fb = np.array([float(a)], dtype=np.float32).view(np.uint32)[0]
        for d in (-1, 0, 1):
            bits.add(int(fb) + d)
    bits = sorted(b for b in bits if lo <= b <= hi)
    assert len(bits) > 6000
    bad = [b for b in bits if markstein(f32(b)) != rn_f32(f32(b) / 2688)]
    assert not bad, f"{len(bad)} amax values differ, first {hex(bad[0])}"
