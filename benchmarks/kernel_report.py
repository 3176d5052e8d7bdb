"""Kernel-level timing reports of our SM90 kernels, called directly (no public API, no FLA table).

They answer what the suite benchmarks do not ask: which variant of a kernel is faster, and how far a kernel alone is
from its bytes. Nothing here is a pass/fail gate; the kernels' correctness is tested in tests/ops/.

    python benchmarks/kernel_report.py [REPORT...] [--json PATH]
    device run, carry [".device"]:  bash scripts/device/run.sh python benchmarks/kernel_report.py kda-decode

Reports (all by default):

* ``kda-decode``: ``kda_decode_sm90`` kernel time, state bandwidth and host time per call for N = 1 / 64 / 256
  (T = 1), N = 64 (T = 4, with and without step states), H = HV = 64, K = V = 128, on both pool layouts ([K, V]
  also with the wide lane tile); then the launcher's variants at T = 1: CTA size at 16 warps per SM, one token slot
  per warp at 5 and 6 CTAs per SM, and [K, V] boxes by TMA at 4 and 5 CTAs per SM.
* ``gdn-decode``: Gated DeltaNet's decode on the KDA decode kernel as ``gdn_decode`` runs it in
  ``bench_gdn_decode.py`` (per-head gate, [V, K] pool updated in place, no step states) for MTP verify
  N = 64, T = 4 and decode N = 128 / 512 (H = 16, HV = 32), and KDA's MTP shape (H = HV = 64): every variant of
  ``GDN_DECODE_VARIANTS`` (the wide lane tile, CTA size, token slots, CTAs per SM), each checked against the
  default's output and pool first (``vs_default``: relative RMSE), then timed; what sets
  ``KdaTuning.multi_token_vk`` / ``wide_vk_min_tokens`` and the decode knobs of the tuning entry.
* ``lightning-decode``: ``lightning_decode_sm90`` for N = 1 / 64 / 256 (T = 1) and N = 64 (T = 4) on both layouts,
  each cache-hint pair at N = 64, 20 resident warps per SM, and the persistent grid against one CTA per unit group.
* ``kda-intra``: the intra-chunk kernel (``chunk_kda_intra_sm90``, log-space gate) at B = 2, T = 16384, H = HV = 64
  against FLA's gate cumsum + ``chunk_kda_fwd_intra``.
* ``kda-states``: the state/output kernel (``chunk_kda_delta_h_fwd_o_sm90``) alone on FLA's intermediates at the same
  shape, FLA's intra stage, ``chunk_kda_fwd_sm90`` whole and FLA's ``chunk_kda``.
* ``kda-bwd-dv-dhu``: the backward's dv and state-gradient recurrence in one launch (``chunk_kda_bwd_dv_dhu_sm90``)
  against FLA's ``chunk_kda_bwd_dAv`` + ``chunk_gated_delta_rule_bwd_dhu`` at the same shape.
* ``kda-fwd-h``: the backward recompute's states kernel (``chunk_kda_fwd_h_sm90``: every chunk's h and v_new) against
  FLA's ``chunk_gated_delta_rule_fwd_h`` on FLA's intermediates, at B = 2, T = 16384 and B = 1, T = 4096 (H = 64,
  [K, V] and [V, K] states), and each side's rate of its bytes.

Kernel times are medians of CUDA-event-timed calls (``common.bench``) with L2 flushed before each decode call
(the decode inputs fit in L2) and one input set for the prefill shapes (each far above 2x L2). FLA autotunes on its
first call per shape here (this is not a test run): run through ``scripts/device/run.sh`` to start from the cached
choices.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path

# The script's own directory is on sys.path when run as `python benchmarks/kernel_report.py`.
import common as bc
import torch

K = V = D = 128
H = HV = 64


def kernel_us(call: Callable[[], object], flush: bool = True, iters: int = 200) -> float:
    return bc.bench(call, iters=iters, warmup=25, l2="flush" if flush else "rotate").median_ms * 1e3


def host_us(call: Callable[[], object], n: int = 200) -> float:
    """Wall time per call of ``n`` back-to-back calls (the launch path's host cost while the GPU keeps up)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / n * 1e6


# ------------------------------------------------------------------------------------------------ KDA decode


def _kda_decode_inputs(N: int, T: int, state_v_first: bool, steps: bool) -> tuple:
    """``kda_decode_sm90``'s positional tensors for a softplus-gate call: q, k, v, g, beta, A_log, dt_bias, pool,
    indices, out, step_states."""
    dev = "cuda"
    inner = (V, K) if state_v_first else (K, V)
    q = torch.randn(N, T, H, K, device=dev).to(torch.bfloat16)
    k = torch.randn(N, T, H, K, device=dev).to(torch.bfloat16)
    v = torch.randn(N, T, HV, V, device=dev).to(torch.bfloat16)
    g = torch.randn(N, T, HV, K, device=dev) * 2.0
    beta = torch.randn(N, T, HV, device=dev)
    A_log = torch.rand(HV, device=dev) * 2.0 - 1.0
    dt_bias = torch.randn(HV * K, device=dev) * 0.5
    pool = torch.randn(N, HV, *inner, device=dev) * 0.1
    indices = torch.arange(N, dtype=torch.int32, device=dev)
    out = torch.empty(N, T, HV, V, device=dev, dtype=torch.bfloat16)
    step_states = torch.empty(N, T, HV, *inner, device=dev) if steps else None
    return q, k, v, g, beta, A_log, dt_bias, pool, indices, out, step_states


def report_kda_decode() -> list[dict]:
    from cula.kda.plan import KDA_TUNING, kda_decode_launcher, kda_decode_sm90

    rows = []
    for state_v_first, wide in ((False, False), (False, True), (True, False)):
        for N, T, steps in ((1, 1, False), (64, 1, False), (256, 1, False), (64, 4, False), (64, 4, True)):
            *tensors, step = _kda_decode_inputs(N, T, state_v_first, steps)
            call = functools.partial(
                kda_decode_sm90, *tensors, scale=K**-0.5, gate="softplus", lower_bound=None, use_qk_l2norm=True,
                beta_sigmoid=True, allow_neg_eigval=False, state_v_first=state_v_first, step_states=step,
            )  # fmt: skip
            with KDA_TUNING.override(wide_kv=wide):
                us = kernel_us(call)
                host = host_us(call)
            state_bytes = N * HV * K * V * 4 * (1 + (T if steps else 1))
            layout = ("vk" if state_v_first else "kv") + (" wide" if wide else "")
            rows.append({"report": "kda-decode", "variant": layout, "N": N, "T": T, "step_states": steps,
                         "kernel_us": us, "state_tbps": state_bytes / us / 1e6, "host_us": host})

    def variant_us(N: int, state_v_first: bool, **variant) -> float:
        q, k, v, g, beta, A_log, dt_bias, pool, indices, out, _ = _kda_decode_inputs(N, 1, state_v_first, False)
        launch = kda_decode_launcher(
            io_dtype=q.dtype, g_dtype=g.dtype, beta_dtype=beta.dtype, K=K, V=V, gate="softplus", has_a_log=True,
            has_dt_bias=True, use_qk_l2norm=True, beta_sigmoid=True, allow_neg_eigval=False,
            state_v_first=state_v_first, has_step_states=False, wide_kv=False, **variant,
        )  # fmt: skip
        return kernel_us(functools.partial(launch, q, k, v, g, beta, A_log, dt_bias, pool, indices, out, None,
                                           K**-0.5, None))  # fmt: skip

    def add(name: str, N: int, state_v_first: bool, **variant) -> None:
        us = variant_us(N, state_v_first, **variant)
        rows.append({"report": "kda-decode", "variant": f"{'vk' if state_v_first else 'kv narrow'} {name}", "N": N,
                     "T": 1, "kernel_us": us, "state_tbps": N * HV * K * V * 8 / us / 1e6})  # fmt: skip

    # CTA size at the same 16 resident warps per SM ([V, K] pools)
    for warps, N in itertools.product((2, 8), (64, 256)):
        add(f"{warps} warps/CTA", N, True, warps_per_cta=warps)
    # one token slot per warp frees the shared memory that held the default at 4 CTAs of 4 warps
    for ctas, state_v_first, N in itertools.product((None, 5, 6), (True, False), (64, 256)):
        extra = {} if ctas is None else {"tokens_per_round": 1, "min_blocks_per_sm": ctas}
        add("8 slots, 4 CTAs/SM" if ctas is None else f"1 slot, {ctas} CTAs/SM", N, state_v_first, **extra)
    # [K, V] pools by TMA: whole 128-byte row pieces through shared memory
    for ctas, N in itertools.product((4, 5), (64, 256)):
        add(f"tma 1 slot, {ctas} CTAs/SM", N, False, kv_tma=True, tokens_per_round=1, min_blocks_per_sm=ctas)
    return rows


# ------------------------------------------------------------------------------------------------ GDN decode

GDN_H, GDN_HV = 16, 32  # Qwen3-Next's heads (bench_gdn_decode.py's suite)
# the decode kernel's knobs a GDN call could take (cula.kda.plan.decode_variant's sweep flags, and the wide lane
# tile on [V, K] pools, KdaTuning.wide_vk_min_tokens): name -> explicit variant keywords
GDN_DECODE_VARIANTS = {
    "default": {},
    "wide": {"wide_kv": True},
    "wide, 4 slots": {"wide_kv": True, "tokens_per_round": 4},
    "2 warps/CTA": {"warps_per_cta": 2},
    "8 warps/CTA": {"warps_per_cta": 8},
    "4 slots": {"tokens_per_round": 4},
    "4 slots, 5 CTAs/SM": {"tokens_per_round": 4, "min_blocks_per_sm": 5},
    "8 slots": {"tokens_per_round": 8},  # the narrow tile's own shape, which MTP calls ran before multi_token_vk
    "1 slot, 5 CTAs/SM": {"tokens_per_round": 1, "min_blocks_per_sm": 5},
    "1 slot, 8 CTAs/SM": {"tokens_per_round": 1, "min_blocks_per_sm": 8},
}
GDN_DECODE_KNOBS = ("wide_kv", "warps_per_cta", "tokens_per_round", "min_blocks_per_sm", "kv_cols", "kv_tma")
# (N, T, q/k heads, value heads, per-head gate): GDN's MTP verify (0.77x FLA on the H200) and two decode sizes, then
# KDA's MTP shape (per-channel gate)
GDN_DECODE_SHAPES = ((64, 4, GDN_H, GDN_HV, True), (128, 1, GDN_H, GDN_HV, True), (512, 1, GDN_H, GDN_HV, True),
                     (64, 4, H, HV, False))


def gdn_decode_flags(T: int, states: int, per_head_gate: bool = True, **variant) -> dict:
    """``kda_decode_launcher``'s keywords for a call of T tokens on ``states`` (N x HV) [V, K] states with the
    softplus gate and a variant's explicit knobs: GDN's (per-head gate, all bf16) or KDA's (fp32 g and beta)."""
    low = torch.bfloat16 if per_head_gate else torch.float32
    return dict(
        io_dtype=torch.bfloat16, g_dtype=low, beta_dtype=low, K=K, V=V, gate="softplus", has_a_log=True,
        has_dt_bias=True, use_qk_l2norm=True, beta_sigmoid=True, allow_neg_eigval=False, state_v_first=True,
        has_step_states=False, per_head_gate=per_head_gate, tokens=T, states=states, **variant,
    )  # fmt: skip


def report_gdn_decode() -> list[dict]:
    """Each of ``GDN_DECODE_VARIANTS`` on each of ``GDN_DECODE_SHAPES``: its output and pool against the default's
    (relative RMSE, from the same pool), then its kernel time; a variant the planner resolves to an earlier one's
    kernel says which (``same_as``)."""
    from cula.kda.plan import decode_variant, kda_decode_launcher
    from cula.testing import rel_rmse

    rows, dev = [], "cuda"
    for N, T, h, hv, per_head in GDN_DECODE_SHAPES:
        torch.manual_seed(N * 10 + T)
        q, k = (torch.randn(N, T, h, K, device=dev).to(torch.bfloat16) for _ in range(2))
        v = torch.randn(N, T, hv, V, device=dev).to(torch.bfloat16)
        gate_shape, low = ((N, T, hv), torch.bfloat16) if per_head else ((N, T, hv, K), torch.float32)
        g, beta = torch.randn(gate_shape, device=dev).to(low), torch.randn(N, T, hv, device=dev).to(low)
        A_log = torch.rand(hv, device=dev) - 0.5
        dt_bias = torch.randn(hv if per_head else hv * K, device=dev) * 0.5
        pool0 = torch.randn(N, hv, V, K, device=dev) * 0.1
        indices = torch.arange(N, dtype=torch.int32, device=dev)
        base, keys = None, {}
        for name, variant in GDN_DECODE_VARIANTS.items():
            flags = gdn_decode_flags(T, N * hv, per_head, **variant)
            # what runs: the planner may overrule a knob (T = 1 calls take the tuning's single-token CTA shape)
            chosen = decode_variant(**flags)
            key = tuple(sorted(chosen.items()))
            row = {"report": "gdn-decode", "variant": name, "gate": "per-head" if per_head else "per-channel", "N": N,
                   "T": T, "H": h, "HV": hv, **{n: chosen.get(n) for n in GDN_DECODE_KNOBS}}  # fmt: skip
            if key in keys:
                rows.append({**row, "same_as": keys[key]})
                continue
            keys[key] = name
            try:
                launch = kda_decode_launcher(**flags)
            except ValueError as error:  # a knob this shape's kernel does not take
                rows.append({**row, "error": str(error)[:120]})
                continue
            pool, out = pool0.clone(), torch.empty(N, T, hv, V, device=dev, dtype=torch.bfloat16)
            call = functools.partial(launch, q, k, v, g, beta, A_log, dt_bias, pool, indices, out, None, K**-0.5,
                                     None)  # fmt: skip
            call()
            torch.cuda.synchronize()
            if base is None:
                base = (out.clone(), pool.clone())
            finite = bool(torch.isfinite(out).all() and torch.isfinite(pool).all())
            row["vs_default"] = max(rel_rmse(base[0], out), rel_rmse(base[1], pool)) if finite else float("inf")
            us = kernel_us(call)
            row.update(kernel_us=us, state_tbps=N * hv * K * V * 8 / us / 1e6)
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ Lightning decode


def report_lightning_decode() -> list[dict]:
    from cula.lightning.plan import lightning_decode_sm90
    from cula.ops.lightning.sm90.decode import LOAD_HINTS, STORE_HINTS

    copy_tbps = bc.measure_copy_bandwidth()
    rows = []

    def measure(N: int, state_v_first: bool, T: int = 1, **hints) -> None:
        dev = "cuda"
        q = torch.randn(N, T, H, D, device=dev, dtype=torch.bfloat16)
        k = (torch.randn(N, T, H, D, device=dev) * D**-0.5).to(torch.bfloat16)
        v = torch.randn(N, T, HV, D, device=dev, dtype=torch.bfloat16)
        decay = torch.rand(HV, device=dev)
        pool = torch.randn(2 * N, HV, D, D, device=dev) * 0.1
        indices = torch.randperm(2 * N, device=dev)[:N].to(torch.int32)
        out = torch.empty(N, T, HV, D, device=dev, dtype=torch.bfloat16)
        call = functools.partial(lightning_decode_sm90, q, k, v, decay, pool, indices, out, scale=D**-0.5,
                                 state_v_first=state_v_first, **hints)  # fmt: skip
        us = kernel_us(call)
        tbps = 2 * N * HV * D * D * 4 / us / 1e6
        rows.append({"report": "lightning-decode", "variant": ("vk" if state_v_first else "kv"),
                     "options": " ".join(f"{n}={x}" for n, x in hints.items()), "N": N, "T": T, "kernel_us": us,
                     "state_tbps": tbps, "pct_of_copy": 100 * tbps / copy_tbps, "host_us": host_us(call)})  # fmt: skip

    for state_v_first in (True, False):
        for N in (1, 64, 256):
            measure(N, state_v_first)
        measure(64, state_v_first, T=4)
    for state_v_first, (load_hint, store_hint) in itertools.product((True, False),
                                                                    itertools.product(LOAD_HINTS, STORE_HINTS)):
        measure(64, state_v_first, load_hint=load_hint, store_hint=store_hint)
    # 20 resident warps per SM instead of 16 (ptxas then fits 96 registers and spills a little)
    for state_v_first, N in itertools.product((True, False), (64, 256)):
        measure(N, state_v_first, warps_per_sm=20)
    # the persistent grid (#SMs x CTAs per SM walking the units) against one CTA per unit group
    for state_v_first, (N, T), persistent in itertools.product((True, False), ((64, 1), (256, 1), (64, 4)),
                                                               (True, False)):
        measure(N, state_v_first, T=T, persistent=persistent)
    for r in rows:
        r["copy_tbps"] = copy_tbps
    return rows


# ------------------------------------------------------------------------------------------ KDA prefill stages


def _kda_prefill_inputs(B: int = 2, T: int = 16384) -> tuple:
    """q, k (unit rows), v, log-space gate (about -0.05 a step), beta in (0, 1): bf16 but the fp32 gate."""
    dev = "cuda"
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T, HV, V, device=dev).to(torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, K, device=dev) + 3.0)
    beta = torch.sigmoid(torch.randn(B, T, HV, device=dev)).to(torch.bfloat16)
    return q, k, v, g, beta


def _fla_intra(q, k, v, g, beta, scale):
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.utils import chunk_local_cumsum

    g_cum = chunk_local_cumsum(g, chunk_size=64, scale=1.4426950408889634)  # log2 units, as FLA's stages take it
    return g_cum, *chunk_kda_fwd_intra(q=q, k=k, v=v, gk=g_cum, beta=beta, scale=scale, disable_recompute=True)


def report_kda_intra() -> list[dict]:
    from cula.ops.kda.sm90.intra import chunk_kda_intra_sm90

    q, k, v, g, beta = _kda_prefill_inputs()
    B, T = q.shape[:2]
    scale = K**-0.5
    w, u, qg, kg = (torch.empty(B, T, HV, K, device="cuda", dtype=q.dtype) for _ in range(4))
    Aqk = torch.empty(B, T, HV, 64, device="cuda", dtype=q.dtype)
    g_cum = torch.empty(B, T, HV, K, device="cuda")
    ms = kernel_us(lambda: chunk_kda_intra_sm90(q, k, v, g, beta, scale, w, u, qg, kg, Aqk, g_cum, gate="none"),
                   flush=False, iters=50) / 1e3  # fmt: skip
    ms_fla = kernel_us(lambda: _fla_intra(q, k, v, g, beta, scale), flush=False, iters=50) / 1e3
    nbytes = sum(t.numel() * t.element_size() for t in (q, k, v, g, beta, w, u, qg, kg, Aqk, g_cum))
    return [{"report": "kda-intra", "B": B, "T": T, "cula_intra_us": ms * 1e3, "cula_intra_tbps": nbytes / ms / 1e9,
             "fla_cumsum_intra_us": ms_fla * 1e3}]  # fmt: skip


def report_kda_states() -> list[dict]:
    from fla.ops.kda import chunk_kda

    from cula.kda.forward import chunk_kda_fwd_sm90
    from cula.ops.kda.sm90.delta_h_fwd_o import chunk_kda_delta_h_fwd_o_sm90

    q, k, v, g, beta = _kda_prefill_inputs()
    B, T = q.shape[:2]
    scale = K**-0.5
    g_cum, w, u, qg, kg, Aqk, *_ = _fla_intra(q, k, v, g, beta, scale)
    o = torch.empty_like(v)
    ht = torch.empty(B, HV, K, V, device="cuda")
    ms_kernel = kernel_us(lambda: chunk_kda_delta_h_fwd_o_sm90(w, u, kg, qg, g_cum, Aqk, o, None, ht, scale=scale),
                          flush=False, iters=50) / 1e3  # fmt: skip
    nbytes = sum(t.numel() * t.element_size() for t in (w, u, kg, qg, Aqk, o)) + ht.numel() * 4
    ms_intra = kernel_us(lambda: _fla_intra(q, k, v, g, beta, scale), flush=False, iters=50) / 1e3
    ms_cula = kernel_us(lambda: chunk_kda_fwd_sm90(q, k, v, g, beta, scale, None, True), flush=False, iters=50) / 1e3
    ms_fla = kernel_us(lambda: chunk_kda(q, k, v, g, beta, scale=scale, output_final_state=True), flush=False,
                       iters=50) / 1e3  # fmt: skip
    return [{"report": "kda-states", "B": B, "T": T, "states_kernel_us": ms_kernel * 1e3,
             "states_kernel_tbps": nbytes / ms_kernel / 1e9, "fla_intra_us": ms_intra * 1e3,
             "chunk_kda_fwd_sm90_us": ms_cula * 1e3, "fla_chunk_kda_us": ms_fla * 1e3}]  # fmt: skip


def report_kda_bwd_dv_dhu() -> list[dict]:
    """Stages 4 and 5 of the KDA backward at the prefill shape: FLA's chunk_kda_bwd_dAv then
    chunk_gated_delta_rule_bwd_dhu against cula's one launch on the same inputs (FLA's intermediates, random do /
    dht, a causal Aqk), [V, K] states, and the bytes' rate."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv

    from cula.ops.kda.sm90.bwd_dhu import chunk_kda_bwd_dv_dhu_sm90

    q, k, v, g, beta = _kda_prefill_inputs()
    B, T = q.shape[:2]
    scale = K**-0.5
    g_cum, w, u, qg, kg, *_ = _fla_intra(q, k, v, g, beta, scale)
    do, v_new = (torch.randn(B, T, HV, V, device="cuda").to(q.dtype) for _ in range(2))
    t = torch.arange(T, device="cuda")
    causal = ((t % 64)[:, None] >= torch.arange(64, device="cuda")[None, :])[None, :, None, :]
    aqk = (torch.randn(B, T, HV, 64, device="cuda") * 0.1 * causal).to(q.dtype)
    dht, h0 = torch.randn(B, HV, V, K, device="cuda") * 0.1, torch.zeros(B, HV, V, K, device="cuda")
    stage5 = dict(q=qg, k=kg, w=w, do=do, gk=g_cum, h0=h0, dht=dht, scale=scale, state_v_first=True)

    def fla():
        _, dv = chunk_kda_bwd_dAv(q=qg, k=kg, v=v_new, do=do, A=aqk, scale=scale, chunk_size=64)
        return chunk_gated_delta_rule_bwd_dhu(**stage5, dv=dv, chunk_size=64)

    ms = kernel_us(lambda: chunk_kda_bwd_dv_dhu_sm90(**stage5, Aqk=aqk, v_new=v_new), flush=False, iters=50) / 1e3
    ms_fla = kernel_us(fla, flush=False, iters=50) / 1e3
    NT = -(-T // 64)
    nbytes = (sum(t.numel() * t.element_size() for t in (qg, kg, w, do, v_new, aqk, g_cum)) + do.numel() * 2
              + aqk.numel() * 4 + B * NT * HV * K * V * 2 + 2 * dht.numel() * 4)  # fmt: skip
    return [{"report": "kda-bwd-dv-dhu", "B": B, "T": T, "cula_us": ms * 1e3, "fla_us": ms_fla * 1e3,
             "speedup": ms_fla / ms, "cula_tbps": nbytes / ms / 1e9}]  # fmt: skip


def report_kda_fwd_h() -> list[dict]:
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

    from cula.ops.kda.sm90.delta_h_states import chunk_kda_fwd_h_sm90

    rows = []
    for B, T in ((2, 16384), (1, 4096)):
        q, k, v, g, beta = _kda_prefill_inputs(B, T)
        g_cum, w, u, qg, kg, *_ = _fla_intra(q, k, v, g, beta, K**-0.5)
        h0 = torch.randn(B, HV, K, V, device="cuda") * 0.1
        # w, u, kg in, h (a state a chunk) and v_new out, the initial state and a gate row a chunk
        nbytes = (4 * w.numel() * 2 + B * -(-T // 64) * HV * K * V * 2 + h0.numel() * 4
                  + B * -(-T // 64) * HV * K * 4)  # fmt: skip
        for svf in (False, True):
            args = dict(k=kg, w=w, u=u, gk=g_cum, initial_state=h0, chunk_size=64, state_v_first=svf)
            ms = kernel_us(lambda: chunk_kda_fwd_h_sm90(**args), flush=False, iters=50) / 1e3
            ms_fla = kernel_us(lambda: chunk_gated_delta_rule_fwd_h(**args), flush=False, iters=50) / 1e3
            rows.append({"report": "kda-fwd-h", "B": B, "T": T, "state_v_first": svf, "cula_us": ms * 1e3,
                         "fla_us": ms_fla * 1e3, "speedup": ms_fla / ms, "cula_tbps": nbytes / ms / 1e9,
                         "fla_tbps": nbytes / ms_fla / 1e9})  # fmt: skip
    return rows


REPORTS = {
    "kda-decode": report_kda_decode,
    "gdn-decode": report_gdn_decode,
    "lightning-decode": report_lightning_decode,
    "kda-intra": report_kda_intra,
    "kda-states": report_kda_states,
    "kda-bwd-dv-dhu": report_kda_bwd_dv_dhu,
    "kda-fwd-h": report_kda_fwd_h,
}


def _fmt(row: dict) -> str:
    return "  ".join(f"{n}={x:.3f}" if isinstance(x, float) else f"{n}={x}" for n, x in row.items() if n != "report")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="*", metavar="REPORT", help=f"any of {', '.join(REPORTS)} (default: all)")
    parser.add_argument("--json", type=Path, help="also write the rows and the environment here")
    args = parser.parse_args(argv)
    unknown = [r for r in args.reports if r not in REPORTS]
    if unknown:
        parser.error(f"unknown report(s) {', '.join(unknown)}; choose from {', '.join(REPORTS)}")
    if not torch.cuda.is_available():
        raise SystemExit("kernel_report needs a CUDA GPU")
    rows = []
    for name in args.reports or list(REPORTS):
        print(f"== {name}", flush=True)
        for row in REPORTS[name]():
            print(_fmt(row), flush=True)
            rows.append(row)
    if args.json is not None:
        args.json.write_text(json.dumps({"meta": bc.environment_meta(), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
