"""Lightning decode: FLA 0.6.0 ``fused_recurrent_simple_gla`` on gathered pool rows against \
``cula.lightning.lightning_decode``.

Suite, T = 1, H = HV = 64 heads, D = K = V = 128, bf16 q/k/v, fp32 state pool of P = 2N rows,
``state_indices`` = the first N entries of a seeded random permutation of the pool rows (int32), decay = FLA's
Lightning schedule for layer 12 of 24 (``-cula.lightning.lightning_g_gamma(64, 12, 24)``), under
``torch.inference_mode()``:

* ``decode-N{N}-vk``: pool ``[P, HV, V, K]`` (``state_v_first=True``, serving's layout), N in {1, 64, 256};
* ``decode-N{N}-kv``: pool ``[P, HV, K, V]``, same N.

cula call: ``lightning_decode(q, k, v, decay, pool, indices, state_v_first=..., check_indices=False)`` (a
serving loop validates its slot indices once, not per step; the per-call check is a host sync).

FLA call (``fla_ms``): FLA 0.6.0 has no state-pool path for Simple GLA / Lightning (``ssm_state_indices``
exists only for the delta-rule kernels, whose math differs), so the fairest equivalent is a gather, the
recurrent kernel and a scatter: ``h0 = pool.index_select(0, idx)``, ``o, ht = fused_recurrent_simple_gla(q, k,
v, g_gamma=-decay, initial_state=h0, output_final_state=True, state_v_first=...)``, ``pool.index_copy_(0, idx,
ht)``. The gather and scatter each move the touched rows once more, so ``fla_kernel_ms`` also times the FLA
kernel alone on pre-gathered states (``speedup_vs_kernel`` = ``fla_kernel_ms / cula_ms``): the floor any
pool-less kernel could reach is one read and one write, as cula's.

Correctness gate: each config first runs both on copies of the same pool and compares ``o`` and the touched
pool rows by relative RMSE (``ok`` <= 5e-3, ``warn`` <= 5e-2, else ``FAIL`` and cula is not timed); a cula
write to an untouched pool row is also a ``FAIL``.

``bw_fraction`` (and ``fla_bw_fraction``) = state bytes read and written per call (``2 * 4 * N * HV * K * V``)
/ time / measured copy bandwidth; the target is >= 0.95 for N >= 64. ``floor_ms`` adds the activations (q, k,
v in, o out, bf16). Host overhead for N = 1: ``*_host_us`` = wall time per call of 100 back-to-back calls with
one sync at the end, the median of 15 such runs (``common.measure_host_overhead``'s ``back_to_back_us``), the
lowest of three rounds that take FLA, cula and the step form in turn (``common.measure_host_overheads``); all
three figures are in meta, with ``cula_step``: the same for ``cula.lightning.lightning_decode_step``, the serving
form whose fixed arguments are bound once). ``host_yardstick`` in meta is ``torch.empty(1)`` on the device, timed
in the same rounds: the host's own speed, which swings 1.8x on the H200's host (``common.host_yardstick``).

Time budget: ``--max-seconds S`` stops starting new configs S seconds after the script started and still
writes what it has (``meta["partial"]``, ``meta["skipped_configs"]``).

Usage: ``python benchmarks/bench_lightning_decode.py [--quick] [--iters N] [--max-seconds S] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

# The script's own directory is on sys.path when run as `python benchmarks/bench_lightning_decode.py`.
import common as bc
import torch

NAME = "lightning_decode"
H = 64
HV = 64
D = 128
LAYER_IDX, NUM_LAYERS = 12, 24
WARN_TOL = 5e-3
FAIL_TOL = 5e-2
BACKEND_REGISTRY = "cula.lightning.decode:lightning_decode_registry"
DEVICE = "cuda"  # the CPU tests point this at "cpu"

DECODE_N = (1, 64, 256)
QUICK = ("decode-N1-vk", "decode-N64-vk", "decode-N256-vk")

MD_COLUMNS = ("config", "N", "layout", "fla_ms", "fla_kernel_ms", "cula_ms", "speedup", "speedup_vs_kernel",
              "max_rel_err", "check", "backend", "bw_fraction", "fla_bw_fraction", "floor_pct", "fla_host_us",
              "cula_host_us")

# common's suite loop and result-file name (_cudagraph / _flush / _subset suffixes) under NAME
run_suite = functools.partial(bc.run_suite, name=NAME)
result_name = functools.partial(bc.result_name, NAME)


@dataclasses.dataclass(frozen=True)
class Config:
    """One decode shape: N sequences of one token against a pool of 2N rows in one layout."""

    N: int
    state_v_first: bool

    @property
    def P(self) -> int:
        return 2 * self.N

    @property
    def layout(self) -> str:
        return "vk" if self.state_v_first else "kv"

    @property
    def name(self) -> str:
        return f"decode-N{self.N}-{self.layout}"


def suite(quick: bool = False) -> list[Config]:
    """The V-first sweep (serving's layout) first, then the ``[K, V]`` one (module docstring)."""
    cfgs = [Config(n, vf) for vf in (True, False) for n in DECODE_N]
    if quick:
        cfgs = [c for c in cfgs if c.name in QUICK]
    return cfgs


def state_bytes(cfg: Config) -> int:
    """fp32 state bytes read and written by one call (each touched pool row once each way)."""
    return 2 * 4 * cfg.N * HV * D * D


def activation_bytes(cfg: Config) -> int:
    """bf16 q, k, v read and o written by one call."""
    return 2 * cfg.N * (2 * H * D + 2 * HV * D)


def input_set_bytes(cfg: Config) -> int:
    """Bytes one call reads (touched state rows and activations): what rotation must keep out of L2."""
    return 4 * cfg.N * HV * D * D + activation_bytes(cfg)


def decay_rates(device: str | None = None) -> torch.Tensor:
    """fp32 ``[HV]`` decay rates ``s >= 0`` of FLA's schedule for layer 12 of 24."""
    from cula.lightning import lightning_g_gamma

    return (-lightning_g_gamma(HV, LAYER_IDX, NUM_LAYERS, device=device or DEVICE)).contiguous()


def make_shared(cfg: Config, device: str | None = None) -> dict[str, torch.Tensor]:
    """decay ``[HV]`` and FLA's ``g_gamma = -decay``, shared by every input set."""
    decay = decay_rates(device)
    return {"decay": decay, "g_gamma": (-decay).contiguous()}


def make_set(cfg: Config, index: int, device: str | None = None) -> dict[str, torch.Tensor]:
    """One independent input set, its own pool and int32 ``indices [N]`` (+ their int64 copy for FLA)."""
    device = device or DEVICE
    gen = torch.Generator().manual_seed(bc.config_seed(cfg.name) + 100 + index)
    torch.manual_seed(bc.config_seed(cfg.name) + 100 + index)
    n = cfg.N
    bf16 = torch.bfloat16
    perm = torch.randperm(cfg.P, generator=gen)[:n]
    return {
        "q": torch.randn(n, 1, H, D, dtype=bf16, device=device),
        "k": (torch.randn(n, 1, H, D, device=device) * D**-0.5).to(bf16),
        "v": torch.randn(n, 1, HV, D, dtype=bf16, device=device),
        "pool": 0.1 * torch.randn(cfg.P, HV, D, D, dtype=torch.float32, device=device),
        "indices": perm.to(dtype=torch.int32, device=device),
        "indices_long": perm.to(device=device),
    }


def fla_call(fn: Callable, cfg: Config, s: dict, shared: dict,
             pool: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
    """Zero-argument FLA pool step (gather, ``fused_recurrent_simple_gla``, scatter) returning ``o``."""
    pool = s["pool"] if pool is None else pool
    idx = s["indices_long"]

    def call():
        h0 = pool.index_select(0, idx)
        o, ht = fn(s["q"], s["k"], s["v"], g_gamma=shared["g_gamma"], initial_state=h0,
                   output_final_state=True, state_v_first=cfg.state_v_first)
        pool.index_copy_(0, idx, ht)
        return o

    return call


def fla_kernel_call(fn: Callable, cfg: Config, s: dict, shared: dict) -> Callable[[], torch.Tensor]:
    """Zero-argument FLA kernel alone on states gathered once beforehand (its output state is discarded)."""
    h0 = s["pool"].index_select(0, s["indices_long"])
    return lambda: fn(s["q"], s["k"], s["v"], g_gamma=shared["g_gamma"], initial_state=h0,
                      output_final_state=True, state_v_first=cfg.state_v_first)[0]


def cula_call(fn: Callable, cfg: Config, s: dict, shared: dict,
              pool: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
    """Zero-argument cula ``lightning_decode`` call returning ``o``."""
    pool = s["pool"] if pool is None else pool
    return lambda: fn(s["q"], s["k"], s["v"], shared["decay"], pool, s["indices"],
                      state_v_first=cfg.state_v_first, check_indices=False)


def cula_step_call(cfg: Config, s: dict, shared: dict) -> Callable[[], torch.Tensor]:
    """Zero-argument call of ``cula.lightning.lightning_decode_step`` bound to the set's decay, pool and indices
    (the serving form, fixed arguments bound once; host overhead only, the kernel is lightning_decode's)."""
    from cula.lightning import lightning_decode_step

    step = lightning_decode_step(shared["decay"], s["pool"], s["indices"], state_v_first=cfg.state_v_first,
                                 check_indices=False)  # fmt: skip
    return lambda: step(s["q"], s["k"], s["v"])


def check(s: dict, fla_o: torch.Tensor, fla_pool: torch.Tensor, cula_o: torch.Tensor,
          cula_pool: torch.Tensor) -> tuple[float, str]:
    """(max relative RMSE over o and the touched pool rows, "ok" | "warn" | "FAIL") of cula against FLA.

    A cula write to a pool row it was not given also fails.
    """
    idx = s["indices_long"]
    untouched = torch.ones(s["pool"].shape[0], dtype=torch.bool, device=idx.device)
    untouched[idx] = False
    if not torch.equal(cula_pool[untouched], s["pool"][untouched]):
        return float("inf"), "FAIL"
    return bc.check_outputs([(fla_o, cula_o), (fla_pool[idx], cula_pool[idx])], WARN_TOL, FAIL_TOL)


def run_config(cfg: Config, fla_fn: Callable, cula_fn: Callable, args: argparse.Namespace,
               ceilings: dict[str, float], step_call: Callable | None = None) -> dict[str, Any]:
    """Check then time both implementations on one config; returns the result row (errors recorded in it).
    ``step_call`` (``cula_step_call``'s signature): also the host overhead of the bound-step form at N = 1."""
    errors: dict[str, str] = {}
    record = bc.error_recorder(errors, cfg.name)
    sbytes = state_bytes(cfg)
    nbytes = sbytes + activation_bytes(cfg)
    floor = bc.floor_ms(nbytes, 0.0, ceilings["copy_bw_tbps"], ceilings["gemm_tflops"])
    row: dict[str, Any] = {
        "config": cfg.name, "N": cfg.N, "layout": cfg.layout, "H": H, "HV": HV, "P": cfg.P,
        "fla_ms": None, "fla_kernel_ms": None, "cula_ms": None, "speedup": None, "speedup_vs_kernel": None,
        "max_rel_err": float("nan"), "check": "FAIL", "backend": "unknown", "bw_fraction": None,
        "fla_bw_fraction": None, "floor_ms": floor, "floor_pct": None, "state_mbytes": sbytes / 1e6,
        "mbytes": nbytes / 1e6,
    }
    try:
        shared = make_shared(cfg)
        sets = bc.rotation_sets(cfg, make_set, input_set_bytes(cfg), args.l2)
        row["rotation_sets"] = len(sets)
    except Exception as exc:  # noqa: BLE001  (e.g. out of memory: this row fails, the suite goes on)
        record("inputs", exc)
        row["errors"] = errors
        return row

    s0 = sets[0]
    fla_ok = True
    err, status = float("nan"), "FAIL"
    fla_o = fla_pool = None
    try:
        fla_pool = s0["pool"].clone()
        fla_o = fla_call(fla_fn, cfg, s0, shared, fla_pool)()
    except Exception as exc:  # noqa: BLE001
        record("fla check", exc)
        fla_ok = False
    try:
        cula_pool = s0["pool"].clone()
        cula_o, row["backend"] = bc.call_recording_backend(cula_call(cula_fn, cfg, s0, shared, cula_pool),
                                                           BACKEND_REGISTRY)
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
    bc.warn_check(cfg.name, err, status)

    fla_t, cula_t = bc.time_pair((lambda s: fla_call(fla_fn, cfg, s, shared)) if fla_ok else None,
                                 (lambda s: cula_call(cula_fn, cfg, s, shared)) if status != "FAIL" else None,
                                 sets, args, record)
    kernel_t = bc.timed("fla kernel", lambda s: fla_kernel_call(fla_fn, cfg, s, shared), sets, args,
                        record) if fla_ok else None
    fla_ms, cula_ms, kernel_ms = bc.median_ms(fla_t), bc.median_ms(cula_t), bc.median_ms(kernel_t)
    row.update({
        "fla_ms": fla_ms, "fla_kernel_ms": kernel_ms, "cula_ms": cula_ms,
        "speedup": bc.speedup(fla_ms, cula_ms), "speedup_vs_kernel": bc.speedup(kernel_ms, cula_ms),
        "bw_fraction": bc.bw_fraction(sbytes, cula_ms, ceilings["copy_bw_tbps"]),
        "fla_bw_fraction": bc.bw_fraction(sbytes, fla_ms, ceilings["copy_bw_tbps"]),
        "floor_pct": bc.floor_pct(floor, cula_ms), "fla_floor_pct": bc.floor_pct(floor, fla_ms),
        **bc.spread_fields(fla_t, cula_t),
    })

    if cfg.N == 1 and not args.no_host_overhead:
        calls = {}
        if fla_ok:
            calls["fla"] = lambda: fla_call(fla_fn, cfg, s0, shared)
        if status != "FAIL":
            calls["cula"] = lambda: cula_call(cula_fn, cfg, s0, shared)
            if step_call is not None:
                calls["cula_step"] = lambda: step_call(cfg, s0, shared)
        bc.record_host_overheads(row, calls, s0["q"].device, record)
    if errors:
        row["errors"] = errors
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return bc.arg_parser(__doc__.splitlines()[0], QUICK, iters=50, warmup=5,
                         host_overhead_help="skip the N=1 host-overhead measurement").parse_args(argv)


def main(argv: list[str] | None = None) -> tuple[dict, list[dict], dict]:
    """Run the suite; returns (meta, rows, written paths)."""
    t_start = time.perf_counter()
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_lightning_decode needs a CUDA GPU")
    from fla.ops.simple_gla import fused_recurrent_simple_gla

    from cula.lightning import lightning_decode

    cfgs = bc.select_configs(suite, args)
    ceilings = bc.reported_ceilings(NAME)
    return run_benchmark(cfgs, args, t_start, fused_recurrent_simple_gla, lightning_decode, ceilings, cula_step_call)


def run_benchmark(cfgs: list[Config], args: argparse.Namespace, t_start: float, fla_fn: Callable,
                  cula_fn: Callable, ceilings: dict[str, float],
                  step_call: Callable | None = None) -> tuple[dict, list[dict], dict]:
    """Run ``cfgs`` with the given FLA / cula callables and write the results; returns (meta, rows, paths).

    Split from ``main`` so the CPU tests can drive the whole suite with stand-ins for the GPU-only pieces.
    """
    with torch.inference_mode():
        run = run_suite(cfgs, lambda cfg: run_config(cfg, fla_fn, cula_fn, args, ceilings, step_call), args.max_seconds,
                        t_start, progress=bc.PROGRESS_KEYS + ("backend", "bw_fraction"))
    rows = run.rows
    from cula.lightning.plan import LIGHTNING_TUNING

    host = {r["config"]: r["host_overhead_us"] for r in rows if r.get("host_overhead_us")}
    meta: dict[str, Any] = {
        "shape": {"H": H, "HV": HV, "D": D, "T": 1, "dtype": "bfloat16",
                  "state": "float32 pool [2N, HV, V, K] (vk) or [2N, HV, K, V] (kv)",
                  "indices": "int32 [N], random permutation of pool rows"},
        "decay": f"-lightning_g_gamma({HV}, {LAYER_IDX}, {NUM_LAYERS}) (FLA layer schedule)",
        "calls": {
            "cula": "lightning_decode(q, k, v, decay, pool, indices, state_v_first=..., check_indices=False)",
            "fla": "h0 = pool.index_select(0, idx); o, ht = fused_recurrent_simple_gla(q, k, v, "
                   "g_gamma=-decay, initial_state=h0, output_final_state=True, state_v_first=...); "
                   "pool.index_copy_(0, idx, ht)",
            "fla_kernel": "fused_recurrent_simple_gla on states gathered once before timing "
                          "(no gather/scatter)",
        },
        "fla_path": "FLA 0.6.0 has no state-pool (ssm_state_indices) path for Simple GLA / Lightning",
        "cula_check_indices": "False: the index range check (a host sync) is the caller's, as in serving",
        "bw_fraction": "state bytes read + written per call (2 * 4 * N * HV * K * V) / time / copy bandwidth",
        **bc.run_meta(args, ceilings, WARN_TOL, FAIL_TOL,
                      rotate="rotate input sets (own pool each) to > 2x L2"),
        "host_overhead_us": host,
        "host_overhead_cula_step": ("cula.lightning.lightning_decode_step(decay, pool, indices, state_v_first=..., "
                                    "check_indices=False) bound once, then step(q, k, v) per call"),
        "cula_tuning": dataclasses.asdict(LIGHTNING_TUNING.get((9, 0))),
        **bc.budget_meta(run, args.max_seconds, t_start),
    }
    paths = bc.write_suite(NAME, args, meta, rows, MD_COLUMNS)
    return meta, rows, paths


if __name__ == "__main__":
    main()
