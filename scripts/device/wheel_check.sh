#!/usr/bin/env bash
# On the H200: install the prebuilt wheel into a fresh virtual environment without the CuTe DSL, and run
# wheel_check.py there (chunk_kda fixed / packed / training, decode, Lightning against the reference; the first
# call in a fresh process). The machine has no package index: torch and triton come from the system, and
# apache-tvm-ffi and fla-core from the .device payload (its CuTe DSL is left out), all with --no-deps.
#
#   here:    SCOPE=smoke bash scripts/build_wheel.sh (CUDA=13 for the H200's torch), and ../shared/device/make-payload
#   device:  carry [".device/site-rest.tar.xz", "dist"]:  bash scripts/device/wheel_check.sh dist/cula-*.whl
#            (the payload's DSL libraries are not needed and would not fit beside the wheel in the 64 MiB upload)
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
WHEEL=${1:-$(ls -t dist/cula-*-py3-none-*.whl | head -1)}
ENV=/tmp/cula-wheel-env
DEPS=/tmp/cula-wheel-deps
rm -rf "$ENV" "$DEPS"
# the machine's python3 is itself a virtual environment (/opt/torch/.venv): a venv made from it sees the base
# interpreter's packages, not torch's, so torch's site-packages go in through a .pth file
TORCH_SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python3 -m venv "$ENV"
SITE=$("$ENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$TORCH_SITE" > "$SITE/device_torch.pth"
mkdir -p "$DEPS"
tar -xJf .device/site-rest.tar.xz -C "$DEPS" --wildcards './tvm_ffi' './apache_tvm_ffi-*' './fla' './fla_core-*'
cp -r "$DEPS"/* "$SITE"/
"$ENV/bin/python" -m pip install -q --no-index --no-deps "$WHEEL"
if "$ENV/bin/python" -c 'import cutlass' 2>/dev/null; then
  echo "@@FAIL the CuTe DSL is importable in the wheel's environment" && exit 1
fi
export PYTHONUNBUFFERED=1 FLA_FLASH_KDA=0 FLA_CULA=0 TRITON_CACHE_DIR=/tmp/cula-triton-cache
mkdir -p "$TRITON_CACHE_DIR" && tar xzf scripts/device/fla-autotune-h200.tgz -C "$TRITON_CACHE_DIR"
unset PYTHONPATH
ls -la "$WHEEL"
cd /tmp  # cula from the wheel, not from the checkout
"$ENV/bin/python" "$REPO/scripts/device/wheel_check.py"
