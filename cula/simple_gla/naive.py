"""PyTorch references for Simple GLA (gated linear attention with one decay per head and token).

    S_t = exp(gate_t) S_{t-1} + k_t v_t^T,    o_t = scale * S_t^T q_t

``gate_t = g_t + g_gamma`` where ``g [B, T, HV]`` is a data-dependent log decay and ``g_gamma [HV]`` a
constant one; either may be omitted (both omitted: plain causal linear attention). The math lives in
``cula/kda/naive.py`` (:func:`~cula.kda.naive.recurrent_linear_attention` without the delta rule, gate
broadcast over K); conventions (varlen, GVA, state layouts, dtypes) are the same as there.

``reverse=True`` follows FLA's ``fused_recurrent_simple_gla``: each sequence is scanned from its last
token to its first, so ``o_t`` sums over ``s >= t`` with decay ``exp(gate_t + ... + gate_{s-1})`` for
``s > t``, and the final state is the one after token 0 (``initial_state`` enters at the last token).
"""

from __future__ import annotations

import torch

from cula.kda.naive import _finish, _float_dtype, chunk_linear_attention, recurrent_linear_attention

__all__ = ["naive_chunk_simple_gla", "naive_recurrent_simple_gla", "reference_chunk_simple_gla"]


def _per_key_gate(q, v, g, g_gamma, dtype):
    """Combine ``g [B, T, HV]`` and ``g_gamma [HV]`` into a ``[B, T, HV, K]`` log decay (None if neither)."""
    B, T, HV = v.shape[:3]
    K = q.shape[-1]
    gate = None
    if g is not None:
        if tuple(g.shape) != (B, T, HV):
            raise ValueError(f"g must be [B, T, HV]={[B, T, HV]}, got {list(g.shape)}")
        gate = g.to(dtype)
    if g_gamma is not None:
        if tuple(g_gamma.shape) != (HV,):
            raise ValueError(f"g_gamma must be [HV]=[{HV}], got {list(g_gamma.shape)}")
        gamma = g_gamma.to(dtype=dtype, device=v.device).expand(B, T, HV)
        gate = gamma if gate is None else gate + gamma
    return None if gate is None else gate[..., None].expand(B, T, HV, K)


def _no_delta_rule(core, q, k, v, g, g_gamma, compute_dtype, **args):
    """``core`` (the recurrent or chunk form) as Simple GLA: plain linear attention, gated on the key axis
    by the gate of ``g`` and ``g_gamma``, built in the compute dtype; ``args`` pass through."""
    dtype = compute_dtype if compute_dtype is not None else _float_dtype(q)
    gk = _per_key_gate(q, v, g, g_gamma, dtype)
    return core(q, k, v, gk=gk, delta_rule=False, compute_dtype=dtype, **args)


def naive_recurrent_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    *,
    g_gamma: torch.Tensor | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    reverse: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token Simple GLA.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``, HV % H == 0.
        g: optional ``[B, T, HV]`` log-space decay; g_gamma: optional ``[HV]`` constant log decay.
        scale: default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` if ``state_v_first``).
        cu_seqlens: ``[N+1]`` for packed varlen input (B must be 1).
        reverse: scan each sequence backwards (see the module docstring).
        compute_dtype: default ``promote_types(q.dtype, float32)``.

    Returns:
        ``(o [B, T, HV, V], final_state or None)`` in the compute dtype.
    """
    return _no_delta_rule(recurrent_linear_attention, **locals())


def naive_chunk_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    scale: float | None = None,
    *,
    g_gamma: torch.Tensor | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    reverse: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise Simple GLA, any T. Arguments and result as :func:`naive_recurrent_simple_gla`."""
    return _no_delta_rule(chunk_linear_attention, **locals())


def reference_chunk_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    reverse: bool = False,
    compute_dtype: torch.dtype | None = None,
    form: str = "chunk",
    *,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA ``chunk_simple_gla`` / ``fused_recurrent_simple_gla`` semantics in plain torch.

    Arguments as :func:`naive_recurrent_simple_gla`; ``form`` is ``"chunk"`` or ``"recurrent"``.

    Returns:
        ``(o [B, T, HV, V] in q.dtype, final_state float32 or None)``.
    """
    args = dict(locals())
    del args["form"], args["chunk_size"]
    if form == "chunk":
        o, S = naive_chunk_simple_gla(chunk_size=chunk_size, **args)
    elif form == "recurrent":
        o, S = naive_recurrent_simple_gla(**args)
    else:
        raise ValueError(f"form must be 'chunk' or 'recurrent', got {form!r}")
    return _finish(o, S, q.dtype)
