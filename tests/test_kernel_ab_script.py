"""scripts/device/kernel_ab.py on the CPU: an earlier commit's launcher and kernel modules load beside the working
tree's (from ``.git``), under other names, with their own compile cache, and every case names a launcher."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts" / "device"))

import kernel_ab  # noqa: E402


def _has_history() -> bool:
    return subprocess.run(["git", "rev-parse", "--verify", "HEAD"], cwd=REPO, capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_history(), reason="needs the checkout's .git")
def test_loads_a_commits_launcher_beside_the_working_trees():
    host = "cula.ops.kda.sm90.bwd_wy_dqkg"
    old = kernel_ab.load_rev("HEAD", host)
    new = importlib.import_module(host)
    assert old is not new and old.__name__ != new.__name__
    assert callable(old.chunk_kda_bwd_wy_dqkg_sm90)
    # its kernel module is REV's, found by the host's own lookup (the DSL reads kernels' source from their files)
    compile_fn = old._compile
    kernel = sys.modules[old.__name__ + "_kernel"]
    assert Path(kernel.__file__).read_text() == subprocess.run(
        ["git", "show", "HEAD:cula/ops/kda/sm90/bwd_wy_dqkg_kernel.py"], cwd=REPO, capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    assert compile_fn is kernel._compile
    # compiled outside cula's caches: each key built once, by REV's code
    built = []
    first = old.compiled_kernel(("k",), lambda: built.append(1) or object())
    assert old.compiled_kernel(("k",), lambda: built.append(2)) is first and built == [1]


def test_every_case_names_a_launcher():
    for name, ((host, fn), make) in kernel_ab.CASES.items():
        assert callable(getattr(importlib.import_module(host), fn)), name
        assert callable(make), name


def test_loads_a_directory_of_files_as_rev(tmp_path, monkeypatch):
    """REV naming a directory of the working tree: the host and kernel modules are that directory's copies (for a
    device whose .git lags the checkout)."""
    host = "cula.ops.kda.sm90.segment_chain"
    base = tmp_path / "ab_base"
    for suffix in ("", "_kernel"):
        path = Path(host.replace(".", "/") + suffix + ".py")
        (base / path).parent.mkdir(parents=True, exist_ok=True)
        text = (REPO / path).read_text()
        (base / path).write_text(text + ("\nMARK = 1\n" if suffix == "_kernel" else ""))
    monkeypatch.setattr(kernel_ab, "REPO", tmp_path)
    old = kernel_ab.load_rev("ab_base", host)
    assert old.__name__ == "_kernel_ab_ab_base_segment_chain"
    assert old._compile is sys.modules[old.__name__ + "_kernel"]._compile  # the kernel module, imported on use
    assert sys.modules[old.__name__ + "_kernel"].MARK == 1
