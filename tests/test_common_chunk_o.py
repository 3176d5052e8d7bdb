"""``cula.common.chunk_o.chunk_bwd_dqkwg`` (FLA's gated dq / dk / dw / dg stage in torch's matrix products)
and its place in FLA 0.6.0's dispatch.

CPU: against the float64 contract ``chunk_bwd_dqkwg_reference`` (itself FLA's kernel under Triton's
interpreter, ``tests/test_gdn_naive_bwd.py``) with dw, GVA and odd lengths, [V, K] states, packed batches with
empty and length-1 sequences (with and without FLA's chunk list), the constant-decay and ungated forms, bf16
inputs; the verifier of cula's FLA backend takes exactly the gated calls FLA's Triton kernel refuses. GPU
(``-m gpu``): FLA's own ``chunk_gated_delta_rule`` and ``chunk_simple_gla`` (data-dependent ``g``) training on
the H200 with cula imported, against float64 references: FLA alone raises there (issue #640).
"""

from __future__ import annotations

import fla.backends as fla_backends
import pytest
import torch
from test_gdn_naive_bwd import _dqkwg_case

import cula  # noqa: F401  (registers with FLA's dispatch)
from cula.common.chunk_o import chunk_bwd_dqkwg
from cula.gated_delta_rule.naive_bwd import chunk_bwd_dqkwg_reference
from cula.testing import assert_close

CASES = {  # B, T, H, HV, K, V, packed lengths, state_v_first, gate, with dw
    "gated-dw-gva-odd": (1, 100, 2, 4, 128, 128, None, False, "g", True),
    "gated-vk-B2": (2, 130, 2, 2, 64, 32, None, True, "g", False),
    "gated-packed-empty-len1": (1, 0, 1, 2, 32, 32, [70, 0, 1, 64, 129], False, "g", True),
    "gamma": (2, 70, 1, 1, 32, 32, None, False, "gamma", False),
    "ungated-packed-vk": (1, 0, 1, 2, 32, 32, [5, 64, 65], True, None, True),
}  # fmt: skip


def _case(name, dtype=torch.float32, seed=0):
    args = list(CASES[name])
    if args[6]:
        args[1] = sum(args[6])
    case = _dqkwg_case(*args, seed=seed)
    for n in ("q", "k", "v", "do", "h", "dh", "w", "dv"):
        if case.get(n) is not None:
            case[n] = case[n].to(dtype)
    return case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", CASES)
def test_matches_the_contract(name, dtype):
    case = _case(name, dtype)
    ref = chunk_bwd_dqkwg_reference(**case, chunk_size=64)
    ours = chunk_bwd_dqkwg(**case, chunk_size=64)
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the outputs' own rounding
    for label, r, o in zip(("dq", "dk", "dw", "dg"), ref, ours):
        assert (r is None) == (o is None), label
        if r is None:
            continue
        assert o.dtype == r.dtype and o.shape == r.shape, label
        assert not o.isnan().any(), label
        assert_close(label, r, o, tol)


@pytest.mark.parametrize("name", ["gated-dw-gva-odd", "gated-packed-empty-len1"])
def test_strong_gates_with_partial_chunks_stay_finite(name):
    """Gates of up to -10 a token (chunk-local cumsums down to -640, base 2) with chunks that end inside a
    sequence's last 64 rows: a padded row must never meet a real one in 2^(g_i - g_j) (0 * inf)."""
    case = _case(name)
    case["g"] = case["g"] * 20
    ref = chunk_bwd_dqkwg_reference(**case, chunk_size=64)
    ours = chunk_bwd_dqkwg(**case, chunk_size=64)
    for label, r, o in zip(("dq", "dk", "dw", "dg"), ref, ours):
        if r is not None:
            assert not o.isnan().any(), label
            assert_close(label, r, o, 1e-5)


def test_takes_fla_chunk_list_and_refuses_mismatched_states():
    from fla.ops.utils.index import prepare_chunk_indices

    case = _case("gated-packed-empty-len1")
    listed = chunk_bwd_dqkwg(**case, chunk_indices=prepare_chunk_indices(case["cu_seqlens"], 64))
    for a, b in zip(listed, chunk_bwd_dqkwg(**case)):
        assert torch.equal(a, b)
    case["h"], case["dh"] = case["h"][:, :-1], case["dh"][:, :-1]
    with pytest.raises(ValueError, match="chunk states"):
        chunk_bwd_dqkwg(**case)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda c: c.update(dh=c["dh"][:, :-1]), ValueError, "`dh` must have shape"),
        (lambda c: c.update(h=c["h"].transpose(-1, -2)[..., :8, :]), ValueError, "`h` must have shape"),
        (lambda c: c.update(do=c["do"][..., :8]), ValueError, "`do` must have shape"),
        (lambda c: c.update(g=c["g"][..., :1]), ValueError, "`g` must have shape"),
        (lambda c: c.update(dv=None), ValueError, "`w` needs `dv`"),
        (lambda c: c.update(dv=c["dv"].int()), TypeError, "`dv` must have dtype"),
        (lambda c: c.update(k=c["k"][..., :8]), ValueError, "`k` must have shape"),
        (lambda c: c.update(cu_seqlens=c["cu_seqlens"].float()), TypeError, "`cu_seqlens` must have dtype"),
        (lambda c: c.update(chunk_size=0), ValueError, "`chunk_size`"),
        (lambda c: c.update(scale=float("nan")), ValueError, "`scale` must be finite"),
    ],
)
def test_refuses_bad_arguments_by_name(change, error, match):
    case = _case("gated-packed-empty-len1")
    change(case)
    with pytest.raises(error, match=match):
        chunk_bwd_dqkwg(**case)


@pytest.fixture
def hopper_with_refused_triton(monkeypatch):
    """What FLA sees on the H200 with PyTorch 2.11's Triton (3.6.0): its gated stage refuses; no TileLang."""
    import fla.utils

    from cula import _fla_backend

    monkeypatch.setattr(fla.utils, "IS_NVIDIA_HOPPER", True)
    monkeypatch.setattr(fla.utils, "TRITON_ABOVE_3_4_0", True)
    monkeypatch.setattr(fla.utils, "TRITON_ABOVE_3_7_1", False)
    monkeypatch.setattr(_fla_backend, "_tilelang_takes", lambda args, kwargs: False)
    monkeypatch.setenv("FLA_CULA", "1")


def test_fla_dispatch_hands_cula_the_refused_calls(hopper_with_refused_triton, monkeypatch):
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg as fla_chunk_bwd_dqkwg

    from cula import _fla_backend

    backend = fla_backends._operation_registries["common"]._backends["cula"]
    case = _case("gated-dw-gva-odd")
    assert backend.verify("chunk_bwd_dqkwg", **case) == (True, None)
    # FLA's own function, dispatched: cula's stage runs it (FLA's kernel would raise, or cannot run here)
    for a, b in zip(fla_chunk_bwd_dqkwg(**case), chunk_bwd_dqkwg_reference(**case)):
        assert_close("fla dispatched", b, a, 1e-5)
    ok, why = backend.verify("chunk_bwd_dqkwg", **_case("gamma"))
    assert not ok and "ungated" in why
    ok, why = backend.verify("chunk_bwd_dqkwg", **case, bogus=1)
    assert not ok and "bogus" in why
    monkeypatch.setattr(_fla_backend, "_tilelang_takes", lambda args, kwargs: True)
    ok, why = backend.verify("chunk_bwd_dqkwg", **case)
    assert not ok and "TileLang" in why


def test_tilelang_is_asked_about_the_call(monkeypatch):
    """cula steps aside only for calls FLA's registered TileLang backend takes: its verifier refuses Simple GLA's
    fp32 states with 16-bit q, which cula's stage then runs (FLA would raise its #640 error)."""
    from cula import _fla_backend

    class TileLang:
        is_available = staticmethod(lambda: True)
        is_enabled = staticmethod(lambda: True)

        @staticmethod
        def verify(name, *args, h=None, q=None, **kwargs):
            return (h.dtype == q.dtype, None)

    monkeypatch.setitem(fla_backends._operation_registries["common"]._backends, "tilelang", TileLang())
    case = _case("gated-dw-gva-odd", dtype=torch.bfloat16)
    assert _fla_backend._tilelang_takes((), case)
    assert not _fla_backend._tilelang_takes((), dict(case, h=case["h"].float()))


def test_fla_keeps_the_calls_its_triton_runs(monkeypatch):
    import fla.utils

    monkeypatch.setattr(fla.utils, "TRITON_ABOVE_3_7_1", True)
    backend = fla_backends._operation_registries["common"]._backends["cula"]
    ok, why = backend.verify("chunk_bwd_dqkwg", **_case("gated-vk-B2"))
    assert not ok and "correct" in why


def _train(fn, x, **flags):
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    o, ht = fn(**leaves, **flags)
    gen = torch.Generator().manual_seed(7)
    loss = (o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum()
    dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(ht.device)
    loss = loss + (ht.double() * dht).sum()
    loss.backward()
    return o, ht, {n: t.grad for n, t in leaves.items()}


def _check(label, ref, ours, tols):
    (o_r, ht_r, g_r), (o, ht, g) = ref, ours
    assert not o.isnan().any() and not ht.isnan().any()
    assert_close(f"{label} o", o_r, o.cpu(), 5e-3)
    assert_close(f"{label} final state", ht_r, ht.cpu(), 5e-3)
    for name, tol in tols.items():
        assert not g[name].isnan().any(), name
        assert_close(f"{label} d{name}", g_r[name], g[name].cpu(), tol)


def _gpu_inputs(B, T, H, HV, D, gen):
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=rnd(B, T, H, D), k=rnd(B, T, H, D), v=rnd(B, T, HV, D),
                g=torch.nn.functional.logsigmoid(rnd(B, T, HV) + 3), h0=rnd(B, HV, D, D) * 0.1)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "packed"])
def test_fla_trains_gated_delta_rule_and_simple_gla_on_hopper_cuda(packed, monkeypatch):
    """FLA's own ``chunk_gated_delta_rule`` and ``chunk_simple_gla(g=...)`` with autograd on the H200, cula
    imported (its FLA backend on, as by default): every gradient against the float64 references."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    monkeypatch.setenv("FLA_CULA", "1")  # the default outside the tests (conftest turns it off)
    import inspect

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as dispatched
    from fla.ops.simple_gla import chunk_simple_gla

    # FLA's own body (its dispatch would hand the whole call to cula's backend): FLA's stages, cula's gated one
    chunk_gated_delta_rule = inspect.unwrap(dispatched)

    from cula.gated_delta_rule.naive import reference_chunk_gated_delta_rule
    from cula.simple_gla.naive import naive_recurrent_simple_gla
    from cula.testing import make_cu_seqlens

    gen = torch.Generator().manual_seed(0)
    lens = [300, 1, 0, 129] if packed else None
    B, T = (1, sum(lens)) if packed else (2, 200)
    x = _gpu_inputs(B, T, 2, 2, 128, gen)
    N = len(lens) if packed else B
    x["h0"] = torch.randn(N, 2, 128, 128, generator=gen) * 0.1
    cu = make_cu_seqlens(lens) if packed else None
    cu_gpu = None if cu is None else cu.cuda()
    beta = torch.rand(B, T, 2, generator=gen)
    def to_gpu(d, dt):
        return {n: t.to("cuda", dt if n in ("q", "k", "v") else torch.float32) for n, t in d.items()}


    gdn = dict(x, beta=beta)
    gdn_cpu = {n: (t.bfloat16().double() if n in ("q", "k", "v") else t.double()) for n, t in gdn.items()}
    kw = dict(scale=0.125, output_final_state=True, use_qk_l2norm_in_kernel=True)

    def fla_gdn(h0, **t):
        return chunk_gated_delta_rule(**t, initial_state=h0, cu_seqlens=cu_gpu, **kw)

    def ref_gdn(h0, **t):
        return reference_chunk_gated_delta_rule(**t, initial_state=h0, cu_seqlens=cu,
                                                compute_dtype=torch.float64, **kw)  # fmt: skip

    tols = {"q": 8e-3, "k": 8e-3, "v": 8e-3, "g": 2e-2, "beta": 2e-2, "h0": 8e-3}
    _check("gdn", _train(ref_gdn, gdn_cpu), _train(fla_gdn, to_gpu(gdn, torch.bfloat16)), tols)

    sgla_cpu = {n: (t.bfloat16().double() if n in ("q", "k", "v") else t.double()) for n, t in x.items()}
    kw = dict(scale=0.125, output_final_state=True)

    def fla_sgla(h0, **t):
        return chunk_simple_gla(**t, initial_state=h0, cu_seqlens=cu_gpu, **kw)

    def ref_sgla(h0, **t):
        return naive_recurrent_simple_gla(**t, initial_state=h0, cu_seqlens=cu, compute_dtype=torch.float64,
                                          **kw)  # fmt: skip

    tols = {"q": 8e-3, "k": 8e-3, "v": 8e-3, "g": 2e-2, "h0": 8e-3}
    _check("simple_gla", _train(ref_sgla, sgla_cpu), _train(fla_sgla, to_gpu(x, torch.bfloat16)), tols)
