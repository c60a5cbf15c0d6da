"""A/B of the two schedules of the large-M NVFP4 GEMM (register-operand wgmma kernel) in one process: the
data-parallel grid (one CTA per 128 x 256 output tile) and stream-K (one CTA per SM, k-step ranges with the fp32
accumulator handed between CTAs), switched per call by TRACE_EXT_WGMMA_SCHED=dp|streamk; "auto" is what the
library picks (stream-K when the data-parallel wave efficiency is < 0.9, tiles >= SMs and K >= 2048).
Shapes: the large-M rows of bench_gemm.py (M in {1024, 4096, 16384} x the Mixtral / Llama projections) plus
partial-wave shapes (Qwen3 gate_up at M = 4096, Mixtral w2 at M = 4097). Per row: cuBLAS bf16 in the same run,
W4A16 and W4A4 (activation quantization included) under dp / streamk / auto, and whether streamk and dp give the
same bits (they must). Timing as bench_gemm.py: do_bench median with a cold L2, 4 weight sets rotated.
Run: python bench/bench_wgmma_sched.py (wgmma_sched_h200.{json,md} in $BENCH_OUT or bench/results/);
SCHED_PARTIAL_ONLY=1 keeps only the rows whose data-parallel wave efficiency is < 0.9 (where auto may differ).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemm import _bench_or_nan, _dense_weight_sets, _rot  # noqa: E402
from common import env_stamp, print_table, write_results  # noqa: E402

import trace_ext.ops as O  # noqa: E402

DEV = "cuda"
SHAPES = [  # (N, K, Ms)
    (14336, 4096, (1024, 4096, 16384)),
    (4096, 14336, (1024, 4096, 16384)),
    (7168, 4096, (1024, 4096, 16384)),
    (1536, 2048, (4096,)),
    (4096, 14336, (4097,)),
]


def _set_sched(s: str) -> None:
    os.environ["TRACE_EXT_WGMMA_SCHED"] = s
    os.environ.pop("TRACE_EXT_WGMMA_SK_CTAS", None)


def _plan(M, N, K, sms):
    tiles = -(-N // 128) * -(-M // 256)
    waves = -(-tiles // sms)
    eff = tiles / (waves * sms)
    auto = "streamk" if tiles >= sms and eff < 0.9 and K >= 2048 else "dp"
    return tiles, tiles / sms, eff, auto


def main():
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: {sms} SMs")
    rows = []
    for N, K, Ms in SHAPES:
        sets = _dense_weight_sets(N, K)
        for M in Ms:
            tiles, waves, eff, auto = _plan(M, N, K, sms)
            if os.environ.get("SCHED_PARTIAL_ONLY") == "1" and eff >= 0.9:
                continue
            a = torch.randn(M, K, device=DEV).bfloat16()
            nw = _rot([s[0] for s in sets])
            nb = _rot([s[1] for s in sets])
            flops = 2 * M * N * K
            base = _bench_or_nan(lambda: torch.matmul(a, nb().T), rep_ms=100)
            row = {"shape": f"M={M} N={N} K={K}", "tiles": tiles, "waves": waves, "dp_eff": eff, "auto": auto,
                   "cublas_ms": base}
            for mode, kw in (("w4a16", {}), ("w4a4", {"act_quant": "nvfp4"})):
                same = True
                for sched in ("dp", "streamk", "auto"):
                    _set_sched(sched)
                    ms = _bench_or_nan(lambda: O.fp4_linear(a, nw(), backend="cuda", **kw), rep_ms=100)
                    row[f"{mode}_{sched}_ms"] = ms
                    if sched == "auto":
                        row[f"{mode}_auto_x_cublas"] = base / ms
                        row[f"{mode}_auto_TFLOP/s"] = flops / (ms * 1e-3) / 1e12
                w0 = sets[0][0]
                _set_sched("dp")
                y_dp = O.fp4_linear(a, w0, backend="cuda", **kw)
                _set_sched("streamk")
                same &= bool(torch.equal(O.fp4_linear(a, w0, backend="cuda", **kw), y_dp))
                row[f"{mode}_sk/dp"] = row[f"{mode}_streamk_ms"] / row[f"{mode}_dp_ms"]
                row[f"{mode}_bits_equal"] = same
            rows.append(row)
            print_table(rows[-1:])
        del sets
        torch.cuda.empty_cache()
    os.environ.pop("TRACE_EXT_WGMMA_SCHED", None)
    print_table(rows)
    path = write_results("wgmma_sched_h200", rows, env_stamp(), f"{sms} SMs; targets: W4A16 >= 0.7x, W4A4 >= 0.6x")
    bad = [r["shape"] for r in rows if not (r["w4a16_bits_equal"] and r["w4a4_bits_equal"])]
    print(f"stream-K bit-identical to dp on {len(rows) - len(bad)}/{len(rows)} shapes {bad if bad else ''}; {path}")


if __name__ == "__main__":
    main()
