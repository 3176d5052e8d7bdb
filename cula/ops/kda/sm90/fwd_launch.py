"""One host call for a repeated ``chunk_kda``: the host side (the compile key; the workspace's size).

The launchers, ``ChunkKDAFwdSm90`` / ``ChunkKDAVarlenFwdSm90``, and the workspace layout are described in
``fwd_launch_kernel.py``, imported (with the CuTe DSL) only to compile a variant; see ``cula.ops._host``.
"""

from __future__ import annotations

from cula.cache import compiled_kernel
from cula.ops._host import ROW_FACTORS, kernel_attr

__all__ = ["ROW_WORK_COLS", "WORK_COLS", "WY_WORK_COLS", "compiled", "compiled_variant", "variant_key", "work_cols"]

DK = DV = 128
BT = 64
# w, u, qg, kg, Aqk in elements of q's dtype, then g_cum's 128 fp32 (256 two-byte elements)
WORK_COLS = 4 * DK + BT + 2 * DK
# Gated DeltaNet's row_factors variant: w, u, Aqk, then the ROW_FACTORS fp32 factors of each token and value head
ROW_WORK_COLS = 2 * DK + BT + 2 * ROW_FACTORS
# with wy_in_recurrence: T diag(beta), Aqk, then the factors
WY_WORK_COLS = 2 * BT + 2 * ROW_FACTORS


def work_cols(intra_options: dict) -> int:
    """The workspace's columns (two-byte elements a token and value head) of a variant."""
    if intra_options.get("wy_in_recurrence"):
        return WY_WORK_COLS
    return ROW_WORK_COLS if intra_options.get("row_factors") else WORK_COLS


def __getattr__(name):
    return kernel_attr(__name__, name)


def variant_key(intra_options: dict, state_options: dict, arch=(9, 0), varlen: bool = False) -> tuple:
    """The compile key of a variant: the intra kernel's options (``intra.kernel_options``) and the state/output
    kernel's."""

    def named(options):  # DSL dtype classes by name, so that the key reads well in the benchmarks' meta
        return tuple((k, getattr(v, "__name__", v)) for k, v in sorted(options.items()))

    cls = "ChunkKDAVarlenFwdSm90" if varlen else "ChunkKDAFwdSm90"
    return ("kda.fwd_launch", cls, named(intra_options), named(state_options), arch)


def compiled(key: tuple):
    """The compiled variant of ``key`` (see ``cula.cache.compiled_kernel``)."""
    _, cls, intra_options, state_options, arch = key
    varlen = cls == "ChunkKDAVarlenFwdSm90"
    return compiled_kernel(
        key, lambda: kernel_attr(__name__, "_compile")(dict(intra_options), dict(state_options), arch, varlen=varlen)
    )


def compiled_variant(intra_options: dict, state_options: dict, arch=(9, 0), varlen: bool = False):
    """``compiled(variant_key(...))``."""
    return compiled(variant_key(intra_options, state_options, arch, varlen))
