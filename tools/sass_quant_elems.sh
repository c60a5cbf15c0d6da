#!/usr/bin/env bash
# Static SASS instructions per element of the NVFP4 quantize element loops, by rounding mode and implementation
# (tools/sass_quant_elems.cu), for sm_90a, with the instruction mix. No GPU needed (~1 min to compile).
#   tools/sass_quant_elems.sh            CUOBJDUMP=/path/to/cuobjdump to override
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
obj=${OUT_OBJ:-/tmp/sass_quant_elems.o}
OUT_OBJ=$obj TRACE_EXT_CUDA_ARCHS=9.0a "$root/tools/nvcc_check.sh" tools/sass_quant_elems.cu >/dev/null
cuobjdump=${CUOBJDUMP:-$(command -v cuobjdump || echo /work/tools_bin/cuobjdump)}
"$cuobjdump" -sass "$obj" | python3 -c '
import collections, re, subprocess, sys
funcs, cur = {}, None
for line in sys.stdin:
    m = re.match(r"\s+Function : (\S+)", line)
    if m:
        cur = m.group(1)
        funcs[cur] = collections.Counter()
        continue
    m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
    if m and cur and m.group(1) not in ("NOP",):
        funcs[cur][m.group(1)] += 1
def demangle(k):
    return subprocess.run(["c++filt", k], capture_output=True, text=True).stdout.strip()
names = {k: demangle(k) for k in funcs if "probe" in k}
base = next(sum(funcs[k].values()) for k, d in names.items() if "probe_baseline" in d)
label = {"0": "rtn", "1": "sr", "2": "guided compact", "3": "guided full"}
impl = {"0": "scaled (rtn-fminf)", "1": "bits", "2": "default (rtn saturated after packing)",
        "7": "lean (sr_elems_lean_x2m14)"}
print(f"baseline (loads + stores): {base} instructions")
print("mode             impl     total  per elem  top opcodes (whole probe)")
for k, d in sorted(names.items(), key=lambda kv: kv[1]):
    m = re.search(r"probe_elems<(\d), (\d)>", d)
    if not m:
        continue
    mode, im = label[m.group(1)], impl[m.group(2)]
    c = funcs[k]
    n = sum(c.values())
    top = " ".join(f"{op}:{cnt}" for op, cnt in c.most_common(9))
    print(f"{mode:16} {im:7} {n:6d} {(n - base) / 16:9.2f}  {top}")
'
