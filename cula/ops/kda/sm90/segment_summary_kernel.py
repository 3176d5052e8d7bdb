"""KDA time-parallel forward, first pass on SM90: every segment's end state and its transition in one launch.

Over a segment of whole chunks the KDA recurrence is affine in the segment's start state (``cula.kda.forward``'s
``parallel_segment_states``): with ``S`` the ``[K, V]`` state, per chunk ``v_new = u - w S`` and
``S <- diag(exp2 g_last) S + kg^T v_new``, so ``S_end = R S_start + E`` with

    E = the end state from a zero start
    R = the end state from the identity with u = 0   (the product of the chunks' ``diag(gamma) - kg^T w``)

This kernel computes both for every segment (packed like sequences, ``cu_seqlens`` their bounds) without the
output: CTA ``(h, n)`` of ``h < HV`` walks segment ``n`` of value head ``h`` for E; ``h >= HV`` walks the same
segment of head ``h - HV`` for R. Both land in one ``[M, 2 HV, ...]`` state tensor (E then R along the head axis),
in the caller's state layout. The arithmetic is the state/output kernel's (``delta_h_fwd_o_kernel.py``: fp32 state
transposed in the accumulators, bf16 copies as the RS operand, FLA's rounding points); without ``qg``, ``Aqk`` and
``o`` a chunk moves two thirds of the bytes and runs two of its four GEMMs::

    GEMM1  v^T  = bf16(S^T) . w^T        M=V  N=BT K=K   B = w   tile [BT, K], K-major
    GEMM4  S^T += bf16(v_new^T) . kg     M=V  N=K  K=BT  B = kg  tile [BT, K], MN-major

A transition CTA loads u like the others (one transaction size for the pipeline) and ignores it. Rows past a
segment's end are zeroed in v_new, as in the state/output kernel.

With ``mid_states`` the kernel also writes, into ``mMids`` (laid out as ``mEnds``), the same two summaries of the
segment's first ``num_chunks // 2`` chunks (E and R where the running state stands at that chunk boundary; a
segment of one chunk or none gives E = 0, R = I): the caller then starts the segment's second half from
``R_mid S_start + E_mid`` and runs the output pass over twice the segments, with no more chain steps.

With ``row_factors`` (Gated DeltaNet: one gate per token and value head) the kernel reads the raw k of the value
head's q / k head and the intra kernel's factor rows in place of kg and the decay row, as the state/output kernel's
variant does: v_new's token columns times ``f_k`` before GEMM4, one decay ``f_g`` of the last valid row for every
column. With ``wy_in_recurrence`` as well it reads the intra kernel's T diag(beta) in w's place and the raw v in
u's, and makes v_new as the state/output kernel's variant does: GEMM1 on the raw k (its tile read K-major), then
``v_new^T = bf16(u_weight v - f_x o k S)^T (T diag(beta))^T`` (``cute_common.wy_v_new_product``).

Warp roles (384 threads, ``min_blocks_per_mp=1``):

=========  =========  =====================================================================================
warps      registers  role
=========  =========  =====================================================================================
0          40         ``load_chunk_tiles``, the TMA producer: per chunk w, kg, u and the last valid g row
1-3        40         idle
4-11       232        ``_recurrence``, two consumer warpgroups (64 V rows each): GEMM1, decay, v_new, GEMM4
=========  =========  =====================================================================================

One ``PipelineTmaAsync`` of ``num_stages`` slots (4 by default, 49.7 KB each); the consumer warpgroups never meet.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float16, Float32, Int32, const_expr, cute, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

from cula.cache import compile_options
from cula.ops._host import ROW_FACTORS, dsl_type
from cula.ops.cute_common import (
    ChunkRecurrenceResources, acc_as_a_frag, column_decay, decay_columns, factor_rows_layout, gate_row_layout,
    gemm_k_blocks, load_chunk_tiles, load_column_decay, load_row_factors, load_u_and_row_mask, recurrence_pipeline,
    scale_token_columns, state_view, token_cols, token_rows, token_tile_a_m_major, token_tile_b_k_major,
    token_major, token_tile_b_mn_major, wy_v_new_product,
)  # fmt: skip

__all__ = ["SegmentSummarySm90"]



class SegmentSummarySm90(ChunkRecurrenceResources):
    """End state E and transition R of every segment of a packed KDA call, sm_90a (see the module docstring).

    Static configuration: element dtype of w/u/kg, K = V = 128, chunk size 64, pipeline depth, the state layout and
    whether the first halves' summaries are written too (``mid_states``). The number of segments, heads and tokens
    are runtime values.
    """

    arch = 90

    def __init__(self, dtype=BFloat16, num_stages: int = 4, state_v_first: bool = False, mid_states: bool = False,
                 row_factors: bool = False, wy_in_recurrence: bool = False):  # fmt: skip
        if dtype not in (BFloat16, Float16):
            raise ValueError(f"dtype must be BFloat16 or Float16, got {dtype}")
        self.dtype = dtype
        self.mid_states = mid_states
        self.dk = self.dv = 128
        self.bt = 64
        self.state_v_first = state_v_first
        # Gated DeltaNet: raw k of the value head's q / k head and the intra kernel's factor rows instead of kg and
        # the decay row (the state/output kernel's row_factors, delta_h_fwd_o_kernel.py)
        self.row_factors = row_factors
        # ... and T diag(beta) in w's place, the raw v in u's (the state/output kernel's wy_in_recurrence)
        self.wy_in_recurrence = wy_in_recurrence
        if wy_in_recurrence and not row_factors:
            raise ValueError("wy_in_recurrence scales k S by the factor rows' f_x: it needs row_factors")
        row_bytes = self.bt * ROW_FACTORS * 4 if row_factors else self.dk * 4
        w_elems = self.bt * self.bt if wy_in_recurrence else self.bt * self.dk
        self._set_stages(num_stages, (2 * self.bt * self.dk + w_elems) * (dtype.width // 8) + row_bytes)

    @cute.jit
    def __call__(
        self,
        mW: cute.Tensor,  # (T_total, HV, K)  dtype; wy_in_recurrence: T diag(beta) (T_total, HV, BT)
        mU: cute.Tensor,  # (T_total, HV, V)  dtype; wy_in_recurrence: v
        mKg: cute.Tensor,  # (T_total, HV, K)  dtype; row_factors: k (T_total, H, K)
        mG: cute.Tensor,  # (T_total, HV, K)  fp32, chunk-local cumsum of the log2 gate; row_factors: the factor
        #                   rows (T_total, HV, ROW_FACTORS) fp32
        mEnds: cute.Tensor,  # (M, 2 HV, K, V) or (M, 2 HV, V, K) fp32: E of head h at h, R at HV + h
        mMids: cute.Tensor | None,  # as mEnds, after each segment's first half (mid_states), else None
        mCu: cute.Tensor,  # (M + 1,) int32 segment bounds
        num_segments: Int32,
        stream: cuda.CUstream,
    ):
        dt, BT, DK, DV, S = self.dtype, self.bt, self.dk, self.dv, self.num_stages
        w_v = token_rows(mW)  # (T, K, HV)
        k_v = token_cols(mKg)  # (K, T, HV)
        u_v = token_cols(mU)  # (V, T, HV)
        g_v = token_rows(mG) if const_expr(self.row_factors) else token_cols(mG)  # (T, F, HV) or (K, T, HV)
        ends_v = state_view(mEnds, self.state_v_first)  # (V, K, 2 HV, M)
        mids_v = ends_v  # never touched without mid_states
        if const_expr(self.mid_states):
            mids_v = state_view(mMids, self.state_v_first)

        mma_v = self._state_product_mma(dt, BT)
        mma_s = self._state_update_mma(dt, DK)

        sW_l, sK_l, sU_l = token_tile_b_k_major(dt, S), token_tile_b_mn_major(dt, S), token_tile_a_m_major(dt, S)
        w_box = (BT, DK)
        if const_expr(self.wy_in_recurrence):  # T diag(beta): B of v_new^T = x^T (T diag(beta))^T
            sW_l, w_box = token_tile_b_k_major(dt, S, D=BT), (BT, BT)
        sG_l, g_box = gate_row_layout(S), (DK, 1)
        if const_expr(self.row_factors):
            sG_l, g_box = factor_rows_layout(S), (BT, ROW_FACTORS)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_w, tw = cpasync.make_tiled_tma_atom(g2s, w_v, cute.select(sW_l, mode=[0, 1]), w_box)
        tma_k, tk = cpasync.make_tiled_tma_atom(g2s, k_v, cute.select(sK_l, mode=[0, 1]), (DK, BT))
        tma_u, tu = cpasync.make_tiled_tma_atom(g2s, u_v, cute.select(sU_l, mode=[0, 1]), (DV, BT))
        tma_g, tg = cpasync.make_tiled_tma_atom(g2s, g_v, cute.select(sG_l, mode=[0, 1]), g_box)

        @cute.struct
        class Storage:
            mbar: cute.struct.MemRange[cutlass.Int64, S * 2]
            sW: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sW_l)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_l)], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sU_l)], 1024]
            sG: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sG_l)], 128]

        self.storage = Storage
        HV = mW.shape[1]
        group = HV // mKg.shape[1] if const_expr(self.row_factors) else None  # value heads per q / k head
        kernel = self.kernel(
            tma_w, tw, tma_k, tk, tma_u, tu, tma_g, tg, ends_v, mids_v, mCu, HV, mma_v, mma_s, sW_l, sK_l, sU_l,
            sG_l, group,
        )  # fmt: skip
        kernel.launch(
            grid=(2 * HV, num_segments, 1), block=(self.num_threads, 1, 1), stream=stream, min_blocks_per_mp=1
        )

    @cute.kernel
    def kernel(
        self,
        tma_w: cute.CopyAtom, tw: cute.Tensor,
        tma_k: cute.CopyAtom, tk: cute.Tensor,
        tma_u: cute.CopyAtom, tu: cute.Tensor,
        tma_g: cute.CopyAtom, tg: cute.Tensor,
        ends_v: cute.Tensor, mids_v: cute.Tensor, mCu: cute.Tensor, HV: Int32,
        mma_v: cute.TiledMma, mma_s: cute.TiledMma,
        sW_l: cute.ComposedLayout, sK_l: cute.ComposedLayout, sU_l: cute.ComposedLayout, sG_l: cute.Layout,
        group: Int32 | None,
    ):  # fmt: skip
        S = self.num_stages
        tidx, _, _ = cute.arch.thread_idx()
        slot, n, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if warp_idx == 0:
            for atom in (tma_w, tma_k, tma_u, tma_g):
                cpasync.prefetch_descriptor(atom)
        transition = slot >= HV
        h = cutlass.select_(transition, slot - HV, slot)  # the value head whose tensors this CTA reads

        bos = mCu[n]
        seg_len = mCu[n + 1] - bos
        num_chunks = (seg_len + self.bt - 1) // self.bt

        storage = SmemAllocator().allocate(self.storage)
        pipe = recurrence_pipeline(storage.mbar.data_ptr(), S, self.num_consumer_wg, self.stage_bytes)
        sW = storage.sW.get_tensor(sW_l.outer, swizzle=sW_l.inner)
        sK = storage.sK.get_tensor(sK_l.outer, swizzle=sK_l.inner)
        sU = storage.sU.get_tensor(sU_l.outer, swizzle=sU_l.inner)
        sG = storage.sG.get_tensor(sG_l)

        if wg_idx == 0:  # ------------------------------ producer ------------------------------
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:  # whole warp: TMA issue and expect_tx are elect_one'd inside
                if const_expr(self.row_factors):  # k of the group's q / k head; the factor rows carry the decay
                    load_chunk_tiles(
                        pipe, S, ((tma_w, tw, sW, (self.bt, self.bt if const_expr(self.wy_in_recurrence) else self.dk),
                                   True),
                                  (tma_k, tk, sK, (self.dk, self.bt), False, h // group),
                                  (tma_u, tu, sU, (self.dv, self.bt), False),
                                  (tma_g, tg, sG, (self.bt, ROW_FACTORS), True)),
                        None, h, bos, seg_len, num_chunks,
                    )  # fmt: skip
                else:
                    load_chunk_tiles(
                        pipe, S, ((tma_w, tw, sW, (self.bt, self.dk), True),
                                  (tma_k, tk, sK, (self.dk, self.bt), False),
                                  (tma_u, tu, sU, (self.dv, self.bt), False)),
                        (tma_g, tg, sG), h, bos, seg_len, num_chunks,
                    )  # fmt: skip
        else:  # ------------------------------ consumers ------------------------------
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self._recurrence(
                pipe, tidx, wg_idx, h, slot, n, transition, seg_len, num_chunks, mma_v, mma_s, sW, sK, sU, sG, ends_v,
                mids_v,
            )  # fmt: skip

    @cute.jit
    def _recurrence(
        self, pipe, tidx, wg_idx, h, slot, n, transition, seg_len, num_chunks, mma_v, mma_s, sW, sK, sU, sG, ends_v,
        mids_v,
    ):  # fmt: skip
        """Consumers (two warpgroups, each half of V): S^T in registers from its start (zero, or the identity
        for R), chunk by chunk GEMM1, decay, v_new (u, or nothing for R), GEMM4; S^T out at the end (and with
        ``mid_states`` where the first half ends)."""
        BT, DK, DV, S = self.bt, self.dk, self.dv, self.num_stages
        ctid = tidx - 128
        wg_first = cute.make_layout(self.num_consumer_wg, stride=128)(wg_idx - 1)
        wg_v, wg_s = mma_v.get_slice(wg_first), mma_s.get_slice(wg_first)
        thr_v, thr_s = mma_v.get_slice(ctid), mma_s.get_slice(ctid)

        accS = cute.make_rmem_tensor(wg_s.partition_shape_C((DV, DK)), Float32)  # S^T, fp32
        tScS = thr_s.partition_C(cute.make_identity_tensor((DV, DK)))  # (v, k) of each element
        if transition:
            for i in cutlass.range_constexpr(cute.size(accS)):
                accS[i] = cutlass.select_(tScS[i][0] == tScS[i][1], Float32(1.0), Float32(0.0))
        else:
            accS.fill(0.0)
        tOrS = wg_v.make_fragment_A(wg_v.partition_shape_A((DV, DK)))
        tVrV = wg_v.make_fragment_A(wg_v.partition_shape_A((DV, BT)))
        tOrW = wg_v.make_fragment_B(wg_v.partition_B(sW))  # w, or wy_in_recurrence's T diag(beta)
        tSrK = wg_s.make_fragment_B(wg_s.partition_B(sK))
        tOrKk = None
        if const_expr(self.wy_in_recurrence):  # k S: the k tile (MN-major B of GEMM4) read K-major, byte for byte
            tOrKk = wg_v.make_fragment_B(wg_v.partition_B(token_major(sK)))
        accV = cute.make_rmem_tensor(wg_v.partition_shape_C((DV, BT)), Float32)
        pV = cute.make_rmem_tensor(wg_v.partition_shape_C((DV, BT)), cutlass.Boolean)
        rD = rKf = None
        if const_expr(self.row_factors):
            rKf = column_decay(accV)  # f_k of this thread's token columns
        else:
            rD = column_decay(accS)
        tUsU = thr_v.partition_C(sU)  # (MMA, MMA_M, MMA_N, S) view of u^T in the accumulator layout
        tVcV = thr_v.partition_C(cute.make_identity_tensor((DV, BT)))  # (v, t) of each element
        # R ignores u: v_new = 0 - w S there
        u_weight = cutlass.select_(transition, Float32(0.0), Float32(1.0))

        half = num_chunks // 2
        st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, S)
        for c in cutlass.range(num_chunks, unroll=1):
            valid = cutlass.min(seg_len - c * BT, BT)
            si = st.index
            if const_expr(self.mid_states):
                if c == half:  # the state after the first half's chunks, before the wait on the next one's tiles
                    thr_s.partition_C(mids_v[None, None, slot, n]).store(accS.load())
            pipe.consumer_wait(st)
            tOrS.store(acc_as_a_frag(accS).load().to(self.dtype))
            warpgroup.fence()
            gemm_k_blocks(mma_v, accV, tOrS, tOrKk if const_expr(self.wy_in_recurrence) else tOrW, accumulate=False,
                          b_stage=si)  # fmt: skip
            warpgroup.commit_group()
            # while GEMM1 runs: the decay factors of this thread's columns, u^T, the row mask
            if const_expr(not self.row_factors):
                load_column_decay(rD, sG, tScS, si)
            rU = load_u_and_row_mask(tUsU, si, pV, tVcV, valid)
            warpgroup.wait_group(0)
            if const_expr(self.row_factors):
                if const_expr(self.wy_in_recurrence):
                    # v_new from T diag(beta) (f_x through rKf's registers, refilled with f_k below)
                    wy_v_new_product(mma_v, accV, tVrV, tOrW, rU, pV, rKf, sG, tVcV, si, valid, self.dtype, u_weight)
                    warpgroup.wait_group(0)
                    v_new = cute.where(pV.load(), accV.load(), 0.0)
                else:
                    v_new = cute.where(pV.load(), rU.to(Float32) * u_weight - accV.load(), 0.0)
                # one decay for every column, v_new's token columns times f_k (GEMM4 alone reads it here)
                accS.store(accS.load() * load_row_factors(rKf, sG, tVcV, si, valid))
                accV.store(v_new)
                scale_token_columns(accV, rKf)
                tVrV.store(accV.load().to(self.dtype))
            else:
                decay_columns(accS, rD)
                v_new = cute.where(pV.load(), rU.to(Float32) * u_weight - accV.load(), 0.0)
                tVrV.store(v_new.to(self.dtype))
            warpgroup.fence()
            gemm_k_blocks(mma_s, accS, tVrV, tSrK, accumulate=True, b_stage=si)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            pipe.consumer_release(st)
            st.advance()

        thr_s.partition_C(ends_v[None, None, slot, n]).store(accS.load())
        if const_expr(self.mid_states):
            if num_chunks == 0:  # an empty segment: its halves are empty, their start state still written
                thr_s.partition_C(mids_v[None, None, slot, n]).store(accS.load())


def _compile(dtype, state_v_first, arch=(9, 0), extra_options="", num_stages=4, mid_states=False, row_factors=False,
             wy_in_recurrence=False):  # fmt: skip
    """Trace and compile one variant against fake tensors (no GPU needed). Returns the TVM-FFI callable."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    DK = DV = 128
    dtype = dsl_type(dtype)
    kernel = SegmentSummarySm90(dtype=dtype, num_stages=num_stages, state_v_first=state_v_first,
                                mid_states=mid_states, **({"row_factors": True} if row_factors else {}),
                                **({"wy_in_recurrence": True} if wy_in_recurrence else {}))  # fmt: skip
    # 64-bit token and segment strides: T_total * HV * D (or M * 2 HV * K * V) may pass 2^31 elements
    tt, hv = cute.sym_int32(), cute.sym_int32()
    tok_stride = cute.sym_int64(divisibility=DK)

    def tok(dt):
        return make_fake_tensor(dt, (tt, hv, DK), (tok_stride, DK, 1), assumed_align=16)

    def state():
        return make_fake_tensor(
            Float32, (cute.sym_int32(), cute.sym_int32(), DK, DV),
            (cute.sym_int64(divisibility=DK * DV), DK * DV, DV, 1), assumed_align=16,
        )  # fmt: skip

    cu = make_fake_compact_tensor(Int32, (cute.sym_int32(),), stride_order=(0,), assumed_align=4)
    k, g = tok(dtype), tok(Float32)
    if row_factors:  # k of H heads (its own sizes), the factor rows
        k = make_fake_tensor(dtype, (tt, cute.sym_int32(), DK), (cute.sym_int64(divisibility=DK), DK, 1),
                             assumed_align=16)  # fmt: skip
        g = make_fake_tensor(Float32, (tt, hv, ROW_FACTORS), (cute.sym_int64(divisibility=ROW_FACTORS), ROW_FACTORS, 1),
                             assumed_align=16)  # fmt: skip
    w = tok(dtype)
    if wy_in_recurrence:  # T diag(beta) in w's place
        w = make_fake_tensor(dtype, (tt, hv, 64), (cute.sym_int64(divisibility=64), 64, 1), assumed_align=16)
    args = (w, tok(dtype), k, g, state(), state() if mid_states else None, cu, Int32(1),
            make_fake_stream(use_tvm_ffi_env_stream=True))  # fmt: skip
    return cute.compile(kernel, *args, options=compile_options(arch, extra_options))
