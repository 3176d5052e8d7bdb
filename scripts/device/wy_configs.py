"""FLA's stage-6 backward kernel (``chunk_kda_bwd_kernel_wy_dqkg_fused``) under launch configurations its autotuner
does not try on Hopper: is its 4.5x over the byte floor the configuration or the kernel's structure?

    device run, carry [".device"]:  bash scripts/device/run.sh python scripts/device/wy_configs.py [B T] [--isolated]

Session 21's ncu (``profile_kda.py --ncu-backward``): the autotuned choice (BK=64, BV=64, 4 warps) compiles to 255
registers with 302 spilled, 12.5% occupancy, 16.7 M local-memory requests at B1-T4096; FLA's config list stops at 4
warps on Hopper. This script feeds the kernel the B2-T16384 training shape's tensors (random, of the right dtypes
and ranges), runs FLA's own wrapper (its autotuned configuration) as the reference, then launches the same Triton
function with each (BK, BV, warps, stages) of ``CONFIGS``: median milliseconds, registers and spills as compiled,
and each output's relative RMSE against the reference. FLA's kernel is called, not copied.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import common as bc  # noqa: E402

from cula.testing import rel_rmse  # noqa: E402

H = HV = 64
K = V = 128
BT = 64
CONFIGS = [c for c in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (1, 2))
           if not (c[2] == 4 and c[0] * c[1] > 64 * 64)]  # fmt: skip
# ``--isolated``: each configuration in its own process, since one illegal address poisons the CUDA context for the
# rest (session 21's first run: BK=32, BV=128 did, and every configuration after it failed)
ISOLATED = [(64, 32, 8, 1), (64, 64, 8, 1), (64, 128, 8, 1), (128, 32, 8, 1), (128, 64, 8, 1), (32, 64, 16, 1),
            (32, 128, 8, 1)]  # fmt: skip


def stage6_inputs(B: int, T: int) -> dict:
    """Stage 6's arguments at one shape: bf16 activations and per-chunk states, an fp32 chunk-local log2 gate
    cumsum, fp32 beta, a lower-triangular bf16 A."""
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    NT = T // BT
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(bf16) for _ in range(2))
    v, v_new, do, dv = (torch.randn(B, T, HV, V, device=dev, dtype=bf16) for _ in range(4))
    g = (-0.1 * torch.rand(B, NT, BT, HV, K, device=dev)).cumsum(2).view(B, T, HV, K)
    A = (0.1 * torch.randn(B, NT, BT, HV, BT, device=dev)).tril(-1).view(B, T, HV, BT).to(bf16)
    h, dh = (0.1 * torch.randn(B, NT, HV, V, K, device=dev, dtype=bf16) for _ in range(2))
    return dict(q=q, k=k, v=v, v_new=v_new, g=g, beta=torch.rand(B, T, HV, device=dev), A=A, h=h, do=do, dh=dh,
                dv=dv, scale=K**-0.5, state_v_first=True)  # fmt: skip


def main(B: int = 2, T: int = 16384, configs=None) -> None:
    from fla.ops.kda import chunk_bwd
    from triton.runtime.autotuner import Autotuner, Heuristics

    x = stage6_inputs(B, T)
    ref = chunk_bwd.chunk_kda_bwd_wy_dqkg_fused(**x, chunk_size=BT)
    ms = bc.bench(lambda: chunk_bwd.chunk_kda_bwd_wy_dqkg_fused(**x, chunk_size=BT), iters=20, warmup=2).median_ms
    print(f"FLA autotuned: {ms:8.3f} ms", flush=True)
    jit = chunk_bwd.chunk_kda_bwd_kernel_wy_dqkg_fused
    while isinstance(jit, (Autotuner, Heuristics)):
        jit = jit.fn
    names = ("dq", "dk", "dv", "db", "dg", "dA")
    out = dict(dq=torch.empty(B, T, HV, K, device="cuda"), dk=torch.empty(B, T, HV, K, device="cuda"),
               dv2=torch.empty_like(x["v"]), dg=torch.empty_like(x["g"]), db=torch.empty_like(x["beta"]),
               dA=torch.empty_like(x["A"], dtype=torch.float))  # fmt: skip
    NT = T // BT
    for bk, bv, warps, stages in CONFIGS if configs is None else configs:

        def launch(bk=bk, bv=bv, warps=warps, stages=stages):
            return jit[(NT, B * HV)](
                q=x["q"], k=x["k"], v=x["v"], v_new=x["v_new"], g=x["g"], beta=x["beta"], A=x["A"], h=x["h"],
                do=x["do"], dh=x["dh"], dv=x["dv"], cu_seqlens=None, chunk_indices=None, scale=x["scale"], T=T, H=H,
                HV=HV, K=K, V=V, BT=BT, BK=bk, BV=bv, STATE_V_FIRST=True, IS_VARLEN=False, USE_GRAPH=False,
                num_warps=warps, num_stages=stages, **out,
            )  # fmt: skip

        try:
            compiled = launch()
            torch.cuda.synchronize()
            mine = (out["dq"], out["dk"], out["dv2"], out["db"], out["dg"], out["dA"])
            errs = [rel_rmse(r, m) for r, m in zip(ref, mine)]
            t = bc.bench(launch, iters=20, warmup=1).median_ms
            print(f"BK={bk:3d} BV={bv:3d} warps={warps} stages={stages}: {t:8.3f} ms  "
                  f"{getattr(compiled, 'n_regs', '?')} regs, {getattr(compiled, 'n_spills', '?')} spilled  "
                  + " ".join(f"{n}={e:.1e}" for n, e in zip(names, errs)), flush=True)  # fmt: skip
        except Exception as exc:  # a config that does not compile or fit: say so and go on
            print(f"BK={bk:3d} BV={bv:3d} warps={warps} stages={stages}: failed: {type(exc).__name__}: "
                  f"{str(exc)[:160]}", flush=True)  # fmt: skip


if __name__ == "__main__":
    shape = [int(a) for a in sys.argv[1:] if a.isdigit()][:2]
    if "--one" in sys.argv:  # --one BK,BV,WARPS,STAGES
        main(*shape, configs=[tuple(int(x) for x in sys.argv[sys.argv.index("--one") + 1].split(","))])
    elif "--isolated" in sys.argv:
        import subprocess

        for c in ISOLATED:
            subprocess.run([sys.executable, __file__, *map(str, shape), "--one", ",".join(map(str, c))], check=False,
                           timeout=120)  # fmt: skip
    else:
        main(*shape)
