"""Exact time-parallel prefill for a constant per-head decay (Lightning, ``chunk_simple_gla(g_gamma=...)``).

The chunk kernel parallelises over sequences, heads and V tiles only, so one long sequence with few heads runs
on a handful of SMs. With a scalar decay ``gamma = exp(g_gamma)`` per head the state transition over ``n``
tokens is the scalar ``gamma^n``, so a sequence can be cut into segments whose recurrences all run at once:

    E_j      = the end state of segment j from a zero start (the kernel's states-only pass: k and v read)
    S_i      = h0 for a sequence's first segment, else gamma^(b_{i-1} - a_{i-1}) S_{i-1} + E_{i-1}
    o, S_end = the kernel's full pass over every segment from its true start S_i

(segment i is tokens a_i .. b_i - 1 of its sequence, whose initial state is h0)

so the bytes are a full pass and half of one (k and v again), and the final state is the last segment's end.
The starts are a scan along each sequence, element by element of the state: one small kernel
(``cula.ops.lightning.sm90.segment_chain``) reads each E once and writes each start once. Each factor is
``gamma^L`` of one segment's own length L, formed as an exponential of ``g_gamma L`` (a strong decay underflows
to 0, never to ``inf * 0``); nothing is truncated, so gates near 0 (no decay) are exact too.

Everything about the cut (segment boundaries, which end states feed which start) is decided on the host from
shapes or ``cu_seqlens_cpu``; the device tensors holding it are cached per layout, so a call after the first
one needs no host-to-device copy and can be captured in a CUDA graph. A packed call captured in a graph replays on
whatever boundaries its ``cu_seqlens`` then holds: its segments are made on the device from them
(``cula.time_split.device_segment_tables``, the capture's rule), and the scan reads those tables, at every replay.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from cula.backends import capturing
from cula.ops import device_tables
from cula.ops.lightning.sm90.chunk_fwd import kernel_decay
from cula.time_split import (  # noqa: F401  (the split's planning, shared with KDA; re-exported for callers)
    SEGMENT_ALIGN, SplitPlan, SplitThresholds, on_device, plan_time_split, segment_tables, split_plan,
)


class _Combine(NamedTuple):
    """What the combine needs of a plan beyond its segment tables (host ints, per plan): ``first`` ``[N + 1]``,
    sequence n's segments ``first[n] .. first[n + 1] - 1``; ``last`` ``[N]`` each sequence's last segment;
    ``feeding_bounds`` ``[M + 1]``, the first pass's: the plan's up to the end of the last segment whose end state
    feeds a start, every later segment empty (a sequence's last segment and an uncut sequence feed none)."""

    first: tuple[int, ...]
    last: tuple[int, ...]
    feeding_bounds: tuple[int, ...]


@functools.lru_cache(maxsize=64)
def _combine_layout(plan: SplitPlan) -> _Combine:
    N = len(plan.lengths)
    last = tuple(plan.segments_of(s)[-1] for s in range(N))
    feeding = [j for s in range(N) if plan.split[s] for j in plan.segments_of(s)[:-1]]
    end = plan.bounds[max(feeding) + 1] if feeding else 0
    return _Combine((*plan.first_segment, plan.num_segments), last, tuple(min(b, end) for b in plan.bounds))


def _scan_starts(E: torch.Tensor, h0: torch.Tensor | None, decay: torch.Tensor, bounds: tuple[int, ...],
                 first: tuple[int, ...]) -> torch.Tensor:  # fmt: skip
    """Every segment's true start ``[M, HV, K, V]`` from the zero-start ends ``E`` and the initial states, in torch
    ops over host tables: the scan kernel's rule (``cula.ops.lightning.sm90.segment_chain``), for the CPU and the
    float64 reference's states. ``decay`` ``[HV]`` (``-g_gamma``); in E's dtype, at least fp32; segments past
    ``first[N]`` (a captured call's spare ones) start from zeros."""
    cd = torch.promote_types(E.dtype, torch.float32)
    starts = torch.zeros(E.shape, dtype=cd, device=E.device)
    rate = decay.to(device=E.device, dtype=cd)[:, None, None]
    for n in range(len(first) - 1):
        S = torch.zeros(E.shape[1:], dtype=cd, device=E.device) if h0 is None else h0[n].to(cd)
        for m in range(first[n], first[n + 1]):
            starts[m] = S
            if m + 1 < first[n + 1]:  # (a sequence's last segment feeds nothing: its E is not read)
                S = torch.exp(-rate * (bounds[m + 1] - bounds[m])) * S + E[m]
    return starts


def _starts(E: torch.Tensor, h0: torch.Tensor | None, decay: torch.Tensor, bounds: torch.Tensor, first: torch.Tensor,
            spare: bool = False) -> torch.Tensor:  # fmt: skip
    """Every segment's true start from the segment tables on the device (``first`` ``[N + 1]``): the scan kernel
    (``cula.ops.lightning.sm90.segment_chain``) where it takes E (fp32 on a CUDA device, D 64 or 128), elsewhere
    its torch rule ``_scan_starts`` over the tables read to the host (the CPU, the float64 reference's states:
    nothing to wait on there). ``spare``: the tables may end in segments of no sequence (a captured call's), which
    the scan leaves alone; their starts are zeros, which the output pass reads and carries to ends nothing gathers."""
    if not (E.is_cuda and E.dtype == torch.float32 and E.shape[-1] in (64, 128)):
        return _scan_starts(E, h0, decay, bounds.tolist(), first.tolist()).to(E.dtype)
    from cula.ops.lightning.sm90.segment_chain import lightning_segment_chain_sm90

    starts = torch.zeros_like(E) if spare else torch.empty_like(E)
    lightning_segment_chain_sm90(E, None if h0 is None else h0.float().contiguous(), starts, bounds, first, decay)
    return starts


def _device_feed_bounds(bounds: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first pass's bounds for device segment tables, clamped where the last segment that feeds a start (one of
    a sequence, not its last) ends, and every sequence's last segment (int64)."""
    last = first[1:].long() - 1
    feeding = torch.arange(bounds.numel() - 1, device=bounds.device) < first[-1]
    feeding.index_fill_(0, last, False)  # (not an index_put of a host scalar: a copy, which capture refuses)
    return bounds.clamp(max=torch.where(feeding, bounds[1:], 0).max()), last


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
    first = on_device(layout.first, torch.int32, dev)
    starts = _starts(E, initial_state, kernel_decay(g_gamma, HV, dev), bounds, first)
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
    segment tables are the plan's, and between the kernel's two passes runs the combine's scan kernel alone
    (``cula.ops.lightning.sm90.segment_chain``: one launch, the decay of each call read on the device).

    ``states_pass(k, v, decay, ends, bounds)`` writes the segments' end states from a zero start (the kernel's
    states-only form; ``bounds`` may end before the last token) and ``output_pass(q, k, v, o, decay, starts, ends,
    bounds)`` the outputs from the true starts and, when ``ends`` is not None, the segments' ends; q / k / v / o
    flat ``[1, B T, heads, D]``, decay fp32 ``[HV]`` (``-g_gamma``), states fp32 ``[M, HV, D, D]``. Returns
    ``launch(q, k, v, decay, initial_state) -> (o, final_state)`` (``initial_state`` fp32 and dense, or None)."""
    from cula.ops.lightning.sm90 import segment_chain

    layout = _combine_layout(plan)
    M, N = plan.num_segments, len(plan.lengths)
    bounds = on_device(plan.bounds, torch.int32, dev)
    feeding = on_device(layout.feeding_bounds, torch.int32, dev)
    first = on_device(layout.first, torch.int32, dev)
    last = on_device(layout.last, torch.long, dev)
    chains: dict[bool, Callable[..., None]] = {}  # per whether there are initial states, found on first use

    def launch(q, k, v, decay, initial_state):
        B, T = v.shape[:2]
        qf, kf, vf = (x.view(1, B * T, *x.shape[2:]) for x in (q, k, v))
        E = torch.empty(M, HV, D, D, dtype=torch.float32, device=dev)
        states_pass(kf, vf, decay, E, feeding)
        starts = torch.empty_like(E)
        flat = (E.view(M, HV, D * D), None if initial_state is None else initial_state.view(N, HV, D * D))
        has_h0 = initial_state is not None
        chain = chains.get(has_h0) or chains.setdefault(has_h0, segment_chain.compiled_variant(D, has_h0))
        chain(*flat, starts.view(M, HV, D * D), bounds, first, decay, N)
        o = torch.empty_like(v)
        ends = torch.empty_like(E) if output_final_state else None
        output_pass(qf, kf, vf, o.view(vf.shape), decay, starts, ends, bounds)
        return o, None if ends is None else ends.index_select(0, last)

    return launch


def _captured_forward(chunk_fn, plan, q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first,
                      cu_seqlens):  # fmt: skip
    """``time_parallel_forward`` of a packed call while a CUDA graph captures: the segments, the first pass's
    feeding bounds and the combine's tables made on the device from ``cu_seqlens`` at every replay."""
    tables = segment_tables(plan, q.shape[1], cu_seqlens, q.device)
    bounds, first = tables.bounds, tables.first
    if device_tables.usable(q.device):  # the first pass's bounds and the last segments in one launch
        feed_bounds, last = device_tables.combine_tables(bounds, first)
    else:
        feed_bounds, last = _device_feed_bounds(bounds, first)
    _, E = chunk_fn(None, k, v, g_gamma, scale, None, True, state_v_first, feed_bounds)
    starts = _starts(E, initial_state, kernel_decay(g_gamma, v.shape[2], q.device), bounds, first, tables.spare)
    o, ends = chunk_fn(q, k, v, g_gamma, scale, starts, output_final_state, state_v_first, bounds)
    return o.view(v.shape), ends.index_select(0, last) if output_final_state else None
