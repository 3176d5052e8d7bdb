"""KDA's planner: what runs for a call, decided from its shapes and flags and the GPU's tuning entry.

- ``chunk_kda``: whether cula's intra kernel or FLA's stages make the intra-chunk terms (``use_cula_intra``);
  whether a long single sequence runs in time segments, with the state/output kernel of one segment beside the
  intra kernel of the next (``time_segments``); whether long sequences with few heads are cut into segments whose
  recurrences run at once, exactly (``parallel_segments``). ``cula.kda.forward`` builds the launches.
- the decode kernels: which ``KdaDecodeSm90`` variant runs a call (``decode_variant``), and its bound launch
  (``kda_decode_launcher``).
- the training backward: the launch of FLA's stage-6 kernel (``KdaTuning.wy_dqkg_launch``, read by
  ``cula.kda.fla_backward``).

The numbers are in ``KDA_TUNING``, one ``KdaTuning`` per compute capability; tests change them with
``KDA_TUNING.override(...)``, never by patching module globals.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import torch

from cula import time_split
from cula.time_split import SplitPlan, SplitThresholds
from cula.tuning import TuningTable

__all__ = [
    "KDA_TUNING", "KdaTuning", "decode_variant", "kda_decode_launcher", "kda_decode_sm90", "parallel_segments",
    "gates_bounded", "intra_any_gate", "segment_bounds", "time_segments", "use_cula_intra",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class KdaTuning:
    """The numbers behind KDA's launch decisions on one GPU."""

    # chunk_kda, B=1 fixed-length calls of at least this many tokens run in time segments (None: never): the
    # state/output kernel holds one SM per value head for its whole run, so with HV at most half the SMs the intra
    # kernel of segment i + 1 runs on the idle ones while the recurrence works through segment i
    overlap_state_min_tokens: int | None = 4096
    # segments of about this many tokens, 2 to max_segments of them (even ones when segment_growth is None) ...
    segment_tokens: int = 4096
    max_segments: int = 8
    # ... or shrinking towards the end: the last one about last_segment_tokens long, each earlier one
    # segment_growth times the next. The last segment's recurrence runs alone, so its length is idle time on the
    # other SMs, and each recurrence should end before the next (shorter) segment's intra kernel does.
    last_segment_tokens: int = 1024
    segment_growth: int | None = 3

    # Decode. [K, V] pools with K=128 take the wide lane tile (the narrow one reads [K, V] rows in lone 32-byte
    # pieces).
    wide_kv: bool = True
    # T=1 calls (not the wide tile or a TMA box): (warps per CTA, CTAs per SM) with one token slot a warp; None:
    # 4 warps, 16 per SM, 8 slots. One-warp CTAs free their registers as soon as their own loads are done.
    single_token_cta: tuple[int, int] | None = (1, 20)
    # T=1 calls on [K, V] pools with K=128 without step states: each CTA's [128, 32] state box by one TMA load and
    # store (whole 128-byte row pieces), at kv_tma_min_blocks CTAs per SM
    kv_tma: bool = True
    kv_tma_min_blocks: int = 4
    # ... and from kv_cols_min_states states (N x HV) on, ahead of kv_tma: the [K, 32 W] box in shared memory with
    # a state column a lane, (warps per CTA, CTAs per SM); below that kv_tma wins (fewer boxes than a wave leave
    # the column loops' serial K rows as the latency). None: off.
    kv_cols: tuple[int, int] | None = (2, 6)
    kv_cols_min_states: int = 1024
    # MTP verify calls of 2 .. multi_token_max_tokens tokens on [K, V] pools with K=128 and no step states:
    # kv_cols with (warps per CTA, token slots a warp, CTAs per SM) instead of the wide tile (its shared-memory
    # passes grow with T, the wide tile's shuffles less, hence the cap). None: off.
    multi_token_kv_cols: tuple[int, int, int] | None = (2, 1, 6)
    multi_token_max_tokens: int = 5
    # ... and on [V, K] pools with K=128 (the narrow tile): (token slots a warp, CTAs per SM) instead of 8 slots at
    # the default occupancy: a warp's one slot walks the tokens in order, and the freed shared memory holds more CTAs
    # whose loads overlap. None: off.
    multi_token_vk: tuple[int, int] | None = None
    # [V, K] pools with K=128 (Gated DeltaNet's serving layout) take the wide lane tile for calls of at least this
    # many tokens a sequence: 16 V rows a warp instead of 8, so each token's preparation (q / k norms, the gate)
    # is made by half as many warps a head, which an MTP verify of several tokens pays once per token; None: never
    wide_vk_min_tokens: int | None = None

    # training: (BK, BV, warps, stages) of FLA's stage-6 backward kernel (chunk_kda_bwd_wy_dqkg_fused) for
    # K = V = 128; None: FLA's autotuned choice, which on Hopper stops at 4 warps and spills
    wy_dqkg_launch: tuple[int, int, int, int] | None = (64, 64, 8, 1)
    # training: stages 4 and 5 of FLA's backward (chunk_kda_bwd_dAv and chunk_gated_delta_rule_bwd_dhu: dv and the
    # state-gradient recurrence) in one launch of cula's kernel (cula.ops.kda.sm90.bwd_dhu), where the forward's
    # intra kernel ran (its Aqk is zero above the diagonal) and the call's (sequence, value head) lanes are within
    # (fewest, most): one CTA a lane walks the chunks in order with stage 4's GEMMs on that chain, so with fewer
    # lanes than SMs FLA's two kernels (stage 4 parallel over chunks, stage 5 two CTAs a lane) win. None: FLA's
    bwd_dv_dhu_lanes: tuple[int, int] | None = None
    # training: stage 7 (chunk_kda_bwd_intra, the gradients through the intra-chunk scores) on cula's kernel
    # (cula.ops.kda.sm90.bwd_intra) where the forward's intra kernel ran
    bwd_intra: bool = False
    # ... with stage 8 (dg's reverse chunk-local cumsum) on chip in that kernel instead of FLA's chunk_local_cumsum
    bwd_intra_cumsum: bool = False
    # ... and with it stage 9 (kda_gate_bwd of the lower-bound gate) on chip too
    bwd_intra_gate: bool = False
    # ... the softplus gate's kda_gate_bwd on chip too (the fused gate without lower_bound)
    bwd_intra_softplus_gate: bool = False
    # ... with FLA's l2norm_bwd of dq and dk on chip (no GVA: the value heads' dq / dk are summed before it)
    bwd_intra_l2norm: bool = False
    # training: no l2norm_fwd before the backward (FLA's two launches): the recompute's intra kernel writes each q / k
    # row's 1 / norm and stages 6 and 7 normalise the raw rows as they read them, where the recompute runs on the
    # intra kernel (bwd_recompute_intra), stage 6 on cula's kernel (bwd_wy_dqkg) and stage 7 on cula's with the L2
    # norm's backward (bwd_intra_l2norm: no GVA)
    bwd_norm_on_load: bool = False
    # training: the recompute prefix's h and v_new (FLA's chunk_gated_delta_rule_fwd_h) on cula's states kernel
    # (cula.ops.kda.sm90.delta_h_states: the stores through shared memory and TMA, off the chain), where the recompute
    # runs on the intra kernel (bwd_recompute_intra)
    bwd_recompute_states: bool = False
    # training: the backward's recompute of w, u, qg, kg and the gate cumsum (FLA's kda_gate_chunk_cumsum and
    # recompute_w_u_fwd) on cula's intra kernel where the forward's ran, then FLA's chunk_kda_bwd without recompute
    bwd_recompute_intra: bool = False
    # training: stage 6 (chunk_kda_bwd_wy_dqkg_fused, the gradients through the state terms and the WY form) on
    # cula's kernel (cula.ops.kda.sm90.bwd_wy_dqkg) instead of FLA's at wy_dqkg_launch
    bwd_wy_dqkg: bool = False

    # chunk_kda: cula's intra kernel (and in training stage 7's) also for gates no bound is known of (a log-space
    # gate without safe_gate, the fused softplus gate, lower_bound < -5), in their any_gate variants: a tile whose
    # gates break the anchored factoring's bound makes its diagonal score blocks element by element; else FLA's
    # intra stages run for them
    intra_any_gate: bool = False

    # chunk_kda: when and how long sequences with few heads are cut into segments whose recurrences run at once
    # (exact: cula.kda.forward's parallel segments); None: never
    time_split: SplitThresholds | None = None
    # ... and the output pass of a cut call over each segment's two halves (cula.kda.forward's parallel segments):
    # twice its CTAs, the second half started from the summary's mid-segment E and R, no more chain steps
    time_split_halves: bool = False

    # chunk_kda's return_intermediate_states (FLA's every-chunk start states h, for an inference engine's prefix
    # cache) on cula's kernels where its intra kernel runs: the state/output kernel writes h beside o, the recurrence
    # in one piece; else FLA's kernels
    intermediate_states: bool = False


# H100 and H200 share sm_90; the numbers were measured on the H200. Other GPUs run no cula kernel yet.
# time_split from benchmarks/results/nvidia-h200/kda_prefill_time_parallel.md: every measured call with fewer than
# about 26 (sequence, head) lanes gains from 16K tokens on (4 heads 1.8-4.4x, 8 heads 1.8-2.5x, 16 heads 1.3-1.4x);
# 2 x 64K at 16 heads (32 lanes) gains 7%, left whole. The best segment gives about half a (segment, head) item per
# SM. The segment summary runs two CTAs per (segment, head), one an SM: whole waves of it (17 segments at 4 heads
# would be 136 CTAs on 132 SMs, a second wave for 4 of them)
# bwd_intra: the stage-7 kernel took 3.89 ms against FLA's 6.84 in a B=2 T=16K training step; bwd_wy_dqkg and
# bwd_intra_cumsum (stages 6 and 8 on cula's kernels) took the step from 4.09 to 3.11 ms at B1-T4096 and from 3.61
# to 3.30 ms at varlen-N20-T4096 (bench_kda_training --quick, kda_training_bwd_wy_dqkg_bwd_intra_bwd_intra_cumsum_
# subset.md: 1.45x and 1.54x FLA). bwd_intra_gate, bwd_intra_l2norm and
# bwd_recompute_intra together took the B1-T4096 step's CUDA-graph replay from 2.43 to 2.29 ms (FLA 4.25) and the
# eager one from 3.07 to 2.67 (kda_training_also_fused_also_recompute_also_all_subset.md); in a B=2 T=16K step the
# gate and norm backward on chip saved 0.68 ms of kernel time. bwd_dv_dhu_lanes (kda_training_also_dvdhu.md, whose
# dvdhu column has stages 4 and 5 in one launch at every lane count): at 64 lanes FLA's two kernels win (B1-T4096 2.38
# against 2.32 ms in graph replay); from 128 on the one launch wins or ties (B16-T2048 H32, 512 lanes: 8.27 against
# 8.45). Packed calls of 640-2,048 lanes gained 1-3% eager, inside the spread of host-bound eager steps, and their
# graph replays run FLA's graph mode (FLA's two stages): left to FLA until measured steadily
# bwd_norm_on_load: the B=2 T=16K step's graph replay 18.84 against 18.91 ms and its peak 12,860 against 13,890 MiB
# (H100, bench_kda_training --also, one run; the H200's B1-T4096 / varlen-N20 replays 1-3.5% faster).
# bwd_recompute_states stays off: under 1% in the same run and an unexplained initcheck finding
# intra_any_gate: with a log-space gate and no safe_gate (FLA's default call) the forward took 0.109 / 1.270 / 0.390 /
# 1.350 ms against 0.727 / 3.969 / 0.950 / 3.429 on FLA's intra stages (kda_prefill_log_anygate_subset.md against
# kda_prefill_log_subset.md: 4.48x FLA instead of 1.15x), and the training step's graph replay 2.22 against 4.54 ms
# at B1-T4096 (kda_training_log_also_any_subset.md, FLA 5.43), its peak memory 1,676 against 1,937 MiB. The softplus
# gate takes the same variant, unmeasured apart: its strong heads' tiles run the exact path
# multi_token_vk, measured on an H100 (kernel_report.py gdn-decode, T = 4 MTP verify on [V, K] pools, N = 64): Gated
# DeltaNet's 16 / 32 heads 131 against 159 us (the wide tile 140), KDA's 64 heads 274 against 324 (wide 280); T = 1
# calls keep single_token_cta (the 1-slot, 6-CTA shape took 197 against 187 us at N = 128)
_H200 = KdaTuning(multi_token_vk=(1, 6), bwd_dv_dhu_lanes=(128, 512), bwd_intra=True, bwd_intra_cumsum=True,
                  bwd_intra_gate=True, bwd_intra_l2norm=True, bwd_norm_on_load=True, bwd_recompute_intra=True,
                  bwd_wy_dqkg=True, intra_any_gate=True, intermediate_states=True,
                  time_split=SplitThresholds(items_per_sm=0.5, busy_items_per_sm=0.2, min_segment=2048,
                                             min_seq_len=16384, wave_ctas=2))
KDA_TUNING: TuningTable[KdaTuning] = TuningTable("kda", {(9, 0): _H200}, fallback=KdaTuning())

# ------------------------------------------------------------------------------------------------------- chunk_kda

INTRA_ENV = "CULA_KDA_INTRA"
# cula's intra kernel is exact while no channel decays by more than 69 nats over 8 steps; FLA's safe-gate range
# (lower_bound >= -5, at most 40 nats) is inside that, anything below it is left to FLA's stage
_INTRA_MIN_LOWER_BOUND = -5.0


def gate_over_k(g: torch.Tensor | None, dt_bias: torch.Tensor | None,
                K: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """One gate per token and head ``[..., HV]`` (Gated DeltaNet's) and the fused gate's ``dt_bias`` ``[HV]`` as KDA's
    per-channel ones (``[..., HV, K]`` contiguous, ``[HV * K]``): the same recurrence for the kernels and stages that
    take the gate per channel. None stays None."""
    gk = None if g is None else g.unsqueeze(-1).expand(*g.shape, K).contiguous()
    return gk, None if dt_bias is None else dt_bias.unsqueeze(-1).expand(dt_bias.shape[0], K).reshape(-1)


def use_cula_intra(q, v, safe_gate: bool, use_gate_in_kernel: bool, lower_bound: float | None,
                   scalar_gate: bool = False) -> bool:  # fmt: skip
    """Whether cula's intra kernel (gate, cumsum, L2 norm, beta sigmoid, scores, inverse and w/u in one launch)
    makes the intra-chunk terms, instead of FLA's preprocessing + cumsum + intra stages. It is faster at every
    shape; it runs where it is exact: bf16/fp16, K = V = 128, and gates of at least ``-5`` a step
    (``gates_bounded``), or any gate with one gate per token and head (``scalar_gate``, Gated DeltaNet's), or any
    gate at all where the tuning entry says so (``KdaTuning.intra_any_gate``: the kernel's any_gate variant,
    ``intra_any_gate``). ``CULA_KDA_INTRA=0`` (read per call) sends every call to FLA's stages."""
    mode = os.environ.get(INTRA_ENV, "auto")
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"{INTRA_ENV} must be 'auto', '0' or '1', got {mode!r}")
    if mode == "0":
        return False
    if q.shape[-1] != 128 or v.shape[-1] != 128 or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if scalar_gate or gates_bounded(safe_gate, use_gate_in_kernel, lower_bound):
        return True
    return KDA_TUNING.for_device(q.device).intra_any_gate


def gates_bounded(safe_gate: bool, use_gate_in_kernel: bool, lower_bound: float | None) -> bool:
    """Whether a call's per-channel gates are known to be at least ``-5`` a step, where the intra kernel's anchored
    factoring (and the stage-7 kernel's, the same) is exact: ``safe_gate`` gates, or the fused lower-bound gate
    (``lower_bound * sigmoid(...)`` lies in ``[lower_bound, 0)`` whatever ``safe_gate`` says), with
    ``lower_bound >= -5`` when given; never the fused softplus gate, which has no lower bound."""
    if not (safe_gate or (use_gate_in_kernel and lower_bound is not None)):
        return False
    if lower_bound is not None and lower_bound < _INTRA_MIN_LOWER_BOUND:
        return False
    return not (use_gate_in_kernel and lower_bound is None)


def intra_any_gate(safe_gate: bool, use_gate_in_kernel: bool, lower_bound: float | None,
                   scalar_gate: bool = False) -> bool:  # fmt: skip
    """Whether a call that ``use_cula_intra`` gives the intra kernel needs its any_gate variant: per-channel gates
    not known to be bounded (``gates_bounded``)."""
    return not scalar_gate and not gates_bounded(safe_gate, use_gate_in_kernel, lower_bound)


def time_segments(B: int, T: int, HV: int, device: torch.device) -> list[tuple[int, int]] | None:
    """The ``[t0, t1)`` segments a fixed-length call runs in (``KdaTuning.overlap_state_min_tokens``), or None
    for one launch of both kernels."""
    tuning = KDA_TUNING.for_device(device)
    least = tuning.overlap_state_min_tokens
    if least is None or B != 1 or T < least:
        return None
    if 2 * HV > time_split.sm_count(device.index or 0):
        return None  # the recurrence alone fills half the GPU: nothing idles for the next intra kernel
    return segment_bounds(T, tuning)


def parallel_segments(B: int, T: int, HV: int, cu_seqlens, cu_seqlens_cpu, device: torch.device,
                      thresholds: SplitThresholds | None | str = "kda") -> SplitPlan | None:  # fmt: skip
    """How a call's sequences are cut for the exact time-parallel recurrence (``KdaTuning.time_split``, or the
    ``thresholds`` another op's entry gives: Gated DeltaNet's), or None to run them whole. From the shapes or
    ``cu_seqlens_cpu`` only (never a read of ``cu_seqlens``: no sync), so the same call is always cut the same way
    and can be captured in a CUDA graph (a packed call's segments then made on the device at each replay:
    ``cula.kda.forward.parallel_segment_states``)."""
    if thresholds == "kda":
        thresholds = KDA_TUNING.for_device(device).time_split
    return time_split.plan_call(thresholds, B, T, HV, cu_seqlens, cu_seqlens_cpu, device)


def segment_bounds(T: int, tuning: KdaTuning) -> list[tuple[int, int]]:
    """[t0, t1) token ranges covering T, each a multiple of 64 long but the last, 2 to ``max_segments`` of them:
    even ones, or with ``segment_growth`` ones shrinking geometrically towards the end."""
    last, whole, most = tuning.last_segment_tokens, T // 64 * 64, tuning.max_segments
    if tuning.segment_growth is None or whole <= last:
        n = max(2, min(most, T // tuning.segment_tokens))
        step = -(-T // n // 64) * 64
        return [(t0, min(t0 + step, T)) for t0 in range(0, T, step)]
    sizes, rest, size = [], whole, last  # from the end; T's ragged remainder joins the last segment
    while len(sizes) < most - 1 and rest > size:
        sizes.append(size)
        rest -= size
        size *= tuning.segment_growth
    if rest < last and len(sizes) > 1:  # no front segment shorter than the last one
        rest += sizes.pop()
    sizes = [rest, *reversed(sizes)]
    sizes[-1] += T - whole
    ends = list(itertools.accumulate(sizes))
    return list(zip([0, *ends[:-1]], ends))


# ---------------------------------------------------------------------------------------------------------- decode

_SWEEP_FLAGS = frozenset(("min_blocks_per_sm", "warps_per_cta", "tokens_per_round"))


def decode_variant(
    *, gate: str, has_a_log: bool, has_dt_bias: bool, wide_kv: bool | None = None, tokens: int | None = None,
    states: int | None = None, tuning: KdaTuning | None = None, **flags,
) -> dict:  # fmt: skip
    """The keywords of ``cula.ops.kda.sm90.decode.compiled_variant`` for a call.

    ``flags`` are that function's other keywords (dtypes, K, V, the math flags; a sweep may fix
    ``warps_per_cta`` / ``tokens_per_round`` / ``min_blocks_per_sm`` itself). ``wide_kv`` None: the tuning's
    choice (``wide_kv`` for [K, V] pools with K=128, ``wide_vk_min_tokens`` for [V, K] ones). ``tokens`` (the
    calls' T) and ``states`` (N x HV), when known, pick the T=1 variants (``kv_cols``, then ``kv_tma``, then
    ``single_token_cta``) and the MTP shapes (``multi_token_kv_cols``, ``multi_token_vk``)."""
    t = tuning or KDA_TUNING.get((9, 0))
    swept = _SWEEP_FLAGS & set(flags)
    kv_pool_128 = not flags["state_v_first"] and flags["K"] == 128
    box = None  # kv_cols as (warps per CTA, token slots a warp, CTAs per SM)
    if kv_pool_128 and not flags["has_step_states"] and tokens is not None and wide_kv is None:
        if (tokens == 1 and t.kv_cols and (states is None or states >= t.kv_cols_min_states)
                and not swept - {"tokens_per_round"}):  # fmt: skip
            box = (t.kv_cols[0], 1, t.kv_cols[1])
        elif 1 < tokens <= t.multi_token_max_tokens and t.multi_token_kv_cols and not swept:
            box = t.multi_token_kv_cols
    if box and flags["V"] % (32 * box[0]) == 0:
        wide_kv = False
        flags.update(kv_cols=True, warps_per_cta=box[0], tokens_per_round=box[1], min_blocks_per_sm=box[2])
    if (t.multi_token_vk and flags["state_v_first"] and flags["K"] == 128 and not flags["has_step_states"]
            and tokens is not None and 1 < tokens <= t.multi_token_max_tokens and wide_kv is None
            and not swept):  # fmt: skip
        wide_kv = False
        flags.update(tokens_per_round=t.multi_token_vk[0], min_blocks_per_sm=t.multi_token_vk[1])
    if (t.kv_tma and kv_pool_128 and tokens == 1 and wide_kv is None and flags["V"] % 32 == 0
            and not flags["has_step_states"] and "min_blocks_per_sm" not in flags
            and flags.get("warps_per_cta", 4) == 4):  # fmt: skip
        wide_kv = False
        flags.update(kv_tma=True, tokens_per_round=1, min_blocks_per_sm=t.kv_tma_min_blocks)
    if wide_kv is None:
        vk_wide = (flags["state_v_first"] and flags["K"] == 128 and t.wide_vk_min_tokens is not None
                   and tokens is not None and tokens >= t.wide_vk_min_tokens)  # fmt: skip
        # (the wide tile takes V in slices of 16)
        wide_kv = ((t.wide_kv and kv_pool_128) or vk_wide) and flags["V"] % 16 == 0
    if tokens == 1 and t.single_token_cta and not wide_kv and "min_blocks_per_sm" not in flags:
        warps, ctas = t.single_token_cta
        flags.update(tokens_per_round=1, warps_per_cta=warps, min_blocks_per_sm=ctas)
    gated = gate != "none"  # the ungated variant takes no A_log / dt_bias
    return dict(
        gate=gate, has_a_log=gated and has_a_log, has_dt_bias=gated and has_dt_bias, wide_kv=bool(wide_kv),
        arch=(9, 0), **flags,
    )  # fmt: skip


def kda_decode_launcher(*, gate: str, tuning: KdaTuning | None = None, **flags):
    """The compiled variant ``decode_variant`` picks, bound once: ``launch(q, k, v, g, beta, A_log, dt_bias, state,
    indices, out, step_states, scale, lower_bound)`` (arguments as :func:`kda_decode_sm90`, ``N >= 1``), and
    ``launch.bind(A_log, dt_bias, state, indices, scale, lower_bound)``, the same with all but the token tensors
    fixed, for ``kda_decode_step``, whose N=1 call is host-bound."""
    from cula.ops.kda.sm90 import decode

    fn = decode.compiled_variant(**decode_variant(gate=gate, tuning=tuning, **flags))
    gated = gate != "none"

    def launch(q, k, v, g, beta, A_log, dt_bias, state, indices, out, step_states, scale, lower_bound):
        fn(q, k, v, g, beta, A_log if gated else None, dt_bias if gated else None, state, indices, out, step_states,
           scale, 0.0 if lower_bound is None else lower_bound)  # fmt: skip

    def bind(A_log, dt_bias, state, indices, scale, lower_bound):
        a_log, dtb = (A_log, dt_bias) if gated else (None, None)
        lb = 0.0 if lower_bound is None else lower_bound

        def tokens(q, k, v, g, beta, out, step_states):
            fn(q, k, v, g, beta, a_log, dtb, state, indices, out, step_states, scale, lb)

        tokens.checks_arguments = True  # the compiled entry's own checks (cula.backends.StepPlans)
        return tokens

    launch.bind = bind
    return launch


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
    """One KDA decode step (T tokens per sequence) against an fp32 state pool, on SM90, through the variant the
    planner picks. Inputs are validated by the caller (``cula.kda.decode``); TVM-FFI still checks dtypes, ranks,
    matching sizes, contiguity of the inner dims and 16-byte alignment, and raises on a mismatch.

    Args:
        q, k: ``[N, T, H, K]`` bf16 or fp16, contiguous, 16-byte aligned. ``K`` in {64, 128}.
        v: ``[N, T, HV, V]``, q's dtype, contiguous; ``HV % H == 0`` (GVA); ``V % 8 == 0`` for K=128,
            ``V % 16 == 0`` for K=64.
        g: ``[N, T, HV, K]`` bf16 or fp32: raw gate logits for ``gate in ("softplus", "lower_bound")``,
            log-space decay for ``gate == "none"``; or ``[N, T, HV]``, one gate per token and value head.
        beta: ``[N, T, HV]`` fp32, bf16 or fp16: raw logits when ``beta_sigmoid`` (``2 * sigmoid`` with
            ``allow_neg_eigval``, which is ignored without ``beta_sigmoid``, as in FLA), else used as is.
        A_log: ``[HV]`` fp32; required by ``softplus``, optional for ``lower_bound``, ignored for ``none``.
        dt_bias: ``[HV * K]`` (``[HV]`` with a per-head g) fp32 or None, added to g before the gate activation
            (ignored for ``none``).
        state: fp32 pool ``[P, HV, K, V]`` (``[P, HV, V, K]`` if ``state_v_first``), updated in place unless
            ``step_states`` is given. Dims 1.. contiguous; dim 0 may have any stride that is a multiple of 4.
        indices: ``[N]`` int32 pool rows. A negative index (or one past the pool) is a padded slot: the pool and
            ``step_states`` are not touched and its output rows are **zeroed**.
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
        tuning=KDA_TUNING.for_device(q.device), per_head_gate=g.dim() == 3,
    )  # fmt: skip
    launch(q, k, v, g, beta, A_log, dt_bias, state, indices, out, step_states, scale, lower_bound)
