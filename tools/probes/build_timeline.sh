#!/usr/bin/env bash
# Build tools/probes/timeline.cu into a shared library for tools/probes/timeline.py (sm_90a; torch's headers, since the
# kernel headers include ATen through host_checks.h; the library itself links no torch symbol).
#   tools/probes/build_timeline.sh [OUT.so]      PYTHON=... picks the interpreter whose torch gives the include paths
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-/tmp/timeline.so}
py=${PYTHON:-python3}
inc=$($py -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I' + p for p in include_paths('cuda')))" 2>/dev/null)
# shellcheck disable=SC2086
nvcc -O3 -std=c++20 -arch=sm_90a -shared -Xcompiler -fPIC --expt-relaxed-constexpr -ftz=false -prec-div=true \
  -prec-sqrt=true -D_GLIBCXX_USE_CXX11_ABI=1 -I"$root/csrc/include" $inc "$root/tools/probes/timeline.cu" -o "$out"
echo "built $out"
