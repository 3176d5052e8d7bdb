"""Kernel time of the N=1 decode step (issue 4: at or under 8 us), without the host: each variant's launch captured
50 times into one CUDA graph, the graph replayed; microseconds per launch (median of 20 replays). Eager timing
(do_bench, the benchmarks' N=1 rows) cannot see it, since an N=1 call is host-bound.

    device run, carry [".device"]:  bash scripts/device/run.sh python scripts/device/decode_n1.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_kda_decode as B  # noqa: E402

import cula.ops.kda.sm90.decode as D  # noqa: E402
import cula.ops.lightning.sm90.decode as L  # noqa: E402

CALLS = 50


def graph_us(call) -> float:
    """Median microseconds per ``call`` over 20 replays of a graph holding ``CALLS`` of them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(times)


def kda_rows():
    for kv in (False, True):
        cfg = B.Config(1, 1, 64, kv=kv)
        s, shared = B.make_set(cfg, 0), B.make_shared(cfg)
        q, k, v, g, beta, pool, idx = (s[n] for n in ("q", "k", "v", "g", "beta", "pool", "indices"))
        out = torch.empty_like(v)
        base = dict(io_dtype=q.dtype, g_dtype=g.dtype, beta_dtype=beta.dtype, K=B.K, V=B.V, gate="lower_bound",
                    has_a_log=True, has_dt_bias=True, use_qk_l2norm=True, beta_sigmoid=True, allow_neg_eigval=False,
                    state_v_first=not kv, has_step_states=False)  # fmt: skip
        variants = [("default (tokens=1)", {"tokens": 1})]
        if not kv:
            variants += [
                ("2 warps/CTA, 1 slot, 10 CTAs/SM", {"warps_per_cta": 2, "tokens_per_round": 1, "min_blocks_per_sm": 10}),
                ("4 warps/CTA, 1 slot, 4 CTAs/SM", {"tokens_per_round": 1, "min_blocks_per_sm": 4}),
                ("8 warps/CTA, 1 slot, 2 CTAs/SM", {"warps_per_cta": 8, "tokens_per_round": 1, "min_blocks_per_sm": 2}),
                ("4 warps/CTA, 8 slots", {}),
            ]  # fmt: skip
        else:
            variants += [("wide tile", {"wide_kv": True})]
        for what, extra in variants:
            launch = D.kda_decode_launcher(**base, **extra)

            def call(launch=launch):
                launch(q, k, v, g, beta, shared["A_log"], shared["dt_bias"], pool, idx, out, None, B.K**-0.5, -5.0)

            print(f"kda {'kv' if kv else 'vk'} N=1 {what:34s}: {graph_us(call):6.2f} us", flush=True)


def lightning_rows():
    for state_v_first in (True, False):
        H, D_ = 64, 128
        q, k, v = (torch.randn(1, 1, H, D_, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        pool = torch.randn(2, H, D_, D_, device="cuda") * 0.01
        idx = torch.tensor([1], dtype=torch.int32, device="cuda")
        decay = torch.rand(H, device="cuda")
        out = torch.empty_like(v)
        launch = L.lightning_decode_launcher(q, v, state_v_first=state_v_first)
        us = graph_us(lambda: launch(q, k, v, decay, pool, idx, out, D_**-0.5))
        print(f"lightning {'vk' if state_v_first else 'kv'} N=1 default{'':26s}: {us:6.2f} us", flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        kda_rows()
        lightning_rows()
