#!/usr/bin/env bash
# Builds .fla-layers/: FLA's KimiDeltaAttention layer (fla/layers/kda.py and utils.py from the
# flash-linear-attention 0.6.0 wheel, unchanged) for tests/test_fla_dispatch.py's GPU test, which the GPU
# machine (fla-core only, no transformers, no package index) cannot install. fla/layers/__init__.py is an
# empty one of ours: FLA's imports every layer, some of which need transformers. A few tens of KB, beside
# .device's ~62 MiB of the 64 MiB upload:
#
#   bash scripts/device/fla_layers.sh
#   device run, carry [".device", ".fla-layers"]:
#     PYTHONPATH=$PWD/.fla-layers bash scripts/device/run.sh python -m pytest -m gpu -q tests/test_fla_dispatch.py
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
$PY -m pip download -q --no-deps flash-linear-attention==0.6.0 -d "$tmp"
$PY -m zipfile -e "$tmp"/flash_linear_attention-0.6.0-py3-none-any.whl "$tmp/whl"
rm -rf .fla-layers && mkdir -p .fla-layers/fla/layers
cp "$tmp"/whl/fla/layers/kda.py "$tmp"/whl/fla/layers/utils.py .fla-layers/fla/layers/
echo '"""fla.layers with only the KDA layer (scripts/device/fla_layers.sh)."""' > .fla-layers/fla/layers/__init__.py
grep -qx '/.fla-layers/' .git/info/exclude 2>/dev/null || echo '/.fla-layers/' >> .git/info/exclude
du -sh .fla-layers
