"""Backends of the Simple GLA entry points (see ``cula.backends``).

- ``cula-sm90``: our CuTe DSL Lightning kernel (Hopper) for the constant-decay case (``g_gamma`` or no
  decay), inference only so far (no autograd), bf16, K = V in {64, 128}.
- ``fla``: FLA 0.6.0's Triton kernels for everything else on CUDA.
- ``reference``: float32 PyTorch, the CPU path.
"""

from __future__ import annotations

import functools

import torch

from cula._validate import dense, is_dense
from cula.backends import Registry, always, capturing, cula_kernels_on, needs_grad, package_on_cuda
from cula.ops._host import sequences_verdict
from cula.ops.lightning.sm90.chunk_fwd import kernel_decay as _decay

chunk_simple_gla_registry = Registry("simple_gla.chunk_simple_gla")
fused_recurrent_simple_gla_registry = Registry("simple_gla.fused_recurrent_simple_gla")

CULA_PRIORITY = 10
FLA_PRIORITY = 50
REFERENCE_PRIORITY = 90
RCP_LN2 = 1.4426950408889634  # FLA's backward kernels take the log decay in base 2


def _cula_chunk_supports(q, k, v, g, g_gamma, initial_state, cu_seqlens=None, **_) -> tuple:
    if g is not None:
        return False, "data-dependent g (the kernel takes a constant per-head decay, g_gamma)"
    if q.dtype != torch.bfloat16:
        return False, f"q dtype {q.dtype} (kernel takes bf16)"
    if q.shape[-1] != v.shape[-1] or q.shape[-1] not in (64, 128):
        return False, f"head sizes K={q.shape[-1]} V={v.shape[-1]} (kernel takes K = V in {{64, 128}})"
    return sequences_verdict(q.shape[0], cu_seqlens)


def _lightning_forward(q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first, cu_seqlens):
    """The Lightning kernel's call: ``(o, final_state)``; with ``q`` None the states-only variant, ``(None,
    final_state)`` (``cula.lightning.time_parallel``'s first pass)."""
    from cula.ops.lightning.sm90.chunk_fwd import lightning_fwd_sm90, lightning_states_sm90

    B, T, HV, V = v.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    decay = _decay(g_gamma, HV, v.device)
    o = None if q is None else torch.empty_like(v, memory_format=torch.contiguous_format)  # row-major
    final = torch.empty(N, HV, V, V, device=v.device, dtype=torch.float32) if output_final_state else None
    if T == 0:  # nothing to read (the kernel is not launched on empty tensors); the state passes through
        if final is not None:
            final.copy_(initial_state if initial_state is not None else torch.zeros_like(final))
        return o, final
    if cu_seqlens is not None and cu_seqlens.dtype != torch.int32:
        cu_seqlens = cu_seqlens.to(torch.int32)
    if initial_state is not None:
        initial_state = dense(initial_state)
    if q is None:
        lightning_states_sm90(dense(k), dense(v), decay, initial_state, final, cu_seqlens,
                              state_v_first=state_v_first)  # fmt: skip
        return None, final
    # the kernel's compiled signature describes row-major, 16-byte aligned tensors (TVM-FFI checks the inner strides
    # and the alignment)
    lightning_fwd_sm90(
        dense(q),
        dense(k),
        dense(v),
        decay,
        o,
        initial_state,
        final,
        cu_seqlens,
        scale=scale,
        state_v_first=state_v_first,
    )
    return o, final


class _LightningTraining(torch.autograd.Function):
    """Our forward kernel, FLA 0.6.0's Triton backward (which recomputes the chunk states from h0)."""

    @staticmethod
    def forward(ctx, q, k, v, g_gamma, initial_state, scale, output_final_state, state_v_first, cu_seqlens,
                cu_seqlens_cpu):  # fmt: skip
        o, final = _lightning_forward(
            q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first, cu_seqlens
        )
        ctx.save_for_backward(q, k, v, g_gamma, initial_state, cu_seqlens, cu_seqlens_cpu)
        ctx.scale, ctx.state_v_first = scale, state_v_first
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        dq, dk, dv, dh0 = lightning_backward(*ctx.saved_tensors, ctx.scale, ctx.state_v_first, do, dht)
        # FLA gives no gradient for the constant decay g_gamma either.
        return dq, dk, dv, None, dh0, None, None, None, None, None


def lightning_backward(q, k, v, g_gamma, initial_state, cu_seqlens, cu_seqlens_cpu, scale, state_v_first, do, dht):
    """``_LightningTraining``'s backward from its inputs: the gradients of q, k, v and the initial state (also what
    torch.compile's chunk_simple_gla op runs for a call on cula's kernel, cula._custom_ops)."""
    from fla.ops.simple_gla.chunk import chunk_simple_gla_bwd
    from fla.ops.utils import prepare_chunk_indices

    B, T, H, K = q.shape
    group = v.shape[2] // H
    qx, kx = q, k
    if group > 1:  # FLA's kernels have no GVA: one q/k copy per value head, gradients summed back
        qx, kx = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    chunk_indices = None
    if cu_seqlens is not None:
        # a fresh alias: FLA's helpers memoise on a tensor's identity, and a boundaries buffer rewritten in place
        # between steps would otherwise get the previous boundaries' chunks
        cu_seqlens = cu_seqlens.view(-1)
        chunk_indices = prepare_chunk_indices(cu_seqlens, 64, cu_seqlens_cpu=cu_seqlens_cpu)
    dq, dk, dv, _, dh0 = chunk_simple_gla_bwd(
        q=qx, k=kx, v=v, g=None, g_gamma=None if g_gamma is None else g_gamma.float() * RCP_LN2,
        initial_state=initial_state, do=do.contiguous(), dht=dht, scale=scale,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, chunk_size=64, chunk_indices=chunk_indices,
    )  # fmt: skip
    if group > 1:
        dq, dk = (t.view(B, T, H, group, K).sum(3) for t in (dq, dk))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dh0


def _prepare_chunk_cula_sm90(q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first, cu_seqlens,
                             **_):  # fmt: skip
    """The bound launch of a repeated fixed-length inference call (``chunk_simple_gla``'s plan cache):
    ``launch(q, k, v, g_gamma, initial_state)`` with the compiled variant and the outputs' shapes found once (for a
    call the time split cuts, its two passes and combine: ``_cut_launch``), or None where the general path runs each
    time (training calls, inputs that are not row-major and 16-byte aligned, no tokens). A packed call's (int32
    ``cu_seqlens``; ``_packed_launch``) also takes ``cu_seqlens, cu_seqlens_cpu``."""
    from cula.lightning.plan import parallel_segments
    from cula.ops.lightning.sm90.chunk_fwd import compiled_variant

    B, T, HV, V = v.shape
    if needs_grad(q, k, v, initial_state):
        return None
    if not (is_dense(q) and is_dense(k) and is_dense(v) and (initial_state is None or is_dense(initial_state))):
        return None  # (the general path copies them: dense; the plan key holds the strides and the alignment)
    if cu_seqlens is not None:
        return _packed_launch(q, k, v, scale, initial_state, output_final_state, state_v_first, cu_seqlens)
    if B * T * HV == 0:
        return None
    plan = parallel_segments(B, T, HV, None, None, q.device)
    if plan is not None:
        return _cut_launch(plan, q.shape[-1], HV, v.device, float(scale), bool(output_final_state), state_v_first)
    fn = compiled_variant(q.shape[-1], initial_state is not None, bool(output_final_state), False, state_v_first)
    device, scale = v.device, float(scale)

    def from_decay(q, k, v, decay, initial_state):
        o = torch.empty_like(v)  # (row-major, as v)
        final = torch.empty(B, HV, V, V, device=device, dtype=torch.float32) if output_final_state else None
        fn(q, k, v, o, decay, initial_state, final, None, scale)
        return o, final

    def launch(q, k, v, g_gamma, initial_state):
        return from_decay(q, k, v, _decay(g_gamma, HV, device), initial_state)

    # lightning_attn_fwd's: the kernel's decay (-g_gamma, fp32, contiguous) as the caller has it
    launch.from_decay = from_decay
    return launch


def _cut_launch(plan, D, HV, device, scale, output_final_state, state_v_first):
    """The launch of a call the time split cuts by ``plan`` (a fixed-length signature's, or a packed one's for one
    boundary list): the kernel's states-only pass, the combine and the output pass
    (``cula.lightning.time_parallel.bind_time_parallel``), each compiled variant found once, as ``_chunk_cula_sm90``
    runs them through ``time_parallel_forward``: ``launch(q, k, v, g_gamma, initial_state)``."""
    from cula.lightning.time_parallel import bind_time_parallel
    from cula.ops.lightning.sm90.chunk_fwd import compiled_variant

    states_fn = compiled_variant(D, False, True, True, state_v_first, states_only=True)
    output_fn = compiled_variant(D, True, output_final_state, True, state_v_first)

    def states_pass(k, v, decay, ends, bounds):
        states_fn(None, k, v, None, decay, None, ends, bounds, 1.0)

    def output_pass(q, k, v, o, decay, starts, ends, bounds):
        output_fn(q, k, v, o, decay, starts, ends, bounds, scale)

    cut = bind_time_parallel(plan, HV, D, device, states_pass, output_pass, output_final_state)

    def launch(q, k, v, g_gamma, initial_state):
        return cut(q, k, v, _decay(g_gamma, HV, device), initial_state)

    return launch


def _packed_launch(q, k, v, scale, initial_state, output_final_state, state_v_first, cu_seqlens):
    """``_prepare_chunk_cula_sm90``'s launch of packed inference calls, ``launch(q, k, v, g_gamma, initial_state,
    cu_seqlens, cu_seqlens_cpu)``: the kernel straight on the call's tensors (the plan key holds their layout and
    alignment but the total length, ``chunk_simple_gla`` checks the boundaries every call); a call the time split
    cuts runs its cut's bound launch (``_cut_launch``, one per cut of the last few boundary lists: every layer of a
    model gets the same batch), or while a CUDA graph captures the backend's general path (the cut made on the
    device at each replay), as does a call without tokens. None (the general path every call) for int64 boundaries
    (cast each call there); the caller has left out training calls and inputs that are not row-major and 16-byte
    aligned."""
    from cula.lightning.plan import parallel_segments
    from cula.ops.lightning.sm90.chunk_fwd import compiled_variant

    if cu_seqlens.dtype != torch.int32:
        return None
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.numel() - 1
    fn = compiled_variant(q.shape[-1], initial_state is not None, bool(output_final_state), True, state_v_first)
    device, scale = v.device, float(scale)
    cuts = functools.lru_cache(maxsize=8)(
        lambda plan: _cut_launch(plan, q.shape[-1], HV, device, scale, bool(output_final_state), state_v_first)
    )

    def launch(q, k, v, g_gamma, initial_state, cu_seqlens, cu_seqlens_cpu):
        T = q.shape[1]
        plan = parallel_segments(1, T, HV, cu_seqlens, cu_seqlens_cpu, device) if T else None
        if plan is not None and not capturing(cu_seqlens):
            return cuts(plan)(q, k, v, g_gamma, initial_state)
        if T == 0 or plan is not None:
            return _chunk_cula_sm90(q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first,
                                    cu_seqlens, cu_seqlens_cpu)  # fmt: skip
        o = torch.empty_like(v)  # (row-major, as v)
        final = torch.empty(N, HV, V, V, device=device, dtype=torch.float32) if output_final_state else None
        fn(q, k, v, o, _decay(g_gamma, HV, device), initial_state, final, cu_seqlens, scale)
        return o, final

    return launch


@chunk_simple_gla_registry.register(
    "cula-sm90", CULA_PRIORITY, available=cula_kernels_on((9, 0)), supports=_cula_chunk_supports,
    prepare=_prepare_chunk_cula_sm90,
)  # fmt: skip
def _chunk_cula_sm90(
    q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first, cu_seqlens, cu_seqlens_cpu,
    **_unused,
):  # fmt: skip
    if needs_grad(q, k, v, initial_state):
        return _LightningTraining.apply(
            q, k, v, g_gamma, initial_state, scale, output_final_state, state_v_first, cu_seqlens, cu_seqlens_cpu
        )
    from cula.lightning.plan import parallel_segments

    B, T, HV = v.shape[:3]
    plan = parallel_segments(B, T, HV, cu_seqlens, cu_seqlens_cpu, q.device)
    if plan is not None:
        from cula.lightning.time_parallel import time_parallel_forward

        return time_parallel_forward(
            _lightning_forward, plan, q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first,
            cu_seqlens,
        )  # fmt: skip
    return _lightning_forward(
        q, k, v, g_gamma, scale, initial_state, output_final_state, state_v_first, cu_seqlens
    )


def _expand_gva(args: dict) -> dict:
    """FLA 0.6.0's simple GLA has no GVA: give each value head its own copy of its q/k head.

    Autograd sums the copies' gradients back, so this is exact for training too.
    """
    H, HV = args["q"].shape[2], args["v"].shape[2]
    if H == HV:
        return args
    return dict(
        args, q=args["q"].repeat_interleave(HV // H, dim=2), k=args["k"].repeat_interleave(HV // H, dim=2)
    )


@chunk_simple_gla_registry.register("fla", FLA_PRIORITY, available=package_on_cuda("fla"))
def _chunk_fla(**args):
    from fla.ops.simple_gla import chunk_simple_gla

    return chunk_simple_gla(**_expand_gva(args))


@chunk_simple_gla_registry.register("reference", REFERENCE_PRIORITY, available=always)
def _chunk_reference(
    q,
    k,
    v,
    g,
    g_gamma,
    scale,
    initial_state,
    output_final_state,
    state_v_first,
    cu_seqlens,
    **_unused_by_reference,
):
    from cula.simple_gla.naive import reference_chunk_simple_gla

    return reference_chunk_simple_gla(
        q,
        k,
        v,
        g=g,
        g_gamma=g_gamma,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        form="chunk",
    )


@fused_recurrent_simple_gla_registry.register("fla", FLA_PRIORITY, available=package_on_cuda("fla"))
def _recurrent_fla(**args):
    from fla.ops.simple_gla import fused_recurrent_simple_gla

    return fused_recurrent_simple_gla(**_expand_gva(args))


@fused_recurrent_simple_gla_registry.register("reference", REFERENCE_PRIORITY, available=always)
def _recurrent_reference(
    q, k, v, g, g_gamma, scale, initial_state, output_final_state, reverse, state_v_first, cu_seqlens
):
    from cula.simple_gla.naive import reference_chunk_simple_gla

    return reference_chunk_simple_gla(
        q,
        k,
        v,
        g=g,
        g_gamma=g_gamma,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        reverse=reverse,
        compute_dtype=torch.float32,  # as FLA's kernel computes (float64 inputs too); o in q's dtype, as FLA's
        form="recurrent",
    )
