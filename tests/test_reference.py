"""CPU tests of the PyTorch references (``cula/<op>/naive.py``), the gold for every GPU test.

Three kinds of evidence:
* self-consistency in float64: the recurrent and chunked forms agree to ~1e-15 (checked < 1e-10) for odd
  T, varlen with empty and one-token sequences, GVA, initial states, both state layouts, chunk 16/64;
* an independent per-head loop oracle (written here, scalar indexing, no GVA expansion) and FLA 0.6.0's
  own fp32 naive functions / gate functions where the conventions overlap;
* autograd: ``torch.autograd.gradcheck`` on tiny float64 cases, and chunk-vs-recurrent gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cula.gated_delta_rule.naive import (
    gdn_gate,
    naive_chunk_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
    reference_chunk_gated_delta_rule,
    reference_fused_recurrent_gated_delta_rule,
)
from cula.kda.naive import (
    kda_gate,
    naive_chunk_kda,
    naive_recurrent_kda,
    reference_chunk_kda,
)
from cula.lightning.naive import lightning_g_gamma, reference_chunk_lightning_attn, reference_lightning_attn
from cula.simple_gla.naive import (
    naive_chunk_simple_gla,
    naive_recurrent_simple_gla,
    reference_chunk_simple_gla,
)
from cula.testing import make_cu_seqlens, rel_rmse

F64 = torch.float64
TIGHT = 1e-10  # float64 recurrent vs chunk
FP32 = 1e-5  # against FLA's fp32 naive functions


def _close(ref, out, tol, name="o"):
    assert ref.shape == out.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if ref.numel() == 0:
        return
    err = rel_rmse(ref, out)
    assert err < tol, f"{name}: relative RMSE {err:.3e} >= {tol:.1e}"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _inputs(B, T, H, HV, K, V, seed=0, dtype=F64, scalar_gate=False):
    """Random q, k (unit norm), v, log gate (mostly mild decay), beta in (0, 1), h0 [B, HV, K, V]."""
    gen = _gen(seed)

    def rn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    q = rn(B, T, H, K)
    k = F.normalize(rn(B, T, H, K), dim=-1)
    v = rn(B, T, HV, V)
    g = F.logsigmoid(2 * rn(*((B, T, HV) if scalar_gate else (B, T, HV, K))) + 3)
    beta = torch.rand(B, T, HV, generator=gen, dtype=F64)
    h0 = rn(B, HV, K, V)
    return [x.to(dtype) for x in (q, k, v, g, beta, h0)]


def _oracle(q, k, v, gk=None, gv=None, beta=None, scale=None, h0=None, delta=True):
    """Per (sequence, value head, step) loop with explicit GVA indexing; dense input only."""
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    scale = K**-0.5 if scale is None else scale
    o = torch.zeros(B, T, HV, V, dtype=F64)
    S_all = torch.zeros(B, HV, K, V, dtype=F64)
    for b in range(B):
        for hv in range(HV):
            h = hv // (HV // H)
            S = torch.zeros(K, V, dtype=F64) if h0 is None else h0[b, hv].clone()
            for t in range(T):
                if gk is not None:
                    S = torch.exp(gk[b, t, hv])[:, None] * S
                if gv is not None:
                    S = S * torch.exp(gv[b, t, hv])[None, :]
                kt = k[b, t, h]
                if delta:
                    u = beta[b, t, hv] * (v[b, t, hv] - S.T @ kt)
                else:
                    u = v[b, t, hv]
                S = S + torch.outer(kt, u)
                o[b, t, hv] = S.T @ (scale * q[b, t, h])
            S_all[b, hv] = S
    return o, S_all


def _pack(xs):
    """[B, T, ...] tensors -> packed [1, B*T, ...]."""
    return [None if x is None else x.reshape(1, -1, *x.shape[2:]) for x in xs]


# ------------------------------------------------------------------------------------------------------
# KDA: recurrent vs chunk, oracle, layouts, varlen
# ------------------------------------------------------------------------------------------------------

KDA_CASES = [
    # B, T, H, HV, K, V, chunk, use_h0, state_v_first
    (1, 1, 1, 1, 16, 16, 16, False, False),
    (2, 63, 2, 2, 16, 32, 16, True, False),
    (2, 100, 2, 4, 32, 16, 64, True, True),
    (1, 130, 1, 2, 16, 16, 64, False, True),
    (1, 64, 2, 2, 8, 8, 16, True, False),
]


def _kda_id(c):
    B, T, H, HV, K, V, C, h0, vf = c
    return f"B{B}-T{T}-H{H}-HV{HV}-K{K}-V{V}-C{C}" + ("-h0" if h0 else "") + ("-vfirst" if vf else "")


@pytest.mark.parametrize("case", KDA_CASES, ids=_kda_id)
def test_kda_chunk_matches_recurrent(case):
    B, T, H, HV, K, V, C, use_h0, vf = case
    q, k, v, g, beta, h0 = _inputs(B, T, H, HV, K, V)
    h0 = (h0.transpose(-1, -2) if vf else h0) if use_h0 else None
    kw = {"initial_state": h0, "output_final_state": True, "state_v_first": vf}
    o_r, s_r = naive_recurrent_kda(q, k, v, g, beta, **kw)
    o_c, s_c = naive_chunk_kda(q, k, v, g, beta, chunk_size=C, **kw)
    assert o_r.dtype == F64 and s_r.dtype == F64
    _close(o_r, o_c, TIGHT)
    _close(s_r, s_c, TIGHT, "state")


@pytest.mark.parametrize("per_value_beta", [False, True], ids=["beta-head", "beta-per-v"])
def test_kda_recurrent_matches_oracle(per_value_beta):
    B, T, H, HV, K, V = 2, 17, 2, 4, 8, 4
    q, k, v, g, beta, h0 = _inputs(B, T, H, HV, K, V, seed=1)
    if per_value_beta:
        beta = torch.rand(B, T, HV, V, generator=_gen(7), dtype=F64)
    o, s = naive_recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True)
    o_ref, s_ref = _oracle(q, k, v, gk=g, beta=beta, scale=0.3, h0=h0)
    _close(o_ref, o, TIGHT)
    _close(s_ref, s, TIGHT, "state")


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_kda_state_v_first_is_transpose(form):
    q, k, v, g, beta, h0 = _inputs(2, 40, 1, 2, 16, 8, seed=2)
    fn = naive_recurrent_kda if form == "recurrent" else naive_chunk_kda
    o_a, s_a = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_b, s_b = fn(
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0.transpose(-1, -2).contiguous(),
        output_final_state=True,
        state_v_first=True,
    )
    assert s_b.shape == (2, 2, 8, 16)
    torch.testing.assert_close(o_a, o_b, rtol=0, atol=1e-13)
    torch.testing.assert_close(s_a, s_b.transpose(-1, -2), rtol=0, atol=1e-13)


@pytest.mark.parametrize("state_v_first", [False, True])
def test_reference_entry_points_return_row_major_states(state_v_first):
    """The reference_* entry points return the final state row-major in either layout, as FLA's kernels write it,
    with or without an initial state (its cores keep [K, V]; the V-first state is a transpose of it)."""
    q, k, v, g, beta, h0 = _inputs(1, 20, 1, 2, 16, 16, seed=3)
    h0 = h0.to(torch.float32)
    for state in (None, h0):
        _, ht = reference_chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                    state_v_first=state_v_first)  # fmt: skip
        assert ht.dtype == torch.float32 and ht.is_contiguous()
        _, ht = reference_chunk_gated_delta_rule(q, k, v, g[..., 0], beta, initial_state=state, output_final_state=True,
                                                 state_v_first=state_v_first)  # fmt: skip
        assert ht.is_contiguous()


VARLEN_CASES = [
    # lengths, H, HV, chunk, state_v_first
    ([0, 1, 37, 64, 5, 0], 2, 4, 16, False),
    ([1, 100, 0, 63], 1, 2, 64, True),
    ([0], 1, 1, 16, False),
]


@pytest.mark.parametrize(
    "case",
    VARLEN_CASES,
    ids=lambda c: "L" + "_".join(map(str, c[0])) + f"-H{c[1]}-HV{c[2]}-C{c[3]}" + ("-vfirst" if c[4] else ""),
)
def test_kda_varlen(case):
    lens, H, HV, C, vf = case
    K, V = 16, 8
    N, total = len(lens), sum(lens)
    q, k, v, g, beta, _ = _inputs(1, total, H, HV, K, V, seed=3)
    h0 = torch.randn(N, HV, V, K, generator=_gen(4), dtype=F64)
    h0 = h0 if vf else h0.transpose(-1, -2).contiguous()
    cu = make_cu_seqlens(lens)
    kw = {"initial_state": h0, "output_final_state": True, "state_v_first": vf, "cu_seqlens": cu}
    o_r, s_r = naive_recurrent_kda(q, k, v, g, beta, **kw)
    o_c, s_c = naive_chunk_kda(q, k, v, g, beta, chunk_size=C, **kw)
    assert o_r.shape == (1, total, HV, V) and s_r.shape == h0.shape
    _close(o_r, o_c, TIGHT)
    _close(s_r, s_c, TIGHT, "state")
    # each sequence on its own must give the same rows; an empty one passes its state through
    for n, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sl = slice(bos, eos)
        o_n, s_n = naive_chunk_kda(
            q[:, sl],
            k[:, sl],
            v[:, sl],
            g[:, sl],
            beta[:, sl],
            chunk_size=C,
            initial_state=h0[n : n + 1],
            output_final_state=True,
            state_v_first=vf,
        )
        torch.testing.assert_close(o_n, o_c[:, sl], rtol=0, atol=1e-12)
        torch.testing.assert_close(s_n, s_c[n : n + 1], rtol=0, atol=1e-12)
        if eos == bos:
            torch.testing.assert_close(s_n, h0[n : n + 1], rtol=0, atol=0)


def test_kda_no_final_state_and_float32_compute():
    q, k, v, g, beta, _ = _inputs(1, 20, 1, 1, 8, 8, dtype=torch.float32)
    o, s = naive_chunk_kda(q, k, v, g, beta, chunk_size=16)
    assert s is None and o.dtype == torch.float32
    o64, _ = naive_chunk_kda(q, k, v, g, beta, chunk_size=16, compute_dtype=F64)
    assert o64.dtype == F64
    _close(o64, o, FP32)


# ------------------------------------------------------------------------------------------------------
# KDA against FLA 0.6.0 (fp32 naive functions and gates)
# ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fla_kda():
    pytest.importorskip("fla")
    from fla.ops.kda import gate, naive

    return naive, gate


def test_kda_vs_fla_naive_recurrent(fla_kda):
    naive, _ = fla_kda
    q, k, v, g, beta, h0 = _inputs(2, 50, 2, 4, 16, 8, seed=5)
    o, s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_f, s_f = naive.naive_recurrent_kda(
        *(x.float() for x in (q, k, v, g, beta)), initial_state=h0.float(), output_final_state=True
    )
    _close(o, o_f, FP32)
    _close(s, s_f, FP32, "state")


def test_kda_vs_fla_naive_chunk(fla_kda):
    naive, _ = fla_kda
    q, k, v, g, beta, h0 = _inputs(1, 128, 1, 2, 16, 16, seed=6)
    o, s = naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=64)
    o_f, s_f = naive.naive_chunk_kda(
        *(x.float() for x in (q, k, v, g, beta)),
        initial_state=h0.float(),
        output_final_state=True,
        chunk_size=64,
    )
    _close(o, o_f, FP32)
    _close(s, s_f, FP32, "state")


GATE_CASES = [
    # lower_bound, has A_log, has dt_bias
    (None, True, True),
    (None, True, False),
    (-5.0, True, True),
    (-5.0, False, True),
    (-3.0, False, False),
]


@pytest.mark.parametrize("case", GATE_CASES, ids=lambda c: f"lb{c[0]}-A{int(c[1])}-bias{int(c[2])}")
def test_kda_gate_vs_fla(fla_kda, case):
    _, gate = fla_kda
    lb, has_a, has_b = case
    HV, K = 3, 8
    gen = _gen(8)
    # spread wide enough to hit softplus' x > 20 linear branch
    g = 12 * torch.randn(2, 5, HV, K, generator=gen)
    A_log = torch.randn(HV, generator=gen) if has_a else None
    dt_bias = torch.randn(HV * K, generator=gen) if has_b else None
    out = kda_gate(g, A_log, dt_bias, lower_bound=lb)
    if lb is None:
        ref = gate.naive_kda_gate(g, A_log, dt_bias)
    else:
        ref = gate.naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound=lb)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert kda_gate(g.double(), A_log, dt_bias, lower_bound=lb).dtype == F64


def test_kda_gate_requires_a_log_without_lower_bound():
    with pytest.raises(ValueError):
        kda_gate(torch.randn(2, 3, 4))


def _l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


PRE_CASES = [
    # l2norm, gate, beta sigmoid, allow_neg_eigval, lower_bound, A_log, varlen, form
    (True, True, True, False, None, True, False, "chunk"),
    (True, True, True, True, -5.0, True, True, "chunk"),
    (False, True, False, False, -5.0, False, False, "recurrent"),
    (True, False, True, True, None, False, True, "recurrent"),
]


def _pre_id(c):
    l2, gate, bs, neg, lb, a, vl, form = c
    parts = [form] + (["l2"] if l2 else []) + ([f"gate-lb{lb}" + ("-A" if a else "")] if gate else [])
    return "-".join(
        parts + (["sigmoid"] if bs else []) + (["neg"] if neg else []) + (["varlen"] if vl else [])
    )


@pytest.mark.parametrize("case", PRE_CASES, ids=_pre_id)
def test_reference_chunk_kda_preprocessing(case):
    l2, use_gate, use_bs, neg, lb, has_a, varlen, form = case
    H, HV, K, V = 1, 2, 16, 8
    lens = [0, 9, 30]
    B, T = (1, sum(lens)) if varlen else (2, 30)
    gen = _gen(9)
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(B, T, HV, V, generator=gen, dtype=F64)
    g_raw = torch.randn(B, T, HV, K, generator=gen, dtype=F64)
    b_raw = torch.randn(B, T, HV, generator=gen, dtype=F64)
    A_log = torch.randn(HV, generator=gen, dtype=F64) if has_a else None
    dt_bias = torch.randn(HV * K, generator=gen, dtype=F64)
    N = len(lens) if varlen else B
    h0 = torch.randn(N, HV, K, V, generator=gen, dtype=F64)
    cu = make_cu_seqlens(lens) if varlen else None

    g = g_raw if use_gate else F.logsigmoid(g_raw)
    o, s = reference_chunk_kda(
        q,
        k,
        v,
        g,
        b_raw if use_bs else b_raw.sigmoid(),
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=l2,
        use_gate_in_kernel=use_gate,
        use_beta_sigmoid_in_kernel=use_bs,
        allow_neg_eigval=neg,
        lower_bound=lb,
        A_log=A_log,
        dt_bias=dt_bias,
        cu_seqlens=cu,
        form=form,
        chunk_size=16,
    )

    # expected: the documented formulas written out here
    qe, ke = (_l2(q), _l2(k)) if l2 else (q, k)
    if use_gate:
        x = g_raw + dt_bias.view(HV, K)
        if lb is None:
            ge = -A_log.exp()[:, None] * F.softplus(x)
        else:
            ge = lb * torch.sigmoid((A_log.exp()[:, None] * x) if has_a else x)
    else:
        ge = g
    be = (2 if neg else 1) * torch.sigmoid(b_raw)
    o_e, s_e = naive_recurrent_kda(
        qe, ke, v, ge, be, initial_state=h0, output_final_state=True, cu_seqlens=cu
    )
    assert o.dtype == F64 and s.dtype == torch.float32
    _close(o_e, o, TIGHT)
    _close(s_e, s, 1e-7, "state")  # the final state is returned in float32, like FLA


def test_reference_chunk_kda_output_dtypes_and_errors():
    q, k, v, g, beta, h0 = _inputs(1, 10, 1, 1, 8, 8)
    q16, k16, v16 = (x.to(torch.bfloat16) for x in (q, k, v))
    o, s = reference_chunk_kda(
        q16, k16, v16, g.float(), beta.float(), initial_state=h0.float(), output_final_state=True
    )
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o, s = reference_chunk_kda(q16, k16, v16, g.float(), beta.float())
    assert s is None
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        reference_chunk_kda(q, k, v, g, beta, allow_neg_eigval=True)
    with pytest.raises(ValueError, match="A_log"):
        reference_chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="batch size"):
        q2, k2, v2, g2, b2, _ = _inputs(2, 10, 1, 1, 8, 8)
        reference_chunk_kda(q2, k2, v2, g2, b2, cu_seqlens=make_cu_seqlens([10, 10]))
    with pytest.raises(ValueError, match="initial_state"):
        reference_chunk_kda(q, k, v, g, beta, initial_state=h0[:, :, :4])


# ------------------------------------------------------------------------------------------------------
# Gated DeltaNet
# ------------------------------------------------------------------------------------------------------

GDN_CASES = [
    # B, T, H, HV, chunk, state_v_first, varlen lengths (None: dense)
    (2, 63, 1, 2, 16, False, None),
    (1, 100, 2, 2, 64, True, None),
    (1, None, 1, 4, 16, True, [5, 0, 1, 70]),
]


@pytest.mark.parametrize(
    "case",
    GDN_CASES,
    ids=lambda c: (
        (f"B{c[0]}-T{c[1]}" if c[6] is None else "L" + "_".join(map(str, c[6])))
        + f"-H{c[2]}-HV{c[3]}-C{c[4]}"
        + ("-vfirst" if c[5] else "")
    ),
)
def test_gdn_chunk_matches_recurrent(case):
    B, T, H, HV, C, vf, lens = case
    T = sum(lens) if lens else T
    q, k, v, g, beta, _ = _inputs(B, T, H, HV, 16, 8, seed=10, scalar_gate=True)
    N = len(lens) if lens else B
    h0 = torch.randn(N, HV, 16, 8, generator=_gen(11), dtype=F64)
    h0 = h0.transpose(-1, -2) if vf else h0
    kw = {
        "initial_state": h0,
        "output_final_state": True,
        "state_v_first": vf,
        "cu_seqlens": make_cu_seqlens(lens) if lens else None,
    }
    o_r, s_r = naive_recurrent_gated_delta_rule(q, k, v, beta, g, **kw)
    o_c, s_c = naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=C, **kw)
    _close(o_r, o_c, TIGHT)
    _close(s_r, s_c, TIGHT, "state")


def test_gdn_recurrent_matches_oracle():
    q, k, v, g, beta, h0 = _inputs(2, 20, 2, 4, 8, 4, seed=12, scalar_gate=True)
    o, s = naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=h0, output_final_state=True)
    o_ref, s_ref = _oracle(q, k, v, gk=g[..., None].expand(-1, -1, -1, 8), beta=beta, h0=h0)
    _close(o_ref, o, TIGHT)
    _close(s_ref, s, TIGHT, "state")


def test_gdn_vs_fla_naive():
    pytest.importorskip("fla")
    from fla.ops.gated_delta_rule import naive as fla_gdn

    q, k, v, g, beta, h0 = _inputs(2, 100, 2, 2, 16, 16, seed=13, scalar_gate=True)
    o, s = naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=h0, output_final_state=True)
    f32 = [x.float() for x in (q, k, v, g, beta)]
    # the same positional call as FLA's (beta before g in the recurrent form; chunk_size sixth in the chunk form)
    o_f, s_f = fla_gdn.naive_recurrent_gated_delta_rule(
        f32[0], f32[1], f32[2], f32[4], f32[3], initial_state=h0.float(), output_final_state=True
    )
    _close(o, o_f, FP32)
    _close(s, s_f, FP32, "state")
    o_fc, s_fc = fla_gdn.naive_chunk_gated_delta_rule(
        *f32, chunk_size=64, initial_state=h0.float(), output_final_state=True
    )
    _close(o, o_fc, FP32, "o(chunk)")
    _close(s, s_fc, FP32, "state(chunk)")


def test_gdn_gate_vs_fla():
    pytest.importorskip("fla")
    from fla.ops.gated_delta_rule.gate import naive_gdn_gate

    gen = _gen(14)
    g = 12 * torch.randn(3, 7, 4, generator=gen)
    A_log, dt_bias = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    torch.testing.assert_close(gdn_gate(g, A_log, dt_bias), naive_gdn_gate(g, A_log, dt_bias))
    torch.testing.assert_close(gdn_gate(g, A_log), naive_gdn_gate(g, A_log))


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_reference_chunk_gdn_preprocessing(form):
    H, HV, K, V = 1, 2, 8, 8
    gen = _gen(15)
    q, k = (torch.randn(1, 33, H, K, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(1, 33, HV, V, generator=gen, dtype=F64)
    g_raw, b_raw = (torch.randn(1, 33, HV, generator=gen, dtype=F64) for _ in range(2))
    A_log, dt_bias = (torch.randn(HV, generator=gen, dtype=F64) for _ in range(2))
    cu = make_cu_seqlens([0, 13, 20])
    o, s = reference_chunk_gated_delta_rule(
        q,
        k,
        v,
        g_raw,
        b_raw,
        None,
        None,
        True,
        True,
        True,
        True,
        False,
        cu,
        use_gate_in_kernel=True,
        A_log=A_log,
        dt_bias=dt_bias,
        form=form,
        chunk_size=16,
    )
    ge = -A_log.exp() * F.softplus(g_raw + dt_bias)
    o_e, s_e = naive_recurrent_gated_delta_rule(
        _l2(q), _l2(k), v, g=ge, beta=2 * b_raw.sigmoid(), cu_seqlens=cu, output_final_state=True
    )
    _close(o_e, o, TIGHT)
    _close(s_e, s, 1e-7, "state")


@pytest.mark.parametrize("vf", [False, True], ids=["kv", "vfirst"])
def test_reference_fused_recurrent_gdn_gk_gv(vf):
    B, T, H, HV, K, V = 2, 15, 1, 2, 8, 4
    q, k, v, g, _, h0 = _inputs(B, T, H, HV, K, V, seed=16, scalar_gate=True)
    gen = _gen(17)
    gk = F.logsigmoid(torch.randn(B, T, HV, K, generator=gen, dtype=F64) + 2)
    gv = F.logsigmoid(torch.randn(B, T, HV, V, generator=gen, dtype=F64) + 2)
    beta_v = torch.rand(B, T, HV, V, generator=gen, dtype=F64)
    h0_in = h0.transpose(-1, -2) if vf else h0
    o, s = reference_fused_recurrent_gated_delta_rule(
        q,
        k,
        v,
        g=g,
        gk=gk,
        gv=gv,
        beta=beta_v,
        initial_state=h0_in,
        output_final_state=True,
        state_v_first=vf,
    )
    o_ref, s_ref = _oracle(q, k, v, gk=gk + g[..., None], gv=gv, beta=beta_v, h0=h0)
    _close(o_ref, o, TIGHT)
    _close(s_ref, s.transpose(-1, -2) if vf else s, 1e-7, "state")
    # beta=None means ones; only gv as decay
    o1, _ = reference_fused_recurrent_gated_delta_rule(q, k, v, gv=gv)
    o1_ref, _ = _oracle(q, k, v, gv=gv, beta=torch.ones(B, T, HV, dtype=F64))
    _close(o1_ref, o1, TIGHT)


def test_reference_fused_recurrent_gdn_gate_in_kernel():
    q, k, v, g_raw, beta, _ = _inputs(1, 12, 2, 2, 8, 8, seed=18, scalar_gate=True)
    A_log, dt_bias = torch.randn(2, dtype=F64), torch.randn(2, dtype=F64)
    o, _ = reference_fused_recurrent_gated_delta_rule(
        q,
        k,
        v,
        g=g_raw,
        beta=beta,
        use_gate_in_kernel=True,
        A_log=A_log,
        dt_bias=dt_bias,
        use_qk_l2norm_in_kernel=True,
    )
    o_e, _ = naive_recurrent_gated_delta_rule(_l2(q), _l2(k), v, g=gdn_gate(g_raw, A_log, dt_bias), beta=beta)
    _close(o_e, o, TIGHT)


# ------------------------------------------------------------------------------------------------------
# Simple GLA / Lightning
# ------------------------------------------------------------------------------------------------------

SGLA_CASES = [
    # gate kind, B, T, H, HV, chunk, state_v_first, varlen lengths
    ("g", 2, 63, 1, 1, 16, False, None),
    ("gamma", 1, 100, 2, 4, 64, True, None),
    ("both", 1, None, 1, 2, 16, False, [0, 1, 40, 17]),
    ("none", 1, 1, 1, 1, 16, True, None),
]


@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize(
    "case",
    SGLA_CASES,
    ids=lambda c: (
        f"{c[0]}-"
        + (f"B{c[1]}-T{c[2]}" if c[7] is None else "L" + "_".join(map(str, c[7])))
        + f"-H{c[3]}-HV{c[4]}-C{c[5]}"
        + ("-vfirst" if c[6] else "")
    ),
)
def test_simple_gla_chunk_matches_recurrent(case, reverse):
    kind, B, T, H, HV, C, vf, lens = case
    T = sum(lens) if lens else T
    q, k, v, g, _, _ = _inputs(B, T, H, HV, 16, 8, seed=19, scalar_gate=True)
    g_gamma = -torch.rand(HV, generator=_gen(20), dtype=F64) * 0.3
    g = g if kind in ("g", "both") else None
    g_gamma = g_gamma if kind in ("gamma", "both") else None
    N = len(lens) if lens else B
    h0 = torch.randn(N, HV, 16, 8, generator=_gen(21), dtype=F64)
    kw = {
        "initial_state": h0.transpose(-1, -2) if vf else h0,
        "output_final_state": True,
        "state_v_first": vf,
        "cu_seqlens": make_cu_seqlens(lens) if lens else None,
        "reverse": reverse,
    }
    o_r, s_r = naive_recurrent_simple_gla(q, k, v, g, g_gamma=g_gamma, **kw)
    o_c, s_c = naive_chunk_simple_gla(q, k, v, g, g_gamma=g_gamma, chunk_size=C, **kw)
    _close(o_r, o_c, TIGHT)
    _close(s_r, s_c, TIGHT, "state")
    if lens is None:
        gate = (g if g is not None else 0) + (g_gamma if g_gamma is not None else torch.zeros(HV, dtype=F64))
        gate = gate.expand(B, T, HV) if torch.is_tensor(gate) else gate
        flip = (lambda x: x.flip(1)) if reverse else (lambda x: x)
        o_ref, s_ref = _oracle(
            flip(q), flip(k), flip(v), gk=flip(gate)[..., None].expand(-1, -1, -1, 16), h0=h0, delta=False
        )
        _close(flip(o_ref), o_r, TIGHT, "o(oracle)")
        _close(s_ref, s_r.transpose(-1, -2) if vf else s_r, TIGHT, "state(oracle)")


def test_simple_gla_reverse_varlen_is_per_sequence_flip():
    lens = [3, 0, 20, 1]
    q, k, v, g, _, _ = _inputs(1, sum(lens), 1, 2, 8, 8, seed=22, scalar_gate=True)
    cu = make_cu_seqlens(lens)
    o, s = naive_chunk_simple_gla(
        q, k, v, g, reverse=True, cu_seqlens=cu, output_final_state=True, chunk_size=16
    )
    for n, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sl = slice(bos, eos)
        o_n, s_n = naive_recurrent_simple_gla(
            *(x[:, sl].flip(1) for x in (q, k, v, g)), output_final_state=True
        )
        torch.testing.assert_close(o_n.flip(1), o[:, sl], rtol=0, atol=1e-12)
        torch.testing.assert_close(s_n, s[n : n + 1], rtol=0, atol=1e-12)


def test_simple_gla_vs_fla_naive():
    pytest.importorskip("fla")
    from fla.ops.simple_gla import naive as fla_sgla

    q, k, v, g, _, h0 = _inputs(2, 100, 2, 2, 16, 8, seed=23, scalar_gate=True)
    o, s = naive_recurrent_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    f32 = [x.float() for x in (q, k, v, g)]
    o_f, s_f = fla_sgla.naive_recurrent_simple_gla(*f32, initial_state=h0.float(), output_final_state=True)
    _close(o, o_f, FP32)
    _close(s, s_f, FP32, "state")
    o_fc, s_fc = fla_sgla.naive_chunk_simple_gla(
        *f32, initial_state=h0.float(), output_final_state=True, chunk_size=64
    )
    _close(o, o_fc, FP32, "o(chunk)")
    _close(s, s_fc, FP32, "state(chunk)")


@pytest.mark.parametrize(
    "H,layer_idx,num_layers", [(1, 0, 1), (4, 0, 24), (8, 5, 24), (6, 23, 24), (64, 12, 48)]
)
def test_lightning_g_gamma_matches_fla(monkeypatch, H, layer_idx, num_layers):
    pytest.importorskip("fla")
    import fla.ops.lightning_attn.chunk as fla_lightning

    seen = {}

    def capture(**kwargs):
        seen.update(kwargs)
        return None, None

    # FLA builds g_gamma in chunk_lightning_attn and hands it to chunk_simple_gla; intercept it there
    monkeypatch.setattr(fla_lightning, "chunk_simple_gla", capture)
    x = torch.zeros(1, 2, H, 4)
    fla_lightning.chunk_lightning_attn(x, x, x, layer_idx=layer_idx, num_layers=num_layers)
    ours = lightning_g_gamma(H, layer_idx, num_layers)
    assert ours.dtype == seen["g_gamma"].dtype == torch.float32
    assert torch.equal(ours, seen["g_gamma"])


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_lightning_is_simple_gla_with_negated_decay(form):
    q, k, v, _, _, h0 = _inputs(1, 50, 2, 2, 16, 16, seed=24)
    decay = torch.tensor([0.0, 0.25], dtype=F64)
    o, s = reference_lightning_attn(q, k, v, decay, initial_state=h0, output_final_state=True, form=form)
    o_e, s_e = reference_chunk_simple_gla(
        q, k, v, g_gamma=-decay, initial_state=h0, output_final_state=True, form="recurrent"
    )
    _close(o_e, o, TIGHT)
    _close(s_e, s, 1e-7, "state")
    o2, _ = reference_chunk_lightning_attn(q, k, v, layer_idx=3, num_layers=8, form=form)
    o2_e, _ = naive_recurrent_simple_gla(q, k, v, g_gamma=lightning_g_gamma(2, 3, 8).double())
    _close(o2_e, o2, TIGHT)


# ------------------------------------------------------------------------------------------------------
# Autograd
# ------------------------------------------------------------------------------------------------------


def _leaves(*xs):
    return [x.detach().clone().requires_grad_(True) for x in xs]


def test_gradcheck_kda_chunk_full_preprocessing():
    H, HV, K, V = 1, 2, 3, 2
    gen = _gen(30)
    q, k = (torch.randn(1, 5, H, K, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(1, 5, HV, V, generator=gen, dtype=F64)
    g = torch.randn(1, 5, HV, K, generator=gen, dtype=F64)
    beta = torch.randn(1, 5, HV, generator=gen, dtype=F64)
    h0 = torch.randn(2, HV, K, V, generator=gen, dtype=F64)
    A_log = torch.randn(HV, generator=gen, dtype=F64)
    dt_bias = torch.randn(HV * K, generator=gen, dtype=F64)
    cu = make_cu_seqlens([2, 3])

    def fn(q, k, v, g, beta, h0, A_log, dt_bias):
        return reference_chunk_kda(
            q,
            k,
            v,
            g,
            beta,
            initial_state=h0,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            A_log=A_log,
            dt_bias=dt_bias,
            cu_seqlens=cu,
            chunk_size=2,
        )[0]

    assert torch.autograd.gradcheck(fn, _leaves(q, k, v, g, beta, h0, A_log, dt_bias), fast_mode=True)


def test_gradcheck_kda_recurrent_per_value_beta():
    q, k, v, g, _, h0 = _inputs(1, 4, 1, 1, 3, 2, seed=31)
    beta = torch.rand(1, 4, 1, 2, generator=_gen(32), dtype=F64)

    def fn(q, k, v, g, beta, h0):
        o, s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        return o, s

    assert torch.autograd.gradcheck(fn, _leaves(q, k, v, g, beta, h0), fast_mode=True)


def test_gradcheck_gdn_chunk_state_v_first():
    q, k, v, g, beta, h0 = _inputs(1, 6, 1, 2, 3, 2, seed=33, scalar_gate=True)

    def fn(q, k, v, g, beta, h0):
        return naive_chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, state_v_first=True, chunk_size=4
        )

    assert torch.autograd.gradcheck(fn, _leaves(q, k, v, g, beta, h0.transpose(-1, -2)), fast_mode=True)


def test_gradcheck_simple_gla_and_lightning():
    q, k, v, g, _, h0 = _inputs(1, 5, 1, 1, 3, 2, seed=34, scalar_gate=True)
    cu = make_cu_seqlens([1, 4])
    h0 = torch.cat([h0, h0.flip(-1)])

    def sgla(q, k, v, g, h0):
        return naive_chunk_simple_gla(
            q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu, reverse=True, chunk_size=2
        )

    assert torch.autograd.gradcheck(sgla, _leaves(q, k, v, g, h0), fast_mode=True)

    def lightning(q, k, v, decay):
        return reference_lightning_attn(q, k, v, decay, chunk_size=2)[0]

    assert torch.autograd.gradcheck(
        lightning, _leaves(q, k, v, torch.tensor([0.3], dtype=F64)), fast_mode=True
    )


def test_kda_chunk_gradients_match_recurrent():
    q, k, v, g, beta, h0 = _inputs(1, 40, 1, 2, 8, 8, seed=35)
    grads = []
    for fn, kw in ((naive_recurrent_kda, {}), (naive_chunk_kda, {"chunk_size": 16})):
        xs = _leaves(q, k, v, g, beta, h0)
        o, s = fn(*xs[:5], initial_state=xs[5], output_final_state=True, **kw)
        (o.pow(2).sum() + s.pow(2).sum()).backward()
        grads.append([x.grad for x in xs])
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], *grads):
        _close(a, b, TIGHT, name)


def test_strong_decay_float32_matches_float64():
    # per-step log decays down to -30 push float32 exp() into the subnormal range, which the references
    # flush to zero; the result must still match the float64 recurrence
    q, k, v, _, beta, h0 = _inputs(1, 70, 1, 2, 16, 8, seed=36)
    g = -30 * torch.rand(1, 70, 2, 16, generator=_gen(37), dtype=F64)
    o64, s64 = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    f32 = [x.float() for x in (q, k, v, g, beta)]
    for fn, kw in ((naive_recurrent_kda, {}), (naive_chunk_kda, {"chunk_size": 64})):
        o32, s32 = fn(*f32, initial_state=h0.float(), output_final_state=True, **kw)
        assert o32.dtype == torch.float32
        _close(o64, o32, FP32)
        _close(s64, s32, FP32, "state")


# ------------------------------------------------------------------------------------------------------
# GPU: the references against FLA's Triton kernels (run by the lead on the H200)
# ------------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_TOL = 5e-3  # FLA's own tolerance for outputs and states


@pytest.mark.gpu
@needs_cuda
def test_gpu_preprocessing_matches_fla_triton():
    from fla.modules.l2norm import l2norm_fwd
    from fla.ops.gated_delta_rule.gate import fused_gdn_gate
    from fla.ops.kda.gate import fused_kda_gate

    from cula.kda.naive import l2norm

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(40)
    x = torch.randn(2, 100, 4, 128, device=dev, generator=gen)
    torch.testing.assert_close(l2norm_fwd(x)[0], l2norm(x), rtol=1e-5, atol=1e-6)
    HV, K = 4, 64
    g = 8 * torch.randn(2, 100, HV, K, device=dev, generator=gen)
    A_log = torch.randn(HV, device=dev, generator=gen)
    dt_bias = torch.randn(HV * K, device=dev, generator=gen)
    for lb, a in ((None, A_log), (-5.0, A_log), (-5.0, None)):
        torch.testing.assert_close(
            fused_kda_gate(g, a, dt_bias, lower_bound=lb),
            kda_gate(g, a, dt_bias, lower_bound=lb),
            rtol=1e-4,
            atol=1e-5,
        )
    gs = 8 * torch.randn(2, 100, HV, device=dev, generator=gen)
    torch.testing.assert_close(
        fused_gdn_gate(gs, A_log, dt_bias[:HV]), gdn_gate(gs, A_log, dt_bias[:HV]), rtol=1e-4, atol=1e-5
    )


def _gpu_inputs(lens, H, HV, K, V, scalar_gate=False, seed=41):
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(seed)
    T, N = sum(lens), len(lens)
    bf = torch.bfloat16
    q = torch.randn(1, T, H, K, device=dev, generator=gen).to(bf)
    k = torch.randn(1, T, H, K, device=dev, generator=gen).to(bf)
    v = torch.randn(1, T, HV, V, device=dev, generator=gen).to(bf)
    g = torch.randn(1, T, HV, *(() if scalar_gate else (K,)), device=dev, generator=gen).to(bf)
    beta = torch.randn(1, T, HV, device=dev, generator=gen).to(bf)
    h0 = torch.randn(N, HV, K, V, device=dev, generator=gen)
    cu = make_cu_seqlens(lens, device=dev, dtype=torch.long)
    return q, k, v, g, beta, h0, cu


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("vf", [False, True], ids=["kv", "vfirst"])
def test_gpu_reference_kda_vs_fla_chunk_kda(vf):
    from fla.ops.kda import chunk_kda

    q, k, v, g, beta, h0, cu = _gpu_inputs([63, 7, 200], 2, 4, 64, 64)
    h0 = h0.transpose(-1, -2).contiguous() if vf else h0
    A_log = torch.rand(4, device="cuda")
    dt_bias = torch.randn(4 * 64, device="cuda")
    flags = {
        "initial_state": h0,
        "output_final_state": True,
        "use_qk_l2norm_in_kernel": True,
        "use_gate_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
        "lower_bound": -5.0,
        "A_log": A_log,
        "dt_bias": dt_bias,
        "state_v_first": vf,
        "cu_seqlens": cu,
    }
    o_f, s_f = chunk_kda(q, k, v, g, beta, **flags)
    o_r, s_r = reference_chunk_kda(q, k, v, g, beta, compute_dtype=F64, **flags)
    assert o_r.dtype == torch.bfloat16 and s_r.dtype == torch.float32
    _close(o_r, o_f, GPU_TOL)
    _close(s_r, s_f, GPU_TOL, "state")


@pytest.mark.gpu
@needs_cuda
def test_gpu_reference_gdn_vs_fla_chunk_gated_delta_rule():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k, v, g, beta, h0, cu = _gpu_inputs([63, 7, 200], 2, 4, 64, 64, scalar_gate=True)
    A_log, dt_bias = torch.rand(4, device="cuda"), torch.randn(4, device="cuda")
    args = (q, k, v, g, beta, None, h0, True, True, True, False, False, cu)
    extra = {"use_gate_in_kernel": True, "A_log": A_log, "dt_bias": dt_bias}
    o_f, s_f = chunk_gated_delta_rule(*args, **extra)
    o_r, s_r = reference_chunk_gated_delta_rule(*args, compute_dtype=F64, **extra)
    _close(o_r, o_f, GPU_TOL)
    _close(s_r, s_f, GPU_TOL, "state")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_gpu_reference_simple_gla_vs_fla(reverse):
    from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla

    q, k, v, g, _, h0, cu = _gpu_inputs([63, 7, 200], 4, 4, 64, 64, scalar_gate=True)
    g = F.logsigmoid(g.float() + 3)
    g_gamma = -torch.rand(4, device="cuda") * 0.2
    kw = {"initial_state": h0, "output_final_state": True, "cu_seqlens": cu}
    o_r, s_r = reference_chunk_simple_gla(q, k, v, g, None, reverse=reverse, compute_dtype=F64, **kw)
    o_f, s_f = fused_recurrent_simple_gla(q, k, v, g, None, reverse=reverse, **kw)
    _close(o_r, o_f, GPU_TOL)
    _close(s_r, s_f, GPU_TOL, "state")
    if not reverse:
        o_r, s_r = reference_chunk_simple_gla(q, k, v, None, g_gamma, compute_dtype=F64, **kw)
        o_f, s_f = chunk_simple_gla(q, k, v, None, g_gamma, **kw)
        _close(o_r, o_f, GPU_TOL, "o(g_gamma)")
        _close(s_r, s_f, GPU_TOL, "state(g_gamma)")


@pytest.mark.parametrize(
    "module, name",
    [
        ("kda", "naive_recurrent_kda"),
        ("kda", "naive_chunk_kda"),
        ("gated_delta_rule", "naive_recurrent_gated_delta_rule"),
        ("gated_delta_rule", "naive_chunk_gated_delta_rule"),
        ("simple_gla", "naive_recurrent_simple_gla"),
        ("simple_gla", "naive_chunk_simple_gla"),
    ],
)
def test_naive_functions_take_flas_positional_arguments(module, name):
    """``cula.<op>.naive`` mirrors ``fla.ops.<op>.naive``: a function of the same name takes FLA 0.6.0's
    parameters in FLA's order with FLA's defaults (the same positional call means the same thing in both), and
    cula's extras only by keyword."""
    import importlib
    import inspect

    pytest.importorskip("fla")
    ours = inspect.signature(getattr(importlib.import_module(f"cula.{module}.naive"), name)).parameters
    theirs = inspect.signature(getattr(importlib.import_module(f"fla.ops.{module}.naive"), name)).parameters
    positional = [p for p in ours.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional] == list(theirs), (name, [p.name for p in positional], list(theirs))
    for p in positional:
        if theirs[p.name].default is not inspect.Parameter.empty:
            assert p.default == theirs[p.name].default, (name, p.name, p.default, theirs[p.name].default)
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours.values() if p.name not in theirs)


@pytest.mark.parametrize("gate", [-1e8, float("-inf")])
def test_chunk_form_with_a_hard_reset(gate):
    """A step whose decay wipes the state (-inf, or one far past the flush point) inside a chunk: the chunked
    reference equals the recurrent one (no NaN from -inf - -inf, no digits lost to cancellation)."""
    import cula.simple_gla as cs

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 70, 2, 8) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, 70, 2))
    g[0, 10], g[0, 40, 0] = gate, gate
    o1, h1 = cs.chunk_simple_gla(q, k, v, g=g, output_final_state=True)
    o2, h2 = cs.fused_recurrent_simple_gla(q, k, v, g=g, output_final_state=True)
    assert not torch.isnan(o1).any()
    torch.testing.assert_close(o1, o2, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h1, h2, rtol=1e-4, atol=1e-4)
