"""Gated DeltaNet prefill: cula's ``chunk_gated_delta_rule`` against FLA 0.6.0's, inference, K = V = 128.

cula runs it on the KDA kernels (the intra kernel's per-head-gate variant, then KDA's state/output kernel:
``cula.gated_delta_rule.backends``); FLA on its own Gated DeltaNet kernels. The configs, timing, checks, floors
and result format are ``bench_kda_prefill.py``'s (see its docstring), with Gated DeltaNet's inputs: g ``[B, T,
HV]`` raw, the fused gate ``-exp(A_log) softplus(g + dt_bias)`` with ``A_log`` / ``dt_bias`` ``[HV]``, beta
logits, q / k L2 norm in the kernel, ``[V, K]`` states. H = HV = 64 on the 28 configs, then Qwen-style GVA rows
(``-H16-HV32`` / ``-H16-HV64``: 1 x 8K, 1 x 32K, 4 x 8K) with published H200 numbers for two of them in
``meta["anchors_ms"]``. The table says whether cula's path is the faster one for inference:
``GdnTuning.inference_chunk_on_cula`` (``cula/gated_delta_rule/plan.py``) is set from it; the run forces cula's
path on for the cula column.

Usage: ``python benchmarks/bench_gdn_prefill.py [--quick] [--iters N] [--out DIR] [--cuda-graph] [--configs NAMES]
[--split SEGMENT [--halves]] [--row-factors | --no-row-factors] [--wy-in-recurrence | --no-wy-in-recurrence]``
(``--split``: cula's calls cut in time, as in ``bench_kda_prefill.py``; ``--row-factors`` / ``--no-row-factors``:
the cula column with ``GdnTuning.inference_row_factors`` on / off whatever the entry says, the result named
``..._rowfactors`` / ``..._norowfactors``; ``--[no-]wy-in-recurrence`` the same for
``GdnTuning.inference_wy_in_recurrence``, ``..._wy`` / ``..._nowy``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import bench_kda_prefill as kp
import common as bc
import torch

NAME = "gdn_prefill"
BACKEND_REGISTRY = "cula.gated_delta_rule.backends:chunk_gdn_registry"
CALL_FLAGS = {
    "output_final_state": True,
    "use_gate_in_kernel": True,
    "use_qk_l2norm_in_kernel": True,
    "use_beta_sigmoid_in_kernel": True,
    "state_v_first": True,
}


def make_shared(cfg: kp.Config, device: str | None = None) -> dict[str, Any]:
    """The gate parameters (per head) and, packed, both copies of cu_seqlens."""
    device = device or kp.DEVICE
    torch.manual_seed(bc.config_seed(NAME + cfg.name) + 1)
    shared: dict[str, Any] = {
        "A_log": torch.empty(cfg.HV, dtype=torch.float32, device=device).uniform_(1, 16).log(),
        "dt_bias": 0.1 * torch.randn(cfg.HV, dtype=torch.float32, device=device),
    }
    if cfg.mode == "varlen":
        shared.update(bc.cu_seqlens(cfg.lens, device))
    return shared


def make_set(cfg: kp.Config, index: int, device: str | None = None) -> dict[str, torch.Tensor]:
    """One input set: q, k, v bf16, g and beta ``[B, T, HV]`` bf16, initial_state ``[N, HV, V, K]`` fp32."""
    x = kp.make_set(cfg, index, device)
    x["g"] = x["g"][..., 0].contiguous()
    return x


GDN = kp.Workload(make_shared, make_set, CALL_FLAGS, BACKEND_REGISTRY, gate_k=1)

# Qwen-style GVA rows after the 28-config suite: 16 q/k heads with 32 and with 64 value heads; published H200
# numbers for two of them (ms): one 32K sequence at 32 value heads, 4 x 8K at 64
QWEN = [kp.Config("fixed", b, t, (t,) * b, heads=(16, hv)) for hv in (32, 64)
        for b, t in ((1, 8192), (1, 32768), (4, 8192))]  # fmt: skip
ANCHORS = {"B1-T32768-H16-HV32": {"FlashQLA": 0.877, "FLA": 1.89, "target": 0.6},
           "B4-T8192-H16-HV64": {"FlashInfer": 0.827, "FLA": 3.36, "target": 0.6}}  # fmt: skip


def suite(quick: bool = False) -> list[kp.Config]:
    """bench_kda_prefill's 28 configs, then the Qwen-style GVA rows (quick: its quick ones and the two anchors)."""
    qwen = [c for c in QWEN if c.name in ANCHORS] if quick else QWEN
    return kp.suite(quick) + qwen


def main(argv: list[str] | None = None) -> tuple[dict, list[dict], dict]:
    """Run the suite; returns (meta, rows, written paths). FLA's own kernels (no FlashKDA, no cula through FLA's
    dispatch) on the FLA side, as in bench_kda_prefill."""
    p = kp.arg_parser(__doc__.splitlines()[0], kp.QUICK + tuple(ANCHORS))
    p.add_argument("--row-factors", action=argparse.BooleanOptionalAction, default=None,
                   help="the cula column with GdnTuning.inference_row_factors on / off, whatever the tuning entry "
                        "says (default: the entry's); results named ..._rowfactors / ..._norowfactors")
    p.add_argument("--wy-in-recurrence", action=argparse.BooleanOptionalAction, default=None,
                   help="the cula column with GdnTuning.inference_wy_in_recurrence on / off, whatever the tuning "
                        "entry says (default: the entry's); results named ..._wy / ..._nowy")
    args = p.parse_args(argv)
    if args.time_parallel:
        raise SystemExit("--time-parallel is bench_kda_prefill.py's (and bench_lightning_prefill.py's) suite")
    with bc.env_var("FLA_FLASH_KDA", "0"), bc.env_var("FLA_CULA", "0"):
        return _run(args)


def _run(args: argparse.Namespace) -> tuple[dict, list[dict], dict]:
    if not torch.cuda.is_available():
        raise SystemExit("bench_gdn_prefill needs a CUDA GPU")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn

    from cula.gated_delta_rule import chunk_gated_delta_rule as cula_fn
    from cula.gated_delta_rule.plan import GDN_TUNING

    cfgs = bc.select_configs(suite, args)
    ceilings = bc.reported_ceilings(NAME)
    t_start = time.perf_counter()
    gdn = dict(inference_chunk_on_cula=True)
    if args.row_factors is not None:
        gdn["inference_row_factors"] = args.row_factors
    if args.wy_in_recurrence is not None:
        gdn["inference_wy_in_recurrence"] = args.wy_in_recurrence
    if args.split:  # Gated DeltaNet's calls cut by its own entry (the halves stay KDA's, set by cula_override)
        from cula.time_split import SplitThresholds

        gdn["time_split"] = SplitThresholds(items_per_sm=1e9, busy_items_per_sm=1e9, min_segment=args.split,
                                            min_seq_len=0)  # fmt: skip
    on_cula = GDN_TUNING.override(**gdn)
    with torch.inference_mode(), on_cula, kp.cula_override(args):
        run = bc.run_suite(cfgs, lambda cfg: kp.run_config(cfg, fla_fn, cula_fn, args, ceilings, GDN),
                           args.max_seconds or None, t_start, name=NAME,
                           progress=bc.PROGRESS_KEYS + ("backend", "floor_pct"), record_wall=False)  # fmt: skip
    meta: dict[str, Any] = {
        "shape": {"H": f"{kp.H} (GVA rows: 16)", "HV": f"{kp.HV} (GVA rows: per row)", "K": kp.K, "V": kp.V,
                  "chunk": kp.CHUNK, "dtype": "bfloat16", "gate": "[B, T, HV] scalar", "state": "float32"},  # fmt: skip
        "call_flags": CALL_FLAGS,
        "anchors_ms": ANCHORS,
        **({"cula_split": {"segment": args.split, "halves": args.halves}} if args.split else {}),
        "cula_row_factors": GDN_TUNING.get((9, 0)).inference_row_factors if args.row_factors is None
        else args.row_factors,
        "cula_wy_in_recurrence": GDN_TUNING.get((9, 0)).inference_wy_in_recurrence if args.wy_in_recurrence is None
        else args.wy_in_recurrence,
        **bc.run_meta(args, ceilings, kp.WARN_TOL, kp.FAIL_TOL),
        **run.partial_note(len(cfgs), args.max_seconds),
    }
    suffix = (kp.split_suffix(args) + {None: "", True: "_rowfactors", False: "_norowfactors"}[args.row_factors]
              + {None: "", True: "_wy", False: "_nowy"}[args.wy_in_recurrence])
    paths = bc.write_suite(NAME + suffix, args, meta, run.rows, kp.MD_COLUMNS)
    return meta, run.rows, paths


if __name__ == "__main__":
    main()
