"""FLA 0.6.0's chunked KDA backward (``fla.ops.kda.chunk_bwd.chunk_kda_bwd``) as cula's training path runs it: FLA's
own stages in FLA's order, with stage 6 (``chunk_kda_bwd_wy_dqkg_fused``, the state-term and WY gradients) on cula's
own kernel where ``KdaTuning.bwd_wy_dqkg`` says so, else launched at a configuration FLA's Hopper autotune list leaves
out (``KdaTuning.wy_dqkg_launch``), stages 4 and 5 (``chunk_kda_bwd_dAv`` and ``chunk_gated_delta_rule_bwd_dhu``, dv
and the state-gradient recurrence) in one launch of cula's own kernel where ``KdaTuning.bwd_dv_dhu_lanes`` says
so, and stage 7 (``chunk_kda_bwd_intra``, the gradients through the intra-chunk scores) on cula's own kernel where
``KdaTuning.bwd_intra`` says so and the gates are ones it is exact for; that kernel also does stage 8 (the reverse
chunk-local cumsum of dg) where ``KdaTuning.bwd_intra_cumsum`` says so, and the rebound body then skips it.

Why: that kernel is the backward's largest stage. FLA's autotuned choice on Hopper (BK = BV = 64, 4 warps) compiles
to 255 registers and spills about 300 of them; at 8 warps it spills a tenth of that and runs about 1.5x faster, with
the same outputs (dq, dk, dv, dA bit for bit, db and dg to fp32 rounding of a different summation order). The
kernel is FLA's, called through its Triton function; only the launch grid's block sizes and warp count are ours.

The rest of FLA's ``chunk_kda_bwd`` is left as it is by running FLA's function body with those stages' names
rebound: a copy of the function object whose globals are FLA's module's with the two names replaced.
FLA's module is not modified, so FLA's own backward (``fla.ops.kda.chunk_kda``) in the same process is unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import types

import torch

__all__ = [
    "chunk_kda_bwd", "cula_chunk_rows", "fla_stages_only", "launch_verdict", "launch_wy_dqkg", "norm_on_load",
    "recompute_on_cula", "recompute_prefix", "wy_dqkg_launch", "wy_dqkg_ours", "wy_dqkg_verdict",
]  # fmt: skip


def wy_dqkg_launch(device: torch.device) -> tuple[int, int, int, int] | None:
    """``(BK, BV, warps, stages)`` of FLA's stage-6 kernel on ``device`` (the GPU's tuning entry), or None."""
    from cula.kda.plan import KDA_TUNING

    return KDA_TUNING.for_device(device).wy_dqkg_launch


def launch_verdict(launch, q, K, V, chunk_size) -> tuple[bool, str | None]:
    """Whether a launch configuration of ours applies, with the reason if not: set, CUDA on SM90, K = V = 128 and
    64-token chunks (the timed shapes). FLA's graph mode (``use_graph``) is no reason against: cula's kernels take
    its chunk list through ``cula_chunk_rows``, FLA's kernel at our launch with its ``USE_GRAPH``."""
    if launch is None:
        return False, "no launch configuration of ours is set for this stage"
    if not q.is_cuda:
        return False, f"needs a CUDA tensor, got {q.device.type}"
    if (K, V, chunk_size) != (128, 128, 64):
        return False, f"K={K} V={V} chunk_size={chunk_size} (ours is timed for K = V = 128, 64-token chunks)"
    arch = torch.cuda.get_device_capability(q.device)
    if arch != (9, 0):
        return False, f"device is sm_{arch[0]}{arch[1]} (ours is timed on sm_90)"
    return True, None


def _ours(launch, q, K, V, chunk_size) -> bool:
    return launch_verdict(launch, q, K, V, chunk_size)[0]


def cula_chunk_rows(chunk_indices, cu_seqlens, use_graph: bool):
    """A backward stage's chunk list as cula's kernels take it. In FLA's graph mode (``use_graph``) the list is FLA's
    ``prepare_chunk_indices_static``: a fixed number of rows, those past the real chunks sentinels (sequence -1) that
    FLA's kernels return on; cula's kernels would read the boundary before the first for them, so they become
    padding rows (the last sequence, a chunk past its end: ``64 c >=`` its length), which cula's kernels skip (and
    where they leave per-chunk partial sums, write zeros). The real rows, and so each row's index into per-chunk
    tensors (h, dh), stay as they are. Device ops on the list's shape alone, so a CUDA graph can capture them;
    otherwise the list as given."""
    if not use_graph or chunk_indices is None or cu_seqlens is None or cu_seqlens.shape[0] < 2:
        return chunk_indices
    rows = chunk_indices.to(torch.int32)
    sentinel = rows[:, 0] < 0
    # chunk number: the row count, at least every sequence's chunk count (FLA sizes the list ceil(T / 64) + N - 1)
    seq = rows[:, 0].masked_fill(sentinel, cu_seqlens.shape[0] - 2)
    return torch.stack((seq, rows[:, 1].masked_fill(sentinel, rows.shape[0])), 1)


def _wy_dqkg_fused(
    q, k, v, v_new, g, beta, A, h, do, dh, dv, scale=None, state_v_first=False, cu_seqlens=None, chunk_size=64,
    chunk_indices=None, chunk_offsets=None, use_graph=False,
):  # fmt: skip
    """FLA's ``chunk_kda_bwd_wy_dqkg_fused`` with its arguments and returns: ``wy_dqkg_ours`` where
    ``wy_dqkg_verdict`` allows it, else FLA's own wrapper."""
    from fla.ops.kda import chunk_bwd

    call = _BACKWARD_CALL.get()
    if call is not None and call.raw_qk:  # norm_on_load said cula's kernel takes it: it must
        if not (wy_dqkg_verdict(q, k, v, v_new, A, h, do, dh, dv, chunk_size)[0]
                and _wy_dqkg_kernel_on(_entry(q.device), q, k, v, v_new, A, h, do, dh, dv)):  # fmt: skip
            raise RuntimeError("stage 6 got raw q / k (norm_on_load) but cula's kernel does not take the call")
        from cula.ops.kda.sm90.bwd_wy_dqkg import chunk_kda_bwd_wy_dqkg_sm90

        return chunk_kda_bwd_wy_dqkg_sm90(
            q, k, v, v_new, g, beta, A, h, do, dh, dv, scale=scale, state_v_first=state_v_first,
            cu_seqlens=cu_seqlens, chunk_size=chunk_size,
            chunk_indices=cula_chunk_rows(chunk_indices, cu_seqlens, use_graph), qk_rstd=call.qk_rstd,
        )  # fmt: skip
    if wy_dqkg_verdict(q, k, v, v_new, A, h, do, dh, dv, chunk_size)[0]:
        return wy_dqkg_ours(q, k, v, v_new, g, beta, A, h, do, dh, dv, scale, state_v_first, cu_seqlens, chunk_size,
                            chunk_indices, use_graph)  # fmt: skip
    return chunk_bwd.chunk_kda_bwd_wy_dqkg_fused(
        q=q, k=k, v=v, v_new=v_new, g=g, beta=beta, A=A, h=h, do=do, dh=dh, dv=dv, scale=scale,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, chunk_size=chunk_size, chunk_indices=chunk_indices,
        chunk_offsets=chunk_offsets, use_graph=use_graph,
    )  # fmt: skip


def _wy_dqkg_kernel_on(entry, q, k, v, v_new, A, h, do, dh, dv) -> bool:
    """Whether cula's stage-6 kernel takes the call: the entry turns it on and the operands share one 16-bit
    dtype."""
    return entry.bwd_wy_dqkg and q.dtype in (torch.bfloat16, torch.float16) and all(
        t.dtype == q.dtype for t in (k, v, v_new, A, h, do, dh, dv)
    )


def wy_dqkg_verdict(q, k, v, v_new, A, h, do, dh, dv, chunk_size) -> tuple[bool, str | None]:
    """Whether stage 6 runs on cula's side (``wy_dqkg_ours``), with the reason if not: cula's kernel takes the call
    (``KdaTuning.bwd_wy_dqkg``, one 16-bit dtype) or the tuning entry sets a launch of FLA's kernel
    (``KdaTuning.wy_dqkg_launch``), and ``launch_verdict``'s conditions hold."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False, f"q dtype {q.dtype} (cula's side of this stage runs bf16 / fp16 calls)"
    entry = _entry(q.device)
    ours = _wy_dqkg_kernel_on(entry, q, k, v, v_new, A, h, do, dh, dv) or entry.wy_dqkg_launch is not None
    return launch_verdict(ours or None, q, k.shape[-1], v.shape[-1], chunk_size)


def wy_dqkg_ours(q, k, v, v_new, g, beta, A, h, do, dh, dv, scale, state_v_first, cu_seqlens, chunk_size,
                 chunk_indices, use_graph=False):  # fmt: skip
    """Stage 6 where ``wy_dqkg_verdict`` allows it: cula's kernel (``cula.ops.kda.sm90.bwd_wy_dqkg``) where it takes
    the call, else FLA's Triton kernel at ``wy_dqkg_launch`` (``use_graph``: ``chunk_indices`` is FLA's graph-mode
    list)."""
    entry = _entry(q.device)
    if _wy_dqkg_kernel_on(entry, q, k, v, v_new, A, h, do, dh, dv):
        from cula.ops.kda.sm90.bwd_wy_dqkg import chunk_kda_bwd_wy_dqkg_sm90

        return chunk_kda_bwd_wy_dqkg_sm90(
            q, k, v, v_new, g, beta, A, h, do, dh, dv, scale=scale, state_v_first=state_v_first,
            cu_seqlens=cu_seqlens, chunk_size=chunk_size,
            chunk_indices=cula_chunk_rows(chunk_indices, cu_seqlens, use_graph),
        )  # fmt: skip
    return launch_wy_dqkg(q, k, v, v_new, g, beta, A, h, do, dh, dv, scale, state_v_first, cu_seqlens, chunk_size,
                          chunk_indices, entry.wy_dqkg_launch, use_graph)  # fmt: skip


def launch_wy_dqkg(q, k, v, v_new, g, beta, A, h, do, dh, dv, scale, state_v_first, cu_seqlens, chunk_size,
                   chunk_indices, launch, use_graph=False):  # fmt: skip
    """FLA's stage-6 Triton kernel at ``launch = (BK, BV, warps, stages)``: ``(dq, dk, dv, db, dg, dA)`` as FLA's
    wrapper allocates and returns them (dq / dk per value head in fp32, dv in v's dtype, the rest fp32); with
    ``use_graph`` the kernel returns on the sentinel rows of FLA's graph-mode list, as FLA's wrapper has it do."""
    from fla.ops.kda import chunk_bwd

    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[-1]
    chunk_indices, NT = _chunk_grid(T, cu_seqlens, chunk_indices, chunk_size)
    dq = torch.empty(B, T, HV, K, dtype=torch.float, device=q.device)
    dk = torch.empty(B, T, HV, K, dtype=torch.float, device=q.device)
    dv2 = torch.empty_like(v)
    dg = torch.empty_like(g, dtype=torch.float)
    db = torch.empty_like(beta, dtype=torch.float)
    dA = torch.empty_like(A, dtype=torch.float)
    bk, bv, warps, stages = launch
    _triton_fn(chunk_bwd.chunk_kda_bwd_kernel_wy_dqkg_fused)[(NT, B * HV)](
        q=q, k=k, v=v, v_new=v_new, g=g, beta=beta, A=A, h=h, do=do, dh=dh, dq=dq, dk=dk, dv=dv, dv2=dv2, dg=dg,
        db=db, dA=dA, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, T=T, H=H, HV=HV, K=K, V=V,
        BT=chunk_size, BK=bk, BV=bv, STATE_V_FIRST=state_v_first, IS_VARLEN=cu_seqlens is not None,
        USE_GRAPH=use_graph, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dq, dk, dv2, db, dg, dA


def _chunk_grid(T, cu_seqlens, chunk_indices, chunk_size):
    """``(chunk_indices, NT)`` as FLA's wrappers make them: the packed batch's (sequence, chunk) pairs (built from
    ``cu_seqlens`` when not given) and the number of chunks the grid's first dimension walks."""
    if cu_seqlens is None:
        return chunk_indices, -(-T // chunk_size)
    if chunk_indices is None:
        from fla.ops.utils import prepare_chunk_indices

        chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size)
    return chunk_indices, len(chunk_indices)


def _triton_fn(kernel):
    """The Triton function under FLA's decorators (heuristics, autotuner), to launch at a configuration of ours."""
    from triton.runtime.autotuner import Autotuner, Heuristics

    while isinstance(kernel, (Autotuner, Heuristics)):
        kernel = kernel.fn
    return kernel


# set while a backward runs again on FLA's stages alone (``fla_stages_only``)
_FLA_STAGES_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("cula_fla_stages_only", default=False)


def _entry(device: torch.device):
    """The tuning entry every stage predicate reads: the device's, or within ``fla_stages_only`` the defaults, which
    put no stage on cula's kernels (stage 6 still at FLA's kernel's ``wy_dqkg_launch``, Triton)."""
    from cula.kda.plan import KDA_TUNING, KdaTuning

    return KdaTuning() if _FLA_STAGES_ONLY.get() else KDA_TUNING.for_device(device)


@contextlib.contextmanager
def fla_stages_only():
    """Within the block, every stage of the backward runs FLA's kernels (none of cula's CuTe DSL kernels): for a
    backward that met a kernel variant with no binary (``cula.cache.VariantUnavailableError``: a wheel without the
    DSL, a variant outside its manifest)."""
    token = _FLA_STAGES_ONLY.set(True)
    try:
        yield
    finally:
        _FLA_STAGES_ONLY.reset(token)


def _stage_on(flag: str, q, K, V, chunk_size) -> bool:
    """Whether a backward stage runs on cula's kernel: the GPU's tuning entry turns it on (``KdaTuning.<flag>``)
    and ``launch_verdict``'s conditions hold (CUDA on SM90, K = V = 128, 64-token chunks)."""
    on = getattr(_entry(q.device), flag) if q.is_cuda else False
    return _ours(on or None, q, K, V, chunk_size)


@dataclasses.dataclass
class _Stage4Left:
    """Stage 4's call (FLA's ``chunk_kda_bwd_dAv``) left for stage 5's launch (``KdaTuning.bwd_dv_dhu_lanes``):
    the rebound body hands it on as ``dv``; ``dAqk`` is the tensor it already returned as stage 4's, which that
    launch fills."""

    kwargs: dict
    dAqk: torch.Tensor

    def run_fla(self) -> torch.Tensor:
        """FLA's stage 4 after all (stage 5 did not take the call): ``dAqk`` filled, ``dv`` returned."""
        from fla.ops.kda import chunk_bwd

        dA, dv = chunk_bwd.chunk_kda_bwd_dAv(**self.kwargs)
        self.dAqk.copy_(dA)
        return dv


def _bwd_dAv(q, k, v, do, A=None, scale=None, cu_seqlens=None, chunk_size=64, chunk_indices=None, use_graph=False):
    """FLA's ``chunk_kda_bwd_dAv`` (stage 4) where stage 5's launch does it (``_fla_chunk_kda_bwd``'s
    ``stage4_fused``): ``(dAqk, dv)`` with ``dAqk`` still to be written and ``dv`` the call, for ``_bwd_dhu``."""
    kwargs = dict(q=q, k=k, v=v, do=do, A=A, scale=scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                  chunk_indices=chunk_indices, use_graph=use_graph)  # fmt: skip
    dAqk = torch.empty(*do.shape[:3], chunk_size, dtype=torch.float32, device=do.device)
    return dAqk, _Stage4Left(kwargs, dAqk)


def _dhu_covers(q, w, do, g, gk, chunk_size) -> bool:
    """Whether cula's stage-5 kernel covers the call: ``launch_verdict``'s conditions (CUDA on SM90, K = V = 128,
    64-token chunks), the per-channel gate alone, bf16 / fp16, per-value-head q."""
    if not _ours(True, q, q.shape[-1], do.shape[-1], chunk_size):
        return False
    return g is None and gk is not None and q.dtype in (torch.bfloat16, torch.float16) and q.shape == w.shape


def _bwd_dhu(
    q, k, w, do, dv, g=None, gk=None, h0=None, dht=None, scale=None, state_v_first=False, cu_seqlens=None,
    chunk_size=64, chunk_indices=None, chunk_offsets=None, use_graph=False,
):  # fmt: skip
    """FLA's ``chunk_gated_delta_rule_bwd_dhu`` (stage 5) with its arguments and returns: where ``dv`` is stage 4's
    call (``_Stage4Left``) and ``_dhu_covers`` the call, stages 4 and 5 in one launch of cula's kernel
    (``cula.ops.kda.sm90.bwd_dhu``); FLA's own function elsewhere (after FLA's stage 4 where that was left to it)."""
    from fla.ops.common import chunk_delta_h

    if isinstance(dv, _Stage4Left) and _dhu_covers(q, w, do, g, gk, chunk_size):
        from cula.ops.kda.sm90.bwd_dhu import chunk_kda_bwd_dv_dhu_sm90

        left = dv.kwargs
        _, dh, dh0, dv2 = chunk_kda_bwd_dv_dhu_sm90(
            q, k, w, do, left["A"].contiguous(), left["v"].contiguous(), gk, h0=h0,
            dht=None if dht is None else dht.contiguous(), scale=scale, state_v_first=state_v_first,
            cu_seqlens=cu_seqlens, chunk_size=chunk_size, chunk_indices=chunk_indices, dAqk=dv.dAqk,
        )  # fmt: skip
        return dh, dh0, dv2
    if isinstance(dv, _Stage4Left):
        dv = dv.run_fla()
    return chunk_delta_h.chunk_gated_delta_rule_bwd_dhu(
        q=q, k=k, w=w, do=do, dv=dv, g=g, gk=gk, h0=h0, dht=dht, scale=scale, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, chunk_size=chunk_size, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
        use_graph=use_graph,
    )  # fmt: skip


@dataclasses.dataclass
class _BackwardCall:
    """What one backward call's stage 7 fuses beyond stage 8 (``_stage7_plan``), and what it leaves for the rebound
    stage 9: the L2 norm's backward with ``qk_rstd``, the gate's with ``gate = (g_raw, A_log, dt_bias,
    lower_bound)``, whose results (``dg_raw, dA_log, ddt_bias``) the kernel's call puts in ``gate_grads``. With
    ``raw_qk`` q and k are the raw ones and stages 6 and 7 normalise them with ``qk_rstd`` (``norm_on_load``)."""

    qk_rstd: tuple | None = None
    gate: tuple | None = None
    gate_grads: tuple | None = None
    any_gate: bool = False  # gates no bound is known of: the kernel's any_gate variant
    raw_qk: bool = False


_BACKWARD_CALL: contextvars.ContextVar[_BackwardCall | None] = contextvars.ContextVar(
    "cula_backward_call", default=None
)


def _bwd_intra(
    q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, cu_seqlens=None, chunk_indices=None, chunk_size=64, safe_gate=False,
    lower_bound=None, use_graph=False, *, ours: bool = False, cumsum: bool = False,
):  # fmt: skip
    """FLA's ``chunk_kda_bwd_intra`` (stage 7) with its arguments and returns: on cula's kernel
    (``cula.ops.kda.sm90.bwd_intra``) when ``ours`` (``_stage7_ours``), with ``cumsum`` its dg already through stage
    8 (FLA's ``chunk_local_cumsum(dg, reverse=True)``, which the rebound body then skips), and with the fused
    neighbours this call's ``_BackwardCall`` names (dq / dk then the raw q's and k's gradients, dg the raw gate's);
    FLA's own function elsewhere. In FLA's graph mode (``use_graph``) both take FLA's static chunk list (cula's
    kernel through ``cula_chunk_rows``)."""
    from fla.ops.kda import chunk_intra

    if ours:
        from cula.ops.kda.sm90.bwd_intra import chunk_kda_bwd_intra_sm90

        call = _BACKWARD_CALL.get() or _BackwardCall()
        out = chunk_kda_bwd_intra_sm90(
            q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, cu_seqlens=cu_seqlens,
            chunk_indices=cula_chunk_rows(chunk_indices, cu_seqlens, use_graph), chunk_size=chunk_size,
            reverse_cumsum_dg=cumsum, qk_rstd=call.qk_rstd, gate=call.gate, in_place=True, any_gate=call.any_gate,
            raw_qk=call.raw_qk,
        )  # fmt: skip
        if call.gate is not None:
            call.gate_grads = out[3:]
        return out[:4]
    return chunk_intra.chunk_kda_bwd_intra(
        q=q, k=k, g=g, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, chunk_size=chunk_size, safe_gate=safe_gate, lower_bound=lower_bound,
        use_graph=use_graph,
    )  # fmt: skip


def _reverse_cumsum_done(g, *args, **kwargs):
    """Stage 8 (``chunk_local_cumsum(dg, reverse=True)``) where cula's stage-7 kernel has done it on chip."""
    return g


def _gate_bwd(g, A_log=None, dt_bias=None, dyg=None, lower_bound=None):
    """Stage 9 (FLA's ``kda_gate_bwd``, same arguments and returns): the results of cula's stage-7 kernel where it
    took the gate's backward for this ``dyg``, else FLA's function."""
    from fla.ops.kda import gate as fla_gate

    call = _BACKWARD_CALL.get()
    if call is not None and call.gate_grads is not None and call.gate_grads[0] is dyg:
        return call.gate_grads
    return fla_gate.kda_gate_bwd(g=g, A_log=A_log, dt_bias=dt_bias, dyg=dyg, lower_bound=lower_bound)


def _stage7_ours(q, v, chunk_size, safe_gate, use_gate_in_kernel, lower_bound) -> tuple[bool, bool]:
    """Whether stage 7 runs on cula's kernel: the tuning entry says so (``KdaTuning.bwd_intra``), ``_stage_on``'s
    conditions hold and the forward's intra kernel took the call's gates (``cula.kda.plan.use_cula_intra``: bounded
    ones, and the others where ``KdaTuning.intra_any_gate`` says so, then in the kernel's any_gate variant); and
    whether that kernel also does stage 8 (``KdaTuning.bwd_intra_cumsum``)."""
    from cula.kda.plan import use_cula_intra

    # stage 7 has no value dimension: V = 128 stands for "any". Gates the intra kernel takes only in its any_gate
    # variant take stage 7's any_gate variant too (_stage7_plan)
    ours = use_cula_intra(q, v, safe_gate, use_gate_in_kernel, lower_bound) and _stage_on(
        "bwd_intra", q, q.shape[-1], 128, chunk_size
    )
    return ours, ours and _entry(q.device).bwd_intra_cumsum


@functools.cache
def _fla_chunk_kda_bwd(stage7_ours: bool = False, stage8_fused: bool = False, stage9_fused: bool = False,
                       stage4_fused: bool = False):  # fmt: skip
    """FLA's ``chunk_kda_bwd`` function body over its module's globals with stages 5, 6 and 7 rebound to ours
    (``stage7_ours``: stage 7 on cula's kernel; ``stage8_fused``: which also does stage 8; ``stage9_fused``: and
    stage 9, the gate's backward; ``stage4_fused``: stage 4 left to stage 5's launch)."""
    from fla.ops.kda import chunk_bwd

    fn = chunk_bwd.chunk_kda_bwd
    ours = {
        "chunk_kda_bwd_wy_dqkg_fused": _wy_dqkg_fused, "chunk_gated_delta_rule_bwd_dhu": _bwd_dhu,
        "chunk_kda_bwd_intra": functools.partial(_bwd_intra, ours=stage7_ours, cumsum=stage8_fused),
    }  # fmt: skip
    if stage4_fused:
        ours["chunk_kda_bwd_dAv"] = _bwd_dAv
    if stage8_fused:
        ours["chunk_local_cumsum"] = _reverse_cumsum_done
    if stage9_fused:
        ours["kda_gate_bwd"] = _gate_bwd
    if not set(ours) <= set(fn.__code__.co_names):  # another FLA: its backward as it is
        return fn
    scope = dict(vars(chunk_bwd), **ours)
    rebound = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    rebound.__kwdefaults__ = fn.__kwdefaults__
    return rebound


def recompute_on_cula(q, v, p: dict) -> bool:
    """Whether the backward's recompute prefix runs on cula's intra kernel (``recompute_prefix``): the tuning entry
    says so (``KdaTuning.bwd_recompute_intra``), the call's gates are ones that kernel takes
    (``cula.kda.plan.use_cula_intra``, as in the forward)."""
    from cula.kda.plan import use_cula_intra

    if not q.is_cuda or not _entry(q.device).bwd_recompute_intra:
        return False
    return use_cula_intra(q, v, p["safe_gate"], p["use_gate_in_kernel"], p["lower_bound"])


def recompute_prefix(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_indices, chunk_offsets,
                     p: dict, Akk=None, qk_rstd: bool = False) -> dict:  # fmt: skip
    """What FLA's ``chunk_kda_bwd`` recomputes before its first gradient stage, for its ``disable_recompute=True``
    path: the gate cumsum ``g`` (every row), ``w, u, qg, kg`` from one launch of cula's intra kernel on the raw
    inputs (the launch the forward made; given the forward's ``Akk``, the kernel reads it instead of computing the
    scores and the solve again, and w, u are the forward's bits), then ``h, v_new`` from FLA's
    ``chunk_gated_delta_rule_fwd_h``, as FLA's recompute branch calls it. Replaces FLA's ``kda_gate_chunk_cumsum``
    (or the glue's ``chunk_local_cumsum``) and ``recompute_w_u_fwd``. In FLA's graph mode (``p["use_graph"]``)
    ``chunk_indices`` / ``chunk_offsets`` are FLA's static ones: the intra kernel takes them through
    ``cula_chunk_rows``, FLA's recurrence as they are (it walks each sequence's chunks from ``chunk_offsets``).
    h and v_new come from cula's states kernel instead where ``KdaTuning.bwd_recompute_states`` says so (the same
    arguments, FLA's shapes); in graph mode kg starts as zeros, as in the forward (the sequences may end before the
    last token, and that kernel's last box of a sequence reads the rows past it). ``qk_rstd`` (``norm_on_load``):
    also q's and k's 1 / norms from the same launch, ``[2, B, T, H]`` fp32 under that key."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

    from cula.kda.forward import _intra_cute

    cu32 = None if cu_seqlens is None else cu_seqlens.to(torch.int32)
    rows = cula_chunk_rows(chunk_indices, cu_seqlens, bool(p.get("use_graph")))
    rstd = torch.empty(2, *q.shape[:3], dtype=torch.float32, device=q.device) if qk_rstd else None
    w, u, qg, kg, _, g_cum, _ = _intra_cute(
        q, k, v, g, beta, p["scale"], cu32, rows, p["use_gate_in_kernel"], A_log, dt_bias,
        p["lower_bound"], p["use_qk_l2norm_in_kernel"], p["use_beta_sigmoid_in_kernel"], p["allow_neg_eigval"],
        full_g_cum=True, given_akk=Akk, qk_rstd=rstd, zero_kg=bool(p.get("use_graph")),
    )  # fmt: skip
    fwd_h = chunk_gated_delta_rule_fwd_h
    if _entry(q.device).bwd_recompute_states:
        from cula.ops.kda.sm90.delta_h_states import chunk_kda_fwd_h_sm90 as fwd_h
    h, v_new, _ = fwd_h(
        k=kg, w=w, u=u, gk=g_cum, initial_state=initial_state, output_final_state=False, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, chunk_size=64, state_v_first=p["state_v_first"],
    )  # fmt: skip
    out = dict(g=g_cum, w=w, u=u, qg=qg, kg=kg, v_new=v_new, h=h)
    if qk_rstd:
        out["qk_rstd"] = rstd
    return out


def _stage7_plan(kwargs: dict, qk_rstd) -> tuple[tuple[bool, bool, bool], _BackwardCall]:
    """``_fla_chunk_kda_bwd``'s flags for one call and what its stage 7 fuses beyond stage 8: the gate's backward
    (``KdaTuning.bwd_intra_gate``: the lower-bound gate in the kernel, and the softplus gate where
    ``KdaTuning.bwd_intra_softplus_gate`` says so; fp32 or absent parameters) and the L2 norm's
    (``KdaTuning.bwd_intra_l2norm``: ``qk_rstd`` given, no GVA)."""
    q, v = kwargs["q"], kwargs["v"]
    lower_bound = kwargs.get("lower_bound")
    ours, cumsum = _stage7_ours(
        q, v, kwargs.get("chunk_size", 64), kwargs.get("safe_gate", False), kwargs.get("use_gate_in_kernel", False),
        lower_bound,
    )  # fmt: skip
    call = _BackwardCall()
    if not ours:
        return (ours, cumsum, False), call
    from cula.kda.plan import intra_any_gate

    call.any_gate = intra_any_gate(kwargs.get("safe_gate", False), kwargs.get("use_gate_in_kernel", False), lower_bound)
    entry = _entry(q.device)
    A_log, dt_bias, g_raw = kwargs.get("A_log"), kwargs.get("dt_bias"), kwargs.get("g_org")
    gate_on_chip = lower_bound is not None or entry.bwd_intra_softplus_gate  # (None: the softplus gate)
    if (cumsum and entry.bwd_intra_gate and kwargs.get("use_gate_in_kernel", False) and gate_on_chip
            and g_raw is not None and all(p is None or p.dtype == torch.float32 for p in (A_log, dt_bias))):
        call.gate = (g_raw, A_log, dt_bias, lower_bound)
    if entry.bwd_intra_l2norm and qk_rstd is not None and q.shape[2] == v.shape[2]:
        call.qk_rstd = qk_rstd
    return (ours, cumsum, call.gate is not None), call


def _stage4_fused(kwargs: dict) -> bool:
    """Whether stage 4 is left to stage 5's launch (``_bwd_dAv``): the tuning entry says so for the call's (sequence,
    value head) lane count (``KdaTuning.bwd_dv_dhu_lanes``; the count from shapes alone, no host sync), not FLA's
    graph mode (the kernel walks FLA's exact chunk list), and the forward's Aqk is cula's intra kernel's (the call's
    gates are ones it takes, ``cula.kda.plan.use_cula_intra``; zero above the diagonal) in q's dtype. Stage 5's own
    conditions are checked at its call, which runs FLA's stage 4 first where they fail."""
    from cula.kda.plan import use_cula_intra

    q, v, Aqk = kwargs["q"], kwargs["v"], kwargs.get("Aqk")
    if not q.is_cuda or kwargs.get("use_graph") or Aqk is None or Aqk.dtype != q.dtype:
        return False
    span = _entry(q.device).bwd_dv_dhu_lanes
    cu = kwargs.get("cu_seqlens")
    lanes = (q.shape[0] if cu is None else cu.shape[0] - 1) * v.shape[2]
    return span is not None and span[0] <= lanes <= span[1] and use_cula_intra(
        q, v, kwargs.get("safe_gate", False), kwargs.get("use_gate_in_kernel", False), kwargs.get("lower_bound")
    )


def norm_on_load(q, v, do, p: dict) -> bool:
    """Whether the backward runs without ``l2norm_fwd`` (``KdaTuning.bwd_norm_on_load``): the recompute's intra
    kernel writes the 1 / norms (``recompute_prefix(qk_rstd=True)``) and ``chunk_kda_bwd(raw_qk=True)`` hands stages
    6 and 7 the raw q and k, which cula's kernels normalise as they read them. Only where the norm is on and both
    stages and the recompute run on cula's kernels, stage 7 with the L2 norm's backward (no GVA), as their
    predicates decide from the same call."""
    if not p["use_qk_l2norm_in_kernel"] or not q.is_cuda:
        return False
    entry = _entry(q.device)
    if not (entry.bwd_norm_on_load and entry.bwd_intra_l2norm and entry.bwd_wy_dqkg) or q.shape[2] != v.shape[2]:
        return False
    # stage 6's operands share q's dtype in the training backward but do, which autograd hands in
    if do.dtype != q.dtype or not launch_verdict(True, q, q.shape[-1], v.shape[-1], 64)[0]:
        return False
    return recompute_on_cula(q, v, p) and _stage7_ours(
        q, v, 64, p["safe_gate"], p["use_gate_in_kernel"], p["lower_bound"]
    )[0]


def chunk_kda_bwd(*, qk_rstd: tuple | None = None, raw_qk: bool = False, **kwargs):
    """FLA 0.6.0's ``chunk_kda_bwd``, called by keyword (same keywords and returns: ``(dq, dk, dv, db, dg, dh0,
    dA_log, ddt_bias)``), its stage 6 launched at ``wy_dqkg_launch``, stages 5, 6 and 7 on cula's kernels where the
    tuning says so (module docstring). ``qk_rstd = (q_rstd, k_rstd)`` (``l2norm_fwd``'s, q and k then the
    normalised ones): dq and dk come back as the raw q's and k's gradients (FLA's ``l2norm_bwd`` applied here, or in
    the stage-7 kernel where the tuning says so). ``raw_qk`` (where ``norm_on_load`` says so): q and k are the raw
    ones, normalised with ``qk_rstd`` by stages 6 and 7."""
    flags, call = _stage7_plan(kwargs, qk_rstd)
    backward = _fla_chunk_kda_bwd(*flags, _stage4_fused(kwargs))
    from fla.ops.kda import chunk_bwd

    if backward is chunk_bwd.chunk_kda_bwd:  # another FLA, its backward as it is: none of our stages run
        call.qk_rstd = None
    if raw_qk:
        if call.qk_rstd is None:
            raise ValueError("raw_qk needs stage 7 on cula's kernel with the L2 norm's backward (norm_on_load)")
        call.raw_qk = True
    token = _BACKWARD_CALL.set(call)
    try:
        dq, dk, *rest = backward(**kwargs)
    finally:
        _BACKWARD_CALL.reset(token)
    if qk_rstd is not None and call.qk_rstd is None:
        import fla.ops.kda.chunk as fla_chunk  # the l2norm_bwd FLA's ChunkKDAFunction calls

        dq = fla_chunk.l2norm_bwd(kwargs["q"], qk_rstd[0], dq)
        dk = fla_chunk.l2norm_bwd(kwargs["k"], qk_rstd[1], dk)
    return (dq, dk, *rest)
