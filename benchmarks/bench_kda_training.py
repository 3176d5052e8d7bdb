"""KDA training step: FLA 0.6.0 ``fla.ops.kda.chunk_kda`` forward + backward against ``cula.kda.chunk_kda``'s.

cula's training path is our forward kernels with FLA's backward (``cula.kda.backends._ChunkKDATraining``: only the
inputs are kept, and the backward recomputes what FLA's forward saves with FLA's own stages), so the comparison is
the whole step on the same inputs and output gradients.

Suite (11 configs, kda_prefill's flags, K = V = 128): kda_prefill's shapes at H = HV = 64, fixed B x T in
{1 x 4096, 2 x 4096, 1 x 16384, 2 x 16384}, varlen ``N10-T8192-random``, ``N20-T4096-uniform``,
``N20-T16384-skewed``; then research training shapes (``research_shapes``): B8-T4096 at H = 16, B4-T8192 and
B16-T2048 at H = 32, and a pack of 64 sequences of 64 to 4096 tokens at H = 32. FLA autotunes its backward kernels
on the first call of each shape key (minutes on a fresh machine), which the check call before timing absorbs; run
through ``scripts/device/run.sh`` to start from the cached choices.

Each timed call runs ``o, ht = chunk_kda(...)`` and ``torch.autograd.backward((o, ht), (do, dht))`` with fixed
random output gradients, on leaves that require grad (q, k, v, g, beta, A_log, dt_bias, initial_state) whose
``.grad`` is set to None first, as ``optimizer.zero_grad()`` does by default: a step writes its gradients rather
than adding them to the last call's (which cost both sides alike ~1.5 ms at B = 2, T = 16384). Each side is timed
eagerly (``fla_ms``, ``cula_ms``) and as the replay of a CUDA graph of the whole step (``fla_graph_ms``,
``cula_graph_ms``: GPU time without the host's launch overhead, which an eager step of FLA's many Triton launches
partly waits on; packed configs capture cula's step in FLA's graph mode, ``use_graph=True``, as cula's packed
backward needs); the forward alone is replayed too (``*_fwd_graph_ms``: the training forward, which keeps what the
backward needs), and the backward is the step less it (``*_bwd_graph_ms``). Before timing, one step of each is
compared: the largest relative RMSE over o, the final state and the eight input gradients against FLA's (warn above
2e-2, FLA's own tolerance for dg / dbeta, FAIL and untimed above 0.1 or on NaN). After timing, one more step of each
measures its peak memory beyond what was live before it (``fla_peak_mib``, ``cula_peak_mib``: activations kept for
the backward, the backward's workspace, the gradients), and one more forward what it keeps for the backward
(``fla_saved_mib``, ``cula_saved_mib``: on inputs made inside the measured call, as a layer's are, the memory live
after the forward beyond its outputs o and the final state: what each layer of a model holds until its backward,
inputs it keeps included). With ``--kernels`` one more step of each side is profiled
(torch.profiler), its forward and backward apart: every kernel's device time, launches and, where ``KERNEL_BYTES``
has a byte model for it, its percent of its byte floor (in the JSON rows and a table per config in the markdown).

Usage: ``python benchmarks/bench_kda_training.py [--quick] [--iters N] [--out DIR] [--kernels]
[--stages FLAG[,FLAG...]] [--also NAME=FLAG[,FLAG...] ...]``: ``--stages`` runs cula's side with these backward
stages on whatever the tuning entry says (``KdaTuning`` flag names, ``bwd_dv_dhu`` for stages 4 and 5 in one launch
at every lane count; results named after them); ``--also`` times cula's side again with more stages on, in the same
process (FLA timed once per config), e.g. ``--also gate=bwd_intra_gate --also all=bwd_intra_gate,bwd_intra_l2norm``;
``disable_recompute`` among the flags calls cula's side with that argument (peak memory beside the time).
``--gate softplus`` / ``--gate log``: the fused softplus gate / a log-space gate without ``safe_gate`` (no bound
known), on both sides; with ``intra_any_gate`` among the stages cula's intra and stage-7 kernels take it in their
any_gate variants (results named ``kda_training_softplus_...``, ``kda_training_log_...``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable
from typing import Any

import bench_kda_prefill as kp
import common as bc
import torch

NAME = "kda_training"
WARN_TOL = 2e-2  # FLA's tolerance for its gate and beta gradients (its tests' ratios for dq / dk / dv are smaller)
FAIL_TOL = 1e-1
PREFILL_SHAPES = ("B1-T4096", "B2-T4096", "B1-T16384", "B2-T16384", "varlen-N10-T8192-random",
                  "varlen-N20-T4096-uniform", "varlen-N20-T16384-skewed")  # fmt: skip
QUICK = ("B1-T4096", "varlen-N20-T4096-uniform")


def research_shapes() -> tuple[kp.Config, ...]:
    """What research training runs use (H = HV per row): B=8 T=4096 H=16, B=4 T=8192 H=32, B=16 T=2048 H=32, and a
    pack of 64 sequences of 64 to 4096 tokens (uniform, seeded) with H=32."""
    fixed = tuple(kp.Config("fixed", b, t, (t,) * b, heads=(h, h)) for b, t, h in ((8, 4096, 16), (4, 8192, 32),
                                                                                   (16, 2048, 32)))  # fmt: skip
    gen = torch.Generator().manual_seed(bc.config_seed("pack-64-of-64-4096"))
    lens = tuple(torch.randint(64, 4097, (64,), generator=gen).tolist())
    return (*fixed, kp.Config("varlen", 1, sum(lens), lens, "span64-4096", heads=(32, 32)))


SUITE = PREFILL_SHAPES + tuple(c.name for c in research_shapes())
GRAD_LEAVES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
MD_COLUMNS = ("config", "B", "T", "N", "H", "dist", "fla_ms", "cula_ms", "speedup", "fla_graph_ms", "cula_graph_ms",
              "graph_speedup", "fla_fwd_graph_ms", "fla_bwd_graph_ms", "cula_fwd_graph_ms", "cula_bwd_graph_ms",
              "fla_peak_mib", "cula_peak_mib", "fla_saved_mib", "cula_saved_mib", "max_rel_err", "check",
              "backend")  # fmt: skip

run_suite = functools.partial(bc.run_suite, name=NAME)


def suite(quick: bool = False) -> list[kp.Config]:
    """The training suite: kda_prefill's configs of ``PREFILL_SHAPES`` (same lengths, seeds and data, H = HV = 64),
    then ``research_shapes()``."""
    names = QUICK if quick else SUITE
    by_name = {c.name: c for c in (*kp.suite(), *research_shapes())}
    return [by_name[n] for n in names]


def _leaves(tensors: dict, shared: dict) -> tuple[dict, dict]:
    """``(leaves, rest)``: an input set's tensors that get gradients (made to require them) and the others."""
    leaves = {n: t.requires_grad_() for n, t in {**tensors, **shared}.items() if n in GRAD_LEAVES}
    return leaves, {n: t for n, t in {**tensors, **shared}.items() if n not in GRAD_LEAVES}


def make_forward(fn: Callable, tensors: dict, shared: dict, flags: dict | None = None):
    """Zero-argument training forward of ``fn`` on one input set (leaves requiring grad: the forward keeps what the
    backward needs), the step's first part."""
    leaves, rest = _leaves(tensors, shared)
    flags = kp.CALL_FLAGS if flags is None else flags
    return lambda: fn(**leaves, **rest, **flags)


def make_step(fn: Callable, tensors: dict, shared: dict, grads: tuple[torch.Tensor, torch.Tensor],
              flags: dict | None = None):  # fmt: skip
    """Zero-argument training step of ``fn`` on one input set (with ``flags``, KDA's by default); returns the
    leaves' gradients as a dict."""
    leaves, rest = _leaves(tensors, shared)
    flags = kp.CALL_FLAGS if flags is None else flags

    def step():
        for t in leaves.values():
            t.grad = None
        o, ht = fn(**leaves, **rest, **flags)
        torch.autograd.backward((o, ht), grads)
        return o.detach(), ht.detach(), {n: t.grad for n, t in leaves.items()}

    return step


# The bytes each kernel of a training step must move, per token and value head (H = HV, K = V = 128, 64-token chunks,
# FLA's dtypes), and the fp32 K x V states it reads or writes per sequence and value head: by the step's phase that
# runs it ("both": either) and a piece of its name. From docs/kernels/kda-backward.md ("Floors and where the time
# goes": FLA's stages G0, 1-9 and G1), kda-intra.md and kda-state-output.md ("Floors"); a kernel not listed has no
# floor in the table (FLA's forward kernels, PyTorch's).
KERNEL_BYTES = (
    # cula's forward: the intra kernel (q, k, v, bf16 g, beta in; w, u, qg, kg, Aqk, the chunks' last g_cum rows and,
    # for the backward, Akk out), the state / output kernel (w, u, qg, kg, Aqk, a g row a chunk in; o out)
    ("forward", "ChunkKDAIntraFwdSm90", 2314, 0),
    ("forward", "DeltaHFwdOFusedSm90", 1416, 2),
    # ... writing every chunk's bf16 state and v_new beside o for the backward (disable_recompute)
    ("forward", "DeltaHFwdOStatesSm90", 2184, 2),
    # the backward's recompute prefix on cula's intra kernel, from the forward's Akk (q, k, v, g, beta, Akk in; w, u,
    # qg, kg and every g_cum row out)
    ("backward", "ChunkKDAIntraFwdSm90", 2690, 0),  # (+8 B of 1 / norms with bwd_norm_on_load)
    ("both", "l2norm_fwd_kernel", 1038, 0),  # G0: q and k (both launches)
    ("both", "fused_beta_sigmoid_fwd_kernel", 6, 0),
    ("both", "kda_gate_chunk_cumsum_vector_kernel", 768, 0),  # 1
    ("both", "recompute_w_u_fwd_kda_kernel", 2436, 0),  # 2
    ("both", "chunk_gated_delta_rule_fwd_kernel_h", 1548, 1),  # 3
    ("backward", "DeltaHStatesSm90", 1544, 1),  # 3 on cula's kernel: w, u, kg and a g row a chunk in; h, v_new out
    ("backward", "chunk_kda_bwd_kernel_dAv", 1152, 0),  # 4
    ("backward", "chunk_gated_delta_rule_bwd_kernel_dhu", 2064, 2),  # 5
    # 4 and 5 in one launch of cula's kernel: qg, kg, w, do, v_new, Aqk and the g rows in, dh, dv2 and dAqk out
    ("backward", "ChunkKDABwdDhuSm90", 2440, 2),
    ("backward", "chunk_kda_bwd_kernel_wy_dqkg_fused", 5256, 0),  # 6
    ("backward", "ChunkKDABwdWyDqkgSm90", 5256, 0),
    ("backward", "chunk_kda_bwd_kernel_intra", 4628, 0),  # 7
    ("backward", "ChunkKDABwdIntraSm90", 3600, 0),  # 7 with 8, 9 and G1 on chip, as the H200 entry runs it
    ("backward", "chunk_local_cumsum_vector_kernel", 1024, 0),  # 8
    ("backward", "kda_gate_bwd_kernel", 1056, 0),  # 9
    ("backward", "l2norm_bwd_kernel", 2064, 0),  # G1: q and k (both launches)
    ("backward", "fused_beta_sigmoid_bwd_kernel", 8, 0),
)


def kernel_floor_us(phase: str, kernel: str, cfg: kp.Config, copy_bw_tbps: float) -> float | None:
    """A kernel's byte floor in a step of ``cfg`` (``KERNEL_BYTES`` at the copy rate), None where it has none."""
    for where, piece, per_token, states in KERNEL_BYTES:
        if where in (phase, "both") and piece in kernel:
            nbytes = (per_token * sum(cfg.lens) + states * cfg.N * 4 * kp.K * kp.V) * cfg.HV
            return nbytes / (copy_bw_tbps * 1e12) * 1e6
    return None


def kernel_table(fn: Callable, tensors: dict, shared: dict, grads: tuple, flags: dict, cfg: kp.Config,
                 copy_bw_tbps: float) -> list[dict]:  # fmt: skip
    """One step's kernels (a forward, then its backward, each profiled alone after the timed runs): per phase and
    kernel its device time, launches, and where ``KERNEL_BYTES`` has it, its byte floor and percent of it."""
    leaves, rest = _leaves(tensors, shared)
    held = {}

    def forward():
        for t in leaves.values():
            t.grad = None
        held["outs"] = fn(**leaves, **rest, **flags)

    out = []
    for phase in ("forward", "backward"):
        if phase == "forward":
            stats = bc.kernel_stats(forward, calls=1)
        else:
            forward()
            stats = bc.kernel_stats(lambda: torch.autograd.backward(held.pop("outs"), grads), calls=1, warm=False)
        for kernel, (us, launches) in stats.items():
            floor = kernel_floor_us(phase, kernel, cfg, copy_bw_tbps)
            out.append({"phase": phase, "kernel": kernel, "us": us, "launches": launches,
                        "floor_us": None if floor is None else round(floor, 1),
                        "floor_pct": None if floor is None else round(bc.floor_pct(floor, us), 1)})  # fmt: skip
    held.clear()
    return out


def fresh(tensors: dict) -> dict:
    """Copies of an input set whose gradients start empty (one per implementation's check step)."""
    return {n: t.detach().clone() for n, t in tensors.items()}


def output_grads(cfg: kp.Config, device: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed output gradients (do for o, dht for the final state) of a config."""
    device = device or kp.DEVICE
    torch.manual_seed(kp._seed(cfg.name) + 7)
    do = torch.randn(cfg.B, cfg.T, cfg.HV, kp.V, dtype=torch.bfloat16, device=device)
    dht = torch.randn(cfg.N, cfg.HV, kp.V, kp.K, dtype=torch.float32, device=device)
    return do, dht


def check(fla_out: tuple, cula_out: tuple) -> tuple[float, str]:
    """(max relative RMSE over o, final state and every input gradient, status) of cula against FLA."""
    pairs = [(fla_out[0], cula_out[0]), (fla_out[1], cula_out[1])]
    pairs += [(fla_out[2][n], cula_out[2][n]) for n in fla_out[2]]
    return bc.check_outputs(pairs, WARN_TOL, FAIL_TOL)


def output_errors(fla_out: tuple, cula_out: tuple) -> dict[str, float]:
    """Relative RMSE of cula against FLA per output (o, ht) and per input gradient (d<leaf>), for the JSON row: which
    gradient sets ``max_rel_err``, to read against FLA's per-gradient tolerances."""
    from cula.testing import rel_rmse

    pairs = {"o": (fla_out[0], cula_out[0]), "ht": (fla_out[1], cula_out[1])}
    pairs.update({f"d{n}": (fla_out[2][n], cula_out[2][n]) for n in fla_out[2]})
    return {n: float(f"{rel_rmse(f.float(), c.float()):.3g}") for n, (f, c) in pairs.items()}


def step_peak_mib(step: Callable[[], Any]) -> float | None:
    """What one step allocates at its peak beyond the memory live before it (MiB): the activations the forward keeps
    for the backward, the backward's workspace and the gradients; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def forward_saved_mib(fn: Callable, tensors: dict, shared: dict, flags: dict | None = None) -> float | None:
    """What a training forward of ``fn`` keeps for its backward (MiB): the memory live after it beyond what was live
    before and beyond its own outputs, its per-call inputs (the set's tensors; not the gate parameters) made inside
    the measured call, so that an input counts only where the forward keeps it; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    leaves, rest = _leaves(tensors, shared)
    flags = kp.CALL_FLAGS if flags is None else flags

    def forward():  # the copies die on return unless the forward kept them
        made = {n: t.clone() if n in tensors else t for n, t in leaves.items()}
        return fn(**made, **rest, **flags)

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = forward()
    torch.cuda.synchronize()
    outputs = sum(t.untyped_storage().nbytes() for t in out if isinstance(t, torch.Tensor))
    kept = torch.cuda.memory_allocated() - base - outputs
    del out
    return kept / 2**20


def timing_mode(meta: dict, args: argparse.Namespace) -> None:
    """The results' ``timing.mode``: without --cuda-graph, rows hold both timings (``run_config``)."""
    if not args.cuda_graph:
        meta["timing"]["mode"] = "eager (*_ms) and cuda_graph replay (*_graph_ms), both in every row"


def run_config(cfg: kp.Config, fla_fn: Callable, cula_fn: Callable, args: argparse.Namespace,
               work: kp.Workload = kp.KDA) -> dict[str, Any]:  # fmt: skip
    """Check one step of each, then time both; returns the result row. ``work``: the inputs, flags and backend
    registry (KDA's; ``bench_gdn_training`` passes Gated DeltaNet's). With ``--also``, cula's side again under each
    named set of extra backward stages (FLA timed once): the row's ``also`` holds their fields, and ``<name>_ms`` /
    ``<name>_speedup`` their headline."""
    shared = work.make_shared(cfg)
    grads = output_grads(cfg)
    sets = bc.rotation_sets(cfg, work.make_set, kp.input_set_bytes(cfg, work.gate_k), args.l2)
    errors: dict[str, str] = {}
    record = bc.error_recorder(errors, cfg.name)

    def maker(fn):
        return lambda s: make_step(fn, s, shared, grads, work.flags)

    def forward_maker(fn):
        return lambda s: make_forward(fn, s, shared, work.flags)

    graph_args = argparse.Namespace(**{**vars(args), "cuda_graph": True})

    def graph_ms(label: str, fn, make=maker) -> float | None:
        """The step's (or with ``make=forward_maker`` its forward's) CUDA-graph replay time beside the eager one:
        None under --cuda-graph (the main timing is the graph one then), without CUDA (the CPU tests' stand-ins) or
        where the capture failed (recorded: it costs the cell)."""
        if args.cuda_graph or not torch.cuda.is_available():
            return None
        return bc.median_ms(bc.timed(f"{label} graph", make(fn), sets, graph_args, record))

    def split(label: str, fn, step_ms: float | None) -> dict[str, float | None]:
        """``<label>_fwd_graph_ms`` (the forward's CUDA-graph replay) and ``<label>_bwd_graph_ms`` (the step's
        less the forward's)."""
        fwd = graph_ms(f"{label} forward", fn, forward_maker) if step_ms is not None else None
        bwd = None if fwd is None else step_ms - fwd
        return {f"{label}_fwd_graph_ms": fwd, f"{label}_bwd_graph_ms": bwd}

    fla_out = maker(fla_fn)(fresh(sets[0]))()
    fla_t, _ = bc.time_pair(maker(fla_fn), None, sets, args, record)
    fla_ms = bc.median_ms(fla_t)
    fla_graph = graph_ms("fla", fla_fn)
    fla_split = split("fla", fla_fn, fla_graph)
    # after the timings, so that neither side's first call (compilation, FLA's autotuning) is in its peak
    fla_peak = step_peak_mib(maker(fla_fn)(fresh(sets[0])))
    fla_saved = forward_saved_mib(fla_fn, fresh(sets[0]), shared, work.flags)

    def cula_side(label: str, fla_out: tuple, cula_fn=cula_fn) -> dict[str, Any]:
        backend, per_output = "unknown", {}
        try:
            cula_out, backend = bc.call_recording_backend(maker(cula_fn)(fresh(sets[0])), work.registry)
            torch.cuda.synchronize()
            err, status = check(fla_out, cula_out)
            per_output = output_errors(fla_out, cula_out) if status != "FAIL" else {}
            del cula_out
        except Exception as exc:  # noqa: BLE001  (a raising cula call is a FAIL row, not a dead suite)
            record(f"{label} check", exc)
            err, status = float("nan"), "FAIL"
        bc.warn_check(f"{cfg.name} {label}", err, status)
        _, cula_t = bc.time_pair(None, maker(cula_fn) if status != "FAIL" else None, sets, args, record)
        cula_ms = bc.median_ms(cula_t)
        cula_graph = graph_ms(label, _graph_form(cfg, work, cula_fn)) if status != "FAIL" else None
        return {
            "cula_ms": cula_ms, "speedup": bc.speedup(fla_ms, cula_ms), "cula_graph_ms": cula_graph,
            "graph_speedup": bc.speedup(fla_graph, cula_graph), "max_rel_err": err, "rel_err": per_output,
            "check": status, "backend": backend, **bc.spread_fields(None, cula_t),
            "cula_peak_mib": step_peak_mib(maker(cula_fn)(fresh(sets[0]))) if status != "FAIL" else None,
            "cula_saved_mib": forward_saved_mib(cula_fn, fresh(sets[0]), shared, work.flags) if status != "FAIL"
            else None,
        }  # fmt: skip

    main = cula_side("cula", fla_out)
    if main["check"] != "FAIL":
        main.update(split("cula", _graph_form(cfg, work, cula_fn), main["cula_graph_ms"]))
    kernels = {}
    if getattr(args, "kernels", False) and torch.cuda.is_available():
        bw = getattr(args, "copy_bw_tbps", None) or bc.measure_copy_bandwidth()
        kernels["fla"] = kernel_table(fla_fn, fresh(sets[0]), shared, grads, work.flags, cfg, bw)
        if main["check"] != "FAIL":
            kernels["cula"] = kernel_table(cula_fn, fresh(sets[0]), shared, grads, work.flags, cfg, bw)
    also = {}
    for name, stages in getattr(args, "also", None) or ():
        call = {f: True for f in stages if f in _CALL_FLAGS}
        fn = functools.partial(cula_fn, **call) if call else cula_fn
        with _stages_on(tuple(f for f in stages if f not in _CALL_FLAGS)):
            also[name] = {"stages": list(stages), **cula_side(name, fla_out, fn)}
    del fla_out
    row = {
        "config": cfg.name, "mode": cfg.mode, "B": cfg.B, "T": cfg.T, "N": cfg.N, "H": cfg.H, "HV": cfg.HV,
        "dist": cfg.dist, "fla_ms": fla_ms, "fla_graph_ms": fla_graph, **fla_split, **main,
        **bc.spread_fields(fla_t, None),
        "cula_p10_ms": main["cula_p10_ms"],
        "cula_p90_ms": main["cula_p90_ms"], "fla_peak_mib": fla_peak, "fla_saved_mib": fla_saved,
        "rotation_sets": len(sets),
    }  # fmt: skip
    if also:
        row["also"] = also
        for name, part in also.items():
            row[f"{name}_ms"], row[f"{name}_speedup"] = part["cula_ms"], part["speedup"]
            row[f"{name}_graph_ms"], row[f"{name}_graph_speedup"] = part["cula_graph_ms"], part["graph_speedup"]
            row[f"{name}_peak_mib"], row[f"{name}_saved_mib"] = part["cula_peak_mib"], part["cula_saved_mib"]
    if kernels:
        row["kernels"] = kernels
    if errors:
        row["errors"] = errors
    if cfg.mode == "varlen":
        row["seq_lens"] = list(cfg.lens)
    return row


def _graph_form(cfg: kp.Config, work: kp.Workload, cula_fn: Callable) -> Callable:
    """cula's step as its CUDA-graph timing captures it: a packed KDA one in FLA's graph mode (``use_graph``,
    ``max_num_seqs`` = the config's sequence count), without which cula refuses to capture a packed backward (its
    exact chunk list is built on the host); FLA's step captures as it is (its chunk list memoised from the warm-up)."""
    if cfg.mode != "varlen" or work not in kp.GATE_WORKLOADS.values():
        return cula_fn
    return functools.partial(cula_fn, use_graph=True, max_num_seqs=cfg.N)


def _stages_on(stages):
    """The H200's tuning entry with these backward stages (``_STAGE_FLAGS``) on for the block."""
    from cula.kda.plan import KDA_TUNING

    values = dict(_STAGE_VALUES.get(s, (s, True)) for s in stages)
    return KDA_TUNING.override((9, 0), **values) if stages else contextlib.nullcontext()


# KdaTuning flag names, and bwd_dv_dhu: stages 4 and 5 in one launch at every lane count
_STAGE_VALUES = {"bwd_dv_dhu": ("bwd_dv_dhu_lanes", (1, 1 << 30))}
_STAGE_FLAGS = ("bwd_dv_dhu", "bwd_wy_dqkg", "bwd_intra", "bwd_intra_cumsum", "bwd_intra_gate",
                "bwd_intra_l2norm", "bwd_intra_softplus_gate", "bwd_recompute_intra", "bwd_norm_on_load",
                "bwd_recompute_states", "intra_any_gate")  # fmt: skip


# call arguments --also may turn on beside the stage flags (FLA's keep-the-intermediates switch)
_CALL_FLAGS = ("disable_recompute",)


def _stage_list(text: str) -> tuple[str, ...]:
    """``--stages FLAG[,FLAG...]``: ``_STAGE_FLAGS`` names, in that order."""
    stages = {f.strip() for f in text.split(",") if f.strip()}
    if not stages or not stages <= set(_STAGE_FLAGS):
        raise argparse.ArgumentTypeError(f"--stages wants FLAG[,FLAG...] among {_STAGE_FLAGS}, got {text!r}")
    return tuple(f for f in _STAGE_FLAGS if f in stages)


def _also(text: str) -> tuple[str, tuple[str, ...]]:
    """``--also NAME=FLAG[,FLAG...]`` (``KdaTuning`` flag names, on top of the run's stages, or ``_CALL_FLAGS``:
    cula's call with that argument True)."""
    name, _, flags = text.partition("=")
    stages = tuple(f.strip() for f in flags.split(",") if f.strip())
    bad = [f for f in stages if f not in _STAGE_FLAGS + _CALL_FLAGS]
    if not name.isidentifier() or not stages or bad:
        raise argparse.ArgumentTypeError(f"--also wants NAME=FLAG[,FLAG...] with flags among "
                                         f"{_STAGE_FLAGS + _CALL_FLAGS}, got {text!r}")  # fmt: skip
    return name, stages


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bc.arg_parser(
        __doc__.splitlines()[0], QUICK, iters=20, warmup=3, max_seconds=0.0,
        max_seconds_help="start no new config after this many seconds (0: no limit); the results say partial",
        host_overhead_help="unused (a training step is GPU-bound at these sizes)",
    )
    p.add_argument("--stages", type=_stage_list, default=(), metavar="FLAG[,FLAG...]",
                   help="cula's side with these backward stages on, whatever the tuning entry says (KdaTuning flag "
                        "names; bwd_dv_dhu: stages 4 and 5 in one launch at every lane count); results named after "
                        "them, as kda_training_bwd_intra")  # fmt: skip
    p.add_argument("--kernels", action="store_true",
                   help="profile one step of each side per config: every kernel's time, launches and percent of its "
                        "byte floor (KERNEL_BYTES), by phase, in the JSON rows and a table per config in the markdown")
    p.add_argument("--also", type=_also, action="append", default=[], metavar="NAME=FLAG[,FLAG...]",
                   help="time cula's side again with these backward stages on too (KdaTuning flag names), FLA timed "
                        "once: columns NAME_ms and NAME_speedup; repeatable")  # fmt: skip
    p.add_argument("--gate", choices=tuple(kp.GATE_WORKLOADS), default="lower_bound",
                   help="the gate: the fused lower-bound sigmoid with safe_gate (default), the fused softplus gate "
                        "or a log-space gate without it (no bound known: FLA's non-safe stages; cula's intra and "
                        "stage-7 kernels only with intra_any_gate among the stages)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> tuple[dict, list[dict], dict]:
    """Run the suite with ``FLA_FLASH_KDA=0`` (FLA's Triton path on both sides' backward) and ``FLA_CULA=0`` (FLA's
    column is FLA's own kernels, not cula's through FLA's dispatch); returns (meta, rows, written paths)."""
    with bc.env_var("FLA_FLASH_KDA", "0"), bc.env_var("FLA_CULA", "0"):
        return _run(parse_args(argv))


def _run(args: argparse.Namespace) -> tuple[dict, list[dict], dict]:
    if not torch.cuda.is_available():
        raise SystemExit("bench_kda_training needs a CUDA GPU")
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    from cula.kda import chunk_kda as cula_chunk_kda
    from cula.kda.plan import KDA_TUNING

    cfgs = bc.select_configs(suite, args)
    ceilings = bc.reported_ceilings(NAME)
    args.copy_bw_tbps = ceilings["copy_bw_tbps"]
    stages = args.stages
    work = kp.GATE_WORKLOADS[args.gate]
    with _stages_on(stages):
        run = run_suite(cfgs, lambda cfg: run_config(cfg, fla_chunk_kda, cula_chunk_kda, args, work),
                        args.max_seconds or None, time.perf_counter(), progress=bc.PROGRESS_KEYS + ("backend",),
                        record_wall=False)  # fmt: skip
        entry = dataclasses.asdict(KDA_TUNING.get((9, 0)))
    rows = run.rows
    meta = {
        "FLA_FLASH_KDA": os.environ.get("FLA_FLASH_KDA"),
        "FLA_CULA": os.environ.get("FLA_CULA"),
        "CULA_BACKEND": os.environ.get("CULA_BACKEND", "unset"),
        "cula_tuning": entry,
        "shape": {"H = HV": f"{kp.H} (kda_prefill's shapes) or per row (the research shapes)", "K": kp.K, "V": kp.V,
                  "chunk": kp.CHUNK, "dtype": "bfloat16", "state": "float32"},  # fmt: skip
        "call_flags": work.flags,
        "step": "chunk_kda forward + torch.autograd.backward((o, ht), (do, dht)) on 8 leaves, .grad set to None first",
        **bc.run_meta(args, ceilings, WARN_TOL, FAIL_TOL),
        **run.partial_note(len(cfgs), args.max_seconds),
    }
    timing_mode(meta, args)
    extra = [f"{name}_{col}" for name, _ in args.also
             for col in ("ms", "speedup", "graph_ms", "graph_speedup", "peak_mib", "saved_mib")]  # fmt: skip
    gate = "" if args.gate == "lower_bound" else "_" + args.gate
    paths = bc.write_suite(NAME + gate + "".join("_" + s for s in stages) + "".join("_also_" + n for n, _ in args.also),
                           args, meta, rows, MD_COLUMNS + tuple(extra))  # fmt: skip
    # from the written rows: with --merge, the earlier runs' profiles too
    tables = kernel_markdown(json.loads(paths["json"].read_text())["rows"])
    if tables:
        with open(paths["md"], "a") as f:
            f.write(tables)
    return meta, rows, paths


def kernel_markdown(rows: list[dict]) -> str:
    """The ``--kernels`` profiles as markdown: per config and side, each kernel's time and percent of its floor."""
    lines = []
    for row in rows:
        for side, table in row.get("kernels", {}).items():
            total = sum(k["us"] for k in table)
            lines += ["", f"### {row['config']}: {side} ({total / 1e3:.2f} ms of kernels)", "",
                      "| phase | kernel | us | launches | floor_us | floor_pct |", "|---|---|---|---|---|---|"]
            lines += [f"| {k['phase']} | {k['kernel'][:70]} | {k['us']:.1f} | {k['launches']:g} | "
                      f"{bc._fmt_value('floor_us', k['floor_us'])} | {bc._fmt_value('floor_pct', k['floor_pct'])} |"
                      for k in table]  # fmt: skip
    if not lines:
        return ""
    return "\n## Kernels (one profiled step per side; floors from KERNEL_BYTES)\n" + "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
