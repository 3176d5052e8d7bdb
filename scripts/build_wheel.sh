#!/usr/bin/env bash
# Build cula's prebuilt wheel on a CPU-only machine: every kernel variant of the scope compiled for sm_90a
# (scripts/build_wheel.py), linked into shared objects with a manifest, packed as cula/_prebuilt into a
# manylinux x86_64 wheel in dist/, then checked: the manifest must cover the scope's variant list.
#
#   bash scripts/build_wheel.sh                 # SCOPE=wheel: the variants models use (see cula/variants.py)
#   SCOPE=smoke bash scripts/build_wheel.sh     # two variants a kernel family (CI)
#   CUDA=13 bash scripts/build_wheel.sh         # for CUDA 13: installs the DSL's cu13 runtime into the venv first
#                                               # (a GPU-less DSL compiles against its newest CUDA flavour)
# PYTHON (default .venv/bin/python, after scripts/install.sh) needs torch and nvidia-cutlass-dsl; JOBS compile
# processes (default: all cores). An interrupted build resumes: finished variants stay in build/prebuilt-$SCOPE.
set -euo pipefail
cd "$(dirname "$0")/.."
SCOPE=${SCOPE:-wheel}
PY=${PYTHON:-.venv/bin/python}
JOBS=${JOBS:-$(nproc)}
OUT=${OUT:-build/prebuilt-$SCOPE}
if [ -n "${CUDA:-}" ]; then
  $PY -m pip install -q "nvidia-cutlass-dsl-libs-cu${CUDA}==$($PY -c 'import importlib.metadata as m; print(m.version("nvidia-cutlass-dsl"))')"
fi
# the wheel's platform tag is set through setuptools' own bdist_wheel (setuptools >= 70.1)
$PY -c 'import setuptools.command.bdist_wheel' 2>/dev/null || $PY -m pip install -q "setuptools>=70.1"
start=$(date +%s)
CUTE_DSL_ARCH=sm_90a $PY scripts/build_wheel.py compile --scope "$SCOPE" --out "$OUT" --jobs "$JOBS"
rm -rf build/lib build/lib.*  # no stale package data from another scope's build
CULA_WHEEL_KERNELS=$SCOPE CULA_WHEEL_PREBUILT_DIR=$OUT $PY -m pip wheel -q --no-deps --no-build-isolation -w dist .
WHEEL=$(ls -t dist/cula-*-py3-none-*.whl | head -1)
$PY scripts/build_wheel.py check "$WHEEL" --scope "$SCOPE"
echo "$WHEEL: $(du -h "$WHEEL" | cut -f1), built in $(( $(date +%s) - start )) s"
