"""Exact time-parallel Lightning / ``chunk_simple_gla(g_gamma=...)`` prefill (``cula.lightning.time_parallel``).

On the CPU the float64 reference stands in for the kernel: what is tested is the cut, the combine of the segments'
end states and the carry into their outputs, against the unsplit float64 reference. The ``gpu`` tests run the same
comparisons with cula's kernel against its own serial path at up to 1M tokens.
"""

import dataclasses

import pytest
import torch

import cula.simple_gla.backends as sb
from cula.lightning import time_parallel as tp
from cula.lightning.plan import LIGHTNING_TUNING
from cula.simple_gla.naive import reference_chunk_simple_gla
from cula.testing import rel_rmse

F64_TOL = 1e-5
BF16_TOL = 5e-3  # FLA's
# one head per regime: no decay (the state only grows), slow, fast, and 4 nats a token (gone after one token)
DECAYS = (0.0, 0.01, 1.0, 4.0)


def _reference_fn(q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first, cu_seqlens):
    if q is None:  # the kernel's states-only form: the final states alone, of tokens up to cu_seqlens[-1]
        end = int(cu_seqlens[-1])
        k, v = k[:, :end], v[:, :end]
        return None, _reference_fn(torch.zeros_like(k), k, v, g_gamma, scale, initial_state, True, state_v_first,
                                   cu_seqlens)[1]  # fmt: skip
    return reference_chunk_simple_gla(
        q, k, v, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
    )  # fmt: skip


def _inputs(lengths, varlen, dtype, h0, state_v_first, H=2, HV=4, D=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    B, T = (1, sum(lengths)) if varlen else (len(lengths), lengths[0])
    q, k = (torch.randn(B, T, H, D, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(B, T, HV, D, generator=gen).to(dtype)
    g_gamma = -torch.tensor([DECAYS[i % len(DECAYS)] for i in range(HV)], dtype=torch.float64)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist())) if varlen else None
    state = torch.randn(len(lengths), HV, D, D, generator=gen) if h0 else None
    return q, k, v, g_gamma, state, cu


def _check(lengths, varlen, segment_len, dtype, tol, h0, state_v_first, output_final_state=True):
    q, k, v, g_gamma, state, cu = _inputs(lengths, varlen, dtype, h0, state_v_first)
    scale = q.shape[-1] ** -0.5
    plan = tp.split_plan(lengths, segment_len)
    if plan is None:
        assert max(lengths) <= segment_len
        return
    o, ht = tp.time_parallel_forward(_reference_fn, plan, q, k, v, g_gamma.to(dtype), scale, state,
                                     output_final_state, state_v_first, cu)
    o_ref, ht_ref = _reference_fn(q.double(), k.double(), v.double(), g_gamma, scale, state, True,
                                  state_v_first, cu)
    assert o.dtype == q.dtype and o.shape == o_ref.shape
    assert rel_rmse(o_ref, o) < tol
    if output_final_state:
        assert ht.dtype == torch.float32 and ht.shape == ht_ref.shape
        assert rel_rmse(ht_ref, ht) < tol
    else:
        assert ht is None


@pytest.mark.parametrize("T", [1, 64, 65, 200, 1000, 2500])
@pytest.mark.parametrize("segment_len", [64, 192, 512])
@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("h0", [False, True])
def test_fixed_lengths_float64(T, segment_len, state_v_first, h0):
    _check((T,) * 2, False, segment_len, torch.float64, F64_TOL, h0, state_v_first)


@pytest.mark.parametrize("T,segment_len", [(1000, 64), (2500, 512)])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_fixed_lengths_bf16(T, segment_len, state_v_first):
    _check((T,) * 2, False, segment_len, torch.bfloat16, BF16_TOL, True, state_v_first)


PACKS = [
    (0, 700, 17, 0, 130, 64, 1),  # empty, ragged, exactly one segment, one token
    (2000, 100, 100, 100, 100, 100),  # one long sequence among short ones
    (300, 0),
]


@pytest.mark.parametrize("lengths", PACKS)
@pytest.mark.parametrize("segment_len", [64, 128])
@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("h0", [False, True])
def test_varlen_packs_float64(lengths, segment_len, state_v_first, h0):
    _check(lengths, True, segment_len, torch.float64, F64_TOL, h0, state_v_first)


@pytest.mark.parametrize("state_v_first", [False, True])
def test_varlen_pack_bf16(state_v_first):
    _check(PACKS[1], True, 128, torch.bfloat16, BF16_TOL, True, state_v_first)


@pytest.mark.parametrize("varlen", [False, True])
def test_without_final_state(varlen):
    _check((700, 300) if varlen else (700, 700), varlen, 128, torch.float64, F64_TOL, True, False,
           output_final_state=False)


def test_no_decay_given():
    """``g_gamma=None`` is plain linear attention: every weight of the combine is 1."""
    q, k, v, _, state, cu = _inputs((900,), False, torch.float64, True, False)
    plan = tp.split_plan((900,), 128)
    o, ht = tp.time_parallel_forward(_reference_fn, plan, q, k, v, None, 0.25, state, True, False, cu)
    o_ref, ht_ref = _reference_fn(q, k, v, None, 0.25, state, True, False, cu)
    assert rel_rmse(o_ref, o) < F64_TOL and rel_rmse(ht_ref, ht) < F64_TOL


def test_combine_follows_the_decay_written_through_data():
    """The combine reads g_gamma's current values at each call: a write through ``g_gamma.data`` bumps no version
    counter, so anything cached on the tensor would miss it (a weight load or an RL weight sync writes so)."""
    lengths = (2000, 100, 100)
    q, k, v, g_gamma, state, cu = _inputs(lengths, True, torch.float64, True, False)
    plan = tp.split_plan(lengths, 256)

    def run(decay):
        return tp.time_parallel_forward(_reference_fn, plan, q, k, v, decay, 0.25, state, True, False, cu)

    run(g_gamma)
    g_gamma.data.mul_(0.5)
    o, ht = run(g_gamma)
    o_ref, ht_ref = _reference_fn(q, k, v, g_gamma, 0.25, state, True, False, cu)
    assert rel_rmse(o_ref, o) < F64_TOL and rel_rmse(ht_ref, ht) < F64_TOL


def test_plan_mismatch_raises():
    q, k, v, g, _, _ = _inputs((300,), False, torch.float64, False, False)
    with pytest.raises(ValueError, match="does not match"):
        tp.time_parallel_forward(_reference_fn, tp.split_plan((400,), 64), q, k, v, g, 1.0, None, True, False, None)


def test_first_pass_reads_only_feeding_segments():
    """A sequence's last segment and an uncut sequence feed no start: the first pass runs them empty, up to the
    end of the last segment that feeds one (its bounds keep one entry a segment, so E keeps the plan's rows)."""
    # lengths (0, 300, 64, 129) cut at 64: segments [0,0) | [0,64) .. [256,300) | [300,364) | [364,428) .. [492,493)
    plan = tp.split_plan((0, 300, 64, 129), 64)
    assert tp._combine_layout(plan).feeding_bounds == (0, 0, 64, 128, 192, 256, 300, 364, 428, 492, 492)
    assert tp._combine_layout(tp.split_plan((300,), 64)).feeding_bounds == (0, 64, 128, 192, 256, 256)
    # a long sequence first, short uncut ones after it: the pass ends with the long one's next-to-last segment
    assert tp._combine_layout(tp.split_plan((200, 10, 20), 64)).feeding_bounds == (0, 64, 128, 192, 192, 192, 192)

    q, k, v, g, state, cu = _inputs((200, 10, 20), True, torch.float64, True, False)
    seen = []

    def spy(q, k, v, *args):
        seen.append((q is None, args[-1].tolist()))
        return _reference_fn(q, k, v, *args)

    plan = tp.split_plan((200, 10, 20), 64)
    o, ht = tp.time_parallel_forward(spy, plan, q, k, v, g, 0.25, state, True, False, cu)
    assert seen == [(True, [0, 64, 128, 192, 192, 192, 192]), (False, [0, 64, 128, 192, 200, 210, 230])]
    o_ref, ht_ref = _reference_fn(q, k, v, g, 0.25, state, True, False, cu)
    assert rel_rmse(o_ref, o) < 1e-6 and rel_rmse(ht_ref, ht) < 1e-6  # (the starts are fp32, as the kernel's)


# a packed call captured in a CUDA graph (simulated): the capture's lengths, then the boundaries of a replay
REPLAYS = [
    ((2000, 100, 100), (100, 100, 2000), 256, 0),  # the long one last
    ((2000, 100, 100), (0, 2200, 0), 256, 0),
    ((0, 300, 64, 129), (129, 64, 0, 300), 64, 0),
    ((700, 300), (500, 500), 128, 600),  # min_seq_len: nothing cut on the replay's boundaries
    ((700, 300), (700, 300), 128, 0),
]


@pytest.mark.parametrize("capture,replay,segment_len,min_seq_len", REPLAYS)
@pytest.mark.parametrize("h0", [False, True])
@pytest.mark.parametrize("decay", ["g_gamma", "none"])
def test_captured_pack_cut_on_the_replays_boundaries(monkeypatch, capture, replay, segment_len, min_seq_len, h0,
                                                     decay):  # fmt: skip
    """A packed call cut while a CUDA graph captures: its segments (``cula.time_split.device_segment_tables``), the
    first pass's feeding bounds and the combine's segment tables come from ``cu_seqlens`` on the device, never
    from the plan's host tables, so the cut is exact for the boundaries a replay holds; float64."""
    import cula.time_split as ts

    for mod in (tp, ts):
        monkeypatch.setattr(mod, "capturing", lambda t: True)
    monkeypatch.setattr(ts, "on_device", lambda *a: pytest.fail("host-built segment tables"))
    monkeypatch.setattr(tp, "on_device", lambda *a: pytest.fail("host-built segment tables"))
    assert sum(capture) == sum(replay) and len(capture) == len(replay)
    q, k, v, g_gamma, state, cu = _inputs(replay, True, torch.float64, h0, False, seed=4)
    g_gamma = g_gamma if decay == "g_gamma" else None
    plan = tp.split_plan(capture, segment_len, min_seq_len)
    passes = []

    def spy(q, *args):
        passes.append(args[-1].tolist())
        return _reference_fn(q, *args)

    o, ht = tp.time_parallel_forward(spy, plan, q, k, v, g_gamma, 0.25, state, True, False, cu)
    o_ref, ht_ref = _reference_fn(q, k, v, g_gamma, 0.25, state, True, False, cu)
    assert rel_rmse(o_ref, o) < 1e-6 and rel_rmse(ht_ref, ht) < 1e-6  # (the starts are fp32, as the kernel's)
    # the first pass reads no further than the host layout's of the replay's own cut would
    own = tp.split_plan(replay, segment_len, min_seq_len)
    assert passes[0][-1] == (tp._combine_layout(own).feeding_bounds[-1] if own else 0)


# ------------------------------------------------------------------------------------------------ planner

TABLE = tp.SplitThresholds(items_per_sm=2.0, busy_items_per_sm=1.0, min_segment=1024, min_seq_len=4096)


def test_split_plan_bounds():
    plan = tp.split_plan((0, 300, 64, 129), 64)
    assert plan.split == (False, True, False, True)
    assert plan.bounds == (0, 0, 64, 128, 192, 256, 300, 364, 428, 492, 493)
    assert plan.first_segment == (0, 1, 6, 7)
    assert [list(plan.segments_of(s)) for s in range(4)] == [[0], [1, 2, 3, 4, 5], [6], [7, 8, 9]]
    assert tp.split_plan((64, 10), 64) is None
    assert tp.split_plan((5000, 3000), 1024, min_seq_len=4096).split == (True, False)


def test_planner_decisions():
    # off unless a table is given: the default for every GPU until measured
    assert tp.plan_time_split((65536,), 4, 132, None) is None
    # B=1, 4 heads, 64K on 132 SMs: 2 * 132 / 4 = 66 segments -> ceil(65536 / 66) = 993 -> 1024 (a 64 multiple)
    plan = tp.plan_time_split((65536,), 4, 132, TABLE)
    assert plan.segment_len == 1024 and plan.num_segments == 64
    # 1M tokens: segments grow rather than multiply
    plan = tp.plan_time_split((1 << 20,), 4, 132, TABLE)
    assert plan.segment_len == 15936 and plan.num_segments == 66
    # enough (sequence, head) items already fill the GPU: no split
    assert tp.plan_time_split((65536,) * 4, 64, 132, TABLE) is None
    assert tp.plan_time_split((65536,) * 33, 4, 132, TABLE) is None
    # short sequences are never cut, and never below min_segment
    assert tp.plan_time_split((4000,), 4, 132, TABLE) is None
    assert tp.plan_time_split((8192,), 4, 132, TABLE).segment_len == 1024
    # ragged pack: only the long sequence is cut; empty sequences are fine
    plan = tp.plan_time_split((65536, 1024, 1024, 0, 1024, 1024, 1024), 4, 132, TABLE)
    assert plan.split == (True, False, False, False, False, False, False)
    assert plan.segment_len == 1088
    assert tp.plan_time_split((0, 0), 4, 132, TABLE) is None
    with pytest.raises(ValueError, match="multiple"):
        tp.SplitThresholds(items_per_sm=1, busy_items_per_sm=1, min_segment=100, min_seq_len=0)


def test_h200_entry_cuts_where_measured():
    """The H200's entry picks, at 132 SMs, a segment length whose time bench_lightning_prefill.py --time-parallel
    measured within 10% of the best: e.g. 4 heads x 64K 2048 (0.153 ms, the best), 4 heads x 1M 31808 (about the
    best 32K), 8 heads x 256K 16K and 16 heads x 64K 8K (the best, whole waves), 16 heads x 2 x 64K 16K (the best)."""
    entry = LIGHTNING_TUNING.get((9, 0)).time_split
    cases = {((65536,), 4): 2048, ((1 << 20,), 4): 31808, ((262144,), 4): 8000, ((262144,), 8): 16384,
             ((65536,), 16): 8192, ((65536,) * 2, 16): 16384, ((65536,) + (1024,) * 5, 4): 2176}
    for (lens, heads), seg in cases.items():
        assert tp.plan_time_split(lens, heads, 132, entry).segment_len == seg, (lens, heads)
    # the prefill table's 64 heads and short sequences run whole
    assert tp.plan_time_split((16384,), 64, 132, entry) is None
    assert tp.plan_time_split((8192,), 4, 132, entry) is None
    assert tp.plan_time_split((65536,) * 3, 16, 132, entry) is None


def test_planner_fills_whole_waves():
    """With ``wave_ctas`` the segment count is rounded down to whole waves of the widest pass: at 4 heads on 132
    SMs a pass of 2 CTAs per (segment, head) holds 16 segments a wave, so a target of 17 (one too many) becomes 16
    and a target of 40 becomes 32; never below one wave."""
    waves = dataclasses.replace(TABLE, items_per_sm=0.5, min_segment=64, wave_ctas=2)
    assert tp.plan_time_split((65536,), 4, 132, dataclasses.replace(waves, wave_ctas=0)).num_segments == 17
    assert tp.plan_time_split((65536,), 4, 132, waves).num_segments == 16
    assert tp.plan_time_split((65536,), 4, 132, dataclasses.replace(waves, items_per_sm=1.2)).num_segments == 32
    assert tp.plan_time_split((65536,), 4, 132, dataclasses.replace(waves, items_per_sm=0.01)).num_segments == 16
    # 8 heads: 8 segments a wave
    assert tp.plan_time_split((65536,), 8, 132, waves).num_segments == 8


# ------------------------------------------------------------------------------------ the cula-sm90 backend hook


def _patch_hook(monkeypatch, tune, table, calls):
    import cula.arch

    def fake_forward(*args):
        calls.append(args[-1])  # cu_seqlens the kernel saw
        return _reference_fn(*args)

    monkeypatch.setattr(sb, "_lightning_forward", fake_forward)
    monkeypatch.setattr(cula.arch, "device_arch", lambda dev: (9, 0))
    monkeypatch.setattr("cula.time_split.sm_count", lambda index: 132)
    tune(time_split=table)


@pytest.mark.parametrize("varlen", [False, True])
def test_backend_splits_when_table_says(monkeypatch, lightning_tuning, varlen):
    calls = []
    table = tp.SplitThresholds(items_per_sm=1.0, busy_items_per_sm=1.0, min_segment=128, min_seq_len=512)
    _patch_hook(monkeypatch, lightning_tuning, table, calls)
    lengths = (3000, 100, 0, 200) if varlen else (3000,)
    q, k, v, g, h0, cu = _inputs(lengths, varlen, torch.float64, True, False)
    args = (q, k, v, g, 0.25, h0, True, False, cu, None if cu is None else cu.clone())
    o, ht = sb._chunk_cula_sm90(*args)
    assert calls[-1] is not None and calls[-1].numel() > len(lengths) + 1  # ran on segments
    o_ref, ht_ref = _reference_fn(q, k, v, g, 0.25, h0, True, False, cu)
    assert rel_rmse(o_ref, o) < F64_TOL and rel_rmse(ht_ref, ht) < F64_TOL
    if varlen:  # without the host copy of the boundaries it never splits (reading them would sync)
        sb._chunk_cula_sm90(*args[:-1], None)
        assert calls[-1] is cu


def test_backend_unchanged_while_table_off(monkeypatch, lightning_tuning):
    calls = []
    _patch_hook(monkeypatch, lightning_tuning, None, calls)
    q, k, v, g, h0, _ = _inputs((3000,), False, torch.float64, True, False)
    sb._chunk_cula_sm90(q, k, v, g, 0.25, h0, True, False, None, None)
    assert calls == [None]


# ------------------------------------------------------------------------------------------------------ GPU


def _gpu_inputs(lengths, varlen, HV=4, D=128, h0=True):
    torch.manual_seed(0)
    B, T = (1, sum(lengths)) if varlen else (len(lengths), lengths[0])
    q, k, v = (torch.randn(B, T, HV, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    g_gamma = -torch.tensor([0.0, 1e-4, 0.05, 4.0][:HV], device="cuda")
    cu = None
    if varlen:
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), device="cuda", dtype=torch.int32)
    state = torch.randn(len(lengths), HV, D, D, device="cuda") if h0 else None
    return q, k, v, g_gamma, state, cu


@pytest.mark.gpu
@pytest.mark.parametrize("T,segment_len", [(65536, 1024), (65536 + 333, 4096), (1 << 20, 16384)])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_gpu_split_matches_serial(T, segment_len, state_v_first):
    q, k, v, g, h0, _ = _gpu_inputs((T,), False)
    scale = q.shape[-1] ** -0.5
    o_s, ht_s = sb._lightning_forward(q, k, v, g, scale, h0, True, state_v_first, None)
    plan = tp.split_plan((T,), segment_len)
    o, ht = tp.time_parallel_forward(sb._lightning_forward, plan, q, k, v, g, scale, h0, True, state_v_first, None)
    assert rel_rmse(o_s, o) < BF16_TOL and rel_rmse(ht_s, ht) < BF16_TOL
    if T <= 65536 + 333:  # the float64 reference is slow; at 64K it is affordable
        o_r, ht_r = _reference_fn(q.double(), k.double(), v.double(), g.double(), scale, h0, True, state_v_first,
                                  None)
        assert rel_rmse(o_r, o) < BF16_TOL and rel_rmse(ht_r, ht) < BF16_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("state_v_first", [False, True])
def test_gpu_ragged_pack(state_v_first):
    lengths = (65536, 1024, 1024, 0, 1024, 1024, 1024)
    q, k, v, g, h0, cu = _gpu_inputs(lengths, True)
    scale = q.shape[-1] ** -0.5
    o_s, ht_s = sb._lightning_forward(q, k, v, g, scale, h0, True, state_v_first, cu)
    plan = tp.split_plan(lengths, 2048)
    o, ht = tp.time_parallel_forward(sb._lightning_forward, plan, q, k, v, g, scale, h0, True, state_v_first, cu)
    o_r, ht_r = _reference_fn(q.double(), k.double(), v.double(), g.double(), scale, h0, True, state_v_first, cu)
    for ref in ((o_s, ht_s), (o_r, ht_r)):
        assert rel_rmse(ref[0], o) < BF16_TOL and rel_rmse(ref[1], ht) < BF16_TOL


@pytest.mark.gpu
def test_gpu_dispatch_and_graph_capture(lightning_tuning):
    """Through ``lightning_attn_fwd`` with a table switched on: split, and replayable from a CUDA graph."""
    from cula.lightning import lightning_attn_fwd

    lightning_tuning(time_split=tp.SplitThresholds(2.0, 1.0, 1024, 4096))
    q, k, v, g, h0, _ = _gpu_inputs((131072,), False)
    with torch.inference_mode():
        o_s, ht_s = sb._lightning_forward(q, k, v, g, q.shape[-1] ** -0.5, h0, True, False, None)
        o, ht = lightning_attn_fwd(q, k, v, -g, initial_state=h0, output_final_state=True)
        assert rel_rmse(o_s, o) < BF16_TOL and rel_rmse(ht_s, ht) < BF16_TOL
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_g, ht_g = lightning_attn_fwd(q, k, v, -g, initial_state=h0, output_final_state=True)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o_g, o) and torch.equal(ht_g, ht)


@pytest.mark.gpu
def test_gpu_packed_capture_replays_new_boundaries(lightning_tuning):
    """``chunk_simple_gla(g_gamma)`` packed with ``cu_seqlens_cpu`` and cut, captured in a CUDA graph, then replayed
    on other boundaries (same count and total) written into its ``cu_seqlens``: each replay is cut on the boundaries
    it reads and matches the serial kernel on them; NaN-poisoned outputs."""
    from cula.simple_gla import chunk_simple_gla

    lightning_tuning(time_split=tp.SplitThresholds(2.0, 1.0, 1024, 4096))
    capture = (65536, 1024, 0, 1024, 1023)
    replays = [(1024, 1023, 1024, 0, 65536), (13721, 13721, 13721, 13722, 13722), (0, 68607, 0, 0, 0), capture]
    q, k, v, g, h0, cu = _gpu_inputs(capture, True)
    cu_cpu = cu.cpu()
    scale = q.shape[-1] ** -0.5
    kw = dict(g_gamma=g, scale=scale, initial_state=h0, output_final_state=True)
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chunk_simple_gla(q, k, v, **kw, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)  # warm-up: compiles, plans
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                o_g, ht_g = chunk_simple_gla(q, k, v, **kw, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
        torch.cuda.current_stream().wait_stream(stream)
        for lengths in replays:
            assert sum(lengths) == sum(capture)
            new = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
            cu.copy_(new)
            o_g.fill_(float("nan"))
            ht_g.fill_(float("nan"))
            graph.replay()
            o_s, ht_s = sb._lightning_forward(q, k, v, g, scale, h0, True, False, new.cuda())
            torch.cuda.synchronize()
            assert not o_g.isnan().any() and not ht_g.isnan().any(), lengths
            assert rel_rmse(o_s, o_g) < BF16_TOL and rel_rmse(ht_s, ht_g) < BF16_TOL, lengths
