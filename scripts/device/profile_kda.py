"""Where a KDA forward spends its GPU time, kernel by kernel (torch.profiler), for FLA and both cula paths.

    device run, carry [".device"]:  bash scripts/device/run.sh python scripts/device/profile_kda.py [--ncu]

Prints, per shape and path, each kernel's summed device time over a few calls, and writes the same as JSON to
$OUT/profile_kda.json. With ``--ncu`` the script re-runs itself under Nsight Compute for one call of cula's two
kernels at B=1, T=4096 (speed of light, occupancy, warp stall reasons) into $OUT/ncu_kda.txt; ncu needs the
Firecracker runtime (device KINDS.md) and is skipped with a message where it cannot read the counters.
``--ncu-source`` records the intra kernel alone with line info and source counters, and writes its per-SASS-
instruction stall samples to $OUT/ncu_intra_source.csv (which instructions, hence which phase, the time goes to).
``--ncu-decode`` profiles the KDA and Lightning decode kernels at N=64 instead ($OUT/ncu_decode.txt).
``--ncu-gdn`` profiles chunk_gated_delta_rule's two kernels at one 8K sequence, 16 q / k and 32 value heads
(``bench_gdn_prefill``'s inputs and flags), once with ``GdnTuning.inference_wy_in_recurrence`` off and once on: speed
of light, occupancy, stall reasons ($OUT/ncu_gdn.txt) and the intra kernel's per-instruction stall samples
($OUT/ncu_gdn_intra_source.csv, the wy variant's).
``--ncu-backward`` profiles FLA's two heaviest backward kernels (``chunk_kda_bwd_kernel_wy_dqkg_fused``, stage 6, and
``chunk_kda_bwd_kernel_intra``, stage 7 of docs/kernels/kda-backward.md) and the dh recurrence beside them in one FLA
training step at B=1, T=4096 ($OUT/ncu_backward.txt), and prints the registers and spills Triton compiled them with.
``--ncu-cula-backward`` does the same for cula's stage 5, 6 and 7 kernels (with the stage-7 and stage-6 kernels'
per-instruction stall samples in $OUT/ncu_bwd_intra_source.csv and $OUT/ncu_bwd_wy_source.csv).
``--training [CONFIG...]`` profiles training steps instead (bench_kda_training's data, flags and output gradients;
default B1-T4096 and B2-T16384): per path (FLA whole; cula with the H200 entry's backward stages and stages 4 and 5
FLA's; that with stages 4 and 5 in cula's one launch) the kernels of the forward and of the backward separately,
into $OUT/profile_kda_training.json: which of FLA's backward stages a backward of our own would replace first. Run
through ``run.sh`` so FLA's backward starts from its cached autotune choices.
``--memory [CONFIG...]`` records one training step of each side (FLA; cula with the H200 entry) with PyTorch's
allocator history (default B1-T4096): the step's peak beyond what was live before it, as the training benchmark's
``*_peak_mib`` measures it, and the allocations live at that peak grouped by the innermost cula / FLA source line
that made them (size, count, and whether the forward or the backward made them), into $OUT/profile_kda_memory.json:
where a side's peak comes from.
``--time-split [H:T:SEGMENT ...]`` profiles chunk_kda cut in time (default 4:16384:8192, 4:65536:4096,
4:65536:2048, 8:65536:8192; ``gdn:H:HV:T:SEGMENT`` profiles chunk_gated_delta_rule instead, one sequence with
``bench_gdn_prefill``'s inputs and flags, e.g. its anchor ``gdn:16:32:32768:8192``): per shape, serial and cut,
each kernel's device time and launches, the benchmarks' host overhead (``measure_host_overhead``: event time, host
time per call with the GPU idle, back-to-back time; a host time near the event time means host-bound or a sync),
and the cut call's heaviest Python frames (cProfile), into $OUT/profile_kda_time_split.json.
``--host`` splits the host time of the benchmarks' two host-bound calls (``bench_kda_prefill``'s repeated B1-T256
``chunk_kda`` and ``bench_kda_decode``'s N=1 ``kda_decode_step``) into a ladder, each rung the one before plus one
layer, timed in interleaved rounds (``measure_host_overheads``): ``torch.empty(1)`` on the device (the host's own
speed), an empty tensor of the output's shape, the compiled entry called directly on buffers made once (TVM-FFI's
argument checks and the kernels' launches), for the decode step the step with ``out=`` (no output allocation), the
public call; and the public call's heaviest Python frames; and the host time of a training step of each side at
B1-T4096 and varlen-N20-T4096 (``bench_kda_training``'s step: where it exceeds the step's GPU time, eager steps
are host-bound). Into $OUT/profile_kda_host.json: what the issue's 10 / 8 us targets leave for Python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from common import bench, kernel_stats, measure_host_overhead  # the benchmarks' helpers live beside their scripts

H = HV = 64
D = 128
SHAPES = [(1, 512), (2, 1024), (1, 4096), (1, 16384), (2, 16384)]
FLAGS = dict(output_final_state=True, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
             use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0, state_v_first=True)


def inputs(B: int, T: int) -> dict:
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    return dict(
        q=torch.randn(B, T, H, D, dtype=bf16, device="cuda"), k=torch.randn(B, T, H, D, dtype=bf16, device="cuda"),
        v=torch.randn(B, T, HV, D, dtype=bf16, device="cuda"), g=torch.randn(B, T, HV, D, dtype=bf16, device="cuda"),
        beta=torch.randn(B, T, HV, dtype=bf16, device="cuda"),
        A_log=torch.randn(HV, device="cuda") * 0.5, dt_bias=torch.randn(HV * D, device="cuda") * 0.5,
        initial_state=0.01 * torch.randn(B, HV, D, D, device="cuda"),
    )


def kernel_times(fn, calls: int = 5) -> dict[str, float]:
    """Summed device microseconds per kernel name, averaged per call."""
    return {k: v[0] for k, v in kernel_stats(fn, calls).items()}


def wall_us(fn) -> float:
    """Median wall time of one call between CUDA events on the caller's stream (the benchmarks' ``bench``):
    kernels on a side stream that the caller's stream waits for are included, where summed kernel times would
    count overlapped ones twice."""
    return round(bench(fn, iters=7, warmup=1).median_ms * 1e3, 1)


def profile_paths() -> None:
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    from cula.backends import clear_plan_caches
    from cula.kda import chunk_kda

    paths = [("fla", None), ("cula-fla-intra", "0"), ("cula-intra", "1")]
    report = {}
    with torch.inference_mode():
        for B, T in SHAPES:
            x = inputs(B, T)
            for path, env in paths:
                if env is not None:
                    os.environ["CULA_KDA_INTRA"] = env
                clear_plan_caches()
                fn = fla_chunk_kda if env is None else chunk_kda
                times = kernel_times(lambda fn=fn, x=x: fn(**x, **FLAGS))
                wall = wall_us(lambda fn=fn, x=x: fn(**x, **FLAGS))
                key = f"B{B}-T{T} {path}"
                report[key] = {"total_us": round(sum(times.values()), 1), "wall_us": wall, "kernels": times}
                print(f"== {key}: {report[key]['total_us']} us of kernels, {wall} us wall", flush=True)
                for name, us in times.items():
                    print(f"   {us:10.1f} us  {name}", flush=True)
            del x
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "profile_kda.json"), "w") as f:
        json.dump(report, f, indent=1)


def profile_training(names: list[str]) -> None:
    """Forward and backward kernels of one training step per path, by kernel name (see the module docstring)."""
    import bench_kda_prefill as kp
    import bench_kda_training as kt
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    from cula.kda import chunk_kda
    from cula.kda.plan import KDA_TUNING

    by_name = {c.name: c for c in kt.suite()}  # its research shapes too
    report = {}
    for name in names or ["B1-T4096", "B2-T16384"]:
        cfg = by_name[name]
        shared, grads = kp.make_shared(cfg), kt.output_grads(cfg)
        tensors = kp.make_set(cfg, 0)
        # the H200 entry's stages; stages 4 and 5 in one launch at every lane count or never
        ours = dict.fromkeys(("bwd_intra", "bwd_intra_cumsum", "bwd_intra_gate", "bwd_intra_l2norm",
                              "bwd_recompute_intra", "bwd_wy_dqkg"), True)  # fmt: skip
        off = dict.fromkeys(ours, False)
        for path, fn, entry in (("fla", fla_chunk_kda, dict(off, bwd_dv_dhu_lanes=None)),
                                ("cula", chunk_kda, dict(ours, bwd_dv_dhu_lanes=None)),
                                ("cula+bwd_dv_dhu", chunk_kda, dict(ours, bwd_dv_dhu_lanes=(1, 1 << 30)))):
            leaves = {n: t.detach().clone().requires_grad_() for n, t in {**tensors, **shared}.items()
                      if n in kt.GRAD_LEAVES}  # fmt: skip
            rest = {n: t for n, t in {**tensors, **shared}.items() if n not in kt.GRAD_LEAVES}

            def forward(fn=fn, leaves=leaves, rest=rest):
                return fn(**leaves, **rest, **kp.CALL_FLAGS)

            # each path with only its own backward stages on cula's kernels, whatever the tuning entry says
            with KDA_TUNING.override((9, 0), **entry):
                outs = forward()  # autotunes / compiles outside the profile
                torch.autograd.backward(outs, grads, retain_graph=True)
                def backward(outs=outs, grads=grads, leaves=leaves):
                    # the same saved graph, backward again (retain_graph), writing the gradients as a step does
                    # (.grad set to None first, as zero_grad: no accumulation adds)
                    for t in leaves.values():
                        t.grad = None
                    torch.autograd.backward(outs, grads, retain_graph=True)

                stages = {"forward": kernel_stats(forward, calls=3), "backward": kernel_stats(backward, calls=3)}
            for stage, stats in stages.items():
                total = round(sum(v[0] for v in stats.values()), 1)
                key = f"{name} {path} {stage}"
                report[key] = {"total_us": total, "kernels": stats}
                print(f"== {key}: {total} us of kernels", flush=True)
                for kernel, (us, launches) in stats.items():
                    print(f"   {us:10.1f} us  x{launches:<5}  {kernel}", flush=True)
            del outs, leaves
        del tensors
    with open(os.path.join(os.environ.get("OUT", "."), "profile_kda_training.json"), "w") as f:
        json.dump(report, f, indent=1)


def _allocation_site(frames: list[dict]) -> str:
    """The innermost frame of an allocation's stack in cula's or FLA's source (else the innermost Python frame)."""
    for f in frames:
        name = f.get("filename", "")
        if "/cula/" in name or "/fla/" in name or "/benchmarks/" in name:
            # the checkout's files relative to its root, installed packages' relative to site-packages
            short = os.path.relpath(name, REPO) if name.startswith(REPO + os.sep) else name.split("/site-packages/")[-1]
            return f"{short}:{f.get('line')} {f.get('name')}"
    py = [f for f in frames if f.get("filename", "").endswith(".py")]
    return f"{py[0]['filename']}:{py[0]['line']} {py[0]['name']}" if py else "?"


def live_at_peak(trace: list[dict], phase_of) -> tuple[int, list[dict]]:
    """Replays an allocator trace (``torch.cuda.memory._snapshot()["device_traces"][i]``): the peak of the bytes
    allocated since the trace began (frees of older blocks count against it) and the blocks live at that peak as
    ``{"size", "site", "phase"}``; ``phase_of(event index)`` names the step's phase an allocation was made in."""
    live, cur, peak, at_peak = {}, 0, 0, {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = dict(size=e["size"], site=_allocation_site(e.get("frames", [])), phase=phase_of(i))
            cur += e["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif e["action"] == "free_completed":
            cur -= e["size"]
            live.pop(e["addr"], None)
    return peak, list(at_peak.values())


def profile_memory(names: list[str]) -> None:
    """Each side's peak in one training step and what is live at it (see the module docstring)."""
    import bench_kda_prefill as kp
    import bench_kda_training as kt
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    from cula.kda import chunk_kda

    by_name = {c.name: c for c in kt.suite()}
    report = {}
    for name in names or ["B1-T4096"]:
        cfg = by_name[name]
        shared, grads = kp.make_shared(cfg), kt.output_grads(cfg)
        tensors = kp.make_set(cfg, 0)
        for path, fn in (("fla", fla_chunk_kda), ("cula", chunk_kda)):
            step = kt.make_step(fn, kt.fresh(tensors), kt.fresh(shared), grads)
            step()  # autotunes / compiles outside the record
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
            try:
                out = step()
                torch.cuda.synchronize()
                snap = torch.cuda.memory._snapshot()
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
            peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
            trace = max(snap["device_traces"], key=len)
            # the backward's first allocation: the first made under an autograd Function's backward
            first_bwd = next((i for i, e in enumerate(trace) if e["action"] == "alloc"
                              and any(f.get("name") == "backward" for f in e.get("frames", []))), len(trace))
            replay_peak, blocks = live_at_peak(trace, lambda i: "forward" if i < first_bwd else "backward")
            sites: dict[tuple[str, str], list[int]] = {}
            for b in blocks:
                sites.setdefault((b["phase"], b["site"]), [0, 0])
                sites[b["phase"], b["site"]][0] += b["size"]
                sites[b["phase"], b["site"]][1] += 1
            rows = sorted(((v[0] / 2**20, v[1], ph, site) for (ph, site), v in sites.items()), reverse=True)
            key = f"{name} {path}"
            report[key] = {"peak_mib": peak_mib, "replayed_peak_mib": replay_peak / 2**20,
                           "live_at_peak": [dict(mib=m, blocks=n, phase=ph, site=site) for m, n, ph, site in rows]}
            print(f"== {key}: peak {peak_mib:.1f} MiB beyond the {base / 2**20:.1f} live before (replayed "
                  f"{replay_peak / 2**20:.1f})", flush=True)
            for m, n, ph, site in rows[:20]:
                print(f"   {m:9.1f} MiB  x{n:<4} {ph:8}  {site}", flush=True)
            del out, step
        del tensors
    with open(os.path.join(os.environ.get("OUT", "."), "profile_kda_memory.json"), "w") as f:
        json.dump(report, f, indent=1)


def python_frames(fn, calls: int = 10, top: int = 15) -> list[str]:
    """The heaviest Python frames of ``calls`` calls by their own time (cProfile), one line each."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return [line for line in text.getvalue().splitlines() if line.strip()][-top:]


def profile_time_split(specs: list[str]) -> None:
    """chunk_kda serial and cut in time, per ``H:T:SEGMENT`` (see the module docstring)."""
    import bench_kda_prefill as kp

    from cula.kda import chunk_kda
    from cula.kda.plan import KDA_TUNING
    from cula.time_split import SplitThresholds

    report = {}
    for spec in specs or ["4:16384:8192", "4:65536:4096", "4:65536:2048", "8:65536:8192"]:
        if spec.startswith("gdn:"):  # chunk_gated_delta_rule, bench_gdn_prefill's inputs and flags
            import bench_gdn_prefill as gp

            from cula.gated_delta_rule import chunk_gated_delta_rule
            from cula.gated_delta_rule.plan import GDN_TUNING

            h, hv, t, seg = (int(x) for x in spec[4:].split(":"))
            cfg = kp.Config("fixed", 1, t, (t,), heads=(h, hv))
            x = {**gp.make_set(cfg, 0), **gp.make_shared(cfg)}
            fn, flags, table = chunk_gated_delta_rule, gp.CALL_FLAGS, GDN_TUNING
        else:
            h, t, seg = (int(x) for x in spec.split(":"))
            cfg = kp.bc.TimeSplitConfig(h, (t,), False)
            x = {**kp.tp_inputs(cfg, 0), **kp.tp_shared(cfg)}
            fn, flags, table = chunk_kda, kp.CALL_FLAGS, KDA_TUNING
        exact = SplitThresholds(items_per_sm=1e9, busy_items_per_sm=1e9, min_segment=seg, min_seq_len=0)
        for path, split in (("serial", None), ("cut", exact)):
            with torch.inference_mode(), table.override(time_split=split):
                def call(x=x, fn=fn, flags=flags):
                    return fn(**x, **flags)

                stats = kernel_stats(call)
                key = f"{spec} {path}"
                host = {k: round(v, 1) for k, v in measure_host_overhead(call, n=20, warmup=3, batches=5).items()}
                report[key] = {"kernels_us": round(sum(v[0] for v in stats.values()), 1), **host, "kernels": stats}
                if path == "cut":
                    report[key]["python"] = python_frames(call)
            r = report[key]
            print(f"== {key}: {r['kernels_us']} us of kernels, {r['gpu_us']} us event time, {r['host_us']} us host "
                  f"(GPU idle), {r['back_to_back_us']} us back to back", flush=True)
            for kernel, (us, launches) in stats.items():
                print(f"   {us:10.1f} us  x{launches:<5}  {kernel}", flush=True)
            for line in r.get("python", []):
                print(f"   {line}", flush=True)
        del x
    with open(os.path.join(os.environ.get("OUT", "."), "profile_kda_time_split.json"), "w") as f:
        json.dump(report, f, indent=1)


def _first_call_entry(module, call):
    """``(fn, args)``: ``call()`` made once with fresh plans (its compiled entry is bound at that first call) while
    ``module.compiled_variant`` (a compiled-variant getter) hands out kernels that note themselves and their
    arguments; ``fn(*args)`` repeats the last launch of that call on the same buffers (``fn`` None where the call
    launched none)."""
    from cula.backends import clear_plan_caches

    real, seen = module.compiled_variant, {}

    def getter(*args, **kwargs):
        fn = real(*args, **kwargs)

        def noted(*a):
            seen["fn"], seen["args"] = fn, a
            return fn(*a)

        return noted

    module.compiled_variant = getter
    try:
        clear_plan_caches()
        call()
        torch.cuda.synchronize()
    finally:
        module.compiled_variant = real
    return seen.get("fn"), seen.get("args")


def profile_host() -> None:
    """The host-time ladders of a repeated chunk_kda and a decode step (see the module docstring)."""
    import bench_kda_decode as kd
    import bench_kda_prefill as kp
    from common import measure_host_overheads

    from cula.kda import chunk_kda, kda_decode_step
    from cula.ops.kda.sm90 import decode, fwd_launch

    report = {}
    with torch.inference_mode():
        # chunk_kda, B1-T256 H64 with the prefill suite's flags, as bench_kda_prefill's host_overhead_us
        cfg = kp.Config("fixed", 1, kp.HOST_OVERHEAD_T, (kp.HOST_OVERHEAD_T,))
        x, shared = kp.make_set(cfg, 0), kp.make_shared(cfg)
        public = kp.bind(chunk_kda, x, shared)
        fn, args = _first_call_entry(fwd_launch, public)
        o_shape = x["v"].shape
        calls = {
            "empty_1": lambda: lambda: torch.empty(1, device="cuda"),
            "empty_o": lambda: lambda: torch.empty(o_shape, dtype=torch.bfloat16, device="cuda"),
        }
        if fn is not None:
            calls["entry"] = lambda: lambda: fn(*args)
        calls["public"] = lambda: public
        report["chunk_kda"] = measure_host_overheads(calls)
        report["chunk_kda"]["python"] = python_frames(public, calls=2000)
        del x, shared

        # kda_decode_step, N=1 H64 with the decode suite's flags, as bench_kda_decode's cula_step
        dcfg = next(c for c in kd.suite() if c.name == "decode-N1-H64")
        s, dshared = kd.make_set(dcfg, 0), kd.make_shared(dcfg)
        step = kd.resolve_cula_step()(s, dshared)
        fn, args = _first_call_entry(decode, step)
        out = torch.empty_like(s["v"])
        step_fn = kda_decode_step(s["pool"], s["indices"], A_log=dshared["A_log"], dt_bias=dshared["dt_bias"],
                                  scale=None, check_indices=False,
                                  **dict(kd.CALL_FLAGS, state_v_first=dshared["state_v_first"]))  # fmt: skip
        calls = {
            "empty_1": lambda: lambda: torch.empty(1, device="cuda"),
            "empty_o": lambda: lambda: torch.empty_like(s["v"]),
        }
        if fn is not None:
            calls["entry"] = lambda: lambda: fn(*args)
        calls["step_out"] = lambda: lambda: step_fn(s["q"], s["k"], s["v"], s["g"], s["beta"], out=out)
        calls["step"] = lambda: step
        report["decode_step"] = measure_host_overheads(calls)
        report["decode_step"]["python"] = python_frames(step, calls=2000)

    # training steps (autograd on): host time with the GPU idle against the step's GPU time, each side
    import bench_kda_training as kt
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    by_name = {c.name: c for c in kt.suite()}
    for name in ("B1-T4096", "varlen-N20-T4096-uniform"):
        cfg = by_name[name]
        tensors, tshared, grads = kp.make_set(cfg, 0), kp.make_shared(cfg), kt.output_grads(cfg)
        sides = {"fla": fla_chunk_kda, "cula": chunk_kda}
        calls = {side: (lambda fn=fn: kt.make_step(fn, kt.fresh(tensors), tshared, grads))
                 for side, fn in sides.items()}  # fmt: skip
        report[f"training {name}"] = measure_host_overheads(calls)
        report[f"training {name}"]["python"] = python_frames(calls["cula"](), calls=20)
    for name, rungs in report.items():
        print(f"== {name}", flush=True)
        for rung, r in rungs.items():
            if isinstance(r, dict):
                print(f"   {rung:10s} host {r['host_us']:7.2f} us, back to back {r['back_to_back_us']:7.2f} us, "
                      f"event {r['gpu_us']:7.2f} us", flush=True)
        for line in rungs.get("python", []):
            print(f"   {line}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "profile_kda_host.json"), "w") as f:
        json.dump(report, f, indent=1)


def ncu_target() -> None:
    """Two cula calls with cula's intra kernel at B=1, T=4096 (the second is the one ncu keeps)."""
    from cula.kda import chunk_kda

    os.environ["CULA_KDA_INTRA"] = "1"
    x = inputs(1, 4096)
    with torch.inference_mode():
        for _ in range(2):
            chunk_kda(**x, **FLAGS)
    torch.cuda.synchronize()


def ncu_gdn_target() -> None:
    """Two chunk_gated_delta_rule calls at T=8192, 16 q / k heads, 32 value heads (the second is the one ncu keeps),
    with the wy_in_recurrence variants where ``CULA_PROFILE_WY=1``."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import bench_gdn_prefill as gp
    import bench_kda_prefill as kp

    from cula.gated_delta_rule import chunk_gated_delta_rule
    from cula.gated_delta_rule.plan import GDN_TUNING

    cfg = kp.Config("fixed", 1, 8192, (8192,), heads=(16, 32))
    x = {**gp.make_set(cfg, 0), **gp.make_shared(cfg)}
    wy = os.environ.get("CULA_PROFILE_WY") == "1"
    with torch.inference_mode(), GDN_TUNING.override(time_split=None, inference_wy_in_recurrence=wy):
        for _ in range(2):
            chunk_gated_delta_rule(**x, **gp.CALL_FLAGS)
    torch.cuda.synchronize()


def decode_inputs(N: int = 64, P: int = 128) -> dict:
    """One T=1 decode step's inputs at HV=64, K=V=128: q, k, v, g, beta, a fp32 pool of P states, N random pool
    rows, A_log and Lightning's decay."""
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(N, 1, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    return dict(
        q=q, k=k, v=v, g=g, beta=torch.randn(N, 1, H, device="cuda"),
        pool=torch.randn(P, H, D, D, device="cuda") * 0.01,
        idx=torch.randperm(P, device="cuda")[:N].to(torch.int32),
        A_log=torch.randn(H, device="cuda"), decay=torch.rand(H, device="cuda"),
    )  # fmt: skip


def ncu_decode_target() -> None:
    """Two kda_decode and two lightning_decode steps at N=64, HV=64, K=V=128 over a V-first fp32 pool."""
    from cula.kda import kda_decode
    from cula.lightning import lightning_decode

    x = decode_inputs()
    q, k, v, pool, idx = x["q"], x["k"], x["v"], x["pool"], x["idx"]
    for _ in range(2):
        kda_decode(q, k, v, x["g"], x["beta"], pool, idx, A_log=x["A_log"], lower_bound=-5.0, check_indices=False)
    for _ in range(2):
        lightning_decode(q, k, v, x["decay"], pool, idx, check_indices=False)
    torch.cuda.synchronize()


def ncu_backward_target() -> None:
    """Two FLA training steps at B=1, T=4096 (bench_kda_training's data; ncu keeps the second backward), then the
    registers and spills of the backward's Triton kernels as compiled."""
    import bench_kda_prefill as kp
    import bench_kda_training as kt
    from fla.ops.kda import chunk_bwd, chunk_intra
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    cfg = {c.name: c for c in kp.suite()}["B1-T4096"]
    shared, grads, tensors = kp.make_shared(cfg), kt.output_grads(cfg), kp.make_set(cfg, 0)
    for _ in range(2):
        kt.make_step(fla_chunk_kda, kt.fresh(tensors), kt.fresh(shared), grads)()
    torch.cuda.synchronize()
    from cula.kda.fla_backward import _triton_fn

    for kernel in (chunk_bwd.chunk_kda_bwd_kernel_wy_dqkg_fused, chunk_intra.chunk_kda_bwd_kernel_intra):
        fn = _triton_fn(kernel)
        for caches in getattr(fn, "device_caches", {}).values():
            for compiled in caches[0].values():
                print(f"[compiled] {fn.__name__}: {getattr(compiled, 'n_regs', '?')} registers, "
                      f"{getattr(compiled, 'n_spills', '?')} spilled, "
                      f"{compiled.metadata.num_warps} warps, {compiled.metadata.shared} B shared", flush=True)


def run_ncu_backward() -> None:
    """Occupancy, memory throughput and stall reasons of FLA's stage 6 and 7 kernels (and the dh recurrence)."""
    out = os.environ.get("OUT", ".")
    text = _ncu(["ncu", "--clock-control", "none", "-k",
                 "regex:wy_dqkg_fused|chunk_kda_bwd_kernel_intra|bwd_kernel_dhu",
                 "--launch-skip", "3", "--launch-count", "3", "--section", "SpeedOfLight", "--section", "Occupancy",
                 "--section", "LaunchStats", "--section", "WarpStateStats", "--section", "SchedulerStats",
                 "--section", "MemoryWorkloadAnalysis", "--section", "MemoryWorkloadAnalysis_Tables", sys.executable,
                 __file__, "--ncu-backward-target"], timeout=400)  # fmt: skip
    with open(os.path.join(out, "ncu_backward.txt"), "w") as f:
        f.write(text)
    print(text[-12000:])


def ncu_cula_backward_target() -> None:
    """Two cula training steps at B=1, T=4096 with stages 5, 6 and 7 on cula's kernels (ncu keeps the second)."""
    import bench_kda_prefill as kp
    import bench_kda_training as kt

    from cula.kda import chunk_kda
    from cula.kda.plan import KDA_TUNING

    cfg = {c.name: c for c in kp.suite()}["B1-T4096"]
    shared, grads, tensors = kp.make_shared(cfg), kt.output_grads(cfg), kp.make_set(cfg, 0)
    with KDA_TUNING.override((9, 0), bwd_intra=True, bwd_intra_cumsum=True, bwd_intra_gate=True, bwd_intra_l2norm=True,
                             bwd_dv_dhu_lanes=(1, 1 << 30), bwd_wy_dqkg=True):  # fmt: skip
        for _ in range(2):
            kt.make_step(chunk_kda, kt.fresh(tensors), kt.fresh(shared), grads)()
    torch.cuda.synchronize()


def run_ncu_cula_backward() -> None:
    """Occupancy, memory throughput and stall reasons of cula's stage 5, 6 and 7 kernels, and the stage-7 and
    stage-6 kernels' per-instruction stall samples (the second step's launches) as CSV."""
    out = os.environ.get("OUT", ".")
    rep = os.path.join(out, "ncu_cula_bwd")
    env = dict(os.environ, CUTE_DSL_LINEINFO="1")
    # the three kernels launch once a step, in the order 4+5, 6, 7: the second step's three
    log = _ncu(["ncu", "--clock-control", "none", "-k", "regex:BwdIntraSm90|BwdDhuSm90|BwdWyDqkgSm90",
                "--launch-skip", "3", "--launch-count", "3", "--import-source", "yes", "--section", "SpeedOfLight",
                "--section", "Occupancy", "--section", "LaunchStats", "--section", "WarpStateStats",
                "--section", "SchedulerStats",
                "--section", "MemoryWorkloadAnalysis", "--section", "SourceCounters", "-f", "-o", rep,
                sys.executable, __file__, "--ncu-cula-backward-target"], timeout=400, env=env)  # fmt: skip
    details = _ncu(["ncu", "-i", rep + ".ncu-rep", "--print-details", "all"])
    with open(os.path.join(out, "ncu_cula_bwd.txt"), "w") as f:
        f.write(log + details)
    for kernel, name in (("BwdIntraSm90", "ncu_bwd_intra_source.csv"), ("BwdWyDqkgSm90", "ncu_bwd_wy_source.csv")):
        with open(os.path.join(out, name), "w") as f:
            f.write(_ncu(["ncu", "-i", rep + ".ncu-rep", "--page", "source", "--csv", "--print-source", "sass",
                          "-k", f"regex:{kernel}"]))  # fmt: skip
    print(log[-2000:])
    print(details[-9000:])


def run_ncu_decode() -> None:
    """Why the decode kernels stop at ~85% of copy bandwidth: memory workload and stall reasons at N=64."""
    out = os.environ.get("OUT", ".")
    text = _ncu(["ncu", "--clock-control", "none", "-k", "regex:DecodeSm90", "--launch-count", "4", "--section",
                 "SpeedOfLight", "--section", "MemoryWorkloadAnalysis", "--section", "MemoryWorkloadAnalysis_Tables",
                 "--section", "Occupancy", "--section", "LaunchStats", "--section", "WarpStateStats", "--section",
                 "SchedulerStats", sys.executable, __file__, "--ncu-decode-target"])  # fmt: skip
    with open(os.path.join(out, "ncu_decode.txt"), "w") as f:
        f.write(text)
    print(text[-6000:])


def run_ncu_gdn() -> None:
    """Gated DeltaNet's intra and state/output kernels with wy_in_recurrence off, then on (the second call's)."""
    out = os.environ.get("OUT", ".")
    sections = ["--section", "SpeedOfLight", "--section", "Occupancy", "--section", "LaunchStats", "--section",
                "WarpStateStats", "--section", "SchedulerStats", "--section", "MemoryWorkloadAnalysis"]
    text = ""
    for wy in ("0", "1"):
        env = dict(os.environ, CULA_PROFILE_WY=wy, CUTE_DSL_LINEINFO="1")
        rep = os.path.join(out, f"ncu_gdn_{wy}")
        text += f"##### wy_in_recurrence={wy}\n" + _ncu(
            ["ncu", "--clock-control", "none", "-k", "regex:ChunkKDAIntra|DeltaHFwdO", "--launch-skip", "2",
             "--launch-count", "2", "--import-source", "yes", *sections, "--section", "SourceCounters", "-f", "-o",
             rep, sys.executable, __file__, "--ncu-gdn-target"], env=env)  # fmt: skip
        text += _ncu(["ncu", "-i", rep + ".ncu-rep", "--print-details", "all"])
    with open(os.path.join(out, "ncu_gdn.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "ncu_gdn_intra_source.csv"), "w") as f:
        f.write(_ncu(["ncu", "-i", os.path.join(out, "ncu_gdn_1.ncu-rep"), "--page", "source", "--csv",
                      "--print-source", "sass", "-k", "regex:ChunkKDAIntra"]))  # fmt: skip
    for wy in ("0", "1"):
        try:
            os.remove(os.path.join(out, f"ncu_gdn_{wy}.ncu-rep"))
        except OSError:
            pass
    print(text[-9000:])


def _ncu(cmd: list[str], timeout: float = 240, env: dict | None = None) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        return res.stdout + res.stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"ncu did not run: {exc!r}"


def run_ncu() -> None:
    out = os.environ.get("OUT", ".")
    text = _ncu(["ncu", "--clock-control", "none", "-k", "regex:ChunkKDAIntra|DeltaHFwdO", "--launch-skip", "2",
                 "--launch-count", "2", "--section", "SpeedOfLight", "--section", "Occupancy", "--section",
                 "LaunchStats", "--section", "WarpStateStats", "--section", "SchedulerStats", "--section",
                 "MemoryWorkloadAnalysis", sys.executable, __file__, "--ncu-target"])
    with open(os.path.join(out, "ncu_kda.txt"), "w") as f:
        f.write(text)
    print(text[-6000:])


def run_ncu_source() -> None:
    """Per-instruction stall samples of the intra kernel (second launch), as CSV."""
    out = os.environ.get("OUT", ".")
    rep = os.path.join(out, "ncu_intra")
    env = dict(os.environ, CUTE_DSL_LINEINFO="1")
    log = _ncu(["ncu", "--clock-control", "none", "-k", "regex:ChunkKDAIntra", "--launch-skip", "1",
                "--launch-count", "1", "--import-source", "yes", "--section", "SourceCounters", "--section",
                "WarpStateStats", "-f", "-o", rep, sys.executable, __file__, "--ncu-target"], env=env)
    csv = _ncu(["ncu", "-i", rep + ".ncu-rep", "--page", "source", "--csv", "--print-source", "sass"])
    with open(os.path.join(out, "ncu_intra_source.csv"), "w") as f:
        f.write(csv)
    print(log[-3000:])
    print(csv[:3000])


if __name__ == "__main__":
    if "--ncu-target" in sys.argv:
        ncu_target()
    elif "--ncu-gdn-target" in sys.argv:
        ncu_gdn_target()
    elif "--ncu-gdn" in sys.argv:
        run_ncu_gdn()
    elif "--ncu-decode-target" in sys.argv:
        ncu_decode_target()
    elif "--ncu-backward-target" in sys.argv:
        os.environ.setdefault("FLA_FLASH_KDA", "0")
        os.environ.setdefault("FLA_CULA", "0")
        ncu_backward_target()
    elif "--ncu-cula-backward-target" in sys.argv:
        os.environ.setdefault("FLA_FLASH_KDA", "0")
        os.environ.setdefault("FLA_CULA", "0")
        ncu_cula_backward_target()
    elif "--ncu-cula-backward" in sys.argv:
        run_ncu_cula_backward()
    elif "--ncu-backward" in sys.argv:
        run_ncu_backward()
    elif "--ncu-decode" in sys.argv:
        run_ncu_decode()
    elif "--host" in sys.argv:
        os.environ.setdefault("FLA_FLASH_KDA", "0")
        os.environ.setdefault("FLA_CULA", "0")
        profile_host()
    elif "--time-split" in sys.argv:
        os.environ.setdefault("FLA_FLASH_KDA", "0")
        os.environ.setdefault("FLA_CULA", "0")
        profile_time_split(sys.argv[sys.argv.index("--time-split") + 1:])
    elif "--memory" in sys.argv:
        os.environ.setdefault("FLA_FLASH_KDA", "0")
        os.environ.setdefault("FLA_CULA", "0")
        profile_memory(sys.argv[sys.argv.index("--memory") + 1:])
    elif "--training" in sys.argv:
        os.environ.setdefault("FLA_FLASH_KDA", "0")
        os.environ.setdefault("FLA_CULA", "0")
        profile_training(sys.argv[sys.argv.index("--training") + 1:])
    else:
        if "--ncu" in sys.argv:
            run_ncu()
        if "--ncu-source" in sys.argv:
            run_ncu_source()
        else:
            profile_paths()
