"""The prebuilt wheel on the H200, in an environment without the CuTe DSL (run by ``wheel_check.sh``).

Checks, against cula's float32 reference backend (``CULA_BACKEND=reference``, on the same GPU tensors):
``chunk_kda`` fixed length, packed, and training (forward and input gradients), the same call with the fused
softplus gate (no bound known: the intra kernel's any_gate variant), ``kda_decode`` at T = 1 and 4,
``lightning_attn_fwd`` fixed, packed and cut in time, ``lightning_decode``. Each call's configuration is one of the
wheel's smoke variants (``cula.variants._smoke``), and every kernel must come from the wheel (``cula.cache.origins``).
Then times the first call of each family in a fresh process: import torch, make the inputs (CUDA initialised),
then ``import cula`` and the first call, synchronised (the issue's target: 0.3 s), and a second call.
Prints one ``@@`` line per result and exits non-zero on any failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

FAILURES: list[str] = []
BF16, FP32 = torch.bfloat16, torch.float32
DEV = "cuda"


def report(name: str, got, want, tol: float) -> None:
    got, want = got.float(), want.float()
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
    finite = bool(torch.isfinite(got).all())
    ok = finite and err <= tol
    tail = "" if finite else " NON-FINITE"
    print(f"@@{'ok' if ok else 'FAIL'} {name}: max error / max |ref| = {err:.2e} (tol {tol:.0e}){tail}")
    if not ok:
        FAILURES.append(name)


def reference(fn, *args, **kwargs):
    os.environ["CULA_BACKEND"] = "reference"
    try:
        return fn(*args, **kwargs)
    finally:
        del os.environ["CULA_BACKEND"]


def _chunk_inputs(B, T, H=2, HV=4, D=128, N=None, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s, dt=BF16, sc=1.0: (sc * torch.randn(*s, generator=g, device=DEV)).to(dt)  # noqa: E731
    return dict(
        q=r(B, T, H, D), k=r(B, T, H, D), v=r(B, T, HV, D), g=r(B, T, HV, D, dt=FP32), beta=r(B, T, HV),
        A_log=r(HV, dt=FP32, sc=0.5), dt_bias=r(HV * D, dt=FP32, sc=0.5),
        initial_state=r(N or B, HV, D, D, dt=FP32, sc=0.1),
    )  # fmt: skip


# safe_gate with the lower-bound gate, q/k L2 norm, beta sigmoid, initial and final state: the smoke variants
CHUNK_FLAGS = dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, use_qk_l2norm_in_kernel=True,
                   use_beta_sigmoid_in_kernel=True, output_final_state=True)  # fmt: skip


def check_chunk():
    from cula.kda import chunk_kda

    x = _chunk_inputs(2, 300)
    with torch.no_grad():
        for i in range(2):  # the second call takes the plan (one fused launch)
            o, s = chunk_kda(**x, **CHUNK_FLAGS)
            ro, rs = reference(chunk_kda, **x, **CHUNK_FLAGS)
            report(f"chunk_kda fixed, call {i + 1}: o", o, ro, 1e-2)
            report(f"chunk_kda fixed, call {i + 1}: final state", s, rs, 1e-2)
        # the fused softplus gate (no bound known): the intra kernel's any_gate variant where the entry says so
        flags = dict(CHUNK_FLAGS, safe_gate=False, lower_bound=None)
        o, s = chunk_kda(**x, **flags)
        ro, rs = reference(chunk_kda, **x, **flags)
        report("chunk_kda with the softplus gate: o", o, ro, 1e-2)
        cu = torch.tensor([0, 100, 300, 557], dtype=torch.int32, device=DEV)
        xp = _chunk_inputs(1, 557, N=3, seed=1)
        for i in range(2):
            o, s = chunk_kda(**xp, **CHUNK_FLAGS, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
            ro, rs = reference(chunk_kda, **xp, **CHUNK_FLAGS, cu_seqlens=cu)
            report(f"chunk_kda packed, call {i + 1}: o", o, ro, 1e-2)
            report(f"chunk_kda packed, call {i + 1}: final state", s, rs, 1e-2)
        # the same pack cut in time (the segment summary and chain, then the packed state/output kernel)
        from cula.kda.plan import KDA_TUNING
        from cula.time_split import SplitThresholds

        cut = SplitThresholds(items_per_sm=1.0, busy_items_per_sm=1.0, min_segment=128, min_seq_len=256)
        with KDA_TUNING.override((9, 0), time_split=cut):
            o, s = chunk_kda(**xp, **CHUNK_FLAGS, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
        report("chunk_kda packed, cut in time: o", o, ro, 1e-2)
        report("chunk_kda packed, cut in time: final state", s, rs, 1e-2)
    names = ("q", "k", "v", "g", "beta")
    grads = {}
    for label, run in (("cula", chunk_kda), ("reference", lambda **a: reference(chunk_kda, **a))):
        xt = {n: (t.detach().clone().requires_grad_(n in names)) for n, t in x.items()}
        o, s = run(**xt, **CHUNK_FLAGS)
        ((o.float() * 0.01).sum() + s.sum() * 0.01).backward()
        grads[label] = (o.detach(), *(xt[n].grad for n in names))
    report("chunk_kda training: o", grads["cula"][0], grads["reference"][0], 1e-2)
    for n, a, b in zip(names, grads["cula"][1:], grads["reference"][1:]):
        report(f"chunk_kda training: d{n}", a, b, 3e-2)


def check_decode():
    from cula.kda import kda_decode
    from cula.lightning import lightning_attn_fwd, lightning_decode

    g = torch.Generator(device=DEV).manual_seed(2)
    r = lambda *s, dt=BF16, sc=1.0: (sc * torch.randn(*s, generator=g, device=DEV)).to(dt)  # noqa: E731
    N, H, HV, D = 4, 4, 16, 128
    for T in (1, 4):
        q, k, v = r(N, T, H, D), r(N, T, H, D), r(N, T, HV, D)
        gg, beta = r(N, T, HV, D, dt=FP32), r(N, T, HV, dt=FP32)
        a_log, dt_bias = r(HV, dt=FP32, sc=0.5), r(HV * D, dt=FP32, sc=0.5)
        pool = r(N + 2, HV, D, D, dt=FP32, sc=0.1)
        ref_pool = pool.clone()
        idx = torch.tensor([3, 0, -1, 1], dtype=torch.int32, device=DEV)
        o = kda_decode(q, k, v, gg, beta, pool, idx, A_log=a_log, dt_bias=dt_bias)
        ro = reference(kda_decode, q, k, v, gg, beta, ref_pool, idx, A_log=a_log, dt_bias=dt_bias)
        report(f"kda_decode T={T}: o", o, ro, 1e-2)
        report(f"kda_decode T={T}: pool", pool, ref_pool, 1e-2)
    q, k, v = r(N, 1, H, D), r(N, 1, H, D), r(N, 1, HV, D)
    decay = torch.rand(HV, device=DEV)
    pool = r(N + 2, HV, D, D, dt=FP32, sc=0.1)
    ref_pool = pool.clone()
    idx = torch.tensor([3, 0, -1, 1], dtype=torch.int32, device=DEV)
    o = lightning_decode(q, k, v, decay, pool, idx)
    ro = reference(lightning_decode, q, k, v, decay, ref_pool, idx)
    report("lightning_decode: o", o, ro, 1e-2)
    report("lightning_decode: pool", pool, ref_pool, 1e-2)
    for packed in (False, True):
        B, T = (1, 557) if packed else (2, 300)
        q, k, v = r(B, T, 2, D), r(B, T, 2, D), r(B, T, 4, D)
        kw = {"cu_seqlens": torch.tensor([0, 100, 300, 557], dtype=torch.int32, device=DEV)} if packed else {}
        h0 = r(3 if packed else B, 4, D, D, dt=FP32, sc=0.1)
        decay = torch.rand(4, device=DEV)
        with torch.no_grad():
            o, s = lightning_attn_fwd(q, k, v, decay, initial_state=h0, output_final_state=True, **kw)
            ro, rs = reference(lightning_attn_fwd, q, k, v, decay, initial_state=h0, output_final_state=True, **kw)
        report(f"lightning_attn_fwd {'packed' if packed else 'fixed'}: o", o, ro, 1e-2)
        report(f"lightning_attn_fwd {'packed' if packed else 'fixed'}: final state", s, rs, 1e-2)
    # the last pack cut in time (the states-only pass, the combine's scan, the full pass over the segments)
    from cula.lightning.plan import LIGHTNING_TUNING
    from cula.time_split import SplitThresholds

    cut = SplitThresholds(items_per_sm=1.0, busy_items_per_sm=1.0, min_segment=64, min_seq_len=128)
    with LIGHTNING_TUNING.override((9, 0), time_split=cut), torch.no_grad():
        o, s = lightning_attn_fwd(q, k, v, decay, initial_state=h0, output_final_state=True,
                                  cu_seqlens_cpu=kw["cu_seqlens"].cpu(), **kw)
    report("lightning_attn_fwd packed, cut in time: o", o, ro, 1e-2)
    report("lightning_attn_fwd packed, cut in time: final state", s, rs, 1e-2)


def host_us(fn) -> float:
    """The benchmarks' ``host_us`` of ``fn`` (``benchmarks/common.measure_host_overhead``: median host time of one
    call issued with the GPU idle, microseconds): the per-call cost a wheel's kernels must not raise."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
    import common  # noqa: PLC0415 (torch and the standard library only)

    return common.measure_host_overhead(fn)["host_us"]


# one fresh process per family: inputs made (CUDA initialised) before the clock starts
_FIRST_CALL = """
import json, sys, time
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter() - t0
sys.path.insert(0, {here!r})
import wheel_check as w
x = w._chunk_inputs(2, 300)
g = torch.Generator(device="cuda").manual_seed(3)
N, HV, D = 4, 16, 128
dq, dk, dv = (torch.randn(N, 1, 4 if i < 2 else HV, D, device="cuda", generator=g).bfloat16() for i in range(3))
dg, dbeta = torch.randn(N, 1, HV, D, device="cuda"), torch.randn(N, 1, HV, device="cuda")
pool = torch.zeros(N, HV, D, D, device="cuda")
idx = torch.arange(N, dtype=torch.int32, device="cuda")
a_log, bias = torch.zeros(HV, device="cuda"), torch.zeros(HV * D, device="cuda")
torch.cuda.synchronize()
times = []
for i in range(2):
    t = time.perf_counter()
    if i == 0:
        import cula
    if {family!r} == "chunk_kda":
        from cula.kda import chunk_kda
        with torch.no_grad():
            chunk_kda(**x, **w.CHUNK_FLAGS)
    elif {family!r} == "kda_decode":
        from cula.kda import kda_decode
        kda_decode(dq, dk, dv, dg, dbeta, pool, idx, A_log=a_log, dt_bias=bias)
    else:
        from cula.lightning import lightning_decode
        lightning_decode(dq, dk, dv, torch.rand(HV, device="cuda"), pool, idx)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
host = None
if {family!r} == "chunk_kda":
    with torch.no_grad():
        host = w.host_us(lambda: chunk_kda(**x, **w.CHUNK_FLAGS))
import cula.cache
print(json.dumps({{"torch": t_torch, "first": times[0], "second": times[1], "host_us": host,
                  "origins": sorted(set(cula.cache.origins().values())),
                  "dsl": any(m == "cutlass" or m.startswith("cutlass.") for m in sys.modules)}}))
"""


def first_calls():
    here = os.path.dirname(os.path.abspath(__file__))
    for family in ("chunk_kda", "kda_decode", "lightning_decode"):
        proc = subprocess.run([sys.executable, "-c", _FIRST_CALL.format(here=here, family=family)],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        if proc.returncode != 0:
            print(f"@@FAIL first call {family}: {proc.stderr[-3000:]}")
            FAILURES.append(f"first call {family}")
            continue
        t = json.loads(proc.stdout.strip().splitlines()[-1])
        ok = t["first"] <= 0.3 and t["origins"] == ["prebuilt"] and not t["dsl"]
        print(f"@@{'ok' if ok else 'FAIL'} first call {family}: import torch {t['torch']:.2f} s, then import cula "
              f"+ first call {t['first'] * 1e3:.0f} ms (target 300), second call {t['second'] * 1e3:.2f} ms"
              f"{'' if t['host_us'] is None else '; host time of a repeated call %.1f us' % t['host_us']}; "
              f"kernels from {t['origins']}, DSL imported: {t['dsl']}")  # fmt: skip
        if not ok:
            FAILURES.append(f"first call {family}")


def _fla_untuned() -> None:
    """FLA's Triton autotuners take their lightest config (as in tests/conftest.py): every config computes the same
    result, and tuning each kernel at these shapes would take minutes of device time."""
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs
    Autotuner.prune_configs = lambda self, *a, **k: sorted(prune(self, *a, **k),
                                                          key=lambda c: (c.num_stages, c.num_warps))[:1]  # fmt: skip


def main():
    import cula.cache

    _fla_untuned()

    dsl = any(m == "cutlass" or m.startswith("cutlass.") for m in sys.modules)
    print(f"@@info cula from {os.path.dirname(cula.cache.__file__)}; prebuilt: {cula.cache.prebuilt_status()}; "
          f"DSL installed: {cula.cache.dsl_installed()}")
    start = time.perf_counter()
    check_chunk()
    check_decode()
    origins = cula.cache.origins()
    not_prebuilt = {cula.cache.key_text(k): o for k, o in origins.items() if o != "prebuilt"}
    print(f"@@{'ok' if not not_prebuilt else 'FAIL'} {len(origins)} kernel variants used, from the wheel: "
          f"{len(origins) - len(not_prebuilt)}{'' if not not_prebuilt else '; others: ' + repr(not_prebuilt)}")
    if not_prebuilt or dsl or len(origins) < 10:
        FAILURES.append("kernels not all from the wheel")
    print(f"@@info checks took {time.perf_counter() - start:.1f} s")
    first_calls()
    print(f"@@{'PASSED' if not FAILURES else 'FAILED: ' + ', '.join(FAILURES)}")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
