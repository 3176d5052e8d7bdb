"""KDA chunk forward, inter-chunk stage on SM90: the gated delta-rule state recurrence fused with the output.

Replaces FLA's ``chunk_gated_delta_rule_fwd_h`` + ``chunk_gla_fwd_o_gk`` (``fla/ops/common/chunk_delta_h.py``,
``fla/ops/gla/chunk.py``). Per (sequence n, value head h) one CTA walks the chunks of BT = 64 tokens with the
state in fp32 registers and never writes the per-chunk states ``h`` or ``v_new`` to memory. Per chunk c, with
``S`` the ``[K, V]`` state before the chunk (FLA's ``h[c]``)::

    v_new = u - w @ bf16(S)                                   # [BT, V]; rows past the sequence end -> 0
    o     = scale * qg @ bf16(S) + tril(Aqk) @ bf16(v_new)    # [BT, V]; tril keeps the diagonal
    S     = diag(exp2(g[last])) S + kg^T @ bf16(v_new)

where the inputs are what ``fla.ops.kda.chunk_intra.chunk_kda_fwd_intra(..., disable_recompute=True)`` returns:
``w = A_kk (beta k exp2(g))``, ``u = A_kk (beta v)``, ``qg = q exp2(g)``, ``kg = k exp2(g_last - g)`` (zero past the
sequence end), ``Aqk`` (already scaled; upper triangle unspecified, or 0 with ``aqk_causal``) and ``g`` the
chunk-local cumsum of the log gate in base 2 (FLA multiplies by RCP_LN2), ``g_last`` its last valid row in the
chunk. The rounding points (bf16 state copy for both products, bf16 v_new) are FLA's, so results match FLA to bf16
noise.

Layout in the kernel. The state is kept transposed, ``S^T`` fp32 ``[V, K]``, as the WGMMA accumulator of two
consumer warpgroups (each owns 64 of the 128 V rows), so every product with the state is an RS WGMMA with the
bf16 copy of ``S^T`` as the register A operand::

    GEMM1  v^T  = bf16(S^T) . w^T       M=V  N=BT K=K   B = w   tile [BT, K], K-major
    GEMM2  o^T  = bf16(S^T) . qg^T      M=V  N=BT K=K   B = qg  tile [BT, K], K-major
    GEMM3  o^T += bf16(v_new^T) . Aqk^T M=V  N=BT K=BT  B = Aqk tile [BT, BT], K-major (upper triangle zeroed)
    GEMM4  S^T += bf16(v_new^T) . kg    M=V  N=K  K=BT  B = kg  tile [BT, K], MN-major

The accumulator of GEMM1 becomes the A fragment of GEMM3/GEMM4 without leaving registers.

Gated DeltaNet (``row_factors``): the raw q and k of the value head's q / k head and per token the intra kernel's
factor rows (f_q, f_k, the decay f_g, f_x) make qg and kg: o^T's token columns times f_q (scale included), v_new^T's
times f_k before GEMM4, one decay for every column. With ``wy_in_recurrence`` as well, w and u are never written:
the stage's w tile holds the intra kernel's ``T diag(beta)`` ``[BT, BT]`` and its u tile the raw v, and::

    GEMM1  (k S)^T = bf16(S^T) . k^T     M=V  N=BT K=K   B = k   the MN-major k tile read K-major (same bytes)
    GEMM1b v_new^T = bf16(v - f_x o k S)^T . (T diag(beta))^T     M=V N=BT K=BT  (cute_common.wy_v_new_product)

one 64 x 128 x 64 product more a chunk on the state's chain (issued ahead of GEMM2, which is off the chain), 128
bytes a token and value head read where w and u were 512.

Warp roles (384 threads, ``min_blocks_per_mp=1``):

=========  =========  =====================================================================================
warps      registers  role
=========  =========  =====================================================================================
0          40         ``load_chunk_tiles``, the TMA producer: per chunk w, qg, u, kg, Aqk and the last valid g row
1-3        40         idle
4-11       232        ``_recurrence``, two consumer warpgroups: mask Aqk, four GEMMs, decay, o, initial/final state
=========  =========  =====================================================================================

One ``PipelineTmaAsync`` with ``num_stages`` slots (3 by default, 72 KB each) connects them: the full barrier
expects the bytes of all six copies, the empty barrier counts the 8 consumer warps. Inside a chunk the two
consumer warpgroups meet at one named barrier (the causal mask of the shared Aqk tile is written by both),
unless ``aqk_causal`` says the upper triangle arrives as zeros (cula's intra kernel writes them): then there is
no mask and no barrier, and the two warpgroups' recurrences run unsynchronised (H200: -22% kernel time with 64
CTAs at B1-T8192, -9% for 20 short sequences, -5% at B2-T16384), and a full chunk's o leaves by TMA (below).

Ragged ends. All tensors are passed flattened as ``[T_total, HV, D]``; a chunk is a TMA box starting at the
sequence start plus ``64 c``, so a box crossing the sequence end reads the next sequence (or TMA zeros at the
tensor end). Those rows are harmless: v_new rows past the end are zeroed before GEMM3/GEMM4, kg is multiplied by
them only, Aqk columns past the end only meet masked rows, and o rows past the end are not stored: a full chunk's
o goes out by one TMA store per consumer warpgroup (staged in the stage's u tile; direct stores without
``aqk_causal``), a partial one's by row-predicated direct stores.
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
from cula.ops._host import ROW_FACTORS, dsl_type
from cula.ops.cute_common import (
    FIRST_NAMED_BARRIER, ChunkRecurrenceResources, acc_as_a_frag, column_decay, decay_columns, factor_rows_layout,
    gate_row_layout, gemm_k_blocks, load_chunk_tiles, load_column_decay, load_row_factors, load_u_and_row_mask,
    recurrence_pipeline, scale_token_columns, state_view, token_cols, token_rows, token_tile_a_m_major,
    token_major, token_tile_b_k_major, token_tile_b_mn_major, wy_v_new_product,
)  # fmt: skip

__all__ = ["DeltaHFwdOFusedSm90", "DeltaHFwdOStatesSm90"]


class Barrier(enum.IntEnum):
    """Named barriers (0 is the CTA-wide one)."""

    MASK = FIRST_NAMED_BARRIER  # both consumer warpgroups: the causal mask of the shared Aqk tile is written
    WARPGROUP0 = FIRST_NAMED_BARRIER + 1  # one consumer warpgroup: its half of o is staged for the TMA store
    WARPGROUP1 = FIRST_NAMED_BARRIER + 2


class DeltaHFwdOFusedSm90(ChunkRecurrenceResources):
    """Fused KDA state recurrence (``chunk_gated_delta_rule_fwd_h``) + output (``chunk_gla_fwd_o_gk``), sm_90a.

    Static configuration: element dtype of w/u/kg/qg/Aqk/o, head sizes (K = V = 128), chunk size 64, pipeline
    depth, and four trace flags (varlen, initial state, final state, state layout). Sizes that vary per call
    (total tokens, heads, sequences) are runtime values.
    """

    arch = 90

    def __init__(
        self,
        dtype=BFloat16,
        head_k: int = 128,
        head_v: int = 128,
        chunk_size: int = 64,
        num_stages: int = 3,
        varlen: bool = False,
        has_initial_state: bool = False,
        has_final_state: bool = False,
        state_v_first: bool = False,
        aqk_causal: bool = False,
        store_states: bool = False,
        row_factors: bool = False,
        wy_in_recurrence: bool = False,
    ):
        if head_k != 128 or head_v != 128:
            raise ValueError(f"only K = V = 128 is implemented, got K={head_k}, V={head_v}")
        if chunk_size != 64:
            raise ValueError(f"only chunk_size 64 is implemented, got {chunk_size}")
        if dtype not in (BFloat16, Float16):
            raise ValueError(f"dtype must be BFloat16 or Float16, got {dtype}")
        self.dtype = dtype
        self.dk, self.dv, self.bt = head_k, head_v, chunk_size
        self.varlen = varlen
        self.has_h0 = has_initial_state
        self.has_ht = has_final_state
        self.state_v_first = state_v_first
        # Aqk's upper triangle arrives as zeros (cula's intra kernel writes them): no causal mask, and with it no
        # barrier between the consumer warpgroups, whose recurrences (64 V rows each) are otherwise independent
        self.aqk_causal = aqk_causal
        # also write what FLA's backward reads of the recurrence (``DeltaHFwdOStatesSm90``)
        self.store_states = store_states
        # one gate per token and value head (Gated DeltaNet): raw q and k of the value head's q / k head instead of
        # qg and kg, and per token the factors that make them (``cute_common.load_row_factors``)
        self.row_factors = row_factors
        if row_factors and (store_states or not aqk_causal):
            raise ValueError("row_factors reads cula's intra kernel's outputs (aqk_causal) and stores no states")
        # row_factors only: v_new = (T diag(beta)) bf16(v - f_x o (k S)) from the intra kernel's T diag(beta) (its
        # wy_in_recurrence variant; in mW's place, [T_total, HV, BT]) and the raw v (in mU's), where w and u were
        # read: one more product a chunk (64 x 128 x 64, the raw k tile read K-major for k S), 128 bytes a token
        # and value head read where w and u were 512 (and no w, u written before)
        self.wy_in_recurrence = wy_in_recurrence
        if wy_in_recurrence and not row_factors:
            raise ValueError("wy_in_recurrence scales k S by the factor rows' f_x: it needs row_factors")
        # (only _chunks_o_behind makes v_new from T diag(beta), and row_factors always takes that loop)
        assert not wy_in_recurrence or (aqk_causal and not store_states)
        # full chunks' o by stmatrix + TMA (see the consumer prologue); the masked variant keeps the direct stores:
        # with the mask's registers the staging spills (20-28 bytes)
        self.o_tma = aqk_causal
        # the consumers hold S^T (64 registers), its bf16 copy (32), two 64x64 accumulators (64), u (16) and the
        # bf16 v_new fragment (16) of their 232
        elt = dtype.width // 8
        row_bytes = self.bt * ROW_FACTORS * 4 if row_factors else self.dk * 4  # the factor rows, or the decay row
        w_elems = self.bt * self.bt if wy_in_recurrence else self.bt * self.dk  # w, or T diag(beta)
        self._set_stages(num_stages, (3 * self.bt * self.dk + w_elems + self.bt * self.bt) * elt + row_bytes)

    @cute.jit
    def __call__(
        self,
        mW: cute.Tensor,  # (T_total, HV, K)  dtype
        mU: cute.Tensor,  # (T_total, HV, V)  dtype
        mKg: cute.Tensor,  # (T_total, HV, K)  dtype; row_factors: k (T_total, H, K)
        mQg: cute.Tensor,  # (T_total, HV, K)  dtype; row_factors: q (T_total, H, K)
        mG: cute.Tensor,  # (T_total, HV, K)  fp32, chunk-local cumsum of the log2 gate; row_factors: the factor
        #                   rows (T_total, HV, ROW_FACTORS) fp32
        mA: cute.Tensor,  # (T_total, HV, BT) dtype, Aqk
        mO: cute.Tensor,  # (T_total, HV, V)  dtype, output
        mH0: cute.Tensor,  # (N, HV, K, V) or (N, HV, V, K) fp32; unread unless has_initial_state
        mHt: cute.Tensor,  # same layout as mH0; unwritten unless has_final_state
        mCu: cute.Tensor,  # (N + 1,) int32 cu_seqlens; unread unless varlen
        seqlen: Int32,  # tokens per sequence when not varlen (T_total = N * seqlen)
        num_seqs: Int32,  # N
        scale: Float32,
        stream: cuda.CUstream,
    ):
        self._launch(mW, mU, mKg, mQg, mG, mA, mO, mH0, mHt, mCu, seqlen, num_seqs, scale, stream, None, None, None)

    @cute.jit
    def _launch(
        self, mW, mU, mKg, mQg, mG, mA, mO, mH0, mHt, mCu, seqlen: Int32, num_seqs: Int32, scale: Float32,
        stream: cuda.CUstream, mH, mVn, mChunks,
    ):  # fmt: skip
        """The launch; ``mH``, ``mVn``, ``mChunks`` (``store_states``'s outputs and chunk offsets) None without."""
        dt, BT, DK, DV, S = self.dtype, self.bt, self.dk, self.dv, self.num_stages
        # Transposed / reordered views; each keeps one unit-stride mode for TMA.
        w_v = token_rows(mW)  # (T, K, HV)
        q_v = token_rows(mQg)  # (T, K, HV)
        a_v = token_rows(mA)  # (T, BT, HV)
        k_v = token_cols(mKg)  # (K, T, HV)
        u_v = token_cols(mU)  # (V, T, HV)
        g_v = token_rows(mG) if const_expr(self.row_factors) else token_cols(mG)  # (T, F, HV) or (K, T, HV)
        o_v = token_cols(mO)  # (V, T, HV)
        h0_v = state_view(mH0, self.state_v_first)  # (V, K, HV, N)
        ht_v = state_view(mHt, self.state_v_first)  # (V, K, HV, N)
        # store_states: h (V, K, HV, chunks) and v_new (V, T, HV); else views the kernel never touches
        h_v, vn_v, chunks = ht_v, o_v, mCu
        if const_expr(self.store_states):
            h_v, vn_v, chunks = state_view(mH, self.state_v_first), token_cols(mVn), mChunks

        # GEMM1-3: M = V over both warpgroups, N = BT. GEMM4: M = V, N = K, B (kg) read MN-major.
        mma_o = self._state_product_mma(dt, BT)
        mma_s = self._state_update_mma(dt, DK)

        sW_l, sQ_l = token_tile_b_k_major(dt, S), token_tile_b_k_major(dt, S)
        sA_l = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (DV, BT, BT), dt, S)  # (BT_i, BT_j, S)
        w_box = (BT, DK)
        if const_expr(self.wy_in_recurrence):  # T diag(beta) in w's place: B of v_new^T = x^T (T diag(beta))^T
            sW_l, w_box = token_tile_b_k_major(dt, S, D=BT), (BT, BT)
        sK_l, sU_l, sG_l = token_tile_b_mn_major(dt, S), token_tile_a_m_major(dt, S), gate_row_layout(S)
        g_box = (DK, 1)
        if const_expr(self.row_factors):  # a chunk's factor rows, token-major
            sG_l, g_box = factor_rows_layout(S), (BT, ROW_FACTORS)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_w, tw = cpasync.make_tiled_tma_atom(g2s, w_v, cute.select(sW_l, mode=[0, 1]), w_box)
        tma_q, tq = cpasync.make_tiled_tma_atom(g2s, q_v, cute.select(sQ_l, mode=[0, 1]), (BT, DK))
        tma_a, ta = cpasync.make_tiled_tma_atom(g2s, a_v, cute.select(sA_l, mode=[0, 1]), (BT, BT))
        tma_k, tk = cpasync.make_tiled_tma_atom(g2s, k_v, cute.select(sK_l, mode=[0, 1]), (DK, BT))
        tma_u, tu = cpasync.make_tiled_tma_atom(g2s, u_v, cute.select(sU_l, mode=[0, 1]), (DV, BT))
        tma_g, tg = cpasync.make_tiled_tma_atom(g2s, g_v, cute.select(sG_l, mode=[0, 1]), g_box)
        # o^T of one consumer warpgroup: its 64 V rows of the stage's u tile (the half has the tile's swizzle)
        half = DV // self.num_consumer_wg
        sOh_l = sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, (half, DK, BT), dt, 1)
        tma_o, to = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), o_v, cute.select(sOh_l, mode=[0, 1]), (half, BT)
        )

        @cute.struct
        class Storage:
            mbar: cute.struct.MemRange[cutlass.Int64, S * 2]
            sW: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sW_l)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_l)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_l)], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sU_l)], 1024]
            sA: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sA_l)], 1024]
            sG: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sG_l)], 128]

        self.storage = Storage
        HV = mW.shape[1]
        group = HV // mQg.shape[1] if const_expr(self.row_factors) else None  # value heads per q / k head
        kernel = self.kernel(
            tma_w, tw, tma_q, tq, tma_a, ta, tma_k, tk, tma_u, tu, tma_g, tg, tma_o, to,
            o_v, h0_v, ht_v, mCu, seqlen, scale,
            mma_o, mma_s, sW_l, sQ_l, sA_l, sK_l, sU_l, sG_l, h_v, vn_v, chunks, group,
        )  # fmt: skip
        kernel.launch(
            grid=(HV, num_seqs, 1), block=(self.num_threads, 1, 1), stream=stream, min_blocks_per_mp=1
        )

    @cute.kernel
    def kernel(
        self,
        tma_w: cute.CopyAtom, tw: cute.Tensor,
        tma_q: cute.CopyAtom, tq: cute.Tensor,
        tma_a: cute.CopyAtom, ta: cute.Tensor,
        tma_k: cute.CopyAtom, tk: cute.Tensor,
        tma_u: cute.CopyAtom, tu: cute.Tensor,
        tma_g: cute.CopyAtom, tg: cute.Tensor,
        tma_o: cute.CopyAtom, to: cute.Tensor,
        o_v: cute.Tensor, h0_v: cute.Tensor, ht_v: cute.Tensor, mCu: cute.Tensor,
        seqlen: Int32, scale: Float32,
        mma_o: cute.TiledMma, mma_s: cute.TiledMma,
        sW_l: cute.ComposedLayout, sQ_l: cute.ComposedLayout, sA_l: cute.ComposedLayout,
        sK_l: cute.ComposedLayout, sU_l: cute.ComposedLayout, sG_l: cute.Layout,
        h_v: cute.Tensor, vn_v: cute.Tensor, mChunks: cute.Tensor, group: Int32 | None,
    ):  # fmt: skip
        BT, DK, DV, S = self.bt, self.dk, self.dv, self.num_stages
        tidx, _, _ = cute.arch.thread_idx()
        h, n, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if warp_idx == 0:
            for atom in (tma_w, tma_q, tma_a, tma_k, tma_u, tma_g):
                cpasync.prefetch_descriptor(atom)

        # Sequence bounds: bos = first token of this sequence in the flattened [T_total] axis.
        if const_expr(self.varlen):
            bos = mCu[n]
            seq_len = mCu[n + 1] - bos
        else:
            bos = n * seqlen
            seq_len = seqlen
        num_chunks = (seq_len + BT - 1) // BT
        # store_states: this sequence's first chunk in h's chunk axis (FLA's chunk_offsets when packed)
        first_chunk = Int32(0)
        if const_expr(self.store_states):
            first_chunk = mChunks[n] if const_expr(self.varlen) else n * ((seqlen + BT - 1) // BT)

        storage = SmemAllocator().allocate(self.storage)
        pipe = recurrence_pipeline(storage.mbar.data_ptr(), S, self.num_consumer_wg, self.stage_bytes)
        sW = storage.sW.get_tensor(sW_l.outer, swizzle=sW_l.inner)
        sQ = storage.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)
        sA = storage.sA.get_tensor(sA_l.outer, swizzle=sA_l.inner)
        sK = storage.sK.get_tensor(sK_l.outer, swizzle=sK_l.inner)
        sU = storage.sU.get_tensor(sU_l.outer, swizzle=sU_l.inner)
        sG = storage.sG.get_tensor(sG_l)

        if wg_idx == 0:  # ------------------------------ producer ------------------------------
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:  # whole warp: TMA issue and expect_tx are elect_one'd inside
                if const_expr(self.row_factors):  # q, k of the group's q / k head; the factor rows carry the decay
                    qk = h // group
                    tiles = ((tma_w, tw, sW, (BT, BT if const_expr(self.wy_in_recurrence) else DK), True),
                             (tma_q, tq, sQ, (BT, DK), True, qk),
                             (tma_k, tk, sK, (DK, BT), False, qk), (tma_u, tu, sU, (DV, BT), False),
                             (tma_a, ta, sA, (BT, BT), True), (tma_g, tg, sG, (BT, ROW_FACTORS), True))  # fmt: skip
                    load_chunk_tiles(pipe, S, tiles, None, h, bos, seq_len, num_chunks)
                else:
                    tiles = ((tma_w, tw, sW, (BT, DK), True), (tma_q, tq, sQ, (BT, DK), True),
                             (tma_k, tk, sK, (DK, BT), False), (tma_u, tu, sU, (DV, BT), False),
                             (tma_a, ta, sA, (BT, BT), True))  # fmt: skip
                    load_chunk_tiles(pipe, S, tiles, (tma_g, tg, sG), h, bos, seq_len, num_chunks)
        else:  # ------------------------------ consumers ------------------------------
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self._recurrence(
                pipe, tidx, wg_idx, h, n, bos, seq_len, num_chunks, scale, mma_o, mma_s, sW, sQ, sA, sK, sU, sG,
                tma_o, to, o_v, h0_v, ht_v, h_v, vn_v, first_chunk,
            )  # fmt: skip

    @cute.jit
    def _recurrence(
        self, pipe, tidx, wg_idx, h, n, bos, seq_len, num_chunks, scale, mma_o, mma_s, sW, sQ, sA, sK, sU, sG, tma_o,
        to, o_v, h0_v, ht_v, h_v, vn_v, first_chunk,
    ):  # fmt: skip
        """Consumers (two warpgroups, each half of V): the state S^T in registers, chunk by chunk (GEMM1 w S,
        GEMM2 q S, v_new, GEMM3 Aqk v_new, GEMM4 S update), the output tile out, the final state at the end; with
        ``store_states`` each chunk's bf16 state before it and its v_new too."""
        BT, DK, DV, S = self.bt, self.dk, self.dv, self.num_stages
        ctid = tidx - 128
        wg_first = cute.make_layout(self.num_consumer_wg, stride=128)(wg_idx - 1)
        wg_o, wg_s = mma_o.get_slice(wg_first), mma_s.get_slice(wg_first)
        thr_o, thr_s = mma_o.get_slice(ctid), mma_s.get_slice(ctid)
        mask_bar = pipeline.NamedBarrier(barrier_id=Barrier.MASK, num_threads=128 * self.num_consumer_wg)

        accS = cute.make_rmem_tensor(wg_s.partition_shape_C((DV, DK)), Float32)  # S^T, fp32
        tSgH0 = thr_s.partition_C(h0_v[None, None, h, n])
        if const_expr(self.has_h0):
            accS.store(tSgH0.load())
        else:
            accS.fill(0.0)
        # Register A fragments (bf16 S^T for GEMM1/2, bf16 v_new^T for GEMM3/4; the RS A layout of a
        # 64x16 atom does not depend on N, so one v_new fragment serves both tiled MMAs).
        tOrS = wg_o.make_fragment_A(wg_o.partition_shape_A((DV, DK)))
        tVrV = wg_o.make_fragment_A(wg_o.partition_shape_A((DV, BT)))
        tOrW = wg_o.make_fragment_B(wg_o.partition_B(sW))  # w, or wy_in_recurrence's T diag(beta)
        tOrKk = None
        if const_expr(self.wy_in_recurrence):  # k S: the k tile (MN-major B of GEMM4) read K-major, byte for byte
            tOrKk = wg_o.make_fragment_B(wg_o.partition_B(token_major(sK)))
        tOrQ = wg_o.make_fragment_B(wg_o.partition_B(sQ))
        tOrA = wg_o.make_fragment_B(wg_o.partition_B(sA))
        tSrK = wg_s.make_fragment_B(wg_s.partition_B(sK))
        accV = cute.make_rmem_tensor(wg_o.partition_shape_C((DV, BT)), Float32)
        accO = cute.make_rmem_tensor(wg_o.partition_shape_C((DV, BT)), Float32)
        rO = cute.make_rmem_tensor(wg_o.partition_shape_C((DV, BT)), self.dtype)
        pV = cute.make_rmem_tensor(wg_o.partition_shape_C((DV, BT)), cutlass.Boolean)
        rD = rQf = rKf = tVrK = None
        if const_expr(self.row_factors):
            rQf, rKf = column_decay(accO), column_decay(accO)  # per token column of o^T / v_new^T
            tVrK = wg_o.make_fragment_A(wg_o.partition_shape_A((DV, BT)))  # bf16(v_new^T) for GEMM4
        else:
            rD = column_decay(accS)

        tUsU = thr_o.partition_C(sU)  # (MMA, MMA_M, MMA_N, S) view of u^T in the accumulator layout
        tVcV = thr_o.partition_C(cute.make_identity_tensor((DV, BT)))  # (v, t) of each element
        tScS = thr_s.partition_C(cute.make_identity_tensor((DV, DK)))  # (v, k) of each element
        gO = cute.local_tile(cute.domain_offset((0, bos), o_v[None, None, h]), (DV, BT), (0, None))
        tOgO = thr_o.partition_C(gO)  # (MMA, MMA_M, MMA_N, NC)
        if const_expr(self.store_states):
            gVn = cute.local_tile(cute.domain_offset((0, bos), vn_v[None, None, h]), (DV, BT), (0, None))
            tVgVn = thr_o.partition_C(gVn)  # v_new^T's chunks, o's partition
        # A full chunk's o^T leaves through this warpgroup's half of the stage's u tile (u is dead once v_new
        # is built): transposed stmatrix, then one TMA store by the warpgroup's first thread, where 32
        # scattered 2-byte stores a thread were ~20% of the stall samples (H200: -4% at B2-T16384, -22% with
        # 64 CTAs at B1-T8192). That thread's warp releases the stage late, after the store's read.
        issuer = first_warp = st_o = thr_sto = tOsU = wg_bar = tOs = tOg = None
        if const_expr(self.o_tma):
            issuer, first_warp, st_o, thr_sto, tOsU, wg_bar, tOs, tOg = self._o_staging(
                ctid, wg_idx, h, bos, mma_o, sU, tma_o, to
            )

        # Causal mask of the shared Aqk tile: consumer thread ctid zeroes row ctid // 4, columns
        # 16 * (ctid % 4) + [0, 16) above the diagonal.
        mrow = ctid // 4
        mcol0 = (ctid % 4) * 16

        if const_expr(self.o_tma and not self.store_states):
            self._chunks_o_behind(
                pipe, num_chunks, seq_len, scale, mma_o, mma_s, accS, accV, accO, rO, pV, rD, rQf, rKf, tOrS, tVrV,
                tVrK, tOrW, tOrKk, tOrQ, tOrA, tSrK, tUsU, tVcV, tScS, sG, tOgO, issuer, first_warp, st_o, thr_sto,
                tOsU, wg_bar, tma_o, tOs, tOg,
            )  # fmt: skip
            if const_expr(self.has_ht):
                thr_s.partition_C(ht_v[None, None, h, n]).store(accS.load())
        else:
            st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, S)
            for c in cutlass.range(num_chunks, unroll=1):
                valid = cutlass.min(seq_len - c * BT, BT)
                si = st.index
                pipe.consumer_wait(st)
                # GEMM1 + GEMM2 on the state before this chunk.
                tOrS.store(acc_as_a_frag(accS).load().to(self.dtype))
                warpgroup.fence()
                gemm_k_blocks(mma_o, accV, tOrS, tOrW, accumulate=False, b_stage=si)
                gemm_k_blocks(mma_o, accO, tOrS, tOrQ, accumulate=False, b_stage=si)
                warpgroup.commit_group()
                if const_expr(self.o_tma):
                    if (c > 0) & first_warp:
                        # the previous chunk's stage, once its o store has read it (see the end of the loop)
                        if issuer:
                            cute.arch.cp_async_bulk_wait_group(0, read=True)
                        prev = cutlass.select_(si == 0, S - 1, si - 1)
                        pipe.consumer_release(pipeline.PipelineState(S, st.count, prev, st.phase))

                # While GEMM1/2 run: mask Aqk, compute the decay factors, fetch u^T.
                if const_expr(not self.aqk_causal):
                    sAc = sA[None, None, si]
                    for jj in cutlass.range_constexpr(16):
                        if mcol0 + jj > mrow:
                            sAc[mrow, mcol0 + jj] = self.dtype(0.0)
                    cute.arch.fence_view_async_shared()
                # Decay factors exp2(g_last[k]) of this thread's 32 distinct K columns; applied after the wait
                # because ptxas serialises the WGMMAs (C7517) if S^T registers change while GEMM1/2 run.
                if const_expr(not self.row_factors):
                    load_column_decay(rD, sG, tScS, si)
                rU = load_u_and_row_mask(tUsU, si, pV, tVcV, valid)

                warpgroup.wait_group(0)
                if const_expr(not self.row_factors):
                    decay_columns(accS, rD)
                v_new = cute.where(pV.load(), rU.to(Float32) - accV.load(), 0.0)
                tVrV.store(v_new.to(self.dtype))
                if const_expr(self.row_factors):
                    # read here, not while GEMM1 / GEMM2 run: held across the wait they spilled
                    gd = load_row_factors(rKf, sG, tVcV, si, valid, rQf, scale)
                    accS.store(accS.load() * gd)
                    accV.store(v_new)
                    scale_token_columns(accO, rQf)
                    scale_token_columns(accV, rKf)
                    tVrK.store(accV.load().to(self.dtype))
                else:
                    accO.store(accO.load() * scale)
                if const_expr(not self.aqk_causal):
                    mask_bar.arrive_and_wait()
                # GEMM3 (intra-chunk output) + GEMM4 (state update) share the v_new fragment (with row_factors GEMM4
                # takes its f_k-scaled copy).
                warpgroup.fence()
                gemm_k_blocks(mma_o, accO, tVrV, tOrA, accumulate=True, b_stage=si)
                tVrS = tVrK if const_expr(self.row_factors) else tVrV
                gemm_k_blocks(mma_s, accS, tVrS, tSrK, accumulate=True, b_stage=si)
                warpgroup.commit_group()
                warpgroup.wait_group(0)

                rO.store(accO.load().to(self.dtype))
                self._store_o(
                    rO, tOgO[None, None, None, c], tVcV, valid, pipe, st, si, c, issuer, first_warp, st_o, thr_sto,
                    tOsU, wg_bar, tma_o, tOs, tOg,
                )  # fmt: skip
                if const_expr(self.store_states):
                    # from the bf16 operand fragments, once their products are done and o is out (fewest live
                    # registers): FLA's h[c] (the state the chunk's products read) and v_new (the fragment's order is
                    # o's; rows past the sequence end belong to the next one and are not written)
                    acc_as_a_frag(thr_s.partition_C(h_v[None, None, h, first_chunk + c])).store(tOrS.load())
                    tVgVnc = tVgVn[None, None, None, c]
                    for i in cutlass.range_constexpr(cute.size(tVrV)):
                        if tVcV[i][1] < valid:
                            tVgVnc[i] = tVrV[i]
                st.advance()

            if const_expr(self.o_tma):
                if (num_chunks > 0) & (seq_len % BT == 0) & first_warp:  # the last chunk's deferred release
                    if issuer:
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                    prev = cutlass.select_(st.index == 0, S - 1, st.index - 1)
                    pipe.consumer_release(pipeline.PipelineState(S, st.count, prev, st.phase))

            if const_expr(self.has_ht):
                tSgHt = thr_s.partition_C(ht_v[None, None, h, n])
                tSgHt.store(accS.load())

    @cute.jit
    def _chunks_o_behind(
        self, pipe, num_chunks, seq_len, scale, mma_o, mma_s, accS, accV, accO, rO, pV, rD, rQf, rKf, tOrS, tVrV,
        tVrK, tOrW, tOrKk, tOrQ, tOrA, tSrK, tUsU, tVcV, tScS, sG, tOgO, issuer, first_warp, st_o, thr_sto, tOsU,
        wg_bar, tma_o, tOs, tOg,
    ):  # fmt: skip
        """The chunk loop of the ``o_tma`` variants without ``store_states``, ordered so that the tensor pipe is fed
        while the epilogues run: chunk c's GEMM3 is issued at the top of chunk c + 1, ahead of its GEMM1; chunk c's o
        is converted and stored once GEMM3 is done, while GEMM1 runs; GEMM2 (which overwrites accO) is issued once
        GEMM1 is done, and v_new and the decay factors are built while it runs. The other loop waits for GEMM1 and
        GEMM2 together, builds v_new, then GEMM3 and GEMM4 together, then stores o, each step with the pipe idle
        for its warpgroup. Each iteration still ends with nothing in flight (a WGMMA
        pending across the loop's back edge made ptxas serialise every WGMMA, remark C7514). A stage is held into the
        next chunk (its Aqk tile read and its o staged there) and released by the end of it, the first warp of each
        warpgroup last, once the o store has read it: at a chunk's top only the previous chunk's stage is held, so any
        number of stages from 2 works and the producer runs one to two chunks ahead. Same products on the same
        operands, in the same order per accumulator: the outputs are bit for bit the other loop's."""
        BT, S = self.bt, self.num_stages
        # the first chunk's GEMM3 has no previous chunk: it adds 0 (a WGMMA issued under a branch made ptxas
        # serialise them all, remark C7515), to this chunk's Aqk tile, the one stage surely loaded
        tVrV.fill(0.0)
        accO.fill(0.0)
        st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, S)
        for c in cutlass.range(num_chunks, unroll=1):
            valid = cutlass.min(seq_len - c * BT, BT)
            si = st.index
            prev = cutlass.select_(si == 0, S - 1, si - 1)
            pipe.consumer_wait(st)
            # (S^T read before any WGMMA is issued: ptxas serialises a read of registers a WGMMA once wrote while
            # another one runs, remark C7517)
            tOrS.store(acc_as_a_frag(accS).load().to(self.dtype))
            warpgroup.fence()
            # the previous chunk's GEMM3 (its o^T's intra-chunk part), then this chunk's GEMM1
            gemm_k_blocks(mma_o, accO, tVrV, tOrA, accumulate=True, b_stage=cutlass.select_(c == 0, si, prev))
            warpgroup.commit_group()
            gemm_k_blocks(mma_o, accV, tOrS, tOrKk if const_expr(self.wy_in_recurrence) else tOrW, accumulate=False,
                          b_stage=si)  # fmt: skip
            warpgroup.commit_group()
            # the previous chunk's o out through its stage's u tile, while GEMM1 runs (the wait and the read outside
            # the branch, for ptxas as above)
            warpgroup.wait_group(1)
            rO.store(accO.load().to(self.dtype))
            if c > 0:
                self._store_o(
                    rO, tOgO[None, None, None, c - 1], tVcV, BT, pipe,
                    pipeline.PipelineState(S, st.count, prev, st.phase), prev, c - 1, issuer, first_warp, st_o, thr_sto,
                    tOsU, wg_bar, tma_o, tOs, tOg,
                )  # fmt: skip
            # While GEMM1 runs: u^T, the rows past the sequence end. GEMM2 once GEMM1 is done, so that v_new is built
            # while GEMM2 runs.
            rU = load_u_and_row_mask(tUsU, si, pV, tVcV, valid)
            warpgroup.wait_group(0)
            if const_expr(self.wy_in_recurrence):
                # v_new's product from T diag(beta) ahead of GEMM2 (v_new is on the state's chain, o is not), then the
                # rest of v_new while GEMM2 runs (f_x through rKf's registers: load_row_factors refills them)
                wy_v_new_product(mma_o, accV, tVrV, tOrW, rU, pV, rKf, sG, tVcV, si, valid, self.dtype)
                gemm_k_blocks(mma_o, accO, tOrS, tOrQ, accumulate=False, b_stage=si)
                warpgroup.commit_group()
                warpgroup.wait_group(1)
                v_new = cute.where(pV.load(), accV.load(), 0.0)
            else:
                warpgroup.fence()
                gemm_k_blocks(mma_o, accO, tOrS, tOrQ, accumulate=False, b_stage=si)
                warpgroup.commit_group()
                v_new = cute.where(pV.load(), rU.to(Float32) - accV.load(), 0.0)
            tVrV.store(v_new.to(self.dtype))
            if const_expr(self.row_factors):
                accV.store(v_new)
            else:
                load_column_decay(rD, sG, tScS, si)  # the decay factors exp2(g_last[k])

            warpgroup.wait_group(0)
            if const_expr(self.row_factors):
                gd = load_row_factors(rKf, sG, tVcV, si, valid, rQf, scale)
                accS.store(accS.load() * gd)
                scale_token_columns(accO, rQf)
                scale_token_columns(accV, rKf)
                tVrK.store(accV.load().to(self.dtype))
            else:
                decay_columns(accS, rD)
                accO.store(accO.load() * scale)
            # GEMM4, the state update; GEMM3 waits for the next chunk's top (or the drain below)
            warpgroup.fence()
            gemm_k_blocks(mma_s, accS, tVrK if const_expr(self.row_factors) else tVrV, tSrK, accumulate=True,
                          b_stage=si)  # fmt: skip
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            if (c > 0) & first_warp:
                # the previous chunk's stage, once its o store (issued while GEMM1 ran) has read it: long done by
                # now, and the stage is free before the next chunk's top (the producer keeps two chunks ahead)
                if issuer:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                pipe.consumer_release(pipeline.PipelineState(S, st.count, prev, st.phase))
            st.advance()

        if num_chunks > 0:
            # the last chunk's GEMM3 and o (partial or full), and the deferred releases
            last = cutlass.select_(st.index == 0, S - 1, st.index - 1)
            warpgroup.fence()
            gemm_k_blocks(mma_o, accO, tVrV, tOrA, accumulate=True, b_stage=last)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            rO.store(accO.load().to(self.dtype))
            cl = num_chunks - 1
            vl = cutlass.min(seq_len - cl * BT, BT)
            self._store_o(
                rO, tOgO[None, None, None, cl], tVcV, vl, pipe, pipeline.PipelineState(S, st.count, last, st.phase),
                last, cl, issuer, first_warp, st_o, thr_sto, tOsU, wg_bar, tma_o, tOs, tOg,
            )  # fmt: skip
            if (vl == BT) & first_warp:
                if issuer:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                pipe.consumer_release(pipeline.PipelineState(S, st.count, last, st.phase))

    def _o_staging(self, ctid, wg_idx, h, bos, mma_o, sU, tma_o, to):
        """A full chunk's o^T leaves through this warpgroup's half of the stage's u tile (``o_tma``): the
        transposed stmatrix into it and the TMA partitions of the store, issued by the warpgroup's first thread
        (lane 0 of its first warp, which also releases the stage late, once the store has read it).
        Plain Python, traced inline: ``(issuer, first_warp, st_o, thr_sto, tOsU, wg_bar, tOs, tOg)``."""
        BT, DV = self.bt, self.dv
        issuer = ctid % 128 == 0
        first_warp = (ctid % 128) < 32
        me = wg_idx - 1
        half = DV // self.num_consumer_wg
        st_o = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype), mma_o
        )
        thr_sto = st_o.get_slice(ctid)
        tOsU = thr_sto.partition_D(sU)  # (CPY, CPY_M, CPY_N, S)
        wg_bar = pipeline.NamedBarrier(barrier_id=Barrier.WARPGROUP0 + me, num_threads=128)
        sUh = cute.flat_divide(sU, (half, BT))[None, None, me, 0, None]  # (half, BT, S)
        gOh = cute.local_tile(cute.domain_offset((0, bos), to[None, None, h]), (half, BT), (me, None))
        tOs, tOg = cpasync.tma_partition(
            tma_o, 0, cute.make_layout(1), cute.group_modes(sUh, 0, 2), cute.group_modes(gOh, 0, 2)
        )
        return issuer, first_warp, st_o, thr_sto, tOsU, wg_bar, tOs, tOg

    @cute.jit
    def _store_o(
        self, rO, tOgOc, tVcV, valid, pipe, st, si, c, issuer, first_warp, st_o, thr_sto, tOsU, wg_bar, tma_o, tOs,
        tOg,
    ):  # fmt: skip
        """Chunk c's o^T (``rO``, bf16) out and its stage released: a full chunk by stmatrix and TMA where ``o_tma``
        (u is dead since v_new; the first warp releases the stage only once the store has read it, at the next
        chunk), else by direct stores; a partial last chunk by row-predicated stores (the next sequence's rows
        untouched)."""
        if valid == self.bt:
            if const_expr(self.o_tma):
                cute.copy(st_o, thr_sto.retile(rO), tOsU[None, None, None, si])
                cute.arch.fence_view_async_shared()
                wg_bar.arrive_and_wait()
                if issuer:
                    cute.copy(tma_o, tOs[None, si], tOg[None, c])
                    cute.arch.cp_async_bulk_commit_group()
                if not first_warp:
                    pipe.consumer_release(st)
            else:
                pipe.consumer_release(st)
                tOgOc.store(rO.load())
        else:
            pipe.consumer_release(st)
            for i in cutlass.range_constexpr(cute.size(rO)):
                if tVcV[i][1] < valid:
                    tOgOc[i] = rO[i]


class DeltaHFwdOStatesSm90(DeltaHFwdOFusedSm90):
    """``DeltaHFwdOFusedSm90`` that also writes what FLA's backward reads of the recurrence (the training forward under
    ``disable_recompute=True``): per chunk c the bf16 state before it, FLA's ``h[c]`` (``[chunks, HV, K, V]``, or
    ``[chunks, HV, V, K]`` with ``state_v_first``; a sequence's chunks from ``mChunks[n]`` when packed, FLA's
    ``chunk_offsets``, else from ``n * ceil(T / 64)``), and ``v_new`` (``[T, HV, V]``, FLA's rounding: bf16 of
    ``u - w bf16(S)``), both by direct stores from the bf16 operand fragments the chunk's products read, after its o,
    where the fewest registers are live. Same warp roles and pipeline; the packed variants spill 24-28 bytes at the
    consumers' 232 registers (240 would leave the producer warp 24, where it spilled too)."""

    def __init__(self, **options):
        super().__init__(store_states=True, **options)

    @cute.jit
    def __call__(
        self,
        mW: cute.Tensor, mU: cute.Tensor, mKg: cute.Tensor, mQg: cute.Tensor, mG: cute.Tensor, mA: cute.Tensor,
        mO: cute.Tensor, mH0: cute.Tensor, mHt: cute.Tensor, mCu: cute.Tensor,
        mH: cute.Tensor,  # (chunks, HV, K, V) or (chunks, HV, V, K) dtype, out
        mVn: cute.Tensor,  # (T_total, HV, V) dtype, out
        mChunks: cute.Tensor,  # (N + 1,) int32 first chunk of each sequence; unread unless varlen
        seqlen: Int32, num_seqs: Int32, scale: Float32, stream: cuda.CUstream,
    ):  # fmt: skip
        self._launch(mW, mU, mKg, mQg, mG, mA, mO, mH0, mHt, mCu, seqlen, num_seqs, scale, stream, mH, mVn, mChunks)


def _compile(dtype, num_stages, varlen, has_h0, has_ht, state_v_first, arch=(9, 0), extra_options="",
             aqk_causal=False, store_states=False, row_factors=False, wy_in_recurrence=False):
    """Trace and compile one variant against fake tensors (no GPU needed). Returns the TVM-FFI callable.

    ``extra_options`` is appended to the cute.compile options (tests use ``--keep-cubin --dump-dir D``).
    """
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    DK = DV = 128
    BT = 64
    dtype = dsl_type(dtype)
    cls = DeltaHFwdOStatesSm90 if store_states else DeltaHFwdOFusedSm90
    kernel = cls(
        dtype=dtype, head_k=DK, head_v=DV, chunk_size=BT, num_stages=num_stages, varlen=varlen,
        has_initial_state=has_h0, has_final_state=has_ht, state_v_first=state_v_first, aqk_causal=aqk_causal,
        **({"row_factors": True} if row_factors else {}), **({"wy_in_recurrence": True} if wy_in_recurrence else {}),
    )  # fmt: skip
    # Token and sequence strides are 64-bit so that T_total * HV * D (or N * HV * K * V) may pass 2^31
    # elements; their divisibility keeps TMA's 16-byte stride check provable at compile time.
    tt, hv = cute.sym_int32(), cute.sym_int32()
    tok_stride = {d: cute.sym_int64(divisibility=d) for d in (DK, BT)}

    def tok(dt, d):
        return make_fake_tensor(dt, (tt, hv, d), (tok_stride[d], d, 1), assumed_align=16)

    def state(dt=Float32):
        inner = (DV, DK) if state_v_first else (DK, DV)
        return make_fake_tensor(
            dt,
            (cute.sym_int32(), cute.sym_int32(), *inner),
            (cute.sym_int64(divisibility=DK * DV), DK * DV, inner[1], 1),
            assumed_align=16,
        )

    def cu():
        return make_fake_compact_tensor(Int32, (cute.sym_int32(),), stride_order=(0,), assumed_align=4)

    tensors = (tok(dtype, DK), tok(dtype, DV), tok(dtype, DK), tok(dtype, DK), tok(Float32, DK), tok(dtype, BT),
               tok(dtype, DV), state(), state(), cu())  # fmt: skip
    if row_factors:  # k and q of H heads (their own sizes), the factor rows
        h, qk_stride = cute.sym_int32(), cute.sym_int64(divisibility=DK)
        qk = make_fake_tensor(dtype, (tt, h, DK), (qk_stride, DK, 1), assumed_align=16)
        rows = make_fake_tensor(Float32, (tt, hv, ROW_FACTORS), (cute.sym_int64(divisibility=ROW_FACTORS),
                                                                  ROW_FACTORS, 1), assumed_align=16)  # fmt: skip
        tensors = tensors[:2] + (qk, qk, rows) + tensors[5:]
        if wy_in_recurrence:  # T diag(beta) in w's place
            tensors = (tok(dtype, BT),) + tensors[1:]
    if store_states:  # h, v_new, the chunk offsets
        tensors += (state(dtype), tok(dtype, DV), cu())
    args = (*tensors, Int32(1), Int32(1), Float32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True))
    return cute.compile(kernel, *args, options=compile_options(arch, extra_options))
