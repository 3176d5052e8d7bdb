"""Lightning's planner: what runs for a call, decided from its shapes and the GPU's tuning entry.

- prefill (``lightning_attn_fwd``, ``chunk_simple_gla(g_gamma=...)``): whether long sequences with few heads are
  cut into segments that run at once (``LightningTuning.time_split``, read by ``cula.lightning.time_parallel``).
- decode: which ``LightningDecodeSm90`` tile runs a call (``default_tile``, ``launch_key``), its grid, and its bound
  launch (``lightning_decode_launcher``).

The numbers are in ``LIGHTNING_TUNING``, one ``LightningTuning`` per compute capability; tests change them with
``LIGHTNING_TUNING.override(...)``.
"""

from __future__ import annotations

import dataclasses

import torch

from cula.ops.lightning.sm90.decode import compiled, tile_for, variant_key
from cula import time_split
from cula.time_split import SplitPlan, SplitThresholds
from cula.tuning import TuningTable

__all__ = [
    "LIGHTNING_TUNING", "LightningTuning", "default_tile", "launch_key", "lightning_decode_launcher",
    "lightning_decode_sm90", "parallel_segments",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LightningTuning:
    """The numbers behind Lightning's launch decisions on one GPU."""

    # decode, T=1 calls on [V, K] pools: (warps per CTA, warps per SM, state values a lane); one-warp CTAs with half
    # the state a lane free their registers as soon as their one warp ends. None: 4-warp CTAs, 16 per SM, 64 values.
    single_token_tile: tuple[int, int, int] | None = (1, 20, 32)
    # decode, T=1 calls on [K, V] pools with K=128 from kv_cols_min_states states (N x HV) on: the column kernel
    # (LightningDecodeSm90(cols=True)) with (warps per CTA, CTAs per SM); fewer boxes than that do not fill the SMs
    # and the 4-warp tile is faster. None: off.
    kv_cols: tuple[int, int] | None = (2, 6)
    kv_cols_min_states: int = 3072
    # decode calls of fewer tokens launch one CTA per unit group (the hardware hands each new CTA to whichever SM
    # frees up) rather than #SMs x CTAs per SM walking the units with a static stride, where the slowest SMs set
    # the end; from this many tokens on the persistent grid is faster. None: always persistent.
    persistent_min_tokens: int | None = 2
    # prefill: when and how long sequences with few heads are cut in time (None: never)
    time_split: SplitThresholds | None = None


# The H200's numbers (H100 shares sm_90). time_split from bench_lightning_prefill.py --time-parallel: about one
# (segment, head) item per SM was best or within 5% of it from 4 to 16 heads and 16K to 1M tokens (longer segments
# as the call grows, so the two passes' extra state traffic stays small); a call of 32 (sequence, head) items
# already gained 1.6x from cutting (16 heads x 2 x 64K). Whole waves (wave_ctas=1: an item's two V-slice CTAs share
# one SM): one item more than the SMs costs a second wave, as in 8 heads x 64K (16 segments 0.271 ms in that sweep,
# the 17 the unrounded count gives 0.314 in long_context.md) and 16 heads x 64K (8 segments 0.495, 9 0.604).
LIGHTNING_TUNING: TuningTable[LightningTuning] = TuningTable(
    "lightning",
    {(9, 0): LightningTuning(time_split=SplitThresholds(items_per_sm=1.0, busy_items_per_sm=0.3, min_segment=2048,
                                                        min_seq_len=16384, wave_ctas=1))},
    fallback=LightningTuning(),
)
_ARCH = (9, 0)


def default_tile(
    state_v_first: bool, T: int, V: int = 128, K: int = 128, states: int | None = None,
    tuning: LightningTuning | None = None,
) -> tuple[int, int, int, bool]:  # fmt: skip
    """(warps per CTA, warps per SM, state values a lane, cols) of a call: ``single_token_tile`` for T=1 on a
    [V, K] pool, ``kv_cols`` (when set) for T=1 on a [K, V] pool with K=128 whose V its box divides and whose
    ``states`` (N x HV; None: any) reach ``kv_cols_min_states``, else 4-warp CTAs, 16 warps per SM and 64 values a
    lane."""
    t = tuning or LIGHTNING_TUNING.get(_ARCH)
    if T == 1 and state_v_first and t.single_token_tile:
        return (*t.single_token_tile, False)
    cols = t.kv_cols
    if (T == 1 and not state_v_first and cols and K == 128 and V % (32 * cols[0]) == 0
            and (states is None or states >= t.kv_cols_min_states)):  # fmt: skip
        return cols[0], cols[0] * cols[1], 64, True
    return 4, 16, 64, False


def launch_key(
    io_dtype: torch.dtype, K: int, V: int, tokens: int, states: int | None, *, state_v_first: bool,
    load_hint: str | None = None, store_hint: str = "default", warps_per_sm: int | None = None,
    warps_per_cta: int | None = None, state_regs: int | None = None, cols: bool | None = None,
    tuning: LightningTuning | None = None,
) -> tuple:  # fmt: skip
    """The compile key ``lightning_decode_launcher`` takes for calls of ``tokens`` tokens and ``states`` (N x HV)
    states (arguments as :func:`lightning_decode_sm90`): the tile of ``default_tile`` unless a knob is given."""
    if warps_per_sm is None and warps_per_cta is None and state_regs is None and cols is None:
        warps_per_cta, warps_per_sm, state_regs, cols = default_tile(state_v_first, tokens, V, K, states, tuning)
    else:
        warps_per_sm = 16 if warps_per_sm is None else warps_per_sm
        warps_per_cta = 4 if warps_per_cta is None else warps_per_cta
        state_regs = 64 if state_regs is None else state_regs
        cols = bool(cols)
    return variant_key(
        io_dtype=io_dtype, K=K, V=V, state_v_first=state_v_first, load_hint=load_hint, store_hint=store_hint,
        warps_per_sm=warps_per_sm, warps_per_cta=warps_per_cta, state_regs=state_regs, cols=cols, arch=_ARCH,
    )  # fmt: skip


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
    ``launch(q, k, v, decay, state, indices, out, scale)`` (arguments as :func:`lightning_decode_sm90`), and
    ``launch.bind(decay, state, indices, scale)``, the same with all but q, k, v and out fixed, for
    ``lightning_decode_step`` (its N=1 call is host-bound)."""
    tuning = LIGHTNING_TUNING.for_device(q.device)
    key = launch_key(
        q.dtype, q.shape[-1], v.shape[-1], q.shape[1], q.shape[0] * v.shape[2], state_v_first=state_v_first,
        load_hint=load_hint, store_hint=store_hint, warps_per_sm=warps_per_sm, warps_per_cta=warps_per_cta,
        state_regs=state_regs, cols=cols, tuning=tuning,
    )  # fmt: skip
    if key[10]:  # cols: one CTA a box, no grid stride in kernel_cols
        persistent = False
    cfg = tile_for(key)
    fn = compiled(key)
    ctas = cfg.ctas_needed(q.shape[0], v.shape[2])
    if persistent is None:
        persistent = tuning.persistent_min_tokens is not None and q.shape[1] >= tuning.persistent_min_tokens
    if persistent:
        ctas = min(ctas, time_split.sm_count(q.device.index) * cfg.min_blocks_per_sm)

    def launch(q, k, v, decay, state, indices, out, scale):
        fn(q, k, v, decay, state, indices, out, scale, ctas)

    def bind(decay, state, indices, scale):
        def tokens(q, k, v, out):
            fn(q, k, v, decay, state, indices, out, scale, ctas)

        tokens.checks_arguments = True  # the compiled entry's own checks (cula.backends.StepPlans)
        return tokens

    launch.bind = bind
    return launch


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
    """One Lightning decode step (T tokens per sequence) against an fp32 state pool, on SM90, through the tile the
    planner picks. Inputs are validated by the caller (``cula.lightning.decode``); TVM-FFI still checks dtypes,
    ranks, matching sizes, contiguity of the inner dims and 16-byte alignment, and raises on a mismatch.

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
        load_hint, store_hint, warps_per_sm, warps_per_cta, state_regs: knobs for the speed report (see
            ``LOAD_HINTS``, ``STORE_HINTS``; ``load_hint`` None: ``default_load_hint``; ``warps_per_sm`` sets
            ptxas' register cap to ``65536 / (32 * warps_per_sm)``; ``warps_per_cta`` 1 or 4; ``state_regs``, fp32
            state values a lane, 64 or, for [V, K] pools, 32); ``cols``: the column kernel for [K, V] pools (see
            ``LightningDecodeSm90``). All four None: :func:`default_tile`; any given: the others default to 16, 4,
            64 and False. ``persistent``: ``#SMs x CTAs per SM`` CTAs walking the units with a grid stride instead
            of one CTA per unit group (None: from ``persistent_min_tokens``).
    """
    if q.shape[0] == 0:  # an empty grid is a launch error
        return
    launch = lightning_decode_launcher(
        q, v, state_v_first=state_v_first, load_hint=load_hint, store_hint=store_hint, warps_per_sm=warps_per_sm,
        warps_per_cta=warps_per_cta, state_regs=state_regs, cols=cols, persistent=persistent,
    )  # fmt: skip
    launch(q, k, v, decay, state, indices, out, scale)


def parallel_segments(B: int, T: int, HV: int, cu_seqlens, cu_seqlens_cpu, device: torch.device) -> SplitPlan | None:
    """How a Lightning / ``chunk_simple_gla(g_gamma)`` inference call's sequences are cut for the exact
    time-parallel forward (``LightningTuning.time_split``, ``cula.lightning.time_parallel``), or None to run them
    whole; as ``cula.kda.plan.parallel_segments`` (a captured packed call's segments and combine made on the device
    at each replay)."""
    return time_split.plan_call(
        LIGHTNING_TUNING.for_device(device).time_split, B, T, HV, cu_seqlens, cu_seqlens_cpu, device
    )
