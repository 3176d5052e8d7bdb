"""Backends of the Gated DeltaNet entry points (see ``cula.backends``): ``fla`` on CUDA, ``reference``."""

from __future__ import annotations

from cula.backends import Registry, always, package_on_cuda

chunk_gdn_registry = Registry("gated_delta_rule.chunk_gated_delta_rule")
fused_recurrent_gdn_registry = Registry("gated_delta_rule.fused_recurrent_gated_delta_rule")

FLA_PRIORITY = 50
REFERENCE_PRIORITY = 90


def _reference_chunk_supports(cp_context=None, **_) -> tuple:
    if cp_context is not None:
        return False, "cp_context (context parallel) is only run by the fla backend"
    return True, None


@chunk_gdn_registry.register("fla", FLA_PRIORITY, available=package_on_cuda("fla"))
def _chunk_fla(**args):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(**args)


@chunk_gdn_registry.register(
    "reference", REFERENCE_PRIORITY, available=always, supports=_reference_chunk_supports
)
def _chunk_reference(
    q,
    k,
    v,
    g,
    beta,
    scale,
    initial_state,
    output_final_state,
    use_qk_l2norm_in_kernel,
    use_beta_sigmoid_in_kernel,
    allow_neg_eigval,
    state_v_first,
    cu_seqlens,
    use_gate_in_kernel,
    A_log,
    dt_bias,
    **_unused_by_reference,
):
    from cula.gated_delta_rule.naive import reference_chunk_gated_delta_rule

    return reference_chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log,
        dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
    )


@fused_recurrent_gdn_registry.register("fla", FLA_PRIORITY, available=package_on_cuda("fla"))
def _recurrent_fla(**args):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    return fused_recurrent_gated_delta_rule(**args)


@fused_recurrent_gdn_registry.register("reference", REFERENCE_PRIORITY, available=always)
def _recurrent_reference(**args):
    from cula.gated_delta_rule.naive import reference_fused_recurrent_gated_delta_rule

    return reference_fused_recurrent_gated_delta_rule(**args)
