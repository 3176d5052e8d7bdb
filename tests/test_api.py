"""Public API: FLA 0.6.0 signatures, argument validation, backend selection and the CPU path."""

import inspect
import logging
import warnings

import pytest
import torch

import cula.gated_delta_rule as cg
import cula.kda as ck
import cula.lightning as cl
import cula.simple_gla as cs
from cula.backends import BackendUnavailableError
from cula.kda.backends import chunk_kda_registry
from cula.testing import assert_close, make_cu_seqlens

warnings.filterwarnings("ignore", message=".*Triton is not supported.*")


def _fla_pairs():
    import fla.ops.gated_delta_rule as fg
    import fla.ops.kda as fk
    import fla.ops.lightning_attn as fl
    import fla.ops.simple_gla as fs
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    return [
        (ck.chunk_kda, fk.chunk_kda),
        (ck.fused_recurrent_kda, fk.fused_recurrent_kda),
        (ck.fused_recurrent_kda_fwd, fused_recurrent_kda_fwd),
        (cg.chunk_gated_delta_rule, fg.chunk_gated_delta_rule),
        (cg.fused_recurrent_gated_delta_rule, fg.fused_recurrent_gated_delta_rule),
        (cs.chunk_simple_gla, fs.chunk_simple_gla),
        (cs.fused_recurrent_simple_gla, fs.fused_recurrent_simple_gla),
        (cl.chunk_lightning_attn, fl.chunk_lightning_attn),
        (cl.fused_recurrent_lightning_attn, fl.fused_recurrent_lightning_attn),
    ]


def test_signatures_match_fla():
    for ours, theirs in _fla_pairs():
        a = [(p.name, p.default, p.kind) for p in inspect.signature(ours).parameters.values()]
        b = [(p.name, p.default, p.kind) for p in inspect.signature(theirs).parameters.values()]
        assert a == b, f"{ours.__name__}: {a} != FLA {b}"


def test_aliases_match_fla():
    assert cg.chunk_gdn is cg.chunk_gated_delta_rule
    assert cg.fused_recurrent_gdn is cg.fused_recurrent_gated_delta_rule


# ---------------------------------------------------------------- inputs

B, T, H, HV, K, V = 1, 20, 2, 4, 16, 16


def kda_inputs(B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=torch.float32, requires_grad=False):
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = torch.randn(B, T, H, K, dtype=dtype)
    v = torch.randn(B, T, HV, V, dtype=dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, K)).to(dtype)
    beta = torch.rand(B, T, HV, dtype=dtype)
    out = dict(q=q, k=k, v=v, g=g, beta=beta)
    for t in out.values():
        t.requires_grad_(requires_grad)
    return out


def _bad_cases():
    x = kda_inputs()
    cu = make_cu_seqlens([5, 15])
    h0 = torch.zeros(1, HV, K, V)
    yield "q dtype int", dict(x, q=x["q"].long()), TypeError, "`q` must have dtype"
    yield "q float64", dict(x, q=x["q"].double()), TypeError, "`q` must have dtype"
    yield "q rank", dict(x, q=x["q"][0]), ValueError, "`q` must have 4 dimensions"
    yield "k shape", dict(x, k=x["k"][:, :-1]), ValueError, "`k` must have shape"
    yield "v dtype", dict(x, v=x["v"].half()), TypeError, "`v` must have dtype"
    yield "v time", dict(x, v=x["v"][:, :-1]), ValueError, "`v` must have shape"
    yield "gva", dict(x, v=torch.randn(B, T, 3, V), g=x["g"][:, :, :3], beta=x["beta"][:, :, :3]), ValueError, "GVA"
    yield "g shape", dict(x, g=x["g"][..., :-1]), ValueError, "`g` must have shape"
    yield "beta shape", dict(x, beta=x["beta"][..., None]), ValueError, "`beta` must have"
    yield "device", dict(x, k=x["k"].to("meta")), ValueError, "`k` is on meta"
    yield "head size", dict(x, q=torch.randn(B, T, H, 300), k=torch.randn(B, T, H, 300),
                            g=torch.randn(B, T, HV, 300)), ValueError, "unsupported head size"
    yield "cu float", dict(x, cu_seqlens=cu.float()), TypeError, "`cu_seqlens` must have dtype"
    yield "cu 2d", dict(x, cu_seqlens=cu[None]), ValueError, "`cu_seqlens` must have 1 dimensions"
    yield "cu start", dict(x, cu_seqlens=torch.tensor([1, 5, 20])), ValueError, "must start at 0"
    yield "cu order", dict(x, cu_seqlens=torch.tensor([0, 15, 5, 20])), ValueError, "non-decreasing"
    yield "cu end", dict(x, cu_seqlens=torch.tensor([0, 5, 19])), ValueError, "must end at the total"
    yield "cu cpu end", dict(x, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 5, 21])), ValueError, "must end"
    yield "cu batch", dict({n: torch.cat([t, t]) for n, t in x.items()}, cu_seqlens=make_cu_seqlens([20, 20])), \
        ValueError, "batch size is expected to be 1"
    yield "h0 shape", dict(x, initial_state=torch.zeros(1, HV, K, V + 1)), ValueError, "`initial_state` must have shape"
    yield "h0 n varlen", dict(x, cu_seqlens=cu, initial_state=h0), ValueError, "`initial_state` must have shape"
    yield "h0 dtype", dict(x, initial_state=h0.bfloat16()), TypeError, "`initial_state` must have dtype"
    yield "unknown kwarg", dict(x, use_qk_l2norm=True), TypeError, "unexpected keyword argument"
    yield "chunk size", dict(x, chunk_size=16), ValueError, "`chunk_size` must be either 32 or 64"
    yield "neg eigval", dict(x, allow_neg_eigval=True), ValueError, "requires `use_beta_sigmoid_in_kernel"
    yield "safe gate lb", dict(x, safe_gate=True, use_gate_in_kernel=True, A_log=torch.zeros(HV)), ValueError, \
        "`lower_bound` must be specified"
    yield "safe gate range", dict(x, safe_gate=True, use_gate_in_kernel=True, lower_bound=-6.0), ValueError, \
        "safe range"
    yield "gate no A_log", dict(x, use_gate_in_kernel=True), ValueError, "`A_log` must be provided"
    yield "A_log shape", dict(x, use_gate_in_kernel=True, A_log=torch.zeros(HV + 1)), ValueError, "`A_log` must"
    yield "dt_bias size", dict(x, use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=torch.zeros(HV)), \
        ValueError, "`dt_bias` must have HV\\*K"
    yield "scale tensor", dict(x, scale=torch.tensor(0.5)), TypeError, "`scale` must be a Python float"
    yield "both layouts", dict(x, state_v_first=True, transpose_state_layout=True), ValueError, "not both"


@pytest.mark.parametrize("case", list(_bad_cases()), ids=lambda c: c[0])
def test_chunk_kda_rejects_bad_input(case, monkeypatch):
    _, kwargs, exc, match = case
    # Validation must fire before any backend runs.
    monkeypatch.setattr(chunk_kda_registry, "dispatch", lambda *a, **k: pytest.fail("dispatched bad input"))
    with pytest.raises(exc, match=match):
        ck.chunk_kda(**kwargs)


@pytest.mark.parametrize("fn", ["fused_recurrent_kda", "fused_recurrent_kda_fwd"])
def test_fused_recurrent_kda_rejects_bad_input(fn):
    x = kda_inputs()
    f = getattr(ck, fn)
    kw = dict(inplace_final_state=False) if fn.endswith("_fwd") else {}
    with pytest.raises(TypeError, match="unexpected keyword"):
        f(**x, **kw, bogus=1)
    with pytest.raises(ValueError, match="`g` must have shape"):
        f(**dict(x, g=x["g"][..., :3]), **kw)
    with pytest.raises(ValueError, match="non-decreasing"):
        f(**x, **kw, cu_seqlens=torch.tensor([0, 12, 3, 20]))


def test_other_ops_reject_bad_input():
    x = kda_inputs()
    q, k, v = x["q"], x["k"], x["v"]
    g = torch.randn(B, T, HV)
    with pytest.raises(ValueError, match="`g` must have shape"):
        cg.chunk_gated_delta_rule(q, k, v, g[..., :1], x["beta"])
    with pytest.raises(TypeError, match="unexpected keyword"):
        cg.chunk_gated_delta_rule(q, k, v, g, x["beta"], chunk_szie=64)
    with pytest.raises(ValueError, match="chunk_size"):
        cg.chunk_gated_delta_rule(q, k, v, g, x["beta"], chunk_size=128)
    # FLA raises DeprecationWarning for head_first; cula's error is one, and a ValueError
    for call in (
        lambda: cs.chunk_simple_gla(q, k, v, g=g, head_first=False),
        lambda: cg.chunk_gated_delta_rule(q, k, v, g, x["beta"], head_first=False),
        lambda: cl.chunk_lightning_attn(q, k, v, layer_idx=0, num_layers=2, head_first=False),
    ):
        for kind in (DeprecationWarning, ValueError):
            with pytest.raises(kind, match="head_first"):
                call()
    with pytest.raises(ValueError, match="not both"):
        cs.chunk_simple_gla(q, k, v, g=g, g_gamma=torch.zeros(HV))
    with pytest.raises(TypeError, match="`decay` must have dtype"):
        cl.lightning_attn_fwd(q, k, v, torch.zeros(HV, dtype=torch.float64))
    with pytest.raises(ValueError, match="layer_idx"):
        cl.chunk_lightning_attn(q, k, v[:, :, :H], layer_idx=4, num_layers=3)
    with pytest.raises(ValueError, match="must start at 0"):
        cs.fused_recurrent_simple_gla(q, k, v, g=g, cu_seqlens=torch.tensor([2, 20]))


# ---------------------------------------------------------------- inputs strided in their last dimension


def _strided_last(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a view whose last dimension has stride 2."""
    buf = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    view = buf[..., ::2]
    view.copy_(t)
    return view


def _kda_step(state_pool, state_indices, q, k, v, g, beta, **bound):
    step = ck.kda_decode_step(state_pool, state_indices, **bound)
    step(q, k, v, g, beta)  # the second step runs the closure's plan
    return step(q, k, v, g, beta)


def _gdn_step(state_pool, state_indices, q, k, v, g, beta, **bound):
    step = cg.gdn_decode_step(state_pool, state_indices, **bound)
    step(q, k, v, g, beta)
    return step(q, k, v, g, beta)


def _lightning_step(decay, state_pool, state_indices, q, k, v, **bound):
    step = cl.lightning_decode_step(decay, state_pool, state_indices, **bound)
    step(q, k, v)
    return step(q, k, v)


def _strided_cases():
    """(label, function, keyword arguments, the tensors it writes, differentiable): every public function of the
    four packages; every other tensor argument is only read."""
    torch.manual_seed(0)
    x = kda_inputs()
    h0 = torch.randn(B, HV, K, V)
    gate = dict(A_log=torch.randn(HV), dt_bias=torch.randn(HV * K), use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)  # fmt: skip
    cu = make_cu_seqlens([5, 15])
    packed = dict(x, cu_seqlens=cu, initial_state=torch.randn(2, HV, K, V), output_final_state=True)
    gs = torch.nn.functional.logsigmoid(torch.randn(B, T, HV))
    gdn = dict(q=x["q"], k=x["k"], v=x["v"], g=gs, beta=x["beta"], initial_state=h0, output_final_state=True)
    qkv = {n: x[n] for n in ("q", "k", "v")}
    gla = dict(qkv, g_gamma=-torch.rand(HV), initial_state=h0, output_final_state=True)
    mh = dict(qkv, v=x["v"][:, :, :H].contiguous(), initial_state=h0[:, :H].contiguous(), output_final_state=True)
    N, P = 3, 5
    tok = {n: t[:N, :2] for n, t in kda_inputs(B=N).items()}
    pool, idx = torch.randn(P, HV, V, K) * 0.1, torch.tensor([4, -1, 0], dtype=torch.int32)
    dec = dict(tok, state_pool=pool, state_indices=idx, A_log=torch.randn(HV), dt_bias=torch.randn(HV * K))
    gdn_dec = dict(dec, g=torch.randn(N, 2, HV), dt_bias=torch.randn(HV))
    steps = torch.randn(N, 2, HV, V, K)

    yield "chunk_kda", ck.chunk_kda, dict(x, initial_state=h0, output_final_state=True, **gate), (), True
    yield "chunk_kda[varlen]", ck.chunk_kda, dict(packed, cu_seqlens_cpu=cu), (), True
    yield "fused_recurrent_kda", ck.fused_recurrent_kda, dict(x, initial_state=h0, output_final_state=True, **gate), \
        (), True
    yield "fused_recurrent_kda_fwd[varlen]", ck.fused_recurrent_kda_fwd, dict(packed, inplace_final_state=False), \
        (), True
    yield "fused_recurrent_kda_fwd[in place]", ck.fused_recurrent_kda_fwd, dict(x, initial_state=h0.clone()), \
        ("initial_state",), False
    yield "kda_decode", ck.kda_decode, dict(dec, out=torch.zeros_like(tok["v"])), ("state_pool", "out"), False
    yield "kda_decode[step_states]", ck.kda_decode, dict(dec, step_states=steps), ("state_pool", "step_states"), \
        False
    yield "kda_decode_step", _kda_step, dec, ("state_pool",), False
    yield "kda_commit_accepted", ck.kda_commit_accepted, dict(
        step_states=steps, state_pool=pool, state_indices=idx, num_accepted_tokens=torch.tensor([2, 1, 0])
    ), ("state_pool",), False  # fmt: skip
    yield "gdn_decode", cg.gdn_decode, gdn_dec, ("state_pool",), False
    yield "gdn_decode_step", _gdn_step, gdn_dec, ("state_pool",), False
    yield "chunk_gated_delta_rule", cg.chunk_gated_delta_rule, dict(
        gdn, use_gate_in_kernel=True, A_log=torch.randn(HV), dt_bias=torch.randn(HV)
    ), (), True  # fmt: skip
    yield "chunk_gated_delta_rule[varlen]", cg.chunk_gated_delta_rule, dict(
        gdn, initial_state=torch.randn(2, HV, K, V), cu_seqlens=cu, cu_seqlens_cpu=cu
    ), (), True  # fmt: skip
    yield "fused_recurrent_gated_delta_rule", cg.fused_recurrent_gated_delta_rule, dict(
        gdn, gk=x["g"], gv=torch.nn.functional.logsigmoid(torch.randn(B, T, HV, V))
    ), (), True  # fmt: skip
    yield "chunk_simple_gla", cs.chunk_simple_gla, gla, (), True
    yield "chunk_simple_gla[g, varlen]", cs.chunk_simple_gla, dict(
        qkv, g=gs, initial_state=torch.randn(2, HV, K, V), output_final_state=True, cu_seqlens=cu
    ), (), True  # fmt: skip
    yield "fused_recurrent_simple_gla", cs.fused_recurrent_simple_gla, dict(gla, reverse=True), (), True
    yield "lightning_attn_fwd", cl.lightning_attn_fwd, dict(gla, decay=-gla.pop("g_gamma")), (), True
    yield "chunk_lightning_attn", cl.chunk_lightning_attn, dict(mh, layer_idx=1, num_layers=4), (), True
    yield "fused_recurrent_lightning_attn", cl.fused_recurrent_lightning_attn, dict(mh, layer_idx=1, num_layers=4), \
        (), True
    light = {n: dec[n] for n in ("q", "k", "v", "state_pool", "state_indices")}
    yield "lightning_decode", cl.lightning_decode, dict(light, decay=torch.rand(HV)), ("state_pool",), False
    yield "lightning_decode_step", _lightning_step, dict(light, decay=torch.rand(HV)), ("state_pool",), False


def _run_with(fn, kwargs, writes, strided, grads):
    """``fn`` on fresh copies of ``kwargs``' tensors (those it only reads strided in their last dimension when
    ``strided``): its outputs, the tensors it wrote, and with ``grads`` the gradients of the floating inputs."""
    call, leaves = {}, {}
    for n, t in kwargs.items():
        if isinstance(t, torch.Tensor):
            t = t.clone()
            if strided and n not in writes and t.shape[-1] > 1 and n != "cu_seqlens_cpu":
                t = _strided_last(t)
                assert t.stride(-1) == 2
            if grads and t.is_floating_point() and n not in writes:
                leaves[n] = t.requires_grad_()
        call[n] = t
    out = fn(**call)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)]
    found = []
    if grads:
        gen = torch.Generator().manual_seed(1)
        loss = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs)
        found = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return [o.detach() for o in outs], [call[n] for n in writes], found


@pytest.mark.parametrize("case", list(_strided_cases()), ids=lambda c: c[0])
def test_inputs_strided_in_their_last_dimension_are_copied(case):
    """FLA's wrappers make every tensor argument contiguous (``input_guard``): such a view (e.g. the heads of a
    ``[B, D, T]`` conv1d output) is valid input, and cula copies the tensors a call only reads, with the contiguous
    call's outputs, writes and gradients (twice: the plan caches keep the strided signature's own plan)."""
    _, fn, kwargs, writes, grads = case
    for _ in range(2):
        want = _run_with(fn, kwargs, writes, strided=False, grads=grads)
        got = _run_with(fn, kwargs, writes, strided=True, grads=grads)
        for a, b in zip(want, got, strict=True):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert (x is None and y is None) or torch.equal(x, y)
    if grads:  # the gradients are the strided inputs' own (a copy autograd records)
        assert any(t is not None for t in got[2])


@pytest.mark.parametrize(
    "case",
    [c for c in _strided_cases() if not any(w in c[0] for w in ("varlen", "decode", "step", "commit"))],
    ids=lambda c: c[0],
)
def test_empty_inputs_strided_in_their_last_dimension_are_copied(case):
    """The same with no tokens: torch calls an empty tensor contiguous whatever its strides, so such a view passed
    the copy and was refused by the stride check."""
    _, fn, kwargs, writes, grads = case
    kwargs = {n: t[:, :0] if isinstance(t, torch.Tensor) and t.dim() > 2 and t.shape[1] == T else t
              for n, t in kwargs.items()}  # fmt: skip
    want = _run_with(fn, kwargs, writes, strided=False, grads=False)
    got = _run_with(fn, kwargs, writes, strided=True, grads=False)
    for a, b in zip(want, got, strict=True):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_written_tensors_strided_in_their_last_dimension_are_refused():
    """A tensor a call writes is never copied (the write would be lost): one strided in its last dimension is
    refused by name, before anything runs."""
    x = kda_inputs(B=3, T=1)
    pool, idx = torch.randn(5, HV, V, K), torch.tensor([4, -1, 0], dtype=torch.int32)
    before = pool.clone()
    with pytest.raises(ValueError, match="`out` must be contiguous in its last dimension"):
        ck.kda_decode(**x, state_pool=pool, state_indices=idx, A_log=torch.randn(HV),
                      out=_strided_last(torch.zeros_like(x["v"])))  # fmt: skip
    with pytest.raises(ValueError, match="`state_pool` must be contiguous in its last dimension"):
        ck.kda_decode(**x, state_pool=_strided_last(pool), state_indices=idx, A_log=torch.randn(HV))
    with pytest.raises(ValueError, match="`step_states` must be contiguous in its last dimension"):
        ck.kda_decode(**x, state_pool=pool, state_indices=idx, A_log=torch.randn(HV),
                      step_states=_strided_last(torch.zeros(3, 1, HV, V, K)))  # fmt: skip
    with pytest.raises(ValueError, match="`state_pool` must be contiguous in its last dimension"):
        cl.lightning_decode(x["q"], x["k"], x["v"], torch.rand(HV), _strided_last(pool), idx)
    with pytest.raises(ValueError, match="`initial_state` must be contiguous in its last dimension"):
        ck.fused_recurrent_kda_fwd(**x, initial_state=_strided_last(torch.randn(3, HV, K, V)))
    with pytest.raises(ValueError, match="`state_pool` must be contiguous in its last dimension"):
        ck.kda_commit_accepted(torch.randn(3, 1, HV, V, K), _strided_last(pool), idx, torch.ones(3, dtype=torch.int32))
    assert torch.equal(pool, before)


# ---------------------------------------------------------------- backend selection


def test_cpu_runs_reference_and_logs_once(caplog):
    x = kda_inputs()
    with caplog.at_level(logging.INFO, logger="cula"):
        ck.chunk_kda(**x)
        ck.chunk_kda(**x)
    lines = [r.getMessage() for r in caplog.records if "kda.chunk_kda" in r.getMessage()]
    assert len(lines) <= 1
    assert chunk_kda_registry.select(x["q"].device, dict(x, cp_context=None)).name == "reference"


def test_forced_backend(monkeypatch):
    x = kda_inputs()
    monkeypatch.setenv("CULA_BACKEND", "fla")
    with pytest.raises(BackendUnavailableError, match="CULA_BACKEND='fla' cannot run kda.chunk_kda: needs a CUDA"):
        ck.chunk_kda(**x)
    monkeypatch.setenv("CULA_BACKEND", "nonsense")
    with pytest.raises(BackendUnavailableError, match="not a backend of kda.chunk_kda"):
        ck.chunk_kda(**x)
    monkeypatch.setenv("CULA_BACKEND", "reference")
    o, _ = ck.chunk_kda(**x)
    assert o.shape == x["v"].shape


def test_reference_declines_fla_only_features():
    x = kda_inputs()
    with pytest.raises(BackendUnavailableError, match="cp_context"):
        ck.chunk_kda(**x, cp_context=object())
    with torch.inference_mode():
        with pytest.raises(BackendUnavailableError, match="return_intermediate_states"):
            ck.chunk_kda(**x, return_intermediate_states=True)


# ---------------------------------------------------------------- CPU path


def test_chunk_kda_cpu_matches_float64_reference_and_has_grads():
    from cula.kda.naive import naive_recurrent_kda

    x = kda_inputs(T=37, requires_grad=True)
    h0 = torch.randn(B, HV, K, V, requires_grad=True)
    o, ht = ck.chunk_kda(**x, initial_state=h0, output_final_state=True)
    ro, rt = naive_recurrent_kda(*(x[n].double() for n in ("q", "k", "v", "g", "beta")),
                                 initial_state=h0.double(), output_final_state=True)
    assert o.dtype == x["q"].dtype and ht.dtype == torch.float32
    assert_close("o", ro, o, 1e-5)
    assert_close("ht", rt, ht, 1e-5)
    (o.sum() + ht.sum()).backward()
    for name in ("q", "k", "v", "g", "beta"):
        assert x[name].grad is not None and torch.isfinite(x[name].grad).all(), name
    assert h0.grad is not None


def test_chunk_kda_cpu_state_layout_and_alias():
    x = kda_inputs(T=9)
    h0 = torch.randn(B, HV, K, V)
    o, ht = ck.chunk_kda(**x, initial_state=h0, output_final_state=True)
    o2, ht2 = ck.chunk_kda(**x, initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True,
                           state_v_first=True)
    with pytest.warns(DeprecationWarning):
        o3, ht3 = ck.chunk_kda(**x, initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True,
                               transpose_state_layout=True)
    assert_close("o", o, o2, 1e-6)
    assert_close("ht", ht, ht2.transpose(-1, -2), 1e-6)
    assert torch.equal(o2, o3) and torch.equal(ht2, ht3)


def test_chunk_kda_cpu_varlen_equals_separate_sequences():
    lengths = [0, 1, 7, 12]
    x = kda_inputs(T=sum(lengths))
    cu = make_cu_seqlens(lengths)
    h0 = torch.randn(len(lengths), HV, K, V)
    o, ht = ck.chunk_kda(**x, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        xi = {n: t[:, s:e] for n, t in x.items()}
        oi, hi = ck.chunk_kda(**xi, initial_state=h0[i:i + 1], output_final_state=True)
        assert_close(f"o[{i}]", oi, o[:, s:e], 1e-5)
        assert_close(f"ht[{i}]", hi, ht[i:i + 1], 1e-5)


def test_kda_gate_and_beta_flags_cpu():
    from cula.kda.naive import kda_gate

    x = kda_inputs(T=10)
    raw_g, raw_b = torch.randn(B, T, HV, K)[:, :10], torch.randn(B, 10, HV)
    A_log, dt_bias = torch.randn(HV), torch.randn(HV * K)
    o, _ = ck.chunk_kda(**dict(x, g=raw_g, beta=raw_b), use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                        allow_neg_eigval=True, use_qk_l2norm_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    qn = torch.nn.functional.normalize(x["q"], dim=-1, eps=0)
    kn = torch.nn.functional.normalize(x["k"], dim=-1, eps=0)
    o2, _ = ck.chunk_kda(qn, kn, x["v"], kda_gate(raw_g, A_log, dt_bias), 2 * raw_b.sigmoid())
    assert_close("o", o2, o, 1e-4)


def test_fused_recurrent_kda_cpu_matches_chunk():
    x = kda_inputs(T=13)
    h0 = torch.randn(B, HV, K, V)
    o, ht = ck.chunk_kda(**x, initial_state=h0, output_final_state=True)
    o2, ht2 = ck.fused_recurrent_kda(**x, initial_state=h0, output_final_state=True)
    assert_close("o", o, o2, 1e-5)
    assert_close("ht", ht, ht2, 1e-5)
    pool = h0.clone()
    o3, ht3 = ck.fused_recurrent_kda_fwd(**x, initial_state=pool)
    assert ht3 is pool
    assert_close("pool", ht, pool, 1e-5)


def test_gdn_cpu_is_kda_with_broadcast_gate():
    x = kda_inputs(T=11)
    g = torch.nn.functional.logsigmoid(torch.randn(B, 11, HV))
    o, ht = cg.chunk_gated_delta_rule(x["q"], x["k"], x["v"], g, x["beta"], output_final_state=True)
    o2, ht2 = ck.chunk_kda(**dict(x, g=g[..., None].expand(-1, -1, -1, K).contiguous()), output_final_state=True)
    assert_close("o", o2, o, 1e-5)
    assert_close("ht", ht2, ht, 1e-5)
    o3, ht3 = cg.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g=g, beta=x["beta"],
                                                  output_final_state=True)
    assert_close("o recurrent", o, o3, 1e-5)


def test_gdn_recurrent_per_value_beta_cpu():
    """A beta per value channel (FLA's recurrent form takes [B, T, HV, V]): KDA's recurrent form with the gate
    broadcast over K, which takes it too."""
    x = kda_inputs(T=9)
    g = torch.nn.functional.logsigmoid(torch.randn(B, 9, HV))
    beta = torch.rand(B, 9, HV, x["v"].shape[-1])
    o, ht = cg.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g=g, beta=beta, output_final_state=True)
    o2, ht2 = ck.fused_recurrent_kda(**dict(x, g=g[..., None].expand(-1, -1, -1, K).contiguous(), beta=beta),
                                     output_final_state=True)  # fmt: skip
    assert_close("o", o2, o, 1e-5)
    assert_close("ht", ht2, ht, 1e-5)
    o3, _ = cg.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g=g, beta=beta[..., 0])
    assert (o3 - o).abs().max() > 1e-3, "the per-value beta was read as one a head"


@pytest.mark.parametrize("form", ["gdn_chunk", "gdn_recurrent", "sgla_chunk", "sgla_recurrent", "lightning"])
def test_half_precision_initial_state_read_as_fp32(form):
    """FLA 0.6.0's GDN, Simple GLA and Lightning forms read a bf16 initial state as fp32 (its chunked KDA alone
    asserts fp32): the same outputs as the state cast to fp32, its gradient in bf16."""
    heads = H if form == "lightning" else HV  # (FLA's Lightning wrappers: as many value heads as q / k heads)
    x = kda_inputs(T=9, HV=heads)
    g = torch.nn.functional.logsigmoid(torch.randn(B, 9, heads))
    h0 = torch.randn(B, heads, K, V).bfloat16()

    def run(state):
        kw = dict(initial_state=state, output_final_state=True)
        if form == "gdn_chunk":
            return cg.chunk_gated_delta_rule(x["q"], x["k"], x["v"], g, x["beta"], **kw)
        if form == "gdn_recurrent":
            return cg.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g=g, beta=x["beta"], **kw)
        if form == "sgla_chunk":
            return cs.chunk_simple_gla(x["q"], x["k"], x["v"], g=g, **kw)
        if form == "sgla_recurrent":
            return cs.fused_recurrent_simple_gla(x["q"], x["k"], x["v"], g=g, **kw)
        return cl.chunk_lightning_attn(x["q"], x["k"], x["v"], layer_idx=1, num_layers=4, **kw)

    o, ht = run(h0.float())
    half = h0.clone().requires_grad_(form != "gdn_recurrent")  # (FLA's recurrent GDN is forward-only)
    o2, ht2 = run(half)
    assert ht2.dtype == torch.float32
    assert_close("o", o, o2, 1e-6)
    assert_close("ht", ht, ht2, 1e-6)
    if half.requires_grad:
        o2.sum().backward()
        assert half.grad is not None and half.grad.dtype == torch.bfloat16


def test_simple_gla_as_fla_takes_it():
    """Simple GLA and Lightning as FLA 0.6.0 takes them: any head size (its kernels tile it); g_gamma gets no
    gradient on any backend (FLA's backward returns None there); Lightning's layer arguments as any integer, and
    chunk_lightning_attn's state_v_first / cu_seqlens_cpu handed on."""
    import numpy as np

    q, k, v = (torch.randn(1, 5, 2, 320, requires_grad=True) for _ in range(3))
    g_gamma = torch.tensor([-0.1, -0.5], requires_grad=True)
    o, _ = cs.chunk_simple_gla(q, k, v, g_gamma=g_gamma)
    o.sum().backward()
    assert o.shape == v.shape and g_gamma.grad is None
    x = kda_inputs(T=7, HV=H)
    h0 = torch.randn(B, H, V, K)
    o1, ht1 = cl.chunk_lightning_attn(x["q"], x["k"], x["v"], np.int64(1), torch.tensor(4), initial_state=h0,
                                      output_final_state=True, state_v_first=True)  # fmt: skip
    o2, ht2 = cs.chunk_simple_gla(x["q"], x["k"], x["v"], g_gamma=cl.lightning_g_gamma(H, 1, 4), initial_state=h0,
                                  output_final_state=True, state_v_first=True)  # fmt: skip
    assert torch.equal(o1, o2) and torch.equal(ht1, ht2)
    o3, _ = cl.fused_recurrent_lightning_attn(x["q"], x["k"], x["v"], 4, 4)  # the last layer: no decay
    o4, _ = cs.fused_recurrent_simple_gla(x["q"], x["k"], x["v"])
    assert_close("no decay", o4, o3, 1e-6)


def test_recurrent_kda_softplus_gate_without_A_log():
    """FLA's recurrent kernel reads an absent A_log as a log coefficient of 1 a head (its chunk form refuses the
    call, as cula's chunk_kda does); fused_recurrent_kda_fwd ignores transpose_state_layout, as FLA's does."""
    x = kda_inputs(T=6)
    kw = dict(use_gate_in_kernel=True, output_final_state=True)
    o, ht = ck.fused_recurrent_kda(**x, **kw)
    o2, ht2 = ck.fused_recurrent_kda(**x, A_log=torch.ones(HV), **kw)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
    with pytest.raises(ValueError, match="A_log"):
        ck.chunk_kda(**x, **kw)
    h0 = torch.randn(B, HV, K, V)
    with pytest.warns(UserWarning, match="ignores `transpose_state_layout`"):
        o3, _ = ck.fused_recurrent_kda_fwd(**x, initial_state=h0, inplace_final_state=False, output_final_state=True,
                                           transpose_state_layout=True)  # fmt: skip
    o4, _ = ck.fused_recurrent_kda_fwd(**x, initial_state=h0, inplace_final_state=False, output_final_state=True)
    assert torch.equal(o3, o4)


def test_recurrent_kda_half_state_and_out_on_the_cpu():
    """fused_recurrent_kda reads a bf16 initial_state as fp32, as FLA's recurrent kernel does (its chunk form alone
    asserts fp32); the reference writes a given `out`, as the kernels do."""
    x = kda_inputs(T=5)
    h0 = torch.randn(B, HV, K, V).bfloat16()
    o, ht = ck.fused_recurrent_kda(**x, initial_state=h0.float(), output_final_state=True)
    o2, ht2 = ck.fused_recurrent_kda(**x, initial_state=h0, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(ht, ht2) and ht2.dtype == torch.float32
    out = torch.full_like(x["v"], float("nan"))
    o3, _ = ck.fused_recurrent_kda_fwd(**x, initial_state=h0.float(), inplace_final_state=False,
                                       output_final_state=True, out=out)  # fmt: skip
    assert o3 is out and torch.equal(out, o)
    with pytest.raises(TypeError, match="initial_state"):  # (FLA's chunk_kda asserts fp32)
        ck.chunk_kda(**x, initial_state=h0)


def test_lightning_wrappers_cpu():
    x = kda_inputs(T=21, HV=H)
    q, k, v = x["q"], x["k"], x["v"]
    decay = torch.rand(H)
    o, ht = cl.lightning_attn_fwd(q, k, v, decay, output_final_state=True)
    o2, ht2 = cs.chunk_simple_gla(q, k, v, g_gamma=-decay, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
    g_gamma = cl.lightning_g_gamma(H, 2, 8)
    assert torch.allclose(g_gamma, -(8 / H * (1 - 2 / 8)) * torch.arange(H, dtype=torch.float))
    o3, _ = cl.chunk_lightning_attn(q, k, v, layer_idx=2, num_layers=8)
    o4, _ = cl.fused_recurrent_lightning_attn(q, k, v, layer_idx=2, num_layers=8)
    o5, _ = cs.chunk_simple_gla(q, k, v, g_gamma=g_gamma)
    assert_close("chunk", o5, o3, 1e-6)
    assert_close("recurrent", o5, o4, 1e-5)


def test_kda_decode_validation_and_cpu_path():
    N, T, H, HV, D, P = 3, 2, 2, 4, 16, 6
    q, k = torch.randn(N, T, H, D), torch.randn(N, T, H, D)
    v, g = torch.randn(N, T, HV, D), torch.randn(N, T, HV, D)
    beta, A_log = torch.randn(N, T, HV), torch.randn(HV)
    pool = torch.randn(P, HV, D, D)
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="out of range"):
        ck.kda_decode(q, k, v, g, beta, pool.clone(), torch.tensor([9, 0, 1], dtype=torch.int32), A_log=A_log)
    with pytest.raises(TypeError, match="`state_indices` must have dtype int32"):
        ck.kda_decode(q, k, v, g, beta, pool.clone(), idx.long(), A_log=A_log)
    with pytest.raises(ValueError, match="1..8 tokens"):
        ck.kda_decode(*(t.repeat(1, 5, 1, 1) for t in (q, k, v, g)), beta.repeat(1, 5, 1), pool, idx, A_log=A_log)
    with pytest.raises(ValueError, match="`state_pool` must have shape"):
        ck.kda_decode(q, k, v, g, beta, pool[..., :-1], idx, A_log=A_log)
    new = pool.clone()
    steps = torch.full((N, T, HV, D, D), float("nan"))
    o = ck.kda_decode(q, k, v, g, beta, new, idx, A_log=A_log, step_states=steps)
    assert torch.equal(new, pool), "step_states mode must leave the pool untouched"
    assert torch.equal(o[1], torch.zeros_like(o[1])) and torch.isnan(steps[1]).all()
    o2 = ck.kda_decode(q, k, v, g, beta, new, idx, A_log=A_log)
    assert torch.equal(o, o2)
    assert_close("final", steps[0, -1], new[4], 1e-6)
    assert torch.equal(new[[0, 2, 3, 5]], pool[[0, 2, 3, 5]])
    o_ref, h_ref = ck.fused_recurrent_kda(q[:1], k[:1], v[:1], g[:1], beta[:1], A_log=A_log, initial_state=pool[4:5],
                                          output_final_state=True, use_qk_l2norm_in_kernel=True,
                                          use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                          state_v_first=True)
    assert_close("o", o_ref[0], o[0], 1e-5)
    assert_close("h", h_ref[0], new[4], 1e-5)


def test_kda_commit_accepted_prefix():
    N, T, H, HV, D, P = 4, 3, 2, 2, 8, 7
    q, k = torch.randn(N, T, H, D), torch.randn(N, T, H, D)
    v, g = torch.randn(N, T, HV, D), torch.randn(N, T, HV, D)
    beta, A_log = torch.randn(N, T, HV), torch.randn(HV)
    pool = torch.randn(P, HV, D, D)
    idx = torch.tensor([5, -1, 0, 2], dtype=torch.int32)
    steps = torch.zeros(N, T, HV, D, D)
    ck.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log, step_states=steps)
    accepted = torch.tensor([2, 3, 0, 3])
    new = pool.clone()
    ck.kda_commit_accepted(steps, new, idx, accepted)
    assert torch.equal(new[5], steps[0, 1]) and torch.equal(new[2], steps[3, 2])
    assert torch.equal(new[0], pool[0]), "0 accepted tokens keeps the old state"
    assert torch.equal(new[[1, 3, 4, 6]], pool[[1, 3, 4, 6]])
    # committing the accepted prefix equals decoding only that prefix
    ref = pool.clone()
    ck.kda_decode(q[:1, :2], k[:1, :2], v[:1, :2], g[:1, :2], beta[:1, :2], ref, idx[:1], A_log=A_log)
    assert_close("prefix", ref[5], new[5], 1e-6)
    # no verified token: nothing accepted, every row kept
    ck.kda_commit_accepted(steps[:, :0], new, idx, torch.zeros(N, dtype=torch.int32))
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        ck.kda_commit_accepted(steps[:, :0], new, idx, accepted)


def test_cula_kernel_verifiers_decline_what_the_kernels_do_not_take(pretend_sm90, kda_tuning):
    """On the GPU these decide between our kernels and FLA; the reasons end up in the `cula` log."""
    from cula.kda.backends import _cula_chunk_supports
    from cula.simple_gla.backends import _cula_chunk_supports as lightning_supports

    def kda_args(**over):
        x = kda_inputs(K=128, V=128, dtype=torch.bfloat16)
        base = dict(x, initial_state=None, A_log=None, dt_bias=None, chunk_size=64)
        return {**base, **over}

    assert _cula_chunk_supports(**kda_args()) == (True, None)
    x = kda_inputs(K=128, V=128, dtype=torch.bfloat16, requires_grad=True)
    assert _cula_chunk_supports(**dict(kda_args(), **x)) == (True, None)  # our forward, FLA's backward
    assert "dtype" in _cula_chunk_supports(**kda_args(q=kda_inputs()["q"]))[1]
    assert "head sizes" in _cula_chunk_supports(**kda_args(v=torch.zeros(B, T, HV, 64)))[1]
    assert "chunk_size" in _cula_chunk_supports(**kda_args(chunk_size=32))[1]
    assert not _cula_chunk_supports(**kda_args(cp_context=object()))[0]
    # FLA's intermediate states: on cula's kernels only where the tuning entry says so, its intra kernel runs (a
    # safe gate) and the chunk list comes from the host
    states = kda_args(return_intermediate_states=True, safe_gate=True, use_gate_in_kernel=True, lower_bound=-5.0)
    kda_tuning(intermediate_states=False)
    assert "intermediate_states off" in _cula_chunk_supports(**states)[1]
    kda_tuning(intermediate_states=True)
    assert _cula_chunk_supports(**states) == (True, None)
    assert "graph mode" in _cula_chunk_supports(**dict(states, use_graph=True))[1]
    kda_tuning(intermediate_states=True, intra_any_gate=False)
    assert "unbounded gates" in _cula_chunk_supports(**dict(states, safe_gate=False, lower_bound=None))[1]

    # varlen, odd T, GVA and both state layouts all go to the kernels (confirmed on the H200)
    x = kda_inputs(T=100, HV=2 * H, K=128, V=128, dtype=torch.bfloat16)
    wide = dict(kda_args(), **x, cu_seqlens=make_cu_seqlens([40, 60]))
    assert _cula_chunk_supports(**wide) == (True, None)
    assert _cula_chunk_supports(**dict(wide, state_v_first=True)) == (True, None)

    q = torch.zeros(1, 4, 2, 128, dtype=torch.bfloat16)
    base = dict(q=q, k=q, v=q, g=None, g_gamma=torch.zeros(2), initial_state=None)
    assert lightning_supports(**base) == (True, None)
    assert "data-dependent" in lightning_supports(**dict(base, g=torch.zeros(1, 4, 2)))[1]
    assert "dtype" in lightning_supports(**dict(base, q=q.float(), k=q.float(), v=q.float()))[1]


@pytest.mark.parametrize("K, V", [(256, 512), (64, 1024), (300, 300)], ids=["fla-gdn-layer", "wide-v", "k-300"])
def test_head_sizes_fla_takes(K, V):
    """FLA's chunked delta-rule kernels assert K <= 256 and block any V (its default GatedDeltaNet layer has K = 256,
    V = 512); its recurrent kernels take any K. The chunked and recurrent forms agree where both run."""
    torch.manual_seed(0)
    q, k = (torch.randn(1, 9, 1, K) for _ in range(2))
    v, beta = torch.randn(1, 9, 1, V), torch.rand(1, 9, 1)
    g = torch.nn.functional.logsigmoid(torch.randn(1, 9, 1, K))
    forms = ((ck.chunk_kda, ck.fused_recurrent_kda, g),
             (cg.chunk_gated_delta_rule, cg.fused_recurrent_gated_delta_rule, g[..., 0]))
    for chunk, recurrent, gate in forms:
        o, ht = recurrent(q, k, v, gate, beta=beta, use_qk_l2norm_in_kernel=True, output_final_state=True)
        assert o.shape == v.shape and ht.shape == (1, 1, K, V)
        if K > 256:
            with pytest.raises(ValueError, match="K=300"):
                chunk(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True)
            continue
        oc, htc = chunk(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True, output_final_state=True)
        assert_close("o", o, oc, 1e-5)
        assert_close("ht", ht, htc, 1e-5)


@pytest.mark.parametrize("T_", [0, 70], ids=["no-tokens", "T70"])
def test_outputs_are_row_major_and_recorded(T_):
    """o is row-major as FLA's (``o.view(B, T, -1)`` works), and with no tokens still recorded by autograd on the
    token inputs, as FLA's is (``o.sum().backward()`` works; the gradients are empty)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, T_, 2, 16, requires_grad=True) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(2, T_, 2, 16)).requires_grad_()
    beta = torch.rand(2, T_, 2).requires_grad_()
    calls = {
        "chunk_kda": lambda: ck.chunk_kda(q, k, v, g, beta),
        "fused_recurrent_kda": lambda: ck.fused_recurrent_kda(q, k, v, g, beta),
        "chunk_gated_delta_rule": lambda: cg.chunk_gated_delta_rule(q, k, v, g[..., 0], beta),
        "chunk_simple_gla": lambda: cs.chunk_simple_gla(q, k, v, g[..., 0]),
        "chunk_lightning_attn": lambda: cl.chunk_lightning_attn(q, k, v, layer_idx=1, num_layers=4),
    }
    for name, call in calls.items():
        o = call()[0]
        assert o.is_contiguous() and o.shape == v.shape, name
        q.grad = None
        o.sum().backward()
        assert q.grad is not None and q.grad.shape == q.shape, name


def test_g_gamma_of_any_shape_of_its_size():
    """FLA's Simple GLA kernels index g_gamma flat, so [1, HV] passes there, as A_log of any shape does."""
    q = torch.randn(1, 9, 2, 16)
    g_gamma = -torch.rand(2)
    for fn in (cs.chunk_simple_gla, cs.fused_recurrent_simple_gla):
        assert torch.equal(fn(q, q, q, g_gamma=g_gamma)[0], fn(q, q, q, g_gamma=g_gamma[None])[0])
    with pytest.raises(ValueError, match="`g_gamma` must have shape"):
        cs.chunk_simple_gla(q, q, q, g_gamma=g_gamma[None].expand(3, 2))


def test_host_copy_of_cu_seqlens_must_match_on_the_cpu():
    """Where cu_seqlens itself is on the host, a cu_seqlens_cpu that differs is refused (free to compare there)."""
    q, g, beta = torch.randn(1, 30, 2, 16), -torch.rand(1, 30, 2, 16), torch.rand(1, 30, 2)
    cu = torch.tensor([0, 10, 30])
    for _ in range(2):  # the second call of each goes through the first's plan
        ck.chunk_kda(q, q, q, g, beta, cu_seqlens=cu, cu_seqlens_cpu=cu.clone())
        with pytest.raises(ValueError, match="`cu_seqlens_cpu` must equal `cu_seqlens`"):
            ck.chunk_kda(q, q, q, g, beta, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 20, 30]))


def test_cula_kernels_decline_head_sizes_only_validation_now_allows(monkeypatch):
    """Validation takes any V (and any K in the recurrent forms), as FLA does: every cula-sm90 verifier must then
    decline such a call (so FLA's kernel or the reference runs it), whatever else about it would suit the kernels."""
    from cula.backends import Registry

    seen = []
    select = Registry.select

    def spy(self, device, args, skip=()):
        seen.append((self, dict(args)))
        return select(self, device, args, skip)

    monkeypatch.setattr(Registry, "select", spy)
    bf = torch.bfloat16
    for K, V in ((128, 512), (128, 256), (300, 128)):
        x = {n: t.to(bf) if t.is_floating_point() else t for n, t in kda_inputs(K=K, V=V).items()}
        x["beta"] = x["beta"].float()
        pool, idx = torch.zeros(3, HV, V, K), torch.tensor([0, 2], dtype=torch.int32)
        one = {n: t[:1, :1].expand(2, 1, *t.shape[2:]).contiguous() for n, t in x.items()}
        calls = [
            lambda: ck.fused_recurrent_kda(**x),
            lambda: ck.fused_recurrent_kda_fwd(**one, initial_state=pool.clone(), ssm_state_indices=idx,
                                               inplace_final_state=True, state_v_first=True),  # fmt: skip
            lambda: cg.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"][..., 0].float(), beta=x["beta"]),
            lambda: cs.chunk_simple_gla(x["q"], x["k"], x["v"], g_gamma=-torch.rand(HV)),
        ]
        if K <= 256:  # (the chunked forms' limit, FLA's; kda_decode and lightning_decode keep it too)
            calls += [
                lambda: ck.kda_decode(*(one[n] for n in ("q", "k", "v", "g", "beta")), pool.clone(), idx,
                                      A_log=torch.randn(HV), dt_bias=torch.randn(HV * K)),  # fmt: skip
                lambda: cl.lightning_decode(one["q"], one["k"], one["v"], torch.rand(HV), pool.clone(), idx),
                lambda: ck.chunk_kda(**x),
                lambda: cg.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"][..., 0].float(), x["beta"]),
            ]
        for call in calls:
            seen.clear()
            call()
            assert seen, "no registry selected a backend"
            for registry, args in seen:
                for backend in registry._backends:
                    if backend.name == "cula-sm90":
                        ok, why = backend.supports(**args)
                        assert not ok and why, (registry.op, K, V)


def test_autocast_leaves_cula_maths_in_its_own_dtype():
    """FLA's Triton kernels ignore torch.autocast; so do cula's PyTorch maths (the reference, and the gated
    chunk_bwd_dqkwg stage FLA's dispatch hands cula inside FLA's backwards, which re-enter the forward's autocast
    state): the same bits with and without it, as a compiled call gives."""
    from cula.common.chunk_o import chunk_bwd_dqkwg

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 70, 2, 32) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, 70, 2, 32))
    beta = torch.rand(1, 70, 2)
    pool, idx = torch.randn(3, 2, 32, 32), torch.tensor([2, 0], dtype=torch.int32)
    one = [t[:, :1].expand(2, 1, *t.shape[2:]).contiguous() for t in (q, k, v, g, beta)]
    h, dh = torch.randn(1, 2, 2, 32, 32), torch.randn(1, 2, 2, 32, 32)
    calls = {
        "chunk_kda": lambda: ck.chunk_kda(q, k, v, g, beta, output_final_state=True),
        "chunk_gated_delta_rule": lambda: cg.chunk_gated_delta_rule(q, k, v, g[..., 0], beta, output_final_state=True),
        "chunk_simple_gla": lambda: cs.chunk_simple_gla(q, k, v, g[..., 0], output_final_state=True),
        "fused_recurrent_kda": lambda: ck.fused_recurrent_kda(q, k, v, g, beta, output_final_state=True),
        "kda_decode": lambda: (ck.kda_decode(*one, pool.clone(), idx, A_log=torch.randn(2)),),
        # (by keyword, as FLA's backwards call it)
        "chunk_bwd_dqkwg": lambda: chunk_bwd_dqkwg(q=q, k=k, v=v, do=v, h=h, dh=dh, g=g[..., 0].cumsum(1)),
    }
    torch.manual_seed(1)
    for name, call in calls.items():
        torch.manual_seed(1)
        want = call()
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = call()
        for a, b in zip(want, got):
            assert (a is None and b is None) or torch.equal(a, b), name
