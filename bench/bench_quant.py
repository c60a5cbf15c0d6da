"""Bandwidth of the NVFP4 / MXFP4 quantization kernels on 2^26 and 2^28 bf16 elements (H200).

Timing of record: bench.common.do_bench_cold (median, L2 flushed before every call). Each row reports the
bytes the op must move (x read 2 B + codes 0.5 B + scales 1/16 B per element; guided adds the rollout's record
per row; dequantize reads 0.5625 B and writes 2 B; fake quantization (the trainer's forward) reads 2 B and writes
2 B, plus the record for guided), GB/s, and % of the device-to-device copy bandwidth measured
in the same run, against the targets: RTN >= 80%, SR >= 72%, guided >= 72%, dequantize >= 80%.

Run from the repo root with the package installed:  python bench/bench_quant.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, do_bench_cold, env_stamp, print_table, require_kernels_usable, write_results  # noqa: E402

import trace_ext  # noqa: E402
from trace_ext import reference as ref  # noqa: E402

SHAPES = ((16384, 4096), (65536, 4096))  # 2^26 and 2^28 elements
TARGET = {"rtn": 80.0, "sr": 72.0, "guided": 72.0, "dequant": 80.0}


def nvfp4_inputs(op, R, K, dtype=torch.bfloat16):
    """Inputs shared by the NVFP4 quantize benchmarks for an R x K activation (bf16 unless dtype): x, its per-row g,
    the default quantization (codes, scales, g), a perturbed trainer-side x and the mantissa bits of the codes, and the
    bytes moved: quantize (x read, codes + scales written), compact and full guidance records read."""
    n = R * K
    x = torch.randn(R, K, device="cuda", dtype=dtype)
    g = ref.nvfp4_global_scale(x, "row").contiguous()
    codes, scales, g_out, _ = op.nvfp4_quantize(x, None, 0, 0, 0, None, None, None, False, False)
    x_train = (x.float() * (1 + 1e-3 * torch.randn_like(x, dtype=torch.float32))).to(dtype)
    mbits = ref.mantissa_bits_of_codes(codes)
    q_bytes = 2 * n + n // 2 + n // 16
    compact = R * (K // 8 + K // 16 + 4)
    full = R * (K // 2 + K // 16 + 4)
    return x, g, codes, scales, g_out, x_train, mbits, q_bytes, compact, full


def main() -> None:
    require_kernels_usable()
    op = torch.ops.trace_ext
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth: {copy_gbs:.1f} GB/s")
    rows = []
    for R, K in SHAPES:
        n = R * K
        x, g, codes, scales, g_out, x_train, mbits, q_bytes, compact, full = nvfp4_inputs(op, R, K)
        cases = [
            ("nvfp4 rtn (per-row g fused)", "rtn", q_bytes + 4 * R,
             lambda: op.nvfp4_quantize(x, None, 0, 0, 0, None, None, None, False, False)),
            ("nvfp4 rtn (g given)", "rtn", q_bytes + 8 * R,
             lambda: op.nvfp4_quantize(x, g, 0, 0, 0, None, None, None, False, False)),
            ("nvfp4 rtn swizzled", "rtn", q_bytes + 4 * R,
             lambda: op.nvfp4_quantize(x, None, 0, 0, 0, None, None, None, True, False)),
            ("nvfp4 sr (per-row g fused)", "sr", q_bytes + 4 * R,
             lambda: op.nvfp4_quantize(x, None, 1, 7, 0, None, None, None, False, False)),
            ("nvfp4 guided compact", "guided", q_bytes + 4 * R + compact,
             lambda: op.nvfp4_quantize(x_train, None, 2, 0, 0, scales, g_out, mbits, False, False)),
            ("nvfp4 guided full", "guided", q_bytes + 4 * R + full,
             lambda: op.nvfp4_quantize(x_train, None, 3, 0, 0, scales, g_out, codes, False, False)),
            ("nvfp4 capture (rtn + mbits)", "rtn", q_bytes + 4 * R + n // 8,
             lambda: op.nvfp4_quantize(x, None, 0, 0, 0, None, None, None, False, True)),
            ("nvfp4 fake-quant rtn (bf16 out)", "rtn", 4 * n,
             lambda: op.nvfp4_fake_quantize(x, None, 0, 0, 0, None, None, None, False)),
            ("nvfp4 fake-quant guided compact (bf16 out)", "guided", 4 * n + compact,
             lambda: op.nvfp4_fake_quantize(x_train, None, 2, 0, 0, scales, g_out, mbits, False)),
            ("nvfp4 dequantize -> bf16", "dequant", n // 2 + n // 16 + 4 * R + 2 * n,
             lambda: op.nvfp4_dequantize(codes, scales, g_out, torch.bfloat16)),
            ("mxfp4 rtn", "rtn", 2 * n + n // 2 + n // 32, lambda: op.mxfp4_quantize(x, 0, 0, 0, False)),
            ("mxfp4 sr", "sr", 2 * n + n // 2 + n // 32, lambda: op.mxfp4_quantize(x, 1, 7, 0, False)),
        ]
        mx_codes, mx_scales = op.mxfp4_quantize(x, 0, 0, 0, False)
        cases.append(("mxfp4 dequantize -> bf16", "dequant", n // 2 + n // 32 + 2 * n,
                      lambda: op.mxfp4_dequantize(mx_codes, mx_scales, torch.bfloat16)))
        for name, kind, nbytes, fn in cases:
            ms = do_bench_cold(fn)
            gbs = nbytes / (ms * 1e-3) / 1e9
            pct = 100.0 * gbs / copy_gbs
            rows.append({
                "op": name, "shape": f"{R}x{K}", "ms": ms, "MB": nbytes / 1e6, "GB/s": gbs, "% copy": pct,
                "target %": TARGET[kind], "status": "PASS" if pct >= TARGET[kind] else "MISS",
            })
        del x, x_train, codes, scales, g_out, mbits, mx_codes, mx_scales
        torch.cuda.empty_cache()
    print_table(rows)
    notes = f"copy bandwidth (same run): {copy_gbs:.1f} GB/s; bytes = minimum traffic of each op (see module docstring)"
    path = write_results("quant_h200", rows, env_stamp(), notes)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
