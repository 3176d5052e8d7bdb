"""TMA boxes of fp32 decode states in a ``[P, HV, K, V]`` pool, shared by the KDA and Lightning decode kernels (SM90).

A decode CTA that works on ``[K, tile_v]`` of one (pool row, head) state moves it with one TMA load into shared
memory and one TMA store back. These helpers build the two TMA atoms over the pool viewed as ``(V, K, HV, P)`` and
cut the box of one (head, pool row) out of it; the kernels own the shared-memory layout (swizzled or not).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

__all__ = ["box_partition", "state_box_atoms"]


@cute.jit
def state_box_atoms(mState: cute.Tensor, box_layout, tile_v: int, K: int):
    """``(tma_load, load_view, tma_store, store_view)`` for ``[tile_v V, K]`` boxes of a ``[P, HV, K, V]`` pool,
    staged in shared memory as ``box_layout`` (``(tile_v, K)``, V contiguous)."""
    s_vk = cute.make_tensor(mState.iterator, cute.select(mState.layout, mode=[3, 2, 1, 0]))  # (V, K, HV, P)
    tma_ld, t_ld = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), s_vk, box_layout, (tile_v, K))
    tma_st, t_st = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), s_vk, box_layout, (tile_v, K))
    return tma_ld, t_ld, tma_st, t_st


@cute.jit
def box_partition(atom, t_pool, sTile, hv, slot, tile_v: int, K: int):
    """(shared box, the state's boxes along V) of pool row ``slot``, head ``hv``, for a load or store atom of
    :func:`state_box_atoms`; ``sTile`` is the ``(tile_v, K, 1)`` shared tile."""
    g_box = cute.local_tile(t_pool[None, None, hv, slot], (tile_v, K), (None, 0))
    return cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(sTile, 0, 2), cute.group_modes(g_box, 0, 2)
    )
