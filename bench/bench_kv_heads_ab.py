"""A/B of the FP4-KV decode kernels on the H200: the 4-warp heads kernel (TRACE_EXT_KV_DECODE_IMPL=heads: one warp
per KV head; the default until 2071576) against heads8 (the default since; =heads8: 8 warps per CTA, two per KV head
on alternate 16-token tiles of the same shared ring, merged at the end), on the four decode cases of bench/bench_kv.py,
plus a split sweep of heads8.

Timing: bench.common.do_bench_cold (median, L2 flushed before every call), the compiled op called directly; the two
variants are timed alternately (ROUNDS rounds per case, the switch is read per call) and each reports the median of
its rounds, so clock or thermal drift hits both alike. Bytes, GB/s and % of copy as in bench_kv.py. The "max |diff|"
column is the largest output difference heads8 vs heads (bf16; both are the same arithmetic per tile, summed in a
different tile order).

Run from the repo root with the package installed:  python bench/bench_kv_heads_ab.py   (~40 s)
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kv import D, _impl_env, decode_ab_start, decode_case_inputs  # noqa: E402
from common import do_bench_cold, env_stamp, print_table, write_results  # noqa: E402

import trace_ext  # noqa: E402

ROUNDS = 3
BASE = "heads"
NEW = "heads8"
# split sweep of heads8 (same grid as the 4-warp kernel: H_kv / 4 head groups per sequence, 2 CTAs of 8 warps per SM)
NEW_SPLIT_SWEEP = {
    "B32 Hq32 Hkv4 S8K": (4, 8, 12),
    "B64 Hq32 Hkv4 S4K": (2, 4, 8),
    "B8 Hq32 Hkv8 S32K": (8, 16, 33),
    "B1 Hq32 Hkv8 S128K": (66, 126, 132, 264),
}


def main() -> None:
    gen, copy_gbs, op = decode_ab_start("TRACE_EXT_KV_DECODE_IMPL", "TRACE_EXT_KV_DECODE_COMBINE")
    rows = []
    for name, nbytes, head_args in decode_case_inputs(gen):
        def call(splits=0):
            return op(*head_args, splits)

        times = {BASE: [], NEW: []}
        for _ in range(ROUNDS):
            for impl in (BASE, NEW):
                with _impl_env(impl):
                    times[impl].append(do_bench_cold(call))
        with _impl_env(BASE):
            out_d = call()[0]
        with _impl_env(NEW):
            out_n = call()[0]
        diff = (out_d.float() - out_n.float()).abs().max().item()
        ms_d = statistics.median(times[BASE])
        for impl in (BASE, NEW):
            ms = statistics.median(times[impl])
            gbs = nbytes / (ms * 1e-3) / 1e9
            rows.append({
                "case": f"decode {name} impl={impl}", "ms": ms, "MB": nbytes / 1e6, "GB/s": gbs,
                "% copy": 100.0 * gbs / copy_gbs, "vs heads": ms_d / ms,
                "rounds ms": " ".join(f"{t:.4f}" for t in times[impl]),
                "max |diff|": diff if impl == NEW else float("nan"),
            })
        with _impl_env(NEW):
            for splits in NEW_SPLIT_SWEEP.get(name, ()):
                ms = do_bench_cold(lambda: call(splits))
                gbs = nbytes / (ms * 1e-3) / 1e9
                rows.append({
                    "case": f"decode {name} impl={NEW} splits={splits}", "ms": ms, "MB": nbytes / 1e6, "GB/s": gbs,
                    "% copy": 100.0 * gbs / copy_gbs, "vs heads": ms_d / ms, "rounds ms": "",
                    "max |diff|": float("nan"),
                })
    print_table(rows)
    notes = (
        f"copy bandwidth {copy_gbs:.1f} GB/s; head_dim {D}; {BASE} = TRACE_EXT_KV_DECODE_IMPL={BASE} (4 warps/CTA), "
        f"{NEW} = TRACE_EXT_KV_DECODE_IMPL={NEW} (8 warps/CTA, the default); {ROUNDS} interleaved rounds per case, "
        f"median; vs heads = {BASE} ms / this ms"
    )
    path = write_results("kv_heads_ab_h200", rows, env_stamp(), notes)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
