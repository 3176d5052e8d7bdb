"""KDA decode: FLA 0.6.0 ``fused_recurrent_kda_fwd`` (continuous batching) against cula's SM90 decode kernel.

Suite, K = V = 128, HV = 64 value heads, bf16 q/k/v/g/beta, fp32 state pool ``[P, HV, V, K]``
(``state_v_first``), P = 2N rows, ``state_indices`` = the first N entries of a seeded random permutation of
the pool rows (int32), under ``torch.inference_mode()``:

* ``decode-N{N}-H64``: T = 1, H = 64, N in {1, 8, 32, 64, 128, 256, 512};
* ``mtp-N64-T4-H64``: an MTP verify step, T = 4 tokens per sequence, N = 64;
* ``decode-N{N}-H16``: T = 1, GVA with H = 16 q/k heads (4 value heads per q/k head), same N;
* ``decode-N{N}-H64-kv``: T = 1, H = 64, N in {1, 64, 256}, with FLA's default ``[P, HV, K, V]`` pool
  (``state_v_first=False``) for both;
* ``mtp-N64-T4-H64-kv``: the MTP verify step on that pool.

H = 64 configs run first, so FLA's Triton compile for that shape is paid once; H = 16 and T > 1 (2-D
indices) compile again.

cula call: ``cula.kda.kda_decode(q, k, v, g, beta, pool, indices, A_log=, dt_bias=, lower_bound=-5.0,
use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True)``
(``state_v_first=False`` for the kv rows) with q/k ``[N, T, H, K]``, v ``[N, T, HV, V]``, g ``[N, T, HV, K]``,
beta ``[N, T, HV]``. ``meta["cula_entry"]`` names the entry point.

FLA call: ``fused_recurrent_kda_fwd`` on the same tensors viewed as ``[1, N*T, ...]`` with
``cu_seqlens = arange(0, N*T + 1, T)`` (int32), ``initial_state = pool``, ``ssm_state_indices = indices``,
``inplace_final_state=True`` and the same flags. For T > 1 FLA reads the state from
``indices[n * stride(0)]`` and writes the state after token t to ``indices[n * stride(0) + t]``, so 1-D
indices would overwrite other sequences' rows; the MTP row passes 2-D indices ``[N, T]`` whose columns all
repeat ``indices[n]`` (the simplest equivalent of an in-place final state). FLA then writes the state T
times per call where cula writes it once; ``meta["mtp_fla_indices"]`` records this.

Correctness gate: each config first runs both on copies of the same pool and compares ``o`` and the touched
pool rows by relative RMSE (``ok`` <= 5e-3, ``warn`` <= 5e-2, else ``FAIL`` and cula is not timed); a cula
write to an untouched row is also a ``FAIL``.

``bw_fraction`` (and ``fla_bw_fraction``) = state bytes read and written per call (``2 * 4 * N * HV * K * V``)
/ time / measured copy bandwidth. ``floor_ms`` adds the activations (q, k, v, g, beta in, o out, bf16).
Host overhead for N = 1 (both H): ``*_host_us`` = wall time per call of 100 back-to-back calls with one sync at
the end, the median of 15 such runs (``common.measure_host_overhead``'s ``back_to_back_us``), the lowest of three
rounds that take FLA, cula and the step form in turn (``common.measure_host_overheads``); all three figures are in
meta, with ``cula_step``: the same for ``cula.kda.kda_decode_step``, the serving form whose fixed arguments are
bound once). ``host_yardstick`` in meta is ``torch.empty(1)`` on the device, timed in the same rounds: the host's own
speed, which swings 1.8x on the H200's host (``common.host_yardstick``).

Time budget: ``--max-seconds S`` stops starting new configs S seconds after the script started and still
writes what it has (``meta["partial"]``, ``meta["skipped_configs"]``).

Usage: ``python benchmarks/bench_kda_decode.py [--quick] [--iters N] [--max-seconds S] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

# The script's own directory is on sys.path when run as `python benchmarks/bench_kda_decode.py`.
import common as bc
import torch

NAME = "kda_decode"
HV = 64
K = 128
V = 128
LOWER_BOUND = -5.0
WARN_TOL = 5e-3
FAIL_TOL = 5e-2
DEVICE = "cuda"  # the CPU tests point this at "cpu"

DECODE_N = (1, 8, 32, 64, 128, 256, 512)
KV_N = (1, 64, 256)  # the [K, V] pool rows
MTP = (64, 4)  # (N, T)
QUICK = ("decode-N1-H64", "decode-N64-H64", "mtp-N64-T4-H64", "decode-N64-H16")

MD_COLUMNS = ("config", "N", "T", "H", "HV", "fla_ms", "cula_ms", "speedup", "max_rel_err", "check",
              "bw_fraction", "fla_bw_fraction", "floor_pct", "fla_host_us", "cula_host_us")

# common's suite loop and result-file name (_cudagraph / _flush / _subset suffixes) under NAME
run_suite = functools.partial(bc.run_suite, name=NAME)
result_name = functools.partial(bc.result_name, NAME)

CALL_FLAGS = {
    "use_qk_l2norm_in_kernel": True,
    "use_gate_in_kernel": True,
    "use_beta_sigmoid_in_kernel": True,
    "lower_bound": LOWER_BOUND,
    "state_v_first": True,
}


@dataclasses.dataclass(frozen=True)
class Config:
    """One decode shape: N sequences of T tokens, H q/k heads."""

    N: int
    T: int
    H: int
    kv: bool = False  # [P, HV, K, V] pool (state_v_first=False) instead of [P, HV, V, K]

    @property
    def P(self) -> int:
        return 2 * self.N

    @property
    def name(self) -> str:
        layout = "-kv" if self.kv else ""
        if self.T == 1:
            return f"decode-N{self.N}-H{self.H}{layout}"
        return f"mtp-N{self.N}-T{self.T}-H{self.H}{layout}"


def suite(quick: bool = False) -> list[Config]:
    """H = 64 decode sweep, the MTP verify step, the H = 16 (GVA) sweep, the [K, V] pool rows (module docstring)."""
    cfgs = [Config(n, 1, 64) for n in DECODE_N]
    cfgs.append(Config(MTP[0], MTP[1], 64))
    cfgs += [Config(n, 1, 16) for n in DECODE_N]
    cfgs += [Config(n, 1, 64, kv=True) for n in KV_N]
    cfgs.append(Config(MTP[0], MTP[1], 64, kv=True))
    if quick:
        cfgs = [c for c in cfgs if c.name in QUICK]
    return cfgs


def state_bytes(cfg: Config) -> int:
    """fp32 state bytes read and written by one call (each touched pool row once each way)."""
    return 2 * 4 * cfg.N * HV * K * V


def activation_bytes(cfg: Config) -> int:
    """bf16 q, k, v, g, beta read and o written by one call."""
    return 2 * cfg.N * cfg.T * (2 * cfg.H * K + HV * V + HV * K + HV + HV * V)


def input_set_bytes(cfg: Config) -> int:
    """Bytes one call reads (touched state rows and activations): what rotation must keep out of L2."""
    return 4 * cfg.N * HV * K * V + activation_bytes(cfg)


def make_shared(cfg: Config, device: str | None = None) -> dict[str, torch.Tensor]:
    """Gate parameters (A_log fp32 ``[HV]``, dt_bias fp32 ``[HV*K]``), FLA's ``cu_seqlens`` (int32) and the pool
    layout flag ``state_v_first``."""
    device = device or DEVICE
    torch.manual_seed(bc.config_seed(cfg.name) + 1)
    return {
        "A_log": torch.empty(HV, dtype=torch.float32, device=device).uniform_(1, 16).log(),
        "dt_bias": 0.1 * torch.randn(HV * K, dtype=torch.float32, device=device),
        "cu_seqlens": torch.arange(0, cfg.N * cfg.T + 1, cfg.T, dtype=torch.int32, device=device),
        "state_v_first": not cfg.kv,
    }


def make_set(cfg: Config, index: int, device: str | None = None) -> dict[str, torch.Tensor]:
    """One independent input set, its own pool ``[P, HV, V, K]`` (``[P, HV, K, V]`` for kv configs) fp32 and int32
    ``indices [N]`` included."""
    device = device or DEVICE
    gen = torch.Generator().manual_seed(bc.config_seed(cfg.name) + 100 + index)
    torch.manual_seed(bc.config_seed(cfg.name) + 100 + index)
    n, t, h = cfg.N, cfg.T, cfg.H
    bf16 = torch.bfloat16
    perm = torch.randperm(cfg.P, generator=gen)[:n]
    return {
        "q": torch.randn(n, t, h, K, dtype=bf16, device=device),
        "k": torch.randn(n, t, h, K, dtype=bf16, device=device),
        "v": torch.randn(n, t, HV, V, dtype=bf16, device=device),
        "g": torch.randn(n, t, HV, K, dtype=bf16, device=device),
        "beta": torch.randn(n, t, HV, dtype=bf16, device=device),
        "pool": 0.01 * torch.randn(cfg.P, HV, *((K, V) if cfg.kv else (V, K)), dtype=torch.float32, device=device),
        "indices": perm.to(dtype=torch.int32, device=device),
    }


def fla_indices(indices: torch.Tensor, t: int) -> torch.Tensor:
    """FLA's ``ssm_state_indices`` for T tokens per sequence: 1-D for T = 1, else ``[N, T]`` (rows repeat)."""
    if t == 1:
        return indices
    return indices[:, None].expand(indices.shape[0], t).contiguous()


def fla_args(s: dict, shared: dict, pool: torch.Tensor | None = None) -> dict[str, Any]:
    """Keyword arguments of the FLA call on set ``s`` (optionally against another pool)."""
    n, t = s["q"].shape[:2]
    return {
        "q": s["q"].view(1, n * t, *s["q"].shape[2:]),
        "k": s["k"].view(1, n * t, *s["k"].shape[2:]),
        "v": s["v"].view(1, n * t, *s["v"].shape[2:]),
        "g": s["g"].view(1, n * t, *s["g"].shape[2:]),
        "beta": s["beta"].view(1, n * t, s["beta"].shape[2]),
        "A_log": shared["A_log"],
        "dt_bias": shared["dt_bias"],
        "initial_state": s["pool"] if pool is None else pool,
        "inplace_final_state": True,
        "cu_seqlens": shared["cu_seqlens"],
        "ssm_state_indices": fla_indices(s["indices"], t),
        **CALL_FLAGS,
        "state_v_first": shared["state_v_first"],
    }


def fla_call(fn: Callable, s: dict, shared: dict,
             pool: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
    """Zero-argument FLA call returning ``o`` as ``[N, T, HV, V]``."""
    kwargs = fla_args(s, shared, pool)
    n, t = s["q"].shape[:2]
    return lambda: fn(**kwargs)[0].view(n, t, HV, V)


def resolve_cula() -> tuple[Callable, str]:
    """``(fn, entry)``: ``fn(q, k, v, g, beta, pool, indices, A_log, dt_bias, state_v_first) -> o`` through the
    public ``cula.kda.kda_decode``."""
    from cula.kda import kda_decode

    # A serving loop validates its slot indices once, not per step, so it passes check_indices=False
    # (the per-call check reads the indices on the host, a device sync).
    def public(q, k, v, g, beta, pool, indices, A_log, dt_bias, state_v_first):
        return kda_decode(q, k, v, g, beta, pool, indices, A_log=A_log, dt_bias=dt_bias, scale=None,
                          check_indices=False, **dict(CALL_FLAGS, state_v_first=state_v_first))

    return public, "cula.kda.kda_decode(check_indices=False)"


def resolve_cula_step() -> Callable[[dict, dict], Callable[[], torch.Tensor]]:
    """``make(s, shared)``: a zero-argument call of ``cula.kda.kda_decode_step`` bound to the set's pool and indices
    (the serving form with the fixed arguments bound once; host overhead only, the kernel is kda_decode's)."""
    from cula.kda import kda_decode_step

    def make(s: dict, shared: dict) -> Callable[[], torch.Tensor]:
        step = kda_decode_step(s["pool"], s["indices"], A_log=shared["A_log"], dt_bias=shared["dt_bias"], scale=None,
                               check_indices=False, **dict(CALL_FLAGS, state_v_first=shared["state_v_first"]))
        return lambda: step(s["q"], s["k"], s["v"], s["g"], s["beta"])

    return make


def cula_call(fn: Callable, s: dict, shared: dict,
              pool: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
    """Zero-argument cula call returning ``o`` ``[N, T, HV, V]``."""
    args = (s["q"], s["k"], s["v"], s["g"], s["beta"], s["pool"] if pool is None else pool, s["indices"],
            shared["A_log"], shared["dt_bias"], shared["state_v_first"])
    return lambda: fn(*args)


def check(s: dict, fla_o: torch.Tensor, fla_pool: torch.Tensor, cula_o: torch.Tensor,
          cula_pool: torch.Tensor) -> tuple[float, str]:
    """(max relative RMSE over o and the touched pool rows, "ok" | "warn" | "FAIL") of cula against FLA.

    A cula write to a pool row it was not given also fails.
    """
    idx = s["indices"].long()
    untouched = torch.ones(s["pool"].shape[0], dtype=torch.bool, device=idx.device)
    untouched[idx] = False
    if not torch.equal(cula_pool[untouched], s["pool"][untouched]):
        return float("inf"), "FAIL"
    return bc.check_outputs(((fla_o, cula_o), (fla_pool[idx], cula_pool[idx])), WARN_TOL, FAIL_TOL)


def run_config(cfg: Config, fla_fn: Callable, cula_fn: Callable, args: argparse.Namespace,
               ceilings: dict[str, float], step_maker: Callable | None = None, w: Any = None) -> dict[str, Any]:
    """Check then time both implementations on one config; returns the result row (errors recorded in it).
    ``step_maker`` (``resolve_cula_step``'s): also the host overhead of the bound-step form at N = 1. ``w``: the
    workload module (this one by default; ``bench_gdn_decode`` passes itself): its ``HV``, ``state_bytes``,
    ``activation_bytes``, ``input_set_bytes``, ``make_shared``, ``make_set``, ``fla_call``, ``cula_call`` and
    ``check``."""
    w = w or sys.modules[__name__]
    errors: dict[str, str] = {}
    record = bc.error_recorder(errors, cfg.name)
    sbytes = w.state_bytes(cfg)
    nbytes = sbytes + w.activation_bytes(cfg)
    floor = bc.floor_ms(nbytes, 0.0, ceilings["copy_bw_tbps"], ceilings["gemm_tflops"])
    row: dict[str, Any] = {
        "config": cfg.name, "N": cfg.N, "T": cfg.T, "H": cfg.H, "HV": w.HV, "P": cfg.P,
        "fla_ms": None, "cula_ms": None, "speedup": None, "max_rel_err": float("nan"), "check": "FAIL",
        "bw_fraction": None, "fla_bw_fraction": None, "floor_ms": floor, "floor_pct": None,
        "state_mbytes": sbytes / 1e6, "mbytes": nbytes / 1e6,
    }
    try:
        shared = w.make_shared(cfg)
        sets = bc.rotation_sets(cfg, w.make_set, w.input_set_bytes(cfg), args.l2)
        row["rotation_sets"] = len(sets)
    except Exception as exc:  # noqa: BLE001  (this row fails, the suite goes on)
        record("inputs", exc)
        row["errors"] = errors
        return row

    s0 = sets[0]
    fla_ok = True
    err, status = float("nan"), "FAIL"
    fla_o = fla_pool = None
    try:
        fla_pool = s0["pool"].clone()
        fla_o = w.fla_call(fla_fn, s0, shared, fla_pool)()
    except Exception as exc:  # noqa: BLE001
        record("fla check", exc)
        fla_ok = False
    try:
        cula_pool = s0["pool"].clone()
        cula_o = w.cula_call(cula_fn, s0, shared, cula_pool)()
        torch.cuda.synchronize()
        if fla_ok:
            err, status = w.check(s0, fla_o, fla_pool, cula_o, cula_pool)
        else:
            status = "unchecked"
        del cula_o, cula_pool
    except Exception as exc:  # noqa: BLE001  (a raising cula call is a FAIL row, not a dead suite)
        record("cula check", exc)
    del fla_o, fla_pool
    row["max_rel_err"], row["check"] = err, status
    bc.warn_check(cfg.name, err, status)

    fla_t, cula_t = bc.time_pair((lambda s: w.fla_call(fla_fn, s, shared)) if fla_ok else None,
                                 (lambda s: w.cula_call(cula_fn, s, shared)) if status != "FAIL" else None,
                                 sets, args, record)
    fla_ms, cula_ms = bc.median_ms(fla_t), bc.median_ms(cula_t)
    row.update({
        "fla_ms": fla_ms, "cula_ms": cula_ms, "speedup": bc.speedup(fla_ms, cula_ms),
        "bw_fraction": bc.bw_fraction(sbytes, cula_ms, ceilings["copy_bw_tbps"]),
        "fla_bw_fraction": bc.bw_fraction(sbytes, fla_ms, ceilings["copy_bw_tbps"]),
        "floor_pct": bc.floor_pct(floor, cula_ms), "fla_floor_pct": bc.floor_pct(floor, fla_ms),
        **bc.spread_fields(fla_t, cula_t),
    })

    if cfg.N == 1 and not args.no_host_overhead:
        calls = {}
        if fla_ok:
            calls["fla"] = lambda: w.fla_call(fla_fn, s0, shared)
        if status != "FAIL":
            calls["cula"] = lambda: w.cula_call(cula_fn, s0, shared)
            if step_maker is not None:
                calls["cula_step"] = lambda: step_maker(s0, shared)
        bc.record_host_overheads(row, calls, s0["q"].device, record)
    if errors:
        row["errors"] = errors
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return bc.arg_parser(
        __doc__.splitlines()[0], QUICK, iters=20, warmup=3,
        warmup_help="untimed calls before timing (at least one per set)",
        host_overhead_help="skip the N=1 host-overhead measurement",
    ).parse_args(argv)


def main(argv: list[str] | None = None) -> tuple[dict, list[dict], dict]:
    """Run the suite; returns (meta, rows, written paths). ``FLA_FLASH_KDA=0`` and ``FLA_CULA=0`` (FLA's column is
    FLA's own kernels, not cula's through FLA's dispatch) for the run, then restored."""
    with bc.env_var("FLA_FLASH_KDA", "0"), bc.env_var("FLA_CULA", "0"):
        return _run(parse_args(argv), time.perf_counter())


def _run(args: argparse.Namespace, t_start: float) -> tuple[dict, list[dict], dict]:
    if not torch.cuda.is_available():
        raise SystemExit("bench_kda_decode needs a CUDA GPU")
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    cula_fn, cula_entry = resolve_cula()
    step_maker = resolve_cula_step()
    cfgs = bc.select_configs(suite, args)
    ceilings = bc.reported_ceilings(NAME, f"cula entry {cula_entry}")

    with torch.inference_mode():
        run = run_suite(cfgs, lambda cfg: run_config(cfg, fused_recurrent_kda_fwd, cula_fn, args, ceilings, step_maker),
                        args.max_seconds, t_start, progress=bc.PROGRESS_KEYS + ("bw_fraction",))
    rows = run.rows

    from cula.kda.plan import KDA_TUNING

    host = {r["config"]: r["host_overhead_us"] for r in rows if r.get("host_overhead_us")}
    meta: dict[str, Any] = {
        "FLA_FLASH_KDA": os.environ.get("FLA_FLASH_KDA"),
        "FLA_CULA": os.environ.get("FLA_CULA"),
        "cula_entry": cula_entry,
        "cula_check_indices": ("False: the index range check (a host sync) is the caller's, as in a serving "
                               "loop"),
        "shape": {"HV": HV, "K": K, "V": V, "dtype": "bfloat16",
                  "state": "float32 pool [2N, HV, V, K]; [2N, HV, K, V] (state_v_first=False) in the -kv rows",
                  "indices": "int32 [N], random permutation of pool rows"},
        "call_flags": {**CALL_FLAGS, "fla": "inplace_final_state=True, cu_seqlens=arange(0, N*T+1, T) int32"},
        "mtp_fla_indices": ("2-D ssm_state_indices [N, T] repeating indices[n] (FLA writes the state after "
                            "every token to indices[n, t]); no num_accepted_tokens; FLA writes each state T "
                            "times per call, cula once"),
        "bw_fraction": "state bytes read + written per call (2 * 4 * N * HV * K * V) / time / copy bandwidth",
        **bc.run_meta(args, ceilings, WARN_TOL, FAIL_TOL,
                      rotate="rotate input sets (own pool each) to > 2x L2"),
        "host_overhead_us": host,
        "host_overhead_cula_step": ("cula.kda.kda_decode_step(pool, indices, A_log=, dt_bias=, flags, "
                                    "check_indices=False) bound once, then step(q, k, v, g, beta) per call"),
        "cula_tuning": dataclasses.asdict(KDA_TUNING.get((9, 0))),
        **bc.budget_meta(run, args.max_seconds, t_start),
    }
    paths = bc.write_suite(NAME, args, meta, rows, MD_COLUMNS)
    return meta, rows, paths


if __name__ == "__main__":
    main()
