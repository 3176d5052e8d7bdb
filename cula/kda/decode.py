"""``cula.kda.kda_decode``: KDA decode steps for serving, against a pool of fp32 states."""

from __future__ import annotations

import torch
from torch.compiler import is_compiling

from cula import _custom_ops
from cula._validate import (
    FLOAT_DTYPES,
    check_decode_tokens,
    check_lower_bound,
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
    refuse_repeated_rows,
)
from cula.backends import (
    Registry, StepPlans, always, cula_kernels_on, forced_backend, tensor_sig, token_sigs,
)  # fmt: skip
from cula.ops._host import gate_kind, int32_offsets_verdict

kda_decode_registry = Registry("kda.kda_decode")
# Validated launches by call signature, and by a short key (shapes, dtypes, flags) for those whose compiled entry
# checks its own arguments (cula.backends.StepPlans): a serving loop repeats a few signatures once per token, and
# full validation plus dispatch, or eleven tensors' full signatures, cost more than the N=1 kernel's launch.
_plans = StepPlans()


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    use_gate_in_kernel: bool = True,
    use_beta_sigmoid_in_kernel: bool = True,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = True,
    out: torch.Tensor | None = None,
    step_states: torch.Tensor | None = None,
    check_indices: bool = True,
) -> torch.Tensor:
    r"""Run T (1..8) KDA tokens for each of N sequences, reading and updating their states in a pool.

    Same math and flags as :func:`cula.kda.fused_recurrent_kda`. The pool is updated in place: the state
    of sequence ``n`` lives in ``state_pool[state_indices[n]]``; a negative index marks a padded slot,
    which is skipped (its pool row is untouched and its output rows are zero).

    Args:
        q, k: ``[N, T, H, K]`` bf16/fp16.  v: ``[N, T, HV, V]``.  g: ``[N, T, HV, K]`` (raw logits with
            ``use_gate_in_kernel``: softplus gate with ``A_log``, or the ``lower_bound`` sigmoid gate), or
            ``[N, T, HV]``: one gate per token and value head (Gated DeltaNet's), with ``dt_bias`` ``[HV]``.
        beta: ``[N, T, HV]`` fp32/bf16 (logits with ``use_beta_sigmoid_in_kernel``).
        state_pool: fp32 ``[P, HV, V, K]`` (``state_v_first=True``, the default here) or ``[P, HV, K, V]``.
        state_indices: int32 ``[N]`` pool rows (negative: padded), checked to be ``< P`` and distinct unless
            ``check_indices=False`` (the check reads the indices on the host; serving loops that guarantee them can
            skip it).
        A_log, dt_bias: fp32 ``[HV]`` and ``[HV * K]`` (``[HV]`` with a per-head g).
        out: optional ``[N, T, HV, V]`` output buffer in q's dtype.
        step_states: optional fp32 ``[N, T, HV, V, K]`` (or ``[N, T, HV, K, V]``): receives the state after
            every token and leaves the pool untouched, so a speculative-decoding engine can commit the
            accepted prefix later.

    Returns:
        ``o`` ``[N, T, HV, V]`` in q's dtype.
    """
    if is_compiling() and _custom_ops.routes():  # torch.compile traces the cula::kda_decode op instead
        return _custom_ops.kda_decode(
            q, k, v, g, beta, state_pool, state_indices, A_log=A_log, dt_bias=dt_bias, scale=scale,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            lower_bound=lower_bound, state_v_first=state_v_first, out=out, step_states=step_states,
            check_indices=check_indices,
        )  # fmt: skip
    flags = (scale is None or type(scale), lower_bound is None, use_qk_l2norm_in_kernel, use_gate_in_kernel,
             use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, forced_backend())  # fmt: skip
    try:
        short = (
            q.shape, v.shape, q.dtype, q.device, g.dtype, g.dim(), beta.dtype, state_pool.shape,
            # (the pool's strides too: the variant chosen may load it by TMA, which needs 16-byte row strides, and
            # the entry checks no stride of a size-1 dim, a one-row pool's)
            state_pool.stride(), None if A_log is None else A_log.shape, None if dt_bias is None else dt_bias.shape,
            out is None, None if step_states is None else step_states.shape, *flags,
        )  # fmt: skip
    except AttributeError:
        short = None  # not tensors: validated in full
    return _plans.run(
        short,
        lambda launch: _checked_launch(launch, q, k, v, g, beta, state_pool, state_indices, A_log, dt_bias, scale,
                                       lower_bound, out, step_states, check_indices),
        lambda: (
            tensor_sig(q), tensor_sig(k), tensor_sig(v), tensor_sig(g), tensor_sig(beta), tensor_sig(state_pool),
            tensor_sig(state_indices), tensor_sig(A_log), tensor_sig(dt_bias), tensor_sig(out),
            tensor_sig(step_states), *flags,
        ),
        lambda: _plan(
            q, k, v, g, beta, state_pool, state_indices, A_log, dt_bias, scale, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first, out,
            step_states,
        ),
    )  # fmt: skip


def _checked_launch(launch, q, k, v, g, beta, state_pool, state_indices, A_log, dt_bias, scale, lower_bound, out,
                    step_states, check_indices):  # fmt: skip
    """A planned call's per-call checks (the values a plan key does not hold), then its launch; returns o."""
    if check_indices:
        check_pool_indices(state_indices, state_pool.shape[0])
    scale = check_scale(scale, q.shape[-1])
    check_lower_bound(lower_bound)  # the plan keys hold only whether it is None
    if out is None:
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
    launch(q, k, v, g, beta, state_pool, state_indices, A_log, dt_bias, scale, lower_bound, out, step_states)
    return out


def kda_decode_step(
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    use_gate_in_kernel: bool = True,
    use_beta_sigmoid_in_kernel: bool = True,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = True,
    check_indices: bool = True,
):
    r""":func:`kda_decode` with the serving loop's fixed arguments bound once: returns
    ``step(q, k, v, g, beta, out=None, step_states=None) -> o``, the same call as ``kda_decode(q, k, v, g, beta,
    state_pool, state_indices, ...)`` with the bound tensors and flags.

    Per step only the token tensors' shapes and dtypes are read on cula's kernels (the compiled entry checks the
    rest before it launches, and a call it refuses is validated in full: ``cula.backends.StepPlans``), against
    every signature field of eleven tensors for ``kda_decode``: the bound ``state_pool``, ``state_indices``,
    ``A_log`` and ``dt_bias`` are validated with the first step of each new token signature and must keep their
    shapes, strides, dtype and device from then on (their values may change between steps: the kernel reads them
    each time, so an engine updates the slot indices in place). Validation, errors and results are those of
    :func:`kda_decode`.
    """
    plans = StepPlans()
    flags = (use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)

    def bound_plan(q, k, v, g, beta, out, step_states):
        """``_plan`` for a new token signature, with the bound arguments fixed: ``tokens(q, k, v, g, beta, out,
        step_states)``."""
        launch = _plan(
            q, k, v, g, beta, state_pool, state_indices, A_log, dt_bias, scale, *flags, lower_bound, state_v_first,
            out, step_states,
        )  # fmt: skip
        scale_ = check_scale(scale, q.shape[-1])
        bind = getattr(launch, "bind", None)  # the cula-sm90 fast launch's (kda_decode_launcher's argument order)
        if bind is not None:
            return bind(A_log, dt_bias, state_pool, state_indices, scale_, lower_bound)
        return lambda q, k, v, g, beta, out, step_states: launch(
            q, k, v, g, beta, state_pool, state_indices, A_log, dt_bias, scale_, lower_bound, out, step_states
        )

    def step(q, k, v, g, beta, out=None, step_states=None):
        if is_compiling() and _custom_ops.routes():  # the kda_decode call this step stands for, as an op
            return kda_decode(
                q, k, v, g, beta, state_pool, state_indices, A_log=A_log, dt_bias=dt_bias, scale=scale,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                lower_bound=lower_bound, state_v_first=state_v_first, out=out, step_states=step_states,
                check_indices=check_indices,
            )  # fmt: skip
        try:  # the step's short key (cula.backends.StepPlans)
            key = (q.shape, v.shape, q.dtype, g.dtype, g.dim(), beta.dtype, out is None, step_states is None,
                   forced_backend())  # fmt: skip
        except AttributeError:
            key = None  # not tensors: validated in full
        if key is not None and key == plans.last_key:  # the loop's signature again: straight to its launch
            if check_indices:
                check_pool_indices(state_indices, state_pool.shape[0])
            o = torch.empty_like(v, memory_format=torch.contiguous_format) if out is None else out
            try:
                plans.last_launch(q, k, v, g, beta, o, step_states)
                return o
            except Exception:  # noqa: BLE001  (refused before any launch: the general path finds out why)
                plans.last_key = None

        def call(tokens):
            if check_indices:
                check_pool_indices(state_indices, state_pool.shape[0])
            o = torch.empty_like(v, memory_format=torch.contiguous_format) if out is None else out
            tokens(q, k, v, g, beta, o, step_states)
            return o

        return plans.run(
            key, call,
            lambda: (*token_sigs(q, k, v, g, beta), None if out is None else tensor_sig(out),
                     None if step_states is None else tensor_sig(step_states), forced_backend()),
            lambda: bound_plan(q, k, v, g, beta, out, step_states),
        )  # fmt: skip

    return step


def _plan(
    q, k, v, g, beta, state_pool, state_indices, A_log, dt_bias, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
    use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first, out, step_states,
):  # fmt: skip
    """Validate a call with a new signature in full and choose its launch (raises on bad input)."""
    given = (q, k, v, g, beta, state_indices, A_log, dt_bias)
    rows = contiguous_reads(*given)
    # an input strided in its last dimension: planned as its row-major copy
    if any(r is not t for r, t in zip(rows, given)):
        return copying_reads(_plan(*rows[:5], state_pool, *rows[5:], scale, use_qk_l2norm_in_kernel,
                                   use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
                                   state_v_first, out, step_states))  # fmt: skip
    N, T, _H, K, HV, V = check_qkv(q, k, v)
    check_decode_tokens("kda_decode", T)
    dev = q.device
    per_head = getattr(g, "ndim", None) == 3  # one gate per token and value head (Gated DeltaNet's)
    check_tensor("g", g, shape=(N, T, HV) if per_head else (N, T, HV, K), dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("beta", beta, shape=(N, T, HV), dtypes=(torch.float32, torch.bfloat16), device=dev)
    check_state_pool(
        state_pool, state_indices, n=N, heads=HV, k=K, v=V, state_v_first=state_v_first, device=dev
    )
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise ValueError(
                "`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set"
            )
        if A_log is not None:
            check_tensor("A_log", A_log, shape=(HV,), dtypes=(torch.float32,), device=dev)
        if dt_bias is not None:
            want = (HV,) if per_head else (HV * K,)
            if isinstance(dt_bias, torch.Tensor) and tuple(dt_bias.shape) != want:
                gate = f"a per-head gate g {list(g.shape)}" if per_head else f"a per-channel gate g {list(g.shape)}"
                raise ValueError(f"`dt_bias` must have shape {list(want)} with {gate}, got {list(dt_bias.shape)}")
            check_tensor("dt_bias", dt_bias, shape=want, dtypes=(torch.float32,), device=dev)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`")
    check_lower_bound(lower_bound)
    if out is None:
        # stands for the fresh buffer every such call allocates
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
    else:
        check_tensor("out", out, shape=tuple(v.shape), dtypes=(q.dtype,), device=dev)
    if step_states is not None:
        check_tensor(
            "step_states", step_states, shape=(N, T) + tuple(state_pool.shape[1:]), dtypes=(torch.float32,),
            device=dev,
        )  # fmt: skip
    flags = dict(
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first,
    )  # fmt: skip
    run = kda_decode_registry.plan(dev, dict(
        q=q, k=k, v=v, g=g, beta=beta, state_pool=state_pool, state_indices=state_indices, A_log=A_log,
        dt_bias=dt_bias, scale=check_scale(scale, K), lower_bound=lower_bound, out=out, step_states=step_states,
        **flags,
    ))  # fmt: skip
    if getattr(run, "positional", False):
        return run

    # the flags are part of the plan key, so they are bound here once
    def launch(q, k, v, g, beta, state_pool, state_indices, A_log, dt_bias, scale, lower_bound, out, step_states):
        run(q=q, k=k, v=v, g=g, beta=beta, state_pool=state_pool, state_indices=state_indices, A_log=A_log,
            dt_bias=dt_bias, scale=scale, lower_bound=lower_bound, out=out, step_states=step_states,
            **flags)  # fmt: skip

    return launch


def _cula_supports(q, k, v, g, state_pool, state_v_first, step_states=None, **_) -> tuple:
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False, f"q dtype {q.dtype} (kernel takes bf16/fp16)"
    if k.dtype != q.dtype or v.dtype != q.dtype:  # (kda_decode's validation refuses these: a guard for the kernel)
        return False, f"q / k / v dtypes {q.dtype} / {k.dtype} / {v.dtype} (kernel takes one bf16/fp16 dtype)"
    if g.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False, f"g dtype {g.dtype} (kernel takes bf16/fp16/fp32)"
    if (q.shape[-1], v.shape[-1]) not in ((64, 64), (128, 128)):
        return False, f"head sizes K={q.shape[-1]} V={v.shape[-1]} (kernel takes K = V in {{64, 128}})"
    if step_states is not None and not is_dense(step_states):
        return False, "step_states is not row-major and 16-byte aligned"
    if state_pool.dtype != torch.float32:  # (validation refuses other pools: a guard for the kernel's fp32 reads)
        return False, f"state_pool dtype {state_pool.dtype} (the kernel takes an fp32 pool)"
    fits, why = int32_offsets_verdict(q.shape, v.shape, g.shape)
    if not fits:
        return False, why
    return pool_layout_verdict(state_pool, q.shape[-1], v.shape[-1], state_v_first)


def _prepare_cula_sm90(q, k, v, g, beta, state_pool, state_indices, A_log, dt_bias, use_qk_l2norm_in_kernel,
                       use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,
                       out, step_states, **_):  # fmt: skip
    """The compiled kernel bound once, called with ``kda_decode``'s positional launch arguments (see ``_plan``);
    None (the general path) where an input needs a dense copy first."""
    from cula.kda.plan import KDA_TUNING, kda_decode_launcher

    if q.shape[0] == 0 or not all(is_dense(t) for t in (q, k, v, g, beta, state_indices, out)):
        return None
    if not all(t is None or is_dense(t) for t in (A_log, dt_bias)):
        return None
    bound = kda_decode_launcher(
        io_dtype=q.dtype, g_dtype=g.dtype, beta_dtype=beta.dtype, K=q.shape[-1], V=v.shape[-1],
        gate=gate_kind(use_gate_in_kernel, lower_bound), has_a_log=A_log is not None,
        has_dt_bias=dt_bias is not None, use_qk_l2norm=use_qk_l2norm_in_kernel, beta_sigmoid=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, has_step_states=step_states is not None,
        tokens=q.shape[1], states=q.shape[0] * v.shape[2], tuning=KDA_TUNING.for_device(q.device),
        per_head_gate=g.dim() == 3,
    )  # fmt: skip

    def launch(q, k, v, g, beta, state_pool, state_indices, A_log, dt_bias, scale, lower_bound, out, step_states):
        bound(q, k, v, g, beta, A_log, dt_bias, state_pool, state_indices, out, step_states, scale, lower_bound)

    launch.positional = True
    launch.checks_arguments = True  # one call of the compiled entry, which checks every tensor before launching
    launch.bind = bound.bind  # kda_decode_step's launch, the kernel called without the positional shuffle
    return launch


@kda_decode_registry.register(
    "cula-sm90", 10, available=cula_kernels_on((9, 0)), supports=_cula_supports, prepare=_prepare_cula_sm90
)
def _decode_cula_sm90(
    q,
    k,
    v,
    g,
    beta,
    state_pool,
    state_indices,
    A_log,
    dt_bias,
    scale,
    use_qk_l2norm_in_kernel,
    use_gate_in_kernel,
    use_beta_sigmoid_in_kernel,
    allow_neg_eigval,
    lower_bound,
    state_v_first,
    out,
    step_states,
):
    from cula.kda.plan import kda_decode_sm90

    gate = gate_kind(use_gate_in_kernel, lower_bound)
    # The kernel was compiled for row-major tensors (compact fakes); decode inputs are a few KB per sequence, so a
    # copy of an odd-strided one costs little and keeps the first call of a signature on the layout it was built for.
    q, k, v, g, beta, state_indices = (dense(t) for t in (q, k, v, g, beta, state_indices))
    A_log, dt_bias = (None if t is None else dense(t) for t in (A_log, dt_bias))
    o = out if is_dense(out) else torch.empty_like(out, memory_format=torch.contiguous_format)  # row-major
    kda_decode_sm90(
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        state_pool,
        state_indices,
        o,
        scale=scale,
        gate=gate,
        lower_bound=lower_bound,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        beta_sigmoid=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first,
        step_states=step_states,
    )
    if o is not out:
        out.copy_(o)


@kda_decode_registry.register("reference", 90, available=always)
def _decode_reference(
    q,
    k,
    v,
    g,
    beta,
    state_pool,
    state_indices,
    A_log,
    dt_bias,
    scale,
    use_qk_l2norm_in_kernel,
    use_gate_in_kernel,
    use_beta_sigmoid_in_kernel,
    allow_neg_eigval,
    lower_bound,
    state_v_first,
    out,
    step_states,
):
    from cula.kda.naive import reference_chunk_kda
    from cula.kda.plan import gate_over_k

    if g.dim() == 3:  # one gate per token and value head: the same recurrence with it on every K channel
        g, dt_bias = gate_over_k(g, dt_bias, q.shape[-1])
    # the range with check_indices=False too: torch's indexing below would fail inside a kernel (on CUDA, a device
    # assert); a repeated row indexes fine (last write kept, as the kernels' race), refused only where checked
    check_pool_indices(state_indices, state_pool.shape[0], distinct=False)
    live = state_indices >= 0
    rows = state_indices.long().clamp(min=0)
    flags = dict(
        scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound,
        A_log=A_log,
        dt_bias=dt_bias,
        state_v_first=state_v_first,
        form="recurrent",
    )
    with torch.no_grad():
        states = state_pool[rows]
        o = torch.zeros_like(v)
        for t in range(q.shape[1]):  # one token at a time so every intermediate state is available
            sl = slice(t, t + 1)
            o_t, states = reference_chunk_kda(
                q[:, sl],
                k[:, sl],
                v[:, sl],
                g[:, sl],
                beta[:, sl],
                initial_state=states,
                output_final_state=True,
                **flags,
            )
            o[:, sl] = o_t
            if step_states is not None:
                step_states[live, t] = states[live]
        out.copy_(torch.where(live[:, None, None, None], o, torch.zeros_like(o)))
        if step_states is None:
            state_pool[rows[live]] = states[live]


def kda_commit_accepted(
    step_states: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
) -> None:
    r"""Write each sequence's state after its last accepted token into the pool (speculative decoding).

    After a verify call ``kda_decode(..., step_states=buf)``, ``num_accepted_tokens[n]`` (int, 0..T) says how
    many of sequence ``n``'s T tokens were accepted; this copies ``buf[n, num_accepted_tokens[n] - 1]`` into
    ``state_pool[state_indices[n]]``. Sequences with 0 accepted tokens or a negative index keep their pool row; two
    sequences that both write one row are refused (``ValueError``), as are rows past the pool and counts outside 0..T.

    Args:
        step_states: fp32 ``[N, T, HV, ...]`` from :func:`kda_decode`.
        state_pool: fp32 ``[P, HV, ...]``, updated in place.
        state_indices: int32 ``[N]``.
        num_accepted_tokens: int32/int64 ``[N]``.
    """
    if is_compiling() and _custom_ops.routes():  # torch.compile traces the cula::kda_commit_accepted op instead
        return _custom_ops.kda_commit_accepted(step_states, state_pool, state_indices, num_accepted_tokens)
    step_states, state_indices, num_accepted_tokens = contiguous_reads(step_states, state_indices, num_accepted_tokens)
    check_tensor("step_states", step_states, ndim=5, dtypes=(torch.float32,))
    dev = step_states.device
    check_tensor("state_pool", state_pool, ndim=4, dtypes=(torch.float32,), device=dev)
    N, T, state_shape = step_states.shape[0], step_states.shape[1], tuple(state_pool.shape[1:])
    if tuple(step_states.shape[2:]) != state_shape:
        raise ValueError(
            f"`step_states` [N, T, HV, ...] must hold states of `state_pool`'s shape {list(state_shape)}, got "
            f"{list(step_states.shape)}"
        )
    check_tensor("state_indices", state_indices, shape=(N,), dtypes=(torch.int32,), device=dev)
    check_tensor("num_accepted_tokens", num_accepted_tokens, shape=(N,), dtypes=(torch.int32, torch.int64), device=dev)
    # The values are read on the host (once per verify step, not per token): an out-of-range row would fail inside
    # torch's indexing kernel (on CUDA, a device assert), and two sequences written to one row would leave either
    # state there. The rows to write are then picked on the host too, so that only the kept states are gathered.
    rows = check_pool_indices(state_indices, state_pool.shape[0], distinct=False)
    accepted = num_accepted_tokens.tolist()
    if accepted and not 0 <= min(accepted) <= max(accepted) <= T:
        raise ValueError(f"`num_accepted_tokens` must lie in 0..T={T}, got {accepted[:16]}")
    writes = [(n, a - 1, row) for n, (row, a) in enumerate(zip(rows or (), accepted)) if row >= 0 and a > 0]
    refuse_repeated_rows(row for _, _, row in writes)
    if not writes:  # no token accepted (or none verified, T = 0): every row kept
        return
    seq, pos, dst = torch.tensor(writes, dtype=torch.long, device=dev).unbind(1)
    state_pool[dst] = step_states[seq, pos]
