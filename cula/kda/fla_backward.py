"""FLA 0.6.0's chunked KDA backward (``fla.ops.kda.chunk_bwd.chunk_kda_bwd``) as cula's training path runs it: FLA's
own stages in FLA's order, with stage 6 (``chunk_kda_bwd_wy_dqkg_fused``, the state-term and WY gradients; see
docs/design-kda-backward.md) launched at a configuration FLA's Hopper autotune list leaves out.

Why: on the H200 that kernel is 42% of the backward (11.5 of 27.2 ms at B=2, T=16384, H=64, K=V=128; session 21,
``profile_kda.py --training``). Its autotuned choice (BK=64, BV=64, 4 warps) compiles to 255 registers with 302
spilled; FLA's list stops at 4 warps on Hopper. At 8 warps (BK = BV = 64) it spills 36 and runs in 7.71 ms
(``scripts/device/bwd_configs.py``), with the same outputs (dq, dk, dv, dA bit for bit, db and dg to fp32 rounding
of a different summation order). The kernel is FLA's, called through its Triton function; only the
launch grid's block sizes and warp count are ours.

The rest of FLA's ``chunk_kda_bwd`` is left as it is by running FLA's function body with stage names rebound: a copy
of the function object whose globals are FLA's module's with ``chunk_kda_bwd_wy_dqkg_fused`` (and
``chunk_kda_bwd_intra``, whose launch of ours, ``INTRA_BWD_LAUNCH``, is off until timed) replaced. FLA's
module is not modified, so FLA's own backward (``fla.ops.kda.chunk_kda``) in the same process is unchanged.
"""

from __future__ import annotations

import functools
import types

import torch

__all__ = ["chunk_kda_bwd", "INTRA_BWD_LAUNCH", "WY_DQKG_LAUNCH"]

# (BK, BV, warps, stages) of FLA's stage-6 kernel for K = V = 128 on SM90; None: FLA's autotuned choice.
# H200 (session 21, bwd_configs.py, B2-T16384, [V, K] state; FLA's choice, 64 / 64 at 4 warps: 11.54 ms, 302
# registers spilled): at 8 warps BK / BV 64 / 64 7.71 ms (36 spilled), 32 / 64 8.48 (none), 128 / 64 8.49, 64 / 128
# 8.41, 32 / 128 8.58, 64 / 32 8.90, 128 / 32 9.60; 32 / 64 at 16 warps 10.70. BK=32 at 4 warps returned wrong dk
# (FLA's list leaves it out on Hopper too) and 32 / 128 at 4 warps hit an illegal address. Every 8-warp one
# returned FLA's dq, dk, dv and dA bit for bit.
WY_DQKG_LAUNCH: tuple[int, int, int, int] | None = (64, 64, 8, 1)
# (BK, warps, stages) of FLA's stage-7 kernel (``chunk_kda_bwd_kernel_intra``; FLA fixes BK=32 and autotunes warps
# and stages) for K = 128 on SM90; None: FLA's own. Not timed yet (scripts/device/bwd_configs.py --stage 7): off.
INTRA_BWD_LAUNCH: tuple[int, int, int] | None = None


def launch_verdict(launch, q, use_graph, K, V, chunk_size) -> tuple[bool, str | None]:
    """Whether a launch configuration of ours applies, with the reason if not: set, CUDA on SM90, K = V = 128 and
    64-token chunks (the timed shapes), no CUDA-graph buffers (FLA's static allocations)."""
    if launch is None:
        return False, "no launch configuration of ours is set for this stage"
    if use_graph:
        return False, "use_graph (FLA's static buffers) runs FLA's wrapper"
    if not q.is_cuda:
        return False, f"needs a CUDA tensor, got {q.device.type}"
    if (K, V, chunk_size) != (128, 128, 64):
        return False, f"K={K} V={V} chunk_size={chunk_size} (ours is timed for K = V = 128, 64-token chunks)"
    arch = torch.cuda.get_device_capability(q.device)
    if arch != (9, 0):
        return False, f"device is sm_{arch[0]}{arch[1]} (ours is timed on sm_90)"
    return True, None


def _ours(launch, q, use_graph, K, V, chunk_size) -> bool:
    return launch_verdict(launch, q, use_graph, K, V, chunk_size)[0]


def _wy_dqkg_fused(
    q, k, v, v_new, g, beta, A, h, do, dh, dv, scale=None, state_v_first=False, cu_seqlens=None, chunk_size=64,
    chunk_indices=None, chunk_offsets=None, use_graph=False,
):  # fmt: skip
    """FLA's ``chunk_kda_bwd_wy_dqkg_fused`` with its arguments and returns, launched at ``WY_DQKG_LAUNCH`` where
    that applies (``_ours``); FLA's own wrapper elsewhere."""
    from fla.ops.kda import chunk_bwd

    if not _ours(WY_DQKG_LAUNCH, q, use_graph, k.shape[-1], v.shape[-1], chunk_size):
        return chunk_bwd.chunk_kda_bwd_wy_dqkg_fused(
            q=q, k=k, v=v, v_new=v_new, g=g, beta=beta, A=A, h=h, do=do, dh=dh, dv=dv, scale=scale,
            state_v_first=state_v_first, cu_seqlens=cu_seqlens, chunk_size=chunk_size, chunk_indices=chunk_indices,
            chunk_offsets=chunk_offsets, use_graph=use_graph,
        )  # fmt: skip
    return launch_wy_dqkg(q, k, v, v_new, g, beta, A, h, do, dh, dv, scale, state_v_first, cu_seqlens, chunk_size,
                          chunk_indices, WY_DQKG_LAUNCH)  # fmt: skip


def launch_wy_dqkg(q, k, v, v_new, g, beta, A, h, do, dh, dv, scale, state_v_first, cu_seqlens, chunk_size,
                   chunk_indices, launch):  # fmt: skip
    """FLA's stage-6 Triton kernel at ``launch = (BK, BV, warps, stages)``: ``(dq, dk, dv, db, dg, dA)`` as FLA's
    wrapper allocates and returns them (dq / dk per value head in fp32, dv in v's dtype, the rest fp32)."""
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
        USE_GRAPH=False, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dq, dk, dv2, db, dg, dA


def _intra_bwd(
    q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, cu_seqlens=None, chunk_indices=None, chunk_size=64, safe_gate=False,
    lower_bound=None, use_graph=False,
):  # fmt: skip
    """FLA's ``chunk_kda_bwd_intra`` with its arguments and returns, launched at ``INTRA_BWD_LAUNCH`` where that
    applies (``_ours``); FLA's own wrapper elsewhere."""
    from fla.ops.kda import chunk_intra

    if not _ours(INTRA_BWD_LAUNCH, q, use_graph, k.shape[-1], k.shape[-1], chunk_size):
        return chunk_intra.chunk_kda_bwd_intra(
            q=q, k=k, g=g, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg, cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices, chunk_size=chunk_size, safe_gate=safe_gate, lower_bound=lower_bound,
            use_graph=use_graph,
        )  # fmt: skip
    return launch_intra_bwd(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, cu_seqlens, chunk_indices, chunk_size,
                            safe_gate, lower_bound, INTRA_BWD_LAUNCH)  # fmt: skip


def launch_intra_bwd(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, cu_seqlens, chunk_indices, chunk_size, safe_gate,
                     lower_bound, launch):  # fmt: skip
    """FLA's stage-7 Triton kernel (``chunk_kda_bwd_kernel_intra``) at ``launch = (BK, warps, stages)``: ``(dq, dk,
    db, dg)`` as FLA's ``chunk_kda_bwd_intra`` returns them (the dbeta partials of the BK channel blocks summed
    onto ``db``); the backward's stage 7 when ``INTRA_BWD_LAUNCH`` is set."""
    from fla.ops.kda import chunk_intra
    from fla.ops.utils.constant import RCP_LN2

    B, T, H, K = k.shape
    HV = g.shape[2]
    bk, warps, stages = launch
    BC = 16
    chunk_indices, NT = _chunk_grid(T, cu_seqlens, chunk_indices, chunk_size)
    NC, NK = chunk_size // BC, -(-K // bk)
    dq2, dk2 = torch.empty_like(dq), torch.empty_like(dk)
    db2 = beta.new_empty(NK, *beta.shape, dtype=torch.float)
    dg2 = torch.empty_like(dg, dtype=torch.float)
    _triton_fn(chunk_intra.chunk_kda_bwd_kernel_intra)[(NK * NC * NT, B * HV)](
        q=q, k=k, g=g, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dq2=dq2, dk=dk, dk2=dk2, dg=dg, dg2=dg2, db=db2,
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, B=B, T=T, H=H, HV=HV, K=K, BT=chunk_size, BC=BC, BK=bk,
        NC=NC, SAFE_GATE=safe_gate, GATE_SHIFT=(-lower_bound if lower_bound is not None else 2.0) * RCP_LN2,
        USE_GATHER=chunk_intra.IS_GATHER_SUPPORTED, USE_GRAPH=False, IS_VARLEN=cu_seqlens is not None,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dq2, dk2, db2.sum(0).add_(db), dg2


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


@functools.cache
def _fla_chunk_kda_bwd():
    """FLA's ``chunk_kda_bwd`` function body over its module's globals with stages 6 and 7 rebound to ours."""
    from fla.ops.kda import chunk_bwd

    fn = chunk_bwd.chunk_kda_bwd
    ours = {"chunk_kda_bwd_wy_dqkg_fused": _wy_dqkg_fused, "chunk_kda_bwd_intra": _intra_bwd}
    if not set(ours) <= set(fn.__code__.co_names):  # another FLA: its backward as it is
        return fn
    scope = dict(vars(chunk_bwd), **ours)
    rebound = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    rebound.__kwdefaults__ = fn.__kwdefaults__
    return rebound


def chunk_kda_bwd(**kwargs):
    """FLA 0.6.0's ``chunk_kda_bwd`` (same keywords and returns: ``(dq, dk, dv, db, dg, dh0, dA_log, ddt_bias)``),
    its stage 6 launched at ``WY_DQKG_LAUNCH`` and stage 7 at ``INTRA_BWD_LAUNCH`` (module docstring)."""
    return _fla_chunk_kda_bwd()(**kwargs)
