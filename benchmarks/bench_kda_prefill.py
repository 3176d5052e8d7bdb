"""KDA prefill: FLA 0.6.0 ``fla.ops.kda.chunk_kda`` against ``cula.kda.chunk_kda`` (same signature).

Suite (28 configs), H = HV = 64, K = V = 128, bf16 q/k/v/g/beta, fp32 states, inference settings:

* fixed length: B in {1, 2} x T in {512, 1024, 4096, 8192, 16384} (10 configs);
* varlen, B = 1 packed with ``cu_seqlens`` (int32, plus ``cu_seqlens_cpu``): number of sequences in {10, 20} x
  total tokens in {4096, 8192, 16384} x length distribution (18 configs):
    - ``uniform``: equal lengths (the remainder spread one token at a time over the first sequences);
    - ``random``: N-1 distinct cut points drawn uniformly from [1, total-1] (seeded), so lengths vary
      freely and most are not multiples of the chunk size;
    - ``skewed``: one sequence takes half the tokens and sits at a seeded random position; the other N-1
      share the rest equally.
  Seeds are derived from the config name, so every run sees the same lengths and data.

Call: ``chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_gate_in_kernel=True,
use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
state_v_first=True, A_log=A_log, dt_bias=dt_bias)`` under ``torch.inference_mode()``, with ``g`` and
``beta`` raw logits (randn), ``A_log`` fp32 [HV], ``dt_bias`` fp32 [HV*K], ``h0`` fp32 [N, HV, V, K] small
random. ``FLA_FLASH_KDA=0`` (set by ``main`` before fla is imported, recorded in meta) keeps FLA on its
Triton path; FlashKDA, when installed, would otherwise take this call.

Before timing, each config runs both implementations once on the same inputs and compares cula's ``o`` and
final state with FLA's (relative RMSE). Above ``WARN_TOL`` a warning is printed; non-finite output or an
error above ``FAIL_TOL`` marks the row FAIL and cula is not timed.

Floor for cula (``floor_ms = max(bytes / copy_bw, flops / gemm_rate)``, both measured in this run):

* bytes: q, k, v, g, beta reads and o write in bf16, initial state read and final state write in fp32,
  plus A_log and dt_bias (fp32);
* flops: matmul work of the chunked forward with chunk C = 64, per chunk of c tokens (c = C except a
  sequence's last, partial chunk) and per value head:
      Aqk = (q*e^G) (k*e^-G)^T        2 c^2 K
      Akk = (k*e^G) (k*e^-G)^T        2 c^2 K
      (I + Akk)^-1 (triangular)       c^3 / 3
      w, u = T (k*e^G), T v            2 c^2 (K + V)
      w S, q S, k^T v_new              3 * 2 c K V
      Aqk v_new (intra output)         2 c^2 V
  Elementwise work (gates, l2norm, cumsum, decays) is not counted, so the floor is a true lower bound.

``--time-parallel``: a separate suite (result ``kda_prefill_time_parallel``) of few-head long sequences
(``common.time_split_suite``: H = HV of 4, 8 and 16, B = 1 up to T = 1M, B = 2 at 64K, the ragged pack 64K + 5 x 1K),
timing cula's serial ``chunk_kda`` against its exact time-parallel recurrence (``cula.kda.forward``'s parallel
segments) at each segment length of ``common.TIME_SPLIT_SEGMENTS``, eager and CUDA-graph replay in every row, each
split checked against the serial output first. These are the numbers ``KdaTuning.time_split`` is set from. With
``--halves`` the split calls run their output pass over each segment's halves (``KdaTuning.time_split_halves``;
result ``kda_prefill_time_parallel_halves``).

``--split SEGMENT`` (the main suite, and ``bench_gdn_prefill.py``'s): cula's calls cut in time into segments of that
many tokens whatever the tuning's planner says (any head count; ``--halves`` too for the output pass over halves),
results named with ``_split<SEGMENT>``: how the planner's thresholds are checked on other shapes.

Usage: ``python benchmarks/bench_kda_prefill.py [--quick] [--iters N] [--out DIR] [--cuda-graph] [--time-parallel
[--halves]] [--split SEGMENT [--halves]]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import time
from collections.abc import Callable
from typing import Any

# The script's own directory is on sys.path when run as `python benchmarks/bench_kda_prefill.py`.
import common as bc
import torch

NAME = "kda_prefill"
H = 64
HV = 64
K = 128
V = 128
CHUNK = 64
LOWER_BOUND = -5.0
WARN_TOL = 5e-3  # FLA's own forward tolerance for o (relative RMSE)
FAIL_TOL = 5e-2  # beyond this the output is treated as garbage and not timed
BACKEND_REGISTRY = "cula.kda.backends:chunk_kda_registry"  # the dispatch that cula.kda.chunk_kda goes through
HOST_OVERHEAD_T = 256  # tokens of the host-overhead calls (one sequence, or four packed)
DEVICE = "cuda"  # the CPU tests point this at "cpu" to exercise the row logic with fake implementations

FIXED = [(b, t) for b in (1, 2) for t in (512, 1024, 4096, 8192, 16384)]
VARLEN = [(n, total, dist) for n in (10, 20) for total in (4096, 8192, 16384)
          for dist in ("uniform", "random", "skewed")]
QUICK = ("B1-T1024", "B2-T8192", "varlen-N10-T4096-random", "varlen-N20-T16384-skewed")

MD_COLUMNS = ("config", "B", "T", "N", "dist", "fla_ms", "cula_ms", "speedup", "max_rel_err", "check",
              "backend", "floor_ms", "floor_pct", "fla_floor_pct", "bw_fraction")

# common's suite loop and result-file name (_cudagraph / _flush / _subset suffixes) under NAME
run_suite = functools.partial(bc.run_suite, name=NAME)
result_name = functools.partial(bc.result_name, NAME)


@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmark shape. ``lens`` holds every sequence's length (fixed: ``[T] * B``)."""

    mode: str  # "fixed", "varlen", or "warmup" (bench_lightning_prefill: a fixed shape run first)
    B: int
    T: int  # tokens per batch row (varlen: all packed tokens)
    lens: tuple[int, ...]
    dist: str = "-"
    heads: tuple[int, int] | None = None  # (H, HV) when not the suite's (bench_gdn_prefill's GVA rows)

    @property
    def N(self) -> int:
        return len(self.lens)

    @property
    def H(self) -> int:
        return H if self.heads is None else self.heads[0]

    @property
    def HV(self) -> int:
        return HV if self.heads is None else self.heads[1]

    @property
    def name(self) -> str:
        suffix = "" if self.heads is None else f"-H{self.heads[0]}-HV{self.heads[1]}"
        if self.mode == "varlen":
            return f"varlen-N{self.N}-T{self.T}-{self.dist}{suffix}"
        prefix = "warmup-" if self.mode == "warmup" else ""
        return f"{prefix}B{self.B}-T{self.T}{suffix}"


def varlen_lengths(n: int, total: int, dist: str, seed: int) -> list[int]:
    """Lengths of ``n`` sequences summing to ``total`` (see the module docstring for ``dist``)."""
    if n < 1 or total < n:
        raise ValueError(f"cannot split {total} tokens into {n} non-empty sequences")
    gen = torch.Generator().manual_seed(seed)
    if dist == "uniform":
        base, extra = divmod(total, n)
        return [base + (1 if i < extra else 0) for i in range(n)]
    if dist == "random":
        cuts = sorted((torch.randperm(total - 1, generator=gen)[: n - 1] + 1).tolist())
        bounds = [0, *cuts, total]
        return [bounds[i + 1] - bounds[i] for i in range(n)]
    if dist == "skewed":
        if n == 1:
            return [total]
        long = total // 2
        rest = varlen_lengths(n - 1, total - long, "uniform", seed)
        pos = int(torch.randint(0, n, (1,), generator=gen))
        return rest[:pos] + [long] + rest[pos:]
    raise ValueError(f"unknown distribution {dist!r}")


_seed = bc.config_seed  # bench_lightning_prefill imports it from here


def suite(quick: bool = False) -> list[Config]:
    """The 28-config suite (or the 4-config ``--quick`` subset)."""
    cfgs = [Config("fixed", b, t, (t,) * b) for b, t in FIXED]
    for n, total, dist in VARLEN:
        name = f"varlen-N{n}-T{total}-{dist}"
        cfgs.append(Config("varlen", 1, total, tuple(varlen_lengths(n, total, dist, _seed(name))), dist))
    if quick:
        cfgs = [c for c in cfgs if c.name in QUICK]
    return cfgs


def chunk_flops(c: int, k: int = K, v: int = V) -> float:
    """Matmul FLOPs of one chunk of ``c`` tokens for one head (formula in the module docstring)."""
    return 2 * c * c * k + 2 * c * c * k + c**3 / 3 + 2 * c * c * (k + v) + 3 * 2 * c * k * v + 2 * c * c * v


def kda_flops(lens: tuple[int, ...], hv: int = HV, k: int = K, v: int = V, chunk: int = CHUNK) -> float:
    """Forward matmul FLOPs over all sequences and value heads."""
    total = 0.0
    for length in lens:
        full, tail = divmod(length, chunk)
        total += full * chunk_flops(chunk, k, v) + (chunk_flops(tail, k, v) if tail else 0.0)
    return total * hv


def kda_bytes(lens: tuple[int, ...], h: int = H, hv: int = HV, k: int = K, v: int = V, gate_k: int = K) -> int:
    """Compulsory DRAM traffic: bf16 q, k, v, g, beta in and o out; fp32 state in and out; gate params.
    ``gate_k``: gate values a token and head (K for KDA, 1 for Gated DeltaNet's scalar gate)."""
    t, n = sum(lens), len(lens)
    activations = 2 * t * (2 * h * k + hv * v + hv * gate_k + hv + hv * v)
    states = 2 * 4 * n * hv * k * v
    params = 4 * hv + 4 * hv * gate_k
    return activations + states + params


def input_set_bytes(cfg: Config, gate_k: int = K) -> int:
    """Bytes read from inputs by one call: what rotation must keep out of L2."""
    t, h, hv = sum(cfg.lens), cfg.H, cfg.HV
    return 2 * t * (2 * h * K + hv * V + hv * gate_k + hv) + 4 * cfg.N * hv * K * V


def make_shared(cfg: Config, device: str | None = None) -> dict[str, Any]:
    """Tensors every input set shares: gate parameters and (varlen) cu_seqlens.

    Sharing ``cu_seqlens`` keeps FLA's identity-keyed ``tensor_cache`` hitting across rotated sets, as it
    would in a serving loop, and lets CUDA-graph capture avoid a host-to-device copy.
    """
    device = device or DEVICE
    torch.manual_seed(_seed(cfg.name) + 1)
    shared: dict[str, Any] = {
        # Real checkpoints initialise A_log = log(U(1, 16)) and a small dt_bias.
        "A_log": torch.empty(cfg.HV, dtype=torch.float32, device=device).uniform_(1, 16).log(),
        "dt_bias": 0.1 * torch.randn(cfg.HV * K, dtype=torch.float32, device=device),
    }
    if cfg.mode == "varlen":
        shared.update(bc.cu_seqlens(cfg.lens, device))
    return shared


def make_set(cfg: Config, index: int, device: str | None = None) -> dict[str, torch.Tensor]:
    """One independent input set: q, k, v, g, beta [B, T, ...] bf16 and initial_state [N, HV, V, K] fp32."""
    device = device or DEVICE
    torch.manual_seed(_seed(cfg.name) + 100 + index)
    b, t, h, hv = cfg.B, cfg.T, cfg.H, cfg.HV
    bf16 = torch.bfloat16
    return {
        "q": torch.randn(b, t, h, K, dtype=bf16, device=device),
        "k": torch.randn(b, t, h, K, dtype=bf16, device=device),
        "v": torch.randn(b, t, hv, V, dtype=bf16, device=device),
        "g": torch.randn(b, t, hv, K, dtype=bf16, device=device),
        "beta": torch.randn(b, t, hv, dtype=bf16, device=device),
        "initial_state": 0.01 * torch.randn(cfg.N, hv, V, K, dtype=torch.float32, device=device),
    }


CALL_FLAGS = {
    "output_final_state": True,
    "use_gate_in_kernel": True,
    "use_qk_l2norm_in_kernel": True,
    "use_beta_sigmoid_in_kernel": True,
    "safe_gate": True,
    "lower_bound": LOWER_BOUND,
    "state_v_first": True,
}


def bind(fn: Callable, tensors: dict, shared: dict, flags: dict | None = None) -> Callable[[], Any]:
    """Zero-argument call of ``fn`` on one input set with the suite's flags (``CALL_FLAGS`` unless given)."""
    kwargs = {**tensors, **shared, **(CALL_FLAGS if flags is None else flags)}
    return lambda: fn(**kwargs)


@dataclasses.dataclass(frozen=True)
class Workload:
    """What a prefill suite calls: its inputs, flags, backend registry and gate width (KDA's here; the Gated
    DeltaNet suite, ``bench_gdn_prefill.py``, has its own)."""

    make_shared: Callable[..., dict]
    make_set: Callable[..., dict]
    flags: dict
    registry: str
    gate_k: int


KDA = Workload(make_shared, make_set, CALL_FLAGS, BACKEND_REGISTRY, K)
# --gate softplus: FLA's fused softplus gate without safe_gate, a gate no bound is known of (FLA's non-safe intra
# stages on FLA's side; on cula's, FLA's intra stages too unless --any-gate)
KDA_SOFTPLUS = dataclasses.replace(KDA, flags={**CALL_FLAGS, "safe_gate": False, "lower_bound": None})


def make_set_log(cfg: Config, index: int, device: str | None = None) -> dict[str, torch.Tensor]:
    """``make_set``'s inputs with g a log-space gate, ``logsigmoid`` of the raw one (bf16), for ``--gate log``."""
    x = make_set(cfg, index, device)
    x["g"] = torch.nn.functional.logsigmoid(x["g"].float()).to(x["g"].dtype)
    return x


def make_shared_log(cfg: Config, device: str | None = None) -> dict[str, Any]:
    """``make_shared`` without the fused gate's parameters (``--gate log``: nothing reads them, and a training step
    would leave them without gradients)."""
    return {n: t for n, t in make_shared(cfg, device).items() if n not in ("A_log", "dt_bias")}


# --gate log: FLA's plain call, a log-space gate without safe_gate (no fused gate, no bound known)
KDA_LOG = dataclasses.replace(KDA, make_shared=make_shared_log, make_set=make_set_log, flags={
    **CALL_FLAGS, "use_gate_in_kernel": False, "safe_gate": False, "lower_bound": None,
})  # fmt: skip
GATE_WORKLOADS = {"lower_bound": KDA, "softplus": KDA_SOFTPLUS, "log": KDA_LOG}


def check(fla_out: tuple, cula_out: tuple) -> tuple[float, str]:
    """(max relative RMSE over o and final state, "ok" | "warn" | "FAIL") of cula against FLA."""
    return bc.check_outputs(zip(fla_out[:2], cula_out[:2]), WARN_TOL, FAIL_TOL)


def run_config(cfg: Config, fla_fn: Callable, cula_fn: Callable, args: argparse.Namespace,
               ceilings: dict[str, float], work: Workload = KDA) -> dict[str, Any]:
    """Check then time both implementations on one config; returns the result row."""
    shared = work.make_shared(cfg)
    sets = bc.rotation_sets(cfg, work.make_set, input_set_bytes(cfg, work.gate_k), args.l2)
    errors: dict[str, str] = {}
    record = bc.error_recorder(errors, cfg.name)

    fla_out = bind(fla_fn, sets[0], shared, work.flags)()
    backend = "unknown"
    try:
        cula_out, backend = bc.call_recording_backend(bind(cula_fn, sets[0], shared, work.flags), work.registry)
        torch.cuda.synchronize()
        err, status = check(fla_out, cula_out)
        del cula_out
    except Exception as exc:  # noqa: BLE001  (a raising cula call is a FAIL row, not a dead suite)
        record("cula check", exc)
        err, status = float("nan"), "FAIL"
    del fla_out
    bc.warn_check(cfg.name, err, status)

    fla_t, cula_t = bc.time_pair(lambda s: bind(fla_fn, s, shared, work.flags),
                                 (lambda s: bind(cula_fn, s, shared, work.flags)) if status != "FAIL" else None,
                                 sets, args, record)  # fmt: skip
    fla_ms, cula_ms = bc.median_ms(fla_t), bc.median_ms(cula_t)

    nbytes = kda_bytes(cfg.lens, h=cfg.H, hv=cfg.HV, gate_k=work.gate_k)
    flops = kda_flops(cfg.lens, hv=cfg.HV)
    floor = bc.floor_ms(nbytes, flops, ceilings["copy_bw_tbps"], ceilings["gemm_tflops"])
    row = {
        "config": cfg.name, "mode": cfg.mode, "B": cfg.B, "T": cfg.T, "N": cfg.N, "dist": cfg.dist,
        "H": cfg.H, "HV": cfg.HV,
        "fla_ms": fla_ms, "cula_ms": cula_ms, "speedup": bc.speedup(fla_ms, cula_ms),
        "max_rel_err": err, "check": status, "backend": backend,
        "floor_ms": floor, "floor_pct": bc.floor_pct(floor, cula_ms),
        "fla_floor_pct": bc.floor_pct(floor, fla_ms),
        "bw_fraction": bc.bw_fraction(nbytes, cula_ms, ceilings["copy_bw_tbps"]),
        "mbytes": nbytes / 1e6, "gflop": flops / 1e9,
        **bc.spread_fields(fla_t, cula_t),
        "rotation_sets": len(sets),
    }
    if errors:
        row["errors"] = errors
    if cfg.mode == "varlen":
        row["seq_lens"] = list(cfg.lens)
    return row


def host_overhead(fla_fn: Callable, cula_fn: Callable, packed: bool = False) -> dict[str, Any]:
    """Per-call host cost of both implementations on a tiny config (the lowest of three interleaved rounds,
    ``common.measure_host_overheads``): one sequence of ``HOST_OVERHEAD_T`` tokens, or with ``packed`` the same
    tokens as four packed sequences with ``cu_seqlens_cpu``."""
    if packed:
        lens = (HOST_OVERHEAD_T // 4,) * 4
        cfg = Config("varlen", 1, HOST_OVERHEAD_T, lens, "uniform")
    else:
        cfg = Config("fixed", 1, HOST_OVERHEAD_T, (HOST_OVERHEAD_T,))
    shared, tensors = make_shared(cfg), make_set(cfg, 0)
    calls = {"fla": lambda: bind(fla_fn, tensors, shared), "cula": lambda: bind(cula_fn, tensors, shared)}
    errors: list[BaseException] = []
    host = bc.measure_host_overheads(calls, record=lambda what, exc: errors.append(exc))
    if errors:  # the caller writes it into the meta
        raise errors[0]
    return {"config": cfg.name, **host}


def arg_parser(description: str = __doc__.splitlines()[0], quick: tuple[str, ...] = QUICK) -> argparse.ArgumentParser:
    """This suite's options; bench_gdn_prefill builds on them with its own description and quick configs."""
    p = bc.arg_parser(
        description, quick, iters=100, warmup=10, max_seconds=0.0,
        max_seconds_help="start no new config after this many seconds (0: no limit); the results say partial",
        host_overhead_help="skip the host-overhead measurement",
    )
    p.add_argument("--time-parallel", action="store_true",
                   help="few-head long rows: serial against time-parallel at several segment lengths")
    p.add_argument("--halves", action="store_true",
                   help="with --time-parallel or --split: the split calls' output pass over each segment's halves")
    p.add_argument("--split", type=int, default=0, metavar="SEGMENT",
                   help="cula's calls cut in time into segments of SEGMENT tokens (a multiple of 64), whatever the "
                        "tuning's planner says")
    p.add_argument("--gate", choices=tuple(GATE_WORKLOADS), default="lower_bound",
                   help="the gate: the fused lower-bound sigmoid with safe_gate (default), the fused softplus gate "
                        "without it, or a log-space gate without it (logsigmoid of the raw one; no bound known)")
    p.add_argument("--any-gate", action="store_true",
                   help="cula's calls with KdaTuning.intra_any_gate on: unbounded gates on the intra kernel's "
                        "any_gate variant")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return arg_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> tuple[dict, list[dict], dict]:
    """Run the suite; returns (meta, rows, written paths).

    Sets ``FLA_FLASH_KDA=0`` and ``FLA_CULA=0`` for the duration of the run (FLA reads them at every dispatch:
    the FLA column is FLA's own Triton kernels, not FlashKDA's nor, through FLA's dispatch, cula's) and restores
    the previous values afterwards, so an in-process caller such as the GPU test does not leak them into later
    tests.
    """
    with bc.env_var("FLA_FLASH_KDA", "0"), bc.env_var("FLA_CULA", "0"):
        return _run(parse_args(argv))


def _run(args: argparse.Namespace) -> tuple[dict, list[dict], dict]:
    if not torch.cuda.is_available():
        raise SystemExit("bench_kda_prefill needs a CUDA GPU")
    if args.time_parallel:
        return main_time_parallel(args, time.perf_counter())
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    from cula.kda import chunk_kda as cula_chunk_kda

    cfgs = bc.select_configs(suite, args)
    ceilings = bc.reported_ceilings(NAME)
    work = GATE_WORKLOADS[args.gate]

    meta: dict[str, Any] = {}
    with torch.inference_mode():
        # First cula call of the run, timed whole: includes CuTe compilation of the kernels it needs.
        first = cfgs[0]
        first_set, first_shared = work.make_set(first, 0), work.make_shared(first)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            with cula_override(args):
                bind(cula_chunk_kda, first_set, first_shared, work.flags)()
            torch.cuda.synchronize()
            meta["cula_first_call_s"] = {first.name: round(time.perf_counter() - t0, 3)}
        except Exception as exc:  # noqa: BLE001  (run_config records it again as a FAIL row)
            meta["cula_first_call_s"] = {first.name: bc.error_text(exc, "raised ")}
        del first_set, first_shared

        # The budget counts from here: the first call's compilation above is not part of it.
        with cula_override(args):
            run = run_suite(cfgs, lambda cfg: run_config(cfg, fla_chunk_kda, cula_chunk_kda, args, ceilings, work),
                            args.max_seconds or None, time.perf_counter(),
                            progress=bc.PROGRESS_KEYS + ("backend", "floor_pct"), record_wall=False)
        rows = run.rows
        meta.update(run.partial_note(len(cfgs), args.max_seconds))
        if not args.no_host_overhead and not run.interrupted:
            for key, packed in (("host_overhead_us", False), ("host_overhead_packed_us", True)):
                try:
                    meta[key] = host_overhead(fla_chunk_kda, cula_chunk_kda, packed)
                except Exception as exc:  # noqa: BLE001  (informational; never lose the suite's rows to it)
                    meta[key] = bc.error_text(exc, "raised ")

    try:
        import cula.cache

        compile_seconds = getattr(cula.cache, "compile_seconds", None)
        if compile_seconds is not None:
            meta["cula_compile_s"] = {repr(k): round(v, 3) for k, v in compile_seconds().items()}
        from cula.kda.plan import KDA_TUNING

        meta["cula_tuning"] = dataclasses.asdict(KDA_TUNING.get((9, 0)))
    except ImportError:
        pass

    meta = {
        "FLA_FLASH_KDA": os.environ.get("FLA_FLASH_KDA"),
        "FLA_CULA": os.environ.get("FLA_CULA"),
        "CULA_BACKEND": os.environ.get("CULA_BACKEND", "unset"),
        "CULA_KDA_INTRA": os.environ.get("CULA_KDA_INTRA", "unset"),
        "shape": {"H": H, "HV": HV, "K": K, "V": V, "chunk": CHUNK, "dtype": "bfloat16", "state": "float32"},
        "call_flags": work.flags,
        **({"cula_split": {"segment": args.split, "halves": args.halves}} if args.split else {}),
        **({"cula_intra_any_gate": True} if args.any_gate else {}),
        **bc.run_meta(args, ceilings, WARN_TOL, FAIL_TOL),
        **meta,
    }
    paths = bc.write_suite(NAME + split_suffix(args), args, meta, rows, MD_COLUMNS)
    return meta, rows, paths


def cula_override(args: argparse.Namespace):
    """The tuning override for cula's calls: ``--split SEGMENT`` (and ``--halves``) cuts every sequence longer
    than SEGMENT tokens into pieces of that length, at any head count; ``--any-gate`` turns
    ``KdaTuning.intra_any_gate`` on; no override without them."""
    import contextlib

    from cula.kda.plan import KDA_TUNING
    from cula.time_split import SplitThresholds

    changes: dict[str, Any] = {}
    if args.split:
        exact = SplitThresholds(items_per_sm=1e9, busy_items_per_sm=1e9, min_segment=args.split, min_seq_len=0)
        changes.update(time_split=exact, time_split_halves=args.halves)
    if getattr(args, "any_gate", False):
        changes.update(intra_any_gate=True)
    return KDA_TUNING.override((9, 0), **changes) if changes else contextlib.nullcontext()


def split_suffix(args: argparse.Namespace) -> str:
    """The result name's mark of ``--split`` / ``--halves`` / ``--gate softplus`` / ``--any-gate`` on a main
    suite."""
    mark = f"_split{args.split}" + ("_halves" if args.halves else "") if args.split else ""
    if getattr(args, "gate", "lower_bound") != "lower_bound":
        mark += f"_{args.gate}"
    return mark + ("_anygate" if getattr(args, "any_gate", False) else "")


# ------------------------------------------------------------------------------------------- time-parallel suite

TP_NAME = NAME + "_time_parallel"
TP_GATE_SHIFT = -12.0  # see tp_inputs


def tp_shared(cfg: bc.TimeSplitConfig, device: str | None = None) -> dict[str, Any]:
    """Gate parameters and (packed) both copies of cu_seqlens, as ``make_shared`` for H value heads."""
    device = device or DEVICE
    torch.manual_seed(bc.config_seed(cfg.name) + 1)
    shared: dict[str, Any] = {
        "A_log": torch.empty(cfg.H, dtype=torch.float32, device=device).uniform_(1, 16).log(),
        "dt_bias": 0.1 * torch.randn(cfg.H * K, dtype=torch.float32, device=device),
    }
    if cfg.varlen:
        shared.update(bc.cu_seqlens(cfg.lens, device))
    return shared


def tp_inputs(cfg: bc.TimeSplitConfig, index: int, device: str | None = None) -> dict[str, torch.Tensor]:
    """One input set: q, k, v, g, beta bf16 (B = 1 packed for the ragged pack), initial_state fp32 [N, H, V, K].

    The gate logits are shifted by ``TP_GATE_SHIFT``: the fused lower-bound gate then decays under 1e-3 a token, so
    the state a segment starts with still counts at its end and the split-against-serial check tests the carry (the
    prefill suite's unshifted logits forget everything within a chunk in fp32). The time does not depend on it."""
    device = device or DEVICE
    torch.manual_seed(bc.config_seed(cfg.name) + 100 + index)
    b, h, bf16 = (1 if cfg.varlen else cfg.N), cfg.H, torch.bfloat16
    return {
        **{n: torch.randn(b, cfg.T, h, K, dtype=bf16, device=device) for n in ("q", "k", "v")},
        "g": torch.randn(b, cfg.T, h, K, dtype=bf16, device=device) + TP_GATE_SHIFT,
        "beta": torch.randn(b, cfg.T, h, dtype=bf16, device=device),
        "initial_state": 0.01 * torch.randn(cfg.N, h, V, K, dtype=torch.float32, device=device),
    }


def run_time_parallel_config(cfg: bc.TimeSplitConfig, args: argparse.Namespace, ceilings: dict[str, float]
                             ) -> dict[str, Any]:  # fmt: skip
    """Serial ``chunk_kda`` against the cut one at every segment length that cuts the longest sequence (the tuning
    entry overridden to cut at exactly that length)."""
    from cula.kda import chunk_kda
    from cula.kda.plan import KDA_TUNING
    from cula.time_split import SplitThresholds, split_plan

    shared = tp_shared(cfg)
    sets = bc.rotation_sets(cfg, tp_inputs, 2 * cfg.T * cfg.H * (4 * K + 1), args.l2)

    def call(s):
        return bind(chunk_kda, s, shared)

    def split(seg):
        plan = split_plan(cfg.lens, seg)
        if plan is None:
            return None
        # every sequence longer than seg cut into pieces of seg: aim at more segments than anything can give
        exact = SplitThresholds(items_per_sm=1e9, busy_items_per_sm=1e9, min_segment=seg, min_seq_len=0)
        return call, plan.num_segments, KDA_TUNING.override(time_split=exact, time_split_halves=args.halves)

    nbytes, flops = kda_bytes(cfg.lens, h=cfg.H, hv=cfg.H), kda_flops(cfg.lens, hv=cfg.H)
    floor = bc.floor_ms(nbytes, flops, ceilings["copy_bw_tbps"], ceilings["gemm_tflops"])
    # the serial column is the kernel unsplit, not the H200's default plan (which cuts long calls itself)
    serial = KDA_TUNING.override(time_split=None)
    return bc.time_split_row(cfg, sets, call, split, check, floor, args, serial_context=serial)


def main_time_parallel(args: argparse.Namespace, t_start: float) -> tuple[dict, list[dict], dict]:
    meta = {
        "shape": {"K": K, "V": V, "H = HV": "per row", "dtype": "bfloat16", "state": "float32 [N, H, V, K]",
                  "segments": list(bc.TIME_SPLIT_SEGMENTS)},
        "call_flags": CALL_FLAGS,
        "calls": {"serial": "cula.kda.chunk_kda under KDA_TUNING.override(time_split=None)",
                  "split": f"cula.kda.chunk_kda under KDA_TUNING.override(time_split=..., "
                           f"time_split_halves={args.halves})"},
    }  # fmt: skip
    name = TP_NAME + ("_halves" if args.halves else "")
    return bc.time_split_main(name, args, t_start, run_time_parallel_config, meta, WARN_TOL, FAIL_TOL)


if __name__ == "__main__":
    main()
