#!/usr/bin/env bash
# Every GPU test of tests/ (`pytest -m gpu`), file by file in steps, each step under its own time limit so a slow
# step cannot starve the rest. Every test file belongs to exactly one step: `rest` takes each tests/**/test_*.py
# that no other step names, so a new test file is never left out (a file without GPU tests costs its import).
# The steps' limits are sized for the groups in CALLS, each of which fits one 10-minute device call (limits
# summing to <= 590 s); the typical times on a warm machine are in brackets:
#   device run, carry [".device"], timeout 600:  bash scripts/device/run.sh bash scripts/device/validate.sh STEP...
#     api reference                     [~5.5 + ~0.5 min]
#     intra decode lightning            [~3.5 + ~2.5 + ~0.5 min]
#     states long                       [~1.5 (before the recompute's states kernel's tests) + ~1 min]
#     backward                          [~6.5 min: the stage kernels, a step per stage flag, steps vs float64]
#     split                             [> 5.5 min on an H100: 40 of its tests in 315 s alone]
#     gdn                               [not yet timed alone]
#     bench fla                         [~1 + ~1 min]
#     rest                              [> 4.5 min: 78 of its tests in 280 s beside two other steps]
#     matrix                            [> 3 min: 7 of its 16 tests in 180 s beside two other steps]
# No STEP: all of them in that order (nine calls' worth). `--list`: each step's limit and files and the calls,
# nothing run (tests/test_validate_script.py checks them on the CPU).
# `-j N` (first argument): N steps at once, longest limit first, each with its share of the CPU's threads (the
# tests are small on the GPU; a step's time is mostly the DSL compiling its variants, one core each), so that
# two calls run them all: `validate.sh -j 8 api long intra states backward decode lightning reference bench fla`,
# then `validate.sh -j 4 split gdn matrix rest`, each with DEADLINE=570 (seconds from the start: no step runs past
# it; a step cut short says TIMED OUT and lists the failures its tests logged before the cut). The summary follows the steps' order whatever order they ended in. FLA's
# autotuning under -j works on a private copy of Triton's cache (its winners are not saved).
# Logs land in $OUT (one file per step); FLA's autotune results are restored and saved by run.sh.
set -u
cd "$(dirname "$0")/../.."
S=$(date +%s)

STEPS=(api long intra states backward decode lightning reference split gdn bench fla matrix rest)
CALLS=("api reference" "intra decode lightning" "states long" "backward" "split" "gdn" "bench fla" "rest" "matrix")
declare -A LIMIT FILES
LIMIT[api]=400;       FILES[api]="tests/test_gpu_api.py tests/test_chunk_plans.py"
LIMIT[long]=100;      FILES[long]="tests/test_gpu_long.py"
LIMIT[intra]=320;     FILES[intra]="tests/ops/test_kda_intra_kernel.py"
LIMIT[states]=300;    FILES[states]="tests/ops/test_kda_delta_h_kernel.py tests/ops/test_kda_delta_h_states_kernel.py"
# the backward stages on cula's kernels (5, 6, 7) against FLA's and float64, and a training step with each
LIMIT[backward]=540;  FILES[backward]="tests/ops/test_kda_bwd_dhu_kernel.py tests/ops/test_kda_bwd_wy_dqkg_kernel.py
                                       tests/ops/test_kda_bwd_intra_kernel.py tests/test_fla_backward.py"
LIMIT[decode]=170;    FILES[decode]="tests/test_decode_plans.py tests/test_lightning_decode_api.py tests/test_gdn_decode.py
                                     tests/ops/test_kda_decode_kernel.py tests/ops/test_lightning_decode_kernel.py"
LIMIT[lightning]=90;  FILES[lightning]="tests/ops/test_lightning_kernel.py"
LIMIT[reference]=90;  FILES[reference]="tests/test_reference.py"
# the time-parallel paths and Gated DeltaNet on the KDA kernels (float64 references of long sequences on the host)
LIMIT[split]=580;     FILES[split]="tests/ops/test_kda_segment_summary_kernel.py tests/ops/test_kda_segment_chain_kernel.py
                                    tests/test_kda_time_parallel.py tests/test_lightning_time_parallel.py"
LIMIT[gdn]=580;       FILES[gdn]="tests/test_gdn_on_kda.py"
LIMIT[bench]=300;     FILES[bench]="tests/test_bench_scripts.py tests/test_bench_common.py"
# FLA's own training backwards with cula's gated chunk_bwd_dqkwg (FLA autotunes its Triton stages on first calls)
LIMIT[fla]=280;       FILES[fla]="tests/test_common_chunk_o.py"
# cula's training step on the inputs FLA's own KDA tests draw (positive keys), against FLA and float64
LIMIT[matrix]=580;    FILES[matrix]="tests/test_fla_matrix.py"
LIMIT[rest]=580
named=" $(echo ${FILES[*]}) "
FILES[rest]=$(find tests -name 'test_*.py' | sort | while read -r f; do [[ "$named" == *" $f "* ]] || echo "$f"; done)

JOBS=1
if [[ "${1:-}" == "-j" ]]; then
  JOBS=${2:?-j needs a number}; shift 2
  [[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || { echo "-j needs a positive number, got $JOBS" >&2; exit 2; }
fi
if [[ "${1:-}" == "--list" ]]; then
  for name in "${STEPS[@]}"; do echo "step $name ${LIMIT[$name]}" $(echo ${FILES[$name]}); done
  for call in "${CALLS[@]}"; do echo "call $call"; done
  exit 0
fi
for name in "$@"; do
  [[ -n "${LIMIT[$name]:-}" ]] || { echo "unknown step $name (steps: ${STEPS[*]})" >&2; exit 2; }
done
WANT=" ${*:-${STEPS[*]}} "
OUT=${OUT:-/tmp/cula-validate}
mkdir -p "$OUT"

# a test stuck on the GPU (a kernel waiting forever) dumps its stack and ends its step after STUCK seconds instead
# of using up the step's whole limit; a benchmark's quick suite in one test compiles and measures for longer
declare -A STUCK=([bench]=280)
P=${VALIDATE_PYTEST:-"python -m pytest -m gpu -q -rfEs --tb=short -p no:warnings -o faulthandler_exit_on_timeout=true"}
DEADLINE=${DEADLINE:-0}

run_step() {  # name: the step's tests into $OUT/name.log, pytest's exit status into $OUT/name.rc
  local name=$1 limit=${LIMIT[$1]}
  if (( DEADLINE > 0 )); then
    local left=$(( DEADLINE - ($(date +%s) - S) - 5 ))
    (( left < limit )) && limit=$left
    (( limit < 1 )) && { echo 124 > "$OUT/$name.rc"; echo "not started: DEADLINE reached" > "$OUT/$name.log"; return; }
  fi
  rm -f "$OUT/$name.failures"
  CULA_FAILURE_LOG="$OUT/$name.failures" timeout "$limit" $P -o faulthandler_timeout="${STUCK[$name]:-150}" ${FILES[$name]} > "$OUT/$name.log" 2>&1
  echo $? > "$OUT/$name.rc"
}

report_step() {  # failures and skips (a skip on the H200 means a test did not run), then pytest's summary line
  local name=$1 rc
  rc=$(cat "$OUT/$name.rc" 2>/dev/null || echo "?")
  case $rc in
    0) ;;
    5) echo "   no GPU tests in these files" ;;
    124) echo "   TIMED OUT (limit ${LIMIT[$name]}s or DEADLINE)" ;;
  esac
  echo "   rc=$rc"; grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/$name.log" | head -20; tail -1 "$OUT/$name.log"
  # a step cut short prints no summary: the failures its tests logged as they happened (tests/conftest.py)
  [[ "$rc" == 124 && -s "$OUT/$name.failures" ]] && grep -E "^== " "$OUT/$name.failures" | head -20
}

ORDER=()
for name in "${STEPS[@]}"; do
  [[ "$WANT" == *" $name "* ]] || continue
  # no files would make pytest collect all of tests/
  [[ -n "$(echo ${FILES[$name]})" ]] || { echo "== $name: no files"; continue; }
  ORDER+=("$name")
done
if (( JOBS == 1 )); then
  for name in "${ORDER[@]}"; do
    echo "== $name (limit ${LIMIT[$name]}s) at +$(( $(date +%s) - S ))s:" $(echo ${FILES[$name]})
    run_step "$name"
    report_step "$name"
  done
else
  export OMP_NUM_THREADS=$(( $(nproc) / JOBS > 0 ? $(nproc) / JOBS : 1 ))
  # FLA autotunes what it has not met on a GPU the other steps share: winners picked under that contention must not
  # reach run.sh's saved set (the benchmarks' FLA baseline), so the steps work on a private copy of Triton's cache
  if [[ -n "${TRITON_CACHE_DIR:-}" ]]; then
    private=$(mktemp -d)
    cp -r "$TRITON_CACHE_DIR/." "$private/" 2>/dev/null
    export TRITON_CACHE_DIR=$private
  fi
  running=0
  for name in $(for n in "${ORDER[@]}"; do echo "${LIMIT[$n]} $n"; done | sort -rn | cut -d' ' -f2); do
    if (( running >= JOBS )); then wait -n; running=$(( running - 1 )); fi
    echo "== $name started at +$(( $(date +%s) - S ))s (limit ${LIMIT[$name]}s)"
    run_step "$name" &
    running=$(( running + 1 ))
  done
  wait
  for name in "${ORDER[@]}"; do
    echo "== $name:" $(echo ${FILES[$name]})
    report_step "$name"
  done
fi
echo "== done at +$(( $(date +%s) - S ))s"
