"""``cula.gated_delta_rule.fused_recurrent_gated_delta_rule``: token-by-token Gated DeltaNet."""

from __future__ import annotations

import torch
from torch.compiler import is_compiling

from cula import _custom_ops
from cula._validate import (
    FLOAT_DTYPES, READ_AS_FP32, check_scale, check_tensor, contiguous_reads, gate_params_fp32, resolve_state_layout,
    state_fp32, take_extra_kwargs,
)  # fmt: skip
from cula.gated_delta_rule.backends import fused_recurrent_gdn_registry
from cula.gated_delta_rule.chunk import check_gdn_activations, check_gdn_inputs


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Recurrent Gated DeltaNet, keyword-compatible with FLA 0.6.0 ``fused_recurrent_gated_delta_rule``.

    Forward only in FLA (its backward raises). Note FLA's positional order: the 5th argument is ``gk``,
    not ``beta``; pass ``beta=`` by keyword.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``. As FLA's kernel reads each of them as fp32, each may have its
            own float dtype, float64 included (cula's kernel takes one 16-bit dtype for all three: other calls run
            on FLA's kernel or the reference).
        g: ``[B, T, HV]`` scalar log decay (raw with ``use_gate_in_kernel``: ``-exp(A_log) * softplus(g + dt_bias)``).
        gk: ``[B, T, HV, K]`` per-key log decay; gv: ``[B, T, HV, V]`` per-value log decay.
        beta: ``[B, T, HV]``, or ``[B, T, HV, V]`` (a beta per value channel; FLA's kernel runs it); None means
            ones.
        initial_state: fp32 ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``); bf16 / fp16 / float64
            read as fp32 (and ``A_log`` / ``dt_bias``).
        **kwargs: only the deprecated ``transpose_state_layout``.

    Returns:
        ``(o [B, T, HV, V] in v.dtype (as FLA's, which allocates it like v), final_state fp32 or None)``.
    """
    # bf16 / fp16 / float64 parameters as FLA's kernel takes them
    A_log, dt_bias = gate_params_fp32(A_log, dt_bias, READ_AS_FP32)
    initial_state = state_fp32(initial_state)
    if is_compiling() and _custom_ops.routes():  # torch.compile traces the cula::fused_recurrent_gated_delta_rule op
        return _custom_ops.fused_recurrent_gated_delta_rule(
            q, k, v, g, gk, gv, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
            cu_seqlens, **kwargs,
        )  # fmt: skip
    extra = take_extra_kwargs("fused_recurrent_gated_delta_rule", kwargs, ("transpose_state_layout",))
    state_v_first = resolve_state_layout("fused_recurrent_gated_delta_rule", state_v_first, extra)
    q, k, v, g, gk, gv, beta, initial_state, A_log, dt_bias, cu_seqlens = contiguous_reads(
        q, k, v, g, gk, gv, beta, initial_state, A_log, dt_bias, cu_seqlens
    )
    check_gdn_inputs(
        q,
        k,
        v,
        g,
        beta,
        initial_state=initial_state,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=None,
        beta_per_value=True,
        mixed_qkv=True,
    )
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    if gk is not None:
        check_tensor("gk", gk, shape=(B, T, HV, K), dtypes=FLOAT_DTYPES, device=q.device)
    if gv is not None:
        check_tensor("gv", gv, shape=(B, T, HV, V), dtypes=FLOAT_DTYPES, device=q.device)
    check_gdn_activations(
        q, v, g, A_log, dt_bias, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval
    )
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    args = dict(
        q=q,
        k=k,
        v=v,
        g=g,
        gk=gk,
        gv=gv,
        beta=beta,
        scale=check_scale(scale, K),
        initial_state=initial_state,
        output_final_state=bool(output_final_state),
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        use_gate_in_kernel=bool(use_gate_in_kernel),
        A_log=A_log,
        dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid_in_kernel),
        allow_neg_eigval=bool(allow_neg_eigval),
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
    )
    return fused_recurrent_gdn_registry.dispatch(q.device, args)
