"""CUDA path of every public function against FLA 0.6.0's Triton kernels and our float64 references.

Whatever backend the registry picks (our kernels where they cover the arguments, FLA otherwise) must
match the float64 reference within FLA's tolerances (relative RMSE 5e-3 for o and the final state, 8e-3 for
dq / dk / dv / dh0, 2e-2 for the gate, beta, A_log and dt_bias gradients), and FLA where FLA has the call.
Every uninitialised allocation starts as NaN (tests/conftest.py), so an output element nobody writes fails.
"""

import os

import pytest
import torch

from cula.testing import assert_close, assert_rows_rewritten, make_cu_seqlens

pytestmark = pytest.mark.gpu
os.environ.setdefault("FLA_FLASH_KDA", "0")
DEV = "cuda"
TOL = 5e-3

# (B, T, H, HV, D, lengths)
# Few distinct (H, HV, D, varlen) combinations: FLA autotunes its Triton kernels once per combination,
# which dominates the run time on a fresh GPU machine.
CASES = [
    (2, 63, 2, 2, 128, None),
    (1, 1000, 2, 4, 128, None),
    (1, 0, 2, 2, 128, [0, 1, 63, 300, 64, 129]),
]


def _ids(c):
    B, T, H, HV, D, lens = c
    return f"B{B}-T{T}-H{H}-HV{HV}-D{D}" + ("-varlen" if lens else "")


def _inputs(B, T, H, HV, D, lens, dtype=torch.bfloat16):
    if lens:
        B, T = 1, sum(lens)
    q = torch.randn(B, T, H, D, device=DEV, dtype=dtype)
    k = torch.randn(B, T, H, D, device=DEV, dtype=dtype)
    v = torch.randn(B, T, HV, D, device=DEV, dtype=dtype)
    cu = make_cu_seqlens(lens, device=DEV) if lens else None
    N = len(lens) if lens else B
    return q, k, v, cu, N


def _f64(*ts):
    return [None if t is None else t.double() for t in ts]


def _inference_vs_fla_and_ref(case, state_v_first=False, dtype=torch.bfloat16, safe_gate=True):
    """cula.kda.chunk_kda with the benchmark's inference flags (fused gate, l2norm, beta sigmoid) against FLA's
    chunk_kda and the float64 recurrence; returns cula's ``(o, ht)`` and a function that runs the call again."""
    import fla.ops.kda as fk

    import cula.kda as ck
    from cula.kda.naive import kda_gate, l2norm, naive_recurrent_kda

    q, k, v, cu, N = _inputs(*case, dtype=dtype)
    B, T, _H, D = q.shape
    HV = v.shape[2]
    g_raw = torch.randn(B, T, HV, D, device=DEV, dtype=dtype)
    beta_raw = torch.randn(B, T, HV, device=DEV, dtype=torch.float32)
    A_log = torch.randn(HV, device=DEV) * 0.5
    dt_bias = torch.randn(HV * D, device=DEV) * 0.5
    h0 = torch.randn(N, HV, D, D, device=DEV) * 0.1
    kw = {"scale": None, "output_final_state": True, "use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True,
          "use_beta_sigmoid_in_kernel": True, "safe_gate": safe_gate, "lower_bound": -5.0,
          "state_v_first": state_v_first, "cu_seqlens": cu, "A_log": A_log, "dt_bias": dt_bias}
    if cu is not None and state_v_first:
        # with its host copy a packed call takes cula's varlen plan, without it the general path: the two state
        # layouts cover one each
        kw["cu_seqlens_cpu"] = cu.cpu()

    def run():
        with torch.inference_mode():
            return ck.chunk_kda(q, k, v, g_raw, beta_raw, initial_state=h0, **kw)

    o, ht = run()
    with torch.inference_mode():
        o_fla, ht_fla = fk.chunk_kda(q, k, v, g_raw, beta_raw, initial_state=h0, **kw)
    g = kda_gate(g_raw.double(), A_log.double(), dt_bias.double(), lower_bound=-5.0)
    h0_kv = h0.transpose(-1, -2) if state_v_first else h0
    ro, rt = naive_recurrent_kda(l2norm(q.double()), l2norm(k.double()), v.double(), g, beta_raw.double().sigmoid(),
                                 initial_state=h0_kv.double(), output_final_state=True, cu_seqlens=cu)
    rt = rt.transpose(-1, -2) if state_v_first else rt
    assert_close("o vs ref", ro, o, TOL)
    assert_close("ht vs ref", rt, ht, TOL)
    assert_close("o vs fla", o_fla, o, TOL)
    assert_close("ht vs fla", ht_fla, ht, TOL)
    assert_close("fla o vs ref", ro, o_fla, TOL)
    assert_close("fla ht vs ref", rt, ht_fla, TOL)
    return o, ht, run


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("state_v_first", [False, True])
def test_chunk_kda_cuda(case, state_v_first):
    o, ht, run = _inference_vs_fla_and_ref(case, state_v_first)
    o2, ht2 = run()
    assert torch.equal(o, o2) and torch.equal(ht, ht2), "results differ between identical runs"


@pytest.mark.parametrize("case", [(2, 300, 2, 4, 128, None), (1, 0, 2, 2, 128, [0, 1, 63, 300, 64])], ids=_ids)
def test_chunk_kda_fp16_cuda(case, monkeypatch):
    """fp16 q/k/v on the cula-sm90 kernels against FLA's fp16 chunk_kda and the float64 recurrence."""
    from cula.backends import clear_plan_caches

    monkeypatch.setenv("CULA_BACKEND", "cula-sm90")  # raise rather than fall back
    monkeypatch.setenv("CULA_KDA_INTRA", "1")
    clear_plan_caches()
    o, _ht, _run = _inference_vs_fla_and_ref(case, dtype=torch.float16)
    clear_plan_caches()
    assert o.dtype == torch.float16


@pytest.mark.parametrize("case", [(2, 300, 2, 4, 128, None), (1, 0, 2, 2, 128, [0, 1, 63, 300, 64])], ids=_ids)
def test_chunk_kda_lower_bound_gate_without_safe_gate_cuda(case):
    """The fused lower-bound gate without ``safe_gate`` (its gates lie in ``[lower_bound, 0)`` anyway) runs on cula's
    intra kernel, against FLA's non-safe intra stages and the float64 recurrence."""
    from cula.kda.plan import use_cula_intra

    q = torch.empty(1, 1, 1, 128, device=DEV, dtype=torch.bfloat16)
    assert use_cula_intra(q, q, safe_gate=False, use_gate_in_kernel=True, lower_bound=-5.0)
    _inference_vs_fla_and_ref(case, state_v_first=True, safe_gate=False)


# FLA's training tolerances, per gradient, against the float64 reference and between cula and FLA
GRAD_TOL = {"q": 8e-3, "k": 8e-3, "v": 8e-3, "g": 2e-2, "beta": 2e-2, "A_log": 2e-2, "dt_bias": 2e-2,
            "initial_state": 8e-3}  # fmt: skip


def _grads(fn, leaves, cotangents, dtype=None, **kw):
    """``fn(**leaves, **kw)`` -> ``(o, ht)`` with every leaf requiring grad (cast to ``dtype`` if given), then
    ``o`` and ``ht`` pulled back along the fixed ``cotangents``; returns ``(o, ht, {leaf: gradient})``.

    Fixed random cotangents (not a loss of the outputs themselves) give every implementation the same backward
    input, so the float64 reference's gradients are exact for the same question. They are bf16 / fp32 values, so
    casting them to o's / ht's dtype changes nothing."""
    x = {n: (t.to(dtype) if dtype is not None else t.clone()).requires_grad_() for n, t in leaves.items()}
    o, ht = fn(**x, **kw)
    do, dht = cotangents
    ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
    return o, ht, {n: t.grad for n, t in x.items()}


def _reference_kda(**kw):
    from cula.kda.naive import reference_chunk_kda

    return reference_chunk_kda(**kw, compute_dtype=torch.float64)


@pytest.mark.parametrize("fused,safe_gate", [(False, False), (True, True), (True, False)],
                         ids=["log-gate", "fused-gate-gva", "fused-gate-gva-unsafe"])  # fmt: skip
def test_chunk_kda_cuda_backward_matches_fla(fused, safe_gate, monkeypatch):
    """Training: our forward kernels and FLA's backward (the stages FLA saves recomputed from the inputs); o, the
    final state and every input gradient against the float64 reference (cula's call and FLA's own alike) and
    against FLA. The fused lower-bound gate with and without ``safe_gate`` (cula's intra kernel and stage 7 either
    way, FLA's two intra paths)."""
    import fla.ops.kda as fk

    import cula.kda as ck
    import cula.kda.backends as kb
    from cula.backends import clear_plan_caches

    clear_plan_caches()
    B, T, H, D = 1, 300, 2, 128
    HV = 2 * H if fused else H
    base = dict(
        q=torch.randn(B, T, H, D, device=DEV, dtype=torch.bfloat16),
        k=torch.randn(B, T, H, D, device=DEV, dtype=torch.bfloat16),
        v=torch.randn(B, T, HV, D, device=DEV, dtype=torch.bfloat16),
        g=torch.nn.functional.logsigmoid(torch.randn(B, T, HV, D, device=DEV)).clamp(min=-5).to(torch.bfloat16),
        beta=torch.rand(B, T, HV, device=DEV, dtype=torch.bfloat16),
    )
    flags = dict(use_qk_l2norm_in_kernel=True)
    if fused:  # the benchmark's flags: raw gate and beta logits, gate parameters with gradients
        base.update(g=torch.randn(B, T, HV, D, device=DEV, dtype=torch.bfloat16),
                    beta=torch.randn(B, T, HV, device=DEV, dtype=torch.bfloat16),
                    A_log=torch.randn(HV, device=DEV) * 0.5, dt_bias=torch.randn(HV * D, device=DEV) * 0.5)
        flags.update(use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=safe_gate, use_beta_sigmoid_in_kernel=True,
                     state_v_first=True)  # fmt: skip
    base["initial_state"] = torch.randn(B, HV, D, D, device=DEV) * 0.1
    cotangents = (torch.randn(B, T, HV, D, device=DEV).to(torch.bfloat16).double(),
                  torch.randn(B, HV, D, D, device=DEV).double())  # fmt: skip
    ran = []
    forward = kb._ChunkKDATraining.forward
    monkeypatch.setattr(kb._ChunkKDATraining, "forward", staticmethod(lambda *a: ran.append(1) or forward(*a)))

    kw = dict(output_final_state=True, **flags)
    o, ht, grads = _grads(ck.chunk_kda, base, cotangents, **kw)
    assert ran == [1]
    o_f, ht_f, grads_f = _grads(fk.chunk_kda, base, cotangents, **kw)
    o_r, ht_r, grads_r = _grads(_reference_kda, base, cotangents, dtype=torch.float64, **kw)
    for who, (o_x, ht_x, grads_x) in (("cula", (o, ht, grads)), ("fla", (o_f, ht_f, grads_f))):
        assert_close(f"{who} o vs ref", o_r, o_x, TOL)
        assert_close(f"{who} ht vs ref", ht_r, ht_x, TOL)
        for name in grads:
            assert_close(f"{who} d{name} vs ref", grads_r[name], grads_x[name], GRAD_TOL[name])
    assert_close("o vs fla", o_f, o, TOL)
    assert_close("ht vs fla", ht_f, ht, TOL)
    for name in grads:
        assert_close(f"d{name} vs fla", grads_f[name], grads[name], GRAD_TOL[name])


@pytest.mark.parametrize("lens", [None, [1, 0, 63, 200, 37]], ids=["fixed", "packed"])
def test_chunk_kda_any_gate_cuda(lens, kda_tuning):
    """A log-space gate without safe_gate, steps of -80 nats on 3% of the channels, on cula's intra kernel in its
    any_gate variant (KdaTuning.intra_any_gate): inference and a training step (stage 7 on its kernel's any_gate
    variant) against FLA's non-safe path and the float64 reference."""
    import fla.ops.kda as fk

    import cula.kda as ck
    from cula.backends import clear_plan_caches

    kda_tuning(intra_any_gate=True)
    clear_plan_caches()
    H, HV, D = 2, 4, 128
    T = 300 if lens is None else sum(lens)
    cu = None if lens is None else make_cu_seqlens(lens, device=DEV)
    N = 1 if lens is None else len(lens)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, D, device=DEV) + 2.0)
    g = g.masked_fill(torch.rand_like(g) < 0.03, -80.0)
    base = dict(
        q=torch.randn(1, T, H, D, device=DEV, dtype=torch.bfloat16),
        k=torch.randn(1, T, H, D, device=DEV, dtype=torch.bfloat16),
        v=torch.randn(1, T, HV, D, device=DEV, dtype=torch.bfloat16),
        g=g, beta=torch.rand(1, T, HV, device=DEV, dtype=torch.bfloat16),
        initial_state=torch.randn(N, HV, D, D, device=DEV) * 0.1,
    )  # fmt: skip
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    with torch.inference_mode():
        o, ht = ck.chunk_kda(**base, **kw)
        o_f, ht_f = fk.chunk_kda(**base, **kw)
    assert_close("o vs fla", o_f, o, TOL)
    assert_close("ht vs fla", ht_f, ht, TOL)
    cotangents = (torch.randn(1, T, HV, D, device=DEV).to(torch.bfloat16).double(),
                  torch.randn(N, HV, D, D, device=DEV).double())  # fmt: skip
    o, ht, grads = _grads(ck.chunk_kda, base, cotangents, **kw)
    # FLA memoises its chunk list on the boundaries tensor: the one its inference call made is an inference tensor,
    # which its training forward would save (and torch refuses), so FLA's step gets other boundaries of the same values
    fla_kw = dict(kw, cu_seqlens=None if cu is None else cu.clone())
    o_f, ht_f, grads_f = _grads(fk.chunk_kda, base, cotangents, **fla_kw)
    o_r, ht_r, grads_r = _grads(_reference_kda, base, cotangents, dtype=torch.float64, **kw)
    assert_close("o vs ref", o_r, o, TOL)
    assert_close("ht vs ref", ht_r, ht, TOL)
    for name in grads:
        assert_close(f"d{name} vs ref", grads_r[name], grads[name], GRAD_TOL[name])
        assert_close(f"d{name} vs fla", grads_f[name], grads[name], GRAD_TOL[name])
    clear_plan_caches()


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("state_v_first", [False, True])
def test_chunk_kda_intermediate_states_cuda(case, state_v_first, kda_tuning):
    """return_intermediate_states on cula's kernels (KdaTuning.intermediate_states): every chunk's start state h,
    in FLA's shape, dtype and layout, against FLA's (every allocation poisoned: the kernel writes every row), with
    the plain call's o and final state bit for bit (so the call ran on cula's kernels, not FLA's)."""
    import fla.ops.kda as fk

    import cula.kda as ck
    from cula.backends import clear_plan_caches

    kda_tuning(intermediate_states=True)
    clear_plan_caches()
    q, k, v, cu, N = _inputs(*case)
    B, T, _H, D = q.shape
    HV = v.shape[2]
    kw = dict(g=torch.randn(B, T, HV, D, device=DEV, dtype=torch.bfloat16),
              beta=torch.randn(B, T, HV, device=DEV), initial_state=torch.randn(N, HV, D, D, device=DEV) * 0.1,
              output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0, state_v_first=state_v_first,
              cu_seqlens=cu, A_log=torch.randn(HV, device=DEV) * 0.5, dt_bias=torch.randn(HV * D, device=DEV) * 0.5)
    with torch.inference_mode():
        o, ht, h = ck.chunk_kda(q, k, v, return_intermediate_states=True, **kw)
        o_plain, ht_plain = ck.chunk_kda(q, k, v, **kw)
        o_f, ht_f, h_f = fk.chunk_kda(q, k, v, return_intermediate_states=True, **kw)
    assert h.shape == h_f.shape and h.dtype == h_f.dtype
    assert not h.isnan().any()
    assert torch.equal(o, o_plain) and torch.equal(ht, ht_plain)
    assert_close("h vs fla", h_f.float(), h.float(), TOL)
    assert_close("o vs fla", o_f, o, TOL)
    clear_plan_caches()


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_fused_recurrent_kda_cuda(case):
    import fla.ops.kda as fk

    import cula.kda as ck
    from cula.kda.naive import l2norm, naive_recurrent_kda

    q, k, v, cu, N = _inputs(*case)
    B, T, H, D = q.shape
    HV = v.shape[2]
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, D, device=DEV))
    beta = torch.rand(B, T, HV, device=DEV)
    h0 = torch.randn(N, HV, D, D, device=DEV) * 0.1
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    o, ht = ck.fused_recurrent_kda(q, k, v, g, beta, **kw)
    o_f, ht_f = fk.fused_recurrent_kda(q, k, v, g, beta, **kw)
    ro, rt = naive_recurrent_kda(l2norm(q.double()), l2norm(k.double()), v.double(), g.double(), beta.double(),
                                 initial_state=h0.double(), output_final_state=True, cu_seqlens=cu)  # fmt: skip
    assert_close("o vs ref", ro, o, TOL)
    assert_close("ht vs ref", rt, ht, TOL)
    assert_close("o vs fla", o_f, o, TOL)
    assert_close("ht vs fla", ht_f, ht, TOL)
    assert_close("fla o vs ref", ro, o_f, TOL)
    assert_close("fla ht vs ref", rt, ht_f, TOL)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gated_delta_rule_cuda(case):
    import fla.ops.gated_delta_rule as fg

    import cula.gated_delta_rule as cg
    from cula.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    q, k, v, cu, N = _inputs(*case)
    B, T, H, D = q.shape
    HV = v.shape[2]
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device=DEV))
    beta = torch.rand(B, T, HV, device=DEV, dtype=torch.bfloat16)
    h0 = torch.randn(N, HV, D, D, device=DEV) * 0.1
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    o, ht = cg.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    o_f, ht_f = fg.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    assert_close("o vs fla", o_f, o, TOL)
    assert_close("ht vs fla", ht_f, ht, TOL)
    qn = torch.nn.functional.normalize(q.double(), dim=-1)
    kn = torch.nn.functional.normalize(k.double(), dim=-1)
    ro, rt = naive_recurrent_gated_delta_rule(qn, kn, v.double(), g=g.double(), beta=beta.double(),
                                              initial_state=h0.double(), output_final_state=True, cu_seqlens=cu)
    assert_close("o vs ref", ro, o, TOL)
    assert_close("ht vs ref", rt, ht, TOL)
    assert_close("fla o vs ref", ro, o_f, TOL)
    assert_close("fla ht vs ref", rt, ht_f, TOL)
    o_r, ht_r = cg.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kw)
    assert_close("recurrent o", ro, o_r, TOL)
    assert_close("recurrent ht", rt, ht_r, TOL)


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("state_v_first", [False, True])
def test_lightning_and_simple_gla_cuda(case, state_v_first):
    import fla.ops.simple_gla as fs

    import cula.lightning as cl
    import cula.simple_gla as cs
    from cula.simple_gla.naive import naive_recurrent_simple_gla

    q, k, v, cu, N = _inputs(*case)
    HV, D = v.shape[2], q.shape[-1]
    decay = torch.rand(HV, device=DEV) * 0.5
    decay[0] = 0.0
    h0 = torch.randn(N, HV, D, D, device=DEV) * 0.1
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, state_v_first=state_v_first)
    o, ht = cl.lightning_attn_fwd(q, k, v, decay, **kw)
    h0_kv = h0.transpose(-1, -2) if state_v_first else h0
    ro, rt = naive_recurrent_simple_gla(q.double(), k.double(), v.double(), g_gamma=-decay.double(),
                                        initial_state=h0_kv.double(), output_final_state=True, cu_seqlens=cu)
    rt = rt.transpose(-1, -2) if state_v_first else rt
    assert_close("o vs ref", ro, o, TOL)
    assert_close("ht vs ref", rt, ht, TOL)
    if HV == q.shape[2]:  # FLA's simple GLA has no GVA
        o_f, ht_f = fs.chunk_simple_gla(q, k, v, g_gamma=-decay, **kw)
        assert_close("o vs fla", o_f, o, TOL)
        assert_close("ht vs fla", ht_f, ht, TOL)
        assert_close("fla o vs ref", ro, o_f, TOL)
        assert_close("fla ht vs ref", rt, ht_f, TOL)
    o_r, ht_r = cs.fused_recurrent_simple_gla(q, k, v, g_gamma=-decay, **kw)
    assert_close("recurrent o", ro, o_r, TOL)
    assert_close("recurrent ht", rt, ht_r, TOL)


def test_lightning_wrappers_cuda():
    import fla.ops.lightning_attn as fl

    import cula.lightning as cl

    from cula.simple_gla.naive import naive_recurrent_simple_gla

    q, k, v, _, _ = _inputs(2, 300, 4, 4, 128, None)
    # With H = 4 the last head decays by 4.5 nats per step; FLA's chunked final state overflows to inf there
    # (seen on the H200), so the state is checked against the float64 recurrence and against FLA only where
    # FLA's is finite.
    g_gamma = -(8 / 4 * (1 - 3 / 12)) * torch.arange(4, dtype=torch.float64, device=DEV)
    ro, rt = naive_recurrent_simple_gla(q.double(), k.double(), v.double(), g_gamma=g_gamma, output_final_state=True)
    for name in ("chunk_lightning_attn", "fused_recurrent_lightning_attn"):
        o, ht = getattr(cl, name)(q, k, v, layer_idx=3, num_layers=12, output_final_state=True)
        o_f, ht_f = getattr(fl, name)(q, k, v, layer_idx=3, num_layers=12, output_final_state=True)
        assert_close(f"{name} o vs ref", ro, o, TOL)
        assert_close(f"{name} ht vs ref", rt, ht, TOL)
        assert_close(f"{name} o vs fla", o_f, o, TOL)
        finite = torch.isfinite(ht_f).flatten(2).all(-1)  # [N, H]
        assert_close(f"{name} ht vs fla (finite heads)", ht_f[finite], ht[finite], TOL)


def _kda_pool_reference(q, k, v, g, beta, pool, indices, **flags):
    """The float64 reference of a decode call on ``[N, T]`` tokens with a state pool: each live slot (index >= 0)
    runs its T tokens from its pool row. Returns ``o`` (padded slots zero) and the pool after the call."""
    from cula.kda.naive import reference_chunk_kda

    live = indices >= 0
    rows = indices.long()[live]
    o_live, states = reference_chunk_kda(
        *(t[live].double() for t in (q, k, v, g, beta)), initial_state=pool[rows].double(), output_final_state=True,
        compute_dtype=torch.float64, form="recurrent", **flags,
    )  # fmt: skip
    o = torch.zeros(v.shape, dtype=torch.float64, device=v.device)
    o[live] = o_live
    after = pool.double()
    after[rows] = states.double()
    return o, after


def test_kda_decode_pool_cuda():
    """FLA-style serving call: state pool updated in place, one token per sequence."""
    import fla.ops.kda.fused_recurrent as fkr

    import cula.kda as ck

    N, HV, H, D, P = 8, 4, 2, 128, 16
    q = torch.randn(N, 1, H, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(N, 1, H, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(N, 1, HV, D, device=DEV, dtype=torch.bfloat16)
    g = torch.randn(N, 1, HV, D, device=DEV, dtype=torch.bfloat16)
    beta = torch.randn(N, 1, HV, device=DEV)
    A_log, dt_bias = torch.randn(HV, device=DEV), torch.randn(HV * D, device=DEV)
    pool = torch.randn(P, HV, D, D, device=DEV) * 0.1
    idx = torch.randperm(P, device=DEV)[:N].to(torch.int32)
    # FLA's serving layout: [1, N, ...] packed with one token per sequence.
    flat = [t.transpose(0, 1).contiguous() for t in (q, k, v, g, beta)]
    cu = torch.arange(N + 1, device=DEV, dtype=torch.int32)
    kw = dict(A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, cu_seqlens=cu, ssm_state_indices=idx,
              inplace_final_state=True)
    pool_c, pool_f = pool.clone(), pool.clone()
    o, _ = ck.fused_recurrent_kda_fwd(*flat, initial_state=pool_c, **kw)
    o_f, _ = fkr.fused_recurrent_kda_fwd(*flat, initial_state=pool_f, **kw)
    o_r, pool_r = _kda_pool_reference(q, k, v, g, beta, pool, idx, A_log=A_log, dt_bias=dt_bias,
                                      use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                      use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)  # fmt: skip
    assert_close("o vs ref", o_r.transpose(0, 1), o, TOL)
    assert_close("pool vs ref", pool_r, pool_c, TOL)
    assert_close("o vs fla", o_f, o, TOL)
    assert_close("pool vs fla", pool_f, pool_c, TOL)
    assert_close("fla o vs ref", o_r.transpose(0, 1), o_f, TOL)
    assert_close("fla pool vs ref", pool_r, pool_f, TOL)
    rows = idx.long()
    assert_rows_rewritten("pool rows", pool_c, pool, rows, ref=pool_r[rows])
    untouched = torch.ones(P, dtype=torch.bool, device=DEV)
    untouched[rows] = False
    assert torch.equal(pool_c[untouched], pool[untouched])
    # the [N, 1] form (no cu_seqlens) runs on cula's decode kernel: same numbers
    from cula.kda.backends import fused_recurrent_kda_registry

    kw.pop("cu_seqlens")
    pool_c2, pool_f2 = pool.clone(), pool.clone()
    o2, ht2 = ck.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool_c2, **kw)
    o2_f, _ = fkr.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool_f2, **kw)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=pool_c2, scale=D**-0.5, output_final_state=False,
                state_v_first=False, num_accepted_tokens=None, out=None, cu_seqlens=None, allow_neg_eigval=False,
                **kw)  # fmt: skip
    assert fused_recurrent_kda_registry.select(q.device, args).name == "cula-sm90"
    assert ht2 is pool_c2
    assert_close("o ([N, 1] form) vs ref", o_r, o2, TOL)
    assert_close("pool ([N, 1] form) vs ref", pool_r, pool_c2, TOL)
    assert_close("o ([N, 1] form) vs fla", o2_f, o2, TOL)
    assert_close("pool ([N, 1] form) vs fla", pool_f2, pool_c2, TOL)
    assert_rows_rewritten("pool rows ([N, 1] form)", pool_c2, pool, rows, ref=pool_r[rows])
    assert torch.equal(pool_c2[untouched], pool[untouched])


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("state_v_first", [True, False])
def test_kda_decode_public_cuda(T, state_v_first, monkeypatch):
    """cula.kda.kda_decode (our kernel) against the float64 reference and the same call on the reference backend
    (the CPU path, fp32)."""
    import cula.kda as ck

    N, H, HV, D, P = 5, 2, 4, 128, 9
    q = torch.randn(N, T, H, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(N, T, H, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(N, T, HV, D, device=DEV, dtype=torch.bfloat16)
    g = torch.randn(N, T, HV, D, device=DEV)
    beta = torch.randn(N, T, HV, device=DEV)
    A_log, dt_bias = torch.randn(HV, device=DEV) * 0.5, torch.randn(HV * D, device=DEV)
    pool = torch.randn(P, HV, D, D, device=DEV) * 0.1
    idx = torch.tensor([3, -1, 0, 7, 5], device=DEV, dtype=torch.int32)
    kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, state_v_first=state_v_first)
    pool_c, pool_r = pool.clone(), pool.clone()
    o = ck.kda_decode(q, k, v, g, beta, pool_c, idx, out=torch.full_like(v, float("nan")), **kw)
    monkeypatch.setenv("CULA_BACKEND", "reference")
    o_r = ck.kda_decode(q, k, v, g, beta, pool_r, idx, **kw)
    o64, pool64 = _kda_pool_reference(q, k, v, g, beta, pool, idx, use_qk_l2norm_in_kernel=True,
                                      use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, **kw)  # fmt: skip
    assert_close("o vs float64", o64, o, TOL)
    assert_close("pool vs float64", pool64, pool_c, TOL)
    assert_close("o vs reference backend", o_r, o, TOL)
    assert_close("pool vs reference backend", pool_r, pool_c, TOL)
    rows = idx[idx >= 0].long()
    assert_rows_rewritten("pool rows", pool_c, pool, rows, ref=pool64[rows])
    assert torch.equal(pool_c[[1, 2, 4, 6, 8]], pool[[1, 2, 4, 6, 8]])
    assert torch.equal(o[1], torch.zeros_like(o[1]))


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_lightning_training_matches_fla(case):
    """Our forward + FLA's backward (simple_gla.backends._LightningTraining) end to end: o, the final state and
    the gradients of q, k, v and the initial state against the float64 reference (FLA's own call too) and FLA."""
    import fla.ops.simple_gla as fs

    from cula.lightning import lightning_attn_fwd
    from cula.lightning.naive import reference_lightning_attn

    q, k, v, cu, N = _inputs(*case)
    H, HV, D = q.shape[2], v.shape[2], q.shape[-1]
    decay = torch.rand(HV, device=DEV)
    leaves = dict(q=q, k=k, v=v, initial_state=torch.randn(N, HV, D, D, device=DEV) * 0.1)
    cotangents = (torch.randn(v.shape, device=DEV).to(torch.bfloat16).double(),
                  torch.randn(N, HV, D, D, device=DEV).double())  # fmt: skip

    def fla(q, k, v, **kw):  # FLA's simple GLA has no GVA: each value head gets its q/k head's copy
        q, k = (t.repeat_interleave(HV // H, dim=2) for t in (q, k))
        return fs.chunk_simple_gla(q, k, v, g_gamma=-decay, **kw)

    kw = dict(output_final_state=True, cu_seqlens=cu)
    ours = _grads(lambda **x: lightning_attn_fwd(decay=decay, **x, **kw), leaves, cotangents)
    theirs = _grads(lambda **x: fla(**x, **kw), leaves, cotangents)
    ref = _grads(lambda **x: reference_lightning_attn(decay=decay.double(), **x, **kw, compute_dtype=torch.float64),
                 leaves, cotangents, dtype=torch.float64)  # fmt: skip
    for who, (o, ht, grads) in (("cula", ours), ("fla", theirs)):
        assert_close(f"{who} o vs ref", ref[0], o, TOL)
        assert_close(f"{who} ht vs ref", ref[1], ht, TOL)
        for name in grads:
            assert_close(f"{who} d{name} vs ref", ref[2][name], grads[name], GRAD_TOL[name])
    assert_close("o vs fla", theirs[0], ours[0], TOL)
    assert_close("ht vs fla", theirs[1], ours[1], TOL)
    for name in ours[2]:
        assert_close(f"d{name} vs fla", theirs[2][name], ours[2][name], GRAD_TOL[name])


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_chunk_simple_gla_data_dependent_gate_cuda(case):
    import fla.ops.simple_gla as fs

    import cula.simple_gla as cs
    from cula.simple_gla.naive import naive_recurrent_simple_gla

    q, k, v, cu, N = _inputs(*case)
    B, T, H, D = q.shape
    HV = v.shape[2]
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device=DEV) + 2)
    h0 = torch.randn(N, HV, D, D, device=DEV) * 0.1
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o, ht = cs.chunk_simple_gla(q, k, v, g=g, **kw)
    ro, rt = naive_recurrent_simple_gla(q.double(), k.double(), v.double(), g=g.double(),
                                        initial_state=h0.double(), output_final_state=True, cu_seqlens=cu)
    assert_close("o vs ref", ro, o, TOL)
    assert_close("ht vs ref", rt, ht, TOL)
    if HV == H:
        o_f, ht_f = fs.chunk_simple_gla(q, k, v, g=g, **kw)
        assert_close("o vs fla", o_f, o, TOL)
        assert_close("ht vs fla", ht_f, ht, TOL)
        assert_close("fla o vs ref", ro, o_f, TOL)
        assert_close("fla ht vs ref", rt, ht_f, TOL)


def test_cuda_graph_capture_and_replay():
    """Serving engines capture decode (and often prefill) in CUDA graphs: our launches must follow the capture
    stream and our argument checks must not sync while capturing."""
    import cula.kda as ck
    from cula.lightning import lightning_attn_fwd

    N, H, HV, D, P = 4, 2, 4, 128, 8
    q = torch.randn(N, 1, H, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(N, 1, H, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(N, 1, HV, D, device=DEV, dtype=torch.bfloat16)
    g = torch.randn(N, 1, HV, D, device=DEV)
    beta = torch.randn(N, 1, HV, device=DEV)
    A_log = torch.randn(HV, device=DEV)
    pool = torch.randn(P, HV, D, D, device=DEV) * 0.1
    idx = torch.tensor([5, 0, -1, 2], device=DEV, dtype=torch.int32)
    out = torch.empty_like(v)
    kw = dict(A_log=A_log, lower_bound=-5.0)
    lq, lk, lv = (torch.randn(2, 200, 4, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    decay = torch.rand(4, device=DEV)

    pool_eager = pool.clone()
    o_eager = ck.kda_decode(q, k, v, g, beta, pool_eager, idx, **kw)
    lo_eager, lh_eager = lightning_attn_fwd(lq, lk, lv, decay, output_final_state=True)

    pool_graph = pool.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) outside the capture
        ck.kda_decode(q, k, v, g, beta, pool.clone(), idx, out=out, **kw)
        lightning_attn_fwd(lq, lk, lv, decay, output_final_state=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ck.kda_decode(q, k, v, g, beta, pool_graph, idx, out=out, **kw)
        lo, lh = lightning_attn_fwd(lq, lk, lv, decay, output_final_state=True)
    pool_graph.copy_(pool)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, o_eager) and torch.equal(pool_graph, pool_eager)
    assert torch.equal(lo, lo_eager) and torch.equal(lh, lh_eager)
