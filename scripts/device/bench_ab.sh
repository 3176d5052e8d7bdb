#!/usr/bin/env bash
# The benchmarks at an earlier revision and at the working tree, back to back on one card: is a change within noise
# of before? Here, once:   bash scripts/device/bench_ab.sh --pack REV   (REV's cula/ and benchmarks/, ~0.1 MiB
# packed into .device/before.tar.xz, so that it travels with the payload). Then
#   device run, carry [".device"]:  bash scripts/device/run.sh bash scripts/device/bench_ab.sh [NAME:SECONDS[:ARGS]]...
# Each NAME (bench_NAME.py) runs with its own limit per side, REV's side first (ORDER=after-first: the working
# tree's first; run both orders to tell drift from change). No NAME: the four of bench.sh with half its budgets (one
# call). $OUT/ab.tgz holds both sides' results and logs, $OUT/compare.md the tables of benchmarks/compare.py (FLA's
# column is the control: same code on both sides).
set -u
cd "$(dirname "$0")/../.."
if [ "${1:-}" = "--pack" ]; then
  set -euo pipefail
  rev=$(git rev-parse --verify "${2:?--pack needs a revision}^{commit}")
  rm -rf /tmp/cula-before && mkdir -p /tmp/cula-before/before .device
  git archive "$rev" cula benchmarks | tar x -C /tmp/cula-before/before
  rm -rf /tmp/cula-before/before/benchmarks/results
  echo "$rev" > /tmp/cula-before/before/REVISION
  tar cJf .device/before.tar.xz.new -C /tmp/cula-before before
  mv .device/before.tar.xz.new .device/before.tar.xz && du -b .device/before.tar.xz
  exit
fi
[ -f .device/before.tar.xz ] || { echo "no .device/before.tar.xz: run bash scripts/device/bench_ab.sh --pack REV here" >&2; exit 2; }
OUT=${OUT:-/tmp/cula-bench-ab}
S=$(date +%s)
rm -rf /tmp/cula-before && mkdir -p /tmp/cula-before && tar xJf .device/before.tar.xz -C /tmp/cula-before
echo "before: $(cat /tmp/cula-before/before/REVISION)"
[ $# -gt 0 ] || set -- "kda_prefill:125:--iters 30 --warmup 5 --max-seconds 100" "lightning_prefill:55:--max-seconds 45" \
  "kda_decode:30:--max-seconds 22" "lightning_decode:30:--max-seconds 22"
sides="before after"
[ "${ORDER:-}" = "after-first" ] && sides="after before"
rm -rf "$OUT/before" "$OUT/after" "$OUT/logs"  # (a local rerun must not compare an earlier run's results)
mkdir -p "$OUT/before" "$OUT/after" "$OUT/logs"
i=0
for spec in "$@"; do
  IFS=: read -r name secs args <<< "$spec"
  i=$((i + 1))  # (a NAME may come twice, e.g. eager and --cuda-graph: a log each)
  for side in $sides; do
    dir=$PWD
    [ "$side" = before ] && dir=/tmp/cula-before/before
    echo "== $side $name at +$(( $(date +%s) - S ))s"
    # shellcheck disable=SC2086  # ARGS is a list of options
    (cd "$dir" && PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" timeout "$secs" python "benchmarks/bench_$name.py" \
      --out "$OUT/$side" $args > "$OUT/logs/${side}_${i}_$name.log" 2>&1)
    echo "   rc=$?"; grep -E "geomean|partial|interrupted|FAIL" "$OUT/logs/${side}_${i}_$name.log" | tail -3
  done
done
# each side's results sit in one folder named after the GPU; a side that wrote none leaves nothing to compare
sides_ok=1
for side in before after; do
  n=$(find "$OUT/$side" -mindepth 1 -maxdepth 1 -type d | wc -l)
  [ "$n" -eq 1 ] || { echo "$side: $n results folders (want 1): see $OUT/logs" >&2; sides_ok=0; }
done
[ "$sides_ok" -eq 1 ] && python benchmarks/compare.py "$OUT"/before/* "$OUT"/after/* --out "$OUT/compare.md" \
  | grep -E "^###|geomean|missing"
tar czf "$OUT/ab.tgz" -C "$OUT" before after logs && rm -rf "$OUT/before" "$OUT/after" "$OUT/logs"
echo "== done at +$(( $(date +%s) - S ))s"
