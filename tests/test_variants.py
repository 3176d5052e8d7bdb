"""The variant list (``cula.variants``) against what the public entry points actually ask for, on the CPU.

Every call below runs on the cula-sm90 backends (``pretend_sm90``) with ``cula.cache.recording`` on: each compiled
kernel a launcher asks for is recorded and stands in as a no-op, so nothing is compiled or launched; each launch's
arguments are then checked against its variant's compiled signature (``cula.testing.check_launch``). Whatever the
planners request, through any path (the plan of a repeated call, the general path, training, packed sequences, the
time-segmented launch, decode at T = 1 and multi-token, GVA), must be in ``planner_variants("full")``; the wheel
scope must be part of the full one; and every variant listed (chunk, decode, Lightning) must be reachable.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import cula.cache
from cula import variants

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(scope="module")
def full_list():
    return set(variants.planner_variants("full"))


@pytest.fixture
def requested(monkeypatch, pretend_sm90):
    """Record every variant asked for; FLA's intra stage (Triton) and CUDA streams stubbed on the CPU."""
    import cula.backends
    import cula.kda.forward as cf

    def fla_intra(q, k, v, g, beta, *args, **kwargs):
        B, T, _, K = q.shape
        HV = v.shape[2]
        w = torch.zeros(B, T, HV, K, dtype=q.dtype)
        return w, w.clone(), w.clone(), w.clone(), torch.zeros(B, T, HV, 64, dtype=q.dtype), w.float(), None

    class Stream:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, other):
            pass

        def wait_event(self, ev):
            pass

    class Event:
        def record(self, stream):
            pass

    import contextlib

    monkeypatch.setattr(cf, "_intra_fla", fla_intra)
    monkeypatch.setattr(cf, "_side_streams", {})
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cula.backends.clear_plan_caches()
    with cula.cache.recording(_check_launch) as seen:
        yield seen
    cula.backends.clear_plan_caches()


_FAKES: dict = {}


def _check_launch(key: tuple, args: tuple) -> None:
    """A launch against its variant's compiled signature (``cula.testing.check_launch``), so a host's arguments
    that TVM-FFI would refuse on the GPU (a stand-in of the wrong shape, a symbol bound to two sizes) fail on the
    CPU."""
    from cula.testing import check_launch, fake_arguments

    fake = _FAKES.get(key)
    if fake is None:
        fake = _FAKES[key] = fake_arguments(cula.cache.recorded_build(key))
    check_launch(fake, args, cula.cache.key_text(key))


def _rnd(*shape, dtype=BF16, requires_grad=False):
    return (0.1 * torch.randn(*shape)).to(dtype).requires_grad_(requires_grad)


def _sampled(grid, every: int):
    """Every ``every``-th combination of ``grid`` (a deterministic spread over all axes), and the first and last."""
    combos = list(itertools.product(*grid))
    return combos[::every] + [combos[-1]]


def _chunk_calls():
    from cula.kda import chunk_kda

    grid = (
        (BF16, FP16), (FP32, BF16, FP16), (BF16, FP16, FP32),  # q/k/v, g, beta
        ("plain", "safe_logspace", "safe_sigmoid", "softplus"),  # gate form
        (False, True), ((False, False), (True, False), (True, True)),  # l2norm, (beta sigmoid, neg eigval)
        (False, True), (False, True), (False, True),  # initial state, final state, state_v_first
        ("fixed", "packed", "segmented", "training"),
    )
    for io, g_dt, b_dt, gate, l2, (sig, neg), h0, ht, svf, form in _sampled(grid, 23):
        H, HV, K = 1, 2, 128  # GVA
        B, T = (1, 130) if form in ("packed", "segmented") else (2, 70)
        train = form == "training"
        x = dict(q=_rnd(B, T, H, K, dtype=io, requires_grad=train), k=_rnd(B, T, H, K, dtype=io),
                 v=_rnd(B, T, HV, K, dtype=io), g=-_rnd(B, T, HV, K, dtype=g_dt).abs(),
                 beta=_rnd(B, T, HV, dtype=b_dt))  # fmt: skip
        kw = dict(use_qk_l2norm_in_kernel=l2, use_beta_sigmoid_in_kernel=sig, allow_neg_eigval=neg,
                  output_final_state=ht, state_v_first=svf)  # fmt: skip
        if gate.startswith("safe"):
            kw["safe_gate"] = True
        if gate in ("safe_sigmoid", "softplus"):
            kw.update(use_gate_in_kernel=True, A_log=_rnd(HV, dtype=FP32), dt_bias=_rnd(HV * K, dtype=FP32))
            if gate == "safe_sigmoid":
                kw["lower_bound"] = -5.0
        N = B
        if form == "packed":
            kw["cu_seqlens"] = torch.tensor([0, 50, 130], dtype=torch.int32)
            kw["cu_seqlens_cpu"] = kw["cu_seqlens"]
            N = 2
        if h0:
            kw["initial_state"] = _rnd(N, HV, K, K, dtype=FP32)
        yield form, x, kw, chunk_kda


def test_chunk_kda_requests_are_listed(requested, full_list):
    from cula.kda.plan import KDA_TUNING

    calls = 0
    for form, x, kw, chunk_kda in _chunk_calls():
        with KDA_TUNING.override(overlap_state_min_tokens=64 if form == "segmented" else None):
            for _ in range(2):  # the second call of a signature takes its plan (the fused launch)
                with torch.no_grad() if form != "training" else torch.enable_grad():
                    chunk_kda(**x, **kw)
        calls += 1
    families = {k[0] for k in requested}
    assert families == {"kda.intra", "kda.delta_h_fwd_o", "kda.fwd_launch"}, families
    missing = [cula.cache.key_text(k) for k in requested if k not in full_list]
    assert not missing, f"{len(missing)} of {len(requested)} requested variants are not listed: {missing[:3]}"
    assert calls > 100


@pytest.mark.parametrize("wy", [False, True], ids=["w-u", "wy-in-recurrence"])
def test_gdn_inference_requests_are_listed(requested, gdn_tuning, wy):
    """With the GPU's entry running Gated DeltaNet inference on cula (``GdnTuning.inference_chunk_on_cula``, with
    the factor rows: ``inference_row_factors``, and ``wy``: ``inference_wy_in_recurrence``) and training's forward on
    the per-head gate (``training_per_head_gate``), its per-head-gate intra kernels and the state/output kernel's
    row-factor variants are listed, and only then."""
    from cula.gated_delta_rule import chunk_gated_delta_rule

    gdn_tuning(inference_chunk_on_cula=False)
    assert not [k for k in variants.planner_variants("full", ops=("gdn.chunk",))]
    gdn_tuning(inference_chunk_on_cula=True, training_per_head_gate=True, inference_row_factors=True,
               inference_wy_in_recurrence=wy)
    listed = set(variants.planner_variants("full", ops=("gdn.chunk",)))
    grid = ((BF16, FP16), (FP32, BF16), (BF16, FP32), (False, True), (False, True), ("fixed", "packed"),
            ("inference", "training"))  # fmt: skip
    # (the sample, fp16 inference with the L2 norm, which must not take the factor rows, and bf16 inference, fixed
    # and packed)
    for io, g_dt, b_dt, fused, l2, form, mode in [*_sampled(grid, 3), (FP16, FP32, BF16, True, True, "fixed",
                                                                       "inference"),
                                                  (BF16, BF16, BF16, True, True, "fixed", "inference"),
                                                  (BF16, FP32, FP32, False, True, "packed", "inference")]:  # fmt: skip
        B, T, H, HV, K = (1, 130, 1, 2, 128) if form == "packed" else (2, 70, 1, 2, 128)
        x = dict(q=_rnd(B, T, H, K, dtype=io), k=_rnd(B, T, H, K, dtype=io), v=_rnd(B, T, HV, K, dtype=io),
                 g=-_rnd(B, T, HV, dtype=g_dt).abs(), beta=_rnd(B, T, HV, dtype=b_dt))  # fmt: skip
        kw = dict(use_qk_l2norm_in_kernel=l2, use_beta_sigmoid_in_kernel=fused, output_final_state=True)
        if fused:
            kw.update(use_gate_in_kernel=True, A_log=_rnd(HV, dtype=FP32), dt_bias=_rnd(HV, dtype=FP32))
        if form == "packed":
            kw["cu_seqlens"] = torch.tensor([0, 50, 130], dtype=torch.int32)
            kw["cu_seqlens_cpu"] = kw["cu_seqlens"]
        if mode == "training":  # the forward only (training_per_head_gate: the per-head gate, writing Akk)
            x["q"].requires_grad_()
        # (a repeated inference call takes its plan: both kernels in one launch)
        for _ in range(2 if mode == "inference" else 1):
            with torch.no_grad() if mode == "inference" else torch.enable_grad():
                chunk_gated_delta_rule(**x, **kw)
    # the training backward's recompute on the per-head gate (T read, every g_cum row)
    from cula.kda.forward import _intra_cute

    for g_dt, fused, l2, cu in itertools.product((FP32, BF16), (False, True), (False, True),
                                                 (None, torch.tensor([0, 30, 70], dtype=torch.int32))):  # fmt: skip
        x, xv = _rnd(1, 70, 1, 128), _rnd(1, 70, 2, 128)
        ci = None if cu is None else torch.tensor([[0, 0], [1, 0]], dtype=torch.int32)
        _intra_cute(x, x, xv, -_rnd(1, 70, 2, dtype=g_dt).abs(), _rnd(1, 70, 2, dtype=FP32), 0.1, cu, ci, fused,
                    _rnd(2, dtype=FP32), _rnd(2, dtype=FP32), None, l2, True, False, full_g_cum=True,
                    given_akk=_rnd(1, 70, 2, 64))  # fmt: skip
    intra = [k for k in requested if k[0] == "kda.intra"]
    assert intra and all(("scalar_gate", True) in k for k in intra)
    assert any(("write_akk", True) in k for k in intra)
    # inference with the factor rows: both kernels from one host call (a repeated call's plan, and the first call of
    # a signature, which makes the plan), both in their row_factors variants
    launched = [k for k in requested if k[0] == "kda.fwd_launch"]
    assert launched and all(("row_factors", True) in k[2] and ("row_factors", True) in k[3] for k in launched)
    assert all((("wy_in_recurrence", True) in k[2]) == (("wy_in_recurrence", True) in k[3]) == wy for k in launched)
    assert {k[1] for k in launched} == {"ChunkKDAFwdSm90", "ChunkKDAVarlenFwdSm90"}
    # fp16 with the L2 norm keeps qg / kg (its factor rows would carry the 1 / norm past fp16's range)
    assert not [k for k in intra if ("row_factors", True) in k and k[2] == "Float16" and ("l2norm_qk", True) in k]
    assert not [k for k in launched if ("dtype", "Float16") in k[2] and ("l2norm_qk", True) in k[2]]
    missing = [cula.cache.key_text(k) for k in intra + launched if k not in listed]
    assert not missing, missing[:3]


def test_training_stage_requests_are_listed(requested, kda_tuning):
    """The backward stages' hosts (stages 4 and 5, 6, 7 on cula's kernels) ask only for listed variants, over the
    dtypes, layouts and forms the training path hands them; a stage whose tuning flag is off lists nothing."""
    from cula.ops.kda.sm90.bwd_dhu import chunk_kda_bwd_dv_dhu_sm90
    from cula.ops.kda.sm90.bwd_intra import chunk_kda_bwd_intra_sm90
    from cula.ops.kda.sm90.bwd_wy_dqkg import chunk_kda_bwd_wy_dqkg_sm90

    kda_tuning(bwd_dv_dhu_lanes=None, bwd_wy_dqkg=False, bwd_intra=False, bwd_recompute_intra=False)
    assert not variants.planner_variants("full", ops=("kda.training",))
    kda_tuning(bwd_dv_dhu_lanes=(1, 1 << 30), bwd_wy_dqkg=True, bwd_intra=True, bwd_intra_cumsum=True,
               bwd_intra_gate=True, bwd_intra_l2norm=True, bwd_recompute_intra=True, bwd_norm_on_load=True,
               bwd_recompute_states=True, bwd_intra_softplus_gate=True)  # fmt: skip
    listed = set(variants.planner_variants("full", ops=("kda.training",)))
    from cula.ops.kda.sm90.delta_h_states import chunk_kda_fwd_h_sm90

    H, HV, D = 1, 2, 128
    for io, b_dt, svf, packed in itertools.product((BF16, FP16), (FP32, BF16, FP16), (False, True), (False, True)):
        B, T = (1, 130) if packed else (2, 70)
        cu = torch.tensor([0, 50, 130], dtype=torch.int32) if packed else None
        NT = 3 if packed else 2
        x, xv, f = _rnd(B, T, H, D, dtype=io), _rnd(B, T, HV, D, dtype=io), _rnd(B, T, HV, D, dtype=FP32)
        beta, a = _rnd(B, T, HV, dtype=b_dt), _rnd(B, T, HV, 64, dtype=FP32)
        s = _rnd(B, NT, HV, D, D, dtype=io)
        chunk_kda_bwd_intra_sm90(x, x, f, beta, a, a, f, f, _rnd(B, T, HV, dtype=FP32), f, cu_seqlens=cu,
                                 reverse_cumsum_dg=True)  # fmt: skip
        # stage 7 with the gate's backward (GVA here) and, with one value head a q/k head, the L2 norm's
        for g_dt, has_a, has_b, lb in itertools.product((FP32, BF16, FP16), (False, True), (False, True),
                                                        (-5.0, None)):  # fmt: skip  (None: the softplus gate)
            gate = (_rnd(B, T, HV, D, dtype=g_dt), _rnd(HV, dtype=FP32) if has_a else None,
                    _rnd(HV * D, dtype=FP32) if has_b else None, lb)  # fmt: skip
            chunk_kda_bwd_intra_sm90(x, x, f, beta, a, a, f, f, _rnd(B, T, HV, dtype=FP32), f, cu_seqlens=cu,
                                     reverse_cumsum_dg=True, gate=gate, any_gate=lb is None)  # fmt: skip
            f1, a1, beta1 = f[:, :, :1].contiguous(), a[:, :, :1].contiguous(), beta[:, :, :1].contiguous()
            rstd = (_rnd(B * T, dtype=FP32), _rnd(B * T, dtype=FP32))
            gate1 = (gate[0][:, :, :1].contiguous(), None if gate[1] is None else gate[1][:1],
                     None if gate[2] is None else gate[2][:D], -5.0)  # fmt: skip
            for g1, raw in itertools.product((None, gate1), (False, True)):  # raw: q / k normalised as they load
                chunk_kda_bwd_intra_sm90(x, x, f1, beta1, a1, a1, f1, f1, _rnd(B, T, 1, dtype=FP32), f1,
                                         cu_seqlens=cu, reverse_cumsum_dg=True, qk_rstd=rstd, gate=g1,
                                         raw_qk=raw, any_gate=lb is None)  # fmt: skip
        for rstd in (None, (_rnd(B * T * H, dtype=FP32), _rnd(B * T * H, dtype=FP32))):
            chunk_kda_bwd_wy_dqkg_sm90(x, x, xv, xv, f, beta, a.to(io), s, xv, s, xv, state_v_first=svf,
                                       cu_seqlens=cu, qk_rstd=rstd)  # fmt: skip
        # the recompute's h and v_new (no final state), with and without an initial state
        for h0 in (None, _rnd(B if cu is None else 2, HV, D, D, dtype=FP32)):
            chunk_kda_fwd_h_sm90(xv, xv, xv, f, initial_state=h0, state_v_first=svf, cu_seqlens=cu)
        chunk_kda_bwd_dv_dhu_sm90(xv, xv, xv, xv, a.to(io), xv, f, dht=None, state_v_first=svf, cu_seqlens=cu,
                                  h0=_rnd(B if cu is None else 2, HV, D, D, dtype=FP32))  # fmt: skip
    # the recompute prefix on cula's intra kernel: every row of g_cum, T read from the forward's Akk, over the gates
    # and flags it takes
    from cula.kda.forward import _intra_cute

    x, xv, beta = _rnd(1, 70, H, D, dtype=BF16), _rnd(1, 70, HV, D, dtype=BF16), _rnd(1, 70, HV, dtype=FP32)
    for g_dt, (fused, lb), l2, (sig, neg), cu in itertools.product(
        (FP32, BF16), ((False, None), (True, -5.0)), (False, True), ((False, False), (True, True)),
        (None, torch.tensor([0, 30, 70], dtype=torch.int32)),
    ):  # fmt: skip
        ci = None if cu is None else torch.tensor([[0, 0], [1, 0]], dtype=torch.int32)
        # with the L2 norm, also writing the 1 / norms (bwd_norm_on_load)
        for rstd in (None, torch.empty(2, 1, 70, H)) if l2 else (None,):
            _intra_cute(x, x, xv, _rnd(1, 70, HV, D, dtype=g_dt), beta, 0.1, cu, ci, fused, _rnd(HV, dtype=FP32),
                        _rnd(HV * D, dtype=FP32), lb, l2, sig, neg, full_g_cum=True,
                        given_akk=_rnd(1, 70, HV, 64, dtype=BF16), qk_rstd=rstd)  # fmt: skip
    families = {k[0] for k in requested}
    assert families == {"kda.bwd_dhu", "kda.bwd_wy_dqkg", "kda.bwd_intra", "kda.intra", "kda.delta_h_states"}, (
        families)
    missing = [cula.cache.key_text(k) for k in requested if k not in listed]
    assert not missing, missing[:3]


def test_any_gate_lists_only_variants_the_kernel_builds(requested, kda_tuning):
    """With ``KdaTuning.intra_any_gate`` on, the intra kernel's any_gate option stays off where the kernel makes no
    per-channel scores (the recompute's given_t, Gated DeltaNet's scalar gate; the kernel refuses both), so every
    listed variant can be built; and the recompute of a gate with no known bound (the softplus gate without
    safe_gate, a log gate) asks for listed variants."""
    from cula.kda.forward import _intra_cute

    kda_tuning(intra_any_gate=True, bwd_recompute_intra=True)
    listed = set(variants.planner_variants("full", ops=("kda.chunk", "kda.training", "gdn.chunk")))
    for key in listed:
        options = dict(key[8:]) if key[0] == "kda.intra" else {}
        assert not (options.get("any_gate") and (options.get("given_t") or options.get("scalar_gate"))), key
    H, HV, D = 1, 2, 128
    x, xv, beta = _rnd(1, 70, H, D, dtype=BF16), _rnd(1, 70, HV, D, dtype=BF16), _rnd(1, 70, HV, dtype=FP32)
    for fused, any_gate in itertools.product((False, True), (False, True)):
        _intra_cute(x, x, xv, -_rnd(1, 70, HV, D, dtype=FP32).abs(), beta, 0.1, None, None, fused, _rnd(HV, dtype=FP32),
                    _rnd(HV * D, dtype=FP32), None, True, True, False, full_g_cum=True,
                    given_akk=_rnd(1, 70, HV, 64, dtype=BF16), any_gate=any_gate)  # fmt: skip
    missing = [cula.cache.key_text(k) for k in requested if k not in listed]
    assert requested and not missing, missing[:3]


def test_decode_requests_are_listed(requested, full_list):
    from cula.kda import fused_recurrent_kda, kda_decode, kda_decode_step
    from cula.lightning import lightning_decode

    grid = (
        (BF16, FP16), (FP32, BF16, FP16), (FP32, BF16), (64, 128),
        ("none", "softplus", "lower_bound", "lower_bound_no_a"), (False, True), ((False, False), (True, True)),
        (False, True), (False, True), (1, 2, 4, 8), (1, 16),  # state_v_first, step_states, T, N
    )
    for io, g_dt, b_dt, d, gate, l2, (sig, neg), svf, step, T, N in _sampled(grid, 13):
        H, HV = 1, 2 if N == 1 else 64  # N x HV reaches the column kernels' state counts at N = 16
        q, k, v = _rnd(N, T, H, d, dtype=io), _rnd(N, T, H, d, dtype=io), _rnd(N, T, HV, d, dtype=io)
        g, beta = _rnd(N, T, HV, d, dtype=g_dt), _rnd(N, T, HV, dtype=b_dt)
        pool = torch.empty(N + 1, HV, d, d)  # never read: the kernels are stubs
        idx = torch.arange(N, dtype=torch.int32)
        kw = dict(use_qk_l2norm_in_kernel=l2, use_beta_sigmoid_in_kernel=sig, allow_neg_eigval=neg,
                  state_v_first=svf, use_gate_in_kernel=gate != "none")  # fmt: skip
        if gate != "none":
            kw["dt_bias"] = _rnd(HV * d, dtype=FP32)
            if gate != "lower_bound_no_a":
                kw["A_log"] = _rnd(HV, dtype=FP32)
            if gate.startswith("lower_bound"):
                kw["lower_bound"] = -5.0
        steps = torch.empty(N, T, HV, d, d) if step else None
        kda_decode(q, k, v, g, beta, pool, idx, step_states=steps, **kw)
        kda_decode_step(pool, idx, **{n: a for n, a in kw.items()})(q, k, v, g, beta, step_states=steps)
        if T == 1 and g_dt != FP16:  # FLA's in-place pool form
            fused_recurrent_kda(q.transpose(0, 1).reshape(N, 1, H, d), k, v, g, beta, initial_state=pool,
                                ssm_state_indices=idx, inplace_final_state=True,
                                **{n: a for n, a in kw.items() if n != "allow_neg_eigval" or a})  # fmt: skip
        if io in (BF16, FP16):
            lightning_decode(q, k, v, torch.rand(HV), pool, idx, state_v_first=svf)
    families = {k[0] for k in requested}
    assert families == {"kda_decode_sm90", "lightning_decode_sm90"}, families
    missing = [cula.cache.key_text(k) for k in requested if k not in full_list]
    assert not missing, f"{len(missing)} of {len(requested)} requested variants are not listed: {missing[:3]}"


def test_lightning_variants_all_reachable(requested):
    """Every listed Lightning variant (prefill and decode) is asked for by some public call."""
    from cula.lightning import lightning_attn_fwd, lightning_decode

    for d, h0, ht, packed, svf in itertools.product((64, 128), (False, True), (False, True), (False, True),
                                                    (False, True)):  # fmt: skip
        B, T, HV = (1, 100, 2) if packed else (2, 50, 2)
        q, k, v = _rnd(B, T, 1, d), _rnd(B, T, 1, d), _rnd(B, T, HV, d)
        kw = dict(output_final_state=ht, state_v_first=svf)
        if packed:
            kw["cu_seqlens"] = torch.tensor([0, 30, 100], dtype=torch.int32)
        if h0:
            kw["initial_state"] = _rnd(2, HV, d, d, dtype=FP32)
        with torch.no_grad():
            lightning_attn_fwd(q, k, v, torch.rand(HV), **kw)
    # a call the time split cuts (whatever the H200's entry says): its first pass (the states-only variant) and the
    # combine's scan
    from cula.lightning.plan import LIGHTNING_TUNING
    from cula.time_split import SplitThresholds

    cut = SplitThresholds(items_per_sm=1.0, busy_items_per_sm=1.0, min_segment=64, min_seq_len=128)
    with LIGHTNING_TUNING.override((9, 0), time_split=cut), torch.no_grad():
        for d, svf in itertools.product((64, 128), (False, True)):
            q, k, v = _rnd(1, 256, 1, d), _rnd(1, 256, 1, d), _rnd(1, 256, 2, d)
            h0 = _rnd(1, 2, d, d, dtype=FP32) if svf else None  # (the combine's scan with and without h0)
            lightning_attn_fwd(q, k, v, torch.rand(2), initial_state=h0, state_v_first=svf)
    for io, d, svf, T, N in itertools.product((BF16, FP16), (64, 128), (False, True), range(1, 9), (1, 16)):
        HV = 2 if N == 1 else 256
        q, k, v = _rnd(N, T, 1, d, dtype=io), _rnd(N, T, 1, d, dtype=io), _rnd(N, T, HV, d, dtype=io)
        lightning_decode(q, k, v, torch.rand(HV), torch.empty(N, HV, d, d), torch.arange(N, dtype=torch.int32),
                         state_v_first=svf, check_indices=False)  # fmt: skip
    listed = set(variants.planner_variants("full", ops=("lightning",)))
    assert set(requested) == listed, (len(set(requested) - listed), len(listed - set(requested)))


def test_scopes_nest(full_list):
    wheel = set(variants.planner_variants("wheel"))
    smoke = set(variants.planner_variants("smoke"))
    assert smoke <= wheel <= full_list
    assert {k[0] for k in smoke} == {k[0] for k in full_list}  # every kernel family in CI's wheel
    assert all("(9, 0)" in cula.cache.key_text(k) for k in full_list)  # sm_90a only


def test_wheel_check_calls_take_smoke_variants(requested, monkeypatch):
    """The calls of ``scripts/device/wheel_check.py`` (the wheel's check on the H200, where the DSL is absent and
    only the wheel's variants exist) ask for variants of the smoke scope only, which CI's wheel build compiles:
    chunk_kda fixed (plan and general path), without safe_gate, packed, packed cut in time, the training forward;
    the training backward's stages on cula's kernels as the glue calls them for that call; decode and Lightning
    (prefill packed cut in time too)."""
    import importlib.util
    from pathlib import Path

    from cula.kda import chunk_kda, kda_decode
    from cula.kda.forward import _intra_cute
    from cula.kda.plan import KDA_TUNING
    from cula.lightning import lightning_attn_fwd, lightning_decode
    from cula.ops.kda.sm90.bwd_intra import chunk_kda_bwd_intra_sm90
    from cula.ops.kda.sm90.bwd_wy_dqkg import chunk_kda_bwd_wy_dqkg_sm90
    from cula.time_split import SplitThresholds

    path = Path(__file__).resolve().parents[1] / "scripts" / "device" / "wheel_check.py"
    spec = importlib.util.spec_from_file_location("wheel_check", path)
    wc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wc)
    monkeypatch.setattr(wc, "DEV", "cpu")
    flags = wc.CHUNK_FLAGS
    x, xp = wc._chunk_inputs(2, 300), wc._chunk_inputs(1, 557, N=3, seed=1)
    cu = torch.tensor([0, 100, 300, 557], dtype=torch.int32)
    with torch.no_grad():
        for _ in range(2):
            chunk_kda(**x, **flags)
            chunk_kda(**xp, **flags, cu_seqlens=cu, cu_seqlens_cpu=cu)
        chunk_kda(**x, **dict(flags, safe_gate=False))
        cut = SplitThresholds(items_per_sm=1.0, busy_items_per_sm=1.0, min_segment=128, min_seq_len=256)
        with KDA_TUNING.override((9, 0), time_split=cut):
            chunk_kda(**xp, **flags, cu_seqlens=cu, cu_seqlens_cpu=cu)
    xt = {n: t.clone().requires_grad_(n in ("q", "k", "v", "g", "beta")) for n, t in x.items()}
    chunk_kda(**xt, **flags)
    # the backward (FLA's Triton stages do not run on the CPU): cula's stages with the glue's arguments for this
    # call (beta after the glue's sigmoid is fp32; GVA, so no L2 norm's backward in stage 7)
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    B, T, HV, D = *v.shape[:3], 128
    a_log, dt_bias = x["A_log"], x["dt_bias"]
    _intra_cute(q, k, v, g, beta, D**-0.5, None, None, True, a_log, dt_bias, -5.0, True, True, False,
                full_g_cum=True, given_akk=torch.zeros(B, T, HV, 64, dtype=BF16))  # fmt: skip
    f, a, b32 = torch.zeros(B, T, HV, D), torch.zeros(B, T, HV, 64), torch.zeros(B, T, HV)
    s = torch.zeros(B, -(-T // 64), HV, D, D, dtype=BF16)
    chunk_kda_bwd_wy_dqkg_sm90(q, k, v, v, f, b32, a.to(BF16), s, v, s, v, state_v_first=False)
    chunk_kda_bwd_intra_sm90(q, k, f, b32, a, a, f, f, b32, f, reverse_cumsum_dg=True,
                             gate=(g, a_log, dt_bias, -5.0), in_place=True)  # fmt: skip
    # decode at T = 1 and 4, Lightning decode, Lightning prefill fixed, packed and cut in time
    N, H, HV = 4, 4, 16
    idx = torch.tensor([3, 0, -1, 1], dtype=torch.int32)
    pool = torch.zeros(N + 2, HV, D, D)
    for T in (1, 4):
        kda_decode(_rnd(N, T, H, D), _rnd(N, T, H, D), _rnd(N, T, HV, D), _rnd(N, T, HV, D, dtype=FP32),
                   _rnd(N, T, HV, dtype=FP32), pool, idx, A_log=_rnd(HV, dtype=FP32), dt_bias=_rnd(HV * D, dtype=FP32))
    lightning_decode(_rnd(N, 1, H, D), _rnd(N, 1, H, D), _rnd(N, 1, HV, D), torch.rand(HV), pool, idx)
    for packed in (False, True):
        B, T = (1, 557) if packed else (2, 300)
        with torch.no_grad():
            lightning_attn_fwd(_rnd(B, T, 2, D), _rnd(B, T, 2, D), _rnd(B, T, 4, D), torch.rand(4),
                               initial_state=torch.zeros(3 if packed else B, 4, D, D), output_final_state=True,
                               **({"cu_seqlens": cu} if packed else {}))  # fmt: skip
    from cula.lightning.plan import LIGHTNING_TUNING  # the pack again, cut in time

    cut = SplitThresholds(items_per_sm=1.0, busy_items_per_sm=1.0, min_segment=64, min_seq_len=128)
    with LIGHTNING_TUNING.override((9, 0), time_split=cut), torch.no_grad():
        lightning_attn_fwd(_rnd(1, 557, 2, D), _rnd(1, 557, 2, D), _rnd(1, 557, 4, D), torch.rand(4),
                           initial_state=torch.zeros(3, 4, D, D), output_final_state=True, cu_seqlens=cu,
                           cu_seqlens_cpu=cu)  # fmt: skip
    smoke = set(variants.planner_variants("smoke"))
    missing = [cula.cache.key_text(k) for k in requested if k not in smoke]
    assert not missing, f"{len(missing)} of {len(requested)} requested variants are not in the smoke scope: {missing}"
    # every family but stages 4 and 5's (this small call has fewer lanes than KdaTuning.bwd_dv_dhu_lanes)
    assert {k[0] for k in requested} == {k[0] for k in smoke} - {"kda.bwd_dhu"}


def test_recording_compiles_nothing(monkeypatch):
    """Listing the variants builds none of them (it is a dictionary of build functions)."""
    built = []
    monkeypatch.setattr(cula.cache, "_obtain", lambda key, build: built.append(key))
    listed = variants.planner_variants("smoke")
    assert listed and not built and all(callable(b) for b in listed.values())


def test_chunk_variants_all_reachable(requested, kda_tuning, monkeypatch):
    """Every listed chunk_kda variant (intra, state/output, the one-call launch, the segment summary and chain) is
    asked for by some public call: fixed and packed inference (general path and plan), training (with and without
    ``disable_recompute``), FLA's intra stage, the time-segmented launch and calls cut in time (on 132 SMs, where
    the chain takes 8 columns a CTA, and on 16, where it takes 16), over every dtype and flag the backend
    accepts."""
    from cula.kda import chunk_kda
    from cula.time_split import SplitThresholds

    grid = (
        (BF16, FP16), (FP32, BF16, FP16), (BF16, FP16, FP32),  # q/k/v, g, beta
        # gate form: a log gate without safe_gate and the fused softplus gate, no bound known (the intra kernel's
        # any_gate variant where the entry says so, else FLA's intra stages)
        ("plain", "safe_logspace", "safe_sigmoid", "softplus"),
        (False, True), ((False, False), (True, False), (True, True)),  # l2norm, (beta sigmoid, neg eigval)
        (False, True), (False, True), (False, True),  # initial state, final state, state_v_first
    )
    cut = SplitThresholds(items_per_sm=1.0, busy_items_per_sm=1.0, min_segment=64, min_seq_len=128)
    kept = {"disable_recompute": True}
    forms = {  # (B, packed, training, tuning, call, SMs)
        "fixed": (2, False, False, {}, {}, 132), "packed": (1, True, False, {}, {}, 132),
        "training": (2, False, True, {}, {}, 132), "training_packed": (1, True, True, {}, {}, 132),
        "training_kept": (2, False, True, {}, kept, 132), "training_kept_packed": (1, True, True, {}, kept, 132),
        "segmented": (1, False, False, {"overlap_state_min_tokens": 64}, {}, 132),
        "cut": (1, False, False, {"time_split": cut}, {}, 132),
        "cut_packed": (1, True, False, {"time_split": cut}, {}, 132),
        "cut_few_sms": (1, False, False, {"time_split": cut}, {}, 16),
    }  # fmt: skip
    H, HV, K, T = 1, 2, 128, 200
    for io, g_dt, b_dt, gate, l2, (sig, neg), h0, ht, svf in itertools.product(*grid):
        kw = dict(use_qk_l2norm_in_kernel=l2, use_beta_sigmoid_in_kernel=sig, allow_neg_eigval=neg,
                  output_final_state=ht, state_v_first=svf, safe_gate=gate.startswith("safe"))  # fmt: skip
        if gate in ("safe_sigmoid", "softplus"):
            kw.update(use_gate_in_kernel=True, A_log=_rnd(HV, dtype=FP32), dt_bias=_rnd(HV * K, dtype=FP32),
                      lower_bound=-5.0 if gate == "safe_sigmoid" else None)  # fmt: skip
        for B, packed, training, tuning, extra, sms in forms.values():
            monkeypatch.setattr("cula.time_split.sm_count", lambda index, sms=sms: sms)
            x = dict(q=_rnd(B, T, H, K, dtype=io, requires_grad=training), k=_rnd(B, T, H, K, dtype=io),
                     v=_rnd(B, T, HV, K, dtype=io), g=-_rnd(B, T, HV, K, dtype=g_dt).abs(),
                     beta=_rnd(B, T, HV, dtype=b_dt))  # fmt: skip
            call, N = dict(kw, **extra), B
            if packed:
                cu = torch.tensor([0, 150, 200], dtype=torch.int32)
                call.update(cu_seqlens=cu, cu_seqlens_cpu=cu)
                N = 2
            if h0:
                call["initial_state"] = _rnd(N, HV, K, K, dtype=FP32)
            kda_tuning(**{"time_split": None, "overlap_state_min_tokens": None, **tuning})
            for _ in range(2):  # the second call of a signature takes its plan (the fused launch)
                with torch.enable_grad() if training else torch.no_grad():
                    chunk_kda(**x, **call)
    listed = set(variants.planner_variants("full", ops=("kda.chunk",)))
    unreached = listed - set(requested)
    assert not unreached, (len(unreached), [cula.cache.key_text(k) for k in sorted(unreached, key=str)[:3]])


def test_decode_variants_all_reachable(requested):
    """Every listed kda_decode variant is asked for by some ``kda_decode`` call: every dtype, head size, gate (with
    and without ``A_log`` / ``dt_bias`` where optional; per channel, and per head as Gated DeltaNet's), flag, token
    count and both sides of the state count where the tile changes."""
    from cula._validate import DECODE_MAX_TOKENS
    from cula.kda import kda_decode

    gates = [("none", False, False), ("softplus", True, False), ("softplus", True, True)]
    gates += [("lower_bound", a, b) for a, b in itertools.product((False, True), (False, True))]
    gates = [(*gate, False) for gate in gates] + [(*gate, True) for gate in gates if gate[0] != "lower_bound"]
    grid = (
        (BF16, FP16), (FP32, BF16, FP16), (FP32, BF16), (64, 128), gates, (False, True),
        ((False, False), (True, False), (True, True)), (False, True), (False, True),  # beta, state_v_first, steps
        range(1, DECODE_MAX_TOKENS + 1), (1, 16),  # T, N (N = 16 with 64 value heads: the column kernels' counts)
    )
    made = {}

    def tensors(io, g_dt, b_dt, d, T, N, HV, per_head):  # made once a shape: the kernels are stubs
        key = (io, g_dt, b_dt, d, T, N, per_head)
        if key not in made:
            qkv = [torch.zeros(N, T, h, d, dtype=io) for h in (1, 1, HV)]
            g = torch.zeros((N, T, HV) if per_head else (N, T, HV, d), dtype=g_dt)
            made[key] = (*qkv, g, torch.zeros(N, T, HV, dtype=b_dt), torch.empty(N + 1, HV, d, d),
                         torch.arange(N, dtype=torch.int32), torch.empty(N, T, HV, d, d))  # fmt: skip
        return made[key]

    for io, g_dt, b_dt, d, (gate, a_log, bias, per_head), l2, (sig, neg), svf, step, T, N in itertools.product(*grid):
        HV = 2 if N == 1 else 64
        q, k, v, g, beta, pool, idx, steps = tensors(io, g_dt, b_dt, d, T, N, HV, per_head)
        kw = dict(use_qk_l2norm_in_kernel=l2, use_beta_sigmoid_in_kernel=sig, allow_neg_eigval=neg,
                  state_v_first=svf, use_gate_in_kernel=gate != "none")  # fmt: skip
        if a_log:
            kw["A_log"] = _rnd(HV, dtype=FP32)
        if bias:
            kw["dt_bias"] = _rnd(HV if per_head else HV * d, dtype=FP32)
        if gate == "lower_bound":
            kw["lower_bound"] = -5.0
        kda_decode(q, k, v, g, beta, pool, idx, step_states=steps if step else None, **kw)
    listed = set(variants.planner_variants("full", ops=("kda.decode",)))
    unreached = listed - set(requested)
    assert not unreached, (len(unreached), [cula.cache.key_text(k) for k in sorted(unreached, key=str)[:3]])
