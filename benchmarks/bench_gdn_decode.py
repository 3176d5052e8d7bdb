"""Gated DeltaNet decode: cula's ``gdn_decode`` (a state pool, in place) against FLA 0.6.0's
``fused_recurrent_gated_delta_rule``.

Suite, Qwen3-Next's shape: H = 16 q/k heads, HV = 32 value heads, K = V = 128, bf16 q/k/v/g/beta, fp32 states
``[V, K]`` (``state_v_first``), under ``torch.inference_mode()``:

* ``decode-N{N}``: T = 1, N in {1, 8, 32, 64, 128, 256, 512};
* ``mtp-N64-T4``: an MTP verify step, T = 4 tokens per sequence, N = 64.

cula call: ``cula.gated_delta_rule.gdn_decode(q, k, v, g, beta, pool, indices, A_log=, dt_bias=,
check_indices=False)`` with its serving defaults (the fused gate ``-exp(A_log) softplus(g + dt_bias)`` on raw
``g [N, T, HV]``, beta logits, q / k L2 norm in the kernel): the pool ``[2N, HV, V, K]`` read and updated in
place at int32 ``indices`` (the first N of a seeded permutation of its rows). ``cula_step``'s host overhead in
meta: ``gdn_decode_step``, the form with the pool, indices and gate parameters bound once.

FLA call: FLA 0.6.0 has no pooled Gated DeltaNet decode, so FLA runs ``fused_recurrent_gated_delta_rule`` with
the same flags on the same tokens as a batch of N sequences, its states already gathered (``initial_state =
pool[indices]``, ``output_final_state=True``): the gather before and the scatter after, which an engine adds,
are not in FLA's time. Correctness gate (``bench_kda_decode``'s): o and the touched pool rows (FLA's final
states scattered into a copy of the pool) by relative RMSE; a cula write to an untouched row fails.

``bw_fraction``: state bytes read and written per call (``2 * 4 * N * HV * K * V``) / time / copy bandwidth
(the issue's target: at least 0.9 at N >= 64); host overhead at N = 1 (``cula_host_us``; target 15 us) as in
``bench_kda_decode``.

Usage: ``python benchmarks/bench_gdn_decode.py [--quick] [--iters N] [--max-seconds S] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import bench_kda_decode as kd
import common as bc
import torch

NAME = "gdn_decode"
H, HV, K, V = 16, 32, 128, 128
DECODE_N = (1, 8, 32, 64, 128, 256, 512)
MTP = (64, 4)
QUICK = ("decode-N1", "decode-N64", "mtp-N64-T4")
DEVICE = "cuda"  # the CPU tests point this at "cpu"
CALL_FLAGS = {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True,
              "state_v_first": True}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Config:
    """N sequences of T tokens (H and HV fixed)."""

    N: int
    T: int

    H = H

    @property
    def P(self) -> int:
        return 2 * self.N

    @property
    def name(self) -> str:
        return f"decode-N{self.N}" if self.T == 1 else f"mtp-N{self.N}-T{self.T}"


def suite(quick: bool = False) -> list[Config]:
    cfgs = [Config(n, 1) for n in DECODE_N] + [Config(*MTP)]
    return [c for c in cfgs if c.name in QUICK] if quick else cfgs


def state_bytes(cfg: Config) -> int:
    return 2 * 4 * cfg.N * HV * K * V


def activation_bytes(cfg: Config) -> int:
    """bf16 q, k, v, g, beta read and o written."""
    return 2 * cfg.N * cfg.T * (2 * H * K + HV * V + 2 * HV + HV * V)


def input_set_bytes(cfg: Config) -> int:
    return 4 * cfg.N * HV * K * V + activation_bytes(cfg)


def make_shared(cfg: Config, device: str | None = None) -> dict[str, torch.Tensor]:
    """GDN's gate parameters, fp32 ``[HV]`` each."""
    device = device or DEVICE
    torch.manual_seed(bc.config_seed(NAME + cfg.name) + 1)
    return {"A_log": torch.empty(HV, dtype=torch.float32, device=device).uniform_(1, 16).log(),
            "dt_bias": 0.1 * torch.randn(HV, dtype=torch.float32, device=device)}  # fmt: skip


def make_set(cfg: Config, index: int, device: str | None = None) -> dict[str, torch.Tensor]:
    """One input set with its own pool ``[P, HV, V, K]`` and int32 ``indices [N]``."""
    device = device or DEVICE
    gen = torch.Generator().manual_seed(bc.config_seed(NAME + cfg.name) + 100 + index)
    torch.manual_seed(bc.config_seed(NAME + cfg.name) + 100 + index)
    n, t, bf16 = cfg.N, cfg.T, torch.bfloat16
    return {
        "q": torch.randn(n, t, H, K, dtype=bf16, device=device),
        "k": torch.randn(n, t, H, K, dtype=bf16, device=device),
        "v": torch.randn(n, t, HV, V, dtype=bf16, device=device),
        "g": torch.randn(n, t, HV, dtype=bf16, device=device),
        "beta": torch.randn(n, t, HV, dtype=bf16, device=device),
        "pool": 0.01 * torch.randn(cfg.P, HV, V, K, dtype=torch.float32, device=device),
        "indices": torch.randperm(cfg.P, generator=gen)[:n].to(dtype=torch.int32, device=device),
    }


def fla_call(fn: Callable, s: dict, shared: dict,
             pool: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:  # fmt: skip
    """FLA's call on the gathered states; with ``pool`` (the correctness run) its final states are scattered
    into it afterwards, outside what the timed call does."""
    rows = s["indices"].long()
    states = s["pool"][rows].clone()
    kwargs = dict(q=s["q"], k=s["k"], v=s["v"], g=s["g"], beta=s["beta"], A_log=shared["A_log"],
                  dt_bias=shared["dt_bias"], initial_state=states, output_final_state=True,
                  **CALL_FLAGS)  # fmt: skip
    if pool is None:
        return lambda: fn(**kwargs)[0]

    def call():
        o, final = fn(**kwargs)
        pool[rows] = final
        return o

    return call


def resolve_cula() -> tuple[Callable, str]:
    from cula.gated_delta_rule import gdn_decode

    def public(q, k, v, g, beta, pool, indices, A_log, dt_bias):
        return gdn_decode(q, k, v, g, beta, pool, indices, A_log=A_log, dt_bias=dt_bias, check_indices=False,
                          **CALL_FLAGS)  # fmt: skip

    return public, "cula.gated_delta_rule.gdn_decode(check_indices=False)"


def resolve_cula_step() -> Callable[[dict, dict], Callable[[], torch.Tensor]]:
    from cula.gated_delta_rule import gdn_decode_step

    def make(s: dict, shared: dict) -> Callable[[], torch.Tensor]:
        step = gdn_decode_step(s["pool"], s["indices"], A_log=shared["A_log"], dt_bias=shared["dt_bias"],
                               check_indices=False, **CALL_FLAGS)  # fmt: skip
        return lambda: step(s["q"], s["k"], s["v"], s["g"], s["beta"])

    return make


def cula_call(fn: Callable, s: dict, shared: dict,
              pool: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:  # fmt: skip
    args = (s["q"], s["k"], s["v"], s["g"], s["beta"], s["pool"] if pool is None else pool, s["indices"],
            shared["A_log"], shared["dt_bias"])
    return lambda: fn(*args)


check = kd.check


def run_config(cfg: Config, fla_fn: Callable, cula_fn: Callable, args: argparse.Namespace,
               ceilings: dict[str, float], step_maker: Callable | None = None) -> dict[str, Any]:
    """``bench_kda_decode.run_config`` on this module's workload."""
    return kd.run_config(cfg, fla_fn, cula_fn, args, ceilings, step_maker, w=sys.modules[__name__])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return bc.arg_parser(
        __doc__.splitlines()[0], QUICK, iters=20, warmup=3,
        warmup_help="untimed calls before timing (at least one per set)",
        host_overhead_help="skip the N=1 host-overhead measurement",
    ).parse_args(argv)


def main(argv: list[str] | None = None) -> tuple[dict, list[dict], dict]:
    """Run the suite; FLA's own kernels on its side (``FLA_CULA=0``)."""
    with bc.env_var("FLA_CULA", "0"):
        return _run(parse_args(argv), time.perf_counter())


def _run(args: argparse.Namespace, t_start: float) -> tuple[dict, list[dict], dict]:
    if not torch.cuda.is_available():
        raise SystemExit("bench_gdn_decode needs a CUDA GPU")
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    from cula.gated_delta_rule.plan import GDN_TUNING

    cula_fn, entry = resolve_cula()
    step_maker = resolve_cula_step()
    cfgs = bc.select_configs(suite, args)
    ceilings = bc.reported_ceilings(NAME, f"cula entry {entry}")
    with torch.inference_mode():
        run = bc.run_suite(cfgs, lambda cfg: run_config(cfg, fused_recurrent_gated_delta_rule, cula_fn, args,
                                                        ceilings, step_maker),
                           args.max_seconds, t_start, name=NAME, progress=bc.PROGRESS_KEYS + ("bw_fraction",))
    meta: dict[str, Any] = {
        "cula_entry": entry,
        "shape": {"H": H, "HV": HV, "K": K, "V": V, "dtype": "bfloat16",
                  "state": "float32 pool [2N, HV, V, K]",
                  "indices": "int32 [N], random permutation of pool rows"},
        "call_flags": CALL_FLAGS,
        "fla_call": ("fused_recurrent_gated_delta_rule on the states gathered before the timed call "
                     "(initial_state=pool[indices], output_final_state=True); the scatter back is not timed"),
        "gdn_tuning": dataclasses.asdict(GDN_TUNING.get((9, 0))),
        "bw_fraction": "state bytes read + written per call (2 * 4 * N * HV * K * V) / time / copy bandwidth",
        **bc.run_meta(args, ceilings, kd.WARN_TOL, kd.FAIL_TOL,
                      rotate="rotate input sets (own pool each) to > 2x L2"),
        "host_overhead_us": {r["config"]: r["host_overhead_us"] for r in run.rows
                             if r.get("host_overhead_us")},  # fmt: skip
        **bc.budget_meta(run, args.max_seconds, t_start),
    }
    paths = bc.write_suite(NAME, args, meta, run.rows, kd.MD_COLUMNS)
    return meta, run.rows, paths


if __name__ == "__main__":
    main()
