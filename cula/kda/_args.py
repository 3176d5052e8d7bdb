"""Validation and dispatch shared by the KDA entry points (chunk and fused recurrent)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cula._validate import (
    FLOAT_DTYPES,
    check_cu_seqlens,
    check_lower_bound,
    check_qkv,
    check_scale,
    check_state,
    check_tensor,
    copying_reads,
)


def check_kda_inputs(
    q,
    k,
    v,
    g,
    beta,
    *,
    initial_state,
    state_v_first,
    cu_seqlens,
    cu_seqlens_cpu,
    A_log,
    dt_bias,
    use_gate_in_kernel,
    lower_bound,
    use_beta_sigmoid_in_kernel,
    allow_neg_eigval,
    beta_per_value=False,
    partial_cu_seqlens=False,
    state_dtypes=(torch.float32,),
    mixed_qkv=False,
) -> int:
    """Check KDA arguments (FLA 0.6.0 rules plus dtype/device/layout checks); return N sequences.
    ``partial_cu_seqlens``: the packed sequences may end before the last token (FLA's graph mode). ``state_dtypes``:
    the dtypes ``initial_state`` may have (fp32; the recurrent form's in-place state also bf16 / fp16).
    ``mixed_qkv``: q, k, v of any float dtypes (the recurrent forms: ``check_qkv``'s ``mixed``)."""
    # (the recurrent forms, mixed_qkv, take any K as FLA's recurrent kernel does; its chunk form asserts K <= 256)
    B, T, H, K, HV, V = check_qkv(q, k, v, head_limit=None if mixed_qkv else 256, mixed=mixed_qkv)
    device = q.device
    check_tensor("g", g, shape=(B, T, HV, K), dtypes=FLOAT_DTYPES, device=device)
    if beta_per_value and isinstance(beta, torch.Tensor) and beta.dim() == 4:
        check_tensor("beta", beta, shape=(B, T, HV, V), dtypes=FLOAT_DTYPES, device=device)
    else:
        check_tensor("beta", beta, shape=(B, T, HV), dtypes=FLOAT_DTYPES, device=device)
    N = check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, batch=B, total=T, device=device, partial=partial_cu_seqlens)
    check_state(
        "initial_state", initial_state, n=N, heads=HV, k=K, v=V, state_v_first=state_v_first, device=device,
        dtypes=state_dtypes,
    )
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise ValueError(
                "`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set"
            )
        if A_log is not None:
            check_tensor("A_log", A_log, shape=(HV,), dtypes=(torch.float32,), device=device)
        if dt_bias is not None:
            check_tensor("dt_bias", dt_bias, dtypes=(torch.float32,), device=device)
            if dt_bias.numel() != HV * K:
                raise ValueError(
                    f"`dt_bias` must have HV*K={HV * K} elements ([HV*K]), got {list(dt_bias.shape)}"
                )
    check_lower_bound(lower_bound)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`")
    return N


def dispatch_kda_call(registry, plans, key: tuple | None, call: dict[str, Any], checked: Callable[[dict], dict]):
    """Run a KDA entry point's call on ``registry``.

    ``checked(call)`` validates in full and returns the dispatch arguments. With ``key`` None every call is
    validated; otherwise ``plans`` (a ``cula.backends.PlanCache``) keeps, per key, the launch chosen after the
    first call's full validation, and later calls with that key go straight to it.
    """
    if key is None:
        args = checked(call)
        return registry.dispatch(args["q"].device, args)

    def plan():
        args = checked(dict(call))
        launch = registry.plan(args["q"].device, args)
        copied = any(isinstance(t, torch.Tensor) and args[n] is not t for n, t in call.items())
        return copying_reads(launch) if copied else launch

    launch = plans.lookup(key, plan)
    call["scale"] = check_scale(call["scale"], call["q"].shape[-1])
    return launch(**call)
