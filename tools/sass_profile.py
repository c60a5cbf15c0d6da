#!/usr/bin/env python3
"""Summarize an Nsight Compute source page (`make gpu-sass` -> sass_<group>.csv[.gz]): per kernel, the dynamic
instruction mix (warp instructions executed, by opcode) and the hottest SASS lines by stall samples.

  tools/sass_profile.py sass_quant.csv.gz [--kernel SUBSTR] [--per N] [--top K] [--all]
--per N: also print thread instructions per unit, with N units (e.g. elements) of work per launch.
"""
import argparse
import collections
import csv
import gzip
import io
import re


def kernels(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        text = f.read()
    blocks = re.split(r'^"Kernel Name",', text, flags=re.M)[1:]
    for b in blocks:
        name, _, rest = b.partition("\n")
        rows = list(csv.DictReader(io.StringIO(rest)))
        yield name.strip().strip(",").strip('"'), rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--kernel", default="")
    ap.add_argument("--per", type=float, default=0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--all", action="store_true", help="every launch, not only the first of each kernel")
    a = ap.parse_args()
    seen = set()
    for name, rows in kernels(a.csv):
        if a.kernel not in name or (name in seen and not a.all):
            continue
        seen.add(name)
        ops = collections.Counter()
        total = 0
        samples = 0
        for r in rows:
            n = int(r.get("Instructions Executed") or 0)
            op = r["Source"].split()
            op = [t for t in op if not t.startswith("@")]
            opc = op[0].split(".")[0] if op else "?"
            ops[opc] += n
            total += n
            samples += int(r.get("Warp Stall Sampling (All Samples)") or 0)
        print(f"== {name}\n   warp instructions executed: {total:,}" +
              (f"   thread instr per unit: {32 * total / a.per:.2f}" if a.per else ""))
        mix = ", ".join(f"{k} {v / total:.1%}" for k, v in ops.most_common(18))
        print(f"   mix: {mix}")
        if a.per:
            print("   per unit: " + ", ".join(f"{k} {32 * v / a.per:.2f}" for k, v in ops.most_common(18)))
        hot = sorted(rows, key=lambda r: -int(r.get("Warp Stall Sampling (All Samples)") or 0))[: a.top]
        print(f"   hottest lines (of {samples} stall samples):")
        for r in hot:
            print(f"     {r['Address'][-5:]} {int(r.get('Warp Stall Sampling (All Samples)') or 0):6d} "
                  f"x{int(r.get('Instructions Executed') or 0):>10,}  {r['Source'].strip()[:90]}")


if __name__ == "__main__":
    main()
