#!/usr/bin/env bash
# Moves what no device call reads out of the checkout, so that the tree and .device/ fit the device's 64 MiB
# upload together, and back again:
#
#   bash scripts/device/hold_tree.sh hold      # before the device calls: prints the room left in the upload
#   bash scripts/device/hold_tree.sh restore   # after them (before any commit: the held files read as deleted)
#
# Held: docs/, benchmarks/results/ (write new results under $OUT and unpack them after restoring), USAGE.md and the
# test files with no GPU test in them that no other test imports. They wait in $HOLD (default /tmp/cula-hold),
# which must be empty to hold.
set -euo pipefail
cd "$(dirname "$0")/../.."
HOLD=${HOLD:-/tmp/cula-hold}
LIMIT=$((64 * 1024 * 1024))

room() {
  python3 - "$LIMIT" <<'EOF'
import os, subprocess, sys
files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True, text=True,
                       check=True).stdout.split("\0")
tree = sum(os.path.getsize(f) for f in files if f and os.path.isfile(f))
device = sum(os.path.getsize(os.path.join(".device", f)) for f in os.listdir(".device")) if os.path.isdir(".device") else 0
print(f"tree {tree} B + .device {device} B: {int(sys.argv[1]) - tree - device} B of the upload left")
EOF
}

case "${1:-}" in
  hold)
    if [ -d "$HOLD" ] && [ -n "$(ls -A "$HOLD")" ]; then
      echo "$HOLD is not empty: restore (or remove) the last hold first" >&2
      exit 1
    fi
    mkdir -p "$HOLD/tests"
    for p in docs benchmarks/results USAGE.md; do
      mkdir -p "$HOLD/$(dirname "$p")"
      mv "$p" "$HOLD/$p"
    done
    # test modules that other tests import (their helpers) stay, GPU tests or not
    imported=$(grep -ho "from test_[a-z0-9_]* import" tests/*.py tests/ops/*.py | cut -d' ' -f2 | sort -u)
    for f in tests/test_*.py; do
      name=$(basename "$f" .py)
      grep -q "mark.gpu" "$f" || grep -qx "$name" <<< "$imported" || mv "$f" "$HOLD/tests/"
    done
    room
    ;;
  restore)
    [ -d "$HOLD" ] || { echo "nothing held in $HOLD" >&2; exit 1; }
    for p in docs benchmarks/results USAGE.md; do
      [ -e "$HOLD/$p" ] && mv "$HOLD/$p" "$p"
    done
    for f in "$HOLD"/tests/*.py; do
      [ -e "$f" ] && mv "$f" tests/
    done
    rm -rf "$HOLD"
    git status --short
    ;;
  *)
    echo "usage: $0 hold|restore" >&2
    exit 2
    ;;
esac
