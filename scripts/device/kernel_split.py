"""chunk_kda's GPU time split by kernel for configs of the kda_prefill suite (cula only, no FLA).

    device run, carry [".device"]:  bash scripts/device/run.sh python scripts/device/kernel_split.py [NAME ...]

NAME is a suite config (``B1-T512``, ``varlen-N20-T4096-uniform``, ...); without names a default set of the
rows where the whole call is far from the sum of its parts' floors. Per config: the median wall time of a call
between CUDA events (eager and CUDA-graph replay), each kernel's device time per call (torch.profiler), and the
launch count, so that launch gaps, tails and the intra / state split can be read off. JSON to
$OUT/kernel_split.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kda_prefill as bk  # noqa: E402
from common import bench, n_rotation_sets  # noqa: E402
from profile_kda import kernel_stats  # noqa: E402

DEFAULT = ["B1-T512", "B2-T512", "B2-T1024", "B1-T4096", "varlen-N10-T4096-uniform", "varlen-N20-T4096-uniform",
           "varlen-N20-T4096-skewed", "varlen-N20-T16384-random", "B2-T16384"]


def suite_calls(name: str) -> list:
    """Zero-argument chunk_kda calls on the suite config ``name``: as many input sets as the benchmark rotates
    through, so that a call never finds its inputs in L2."""
    from cula.kda import chunk_kda

    cfg = next(c for c in bk.suite() if c.name == name)
    shared = bk.make_shared(cfg, "cuda")
    return [bk.bind(chunk_kda, bk.make_set(cfg, i, "cuda"), shared)
            for i in range(n_rotation_sets(bk.input_set_bytes(cfg)))]  # fmt: skip


def main(names: list[str]) -> None:
    report = {}
    with torch.inference_mode():
        for name in names:
            fns = suite_calls(name)
            times = kernel_stats(fns[0])
            eager = bench(fns, iters=20, warmup=3).median_ms * 1e3
            graph = bench(fns, iters=20, warmup=3, cuda_graph=True).median_ms * 1e3
            total = sum(t[0] for t in times.values())
            report[name] = {"eager_us": round(eager, 1), "graph_us": round(graph, 1),
                            "kernel_sum_us": round(total, 1), "kernels": times}
            print(f"== {name}: eager {eager:.1f} us, graph {graph:.1f} us, kernels {total:.1f} us", flush=True)
            for k, (us, n) in times.items():
                print(f"   {us:9.1f} us  x{n:<5}  {k}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "kernel_split.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:] or DEFAULT)
