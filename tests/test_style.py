"""The tree passes ruff's checks as pyproject.toml configures them (pyflakes and 120-column lines)."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is in the `test` extra")
def test_ruff_is_clean():
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "cula", "benchmarks", "scripts", "tests", "setup.py"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
