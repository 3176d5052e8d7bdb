"""Backends of the KDA entry points, tried in priority order (see ``cula.backends``).

- ``cula-sm90``: ``chunk_kda``: our CuTe DSL kernels on Hopper (see ``cula.kda.forward``), bf16 and
  fp16, K = V = 128, chunk 64; with autograd on, our forward and FLA 0.6.0's backward (``_ChunkKDATraining``);
  ``fused_recurrent_kda``: FLA's in-place state-pool decode form with one token per sequence, on the
  ``kda_decode`` kernel.
- ``fla``: FLA 0.6.0's Triton kernels, for everything our kernels do not cover yet on CUDA.
- ``reference``: float32 PyTorch (``cula.kda.naive``); the CPU path, differentiable.
"""

from __future__ import annotations

import contextlib
import math

import torch

from cula._validate import is_row_major
from cula.backends import (
    BackendUnavailableError, Registry, always, capturing, cula_kernels_on, logger, needs_grad, package_on_cuda,
)  # fmt: skip
from cula.cache import VariantUnavailableError
from cula.ops._host import sequences_verdict

chunk_kda_registry = Registry("kda.chunk_kda")
fused_recurrent_kda_registry = Registry("kda.fused_recurrent_kda")

CULA_PRIORITY = 10
FLA_PRIORITY = 50
REFERENCE_PRIORITY = 90


# the gate and beta dtypes the CuTe kernels are compiled for (validation also lets float64 through, as FLA does)
_KERNEL_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


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
    return_intermediate_states=False,
    cu_seqlens=None,
    state_v_first=False,
    use_graph=False,
    safe_gate=False,
    use_gate_in_kernel=False,
    lower_bound=None,
    **_,
) -> tuple:
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False, f"q dtype {q.dtype} (kernels take bf16 / fp16)"
    if g.dtype not in _KERNEL_FLOATS or beta.dtype not in _KERNEL_FLOATS:
        return False, f"g dtype {g.dtype} / beta dtype {beta.dtype} (kernels take bf16/fp16/fp32)"
    if q.shape[-1] != 128 or v.shape[-1] != 128:
        return False, f"head sizes K={q.shape[-1]} V={v.shape[-1]} (kernel takes K=V=128)"
    if chunk_size != 64:
        return False, f"chunk_size={chunk_size} (kernel takes 64)"
    if cp_context is not None:
        return False, "cp_context runs on fla"
    if return_intermediate_states:
        from cula.kda.plan import KDA_TUNING, use_cula_intra

        if not KDA_TUNING.for_device(q.device).intermediate_states:
            return False, "return_intermediate_states runs on fla (KdaTuning.intermediate_states off)"
        if use_graph or capturing(q):  # (a chunk list built on the device holds a bound of the rows, not the rows)
            return False, "return_intermediate_states in FLA's graph mode or a capture runs on fla"
        if not use_cula_intra(q, v, safe_gate, use_gate_in_kernel, lower_bound):
            return False, "return_intermediate_states with FLA's intra stage (unbounded gates) runs on fla"
    fits, why = sequences_verdict(q.shape[0], cu_seqlens)
    if not fits:
        return False, why
    if use_graph and cu_seqlens is not None:
        from cula.kda.plan import use_cula_intra

        if not use_cula_intra(q, v, safe_gate, use_gate_in_kernel, lower_bound):
            # graph mode lets the sequences end before the last token; FLA's intra stage leaves those rows of kg
            # unwritten, which our state kernel would then read
            return False, "use_graph with FLA's intra stage (gates not bounded below by -5) runs on fla"
    return True, None


def _cula_chunk_args(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
    use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_v_first, cu_seqlens, A_log, dt_bias,
    chunk_size, use_graph=False, **_unused,
):  # fmt: skip
    """The dispatch arguments as ``chunk_kda_fwd_sm90`` and its ``prepare_`` twin take them (``use_graph`` only where
    packed sequences make it matter)."""
    return {
        "q": q, "k": k, "v": v, "g": g, "beta": beta, "scale": scale, "initial_state": initial_state,
        "output_final_state": output_final_state, "state_v_first": state_v_first, "cu_seqlens": cu_seqlens,
        "chunk_size": chunk_size, "use_gate_in_kernel": use_gate_in_kernel, "A_log": A_log, "dt_bias": dt_bias,
        "lower_bound": lower_bound if use_gate_in_kernel else None, "safe_gate": safe_gate,
        "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel, "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel,
        "allow_neg_eigval": allow_neg_eigval,
        **({"use_graph": True} if use_graph and cu_seqlens is not None else {}),
    }  # fmt: skip


_GRAD_TENSORS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


# The chunk kernels' compiled signatures take contiguous inputs aligned to 16 bytes, beta to its element and A_log
# to 4 bytes (TVM-FFI refuses the rest at the launch).
_KERNEL_ALIGN = {"beta": 1, "A_log": 4}


def _kernel_ready(name: str, t: torch.Tensor | None) -> bool:
    # row-major strictly: the kernels step tokens by dim 1's stride, which is_contiguous() ignores with one token
    return t is None or (is_row_major(t) and t.data_ptr() % _KERNEL_ALIGN.get(name, 16) == 0)


def _ready_inputs(args: dict) -> dict:
    """``args`` with a contiguous, aligned copy of each input tensor that is not (a strided view, an odd storage
    offset)."""
    return {
        n: (t.clone(memory_format=torch.contiguous_format) if n in _GRAD_TENSORS and not _kernel_ready(n, t) else t)
        for n, t in args.items()
    }


def _prepare_chunk_kda_cula_sm90(**args):
    """The bound launch of a repeated call (see ``prepare_chunk_kda_fwd_sm90``), or None (training calls: autograd
    runs through ``_ChunkKDATraining``)."""
    from cula.kda.forward import prepare_chunk_kda_fwd_sm90

    if needs_grad(*(args[n] for n in _GRAD_TENSORS)) or args.get("use_graph"):
        return None  # graph mode is validated and built each call (it is captured once)
    if args.get("return_intermediate_states"):
        return None  # (chunk_kda validates such calls every time)
    if not all(_kernel_ready(n, args[n]) for n in _GRAD_TENSORS):
        return None  # the general path, which copies them (_ready_inputs) on every call
    return prepare_chunk_kda_fwd_sm90(**_cula_chunk_args(**args))


class _ChunkKDATraining(torch.autograd.Function):
    """Our forward kernels, FLA 0.6.0's backward (``fla.ops.kda.chunk.ChunkKDAFunction.backward``; its stage 6 at
    the launch configuration of ``cula.kda.fla_backward``).

    FLA's forward saves the l2-normalised q and k with their rstd, beta after the sigmoid, the gate cumsum (when the
    gate is not fused) and the intra stage's Aqk and Akk. Ours keeps the inputs and the Aqk and Akk our forward
    made (``keep_scores``: cula's intra kernel writes Akk, ``(I + A)^-1`` in bf16, beside what the recurrence
    reads; FLA's intra stage where ours does not run), and the backward recomputes the cheap rest with FLA's own
    elementwise stages (the q/k L2 norm, the beta sigmoid, the gate cumsum) before FLA's ``chunk_kda_bwd``. So the
    gradients are FLA's backward on our forward's scores: FLA's bits where FLA's intra stage ran, within the intra
    kernel's tolerance of them where ours did. Recomputing the scores instead (FLA's intra stage in the backward)
    left the step 1-2% slower than FLA's on the H200."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, opts):
        keep = opts.get("disable_recompute", False)
        o, final_state, Aqk, Akk, *prefix = _training_forward(
            q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, opts, keep_prefix=keep
        )
        prefix = prefix[0] if prefix else None
        saved = (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, Aqk, Akk)
        ctx.save_for_backward(*saved, *(prefix[n] for n in PREFIX) if prefix else ())
        ctx.opts = opts
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        saved = ctx.saved_tensors
        prefix = dict(zip(PREFIX, saved[12:])) if len(saved) > 12 else None
        return (*_training_backward(saved[:12], ctx.opts, do, dht, prefix), None, None, None)


# what FLA's backward recomputes before its first gradient stage, kept by the forward under disable_recompute=True
PREFIX = ("g", "w", "u", "qg", "kg", "h", "v_new")


def _training_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, opts,
                      keep_prefix=False):  # fmt: skip
    """``_ChunkKDATraining``'s forward: ``(o, final_state, Aqk, Akk)``, and with ``keep_prefix`` (FLA's
    ``disable_recompute=True``) a fifth item: the tensors of ``PREFIX`` for FLA's backward (the intra kernel's and
    the states kernel's ``DeltaHFwdOStatesSm90``), or None (logged once) where cula's intra kernel does not run and
    the backward recomputes them."""
    from cula.kda.forward import chunk_kda_fwd_sm90

    opts = {n: x for n, x in opts.items() if n != "disable_recompute"}
    out = chunk_kda_fwd_sm90(
        q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, keep_scores=True, keep_prefix=keep_prefix, **opts,
    )  # fmt: skip
    if not keep_prefix:
        return out
    if out[-1] is None and q.shape[1] > 0:  # (no tokens: nothing to keep)
        _say_recompute("FLA's intra stage ran (gates cula's intra kernel does not take)")
    return out


def _training_backward(saved, p, do, dht, kept=None):
    """``_ChunkKDATraining``'s backward from what its forward saved: the gradients of q, k, v, g, beta, A_log, dt_bias
    and the initial state (None where FLA gives none). ``kept``: the forward's ``PREFIX`` tensors
    (``disable_recompute=True``), which FLA's backward then takes instead of recomputing them."""
    import fla.ops.kda.chunk as fc
    import fla.ops.kda.chunk_fwd as ff

    from cula.kda import fla_backward

    q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, Aqk, Akk = saved
    if cu is not None:
        # FLA's helpers memoise on a tensor's identity (fla.utils.tensor_cache: its stages fill in chunk offsets
        # from cu_seqlens that way): a fresh alias each backward, so a boundaries buffer rewritten in place between
        # steps never meets the previous boundaries' offsets
        cu = cu.view(-1)
    fused_gate = p["use_gate_in_kernel"]
    # what FLA's chunk_kda hands ChunkKDAFunction: contiguous tensors, the gate parameters only with the fused gate
    q, k, v, g_raw, beta_raw = (t.contiguous() for t in (q, k, v, g, beta))
    q_raw, k_raw = q, k
    if not fused_gate:
        A_log = dt_bias = None
    per_head_gate, g_in, bias_in = g.dim() == 3, g, dt_bias
    sig_scale = 2.0 if p["allow_neg_eigval"] else 1.0

    def gradients():
        # Gated DeltaNet's gate (one a token and head): where the recompute runs on cula's intra kernel it takes the
        # gate per head (its g_cum rows per channel are what FLA's stages read) and the gate's backward runs per
        # head after them (per_head_gate_backward); elsewhere FLA's stages take it repeated over K (fp32: dg is
        # summed back below)
        recompute = kept is None and fla_backward.recompute_on_cula(q, v, p)  # FLA's prefix on cula's intra kernel
        head = per_head_gate and recompute and not (fused_gate and p["lower_bound"] is not None)
        g_chan, bias_chan = g_raw, dt_bias
        if per_head_gate and not head:
            from cula.kda.plan import gate_over_k

            g_chan, bias_chan = gate_over_k(g_raw.float(), dt_bias, q.shape[-1])
        fla_gate = fused_gate and not head  # FLA's stages take the fused gate (its cumsum and its backward)
        qn, kn, beta_in, q_rstd, k_rstd = q, k, beta, None, None
        # stages 6 and 7 normalise the raw q / k with the recompute's 1 / norms, or FLA's l2norm_fwd does it first
        # (decided on the gate as FLA's stages will see it)
        raw_qk = kept is None and fla_backward.norm_on_load(q, v, do, dict(p, use_gate_in_kernel=fla_gate))
        if p["use_qk_l2norm_in_kernel"] and not raw_qk:
            qn, q_rstd = fc.l2norm_fwd(q)
            kn, k_rstd = fc.l2norm_fwd(k)
        if p["use_beta_sigmoid_in_kernel"]:
            beta_in = fc.fused_beta_sigmoid(x=beta_raw, scale=sig_scale)
        graph = bool(p.get("use_graph"))
        chunk_indices, chunk_offsets = _backward_chunks(cu, cu_cpu, q.shape[1], graph)
        g_cum, prefix = None, {}
        if kept is not None:
            prefix = dict(kept)
            g_cum = prefix.pop("g")
        elif recompute:
            prefix = fla_backward.recompute_prefix(
                q_raw, k_raw, v, g_chan, beta_raw, A_log, bias_chan, h0, cu, chunk_indices, chunk_offsets, p,
                Akk=Akk, qk_rstd=raw_qk,
            )  # fmt: skip
            g_cum = prefix.pop("g")
            if raw_qk:
                q_rstd, k_rstd = prefix.pop("qk_rstd").unbind(0)
        elif not fused_gate:  # with the fused gate FLA's backward makes the cumsum from the raw gate itself
            g_cum = ff.chunk_local_cumsum(
                g=g_chan, scale=ff.RCP_LN2, chunk_size=64, cu_seqlens=cu, chunk_indices=chunk_indices,
                use_graph=graph,
            )  # fmt: skip
        # FLA's chunk_kda_bwd with its heaviest stage at a faster launch configuration (fla_backward)
        # with q_rstd / k_rstd, dq and dk come back through the L2 norm's backward (on chip where the tuning says so)
        dq, dk, dv, db, dg, dh0, dA, dbias = fla_backward.chunk_kda_bwd(
            qk_rstd=None if q_rstd is None else (q_rstd, k_rstd), raw_qk=raw_qk,
            q=qn, k=kn, v=v, beta=beta_in, Aqk=Aqk, Akk=Akk, scale=p["scale"], initial_state=h0,
            do=do.contiguous(), dht=None if dht is None else dht.contiguous(),
            # FLA's forward keeps the gate cumsum only when the gate is not fused; the backward redoes it
            g=g_cum, g_org=g_chan if fla_gate else None,
            state_v_first=p["state_v_first"], cu_seqlens=cu, chunk_indices=chunk_indices, chunk_size=64,
            safe_gate=p["safe_gate"], lower_bound=p["lower_bound"], use_gate_in_kernel=fla_gate,
            A_log=A_log if fla_gate else None, dt_bias=bias_chan if fla_gate else None,
            disable_recompute=bool(prefix), cp_context=None,
            **(prefix or dict(w=None, u=None, qg=None, kg=None, v_new=None, h=None)),
            use_graph=graph, chunk_offsets=chunk_offsets,
        )  # fmt: skip
        if p["use_beta_sigmoid_in_kernel"]:
            db = fc.fused_beta_sigmoid_bwd(x=beta_raw, dy=db, scale=sig_scale)
        if head:
            dg, dA, dbias = per_head_gate_backward(dg, g_raw, A_log, dt_bias, fused_gate)
        elif per_head_gate:  # the repeated gate's (and bias's) gradients summed over the K channels
            dg = dg.float().sum(-1)
            dbias = None if dbias is None else dbias.float().view(-1, q.shape[-1]).sum(-1).to(bias_in)
        return dq, dk, dv, db, dg, dh0, dA, dbias

    # FLA's Triton launches go to the current device (FLA's input_guard sets it the same way)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        try:
            dq, dk, dv, db, dg, dh0, dA, dbias = gradients()
        except VariantUnavailableError as err:
            # a stage of cula's met a kernel variant with no binary (a wheel without the DSL): every output of
            # this backward is a new tensor, so it runs again on FLA's stages alone (kept prefix tensors included)
            _say_fla_stages(str(err))
            with fla_backward.fla_stages_only():
                dq, dk, dv, db, dg, dh0, dA, dbias = gradients()
    return dq.to(q), dk.to(k), dv.to(v), dg.to(g_in), db.to(beta_raw), dA, dbias, dh0


def per_head_gate_backward(dg: torch.Tensor, g: torch.Tensor, A_log: torch.Tensor | None,
                           dt_bias: torch.Tensor | None, fused: bool) -> tuple:  # fmt: skip
    """Gated DeltaNet's gate gradients from the per-channel ones FLA's stages return for a log-space gate that is
    the same in every channel (``dg`` ``[..., HV, K]``, no fused gate in them): ``(dg, dA_log, ddt_bias)`` for the
    per-head ``g`` ``[..., HV]``. The channels' sum, then with the fused gate ``a = -exp(A_log) softplus(g + dt_bias)``
    (FLA's: softplus the identity above 20, ``exp(A_log)`` e where A_log is absent) its backward, in fp32; dA_log and
    ddt_bias are the sums over the tokens, None where the parameter is."""
    da = dg.float().sum(-1)
    if not fused:
        return da, None, None
    x = g.float() if dt_bias is None else g.float() + dt_bias.float().view(-1)
    coef = torch.exp(A_log.float().view(-1)) if A_log is not None else math.e
    # softplus'(x) = sigmoid(x), and 1 past the threshold where FLA's softplus is x itself
    slope = torch.where(x > 20.0, torch.ones_like(x), torch.sigmoid(x))
    dx = -da * coef * slope
    tokens = tuple(range(dx.dim() - 1))
    dA = None
    if A_log is not None:
        a = -coef * torch.where(x > 20.0, x, torch.nn.functional.softplus(x))
        dA = (da * a).sum(tokens).view_as(A_log).to(A_log.dtype)
    dbias = None if dt_bias is None else dx.sum(tokens).view_as(dt_bias).to(dt_bias.dtype)
    return dx, dA, dbias


def _backward_chunks(cu, cu_cpu, T: int, graph: bool):
    """``(chunk_indices, chunk_offsets)`` for FLA's backward stages of a packed call (both None for fixed lengths).

    In FLA's graph mode (``use_graph``) FLA's own fixed-size list, built on the device, whose rows past the real
    chunks are sentinels its graph-mode kernels skip. Otherwise the exact list from the host copy of the boundaries
    (cula's, not FLA's ``prepare_chunk_indices``, which memoises on the tensor's identity and would hand a rewritten
    ``cu_seqlens`` buffer the previous boundaries' chunks); while a CUDA graph captures, that host list would be
    copied at capture and replayed from a stale host buffer, so capture without graph mode is refused."""
    if cu is None:
        return None, None
    if graph:
        from fla.ops.utils.index import prepare_chunk_indices_static

        return prepare_chunk_indices_static(cu_seqlens=cu, chunk_size=64, nt_max=-(-T // 64) + cu.shape[0] - 2)
    if capturing(cu):
        raise RuntimeError(
            "capturing the backward of a packed chunk_kda call in a CUDA graph needs use_graph=True (FLA's graph "
            "mode: a chunk list of fixed size built on the device)"
        )
    from cula.kda.forward import host_chunk_indices

    return host_chunk_indices(cu, cu_cpu), None


_said_recompute: list[bool] = []  # disable_recompute's note, logged once a process
_said_fla_stages: list[bool] = []  # the backward's fallback to FLA's stages, logged once a process


def _say_fla_stages(why: str) -> None:
    if not _said_fla_stages:
        _said_fla_stages.append(True)
        logger.warning("chunk_kda: the training backward runs on FLA's stages alone (cula's kernels declined): %s",
                       why)  # fmt: skip


def _say_recompute(why: str) -> None:
    if not _said_recompute:
        _said_recompute.append(True)
        logger.info("chunk_kda: disable_recompute=True on cula-sm90, but the backward recomputes its intermediates "
                    "(the same gradients, FLA's default activation memory): %s", why)  # fmt: skip


# The intra-chunk stage still comes from FLA's Triton kernels, hence needs=("fla",).
@chunk_kda_registry.register(
    "cula-sm90",
    CULA_PRIORITY,
    available=cula_kernels_on((9, 0), needs=("fla",)),
    supports=_cula_chunk_supports,
    prepare=_prepare_chunk_kda_cula_sm90,
)
def chunk_kda_cula_sm90(cu_seqlens_cpu=None, **args):
    """The cula-sm90 backend of ``chunk_kda`` on validated dispatch arguments: inference on ``chunk_kda_fwd_sm90``,
    training through ``_ChunkKDATraining``. Gated DeltaNet's training path runs it directly (its per-head gate is
    one the intra kernel takes)."""
    from cula.kda.forward import chunk_kda_fwd_sm90

    # q/k L2 norm and the beta sigmoid happen inside (fused into cula's intra kernel where it runs, see
    # cula.kda.forward)
    opts = _cula_chunk_args(**_ready_inputs(args))
    if needs_grad(*(args[n] for n in _GRAD_TENSORS)):
        tensors = [opts.pop(n) for n in (*_GRAD_TENSORS, "cu_seqlens")]
        if args.get("disable_recompute"):
            opts["disable_recompute"] = True
        return _ChunkKDATraining.apply(*tensors, cu_seqlens_cpu, opts)
    if args.get("return_intermediate_states"):  # (validation: inference mode, no disable_recompute)
        return chunk_kda_fwd_sm90(cu_seqlens_cpu=cu_seqlens_cpu, keep_states=True, **opts)
    return chunk_kda_fwd_sm90(cu_seqlens_cpu=cu_seqlens_cpu, **opts)


# torch.compile's chunk_kda op (cula._custom_ops) records the autograd itself: it runs _ChunkKDATraining's two halves
# apart, handing Aqk and Akk from its forward to its backward as outputs, whose shapes it must know from the
# arguments' metadata alone.


def chunk_training_keeps_scores(args: dict) -> bool:
    """Whether a training call with these dispatch arguments runs ``_ChunkKDATraining`` (our forward, keeping Aqk and
    Akk ``[B, T, HV, 64]`` in q's dtype for FLA's backward). Reads metadata only: valid on fake tensors."""
    q = args["q"]
    if q.device.type != "cuda":
        return False
    try:
        return chunk_kda_registry.select(q.device, args).name == "cula-sm90"
    except BackendUnavailableError:
        return False  # the op's eager call raises it


def _training_call(args: dict) -> tuple[list, dict]:
    """``_ChunkKDATraining``'s tensor arguments and options for a training call's dispatch arguments."""
    opts = _cula_chunk_args(**_ready_inputs(args))
    return [opts.pop(n) for n in (*_GRAD_TENSORS, "cu_seqlens")], opts


def chunk_kda_training_forward(args: dict) -> tuple:
    """``(o, final_state, Aqk, Akk)`` of a validated training call on cula's kernels, nothing recorded."""
    if args.get("disable_recompute"):
        _say_recompute("torch.compile's chunk_kda op hands its backward only the scores")
    tensors, opts = _training_call(args)
    return _training_forward(*tensors, args["cu_seqlens_cpu"], opts)


def chunk_kda_training_backward(args: dict, Aqk, Akk, do, dht) -> tuple:
    """The gradients of ``_GRAD_TENSORS`` (q, k, v, g, beta, A_log, dt_bias, initial_state; None where FLA gives
    none) of the training call ``chunk_kda_training_forward(args)`` made Aqk and Akk for."""
    tensors, opts = _training_call(args)
    return _training_backward((*tensors, args["cu_seqlens_cpu"], Aqk, Akk), opts, do, dht)


def _reference_chunk_supports(q=None, cp_context=None, use_graph=False, return_intermediate_states=False, **_
                               ) -> tuple:  # fmt: skip
    # (use_graph on the CPU: it changes how FLA builds its chunk list for a captured call, not the result, and its
    # arguments were validated with FLA's rules; on a GPU the reference reads the boundaries on the host, which a
    # captured call cannot)
    if use_graph and isinstance(q, torch.Tensor) and q.device.type != "cpu":
        return False, "use_graph on a GPU runs on the cula-sm90 and fla backends (the reference reads cu_seqlens)"
    if cp_context is not None:
        return False, "cp_context (context parallel) is only run by the fla backend"
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
    """The reference on dispatch arguments: in fp32, as FLA's kernels compute (the recurrent form's float64 inputs
    too), o in q's dtype (the chunk form) or v's (the recurrent form, whose q, k, v may differ: FLA's allocates o
    like v)."""
    from cula.kda.naive import reference_chunk_kda

    return reference_chunk_kda(
        args["q"], args["k"], args["v"], args["g"], args["beta"], form=form, compute_dtype=torch.float32,
        output_final_state=output_final_state,
        # FLA applies lower_bound only through the fused gate
        lower_bound=args["lower_bound"] if args["use_gate_in_kernel"] else None,
        **{name: args[name] for name in _REFERENCE_ARGS},
    )  # fmt: skip


@chunk_kda_registry.register(
    "reference", REFERENCE_PRIORITY, available=always, supports=_reference_chunk_supports
)
def _chunk_kda_reference(**args):
    cu = args["cu_seqlens"]
    T = args["q"].shape[1]
    end = T if cu is None or not args["use_graph"] else int(cu[-1])
    if end == T:
        return _reference("chunk", args, args["output_final_state"])
    # FLA's graph mode: the sequences may end before the last token (static buffers filled in part); the rows past
    # them read nothing and are written as zeros
    part = {**args, **{n: args[n][:, :end] for n in ("q", "k", "v", "g", "beta")}}
    o, final = _reference("chunk", part, args["output_final_state"])
    return torch.cat([o, o.new_zeros(o.shape[0], T - end, *o.shape[2:])], dim=1), final


def serving_form_verdict(q, cu_seqlens, ssm_state_indices, inplace_final_state, num_accepted_tokens) -> tuple:
    """The part of ``_cula_recurrent_supports`` that needs no validation first (so FLA's dispatch can decline a
    packed call without reading its boundaries): the in-place pool form, one token a sequence, unpacked."""
    if ssm_state_indices is None or not inplace_final_state:
        return False, "only the in-place state-pool form (ssm_state_indices, inplace_final_state=True) runs on cula"
    if cu_seqlens is not None:
        # [1, N] packed with one token per sequence: exact only if no sequence is empty, which the device knows
        return False, "cu_seqlens (the packed [1, N] form) runs on fla; pass q as [N, 1, H, K] for cula's kernel"
    if num_accepted_tokens is not None:
        return False, "num_accepted_tokens (speculative verify) runs on fla; cula's is kda_decode(step_states=...)"
    if q.dim() != 4 or q.shape[1] != 1:
        return False, f"q of shape {list(q.shape)} (cula's kernel takes [N, 1, H, K]: one token a sequence)"
    return True, None


def _cula_recurrent_supports(
    q, k, v, g, beta, A_log, dt_bias, initial_state, inplace_final_state, cu_seqlens, ssm_state_indices,
    num_accepted_tokens, use_gate_in_kernel, lower_bound, state_v_first, **_,
) -> tuple:  # fmt: skip
    """FLA's serving call that is exactly one ``kda_decode`` step: [N, 1] tokens, an fp32 pool, int32 [N] rows (a
    bf16 / fp16 pool goes on to FLA's kernel, the reason logged by the registry)."""
    from cula._validate import pool_layout_verdict

    ok, why = serving_form_verdict(q, cu_seqlens, ssm_state_indices, inplace_final_state, num_accepted_tokens)
    if not ok:
        return ok, why
    if initial_state.dtype != torch.float32 or initial_state.ndim != 4:
        # (FLA's kernel takes bf16 / fp16 pools: its fp32 recurrence, each new state stored in the pool's dtype)
        pool = f"a {initial_state.dtype} state pool of rank {initial_state.ndim}"
        return False, f"{pool} (cula's kernel takes an fp32 pool [P, HV, ...])"
    if ssm_state_indices.ndim != 1 or ssm_state_indices.dtype != torch.int32:
        return False, "ssm_state_indices must be int32 [N] for cula's kernel"
    if q.dtype not in (torch.bfloat16, torch.float16) or g.dtype not in _KERNEL_FLOATS:
        return False, f"q dtype {q.dtype} / g dtype {g.dtype} (kernel takes bf16/fp16 q, bf16/fp16/fp32 g)"
    if k.dtype != q.dtype or v.dtype != q.dtype:  # (validation takes any float dtype apiece, as FLA's kernel does)
        return False, f"q / k / v dtypes {q.dtype} / {k.dtype} / {v.dtype} (kernel takes one bf16 / fp16 dtype)"
    if beta.ndim == v.ndim or beta.dtype not in (torch.float32, torch.bfloat16):
        return False, "per-channel beta, or beta not fp32/bf16, runs on fla"
    if any(t is not None and t.dtype != torch.float32 for t in (A_log, dt_bias)):
        return False, "A_log / dt_bias not fp32 run on fla"
    if (q.shape[-1], v.shape[-1]) not in ((64, 64), (128, 128)):
        return False, f"head sizes K={q.shape[-1]} V={v.shape[-1]} (kernel takes K = V in {{64, 128}})"
    return pool_layout_verdict(initial_state, q.shape[-1], v.shape[-1], state_v_first)


def _prepare_recurrent_cula_sm90(
    q, k, v, g, beta, A_log, dt_bias, initial_state, ssm_state_indices, use_qk_l2norm_in_kernel, use_gate_in_kernel,
    use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first, out, **_,
):  # fmt: skip
    """The decode kernel bound once for a repeated serving call (one plan: the call does not walk ``kda_decode``'s
    validation, registry and plan cache a second time); None where an input needs a dense copy first (the
    general path, through ``kda_decode``)."""
    from cula._validate import check_state_pool
    from cula.kda import decode

    check_state_pool(
        initial_state, ssm_state_indices, n=q.shape[0], heads=v.shape[2], k=q.shape[-1], v=v.shape[-1],
        state_v_first=state_v_first, device=q.device,
    )  # fmt: skip
    flat_bias = None if dt_bias is None else dt_bias.reshape(-1)  # FLA takes any dt_bias of HV*K elements
    bound = decode._prepare_cula_sm90(
        q=q, k=k, v=v, g=g, beta=beta, state_pool=initial_state, state_indices=ssm_state_indices, A_log=A_log,
        dt_bias=flat_bias, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, state_v_first=state_v_first,
        out=torch.empty_like(v, memory_format=torch.contiguous_format) if out is None else out, step_states=None,
    )  # fmt: skip
    if bound is None:
        return None

    def launch(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, ssm_state_indices, lower_bound, out, **_):
        o = torch.empty_like(v, memory_format=torch.contiguous_format) if out is None else out
        bias = None if dt_bias is None else dt_bias.reshape(-1)
        bound(q, k, v, g, beta, initial_state, ssm_state_indices, A_log, bias, scale, lower_bound, o, None)
        return o, initial_state

    return launch


# Serving engines call FLA's fused_recurrent_kda_fwd once per token; the [N, 1] pool form is exactly kda_decode.
@fused_recurrent_kda_registry.register(
    "cula-sm90", CULA_PRIORITY, available=cula_kernels_on((9, 0)), supports=_cula_recurrent_supports,
    prepare=_prepare_recurrent_cula_sm90,
)  # fmt: skip
def _fused_recurrent_kda_cula_sm90(
    q, k, v, g, beta, A_log, dt_bias, initial_state, scale, ssm_state_indices, use_qk_l2norm_in_kernel,
    use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first, out, **_,
):  # fmt: skip
    from cula.kda.decode import kda_decode

    o = kda_decode(
        q, k, v, g, beta, initial_state, ssm_state_indices, A_log=A_log,
        # FLA takes any dt_bias of HV*K elements, kda_decode the flat [HV*K] one
        dt_bias=None if dt_bias is None else dt_bias.reshape(-1), scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, state_v_first=state_v_first, out=out, check_indices=False,
    )  # fmt: skip
    return o, initial_state


@fused_recurrent_kda_registry.register("fla", FLA_PRIORITY, available=package_on_cuda("fla"))
def _fused_recurrent_kda_fla(**args):
    """FLA's low-level form, which (unlike its public one) makes nothing contiguous: its kernel addresses the token
    tensors, the gate parameters and ``out`` as row-major, a pool by its dim-0 stride with each row row-major, and
    a state of its own (no ``ssm_state_indices``) as row-major. Others are copied first; a strided ``out`` or
    in-place state is written through a row-major copy."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    state, out = args["initial_state"], args["out"]
    pooled = args["ssm_state_indices"] is not None
    state_ok = state is None or not state.numel() or (state[0] if pooled else state).is_contiguous()
    tensors = (t for n, t in args.items() if isinstance(t, torch.Tensor) and n != "initial_state")
    if state_ok and all(t.is_contiguous() for t in tensors):
        return fused_recurrent_kda_fwd(**args)  # (the common call: no copies, no views)
    call = {n: t.contiguous() if isinstance(t, torch.Tensor) and n not in ("initial_state", "out") else t
            for n, t in args.items()}  # fmt: skip
    if not state_ok:
        call["initial_state"] = state.contiguous()
    if out is not None and not out.is_contiguous():
        call["out"] = out.contiguous()
    o, final = fused_recurrent_kda_fwd(**call)
    if call["out"] is not out:
        o = out.copy_(o)
    if call["initial_state"] is not state and args["inplace_final_state"]:
        final = state.copy_(final)
    return o, final


@fused_recurrent_kda_registry.register("reference", REFERENCE_PRIORITY, available=always)
def _fused_recurrent_kda_reference(**args):
    if args["ssm_state_indices"] is not None:
        return _recurrent_pool_reference(args)
    initial_state, inplace_final_state = args["initial_state"], args["inplace_final_state"]
    o, final = _reference("recurrent", args, args["output_final_state"] or inplace_final_state)
    if inplace_final_state:  # (stored in the state's dtype, rounded to nearest even as FLA's kernel stores it)
        with torch.no_grad():
            initial_state.copy_(final)
        final = initial_state
    if args.get("out") is not None:
        with torch.no_grad():
            o = args["out"].copy_(o)
    return o, final


def _recurrent_pool_reference(args: dict):
    """FLA 0.6.0's state-pool form of ``fused_recurrent_kda_fwd`` (``ssm_state_indices``) in PyTorch, on validated
    dispatch arguments, as FLA's kernel runs it: sequence ``n`` starts from pool row ``indices[n, a - 1]`` (``a``:
    its ``num_accepted_tokens``, else 1; ``[N]`` indices are one column) read as fp32, runs its tokens in fp32 with
    the state carried in fp32 from token to token, and stores the state after its token ``t`` in place at row
    ``indices[n, t]`` in the pool's dtype (rounded to nearest even, as the kernel's store does: a bf16 / fp16 pool
    takes each new state rounded once), or with ``inplace_final_state=False`` at row ``bos + t`` of an fp32
    ``[N, HV, ...]`` final state (FLA's: a sequence's first token's position; validation allows one token a sequence
    there). Empty sequences write nothing. A negative index, which FLA's kernel would follow out of the pool, marks a
    padded slot, as for cula's decode kernel: read there, the sequence is skipped (its outputs zero, nothing stored);
    written there, that token's state is not stored. Index values past the pool, and ``num_accepted_tokens`` outside
    ``1..T'`` for a sequence with tokens, raise ``ValueError`` (the values are read on the host)."""
    q, v, pool, indices = args["q"], args["v"], args["initial_state"], args["ssm_state_indices"]
    cu, accepted, inplace = args["cu_seqlens"], args["num_accepted_tokens"], args["inplace_final_state"]
    B, T = q.shape[:2]
    bounds = [n * T for n in range(B + 1)] if cu is None else cu.tolist()
    N = len(bounds) - 1
    rows = indices.reshape(N, -1).tolist()  # [N] indices: a column of one
    lengths = [bounds[n + 1] - bounds[n] for n in range(N)]
    first = [0] * N if accepted is None else [int(a) - 1 for a in accepted.tolist()]
    for n in range(N):
        if lengths[n] and not 0 <= first[n] < len(rows[n]):
            raise ValueError(f"`num_accepted_tokens` must lie in 1..{len(rows[n])} (the columns of "
                             f"`ssm_state_indices`) for a sequence with tokens, got {first[n] + 1} for sequence {n}")
    read = [rows[n][first[n]] if lengths[n] else -1 for n in range(N)]
    used = [r for r in read if r >= 0]
    if inplace:
        used += [rows[n][t] for n in range(N) if read[n] >= 0 for t in range(lengths[n])]
    if used and max(used) >= pool.shape[0]:
        raise ValueError(f"`ssm_state_indices` has {max(used)}, out of range for a pool of {pool.shape[0]} rows")
    tokens = {n: args[n].reshape(B * T, *args[n].shape[2:]) for n in ("q", "k", "v", "g", "beta")}
    o = torch.zeros(B * T, *v.shape[2:], dtype=v.dtype, device=v.device)
    final = None if inplace else torch.zeros(N, *pool.shape[1:], dtype=torch.float32, device=q.device)
    live = [n for n in range(N) if read[n] >= 0]
    with torch.no_grad():
        states = pool[torch.tensor([read[n] for n in live], dtype=torch.long, device=pool.device)].float()
        for t in range(max((lengths[n] for n in live), default=0)):  # a token of every live sequence at a time
            step = [i for i, n in enumerate(live) if lengths[n] > t]
            at = torch.tensor([bounds[live[i]] + t for i in step], dtype=torch.long, device=q.device)
            sub = torch.tensor(step, dtype=torch.long, device=q.device)
            call = dict(args, cu_seqlens=None, initial_state=states[sub],
                        **{name: x[at].unsqueeze(1) for name, x in tokens.items()})  # fmt: skip
            o_t, new = _reference("recurrent", call, True)
            o[at] = o_t[:, 0]
            states[sub] = new  # carried in fp32 to the sequence's next token
            for j, i in enumerate(step):
                row = rows[live[i]][t] if inplace else bounds[live[i]] + t
                if not inplace:
                    final[row] = new[j]
                elif row >= 0:
                    pool[row] = new[j].to(pool.dtype)
        o = o.view(v.shape)
        if args.get("out") is not None:
            o = args["out"].copy_(o)
    return o, (pool if inplace else final)
