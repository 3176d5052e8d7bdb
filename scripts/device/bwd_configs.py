"""FLA's two heaviest backward kernels under launch configurations its autotuner does not try: stage 6
(``chunk_kda_bwd_kernel_wy_dqkg_fused``, as (BK, BV, warps, stages)) and stage 7 (``chunk_kda_bwd_kernel_intra``,
as (BK, warps, stages); FLA fixes BK=32). Is their 3-4.5x over the byte floor the configuration or the structure?

    device run, carry [".device"]:  bash scripts/device/run.sh python scripts/device/bwd_configs.py [B T] [--stage 7]
        [--one A,B,C(,D)]

Each configuration runs in its own process (one illegal address poisons the CUDA context for all that follow:
session 21's first sweep lost 22 configurations to BK=32, BV=128 at 4 warps). Each process feeds the kernel the
B2-T16384 training shape's tensors (random, of the right dtypes and ranges), runs FLA's own wrapper (its autotuned
configuration) as the reference, then ``cula.kda.fla_backward``'s launch of the same Triton function at the given
configuration: median milliseconds of both and each output's relative RMSE against the reference. FLA's kernels
are called, not copied. Session 21 (stage 6): FLA's choice 11.54 ms, 8 warps at BK = BV = 64 7.71 (now
``fla_backward.WY_DQKG_LAUNCH``), the rest in docs/perf-notes-kda.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

# FLA's wrapper of each stage must stay FLA's: cula registers its stage-6 launch with FLA's dispatch (cula.fla_dispatch)
os.environ.setdefault("FLA_CULA", "0")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import common as bc  # noqa: E402

from cula.kda import fla_backward  # noqa: E402
from cula.testing import rel_rmse  # noqa: E402

H = HV = 64
K = V = 128
BT = 64
CONFIGS = {
    6: [(64, 64, 8, 1), (32, 64, 8, 1), (64, 128, 8, 1), (128, 64, 8, 1), (64, 32, 8, 1), (32, 64, 16, 1)],
    7: [(32, 1, 2), (32, 1, 3), (16, 1, 2), (16, 1, 3), (16, 2, 3), (32, 2, 3), (16, 4, 3), (64, 2, 3), (64, 4, 3)],
}


def _common_inputs(B: int, T: int) -> dict:
    """What both stages read: l2-normed bf16 q / k, an fp32 chunk-local log2 gate cumsum, fp32 beta."""
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(bf16) for _ in range(2))
    g = (-0.1 * torch.rand(B, T // BT, BT, HV, K, device=dev)).cumsum(2).view(B, T, HV, K)
    return dict(q=q, k=k, g=g, beta=torch.rand(B, T, HV, device=dev))


def stage6(B: int, T: int):
    """(inputs, FLA's call, our launch at a configuration) for stage 6: bf16 activations and per-chunk states and a
    lower-triangular bf16 A besides the common inputs."""
    from fla.ops.kda import chunk_bwd

    dev, bf16 = "cuda", torch.bfloat16
    x = _common_inputs(B, T)
    v, v_new, do, dv = (torch.randn(B, T, HV, V, device=dev, dtype=bf16) for _ in range(4))
    A = (0.1 * torch.randn(B, T // BT, BT, HV, BT, device=dev)).tril(-1).view(B, T, HV, BT).to(bf16)
    h, dh = (0.1 * torch.randn(B, T // BT, HV, V, K, device=dev, dtype=bf16) for _ in range(2))
    x.update(v=v, v_new=v_new, A=A, h=h, do=do, dh=dh, dv=dv, scale=K**-0.5, state_v_first=True, cu_seqlens=None)
    return (
        lambda: chunk_bwd.chunk_kda_bwd_wy_dqkg_fused(**x, chunk_size=BT),
        lambda c: fla_backward.launch_wy_dqkg(**x, chunk_size=BT, chunk_indices=None, launch=c),
        ("dq", "dk", "dv", "db", "dg", "dA"),
    )


def stage7(B: int, T: int):
    """The same for stage 7: fp32 score gradients and incoming accumulations, the training flags' safe gate."""
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra

    x = _common_inputs(B, T)
    dAqk, dAkk = (torch.randn(B, T, HV, BT, device="cuda") for _ in range(2))
    acc = dict(dq=torch.randn_like(x["g"]), dk=torch.randn_like(x["g"]), db=torch.randn_like(x["beta"]),
               dg=torch.randn_like(x["g"]))  # fmt: skip
    x.update(dAqk=dAqk, dAkk=dAkk, **acc, cu_seqlens=None)
    return (
        lambda: chunk_kda_bwd_intra(**x, chunk_size=BT, safe_gate=True, lower_bound=-5.0),
        lambda c: fla_backward.launch_intra_bwd(**x, chunk_indices=None, chunk_size=BT, safe_gate=True,
                                                lower_bound=-5.0, launch=c),  # fmt: skip
        ("dq", "dk", "db", "dg"),
    )


def run_one(stage: int, config: tuple, B: int = 2, T: int = 16384) -> None:
    fla, ours, names = (stage6 if stage == 6 else stage7)(B, T)
    ref = fla()
    fla_ms = bc.bench(fla, iters=10, warmup=1).median_ms
    try:
        errs = [rel_rmse(r, m) for r, m in zip(ref, ours(config))]
        ms = bc.bench(lambda: ours(config), iters=10, warmup=1).median_ms
        print(f"stage {stage} {config}: {ms:8.3f} ms (FLA's choice {fla_ms:.3f})  "
              + " ".join(f"{n}={e:.1e}" for n, e in zip(names, errs)), flush=True)  # fmt: skip
    except Exception as exc:  # a configuration that does not compile or fit: say so
        print(f"stage {stage} {config}: failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    # B T come before the flags: a flag's value (--stage 7) is no shape
    flags = [i for i, a in enumerate(args) if a.startswith("--")]
    shape = [int(a) for a in args[: flags[0] if flags else None]][:2]
    stage = int(args[args.index("--stage") + 1]) if "--stage" in args else 6
    if "--one" in args:
        run_one(stage, tuple(int(x) for x in args[args.index("--one") + 1].split(",")), *shape)
    else:
        for c in CONFIGS[stage]:
            try:
                subprocess.run([sys.executable, __file__, *map(str, shape), "--stage", str(stage), "--one",
                                ",".join(map(str, c))], check=False, timeout=120)  # fmt: skip
            except subprocess.TimeoutExpired:
                print(f"stage {stage} {c}: timed out", flush=True)
