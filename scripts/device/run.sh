#!/usr/bin/env bash
# Run a command on the GPU machine of the `device` tool with FLA's Triton autotune results restored.
#
#   device run, carry [".device"]:  bash scripts/device/run.sh python -m pytest -m gpu -q tests/test_gpu_api.py
#
# FLA 0.6.0 autotunes each Triton kernel once per shape key on a fresh machine (a KDA forward: ~90 s),
# which otherwise eats most of a session's GPU time. Triton caches the winning configs as small
# *.autotune.json files; fla-autotune-h200.tgz holds the ones measured on the H200 so far. After the
# command, the (possibly grown) set is written to $OUT/fla-autotune-h200.tgz: copy it back over this
# file to keep new shapes for the next session.
set -uo pipefail
cd "$(dirname "$0")/../.."
source .device/activate
export PYTHONUNBUFFERED=1 FLA_FLASH_KDA=0 FLA_CULA=0 TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/cula-triton-cache}"
mkdir -p "$TRITON_CACHE_DIR"
tar xzf scripts/device/fla-autotune-h200.tgz -C "$TRITON_CACHE_DIR"
"$@"
rc=$?
if [ -n "${OUT:-}" ]; then
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$OUT/fla-autotune-h200.tgz" -T -)
fi
exit $rc
