"""A/B of the NVFP4 quantize element-code variants in one process (TRACE_EXT_QUANT_IMPL is read per call):
"default" (the lean kernel: RTN by the power-of-two magic add, quantize with linear scales through the lean flat
kernel; SR / guided in the 2^-14-scaled domain), "rtn-sat" (the previous default: RTN saturated after packing),
"bits" (the previous SR / guided code) and "rtn-fminf" (RTN saturated per element by fminf), on 2^26 and 2^28 bf16
elements (H200).

Each (op, shape) is timed for every variant in two interleaved rounds (A B C A B C; the better median of the two is
kept) so that clock / thermal drift between variants cancels; every output (codes, scales, g, mbits) of every variant is
checked equal to the default's first.
Timing: bench.common.do_bench_cold (median, L2 flushed before every call); % of the device-to-device copy bandwidth
measured in the same run, bytes counted as in bench_quant.py.
Run from the repo root with the package installed:  python bench/bench_quant_impl.py
(about 50 s for all four variants; QUANT_IMPL_VARIANTS=rtn-sat python bench/bench_quant_impl.py: two, ~25 s)
The lean per-row-g kernel (=rowg-lean: RTN quantize with g None, linear / swizzled / capture; =rowg-lean2: two
blocks per lane for every K) on K 4096 (rowg-lean: one block per lane), K 7168 (both: two) and K 1024 (4 rows per
CTA), ~40 s:
  QUANT_IMPL_VARIANTS=rowg-lean,rowg-lean2 QUANT_IMPL_OPS="rtn (per-row,swizzled,capture" \
  QUANT_IMPL_SHAPES=65536x4096,16384x4096,37449x7168,262144x1024 python bench/bench_quant_impl.py
SR's lean element code (=sr-lean: NVFP4 SR quantize / fake-quantize and MXFP4 SR), ~25 s:
  QUANT_IMPL_VARIANTS=sr-lean QUANT_IMPL_OPS=sr python bench/bench_quant_impl.py
The guided-lean kernel (=guided-lean: guided quantize through nvfp4_quant_guided_lean_kernel; everything else the
default's), guided compact / full on 2^26 and 2^28 elements, ~20 s:
  QUANT_IMPL_VARIANTS=guided-lean QUANT_IMPL_OPS=guided python bench/bench_quant_impl.py
RTN fake quantization with g None through the lean3 kernel (the default since round 54, =fake-lean3) against the
previous kernel (=sr-row), without and with emit_guidance, ~20 s:
  QUANT_IMPL_VARIANTS=sr-row QUANT_IMPL_OPS="fake-quant rtn" python bench/bench_quant_impl.py
RTN quantize / fake quantization with g given (per row, or one g) through the lean3 kernel's GIVEN instantiations
(the default for K 1024 / 2048 / 4096 / 7168 / 8192; =1 every K it takes) against the flat kernels (=0), ~30 s:
  QUANT_IMPL_VARIANTS=default@TRACE_EXT_QUANT_GIVEN_LEAN3=0 QUANT_IMPL_OPS="rtn (g" python bench/bench_quant_impl.py
Guided quantize through the lean3 kernel's guided instantiations (the default for compact of bf16 x; =1: full too)
against the guided lean kernel (=0), ~15 s:
  QUANT_IMPL_VARIANTS=default@TRACE_EXT_QUANT_GUIDED_LEAN3=0,default@TRACE_EXT_QUANT_GUIDED_LEAN3=1 QUANT_IMPL_OPS=guided \
  python bench/bench_quant_impl.py
The per-team barrier of the per-row lean3 kernel (the default for fake quantization; =1: quantize too; =0: never), ~25 s:
  QUANT_IMPL_VARIANTS=default@TRACE_EXT_QUANT_TEAM_BAR=0,default@TRACE_EXT_QUANT_TEAM_BAR=1 \
  QUANT_IMPL_OPS="rtn (per-row,fake-quant rtn (per-row" python bench/bench_quant_impl.py
Swizzled scales of the per-row lean3 kernel staged per CTA and stored as 16-byte chunks (the default) against the
scattered byte stores (=default@TRACE_EXT_QUANT_SWZ_STAGED=0), ~20 s:
  QUANT_IMPL_VARIANTS=default@TRACE_EXT_QUANT_SWZ_STAGED=0 QUANT_IMPL_OPS=swizzled \
  QUANT_IMPL_SHAPES=16384x4096,65536x4096,9362x7168,37449x7168,65536x1024 python bench/bench_quant_impl.py
MXFP4 RTN of 16-bit x with two lanes per block (the default since round 66) against one lane per block
(=default@TRACE_EXT_MX_HALF=0), ~10 s:
  QUANT_IMPL_VARIANTS=default@TRACE_EXT_MX_HALF=0 QUANT_IMPL_OPS="mxfp4 rtn" python bench/bench_quant_impl.py
MXFP4 quantize with another grid (TRACE_EXT_MX_TILES: tiles per warp the grid aims at, default 4), ~20 s:
  QUANT_IMPL_VARIANTS=default@TRACE_EXT_MX_TILES=1,default@TRACE_EXT_MX_TILES=2,default@TRACE_EXT_MX_TILES=8 \
  QUANT_IMPL_OPS=mxfp4 python bench/bench_quant_impl.py
Guided fake quantization (the trainer's TRACE forward) through the lean3 kernel's FAKE guided instantiations (the
default since rounds 63-65) against the generic flat kernel (=default@TRACE_EXT_QUANT_FAKE_GUIDED_LEAN3=0), ~15 s:
  QUANT_IMPL_VARIANTS=default@TRACE_EXT_QUANT_FAKE_GUIDED_LEAN3=0 QUANT_IMPL_OPS="fake-quant guided" \
  python bench/bench_quant_impl.py
QUANT_IMPL_DTYPE=fp16 times fp16 x instead of bf16.
A variant may set further switches after "@": the per-row lean kernels as one persistent wave of CTAs (the grid before
round 52; the default walks at most 4 row groups per CTA), ~20 s:
  QUANT_IMPL_VARIANTS=default@TRACE_EXT_QUANT_LEAN_ITERS=0 QUANT_IMPL_OPS="rtn (per-row" python bench/bench_quant_impl.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_quant import nvfp4_inputs  # noqa: E402
from common import (  # noqa: E402
    copy_bandwidth_gbs, do_bench_cold, env_stamp, impl_env, print_table, require_kernels_usable, write_results)

import trace_ext  # noqa: E402

SHAPES = ((16384, 4096), (65536, 4096))  # 2^26 and 2^28 elements
# QUANT_IMPL_VARIANTS=default,rtn-sat times a subset ("default" is always first: codes are compared against it)
VARIANTS = ("default",) + tuple(
    v for v in os.environ.get("QUANT_IMPL_VARIANTS", "rtn-sat,bits,rtn-fminf").split(",") if v and v != "default")
ENV = "TRACE_EXT_QUANT_IMPL"
# QUANT_IMPL_SHAPES=RxK,RxK overrides SHAPES; QUANT_IMPL_OPS=word,word times only the ops whose name contains a word
if os.environ.get("QUANT_IMPL_SHAPES"):
    SHAPES = tuple(tuple(int(d) for d in s.split("x")) for s in os.environ["QUANT_IMPL_SHAPES"].split(",") if s)
OPS = tuple(w for w in os.environ.get("QUANT_IMPL_OPS", "").split(",") if w)
DTYPE = os.environ.get("QUANT_IMPL_DTYPE", "bf16")  # x's dtype: bf16 or fp16


def with_variant(v: str, fn):
    """fn() under variant v: a TRACE_EXT_QUANT_IMPL value ("default": unset), optionally followed by @VAR=VALUE
    settings of further switches (e.g. default@TRACE_EXT_QUANT_LEAN_ITERS=0; common.impl_env)."""
    with impl_env(ENV, v):
        return fn()


def main() -> None:
    require_kernels_usable()
    op = torch.ops.trace_ext
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth: {copy_gbs:.1f} GB/s")
    rows = []
    for R, K in SHAPES:
        n = R * K
        x, g, codes, scales, g_out, x_train, mbits, q_bytes, compact, full = with_variant(
            "default", lambda: nvfp4_inputs(op, R, K, {"bf16": torch.bfloat16, "fp16": torch.float16}[DTYPE]))
        g1 = g[:1].contiguous()  # one g for every row (a weight's per-tensor g)
        cases = [
            ("nvfp4 rtn (per-row g fused)", q_bytes + 4 * R,
             lambda: op.nvfp4_quantize(x, None, 0, 0, 0, None, None, None, False, False)),
            ("nvfp4 rtn (g given)", q_bytes + 8 * R,
             lambda: op.nvfp4_quantize(x, g, 0, 0, 0, None, None, None, False, False)),
            ("nvfp4 rtn (g scalar)", q_bytes + 4 * R,
             lambda: op.nvfp4_quantize(x, g1, 0, 0, 0, None, None, None, False, False)),
            ("nvfp4 rtn swizzled", q_bytes + 4 * R,
             lambda: op.nvfp4_quantize(x, None, 0, 0, 0, None, None, None, True, False)),
            ("nvfp4 capture (rtn + mbits)", q_bytes + 4 * R + n // 8,
             lambda: op.nvfp4_quantize(x, None, 0, 0, 0, None, None, None, False, True)),
            ("nvfp4 sr (per-row g fused)", q_bytes + 4 * R,
             lambda: op.nvfp4_quantize(x, None, 1, 7, 0, None, None, None, False, False)),
            ("nvfp4 sr (g given)", q_bytes + 8 * R,
             lambda: op.nvfp4_quantize(x, g, 1, 7, 0, None, None, None, False, False)),
            ("nvfp4 guided compact", q_bytes + 4 * R + compact,
             lambda: op.nvfp4_quantize(x_train, None, 2, 0, 0, scales, g_out, mbits, False, False)),
            ("nvfp4 guided full", q_bytes + 4 * R + full,
             lambda: op.nvfp4_quantize(x_train, None, 3, 0, 0, scales, g_out, codes, False, False)),
            ("nvfp4 fake-quant rtn (per-row g fused)", 4 * n,
             lambda: op.nvfp4_fake_quantize(x, None, 0, 0, 0, None, None, None, False)),
            ("nvfp4 fake-quant rtn (g given)", 4 * n + 4 * R,
             lambda: op.nvfp4_fake_quantize(x, g, 0, 0, 0, None, None, None, False)),
            ("nvfp4 fake-quant rtn + emit guidance", 4 * n + n // 8 + n // 16 + 4 * R,
             lambda: op.nvfp4_fake_quantize(x, None, 0, 0, 0, None, None, None, True)),
            ("nvfp4 fake-quant guided compact", 4 * n + compact,  # compact / full: the record read, g included
             lambda: op.nvfp4_fake_quantize(x_train, None, 2, 0, 0, scales, g_out, mbits, False)),
            ("nvfp4 fake-quant guided compact + emit guidance", 4 * n + compact + n // 8 + n // 16 + 4 * R,
             lambda: op.nvfp4_fake_quantize(x_train, None, 2, 0, 0, scales, g_out, mbits, True)),
            ("nvfp4 fake-quant guided full", 4 * n + full,
             lambda: op.nvfp4_fake_quantize(x_train, None, 3, 0, 0, scales, g_out, codes, False)),
            ("nvfp4 fake-quant sr (per-row g fused)", 4 * n,
             lambda: op.nvfp4_fake_quantize(x, None, 1, 7, 0, None, None, None, False)),
            ("mxfp4 rtn", 2 * n + n // 2 + n // 32, lambda: op.mxfp4_quantize(x, 0, 0, 0, False)),
            ("mxfp4 sr", 2 * n + n // 2 + n // 32, lambda: op.mxfp4_quantize(x, 1, 7, 0, False)),
        ]
        cases = [c for c in cases if not OPS or any(w in c[0] for w in OPS)]
        for name, nbytes, fn in cases:
            outs = {v: with_variant(v, fn) for v in VARIANTS}
            same = all(torch.equal(a, b) for v in VARIANTS for a, b in zip(outs[v], outs["default"]))
            best = {v: float("inf") for v in VARIANTS}
            for _ in range(2):
                for v in VARIANTS:
                    best[v] = min(best[v], with_variant(v, lambda: do_bench_cold(fn)))
            for v in VARIANTS:
                gbs = nbytes / (best[v] * 1e-3) / 1e9
                rows.append({"op": name, "shape": f"{R}x{K}" + ("" if DTYPE == "bf16" else f" {DTYPE}"), "variant": v, "ms": best[v], "GB/s": gbs,
                             "% copy": 100.0 * gbs / copy_gbs,
                             "vs default": best["default"] / best[v],
                             "codes equal": same})
        del x, x_train, codes, scales, g_out, mbits
        torch.cuda.empty_cache()
    print_table(rows)
    env = " ".join(f"{k}={os.environ[k]!r}" for k in ("QUANT_IMPL_VARIANTS", "QUANT_IMPL_OPS", "QUANT_IMPL_SHAPES", "QUANT_IMPL_DTYPE")
                   if os.environ.get(k))
    path = write_results("quant_impl_h200", rows, env_stamp((env + " " if env else "") + "python bench/bench_quant_impl.py"),
                         notes=f"copy bandwidth {copy_gbs:.1f} GB/s; variants via {ENV} (read per call)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
