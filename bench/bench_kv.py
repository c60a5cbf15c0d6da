"""FP4 KV cache on the H200: split-KV decode attention against torch SDPA on bf16 K/V, and the append kernel.

Timing of record: bench.common.do_bench_cold (median, L2 flushed before every call); the compiled ops are
called directly (torch.ops.trace_ext.*), without the Python argument checks, whose data-dependent page-table
check syncs the host.

Decode rows: bytes = K and V codes + scale bytes of every cached token + q read + out written (+ LSE);
GB/s and % of the device-to-device copy bandwidth measured in the same run; anchor = torch SDPA
(enable_gqa=True) on bf16 K/V of identical shapes in the same run; speedup = SDPA ms / FP4 ms.
Targets: >= 75% of copy bandwidth and >= 3.0x SDPA on the first three cases, >= 2.0x at B=1, S=131072.
Append row: a 4096-token prefill chunk for 8 sequences (bytes = bf16 K/V read + codes and scales written),
target >= 70% of copy bandwidth. Extra rows (no target) sweep the split count of two decode cases and the
page size of the first. The main rows use whatever TRACE_EXT_KV_DECODE_IMPL the run was started with (default:
the heads8 kernel, 4 KV heads per CTA, two warps per head, contiguous tile copies); A/B rows "impl=g8" time the
swapped-operand kernel (TRACE_EXT_KV_DECODE_IMPL=g8; the switch is read per call), on every case in the same
process, with its own split sweep. Rows "impl=heads" time the 4-warp heads kernel (TRACE_EXT_KV_DECODE_IMPL=heads;
interleaved A/B with heads8's split sweep: bench/bench_kv_heads_ab.py).

Run from the repo root with the package installed:  python bench/bench_kv.py   (< 3 min)
"""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, do_bench_cold, env_stamp, env_switch, print_table, require_kernels_usable, write_results  # noqa: E402

import trace_ext  # noqa: E402

PAGE = 16  # tokens per page (vLLM's default)
D = 128
# (name, B, Hq, Hkv, S, speedup target); Hq/Hkv of Llama-3-70B-like (32/4... per TP rank) and Llama-3-8B (32/8)
DECODE_CASES = [
    ("B32 Hq32 Hkv4 S8K", 32, 32, 4, 8192, 3.0),
    ("B64 Hq32 Hkv4 S4K", 64, 32, 4, 4096, 3.0),
    ("B8 Hq32 Hkv8 S32K", 8, 32, 8, 32768, 3.0),
    ("B1 Hq32 Hkv8 S128K", 1, 32, 8, 131072, 2.0),
]
BW_TARGET = 75.0
APPEND_TARGET = 70.0
PAGE_SWEEP = {"B32 Hq32 Hkv4 S8K": (1, 64, 256)}
# split sweep of the default (heads) kernel: its grid has H_kv / 4 head groups per sequence
SPLIT_SWEEP = {
    "B32 Hq32 Hkv4 S8K": (4, 8, 12, 16),
    "B64 Hq32 Hkv4 S4K": (2, 4, 8),
    "B8 Hq32 Hkv8 S32K": (8, 16, 32),
    "B1 Hq32 Hkv8 S128K": (32, 64, 128, 132, 256),
}
# split sweep of the g8 kernel (one KV head per CTA)
G8_SPLIT_SWEEP = {
    "B32 Hq32 Hkv4 S8K": (2, 3, 4),
    "B64 Hq32 Hkv4 S4K": (1, 2),
    "B8 Hq32 Hkv8 S32K": (4, 8),
    "B1 Hq32 Hkv8 S128K": (32, 64),
}


def _impl_env(value):
    """TRACE_EXT_KV_DECODE_IMPL set to `value` for the calls inside the block (the extension reads it per call)."""
    return env_switch("TRACE_EXT_KV_DECODE_IMPL", value)


def random_cache(B, Hkv, S, gen, page=PAGE):
    """Random but valid cache bytes (no NaN scale bytes) for B sequences of S tokens, pages shuffled."""
    pages_per_seq = math.ceil(S / page)
    num_pages = B * pages_per_seq
    code_shape = (num_pages, page, Hkv, D // 2)
    scale_shape = (num_pages, page, Hkv, D // 16)
    kc = torch.randint(0, 256, code_shape, dtype=torch.uint8, device="cuda", generator=gen)
    vc = torch.randint(0, 256, code_shape, dtype=torch.uint8, device="cuda", generator=gen)
    ks = torch.randint(0x30, 0x48, scale_shape, dtype=torch.uint8, device="cuda", generator=gen)
    vs = torch.randint(0x30, 0x48, scale_shape, dtype=torch.uint8, device="cuda", generator=gen)
    table = torch.randperm(num_pages, device="cuda", generator=gen).reshape(B, pages_per_seq).to(torch.int32)
    seq_lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    return kc, ks, vc, vs, table, seq_lens


def decode_bytes(B, Hq, Hkv, S):
    """Bytes a decode call must move: the codes and scales of K and V of B sequences of S tokens, q, out and lse."""
    return 2 * B * S * Hkv * (D // 2 + D // 16) + 2 * B * Hq * D * 2 + 4 * B * Hq


def decode_ab_start(*switches):
    """The KV decode A/B benches' start: kernels usable, `switches` unset (each impl sets its own), the case
    generator, the copy bandwidth (printed) and the decode op."""
    require_kernels_usable()
    for name in switches:
        os.environ.pop(name, None)
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth: {copy_gbs:.1f} GB/s")
    return gen, copy_gbs, torch.ops.trace_ext.fp4kv_decode_attention


def decode_case_inputs(gen):
    """The A/B benches' inputs, per DECODE_CASES entry: (name, bytes moved (the byte model of decode_rows: codes and
    scales of K and V, q, out, lse), the op's arguments up to the split count) on a random cache."""
    for name, B, Hq, Hkv, S, _ in DECODE_CASES:
        kc, ks, vc, vs, table, seq_lens = random_cache(B, Hkv, S, gen)
        q = torch.randn(B, Hq, D, device="cuda", generator=gen).to(torch.bfloat16)
        nbytes = decode_bytes(B, Hq, Hkv, S)
        yield name, nbytes, (q, kc, ks, vc, vs, table, seq_lens, 1.0 / math.sqrt(D), 0.01, 0.02)


def _sweep_row(case, ms, nbytes, copy_gbs, ms_sdpa):
    """One row of a split / page-size sweep (no target of its own)."""
    gbs = nbytes / (ms * 1e-3) / 1e9
    return {
        "case": case, "ms": ms, "MB": nbytes / 1e6, "GB/s": gbs, "% copy": 100.0 * gbs / copy_gbs,
        "sdpa ms": ms_sdpa, "sdpa GB/s": float("nan"), "speedup": ms_sdpa / ms, "target": "(sweep)", "status": "-",
    }


def decode_rows(copy_gbs, gen):
    op = torch.ops.trace_ext.fp4kv_decode_attention
    rows, sweep = [], []
    for name, B, Hq, Hkv, S, speed_target in DECODE_CASES:
        kc, ks, vc, vs, table, seq_lens = random_cache(B, Hkv, S, gen)
        q = torch.randn(B, Hq, D, device="cuda", generator=gen).to(torch.bfloat16)
        scale = 1.0 / math.sqrt(D)
        g_k, g_v = 0.01, 0.02
        nbytes = decode_bytes(B, Hq, Hkv, S)
        ms = do_bench_cold(lambda: op(q, kc, ks, vc, vs, table, seq_lens, scale, g_k, g_v, 0))
        # the anchor: SDPA over bf16 K/V of the same shapes
        kb = torch.randn(B, Hkv, S, D, device="cuda", generator=gen).to(torch.bfloat16)
        vb = torch.randn(B, Hkv, S, D, device="cuda", generator=gen).to(torch.bfloat16)
        q4 = q[:, :, None]
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q4, kb, vb, scale=scale, enable_gqa=True)  # noqa: E731
        ms_sdpa = do_bench_cold(sdpa)
        sdpa_bytes = 2 * kb.numel() * 2 + 2 * q.numel() * 2
        del kb, vb
        gbs = nbytes / (ms * 1e-3) / 1e9
        pct = 100.0 * gbs / copy_gbs
        speedup = ms_sdpa / ms
        ok = pct >= BW_TARGET and speedup >= speed_target
        rows.append({
            "case": f"decode {name}", "ms": ms, "MB": nbytes / 1e6, "GB/s": gbs, "% copy": pct,
            "sdpa ms": ms_sdpa, "sdpa GB/s": sdpa_bytes / (ms_sdpa * 1e-3) / 1e9, "speedup": speedup,
            "target": f">={BW_TARGET:.0f}% & >={speed_target:.1f}x", "status": "PASS" if ok else "MISS",
        })
        for splits in SPLIT_SWEEP.get(name, ()):
            ms_s = do_bench_cold(lambda: op(q, kc, ks, vc, vs, table, seq_lens, scale, g_k, g_v, splits))
            sweep.append(_sweep_row(f"decode {name} splits={splits}", ms_s, nbytes, copy_gbs, ms_sdpa))
        for impl, impl_sweep in (("g8", G8_SPLIT_SWEEP), ("heads", {})):  # A/B rows: earlier defaults
            with _impl_env(impl):
                ms_h = do_bench_cold(lambda: op(q, kc, ks, vc, vs, table, seq_lens, scale, g_k, g_v, 0))
                row = _sweep_row(f"decode {name} impl={impl}", ms_h, nbytes, copy_gbs, ms_sdpa)
                row["target"] = f">={BW_TARGET:.0f}% & >={speed_target:.1f}x (A/B)"
                row["status"] = "PASS" if row["% copy"] >= BW_TARGET and row["speedup"] >= speed_target else "MISS"
                rows.append(row)
                for splits in impl_sweep.get(name, ()):
                    ms_s = do_bench_cold(lambda: op(q, kc, ks, vc, vs, table, seq_lens, scale, g_k, g_v, splits))
                    sweep.append(_sweep_row(f"decode {name} impl={impl} splits={splits}", ms_s, nbytes, copy_gbs,
                                            ms_sdpa))
        del kc, ks, vc, vs
        torch.cuda.empty_cache()
        if name in PAGE_SWEEP:
            for page in PAGE_SWEEP[name]:
                kc, ks, vc, vs, table, seq_lens = random_cache(B, Hkv, S, gen, page)
                ms_p = do_bench_cold(lambda: op(q, kc, ks, vc, vs, table, seq_lens, scale, g_k, g_v, 0))
                sweep.append(_sweep_row(f"decode {name} page={page}", ms_p, nbytes, copy_gbs, ms_sdpa))
                with _impl_env("g8"):
                    ms_p = do_bench_cold(lambda: op(q, kc, ks, vc, vs, table, seq_lens, scale, g_k, g_v, 0))
                sweep.append(_sweep_row(f"decode {name} impl=g8 page={page}", ms_p, nbytes, copy_gbs, ms_sdpa))
                del kc, ks, vc, vs
    return rows, sweep


def append_inputs(gen, B=8, Hkv=8, chunk=4096):
    """Arguments of fp4kv_append for a prefill chunk of `chunk` tokens per sequence into an empty paged cache (room
    for two chunks per sequence, pages shuffled), written at token 1000: a second chunk, not page aligned."""
    T = B * chunk
    pages_per_seq = math.ceil(2 * chunk / PAGE)
    num_pages = B * pages_per_seq
    code_shape = (num_pages, PAGE, Hkv, D // 2)
    scale_shape = (num_pages, PAGE, Hkv, D // 16)
    kc = torch.zeros(code_shape, dtype=torch.uint8, device="cuda")
    vc = torch.zeros_like(kc)
    ks = torch.zeros(scale_shape, dtype=torch.uint8, device="cuda")
    vs = torch.zeros_like(ks)
    table = torch.randperm(num_pages, device="cuda", generator=gen).reshape(B, pages_per_seq).to(torch.int32)
    k = torch.randn(T, Hkv, D, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(T, Hkv, D, device="cuda", generator=gen).to(torch.bfloat16)
    cu = torch.arange(0, T + 1, chunk, dtype=torch.int32, device="cuda")
    start = torch.full((B,), 1000, dtype=torch.int32, device="cuda")
    return (kc, ks, vc, vs, k, v, table, cu, start, 0.01, 0.02)


def append_row(copy_gbs, gen):
    op = torch.ops.trace_ext.fp4kv_append
    B, Hkv, chunk = 8, 8, 4096
    T = B * chunk
    args = append_inputs(gen, B, Hkv, chunk)
    nbytes = 2 * T * Hkv * D * 2 + 2 * T * Hkv * (D // 2 + D // 16)
    ms = do_bench_cold(lambda: op(*args))
    gbs = nbytes / (ms * 1e-3) / 1e9
    pct = 100.0 * gbs / copy_gbs
    return {
        "case": f"append B{B} x {chunk} tok Hkv{Hkv}", "ms": ms, "MB": nbytes / 1e6, "GB/s": gbs, "% copy": pct,
        "sdpa ms": float("nan"), "sdpa GB/s": float("nan"), "speedup": float("nan"),
        "target": f">={APPEND_TARGET:.0f}%", "status": "PASS" if pct >= APPEND_TARGET else "MISS",
    }


def main() -> None:
    require_kernels_usable()
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth: {copy_gbs:.1f} GB/s")
    rows, sweep = decode_rows(copy_gbs, gen)
    rows.append(append_row(copy_gbs, gen))
    rows += sweep
    print_table(rows)
    notes = (
        f"copy bandwidth {copy_gbs:.1f} GB/s; page size {PAGE}; head_dim {D}; FP4 bytes = codes + scales + q + out + lse; "
        "SDPA = torch.nn.functional.scaled_dot_product_attention(enable_gqa=True) on bf16 K/V, same shapes"
    )
    path = write_results("kv_h200", rows, env_stamp(), notes)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
