"""PyTorch references for Lightning attention (Simple GLA with a constant per-head decay).

    S_t = exp(-decay_h) S_{t-1} + k_t v_t^T,    o_t = scale * S_t^T q_t

The decay is given either directly (``decay [HV] >= 0``, cuLA's ``lightning_attn_fwd`` convention) or
through FLA's layer schedule (:func:`lightning_g_gamma`). In Simple GLA terms ``g_gamma = -decay``; the math
is :func:`cula.simple_gla.naive.reference_chunk_simple_gla`.
"""

from __future__ import annotations

import torch

from cula.lightning.chunk import lightning_g_gamma
from cula.simple_gla.naive import reference_chunk_simple_gla

__all__ = ["lightning_g_gamma", "reference_chunk_lightning_attn", "reference_lightning_attn"]


def reference_lightning_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
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
    """Lightning attention with a per-head decay rate: Simple GLA with ``g_gamma = -decay``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``, HV % H == 0.
        decay: ``[HV]`` non-negative decay rate; the state is multiplied by ``exp(-decay)`` every step.
        scale: default ``K ** -0.5`` (FLA's default; cuLA's ``lightning_attn_fwd`` defaults to 1.0).
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` if ``state_v_first``; cuLA's kernels use the
            V-first layout).
        cu_seqlens: ``[N+1]`` for packed varlen input (B must be 1).
        reverse: scan each sequence backwards, as FLA's ``fused_recurrent_lightning_attn(reverse=True)``.
        compute_dtype: default ``promote_types(q.dtype, float32)``.
        form: ``"chunk"`` or ``"recurrent"``.

    Returns:
        ``(o [B, T, HV, V] in q.dtype, final_state float32 or None)``.
    """
    args = dict(locals())
    return reference_chunk_simple_gla(g_gamma=-args.pop("decay"), **args)


def reference_chunk_lightning_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    num_layers: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    state_v_first: bool = False,
    reverse: bool = False,
    compute_dtype: torch.dtype | None = None,
    form: str = "chunk",
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA ``chunk_lightning_attn`` semantics: the decay comes from :func:`lightning_g_gamma`.

    The schedule is built over the value heads ``HV = v.shape[2]`` (FLA has no GVA here, so HV == H).
    Other arguments and the result as :func:`reference_lightning_attn`.
    """
    args = dict(locals())
    del args["layer_idx"], args["num_layers"]
    g_gamma = lightning_g_gamma(v.shape[2], layer_idx, num_layers, device=q.device)
    return reference_lightning_attn(decay=-g_gamma, **args)
