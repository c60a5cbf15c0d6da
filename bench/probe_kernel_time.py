"""Where the time of a short call goes: do_bench's median (what every bench table reports) next to the GPU time of
the call's own kernels (CUPTI timestamps through torch.profiler), with the L2 cleared before every call in both.

For each case of bench/profile_kernels.py (groups quant, gemm, kv, decode, grouped) and for device copies of a few
sizes (the bandwidth anchor), one row: do_bench median (us), the median span from the call's first kernel start to
its last kernel end (us), the sum of its kernel durations (us), the kernel count and the names. do_bench minus span is
what the timing itself adds (event records, launch gap after the cache clear); a span well above the bytes / copy
rate is time inside the kernels (ramp, latency chains, tail).

Run: python bench/probe_kernel_time.py [group ...]   (default: all groups; prints a table, writes
probe_kernel_time_h200.{md,json} under $BENCH_OUT or bench/results/)
"""
from __future__ import annotations

import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import do_bench_cold, env_stamp, print_table, write_results  # noqa: E402
from profile_kernels import CASES  # noqa: E402

CALLS = 30
CLEAR_BYTES = 256 * 1024 * 1024  # as triton.testing.do_bench's cache clear


def kernel_spans(fn, calls: int = CALLS):
    """Per call (after clearing the L2 with a fill kernel): (span us, summed kernel us, kernel names)."""
    cache = torch.empty(CLEAR_BYTES, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            cache.zero_()
            fn()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0),
        key=lambda e: e.time_range.start)
    calls_out, cur = [], None
    for e in kernels:
        is_clear = "fill" in e.name.lower() or "memset" in e.name.lower()
        if is_clear:
            if cur:
                calls_out.append(cur)
            cur = []
        elif cur is not None:
            cur.append(e)
    if cur:
        calls_out.append(cur)
    rows = []
    for ks in calls_out:
        span = ks[-1].time_range.end - ks[0].time_range.start
        busy = sum(k.time_range.end - k.time_range.start for k in ks)
        rows.append((span, busy, tuple(k.name[:60] for k in ks)))
    return rows


def copy_cases():
    for mib in (16, 66, 164, 1024):
        src = torch.empty(mib * 1024 * 1024 // 2, dtype=torch.uint8, device="cuda").random_()
        dst = torch.empty_like(src)
        yield f"copy {mib} MiB read+write", lambda src=src, dst=dst: dst.copy_(src)


def main() -> None:
    groups = sys.argv[1:] or ["copy", *CASES]
    rows = []
    for group in groups:
        cases = copy_cases() if group == "copy" else CASES[group]()
        for label, fn in cases:
            ms = do_bench_cold(fn, rep_ms=100)
            spans = kernel_spans(fn)
            if not spans:
                print(f"{label}: no kernel seen", flush=True)
                continue
            span = statistics.median(s for s, _, _ in spans)
            busy = statistics.median(b for _, b, _ in spans)
            names = spans[len(spans) // 2][2]
            row = {"group": group, "case": label, "do_bench_us": round(ms * 1e3, 2), "span_us": round(span, 2),
                   "kernel_us": round(busy, 2), "timing_adds_us": round(ms * 1e3 - span, 2),
                   "kernels": len(names), "names": " | ".join(names)}
            rows.append(row)
            print(row, flush=True)
    print_table(rows)
    write_results("probe_kernel_time_h200", rows, env_stamp(),
                  "do_bench median vs CUPTI kernel span per call (L2 cleared before each call in both; median of "
                  f"{CALLS} calls)")


if __name__ == "__main__":
    main()
