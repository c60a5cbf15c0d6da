"""A/B of the dense decode GEMM kernels (W4A16): the flat-stream kernel (TRACE_EXT_DECODE_IMPL=stream), the default
(on sm_90 the K-slab kernel of gemm_w4_decode_kslab_sm90.cu: A staged once per CTA in shared memory), auto (pair2 or
stream by the shape rule decode_prefers_pair of gemm_w4_decode_sm90.cu, the default before 7b3e763) and the other
kernels named by TRACE_EXT_DECODE_IMPL (read by the extension at every call): pair2; pair3 = pair2's kernel, stream2 =
the stream kernel, auto2 = auto, kslab2 = the K-slab kernel, all four on the second packed form of
prepare_fp4_weight(decode_form2=True) (FP4 expansion 9 instead of 10 integer ops per 8 weights); quad3 = pair3 with
items of 4 blocks (<= 16 rows; pair3 beyond). cuBLAS bf16 in the same run.
Interleaved in one process: per shape, ROUNDS rounds of (IMPLS..., cuBLAS), each a do_bench_cold median over >= 4
rotated weight sets (cold L2); the row reports the median over the rounds. Shapes: the 12 dense decode rows of
bench_gemm.py (M in {1, 8, 16, 32} x (N, K) in {(14336, 4096), (4096, 14336), (7168, 4096)}). %copyBW is on the
bytes moved (codes + scales + A + Y); speedups are against stream. Before timing, each shape checks every kernel
against the float64 reference bound of the GPU tests (1 bf16 ulp + the fp32 accumulation bound) and every twin pair
for equal bits, so a broken variant never reports a time; pair2_bit_equal is the fraction of outputs where pair2
equals stream (their K splits differ, so a few fp32 sums round differently).
Run: python bench/bench_decode_ab.py [shape indices 0 1 2]; one shape with all 10 kernels + cuBLAS takes ~40 s on an
H200 (results in decode_ab_h200[_s<indices>].{json,md} under $BENCH_OUT or bench/results/); DECODE_AB_IMPLS=a,b,...
times stream, default and a subset.
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemm import _rot  # noqa: E402
from common import (  # noqa: E402
    check_gemm_bound, copy_bandwidth_gbs, do_bench_cold, env_stamp, impl_env, nvfp4_f64, print_table, write_results)

import trace_ext.ops as O  # noqa: E402
from trace_ext import reference as ref  # noqa: E402

DEV = "cuda"
N_SETS = 4
ROUNDS = 2
SHAPES = ((14336, 4096), (4096, 14336), (7168, 4096))
MS = (1, 8, 16, 32)
ENV = "TRACE_EXT_DECODE_IMPL"
# speedups are against stream (the flat-stream kernel, the default before c7928a5); pair (3 CTAs per SM) lost to
# pair2 everywhere at ab46e90
IMPLS = ("stream", "default", "auto", "pair2", "pair3", "stream2", "auto2", "quad3", "kslab", "kslab2")
# DECODE_AB_IMPLS=stream,default,... times a subset (stream and default are always timed: the speedups refer to them)
if os.environ.get("DECODE_AB_IMPLS"):
    IMPLS = ("stream", "default", *(v for v in os.environ["DECODE_AB_IMPLS"].split(",") if v not in ("", "stream",
                                                                                                       "default")))
# pairs that must give the same bits (the same kernel on the other packed form)
TWINS = (("pair3", "pair2"), ("stream2", "stream"), ("kslab2", "kslab"), ("auto2", "auto"))


def _with_impl(impl, fn):
    """Calls fn with TRACE_EXT_DECODE_IMPL set to impl (None / "default": unset, the default kernel; "@VAR=VALUE"
    suffixes set further switches, common.impl_env)."""
    with impl_env(ENV, impl):
        return fn()


def _check_pair(a, q, wp):
    """All kernels within the reference bound (1 bf16 ulp + fp32 accumulation bound), same shape / dtype; returns
    the fraction of outputs where pair2 equals the stream kernel bit for bit, and raises unless pair3 equals pair2 and
    stream2 equals the stream kernel and kslab2 kslab bit for bit (same kernels, same sums; only the packed form
    differs); quad3 and kslab within the bound."""
    ys = {impl: _with_impl(None if impl == "default" else impl, lambda: O.fp4_linear(a, wp, backend="cuda"))
          for impl in IMPLS}
    for impl, y in ys.items():
        assert y.shape == ys["default"].shape and y.dtype == torch.bfloat16, impl
    for impl, twin in TWINS:  # same products and sums: the same bits (NaN included)
        if impl in ys and twin in ys and not torch.equal(ys[impl].view(torch.int16), ys[twin].view(torch.int16)):
            raise AssertionError(f"{impl} differs from {twin}")
    check_gemm_bound(ys, a.double(), nvfp4_f64(q))
    return float((ys["stream"] == ys.get("pair2", ys["default"])).double().mean())


def picked_shapes() -> list[int]:
    """Shape indices from the command line (all shapes when none)."""
    return [int(x) for x in sys.argv[1:]] or list(range(len(SHAPES)))


def weight_sets(N: int, K: int, bf16: bool = False) -> list[tuple]:
    """N_SETS random weights (rotated for a cold L2): (NVFP4 q, prepared with the second packed form[, bf16 q])."""
    sets = []
    for _ in range(N_SETS):
        q = ref.nvfp4_quantize(torch.randn(N, K, device=DEV) * 0.02, scope="tensor")
        w = O.prepare_fp4_weight(q, decode_form2=True)
        sets.append((q, w, ref.nvfp4_dequantize(q, torch.bfloat16)) if bf16 else (q, w))
    return sets


def start_run() -> tuple[float, list[int]]:
    """The common start of the decode A/B benches: seed, the copy bandwidth of this run (printed), the picked shapes."""
    torch.manual_seed(0)
    copy_bw = copy_bandwidth_gbs()
    print(f"copy bandwidth: {copy_bw:.0f} GB/s")
    return copy_bw, picked_shapes()


def write_decode_results(base: str, rows: list[dict], pick: list[int], copy_bw: float, env: str = "") -> None:
    """Prints the table and writes <base>_h200[_s<indices>].{json,md}, stamped with the script's command line."""
    print_table(rows)
    name = base + "_h200" + ("" if len(pick) == len(SHAPES) else "_s" + "".join(map(str, pick)))
    command = " ".join([*([env] if env else []), "python bench/" + os.path.basename(sys.argv[0]), *sys.argv[1:]])
    path = write_results(name, rows, env_stamp(command),
                         notes=f"copy BW {copy_bw:.0f} GB/s; medians of {ROUNDS} interleaved rounds")
    print(f"wrote {path}")


def main():
    copy_bw, pick = start_run()
    rows = []
    for N, K in [SHAPES[i] for i in pick]:
        sets = weight_sets(N, K, bf16=True)
        for M in MS:
            a = torch.randn(M, K, device=DEV).bfloat16()
            same = _check_pair(a, sets[0][0], sets[0][1])
            nw = _rot([s[1] for s in sets])
            nb = _rot([s[2] for s in sets])
            t = {k: [] for k in (*IMPLS, "cublas")}
            for _ in range(ROUNDS):
                for impl in IMPLS:
                    env = None if impl == "default" else impl
                    t[impl].append(_with_impl(env, lambda: do_bench_cold(lambda: O.fp4_linear(a, nw(), backend="cuda"))))
                t["cublas"].append(do_bench_cold(lambda: torch.matmul(a, nb().T)))
            ms = {k: statistics.median(v) for k, v in t.items()}
            nbytes = N * K // 2 + N * K // 16 + M * K * 2 + M * N * 2
            bw = lambda m: 100 * nbytes / (m * 1e-3) / 1e9 / copy_bw  # noqa: E731
            best = min(ms[k] for k in IMPLS)
            row = {"shape": f"M={M} N={N} K={K}"}
            row.update({f"{k}_ms": ms[k] for k in (*IMPLS, "cublas")})
            row.update({f"{k}_%BW": bw(ms[k]) for k in IMPLS})
            row.update({f"{k}_speedup": ms["stream"] / ms[k] for k in IMPLS if k != "stream"})
            if "auto2" in ms:
                row["auto2_vs_best"] = best / ms["auto2"]
            row["best_impl"] = min(IMPLS, key=lambda k: ms[k])
            row["best_vs_cublas"] = ms["cublas"] / best
            row["target"] = f">=75%BW >={3.0 if M <= 16 else 2.5}x"
            row["best_result"] = (
                "PASS" if bw(best) >= 75 and ms["cublas"] / best >= (3.0 if M <= 16 else 2.5) else "MISS"
            )
            row["pair2_bit_equal" if "pair2" in IMPLS else "default_bit_equal"] = same
            rows.append(row)
            print_table(rows[-1:])
        del sets
        torch.cuda.empty_cache()
    impls = os.environ.get("DECODE_AB_IMPLS")
    write_decode_results("decode_ab", rows, pick, copy_bw, f"DECODE_AB_IMPLS={impls}" if impls else "")


if __name__ == "__main__":
    main()
