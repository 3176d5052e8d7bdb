"""Does the host time of an N=1 decode call drift over a process's first seconds, and is it the call or the host?

The decode benchmarks' first N=1 rows have measured 1.6-2.4x the host time of the same calls later in the same
process (sessions 19-20: kda_decode_step 24.6-27.5 us at +8-12 s against 15.6 at +15 s; FLA's calls alike). Here,
in one fresh process: every ~0.5 s for ``--seconds``, the back-to-back time per call (100 calls, one sync) of
``kda_decode_step`` (N=1, HV=64, [V, K]) and of a bare ``torch.empty(1, device="cuda")`` as the host's own
yardstick; then the same after ``gc.collect(); gc.freeze()`` (what serving engines do after start-up). If the
yardstick drifts with the call, the host is slow (clock, neighbours); if only the call does, it is Python.

    device run, carry [".device"]:  bash scripts/device/run.sh python scripts/device/host_drift.py [--seconds 20]
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_kda_decode as B  # noqa: E402
import common as bc  # noqa: E402


def sample(label: str, calls: dict, seconds: float, t_start: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        figures = "  ".join(f"{name} {bc.back_to_back_us(fn, 100, 5):6.2f}" for name, fn in calls.items())
        print(f"{label} +{time.perf_counter() - t_start:5.1f}s  {figures}  (us a call)", flush=True)
        time.sleep(0.3)


def main() -> None:
    t_start = time.perf_counter()
    seconds = float(sys.argv[sys.argv.index("--seconds") + 1]) if "--seconds" in sys.argv else 20.0
    cfg = B.Config(1, 1, 64)
    s, shared = B.make_set(cfg, 0), B.make_shared(cfg)
    step = B.resolve_cula_step()(s, shared)
    step()
    torch.cuda.synchronize()
    calls = {"kda_decode_step": step, "torch.empty": lambda: torch.empty(1, device="cuda")}
    print(f"setup done at +{time.perf_counter() - t_start:.1f}s; gc counts {gc.get_count()}", flush=True)
    sample("plain ", calls, seconds, t_start)
    gc.collect()
    gc.freeze()
    sample("frozen", calls, seconds / 2, t_start)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
