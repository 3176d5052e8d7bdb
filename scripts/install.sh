#!/usr/bin/env bash
# Create .venv and install cula with the CuTe DSL (the jit extra: compiles the kernels), test and benchmark extras.
# An already-installed torch (e.g. a CUDA build on a GPU machine) is reused through system site
# packages; without one, the CPU build torch==2.13.0 is installed when no NVIDIA driver is present.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] || python3 -m venv --system-site-packages .venv
PY=.venv/bin/python
$PY -m pip install -q --upgrade pip
if ! $PY -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PY -m pip install -q torch
  else
    $PY -m pip install -q "torch==2.13.0"
  fi
fi
$PY -m pip install -q -e ".[jit,test,bench]"
$PY -c "import torch, cutlass, fla, cula; print('installed: torch', torch.__version__, '| cutlass-dsl', cutlass.__version__, '| fla-core', fla.__version__, '| cula', cula.__version__)"
