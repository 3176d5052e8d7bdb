"""Triton kernels of ``cula.ops.device_tables`` (imported by it only when a table is made on a CUDA device, so that
``import cula`` does not import Triton).

Both walk the sequences in blocks (each block's inclusive prefix sum plus the carry of the blocks before), storing
the running ends, then map every output row to its sequence by a binary search over those ends
(``searchsorted(ends, row, right=True)``, clamped to the last sequence). The segment tables (a few hundred rows at
most) do both in one program, the second after a CTA barrier (global stores made before it are seen after it by the
whole CTA); the chunk list (up to ``T / 64`` rows) searches in a grid of programs, after a one-program launch of the
ends. Values are not checked, as in the torch forms: boundaries that are not non-decreasing give meaningless rows.

Every integer argument is left unspecialized and no pointer is specialized on its alignment, so one compiled
variant per boundary dtype serves every call (``with_halves`` too is a run-time integer): ``device_tables.preload``
compiles and loads them all before any capture needs them (a launch that compiles inside a capture loads a module
there, which invalidates it).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["chunk_rows", "combine_tables", "segment_tables"]

_BLOCK = 1024  # sequences / rows a step of the program
_WARPS = 8


_INTS = ["N", "num_rows", "steps", "seg", "min_len", "M", "width", "with_halves"]


def _jit(fn):
    """``triton.jit`` with the integer arguments unspecialized and no pointer specialized on its alignment (one
    variant a dtype, see the module docstring)."""
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    ints = [n for n in names if n in _INTS]
    ptrs = [n for n in names if n not in _INTS and n.upper() != n]
    return triton.jit(do_not_specialize=ints, do_not_specialize_on_alignment=ptrs)(fn)


@triton.jit
def _cut_pieces(lens, seg, min_len):
    """The time split's rule: a sequence longer than ``seg`` and at least ``min_len`` long is cut into pieces of
    ``seg``; any other is one piece."""
    return tl.where((lens > seg) & (lens >= min_len), (lens + seg - 1) // seg, 1)


@triton.jit
def _ends_pass(cu, ends, N, width, seg, min_len, BLOCK: tl.constexpr, CUT: tl.constexpr):
    """``ends[n]`` = the pieces of sequences 0..n (each ``ceil(len / width)`` chunks, or, with CUT, pieces of
    ``seg`` where ``len > seg`` and ``len >= min_len``, else one)."""
    carry = tl.zeros((), dtype=tl.int64)
    for start in range(0, N, BLOCK):
        n = start + tl.arange(0, BLOCK)
        live = n < N
        a = tl.load(cu + n, mask=live, other=0).to(tl.int64)
        b = tl.load(cu + n + 1, mask=live, other=0).to(tl.int64)
        lens = b - a
        if CUT:
            pieces = _cut_pieces(lens, seg, min_len)
        else:
            pieces = (lens + width - 1) // width
        pieces = tl.where(live, pieces, 0)
        run = tl.cumsum(pieces, 0) + carry
        tl.store(ends + n, run, mask=live)
        carry += tl.sum(pieces, 0)


@triton.jit
def _sequence_of(ends, rows, N, steps):
    """``searchsorted(ends[:N], rows, right=True)`` clamped to ``N - 1``: the first sequence whose end is past the
    row."""
    lo = tl.zeros(rows.shape, dtype=tl.int64)
    hi = tl.zeros(rows.shape, dtype=tl.int64) + N
    for _ in range(steps):
        mid = (lo + hi) // 2
        e = tl.load(ends + mid, mask=mid < N, other=0)
        right = (mid < hi) & (e <= rows)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right | (mid >= hi), hi, mid)
    return tl.minimum(lo, N - 1)


@_jit
def _chunk_ends_kernel(cu, ends, N, width, BLOCK: tl.constexpr):
    _ends_pass(cu, ends, N, width, 0, 0, BLOCK, False)


@_jit
def _chunk_rows_kernel(cu, ends, out, N, num_rows, steps, width, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = r < num_rows
    seq = _sequence_of(ends, r, N, steps)
    a = tl.load(cu + seq, mask=live, other=0).to(tl.int64)
    b = tl.load(cu + seq + 1, mask=live, other=0).to(tl.int64)
    before = tl.load(ends + seq, mask=live, other=0) - (b - a + width - 1) // width
    tl.store(out + 2 * r, seq.to(tl.int32), mask=live)
    tl.store(out + 2 * r + 1, (r - before).to(tl.int32), mask=live)


@triton.jit
def _segment_start(cu, ends, m, seq, live, seg, min_len):
    """Segment row ``m``'s first token: its sequence's pieces start ``seg`` apart from the sequence's start; the
    spare rows (past the last sequence's pieces) start at its end."""
    a = tl.load(cu + seq, mask=live, other=0).to(tl.int64)
    lens = tl.load(cu + seq + 1, mask=live, other=0).to(tl.int64) - a
    pieces = _cut_pieces(lens, seg, min_len)
    piece = m - (tl.load(ends + seq, mask=live, other=0) - pieces)
    return a + tl.where(piece < pieces, piece * seg, lens)


@_jit
def _segment_tables_kernel(cu, ends, bounds, first, halves, N, M, seg, min_len, steps, with_halves,
                           ALIGN: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    _ends_pass(cu, ends, N, 0, seg, min_len, BLOCK, True)
    tl.debug_barrier()
    for start in range(0, N + 1, BLOCK):  # first = [0, ends...]
        n = start + tl.arange(0, BLOCK)
        prev = tl.load(ends + n - 1, mask=(n > 0) & (n <= N), other=0)
        tl.store(first + n, prev.to(tl.int32), mask=n <= N)
    total = tl.load(cu + N).to(tl.int64)
    for start in range(0, M, BLOCK):
        m = start + tl.arange(0, BLOCK).to(tl.int64)
        live = m < M
        seq = _sequence_of(ends, m, N, steps)
        begin = _segment_start(cu, ends, m, seq, live, seg, min_len)
        tl.store(bounds + m, begin.to(tl.int32), mask=live)
        if with_halves != 0:  # each segment's first ceil(len / ALIGN) // 2 chunks, then the rest
            # (the segment's end: the next one's start, or the call's end for the last)
            nxt = m + 1
            end = _segment_start(cu, ends, nxt, _sequence_of(ends, nxt, N, steps), live, seg, min_len)
            end = tl.where(nxt < M, end, total)
            mid = begin + (end - begin + ALIGN - 1) // ALIGN // 2 * ALIGN
            tl.store(halves + 2 * m, begin.to(tl.int32), mask=live)
            tl.store(halves + 2 * m + 1, mid.to(tl.int32), mask=live)
    tl.store(bounds + M, total.to(tl.int32))
    if with_halves != 0:
        tl.store(halves + 2 * M, total.to(tl.int32))


@_jit
def _combine_tables_kernel(bounds, first, clamped, last, N, M, BLOCK: tl.constexpr):
    """Lightning's captured cut (``cula.lightning.time_parallel._captured_forward``) from the segment tables: the
    first pass's bounds, clamped at the end of the last segment that feeds a start (one of a sequence, not its
    last), and every sequence's last segment."""
    end = tl.zeros((), dtype=tl.int64)
    for start in range(0, N, BLOCK):  # a sequence's feeding segments (all but its last) end where its last starts
        n = start + tl.arange(0, BLOCK)
        own_last = tl.load(first + n + 1, mask=n < N, other=1).to(tl.int64) - 1
        tl.store(last + n, own_last, mask=n < N)
        feeds = (n < N) & (own_last > tl.load(first + n, mask=n < N, other=0).to(tl.int64))
        stop = tl.load(bounds + own_last, mask=feeds, other=0).to(tl.int64)
        end = tl.maximum(end, tl.max(tl.where(feeds, stop, 0), 0))
    for start in range(0, M + 1, BLOCK):
        m = start + tl.arange(0, BLOCK)
        b = tl.load(bounds + m, mask=m <= M, other=0).to(tl.int64)
        tl.store(clamped + m, tl.minimum(b, end).to(tl.int32), mask=m <= M)


def _search_steps(n: int) -> int:
    """Binary search steps over ``n`` ends: enough to narrow ``[0, n]`` to one point."""
    return max(1, n.bit_length())


def _on(device: torch.device):
    """Triton launches on the current device's current stream: make it ``device``'s (CPU tensors: the interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def chunk_rows(cu_seqlens: torch.Tensor, num_rows: int, chunk_size: int = 64) -> torch.Tensor:
    """``cula.kda.forward.device_chunk_indices`` in two launches: ``[num_rows, 2]`` int32 (sequence, chunk within
    it), the rows past the real chunks naming the last sequence with chunk numbers from its chunk count on."""
    N, dev = cu_seqlens.numel() - 1, cu_seqlens.device
    out = torch.empty(num_rows, 2, dtype=torch.int32, device=dev)
    if num_rows == 0:
        return out
    ends = torch.empty(max(N, 1), dtype=torch.int64, device=dev)
    with _on(dev):
        _chunk_ends_kernel[(1,)](cu_seqlens, ends, N, chunk_size, BLOCK=_BLOCK, num_warps=_WARPS)
        _chunk_rows_kernel[(triton.cdiv(num_rows, _BLOCK),)](
            cu_seqlens, ends, out, N, num_rows, _search_steps(N), chunk_size, BLOCK=_BLOCK, num_warps=_WARPS
        )  # fmt: skip
    return out


def segment_tables(cu_seqlens: torch.Tensor, segment_len: int, min_seq_len: int, num_segments: int, halves: bool,
                   align: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``cula.time_split.device_segment_tables``' tables in one launch: ``(bounds, first, halves)``, int32
    ``[M + 1]``, int32 ``[N + 1]``, int32 ``[2 M + 1]`` or None."""
    N, M, dev = cu_seqlens.numel() - 1, num_segments, cu_seqlens.device
    bounds = torch.empty(M + 1, dtype=torch.int32, device=dev)
    first = torch.empty(N + 1, dtype=torch.int32, device=dev)
    half = torch.empty(2 * M + 1, dtype=torch.int32, device=dev) if halves else bounds
    ends = torch.empty(max(N, 1), dtype=torch.int64, device=dev)
    with _on(dev):
        _segment_tables_kernel[(1,)](
            cu_seqlens, ends, bounds, first, half, N, M, segment_len, min_seq_len, _search_steps(N),
            int(halves), ALIGN=align, BLOCK=_BLOCK, num_warps=_WARPS,
        )  # fmt: skip
    return bounds, first, half if halves else None


def combine_tables(bounds: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lightning's captured cut from device segment tables in one launch: ``(clamped bounds, last segments)``, int32
    ``[M + 1]`` and int64 ``[N]`` (``_combine_tables_kernel``)."""
    M, N, dev = bounds.numel() - 1, first.numel() - 1, bounds.device
    clamped = torch.empty(M + 1, dtype=torch.int32, device=dev)
    last = torch.empty(N, dtype=torch.int64, device=dev)
    with _on(dev):
        _combine_tables_kernel[(1,)](bounds, first, clamped, last, N, M, BLOCK=_BLOCK, num_warps=_WARPS)
    return clamped, last
