"""A chunk_kda training step (forward + backward) on cula's path against FLA's, in one process.

    device run, carry [".device"]:  bash scripts/device/run.sh python scripts/device/time_training.py [B T H]

cula's path is our forward kernels with FLA 0.6.0's backward (``cula.kda.backends._ChunkKDATraining``), FLA's is
its own forward and backward; both get the same inputs (the kda_prefill suite's flags: fused sigmoid gate with
A_log and dt_bias, q/k L2 norm, beta sigmoid, [V, K] state, an initial state) and the same output gradients. Prints
the median CUDA-event time of forward, backward and the step for each, and the largest relative RMSE between their
gradients. FLA autotunes its backward on the first call of a shape (~200 s on a fresh machine for the suite's
shapes; run.sh restores the cached choices), so keep to one shape per device call. Default B=2, T=4096, H=HV=64.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

os.environ.setdefault("FLA_FLASH_KDA", "0")
os.environ.setdefault("FLA_CULA", "0")  # FLA's calls stay FLA's (cula.fla_dispatch)
FLAGS = dict(output_final_state=True, use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=True,
             use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True)  # fmt: skip


def inputs(B: int, T: int, H: int, D: int = 128) -> dict:
    torch.manual_seed(0)
    bf16, dev = torch.bfloat16, "cuda"
    x = {n: torch.randn(B, T, H, D, dtype=bf16, device=dev) for n in ("q", "k", "v", "g")}
    x.update(beta=torch.randn(B, T, H, dtype=bf16, device=dev), A_log=0.5 * torch.randn(H, device=dev),
             dt_bias=0.5 * torch.randn(H * D, device=dev), initial_state=0.01 * torch.randn(B, H, D, D, device=dev))
    return x


def step_times(fn, x: dict, w_o: torch.Tensor, w_t: torch.Tensor, reps: int = 10) -> tuple[dict, dict]:
    """Median forward / backward / step milliseconds of ``fn`` and the gradients of its last run."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    times = {"fwd": [], "bwd": [], "step": []}
    for _ in range(reps + 1):  # the first run compiles / autotunes
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        ev[0].record()
        o, ht = fn(**leaves, **FLAGS)
        ev[1].record()
        ((o.float() * w_o).sum() + (ht * w_t).sum()).backward()
        ev[2].record()
        torch.cuda.synchronize()
        times["fwd"].append(ev[0].elapsed_time(ev[1]))
        times["bwd"].append(ev[1].elapsed_time(ev[2]))
        times["step"].append(ev[0].elapsed_time(ev[2]))
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    return med, {n: t.grad for n, t in leaves.items()}


def main() -> None:
    import fla.ops.kda as fk

    import cula.kda as ck
    import cula.kda.backends as kb
    from cula.testing import rel_rmse

    B, T, H = (int(a) for a in sys.argv[1:4]) if len(sys.argv) >= 4 else (2, 4096, 64)
    assert kb.CHUNK_TRAINING_ON_CULA, "cula's training path is switched off"
    x = inputs(B, T, H)
    w_o = torch.randn(B, T, H, 128, device="cuda")
    w_t = torch.randn(B, H, 128, 128, device="cuda")
    fla_t, fla_g = step_times(fk.chunk_kda, x, w_o, w_t)
    cula_t, cula_g = step_times(ck.chunk_kda, x, w_o, w_t)
    worst = max((rel_rmse(fla_g[n], cula_g[n]), n) for n in fla_g)
    print(f"training B{B}-T{T}-H{H} (ms): " + ", ".join(
        f"{k} fla {fla_t[k]:.3f} cula {cula_t[k]:.3f} ({fla_t[k] / cula_t[k]:.2f}x)" for k in fla_t))  # fmt: skip
    print(f"largest gradient difference: d{worst[1]} rel RMSE {worst[0]:.2e}")


if __name__ == "__main__":
    main()
