"""``cula.lightning.lightning_decode``: Lightning attention decode steps against a pool of fp32 states."""

from __future__ import annotations

import torch
from torch.compiler import is_compiling

from cula import _custom_ops
from cula._validate import (
    check_decode_tokens,
    check_pool_indices,
    check_qkv,
    check_scale,
    check_state_pool,
    check_tensor,
    contiguous_reads,
    copying_reads,
    dense,
    is_dense,
    pool_layout_verdict,
)
from cula.backends import Registry, StepPlans, always, cula_kernels_on, forced_backend, tensor_sig
from cula.ops._host import int32_offsets_verdict

lightning_decode_registry = Registry("lightning.lightning_decode")
# validated launches by call signature, and by a short key for those whose compiled entry checks its own arguments
# (cula.backends.StepPlans; as cula.kda.decode's)
_plans = StepPlans()

def lightning_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    scale: float | None = None,
    state_v_first: bool = True,
    out: torch.Tensor | None = None,
    check_indices: bool = True,
) -> torch.Tensor:
    r"""Run T (1..8) Lightning attention tokens for each of N sequences against their states in a pool.

    Per value head ``hv``: ``S <- exp(-decay[hv]) * S + k_t v_t^T``, ``o_t = scale * S^T q_t`` (Simple GLA
    with ``g_gamma = -decay``, as :func:`cula.lightning.lightning_attn_fwd`). The pool is updated in place:
    the state of sequence ``n`` lives in ``state_pool[state_indices[n]]``; a negative index marks a padded
    slot, which is skipped (its pool row is untouched and its output rows are zero).

    Args:
        q, k: ``[N, T, H, D]`` bf16/fp16 (fp32 runs on the reference backend).
        v: ``[N, T, HV, D]``, q's dtype; ``HV % H == 0`` (GVA: value head ``hv`` reads q/k head
            ``hv // (HV // H)``).
        decay: fp32 ``[HV]``, the per-head decay rate (``>= 0``; not checked, it would need a host sync).
        state_pool: fp32 ``[P, HV, V, K]`` (``state_v_first=True``, the default here) or ``[P, HV, K, V]``.
        state_indices: int32 ``[N]`` pool rows (negative: padded), checked to be ``< P`` and distinct unless
            ``check_indices=False`` (the check reads the indices on the host; serving loops that guarantee them can
            skip it).
        scale: multiplies ``S^T q``; defaults to ``K ** -0.5``.
        out: optional ``[N, T, HV, V]`` output buffer in q's dtype.

    Returns:
        ``o`` ``[N, T, HV, V]`` in q's dtype.

    Backends: ``cula-sm90`` (SM90, bf16/fp16, ``K = V`` in {64, 128}) and ``reference`` (float32 PyTorch,
    any device).
    """
    if is_compiling() and _custom_ops.routes():  # torch.compile traces the cula::lightning_decode op instead
        return _custom_ops.lightning_decode(
            q, k, v, decay, state_pool, state_indices, scale=scale, state_v_first=state_v_first, out=out,
            check_indices=check_indices,
        )  # fmt: skip
    flags = (scale is None or type(scale), state_v_first, forced_backend())
    try:
        # (the pool's strides too, as kda_decode's: the entry checks no stride of a size-1 dim)
        short = (q.shape, v.shape, q.dtype, q.device, decay.shape, state_pool.shape, state_pool.stride(), out is None,
                 *flags)  # fmt: skip
    except AttributeError:
        short = None  # not tensors: validated in full
    return _plans.run(
        short,
        lambda launch: _checked_launch(launch, q, k, v, decay, state_pool, state_indices, scale, out, check_indices),
        lambda: (
            tensor_sig(q), tensor_sig(k), tensor_sig(v), tensor_sig(decay), tensor_sig(state_pool),
            tensor_sig(state_indices), tensor_sig(out), *flags,
        ),
        lambda: _plan(q, k, v, decay, state_pool, state_indices, scale, state_v_first, out),
    )  # fmt: skip


def _checked_launch(launch, q, k, v, decay, state_pool, state_indices, scale, out, check_indices):
    """A planned call's per-call checks (the values a plan key does not hold), then its launch; returns o."""
    if check_indices:
        check_pool_indices(state_indices, state_pool.shape[0])
    if out is None:
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
    launch(q, k, v, decay, state_pool, state_indices, check_scale(scale, q.shape[-1]), out)
    return out


def lightning_decode_step(
    decay: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    scale: float | None = None,
    state_v_first: bool = True,
    check_indices: bool = True,
):
    r""":func:`lightning_decode` with the serving loop's fixed arguments bound once: returns
    ``step(q, k, v, out=None) -> o``, the same call as ``lightning_decode(q, k, v, decay, state_pool, state_indices,
    ...)``. Only q, k, v (and ``out``) enter the per-step call signature, on cula's kernels only their shapes and
    q's dtype (``cula.backends.StepPlans``); the bound ``decay``, ``state_pool`` and
    ``state_indices`` are validated with the first step of each token signature and must keep their shapes,
    strides, dtype and device afterwards (their values may change between steps). Errors and results are those of
    :func:`lightning_decode`."""
    plans = StepPlans()

    def bound_plan(q, k, v, out):
        """``_plan`` for a new token signature, with the bound arguments fixed: ``tokens(q, k, v, out)``."""
        launch = _plan(q, k, v, decay, state_pool, state_indices, scale, state_v_first, out)
        scale_ = check_scale(scale, q.shape[-1])
        bind = getattr(launch, "bind", None)
        if bind is not None:
            return bind(decay, state_pool, state_indices, scale_)
        return lambda q, k, v, out: launch(q, k, v, decay, state_pool, state_indices, scale_, out)

    def step(q, k, v, out=None):
        if is_compiling() and _custom_ops.routes():  # the lightning_decode call this step stands for, as an op
            return lightning_decode(
                q, k, v, decay, state_pool, state_indices, scale=scale, state_v_first=state_v_first, out=out,
                check_indices=check_indices,
            )  # fmt: skip
        try:  # the step's short key (cula.backends.StepPlans)
            key = (q.shape, v.shape, q.dtype, out is None, forced_backend())
        except AttributeError:
            key = None  # not tensors: validated in full
        if key is not None and key == plans.last_key:  # the loop's signature again: straight to its launch
            if check_indices:
                check_pool_indices(state_indices, state_pool.shape[0])
            o = torch.empty_like(v, memory_format=torch.contiguous_format) if out is None else out
            try:
                plans.last_launch(q, k, v, o)
                return o
            except Exception:  # noqa: BLE001  (refused before any launch: the general path finds out why)
                plans.last_key = None

        def call(tokens):
            if check_indices:
                check_pool_indices(state_indices, state_pool.shape[0])
            o = torch.empty_like(v, memory_format=torch.contiguous_format) if out is None else out
            tokens(q, k, v, o)
            return o

        def full_key():
            try:  # tensor_sig of q, k, v written out
                return (
                    q.shape, q.stride(), q.dtype, q.device, q.data_ptr() & 15,
                    k.shape, k.stride(), k.dtype, k.device, k.data_ptr() & 15,
                    v.shape, v.stride(), v.dtype, v.device, v.data_ptr() & 15,
                    None if out is None else tensor_sig(out), forced_backend(),
                )  # fmt: skip
            except (AttributeError, TypeError):  # not a tensor: the full validation names it
                return (tensor_sig(q), tensor_sig(k), tensor_sig(v))

        return plans.run(key, call, full_key, lambda: bound_plan(q, k, v, out))

    return step


def _plan(q, k, v, decay, state_pool, state_indices, scale, state_v_first, out):
    """Validate a call with a new signature in full and choose its launch (raises on bad input)."""
    given = (q, k, v, decay, state_indices)
    rows = contiguous_reads(*given)
    # an input strided in its last dimension: planned as its row-major copy
    if any(r is not t for r, t in zip(rows, given)):
        return copying_reads(_plan(*rows[:4], state_pool, rows[4], scale, state_v_first, out))
    N, T, _H, K, HV, V = check_qkv(q, k, v)
    check_decode_tokens("lightning_decode", T)
    dev = q.device
    check_tensor("decay", decay, shape=(HV,), dtypes=(torch.float32,), device=dev)
    check_state_pool(
        state_pool, state_indices, n=N, heads=HV, k=K, v=V, state_v_first=state_v_first, device=dev
    )
    if out is None:
        # stands for the fresh buffer every such call allocates
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
    else:
        check_tensor("out", out, shape=tuple(v.shape), dtypes=(q.dtype,), device=dev)
    args = {
        "q": q, "k": k, "v": v, "decay": decay, "state_pool": state_pool, "state_indices": state_indices,
        "scale": check_scale(scale, K), "state_v_first": bool(state_v_first), "out": out,
    }  # fmt: skip
    run = lightning_decode_registry.plan(dev, args)
    if getattr(run, "positional", False):
        return run

    def launch(q, k, v, decay, state_pool, state_indices, scale, out):  # state_v_first is part of the plan key
        run(q=q, k=k, v=v, decay=decay, state_pool=state_pool, state_indices=state_indices, scale=scale,
            state_v_first=bool(state_v_first), out=out)  # fmt: skip

    return launch


def _cula_supports(q, v, state_pool, state_v_first, **_) -> tuple:
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False, f"q dtype {q.dtype} (kernel takes bf16/fp16)"
    K, V = q.shape[-1], v.shape[-1]
    if (K, V) not in ((64, 64), (128, 128)):
        return False, f"head sizes K={K} V={V} (kernel takes K = V in {{64, 128}})"
    fits, why = int32_offsets_verdict(q.shape, v.shape)
    if not fits:
        return False, why
    return pool_layout_verdict(state_pool, K, V, state_v_first)


def _prepare_cula_sm90(q, k, v, decay, state_pool, state_indices, state_v_first, out, **_):
    """The compiled kernel and grid bound once; None (the general path) where an input needs fixing first."""
    from cula.lightning.plan import lightning_decode_launcher

    _, HV, D0, D1 = state_pool.shape
    if q.shape[0] == 0 or (HV == 1 and state_pool.stride(1) != D0 * D1):
        return None
    if not all(is_dense(t) for t in (q, k, v, decay, state_indices, out)):
        return None
    bound = lightning_decode_launcher(q, v, state_v_first=state_v_first)

    def launch(q, k, v, decay, state_pool, state_indices, scale, out):  # lightning_decode's positional launch
        bound(q, k, v, decay, state_pool, state_indices, out, scale)

    launch.positional = True
    launch.checks_arguments = True  # one call of the compiled entry, which checks every tensor before launching
    launch.bind = getattr(bound, "bind", None)  # lightning_decode_step's launch (None: a launcher without one)
    return launch


@lightning_decode_registry.register(
    "cula-sm90", 10, available=cula_kernels_on((9, 0)), supports=_cula_supports, prepare=_prepare_cula_sm90
)
def _decode_cula_sm90(q, k, v, decay, state_pool, state_indices, scale, state_v_first, out):
    from cula.lightning.plan import lightning_decode_sm90

    P, HV, D0, D1 = state_pool.shape
    if HV == 1 and state_pool.stride(1) != D0 * D1:
        # a size-1 head dim may carry any stride; give the kernel the canonical one (same memory)
        state_pool = state_pool.as_strided((P, HV, D0, D1), (state_pool.stride(0), D0 * D1, D1, 1))
    # the kernel writes a row-major, 16-byte aligned output; anything else goes through a temporary
    o = out
    if not is_dense(out):
        o = torch.empty_like(out, memory_format=torch.contiguous_format)
    lightning_decode_sm90(
        dense(q),
        dense(k),
        dense(v),
        dense(decay),
        state_pool,
        dense(state_indices),
        o,
        scale=scale,
        state_v_first=state_v_first,
    )
    if o is not out:
        out.copy_(o)


@lightning_decode_registry.register("reference", 90, available=always)
def _decode_reference(q, k, v, decay, state_pool, state_indices, scale, state_v_first, out):
    from cula.simple_gla.naive import reference_chunk_simple_gla

    # the range with check_indices=False too: torch's indexing below would fail inside a kernel (on CUDA, a device
    # assert); a repeated row indexes fine (last write kept, as the kernels' race), refused only where checked
    check_pool_indices(state_indices, state_pool.shape[0], distinct=False)
    live = state_indices >= 0
    rows = state_indices.long().clamp(min=0)
    with torch.no_grad():
        o, states = reference_chunk_simple_gla(
            q,
            k,
            v,
            g_gamma=-decay,
            scale=scale,
            initial_state=state_pool[rows],
            output_final_state=True,
            state_v_first=state_v_first,
            form="recurrent",
        )
        out.copy_(torch.where(live[:, None, None, None], o, torch.zeros_like(o)))
        state_pool[rows[live]] = states[live]
