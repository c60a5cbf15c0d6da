"""A/B of the dense W4A16 decode GEMM: the default flat-stream kernel vs the opt-in pair-stream kernels
(TRACE_EXT_DECODE_IMPL=pair / pair2, read by the extension at every call), with cuBLAS bf16 in the same run,
interleaved in one process: per shape, ROUNDS rounds of (default, pair, pair2, cuBLAS), each a do_bench_cold median over >= 4 rotated
weight sets (cold L2); the row reports the median over the rounds. Shapes: the 12 dense decode rows of
bench_gemm.py (M in {1, 8, 16, 32} x (N, K) in {(14336, 4096), (4096, 14336), (7168, 4096)}). %copyBW is on the
bytes moved (codes + scales + A + Y). Before timing, each shape checks that both kernels give the same shape and
dtype and outputs within the float64 reference bound of the GPU tests (1 bf16 ulp + the fp32 accumulation bound),
so a broken variant never reports a time; bit_equal is the fraction of outputs equal between the two kernels (their
K splits differ, so a few fp32 sums round differently). Run: python bench/bench_decode_ab.py (about 40 s on an H200; results in
decode_ab_h200.{json,md} under $BENCH_OUT or bench/results/).
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemm import _rot  # noqa: E402
from common import copy_bandwidth_gbs, do_bench_cold, env_stamp, env_switch, print_table, write_results  # noqa: E402

import trace_ext.ops as O  # noqa: E402
from trace_ext import reference as ref  # noqa: E402
from trace_ext import reference_gemm as R  # noqa: E402

DEV = "cuda"
N_SETS = 4
ROUNDS = 2
SHAPES = ((14336, 4096), (4096, 14336), (7168, 4096))
MS = (1, 8, 16, 32)
ENV = "TRACE_EXT_DECODE_IMPL"


def _with_impl(impl, fn):
    """Calls fn with TRACE_EXT_DECODE_IMPL set to impl (None: unset, the default kernel)."""
    with env_switch(ENV, impl):
        return fn()


def _check_pair(a, q, wp):
    """All kernels within the reference bound (1 bf16 ulp + fp32 accumulation bound), same shape / dtype; returns
    the fraction of outputs where pair equals the default bit for bit."""
    y0 = _with_impl(None, lambda: O.fp4_linear(a, wp, backend="cuda"))
    y1 = _with_impl("pair", lambda: O.fp4_linear(a, wp, backend="cuda"))
    y2 = _with_impl("pair2", lambda: O.fp4_linear(a, wp, backend="cuda"))
    assert y0.shape == y1.shape == y2.shape and y0.dtype == y1.dtype == y2.dtype == torch.bfloat16
    a64 = a.double()
    g = q.g.double().reshape(-1)  # one value per tensor, or one per row
    w64 = R.dequantize_f64(q.codes, q.scales) * (g[:, None] if g.numel() > 1 else g)
    exact = a64 @ w64.T
    ref_bf16 = R.round_to_bf16(exact)
    tol = R.gemm_tolerance(a64, w64, ref_bf16)
    for y, tag in ((y0, "default"), (y1, "pair"), (y2, "pair2")):
        bad = int((~((y.double() - ref_bf16.double()).abs() <= tol)).sum())
        if bad:
            raise AssertionError(f"{tag}: {bad} outputs outside the reference bound")
    return float((y0 == y1).double().mean())


def main():
    torch.manual_seed(0)
    copy_bw = copy_bandwidth_gbs()
    print(f"copy bandwidth: {copy_bw:.0f} GB/s")
    rows = []
    for N, K in SHAPES:
        sets = []
        for _ in range(N_SETS):
            q = ref.nvfp4_quantize(torch.randn(N, K, device=DEV) * 0.02, scope="tensor")
            sets.append((q, O.prepare_fp4_weight(q), ref.nvfp4_dequantize(q, torch.bfloat16)))
        for M in MS:
            a = torch.randn(M, K, device=DEV).bfloat16()
            same = _check_pair(a, sets[0][0], sets[0][1])
            nw = _rot([s[1] for s in sets])
            nb = _rot([s[2] for s in sets])
            t = {"default": [], "pair": [], "pair2": [], "cublas": []}
            for _ in range(ROUNDS):
                for impl in ("default", "pair", "pair2"):
                    env = None if impl == "default" else impl
                    t[impl].append(_with_impl(env, lambda: do_bench_cold(lambda: O.fp4_linear(a, nw(), backend="cuda"))))
                t["cublas"].append(do_bench_cold(lambda: torch.matmul(a, nb().T)))
            ms = {k: statistics.median(v) for k, v in t.items()}
            nbytes = N * K // 2 + N * K // 16 + M * K * 2 + M * N * 2
            bw = lambda m: 100 * nbytes / (m * 1e-3) / 1e9 / copy_bw  # noqa: E731
            rows.append(
                {
                    "shape": f"M={M} N={N} K={K}",
                    "default_ms": ms["default"],
                    "pair_ms": ms["pair"],
                    "pair2_ms": ms["pair2"],
                    "cublas_ms": ms["cublas"],
                    "default_%BW": bw(ms["default"]),
                    "pair_%BW": bw(ms["pair"]),
                    "pair2_%BW": bw(ms["pair2"]),
                    "pair_speedup": ms["default"] / ms["pair"],
                    "pair2_speedup": ms["default"] / ms["pair2"],
                    "best_vs_cublas": ms["cublas"] / min(ms["pair"], ms["pair2"]),
                    "target": f">=75%BW >={3.0 if M <= 16 else 2.5}x",
                    "best_result": "PASS"
                    if bw(min(ms["pair"], ms["pair2"])) >= 75
                    and ms["cublas"] / min(ms["pair"], ms["pair2"]) >= (3.0 if M <= 16 else 2.5)
                    else "MISS",
                    "bit_equal": same,
                }
            )
            print_table(rows[-1:])
        del sets
        torch.cuda.empty_cache()
    print_table(rows)
    path = write_results("decode_ab_h200", rows, env_stamp("python bench/bench_decode_ab.py"),
                         notes=f"copy BW {copy_bw:.0f} GB/s; medians of {ROUNDS} interleaved rounds")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
