"""The benchmark harness: writer, summaries and floors on the CPU; the KDA prefill suite on a GPU."""

from __future__ import annotations

import importlib
import json
import math
import sys
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
