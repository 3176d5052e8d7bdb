#!/usr/bin/env bash
# One device call (about 9 minutes) running every benchmark with a time budget each; every script
# writes what it has when its budget ends (or on SIGTERM). Results: $OUT/results.tgz (unpack over
# benchmarks/results/ and commit).   device run, carry [".device"]:  bash scripts/device/bench.sh
set -u
cd "$(dirname "$0")/../.."
S=$(date +%s)
run() {  # run NAME SECONDS ARGS...
  local name=$1 limit=$2; shift 2
  echo "== $name at +$(( $(date +%s) - S ))s"
  timeout "$limit" python "benchmarks/$name.py" --out "$OUT/results" "$@" > "$OUT/$name.log" 2>&1
  echo "   rc=$?"; grep -E "geomean|partial|interrupted|FAIL" "$OUT/$name.log" | tail -3
  tar czf "$OUT/results.tgz" -C "$OUT/results" .
}
run bench_kda_prefill 250 --iters 30 --warmup 5 --max-seconds 210
run bench_lightning_prefill 110 --max-seconds 90
run bench_kda_decode 60 --max-seconds 45
run bench_lightning_decode 60 --max-seconds 45
echo "== done at +$(( $(date +%s) - S ))s"
