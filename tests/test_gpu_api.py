"""CUDA path of every public function against FLA 0.6.0's Triton kernels and our float64 references.

Whatever backend the registry picks (our kernels where they cover the arguments, FLA otherwise) must
match both within FLA's tolerance (relative RMSE 5e-3 for o and the final state). The CUDA caching
allocator is filled with NaN before each call so an output element nobody writes fails the check.
"""

import os

import pytest
import torch

from cula.testing import assert_close, make_cu_seqlens, poison_cuda_allocator

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


def _inference_vs_fla_and_ref(case, state_v_first=False, dtype=torch.bfloat16):
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
          "use_beta_sigmoid_in_kernel": True, "safe_gate": True, "lower_bound": -5.0, "state_v_first": state_v_first,
          "cu_seqlens": cu, "A_log": A_log, "dt_bias": dt_bias}
    if cu is not None and state_v_first:
        # with its host copy a packed call takes cula's varlen plan (cula.kda.chunk.VARLEN_PLANS), without it the
        # general path: the two state layouts cover one each
        kw["cu_seqlens_cpu"] = cu.cpu()

    def run():
        with torch.inference_mode():
            return ck.chunk_kda(q, k, v, g_raw, beta_raw, initial_state=h0, **kw)

    poison_cuda_allocator()
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
    return o, ht, run


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("state_v_first", [False, True])
def test_chunk_kda_cuda(case, state_v_first):
    o, ht, run = _inference_vs_fla_and_ref(case, state_v_first)
    o2, ht2 = run()
    assert torch.equal(o, o2) and torch.equal(ht, ht2), "results differ between identical runs"


@pytest.mark.parametrize("case", [(2, 300, 2, 4, 128, None), (1, 0, 2, 2, 128, [0, 1, 63, 300, 64])], ids=_ids)
def test_chunk_kda_fp16_cuda(case, monkeypatch):
    """fp16 q/k/v forced onto the cula-sm90 kernels (CHUNK_FP16_ON_CULA, off until this passes) against FLA's fp16
    chunk_kda and the float64 recurrence."""
    import cula.kda.backends as kb
    from cula.backends import clear_plan_caches

    monkeypatch.setattr(kb, "CHUNK_FP16_ON_CULA", True)
    monkeypatch.setenv("CULA_BACKEND", "cula-sm90")  # raise rather than fall back
    monkeypatch.setenv("CULA_KDA_INTRA", "1")
    clear_plan_caches()
    o, _ht, _run = _inference_vs_fla_and_ref(case, dtype=torch.float16)
    clear_plan_caches()
    assert o.dtype == torch.float16


@pytest.mark.parametrize("fused", [False, True], ids=["log-gate", "fused-gate-gva"])
@pytest.mark.parametrize("on_cula", [True, False], ids=["cula-fwd", "fla"])
def test_chunk_kda_cuda_backward_matches_fla(on_cula, fused, monkeypatch):
    """Training: with CHUNK_TRAINING_ON_CULA our forward kernels and FLA's backward (the stages FLA saves
    recomputed from the inputs), else FLA for both; o, the final state and every input gradient against FLA."""
    import fla.ops.kda as fk

    import cula.kda as ck
    import cula.kda.backends as kb
    from cula.backends import clear_plan_caches

    monkeypatch.setattr(kb, "CHUNK_TRAINING_ON_CULA", on_cula)
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
        flags.update(use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=True, use_beta_sigmoid_in_kernel=True,
                     state_v_first=True)  # fmt: skip
    h0 = torch.randn(B, HV, D, D, device=DEV) * 0.1
    ran = []
    if on_cula:
        forward = kb._ChunkKDATraining.forward
        monkeypatch.setattr(kb._ChunkKDATraining, "forward",
                            staticmethod(lambda *a: ran.append(1) or forward(*a)))  # fmt: skip

    def run(fn):
        x = {n: t.clone().requires_grad_() for n, t in base.items()}
        h = h0.clone().requires_grad_()
        o, ht = fn(**x, initial_state=h, output_final_state=True, **flags)
        (o.float().pow(2).sum() + ht.pow(2).sum()).backward()
        return o, ht, {n: t.grad for n, t in x.items()}, h.grad

    o, ht, grads, dh0 = run(ck.chunk_kda)
    assert ran == ([1] if on_cula else [])
    o_f, ht_f, grads_f, dh0_f = run(fk.chunk_kda)
    assert_close("o", o_f, o, TOL)
    assert_close("ht", ht_f, ht, TOL)
    ratios = {"q": 8e-3, "k": 8e-3, "v": 8e-3, "g": 2e-2, "beta": 2e-2, "A_log": 2e-2, "dt_bias": 2e-2}
    for name in grads:
        assert_close(f"d{name}", grads_f[name], grads[name], ratios[name])
    assert_close("dh0", dh0_f, dh0, 8e-3)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_fused_recurrent_kda_cuda(case):
    import fla.ops.kda as fk

    import cula.kda as ck

    q, k, v, cu, N = _inputs(*case)
    B, T, H, D = q.shape
    HV = v.shape[2]
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, D, device=DEV))
    beta = torch.rand(B, T, HV, device=DEV)
    h0 = torch.randn(N, HV, D, D, device=DEV) * 0.1
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    poison_cuda_allocator()
    o, ht = ck.fused_recurrent_kda(q, k, v, g, beta, **kw)
    o_f, ht_f = fk.fused_recurrent_kda(q, k, v, g, beta, **kw)
    assert_close("o", o_f, o, TOL)
    assert_close("ht", ht_f, ht, TOL)


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
    poison_cuda_allocator()
    o, ht = cg.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    o_f, ht_f = fg.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    assert_close("o vs fla", o_f, o, TOL)
    assert_close("ht vs fla", ht_f, ht, TOL)
    qn = torch.nn.functional.normalize(q.double(), dim=-1)
    kn = torch.nn.functional.normalize(k.double(), dim=-1)
    ro, rt = naive_recurrent_gated_delta_rule(qn, kn, v.double(), g.double(), beta.double(),
                                              initial_state=h0.double(), output_final_state=True, cu_seqlens=cu)
    assert_close("o vs ref", ro, o, TOL)
    assert_close("ht vs ref", rt, ht, TOL)
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
    poison_cuda_allocator()
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
    assert_close("o", o_f, o, TOL)
    assert_close("pool", pool_f, pool_c, TOL)
    untouched = torch.ones(P, dtype=torch.bool, device=DEV)
    untouched[idx.long()] = False
    assert torch.equal(pool_c[untouched], pool[untouched])
    # the [N, 1] form (no cu_seqlens) runs on cula's decode kernel: same numbers
    from cula.kda.backends import fused_recurrent_kda_registry

    kw.pop("cu_seqlens")
    pool_c2, pool_f2 = pool.clone(), pool.clone()
    poison_cuda_allocator()
    o2, ht2 = ck.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool_c2, **kw)
    o2_f, _ = fkr.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool_f2, **kw)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=pool_c2, scale=D**-0.5, output_final_state=False,
                state_v_first=False, num_accepted_tokens=None, out=None, cu_seqlens=None, allow_neg_eigval=False,
                **kw)  # fmt: skip
    assert fused_recurrent_kda_registry.select(q.device, args).name == "cula-sm90"
    assert ht2 is pool_c2
    assert_close("o ([N, 1] form)", o2_f, o2, TOL)
    assert_close("pool ([N, 1] form)", pool_f2, pool_c2, TOL)
    assert torch.equal(pool_c2[untouched], pool[untouched])


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("state_v_first", [True, False])
def test_kda_decode_public_cuda(T, state_v_first, monkeypatch):
    """cula.kda.kda_decode (our kernel) against the same call on the reference backend."""
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
    assert_close("o", o_r, o, TOL)
    assert_close("pool", pool_r, pool_c, TOL)
    assert torch.equal(pool_c[[1, 2, 4, 6, 8]], pool[[1, 2, 4, 6, 8]])
    assert torch.equal(o[1], torch.zeros_like(o[1]))


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_lightning_training_matches_fla(case):
    """Our forward + FLA's backward (simple_gla.backends._LightningTraining) against FLA end to end."""
    import fla.ops.simple_gla as fs

    from cula.lightning import lightning_attn_fwd

    q, k, v, cu, N = _inputs(*case)
    H, HV, D = q.shape[2], v.shape[2], q.shape[-1]
    decay = torch.rand(HV, device=DEV)
    h0 = torch.randn(N, HV, D, D, device=DEV) * 0.1

    def run(fn, expand):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        h = h0.clone().requires_grad_()
        qq, kk = x[0], x[1]
        if expand:  # FLA's simple GLA has no GVA
            qq, kk = (t.repeat_interleave(HV // H, dim=2) for t in (qq, kk))
        o, ht = fn(qq, kk, x[2], h)
        (o.float().pow(2).sum() + ht.pow(2).sum()).backward()
        return o, ht, [t.grad for t in x], h.grad

    ours = run(lambda q_, k_, v_, h: lightning_attn_fwd(q_, k_, v_, decay, initial_state=h, output_final_state=True,
                                                        cu_seqlens=cu), expand=False)
    theirs = run(lambda q_, k_, v_, h: fs.chunk_simple_gla(q_, k_, v_, g_gamma=-decay, initial_state=h,
                                                           output_final_state=True, cu_seqlens=cu), expand=True)
    assert_close("o", theirs[0], ours[0], TOL)
    assert_close("ht", theirs[1], ours[1], TOL)
    for name, a, b in zip("qkv", theirs[2], ours[2]):
        assert_close(f"d{name}", a, b, 8e-3)
    assert_close("dh0", theirs[3], ours[3], 8e-3)


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
    poison_cuda_allocator()
    o, ht = cs.chunk_simple_gla(q, k, v, g=g, **kw)
    ro, rt = naive_recurrent_simple_gla(q.double(), k.double(), v.double(), g=g.double(),
                                        initial_state=h0.double(), output_final_state=True, cu_seqlens=cu)
    assert_close("o vs ref", ro, o, TOL)
    assert_close("ht vs ref", rt, ht, TOL)
    if HV == H:
        o_f, ht_f = fs.chunk_simple_gla(q, k, v, g=g, **kw)
        assert_close("o vs fla", o_f, o, TOL)
        assert_close("ht vs fla", ht_f, ht, TOL)


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
