"""``cula.lightning.lightning_decode``: argument validation, backend registry and the reference path.

CPU: bad dtypes, shapes, layouts and out-of-range indices raise before anything runs; the ``reference``
backend (what runs on the CPU) equals ``cula.simple_gla.fused_recurrent_simple_gla(g_gamma=-decay)`` on the
gathered states, writes the final states back to the pool rows it was given, zeroes padded output rows and
leaves every other pool row alone. GPU (``-m gpu`` on an SM90 device): the ``cula-sm90`` backend against the
float64 recurrence and the ``reference`` backend through the public function, and its dispatch.
"""

from __future__ import annotations

import pytest
import torch

from cula.lightning import lightning_decode
from cula.lightning.decode import lightning_decode_registry
from cula.simple_gla import fused_recurrent_simple_gla
from cula.testing import assert_close, assert_rows_rewritten


def _inputs(N=5, T=2, H=2, HV=4, D=64, P=9, *, dtype=torch.bfloat16, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device)
    q = rnd(N, T, H, D).to(dtype)
    k = (rnd(N, T, H, D) * D**-0.5).to(dtype)
    v = rnd(N, T, HV, D).to(dtype)
    decay = torch.rand(HV, generator=gen, device=device) * 2.0
    pool = rnd(P, HV, D, D)
    idx = torch.randperm(P, generator=gen, device=device)[:N].to(torch.int32)
    if N > 1:
        idx[1::3] = -1
    return q, k, v, decay, pool, idx


def test_exported_and_registered():
    import cula.lightning

    assert "lightning_decode" in cula.lightning.__all__
    assert lightning_decode_registry.names == ["cula-sm90", "reference"]


@pytest.mark.parametrize("state_v_first", [True, False], ids=["vk", "kv"])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("H,HV", [(2, 4), (3, 3)], ids=["gva2", "mha"])
def test_reference_matches_fused_recurrent_simple_gla(state_v_first, T, H, HV):
    q, k, v, decay, pool, idx = _inputs(N=7, T=T, H=H, HV=HV, D=32)
    before = pool.clone()
    o = lightning_decode(q, k, v, decay, pool, idx, state_v_first=state_v_first)

    live = idx >= 0
    rows = idx[live].long()
    h0 = before[rows]
    ref_o, ref_ht = fused_recurrent_simple_gla(
        q[live], k[live], v[live], g_gamma=-decay, initial_state=h0, output_final_state=True,
        state_v_first=state_v_first,
    )
    assert o.dtype == q.dtype and o.shape == v.shape
    assert torch.equal(o[live], ref_o)
    assert torch.equal(pool[rows], ref_ht)
    assert torch.equal(o[~live], torch.zeros_like(o[~live]))
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(pool[untouched], before[untouched])


def test_reference_default_scale_and_out_buffer():
    q, k, v, decay, pool, idx = _inputs(N=4, T=1, D=16)
    pool2 = pool.clone()
    out = torch.full_like(v, float("nan"))
    got = lightning_decode(q, k, v, decay, pool, idx, out=out)
    assert got is out
    ref = lightning_decode(q, k, v, decay, pool2, idx, scale=16**-0.5)
    assert torch.equal(got, ref) and torch.equal(pool, pool2)


def test_reference_decay_semantics():
    """One token from a known state: o = scale * (exp(-decay) S + k v^T)^T q."""
    N, H, D = 1, 1, 8
    q = torch.randn(N, 1, H, D, dtype=torch.float32)
    k = torch.randn(N, 1, H, D, dtype=torch.float32)
    v = torch.randn(N, 1, H, D, dtype=torch.float32)
    decay = torch.tensor([5.0])
    S = torch.randn(1, H, D, D)  # [K, V]
    pool = S.clone()
    slot = torch.zeros(1, dtype=torch.int32)
    o = lightning_decode(q, k, v, decay, pool, slot, scale=0.5, state_v_first=False)
    S1 = torch.exp(torch.tensor(-5.0)) * S[0, 0] + k[0, 0, 0][:, None] * v[0, 0, 0][None, :]
    torch.testing.assert_close(pool[0, 0], S1)
    torch.testing.assert_close(o[0, 0, 0], 0.5 * S1.T @ q[0, 0, 0])


def test_all_padded_touches_nothing():
    q, k, v, decay, pool, idx = _inputs(N=3)
    idx[:] = -1
    before = pool.clone()
    o = lightning_decode(q, k, v, decay, pool, idx)
    assert torch.equal(o, torch.zeros_like(o)) and torch.equal(pool, before)


def test_check_indices_false_skips_the_range_check():
    q, k, v, decay, pool, idx = _inputs(N=4)
    idx[0] = pool.shape[0]
    with pytest.raises(ValueError, match="out of range"):
        lightning_decode(q, k, v, decay, pool, idx)
    # unchecked, the bad row reaches the backend: the reference checks it anyway (its gather would fail on it, on
    # CUDA with a device assert), cula's kernel trusts the caller
    with pytest.raises(ValueError, match="out of range"):
        lightning_decode(q, k, v, decay, pool, idx, check_indices=False)


# ------------------------------------------------------------------------------------------- validation


def _call(**over):
    q, k, v, decay, pool, idx = _inputs()
    args = {"q": q, "k": k, "v": v, "decay": decay, "state_pool": pool, "state_indices": idx}
    args.update(over)
    kw = {name: args.pop(name) for name in ("scale", "state_v_first", "out", "check_indices") if name in args}
    return lightning_decode(*args.values(), **kw)


def test_validation_dtypes():
    q, k, v, decay, pool, idx = _inputs()
    with pytest.raises(TypeError, match="`q` must have dtype"):
        _call(q=q.to(torch.int32))
    with pytest.raises(TypeError, match="`k` must have dtype"):
        _call(k=k.half())
    with pytest.raises(TypeError, match="`v` must have dtype"):
        _call(v=v.float())
    with pytest.raises(TypeError, match="`decay` must have dtype"):
        _call(decay=decay.to(torch.bfloat16))
    with pytest.raises(TypeError, match="`state_pool` must have dtype"):
        _call(state_pool=pool.to(torch.bfloat16))
    with pytest.raises(TypeError, match="`state_indices` must have dtype"):
        _call(state_indices=idx.long())
    with pytest.raises(TypeError, match="`out` must have dtype"):
        _call(out=torch.empty_like(v, dtype=torch.float32))
    with pytest.raises(TypeError, match="`scale` must be a Python float"):
        _call(scale=torch.tensor(0.1))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        _call(decay=[0.1] * 4)


def test_validation_shapes():
    q, k, v, decay, pool, idx = _inputs()
    with pytest.raises(ValueError, match="`q` must have 4 dimensions"):
        _call(q=q[0])
    with pytest.raises(ValueError, match="`k` must have shape"):
        _call(k=k[:, :, :1])
    with pytest.raises(ValueError, match="`v` must have shape"):
        _call(v=v[:2])
    with pytest.raises(ValueError, match="multiple of the q/k heads"):
        _call(v=torch.randn(5, 2, 3, 64).to(torch.bfloat16))
    with pytest.raises(ValueError, match="`decay` must have shape"):
        _call(decay=decay[:2])
    with pytest.raises(ValueError, match=r"`state_pool` must have shape \[P, HV, V, K\]"):
        _call(state_pool=pool[:, :2])
    with pytest.raises(ValueError, match="`state_pool` must have 4 dimensions"):
        _call(state_pool=pool[0])
    with pytest.raises(ValueError, match="`state_indices` must have shape"):
        _call(state_indices=idx[:3])
    with pytest.raises(ValueError, match="`out` must have shape"):
        _call(out=torch.empty_like(v)[:, :1])
    with pytest.raises(ValueError, match="1..8 tokens"):
        _call(q=q.repeat(1, 5, 1, 1), k=k.repeat(1, 5, 1, 1), v=v.repeat(1, 5, 1, 1))
    with pytest.raises(ValueError, match="1..8 tokens"):
        _call(q=q[:, :0], k=k[:, :0], v=v[:, :0])


def test_validation_layout_and_indices():
    q, k, v, decay, _pool, idx = _inputs(D=64)
    # [K, V] pool passed as V-first only fails when K != V: use a K=V pool with a wrong head count instead
    kv_pool = torch.randn(9, 4, 64, 64)
    lightning_decode(q, k, v, decay, kv_pool, idx, state_v_first=False)  # both layouts have this shape
    q2 = torch.randn(5, 2, 2, 32).to(torch.bfloat16)
    k2 = torch.randn(5, 2, 2, 32).to(torch.bfloat16)
    v2 = torch.randn(5, 2, 4, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"\[P, HV, K, V\] = \[P, 4, 32, 64\]"):
        lightning_decode(q2, k2, v2, decay, torch.randn(9, 4, 64, 32), idx, state_v_first=False)
    lightning_decode(q2, k2, v2, decay, torch.randn(9, 4, 64, 32), idx, state_v_first=True)
    bad = idx.clone()
    bad[0] = 9
    with pytest.raises(ValueError, match="out of range for a pool of 9 rows"):
        _call(state_indices=bad)
    with pytest.raises(ValueError, match="`decay` is on meta"):
        _call(decay=torch.empty(4, device="meta"))


# ------------------------------------------------------------------------------------------------- GPU


def _float64(q, k, v, decay, pool, idx, state_v_first=True, scale=None):
    """The float64 recurrence of a pool call: ``o`` (padded slots zero) and the pool after it."""
    from cula.simple_gla.naive import naive_recurrent_simple_gla

    live = idx >= 0
    rows = idx.long()[live]
    o_live, states = naive_recurrent_simple_gla(
        *(t[live].double() for t in (q, k, v)), g_gamma=-decay.double(), scale=scale,
        initial_state=pool[rows].double(), output_final_state=True, state_v_first=state_v_first,
    )  # fmt: skip
    o = torch.zeros(v.shape, dtype=torch.float64, device=v.device)
    o[live] = o_live
    after = pool.double()
    after[rows] = states
    return o, after


def _requires_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU (H100/H200)")


@pytest.mark.gpu
@pytest.mark.parametrize("state_v_first", [True, False], ids=["vk", "kv"])
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("T", [1, 4])
def test_cula_backend_matches_reference(monkeypatch, state_v_first, D, T):
    _requires_sm90()
    q, k, v, decay, pool, idx = _inputs(N=11, T=T, H=2, HV=8, D=D, P=20, device="cuda", seed=3)
    before, pool_ref = pool.clone(), pool.clone()
    selected = lightning_decode_registry.select(q.device, {
        "q": q, "k": k, "v": v, "decay": decay, "state_pool": pool, "state_indices": idx, "scale": 0.1,
        "state_v_first": state_v_first, "out": torch.empty_like(v),
    })
    assert selected.name == "cula-sm90"
    o64, pool64 = _float64(q, k, v, decay, pool, idx, state_v_first)
    o = lightning_decode(q, k, v, decay, pool, idx, state_v_first=state_v_first)
    monkeypatch.setenv("CULA_BACKEND", "reference")
    o_ref = lightning_decode(q, k, v, decay, pool_ref, idx, state_v_first=state_v_first)
    torch.cuda.synchronize()
    assert_close("o vs float64", o64, o, 5e-3)
    assert_close("pool vs float64", pool64, pool, 5e-3)
    assert_close("o vs reference backend", o_ref.float(), o.float(), 5e-3)
    assert_close("pool vs reference backend", pool_ref, pool, 5e-3)
    live = idx >= 0
    assert torch.equal(o[~live], torch.zeros_like(o[~live]))
    rows = idx[live].long()
    assert_rows_rewritten("pool rows", pool, before, rows, ref=pool64[rows], others_untouched=True)


@pytest.mark.gpu
def test_cula_backend_odd_strides(monkeypatch):
    """Sliced (non-contiguous) q/k/v, a strided out and a pool slice still run on the kernel."""
    _requires_sm90()
    q, k, v, decay, pool, idx = _inputs(N=6, T=3, H=2, HV=4, D=128, P=10, device="cuda", seed=4)
    big = torch.randn(10, 2, 4, 128, 128, device="cuda")
    pool = big[:, 1]
    before, pool_ref = pool.clone(), pool.clone()
    other = big[:, 0].clone()
    out = torch.full((6, 2, 4, 128), float("nan"), device="cuda", dtype=torch.bfloat16)[:, 1:]
    selected = lightning_decode_registry.select(q.device, {
        "q": q[:, 1:2], "k": k[:, 1:2], "v": v[:, 1:2], "decay": decay, "state_pool": pool,
        "state_indices": idx, "scale": 0.1, "state_v_first": True, "out": out,
    })
    assert selected.name == "cula-sm90"
    o64, pool64 = _float64(q[:, 1:2], k[:, 1:2], v[:, 1:2], decay, pool, idx)
    o = lightning_decode(q[:, 1:2], k[:, 1:2], v[:, 1:2], decay, pool, idx, out=out)
    monkeypatch.setenv("CULA_BACKEND", "reference")
    o_ref = lightning_decode(q[:, 1:2], k[:, 1:2], v[:, 1:2], decay, pool_ref, idx)
    torch.cuda.synchronize()
    assert o is out
    assert_close("o vs float64", o64, o, 5e-3)
    assert_close("pool vs float64", pool64, pool, 5e-3)
    assert_close("o vs reference backend", o_ref.float(), o.float(), 5e-3)
    assert_close("pool vs reference backend", pool_ref, pool, 5e-3)
    assert torch.equal(big[:, 0], other), "the rows between pool rows changed"
    rows = idx[idx >= 0].long()
    assert_rows_rewritten("pool rows", pool, before, rows, ref=pool64[rows], others_untouched=True)
    # N = 1: q[:, 1:2] is is_contiguous() yet its size-1 dims carry foreign strides
    q1, k1, v1 = (x[:1, 1:2] for x in (q, k, v))
    pool1, pool1_ref, before1 = pool.clone(), pool.clone(), pool.clone()
    idx1 = idx[:1].clone().fill_(2)
    o1_64, pool1_64 = _float64(q1, k1, v1, decay, pool1, idx1)
    monkeypatch.delenv("CULA_BACKEND")
    o1 = lightning_decode(q1, k1, v1, decay, pool1, idx1)
    monkeypatch.setenv("CULA_BACKEND", "reference")
    o1_ref = lightning_decode(q1, k1, v1, decay, pool1_ref, idx1)
    assert_close("o (N=1) vs float64", o1_64, o1, 5e-3)
    assert_close("pool (N=1) vs float64", pool1_64, pool1, 5e-3)
    assert_close("o (N=1) vs reference backend", o1_ref.float(), o1.float(), 5e-3)
    assert_close("pool (N=1) vs reference backend", pool1_ref, pool1, 5e-3)
    assert_rows_rewritten("pool row (N=1)", pool1, before1, [2], ref=pool1_64[2:3])
