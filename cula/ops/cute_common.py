"""CuTe DSL pieces shared by the SM90 kernels: barrier ids, the accumulator-as-operand view of chained WGMMAs, and
the TMA boxes of fp32 decode states.

**Named barriers.** Barrier 0 is the CTA-wide ``bar.sync``; every kernel numbers its other named barriers in an
``IntEnum`` of its own module, from ``FIRST_NAMED_BARRIER`` on, so no id is a bare number at its use.

**State boxes.** A decode CTA that works on ``[K, tile_v]`` of one (pool row, head) state moves it with one TMA load
into shared memory and one TMA store back. ``state_box_atoms`` builds the two TMA atoms over a ``[P, HV, K, V]``
pool viewed as ``(V, K, HV, P)``, ``box_partition`` cuts the box of one (head, pool row) out of it; the kernels own
the shared-memory layout (swizzled or not).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

__all__ = [
    "FIRST_NAMED_BARRIER", "acc_as_a_frag", "box_barrier_init", "box_load", "box_partition", "box_store",
    "state_box_atoms",
]  # fmt: skip

FIRST_NAMED_BARRIER = 1  # 0 is the CTA-wide barrier


def acc_as_a_frag(acc: cute.Tensor) -> cute.Tensor:
    """View an SM90 fp32 accumulator ``((2,2,N/8),MMA_M,MMA_N)`` as the A-operand fragment
    ``((2,2,2),MMA_M,(N/16,MMA_N))`` of a 16-bit RS WGMMA over the same registers, so the N of one GEMM becomes the
    K of the next without moving a register (after a conversion to the 16-bit type)."""
    lay = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    new = cute.make_layout(
        ((lay.shape[0][0], lay.shape[0][1], lay.shape[0][2][0]), lay.shape[1], (lay.shape[0][2][1], lay.shape[2])),
        stride=(
            (lay.stride[0][0], lay.stride[0][1], lay.stride[0][2][0]),
            lay.stride[1],
            (lay.stride[0][2][1], lay.stride[2]),
        ),
    )
    return cute.make_tensor(acc.iterator, new)


@cute.jit
def state_box_atoms(mState: cute.Tensor, box_layout, tile_v: int, K: int):
    """``(tma_load, load_view, tma_store, store_view)`` for ``[tile_v V, K]`` boxes of a ``[P, HV, K, V]`` pool,
    staged in shared memory as ``box_layout`` (``(tile_v, K)``, V contiguous)."""
    pool = cute.make_tensor(mState.iterator, cute.select(mState.layout, mode=[3, 2, 1, 0]))  # (V, K, HV, P)
    box = (tile_v, K)
    tma_ld, t_ld = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), pool, box_layout, box)
    tma_st, t_st = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), pool, box_layout, box)
    return tma_ld, t_ld, tma_st, t_st


@cute.jit
def box_partition(atom, t_pool, sTile, hv, slot, tile_v: int, K: int):
    """(shared box, the state's boxes along V) of pool row ``slot``, head ``hv``, for a load or store atom of
    :func:`state_box_atoms`; ``sTile`` is the ``(tile_v, K, 1)`` shared tile."""
    g_box = cute.local_tile(t_pool[None, None, hv, slot], (tile_v, K), (None, 0))
    return cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(sTile, 0, 2), cute.group_modes(g_box, 0, 2)
    )


@cute.jit
def box_load(tma_ld, t_ld, sTile, hv, slot, vb, bar, warp, lane, tile_v: int, K: int):
    """Arm ``bar`` (initialised by :func:`box_barrier_init`) and issue the TMA load of box ``vb`` of pool row
    ``slot``, head ``hv`` into ``sTile``, from the CTA's first warp (``warp``: the warp-uniform index); wait with
    ``mbarrier_wait(bar, 0)``."""
    if warp == 0:
        if lane == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bar, tile_v * K * 4)
        ts, tg = box_partition(tma_ld, t_ld, sTile, hv, slot, tile_v, K)
        cute.copy(tma_ld, tg[None, vb], ts[None, 0], tma_bar_ptr=bar)


@cute.jit
def box_barrier_init(bar, tidx):
    """The box load's mbarrier (one arrival), initialised by thread 0 and visible to the CTA after its barrier."""
    if tidx == 0:
        cute.arch.mbarrier_init(bar, 1)
        cute.arch.mbarrier_init_fence()
    cute.arch.barrier()


@cute.jit
def box_store(tma_st, t_st, sTile, hv, slot, vb, warp, tile_v: int, K: int):
    """Every thread's shared-memory writes to the box made visible to the async proxy, then its TMA store from the
    CTA's first warp, which waits until the store has read the box (shared memory must outlive it)."""
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier()
    if warp == 0:
        ts, tg = box_partition(tma_st, t_st, sTile, hv, slot, tile_v, K)
        cute.copy(tma_st, ts[None, 0], tg[None, vb])
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)
