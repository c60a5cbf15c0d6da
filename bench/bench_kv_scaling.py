"""Where the FP4-KV decode kernel's time goes: fixed cost per launch vs cost per token (H200 diagnosis).

The decode grid is one wave (every CTA resident), so the time of a launch is roughly a fixed part (launch, pipeline
ramp, epilogue, the split partials and their combine) plus the per-CTA token stream. This script keeps the grid fixed (B
sequences, H_kv / 4 head groups, a fixed split count) and grows the context S, so that only the tokens per CTA
change; a least-squares line ms = a + b * S gives the fixed part a and the steady-state rate (bytes per token / b),
reported as % of the copy bandwidth measured in the same run. Grids of 256 CTAs each (the tokens per CTA 128 ..
4096): B32 Hq32 Hkv4 at 8 splits (the first bench_kv case at S = 8K), B8 Hq32 Hkv8 at 16 splits (the third case at
S = 32K), B256 Hq32 Hkv4 at 1 split (no partials, no split finish), and the first grid with the fused split finish
(TRACE_EXT_KV_DECODE_COMBINE=fused; the default since round 88 is the separate combine kernel launched as a
programmatic dependent) and with the 4-warp heads kernel (TRACE_EXT_KV_DECODE_IMPL=heads).

Timing: bench.common.do_bench_cold (median, L2 flushed before every call), default kernel, explicit split count.
Run from the repo root with the package installed:  python bench/bench_kv_scaling.py   (~60 s)
"""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kv import D, decode_ab_start, decode_bytes, random_cache  # noqa: E402
from common import do_bench_cold, env_stamp, impl_env, print_table, write_results  # noqa: E402

import trace_ext  # noqa: E402, F401

# (name, B, Hq, H_kv, splits, variant: a TRACE_EXT_KV_DECODE_IMPL value with optional @VAR=VALUE switches, as in
# the A/B benches); every grid has 256 CTAs
IMPL = "TRACE_EXT_KV_DECODE_IMPL"
GRIDS = (("B32 Hq32 Hkv4 splits=8", 32, 32, 4, 8, "default"),
         ("B8 Hq32 Hkv8 splits=16", 8, 32, 8, 16, "default"),
         ("B256 Hq32 Hkv4 splits=1 (no split finish)", 256, 32, 4, 1, "default"),
         ("B32 Hq32 Hkv4 splits=8 fused finish", 32, 32, 4, 8, "default@TRACE_EXT_KV_DECODE_COMBINE=fused"),
         ("B32 Hq32 Hkv4 splits=8 impl=heads (4 warps)", 32, 32, 4, 8, "heads"))
TOKENS_PER_CTA = (128, 256, 512, 1024, 2048, 4096)


def fit_line(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main() -> None:
    gen, copy_gbs, op = decode_ab_start(IMPL, "TRACE_EXT_KV_DECODE_COMBINE")
    rows = []
    for name, B, Hq, Hkv, splits, variant in GRIDS:
        ss, ms_list = [], []
        for S in (t * splits for t in TOKENS_PER_CTA):
            kc, ks, vc, vs, table, seq_lens = random_cache(B, Hkv, S, gen)
            q = torch.randn(B, Hq, D, device="cuda", generator=gen).to(torch.bfloat16)
            nbytes = decode_bytes(B, Hq, Hkv, S)
            with impl_env(IMPL, variant):
                ms = do_bench_cold(lambda: op(q, kc, ks, vc, vs, table, seq_lens, 1.0 / math.sqrt(D), 0.01, 0.02,
                                              splits))
            gbs = nbytes / (ms * 1e-3) / 1e9
            rows.append({"grid": name, "S": S, "tokens per CTA": S // splits, "ms": ms, "MB": nbytes / 1e6,
                         "GB/s": gbs, "% copy": 100.0 * gbs / copy_gbs, "fit": ""})
            ss.append(S)
            ms_list.append(ms)
            del kc, ks, vc, vs, table
        a, b = fit_line(ss, ms_list)
        bytes_per_token = decode_bytes(B, Hq, Hkv, 1) - decode_bytes(B, Hq, Hkv, 0)
        steady = bytes_per_token / (b * 1e-3) / 1e9
        resid = max(abs(a + b * s - m) for s, m in zip(ss, ms_list))
        rows.append({"grid": name, "S": "fit", "tokens per CTA": "", "ms": a, "MB": float("nan"), "GB/s": steady,
                     "% copy": 100.0 * steady / copy_gbs,
                     "fit": f"ms = {a * 1e3:.1f} us + S * {b * 1e6:.3f} ns; max residual {resid * 1e3:.2f} us"})
    print_table(rows)
    notes = (f"copy bandwidth {copy_gbs:.1f} GB/s; head_dim {D}, page 16; fixed grid per block of rows (explicit "
             "split count), context S grown; fit rows: ms column = fixed part a (ms), GB/s / % copy = the "
             "steady-state rate bytes per token / b of the least-squares line ms = a + b * S")
    path = write_results("kv_scaling_h200", rows, env_stamp("python bench/bench_kv_scaling.py"), notes)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
