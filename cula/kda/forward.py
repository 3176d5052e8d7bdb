"""KDA's chunk forward on SM90 as launches: the intra-chunk stage, then cula's fused state/output kernel.

Stages (FLA 0.6.0 ``fla/ops/kda/chunk.py`` + ``chunk_fwd.py::chunk_kda_fwd`` are the reference):

0. Optional preprocessing, as FLA's ``ChunkKDAFunction``: ``l2norm_fwd`` on q and k, ``fused_beta_sigmoid`` on
   beta (FLA Triton).
1. ``chunk_local_cumsum(g, scale=1/ln 2)`` (or ``kda_gate_chunk_cumsum`` with the fused gate): chunk-local
   cumsum of the log gate, base 2, fp32 (FLA Triton).
2. ``chunk_kda_fwd_intra(..., disable_recompute=True)``: w, u, qg, kg, Aqk (FLA Triton); ``disable_recompute``
   only makes it also return ``qg = q exp2(g)``, which our kernel reads instead of q and the full g tile.
3. ``chunk_kda_delta_h_fwd_o_sm90``: the state recurrence and the output in one CuTe DSL kernel, in place of
   FLA's ``chunk_gated_delta_rule_fwd_h`` + ``chunk_gla_fwd_o_gk``; no per-chunk states or v_new in memory.

Where ``cula.kda.plan.use_cula_intra`` says so (gates bounded below by -5: ``safe_gate`` or the fused lower-bound
gate), stages 0-2 are instead one CuTe DSL launch, ``chunk_kda_intra_sm90``, with the q/k L2 norm and the beta
sigmoid fused. ``chunk_kda_fwd_sm90`` is the general path; ``prepare_chunk_kda_fwd_sm90`` binds a repeated call's
launch once: both kernels from one host call (``fwd_launch``), packed sequences through the same, or a long single
sequence in time segments (``cula.kda.plan.time_segments``).

Importing fla here is deliberate: this module orchestrates FLA's Triton stages where cula's do not run.
"""

from __future__ import annotations

import collections

import torch

from cula._validate import is_row_major
from cula.backends import capturing
from cula.kda.plan import (
    KDA_TUNING, gate_over_k, intra_any_gate, parallel_segments, time_segments, use_cula_intra,
)  # fmt: skip
from cula.ops import device_tables
from cula.ops._host import ROW_FACTORS, dsl_name, gate_kind, placeholder
from cula.ops.kda.sm90 import intra
from cula.ops.kda.sm90.delta_h_fwd_o import chunk_kda_delta_h_fwd_o_sm90
from cula.ops.kda.sm90.segment_chain import chunk_kda_segment_chain_sm90
from cula.ops.kda.sm90.segment_summary import chunk_kda_segment_summary_sm90
from cula.time_split import SplitThresholds, on_device, segment_tables

__all__ = ["chunk_kda_fwd_sm90"]

RCP_LN2 = 1.4426950408889634  # 1 / ln(2): FLA keeps the gate cumsum in base 2


def chunk_kda_fwd_sm90(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_size: int = 64,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    safe_gate: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    keep_scores: bool = False,
    keep_prefix: bool = False,
    keep_states: bool = False,
    use_graph: bool = False,
    row_factors: bool = False,
    wy_in_recurrence: bool = False,
    time_split: SplitThresholds | None | str = "kda",
) -> tuple:
    """KDA forward (FLA's ``ChunkKDAFunction.forward``; with ``keep_scores`` also the intra stage's Aqk and Akk
    that FLA's forward saves for its backward).

    Args:
        q, k: ``[B, T, H, K]`` bf16 (or fp16); L2-normalised here with ``use_qk_l2norm_in_kernel``.
        v: ``[B, T, HV, V]`` same dtype; HV is a multiple of H (GVA).
        g: ``[B, T, HV, K]`` log-space decay (natural log, <= 0), any float dtype; raw gate logits when
            ``use_gate_in_kernel`` (the gate activation is then fused with the chunk cumsum, as in FLA). ``[B, T,
            HV]``: one gate per token and head (Gated DeltaNet; dt_bias ``[HV]``), on cula's intra kernel for any
            gate, else repeated over K for FLA's stages.
        beta: ``[B, T, HV]`` post-sigmoid, or logits with ``use_beta_sigmoid_in_kernel`` (``2 sigmoid`` with
            ``allow_neg_eigval``, which needs ``use_beta_sigmoid_in_kernel``).
        scale: query scale (FLA default ``K ** -0.5`` is the caller's job).
        initial_state: ``[N, HV, K, V]`` fp32 (``[N, HV, V, K]`` if ``state_v_first``) or None.
        output_final_state: return the final state (same layout, fp32).
        cu_seqlens: ``[N + 1]`` cumulative lengths (int32 or int64) with ``B == 1``, or None.
        cu_seqlens_cpu: optional host copy of ``cu_seqlens`` (saves FLA a device sync).
        chunk_size: must be 64.
        use_gate_in_kernel, A_log, dt_bias, lower_bound: FLA's fused gate (see ``cula.kda.chunk_kda``).
        safe_gate: gates are known to lie in ``[lower_bound, 0)`` (``lower_bound >= -5``); selects FLA's faster
            intra-chunk path, or cula's fused one (``CULA_KDA_INTRA``, see the module docstring).
        use_qk_l2norm_in_kernel: ``x / sqrt(sum x^2 + 1e-6)`` on each q and k row (FLA's ``l2norm_fwd``).
        use_beta_sigmoid_in_kernel, allow_neg_eigval: beta holds logits (see beta).
        use_graph: FLA's graph mode: the chunk indices of packed sequences are built on the device at the size the
            shapes bound, as while a CUDA graph captures, so a captured call holds for any boundaries.
        keep_scores: also return ``Aqk`` (``scale (q k^T o exp(g_t - g_s))``, ``s <= t`` in each chunk) and
            ``Akk`` (``(I + beta k k^T o exp(g_t - g_s))^-1``, unit lower-triangular), both ``[B, T, HV, 64]`` in
            q's dtype, as FLA 0.6.0's ``chunk_kda_fwd_intra`` returns them (cula's intra kernel writes Aqk's
            upper triangle as zeros).
        row_factors: with a per-head g (Gated DeltaNet) and no ``keep_scores``: the intra kernel writes per-token
            factors instead of qg, kg and g_cum, and the state/output kernel (and a time split's segment summary)
            applies them to the raw q and k (``GdnTuning.inference_row_factors``); ignored elsewhere, and for fp16
            with the L2 norm (GEMM4's operand ``v_new f_k`` carries the 1 / norm, up to 1000, past fp16's range
            where kg, at most 1 in size, stays inside it).
        wy_in_recurrence: with the factor rows: the intra kernel writes T diag(beta) instead of w and u, and the
            state/output kernel (and a time split's segment summary) makes v_new of it and the raw v and k
            (``GdnTuning.inference_wy_in_recurrence``).
        time_split: when to cut the call in time (``cula.kda.plan.parallel_segments``): ``"kda"``, the entry's
            ``KdaTuning.time_split``, or another op's thresholds (Gated DeltaNet's ``GdnTuning.time_split``).
        keep_prefix: with ``keep_scores``, also what FLA's backward would recompute before its first gradient
            stage: ``{"g": g_cum, "w", "u", "qg", "kg", "h", "v_new"}`` (g_cum fp32 with every row written, the rest
            in q's dtype; h and v_new as FLA's ``chunk_gated_delta_rule_fwd_h`` returns them), where cula's intra
            kernel runs (the recurrence then in one piece, not cut in time); None where FLA's intra stage does.
            With a chunk list built on the device (FLA's graph mode, a capture) ``h`` has the rows of FLA's
            fixed-size list (``prepare_chunk_indices_static``), whose real rows come first in the same order.
        keep_states: FLA's ``return_intermediate_states``: also every chunk's start state ``h`` (``[B, NT, HV, K,
            V]``, ``[..., V, K]`` with ``state_v_first``; packed ``[1, chunks, ...]`` in sequence order) in v's dtype,
            as FLA's ``chunk_gated_delta_rule_fwd_h`` writes it; the recurrence in one piece (not cut in time), the
            chunk list from the host (not FLA's graph mode).

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype, final_state fp32 or None;
        ``(o, final_state, Aqk, Akk)`` with ``keep_scores``, ``(o, final_state, Aqk, Akk, prefix)`` with
        ``keep_prefix`` too; ``(o, final_state, h)`` with ``keep_states``.
    """
    if keep_prefix and not keep_scores:
        raise ValueError("keep_prefix needs keep_scores")
    if keep_states and (keep_scores or use_graph):
        raise ValueError("keep_states is an inference call's (no keep_scores) with a host chunk list (no use_graph)")
    if chunk_size != 64:
        raise ValueError(f"chunk_size must be 64, got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"value heads ({HV}) must be a multiple of query/key heads ({H})")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (flatten the sequences), got {B}")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))

    final_state = None
    if output_final_state:
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        final_state = torch.empty(shape, dtype=torch.float32, device=q.device)
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32).contiguous()

    o = torch.empty_like(v)
    if T == 0:  # nothing to read; the state passes through
        if final_state is not None:
            final_state.copy_(initial_state if initial_state is not None else torch.zeros_like(final_state))
        if keep_states:  # no chunk, no state row
            return o, final_state, v.new_empty(B, 0, HV, V, K) if state_v_first else v.new_empty(B, 0, HV, K, V)
        if keep_scores:
            scores = (o, final_state, q.new_empty(B, 0, HV, 64), q.new_empty(B, 0, HV, 64))
            return (*scores, None) if keep_prefix else scores
        return o, final_state

    chunk_indices = cu32 = None
    device_list = cu_seqlens is not None and (use_graph or capturing(cu_seqlens))
    if device_list:
        chunk_indices = device_chunk_indices(cu_seqlens, chunk_rows_bound(T, N))
        cu32 = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    elif cu_seqlens is not None:
        # not FLA's prepare_chunk_indices: it memoises on the tensors' identity, so a cu_seqlens buffer rewritten
        # in place between calls (an engine's static input) would get the previous boundaries' chunks
        cu32, chunk_indices = host_boundaries(cu_seqlens, cu_seqlens_cpu, chunk_size)
    scalar_gate = g.dim() == 3
    cute_intra = use_cula_intra(q, v, safe_gate, use_gate_in_kernel, lower_bound, scalar_gate)
    if scalar_gate and not cute_intra:  # FLA's stages take the gate (and its bias) per channel
        g, dt_bias = gate_over_k(g, dt_bias, K)
    split = None
    if not (use_graph or keep_prefix or keep_states):
        split = parallel_segments(B, T, HV, cu_seqlens, cu_seqlens_cpu, q.device, time_split)
    # cula's intra kernel writes Aqk's upper triangle as zeros, FLA's leaves it
    states = dict(scale=scale, state_v_first=state_v_first, aqk_causal=cute_intra)
    if (row_factors and scalar_gate and cute_intra and not keep_scores and not keep_states
            and factor_rows_fit(q.dtype, use_qk_l2norm_in_kernel)):  # fmt: skip
        wy = {"wy_in_recurrence": True} if wy_in_recurrence else {}
        w, u, factors, Aqk = _intra_cute(
            q, k, v, g, beta, scale, cu32, chunk_indices, use_gate_in_kernel, A_log, dt_bias, lower_bound,
            use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, row_factors=True, **wy,
        )  # fmt: skip
        # the raw q and k of each value head's q / k head, made into qg and kg by the factors
        if split is None:
            chunk_kda_delta_h_fwd_o_sm90(w, u, k, q, factors, Aqk, o, initial_state, final_state, cu32, **states,
                                         row_factors=True, **wy)  # fmt: skip
        else:
            parallel_segment_states(split, w, u, k, q, factors, Aqk, o, initial_state, final_state, **states,
                                    halves=KDA_TUNING.for_device(q.device).time_split_halves, row_factors=True,
                                    cu_seqlens=cu32, **wy)  # fmt: skip
        return o, final_state
    if cute_intra:
        w, u, qg, kg, Aqk, g_cum, Akk = _intra_cute(
            q, k, v, g, beta, scale, cu32, chunk_indices, use_gate_in_kernel, A_log, dt_bias, lower_bound,
            use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, keep_akk=keep_scores,
            zero_kg=use_graph, full_g_cum=keep_prefix,
            any_gate=intra_any_gate(safe_gate, use_gate_in_kernel, lower_bound, scalar_gate),
        )  # fmt: skip
    else:
        w, u, qg, kg, Aqk, g_cum, Akk = _intra_fla(
            q, k, v, g, beta, scale, cu_seqlens, chunk_indices, chunk_size, use_gate_in_kernel, A_log, dt_bias,
            lower_bound, safe_gate, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        )  # fmt: skip
    # the recurrence in one piece, writing every chunk's state (and v_new, which the kernel writes beside it)
    if keep_states:
        kept = _state_outputs(u, cu32, chunk_indices)
        chunk_kda_delta_h_fwd_o_sm90(w, u, kg, qg, g_cum, Aqk, o, initial_state, final_state, cu32, **states,
                                     h=kept["h"], v_new=kept["v_new"], chunk_offsets=kept["offsets"])
        return o, final_state, kept["h"]
    if cute_intra and keep_prefix:
        kept = _state_outputs(u, cu32, chunk_indices, static_rows=device_list)
        chunk_kda_delta_h_fwd_o_sm90(w, u, kg, qg, g_cum, Aqk, o, initial_state, final_state, cu32, **states,
                                     h=kept["h"], v_new=kept["v_new"], chunk_offsets=kept.pop("offsets"))
        kept.update(g=g_cum, w=w, u=u, qg=qg, kg=kg)
        return o, final_state, Aqk, Akk, kept
    if split is None:
        chunk_kda_delta_h_fwd_o_sm90(w, u, kg, qg, g_cum, Aqk, o, initial_state, final_state, cu32, **states)
    else:
        parallel_segment_states(split, w, u, kg, qg, g_cum, Aqk, o, initial_state, final_state, **states,
                                halves=KDA_TUNING.for_device(q.device).time_split_halves, cu_seqlens=cu32)  # fmt: skip
    if keep_prefix:
        return o, final_state, Aqk, Akk, None
    if keep_scores:
        return o, final_state, Aqk, Akk
    return o, final_state


def factor_rows_fit(dtype: torch.dtype, use_qk_l2norm: bool) -> bool:
    """Whether a per-head-gate call may take the factor rows (``row_factors``): not fp16 with the L2 norm, where
    GEMM4's operand ``v_new f_k`` carries the 1 / norm (up to 1000) past fp16's range that kg, at most 1 in size,
    stays inside."""
    return not (dtype == torch.float16 and use_qk_l2norm)


def _state_outputs(u, cu32, chunk_indices, static_rows: bool = False) -> dict:
    """Room for the states kernel's ``h`` and ``v_new`` (the shapes FLA's ``chunk_gated_delta_rule_fwd_h`` returns)
    and, packed, each sequence's first chunk in ``h`` (on the device: no host read). ``static_rows``: ``h`` with
    as many chunk rows as FLA's graph-mode list has (``chunk_indices`` is then a bound of the real chunks, at most
    that many), the real ones first."""
    B, T, HV, V = u.shape
    if cu32 is None:
        NT, offsets = -(-T // 64), None
    else:
        NT, offsets = chunk_indices.shape[0], intra.chunk_offsets_i32(cu32)
        if static_rows:  # the nt_max cula.kda.backends._backward_chunks gives prepare_chunk_indices_static
            NT = max(NT, -(-T // 64) + cu32.shape[0] - 2)
    h = u.new_empty((B, NT, HV, V, V))  # K = V = 128: either state layout
    return dict(h=h, v_new=torch.empty_like(u), offsets=offsets)


def parallel_segment_states(
    plan, w, u, kg, qg, g_cum, Aqk, o, initial_state, final_state, *, scale, state_v_first, aqk_causal,
    halves=False, states_fn=chunk_kda_delta_h_fwd_o_sm90, summary_fn=chunk_kda_segment_summary_sm90,
    chain_fn=chunk_kda_segment_chain_sm90, row_factors=False, wy_in_recurrence=False, cu_seqlens=None,
):  # fmt: skip
    """The state recurrence and the output of ``plan``'s segments (``cula.time_split``) all at once, exactly.

    Over a segment the recurrence is affine in its start state: ``S_end = R S_start + E`` (``[K, V]`` states; for
    ``[V, K]`` ones ``S_end = S_start R^T + E``), ``R`` a ``K x K`` matrix (the product of the segment's chunk
    transitions ``diag(exp2 g_last) - kg^T w``) and ``E`` the end state from a zero start. With every segment a
    sequence of one packed call:

    1. ``summary_fn`` (``segment_summary_kernel.py``): E and R of every segment in one launch;
    2. ``chain_fn`` (``segment_chain_kernel.py``): the true start states, segment by segment along each sequence
       from the caller's initial state (all sequences, heads and column blocks at once; fp32, finer than the
       kernels' bf16 copies of the state), and the final states (the last segment's end);
    3. ``states_fn`` (the state/output kernel) from the true starts: the outputs.

    With ``halves`` (``KdaTuning.time_split_halves``) the output pass runs twice the segments at no more chain
    steps: the summary also gives each segment's first-half E and R (``cula.time_split.half_bounds`` cuts there), a
    one-step chain per segment starts the second half from ``R_mid start + E_mid``, and step 3 runs over the halves.

    With ``row_factors`` (Gated DeltaNet) ``kg`` and ``qg`` are the raw k and q and ``g_cum`` the intra kernel's
    factor rows, which the summary and the state/output kernel apply (their ``row_factors`` variants); with
    ``wy_in_recurrence`` as well ``w`` and ``u`` are T diag(beta) and the raw v (their ``wy_in_recurrence``
    variants).

    Each kernel runs segments x value heads CTAs (twice that for 1), where the serial kernel runs sequences x value
    heads, each walking its whole sequence. The intermediates (``w, u, kg, qg, g_cum, Aqk`` of the intra stage) are
    the serial path's: segments start on chunk boundaries of their sequence, so every chunk is the same chunk.

    A packed call (``cu_seqlens``) captured in a CUDA graph cuts, at each replay, the boundaries ``cu_seqlens`` then
    holds by ``plan``'s rule (``cula.time_split.segment_tables``)."""
    B, T, HV, V = u.shape
    K = kg.shape[-1]
    dev = w.device
    tables = segment_tables(plan, B * T, cu_seqlens, dev, halves=halves)
    M, seg_cu, first = tables.num_segments, tables.bounds, tables.first
    # (spare segments, in no chain, start from zero: the output pass reads every segment's start)
    new_starts = torch.zeros if tables.spare else torch.empty

    # (row_factors: kg and qg are the raw k and q of H heads, g_cum the factor rows)
    W, U, KG, QG, G, A, O = (t.view(1, B * T, t.shape[2], t.shape[-1]) for t in (w, u, kg, qg, g_cum, Aqk, o))
    rows = {"row_factors": True} if row_factors else {}
    if wy_in_recurrence:
        rows["wy_in_recurrence"] = True
    inner = (V, K) if state_v_first else (K, V)
    summary = torch.empty((M, 2 * HV) + inner, dtype=torch.float32, device=dev)
    if not halves:
        summary_fn(W, U, KG, G, summary, seg_cu, state_v_first=state_v_first, **rows)
        starts = new_starts((M, HV) + inner, dtype=torch.float32, device=dev)
        chain_fn(summary, initial_state, starts, final_state, first, state_v_first=state_v_first)
        states_fn(W, U, KG, QG, G, A, O, starts, None, seg_cu, scale=scale, state_v_first=state_v_first,
                  aqk_causal=aqk_causal, **rows)  # fmt: skip
        return
    mids = torch.empty_like(summary)
    summary_fn(W, U, KG, G, summary, seg_cu, state_v_first=state_v_first, mids=mids, **rows)
    # the halves' start states interleaved, [segment, half]: the chains write straight into the two views
    starts = new_starts((M, 2, HV) + inner, dtype=torch.float32, device=dev)
    chain_fn(summary, initial_state, starts[:, 0], final_state, first, state_v_first=state_v_first)
    # every segment a sequence of one step from its true start: its second half's start (its record of that
    # first start goes to a buffer nothing reads)
    once = on_device(tuple(range(M + 1)), torch.int32, dev)
    chain_fn(mids, starts[:, 0], torch.empty((M, HV) + inner, dtype=torch.float32, device=dev), starts[:, 1], once,
             state_v_first=state_v_first)  # fmt: skip
    states_fn(W, U, KG, QG, G, A, O, starts.view((2 * M, HV) + inner), None, tables.halves, scale=scale,
              state_v_first=state_v_first, aqk_causal=aqk_causal, **rows)  # fmt: skip


def _launch_buffers(B, T, HV, K, dt, o_dtype, dev, state_shape, output_final_state):
    """A bound launch's intermediates in their flat kernel shapes, ``w, u, qg, kg`` ``[B T, HV, K]`` (K = V),
    ``Aqk``, fp32 ``g_cum``, and its outputs ``o`` ``[B, T, HV, V]`` and the final state (or None)."""
    # one allocation for the four [BT, HV, 128] intermediates: each torch.empty costs ~3 us of host time
    w, u, qg, kg = torch.empty(4, B * T, HV, K, dtype=dt, device=dev).unbind(0)
    Aqk = torch.empty(B * T, HV, 64, dtype=dt, device=dev)
    g_cum = torch.empty(B * T, HV, K, dtype=torch.float32, device=dev)
    o = torch.empty(B, T, HV, K, dtype=o_dtype, device=dev)
    final_state = torch.empty(state_shape, dtype=torch.float32, device=dev) if output_final_state else None
    return w, u, qg, kg, Aqk, g_cum, o, final_state


_side_streams: dict[int, torch.cuda.Stream] = {}


def _segmented_launch(
    fn_intra, fn_states, bounds, gate_args, H, HV, K, V, dt, dev, state_shape, has_h0, output_final_state,
    dummy_state, no_cu, no_ci, lb,
):  # fmt: skip
    """The bound launch of a B=1 call in time segments (``cula.kda.plan.time_segments``): intra kernels on the
    caller's stream, the state/output kernel of each segment on a side stream once its intra has run, the state
    handed from segment to segment through two fp32 buffers."""
    T = bounds[-1][1]
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=dev, priority=-1)  # its CTAs get the SMs as they free
    side = _side_streams[index]
    last = len(bounds) - 1

    def launch(q, k, v, g, beta, initial_state, A_log, dt_bias, scale, **_):
        a_log, bias = gate_args(A_log, dt_bias)
        w, u, qg, kg, Aqk, g_cum, o, final_state = _launch_buffers(
            1, T, HV, K, dt, v.dtype, dev, state_shape, output_final_state
        )
        carry = torch.empty(2, *state_shape, dtype=torch.float32, device=dev)  # ping-pong between segments
        s = float(scale)
        qf, kf, vf, gf, bf, of = q.view(T, H, K), k.view(T, H, K), v.view(T, HV, V), g.view(T, HV, K), beta.view(
            T, HV), o.view(T, HV, V)  # fmt: skip
        main = torch.cuda.current_stream(dev)
        side.wait_stream(main)  # the allocations above and whatever wrote the inputs
        for i, (t0, t1) in enumerate(bounds):
            n = t1 - t0
            fn_intra(
                qf[t0:t1], kf[t0:t1], vf[t0:t1], gf[t0:t1], bf[t0:t1], a_log, bias, w[t0:t1], u[t0:t1], qg[t0:t1],
                kg[t0:t1], Aqk[t0:t1], None, g_cum[t0:t1], None, no_cu, no_ci, n, (n + 63) // 64, 1, s, lb,
            )  # fmt: skip
            done = torch.cuda.Event()
            done.record(main)
            side.wait_event(done)
            h0 = (initial_state if has_h0 else dummy_state) if i == 0 else carry[(i - 1) % 2]
            ht = (final_state if output_final_state else dummy_state) if i == last else carry[i % 2]
            with torch.cuda.stream(side):
                fn_states[(i > 0 or has_h0, i < last or output_final_state)](
                    w[t0:t1], u[t0:t1], kg[t0:t1], qg[t0:t1], g_cum[t0:t1], Aqk[t0:t1], of[t0:t1], h0, ht, no_cu,
                    n, 1, s,
                )  # fmt: skip
        main.wait_stream(side)  # o, the final state, and the buffers freed on return
        return o, final_state

    return launch


def _intra_fla(
    q, k, v, g, beta, scale, cu_seqlens, chunk_indices, chunk_size, use_gate_in_kernel, A_log, dt_bias,
    lower_bound, safe_gate, use_qk_l2norm, beta_sigmoid, allow_neg_eigval,
):  # fmt: skip
    """FLA's preprocessing, gate cumsum and intra stage; returns ``(w, u, qg, kg, Aqk, g_cum, Akk)``."""
    from fla.modules.l2norm import l2norm_fwd
    from fla.ops.common.gate import fused_beta_sigmoid_fwd
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.kda.gate import kda_gate_chunk_cumsum
    from fla.ops.utils import chunk_local_cumsum

    if use_qk_l2norm:
        q, _ = l2norm_fwd(q)
        k, _ = l2norm_fwd(k)
    if beta_sigmoid:
        # FLA's own beta path (fp32 out), one launch
        beta = fused_beta_sigmoid_fwd(beta, 2.0 if allow_neg_eigval else 1.0)
    if use_gate_in_kernel:
        g_cum = kda_gate_chunk_cumsum(
            g=g, A_log=A_log, dt_bias=dt_bias, scale=RCP_LN2, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices, lower_bound=lower_bound,
        )  # fmt: skip
    else:
        g_cum = chunk_local_cumsum(
            g, chunk_size=chunk_size, scale=RCP_LN2, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices
        )
    w, u, qg, kg, Aqk, Akk = chunk_kda_fwd_intra(
        q=q, k=k, v=v, gk=g_cum, beta=beta, scale=scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
        chunk_indices=chunk_indices, safe_gate=safe_gate, disable_recompute=True,
    )  # fmt: skip
    return w, u, qg, kg, Aqk, g_cum, Akk


def _intra_cute(
    q, k, v, g, beta, scale, cu32, chunk_indices, use_gate_in_kernel, A_log, dt_bias, lower_bound,
    use_qk_l2norm, beta_sigmoid, allow_neg_eigval, keep_akk=False, zero_kg=False, full_g_cum=False, given_akk=None,
    any_gate=False, qk_rstd=None, row_factors=False, wy_in_recurrence=False,
):  # fmt: skip
    """cula's fused intra kernel (l2norm, beta sigmoid, gate, cumsum, intra); same return as ``_intra_fla``
    (Akk None unless ``keep_akk``: the kernel writes it only when asked). ``zero_kg``: kg starts as zeros, for
    graph mode, where the sequences may end before the last token: the state kernel multiplies the rows of the last
    chunk past the end (never written) by zeros, and garbage there could be NaN. ``full_g_cum``: every row of
    g_cum (the state/output kernel reads only each chunk's last; the training backward's stages read all).
    ``given_akk``: the Akk an earlier call on these inputs kept, read instead of computed (no scores: Aqk is
    None). ``any_gate``: the kernel's variant that is exact for any gate (``cula.kda.plan.intra_any_gate``).
    ``qk_rstd``: a ``[2, B, T, H]`` fp32 tensor the kernel also writes q's and k's 1 / norms into (with
    ``use_qk_l2norm``), or None. ``row_factors``: ``(w, u, factors, Aqk)``, the per-token factor rows (``[B, T, HV,
    ROW_FACTORS]`` fp32) in place of qg, kg and g_cum (a per-head g only; nothing kept); with ``wy_in_recurrence``
    ``(T diag(beta), v, factors, Aqk)``, what the state/output kernel's ``wy_in_recurrence`` variant takes in w's and
    u's places."""
    from cula.ops.kda.sm90.intra import chunk_kda_intra_sm90

    B, T, _H, K = q.shape
    HV = v.shape[2]
    gate = gate_kind(use_gate_in_kernel, lower_bound)
    w = None if wy_in_recurrence else torch.empty(B, T, HV, K, dtype=q.dtype, device=q.device)
    if row_factors or wy_in_recurrence:
        Aqk = torch.empty(B, T, HV, 64, dtype=q.dtype, device=q.device)
        factors = torch.empty(B, T, HV, ROW_FACTORS, dtype=torch.float32, device=q.device)
        u = None if wy_in_recurrence else torch.empty_like(v)
        t_beta = torch.empty_like(Aqk) if wy_in_recurrence else None
        chunk_kda_intra_sm90(
            q, k, v, g, beta, scale, w, u, None, None, Aqk, None, cu32, chunk_indices, gate=gate, A_log=A_log,
            dt_bias=dt_bias, lower_bound=lower_bound if gate == "lower_bound" else None,
            use_qk_l2norm=use_qk_l2norm, beta_sigmoid=beta_sigmoid, allow_neg_eigval=allow_neg_eigval,
            row_factors=factors, t_beta=t_beta,
        )  # fmt: skip
        return (t_beta, v, factors, Aqk) if wy_in_recurrence else (w, u, factors, Aqk)
    qg, kg = torch.empty_like(w), torch.zeros_like(w) if zero_kg else torch.empty_like(w)
    u = torch.empty_like(v)
    Aqk = None if given_akk is not None else torch.empty(B, T, HV, 64, dtype=q.dtype, device=q.device)
    g_cum = torch.empty(B, T, HV, K, dtype=torch.float32, device=q.device)
    Akk = torch.empty(B, T, HV, 64, dtype=q.dtype, device=q.device) if keep_akk else None
    chunk_kda_intra_sm90(
        q, k, v, g, beta, scale, w, u, qg, kg, Aqk, g_cum, cu32, chunk_indices, gate=gate, A_log=A_log,
        dt_bias=dt_bias, lower_bound=lower_bound if gate == "lower_bound" else None, use_qk_l2norm=use_qk_l2norm,
        beta_sigmoid=beta_sigmoid, allow_neg_eigval=allow_neg_eigval, g_cum_last_only=not full_g_cum, Akk=Akk,
        given_akk=given_akk, any_gate=any_gate, qk_rstd=qk_rstd,
    )  # fmt: skip
    return w, u, qg, kg, Aqk, g_cum, Akk


def prepare_chunk_kda_fwd_sm90(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    safe_gate: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    row_factors: bool = False,
    wy_in_recurrence: bool = False,
    time_split: SplitThresholds | None | str = "kda",
):
    """``chunk_kda_fwd_sm90`` bound once for every later call with this call's signature (same shapes, strides,
    dtypes, device, flags; with ``cu_seqlens`` everything but the total length), or None where the general path
    must run each time (FLA's intra stage, non-contiguous inputs, no tokens). A fixed-length call the time split
    cuts (``cula.kda.plan.parallel_segments`` with ``time_split``) gets the cut's kernels bound once
    (``_cut_launch``); a packed one, whose lengths each call decides the cut of, the general path without the public
    validation. A per-head g (Gated DeltaNet) is bound only where the general path takes the factor rows
    (``row_factors``, see ``chunk_kda_fwd_sm90``), to their variant of the one host call (or of the cut).

    The returned ``launch(q, k, v, g, beta, initial_state, A_log, dt_bias, scale, **_)`` (with ``cu_seqlens``:
    ``..., scale, cu_seqlens, cu_seqlens_cpu)``, see ``_varlen_launch``) allocates the outputs and one workspace for
    the intra -> state/output intermediates and calls both compiled kernels directly: none of the per-call checks,
    views and cache-key builds of the general path, which the caller's full validation of the first call with this
    signature stands for (``cula.kda.chunk``'s plan cache).
    The tuning (``cula.kda.plan.KDA_TUNING``) is read here, once (its ``override`` drops the plans made under
    other numbers); ``CULA_KDA_INTRA`` is part of the signature.
    """
    from cula.ops.kda.sm90 import delta_h_fwd_o as dh
    from cula.ops.kda.sm90 import fwd_launch

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    varlen = cu_seqlens is not None
    if chunk_size != 64 or B == 0 or HV == 0 or (K, V) != (128, 128) or (T == 0 and not varlen):
        return None
    scalar_gate = g.dim() == 3
    if scalar_gate and not (row_factors and factor_rows_fit(q.dtype, use_qk_l2norm_in_kernel)):
        return None
    if not use_cula_intra(q, v, safe_gate, use_gate_in_kernel, lower_bound, scalar_gate):
        return None
    if not all(is_row_major(t) for t in (q, k, v, g, beta)):  # the launches' flat token layout (strict: one token)
        return None
    if initial_state is not None and (initial_state.dtype != torch.float32 or not initial_state.is_contiguous()):
        return None
    flags = dict(
        use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound, safe_gate=safe_gate,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
    )  # fmt: skip

    def cut(q, k, v, g, beta, initial_state, A_log, dt_bias, scale, cu_seqlens=None, cu_seqlens_cpu=None, **_):
        # a call cut in time: the general path, without the public validation this signature has passed
        return chunk_kda_fwd_sm90(
            q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first, cu_seqlens, cu_seqlens_cpu,
            A_log=A_log, dt_bias=dt_bias, row_factors=row_factors, wy_in_recurrence=wy_in_recurrence,
            time_split=time_split, **flags,
        )  # fmt: skip

    gate = gate_kind(use_gate_in_kernel, lower_bound)
    beta_act = intra.beta_act_for(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    has_h0 = initial_state is not None
    dev, dt = q.device, q.dtype
    N = cu_seqlens.numel() - 1 if varlen else B
    state_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    dummy_state = placeholder(dev, torch.float32, (1, 1) + state_shape[2:])
    lb = float(lower_bound) if gate == "lower_bound" else 0.0
    if gate == "none":  # the kernels read no A_log / dt_bias then: bind the placeholders, whatever is passed
        A_log = dt_bias = None
    # (with the factor rows, the intra kernel's variant the general path runs: it writes no g_cum)
    intra_options = intra.kernel_options(
        q.dtype, g.dtype, beta.dtype, gate, use_qk_l2norm_in_kernel, beta_act, g_cum_last_only=not scalar_gate,
        any_gate=intra_any_gate(safe_gate, use_gate_in_kernel, lower_bound), scalar_gate=scalar_gate,
        row_factors=scalar_gate, wy_in_recurrence=scalar_gate and wy_in_recurrence,
    )  # fmt: skip
    split = None if varlen else parallel_segments(B, T, HV, None, None, q.device, time_split)
    if split is not None:
        return _cut_launch(
            split, intra.compiled_variant(varlen=False, **intra_options),
            intra.gate_params_binder(A_log, dt_bias, gate, HV, K, dev, per_head=scalar_gate), B, T, HV, K, V, dt, dev,
            state_shape, has_h0, bool(output_final_state), state_v_first, dummy_state, lb,
            row_factors=scalar_gate, wy_in_recurrence=scalar_gate and wy_in_recurrence,
        )  # fmt: skip
    state_options = _launch_state_options(q, has_h0, output_final_state, state_v_first, scalar_gate,
                                          scalar_gate and wy_in_recurrence)  # fmt: skip
    gate_args = intra.gate_params_binder(A_log, dt_bias, gate, HV, K, dev, flat_bias=True, per_head=scalar_gate)
    cols = fwd_launch.work_cols(intra_options)

    if varlen:
        fn = fwd_launch.compiled_variant(intra_options, state_options, varlen=True)
        launch = _varlen_launch(fn, gate_args, HV, V, dt, dev, state_shape, has_h0, output_final_state, dummy_state,
                                lb, cols)  # fmt: skip
        thresholds = KDA_TUNING.for_device(dev).time_split if time_split == "kda" else time_split
        if thresholds is None:
            return launch

        def launch_or_cut(q, k, v, g, beta, initial_state, A_log, dt_bias, scale, cu_seqlens, cu_seqlens_cpu, **_):
            # whether to cut depends on each call's lengths; only a pack holding a long sequence can be cut
            T = q.shape[1]
            if T >= thresholds.min_seq_len and parallel_segments(1, T, HV, cu_seqlens, cu_seqlens_cpu, dev,
                                                                 thresholds):  # fmt: skip
                return cut(q, k, v, g, beta, initial_state, A_log, dt_bias, scale, cu_seqlens, cu_seqlens_cpu)
            return launch(q, k, v, g, beta, initial_state, A_log, dt_bias, scale, cu_seqlens, cu_seqlens_cpu)

        # both ways end in compiled entries that check their tensors (the cut one on contiguous copies)
        launch_or_cut.checks_arguments = True
        return launch_or_cut

    no_cu = placeholder(dev, torch.int32, (2,))  # the fixed-length kernels' unread cu_seqlens
    # (the general path runs the factor rows' two kernels in one piece)
    bounds = None if scalar_gate else time_segments(B, T, HV, dev)
    if bounds is not None:
        fn_intra = intra.compiled_variant(varlen=False, **intra_options)
        dtype = dsl_name(q.dtype)
        fn_states = {
            (h0, ht): dh.compiled_variant(
                dtype=dtype, varlen=False, has_h0=h0, has_ht=ht, state_v_first=state_v_first, aqk_causal=True
            )
            for h0 in (True, has_h0)
            for ht in (True, bool(output_final_state))
        }
        no_ci = placeholder(dev, torch.int32, (1, 2))
        return _segmented_launch(
            fn_intra, fn_states, bounds, intra.gate_params_binder(A_log, dt_bias, gate, HV, K, dev), H,
            HV, K, V, dt, dev, state_shape, has_h0, bool(output_final_state), dummy_state, no_cu, no_ci, lb,
        )  # fmt: skip

    # both kernels in one host call (fwd_launch): one TVM-FFI call, no views, the intermediates in one buffer
    fn = fwd_launch.compiled_variant(intra_options, state_options)
    rows = B * T * HV

    def launch(q, k, v, g, beta, initial_state, A_log, dt_bias, scale, **_):
        a_log, bias = gate_args(A_log, dt_bias)
        # q.new_empty with the sizes as arguments: q's dtype and device are the plan's (its key holds them), and a
        # torch.empty with dtype and device keywords costs ~0.5 us more each to parse
        work = q.new_empty(rows, cols)
        o = q.new_empty(B, T, HV, V)
        final_state = dummy_state.new_empty(state_shape) if output_final_state else None  # (fp32, on the device)
        fn(
            q, k, v, g, beta, a_log, bias, work, o, initial_state if has_h0 else dummy_state,
            final_state if final_state is not None else dummy_state, no_cu, float(scale), lb,
        )  # fmt: skip
        return o, final_state

    # its one TVM-FFI call checks the tensors before launching (chunk_kda then keys it on shapes alone); the
    # initial state's and dt_bias' sizes are their own symbols there, so the key holds their shapes
    launch.checks_arguments = True
    return launch


def _cut_launch(
    plan, fn_intra, gate_args, B, T, HV, K, V, dt, dev, state_shape, has_h0, output_final_state, state_v_first,
    dummy_state, lb, row_factors=False, wy_in_recurrence=False,
):  # fmt: skip
    """``prepare_chunk_kda_fwd_sm90``'s launch of a fixed-length call the time split cuts by ``plan``: what
    ``chunk_kda_fwd_sm90`` runs for it (the intra kernel, then ``parallel_segment_states``' summary, chain and
    state/output kernels), each compiled variant and the segment tables found once, the intra kernel's
    intermediates in three allocations (w, u, qg and kg in one), none of the kernels' host wrappers (their checks
    hold for every call of the signature, which the first call's full validation stands for). ``row_factors`` /
    ``wy_in_recurrence``: Gated DeltaNet's variants, as the general path takes them. Its segment steps repeat
    ``parallel_segment_states``' on the compiled entries: a change to one is a change to both (the CPU test
    ``test_cut_launch_passes_what_the_general_path_passes`` holds them together)."""
    from cula.ops.kda.sm90 import delta_h_fwd_o, segment_chain, segment_summary

    halves = KDA_TUNING.for_device(dev).time_split_halves
    BT, N = B * T, B
    tables = segment_tables(plan, BT, None, dev, halves=halves)
    M, inner = tables.num_segments, tuple(state_shape[2:])
    rows = {"row_factors": True} if row_factors else {}
    if wy_in_recurrence:
        rows["wy_in_recurrence"] = True
    dtype = dsl_name(dt)
    fn_summary = segment_summary.compiled_variant(dtype=dtype, state_v_first=state_v_first, mid_states=halves,
                                                  row_factors=row_factors, wy_in_recurrence=wy_in_recurrence)
    fn_chain = segment_chain.compiled_variant(has_h0=has_h0, has_ht=output_final_state, state_v_first=state_v_first,
                                              cols=segment_chain.column_block(N * HV, dev))  # fmt: skip
    fn_states = delta_h_fwd_o.compiled_variant(
        dtype=dtype, varlen=True, has_h0=True, has_ht=False, state_v_first=state_v_first, aqk_causal=True, **rows
    )  # fmt: skip
    if halves:  # every segment a sequence of one step from its true start: its second half's start
        fn_mids = segment_chain.compiled_variant(has_h0=True, has_ht=True, state_v_first=state_v_first,
                                                 cols=segment_chain.column_block(M * HV, dev))  # fmt: skip
        once = on_device(tuple(range(M + 1)), torch.int32, dev)
    no_cu, no_ci = placeholder(dev, torch.int32, (2,)), placeholder(dev, torch.int32, (1, 2))
    num_chunks = (T + 63) // 64

    def launch(q, k, v, g, beta, initial_state, A_log, dt_bias, scale, **_):
        a_log, bias = gate_args(A_log, dt_bias)
        s = float(scale)
        q3, k3, v3 = (x.view(BT, *x.shape[2:]) for x in (q, k, v))
        head = (q3, k3, v3, g.view(BT, *g.shape[2:]), beta.view(BT, HV), a_log, bias)
        tail = (no_cu, no_ci, T, num_chunks, B, s, lb)
        Aqk = q.new_empty(BT, HV, 64)
        if row_factors:  # qg and kg made from the raw q and k by the factor rows
            g_rows = dummy_state.new_empty(BT, HV, ROW_FACTORS)
            qg, kg = q3, k3
            if wy_in_recurrence:  # T diag(beta) in w's place, the raw v in u's
                w, u = q.new_empty(BT, HV, 64), v3
                fn_intra(*head, None, None, g_rows, None, Aqk, w, None, None, *tail)
            else:
                w, u = q.new_empty(2, BT, HV, K).unbind(0)
                fn_intra(*head, w, u, g_rows, None, Aqk, None, None, None, *tail)
        else:
            w, u, qg, kg = q.new_empty(4, BT, HV, K).unbind(0)
            g_rows = dummy_state.new_empty(BT, HV, K)
            fn_intra(*head, w, u, qg, kg, Aqk, None, g_rows, None, *tail)
        o = v.new_empty(B, T, HV, V)
        final_state = dummy_state.new_empty(state_shape) if output_final_state else None
        h0 = initial_state if has_h0 else dummy_state
        ht = final_state if final_state is not None else dummy_state
        summary = dummy_state.new_empty((M, 2 * HV) + inner)
        operands = (w, u, kg, qg, g_rows, Aqk, o.view(BT, HV, V))
        if not halves:
            fn_summary(w, u, kg, g_rows, summary, None, tables.bounds, M)
            starts = dummy_state.new_empty((M, HV) + inner)
            fn_chain(summary, h0, starts, ht, tables.first, N)
            fn_states(*operands, starts, dummy_state, tables.bounds, BT, M, s)
            return o, final_state
        mids = torch.empty_like(summary)
        fn_summary(w, u, kg, g_rows, summary, mids, tables.bounds, M)
        starts = dummy_state.new_empty((M, 2, HV) + inner)  # [segment, half], as parallel_segment_states
        fn_chain(summary, h0, starts[:, 0], ht, tables.first, N)
        fn_mids(mids, starts[:, 0], dummy_state.new_empty((M, HV) + inner), starts[:, 1], once, M)
        fn_states(*operands, starts.view((2 * M, HV) + inner), dummy_state, tables.halves, BT, 2 * M, s)
        return o, final_state

    return launch


def _launch_state_options(q, has_h0, output_final_state, state_v_first, row_factors=False,
                          wy_in_recurrence=False) -> dict:  # fmt: skip
    """``fwd_launch``'s options of the state/output kernel."""
    return dict(
        dtype=dsl_name(q.dtype), has_initial_state=has_h0, has_final_state=bool(output_final_state),
        state_v_first=bool(state_v_first), aqk_causal=True, **({"row_factors": True} if row_factors else {}),
        **({"wy_in_recurrence": True} if wy_in_recurrence else {}),
    )  # fmt: skip


def _varlen_launch(fn, gate_args, HV, V, dt, dev, state_shape, has_h0, output_final_state, dummy_state, lb,
                   cols):  # fmt: skip
    """The bound launch of packed sequences (B = 1, ``cu_seqlens``): the total length and the boundaries may change
    from call to call (``cula.kda.chunk`` checks the boundaries' values every time), the chunk indices are built
    from ``cu_seqlens_cpu`` (on the device from ``cu_seqlens`` while a CUDA graph captures, see
    ``device_chunk_indices``), and both kernels run from one host call."""

    def launch(q, k, v, g, beta, initial_state, A_log, dt_bias, scale, cu_seqlens, cu_seqlens_cpu, **_):
        T = q.shape[1]
        o = q.new_empty(1, T, HV, V)  # (as the fixed-length launch allocates)
        final_state = dummy_state.new_empty(state_shape) if output_final_state else None
        if T == 0:  # nothing to read; the state passes through
            if final_state is not None and has_h0:
                final_state.copy_(initial_state)
            elif final_state is not None:
                final_state.zero_()
            return o, final_state
        a_log, bias = gate_args(A_log, dt_bias)
        if capturing(cu_seqlens):
            cu32 = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
            chunk_indices = device_chunk_indices(cu_seqlens, chunk_rows_bound(T, cu_seqlens.numel() - 1))
        else:
            cu32, chunk_indices = host_boundaries(cu_seqlens, cu_seqlens_cpu)
        work = q.new_empty(T * HV, cols)
        fn(
            q, k, v, g, beta, a_log, bias, work, o, initial_state if has_h0 else dummy_state,
            final_state if final_state is not None else dummy_state, cu32, chunk_indices, float(scale), lb,
        )  # fmt: skip
        return o, final_state

    # its one TVM-FFI call checks the tensors before launching (chunk_kda then keys it on shapes alone)
    launch.checks_arguments = True
    return launch


def host_chunk_indices(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None, chunk_size: int = 64):
    """``prepare_chunk_indices_i32``'s rows on ``cu_seqlens``' device (``host_boundaries``' second half)."""
    return host_boundaries(cu_seqlens, cu_seqlens_cpu, chunk_size)[1]


def host_boundaries(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None,
                    chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(cu32, chunk indices)`` of packed boundaries, as the kernels read them: the boundaries as int32 (``cu_seqlens``
    itself when int32, else an int32 copy made from the host boundaries: an int64 list would otherwise cost a cast
    kernel, with its launch and allocation, on every call) and ``prepare_chunk_indices_i32``'s rows, on
    ``cu_seqlens``' device, remembered for the last 32 boundary lists: every layer of a model gets the same packed
    batch, and the backward the forward's, so only a batch's first call builds them and copies them up. Read only:
    the same tensors are handed out again.

    Keyed by the boundaries' values, never by the tensors' identity (an engine rewrites its static boundary
    buffers in place), and by the current stream, on which the copies to the device were queued."""
    host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()
    dev = cu_seqlens.device
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    key = (tuple(host.tolist()), chunk_size, dev, stream)
    made = _CHUNK_INDICES.get(key)
    if made is None:
        device_tables.preload(dev)  # (a capture of these boundaries later builds its tables with them)
        # made outside inference mode even under it: a later training call of the same batch gets these tensors,
        # and an inference tensor there could not be saved for its backward
        with torch.inference_mode(False):
            made = _CHUNK_INDICES[key] = (None, intra.prepare_chunk_indices_i32(cu_seqlens, chunk_size, host))
        if len(_CHUNK_INDICES) > CHUNK_INDICES_KEPT:
            _CHUNK_INDICES.popitem(last=False)
    else:
        _CHUNK_INDICES.move_to_end(key)
    # int32 boundaries are read from the caller's tensor itself (an engine's static buffer, which it keeps alive)
    if cu_seqlens.dtype == torch.int32:
        return cu_seqlens, made[1]
    if made[0] is None:  # queued like a kernel, as the chunk indices are
        with torch.inference_mode(False):
            cu32 = torch.tensor(key[0], dtype=torch.int32, pin_memory=dev.type == "cuda").to(dev, non_blocking=True)
        made = _CHUNK_INDICES[key] = (cu32, made[1])
    return made


_CHUNK_INDICES: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()
CHUNK_INDICES_KEPT = 32


def chunk_rows_bound(total: int, num_seqs: int, chunk_size: int = 64) -> int:
    """An upper bound on the chunk count of ``num_seqs`` packed sequences of ``total`` tokens in all, from the
    shapes alone: ``sum ceil(len / c) <= (total + num_seqs (c - 1)) // c``, reached when every sequence ends one
    token into a chunk."""
    return (total + num_seqs * (chunk_size - 1)) // chunk_size


def device_chunk_indices(cu_seqlens: torch.Tensor, num_rows: int, chunk_size: int = 64) -> torch.Tensor:
    """``[num_rows, 2]`` int32 (sequence, chunk within it), FLA's ``prepare_chunk_indices`` order, made by torch ops
    on ``cu_seqlens``' device from its values there.

    For CUDA-graph capture: the host path (``prepare_chunk_indices_i32``, FLA's ``prepare_chunk_indices``) reads
    the boundaries on the host and copies the rows up, a sync or a copy from pageable memory that capture refuses,
    or, from pinned memory, a copy that every replay would repeat from a host buffer long since reused. Here
    nothing leaves the device, so a replay recomputes the rows from whatever boundaries ``cu_seqlens`` then holds.

    ``num_rows`` is fixed when the launch is captured, so it cannot be the boundaries' own chunk count: callers
    pass ``chunk_rows_bound`` of the shapes. The rows past the real chunks name the last sequence with chunk
    numbers from its chunk count on (``c * chunk_size >= len``): chunks past that sequence's end, which cula's
    intra kernel and FLA's chunked stages skip (each masks or returns on ``c * chunk_size >= len``), so the graph
    holds for any boundaries with the same sequence count and total length. Values are not checked (capture
    cannot read them); boundaries that are not non-decreasing give meaningless rows.
    """
    if cu_seqlens.numel() > 1 and device_tables.usable(cu_seqlens.device):
        return device_tables.chunk_rows(cu_seqlens, num_rows, chunk_size)
    cu = cu_seqlens.long()  # searchsorted takes one dtype for both sides; int64 also rules out overflow
    counts = (cu[1:] - cu[:-1] + (chunk_size - 1)).div(chunk_size, rounding_mode="floor")
    ends = counts.cumsum(0)  # one past each sequence's last chunk row
    row = torch.arange(num_rows, dtype=torch.int64, device=cu.device)
    seq = torch.searchsorted(ends, row, right=True).clamp_(max=counts.numel() - 1)
    rows = torch.empty(num_rows, 2, dtype=torch.int32, device=cu.device)
    rows[:, 0] = seq
    rows[:, 1] = row - (ends - counts)[seq]
    return rows
