#!/usr/bin/env bash
# Build and run every probe of tools/probes on the GPU, one markdown record each under $OUT (probe_<name>_h200.md).
#   OUT=/some/dir TRACE_EXT_COMMIT=$(git rev-parse --short HEAD) [PROBES="rcp_sequence ..."] tools/probes/run_all.sh
set -eu
here=$(cd "$(dirname "$0")" && pwd)
[ -f "$here/../../COMMIT" ] && export TRACE_EXT_COMMIT=${TRACE_EXT_COMMIT:-$(cat "$here/../../COMMIT")}
mkdir -p "$OUT"
for p in ${PROBES:-dram_streams stream_rw stream_rw_staged rcp_sequence l2_prefetch}; do
  nvcc -O3 -std=c++17 -arch=sm_90a "$here/$p.cu" -o "/tmp/$p"
  (cd /tmp && "./$p") | tee "$OUT/probe_${p}_h200.md"
done
