"""KDA chunk recurrence on SM90, the states alone: FLA's ``chunk_gated_delta_rule_fwd_h`` as the training backward's
recompute calls it (every chunk's state h and v_new; no output).

Replaces FLA 0.6.0's ``chunk_gated_delta_rule_fwd_h`` (``fla/ops/common/chunk_delta_h.py``) with KDA's arguments
(``k = kg``, ``gk = g_cum``, ``save_new_value``). Per (sequence n, value head h) one CTA walks the chunks of BT = 64
tokens with the state in fp32 registers. Per chunk c, with ``S`` the ``[K, V]`` state before it::

    h[c]  = bf16(S)                                            # stored
    v_new = u - w @ bf16(S)                                    # stored in bf16; rows past the sequence end -> 0
    S     = diag(exp2(g[last])) S + kg^T @ bf16(v_new)

The products are ``DeltaHFwdOFusedSm90``'s GEMM1 and GEMM4 with the same operands and rounding points, so h and
v_new are the bits ``DeltaHFwdOStatesSm90`` writes beside o, and FLA's (``h`` bf16 of the fp32 state, ``v_new`` bf16
of ``u - w bf16(S)``) to fp32 summation order.

Layout in the kernel: the state transposed, ``S^T`` fp32 ``[V, K]``, as the WGMMA accumulator of two consumer
warpgroups (64 V rows each, independent recurrences that never meet)::

    GEMM1  v^T  = bf16(S^T) . w^T       M=V  N=BT K=K   B = w  tile [BT, K], K-major
    GEMM4  S^T += bf16(v_new^T) . kg    M=V  N=K  K=BT  B = kg tile [BT, K], MN-major

Stores, none on the chain: ``bf16(S^T)``, GEMM1's A operand, goes by ``stmatrix`` (transposed for the ``[K, V]``
layout) into one of two staging buffers and leaves by one TMA store per warpgroup (64 V rows x K); ``v_new^T`` of a
full chunk by transposed ``stmatrix`` into the warpgroup's half of the stage's u tile (u is dead once v_new is
built) and one TMA store; a partial chunk's v_new by row-predicated direct stores (a TMA box would write the next
sequence's rows). Both stores of a chunk are issued by the warpgroup's first thread after a warpgroup barrier; at the
next chunk that thread waits until they have read shared memory, then its warp releases the stage (one chunk late)
and the barrier of that chunk tells the warpgroup that the other h buffer, written next, is free.

Warp roles (384 threads, ``min_blocks_per_mp=1``):

=========  =========  =====================================================================================
warps      registers  role
=========  =========  =====================================================================================
0          40         ``load_chunk_tiles``, the TMA producer: per chunk w, u, kg and the last valid g row
1-3        40         idle
4-11       232        ``_recurrence``, two consumer warpgroups: GEMM1, v_new, decay, GEMM4, the stores
=========  =========  =====================================================================================

One ``PipelineTmaAsync`` of ``num_stages`` slots (3: 48.5 KB each) joins producer and consumers; with the two 32 KB h
buffers, 210 KB of shared memory.

Floor: it reads w, u, kg (3 x 256 B per token and value head) and a g row per chunk, and writes h (512 B per token
and value head, a 32 KB state per 64-token chunk) and v_new (256 B): 1,536 B per token and value head. The chain of a
chunk (GEMM1, v_new, GEMM4) is what a call with few (sequence, head) pairs waits on.

Supported: K = V = 128, BT = 64, bf16 / fp16 w / u / kg, both state layouts, varlen (``cu_seqlens`` int32; each
sequence's first chunk in h from ``chunk_offsets``), initial and final state.
"""

from __future__ import annotations

import enum

import cuda.bindings.driver as cuda
import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float16, Float32, Int32, const_expr, cute, pipeline
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from cula.cache import compile_options
from cula.ops._host import dsl_type
from cula.ops.cute_common import (
    FIRST_NAMED_BARRIER, SMEM_BYTES_SM90, ChunkRecurrenceResources, acc_as_a_frag, column_decay, decay_columns,
    gate_row_layout, gemm_k_blocks, load_chunk_tiles, load_column_decay, load_u_and_row_mask, recurrence_pipeline,
    state_view, token_cols, token_rows, token_tile_a_m_major, token_tile_b_k_major, token_tile_b_mn_major,
)  # fmt: skip

__all__ = ["DeltaHStatesSm90"]


class Barrier(enum.IntEnum):
    """Named barriers (0 is the CTA-wide one)."""

    WARPGROUP0 = FIRST_NAMED_BARRIER  # one consumer warpgroup: its h and v_new are staged for the TMA stores
    WARPGROUP1 = FIRST_NAMED_BARRIER + 1


class DeltaHStatesSm90(ChunkRecurrenceResources):
    """KDA's state recurrence storing every chunk's state and v_new (FLA's ``chunk_gated_delta_rule_fwd_h``), sm_90a.

    Static configuration: the dtype of w / u / kg / h / v_new, K = V = 128, chunk size 64, pipeline depth, and four
    trace flags (varlen, initial state, final state, state layout). Token counts, heads and sequences are runtime
    values.
    """

    arch = 90

    def __init__(self, dtype=BFloat16, head_k: int = 128, head_v: int = 128, chunk_size: int = 64,
                 num_stages: int = 3, varlen: bool = False, has_initial_state: bool = False,
                 has_final_state: bool = False, state_v_first: bool = False):  # fmt: skip
        if head_k != 128 or head_v != 128:
            raise ValueError(f"only K = V = 128 is implemented, got K={head_k}, V={head_v}")
        if chunk_size != 64:
            raise ValueError(f"only chunk_size 64 is implemented, got {chunk_size}")
        if dtype not in (BFloat16, Float16):
            raise ValueError(f"dtype must be BFloat16 or Float16, got {dtype}")
        if num_stages < 2:  # a stage is released a chunk late (after its v_new store has read it)
            raise ValueError(f"num_stages must be at least 2, got {num_stages}")
        self.dtype = dtype
        self.dk, self.dv, self.bt = head_k, head_v, chunk_size
        self.varlen, self.has_h0, self.has_ht = varlen, has_initial_state, has_final_state
        self.state_v_first = state_v_first
        elt = dtype.width // 8
        stage_bytes = 3 * self.bt * self.dk * elt + self.dk * 4
        self.h_bytes = 2 * self.dv * self.dk * elt  # the two h staging buffers
        if num_stages * stage_bytes + self.h_bytes + 1024 > SMEM_BYTES_SM90:
            raise ValueError(f"{num_stages} stages of {stage_bytes} B and the h buffers do not fit in shared memory")
        self._set_stages(num_stages, stage_bytes)

    @cute.jit
    def __call__(
        self,
        mW: cute.Tensor,  # (T_total, HV, K)  dtype
        mU: cute.Tensor,  # (T_total, HV, V)  dtype
        mKg: cute.Tensor,  # (T_total, HV, K)  dtype
        mG: cute.Tensor,  # (T_total, HV, K)  fp32, chunk-local cumsum of the log2 gate
        mH0: cute.Tensor,  # (N, HV, K, V) or (N, HV, V, K) fp32; unread unless has_initial_state
        mHt: cute.Tensor,  # same layout as mH0; unwritten unless has_final_state
        mH: cute.Tensor,  # (chunks, HV, K, V) or (chunks, HV, V, K) dtype, out
        mVn: cute.Tensor,  # (T_total, HV, V) dtype, out
        mCu: cute.Tensor,  # (N + 1,) int32 cu_seqlens; unread unless varlen
        mChunks: cute.Tensor,  # (N + 1,) int32, each sequence's first chunk in mH; unread unless varlen
        seqlen: Int32,  # tokens per sequence when not varlen (T_total = N * seqlen)
        num_seqs: Int32,  # N
        stream: cuda.CUstream,
    ):
        dt, BT, DK, DV, S = self.dtype, self.bt, self.dk, self.dv, self.num_stages
        w_v = token_rows(mW)  # (T, K, HV)
        k_v = token_cols(mKg)  # (K, T, HV)
        u_v = token_cols(mU)  # (V, T, HV)
        g_v = token_cols(mG)  # (K, T, HV)
        vn_v = token_cols(mVn)  # (V, T, HV)
        h0_v = state_view(mH0, self.state_v_first)  # (V, K, HV, N)
        ht_v = state_view(mHt, self.state_v_first)
        h_v = state_view(mH, self.state_v_first)  # (V, K, HV, chunks)

        mma_v = self._state_product_mma(dt, BT)
        mma_s = self._state_update_mma(dt, DK)

        sW_l = token_tile_b_k_major(dt, S)
        sK_l, sU_l, sG_l = token_tile_b_mn_major(dt, S), token_tile_a_m_major(dt, S), gate_row_layout(S)
        # bf16(S^T) staged (V, K, 2 buffers): V contiguous for the [K, V] layout, K for [V, K]
        h_major = LayoutEnum.ROW_MAJOR if self.state_v_first else LayoutEnum.COL_MAJOR
        sH_l = sm90_utils.make_smem_layout_a(h_major, (DV, DK, DK), dt, 2)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_w, tw = cpasync.make_tiled_tma_atom(g2s, w_v, cute.select(sW_l, mode=[0, 1]), (BT, DK))
        tma_k, tk = cpasync.make_tiled_tma_atom(g2s, k_v, cute.select(sK_l, mode=[0, 1]), (DK, BT))
        tma_u, tu = cpasync.make_tiled_tma_atom(g2s, u_v, cute.select(sU_l, mode=[0, 1]), (DV, BT))
        tma_g, tg = cpasync.make_tiled_tma_atom(g2s, g_v, cute.select(sG_l, mode=[0, 1]), (DK, 1))
        # a consumer warpgroup's 64 V rows: of v_new^T (from its half of the stage's u tile) and of the state
        half = DV // self.num_consumer_wg
        s2g = cpasync.CopyBulkTensorTileS2GOp()
        sVh_l = sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, (half, DK, BT), dt, 1)
        tma_vn, tvn = cpasync.make_tiled_tma_atom(s2g, vn_v, cute.select(sVh_l, mode=[0, 1]), (half, BT))
        sHh_l = sm90_utils.make_smem_layout_a(h_major, (half, DK, DK), dt, 1)
        tma_h, th = cpasync.make_tiled_tma_atom(s2g, h_v, cute.select(sHh_l, mode=[0, 1]), (half, DK))

        @cute.struct
        class Storage:
            mbar: cute.struct.MemRange[cutlass.Int64, S * 2]
            sW: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sW_l)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_l)], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sU_l)], 1024]
            sH: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sH_l)], 1024]
            sG: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sG_l)], 128]

        self.storage = Storage
        HV = mW.shape[1]
        self.kernel(
            tma_w, tw, tma_k, tk, tma_u, tu, tma_g, tg, tma_vn, tvn, tma_h, th, vn_v, h0_v, ht_v, mCu, mChunks,
            seqlen, mma_v, mma_s, sW_l, sK_l, sU_l, sG_l, sH_l,
        ).launch(grid=(HV, num_seqs, 1), block=(self.num_threads, 1, 1), stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(
        self,
        tma_w: cute.CopyAtom, tw: cute.Tensor,
        tma_k: cute.CopyAtom, tk: cute.Tensor,
        tma_u: cute.CopyAtom, tu: cute.Tensor,
        tma_g: cute.CopyAtom, tg: cute.Tensor,
        tma_vn: cute.CopyAtom, tvn: cute.Tensor,
        tma_h: cute.CopyAtom, th: cute.Tensor,
        vn_v: cute.Tensor, h0_v: cute.Tensor, ht_v: cute.Tensor, mCu: cute.Tensor, mChunks: cute.Tensor,
        seqlen: Int32,
        mma_v: cute.TiledMma, mma_s: cute.TiledMma,
        sW_l: cute.ComposedLayout, sK_l: cute.ComposedLayout, sU_l: cute.ComposedLayout, sG_l: cute.Layout,
        sH_l: cute.ComposedLayout,
    ):  # fmt: skip
        BT, S = self.bt, self.num_stages
        tidx, _, _ = cute.arch.thread_idx()
        h, n, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if warp_idx == 0:
            for atom in (tma_w, tma_k, tma_u, tma_g):
                cpasync.prefetch_descriptor(atom)

        if const_expr(self.varlen):
            bos = mCu[n]
            seq_len = mCu[n + 1] - bos
            first_chunk = mChunks[n]
        else:
            bos = n * seqlen
            seq_len = seqlen
            first_chunk = n * ((seqlen + BT - 1) // BT)
        num_chunks = (seq_len + BT - 1) // BT

        storage = SmemAllocator().allocate(self.storage)
        pipe = recurrence_pipeline(storage.mbar.data_ptr(), S, self.num_consumer_wg, self.stage_bytes)
        sW = storage.sW.get_tensor(sW_l.outer, swizzle=sW_l.inner)
        sK = storage.sK.get_tensor(sK_l.outer, swizzle=sK_l.inner)
        sU = storage.sU.get_tensor(sU_l.outer, swizzle=sU_l.inner)
        sH = storage.sH.get_tensor(sH_l.outer, swizzle=sH_l.inner)
        sG = storage.sG.get_tensor(sG_l)

        if wg_idx == 0:  # ------------------------------ producer ------------------------------
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:  # whole warp: TMA issue and expect_tx are elect_one'd inside
                load_chunk_tiles(
                    pipe, S, ((tma_w, tw, sW, (self.bt, self.dk), True), (tma_k, tk, sK, (self.dk, self.bt), False),
                              (tma_u, tu, sU, (self.dv, self.bt), False)),
                    (tma_g, tg, sG), h, bos, seq_len, num_chunks,
                )  # fmt: skip
        else:  # ------------------------------ consumers ------------------------------
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self._recurrence(
                pipe, tidx, wg_idx, h, n, bos, seq_len, num_chunks, first_chunk, mma_v, mma_s, sW, sK, sU, sH, sG,
                tma_vn, tvn, tma_h, th, vn_v, h0_v, ht_v,
            )  # fmt: skip

    @cute.jit
    def _recurrence(
        self, pipe, tidx, wg_idx, h, n, bos, seq_len, num_chunks, first_chunk, mma_v, mma_s, sW, sK, sU, sH, sG,
        tma_vn, tvn, tma_h, th, vn_v, h0_v, ht_v,
    ):  # fmt: skip
        """Consumers (two warpgroups, 64 V rows each): S^T in registers chunk by chunk (h[c] out, GEMM1 w S, v_new
        out, decay, GEMM4), the final state at the end."""
        BT, DK, DV, S = self.bt, self.dk, self.dv, self.num_stages
        ctid = tidx - 128
        me = wg_idx - 1
        half = DV // self.num_consumer_wg
        wg_first = cute.make_layout(self.num_consumer_wg, stride=128)(me)
        wg_v, wg_s = mma_v.get_slice(wg_first), mma_s.get_slice(wg_first)
        thr_v, thr_s = mma_v.get_slice(ctid), mma_s.get_slice(ctid)

        accS = cute.make_rmem_tensor(wg_s.partition_shape_C((DV, DK)), Float32)  # S^T, fp32
        if const_expr(self.has_h0):
            accS.store(thr_s.partition_C(h0_v[None, None, h, n]).load())
        else:
            accS.fill(0.0)
        rS = cute.make_rmem_tensor(wg_s.partition_shape_C((DV, DK)), self.dtype)  # bf16(S^T): h[c], GEMM1's A
        tVrS = wg_v.make_fragment_A(wg_v.partition_shape_A((DV, DK)))
        tVrV = wg_v.make_fragment_A(wg_v.partition_shape_A((DV, BT)))  # bf16(v_new^T), GEMM4's A (RS)
        tVrW = wg_v.make_fragment_B(wg_v.partition_B(sW))
        tSrK = wg_s.make_fragment_B(wg_s.partition_B(sK))
        accV = cute.make_rmem_tensor(wg_v.partition_shape_C((DV, BT)), Float32)
        rVn = cute.make_rmem_tensor(wg_v.partition_shape_C((DV, BT)), self.dtype)
        pV = cute.make_rmem_tensor(wg_v.partition_shape_C((DV, BT)), cutlass.Boolean)
        rD = column_decay(accS)
        tUsU = thr_v.partition_C(sU)  # (MMA, MMA_M, MMA_N, S) u^T in the accumulator layout
        tVcV = thr_v.partition_C(cute.make_identity_tensor((DV, BT)))  # (v, t) of each element
        tScS = thr_s.partition_C(cute.make_identity_tensor((DV, DK)))  # (v, k) of each element
        gVn = cute.local_tile(cute.domain_offset((0, bos), vn_v[None, None, h]), (DV, BT), (0, None))
        tVgVn = thr_v.partition_C(gVn)  # (MMA, MMA_M, MMA_N, NC): a partial chunk's direct stores

        # the stores: stmatrix into shared memory (transposed where the tile is V-contiguous), a TMA store each
        issuer = ctid % 128 == 0
        first_warp = (ctid % 128) < 32
        wg_bar = pipeline.NamedBarrier(barrier_id=Barrier.WARPGROUP0 + me, num_threads=128)
        st_h = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=not self.state_v_first, num_matrices=4), self.dtype),
            mma_s,
        )  # fmt: skip
        thr_sth = st_h.get_slice(ctid)
        tHsH = thr_sth.partition_D(sH)  # (CPY, CPY_M, CPY_N, 2)
        st_v = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype), mma_v
        )
        thr_stv = st_v.get_slice(ctid)
        tVsU = thr_stv.partition_D(sU)  # (CPY, CPY_M, CPY_N, S)
        sVh = cute.flat_divide(sU, (half, BT))[None, None, me, 0, None]  # (half, BT, S)
        gVh = cute.local_tile(cute.domain_offset((0, bos), tvn[None, None, h]), (half, BT), (me, None))
        tVs, tVg = cpasync.tma_partition(
            tma_vn, 0, cute.make_layout(1), cute.group_modes(sVh, 0, 2), cute.group_modes(gVh, 0, 2)
        )
        sHh = cute.flat_divide(sH, (half, DK))[None, None, me, 0, None]  # (half, DK, 2)

        st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, S)
        for c in cutlass.range(num_chunks, unroll=1):
            valid = cutlass.min(seq_len - c * BT, BT)
            si = st.index
            pipe.consumer_wait(st)
            rS.store(accS.load().to(self.dtype))
            tVrS.store(acc_as_a_frag(rS).load())
            warpgroup.fence()
            gemm_k_blocks(mma_v, accV, tVrS, tVrW, accumulate=False, b_stage=si)
            warpgroup.commit_group()
            if (c > 0) & first_warp:
                # the previous chunk's stores have read their buffers: its stage goes back (its v_new was staged
                # in the u tile) and, after this chunk's barrier, the h buffer this chunk does not write
                if issuer:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                prev = cutlass.select_(si == 0, S - 1, si - 1)
                pipe.consumer_release(pipeline.PipelineState(S, st.count, prev, st.phase))
            # h[c] while GEMM1 runs (its registers are only read)
            cute.copy(st_h, thr_sth.retile(rS), tHsH[None, None, None, c % 2])
            load_column_decay(rD, sG, tScS, si)
            rU = load_u_and_row_mask(tUsU, si, pV, tVcV, valid)
            warpgroup.wait_group(0)
            # decay after the wait: ptxas serialises WGMMAs whose accumulator changes while they run (C7517)
            decay_columns(accS, rD)
            rVn.store(cute.where(pV.load(), rU.to(Float32) - accV.load(), 0.0).to(self.dtype))
            tVrV.store(rVn.load())
            warpgroup.fence()
            gemm_k_blocks(mma_s, accS, tVrV, tSrK, accumulate=True, b_stage=si)
            warpgroup.commit_group()
            # v_new out while GEMM4 runs: a full chunk through the u tile, a partial one by direct stores
            if valid == BT:
                cute.copy(st_v, thr_stv.retile(rVn), tVsU[None, None, None, si])
            else:
                tVgVnc = tVgVn[None, None, None, c]
                for i in cutlass.range_constexpr(cute.size(rVn)):
                    if tVcV[i][1] < valid:
                        tVgVnc[i] = rVn[i]
            cute.arch.fence_view_async_shared()
            wg_bar.arrive_and_wait()
            if issuer:
                gH = cute.local_tile(th[None, None, h, first_chunk + c], (half, DK), (None, 0))  # (half, DK, 2)
                tHs, tHg = cpasync.tma_partition(
                    tma_h, 0, cute.make_layout(1), cute.group_modes(sHh, 0, 2), cute.group_modes(gH, 0, 2)
                )
                cute.copy(tma_h, tHs[None, c % 2], tHg[None, me])
                if valid == BT:
                    cute.copy(tma_vn, tVs[None, si], tVg[None, c])
                cute.arch.cp_async_bulk_commit_group()
            # the stage goes back once this warp's share of GEMM4 has read its kg tile (a warp's wait covers its
            # own share only); the first warp's waits for the stores too, at the next chunk
            warpgroup.wait_group(0)
            if not first_warp:
                pipe.consumer_release(st)
            st.advance()

        if (num_chunks > 0) & first_warp:  # the last chunk's deferred release, once its stores have read
            if issuer:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            prev = cutlass.select_(st.index == 0, S - 1, st.index - 1)
            pipe.consumer_release(pipeline.PipelineState(S, st.count, prev, st.phase))
        if const_expr(self.has_ht):
            thr_s.partition_C(ht_v[None, None, h, n]).store(accS.load())


def _compile(dtype, num_stages, varlen, has_h0, has_ht, state_v_first, arch=(9, 0), extra_options=""):
    """Trace and compile one variant against fake tensors (no GPU needed). Returns the TVM-FFI callable.

    ``extra_options`` is appended to the cute.compile options (tests use ``--keep-cubin --dump-dir D``).
    """
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    DK = DV = 128
    dtype = dsl_type(dtype)
    kernel = DeltaHStatesSm90(dtype=dtype, num_stages=num_stages, varlen=varlen, has_initial_state=has_h0,
                              has_final_state=has_ht, state_v_first=state_v_first)  # fmt: skip
    # 64-bit token and state strides (T_total * HV * D or chunks * HV * K * V may pass 2^31 elements), divisible as
    # TMA's 16-byte stride check needs
    tt, hv = cute.sym_int32(), cute.sym_int32()
    tok_stride = cute.sym_int64(divisibility=DK)

    def tok(dt):
        return make_fake_tensor(dt, (tt, hv, DK), (tok_stride, DK, 1), assumed_align=16)

    def state(dt=Float32):
        inner = (DV, DK) if state_v_first else (DK, DV)
        return make_fake_tensor(
            dt, (cute.sym_int32(), cute.sym_int32(), *inner),
            (cute.sym_int64(divisibility=DK * DV), DK * DV, inner[1], 1), assumed_align=16,
        )  # fmt: skip

    def cu():
        return make_fake_compact_tensor(Int32, (cute.sym_int32(),), stride_order=(0,), assumed_align=4)

    args = (tok(dtype), tok(dtype), tok(dtype), tok(Float32), state(), state(), state(dtype), tok(dtype), cu(), cu(),
            Int32(1), Int32(1), make_fake_stream(use_tvm_ffi_env_stream=True))  # fmt: skip
    return cute.compile(kernel, *args, options=compile_options(arch, extra_options))
