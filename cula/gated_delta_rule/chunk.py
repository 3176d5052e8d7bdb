"""``cula.gated_delta_rule.chunk_gated_delta_rule``: FLA 0.6.0's chunked Gated DeltaNet."""

from __future__ import annotations

import torch
from torch.compiler import is_compiling

from cula import _custom_ops
from cula._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_cu_seqlens,
    check_head_first,
    check_planned_boundaries,
    check_qkv,
    check_scale,
    check_state,
    check_tensor,
    contiguous_reads,
    gate_kwargs_fp32,
    resolve_state_layout,
    state_fp32,
    take_extra_kwargs,
)
from cula.backends import (
    PlanCache, capturing, env_reader, forced_backend, scalars_key, tensor_sig, token_sigs, varlen_token_sigs,
)  # fmt: skip
from cula.gated_delta_rule.backends import chunk_gdn_registry

# Fixed-length and packed calls skip validation and backend selection when their signature repeats: the first call of
# a signature is validated in full and planned (chunk_gdn_registry.plan); later ones go straight to that launch.
_plans = PlanCache()
_PLANNED = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
_PACKED = ("cu_seqlens", "cu_seqlens_cpu")  # a packed call's plan takes them after _PLANNED
_PLANNED_KWARGS = frozenset(("use_gate_in_kernel", "A_log", "dt_bias"))
# a plan binds the intra kernel's launch, which CULA_KDA_INTRA=0 turns off (read per call by the general path)
_read_intra_mode = env_reader("CULA_KDA_INTRA")

_EXTRA_KWARGS = (
    "use_gate_in_kernel",
    "A_log",
    "dt_bias",
    "chunk_size",
    "transpose_state_layout",
    "head_first",
)


def check_gdn_inputs(q, k, v, g, beta, *, initial_state, state_v_first, cu_seqlens, cu_seqlens_cpu,
                     beta_per_value: bool = False, mixed_qkv: bool = False) -> int:  # fmt: skip
    """Shapes of the scalar-gate delta rule: g ``[B, T, HV]`` (or None), beta ``[B, T, HV]`` (or None; also
    ``[B, T, HV, V]`` with ``beta_per_value``, as FLA's recurrent form takes it); ``mixed_qkv``: q, k, v of any float
    dtypes (the recurrent form: ``check_qkv``'s ``mixed``)."""
    # (the recurrent form, mixed_qkv, takes any K as FLA's recurrent kernel does; its chunk form asserts K <= 256)
    B, T, H, K, HV, V = check_qkv(q, k, v, head_limit=None if mixed_qkv else 256, mixed=mixed_qkv)
    device = q.device
    if g is not None:
        check_tensor("g", g, shape=(B, T, HV), dtypes=FLOAT_DTYPES, device=device)
    if beta is not None:
        per_value = beta_per_value and isinstance(beta, torch.Tensor) and beta.dim() == 4
        check_tensor(
            "beta", beta, shape=(B, T, HV, V) if per_value else (B, T, HV), dtypes=FLOAT_DTYPES, device=device
        )
    n = check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, batch=B, total=T, device=device)
    check_state(
        "initial_state", initial_state, n=n, heads=HV, k=K, v=V, state_v_first=state_v_first, device=device
    )
    return n


def check_gdn_activations(
    q, v, g, A_log, dt_bias, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval
) -> None:
    """The in-kernel activations' arguments: with ``use_gate_in_kernel`` the raw ``g`` and fp32 ``A_log [HV]``
    (and ``dt_bias [HV]`` if given); ``allow_neg_eigval`` only with ``use_beta_sigmoid_in_kernel``."""
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True`")
        if g is None:
            raise ValueError("`g` (raw pre-activation) must be provided when `use_gate_in_kernel=True`")
        HV = v.shape[2]
        check_tensor("A_log", A_log, shape=(HV,), dtypes=(torch.float32,), device=q.device)
        if dt_bias is not None:
            check_tensor("dt_bias", dt_bias, shape=(HV,), dtypes=(torch.float32,), device=q.device)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`")


def chunk_gated_delta_rule(
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
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Chunked Gated DeltaNet, keyword-compatible with ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``.

    Per value head: ``S <- exp(g_t) S; S <- S + beta_t k_t (v_t - S^T k_t)^T; o_t = S^T (scale q_t)``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (GVA when ``HV > H``).
        g: ``[B, T, HV]`` log-space decay (raw logits with ``use_gate_in_kernel=True``:
            ``-exp(A_log) * softplus(g + dt_bias)``, ``A_log`` and ``dt_bias`` fp32 ``[HV]``).
        beta: ``[B, T, HV]`` (logits with ``use_beta_sigmoid_in_kernel``; ``2 * sigmoid`` with ``allow_neg_eigval``).
        initial_state: fp32 ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``); bf16 / fp16 read as fp32.
        cu_seqlens / cu_seqlens_cpu / chunk_indices: packed varlen boundaries (B must be 1).
        **kwargs: ``use_gate_in_kernel``, ``A_log``, ``dt_bias``, ``chunk_size`` (16, 32 or 64) and the
            deprecated ``transpose_state_layout``; anything else raises ``TypeError``.

    Returns:
        ``(o [B, T, HV, V] in q.dtype, final_state fp32 or None)``.
    """
    if kwargs:  # FLA's kernels take bf16 / fp16 A_log and dt_bias (a model cast to bf16): fp32 from here on
        kwargs = gate_kwargs_fp32(kwargs)
    initial_state = state_fp32(initial_state)
    if is_compiling() and _custom_ops.routes():  # torch.compile traces the cula::chunk_gated_delta_rule op instead
        return _custom_ops.chunk_gated_delta_rule(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, cu_seqlens_cpu, chunk_indices,
            cp_context, **kwargs,
        )  # fmt: skip
    # a repeated signature (fixed length, or packed with the boundaries' host copy) skips validation and selection
    if ((cu_seqlens is None) == (cu_seqlens_cpu is None) and chunk_indices is None and cp_context is None
            and kwargs.keys() <= _PLANNED_KWARGS and not is_compiling()):  # fmt: skip
        A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
        flags = (scale, output_final_state, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                 state_v_first, kwargs.get("use_gate_in_kernel", False))  # fmt: skip
        key = _plan_key(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu, flags)
        if key is not None:
            planned = (q, k, v, g, beta, initial_state, A_log, dt_bias)
            launch = _plans.get(key)
            if launch is None:
                args = _checked(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                                use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens,
                                cu_seqlens_cpu, None, None, dict(kwargs))  # fmt: skip
                if any(args[n] is not x for n, x in zip(_PLANNED + _PACKED, planned + (cu_seqlens, cu_seqlens_cpu))):
                    # a tensor strided in its last dimension was copied: such calls take the general path each time
                    return chunk_gdn_registry.dispatch(q.device, args)
                launch = chunk_gdn_registry.plan(q.device, args, positional=_PLANNED + _PACKED * (cu_seqlens
                                                                                                  is not None))
                if not capturing(q):  # (as chunk_kda's: a plan made under capture serves that call only)
                    _plans.put(key, launch)
            elif cu_seqlens is not None:  # the boundaries' values, which the key does not hold (before any launch)
                check_planned_boundaries(cu_seqlens, cu_seqlens_cpu, q.shape[1])
            if cu_seqlens is None:
                return launch(*planned)
            return launch(*planned, cu_seqlens, cu_seqlens_cpu)
    args = _checked(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                    use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, cu_seqlens_cpu,
                    chunk_indices, cp_context, kwargs)  # fmt: skip
    return chunk_gdn_registry.dispatch(q.device, args)


def _checked(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
             use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, cu_seqlens_cpu, chunk_indices,
             cp_context, kwargs: dict) -> dict:  # fmt: skip
    """Validate a call in full (FLA's rules plus dtype / device / layout checks); returns the dispatch arguments, a
    tensor strided in its last dimension replaced by its row-major copy."""
    extra = take_extra_kwargs("chunk_gated_delta_rule", kwargs, _EXTRA_KWARGS)
    check_head_first(extra)
    state_v_first = resolve_state_layout("chunk_gated_delta_rule", state_v_first, extra)
    chunk_size = extra.get("chunk_size", 64)
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {chunk_size}")
    use_gate_in_kernel = bool(extra.get("use_gate_in_kernel", False))
    A_log, dt_bias = extra.get("A_log"), extra.get("dt_bias")
    q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, chunk_indices = contiguous_reads(
        q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, chunk_indices
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
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    if g is None or beta is None:
        raise ValueError("`g` and `beta` are required for chunk_gated_delta_rule")
    check_gdn_activations(
        q, v, g, A_log, dt_bias, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval
    )
    if chunk_indices is not None:
        check_tensor("chunk_indices", chunk_indices, ndim=2, dtypes=INDEX_DTYPES, device=q.device)
    if cp_context is not None and (initial_state is not None or output_final_state):
        raise ValueError("`cp_context` cannot be combined with `initial_state` or `output_final_state`")
    args = dict(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        scale=check_scale(scale, q.shape[-1]),
        initial_state=initial_state,
        output_final_state=bool(output_final_state),
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid_in_kernel),
        allow_neg_eigval=bool(allow_neg_eigval),
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_indices=chunk_indices,
        cp_context=cp_context,
        use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log,
        dt_bias=dt_bias,
        chunk_size=chunk_size,
    )
    return args


def _plan_key(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu,
              flags: tuple) -> tuple | None:  # fmt: skip
    """The plan-cache key of a call: everything validation and backend selection read (each tensor's
    ``tensor_sig``, the flags with their types, whether autograd records the call, inference mode,
    ``CULA_BACKEND``, ``CULA_KDA_INTRA``), or None where the call is validated in full every time (scalars of other
    types, not tensors, tensors without storage). A packed call's leaves out its total length (and its boundaries'
    values, checked every call), as chunk_kda's does; it needs contiguous token tensors."""
    scalars = scalars_key(flags)
    if scalars is None:
        return None
    tokens = None
    if cu_seqlens is not None:
        tokens = varlen_token_sigs(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu)
        if tokens is None:
            return None
    try:  # written out: this runs for every call
        grad = torch.is_grad_enabled() and bool(
            q.requires_grad or k.requires_grad or v.requires_grad or g.requires_grad or beta.requires_grad
            or (initial_state is not None and initial_state.requires_grad)
            or (A_log is not None and A_log.requires_grad) or (dt_bias is not None and dt_bias.requires_grad)
        )  # fmt: skip
        sigs = (*(tokens or token_sigs(q, k, v, g, beta)), tensor_sig(initial_state), tensor_sig(A_log),
                tensor_sig(dt_bias))  # fmt: skip
    except (AttributeError, RuntimeError):  # not tensors, or without storage (torch.func transforms)
        return None
    return (*sigs, *scalars, grad, torch.is_inference_mode_enabled(), forced_backend(), _read_intra_mode())
