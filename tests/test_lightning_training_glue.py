"""CPU check of the glue in ``cula.simple_gla.backends._LightningTraining`` (our forward, FLA's backward).

The kernel and FLA's Triton backward need a GPU; here both are replaced by the float64 reference and
its autograd, so what is tested is everything in between: saved tensors, the base-2 decay FLA's
backward expects, the GVA expansion and the summing of q/k gradients over each group, varlen and
state layouts. The real pairing is tested on the GPU by test_gpu_api.py::test_lightning_training_matches_fla.
"""

import pytest
import torch

import cula.simple_gla.backends as sb
from cula.simple_gla.naive import reference_chunk_simple_gla
from cula.testing import assert_close, small_batch


def _fake_forward(q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first, cu_seqlens):
    with torch.no_grad():
        return reference_chunk_simple_gla(
            q, k, v, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        )  # fmt: skip


def _fake_fla_bwd(q, k, v, g, g_gamma, initial_state, do, dht, scale, state_v_first, cu_seqlens, chunk_size,
                  chunk_indices):  # fmt: skip
    assert g is None and chunk_size == 64
    assert q.shape[2] == v.shape[2], "FLA's backward has no GVA: q/k must arrive expanded"
    x = [t.detach().double().requires_grad_() for t in (q, k, v)]
    h0 = None if initial_state is None else initial_state.detach().double().requires_grad_()
    with torch.enable_grad():  # backward passes run with grad mode off
        o, ht = reference_chunk_simple_gla(
            *x, g_gamma=g_gamma.double() / sb.RCP_LN2, scale=scale, initial_state=h0, output_final_state=True,
            state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        )  # fmt: skip
        leaves = x + ([h0] if h0 is not None else [])
        grads = torch.autograd.grad((o * do.double()).sum() + (ht * dht.double()).sum(), leaves)
    dh0 = grads[3].float() if h0 is not None else None
    return grads[0], grads[1], grads[2], None, dh0


@pytest.mark.parametrize("gva", [1, 2])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_training_glue_matches_reference_autograd(monkeypatch, gva, varlen, state_v_first):
    import fla.ops.simple_gla.chunk as fla_chunk
    import fla.ops.utils as fla_utils

    monkeypatch.setattr(sb, "_lightning_forward", _fake_forward)
    monkeypatch.setattr(fla_chunk, "chunk_simple_gla_bwd", _fake_fla_bwd)
    monkeypatch.setattr(fla_utils, "prepare_chunk_indices", lambda cu, chunk, cu_seqlens_cpu=None: None)

    H, D = 2, 8
    HV = H * gva
    B, T, N, cu = small_batch(varlen, fixed_t=11)
    torch.manual_seed(0)
    q, k = torch.randn(B, T, H, D), torch.randn(B, T, H, D)
    v = torch.randn(B, T, HV, D)
    g_gamma = -torch.rand(HV)
    h0 = torch.randn(N, HV, D, D)
    scale = D**-0.5

    def leaves():
        return [t.clone().double().requires_grad_() for t in (q, k, v, h0)]

    ours = leaves()
    o, ht = sb._LightningTraining.apply(ours[0], ours[1], ours[2], g_gamma.double(), ours[3], scale, True,
                                        state_v_first, cu, None)  # fmt: skip
    (o.pow(2).sum() + ht.pow(2).sum()).backward()

    ref = leaves()
    o_r, ht_r = reference_chunk_simple_gla(ref[0], ref[1], ref[2], g_gamma=g_gamma.double(), scale=scale,
                                           initial_state=ref[3], output_final_state=True,
                                           state_v_first=state_v_first, cu_seqlens=cu)  # fmt: skip
    (o_r.pow(2).sum() + ht_r.pow(2).sum()).backward()
    for name, a, b in zip(("dq", "dk", "dv", "dh0"), ref, ours):
        assert_close(name, a.grad, b.grad, 1e-6)


def test_backward_hands_fla_a_fresh_boundaries_alias(monkeypatch):
    """FLA's index helpers memoise on a tensor's identity: a training loop that rewrites its cu_seqlens buffer in
    place between steps must not get the previous step's chunks, so each backward hands FLA a fresh alias."""
    import fla.ops.simple_gla.chunk as fla_chunk
    import fla.ops.utils as fla_utils

    seen = []

    def indices(cu, chunk_size, cu_seqlens_cpu=None):
        seen.append(cu)
        return torch.zeros(0, 2, dtype=torch.int32)

    def bwd(q, k, v, **kw):
        seen.append(kw["cu_seqlens"])
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None

    monkeypatch.setattr(fla_utils, "prepare_chunk_indices", indices)
    monkeypatch.setattr(fla_chunk, "chunk_simple_gla_bwd", bwd)
    q = torch.zeros(1, 8, 1, 64)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    for _ in range(2):
        sb.lightning_backward(q, q, q, None, None, cu, cu.clone(), 0.125, False, q, None)
    assert len(seen) == 4 and all(t is not cu and torch.equal(t, cu) for t in seen)
    assert seen[0] is seen[1] and seen[2] is not seen[0]  # one alias a backward, a new one the next
