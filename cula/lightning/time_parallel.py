"""Exact time-parallel prefill for a constant per-head decay (Lightning, ``chunk_simple_gla(g_gamma=...)``).

The chunk kernel parallelises over sequences, heads and V tiles only, so one long sequence with few heads runs on a
handful of SMs. With a scalar decay ``gamma = exp(g_gamma)`` per head the state transition over ``n`` tokens is the
scalar ``gamma^n``, so a sequence can be cut into segments that all run at once from a zero start:

    o_t      = o_loc_t + scale * gamma^(t - a_i + 1) * S_i^T q_t        (t in segment i, which starts at a_i)
    S_i      = sum_{j < i} gamma^(a_i - b_j) * E_j                       (b_j: end of segment j, E_j its local end state)
    final    = sum_j gamma^(len - b_j) * E_j

The first segment of a sequence starts from the caller's initial state, so its ``E`` already carries it. The sums
are one small matmul per head with weights ``exp(g_gamma * distance)`` (a distance of tokens, never a product of
factors, so neither under- nor overflow compounds); nothing is truncated, so gates near 0 (no decay) are exact too.

Everything about the cut (segment boundaries, which segment feeds which sum) is decided on the host from shapes or
``cu_seqlens_cpu``; the device tensors holding it are cached per layout, so a call after the first one needs no
host-to-device copy and can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from cula.time_split import (  # noqa: F401  (the split's planning, shared with KDA; re-exported for callers)
    SEGMENT_ALIGN, SplitPlan, SplitThresholds, on_device, plan_time_split, split_plan,
)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Host-side bookkeeping of the combine: which local end states feed which start / final states."""

    cols: tuple[int, ...]  # segments of cut sequences, whose end states enter the sums
    rows_per_seq: tuple[int, ...]  # per cut sequence: its non-first segments' starts, then (optionally) its final
    dist: tuple[tuple[int, ...], ...]  # [rows, cols] tokens from a column's end to a row's point; -1: no term
    last_segment: tuple[int, ...]  # per sequence


@functools.lru_cache(maxsize=64)
def _layout(plan: SplitPlan, with_final: bool) -> _Layout:
    cols, rows_per_seq, row_specs = [], [], []  # row_specs: (seq, point as a packed offset)
    for s, cut in enumerate(plan.split):
        if not cut:
            continue
        segs = plan.segments_of(s)
        cols += segs
        points = [plan.bounds[i] for i in segs[1:]] + ([plan.bounds[segs[-1] + 1]] if with_final else [])
        rows_per_seq.append(len(points))
        row_specs += [(s, p) for p in points]
    seq_of = {i: s for s in range(len(plan.lengths)) for i in plan.segments_of(s)}
    dist = tuple(
        tuple(p - plan.bounds[j + 1] if seq_of[j] == s and plan.bounds[j + 1] <= p else -1 for j in cols)
        for s, p in row_specs
    )
    last = tuple(plan.segments_of(s)[-1] for s in range(len(plan.lengths)))
    return _Layout(tuple(cols), tuple(rows_per_seq), dist, last)


ChunkFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


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
    """The chunk forward of ``chunk_fn`` run over ``plan``'s segments at once, then carried across them exactly.

    Args:
        chunk_fn: ``chunk_fn(q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first,
            cu_seqlens) -> (o, final_state)`` on packed sequences (the cula kernel, or the reference in tests).
        plan: from :func:`plan_time_split` / :func:`split_plan` over the call's sequence lengths (B copies of T
            without ``cu_seqlens``).
        Others: as ``chunk_simple_gla`` (q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, states fp32).

    Returns:
        ``(o [B, T, HV, V] in q.dtype, final_state or None)``, as the unsplit ``chunk_fn`` call.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = len(plan.lengths)
    expect_n = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if N != expect_n or sum(plan.lengths) != B * T:
        raise ValueError(f"plan for lengths {plan.lengths} does not match q {list(q.shape)} ({expect_n} sequences)")
    dev = q.device
    bounds = on_device(plan.bounds, torch.int32, dev)
    h0 = None
    if initial_state is not None:
        h0 = initial_state.new_zeros((plan.num_segments,) + tuple(initial_state.shape[1:]))
        h0.index_copy_(0, on_device(plan.first_segment, torch.long, dev), initial_state)
    o, E = chunk_fn(q.reshape(1, B * T, H, K), k.reshape(1, B * T, H, K), v.reshape(1, B * T, HV, V),
                    g_gamma, scale, h0, True, state_v_first, bounds)
    o = o.view(B, T, HV, V)

    layout = _layout(plan, bool(output_final_state))
    state_shape = E.shape[2:]
    cd = torch.promote_types(E.dtype, torch.float32)
    g = (torch.zeros(HV, device=dev) if g_gamma is None else g_gamma).to(cd)
    dist = on_device(layout.dist, cd, dev)  # [R, C]
    # exp(g * d) in (0, 1] for d >= 0; masked entries (d = -1) get weight 0
    w = torch.where(dist >= 0, torch.exp(g[:, None, None] * dist.clamp_min(0)), 0.0)  # [HV, R, C]
    Ec = E.index_select(0, on_device(layout.cols, torch.long, dev)).to(cd).flatten(2)  # [C, HV, KV]
    carried = torch.einsum("hrc,chx->rhx", w, Ec).view((-1, HV) + tuple(state_shape))  # [R, HV, ...]

    final = None
    if output_final_state:
        final = E.index_select(0, on_device(layout.last_segment, torch.long, dev))
    L = plan.segment_len
    decay_t = torch.exp(g[None, :] * torch.arange(1, L + 1, device=dev, dtype=cd)[:, None])  # [L, HV]
    fixed = cu_seqlens is None
    row = 0
    cut_seqs = [s for s, c in enumerate(plan.split) if c]
    if fixed and cut_seqs:  # every sequence is cut alike: one batched correction over the batch
        n = plan.lengths[0]
        per = layout.rows_per_seq[0]
        rows = carried.view((B, per, HV) + tuple(state_shape))
        _carry_sequence(o, q, rows, slice(None), 0, n, L, decay_t, scale, state_v_first)
        if output_final_state:
            final = rows[:, -1].to(E.dtype)
    else:
        offsets = [0]
        for n in plan.lengths:
            offsets.append(offsets[-1] + n)
        finals = []
        for s, per in zip(cut_seqs, layout.rows_per_seq):
            rows = carried[row:row + per].unsqueeze(0)
            row += per
            _carry_sequence(o, q, rows, slice(0, 1), offsets[s], plan.lengths[s], L, decay_t, scale,
                            state_v_first)
            if output_final_state:
                finals.append(rows[0, -1])
        if output_final_state and finals:
            final = final.index_copy(0, on_device(tuple(cut_seqs), torch.long, dev),
                                     torch.stack(finals).to(E.dtype))
    return o, final


def _carry_sequence(o, q, rows, batch, start, n, L, decay_t, scale, state_v_first):
    """Add the carried start states ``rows [b, *, HV, ...]`` (segments 1.. of a sequence of length ``n`` starting
    at token ``start``, for the sequences ``batch`` of o / q) to the outputs of those segments."""
    full = n // L - 1  # whole segments after the first
    tail = n - (full + 1) * L
    if full > 0:
        a, b = start + L, start + L + full * L
        _add_carry(o[batch, a:b].unflatten(1, (full, L)), q[batch, a:b].unflatten(1, (full, L)),
                   rows[:, :full], decay_t, scale, state_v_first)
    if tail > 0:
        a = start + (full + 1) * L
        _add_carry(o[batch, a:a + tail].unsqueeze(1), q[batch, a:a + tail].unsqueeze(1),
                   rows[:, full:full + 1], decay_t[:tail], scale, state_v_first)


def _add_carry(o, q, S, decay_t, scale, state_v_first):
    """``o[b, n, t] += scale * gamma^(t+1) * S[b, n]^T q[b, n, t]`` in fp32, written back in o's dtype.

    o ``[b, n, l, HV, V]``, q ``[b, n, l, H, K]`` (GVA: value head ``h`` reads q head ``h // (HV / H)``),
    S ``[b, n, HV, K, V]`` (``[.., V, K]`` when ``state_v_first``), decay_t ``[l, HV]``.
    """
    H, HV = q.shape[3], o.shape[3]
    G = HV // H
    # the decay and scale go on q (K wide per head, not V wide on the product) to save a pass over the result
    qs = (q.unsqueeze(4) * (decay_t * scale).unflatten(1, (H, G))[..., None]).to(S.dtype)  # [b, n, l, H, G, K]
    spec = "bnthgk,bnhgvk->bnthgv" if state_v_first else "bnthgk,bnhgkv->bnthgv"
    corr = torch.einsum(spec, qs, S.unflatten(2, (H, G))).flatten(3, 4)  # [b, n, l, HV, V]
    corr += o
    o.copy_(corr)
