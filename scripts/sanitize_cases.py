"""Small calls that reach every CuTe DSL kernel variant cula's dispatch can select, for compute-sanitizer.

Each case goes through the public API (so the planner picks the variant, as in a user's program), runs once and
synchronises; ``@@case NAME`` / ``@@done NAME`` markers around it let ``scripts/sanitize.sh`` attribute a finding
to a case. At the end ``@@variants`` lists the compile keys that ran (``cula.cache``), which the report records so
that a new variant without a case shows up as missing from it.

    python scripts/sanitize_cases.py [--list] [--group I/N] [NAME_SUBSTRING ...]

Run under ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` (sanitize.sh does): every tensor is then its own allocation, so
memcheck sees an access past a tensor's end and initcheck sees a read of memory no one wrote since it was
allocated, instead of the caching allocator's recycled blocks.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from unittest import mock

os.environ.setdefault("FLA_FLASH_KDA", "0")
os.environ.setdefault("FLA_CULA", "0")  # FLA's calls stay FLA's (cula.fla_dispatch)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

DEV = "cuda"
CASES: dict[str, callable] = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def _r(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def _cu(lens):
    from cula.testing import make_cu_seqlens

    return make_cu_seqlens(list(lens), device=DEV)


def _kda_chunk(B, lens, H, HV, *, dtype=torch.bfloat16, gate="lower_bound", h0=True, v_first=False, cpu_copy=True,
               grad=False, neg=False, keep=False, graph=False, states=False):  # fmt: skip
    """One chunk_kda call: fixed (lens an int T, B sequences) or packed (lens a list, B = 1); ``graph``: packed in
    FLA's graph mode (``use_graph``, ``max_num_seqs`` the sequence count); ``states``: inference with
    ``return_intermediate_states``."""
    from cula.kda import chunk_kda
    from cula.kda.plan import INTRA_ENV

    packed = isinstance(lens, (list, tuple))
    T = sum(lens) if packed else lens
    N = len(lens) if packed else B
    q, k = _r(B, T, H, 128, dtype=dtype), _r(B, T, H, 128, dtype=dtype)
    v = _r(B, T, HV, 128, dtype=dtype)
    beta = _r(B, T, HV, dtype=torch.float32)
    kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg, safe_gate=True,
              state_v_first=v_first, output_final_state=True)  # fmt: skip
    if gate == "lower_bound":
        g = _r(B, T, HV, 128, dtype=torch.float32)
        kw.update(use_gate_in_kernel=True, lower_bound=-5.0, A_log=torch.randn(HV, device=DEV) * 0.1,
                  dt_bias=torch.randn(HV * 128, device=DEV) * 0.1)  # fmt: skip
    elif gate == "softplus":  # the fused gate with no lower bound (the intra kernel's any_gate variant)
        g = _r(B, T, HV, 128, dtype=torch.float32)
        kw.update(use_gate_in_kernel=True, lower_bound=None, safe_gate=False, A_log=torch.randn(HV, device=DEV) * 0.1,
                  dt_bias=torch.randn(HV * 128, device=DEV) * 0.1)  # fmt: skip
    elif gate == "none":
        g = -torch.rand(B, T, HV, 128, device=DEV) * 0.5  # log-space, within the safe range
    elif gate == "steep":  # no bound known (no safe_gate), and steps of -80 nats: the any_gate variant's exact path
        g = torch.nn.functional.logsigmoid(_r(B, T, HV, 128, dtype=torch.float32))
        g = g.masked_fill(torch.rand_like(g) < 0.03, -80.0)
        kw.update(safe_gate=False)
    else:  # FLA's intra stage (CULA_KDA_INTRA=0: the any_gate variant takes such gates by default), our state kernel
        g = torch.nn.functional.logsigmoid(_r(B, T, HV, 128, dtype=torch.float32))
        kw.update(safe_gate=False)
    if h0:
        kw["initial_state"] = torch.randn(N, HV, 128, 128, device=DEV) * 0.1
    if packed:
        kw["cu_seqlens"] = _cu(lens)
        if cpu_copy:
            kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu()
        if graph:
            kw.update(use_graph=True, max_num_seqs=len(lens))
    intra_env = {INTRA_ENV: "0"} if gate == "fla" else {}
    if grad:
        for t in (q, k, v, g, beta):
            t.requires_grad_(True)
        with mock.patch.dict(os.environ, intra_env):
            o, ht = chunk_kda(q, k, v, g, beta, disable_recompute=keep, **kw)
            (o.float().sum() + ht.sum()).backward()
        return o
    with torch.inference_mode(), mock.patch.dict(os.environ, intra_env):
        return chunk_kda(q, k, v, g, beta, return_intermediate_states=states, **kw)


@case
def kda_fixed_sigmoid_kv():
    _kda_chunk(2, 130, 2, 2)


@case
def kda_intermediate_states():
    # return_intermediate_states on cula's kernels (KdaTuning.intermediate_states): the state/output kernel's storing
    # variant writing every chunk's start state beside o; GVA, a partial last chunk
    _kda_chunk(2, 130, 1, 2, states=True)


@case
def kda_intermediate_states_packed():
    # empty, one-token and partial chunks, the [V, K] layout, no initial state
    _kda_chunk(1, [70, 0, 65, 1], 1, 1, v_first=True, h0=False, states=True)


@case
def kda_fixed_log_gate_vk():
    _kda_chunk(2, 77, 2, 2, gate="none", v_first=True, h0=False)


@case
def kda_fixed_gva_fp16():
    _kda_chunk(1, 200, 1, 2, dtype=torch.float16, neg=True)


@case
def kda_fixed_fla_intra():
    _kda_chunk(2, 100, 2, 2, gate="fla")


@case
def kda_any_gate_fixed():
    # gates no bound is known of on cula's intra kernel (KdaTuning.intra_any_gate): tiles on the exact path (the
    # diagonal blocks element by element) beside tiles on the anchored one. Three cases, not one: each compiles its
    # own variants, and the sanitizer's warm run shares cases, not variants, over its processes
    from cula.kda.plan import KDA_TUNING

    with KDA_TUNING.override(intra_any_gate=True):
        _kda_chunk(2, 130, 2, 2, gate="steep")


@case
def kda_any_gate_packed():
    from cula.kda.plan import KDA_TUNING

    with KDA_TUNING.override(intra_any_gate=True):
        _kda_chunk(1, [1, 0, 63, 130, 17], 2, 2, gate="steep", v_first=True)


@case
def kda_any_gate_training():
    from cula.kda.plan import KDA_TUNING

    with KDA_TUNING.override(intra_any_gate=True):
        _kda_chunk(1, 100, 1, 2, gate="steep", grad=True)


@case
def kda_packed_issue_case():
    # the call racecheck first flagged: lengths [1, 0, 63, 130, 17], fused lower-bound gate, V-first states
    _kda_chunk(1, [1, 0, 63, 130, 17], 2, 2, v_first=True)


@case
def kda_packed_no_host_copy():
    _kda_chunk(1, [64, 5, 0, 129], 2, 2, cpu_copy=False, gate="none")


@case
def kda_packed_fla_intra():
    _kda_chunk(1, [33, 0, 100], 2, 2, gate="fla", v_first=True)


@case
def kda_segmented_b1():
    # B=1 and T >= KdaTuning.overlap_state_min_tokens: intra and state kernels of time segments on two streams
    _kda_chunk(1, 4096 + 65, 1, 1, h0=True)


@case
def kda_parallel_segments():
    # few heads, long sequences cut in time: the segment summary (E and R of every segment), the segment chain (the
    # true starts and the final states), then the state/output kernel from the starts (forced at a small length
    # here); with and without initial states, both layouts
    from cula.kda.plan import KDA_TUNING
    from cula.time_split import SplitThresholds

    with KDA_TUNING.override(time_split=SplitThresholds(1e9, 1e9, 128, 0)):
        _kda_chunk(1, [300, 0, 70], 1, 2, v_first=True)
        _kda_chunk(1, [70, 300], 1, 2, h0=False)


@case
def kda_parallel_segment_halves():
    # the same with the output pass over each segment's halves (KdaTuning.time_split_halves): the summary also
    # writing every first half's E and R (a one-chunk and an empty segment among them), the one-step chain to the
    # second halves' starts, written through strided views
    from cula.kda.plan import KDA_TUNING
    from cula.time_split import SplitThresholds

    with KDA_TUNING.override(time_split=SplitThresholds(1e9, 1e9, 128, 0), time_split_halves=True):
        _kda_chunk(1, [300, 0, 70], 1, 2, v_first=True)
        _kda_chunk(1, [70, 300], 1, 2, h0=False)


@case
def gdn_chunk_and_decode():
    # Gated DeltaNet on the KDA kernels: the chunk path (the intra kernel's per-head gate, fixed and packed) and the
    # decode path (states into step states)
    from cula.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from cula.gated_delta_rule.plan import GDN_TUNING

    q, k, v = _r(1, 100, 1, 128), _r(1, 100, 1, 128), _r(1, 100, 2, 128)
    g, beta = -torch.rand(1, 100, 2, device=DEV), torch.rand(1, 100, 2, device=DEV)
    h0 = torch.randn(1, 2, 128, 128, device=DEV) * 0.1
    on_cula = GDN_TUNING.override(inference_chunk_on_cula=True, inference_decode_max_tokens=8)
    cu = torch.tensor([0, 70, 70, 71, 100], dtype=torch.int32, device=DEV)  # empty, one-token, partial chunks
    with torch.inference_mode(), on_cula:
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                               use_qk_l2norm_in_kernel=True)  # fmt: skip
        # the intra kernel's per-head gate, packed, with the fused softplus gate
        chunk_gated_delta_rule(
            q, k, v, torch.randn(1, 100, 2, device=DEV), beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, A_log=torch.rand(2, device=DEV), dt_bias=torch.rand(2, device=DEV),
            cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(),
        )  # fmt: skip
        fused_recurrent_gated_delta_rule(
            _r(3, 1, 1, 128), _r(3, 1, 1, 128), _r(3, 1, 2, 128), g=-torch.rand(3, 1, 2, device=DEV),
            beta=torch.rand(3, 1, 2, device=DEV), initial_state=torch.randn(3, 2, 128, 128, device=DEV) * 0.1,
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        # the serving form with the fused gate (per-head A_log / dt_bias): MTP with step states on a [V, K] pool, one
        # token a step on a [K, V] pool (a padded slot in each)
        from cula.gated_delta_rule import gdn_decode, gdn_decode_step

        gate = dict(A_log=torch.rand(2, device=DEV), dt_bias=torch.rand(2, device=DEV))
        slots = torch.tensor([2, -1, 0], dtype=torch.int32, device=DEV)
        pool = torch.randn(4, 2, 128, 128, device=DEV) * 0.1
        gdn_decode(_r(3, 3, 1, 128), _r(3, 3, 1, 128), _r(3, 3, 2, 128), _r(3, 3, 2), _r(3, 3, 2), pool, slots,
                   step_states=torch.empty(3, 3, 2, 128, 128, device=DEV), **gate)  # fmt: skip
        step = gdn_decode_step(pool, slots, state_v_first=False, **gate)
        for _ in range(2):
            step(_r(3, 1, 1, 128), _r(3, 1, 1, 128), _r(3, 1, 2, 128), _r(3, 1, 2), _r(3, 1, 2))


@case
def gdn_row_factors():
    # Gated DeltaNet inference with the intra kernel's factor rows and the state/output kernel on the raw q / k
    # (GdnTuning.inference_row_factors): fixed with a partial last chunk and GVA (4 value heads a q / k head), packed
    # with empty, one-token and partial chunks and the fused softplus gate, without the L2 norm; each with v_new made
    # in the recurrence too (GdnTuning.inference_wy_in_recurrence)
    from cula.gated_delta_rule import chunk_gated_delta_rule
    from cula.gated_delta_rule.plan import GDN_TUNING

    cu = torch.tensor([0, 70, 70, 71, 100], dtype=torch.int32, device=DEV)
    # each form twice: through its plan (both kernels from one host call), and with a keyword the plan cache does not
    # take (chunk_size) through the general path's two launches
    for wy, general in itertools.product((False, True), ({}, {"chunk_size": 64})):
        with torch.inference_mode(), GDN_TUNING.override(inference_chunk_on_cula=True, inference_row_factors=True,
                                                         inference_wy_in_recurrence=wy):  # fmt: skip
            chunk_gated_delta_rule(
                _r(2, 100, 1, 128), _r(2, 100, 1, 128), _r(2, 100, 4, 128), -torch.rand(2, 100, 4, device=DEV),
                torch.rand(2, 100, 4, device=DEV), initial_state=torch.randn(2, 4, 128, 128, device=DEV) * 0.1,
                output_final_state=True, use_qk_l2norm_in_kernel=True, state_v_first=True, **general,
            )  # fmt: skip
            chunk_gated_delta_rule(
                _r(1, 100, 1, 128), _r(1, 100, 1, 128), _r(1, 100, 2, 128), torch.randn(1, 100, 2, device=DEV),
                torch.randn(1, 100, 2, device=DEV), output_final_state=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, A_log=torch.rand(2, device=DEV), dt_bias=torch.rand(2, device=DEV),
                cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(), **general,
            )  # fmt: skip
    # cut in time (every sequence past 128 tokens), with and without the halves: the summary's row-factor variants
    # (with v_new made in the recurrence too)
    from cula.kda.plan import KDA_TUNING
    from cula.time_split import SplitThresholds

    cu = torch.tensor([0, 300, 300, 301, 370], dtype=torch.int32, device=DEV)
    x = (_r(1, 370, 1, 128), _r(1, 370, 1, 128), _r(1, 370, 2, 128), -torch.rand(1, 370, 2, device=DEV),
         torch.rand(1, 370, 2, device=DEV))  # fmt: skip
    for halves, wy in itertools.product((False, True), (False, True)):
        with torch.inference_mode(), KDA_TUNING.override(time_split_halves=halves), \
                GDN_TUNING.override(inference_chunk_on_cula=True, inference_row_factors=True,
                                    inference_wy_in_recurrence=wy,
                                    time_split=SplitThresholds(1e9, 1e9, 128, 0)):  # (Gated DeltaNet's own cut)
            chunk_gated_delta_rule(*x, initial_state=torch.randn(4, 2, 128, 128, device=DEV) * 0.1,
                                   output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                   cu_seqlens_cpu=cu.cpu())  # fmt: skip


@case
def gdn_training_per_head_gate():
    # Gated DeltaNet training with the forward on the intra kernel's per-head gate writing Akk
    # (GdnTuning.training_per_head_gate), packed with empty and one-token sequences, the fused softplus gate
    from cula.gated_delta_rule import chunk_gated_delta_rule
    from cula.gated_delta_rule.plan import GDN_TUNING

    cu = torch.tensor([0, 70, 70, 71, 100], dtype=torch.int32, device=DEV)
    x = [_r(1, 100, 1, 128), _r(1, 100, 1, 128), _r(1, 100, 2, 128), torch.randn(1, 100, 2, device=DEV),
         torch.randn(1, 100, 2, device=DEV)]  # fmt: skip
    for t in x:
        t.requires_grad_(True)
    with GDN_TUNING.override(training_per_head_gate=True):
        o, ht = chunk_gated_delta_rule(
            *x, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, A_log=torch.rand(2, device=DEV), dt_bias=torch.rand(2, device=DEV),
            cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(),
        )  # fmt: skip
        (o.float().sum() + ht.sum()).backward()


@case
def kda_training_forward():
    # autograd on: the intra kernel's write_akk variant (FLA's Triton backward is not ours to check)
    _kda_chunk(1, [70, 0, 65], 1, 2, grad=True)


@case
def kda_training_disable_recompute():
    # the training forward keeping FLA's backward's intermediates: the intra kernel writing every g_cum row beside
    # Akk, the states kernel writing h and v_new (DeltaHFwdOStatesSm90); fixed and packed, both layouts
    _kda_chunk(2, 130, 1, 2, grad=True, keep=True)
    _kda_chunk(1, [70, 0, 65, 1], 1, 2, grad=True, v_first=True, keep=True)


@case
def kda_training_bwd_dv_dhu():
    # stages 4 and 5 in one launch of cula's kernel at every lane count (KdaTuning.bwd_dv_dhu_lanes): fixed and
    # packed, both layouts
    from cula.kda.plan import KDA_TUNING

    with KDA_TUNING.override(bwd_dv_dhu_lanes=(1, 1 << 30)):
        _kda_chunk(2, 130, 1, 2, grad=True, v_first=True)
        _kda_chunk(1, [70, 0, 65, 1], 1, 2, grad=True)


@case
def kda_training_bwd_intra():
    # autograd on with stage 7 of the backward on cula's kernel (KdaTuning.bwd_intra), fixed and packed (empty,
    # one-token and partial sub-chunks), GVA
    from cula.kda.plan import KDA_TUNING

    for cumsum in (False, True):  # stage 8 (dg's reverse cumsum) in FLA's kernel, then on chip
        with KDA_TUNING.override(bwd_intra=True, bwd_intra_cumsum=cumsum):
            _kda_chunk(2, 130, 1, 2, grad=True)
            _kda_chunk(1, [70, 0, 65, 1], 1, 2, grad=True, v_first=True)


@case
def kda_training_bwd_intra_fused():
    # stage 7 with stages 8, 9 (the gate's backward) and the L2 norm's backward on chip (KdaTuning.bwd_intra_gate,
    # bwd_intra_l2norm), the recompute prefix on the intra kernel (bwd_recompute_intra): fixed and packed without
    # GVA (both fused), packed with GVA (the gate alone)
    from cula.kda.plan import KDA_TUNING

    with KDA_TUNING.override(bwd_intra=True, bwd_intra_cumsum=True, bwd_intra_gate=True, bwd_intra_l2norm=True,
                             bwd_recompute_intra=True):  # fmt: skip
        _kda_chunk(2, 130, 2, 2, grad=True)
        _kda_chunk(1, [70, 0, 65, 1], 1, 1, grad=True, v_first=True)
        _kda_chunk(1, [70, 0, 65, 1], 1, 2, grad=True)


# The flags' training cases come one call each: under initcheck (which instruments FLA's and PyTorch's kernels too)
# one training call takes minutes, and a case is what the tools' processes share out.


def _training_with(tuning: dict, *args, **kwargs):
    """One ``_kda_chunk`` training call under a KDA tuning override."""
    from cula.kda.plan import KDA_TUNING

    with KDA_TUNING.override(**tuning):
        _kda_chunk(*args, grad=True, **kwargs)


# the softplus gate's backward in the stage-7 kernel (KdaTuning.bwd_intra_softplus_gate; its any_gate variant)
_SOFTPLUS = dict(bwd_intra_softplus_gate=True)
# no l2norm_fwd before the backward (KdaTuning.bwd_norm_on_load): the recompute's intra kernel writing the 1 / norms
# (write_rstd), stages 6 and 7 normalising the raw q / k as they read them (raw_qk), with the H200 entry's others
_NORM_ON_LOAD = dict(bwd_norm_on_load=True)
# the recompute prefix's h and v_new on cula's states kernel (KdaTuning.bwd_recompute_states)
_RECOMPUTE_STATES = dict(bwd_recompute_states=True)


@case
def kda_training_softplus_gate():
    _training_with(_SOFTPLUS, 2, 130, 2, 2, gate="softplus")


@case
def kda_training_softplus_gate_packed():
    # empty, one-token and partial chunks, GVA
    _training_with(_SOFTPLUS, 1, [70, 0, 65, 1], 1, 2, v_first=True, gate="softplus")


@case
def kda_training_norm_on_load():
    _training_with(_NORM_ON_LOAD, 2, 130, 2, 2)


@case
def kda_training_norm_on_load_packed():
    # empty, one-token and partial chunks, the [V, K] layout
    _training_with(_NORM_ON_LOAD, 1, [70, 0, 65, 1], 1, 1, v_first=True)


@case
def kda_training_recompute_states():
    _training_with(_RECOMPUTE_STATES, 2, 130, 1, 2)  # GVA


@case
def kda_training_recompute_states_packed():
    # empty, one-token and partial chunks, the [V, K] layout
    _training_with(_RECOMPUTE_STATES, 1, [70, 0, 65, 1], 1, 1, v_first=True)


@case
def kda_training_recompute_states_graph():
    # FLA's graph mode: its static chunk list and offsets
    _training_with(_RECOMPUTE_STATES, 1, [70, 0, 65, 1, 0], 1, 1, graph=True)


@case
def kda_training_recompute_states_copied():
    # kda_training_recompute_states with h and v_new copied by PyTorch (ordinary stores) before stage 6 reads them:
    # the states kernel writes them by TMA tensor stores, and initcheck reports stage 6's bulk reads of those bytes
    # (the states kernel's test finds every element written). Clean here and not there = initcheck not counting TMA
    # stores as writes; the same finding here = stage 6 reads bytes no kernel writes.
    import cula.ops.kda.sm90.delta_h_states as states

    original = states.chunk_kda_fwd_h_sm90

    def copied(*args, **kwargs):
        h, v_new, ht = original(*args, **kwargs)
        return h.clone(), v_new.clone(), ht

    states.chunk_kda_fwd_h_sm90 = copied
    try:
        _training_with(_RECOMPUTE_STATES, 2, 130, 1, 2)
    finally:
        states.chunk_kda_fwd_h_sm90 = original


def _states_then_stage6(copied: bool):
    """The states kernel (``DeltaHStatesSm90``: h and v_new by TMA tensor stores) and stage 6's kernel on its h and
    v_new (read by bulk row copies), nothing of FLA's or of a training step between: initcheck's view of those bytes
    in seconds, where kda_training_recompute_states_copied (a whole step, FLA's kernels instrumented too) has never
    finished in a device call. ``copied``: h and v_new copied by PyTorch first (ordinary stores)."""
    from cula.ops.kda.sm90.bwd_wy_dqkg import chunk_kda_bwd_wy_dqkg_sm90
    from cula.ops.kda.sm90.delta_h_states import chunk_kda_fwd_h_sm90

    from cula.testing import chunk_local_gate

    B, T, HV = 1, 130, 2  # a partial last chunk
    g = chunk_local_gate(B, T, HV, 128, device=DEV)
    k, w, u = (_r(B, T, HV, 128, scale=0.1) for _ in range(3))
    h, v_new, _ = chunk_kda_fwd_h_sm90(k, w, u, g)
    if copied:
        h, v_new = h.clone(), v_new.clone()
    chunk_kda_bwd_wy_dqkg_sm90(
        _r(B, T, HV, 128), k, _r(B, T, HV, 128), v_new, g, torch.rand(B, T, HV, device=DEV),
        _r(B, T, HV, 64, scale=0.1), h, _r(B, T, HV, 128), _r(*h.shape, scale=0.1), _r(B, T, HV, 128),
    )  # fmt: skip


@case
def kda_states_then_stage6():
    _states_then_stage6(copied=False)


@case
def kda_states_then_stage6_copied():
    _states_then_stage6(copied=True)


@case
def kda_training_graph_mode():
    # a packed training step in FLA's graph mode: the backward's kernels (the recompute on the intra kernel, stages 6
    # and 7) walk FLA's fixed-size chunk list, its sentinel rows as padding rows; without and with GVA
    _kda_chunk(1, [70, 0, 65, 1, 0], 1, 1, grad=True, graph=True)
    _kda_chunk(1, [70, 0, 65, 1, 0], 1, 2, grad=True, v_first=True, graph=True)


@case
def kda_training_bwd_wy_dqkg():
    # autograd on with stage 6 of the backward on cula's kernel (KdaTuning.bwd_wy_dqkg), fixed and packed (empty,
    # one-token and partial chunks), GVA, both state layouts
    from cula.kda.plan import KDA_TUNING

    with KDA_TUNING.override(bwd_wy_dqkg=True):
        _kda_chunk(2, 130, 1, 2, grad=True)
        _kda_chunk(1, [70, 0, 65, 1], 1, 2, grad=True, v_first=True)


@case
def kda_bwd_wy_dqkg_many_items():
    # the stage-6 kernel alone with more (chunk, value head) items than SMs, so that each persistent CTA walks
    # several and loads the next item's tiles while it computes the current one: fixed, and packed with a chunk
    # list ending in padding rows (as a list built on the device does), both state layouts
    from cula.ops.kda.sm90.bwd_wy_dqkg import chunk_kda_bwd_wy_dqkg_sm90
    from cula.ops.kda.sm90.intra import prepare_chunk_indices_i32

    for svf, lens in ((True, None), (False, [1, 4000, 63, 0, 4306, 130])):
        T = 9000 if lens is None else sum(lens)
        B, HV = 1, 4
        kw = {}
        if lens is None:
            NT = -(-T // 64)
        else:
            cu = _cu(lens)
            ci = prepare_chunk_indices_i32(cu)
            ci = torch.cat([ci, torch.tensor([[len(lens) - 1, 1000]] * 8, dtype=torch.int32, device=DEV)])
            NT, kw = ci.shape[0], dict(cu_seqlens=cu, chunk_indices=ci)
        x = {n: _r(B, T, HV, 128) for n in ("q", "k", "v", "v_new", "do", "dv")}
        g = -0.05 * torch.rand(B, T, HV, 128, device=DEV).cumsum(1).remainder(3.0)
        chunk_kda_bwd_wy_dqkg_sm90(
            **x, g=g, beta=torch.rand(B, T, HV, device=DEV), A=_r(B, T, HV, 64, scale=0.1),
            h=_r(B, NT, HV, 128, 128, scale=0.1), dh=_r(B, NT, HV, 128, 128, scale=0.1), state_v_first=svf, **kw,
        )  # fmt: skip


def _kda_decode_call(N, T, H, HV, D=128, *, v_first=True, steps=False, gate="lower_bound", dtype=torch.bfloat16,
                     pool_rows=None, g_dtype=torch.float32, beta_dtype=torch.float32):  # fmt: skip
    from cula.kda import kda_decode

    P = pool_rows or N + 2
    q, k = _r(N, T, H, D, dtype=dtype), _r(N, T, H, D, dtype=dtype)
    v = _r(N, T, HV, D, dtype=dtype)
    g, beta = _r(N, T, HV, D, dtype=g_dtype), _r(N, T, HV, dtype=beta_dtype)
    pool = torch.randn(P, HV, D, D, device=DEV) * 0.1
    idx = torch.arange(N, dtype=torch.int32, device=DEV).flip(0)
    if N > 1:
        idx[1] = -1  # a padded slot
    kw = dict(state_v_first=v_first)
    if gate == "lower_bound":
        kw.update(lower_bound=-5.0, A_log=torch.randn(HV, device=DEV) * 0.1)
    elif gate == "softplus":
        kw.update(lower_bound=None, A_log=torch.randn(HV, device=DEV) * 0.1,
                  dt_bias=torch.randn(HV * D, device=DEV) * 0.1)  # fmt: skip
    else:
        kw.update(use_gate_in_kernel=False)
        g = -torch.rand(N, T, HV, D, device=DEV).to(g_dtype)
    if steps:
        kw["step_states"] = torch.empty(N, T, HV, D, D, device=DEV)
    return kda_decode(q, k, v, g, beta, pool, idx, **kw)


@case
def kda_decode_t1_vk():
    _kda_decode_call(4, 1, 2, 4)


@case
def kda_decode_t1_kv_tma():
    _kda_decode_call(4, 1, 2, 4, v_first=False, gate="softplus")


@case
def kda_decode_t1_kv_cols():
    # from kv_cols_min_states (N x HV) states the [K, V] pool runs by column from shared memory
    from cula.kda.plan import KDA_TUNING

    _kda_decode_call(KDA_TUNING.get((9, 0)).kv_cols_min_states // 16, 1, 16, 16, v_first=False)


@case
def kda_decode_mtp_kv_cols():
    _kda_decode_call(3, 3, 1, 2, v_first=False, beta_dtype=torch.bfloat16)


@case
def kda_decode_mtp_vk():
    _kda_decode_call(3, 3, 1, 2, gate="none", g_dtype=torch.bfloat16)


@case
def kda_decode_mtp_steps_vk():
    _kda_decode_call(3, 4, 2, 2, steps=True)


@case
def kda_decode_mtp_steps_kv_wide():
    _kda_decode_call(3, 4, 2, 2, steps=True, v_first=False)


@case
def kda_decode_mtp_vk_wide():
    # the wide lane tile on [V, K] pools (KdaTuning.wide_vk_min_tokens), with and without step states
    from cula.kda.plan import KDA_TUNING

    from cula.gated_delta_rule import gdn_decode

    with KDA_TUNING.override(wide_vk_min_tokens=2):
        _kda_decode_call(3, 3, 1, 2, gate="softplus", beta_dtype=torch.bfloat16)
        _kda_decode_call(3, 4, 2, 2, steps=True)
        # Gated DeltaNet's MTP verify: one gate per token and head, bf16 gate and beta, a padded slot
        pool = torch.randn(5, 2, 128, 128, device=DEV) * 0.1
        slots = torch.tensor([4, -1, 0], dtype=torch.int32, device=DEV)
        gdn_decode(_r(3, 4, 1, 128), _r(3, 4, 1, 128), _r(3, 4, 2, 128), _r(3, 4, 2), _r(3, 4, 2), pool, slots,
                   A_log=torch.randn(2, device=DEV) * 0.1, dt_bias=torch.randn(2, device=DEV) * 0.1)  # fmt: skip


@case
def kda_decode_t8_kv_wide():
    _kda_decode_call(2, 8, 1, 2, v_first=False, dtype=torch.float16)


@case
def kda_decode_d64():
    _kda_decode_call(3, 1, 2, 2, D=64)
    _kda_decode_call(3, 2, 2, 2, D=64, v_first=False)


@case
def kda_decode_step_and_serving():
    from cula.kda import fused_recurrent_kda_fwd, kda_commit_accepted, kda_decode_step

    N, HV = 3, 2
    pool = torch.randn(N + 1, HV, 128, 128, device=DEV) * 0.1
    idx = torch.tensor([2, -1, 0], dtype=torch.int32, device=DEV)
    step = kda_decode_step(pool, idx, lower_bound=-5.0)
    for _ in range(2):
        step(_r(N, 1, 1, 128), _r(N, 1, 1, 128), _r(N, 1, HV, 128), _r(N, 1, HV, 128, dtype=torch.float32),
             _r(N, 1, HV, dtype=torch.float32))  # fmt: skip
    fused_recurrent_kda_fwd(
        _r(N, 1, 1, 128), _r(N, 1, 1, 128), _r(N, 1, HV, 128), _r(N, 1, HV, 128, dtype=torch.float32),
        _r(N, 1, HV, dtype=torch.float32), initial_state=pool, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0,
    )  # fmt: skip
    steps = torch.randn(N, 3, HV, 128, 128, device=DEV)
    kda_commit_accepted(steps, pool, idx, torch.tensor([1, 2, 3], dtype=torch.int32, device=DEV))


def _lightning_prefill(B, lens, H, D, *, h0=True, v_first=False):
    from cula.lightning import lightning_attn_fwd

    packed = isinstance(lens, (list, tuple))
    T = sum(lens) if packed else lens
    N = len(lens) if packed else B
    kw = dict(output_final_state=True, state_v_first=v_first)
    if h0:
        kw["initial_state"] = torch.randn(N, H, D, D, device=DEV) * 0.1
    if packed:
        kw["cu_seqlens"] = _cu(lens)
        kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu()
    decay = torch.linspace(0.01, 1.0, H, device=DEV)
    return lightning_attn_fwd(_r(B, T, H, D), _r(B, T, H, D), _r(B, T, H, D), decay, **kw)


@case
def lightning_prefill_fixed():
    _lightning_prefill(2, 130, 2, 128)
    _lightning_prefill(1, 65, 2, 64, h0=False, v_first=True)


@case
def lightning_prefill_packed():
    _lightning_prefill(1, [1, 0, 63, 130, 17], 2, 128, v_first=True)


@case
def lightning_time_split():
    # one long sequence cut in time (forced at a small length): the states-only first pass over the segments, then
    # the full kernel from the true starts; packed with an initial state and [V, K] states, fixed without
    from cula.lightning.plan import LIGHTNING_TUNING
    from cula.time_split import SplitThresholds

    with LIGHTNING_TUNING.override(time_split=SplitThresholds(1e9, 1e9, 64, 0)):
        _lightning_prefill(1, [300, 0, 70], 2, 128, v_first=True)
        _lightning_prefill(1, 300, 2, 64, h0=False)


@case
def lightning_time_split_captured():
    # lightning_time_split's pack captured in a CUDA graph and replayed on other boundaries: the segment tables made
    # on the device from the cu_seqlens buffer (spare segments start from zeros) and the scan reading them
    from cula.lightning import lightning_attn_fwd
    from cula.lightning.plan import LIGHTNING_TUNING
    from cula.time_split import SplitThresholds

    cu = _cu([300, 0, 70])
    q, k, v = (_r(1, 370, 2, 128) for _ in range(3))
    kw = dict(initial_state=torch.randn(3, 2, 128, 128, device=DEV) * 0.1, output_final_state=True,
              cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(), state_v_first=True)  # fmt: skip
    decay = torch.linspace(0.01, 1.0, 2, device=DEV)
    with torch.inference_mode(), LIGHTNING_TUNING.override(time_split=SplitThresholds(1e9, 1e9, 64, 0)):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            lightning_attn_fwd(q, k, v, decay, **kw)  # compiles and plans outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                lightning_attn_fwd(q, k, v, decay, **kw)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        cu.copy_(_cu([70, 0, 300]))
        graph.replay()
        torch.cuda.synchronize()


@case
def simple_gla_g_gamma():
    from cula.simple_gla import chunk_simple_gla

    B, T, H = 1, 100, 2
    chunk_simple_gla(_r(B, T, H, 128), _r(B, T, H, 128), _r(B, T, H, 128),
                     g_gamma=-torch.linspace(0.01, 1.0, H, device=DEV), output_final_state=True)  # fmt: skip


def _lightning_decode_call(N, T, H, D=128, *, v_first=True):
    from cula.lightning import lightning_decode

    pool = torch.randn(N + 1, H, D, D, device=DEV) * 0.1
    idx = torch.arange(N, dtype=torch.int32, device=DEV)
    if N > 1:
        idx[0] = -1
    decay = torch.linspace(0.01, 1.0, H, device=DEV)
    return lightning_decode(_r(N, T, H, D), _r(N, T, H, D), _r(N, T, H, D), decay, pool, idx, state_v_first=v_first)


@case
def lightning_decode_t1():
    _lightning_decode_call(3, 1, 2)
    _lightning_decode_call(3, 1, 2, v_first=False)


@case
def lightning_decode_kv_cols():
    from cula.lightning.plan import LIGHTNING_TUNING

    _lightning_decode_call(LIGHTNING_TUNING.get((9, 0)).kv_cols_min_states // 32, 1, 32, v_first=False)


@case
def lightning_decode_multi_token():
    from cula.lightning import lightning_decode_step

    _lightning_decode_call(3, 3, 2)
    _lightning_decode_call(2, 2, 2, D=64, v_first=False)
    pool = torch.randn(2, 2, 128, 128, device=DEV) * 0.1
    step = lightning_decode_step(torch.tensor([0.1, 0.5], device=DEV), pool, torch.tensor([1], dtype=torch.int32,
                                 device=DEV))  # fmt: skip
    step(_r(1, 1, 2, 128), _r(1, 1, 2, 128), _r(1, 1, 2, 128))


def _fla_untuned():
    """Tests' one-config FLA autotuning (tests/conftest.py): the training case's backward would otherwise time
    every config of FLA's kernels under the sanitizer."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "conftest.py")
    spec = importlib.util.spec_from_file_location("_cula_test_conftest", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod._fla_untuned()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", help="run the cases whose name contains one of these")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--group", default="1/1", help="I/N: every N-th case starting at the I-th")
    a = ap.parse_args()
    names = [n for n in CASES if not a.names or any(s in n for s in a.names)]
    i, n = (int(x) for x in a.group.split("/"))
    names = names[i - 1 :: n]
    if a.list:
        print("\n".join(names))
        return 0
    _fla_untuned()
    import cula.cache

    torch.manual_seed(0)
    failed = []
    for name in names:
        print(f"@@case {name}", flush=True)
        t0 = time.time()
        try:
            CASES[name]()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported, and the run's exit code says so
            failed.append(name)
            print(f"@@failed {name}: {type(e).__name__}: {e}", flush=True)
        print(f"@@done {name} {time.time() - t0:.1f}s", flush=True)
    variants = sorted(repr(k) for k in cula.cache._CACHE)
    print("@@variants " + json.dumps(variants), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
