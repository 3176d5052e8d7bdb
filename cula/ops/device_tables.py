"""The tables a captured packed call builds from its ``cu_seqlens`` on the device, in one or two Triton launches.

A packed call captured in a CUDA graph replays on whatever boundaries its ``cu_seqlens`` then holds, so the chunk
list of the intra and state kernels (``cula.kda.forward.device_chunk_indices``) and the time split's segment tables
(``cula.time_split.device_segment_tables``) are made on the device at every replay, and Lightning's cut makes its
first pass's bounds from the segment tables. Written as torch ops they are about 14, 28 and 9 small kernels, each a
graph node of a microsecond or two; here the chunk list is two launches (the sequences' chunk ends, then a grid
over the rows) and each of the others one.
The torch forms stay the rule's statement (and the CPU's path); the CPU tests hold these to them under Triton's
interpreter.

The kernels (``_device_tables_triton``) are imported on first use on a CUDA device, not with ``cula``.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["chunk_rows", "combine_tables", "preload", "segment_tables", "usable"]

_LOADED: set[int] = set()  # devices where every kernel variant has run once (compiled and its module loaded)
_UNAVAILABLE: list[str] = []  # why the kernels cannot run here (no Triton, or a compile failed): the torch forms


def usable(device: torch.device) -> bool:
    """Whether the kernels can run on ``device`` now: a CUDA device where they have run before, or where no capture
    is under way (they run once first, ``preload``). A kernel's first launch loads its module, which a capture
    refuses (the capture would be invalidated): callers then take the torch forms."""
    return preload(device)


def preload(device: torch.device) -> bool:
    """Run every kernel variant once on ``device`` (outside any capture) unless they have: the chunk list's two kernels
    the segment tables' kernel and Lightning's first-pass bounds' kernel, for int32 and int64 boundaries (the only
    specializations: integers and alignments are not specialized on). The eager calls of packed boundaries call
    this, so that a capture after them (an engine's or a training loop's warm-up, then its capture) finds every
    variant loaded. Where Triton is missing or a compile fails, the torch forms serve from then on (the reason
    logged once). Returns whether every variant is loaded on ``device`` (False too while ``torch.compile`` traces,
    and inside a capture before the first load)."""
    if device.type != "cuda" or _UNAVAILABLE or torch.compiler.is_compiling():  # (tracing: fake tensors)
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _LOADED:
        return True
    if torch.cuda.is_current_stream_capturing():
        return False
    try:
        for dtype in (torch.int32, torch.int64):
            cu = torch.tensor([0, 3, 3, 70], dtype=dtype, device=torch.device("cuda", index))
            chunk_rows(cu, 4, 64)
            bounds, first, _ = segment_tables(cu, 64, 0, 4, True, 64)
            combine_tables(bounds, first)
    except Exception as err:  # (ImportError without Triton; a compiler's or driver's error otherwise)
        _UNAVAILABLE.append(f"{type(err).__name__}: {err}")
        logging.getLogger("cula").warning(
            "cula: captured packed calls build their tables with torch ops (the Triton kernels cannot run: %s)",
            _UNAVAILABLE[0],
        )  # fmt: skip
        return False
    _LOADED.add(index)
    return True


def chunk_rows(cu_seqlens: torch.Tensor, num_rows: int, chunk_size: int = 64) -> torch.Tensor:
    """``cula.kda.forward.device_chunk_indices`` in two launches (where ``usable``)."""
    from cula.ops import _device_tables_triton as kernels

    return kernels.chunk_rows(cu_seqlens, num_rows, chunk_size)


def segment_tables(cu_seqlens: torch.Tensor, segment_len: int, min_seq_len: int, num_segments: int, halves: bool,
                   align: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``cula.time_split.device_segment_tables``' tables in one launch (where ``usable``)."""
    from cula.ops import _device_tables_triton as kernels

    return kernels.segment_tables(cu_seqlens, segment_len, min_seq_len, num_segments, halves, align)


def combine_tables(bounds: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lightning's captured cut from the device segment tables in one launch (where ``usable``): the first pass's
    clamped bounds and every sequence's last segment (``cula.lightning.time_parallel``'s ``_device_feed_bounds``)."""
    from cula.ops import _device_tables_triton as kernels

    return kernels.combine_tables(bounds, first)
