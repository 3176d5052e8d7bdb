"""Lightning prefill: FLA 0.6.0 ``fla.ops.simple_gla.chunk_simple_gla`` against \
``cula.lightning.lightning_attn_fwd``.

Lightning attention is Simple GLA with a constant per-head decay: cula takes the decay rate ``s >= 0``
(``lightning_attn_fwd(q, k, v, decay)``), FLA takes ``g_gamma = -s``. The decay is FLA's Lightning schedule
for layer 12 of 24 (``decay = -cula.lightning.lightning_g_gamma(64, 12, 24)``).

Suite, H = 64, D = K = V = 128, bf16 q/k/v, no initial state, final state fp32 ``[N, H, K, V]``, under
``torch.inference_mode()``:

* ``warmup-B1-T512``: a small fixed config run first; it absorbs FLA's Triton autotuning for the fixed-length
  key (all fixed configs share H and D) and cula's first-call compilation;
* fixed length: ``B2-T16384`` first (the headline shape), then B in {1, 2, 8} x T in {256, 1024, 4096, 8192,
  16384, 32768} (18 configs; B8-T32768 is 4.3 GB per q/k/v tensor, fine on a 141 GB H200);
* varlen, B = 1 packed with ``cu_seqlens`` (int32) and ``cu_seqlens_cpu``: N in {10, 20} sequences x
  total in {8192, 16384} x {uniform, random, skewed} (12 configs; lengths from ``bench_kda_prefill``'s
  generator, seeded by the config name). They come last because varlen changes FLA's autotune keys.

Calls: ``fla(q, k, v, g_gamma=-decay, output_final_state=True[, cu_seqlens, cu_seqlens_cpu])`` and
``cula(q, k, v, decay, scale=None, initial_state=None, output_final_state=True[, cu_seqlens,
cu_seqlens_cpu])``; both default ``scale`` to ``D ** -0.5``.

Correctness gate: before timing, both run once on the same inputs; cula's ``o`` and final state are compared
with FLA's by relative RMSE (``ok`` <= 5e-3, ``warn`` <= 5e-2, else ``FAIL`` and cula is not timed). Where FLA's
own output has inf/NaN (FLA 0.6.0 overflows on some varlen configs with this schedule's steepest heads, ~7.9
nats per step), cula is checked against the float64 chunked reference instead (``checked_vs = "ref64"``) and
FLA is still timed; ``meta["fla_nonfinite_configs"]`` lists those rows.

Floor for cula (``floor_ms = max(bytes / copy_bw, flops / gemm_rate)``):

* bytes: q, k, v read and o write in bf16 (``2 * T * (2 H K + 2 H V)``) plus the final state written in
  fp32 (``4 N H K V``); the decay vector is negligible and not counted;
* flops: per head and chunk of ``c`` tokens (C = 64, the last chunk of a sequence may be partial):
  ``q k^T`` 2 c^2 K, intra-chunk ``A v`` 2 c^2 V, inter-chunk ``q S`` 2 c K V, state update ``k^T v`` 2 c K V.

Time budget: ``--max-seconds S`` stops starting new configs S seconds after the script started and still
writes what it has (``meta["partial"]`` then lists the skipped configs).

``--time-parallel``: a separate suite (result ``lightning_prefill_time_parallel``) of few-head long sequences, where
the serial kernel leaves most SMs idle, timing cula's serial path against ``cula.lightning.time_parallel`` at each
segment length of ``common.TIME_SPLIT_SEGMENTS``, eager and CUDA-graph replay side by side in every row (the other
options as above; ``--cuda-graph`` is ignored there). The configs are ``common.time_split_suite``'s (H = HV of 4, 8 and
16, B = 1 up to T = 1M, B = 2 at 64K, and the ragged pack 64K + 5 x 1K); decay from FLA's schedule for H heads. Each row
checks every split against the serial output (relative RMSE, same gates) and gives per segment length ``split_ms`` /
``split_graph_ms`` (``segments`` in the JSON) and the best one. These are the numbers
``cula.lightning.plan.LightningTuning.time_split`` is set from.

Usage: ``python benchmarks/bench_lightning_prefill.py [--quick] [--iters N] [--max-seconds S] [--out DIR]
[--time-parallel]``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Callable
from typing import Any

# The script's own directory is on sys.path when run as `python benchmarks/bench_lightning_prefill.py`.
import common as bc
import torch
from bench_kda_prefill import Config, varlen_lengths

NAME = "lightning_prefill"
H = 64
D = 128
CHUNK = 64
LAYER_IDX, NUM_LAYERS = 12, 24
WARN_TOL = 5e-3
FAIL_TOL = 5e-2
BACKEND_REGISTRY = "cula.simple_gla.backends:chunk_simple_gla_registry"  # lightning_attn_fwd dispatches here
DEVICE = "cuda"  # the CPU tests point this at "cpu"

WARMUP_CFG = (1, 512)
HEADLINE = (2, 16384)
FIXED_B = (1, 2, 8)
FIXED_T = (256, 1024, 4096, 8192, 16384, 32768)
VARLEN = [(n, total, dist) for n in (10, 20) for total in (8192, 16384)
          for dist in ("uniform", "random", "skewed")]
QUICK = ("warmup-B1-T512", "B2-T16384", "B1-T4096", "varlen-N20-T16384-skewed")

MD_COLUMNS = ("config", "B", "T", "N", "dist", "fla_ms", "cula_ms", "speedup", "max_rel_err", "check", "checked_vs",
              "backend", "floor_ms", "floor_pct", "fla_floor_pct", "bw_fraction")

# common's suite loop and result-file name (_cudagraph / _flush / _subset suffixes) under NAME
run_suite = functools.partial(bc.run_suite, name=NAME)
result_name = functools.partial(bc.result_name, NAME)


def suite(quick: bool = False) -> list[Config]:
    """Warm-up config, the headline ``B2-T16384``, the other fixed configs, then varlen (module docstring)."""
    wb, wt = WARMUP_CFG
    cfgs = [Config("warmup", wb, wt, (wt,) * wb)]
    fixed = [HEADLINE] + [(b, t) for b in FIXED_B for t in FIXED_T if (b, t) != HEADLINE]
    cfgs += [Config("fixed", b, t, (t,) * b) for b, t in fixed]
    for n, total, dist in VARLEN:
        seed = bc.config_seed(f"varlen-N{n}-T{total}-{dist}")
        cfgs.append(Config("varlen", 1, total, tuple(varlen_lengths(n, total, dist, seed)), dist))
    if quick:
        cfgs = [c for c in cfgs if c.name in QUICK]
    return cfgs


def lightning_bytes(lens: tuple[int, ...], h: int = H, d: int = D) -> int:
    """Compulsory DRAM traffic: bf16 q, k, v in and o out; fp32 final state out."""
    t, n = sum(lens), len(lens)
    return 2 * t * 4 * h * d + 4 * n * h * d * d


def chunk_flops(c: int, k: int = D, v: int = D) -> float:
    """Matmul FLOPs of one chunk of ``c`` tokens for one head (formula in the module docstring)."""
    return 2 * c * c * k + 2 * c * c * v + 2 * c * k * v + 2 * c * k * v


def lightning_flops(lens: tuple[int, ...], h: int = H, d: int = D, chunk: int = CHUNK) -> float:
    """Forward matmul FLOPs over all sequences and heads."""
    total = 0.0
    for length in lens:
        full, tail = divmod(length, chunk)
        total += full * chunk_flops(chunk, d, d) + (chunk_flops(tail, d, d) if tail else 0.0)
    return total * h


def input_set_bytes(cfg: Config) -> int:
    """Bytes read from inputs by one call (q, k, v): what rotation must keep out of L2."""
    return 2 * sum(cfg.lens) * 3 * H * D


def decay_rates(device: str | None = None) -> torch.Tensor:
    """fp32 ``[H]`` decay rates ``s >= 0`` of FLA's schedule for layer 12 of 24."""
    from cula.lightning import lightning_g_gamma

    return (-lightning_g_gamma(H, LAYER_IDX, NUM_LAYERS, device=device or DEVICE)).contiguous()


def make_shared(cfg: Config, device: str | None = None) -> dict[str, Any]:
    """Tensors every input set shares: decay and (varlen) cu_seqlens / cu_seqlens_cpu."""
    device = device or DEVICE
    shared: dict[str, Any] = {"decay": decay_rates(device)}
    if cfg.mode == "varlen":
        shared.update(bc.cu_seqlens(cfg.lens, device))
    return shared


def make_set(cfg: Config, index: int, device: str | None = None) -> dict[str, torch.Tensor]:
    """One independent input set: q, k, v ``[B, T, H, D]`` bf16."""
    device = device or DEVICE
    torch.manual_seed(bc.config_seed(cfg.name) + 100 + index)
    shape = (cfg.B, cfg.T, H, D)
    return {name: torch.randn(shape, dtype=torch.bfloat16, device=device) for name in ("q", "k", "v")}


def fla_call(fn: Callable, tensors: dict, shared: dict) -> Callable[[], Any]:
    """Zero-argument FLA ``chunk_simple_gla`` call on one input set."""
    kwargs = {**tensors, "g_gamma": -shared["decay"], "output_final_state": True}
    if "cu_seqlens" in shared:
        kwargs.update(cu_seqlens=shared["cu_seqlens"], cu_seqlens_cpu=shared["cu_seqlens_cpu"])
    return lambda: fn(**kwargs)


def cula_call(fn: Callable, tensors: dict, shared: dict) -> Callable[[], Any]:
    """Zero-argument cula ``lightning_attn_fwd`` call on one input set."""
    kwargs = {**tensors, "decay": shared["decay"], "scale": None, "initial_state": None,
              "output_final_state": True}
    if "cu_seqlens" in shared:
        kwargs.update(cu_seqlens=shared["cu_seqlens"], cu_seqlens_cpu=shared["cu_seqlens_cpu"])
    return lambda: fn(**kwargs)


def check(fla_out: tuple, cula_out: tuple) -> tuple[float, str]:
    """(max relative RMSE over o and final state, "ok" | "warn" | "FAIL") of cula against FLA."""
    return bc.check_outputs(zip(fla_out[:2], cula_out[:2]), WARN_TOL, FAIL_TOL)


def reference_out(tensors: dict, shared: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, final state)`` of the float64 chunked reference on one input set (when FLA's is not finite)."""
    from cula.simple_gla.naive import reference_chunk_simple_gla

    q, k, v = (tensors[n].double() for n in ("q", "k", "v"))
    return reference_chunk_simple_gla(q, k, v, g_gamma=-shared["decay"].double(), output_final_state=True,
                                      cu_seqlens=shared.get("cu_seqlens"))


def run_config(cfg: Config, fla_fn: Callable, cula_fn: Callable, args: argparse.Namespace,
               ceilings: dict[str, float]) -> dict[str, Any]:
    """Check then time both implementations on one config; returns the result row (errors recorded in it)."""
    errors: dict[str, str] = {}
    record = bc.error_recorder(errors, cfg.name)
    nbytes, flops = lightning_bytes(cfg.lens), lightning_flops(cfg.lens)
    floor = bc.floor_ms(nbytes, flops, ceilings["copy_bw_tbps"], ceilings["gemm_tflops"])
    row: dict[str, Any] = {
        "config": cfg.name, "mode": cfg.mode, "B": cfg.B, "T": cfg.T, "N": cfg.N, "dist": cfg.dist,
        "fla_ms": None, "cula_ms": None, "speedup": None, "max_rel_err": float("nan"), "check": "FAIL",
        "backend": "unknown", "floor_ms": floor, "floor_pct": None, "fla_floor_pct": None,
        "bw_fraction": None, "mbytes": nbytes / 1e6, "gflop": flops / 1e9,
    }
    if cfg.mode == "varlen":
        row["seq_lens"] = list(cfg.lens)
    try:
        shared = make_shared(cfg)
        sets = bc.rotation_sets(cfg, make_set, input_set_bytes(cfg), args.l2)
        row["rotation_sets"] = len(sets)
    except Exception as exc:  # noqa: BLE001  (e.g. out of memory: this row fails, the suite goes on)
        record("inputs", exc)
        row["errors"] = errors
        return row

    fla_out = None
    try:
        fla_out = fla_call(fla_fn, sets[0], shared)()
    except Exception as exc:  # noqa: BLE001
        record("fla check", exc)
    status, err = "FAIL", float("nan")
    try:
        cula_out, row["backend"] = bc.call_recording_backend(cula_call(cula_fn, sets[0], shared),
                                                             BACKEND_REGISTRY)
        torch.cuda.synchronize()
        if fla_out is not None and not all(torch.isfinite(t).all() for t in fla_out[:2]):
            row["checked_vs"] = "ref64"
            err, status = check(reference_out(sets[0], shared), cula_out)
        elif fla_out is not None:
            row["checked_vs"] = "fla"
            err, status = check(fla_out, cula_out)
        else:
            # nothing to compare against: time cula anyway but say the row is unchecked
            status = "unchecked"
        del cula_out
    except Exception as exc:  # noqa: BLE001  (a raising cula call is a FAIL row, not a dead suite)
        record("cula check", exc)
    del fla_out
    row["max_rel_err"], row["check"] = err, status
    bc.warn_check(cfg.name, err, status)

    fla_ok = "fla check" not in errors
    fla_t, cula_t = bc.time_pair((lambda s: fla_call(fla_fn, s, shared)) if fla_ok else None,
                                 (lambda s: cula_call(cula_fn, s, shared)) if status != "FAIL" else None,
                                 sets, args, record)
    fla_ms, cula_ms = bc.median_ms(fla_t), bc.median_ms(cula_t)
    row.update({
        "fla_ms": fla_ms, "cula_ms": cula_ms, "speedup": bc.speedup(fla_ms, cula_ms),
        "floor_pct": bc.floor_pct(floor, cula_ms), "fla_floor_pct": bc.floor_pct(floor, fla_ms),
        "bw_fraction": bc.bw_fraction(nbytes, cula_ms, ceilings["copy_bw_tbps"]),
        **bc.spread_fields(fla_t, cula_t),
    })
    if errors:
        row["errors"] = errors
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bc.arg_parser(__doc__.splitlines()[0], QUICK, iters=20, warmup=3)
    p.add_argument("--time-parallel", action="store_true",
                   help="few-head long rows: serial against time-parallel at several segment lengths")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------- time-parallel suite

TP_NAME = NAME + "_time_parallel"
TP_QUICK = bc.TIME_SPLIT_QUICK


def tp_suite(quick: bool = False) -> list[bc.TimeSplitConfig]:
    return bc.time_split_suite(quick)


def tp_inputs(cfg: bc.TimeSplitConfig, index: int, device: str | None = None) -> dict[str, Any]:
    """One input set: q, k, v bf16 ``[B, T, H, D]`` (B = 1 packed for the ragged pack)."""
    device = device or DEVICE
    torch.manual_seed(bc.config_seed(cfg.name) + 100 + index)
    shape = (1 if cfg.varlen else cfg.N, cfg.T, cfg.H, D)
    return {name: torch.randn(shape, dtype=torch.bfloat16, device=device) for name in ("q", "k", "v")}


def run_time_parallel_config(cfg: bc.TimeSplitConfig, args: argparse.Namespace, ceilings: dict[str, float]
                             ) -> dict[str, Any]:  # fmt: skip
    """Serial against split at every segment length of ``bc.TIME_SPLIT_SEGMENTS`` that cuts the longest
    sequence."""
    from cula.lightning import lightning_g_gamma
    from cula.lightning import time_parallel as tp
    from cula.simple_gla.backends import _lightning_forward

    g_gamma = lightning_g_gamma(cfg.H, LAYER_IDX, NUM_LAYERS, device=DEVICE)
    cu = bc.cu_seqlens(cfg.lens, DEVICE)["cu_seqlens"] if cfg.varlen else None
    scale = D ** -0.5
    sets = bc.rotation_sets(cfg, tp_inputs, 2 * sum(cfg.lens) * 3 * cfg.H * D, args.l2)

    def serial(s):
        return lambda: _lightning_forward(s["q"], s["k"], s["v"], g_gamma, scale, None, True, False, cu)

    def split(seg):
        plan = tp.split_plan(cfg.lens, seg)
        if plan is None:
            return None
        return (lambda s: lambda: tp.time_parallel_forward(_lightning_forward, plan, s["q"], s["k"], s["v"], g_gamma,
                                                           scale, None, True, False, cu)), plan.num_segments, \
            contextlib.nullcontext()

    nbytes, flops = lightning_bytes(cfg.lens, h=cfg.H), lightning_flops(cfg.lens, h=cfg.H)
    floor = bc.floor_ms(nbytes, flops, ceilings["copy_bw_tbps"], ceilings["gemm_tflops"])
    return bc.time_split_row(cfg, sets, serial, split, check, floor, args)


def main_time_parallel(args: argparse.Namespace, t_start: float) -> tuple[dict, list[dict], dict]:
    meta = {
        "shape": {"D": D, "dtype": "bfloat16", "state": "float32 [N, H, K, V]",
                  "segments": list(bc.TIME_SPLIT_SEGMENTS)},
        "decay": f"-lightning_g_gamma(H, {LAYER_IDX}, {NUM_LAYERS})",
        "calls": {"serial": "cula.simple_gla.backends._lightning_forward",
                  "split": "cula.lightning.time_parallel.time_parallel_forward(_lightning_forward, split_plan(...))"},
    }  # fmt: skip
    return bc.time_split_main(TP_NAME, args, t_start, run_time_parallel_config, meta, WARN_TOL, FAIL_TOL, tp_suite)


def main(argv: list[str] | None = None) -> tuple[dict, list[dict], dict]:
    """Run the suite; returns (meta, rows, written paths)."""
    t_start = time.perf_counter()
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_lightning_prefill needs a CUDA GPU")
    if args.time_parallel:
        return main_time_parallel(args, t_start)
    from fla.ops.simple_gla import chunk_simple_gla as fla_chunk_simple_gla

    from cula.lightning import lightning_attn_fwd

    cfgs = bc.select_configs(suite, args)
    ceilings = bc.reported_ceilings(NAME)

    with torch.inference_mode():
        run = run_suite(
            cfgs, lambda cfg: run_config(cfg, fla_chunk_simple_gla, lightning_attn_fwd, args, ceilings),
            args.max_seconds, t_start, progress=bc.PROGRESS_KEYS + ("backend", "floor_pct"))
    rows = run.rows
    # the first config's wall time includes FLA autotuning and cula's first compilation
    first_call = {rows[0]["config"]: rows[0]["wall_s"]} if rows else {}
    from cula.lightning.plan import LIGHTNING_TUNING

    meta: dict[str, Any] = {
        "CULA_BACKEND": os.environ.get("CULA_BACKEND", "unset"),
        "shape": {"H": H, "D": D, "chunk": CHUNK, "dtype": "bfloat16", "state": "float32 [N, H, K, V]"},
        "decay": f"-lightning_g_gamma({H}, {LAYER_IDX}, {NUM_LAYERS}) (FLA layer schedule)",
        "calls": {"fla": "chunk_simple_gla(q, k, v, g_gamma=-decay, output_final_state=True)",
                  "cula": "lightning_attn_fwd(q, k, v, decay, scale=None, initial_state=None, "
                          "output_final_state=True)"},
        **bc.run_meta(args, ceilings, WARN_TOL, FAIL_TOL),
        "first_config_wall_s": first_call,
        "fla_nonfinite_configs": [r["config"] for r in rows if r.get("checked_vs") == "ref64"],
        "cula_tuning": dataclasses.asdict(LIGHTNING_TUNING.get((9, 0))),
        **bc.budget_meta(run, args.max_seconds, t_start),
    }
    paths = bc.write_suite(NAME, args, meta, rows, MD_COLUMNS)
    return meta, rows, paths


if __name__ == "__main__":
    main()
