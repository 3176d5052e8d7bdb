"""CuTe DSL pieces shared by the SM90 kernels: barrier ids, the accumulator-as-operand view of chained WGMMAs, tf32
rounding and vector views for the kernels on ``mma.sync``, the pieces of the chunk-recurrence kernels, and the TMA
boxes of fp32 decode states.

**Named barriers.** Barrier 0 is the CTA-wide ``bar.sync``; every kernel numbers its other named barriers in an
``IntEnum`` of its own module, from ``FIRST_NAMED_BARRIER`` on, so no id is a bare number at its use.

**Warp MMAs.** The kernels on ``mma.sync`` (the backward's stage 6 and 7 kernels, CTAs of 256 threads) load a
chunk's token rows into padded shared rows with ``bulk_token_rows`` (a thread a row, one ``cp.async.bulk`` each, on
an mbarrier: stage 6's persistent loop, whose loads overlap the previous item) or ``cp_async_token_rows`` (16-byte
``cp.async``: stage 7, a CTA a chunk), a per-token scalar with ``load_token_scalars``, index them with ``vec_at``
and keep a product as ``n_tile_accumulators``; ``round_tf32`` rounds tf32 operands to nearest, ``split_tf32``
splits one for 3xTF32 products.

**Chunk recurrences.** The KDA kernels that walk a sequence chunk by chunk with a ``[K, V]`` state (the forward's
state/output kernel, the time-parallel segment summary, the backward's recompute of the states and its
state-gradient recurrence) keep the state transposed, ``[V, K]`` fp32, as the accumulator of two consumer warpgroups
(64 V rows each), fed by one TMA producer warp through a ``PipelineTmaAsync`` of one chunk's tiles a stage. A token
tile ``[BT, D]`` lands in shared memory in the layout of the WGMMA operand it is (``token_tile_b_k_major``: B of a
product with the state, N = BT; ``token_tile_b_mn_major``: B of an update of the state, N = K;
``token_tile_a_m_major``: A read M-major, or a tile read in the accumulator layout), the chunk's last gate row as
``gate_row_layout``; ``token_rows`` / ``token_cols`` / ``state_view`` reorder the global tensors for those boxes and
for the transposed state. ``ChunkRecurrenceResources`` holds the warp layout, the register split, the stage check
and the two tiled MMAs every such kernel has (products with the state, updates of it); ``recurrence_pipeline`` makes
the pipeline and ``load_chunk_tiles`` is the producer warp's loop over it; ``column_decay`` / ``decay_columns``
scale the state's K columns by ``exp2`` of the gate row; ``gemm_k_blocks`` issues one product's K-block WGMMAs.

**State boxes.** A decode CTA that works on ``[K, tile_v]`` of one (pool row, head) state moves it with one TMA load
into shared memory and one TMA store back. ``state_box_atoms`` builds the two TMA atoms over a ``[P, HV, K, V]``
pool viewed as ``(V, K, HV, P)``, ``box_partition`` cuts the box of one (head, pool row) out of it; the kernels own
the shared-memory layout (swizzled or not).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from cula.ops._host import ROW_FACTORS

__all__ = [
    "FIRST_NAMED_BARRIER", "SMEM_BYTES_SM90", "ChunkRecurrenceResources", "acc_as_a_frag", "box_barrier_init",
    "box_load", "box_partition", "box_store", "bulk_row_copy", "bulk_token_rows", "chunk_rows", "column_decay",
    "cp_async_token_rows", "decay_columns", "factor_rows_layout", "gate_row_layout", "gemm_k_blocks",
    "load_column_decay", "load_row_factors", "load_token_scalars", "load_chunk_tiles", "n_tile_accumulators",
    "prefetch_token_rows", "recurrence_pipeline", "round_tf32", "scale_token_columns", "state_box_atoms",
    "state_view", "token_cols", "token_rows", "token_tile_a_m_major", "token_tile_b_k_major",
    "token_tile_b_mn_major", "vec_at",
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
def round_tf32(x: Float32) -> Float32:
    """x rounded to tf32's 10 mantissa bits (to nearest, ties away from zero), still as fp32: mma.sync drops the
    low 13 bits, so adding half of their range first rounds instead of truncating (FLA's tf32 dots round)."""
    return (x.bitcast(Int32) + Int32(0x1000)).bitcast(Float32)


@cute.jit
def split_tf32(x: Float32):
    """x as ``hi + lo``, both tf32 values (``hi`` rounded, its low 13 bits cleared; ``lo`` the remainder rounded):
    the three tf32 products ``hi hi' + hi lo' + lo hi'`` carry about fp32's precision (3xTF32)."""
    hi = ((x.bitcast(Int32) + Int32(0x1000)) & Int32(-0x2000)).bitcast(Float32)
    return hi, round_tf32(x - hi)


@cute.jit
def chunk_rows(varlen: bool, mCu: cute.Tensor, mCi: cute.Tensor, bx, bz, seqlen, BT: int):
    """``(tok0, valid)`` of the chunk a per-chunk CTA works on: its first token in the flattened ``[T_total]`` axis
    and its number of rows inside the sequence (<= 0 for a padding row of a device-built chunk list). Packed
    (``varlen``): chunk-list row ``bx`` = (sequence, chunk) over ``cu_seqlens``; fixed: chunk ``bx`` of sequence
    ``bz`` of ``seqlen`` tokens."""
    if cutlass.const_expr(varlen):
        n = mCi[bx, 0]
        c = mCi[bx, 1]
        bos = mCu[n]
        seq_len = mCu[n + 1] - bos
    else:
        c = bx
        bos = bz * seqlen
        seq_len = seqlen
    return bos + c * BT, cutlass.min(seq_len - c * BT, BT)


@cute.jit
def vec_at(t_: cute.Tensor, crd, divby: int = 8, n: int = 8) -> cute.Tensor:
    """The n (8) elements at and after ``crd`` in memory, for tensors whose n-element runs are contiguous there
    (``divby``: the offset's known divisibility, which sets the access width)."""
    return cute.make_tensor(
        t_.iterator + cute.assume(cute.crd2idx(crd, t_.layout), divby=divby), cute.make_layout(n)
    )


@cute.jit
def n_tile_accumulators(tiled_mma, n: int) -> list:
    """``n`` zeroed ``[16 x 8]`` fp32 accumulators of a warp's ``mma.sync``: the n-tiles of a ``[16 x 8n]`` product,
    one tensor each, so that an n-tile's B fragment can be built just before its MMA."""
    accs = []
    for _ in cutlass.range_constexpr(n):
        acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((16, 8)), Float32)
        acc.fill(0.0)
        accs.append(acc)
    return accs


@cute.jit
def cp_async_token_rows(atom: cute.CopyAtom, tiles, tok0, valid, tidx, rows: int = 64, row_units: int = 16,
                        unit: int = 8, threads: int = 256):  # fmt: skip
    """16-byte ``cp.async`` copies of ``rows`` token rows, ``tiles`` a tuple of ``(source (T, heads, width),
    destination (rows, width) in shared memory, head)`` whose rows are ``row_units`` units of ``unit`` elements
    (16-bit rows of 128 by default; fp32 rows of 128: 32 units of 4): ``threads`` threads, a unit each, rows at and
    past ``valid`` zero-filled instead."""
    col = cute.assume((tidx % row_units) * unit, divby=unit)
    per_pass = threads // row_units
    for m in cutlass.range_constexpr(rows // per_pass):
        t = tidx // row_units + per_pass * m
        for src, dst, head in tiles:
            if t < valid:
                cute.copy(atom, vec_at(src, (tok0 + t, head, col), unit, unit), vec_at(dst, (t, col), unit, unit))
            else:
                vec_at(dst, (t, col), unit, unit).fill(0.0)


def _token_row_bytes(tiles) -> int:
    """Bytes a token brings in across ``tiles`` (``(source (T, heads, width), destination, head)`` tuples) when
    each tile's row is ``width`` elements: what :func:`bulk_token_rows` arms its mbarrier with per valid row."""
    return sum(dst.shape[1] * src.element_type.width // 8 for src, dst, _ in tiles)


@cute.jit
def bulk_row_copy(src: cute.Tensor, dst: cute.Tensor, bar):
    """One ``cp.async.bulk`` of the contiguous run ``src`` (16-byte aligned at both ends, a multiple of 16 bytes)
    into ``dst``, completing its bytes on the mbarrier ``bar``. Issued by the calling thread alone."""
    atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), src.element_type,
                               num_bits_per_copy=cute.size(src) * src.element_type.width)  # fmt: skip
    cute.copy(atom, src, dst, mbar_ptr=bar)


@cute.jit
def bulk_token_rows(tiles, tok0, valid, tidx, bar, rows: int = 64, threads: int = 256):
    """A chunk's ``rows`` token rows of each of ``tiles`` (``(source (T, heads, width), destination (rows, width)
    in shared memory with 16-byte aligned rows, head)``) into shared memory, a thread a row (tile j's rows by
    threads ``(j rows) % threads`` on, the tiles past ``threads / rows`` on a second pass): rows before ``valid``
    by one bulk copy each, completing on ``bar``, the rest zero-filled by plain stores. Thread 0 arms ``bar``
    (one arrival) with ``max(valid, 0) * _token_row_bytes(tiles)``; wait on it, then a CTA barrier for the zero
    rows. The copies go through the TMA unit, where 16-byte ``cp.async`` copies (:func:`cp_async_token_rows`) take
    the load/store unit's issue slots, one a thread per 16 bytes."""
    if tidx == 0:  # a padding row of a device-built chunk list has valid <= 0: no bytes
        cute.arch.mbarrier_arrive_and_expect_tx(bar, cutlass.max(valid, 0) * _token_row_bytes(tiles))
    for j, (src, dst, head) in enumerate(tiles):
        t = tidx - (j * rows) % threads
        if t >= 0 and t < rows:
            width = dst.shape[1]
            row = vec_at(dst, (t, 0), 128 // dst.element_type.width, width)
            if t < valid:
                bulk_row_copy(vec_at(src, (tok0 + t, head, 0), 128 // src.element_type.width, width), row, bar)
            else:
                row.fill(0.0)


@cute.jit
def prefetch_token_rows(tiles, tok0, valid, tidx, rows: int = 64):
    """Each ``(source (T, heads, width), head)`` tile's token rows ``tok0 + t`` (t < ``valid``) pulled into L2, thread
    ``i`` taking row ``i % rows`` of tile ``i // rows`` (one ``prefetch.global.L2`` a 128-byte line): for rows a kernel
    reads from global memory long after its start, so that the read then waits for L2, not DRAM."""
    from cutlass.experimental.primitives.nvvm_wrapper import prefetch_l2

    for i, (src, head) in enumerate(tiles):
        t = tidx - rows * i
        if t >= 0 and t < rows and t < valid:
            per_line = 1024 // src.element_type.width  # elements a 128-byte line
            for line in cutlass.range_constexpr(src.shape[2] // per_line):
                prefetch_l2(vec_at(src, (tok0 + t, head, line * per_line), 16, 1).iterator)


@cute.jit
def load_token_scalars(src: cute.Tensor, dst: cute.Tensor, tok0, valid, head, tidx, rows: int = 64):
    """``dst[t] = src[tok0 + t, head]`` as fp32 for the chunk's ``rows`` rows (0 at and past ``valid``), by the
    first ``rows`` threads."""
    if tidx < rows:
        x = Float32(0.0)
        if tidx < valid:
            x = src[tok0 + tidx, head].to(Float32)
        dst[tidx] = x


# ------------------------------------------------------------------------------------------- chunk recurrences
def token_tile_b_k_major(dtype, num_stages: int, D: int = 128, BT: int = 64):
    """``(BT, D, S)``: a token tile as the B operand of a product with the state (N = BT, K-major)."""
    return sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (D, BT, D), dtype, num_stages)


def token_tile_b_mn_major(dtype, num_stages: int, D: int = 128, BT: int = 64):
    """``(D, BT, S)``: a token tile as the B operand of an update of the state (N = D, MN-major)."""
    return sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (D, D, BT), dtype, num_stages)


def token_major(tile: cute.Tensor) -> cute.Tensor:
    """The ``(token, feature, ...)`` view of a ``token_tile_b_mn_major`` tile ``(feature, token, ...)``: byte for byte
    the K-major operand layout (``S<3,4,3> o ((8,8),(64,2)):((64,512),(1,4096))`` is the MN-major one transposed), so
    one tile serves a product over its features as well (``tile``: the swizzle in its pointer)."""
    return cute.make_tensor(tile.iterator, cute.select(tile.layout, mode=[1, 0, *range(2, cute.rank(tile))]))


def token_tile_a_m_major(dtype, num_stages: int, D: int = 128, BT: int = 64):
    """``(D, BT, S)``: a token tile transposed, as an A operand read M-major or read in the accumulator layout."""
    return sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, (D, D, BT), dtype, num_stages)


def gate_row_layout(num_stages: int, D: int = 128):
    """``(D, 1, S)`` fp32: one gate row a stage."""
    return cute.make_layout((D, 1, num_stages), stride=(1, D, D))


def factor_rows_layout(num_stages: int, BT: int = 64):
    """``(BT, ROW_FACTORS, S)`` fp32: a chunk's factor rows a stage (``row_factors``), token-major as TMA lands them."""
    return cute.make_layout((BT, ROW_FACTORS, num_stages), stride=(ROW_FACTORS, 1, ROW_FACTORS * BT))


SMEM_BYTES_SM90 = 232448  # 227 KB of opt-in dynamic shared memory per CTA on H100/H200


class ChunkRecurrenceResources:
    """The resources every chunk-recurrence kernel has: one producer warpgroup (its first warp issues the TMA loads)
    and two consumer warpgroups, each owning 64 of the state's V rows (WGMMA M = 64 a warpgroup); 40 registers for
    the producer, 232 for the consumers (128 (40 + 2 232) = 64,512 of 65,536); ``num_stages`` pipeline stages of
    ``stage_bytes`` each, checked against shared memory."""

    num_consumer_wg = 2
    num_threads = 128 * (1 + num_consumer_wg)
    producer_regs, consumer_regs = 40, 232

    def _set_stages(self, num_stages: int, stage_bytes: int) -> None:
        if num_stages * stage_bytes + 1024 > SMEM_BYTES_SM90:
            raise ValueError(f"{num_stages} stages of {stage_bytes} B do not fit in shared memory")
        self.num_stages, self.stage_bytes = num_stages, stage_bytes

    def _state_product_mma(self, dtype, n: int):
        """``state^T (registers, bf16) . tile^T``: M = V over the consumer warpgroups, N = ``n`` token rows or
        columns, the token tile K-major (``token_tile_b_k_major``)."""
        return sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, OperandMajorMode.K, OperandMajorMode.K, Float32, (self.num_consumer_wg, 1, 1),
            tiler_mn=(64, n), a_source=warpgroup.OperandSource.RMEM,
        )  # fmt: skip

    def _state_update_mma(self, dtype, n: int = 128):
        """``(token-by-V fragment, registers)^T . tile``: M = V, N = ``n`` = K, the token tile MN-major
        (``token_tile_b_mn_major``)."""
        return sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32, (self.num_consumer_wg, 1, 1),
            tiler_mn=(64, n), a_source=warpgroup.OperandSource.RMEM,
        )  # fmt: skip


def token_rows(t: cute.Tensor) -> cute.Tensor:
    """``(T, HV, D)`` as ``(T, D, HV)``: a token tile's rows for a K-major TMA box (``token_tile_b_k_major``)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[0, 2, 1]))


def token_cols(t: cute.Tensor) -> cute.Tensor:
    """``(T, HV, D)`` as ``(D, T, HV)``: a token tile transposed, for MN-major boxes and the accumulator layout."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 0, 1]))


def chunk_tiles(atom: cute.CopyAtom, t: cute.Tensor, s: cute.Tensor, h, bos, tile: tuple, tokens_first: bool):
    """The producer's TMA partitions of value head ``h``'s chunk tiles of ``t`` (a TMA tensor over a
    ``token_rows`` view when ``tokens_first``, else over a ``token_cols`` view), tokens counted from ``bos``:
    ``(smem, gmem)``, stage ``i`` at ``smem[None, i]`` and token tile ``c`` at ``gmem[None, c]``."""
    at, tiles = ((bos, 0), (None, 0)) if tokens_first else ((0, bos), (0, None))
    g = cute.local_tile(cute.domain_offset(at, t[None, None, h]), tile, tiles)
    one = cute.make_layout(1)
    return cpasync.tma_partition(atom, 0, one, cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2))


@cute.jit
def load_chunk_tiles(pipe, num_stages: int, tiles, gate_row, h, bos, seq_len, num_chunks, last_first: bool = False,
                     BT: int = 64):  # fmt: skip
    """The TMA producer warp of a chunk recurrence: per chunk (in order, or ``last_first``) each of ``tiles`` and the
    decay row (g at the chunk's last valid token) into the next of ``num_stages`` pipeline stages. ``tiles``: ``(atom,
    TMA tensor, shared tiles, tile shape, tokens_first)`` as ``chunk_tiles`` takes them, issued in that order, of
    head ``h`` (or of the head a sixth entry gives: a q / k head of a value head's group); ``gate_row``: the decay
    row's ``(atom, TMA tensor, shared rows)`` (``gate_row_layout``), or None where a tile carries the decay."""
    parts = [chunk_tiles(e[0], e[1], e[2], e[5] if len(e) > 5 else h, bos, e[3], e[4]) for e in tiles]
    if const_expr(gate_row is not None):
        g_atom, g_t, g_s = gate_row
        tGs, tGg = chunk_tiles(g_atom, g_t, g_s, h, bos, (g_s.shape[0], 1), tokens_first=False)
    st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, num_stages)
    for i in cutlass.range(num_chunks, unroll=1):
        c = num_chunks - 1 - i if last_first else i
        pipe.producer_acquire(st)
        bar = pipe.producer_get_barrier(st)
        for (atom, *_), (ts, tg) in zip(tiles, parts):
            cute.copy(atom, tg[None, c], ts[None, st.index], tma_bar_ptr=bar)
        if const_expr(gate_row is not None):
            last = cutlass.min(c * BT + BT, seq_len) - 1
            cute.copy(g_atom, tGg[None, last], tGs[None, st.index], tma_bar_ptr=bar)
        pipe.producer_commit(st)
        st.advance()
    pipe.producer_tail(st)


def state_view(t: cute.Tensor, state_v_first: bool) -> cute.Tensor:
    """``(N, HV, K, V)`` (or ``(N, HV, V, K)`` with ``state_v_first``) as ``(V, K, HV, N)``: the transposed state
    the consumer warpgroups hold."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0] if state_v_first else [3, 2, 1, 0]))


def recurrence_pipeline(barrier_ptr, num_stages: int, num_consumer_wg: int, tx_count: int):
    """The producer-warp -> consumer-warpgroups pipeline: one thread commits a stage's TMA bytes, every consumer
    warp releases it (lane 0, no clusters)."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barrier_ptr,
        num_stages=num_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * num_consumer_wg),
        tx_count=tx_count,
    )


def column_decay(acc: cute.Tensor) -> cute.Tensor:
    """Registers for the decay factors of the state accumulator ``acc`` ``((2, 2, K/8), 1, 1)`` (column pair, row
    + 8, column block of 8): a factor depends on the K column only, so a thread needs ``2 K/8`` of them."""
    assert cute.rank(acc.shape[0]) == 3 and cute.size(acc.shape[0][1]) == 2
    assert cute.size(acc.shape[1]) == 1 and cute.size(acc.shape[2]) == 1
    return cute.make_rmem_tensor(2 * cute.size(acc.shape[0][2]), Float32)


# The helpers below are plain Python, traced inline into the calling kernel: their loops unroll at trace time.
def load_column_decay(rD: cute.Tensor, sG: cute.Tensor, tScS: cute.Tensor, stage) -> None:
    """``rD`` = ``exp2`` of the gate row of ``stage`` at this thread's columns (``tScS``: the accumulator's
    (v, k) coordinates)."""
    for j in range(cute.size(rD)):
        rD[j] = cute.math.exp2(sG[tScS[(j % 2, 0, j // 2), 0, 0][1], 0, stage], fastmath=True)


def load_u_and_row_mask(tUsU: cute.Tensor, stage, pV: cute.Tensor, tVcV: cute.Tensor, valid):
    """``u^T`` of ``stage`` (this thread's part, from shared memory) into registers, and ``pV``: which of this
    thread's v_new elements lie on token rows before ``valid`` (``tVcV``: their (v, token) coordinates; v_new is
    forced to 0 past a chunk's end)."""
    rU = tUsU[None, None, None, stage].load()
    for i in range(cute.size(pV)):
        pV[i] = tVcV[i][1] < valid
    return rU


def decay_columns(acc: cute.Tensor, rD: cute.Tensor) -> None:
    """Scale the accumulator's K columns by ``rD`` (after the WGMMAs reading it have retired: ptxas serialises
    WGMMAs whose accumulator registers change while they run)."""
    for i in range(cute.size(acc)):
        acc[i] = acc[i] * rD[(i % 2) + 2 * (i // 4)]


def load_row_factors(rKf: cute.Tensor, sF: cute.Tensor, tVcV: cute.Tensor, stage, valid, rQf=None, scale=None):
    """Gated DeltaNet's ``row_factors``: this thread's token columns' factors of ``stage``'s rows (``sF``
    ``[BT, ROW_FACTORS, S]``, the intra kernel's ``f_q, f_k, f_g``) into ``rKf`` and (times ``scale``) ``rQf``,
    both 0 past the sequence end (``valid`` rows), so that v_new's zeros there stay zeros whatever the rows hold;
    returns the chunk's decay ``exp2(g_last)``, the last valid row's ``f_g``. ``tVcV``: the ``(v, t)`` coordinates of
    a token-column accumulator ``((2, 2, BT/8), 1, 1)``; ``rKf``, ``rQf`` its ``column_decay`` registers."""
    load_token_factors(rKf, sF, tVcV, stage, valid, 1)
    if rQf is not None:
        load_token_factors(rQf, sF, tVcV, stage, valid, 0, scale)
    return sF[valid - 1, 2, stage]


def wy_v_new_product(mma, accV, tVrV, tTb, rU, pV, rF, sF, tVcV, stage, valid, dtype, u_weight=None) -> None:
    """``wy_in_recurrence``'s v_new (Gated DeltaNet): with ``accV`` = ``(k S)^T`` (a product on the raw k, retired),
    issues and commits ``v_new^T = bf16(x^T) (T diag(beta))^T`` into ``accV`` for ``x = u_weight v - f_x o k S``
    (the factor rows' ``f_x`` through ``rF``'s registers; 0 past the end), ``tVrV`` taking bf16(x^T) as the A
    operand. Once it is waited for, the caller clears the token columns past ``valid`` with a select, not a product:
    the stage's T diag(beta) tile ``tTb`` (B, K-major) may hold anything in its rows there, even never written."""
    load_token_factors(rF, sF, tVcV, stage, valid, 3)
    scale_token_columns(accV, rF)
    v = rU.to(Float32) if u_weight is None else rU.to(Float32) * u_weight
    tVrV.store(cute.where(pV.load(), v - accV.load(), 0.0).to(dtype))
    warpgroup.fence()
    gemm_k_blocks(mma, accV, tVrV, tTb, accumulate=False, b_stage=stage)
    warpgroup.commit_group()


def load_token_factors(rF: cute.Tensor, sF: cute.Tensor, tVcV: cute.Tensor, stage, valid, slot: int, scale=None):
    """Entry ``slot`` of this thread's token columns' factor rows (times ``scale``) into ``rF``, 0 past the
    sequence end (see ``load_row_factors``)."""
    for j in range(cute.size(rF)):
        t = tVcV[(j % 2, 0, j // 2), 0, 0][1]
        f = sF[t, slot, stage] if scale is None else sF[t, slot, stage] * scale
        rF[j] = Float32(cutlass.select_(t < valid, f, Float32(0.0)))


def scale_token_columns(acc: cute.Tensor, rF: cute.Tensor) -> None:
    """Scale a token-column accumulator ``((2, 2, BT/8), 1, 1)``'s columns by ``rF`` (``load_row_factors``)."""
    for i in range(cute.size(acc)):
        acc[i] = acc[i] * rF[(i % 2) + 2 * (i // 4)]


def gemm_k_blocks(tiled_mma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor, accumulate: bool, a_stage=None,
                  b_stage=None) -> None:
    """One product's WGMMAs over the K blocks of ``a`` ``(MMA, M, KB[, S])`` and ``b`` ``(MMA, N, KB[, S])`` into
    ``acc`` (overwritten first unless ``accumulate``), at pipeline stage ``a_stage`` / ``b_stage`` of an operand in
    shared memory; the caller fences, commits and waits."""
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, accumulate)
    for kb in range(cute.size(a, mode=[2])):
        a_kb = a[None, None, kb] if a_stage is None else a[None, None, kb, a_stage]
        b_kb = b[None, None, kb] if b_stage is None else b[None, None, kb, b_stage]
        cute.gemm(atom, acc, a_kb, b_kb, acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)


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
