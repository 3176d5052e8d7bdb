#!/usr/bin/env bash
# The GPU tests of everything written since the last GPU run, most important first, each step under its own
# time limit so a slow step cannot starve the rest. All steps can exceed one 10-minute device call when FLA and
# our kernels compile on first use; name steps to run a subset:
#   device run, carry [".device"], timeout 600:  bash scripts/device/run.sh bash scripts/device/validate.sh [STEP...]
# Steps: pending decode api intra long speed. Logs land in $OUT (one file per step); FLA's autotune results are restored
# and saved by run.sh.
set -u
cd "$(dirname "$0")/../.."
S=$(date +%s)
WANT=" ${*:-pending decode api intra long speed} "
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  [[ "$WANT" == *" $name "* ]] || return 0
  echo "== $name (limit ${limit}s) at +$(( $(date +%s) - S ))s"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "   rc=$?"; grep -E "passed|failed|error|FAIL|geomean" "$OUT/$name.log" | tail -4
}
# a test stuck on the GPU (a kernel waiting forever) dumps its stack and ends its step after 150 s instead of
# using up the step's whole limit
P="python -m pytest -m gpu -q -rfE --tb=short -p no:warnings -o faulthandler_timeout=150 -o faulthandler_exit_on_timeout=true"
# the GPU checks of the switches written CPU-only and still off (scripts/device/README.md "Next GPU session")
step pending 300 $P tests/ops/test_kda_decode_kernel.py tests/test_chunk_plans.py \
  -k "single_token_occupancy or segmented or varlen_plan"
step decode 150 $P tests/test_decode_plans.py tests/test_lightning_decode_api.py tests/ops/test_kda_decode_kernel.py \
  tests/ops/test_lightning_decode_kernel.py -k "not speed_report"
step api 400 $P tests/test_gpu_api.py tests/test_chunk_plans.py tests/test_fla_backward.py
step intra 400 $P tests/ops/test_kda_intra_kernel.py
step long 100 $P tests/test_gpu_long.py
step speed 180 $P -s tests/ops/test_lightning_decode_kernel.py tests/ops/test_kda_decode_kernel.py -k speed_report
echo "== done at +$(( $(date +%s) - S ))s"
