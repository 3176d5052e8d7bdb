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


def _run_fake(tmp_path, *args, **env):
    """validate.sh with pytest replaced by ``echo`` (each step's log: its command line), in $OUT = tmp_path."""
    import os

    env = dict(os.environ, OUT=str(tmp_path), VALIDATE_PYTEST="echo ran", **env)
    return subprocess.run(["bash", "scripts/device/validate.sh", *args], cwd=REPO, capture_output=True, text=True,
                          env=env, check=True).stdout  # fmt: skip


def test_parallel_steps_all_run_and_report_in_step_order(tmp_path):
    steps, _ = _listing()
    out = _run_fake(tmp_path, "-j", "4")
    for name, (_limit, files) in steps.items():
        assert (tmp_path / f"{name}.rc").read_text().strip() == "0", name
        log = (tmp_path / f"{name}.log").read_text()
        assert log.startswith("ran ") and all(f in log for f in files), name
    reported = [line.split()[1].rstrip(":") for line in out.splitlines() if line.startswith("== ") and ":" in line
                and "started" not in line and "done" not in line]  # fmt: skip
    assert reported == list(steps), "the summary follows the steps' order"
    started = [line.split()[1] for line in out.splitlines() if " started at " in line]
    assert [steps[s][0] for s in started] == sorted((steps[s][0] for s in started), reverse=True), "longest first"


def test_deadline_cuts_steps_that_cannot_start(tmp_path):
    out = _run_fake(tmp_path, "-j", "2", "api", "long", DEADLINE="1")
    assert (tmp_path / "api.rc").read_text().strip() == "124" and "not started" in (tmp_path / "api.log").read_text()
    assert "TIMED OUT" in out
    bad = subprocess.run(["bash", "scripts/device/validate.sh", "-j", "x"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "-j needs a positive number" in bad.stderr
