"""KDA and Lightning decode at T=1 by CTA size: does a smaller CTA (1 or 2 warps, 4 or 8 KB of state) reach more of
the copy bandwidth at N >= 64 than the default 4-warp CTA (16 KB)? The traffic-only kernels of ``decode_ceiling.py``
reached 93.1% of copy at N=64 with 4 KB programs against 89.1% with 16 KB ones (token work included); the decode
kernel's CTA size had only been swept at N=1. Kernel time by CUDA-graph replay (``decode_n1.graph_us``), the
variants taking turns over three rounds (median of the rounds), [V, K] pools, the benchmarks' inputs. Session 19's
first run (KDA, H200): 1 warp x 20 CTAs per SM 137.3 / 267.3 / 528.4 / 1053.9 us at N = 64 / 128 / 256 / 512
against 140.4 / 273.2 / 539.4 / 1075.3 for 4 x 5 (92.0 / 94.5 / 95.6 / 95.9% of copy against 90.0 / 92.5 / 93.7 /
94.0); 2 x 10 as 4 x 5; 16 or 24 warps per SM 4-6% slower.

    device run, carry [".device"]:  bash scripts/device/run.sh python scripts/device/decode_cta_size.py [--mtp]

``--ns 2,8,32`` / ``--boxes 2x6,4x3``: other N values / kv_cols boxes. ``--mtp``: the same question for the MTP
verify call (N=64, T = 2 / 4 / 8 or ``--ts 3,5``), by token slots and CTA size (``--mtp --kv``: on [K, V] pools, the
wide tile against kv_cols boxes, ``--boxes 2x1x6`` as warps x slots x CTAs per SM; session 21 switched
MULTI_TOKEN_KV_COLS on from it; ``--mtp --rows``: [V, K] pools, the default against kv_cols boxes of pool
rows, ``MULTI_TOKEN_VK_COLS``'s question, not run yet); ``--kv``: [K, V] pools, KDA's kv_tma against its kv_cols
boxes (``KdaDecodeSm90(kv_cols=True)``) and Lightning's tile against its column kernel
(``LightningDecodeSm90(cols=True)``).
``--kv`` and ``--mtp`` ran in session 20 (see the KV_COLS comments of the two decode modules,
docs/perf-notes-decode.md).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kda_decode as B  # noqa: E402
import common as bc  # noqa: E402
import decode_n1  # noqa: E402

import cula.ops.kda.sm90.decode as D  # noqa: E402
import cula.ops.lightning.sm90.decode as L  # noqa: E402

# (warps per CTA, CTAs per SM): 20 resident warps at 96 registers unless said otherwise
VARIANTS = [(4, 5), (1, 20)]
# Lightning (warps per CTA, warps per SM, state values a lane): 64 a lane fit 16 warps at the 128-register cap, 32
# fit 24 (80 registers)
LIGHTNING = [(4, 16, 64), (1, 16, 64), (1, 20, 32), (1, 24, 32), (4, 24, 32)]
NS = (1, 64, 128, 256, 512)
# MTP verify (``--mtp``: N=64, T = 2 / 4 / 8, KDA [V, K]): (token slots a warp, warps per CTA, CTAs per SM) beside the
# T>1 default (8 slots, 4 warps, 4 CTAs). ptxas (CPU compile): 104 registers for the default, 106 for one-warp CTAs
# at 16 per SM, 96 with 20 bytes spilled at 20, 96 / 24 bytes at 4 x 5
MTP = [(4, 1, 16), (8, 1, 16), (4, 1, 20), (4, 4, 5)]


def _rounds_us(calls: dict) -> dict:
    """Graph-replay microseconds of every call, the calls taking turns over three rounds: key -> [us per round]."""
    times = {key: [] for key in calls}
    for _ in range(3):
        for key, call in calls.items():
            times[key].append(decode_n1.graph_us(call))
    return times


def _kda_case(N: int, T: int, kv: bool = False):
    """The benchmark's inputs for one KDA decode shape ([K, V] pool with ``kv``): ``(make, inputs)``, where
    ``make(**flags)`` is the zero-argument call of the ``kda_decode_launcher`` variant those flags select (the
    benchmark's gate and flags besides), ready for :func:`_rounds_us`, and ``inputs`` the set it runs on."""
    cfg = B.Config(N, T, 64, kv=kv)
    s, shared = B.make_set(cfg, 0), B.make_shared(cfg)
    q, k, v, g, beta, pool, idx = (s[n] for n in ("q", "k", "v", "g", "beta", "pool", "indices"))
    out = torch.empty_like(v)

    def make(**flags):
        launch = D.kda_decode_launcher(
            io_dtype=q.dtype, g_dtype=g.dtype, beta_dtype=beta.dtype, K=B.K, V=B.V, gate="lower_bound",
            has_a_log=True, has_dt_bias=True, use_qk_l2norm=True, beta_sigmoid=True, allow_neg_eigval=False,
            state_v_first=not kv, has_step_states=False, **flags,
        )  # fmt: skip
        return lambda: launch(q, k, v, g, beta, shared["A_log"], shared["dt_bias"], pool, idx, out, None, B.K**-0.5,
                              -5.0)  # fmt: skip

    return make, s


def main():
    decode_n1.CALLS = 10  # graphs of 10 launches: N=512 is ~1 ms a launch
    copy_tbps = bc.measure_copy_bandwidth()
    print(f"copy {copy_tbps:.3f} TB/s", flush=True)
    calls = {}
    for N in NS:
        make, _ = _kda_case(N, 1)
        for w, ctas in VARIANTS:
            calls[(N, w, ctas)] = make(warps_per_cta=w, tokens_per_round=1, min_blocks_per_sm=ctas)
        lq, lk, lv = (torch.randn(N, 1, B.HV, B.K, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        lpool = 0.01 * torch.randn(2 * N, B.HV, B.V, B.K, device="cuda")
        lidx = torch.randperm(2 * N, device="cuda")[:N].to(torch.int32)
        decay = torch.rand(B.HV, device="cuda")
        lout = torch.empty_like(lv)
        for w, per_sm, regs in LIGHTNING:
            launch = L.lightning_decode_launcher(
                lq, lv, state_v_first=True, warps_per_sm=per_sm, warps_per_cta=w, state_regs=regs
            )

            def call(launch=launch, q=lq, k=lk, v=lv, decay=decay, pool=lpool, idx=lidx, out=lout):
                launch(q, k, v, decay, pool, idx, out, B.K**-0.5)

            calls[(N, "lightning", w, per_sm, regs)] = call
    times = _rounds_us(calls)
    for N in NS:
        nbytes = N * B.HV * B.K * B.V * 4 * 2
        for w, ctas in VARIANTS:
            us = statistics.median(times[(N, w, ctas)])
            tbps = nbytes / us / 1e6
            print(f"N={N:4d} kda {w} warps/CTA x {ctas:2d} CTAs/SM: {us:8.2f} us  {tbps:5.3f} TB/s  "
                  f"{100 * tbps / copy_tbps:5.1f}% of copy", flush=True)
        for w, per_sm, regs in LIGHTNING:
            us = statistics.median(times[(N, "lightning", w, per_sm, regs)])
            tbps = nbytes / us / 1e6
            print(f"N={N:4d} lightning {w} warps/CTA, {per_sm} warps/SM, {regs} values/lane: {us:8.2f} us  "
                  f"{tbps:5.3f} TB/s  "
                  f"{100 * tbps / copy_tbps:5.1f}% of copy", flush=True)


# MTP verify on [K, V] pools (``--mtp --kv``): the T>1 default there (wide_kv, 3 CTAs of 4 warps) against kv_cols
# boxes, as (warps per CTA, token slots a warp, CTAs per SM); test_kv_cols_tokens_match checked kv_cols at T > 1
MTP_KV = [(2, 1, 6), (2, 2, 6), (2, 4, 5), (4, 2, 3)]
MTP_TOKENS = (2, 4, 8)


def mtp(kv: bool = False, rows: bool = False):
    """Kernel time of the MTP verify call by token slots and CTA size (the T=1 sweep's question at T > 1); with
    ``kv``, on [K, V] pools: the wide tile against kv_cols boxes; with ``rows``, on [V, K] pools: the default
    against kv_cols boxes of pool rows (``MTP_KV``'s boxes)."""
    decode_n1.CALLS = 10
    copy_tbps = bc.measure_copy_bandwidth()
    calls = {}
    for T in MTP_TOKENS:
        make, _ = _kda_case(64, T, kv)
        for variant in [None, *(MTP_KV if kv or rows else MTP)]:
            if variant is None:  # the wide tile named: on [K, V] pools kv_cols is the default up to 5 tokens
                extra = dict(wide_kv=True) if kv else {}
            elif kv or rows:
                extra = dict(kv_cols=True, wide_kv=False, warps_per_cta=variant[0], tokens_per_round=variant[1],
                             min_blocks_per_sm=variant[2])  # fmt: skip
            else:
                extra = dict(zip(("tokens_per_round", "warps_per_cta", "min_blocks_per_sm"), variant))
            calls[(T, variant)] = make(tokens=T, **extra)
    times = _rounds_us(calls)
    nbytes = 64 * B.HV * B.K * B.V * 4 * 2
    for (T, variant), ts in times.items():
        us = statistics.median(ts)
        if variant is None:
            what = "wide_kv (4 warps, 3 CTAs/SM)" if kv else "default (8 slots, 4 warps, 4 CTAs/SM)"
        elif kv or rows:
            what = "kv_cols %d warps/CTA, %d slots, %d CTAs/SM" % variant
        else:
            what = "%d slots, %d warps/CTA, %d CTAs/SM" % variant
        print(f"mtp{' kv' if kv else ' vk rows' if rows else ''} N=64 T={T} {what:40s}: {us:8.2f} us  "
              f"{100 * nbytes / us / 1e6 / copy_tbps:5.1f}% of copy (state bytes once)", flush=True)  # fmt: skip


# [K, V] pools (``--kv``): the T=1 default (kv_tma, [128, 32] TMA boxes) against kv_cols (warps per CTA, CTAs per SM)
KV_COLS = [(4, 3), (2, 6), (1, 12)]


def kv_pools():
    """Kernel time of T=1 calls on [K, V] pools: kv_tma against kv_cols boxes of 1, 2 and 4 warps; Lightning's
    4-warp tile against its column kernel with the same boxes (both defaults since session 20 up to
    KV_COLS_MIN_STATES, the column kernels above)."""
    decode_n1.CALLS = 10
    copy_tbps = bc.measure_copy_bandwidth()
    calls = {}
    for N in NS:
        make, kda_set = _kda_case(N, 1, kv=True)
        pool, idx = kda_set["pool"], kda_set["indices"]
        for variant in [None, *KV_COLS]:
            extra = dict(kv_tma=True, wide_kv=False, tokens_per_round=1, min_blocks_per_sm=D.KV_TMA_MIN_BLOCKS)
            if variant is not None:
                extra = dict(kv_cols=True, wide_kv=False, tokens_per_round=1, warps_per_cta=variant[0],
                             min_blocks_per_sm=variant[1])  # fmt: skip
            calls[(N, variant)] = make(tokens=1, **extra)
        # Lightning on the same [K, V] pool: the 4-warp tile against its column kernel
        lq, lk, lv = (torch.randn(N, 1, B.HV, B.K, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        decay = torch.rand(B.HV, device="cuda")
        lout = torch.empty_like(lv)
        for variant in [None, *KV_COLS]:
            extra = dict(cols=False)  # the 4-warp tile
            if variant is not None:
                extra = dict(cols=True, warps_per_cta=variant[0], warps_per_sm=variant[0] * variant[1])
            launch = L.lightning_decode_launcher(lq, lv, state_v_first=False, **extra)

            def call(launch=launch, q=lq, k=lk, v=lv, decay=decay, pool=pool, idx=idx, out=lout):
                launch(q, k, v, decay, pool, idx, out, B.K**-0.5)

            calls[(N, ("lightning", variant))] = call
    times = _rounds_us(calls)
    for (N, variant), ts in times.items():
        us = statistics.median(ts)
        if isinstance(variant, tuple) and variant[0] == "lightning":
            what = "lightning tile"
            if variant[1] is not None:
                what = "lightning cols %d warps/CTA x %d CTAs/SM" % variant[1]
        else:
            what = "kv_tma" if variant is None else "kv_cols %d warps/CTA x %d CTAs/SM" % variant
        tbps = N * B.HV * B.K * B.V * 8 / us / 1e6
        print(f"kv N={N:4d} {what:34s}: {us:8.2f} us  {tbps:5.3f} TB/s  {100 * tbps / copy_tbps:5.1f}% of copy",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    with torch.inference_mode():
        args = sys.argv[1:]
        if "--ns" in args:  # e.g. --ns 2,8,32: the N values instead of NS
            NS = tuple(int(n) for n in args[args.index("--ns") + 1].split(","))
        if "--boxes" in args:  # e.g. --boxes 2x6,4x3 (--kv), 2x1x6 (--mtp --kv): the kv_cols boxes to time
            boxes = [tuple(int(x) for x in b.split("x")) for b in args[args.index("--boxes") + 1].split(",")]
            if "--mtp" in args:  # --kv or --rows
                MTP_KV = boxes
            else:
                KV_COLS = boxes
        if "--ts" in args:  # e.g. --ts 3,5,6: the MTP token counts instead of MTP_TOKENS
            MTP_TOKENS = tuple(int(t) for t in args[args.index("--ts") + 1].split(","))
        if "--mtp" in args:
            mtp(kv="--kv" in args, rows="--rows" in args)
        else:
            kv_pools() if "--kv" in args else main()
