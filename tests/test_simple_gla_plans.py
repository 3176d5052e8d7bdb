"""chunk_simple_gla's plan cache (fixed-length calls with a constant decay, Lightning's) and lightning_attn_fwd's fast
path, on the CPU: a repeated signature is validated once and runs the same numbers; everything validation reads
starts a new plan; bad input after a good call still raises; on (pretend) SM90 the bound launch hands the kernel
what the general path hands it.
"""

from __future__ import annotations

import pytest
import torch

import cula.simple_gla.chunk as chunk_mod
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
def counted(plan_counter):
    """A fresh plan cache and a count of full validations."""
    return plan_counter(chunk_mod, "_checked_args")


def _general(*args, **kw):
    """``chunk_simple_gla`` off the plan cache (an extra keyword sends a call down the general path)."""
    return chunk_simple_gla(*args, **kw, chunk_size=None)


def test_repeated_signature_is_validated_once(counted):
    """Each repeated call (fresh tensors of the same signature) runs on its own inputs: the general path's numbers."""
    outs, wants = [], []
    for seed in range(3):
        q, k, v, decay, h0 = _inputs(seed)
        outs.append(chunk_simple_gla(q, k, v, g_gamma=-decay, initial_state=h0, output_final_state=True))
        outs.append(lightning_attn_fwd(q, k, v, decay, initial_state=h0, output_final_state=True))
        wants += [_general(q, k, v, g_gamma=-decay, initial_state=h0, output_final_state=True)] * 2
    assert counted[0] == 1 + 3 and len(chunk_mod._plans) == 1  # (one plan; the general path validates each call)
    for (o, s), (o_want, s_want) in zip(outs, wants):
        assert torch.equal(o, o_want) and torch.equal(s, s_want)
    assert not torch.equal(outs[0][0], outs[2][0])


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
    chunk_simple_gla(q, k, v, g_gamma=g, scale=-0.0)  # (0.0 == -0.0: one dict key without the sign)
    chunk_simple_gla(q, k, v, g_gamma=g, scale=0.0)
    with torch.inference_mode():
        chunk_simple_gla(q, k, v, g_gamma=g)
    with torch.no_grad():  # nothing recorded: the first variant's plan
        chunk_simple_gla(q.requires_grad_(), k, v, g_gamma=g)
    assert counted[0] == len(variants) + 7
    chunk_simple_gla(q, k, v, g_gamma=g)  # recorded: another plan
    assert counted[0] == len(variants) + 8


def test_backend_choice_is_part_of_the_signature(counted, monkeypatch):
    q, k, v, decay, _ = _inputs()
    chunk_simple_gla(q, k, v, g_gamma=-decay)
    monkeypatch.setenv("CULA_BACKEND", "no-such-backend")
    with pytest.raises(Exception, match="no-such-backend"):
        chunk_simple_gla(q, k, v, g_gamma=-decay)
    with pytest.raises(Exception, match="no-such-backend"):
        lightning_attn_fwd(q, k, v, decay)


def test_tensors_without_storage_take_the_general_path(counted):
    """torch.func transforms hand over tensors with no address to key on: validated in full, each call."""
    q, k, v, decay, _ = _inputs(dtype=torch.float32)
    x = torch.stack([q, q + 1])
    for fn in (lambda t: chunk_simple_gla(t, k, v, g_gamma=-decay)[0], lambda t: lightning_attn_fwd(t, k, v, decay)[0]):
        got = torch.func.vmap(fn)(x)
        assert torch.equal(got[1], _general(q + 1, k, v, g_gamma=-decay)[0])
    assert len(chunk_mod._plans) == 0


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
    want = _general(q, k, v, g_gamma=-decay, initial_state=h0, output_final_state=True)
    for _ in range(2):
        d = decay.clone().requires_grad_()
        qs = torch.empty(B, T, H, 2 * D)[..., ::2].copy_(q).requires_grad_()  # strided: copied every call
        o, s = lightning_attn_fwd(qs, k, v, d, initial_state=h0, output_final_state=True)
        assert torch.equal(o, want[0]) and torch.equal(s, want[1])
        o.sum().backward()
        assert d.grad is None and qs.grad is not None  # (FLA gives g_gamma no gradient either)
        ds = torch.empty(2 * HV)[::2].copy_(decay)  # a strided decay: the general path
        o, _ = lightning_attn_fwd(q, k, v, ds, initial_state=h0, output_final_state=True)
        assert torch.equal(o, want[0])


def test_chunk_lightning_attn_takes_the_plan_with_its_schedule_made_once(counted):
    from cula.lightning import chunk_lightning_attn, lightning_g_gamma

    q, k, v, _, h0 = _inputs()
    v = v[:, :, :H]  # (FLA's Lightning wrappers are multi-head: v has q's heads)
    h0 = h0[:, :H]
    want = _general(q, k, v, g_gamma=lightning_g_gamma(H, 3, 8), initial_state=h0, output_final_state=True)
    outs = [chunk_lightning_attn(q, k, v, 3, 8, initial_state=h0, output_final_state=True) for _ in range(2)]
    assert counted[0] == 1 + 1  # (the general path's call, then one plan)
    for o, s in outs:
        assert torch.equal(o, want[0]) and torch.equal(s, want[1])
    import cula.lightning.chunk as lc

    made = lc._LAYER_DECAYS.get(q.device, ("lightning_decay", H, 3, 8), lambda: None)
    assert made is not None and torch.equal(made, -lightning_g_gamma(H, 3, 8))
    with pytest.raises(ValueError, match="layer_idx"):
        chunk_lightning_attn(q, k, v, 9, 8)


@pytest.fixture
def fake_lightning(monkeypatch, pretend_sm90):
    """CPU tensors on a pretend SM90; the Lightning kernel records its variant and arguments (the combine's scan
    kernel runs its torch rule)."""
    from cula.ops.lightning.sm90 import chunk_fwd

    calls = []
    monkeypatch.setattr(chunk_fwd, "compiled_variant", lambda *key, **kw: lambda *a: calls.append((key, kw, a)))
    _scan_by_its_rule(monkeypatch)
    return calls


def _scan_by_its_rule(monkeypatch):
    """The combine's scan kernel (``segment_chain``) replaced by its torch rule, ``time_parallel._scan_starts``."""
    import cula.lightning.time_parallel as tp
    from cula.ops.lightning.sm90 import segment_chain

    def variant(D, has_h0):
        def run(E, h0, starts, bounds, first, decay, N):
            full = (E.shape[0], E.shape[1], D, D)
            h0 = None if h0 is None else h0.view(N, E.shape[1], D, D)
            starts.copy_(tp._scan_starts(E.view(full), h0, decay, bounds.tolist(), first.tolist()).view(starts.shape))

        return run

    monkeypatch.setattr(segment_chain, "compiled_variant", variant)


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_bound_launch_passes_what_the_general_path_passes(counted, fake_lightning, state_v_first, with_state):
    """Three calls of one signature on fresh inputs (chunk_simple_gla twice, then lightning_attn_fwd): the kernel gets
    each call's own tensors, every argument equal to what the general path hands it for those inputs."""
    from cula.simple_gla.backends import _lightning_forward

    kw = dict(scale=0.125, output_final_state=with_state, state_v_first=state_v_first)
    with torch.no_grad():
        for seed, lightning in ((0, False), (1, False), (2, True)):
            q, k, v, decay, h0 = _inputs(seed)
            h0 = h0 if with_state else None
            _lightning_forward(q, k, v, -decay, 0.125, h0, with_state, state_v_first, None)
            if lightning:
                lightning_attn_fwd(q, k, v, decay, initial_state=h0, **kw)
            else:
                chunk_simple_gla(q, k, v, g_gamma=-decay, initial_state=h0, **kw)
            (key, vkw, want), (got_key, got_kw, got) = fake_lightning[-2:]
            assert (got_key, got_kw) == (key, vkw) and len(got) == len(want)
            # fn(q, k, v, o, decay, h0, ht, cu_seqlens, scale): the inputs themselves, fresh outputs of the same layout
            for i in (0, 1, 2, 5, 7):
                assert got[i] is want[i] or (got[i] is (q, k, v)[i] if i < 3 else False), i
            for i in (3, 6):
                a, b = want[i], got[i]
                assert (a is None) == (b is None)
                if a is not None:
                    assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
            assert got[8] == want[8]
            assert torch.equal(got[4], want[4]) and torch.equal(got[4], decay) and (got[4] is decay) == lightning
    assert counted[0] == 1


@pytest.fixture
def writing_lightning(monkeypatch, pretend_sm90):
    """CPU tensors on a pretend SM90; the Lightning kernel records its variant and arguments and writes outputs that
    are a function of its inputs (the states-only pass's ends from k and v, the output pass's o and ends from q and
    its starts), so that what a cut call computes between and after its passes can be compared; the combine's scan
    kernel runs its torch rule."""
    from cula.ops.lightning.sm90 import chunk_fwd

    calls = []

    def variant(*key, **kw):
        def run(q, k, v, o, decay, h0, ht, cu, scale):
            calls.append((key, kw, (q, k, v, o, decay, h0, ht, cu, scale)))
            segs = cu.numel() - 1
            if ht is not None:  # per segment: sums of its rows, the decay and the start
                for m in range(segs):
                    a, b = int(cu[m]), int(cu[m + 1])
                    x = (k if q is None else q)[0, a:b].float().sum(0)[:, :, None] + v[0, a:b].float().sum(0)[:, None]
                    ht[m] = x.expand(ht.shape[1:]) * (1 + decay[:, None, None]) + (0 if h0 is None else h0[m])
            if o is not None:
                o.copy_((q.float().mean(-1, keepdim=True) + v.float()).to(o.dtype))

        return run

    monkeypatch.setattr(chunk_fwd, "compiled_variant", variant)
    _scan_by_its_rule(monkeypatch)
    return calls


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("decayed", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_cut_launch_runs_what_the_general_path_runs(counted, writing_lightning, monkeypatch, state_v_first,
                                                    with_state, decayed, packed):  # fmt: skip
    """A long sequence with few heads is cut in time (cula.lightning.time_parallel): repeated calls of its signature
    (packed: with the same boundaries, one long sequence among short ones, which run whole) take the bound cut
    launch, which hands the kernel's two passes what the general path hands them (the segment tables, the decay,
    the combined starts) and returns the same outputs; a short call takes the unsplit launch."""
    import cula.lightning.time_parallel as tp
    from cula.simple_gla.backends import _chunk_cula_sm90, _prepare_chunk_cula_sm90

    general_cuts = []
    real_forward = tp.time_parallel_forward
    monkeypatch.setattr(tp, "time_parallel_forward", lambda *a: general_cuts.append(1) or real_forward(*a))
    lens = (1000, 32768, 64) if packed else (32768, 32768)
    Bc, Tc, Hc, Dc = (1, sum(lens), 1, 64) if packed else (len(lens), lens[0], 1, 64)
    cu = bounds = None
    if packed:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        bounds = dict(cu_seqlens=cu, cu_seqlens_cpu=cu)
    kw = dict(scale=0.125, output_final_state=with_state, state_v_first=state_v_first, **(bounds or {}))
    with torch.no_grad():
        for seed in range(2):  # fresh inputs of one signature: the first call plans, the second runs the plan
            gen = torch.Generator().manual_seed(seed)
            q, k, v = (torch.randn(Bc, Tc, Hc, Dc, generator=gen).to(torch.bfloat16) for _ in range(3))
            g_gamma = -torch.rand(Hc, generator=gen) if decayed else None
            h0 = torch.randn(len(lens), Hc, Dc, Dc, generator=gen) if with_state else None
            want = _chunk_cula_sm90(q, k, v, g_gamma, 0.125, h0, with_state, state_v_first, cu, cu)
            general = writing_lightning[-2:]
            got = chunk_simple_gla(q, k, v, g_gamma=g_gamma, initial_state=h0, **kw)
            bound = writing_lightning[-2:]
            assert len(general_cuts) == seed + 1  # (the reference's alone)
            for (key, vkw, a), (got_key, got_kw, b) in zip(general, bound):
                assert (got_key, got_kw) == (key, vkw)
                for x, y in zip(a, b):
                    if isinstance(x, torch.Tensor):
                        assert (x.shape, x.stride(), x.dtype) == (y.shape, y.stride(), y.dtype)
                        if x.data_ptr() != y.data_ptr():  # a view of the same input, or the same values
                            assert torch.equal(x, y)
                    else:
                        assert x == y
            assert bound[0][2][0] is None and bound[1][2][0] is not None  # the states-only pass, then the outputs
            assert torch.equal(got[0], want[0])
            assert (got[1] is None) == (not with_state) and (got[1] is None or torch.equal(got[1], want[1]))
    assert counted[0] == 1
    args = dict(q=q, k=k, v=v, g_gamma=g_gamma, scale=0.125, initial_state=None, output_final_state=True,
                state_v_first=False, cu_seqlens=None)  # fmt: skip
    short = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16)
    launch = _prepare_chunk_cula_sm90(**dict(args, q=short, k=short, v=short))
    assert launch is not None and hasattr(launch, "from_decay")  # (the unsplit launch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm_90)")
@pytest.mark.parametrize("state_v_first", [False, True])
def test_bound_launch_bit_identical_cuda(counted, state_v_first):
    """The bound launch (chunk_simple_gla's and lightning_attn_fwd's repeated calls) against the kernel's general
    path, bit for bit, outputs poisoned first."""
    from cula.simple_gla.backends import _lightning_forward
    from cula.testing import poisoned_allocations

    for seed, lightning in ((0, False), (1, False), (2, True)):  # fresh inputs of one signature
        q, k, v, decay, h0 = (t.cuda() for t in _inputs(seed))
        want = _lightning_forward(q, k, v, -decay, D**-0.5, h0, True, state_v_first, None)
        with torch.no_grad(), poisoned_allocations():
            kw = dict(initial_state=h0, output_final_state=True, state_v_first=state_v_first)
            if lightning:
                o, s = lightning_attn_fwd(q, k, v, decay, **kw)
            else:
                o, s = chunk_simple_gla(q, k, v, g_gamma=-decay, **kw)
        assert torch.isfinite(o).all() and torch.isfinite(s).all()
        assert torch.equal(o, want[0]) and torch.equal(s, want[1])
    assert counted[0] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm_90)")
@pytest.mark.parametrize("state_v_first", [False, True])
def test_cut_launch_bit_identical_cuda(counted, state_v_first):
    """Repeated calls the time split cuts (the bound cut launch) against the general path's cut, bit for bit, outputs
    poisoned first: one sequence with and without a decay and an initial state, and a pack of one long sequence
    among short ones."""
    from cula.lightning.plan import parallel_segments
    from cula.simple_gla.backends import _chunk_cula_sm90
    from cula.testing import poisoned_allocations

    Hc, HVc, Dc = 2, 4, 128
    dev = torch.device("cuda")
    lens = (1000, 40000, 63)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    for decayed, with_state, packed in ((True, True, False), (False, False, False), (True, True, True)):
        Bc, Tc = (1, sum(lens)) if packed else (1, 40000)
        bounds = dict(cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu) if packed else {}
        assert parallel_segments(Bc, Tc, HVc, bounds.get("cu_seqlens"), bounds.get("cu_seqlens_cpu"), dev)
        for seed in range(2):
            gen = torch.Generator().manual_seed(seed)
            q, k = (torch.randn(Bc, Tc, Hc, Dc, generator=gen).to(torch.bfloat16).cuda() for _ in range(2))
            v = torch.randn(Bc, Tc, HVc, Dc, generator=gen).to(torch.bfloat16).cuda()
            g_gamma = -0.01 * torch.rand(HVc, generator=gen).cuda() if decayed else None
            h0 = torch.randn(len(lens) if packed else Bc, HVc, Dc, Dc, generator=gen).cuda() if with_state else None
            with torch.no_grad():
                want = _chunk_cula_sm90(q, k, v, g_gamma, Dc**-0.5, h0, True, state_v_first,
                                        bounds.get("cu_seqlens"), bounds.get("cu_seqlens_cpu"))  # fmt: skip
                with poisoned_allocations():
                    o, s = chunk_simple_gla(q, k, v, g_gamma=g_gamma, initial_state=h0, output_final_state=True,
                                            state_v_first=state_v_first, **bounds)  # fmt: skip
            assert torch.isfinite(o).all() and torch.isfinite(s).all()
            assert torch.equal(o, want[0]) and torch.equal(s, want[1])
    assert counted[0] == 3  # one plan per signature


def _packed(lens, seed=0, dtype=torch.bfloat16, device="cpu", cu_dtype=torch.int32):
    """One packed batch of ``lens`` (B = 1): q, k, v, decay, h0 (one a sequence), cu_seqlens and its host copy."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q, k = (torch.randn(1, total, H, D, generator=gen).to(dtype).to(device) for _ in range(2))
    v = torch.randn(1, total, HV, D, generator=gen).to(dtype).to(device)
    decay = torch.rand(HV, generator=gen).to(device)
    h0 = (0.1 * torch.randn(len(lens), HV, D, D, generator=gen)).to(device)
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    cu_cpu = torch.tensor(bounds, dtype=cu_dtype)
    return q, k, v, decay, h0, cu_cpu.to(device), cu_cpu


PACKINGS = ([40, 0, 130, 64], [3, 64, 200, 1], [0, 0, 0, 65])  # one sequence count, three totals


def test_packed_calls_are_planned_without_their_total_length(counted):
    """Packed calls with the boundaries' host copy: one plan for every total length, each call the general path's
    numbers (empty sequences included)."""
    for seed, lens in enumerate(PACKINGS):
        q, k, v, decay, h0, cu, cu_cpu = _packed(lens, seed)
        kw = dict(g_gamma=-decay, initial_state=h0, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
        o, s = chunk_simple_gla(q, k, v, **kw)
        o_want, s_want = _general(q, k, v, **kw)
        assert torch.equal(o, o_want) and torch.equal(s, s_want)
    assert counted[0] == 1 + len(PACKINGS) and len(chunk_mod._plans) == 1
    # without the host copy a packed call is validated every time (its boundaries would be read from the device)
    chunk_simple_gla(q, k, v, g_gamma=-decay, initial_state=h0, cu_seqlens=cu)
    assert counted[0] == 2 + len(PACKINGS) and len(chunk_mod._plans) == 1


def test_packed_boundaries_are_checked_every_call(counted):
    q, k, v, decay, h0, cu, cu_cpu = _packed(PACKINGS[0])
    kw = dict(g_gamma=-decay, initial_state=h0)
    chunk_simple_gla(q, k, v, **kw, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    bad = {
        "end at the total": torch.tensor([0, 40, 40, 170, 233], dtype=torch.int32),
        "non-decreasing": torch.tensor([0, 40, 30, 170, 234], dtype=torch.int32),
        "start at 0": torch.tensor([1, 40, 40, 170, 234], dtype=torch.int32),
    }
    for why, b in bad.items():
        with pytest.raises(ValueError, match=why):
            chunk_simple_gla(q, k, v, **kw, cu_seqlens=b, cu_seqlens_cpu=b.clone())
    other = torch.tensor([0, 41, 41, 170, 234], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_cpu"):  # a host copy that is not the boundaries'
        chunk_simple_gla(q, k, v, **kw, cu_seqlens=cu, cu_seqlens_cpu=other)
    with pytest.raises(ValueError):  # a state per sequence
        chunk_simple_gla(q, k, v, g_gamma=-decay, initial_state=h0[:3], cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    assert len(chunk_mod._plans) == 1


@pytest.mark.parametrize("with_state", [False, True])
def test_packed_bound_launch_passes_what_the_general_path_passes(counted, fake_lightning, with_state):
    """On a pretend SM90, packed calls of new total lengths reuse one bound launch, which hands the kernel each call's
    own tensors and boundaries, every argument equal to what the general path hands it."""
    from cula.simple_gla.backends import _lightning_forward

    with torch.no_grad():
        for seed, lens in enumerate(PACKINGS):
            q, k, v, decay, h0, cu, cu_cpu = _packed(lens, seed)
            h0 = h0 if with_state else None
            _lightning_forward(q, k, v, -decay, 0.125, h0, with_state, True, cu)
            chunk_simple_gla(q, k, v, g_gamma=-decay, scale=0.125, initial_state=h0, output_final_state=with_state,
                             state_v_first=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)  # fmt: skip
            (key, vkw, want), (got_key, got_kw, got) = fake_lightning[-2:]
            assert (got_key, got_kw) == (key, vkw) and len(got) == len(want)
            # fn(q, k, v, o, decay, h0, ht, cu_seqlens, scale)
            for i in (0, 1, 2, 7):
                assert got[i] is (q, k, v, cu)[min(i, 3)] and want[i] is got[i], i
            assert got[5] is want[5] is h0
            for i in (3, 6):
                a, b = want[i], got[i]
                assert (a is None) == (b is None)
                if a is not None:
                    assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
            assert got[8] == want[8] and torch.equal(got[4], want[4]) and torch.equal(got[4], decay)
    assert counted[0] == 1


def test_packed_int64_boundaries_take_the_general_launch(counted, fake_lightning):
    """int64 boundaries (cast each call) keep the backend's general path under the plan: the same kernel arguments
    as without one. A packed call the time split cuts runs its cut's bound launch (the states-only pass, then the
    outputs over the segments), and the general path while a CUDA graph captures (not on the CPU)."""
    from cula.simple_gla.backends import _packed_launch

    q, k, v, decay, h0, cu, cu_cpu = _packed(PACKINGS[0], cu_dtype=torch.int64)
    assert _packed_launch(q, k, v, 0.125, h0, True, False, cu) is None
    with torch.no_grad():
        for _ in range(2):
            o, s = chunk_simple_gla(q, k, v, g_gamma=-decay, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                    cu_seqlens_cpu=cu_cpu)  # fmt: skip
            assert fake_lightning[-1][2][7].dtype == torch.int32
    assert counted[0] == 1
    long = torch.zeros(1, 32768, 1, 64, dtype=torch.bfloat16)
    cu_long = torch.tensor([0, 32768], dtype=torch.int32)
    launch = _packed_launch(long, long, long, 0.125, None, True, False, cu_long)
    import cula.simple_gla.backends as sb

    seen = []
    real = sb._chunk_cula_sm90
    try:
        sb._chunk_cula_sm90 = lambda *a: seen.append(a) or (None, None)
        launch(long, long, long, -torch.ones(1), None, cu_long, cu_long.clone())
    finally:
        sb._chunk_cula_sm90 = real
    (_, _, first), (_, _, second) = fake_lightning[-2:]
    assert not seen and first[0] is None and second[0] is not None  # (cut in time: the bound cut's two passes)
    assert second[7].numel() > 2 and int(second[7][-1]) == 32768  # (its segments' bounds)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm_90)")
def test_packed_bound_launch_bit_identical_cuda(counted):
    """Packed calls of three total lengths through one plan against the kernel's general path, bit for bit, outputs
    poisoned first."""
    from cula.simple_gla.backends import _lightning_forward
    from cula.testing import poisoned_allocations

    for seed, lens in enumerate(PACKINGS):
        q, k, v, decay, h0, cu, cu_cpu = _packed(lens, seed, device="cuda")
        want = _lightning_forward(q, k, v, -decay, D**-0.5, h0, True, False, cu)
        with torch.no_grad(), poisoned_allocations():
            o, s = chunk_simple_gla(q, k, v, g_gamma=-decay, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                    cu_seqlens_cpu=cu_cpu)  # fmt: skip
        assert torch.isfinite(o).all() and torch.isfinite(s).all()
        assert torch.equal(o, want[0]) and torch.equal(s, want[1])
    assert counted[0] == 1


def test_packed_views_and_empty_packs_are_not_planned(counted, fake_lightning):
    """A review's cases: a slice of a larger static buffer (``buf[:, :T]``: is_contiguous, but its size-1 batch stride
    is the buffer's) after a planned call is validated in full and handed to the kernel as the general path hands it
    (row-major copies, a row-major o); an empty first pack plans nothing for its signature."""
    q, k, v, decay, h0, cu, cu_cpu = _packed(PACKINGS[0])
    kw = dict(g_gamma=-decay, initial_state=h0, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    with torch.no_grad():
        chunk_simple_gla(q, k, v, **kw)
        bufs = [torch.zeros(1, 4096, *t.shape[2:], dtype=t.dtype) for t in (q, k, v)]
        for buf, t in zip(bufs, (q, k, v)):
            buf[:, : t.shape[1]] = t
        qs, ks, vs = (buf[:, : q.shape[1]] for buf in bufs)
        assert qs.is_contiguous() and qs.stride(0) != q.numel()
        o, s = chunk_simple_gla(qs, ks, vs, **kw)
        got = fake_lightning[-1][2]
        assert counted[0] == 2 and all(g.stride() == t.stride() for g, t in zip(got[:4], (q, k, v, v)))
        assert o.stride() == v.stride()
        empty = [t[:, :0] for t in (q, k, v)]
        z = torch.zeros(h0.shape[0] + 1, dtype=torch.int32)
        chunk_simple_gla(*empty, g_gamma=-decay, initial_state=h0, output_final_state=True, cu_seqlens=z,
                         cu_seqlens_cpu=z.clone())  # fmt: skip
    assert len(chunk_mod._plans) == 1
