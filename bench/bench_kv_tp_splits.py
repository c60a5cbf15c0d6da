"""FP4 KV decode at tensor-parallel rank shapes (H_kv = 1, 2 per GPU): the default kernel (heads8 over folded tokens)
against the g8 kernel (the default there before), both with their automatic split counts, a sweep of the default's
split counts, and torch SDPA on bf16 K/V of the same shapes.

A rollout engine with tensor parallelism holds H_kv / TP KV heads per GPU: 1 or 2 for Qwen3-30B-A3B (H_kv 4, G 8) at
TP 2 / 4 and for Mixtral-like models (H_kv 8, G 4) at TP 4 / 8. Rows: the default ("auto"), g8 (TRACE_EXT_KV_DECODE_IMPL
=g8, read per call), the default at every split count that puts k = 1 .. 4 CTAs per head group on the busiest SM, the
best of that sweep and auto / best. Timing: bench.common.do_bench_cold (median, L2 flushed before every call); bytes
as bench_kv.

Run from the repo root with the package installed:  python bench/bench_kv_tp_splits.py   (~2 min on the H200)
"""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kv import D, decode_bytes, random_cache  # noqa: E402
from common import copy_bandwidth_gbs, do_bench_cold, env_stamp, env_switch, print_table, require_kernels_usable, write_results  # noqa: E402

# (model at TP, Hq, Hkv) per GPU
TP_SHAPES = [("Qwen3-30B-A3B TP2", 16, 2), ("Qwen3-30B-A3B TP4", 8, 1), ("Mixtral TP4", 8, 2), ("Mixtral TP8", 4, 1)]
BATCH_CONTEXTS = [(B, S) for B in (8, 32, 128) for S in (4096, 16384)] + [(1, 131072)]
MIN_SPLIT_TOKENS = 256  # the sweep's shortest split (tokens; the kernel takes 128 pseudo tokens = 256 or 512 tokens)


def split_candidates(pairs: int, S: int, sms: int) -> list[int]:
    """1, 2, 4, 8 and the split counts that put k = 1 .. 4 CTAs of `pairs` (sequence, head group) pairs on the busiest
    of `sms` SMs, at most one split per MIN_SPLIT_TOKENS tokens."""
    cap = max(1, min(S // MIN_SPLIT_TOKENS, 4 * sms))
    return sorted({s for s in (1, 2, 4, 8) if s <= cap} | {min(cap, max(1, (k * sms) // pairs)) for k in range(1, 5)})


def main() -> None:
    require_kernels_usable()
    os.environ.pop("TRACE_EXT_KV_DECODE_IMPL", None)
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy bandwidth: {copy_gbs:.1f} GB/s; {sms} SMs")
    op = torch.ops.trace_ext.fp4kv_decode_attention
    scale, g_k, g_v = 1.0 / math.sqrt(D), 0.01, 0.02
    rows = []
    for model, Hq, Hkv in TP_SHAPES:
        for B, S in BATCH_CONTEXTS:
            kc, ks, vc, vs, table, seq_lens = random_cache(B, Hkv, S, gen)
            q = torch.randn(B, Hq, D, device="cuda", generator=gen).to(torch.bfloat16)
            nbytes = decode_bytes(B, Hq, Hkv, S)
            ms_auto = do_bench_cold(lambda: op(q, kc, ks, vc, vs, table, seq_lens, scale, g_k, g_v, 0))
            with env_switch("TRACE_EXT_KV_DECODE_IMPL", "g8"):
                ms_g8 = do_bench_cold(lambda: op(q, kc, ks, vc, vs, table, seq_lens, scale, g_k, g_v, 0))
            sweep = {}
            for s in split_candidates(B, S, sms):
                sweep[s] = do_bench_cold(lambda: op(q, kc, ks, vc, vs, table, seq_lens, scale, g_k, g_v, s))
            best = min(sweep, key=sweep.get)
            del kc, ks, vc, vs
            kb = torch.randn(B, Hkv, S, D, device="cuda", generator=gen).to(torch.bfloat16)
            vb = torch.randn(B, Hkv, S, D, device="cuda", generator=gen).to(torch.bfloat16)
            q4 = q[:, :, None]
            ms_sdpa = do_bench_cold(
                lambda: torch.nn.functional.scaled_dot_product_attention(q4, kb, vb, scale=scale, enable_gqa=True))
            del kb, vb
            torch.cuda.empty_cache()
            gbs = nbytes / (ms_auto * 1e-3) / 1e9
            rows.append({
                "case": f"{model} B{B} Hq{Hq} Hkv{Hkv} S{S // 1024}K", "auto ms": ms_auto,
                "% copy": 100.0 * gbs / copy_gbs, "sdpa ms": ms_sdpa, "speedup": ms_sdpa / ms_auto,
                "g8 ms": ms_g8, "g8 / auto": ms_g8 / ms_auto,
                "best splits": best, "best ms": sweep[best], "auto / best": ms_auto / sweep[best],
                "sweep (splits: us)": " ".join(f"{s}:{1e3 * t:.1f}" for s, t in sweep.items()),
            })
            print(rows[-1], flush=True)
    print_table(rows)
    path = write_results("kv_tp_splits_h200", rows, env_stamp("python3 bench/bench_kv_tp_splits.py"),
                         notes=f"copy bandwidth {copy_gbs:.1f} GB/s; page size 16; head_dim {D}; auto = the default "
                               "kernel with its own split count (num_splits=0); g8 = TRACE_EXT_KV_DECODE_IMPL=g8, its "
                               "own split count; sweep = the default at explicit split counts")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
