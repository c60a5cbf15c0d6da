"""Probe (H200): the FP4-KV decode launch at almost no work, against the smallest device copy, under do_bench
(cold L2), to split the decode kernel's ~13.5 us fixed part (bench_kv_scaling.py, 1 split) into launch floor and
kernel prologue / epilogue. 256 CTAs (B256 Hq32 Hkv4, 1 split) with every sequence 0, 16, 32, 64, 128 tokens long;
also B32 Hq32 Hkv4 with 8 splits, with the separate combine kernel (the default since round 88) and the fused split
finish (TRACE_EXT_KV_DECODE_COMBINE=fused); the batched finish (TRACE_EXT_KV_FINISH=batched) exists only on branch
next/round48 (add its case there). For the default at 0, 128 and 1024 tokens also do_bench of two back-to-back calls
(the second follows a kernel with the same shared-memory carveout; at 0 tokens it reads nothing but the block table
and Q, at 128 tokens per CTA its 19 MB are still in L2, at 1024 its 151 MB mostly not): if the second call at 0
tokens costs much less than the first, part of the fixed cost is launch-side (carveout reconfiguration, ramp), not
the kernel's prologue. With TRACE_EXT_KV_CARVEOUT=driver set (a fresh process: the attribute is set once) the decode
kernels leave the L1 / shared split to the driver instead of asking for the largest shared carveout. Prints a table;
writes nothing.
Run: python tools/probes/kv_fixed_cost.py   (~10 s)
"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from bench_kv import D, random_cache  # noqa: E402
from common import do_bench_cold, impl_env  # noqa: E402

import trace_ext  # noqa: E402, F401

op = torch.ops.trace_ext.fp4kv_decode_attention
gen = torch.Generator(device="cuda").manual_seed(0)
src = torch.empty(4096, dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
print(f"copy 4 KB: {1e3 * do_bench_cold(lambda: dst.copy_(src)):.2f} us")
x = torch.zeros(1, device="cuda")
print(f"add_ on 1 float: {1e3 * do_bench_cold(lambda: x.add_(1.0)):.2f} us")
# (B, H_kv, splits, variant as in the A/B benches: a TRACE_EXT_KV_DECODE_IMPL value with optional @VAR=VALUE)
CASES = ((256, 4, 1, "default"), (32, 4, 8, "default"), (32, 4, 8, "default@TRACE_EXT_KV_DECODE_COMBINE=fused"))
for B, Hkv, splits, variant in CASES:
    kc, ks, vc, vs, table, seq_lens = random_cache(B, Hkv, 1024 * splits, gen)
    q = torch.randn(B, 32, D, device="cuda", generator=gen).to(torch.bfloat16)
    for n in (0, 16, 32, 64, 128, 1024):
        lens = torch.full_like(seq_lens, n * splits)
        one = lambda: op(q, kc, ks, vc, vs, table, lens, 1.0 / math.sqrt(D), 0.01, 0.02, splits)  # noqa: E731
        with impl_env("TRACE_EXT_KV_DECODE_IMPL", variant):
            t1 = do_bench_cold(one)
            line = f"B{B} Hkv{Hkv} splits={splits} {variant} tokens per CTA {n}: {1e3 * t1:.2f} us"
            if variant == "default" and n in (0, 128, 1024):  # back to back: the second call's share
                t2 = do_bench_cold(lambda: (one(), one()))
                line += f"; two calls {1e3 * t2:.2f} us, second call {1e3 * (t2 - t1):.2f} us"
        print(line)
