"""Long sequences with few heads: cula against FLA 0.6.0 where the serial recurrence leaves most SMs idle.

Suite, K = V = 128, bf16 activations, fp32 states, inference:

* ``kda``: ``chunk_kda`` with ``bench_kda_prefill``'s flags (the fused lower-bound gate at -5, q/k L2 norm, beta
  sigmoid, ``safe_gate``, ``[V, K]`` initial and final state), H = HV in {4, 8, 16, 32} x T in {16K, 32K, 64K, 128K},
  one sequence (``B1``) and a pack of two sequences of T each (``pack2``, ``cu_seqlens`` and ``cu_seqlens_cpu``), and
  the ragged pack 64K + 5 x 1K per H (36 rows);
* ``lightning``: ``chunk_simple_gla(q, k, v, g_gamma=...)`` (FLA's Lightning decay schedule for layer 12 of 24, final
  state), the same heads x lengths for one sequence and the ragged pack (20 rows).

Both sides are called with the same arguments (``fla.ops.kda.chunk_kda`` / ``cula.kda.chunk_kda``,
``fla.ops.simple_gla.chunk_simple_gla`` / ``cula.simple_gla.chunk_simple_gla``): cula's planner decides whether to cut
a call in time (``cula.time_split``); the row records how many segments it ran. For packed KDA rows FLA is timed a
second time with its intracard context-parallel backend switched on (``FLA_INTRACARD_CP=1``, inference + varlen),
``fla_cp_ms``. Every row: eager and CUDA-graph replay times of each side, cula checked against FLA first (relative
RMSE of o and the final state), the floor ``max(bytes / copy bw, flops / GEMM rate)`` of ``bench_kda_prefill`` /
``bench_lightning_prefill`` and cula's percent of it (graph time).

Headline numbers: ``speedup`` (FLA / cula, eager), ``graph_speedup`` (CUDA-graph replay: no host overhead on either
side), and for packs ``cp_speedup`` (FLA with its CP backend / cula, eager).

Usage: ``python benchmarks/bench_long_context.py [--quick] [--iters N] [--max-seconds S] [--configs a,b] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import bench_kda_prefill as kp
import bench_lightning_prefill as lp
import common as bc
import torch

NAME = "long_context"
D = 128
HEADS = (4, 8, 16, 32)
LENGTHS = (16384, 32768, 65536, 131072)
RAGGED = (65536,) + (1024,) * 5
WARN_TOL, FAIL_TOL = 5e-3, 5e-2
QUICK = ("kda-H4-B1-T65536", "kda-H4-ragged", "lightning-H4-B1-T65536")
DEVICE = "cuda"  # the CPU tests point this at "cpu" with fake implementations

MD_COLUMNS = ("config", "H", "T", "N", "segments", "fla_ms", "fla_cp_ms", "cula_ms", "speedup", "cp_speedup",
              "fla_graph_ms", "cula_graph_ms", "graph_speedup", "max_rel_err", "check", "floor_ms", "floor_pct",
              "fla_floor_pct")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Config:
    op: str  # "kda" or "lightning"
    H: int
    lens: tuple[int, ...]
    packed: bool  # cu_seqlens (B = 1) rather than one sequence a batch row

    @property
    def name(self) -> str:
        if self.lens == RAGGED:
            shape = "ragged"
        elif self.packed:
            shape = f"pack{len(self.lens)}-T{self.lens[0]}"
        else:
            shape = f"B1-T{self.lens[0]}"
        return f"{self.op}-H{self.H}-{shape}"

    @property
    def T(self) -> int:
        return sum(self.lens)

    @property
    def N(self) -> int:
        return len(self.lens)


def suite(quick: bool = False) -> list[Config]:
    cfgs = []
    for h in HEADS:
        cfgs += [Config("kda", h, (t,), False) for t in LENGTHS]
        cfgs += [Config("kda", h, (t, t), True) for t in LENGTHS]
        cfgs.append(Config("kda", h, RAGGED, True))
    for h in HEADS:
        cfgs += [Config("lightning", h, (t,), False) for t in LENGTHS]
        cfgs.append(Config("lightning", h, RAGGED, True))
    return [c for c in cfgs if c.name in QUICK] if quick else cfgs


# ------------------------------------------------------------------------------------------------------ inputs
def make_shared(cfg: Config, device: str | None = None) -> dict[str, Any]:
    """Per-config tensors every input set shares: the gate parameters (KDA) or the decay (Lightning), and the
    packed boundaries with their host copy."""
    device = device or DEVICE
    torch.manual_seed(bc.config_seed(cfg.name) + 1)
    if cfg.op == "kda":
        shared: dict[str, Any] = {
            "A_log": torch.empty(cfg.H, dtype=torch.float32, device=device).uniform_(1, 16).log(),
            "dt_bias": 0.1 * torch.randn(cfg.H * D, dtype=torch.float32, device=device),
        }
    else:
        from cula.lightning import lightning_g_gamma

        shared = {"g_gamma": lightning_g_gamma(cfg.H, lp.LAYER_IDX, lp.NUM_LAYERS, device=device).contiguous()}
    if cfg.packed:
        shared.update(bc.cu_seqlens(cfg.lens, device))
    return shared


def make_set(cfg: Config, index: int, device: str | None = None) -> dict[str, torch.Tensor]:
    """One input set: q, k, v (KDA: g, beta and the initial state too), bf16 ``[B, T, H, 128]``."""
    device = device or DEVICE
    torch.manual_seed(bc.config_seed(cfg.name) + 100 + index)
    b, t = (1, cfg.T) if cfg.packed else (cfg.N, cfg.lens[0])
    bf16 = torch.bfloat16
    x = {n: torch.randn(b, t, cfg.H, D, dtype=bf16, device=device) for n in ("q", "k", "v")}
    if cfg.op == "kda":  # weak gates, so that state carries across segments (kp.tp_inputs says why)
        x["g"] = torch.randn(b, t, cfg.H, D, dtype=bf16, device=device) + kp.TP_GATE_SHIFT
        x["beta"] = torch.randn(b, t, cfg.H, dtype=bf16, device=device)
        x["initial_state"] = 0.01 * torch.randn(cfg.N, cfg.H, D, D, dtype=torch.float32, device=device)
    return x


def set_bytes(cfg: Config) -> int:
    """What one call reads from its inputs (rotation keeps the sets out of L2)."""
    per_token = cfg.H * D * (5 if cfg.op == "kda" else 3) * 2
    return cfg.T * per_token + (4 * cfg.N * cfg.H * D * D if cfg.op == "kda" else 0)


def bind(fn: Callable, cfg: Config, tensors: dict, shared: dict) -> Callable[[], Any]:
    """A zero-argument call of ``fn`` (FLA's or cula's, same keywords) on one input set."""
    kwargs = {**tensors, **shared}
    kwargs.update(kp.CALL_FLAGS if cfg.op == "kda" else {"output_final_state": True})
    return lambda: fn(**kwargs)


def floor_inputs(cfg: Config) -> tuple[int, float]:
    """(bytes, flops) of the call's floor."""
    if cfg.op == "kda":
        return kp.kda_bytes(cfg.lens, h=cfg.H, hv=cfg.H), kp.kda_flops(cfg.lens, hv=cfg.H)
    return lp.lightning_bytes(cfg.lens, h=cfg.H, d=D), lp.lightning_flops(cfg.lens, h=cfg.H, d=D)


def segments(cfg: Config) -> int | None:
    """How many pieces cula's planner cuts this call into (None: run whole)."""
    from cula.kda.plan import parallel_segments as kda_segments
    from cula.lightning.plan import parallel_segments as lightning_segments

    planner = kda_segments if cfg.op == "kda" else lightning_segments
    cu = bc.cu_seqlens(cfg.lens, "cpu")["cu_seqlens_cpu"] if cfg.packed else None
    B, T = (1, cfg.T) if cfg.packed else (cfg.N, cfg.lens[0])
    plan = planner(B, T, cfg.H, cu, cu, torch.device(DEVICE, 0))
    return plan.num_segments if plan is not None else None


# ------------------------------------------------------------------------------------------------------- rows
def run_config(cfg: Config, fla_fn: Callable, cula_fn: Callable, args: argparse.Namespace,
               ceilings: dict[str, float]) -> dict[str, Any]:  # fmt: skip
    """Check cula against FLA, then time FLA, FLA with its CP backend (packed KDA), and cula, eager and replayed."""
    errors: dict[str, str] = {}
    record = bc.error_recorder(errors, cfg.name)
    shared = make_shared(cfg)
    sets = bc.rotation_sets(cfg, make_set, set_bytes(cfg), args.l2)
    nbytes, flops = floor_inputs(cfg)
    floor = bc.floor_ms(nbytes, flops, ceilings["copy_bw_tbps"], ceilings["gemm_tflops"])
    row: dict[str, Any] = {"config": cfg.name, "op": cfg.op, "H": cfg.H, "T": cfg.T, "N": cfg.N,
                           "segments": segments(cfg), "floor_ms": floor, "check": "FAIL",
                           "max_rel_err": float("nan")}  # fmt: skip

    def timings(label, make, capture=True):
        return bc.eager_and_graph_ms(label, make, sets, args, record, capture)

    try:
        fla_out = bind(fla_fn, cfg, sets[0], shared)()
    except Exception as exc:  # noqa: BLE001
        record("fla check", exc)
        fla_out = None
    try:
        cula_out = bind(cula_fn, cfg, sets[0], shared)()
        if fla_out is not None:
            row["max_rel_err"], row["check"] = bc.check_outputs(zip(fla_out[:2], cula_out[:2]), WARN_TOL, FAIL_TOL)
        else:
            row["check"] = "unchecked"
        del cula_out
    except Exception as exc:  # noqa: BLE001
        record("cula check", exc)
    del fla_out
    bc.warn_check(cfg.name, row["max_rel_err"], row["check"])

    row["fla_ms"], row["fla_graph_ms"] = timings("fla", lambda s: bind(fla_fn, cfg, s, shared))
    row["fla_cp_ms"] = None
    if cfg.op == "kda" and cfg.packed:
        # FLA's CP backend copies its plan from the host on every call: it cannot be captured
        with bc.env_var("FLA_INTRACARD_CP", "1"):
            row["fla_cp_ms"], _ = timings("fla cp", lambda s: bind(fla_fn, cfg, s, shared), capture=False)
    row["cula_ms"] = row["cula_graph_ms"] = None
    if row["check"] != "FAIL":
        row["cula_ms"], row["cula_graph_ms"] = timings("cula", lambda s: bind(cula_fn, cfg, s, shared))
    row["speedup"] = bc.speedup(row["fla_ms"], row["cula_ms"])
    row["graph_speedup"] = bc.speedup(row["fla_graph_ms"], row["cula_graph_ms"])
    row["cp_speedup"] = bc.speedup(row["fla_cp_ms"], row["cula_ms"])
    row["floor_pct"] = bc.floor_pct(floor, row["cula_graph_ms"] or row["cula_ms"])
    row["fla_floor_pct"] = bc.floor_pct(floor, row["fla_graph_ms"] or row["fla_ms"])
    row["mbytes"], row["gflop"], row["rotation_sets"] = nbytes / 1e6, flops / 1e9, len(sets)
    if errors:
        row["errors"] = errors
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return bc.arg_parser(__doc__.splitlines()[0], QUICK, iters=50, warmup=5, max_seconds=0.0).parse_args(argv)


def main(argv: list[str] | None = None) -> tuple[dict, list[dict], dict]:
    """Run the suite (FLA's own Triton kernels: ``FLA_FLASH_KDA=0``, ``FLA_CULA=0``, CP off but in its column)."""
    with bc.env_var("FLA_FLASH_KDA", "0"), bc.env_var("FLA_CULA", "0"), bc.env_var("FLA_INTRACARD_CP", "0"):
        return _run(parse_args(argv))


def _run(args: argparse.Namespace) -> tuple[dict, list[dict], dict]:
    if not torch.cuda.is_available():
        raise SystemExit("bench_long_context needs a CUDA GPU")
    from fla.ops.kda import chunk_kda as fla_kda
    from fla.ops.simple_gla import chunk_simple_gla as fla_sgla

    from cula.kda import chunk_kda as cula_kda
    from cula.kda.plan import KDA_TUNING
    from cula.lightning.plan import LIGHTNING_TUNING
    from cula.simple_gla import chunk_simple_gla as cula_sgla

    t_start = time.perf_counter()
    cfgs = bc.select_configs(suite, args)
    ceilings = bc.reported_ceilings(NAME)
    fns = {"kda": (fla_kda, cula_kda), "lightning": (fla_sgla, cula_sgla)}
    args.cuda_graph = False  # every row has both; the result's name stays free of the graph suffix
    with torch.inference_mode():
        run = bc.run_suite(cfgs, lambda cfg: run_config(cfg, *fns[cfg.op], args, ceilings),
                           args.max_seconds or None, t_start, name=NAME,
                           progress=("speedup", "graph_speedup", "cp_speedup", "segments", "floor_pct", "check"))
    meta = {
        "shape": {"K": D, "V": D, "H = HV": "per row", "dtype": "bfloat16", "state": "float32"},
        "calls": {"kda": "chunk_kda(**bench_kda_prefill.CALL_FLAGS, A_log, dt_bias, initial_state)",
                  "lightning": "chunk_simple_gla(q, k, v, g_gamma=lightning_g_gamma(H, 12, 24), "
                               "output_final_state=True)"},
        "fla_cp": "FLA_INTRACARD_CP=1 around FLA's packed KDA rows (FLA's IntraCardCPBackend: inference, varlen)",
        "cula_tuning": {"kda": dataclasses.asdict(KDA_TUNING.get((9, 0))).get("time_split"),
                        "lightning": dataclasses.asdict(LIGHTNING_TUNING.get((9, 0))).get("time_split")},
        **bc.run_meta(args, ceilings, WARN_TOL, FAIL_TOL),
        **bc.budget_meta(run, args.max_seconds, t_start),
    }
    meta["timing"]["mode"] = "eager and cuda_graph (both in every row)"
    paths = bc.write_suite(NAME, args, meta, run.rows, MD_COLUMNS, [c.name for c in suite()])
    return meta, run.rows, paths


if __name__ == "__main__":
    main()
