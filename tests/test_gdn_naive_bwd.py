"""``cula.gated_delta_rule.naive_bwd.chunk_bwd_dqkwg_reference`` against FLA 0.6.0's ``chunk_bwd_dqkwg`` (its Triton
kernel under Triton's CPU interpreter, in a subprocess): the gated stage with dw (Gated DeltaNet), GVA with an odd
length, [V, K] states, a packed batch with a length-1 sequence, the constant-decay (``g_gamma``) and ungated forms."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from test_naive_bwd import _interpreted

from cula.gated_delta_rule.naive_bwd import chunk_bwd_dqkwg_reference
from cula.testing import make_cu_seqlens

BT = 64


def _dqkwg_case(B, T, H, HV, K, V, lens, state_v_first, gate, with_dw, seed=0):
    """Random fp32 inputs of the stage (``gate``: "g", "gamma" or None); chunk-local base-2 cumsums for g."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    cu = make_cu_seqlens(lens) if lens else None
    bounds = [(b * T, b * T + T) for b in range(B)] if cu is None else list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    chunks = sum(-(-(e - s) // BT) for s, e in bounds)
    inner = (V, K) if state_v_first else (K, V)
    case = dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, HV, V), do=rnd(B, T, HV, V),
                h=rnd(1, chunks, HV, *inner) * 0.1, dh=rnd(1, chunks, HV, *inner) * 0.1, scale=0.3,
                state_v_first=state_v_first, cu_seqlens=cu)  # fmt: skip
    if cu is None:
        case["h"], case["dh"] = (x.view(B, chunks // B, HV, *inner) for x in (case["h"], case["dh"]))
    if gate == "g":
        raw = -torch.rand(B, T, HV, generator=gen) * 0.5
        g = torch.zeros_like(raw)
        flat_raw, flat_g = raw.view(-1, HV), g.view(-1, HV)
        for s, e in bounds:  # chunk-local cumsum, restarting at chunk and sequence starts
            for c in range(s, e, BT):
                flat_g[c : min(c + BT, e)] = flat_raw[c : min(c + BT, e)].cumsum(0)
        case["g"] = g
    elif gate == "gamma":
        case["g_gamma"] = -torch.rand(HV, generator=gen) * 0.1
    if with_dw:
        case.update(w=rnd(B, T, HV, K), dv=rnd(B, T, HV, V))
    return case


_SCRIPT = textwrap.dedent(
    """
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg
    from cula.gated_delta_rule.naive_bwd import chunk_bwd_dqkwg_reference
    from test_gdn_naive_bwd import _dqkwg_case
    out = {}
    for name, args in json.loads(sys.argv[1]):
        case = _dqkwg_case(*args)
        fla = chunk_bwd_dqkwg(**case, chunk_size=64)
        ref = chunk_bwd_dqkwg_reference(**case, chunk_size=64)
        out[name] = [None if r is None else float((f.double() - r.double()).norm() / r.double().norm())
                     for f, r in zip(fla, ref)]
    print("@@" + json.dumps(out))
    """
)


def test_reference_matches_fla_kernel():
    pytest.importorskip("fla.ops.common.chunk_o")
    cases = [
        ("gated-dw-gva-odd", [2, 100, 1, 2, 32, 32, None, False, "g", True]),
        ("gated-vk-varlen", [1, 150, 1, 1, 32, 32, [37, 1, 112], True, "g", False]),
        ("gamma", [1, 130, 2, 2, 32, 32, None, False, "gamma", False]),
        ("ungated-dw", [1, 70, 1, 1, 32, 32, None, False, None, True]),
    ]
    for name, errs in _interpreted(_SCRIPT, json.dumps(cases)).items():
        for what, err in zip(("dq", "dk", "dw", "dg"), errs):
            assert err is None or err < 1e-5, (name, what, err)


def test_gva_sums_the_group():
    """Two value heads reading one q / k head: dq is the sum of the heads' dq (each head alone, H = HV)."""
    case = _dqkwg_case(1, 70, 1, 2, 16, 16, None, False, "g", False)
    both = chunk_bwd_dqkwg_reference(**case)
    per_head = []
    for hv in range(2):
        one = {n: (x[:, :, hv : hv + 1] if n in ("v", "do", "g") else x) for n, x in case.items()}
        one.update(h=case["h"][:, :, hv : hv + 1], dh=case["dh"][:, :, hv : hv + 1])
        per_head.append(chunk_bwd_dqkwg_reference(**one))
    assert torch.allclose(both[0], per_head[0][0] + per_head[1][0], atol=1e-6)
    assert torch.allclose(both[3][..., 1], per_head[1][3][..., 0], atol=1e-6)
