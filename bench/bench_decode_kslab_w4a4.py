"""A/B of the dense W4A4 decode GEMM (NVFP4 activations): the flat-stream kernel (TRACE_EXT_DECODE_IMPL=stream, the
default before 18ad6e6, which converts the activation fragments FP4 -> bf16 in every 256-K tile) against the K-slab
kernel (the default on sm_90 since; gemm_w4_decode_kslab_sm90.cu: A dequantized once per CTA into shared memory;
kslab2: the same on the second packed form), interleaved in one process: per shape, ROUNDS rounds of (stream, kslab,
kslab2), each a do_bench_cold median over >= 4 rotated weight sets (cold L2); the row
reports the median over the rounds. Shapes and M: those of bench_decode_ab.py. Before timing, each shape checks both
kernels against the float64 reference bound of the GPU tests (1 bf16 ulp + the fp32 accumulation bound); bit_equal is
the fraction of outputs equal between the two (their K splits differ). %copyBW is on the bytes moved (weight codes +
scales, A codes + scales, Y). Run: python bench/bench_decode_kslab_w4a4.py (about 40 s on an H200; results in
decode_kslab_w4a4_h200.{json,md} under $BENCH_OUT or bench/results/); optional shape indices as in bench_decode_ab.py.
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode_ab import MS, ROUNDS, SHAPES, _with_impl, start_run, weight_sets, write_decode_results  # noqa: E402
from bench_gemm import _rot  # noqa: E402
from common import check_gemm_bound, do_bench_cold, nvfp4_f64, print_table  # noqa: E402

import trace_ext.ops as O  # noqa: E402
from trace_ext import reference as ref  # noqa: E402

DEV = "cuda"
IMPLS = ("stream", "kslab", "kslab2")  # stream: the W4A4 default before 18ad6e6; kslab is the default since


def _check(aq, q, wp):
    """All kernels within the reference bound, same shape / dtype, kslab2 bit-equal to kslab; returns the fraction
    of outputs where kslab equals the stream kernel bit for bit."""
    ys = {impl: _with_impl(impl, lambda: O.fp4_linear(aq, wp, backend="cuda")) for impl in IMPLS}
    for tag, y in ys.items():
        assert y.shape == (aq.shape[0], q.shape[0]) and y.dtype == torch.bfloat16, tag
    check_gemm_bound(ys, nvfp4_f64(aq), nvfp4_f64(q))
    if not torch.equal(ys["kslab2"], ys["kslab"]):
        raise AssertionError("the second packed form changed the results of kslab")
    return float((ys["stream"] == ys["kslab"]).double().mean())


def main():
    copy_bw, pick = start_run()
    rows = []
    for N, K in [SHAPES[i] for i in pick]:
        sets = weight_sets(N, K)
        for M in MS:
            aq = ref.nvfp4_quantize(torch.randn(M, K, device=DEV))
            same = _check(aq, sets[0][0], sets[0][1])
            nw = _rot([s[1] for s in sets])
            t = {k: [] for k in IMPLS}
            for _ in range(ROUNDS):
                for impl in IMPLS:
                    t[impl].append(_with_impl(impl, lambda: do_bench_cold(lambda: O.fp4_linear(aq, nw(), backend="cuda"))))
            ms = {k: statistics.median(v) for k, v in t.items()}
            nbytes = N * K // 2 + N * K // 16 + M * K // 2 + M * K // 16 + M * N * 2
            row = {"shape": f"W4A4 M={M} N={N} K={K}"}
            row.update({f"{k}_ms": ms[k] for k in IMPLS})
            row.update({f"{k}_%BW": 100 * nbytes / (ms[k] * 1e-3) / 1e9 / copy_bw for k in IMPLS})
            row.update({f"{k}_speedup": ms["stream"] / ms[k] for k in IMPLS if k != "stream"})
            row["bit_equal"] = same
            rows.append(row)
            print_table(rows[-1:])
        del sets
        torch.cuda.empty_cache()
    write_decode_results("decode_kslab_w4a4", rows, pick, copy_bw)


if __name__ == "__main__":
    main()
