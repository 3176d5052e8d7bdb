"""``cula.kda.fused_recurrent_kda`` / ``fused_recurrent_kda_fwd``: token-by-token KDA (decode)."""

from __future__ import annotations

import warnings

import torch
from torch.compiler import is_compiling

from cula import _custom_ops
from cula._validate import (
    INDEX_DTYPES, INPLACE_STATE_DTYPES, READ_AS_FP32, check_pool_rows, check_scale, check_tensor, contiguous_reads,
    gate_params_fp32, resolve_state_layout, state_fp32, take_extra_kwargs,
)  # fmt: skip
from cula.backends import ConstantTensors, PlanCache, call_signature, capturing
from cula.kda._args import check_kda_inputs, dispatch_kda_call
from cula.kda.backends import fused_recurrent_kda_registry

_DECODE_KWARGS = ("ssm_state_indices", "num_accepted_tokens", "inplace_final_state", "out")

_plans = PlanCache()
_TENSOR_ARGS = (
    "q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "ssm_state_indices", "num_accepted_tokens", "out"
)  # fmt: skip
# the tensors a call only reads (initial_state too unless updated in place)
_READ_ARGS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "ssm_state_indices", "num_accepted_tokens")
_SCALAR_ARGS = (
    "scale", "output_final_state", "inplace_final_state", "state_v_first", "use_qk_l2norm_in_kernel",
    "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "lower_bound",
)  # fmt: skip


def _gate_params(A_log, dt_bias, v, use_gate_in_kernel, lower_bound):
    """``A_log`` / ``dt_bias`` as the recurrent kernels take them: fp32 (``gate_params_fp32``), and for the
    softplus gate without ``A_log`` FLA's recurrent kernel's reading of it, a log coefficient of 1 a head (the gate
    ``-e softplus(g + dt_bias)``; FLA's chunk form refuses that call, and so does :func:`cula.kda.chunk_kda`). Float64
    ones too, as FLA's recurrent kernel reads them (FLA's KDA tests make a float64 gold call)."""
    A_log, dt_bias = gate_params_fp32(A_log, dt_bias, READ_AS_FP32)
    if use_gate_in_kernel and A_log is None and lower_bound is None and isinstance(v, torch.Tensor) and v.dim() == 4:
        HV, device = v.shape[2], v.device
        A_log = _UNIT_LOG_COEFFICIENTS.get(
            device, ("ones", HV), lambda: torch.ones(HV, dtype=torch.float32, device=device)
        )
    return A_log, dt_bias


_UNIT_LOG_COEFFICIENTS = ConstantTensors()  # one fp32 [HV] of ones a head count and device (a call allocates none)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Recurrent KDA, keyword-compatible with ``fla.ops.kda.fused_recurrent_kda`` (fla-core 0.6.0).

    Forward only (no autograd, as in FLA). Same math and arguments as :func:`cula.kda.chunk_kda`, except
    ``beta`` may also be per value channel ``[B, T, HV, V]`` and ``dt_bias`` is ``[HV*K]`` fp32.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g: ``[B, T, HV, K]``; beta: ``[B, T, HV]`` or ``[B, T, HV, V]``.
            As FLA's kernel reads each of q, k, v as fp32, each may have its own float dtype, float64 included
            (cula's kernels take one 16-bit dtype for all three: other calls run on FLA's kernel or the reference).
        initial_state: fp32 ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``); bf16 / fp16 / float64 read
            as fp32 (a pool of the serving keywords, updated in place, keeps its dtype: see
            ``fused_recurrent_kda_fwd``). ``A_log`` / ``dt_bias`` may be float64 too.
        cu_seqlens: ``[N+1]`` int32/int64 boundaries of packed sequences (B must be 1).
        **kwargs: ``transpose_state_layout`` (deprecated alias of ``state_v_first``) and the serving
            arguments of FLA's ``fused_recurrent_kda_fwd``: ``ssm_state_indices``, ``num_accepted_tokens``,
            ``inplace_final_state``, ``out``. Anything else raises ``TypeError``.

    Returns:
        ``(o [B, T, HV, V] in v.dtype (as FLA's, which allocates it like v), final_state fp32 (the pool itself in
        place) or None)``.
    """
    A_log, dt_bias = _gate_params(A_log, dt_bias, v, use_gate_in_kernel, lower_bound)
    if is_compiling() and _custom_ops.routes():  # torch.compile traces cula's ops instead
        return _custom_ops.fused_recurrent_kda(
            q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first, cu_seqlens,
            **kwargs,
        )  # fmt: skip
    extra = take_extra_kwargs("fused_recurrent_kda", kwargs, ("transpose_state_layout",) + _DECODE_KWARGS)
    state_v_first = resolve_state_layout("fused_recurrent_kda", state_v_first, extra)
    return fused_recurrent_kda_fwd(
        q,
        k,
        v,
        g,
        beta,
        A_log=A_log,
        dt_bias=dt_bias,
        initial_state=initial_state,
        scale=scale,
        output_final_state=output_final_state,
        inplace_final_state=extra.get("inplace_final_state", False),
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        ssm_state_indices=extra.get("ssm_state_indices"),
        num_accepted_tokens=extra.get("num_accepted_tokens"),
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound,
        out=extra.get("out"),
    )


def fused_recurrent_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    output_final_state: bool = False,
    inplace_final_state: bool = True,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    out: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Serving form of recurrent KDA, keyword-compatible with FLA 0.6.0 ``fused_recurrent_kda_fwd``.

    With ``inplace_final_state=True`` (the default, as in FLA) ``initial_state`` is a state pool that is
    updated in place and returned as the final state; ``ssm_state_indices`` (``[N]`` or ``[N, T]`` int)
    picks each sequence's pool row, and ``num_accepted_tokens`` (``[N]``) serves speculative decoding.
    ``out`` (``[B, T, HV, V]``, v's dtype) receives the output when given. Other arguments (q, k, v of any float
    dtypes, o in v's) as :func:`fused_recurrent_kda`.

    State dtypes, as FLA 0.6.0's kernel takes them: a state updated in place (the pool, or with no indices a state
    of its own) may be fp32, bf16 or fp16 (serving engines keep bf16 caches); it is read as fp32, the recurrence
    runs in fp32 and each new state is stored rounded (to nearest even) to the state's dtype, the carried state
    staying fp32 between a sequence's tokens. A new state out of place (``inplace_final_state=False``) is fp32 and the
    state is only read. On CUDA, bf16 / fp16 pools run on FLA's kernel (cula's decode kernel takes fp32 pools).
    """
    A_log, dt_bias = _gate_params(A_log, dt_bias, v, use_gate_in_kernel, lower_bound)
    if not inplace_final_state and ssm_state_indices is None:  # FLA's kernel reads any float state as fp32
        initial_state = state_fp32(initial_state)
    if is_compiling() and _custom_ops.routes():  # torch.compile traces cula's ops instead
        return _custom_ops.fused_recurrent_kda_fwd(
            q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state, inplace_final_state,
            state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, out, **kwargs,
        )  # fmt: skip
    extra = take_extra_kwargs("fused_recurrent_kda_fwd", kwargs, ("transpose_state_layout",))
    if "transpose_state_layout" in extra:  # (FLA's public fused_recurrent_kda honours it; this form never did)
        warnings.warn("fused_recurrent_kda_fwd ignores `transpose_state_layout`, as FLA 0.6.0's does: pass "
                      "`state_v_first`", stacklevel=2)  # fmt: skip
    call = dict(
        q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state, scale=scale,
        output_final_state=bool(output_final_state), inplace_final_state=bool(inplace_final_state),
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices,
        num_accepted_tokens=num_accepted_tokens, use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        use_gate_in_kernel=bool(use_gate_in_kernel), use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid_in_kernel),
        allow_neg_eigval=bool(allow_neg_eigval), lower_bound=lower_bound, out=out,
    )  # fmt: skip
    # serving engines call this once per token: a repeated signature skips validation and backend selection
    # (varlen calls are validated every time: their cu_seqlens values are checked)
    key = None if cu_seqlens is not None else call_signature(call, _TENSOR_ARGS, _SCALAR_ARGS)
    return dispatch_kda_call(fused_recurrent_kda_registry, _plans, key, call, _checked)


def _check_pool_call(call: dict, N: int, bounds: torch.Tensor | None) -> None:
    """The serving form's pool and indices, by their shapes (FLA's kernel trusts them): a pool of ``[P, HV, K, V]``
    rows (``[P, HV, V, K]`` with ``state_v_first``); ``[N]`` indices (a row a sequence) or ``[N, T']`` (a row a
    token, its state after that token); with more than one token a sequence, a row for each (``T'`` at least the
    longest sequence) and the states written to the pool; new states out of the pool only one a sequence, and only
    where the call asks for them. ``bounds``: ``cu_seqlens`` on the host (None: not read, a CUDA graph captures)."""
    q, v, indices, pool = call["q"], call["v"], call["ssm_state_indices"], call["initial_state"]
    check_tensor("ssm_state_indices", indices, dtypes=INDEX_DTYPES, device=q.device)
    if indices.dim() not in (1, 2) or indices.shape[0] != N:
        raise ValueError(f"`ssm_state_indices` must have shape [N] or [N, T] with N={N}, got {list(indices.shape)}")
    if pool is None:
        raise ValueError("`ssm_state_indices` needs `initial_state` (the state pool)")
    # fp32, bf16 or fp16, as FLA's kernel takes a pool (read as fp32, each new state stored in the pool's dtype)
    check_pool_rows("initial_state", pool, heads=v.shape[2], k=q.shape[-1], v=v.shape[-1],
                    state_v_first=call["state_v_first"], device=q.device, what=" (the state pool)",
                    dtypes=INPLACE_STATE_DTYPES)  # fmt: skip
    if call["cu_seqlens"] is None:
        most = q.shape[1]
    else:
        most = None if bounds is None else int((bounds[1:] - bounds[:-1]).max())  # (validated: 2+ entries)
    if most is not None and most > 1:
        if indices.dim() != 2 or indices.shape[1] < most:
            raise ValueError(f"`ssm_state_indices` must be [N, T] with a pool row for each of a sequence's tokens "
                             f"(T >= {most}) when a sequence has more than one, got {list(indices.shape)}")  # fmt: skip
        if not call["inplace_final_state"]:
            raise ValueError("`ssm_state_indices` with more than one token a sequence needs "
                             "`inplace_final_state=True`: each token's state goes to its pool row")  # fmt: skip
    if not call["inplace_final_state"] and not call["output_final_state"]:
        raise ValueError("`ssm_state_indices` with `inplace_final_state=False` needs `output_final_state=True` "
                         "(the new states go to a final_state of their own)")  # fmt: skip


def _checked(call: dict) -> dict:
    """Validate a call in full; returns the dispatch arguments, an input strided in its last dimension replaced by
    its row-major copy."""
    reads = _READ_ARGS if call["inplace_final_state"] else (*_READ_ARGS, "initial_state")
    call.update(zip(reads, contiguous_reads(*(call[n] for n in reads))))
    q, initial_state = call["q"], call["initial_state"]
    pooled = call["ssm_state_indices"] is not None
    if call["inplace_final_state"] and initial_state is None:
        raise ValueError("`inplace_final_state=True` needs `initial_state` (the state pool to update)")
    cu = call["cu_seqlens"]
    # the boundaries read once, for their checks and the pool's (not while a CUDA graph captures)
    bounds = None
    if (isinstance(cu, torch.Tensor) and isinstance(q, torch.Tensor) and cu.dim() == 1 and cu.dtype in INDEX_DTYPES
            and cu.device == q.device and not capturing(cu)):  # (else check_kda_inputs names what is wrong)
        bounds = cu.detach().to("cpu")
    N = check_kda_inputs(
        q,
        call["k"],
        call["v"],
        call["g"],
        call["beta"],
        initial_state=None if pooled else initial_state,
        state_v_first=call["state_v_first"],
        cu_seqlens=cu,
        cu_seqlens_cpu=bounds,
        A_log=call["A_log"],
        dt_bias=call["dt_bias"],
        use_gate_in_kernel=call["use_gate_in_kernel"],
        lower_bound=call["lower_bound"],
        use_beta_sigmoid_in_kernel=call["use_beta_sigmoid_in_kernel"],
        allow_neg_eigval=call["allow_neg_eigval"],
        beta_per_value=True,
        # a state updated in place keeps its dtype (FLA stores it back so); one read only was made fp32 already
        state_dtypes=INPLACE_STATE_DTYPES if call["inplace_final_state"] else (torch.float32,),
        mixed_qkv=True,  # FLA's kernel reads each of q, k, v as fp32; o comes in v's dtype
    )
    if pooled:
        _check_pool_call(call, N, bounds)
    if call["num_accepted_tokens"] is not None:
        if not pooled or call["ssm_state_indices"].dim() != 2:
            raise ValueError("`num_accepted_tokens` needs `ssm_state_indices` of a pool row a token ([N, T]): it "
                             "picks the row each sequence's state is read from")  # fmt: skip
        check_tensor(
            "num_accepted_tokens", call["num_accepted_tokens"], shape=(N,), dtypes=INDEX_DTYPES, device=q.device
        )
    if call["out"] is not None:
        check_tensor("out", call["out"], shape=tuple(call["v"].shape), dtypes=(call["v"].dtype,), device=q.device)
    call["scale"] = check_scale(call["scale"], q.shape[-1])
    return call
