"""The backward-stage references of ``cula.kda.naive_bwd`` on the CPU: against autograd through the forward
quantities they differentiate, and against FLA 0.6.0's own Triton kernel for the stage, run by Triton's
interpreter (``TRITON_INTERPRET=1``, in a subprocess: the variable has to be set before triton is imported)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cula.kda.naive_bwd import (
    chunk_kda_bwd_dhu_reference,
    chunk_kda_bwd_gate_reference,
    chunk_kda_bwd_intra_reference,
    chunk_kda_bwd_wy_dqkg_reference,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BT = 64


def _intra_case(B, T, H, HV, K, lens=None, seed=0):
    """Inputs of the intra backward stage: l2-normed q / k, a chunk-local log2 gate cumsum (restarting at every
    chunk and sequence start), beta in (0, 1), random score gradients and incoming accumulations."""
    gen = torch.Generator().manual_seed(seed)
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    a = -0.5 * torch.rand(B, T, HV, K, generator=gen)  # log2 decay a step
    g = torch.empty_like(a)
    for c0, c1 in _chunk_bounds(T, cu):
        g[:, c0:c1] = a[:, c0:c1].cumsum(1)
    beta = torch.rand(B, T, HV, generator=gen)
    dAqk, dAkk = (torch.randn(B, T, HV, BT, generator=gen) for _ in range(2))
    acc = [torch.randn(B, T, HV, K, generator=gen), torch.randn(B, T, HV, K, generator=gen),
           torch.randn(B, T, HV, generator=gen), torch.randn(B, T, HV, K, generator=gen)]  # fmt: skip
    return dict(q=q, k=k, g=g, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=acc[0], dk=acc[1], db=acc[2], dg=acc[3],
                cu_seqlens=cu)  # fmt: skip


def _chunk_bounds(T, cu):
    starts = [0] if cu is None else cu[:-1].tolist()
    ends = [T] if cu is None else cu[1:].tolist()
    return [(c, min(c + BT, e)) for s, e in zip(starts, ends) for c in range(s, e, BT)]


def _autograd_intra(case):
    """The same gradients by autograd through P (Aqk before its scale) and L (Akk) built from q, k, g, beta."""
    q, k, g, beta = (case[n].double().requires_grad_() for n in ("q", "k", "g", "beta"))
    B, T, H, K = q.shape
    HV = g.shape[2]
    loss = 0.0
    for c0, c1 in _chunk_bounds(T, case["cu_seqlens"]):
        n = c1 - c0
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        for hv in range(HV):
            h = hv // (HV // H)
            qc, kc, gc = q[:, c0:c1, h], k[:, c0:c1, h], g[:, c0:c1, hv]
            diff = (gc[:, :, None] - gc[:, None, :]).masked_fill(~causal[None, :, :, None], float("-inf"))
            E = torch.exp2(diff)
            P = torch.einsum("bti,bsi,btsi->bts", qc, kc, E)
            L = torch.einsum("bti,bsi,btsi->bts", kc, kc, E) * beta[:, c0:c1, hv, None]
            loss = loss + (P * case["dAqk"][:, c0:c1, hv, :n].double() * causal).sum()
            loss = loss + (L * case["dAkk"][:, c0:c1, hv, :n].double() * causal).sum()
    loss.backward()
    return (case["dq"].double() + q.grad, case["dk"].double() + k.grad if HV == H else None,
            case["db"].double() + beta.grad, case["dg"].double() + g.grad / math.log(2))  # fmt: skip


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# Ahead of every interpreted script: FLA's autotuners take one configuration (each would run them all, slowly, in
# the interpreter), and the tests folder is importable for the case builders.
_PRELUDE = """import json, sys
from triton.runtime.autotuner import Autotuner
prune = Autotuner.prune_configs
Autotuner.prune_configs = lambda self, *a, **k: sorted(prune(self, *a, **k),
                                                     key=lambda c: (c.num_stages, c.num_warps))[:1]
sys.path.insert(0, "tests")
import torch
"""


def _interpreted(script: str, *args: str) -> dict:
    """Run ``script`` (which imports FLA's Triton kernels; ``json``, ``sys`` and ``torch`` are imported) under
    Triton's CPU interpreter in a subprocess and return the JSON it prints after ``@@``."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _PRELUDE + script, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900, check=False)  # fmt: skip
    line = [x for x in proc.stdout.splitlines() if x.startswith("@@")]
    assert proc.returncode == 0 and line, (proc.stdout + proc.stderr)[-3000:]
    return json.loads(line[0][2:])


@pytest.mark.parametrize(
    "B,T,H,HV,K,lens",
    [(1, 64, 1, 1, 32, None), (2, 100, 2, 2, 64, None), (1, 150, 1, 1, 32, [37, 1, 112])],
    ids=["one-chunk", "odd-T", "varlen"],
)
def test_intra_reference_matches_autograd(B, T, H, HV, K, lens):
    """dq, dk, db and dg (natural-log units) against autograd through the scores, fixed and packed batches."""
    case = _intra_case(B, T, H, HV, K, lens)
    want = _autograd_intra(case)
    got = chunk_kda_bwd_intra_reference(**case, chunk_size=BT)
    for name, w, x in zip(("dq", "dk", "db", "dg"), want, got):
        if w is not None:
            assert _rel(x, w) < 1e-6, name


def test_intra_reference_gva_sums_to_the_shared_heads():
    """GVA: per value head, the q / k of its group's head; summing dq over the group gives autograd's dq."""
    case = _intra_case(1, 80, 1, 2, 32)
    got = chunk_kda_bwd_intra_reference(**case, chunk_size=BT)
    want = _autograd_intra(dict(case, dq=torch.zeros_like(case["dq"][:, :, :1])))
    dq_group = (got[0] - case["dq"]).sum(2, keepdim=True)
    assert _rel(dq_group, want[0]) < 1e-6
    assert _rel(got[2], want[2]) < 1e-6 and _rel(got[3], want[3]) < 1e-6


_FLA_SCRIPT = textwrap.dedent(
    """
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra
    from cula.kda.naive_bwd import chunk_kda_bwd_intra_reference
    from test_naive_bwd import _intra_case
    out = {}
    for name, args, safe in json.loads(sys.argv[1]):
        case = _intra_case(*args)
        fla = chunk_kda_bwd_intra(**{n: (v.clone() if torch.is_tensor(v) else v) for n, v in case.items()},
                                  chunk_size=64, safe_gate=safe)
        ref = chunk_kda_bwd_intra_reference(**case, chunk_size=64)
        out[name] = [float((f.double() - r.double()).norm() / r.double().norm()) for f, r in zip(fla, ref)]
    print("@@" + json.dumps(out))
    """
)


def test_intra_reference_matches_fla_kernel():
    """FLA's chunk_kda_bwd_intra (its Triton kernel under the interpreter) against the reference: GVA, odd T, a
    packed batch with a length-1 sequence (they agree to ~5e-8). ``safe_gate=True`` (the same math, anchored
    differently for range) does not run under Triton 3.9's interpreter: one of its helpers is not a jit function
    there; it is for a GPU test."""
    pytest.importorskip("fla.ops.kda.chunk_intra")
    cases = [("gva-odd", [2, 100, 1, 2, 64, None], False), ("varlen", [1, 150, 1, 1, 32, [37, 1, 112]], False)]
    for name, errs in _interpreted(_FLA_SCRIPT, json.dumps(cases)).items():
        for what, err in zip(("dq", "dk", "db", "dg"), errs):
            assert err < 1e-5, (name, what, err)


def test_gate_reference_is_the_cumsum_and_gate_gradient():
    """dg_raw, dA_log, ddt_bias against autograd through the chunk-local cumsum of the activated gate."""
    from cula.kda.naive import kda_gate

    gen = torch.Generator().manual_seed(3)
    B, T, HV, K = 1, 150, 2, 32
    cu = torch.tensor([0, 37, 38, 150], dtype=torch.int32)
    g_raw, dG = (torch.randn(B, T, HV, K, generator=gen, dtype=torch.float64) for _ in range(2))
    A_log, dt_bias = torch.randn(HV, generator=gen), torch.randn(HV * K, generator=gen)
    for lb in (None, -5.0):
        x, A, b = (t.clone().double().requires_grad_() for t in (g_raw, A_log, dt_bias))
        a = kda_gate(x, A, b, lb)
        G = torch.cat([a[:, c0:c1].cumsum(1) for c0, c1 in _chunk_bounds(T, cu)], 1)
        (G * dG).sum().backward()
        got = chunk_kda_bwd_gate_reference(dG, g_raw, A_log.double(), dt_bias.double(), lb, cu_seqlens=cu)
        for w, x_ in zip((x.grad, A.grad, b.grad), got):
            assert _rel(x_, w) < 1e-10


_FLA_GATE_SCRIPT = textwrap.dedent(
    """
    from fla.ops.kda.gate import kda_gate_bwd
    from fla.ops.utils.cumsum import chunk_local_cumsum
    from cula.kda.naive_bwd import chunk_kda_bwd_gate_reference
    gen = torch.Generator().manual_seed(4)
    out = {}
    for name, lens, lb in [("fixed-softplus", None, None), ("varlen-lower-bound", [37, 1, 112], -5.0)]:
        T = 150 if lens is None else sum(lens)
        cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        g_raw = torch.randn(1, T, 2, 32, generator=gen)
        dG = torch.randn(1, T, 2, 32, generator=gen)
        A_log, dt_bias = torch.randn(2, generator=gen), torch.randn(64, generator=gen)
        da = chunk_local_cumsum(dG.clone(), chunk_size=64, reverse=True, cu_seqlens=cu)
        fla = kda_gate_bwd(g=g_raw, A_log=A_log, dt_bias=dt_bias, dyg=da, lower_bound=lb)
        ref = chunk_kda_bwd_gate_reference(dG, g_raw, A_log, dt_bias, lb, cu_seqlens=cu)
        out[name] = [float((f.double() - r.double()).norm() / r.double().norm()) for f, r in zip(fla, ref)]
    print("@@" + json.dumps(out))
    """
)


def test_gate_reference_matches_fla_kernels():
    """FLA's reverse chunk_local_cumsum + kda_gate_bwd (Triton interpreter) against the reference: the softplus
    gate on a fixed batch, the lower-bound sigmoid gate on a packed one with a length-1 sequence."""
    pytest.importorskip("fla.ops.kda.gate")
    for name, errs in _interpreted(_FLA_GATE_SCRIPT).items():
        for what, err in zip(("dg_raw", "dA_log", "ddt_bias"), errs):
            assert err < 1e-5, (name, what, err)


# ----------------------------------------------------------------------------------- stage 6: wy_dqkg_fused


def _wy_case(B, T, H, HV, K, V, lens=None, state_v_first=False, seed=0):
    """Inputs of stage 6 and the strictly lower ``L`` whose chunk inverses ``(I + L)^-1`` are its ``A``: l2-normed
    q / k, a chunk-local log2 gate cumsum, beta in (0, 1), random v, v_new, do, dv and per-chunk states h, dh."""
    gen = torch.Generator().manual_seed(seed)
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    bounds = _chunk_bounds(T, cu)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    a = -0.3 * torch.rand(B, T, HV, K, generator=gen)
    g = torch.empty_like(a)
    L = 0.2 * torch.randn(B, T, HV, BT, generator=gen)
    A = torch.zeros_like(L)
    for c0, c1 in bounds:
        n = c1 - c0
        g[:, c0:c1] = a[:, c0:c1].cumsum(1)
        L[:, c0:c1, :, :n] *= torch.ones(n, n).tril(-1)[None, :, None, :]
        L[:, c0:c1, :, n:] = 0
        Lc = L[:, c0:c1, :, :n].permute(0, 2, 1, 3)  # [B, HV, n, n]
        A[:, c0:c1, :, :n] = torch.linalg.inv(torch.eye(n) + Lc).permute(0, 2, 1, 3)
    v, v_new, do, dv = (torch.randn(B, T, HV, V, generator=gen) for _ in range(4))
    state = (B, len(bounds), HV, *((V, K) if state_v_first else (K, V)))
    h, dh = (0.5 * torch.randn(*state, generator=gen) for _ in range(2))
    beta = torch.rand(B, T, HV, generator=gen)
    case = dict(q=q, k=k, v=v, v_new=v_new, g=g, beta=beta, A=A, h=h, do=do, dh=dh, dv=dv, scale=K**-0.5,
                state_v_first=state_v_first, cu_seqlens=cu)  # fmt: skip
    return case, L


def _autograd_wy(case, L):
    """Stage 6's gradients by autograd through the forward terms it differentiates (H == HV): the state part of
    o against do, S_next against dh, v_new = T beta v - T beta k G S against dv, with T = (I + L)^-1."""
    q, k, v, g, beta, L = (x.double().requires_grad_() for x in (case["q"], case["k"], case["v"], case["g"],
                                                                 case["beta"], L))  # fmt: skip
    B, T, HV, K = g.shape
    h, dh = case["h"].double(), case["dh"].double()
    if case["state_v_first"]:
        h, dh = h.transpose(-1, -2), dh.transpose(-1, -2)
    loss = 0.0
    cu = case["cu_seqlens"]
    for c, (c0, c1) in enumerate(_chunk_bounds(T, cu)):
        n = c1 - c0
        for hv in range(HV):
            S, dS = h[:, c, hv], dh[:, c, hv]
            qc, kc, vc, gc, bc = (x[:, c0:c1, hv] for x in (q, k, v, g, beta))
            vn, doc, du = (case[x][:, c0:c1, hv].double() for x in ("v_new", "do", "dv"))
            Tm = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + L[:, c0:c1, hv, :n])
            G, gamma = torch.exp2(gc), torch.exp2(gc[:, -1:])
            o = case["scale"] * (qc * G) @ S
            s_next = gamma.transpose(-1, -2) * S + (kc * gamma / G).transpose(-1, -2) @ vn
            v_expr = Tm @ (bc[..., None] * vc) - Tm @ (bc[..., None] * kc * G) @ S
            loss = loss + (o * doc).sum() + (s_next * dS).sum() + (v_expr * du).sum()
    loss.backward()
    strict = torch.zeros_like(L, dtype=torch.bool)
    for c0, c1 in _chunk_bounds(T, cu):
        strict[:, c0:c1, :, : c1 - c0] = torch.ones(c1 - c0, c1 - c0, dtype=torch.bool).tril(-1)[None, :, None, :]
    return q.grad, k.grad, v.grad, beta.grad, g.grad / math.log(2), L.grad * strict


@pytest.mark.parametrize(
    "B,T,K,V,lens,state_v_first",
    [(1, 64, 32, 32, None, False), (2, 100, 32, 64, None, True), (1, 150, 32, 32, [37, 1, 112], False)],
    ids=["one-chunk", "odd-T-v-first", "varlen"],
)
def test_wy_dqkg_reference_matches_autograd(B, T, K, V, lens, state_v_first):
    """dq, dk, dv, db, dg (natural-log units) and dA (the gradient of L) against autograd, fixed and packed (the
    case's A is a float32 inverse, autograd's float64: ~1e-7 apart)."""
    case, L = _wy_case(B, T, 2, 2, K, V, lens, state_v_first)
    want = _autograd_wy(case, L)
    got = chunk_kda_bwd_wy_dqkg_reference(**{n: x.double() if torch.is_tensor(x) and x.is_floating_point() else x
                                             for n, x in case.items()}, chunk_size=BT)  # fmt: skip
    for name, w, x in zip(("dq", "dk", "dv", "db", "dg", "dA"), want, got):
        assert x.dtype == torch.float64 and x.shape == w.shape, name
        assert _rel(x, w) < 1e-6, name


_FLA_WY_SCRIPT = textwrap.dedent(
    """
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_wy_dqkg_fused
    from cula.kda.naive_bwd import chunk_kda_bwd_wy_dqkg_reference
    from test_naive_bwd import _wy_case
    out = {}
    for name, args in json.loads(sys.argv[1]):
        case, _ = _wy_case(*args)
        fla = chunk_kda_bwd_wy_dqkg_fused(**case, chunk_size=64)
        ref = chunk_kda_bwd_wy_dqkg_reference(**case, chunk_size=64)
        out[name] = [float((f.double() - r.double()).norm() / r.double().norm()) for f, r in zip(fla, ref)]
    print("@@" + json.dumps(out))
    """
)


def test_wy_dqkg_reference_matches_fla_kernel():
    """FLA's chunk_kda_bwd_wy_dqkg_fused (Triton interpreter) against the reference: GVA with an odd T in both
    state layouts, a packed batch with a length-1 sequence (they agree to ~2e-7). fp32 inputs throughout, so
    FLA's casts of dw, k G and the dA products to A's dtype round nothing: the interpreter's bf16 loads return
    garbage (Triton 3.9), so the bf16 rounding is for a GPU test."""
    pytest.importorskip("fla.ops.kda.chunk_bwd")
    cases = [("gva-odd", [2, 100, 1, 2, 64, 64, None, False]), ("gva-v-first", [1, 70, 1, 2, 64, 32, None, True]),
             ("varlen", [1, 150, 1, 1, 32, 64, [37, 1, 112], False])]  # fmt: skip
    for name, errs in _interpreted(_FLA_WY_SCRIPT, json.dumps(cases)).items():
        for what, err in zip(("dq", "dk", "dv", "db", "dg", "dA"), errs):
            assert err < 1e-5, (name, what, err)


# ------------------------------------------------------------------------------------------ state gradients (stage 5)
def _dhu_case(B, T, HV, K, V, lens, state_v_first, seed=0):
    """Inputs of FLA's chunk_gated_delta_rule_bwd_dhu as chunk_kda_bwd passes them (qg, kg, w, do, dv, the
    chunk-local log2 gate cumsum gk, an initial state's presence, dht), fp32."""
    gen = torch.Generator().manual_seed(seed)
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    r = lambda *s: 0.5 * torch.randn(*s, generator=gen)  # noqa: E731
    a = -0.3 * torch.rand(B, T, HV, K, generator=gen)
    gk = torch.empty_like(a)
    for c0, c1 in _chunk_bounds(T, cu):
        gk[:, c0:c1] = a[:, c0:c1].cumsum(1)
    N = B if cu is None else len(lens)
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    return dict(q=r(B, T, HV, K), k=r(B, T, HV, K), w=r(B, T, HV, K), do=r(B, T, HV, V), dv=r(B, T, HV, V), gk=gk,
                h0=torch.zeros(shape), dht=r(*shape), scale=0.3, state_v_first=state_v_first, cu_seqlens=cu)


_FLA_DHU_SCRIPT = textwrap.dedent(
    """
    import builtins
    import fla.ops.common.chunk_delta_h as dh_mod
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
    from cula.kda.naive_bwd import chunk_kda_bwd_dhu_reference

    class Index(int):  # the kernel converts its loop index with .to(tl.int64), which a Python int lacks
        def to(self, *args, **kwargs):
            return self

    dh_mod.range = lambda *a: (Index(i) for i in builtins.range(*(int(x) for x in a)))
    from test_naive_bwd import _dhu_case
    out = {}
    for name, args in json.loads(sys.argv[1]):
        case = _dhu_case(*args)
        fla = chunk_gated_delta_rule_bwd_dhu(**case, chunk_size=64)
        ref = chunk_kda_bwd_dhu_reference(**case, chunk_size=64)
        out[name] = [float((f.double() - r.double()).norm() / r.double().norm()) for f, r in zip(fla, ref)]
    print("@@" + json.dumps(out))
    """
)


def test_dhu_reference_matches_fla_kernel():
    """FLA's chunk_gated_delta_rule_bwd_dhu with the per-channel gate (Triton interpreter) against the reference:
    an odd T over two batch rows, the [V, K] layout, and a packed batch with a length-1 sequence; fp32 inputs
    (the interpreter's bf16 loads are not to be trusted, see above)."""
    pytest.importorskip("fla.ops.common.chunk_delta_h")
    cases = [("odd-T", [2, 100, 2, 32, 64, None, False]), ("v-first", [1, 130, 1, 64, 32, None, True]),
             ("varlen", [1, 150, 2, 32, 32, [37, 1, 112], False])]  # fmt: skip
    for name, errs in _interpreted(_FLA_DHU_SCRIPT, json.dumps(cases)).items():
        for what, err in zip(("dh", "dh0", "dv2"), errs):
            assert err < 1e-5, (name, what, err)


def test_dhu_reference_is_the_gradient():
    """The reference's dh0 and dv2 are the gradients of the forward recurrence's outputs by autograd (float64,
    no rounding): o = scale qg S + (terms without S), S_next = diag(gamma) S + kg^T (u - w S) with u's gradient
    dv, against a loss with do on o and dht on the final state."""
    B, T, HV, K, V = 1, 150, 2, 16, 8
    case = _dhu_case(B, T, HV, K, V, None, False, seed=3)
    q, k, w, do, dv, gk = (case[n].double() for n in ("q", "k", "w", "do", "dv", "gk"))
    S0 = torch.randn(B, HV, K, V, dtype=torch.float64, requires_grad=True)
    u = torch.randn(B, T, HV, V, dtype=torch.float64, requires_grad=True)
    S, loss = S0, 0.0
    for c0, c1 in _chunk_bounds(T, None):
        loss = loss + (do[:, c0:c1] * (0.3 * torch.einsum("bnhk,bhkv->bnhv", q[:, c0:c1], S))).sum()
        v_new = u[:, c0:c1] - torch.einsum("bnhk,bhkv->bnhv", w[:, c0:c1], S)
        loss = loss + (dv[:, c0:c1] * v_new).sum()  # dv: the gradient reaching v_new from the outputs' scores
        S = torch.exp2(gk[:, c1 - 1])[..., None] * S + torch.einsum("bnhk,bnhv->bhkv", k[:, c0:c1], v_new)
    loss = loss + (case["dht"].double() * S).sum()
    loss.backward()
    dh, dh0, dv2 = chunk_kda_bwd_dhu_reference(**{**case, "q": q, "k": k, "w": w, "do": do, "dv": dv, "gk": gk,
                                                  "dht": case["dht"].double()})  # fmt: skip
    assert _rel(dh0, S0.grad) < 1e-12
    assert _rel(dv2, u.grad) < 1e-12
