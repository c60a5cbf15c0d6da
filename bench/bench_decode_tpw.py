"""A/B of the decode stream kernel's grid size: TRACE_EXT_DECODE_TPW = fewest tiles (16 rows x 256 K) per warp
(default 2; read by the extension at every call). Below a full resident wave each warp of the stream kernel streams
2-3 tiles, so its one-time work (~375 instructions, about one tile's worth) and ring ramp are paid per 2 tiles;
fewer, longer streams trade that against memory parallelism.

Cases: the dense W4A16 decode rows of bench_gemm.py that run the stream kernel (TRACE_EXT_DECODE_IMPL=stream, all
three shapes) and the grouped Qwen3-30B-A3B decode rows (E = 128, top-8). Per case, ROUNDS interleaved rounds of every
TPW value, each a do_bench_cold median over >= 4 rotated weight sets (cold L2); the row reports the median over the
rounds, % of copy bandwidth on the bytes moved, and the speedup over TPW = 2. Before timing, every TPW value's output
is checked against the float64 reference bound of the GPU tests (the K splits differ between values, so bits may).
Run: python bench/bench_decode_tpw.py dense | grouped   (about 40 s each on an H200; results in
decode_tpw_<part>_h200.{json,md} under $BENCH_OUT or bench/results/).
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemm import _rot, routed_offsets  # noqa: E402
from common import copy_bandwidth_gbs, do_bench_cold, env_stamp, env_switch, print_table, write_results  # noqa: E402

import trace_ext.ops as O  # noqa: E402
from trace_ext import reference as ref  # noqa: E402
from trace_ext import reference_gemm as R  # noqa: E402

DEV = "cuda"
N_SETS = 4
ROUNDS = 2
TPWS = ("2", "3", "4", "6", "8")


def _within_bound(y, a, w64, what):
    exact = a.double() @ w64.T
    ref_bf16 = R.round_to_bf16(exact)
    tol = R.gemm_tolerance(a.double(), w64, ref_bf16)
    bad = int((~((y.double() - ref_bf16.double()).abs() <= tol)).sum())
    if bad:
        raise AssertionError(f"{what}: {bad} outputs outside the reference bound")


def _time_tpws(call, nbytes, copy_bw, label):
    t = {v: [] for v in TPWS}
    for _ in range(ROUNDS):
        for v in TPWS:
            with env_switch("TRACE_EXT_DECODE_TPW", v):
                t[v].append(do_bench_cold(call))
    ms = {v: statistics.median(x) for v, x in t.items()}
    row = {"case": label}
    row.update({f"tpw{v}_ms": ms[v] for v in TPWS})
    row.update({f"tpw{v}_%BW": 100 * nbytes / (ms[v] * 1e-3) / 1e9 / copy_bw for v in TPWS})
    row.update({f"tpw{v}_speedup": ms["2"] / ms[v] for v in TPWS if v != "2"})
    row["best"] = min(TPWS, key=lambda v: ms[v])
    return row


def dense(copy_bw):
    rows = []
    with env_switch("TRACE_EXT_DECODE_IMPL", "stream"):
        for N, K in ((14336, 4096), (4096, 14336), (7168, 4096)):
            qs = [ref.nvfp4_quantize(torch.randn(N, K, device=DEV) * 0.02, scope="tensor") for _ in range(N_SETS)]
            ws = [O.prepare_fp4_weight(q) for q in qs]
            g = qs[0].g.double().reshape(-1)  # one value per row (reference.nvfp4_quantize expands the tensor's g)
            w64 = R.dequantize_f64(qs[0].codes, qs[0].scales) * (g[:, None] if g.numel() > 1 else g)
            for M in (1, 8, 16, 32):
                a = torch.randn(M, K, device=DEV).bfloat16()
                for v in TPWS:
                    with env_switch("TRACE_EXT_DECODE_TPW", v):
                        _within_bound(O.fp4_linear(a, ws[0], backend="cuda"), a, w64, f"tpw {v} M={M} {N}x{K}")
                nw = _rot(ws)
                nbytes = N * K // 2 + N * K // 16 + M * K * 2 + M * N * 2
                rows.append(_time_tpws(lambda: O.fp4_linear(a, nw(), backend="cuda"), nbytes, copy_bw,
                                       f"stream M={M} N={N} K={K}"))
                print_table(rows[-1:])
            del qs, ws
            torch.cuda.empty_cache()
    return rows


def grouped(copy_bw):
    rows = []
    E, k = 128, 8
    gen = torch.Generator(device=DEV).manual_seed(0)
    for name, N, K in (("gate_up", 1536, 2048), ("down", 2048, 768)):
        qs = [ref.nvfp4_quantize(torch.randn(E, N, K, device=DEV) * 0.02, scope="matrix") for _ in range(N_SETS)]
        ws = [O.prepare_fp4_weight(q) for q in qs]
        for T in (1, 16, 64, 256):
            offsets = routed_offsets(T, E, k, gen)
            active = int((offsets[1:] > offsets[:-1]).sum())
            M = T * k
            a = torch.randn(M, K, device=DEV).bfloat16()
            off = offsets.tolist()
            w64 = {e: R.dequantize_f64(qs[0].codes[e], qs[0].scales[e]) * qs[0].g[e].double().reshape(-1, 1)
                   for e in range(E) if off[e + 1] > off[e]}  # g: one value per row of each expert
            for v in TPWS:
                with env_switch("TRACE_EXT_DECODE_TPW", v):
                    y = O.fp4_grouped_linear(a, ws[0], offsets, backend="cuda")
                for e, we in w64.items():
                    _within_bound(y[off[e]:off[e + 1]], a[off[e]:off[e + 1]], we, f"tpw {v} {name} T={T} e={e}")
            del w64
            nw = _rot(ws)
            nbytes = active * (N * K // 2 + N * K // 16) + M * K * 2 + M * N * 2
            rows.append(_time_tpws(lambda: O.fp4_grouped_linear(a, nw(), offsets, backend="cuda"), nbytes, copy_bw,
                                   f"qwen3 {name} T={T} active={active}"))
            print_table(rows[-1:])
        del qs, ws
        torch.cuda.empty_cache()
    return rows


def main():
    torch.manual_seed(0)
    part = sys.argv[1] if len(sys.argv) > 1 else "dense"
    copy_bw = copy_bandwidth_gbs()
    print(f"copy bandwidth: {copy_bw:.0f} GB/s")
    rows = {"dense": dense, "grouped": grouped}[part](copy_bw)
    print_table(rows)
    path = write_results(f"decode_tpw_{part}_h200", rows, env_stamp(f"python bench/bench_decode_tpw.py {part}"),
                         notes=f"copy BW {copy_bw:.0f} GB/s; medians of {ROUNDS} interleaved rounds")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
