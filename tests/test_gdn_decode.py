"""``cula.gated_delta_rule.gdn_decode``: Gated DeltaNet's pooled decode (``kda_decode``'s serving form with its
per-head gate), its bound step ``gdn_decode_step`` and ``gdn_commit_accepted``.

CPU (``kda_decode``'s reference backend) and GPU (``-m gpu``: cula's decode kernel on the H200): against GDN's own
float64 recurrence (``reference_fused_recurrent_gated_delta_rule``) per pool row: outputs, the pool updated in
place, a padded slot (negative index) untouched with zero outputs, per-token step states with the pool left alone
and the commit of an accepted prefix; the fused and the log-space gate, GVA, both state layouts, 1 and 4 tokens,
NaN-poisoned outputs; two steps of the bound closure equal two ``gdn_decode`` calls bit for bit. Bad gate arguments
are rejected before any work.
"""

from __future__ import annotations

import pytest
import torch

from cula.gated_delta_rule import gdn_commit_accepted, gdn_decode, gdn_decode_step
from cula.gated_delta_rule.naive import reference_fused_recurrent_gated_delta_rule
from cula.testing import assert_close, assert_rows_rewritten

INDICES = [3, -1, 0]  # the second sequence is a padded slot
P = 5


def _case(T, H, HV, K, fused, state_v_first, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    N = len(INDICES)

    def rnd(*shape, dtype=torch.float32, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(dtype).to(device)

    x = dict(
        q=rnd(N, T, H, K, dtype=torch.bfloat16), k=rnd(N, T, H, K, dtype=torch.bfloat16),
        v=rnd(N, T, HV, K, dtype=torch.bfloat16),
        g=rnd(N, T, HV) if fused else -torch.rand(N, T, HV, generator=gen).to(device) * 0.5,
        beta=rnd(N, T, HV),
    )  # fmt: skip
    flags = dict(use_gate_in_kernel=fused, state_v_first=state_v_first)
    if fused:
        flags.update(A_log=rnd(HV, s=0.5), dt_bias=rnd(HV, s=0.5))
    pool = rnd(P, HV, K, K, s=0.1)
    return x, flags, pool, torch.tensor(INDICES, dtype=torch.int32, device=device)


def _reference(x, flags, pool, n, tokens):
    """GDN's float64 recurrence for sequence n's first ``tokens`` tokens from its pool row: (o, final state)."""
    row = pool[INDICES[n]].cpu()[None]
    return reference_fused_recurrent_gated_delta_rule(
        *(x[name][n : n + 1, :tokens].cpu() for name in ("q", "k", "v")), g=x["g"][n : n + 1, :tokens].cpu(),
        beta=x["beta"][n : n + 1, :tokens].cpu(), initial_state=row, output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, compute_dtype=torch.float64,
        **{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in flags.items()},
    )  # fmt: skip


def _check(device, T, H, HV, K, fused, state_v_first):
    x, flags, pool, idx = _case(T, H, HV, K, fused, state_v_first, device)
    before = pool.clone()
    out = torch.full_like(x["v"], float("nan"))
    o = gdn_decode(**x, state_pool=pool, state_indices=idx, out=out, **flags)
    assert o is out and not o.isnan().any()
    for n, row in enumerate(INDICES):
        if row < 0:
            assert not o[n].any() and torch.equal(pool[[1, 2, 4]], before[[1, 2, 4]])
            continue
        o_ref, s_ref = _reference(x, flags, before, n, T)
        assert_close(f"o[{n}]", o_ref[0].float(), o[n].float().cpu(), 5e-3)
        assert_close(f"pool[{row}]", s_ref[0].float(), pool[row].cpu(), 5e-3)
        assert_rows_rewritten(f"pool[{row}]", pool, before, [row], ref=s_ref)

    # speculative decoding: every token's state into step_states, the pool untouched; then commit a prefix
    pool = before.clone()
    steps = torch.full((len(INDICES), T) + tuple(pool.shape[1:]), float("nan"), device=device)
    gdn_decode(**x, state_pool=pool, state_indices=idx, step_states=steps, **flags)
    assert torch.equal(pool, before)
    for n, row in enumerate(INDICES):  # every live sequence's: one never checked could be left unwritten
        if row < 0:
            assert steps[n].isnan().all()  # a padded slot's step states are left as they were
            continue
        for t in range(T):
            _, s_ref = _reference(x, flags, before, n, t + 1)
            assert_close(f"step state {n}, {t}", s_ref[0].float(), steps[n, t].cpu(), 5e-3)
    accepted = torch.tensor([T - 1, 1, 0], dtype=torch.int32, device=device)
    gdn_commit_accepted(steps, pool, idx, accepted)
    if T > 1:
        assert torch.equal(pool[3], steps[0, T - 2])
    assert torch.equal(pool[0], before[0])  # nothing accepted: the row stays


def _check_step(device, T, H, HV, K, fused, state_v_first):
    x, flags, pool, idx = _case(T, H, HV, K, fused, state_v_first, device)
    x2, _, _, _ = _case(T, H, HV, K, fused, state_v_first, device, seed=1)
    pool_step = pool.clone()
    step = gdn_decode_step(pool_step, idx, **flags)
    for tokens in (x, x2):  # the pool evolves over the two steps
        o_step = step(**tokens)
        o = gdn_decode(**tokens, state_pool=pool, state_indices=idx, **flags)
        assert torch.equal(o_step, o) and torch.equal(pool_step, pool)


@pytest.mark.parametrize("state_v_first", [True, False], ids=["vk", "kv"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused_gate", "log_gate"])
@pytest.mark.parametrize("T,H,HV", [(1, 2, 2), (4, 1, 2)], ids=["T1", "T4-gva"])
def test_gdn_decode_matches_the_recurrence(T, H, HV, fused, state_v_first):
    _check("cpu", T, H, HV, 64, fused, state_v_first)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_gate", "log_gate"])
def test_gdn_decode_step_is_gdn_decode(fused):
    _check_step("cpu", 2, 1, 2, 64, fused, True)


@pytest.mark.gpu
@pytest.mark.parametrize("state_v_first", [True, False], ids=["vk", "kv"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused_gate", "log_gate"])
@pytest.mark.parametrize("T,H,HV,K", [(1, 2, 4, 128), (4, 1, 2, 128), (3, 2, 2, 64)], ids=["T1", "T4-gva", "T3-d64"])
def test_gdn_decode_matches_the_recurrence_cuda(T, H, HV, K, fused, state_v_first):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    _check("cuda", T, H, HV, K, fused, state_v_first)
    _check_step("cuda", T, H, HV, K, fused, state_v_first)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["fused_gate", "log_gate"])
@pytest.mark.parametrize("T,H,HV", [(4, 1, 2), (2, 2, 4)], ids=["T4-gva", "T2"])
def test_gdn_decode_wide_vk_tile_cuda(T, H, HV, fused, kda_tuning):
    """The decode kernel's wide lane tile on [V, K] pools (KdaTuning.wide_vk_min_tokens) for Gated DeltaNet's MTP
    verify: outputs, pool and step states against the float64 recurrence, the padded slot untouched."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    kda_tuning(wide_vk_min_tokens=2)
    _check("cuda", T, H, HV, 128, fused, True)
    _check_step("cuda", T, H, HV, 128, fused, True)


@pytest.mark.gpu
@pytest.mark.parametrize("steps", [False, True], ids=["pool", "step_states"])
@pytest.mark.parametrize("state_v_first", [True, False], ids=["vk", "kv"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused_gate", "log_gate"])
@pytest.mark.parametrize("T,HV", [(1, 2), (1, 64), (4, 2)], ids=["T1", "T1-cols", "T4"])
def test_per_head_gate_is_the_repeated_gate_cuda(T, HV, fused, state_v_first, steps):
    """The decode kernel's per-head gate (what gdn_decode runs) gives kda_decode's results with the gate repeated
    over K bit for bit: outputs and pool (or step states), at one token (incl. the [K, V] column kernel's state
    count) and four."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from cula.kda import kda_decode
    from cula.kda.plan import gate_over_k

    x, flags, pool, idx = _case(T, 1, HV, 128, fused, state_v_first, "cuda")
    runs = []
    for per_head in (True, False):
        p = pool.clone()
        xs, fl = dict(x), dict(flags)
        if not per_head:
            xs["g"], bias = gate_over_k(x["g"], flags.get("dt_bias"), 128)
            if fused:
                fl["dt_bias"] = bias
        st = torch.full((len(INDICES), T) + tuple(p.shape[1:]), float("nan"), device="cuda") if steps else None
        o = kda_decode(**xs, state_pool=p, state_indices=idx, step_states=st, **fl)
        runs.append((o, p, st))
    (o1, p1, s1), (o2, p2, s2) = runs
    assert not o1.isnan().any() and torch.equal(o1, o2) and torch.equal(p1, p2)
    for n, row in enumerate(INDICES):  # both runs could leave the same element of a row unwritten
        if row >= 0 and not steps:
            _, s_ref = _reference(x, flags, pool, n, T)
            assert_rows_rewritten(f"pool[{row}]", p1, pool, [row], ref=s_ref)
    live = [n for n, row in enumerate(INDICES) if row >= 0]  # the padded slot's step states are left NaN
    assert not steps or torch.equal(s1[live], s2[live])


def test_gdn_decode_rejects_bad_gates():
    x, flags, pool, idx = _case(2, 1, 2, 64, True, True, "cpu")
    with pytest.raises(ValueError, match="`g`"):
        gdn_decode(**{**x, "g": x["g"][..., None].expand(-1, -1, -1, 64)}, state_pool=pool, state_indices=idx,
                   **flags)  # fmt: skip
    with pytest.raises(ValueError, match="dt_bias"):
        gdn_decode(**x, state_pool=pool, state_indices=idx, **{**flags, "dt_bias": torch.zeros(2 * 64)})
    with pytest.raises(ValueError, match="A_log"):
        gdn_decode(**x, state_pool=pool, state_indices=idx, **{**flags, "A_log": None})
