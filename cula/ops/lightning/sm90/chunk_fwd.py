"""Lightning-attention prefill on SM90: the host side (compile key, launch).

The kernel, ``LightningFwdSm90``, and its description are in ``chunk_fwd_kernel.py``, imported (with the CuTe DSL)
only to compile a variant; see ``cula.ops._host``.
"""

from __future__ import annotations

import torch

from cula.backends import ConstantTensors
from cula.cache import compiled_kernel
from cula.ops._host import kernel_attr

CHUNK = 64
V_TILE = 64  # V columns owned by one CTA
SUPPORTED_HEAD_DIMS = (64, 128)


def __getattr__(name):
    return kernel_attr(__name__, name)


_NO_DECAYS = ConstantTensors()


def kernel_decay(g_gamma: torch.Tensor | None, HV: int, device: torch.device) -> torch.Tensor:
    """The kernel's fp32 ``[HV]`` decay, ``-g_gamma`` (zeros without one, made once per device and head count), from
    the decay's current values at each call (a write through ``.data`` leaves no version bump a cache could check)."""
    if g_gamma is None:
        return _NO_DECAYS.get(device, ("no_decay", HV), lambda: torch.zeros(HV, device=device))
    return (-g_gamma.detach()).float().contiguous()


def variant_key(head_dim: int, has_h0: bool, has_ht: bool, varlen: bool, state_v_first: bool,
                arch: tuple[int, int] = (9, 0), states_only: bool = False) -> tuple:  # fmt: skip
    """The compile key of a variant (``states_only`` appended only when set: the full variants' keys stay)."""
    key = ("lightning_fwd", "LightningFwdSm90", "BFloat16", head_dim, has_h0, has_ht, varlen, state_v_first, arch)
    return key + (True,) if states_only else key


def compiled(key: tuple):
    """The compiled variant of ``key`` (cached, see ``cula.cache.compiled_kernel``): the TVM-FFI callable
    ``fn(q, k, v, o, decay, h0, ht, cu_seqlens, scale)`` taking torch tensors (None where absent; q and o in a
    states-only variant)."""
    return compiled_kernel(key, lambda: kernel_attr(__name__, "_compile")(*key[3:]))


def compiled_variant(head_dim: int, has_h0: bool, has_ht: bool, varlen: bool, state_v_first: bool,
                     arch: tuple[int, int] = (9, 0), states_only: bool = False):  # fmt: skip
    """``compiled(variant_key(...))``."""
    return compiled(variant_key(head_dim, has_h0, has_ht, varlen, state_v_first, arch, states_only))


def lightning_fwd_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, o: torch.Tensor,
                       initial_state: torch.Tensor | None, final_state: torch.Tensor | None,
                       cu_seqlens: torch.Tensor | None, *, scale: float, state_v_first: bool) -> None:
    """Lightning-attention prefill on SM90, written into preallocated outputs (the caller validates).

    Args:
        q, k: ``[B, T, H, D]`` bf16, contiguous. ``B == 1`` with packed sequences when ``cu_seqlens``.
        v: ``[B, T, HV, D]`` bf16, ``HV`` a multiple of ``H`` (GVA); ``D`` in {64, 128}.
        decay: ``[HV]`` fp32, ``>= 0``; the per-step state decay is ``exp(-decay)`` (FLA ``g_gamma = -decay``).
        o: ``[B, T, HV, D]`` bf16 output, fully overwritten.
        initial_state: ``[N, HV, D, D]`` fp32 or None (zeros). ``N`` is B, or the number of sequences.
        final_state: ``[N, HV, D, D]`` fp32 output or None.
        cu_seqlens: ``[N + 1]`` int32 cumulative sequence lengths, or None.
        scale: multiplies o (FLA default ``D ** -0.5``).
        state_v_first: states are ``[N, HV, V, K]`` if True, else ``[N, HV, K, V]``.
    """
    fn = compiled_variant(q.shape[-1], initial_state is not None, final_state is not None, cu_seqlens is not None,
                          state_v_first)  # fmt: skip
    fn(q, k, v, o, decay, initial_state, final_state, cu_seqlens, float(scale))


def lightning_states_sm90(k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, initial_state: torch.Tensor | None,
                          final_state: torch.Tensor, cu_seqlens: torch.Tensor | None, *, state_v_first: bool) -> None:
    """The final states alone (the states-only variant: k and v read, no q, no output); arguments as
    :func:`lightning_fwd_sm90`'s."""
    fn = compiled_variant(k.shape[-1], initial_state is not None, True, cu_seqlens is not None, state_v_first,
                          states_only=True)  # fmt: skip
    fn(None, k, v, None, decay, initial_state, final_state, cu_seqlens, 1.0)
