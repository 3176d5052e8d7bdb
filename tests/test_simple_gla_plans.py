"""chunk_simple_gla's plan cache (fixed-length calls with a constant decay, Lightning's) and lightning_attn_fwd's fast
path, on the CPU: a repeated signature is validated once and runs the same numbers; everything validation reads
starts a new plan; bad input after a good call still raises; on (pretend) SM90 the bound launch hands the kernel
what the general path hands it.
"""

from __future__ import annotations

import pytest
import torch

import cula.simple_gla.chunk as chunk_mod
from cula.backends import PlanCache
from cula.lightning import lightning_attn_fwd
from cula.simple_gla import chunk_simple_gla

B, T, H, HV, D = 2, 100, 2, 4, 64


def _inputs(seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, D, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(B, T, HV, D, generator=gen).to(dtype)
    decay = torch.rand(HV, generator=gen)
    h0 = 0.1 * torch.randn(B, HV, D, D, generator=gen)
    return q, k, v, decay, h0


@pytest.fixture
def counted(monkeypatch):
    """A fresh plan cache and a count of full validations."""
    count = [0]
    monkeypatch.setattr(chunk_mod, "_plans", PlanCache())
    real = chunk_mod._checked_args

    def checked(*a, **kw):
        count[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(chunk_mod, "_checked_args", checked)
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    return count


def _general(q, k, v, g_gamma, **kw):
    """The general path's result (the plan cache bypassed by an empty dict of extra keywords)."""
    return chunk_simple_gla(q, k, v, g_gamma=g_gamma, **kw, **{})


def test_repeated_signature_is_validated_once(counted):
    q, k, v, decay, h0 = _inputs()
    outs = [chunk_simple_gla(q, k, v, g_gamma=-decay, initial_state=h0, output_final_state=True) for _ in range(3)]
    assert counted[0] == 1 and len(chunk_mod._plans) == 1
    for o, s in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(s, outs[0][1])
    # lightning_attn_fwd's call of the same signature takes the plan (no validation of its own either)
    o, s = lightning_attn_fwd(q, k, v, decay, initial_state=h0, output_final_state=True)
    assert counted[0] == 1 and torch.equal(o, outs[0][0]) and torch.equal(s, outs[0][1])


def test_what_validation_reads_starts_a_new_plan(counted):
    q, k, v, decay, h0 = _inputs()
    g = -decay
    variants = [
        dict(), dict(scale=0.5), dict(scale=1), dict(scale=1.0), dict(scale=True), dict(initial_state=h0),
        dict(output_final_state=True), dict(output_final_state=1), dict(state_v_first=True),
    ]  # fmt: skip
    for kw in variants:
        try:
            chunk_simple_gla(q, k, v, g_gamma=g, **kw)
        except (TypeError, ValueError):
            pass  # (a bool scale may be refused: what matters is that it was validated)
    assert counted[0] == len(variants)
    chunk_simple_gla(q.float(), k.float(), v.float(), g_gamma=g)  # dtype
    chunk_simple_gla(q[:, :50], k[:, :50], v[:, :50], g_gamma=g)  # shape (a view: strides too)
    chunk_simple_gla(q, k, v, g_gamma=None)  # no decay
    chunk_simple_gla(q, k, v, g_gamma=g.double())
    assert counted[0] == len(variants) + 4
    with torch.no_grad():  # nothing recorded: the first variant's plan
        chunk_simple_gla(q.requires_grad_(), k, v, g_gamma=g)
    assert counted[0] == len(variants) + 4
    chunk_simple_gla(q, k, v, g_gamma=g)  # recorded: another plan
    assert counted[0] == len(variants) + 5


def test_bad_input_after_a_good_call_still_raises(counted):
    q, k, v, decay, h0 = _inputs()
    chunk_simple_gla(q, k, v, g_gamma=-decay, initial_state=h0)
    lightning_attn_fwd(q, k, v, decay, initial_state=h0)
    with pytest.raises(ValueError):
        chunk_simple_gla(q, k, v, g_gamma=-decay, initial_state=h0[:1])
    with pytest.raises(ValueError):
        chunk_simple_gla(q, k[:, :, :1], v, g_gamma=-decay)
    # lightning's own rules: decay fp32 [HV], even where -decay has a planned signature
    with pytest.raises(ValueError, match="decay"):
        lightning_attn_fwd(q, k, v, decay.view(1, HV), initial_state=h0)
    chunk_simple_gla(q, k, v, g_gamma=-decay.bfloat16(), initial_state=h0)
    with pytest.raises(TypeError, match="decay"):
        lightning_attn_fwd(q, k, v, decay.bfloat16(), initial_state=h0)


def test_decay_gets_no_gradient_and_strided_inputs_are_copied(counted):
    q, k, v, decay, h0 = _inputs(dtype=torch.float32)
    want = lightning_attn_fwd(q, k, v, decay, initial_state=h0, output_final_state=True)
    for _ in range(2):
        d = decay.clone().requires_grad_()
        qs = torch.empty(B, T, H, 2 * D)[..., ::2].copy_(q)  # strided in its last dimension: copied every call
        o, s = lightning_attn_fwd(qs, k, v, d, initial_state=h0, output_final_state=True)
        assert torch.equal(o, want[0]) and torch.equal(s, want[1]) and not o.requires_grad
        ds = torch.empty(2 * HV)[::2].copy_(decay)  # a strided decay: the general path
        o, _ = lightning_attn_fwd(q, k, v, ds, initial_state=h0, output_final_state=True)
        assert torch.equal(o, want[0])


@pytest.fixture
def fake_lightning(monkeypatch, pretend_sm90):
    """CPU tensors on a pretend SM90; the Lightning kernel records its variant and arguments."""
    from cula.ops.lightning.sm90 import chunk_fwd

    calls = []
    monkeypatch.setattr(chunk_fwd, "compiled_variant", lambda *key, **kw: lambda *a: calls.append((key, kw, a)))
    return calls


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_bound_launch_passes_what_the_general_path_passes(counted, fake_lightning, state_v_first, with_state):
    from cula.simple_gla.backends import _lightning_forward

    q, k, v, decay, h0 = _inputs()
    h0 = h0 if with_state else None
    with torch.no_grad():
        _lightning_forward(q, k, v, -decay, 0.125, h0, with_state, state_v_first, None)
        general = list(fake_lightning)
        fake_lightning.clear()
        for _ in range(2):
            chunk_simple_gla(q, k, v, g_gamma=-decay, scale=0.125, initial_state=h0, output_final_state=with_state,
                             state_v_first=state_v_first)  # fmt: skip
        lightning_attn_fwd(q, k, v, decay, scale=0.125, initial_state=h0, output_final_state=with_state,
                           state_v_first=state_v_first)  # fmt: skip
    assert counted[0] == 1 and len(fake_lightning) == 3
    (key, kw, args), = general
    for got_key, got_kw, got in fake_lightning:
        assert (got_key, got_kw) == (key, kw) and len(got) == len(args)
        for a, b in zip(args, got):
            if isinstance(a, torch.Tensor):
                assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
                if a.data_ptr() in (q.data_ptr(), k.data_ptr(), v.data_ptr()) or a.numel() <= HV:
                    assert a.data_ptr() == b.data_ptr() or torch.equal(a, b)
            else:
                assert a == b
    assert fake_lightning[2][2][4] is decay  # lightning_attn_fwd's decay reaches the kernel as it is


def test_calls_the_time_split_cuts_stay_on_the_general_path(counted, fake_lightning):
    """A long sequence with few heads is cut in time (cula.lightning.time_parallel): no bound launch for it."""
    from cula.simple_gla.backends import _prepare_chunk_cula_sm90

    q = torch.zeros(1, 32768, 1, 64, dtype=torch.bfloat16)
    args = dict(q=q, k=q, v=q, g_gamma=-torch.ones(1), scale=0.125, initial_state=None, output_final_state=True,
                state_v_first=False, cu_seqlens=None)  # fmt: skip
    assert _prepare_chunk_cula_sm90(**args) is None
    short = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16)
    assert _prepare_chunk_cula_sm90(**dict(args, q=short, k=short, v=short)) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm_90)")
@pytest.mark.parametrize("state_v_first", [False, True])
def test_bound_launch_bit_identical_cuda(counted, state_v_first):
    """The bound launch (chunk_simple_gla's and lightning_attn_fwd's repeated calls) against the kernel's general
    path, bit for bit, outputs poisoned first."""
    from cula.simple_gla.backends import _lightning_forward
    from cula.testing import poisoned_allocations

    q, k, v, decay, h0 = (t.cuda() for t in _inputs())
    want = _lightning_forward(q, k, v, -decay, D**-0.5, h0, True, state_v_first, None)
    with torch.no_grad(), poisoned_allocations():
        got = [chunk_simple_gla(q, k, v, g_gamma=-decay, initial_state=h0, output_final_state=True,
                                state_v_first=state_v_first) for _ in range(2)]  # fmt: skip
        got.append(lightning_attn_fwd(q, k, v, decay, initial_state=h0, output_final_state=True,
                                      state_v_first=state_v_first))  # fmt: skip
    assert counted[0] == 1
    for o, s in got:
        assert torch.isfinite(o).all() and torch.isfinite(s).all()
        assert torch.equal(o, want[0]) and torch.equal(s, want[1])
