"""How much of a mid-size kernel's cold-L2 time is the L2 flush's own write-back (H200 diagnosis, not a record).

triton.testing.do_bench (our timing of record) empties the L2 before every timed call by zeroing a 256 MB buffer:
afterwards the L2 holds up to its capacity (~50 MB) of DIRTY lines of that buffer, and the timed kernel's first
reads evict them, i.e. it pays their write-back to DRAM. For a 2 GB copy (the bandwidth reference) that is ~2% more
traffic; for a 150 MB kernel up to a third. This script times the same calls three ways, each the median over REPS
calls with CUDA events around the call, as do_bench does:
- zero:  the 256 MB buffer zeroed before each call (do_bench's flush: L2 cold and dirty);
- read:  the 256 MB buffer summed before each call instead (L2 cold and clean: nothing of the kernel's data, no
         dirty lines);
- do_bench: triton.testing.do_bench itself (should equal "zero").
Cases: device copies of 64 MB, 150 MB and 1 GB (src + dst), the first bench_kv decode case (B32 Hq32 Hkv4 S8K),
NVFP4 RTN per-row quantize at 2^26 and 2^28 bf16 elements, torch SDPA on the bf16 K/V of the decode case.
Run from the repo root with the package installed:  python bench/bench_flush_effect.py   (~30 s)
"""
from __future__ import annotations

import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kv import D, decode_bytes, random_cache  # noqa: E402
from common import do_bench_cold, env_stamp, print_table, require_kernels_usable, write_results  # noqa: E402

import trace_ext  # noqa: E402, F401

REPS = 200
FLUSH_BYTES = 256 * 1024 * 1024


def timed(fn, flush) -> float:
    """Median ms of fn over REPS calls, each after flush(), CUDA events around fn only."""
    for _ in range(5):
        flush()
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(REPS)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(REPS)]
    for i in range(REPS):
        flush()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def main() -> None:
    require_kernels_usable()
    buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    sink = torch.empty((), dtype=torch.int64, device="cuda")
    flushes = {
        "zero": lambda: buf.zero_(),
        "read": lambda: torch.sum(buf, dim=0, dtype=torch.int64, out=sink),
    }
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for mb in (64, 150, 1024):
        src = torch.empty(mb * 1024 * 1024 // 2, dtype=torch.uint8, device="cuda").random_(generator=gen)
        dst = torch.empty_like(src)
        cases.append((f"copy {mb} MB (src + dst)", 2 * src.numel(), lambda s=src, d=dst: d.copy_(s)))
    op = torch.ops.trace_ext
    B, Hq, Hkv, S = 32, 32, 4, 8192
    kc, ks, vc, vs, table, seq_lens = random_cache(B, Hkv, S, gen)
    q = torch.randn(B, Hq, D, device="cuda", generator=gen).to(torch.bfloat16)
    kv_bytes = decode_bytes(B, Hq, Hkv, S)
    cases.append(("kv decode B32 Hq32 Hkv4 S8K", kv_bytes,
                  lambda: op.fp4kv_decode_attention(q, kc, ks, vc, vs, table, seq_lens, 1.0 / math.sqrt(D), 0.01,
                                                    0.02, 0)))
    kb_ = torch.randn(B, Hkv, S, D, device="cuda", generator=gen).to(torch.bfloat16)
    vb_ = torch.randn(B, Hkv, S, D, device="cuda", generator=gen).to(torch.bfloat16)
    q4 = q[:, :, None]
    cases.append(("sdpa bf16 B32 Hq32 Hkv4 S8K", 2 * kb_.numel() * 2 + 2 * q.numel() * 2,
                  lambda: torch.nn.functional.scaled_dot_product_attention(q4, kb_, vb_, scale=1.0 / math.sqrt(D),
                                                                           enable_gqa=True)))
    for R in (16384, 65536):
        x = torch.randn(R, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        n = x.numel()
        cases.append((f"nvfp4 rtn per-row quantize {R}x4096", 2 * n + n // 2 + n // 16 + 4 * R,
                      lambda x=x: op.nvfp4_quantize(x, None, 0, 0, 0, None, None, None, False, False)))
    rows = []
    for name, nbytes, fn in cases:
        ms = {k: timed(fn, f) for k, f in flushes.items()}
        ms["do_bench"] = do_bench_cold(fn)
        row = {"case": name, "MB": nbytes / 1e6}
        for k, v in ms.items():
            row[f"{k} us"] = 1e3 * v
            row[f"{k} GB/s"] = nbytes / (v * 1e-3) / 1e9
        row["zero - read us"] = 1e3 * (ms["zero"] - ms["read"])
        rows.append(row)
    print_table(rows)
    notes = (f"median of {REPS} calls per column, CUDA events around the call; flush before each call: zero = "
             f"{FLUSH_BYTES >> 20} MB buffer zeroed (do_bench's way: L2 cold and dirty), read = the same buffer summed "
             "(L2 cold and clean); do_bench = triton.testing.do_bench (the timing of record)")
    path = write_results("flush_effect_h200", rows, env_stamp("python bench/bench_flush_effect.py"), notes)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
