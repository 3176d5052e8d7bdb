"""KDA decode on SM90: the host side (variant choice, compile keys, launch).

The kernel, ``KdaDecodeSm90``, and its description are in ``decode_kernel.py``, imported (with the CuTe DSL) only
to compile a variant; see ``cula.ops._host``.
"""

from __future__ import annotations

import torch

from cula.cache import compiled_kernel
from cula.ops._host import kernel_attr

__all__ = ["GATES", "kda_decode_launcher", "kda_decode_sm90", "kda_decode_variant"]

GATES = ("none", "softplus", "lower_bound")

# resident warps per SM: 16 (4 CTAs of 4 warps) keeps ptxas at 128 registers; wide_kv's 64 state registers a lane
# need 168, so 12
WARPS_PER_SM, WIDE_WARPS_PER_SM = 16, 12
# kv_cols: the state box in shared memory sets the occupancy (3 CTAs of 4 warps with a 64 KB box); the register cap
# of 12 warps per SM (168) is no limit
KV_COLS_WARPS_PER_SM = 12


def __getattr__(name):
    return kernel_attr(__name__, name)


def _variant_key(flags: dict) -> tuple:
    """The compile-cache key of a variant: its flags, those that cannot change the trace folded so they never
    cost a second compile."""
    flags = dict(flags)
    if flags["gate"] == "none":
        flags.update(has_a_log=False, has_dt_bias=False)
    flags["allow_neg_eigval"] = flags["allow_neg_eigval"] and flags["beta_sigmoid"]
    flags["wide_kv"] = bool(flags["wide_kv"])
    flags["kv_tma"] = bool(flags.get("kv_tma", False))
    if not flags.get("kv_cols", False):  # absent when off: the keys (and caches) of the other variants stay
        flags.pop("kv_cols", None)
    return ("kda_decode_sm90", *sorted(flags.items()))

def kda_decode_variant(
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
    arch: tuple[int, int] = (9, 0),
):
    """The compiled TVM-FFI function of one variant (traced once per process through ``cula.cache``).

    Call it as ``fn(q, k, v, g, beta, A_log, dt_bias, state, indices, out, step_states, scale, lower_bound)``
    with None exactly where the variant has no A_log / dt_bias / step_states. ``warps_per_cta`` (the resident
    warps per SM stay 16, or 12 with ``wide_kv``) is for the speed report's sweep. ``tokens_per_round``: shared
    token slots per warp (any T runs, in rounds); ``min_blocks_per_sm``: CTAs per SM that ptxas must fit (None:
    16 or 12 resident warps). Used by the CPU compile tests.
    """
    key = _variant_key(
        {"io_dtype": io_dtype, "g_dtype": g_dtype, "beta_dtype": beta_dtype, "K": K, "V": V, "gate": gate,
         "has_a_log": has_a_log, "has_dt_bias": has_dt_bias, "use_qk_l2norm": use_qk_l2norm,
         "beta_sigmoid": beta_sigmoid, "allow_neg_eigval": allow_neg_eigval, "state_v_first": state_v_first,
         "has_step_states": has_step_states, "wide_kv": wide_kv, "warps_per_cta": warps_per_cta,
         "tokens_per_round": tokens_per_round, "min_blocks_per_sm": min_blocks_per_sm, "kv_tma": kv_tma,
         "kv_cols": kv_cols, "arch": arch}
    )  # fmt: skip
    return compiled_kernel(key, lambda: kernel_attr(__name__, "_build")(key))


def kda_decode_sm90(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    state: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    gate: str,
    lower_bound: float | None,
    use_qk_l2norm: bool,
    beta_sigmoid: bool,
    allow_neg_eigval: bool,
    state_v_first: bool,
    step_states: torch.Tensor | None = None,
) -> None:
    """One KDA decode step (T tokens per sequence) against an fp32 state pool, on SM90.

    Inputs are validated by the caller; this function only picks the compiled variant and launches it
    (a dict lookup and one TVM-FFI call, on the current torch stream). TVM-FFI still checks dtypes, ranks,
    matching sizes, contiguity of the inner dims and 16-byte alignment, and raises on a mismatch.

    Args:
        q, k: ``[N, T, H, K]`` bf16 or fp16, contiguous, 16-byte aligned. ``K`` in {64, 128}.
        v: ``[N, T, HV, V]``, q's dtype, contiguous; ``HV % H == 0`` (GVA); ``V % 8 == 0`` for K=128,
            ``V % 16 == 0`` for K=64.
        g: ``[N, T, HV, K]`` bf16 or fp32: raw gate logits for ``gate in ("softplus", "lower_bound")``,
            log-space decay for ``gate == "none"``.
        beta: ``[N, T, HV]`` fp32, bf16 or fp16: raw logits when ``beta_sigmoid`` (``2 * sigmoid`` with
            ``allow_neg_eigval``, which is ignored without ``beta_sigmoid``, as in FLA), else used as is.
        A_log: ``[HV]`` fp32; required by ``softplus``, optional for ``lower_bound``, ignored for ``none``.
        dt_bias: ``[HV * K]`` fp32 or None, added to g before the gate activation (ignored for ``none``).
        state: fp32 pool ``[P, HV, K, V]`` (``[P, HV, V, K]`` if ``state_v_first``), updated in place unless
            ``step_states`` is given. Dims 1.. contiguous; dim 0 may have any stride that is a multiple of 4.
        indices: ``[N]`` int32 pool rows. A negative index is a padded slot: the pool and ``step_states``
            are not touched and its output rows are **zeroed**.
        out: ``[N, T, HV, V]`` in q's dtype, written.
        scale: multiplies q (after the l2norm).
        gate: ``"softplus"``: ``g = -exp(A_log) * softplus(g + dt_bias)`` (softplus is the identity above
            20, as in torch); ``"lower_bound"``: ``g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``
            (no ``exp(A_log)`` factor when A_log is None); ``"none"``: g used as given.
        lower_bound: the bound for ``gate == "lower_bound"`` (negative), else unused.
        use_qk_l2norm: ``x / sqrt(sum(x^2) + 1e-6)`` on q and k per token and head, before ``scale``.
        step_states: optional ``[N, T, HV, K, V]`` (``[N, T, HV, V, K]``) fp32, contiguous: when given, the
            state after every token is written there and the pool is left untouched.
    """
    if q.shape[0] == 0:  # an empty grid is a launch error
        return
    launch = kda_decode_launcher(
        io_dtype=q.dtype, g_dtype=g.dtype, beta_dtype=beta.dtype, K=q.shape[-1], V=v.shape[-1], gate=gate,
        has_a_log=A_log is not None, has_dt_bias=dt_bias is not None, use_qk_l2norm=use_qk_l2norm,
        beta_sigmoid=beta_sigmoid, allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
        has_step_states=step_states is not None, tokens=q.shape[1], states=q.shape[0] * v.shape[2],
    )  # fmt: skip
    launch(q, k, v, g, beta, A_log, dt_bias, state, indices, out, step_states, scale, lower_bound)


def kda_decode_launcher(
    *, gate: str, has_a_log: bool, has_dt_bias: bool, wide_kv: bool | None = None, tokens: int | None = None,
    states: int | None = None, **flags,
):  # fmt: skip
    """The compiled variant for these flags (keywords as :func:`kda_decode_variant`; ``wide_kv`` None:
    ``WIDE_KV_DEFAULT`` for [K, V] pools with K=128; ``tokens``: the calls' T, when known, for the T=1 variants
    ``KV_COLS``, ``KV_TMA_DEFAULT`` and ``SINGLE_TOKEN_CTA``, tried in that order, and ``MULTI_TOKEN_KV_COLS`` /
    ``MULTI_TOKEN_VK_COLS`` for 1 < T <= their ``_MAX_TOKENS`` on [K, V] / [V, K] pools; ``states``: the calls'
    N x HV, when known: ``KV_COLS`` takes calls of at least ``KV_COLS_MIN_STATES``, or any when None), bound once:
    ``launch(q, k, v, g, beta, A_log, dt_bias, state, indices, out, step_states, scale, lower_bound)`` (arguments as
    :func:`kda_decode_sm90`, ``N >= 1``)."""
    gated = gate != "none"  # the ungated variant takes no A_log / dt_bias
    kv_pool_128 = not flags["state_v_first"] and flags["K"] == 128
    box = None  # kv_cols as (warps per CTA, token slots a warp, CTAs per SM)
    if (flags["K"] == 128 and not flags["has_step_states"] and tokens is not None
            and (flags["state_v_first"] or wide_kv is None)):  # fmt: skip
        multi, most = ((MULTI_TOKEN_VK_COLS, MULTI_TOKEN_VK_COLS_MAX_TOKENS) if flags["state_v_first"]
                       else (MULTI_TOKEN_KV_COLS, MULTI_TOKEN_KV_COLS_MAX_TOKENS))  # fmt: skip
        if (kv_pool_128 and tokens == 1 and KV_COLS and (states is None or states >= KV_COLS_MIN_STATES)
                and not {"min_blocks_per_sm", "warps_per_cta"} & set(flags)):  # fmt: skip
            box = (KV_COLS[0], 1, KV_COLS[1])
        elif (1 < tokens <= most and multi
              and not {"min_blocks_per_sm", "warps_per_cta", "tokens_per_round"} & set(flags)):  # fmt: skip
            box = multi
    if box and flags["V"] % (32 * box[0]) == 0:
        wide_kv = False
        flags.update(kv_cols=True, warps_per_cta=box[0], tokens_per_round=box[1], min_blocks_per_sm=box[2])
    if (KV_TMA_DEFAULT and kv_pool_128 and tokens == 1 and wide_kv is None and flags["V"] % 32 == 0
            and not flags["has_step_states"] and "min_blocks_per_sm" not in flags
            and flags.get("warps_per_cta", 4) == 4):  # fmt: skip
        wide_kv = False
        flags.update(kv_tma=True, tokens_per_round=1, min_blocks_per_sm=KV_TMA_MIN_BLOCKS)
    if wide_kv is None:
        wide_kv = WIDE_KV_DEFAULT and kv_pool_128
    if tokens == 1 and SINGLE_TOKEN_CTA and not wide_kv and "min_blocks_per_sm" not in flags:
        warps, ctas = SINGLE_TOKEN_CTA
        flags.update(tokens_per_round=1, warps_per_cta=warps, min_blocks_per_sm=ctas)
    fn = kda_decode_variant(
        gate=gate, has_a_log=gated and has_a_log, has_dt_bias=gated and has_dt_bias, wide_kv=bool(wide_kv),
        arch=_ARCH, **flags,
    )  # fmt: skip

    def launch(q, k, v, g, beta, A_log, dt_bias, state, indices, out, step_states, scale, lower_bound):
        fn(q, k, v, g, beta, A_log if gated else None, dt_bias if gated else None, state, indices, out, step_states,
           scale, 0.0 if lower_bound is None else lower_bound)  # fmt: skip

    def bind(A_log, dt_bias, state, indices, scale, lower_bound):
        """``launch`` with all but the token tensors fixed: ``tokens(q, k, v, g, beta, out, step_states)``, for
        ``kda_decode_step``, whose N=1 call is host-bound: one Python frame and the argument shuffling less."""
        a_log, dtb = (A_log, dt_bias) if gated else (None, None)
        lb = 0.0 if lower_bound is None else lower_bound

        def tokens(q, k, v, g, beta, out, step_states):
            fn(q, k, v, g, beta, a_log, dtb, state, indices, out, step_states, scale, lb)

        return tokens

    launch.bind = bind
    return launch


_ARCH = (9, 0)
# [K, V] pools with K=128 take the wide lane tile (KdaDecodeSm90(wide_kv=True)): on the H200 (2026-11-30) it
# matched the narrow tile (tests/ops/test_kda_decode_kernel.py::test_wide_kv_matches) and ran N=64 in 180 us
# against 225 (3.0 against 2.4 TB/s; the narrow tile reads [K, V] rows in lone 32-byte pieces)
WIDE_KV_DEFAULT = True
# T=1 calls (not the wide tile or the TMA box): one token slot per warp instead of 8 (51 -> 6 KB of shared memory
# per 4-warp CTA), (warps per CTA, CTAs per SM); None: 4 warps, 16 per SM, 8 slots. 16 warps per SM hold at most
# 64 KB of state loads in flight, about what Little's law asks at ~1.5 us of loaded latency, and less on average; 20
# fit 96 registers. On the H200 (2026-12-01, speed report, [V, K] pool) 5 CTAs of 4 warps ran N=64 in 141 us against
# 153 for 4 CTAs (3.82 against 3.52 TB/s) and N=256 in 542 against 582; 6 CTAs (80 registers, 56 bytes spilled) only
# 149 / 574. The same 20 warps as CTAs of one warp (session 19, scripts/device/decode_cta_size.py, CUDA-graph replay)
# ran N=64 / 128 / 256 / 512 in 136.5-137.3 / 267.3-268.3 / 528.4-530.6 / 1053.9-1055.2 us against 140.0-140.4 /
# 273.2-275.3 / 539.4-544.1 / 1075.3-1081.8 (92.0-92.6 / 94.2-94.5 / 95.3-95.6 / 95.8-95.9% of copy): a CTA's
# registers are freed when its last warp ends, so with four warps each waits for the slowest of its CTA's state
# loads. 2 x 10 ran as 4 x 5; 1 x 21 (ptxas then allocates 88 registers) 6% slower; N=1 4.3 against 4.2 us.
# test_single_token_occupancy_matches saw identical bits for each.
SINGLE_TOKEN_CTA: tuple[int, int] | None = (1, 20)
# T=1 calls on [K, V] pools with K=128 (no step states) take KdaDecodeSm90(kv_tma=True): each CTA's [128, 32] state
# box by one TMA load and one TMA store, whole 128-byte row pieces, instead of the wide tile's 64-byte rows from
# registers. On the H200 (2026-12-01, speed report) N=64 140 us and N=256 536 us (4.0 TB/s) at 4 CTAs per SM, against
# 179 / 685 us for the wide tile; 5 CTAs per SM 143 / 550 us. test_kv_tma_matches passed.
KV_TMA_DEFAULT = True
KV_TMA_MIN_BLOCKS = 4
# T=1 calls on [K, V] pools with K=128 (no step states; K=64 not timed) of at least KV_COLS_MIN_STATES states
# (N x HV) take KdaDecodeSm90(kv_cols=True) with (warps per CTA, CTAs per SM), ahead of kv_tma: the [K, 32 W] box in
# shared memory, a state column a lane (76-78 registers, no spills; shared memory allows 3 CTAs of 4 warps, 6 of 2,
# 12 of 1). None: off. On the H200 (session 20, scripts/device/decode_cta_size.py --kv, CUDA-graph replay, HV=64,
# random pool rows) 2 x 6 ran N = 64 / 128 / 256 / 512 in 138.0 / 271.3 / 537.1 / 1069.8 us against kv_tma's 146.2 /
# 288.6 / 571.6 / 1140.1 (92.0 / 93.6 / 94.6 / 95.0% of copy against 86.9 / 88.0 / 88.9 / 89.1; the [V, K] default
# 136.5-137.3 at N=64), 4 x 3 1-2% behind it, 1 x 12 as kv_tma. Below ~1024 states kv_tma is faster (N = 1 / 2 / 4 /
# 8: 4.3 / 6.1 / 9.0 / 15.5 us against 5.6 / 7.1 / 10.1 / 16.9; N = 16: 40.0 against 37.9): with fewer boxes than a
# wave the column loops' serial K rows are the latency. test_kv_cols_matches passed (14 cases).
KV_COLS: tuple[int, int] | None = (2, 6)
KV_COLS_MIN_STATES = 1024
# T > 1 calls (MTP verify) up to MULTI_TOKEN_KV_COLS_MAX_TOKENS tokens on [K, V] pools with K=128 and no step states
# take kv_cols with (warps per CTA, token slots a warp, CTAs per SM) instead of the wide tile; None: off. On the H200
# (session 21, scripts/device/decode_cta_size.py --mtp --kv, CUDA-graph replay, N=64, HV=64) 2 x 1 x 6 ran T = 2 / 3
# / 4 / 5 / 6 / 8 in 143.9 / 178.2 / 223.2 / 269.5 / 316.9 / 415.0 us against the wide tile's 204.6 / 234.1 / 257.4 /
# 282.3 / 307.8 / 362.3 (2 x 2 x 6, 2 x 4 x 5 and 4 x 2 x 3 slower than 2 x 1 x 6 at T = 2 / 4 / 8): the column's
# shared-memory passes grow with T (2 reads and 1 write of the box a token), the wide tile's shuffles less. The
# same compiled variant as KV_COLS at T=1; test_kv_cols_tokens_match passed on the H200 (sessions 20, 21).
MULTI_TOKEN_KV_COLS: tuple[int, int, int] | None = (2, 1, 6)
MULTI_TOKEN_KV_COLS_MAX_TOKENS = 5
# The same for [V, K] pools (state_v_first, K=128): kv_cols on a box of pool rows (the lane's column of S is a row of
# the pool; 128-byte swizzled pieces read 16 bytes at a time, 88 registers, no spills at 2 x 6), instead of the
# 1-warp T > 1 default (268 us at N=64 T=4 in session 20, against 223 for kv_cols on [K, V] pools). Written in session
# 21 without a GPU: off until test_kv_cols_tokens_match[vk] passes and decode_cta_size.py --mtp times it.
MULTI_TOKEN_VK_COLS: tuple[int, int, int] | None = None
MULTI_TOKEN_VK_COLS_MAX_TOKENS = 5
