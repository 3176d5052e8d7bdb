"""Pure logic of the Lightning prefill, KDA training, KDA decode and Lightning decode benchmarks on the CPU (suites,
byte formulas, row logic)."""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))  # benchmarks/ is a script folder, not a package
bc = importlib.import_module("common")
lp = importlib.import_module("bench_lightning_prefill")
kd = importlib.import_module("bench_kda_decode")
ld = importlib.import_module("bench_lightning_decode")
kt = importlib.import_module("bench_kda_training")
kp = importlib.import_module("bench_kda_prefill")


class _FakeEvent:
    def __init__(self, enable_timing: bool = False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


@pytest.fixture
def cpu_bench(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(bc, "l2_cache_bytes", lambda *a: 60 * 2**20)
    monkeypatch.setattr(bc, "n_rotation_sets", lambda *a, **k: 2)
    monkeypatch.setattr(lp, "DEVICE", "cpu")
    monkeypatch.setattr(kd, "DEVICE", "cpu")
    monkeypatch.setattr(ld, "DEVICE", "cpu")
    monkeypatch.setattr(kp, "DEVICE", "cpu")
    return {"copy_bw_tbps": 4.27, "gemm_tflops": 690.0}


# ---------------------------------------------------------------------------------------------- lightning


def test_lightning_suite_order_and_shape():
    cfgs = lp.suite()
    names = [c.name for c in cfgs]
    assert len(cfgs) == 1 + 18 + 12 and len(set(names)) == len(names)
    assert names[0] == "warmup-B1-T512" and names[1] == "B2-T16384"
    modes = [c.mode for c in cfgs]
    # every fixed config (one FLA autotune key) before any varlen one
    assert modes.index("varlen") == 19 and set(modes[19:]) == {"varlen"}
    assert "B8-T32768" in names
    for c in cfgs:
        assert sum(c.lens) == c.B * c.T and min(c.lens) >= 1
    assert {c.N for c in cfgs if c.mode == "varlen"} == {10, 20}
    assert {c.T for c in cfgs if c.mode == "varlen"} == {8192, 16384}
    assert [c.name for c in lp.suite(quick=True)] == list(lp.QUICK)
    assert [c.lens for c in lp.suite()] == [c.lens for c in cfgs]  # seeded


def test_lightning_bytes_and_flops():
    h, d = 64, 128
    assert lp.lightning_bytes((1024,)) == 2 * 1024 * 4 * h * d + 4 * h * d * d
    assert lp.lightning_bytes((100, 28)) == 2 * 128 * 4 * h * d + 2 * 4 * h * d * d
    c = 64
    per_chunk = 2 * c * c * d * 2 + 4 * c * d * d
    assert lp.chunk_flops(c) == pytest.approx(per_chunk)
    assert lp.lightning_flops((128,), h=1) == pytest.approx(2 * per_chunk)
    assert lp.lightning_flops((70,), h=1) == pytest.approx(per_chunk + lp.chunk_flops(6))
    assert lp.input_set_bytes(lp.Config("fixed", 2, 16, (16, 16))) == 2 * 32 * 3 * h * d


def test_lightning_decay_is_fla_schedule():
    decay = lp.decay_rates("cpu")
    assert decay.dtype == torch.float32 and decay.shape == (64,)
    expected = (8 / 64) * (1 - 12 / 24) * torch.arange(64, dtype=torch.float32)
    torch.testing.assert_close(decay, expected)


def _fake_lightning(q, k, v, decay=None, g_gamma=None, output_final_state=True, **kwargs):
    n = q.shape[0] if kwargs.get("cu_seqlens") is None else len(kwargs["cu_seqlens"]) - 1
    return v.clone(), torch.ones(n, q.shape[2], q.shape[3], v.shape[3])


def _nan_lightning(q, k, v, decay, **kwargs):
    o, s = _fake_lightning(q, k, v, decay, **kwargs)
    return o.fill_(float("nan")), s


def _raising(*args, **kwargs):
    raise RuntimeError("boom")


def test_lightning_run_config_with_fakes(cpu_bench, monkeypatch):
    monkeypatch.setattr(lp, "H", 2)
    monkeypatch.setattr(lp, "D", 8)
    monkeypatch.setattr(lp, "decay_rates", lambda device=None: torch.ones(2))
    args = lp.parse_args(["--iters", "3", "--warmup", "1"])
    cfg = lp.Config("varlen", 1, 48, (40, 8), "random")
    row = lp.run_config(cfg, _fake_lightning, _fake_lightning, args, cpu_bench)
    assert row["check"] == "ok" and row["max_rel_err"] == 0.0
    assert row["fla_ms"] > 0 and row["cula_ms"] > 0 and row["speedup"] > 0 and row["rotation_sets"] == 2
    assert row["seq_lens"] == [40, 8] and "errors" not in row

    bad = lp.run_config(cfg, _fake_lightning, _nan_lightning, args, cpu_bench)
    assert bad["check"] == "FAIL" and bad["cula_ms"] is None and bad["speedup"] is None

    raised = lp.run_config(lp.Config("fixed", 1, 16, (16,)), _fake_lightning, _raising, args, cpu_bench)
    assert raised["check"] == "FAIL" and "cula check" in raised["errors"] and raised["fla_ms"] > 0


# ----------------------------------------------------------------------------------------------- training


def _fake_training_step(q, k, v, g, beta, initial_state, A_log=None, dt_bias=None, output_final_state=True, **kwargs):
    """Differentiable in all eight leaves, with kda_prefill's shapes (in six without the fused gate's parameters)."""
    gate = torch.sigmoid(g.float()) if A_log is None else (
        torch.sigmoid(g.float() + dt_bias.view(1, 1, *g.shape[2:])) * A_log.exp().view(1, 1, -1, 1))  # fmt: skip
    o = (v.float() * gate * torch.sigmoid(beta.float())[..., None] + q.float().sum() + k.float().mean()).to(v.dtype)
    return o, initial_state * 2


def test_training_suite_is_prefills_then_research_shapes():
    names = [c.name for c in kt.suite()]
    assert names == list(kt.SUITE) and [c.name for c in kt.suite(quick=True)] == list(kt.QUICK)
    prefill = {c.name: c for c in kp.suite()}
    cfgs = kt.suite()
    assert all(c == prefill[c.name] for c in cfgs[:len(kt.PREFILL_SHAPES)])  # the same lengths and seeds
    research = cfgs[len(kt.PREFILL_SHAPES):]
    assert [(c.B, c.T, c.H, c.HV) for c in research[:3]] == [(8, 4096, 16, 16), (4, 8192, 32, 32), (16, 2048, 32, 32)]
    pack = research[3]
    assert pack.mode == "varlen" and pack.N == 64 and pack.H == 32 and 64 <= min(pack.lens) <= max(pack.lens) <= 4096
    assert pack.lens == kt.research_shapes()[3].lens and pack.T == sum(pack.lens)  # seeded: the same every run
    grads = kt.output_grads(research[0], device="cpu")
    assert grads[0].shape == (8, 4096, 16, kp.V) and grads[1].shape == (8, 16, kp.V, kp.K)


def test_training_kernel_floors():
    """``KERNEL_BYTES``: a kernel's floor by the phase that runs it (cula's intra kernel is the forward's or the
    recompute's), the states per sequence; no floor for kernels it does not model; the markdown tables."""
    cfg = kp.Config("varlen", 1, 300, (100, 200), "random", heads=(4, 4))
    per_us = 1e6 / 1e12  # at 1 TB/s
    intra = "kernel_cutlass_kernel_culaopskdasm90intra_kernelChunkKDAIntraFwdSm90_o"
    fwd, bwd = (kt.kernel_floor_us(phase, intra, cfg, 1) for phase in ("forward", "backward"))
    assert fwd == pytest.approx(2314 * 300 * 4 * per_us) and bwd == pytest.approx(2690 * 300 * 4 * per_us)
    dhu = kt.kernel_floor_us("backward", "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64", cfg, 1)
    assert dhu == pytest.approx((2064 * 300 + 2 * 2 * 4 * kp.K * kp.V) * 4 * per_us)
    assert kt.kernel_floor_us("both", "l2norm_fwd_kernel", cfg, 1) is not None
    fused = kt.kernel_floor_us("backward", "kernel_cutlass_kernel_ChunkKDABwdDhuSm90_object", cfg, 1)
    assert fused == pytest.approx((2440 * 300 + 2 * 2 * 4 * kp.K * kp.V) * 4 * per_us)  # stages 4 and 5
    assert kt.kernel_floor_us("forward", "chunk_kda_bwd_kernel_dAv", cfg, 1) is None
    assert kt.kernel_floor_us("forward", "void at::native::vectorized_elementwise_kernel", cfg, 1) is None
    table = [{"phase": "backward", "kernel": "chunk_kda_bwd_kernel_dAv", "us": 10.0, "launches": 1, "floor_us": 5.0,
              "floor_pct": 50.0},
             {"phase": "forward", "kernel": "fill", "us": 1.0, "launches": 2, "floor_us": None, "floor_pct": None}]
    md = kt.kernel_markdown([{"config": "c", "kernels": {"cula": table}}, {"config": "d"}])
    assert "### c: cula (0.01 ms of kernels)" in md and "| backward | chunk_kda_bwd_kernel_dAv | 10.0 | 1 |" in md
    assert kt.kernel_markdown([{"config": "d"}]) == ""


def test_training_run_config_with_fakes(cpu_bench, monkeypatch):
    for name, value in (("H", 2), ("HV", 2), ("K", 8), ("V", 8)):
        monkeypatch.setattr(kp, name, value)
    args = kt.parse_args(["--iters", "3", "--warmup", "1"])
    cfg = kp.Config("varlen", 1, 48, (40, 8), "random")
    row = kt.run_config(cfg, _fake_training_step, _fake_training_step, args)
    assert row["check"] == "ok" and row["max_rel_err"] == 0.0 and "errors" not in row
    assert row["rel_err"] == dict.fromkeys(["o", "ht", *(f"d{n}" for n in kt.GRAD_LEAVES)], 0.0)
    assert row["fla_ms"] > 0 and row["cula_ms"] > 0 and row["speedup"] > 0 and row["seq_lens"] == [40, 8]
    assert (row["H"], row["HV"]) == (2, 2) and "kernels" not in row
    # the forward / backward split is CUDA-graph time: none on the CPU
    assert row["fla_fwd_graph_ms"] is None and row["cula_bwd_graph_ms"] is None

    def wrong_grads(**kw):  # right outputs, gradients 30% too large: the check must see the gradients too
        o, ht = _fake_training_step(**kw)
        return (o.float() * 1.3 - o.detach().float() * 0.3).to(o.dtype), ht

    bad = kt.run_config(cfg, _fake_training_step, wrong_grads, args)
    assert bad["check"] == "FAIL" and bad["cula_ms"] is None and bad["max_rel_err"] > 0.2 and bad["rel_err"] == {}
    raised = kt.run_config(kp.Config("fixed", 1, 16, (16,)), _fake_training_step, _raising, args)
    assert raised["check"] == "FAIL" and "cula check" in raised["errors"] and raised["fla_ms"] > 0
    # --gate log: no fused gate, so no A_log / dt_bias leaves (they would have no gradients)
    row = kt.run_config(cfg, _fake_training_step, _fake_training_step, args, kp.KDA_LOG)
    assert row["check"] == "ok"
    assert set(row["rel_err"]) == {"o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"}


def test_training_graph_timing_of_packed_kda_steps_uses_graph_mode():
    """The CUDA-graph column captures cula's packed KDA step in FLA's graph mode (max_num_seqs = the config's
    sequence count), whatever the gate; fixed steps, and other workloads' steps, as they are."""
    packed = kp.Config("varlen", 1, 100, (30, 0, 70))
    for work in kp.GATE_WORKLOADS.values():  # every gate's KDA step (--gate log's ran ungraphed once)
        fn = kt._graph_form(packed, work, _fake_training_step)
        assert fn.func is _fake_training_step and fn.keywords == {"use_graph": True, "max_num_seqs": 3}
    assert kt._graph_form(kp.Config("fixed", 2, 64, (64, 64)), kp.KDA, _fake_training_step) is _fake_training_step
    other = kp.Workload(*([None] * 5))
    assert kt._graph_form(packed, other, _fake_training_step) is _fake_training_step


def test_training_also_times_more_stage_sets(cpu_bench, monkeypatch):
    """``--also NAME=FLAGS``: cula's side again under the named stages (the tuning entry changed for that call only),
    FLA timed once; bad flag names are refused by the parser."""
    from cula.kda.plan import KDA_TUNING

    for name, value in (("H", 2), ("HV", 2), ("K", 8), ("V", 8)):
        monkeypatch.setattr(kp, name, value)
    seen, kept = [], []

    def cula_step(disable_recompute=False, **kw):
        seen.append(KDA_TUNING.get((9, 0)).bwd_dv_dhu_lanes)
        kept.append(disable_recompute)
        return _fake_training_step(**kw)

    args = kt.parse_args(["--iters", "2", "--warmup", "1", "--also", "dhu=bwd_dv_dhu",
                          "--also", "kept=disable_recompute"])  # fmt: skip
    assert args.also == [("dhu", ("bwd_dv_dhu",)), ("kept", ("disable_recompute",))]
    row = kt.run_config(kp.Config("fixed", 1, 16, (16,)), _fake_training_step, cula_step, args)
    assert row["also"]["dhu"]["check"] == "ok" and row["also"]["dhu"]["stages"] == ["bwd_dv_dhu"]
    assert row["dhu_ms"] > 0 and row["dhu_speedup"] > 0 and row["cula_ms"] > 0 and row["kept_ms"] > 0
    default = KDA_TUNING.get((9, 0)).bwd_dv_dhu_lanes
    assert set(seen) == {default, (1, 1 << 30)} and default != (1, 1 << 30)
    assert False in kept and True in kept
    for bad in ("gate", "gate=bwd_nothing", "1x=bwd_intra_gate"):
        with pytest.raises(SystemExit):
            kt.parse_args(["--also", bad])
    # --stages: the flags in KdaTuning's order, whatever order they are given in
    assert kt.parse_args(["--stages", "bwd_intra_cumsum, bwd_intra"]).stages == ("bwd_intra", "bwd_intra_cumsum")
    assert kt.parse_args([]).stages == ()
    # the softplus gate without safe_gate, cula's intra and stage-7 kernels on their any_gate variants
    args = kt.parse_args(["--gate", "softplus", "--stages", "intra_any_gate"])
    assert args.gate == "softplus" and args.stages == ("intra_any_gate",) and kt.parse_args([]).gate == "lower_bound"
    for bad in ("", "bwd_nothing", "bwd_intra,disable_recompute"):
        with pytest.raises(SystemExit):
            kt.parse_args(["--stages", bad])


def test_gdn_training_steps_on_the_reference(cpu_bench, monkeypatch):
    """bench_gdn_training's rows on the CPU with cula's Gated DeltaNet (its reference here) on both sides: the
    inputs, flags and eight leaves make a valid training step; the suite and CLI are the KDA training ones."""
    gt = importlib.import_module("bench_gdn_training")
    for name, value in (("H", 2), ("HV", 2), ("K", 8), ("V", 8)):
        monkeypatch.setattr(kp, name, value)
    from cula.gated_delta_rule import chunk_gated_delta_rule

    args = gt.parse_args(["--iters", "2", "--warmup", "1"])
    for cfg in (kp.Config("varlen", 1, 48, (40, 8), "random"), kp.Config("fixed", 2, 16, (16, 16))):
        row = kt.run_config(cfg, chunk_gated_delta_rule, chunk_gated_delta_rule, args, importlib.import_module(
            "bench_gdn_prefill").GDN)  # fmt: skip
        assert row["check"] == "ok" and row["max_rel_err"] == 0.0 and "errors" not in row, row
        assert row["backend"] == "reference"
    assert gt.parse_args(["--quick"]).quick


# ------------------------------------------------------------------------------------------------- decode


def test_decode_suite_order():
    names = [c.name for c in kd.suite()]
    assert names[:7] == [f"decode-N{n}-H64" for n in (1, 8, 32, 64, 128, 256, 512)]
    assert names[7] == "mtp-N64-T4-H64"
    assert names[8:15] == [f"decode-N{n}-H16" for n in (1, 8, 32, 64, 128, 256, 512)]
    assert names[15:] == [f"decode-N{n}-H64-kv" for n in (1, 64, 256)] + ["mtp-N64-T4-H64-kv"]
    assert [c.name for c in kd.suite(quick=True)] == list(kd.QUICK)
    assert all(c.P == 2 * c.N for c in kd.suite())


def test_decode_bytes():
    cfg = kd.Config(8, 1, 64)
    assert kd.state_bytes(cfg) == 2 * 4 * 8 * 64 * 128 * 128
    assert kd.activation_bytes(cfg) == 2 * 8 * (2 * 64 * 128 + 64 * 128 * 3 + 64)
    mtp = kd.Config(64, 4, 16)
    assert kd.state_bytes(mtp) == 2 * 4 * 64 * 64 * 128 * 128  # T does not multiply state traffic
    assert kd.activation_bytes(mtp) == 2 * 64 * 4 * (2 * 16 * 128 + 64 * 128 * 3 + 64)
    assert kd.input_set_bytes(cfg) == 4 * 8 * 64 * 128 * 128 + kd.activation_bytes(cfg)


def test_decode_kv_layout(monkeypatch):
    """kv configs: a [P, HV, K, V] pool and state_v_first=False for both FLA and cula."""
    monkeypatch.setattr(kd, "HV", 4)
    monkeypatch.setattr(kd, "K", 8)
    monkeypatch.setattr(kd, "V", 16)
    cfg = kd.Config(2, 1, 2, kv=True)
    s, shared = kd.make_set(cfg, 0, "cpu"), kd.make_shared(cfg, "cpu")
    assert s["pool"].shape == (4, 4, 8, 16) and shared["state_v_first"] is False
    assert kd.fla_args(s, shared)["state_v_first"] is False
    seen = []
    kd.cula_call(lambda *a: seen.append(a[-1]), s, shared)()
    assert seen == [False]
    assert kd.make_shared(kd.Config(2, 1, 2), "cpu")["state_v_first"] is True


def test_decode_inputs_and_fla_indices(monkeypatch):
    monkeypatch.setattr(kd, "HV", 4)
    monkeypatch.setattr(kd, "K", 8)
    monkeypatch.setattr(kd, "V", 8)
    cfg = kd.Config(5, 3, 2)
    s = kd.make_set(cfg, 0, "cpu")
    assert s["pool"].shape == (10, 4, 8, 8) and s["indices"].dtype == torch.int32
    assert len(set(s["indices"].tolist())) == 5 and max(s["indices"].tolist()) < 10
    assert s["q"].shape == (5, 3, 2, 8) and s["beta"].shape == (5, 3, 4)
    idx2 = kd.fla_indices(s["indices"], 3)
    assert idx2.shape == (5, 3) and idx2.is_contiguous() and (idx2 == s["indices"][:, None]).all()
    assert kd.fla_indices(s["indices"], 1) is s["indices"]
    shared = kd.make_shared(cfg, "cpu")
    assert shared["cu_seqlens"].tolist() == [0, 3, 6, 9, 12, 15]
    a = kd.fla_args(s, shared)
    assert a["q"].shape == (1, 15, 2, 8) and a["beta"].shape == (1, 15, 4)
    assert a["inplace_final_state"] and a["ssm_state_indices"].shape == (5, 3)


def _fake_fla_decode(q, k, v, g, beta, A_log, dt_bias, initial_state, ssm_state_indices, **kwargs):
    idx = ssm_state_indices if ssm_state_indices.ndim == 1 else ssm_state_indices[:, 0]
    initial_state[idx.long()] += 1.0
    return v.clone(), initial_state


def _fake_cula_decode(q, k, v, g, beta, pool, indices, A_log, dt_bias, state_v_first):
    pool[indices.long()] += 1.0
    return v.clone()


def _stray_cula_decode(q, k, v, g, beta, pool, indices, A_log, dt_bias, state_v_first):
    pool += 1.0  # also touches rows it was not given
    return v.clone()


def test_decode_step_form_matches_the_public_call(monkeypatch):
    """The benchmark's kda_decode_step call and its kda_decode call give the same o and pool (reference backend)."""
    monkeypatch.setattr(kd, "HV", 4)
    monkeypatch.setattr(kd, "K", 8)
    monkeypatch.setattr(kd, "V", 8)
    cfg = kd.Config(2, 1, 2)
    s, shared = kd.make_set(cfg, 0, "cpu"), kd.make_shared(cfg, "cpu")
    pool0 = s["pool"].clone()
    with torch.inference_mode():
        o_step = kd.resolve_cula_step()(s, shared)()
        pool_step = s["pool"].clone()
        s["pool"].copy_(pool0)
        o_public = kd.cula_call(kd.resolve_cula()[0], s, shared)()
    torch.testing.assert_close(o_step, o_public, rtol=0, atol=0)
    torch.testing.assert_close(pool_step, s["pool"], rtol=0, atol=0)


def test_decode_run_config_with_fakes(cpu_bench, monkeypatch):
    monkeypatch.setattr(kd, "HV", 4)
    monkeypatch.setattr(kd, "K", 8)
    monkeypatch.setattr(kd, "V", 8)
    args = kd.parse_args(["--iters", "3", "--warmup", "1"])
    monkeypatch.setattr(bc, "measure_host_overhead",
                        lambda fn, **k: (fn(), {"host_us": 1.0, "back_to_back_us": 2.0, "gpu_us": 0.5})[1])
    row = kd.run_config(kd.Config(1, 1, 2), _fake_fla_decode, _fake_cula_decode, args, cpu_bench)
    assert row["check"] == "ok" and row["max_rel_err"] == 0.0, row
    assert row["fla_ms"] > 0 and row["cula_ms"] > 0 and row["bw_fraction"] > 0
    assert row["fla_host_us"] == 2.0 and row["cula_host_us"] == 2.0
    assert set(row["host_overhead_us"]) == {"fla", "cula", "host_yardstick"}
    # with the bound-step form (kda_decode_step) its host overhead joins the meta figures, not the table
    made = []
    step_row = kd.run_config(kd.Config(1, 1, 2), _fake_fla_decode, _fake_cula_decode, args, cpu_bench,
                             step_maker=lambda s, shared: (made.append(s), lambda: None)[1])  # fmt: skip
    assert len(made) == 1 and set(step_row["host_overhead_us"]) == {"fla", "cula", "cula_step", "host_yardstick"}
    assert step_row["cula_host_us"] == 2.0 and "cula_step_host_us" not in step_row

    mtp = kd.run_config(kd.Config(4, 2, 2), _fake_fla_decode, _fake_cula_decode, args, cpu_bench)
    assert mtp["check"] == "ok" and "fla_host_us" not in mtp

    stray = kd.run_config(kd.Config(4, 1, 2), _fake_fla_decode, _stray_cula_decode, args, cpu_bench)
    assert stray["check"] == "FAIL" and stray["cula_ms"] is None

    raised = kd.run_config(kd.Config(4, 1, 2), _raising, _fake_cula_decode, args, cpu_bench)
    assert "fla check" in raised["errors"] and raised["fla_ms"] is None and raised["check"] == "unchecked"


@pytest.mark.parametrize("mod", [lp, kd])
def test_run_suite_budget_and_errors(mod):
    cfgs = mod.suite(quick=True)

    def run_one(cfg):
        if cfg is cfgs[1]:
            raise RuntimeError("broken config")
        return {"config": cfg.name, "check": "ok", "speedup": 1.0}

    rows, skipped = mod.run_suite(cfgs, run_one, None, time.perf_counter())
    assert [r["config"] for r in rows] == [c.name for c in cfgs] and not skipped
    assert rows[1]["check"] == "FAIL" and "broken config" in rows[1]["errors"]["config"]
    # an already spent budget still stops before the first config and reports all as skipped
    rows, skipped = mod.run_suite(cfgs, run_one, 0.0, time.perf_counter() - 1.0)
    assert rows == [] and skipped == [c.name for c in cfgs]
    args = mod.parse_args(["--max-seconds", "75"])
    assert args.max_seconds == 75.0 and args.iters == 20 and args.warmup == 3
    assert mod.result_name(mod.parse_args(["--quick"])).endswith("_subset")


# -------------------------------------------------------------------------------------- lightning decode


def test_lightning_decode_suite_and_cli():
    cfgs = ld.suite()
    assert [c.name for c in cfgs] == [f"decode-N{n}-{lay}" for lay in ("vk", "kv") for n in (1, 64, 256)]
    assert [c.state_v_first for c in cfgs] == [True] * 3 + [False] * 3
    assert all(c.P == 2 * c.N for c in cfgs)
    assert [c.name for c in ld.suite(quick=True)] == list(ld.QUICK)
    args = ld.parse_args([])
    assert (args.iters, args.warmup, args.no_host_overhead, args.l2) == (50, 5, False, "rotate")
    assert ld.result_name(args) == "lightning_decode"
    odd = ld.parse_args(["--cuda-graph", "--l2", "flush", "--configs", "decode-N64-kv,decode-N1-vk"])
    assert ld.result_name(odd) == "lightning_decode_cudagraph_flush_subset"
    assert [c.name for c in bc.select_configs(ld.suite, odd)] == ["decode-N1-vk", "decode-N64-kv"]
    with pytest.raises(SystemExit):
        bc.select_configs(ld.suite, ld.parse_args(["--configs", "decode-N2-vk"]))


def test_lightning_decode_bytes():
    h, d = 64, 128
    for cfg in (ld.Config(64, True), ld.Config(64, False)):  # the layout does not change the traffic
        assert ld.state_bytes(cfg) == 2 * 4 * 64 * h * d * d
        assert ld.activation_bytes(cfg) == 2 * 64 * 4 * h * d  # q, k, v in and o out, bf16
        assert ld.input_set_bytes(cfg) == 4 * 64 * h * d * d + ld.activation_bytes(cfg)


def test_lightning_decode_inputs(monkeypatch):
    decay = ld.decay_rates("cpu")  # the full-size schedule: layer 12 of 24, 64 heads
    torch.testing.assert_close(decay, (8 / 64) * (1 - 12 / 24) * torch.arange(64, dtype=torch.float32))
    monkeypatch.setattr(ld, "H", 2)
    monkeypatch.setattr(ld, "HV", 2)
    monkeypatch.setattr(ld, "D", 8)
    cfg = ld.Config(5, False)
    s = ld.make_set(cfg, 0, "cpu")
    assert s["q"].shape == s["k"].shape == s["v"].shape == (5, 1, 2, 8) and s["q"].dtype == torch.bfloat16
    assert s["pool"].shape == (10, 2, 8, 8) and s["pool"].dtype == torch.float32
    assert s["indices"].dtype == torch.int32 and torch.equal(s["indices"].long(), s["indices_long"])
    assert len(set(s["indices"].tolist())) == 5 and max(s["indices"].tolist()) < 10
    assert torch.equal(ld.make_set(cfg, 0, "cpu")["pool"], s["pool"])  # seeded by config name and set
    assert not torch.equal(ld.make_set(cfg, 1, "cpu")["pool"], s["pool"])
    shared = ld.make_shared(cfg, "cpu")
    assert torch.equal(shared["g_gamma"], -shared["decay"]) and shared["decay"].shape == (2,)


def _fla_simple_gla_step(q, k, v, g_gamma, initial_state, output_final_state, state_v_first, scale=None):
    """FLA's one-token ``fused_recurrent_simple_gla`` in fp32: ``S = exp(g) S + k v^T``, ``o = scale S^T q``.

    Written out here rather than taken from ``cula.simple_gla`` so it checks cula's reference independently.
    """
    assert output_final_state
    s = initial_state.float()
    s = s.transpose(-1, -2) if state_v_first else s  # [N, H, K, V]
    s = g_gamma.exp()[:, None, None] * s + k[:, 0, :, :, None].float() * v[:, 0, :, None, :].float()
    o = torch.einsum("nhk,nhkv->nhv", q[:, 0].float() * q.shape[-1] ** -0.5, s)
    return o[:, None].to(q.dtype), (s.transpose(-1, -2) if state_v_first else s).contiguous()


def _stray_lightning_decode(q, k, v, decay, pool, indices, **kwargs):
    from cula.lightning import lightning_decode

    pool[pool.shape[0] - 1 - indices.long()] += 1.0  # the mirror rows: some of them were not given
    return lightning_decode(q, k, v, decay, pool, indices, **kwargs)


def _nan_lightning_decode(q, k, v, decay, pool, indices, **kwargs):
    from cula.lightning import lightning_decode

    return lightning_decode(q, k, v, decay, pool, indices, **kwargs).fill_(float("nan"))


@pytest.fixture
def small_ld(cpu_bench, monkeypatch):
    """Lightning decode at H = HV = 2, D = 8 on the CPU, with a canned host-overhead measurement."""
    monkeypatch.setattr(ld, "H", 2)
    monkeypatch.setattr(ld, "HV", 2)
    monkeypatch.setattr(ld, "D", 8)
    monkeypatch.setattr(bc, "measure_host_overhead",
                        lambda fn, **k: (fn(), {"host_us": 1.0, "back_to_back_us": 2.0, "gpu_us": 0.5})[1])
    return cpu_bench


ROW_KEYS = {
    "config", "N", "layout", "H", "HV", "P", "fla_ms", "fla_kernel_ms", "cula_ms", "speedup",
    "speedup_vs_kernel", "max_rel_err", "check", "backend", "bw_fraction", "fla_bw_fraction", "floor_ms",
    "floor_pct", "fla_floor_pct", "state_mbytes", "mbytes", "rotation_sets", "fla_p10_ms", "fla_p90_ms",
    "cula_p10_ms", "cula_p90_ms",
}


@pytest.mark.parametrize("state_v_first", [True, False], ids=["vk", "kv"])
def test_lightning_decode_pool_step_matches_cula(small_ld, state_v_first):
    """FLA's gather + kernel + scatter and cula's reference backend agree on ``o`` and the pool."""
    from cula.lightning import lightning_decode

    args = ld.parse_args(["--iters", "3", "--warmup", "1"])
    row = ld.run_config(ld.Config(1, state_v_first), _fla_simple_gla_step, lightning_decode, args, small_ld)
    assert set(row) == ROW_KEYS | {"fla_host_us", "cula_host_us", "host_overhead_us"}, row
    assert row["check"] == "ok" and row["max_rel_err"] < ld.WARN_TOL and row["backend"] == "reference"
    assert row["layout"] == ("vk" if state_v_first else "kv") and row["rotation_sets"] == 2
    for key in ("fla_ms", "fla_kernel_ms", "cula_ms", "speedup", "speedup_vs_kernel", "bw_fraction",
                "fla_bw_fraction", "floor_pct"):
        assert row[key] > 0, key
    assert row["fla_host_us"] == row["cula_host_us"] == 2.0
    assert set(row["host_overhead_us"]) == {"fla", "cula", "host_yardstick"}

    # the pool step really is one: both calls leave the same pool, and only the given rows change
    cfg = ld.Config(4, state_v_first)
    s, shared = ld.make_set(cfg, 0), ld.make_shared(cfg)
    fla_pool, cula_pool = s["pool"].clone(), s["pool"].clone()
    fla_o = ld.fla_call(_fla_simple_gla_step, cfg, s, shared, fla_pool)()
    cula_o = ld.cula_call(lightning_decode, cfg, s, shared, cula_pool)()
    assert ld.check(s, fla_o, fla_pool, cula_o, cula_pool)[1] == "ok"
    changed = (fla_pool != s["pool"]).flatten(1).any(1).nonzero().flatten()
    assert changed.tolist() == sorted(s["indices"].tolist())
    no_host = ld.run_config(cfg, _fla_simple_gla_step, lightning_decode, args, small_ld)
    assert no_host["check"] == "ok" and set(no_host) == ROW_KEYS

    # the bound-step form (lightning_decode_step): the same o and pool as the public call; at N = 1 its host
    # overhead joins the meta figures, not the table
    step_pool = s["pool"].clone()
    s_step = dict(s, pool=step_pool)
    torch.testing.assert_close(ld.cula_step_call(cfg, s_step, shared)(), cula_o, rtol=0, atol=0)
    torch.testing.assert_close(step_pool, cula_pool, rtol=0, atol=0)
    step_row = ld.run_config(ld.Config(1, state_v_first), _fla_simple_gla_step, lightning_decode, args, small_ld,
                             step_call=ld.cula_step_call)  # fmt: skip
    assert set(step_row["host_overhead_us"]) == {"fla", "cula", "cula_step", "host_yardstick"}
    assert "cula_step_host_us" not in step_row


def test_lightning_decode_gate_and_errors(small_ld):
    from cula.lightning import lightning_decode

    args = ld.parse_args(["--iters", "3", "--warmup", "1", "--no-host-overhead"])
    cfg = ld.Config(1, True)
    ok = ld.run_config(cfg, _fla_simple_gla_step, lightning_decode, args, small_ld)
    assert ok["check"] == "ok" and "fla_host_us" not in ok and "host_overhead_us" not in ok

    stray = ld.run_config(ld.Config(64, True), _fla_simple_gla_step, _stray_lightning_decode, args, small_ld)
    assert stray["check"] == "FAIL" and stray["max_rel_err"] == float("inf") and stray["cula_ms"] is None
    assert stray["fla_ms"] > 0 and stray["fla_kernel_ms"] > 0 and stray["speedup"] is None

    nan = ld.run_config(cfg, _fla_simple_gla_step, _nan_lightning_decode, args, small_ld)
    assert nan["check"] == "FAIL" and nan["cula_ms"] is None and "errors" not in nan

    raised = ld.run_config(cfg, _fla_simple_gla_step, _raising, args, small_ld)
    assert raised["check"] == "FAIL" and "cula check" in raised["errors"] and raised["fla_ms"] > 0

    no_fla = ld.run_config(cfg, _raising, lightning_decode, args, small_ld)
    assert no_fla["check"] == "unchecked" and "fla check" in no_fla["errors"]
    assert no_fla["fla_ms"] is None and no_fla["fla_kernel_ms"] is None and no_fla["cula_ms"] > 0


def test_lightning_decode_run_benchmark_writes_rows_and_meta(small_ld, tmp_path):
    import json

    from cula.lightning import lightning_decode

    args = ld.parse_args(["--iters", "2", "--warmup", "1", "--configs", "decode-N1-vk,decode-N64-kv",
                          "--out", str(tmp_path)])
    cfgs = bc.select_configs(ld.suite, args)
    meta, rows, paths = ld.run_benchmark(cfgs, args, time.perf_counter(), _fla_simple_gla_step,
                                         lightning_decode, small_ld)
    assert paths["json"].name == "lightning_decode_subset.json" and paths["md"].exists()
    written = json.loads(paths["json"].read_text())
    assert [r["config"] for r in written["rows"]] == ["decode-N1-vk", "decode-N64-kv"]
    assert all(r["check"] == "ok" and r["backend"] == "reference" for r in written["rows"])
    assert set(written["rows"][1]) == ROW_KEYS | {"wall_s"}
    assert {"shape", "decay", "calls", "fla_path", "cula_check_indices", "bw_fraction", "timing", "tolerance",
            "copy_bw_tbps", "gemm_tflops", "host_overhead_us", "partial", "wall_s"} <= set(written["meta"])
    assert set(written["meta"]["calls"]) == {"cula", "fla", "fla_kernel"}
    assert meta["partial"] is False and set(meta["host_overhead_us"]) == {"decode-N1-vk"}
    assert meta["tolerance"] == {"warn": ld.WARN_TOL, "fail": ld.FAIL_TOL}

    # a spent budget still writes a (partial) result that names every skipped config
    spent = ld.parse_args(["--max-seconds", "0", "--configs", args.configs, "--out", str(tmp_path)])
    meta, rows, _ = ld.run_benchmark(cfgs, spent, time.perf_counter() - 1.0, _fla_simple_gla_step,
                                     lightning_decode, small_ld)
    assert rows == [] and meta["partial"] is True and meta["skipped_configs"] == [c.name for c in cfgs]


@pytest.mark.gpu
def test_lightning_decode_quick_on_gpu(tmp_path):
    meta, rows, paths = ld.main(["--quick", "--iters", "5", "--warmup", "2", "--out", str(tmp_path)])
    assert [r["config"] for r in rows] == list(ld.QUICK)
    for r in rows:
        assert r["check"] in ("ok", "warn") and r["backend"] == "cula-sm90", r
        assert r["fla_ms"] > 0 and r["fla_kernel_ms"] > 0 and r["cula_ms"] > 0 and r["bw_fraction"] > 0
    # main() measures the bound-step form too (cula_step_call), beside the public call and the yardstick
    assert set(meta["host_overhead_us"]["decode-N1-vk"]) == {"fla", "cula", "cula_step", "host_yardstick"}
    assert paths["json"].name == "lightning_decode_subset.json"


def test_gdn_prefill_inputs_run_on_the_reference():
    """bench_gdn_prefill's inputs and flags make a valid Gated DeltaNet call (the CPU reference here)."""
    gp = importlib.import_module("bench_gdn_prefill")
    from cula.gated_delta_rule import chunk_gated_delta_rule

    cfg = kp.Config("fixed", 1, 64, (64,))
    x, shared = gp.make_set(cfg, 0, device="cpu"), gp.make_shared(cfg, device="cpu")
    assert x["g"].shape == (1, 64, kp.HV) and shared["dt_bias"].shape == (kp.HV,)
    o, ht = kp.bind(chunk_gated_delta_rule, x, shared, gp.CALL_FLAGS)()
    assert o.shape == x["v"].shape and ht.shape == x["initial_state"].shape and not o.isnan().any()
    with pytest.raises(SystemExit, match="time-parallel"):
        gp.main(["--time-parallel"])
    # the Qwen-style GVA rows: their own heads in the inputs, names and byte counts, the anchors among them
    gva = kp.Config("fixed", 1, 64, (64,), heads=(2, 4))
    x, shared = gp.make_set(gva, 0, device="cpu"), gp.make_shared(gva, device="cpu")
    assert x["q"].shape[2] == 2 and x["v"].shape[2] == 4 and x["g"].shape == (1, 64, 4)
    assert shared["A_log"].shape == (4,)
    o, ht = kp.bind(chunk_gated_delta_rule, x, shared, gp.CALL_FLAGS)()
    assert o.shape == x["v"].shape and not o.isnan().any()
    assert gva.name == "B1-T64-H2-HV4" and kp.input_set_bytes(gva, 1) < kp.input_set_bytes(cfg, 1)
    names = [c.name for c in gp.suite()]
    assert names[:28] == [c.name for c in kp.suite()] and set(gp.ANCHORS) <= set(names)
    assert set(gp.ANCHORS) <= {c.name for c in gp.suite(quick=True)}


def test_gdn_decode_rows_on_the_reference(cpu_bench, monkeypatch):
    """bench_gdn_decode end to end on the CPU: its FLA-side call (cula's functional recurrent GDN, the reference
    here, with FLA's signature) and its gdn_decode call agree on o and the touched pool rows; the step form's
    host overhead joins the meta figures; the suite and the CLI."""
    gd = importlib.import_module("bench_gdn_decode")
    for name, value in (("H", 2), ("HV", 4), ("K", 16), ("V", 16), ("DEVICE", "cpu")):
        monkeypatch.setattr(gd, name, value)
    monkeypatch.setattr(gd.Config, "H", 2)
    monkeypatch.setattr(bc, "measure_host_overhead",
                        lambda fn, **k: (fn(), {"host_us": 1.0, "back_to_back_us": 2.0, "gpu_us": 0.5})[1])
    from cula.gated_delta_rule import fused_recurrent_gated_delta_rule

    args = gd.parse_args(["--iters", "2", "--warmup", "1"])
    rows = []
    with torch.inference_mode():
        for cfg in (gd.Config(1, 1), gd.Config(3, 2)):
            rows.append(gd.run_config(cfg, fused_recurrent_gated_delta_rule, gd.resolve_cula()[0], args, cpu_bench,
                                      gd.resolve_cula_step()))  # fmt: skip
    for row in rows:
        assert row["check"] == "ok" and row["max_rel_err"] < 1e-5, row
        assert row["HV"] == 4 and row["bw_fraction"] > 0
    assert set(rows[0]["host_overhead_us"]) >= {"fla", "cula", "cula_step"} and "host_overhead_us" not in rows[1]
    assert [c.name for c in gd.suite(quick=True)] == list(gd.QUICK)
    assert gd.parse_args(["--quick"]).quick


def test_kda_time_parallel_cli():
    assert kp.parse_args(["--time-parallel"]).time_parallel and not kp.parse_args([]).time_parallel
    assert kp.parse_args(["--time-parallel", "--halves"]).halves and not kp.parse_args(["--time-parallel"]).halves
    # --split on the main suites: an override cutting at exactly that length (halves too with --halves), named after it
    from cula.kda.plan import KDA_TUNING

    args = kp.parse_args(["--split", "4096", "--halves"])
    assert kp.split_suffix(args) == "_split4096_halves" and kp.split_suffix(kp.parse_args([])) == ""
    with kp.cula_override(args):
        entry = KDA_TUNING.get((9, 0))
        assert entry.time_split.min_segment == 4096 and entry.time_split_halves
    assert KDA_TUNING.get((9, 0)).time_split_halves is False
    # --gate softplus (no safe_gate, no bound) and --any-gate (the intra kernel's any_gate variant for cula's calls)
    args = kp.parse_args(["--gate", "softplus", "--any-gate"])
    assert kp.split_suffix(args) == "_softplus_anygate"
    assert kp.KDA_SOFTPLUS.flags["safe_gate"] is False and kp.KDA_SOFTPLUS.flags["lower_bound"] is None
    # --gate log: a log-space gate (every value <= 0) without the fused gate
    assert not kp.KDA_LOG.flags["use_gate_in_kernel"] and kp.split_suffix(kp.parse_args(["--gate", "log"])) == "_log"
    cfg = kp.suite(quick=True)[0]
    assert (kp.make_set_log(cfg, 0, device="cpu")["g"] <= 0).all()
    assert "A_log" not in kp.make_shared_log(cfg, device="cpu")
    with KDA_TUNING.override((9, 0), intra_any_gate=False):
        with kp.cula_override(args):
            assert KDA_TUNING.get((9, 0)).intra_any_gate
        assert not KDA_TUNING.get((9, 0)).intra_any_gate
    cfg = bc.time_split_suite(quick=True)[0]
    x = kp.tp_inputs(cfg, 0, device="cpu")
    assert x["q"].shape == (1, cfg.T, cfg.H, kp.K) and x["initial_state"].shape == (cfg.N, cfg.H, kp.V, kp.K)
    assert kp.tp_shared(cfg, device="cpu")["dt_bias"].shape == (cfg.H * kp.K,)


def test_time_split_main_runs_every_config_on_the_default_budget(monkeypatch):
    """bench_kda_prefill's --max-seconds defaults to 0, "no limit": the time-split suites (--time-parallel) run every
    config on it (they once skipped them all)."""
    monkeypatch.setattr(bc, "reported_ceilings", lambda name: {"copy_bw_tbps": 1.0, "gemm_tflops": 1.0})
    monkeypatch.setattr(bc, "run_meta", lambda *a, **k: {"timing": {}})
    written = {}
    monkeypatch.setattr(bc, "write_suite", lambda name, args, meta, rows, cols: written.update(rows=rows) or {})
    args = kp.parse_args(["--time-parallel", "--quick"])
    assert args.max_seconds == 0
    cfgs = bc.time_split_suite(quick=True)
    bc.time_split_main("t", args, time.perf_counter(), lambda cfg, a, c: {"config": cfg.name, "check": "ok"}, {},
                       0.01, 0.1)
    assert [r["config"] for r in written["rows"]] == [c.name for c in cfgs]


def test_lightning_time_parallel_suite_and_cli():
    cfgs = lp.tp_suite()
    names = [c.name for c in cfgs]
    assert len(names) == len(set(names))
    assert "H4-B1-T65536" in names and "H4-pack-64K+5x1K" in names
    assert [c.name for c in lp.tp_suite(quick=True)] == list(lp.TP_QUICK)
    pack = next(c for c in cfgs if c.varlen)
    assert pack.T == 65536 + 5 * 1024 and pack.N == 6
    assert lp.parse_args(["--time-parallel"]).time_parallel and not lp.parse_args([]).time_parallel


# ------------------------------------------------------------------------------------------------ long context
lc = importlib.import_module("bench_long_context")


def test_long_context_suite_and_cli():
    cfgs = lc.suite()
    assert len(cfgs) == 36 + 20 and len({c.name for c in cfgs}) == len(cfgs)
    assert {c.H for c in cfgs} == {4, 8, 16, 32} and max(c.T for c in cfgs) == 2 * 131072
    assert [c.name for c in lc.suite(quick=True)] == list(lc.QUICK)
    ragged = next(c for c in cfgs if c.name == "kda-H4-ragged")
    assert ragged.packed and ragged.lens == (65536,) + (1024,) * 5 and ragged.T == 70656
    assert lc.parse_args(["--configs", "kda-H8-B1-T16384"]).configs == "kda-H8-B1-T16384"


def _fake_long(q, k, v, *args, output_final_state=True, initial_state=None, cu_seqlens=None, **kwargs):
    n = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    return v * 2, torch.ones(n, q.shape[2], q.shape[3], v.shape[3])


def test_long_context_rows_with_fakes(cpu_bench, monkeypatch):
    monkeypatch.setattr(lc, "DEVICE", "cpu")
    monkeypatch.setattr(lc, "D", 8)
    monkeypatch.setattr(lc, "segments", lambda cfg: None)
    args = lc.parse_args(["--iters", "3", "--warmup", "1"])
    seen_cp = []

    def fla(**kw):
        import os

        seen_cp.append(os.environ.get("FLA_INTRACARD_CP"))
        return _fake_long(**kw)

    for cfg in (lc.Config("kda", 2, (64, 64), True), lc.Config("lightning", 2, (96,), False)):
        row = lc.run_config(cfg, fla, _fake_long, args, cpu_bench)
        assert row["check"] == "ok" and row["max_rel_err"] == 0.0, row
        assert row["fla_ms"] > 0 and row["cula_ms"] > 0 and row["fla_graph_ms"] is None  # no capture on the CPU
        assert (row["fla_cp_ms"] is not None) == (cfg.op == "kda") and "errors" in row
    assert "1" in seen_cp  # FLA's CP column ran under FLA_INTRACARD_CP=1

    def nan(**kw):
        o, s = _fake_long(**kw)
        return o * float("nan"), s

    bad = lc.run_config(lc.Config("lightning", 2, (96,), False), fla, nan, args, cpu_bench)
    assert bad["check"] == "FAIL" and bad["cula_ms"] is None and bad["speedup"] is None
