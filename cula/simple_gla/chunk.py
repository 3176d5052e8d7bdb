"""``cula.simple_gla.chunk_simple_gla`` and ``fused_recurrent_simple_gla`` (FLA 0.6.0 signatures)."""

from __future__ import annotations

import torch
from torch.compiler import is_compiling

from cula import _custom_ops
from cula._validate import (
    FLOAT_DTYPES,
    check_cu_seqlens,
    check_head_first,
    check_planned_boundaries,
    check_qkv,
    check_scale,
    check_state,
    check_tensor,
    contiguous_reads,
    is_row_major,
    resolve_state_layout,
    state_fp32,
    take_extra_kwargs,
)
from cula.backends import PlanCache, capturing, forced_backend, scalars_key, tensor_sig
from cula.simple_gla.backends import chunk_simple_gla_registry, fused_recurrent_simple_gla_registry

# Fixed-length calls with a constant decay (Lightning's) skip validation and backend selection when their signature
# repeats: the first call of a signature is validated in full and planned (chunk_simple_gla_registry.plan, which on
# cula's kernels binds the compiled variant); later ones go straight to that launch.
_plans = PlanCache()
_PLANNED = ("q", "k", "v", "g_gamma", "initial_state")
# Packed calls with the boundaries' host copy (a serving engine's prefill) are planned too, keyed on everything but
# the total length; the boundaries' values are checked on the host at every call
_PLANNED_PACKED = (*_PLANNED, "cu_seqlens", "cu_seqlens_cpu")


def check_simple_gla_inputs(q, k, v, g, g_gamma, *, initial_state, state_v_first, cu_seqlens, cu_seqlens_cpu,
                            mixed_qkv=False):  # fmt: skip
    """q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g ``[B, T, HV]`` or g_gamma ``[HV]`` (at most one); ``mixed_qkv``:
    q, k, v of any float dtypes (the recurrent form: ``check_qkv``'s ``mixed``)."""
    # FLA's kernels tile any head size
    B, T, H, K, HV, V = check_qkv(q, k, v, head_limit=None, mixed=mixed_qkv)
    device = q.device
    if g is not None and g_gamma is not None:
        raise ValueError("pass either `g` (data-dependent decay) or `g_gamma` (constant decay), not both")
    if g is not None:
        check_tensor("g", g, shape=(B, T, HV), dtypes=FLOAT_DTYPES, device=device)
    if g_gamma is not None:
        check_tensor("g_gamma", g_gamma, shape=(HV,), dtypes=FLOAT_DTYPES, device=device)
    n = check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, batch=B, total=T, device=device)
    check_state(
        "initial_state", initial_state, n=n, heads=HV, k=K, v=V, state_v_first=state_v_first, device=device
    )


def _constant(g_gamma):
    """``g_gamma`` as a constant: FLA 0.6.0 gives it no gradient (its backward returns None there), so neither does
    any of cula's backends, the CPU reference included. Read flat as FLA's kernels index it (``[1, HV]`` passes
    there), as ``A_log`` is; validation then holds it to ``[HV]``."""
    return g_gamma.detach().reshape(-1) if isinstance(g_gamma, torch.Tensor) else g_gamma


def _checked_args(
    q, k, v, g, g_gamma, scale, initial_state, output_final_state, state_v_first, cu_seqlens, mixed_qkv=False, **own
) -> dict:
    """The call both entry points hand their registry, after the checks they share: ``scale`` resolved,
    ``output_final_state`` a bool, tensors strided in their last dimension copied, then the entry point's ``own``
    arguments (a ``cu_seqlens_cpu`` among them is checked with ``cu_seqlens``); ``mixed_qkv`` as
    ``check_simple_gla_inputs``'."""
    q, k, v, g, g_gamma, initial_state, cu_seqlens = contiguous_reads(q, k, v, g, g_gamma, initial_state, cu_seqlens)
    check_simple_gla_inputs(
        q,
        k,
        v,
        g,
        g_gamma,
        initial_state=initial_state,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=own.get("cu_seqlens_cpu"),
        mixed_qkv=mixed_qkv,
    )
    return dict(
        q=q,
        k=k,
        v=v,
        g=g,
        g_gamma=g_gamma,
        scale=check_scale(scale, q.shape[-1]),
        initial_state=initial_state,
        output_final_state=bool(output_final_state),
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        **own,
    )


def chunk_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Chunked Simple GLA, keyword-compatible with ``fla.ops.simple_gla.chunk_simple_gla`` (fla-core 0.6.0).

    ``S_t = exp(gate_t) S_{t-1} + k_t v_t^T``, ``o_t = scale * S_t^T q_t``, with the gate from ``g``
    (data-dependent) or ``g_gamma`` (constant per head; Lightning attention is ``g_gamma = -decay``).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (GVA when ``HV > H``).
        g: ``[B, T, HV]`` log decay, or g_gamma: ``[HV]`` log decay (<= 0; any shape of HV elements, read flat);
            neither means no decay.
        initial_state: fp32 ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``); bf16 / fp16 read as fp32.
        cu_seqlens / cu_seqlens_cpu: packed varlen boundaries ``[N+1]`` (B must be 1).
        **kwargs: ``chunk_size`` (a power of 2) and the deprecated ``transpose_state_layout``.

    Returns:
        ``(o [B, T, HV, V] in q.dtype, final_state fp32 or None)``. Differentiable (q, k, v, g, h0).
    """
    initial_state = state_fp32(initial_state)  # FLA reads a bf16 / fp16 state as fp32
    g_gamma = _constant(g_gamma)
    if is_compiling() and _custom_ops.routes():  # torch.compile traces the cula::chunk_simple_gla op instead
        return _custom_ops.chunk_simple_gla(
            q, k, v, g, g_gamma, scale, initial_state, output_final_state, state_v_first, cu_seqlens, cu_seqlens_cpu,
            **kwargs,
        )  # fmt: skip
    if g is None and cu_seqlens is None and cu_seqlens_cpu is None and not kwargs and not is_compiling():
        key = _plan_key(q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first)
        if key is not None:
            launch = _plans.get(key)
            if launch is None:
                args = _checked_args(q, k, v, None, g_gamma, scale, initial_state, output_final_state,
                                     bool(state_v_first), None, cu_seqlens_cpu=None, chunk_size=None)  # fmt: skip
                if any(args[n] is not x for n, x in zip(_PLANNED, (q, k, v, g_gamma, initial_state))):
                    # a tensor strided in its last dimension was copied: such calls take the general path each time
                    return chunk_simple_gla_registry.dispatch(q.device, args)
                launch = chunk_simple_gla_registry.plan(q.device, args, positional=_PLANNED)
                if not capturing(q):  # (as chunk_kda's: a plan made under capture serves that call only)
                    _plans.put(key, launch)
            return launch(q, k, v, g_gamma, initial_state)
    if g is None and cu_seqlens is not None and cu_seqlens_cpu is not None and not kwargs and not is_compiling():
        key = _packed_plan_key(q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first, cu_seqlens,
                               cu_seqlens_cpu)  # fmt: skip
        if key is not None:
            launch = _plans.get(key)
            if launch is not None:
                check_planned_boundaries(cu_seqlens, cu_seqlens_cpu, q.shape[1])  # before any launch
                return launch(q, k, v, g_gamma, initial_state, cu_seqlens, cu_seqlens_cpu)
            args = _checked_args(q, k, v, None, g_gamma, scale, initial_state, output_final_state, bool(state_v_first),
                                 cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=None)  # fmt: skip
            given = (q, k, v, g_gamma, initial_state, cu_seqlens)
            if any(args[n] is not x for n, x in zip(_PLANNED_PACKED, given)):
                return chunk_simple_gla_registry.dispatch(q.device, args)  # a copied input: the general path each time
            launch = chunk_simple_gla_registry.plan(q.device, args, positional=_PLANNED_PACKED)
            if not capturing(q) and q.shape[1] > 0:  # (an empty pack plans the general launch: not for its signature)
                _plans.put(key, launch)
            return launch(q, k, v, g_gamma, initial_state, cu_seqlens, cu_seqlens_cpu)
    extra = take_extra_kwargs(
        "chunk_simple_gla", kwargs, ("chunk_size", "transpose_state_layout", "head_first")
    )
    check_head_first(extra)
    state_v_first = resolve_state_layout("chunk_simple_gla", state_v_first, extra)
    chunk_size = extra.get("chunk_size")
    if chunk_size is not None and (
        not isinstance(chunk_size, int) or chunk_size < 1 or chunk_size & (chunk_size - 1)
    ):
        raise ValueError(f"`chunk_size` must be a power of 2, got {chunk_size}")
    args = _checked_args(
        q, k, v, g, g_gamma, scale, initial_state, output_final_state, state_v_first, cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=chunk_size,
    )  # fmt: skip
    return chunk_simple_gla_registry.dispatch(q.device, args)


def planned_launch(q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first):
    """The launch ``chunk_simple_gla`` planned for a fixed-length call of this signature (``g_gamma`` flat,
    ``initial_state`` fp32, as ``chunk_simple_gla`` makes them), taking ``(q, k, v, g_gamma, initial_state)``; None
    when there is none yet (``lightning_attn_fwd``'s fast path: a planned signature needs none of its checks)."""
    key = _plan_key(q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first)
    return None if key is None else _plans.get(key)


def _plan_key(q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first) -> tuple | None:
    """The plan-cache key of a fixed-length call with a constant (or no) decay: everything validation and backend
    selection read (each tensor's ``tensor_sig``, the flags, whether autograd records the call, inference mode,
    ``CULA_BACKEND``), or None where the call is validated in full every time (scalars of other types)."""
    scalars = scalars_key((scale, output_final_state, state_v_first))
    if scalars is None:
        return None
    try:  # written out: this runs for every call
        grad = torch.is_grad_enabled() and bool(
            q.requires_grad or k.requires_grad or v.requires_grad
            or (initial_state is not None and initial_state.requires_grad)
        )  # fmt: skip
        sigs = (tensor_sig(q), tensor_sig(k), tensor_sig(v), tensor_sig(g_gamma), tensor_sig(initial_state))
    except AttributeError:  # not tensors: validation says what is wrong
        return None
    except RuntimeError:  # tensors without storage (torch.func transforms): no address to key on
        return None
    return (*sigs, *scalars, grad, torch.is_inference_mode_enabled(), forced_backend())


def _packed_plan_key(q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first, cu_seqlens,
                     cu_seqlens_cpu) -> tuple | None:  # fmt: skip
    """``_plan_key`` of a packed call without its total length (which changes from call to call), or None (validated
    in full) unless q, k and v are row-major tensors of one length."""
    scalars = scalars_key((scale, output_final_state, state_v_first))
    if scalars is None:
        return None
    try:  # written out: this runs for every packed call
        qs, ks, vs = q.shape, k.shape, v.shape
        T = qs[1]
        # row-major exactly, size-1 dims included (B is 1; is_contiguous would let any stride of theirs through, and the
        # key holds no strides): the layout the first call's bound launch was made for and the general path copies to
        if ks[1] != T or vs[1] != T or not (is_row_major(q) and is_row_major(k) and is_row_major(v)):
            return None
        grad = torch.is_grad_enabled() and bool(
            q.requires_grad or k.requires_grad or v.requires_grad
            or (initial_state is not None and initial_state.requires_grad)
        )  # fmt: skip
        return (
            qs[0], qs[2:], q.dtype, q.device, q.data_ptr() & 15, ks[0], ks[2:], k.dtype, k.device, k.data_ptr() & 15,
            vs[0], vs[2:], v.dtype, v.device, v.data_ptr() & 15, tensor_sig(g_gamma), tensor_sig(initial_state),
            tensor_sig(cu_seqlens), cu_seqlens_cpu.shape, cu_seqlens_cpu.dtype, cu_seqlens_cpu.device, *scalars, grad,
            torch.is_inference_mode_enabled(), forced_backend(),
        )  # fmt: skip
    except (AttributeError, IndexError, TypeError):
        return None  # not tensors of at least two dimensions: validation says what is wrong
    except RuntimeError:
        return None  # tensors without storage (torch.func transforms)


def fused_recurrent_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Recurrent Simple GLA, keyword-compatible with FLA 0.6.0 ``fused_recurrent_simple_gla``.

    Same arguments as :func:`chunk_simple_gla`, plus ``reverse`` (run each sequence from its end), except that q, k,
    v may each have their own float dtype, float64 included, as FLA's kernel reads each as fp32 (o comes in q's
    dtype, as FLA's; there is no cula kernel of this form: FLA's runs on CUDA, the reference elsewhere), and so may
    ``initial_state``. **kwargs: only the deprecated ``transpose_state_layout``.
    """
    initial_state = state_fp32(initial_state)  # FLA reads a bf16 / fp16 / float64 state as fp32
    g_gamma = _constant(g_gamma)
    if is_compiling() and _custom_ops.routes():  # torch.compile traces the cula::fused_recurrent_simple_gla op
        return _custom_ops.fused_recurrent_simple_gla(
            q, k, v, g, g_gamma, scale, initial_state, output_final_state, reverse, state_v_first, cu_seqlens,
            **kwargs,
        )  # fmt: skip
    extra = take_extra_kwargs("fused_recurrent_simple_gla", kwargs, ("transpose_state_layout",))
    state_v_first = resolve_state_layout("fused_recurrent_simple_gla", state_v_first, extra)
    args = _checked_args(
        q, k, v, g, g_gamma, scale, initial_state, output_final_state, state_v_first, cu_seqlens, mixed_qkv=True,
        reverse=bool(reverse),
    )  # fmt: skip
    return fused_recurrent_simple_gla_registry.dispatch(q.device, args)
