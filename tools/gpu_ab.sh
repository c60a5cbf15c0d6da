#!/usr/bin/env bash
# One H200 call for an A/B round: build for 9.0a, then every step of a steps file, each with its own time limit so
# that a hang still returns the logs of the steps before it. Logs land in $OUT/<name>.log, bench tables in $OUT.
#   OUT=/some/dir tools/gpu_ab.sh tools/ab/<round>.steps
# A steps file has one step per line: NAME SECONDS TAIL_LINES COMMAND... ('#' lines are comments); commands run in
# the repo root with BENCH_OUT=$OUT and PYTHONUNBUFFERED=1 exported. After every step $OUT/ab.tgz holds all logs and
# tables so far.
set -u
steps=$1
[ -f COMMIT ] && export TRACE_EXT_COMMIT=${TRACE_EXT_COMMIT:-$(cat COMMIT)}  # a git-archive snapshot has no .git
T=/tmp/trace_ext_out
mkdir -p "$OUT"
export BENCH_OUT="$OUT" PYTHONUNBUFFERED=1
make gpu-build > "$OUT/build.log" 2>&1 || {
  cp $T/build.log "$OUT/build_full.log"; grep -n -B3 -A12 "error" $T/build.log | head -120; exit 1; }
echo "built in ${SECONDS}s"
while read -r name secs tailn cmd; do
  case "$name" in ''|'#'*) continue ;; esac
  t0=$SECONDS
  timeout "$secs" bash -c "$cmd" > "$OUT/$name.log" 2>&1; rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s"; tail -"$tailn" "$OUT/$name.log"
  # everything so far in one archive (only a few files of $OUT come back one by one; a call cut short keeps this)
  tar czf "$T/ab.tgz" -C "$OUT" --exclude=ab.tgz . && cp "$T/ab.tgz" "$OUT/ab.tgz"
done < "$steps"
