"""PyTorch references for Gated DeltaNet (GDN).

GDN is KDA with one decay per head and token: the scalar log gate ``g [B, T, HV]`` is broadcast over the
K channels and handed to the KDA references in ``cula/kda/naive.py`` (which hold the only copy of the
math)::

    S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T (scale q_t)

Conventions (shapes, varlen, GVA, state layouts, dtypes) are those of ``cula/kda/naive.py``. The ``naive_*``
functions take FLA 0.6.0's positional arguments in FLA's order (``naive_recurrent_gated_delta_rule(q, k, v, beta,
g, ...)``, ``naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size, ...)``), so the same call means the same
thing here and in ``fla.ops.gated_delta_rule.naive``; cula's extras are keyword-only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cula.kda.naive import (
    _finish,
    _float_dtype,
    _preprocess_qk_beta,
    naive_chunk_kda,
    naive_recurrent_kda,
    recurrent_linear_attention,
)

__all__ = [
    "gdn_gate",
    "naive_chunk_gated_delta_rule",
    "naive_recurrent_gated_delta_rule",
    "reference_chunk_gated_delta_rule",
    "reference_fused_recurrent_gated_delta_rule",
]


def gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """GDN gate activation ``-exp(A_log) * softplus(g + dt_bias)`` (FLA ``naive_gdn_gate``).

    Args:
        g: ``[..., HV]`` raw gate logits.
        A_log: ``[HV]``.
        dt_bias: optional ``[HV]``.

    Returns:
        ``[..., HV]`` log-space gate, float32 (float64 when ``g`` is float64).
    """
    dtype = _float_dtype(g)
    x = g.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype)
    return -A_log.to(dtype).exp() * F.softplus(x)


def _per_key(g: torch.Tensor, K: int) -> torch.Tensor:
    """[B, T, HV] scalar log gate -> [B, T, HV, K] per-channel gate (a view)."""
    if g.dim() != 3:
        raise ValueError(f"the GDN gate must be [B, T, HV], got {list(g.shape)}")
    return g[..., None].expand(*g.shape, K)


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token GDN.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``, HV % H == 0.
        g: ``[B, T, HV]`` log-space decay (already activated).
        beta: ``[B, T, HV]`` or per-value ``[B, T, HV, V]``, post-activation.
        scale: default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` if ``state_v_first``).
        cu_seqlens: ``[N+1]`` for packed varlen input (B must be 1).
        compute_dtype: default ``promote_types(q.dtype, float32)``.

    Returns:
        ``(o [B, T, HV, V], final_state or None)`` in the compute dtype.
    """
    return naive_recurrent_kda(**dict(locals(), g=_per_key(g, q.shape[-1])))


def naive_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise GDN, any T; head-wise beta only. Arguments as :func:`naive_recurrent_gated_delta_rule`, in FLA's
    order for this form (``g`` before ``beta``, ``chunk_size`` sixth).
    """
    return naive_chunk_kda(**dict(locals(), g=_per_key(g, q.shape[-1])))


def reference_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
    compute_dtype: torch.dtype | None = None,
    form: str = "chunk",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA 0.6.0 ``chunk_gated_delta_rule`` semantics in plain torch (positional order as FLA's).

    Preprocessing, in the compute dtype: ``l2norm`` of q/k (``use_qk_l2norm_in_kernel``), the gate
    :func:`gdn_gate` on raw ``g`` (``use_gate_in_kernel``, ``A_log`` required), ``beta = sigmoid(beta)`` or
    ``2 * sigmoid(beta)`` (``use_beta_sigmoid_in_kernel`` / ``allow_neg_eigval``).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``.
        g: ``[B, T, HV]`` log-space decay, or raw logits with ``use_gate_in_kernel``.
        beta: ``[B, T, HV]``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` if ``state_v_first``).
        A_log, dt_bias: ``[HV]`` each (``use_gate_in_kernel`` only).
        form: ``"chunk"`` or ``"recurrent"``.

    Returns:
        ``(o [B, T, HV, V] in q.dtype, final_state float32 or None)``.
    """
    if form not in ("chunk", "recurrent"):
        raise ValueError(f"form must be 'chunk' or 'recurrent', got {form!r}")
    dtype = compute_dtype if compute_dtype is not None else _float_dtype(q)
    q2, k2, beta2 = _preprocess_qk_beta(
        q, k, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, dtype
    )
    g2 = g.to(dtype)
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("A_log must be provided when use_gate_in_kernel=True.")
        g2 = gdn_gate(g2, A_log, dt_bias).to(dtype)
    common = {
        "scale": scale,
        "initial_state": initial_state,
        "output_final_state": output_final_state,
        "state_v_first": state_v_first,
        "cu_seqlens": cu_seqlens,
        "compute_dtype": dtype,
    }
    if form == "chunk":
        o, S = naive_chunk_gated_delta_rule(q2, k2, v, g=g2, beta=beta2, chunk_size=chunk_size, **common)
    else:
        o, S = naive_recurrent_gated_delta_rule(q2, k2, v, g=g2, beta=beta2, **common)
    return _finish(o, S, q.dtype)


def reference_fused_recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None, gv: torch.Tensor | None = None, beta: torch.Tensor | None = None,
    scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False, A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None, use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
    state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None, *,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """FLA 0.6.0 ``fused_recurrent_gated_delta_rule`` semantics in plain torch (same positional order).

    Per step the state is decayed by ``exp(g_t)`` (scalar), ``exp(gk_t)`` on its K axis and ``exp(gv_t)``
    on its V axis (each optional), then the delta-rule update and read-out follow. With
    ``use_gate_in_kernel`` only ``g`` is activated (:func:`gdn_gate`); ``gk``/``gv`` are always log-space.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``.
        g: optional ``[B, T, HV]``; gk: optional ``[B, T, HV, K]``; gv: optional ``[B, T, HV, V]``.
        beta: ``[B, T, HV]`` or per-value ``[B, T, HV, V]``; None means ones.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` if ``state_v_first``).
        A_log, dt_bias: ``[HV]`` each (``use_gate_in_kernel`` only; ignored otherwise, as in FLA).

    Returns:
        ``(o [B, T, HV, V] in v.dtype (as FLA's, which allocates it like v: q, k, v may differ), final_state float32
        or None)``.
    """
    dtype = compute_dtype if compute_dtype is not None else _float_dtype(q)
    if beta is None:
        beta = q.new_ones(v.shape[:3], dtype=dtype)
    q2, k2, beta2 = _preprocess_qk_beta(
        q, k, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, dtype
    )
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True`.")
        if g is None:
            raise ValueError("`g` (raw pre-activation) must be provided when `use_gate_in_kernel=True`.")
        g = gdn_gate(g.to(dtype), A_log, dt_bias)
    decay_k = None
    if g is not None:
        decay_k = _per_key(g.to(dtype), q.shape[-1])
    if gk is not None:
        decay_k = gk.to(dtype) if decay_k is None else decay_k + gk.to(dtype)
    o, S = recurrent_linear_attention(
        q2,
        k2,
        v,
        gk=decay_k,
        gv=gv,
        beta=beta2,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        compute_dtype=dtype,
    )
    return _finish(o, S, v.dtype)
