"""A/B timing of the FP4 KV append kernels on the H200, interleaved in one process.

Impls (TRACE_EXT_KV_APPEND_IMPL, read per call by the extension): "default" (unset: warp2 for appends of at least 32
items per resident warp, else the grid kernel), "grid" (the grid-stride kernel, two blocks per thread,
reciprocal-quotient element path; the default before), "old" (the same kernel with the previous per-element path),
"warp" (warp-stream kernel: contiguous warp chunks, incremental token / sequence / page walk, four blocks per item,
exponent-magic RTN, scale-byte table) and "warp2" (the same with two blocks per item: fewer registers).
APPEND_AB_IMPLS=a,b,... overrides the list (the first is the "vs" baseline); "@VAR=VALUE" sets a further switch, e.g.
default@TRACE_EXT_KV_APPEND_WAVES=2 (common.impl_env).

Timing of record: bench.common.do_bench_cold (median, L2 flushed before every call), the compiled op called
directly. Each case is timed in ROUNDS rounds, every round timing every impl once in turn; the table reports the
median over rounds. Bytes = bf16 K/V read + codes and scales written; % copy against copy_bandwidth_gbs measured in
the same run; target (issue 5) >= 70% of copy on the first case. Before timing, each impl's cache bytes are checked
equal to the default's on the case's inputs.

Run from the repo root with the package installed:  python bench/bench_kv_append_ab.py   (< 60 s)
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kv import D, append_inputs  # noqa: E402
from common import (  # noqa: E402
    copy_bandwidth_gbs, do_bench_cold, env_stamp, impl_env, print_table, require_kernels_usable, write_results)

import trace_ext  # noqa: E402

ENV = "TRACE_EXT_KV_APPEND_IMPL"
IMPLS = tuple(os.environ.get("APPEND_AB_IMPLS", "default,grid,old,warp,warp2").split(","))
ROUNDS = int(os.environ.get("APPEND_AB_ROUNDS", "3"))
TARGET = 70.0
# (name, B, Hkv, tokens per sequence); the first is bench_kv.py's append row
CASES = [
    ("prefill B8 x 4096 Hkv8", 8, 8, 4096),
    ("prefill B1 x 32768 Hkv8", 1, 8, 32768),
    ("prefill B32 x 1024 Hkv4", 32, 4, 1024),
    ("decode B256 x 1 Hkv8", 256, 8, 1),
]


def decode_inputs(gen, B, Hkv, max_start=500):
    """One new token for each of B sequences at random positions below max_start (append_inputs writes at 1000)."""
    page = 16
    pages_per_seq = (max_start + page) // page
    num_pages = B * pages_per_seq
    kc = torch.zeros((num_pages, page, Hkv, D // 2), dtype=torch.uint8, device="cuda")
    ks = torch.zeros((num_pages, page, Hkv, D // 16), dtype=torch.uint8, device="cuda")
    table = torch.randperm(num_pages, device="cuda", generator=gen).reshape(B, pages_per_seq).to(torch.int32)
    k = torch.randn(B, Hkv, D, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(B, Hkv, D, device="cuda", generator=gen).to(torch.bfloat16)
    cu = torch.arange(0, B + 1, dtype=torch.int32, device="cuda")
    start = torch.randint(0, max_start, (B,), device="cuda", generator=gen, dtype=torch.int32)
    return (kc, ks, torch.zeros_like(kc), torch.zeros_like(ks), k, v, table, cu, start, 0.01, 0.02)


def main() -> None:
    require_kernels_usable()
    op = torch.ops.trace_ext.fp4kv_append
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth: {copy_gbs:.1f} GB/s")
    rows = []
    for ci, (name, B, Hkv, chunk) in enumerate(CASES):
        args = append_inputs(gen, B, Hkv, chunk) if chunk > 1 else decode_inputs(gen, B, Hkv)
        T = B * chunk
        nbytes = 2 * T * Hkv * D * 2 + 2 * T * Hkv * (D // 2 + D // 16)
        # same bytes from every impl
        ref = None
        for impl in IMPLS:
            for t in args[:4]:
                t.zero_()
            with impl_env(ENV, impl):
                op(*args)
            out = [t.clone() for t in args[:4]]
            if ref is None:
                ref = out
            elif not all(torch.equal(x, y) for x, y in zip(out, ref)):
                raise SystemExit(f"{name}: impl={impl} writes different cache bytes than {IMPLS[0]}")
        del ref, out
        ms = {impl: [] for impl in IMPLS}
        for _ in range(ROUNDS):
            for impl in IMPLS:
                with impl_env(ENV, impl):
                    ms[impl].append(do_bench_cold(lambda: op(*args)))
        base = statistics.median(ms[IMPLS[0]])
        for impl in IMPLS:
            m = statistics.median(ms[impl])
            gbs = nbytes / (m * 1e-3) / 1e9
            pct = 100.0 * gbs / copy_gbs
            rows.append({
                "case": name, "impl": impl, "ms": m, "ms min": min(ms[impl]), "MB": nbytes / 1e6, "GB/s": gbs,
                "% copy": pct, "vs default": base / m,
                "target": f">={TARGET:.0f}%" if ci == 0 else "-",
                "status": ("PASS" if pct >= TARGET else "MISS") if ci == 0 else "-",
            })
        del args
    print_table(rows)
    notes = (f"copy bandwidth {copy_gbs:.1f} GB/s; head_dim {D}, page 16; bytes = bf16 K/V read + codes and scales "
             f"written; median of {ROUNDS} interleaved rounds of do_bench_cold; vs default = first impl ms / impl ms")
    path = write_results("kv_append_ab_h200", rows, env_stamp(), notes)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
