"""KDA time-parallel forward, second pass on SM90: the host side (compile keys, launch).

The kernel, ``SegmentChainSm90`` (every segment's true start state and every sequence's final state from the
segment summaries, in one launch), and its description are in ``segment_chain_kernel.py``, imported (with the
CuTe DSL) only to compile a variant; see ``cula.ops._host``.
"""

from __future__ import annotations

import torch

from cula.cache import compiled_kernel
from cula.ops._host import kernel_attr, placeholder

__all__ = ["chunk_kda_segment_chain_sm90", "column_block", "compiled", "compiled_variant", "variant_key"]


def __getattr__(name):
    return kernel_attr(__name__, name)


def variant_key(has_h0=False, has_ht=False, state_v_first=False, cols=16, arch=(9, 0)) -> tuple:
    """The compile key of a variant."""
    return ("kda.segment_chain", "SegmentChainSm90", 128, has_h0, has_ht, state_v_first, cols, arch)


def compiled(key: tuple):
    """The compiled variant of ``key`` (see ``cula.cache.compiled_kernel``)."""
    _D, has_h0, has_ht, state_v_first, cols, arch = key[2:]
    return compiled_kernel(
        key, lambda: kernel_attr(__name__, "_compile")(has_h0, has_ht, state_v_first, cols, arch)
    )


def column_block(lanes: int, device: torch.device) -> int:
    """The value columns a CTA for a chain of ``lanes`` (sequence, value head) pairs: 8 where the 16 CTAs a lane
    that takes still fit one wave of the device's SMs (a step's products halved, every CTA on its own SM), else 16
    (8 CTAs a lane). The SM count as the time split's planners read it (``cula.time_split.sm_count``)."""
    from cula import time_split

    return 8 if 16 * lanes <= time_split.sm_count(device.index or 0) else 16


def compiled_variant(**options):
    """``compiled(variant_key(**options))``."""
    return compiled(variant_key(**options))


def chunk_kda_segment_chain_sm90(
    summary: torch.Tensor,
    initial_state: torch.Tensor | None,
    starts: torch.Tensor,
    final_state: torch.Tensor | None,
    first_segment: torch.Tensor,
    *,
    state_v_first: bool = False,
) -> None:
    """Every segment's start state and every sequence's final state (``segment_chain_kernel.py``).

    Args:
        summary: ``[M, 2 HV, K, V]`` fp32 (``[M, 2 HV, V, K]`` if ``state_v_first``), the segment summary's output:
            E (the end from a zero start) of head h at h, the transition R at ``HV + h``.
        initial_state: ``[N, HV, ...]`` fp32, the sequences' start states, or None for zeros.
        starts: ``[M, HV, ...]`` fp32, written: each segment's true start state.
        final_state: ``[N, HV, ...]`` fp32, written: each sequence's end state; or None.
        The three may be views with rows of whole ``[HV, ...]`` states apart (a row stride that is a multiple of
        ``HV K V``; the summary is contiguous).
        first_segment: ``[N + 1]`` int32 on the device: sequence n owns segments ``first_segment[n]`` to
            ``first_segment[n + 1] - 1`` (at least one each, as ``cula.time_split.split_plan`` makes them).
    """
    M, HV2 = summary.shape[:2]
    HV = HV2 // 2
    N = first_segment.numel() - 1
    D = 128
    if summary.dim() != 4 or tuple(summary.shape[2:]) != (D, D) or HV2 % 2:
        raise ValueError(f"summary: expected [M, 2 HV, {D}, {D}], got {tuple(summary.shape)}")
    if first_segment.dtype != torch.int32 or first_segment.dim() != 1 or N < 0:
        raise ValueError(
            f"first_segment must be a 1-D int32 tensor, got {first_segment.dtype} {first_segment.dim()}-D"
        )
    for name, t, rows in (("summary", summary, M), ("initial_state", initial_state, N), ("starts", starts, M),
                          ("final_state", final_state, N)):  # fmt: skip
        heads = HV2 if name == "summary" else HV
        laid_out = t is not None and (t.is_contiguous() if name == "summary" else _whole_rows(t))
        if t is not None and (tuple(t.shape) != (rows, heads, D, D) or t.dtype != torch.float32 or not laid_out):
            how = "contiguous" if name == "summary" else "rows of whole states"
            raise ValueError(f"{name}: expected {(rows, heads, D, D)} float32, {how}, got {tuple(t.shape)} {t.dtype}")
    if N == 0 or HV == 0:
        return
    fn = compiled_variant(has_h0=initial_state is not None, has_ht=final_state is not None,
                          state_v_first=state_v_first, cols=column_block(N * HV, summary.device))  # fmt: skip
    dummy = placeholder(summary.device, torch.float32, (1, 1, D, D))
    fn(
        summary, initial_state if initial_state is not None else dummy, starts,
        final_state if final_state is not None else dummy, first_segment, N,
    )  # fmt: skip


def _whole_rows(t: torch.Tensor) -> bool:
    """Each row ``t[i]`` one contiguous block of whole states, the rows apart by a multiple of it (what the kernel's
    symbolic outer stride, a multiple of ``K V``, takes)."""
    row = t.shape[1] * t.shape[2] * t.shape[3]
    return t.stride()[1:] == (t.shape[2] * t.shape[3], t.shape[3], 1) and (
        t.shape[0] <= 1 or (t.stride(0) >= row and t.stride(0) % row == 0)
    )
