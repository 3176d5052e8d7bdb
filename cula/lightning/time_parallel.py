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
one needs no host-to-device copy and can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from cula.time_split import (  # noqa: F401  (the split's planning, shared with KDA; re-exported for callers)
    SEGMENT_ALIGN, SplitPlan, SplitThresholds, on_device, plan_time_split, split_plan,
)


@functools.lru_cache(maxsize=64)
def _start_weights_layout(plan: SplitPlan, with_h0: bool) -> tuple[tuple[int, ...], ...]:
    """``[segments, segments (+ sequences with h0)]`` distances in tokens from each column's point (a
    segment's end, or a sequence's start for its initial state) to each segment's start, -1 where the column
    does not feed it."""
    seq_of = [s for s in range(len(plan.lengths)) for _ in plan.segments_of(s)]
    start_of = [plan.bounds[plan.first_segment[s]] for s in range(len(plan.lengths))]
    M = plan.num_segments
    rows = []
    for i in range(M):
        a = plan.bounds[i]
        row = [a - plan.bounds[j + 1] if seq_of[j] == seq_of[i] and j < i else -1 for j in range(M)]
        if with_h0:
            row += [a - start_of[s] if s == seq_of[i] else -1 for s in range(len(plan.lengths))]
        rows.append(tuple(row))
    return tuple(rows)


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
            states-only variant).
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
    bounds = on_device(plan.bounds, torch.int32, dev)
    qf, kf, vf = q.reshape(1, B * T, H, K), k.reshape(1, B * T, H, K), v.reshape(1, B * T, HV, V)
    # 1. every segment's end state from a zero start
    _, E = chunk_fn(None, kf, vf, g_gamma, scale, None, True, state_v_first, bounds)
    # 2. every segment's true start: its sequence's initial state and the earlier segments' ends, decayed
    cd = torch.promote_types(E.dtype, torch.float32)
    cols = E.to(cd)
    if initial_state is not None:
        cols = torch.cat([cols, initial_state.to(cd)])
    dist = on_device(_start_weights_layout(plan, initial_state is not None), cd, dev)  # [M, C]
    g = (torch.zeros(HV, device=dev) if g_gamma is None else g_gamma).to(cd)
    # exp(g * d) in (0, 1] for d >= 0; columns that do not feed a row (d = -1) weigh 0
    w = torch.where(dist >= 0, torch.exp(g[:, None, None] * dist.clamp_min(0)), 0.0)  # [HV, M, C]
    starts = torch.einsum("hrc,chx->rhx", w, cols.flatten(2)).view(E.shape).to(E.dtype)
    # 3. the outputs from the true starts; each sequence's last segment ends in its final state
    o, ends = chunk_fn(qf, kf, vf, g_gamma, scale, starts, output_final_state, state_v_first, bounds)
    final = None
    if output_final_state:
        last = tuple(plan.segments_of(s)[-1] for s in range(N))
        final = ends.index_select(0, on_device(last, torch.long, dev))
    return o.view(B, T, HV, V), final
