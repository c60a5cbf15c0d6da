"""One-shot exhaustive check of the guided-lean floor / off-grid bits (fp4_numerics.cuh: e2m1_floor_pair_rz_x2m14,
e2m1_guided_lo8_rz_x2m14) over every float a in [0, 6 * 2^-14] (the kernel's a = min(|v| 2^-14, 6 2^-14); a superset
of its domain, which has no subnormal a): the fp16 round-toward-zero floor with mantissa bits 0..8 cleared equals the
scaled-domain floor e2m1_floor_grid_x2m14 (its code checked against the reference's bracket by
tools/exhaustive_scaled_sr_guided.py), and the sign of fl(lo - a) is exactly a != lo. The packed-code arithmetic on top
is the same as the default's (tests/test_scaled_sr_guided_emulation.py checks every nibble case). Guided full floors
the unsaturated u and saturates the fp16 floors (min with 6 * 2^-14): monotone, so equal to the floor of min(u, 6 2^-14)
checked here (tests/test_guided_rz_emulation.py sweeps u above 6 2^-14). ~4 min on one core.
Run: PYTHONPATH=python:tests python tools/exhaustive_guided_rz.py
"""
import time

import numpy as np

import test_guided_rz_emulation as G

F = np.float32


def main() -> None:
    stop = int(np.array([6 * 2.0**-14], dtype=F).view(np.uint32)[0]) + 1
    chunk = 1 << 23
    t0 = time.time()
    n = 0
    for b0 in range(0, stop, chunk):
        a = np.arange(b0, min(b0 + chunk, stop), dtype=np.uint32).view(F)
        G.check_floor_and_off(a)
        n += a.size
    print(f"ok: {n} floats a in [0, 6 * 2^-14] ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
