"""Exact time-parallel prefill for a constant per-head decay (Lightning, ``chunk_simple_gla(g_gamma=...)``).

The chunk kernel parallelises over sequences, heads and V tiles only, so one long sequence with few heads runs
on a handful of SMs. With a scalar decay ``gamma = exp(g_gamma)`` per head the state transition over ``n``
tokens is the scalar ``gamma^n``, so a sequence can be cut into segments whose recurrences all run at once:

    E_j      = the end state of segment j from a zero start (the kernel's states-only pass: k and v read)
    S_i      = gamma^(a_i - s) h0 + sum_{j < i} gamma^(a_i - b_j) E_j
    o, S_end = the kernel's full pass over every segment from its true start S_i

(segment i starts at token a_i, its sequence at s with initial state h0; b_j is the end of segment j)

so the bytes are a full pass and half of one (k and v again), and the final state is the last segment's end.
The sums are one small matmul per head with weights ``exp(g_gamma * distance)`` (a distance of tokens, never a
product of factors, so neither under- nor overflow compounds); nothing is truncated, so gates near 0 (no
decay) are exact too.

Everything about the cut (segment boundaries, which end states feed which start) is decided on the host from
shapes or ``cu_seqlens_cpu``; the device tensors holding it are cached per layout, so a call after the first
one needs no host-to-device copy and can be captured in a CUDA graph. A packed call captured in a graph replays on
whatever boundaries its ``cu_seqlens`` then holds: its segments are made on the device from them
(``cula.time_split.device_segment_tables``, the capture's rule) and so is the combine's layout (``_device_weights``:
every segment a row, its distances by broadcast), at every replay.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from cula.backends import ConstantTensors, capturing
from cula.ops import device_tables
from cula.time_split import (  # noqa: F401  (the split's planning, shared with KDA; re-exported for callers)
    SEGMENT_ALIGN, SplitPlan, SplitThresholds, on_device, plan_time_split, segment_tables, split_plan,
)


class _Combine(NamedTuple):
    """Which rows the start combination touches, and the distances that weigh it (host ints, per plan).

    Rows and E columns are the segments of the cut sequences (``segs``; None when every sequence is cut: all
    segments, no gather); ``dist`` ``[R, R + Nc]`` holds, per row r, the distance in tokens from column c's end to
    r's start (-1 where c does not feed r), then from each cut sequence's start (its initial state, columns
    ``seqs``) to r's start (-1 for another sequence). ``seq_of`` ``[M]`` is every segment's sequence (an uncut
    sequence starts from its initial state as it is) and ``last`` ``[N]`` each sequence's last segment.
    ``feeding_bounds`` ``[M + 1]`` are the first pass's: the plan's up to the end of the last segment whose end
    state feeds a start, every later segment empty (a sequence's last segment and an uncut sequence feed none)."""

    segs: tuple[int, ...] | None
    seqs: tuple[int, ...] | None
    dist: tuple[tuple[int, ...], ...]
    seq_of: tuple[int, ...]
    last: tuple[int, ...]
    feeding_bounds: tuple[int, ...]


@functools.lru_cache(maxsize=64)
def _combine_layout(plan: SplitPlan) -> _Combine:
    N = len(plan.lengths)
    seq_of = tuple(s for s in range(N) for _ in plan.segments_of(s))
    cut = [s for s in range(N) if plan.split[s]]
    rows = [i for s in cut for i in plan.segments_of(s)]
    start = {s: plan.bounds[plan.first_segment[s]] for s in cut}
    dist = []
    for i in rows:
        a = plan.bounds[i]
        dist.append((*(a - plan.bounds[j + 1] if seq_of[j] == seq_of[i] and j < i else -1 for j in rows),
                     *(a - start[s] if s == seq_of[i] else -1 for s in cut)))  # fmt: skip
    every = len(cut) == N
    last = tuple(plan.segments_of(s)[-1] for s in range(N))
    feeding = [j for s in cut for j in plan.segments_of(s)[:-1]]
    end = plan.bounds[max(feeding) + 1] if feeding else 0
    feeding_bounds = tuple(min(b, end) for b in plan.bounds)
    return _Combine(
        None if every else tuple(rows), None if every else tuple(cut), tuple(dist), seq_of, last, feeding_bounds,
    )  # fmt: skip


# per (plan, dtype, device): the combine's distances (_Combine.dist) clamped at 0, and where a column feeds a row (1)
# or not (0); and its weights without a decay. A repeated call then makes its weights in three launches (with
# g_gamma, from its current values) and none without.
_TABLES = ConstantTensors()


def _distance_tables(layout: _Combine, plan: SplitPlan, dtype: torch.dtype, dev: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    def make():
        d = on_device(layout.dist, dtype, dev)
        return d.clamp_min(0), (d >= 0).to(dtype)

    return _TABLES.get(dev, ("lightning_dist", plan, dtype), make)


def _weights(layout: _Combine, plan: SplitPlan, g_gamma: torch.Tensor | None, HV: int, dtype: torch.dtype,
             dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``[HV, R, R]`` and ``[HV, R, Nc]`` weights ``exp(g_gamma * distance)``, 0 where a column does not feed
    a row: in (0, 1] for distances >= 0, so neither under- nor overflow compounds. Views of one ``[HV, R, R + Nc]``
    table."""
    dist, feeds = _distance_tables(layout, plan, dtype, dev)
    if g_gamma is None:
        w = feeds.expand(HV, *feeds.shape).contiguous()
    else:
        w = torch.mul(g_gamma.detach().to(dtype)[:, None, None], dist).exp_().mul_(feeds)
    R = len(layout.dist)
    return w[:, :, :R], w[:, :, R:]


def _per_head_mm(w: torch.Tensor, x: torch.Tensor, out: torch.Tensor, add: bool = False) -> None:
    """``out[r, h] (+)= sum_c w[h, r, c] x[c, h]`` over ``[rows, HV, K, V]`` tensors: one batched product over
    the heads, read and written in place through transposed views (no copies)."""
    HV = x.shape[1]
    xv = x.reshape(x.shape[0], HV, -1).transpose(0, 1)
    ov = out.view(out.shape[0], HV, -1).transpose(0, 1)
    if add:
        ov.baddbmm_(w, xv)
    else:
        torch.bmm(w, xv, out=ov)


class _CombineIndex(NamedTuple):
    """A combine's gathers on the device, where some sequences run whole (``_Combine.segs`` not None): the cut
    sequences' segments (rows), their sequences (``seqs``) and every segment's sequence (``seq_of``), int64."""

    rows: torch.Tensor
    seqs: torch.Tensor
    seq_of: torch.Tensor


def _combine_index(layout: _Combine, dev: torch.device) -> _CombineIndex | None:
    if layout.segs is None:
        return None
    return _CombineIndex(*(on_device(x, torch.long, dev) for x in (layout.segs, layout.seqs, layout.seq_of)))


def _start_weights(layout: _Combine, plan: SplitPlan, g_gamma: torch.Tensor | None, HV: int, dtype: torch.dtype,
                   dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``_weights``, made once per plan and dtype without a decay."""
    if g_gamma is None:
        key = ("lightning_starts", plan, HV, dtype)
        return _TABLES.get(dev, key, lambda: _weights(layout, plan, None, HV, dtype, dev))
    return _weights(layout, plan, g_gamma, HV, dtype, dev)


def _starts(layout: _Combine, E: torch.Tensor, h0: torch.Tensor | None, g_gamma: torch.Tensor | None,
            plan: SplitPlan) -> torch.Tensor:  # fmt: skip
    """Every segment's true start ``[M, HV, K, V]`` from the zero-start ends ``E`` and the initial states."""
    cd = torch.promote_types(E.dtype, torch.float32)
    we, wh = _start_weights(layout, plan, g_gamma, E.shape[1], cd, E.device)
    return _combine(we, wh, E, h0, _combine_index(layout, E.device))


def _combine(we: torch.Tensor, wh: torch.Tensor, E: torch.Tensor, h0: torch.Tensor | None,
             index: _CombineIndex | None) -> torch.Tensor:  # fmt: skip
    """``_starts`` with its weights and gathers made: in the weights' dtype."""
    E = E.to(we.dtype)
    h0 = None if h0 is None else h0.to(we.dtype)
    if index is None:  # every sequence cut: rows and columns are all segments
        starts = E.new_empty(E.shape)
        _per_head_mm(we, E, starts)
        if h0 is not None:
            _per_head_mm(wh, h0, starts, add=True)
        return starts
    # some sequences run whole: they start from their initial state; only the cut ones' rows are combined
    cols = E.index_select(0, index.rows)
    part = cols.new_empty(cols.shape)
    _per_head_mm(we, cols, part)
    if h0 is None:
        starts = E.new_zeros(E.shape)
    else:
        _per_head_mm(wh, h0.index_select(0, index.seqs), part, add=True)
        starts = h0.index_select(0, index.seq_of)
    return starts.index_copy_(0, index.rows, part)


def _device_weights(bounds: torch.Tensor, seq_of: torch.Tensor, cu_seqlens: torch.Tensor, num_heads: int,
                    dtype: torch.dtype, g_gamma: torch.Tensor | None, with_h0: bool):  # fmt: skip
    """``_start_weights`` for segment tables made on the device (a captured packed call): every segment a row, fed
    by the earlier segments of its sequence and its sequence's initial state, the distances by broadcast over the
    ``[M]`` bounds (nothing read on the host). ``(we [HV, M, M], wh [HV, M] or None)``."""
    M, HV = seq_of.numel(), num_heads
    b = bounds.long()
    a, end = b[:-1], b[1:]
    idx = torch.arange(M, device=b.device)
    feeds = (seq_of[:, None] == seq_of[None, :]) & (idx[None, :] < idx[:, None])
    dist = (a[:, None] - end[None, :]).clamp_min(0).to(dtype)
    if g_gamma is None:
        we = feeds.to(dtype).expand(HV, M, M).contiguous()
    else:
        we = torch.mul(g_gamma.detach().to(dtype)[:, None, None], dist).exp_().mul_(feeds)
    if not with_h0:
        return we, None
    # the initial state, decayed over the tokens before the segment in its sequence
    since = (a - cu_seqlens.long()[seq_of]).to(dtype)
    wh = torch.ones(HV, M, dtype=dtype, device=b.device) if g_gamma is None else torch.mul(
        g_gamma.detach().to(dtype)[:, None], since).exp_()  # fmt: skip
    return we, wh


def _device_feed_bounds(bounds: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first pass's bounds for device segment tables, clamped where the last segment that feeds a start (one of
    a sequence, not its last) ends, and every sequence's last segment (int64)."""
    last = first[1:].long() - 1
    feeding = torch.arange(bounds.numel() - 1, device=bounds.device) < first[-1]
    feeding.index_fill_(0, last, False)  # (not an index_put of a host scalar: a copy, which capture refuses)
    return bounds.clamp(max=torch.where(feeding, bounds[1:], 0).max()), last


def _device_combine(we: torch.Tensor, wh: torch.Tensor | None, seq_of: torch.Tensor, E: torch.Tensor,
                    h0: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """``_starts`` from ``_device_weights``' weights (or the table kernel's), in their dtype."""
    starts = E.new_empty(E.shape, dtype=we.dtype)
    _per_head_mm(we, E.to(we.dtype), starts)
    if h0 is not None:
        starts.add_(h0.to(we.dtype).index_select(0, seq_of) * wh.t()[:, :, None, None])
    return starts


ChunkFn = Callable[..., tuple[torch.Tensor | None, torch.Tensor | None]]


def time_parallel_forward(
    chunk_fn: ChunkFn,
    plan: SplitPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_gamma: torch.Tensor | None,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    state_v_first: bool,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunk forward of ``chunk_fn`` run over ``plan``'s segments at once, exactly (module docstring).

    Args:
        chunk_fn: ``chunk_fn(q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first,
            cu_seqlens) -> (o, final_state)`` on packed sequences (the cula kernel, or the reference in
            tests); with ``q`` None it reads no q and returns ``(None, final_state)`` (the kernel's
            states-only variant), and ``cu_seqlens`` may end before the last token (no later token is read).
        plan: from :func:`plan_time_split` / :func:`split_plan` over the call's sequence lengths (B copies of
            T without ``cu_seqlens``).
        Others: as ``chunk_simple_gla`` (q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, states fp32).

    Returns:
        ``(o [B, T, HV, V] in q.dtype, final_state or None)``, as the unsplit ``chunk_fn`` call.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = len(plan.lengths)
    expect_n = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if N != expect_n or sum(plan.lengths) != B * T:
        raise ValueError(
            f"plan for lengths {plan.lengths} does not match q {list(q.shape)} ({expect_n} sequences)"
        )
    dev = q.device
    qf, kf, vf = q.reshape(1, B * T, H, K), k.reshape(1, B * T, H, K), v.reshape(1, B * T, HV, V)
    if cu_seqlens is not None and capturing(cu_seqlens):
        return _captured_forward(chunk_fn, plan, qf, kf, vf, g_gamma, scale, initial_state, output_final_state,
                                 state_v_first, cu_seqlens)  # fmt: skip
    bounds = on_device(plan.bounds, torch.int32, dev)
    layout = _combine_layout(plan)
    # 1. the end states from a zero start of the segments that feed a later start; the rest run empty (zero ends,
    # which nothing reads), so the pass reads no k or v past the last of those
    feeding = on_device(layout.feeding_bounds, torch.int32, dev)
    _, E = chunk_fn(None, kf, vf, g_gamma, scale, None, True, state_v_first, feeding)
    # 2. every segment's true start: its sequence's initial state and the earlier segments' ends, decayed
    starts = _starts(layout, E, initial_state, g_gamma, plan).to(E.dtype)
    # 3. the outputs from the true starts; each sequence's last segment ends in its final state
    o, ends = chunk_fn(qf, kf, vf, g_gamma, scale, starts, output_final_state, state_v_first, bounds)
    final = None
    if output_final_state:
        final = ends.index_select(0, on_device(layout.last, torch.long, dev))
    return o.view(B, T, HV, V), final


def bind_time_parallel(plan: SplitPlan, HV: int, D: int, dev: torch.device, states_pass: Callable[..., None],
                       output_pass: Callable[..., None], output_final_state: bool) -> Callable[..., tuple]:
    """``time_parallel_forward`` of an inference call on the kernel, bound once for every later call of its signature
    (``chunk_simple_gla``'s plan cache; a packed one's for one boundary list, not while a CUDA graph captures): the
    segment tables, the combine's layout and its gathers are the plan's, and the host work between the kernel's two
    passes is the combine alone (its weights, from the decay of each call, are made before the first pass).

    ``states_pass(k, v, decay, ends, bounds)`` writes the segments' end states from a zero start (the kernel's
    states-only form; ``bounds`` may end before the last token) and ``output_pass(q, k, v, o, decay, starts, ends,
    bounds)`` the outputs from the true starts and, when ``ends`` is not None, the segments' ends; q / k / v / o
    flat ``[1, B T, heads, D]``, decay fp32 ``[HV]`` (``-g_gamma``), states fp32 ``[M, HV, D, D]``. Returns
    ``launch(q, k, v, decay, g_gamma, initial_state) -> (o, final_state)``, ``g_gamma`` None for no decay."""
    layout = _combine_layout(plan)
    M = plan.num_segments
    bounds = on_device(plan.bounds, torch.int32, dev)
    feeding = on_device(layout.feeding_bounds, torch.int32, dev)
    last = on_device(layout.last, torch.long, dev)
    index = _combine_index(layout, dev)

    def launch(q, k, v, decay, g_gamma, initial_state):
        B, T = v.shape[:2]
        qf, kf, vf = (x.view(1, B * T, *x.shape[2:]) for x in (q, k, v))
        we, wh = _start_weights(layout, plan, g_gamma, HV, torch.float32, dev)
        E = torch.empty(M, HV, D, D, dtype=torch.float32, device=dev)
        states_pass(kf, vf, decay, E, feeding)
        starts = _combine(we, wh, E, initial_state, index)
        o = torch.empty_like(v)
        ends = torch.empty_like(E) if output_final_state else None
        output_pass(qf, kf, vf, o.view(vf.shape), decay, starts, ends, bounds)
        return o, None if ends is None else ends.index_select(0, last)

    return launch


def _captured_forward(chunk_fn, plan, q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first,
                      cu_seqlens):  # fmt: skip
    """``time_parallel_forward`` of a packed call while a CUDA graph captures: the segments, the first pass's
    feeding bounds and the combine made on the device from ``cu_seqlens`` at every replay."""
    tables = segment_tables(plan, q.shape[1], cu_seqlens, q.device)
    bounds, first, seq_of, HV = tables.bounds, tables.first, tables.sequence, v.shape[2]
    with_h0 = initial_state is not None
    if device_tables.usable(q.device):  # the first pass's bounds, last segments and weights in one launch
        feed_bounds, last, we, wh = device_tables.combine_tables(bounds, first, seq_of, cu_seqlens, g_gamma, HV,
                                                                 with_h0)  # fmt: skip
    else:
        feed_bounds, last = _device_feed_bounds(bounds, first)
        we = None
    _, E = chunk_fn(None, k, v, g_gamma, scale, None, True, state_v_first, feed_bounds)
    if we is None:
        cd = torch.promote_types(E.dtype, torch.float32)
        we, wh = _device_weights(bounds, seq_of, cu_seqlens, HV, cd, g_gamma, with_h0)
    starts = _device_combine(we, wh, seq_of, E, initial_state).to(E.dtype)
    o, ends = chunk_fn(q, k, v, g_gamma, scale, starts, output_final_state, state_v_first, bounds)
    return o.view(v.shape), ends.index_select(0, last) if output_final_state else None
