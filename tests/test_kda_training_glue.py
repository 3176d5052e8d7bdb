"""CPU check of ``cula.kda.backends._ChunkKDATraining`` (our forward kernels, FLA 0.6.0's backward).

FLA's own ``ChunkKDAFunction`` saves what its forward stages produced and hands them to ``chunk_kda_bwd``; ours
keeps the inputs and its forward's Aqk / Akk and recomputes the rest in its backward. Here every Triton stage of
FLA (and our forward kernel, whose Aqk / Akk the stand-in makes with FLA's stand-in stages) is replaced by a
deterministic CPU stand-in, and FLA's real autograd function runs beside ours on the same inputs and output
gradients: ``chunk_kda_bwd`` must receive the same arguments from both, and the input gradients (FLA's
post-processing of them included) must come out the same. The real pairing is tested on the GPU by
test_gpu_api.py::test_chunk_kda_cuda_backward_matches_fla and test_kda_intra_kernel.py::test_akk_vs_fla.
"""

import math

import pytest
import torch

import cula.kda.backends as kb
from cula.kda import fla_backward
from cula.testing import small_batch

fc = pytest.importorskip("fla.ops.kda.chunk")
ff = pytest.importorskip("fla.ops.kda.chunk_fwd")


def _mix(*ts) -> torch.Tensor:
    """A scalar that depends on every given tensor (None counts as 0)."""
    return sum(t.double().sum() * (i + 1) for i, t in enumerate(ts) if t is not None)


def _intra(q, k, v, gk, beta, scale, cu_seqlens, chunk_size, chunk_indices, safe_gate, disable_recompute, use_graph):
    B, T, HV, _ = v.shape
    base = torch.arange(B * T * HV * 64, dtype=torch.float32).view(B, T, HV, 64) / 1e4
    s = float(_mix(q, k, v, gk, beta, chunk_indices)) * scale + (2.0 if safe_gate else 1.0)
    z = torch.zeros_like(v)
    return z, z, None, z, (base * s).to(q.dtype), (base + s).to(k.dtype)


def _bwd(calls):
    def chunk_kda_bwd(qk_rstd=None, raw_qk=False, **kw):
        """FLA's chunk_kda_bwd (a stand-in); with ``qk_rstd`` (cula's wrapper, ``fla_backward.chunk_kda_bwd``) dq and
        dk through FLA's l2norm_bwd, as that wrapper's contract says (CPU tensors: q and k normalised already)."""
        assert not raw_qk
        calls.append(kw)
        out = _bwd_outputs(kw)
        if qk_rstd is not None:
            out = (fc.l2norm_bwd(kw["q"], qk_rstd[0], out[0]), fc.l2norm_bwd(kw["k"], qk_rstd[1], out[1]), *out[2:])
        return out

    return chunk_kda_bwd


def _bwd_outputs(kw):
    m = float(_mix(kw["q"], kw["k"], kw["v"], kw["beta"], kw["Aqk"], kw["Akk"], kw["do"], kw["dht"], kw["g"],
                   kw["g_org"], kw["initial_state"], kw["A_log"], kw["dt_bias"], kw["chunk_indices"])) / 1e3
    g_like = kw["g_org"] if kw["g_org"] is not None else kw["g"]
    dA = None if kw["A_log"] is None else kw["A_log"] * m
    dbias = None if kw["dt_bias"] is None else kw["dt_bias"] * m
    dh0 = None if kw["initial_state"] is None else kw["initial_state"] * m
    return (kw["q"].float() * m, kw["k"].float() + m, kw["v"].float() - m, kw["beta"].float() * 2 * m,
            g_like.float() * 3 * m, dh0, dA, dbias)  # fmt: skip


def _fla_scores(q, k, v, g, beta, *, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu, scale, use_gate_in_kernel,
                lower_bound, safe_gate, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, **_):
    """(Aqk, Akk) through FLA's stages (here the stand-ins), with the arguments FLA's forward gives them."""
    if use_qk_l2norm_in_kernel:
        q, _ = fc.l2norm_fwd(q)
        k, _ = fc.l2norm_fwd(k)
    if use_beta_sigmoid_in_kernel:
        beta = fc.fused_beta_sigmoid(x=beta, scale=2.0 if allow_neg_eigval else 1.0)
    ci = None
    if cu_seqlens is not None:
        ci = fc.prepare_chunk_indices(cu_seqlens=cu_seqlens, chunk_size=64, cu_seqlens_cpu=cu_seqlens_cpu)
    if use_gate_in_kernel:
        g_cum = ff.kda_gate_chunk_cumsum(g=g, A_log=A_log, dt_bias=dt_bias, scale=ff.RCP_LN2, chunk_size=64,
                                         cu_seqlens=cu_seqlens, chunk_indices=ci, lower_bound=lower_bound)  # fmt: skip
    else:
        g_cum = ff.chunk_local_cumsum(g=g, scale=ff.RCP_LN2, chunk_size=64, cu_seqlens=cu_seqlens, chunk_indices=ci)
    *_, Aqk, Akk = ff.chunk_kda_fwd_intra(
        q=q, k=k, v=v, gk=g_cum, beta=beta, scale=scale, cu_seqlens=cu_seqlens, chunk_size=64, chunk_indices=ci,
        safe_gate=safe_gate, disable_recompute=False, use_graph=False,
    )  # fmt: skip
    return Aqk, Akk


@pytest.fixture
def stand_ins(monkeypatch):
    """FLA's stages and our forward kernel replaced by CPU stand-ins; returns the recorded chunk_kda_bwd calls."""
    calls = []
    monkeypatch.setattr(fc, "l2norm_fwd", lambda x: ((x * 0.5 + 0.25).to(x.dtype), x.float().pow(2).sum(-1)))
    monkeypatch.setattr(fc, "l2norm_bwd", lambda y, rstd, dy: dy * 3 + y.float() * rstd[..., None])
    monkeypatch.setattr(fc, "fused_beta_sigmoid", lambda x, scale: x.float() * scale + 1)
    monkeypatch.setattr(fc, "fused_beta_sigmoid_bwd", lambda x, dy, scale: dy * scale + x.float())
    monkeypatch.setattr(fc, "prepare_chunk_indices", lambda cu_seqlens, chunk_size, cu_seqlens_cpu=None: cu_seqlens * 2)
    # our backward builds the same list with cula's builder (its memo of earlier boundaries emptied)
    import collections

    import cula.kda.forward as chunk_fwd
    import cula.ops.kda.sm90.intra as intra

    monkeypatch.setattr(intra, "prepare_chunk_indices_i32", lambda cu, chunk_size=64, cu_seqlens_cpu=None: cu * 2)
    monkeypatch.setattr(chunk_fwd, "_CHUNK_INDICES", collections.OrderedDict())
    monkeypatch.setattr(fc, "chunk_kda_bwd", _bwd(calls))
    monkeypatch.setattr(fla_backward, "chunk_kda_bwd", _bwd(calls))  # what our backward calls

    def gate(g, A_log, dt_bias, scale, chunk_size, cu_seqlens, chunk_indices, lower_bound, use_graph=False):
        return g.float().cumsum(1) * scale + float(_mix(A_log, dt_bias, chunk_indices)) + (lower_bound or 0.0)

    monkeypatch.setattr(ff, "kda_gate_chunk_cumsum", gate)
    monkeypatch.setattr(ff, "chunk_local_cumsum", lambda g, scale, chunk_size, cu_seqlens, chunk_indices,
                        use_graph=False: g.float().cumsum(1) * scale + float(_mix(chunk_indices)))  # fmt: skip
    monkeypatch.setattr(ff, "chunk_kda_fwd_intra", _intra)
    monkeypatch.setattr(ff, "chunk_gated_delta_rule_fwd_h", lambda **kw: (
        None, kw["u"], kw["initial_state"] * 2 if kw["output_final_state"] else None))  # fmt: skip
    monkeypatch.setattr(ff, "chunk_gla_fwd_o_gk", lambda **kw: kw["v"] + 1)

    def our_forward(q, k, v, g, beta, initial_state, output_final_state, keep_scores=False, **kw):
        # the kernels' outputs' shapes; the scores made as FLA's forward makes them (the stand-in stages), which
        # on the GPU our intra kernel matches within its tolerance (test_kda_intra_kernel.py::test_akk_vs_fla)
        o, ht = v.detach() * 2, initial_state.detach() * 3 if output_final_state else None
        if not keep_scores:
            return o, ht
        return (o, ht, *_fla_scores(q.detach(), k.detach(), v.detach(), g.detach(), beta.detach(), **kw))

    monkeypatch.setattr(chunk_fwd, "chunk_kda_fwd_sm90", our_forward)
    return calls


CASES = {  # flags, GVA group, varlen, state_v_first
    "benchmark-flags-varlen-gva": (dict(use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=True,
                                        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True), 2, True, True),
    "neg-eigval-softplus": (dict(use_gate_in_kernel=True, lower_bound=None, use_beta_sigmoid_in_kernel=True,
                                 allow_neg_eigval=True), 1, False, False),
    "log-space-gate": (dict(use_qk_l2norm_in_kernel=True), 1, False, True),
    "plain-varlen": (dict(), 2, True, False),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_backward_hands_fla_what_fla_saves(stand_ins, case):
    flags, group, varlen, state_v_first = CASES[case]
    H, D = 2, 8
    HV = H * group
    B, T, N, cu = small_batch(varlen, fixed_t=7)
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype)

    fused = flags.get("use_gate_in_kernel", False)
    base = dict(q=rnd(B, T, H, D), k=rnd(B, T, H, D), v=rnd(B, T, HV, D), g=rnd(B, T, HV, D), beta=rnd(B, T, HV),
                initial_state=rnd(N, HV, D, D, dtype=torch.float32))  # fmt: skip
    if fused:
        base.update(A_log=rnd(HV, dtype=torch.float32), dt_bias=rnd(HV * D, dtype=torch.float32))
    w_o, w_t = rnd(B, T, HV, D, dtype=torch.float32), rnd(N, HV, D, D, dtype=torch.float32)
    kw = dict(scale=D**-0.5, output_final_state=True, state_v_first=state_v_first, cu_seqlens=cu, **flags)

    def leaves():
        return {n: t.clone().requires_grad_() for n, t in base.items()}

    def backward(o, ht, x):
        ((o.float() * w_o).sum() + (ht * w_t).sum()).backward()  # the same output gradients for both
        return {n: t.grad for n, t in x.items()}

    x_fla = leaves()
    fla_grads = backward(*fc.chunk_kda(**x_fla, **kw), x_fla)

    x_ours = leaves()
    args = dict(kw, A_log=None, dt_bias=None, chunk_size=64, cu_seqlens_cpu=None if cu is None else cu.clone())
    args.update(x_ours)
    for name in ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
                 "safe_gate"):  # fmt: skip
        args.setdefault(name, False)
    args.setdefault("lower_bound", None)
    our_grads = backward(*kb.chunk_kda_cula_sm90(**args), x_ours)

    assert len(stand_ins) == 2
    fla_call, our_call = stand_ins
    assert fla_call.keys() == our_call.keys()
    for name, a in fla_call.items():
        b = our_call[name]
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), name
        else:
            assert a == b, name
    assert fla_grads.keys() == our_grads.keys()
    for name, a in fla_grads.items():
        b = our_grads[name]
        assert a is not None and b is not None and a.dtype == b.dtype and torch.equal(a, b), f"d{name}"


def test_training_call_skips_the_bound_launch(monkeypatch):
    """A training call's plan must go through autograd, never through the bound (forward-only) launch."""
    q = torch.randn(1, 4, 2, 128, requires_grad=True)
    args = dict(q=q, k=q, v=q, g=q, beta=q[..., 0], A_log=None, dt_bias=None, initial_state=None)
    with torch.enable_grad():
        assert kb._prepare_chunk_kda_cula_sm90(**args) is None


def _plain_call(q):
    return dict(q=q, k=q, v=q, g=q, beta=q[..., 0], A_log=None, dt_bias=None, initial_state=None, scale=0.1,
                output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=True, lower_bound=None,
                state_v_first=False, cu_seqlens=None, chunk_size=64)  # fmt: skip


def _prefix_forward(monkeypatch, with_prefix: bool) -> list:
    """Our forward replaced by one that returns marked prefix tensors (or None, as where FLA's intra stage runs)
    and FLA's backward by a recorder; returns the recorded chunk_kda_bwd keyword sets."""
    import cula.kda.forward as chunk_fwd

    calls = []

    def forward(q, k, v, g, beta, initial_state, output_final_state, keep_scores=False, keep_prefix=False, **kw):
        assert keep_scores
        scores = (v.detach() * 2, None, torch.ones_like(v), torch.ones_like(v) * 2)
        if not keep_prefix:
            return scores
        marks = {n: torch.full_like(v, i + 3.0) for i, n in enumerate(("g", "w", "u", "qg", "kg", "h", "v_new"))}
        return (*scores, marks if with_prefix else None)

    def bwd(qk_rstd=None, **kw):
        calls.append(kw)
        return (kw["q"].float(), kw["k"].float(), kw["v"].float(), kw["beta"].float(), kw["g"].float(), None, None,
                None)  # fmt: skip

    monkeypatch.setattr(chunk_fwd, "chunk_kda_fwd_sm90", forward)
    monkeypatch.setattr(fla_backward, "chunk_kda_bwd", bwd)
    monkeypatch.setattr(fla_backward, "recompute_on_cula", lambda *a: pytest.fail("the prefix was recomputed"))
    monkeypatch.setattr(kb, "_said_recompute", [])
    return calls


def test_disable_recompute_keeps_what_the_backward_reads(monkeypatch):
    """disable_recompute=True (FLA's switch to keep the intermediates instead of recomputing them): the forward's
    g_cum, w, u, qg, kg and the states h, v_new reach FLA's backward as they are, with disable_recompute=True."""
    calls = _prefix_forward(monkeypatch, with_prefix=True)
    q = torch.randn(1, 4, 2, 128, requires_grad=True)
    with torch.enable_grad():
        o, _ = kb.chunk_kda_cula_sm90(**_plain_call(q), disable_recompute=True)
        o.sum().backward()
    (kw,) = calls
    assert kw["disable_recompute"] is True
    for i, name in enumerate(("g", "w", "u", "qg", "kg", "h", "v_new")):
        assert torch.equal(kw[name], torch.full_like(q, i + 3.0)), name


def test_disable_recompute_is_said_once(monkeypatch, caplog):
    """Where the forward cannot keep them (FLA's intra stage ran), disable_recompute=True changes nothing but is not
    silent: one INFO line a process says the backward recomputes; without it the backward recomputes unsaid."""
    import logging

    calls = _prefix_forward(monkeypatch, with_prefix=False)
    monkeypatch.setattr(fla_backward, "recompute_on_cula", lambda *a: False)
    monkeypatch.setattr(ff, "chunk_local_cumsum", lambda g, **kw: g.float())
    q = torch.randn(1, 4, 2, 128, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="cula"), torch.enable_grad():
        for recompute in (False, True, True):
            o, _ = kb.chunk_kda_cula_sm90(**_plain_call(q), disable_recompute=recompute)
            o.sum().backward()
    said = [r for r in caplog.records if "disable_recompute" in r.getMessage()]
    assert len(said) == 1 and "recomputes" in said[0].getMessage()
    assert [kw["disable_recompute"] for kw in calls] == [False] * 3


@pytest.mark.parametrize("fused", [False, True], ids=["log-gate", "fused-gate"])
def test_per_head_gate_backward_sums_the_repeated_gate(stand_ins, fused):
    """Gated DeltaNet's gate (``g [B, T, HV]``, ``dt_bias [HV]``) saved by the forward: the backward hands FLA's
    stages the gate repeated over K, exactly as a call with the repeated gate would, and sums dg and ddt_bias back over
    K; the other gradients are that call's."""
    from cula.kda import backends as kb
    from cula.kda.plan import gate_over_k

    gen = torch.Generator().manual_seed(5)
    B, T, H, HV, D = 1, 70, 1, 2, 128
    x = {n: torch.randn(B, T, h, D, generator=gen).bfloat16() for n, h in (("q", H), ("k", H), ("v", HV))}
    g, beta = torch.randn(B, T, HV, generator=gen), torch.randn(B, T, HV, generator=gen)
    A_log, bias = torch.randn(HV, generator=gen), torch.randn(HV, generator=gen)
    p = dict(use_gate_in_kernel=fused, allow_neg_eigval=False, use_qk_l2norm_in_kernel=True,
             use_beta_sigmoid_in_kernel=True, use_graph=False, scale=D**-0.5, state_v_first=False, safe_gate=False,
             lower_bound=None)  # fmt: skip
    scores = (torch.randn(B, T, HV, 64, generator=gen).bfloat16(),) * 2
    do = torch.randn(B, T, HV, D, generator=gen).bfloat16()
    head = kb._training_backward((x["q"], x["k"], x["v"], g, beta, A_log, bias, None, None, None, *scores), p, do,
                                 None)  # fmt: skip
    gk, bias_k = gate_over_k(g, bias, D)
    chan = kb._training_backward((x["q"], x["k"], x["v"], gk, beta, A_log, bias_k, None, None, None, *scores), p, do,
                                 None)  # fmt: skip
    assert stand_ins[0].keys() == stand_ins[1].keys()
    for name, a in stand_ins[0].items():
        b = stand_ins[1][name]
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), name
    names = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")
    for name, a, b in zip(names, head, chan):
        if name == "dg":
            b = b.float().sum(-1)
        elif name == "ddt_bias" and b is not None:
            b = b.view(HV, D).sum(-1)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-6, atol=1e-6), name


def test_backward_without_a_binary_runs_on_fla_stages(monkeypatch, caplog):
    """A backward stage of cula's that meets a kernel variant with no binary (a wheel without the DSL) raises
    before it launches; the backward then runs again on FLA's stages alone (``fla_backward.fla_stages_only``) with
    the same arguments, logged once a process as a warning."""
    import logging

    from cula.cache import VariantUnavailableError

    calls = _prefix_forward(monkeypatch, with_prefix=True)
    recorded = fla_backward.chunk_kda_bwd
    only = []

    def bwd(qk_rstd=None, **kw):
        only.append(fla_backward._FLA_STAGES_ONLY.get())
        if not only[-1]:
            raise VariantUnavailableError("kernel variant ('kda.bwd_intra', ...) is not in cula's prebuilt manifest")
        return recorded(qk_rstd, **kw)

    monkeypatch.setattr(fla_backward, "chunk_kda_bwd", bwd)
    monkeypatch.setattr(kb, "_said_fla_stages", [])
    q = torch.randn(1, 4, 2, 128, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="cula"), torch.enable_grad():
        for _ in range(2):
            o, _ = kb.chunk_kda_cula_sm90(**_plain_call(q), disable_recompute=True)
            o.sum().backward()
    assert only == [False, True, False, True]
    assert len(calls) == 2 and all(kw["disable_recompute"] for kw in calls)
    said = [r for r in caplog.records if "FLA's stages alone" in r.getMessage()]
    assert len(said) == 1 and "prebuilt manifest" in said[0].getMessage()
    assert not fla_backward._FLA_STAGES_ONLY.get()


@pytest.mark.parametrize("params", ["both", "no-A_log", "no-dt_bias"])
def test_per_head_gate_backward_is_autograds(params):
    """``per_head_gate_backward``: Gated DeltaNet's fused gate ``a = -exp(A_log) softplus(g + dt_bias)`` (FLA's:
    softplus the identity above 20, ``exp(A_log)`` e where A_log is absent) repeated over K, against autograd through
    it for per-channel gradients ``dg``; and without the fused gate, the channels' sum."""
    from cula.kda.backends import per_head_gate_backward

    gen = torch.Generator().manual_seed(7)
    B, T, HV, K = 2, 33, 3, 128
    g = torch.randn(B, T, HV, generator=gen, dtype=torch.float64) * 8  # some past softplus's threshold
    A_log = None if params == "no-A_log" else torch.randn(HV, generator=gen, dtype=torch.float64)
    bias = None if params == "no-dt_bias" else torch.randn(HV, generator=gen, dtype=torch.float64)
    dg = torch.randn(B, T, HV, K, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (g, A_log, bias)]
    x = leaves[0] + (0 if bias is None else leaves[2])
    coef = torch.exp(leaves[1]) if A_log is not None else math.e
    a = -coef * torch.where(x > 20.0, x, torch.nn.functional.softplus(x))
    (a[..., None] * dg).sum().backward()
    got = per_head_gate_backward(dg.float(), g.float(), None if A_log is None else A_log.float(),
                                 None if bias is None else bias.float(), True)  # fmt: skip
    for name, want, have in zip(("dg", "dA_log", "ddt_bias"), (t.grad if t is not None else None for t in leaves), got):
        assert (want is None) == (have is None), name
        if want is not None:
            torch.testing.assert_close(have.double(), want, rtol=1e-4, atol=1e-4, msg=name)
    plain = per_head_gate_backward(dg.float(), g.float(), None, None, False)
    torch.testing.assert_close(plain[0].double(), dg.sum(-1), rtol=1e-5, atol=1e-5)
    assert plain[1:] == (None, None)


@pytest.mark.parametrize("fused", [False, True], ids=["log-gate", "fused-gate"])
def test_per_head_gate_recompute_keeps_the_gate_per_head(monkeypatch, fused):
    """With the recompute on cula's intra kernel, Gated DeltaNet's gate reaches it per head (no repeat over K), FLA's
    stages get its g_cum with no fused gate (no g_org, A_log, dt_bias) and the gate's backward runs per head
    afterwards (``per_head_gate_backward`` on the stages' dg)."""
    gen = torch.Generator().manual_seed(9)
    B, T, H, HV, D = 1, 70, 1, 2, 128
    x = {n: torch.randn(B, T, h, D, generator=gen).bfloat16() for n, h in (("q", H), ("k", H), ("v", HV))}
    g, beta = torch.randn(B, T, HV, generator=gen), torch.randn(B, T, HV, generator=gen)
    A_log, bias = torch.randn(HV, generator=gen), torch.randn(HV, generator=gen)
    dg_chan = torch.randn(B, T, HV, D, generator=gen)
    seen = {}

    def prefix(q, k, v, g_, beta_, A_log_, dt_bias_, *args, Akk=None, qk_rstd=False):
        seen["prefix"] = (g_, A_log_, dt_bias_)
        made = {n: torch.full((1,), float(i)) for i, n in enumerate(("g", "w", "u", "qg", "kg", "v_new", "h"))}
        return made

    def bwd(qk_rstd=None, raw_qk=False, **kw):
        seen["bwd"] = kw
        return (kw["q"].float(), kw["k"].float(), kw["v"].float(), kw["beta"].float(), dg_chan.clone(), None, None,
                None)  # fmt: skip

    monkeypatch.setattr(fc, "fused_beta_sigmoid", lambda x, scale: x.float() * scale)
    monkeypatch.setattr(fc, "fused_beta_sigmoid_bwd", lambda x, dy, scale: dy * scale)
    monkeypatch.setattr(fc, "l2norm_fwd", lambda t: (t, t.float().pow(2).sum(-1)))
    monkeypatch.setattr(fla_backward, "recompute_on_cula", lambda q, v, p: True)
    monkeypatch.setattr(fla_backward, "recompute_prefix", prefix)
    monkeypatch.setattr(fla_backward, "chunk_kda_bwd", bwd)
    p = dict(use_gate_in_kernel=fused, allow_neg_eigval=False, use_qk_l2norm_in_kernel=False,
             use_beta_sigmoid_in_kernel=True, use_graph=False, scale=D**-0.5, state_v_first=False, safe_gate=False,
             lower_bound=None)  # fmt: skip
    scores = (torch.zeros(B, T, HV, 64).bfloat16(),) * 2
    out = kb._training_backward((x["q"], x["k"], x["v"], g, beta, A_log, bias, None, None, None, *scores), p,
                                torch.randn(B, T, HV, D, generator=gen).bfloat16(), None)  # fmt: skip
    g_seen, a_seen, b_seen = seen["prefix"]
    assert g_seen is g  # per head, not repeated over K
    assert (a_seen is A_log and b_seen is bias) if fused else (a_seen is None and b_seen is None)
    kw = seen["bwd"]
    assert kw["use_gate_in_kernel"] is False and kw["g_org"] is None and kw["A_log"] is None
    assert kw["dt_bias"] is None and kw["g"] is not None
    want = kb.per_head_gate_backward(dg_chan, g, A_log if fused else None, bias if fused else None, fused)
    names = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")
    got = dict(zip(names, out))
    assert torch.equal(got["dg"], want[0].to(g.dtype))
    for name, w in (("dA_log", want[1]), ("ddt_bias", want[2])):
        assert (got[name] is None) == (w is None) and (w is None or torch.equal(got[name], w)), name
