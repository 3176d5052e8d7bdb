"""Lightning attention (constant per-head decay) on top of ``cula.simple_gla``.

Relation to FLA: Lightning is Simple GLA with ``g_gamma = -decay``. ``lightning_attn_fwd`` takes the
decay rate ``s >= 0`` directly (per-step factor ``exp(-s)``); ``chunk_lightning_attn`` and
``fused_recurrent_lightning_attn`` keep FLA's signatures and build FLA's per-layer schedule.
"""

from __future__ import annotations

import operator

import torch
from torch.compiler import is_compiling

from cula._validate import (
    check_head_first, check_qkv, check_tensor, contiguous_reads, state_fp32, take_extra_kwargs,
)  # fmt: skip
from cula.backends import ConstantTensors
from cula.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
from cula.simple_gla.chunk import planned_launch


def lightning_g_gamma(num_heads: int, layer_idx: int, num_layers: int, device=None) -> torch.Tensor:
    """FLA 0.6.0's Lightning decay schedule (``fla/ops/lightning_attn/chunk.py``), bit for bit.

    ``g_gamma[h] = -(8 / H * (1 - layer_idx / num_layers)) * h`` for ``h = 0 .. H-1``: head 0 never
    decays and the log decay grows linearly with the head index (not the geometric ALiBi slopes).

    Returns:
        ``[num_heads]`` float32 log decay (<= 0); ``decay = -g_gamma``.
    """
    num_heads = _as_int("num_heads", num_heads)
    if num_heads < 1:
        raise ValueError(f"`num_heads` must be positive, got {num_heads}")
    layer_idx, num_layers = _check_layer(layer_idx, num_layers)
    return -(8 / num_heads * (1 - layer_idx / num_layers)) * torch.arange(
        num_heads, dtype=torch.float32, device=device
    )


def lightning_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    state_v_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Lightning attention prefill: ``S_t = exp(-decay) S_{t-1} + k_t v_t^T``, ``o_t = scale * S_t^T q_t``.

    Args:
        q, k: ``[B, T, H, D]`` bf16 (fp16/fp32 run on the fallback); v: ``[B, T, HV, D]`` (GVA when ``HV > H``).
        decay: fp32 ``[HV]``, the per-head decay rate ``s >= 0``; FLA's ``g_gamma`` is ``-decay``.
        scale: defaults to ``D ** -0.5`` as in FLA (cuLA's ``lightning_attn_fwd`` defaults to 1.0).
        initial_state: fp32 ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``).
        cu_seqlens: ``[N+1]`` boundaries of packed sequences (B must be 1); ``cu_seqlens_cpu`` its host copy.

    Returns:
        ``(o [B, T, HV, V] in q.dtype, final_state fp32 or None)``. Differentiable in q, k, v, initial_state.
    """
    # (is_compiling first: Dynamo cannot trace data_ptr; torch.compile traces chunk_simple_gla's custom op instead)
    if (not is_compiling() and cu_seqlens is None and cu_seqlens_cpu is None and isinstance(decay, torch.Tensor)
            and decay.ndim == 1 and decay.dtype is torch.float32 and decay.is_contiguous()
            and _aligned(decay)):  # fmt: skip
        # A signature chunk_simple_gla has planned needs none of the checks below: g_gamma = -decay would have
        # decay's signature (shape, strides, dtype, device, alignment), which the plan's key holds. A launch bound
        # to cula's kernel takes the decay as it is (the kernel's own form), without negating it twice.
        initial_state = state_fp32(initial_state)
        launch = planned_launch(q, k, v, decay, scale, initial_state, output_final_state, state_v_first)
        if launch is not None:
            from_decay = getattr(launch, "from_decay", None)
            if from_decay is not None:
                return from_decay(q, k, v, decay, initial_state)
            return launch(q, k, v, -decay.detach(), initial_state)  # (a constant, as chunk_simple_gla takes g_gamma)
    q, k, v, decay = contiguous_reads(q, k, v, decay)  # (the state and boundaries: chunk_simple_gla's)
    *_, HV, _V = check_qkv(q, k, v, head_limit=None)  # first: the decay's shape and device are q's and v's
    check_tensor("decay", decay, shape=(HV,), dtypes=(torch.float32,), device=q.device)
    return chunk_simple_gla(
        q,
        k,
        v,
        g_gamma=-decay,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )


def _aligned(t: torch.Tensor) -> bool:
    """16-byte aligned; False for a tensor without storage (torch.func transforms), which takes the general path."""
    try:
        return not t.data_ptr() & 15
    except RuntimeError:
        return False


def _check_heads(q, v) -> int:
    """FLA's Lightning wrappers are multi-head (the decay schedule runs over q's H heads): v has H heads too. (Their
    strides are the Simple GLA call's to check, which copies a view strided in its last dimension.)"""
    check_tensor("q", q, ndim=4, contiguous_last=False)
    check_tensor("v", v, ndim=4, contiguous_last=False)
    if v.shape[2] != q.shape[2]:
        raise ValueError(
            f"`v` must have the H={q.shape[2]} heads of `q` (one decay a head), got {list(v.shape)}; "
            "for more value heads pass the decays to lightning_attn_fwd"
        )
    return q.shape[2]


def _as_int(name: str, x) -> int:
    """``x`` as a Python int: any integer FLA's arithmetic takes (a NumPy integer, a one-element integer tensor), not
    a float or a bool."""
    try:
        if isinstance(x, bool):
            raise TypeError
        return operator.index(x)
    except TypeError:
        raise ValueError(f"`{name}` must be an integer, got {x!r}") from None


# FLA's schedule as the kernel's decay, per (heads, layer_idx, num_layers) and device: it depends on those ints alone
_LAYER_DECAYS = ConstantTensors()


def _layer_decay(num_heads: int, layer_idx, num_layers, device: torch.device) -> torch.Tensor:
    """``-lightning_g_gamma(...)`` (same checks), made once: a repeated call launches nothing for it."""
    layer_idx, num_layers = _check_layer(layer_idx, num_layers)
    return _LAYER_DECAYS.get(
        device, ("lightning_decay", num_heads, layer_idx, num_layers),
        lambda: -lightning_g_gamma(num_heads, layer_idx, num_layers, device=device),
    )  # fmt: skip


def _check_layer(layer_idx, num_layers) -> tuple[int, int]:
    """``(layer_idx, num_layers)`` as ints, ``0 <= layer_idx <= num_layers`` (the last: no decay, as FLA's schedule
    gives; past it the schedule would make the states grow)."""
    num_layers = _as_int("num_layers", num_layers)
    if num_layers < 1:
        raise ValueError(f"`num_layers` must be positive, got {num_layers}")
    layer_idx = _as_int("layer_idx", layer_idx)
    if not 0 <= layer_idx <= num_layers:
        raise ValueError(f"`layer_idx` must be in [0, num_layers={num_layers}], got {layer_idx}")
    return layer_idx, num_layers


def chunk_lightning_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    num_layers: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Chunked Lightning attention, keyword-compatible with ``fla.ops.lightning_attn.chunk_lightning_attn``.

    q, k, v ``[B, T, H, D]``; the decay of head ``h`` is FLA's ``(8 / H) * (1 - layer_idx / num_layers) * h``
    (see :func:`lightning_g_gamma`). State fp32 ``[N, H, K, V]``. ``**kwargs``: ``chunk_size``, and cula's
    ``state_v_first`` (or FLA's deprecated alias ``transpose_state_layout``) and ``cu_seqlens_cpu``, handed to
    :func:`cula.simple_gla.chunk_simple_gla` (FLA 0.6.0's wrapper drops those three unread).
    """
    extra = take_extra_kwargs(
        "chunk_lightning_attn", kwargs,
        ("chunk_size", "head_first", "state_v_first", "transpose_state_layout", "cu_seqlens_cpu"),
    )  # fmt: skip
    check_head_first(extra)
    decay = _layer_decay(_check_heads(q, v), layer_idx, num_layers, q.device)
    if extra.keys() <= {"state_v_first", "cu_seqlens_cpu"}:
        # lightning_attn_fwd is chunk_simple_gla(g_gamma=-decay), bit for bit, and its repeated calls hand the
        # kernel this decay as it is
        return lightning_attn_fwd(
            q, k, v, decay, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, **extra,
        )  # fmt: skip
    return chunk_simple_gla(
        q,
        k,
        v,
        g_gamma=-decay,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        **extra,
    )


def fused_recurrent_lightning_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    num_layers: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Recurrent Lightning attention, keyword-compatible with FLA 0.6.0 ``fused_recurrent_lightning_attn``.

    Same decay schedule as :func:`chunk_lightning_attn`; ``reverse`` runs each sequence from its end.
    """
    g_gamma = lightning_g_gamma(_check_heads(q, v), layer_idx, num_layers, device=q.device)
    return fused_recurrent_simple_gla(
        q,
        k,
        v,
        g_gamma=g_gamma,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        reverse=reverse,
        cu_seqlens=cu_seqlens,
    )
