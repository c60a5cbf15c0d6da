"""A/B timing of the heads8 FP4-KV decode kernel (the default on sm_90 for the benchmarked shapes) against opt-in
variants, interleaved in one process, on the four decode cases of bench/bench_kv.py.

Impls: values of TRACE_EXT_KV_DECODE_IMPL ("default": unset), optionally with further switches as "@VAR=VALUE"
(bench/common.impl_env), e.g. default@TRACE_EXT_KV_DECODE_RING=4 (heads8 with the 4-stage ring before round 22).
KV_DECODE_AB_IMPLS=a,b,... overrides the list (the first is the baseline of the ratios). Every impl's output and LSE
are compared bit for bit with the first one's before timing (column "bits").

Timing of record: bench.common.do_bench_cold (median, L2 flushed before every call), the compiled op called directly,
automatic split count, REP_MS per call. Each case is timed in two passes of ROUNDS rounds, every round timing every
impl once in turn; a pass reports the median over its rounds, so clock or thermal drift hits all impls alike and the
two passes show the run-to-run spread. Bytes, GB/s and % of copy as in bench_kv.py (target 75%).

Run from the repo root with the package installed:  python bench/bench_kv_decode_ab.py   (~35 s)
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kv import BW_TARGET, D, decode_ab_start, decode_case_inputs  # noqa: E402
from common import do_bench_cold, env_stamp, impl_env, print_table, write_results  # noqa: E402

import trace_ext  # noqa: E402, F401

ENV = "TRACE_EXT_KV_DECODE_IMPL"
IMPLS = tuple(os.environ.get(
    "KV_DECODE_AB_IMPLS", "default,default@TRACE_EXT_KV_DECODE_RING=4,default@TRACE_EXT_KV_DECODE_RING=2").split(","))
ROUNDS = 3
PASSES = 2
REP_MS = 120  # do_bench_cold's timing window per call (~1500 calls of ~70 us): keeps the script under a minute


def main() -> None:
    gen, copy_gbs, op = decode_ab_start(ENV, "TRACE_EXT_KV_DECODE_COMBINE", "TRACE_EXT_KV_DECODE_RING",
                                         "TRACE_EXT_KV_DECODE_PDL")
    rows = []
    for name, nbytes, head_args in decode_case_inputs(gen):
        args = head_args + (0,)  # automatic split count

        def call():
            return op(*args)

        # same bits from every impl (raw bytes, NaN included)
        ref, same = None, {}
        for impl in IMPLS:
            with impl_env(ENV, impl):
                out, lse = call()
            bits = (out.view(torch.int16).clone(), lse.view(torch.int32).clone())
            if ref is None:
                ref = bits
            same[impl] = torch.equal(bits[0], ref[0]) and torch.equal(bits[1], ref[1])
            if not same[impl]:
                print(f"WARNING {name}: impl={impl} gives different output / LSE bits than the default")
        for pass_no in range(PASSES):
            ms = {impl: [] for impl in IMPLS}
            for _ in range(ROUNDS):
                for impl in IMPLS:
                    with impl_env(ENV, impl):
                        ms[impl].append(do_bench_cold(call, rep_ms=REP_MS))
            base = statistics.median(ms[IMPLS[0]])
            for impl in IMPLS:
                m = statistics.median(ms[impl])
                gbs = nbytes / (m * 1e-3) / 1e9
                rows.append({
                    "case": name, "pass": pass_no + 1, "impl": impl, "bits": "same" if same[impl] else "DIFF",
                    "ms": m, "ms min": min(ms[impl]),
                    "MB": nbytes / 1e6, "GB/s": gbs, "% copy": 100.0 * gbs / copy_gbs, "vs default": base / m,
                    "rounds ms": " ".join(f"{t:.4f}" for t in ms[impl]),
                })
    print_table(rows)
    notes = (f"copy bandwidth {copy_gbs:.1f} GB/s (target {BW_TARGET:.0f}%); head_dim {D}, page 16, automatic splits; "
             f"{PASSES} passes x {ROUNDS} interleaved rounds of do_bench_cold per case, median per pass; "
             f"vs default = default ms / impl ms of the same pass")
    path = write_results("kv_decode_ab_h200", rows, env_stamp(), notes)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
