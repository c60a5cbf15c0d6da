"""A/B of the grouped (MoE) decode GEMM kernels (W4A16, prepared weights), each named by TRACE_EXT_DECODE_IMPL (read
by the extension at every call): the flat-stream kernel of gemm_w4_decode_sm90.cu with units = (expert with rows, chunk
of 8 / 16 / 32 rows) (stream, the default before f062b32), kslab-grouped (the default on sm_90 since: the K-slab kernel
of gemm_w4_decode_kslab_sm90.cu generalized to units, the unit's A rows staged once per job in shared memory; jobs of
(unit, K slab, N chunk)), kslab-flat (opt-in: the same kernel with each CTA on one contiguous range of (unit, slab,
16-row block), so every SM gets the same number of blocks whatever the unit count), default (unset: per call one of
the two work orders, grouped_flat_pays) and torch._grouped_mm on the dequantized bf16 weights. GROUPED_AB_IMPLS=a,b,...
picks the FP4 kernels (the first is the speedup baseline).
Qwen3-30B-A3B experts (E=128, top-8; gate_up N=1536 K=2048, down N=2048 K=768) at T = 1, 16, 64, 256 tokens (M = 8 T
rows, router-like random top-8 routing).
Interleaved in one process: per row, ROUNDS rounds of (each FP4 kernel, grouped_mm), each a do_bench_cold median over
N_SETS rotated weight sets (cold L2); the row reports the median over the rounds. Before timing, every FP4 kernel is
checked against the float64 reference bound of the GPU tests (1 bf16 ulp + the fp32 accumulation bound) on every
active expert, so a broken variant never reports a time. %copyBW is on the active experts' bytes (codes + scales) + A +
Y; speedups are against the first kernel and against grouped_mm.
GROUPED_AB_TS=a,b,... overrides the token batches; GROUPED_AB_SKEW=s skews the routing (routed_offsets).
Run: python bench/bench_decode_grouped_ab.py (~45-60 s on an H200; results in decode_grouped_ab_h200.{json,md} under
$BENCH_OUT or bench/results/).
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemm import _rot, routed_offsets  # noqa: E402
from common import (  # noqa: E402
    check_gemm_bound, copy_bandwidth_gbs, do_bench_cold, env_stamp, impl_env, nvfp4_f64, print_table, write_results)

import trace_ext.ops as O  # noqa: E402
from trace_ext import reference as ref  # noqa: E402

DEV = "cuda"
N_SETS = 4
ROUNDS = 2
REP_MS = 100
E, TOPK = 128, 8
PROJ = (("gate_up", 1536, 2048), ("down", 2048, 768))
TS = tuple(int(t) for t in os.environ.get("GROUPED_AB_TS", "1,16,64,256").split(","))  # GROUPED_AB_TS overrides
SKEW = float(os.environ.get("GROUPED_AB_SKEW", "0"))  # router skew (bench_gemm.routed_offsets); 0: uniform routing
ENV = "TRACE_EXT_DECODE_IMPL"
# TRACE_EXT_DECODE_IMPL values ("default": unset; "@VAR=VALUE" sets a further switch, common.impl_env): the grouped
# stream kernel (the default before f062b32), the K-slab kernel's whole jobs under the previous plan (the default before
# 2026-11-30 11:30) and the current one, its flat ranges, and the default (per call one of the two orders);
# GROUPED_AB_IMPLS=a,b,... overrides (the first is the speedup baseline; each is checked against the f64 bound)
IMPLS = tuple(os.environ.get(
    "GROUPED_AB_IMPLS", "stream,kslab-grouped@TRACE_EXT_KSLAB_GRP_PLAN=v1,kslab-grouped,kslab-flat,default").split(","))


def _run(impl, a, wp, offsets):
    with impl_env(ENV, impl):
        return O.fp4_grouped_linear(a, wp, offsets, backend="cuda")


def _check(a, q, wp, offsets, N):
    """Every FP4 kernel within the f64 reference bound on every active expert; returns, per kernel after the first, the
    fraction of outputs equal to the first kernel's bit for bit (their K splits differ, so a few fp32 sums round
    differently)."""
    ys = {impl: _run(impl, a, wp, offsets) for impl in IMPLS}
    for impl, y in ys.items():
        assert y.shape == (a.shape[0], N) and y.dtype == torch.bfloat16, impl
    off = offsets.tolist()
    a64 = a.double()
    for e in range(E):
        lo, hi = off[e], off[e + 1]
        if hi > lo:
            check_gemm_bound({impl: y[lo:hi] for impl, y in ys.items()}, a64[lo:hi], nvfp4_f64(q, e), f" expert {e}")
    return {impl: float((ys[IMPLS[0]] == ys[impl]).double().mean()) for impl in IMPLS[1:]}


def main():
    torch.manual_seed(0)
    copy_bw = copy_bandwidth_gbs()
    print(f"copy bandwidth: {copy_bw:.0f} GB/s")
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    for name, N, K in PROJ:
        sets = []
        for _ in range(N_SETS):
            x = torch.randn(E, N, K, device=DEV) * 0.02
            q = ref.nvfp4_quantize(x, scope="matrix")
            del x
            sets.append((q, O.prepare_fp4_weight(q), ref.nvfp4_dequantize(q, torch.bfloat16).transpose(-2, -1)))
        for T in TS:
            offsets = routed_offsets(T, E, TOPK, gen, SKEW)
            active = int((offsets[1:] > offsets[:-1]).sum())
            M = T * TOPK
            a = torch.randn(M, K, device=DEV).bfloat16()
            same = _check(a, sets[0][0], sets[0][1], offsets, N)
            nw = _rot([s[1] for s in sets])
            nb = _rot([s[2] for s in sets])
            offs_end = offsets[1:].contiguous()
            t = {k: [] for k in (*IMPLS, "grouped_mm")}
            for _ in range(ROUNDS):
                for impl in IMPLS:
                    with impl_env(ENV, impl):
                        t[impl].append(do_bench_cold(lambda: O.fp4_grouped_linear(a, nw(), offsets, backend="cuda"),
                                                     rep_ms=REP_MS))
                t["grouped_mm"].append(do_bench_cold(lambda: torch._grouped_mm(a, nb(), offs=offs_end), rep_ms=REP_MS))
            ms = {k: statistics.median(v) for k, v in t.items()}
            nbytes = active * (N * K // 2 + N * K // 16) + M * K * 2 + M * N * 2
            bw = lambda m: 100 * nbytes / (m * 1e-3) / 1e9 / copy_bw  # noqa: E731
            row = {"shape": f"qwen3 {name} T={T} top{TOPK}" + (f" skew {SKEW:g}" if SKEW else ""), "active": active,
                   "M": M, "max rows": int((offsets[1:] - offsets[:-1]).max())}
            row.update({f"{k}_us": 1e3 * ms[k] for k in (*IMPLS, "grouped_mm")})
            row.update({f"{k}_%BW": bw(ms[k]) for k in IMPLS})
            row.update({f"{k}_speedup": ms[IMPLS[0]] / ms[k] for k in IMPLS[1:]})
            row.update({f"{k}_vs_grouped_mm": ms["grouped_mm"] / ms[k] for k in IMPLS})
            row.update({f"{k}_bit_equal_to_{IMPLS[0]}": v for k, v in same.items()})
            rows.append(row)
            print_table(rows[-1:])
        del sets
        torch.cuda.empty_cache()
    print_table(rows)
    path = write_results("decode_grouped_ab_h200", rows, env_stamp("python bench/bench_decode_grouped_ab.py"),
                         notes=f"copy BW {copy_bw:.0f} GB/s; medians of {ROUNDS} interleaved rounds")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
