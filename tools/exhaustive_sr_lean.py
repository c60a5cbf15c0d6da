"""One-shot exhaustive check of the lean SR element routine (csrc/include/trace_ext/quant_sr_elems.cuh:
sr_lean_pre_floor_x2m14 + cvt.rz.f16 + min.u16x2, emulated in tests/test_sr_lean_emulation.py) over every float v in
[2^-100, 8] and v = 0, against the reference's threshold: hi iff k < K = ceil(p 2^24) (formats.e2m1_bracket, exact in
float64). The routine's code falls monotonically as k grows (y = fl_ru(u + (2^24 - k) c) does), so k = K - 1 (hi) and
k = K (lo) decide every word of each value; both are checked with the word's low byte 0x00 and 0xFF. Above 8 (code 7
for every word) a stride-61 sweep up to 2^100 with k = 0 and 2^24 - 1. Run once when the routine was written (5f60fa8):
all 864026626 floats agree, 13339262 above 8 give code 7 (380 s on one core).
Run: PYTHONPATH=python:tests python tools/exhaustive_sr_lean.py
"""
import sys
import time

import numpy as np

import test_scaled_sr_guided_emulation as E
import test_sr_lean_emulation as L

F = np.float32
U32 = np.uint32


def check_chunk(v: np.ndarray) -> None:
    lo, hi, K = L.thresholds(v)
    for k in (K - 1, K):
        ok = (k >= 0) & (k < 2**24)
        want = np.where(k[ok] < K[ok], hi[ok], lo[ok])
        for low in (0x00, 0xFF):
            got = L.lean_codes(v[ok], ((k[ok] << 8) | low).astype(U32))
            bad = got != want
            assert not bad.any(), (v[ok][bad][:4], k[ok][bad][:4], got[bad][:4], want[bad][:4])


def main() -> None:
    start = E.f32_bits(2.0**-100)
    stop = E.f32_bits(8.0) + 1
    chunk = 1 << 22
    t0 = time.time()
    n = 0
    check_chunk(np.zeros(1, dtype=F))
    for b0 in range(start, stop, chunk):
        v = np.arange(b0, min(b0 + chunk, stop), dtype=U32).view(F)
        check_chunk(v)
        n += v.size
        if (b0 - start) % (64 * chunk) == 0:
            print(f"  {v[-1]:.3e} ({n} floats, {time.time() - t0:.0f} s)", flush=True)
    big = np.arange(stop, E.f32_bits(2.0**100) + 1, 61, dtype=U32).view(F)
    for w in (0x000000FF, 0xFFFFFF00):
        assert np.array_equal(L.lean_codes(big, np.full(big.shape, w, dtype=U32)), np.full(big.shape, 7))
    print(f"all {n + 1} floats in {{0}} u [2^-100, 8] agree at k = K - 1 and K; {big.size} above 8 give code 7 "
          f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
