"""Backends of the Gated DeltaNet entry points (see ``cula.backends``).

- ``cula-sm90`` (``chunk_gated_delta_rule``; inference calls where ``cula.gated_delta_rule.plan.GDN_TUNING`` says
  cula's path measured faster): Gated DeltaNet is KDA with one gate per head. Inference runs KDA's forward
  (``cula.kda.forward.chunk_kda_fwd_sm90``) with that gate as it is: the intra kernel's ``scalar_gate`` variant
  applies it to the scores, exact for any gate (with ``GdnTuning.inference_row_factors``, per-token factor rows in
  place of qg, kg and g_cum, applied to the raw q and k by the state/output kernel's ``row_factors`` variant).
  Training runs ``cula.kda.chunk_kda`` with the gate (and the fused
  gate's ``dt_bias``) repeated over the K channels: the same recurrence, trainable on Hopper through KDA's training
  path (FLA 0.6.0's own gated backward refuses the Triton that PyTorch ships there); the gradient of the repeated
  gate is summed back by autograd. Where ``GdnTuning.training_per_head_gate`` says so, training's forward runs the
  per-head gate on the intra kernel as inference does, and so does the backward's recompute, its gate's backward per
  head after FLA's stages (``cula.kda.backends._training_backward``, ``per_head_gate_backward``). ``chunk_indices``
  (FLA's precomputed chunk list) is not needed: cula builds its own.
- ``cula-sm90`` (``fused_recurrent_gated_delta_rule``): decode calls (fp32 states, up to
  ``GDN_TUNING``'s ``inference_decode_max_tokens`` tokens a sequence, at most 8) on ``kda_decode``'s kernel with its
  per-head gate (g ``[N, T, HV]``, nothing repeated over K), the new states written beside the caller's.
- ``fla``: FLA 0.6.0's Triton kernels, for what cula does not cover.
- ``reference``: float32 PyTorch, the CPU path.
"""

from __future__ import annotations

import torch

from cula._validate import check_scale
from cula.backends import (
    ConstantTensors, Registry, always, capturing, cula_kernels_on, needs_grad, package_on_cuda,
)  # fmt: skip
from cula.kda.plan import gate_over_k
from cula.ops._host import sequences_verdict

chunk_gdn_registry = Registry("gated_delta_rule.chunk_gated_delta_rule")
fused_recurrent_gdn_registry = Registry("gated_delta_rule.fused_recurrent_gated_delta_rule")

CULA_PRIORITY = 10
FLA_PRIORITY = 50
REFERENCE_PRIORITY = 90


def _cula_chunk_supports(
    q, k, v, g, beta, initial_state=None, A_log=None, dt_bias=None, chunk_size=64, cp_context=None, cu_seqlens=None,
    **_,
) -> tuple:  # fmt: skip
    from cula.gated_delta_rule.plan import GDN_TUNING

    training = needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias)
    if not training and not GDN_TUNING.for_device(q.device).inference_chunk_on_cula:
        return False, "inference runs on FLA's kernels on this GPU (GdnTuning.inference_chunk_on_cula)"
    if cp_context is not None:
        return False, "cp_context (context parallel) runs on fla"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False, f"q dtype {q.dtype} (kernels take bf16 / fp16)"
    if (q.shape[-1], v.shape[-1]) != (128, 128):
        return False, f"head sizes K={q.shape[-1]} V={v.shape[-1]} (kernels take K = V = 128)"
    if chunk_size != 64:
        return False, f"chunk_size={chunk_size} (kernels take 64)"
    kernel_floats = (torch.bfloat16, torch.float16, torch.float32)
    if g.dtype not in kernel_floats or beta.dtype not in kernel_floats:
        return False, f"g dtype {g.dtype} / beta dtype {beta.dtype} (kernels take bf16 / fp16 / fp32)"
    return sequences_verdict(q.shape[0], cu_seqlens)


def _prepare_chunk_cula_sm90(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
    allow_neg_eigval, state_v_first, cu_seqlens, use_gate_in_kernel, A_log, dt_bias, **_,
):  # fmt: skip
    """The bound launch of a repeated inference call (``chunk_gated_delta_rule``'s plan cache): ``launch(q, k, v,
    g, beta, initial_state, A_log, dt_bias)`` (packed: ``..., cu_seqlens, cu_seqlens_cpu)``), KDA's one host call
    for both kernels with the factor rows (``cula.kda.forward.prepare_chunk_kda_fwd_sm90``), or None where the
    general path runs each time (training, the gate repeated over K, inputs that are not row-major)."""
    from cula.gated_delta_rule.plan import GDN_TUNING
    from cula.kda.forward import prepare_chunk_kda_fwd_sm90

    entry = GDN_TUNING.for_device(q.device)
    if not entry.inference_row_factors:
        return None
    if needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias):
        return None
    scale = check_scale(scale, q.shape[-1])
    bound = prepare_chunk_kda_fwd_sm90(
        q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first, cu_seqlens,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, row_factors=True, wy_in_recurrence=entry.inference_wy_in_recurrence,
        time_split=entry.time_split,
    )  # fmt: skip
    if bound is None:
        return None

    if cu_seqlens is not None:

        def packed(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu):
            return bound(q, k, v, g, beta, initial_state, A_log, dt_bias, scale, cu_seqlens, cu_seqlens_cpu)

        return packed

    def launch(q, k, v, g, beta, initial_state, A_log, dt_bias):
        return bound(q, k, v, g, beta, initial_state, A_log, dt_bias, scale)

    return launch


@chunk_gdn_registry.register(
    "cula-sm90", CULA_PRIORITY, available=cula_kernels_on((9, 0), needs=("fla",)), supports=_cula_chunk_supports,
    prepare=_prepare_chunk_cula_sm90,
)  # fmt: skip
def _chunk_cula_sm90(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
    allow_neg_eigval, state_v_first, cu_seqlens, cu_seqlens_cpu, use_gate_in_kernel, A_log, dt_bias, **_,
):  # fmt: skip
    from cula.gated_delta_rule.plan import GDN_TUNING
    from cula.kda import chunk_kda

    entry = GDN_TUNING.for_device(q.device)
    if not needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias):
        # inference: the intra kernel takes the one gate per token and head itself (exact for any gate), so
        # nothing is repeated over K
        from cula.kda.forward import chunk_kda_fwd_sm90

        return chunk_kda_fwd_sm90(
            q, k, v, g, beta, check_scale(scale, q.shape[-1]), initial_state, output_final_state,
            state_v_first, cu_seqlens, cu_seqlens_cpu, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
            dt_bias=dt_bias, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            row_factors=entry.inference_row_factors, wy_in_recurrence=entry.inference_wy_in_recurrence,
            time_split=entry.time_split,
        )  # fmt: skip
    # packed training without the boundaries' host copy runs KDA's in FLA's graph mode (chunk lists of a size fixed
    # by the shapes, built on the device), without which KDA's backward cannot be captured; chunk_gated_delta_rule
    # has no use_graph of its own (FLA's cannot be captured at all: it waits on the host). Eager calls take it too:
    # a warm-up then autotunes FLA's Triton stages for the very launches a capture records (a stage first met under
    # capture would autotune there and break it), and no step waits on the host for its chunk list (such calls are
    # never cut in time: their lengths are unknown). With cu_seqlens_cpu an eager step keeps the exact lists and
    # the time split of its forward; a captured one needs graph mode all the same
    graph = {}
    if cu_seqlens is not None and (cu_seqlens_cpu is None or capturing(cu_seqlens)):
        graph = {"use_graph": True, "max_num_seqs": cu_seqlens.shape[0] - 1}
    if entry.training_per_head_gate:
        # the forward's intra kernel takes the per-head gate itself, and so does the backward's recompute where it
        # runs on the intra kernel (else the gate is repeated over K for FLA's stages: cula.kda.backends'
        # _training_backward)
        from cula.kda.backends import chunk_kda_cula_sm90

        return chunk_kda_cula_sm90(
            cu_seqlens_cpu=cu_seqlens_cpu, q=q, k=k, v=v, g=g, beta=beta, scale=check_scale(scale, q.shape[-1]),
            initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            safe_gate=False, lower_bound=None, state_v_first=state_v_first, cu_seqlens=cu_seqlens, A_log=A_log,
            dt_bias=dt_bias, chunk_size=64, **graph,
        )  # fmt: skip
    gk, bias = gate_over_k(g, dt_bias, q.shape[-1])
    return chunk_kda(
        q, k, v, gk, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, A_log=A_log,
        dt_bias=bias, **graph,
    )  # fmt: skip


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


def _cula_recurrent_supports(q, k, v, g, gk, gv, beta, initial_state, state_v_first, cu_seqlens, A_log, dt_bias,
                             **_) -> tuple:  # fmt: skip
    from cula._validate import DECODE_MAX_TOKENS, pool_layout_verdict

    from cula.gated_delta_rule.plan import GDN_TUNING

    if needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias):
        return False, "autograd (cula's decode kernel is forward-only)"
    if cu_seqlens is not None:
        return False, "cu_seqlens (the packed form) runs on fla; pass q as [N, T, H, K] for cula's kernel"
    if gk is not None or gv is not None or g is None:
        return False, "per-key / per-value gates, or no gate, run on fla"
    if not 1 <= q.shape[1] <= DECODE_MAX_TOKENS:
        return False, f"{q.shape[1]} tokens per sequence (cula's decode kernel takes 1..{DECODE_MAX_TOKENS})"
    most = GDN_TUNING.for_device(q.device).inference_decode_max_tokens
    if q.shape[1] > most:
        return False, (f"{q.shape[1]} tokens a sequence: decode runs on FLA's kernel on this GPU beyond "
                       f"GdnTuning.inference_decode_max_tokens={most}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False, f"q dtype {q.dtype} (the kernel takes bf16 / fp16)"
    if k.dtype != q.dtype or v.dtype != q.dtype:  # (validation takes any float dtype apiece, as FLA's kernel does)
        return False, f"q / k / v dtypes {q.dtype} / {k.dtype} / {v.dtype} (the kernel takes one bf16 / fp16 dtype)"
    if (q.shape[-1], v.shape[-1]) not in ((64, 64), (128, 128)):
        return False, f"head sizes K={q.shape[-1]} V={v.shape[-1]} (the kernel takes K = V in {{64, 128}})"
    if g.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False, f"g dtype {g.dtype} (the kernel takes bf16 / fp16 / fp32)"
    if beta is not None and beta.dtype not in (torch.float32, torch.bfloat16):
        return False, f"beta dtype {beta.dtype} (the kernel takes fp32 / bf16)"
    if beta is not None and beta.dim() == 4:
        return False, "a per-value beta [B, T, HV, V] (the kernel takes one beta a head and token)"
    if initial_state is None or initial_state.dtype != torch.float32:
        return False, "an fp32 initial_state is needed (the kernel reads the states in place)"
    return pool_layout_verdict(initial_state, q.shape[-1], v.shape[-1], state_v_first)


_SLOTS = ConstantTensors()


@fused_recurrent_gdn_registry.register(
    "cula-sm90", CULA_PRIORITY, available=cula_kernels_on((9, 0)), supports=_cula_recurrent_supports
)
def _recurrent_cula_sm90(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log,
    dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, **_,
):  # fmt: skip
    """Decode-sized calls (1..8 tokens a sequence) on ``kda_decode``'s kernel with its per-head gate (g ``[N, T,
    HV]``, dt_bias ``[HV]``): the states are read from ``initial_state`` and the new ones written to a separate buffer
    (``step_states``), so the caller's states stay untouched, as in FLA."""
    from cula.kda import kda_decode

    N, T = q.shape[:2]
    steps = torch.empty((N, T) + tuple(initial_state.shape[1:]), dtype=torch.float32, device=q.device)
    # sequence n's state is initial_state[n]: the identity slots, made once per N and device (an arange kernel a call)
    slots = _SLOTS.get(q.device, ("slots", N), lambda: torch.arange(N, dtype=torch.int32, device=q.device))
    o = kda_decode(
        q, k, v, g, torch.ones(N, T, v.shape[2], device=q.device) if beta is None else beta,
        initial_state, slots, A_log=A_log, dt_bias=dt_bias, scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first, step_states=steps, check_indices=False,
    )  # fmt: skip
    return o, (steps[:, -1].contiguous() if output_final_state else None)


@fused_recurrent_gdn_registry.register("fla", FLA_PRIORITY, available=package_on_cuda("fla"))
def _recurrent_fla(**args):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    return fused_recurrent_gated_delta_rule(**args)


@fused_recurrent_gdn_registry.register("reference", REFERENCE_PRIORITY, available=always)
def _recurrent_reference(**args):
    from cula.gated_delta_rule.naive import reference_fused_recurrent_gated_delta_rule

    # in fp32 as FLA's kernel computes (float64 inputs too), o in v's dtype
    return reference_fused_recurrent_gated_delta_rule(**args, compute_dtype=torch.float32)
