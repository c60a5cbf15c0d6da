#!/usr/bin/env bash
# Compile one CUDA source of csrc/ to an object, for the archs in TRACE_EXT_CUDA_ARCHS (default 9.0a;10.0a),
# with the same include paths and flags as setup.py. No GPU needed; catches most errors in seconds.
#   tools/nvcc_check.sh csrc/quant_nvfp4.cu [extra nvcc flags, e.g. -Xptxas -v]
set -euo pipefail
src=$1; shift || true
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
read -r tinc tinc2 pyinc cutlass < <($py - <<'PY'
import sysconfig, torch, os, importlib.util
from torch.utils.cpp_extension import include_paths
inc = include_paths("cuda")
cut = os.path.join(list(importlib.util.find_spec("cutlass_library").submodule_search_locations)[0], "source")
print(inc[0], inc[1], sysconfig.get_paths()["include"], cut)
PY
)
archs=${TRACE_EXT_CUDA_ARCHS:-9.0a;10.0a}
gen=()
IFS=';' read -ra list <<< "$archs"
for a in "${list[@]}"; do n=${a/./}; gen+=("-gencode=arch=compute_$n,code=sm_$n"); done
out=${OUT_OBJ:-/tmp/$(basename "$src").o}
nvcc -c "$root/$src" -o "$out" -I"$root/csrc/include" -I"$tinc" -I"$tinc2" -I"$pyinc" -I"$cutlass/include" \
  -I"$cutlass/tools/util/include" -O3 -DNDEBUG -std=c++20 --expt-relaxed-constexpr --expt-extended-lambda \
  -ftz=false -prec-div=true -prec-sqrt=true -D_GLIBCXX_USE_CXX11_ABI=1 -DTORCH_EXTENSION_NAME=_C \
  -DTRACE_EXT_ARCHS=sm_90a/sm_100a -Xcompiler -fPIC "${gen[@]}" "$@"
echo "ok: $src -> $out"
