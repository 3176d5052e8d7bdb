"""chunk_gated_delta_rule's plan cache on the CPU: a repeated fixed-length signature is validated once and runs the
general path's numbers on each call's own inputs; what validation reads starts a new plan; bad input after a good
call still raises."""

from __future__ import annotations

import pytest
import torch

import cula.gated_delta_rule.chunk as chunk_mod
from cula.gated_delta_rule import chunk_gated_delta_rule

B, T, H, HV, D = 2, 70, 2, 4, 32


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, D, generator=gen) for _ in range(2))
    v = torch.randn(B, T, HV, D, generator=gen)
    g, beta = torch.randn(B, T, HV, generator=gen), torch.randn(B, T, HV, generator=gen)
    h0 = 0.1 * torch.randn(B, HV, D, D, generator=gen)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, A_log=torch.rand(HV, generator=gen),
                dt_bias=torch.randn(HV, generator=gen))  # fmt: skip


FLAGS = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
             output_final_state=True)  # fmt: skip


@pytest.fixture
def counted(plan_counter):
    return plan_counter(chunk_mod)


def test_repeated_signature_is_validated_once(counted):
    for seed in range(3):
        x = _inputs(seed)
        o, s = chunk_gated_delta_rule(**x, **FLAGS)
        o_want, s_want = chunk_gated_delta_rule(**x, **FLAGS, chunk_size=64)  # (a keyword off the plan cache)
        assert torch.equal(o, o_want) and torch.equal(s, s_want)
    assert counted[0] == 1 + 3 and len(chunk_mod._plans) == 1


def test_what_validation_reads_starts_a_new_plan(counted):
    x = _inputs()
    chunk_gated_delta_rule(**x, **FLAGS)
    variants = [
        dict(FLAGS, scale=0.5), dict(FLAGS, scale=1), dict(FLAGS, output_final_state=False),
        dict(FLAGS, use_gate_in_kernel=False), dict(FLAGS, state_v_first=True), dict(FLAGS, allow_neg_eigval=True),
    ]  # fmt: skip
    for kw in variants:
        chunk_gated_delta_rule(**x, **kw)
    chunk_gated_delta_rule(**dict(x, initial_state=None), **FLAGS)
    chunk_gated_delta_rule(**dict(x, dt_bias=None), **FLAGS)
    chunk_gated_delta_rule(**dict(x, g=x["g"].double()), **FLAGS)
    assert counted[0] == 1 + len(variants) + 3
    with pytest.raises(ValueError, match="A_log"):
        chunk_gated_delta_rule(**dict(x, A_log=x["A_log"][:1]), **FLAGS)
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        chunk_gated_delta_rule(**x, **dict(FLAGS, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=True))
    with pytest.raises(ValueError):
        chunk_gated_delta_rule(**dict(x, beta=x["beta"][:, :5]), **FLAGS)


def test_gradients_through_a_planned_signature(counted):
    x = _inputs()
    leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
    grads = []
    for _ in range(2):
        o, s = chunk_gated_delta_rule(**dict(x, **leaves), **FLAGS)
        grads.append(torch.autograd.grad((o.sum() + s.sum()), list(leaves.values())))
    assert counted[0] == 1
    for a, b in zip(*grads):
        assert torch.equal(a, b) and torch.isfinite(a).all()
