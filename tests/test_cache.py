"""cula.cache beyond one process, on the CPU: the disk cache, the prebuilt manifest, and the decline without either.

A binary loads without a GPU (its CUDA calls bind lazily); calling it needs one, so nothing here calls a kernel.
Each cross-process check runs in fresh subprocesses, with the disk cache and the manifest switched on there
(the suite's conftest switches both off).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import cula.cache as cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the smallest variant there is (~0.5 s to compile): Lightning decode, bf16, K = V = 64, a [V, K] pool
_VARIANT = "dict(io_dtype=torch.bfloat16, K=64, V=64, state_v_first=True)"

_GET = textwrap.dedent(
    f"""
    import json, sys, time
    start = time.perf_counter()
    import torch
    torch_s = time.perf_counter() - start
    from cula.ops.lightning.sm90 import decode
    import cula.cache as cache
    fn = decode.compiled_variant(**{_VARIANT})
    print(json.dumps({{
        "seconds": time.perf_counter() - start - torch_s,
        "origins": list(cache.origins().values()),
        "dsl_imported": any(m == "cutlass" or m.startswith("cutlass.") for m in sys.modules),
        "callable": callable(fn),
    }}))
    """
)


def _run(env: dict, script: str = _GET) -> dict:
    full = dict(os.environ, PYTHONPATH=REPO, CUTE_DSL_ARCH="sm_90a", **env)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=full, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_disk_cache_serves_the_next_process(tmp_path):
    """The first process compiles and stores the variant; the next loads it without importing the DSL."""
    env = {"CULA_DISK_CACHE": "1", "CULA_CACHE_DIR": str(tmp_path), "CULA_PREBUILT": "0"}
    first = _run(env)
    assert first["origins"] == ["jit"] and first["dsl_imported"]
    stored = list(tmp_path.rglob("*.so"))
    assert len(stored) == 1 and not list(tmp_path.rglob("*.tmp"))
    second = _run(env)
    assert second["origins"] == ["disk"] and second["callable"]
    assert not second["dsl_imported"], "a disk hit must not import the DSL"
    print(f"compile + store {first['seconds']:.2f} s; next process, from disk: {second['seconds']:.3f} s")
    assert second["seconds"] < 0.5


def test_disk_cache_dir_changes_with_the_sources(tmp_path, monkeypatch):
    """The directory is named by the kernel sources' digest among others: an edit means a new directory."""
    monkeypatch.setenv("CULA_DISK_CACHE", "1")
    monkeypatch.setenv("CULA_CACHE_DIR", str(tmp_path))
    before = cache.disk_cache_dir()
    assert before.parent == tmp_path
    monkeypatch.setattr(cache, "source_digest", lambda: "edited")
    cache.build_tag.cache_clear()
    try:
        assert cache.disk_cache_dir() != before
    finally:
        cache.build_tag.cache_clear()
    monkeypatch.setenv("CULA_DISK_CACHE", "0")
    assert cache.disk_cache_dir() is None


def test_damaged_disk_entries_are_compiled_again(tmp_path):
    """A truncated entry (an interrupted copy; the loader would map it and die of SIGBUS past its end) or a garbage
    one is compiled again and replaced, as is one made with other DSL compile switches (line info: its own
    directory)."""
    env = {"CULA_DISK_CACHE": "1", "CULA_CACHE_DIR": str(tmp_path), "CULA_PREBUILT": "0"}
    assert _run(env)["origins"] == ["jit"]
    (stored,) = tmp_path.rglob("*.so")
    whole = stored.read_bytes()
    for damaged in (whole[: len(whole) // 2], whole[:4096], b"not an ELF file"):
        stored.write_bytes(damaged)
        assert _run(env)["origins"] == ["jit"]
        assert stored.read_bytes() == whole
    assert _run(env)["origins"] == ["disk"]
    assert _run(dict(env, CUTE_DSL_LINEINFO="1"))["origins"] == ["jit"]
    assert len(list(tmp_path.rglob("*.so"))) == 2


@pytest.fixture
def prebuilt(tmp_path):
    """A one-variant prebuilt directory, made as scripts/build_wheel.py makes one (compiled in a subprocess)."""
    script = textwrap.dedent(
        f"""
        import json, sys, torch
        from pathlib import Path
        from cula import aot, cache
        from cula.ops.lightning.sm90 import decode
        with cache.recording() as seen:
            decode.compiled_variant(**{_VARIANT})
        (key, build), = seen.items()
        out = Path(sys.argv[1])
        symbols = aot.link_variants(out / "libcula_test.so", [(key, build())])
        manifest = {{"sources": cache.source_digest(), "tvm_ffi": cache._version("apache-tvm-ffi"), "cuda": "",
                     "targets": ["sm_90a"], "variants": {{t: {{"library": "libcula_test.so", "symbol": s}}
                                                        for t, s in symbols.items()}}}}
        (out / "manifest.json").write_text(json.dumps(manifest))
        print(json.dumps({{}}))
        """
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, check=True, timeout=600,
                   env=dict(os.environ, PYTHONPATH=REPO, CUTE_DSL_ARCH="sm_90a", CULA_DISK_CACHE="0"))  # fmt: skip
    return tmp_path


def test_prebuilt_variant_loads_without_the_dsl(prebuilt):
    got = _run({"CULA_PREBUILT": "1", "CULA_PREBUILT_DIR": str(prebuilt), "CULA_DISK_CACHE": "0"})
    assert got["origins"] == ["prebuilt"] and got["callable"] and not got["dsl_imported"]
    print(f"prebuilt variant in a fresh process: {got['seconds']:.3f} s beyond import torch")
    assert got["seconds"] < 0.3


def test_stale_manifest_is_ignored(prebuilt):
    """A manifest of other kernel sources is not trusted: the variant is compiled instead."""
    manifest = json.loads((prebuilt / "manifest.json").read_text())
    manifest["sources"] = "someone-else"
    (prebuilt / "manifest.json").write_text(json.dumps(manifest))
    got = _run({"CULA_PREBUILT": "1", "CULA_PREBUILT_DIR": str(prebuilt), "CULA_DISK_CACHE": "0"})
    assert got["origins"] == ["jit"]


def test_damaged_prebuilt_installation_falls_back(prebuilt):
    """An unreadable manifest, or a library it names missing or truncated: the variant is compiled instead (a
    process without the DSL then declines), never an error out of the call."""
    env = {"CULA_PREBUILT": "1", "CULA_PREBUILT_DIR": str(prebuilt), "CULA_DISK_CACHE": "0"}
    library = prebuilt / "libcula_test.so"
    whole = library.read_bytes()
    library.write_bytes(whole[: len(whole) // 3])
    assert _run(env)["origins"] == ["jit"]
    library.unlink()
    assert _run(env)["origins"] == ["jit"]
    library.write_bytes(whole)
    assert _run(env)["origins"] == ["prebuilt"]
    text = (prebuilt / "manifest.json").read_text()
    for broken in (text[: len(text) // 2], "", "[]"):
        (prebuilt / "manifest.json").write_text(broken)
        assert _run(env)["origins"] == ["jit"]


def test_recording_is_this_threads_own():
    """While one thread records (cula.variants lists the variants this way), another's lookups are untouched."""
    import threading

    seen_elsewhere = []
    with cache.recording() as seen:
        worker = threading.Thread(target=lambda: seen_elsewhere.append(cache._RECORDING.get()))
        worker.start()
        worker.join()
        cache.compiled_kernel(("test-key",), lambda: None)
    assert seen_elsewhere == [None] and list(seen) == [("test-key",)]
    assert cache._RECORDING.get() is None


def test_no_binary_and_no_dsl_declines(monkeypatch, pretend_sm90, caplog):
    """Without the DSL, a variant the manifest lacks makes the cula-sm90 backend decline, with the reason logged,
    and the call runs on the next backend (here the reference: the tensors are on the CPU)."""
    import cula.backends
    import cula.lightning.decode as ldec
    from cula.lightning import lightning_decode

    monkeypatch.setattr(cula.backends, "has_package", lambda name: name != "cutlass")
    monkeypatch.setattr(cula.backends, "_has_prebuilt", lambda arch: True)  # a wheel, lacking this variant
    monkeypatch.setattr(cache, "dsl_installed", lambda: False)
    monkeypatch.setattr(cache, "_CACHE", {})
    monkeypatch.setattr(ldec, "_plans", cula.backends.StepPlans())
    caplog.set_level(logging.INFO, logger="cula")
    N, HV, D = 2, 2, 64
    q, k, v = torch.randn(N, 1, 1, D), torch.randn(N, 1, 1, D), torch.randn(N, 1, HV, D)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    decay = torch.rand(HV)
    pool = torch.randn(N, HV, D, D)
    ref_pool = pool.clone()
    idx = torch.arange(N, dtype=torch.int32)
    o = lightning_decode(q, k, v, decay, pool, idx)
    with monkeypatch.context() as m:
        m.setenv("CULA_BACKEND", "reference")
        expected = lightning_decode(q, k, v, decay, ref_pool, idx)
    torch.testing.assert_close(o, expected)
    torch.testing.assert_close(pool, ref_pool)
    assert any("cula-sm90: kernel variant" in r.getMessage() and "not installed" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]  # fmt: skip


def test_no_dsl_no_wheel_is_unavailable(monkeypatch, pretend_sm90):
    import cula.backends

    monkeypatch.setattr(cula.backends, "dsl_installed", lambda: False)
    monkeypatch.setattr(cula.backends, "_has_prebuilt", lambda arch: False)
    ok, why = cula.backends.cula_kernels_on((9, 0))(torch.device("cuda"))
    assert not ok and "nvidia-cutlass-dsl" in why


def test_wheel_estimate_samples_every_family(monkeypatch):
    """``build_wheel.py estimate`` compiles a few variants of every kernel family, spread through its list."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_wheel", os.path.join(REPO, "scripts", "build_wheel.py"))
    build_wheel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_wheel)
    listed = {("a", i): None for i in range(10)} | {("b", 0): None}
    monkeypatch.setattr(build_wheel, "_variants", lambda scope: listed)
    sample = [key for key, _ in build_wheel._listed("wheel", per_family=3)]
    assert sample == [("a", 0), ("a", 3), ("a", 6), ("b", 0)]
    assert len(build_wheel._listed("wheel")) == 11


def test_prepared_plan_falls_back_per_call():
    """A cula backend's prepared launch that meets a variant without a binary on a later call (a path its first
    call did not take) runs that call on the next backend, and keeps its own launch for the calls it can run."""
    from cula.backends import Registry

    reg = Registry("test_op")
    seen = []

    def prepare(x, path):
        def launch(x_value):
            if x_value < 0:
                raise cache.VariantUnavailableError("no binary for the cut path")
            seen.append(("cula", x_value))
            return "cula"

        launch.checks_arguments = True
        return launch

    @reg.register("cula-test", 0, prepare=prepare)
    def _cula(x, path):
        return "cula-run"

    @reg.register("other", 1)
    def _other(x, path):
        seen.append(("other", x))
        return "other"

    launch = reg.plan(torch.device("cpu"), {"x": 1, "path": "p"}, positional=("x",))
    assert launch.checks_arguments
    assert [launch(1), launch(-2), launch(3)] == ["cula", "other", "cula"]
    assert seen == [("cula", 1), ("other", -2), ("cula", 3)]


def test_failed_link_leaves_nothing(tmp_path, monkeypatch):
    """A link that fails (no compiler here) leaves no temporary file in the cache directory."""
    from cula import aot

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(OSError):
        aot.link([], tmp_path / "libcula_x.so")
    assert list(tmp_path.iterdir()) == []


def test_compiled_entry_is_the_bare_function(monkeypatch):
    """A fresh compile is served as the TVM-FFI function beneath the DSL's keyword wrapper (as a prebuilt or cached
    variant is), the wrapper kept alive; a wrapper with pointer-address arguments or defaults to fill, one with no
    loaded entry (no GPU) and anything without the accessor are served as they are."""

    class Args:
        def __init__(self, pointers):
            self.has_pointer_address_arg_specs = pointers

    class Wrapper:
        def __init__(self, bare, pointers=False):
            self.bare, self.execution_args = bare, Args(pointers)

        def __tvm_ffi_object__(self):
            return self.bare

    bare = object()
    wrapped = Wrapper(bare)
    monkeypatch.setattr(cache, "_MODULES", [])
    monkeypatch.setattr(cache, "disk_cache_dir", lambda: None)
    monkeypatch.setattr(cache, "_prebuilt_function", lambda key: None)
    monkeypatch.setattr(cache, "dsl_installed", lambda: True)
    assert cache._obtain(("k",), lambda: wrapped) == (bare, "jit") and cache._MODULES == [wrapped]
    with_defaults = Wrapper(bare)
    with_defaults._kwargs_wrapper = lambda a, b=1: None
    for kept in (Wrapper(bare, pointers=True), Wrapper(None), with_defaults, bare):
        assert cache.positional_entry(kept) is kept
