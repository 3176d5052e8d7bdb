"""Lightning decode on SM90: the host side (tile choice, compile keys, grid, launch).

The kernel, ``LightningDecodeSm90``, and its description are in ``decode_kernel.py``, imported (with the CuTe DSL)
only to compile a variant; see ``cula.ops._host``. ``LightningDecodeTile`` here holds a variant's geometry, which
the launcher sizes the grid with.
"""

from __future__ import annotations

import functools

import torch

from cula.cache import compiled_kernel
from cula.ops._host import kernel_attr

__all__ = [
    "HINTS", "LightningDecodeTile", "default_load_hint", "launch_key", "lightning_decode_launcher",
    "lightning_decode_sm90", "lightning_decode_variant",
]

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


def default_tile(
    state_v_first: bool, T: int, V: int = 128, K: int = 128, states: int | None = None
) -> tuple[int, int, int, bool]:
    """(warps per CTA, warps per SM, state values a lane, cols) of a call: ``SINGLE_TOKEN_TILE`` for T=1 on a
    [V, K] pool, ``KV_COLS`` (when set) for T=1 on a [K, V] pool with K=128 whose V its box divides and whose
    ``states`` (N x HV; None: any) reach ``KV_COLS_MIN_STATES``, else 4-warp CTAs, 16 warps per SM and 64 values a
    lane."""
    if T == 1 and state_v_first and SINGLE_TOKEN_TILE:
        return (*SINGLE_TOKEN_TILE, False)
    if (T == 1 and not state_v_first and KV_COLS and K == 128 and V % (32 * KV_COLS[0]) == 0
            and (states is None or states >= KV_COLS_MIN_STATES)):  # fmt: skip
        return KV_COLS[0], KV_COLS[0] * KV_COLS[1], 64, True
    return 4, 16, 64, False


def _variant_key(
    io_dtype, K, V, state_v_first, load_hint, store_hint, warps_per_sm, warps_per_cta, state_regs, cols, arch
) -> tuple:
    """The compile-cache key (``load_hint`` None: :func:`default_load_hint`)."""
    load_hint = default_load_hint(K, state_v_first) if load_hint is None else load_hint
    return ("lightning_decode_sm90", io_dtype, K, V, state_v_first, load_hint, store_hint, warps_per_sm,
            warps_per_cta, state_regs, bool(cols), arch)  # fmt: skip

@functools.cache
def _config_for(key: tuple):
    """The variant's kernel object (imports the DSL)."""
    return kernel_attr(__name__, "_config")(key)


@functools.cache
def _tile_for(key: tuple) -> LightningDecodeTile:
    """The variant's geometry, without the DSL (the launcher sizes its grid with it)."""
    (_, io_dtype, K, V, state_v_first, load_hint, store_hint, warps_per_sm, warps_per_cta, state_regs, cols,
     _arch) = key  # fmt: skip
    return LightningDecodeTile(
        io_dtype=io_dtype, K=K, V=V, state_v_first=state_v_first, load_hint=load_hint, store_hint=store_hint,
        warps_per_sm=warps_per_sm, warps_per_cta=warps_per_cta, state_regs=state_regs, cols=cols,
    )  # fmt: skip


def lightning_decode_variant(
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
):
    """The compiled TVM-FFI function of one variant (traced once per process through ``cula.cache``).

    Call it as ``fn(q, k, v, decay, state, indices, out, scale, num_ctas)``. Used by the CPU compile tests.
    """
    key = _variant_key(
        io_dtype, K, V, state_v_first, load_hint, store_hint, warps_per_sm, warps_per_cta, state_regs, cols, arch
    )
    return compiled_kernel(key, lambda: kernel_attr(__name__, "_compile")(_config_for(key), arch))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def lightning_decode_sm90(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    state: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    state_v_first: bool,
    load_hint: str | None = None,
    store_hint: str = "default",
    warps_per_sm: int | None = None,
    warps_per_cta: int | None = None,
    state_regs: int | None = None,
    cols: bool | None = None,
    persistent: bool | None = None,
) -> None:
    """One Lightning decode step (T tokens per sequence) against an fp32 state pool, on SM90.

    Inputs are validated by the caller; this function only picks the compiled variant and launches it
    (a dict lookup and one TVM-FFI call, on the current torch stream). TVM-FFI still checks dtypes, ranks,
    matching sizes, contiguity of the inner dims and 16-byte alignment, and raises on a mismatch.

    Args:
        q, k: ``[N, T, H, K]`` bf16 or fp16, contiguous, 16-byte aligned. ``K`` in {64, 128}.
        v: ``[N, T, HV, V]``, q's dtype, contiguous; ``HV % H == 0`` (GVA); ``V % 64 == 0``.
        decay: ``[HV]`` fp32, the per-head decay rate (``>= 0``); the state is multiplied by
            ``exp(-decay)`` before each token's update.
        state: fp32 pool ``[P, HV, V, K]`` if ``state_v_first`` else ``[P, HV, K, V]``, updated in place.
            Dims 1.. contiguous; dim 0 may have any stride that is a multiple of 4.
        indices: ``[N]`` int32 pool rows. A negative index is a padded slot: the pool is not touched and its
            output rows are **zeroed**. Indices must be ``< P`` (not checked here).
        out: ``[N, T, HV, V]`` in q's dtype, written.
        scale: multiplies ``S^T q``.
        load_hint, store_hint, warps_per_sm, warps_per_cta, state_regs: tuning knobs for the speed report (see
            ``LOAD_HINTS``, ``STORE_HINTS``; ``load_hint`` None: :func:`default_load_hint`; ``warps_per_sm`` sets
            ptxas' register cap to ``65536 / (32 * warps_per_sm)``; ``warps_per_cta`` 1 or 4; ``state_regs``, fp32
            state values a lane, 64 or, for [V, K] pools, 32); ``cols``: the column kernel for [K, V] pools (see
            ``LightningDecodeSm90``). All four None: :func:`default_tile`; any given: the others default to 16, 4,
            64 and False. ``persistent``: ``#SMs x CTAs per SM`` CTAs walking the units
            with a grid stride instead of one CTA per unit group (None: from ``PERSISTENT_MIN_TOKENS``).
    """
    if q.shape[0] == 0:  # an empty grid is a launch error
        return
    launch = lightning_decode_launcher(
        q, v, state_v_first=state_v_first, load_hint=load_hint, store_hint=store_hint, warps_per_sm=warps_per_sm,
        warps_per_cta=warps_per_cta, state_regs=state_regs, cols=cols, persistent=persistent,
    )  # fmt: skip
    launch(q, k, v, decay, state, indices, out, scale)


def launch_key(
    io_dtype: torch.dtype, K: int, V: int, tokens: int, states: int | None, *, state_v_first: bool,
    load_hint: str | None = None, store_hint: str = "default", warps_per_sm: int | None = None,
    warps_per_cta: int | None = None, state_regs: int | None = None, cols: bool | None = None,
) -> tuple:  # fmt: skip
    """The compile key ``lightning_decode_launcher`` takes for calls of ``tokens`` tokens and ``states`` (N x HV)
    states (arguments as :func:`lightning_decode_sm90`): the tile of ``default_tile`` unless a knob is given."""
    if warps_per_sm is None and warps_per_cta is None and state_regs is None and cols is None:
        warps_per_cta, warps_per_sm, state_regs, cols = default_tile(state_v_first, tokens, V, K, states)
    else:
        warps_per_sm = 16 if warps_per_sm is None else warps_per_sm
        warps_per_cta = 4 if warps_per_cta is None else warps_per_cta
        state_regs = 64 if state_regs is None else state_regs
        cols = bool(cols)
    return _variant_key(
        io_dtype, K, V, state_v_first, load_hint, store_hint, warps_per_sm, warps_per_cta, state_regs, cols, _ARCH
    )


def lightning_decode_launcher(
    q: torch.Tensor,
    v: torch.Tensor,
    *,
    state_v_first: bool,
    load_hint: str | None = None,
    store_hint: str = "default",
    warps_per_sm: int | None = None,
    warps_per_cta: int | None = None,
    state_regs: int | None = None,
    cols: bool | None = None,
    persistent: bool | None = None,
):
    """The compiled variant and grid for calls shaped like ``q`` / ``v`` (``N >= 1``), bound once:
    ``launch(q, k, v, decay, state, indices, out, scale)`` (arguments as :func:`lightning_decode_sm90`)."""
    key = launch_key(
        q.dtype, q.shape[-1], v.shape[-1], q.shape[1], q.shape[0] * v.shape[2], state_v_first=state_v_first,
        load_hint=load_hint, store_hint=store_hint, warps_per_sm=warps_per_sm, warps_per_cta=warps_per_cta,
        state_regs=state_regs, cols=cols,
    )  # fmt: skip
    if key[10]:  # cols: one CTA a box, no grid stride in kernel_cols
        persistent = False
    cfg = _tile_for(key)
    fn = compiled_kernel(key, lambda: kernel_attr(__name__, "_compile")(_config_for(key), _ARCH))
    ctas = cfg.ctas_needed(q.shape[0], v.shape[2])
    if persistent is None:
        persistent = PERSISTENT_MIN_TOKENS is not None and q.shape[1] >= PERSISTENT_MIN_TOKENS
    if persistent:
        ctas = min(ctas, _sm_count(q.device.index) * cfg.min_blocks_per_sm)

    def launch(q, k, v, decay, state, indices, out, scale):
        fn(q, k, v, decay, state, indices, out, scale, ctas)

    def bind(decay, state, indices, scale):
        """``launch`` with all but q, k, v and out fixed: ``tokens(q, k, v, out)``, for ``lightning_decode_step``
        (its N=1 call is host-bound)."""

        def tokens(q, k, v, out):
            fn(q, k, v, decay, state, indices, out, scale, ctas)

        return tokens

    launch.bind = bind
    return launch


_ARCH = (9, 0)
# T=1 calls on [V, K] pools: (warps per CTA, warps per SM, state values a lane). One-warp CTAs with half the state a
# lane (V slices of 8 rows, 83 registers, no spills) against the 4-warp CTAs of 64 values a lane at 16 warps per SM,
# on the H200 (session 19, scripts/device/decode_cta_size.py, CUDA-graph replay): N=64 / 128 / 256 / 512 in 134.9 /
# 268.0 / 531.4 / 1060.3 us against 137.7 / 273.3 / 542.7 / 1083.0 (94.1 / 94.8 / 95.6 / 95.8% of copy against 92.2
# / 92.9 / 93.6 / 93.8); 24 warps per SM (80 registers) the same; one-warp CTAs of 64 values, or 4-warp CTAs of 32
# values at 24 warps per SM, no faster than the old tile. N=1 3.74 us either way. Smaller CTAs free their registers
# the moment their one warp ends (see the KDA decode's SINGLE_TOKEN_CTA). None: the old tile.
SINGLE_TOKEN_TILE: tuple[int, int, int] | None = (1, 20, 32)
# T=1 calls on [K, V] pools with K=128 (K=64 not timed) and at least KV_COLS_MIN_STATES states (N x HV): the column
# kernel (``LightningDecodeSm90(cols=True)``) with (warps per CTA, CTAs per SM); None: off. On the H200 (session 20,
# scripts/device/decode_cta_size.py --kv, CUDA-graph replay, HV=64) 2 x 6 ran N = 48 / 64 / 128 / 256 / 512 in 104.5
# / 137.3 / 271.0 / 536.5 / 1069.9 us against the 4-warp tile's 104.7 / 137.9 / 272.5 / 540.4 / 1077.7 (95.0 against
# 94.3% of copy at N=512), 4 x 3 and 1 x 12 behind the tile. N = 16 / 32 tied (37.4 / 71.3 us), N = 1 / 2 / 4 / 8 the
# tile faster (3.8 / 5.2 / 7.7 / 13.9 against 4.7 / 6.1 / 9.0 / 14.6): too few boxes to fill the SMs.
# test_decode_cases' cols cases passed (1, 2 and 4 warps, T = 1 to 3, K = 64 and 128).
KV_COLS: tuple[int, int] | None = (2, 6)
KV_COLS_MIN_STATES = 3072
# Calls with fewer tokens than this launch one CTA per unit group (the kernel's grid stride then runs one round)
# rather than #SMs x CTAs per SM walking the units: the hardware hands each new CTA to whichever SM frees up,
# where a static grid stride gives every CTA the same share and the slowest SMs set the end. On the H200
# (2026-12-01, speed report, N=64 / 256, T=1) 139.3-139.7 / 542.9-543.3 us in both layouts against 144.5-146.5 /
# 567.5-569.6 us persistent (91 / 93.6% of copy against 87-88 / 89.5%). At T=4 the persistent grid is still
# faster (156-157 against 162-163 us at N=64), so it stays for T >= 2. None: always persistent.
PERSISTENT_MIN_TOKENS: int | None = 2
