"""Device time of the KDA intra kernel, today's ``cula/ops/kda/sm90/intra.py`` beside other versions of it.

    device run, carry [".device"]:  bash scripts/device/run.sh python scripts/device/time_intra.py [V.py ...]

Each V.py is a copy of the module (an earlier commit's, ``git show <commit>:cula/ops/kda/sm90/intra.py``, or a
variant under test), untracked in the working tree so it travels to the device. Every version runs chunk_kda's
own intra call (sigmoid gate, fused q/k L2 norm and beta sigmoid, g_cum at each chunk's last row only) on the
same inputs; the versions take turns, several rounds, and the median of each version's CUDA-event times is
printed per shape, so a change of a few percent is not clock drift between two separate runs.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bit_identity import load_ref  # noqa: E402 - a module under its own compile cache

SHAPES = [(2, 16384), (1, 16384), (1, 4096)]
H = HV = 64
D = 128


def inputs(B: int, T: int) -> dict:
    torch.manual_seed(0)
    bf16, dev = torch.bfloat16, "cuda"
    x = dict(
        q=torch.randn(B, T, H, D, dtype=bf16, device=dev), k=torch.randn(B, T, H, D, dtype=bf16, device=dev),
        v=torch.randn(B, T, HV, D, dtype=bf16, device=dev), g=torch.randn(B, T, HV, D, dtype=bf16, device=dev),
        beta=torch.randn(B, T, HV, dtype=bf16, device=dev),
    )
    outs = [torch.empty(B, T, HV, D, dtype=bf16, device=dev) for _ in range(4)]
    outs += [torch.empty(B, T, HV, 64, dtype=bf16, device=dev), torch.empty(B, T, HV, D, device=dev)]
    x["outs"] = outs
    x["A_log"] = torch.randn(HV, device=dev) * 0.5
    x["dt_bias"] = torch.randn(HV * D, device=dev) * 0.5
    return x


def call(mod, x) -> None:
    mod.chunk_kda_intra_sm90(
        x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, *x["outs"], None, None, gate="sigmoid",
        A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-5.0, use_qk_l2norm=True, beta_sigmoid=True,
        g_cum_last_only=True,
    )  # fmt: skip


def time_us(mod, x, reps: int = 5) -> list[float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        start.record()
        call(mod, x)
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3)
    return out


def main() -> None:
    from cula.ops.kda.sm90 import intra as cur

    mods = [("today", cur)] + [(os.path.basename(p), load_ref(p)) for p in sys.argv[1:]]
    for B, T in SHAPES:
        x = inputs(B, T)
        for _, m in mods:  # compile and warm up
            call(m, x)
        torch.cuda.synchronize()
        times: dict[str, list[float]] = {name: [] for name, _ in mods}
        for _ in range(6):
            for name, m in mods:
                times[name] += time_us(m, x)
        row = ", ".join(f"{name} {statistics.median(t):.0f} us" for name, t in times.items())
        print(f"intra B{B}-T{T}: {row}", flush=True)
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
