"""Calls past what one launch of cula's kernels can address are declined (with the reason) before anything runs:
more sequences than CUDA's grid y / z holds, decode activations past 32-bit offsets, a time split into more
segments than the grid holds; and a packed call captured in a CUDA graph is never cut. CPU only: the verdicts read
shapes (meta tensors)."""

from __future__ import annotations

import torch

from cula.ops._host import GRID_YZ_MAX, int32_offsets_verdict, sequences_verdict


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_sequences_past_the_grid_are_declined_by_every_chunk_backend():
    from cula.gated_delta_rule.backends import _cula_chunk_supports as gdn_supports
    from cula.kda.backends import _cula_chunk_supports as kda_supports
    from cula.simple_gla.backends import _cula_chunk_supports as gla_supports

    assert sequences_verdict(GRID_YZ_MAX, None) == (True, None)
    for n in (GRID_YZ_MAX, GRID_YZ_MAX + 1):
        q, v = _meta(1, 2 * n, 1, 128), _meta(1, 2 * n, 1, 128)
        g, beta = _meta(1, 2 * n, 1, 128, dtype=torch.float32), _meta(1, 2 * n, 1, dtype=torch.float32)
        cu = _meta(n + 1, dtype=torch.int32)
        verdicts = (
            kda_supports(q, q, v, g, beta, None, None, None, 64, cu_seqlens=cu),
            # (a training call: GDN's inference takes cula's kernels only where the GPU's tuning entry says so)
            gdn_supports(q.requires_grad_(), q, v, g[..., 0], beta, cu_seqlens=cu),
            gla_supports(q, q, v, None, _meta(1, dtype=torch.float32), None, cu_seqlens=cu),
        )
        for ok, why in verdicts:
            if n > GRID_YZ_MAX:
                assert not ok and f"{n} sequences" in why and str(GRID_YZ_MAX) in why
            else:
                assert ok or "sequences" not in (why or "")
    # a fixed-length batch puts B where a pack puts its sequences
    q = _meta(GRID_YZ_MAX + 1, 64, 1, 128)
    ok, why = kda_supports(q, q, q, _meta(*q.shape, dtype=torch.float32), _meta(*q.shape[:3]), None, None, None, 64)
    assert not ok and "sequences" in why


def test_decode_activations_past_int32_offsets_are_declined():
    from cula.kda.decode import _cula_supports as kda_supports
    from cula.lightning.decode import _cula_supports as lightning_supports

    assert int32_offsets_verdict((2**31 - 1,), (4, 8)) == (True, None)
    ok, why = int32_offsets_verdict((1, 2), (2**16, 1, 64, 512))
    assert not ok and "32-bit" in why
    N, HV = 2**31 // (64 * 128), 64  # N T HV V = 2^31 at T = 1
    q, v = _meta(N, 1, HV, 128), _meta(N, 1, HV, 128)
    pool = _meta(8, HV, 128, 128, dtype=torch.float32)
    for ok, why in (kda_supports(q, q, v, _meta(N, 1, HV, 128), pool, True), lightning_supports(q, v, pool, True)):
        assert not ok and "32-bit" in why
    q, v = _meta(N - 1, 1, HV, 128), _meta(N - 1, 1, HV, 128)
    assert kda_supports(q, q, v, _meta(N - 1, 1, HV, 128), pool, True)[0]
    assert lightning_supports(q, v, pool, True)[0]


def test_a_time_split_past_the_grid_runs_whole(monkeypatch):
    from cula import time_split

    class Plan:
        def __init__(self, m):
            self.num_segments = m

    thresholds = object()
    monkeypatch.setattr(time_split, "sm_count", lambda index: 132)
    for m, cut in ((GRID_YZ_MAX // 2, True), (GRID_YZ_MAX // 2 + 1, False)):
        monkeypatch.setattr(time_split, "plan_time_split", lambda *a, _m=m: Plan(_m))
        plan = time_split.plan_call(thresholds, 1, 1 << 20, 4, None, None, torch.device("cpu"))
        assert (plan is not None) == cut, m


def test_a_packed_call_captured_in_a_graph_is_cut_for_any_boundaries(monkeypatch):
    """A captured packed call replays on whatever boundaries its buffer then holds, cut by the capture's rule on the
    device (``segment_tables``): the grid must hold the segments any boundaries of the call's shapes can need
    (``replay_segments``), not only the capture's."""
    import types

    from cula import time_split

    cut = types.SimpleNamespace(num_segments=16, segment_len=1 << 16, lengths=(1 << 20,))
    monkeypatch.setattr(time_split, "sm_count", lambda index: 132)
    monkeypatch.setattr(time_split, "plan_time_split", lambda *a: cut)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    cu = types.SimpleNamespace(is_cuda=True, device=torch.device("cpu"))  # (a CPU device: nothing to preload)
    cu_cpu = torch.tensor([0, 1 << 20], dtype=torch.int32)
    assert time_split.plan_call(object(), 1, 1 << 20, 4, cu, cu_cpu, torch.device("cpu")) is cut
    assert time_split.plan_call(object(), 1, 1 << 20, 4, None, None, torch.device("cpu")) is cut
    # 17 segments for the capture's one sequence, but 1 + GRID_YZ_MAX // 2 for any of its boundaries
    T = 64 * (GRID_YZ_MAX // 2)
    many = types.SimpleNamespace(num_segments=17, segment_len=64, lengths=(T,))
    monkeypatch.setattr(time_split, "plan_time_split", lambda *a: many)
    cu_cpu = torch.tensor([0, T], dtype=torch.int32)
    assert time_split.plan_call(object(), 1, T, 4, cu, cu_cpu, torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert time_split.plan_call(object(), 1, T, 4, cu, cu_cpu, torch.device("cpu")) is many
