"""Where the [K, V] pool's decode loses against [V, K] in bench_kda_decode (N=64: 146 against 140 us) while the
kernel speed report (identity indices, softplus gate, fp32 g) has them equal: each bench input property alone,
then, for [K, V] pools, the wide tile (no TMA) and the TMA box at 5 CTAs per SM in both index orders.

    device run, carry [".device"]:  bash scripts/device/run.sh python scripts/device/decode_layouts.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_kda_decode as B  # noqa: E402

import cula.ops.kda.sm90.decode as D  # noqa: E402
from cula.backends import clear_plan_caches  # noqa: E402
from cula.kda import kda_decode  # noqa: E402


def time_us(cfg, *, identity=False, softplus=False, g_fp32=False, beta_fp32=False, pool_rows=None, switches=None):
    defaults = {name: getattr(D, name) for name in (switches or {})}
    for name, value in (switches or {}).items():
        setattr(D, name, value)
    clear_plan_caches()
    try:
        return _time_us(cfg, identity, softplus, g_fp32, beta_fp32, pool_rows)
    finally:
        for name, value in defaults.items():
            setattr(D, name, value)
        clear_plan_caches()


def _time_us(cfg, identity, softplus, g_fp32, beta_fp32, pool_rows):
    s, shared = B.make_set(cfg, 0), B.make_shared(cfg)
    if identity:
        s["indices"] = torch.arange(cfg.N, dtype=torch.int32, device="cuda")
    if pool_rows is not None:
        s["pool"] = s["pool"][:pool_rows].clone()
        s["indices"] = torch.randperm(pool_rows, device="cuda")[: cfg.N].to(torch.int32)
    if g_fp32:
        s["g"] = s["g"].float()
    if beta_fp32:
        s["beta"] = s["beta"].float()
    flags = dict(B.CALL_FLAGS, state_v_first=shared["state_v_first"])
    if softplus:
        flags["lower_bound"] = None

    def call():
        return kda_decode(s["q"], s["k"], s["v"], s["g"], s["beta"], s["pool"], s["indices"], A_log=shared["A_log"],
                          dt_bias=shared["dt_bias"], check_indices=False, **flags)  # fmt: skip

    call()
    torch.cuda.synchronize()
    return do_bench(call, warmup=25, rep=300, return_mode="median") * 1e3


def main():
    for N in (64, 256):
        for kv in (True, False):
            cfg = B.Config(N, 1, 64, kv=kv)
            for what, kw in (("bench inputs", {}), ("identity indices", {"identity": True}),
                             ("softplus gate", {"softplus": True}), ("g fp32", {"g_fp32": True}),
                             ("beta fp32", {"beta_fp32": True}), ("pool of N rows", {"pool_rows": N}),
                             ("all four", {"identity": True, "softplus": True, "g_fp32": True, "beta_fp32": True})):
                report(cfg, what, time_us(cfg, **kw))
        # [K, V] pools: is the random-row penalty the TMA box's (128 rows of 128 B, 512 B apart) or the layout's?
        cfg = B.Config(N, 1, 64, kv=True)
        for what, switches in (("wide tile", {"KV_TMA_DEFAULT": False}), ("tma 5 CTAs/SM", {"KV_TMA_MIN_BLOCKS": 5})):
            for order in ("random", "identity"):
                us = time_us(cfg, identity=order == "identity", switches=switches)
                report(cfg, f"{what}, {order}", us)


def report(cfg, what, us):
    print(f"{'kv' if cfg.kv else 'vk'} N={cfg.N:4d} {what:24s}: {us:8.2f} us  {B.state_bytes(cfg) / us / 1e6:6.3f} TB/s",
          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
