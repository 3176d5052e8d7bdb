"""Lightning's time-parallel prefill, the combine on SM90: the host side (compile key, launch).

The kernel, ``LightningSegmentChainSm90`` (every segment's true start state from the segments' end states, a scan
of a scalar decay per head), and its description are in ``segment_chain_kernel.py``, imported (with the CuTe DSL)
only to compile a variant; see ``cula.ops._host``.
"""

from __future__ import annotations

import torch

from cula.cache import compiled_kernel
from cula.ops._host import kernel_attr

__all__ = ["compiled", "compiled_variant", "lightning_segment_chain_sm90", "variant_key"]


def __getattr__(name):
    return kernel_attr(__name__, name)


def variant_key(head_dim: int, has_h0: bool, arch: tuple[int, int] = (9, 0)) -> tuple:
    """The compile key of a variant."""
    return ("lightning.segment_chain", "LightningSegmentChainSm90", head_dim, has_h0, arch)


def compiled(key: tuple):
    """The compiled variant of ``key`` (see ``cula.cache.compiled_kernel``): the TVM-FFI callable ``fn(E, h0,
    starts, bounds, first, decay, num_seqs)``."""
    head_dim, has_h0, arch = key[2:]
    return compiled_kernel(key, lambda: kernel_attr(__name__, "_compile")(head_dim, has_h0, arch))


def compiled_variant(head_dim: int, has_h0: bool, arch: tuple[int, int] = (9, 0)):
    """``compiled(variant_key(...))``."""
    return compiled(variant_key(head_dim, has_h0, arch))


def lightning_segment_chain_sm90(
    ends: torch.Tensor,
    initial_state: torch.Tensor | None,
    starts: torch.Tensor,
    bounds: torch.Tensor,
    first_segment: torch.Tensor,
    decay: torch.Tensor,
) -> None:
    """Every segment's true start state (``segment_chain_kernel.py``), written into ``starts``.

    Args:
        ends: ``[M, HV, D, D]`` fp32 contiguous (either state layout): each segment's end state from a zero start;
            read only for segments that feed a later one (not a sequence's last).
        initial_state: ``[N, HV, D, D]`` fp32 contiguous, or None for zeros.
        starts: ``[M, HV, D, D]`` fp32 contiguous, written.
        bounds: ``[M + 1]`` int32 on the device, the segments' token bounds.
        first_segment: ``[N + 1]`` int32 on the device: sequence n owns segments ``first_segment[n]`` to
            ``first_segment[n + 1] - 1`` (at least one each).
        decay: ``[HV]`` fp32 contiguous, ``>= 0`` (``-g_gamma``).
    """
    M, HV, D = starts.shape[0], starts.shape[1], starts.shape[-1]
    N = first_segment.numel() - 1
    shape = (M, HV, D, D)
    for name, t, want in (("ends", ends, shape), ("starts", starts, shape),
                          ("initial_state", initial_state, (N, HV, D, D))):  # fmt: skip
        if t is not None and (tuple(t.shape) != want or t.dtype != torch.float32 or not t.is_contiguous()):
            raise ValueError(f"{name}: expected {want} float32 contiguous, got {tuple(t.shape)} {t.dtype}")
    if D not in (64, 128):
        raise ValueError(f"head dimension {D} (the kernel takes 64 or 128)")
    for name, t, n in (("bounds", bounds, M + 1), ("first_segment", first_segment, N + 1), ("decay", decay, HV)):
        want = torch.float32 if name == "decay" else torch.int32
        if t.dtype != want or t.dim() != 1 or t.numel() != n or not t.is_contiguous():
            raise ValueError(f"{name}: expected [{n}] {want} contiguous, got {list(t.shape)} {t.dtype}")
    if N <= 0 or M == 0 or HV == 0:
        return
    h0 = None if initial_state is None else initial_state.view(N, HV, D * D)
    fn = compiled_variant(D, initial_state is not None)
    fn(ends.view(M, HV, D * D), h0, starts.view(M, HV, D * D), bounds, first_segment, decay, N)
