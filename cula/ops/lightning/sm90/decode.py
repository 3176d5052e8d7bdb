"""Lightning decode on SM90: the host side of ``LightningDecodeSm90`` (its variants' geometry and compile keys).

The kernel, ``LightningDecodeSm90``, and its description are in ``decode_kernel.py``, imported (with the CuTe DSL)
only to compile a variant; see ``cula.ops._host``. ``LightningDecodeTile`` here holds a variant's geometry, which
the planner (``cula.lightning.plan``) sizes the grid with.
"""

from __future__ import annotations

import functools

import torch

from cula.cache import compiled_kernel
from cula.ops._host import kernel_attr

__all__ = [
    "HINTS", "LightningDecodeTile", "compiled", "compiled_variant", "default_load_hint", "tile_for", "variant_key",
]  # fmt: skip

HINTS = ("default", "no_allocate", "streaming")  # the cache hints' names (``decode_kernel.LOAD_HINTS``)


def __getattr__(name):
    return kernel_attr(__name__, name)


class LightningDecodeTile:
    """A variant's static configuration and work geometry (the kernel, ``LightningDecodeSm90``, subclasses it)."""

    arch = 90
    VEC = 4  # fp32 per 16-byte state vector

    def __init__(
        self,
        *,
        io_dtype,
        K: int,
        V: int,
        state_v_first: bool,
        load_hint: str = "default",
        store_hint: str = "default",
        warps_per_sm: int = 16,
        warps_per_cta: int = 4,
        state_regs: int = 64,
        cols: bool = False,
    ):
        if K not in (64, 128):
            raise ValueError(f"K must be 64 or 128, got {K}")
        if V % 64 != 0:
            raise ValueError(f"V must be a multiple of 64, got {V}")
        if load_hint not in HINTS:
            raise ValueError(f"load_hint must be one of {list(HINTS)}, got {load_hint!r}")
        if store_hint not in HINTS:
            raise ValueError(f"store_hint must be one of {list(HINTS)}, got {store_hint!r}")
        # cols ([K, V] pools): a CTA of W warps takes a [K, 32 W] box of one (sequence, head) by one TMA load (W = 4,
        # V = 128: the whole state, one contiguous piece of the pool) and keeps it in shared memory; lane j of warp w
        # owns column 32 w + j with all K rows, so o = S^T q is an in-lane sum (no reduction across lanes or warps)
        if cols and (state_v_first or V % (32 * warps_per_cta) != 0):
            raise ValueError("cols is for [K, V] pools with V a multiple of 32 x warps_per_cta")
        self.cols = cols
        if warps_per_cta not in ((1, 2, 4) if cols else (1, 4)):
            raise ValueError(f"warps_per_cta must be 1 or 4 (or 2 with cols), got {warps_per_cta}")
        if warps_per_sm % warps_per_cta != 0:
            raise ValueError(f"warps_per_sm must be a multiple of {warps_per_cta}, got {warps_per_sm}")
        self.warps_per_cta = warps_per_cta
        if state_regs not in (32, 64) or (state_regs == 32 and not state_v_first):
            raise ValueError(f"state_regs must be 64, or 32 for [V, K] pools, got {state_regs}")
        self.state_regs = state_regs  # fp32 state values per lane
        self.io_dtype = io_dtype
        self.K, self.V = K, V
        self.state_v_first = state_v_first
        self.load_hint = load_hint
        self.store_hint = store_hint
        self.min_blocks_per_sm = warps_per_sm // self.warps_per_cta

        if state_v_first:
            # inner = K: the whole K row sits in one warp, so the reduction for o never leaves it
            self.C = 2
            self.R = state_regs // (self.VEC * self.C)
            self.lanes_in = K // (self.VEC * self.C)
            self.lanes_out = 32 // self.lanes_in
            self.rows_per_unit = self.lanes_out * self.R  # rows of V per unit
            self.warps_per_unit = 1
            self.units_per_head = V // self.rows_per_unit
        else:
            # inner = V: 8 lanes x 16 B = one 128-byte line of a K row per chunk; K split over lane groups
            # (and for K=128 over the CTA's 4 warps)
            self.R = 16 if K == 64 else 8
            self.C = state_regs // (self.VEC * self.R)
            self.lanes_in = 8
            self.lanes_out = 4
            self.slice_v = self.lanes_in * self.VEC * self.C  # 32 (K=64) or 64 (K=128)
            self.warps_per_unit = K // (self.lanes_out * self.R)
            self.units_per_head = V // self.slice_v
        assert self.R * self.C * self.VEC == self.state_regs
        self.tile_v = 32 * warps_per_cta  # cols: V columns per CTA
        if cols:  # a CTA is the unit: one box
            self.warps_per_unit, self.units_per_head = warps_per_cta, V // self.tile_v
        if self.warps_per_unit not in (1, self.warps_per_cta):
            raise ValueError(f"[K, V] pools with K={K} reduce over the CTA's 4 warps: warps_per_cta must be 4")
        self.units_per_cta = self.warps_per_cta // self.warps_per_unit
        self.chunk_stride = self.lanes_in * self.VEC  # inner distance between a lane's chunks

    def units(self, N: int, HV: int) -> int:
        """Work units of one call (warps or CTAs, see the module docstring)."""
        return N * HV * self.units_per_head

    def ctas_needed(self, N: int, HV: int) -> int:
        return (self.units(N, HV) + self.units_per_cta - 1) // self.units_per_cta


def default_load_hint(K: int, state_v_first: bool) -> str:
    """The state loads' cache hint: none, except for [K, V] pools with K=64, whose tile spills 20 bytes at the
    128-register cap without ``L1::no_allocate`` (and was measured with it)."""
    return "no_allocate" if K == 64 and not state_v_first else "default"


def variant_key(
    *,
    io_dtype: torch.dtype,
    K: int,
    V: int,
    state_v_first: bool,
    load_hint: str | None = None,
    store_hint: str = "default",
    warps_per_sm: int = 16,
    warps_per_cta: int = 4,
    state_regs: int = 64,
    cols: bool = False,
    arch: tuple[int, int] = (9, 0),
) -> tuple:
    """The compile key of a variant (``load_hint`` None: :func:`default_load_hint`)."""
    load_hint = default_load_hint(K, state_v_first) if load_hint is None else load_hint
    return ("lightning_decode_sm90", io_dtype, K, V, state_v_first, load_hint, store_hint, warps_per_sm,
            warps_per_cta, state_regs, bool(cols), arch)  # fmt: skip


def compiled(key: tuple):
    """The compiled TVM-FFI function of the variant ``key``, traced once per process through ``cula.cache``:
    ``fn(q, k, v, decay, state, indices, out, scale, num_ctas)``."""
    return compiled_kernel(key, lambda: kernel_attr(__name__, "_compile")(config_for(key), key[-1]))


def compiled_variant(**options):
    """``compiled(variant_key(**options))``."""
    return compiled(variant_key(**options))


@functools.cache
def config_for(key: tuple):
    """The variant's kernel object (imports the DSL)."""
    return kernel_attr(__name__, "_config")(key)


@functools.cache
def tile_for(key: tuple) -> LightningDecodeTile:
    """The variant's geometry, without the DSL (the planner sizes its grid with it)."""
    (_, io_dtype, K, V, state_v_first, load_hint, store_hint, warps_per_sm, warps_per_cta, state_regs, cols,
     _arch) = key  # fmt: skip
    return LightningDecodeTile(
        io_dtype=io_dtype, K=K, V=V, state_v_first=state_v_first, load_hint=load_hint, store_hint=store_hint,
        warps_per_sm=warps_per_sm, warps_per_cta=warps_per_cta, state_regs=state_regs, cols=cols,
    )  # fmt: skip
