"""The benchmark harness on the CPU (writer, summaries, floors, shared suite helpers); KDA prefill on GPU."""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))  # benchmarks/ is a script folder, not a package
bc = importlib.import_module("common")
kda_bench = importlib.import_module("bench_kda_prefill")


def fake_rows() -> list[dict]:
    return [
        {"config": "B1-T512", "B": 1, "T": 512, "fla_ms": 1.0, "cula_ms": 0.5, "speedup": 2.0,
         "max_rel_err": 1e-3, "floor_ms": 0.25, "floor_pct": 50.0},
        {"config": "B2-T512", "B": 2, "T": 512, "fla_ms": 2.0, "cula_ms": 4.0, "speedup": 0.5,
         "max_rel_err": 2e-3, "floor_ms": 0.5, "floor_pct": 12.5},
        {"config": "varlen-N10-T4096-random", "B": 1, "T": 4096, "fla_ms": 3.0, "cula_ms": 1.5,
         "speedup": 2.0, "max_rel_err": 0.0, "floor_ms": 0.1, "floor_pct": 6.7, "seq_lens": [1, 2, 3]},
        {"config": "failed", "B": 1, "T": 64, "fla_ms": 1.0, "cula_ms": None, "speedup": None,
         "max_rel_err": float("inf"), "floor_ms": 0.1, "floor_pct": None},
    ]


def test_geomean_skips_missing():
    assert bc.geomean([2.0, 0.5, 2.0]) == pytest.approx(2.0 ** (1 / 3))
    assert bc.geomean([4.0, None, float("nan"), 1.0]) == pytest.approx(2.0)
    assert math.isnan(bc.geomean([None]))


def test_summary_reports_min_config():
    s = bc.summarize(fake_rows())
    assert s["n"] == 3
    assert s["min"] == 0.5 and s["max"] == 2.0 and s["min_config"] == "B2-T512"
    assert s["geomean"] == pytest.approx(2.0 ** (1 / 3))


def test_floor_math():
    # 4.27e12 bytes at 4.27 TB/s is 1 s; 690e12 flops at 690 TFLOP/s is 1 s: the larger side wins.
    assert bc.floor_ms(4.27e12, 1.0, 4.27, 690.0) == pytest.approx(1000.0)
    assert bc.floor_ms(1.0, 2 * 690e12, 4.27, 690.0) == pytest.approx(2000.0)
    assert bc.floor_pct(1.0, 4.0) == pytest.approx(25.0)
    assert bc.floor_pct(1.0, None) is None
    assert bc.bw_fraction(2.135e9, 1.0, 4.27) == pytest.approx(0.5)
    assert bc.speedup(3.0, 1.5) == pytest.approx(2.0)
    assert bc.speedup(3.0, None) is None


def test_rotation_sets_cover_twice_l2():
    l2 = 60 * 2**20
    assert bc.n_rotation_sets(10 * 2**20, l2) == 12
    assert bc.n_rotation_sets(500 * 2**20, l2) == 1
    assert bc.n_rotation_sets(1, l2, max_sets=8) == 8
    assert bc.gpu_slug("NVIDIA H200") == "nvidia-h200"


def test_timing_summary():
    t = bc.Timing.from_samples([5.0, 1.0, 3.0, 2.0, 4.0])
    assert t.median_ms == 3.0 and t.min_ms == 1.0 and t.n == 5


class _FakeEvent:
    """Stands in for torch.cuda.Event on the CPU: records wall time."""

    def __init__(self, enable_timing: bool = False):
        self.t = None

    def record(self, stream=None):
        import time

        self.t = time.perf_counter()

    def elapsed_time(self, end: _FakeEvent) -> float:
        return (end.t - self.t) * 1e3


def test_bench_rotates_sets_and_takes_median(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    calls = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]
    t = bc.bench(fns, iters=7, warmup=2)
    # Warm-up covers every set once (3 >= warmup), then timed calls cycle 0, 1, 2, 0, ...
    assert calls == [0, 1, 2] + [0, 1, 2, 0, 1, 2, 0]
    assert t.n == 7 and t.min_ms <= t.median_ms <= t.p90_ms
    with pytest.raises(ValueError):
        bc.bench(fns, iters=1, l2="none")
    overhead = bc.measure_host_overhead(lambda: None, n=5, warmup=1)
    assert set(overhead) == {"host_us", "back_to_back_us", "gpu_us"}


def test_prefill_host_overhead_calls_one_sequence_or_a_packed_batch(monkeypatch):
    """bench_kda_prefill.host_overhead: the fixed call is one sequence of HOST_OVERHEAD_T tokens, the packed one the
    same tokens as four sequences with both copies of cu_seqlens; each side's call measured."""
    monkeypatch.setattr(kda_bench, "DEVICE", "cpu")
    seen = []

    def fake(calls, record=None):
        return {label: seen.append((label, make()())) or {"host_us": 1.0} for label, make in calls.items()}

    monkeypatch.setattr(bc, "measure_host_overheads", fake)
    fn = lambda **kw: (kw["q"].shape, None if kw.get("cu_seqlens") is None else kw["cu_seqlens_cpu"].tolist())  # noqa: E731
    T = kda_bench.HOST_OVERHEAD_T
    out = kda_bench.host_overhead(fn, fn)
    assert out["config"] == f"B1-T{T}" and set(out) == {"config", "fla", "cula"}
    assert seen == [(side, ((1, T, kda_bench.H, kda_bench.K), None)) for side in ("fla", "cula")]
    seen.clear()
    out = kda_bench.host_overhead(fn, fn, packed=True)
    assert out["config"].startswith("varlen-N4")
    assert [s[1][1] for s in seen] == [[0, T // 4, T // 2, 3 * T // 4, T]] * 2


def test_host_overheads_interleave_rounds_and_keep_the_lowest(monkeypatch):
    """measure_host_overheads: each maker once, the implementations in turn every round, per figure the lowest
    round; a failing maker or call is recorded and left out."""
    seen = []

    def fake(fn):
        seen.append(fn())
        r = len(seen)
        return {"host_us": 10.0 + r, "back_to_back_us": 20.0 - r, "gpu_us": 1.0}

    monkeypatch.setattr(bc, "measure_host_overhead", fake)
    made, errors = [], []

    def maker(label):
        def make():
            made.append(label)
            return lambda: label

        return make

    def broken():
        raise RuntimeError("no")

    calls = {"fla": maker("fla"), "cula": maker("cula"), "broken": broken,
             "bad_call": lambda: (lambda: (_ for _ in ()).throw(RuntimeError("call")))}  # fmt: skip
    out = bc.measure_host_overheads(calls, rounds=3, record=lambda what, exc: errors.append(what))
    assert made == ["fla", "cula"] and seen == ["fla", "cula"] * 3
    assert set(out) == {"fla", "cula"} and sorted(errors) == ["bad_call host overhead", "broken host overhead"]
    # measurements 1-6 alternate fla, cula (bad_call raised before counting): the lowest of each figure per label
    assert out["fla"]["host_us"] == 11.0 and out["cula"]["host_us"] == 12.0
    assert out["fla"]["back_to_back_us"] == 15.0 and out["cula"]["back_to_back_us"] == 14.0


def _fake_kda(q, k, v, g, beta, initial_state, **kwargs):
    return v.clone(), initial_state * 2


def _garbage_kda(q, k, v, g, beta, initial_state, **kwargs):
    return torch.full_like(v, float("nan")), initial_state * 2


def test_kda_run_config_with_fake_impls(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(bc, "l2_cache_bytes", lambda *a: 60 * 2**20)
    monkeypatch.setattr(bc, "n_rotation_sets", lambda *a, **k: 2)
    monkeypatch.setattr(kda_bench, "DEVICE", "cpu")
    args = kda_bench.parse_args(["--iters", "3", "--warmup", "1"])
    ceilings = {"copy_bw_tbps": 4.27, "gemm_tflops": 690.0}
    lens = (40, 24)
    cfg = kda_bench.Config("varlen", 1, sum(lens), lens, "random")

    row = kda_bench.run_config(cfg, _fake_kda, _fake_kda, args, ceilings)
    assert row["check"] == "ok" and row["max_rel_err"] == 0.0
    assert row["fla_ms"] > 0 and row["cula_ms"] > 0 and row["speedup"] > 0
    assert row["seq_lens"] == [40, 24] and row["rotation_sets"] == 2 and row["N"] == 2
    expected_floor = bc.floor_ms(kda_bench.kda_bytes(lens), kda_bench.kda_flops(lens), 4.27, 690.0)
    assert row["floor_ms"] == pytest.approx(expected_floor)

    bad = kda_bench.run_config(cfg, _fake_kda, _garbage_kda, args, ceilings)
    assert bad["check"] == "FAIL" and bad["cula_ms"] is None and bad["speedup"] is None


def test_write_results_md_json_png(tmp_path):
    meta = {"FLA_FLASH_KDA": "0", "copy_bw_tbps": 4.27, "gemm_tflops": 690.0, "compile": {("k", 1): 1.5}}
    paths = bc.write_results("fake_bench", meta, fake_rows(), out_dir=tmp_path)
    slug_dir = tmp_path / bc.gpu_slug(bc.environment_meta()["gpu_name"])
    assert paths["md"] == slug_dir / "fake_bench.md"
    for ext in ("md", "json", "png"):
        assert paths[ext].is_file() and paths[ext].stat().st_size > 0

    data = json.loads(paths["json"].read_text())  # strict JSON: inf/nan must have become null
    assert set(data) == {"meta", "rows"}
    m = data["meta"]
    for key in ("gpu_name", "driver_version", "cuda_version", "date", "copy_bw_tbps", "gemm_tflops"):
        assert key in m
    assert set(m["versions"]) >= {"torch", "triton", "nvidia-cutlass-dsl", "fla-core", "cula"}
    assert m["FLA_FLASH_KDA"] == "0"
    assert m["summary"]["min_config"] == "B2-T512"
    assert len(data["rows"]) == 4 and data["rows"][3]["max_rel_err"] is None
    assert data["rows"][2]["seq_lens"] == [1, 2, 3]

    md = paths["md"].read_text()
    assert "| config |" in md and "| B2-T512 |" in md
    assert "seq_lens" not in md  # list-valued entries stay in the JSON
    last = md.strip().splitlines()[-1]
    assert "geomean speedup 1.260x" in last and "min 0.500x (B2-T512)" in last
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_merge_runs_in_parts(tmp_path):
    """``--merge``: a second run's rows join the first's under the suite's own name (a config run again replaces
    its row), each row with the commit that measured it, in suite order, with what is still missing."""
    rows = fake_rows()
    first = bc.write_results("fake_bench", {"cula_git": "aaa"}, rows[:2], out_dir=tmp_path)["json"]
    args = kda_bench.parse_args(["--configs", "x", "--merge", str(first), "--out", str(tmp_path / "next")])
    again = dict(rows[1], speedup=9.0)
    suite = [r["config"] for r in rows] + ["never-run"]
    paths = bc.write_suite("fake_bench", args, {"cula_git": "bbb", "partial": False}, [rows[2], again],
                           ["config", "speedup"], suite)
    assert paths["json"].name == "fake_bench.json"
    data = json.loads(paths["json"].read_text())
    assert [r["config"] for r in data["rows"]] == suite[:3]
    assert [r["cula_git"] for r in data["rows"]] == ["aaa", "bbb", "bbb"]
    assert data["rows"][1]["speedup"] == 9.0
    m = data["meta"]
    assert m["partial"] and m["missing_configs"] == ["failed", "never-run"]
    assert [r["cula_git"] for r in m["merged_runs"]] == ["aaa", "bbb"]
    assert m["merged_runs"][1]["configs"] == [rows[2]["config"], rows[1]["config"]]


def test_code_tree_names_the_commit_whose_cula_ran(tmp_path):
    """cula_tree is cula/'s git tree as the working tree holds it: a commit's own (``git rev-parse REV:cula``) where
    cula/ matches it, whatever HEAD says, and another id once a file under cula/ differs."""
    import shutil
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("no git")
    root = BENCH_DIR.parent
    work = tmp_path / "work"
    clone = subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(root), str(work)], capture_output=True)
    if clone.returncode:
        pytest.skip("the checkout cannot be cloned here")
    (work / "benchmarks").mkdir(exist_ok=True)
    shutil.copy(BENCH_DIR / "common.py", work / "benchmarks" / "common.py")
    probe = "import sys; sys.path.insert(0, 'benchmarks'); import common; print(common._code_tree())"

    def tree() -> str:
        out = subprocess.run([sys.executable, "-c", probe], cwd=work, capture_output=True, text=True, check=True)
        return out.stdout.strip()

    head = subprocess.run(["git", "rev-parse", "HEAD:cula"], cwd=work, capture_output=True, text=True, check=True)
    assert tree() == head.stdout.strip()[:12]
    (work / "cula" / "__init__.py").write_text((work / "cula" / "__init__.py").read_text() + "\n# edited\n")
    assert tree() not in (head.stdout.strip()[:12], "unknown")


def test_write_results_fills_missing_ceilings(tmp_path):
    paths = bc.write_results("bare", {}, fake_rows()[:1], out_dir=tmp_path, md_columns=["config", "speedup"])
    m = json.loads(paths["json"].read_text())["meta"]
    assert m["copy_bw_tbps"] == "not measured" and m["gemm_tflops"] == "not measured"
    assert "| config | speedup |" in paths["md"].read_text()


def test_kda_suite_shape():
    cfgs = kda_bench.suite()
    assert len(cfgs) == 28 and len({c.name for c in cfgs}) == 28
    assert sum(c.mode == "fixed" for c in cfgs) == 10
    for c in cfgs:
        assert sum(c.lens) == c.B * c.T and min(c.lens) >= 1
        if c.dist == "skewed":
            assert max(c.lens) == c.T // 2
    assert [c.name for c in kda_bench.suite(quick=True)] == list(kda_bench.QUICK)
    # Seeded: a second build gives identical lengths.
    assert [c.lens for c in kda_bench.suite()] == [c.lens for c in cfgs]


def test_kda_flops_and_bytes():
    c, k, v = 64, 128, 128
    per_chunk = 2 * c * c * k * 2 + c**3 / 3 + 2 * c * c * (k + v) + 6 * c * k * v + 2 * c * c * v
    assert kda_bench.chunk_flops(c) == pytest.approx(per_chunk)
    assert kda_bench.kda_flops((128,), hv=1) == pytest.approx(2 * per_chunk)
    # A partial chunk counts only its own tokens.
    assert kda_bench.kda_flops((64 + 10,), hv=1) == pytest.approx(per_chunk + kda_bench.chunk_flops(10))
    t, n = 512, 1
    expected = 2 * t * (2 * 64 * 128 + 64 * 128 + 64 * 128 + 64 + 64 * 128) + 8 * n * 64 * 128 * 128
    assert kda_bench.kda_bytes((t,)) == expected + 4 * 64 + 4 * 64 * 128


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kda_prefill_quick_on_gpu(tmp_path):
    meta, rows, paths = kda_bench.main(["--quick", "--iters", "5", "--warmup", "2", "--out", str(tmp_path)])
    assert len(rows) == len(kda_bench.QUICK)
    for r in rows:
        assert r["check"] != "FAIL", r
        assert r["fla_ms"] > 0 and r["cula_ms"] > 0 and r["speedup"] > 0
        assert 0 < r["floor_pct"] <= 100.0 + 1e-6
    assert meta["FLA_FLASH_KDA"] == "0"
    assert meta["copy_bw_tbps"] > 0.5 and meta["gemm_tflops"] > 10
    assert "host_overhead_us" in meta
    data = json.loads(paths["json"].read_text())
    assert data["meta"]["FLA_FLASH_KDA"] == "0" and len(data["rows"]) == len(rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_timing_refuses_host_waits_and_leaves_the_process_usable():
    x = torch.randn(1 << 20, device="cuda")
    lens = torch.tensor([3, 5], device="cuda")
    with pytest.raises(bc.NotCapturable, match="waits on the host"):
        bc.bench(lambda: x[: int(lens.sum().item())].mul_(1.0), iters=3, warmup=1, cuda_graph=True)
    assert torch.cuda.get_sync_debug_mode() == 0
    # a failed capture would leave the allocator and the RNG in capture mode: both must still work after
    free_before = torch.cuda.mem_get_info()[0]
    big = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    del big
    torch.randn(8, device="cuda")
    t = bc.bench(lambda: x.mul_(1.0), iters=3, warmup=1, cuda_graph=True)
    assert t.median_ms > 0
    assert torch.cuda.mem_get_info()[0] >= free_before - (64 << 20)


# ---------------------------------------------------------------------------------- shared suite machinery


def test_check_outputs_statuses():
    ref = torch.ones(4, 8)
    ok = bc.check_outputs([(ref, ref.clone()), (ref, ref.clone())], 5e-3, 5e-2)
    assert ok == (0.0, "ok")
    warn_err, warn = bc.check_outputs([(ref, ref * 1.01)], 5e-3, 5e-2)
    assert warn == "warn" and warn_err == pytest.approx(0.01)
    assert bc.check_outputs([(ref, ref * 1.1)], 5e-3, 5e-2)[1] == "FAIL"
    # the worst pair decides the error; a tighter fail tolerance turns the same error into a FAIL
    err, status = bc.check_outputs([(ref, ref), (ref, ref * 1.01)], 5e-3, 5e-2)
    assert status == "warn" and err == pytest.approx(0.01)
    assert bc.check_outputs([(ref, ref * 1.01)], 1e-3, 5e-3)[1] == "FAIL"
    nan = torch.full_like(ref, float("nan"))
    assert bc.check_outputs([(ref, None)], 5e-3, 5e-2) == (math.inf, "FAIL")
    assert bc.check_outputs([(None, ref)], 5e-3, 5e-2) == (math.inf, "FAIL")
    assert bc.check_outputs([(ref, ref[:2])], 5e-3, 5e-2) == (math.inf, "FAIL")
    assert bc.check_outputs([(ref, nan)], 5e-3, 5e-2) == (math.inf, "FAIL")
    err, status = bc.check_outputs([(nan, ref)], 5e-3, 5e-2)  # broken reference: NaN error
    assert math.isnan(err) and status == "FAIL"
    # the first pair that cannot be compared decides, before later pairs are looked at
    assert bc.check_outputs([(ref, nan), (nan, ref)], 5e-3, 5e-2) == (math.inf, "FAIL")


def test_script_checks_use_their_outputs_and_tolerances():
    o, s = torch.ones(2, 3), torch.ones(2, 4)
    assert kda_bench.check((o, s, "extra"), (o.clone(), s.clone())) == (0.0, "ok")
    assert kda_bench.check((o, s), (o, s * (1 + 2 * kda_bench.WARN_TOL)))[1] == "warn"
    assert kda_bench.check((o, s), (o, s * (1 + 2 * kda_bench.FAIL_TOL)))[1] == "FAIL"


def test_error_recorder_and_error_text(capsys):
    errors: dict[str, str] = {}
    record = bc.error_recorder(errors, "B1-T512")
    record("cula check", ValueError("x" * 1000))
    assert errors["cula check"].startswith("ValueError: xxx") and len(errors["cula check"]) == bc.ERROR_CHARS
    assert "WARNING: B1-T512: cula check raised ValueError" in capsys.readouterr().err
    assert bc.error_text(RuntimeError("boom"), "raised ") == "raised RuntimeError: boom"
    assert len(bc.error_text(RuntimeError("y" * 1000), "raised ")) == bc.ERROR_CHARS


class _FakeBackend:
    def __init__(self, name):
        self.name = name


class _FakeRegistry:
    def select(self, device, args):
        return _FakeBackend("fake-sm90")


def test_call_recording_backend(monkeypatch):
    import types

    registry = _FakeRegistry()
    module = types.ModuleType("fake_backends_for_test")
    module.registry = registry
    monkeypatch.setitem(sys.modules, "fake_backends_for_test", module)

    def call():
        return registry.select("cpu", {}).name + "-result"

    out = bc.call_recording_backend(call, "fake_backends_for_test:registry")
    assert out == ("fake-sm90-result", "fake-sm90")
    assert "select" not in vars(registry)  # the spy is gone after the call
    assert bc.call_recording_backend(lambda: 1, "fake_backends_for_test:registry") == (1, "unknown")

    def raising():
        registry.select("cpu", {})
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        bc.call_recording_backend(raising, "fake_backends_for_test:registry")
    assert "select" not in vars(registry)
    assert bc.call_recording_backend(lambda: 2, "no_such_module_for_test:registry") == (2, "unknown")
    assert bc.call_recording_backend(lambda: 3, "fake_backends_for_test:missing") == (3, "unknown")


class _Cfg:
    def __init__(self, name):
        self.name = name


def test_run_suite_rows_budget_progress(capsys):
    cfgs = [_Cfg(f"c{i}") for i in range(4)]

    def run_one(cfg):
        if cfg is cfgs[2]:
            raise RuntimeError("broken config")
        return {"config": cfg.name, "check": "ok", "speedup": 2.0}

    seen = []
    run = bc.run_suite(cfgs, run_one, None, 0.0, lambda c, r: seen.append(c.name), name="t",
                       progress=bc.PROGRESS_KEYS)
    rows, skipped = run
    assert [r["config"] for r in rows] == ["c0", "c1", "c2", "c3"]
    assert skipped == [] and run.interrupted is None
    assert rows[2]["check"] == "FAIL" and rows[2]["errors"] == {"config": "RuntimeError: broken config"}
    assert rows[2]["fla_ms"] is None and rows[2]["cula_ms"] is None and rows[2]["speedup"] is None
    assert all("wall_s" in r for r in rows) and seen == ["c0", "c1", "c2", "c3"]
    err = capsys.readouterr().err
    assert "[t 4/4 " in err and "c1 fla_ms=n/a cula_ms=n/a speedup=2.000" in err

    run = bc.run_suite(cfgs, run_one, None, 0.0, record_wall=False)
    assert not any("wall_s" in r for r in run.rows)
    # a spent budget skips everything from the next config on, and says so
    def slow(cfg):
        time.sleep(0.06)
        return {"config": cfg.name, "check": "ok"}

    rows, skipped = bc.run_suite(cfgs, slow, 0.05, time.perf_counter())
    assert [r["config"] for r in rows] == ["c0"] and skipped == ["c1", "c2", "c3"]
    assert "--max-seconds 0.05 reached: skipping 3 config(s)" in capsys.readouterr().err


def test_run_suite_records_the_hosts_speed_before_each_config(monkeypatch):
    """On a GPU every row carries the host's speed measured just before its config ran (none without one)."""
    cfgs = [_Cfg(f"c{i}") for i in range(3)]
    speeds = iter([2.71, 5.044, 2.8])
    monkeypatch.setattr(bc, "host_speed_us", lambda: next(speeds))
    monkeypatch.setattr(bc.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bc.torch.cuda, "empty_cache", lambda: None)
    run = bc.run_suite(cfgs, lambda cfg: {"config": cfg.name, "check": "ok"}, None, 0.0)
    assert [r["host_speed_us"] for r in run.rows] == [2.71, 5.04, 2.8]
    monkeypatch.setattr(bc.torch.cuda, "is_available", lambda: False)
    run = bc.run_suite(cfgs, lambda cfg: {"config": cfg.name, "check": "ok"}, None, 0.0)
    assert not any("host_speed_us" in r for r in run.rows)


def test_run_suite_sigterm_keeps_rows():
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    cfgs = [_Cfg(f"c{i}") for i in range(4)]

    def run_one(cfg):
        if cfg is cfgs[2]:
            signal.raise_signal(signal.SIGTERM)
        return {"config": cfg.name, "check": "ok"}

    # A no-op handler underneath, so a run_suite that failed to install its own cannot kill pytest.
    fallback = signal.signal(signal.SIGTERM, lambda *a: None)
    try:
        underneath = signal.getsignal(signal.SIGTERM)
        run = bc.run_suite(cfgs, run_one, None, 0.0, name="t")
        assert signal.getsignal(signal.SIGTERM) is underneath  # restored after the suite
    finally:
        signal.signal(signal.SIGTERM, fallback)
    assert [r["config"] for r in run.rows] == ["c0", "c1"]
    assert run.skipped == ["c2", "c3"] and run.interrupted == f"signal {int(signal.SIGTERM)}"
    meta = bc.budget_meta(run, None, 0.0)
    assert meta["partial"] is True and meta["skipped_configs"] == ["c2", "c3"]
    assert meta["interrupted"] == run.interrupted and meta["max_seconds"] is None


def test_timed_and_time_pair(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    args = bc.arg_parser("x", ("a",), iters=3, warmup=1).parse_args([])
    errors: dict[str, str] = {}
    record = bc.error_recorder(errors, "cfg")
    calls = []
    sets = [0, 1]
    fla_t, cula_t = bc.time_pair(lambda s: (lambda: calls.append(("fla", s))), None, sets, args, record)
    assert fla_t is not None and fla_t.n == 3 and cula_t is None
    assert {c[1] for c in calls} == {0, 1} and {c[0] for c in calls} == {"fla"}

    def broken(s):
        def call():
            raise RuntimeError("capture refused")
        return call

    fla_t, cula_t = bc.time_pair(None, broken, sets, args, record)
    assert fla_t is None and cula_t is None and errors == {"cula timing": "RuntimeError: capture refused"}
    assert bc.median_ms(None) is None
    t = bc.Timing.from_samples([1.0, 2.0, 3.0])
    assert bc.median_ms(t) == 2.0
    assert bc.spread_fields(t, None) == {"fla_p10_ms": 1.0, "fla_p90_ms": 3.0, "cula_p10_ms": None,
                                         "cula_p90_ms": None}


def test_rotation_sets_and_inputs(monkeypatch):
    monkeypatch.setattr(bc, "l2_cache_bytes", lambda *a: 60 * 2**20)
    sets = bc.rotation_sets("cfg", lambda cfg, i: (cfg, i), 10 * 2**20, "rotate")
    assert sets == [("cfg", i) for i in range(12)]
    assert bc.rotation_sets("cfg", lambda cfg, i: i, 10 * 2**20, "flush") == [0]
    cu = bc.cu_seqlens((3, 5, 1), "cpu")
    assert cu["cu_seqlens_cpu"].tolist() == [0, 3, 8, 9] and cu["cu_seqlens"].dtype == torch.int32
    assert bc.config_seed("B1-T512") == bc.config_seed("B1-T512") != bc.config_seed("B2-T512")
    assert kda_bench._seed is bc.config_seed  # bench_lightning_prefill's seeds come from the same function


def test_arg_parser_defaults_and_result_names():
    lp = importlib.import_module("bench_lightning_prefill")
    kd = importlib.import_module("bench_kda_decode")
    a = kda_bench.parse_args([])
    assert (a.iters, a.warmup, a.max_seconds, a.no_host_overhead, a.l2) == (100, 10, 0.0, False, "rotate")
    a = lp.parse_args([])
    assert (a.iters, a.warmup, a.max_seconds) == (20, 3, None) and not hasattr(a, "no_host_overhead")
    a = kd.parse_args(["--no-host-overhead", "--cuda-graph", "--l2", "flush", "--configs", "x,y",
                       "--out", "o"])
    assert (a.iters, a.warmup, a.no_host_overhead, a.cuda_graph, a.l2, a.configs, a.out) == (
        20, 3, True, True, "flush", "x,y", "o")
    with pytest.raises(SystemExit):
        lp.parse_args(["--l2", "none"])
    assert kda_bench.result_name(kda_bench.parse_args([])) == "kda_prefill"
    assert kda_bench.result_name(kda_bench.parse_args(["--cuda-graph", "--l2", "flush", "--quick"])) == (
        "kda_prefill_cudagraph_flush_subset")
    assert kd.result_name(kd.parse_args(["--configs", "decode-N1-H64"])) == "kda_decode_subset"


def test_select_configs():
    quick = bc.select_configs(kda_bench.suite, kda_bench.parse_args(["--quick"]))
    assert [c.name for c in quick] == list(kda_bench.QUICK)
    # --configs keeps suite order and wins over --quick
    args = kda_bench.parse_args(["--quick", "--configs", "B2-T512,B1-T512"])
    picked = bc.select_configs(kda_bench.suite, args)
    assert [c.name for c in picked] == ["B1-T512", "B2-T512"]
    with pytest.raises(SystemExit, match="unknown configs"):
        bc.select_configs(kda_bench.suite, kda_bench.parse_args(["--configs", "B1-T512,nope"]))


def test_meta_helpers_and_env_var(monkeypatch):
    args = kda_bench.parse_args(["--iters", "7"])
    meta = bc.run_meta(args, {"copy_bw_tbps": 4.123456, "gemm_tflops": 690.1234}, 5e-3, 5e-2)
    assert list(meta) == ["timing", "tolerance", "copy_bw_tbps", "gemm_tflops"]
    assert meta["timing"] == {"mode": "eager", "stat": "median", "iters": 7, "warmup": 10,
                              "l2": "rotate input sets to > 2x L2"}
    assert meta["tolerance"] == {"warn": 5e-3, "fail": 5e-2}
    assert meta["copy_bw_tbps"] == 4.1235 and meta["gemm_tflops"] == 690.12
    flush = bc.run_meta(kda_bench.parse_args(["--l2", "flush", "--cuda-graph"]), {"copy_bw_tbps": 1.0,
                        "gemm_tflops": 1.0}, 1.0, 2.0, rotate="own pools")
    assert flush["timing"]["l2"] == "flush 256 MiB before each call"
    assert flush["timing"]["mode"] == "cuda_graph"
    assert bc.budget_meta(bc.SuiteRun([{}], []), 60.0, 0.0).keys() == {"partial", "wall_s"}

    monkeypatch.delenv("BENCH_TEST_VAR", raising=False)
    with bc.env_var("BENCH_TEST_VAR", "0"):
        assert os.environ["BENCH_TEST_VAR"] == "0"
    assert "BENCH_TEST_VAR" not in os.environ
    monkeypatch.setenv("BENCH_TEST_VAR", "1")
    with pytest.raises(RuntimeError), bc.env_var("BENCH_TEST_VAR", "0"):
        raise RuntimeError
    assert os.environ["BENCH_TEST_VAR"] == "1"


def test_compare_two_runs(tmp_path, capsys):
    """benchmarks/compare.py: cula's and FLA's after / before on the configs both runs timed."""
    compare = importlib.import_module("compare")
    rows = fake_rows()
    later = [dict(r) for r in rows]
    later[0]["cula_ms"], later[0]["fla_ms"] = 1.0, 2.0  # both twice as slow: the host, by FLA's column
    later[1]["cula_ms"] = 2.0
    for side, rs in (("b", rows), ("a", later[:3])):
        (tmp_path / side).mkdir()
        (tmp_path / side / "kda_prefill.json").write_text(json.dumps({"meta": {}, "rows": rs}))
    summaries = compare.main([str(tmp_path / "b"), str(tmp_path / "a"), "--out", str(tmp_path / "ab.md")])
    s = summaries["kda_prefill"]
    assert s["configs"] == 3  # "failed" is in one run only; B1, B2 and the varlen row in both
    assert s["cula_geomean"] == pytest.approx((2.0 * 0.5 * 1.0) ** (1 / 3))
    assert s["cula_range"] == (0.5, 2.0)
    assert s["fla_geomean"] == pytest.approx(2.0 ** (1 / 3))  # (over the configs cula's ratios cover)
    assert s["missing"] == ["failed (after: no row)"]
    with pytest.raises(SystemExit):
        compare.main([str(tmp_path / "b"), str(tmp_path / "nothing-here")])
    text = (tmp_path / "ab.md").read_text()
    assert "| B1-T512 | 0.5000 | 1.0000 | 2.000 | 2.000 |" in text and "### kda_prefill" in capsys.readouterr().out
