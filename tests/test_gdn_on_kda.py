"""Gated DeltaNet on cula's KDA path (``cula.gated_delta_rule.backends``'s ``cula-sm90``): the gate repeated over K.

CPU: the backend's call, which reaches ``cula.kda.chunk_kda`` (its reference backend here), against Gated DeltaNet's
own float64 reference, outputs, final states and every input gradient (the repeated gate's summed back by
autograd), with the fused gate, beta sigmoid, GVA, packed sequences and both state layouts; what the kernels do
not take declines with its reason. GPU (``-m gpu``): ``chunk_gated_delta_rule`` training on the H200 (FLA 0.6.0's
own gated backward refuses to run there) against the float64 reference.
"""

from __future__ import annotations

import pytest
import torch

from cula.gated_delta_rule.backends import _chunk_cula_sm90, _cula_chunk_supports
from cula.gated_delta_rule.naive import reference_chunk_gated_delta_rule
from cula.testing import assert_close, make_cu_seqlens


def _inputs(B, T, H, HV, D, fused, seed=0, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x = dict(q=rnd(B, T, H, D), k=rnd(B, T, H, D), v=rnd(B, T, HV, D))
    if fused:
        x.update(g=rnd(B, T, HV), beta=rnd(B, T, HV), A_log=rnd(HV) * 0.5, dt_bias=rnd(HV) * 0.5)
    else:
        x.update(g=torch.nn.functional.logsigmoid(rnd(B, T, HV) + 2), beta=torch.rand(B, T, HV, generator=gen))
    return {n: (t.to(dtype) if n in ("q", "k", "v") else t).to(device) for n, t in x.items()}


def _run(fn, x, flags, grads=True):
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    o, ht = fn(**leaves, **flags)
    if not grads:
        return o, ht, {}
    gen = torch.Generator().manual_seed(7)
    loss = (o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum()
    if ht is not None:
        loss = loss + (ht.double() * torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(ht.device)).sum()
    loss.backward()
    return o, ht, {n: t.grad for n, t in leaves.items()}


def _flags(fused, state_v_first, cu, h0):
    return dict(
        scale=0.125, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=fused, allow_neg_eigval=False, state_v_first=state_v_first, cu_seqlens=cu,
        use_gate_in_kernel=fused,
    )  # fmt: skip


def _against_reference(x, flags, o, ht):
    """A GPU inference call's output and final state against the float64 reference on the same inputs (every
    element written: NaN fails), computed where the inputs are (float64 on the GPU: many times the CPU's speed)."""
    assert not o.isnan().any() and not ht.isnan().any()
    o_r, ht_r, _ = _run(_reference, x, _reference_flags(flags), grads=False)
    assert_close("o", o_r, o, 5e-3)
    assert_close("final state", ht_r, ht, 5e-3)


def _reference(**kw):
    return reference_chunk_gated_delta_rule(**kw, compute_dtype=torch.float64)


def _reference_flags(flags):
    return {n: t for n, t in flags.items() if n != "cu_seqlens_cpu"}


def _backend(**kw):
    kw.setdefault("A_log", None)
    kw.setdefault("dt_bias", None)
    return _chunk_cula_sm90(cu_seqlens_cpu=None if kw["cu_seqlens"] is None else kw["cu_seqlens"].cpu(), **kw)


@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("fused", [False, True], ids=["log-gate", "fused-gate"])
@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "packed"])
def test_matches_the_gdn_reference(fused, state_v_first, packed):
    lens = [37, 0, 70, 1]
    B, T = (1, sum(lens)) if packed else (2, 45)
    N = len(lens) if packed else B
    x = _inputs(B, T, 2, 4, 16, fused)
    cu = make_cu_seqlens(lens) if packed else None
    shape = (N, 4, 16, 16)
    h0 = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    flags = _flags(fused, state_v_first, cu, h0)
    o, ht, grads = _run(_backend, x, flags)
    o_r, ht_r, grads_r = _run(_reference, x, flags)
    # the KDA path runs cula's float32 reference here, the GDN reference float64: fp32 rounding apart
    assert_close("o", o_r, o, 1e-4)
    assert_close("final state", ht_r, ht, 1e-4)
    for name in grads_r:
        assert_close(f"d{name}", grads_r[name], grads[name], 1e-4)


def test_inference_takes_the_gdn_entry(gdn_tuning, pretend_sm90, monkeypatch):
    """An inference call hands KDA's forward Gated DeltaNet's own time split and row-factor flag (not KDA's)."""
    import cula.kda.forward
    from cula.time_split import SplitThresholds

    seen = {}
    monkeypatch.setattr(cula.kda.forward, "chunk_kda_fwd_sm90", lambda *a, **kw: seen.update(kw) or (None, None))
    x = _inputs(1, 8, 1, 2, 128, False, dtype=torch.bfloat16)
    for split, rows in ((None, False), (SplitThresholds(0.5, 0.3, 1024, 8192), True)):
        gdn_tuning(inference_chunk_on_cula=True, time_split=split, inference_row_factors=rows)
        _backend(**x, **_flags(False, False, None, None))
        assert seen["time_split"] == split and seen["row_factors"] is rows


def test_declines_what_the_kernels_do_not_take(gdn_tuning, pretend_sm90):
    x = _inputs(1, 8, 1, 1, 128, False, dtype=torch.bfloat16)
    base = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], chunk_size=64)
    # inference takes cula's path only where the GPU's entry says so; training always does
    gdn_tuning(inference_chunk_on_cula=False)
    ok, why = _cula_chunk_supports(**base)
    assert not ok and "inference_chunk_on_cula" in why
    assert _cula_chunk_supports(**dict(base, g=x["g"].clone().requires_grad_())) == (True, None)
    gdn_tuning(inference_chunk_on_cula=True)
    assert _cula_chunk_supports(**base) == (True, None)
    for over, why in (
        ({"q": x["q"].float()}, "q dtype"),
        ({"v": x["v"][..., :64]}, "head sizes"),
        ({"chunk_size": 32}, "chunk_size"),
        ({"cp_context": object()}, "cp_context"),
        ({"g": x["g"].double()}, "g dtype"),
    ):
        ok, reason = _cula_chunk_supports(**dict(base, **over))
        assert not ok and why in reason, (over, reason)


@pytest.mark.parametrize("per_head", [False, True], ids=["repeated-gate", "per-head-forward"])
def test_packed_training_takes_fla_graph_mode(per_head, gdn_tuning, monkeypatch):
    """A packed training call without ``cu_seqlens_cpu`` runs KDA's training in FLA's graph mode (``use_graph``,
    ``max_num_seqs`` the call's sequence count), eager or captured alike, so that an eager warm-up readies what a
    capture records; with ``cu_seqlens_cpu`` only a captured call does (an eager one keeps the exact chunk lists and
    its forward's time split); fixed lengths never."""
    import cula.gated_delta_rule.backends as gb
    import cula.kda
    import cula.kda.backends as kb

    gdn_tuning(training_per_head_gate=per_head)
    seen = []
    record = lambda *a, **kw: seen.append(kw) or (None, None)  # noqa: E731
    monkeypatch.setattr(cula.kda, "chunk_kda", record)
    monkeypatch.setattr(kb, "chunk_kda_cula_sm90", record)
    x = _inputs(1, 100, 2, 2, 16, True)
    cu = make_cu_seqlens([40, 0, 60])
    for cut, host, capture in ((cu, None, False), (cu, None, True), (cu, cu, False), (cu, cu, True),
                               (None, None, False), (None, None, True)):  # fmt: skip
        monkeypatch.setattr(gb, "capturing", lambda t, capture=capture: capture)
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
        _chunk_cula_sm90(**leaves, **dict(_flags(True, True, cut, None), scale=0.25), cu_seqlens_cpu=host)
        graph = {n: seen[-1][n] for n in ("use_graph", "max_num_seqs") if n in seen[-1]}
        want = cut is not None and (host is None or capture)
        assert graph == ({"use_graph": True, "max_num_seqs": 3} if want else {}), (host is None, capture)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["fixed", "packed", "packed-host-copy"])
@pytest.mark.parametrize("per_head", [False, True], ids=["repeated-gate", "per-head-forward"])
@pytest.mark.parametrize("fused", [False, True], ids=["log-gate", "fused-gate-gva"])
def test_gdn_training_on_hopper_cuda(fused, per_head, layout, gdn_tuning):
    """``chunk_gated_delta_rule`` with autograd on the H200, through cula's KDA path (the forward with the gate
    repeated over K, or on the intra kernel's per-head gate: ``GdnTuning.training_per_head_gate``), against the
    float64 reference: outputs, final state and every gradient at FLA's tolerances. Fixed lengths, and packed
    sequences with empty and one-token ones (without ``cu_seqlens_cpu``: FLA's graph mode; with it: the exact
    chunk lists)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from cula.gated_delta_rule import chunk_gated_delta_rule

    gdn_tuning(training_per_head_gate=per_head)

    H, HV = (2, 4) if fused else (2, 2)
    cu, (B, T, N) = None, (2, 300, 2)
    if layout != "fixed":
        lens = [37, 0, 130, 1, 72]
        cu, (B, T, N) = make_cu_seqlens(lens, device="cuda"), (1, sum(lens), len(lens))
    x = _inputs(B, T, H, HV, 128, fused, dtype=torch.bfloat16, device="cuda")
    h0 = torch.randn(N, HV, 128, 128, device="cuda") * 0.1
    flags = _flags(fused, True, cu, h0)
    if layout == "packed-host-copy":
        flags["cu_seqlens_cpu"] = cu.cpu()
    if fused:
        extra = {n: x.pop(n) for n in ("A_log", "dt_bias")}
        x.update(extra)
    o, ht, grads = _run(chunk_gated_delta_rule, x, flags)
    assert not o.isnan().any()
    o_r, ht_r, grads_r = _run(_reference, x, _reference_flags(flags))
    assert_close("o", o_r, o, 5e-3)
    assert_close("final state", ht_r, ht, 5e-3)
    tol = {"q": 8e-3, "k": 8e-3, "v": 8e-3, "g": 2e-2, "beta": 2e-2, "A_log": 2e-2, "dt_bias": 2e-2}
    for name in grads_r:
        assert not grads[name].isnan().any(), name
        assert_close(f"d{name}", grads_r[name], grads[name], tol[name])


@pytest.mark.gpu
@pytest.mark.parametrize("per_head", [False, True], ids=["repeated-gate", "per-head-forward"])
def test_gdn_packed_training_step_captured_cuda(per_head, gdn_tuning):
    """A packed ``chunk_gated_delta_rule`` training step (forward and backward) captured in a CUDA graph and replayed
    on new inputs after an eager warm-up: o, the final states and every gradient against the same step run eagerly,
    within FLA's tolerances, none NaN."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from test_cuda_graphs import _capture

    from cula.gated_delta_rule import chunk_gated_delta_rule

    gdn_tuning(training_per_head_gate=per_head)
    lens = [37, 0, 130, 1, 72]
    cu = make_cu_seqlens(lens, device="cuda")
    x = _inputs(1, sum(lens), 2, 4, 128, True, dtype=torch.bfloat16, device="cuda")
    x["initial_state"] = torch.randn(len(lens), 4, 128, 128, device="cuda") * 0.1
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    flags = {n: v for n, v in _flags(True, True, cu, None).items() if n != "initial_state"}
    gen = torch.Generator(device="cuda").manual_seed(3)
    do = torch.randn(1, sum(lens), 4, 128, generator=gen, device="cuda").to(torch.bfloat16)
    dht = torch.randn(len(lens), 4, 128, 128, generator=gen, device="cuda")

    def step():
        for t in leaves.values():
            t.grad = None
        o, ht = chunk_gated_delta_rule(**leaves, **flags)
        torch.autograd.backward((o, ht), (do, dht))
        return {"o": o, "ht": ht, **{f"d{n}": t.grad for n, t in leaves.items()}}

    graph, captured = _capture(step, warmup=2)
    tol = {"dg": 2e-2, "dbeta": 2e-2, "dA_log": 2e-2, "ddt_bias": 2e-2, "o": 5e-3, "ht": 5e-3}
    for seed in (1, 2):
        fresh = _inputs(1, sum(lens), 2, 4, 128, True, seed=seed, dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            for n, t in fresh.items():
                leaves[n].copy_(t)
        graph.replay()
        replayed = {n: t.detach().clone() for n, t in captured.items()}
        eager = step()
        for name, want in eager.items():
            assert not replayed[name].isnan().any(), name
            assert_close(name, want.float(), replayed[name].float(), tol.get(name, 8e-3))


@pytest.mark.gpu
@pytest.mark.parametrize("row_factors", [False, True, "wy"], ids=["qg-kg", "row-factors", "wy-in-recurrence"])
@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("gates", ["mild", "steep"])
@pytest.mark.parametrize("fused", [False, True], ids=["log-gate", "fused-gate"])
def test_gdn_inference_per_head_gate_on_hopper_cuda(fused, gates, state_v_first, row_factors, gdn_tuning):
    """Inference on cula's path: KDA's forward with the intra kernel's per-head gate (``scalar_gate``), nothing
    repeated over K, against the float64 reference: GVA, a ragged pack with empty and one-token sequences and a
    partial last chunk, initial states, and gates steep enough (about 10 to 50 nats a token) that the per-channel
    kernel's factored scores would not be exact. ``row_factors``: the intra kernel's factor rows and the
    state/output kernel on the raw q / k (``GdnTuning.inference_row_factors``); ``"wy"``: with v_new made in the
    recurrence from T diag(beta) and the raw v (``inference_wy_in_recurrence``)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from cula.gated_delta_rule import chunk_gated_delta_rule

    gdn_tuning(inference_chunk_on_cula=True, inference_row_factors=bool(row_factors),
               inference_wy_in_recurrence=row_factors == "wy")  # fmt: skip
    lens = [130, 0, 1, 64, 257, 7]
    x = _inputs(1, sum(lens), 2, 4, 128, fused, dtype=torch.bfloat16, device="cuda")
    if gates == "steep":
        if fused:  # -16 softplus(g + 3): about -50 a token
            x["A_log"] = torch.full_like(x["A_log"], 16.0).log()
            x["dt_bias"] = x["dt_bias"] + 3.0
        else:
            x["g"] = x["g"] - 10.0
    cu = make_cu_seqlens(lens).cuda()
    h0 = torch.randn(len(lens), 4, 128, 128, device="cuda") * 0.1
    flags = dict(_flags(fused, state_v_first, cu, h0), cu_seqlens_cpu=cu.cpu())
    with torch.inference_mode():
        o, ht = chunk_gated_delta_rule(**x, **flags)
    _against_reference(x, flags, o, ht)


@pytest.mark.gpu
@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("l2norm", [False, True], ids=["raw-qk", "l2norm"])
def test_gdn_row_factors_fixed_length_cuda(l2norm, state_v_first, gdn_tuning):
    """The factor rows at a fixed length (two sequences of 200 tokens: three full chunks and a partial one), four
    value heads per q / k head, with and without the fused L2 norm (f_q, f_k, f_x carry 1 / norm or 1), and with
    v_new made in the recurrence (``inference_wy_in_recurrence``): against the float64 reference, and within bf16
    noise of the qg / kg path they replace."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from cula.gated_delta_rule import chunk_gated_delta_rule

    x = _inputs(2, 200, 2, 8, 128, True, seed=3, dtype=torch.bfloat16, device="cuda")
    if not l2norm:  # unit-norm rows, as a caller that normalises them itself passes them
        x["q"], x["k"] = (torch.nn.functional.normalize(x[n].float(), dim=-1).to(torch.bfloat16) for n in "qk")
    h0 = torch.randn(2, 8, 128, 128, device="cuda") * 0.1
    flags = dict(_flags(True, state_v_first, None, h0), use_qk_l2norm_in_kernel=l2norm)
    outs = {}
    for rows in (False, True, "wy"):
        gdn_tuning(inference_chunk_on_cula=True, inference_row_factors=bool(rows),
                   inference_wy_in_recurrence=rows == "wy")  # fmt: skip
        with torch.inference_mode():
            outs[rows] = chunk_gated_delta_rule(**x, **flags)
    for rows in (True, "wy"):
        o, ht = outs[rows]
        _against_reference(x, flags, o, ht)
        assert_close(f"o ({rows}) against the qg / kg path", outs[False][0].float(), o.float(), 5e-3)
        assert_close(f"final state ({rows}) against the qg / kg path", outs[False][1], ht, 5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("wy", [False, True], ids=["w-u", "wy-in-recurrence"])
@pytest.mark.parametrize("halves", [False, True], ids=["segments", "halves"])
def test_gdn_row_factors_cut_in_time_cuda(halves, wy, gdn_tuning, kda_tuning, monkeypatch):
    """The factor rows through the exact time-parallel path (the segment summary's and the packed output pass's
    row_factors variants; every sequence past 128 tokens cut into 128-token segments): a ragged pack with an empty,
    a one-token and a partial-chunk sequence, initial states, GVA, against the float64 reference and the uncut
    call (``wy``: both with ``inference_wy_in_recurrence``, the summary's variant too)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from cula.gated_delta_rule import chunk_gated_delta_rule
    from cula.time_split import SplitThresholds

    lens = [300, 0, 1, 70, 450]
    x = _inputs(1, sum(lens), 1, 2, 128, True, seed=5, dtype=torch.bfloat16, device="cuda")
    cu = make_cu_seqlens(lens).cuda()
    h0 = torch.randn(len(lens), 2, 128, 128, device="cuda") * 0.1
    flags = dict(_flags(True, True, cu, h0), cu_seqlens_cpu=cu.cpu())
    import cula.kda.forward as forward

    cuts = []
    real = forward.parallel_segment_states

    def spy(plan, *a, **kw):
        cuts.append((plan.num_segments, kw.get("halves")))
        return real(plan, *a, **kw)

    monkeypatch.setattr(forward, "parallel_segment_states", spy)
    kda_tuning(time_split_halves=halves)  # (the halves are KDA's flag; the cut is Gated DeltaNet's own entry's)
    outs = {}
    for cut in (False, True):
        gdn_tuning(inference_chunk_on_cula=True, inference_row_factors=True, inference_wy_in_recurrence=wy,
                   time_split=SplitThresholds(1e9, 1e9, 128, 0) if cut else None)  # fmt: skip
        with torch.inference_mode():
            outs[cut] = chunk_gated_delta_rule(**x, **flags)
    assert cuts == [(10, halves)]  # only the second call cut: 300 and 450 tokens into 3 and 4 segments, 3 left whole
    o, ht = outs[True]
    _against_reference(x, flags, o, ht)
    assert_close("o against the uncut call", outs[False][0].float(), o.float(), 5e-3)
    assert_close("final state against the uncut call", outs[False][1], ht, 5e-3)


@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("fused", [False, True], ids=["log-gate", "fused-gate"])
@pytest.mark.parametrize("T", [1, 3])
def test_recurrent_decode_matches_the_gdn_reference(T, fused, state_v_first):
    """``fused_recurrent_gated_delta_rule``'s decode-sized calls on ``kda_decode`` (its reference backend here): the
    outputs and final state of GDN's own reference, the caller's initial state untouched, beta None as ones."""
    from cula.gated_delta_rule.backends import _recurrent_cula_sm90
    from cula.gated_delta_rule.naive import reference_fused_recurrent_gated_delta_rule

    x = _inputs(5, T, 2, 4, 16, fused, seed=T)
    h0 = torch.randn(5, 4, 16, 16, generator=torch.Generator().manual_seed(9))
    kept = h0.clone()
    flags = dict(
        scale=0.25, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=fused, A_log=x.pop("A_log", None), dt_bias=x.pop("dt_bias", None),
        use_beta_sigmoid_in_kernel=fused, allow_neg_eigval=False, state_v_first=state_v_first, cu_seqlens=None,
    )  # fmt: skip
    for beta in (x["beta"], None):
        args = dict(x, beta=beta, **flags)
        o, ht = _recurrent_cula_sm90(gk=None, gv=None, **args)
        o_r, ht_r = reference_fused_recurrent_gated_delta_rule(**args)
        assert_close("o", o_r, o, 1e-4)
        assert_close("final state", ht_r, ht, 1e-4)
        assert torch.equal(h0, kept)


def test_recurrent_declines_what_the_kernel_does_not_take(gdn_tuning, pretend_sm90):
    from cula.gated_delta_rule.backends import _cula_recurrent_supports

    x = _inputs(2, 1, 1, 1, 128, False, dtype=torch.bfloat16)
    h0 = torch.zeros(2, 1, 128, 128)
    base = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], gk=None, gv=None, beta=x["beta"], initial_state=h0,
                state_v_first=False, cu_seqlens=None, A_log=None, dt_bias=None)  # fmt: skip
    # the H200's entry: one token a sequence (measured faster than FLA's), MTP-sized calls on FLA's kernel
    assert _cula_recurrent_supports(**base) == (True, None)
    four = dict(base, q=torch.zeros(2, 4, 1, 128, dtype=torch.bfloat16))
    ok, why = _cula_recurrent_supports(**four)
    assert not ok and "inference_decode_max_tokens=1" in why
    gdn_tuning(inference_decode_max_tokens=8)
    assert _cula_recurrent_supports(**four) == (True, None)
    for over, why in (
        ({"cu_seqlens": torch.tensor([0, 1, 2])}, "cu_seqlens"),
        ({"gk": torch.zeros(2, 1, 1, 128)}, "per-key"),
        ({"q": torch.zeros(2, 9, 1, 128, dtype=torch.bfloat16)}, "tokens per sequence"),
        ({"initial_state": None}, "initial_state"),
        ({"initial_state": h0.double()}, "initial_state"),
        ({"q": x["q"].float()}, "q dtype"),
        ({"k": x["k"].half()}, "q / k / v dtypes"),  # (validation takes them apiece, as FLA's kernel does)
        ({"v": x["v"].float()}, "q / k / v dtypes"),
        ({"beta": x["beta"].half()}, "beta dtype"),
        ({"q": x["q"].detach().requires_grad_()}, "autograd"),
        ({"k": x["k"].detach().requires_grad_()}, "autograd"),
    ):
        ok, reason = _cula_recurrent_supports(**dict(base, **over))
        assert not ok and why in reason, (over, reason)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4])
def test_recurrent_decode_on_hopper_cuda(T, gdn_tuning):
    """``fused_recurrent_gated_delta_rule`` decode calls on cula's kernel against the float64 reference and FLA's
    kernel, NaN-poisoned outputs, the caller's states untouched."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fn

    from cula.gated_delta_rule import fused_recurrent_gated_delta_rule
    from cula.gated_delta_rule.naive import reference_fused_recurrent_gated_delta_rule

    gdn_tuning(inference_decode_max_tokens=8)  # MTP-sized calls run on FLA's kernel on the H200
    x = _inputs(64, T, 4, 8, 128, True, dtype=torch.bfloat16, device="cuda")
    h0 = torch.randn(64, 8, 128, 128, device="cuda") * 0.1
    kept = h0.clone()
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, A_log=x.pop("A_log"), dt_bias=x.pop("dt_bias"))  # fmt: skip
    o, ht = fused_recurrent_gated_delta_rule(**x, **kw)
    assert torch.equal(h0, kept) and not o.isnan().any()
    o_f, ht_f = fla_fn(**x, **kw)
    o_r, ht_r = reference_fused_recurrent_gated_delta_rule(
        **{n: t.cpu() for n, t in x.items()}, **{n: (t.cpu() if torch.is_tensor(t) else t) for n, t in kw.items()},
        compute_dtype=torch.float64,
    )  # fmt: skip
    assert_close("o vs f64", o_r, o.cpu(), 5e-3)
    assert_close("ht vs f64", ht_r, ht.cpu(), 5e-3)
    assert_close("o vs fla", o_f, o, 5e-3)
    assert_close("ht vs fla", ht_f, ht, 5e-3)
