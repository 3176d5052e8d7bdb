"""KDA decode: FLA 0.6.0 ``fused_recurrent_kda_fwd`` (continuous batching) against cula's SM90 decode kernel.

Suite, K = V = 128, HV = 64 value heads, bf16 q/k/v/g/beta, fp32 state pool ``[P, HV, V, K]``
(``state_v_first``), P = 2N rows, ``state_indices`` = the first N entries of a seeded random permutation of
the pool rows (int32), under ``torch.inference_mode()``:

* ``decode-N{N}-H64``: T = 1, H = 64, N in {1, 8, 32, 64, 128, 256, 512};
* ``mtp-N64-T4-H64``: an MTP verify step, T = 4 tokens per sequence, N = 64;
* ``decode-N{N}-H16``: T = 1, GVA with H = 16 q/k heads (4 value heads per q/k head), same N.

H = 64 configs run first, so FLA's Triton compile for that shape is paid once; H = 16 and T > 1 (2-D
indices) compile again.

cula call: ``cula.kda.kda_decode(q, k, v, g, beta, pool, indices, A_log=, dt_bias=, lower_bound=-5.0,
use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True)``
with q/k ``[N, T, H, K]``, v ``[N, T, HV, V]``, g ``[N, T, HV, K]``, beta ``[N, T, HV]``; when
``cula.kda.kda_decode`` does not exist, ``cula.ops.kda.sm90.decode.kda_decode_sm90`` is called directly with
the same meaning (``gate="lower_bound"``, a fresh ``torch.empty`` output per call). ``meta["cula_entry"]``
says which.

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
Host overhead for N = 1 (both H): ``*_host_us`` = wall time per call of 100 back-to-back calls with one
sync at the end (``common.measure_host_overhead``'s ``back_to_back_us``; all three figures are in meta).

Time budget: ``--max-seconds S`` stops starting new configs S seconds after the script started and still
writes what it has (``meta["partial"]``, ``meta["skipped_configs"]``).

Usage: ``python benchmarks/bench_kda_decode.py [--quick] [--iters N] [--max-seconds S] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import zlib
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
MTP = (64, 4)  # (N, T)
QUICK = ("decode-N1-H64", "decode-N64-H64", "mtp-N64-T4-H64", "decode-N64-H16")

MD_COLUMNS = ("config", "N", "T", "H", "HV", "fla_ms", "cula_ms", "speedup", "max_rel_err", "check",
              "bw_fraction", "fla_bw_fraction", "floor_pct", "fla_host_us", "cula_host_us")

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

    @property
    def P(self) -> int:
        return 2 * self.N

    @property
    def name(self) -> str:
        if self.T == 1:
            return f"decode-N{self.N}-H{self.H}"
        return f"mtp-N{self.N}-T{self.T}-H{self.H}"


def suite(quick: bool = False) -> list[Config]:
    """H = 64 decode sweep, the MTP verify step, then the H = 16 (GVA) sweep (module docstring)."""
    cfgs = [Config(n, 1, 64) for n in DECODE_N]
    cfgs.append(Config(MTP[0], MTP[1], 64))
    cfgs += [Config(n, 1, 16) for n in DECODE_N]
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


def _seed(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def make_shared(cfg: Config, device: str | None = None) -> dict[str, torch.Tensor]:
    """Gate parameters (A_log fp32 ``[HV]``, dt_bias fp32 ``[HV*K]``) and FLA's ``cu_seqlens`` (int32)."""
    device = device or DEVICE
    torch.manual_seed(_seed(cfg.name) + 1)
    return {
        "A_log": torch.empty(HV, dtype=torch.float32, device=device).uniform_(1, 16).log(),
        "dt_bias": 0.1 * torch.randn(HV * K, dtype=torch.float32, device=device),
        "cu_seqlens": torch.arange(0, cfg.N * cfg.T + 1, cfg.T, dtype=torch.int32, device=device),
    }


def make_set(cfg: Config, index: int, device: str | None = None) -> dict[str, torch.Tensor]:
    """One independent input set, its own pool ``[P, HV, V, K]`` fp32 and int32 ``indices [N]`` included."""
    device = device or DEVICE
    gen = torch.Generator().manual_seed(_seed(cfg.name) + 100 + index)
    torch.manual_seed(_seed(cfg.name) + 100 + index)
    n, t, h = cfg.N, cfg.T, cfg.H
    bf16 = torch.bfloat16
    perm = torch.randperm(cfg.P, generator=gen)[:n]
    return {
        "q": torch.randn(n, t, h, K, dtype=bf16, device=device),
        "k": torch.randn(n, t, h, K, dtype=bf16, device=device),
        "v": torch.randn(n, t, HV, V, dtype=bf16, device=device),
        "g": torch.randn(n, t, HV, K, dtype=bf16, device=device),
        "beta": torch.randn(n, t, HV, dtype=bf16, device=device),
        "pool": 0.01 * torch.randn(cfg.P, HV, V, K, dtype=torch.float32, device=device),
        "indices": perm.to(dtype=torch.int32, device=device),
    }


def fla_indices(indices: torch.Tensor, t: int) -> torch.Tensor:
    """FLA's ``ssm_state_indices`` for T tokens per sequence: 1-D for T = 1, else ``[N, T]`` repeating each row."""
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
    }


def fla_call(fn: Callable, s: dict, shared: dict, pool: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
    """Zero-argument FLA call returning ``o`` as ``[N, T, HV, V]``."""
    kwargs = fla_args(s, shared, pool)
    n, t = s["q"].shape[:2]
    return lambda: fn(**kwargs)[0].view(n, t, HV, V)


def resolve_cula() -> tuple[Callable, str]:
    """``(fn, entry)``: ``fn(q, k, v, g, beta, pool, indices, A_log, dt_bias) -> o`` through the public
    ``cula.kda.kda_decode`` when it exists, else straight into ``kda_decode_sm90``."""
    from cula.kda import kda_decode

    # A serving loop validates its slot indices once, not per step, so it passes check_indices=False
    # (the per-call check reads the indices on the host, a device sync).
    def public(q, k, v, g, beta, pool, indices, A_log, dt_bias):
        return kda_decode(q, k, v, g, beta, pool, indices, A_log=A_log, dt_bias=dt_bias, scale=None,
                          check_indices=False, **CALL_FLAGS)

    return public, "cula.kda.kda_decode(check_indices=False)"


def cula_call(fn: Callable, s: dict, shared: dict, pool: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
    """Zero-argument cula call returning ``o`` ``[N, T, HV, V]``."""
    args = (s["q"], s["k"], s["v"], s["g"], s["beta"], s["pool"] if pool is None else pool, s["indices"],
            shared["A_log"], shared["dt_bias"])
    return lambda: fn(*args)


def check(s: dict, fla_o: torch.Tensor, fla_pool: torch.Tensor, cula_o: torch.Tensor,
          cula_pool: torch.Tensor) -> tuple[float, str]:
    """(max relative RMSE over o and the touched pool rows, "ok" | "warn" | "FAIL") of cula against FLA.

    A cula write to a pool row it was not given also fails.
    """
    from cula.testing import rel_rmse

    idx = s["indices"].long()
    untouched = torch.ones(s["pool"].shape[0], dtype=torch.bool, device=idx.device)
    untouched[idx] = False
    if not torch.equal(cula_pool[untouched], s["pool"][untouched]):
        return float("inf"), "FAIL"
    errs = []
    for ref, out in ((fla_o, cula_o), (fla_pool[idx], cula_pool[idx])):
        if out is None or out.shape != ref.shape:
            return float("inf"), "FAIL"
        if not torch.isfinite(ref).all():
            return float("nan"), "FAIL"
        if not torch.isfinite(out).all():
            return float("inf"), "FAIL"
        errs.append(rel_rmse(ref.float(), out.float()))
    err = max(errs)
    if not err <= FAIL_TOL:
        return err, "FAIL"
    return err, ("warn" if err > WARN_TOL else "ok")


def run_config(cfg: Config, fla_fn: Callable, cula_fn: Callable, args: argparse.Namespace,
               ceilings: dict[str, float]) -> dict[str, Any]:
    """Check then time both implementations on one config; returns the result row (errors recorded in it)."""
    errors: dict[str, str] = {}

    def record(label: str, exc: Exception) -> None:
        errors[label] = f"{type(exc).__name__}: {exc}"[:300]
        print(f"WARNING: {cfg.name}: {label} raised {errors[label]}", file=sys.stderr, flush=True)

    sbytes = state_bytes(cfg)
    nbytes = sbytes + activation_bytes(cfg)
    floor = bc.floor_ms(nbytes, 0.0, ceilings["copy_bw_tbps"], ceilings["gemm_tflops"])
    row: dict[str, Any] = {
        "config": cfg.name, "N": cfg.N, "T": cfg.T, "H": cfg.H, "HV": HV, "P": cfg.P,
        "fla_ms": None, "cula_ms": None, "speedup": None, "max_rel_err": float("nan"), "check": "FAIL",
        "bw_fraction": None, "fla_bw_fraction": None, "floor_ms": floor, "floor_pct": None,
        "state_mbytes": sbytes / 1e6, "mbytes": nbytes / 1e6,
    }
    try:
        shared = make_shared(cfg)
        n_sets = bc.n_rotation_sets(input_set_bytes(cfg), bc.l2_cache_bytes()) if args.l2 == "rotate" else 1
        sets = [make_set(cfg, i) for i in range(n_sets)]
        row["rotation_sets"] = n_sets
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
        fla_o = fla_call(fla_fn, s0, shared, fla_pool)()
    except Exception as exc:  # noqa: BLE001
        record("fla check", exc)
        fla_ok = False
    try:
        cula_pool = s0["pool"].clone()
        cula_o = cula_call(cula_fn, s0, shared, cula_pool)()
        torch.cuda.synchronize()
        if fla_ok:
            err, status = check(s0, fla_o, fla_pool, cula_o, cula_pool)
        else:
            status = "unchecked"
        del cula_o, cula_pool
    except Exception as exc:  # noqa: BLE001  (a raising cula call is a FAIL row, not a dead suite)
        record("cula check", exc)
    del fla_o, fla_pool
    row["max_rel_err"], row["check"] = err, status
    if status != "ok":
        print(f"WARNING: {cfg.name}: cula vs FLA relative RMSE {err:.3e} -> {status}"
              + (" (cula not timed)" if status == "FAIL" else ""), file=sys.stderr, flush=True)

    timing = {"iters": args.iters, "warmup": args.warmup, "cuda_graph": args.cuda_graph, "l2": args.l2}

    def timed(label: str, make: Callable) -> bc.Timing | None:
        try:
            return bc.bench([make(s) for s in sets], **timing)
        except Exception as exc:  # noqa: BLE001
            record(f"{label} timing", exc)
            torch.cuda.synchronize()
            return None

    fla_t = timed("fla", lambda s: fla_call(fla_fn, s, shared)) if fla_ok else None
    cula_t = None if status == "FAIL" else timed("cula", lambda s: cula_call(cula_fn, s, shared))
    fla_ms = fla_t.median_ms if fla_t is not None else None
    cula_ms = cula_t.median_ms if cula_t is not None else None
    row.update({
        "fla_ms": fla_ms, "cula_ms": cula_ms, "speedup": bc.speedup(fla_ms, cula_ms),
        "bw_fraction": bc.bw_fraction(sbytes, cula_ms, ceilings["copy_bw_tbps"]),
        "fla_bw_fraction": bc.bw_fraction(sbytes, fla_ms, ceilings["copy_bw_tbps"]),
        "floor_pct": bc.floor_pct(floor, cula_ms), "fla_floor_pct": bc.floor_pct(floor, fla_ms),
        "fla_p10_ms": fla_t.p10_ms if fla_t else None, "fla_p90_ms": fla_t.p90_ms if fla_t else None,
        "cula_p10_ms": cula_t.p10_ms if cula_t else None, "cula_p90_ms": cula_t.p90_ms if cula_t else None,
    })

    if cfg.N == 1 and not args.no_host_overhead:
        host: dict[str, Any] = {}
        for label, make, ok in (("fla", fla_call, fla_ok), ("cula", cula_call, status != "FAIL")):
            if not ok:
                continue
            fn = fla_fn if label == "fla" else cula_fn
            try:
                h = bc.measure_host_overhead(make(fn, s0, shared))
                host[label] = {k: round(v, 2) for k, v in h.items()}
                row[f"{label}_host_us"] = round(h["back_to_back_us"], 2)
            except Exception as exc:  # noqa: BLE001
                record(f"{label} host overhead", exc)
        row["host_overhead_us"] = host
    if errors:
        row["errors"] = errors
    return row


def run_suite(cfgs: list, run_one: Callable[[Any], dict], max_seconds: float | None, t_start: float,
              on_row: Callable[[Any, dict], None] | None = None) -> tuple[list[dict], list[str]]:
    """Run ``run_one`` over ``cfgs`` until ``max_seconds`` after ``t_start`` (perf_counter) have passed.

    An exception escaping ``run_one`` becomes a FAIL row for that config. Returns ``(rows, skipped names)``.
    """
    rows: list[dict] = []
    for i, cfg in enumerate(cfgs):
        if max_seconds is not None and time.perf_counter() - t_start > max_seconds:
            skipped = [c.name for c in cfgs[i:]]
            print(f"[{NAME}] --max-seconds {max_seconds:g} reached: skipping {len(skipped)} config(s)",
                  file=sys.stderr, flush=True)
            return rows, skipped
        t0 = time.perf_counter()
        try:
            row = run_one(cfg)
        except Exception as exc:  # noqa: BLE001  (anything run_config did not catch still costs one row)
            row = {"config": cfg.name, "check": "FAIL", "fla_ms": None, "cula_ms": None, "speedup": None,
                   "errors": {"config": f"{type(exc).__name__}: {exc}"[:300]}}
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # multi-GB input sets of one config should not crowd the next
        rows.append(row)
        if on_row is not None:
            on_row(cfg, row)
    return rows, []


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"only {len(QUICK)} configs: {', '.join(QUICK)}")
    p.add_argument("--iters", type=int, default=20, help="timed calls per implementation and config")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before timing (at least one per set)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="start no new config after this many seconds since launch; results are still written "
                        "and marked partial")
    p.add_argument("--out", default=None, help="results root (default benchmarks/results); files go to "
                   "<out>/<gpu-slug>/")
    p.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays instead of eager calls")
    p.add_argument("--l2", choices=("rotate", "flush"), default="rotate",
                   help="keep inputs out of L2 by rotating input sets (default) or flushing 256 MiB")
    p.add_argument("--configs", default=None, help="comma-separated config names to run (default: all)")
    p.add_argument("--no-host-overhead", action="store_true", help="skip the N=1 host-overhead measurement")
    return p.parse_args(argv)


def result_name(args: argparse.Namespace) -> str:
    """``kda_decode`` for the default run; non-default modes get a suffix so they do not overwrite it."""
    name = NAME
    if args.cuda_graph:
        name += "_cudagraph"
    if args.l2 == "flush":
        name += "_flush"
    if args.quick or args.configs:
        name += "_subset"
    return name


def select_configs(args: argparse.Namespace) -> list[Config]:
    """The configs this run will try, in suite order (``--quick`` / ``--configs``)."""
    if not args.configs:
        return suite(args.quick)
    wanted = set(args.configs.split(","))
    unknown = wanted - {c.name for c in suite()}
    if unknown:
        raise SystemExit(f"unknown configs: {sorted(unknown)}")
    return [c for c in suite() if c.name in wanted]


def main(argv: list[str] | None = None) -> tuple[dict, list[dict], dict]:
    """Run the suite; returns (meta, rows, written paths). ``FLA_FLASH_KDA=0`` for the run, then restored."""
    previous = os.environ.get("FLA_FLASH_KDA")
    os.environ["FLA_FLASH_KDA"] = "0"
    try:
        return _run(parse_args(argv), time.perf_counter())
    finally:
        if previous is None:
            os.environ.pop("FLA_FLASH_KDA", None)
        else:
            os.environ["FLA_FLASH_KDA"] = previous


def _run(args: argparse.Namespace, t_start: float) -> tuple[dict, list[dict], dict]:
    if not torch.cuda.is_available():
        raise SystemExit("bench_kda_decode needs a CUDA GPU")
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    cula_fn, cula_entry = resolve_cula()
    cfgs = select_configs(args)
    ceilings = bc.machine_ceilings()
    print(f"[{NAME}] copy {ceilings['copy_bw_tbps']:.3f} TB/s, L2 {bc.l2_cache_bytes() / 2**20:.0f} MiB, "
          f"cula entry {cula_entry}", file=sys.stderr, flush=True)

    progress = bc.Progress(len(cfgs), NAME)

    def on_row(cfg: Config, row: dict) -> None:
        progress.update(cfg.name, fla_ms=row.get("fla_ms"), cula_ms=row.get("cula_ms"), speedup=row.get("speedup"),
                        max_rel_err=row.get("max_rel_err"), check=row["check"],
                        bw_fraction=row.get("bw_fraction"))

    with torch.inference_mode():
        rows, skipped = run_suite(
            cfgs, lambda cfg: run_config(cfg, fused_recurrent_kda_fwd, cula_fn, args, ceilings),
            args.max_seconds, t_start, on_row)

    host = {r["config"]: r["host_overhead_us"] for r in rows if r.get("host_overhead_us")}
    meta: dict[str, Any] = {
        "FLA_FLASH_KDA": os.environ.get("FLA_FLASH_KDA"),
        "cula_entry": cula_entry,
        "cula_check_indices": "False: the index range check (a host sync) is the caller's, as in a serving loop",
        "shape": {"HV": HV, "K": K, "V": V, "dtype": "bfloat16", "state": "float32 pool [2N, HV, V, K]",
                  "indices": "int32 [N], random permutation of pool rows"},
        "call_flags": {**CALL_FLAGS, "fla": "inplace_final_state=True, cu_seqlens=arange(0, N*T+1, T) int32"},
        "mtp_fla_indices": ("2-D ssm_state_indices [N, T] repeating indices[n] (FLA writes the state after "
                            "every token to indices[n, t]); no num_accepted_tokens; FLA writes each state T "
                            "times per call, cula once"),
        "bw_fraction": "state bytes read + written per call (2 * 4 * N * HV * K * V) / time / copy bandwidth",
        "timing": {"mode": "cuda_graph" if args.cuda_graph else "eager", "stat": "median",
                   "iters": args.iters, "warmup": args.warmup,
                   "l2": ("rotate input sets (own pool each) to > 2x L2" if args.l2 == "rotate"
                          else "flush 256 MiB before each call")},
        "tolerance": {"warn": WARN_TOL, "fail": FAIL_TOL},
        "copy_bw_tbps": round(ceilings["copy_bw_tbps"], 4),
        "gemm_tflops": round(ceilings["gemm_tflops"], 2),
        "host_overhead_us": host,
        "partial": bool(skipped),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    if skipped:
        meta["skipped_configs"] = skipped
        meta["max_seconds"] = args.max_seconds
    paths = bc.write_results(result_name(args), meta, rows, out_dir=args.out, md_columns=MD_COLUMNS)
    summary = bc.summarize(rows)
    print(f"[{NAME}] geomean speedup {summary['geomean']:.3f}x, min {summary['min']:.3f}x "
          f"({summary['min_config']}); wrote {paths['md']}", file=sys.stderr, flush=True)
    return meta, rows, paths


if __name__ == "__main__":
    main()
