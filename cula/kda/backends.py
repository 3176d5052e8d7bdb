"""Backends of the KDA entry points, tried in priority order (see ``cula.backends``).

- ``cula-sm90``: ``chunk_kda``: our CuTe DSL kernels on Hopper (see ``cula.ops.kda.sm90.chunk_fwd``), for
  inference (no autograd yet), bf16, K = V = 128, chunk 64 (fp16 compiles but is not yet GPU-tested);
  ``fused_recurrent_kda``: FLA's in-place state-pool decode form with one token per sequence, on the
  ``kda_decode`` kernel.
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


# fp16 q/k/v on the cula-sm90 kernels (tests/test_gpu_api.py::test_chunk_kda_fp16_cuda passed on the H200,
# 2026-11-30); False sends fp16 to FLA
CHUNK_FP16_ON_CULA = True


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
    if q.dtype != torch.bfloat16 and not (CHUNK_FP16_ON_CULA and q.dtype == torch.float16):
        return False, f"q dtype {q.dtype} (kernel path is validated for bf16)"
    if q.shape[-1] != 128 or v.shape[-1] != 128:
        return False, f"head sizes K={q.shape[-1]} V={v.shape[-1]} (kernel takes K=V=128)"
    if chunk_size != 64:
        return False, f"chunk_size={chunk_size} (kernel takes 64)"
    if cp_context is not None or use_graph or return_intermediate_states:
        return False, "cp_context / use_graph / return_intermediate_states run on fla"
    return True, None


def _cula_chunk_args(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
    use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_v_first, cu_seqlens, A_log, dt_bias,
    chunk_size, **_unused,
):  # fmt: skip
    """The dispatch arguments as ``chunk_kda_fwd_sm90`` and its ``prepare_`` twin take them."""
    return {
        "q": q, "k": k, "v": v, "g": g, "beta": beta, "scale": scale, "initial_state": initial_state,
        "output_final_state": output_final_state, "state_v_first": state_v_first, "cu_seqlens": cu_seqlens,
        "chunk_size": chunk_size, "use_gate_in_kernel": use_gate_in_kernel, "A_log": A_log, "dt_bias": dt_bias,
        "lower_bound": lower_bound if use_gate_in_kernel else None, "safe_gate": safe_gate,
        "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel, "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel,
        "allow_neg_eigval": allow_neg_eigval,
    }  # fmt: skip


def _prepare_chunk_kda_cula_sm90(**args):
    """The bound launch of a repeated fixed-length call (see ``prepare_chunk_kda_fwd_sm90``), or None."""
    from cula.ops.kda.sm90.chunk_fwd import prepare_chunk_kda_fwd_sm90

    return prepare_chunk_kda_fwd_sm90(**_cula_chunk_args(**args))


# The intra-chunk stage still comes from FLA's Triton kernels, hence needs=("fla",).
@chunk_kda_registry.register(
    "cula-sm90",
    CULA_PRIORITY,
    available=cula_kernels_on((9, 0), needs=("fla",)),
    supports=_cula_chunk_supports,
    prepare=_prepare_chunk_kda_cula_sm90,
)
def _chunk_kda_cula_sm90(cu_seqlens_cpu=None, **args):
    from cula.ops.kda.sm90.chunk_fwd import chunk_kda_fwd_sm90

    # q/k L2 norm and the beta sigmoid happen inside (fused into cula's intra kernel where it runs, see chunk_fwd)
    return chunk_kda_fwd_sm90(cu_seqlens_cpu=cu_seqlens_cpu, **_cula_chunk_args(**args))


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


def _cula_recurrent_supports(
    q, k, v, g, beta, A_log, dt_bias, initial_state, inplace_final_state, cu_seqlens, ssm_state_indices,
    num_accepted_tokens, use_gate_in_kernel, lower_bound, state_v_first, **_,
) -> tuple:  # fmt: skip
    """FLA's serving call that is exactly one ``kda_decode`` step: [N, 1] tokens, an fp32 pool, int32 [N] rows."""
    from cula._validate import FLOAT_DTYPES, pool_layout_verdict

    if ssm_state_indices is None or not inplace_final_state:
        return False, "only the in-place state-pool form (ssm_state_indices, inplace_final_state=True) runs on cula"
    if cu_seqlens is not None:
        # [1, N] packed with one token per sequence: exact only if no sequence is empty, which the device knows
        return False, "cu_seqlens (the packed [1, N] form) runs on fla; pass q as [N, 1, H, K] for cula's kernel"
    if num_accepted_tokens is not None:
        return False, "num_accepted_tokens (speculative verify) runs on fla; cula's is kda_decode(step_states=...)"
    if q.shape[1] != 1:
        return False, f"{q.shape[1]} tokens per sequence with a state pool run on fla (cula's kernel: one)"
    if ssm_state_indices.ndim != 1 or ssm_state_indices.dtype != torch.int32:
        return False, "ssm_state_indices must be int32 [N] for cula's kernel"
    if q.dtype not in (torch.bfloat16, torch.float16) or g.dtype not in FLOAT_DTYPES:
        return False, f"q dtype {q.dtype} / g dtype {g.dtype} (kernel takes bf16/fp16 q, float g)"
    if beta.ndim == v.ndim or beta.dtype not in (torch.float32, torch.bfloat16):
        return False, "per-channel beta, or beta not fp32/bf16, runs on fla"
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        return False, "the softplus gate without A_log (FLA's default coefficient) runs on fla"
    if any(t is not None and t.dtype != torch.float32 for t in (A_log, dt_bias)):
        return False, "A_log / dt_bias not fp32 run on fla"
    if initial_state.dtype != torch.float32 or initial_state.ndim != 4:
        return False, "the state pool must be fp32 [P, HV, ...] for cula's kernel"
    if (q.shape[-1], v.shape[-1]) not in ((64, 64), (128, 128)):
        return False, f"head sizes K={q.shape[-1]} V={v.shape[-1]} (kernel takes K = V in {{64, 128}})"
    return pool_layout_verdict(initial_state, q.shape[-1], v.shape[-1], state_v_first)


# Serving engines call FLA's fused_recurrent_kda_fwd once per token; the [N, 1] pool form is exactly kda_decode.
@fused_recurrent_kda_registry.register(
    "cula-sm90", CULA_PRIORITY, available=cula_kernels_on((9, 0)), supports=_cula_recurrent_supports
)
def _fused_recurrent_kda_cula_sm90(
    q, k, v, g, beta, A_log, dt_bias, initial_state, scale, ssm_state_indices, use_qk_l2norm_in_kernel,
    use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first, out, **_,
):  # fmt: skip
    from cula.kda.decode import kda_decode

    o = kda_decode(
        q, k, v, g, beta, initial_state, ssm_state_indices, A_log=A_log, dt_bias=dt_bias, scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, state_v_first=state_v_first, out=out, check_indices=False,
    )  # fmt: skip
    return o, initial_state


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
