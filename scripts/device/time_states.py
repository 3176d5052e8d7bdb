"""Device time of the KDA state/output kernel's variants, side by side in one process, with bit checks.

    device run, carry [".device"]:  bash scripts/device/run.sh python scripts/device/time_states.py [REF.py ...]
                                    ... time_states.py --ncu NAME

``--ncu NAME`` instead profiles ``NCU_VARIANT`` on shape NAME under Nsight Compute (speed of light, pipe use,
warp states, per-SASS source counters): $OUT/ncu_states.txt and $OUT/ncu_states_source.csv (read the CSV with
``ncu_phases.py``).

For each shape, cula's intra kernel prepares w, u, qg, kg, Aqk (upper triangle zero) and g_cum once; then every
variant in ``VARIANTS`` (``DeltaHFwdOFusedSm90`` switches) runs the state/output kernel on them, taking turns over
several rounds, with an fp32 initial state and the final state written (the kda_prefill suite's flags). Each REF.py
(a copy of ``cula/ops/kda/sm90/delta_h_fwd_o_kernel.py``, or ``delta_h_fwd_o.py`` of a commit from before the kernel
had a module of its own, e.g. ``git show <commit>:...``, untracked so that it travels to the device) adds its
``aqk_causal`` kernel as one more variant, named after the file. Prints each variant's median CUDA-event time per
shape and whether its o and final state equal the first variant's bit for bit. Shapes with few (sequence, head)
pairs or short sequences show the kernel's per-chunk latency; B2-T16384 its bandwidth.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

import torch

H = HV = 64
D = 128
# (name, B, T, sequence lengths or None)
SHAPES = [
    ("B1-T512", 1, 512, None), ("B2-T1000", 2, 1000, None), ("B2-T1024", 2, 1024, None), ("B1-T8192", 1, 8192, None),
    ("varlen-N20-T4096-uniform", 1, 4096, [205] * 16 + [204] * 4), ("varlen-N20-T3840-full", 1, 3840, [192] * 20),
    ("varlen-N20-T4081-skewed", 1, 4081, [107] * 7 + [2048] + [107] * 12),
    ("varlen-N10-T4096", 1, 4096, [410] * 6 + [409] * 4),
    ("B2-T16384", 2, 16384, None),
]  # fmt: skip
# name -> get_compiled keyword arguments (over the suite's flags: varlen as the shape, h0 and ht on, [V, K] state);
# the variants without h0 / ht are not bit-equal (a different result), they size the state's load and store
VARIANTS = {
    "causal": dict(aqk_causal=True),
    "no-h0": dict(aqk_causal=True, has_h0=False),
    "no-ht": dict(aqk_causal=True, has_ht=False),
    "no-h0-ht": dict(aqk_causal=True, has_h0=False, has_ht=False),
}
NCU_VARIANT = "causal"


def prepare(B: int, T: int, lens: list[int] | None) -> dict:
    from cula.ops.kda.sm90.intra import chunk_kda_intra_sm90

    torch.manual_seed(0)
    bf16, dev = torch.bfloat16, "cuda"
    q, k = (torch.randn(B, T, H, D, dtype=bf16, device=dev) for _ in range(2))
    v, g = (torch.randn(B, T, HV, D, dtype=bf16, device=dev) for _ in range(2))
    beta = torch.randn(B, T, HV, dtype=bf16, device=dev)
    cu = None
    if lens is not None:
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    w, u, qg, kg = (torch.empty(B, T, HV, D, dtype=bf16, device=dev) for _ in range(4))
    Aqk = torch.empty(B, T, HV, 64, dtype=bf16, device=dev)
    g_cum = torch.empty(B, T, HV, D, device=dev)
    chunk_kda_intra_sm90(
        q, k, v, g, beta, D**-0.5, w, u, qg, kg, Aqk, g_cum, cu, None, gate="sigmoid",
        A_log=torch.randn(HV, device=dev) * 0.5, dt_bias=torch.randn(HV * D, device=dev) * 0.5, lower_bound=-5.0,
        use_qk_l2norm=True, beta_sigmoid=True, g_cum_last_only=True,
    )  # fmt: skip
    N = B if lens is None else len(lens)
    flat = [t.view(B * T, HV, t.shape[-1]) for t in (w, u, kg, qg, g_cum, Aqk)]
    h0 = 0.01 * torch.randn(N, HV, D, D, device=dev)
    return dict(flat=flat, h0=h0, cu=cu, T=T, N=N, varlen=lens is not None, B=B)


def run(fn, x, o, ht) -> None:
    from cula.ops.kda.sm90.delta_h_fwd_o import _placeholder

    cu = x["cu"] if x["varlen"] else _placeholder(o.device, torch.int32, (2,))
    fn(*x["flat"], o, x["h0"], ht, cu, x["T"], x["N"], D**-0.5)


def main() -> None:
    from cutlass import BFloat16

    from cula.ops.kda.sm90 import delta_h_fwd_o as dh

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bit_identity import load_ref  # a module copy under its own compile cache

    refs = {os.path.basename(p): load_ref(p) for p in sys.argv[1:]}
    for name, B, T, lens in SHAPES:
        x = prepare(B, T, lens)
        kw = dict(dtype=BFloat16, varlen=x["varlen"], has_h0=True, has_ht=True, state_v_first=True)
        fns = {v: dh.get_compiled(**{**kw, **extra}) for v, extra in VARIANTS.items()}
        fns.update({r: m.get_compiled(**kw, aqk_causal=True) for r, m in refs.items()})
        outs = {}
        for v, fn in fns.items():
            o = torch.full((B * T, HV, D), float("nan"), dtype=torch.bfloat16, device="cuda")
            ht = torch.full_like(x["h0"], float("nan"))
            run(fn, x, o, ht)
            outs[v] = (o, ht)
        torch.cuda.synchronize()
        ref = next(iter(outs.values()))
        same = {v: bool(torch.equal(o.view(torch.int16), ref[0].view(torch.int16)) and torch.equal(
            ht.view(torch.int32), ref[1].view(torch.int32))) for v, (o, ht) in outs.items()}  # fmt: skip
        times = {v: [] for v in fns}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(6):
            for v, fn in fns.items():
                for _ in range(5):
                    start.record()
                    run(fn, x, *outs[v])
                    end.record()
                    end.synchronize()
                    times[v].append(start.elapsed_time(end) * 1e3)
        row = ", ".join(f"{v} {statistics.median(t):.1f} us{'' if same[v] else ' (DIFFERS)'}" for v, t in times.items())
        print(f"states {name}: {row}", flush=True)
        del x, outs
        torch.cuda.empty_cache()


def ncu_target(name: str) -> None:
    """Two calls of the ``NCU_VARIANT`` on shape ``name`` (ncu keeps the second)."""
    from cutlass import BFloat16

    from cula.ops.kda.sm90 import delta_h_fwd_o as dh

    _, B, T, lens = next(s for s in SHAPES if s[0] == name)
    x = prepare(B, T, lens)
    kw = dict(dtype=BFloat16, varlen=x["varlen"], has_h0=True, has_ht=True, state_v_first=True)
    fn = dh.get_compiled(**{**kw, **VARIANTS[NCU_VARIANT]})
    o = torch.empty(B * T, HV, D, dtype=torch.bfloat16, device="cuda")
    ht = torch.empty_like(x["h0"])
    for _ in range(2):
        run(fn, x, o, ht)
    torch.cuda.synchronize()


def run_ncu(name: str) -> None:
    out = os.environ.get("OUT", ".")
    rep = os.path.join(out, "ncu_states")
    env = dict(os.environ, CUTE_DSL_LINEINFO="1")
    cmd = ["ncu", "--clock-control", "none", "-k", "regex:DeltaHFwdO", "--launch-skip", "1", "--launch-count", "1",
           "--import-source", "yes", "--section", "SpeedOfLight", "--section", "ComputeWorkloadAnalysis",
           "--section", "MemoryWorkloadAnalysis", "--section", "WarpStateStats", "--section", "SchedulerStats",
           "--section", "SourceCounters", "-f", "-o", rep, sys.executable, __file__, "--ncu-target", name]
    log = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    details = subprocess.run(["ncu", "-i", rep + ".ncu-rep", "--page", "details"], capture_output=True, text=True)
    src = subprocess.run(["ncu", "-i", rep + ".ncu-rep", "--page", "source", "--csv", "--print-source", "sass"],
                         capture_output=True, text=True)
    with open(os.path.join(out, "ncu_states.txt"), "w") as f:
        f.write(log.stdout[-4000:] + log.stderr[-4000:] + details.stdout + details.stderr)
    with open(os.path.join(out, "ncu_states_source.csv"), "w") as f:
        f.write(src.stdout)
    print(details.stdout[-8000:] or log.stderr[-3000:])


if __name__ == "__main__":
    if "--ncu-target" in sys.argv:
        ncu_target(sys.argv[sys.argv.index("--ncu-target") + 1])
    elif "--ncu" in sys.argv:
        run_ncu(sys.argv[sys.argv.index("--ncu") + 1])
    else:
        main()
