"""KDA chunk backward, the gradients through the state terms and the WY representation on SM90 (stage 6 of FLA's
``chunk_kda_bwd``).

Replaces FLA 0.6.0's ``chunk_kda_bwd_wy_dqkg_fused`` (``fla/ops/kda/chunk_bwd.py``); contract:
``cula.kda.naive_bwd.chunk_kda_bwd_wy_dqkg_reference``. Per chunk of BT = 64 tokens and value head, with ``S`` the
state entering the chunk (``[K, V]``), ``dS`` the gradient of the state leaving it, ``G = exp2(g)`` (g the chunk-local
log2 gate cumsum), ``gn`` the last valid row's g, ``T`` the chunk's ``(I + L)^-1`` and ``du`` the gradient of v_new::

    dq    = scale (do S^T) G                                      (P1)
    dks   = (v_new dS^T) exp2(gn - g)                              (P2, rows past the end 0)
    dw    = -bf16(du S^T)                                          (P3)
    dvb   = T^T du;  dv2 = beta dvb                                (P5)
    dkgb  = T^T dw                                                 (P6)
    dA    = du v^T + dw bf16(k G)^T                                (P4, P7)
    dAm   = bf16(dA beta_s) on t > s;  dL = -bf16(T^T bf16(dAm T^T)) on t > s   (P8a, P8b)
    dk    = dks + dkgb G beta;   db = sum_v dvb v + sum_k dkgb k G
    dg    = q dq - k dks + k G dkgb beta,  plus on the last row exp2(gn) sum_v S dS + sum_t k dks

(the rounding points are FLA's: bf16 operands, fp32 accumulation). Outputs are new tensors: dq, dk, dg, db, dA fp32,
dv2 in v's dtype.

Layout (256 threads, 8 warps, ~216 KB of shared memory: one CTA per SM). The grid is persistent: CTA b walks the
work items (chunk, value head) b, b + grid, ... (chunk fastest), and each item's tiles reach shared memory in four
groups of row copies (``cp.async.bulk``, a thread a row, each group completing on its own mbarrier once an item),
each issued as soon as the previous item has read the buffers it lands in, so they arrive while that item computes
(L0-L3 below; zeros past the sequence end). All products are bf16 / fp16
``mma.sync`` m16n8k16 with operand fragments read from padded shared rows by ``ldmatrix`` (``.trans`` for the
operands whose contraction runs down the rows); warp w owns the 16 output rows 16 (w % 4) .. +15 and one column
half (w // 4) of every product:

=====  ======================================================================================================
phase  work (all threads; CTA barriers between the steps)
=====  ======================================================================================================
1      once L0 and L2 are in (and L1): P1 and P2 over V, every thread a half row of ``sum_v S dS``, beta (held in
       a register since the previous item's end) to shared memory; once L3 is in: P3, P5 (its epilogue: dv2
       out, the db term of v), P4 into the dA accumulator; then the next item's L0 (S, dS, as stored)
E1     dq out; dks and ``q dq - k dks`` kept in the P1 / P2 registers; bf16(-dw) and bf16(k G) to the shared rows
       do and v_new had; the column sums of ``k dks`` per row block to shared memory; then the next item's L1 (q)
2      P6 and P7; dk, dg out (the last row adds the channel sums), db's half partial to shared memory; bf16(dAm)
       to du's rows; then the next item's L2 (k, g fp32, do, v_new)
3      P8a into v's rows (bf16), P8b: dA out; db out; then the next item's L3 (du, v, T) and its beta
=====  ======================================================================================================

Supported: K = V = 128, BT = 64, q / k / v / v_new / do / du / h / dh / T all bf16 or all fp16, beta fp32 / bf16 /
fp16, GVA (HV a multiple of H), both state layouts, varlen (``cu_seqlens`` int32 + ``chunk_indices`` int32
``[NT, 2]``; states numbered by chunk-list row; a padding row (n, c) with ``64 c >=`` the length of sequence n writes
nothing). ``raw_qk``: q and k before the L2 norm, with each row's 1 / norm; the epilogues (E1, phase 2), their only
readers, take ``bf16(x rstd)`` (held in shared memory a row, stored in phase 1 as beta is).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float16, Float32, Int32, const_expr, cute
from cutlass.cute.nvgpu import warp
from cutlass.memory import SmemAllocator

from cula.cache import compile_options
from cula.ops._host import dsl_type
from cula.ops.cute_common import (
    bulk_row_copy, bulk_token_rows, chunk_rows, n_tile_accumulators, vec_at,
)  # fmt: skip

__all__ = ["ChunkKDABwdWyDqkgSm90"]


class ChunkKDABwdWyDqkgSm90:
    """KDA backward through the state terms and the WY representation (FLA's ``chunk_kda_bwd_wy_dqkg_fused``),
    sm_90a.

    Static configuration: the dtype of the bf16 / fp16 operands, the dtype of beta, the state layout, varlen. Token
    counts, heads, sequences and the scale are runtime values.
    """

    arch = 90

    def __init__(self, dtype=BFloat16, beta_dtype=Float32, state_v_first: bool = False, varlen: bool = False,
                 raw_qk: bool = False):  # fmt: skip
        if dtype not in (BFloat16, Float16):
            raise ValueError(f"dtype must be BFloat16 or Float16, got {dtype}")
        if beta_dtype not in (BFloat16, Float16, Float32):
            raise ValueError(f"beta_dtype must be BFloat16, Float16 or Float32, got {beta_dtype}")
        self.dtype, self.beta_dtype = dtype, beta_dtype
        self.state_v_first, self.varlen = bool(state_v_first), bool(varlen)
        # q and k arrive before the L2 norm, with each row's 1 / norm (mQRstd, mKRstd): the epilogues, their only
        # readers, normalise what they read, bf16(x rstd) as FLA's l2norm_fwd rounds it, so that the training
        # backward needs no l2norm_fwd launches
        self.raw_qk = bool(raw_qk)
        self.bt, self.dk, self.dv = 64, 128, 128
        self.num_threads = 256
        # padded row strides (elements): 16-bit rows of 128 (+8) and of 64 (+8), fp32 rows of 128 (+4); the 8 rows
        # of 16 bytes an ldmatrix matrix reads, and a quarter warp's epilogue reads, then fall in distinct banks
        self.x_ld, self.a_ld, self.g_ld = 136, 72, 132

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (T_total, H, K) dtype
        mK: cute.Tensor,  # (T_total, H, K) dtype
        mV: cute.Tensor,  # (T_total, HV, V) dtype
        mVn: cute.Tensor,  # (T_total, HV, V) dtype, v_new
        mG: cute.Tensor,  # (T_total, HV, K) fp32, chunk-local log2 cumsum
        mBeta: cute.Tensor,  # (T_total, HV) beta_dtype
        mA: cute.Tensor,  # (T_total, HV, BT) dtype, T by rows
        mH: cute.Tensor,  # (NT_total, HV, K, V) dtype, or (NT_total, HV, V, K) with state_v_first
        mDo: cute.Tensor,  # (T_total, HV, V) dtype
        mDh: cute.Tensor,  # as mH
        mDu: cute.Tensor,  # (T_total, HV, V) dtype, the gradient of v_new (FLA's dv argument)
        mDq: cute.Tensor,  # (T_total, HV, K) fp32, out
        mDk: cute.Tensor,  # (T_total, HV, K) fp32, out
        mDv2: cute.Tensor,  # (T_total, HV, V) dtype, out
        mDg: cute.Tensor,  # (T_total, HV, K) fp32, out
        mDb: cute.Tensor,  # (T_total, HV) fp32, out
        mDA: cute.Tensor,  # (T_total, HV, BT) fp32, out
        mCu: cute.Tensor,  # (N + 1,) int32, unread unless varlen
        mCi: cute.Tensor,  # (NT, 2) int32 (sequence, chunk), unread unless varlen
        mQRstd: cute.Tensor | None,  # (T_total, H) fp32, q's 1 / norms with raw_qk; else None
        mKRstd: cute.Tensor | None,  # (T_total, H) fp32, k's
        scale: Float32,
        seqlen: Int32,  # tokens per sequence when not varlen
        num_chunks: Int32,  # chunks per sequence, or NT when varlen
        num_seqs: Int32,  # B, or 1 when varlen
        num_ctas: Int32,  # the persistent grid: min(chunks x value heads x sequences, SMs)
        stream: cuda.CUstream,
    ):
        BT, DK = self.bt, self.dk

        @cute.struct
        class Storage:
            sH: cute.struct.Align[cute.struct.MemRange[self.dtype, DK * self.x_ld], 16]
            sDh: cute.struct.Align[cute.struct.MemRange[self.dtype, DK * self.x_ld], 16]
            sDo: cute.struct.Align[cute.struct.MemRange[self.dtype, BT * self.x_ld], 16]  # then bf16(-dw)
            sVn: cute.struct.Align[cute.struct.MemRange[self.dtype, BT * self.x_ld], 16]  # then bf16(k G)
            sDu: cute.struct.Align[cute.struct.MemRange[self.dtype, BT * self.x_ld], 16]  # then bf16(dAm)
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, BT * self.x_ld], 16]  # then bf16(dAm T^T)
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, BT * self.x_ld], 16]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, BT * self.x_ld], 16]
            sG: cute.struct.Align[cute.struct.MemRange[Float32, BT * self.g_ld], 16]
            sA: cute.struct.Align[cute.struct.MemRange[self.dtype, BT * self.a_ld], 16]
            sBeta: cute.struct.Align[cute.struct.MemRange[Float32, BT], 16]
            sDgk: cute.struct.Align[cute.struct.MemRange[Float32, 2 * DK], 16]  # sum_v S dS: two V halves
            sKdk: cute.struct.Align[cute.struct.MemRange[Float32, 4 * DK], 16]  # sum_t k dks per row block
            sDb: cute.struct.Align[cute.struct.MemRange[Float32, 2 * BT], 16]  # db's two column-half partials
            # raw_qk (empty otherwise): the item's q rows' 1 / norms, then its k rows'
            sRstd: cute.struct.Align[cute.struct.MemRange[Float32, 2 * BT if self.raw_qk else 0], 16]
            mbar: cute.struct.MemRange[cutlass.Int64, 4]  # the four load groups' completion, one phase an item

        self.storage = Storage
        self.kernel(
            mQ, mK, mV, mVn, mG, mBeta, mA, mH, mDo, mDh, mDu, mDq, mDk, mDv2, mDg, mDb, mDA, mCu, mCi, mQRstd, mKRstd,
            scale, seqlen, num_chunks, num_seqs,
        ).launch(
            grid=(num_ctas, 1, 1), block=(self.num_threads, 1, 1), stream=stream,
            min_blocks_per_mp=1, max_number_threads=[self.num_threads, 1, 1], preferred_smem_carveout=100,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mVn: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
        mA: cute.Tensor, mH: cute.Tensor, mDo: cute.Tensor, mDh: cute.Tensor, mDu: cute.Tensor, mDq: cute.Tensor,
        mDk: cute.Tensor, mDv2: cute.Tensor, mDg: cute.Tensor, mDb: cute.Tensor, mDA: cute.Tensor, mCu: cute.Tensor,
        mCi: cute.Tensor, mQRstd: cute.Tensor | None, mKRstd: cute.Tensor | None, scale: Float32, seqlen: Int32,
        num_chunks: Int32, num_seqs: Int32,
    ):  # fmt: skip
        BT, DK = self.bt, self.dk
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        HV = mDq.shape[1]
        group = HV // mQ.shape[1]
        total = num_chunks * HV * num_seqs

        st = SmemAllocator().allocate(self.storage)
        rows = cute.make_layout((BT, DK), stride=(self.x_ld, 1))
        sQ, sK = st.sQ.get_tensor(rows), st.sK.get_tensor(rows)
        sDo, sVn, sDu, sV = (x.get_tensor(rows) for x in (st.sDo, st.sVn, st.sDu, st.sV))
        sG = st.sG.get_tensor(cute.make_layout((BT, DK), stride=(self.g_ld, 1)))
        sA = st.sA.get_tensor(cute.make_layout((BT, BT), stride=(self.a_ld, 1)))
        sBeta = st.sBeta.get_tensor(cute.make_layout(BT))
        sDgk = st.sDgk.get_tensor(cute.make_layout((2, DK), stride=(DK, 1)))
        sKdk = st.sKdk.get_tensor(cute.make_layout((4, DK), stride=(DK, 1)))
        sDb = st.sDb.get_tensor(cute.make_layout((BT, 2), stride=(1, BT)))
        sRstd = st.sRstd.get_tensor(cute.make_layout((BT, 2), stride=(1, BT))) if const_expr(self.raw_qk) else None
        # the states as stored (rows of 128 + 8), and as (k, v) views whatever the layout
        state_rows = cute.make_layout((DK, DK), stride=(self.x_ld, 1))
        sHr, sDhr = st.sH.get_tensor(state_rows), st.sDh.get_tensor(state_rows)
        kv = cute.make_layout((DK, DK), stride=(1, self.x_ld) if self.state_v_first else (self.x_ld, 1))
        sS, sDS = st.sH.get_tensor(kv), st.sDh.get_tensor(kv)
        # transposed views: T^T (s, t), du^T (v, t), dw^T (k, t), M1^T (s', t); dw, k G, dAm, M1 reuse the rows
        # of do, v_new, du and v
        sAT = cute.make_tensor(sA.iterator, cute.make_layout((BT, BT), stride=(1, self.a_ld)))
        sDuT = cute.make_tensor(sDu.iterator, cute.make_layout((DK, BT), stride=(1, self.x_ld)))
        sDw, sKG = sDo, sVn
        sDwT = cute.make_tensor(sDw.iterator, cute.make_layout((DK, BT), stride=(1, self.x_ld)))
        sDAm = cute.make_tensor(sDu.iterator, cute.make_layout((BT, BT), stride=(self.x_ld, 1)))
        sM1 = cute.make_tensor(sV.iterator, cute.make_layout((BT, BT), stride=(self.x_ld, 1)))
        sM1T = cute.make_tensor(sV.iterator, cute.make_layout((BT, BT), stride=(1, self.x_ld)))

        tiled = cute.make_tiled_mma(warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)))
        rb = warp_idx % 4
        half = warp_idx // 4
        loads = (mQ, mK, mV, mVn, mG, mA, mH, mDo, mDh, mDu, sQ, sK, sV, sVn, sG, sA, sHr, sDhr, sDo, sDu)

        bars = st.mbar.data_ptr()
        if tidx == 0:
            for part in cutlass.range_constexpr(4):
                cute.arch.mbarrier_init(bars + part, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        # the first item's tiles, in the four groups the loop issues its successors' in
        first = self._item(mCu, mCi, bid, num_chunks, HV, group, seqlen, total)
        for part in cutlass.range_constexpr(4):
            self._load(loads, part, first, tidx, bars)
        beta = self._beta(mBeta, first, tidx)
        rstd = self._rstd(mQRstd, mKRstd, first, tidx)

        # one CTA an SM walks the items bid, bid + grid, ...: each item's loads go out in four groups as the
        # previous item frees the buffers they land in, so they arrive while that item computes; each group's
        # mbarrier completes one phase an item
        for item in cutlass.range(bid, total, grid, unroll=1):
            tok0, valid, _, hv, _ = self._item(mCu, mCi, item, num_chunks, HV, group, seqlen, total)
            nxt = self._item(mCu, mCi, item + grid, num_chunks, HV, group, seqlen, total)
            last = cutlass.max(valid - 1, 0)
            phase = ((item - bid) // grid) % 2

            # phase 1: P1 and P2 once the states, do and v_new are in (du, v, T may still be in flight); the
            # barrier publishes the zero rows past the sequence end, stored by other threads
            for part in cutlass.range_constexpr(3):
                cute.arch.mbarrier_wait(bars + part, phase)
            cute.arch.barrier()
            acc_dq, acc_dk = self._state_products(tiled, sDo, sVn, sS, sDS, rb, half, lane)
            self._state_channel_sums(sS, sDS, sDgk, tidx)
            if tidx < BT:
                sBeta[tidx] = beta
            if const_expr(self.raw_qk):
                if tidx < 2 * BT:
                    sRstd[tidx % BT, tidx // BT] = rstd
            cute.arch.mbarrier_wait(bars + 3, phase)
            cute.arch.barrier()
            acc_dw = n_tile_accumulators(tiled, 8)
            self._gemm(tiled, acc_dw, sDu, True, sS, not self.state_v_first, 16 * rb, 64 * half, self.dv // 16,
                       lane)  # fmt: skip
            dbp = self._dv2(tiled, sAT, sDuT, sBeta, sV, mDv2, tok0, hv, valid, rb, half, lane)
            acc_da = n_tile_accumulators(tiled, 4)
            self._gemm(tiled, acc_da, sDu, True, sV, True, 16 * rb, 32 * half, DK // 16, lane)
            self._free()
            self._load(loads, 0, nxt, tidx, bars)  # the states are read

            # E1: dq out; acc_dq <- q dq - k dks, acc_dk <- dks; -dw and k G to the rows of do and v_new
            self._epilogue_state(acc_dq, acc_dk, acc_dw, sQ, sK, sG, sDw, sKG, sKdk, sRstd, mDq, scale, tok0, hv,
                                 valid, last, rb, half, lane)  # fmt: skip
            self._free()
            self._load(loads, 1, nxt, tidx, bars)  # q is read

            # phase 2: P6, P7 and their epilogue
            acc_kgb = n_tile_accumulators(tiled, 8)
            self._gemm(tiled, acc_kgb, sAT, False, sDwT, False, 16 * rb, 64 * half, BT // 16, lane)
            self._gemm(tiled, acc_da, sDw, True, sKG, True, 16 * rb, 32 * half, DK // 16, lane)
            self._epilogue_wy(acc_kgb, acc_dq, acc_dk, sK, sG, sBeta, sDgk, sKdk, sDb, sRstd, mDk, mDg, dbp, tok0,
                              hv, valid, last, rb, half, lane)  # fmt: skip
            self._mask_da(acc_da, sBeta, sDAm, valid, rb, half, lane)
            self._free()
            self._load(loads, 2, nxt, tidx, bars)  # k, g, dw and k G are read

            # phase 3: dL = -T^T bf16(dAm T^T)
            acc_m1 = n_tile_accumulators(tiled, 4)
            self._gemm(tiled, acc_m1, sDAm, True, sA, True, 16 * rb, 32 * half, BT // 16, lane)
            self._store_c16(acc_m1, sM1, 16 * rb, 32 * half, lane)
            cute.arch.barrier()
            acc_dl = n_tile_accumulators(tiled, 4)
            self._gemm(tiled, acc_dl, sAT, False, sM1T, False, 16 * rb, 32 * half, BT // 16, lane)
            self._store_dl(acc_dl, mDA, tok0, hv, valid, rb, half, lane)
            if tidx < valid:
                mDb[tok0 + tidx, hv] = sDb[tidx, 0] + sDb[tidx, 1]
            self._free()
            self._load(loads, 3, nxt, tidx, bars)  # du (dAm), v (M1), T and db's partials are read
            beta = self._beta(mBeta, nxt, tidx)
            rstd = self._rstd(mQRstd, mKRstd, nxt, tidx)

    @cute.jit
    def _item(self, mCu, mCi, item, num_chunks, HV, group, seqlen, total):
        """``(tok0, valid, state row, value head, q / k head)`` of work item ``item`` (chunk fastest, then value
        head, then sequence); ``valid`` is 0 past the last item, so its loads only zero-fill."""
        bx = item % num_chunks
        hv = (item // num_chunks) % HV
        bz = item // (num_chunks * HV)
        tok0, valid = chunk_rows(self.varlen, mCu, mCi, bx, bz, seqlen, self.bt)
        valid = cutlass.select_(item < total, valid, 0)
        # the chunk's state row: its chunk-list row when packed, sequence-major when not
        tg = bx
        if const_expr(not self.varlen):
            tg = bz * num_chunks + bx
        return tok0, valid, tg, hv, hv // group

    # ------------------------------------------------------------------------------------------------ loads
    @cute.jit
    def _free(self):
        """Every thread done with the buffers the next load group overwrites: its shared-memory writes ordered
        before the async proxy's (the bulk copies land where bf16(-dw), k G, dAm, M1 and zero rows were written),
        then the CTA barrier."""
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier()

    @cute.jit
    def _load(self, loads, part: int, item, tidx, bars):
        """One of an item's four load groups, each issued once the previous item has read the buffers it lands in:
        0 the two states (as stored), 1 q, 2 k, g, do, v_new, 3 du, v, T; a thread a row by one bulk copy into its
        padded shared row (``bulk_token_rows``: zeros past the sequence end), completing on the group's mbarrier."""
        mQ, mK, mV, mVn, mG, mA, mH, mDo, mDh, mDu, sQ, sK, sV, sVn, sG, sA, sHr, sDhr, sDo, sDu = loads
        tok0, valid, tg, hv, h = item
        D = self.dk
        x_row = D * self.dtype.width // 8
        bar = bars + part
        if const_expr(part == 0):
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(bar, cutlass.select_(valid > 0, 2 * D * x_row, 0))
            if valid > 0:
                r = tidx % D
                if tidx < D:
                    bulk_row_copy(vec_at(mH, (tg, hv, r, 0), D, D), vec_at(sHr, (r, 0), 8, D), bar)
                else:
                    bulk_row_copy(vec_at(mDh, (tg, hv, r, 0), D, D), vec_at(sDhr, (r, 0), 8, D), bar)
        elif const_expr(part == 1):
            bulk_token_rows(((mQ, sQ, h),), tok0, valid, tidx, bar)
        elif const_expr(part == 2):
            bulk_token_rows(((mK, sK, h), (mDo, sDo, hv), (mVn, sVn, hv), (mG, sG, hv)), tok0, valid, tidx, bar)
        else:
            bulk_token_rows(((mDu, sDu, hv), (mV, sV, hv), (mA, sA, hv)), tok0, valid, tidx, bar)

    @cute.jit
    def _beta(self, mBeta, item, tidx):
        """Thread t < 64's beta of the item's row t as fp32 (0 past the sequence end), held in a register until the
        item's phase 1 stores it to shared memory, so that the load's latency is not waited for at once."""
        tok0, valid, _, hv, _ = item
        x = Float32(0.0)
        if tidx < valid:
            x = mBeta[tok0 + tidx, hv].to(Float32)
        return x

    @cute.jit
    def _rstd(self, mQRstd, mKRstd, item, tidx):
        """With ``raw_qk``, thread t < 128's 1 / norm of the item's q row t (t < 64) or k row t - 64 (0 past the
        sequence end, whose rows arrive as zeros), held in a register until phase 1 stores it, as beta; else 0."""
        x = Float32(0.0)
        if const_expr(self.raw_qk):
            tok0, valid, _, _, h = item
            t = tidx % self.bt
            if t < valid:
                if tidx < self.bt:
                    x = mQRstd[tok0 + t, h]
                elif tidx < 2 * self.bt:
                    x = mKRstd[tok0 + t, h]
        return x

    @cute.jit
    def _row_value(self, x, sRstd, t, which: int) -> Float32:
        """An element ``x`` of q's (``which`` 0) or k's (1) row t as fp32: as it is, or with ``raw_qk`` normalised
        and rounded back to the operand dtype (FLA's l2norm_fwd output)."""
        if const_expr(self.raw_qk):
            return (x.to(Float32) * sRstd[t, which]).to(self.dtype).to(Float32)
        return x.to(Float32)

    # ---------------------------------------------------------------------------------------------- products
    @cute.jit
    def _frag(self, tiled, s, i, ks, operand_a: bool, k_contiguous: bool, lane):
        """The A fragment (16 x 16: rows 16 i.., contraction columns 16 ks..) of the (M, K) view ``s``, or the B
        fragment (8 x 16: output columns 8 i..) of the (N, K) view ``s``, by ``ldmatrix``: each 8 x 8 matrix is 8
        rows of 16 bytes (the padded strides keep the 8 rows in distinct banks), transposed on the way where the
        contraction runs down the view's rows (T^T, du^T, dw^T, M1^T, the [V, K] states)."""
        rows = 16 if operand_a else 8
        atom = cute.make_copy_atom(
            warp.LdMatrix8x8x16bOp(transpose=not k_contiguous, num_matrices=rows // 4), self.dtype
        )
        if const_expr(operand_a):
            cp = cute.make_tiled_copy_A(atom, tiled)
            frag = cute.make_rmem_tensor(tiled.partition_shape_A((16, 16)), self.dtype)
        else:
            cp = cute.make_tiled_copy_B(atom, tiled)
            frag = cute.make_rmem_tensor(tiled.partition_shape_B((8, 16)), self.dtype)
        thr = cp.get_slice(lane)
        cute.copy(cp, thr.partition_S(cute.local_tile(s, (rows, 16), (i, ks))), thr.retile(frag))
        return frag

    @cute.jit
    def _gemm(self, tiled, accs, sa, a_contiguous: bool, sb, b_contiguous: bool, r0, n0, k_steps: int, lane):
        """``accs[nt] += sa[r0:r0+16, :] sb[n0 + 8 nt : +8, :]^T`` over ``k_steps`` x 16 contraction columns (r0, n0
        multiples of 16 and 8)."""
        for ks in cutlass.range(k_steps, unroll=2):
            fa = self._frag(tiled, sa, r0 // 16, ks, True, a_contiguous, lane)
            for nt in cutlass.range_constexpr(len(accs)):
                fb = self._frag(tiled, sb, n0 // 8 + nt, ks, False, b_contiguous, lane)
                cute.gemm(tiled, accs[nt], fa, fb, accs[nt])

    @cute.jit
    def _state_products(self, tiled, sDo, sVn, sS, sDS, rb, half, lane):
        """P1 (do S^T) and P2 (v_new dS^T) for rows 16 rb.. and channels 64 half.., over V."""
        acc_dq, acc_dk = n_tile_accumulators(tiled, 8), n_tile_accumulators(tiled, 8)
        b_contiguous = not self.state_v_first
        for ks in cutlass.range(self.dv // 16, unroll=2):
            fdo = self._frag(tiled, sDo, rb, ks, True, True, lane)
            fvn = self._frag(tiled, sVn, rb, ks, True, True, lane)
            for nt in cutlass.range_constexpr(8):
                fs = self._frag(tiled, sS, 8 * half + nt, ks, False, b_contiguous, lane)
                cute.gemm(tiled, acc_dq[nt], fdo, fs, acc_dq[nt])
                fds = self._frag(tiled, sDS, 8 * half + nt, ks, False, b_contiguous, lane)
                cute.gemm(tiled, acc_dk[nt], fvn, fds, acc_dk[nt])
        return acc_dq, acc_dk

    @cute.jit
    def _state_channel_sums(self, sS, sDS, sDgk, tidx):
        """``sDgk[h, k] = sum_v S[k, v] dS[k, v]`` over the V half h, one thread a (channel, half), in order of v;
        the epilogue adds the halves. ``[K, V]``: threads 2k, 2k + 1 take channel k's two halves, by 16-byte reads
        along its row; ``[V, K]``: threads k and k + 128, so that a warp reads 32 adjacent channels of a row (one
        bank each) rather than 16 channels of two rows 64 apart (the same banks)."""
        if const_expr(self.state_v_first):
            kk, hv = tidx % self.dk, tidx // self.dk
            acc = Float32(0.0)
            for v in cutlass.range_constexpr(64):
                acc = acc + sS[kk, 64 * hv + v].to(Float32) * sDS[kk, 64 * hv + v].to(Float32)
        else:
            kk, hv = tidx // 2, tidx % 2
            acc = Float32(0.0)
            for j in cutlass.range_constexpr(8):
                s8, d8 = cute.make_rmem_tensor(8, self.dtype), cute.make_rmem_tensor(8, self.dtype)
                cute.autovec_copy(vec_at(sS, (kk, 64 * hv + 8 * j)), s8)
                cute.autovec_copy(vec_at(sDS, (kk, 64 * hv + 8 * j)), d8)
                for v in cutlass.range_constexpr(8):
                    acc = acc + s8[v].to(Float32) * d8[v].to(Float32)
        sDgk[hv, kk] = acc

    # --------------------------------------------------------------------------------------------- epilogues
    @cute.jit
    def _dv2(self, tiled, sAT, sDuT, sBeta, sV, mDv2, tok0, hv, valid, rb, half, lane):
        """P5 ``dvb = T^T du`` for rows 16 rb.. and value columns 64 half..; dv2 = beta dvb out. Returns the rows'
        ``sum_v dvb v`` over these columns (a lane's two rows, quad-reduced later with the dkgb term)."""
        g_, c = lane // 4, lane % 4
        acc = n_tile_accumulators(tiled, 8)
        self._gemm(tiled, acc, sAT, False, sDuT, False, 16 * rb, 64 * half, self.bt // 16, lane)
        dbp = cute.make_rmem_tensor(2, Float32)
        for hh in cutlass.range_constexpr(2):
            t = 16 * rb + g_ + 8 * hh
            bt = sBeta[t]
            part = Float32(0.0)
            for nt in cutlass.range_constexpr(8):
                col = cute.assume(64 * half + 8 * nt + 2 * c, divby=2)
                v2 = cute.make_rmem_tensor(2, self.dtype)
                out = cute.make_rmem_tensor(2, self.dtype)
                cute.autovec_copy(vec_at(sV, (t, col), 2, 2), v2)
                for v in cutlass.range_constexpr(2):
                    x = acc[nt][v + 2 * hh]
                    out[v] = (x * bt).to(self.dtype)
                    part = part + x * v2[v].to(Float32)
                if t < valid:
                    cute.autovec_copy(out, vec_at(mDv2, (tok0 + t, hv, col), 2, 2))
            dbp[hh] = part
        return dbp

    @cute.jit
    def _epilogue_state(self, acc_dq, acc_dk, acc_dw, sQ, sK, sG, sDw, sKG, sKdk, sRstd, mDq, scale, tok0, hv, valid,
                        last, rb, half, lane):  # fmt: skip
        """E1 for rows 16 rb.. and channels 64 half..: dq out; ``acc_dq`` becomes ``q dq - k dks`` and ``acc_dk``
        dks; bf16(-dw) and bf16(k G) to shared rows; the row block's column sums of ``k dks`` to ``sKdk``."""
        g_, c = lane // 4, lane % 4
        for nt in cutlass.range_constexpr(8):
            col = cute.assume(64 * half + 8 * nt + 2 * c, divby=2)
            gn = cute.make_rmem_tensor(2, Float32)
            cute.autovec_copy(vec_at(sG, (last, col), 2, 2), gn)
            colsum = cute.make_rmem_tensor(2, Float32)
            colsum.fill(0.0)
            for hh in cutlass.range_constexpr(2):
                t = 16 * rb + g_ + 8 * hh
                gt, q2, k2 = (cute.make_rmem_tensor(2, x) for x in (Float32, self.dtype, self.dtype))
                cute.autovec_copy(vec_at(sG, (t, col), 2, 2), gt)
                cute.autovec_copy(vec_at(sQ, (t, col), 2, 2), q2)
                cute.autovec_copy(vec_at(sK, (t, col), 2, 2), k2)
                dq, nw, kg = (cute.make_rmem_tensor(2, x) for x in (Float32, self.dtype, self.dtype))
                for v in cutlass.range_constexpr(2):
                    i = v + 2 * hh
                    gexp = cute.math.exp2(gt[v], fastmath=True)
                    dq[v] = acc_dq[nt][i] * gexp * scale
                    dks = Float32(0.0)
                    if t < valid:
                        dks = acc_dk[nt][i] * cute.math.exp2(gn[v] - gt[v], fastmath=True)
                    kf = self._row_value(k2[v], sRstd, t, 1)
                    acc_dq[nt][i] = self._row_value(q2[v], sRstd, t, 0) * dq[v] - kf * dks
                    acc_dk[nt][i] = dks
                    colsum[v] = colsum[v] + kf * dks
                    nw[v] = (-acc_dw[nt][i]).to(self.dtype)
                    kg[v] = (kf * gexp).to(self.dtype)
                if t < valid:
                    cute.autovec_copy(dq, vec_at(mDq, (tok0 + t, hv, col), 2, 2))
                cute.autovec_copy(nw, vec_at(sDw, (t, col), 2, 2))
                cute.autovec_copy(kg, vec_at(sKG, (t, col), 2, 2))
            # the row block's 16 rows: the eight row groups of the warp
            for v in cutlass.range_constexpr(2):
                x = colsum[v]
                for off in cutlass.range_constexpr(3):
                    x = x + cute.arch.shuffle_sync_bfly(x, offset=4 << off)
                if g_ == 0:
                    sKdk[rb, col + v] = x

    @cute.jit
    def _epilogue_wy(self, acc_kgb, acc_dg, acc_dks, sK, sG, sBeta, sDgk, sKdk, sDb, sRstd, mDk, mDg, dbp, tok0, hv,
                     valid, last, rb, half, lane):  # fmt: skip
        """Phase 2's epilogue for rows 16 rb.. and channels 64 half..: dk, dg out (the last row adds the channel
        sums), the rows' db partials (with P5's) to ``sDb``."""
        g_, c = lane // 4, lane % 4
        for hh in cutlass.range_constexpr(2):
            t = 16 * rb + g_ + 8 * hh
            bt = sBeta[t]
            part = dbp[hh]
            for nt in cutlass.range_constexpr(8):
                col = cute.assume(64 * half + 8 * nt + 2 * c, divby=2)
                gt, gn, k2 = (cute.make_rmem_tensor(2, x) for x in (Float32, Float32, self.dtype))
                cute.autovec_copy(vec_at(sG, (t, col), 2, 2), gt)
                cute.autovec_copy(vec_at(sG, (last, col), 2, 2), gn)
                cute.autovec_copy(vec_at(sK, (t, col), 2, 2), k2)
                dk, dg = cute.make_rmem_tensor(2, Float32), cute.make_rmem_tensor(2, Float32)
                for v in cutlass.range_constexpr(2):
                    i = v + 2 * hh
                    gexp = cute.math.exp2(gt[v], fastmath=True)
                    kg = self._row_value(k2[v], sRstd, t, 1) * gexp
                    x = acc_kgb[nt][i]
                    dk[v] = acc_dks[nt][i] + x * gexp * bt
                    dg[v] = acc_dg[nt][i] + kg * x * bt
                    if t == last:
                        ch = col + v
                        dg[v] = dg[v] + cute.math.exp2(gn[v], fastmath=True) * (sDgk[0, ch] + sDgk[1, ch]) + (
                            sKdk[0, ch] + sKdk[1, ch] + sKdk[2, ch] + sKdk[3, ch])
                    part = part + x * kg
                if t < valid:
                    cute.autovec_copy(dk, vec_at(mDk, (tok0 + t, hv, col), 2, 2))
                    cute.autovec_copy(dg, vec_at(mDg, (tok0 + t, hv, col), 2, 2))
            # the row's sum over this half's columns: the quad's four lanes
            part = part + cute.arch.shuffle_sync_bfly(part, offset=1)
            part = part + cute.arch.shuffle_sync_bfly(part, offset=2)
            if c == 0:
                sDb[t, half] = part

    @cute.jit
    def _mask_da(self, acc_da, sBeta, sDAm, valid, rb, half, lane):
        """``dAm = bf16(dA beta_s)`` on t > s (both in the sequence), 0 elsewhere, to shared rows."""
        g_, c = lane // 4, lane % 4
        for hh in cutlass.range_constexpr(2):
            t = 16 * rb + g_ + 8 * hh
            for nt in cutlass.range_constexpr(4):
                col = cute.assume(32 * half + 8 * nt + 2 * c, divby=2)
                out = cute.make_rmem_tensor(2, self.dtype)
                for v in cutlass.range_constexpr(2):
                    s = col + v
                    keep = (t > s) & (t < valid)
                    x = Float32(cutlass.select_(keep, acc_da[nt][v + 2 * hh] * sBeta[s], Float32(0.0)))
                    out[v] = x.to(self.dtype)
                cute.autovec_copy(out, vec_at(sDAm, (t, col), 2, 2))

    @cute.jit
    def _store_c16(self, accs, s, r0, n0, lane):
        """The [16 x 8n] accumulators rounded to the operand dtype into rows r0.. and columns n0.. of ``s``."""
        g_, c = lane // 4, lane % 4
        for hh in cutlass.range_constexpr(2):
            for nt in cutlass.range_constexpr(len(accs)):
                out = cute.make_rmem_tensor(2, self.dtype)
                for v in cutlass.range_constexpr(2):
                    out[v] = accs[nt][v + 2 * hh].to(self.dtype)
                col = cute.assume(n0 + 8 * nt + 2 * c, divby=2)
                cute.autovec_copy(out, vec_at(s, (r0 + g_ + 8 * hh, col), 2, 2))

    @cute.jit
    def _store_dl(self, acc_dl, mDA, tok0, hv, valid, rb, half, lane):
        """dA out: ``-dL`` on t > s, 0 elsewhere, rows in the sequence, all 64 columns."""
        g_, c = lane // 4, lane % 4
        for hh in cutlass.range_constexpr(2):
            t = 16 * rb + g_ + 8 * hh
            if t < valid:
                for nt in cutlass.range_constexpr(4):
                    col = cute.assume(32 * half + 8 * nt + 2 * c, divby=2)
                    out = cute.make_rmem_tensor(2, Float32)
                    for v in cutlass.range_constexpr(2):
                        out[v] = Float32(cutlass.select_(t > col + v, -acc_dl[nt][v + 2 * hh], Float32(0.0)))
                    cute.autovec_copy(out, vec_at(mDA, (tok0 + t, hv, col), 2, 2))


def _compile(dtype, beta_dtype, state_v_first, varlen, arch=(9, 0), extra_options="", raw_qk=False):
    """Trace and compile one variant against fake tensors (no GPU needed). Returns the TVM-FFI callable."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    D, BT = 128, 64
    dtype, beta_dtype = dsl_type(dtype), dsl_type(beta_dtype)
    kernel = ChunkKDABwdWyDqkgSm90(dtype=dtype, beta_dtype=beta_dtype, state_v_first=state_v_first, varlen=varlen,
                                   raw_qk=raw_qk)  # fmt: skip
    tt, nt, h, hv = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()

    def tok(dt, heads, d):
        return make_fake_tensor(dt, (tt, heads, d), (cute.sym_int64(divisibility=d), d, 1), assumed_align=16)

    def per_head(dt):
        return make_fake_tensor(dt, (tt, hv), (cute.sym_int64(), 1), assumed_align=dt.width // 8)

    def per_head_h():  # (T, H) fp32: the 1 / norms of raw_qk
        return make_fake_tensor(Float32, (tt, h), (cute.sym_int64(), 1), assumed_align=4)

    def state():
        return make_fake_tensor(dtype, (nt, hv, D, D), (cute.sym_int64(divisibility=D * D), D * D, D, 1),
                                assumed_align=16)  # fmt: skip

    args = (
        tok(dtype, h, D), tok(dtype, h, D), tok(dtype, hv, D), tok(dtype, hv, D), tok(Float32, hv, D),
        per_head(beta_dtype), tok(dtype, hv, BT), state(), tok(dtype, hv, D), state(), tok(dtype, hv, D),
        tok(Float32, hv, D), tok(Float32, hv, D), tok(dtype, hv, D), tok(Float32, hv, D), per_head(Float32),
        tok(Float32, hv, BT),
        make_fake_compact_tensor(Int32, (cute.sym_int32(),), stride_order=(0,), assumed_align=4),
        make_fake_tensor(Int32, (cute.sym_int32(), 2), (2, 1), assumed_align=8),
        *((per_head_h(), per_head_h()) if raw_qk else (None, None)),
        Float32(1.0), Int32(1), Int32(1), Int32(1), Int32(1),
        make_fake_stream(use_tvm_ffi_env_stream=True),
    )  # fmt: skip
    return cute.compile(kernel, *args, options=compile_options(arch, extra_options))
