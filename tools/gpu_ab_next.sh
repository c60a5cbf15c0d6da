#!/usr/bin/env bash
# One H200 call that checks and times the three merged next/* changes against the defaults they keep selectable:
# build for 9.0a, the new correctness tests (stream-K, KV heads kernel, quantize variants), then the A/B benches.
# Every step has its own time limit so that a hang still returns the logs of the steps before it.
#   OUT=/some/dir tools/gpu_ab_next.sh
set -u
[ -f COMMIT ] && export TRACE_EXT_COMMIT=${TRACE_EXT_COMMIT:-$(cat COMMIT)}  # .snap has no .git: stamp the snapshot's commit
T=/tmp/trace_ext_out
mkdir -p "$OUT"
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, print the tail
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s"; tail -${TAILN:-6} "$OUT/$name.log"
}
make gpu-build > "$OUT/build.log" 2>&1 || { cp $T/build.log "$OUT/build_full.log"; grep -n -B3 -A12 "error" $T/build.log | grep -v "^.*pip-setuptools" | head -120; exit 1; }
echo "built in ${SECONDS}s"
P="python3 -m pytest -q -p no:cacheprovider -x --tb=short"
step t_sk 120 $P tests/gpu/test_gemm_gpu.py -k "stream_k or scheduler"
step t_quant_impl 90 $P tests/gpu/test_quant_impl_gpu.py
step t_kv_heads 150 env TRACE_EXT_KV_DECODE_IMPL=heads $P tests/gpu/test_kv_gpu.py tests/gpu/test_hf_kvcache_gpu.py
step t_kv 120 $P tests/gpu/test_kv_gpu.py
TAILN=30 step b_quant_impl 120 env BENCH_OUT="$OUT" PYTHONUNBUFFERED=1 python3 bench/bench_quant_impl.py
TAILN=12 step b_sched 100 env SCHED_PARTIAL_ONLY=1 BENCH_OUT="$OUT" PYTHONUNBUFFERED=1 python3 bench/bench_wgmma_sched.py
TAILN=40 step b_kv 150 env BENCH_OUT="$OUT" PYTHONUNBUFFERED=1 python3 bench/bench_kv.py
