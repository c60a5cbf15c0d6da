"""A/B of the K-slab decode kernel's slab count (csrc/gemm_w4_decode_kslab_sm90.cu, kslab_plan): the host's cost model
against every other valid slab count S forced by TRACE_EXT_KSLAB_S (read by the extension at every call). A slab count
S is valid when L = ceil(KT / S) super-tiles of A fit the shared memory (L <= 20 / 14 / 7 at 8 / 16 / 32 rows) and no
smaller S has the same L; C = min(blocks, SMs / S) CTAs per slab. Larger S: shorter slabs, more CTAs per slab (N is
split finer) but one fp32 partial per slab and 16-row block through L2 and a ticket round trip.

Cases: the 12 dense W4A16 decode rows of bench_gemm.py (M in {1, 8, 16, 32} x (N, K) in {(14336, 4096),
(4096, 14336), (7168, 4096)}), default dense decode = the K-slab kernel. Per case, ROUNDS interleaved rounds of the
model and each valid forced S, each a do_bench_cold median over >= 4 rotated weight sets (cold L2); outputs are checked
against the float64 reference bound first. Run: python bench/bench_decode_kslab_plan.py [shape indices] (about 40 s
on an H200; results in decode_kslab_plan_h200[_s<indices>].{json,md} under $BENCH_OUT or bench/results/).
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode_ab import MS, N_SETS, ROUNDS, SHAPES, start_run, write_decode_results  # noqa: E402
from bench_gemm import _rot  # noqa: E402
from common import check_gemm_bound, do_bench_cold, env_switch, nvfp4_f64, print_table  # noqa: E402

import trace_ext.ops as O  # noqa: E402
from trace_ext import reference as ref  # noqa: E402

DEV = "cuda"
MAX_L = {8: 20, 16: 14, 32: 7}  # kslab_max_l of the kernel file, by rows of the MMA width
CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16)


def valid_slab_counts(K, M):
    """The forced slab counts the host accepts for this shape (mirror of kslab_plan's validity test)."""
    KT = K // 256
    rows = 8 if M <= 8 else 16 if M <= 16 else 32
    out = []
    for S in CANDIDATES:
        L = -(-KT // S)
        if S <= KT and L <= MAX_L[rows] and -(-KT // L) == S:
            out.append(S)
    return out


def main():
    copy_bw, pick = start_run()
    rows = []
    for N, K in [SHAPES[i] for i in pick]:
        qs = [ref.nvfp4_quantize(torch.randn(N, K, device=DEV) * 0.02, scope="tensor") for _ in range(N_SETS)]
        ws = [O.prepare_fp4_weight(q) for q in qs]
        w64 = nvfp4_f64(qs[0])
        for M in MS:
            a = torch.randn(M, K, device=DEV).bfloat16()
            variants = ["model", *(str(s) for s in valid_slab_counts(K, M))]
            ys = {}
            for v in variants:
                with env_switch("TRACE_EXT_KSLAB_S", None if v == "model" else v):
                    ys[f"S={v}"] = O.fp4_linear(a, ws[0], backend="cuda")
            check_gemm_bound(ys, a.double(), w64, f" M={M} {N}x{K}")
            nw = _rot(ws)
            t = {v: [] for v in variants}
            for _ in range(ROUNDS):
                for v in variants:
                    with env_switch("TRACE_EXT_KSLAB_S", None if v == "model" else v):
                        t[v].append(do_bench_cold(lambda: O.fp4_linear(a, nw(), backend="cuda")))
            ms = {v: statistics.median(x) for v, x in t.items()}
            nbytes = N * K // 2 + N * K // 16 + M * K * 2 + M * N * 2
            row = {"shape": f"M={M} N={N} K={K}", "model_ms": ms["model"],
                   "model_%BW": 100 * nbytes / (ms["model"] * 1e-3) / 1e9 / copy_bw}
            # every candidate gets a column (NaN where the count is not valid for the shape)
            row.update({f"S{c}_vs_model": ms["model"] / ms[str(c)] if str(c) in ms else float("nan") for c in CANDIDATES})
            best = min(variants, key=lambda v: ms[v])
            row["best"] = best
            row["best_vs_model"] = ms["model"] / ms[best]
            rows.append(row)
            print_table(rows[-1:])
        del qs, ws, w64
        torch.cuda.empty_cache()
    write_decode_results("decode_kslab_plan", rows, pick, copy_bw)


if __name__ == "__main__":
    main()
