"""``cula.kda.chunk_kda``: FLA 0.6.0's chunked KDA with call-time backend selection."""

from __future__ import annotations

import torch
from torch.compiler import is_compiling

from cula import _custom_ops
from cula._validate import (
    check_lower_bound,
    check_planned_boundaries,
    check_scale,
    contiguous_reads,
    copying_reads,
    gate_kwargs_fp32,
    is_row_major,
    resolve_state_layout,
    take_extra_kwargs,
)
from cula.backends import (
    PLAIN_SCALARS, PlanCache, capturing, env_reader, forced_backend, tensor_sig, token_sigs, varlen_token_sigs,
)  # fmt: skip
from cula.kda._args import check_kda_inputs
from cula.kda.backends import chunk_kda_registry

# FLA reads these from **kwargs; every other unknown keyword is an error here.
_EXTRA_KWARGS = ("A_log", "dt_bias", "chunk_size", "transpose_state_layout")
_PLANNED_KWARGS = frozenset(("A_log", "dt_bias", "chunk_size"))
_read_intra_mode = env_reader("CULA_KDA_INTRA")

# Fixed-length calls skip validation and backend selection when their signature repeats (see the fast path at
# the top of chunk_kda); the cula-sm90 backend then also skips its own per-call checks
# (prepare_chunk_kda_fwd_sm90). A plan is (launch, scale): launch(*_TENSOR_ARGS, scale) with the scale resolved.
_plans = PlanCache()
# the same plans by a short key, for launches whose compiled entry checks their own arguments (cula.backends.StepPlans)
_short_plans = PlanCache()
_TENSOR_ARGS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
_VARLEN_ARGS = (*_TENSOR_ARGS, "scale", "cu_seqlens", "cu_seqlens_cpu")
_READ_ARGS = (*_TENSOR_ARGS, "cu_seqlens")  # chunk_kda writes no tensor argument (cu_seqlens_cpu: read on the host)
# Packed sequences (cu_seqlens with its host copy cu_seqlens_cpu, contiguous inputs) go through plans keyed on
# everything but the total length, the boundaries' values checked on the host every call: what a serving engine's
# prefill needs (a third of the general path's host time).


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs,
):
    r"""Chunked Kimi Delta Attention, keyword-compatible with ``fla.ops.kda.chunk_kda`` (fla-core 0.6.0).

    Per value head, with state ``S`` (``[K, V]``, fp32) and ``q`` scaled by ``scale``::

        S <- Diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t

    Args:
        q, k: ``[B, T, H, K]`` bf16/fp16/fp32 (``K <= 256``, as FLA's kernels; V any).
        v: ``[B, T, HV, V]``, same dtype; GVA when ``HV > H`` (``HV % H == 0``), value head ``hv`` reads
            q/k head ``hv // (HV // H)``.
        g: ``[B, T, HV, K]`` log-space decay, or raw logits with ``use_gate_in_kernel=True``; the gate is
            then ``-exp(A_log) * softplus(g + dt_bias)``, or ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``
            when ``lower_bound`` is set (``A_log`` may then be None).
        beta: ``[B, T, HV]``, post-sigmoid, or logits with ``use_beta_sigmoid_in_kernel=True``
            (``2 * sigmoid`` with ``allow_neg_eigval=True``).
        scale: defaults to ``K ** -0.5``.
        initial_state: fp32 ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``); N = B, or the
            number of sequences with ``cu_seqlens``.
        output_final_state: also return the fp32 final state in the same layout.
        use_qk_l2norm_in_kernel: L2-normalise q and k (``x / sqrt(sum x^2 + 1e-6)``).
        safe_gate: promise that gates lie in ``[lower_bound, 0)``; with ``use_gate_in_kernel`` it needs
            ``-5 <= lower_bound < 0``.
        disable_recompute: save intermediates for backward instead of recomputing them.
        return_intermediate_states: also return per-chunk states ``h`` ``[B, NT, HV, K, V]`` (inference only).
        state_v_first: V-first state layout; ``transpose_state_layout`` is its deprecated alias.
        cu_seqlens: int32/int64 ``[N+1]`` boundaries of packed sequences (B must be 1);
            ``cu_seqlens_cpu`` is its host copy and saves a device-to-host sync.
        cp_context: FLA's context parallel, run by the FLA backend.
        use_graph, max_num_seqs: FLA's CUDA-graph mode for packed sequences: the chunk list is built on the device
            at a fixed size from the shapes, so a captured call (forward and backward) replays for any boundaries
            with the same total length; ``cu_seqlens`` padded with empty sequences to ``max_num_seqs + 1`` entries
            (``initial_state`` ``[max_num_seqs, ...]``); not with ``disable_recompute``.
        **kwargs: only ``A_log`` (fp32 ``[HV]``), ``dt_bias`` (fp32 ``[HV*K]``), ``chunk_size`` (32 or 64)
            and ``transpose_state_layout``; anything else raises ``TypeError``.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in ``q.dtype``; ``final_state`` or None. With
        ``return_intermediate_states=True``, ``(o, final_state, h)``.

    Backends (first that supports the call): ``cula-sm90`` CuTe DSL kernels on Hopper, ``fla`` (FLA's
    Triton), ``reference`` (float32 PyTorch, the CPU path). ``CULA_BACKEND=<name>`` forces one.
    """
    if kwargs:  # FLA's kernels take bf16 / fp16 A_log and dt_bias (a model cast to bf16): fp32 from here on
        kwargs = gate_kwargs_fp32(kwargs)
    if is_compiling() and _custom_ops.routes():  # torch.compile traces the cula::chunk_kda op instead
        return _custom_ops.chunk_kda(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
            use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, disable_recompute,
            return_intermediate_states, state_v_first, cu_seqlens, cu_seqlens_cpu, cp_context, use_graph,
            max_num_seqs, **kwargs,
        )  # fmt: skip
    # The fast path: a fixed-length call whose signature (everything validation and backend selection read) was
    # seen before goes straight to its launch (found by a short key where the launch checks its own arguments);
    # so does a packed call with cu_seqlens_cpu, its boundaries checked here.
    # Other varlen calls, context parallel, FLA's graph mode, intermediate states, the deprecated alias and
    # scalars of unusual types are validated every time. Packed calls plan under CUDA-graph capture too: the launch
    # then makes its chunk indices on the device (cula.kda.forward.device_chunk_indices).
    planned = cu_seqlens_cpu is None if cu_seqlens is None else cu_seqlens_cpu is not None
    if (planned and cp_context is None and not use_graph and not return_intermediate_states
            and (not kwargs or kwargs.keys() <= _PLANNED_KWARGS)):  # fmt: skip
        A_log, dt_bias, chunk_size = kwargs.get("A_log"), kwargs.get("dt_bias"), kwargs.get("chunk_size", 64)
        flags = (
            scale, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
            allow_neg_eigval, safe_gate, lower_bound, disable_recompute, state_v_first, chunk_size, max_num_seqs,
        )  # fmt: skip
        if PLAIN_SCALARS.issuperset(map(type, flags)):
            # whether autograd records the call (every backend decides on that alone); spelled out, as a generator
            # over the eight costs ~1 us a call
            try:
                grad = torch.is_grad_enabled() and bool(
                    q.requires_grad or k.requires_grad or v.requires_grad or g.requires_grad or beta.requires_grad
                    or (initial_state is not None and initial_state.requires_grad)
                    or (A_log is not None and A_log.requires_grad) or (dt_bias is not None and dt_bias.requires_grad)
                )  # fmt: skip
            except AttributeError:  # not tensors: validated in full below
                grad = None
            inference = torch.is_inference_mode_enabled()
            # the short key (as cula.backends.StepPlans'): shapes and dtypes of contiguous inputs, for launches whose
            # compiled entry checks the rest (strides, alignment, one device, the sizes shared with q); a packed
            # call's without its total length, its boundaries' values checked here every call
            short = _short_key(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu, flags,
                               grad, inference)  # fmt: skip
            plan = None if short is None else _short_plans.get(short)
            if plan is not None:
                try:
                    if cu_seqlens is None:
                        return plan[0](q, k, v, g, beta, initial_state, A_log, dt_bias, plan[1])
                    check_planned_boundaries(cu_seqlens, cu_seqlens_cpu, q.shape[1])
                    return plan[0](q, k, v, g, beta, initial_state, A_log, dt_bias, plan[1], cu_seqlens, cu_seqlens_cpu)
                except Exception:  # noqa: BLE001  (refused, or bad boundaries: validate in full below, which says why)
                    pass
            tokens = None if cu_seqlens is None else varlen_token_sigs(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu)
            key = None
            if cu_seqlens is None or tokens is not None:
                try:
                    key = (
                        *(tokens or token_sigs(q, k, v, g, beta)),
                        None if initial_state is None else tensor_sig(initial_state),
                        None if A_log is None else tensor_sig(A_log), None if dt_bias is None else tensor_sig(dt_bias),
                        flags, forced_backend(), _read_intra_mode(), grad, inference,
                    )  # fmt: skip
                except RuntimeError:  # tensors without storage (torch.func transforms): no address to key on
                    pass
            if key is not None:
                plan = _plans.get(key)
                if plan is None:
                    positional = _TENSOR_ARGS + ("scale",) if cu_seqlens is None else _VARLEN_ARGS
                    plan = _plan(_full_call(locals()), positional)
                    # A plan made while a CUDA graph captures serves that call only: the placeholders it binds for
                    # absent gate parameters were filled by the graph (cula.ops._host.placeholder), so an
                    # eager call before the first replay would read them unset.
                    if not capturing(q):
                        _plans.put(key, plan)
                launch, scale = plan
                if cu_seqlens is None:
                    out = launch(q, k, v, g, beta, initial_state, A_log, dt_bias, scale)
                else:
                    check_planned_boundaries(cu_seqlens, cu_seqlens_cpu, q.shape[1])  # before any launch
                    out = launch(q, k, v, g, beta, initial_state, A_log, dt_bias, scale, cu_seqlens, cu_seqlens_cpu)
                if short is not None and getattr(launch, "checks_arguments", False) and _plans.get(key) is plan:
                    _short_plans.put(short, plan)
                return out

    args = _checked(_full_call(locals()))
    return chunk_kda_registry.dispatch(args["q"].device, args)


# chunk_kda's named parameters (its signature less **kwargs), the dispatch dict's keys with A_log, dt_bias and
# chunk_size; and its flags, which the dict holds as bools
_PUBLIC_ARGS = (
    "q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
    "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "safe_gate", "lower_bound",
    "disable_recompute", "return_intermediate_states", "state_v_first", "cu_seqlens", "cu_seqlens_cpu", "cp_context",
    "use_graph", "max_num_seqs",
)  # fmt: skip
_BOOL_FLAGS = (
    "output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
    "allow_neg_eigval", "safe_gate", "disable_recompute", "return_intermediate_states", "state_v_first", "use_graph",
)  # fmt: skip


def _full_call(scope: dict) -> dict:
    """The dispatch dict of a chunk_kda call from its local variables: the named parameters, the accepted
    ``**kwargs`` (anything else raises ``TypeError``), the deprecated state-layout alias resolved, flags as bools."""
    extra = take_extra_kwargs("chunk_kda", scope["kwargs"], _EXTRA_KWARGS)
    call = {name: scope[name] for name in _PUBLIC_ARGS}
    call["state_v_first"] = resolve_state_layout("chunk_kda", call["state_v_first"], extra)
    call.update(A_log=extra.get("A_log"), dt_bias=extra.get("dt_bias"), chunk_size=extra.get("chunk_size", 64))
    for name in _BOOL_FLAGS:
        call[name] = bool(call[name])
    return call


def _plan(call: dict, positional: tuple[str, ...]) -> tuple:
    """Validate the first call of a signature in full (raises on bad input before anything is cached) and choose
    its backend: ``(launch, scale)``, launch taking ``positional`` (the tensors, the resolved scale and, for packed
    sequences, the two ``cu_seqlens``) in that order."""
    given = [call[n] for n in positional]
    args = _checked(call)
    launch = chunk_kda_registry.plan(args["q"].device, args, positional=positional)
    if any(isinstance(t, torch.Tensor) and args[n] is not t for n, t in zip(positional, given)):
        launch = copying_reads(launch)
    return launch, args["scale"]


def _short_key(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu, flags, grad,
               inference) -> tuple | None:  # fmt: skip
    """The short plan key of a call (see the fast path in ``chunk_kda``), or None (not tensors: validated in full).
    A packed call's leaves out the total length, which changes from call to call, after checking that the five
    token tensors share it."""
    try:
        states = (
            None if initial_state is None else (initial_state.shape, initial_state.dtype),
            None if A_log is None else (A_log.shape, A_log.dtype),
            None if dt_bias is None else (dt_bias.shape, dt_bias.dtype),
        )  # fmt: skip
        qs, T = q.shape, q.shape[1]
        # With one token the token stride is any number to is_contiguous() and to TVM-FFI alike (which checks no
        # stride of a size-1 dim, not even its divisibility, which the TMA descriptors need): checked in full then.
        if T == 1 and not all(map(is_row_major, (q, k, v, g, beta))):
            return None
        # The bound launches take contiguous inputs and a contiguous initial state (their condition in
        # prepare_chunk_kda_fwd_sm90): the fixed-length entry takes the batch and token strides as free sizes but
        # addresses token b T + t at (b T + t) times the token stride, so a batch stride other than T token strides
        # (a slice in time, swapped dims) would be accepted and misread; a packed call strided in time or a state
        # strided in dim 0 would run where a fresh plan would not
        if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and g.is_contiguous()
                and beta.is_contiguous() and (initial_state is None or initial_state.is_contiguous())):  # fmt: skip
            return None
        if cu_seqlens is None:
            # (the device too: the launch allocates its outputs there)
            return (qs, v.shape, q.dtype, q.device, g.dtype, beta.dtype, *states, flags, forced_backend(),
                    _read_intra_mode(), grad, inference)  # fmt: skip
        if k.shape[1] != T or v.shape[1] != T or g.shape[1] != T or beta.shape[1] != T:
            return None
        return (
            "packed", qs[0], qs[2:], k.shape[2:], v.shape[2:], g.shape[2:], beta.shape[2:], q.dtype, k.dtype,
            v.dtype, g.dtype, beta.dtype, q.device, cu_seqlens.shape, cu_seqlens.dtype, cu_seqlens.device,
            cu_seqlens_cpu.shape, cu_seqlens_cpu.dtype, cu_seqlens_cpu.device, *states, flags, forced_backend(),
            _read_intra_mode(), grad, inference,
        )  # fmt: skip
    except (AttributeError, IndexError, TypeError):
        return None


def _checked(call: dict) -> dict:
    """Validate a call in full (FLA's rules plus dtype/device/layout checks); returns the dispatch arguments, a
    tensor strided in its last dimension replaced by its row-major copy."""
    call.update(zip(_READ_ARGS, contiguous_reads(*(call[n] for n in _READ_ARGS))))
    q, lower_bound = call["q"], call["lower_bound"]
    if call["chunk_size"] not in (32, 64):
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {call['chunk_size']}")
    check_lower_bound(lower_bound)  # its type, before the range check compares it
    if call["safe_gate"] and call["use_gate_in_kernel"]:
        if lower_bound is None:
            raise ValueError(
                "`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`"
            )
        if not -5 <= lower_bound < 0:
            raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}")
    if call["cp_context"] is not None and (call["initial_state"] is not None or call["output_final_state"]):
        raise ValueError("`cp_context` cannot be combined with `initial_state` or `output_final_state`")
    check_kda_inputs(
        q,
        call["k"],
        call["v"],
        call["g"],
        call["beta"],
        initial_state=call["initial_state"],
        state_v_first=call["state_v_first"],
        cu_seqlens=call["cu_seqlens"],
        cu_seqlens_cpu=call["cu_seqlens_cpu"],
        A_log=call["A_log"],
        dt_bias=call["dt_bias"],
        use_gate_in_kernel=call["use_gate_in_kernel"],
        lower_bound=lower_bound,
        use_beta_sigmoid_in_kernel=call["use_beta_sigmoid_in_kernel"],
        allow_neg_eigval=call["allow_neg_eigval"],
        partial_cu_seqlens=call["use_graph"],
    )
    if call["use_graph"] and call["cu_seqlens"] is not None:
        _check_graph_mode(call)
    if call["return_intermediate_states"] and (
        not torch.is_inference_mode_enabled() or call["disable_recompute"]
    ):
        raise ValueError(
            "`return_intermediate_states=True` needs torch.inference_mode() and disable_recompute=False"
        )
    call["scale"] = check_scale(call["scale"], q.shape[-1])
    return call


def _check_graph_mode(call: dict) -> None:
    """FLA's rules for ``use_graph`` with packed sequences: ``cu_seqlens`` holds exactly ``max_num_seqs`` sequences
    (the tail padded with empty ones), so that every buffer of a captured call has a size fixed by the shapes."""
    cu, most = call["cu_seqlens"], call["max_num_seqs"]
    if most is not None and (isinstance(most, bool) or not isinstance(most, int)):
        raise TypeError(f"`max_num_seqs` must be an int, got {type(most).__name__}")
    if most is not None and cu.shape[0] - 1 != most:
        raise ValueError(
            f"with `use_graph`, `cu_seqlens` must be padded with empty sequences to exactly max_num_seqs + 1 = "
            f"{most + 1} entries, got {cu.shape[0]}"
        )
    if call["disable_recompute"]:
        raise ValueError("`use_graph=True` does not support `disable_recompute=True` (as in FLA)")
