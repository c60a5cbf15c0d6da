#!/usr/bin/env python3
"""Host emulation of the grouped K-slab decode plan (csrc/gemm_w4_decode_kslab_sm90.cu: kslab_grouped_plan,
grouped_flat_pays and launch_decode_kslab_grouped's unit estimate), no GPU needed.

For MoE shapes and token batches it prints the plan the launch picks (slab length L, slabs S, N chunks C, work order)
for 8- and 16-row units, and, over random uniform top-k routings, the real unit count (sum over experts of
ceil(rows / R)) and the probability that the whole-job order needs one more round of jobs than the plan sized its grid
for (real units * S * C > rounds * CTAs). That extra round is what made 8-row units lose 0.62-0.65x at 5 rows per
expert on the H200 (notes/GPU_RESULTS.md, seventh session, rounds 31-32); the default takes 8-row units up to 4 rows
per expert (kKsGrp8RowsMaxHint), where this gives 0-3%. Above 4 rows per expert the default's 16- and 24-row units
take the order decided on the device from the real unit count (kGrpAuto, rounds 42-44), so no extra round is possible
there; the 16-row rows below show the host's estimate that TRACE_EXT_KSLAB_GRP_AUTO16=0 keeps. --spill tabulates the
whole-job spill probabilities under skewed routing.

Keep the constants and formulas in step with the .cu file when either changes.
    python3 tools/emulate_grouped_plan.py [--trials 100] [--sms 132] [--spill]
"""
from __future__ import annotations

import argparse
import math
import random

SMEM_MAX = 227 * 1024  # kKsSmemMax
WARPS = 16  # kKsWarps
TILE_BYTES = 2304  # kKsTileBytes
ROW_BYTES = 512  # kKsRowBytes
ROW_PAD = 16  # kKsRowPad
MAX_EXPERTS = 1024  # kMaxExperts
PREF_BYTES = ((MAX_EXPERTS + 1) * 4 + WARPS * 4 + 15) // 16 * 16  # kKsGrpPrefBytes
RAMP_BYTES = 32768.0  # kRampBytes of the plan
RAMP_TILES = 100  # kGrpRampTiles


def max_l(mt8: int) -> int:  # kslab_grp_max_l: the rings reserve 4 slots at 8 rows, 3 at 16, 2 at 24 / 32 (round 37)
    ring = WARPS * {1: 4, 2: 3, 3: 2, 4: 2}[mt8] * TILE_BYTES
    return ((SMEM_MAX - ring - PREF_BYTES) // (8 * mt8) - ROW_PAD) // ROW_BYTES


def plan(n_blocks: int, kt: int, rows: int, sms: int, units_est: float) -> tuple[int, int, int]:
    """kslab_grouped_plan: (L, S, C) of the smallest estimated cost."""
    best, best_cost, u = (0, 0, 0), -1.0, max(1.0, units_est)
    for s in range(1, min(kt, 64) + 1):
        lsl = (kt + s - 1) // s
        if lsl > max_l(rows // 8) or (kt + lsl - 1) // lsl != s:
            continue
        for c in range(1, int(max(1.0, min(n_blocks, math.ceil(8.0 * sms / (u * s))))) + 1):
            jobs = math.ceil(u) * s * c
            bpc = (n_blocks + c - 1) // c
            job = bpc * lsl * TILE_BYTES + 0.5 * rows * lsl * ROW_BYTES + RAMP_BYTES
            job += bpc * (16.0 * rows * 4 + 1024) if s > 1 else 0.0
            cost = max(jobs * (job - RAMP_BYTES) / sms, math.ceil(jobs / sms) * job / 1.5)
            if best_cost < 0 or cost < best_cost:
                best, best_cost = (lsl, s, c), cost
    return best


def flat_pays(units: int, s: int, c: int, n_blocks: int, lsl: int, ctas: int) -> bool:  # grouped_flat_pays
    job_cost = (units * s * c + ctas - 1) // ctas * ((n_blocks + c - 1) // c * lsl + RAMP_TILES)
    rng = (units * s * n_blocks + ctas - 1) // ctas
    return rng * lsl + (1 + (rng + n_blocks - 1) // n_blocks) * RAMP_TILES < job_cost


def case(e: int, k: int, n: int, kdim: int, t: int, r: int, trials: int, sms: int, rng: random.Random) -> str:
    m = t * k
    nonempty = min(min(e, m), e * (1 - (1 - 1 / e) ** m))
    units_est = nonempty + max(0.0, m - nonempty * r) / r
    n_blocks, kt = n // 16, kdim // 256
    lsl, s, c = plan(n_blocks, kt, r, sms, units_est)
    flat = flat_pays(math.ceil(units_est), s, c, n_blocks, lsl, sms)
    ctas = max(1, min(sms, (min(e, m) + m // r + 1) * s * c))
    rounds = math.ceil(math.ceil(units_est) * s * c / ctas)
    units, extra = [], 0
    for _ in range(trials):
        counts = [0] * e
        for _ in range(t):
            for x in rng.sample(range(e), k):
                counts[x] += 1
        u = sum((x + r - 1) // r for x in counts)
        units.append(u)
        extra += math.ceil(u * s * c / ctas) > rounds
    p = "-" if flat else f"{extra / trials:.2f}"
    return (f"T={t:4d} rows/expert={math.ceil(m / e):2d} R={r:2d} units_est={units_est:6.1f} L={lsl:2d} S={s} C={c:2d} "
            f"{'flat' if flat else 'jobs'} rounds={rounds} real units {min(units)}..{max(units)} P(extra round)={p}")


def spill_table(trials: int, sms: int) -> None:
    """--spill: how often whole jobs of one unit per expert (S = C = 1) need a second round of CTAs, i.e. the real unit
    count sum(ceil(rows / R)) exceeds the CTAs, for Qwen3 (E = 128, top-8) at T = 144 .. 256 and R = 16 / 24 / 32, with
    router scores N(0, 1) plus skew * b_e (b_e ~ N(0, 1) per call: bench_gemm.routed_offsets). The eighth session's
    reason for deciding the order on the device above 8 rows per expert (notes/GPU_RESULTS.md, rounds 39-42)."""
    import numpy as np  # noqa: PLC0415

    g = np.random.default_rng(1)
    e, k = 128, 8
    for skew in (0.0, 0.25, 0.5, 1.0):
        for t in (144, 176, 192, 224, 256):
            spills = {16: 0, 24: 0, 32: 0}
            for _ in range(trials):
                sc = g.standard_normal((t, e)) + skew * g.standard_normal(e)
                cnt = np.bincount(np.argpartition(sc, -k, axis=1)[:, -k:].ravel(), minlength=e)
                for r in spills:
                    spills[r] += int((-(-cnt // r)).sum()) > sms
            print(f"skew={skew:4.2f} T={t:3d} rows/expert={-(-t * k // e):2d} P(second round) "
                  + " ".join(f"R={r}: {n / trials:.3f}" for r, n in spills.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--spill", action="store_true", help="whole-job spill probabilities under skewed routing")
    args = ap.parse_args()
    if args.spill:
        spill_table(args.trials, args.sms)
        return
    rng = random.Random(1)
    shapes = [("qwen3 gate_up", 128, 8, 1536, 2048), ("qwen3 down", 128, 8, 2048, 768),
              ("olmoe gate_up", 64, 8, 2048, 2048), ("olmoe down", 64, 8, 2048, 1024),
              ("dsv3 down", 256, 8, 7168, 2048), ("mixtral", 8, 2, 28672, 4096)]
    for name, e, k, n, kdim in shapes:
        print(name)
        for per_expert in (2, 3, 4, 5):
            t = max(1, e * per_expert // k)
            for r in (8, 16):
                print("  " + case(e, k, n, kdim, t, r, args.trials, args.sms, rng))


if __name__ == "__main__":
    main()
