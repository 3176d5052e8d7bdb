"""Gated DeltaNet training step: FLA 0.6.0 ``chunk_gated_delta_rule`` forward + backward against cula's.

cula's step runs the KDA training path (the scalar gate repeated over K: cula's forward kernels, FLA's KDA
backward stages); FLA's runs its own Gated DeltaNet stages. On Hopper with the Triton PyTorch ships (3.4.0 to
3.7.0) FLA's gated ``chunk_bwd_dqkwg`` refuses to run (FLA issue #640) unless TileLang is installed, so FLA's
column then gets that one stage from cula's FLA backend (``cula.common.chunk_o``, torch's batched matrix
products), the rest FLA's own; ``meta["fla_dqkwg"]`` says which ran. Inputs, suite, method and columns are
``bench_kda_training``'s with ``bench_gdn_prefill``'s Gated DeltaNet inputs (g ``[B, T, HV]`` raw with the
fused softplus gate, ``A_log`` / ``dt_bias`` ``[HV]``, beta logits, q / k L2 norm, ``[V, K]`` states): the
step time, the largest relative RMSE of o, the final state and the eight input gradients against FLA's, and
each step's peak memory.

Usage: ``python benchmarks/bench_gdn_training.py [--quick] [--iters N] [--max-seconds S] [--out DIR]
[--per-head-gate]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import time
from typing import Any

import bench_gdn_prefill as gp
import bench_kda_prefill as kp
import bench_kda_training as kt
import common as bc
import torch

NAME = "gdn_training"


def fla_dqkwg() -> str:
    """Which gated ``chunk_bwd_dqkwg`` FLA's step runs here (FLA's own rule for refusing its Triton
    kernel)."""
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    if not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1):
        return "FLA's Triton kernel"
    if importlib.util.find_spec("tilelang") is not None:
        return "FLA's TileLang kernel"
    return "cula.common.chunk_o.chunk_bwd_dqkwg through cula's FLA backend (FLA's Triton kernel refuses here)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bc.arg_parser(
        __doc__.splitlines()[0], kt.QUICK, iters=20, warmup=3, max_seconds=0.0,
        max_seconds_help="start no new config after this many seconds (0: no limit); the results say partial",
        host_overhead_help="unused (a training step is GPU-bound at these sizes)",
    )
    p.add_argument("--per-head-gate", action="store_true",
                   help="cula's forward on the intra kernel's per-head gate (GdnTuning.training_per_head_gate), "
                        "whatever the tuning entry says; results as gdn_training_per_head_gate")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> tuple[dict, list[dict], dict]:
    """Run the suite with cula's FLA backend on (``FLA_CULA=1``: on Hopper FLA's step needs its gated stage
    from it; FLA's column calls FLA's own ``chunk_gated_delta_rule`` body, past the dispatch that would hand the
    whole call to cula); returns (meta, rows, written paths)."""
    with bc.env_var("FLA_FLASH_KDA", "0"), bc.env_var("FLA_CULA", "1"):
        return _run(parse_args(argv))


def _run(args: argparse.Namespace) -> tuple[dict, list[dict], dict]:
    if not torch.cuda.is_available():
        raise SystemExit("bench_gdn_training needs a CUDA GPU")
    import inspect

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    import cula  # noqa: F401  (registers cula's FLA backend)

    # FLA's own function body: through FLA's dispatch the whole call would go to cula's backend (FLA_CULA=1 is on
    # for the gated stage), and FLA's column would be cula's
    fla_fn = inspect.unwrap(chunk_gated_delta_rule)
    from cula.gated_delta_rule import chunk_gated_delta_rule as cula_fn
    from cula.gated_delta_rule.plan import GDN_TUNING
    from cula.kda.plan import KDA_TUNING

    cfgs = bc.select_configs(kt.suite, args)
    ceilings = bc.reported_ceilings(NAME)
    per_head = {"training_per_head_gate": True} if args.per_head_gate else {}
    with GDN_TUNING.override((9, 0), **per_head):
        run = bc.run_suite(cfgs, lambda cfg: kt.run_config(cfg, fla_fn, cula_fn, args, gp.GDN),
                           args.max_seconds or None, time.perf_counter(), name=NAME,
                           progress=bc.PROGRESS_KEYS + ("backend",), record_wall=False)  # fmt: skip
        gdn_entry = dataclasses.asdict(GDN_TUNING.get((9, 0)))
    meta: dict[str, Any] = {
        "fla_dqkwg": fla_dqkwg(),
        "cula_tuning": dataclasses.asdict(KDA_TUNING.get((9, 0))),
        "cula_gdn_tuning": gdn_entry,
        "shape": {"H": kp.H, "HV": kp.HV, "K": kp.K, "V": kp.V, "chunk": kp.CHUNK, "dtype": "bfloat16",
                  "gate": "[B, T, HV] scalar", "state": "float32"},  # fmt: skip
        "call_flags": gp.CALL_FLAGS,
        "step": "chunk_gated_delta_rule forward + torch.autograd.backward((o, ht), (do, dht)) on 8 leaves, "
                ".grad set to None first",
        **bc.run_meta(args, ceilings, kt.WARN_TOL, kt.FAIL_TOL),
        **run.partial_note(len(cfgs), args.max_seconds),
    }
    kt.timing_mode(meta, args)
    paths = bc.write_suite(NAME + ("_per_head_gate" if args.per_head_gate else ""), args, meta, run.rows, kt.MD_COLUMNS)
    return meta, run.rows, paths


if __name__ == "__main__":
    main()
