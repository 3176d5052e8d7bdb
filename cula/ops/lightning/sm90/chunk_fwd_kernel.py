"""Lightning attention prefill (simple GLA with a constant per-head decay) for SM90: TMA + WGMMA.

Math, per value head ``hv`` (q/k head ``h = hv // (HV // H)``), ``lam = exp(-decay[hv])``:

    S_t = lam * S_{t-1} + k_t v_t^T          (S: fp32 [K, V])
    o_t = scale * S_t^T q_t

Chunked with C = 64 (i, j positions inside a chunk, L valid rows in the chunk):

    o_i    = scale * (lam^(i+1) q_i S_prev + sum_{j<=i} lam^(i-j) (q_i . k_j) v_j)
    S_next = lam^L S_prev + sum_{j<L} lam^(L-1-j) k_j v_j^T

Every power of lam is formed as exp2(-decay * log2(e) * n) from its own exponent n >= 0, never as a
ratio of two powers, so a strong decay underflows to 0 instead of producing inf * 0.

Kernel organisation (one CTA per (V slice of 64 columns, value head, sequence)):

    warpgroup 0 (warp 0)  TMA producer: q [64, K], k [64, K], v^T [64 (V slice), 64] per chunk into a
                          2-stage ring (PipelineTmaAsync, one mbarrier pair per stage)
    warpgroup 1           the math. The transposed state S^T (fp32 [64 V, K]) lives in its registers
                          as a WGMMA accumulator for the whole sequence. Per chunk:

        1. P    = q k^T                       SS  M=i  N=j  K=K     (both operands K-major)
           O^T  = bf16(S^T) q^T               RS  M=v  N=i  K=K     (state as the register A operand)
        2. while those run: v^T (ldmatrix) * lam^(L-1-j) -> bf16 A fragment
        3. wait; S^T *= lam^L; O^T columns *= scale lam^(i+1); S^T += (v^T w) k
                                              RS  M=v  N=K  K=j     (k read MN-major)
        4. while that runs: P *= scale lam^(i-j) [j<=i] -> bf16 -> smem (stmatrix)
           O^T += v^T P^T                     SS  M=v  N=i  K=j
        5. O^T -> bf16 -> smem (stmatrix, transposed) -> TMA store; a partial last chunk is stored
           with predicated direct stores instead, so nothing lands past the sequence end.

``states_only``: the end state alone (the time-parallel prefill's first pass, ``cula.lightning.time_parallel``):
the producer loads k and v^T, the math warpgroup runs step 2's weights and step 3's state update only, and nothing
but the final state is written; half the bytes of a full pass.

Rows of the last chunk past the sequence end are read (TMA zero-fills past the tensor end; inside a
packed varlen batch they hold the next sequence) but never used: the causal mask keeps them out of
valid o rows, and their state weight lam^(L-1-j) is forced to 0. Splitting V over two CTAs costs a
second q k^T per chunk, but doubles the CTAs (B*H = 64 heads fill 128 SMs) and lets two CTAs share
an SM (about 104 KB smem and 128 registers per thread at launch each), so one CTA's elementwise work
overlaps the other's tensor-core work.
"""
from __future__ import annotations

import enum

import cuda.bindings.driver as cuda
import cutlass
import cutlass.utils.hopper_helpers as sm90
from cutlass import BFloat16, Float32, Int32, const_expr, cute, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warp, warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from cula.cache import compile_options
from cula.ops.cute_common import FIRST_NAMED_BARRIER, acc_as_a_frag
from cula.ops.lightning.sm90.chunk_fwd import CHUNK, SUPPORTED_HEAD_DIMS, V_TILE

__all__ = ["LightningFwdSm90"]

LOG2E = 1.4426950408889634


class Barrier(enum.IntEnum):
    """Named barriers (0 is the CTA-wide one), both among the 128 math threads only."""

    P_READY = FIRST_NAMED_BARRIER  # P tile written to smem; also orders reuse of the o staging buffer
    O_READY = FIRST_NAMED_BARRIER + 1  # o tile written to smem, the TMA store may read it


def _transpose_view(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a (possibly swizzled) tensor: the same smem read the other way."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


class LightningFwdSm90:
    """Chunked Lightning-attention forward for sm_90a (see the module docstring for the schedule).

    Static configuration: head dim (64 or 128, K == V), whether an initial / final state is given,
    packed varlen (cu_seqlens) or padded batch, the state layout ([V, K] when ``state_v_first`` else
    [K, V]) and ``states_only`` (no q, no output). Everything else (B, T, N, H, HV) is a runtime size.
    """

    arch = 90

    def __init__(self, head_dim: int, has_h0: bool, has_ht: bool, varlen: bool, state_v_first: bool,
                 states_only: bool = False):  # fmt: skip
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
        if states_only and not has_ht:
            raise ValueError("a states-only variant writes the final state: has_ht must be set")
        self.dk = self.dv = head_dim
        self.has_h0, self.has_ht, self.varlen = has_h0, has_ht, varlen
        self.states_only = states_only
        self.state_v_first = state_v_first
        self.v_splits = head_dim // V_TILE
        self.stages = 2
        self.num_threads = 256  # producer warpgroup + one math warpgroup
        # Two CTAs per SM: 128 registers per thread at launch; the producer gives 104 of them to the
        # math warpgroup (24 + 232 = 2 * 128).
        self.producer_regs, self.math_regs = 24, 232
        self.min_blocks_per_sm = 2

    @cute.jit
    def __call__(self, mQ: cute.Tensor | None, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor | None,
                 mDecay: cute.Tensor, mH0: cute.Tensor | None, mHt: cute.Tensor | None,
                 mCu: cute.Tensor | None, scale: Float32, stream: cuda.CUstream):
        # torch layouts: q, k [B, T, H, K]; v, o [B, T, HV, V] (B == 1 when varlen);
        # decay [HV]; h0 / ht [N, HV, K, V] or [N, HV, V, K] fp32; cu_seqlens [N + 1] int32.
        DK, BT, VT = self.dk, CHUNK, V_TILE
        k = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))   # (T, K, H, B)
        vt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))  # (V, T, HV, B)

        mma_p = sm90.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1), tiler_mn=(BT, BT))
        mma_o = sm90.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1),
            tiler_mn=(VT, BT), a_source=warpgroup.OperandSource.RMEM)
        mma_s = sm90.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN, Float32, (1, 1, 1),
            tiler_mn=(VT, DK), a_source=warpgroup.OperandSource.RMEM)
        mma_pv = sm90.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.MN, OperandMajorMode.K, Float32, (1, 1, 1), tiler_mn=(VT, BT))

        # q and k share one K-major layout: rows are tokens, 128-byte swizzled rows of head dim.
        sQ_l = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BT, BT, DK), BFloat16, self.stages)  # (BT, K, S)
        sV_l = sm90.make_smem_layout_a(LayoutEnum.COL_MAJOR, (VT, BT, BT), BFloat16, self.stages)  # (VT, BT, S)
        sP_l = sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (VT, BT, BT), BFloat16, 1)            # (i, j, 1)
        sO_l = sm90.make_smem_layout_epi(BFloat16, LayoutEnum.COL_MAJOR, (VT, BT), 2)              # (VT, BT, 2)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        one_q = cute.select(sQ_l, mode=[0, 1])
        tma_q, tq, tma_o, to, ot = None, None, None, None, None
        if const_expr(not self.states_only):
            q = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 3, 2, 0]))   # (T, K, H, B)
            ot = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[3, 1, 2, 0]))  # (V, T, HV, B)
            tma_q, tq = cpasync.make_tiled_tma_atom(g2s, q, one_q, (BT, DK))
        tma_k, tk = cpasync.make_tiled_tma_atom(g2s, k, one_q, (BT, DK))
        tma_v, tv = cpasync.make_tiled_tma_atom(g2s, vt, cute.select(sV_l, mode=[0, 1]), (VT, BT))
        if const_expr(not self.states_only):
            tma_o, to = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), ot, cute.select(sO_l, mode=[0, 1]), (VT, BT))
        self.tx_bytes = ((1 if self.states_only else 2) * BT * DK + VT * BT) * BFloat16.width // 8

        hT, h0T = None, None
        state_modes = [2, 3, 1, 0] if const_expr(self.state_v_first) else [3, 2, 1, 0]
        if const_expr(self.has_h0):
            h0T = cute.make_tensor(mH0.iterator, cute.select(mH0.layout, mode=state_modes))  # (V, K, HV, N)
        if const_expr(self.has_ht):
            hT = cute.make_tensor(mHt.iterator, cute.select(mHt.layout, mode=state_modes))   # (V, K, HV, N)

        @cute.struct
        class Storage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_l)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_l)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sV_l)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sP_l)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sO_l)], 1024]

        self.storage = Storage
        if const_expr(self.varlen):
            num_seqs = mCu.shape[0] - 1
        else:
            num_seqs = mK.shape[0]
        self.kernel(tma_q, tq, tma_k, tk, tma_v, tv, tma_o, to, ot, mDecay, h0T, hT, mCu, scale,
                    mma_p, mma_o, mma_s, mma_pv, sQ_l, sV_l, sP_l, sO_l).launch(
            grid=(self.v_splits, mV.shape[2], num_seqs), block=(self.num_threads, 1, 1), stream=stream,
            min_blocks_per_mp=self.min_blocks_per_sm,
            # all of the unified L1/smem as smem (percent), so two ~104 KB CTAs fit on one SM; also
            # keeps launch() from querying a device at trace time
            preferred_smem_carveout=100)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom | None, tq: cute.Tensor | None, tma_k: cute.CopyAtom, tk: cute.Tensor,
               tma_v: cute.CopyAtom, tv: cute.Tensor, tma_o: cute.CopyAtom | None, to: cute.Tensor | None,
               ot: cute.Tensor | None, mDecay: cute.Tensor, h0T: cute.Tensor | None, hT: cute.Tensor | None,
               mCu: cute.Tensor | None, scale: Float32,
               mma_p: cute.TiledMma, mma_o: cute.TiledMma, mma_s: cute.TiledMma, mma_pv: cute.TiledMma,
               sQ_l: cute.ComposedLayout, sV_l: cute.ComposedLayout, sP_l: cute.ComposedLayout,
               sO_l: cute.ComposedLayout):
        DK, BT, VT = self.dk, CHUNK, V_TILE
        tidx, _, _ = cute.arch.thread_idx()
        vs, hv, n = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if warp_idx == 0:
            for atom in (tma_k, tma_v) if const_expr(self.states_only) else (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)

        h = hv // (tv.shape[2] // tk.shape[2])  # GVA: HV / H value heads share one q/k head
        if const_expr(self.varlen):
            bos = mCu[n]
            seqlen = mCu[n + 1] - bos
            b = 0
        else:
            bos = Int32(0)
            seqlen = tk.shape[0]
            b = n
        num_chunks = (seqlen + BT - 1) // BT

        storage = SmemAllocator().allocate(self.storage)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # consumer_release arrives once per warp when the cluster size is 1
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
            tx_count=self.tx_bytes)
        sQ = storage.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)
        sK = storage.sK.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)
        sV = storage.sV.get_tensor(sV_l.outer, swizzle=sV_l.inner)
        sP = storage.sP.get_tensor(sP_l.outer, swizzle=sP_l.inner)
        sO = storage.sO.get_tensor(sO_l.outer, swizzle=sO_l.inner)

        # Token offsets of this sequence; chunk c of the tiles starts at token bos + 64 c.
        gK = cute.local_tile(cute.domain_offset((bos, 0), tk[None, None, h, b]), (BT, DK), (None, 0))
        gV = cute.local_tile(cute.domain_offset((0, bos), tv[None, None, hv, b]), (VT, BT), (vs, None))

        if wg_idx == 0:  # ---------------- producer ----------------
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:  # whole warp: the TMA issue and expect_tx are elect_one'd inside
                tQs, tQg = None, None
                if const_expr(not self.states_only):
                    gQ = cute.local_tile(cute.domain_offset((bos, 0), tq[None, None, h, b]), (BT, DK), (None, 0))
                    tQs, tQg = cpasync.tma_partition(tma_q, 0, cute.make_layout(1),
                                                     cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
                tKs, tKg = cpasync.tma_partition(tma_k, 0, cute.make_layout(1),
                                                 cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
                tVs, tVg = cpasync.tma_partition(tma_v, 0, cute.make_layout(1),
                                                 cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
                st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                for c in cutlass.range(num_chunks, unroll=1):
                    pipe.producer_acquire(st)
                    bar = pipe.producer_get_barrier(st)
                    if const_expr(not self.states_only):
                        cute.copy(tma_q, tQg[None, c], tQs[None, st.index], tma_bar_ptr=bar)
                    cute.copy(tma_k, tKg[None, c], tKs[None, st.index], tma_bar_ptr=bar)
                    cute.copy(tma_v, tVg[None, c], tVs[None, st.index], tma_bar_ptr=bar)
                    pipe.producer_commit(st)
                    st.advance()
                pipe.producer_tail(st)
        else:  # ---------------- math warpgroup ----------------
            cute.arch.setmaxregister_increase(self.math_regs)
            if const_expr(self.states_only):
                self.states(pipe, num_chunks, seqlen, n, hv, vs, mDecay[hv], h0T, hT, sK, sV, mma_s)
            else:
                self.math(pipe, num_chunks, seqlen, bos, b, n, hv, vs, mDecay[hv], scale, h0T, hT, ot, to, tma_o,
                          sQ, sK, sV, sP, sO, mma_p, mma_o, mma_s, mma_pv, warp_idx)

    @cute.jit
    def math(self, pipe, num_chunks: Int32, seqlen: Int32, bos: Int32, b, n: Int32, hv: Int32, vs: Int32,
             decay: Float32, scale: Float32, h0T, hT, ot: cute.Tensor, to: cute.Tensor,
             tma_o: cute.CopyAtom, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, sP: cute.Tensor,
             sO: cute.Tensor, mma_p: cute.TiledMma, mma_o: cute.TiledMma, mma_s: cute.TiledMma,
             mma_pv: cute.TiledMma, warp_idx: Int32):
        DK, BT, VT = self.dk, CHUNK, V_TILE
        tidx, _, _ = cute.arch.thread_idx()
        mtid = tidx - 128
        is_store_warp = warp_idx == 4
        log2_lam = -decay * LOG2E  # lam^n = exp2(n * log2_lam), n >= 0

        thr_p, thr_o = mma_p.get_slice(mtid), mma_o.get_slice(mtid)
        thr_s = mma_s.get_slice(mtid)
        wg_p, wg_o, wg_s, wg_pv = mma_p.get_slice(0), mma_o.get_slice(0), mma_s.get_slice(0), mma_pv.get_slice(0)

        # operands: smem descriptors (S) or registers (R)
        tPsQ = wg_p.make_fragment_A(wg_p.partition_A(sQ))
        tPsK = wg_p.make_fragment_B(wg_p.partition_B(sK))
        tOrS = wg_o.make_fragment_A(wg_o.partition_shape_A((VT, DK)))       # bf16 S^T
        tOsQ = wg_o.make_fragment_B(wg_o.partition_B(sQ))
        tSrV = wg_s.make_fragment_A(wg_s.partition_shape_A((VT, BT)))       # bf16 v^T * lam^(L-1-j)
        tSsK = wg_s.make_fragment_B(wg_s.partition_B(_transpose_view(sK)))  # k read as (K, BT)
        tVsV = wg_pv.make_fragment_A(wg_pv.partition_A(sV))
        tVsP = wg_pv.make_fragment_B(wg_pv.partition_B(sP))

        accP = cute.make_rmem_tensor(wg_p.partition_shape_C((BT, BT)), Float32)
        accO = cute.make_rmem_tensor(wg_o.partition_shape_C((VT, BT)), Float32)
        accS = cute.make_rmem_tensor(wg_s.partition_shape_C((VT, DK)), Float32)  # S^T slice

        # coordinates of every register element: P (i, j), O^T (v, i), v^T fragment (v, j)
        cP = thr_p.partition_C(cute.make_identity_tensor((BT, BT)))
        cO = thr_o.partition_C(cute.make_identity_tensor((VT, BT)))
        cV = thr_s.partition_A(cute.make_identity_tensor((VT, BT)))

        # v^T tile (V-contiguous in smem) -> A fragment with transposing ldmatrix
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), BFloat16)
        cp_v = cute.make_tiled_copy_A(ldsm_t, mma_s).get_slice(mtid)
        tCsV = cp_v.partition_S(sV)
        tCrV = cp_v.retile(tSrV)
        # P (j-contiguous) and O^T (V-contiguous, so the transposing stmatrix) register -> smem
        cp_p = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16), mma_p)
        thr_cp_p = cp_p.get_slice(mtid)
        tCsP = thr_cp_p.partition_D(sP)
        cp_o = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), BFloat16), mma_o)
        thr_cp_o = cp_o.get_slice(mtid)
        tCsO = thr_cp_o.partition_D(sO)
        rP16 = cute.make_rmem_tensor(accP.layout, BFloat16)
        rO16 = cute.make_rmem_tensor(accO.layout, BFloat16)
        tCrP = thr_cp_p.retile(rP16)
        tCrO = thr_cp_o.retile(rO16)

        # o: TMA store tiles for full chunks, plain predicated stores for a partial last chunk
        gO_tma = cute.local_tile(cute.domain_offset((0, bos), to[None, None, hv, b]), (VT, BT), (vs, None))
        tOs, tOg = cpasync.tma_partition(tma_o, 0, cute.make_layout(1),
                                         cute.group_modes(sO, 0, 2), cute.group_modes(gO_tma, 0, 2))
        gO = cute.local_tile(cute.domain_offset((0, bos), ot[None, None, hv, b]), (VT, BT), (vs, None))

        if const_expr(self.has_h0):
            gH0 = cute.local_tile(h0T[None, None, hv, n], (VT, DK), (vs, 0))
            accS.store(thr_s.partition_C(gH0).load())
        else:
            accS.fill(0.0)
        tOrS.store(acc_as_a_frag(accS).load().to(BFloat16))

        st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for c in cutlass.range(num_chunks, unroll=1):
            L = cutlass.min(seqlen - c * BT, BT)
            pipe.consumer_wait(st)
            s = st.index
            # 1. P = q k^T and O^T = S^T q^T (inter-chunk part) on the tensor cores
            warpgroup.fence()
            self._gemm(mma_p, accP, tPsQ, tPsK, s, s, True)
            self._gemm(mma_o, accO, tOrS, tOsQ, None, s, True)
            warpgroup.commit_group()
            # 2. meanwhile: state weights lam^(L-1-j) (0 past the end) on v^T, and S^T *= lam^L
            cute.copy(cp_v, tCsV[None, None, None, s], tCrV)
            self._weigh_v(tSrV, cV, L, log2_lam)
            lam_L = cute.math.exp2(log2_lam * Float32(L), fastmath=True)
            warpgroup.wait_group(0)
            # (not overlapped with the GEMMs above: ptxas then serialises them, C7517)
            accS.store(accS.load() * lam_L)
            # 3. O^T column i *= scale lam^(i+1); then S^T += (v^T w) k
            for e in cutlass.range_constexpr(cute.size(accO)):
                i = cO[e][1]
                accO[e] = accO[e] * (scale * cute.math.exp2(log2_lam * Float32(i + 1), fastmath=True))
            warpgroup.fence()
            self._gemm(mma_s, accS, tSrV, tSsK, None, s, False)
            warpgroup.commit_group()
            # 4. intra-chunk: P *= scale lam^(i-j) on and below the diagonal, 0 above
            for e in cutlass.range_constexpr(cute.size(accP)):
                i, j = cP[e]
                f = Float32(0.0)
                if j <= i:
                    f = scale * cute.math.exp2(log2_lam * Float32(i - j), fastmath=True)
                accP[e] = accP[e] * f
            rP16.store(accP.load().to(BFloat16))
            cute.copy(cp_p, tCrP, tCsP[None, None, None, 0])
            cute.arch.fence_view_async_shared()
            if is_store_warp:
                # the o store issued two chunks ago read the staging buffer this chunk will write
                cute.arch.cp_async_bulk_wait_group(1, read=True)
            cute.arch.barrier(barrier_id=Barrier.P_READY, number_of_threads=128)
            warpgroup.fence()
            self._gemm(mma_pv, accO, tVsV, tVsP, s, 0, False)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            pipe.consumer_release(st)
            tOrS.store(acc_as_a_frag(accS).load().to(BFloat16))
            # 5. epilogue
            rO16.store(accO.load().to(BFloat16))
            if L == BT:
                buf = c % 2
                cute.copy(cp_o, tCrO, tCsO[None, None, None, buf])
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=Barrier.O_READY, number_of_threads=128)
                if is_store_warp:
                    # a TMA store is not elect_one'd by cute.copy; issue and commit from one lane
                    with cute.arch.elect_one():
                        cute.copy(tma_o, tOs[None, buf], tOg[None, c])
                        cute.arch.cp_async_bulk_commit_group()
            else:
                tOgO = thr_o.partition_C(gO[None, None, c])
                for e in cutlass.range_constexpr(cute.size(rO16)):
                    if cO[e][1] < L:
                        tOgO[e] = rO16[e]
            st.advance()

        if is_store_warp:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        if const_expr(self.has_ht):
            gHt = cute.local_tile(hT[None, None, hv, n], (VT, DK), (vs, 0))
            thr_s.partition_C(gHt).store(accS.load())

    @cute.jit
    def states(self, pipe, num_chunks: Int32, seqlen: Int32, n: Int32, hv: Int32, vs: Int32, decay: Float32,
               h0T, hT, sK: cute.Tensor, sV: cute.Tensor, mma_s: cute.TiledMma):
        """``states_only``: steps 2 and 3's state update alone, chunk by chunk, then the final state."""
        DK, BT, VT = self.dk, CHUNK, V_TILE
        tidx, _, _ = cute.arch.thread_idx()
        mtid = tidx - 128
        log2_lam = -decay * LOG2E
        thr_s, wg_s = mma_s.get_slice(mtid), mma_s.get_slice(0)
        tSrV = wg_s.make_fragment_A(wg_s.partition_shape_A((VT, BT)))
        tSsK = wg_s.make_fragment_B(wg_s.partition_B(_transpose_view(sK)))
        accS = cute.make_rmem_tensor(wg_s.partition_shape_C((VT, DK)), Float32)
        cV = thr_s.partition_A(cute.make_identity_tensor((VT, BT)))
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), BFloat16)
        cp_v = cute.make_tiled_copy_A(ldsm_t, mma_s).get_slice(mtid)
        tCsV = cp_v.partition_S(sV)
        tCrV = cp_v.retile(tSrV)
        if const_expr(self.has_h0):
            accS.store(thr_s.partition_C(cute.local_tile(h0T[None, None, hv, n], (VT, DK), (vs, 0))).load())
        else:
            accS.fill(0.0)

        st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for c in cutlass.range(num_chunks, unroll=1):
            L = cutlass.min(seqlen - c * BT, BT)
            pipe.consumer_wait(st)
            s = st.index
            cute.copy(cp_v, tCsV[None, None, None, s], tCrV)
            self._weigh_v(tSrV, cV, L, log2_lam)
            accS.store(accS.load() * cute.math.exp2(log2_lam * Float32(L), fastmath=True))
            warpgroup.fence()
            self._gemm(mma_s, accS, tSrV, tSsK, None, s, False)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            pipe.consumer_release(st)
            st.advance()
        thr_s.partition_C(cute.local_tile(hT[None, None, hv, n], (VT, DK), (vs, 0))).store(accS.load())

    @staticmethod
    @cute.jit
    def _weigh_v(tSrV: cute.Tensor, cV: cute.Tensor, L: Int32, log2_lam: Float32):
        """The state weights lam^(L-1-j) on the v^T fragment's columns j, 0 past the chunk's L rows."""
        for e in cutlass.range_constexpr(cute.size(tSrV)):
            j = cV[e][1]
            w = Float32(0.0)
            if j < L:
                w = cute.math.exp2(log2_lam * Float32(L - 1 - j), fastmath=True)
            tSrV[e] = (Float32(tSrV[e]) * w).to(BFloat16)

    @staticmethod
    @cute.jit
    def _gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
              a_stage, b_stage, zero_init: cutlass.Constexpr[bool]):
        # a fresh atom per call: toggling ACCUMULATE on the shared tiled_mma inside a runtime loop
        # makes the first value not dominate later uses
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for kb in cutlass.range_constexpr(cute.size(tA, mode=[2])):
            a = tA[None, None, kb] if const_expr(a_stage is None) else tA[None, None, kb, a_stage]
            cute.gemm(atom, acc, a, tB[None, None, kb, b_stage], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)



# ----------------------------------------------------------------------------------------------
# host side


def _fake(dtype, shape):
    """Fake row-major tensor; symbolic entries of ``shape`` stay runtime sizes."""
    return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))),
                                    assumed_align=16)


def _compile(head_dim: int, has_h0: bool, has_ht: bool, varlen: bool, state_v_first: bool, arch=(9, 0),
             states_only: bool = False):  # fmt: skip
    """Trace and compile one variant against fake tensors (no GPU needed). Returns the TVM-FFI callable
    ``fn(q, k, v, o, decay, h0, ht, cu_seqlens, scale)`` taking torch tensors (None where absent: q and o with
    ``states_only``)."""
    B, T, H, HV = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    N = cute.sym_int32() if varlen else B
    D = head_dim
    q = None if states_only else _fake(BFloat16, (B, T, H, D))
    k = _fake(BFloat16, (B, T, H, D))
    v = _fake(BFloat16, (B, T, HV, D))
    o = None if states_only else _fake(BFloat16, (B, T, HV, D))
    decay = make_fake_compact_tensor(Float32, (HV,), assumed_align=4)
    h0 = _fake(Float32, (N, HV, D, D)) if has_h0 else None
    ht = _fake(Float32, (N, HV, D, D)) if has_ht else None
    cu = make_fake_compact_tensor(Int32, (cute.sym_int32(),), assumed_align=4) if varlen else None
    kernel = LightningFwdSm90(head_dim, has_h0, has_ht, varlen, state_v_first, states_only)
    return cute.compile(kernel, q, k, v, o, decay, h0, ht, cu, Float32(1.0),
                        make_fake_stream(use_tvm_ffi_env_stream=True), options=compile_options(arch))
