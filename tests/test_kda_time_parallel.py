"""KDA's exact time-parallel recurrence (``cula.kda.forward.parallel_segment_states``) and its planner
(``cula.kda.plan.parallel_segments``).

CPU: the state/output kernel replaced by a float64 torch model of the same stage (``_states_model``: the chunked
recurrence over the intra stage's w / u / kg / qg / g / Aqk), so the cut, the three packed calls, the segmented scan
and the final states are checked against one serial call of the same model, for packed sequences (empty and
ragged ones among them), fixed-length batches, both state layouts, with and without states. GPU: ``chunk_kda``
cut against the serial path and the float64 reference (``-m gpu``).
"""

from __future__ import annotations

import math

import pytest
import torch

from cula.kda.forward import parallel_segment_states
from cula.testing import assert_close, make_cu_seqlens, rel_rmse
from cula.time_split import SplitThresholds, half_bounds, split_plan

K = V = 16  # the model takes any head size; the kernel's 128 changes nothing here
HV = 3
BT = 64


def _states_model(w, u, kg, qg, g, Aqk, o, h0, ht, cu, *, scale, state_v_first, aqk_causal):
    """The state/output stage's math in float64 (the kernel's contract): per chunk of each sequence
    ``v' = u - w S``, ``o = scale qg S + tril(Aqk) v'``, ``S <- diag(exp2 g_last) S + kg^T v'``."""
    del aqk_causal
    bounds = cu.tolist()
    W, U, KG, QG, G, A = (t[0].double() for t in (w, u, kg, qg, g, Aqk))
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        S = h0[n].double() if h0 is not None else torch.zeros(HV, K, V, dtype=torch.float64)
        if state_v_first and h0 is not None:
            S = S.transpose(-1, -2)
        for c in range(bos, eos, BT):
            r = slice(c, min(c + BT, eos))
            L = r.stop - r.start
            v_new = U[r] - torch.einsum("lhk,hkv->lhv", W[r], S)
            mask = torch.tril(torch.ones(L, L, dtype=torch.bool))
            Ac = torch.where(mask[:, None, :], A[r][:, :, :L], 0.0)
            o[0, r] = (scale * torch.einsum("lhk,hkv->lhv", QG[r], S) + torch.einsum("lhs,shv->lhv", Ac, v_new)).to(
                o.dtype
            )
            S = torch.exp2(G[r.stop - 1])[:, :, None] * S + torch.einsum("lhk,lhv->hkv", KG[r], v_new)
        if ht is not None:
            ht[n] = (S.transpose(-1, -2) if state_v_first else S).to(ht.dtype)


def _summary_model(w, u, kg, g, summary, cu, *, state_v_first, mids=None):
    """The segment-summary kernel's contract (``segment_summary_kernel.py``) from the state model: E of head h
    (from a zero start) at h, R of head h (from the identity, u = 0) at HV + h; ``mids``: the same of each segment's
    first half (``cula.time_split.half_bounds``)."""
    if mids is not None:  # the summaries of all the halves; the first halves are the even ones
        both = torch.empty((2 * mids.shape[0],) + tuple(mids.shape[1:]))
        halves = torch.tensor(half_bounds(cu.tolist()), dtype=torch.int32)
        _summary_model(w, u, kg, g, both, halves, state_v_first=state_v_first)
        mids.copy_(both[0::2])
    M, o = cu.numel() - 1, torch.empty(u.shape, dtype=u.dtype)
    eye = torch.eye(K).expand(M, HV, K, K).contiguous()
    E, R = torch.empty(M, HV, K, V), torch.empty(M, HV, K, V)
    kw = dict(scale=1.0, state_v_first=state_v_first, aqk_causal=True)
    zeros, no_scores = torch.zeros_like(u), torch.zeros(u.shape[:-1] + (BT,))
    _states_model(w, u, kg, torch.zeros_like(kg), g, no_scores, o, None, E, cu, **kw)
    _states_model(w, zeros, kg, torch.zeros_like(kg), g, no_scores, o, eye, R, cu, **kw)
    summary.copy_(torch.cat((E, R), dim=1))


def chain_model(summary, h0, starts, ht, first, *, state_v_first):
    """The segment-chain kernel's contract (``segment_chain_kernel.py``) in float64: along each sequence, a segment
    starts where the one before ends (the first from ``h0`` or zero), ``end = R start + E`` in the [K, V] state's
    terms (the transposes for [V, K] states, whose stored R is the transpose too); the last end is the final
    state."""
    HV = summary.shape[1] // 2
    E, R = summary[:, :HV].double(), summary[:, HV:].double()
    if state_v_first:  # [V, K] storage holds every state transposed, R included
        E, R = E.transpose(-1, -2), R.transpose(-1, -2)
    bounds = first.tolist()
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        S = torch.zeros(E.shape[1:], dtype=torch.float64) if h0 is None else h0[n].double()
        if h0 is not None and state_v_first:
            S = S.transpose(-1, -2)
        for m in range(a, b):
            starts[m] = (S.transpose(-1, -2) if state_v_first else S).to(starts.dtype)
            S = R[m] @ S + E[m]
        if ht is not None:
            ht[n] = (S.transpose(-1, -2) if state_v_first else S).to(ht.dtype)


def _intermediates(total: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    w, kg, qg = (rnd(1, total, HV, K) * 0.2 for _ in range(3))
    u = rnd(1, total, HV, V)
    g = -torch.rand(1, total, HV, K, generator=gen) * 2.0  # base-2 log decay of the chunk's last row
    Aqk = rnd(1, total, HV, BT) * 0.1
    return w, u, kg, qg, g, Aqk


def _serial_and_split(lengths, segment_len, state_v_first, with_h0, with_ht, seed=0, halves=False):
    total = sum(lengths)
    w, u, kg, qg, g, Aqk = _intermediates(total, seed)
    N = len(lengths)
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    h0 = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1)) if with_h0 else None
    kw = dict(scale=0.25, state_v_first=state_v_first, aqk_causal=True)
    o_ref = torch.full((1, total, HV, V), float("nan"))
    ht_ref = torch.full(shape, float("nan")) if with_ht else None
    _states_model(w, u, kg, qg, g, Aqk, o_ref, h0, ht_ref, make_cu_seqlens(lengths), **kw)
    plan = split_plan(lengths, segment_len)
    assert plan is not None
    o = torch.full_like(o_ref, float("nan"))
    ht = torch.full(shape, float("nan")) if with_ht else None
    parallel_segment_states(plan, w, u, kg, qg, g, Aqk, o, h0, ht, states_fn=_states_model,
                            summary_fn=_summary_model, chain_fn=chain_model, halves=halves, **kw)  # fmt: skip
    return (o_ref, ht_ref), (o, ht), plan


@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("with_h0,with_ht", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize(
    "lengths,segment_len",
    [([1000], 64), ([1000], 192), ([640, 0, 129, 3 * BT + 7, 1], 128), ([5 * BT, 5 * BT], 64)],
    ids=["one-64", "one-192", "ragged-pack", "two-equal"],
)
@pytest.mark.parametrize("halves", [False, True], ids=["segments", "halves"])
def test_split_matches_serial(lengths, segment_len, state_v_first, with_h0, with_ht, halves):
    (o_ref, ht_ref), (o, ht), plan = _serial_and_split(lengths, segment_len, state_v_first, with_h0, with_ht,
                                                       halves=halves)  # fmt: skip
    assert plan.num_segments > len(lengths)  # something was cut
    assert not o.isnan().any()
    assert_close("o", o_ref, o, 1e-5)
    if with_ht:
        assert not ht.isnan().any()
        assert_close("final state", ht_ref, ht, 1e-5)


def test_half_bounds():
    """Each segment cut after the first half of its chunks (rounded down), at a chunk boundary: a segment of at most
    one chunk (or none) gets an empty first half."""
    assert half_bounds((0, 1000)) == (0, 512, 1000)  # 16 chunks (the last partial): 8, then 8
    assert half_bounds((0, 256, 320, 321, 321, 450)) == (0, 128, 256, 256, 320, 320, 321, 321, 321, 385, 450)
    assert half_bounds((5,)) == (5,)


# the capture's lengths (which choose the rule), then the boundaries of a replay: same count and total
REPLAYS = [
    ([1000], [1000], 192, 0),
    ([640, 0, 129, 3 * BT + 7, 1], [1, 3 * BT + 7, 129, 0, 640], 128, 0),  # the long one last
    ([640, 0, 129, 3 * BT + 7, 1], [0, 0, 0, 0, 969], 128, 0),
    ([640, 0, 129, 3 * BT + 7, 1], [193, 194, 194, 194, 194], 128, 0),  # nothing long enough to cut
    ([900, 100], [100, 900], 64, 300),  # min_seq_len: the short one whole whichever comes first
    ([700, 0, 0], [0, 0, 700], 256, 0),
]


@pytest.mark.parametrize("capture,replay,segment_len,min_seq_len", REPLAYS)
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_device_segment_tables_cut_each_replays_boundaries(capture, replay, segment_len, min_seq_len, cu_dtype):
    """``cula.time_split.device_segment_tables``: the capture's rule applied to the boundaries ``cu_seqlens``
    holds, on its device: each sequence's nonempty segments are those ``split_plan`` cuts its length into (one
    whole where it cuts nothing), each starts on a chunk of its sequence, the spare segments past the last
    sequence's are empty, at the end, and the half bounds are ``half_bounds`` of the bounds."""
    from cula.time_split import device_segment_tables, replay_segments

    plan = split_plan(capture, segment_len, min_seq_len)
    M = replay_segments(plan, sum(capture))
    cu = make_cu_seqlens(replay, dtype=cu_dtype)
    tables = device_segment_tables(plan, cu, M, halves=True)
    bounds, first = tables.bounds.tolist(), tables.first.tolist()
    assert tables.num_segments == M and tables.bounds.dtype == tables.first.dtype == torch.int32
    assert len(bounds) == M + 1 and first[0] == 0 and len(first) == len(replay) + 1 and tables.spare
    assert bounds[first[-1]:] == [sum(replay)] * (M + 1 - first[-1])
    expect = split_plan(replay, segment_len, min_seq_len)
    starts = cu.tolist()
    for n in range(len(replay)):
        segs = [(bounds[m], bounds[m + 1]) for m in range(first[n], first[n + 1])]
        assert segs[0][0] == starts[n] and segs[-1][1] == starts[n + 1] and all(a <= b for a, b in segs)
        want = [(starts[n], starts[n + 1])] if expect is None else [
            (expect.bounds[m], expect.bounds[m + 1]) for m in expect.segments_of(n)]  # fmt: skip
        assert [x for x in segs if x[0] < x[1]] == [x for x in want if x[0] < x[1]], n
        assert all((a - starts[n]) % BT == 0 for a, b in segs if a < b)
    assert tables.halves.tolist() == list(half_bounds(bounds))


@pytest.mark.parametrize("capture,replay,segment_len,min_seq_len", REPLAYS)
@pytest.mark.parametrize("halves", [False, True], ids=["segments", "halves"])
def test_captured_cut_replays_on_new_boundaries(monkeypatch, capture, replay, segment_len, min_seq_len, halves):
    """A packed call captured while cut (capture simulated): the segment tables come from ``cu_seqlens`` on the
    device (never the plan's host bounds), so the cut is exact for the boundaries of the replay, spare segments
    (empty, in no sequence) included."""
    import cula.time_split as ts

    monkeypatch.setattr(ts, "capturing", lambda t: True)
    monkeypatch.setattr(ts, "on_device", lambda *a: pytest.fail("host-built segment tables"))
    total, N = sum(replay), len(replay)
    assert total == sum(capture)
    w, u, kg, qg, g, Aqk = _intermediates(total, 5)
    shape = (N, HV, K, V)
    h0 = torch.randn(shape, generator=torch.Generator().manual_seed(6))
    kw = dict(scale=0.25, state_v_first=False, aqk_causal=True)
    cu = make_cu_seqlens(replay)
    o_ref, ht_ref = torch.full((1, total, HV, V), float("nan")), torch.full(shape, float("nan"))
    _states_model(w, u, kg, qg, g, Aqk, o_ref, h0, ht_ref, cu, **kw)
    o, ht = torch.full_like(o_ref, float("nan")), torch.full_like(ht_ref, float("nan"))
    parallel_segment_states(split_plan(capture, segment_len, min_seq_len), w, u, kg, qg, g, Aqk, o, h0, ht,
                            states_fn=_states_model, summary_fn=_summary_model, chain_fn=chain_model, halves=halves,
                            cu_seqlens=cu, **kw)  # fmt: skip
    assert not o.isnan().any() and not ht.isnan().any()
    assert_close("o", o_ref, o, 1e-5)
    assert_close("final state", ht_ref, ht, 1e-5)


def test_strong_and_no_decay():
    """Gates near 0 (no decay over thousands of tokens) and strong ones: the carry is exact either way."""
    for scale_g in (0.0, 8.0):
        total = 2000
        w, u, kg, qg, g, Aqk = _intermediates(total, 3)
        g = g * scale_g
        kw = dict(scale=0.5, state_v_first=False, aqk_causal=True)
        ref = torch.empty(1, total, HV, V)
        ht_ref = torch.empty(1, HV, K, V)
        _states_model(w, u, kg, qg, g, Aqk, ref, None, ht_ref, make_cu_seqlens([total]), **kw)
        o, ht = torch.empty_like(ref), torch.empty_like(ht_ref)
        parallel_segment_states(split_plan([total], 64), w, u, kg, qg, g, Aqk, o, None, ht, states_fn=_states_model,
                                summary_fn=_summary_model, chain_fn=chain_model, **kw)  # fmt: skip
        assert_close(f"o (gate x{scale_g})", ref, o, 1e-5)
        assert_close(f"ht (gate x{scale_g})", ht_ref, ht, 1e-5)


def test_planner_cuts_where_measured_and_when_told(monkeypatch, kda_tuning, pretend_sm90):
    import cula.kda.plan as kp

    dev = torch.device("cuda", 0)
    # the H200's entry: the measured best segment lengths (2048 at 4 and 8 heads x 16K, 4096 at 4 heads x 64K and
    # 16 heads x 16K, 8192 at 8 heads x 64K), 16 heads cut, 2 x 16 heads whole; the segment summary's 2 CTAs per
    # (segment, head) in one wave of the 132 SMs
    for hv, t, seg in ((4, 16384, 2048), (8, 16384, 2048), (16, 16384, 4096), (4, 65536, 4096), (8, 65536, 8192),
                       (4, 262144, 16384), (8, 262144, 32768)):
        plan = kp.parallel_segments(1, t, hv, None, None, dev)
        assert plan is not None and abs(plan.segment_len - seg) <= seg // 8, (hv, t, plan)
        assert 2 * hv * plan.num_segments <= 132, (hv, t, plan.num_segments)
    assert kp.parallel_segments(1, 8192, 4, None, None, dev) is None
    assert kp.parallel_segments(2, 65536, 16, None, None, dev) is None
    assert kp.parallel_segments(1, 1 << 20, 32, None, None, dev) is None
    # one long sequence among short ones: about one lane of work, cut; sixteen long ones fill the GPU, whole
    ragged = make_cu_seqlens([65536, 1024, 1024, 0, 1024, 1024, 1024])
    plan = kp.parallel_segments(1, 70656, 4, ragged, ragged, dev)
    assert plan is not None and plan.split == (True,) + (False,) * 6
    many = make_cu_seqlens([65536] * 16)
    assert kp.parallel_segments(1, 16 * 65536, 4, many, many, dev) is None
    kda_tuning(time_split=None)
    assert kp.parallel_segments(1, 65536, 4, None, None, dev) is None
    kda_tuning(time_split=SplitThresholds(items_per_sm=2.0, busy_items_per_sm=1.0, min_segment=1024, min_seq_len=4096))
    plan = kp.parallel_segments(1, 65536, 4, None, None, dev)
    assert plan is not None and plan.segment_len == 1024 and plan.num_segments == 64
    assert kp.parallel_segments(64, 65536, 64, None, None, dev) is None  # the GPU is full already
    cu_cpu = make_cu_seqlens([65536, 1024, 0, 1024])
    plan = kp.parallel_segments(1, 67584, 4, cu_cpu, cu_cpu, dev)
    assert plan.split == (True, False, False, False)
    assert kp.parallel_segments(1, 67584, 4, cu_cpu, None, dev) is None  # no host copy: no cut (no sync)


def _gpu_case(lengths, H, gate, state_v_first, seed=0):
    """Inputs and flags of a packed chunk_kda call on the GPU: ``gate`` "strong" (the fused lower-bound gate at -5
    on raw logits: most channels forget within a chunk), "weak" (the same gate on logits shifted by -8: about
    -2e-3 a token, so a state carries across whole segments), or "softplus_weak" (the softplus gate without
    safe_gate, on shifted logits: no bound known, the intra kernel's any_gate variant); initial states in the layout."""
    torch.manual_seed(seed)
    D, T = 128, sum(lengths)
    q, k, v = (torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    g = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
    if gate != "strong":
        g = g - 8.0
    beta = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16)
    A_log, dt_bias = torch.randn(H, device="cuda") * 0.5, torch.randn(H * D, device="cuda") * 0.5
    h0 = torch.randn(len(lengths), H, D, D, device="cuda") * 0.1
    cu = make_cu_seqlens(lengths, device="cuda")
    kw = dict(
        initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, A_log=A_log, dt_bias=dt_bias, state_v_first=state_v_first, cu_seqlens=cu,
        cu_seqlens_cpu=cu.cpu(),
    )  # fmt: skip
    if gate != "softplus_weak":
        kw.update(safe_gate=True, lower_bound=-5.0)
    return (q, k, v, g, beta), kw


_REFERENCES: dict[tuple, tuple[torch.Tensor, torch.Tensor, float, float]] = {}


def _reference_and_fla(lengths, state_v_first, gate):
    """The float64 reference's o and final state for ``_gpu_case(lengths, 4, gate, state_v_first)`` and FLA's
    relative errors against them. Computed on the GPU (float64): on the CPU it took 39 s a case on two cores, most of
    the test's time, and both output-pass forms of a case share it."""
    key = (tuple(lengths), state_v_first, gate)
    if key not in _REFERENCES:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        from cula.kda.naive import reference_chunk_kda

        x, kw = _gpu_case(lengths, 4, gate, state_v_first)
        with torch.inference_mode():
            o_fla, ht_fla = fla_chunk_kda(*x, **kw)
        ref_kw = {n: t for n, t in kw.items() if n != "cu_seqlens_cpu"}
        o_ref, ht_ref = reference_chunk_kda(*x, compute_dtype=torch.float64, **ref_kw)
        errors = (rel_rmse(o_ref.float(), o_fla.float()), rel_rmse(ht_ref.float(), ht_fla.float()))
        _REFERENCES.clear()  # one case's tensors at a time: the parametrization keeps a case's two forms adjacent
        _REFERENCES[key] = (o_ref, ht_ref, *errors)
    return _REFERENCES[key]


@pytest.mark.gpu
@pytest.mark.parametrize("halves", [False, True], ids=["segments", "halves"])
@pytest.mark.parametrize("gate", ["strong", "weak", "softplus_weak"])
@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("lengths", [[20000], [16384 + 7, 1024, 0, 1024, 1024]], ids=["one", "pack"])
def test_chunk_kda_cut_matches_serial_cuda(lengths, state_v_first, gate, halves, kda_tuning):
    """chunk_kda on cula's kernels cut in time against the serial path and the float64 reference, strong and weak
    gates of both functions, the caller's initial states, NaN-poisoned outputs; the output pass over the segments,
    or over their halves (``KdaTuning.time_split_halves``).

    Against float64 the bound is FLA's tolerance, or FLA's own error on the same inputs where that is larger: with
    weak gates a state carries over thousands of tokens and every bf16 operand's rounding with it (FLA's kernels and
    cula's serial path land near 5e-3 there); the cut path may not be less accurate than FLA's kernels."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from cula.kda import chunk_kda

    x, kw = _gpu_case(lengths, 4, gate, state_v_first)
    with torch.inference_mode():
        kda_tuning(time_split=None)
        o_serial, ht_serial = chunk_kda(*x, **kw)
        kda_tuning(time_split=SplitThresholds(items_per_sm=2.0, busy_items_per_sm=1.0, min_segment=1024,
                                              min_seq_len=4096), time_split_halves=halves)  # fmt: skip
        o, ht = chunk_kda(*x, **kw)
    assert not o.isnan().any() and not ht.isnan().any()
    assert_close("o vs serial", o_serial, o, 5e-3)
    assert_close("ht vs serial", ht_serial, ht, 5e-3)
    o_ref, ht_ref, o_fla_err, ht_fla_err = _reference_and_fla(lengths, state_v_first, gate)
    for name, ref, ours, fla_err in (("o", o_ref, o, o_fla_err), ("ht", ht_ref, ht, ht_fla_err)):
        # FLA's error only where finite: an overflow in FLA's output must not lift the bound to infinity
        slack = 1.1 * fla_err if math.isfinite(fla_err) else 0.0
        assert_close(f"{name} vs f64 (FLA's error {fla_err:.2e})", ref, ours, max(5e-3, slack))


@pytest.mark.gpu
@pytest.mark.parametrize("halves", [False, True], ids=["segments", "halves"])
@pytest.mark.parametrize(
    "lengths,H", [([1 << 20], 2), ([65536, 1024, 1024, 0, 1024, 1024, 1024], 4)], ids=["T1M", "ragged-64K+5x1K"]
)
def test_chunk_kda_cut_long_cuda(lengths, H, halves, kda_tuning):
    """The H200's own planner entry (no override but the halves) cuts a 1M-token sequence and the ragged pack's
    long sequence; both match the serial path with a weak gate (state carried across every segment)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    import cula.kda.plan as kp
    from cula.kda import chunk_kda

    kda_tuning(time_split_halves=halves)
    x, kw = _gpu_case(lengths, H, "weak", True, seed=2)
    plan = kp.parallel_segments(1, sum(lengths), H, kw["cu_seqlens"], kw["cu_seqlens_cpu"], x[0].device)
    assert plan is not None and plan.split[0] and not any(plan.split[1:])
    with torch.inference_mode():
        o, ht = chunk_kda(*x, **kw)
        with kp.KDA_TUNING.override((9, 0), time_split=None):
            o_serial, ht_serial = chunk_kda(*x, **kw)
    assert not o.isnan().any() and not ht.isnan().any()
    assert_close("o vs serial", o_serial, o, 5e-3)
    assert_close("ht vs serial", ht_serial, ht, 5e-3)


@pytest.mark.gpu
def test_chunk_kda_cut_captured_first_cuda(kda_tuning):
    """A cut layout first met inside a CUDA-graph capture (its segment tables copied from pinned memory by the graph)
    replays to the eager cut call's result, and an eager call after the capture (before and after the replay) is
    right too: the capture's tables never serve it unwritten."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from cula.kda import chunk_kda

    torch.manual_seed(1)
    H, D, T = 2, 128, 12352  # a length no other test cuts, so its tables are not cached yet
    q, k, v, g = (torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    beta = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16)
    A_log, dt_bias = torch.randn(H, device="cuda") * 0.5, torch.randn(H * D, device="cuda") * 0.5
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-1.0, A_log=A_log, dt_bias=dt_bias)
    kda_tuning(time_split=SplitThresholds(items_per_sm=2.0, busy_items_per_sm=1.0, min_segment=1024, min_seq_len=4096))
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            o_g, ht_g = chunk_kda(q, k, v, g, beta, **kw)
        torch.cuda.current_stream().wait_stream(stream)
        o_e, ht_e = chunk_kda(q, k, v, g, beta, **kw)  # before any replay
        graph.replay()
        torch.cuda.synchronize()
        o_e2, ht_e2 = chunk_kda(q, k, v, g, beta, **kw)
        kda_tuning(time_split=None)
        o_s, ht_s = chunk_kda(q, k, v, g, beta, **kw)
    # the chain's small products go through cuBLAS, whose algorithm may differ under capture: fp32 noise at most
    assert not o_g.isnan().any() and not ht_g.isnan().any()
    assert_close("o replayed vs eager", o_e, o_g, 1e-5)
    assert_close("ht replayed vs eager", ht_e, ht_g, 1e-5)
    assert torch.equal(o_e2, o_e) and torch.equal(ht_e2, ht_e)
    assert_close("o vs serial", o_s, o_e, 5e-3)
    assert_close("ht vs serial", ht_s, ht_e, 5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("halves", [False, True], ids=["segments", "halves"])
def test_chunk_kda_packed_cut_captured_replays_new_boundaries_cuda(halves, kda_tuning):
    """A packed call cut in time, captured in a CUDA graph with ``cu_seqlens_cpu``, then replayed on other boundaries
    of the same sequence count and total length written into its ``cu_seqlens``: each replay is cut by the
    capture's rule on the boundaries it reads (``cula.time_split.device_segment_tables``): it matches the eager call
    on those boundaries where that is cut too (fp32 noise: the chain's products; the same segments and empty
    spares), and the serial path; NaN-poisoned outputs."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    import cula.kda.plan as kp
    from cula.kda import chunk_kda

    capture = [8192 + 7, 1024, 0, 3000]
    # the long one last, none long enough to cut, all in one, the capture's own
    replays = [[1024, 0, 3000, 8192 + 7], [3000, 3000, 3000, 3223], [0, 12223, 0, 0], capture]
    x, kw = _gpu_case(capture, 2, "weak", True, seed=3)
    cu, cu_cpu = kw.pop("cu_seqlens"), kw.pop("cu_seqlens_cpu")
    kda_tuning(time_split=SplitThresholds(items_per_sm=2.0, busy_items_per_sm=1.0, min_segment=1024,
                                          min_seq_len=4096), time_split_halves=halves)  # fmt: skip
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chunk_kda(*x, **kw, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)  # warm-up: compiles, plans
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                o_g, ht_g = chunk_kda(*x, **kw, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
        torch.cuda.current_stream().wait_stream(stream)
        for lengths in replays:
            new = make_cu_seqlens(lengths)
            cu.copy_(new)
            o_g.fill_(float("nan"))
            ht_g.fill_(float("nan"))
            graph.replay()
            o_e, ht_e = chunk_kda(*x, **kw, cu_seqlens=new.cuda(), cu_seqlens_cpu=new)
            eager_cut = kp.parallel_segments(1, sum(lengths), 2, new, new, cu.device) is not None
            kda_tuning(time_split=None)
            o_s, ht_s = chunk_kda(*x, **kw, cu_seqlens=new.cuda(), cu_seqlens_cpu=new)
            kda_tuning(time_split=SplitThresholds(items_per_sm=2.0, busy_items_per_sm=1.0, min_segment=1024,
                                                  min_seq_len=4096), time_split_halves=halves)  # fmt: skip
            torch.cuda.synchronize()
            assert not o_g.isnan().any() and not ht_g.isnan().any(), lengths
            if eager_cut:
                assert_close(f"o replayed vs eager {lengths}", o_e, o_g, 1e-5)
                assert_close(f"ht replayed vs eager {lengths}", ht_e, ht_g, 1e-5)
            assert_close(f"o replayed vs serial {lengths}", o_s, o_g, 5e-3)
            assert_close(f"ht replayed vs serial {lengths}", ht_s, ht_g, 5e-3)
