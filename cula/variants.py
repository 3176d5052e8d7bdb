"""Every compiled kernel variant the planners can select, per op, architecture, dtype and flag combination.

A prebuilt wheel is checked against this list (``scripts/build_wheel.py`` compiles it, ``tests/test_variants.py``
drives the public entry points over a grid of calls and checks that every variant they ask ``cula.cache`` for is
listed here). The list is made by calling the launchers' own selection code (``kda_decode_launcher``,
``cula.lightning.plan.launch_key``, the chunk kernels' ``compiled_variant``) under ``cula.cache.recording``, over
the whole domain of the arguments their backends accept; only the chunk forward's choice between its launch forms
(``cula.kda.forward``'s plan, general and time-segmented paths) is restated here, and the test keeps it honest.

``scope``: ``"full"`` is everything selectable; ``"wheel"`` the part a prebuilt wheel ships (``WHEEL_DTYPES``:
the dtypes models use; the rest of the full list JIT-compiles where the DSL is installed, and runs on FLA where it
is not); ``"smoke"`` one configuration of every kernel family (``_smoke``), for CI's wheel build and the H200's
wheel check.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch

from cula import cache

ARCHS = ((9, 0),)  # every kernel targets sm_90a; none exists for sm_100a yet
SCOPES = ("full", "wheel", "smoke")
_BF16, _FP16, _FP32 = torch.bfloat16, torch.float16, torch.float32
# dtypes of the full domain, per role, as the backends' verifiers accept them
FULL_DTYPES = {
    "io": (_BF16, _FP16),  # q / k / v
    "g": (_FP32, _BF16, _FP16),
    "beta": (_BF16, _FP16, _FP32),
    "decode_beta": (_FP32, _BF16),
}
# what the wheel ships: bf16 activations, the gate in fp32 or bf16, beta in bf16 or fp32
WHEEL_DTYPES = {"io": (_BF16,), "g": (_FP32, _BF16), "beta": (_BF16, _FP32), "decode_beta": (_FP32, _BF16)}
_B = (False, True)


def _dtypes(scope: str) -> dict:
    return FULL_DTYPES if scope == "full" else WHEEL_DTYPES


def _kda_chunk(scope: str) -> None:
    """``chunk_kda`` on cula-sm90 (``cula.kda.forward``): the state/output kernel after FLA's intra
    stage; cula's intra kernel (bounded gates: none or the lower-bound sigmoid; any gate in its any_gate variant
    where the entry says so) with it, in the general path
    (inference and training, which also writes Akk), in one fused launch (the plan of a repeated contiguous
    inference call, fixed length or packed), as separate kernels in time segments (B = 1, long T), and cut for the
    exact time-parallel recurrence (the segment summary, the segment chain, then the packed state/output
    kernel)."""
    from cula.kda.plan import KDA_TUNING
    from cula.ops._host import dsl_name
    from cula.ops.kda.sm90 import delta_h_fwd_o as dh
    from cula.ops.kda.sm90 import fwd_launch, intra, segment_chain, segment_summary

    d = _dtypes(scope)
    for dt, varlen, h0, ht, svf, causal in itertools.product(d["io"], _B, _B, _B, _B, _causal_forms()):
        dh.compiled_variant(dtype=dsl_name(dt), varlen=varlen, has_h0=h0, has_ht=ht, state_v_first=svf,
                        aqk_causal=causal)  # fmt: skip
    for dt, g_dt, b_dt, gate, l2, beta_act, extra in _kda_intra_forms(d):
        for varlen, akk in itertools.product(_B, _B):
            intra.compiled_variant(
                varlen=varlen,
                **intra.kernel_options(dt, g_dt, b_dt, gate, l2, beta_act, g_cum_last_only=True, write_akk=akk,
                                       **extra),
            )  # fmt: skip
        options = intra.kernel_options(dt, g_dt, b_dt, gate, l2, beta_act, g_cum_last_only=True, **extra)
        for varlen, h0, ht, svf in itertools.product(_B, _B, _B, _B):
            state = dict(dtype=dsl_name(dt), has_initial_state=h0, has_final_state=ht,
                         state_v_first=svf, aqk_causal=True)  # fmt: skip
            fwd_launch.compiled_variant(options, state, varlen=varlen)
        intra.compiled_variant(varlen=False, **options)  # the segmented launch's intra kernel
    # the training forward under disable_recompute=True: every row of g_cum beside Akk, and the states kernel
    # writing h and v_new, kept for the backward
    _kda_intra_variants(d, g_cum_last_only=False, write_akk=True)
    for dt, varlen, h0, ht, svf in itertools.product(d["io"], _B, _B, _B, _B):
        dh.compiled_variant(dtype=dsl_name(dt), varlen=varlen, has_h0=h0, has_ht=ht, state_v_first=svf,
                            aqk_causal=True, store_states=True)  # fmt: skip
    # the time-parallel path (cula.kda.plan.parallel_segments): every segment's summary and the chain of true
    # starts before the state/output kernel (whose packed variants are above)
    entry = KDA_TUNING.get((9, 0))
    for dt, svf in itertools.product(d["io"], _B):  # (halves: the output pass over each segment's halves)
        segment_summary.compiled_variant(dtype=dsl_name(dt), state_v_first=svf, mid_states=entry.time_split_halves)
    for h0, ht, svf, cols in itertools.product(_B, _B, _B, (8, 16)):  # (8 columns a CTA: few sequences and heads)
        segment_chain.compiled_variant(has_h0=h0, has_ht=ht, state_v_first=svf, cols=cols)


def _causal_forms() -> tuple[bool, ...]:
    """The state/output kernel's ``aqk_causal`` values a call can ask for: False after FLA's intra stages, which
    bf16 / fp16 calls reach only where the entry's intra_any_gate is off (or with ``CULA_KDA_INTRA=0``, compiled
    when met)."""
    from cula.kda.plan import KDA_TUNING

    return (True,) if KDA_TUNING.get((9, 0)).intra_any_gate else (False, True)


def _gdn_chunk(scope: str) -> None:
    """``chunk_gated_delta_rule`` on cula-sm90 where ``GDN_TUNING``'s entry runs it there: cula's intra kernel with
    the per-head gate (``scalar_gate``: the log-space gate or the fused softplus one, exact for any gate) in the
    general path, for inference and (``training_per_head_gate``, writing Akk) training's forward; the state/output
    and time-parallel kernels are KDA's (above), and with ``inference_row_factors`` the intra kernel's factor rows
    and the state/output kernel's variant that applies them (a repeated fixed-length call: both in one launch); with
    ``inference_wy_in_recurrence`` as well, their ``wy_in_recurrence`` variants (and the segment summary's)."""
    from cula.gated_delta_rule.plan import GDN_TUNING
    from cula.kda.forward import factor_rows_fit
    from cula.kda.plan import KDA_TUNING
    from cula.ops._host import dsl_name
    from cula.ops.kda.sm90 import delta_h_fwd_o as dh
    from cula.ops.kda.sm90 import fwd_launch, intra, segment_summary

    entry = GDN_TUNING.get((9, 0))
    akk = [False] * entry.inference_chunk_on_cula + [True] * entry.training_per_head_gate
    d = _dtypes(scope)
    for dt, g_dt, b_dt, gate, l2, beta_act, varlen, write_akk in itertools.product(
        d["io"], d["g"], d["beta"], ("none", "softplus"), _B, intra.BETA_ACTS, _B, akk
    ):  # fmt: skip
        options = intra.kernel_options(dt, g_dt, b_dt, gate, l2, beta_act, g_cum_last_only=True, scalar_gate=True,
                                       write_akk=write_akk)  # fmt: skip
        intra.compiled_variant(varlen=varlen, **options)
    if entry.inference_chunk_on_cula and entry.inference_row_factors:
        wys = ({}, {"wy_in_recurrence": True}) if entry.inference_wy_in_recurrence else ({},)
        # inference uncut: the factor rows in place of qg, kg and g_cum, then the state/output kernel on raw q / k
        for dt, g_dt, b_dt, gate, l2, beta_act, varlen in itertools.product(
            d["io"], d["g"], d["beta"], ("none", "softplus"), _B, intra.BETA_ACTS, _B
        ):  # fmt: skip
            if not factor_rows_fit(dt, l2):  # (qg / kg instead)
                continue
            for wy in wys:
                options = intra.kernel_options(dt, g_dt, b_dt, gate, l2, beta_act, scalar_gate=True, row_factors=True,
                                               **wy)  # fmt: skip
                intra.compiled_variant(varlen=varlen, **options)
                for h0, ht, svf in itertools.product(_B, _B, _B):  # (a repeated call's plan: both in one launch)
                    state = dict(dtype=dsl_name(dt), has_initial_state=h0, has_final_state=ht, state_v_first=svf,
                                 aqk_causal=True, row_factors=True, **wy)  # fmt: skip
                    fwd_launch.compiled_variant(options, state, varlen=varlen)
        for dt, varlen, h0, ht, svf, wy in itertools.product(d["io"], _B, _B, _B, _B, wys):
            dh.compiled_variant(dtype=dsl_name(dt), varlen=varlen, has_h0=h0, has_ht=ht, state_v_first=svf,
                                aqk_causal=True, row_factors=True, **wy)  # fmt: skip
        # cut in time (GdnTuning.time_split): the segment summary on the factor rows (the chain and the packed
        # output pass as above)
        halves = KDA_TUNING.get((9, 0)).time_split_halves
        for dt, svf, wy in itertools.product(d["io"], _B, wys) if entry.time_split is not None else ():
            segment_summary.compiled_variant(dtype=dsl_name(dt), state_v_first=svf, mid_states=halves,
                                             row_factors=True, **wy)  # fmt: skip
    # the training backward's recompute on the per-head gate (cula.kda.backends._training_backward, where KDA's
    # entry puts the recompute on the intra kernel): T read, every g_cum row, with the L2 norm's 1 / norms where
    # the entry's bwd_norm_on_load says so
    kda = KDA_TUNING.get((9, 0))
    if entry.training_per_head_gate and kda.bwd_recompute_intra:
        for dt, g_dt, b_dt, gate, l2, beta_act, varlen in itertools.product(
            d["io"], d["g"], d["beta"], ("none", "softplus"), _B, intra.BETA_ACTS, _B
        ):  # fmt: skip
            for rstd in (False, True) if l2 and kda.bwd_norm_on_load else (False,):
                options = intra.kernel_options(dt, g_dt, b_dt, gate, l2, beta_act, scalar_gate=True, given_t=True,
                                               write_rstd=rstd)  # fmt: skip
                intra.compiled_variant(varlen=varlen, **options)


def _kda_intra_forms(d: dict):
    """(io, g, beta dtypes, gate, L2 norm, beta activation, the any_gate option) of the calls cula's intra kernel
    takes with a gate per channel (cula.kda.plan.use_cula_intra: the log-space gate or the lower-bound sigmoid
    within their bound; where the entry's intra_any_gate is on, the log-space and the softplus gate in the any_gate
    variant too)."""
    from cula.kda.plan import KDA_TUNING
    from cula.ops._host import gate_kind
    from cula.ops.kda.sm90 import intra

    cute_gates = [(gate_kind(fused, lb), {}) for fused, lb in ((False, None), (True, -1.0))]
    if KDA_TUNING.get((9, 0)).intra_any_gate:  # (not the lower-bound gate below -5: rare, compiled when met)
        cute_gates += [(gate, {"any_gate": True}) for gate in ("none", "softplus")]
    for dt, g_dt, b_dt, (gate, extra), l2, beta_act in itertools.product(
        d["io"], d["g"], d["beta"], cute_gates, _B, intra.BETA_ACTS
    ):
        yield dt, g_dt, b_dt, gate, l2, beta_act, extra


def _kda_intra_variants(d: dict, **flags) -> None:
    """The per-channel-gate intra kernel over ``_kda_intra_forms``, fixed and packed, with launch ``flags`` (those with
    the L2 norm alone where the flags write its 1 / norms)."""
    from cula.ops.kda.sm90 import intra

    for (dt, g_dt, b_dt, gate, l2, beta_act, extra), varlen in itertools.product(_kda_intra_forms(d), _B):
        if flags.get("write_rstd") and not l2:
            continue
        intra.compiled_variant(
            varlen=varlen, **intra.kernel_options(dt, g_dt, b_dt, gate, l2, beta_act, **flags, **extra)
        )


def _kda_training(scope: str) -> None:
    """The stages of ``chunk_kda``'s backward that run on cula's kernels where ``KDA_TUNING``'s entry turns them on
    (``cula.kda.fla_backward``): stages 4 and 5 (dv and the state-gradient recurrence, in one launch), 6
    (the state-term and WY gradients), 7 (the intra-score gradients, with stage 8 on chip where the entry says so).
    beta reaches them after the glue's sigmoid (fp32) or as given."""
    from cula.kda.plan import KDA_TUNING
    from cula.ops._host import dsl_name
    from cula.ops.kda.sm90 import bwd_dhu, bwd_intra, bwd_wy_dqkg, delta_h_states

    entry = KDA_TUNING.get((9, 0))
    d = _dtypes(scope)
    if entry.bwd_recompute_intra:  # the recompute prefix (fla_backward.recompute_prefix): every row of g_cum, T read
        _kda_intra_variants(d, g_cum_last_only=False, given_t=True)
        if entry.bwd_norm_on_load:  # ... also writing the 1 / norms stages 6 and 7 normalise with (norm_on_load)
            _kda_intra_variants(d, g_cum_last_only=False, given_t=True, write_rstd=True)
    raw = (False, True) if entry.bwd_norm_on_load else (False,)
    for dt, varlen in itertools.product(d["io"], _B):
        if entry.bwd_recompute_intra and entry.bwd_recompute_states:  # the recompute's h and v_new (no final state)
            for h0, svf in itertools.product(_B, _B):
                delta_h_states.compiled_variant(dtype=dsl_name(dt), varlen=varlen, has_h0=h0, state_v_first=svf)
        if entry.bwd_dv_dhu_lanes is not None:
            for dht, dh0, svf in itertools.product(_B, _B, _B):
                bwd_dhu.compiled_variant(dtype=dsl_name(dt), varlen=varlen, has_dht=dht, has_dh0=dh0,
                                         state_v_first=svf)  # fmt: skip
        for b_dt in d["beta"]:
            if entry.bwd_wy_dqkg:
                for svf, raw_qk in itertools.product(_B, raw):
                    bwd_wy_dqkg.compiled_variant(dtype=dsl_name(dt), beta_dtype=dsl_name(b_dt), state_v_first=svf,
                                                 varlen=varlen, raw_qk=raw_qk)  # fmt: skip
            if entry.bwd_intra:  # with stages 8, 9 and the L2 norm's on chip where the entry says so (_bwd_intra)
                for fused in _bwd_intra_fused(entry, d):
                    bwd_intra.compiled_variant(dtype=dsl_name(dt), beta_dtype=dsl_name(b_dt), varlen=varlen,
                                               reverse_cumsum=entry.bwd_intra_cumsum, **fused)  # fmt: skip


def _bwd_intra_fused(entry, d: dict) -> list[dict]:
    """The stage-7 kernel's fused-neighbour options a call can ask for under ``entry``
    (``cula.kda.fla_backward._stage7_plan``): the L2 norm's backward or not (GVA, or no L2 norm in the call), and
    the gate's backward (the lower-bound gate, any raw-gate dtype, A_log and dt_bias each present or not) or not;
    each in the any_gate variant too where the entry's intra_any_gate is on."""
    from cula.ops._host import dsl_name

    gates = [{}]
    if entry.bwd_intra_cumsum and entry.bwd_intra_gate:
        kinds = ("lower_bound", "softplus") if entry.bwd_intra_softplus_gate else ("lower_bound",)
        gates += [dict(gate=kind, g_raw_dtype=dsl_name(g), has_a_log=a, has_dt_bias=b)
                  for kind, g, a, b in itertools.product(kinds, d["g"], _B, _B)]  # fmt: skip
    norms = (False, True) if entry.bwd_intra_l2norm else (False,)
    fused = [dict(gate_options, l2norm=n) for n in norms for gate_options in gates]
    # with the L2 norm's backward, raw q / k normalised as they load where the entry says so (norm_on_load)
    if entry.bwd_norm_on_load:
        fused += [dict(f, raw_qk=True) for f in fused if f["l2norm"]]
    # gates no bound is known of, where the forward takes them on the intra kernel: the any_gate variants (the
    # softplus gate's backward only there: that gate has no bound)
    bounded = [f for f in fused if f.get("gate") != "softplus"]
    return bounded + ([dict(f, any_gate=True) for f in fused] if entry.intra_any_gate else [])


def _kda_decode(scope: str) -> None:
    """``kda_decode`` / ``kda_decode_step`` / ``fused_recurrent_kda``'s pool form on cula-sm90: every flag
    combination at every T (1..``DECODE_MAX_TOKENS``), below and above the state counts where the tile changes."""
    from cula._validate import DECODE_MAX_TOKENS
    from cula.kda.plan import KDA_TUNING, kda_decode_launcher

    d = _dtypes(scope)
    gates = [("none", False, False), ("softplus", True, False), ("softplus", True, True)]
    gates += [("lower_bound", a, b) for a, b in itertools.product(_B, _B)]
    # (gate, A_log, dt_bias, one gate per head): Gated DeltaNet's decode (gdn_decode, gdn_decode_step and
    # fused_recurrent_gated_delta_rule's decode calls) takes kda_decode's per-head gate, never the lower bound
    gates = [(*gate, False) for gate in gates] + [(*gate, True) for gate in gates if gate[0] != "lower_bound"]
    betas = [(False, False), (True, False), (True, True)]  # (sigmoid, allow_neg_eigval)
    states = (1, KDA_TUNING.get((9, 0)).kv_cols_min_states)
    for io, g_dt, b_dt, kv, (gate, a_log, bias, per_head), l2, (sig, neg), svf, step, tokens, n in itertools.product(
        d["io"], d["g"], d["decode_beta"], (64, 128), gates, _B, betas, _B, _B, range(1, DECODE_MAX_TOKENS + 1),
        states,
    ):  # fmt: skip
        kda_decode_launcher(
            io_dtype=io, g_dtype=g_dt, beta_dtype=b_dt, K=kv, V=kv, gate=gate, has_a_log=a_log, has_dt_bias=bias,
            use_qk_l2norm=l2, beta_sigmoid=sig, allow_neg_eigval=neg, state_v_first=svf, has_step_states=step,
            tokens=tokens, states=n, per_head_gate=per_head,
        )  # fmt: skip


def _lightning(scope: str) -> None:
    """``lightning_attn_fwd`` / ``chunk_simple_gla`` (constant decay, bf16, K = V in {64, 128}) and
    ``lightning_decode`` (bf16 / fp16) on cula-sm90."""
    from cula._validate import DECODE_MAX_TOKENS
    from cula.lightning.plan import LIGHTNING_TUNING, launch_key
    from cula.ops.lightning.sm90 import chunk_fwd as lc
    from cula.ops.lightning.sm90 import decode as ld
    from cula.ops.lightning.sm90 import segment_chain as lsc

    for d, h0, ht, varlen, svf in itertools.product((64, 128), _B, _B, _B, _B):
        lc.compiled_variant(d, h0, ht, varlen, svf)
    # the time-parallel prefill's first pass (cula.lightning.time_parallel): every segment's end state, packed
    for d, svf in itertools.product((64, 128), _B):
        lc.compiled_variant(d, False, True, True, svf, states_only=True)
    # and its combine's scan, with and without initial states
    for d, h0 in itertools.product((64, 128), _B):
        lsc.compiled_variant(d, h0)
    for io, d, svf, tokens, n in itertools.product(
        _dtypes(scope)["io"], (64, 128), _B, range(1, DECODE_MAX_TOKENS + 1),
        (1, LIGHTNING_TUNING.get((9, 0)).kv_cols_min_states),
    ):  # fmt: skip
        ld.compiled(launch_key(io, d, d, tokens, n, state_v_first=svf))


def _smoke() -> None:
    """The variants of the calls ``scripts/device/wheel_check.py`` makes (and CI's wheel build compiles): one
    configuration of every kernel family, FLA's flags as models pass them."""
    from cula.kda.plan import KDA_TUNING, kda_decode_launcher
    from cula.lightning.plan import launch_key
    from cula.ops.kda.sm90 import delta_h_fwd_o as dh
    from cula.ops.kda.sm90 import bwd_dhu, bwd_intra, bwd_wy_dqkg, fwd_launch, intra, segment_chain, segment_summary
    from cula.ops.lightning.sm90 import chunk_fwd as lc
    from cula.ops.lightning.sm90 import decode as ld
    from cula.ops.lightning.sm90 import segment_chain as lsc

    # chunk_kda, bf16 q/k/v, fp32 g, bf16 beta, safe_gate with the lower-bound gate, q/k L2 norm, beta sigmoid,
    # initial and final state: the inference plans (fixed length and packed), training's forward, and the
    # state/output kernel after FLA's intra stage (the same call without safe_gate)
    options = intra.kernel_options(_BF16, _FP32, _BF16, "lower_bound", True, "sigmoid", g_cum_last_only=True)
    state = dict(dtype="BFloat16", has_initial_state=True, has_final_state=True, state_v_first=False,
                 aqk_causal=True)  # fmt: skip
    for varlen in _B:
        fwd_launch.compiled_variant(options, state, varlen=varlen)
    intra.compiled_variant(
        varlen=False,
        **intra.kernel_options(_BF16, _FP32, _BF16, "lower_bound", True, "sigmoid", g_cum_last_only=True,
                               write_akk=True),
    )  # fmt: skip
    for causal in _causal_forms():
        dh.compiled_variant(dtype="BFloat16", has_h0=True, has_ht=True, aqk_causal=causal)
    # training's backward: stages 4 and 5, 6 and 7 on cula's kernels where the entry says so (beta after the glue's
    # sigmoid is fp32)
    entry = KDA_TUNING.get((9, 0))
    if entry.intra_any_gate:  # gates no bound is known of on the intra kernel: a log gate, the softplus gate
        for gate, varlen in itertools.product(("none", "softplus"), _B):
            any_options = intra.kernel_options(_BF16, _FP32, _BF16, gate, True, "sigmoid", g_cum_last_only=True,
                                               any_gate=True)  # fmt: skip
            fwd_launch.compiled_variant(any_options, state, varlen=varlen)
    if entry.bwd_dv_dhu_lanes is not None:
        bwd_dhu.compiled_variant(dtype="BFloat16", varlen=False, has_dht=True, has_dh0=True, state_v_first=False)
    if entry.bwd_wy_dqkg:
        bwd_wy_dqkg.compiled_variant(dtype="BFloat16", beta_dtype="Float32", state_v_first=False, varlen=False)
    if entry.bwd_intra:  # the call's g is fp32, with A_log and dt_bias; GVA (no L2 norm's backward on chip)
        fused = {}
        if entry.bwd_intra_cumsum and entry.bwd_intra_gate:
            fused.update(gate="lower_bound", g_raw_dtype="Float32", has_a_log=True, has_dt_bias=True)
        for any_gate in {False, entry.intra_any_gate}:
            bwd_intra.compiled_variant(dtype="BFloat16", beta_dtype="Float32", varlen=False,
                                       reverse_cumsum=entry.bwd_intra_cumsum, any_gate=any_gate, **fused)  # fmt: skip
    # the backward's recompute prefix on the intra kernel: every gate cumsum row, T read from the forward's Akk
    if entry.bwd_recompute_intra:
        intra.compiled_variant(
            varlen=False,
            **intra.kernel_options(_BF16, _FP32, _BF16, "lower_bound", True, "sigmoid", given_t=True),
        )  # fmt: skip
    # the packed call cut in time: the segment summary, the segment chain, the intra kernel on its own, then the
    # packed state/output kernel
    segment_summary.compiled_variant(dtype="BFloat16", mid_states=entry.time_split_halves)
    intra.compiled_variant(varlen=True, **options)
    segment_chain.compiled_variant(has_h0=True, has_ht=True)
    dh.compiled_variant(dtype="BFloat16", varlen=True, has_h0=True, has_ht=False, aqk_causal=True)
    # kda_decode's defaults (softplus gate with A_log and dt_bias, L2 norm, beta sigmoid, [V, K] pool), T = 1 and 4
    for tokens in (1, 4):
        kda_decode_launcher(
            io_dtype=_BF16, g_dtype=_FP32, beta_dtype=_FP32, K=128, V=128, gate="softplus", has_a_log=True,
            has_dt_bias=True, use_qk_l2norm=True, beta_sigmoid=True, allow_neg_eigval=False, state_v_first=True,
            has_step_states=False, tokens=tokens, states=64,
        )  # fmt: skip
    # gdn_decode's defaults (the same with one gate per token and head), T = 1
    kda_decode_launcher(
        io_dtype=_BF16, g_dtype=_FP32, beta_dtype=_FP32, K=128, V=128, gate="softplus", has_a_log=True,
        has_dt_bias=True, use_qk_l2norm=True, beta_sigmoid=True, allow_neg_eigval=False, state_v_first=True,
        has_step_states=False, tokens=1, states=64, per_head_gate=True,
    )  # fmt: skip
    # lightning_attn_fwd with initial and final state, fixed and packed, and the pack cut in time (its states-only
    # first pass and the combine's scan); lightning_decode at T = 1
    for varlen in _B:
        lc.compiled_variant(128, True, True, varlen, False)
    lc.compiled_variant(128, False, True, True, False, states_only=True)
    lsc.compiled_variant(128, True)
    ld.compiled(launch_key(_BF16, 128, 128, 1, 64, state_v_first=True))


OPS: dict[str, Callable[[str], None]] = {
    "kda.chunk": _kda_chunk, "kda.training": _kda_training, "gdn.chunk": _gdn_chunk, "kda.decode": _kda_decode,
    "lightning": _lightning,
}  # fmt: skip


def planner_variants(scope: str = "full", ops: tuple[str, ...] | None = None) -> dict[tuple, Callable[[], Any]]:
    """``{compile key: build function}`` of every variant the planners can select (see the module docstring).
    Nothing is compiled, and the DSL is not imported."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    found: dict[tuple, Callable[[], Any]] = {}
    if scope == "smoke":
        with cache.recording() as seen:
            _smoke()
        return dict(seen)
    for name in ops or tuple(OPS):
        with cache.recording() as seen:
            OPS[name](scope)
        found.update(seen)
    return found


def variant_texts(scope: str = "full") -> set[str]:
    """``cache.key_text`` of every variant in ``scope`` (what a manifest must cover)."""
    return {cache.key_text(k) for k in planner_variants(scope)}


if __name__ == "__main__":  # python -m cula.variants: the count of each scope, by kernel family
    for scope in SCOPES:
        families: dict[str, int] = {}
        for key in planner_variants(scope):
            families[str(key[0])] = families.get(str(key[0]), 0) + 1
        print(f"{scope}: {sum(families.values())} variants {families}")
