"""Shared machinery for every cula benchmark: timing, machine ceilings, floors, and the result writer.

Timing method (``bench``):

* Each timed call is bracketed by its own pair of CUDA events and the reported figure is the **median**
  over ``iters`` calls, after ``warmup`` untimed calls (which also absorb Triton autotuning and CuTe
  compilation).
* **L2 defeat, default ``l2="rotate"``**: the caller allocates several independent input sets
  (``n_rotation_sets``) whose combined size exceeds twice the L2 cache, and the timed calls cycle through
  them, so a call never finds its inputs left in L2 by the previous call. When one set alone exceeds
  2x L2 a single set is used, as streaming it already evicts itself. ``l2="flush"`` instead writes a
  256 MiB buffer before every timed call (outside the events); it is slower to run and kept as a cross-check.
* ``cuda_graph=True`` captures one CUDA graph per input set and times ``graph.replay()``, which removes
  Python and launch overhead; eager timing (the default) shows what a plain PyTorch caller sees, host
  gaps between a multi-kernel call's launches included.

The module imports on a CPU-only machine; anything that touches the GPU does so inside a function.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import gc
import importlib
import importlib.metadata
import io
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS_ROOT = Path(__file__).resolve().parent / "results"
# Used when the driver does not report the L2 size; the H200's L2 is 60 MB.
DEFAULT_L2_BYTES = 60 * 1024 * 1024
FLUSH_BYTES = 256 * 1024 * 1024
VERSION_PACKAGES = ("torch", "triton", "nvidia-cutlass-dsl", "fla-core", "cula", "flash-kda")


# ----------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Timing:
    """Summary of per-call times in milliseconds."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    mean_ms: float
    n: int

    @classmethod
    def from_samples(cls, samples_ms: Sequence[float]) -> Timing:
        s = sorted(samples_ms)
        if not s:
            raise ValueError("no timing samples")

        def pct(p: float) -> float:
            return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]

        return cls(statistics.median(s), pct(0.1), pct(0.9), s[0], statistics.fmean(s), len(s))


def l2_cache_bytes(device: torch.device | int | None = None) -> int:
    """L2 size the driver reports for ``device`` (falls back to the H200's 60 MB)."""
    try:
        dev = device if device is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(dev)
        size = int(getattr(props, "L2_cache_size", 0) or 0)
    except (RuntimeError, AssertionError):  # no CUDA device
        size = 0
    return size if size > 0 else DEFAULT_L2_BYTES


def n_rotation_sets(set_bytes: int, l2_bytes: int | None = None, factor: float = 2.0,
                    max_sets: int = 64) -> int:
    """How many input sets of ``set_bytes`` each to allocate so together they exceed ``factor`` x L2."""
    if set_bytes <= 0:
        raise ValueError(f"set_bytes must be positive, got {set_bytes}")
    l2 = l2_bytes if l2_bytes is not None else DEFAULT_L2_BYTES
    return int(max(1, min(max_sets, math.ceil(factor * l2 / set_bytes))))


def bench(
    fns: Callable[[], Any] | Sequence[Callable[[], Any]],
    *,
    iters: int = 100,
    warmup: int = 10,
    cuda_graph: bool = False,
    l2: str = "rotate",
) -> Timing:
    """Median per-call GPU time of ``fns``.

    Args:
        fns: one zero-argument callable per input set (see ``n_rotation_sets``); calls cycle through them.
            A single callable is allowed (one set).
        iters: timed calls.
        warmup: untimed calls before timing (and before capture in graph mode), at least one per set.
        cuda_graph: capture one CUDA graph per callable and time ``replay()`` instead of eager calls.
        l2: ``"rotate"`` (rely on the rotated sets) or ``"flush"`` (write a 256 MiB buffer before each call).

    Returns:
        ``Timing`` in milliseconds.
    """
    if callable(fns):
        fns = [fns]
    fns = list(fns)
    if not fns:
        raise ValueError("nothing to time")
    if l2 not in ("rotate", "flush"):
        raise ValueError(f"l2 must be 'rotate' or 'flush', got {l2!r}")

    # Graph capture wants its warm-up on a side stream so lazy initialisation (cuBLAS handles, Triton
    # autotuning, CuTe compilation) does not land inside the capture.
    side = torch.cuda.Stream() if cuda_graph else None
    warm_calls = max(warmup, len(fns))
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(warm_calls):
                fns[i % len(fns)]()
        torch.cuda.current_stream().wait_stream(side)
    else:
        for i in range(warm_calls):
            fns[i % len(fns)]()
    torch.cuda.synchronize()

    runners: list[Callable[[], Any]]
    graphs: list[torch.cuda.CUDAGraph] = []
    if cuda_graph:
        refuse_host_waits(fns, side)
        for fn in fns:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graphs.append(graph)
        runners = [g.replay for g in graphs]
        for r in runners:  # first replay uploads the graph; keep it out of the samples
            r()
        torch.cuda.synchronize()
    else:
        runners = fns

    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda") if l2 == "flush" else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    # as timeit does: the collector's passes over what the process holds (after a compilation, millions of objects)
    # are not the call's cost, yet a host-bound eager call would pay for them
    gc.collect()
    gc.disable()
    try:
        for i in range(iters):
            if flush is not None:
                flush.zero_()
            starts[i].record()
            runners[i % len(runners)]()
            ends[i].record()
        torch.cuda.synchronize()
    finally:
        gc.enable()
    samples = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    del graphs
    return Timing.from_samples(samples)


class NotCapturable(RuntimeError):
    """A call waits on the host (a device-to-host copy, ``.item()``, ``.tolist()``), so no CUDA graph can hold it."""


def refuse_host_waits(fns: Sequence[Callable[[], Any]], stream: torch.cuda.Stream) -> None:
    """Raise ``NotCapturable`` when a warmed call still synchronises with the host.

    A capture that fails part-way cannot be undone in-process: PyTorch 2.11 leaves its caching allocator
    routing the stream's allocations to the dead graph's pool and its RNG in capture mode, so every later row
    of the run fails (out of memory, "Offset increment outside graph capture"). One more call per set under
    ``torch.cuda.set_sync_debug_mode("error")`` finds the synchronising calls without capturing anything.
    """
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(stream):
            for fn in fns:
                fn()
    except RuntimeError as exc:
        if "synchroniz" not in str(exc):  # the debug mode's own error ("called a synchronizing CUDA operation")
            raise
        raise NotCapturable(f"not capturable, the call waits on the host: {exc}") from exc
    finally:
        torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize()


def measure_copy_bandwidth(nbytes: int = 1 << 30, iters: int = 30) -> float:
    """Device-to-device copy rate in TB/s: (bytes read + bytes written) / median time.

    ``nbytes`` is the size of each buffer (1 GiB, far above L2). H200 reference: about 4.27 TB/s.
    """
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src), iters=iters, warmup=3)
    return 2 * nbytes / (t.median_ms * 1e-3) / 1e12


def measure_bf16_gemm_tflops(n: int = 8192, iters: int = 30) -> float:
    """Dense bf16 ``n x n x n`` matmul rate in TFLOP/s (2 n^3 / median time). H200 reference: about 690."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    c = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
    t = bench(lambda: torch.mm(a, b, out=c), iters=iters, warmup=5)
    return 2 * n**3 / (t.median_ms * 1e-3) / 1e12


def measure_host_overhead(fn: Callable[[], Any], n: int = 100, warmup: int = 50, batches: int = 15) -> dict[str, float]:
    """Host-side cost of one call of ``fn`` (meant for tiny inputs), in microseconds per call.

    Returns:
        ``host_us``: median ``time.perf_counter`` duration of one Python call issued while the GPU is
        idle (a hidden host sync shows up here as GPU time); ``back_to_back_us``: wall time of ``n``
        calls with a single sync at the end, divided by ``n``, the median over ``batches`` such runs (one run
        alone moved by 10-20% between runs on the device's host); ``gpu_us``: median event time per call.
        ``back_to_back_us`` well above ``gpu_us`` means the call is host-bound at that size.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    host = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    back_to_back = back_to_back_us(fn, n, batches)
    gpu = bench(fn, iters=n, warmup=1)
    return {
        "host_us": statistics.median(host) * 1e6,
        "back_to_back_us": back_to_back,
        "gpu_us": gpu.median_ms * 1e3,
    }


def kernel_stats(fn: Callable[[], Any], calls: int = 5, warm: bool = True) -> dict[str, list[float]]:
    """Per kernel name (its first 90 characters): [device microseconds per call, launches per call] over ``calls``
    calls of ``fn`` under torch.profiler (after one more, unprofiled, with ``warm``), the longest first."""
    from torch.profiler import ProfilerActivity, profile

    if warm:
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, list[float]] = {}
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" or getattr(ev, "self_device_time_total", 0):
            us = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
            if us:
                out[ev.key[:90]] = [round(us / calls, 1), round(ev.count / calls, 2)]
    return dict(sorted(out.items(), key=lambda kv: -kv[1][0]))


def back_to_back_us(fn: Callable[[], Any], n: int = 100, batches: int = 15) -> float:
    """Wall time per call of ``n`` back-to-back calls of ``fn`` with one sync at the end, in microseconds: the
    median over ``batches`` such runs."""
    walls = []
    for _ in range(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) / n)
    return statistics.median(walls) * 1e6


def host_yardstick(device: torch.device | str) -> Callable[[], Callable[[], Any]]:
    """A maker for :func:`measure_host_overheads` of ``torch.empty(1, device=device)``: a call with no work of ours,
    timed beside the implementations as the host's own speed. On the H200's host it swung between 2.6-2.9 and
    4.7-5.3 us in stretches of seconds, the decode step's 15-16 against 22-25 us in lockstep: host figures of two
    runs compare only with their yardsticks."""
    return lambda: (lambda: torch.empty(1, device=device))


def host_speed_us(calls: int = 500) -> float:
    """The host's own speed now: :func:`host_yardstick`'s call on the current CUDA device, ``calls`` times back to
    back (:func:`back_to_back_us`, one run), in microseconds a call (a few milliseconds in all)."""
    return back_to_back_us(host_yardstick("cuda")(), n=calls, batches=1)


def measure_host_overheads(
    calls: dict[str, Callable[[], Callable[[], Any]]], rounds: int = 3, record: Callable | None = None
) -> dict[str, dict[str, float]]:
    """:func:`measure_host_overhead` of several implementations, in ``rounds`` interleaved rounds (each
    implementation once a round, in turn); per implementation and figure the lowest round's value, rounded to
    0.01 us.

    ``calls`` maps a label to a maker of the zero-argument call (made once). A slow stretch of the device's host
    (the first N=1 row of a suite has run 1.6-2x slower than the same calls a minute later, FLA's and cula's
    alike) then costs one round of every implementation instead of all of one. A label whose maker or call
    raises is left out (``record(label + " host overhead", exc)`` when given)."""
    fns, runs = {}, {}
    for label, make in calls.items():
        try:
            fns[label] = make()
        except Exception as exc:  # noqa: BLE001
            if record is not None:
                record(f"{label} host overhead", exc)
    for _ in range(rounds):
        for label in list(fns):
            try:
                runs.setdefault(label, []).append(measure_host_overhead(fns[label]))
            except Exception as exc:  # noqa: BLE001
                fns.pop(label)
                runs.pop(label, None)
                if record is not None:
                    record(f"{label} host overhead", exc)
    return {label: {k: round(min(r[k] for r in rs), 2) for k in rs[0]} for label, rs in runs.items()}


def record_host_overheads(row: dict, calls: dict[str, Callable[[], Callable[[], Any]]], device, record=None) -> None:
    """The N=1 rows' host figures of the decode benchmarks: :func:`measure_host_overheads` of ``calls`` with
    :func:`host_yardstick` on ``device`` beside them, all figures in ``row["host_overhead_us"]`` and the fla / cula
    ``back_to_back_us`` as ``row["fla_host_us"]`` / ``row["cula_host_us"]``."""
    host = measure_host_overheads({**calls, "host_yardstick": host_yardstick(device)}, record=record)
    for label in ("fla", "cula"):
        if label in host:
            row[f"{label}_host_us"] = host[label]["back_to_back_us"]
    row["host_overhead_us"] = host


class Progress:
    """One line per finished config on stderr, with elapsed time, so a long suite shows it is alive."""

    def __init__(self, total: int, name: str = ""):
        self.total = total
        self.name = name
        self.done = 0
        self.t0 = time.perf_counter()

    def update(self, label: str, **fields: Any) -> None:
        self.done += 1
        parts = [f"{k}={_fmt_value(k, v)}" for k, v in fields.items()]
        prefix = f"[{self.name} {self.done}/{self.total} +{time.perf_counter() - self.t0:.1f}s]"
        print(f"{prefix} {label} " + " ".join(parts), file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------
# Floors and summaries
# ----------------------------------------------------------------------------------------------------------


def floor_ms(nbytes: float, flops: float, copy_bw_tbps: float, gemm_tflops: float) -> float:
    """Lower bound on run time: max(bytes / copy bandwidth, flops / GEMM rate), in ms."""
    return max(nbytes / (copy_bw_tbps * 1e12), flops / (gemm_tflops * 1e12)) * 1e3


def floor_pct(floor: float, impl_ms: float | None) -> float | None:
    """How close an implementation is to the floor: floor_ms / impl_ms * 100 (100 = at the floor)."""
    if impl_ms is None or not impl_ms > 0 or not math.isfinite(impl_ms):
        return None
    return floor / impl_ms * 100.0


def bw_fraction(nbytes: float, impl_ms: float | None, copy_bw_tbps: float) -> float | None:
    """Achieved bytes/s over the measured copy bandwidth (1.0 = as fast as a device-to-device copy)."""
    if impl_ms is None or not impl_ms > 0 or not math.isfinite(impl_ms):
        return None
    return nbytes / (impl_ms * 1e-3) / (copy_bw_tbps * 1e12)


def speedup(ref_ms: float | None, impl_ms: float | None) -> float | None:
    """ref_ms / impl_ms, or None when either side is missing."""
    if ref_ms is None or impl_ms is None or not impl_ms > 0 or not math.isfinite(ref_ms * impl_ms):
        return None
    return ref_ms / impl_ms


def geomean(values: Sequence[float | None]) -> float:
    """Geometric mean of the positive finite values (None/NaN skipped); NaN when none are left."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    if not vals:
        return float("nan")
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def summarize(rows: Sequence[dict], key: str = "speedup") -> dict[str, Any]:
    """Geomean / min / max of ``row[key]`` and the config that holds the minimum."""
    pairs = [(r.get(key), r) for r in rows]
    pairs = [(v, r) for v, r in pairs if v is not None and math.isfinite(v) and v > 0]
    if not pairs:
        return {"geomean": float("nan"), "min": float("nan"), "max": float("nan"), "min_config": None, "n": 0}
    vmin, rmin = min(pairs, key=lambda p: p[0])
    return {
        "geomean": geomean([v for v, _ in pairs]),
        "min": vmin,
        "max": max(v for v, _ in pairs),
        "min_config": row_label(rmin),
        "n": len(pairs),
    }


# ----------------------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------------------


def package_versions(packages: Sequence[str] = VERSION_PACKAGES) -> dict[str, str]:
    """Installed distribution versions (importlib.metadata), "missing" when not installed."""
    out = {}
    for pkg in packages:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "missing"
    if out.get("cula") == "missing":
        # Run from a checkout (as on the GPU machine) rather than an installed distribution.
        try:
            import cula

            out["cula"] = f"{cula.__version__} (checkout)"
        except ImportError:
            pass
    return out


def _driver_version() -> str:
    """Kernel-driver version string (e.g. "570.124.06"); torch only exposes the CUDA runtime version."""
    try:
        res = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            check=False, capture_output=True, text=True, timeout=20,
        )
        if res.returncode == 0 and res.stdout.strip():
            return res.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass  # no nvidia-smi on PATH: try NVML below
    try:
        import pynvml

        pynvml.nvmlInit()
        ver = pynvml.nvmlSystemGetDriverVersion()
        return ver.decode() if isinstance(ver, bytes) else str(ver)
    except Exception:  # noqa: BLE001  (pynvml missing or NVMLError: the version is informational only)
        return "unknown"


def _git_revision() -> str:
    """Commit of the checkout being benchmarked (``+dirty`` with local edits); identifies cula's code."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, cwd=root,
                             capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], check=False,
                               cwd=root, capture_output=True, text=True, timeout=10)
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _code_tree() -> str:
    """Git tree id of cula/ as the working tree holds it, tracked or not (ignored files aside): ``git rev-parse
    REV:cula`` prints the same id for the commit whose kernels ran, so it names the code where ``cula_git`` cannot
    (the device's copy of .git can lag the checkout it travels with: its HEAD is then an older commit, "+dirty")."""
    root = Path(__file__).resolve().parent.parent
    try:
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, GIT_INDEX_FILE=os.path.join(tmp, "index"))
            added = subprocess.run(["git", "add", "-A", "cula"], check=False, cwd=root, env=env,
                                   capture_output=True, text=True, timeout=30)
            tree = subprocess.run(["git", "write-tree", "--prefix=cula/"], check=False, cwd=root, env=env,
                                  capture_output=True, text=True, timeout=30)
        if added.returncode or tree.returncode:
            return "unknown"
        return tree.stdout.strip()[:12]
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def gpu_slug(gpu_name: str) -> str:
    """Directory name for a GPU: "NVIDIA H200" -> "nvidia-h200"."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")
    return slug or "unknown-gpu"


def environment_meta() -> dict[str, Any]:
    """GPU, driver, CUDA and package versions, date and python; no hostname. Works without a GPU."""
    meta: dict[str, Any] = {}
    if torch.cuda.is_available():
        dev = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(dev)
        meta["gpu_name"] = props.name
        meta["compute_capability"] = f"{props.major}.{props.minor}"
        meta["sm_count"] = props.multi_processor_count
        meta["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        meta["l2_cache_mb"] = round(l2_cache_bytes(dev) / 2**20, 1)
        meta["driver_version"] = _driver_version()
    else:
        meta["gpu_name"] = "cpu"
        meta["driver_version"] = "n/a"
    meta["cuda_version"] = torch.version.cuda or "n/a"
    meta["versions"] = package_versions()
    meta["cula_git"] = _git_revision()
    meta["cula_tree"] = _code_tree()
    meta["python"] = platform.python_version()
    meta["date"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return meta


def machine_ceilings() -> dict[str, float]:
    """Copy bandwidth (TB/s) and bf16 GEMM rate (TFLOP/s), measured now, for floors and bw fractions."""
    return {"copy_bw_tbps": measure_copy_bandwidth(), "gemm_tflops": measure_bf16_gemm_tflops()}


def reported_ceilings(name: str, note: str = "") -> dict[str, float]:
    """``machine_ceilings()``, also printed on stderr with the L2 size (and ``note``) under ``[name]``."""
    ceilings = machine_ceilings()
    line = (f"[{name}] copy {ceilings['copy_bw_tbps']:.3f} TB/s, bf16 GEMM {ceilings['gemm_tflops']:.1f} "
            f"TFLOP/s, L2 {l2_cache_bytes() / 2**20:.0f} MiB")
    print(line + (f", {note}" if note else ""), file=sys.stderr, flush=True)
    return ceilings


# ----------------------------------------------------------------------------------------------------------
# Writer
# ----------------------------------------------------------------------------------------------------------

_REQUIRED_META = ("gpu_name", "driver_version", "cuda_version", "versions", "date", "copy_bw_tbps",
                  "gemm_tflops")


def row_label(row: dict) -> str:
    """Short name of a row: its ``config`` entry, else its non-measurement entries joined."""
    if "config" in row:
        return str(row["config"])
    skip = ("_ms", "_pct", "speedup", "err", "fraction")
    return ",".join(f"{k}={v}" for k, v in row.items() if not any(s in k for s in skip))


def _fmt_value(key: str, v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if key.endswith("_ms"):
            return f"{v:.4f}"
        if key == "speedup" or key.endswith("fraction"):
            return f"{v:.3f}"
        if key.endswith("_pct"):
            return f"{v:.1f}"
        if "err" in key:
            return f"{v:.2e}"
        return f"{v:.4g}"
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(_jsonable(v))
    return str(v)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None  # strict JSON has no NaN/Inf
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def render_markdown(name: str, meta: dict, rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """Markdown report: meta as a bullet list, one table row per config, then the summary line."""
    if columns is None:
        columns = []
        for r in rows:
            columns.extend(k for k in r if k not in columns and not isinstance(r[k], (list, dict)))
    lines = [f"# {name}", ""]
    for k, v in meta.items():
        lines.append(f"- **{k}**: {_fmt_value(k, v)}")
    lines += ["", "| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt_value(c, r.get(c)) for c in columns) + " |")
    s = summarize(rows)
    lines.append("")
    if s["n"]:
        lines.append(
            f"**Summary**: geomean speedup {s['geomean']:.3f}x over {s['n']} configs; "
            f"min {s['min']:.3f}x ({s['min_config']}); max {s['max']:.3f}x."
        )
    else:
        lines.append("**Summary**: no config has a speedup.")
    missing = len(rows) - s["n"]
    if missing:
        lines[-1] += f" {missing} config(s) have no speedup (failed check or timing) and are left out."
    return "\n".join(lines) + "\n"


def plot_speedup(path: Path, name: str, rows: Sequence[dict], subtitle: str = "") -> None:
    """Bar chart of ``speedup`` per config with a line at 1.0 (Agg backend, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [row_label(r) for r in rows]
    vals = [r.get("speedup") for r in rows]
    heights = [v if v is not None and math.isfinite(v) else 0.0 for v in vals]
    colors = ["tab:green" if h >= 1.0 else "tab:red" for h in heights]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(rows) + 2.0), 5.0))
    bars = ax.bar(range(len(rows)), heights, color=colors)
    for bar, v in zip(bars, vals):
        text = "n/a" if v is None or not math.isfinite(v) else f"{v:.2f}"
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=7, rotation=90, xytext=(0, 2), textcoords="offset points")
    ax.axhline(1.0, color="black", linewidth=1.0, linestyle="--")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("speedup (fla_ms / cula_ms)")
    s = summarize(rows)
    title = f"{name}: geomean {s['geomean']:.3f}x" if s["n"] else name
    ax.set_title(title + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    ax.set_ylim(0, max([1.2] + [h * 1.15 for h in heights]))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=120)
    plt.close(fig)
    _save_palette_png(buf, path)


def _save_palette_png(buf: io.BytesIO, path: Path) -> None:
    """The chart as a 64-colour palette PNG: a third of the RGBA file's bytes for the same picture (the results
    travel with every device call, whose upload is capped)."""
    from PIL import Image

    buf.seek(0)
    with Image.open(buf) as img:
        img.convert("RGB").quantize(colors=64).save(path, optimize=True)


def write_results(
    name: str,
    meta: dict,
    rows: Sequence[dict],
    out_dir: str | os.PathLike | None = None,
    md_columns: Sequence[str] | None = None,
) -> dict[str, Path]:
    """Write ``<out_dir>/<gpu-slug>/<name>.{md,json,png}``.

    Args:
        name: result name, e.g. ``"kda_prefill"``.
        meta: benchmark-specific keys (e.g. ``{"FLA_FLASH_KDA": "0"}``, ``copy_bw_tbps``, ``gemm_tflops``);
            ``environment_meta()`` fills GPU / driver / CUDA / versions / date for keys not given, and
            a missing ceiling is recorded as "not measured".
        rows: one dict per config: its parameters, ``fla_ms``, ``cula_ms``, ``speedup`` and extras.
        out_dir: results root (default ``benchmarks/results``).
        md_columns: columns of the markdown table (default: every scalar key, first-seen order);
            the JSON always holds every key.

    Returns:
        ``{"md": path, "json": path, "png": path}``.
    """
    full = environment_meta()
    full.update(meta)
    for key in _REQUIRED_META:
        full.setdefault(key, "not measured")
    root = Path(out_dir) if out_dir is not None else RESULTS_ROOT
    target = root / gpu_slug(str(full["gpu_name"]))
    target.mkdir(parents=True, exist_ok=True)
    paths = {ext: target / f"{name}.{ext}" for ext in ("md", "json", "png")}
    rows = list(rows)
    summary = summarize(rows)
    payload = {"meta": _jsonable({**full, "summary": summary}), "rows": _jsonable(rows)}
    paths["json"].write_text(json.dumps(payload, indent=2) + "\n")
    paths["md"].write_text(render_markdown(name, full, rows, md_columns))
    subtitle = f"{full['gpu_name']}, {full['date']}"
    plot_speedup(paths["png"], name, rows, subtitle)
    return paths


class Interrupted(BaseException):
    """A SIGTERM (e.g. from `timeout`) arrived while a suite was running.

    A BaseException, so the per-config `except Exception` guards do not swallow it.
    """


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Turn SIGTERM into ``Interrupted`` so a suite killed by a time limit still writes the rows it has."""

    def handler(signum, _frame):
        raise Interrupted(f"signal {signum}")

    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may install signal handlers; elsewhere SIGTERM keeps its default
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ----------------------------------------------------------------------------------------------------------
# Suite machinery shared by the bench_<op>_<mode>.py scripts
# ----------------------------------------------------------------------------------------------------------

ERROR_CHARS = 300  # a long CUDA or compiler message is cut here so it cannot swamp a row or a meta entry
# Row keys every script's progress line shows; a script appends its own (backend, floor_pct, ...).
PROGRESS_KEYS = ("fla_ms", "cula_ms", "speedup", "max_rel_err", "check")


def config_seed(name: str) -> int:
    """Seed derived from a config's name, so every run (and every script using it) sees the same data."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def cu_seqlens(lens: Sequence[int], device: str | torch.device) -> dict[str, torch.Tensor]:
    """int32 varlen offsets ``[0, l0, l0 + l1, ...]`` as ``{"cu_seqlens_cpu": ..., "cu_seqlens": ...}``."""
    cu = [0]
    for length in lens:
        cu.append(cu[-1] + length)
    host = torch.tensor(cu, dtype=torch.int32)
    return {"cu_seqlens_cpu": host, "cu_seqlens": host.to(device)}


def error_text(exc: BaseException, prefix: str = "") -> str:
    """``"<prefix><ExceptionType>: <message>"``, cut to ``ERROR_CHARS`` characters."""
    return f"{prefix}{type(exc).__name__}: {exc}"[:ERROR_CHARS]


def error_recorder(errors: dict[str, str], config: str) -> Callable[[str, BaseException], None]:
    """``record(label, exc)``: keep ``exc`` as ``errors[label]`` (the row's ``errors``) and warn on stderr.

    A raising call costs its cell of the row, not the suite; the row says what raised.
    """

    def record(label: str, exc: BaseException) -> None:
        errors[label] = error_text(exc)
        print(f"WARNING: {config}: {label} raised {errors[label]}", file=sys.stderr, flush=True)

    return record


def check_outputs(pairs: Iterable[tuple[torch.Tensor | None, torch.Tensor | None]], warn_tol: float,
                  fail_tol: float) -> tuple[float, str]:
    """Compare cula's outputs with FLA's: ``(max relative RMSE, "ok" | "warn" | "FAIL")``.

    Args:
        pairs: ``(fla, cula)`` tensor pairs of any shape and float dtype, checked in order (e.g. ``o`` then
            the final state); the relative RMSE is ``cula.testing.rel_rmse`` (float64, in chunks).
        warn_tol: above this error the status is ``"warn"``.
        fail_tol: above this error, or NaN, the status is ``"FAIL"`` (the caller then does not time cula).

    The first pair that cannot be compared decides: a missing tensor or a shape mismatch gives
    ``(inf, "FAIL")``, a non-finite FLA tensor ``(nan, "FAIL")``, a non-finite cula tensor ``(inf, "FAIL")``.
    """
    from cula.testing import rel_rmse

    errs = []
    for ref, out in pairs:
        if out is None or ref is None or out.shape != ref.shape:
            return float("inf"), "FAIL"
        if not torch.isfinite(ref).all():
            return float("nan"), "FAIL"
        if not torch.isfinite(out).all():
            return float("inf"), "FAIL"
        errs.append(rel_rmse(ref, out))
    err = max(errs)
    if not err <= fail_tol:
        return err, "FAIL"
    return err, ("warn" if err > warn_tol else "ok")


def warn_check(config: str, err: float, status: str) -> None:
    """Say on stderr when a config's check is not ``ok``."""
    if status != "ok":
        print(f"WARNING: {config}: cula vs FLA relative RMSE {err:.3e} -> {status}"
              + (" (cula not timed)" if status == "FAIL" else ""), file=sys.stderr, flush=True)


def call_recording_backend(call: Callable[[], Any], registry: str) -> tuple[Any, str]:
    """Run ``call`` (a zero-argument cula call) and name the cula backend that served it.

    A speedup near 1.0 from a call that fell back to FLA looks like a slow kernel unless the row says so.

    Args:
        call: the cula call.
        registry: ``"module:attribute"`` of the ``cula.backends.Registry`` the call dispatches through,
            e.g. ``"cula.kda.backends:chunk_kda_registry"``.

    Returns:
        ``(call(), backend name)``; the name is ``"unknown"`` when the registry cannot be imported or the
        call selected no backend.
    """
    module, _, attr = registry.partition(":")
    try:
        reg = getattr(importlib.import_module(module), attr)
        from cula.backends import clear_plan_caches
    except (ImportError, AttributeError):
        return call(), "unknown"
    clear_plan_caches()  # a call with a cached signature would not consult the registry
    chosen: list[str] = []
    original = reg.select

    def spy(device, args, *skip):
        backend = original(device, args, *skip)
        chosen.append(backend.name)
        return backend

    reg.select = spy  # instance attribute shadows the method for this one call
    try:
        out = call()
    finally:
        del reg.select
    return out, (chosen[0] if chosen else "unknown")


def rotation_sets(cfg: Any, make_set: Callable[[Any, int], Any], set_bytes: int, l2: str) -> list:
    """One config's input sets ``make_set(cfg, i)``: enough to exceed 2x L2 under ``--l2 rotate``, else one.

    ``set_bytes`` is what one call reads from its inputs (see ``n_rotation_sets``).
    """
    n_sets = n_rotation_sets(set_bytes, l2_cache_bytes()) if l2 == "rotate" else 1
    return [make_set(cfg, i) for i in range(n_sets)]


def timed(label: str, make: Callable[[Any], Callable[[], Any]], sets: Sequence, args: argparse.Namespace,
          record: Callable[[str, BaseException], None]) -> Timing | None:
    """Time one implementation over ``sets`` with the run's ``--iters --warmup --cuda-graph --l2``.

    ``make(set)`` builds the zero-argument call on one input set. A failure (e.g. graph capture refused) is
    recorded as ``"<label> timing"`` and returns None: it costs that cell, not the suite.
    """
    try:
        return bench([make(s) for s in sets], iters=args.iters, warmup=args.warmup,
                     cuda_graph=args.cuda_graph, l2=args.l2)
    except Exception as exc:  # noqa: BLE001
        record(f"{label} timing", exc)
        torch.cuda.synchronize()
        return None


def time_pair(fla: Callable[[Any], Callable[[], Any]] | None, cula: Callable[[Any], Callable[[], Any]] | None,
              sets: Sequence, args: argparse.Namespace,
              record: Callable[[str, BaseException], None]) -> tuple[Timing | None, Timing | None]:
    """``(fla timing, cula timing)``: FLA, then cula, timed over the same input sets with ``timed``.

    ``fla`` / ``cula`` build one implementation's call on an input set; pass None for a side that must not
    be timed (FLA's check call raised, or cula failed the check): its timing is None.
    """
    fla_t = timed("fla", fla, sets, args, record) if fla is not None else None
    cula_t = timed("cula", cula, sets, args, record) if cula is not None else None
    return fla_t, cula_t


def median_ms(t: Timing | None) -> float | None:
    """``t.median_ms``, None for an implementation that was not timed."""
    return t.median_ms if t is not None else None


def spread_fields(fla_t: Timing | None, cula_t: Timing | None) -> dict[str, float | None]:
    """The rows' ``fla_p10_ms fla_p90_ms cula_p10_ms cula_p90_ms`` (None for an untimed side)."""
    return {
        "fla_p10_ms": fla_t.p10_ms if fla_t else None, "fla_p90_ms": fla_t.p90_ms if fla_t else None,
        "cula_p10_ms": cula_t.p10_ms if cula_t else None, "cula_p90_ms": cula_t.p90_ms if cula_t else None,
    }


@dataclasses.dataclass
class SuiteRun:
    """What ``run_suite`` did; unpacks as ``rows, skipped = run_suite(...)``."""

    rows: list[dict]
    skipped: list[str]  # names of the configs that have no row (cut by the time budget or a SIGTERM)
    interrupted: str | None = None  # e.g. "signal 15" when a SIGTERM stopped the suite

    def __iter__(self) -> Iterator[list]:
        return iter((self.rows, self.skipped))

    def partial_note(self, n_configs: int, max_seconds: float | None) -> dict[str, str]:
        """The results' ``{"partial": why}`` entry when the suite stopped early, else ``{}``."""
        if self.interrupted:
            return {"partial": f"interrupted ({self.interrupted}) after {len(self.rows)} of {n_configs} configs"}
        if self.skipped:
            return {"partial": f"stopped after {max_seconds or 0:.0f} s: {len(self.rows)} of {n_configs} configs"}
        return {}


def run_suite(
    cfgs: Sequence[Any],
    run_one: Callable[[Any], dict],
    max_seconds: float | None,
    t_start: float,
    on_row: Callable[[Any, dict], None] | None = None,
    *,
    name: str = "bench",
    progress: Sequence[str] | None = None,
    record_wall: bool = True,
) -> SuiteRun:
    """Run ``run_one`` over ``cfgs`` in order, one row per config, and stop early without losing rows.

    * No config starts once ``max_seconds`` have passed since ``t_start`` (``time.perf_counter``);
      ``None`` means no limit. The rest are listed in ``SuiteRun.skipped``.
    * A SIGTERM (e.g. from ``timeout``) ends the suite with the rows it has (``SuiteRun.interrupted``;
      the config it cut short is skipped), so the caller still writes them.
    * An exception escaping ``run_one`` becomes a FAIL row for that config
      (``config check fla_ms cula_ms speedup errors``); the suite goes on.
    * The CUDA caching allocator is emptied after every config, so one config's multi-GB input sets do not
      crowd the next.
    * On a GPU each row records ``host_speed_us``, ``torch.empty(1)`` back to back just before the config ran: the
      host's own speed then (the device's host has slow stretches of seconds, which move every eager figure of a
      host-bound row, FLA's and cula's alike; see ``host_yardstick``).

    Args:
        cfgs: configs, each with a ``name``.
        run_one: config -> row.
        max_seconds: the time budget in seconds, or None.
        t_start: ``time.perf_counter()`` the budget counts from.
        on_row: called with ``(config, row)`` after each row.
        name: the benchmark's name, prefix of its stderr lines.
        progress: row keys to print on a ``Progress`` line per finished config (None: no progress lines).
        record_wall: put each config's wall time in its row as ``wall_s``.

    Returns:
        ``SuiteRun(rows, skipped, interrupted)``.
    """
    rows: list[dict] = []
    interrupted = None
    bar = Progress(len(cfgs), name) if progress is not None else None
    with sigterm_as_interrupt():
        try:
            for cfg in cfgs:
                if max_seconds is not None and time.perf_counter() - t_start > max_seconds:
                    print(f"[{name}] --max-seconds {max_seconds:g} reached: skipping "
                          f"{len(cfgs) - len(rows)} config(s)", file=sys.stderr, flush=True)
                    break
                host = host_speed_us() if torch.cuda.is_available() else None
                t0 = time.perf_counter()
                try:
                    row = run_one(cfg)
                except Exception as exc:  # noqa: BLE001  (anything run_one did not catch still costs one row)
                    row = {"config": cfg.name, "check": "FAIL", "fla_ms": None, "cula_ms": None,
                           "speedup": None, "errors": {"config": error_text(exc)}}
                if record_wall:
                    row["wall_s"] = round(time.perf_counter() - t0, 2)
                if host is not None:
                    row["host_speed_us"] = round(host, 2)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                rows.append(row)
                if bar is not None:
                    bar.update(cfg.name, **{k: row.get(k) for k in progress})
                if on_row is not None:
                    on_row(cfg, row)
        except Interrupted as exc:
            interrupted = str(exc)
            print(f"[{name}] interrupted ({exc}) after {len(rows)} of {len(cfgs)} configs",
                  file=sys.stderr, flush=True)
    return SuiteRun(rows, [c.name for c in cfgs[len(rows):]], interrupted)


def arg_parser(
    description: str,
    quick: Sequence[str],
    *,
    iters: int,
    warmup: int,
    warmup_help: str = "untimed calls before timing",
    max_seconds: float | None = None,
    max_seconds_help: str = "start no new config after this many seconds since launch; results are still "
                            "written and marked partial",
    host_overhead_help: str | None = None,
) -> argparse.ArgumentParser:
    """The options every benchmark takes: ``--quick --iters --warmup --max-seconds --out --cuda-graph --l2
    --configs``, plus ``--no-host-overhead`` when ``host_overhead_help`` is given.

    ``quick`` names the ``--quick`` configs; the keyword arguments are the script's defaults and help texts.
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help=f"only {len(quick)} configs: {', '.join(quick)}")
    p.add_argument("--iters", type=int, default=iters, help="timed calls per implementation and config")
    p.add_argument("--warmup", type=int, default=warmup, help=warmup_help)
    p.add_argument("--max-seconds", type=float, default=max_seconds, help=max_seconds_help)
    p.add_argument("--out", default=None, help="results root (default benchmarks/results); files go to "
                   "<out>/<gpu-slug>/")
    p.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays instead of eager calls")
    p.add_argument("--l2", choices=("rotate", "flush"), default="rotate",
                   help="keep inputs out of L2 by rotating input sets (default) or flushing 256 MiB")
    p.add_argument("--configs", default=None, help="comma-separated config names to run (default: all)")
    p.add_argument("--merge", default=None, metavar="JSON",
                   help="merge this run's rows into an earlier result of the same suite (a config run again "
                        "replaces its row) and write the whole under the suite's name: a suite longer than one "
                        "device call, run in parts")  # fmt: skip
    if host_overhead_help is not None:
        p.add_argument("--no-host-overhead", action="store_true", help=host_overhead_help)
    return p


def result_name(name: str, args: argparse.Namespace) -> str:
    """``name`` for the default run; non-default modes get a suffix so they do not overwrite it."""
    if args.cuda_graph:
        name += "_cudagraph"
    if args.l2 == "flush":
        name += "_flush"
    if args.quick or args.configs:
        name += "_subset"
    return name


def select_configs(suite: Callable[..., list], args: argparse.Namespace) -> list:
    """The configs this run will try, in suite order: ``suite(quick)``, or the ``--configs`` names."""
    if not args.configs:
        return suite(args.quick)
    wanted = set(args.configs.split(","))
    unknown = wanted - {c.name for c in suite()}
    if unknown:
        raise SystemExit(f"unknown configs: {sorted(unknown)}")
    return [c for c in suite() if c.name in wanted]


@contextlib.contextmanager
def env_var(name: str, value: str) -> Iterator[None]:
    """Set ``os.environ[name]`` for the block, then restore the previous value (or its absence).

    Lets an in-process caller (such as a GPU test) run a benchmark without leaking the setting.
    """
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def run_meta(args: argparse.Namespace, ceilings: dict[str, float], warn_tol: float, fail_tol: float,
             rotate: str = "rotate input sets to > 2x L2") -> dict[str, Any]:
    """Meta entries every benchmark writes: ``timing tolerance copy_bw_tbps gemm_tflops``, in that order.

    ``rotate`` describes ``--l2 rotate`` for this benchmark's input sets.
    """
    return {
        "timing": {"mode": "cuda_graph" if args.cuda_graph else "eager", "stat": "median",
                   "iters": args.iters, "warmup": args.warmup,
                   "l2": rotate if args.l2 == "rotate" else "flush 256 MiB before each call"},
        "tolerance": {"warn": warn_tol, "fail": fail_tol},
        "copy_bw_tbps": round(ceilings["copy_bw_tbps"], 4),
        "gemm_tflops": round(ceilings["gemm_tflops"], 2),
    }


def budget_meta(run: SuiteRun, max_seconds: float | None, t_start: float) -> dict[str, Any]:
    """``partial`` and ``wall_s`` (seconds since ``t_start``), plus ``skipped_configs`` and ``max_seconds``
    when configs were skipped and ``interrupted`` when a SIGTERM stopped the suite."""
    meta: dict[str, Any] = {"partial": bool(run.skipped), "wall_s": round(time.perf_counter() - t_start, 1)}
    if run.skipped:
        meta["skipped_configs"] = run.skipped
        meta["max_seconds"] = max_seconds
    if run.interrupted:
        meta["interrupted"] = run.interrupted
    return meta


def write_suite(name: str, args: argparse.Namespace, meta: dict, rows: Sequence[dict],
                md_columns: Sequence[str], suite_names: Sequence[str] | None = None) -> dict[str, Path]:
    """``write_results`` under ``result_name(name, args)`` in ``--out``, then the summary line on stderr. With
    ``--merge`` the rows join the earlier result's (:func:`merge_results`; ``suite_names``: the full suite's
    config names, for the order and what is still missing) under the suite's own name."""
    out_name = result_name(name, args)
    if getattr(args, "merge", None):
        meta, rows = merge_results(Path(args.merge), meta, rows, suite_names)
        out_name = result_name(name, argparse.Namespace(**{**vars(args), "quick": False, "configs": None}))
    paths = write_results(out_name, meta, rows, out_dir=args.out, md_columns=md_columns)
    summary = summarize(rows)
    print(f"[{name}] geomean speedup {summary['geomean']:.3f}x, min {summary['min']:.3f}x "
          f"({summary['min_config']}); wrote {paths['md']}", file=sys.stderr, flush=True)
    n_bad = sum(r.get("check") == "FAIL" for r in rows)
    if n_bad:
        print(f"[{name}] {n_bad} config(s) FAILED the correctness check and were not timed", file=sys.stderr)
    return paths


def merge_results(path: Path, meta: dict, rows: Sequence[dict], suite_names: Sequence[str] | None = None
                  ) -> tuple[dict, list[dict]]:  # fmt: skip
    """An earlier result (``path``, JSON) with this run's ``rows`` merged in: a config run again replaces its row;
    every row carries the ``cula_git`` of the run that measured it, and ``meta["merged_runs"]`` lists each run's
    commit, code tree (``cula_tree``), date and configs. With ``suite_names`` the rows follow the suite's order and
    ``partial`` / ``missing_configs`` say what no run has measured yet."""
    old = json.loads(Path(path).read_text())
    env: dict[str, Any] = {}

    def from_run(key: str) -> Any:
        # the run's own meta holds these (run_meta takes them from environment_meta); this machine's only where it
        # does not, and read once (environment_meta queries the GPU, the packages and git)
        if key in meta:
            return meta[key]
        if not env:
            env.update(environment_meta())
        return env.get(key)

    git, date, tree = from_run("cula_git"), from_run("date"), from_run("cula_tree")
    merged = {r["config"]: {**r, "cula_git": r.get("cula_git", old["meta"].get("cula_git"))} for r in old["rows"]}
    for r in rows:
        merged[r["config"]] = {**r, "cula_git": git}
    order = {n: i for i, n in enumerate(suite_names or ())}
    out = sorted(merged.values(), key=lambda r: order.get(r["config"], len(order)))
    runs = old["meta"].get("merged_runs") or [
        {"cula_git": old["meta"].get("cula_git"), "date": old["meta"].get("date"),
         "configs": [r["config"] for r in old["rows"]]}
    ]  # fmt: skip
    meta = {k: v for k, v in meta.items() if k not in ("skipped_configs", "max_seconds", "partial")}
    meta["merged_runs"] = runs + [{"cula_git": git, "cula_tree": tree, "date": date,
                                   "configs": [r["config"] for r in rows]}]  # fmt: skip
    if suite_names is not None:
        missing = [n for n in suite_names if n not in merged]
        meta["partial"] = bool(missing)
        if missing:
            meta["missing_configs"] = missing
    return meta, out


# --------------------------------------------------------------------------------- time-parallel (split) suites
# Few-head long sequences, where a serial recurrence leaves most SMs idle: each row times the serial path against
# the split one at every segment length that cuts the longest sequence, eager and CUDA-graph replay side by side,
# each split checked against the serial output first. Shared by bench_lightning_prefill.py and bench_kda_prefill.py
# (``--time-parallel``); their results set the planners' ``time_split`` thresholds.

TIME_SPLIT_HEADS = (4, 8, 16)
TIME_SPLIT_T = (16384, 65536, 262144, 1048576)
TIME_SPLIT_SEGMENTS = (1024, 2048, 4096, 8192, 16384, 32768)
TIME_SPLIT_PACK = (65536,) + (1024,) * 5
TIME_SPLIT_QUICK = ("H4-B1-T65536", "H4-pack-64K+5x1K")
TIME_SPLIT_COLUMNS = (
    "config", "H", "T", "N", "serial_ms", "serial_graph_ms", "best_segment", "split_ms", "split_graph_ms", "speedup",
    "graph_speedup", "max_rel_err", "check", "floor_ms", "floor_pct",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TimeSplitConfig:
    H: int
    lens: tuple[int, ...]
    varlen: bool

    @property
    def name(self) -> str:
        if self.varlen:
            return f"H{self.H}-pack-{self.lens[0] // 1024}K+{len(self.lens) - 1}x{self.lens[1] // 1024}K"
        return f"H{self.H}-B{len(self.lens)}-T{self.lens[0]}"

    @property
    def T(self) -> int:
        return sum(self.lens) if self.varlen else self.lens[0]

    @property
    def N(self) -> int:
        return len(self.lens)


def time_split_suite(quick: bool = False) -> list[TimeSplitConfig]:
    cfgs = [TimeSplitConfig(h, (t,), False) for h in TIME_SPLIT_HEADS for t in TIME_SPLIT_T]
    cfgs += [TimeSplitConfig(h, (65536,) * 2, False) for h in TIME_SPLIT_HEADS]
    cfgs += [TimeSplitConfig(h, TIME_SPLIT_PACK, True) for h in TIME_SPLIT_HEADS]
    return [c for c in cfgs if c.name in TIME_SPLIT_QUICK] if quick else cfgs


def time_split_main(
    name: str, args: argparse.Namespace, t_start: float, row: Callable, meta: dict[str, Any], warn_tol: float,
    fail_tol: float, suite: Callable[..., list] = time_split_suite,
) -> tuple[dict, list[dict], dict]:
    """Run a time-split suite (``row(cfg, args, ceilings)`` per config) and write it as ``name``, ``meta`` first in
    the result's meta."""
    cfgs = select_configs(suite, args)
    ceilings = reported_ceilings(name)
    with torch.inference_mode():
        # --max-seconds 0 is no limit in the scripts with these suites (bench_kda_prefill's default)
        run = run_suite(cfgs, lambda cfg: row(cfg, args, ceilings), args.max_seconds or None, t_start, name=name,
                        progress=("speedup", "graph_speedup", "best_segment", "check"))  # fmt: skip
    args.cuda_graph = False  # every row already has both; keep the result name free of the graph suffix
    meta = {**meta, **run_meta(args, ceilings, warn_tol, fail_tol), **budget_meta(run, args.max_seconds, t_start)}
    meta["timing"]["mode"] = "eager and cuda_graph (both in every row)"
    paths = write_suite(name, args, meta, run.rows, TIME_SPLIT_COLUMNS)
    return meta, run.rows, paths


def eager_and_graph_ms(label: str, make: Callable[[Any], Callable[[], Any]], sets: Sequence, args: argparse.Namespace,
                       record: Callable[[str, BaseException], None], capture: bool = True) -> list[float | None]:
    """``[eager median ms, CUDA-graph replay median ms]`` of ``make(set)`` over ``sets`` (``--iters --warmup
    --l2``); a failure (a refused capture, say) is recorded as ``"<label> eager|graph timing"`` and costs its cell.
    ``capture=False``: a call that cannot be captured at all (it copies from the host) gets no graph cell."""
    out: list[float | None] = []
    for graph in (False, True)[:1 + capture]:
        try:
            t = bench([make(s) for s in sets], iters=args.iters, warmup=args.warmup, cuda_graph=graph, l2=args.l2)
            out.append(t.median_ms)
        except Exception as exc:  # noqa: BLE001
            record(f"{label} {'graph' if graph else 'eager'} timing", exc)
            torch.cuda.synchronize()
            out.append(None)
    return out + [None] * (2 - len(out))


def time_split_row(
    cfg: TimeSplitConfig,
    sets: list,
    serial: Callable[[Any], Callable[[], Any]],
    split: Callable[[int], tuple[Callable[[Any], Callable[[], Any]], int, contextlib.AbstractContextManager] | None],
    check: Callable[[Any, Any], tuple[float, str]],
    floor: float,
    args: argparse.Namespace,
    serial_context: contextlib.AbstractContextManager | None = None,
) -> dict[str, Any]:
    """One row of a time-split suite. ``serial(s)`` makes a zero-argument call on input set ``s``, run inside
    ``serial_context`` (where the default planner would cut the call itself: a tuning override turning the split
    off); ``split(segment)`` gives ``(make, number of segments, context)`` with ``make(s)`` the same for the split
    path, run inside ``context``, or None where that length cuts nothing; ``check(serial_out, split_out)`` gives
    ``(relative error, "ok" | "warn" | "FAIL")``."""
    errors: dict[str, str] = {}
    record = error_recorder(errors, cfg.name)
    row: dict[str, Any] = {"config": cfg.name, "H": cfg.H, "T": cfg.T, "N": cfg.N, "check": "FAIL",
                           "max_rel_err": float("nan"), "floor_ms": floor, "segments": {}}  # fmt: skip

    def both(label, make):
        return eager_and_graph_ms(label, make, sets, args, record)

    with serial_context or contextlib.nullcontext():
        ref = serial(sets[0])()
        row["serial_ms"], row["serial_graph_ms"] = both("serial", serial)
    worst, status = 0.0, "ok"
    for seg in TIME_SPLIT_SEGMENTS:
        cut = split(seg)
        if cut is None:
            continue
        make, segments, context = cut
        entry: dict[str, Any] = {"num_segments": segments}
        with context:
            try:
                err, st = check(ref, make(sets[0])())
            except Exception as exc:  # noqa: BLE001
                record(f"split {seg} check", exc)
                err, st = float("nan"), "FAIL"
            entry["rel_err"], entry["check"] = err, st
            worst = max(worst, err) if err == err else float("nan")
            if st == "FAIL":
                status = "FAIL"
            else:
                if st == "warn" and status == "ok":
                    status = "warn"
                entry["split_ms"], entry["split_graph_ms"] = both(f"split {seg}", make)
        row["segments"][seg] = entry
    timed = {seg: e for seg, e in row["segments"].items() if e.get("split_ms") is not None}
    if timed:
        best = min(timed, key=lambda seg: timed[seg]["split_ms"])
        row.update(best_segment=best, split_ms=timed[best]["split_ms"], split_graph_ms=timed[best]["split_graph_ms"])
        row["speedup"] = speedup(row["serial_ms"], row["split_ms"])
        row["graph_speedup"] = speedup(row["serial_graph_ms"], row["split_graph_ms"])
        row["floor_pct"] = floor_pct(floor, row["split_ms"])
    row["max_rel_err"], row["check"] = worst, status if row["segments"] else "unchecked"
    if errors:
        row["errors"] = errors
    return row
