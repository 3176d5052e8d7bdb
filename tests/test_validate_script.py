"""scripts/device/validate.sh's steps, checked on the CPU: every test file runs in exactly one step, and each group
of steps meant for one device call fits the call's 10 minutes."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CALL_SECONDS = 600
RUN_SH_SECONDS = 10  # run.sh's own work around the steps: unpacking and packing FLA's autotune cache


def _listing():
    out = subprocess.run(["bash", "scripts/device/validate.sh", "--list"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    steps, calls = {}, []
    for line in out.splitlines():
        kind, *words = line.split()
        if kind == "step":
            steps[words[0]] = (int(words[1]), words[2:])
        else:
            calls.append(words)
    return steps, calls


def test_every_test_file_is_in_exactly_one_step():
    steps, _ = _listing()
    listed = [f for _limit, files in steps.values() for f in files]
    on_disk = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py"))
    assert sorted(listed) == on_disk, "files missing from the steps, or in two of them"
    assert all(files for _limit, files in steps.values()), "a step without files"


def test_each_call_fits_one_device_call():
    steps, calls = _listing()
    assert sorted(s for call in calls for s in call) == sorted(steps), "each step in exactly one call"
    for call in calls:
        assert sum(steps[s][0] for s in call) + RUN_SH_SECONDS <= CALL_SECONDS, call
