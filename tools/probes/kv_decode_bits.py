"""Bit equality of the FP4-KV decode attention across two builds (an A/B round's N and B): `save FILE` runs every case
below and stores its bf16 output and fp32 LSE; `compare FILE` runs them again and compares bit for bit (exit 1 on any
difference). A change meant to keep the numerics (e.g. fewer instructions in the online softmax) is checked this way;
the GPU tests only bound the error against the reference.

Cases: every decode kernel family (heads8, the 4-warp heads kernel, g8, the G > 8 kernels with Q in shared memory and
in registers) through TRACE_EXT_KV_DECODE_IMPL, G 4 / 8 / 16, head dims 64 / 128, page sizes 16 / 64, mixed lengths
(1, 17, 300, 4096, an empty sequence), automatic and forced split counts (1, 8: the split finish), and scores spread so
that the lazy rescale runs mid-sequence (a growing ramp on Q . K).
Run (H200, extension built): python tools/probes/kv_decode_bits.py save /tmp/bits.pt; ... compare /tmp/bits.pt
"""
from __future__ import annotations

import math
import os
import sys

import torch

from trace_ext import ops
from trace_ext.kvcache import PagedFP4KVCache

DEV = "cuda"
LENS = (1, 17, 300, 4096, 0)
# (H_kv, G, D, P, impl): heads8 / heads need H_kv % 4 == 0; g8 takes G <= 8, qsmem / old take any G
CASES = [(4, 8, 128, 16, None), (8, 4, 128, 64, None), (4, 8, 64, 16, None), (4, 8, 128, 16, "heads"),
         (8, 4, 64, 16, "heads"), (2, 8, 128, 16, None), (2, 4, 64, 64, "g8"), (2, 16, 128, 16, None),
         (1, 16, 64, 16, "old"), (2, 16, 128, 64, "qsmem")]
SPLITS = (0, 1, 8)


def cache_for(Hkv, D, P, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    B = len(LENS)
    max_pages = max(1, max(math.ceil(n / P) for n in LENS))
    num_pages = B * max_pages + 3
    T = sum(LENS)
    k = torch.randn(T, Hkv, D, generator=gen, device=DEV)
    v = torch.randn(T, Hkv, D, generator=gen, device=DEV)
    # a ramp along each sequence's tokens on K's first channels: scores grow, the lazy rescale runs mid-sequence
    k[..., :8] += torch.linspace(0, 12, T, device=DEV)[:, None, None]
    k, v = k.bfloat16(), v.bfloat16()
    cache = PagedFP4KVCache(num_pages, P, Hkv, D, device=DEV, g_k=float(k.float().abs().max()) / 2688.0,
                            g_v=float(v.float().abs().max()) / 2688.0)
    table = torch.randperm(num_pages, generator=gen, device=DEV)[: B * max_pages].reshape(B, max_pages).int()
    cu = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    ops.fp4kv_append(cache, k, v, table, cu, torch.zeros(B, dtype=torch.int32, device=DEV), backend="cuda")
    return cache, table, torch.tensor(LENS, dtype=torch.int32, device=DEV), gen


def run_all() -> dict:
    out = {}
    for i, (Hkv, G, D, P, impl) in enumerate(CASES):
        cache, table, lens, gen = cache_for(Hkv, D, P, 100 + i)
        q = (torch.randn(len(LENS), Hkv * G, D, generator=gen, device=DEV) * 2.0).bfloat16()
        if impl is None:
            os.environ.pop("TRACE_EXT_KV_DECODE_IMPL", None)
        else:
            os.environ["TRACE_EXT_KV_DECODE_IMPL"] = impl
        for splits in SPLITS:
            o, lse = ops.fp4kv_decode_attention(q, cache, table, lens, num_splits=splits, backend="cuda")
            out[f"Hkv{Hkv} G{G} D{D} P{P} impl={impl} splits={splits}"] = (o.view(torch.int16).cpu(),
                                                                          lse.view(torch.int32).cpu())
    os.environ.pop("TRACE_EXT_KV_DECODE_IMPL", None)
    return out


def main() -> int:
    mode, path = sys.argv[1], sys.argv[2]
    got = run_all()
    if mode == "save":
        torch.save(got, path)
        print(f"saved {len(got)} cases to {path}")
        return 0
    want = torch.load(path)
    bad = [k for k in want if not (torch.equal(want[k][0], got[k][0]) and torch.equal(want[k][1], got[k][1]))]
    for k in bad:
        print(f"DIFFERENT: {k}: {int((want[k][0] != got[k][0]).sum())} output / "
              f"{int((want[k][1] != got[k][1]).sum())} LSE elements")
    print(f"{len(want) - len(bad)} of {len(want)} cases bit-equal")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
