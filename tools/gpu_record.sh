#!/usr/bin/env bash
# The run of record on the H200 (device tool), in one call: build for 9.0a, every GPU test file, and when a test file
# fails, the same file again with the previous kernel selected by its environment switch (the benchmarks then run
# with whatever passed, and the switches used are printed and saved), then the three benchmarks. Everything lands in
# $OUT/results.tgz (tests.log, bench.log, *_h200.{md,json}, switches.txt).
#   OUT=/some/dir tools/gpu_record.sh
set -u
T=/tmp/trace_ext_out
make gpu-build > /dev/null 2>&1 || { tail -40 $T/build.log; exit 1; }
make gpu-test 2>&1 | grep -E "^===|passed|failed|error" | grep -v "^$"
retry() {  # retry FILE VAR=VALUE: rerun one test file with a fallback switch; keep the switch when it passes
  local file=$1 kv=$2
  if awk -v f="=== $file" '$0==f{on=1;next} /^===/{on=0} on' $T/tests.log | grep -qE "[0-9]+ (failed|errors?)"; then
    echo "=== $file failed: retry with $kv"
    if env "$kv" python3 -m pytest "$file" -q -p no:cacheprovider 2>&1 | tee -a $T/tests_retry.log | tail -1 | grep -q " passed"; then
      export "$kv"; echo "$kv" >> $T/switches.txt; echo "    passes with $kv"
    fi
  fi
}
retry tests/gpu/test_gemm_gpu.py TRACE_EXT_DECODE_IMPL=auto
retry tests/gpu/test_kv_gpu.py TRACE_EXT_KV_DECODE_COMBINE=kernel
retry tests/gpu/test_quant_gpu.py TRACE_EXT_QUANT_IMPL=guided-lean
touch $T/switches.txt; echo "switches: $(cat $T/switches.txt | tr '\n' ' ')"
make gpu-bench 2>&1 | grep -E "copy bandwidth|MISS|PASS|rows meet"
mkdir -p "$OUT" && tar czf "$OUT/results.tgz" -C $T .
