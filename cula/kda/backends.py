"""Backends of the KDA entry points, tried in priority order (see ``cula.backends``).

- ``cula-sm90``: our CuTe DSL state/output kernel on Hopper after FLA's Triton intra-chunk stage,
  for inference (no autograd yet), bf16, K = V = 128, chunk 64 (fp16 compiles but is not yet GPU-tested).
- ``fla``: FLA 0.6.0's Triton kernels, for everything our kernels do not cover yet on CUDA.
- ``reference``: float32 PyTorch (``cula.kda.naive``); the CPU path, differentiable.
"""

from __future__ import annotations

import torch

from cula.backends import Registry, always, cula_kernels_on, needs_grad, package_on_cuda

chunk_kda_registry = Registry("kda.chunk_kda")
fused_recurrent_kda_registry = Registry("kda.fused_recurrent_kda")

CULA_PRIORITY = 10
FLA_PRIORITY = 50
REFERENCE_PRIORITY = 90


def _cula_chunk_supports(
    q,
    k,
    v,
    g,
    beta,
    initial_state,
    A_log,
    dt_bias,
    chunk_size,
    cp_context=None,
    use_graph=False,
    return_intermediate_states=False,
    cu_seqlens=None,
    state_v_first=False,
    **_,
) -> tuple:
    if needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias):
        return False, "training (autograd) runs on fla until cula's backward lands"
    if q.dtype != torch.bfloat16:
        return False, f"q dtype {q.dtype} (kernel path is validated for bf16)"
    if q.shape[-1] != 128 or v.shape[-1] != 128:
        return False, f"head sizes K={q.shape[-1]} V={v.shape[-1]} (kernel takes K=V=128)"
    if chunk_size != 64:
        return False, f"chunk_size={chunk_size} (kernel takes 64)"
    if cp_context is not None or use_graph or return_intermediate_states:
        return False, "cp_context / use_graph / return_intermediate_states run on fla"
    return True, None


# The intra-chunk stage still comes from FLA's Triton kernels, hence needs=("fla",).
@chunk_kda_registry.register(
    "cula-sm90",
    CULA_PRIORITY,
    available=cula_kernels_on((9, 0), needs=("fla",)),
    supports=_cula_chunk_supports,
)
def _chunk_kda_cula_sm90(
    q,
    k,
    v,
    g,
    beta,
    scale,
    initial_state,
    output_final_state,
    use_qk_l2norm_in_kernel,
    use_gate_in_kernel,
    use_beta_sigmoid_in_kernel,
    allow_neg_eigval,
    safe_gate,
    lower_bound,
    state_v_first,
    cu_seqlens,
    cu_seqlens_cpu,
    A_log,
    dt_bias,
    chunk_size,
    **_unused,
):
    from cula.ops.kda.sm90.chunk_fwd import chunk_kda_fwd_sm90

    # q/k L2 norm and the beta sigmoid happen inside (fused into cula's intra kernel where it runs, see chunk_fwd)
    return chunk_kda_fwd_sm90(
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_size=chunk_size,
        use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound if use_gate_in_kernel else None,
        safe_gate=safe_gate,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
    )


def _reference_chunk_supports(
    cp_context=None, use_graph=False, return_intermediate_states=False, **_
) -> tuple:
    if cp_context is not None:
        return False, "cp_context (context parallel) is only run by the fla backend"
    if use_graph:
        return False, "use_graph is only run by the fla backend"
    if return_intermediate_states:
        return False, "return_intermediate_states is only run by the fla backend"
    return True, None


@chunk_kda_registry.register("fla", FLA_PRIORITY, available=package_on_cuda("fla"))
def _chunk_kda_fla(**args):
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    return fla_chunk_kda(**args)


# The arguments of the public functions that the math depends on; the rest (safe_gate, disable_recompute,
# cu_seqlens_cpu, chunk_size) change how FLA schedules its work, not the result.
_REFERENCE_ARGS = (
    "scale", "initial_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
    "allow_neg_eigval", "A_log", "dt_bias", "state_v_first", "cu_seqlens",
)  # fmt: skip


def _reference(form: str, args: dict, output_final_state: bool):
    from cula.kda.naive import reference_chunk_kda

    return reference_chunk_kda(
        args["q"], args["k"], args["v"], args["g"], args["beta"], form=form,
        output_final_state=output_final_state,
        # FLA applies lower_bound only through the fused gate
        lower_bound=args["lower_bound"] if args["use_gate_in_kernel"] else None,
        **{name: args[name] for name in _REFERENCE_ARGS},
    )  # fmt: skip


@chunk_kda_registry.register(
    "reference", REFERENCE_PRIORITY, available=always, supports=_reference_chunk_supports
)
def _chunk_kda_reference(**args):
    return _reference("chunk", args, args["output_final_state"])


def _reference_recurrent_supports(ssm_state_indices=None, num_accepted_tokens=None, out=None, **_) -> tuple:
    if ssm_state_indices is not None or num_accepted_tokens is not None:
        return False, "state-pool decode (ssm_state_indices / num_accepted_tokens) needs a CUDA backend"
    if out is not None:
        return False, "a preallocated `out` needs a CUDA backend"
    return True, None


@fused_recurrent_kda_registry.register("fla", FLA_PRIORITY, available=package_on_cuda("fla"))
def _fused_recurrent_kda_fla(**args):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    return fused_recurrent_kda_fwd(**args)


@fused_recurrent_kda_registry.register(
    "reference", REFERENCE_PRIORITY, available=always, supports=_reference_recurrent_supports
)
def _fused_recurrent_kda_reference(**args):
    initial_state, inplace_final_state = args["initial_state"], args["inplace_final_state"]
    o, final = _reference("recurrent", args, args["output_final_state"] or inplace_final_state)
    if inplace_final_state:
        with torch.no_grad():
            initial_state.copy_(final)
        final = initial_state
    return o, final
