"""Backends of the Simple GLA entry points (see ``cula.backends``).

``cula.ops.lightning`` registers its Hopper kernel on ``chunk_simple_gla_registry`` for the constant
``g_gamma`` case; ``fla`` covers the rest on CUDA and ``reference`` runs on the CPU.
"""

from __future__ import annotations

from cula.backends import Registry, always, package_on_cuda

chunk_simple_gla_registry = Registry("simple_gla.chunk_simple_gla")
fused_recurrent_simple_gla_registry = Registry("simple_gla.fused_recurrent_simple_gla")

FLA_PRIORITY = 50
REFERENCE_PRIORITY = 90


@chunk_simple_gla_registry.register("fla", FLA_PRIORITY, available=package_on_cuda("fla"))
def _chunk_fla(**args):
    from fla.ops.simple_gla import chunk_simple_gla

    return chunk_simple_gla(**args)


@chunk_simple_gla_registry.register("reference", REFERENCE_PRIORITY, available=always)
def _chunk_reference(q, k, v, g, g_gamma, scale, initial_state, output_final_state, state_v_first, cu_seqlens,
                     **_unused_by_reference):
    from cula.simple_gla.naive import reference_chunk_simple_gla

    return reference_chunk_simple_gla(
        q, k, v, g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens, form="chunk",
    )


@fused_recurrent_simple_gla_registry.register("fla", FLA_PRIORITY, available=package_on_cuda("fla"))
def _recurrent_fla(**args):
    from fla.ops.simple_gla import fused_recurrent_simple_gla

    return fused_recurrent_simple_gla(**args)


@fused_recurrent_simple_gla_registry.register("reference", REFERENCE_PRIORITY, available=always)
def _recurrent_reference(q, k, v, g, g_gamma, scale, initial_state, output_final_state, reverse, state_v_first,
                         cu_seqlens):
    from cula.simple_gla.naive import reference_chunk_simple_gla

    return reference_chunk_simple_gla(
        q, k, v, g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        reverse=reverse, form="recurrent",
    )
