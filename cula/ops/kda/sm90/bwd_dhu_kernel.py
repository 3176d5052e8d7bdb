"""KDA chunk backward, stages 4 and 5 in one launch on SM90: FLA's ``chunk_kda_bwd_dAv`` and
``chunk_gated_delta_rule_bwd_dhu`` for KDA.

Per (sequence n, value head h) one CTA walks the chunks of BT = 64 tokens from last to first with the state
gradient in fp32 registers. With ``dS`` the ``[K, V]`` gradient of the state leaving chunk c (FLA's ``dh[c]``;
``dht`` or zero for the last chunk), per chunk::

    dh[c]   = bf16(dS)                                        # stored for the WY / dq / dk stage
    dv2     = kg @ bf16(dS) + Aqk^T @ do                      # [BT, V]; rows past the sequence end -> 0
    dAqk    = scale * (do @ v_new^T) on t >= s, 0 above       # [BT, BT] fp32 out, rows past the end unwritten
    dS      = diag(exp2(g[last])) dS + scale * qg^T @ do - w^T @ bf16(dv2)

and ``dh0 = dS`` after the first chunk. Inputs are the recomputed forward intermediates FLA's ``chunk_kda_bwd``
passes (``qg = q exp2(g)``, ``kg = k exp2(g_last - g)``, ``w``, the chunk-local log2 gate cumsum ``g``, ``v_new``)
with ``do`` and the forward's ``Aqk`` (scaled, zero above the diagonal, as cula's intra kernel writes it). FLA's
stage 4 writes ``dv = Aqk^T do`` to memory in bf16 and stage 5 reads it back; here it never leaves the chip and is
added in fp32. The other rounding points are FLA's (bf16 ``dS`` for ``dh`` and the kg product, bf16 ``dv2`` for
the w product), so ``dh`` and ``dh0`` match FLA's kernels to that one rounding and fp32 summation order.

Layout in the kernel: ``dS^T`` fp32 ``[V, K]`` is the accumulator of two consumer warpgroups (64 V rows each), as
the forward state kernel keeps ``S^T``::

    GEMM1  dv2^T = bf16(dS^T) . kg^T        M=V N=BT K=K   A registers, B = kg tile [BT, K] K-major
    GEMM2  dS^T += bf16(-dv2^T) . w         M=V N=K  K=BT  A registers, B = w tile [BT, K] MN-major
    GEMM3  dS^T += do^T . qg                M=V N=K  K=BT  A registers (do^T, rows past the sequence end
                                                           zeroed), B = qg tile MN-major

    GEMM0  dv2^T += do^T . Aqk              M=V N=BT K=BT  A registers (do^T, as GEMM3), B = Aqk tile MN-major
    GEMM4  dAqk  = do . v_new^T             M=BT N=BT K=V  A = the do tile read K-major (the same bytes as its
                                                           M-major view), B = v_new tile K-major; N split
                                                           over the two warpgroups

A partial chunk's tiles hold the next sequence's tokens (or the next batch row's) past ``valid``: both products
over tokens take their A operand from registers so those rows can be zeroed (dv2 for GEMM2, do for GEMM3 and
GEMM0); GEMM4's rows past the end are not stored and its columns past the end are above the diagonal.

``scale`` multiplies GEMM3's product alone: the state is divided by it before GEMM3 and multiplied after (fp32,
an ulp each), which keeps one accumulator. ``dh`` and ``dv2`` leave by direct stores.

Warp roles (384 threads, ``min_blocks_per_mp=1``):

=========  =========  =====================================================================================
warps      registers  role
=========  =========  =====================================================================================
0          40         ``load_chunk_tiles``, the TMA producer: per chunk (last first) kg, w, qg, do,
                      v_new, Aqk and the chunk's last g row
1-3        40         idle
4-11       232        ``_recurrence``, two consumer warpgroups: dh store, GEMM1 (+ GEMM0), GEMM4, dv2, decay,
                      GEMM2, GEMM3, dAqk store
=========  =========  =====================================================================================

One ``PipelineTmaAsync`` of ``num_stages`` slots (2, 88.5 KB each); the two consumer
warpgroups never meet.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float16, Float32, Int32, const_expr, cute, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from cula.cache import compile_options
from cula.ops._host import dsl_type
from cula.ops.cute_common import (
    ChunkRecurrenceResources, acc_as_a_frag, column_decay, decay_columns, gate_row_layout, gemm_k_blocks,
    load_chunk_tiles, load_column_decay, recurrence_pipeline, state_view, token_cols, token_rows, token_tile_a_m_major,
    token_tile_b_k_major, token_tile_b_mn_major,
)  # fmt: skip

__all__ = ["ChunkKDABwdDhuSm90"]



class ChunkKDABwdDhuSm90(ChunkRecurrenceResources):
    """KDA dv and state-gradient recurrence (``chunk_kda_bwd_dAv`` then ``chunk_gated_delta_rule_bwd_dhu`` with the
    per-channel gate), sm_90a.

    Static configuration: element dtype of qg/kg/w/do/v_new/Aqk (and of the dh / dv2 outputs), K = V = 128, chunk
    size 64, pipeline depth, and four trace flags (varlen, final-state gradient in, initial-state gradient out,
    state layout). Token, head and sequence counts are runtime values.
    """

    arch = 90

    def __init__(self, dtype=BFloat16, num_stages: int = 2, varlen: bool = False, has_dht: bool = False,
                 has_dh0: bool = False, state_v_first: bool = False):  # fmt: skip
        if dtype not in (BFloat16, Float16):
            raise ValueError(f"dtype must be BFloat16 or Float16, got {dtype}")
        self.dtype = dtype
        self.dk = self.dv = 128
        self.bt = 64
        self.varlen = varlen
        self.has_dht = has_dht
        self.has_dh0 = has_dh0
        self.state_v_first = state_v_first
        tile = self.bt * self.dk * (dtype.width // 8)
        aqk = self.bt * self.bt * (dtype.width // 8)
        self._set_stages(num_stages, 5 * tile + aqk + self.dk * 4)

    @cute.jit
    def __call__(
        self,
        mQg: cute.Tensor,  # (T_total, HV, K)  dtype
        mKg: cute.Tensor,  # (T_total, HV, K)  dtype
        mW: cute.Tensor,  # (T_total, HV, K)  dtype
        mG: cute.Tensor,  # (T_total, HV, K)  fp32, chunk-local cumsum of the log2 gate
        mDo: cute.Tensor,  # (T_total, HV, V)  dtype
        mAqk: cute.Tensor,  # (T_total, HV, BT)  dtype, the forward's Aqk
        mVn: cute.Tensor,  # (T_total, HV, V)  dtype, v_new
        mDv2: cute.Tensor,  # (T_total, HV, V)  dtype, output
        mDAqk: cute.Tensor,  # (T_total, HV, BT)  fp32, output
        mDh: cute.Tensor,  # (NT_total, HV, K, V) or (NT_total, HV, V, K) dtype, output
        mDht: cute.Tensor,  # (N, HV, K, V) or (N, HV, V, K) fp32; unread unless has_dht
        mDh0: cute.Tensor,  # same layout as mDht; unwritten unless has_dh0
        mCu: cute.Tensor,  # (N + 1,) int32 cu_seqlens; unread unless varlen
        mChunkOff: cute.Tensor,  # (N,) int32 first chunk of each sequence in mDh; unread unless varlen
        seqlen: Int32,  # tokens per sequence when not varlen
        num_seqs: Int32,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        dt, BT, DK, DV, S = self.dtype, self.bt, self.dk, self.dv, self.num_stages
        kg_v = token_rows(mKg)  # (T, K, HV)
        w_v = token_cols(mW)  # (K, T, HV)
        q_v = token_cols(mQg)  # (K, T, HV)
        g_v = token_cols(mG)  # (K, T, HV)
        do_v = token_cols(mDo)  # (V, T, HV)
        dv2_v = token_cols(mDv2)  # (V, T, HV)
        da_v = token_rows(mDAqk)  # (T, BT, HV)
        dh_v = state_view(mDh, self.state_v_first)  # (V, K, HV, NT)
        dht_v = state_view(mDht, self.state_v_first)  # (V, K, HV, N)
        dh0_v = state_view(mDh0, self.state_v_first)  # (V, K, HV, N)

        # GEMM1: N = BT, B (kg) K-major. GEMM2 and GEMM3: N = K, B (w, qg) MN-major.
        mma_v = self._state_product_mma(dt, BT)
        mma_s = self._state_update_mma(dt, DK)

        # GEMM0: M = V, N = BT, B (Aqk) MN-major. GEMM4: M = N = BT over both warpgroups (N halves), both operands
        # K-major (A the do tile)
        mma_a = self._state_update_mma(dt, BT)
        mma_d = sm90_utils.make_trivial_tiled_mma(
            dt, dt, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, self.num_consumer_wg, 1),
            tiler_mn=(BT, BT // self.num_consumer_wg),
        )  # fmt: skip

        sKg_l = token_tile_b_k_major(dt, S)
        sW_l, sQ_l = token_tile_b_mn_major(dt, S), token_tile_b_mn_major(dt, S)
        sDo_l = token_tile_a_m_major(dt, S)
        # the do tile as GEMM4's A, (t, v) K-major: the same function of the bytes as sDo_l transposed
        sDoK_l = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BT, BT, DV), dt, S)
        sVn_l, sA_l = token_tile_b_k_major(dt, S), token_tile_b_mn_major(dt, S, D=BT)
        sG_l = gate_row_layout(S)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_kg, tkg = cpasync.make_tiled_tma_atom(g2s, kg_v, cute.select(sKg_l, mode=[0, 1]), (BT, DK))
        tma_w, tw = cpasync.make_tiled_tma_atom(g2s, w_v, cute.select(sW_l, mode=[0, 1]), (DK, BT))
        tma_q, tq = cpasync.make_tiled_tma_atom(g2s, q_v, cute.select(sQ_l, mode=[0, 1]), (DK, BT))
        tma_do, tdo = cpasync.make_tiled_tma_atom(g2s, do_v, cute.select(sDo_l, mode=[0, 1]), (DV, BT))
        tma_x, tx = cpasync.make_tiled_tma_atom(g2s, token_rows(mVn), cute.select(sVn_l, mode=[0, 1]), (BT, DV))
        tma_g, tg = cpasync.make_tiled_tma_atom(g2s, g_v, cute.select(sG_l, mode=[0, 1]), (DK, 1))
        tma_a, ta = cpasync.make_tiled_tma_atom(g2s, token_cols(mAqk), cute.select(sA_l, mode=[0, 1]), (BT, BT))

        @cute.struct
        class Storage:
            mbar: cute.struct.MemRange[cutlass.Int64, S * 2]
            sKg: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sKg_l)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sW_l)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_l)], 1024]
            sDo: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sDo_l)], 1024]
            sX: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sVn_l)], 1024]
            sA: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sA_l)], 1024]
            sG: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sG_l)], 128]

        self.storage = Storage
        HV = mW.shape[1]
        kernel = self.kernel(
            tma_kg, tkg, tma_w, tw, tma_q, tq, tma_do, tdo, tma_x, tx, tma_a, ta, tma_g, tg,
            dv2_v, da_v, dh_v, dht_v, dh0_v, mCu, mChunkOff, seqlen, scale,
            mma_v, mma_s, mma_a, mma_d, sKg_l, sW_l, sQ_l, sDo_l, sDoK_l, sVn_l, sA_l, sG_l,
        )  # fmt: skip
        kernel.launch(grid=(HV, num_seqs, 1), block=(self.num_threads, 1, 1), stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(
        self,
        tma_kg: cute.CopyAtom, tkg: cute.Tensor,
        tma_w: cute.CopyAtom, tw: cute.Tensor,
        tma_q: cute.CopyAtom, tq: cute.Tensor,
        tma_do: cute.CopyAtom, tdo: cute.Tensor,
        tma_x: cute.CopyAtom, tx: cute.Tensor,
        tma_a: cute.CopyAtom, ta: cute.Tensor,
        tma_g: cute.CopyAtom, tg: cute.Tensor,
        dv2_v: cute.Tensor, da_v: cute.Tensor, dh_v: cute.Tensor, dht_v: cute.Tensor, dh0_v: cute.Tensor,
        mCu: cute.Tensor, mChunkOff: cute.Tensor, seqlen: Int32, scale: Float32,
        mma_v: cute.TiledMma, mma_s: cute.TiledMma, mma_a: cute.TiledMma, mma_d: cute.TiledMma,
        sKg_l: cute.ComposedLayout, sW_l: cute.ComposedLayout, sQ_l: cute.ComposedLayout,
        sDo_l: cute.ComposedLayout, sDoK_l: cute.ComposedLayout, sVn_l: cute.ComposedLayout, sA_l: cute.ComposedLayout,
        sG_l: cute.Layout,
    ):  # fmt: skip
        BT, DK, DV, S = self.bt, self.dk, self.dv, self.num_stages
        tidx, _, _ = cute.arch.thread_idx()
        h, n, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if warp_idx == 0:
            for atom in (tma_kg, tma_w, tma_q, tma_do, tma_x, tma_g):
                cpasync.prefetch_descriptor(atom)
            cpasync.prefetch_descriptor(tma_a)

        if const_expr(self.varlen):
            bos = mCu[n]
            seq_len = mCu[n + 1] - bos
            first_chunk = mChunkOff[n]
        else:
            bos = n * seqlen
            seq_len = seqlen
            first_chunk = n * ((seqlen + self.bt - 1) // self.bt)
        num_chunks = (seq_len + self.bt - 1) // self.bt

        storage = SmemAllocator().allocate(self.storage)
        pipe = recurrence_pipeline(storage.mbar.data_ptr(), S, self.num_consumer_wg, self.stage_bytes)
        sKg = storage.sKg.get_tensor(sKg_l.outer, swizzle=sKg_l.inner)
        sW = storage.sW.get_tensor(sW_l.outer, swizzle=sW_l.inner)
        sQ = storage.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)
        sDo = storage.sDo.get_tensor(sDo_l.outer, swizzle=sDo_l.inner)
        sDoK = storage.sDo.get_tensor(sDoK_l.outer, swizzle=sDoK_l.inner)  # the same bytes, (t, v) K-major
        sX = storage.sX.get_tensor(sVn_l.outer, swizzle=sVn_l.inner)
        sA = storage.sA.get_tensor(sA_l.outer, swizzle=sA_l.inner)
        sG = storage.sG.get_tensor(sG_l)

        if wg_idx == 0:  # ------------------------------ producer ------------------------------
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:  # whole warp: TMA issue and expect_tx are elect_one'd inside
                tiles = ((tma_kg, tkg, sKg, (BT, DK), True), (tma_w, tw, sW, (DK, BT), False),
                         (tma_q, tq, sQ, (DK, BT), False), (tma_do, tdo, sDo, (DV, BT), False),
                         (tma_x, tx, sX, (BT, DV), True), (tma_a, ta, sA, (BT, BT), False))  # fmt: skip
                load_chunk_tiles(pipe, S, tiles, (tma_g, tg, sG), h, bos, seq_len, num_chunks, last_first=True)
        else:  # ------------------------------ consumers ------------------------------
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self._recurrence(
                pipe, tidx, wg_idx, h, n, bos, seq_len, num_chunks, first_chunk, scale, mma_v, mma_s, mma_a, mma_d,
                sKg, sW, sQ, sDo, sDoK, sX, sA, sG, dv2_v, da_v, dh_v, dht_v, dh0_v,
            )  # fmt: skip

    @cute.jit
    def _recurrence(
        self, pipe, tidx, wg_idx, h, n, bos, seq_len, num_chunks, first_chunk, scale, mma_v, mma_s, mma_a, mma_d,
        sKg, sW, sQ, sDo, sDoK, sX, sA, sG, dv2_v, da_v, dh_v, dht_v, dh0_v,
    ):  # fmt: skip
        """Consumers (two warpgroups, each half of V): dS^T in registers from dht (or zero), chunk by chunk last
        to first: dh out, GEMM1 and GEMM0 into one accumulator, GEMM4, dv2 out, decay, GEMM2, dAqk out, GEMM3; dh0 at
        the end. ``sX`` is v_new; ``sDoK`` the do tile viewed K-major."""
        BT, DK, DV, S = self.bt, self.dk, self.dv, self.num_stages
        ctid = tidx - 128
        wg_first = cute.make_layout(self.num_consumer_wg, stride=128)(wg_idx - 1)
        wg_v, wg_s = mma_v.get_slice(wg_first), mma_s.get_slice(wg_first)
        thr_v, thr_s = mma_v.get_slice(ctid), mma_s.get_slice(ctid)

        accS = cute.make_rmem_tensor(wg_s.partition_shape_C((DV, DK)), Float32)  # dS^T, fp32
        if const_expr(self.has_dht):
            accS.store(thr_s.partition_C(dht_v[None, None, h, n]).load())
        else:
            accS.fill(0.0)
        tOrS = wg_v.make_fragment_A(wg_v.partition_shape_A((DV, DK)))  # bf16 dS^T for GEMM1
        tVrV = wg_v.make_fragment_A(wg_v.partition_shape_A((DV, BT)))  # bf16 -dv2^T for GEMM2
        tVrDo = wg_v.make_fragment_A(wg_v.partition_shape_A((DV, BT)))  # do^T for GEMM0 and GEMM3
        tVrKg = wg_v.make_fragment_B(wg_v.partition_B(sKg))
        tSrW = wg_s.make_fragment_B(wg_s.partition_B(sW))
        tSrQ = wg_s.make_fragment_B(wg_s.partition_B(sQ))
        accV = cute.make_rmem_tensor(wg_v.partition_shape_C((DV, BT)), Float32)
        rV = cute.make_rmem_tensor(wg_v.partition_shape_C((DV, BT)), self.dtype)
        rD = column_decay(accS)

        tVsDo = thr_v.partition_C(sDo)  # (MMA, MMA_M, MMA_N, S) view of do^T in the accumulator layout
        tVcV = thr_v.partition_C(cute.make_identity_tensor((DV, BT)))  # (v, t) of each element
        tScS = thr_s.partition_C(cute.make_identity_tensor((DV, DK)))  # (v, k) of each element
        gDv2 = cute.local_tile(cute.domain_offset((0, bos), dv2_v[None, None, h]), (DV, BT), (0, None))
        tVgDv2 = thr_v.partition_C(gDv2)  # (MMA, MMA_M, MMA_N, NC)
        inv_scale = Float32(1.0) / scale
        wg_a = mma_a.get_slice(wg_first)
        tArA = wg_a.make_fragment_B(wg_a.partition_B(sA))
        wg_d, thr_d = mma_d.get_slice(wg_first), mma_d.get_slice(ctid)  # this warpgroup's half of the columns
        tDrDo = wg_d.make_fragment_A(wg_d.partition_A(sDoK))
        tDrVn = wg_d.make_fragment_B(wg_d.partition_B(sX))
        accD = cute.make_rmem_tensor(wg_d.partition_shape_C((BT, BT)), Float32)
        tDcD = thr_d.partition_C(cute.make_identity_tensor((BT, BT)))  # (t, s) of each element
        gDA = cute.local_tile(cute.domain_offset((bos, 0), da_v[None, None, h]), (BT, BT), (None, 0))
        tDgDA = thr_d.partition_C(gDA)  # (MMA, MMA_M, MMA_N, NC)

        st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, S)
        for i in cutlass.range(num_chunks, unroll=1):
            c = num_chunks - 1 - i
            valid = cutlass.min(seq_len - c * BT, BT)
            si = st.index
            # dh[c]: the gradient of the state leaving this chunk, as FLA stores it
            thr_s.partition_C(dh_v[None, None, h, first_chunk + c]).store(accS.load().to(self.dtype))
            pipe.consumer_wait(st)
            self._load_do(tVrDo, tVsDo, tVcV, valid, si)  # do^T with the rows past the end zeroed, GEMM0's A
            # GEMM1 and GEMM0: dv2^T = bf16(dS^T) . kg^T + do^T . Aqk
            tOrS.store(acc_as_a_frag(accS).load().to(self.dtype))
            warpgroup.fence()
            gemm_k_blocks(mma_v, accV, tOrS, tVrKg, accumulate=False, b_stage=si)
            gemm_k_blocks(mma_a, accV, tVrDo, tArA, accumulate=True, b_stage=si)
            warpgroup.commit_group()
            # GEMM4: dAqk = do . v_new^T, this warpgroup's columns
            gemm_k_blocks(mma_d, accD, tDrDo, tDrVn, accumulate=False, a_stage=si, b_stage=si)
            warpgroup.commit_group()
            # while they run: the decay factors
            load_column_decay(rD, sG, tScS, si)
            warpgroup.wait_group(1)
            for e in cutlass.range_constexpr(cute.size(rV)):  # the rows past the end zeroed
                rV[e] = Float32(cutlass.select_(tVcV[e][1] < valid, accV[e], Float32(0.0))).to(self.dtype)
            tVrV.store(-rV.load())  # exact in bf16 / fp16
            tVgDv2c = tVgDv2[None, None, None, c]
            if valid == BT:
                tVgDv2c.store(rV.load())
            else:  # the partial chunk: the next sequence's rows untouched
                for e in cutlass.range_constexpr(cute.size(rV)):
                    if tVcV[e][1] < valid:
                        tVgDv2c[e] = rV[e]
            # decay, then GEMM2: dS^T += bf16(-dv2^T) . w
            decay_columns(accS, rD)
            warpgroup.fence()
            gemm_k_blocks(mma_s, accS, tVrV, tSrW, accumulate=True, b_stage=si)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            self._store_dAqk(accD, tDcD, tDgDA[None, None, None, c], valid, scale)
            # GEMM3 with scale on its product alone: dS^T = scale * (dS^T / scale + do^T . qg)
            accS.store(accS.load() * inv_scale)
            warpgroup.fence()
            gemm_k_blocks(mma_s, accS, tVrDo, tSrQ, accumulate=True, b_stage=si)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            pipe.consumer_release(st)
            accS.store(accS.load() * scale)
            st.advance()

        if const_expr(self.has_dh0):
            thr_s.partition_C(dh0_v[None, None, h, n]).store(accS.load())

    @cute.jit
    def _load_do(self, tVrDo, tVsDo, tVcV, valid, si):
        """do^T of stage ``si`` into GEMM0's and GEMM3's A fragment, the rows past the sequence end zeroed."""
        sDo_si = tVsDo[None, None, None, si]
        for e in cutlass.range_constexpr(cute.size(tVrDo)):
            tVrDo[e] = self.dtype(cutlass.select_(tVcV[e][1] < valid, sDo_si[e], self.dtype(0.0)))

    @cute.jit
    def _store_dAqk(self, accD, tDcD, tDgDA, valid, scale):
        """GEMM4's columns as FLA's dAqk: scaled, zero above the diagonal, the rows past the sequence end unwritten
        (the next sequence's)."""
        vals = cute.make_rmem_tensor(accD.shape, Float32)
        for e in cutlass.range_constexpr(cute.size(vals)):
            vals[e] = Float32(cutlass.select_(tDcD[e][0] >= tDcD[e][1], accD[e] * scale, Float32(0.0)))
        if valid == self.bt:
            tDgDA.store(vals.load())
        else:
            for e in cutlass.range_constexpr(cute.size(vals)):
                if tDcD[e][0] < valid:
                    tDgDA[e] = vals[e]


def _compile(dtype, varlen, has_dht, has_dh0, state_v_first, arch=(9, 0), extra_options="", num_stages=2):
    """Trace and compile one variant against fake tensors (no GPU needed). Returns the TVM-FFI callable."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    D, BT = 128, 64
    dtype = dsl_type(dtype)
    kernel = ChunkKDABwdDhuSm90(dtype=dtype, num_stages=num_stages, varlen=varlen, has_dht=has_dht,
                                has_dh0=has_dh0, state_v_first=state_v_first)  # fmt: skip
    # 64-bit token and chunk strides: T_total * HV * D (or NT * HV * K * V) may pass 2^31 elements
    tt, hv = cute.sym_int32(), cute.sym_int32()
    tok_stride = cute.sym_int64(divisibility=D)

    def tok(dt):
        return make_fake_tensor(dt, (tt, hv, D), (tok_stride, D, 1), assumed_align=16)

    def state(dt):
        return make_fake_tensor(
            dt, (cute.sym_int32(), cute.sym_int32(), D, D), (cute.sym_int64(divisibility=D * D), D * D, D, 1),
            assumed_align=16,
        )  # fmt: skip

    def scores(dt):  # Aqk / dAqk
        return make_fake_tensor(dt, (cute.sym_int32(), cute.sym_int32(), BT), (cute.sym_int64(divisibility=BT), BT, 1),
                                assumed_align=16)  # fmt: skip

    def ints():
        return make_fake_compact_tensor(Int32, (cute.sym_int32(),), stride_order=(0,), assumed_align=4)

    args = (
        tok(dtype), tok(dtype), tok(dtype), tok(Float32), tok(dtype), scores(dtype), tok(dtype),
        tok(dtype), scores(Float32), state(dtype), state(Float32), state(Float32), ints(), ints(), Int32(1), Int32(1),
        Float32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True),
    )  # fmt: skip
    return cute.compile(kernel, *args, options=compile_options(arch, extra_options))
