"""One-shot exhaustive check of the scaled-domain SR / guided rounding (fp4_numerics.cuh: e2m1_floor_grid_x2m14,
e2m1_sr_grid_x2m14) over every float v in [2^-100, 8] and v = 0, against the reference's bracket (formats.e2m1_bracket):
  - the floor's code equals the reference's lo, and a != lo exactly when the reference's hi != lo (guided rounding then
    follows from the packed-code arithmetic, checked over all nibble cases in tests/test_scaled_sr_guided_emulation.py);
  - the SR decision at k = K - 1 and k = K, K = ceil(p 2^24) the reference's threshold (both decisions are monotone in
    k, so this covers every random word).
Values above 8 saturate to a = 6 * 2^-14 (checked by the strided sweeps of the CPU test). Takes ~10 min on one core.
Run: PYTHONPATH=python:tests python tools/exhaustive_scaled_sr_guided.py
"""
import sys
import time

import numpy as np

from trace_ext import formats
import test_scaled_sr_guided_emulation as E

F = np.float32


def main() -> None:
    start = int(np.array([2.0**-100], dtype=F).view(np.uint32)[0])
    stop = int(np.array([8.0], dtype=F).view(np.uint32)[0]) + 1
    chunk = 1 << 23
    t0 = time.time()
    n = 0
    for b0 in [None] + list(range(start, stop, chunk)):
        v = np.zeros(1, dtype=F) if b0 is None else np.arange(b0, min(b0 + chunk, stop), dtype=np.uint32).view(F)
        a = E.scaled_a(v)
        lo = E.floor_grid(a)
        lo_code, hi_code, lo_val, hi_val = (t.numpy() for t in formats.e2m1_bracket(E.ref_a(v)))
        assert np.array_equal(E.codes_of(lo), lo_code), b0
        assert np.array_equal(a != lo, hi_code != lo_code), b0
        a64 = np.minimum(v.astype(np.float64), 6.0)
        width = np.where(hi_code == lo_code, 1.0, hi_val.astype(np.float64) - lo_val)
        K = np.ceil((a64 - lo_val) / width * 2.0**24).astype(np.int64)
        for k in (K - 1, K):
            ok = (k >= 0) & (k < 2**24)
            got = E.codes_of(E.sr_grid(a[ok], (k[ok] << 8) | 0x80))
            want = np.where(k[ok] < K[ok], hi_code[ok], lo_code[ok])
            assert np.array_equal(got, want), b0
        n += v.size
    print(f"all {n} floats agree ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
