#!/usr/bin/env python3
"""Check that every kernel of a base object has the same SASS in a new object (an opt-in variant must leave the
default's kernels alone): cuobjdump -sass both, split at "Function :", compare per kernel.

  tools/sass_same.py BASE.o NEW.o [--arch sm_90a] [--cuobjdump PATH] [--show N]

Names: the anonymous-namespace tag (_GLOBAL__N__<hash>_<n>_<file>_<hash>_<n>, which changes with the source text)
is replaced by a constant. Bodies are compared twice: exactly (instruction text and encodings, addresses included)
and normalized (address comments, encodings and hex operands of branches / calls dropped), so a kernel that only
moved reports "same after normalizing". Exit status 0 when every base kernel is present and identical (exactly or
after normalizing), 1 otherwise; kernels only in NEW are listed (the variant's own).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys

ANON = re.compile(r"\d*_GLOBAL__N__[0-9a-f]+_\d+_\w+?_[0-9a-f]+_\d+")
ADDR = re.compile(r"/\*[0-9a-f]{4,}\*/")
ENC = re.compile(r"/\* 0x[0-9a-f]+ \*/")
BRANCH = re.compile(r"\b(BRA|BRX|CALL\.\w+(?:\.\w+)*|JMP|BSSY|SSY|PBK|BREAK|WARPSYNC)\b(.*?)0x[0-9a-f]+")


def functions(obj: str, arch: str | None, tool: str) -> dict[str, str]:
    cmd = [tool, "-sass"] + (["-arch", arch] if arch else []) + [obj]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    out: dict[str, str] = {}
    for part in re.split(r"\n\s*Function : ", text)[1:]:
        name, _, body = part.partition("\n")
        # the next arch's header (cuobjdump prints one block per cubin) is not part of the body
        body = body.split("\n\t.section")[0].split("\nFatbin ")[0]
        name = ANON.sub("ANON", name.strip())
        out[name] = "\n".join(l.rstrip() for l in body.splitlines() if l.strip())
    return out


def normalized(body: str) -> str:
    lines = []
    for l in body.splitlines():
        l = ENC.sub("", ADDR.sub("", l)).strip()
        if not l or l.startswith("/*"):
            continue
        lines.append(BRANCH.sub(lambda m: m.group(1) + m.group(2) + "TARGET", l))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--arch", default=None)
    ap.add_argument("--cuobjdump", default="cuobjdump")
    ap.add_argument("--show", type=int, default=10, help="list at most this many kernels per class")
    a = ap.parse_args()
    base = functions(a.base, a.arch, a.cuobjdump)
    new = functions(a.new, a.arch, a.cuobjdump)
    exact, moved, differ, missing = [], [], [], []
    for name, body in base.items():
        if name not in new:
            missing.append(name)
        elif new[name] == body:
            exact.append(name)
        elif normalized(new[name]) == normalized(body):
            moved.append(name)
        else:
            differ.append(name)
    only_new = [n for n in new if n not in base]
    print(f"base kernels: {len(base)}, new kernels: {len(new)}")
    print(f"identical: {len(exact)}, same after normalizing: {len(moved)}, different: {len(differ)}, "
          f"missing in new: {len(missing)}, only in new: {len(only_new)}")
    for title, names in (("different", differ), ("missing", missing), ("same after normalizing", moved),
                         ("only in new", only_new)):
        for n in names[: a.show]:
            print(f"  {title}: {n}")
        if len(names) > a.show:
            print(f"  {title}: ... {len(names) - a.show} more")
    return 0 if not differ and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
