"""``torch.compile`` support: every public entry point behind a ``torch.library`` custom op.

Dynamo cannot trace cula's eager plumbing (plan keys read data pointers, backend selection reads the environment and
logs), and a compiled graph should hold a cula call as one node anyway. So while Dynamo traces
(``torch.compiler.is_compiling()``), each public function calls its twin here instead, which maps FLA's keyword
signature onto a flat op schema (tensors, optional tensors, plain scalars) and calls the op:

- the op's implementation is the eager public function itself (validation, backend registry, plan caches, kernels),
  run when the graph runs: a compiled call computes what the eager call computes, bit for bit, on the backend the
  eager call would choose;
- its fake implementation gives the outputs' shapes and dtypes from the inputs' metadata alone, symbolic lengths and
  sequence counts (``cu_seqlens.shape[0] - 1``) included, so a new length does not recompile; it also checks q, k
  and v with eager's rules, so that a malformed call fails to compile;
- the twins copy the inputs an op only reads where they are strided in their last dimension, as the eager calls do
  (``cula._validate.contiguous_reads``; the copies are nodes of the graph, so gradients reach the caller's tensors),
  and hand the ops row-major tensors;
- state pools updated in place (``kda_decode``, ``lightning_decode``, ``kda_commit_accepted``, the in-place
  ``fused_recurrent_kda_fwd``) and ``out`` / ``step_states`` buffers are the ops' declared mutations; such an op
  cannot have an autograd formula, and these have no backward in FLA or cula either;
- every other op has a backward op, registered as its autograd. Where cula's forward kernels run a training call on
  SM90 (``chunk_kda``, Lightning through ``chunk_simple_gla``), the backward op runs that path's own backward (for
  ``chunk_kda`` from the Aqk and Akk the forward op returns beside ``o``, as ``_ChunkKDATraining`` keeps them); on
  the backends with an autograd of their own (FLA's, the reference's) it runs the eager call again under autograd
  and differentiates it: the eager backward exactly, for a second forward.

Outputs a call does not produce (no final state, no scores) come back as empty tensors, since an op's outputs are
fixed by its schema; the twins here turn them back into None. Forms the ops do not take (context parallel, FLA's
intermediate states, arguments the eager call rejects, which it then names) run the eager function through
``torch.compiler.disable``: a graph break, an error under ``fullgraph=True``.

This module does not import the subpackages (they import it); the ops' implementations do, when they run.
"""

import importlib
from typing import Optional

import torch
from torch import Tensor

from cula._validate import contiguous_reads

_depth = 0  # > 0 while an op's implementation runs an eager public function


def routes() -> bool:
    """Whether a public function called under ``torch.compiler.is_compiling()`` should call its op.

    Not from an op's own implementation: it runs the eager function, at times inside a compile session (whose flag
    ``is_compiling`` reads), e.g. when inductor folds a constant through the op, and would call itself."""
    return _depth == 0


class _EagerPath:
    """Marks an op implementation's eager call (see ``routes``)."""

    def __enter__(self):
        global _depth
        _depth += 1

    def __exit__(self, *exc):
        global _depth
        _depth -= 1


_eager_path = _EagerPath()

_DK = torch._C.DispatchKey
_AUTOGRAD_KEYS = (_DK.AutogradFunctionality, _DK.AutogradOther, _DK.AutogradNestedTensor)


def _recording():
    """Dispatch with autograd, as outside the op. An op's implementation runs below autograd (its own autograd is
    the registered one), where tensors record nothing; a backward op that differentiates the eager call restores it.
    """
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


_PUBLIC_MODULES = {
    "chunk_kda": "cula.kda.chunk",
    "fused_recurrent_kda_fwd": "cula.kda.fused_recurrent",
    "fused_recurrent_kda": "cula.kda.fused_recurrent",
    "kda_decode": "cula.kda.decode",
    "kda_commit_accepted": "cula.kda.decode",
    "chunk_simple_gla": "cula.simple_gla.chunk",
    "lightning_decode": "cula.lightning.decode",
    "chunk_gated_delta_rule": "cula.gated_delta_rule.chunk",
    "fused_recurrent_gated_delta_rule": "cula.gated_delta_rule.fused_recurrent",
    "fused_recurrent_simple_gla": "cula.simple_gla.chunk",
}


def _public(name: str):
    return getattr(importlib.import_module(_PUBLIC_MODULES[name]), name)


def _eager(name: str, *args, **kwargs):
    """The eager call outside the graph (a graph break): forms the ops do not take, and arguments the eager call
    rejects, which it then names as it always does. (``torch.compiler.disable`` applied here, when Dynamo traces:
    as a decorator at import it would import Dynamo, inductor and triton with ``cula.kda``.)"""
    return torch.compiler.disable(_call_public)(name, *args, **kwargs)


def _call_public(name: str, *args, **kwargs):
    return _public(name)(*args, **kwargs)


def _run(name: str, kwargs: dict):
    """The eager public function ``name`` on an op's arguments, autograd off (the op's autograd is its own)."""
    with _eager_path, torch.no_grad():
        return _public(name)(**kwargs)


def _run_training(name: str, kwargs: dict, grad_names: tuple):
    """``_run`` as a training step's forward: with autograd on and the floating inputs of ``grad_names`` requiring a
    gradient, so that a backend that would decline a training call declines it here
    too. Nothing is recorded (the op runs below autograd)."""
    call = dict(kwargs)
    for n in grad_names:
        t = call[n]
        if t is not None and t.is_floating_point():
            call[n] = t.detach().requires_grad_()
    with _eager_path, torch.enable_grad():
        return tuple(None if t is None else t.detach() for t in _public(name)(**call))


def _recompute_grads(name: str, kwargs: dict, grad_names: tuple, needs, grad_outputs) -> list:
    """The gradients of the inputs ``grad_names`` flagged in ``needs`` (None elsewhere), by running the eager call
    again with autograd recording and differentiating its outputs against ``grad_outputs`` (None: unused)."""
    call = dict(kwargs)
    leaves = []
    for n, need in zip(grad_names, needs):
        if need and call[n] is not None:
            call[n] = call[n].detach().requires_grad_()
            leaves.append(call[n])
    found = [None] * len(leaves)
    with _eager_path, _recording(), torch.enable_grad():
        outs = _public(name)(**call)
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o is not None and o.requires_grad]
        if pairs and leaves:
            found = torch.autograd.grad(
                [o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True
            )  # fmt: skip
    found = iter(found)
    return [next(found) if need and kwargs[n] is not None else None for n, need in zip(grad_names, needs)]


def _empty(like: Tensor) -> Tensor:
    """An output the call does not produce."""
    return like.new_empty(0)


def _fresh(t: Tensor, *inputs) -> Tensor:
    """``t`` contiguous (the strides its fake gives) and not sharing memory with an input (an op's outputs may not
    alias its inputs: e.g. the reference passes an empty sequence's state through)."""
    t = t.contiguous()
    ptr = t.untyped_storage().data_ptr()
    if ptr and any(x is not None and x.untyped_storage().data_ptr() == ptr for x in inputs):
        return t.clone()
    return t


def _gate_needs(needs: list, grad_names: tuple, use_gate_in_kernel: bool) -> list:
    """``needs`` without A_log and dt_bias where the call has no fused gate: eager autograd leaves their gradients
    None then (the call never reads them), and zeros would, e.g., let AdamW decay a parameter eager leaves alone."""
    if use_gate_in_kernel:
        return needs
    return [need and name not in ("A_log", "dt_bias") for need, name in zip(needs, grad_names)]


def _grads_out(grads, inputs, needs, like: Tensor, *args) -> tuple:
    """A backward op's outputs: each needed input's gradient in its shape, dtype and contiguous (zeros where the
    backend gives none; a copy where it is one of the op's tensor ``args``, e.g. an incoming gradient passed
    through), an empty tensor for the rest."""
    out = []
    for grad, x, need in zip(grads, inputs, needs):
        if not need or x is None:
            out.append(_empty(like))
        elif grad is None:
            out.append(torch.zeros(x.shape, dtype=x.dtype, device=x.device))
        else:
            out.append(_fresh(grad.to(x.dtype).reshape(x.shape), *args))
    return tuple(out)


def _fake_grads(inputs, needs, like: Tensor) -> tuple:
    return tuple(
        x.new_empty(x.shape) if need and x is not None else _empty(like)
        for x, need in zip(inputs, needs)
    )


def _check_tokens(q, k, v, head_limit: int | None = 256, mixed: bool = False) -> None:
    """The token tensors' shapes and dtypes, checked when the graph is traced (on their metadata, eager's rules and
    errors), so that a bad call fails to compile instead of failing when the graph runs; the rest of the validation
    reads values or is the op's eager call's. ``head_limit``: the op's eager one (Simple GLA's: None); ``mixed``: q,
    k, v of any float dtypes, as the recurrent forms take them."""
    from cula._validate import check_qkv

    check_qkv(q, k, v, head_limit, mixed)


def _param_names(params: str) -> list[str]:
    """The argument names of a schema's argument list (``"Tensor q, float? scale"``: ``["q", "scale"]``)."""
    return [p.split()[-1] for p in params.split(", ")]


def _state_shape(n, heads: int, k: int, v: int, state_v_first: bool) -> tuple:
    return (n, heads, v, k) if state_v_first else (n, heads, k, v)


def _sequences(q: Tensor, cu_seqlens: Optional[Tensor]):
    """N: the batch, or the packed sequences (symbolic where ``cu_seqlens``' length is)."""
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _requires_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _layout(state_v_first, kwargs):
    """``state_v_first``, or FLA's deprecated alias from ``kwargs``, without eager's DeprecationWarning (Dynamo
    cannot trace ``warnings.warn``)."""
    return bool(kwargs.get("transpose_state_layout", state_v_first))


def _alias_ok(state_v_first, kwargs, allowed) -> bool:
    """The keywords ``**kwargs`` may carry, and not both layout spellings (eager names what is wrong)."""
    return allowed.issuperset(kwargs) and not (state_v_first and "transpose_state_layout" in kwargs)


_LAYOUT_ONLY = frozenset(("transpose_state_layout",))
# fused_recurrent_kda's serving keywords (fused_recurrent_kda_fwd's own arguments)
_DECODE_KWARG_NAMES = ("ssm_state_indices", "num_accepted_tokens", "inplace_final_state", "out")


# ----------------------------------------------------------------------------------------------------------------
# chunk_kda


# the op's differentiable inputs, in the order of its schema and of _ChunkKDATraining's gradients
_KDA_GRADS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


# chunk_kda's flat schema, one list for both ops: the backward op takes the forward op's arguments (less
# `training`) to run or differentiate the very call the forward ran
_KDA_PARAMS = (
    "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, Tensor? initial_state, "
    "Tensor? cu_seqlens, Tensor? cu_seqlens_cpu, float? scale, bool output_final_state, "
    "bool use_qk_l2norm_in_kernel, bool use_gate_in_kernel, bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval, "
    "bool safe_gate, float? lower_bound, bool disable_recompute, bool state_v_first, SymInt chunk_size, "
    "SymInt? max_num_seqs, bool use_graph"
)
_KDA_NAMES = _param_names(_KDA_PARAMS)


def _chunk_kda(*args) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(o, final_state, Aqk, Akk)``: ``chunk_kda``'s outputs (final_state empty unless ``output_final_state``),
    and, for a ``training`` call that runs ``_ChunkKDATraining``, the scores its backward reads (else empty)."""
    call, training = dict(zip(_KDA_NAMES, args)), args[-1]
    q = call["q"]
    if training and _kda_keeps_scores(call):
        from cula.kda import backends, chunk

        with _eager_path:
            args = chunk._checked(_kda_dispatch_args(call))
            o, final, Aqk, Akk = backends.chunk_kda_training_forward(args)
    else:
        o, final = _run_training("chunk_kda", call, _KDA_GRADS) if training else _run("chunk_kda", call)
        Aqk, Akk = _empty(q), _empty(q)
    inputs = tuple(call[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    final = _empty(q) if final is None else _fresh(final, *inputs)
    return _fresh(o, *inputs), final, Aqk, Akk


_chunk_kda_op = torch.library.custom_op(
    "cula::chunk_kda", _chunk_kda, mutates_args=(),
    schema=f"({_KDA_PARAMS}, bool training) -> (Tensor, Tensor, Tensor, Tensor)",
)  # fmt: skip


def _kda_dispatch_args(call: dict) -> dict:
    """The eager dispatch dictionary of an op call's arguments (unvalidated, scale unresolved)."""
    from cula.kda import chunk

    scope = {n: call.get(n) for n in chunk._PUBLIC_ARGS}
    scope["kwargs"] = {"A_log": call["A_log"], "dt_bias": call["dt_bias"], "chunk_size": call["chunk_size"]}
    return chunk._full_call(scope)


def _kda_keeps_scores(call: dict) -> bool:
    from cula.kda import backends

    return backends.chunk_training_keeps_scores(_kda_dispatch_args(call))


@_chunk_kda_op.register_fake
def _(*args):
    call, training = dict(zip(_KDA_NAMES, args)), args[-1]
    q, v = call["q"], call["v"]
    _check_tokens(q, call["k"], v)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = q.new_empty(B, T, HV, V)
    final = _empty(q)
    if call["output_final_state"]:
        shape = _final_shape(q, v, call["cu_seqlens"], call["state_v_first"])
        final = q.new_empty(shape, dtype=torch.float32)
    if training and _kda_keeps_scores(call):
        return o, final, q.new_empty(B, T, HV, 64), q.new_empty(B, T, HV, 64)
    return o, final, _empty(q), _empty(q)


def _chunk_kda_bwd(do, dht, Aqk, Akk, needs, *args) -> tuple[Tensor, ...]:
    """The gradients of ``_KDA_GRADS`` flagged in ``needs`` (empty where not), given ``do`` and ``dht`` (None when
    the final state's gradient is)."""
    call = dict(zip(_KDA_NAMES, args))
    q = call["q"]
    inputs = [call[n] for n in _KDA_GRADS]
    if Aqk.dim() == 4:  # the forward ran _ChunkKDATraining's: its backward, on the scores it kept
        from cula._validate import check_scale
        from cula.kda import backends

        args = _kda_dispatch_args(call)
        args["scale"] = check_scale(call["scale"], q.shape[-1])
        with _eager_path:
            grads = backends.chunk_kda_training_backward(args, Aqk, Akk, do, dht)
    else:
        grads = _recompute_grads("chunk_kda", call, _KDA_GRADS, needs, (do, dht))
    return _grads_out(grads, inputs, needs, q, do, dht, *inputs)


_chunk_kda_bwd_op = torch.library.custom_op(
    "cula::chunk_kda_bwd", _chunk_kda_bwd, mutates_args=(),
    schema=f"(Tensor do, Tensor? dht, Tensor Aqk, Tensor Akk, bool[] needs, {_KDA_PARAMS}) -> "
    f"({', '.join(['Tensor'] * len(_KDA_GRADS))})",
)  # fmt: skip


@_chunk_kda_bwd_op.register_fake
def _(do, dht, Aqk, Akk, needs, q, k, v, g, beta, A_log, dt_bias, initial_state, *_):
    return _fake_grads((q, k, v, g, beta, A_log, dt_bias, initial_state), needs, q)


def _chunk_kda_setup(ctx, inputs, output):
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, *scalars = inputs
    _o, final, Aqk, Akk = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(Aqk, Akk)
    if not scalars[1]:  # output_final_state
        ctx.mark_non_differentiable(final)
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, Aqk, Akk)
    ctx.scalars = scalars[:-1]  # all but `training`


def _chunk_kda_backward(ctx, do, dht, _dAqk, _dAkk):
    *tensors, Aqk, Akk = ctx.saved_tensors
    q, v = tensors[0], tensors[2]
    output_final_state = ctx.scalars[1]
    needs = _gate_needs(list(ctx.needs_input_grad[: len(_KDA_GRADS)]), _KDA_GRADS, ctx.scalars[3])
    # what autograd materialises for an unused output: zeros, which _ChunkKDATraining's backward then reads
    if do is None:
        do = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    if dht is None and output_final_state and Aqk.dim() == 4:
        dht = torch.zeros(_final_shape(q, v, tensors[8], ctx.scalars[9]), dtype=torch.float32, device=q.device)
    grads = torch.ops.cula.chunk_kda_bwd(do, dht, Aqk, Akk, needs, *tensors, *ctx.scalars)
    grads = [gr if need else None for gr, need in zip(grads, needs)]
    return (*grads, *(None,) * (len(ctx.needs_input_grad) - len(grads)))


def _final_shape(q, v, cu_seqlens, state_v_first) -> tuple:
    return _state_shape(_sequences(q, cu_seqlens), v.shape[2], q.shape[3], v.shape[3], state_v_first)


_chunk_kda_op.register_autograd(_chunk_kda_backward, setup_context=_chunk_kda_setup)

_KDA_EXTRA = frozenset(("A_log", "dt_bias", "chunk_size", "transpose_state_layout"))


def chunk_kda(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
    lower_bound=None, disable_recompute=False, return_intermediate_states=False, state_v_first=False, cu_seqlens=None,
    cu_seqlens_cpu=None, cp_context=None, use_graph=False, max_num_seqs=None, **kwargs,
):  # fmt: skip
    """``cula.kda.chunk_kda`` under ``torch.compile``: the ``cula::chunk_kda`` op."""
    if cp_context is not None or return_intermediate_states or not _alias_ok(state_v_first, kwargs, _KDA_EXTRA):
        return _eager(
            "chunk_kda", q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
            disable_recompute, return_intermediate_states, state_v_first, cu_seqlens, cu_seqlens_cpu, cp_context,
            use_graph, max_num_seqs, **kwargs,
        )  # fmt: skip
    state_v_first = _layout(state_v_first, kwargs)
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens = contiguous_reads(
        q, k, v, g, beta, kwargs.get("A_log"), kwargs.get("dt_bias"), initial_state, cu_seqlens
    )
    o, final, _, _ = torch.ops.cula.chunk_kda(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, bool(output_final_state),
        bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel), bool(use_beta_sigmoid_in_kernel),
        bool(allow_neg_eigval), bool(safe_gate), lower_bound, bool(disable_recompute), bool(state_v_first),
        kwargs.get("chunk_size", 64), max_num_seqs, bool(use_graph),
        _requires_grad(q, k, v, g, beta, A_log, dt_bias, initial_state),
    )  # fmt: skip
    return o, final if output_final_state else None


# ----------------------------------------------------------------------------------------------------------------
# fused_recurrent_kda / fused_recurrent_kda_fwd (forward only, as in FLA)


@torch.library.custom_op("cula::fused_recurrent_kda_pool", mutates_args=("initial_state", "out"))
def _fused_recurrent_kda_pool_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    initial_state: Tensor,
    cu_seqlens: Optional[Tensor],
    ssm_state_indices: Optional[Tensor],
    num_accepted_tokens: Optional[Tensor],
    out: Optional[Tensor],
    scale: Optional[float],
    output_final_state: bool,
    state_v_first: bool,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    lower_bound: Optional[float],
) -> Tensor:
    """``fused_recurrent_kda_fwd`` with ``inplace_final_state=True``: the state pool ``initial_state`` updated in place,
    ``o`` written into ``out`` when given (then returns an empty tensor), else returned. Not differentiable (an op
    that mutates cannot have an autograd formula; FLA's and cula's serving kernels have none either)."""
    o, _ = _run("fused_recurrent_kda_fwd", dict(locals(), inplace_final_state=True))
    return _empty(q) if out is not None else _fresh(o, q, k, v, g, beta, initial_state)


@_fused_recurrent_kda_pool_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens, out, *_):
    _check_tokens(q, k, v, None, mixed=True)
    return _empty(q) if out is not None else v.new_empty(v.shape)  # o in v's dtype, as FLA's


def fused_recurrent_kda_fwd(
    q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None, output_final_state=False,
    inplace_final_state=True, state_v_first=False, cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
    lower_bound=None, out=None, **kwargs,
):  # fmt: skip
    """``cula.kda.fused_recurrent_kda_fwd`` (and ``fused_recurrent_kda``) under ``torch.compile``: the
    ``cula::fused_recurrent_kda_pool`` op in place, else ``cula::fused_recurrent_kda`` (defined with the ops run on
    their own below)."""
    pooled = inplace_final_state and initial_state is not None
    functional = not inplace_final_state and ssm_state_indices is None and num_accepted_tokens is None and out is None
    kwargs.pop("transpose_state_layout", None)  # FLA's form ignores it, and so does eager (with a warning)
    if not (pooled or functional) or kwargs:
        return _eager(
            "fused_recurrent_kda_fwd", q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state,
            inplace_final_state, state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens,
            use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
            out, **kwargs,
        )  # fmt: skip
    flags = (
        bool(state_v_first), bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel),
        bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval), lower_bound,
    )  # fmt: skip
    q, k, v, g, beta, A_log, dt_bias, cu_seqlens, ssm_state_indices, num_accepted_tokens = contiguous_reads(
        q, k, v, g, beta, A_log, dt_bias, cu_seqlens, ssm_state_indices, num_accepted_tokens
    )
    if pooled:
        # detached: no autograd would reach a mutating op's output anyway, and AOT would trace a backward for it
        tokens = (q, k, v, g, beta, A_log, dt_bias)
        q, k, v, g, beta, A_log, dt_bias = (None if t is None else t.detach() for t in tokens)
        o = torch.ops.cula.fused_recurrent_kda_pool(
            q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
            out, scale, bool(output_final_state), *flags,
        )  # fmt: skip
        return (o if out is None else out), initial_state
    (initial_state,) = contiguous_reads(initial_state)  # read only here
    o, final = torch.ops.cula.fused_recurrent_kda(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, bool(output_final_state), *flags
    )
    return o, final if output_final_state else None


def fused_recurrent_kda(
    q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
    lower_bound=None, state_v_first=False, cu_seqlens=None, **kwargs,
):  # fmt: skip
    """``cula.kda.fused_recurrent_kda`` under ``torch.compile`` (``fused_recurrent_kda_fwd``'s ops, the layout
    alias resolved here: this form honours it, FLA's low-level one does not)."""
    if not _alias_ok(state_v_first, kwargs, _LAYOUT_ONLY | frozenset(_DECODE_KWARG_NAMES)):
        return _eager(
            "fused_recurrent_kda", q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
            use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
            state_v_first, cu_seqlens, **kwargs,
        )  # fmt: skip
    state_v_first = _layout(state_v_first, kwargs)
    kwargs.pop("transpose_state_layout", None)
    kwargs.setdefault("inplace_final_state", False)
    return fused_recurrent_kda_fwd(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state, scale=scale,
        output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, **kwargs,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# kda_decode / kda_decode_step / kda_commit_accepted


@torch.library.custom_op("cula::kda_decode", mutates_args=("state_pool", "out", "step_states"))
def _kda_decode_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_indices: Tensor,
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    out: Tensor,
    step_states: Optional[Tensor],
    scale: Optional[float],
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    lower_bound: Optional[float],
    state_v_first: bool,
    check_indices: bool,
) -> None:
    """``kda_decode``, writing ``o`` into ``out`` (the pool updated in place, or ``step_states`` written)."""
    _run("kda_decode", dict(locals()))


@_kda_decode_op.register_fake
def _(q, k, v, *_):
    _check_tokens(q, k, v)


def kda_decode(
    q, k, v, g, beta, state_pool, state_indices, *, A_log=None, dt_bias=None, scale=None, use_qk_l2norm_in_kernel=True,
    use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False, lower_bound=None,
    state_v_first=True, out=None, step_states=None, check_indices=True,
):  # fmt: skip
    """``cula.kda.kda_decode`` under ``torch.compile``: the ``cula::kda_decode`` op."""
    q, k, v, g, beta, state_indices, A_log, dt_bias = contiguous_reads(q, k, v, g, beta, state_indices, A_log, dt_bias)
    if out is None:  # the buffer the eager call would allocate
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
    torch.ops.cula.kda_decode(
        q, k, v, g, beta, state_pool, state_indices, A_log, dt_bias, out, step_states, scale,
        bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel), bool(use_beta_sigmoid_in_kernel),
        bool(allow_neg_eigval), lower_bound, bool(state_v_first), bool(check_indices),
    )  # fmt: skip
    return out


@torch.library.custom_op("cula::kda_commit_accepted", mutates_args=("state_pool",))
def _kda_commit_accepted_op(
    step_states: Tensor, state_pool: Tensor, state_indices: Tensor, num_accepted_tokens: Tensor
) -> None:
    """``kda_commit_accepted``."""
    _run("kda_commit_accepted", dict(locals()))


@_kda_commit_accepted_op.register_fake
def _(*_):
    return None


def kda_commit_accepted(step_states, state_pool, state_indices, num_accepted_tokens):
    """``cula.kda.kda_commit_accepted`` under ``torch.compile``: it reads the indices and accepted counts on the
    host, which a graph cannot hold; the op runs it whole."""
    torch.ops.cula.kda_commit_accepted(step_states, state_pool, state_indices, num_accepted_tokens)


# ----------------------------------------------------------------------------------------------------------------
# lightning_decode / lightning_decode_step


@torch.library.custom_op("cula::lightning_decode", mutates_args=("state_pool", "out"))
def _lightning_decode_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    decay: Tensor,
    state_pool: Tensor,
    state_indices: Tensor,
    out: Tensor,
    scale: Optional[float],
    state_v_first: bool,
    check_indices: bool,
) -> None:
    """``lightning_decode``, writing ``o`` into ``out`` and updating the pool in place."""
    _run("lightning_decode", dict(locals()))


@_lightning_decode_op.register_fake
def _(q, k, v, *_):
    _check_tokens(q, k, v)


def lightning_decode(q, k, v, decay, state_pool, state_indices, *, scale=None, state_v_first=True, out=None,
                     check_indices=True):  # fmt: skip
    """``cula.lightning.lightning_decode`` under ``torch.compile``: the ``cula::lightning_decode`` op."""
    q, k, v, decay, state_indices = contiguous_reads(q, k, v, decay, state_indices)
    if out is None:  # the buffer the eager call would allocate
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
    torch.ops.cula.lightning_decode(
        q, k, v, decay, state_pool, state_indices, out, scale, bool(state_v_first), bool(check_indices)
    )
    return out


# ----------------------------------------------------------------------------------------------------------------
# chunk_simple_gla (and through it lightning_attn_fwd / chunk_lightning_attn)

_SIMPLE_GLA_GRADS = ("q", "k", "v", "g", "g_gamma", "initial_state")


# the forward op's schema, and the backward op's after the incoming gradients (see _KDA_PARAMS)
_SIMPLE_GLA_PARAMS = (
    "Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? g_gamma, Tensor? initial_state, Tensor? cu_seqlens, "
    "Tensor? cu_seqlens_cpu, float? scale, bool output_final_state, bool state_v_first, SymInt? chunk_size"
)
_SIMPLE_GLA_NAMES = _param_names(_SIMPLE_GLA_PARAMS)


def _chunk_simple_gla(*args) -> tuple[Tensor, Tensor]:
    """``chunk_simple_gla``: ``(o, final_state or empty)``. Its backends choose alike with and without autograd."""
    call = _simple_gla_call(args)
    o, final = _run("chunk_simple_gla", call)
    q = call["q"]
    inputs = tuple(call[n] for n in _SIMPLE_GLA_GRADS)
    return _fresh(o, *inputs), _empty(q) if final is None else _fresh(final, *inputs)


_chunk_simple_gla_op = torch.library.custom_op(
    "cula::chunk_simple_gla", _chunk_simple_gla, mutates_args=(),
    schema=f"({_SIMPLE_GLA_PARAMS}) -> (Tensor, Tensor)",
)  # fmt: skip


def _simple_gla_call(args: tuple) -> dict:
    """The eager call of the op arguments ``args`` (``_SIMPLE_GLA_PARAMS``'s)."""
    call = dict(zip(_SIMPLE_GLA_NAMES, args))
    if call["chunk_size"] is None:  # a keyword of **kwargs there: absent, not None
        del call["chunk_size"]
    return call


@_chunk_simple_gla_op.register_fake
def _(q, k, v, g, g_gamma, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state, state_v_first, *_):
    _check_tokens(q, k, v, None)
    o = q.new_empty(*v.shape)
    if not output_final_state:
        return o, _empty(q)
    return o, q.new_empty(_final_shape(q, v, cu_seqlens, state_v_first), dtype=torch.float32)


def _chunk_simple_gla_bwd(do, dht, needs, *args) -> tuple[Tensor, ...]:
    """The gradients of ``_SIMPLE_GLA_GRADS`` flagged in ``needs`` (empty where not)."""
    (q, k, v, g, g_gamma, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state, state_v_first,
     chunk_size) = args  # fmt: skip
    call = _simple_gla_call(args)
    from cula._validate import check_scale
    from cula.simple_gla import backends

    inputs = [call[n] for n in _SIMPLE_GLA_GRADS]
    args = dict(call, scale=check_scale(scale, q.shape[-1]), chunk_size=chunk_size)
    if backends.chunk_simple_gla_registry.select(q.device, args).name == "cula-sm90":
        # _LightningTraining's backward, on the zeros autograd materialises for an unused output
        if dht is None and output_final_state:
            dht = torch.zeros(_final_shape(q, v, cu_seqlens, state_v_first), dtype=torch.float32, device=q.device)
        with _eager_path:
            dq, dk, dv, dh0 = backends.lightning_backward(
                q, k, v, g_gamma, initial_state, cu_seqlens, cu_seqlens_cpu, args["scale"], state_v_first, do, dht
            )
        grads = (dq, dk, dv, None, None, dh0)
    else:
        grads = _recompute_grads("chunk_simple_gla", call, _SIMPLE_GLA_GRADS, needs, (do, dht))
    return _grads_out(grads, inputs, needs, q, do, dht, *inputs)


_chunk_simple_gla_bwd_op = torch.library.custom_op(
    "cula::chunk_simple_gla_bwd", _chunk_simple_gla_bwd, mutates_args=(),
    schema=f"(Tensor do, Tensor? dht, bool[] needs, {_SIMPLE_GLA_PARAMS}) -> "
    f"({', '.join(['Tensor'] * len(_SIMPLE_GLA_GRADS))})",
)  # fmt: skip


@_chunk_simple_gla_bwd_op.register_fake
def _(do, dht, needs, q, k, v, g, g_gamma, initial_state, *_):
    return _fake_grads((q, k, v, g, g_gamma, initial_state), needs, q)


def _chunk_simple_gla_setup(ctx, inputs, output):
    q, k, v, g, g_gamma, initial_state, cu_seqlens, cu_seqlens_cpu, *scalars = inputs
    ctx.set_materialize_grads(False)
    if not scalars[1]:  # output_final_state
        ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(q, k, v, g, g_gamma, initial_state, cu_seqlens, cu_seqlens_cpu)
    ctx.scalars = scalars


def _chunk_simple_gla_backward(ctx, do, dht):
    tensors = ctx.saved_tensors
    q, v = tensors[0], tensors[2]
    if do is None:
        do = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    needs = list(ctx.needs_input_grad[: len(_SIMPLE_GLA_GRADS)])
    grads = torch.ops.cula.chunk_simple_gla_bwd(do, dht, needs, *tensors, *ctx.scalars)
    grads = [gr if need else None for gr, need in zip(grads, needs)]
    return (*grads, *(None,) * (len(ctx.needs_input_grad) - len(grads)))


_chunk_simple_gla_op.register_autograd(_chunk_simple_gla_backward, setup_context=_chunk_simple_gla_setup)

_SIMPLE_GLA_EXTRA = frozenset(("chunk_size", "transpose_state_layout"))


def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                     state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):  # fmt: skip
    """``cula.simple_gla.chunk_simple_gla`` under ``torch.compile``: the ``cula::chunk_simple_gla`` op."""
    if not _alias_ok(state_v_first, kwargs, _SIMPLE_GLA_EXTRA):
        return _eager(
            "chunk_simple_gla", q, k, v, g, g_gamma, scale, initial_state, output_final_state, state_v_first,
            cu_seqlens, cu_seqlens_cpu, **kwargs,
        )  # fmt: skip
    q, k, v, g, g_gamma, initial_state, cu_seqlens = contiguous_reads(q, k, v, g, g_gamma, initial_state, cu_seqlens)
    o, final = torch.ops.cula.chunk_simple_gla(
        q, k, v, g, g_gamma, initial_state, cu_seqlens, cu_seqlens_cpu, scale, bool(output_final_state),
        _layout(state_v_first, kwargs), kwargs.get("chunk_size"),
    )  # fmt: skip
    return o, final if output_final_state else None


# ----------------------------------------------------------------------------------------------------------------
# The entry points FLA's kernels (or the reference) run alone: one op each and its backward, which differentiates the
# eager call again. chunk_gated_delta_rule, fused_recurrent_kda's functional form and fused_recurrent_gated_delta_rule
# (where FLA's backward raises, the backward op raises it too, as eager's backward does), fused_recurrent_simple_gla
# (and through it fused_recurrent_lightning_attn).


def _recomputed_op(name: str, params: str, grads: tuple, recurrent: bool = False, o_like: str = "q",
                   head_limit: int | None = 256):  # fmt: skip
    """Define ``cula::<name>``, the eager public function ``name`` returning ``(o [B, T, HV, V] in the dtype of
    ``o_like`` (q or v), final_state [N, HV, K, V] fp32 or empty)``, with ``params`` its flat schema's arguments
    (which include ``q``, ``v``, ``output_final_state``, ``state_v_first`` and ``cu_seqlens``), and
    ``cula::<name>_bwd``, the gradients of ``grads`` (a subset of the tensor arguments), joined as its autograd.
    ``recurrent``: q, k, v of any float dtypes (FLA's recurrent forms); ``head_limit``: the eager one."""
    names = _param_names(params)
    tensor_at = [i for i, p in enumerate(params.split(", ")) if p.startswith("Tensor")]
    grad_at = [names.index(n) for n in grads]

    def impl(*args):
        call = dict(zip(names, args))
        o, final = _run(name, call)
        inputs = [args[i] for i in tensor_at]
        return _fresh(o, *inputs), _empty(call["q"]) if final is None else _fresh(final, *inputs)

    def fake(*args):
        call = dict(zip(names, args))
        q, v = call["q"], call["v"]
        _check_tokens(q, call["k"], v, head_limit, recurrent)
        o = q.new_empty(v.shape, dtype=call[o_like].dtype)
        if not call["output_final_state"]:
            return o, _empty(q)
        final = q.new_empty(_final_shape(q, v, call["cu_seqlens"], call["state_v_first"]), dtype=torch.float32)
        return o, final

    def bwd_impl(do, dht, needs, *args):
        call = dict(zip(names, args))
        found = _recompute_grads(name, call, grads, needs, (do, dht))
        inputs = [args[i] for i in grad_at]
        return _grads_out(found, inputs, needs, call["q"], do, dht, *inputs)

    def bwd_fake(do, dht, needs, *args):
        return _fake_grads([args[i] for i in grad_at], needs, args[names.index("q")])

    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)
        if not inputs[names.index("output_final_state")]:
            ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(*(inputs[i] for i in tensor_at))
        ctx.inputs = list(inputs)  # the scalars; the tensors come back from saved_tensors

    def backward(ctx, do, dht):
        inputs = ctx.inputs
        for i, t in zip(tensor_at, ctx.saved_tensors):
            inputs[i] = t
        q, v = inputs[names.index("q")], inputs[names.index("v")]
        if do is None:
            do = torch.zeros(v.shape, dtype=inputs[names.index(o_like)].dtype, device=q.device)
        needs = [ctx.needs_input_grad[i] for i in grad_at]
        if "use_gate_in_kernel" in names:
            needs = _gate_needs(needs, grads, inputs[names.index("use_gate_in_kernel")])
        found = getattr(torch.ops.cula, f"{name}_bwd")(do, dht, needs, *inputs)
        out = [None] * len(inputs)
        for i, gr, need in zip(grad_at, found, needs):
            out[i] = gr if need else None
        return tuple(out)

    op = torch.library.custom_op(f"cula::{name}", impl, mutates_args=(), schema=f"({params}) -> (Tensor, Tensor)")
    op.register_fake(fake)
    bwd_schema = f"(Tensor do, Tensor? dht, bool[] needs, {params}) -> ({', '.join(['Tensor'] * len(grads))})"
    torch.library.custom_op(f"cula::{name}_bwd", bwd_impl, mutates_args=(), schema=bwd_schema).register_fake(bwd_fake)
    op.register_autograd(backward, setup_context=setup_context)
    return op


_chunk_gdn_op = _recomputed_op(
    "chunk_gated_delta_rule",
    "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, Tensor? initial_state, "
    "Tensor? cu_seqlens, Tensor? cu_seqlens_cpu, Tensor? chunk_indices, float? scale, bool output_final_state, "
    "bool use_qk_l2norm_in_kernel, bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval, bool state_v_first, "
    "bool use_gate_in_kernel, SymInt chunk_size",
    ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"),
)
_fused_recurrent_gdn_op = _recomputed_op(
    "fused_recurrent_gated_delta_rule",
    "Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? gk, Tensor? gv, Tensor? beta, Tensor? A_log, Tensor? dt_bias, "
    "Tensor? initial_state, Tensor? cu_seqlens, float? scale, bool output_final_state, bool use_qk_l2norm_in_kernel, "
    "bool use_gate_in_kernel, bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval, bool state_v_first",
    ("q", "k", "v", "g", "gk", "gv", "beta", "A_log", "dt_bias", "initial_state"),
    recurrent=True, o_like="v", head_limit=None,
)
_fused_recurrent_kda_op = _recomputed_op(
    "fused_recurrent_kda",
    "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, Tensor? initial_state, "
    "Tensor? cu_seqlens, float? scale, bool output_final_state, bool state_v_first, bool use_qk_l2norm_in_kernel, "
    "bool use_gate_in_kernel, bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval, float? lower_bound",
    ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"),
    recurrent=True, o_like="v", head_limit=None,
)
_fused_recurrent_simple_gla_op = _recomputed_op(
    "fused_recurrent_simple_gla",
    "Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? g_gamma, Tensor? initial_state, Tensor? cu_seqlens, "
    "float? scale, bool output_final_state, bool reverse, bool state_v_first",
    ("q", "k", "v", "g", "g_gamma", "initial_state"),
    recurrent=True, head_limit=None,
)



_GDN_EXTRA = frozenset(("use_gate_in_kernel", "A_log", "dt_bias", "chunk_size", "transpose_state_layout"))


def chunk_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
    cu_seqlens_cpu=None, chunk_indices=None, cp_context=None, **kwargs,
):  # fmt: skip
    """``cula.gated_delta_rule.chunk_gated_delta_rule`` under ``torch.compile``: the ``cula::chunk_gated_delta_rule``
    op."""
    if cp_context is not None or g is None or beta is None or not _alias_ok(state_v_first, kwargs, _GDN_EXTRA):
        return _eager(
            "chunk_gated_delta_rule", q, k, v, g, beta, scale, initial_state, output_final_state,
            use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens,
            cu_seqlens_cpu, chunk_indices, cp_context, **kwargs,
        )  # fmt: skip
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_indices = contiguous_reads(
        q, k, v, g, beta, kwargs.get("A_log"), kwargs.get("dt_bias"), initial_state, cu_seqlens, chunk_indices
    )
    o, final = torch.ops.cula.chunk_gated_delta_rule(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
        chunk_indices, scale, bool(output_final_state), bool(use_qk_l2norm_in_kernel),
        bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval), _layout(state_v_first, kwargs),
        bool(kwargs.get("use_gate_in_kernel", False)), kwargs.get("chunk_size", 64),
    )  # fmt: skip
    return o, final if output_final_state else None


def fused_recurrent_gated_delta_rule(
    q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, **kwargs,
):  # fmt: skip
    """``cula.gated_delta_rule.fused_recurrent_gated_delta_rule`` under ``torch.compile``: the
    ``cula::fused_recurrent_gated_delta_rule`` op."""
    if not _alias_ok(state_v_first, kwargs, _LAYOUT_ONLY):
        return _eager(
            "fused_recurrent_gated_delta_rule", q, k, v, g, gk, gv, beta, scale, initial_state, output_final_state,
            use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval,
            state_v_first, cu_seqlens, **kwargs,
        )  # fmt: skip
    q, k, v, g, gk, gv, beta, A_log, dt_bias, initial_state, cu_seqlens = contiguous_reads(
        q, k, v, g, gk, gv, beta, A_log, dt_bias, initial_state, cu_seqlens
    )
    o, final = torch.ops.cula.fused_recurrent_gated_delta_rule(
        q, k, v, g, gk, gv, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, bool(output_final_state),
        bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel), bool(use_beta_sigmoid_in_kernel),
        bool(allow_neg_eigval), _layout(state_v_first, kwargs),
    )  # fmt: skip
    return o, final if output_final_state else None


def fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                               reverse=False, state_v_first=False, cu_seqlens=None, **kwargs):  # fmt: skip
    """``cula.simple_gla.fused_recurrent_simple_gla`` under ``torch.compile``: the ``cula::fused_recurrent_simple_gla``
    op."""
    if not _alias_ok(state_v_first, kwargs, _LAYOUT_ONLY):
        return _eager(
            "fused_recurrent_simple_gla", q, k, v, g, g_gamma, scale, initial_state, output_final_state, reverse,
            state_v_first, cu_seqlens, **kwargs,
        )  # fmt: skip
    q, k, v, g, g_gamma, initial_state, cu_seqlens = contiguous_reads(q, k, v, g, g_gamma, initial_state, cu_seqlens)
    o, final = torch.ops.cula.fused_recurrent_simple_gla(
        q, k, v, g, g_gamma, initial_state, cu_seqlens, scale, bool(output_final_state), bool(reverse),
        _layout(state_v_first, kwargs),
    )  # fmt: skip
    return o, final if output_final_state else None
