"""One call of each hot trace_ext kernel at a benchmark shape, for Nsight Compute (hardware counters).

Not a benchmark (no timing here): `make gpu-profile` runs this file under
`ncu --clock-control none -k regex:trace_ext --kernel-name-base mangled` so that the report shows issue-slot use,
DRAM throughput, occupancy and warp stall reasons of the kernels the benchmarks time. Each case runs twice; the
first call warms up caches of the host dispatch, ncu's --launch-skip is not needed.

Run: python bench/profile_kernels.py [case ...]   (cases: quant gemm kv decode grouped; default all)
"""
from __future__ import annotations

import math
import sys

import torch

import trace_ext.ops as O
from trace_ext import reference as ref

DEV = "cuda"


def quant_cases():
    op = torch.ops.trace_ext
    x = torch.randn(16384, 4096, device=DEV, dtype=torch.bfloat16)
    g = ref.nvfp4_global_scale(x, "row").contiguous()
    codes, scales, g_out, _ = op.nvfp4_quantize(x, None, 0, 0, 0, None, None, None, False, False)
    mbits = ref.mantissa_bits_of_codes(codes)
    torch.cuda.synchronize()
    yield "nvfp4 rtn per-row fused", lambda: op.nvfp4_quantize(x, None, 0, 0, 0, None, None, None, False, False)
    yield "nvfp4 rtn g given", lambda: op.nvfp4_quantize(x, g, 0, 0, 0, None, None, None, False, False)
    yield "nvfp4 sr", lambda: op.nvfp4_quantize(x, None, 1, 7, 0, None, None, None, False, False)
    yield "nvfp4 guided compact", lambda: op.nvfp4_quantize(x, None, 2, 0, 0, scales, g_out, mbits, False, False)
    yield "nvfp4 dequantize", lambda: op.nvfp4_dequantize(codes, scales, g_out, torch.bfloat16)
    yield "mxfp4 rtn", lambda: op.mxfp4_quantize(x, 0, 0, 0, False)


def gemm_cases():
    sys.path.insert(0, "bench")
    from bench_gemm import routed_offsets  # noqa: PLC0415

    q = ref.nvfp4_quantize(torch.randn(14336, 4096, device=DEV) * 0.02, scope="tensor")
    w = O.prepare_fp4_weight(q)
    a1 = torch.randn(1, 4096, device=DEV).bfloat16()
    a16 = torch.randn(16, 4096, device=DEV).bfloat16()
    a4k = torch.randn(4096, 4096, device=DEV).bfloat16()
    yield "dense decode M=1 14336x4096", lambda: O.fp4_linear(a1, w, backend="cuda")
    yield "dense decode M=16 14336x4096", lambda: O.fp4_linear(a16, w, backend="cuda")
    yield "large M=4096 W4A16 14336x4096", lambda: O.fp4_linear(a4k, w, backend="cuda")
    E, k, N, K, T = 128, 8, 1536, 2048, 16
    qg = ref.nvfp4_quantize(torch.randn(E, N, K, device=DEV) * 0.02, scope="matrix")
    wg = O.prepare_fp4_weight(qg)
    gen = torch.Generator(device=DEV).manual_seed(0)
    offsets = routed_offsets(T, E, k, gen)
    a = torch.randn(T * k, K, device=DEV).bfloat16()
    yield "grouped decode qwen3 gate_up T=16", lambda: O.fp4_grouped_linear(a, wg, offsets, backend="cuda")


def kv_cases():
    sys.path.insert(0, "bench")
    from bench_kv import D, append_inputs, random_cache  # noqa: PLC0415
    from common import env_switch  # noqa: PLC0415

    gen = torch.Generator(device=DEV).manual_seed(0)
    op = torch.ops.trace_ext
    B, Hq, Hkv, S = 32, 32, 4, 8192
    kc, ks, vc, vs, table, seq_lens = random_cache(B, Hkv, S, gen)
    q = torch.randn(B, Hq, D, device=DEV, generator=gen).to(torch.bfloat16)
    yield "kv decode B32 Hq32 Hkv4 S8K", lambda: op.fp4kv_decode_attention(
        q, kc, ks, vc, vs, table, seq_lens, 1 / math.sqrt(D), 0.01, 0.02, 0)

    def g8():  # the swapped-operand g8 kernel, the default before the heads kernels (the switch is read per call)
        with env_switch("TRACE_EXT_KV_DECODE_IMPL", "g8"):
            return op.fp4kv_decode_attention(q, kc, ks, vc, vs, table, seq_lens, 1 / math.sqrt(D), 0.01, 0.02, 0)

    yield "kv decode g8 B32 Hq32 Hkv4 S8K", g8
    args = append_inputs(gen)
    yield "kv append B8 x 4096", lambda: op.fp4kv_append(*args)


def decode_cases():
    """The dense decode GEMM at the bench_gemm shapes: the default kernel at M = 1 / 8 / 16 / 32 and the opt-in pair2
    kernel at M = 16 / 32 (14336 x 4096), the default at M = 1 on 4096 x 14336."""
    sys.path.insert(0, "bench")
    from common import env_switch  # noqa: PLC0415

    def weight(n, k):
        return O.prepare_fp4_weight(ref.nvfp4_quantize(torch.randn(n, k, device=DEV) * 0.02, scope="tensor"))

    w = weight(14336, 4096)
    acts = {m: torch.randn(m, 4096, device=DEV).bfloat16() for m in (1, 8, 16, 32)}
    for m, a in acts.items():
        yield f"decode default M={m} 14336x4096", lambda a=a: O.fp4_linear(a, w, backend="cuda")
    for m in (16, 32):
        def pair2(a=acts[m]):
            with env_switch("TRACE_EXT_DECODE_IMPL", "pair2"):
                return O.fp4_linear(a, w, backend="cuda")

        yield f"decode pair2 M={m} 14336x4096", pair2
    w2 = weight(4096, 14336)
    a2 = torch.randn(1, 14336, device=DEV).bfloat16()
    yield "decode default M=1 4096x14336", lambda: O.fp4_linear(a2, w2, backend="cuda")


def grouped_cases():
    """The grouped (MoE) decode GEMM, default kernel, Qwen3-30B-A3B experts (E = 128, top-8) at the bench_gemm token
    counts, both projections."""
    sys.path.insert(0, "bench")
    from bench_gemm import routed_offsets  # noqa: PLC0415

    E, k = 128, 8
    gen = torch.Generator(device=DEV).manual_seed(0)
    for proj, N, K in (("gate_up", 1536, 2048), ("down", 2048, 768)):
        w = O.prepare_fp4_weight(ref.nvfp4_quantize(torch.randn(E, N, K, device=DEV) * 0.02, scope="matrix"))
        for T in (1, 16, 64, 256):
            offsets = routed_offsets(T, E, k, gen)
            a = torch.randn(T * k, K, device=DEV).bfloat16()
            yield f"grouped {proj} T={T}", lambda a=a, w=w, offsets=offsets: O.fp4_grouped_linear(
                a, w, offsets, backend="cuda")


CASES = {"quant": quant_cases, "gemm": gemm_cases, "kv": kv_cases, "decode": decode_cases, "grouped": grouped_cases}


def main() -> None:
    for name in sys.argv[1:] or list(CASES):
        for label, fn in CASES[name]():
            fn()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(label)
            fn()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            print(f"profiled: {label}", flush=True)


if __name__ == "__main__":
    main()
