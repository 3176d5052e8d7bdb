"""Cutting long sequences into segments that run at once: the planning shared by the exact time-parallel forwards
of Lightning / ``chunk_simple_gla(g_gamma=...)`` (``cula.lightning.time_parallel``) and KDA
(``cula.kda.forward``). Plans are host ints, decided from shapes or ``cu_seqlens_cpu``; ``on_device`` caches their
device copies, so a repeated call copies nothing from the host and can be captured in a CUDA graph.

A packed call captured in a CUDA graph replays on whatever boundaries its ``cu_seqlens`` buffer then holds: its
segment tables are then made on the device from those boundaries by the capture's rule (its segment length and
``min_seq_len``; ``segment_tables``), for a segment count fixed by the shapes (``replay_segments``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import torch

from cula.backends import capturing
from cula.ops import device_tables
from cula.ops._host import GRID_YZ_MAX, sm_count

SEGMENT_ALIGN = 64  # the kernel's chunk: a segment of whole chunks adds no partial chunk but the last


@dataclasses.dataclass(frozen=True)
class SplitThresholds:
    """When and how to cut sequences, for one GPU kind.

    Attributes:
        items_per_sm: (segment, value head) work items to aim for per SM; the segment length follows from it.
        busy_items_per_sm: no split when the unsplit call already has this many (sequence, value head) items per SM,
            sequences counted by length against the longest (a pack of one long and many short ones is about one).
        min_segment: shortest segment, in tokens (a multiple of ``SEGMENT_ALIGN``): below it the combine and the
            extra reads of the carry correction cost more than the parallelism gains.
        min_seq_len: sequences shorter than this are never cut.
        wave_ctas: CTAs of the widest pass per (segment, value head), each alone on an SM; when set, the segment
            count is rounded down to whole waves of that pass (one more segment than a wave holds costs a whole
            wave). 0: no rounding.
    """

    items_per_sm: float
    busy_items_per_sm: float
    min_segment: int
    min_seq_len: int
    wave_ctas: int = 0

    def __post_init__(self):
        if self.min_segment < SEGMENT_ALIGN or self.min_segment % SEGMENT_ALIGN:
            raise ValueError(f"min_segment must be a positive multiple of {SEGMENT_ALIGN}, got {self.min_segment}")


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """How a batch of sequences is cut. All host ints; ``cula.lightning.time_parallel`` caches their device copies.

    Attributes:
        lengths: the sequences' lengths.
        segment_len: length of every segment of a cut sequence but its last (which may be shorter).
        split: per sequence, whether it is cut.
        bounds: cumulative boundaries of all segments, packed in sequence order ``[M + 1]``.
        first_segment: per sequence, the index of its first segment (where the initial state goes).
        min_seq_len: the rule's shortest cut sequence (with ``segment_len``: which sequences of other boundaries
            are cut, ``segment_tables`` under capture).
    """

    lengths: tuple[int, ...]
    segment_len: int
    split: tuple[bool, ...]
    bounds: tuple[int, ...]
    first_segment: tuple[int, ...]
    min_seq_len: int = 0

    @property
    def num_segments(self) -> int:
        return len(self.bounds) - 1

    def segments_of(self, seq: int) -> range:
        end = self.first_segment[seq + 1] if seq + 1 < len(self.lengths) else self.num_segments
        return range(self.first_segment[seq], end)


def split_plan(lengths: Sequence[int], segment_len: int, min_seq_len: int = 0) -> SplitPlan | None:
    """Cut every sequence longer than ``segment_len`` (and at least ``min_seq_len``) into ``segment_len`` pieces.

    Returns None when no sequence would be cut.
    """
    if segment_len < 1:
        raise ValueError(f"segment_len must be positive, got {segment_len}")
    lengths = tuple(int(n) for n in lengths)
    split = tuple(n > segment_len and n >= min_seq_len for n in lengths)
    if not any(split):
        return None
    bounds, first = [0], []
    for n, cut in zip(lengths, split):
        first.append(len(bounds) - 1)
        start = bounds[-1]
        if cut:
            bounds += [start + a for a in range(segment_len, n, segment_len)]
        bounds.append(start + n)
    return SplitPlan(lengths, segment_len, split, tuple(bounds), tuple(first), min_seq_len)


def half_bounds(bounds: Sequence[int]) -> tuple[int, ...]:
    """Every segment of ``bounds`` cut in two at a chunk boundary: its first ``ceil(len / SEGMENT_ALIGN) // 2``
    chunks, then the rest (a segment of at most one chunk has an empty first half). Where KDA's segment summary
    with ``mid_states`` takes the first half's E and R."""
    out = [bounds[0]]
    for a, b in zip(bounds[:-1], bounds[1:]):
        out += [a + (-(-(b - a) // SEGMENT_ALIGN) // 2) * SEGMENT_ALIGN, b]
    return tuple(out)


@functools.lru_cache(maxsize=256)
def plan_time_split(lengths: tuple[int, ...], num_value_heads: int, sm_count: int,
                    thresholds: SplitThresholds | None) -> SplitPlan | None:
    """Whether and how to cut a call's sequences (``lengths``: B copies of T, or the varlen lengths).

    Pure: the same answer for the same arguments, so a captured CUDA graph stays valid (and cached: a repeated call
    plans nothing). ``lengths`` must be hashable (a tuple). None means run unsplit.
    """
    if thresholds is None or sm_count < 1 or num_value_heads < 1:
        return None
    nonempty = [n for n in lengths if n > 0]
    if not nonempty:
        return None
    # the unsplit call's parallelism in whole-length lanes: a long sequence among short ones keeps few SMs busy for
    # most of the call, however many short ones finish early
    lanes = sum(nonempty) / max(nonempty)
    if lanes * num_value_heads >= thresholds.busy_items_per_sm * sm_count:
        return None
    # enough segments over all sequences to give every SM its share of work items, but never short ones
    target_segments = max(1, math.ceil(thresholds.items_per_sm * sm_count / num_value_heads))
    if thresholds.wave_ctas:
        per_wave = max(1, sm_count // (thresholds.wave_ctas * num_value_heads))
        target_segments = max(per_wave, target_segments // per_wave * per_wave)
    seg = math.ceil(sum(nonempty) / target_segments)
    seg = max(thresholds.min_segment, -(-seg // SEGMENT_ALIGN) * SEGMENT_ALIGN)
    return split_plan(lengths, seg, thresholds.min_seq_len)


def plan_call(thresholds: SplitThresholds | None, B: int, T: int, num_value_heads: int, cu_seqlens, cu_seqlens_cpu,
              device: torch.device) -> SplitPlan | None:
    """``plan_time_split`` for one call of an op whose GPU tuning entry has ``thresholds``: its lengths from the
    shapes or ``cu_seqlens_cpu`` only (never a read of ``cu_seqlens``: no sync, so the same call is always cut the
    same way and can be captured in a CUDA graph), the SM count of its device. None: run it whole (also a cut into
    more segments than the kernels' grid holds).

    A packed call while a CUDA graph captures replays on whatever boundaries the buffer then holds (its chunk list
    is built on the device): its capture's lengths choose the rule, which each replay applies to the boundaries it
    reads (``segment_tables``), so the grid must hold the segments any boundaries of its shapes can need."""
    if thresholds is None:
        return None
    captured = cu_seqlens is not None and capturing(cu_seqlens)
    if cu_seqlens is not None and not captured:  # (a capture of this call later makes its tables with them)
        device_tables.preload(cu_seqlens.device)
    lengths = call_lengths(B, T, cu_seqlens, cu_seqlens_cpu)
    if lengths is None:
        return None
    plan = plan_time_split(lengths, num_value_heads, sm_count(device.index or 0), thresholds)
    if plan is None:
        return None
    # the cut call's kernels put its segments (twice as many with the state kernel's halves) in grid y / z
    segments = replay_segments(plan, sum(lengths)) if captured else plan.num_segments
    return None if 2 * segments > GRID_YZ_MAX else plan


def replay_segments(plan: SplitPlan, total: int) -> int:
    """The segments of a captured cut call: at least as many as ``plan``'s rule makes of any boundaries of its
    sequence count and ``total`` tokens (each sequence ``ceil(len / segment_len)`` or one)."""
    return -(-total // plan.segment_len) + len(plan.lengths)


@dataclasses.dataclass(frozen=True)
class SegmentTables:
    """A cut's segments as the time-parallel kernels read them (int32 device tensors).

    Attributes:
        num_segments: M.
        bounds: ``[M + 1]`` token offsets of the segments in the packed call (segment m is ``[bounds[m],
            bounds[m + 1])``).
        first: ``[N + 1]`` each sequence's first segment, then M.
        halves: ``[2 M + 1]`` the bounds with every segment cut after its first half (``half_bounds``), or None.
        spare: whether segments past ``first[N]`` may be left over, empty and of no sequence (made on the device:
            no chain writes their start states, which the output pass reads all the same, so they must be zeroed).
    """

    num_segments: int
    bounds: torch.Tensor
    first: torch.Tensor
    halves: torch.Tensor | None
    spare: bool = False


def segment_tables(plan: SplitPlan, total: int, cu_seqlens: torch.Tensor | None, device: torch.device,
                   halves: bool = False) -> SegmentTables:  # fmt: skip
    """``plan``'s segment tables on ``device``: its host tables' cached copies, or, for a packed call while a CUDA
    graph captures, ``device_segment_tables`` of ``cu_seqlens`` (a replay cuts the boundaries it then holds)."""
    if cu_seqlens is not None and capturing(cu_seqlens):
        return device_segment_tables(plan, cu_seqlens, replay_segments(plan, total), halves)
    M = plan.num_segments
    return SegmentTables(
        M, on_device(plan.bounds, torch.int32, device), on_device(plan.first_segment + (M,), torch.int32, device),
        on_device(half_bounds(plan.bounds), torch.int32, device) if halves else None,
    )  # fmt: skip


def device_segment_tables(plan: SplitPlan, cu_seqlens: torch.Tensor, num_segments: int,
                          halves: bool = False) -> SegmentTables:  # fmt: skip
    """``plan``'s rule (a sequence longer than ``segment_len`` and at least ``min_seq_len`` long is cut into pieces
    of ``segment_len``, any other is one segment) applied to the boundaries ``cu_seqlens`` holds, by torch ops on
    its device: no host read, so a captured call cuts the boundaries of each replay.

    ``num_segments`` is fixed at capture (``replay_segments``); the ones the boundaries do not need are spare:
    empty segments at the end of the call, past ``first[N]``, in no sequence's chain (so no chain grows longer
    for them), whose start states the caller zeroes. As ``cula.kda.forward.device_chunk_indices``, values are not
    checked: boundaries that are not non-decreasing or end past ``num_segments``' total give meaningless segments."""
    if cu_seqlens.numel() > 1 and device_tables.usable(cu_seqlens.device):
        bounds, first, half = device_tables.segment_tables(
            cu_seqlens, plan.segment_len, plan.min_seq_len, num_segments, halves, SEGMENT_ALIGN
        )  # fmt: skip
        return SegmentTables(num_segments, bounds, first, half, spare=True)
    cu = cu_seqlens.long()
    seg, M, N = plan.segment_len, num_segments, cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    pieces = torch.where((lens > seg) & (lens >= plan.min_seq_len), (lens + seg - 1) // seg, torch.ones_like(lens))
    ends = pieces.cumsum(0)
    m = torch.arange(M, dtype=torch.int64, device=cu.device)
    seq = torch.searchsorted(ends, m, right=True).clamp_(max=N - 1)
    piece = m - (ends - pieces)[seq]
    # a sequence's pieces from its start, segment_len apart; the spare ones (past the last sequence's) at the end
    starts = cu[seq] + torch.where(piece < pieces[seq], piece * seg, lens[seq])
    bounds = torch.cat((starts, cu[-1:]))
    half = None
    if halves:  # as half_bounds: each segment's first ceil(len / 64) // 2 chunks, then the rest
        a, b = bounds[:-1], bounds[1:]
        mid = a + (b - a + SEGMENT_ALIGN - 1) // SEGMENT_ALIGN // 2 * SEGMENT_ALIGN
        half = torch.cat((torch.stack((a, mid), 1).flatten(), bounds[-1:])).to(torch.int32)
    first = torch.cat((ends.new_zeros(1), ends)).to(torch.int32)
    return SegmentTables(M, bounds.to(torch.int32), first, half, spare=True)


def call_lengths(B: int, T: int, cu_seqlens, cu_seqlens_cpu) -> tuple[int, ...] | None:
    """A call's sequence lengths from its shapes or ``cu_seqlens_cpu``; None for packed sequences without the host
    copy (reading ``cu_seqlens`` would sync with the device)."""
    if cu_seqlens is None:
        return (T,) * B
    if cu_seqlens_cpu is None:
        return None
    bounds = cu_seqlens_cpu.tolist()
    return tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))


def on_device(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a device tensor, made once per (values, dtype, device): later calls of the same layout copy
    nothing from the host.

    A CUDA-graph capture refuses pageable copies, so a layout first met while capturing is copied from pinned
    memory instead: the graph replays that copy, and both buffers live as long as the process (a graph may replay
    any time). That tensor is the capture's own: an eager call before the first replay would read it unwritten,
    so it never enters the eager cache. A cached tensor a capture uses is kept alive for good too."""
    key = (values, dtype, device)
    out = _ON_DEVICE.get(key)
    in_capture = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if out is not None:
        if in_capture:  # the graph reads it at every replay: never evicted from the cache
            _KEPT.add(key)
        return out
    if in_capture:
        host = torch.tensor(values, dtype=dtype).pin_memory()
        out = host.to(device, non_blocking=True)
        _CAPTURED.append((host, out))
        return out
    if len(_ON_DEVICE) >= _ON_DEVICE_MAX:
        oldest = next((k for k in _ON_DEVICE if k not in _KEPT), None)
        if oldest is not None:
            del _ON_DEVICE[oldest]
    out = _ON_DEVICE[key] = torch.tensor(values, dtype=dtype, device=device)
    return out


_ON_DEVICE: dict[tuple, torch.Tensor] = {}
_ON_DEVICE_MAX = 256
_KEPT: set[tuple] = set()  # layouts some captured graph reads
_CAPTURED: list[tuple[torch.Tensor, torch.Tensor]] = []  # (pinned host copy, device tensor) of captures
