"""KDA decode on SM90: the host side of ``KdaDecodeSm90`` (its variants' compile keys).

The kernel, ``KdaDecodeSm90``, and its description are in ``decode_kernel.py``, imported (with the CuTe DSL) only
to compile a variant; see ``cula.ops._host``.
"""

from __future__ import annotations

import torch

from cula.cache import compiled_kernel
from cula.ops._host import GATES, kernel_attr

__all__ = ["GATES", "compiled", "compiled_variant", "variant_key"]


# resident warps per SM: 16 (4 CTAs of 4 warps) keeps ptxas at 128 registers; wide_kv's 64 state registers a lane
# need 168, so 12
WARPS_PER_SM, WIDE_WARPS_PER_SM = 16, 12
# kv_cols: the state box in shared memory sets the occupancy (3 CTAs of 4 warps with a 64 KB box); the register cap
# of 12 warps per SM (168) is no limit
KV_COLS_WARPS_PER_SM = 12


def __getattr__(name):
    return kernel_attr(__name__, name)


def variant_key(
    *,
    io_dtype: torch.dtype,
    g_dtype: torch.dtype,
    beta_dtype: torch.dtype,
    K: int,
    V: int,
    gate: str,
    has_a_log: bool,
    has_dt_bias: bool,
    use_qk_l2norm: bool,
    beta_sigmoid: bool,
    allow_neg_eigval: bool,
    state_v_first: bool,
    has_step_states: bool,
    wide_kv: bool = False,
    warps_per_cta: int = 4,
    tokens_per_round: int = 8,
    min_blocks_per_sm: int | None = None,
    kv_tma: bool = False,
    kv_cols: bool = False,
    per_head_gate: bool = False,
    arch: tuple[int, int] = (9, 0),
) -> tuple:
    """The compile key of a variant: its flags, those that cannot change the trace folded so they never cost a
    second compile. ``warps_per_cta`` (the resident warps per SM stay 16, or 12 with ``wide_kv``) is for sweeps;
    ``tokens_per_round``: shared token slots per warp (any T runs, in rounds); ``min_blocks_per_sm``: CTAs per SM
    that ptxas must fit (None: 16 or 12 resident warps)."""
    gated = gate != "none"
    flags = {
        "io_dtype": io_dtype, "g_dtype": g_dtype, "beta_dtype": beta_dtype, "K": K, "V": V, "gate": gate,
        "has_a_log": has_a_log and gated, "has_dt_bias": has_dt_bias and gated, "use_qk_l2norm": use_qk_l2norm,
        "beta_sigmoid": beta_sigmoid, "allow_neg_eigval": allow_neg_eigval and beta_sigmoid,
        "state_v_first": state_v_first, "has_step_states": has_step_states, "wide_kv": bool(wide_kv),
        "warps_per_cta": warps_per_cta, "tokens_per_round": tokens_per_round, "min_blocks_per_sm": min_blocks_per_sm,
        "kv_tma": bool(kv_tma), "arch": arch,
    }  # fmt: skip
    if kv_cols:  # absent when off: the keys (and caches) of the other variants stay
        flags["kv_cols"] = True
    if per_head_gate:  # g [N, T, HV] and dt_bias [HV] (Gated DeltaNet's gate); absent when off, as kv_cols
        flags["per_head_gate"] = True
    return ("kda_decode_sm90", *sorted(flags.items()))


def compiled(key: tuple):
    """The compiled TVM-FFI function of the variant ``key`` (traced once per process through ``cula.cache``):
    ``fn(q, k, v, g, beta, A_log, dt_bias, state, indices, out, step_states, scale, lower_bound)`` with None exactly
    where the variant has no A_log / dt_bias / step_states."""
    return compiled_kernel(key, lambda: kernel_attr(__name__, "_build")(key))


def compiled_variant(**flags):
    """``compiled(variant_key(**flags))``."""
    return compiled(variant_key(**flags))
