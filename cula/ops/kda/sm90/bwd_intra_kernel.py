"""KDA chunk backward, the gradients through the intra-chunk scores on SM90 (stage 7 of FLA's ``chunk_kda_bwd``).

Replaces FLA 0.6.0's ``chunk_kda_bwd_intra`` (``fla/ops/kda/chunk_intra.py``); contract:
``cula.kda.naive_bwd.chunk_kda_bwd_intra_reference``. Per chunk of BT = 64 tokens and value head, with rows t, s,
channels c, ``g`` the chunk-local log2 gate cumsum and ``E[t, s, c] = exp2(g[t, c] - g[s, c])`` (s <= t)::

    dq_t  += sum_{s <= t} dAqk[t, s] k_s E_ts                          (dq_intra)
    row_t  = sum_{s <= t} dAkk[t, s] k_s E_ts
    dk_s  += beta_s row_s + sum_{t >= s} (dAqk[t, s] q_t + dAkk[t, s] beta_t k_t) E_ts
    db_t  += sum_c row_t k_t
    dg    += q dq_intra + k (beta row - col)      col_s = sum_{t >= s} dAkk[t, s] beta_t k_t E_ts

(``dg`` for the natural-log gate; dAkk's diagonal included, as FLA's kernel reads it.) Outputs are new tensors:
``dq + ...``, ``dk + ...``, ``dg + ...``, ``db + ...``, all fp32.

Numerics: the gate factor is split per 16-row sub-chunk around an anchor row ``a`` (row 8 of the sub-chunk, or its
last valid row): the "row" products (dq_intra, row) of output sub-chunk i are ``exp2(g_t - g_a) * sum_s dA[t, s]
(k_s exp2(g_a - g_s))`` over the key sub-chunks j <= i, the "column" products (col and the dAqk term of dk) of
output sub-chunk j are ``exp2(g_a - g_s) * sum_t dA[t, s] (x_t exp2(g_t - g_a))`` over the query sub-chunks
i >= j, with a the anchor of the output sub-chunk. Exponents are clamped at 100 (base 2) as in the forward intra
kernel, with the same exactness condition (no 8-step window of one channel decays by more than 2^100; the
training path takes this kernel only where the forward's intra kernel ran, which requires it). ``any_gate`` makes
it exact for any gate, as the forward intra kernel's variant of that name: after phase L every valid g of each
sub-chunk is checked against its anchor row's, and a tile where one differs by more than 96 (base 2) takes the exact
path: the row products anchor at the output sub-chunk's first row and the column products at its last valid row
(every factor of an off-diagonal block is then at most 1, nothing clamped), and the diagonal block is summed element
by element (``exp2(g_t - g_s)`` per term, fp32) into the accumulators with their factor (``_row_fold``,
``_column_fold``), the epilogues' factor then 1. Tiles within the bound do the anchored products' arithmetic. The
products run as
tf32 ``mma.sync`` (m16n8k8, fp32 accumulation) with operands rounded to nearest, as FLA's tf32 dots; the diagonal
blocks (i = j) as 3xTF32 (each operand split into tf32 ``hi + lo``, three products), as FLA's bf16x3 there: dg's
``q dq_intra`` and ``k col`` terms cancel pairwise in the reverse cumsum over the chunk, and tf32's rounding of the
largest of them, near the diagonal, added up over a chunk's rows (a training step's ddt_bias was 6% off).

Layout (256 threads, 8 warps, one CTA per (chunk, value head), 104 KB of shared memory: two CTAs per SM):

=====  ======================================================================================================
phase  work
=====  ======================================================================================================
L      all threads: q, k (head hv // (HV/H)) bf16, g fp32, dAqk, dAkk fp32 (cp.async) and beta to padded shared
       rows, zeros past the sequence end; the incoming dq, dk, dg rows (and g_raw) prefetched into L2 for the
       epilogues; CTA barrier (any_gate: the steepness check, voted per warp into shared memory; CTA barrier)
R      warp w: output sub-chunk i = w % 4, channel half w // 4. Row products (dq_intra, row) over key blocks
       j <= i, two accumulators [16 x 64] fed by one B operand (k times its factor, built in registers); then
       dq, and dk / dg with the row terms, to global memory, and the half's db partial to shared memory
C      the same warp, the same rows and channels: column products over query blocks i' >= i (A read transposed
       from the score gradients, B operands q and beta k times their factor, both products summed into one
       accumulator: dk and dg take only their sum); then dk, dg completed in place (the thread reads back only
       what it wrote in R). With ``reverse_cumsum``: a CTA barrier before that epilogue, whose dg rows go to
       shared memory over the score gradients
D      CTA barrier; with ``reverse_cumsum``, threads j and j + 128: channel j's dg as suffix sums over the rows
       (0..31 and 32..63), with ``gate`` taken through the gate's backward (below); threads 0..63: db = db_in +
       both halves' partials
=====  ======================================================================================================

Fused neighbours (static options), so that their reads and writes of dq / dk / dg drop out:

- ``l2norm`` (FLA's ``l2norm_bwd`` after the stage, ``HV == H`` only: with GVA the value heads' dq / dk are summed
  first): ``dx = rstd (dy - (dy . y) y)`` per row with ``y`` the normalised q or k (the shared rows) and ``rstd`` the
  forward's; the row's dot product is summed over both channel halves by the warp pair that owns the rows (a named
  barrier of 64 threads), then dq (phase R) and dk (phase C) leave in q's dtype. dk's row terms still pass through
  the fp32 scratch of phase R.
- ``gate = "lower_bound"`` (FLA's ``kda_gate_bwd`` for ``g = lb sigmoid(A (g_raw + dt_bias))``, A = exp(A_log) or
  1; with ``reverse_cumsum``): phase D takes each suffix sum ``dy`` through ``dg_raw = dy lb s (1 - s) A`` (s the
  sigmoid) into g_raw's dtype, and leaves the chunk's partial sums of ddt_bias (per channel) and dA_log
  (``sum dg_raw (g_raw + dt_bias)``) in per-(chunk, value head) rows that the host sums in a fixed order.
  ``gate = "softplus"`` (FLA's ``g = -A softplus(g_raw + dt_bias)``, A = exp(A_log) or e, softplus the identity past
  20): ``dg_raw = -A dy sigmoid(x)`` and the dA_log partial ``sum dy g``, the rest as the lower-bound gate's.

Row unit i costs i + 1 key blocks, column unit i costs 4 - i: every warp does five block products, the two diagonal
ones as three tf32 products each (nine in all).
Shared rows are padded (q / k 136 bf16, g 132 floats, score gradients 68 floats) so that the B-operand builds
(8 channels x 4 tokens a quarter warp) and the transposed A reads are free of bank conflicts.

Supported: K = 128, BT = 64, q / k bf16 or fp16, beta fp32 / bf16 / fp16, GVA (HV a multiple of H), varlen
(``cu_seqlens`` int32 + ``chunk_indices`` int32 ``[NT, 2]``; a padding row (n, c) with ``64 c >=`` the length of
sequence n writes nothing). ``raw_qk`` (with ``l2norm``): q and k before the L2 norm; in phase L each thread
rescales the q / k units it copied by the row's rstd once its copies have landed, ``bf16(x rstd)``, before the
barrier that ends the phase.
"""

from __future__ import annotations

import enum
import math

import cuda.bindings.driver as cuda
import cutlass
from cutlass import BFloat16, Float16, Float32, Int32, TFloat32, const_expr, cute
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.memory import SmemAllocator

from cula.cache import compile_options
from cula.ops._host import dsl_type
from cula.ops.cute_common import (
    FIRST_NAMED_BARRIER, chunk_rows, cp_async_token_rows, load_token_scalars, n_tile_accumulators,
    prefetch_token_rows, round_tf32, split_tf32, vec_at,
)  # fmt: skip

__all__ = ["ChunkKDABwdIntraSm90"]

_ANCHOR_CLAMP = 100.0  # base-2 exponent cap of the gate factors (see the module docstring)
# any_gate: a tile takes the anchored products where no valid g of a sub-chunk lies further than this (base 2) from
# its anchor row's, so that no factor reaches the clamp
_ANCHOR_SPAN = 96.0


@cute.jit
def _tf32_operand(frags, i, x: Float32, keep=None):
    """Element ``i`` of an MMA operand: ``x`` (zero where ``keep`` is false: a diagonal block's triangle) rounded to
    tf32 (one fragment), or its 3xTF32 ``hi`` and ``lo`` parts (two fragments)."""
    if const_expr(keep is not None):
        x = Float32(cutlass.select_(keep, x, Float32(0.0)))
    if const_expr(len(frags) == 1):
        frags[0][i] = round_tf32(x).to(TFloat32)
    else:
        hi, lo = split_tf32(x)
        frags[0][i] = hi.to(TFloat32)
        frags[1][i] = lo.to(TFloat32)


@cute.jit
def _tf32_gemm(tiled, acc, fa, fb):
    """``acc += a b`` from the operands' fragments: one tf32 product, or 3xTF32's three (small terms first)."""
    if const_expr(len(fa) == 2):
        cute.gemm(tiled, acc, fa[1], fb[0], acc)
        cute.gemm(tiled, acc, fa[0], fb[1], acc)
    cute.gemm(tiled, acc, fa[0], fb[0], acc)


class Barrier(enum.IntEnum):
    """Named barriers (0 is the CTA-wide one)."""

    # one per row block (64 threads): warps w and w + 4 (the block's two channel halves) have put their partial
    # row dot products of the L2 norm's backward in shared memory
    ROW_PAIR0 = FIRST_NAMED_BARRIER


class ChunkKDABwdIntraSm90:
    """KDA backward through the intra-chunk scores (FLA's ``chunk_kda_bwd_intra``), sm_90a.

    Static configuration: the dtype of q / k, the dtype of beta, varlen, ``reverse_cumsum``: dg leaves as its
    reverse chunk-local cumsum (FLA's next stage, ``chunk_local_cumsum(dg, reverse=True)``, done on chip), and the
    fused neighbours of the module docstring: ``l2norm``, ``gate`` with ``g_raw_dtype``, ``has_a_log``,
    ``has_dt_bias``. Token counts, heads, sequences and the gate's bound are runtime values.
    """

    arch = 90

    def __init__(self, dtype=BFloat16, beta_dtype=Float32, varlen: bool = False, reverse_cumsum: bool = False,
                 l2norm: bool = False, gate: str | None = None, g_raw_dtype=Float32, has_a_log: bool = True,
                 has_dt_bias: bool = True, any_gate: bool = False, raw_qk: bool = False):  # fmt: skip
        if dtype not in (BFloat16, Float16):
            raise ValueError(f"dtype must be BFloat16 or Float16, got {dtype}")
        if beta_dtype not in (BFloat16, Float16, Float32):
            raise ValueError(f"beta_dtype must be BFloat16, Float16 or Float32, got {beta_dtype}")
        if gate not in (None, "lower_bound", "softplus"):
            raise ValueError(f"gate must be None, 'lower_bound' or 'softplus', got {gate!r}")
        if gate is not None and not reverse_cumsum:
            raise ValueError("the gate's backward runs after dg's reverse cumsum: gate needs reverse_cumsum")
        if g_raw_dtype not in (BFloat16, Float16, Float32):
            raise ValueError(f"g_raw_dtype must be BFloat16, Float16 or Float32, got {g_raw_dtype}")
        self.dtype, self.beta_dtype, self.varlen = dtype, beta_dtype, bool(varlen)
        self.reverse_cumsum, self.l2norm, self.gate = bool(reverse_cumsum), bool(l2norm), gate
        self.g_raw_dtype, self.has_a_log, self.has_dt_bias = g_raw_dtype, bool(has_a_log), bool(has_dt_bias)
        # exact for any gate (see the module docstring): tiles whose gates break the anchored factoring's bound take
        # the exact path
        self.any_gate = bool(any_gate)
        # q and k arrive before the L2 norm (l2norm's rstd, which it reads anyway, normalises them as they land)
        self.raw_qk = bool(raw_qk)
        if self.raw_qk and not self.l2norm:
            raise ValueError("raw_qk normalises q and k with the L2 norm's rstd: it needs l2norm")
        self.bt, self.dk = 64, 128
        self.num_threads = 256
        # padded row strides (elements), see the module docstring
        self.x_ld, self.g_ld, self.a_ld = self.dk + 8, self.dk + 4, self.bt + 4

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (T_total, H, K) dtype
        mK: cute.Tensor,  # (T_total, H, K) dtype
        mG: cute.Tensor,  # (T_total, HV, K) fp32, chunk-local log2 cumsum
        mBeta: cute.Tensor,  # (T_total, HV) beta_dtype
        mDAqk: cute.Tensor,  # (T_total, HV, BT) fp32
        mDAkk: cute.Tensor,  # (T_total, HV, BT) fp32
        mDq: cute.Tensor,  # (T_total, HV, K) fp32, in
        mDk: cute.Tensor,  # (T_total, HV, K) fp32, in
        mDg: cute.Tensor,  # (T_total, HV, K) fp32, in
        mDb: cute.Tensor,  # (T_total, HV) fp32, in
        mDq2: cute.Tensor,  # (T_total, HV, K) fp32, out
        mDk2: cute.Tensor,  # (T_total, HV, K) fp32, out
        mDg2: cute.Tensor,  # (T_total, HV, K) fp32, out
        mDb2: cute.Tensor,  # (T_total, HV) fp32, out
        mCu: cute.Tensor,  # (N + 1,) int32, unread unless varlen
        mCi: cute.Tensor,  # (NT, 2) int32 (sequence, chunk), unread unless varlen
        mQRstd: cute.Tensor,  # (T_total, H) fp32, unread unless l2norm
        mKRstd: cute.Tensor,  # (T_total, H) fp32, unread unless l2norm
        mDqN: cute.Tensor,  # (T_total, H, K) dtype, out with l2norm (mDq2 unwritten then)
        mDkN: cute.Tensor,  # (T_total, H, K) dtype, out with l2norm (mDk2 is phase R's scratch then)
        mGRaw: cute.Tensor,  # (T_total, HV, K) g_raw_dtype, unread unless gate
        mALog: cute.Tensor,  # (HV,) fp32, unread unless gate and has_a_log
        mDtBias: cute.Tensor,  # (HV * K,) fp32, unread unless gate and has_dt_bias
        mDgRaw: cute.Tensor,  # (T_total, HV, K) g_raw_dtype, out with gate (mDg2 is phase R's scratch then)
        mDAPart: cute.Tensor,  # (chunk rows, HV) fp32, out with gate and has_a_log
        mDBiasPart: cute.Tensor,  # (chunk rows, HV, K) fp32, out with gate and has_dt_bias
        lower_bound: Float32,
        seqlen: Int32,  # tokens per sequence when not varlen
        num_chunks: Int32,  # grid x: chunks per sequence, or NT when varlen
        num_seqs: Int32,  # grid z: B, or 1 when varlen
        stream: cuda.CUstream,
    ):
        BT = self.bt

        @cute.struct
        class Storage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, BT * self.x_ld], 16]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, BT * self.x_ld], 16]
            sG: cute.struct.Align[cute.struct.MemRange[Float32, BT * self.g_ld], 16]
            sAq: cute.struct.Align[cute.struct.MemRange[Float32, BT * self.a_ld], 16]
            sAk: cute.struct.Align[cute.struct.MemRange[Float32, BT * self.a_ld], 16]
            sBeta: cute.struct.Align[cute.struct.MemRange[Float32, BT], 16]
            sDb: cute.struct.Align[cute.struct.MemRange[Float32, 2 * BT], 16]  # the two halves' db partials
            # the two halves' partial row dot products of the L2-norm backward (dq, then dk)
            sDot: cute.struct.Align[cute.struct.MemRange[Float32, 4 * BT], 16]
            # the gate backward's partial sums: ddt_bias per channel for both row halves, dA_log per warp
            sGate: cute.struct.Align[cute.struct.MemRange[Float32, 2 * self.dk + 8], 16]
            # any_gate (empty otherwise): per warp, whether a channel of its steps past the anchored bound
            sFlags: cute.struct.Align[cute.struct.MemRange[Int32, 8 if self.any_gate else 0], 16]

        self.storage = Storage
        self.kernel(
            mQ, mK, mG, mBeta, mDAqk, mDAkk, mDq, mDk, mDg, mDb, mDq2, mDk2, mDg2, mDb2, mCu, mCi, mQRstd, mKRstd,
            mDqN, mDkN, mGRaw, mALog, mDtBias, mDgRaw, mDAPart, mDBiasPart, lower_bound, seqlen,
        ).launch(
            grid=(num_chunks, mDq.shape[1], num_seqs), block=(self.num_threads, 1, 1), stream=stream,
            min_blocks_per_mp=2, max_number_threads=[self.num_threads, 1, 1], preferred_smem_carveout=100,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mDAqk: cute.Tensor,
        mDAkk: cute.Tensor, mDq: cute.Tensor, mDk: cute.Tensor, mDg: cute.Tensor, mDb: cute.Tensor,
        mDq2: cute.Tensor, mDk2: cute.Tensor, mDg2: cute.Tensor, mDb2: cute.Tensor, mCu: cute.Tensor,
        mCi: cute.Tensor, mQRstd: cute.Tensor, mKRstd: cute.Tensor, mDqN: cute.Tensor, mDkN: cute.Tensor,
        mGRaw: cute.Tensor, mALog: cute.Tensor, mDtBias: cute.Tensor, mDgRaw: cute.Tensor, mDAPart: cute.Tensor,
        mDBiasPart: cute.Tensor, lower_bound: Float32, seqlen: Int32,
    ):  # fmt: skip
        BT, DK = self.bt, self.dk
        tidx, _, _ = cute.arch.thread_idx()
        bx, hv, bz = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        HV = mDq.shape[1]
        h = hv // (HV // mQ.shape[1])

        tok0, valid = chunk_rows(self.varlen, mCu, mCi, bx, bz, seqlen, BT)
        # the chunk's row of the gate's partial sums: the grid's (sequence, chunk) flattened
        part_row = bz * cute.arch.grid_dim()[0] + bx

        if valid > 0:
            storage = SmemAllocator().allocate(self.storage)
            sQ = storage.sQ.get_tensor(cute.make_layout((BT, DK), stride=(self.x_ld, 1)))
            sK = storage.sK.get_tensor(cute.make_layout((BT, DK), stride=(self.x_ld, 1)))
            sG = storage.sG.get_tensor(cute.make_layout((BT, DK), stride=(self.g_ld, 1)))
            sAq = storage.sAq.get_tensor(cute.make_layout((BT, BT), stride=(self.a_ld, 1)))
            sAk = storage.sAk.get_tensor(cute.make_layout((BT, BT), stride=(self.a_ld, 1)))
            sBeta = storage.sBeta.get_tensor(cute.make_layout(BT))
            sDb = storage.sDb.get_tensor(cute.make_layout((BT, 2), stride=(1, BT)))
            sDot = storage.sDot.get_tensor(cute.make_layout((BT, 2, 2), stride=(1, BT, 2 * BT)))  # (t, half, q|k)
            sGate = storage.sGate.get_tensor(cute.make_layout(2 * DK + 8))

            self._load(mQ, mK, mG, mBeta, mDAqk, mDAkk, sQ, sK, sG, sAq, sAk, sBeta, mQRstd, mKRstd, tok0, h, hv, valid,
                       tidx)  # fmt: skip
            # the incoming gradients, read from global memory only in the epilogues (and g_raw in phase D): to L2 now
            prefetch_token_rows(((mDq, hv), (mDk, hv), (mDg, hv)), tok0, valid, tidx)
            if const_expr(self.gate is not None):
                prefetch_token_rows(((mGRaw, hv),), tok0, valid, tidx - 192)
            cute.arch.barrier()

            tiled = cute.make_tiled_mma(warp.MmaTF32Op((16, 8, 8)))
            sub = warp_idx % 4
            half = warp_idx // 4
            anchor = cutlass.min(16 * sub + 8, valid - 1)
            # the row and column products' anchors; any_gate's exact path: the output sub-chunk's first row for the
            # rows and its last valid row for the columns (every factor of an off-diagonal block <= 1), the diagonal
            # blocks element by element in the epilogues
            anchor_r, anchor_c = anchor, anchor
            slow = False
            if const_expr(self.any_gate):
                sFlags = storage.sFlags.get_tensor(cute.make_layout(8))
                self._steep_check(sG, sFlags, valid, tidx, warp_idx, lane)
                cute.arch.barrier()
                steep = sFlags[0] | sFlags[1] | sFlags[2] | sFlags[3] | sFlags[4] | sFlags[5] | sFlags[6] | sFlags[7]
                slow = steep != 0
                anchor_r = Int32(cutlass.select_(slow, 16 * sub, anchor))
                anchor_c = Int32(cutlass.select_(slow, cutlass.min(16 * sub + 15, valid - 1), anchor))
            acc_col = n_tile_accumulators(tiled, 8)  # both column products sum into one: dk takes their sum
            if 16 * sub < valid:
                self._row_unit(tiled, sQ, sK, sG, sAq, sAk, sBeta, sDb, sDot, mDq, mDk, mDg, mDq2, mDk2, mDg2,
                               mQRstd, mDqN, tok0, h, hv, valid, sub, half, anchor_r, lane, slow)  # fmt: skip
                self._column_products(tiled, acc_col, sQ, sK, sG, sAq, sAk, sBeta, valid, sub, half, anchor_c, lane,
                                      slow)  # fmt: skip
            # with the reverse cumsum, dg's rows go to shared memory over the score gradients: once all are read
            sDG = cute.make_tensor(sAq.iterator, cute.make_layout((BT, DK), stride=(self.g_ld, 1)))
            if const_expr(self.reverse_cumsum):
                cute.arch.barrier()
            if 16 * sub < valid:
                self._column_epilogue(acc_col, sK, sG, sDot, mDk2, mDg2, mKRstd, mDkN, sDG, tok0, h, hv, valid, sub,
                                      half, anchor_c, lane, slow)  # fmt: skip
            cute.arch.barrier()
            if const_expr(self.reverse_cumsum):
                self._reverse_cumsum(sDG, sGate, mDg2, mGRaw, mALog, mDtBias, mDgRaw, lower_bound, tok0, hv, valid,
                                     tidx)  # fmt: skip
            if tidx < valid:
                mDb2[tok0 + tidx, hv] = mDb[tok0 + tidx, hv] + sDb[tidx, 0] + sDb[tidx, 1]
            if const_expr(self.gate is not None):
                cute.arch.barrier()
                self._gate_partials(sGate, mDAPart, mDBiasPart, part_row, hv, tidx)
        if const_expr(self.gate is not None):
            if valid <= 0:  # a padding row of the chunk list: its partial sums are zero
                self._zero_gate_partials(mDAPart, mDBiasPart, part_row, hv, tidx)

    @cute.jit
    def _load(self, mQ, mK, mG, mBeta, mDAqk, mDAkk, sQ, sK, sG, sAq, sAk, sBeta, mQRstd, mKRstd, tok0, h, hv, valid,
              tidx):  # fmt: skip
        """Phase L: the chunk's tiles to shared memory by 16-byte ``cp.async`` (no registers held), zeros past the
        sequence end; with ``raw_qk`` each thread then normalises the q / k units it copied itself (visible to it
        once its copies are waited for, so no barrier), ``bf16(x rstd)`` as FLA's ``l2norm_fwd`` rounds it."""
        x_atom = cute.make_copy_atom(cpasync.CopyG2SOp(), self.dtype, num_bits_per_copy=128)
        f_atom = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=128)
        cp_async_token_rows(x_atom, ((mQ, sQ, h), (mK, sK, h)), tok0, valid, tidx)
        cp_async_token_rows(f_atom, ((mG, sG, hv),), tok0, valid, tidx, row_units=32, unit=4)
        cp_async_token_rows(f_atom, ((mDAqk, sAq, hv), (mDAkk, sAk, hv)), tok0, valid, tidx, unit=4)
        cute.arch.cp_async_commit_group()
        load_token_scalars(mBeta, sBeta, tok0, valid, hv, tidx)
        if const_expr(self.raw_qk):
            # cp_async_token_rows' units: thread tidx copies columns 8 (tidx % 16).. of rows tidx // 16 + 16 m
            col = cute.assume((tidx % 16) * 8, divby=8)
            rows = [tidx // 16 + 16 * m for m in range(self.bt // 16)]
            rstd = []
            for t in rows:  # the 1 / norms first, so that their loads overlap the copies
                rq, rk = Float32(0.0), Float32(0.0)
                if t < valid:
                    rq = mQRstd[tok0 + t, h]
                    rk = mKRstd[tok0 + t, h]
                rstd.append((rq, rk))
            cute.arch.cp_async_wait_group(0)
            for m, t in enumerate(rows):
                if t < valid:
                    for sX, r in ((sQ, rstd[m][0]), (sK, rstd[m][1])):
                        x = cute.make_rmem_tensor(8, self.dtype)
                        cute.autovec_copy(vec_at(sX, (t, col)), x)
                        for e in cutlass.range_constexpr(8):
                            x[e] = (x[e].to(Float32) * r).to(self.dtype)
                        cute.autovec_copy(x, vec_at(sX, (t, col)))
        else:
            cute.arch.cp_async_wait_group(0)

    @cute.jit
    def _row_unit(self, tiled, sQ, sK, sG, sAq, sAk, sBeta, sDb, sDot, mDq, mDk, mDg, mDq2, mDk2, mDg2, mQRstd,
                  mDqN, tok0, h, hv, valid, sub, half, anchor, lane, slow=False):  # fmt: skip
        """Phase R for output rows 16 sub .. +15 and channels 64 half .. +63 (with ``l2norm``, dq through the L2
        norm's backward into ``mDqN``). ``slow``: any_gate's exact path (the diagonal block element by element,
        folded into the accumulators with their factor, ``_row_fold``)."""
        g_, c = lane // 4, lane % 4
        ch0 = half * 64
        acc_q, acc_l = n_tile_accumulators(tiled, 8), n_tile_accumulators(tiled, 8)
        for j in cutlass.range(sub, unroll=1):
            self._row_block(tiled, acc_q, acc_l, sAq, sAk, sK, sG, 16 * j, sub, ch0, anchor, lane, False)
        # (slow is the Python False without any_gate: a trace-time branch then)
        if slow:
            self._row_fold(acc_q, acc_l, sAq, sAk, sK, sG, sub, ch0, anchor, lane)
        else:
            self._row_block(tiled, acc_q, acc_l, sAq, sAk, sK, sG, 16 * sub, sub, ch0, anchor, lane, True)

        # epilogue: n-tile nt's accumulator holds (row g + 8 hh, column 8 nt + 2 c + v) at index v + 2 hh. The
        # gradient inputs of all eight n-tiles are loaded before the first output is stored: the compiler cannot
        # move a load past a store that may alias it, and a load after each store waited a full memory latency per
        # n-tile (most of the kernel's time in Nsight Compute's stall samples). It costs 16 bytes of spills, and
        # was the fastest of 1, 2, 4 and 8 n-tiles a load batch (5.65, 4.94, 4.03, 3.90 ms at B=2 T=16K H=64)
        for hh in cutlass.range_constexpr(2):
            t = 16 * sub + g_ + 8 * hh
            bt = sBeta[t]
            dbp = Float32(0.0)
            dq_fin = cute.make_rmem_tensor(16, Float32)  # with l2norm: dq until the row's dot product is known
            if t < valid:
                grads = []
                for nt in cutlass.range_constexpr(8):
                    ch = cute.assume(ch0 + 8 * nt + 2 * c, divby=2)
                    dq, dk, dg = (cute.make_rmem_tensor(2, Float32) for _ in range(3))
                    cute.autovec_copy(vec_at(mDq, (tok0 + t, hv, ch), 2, 2), dq)
                    cute.autovec_copy(vec_at(mDk, (tok0 + t, hv, ch), 2, 2), dk)
                    cute.autovec_copy(vec_at(mDg, (tok0 + t, hv, ch), 2, 2), dg)
                    grads.append((dq, dk, dg))
                for nt in cutlass.range_constexpr(8):
                    ch = cute.assume(ch0 + 8 * nt + 2 * c, divby=2)
                    dq, dk, dg = grads[nt]
                    gt, g_a, q2, k2 = (cute.make_rmem_tensor(2, x) for x in (
                        Float32, Float32, self.dtype, self.dtype))  # fmt: skip
                    cute.autovec_copy(vec_at(sG, (t, ch), 2, 2), gt)
                    cute.autovec_copy(vec_at(sG, (anchor, ch), 2, 2), g_a)
                    cute.autovec_copy(vec_at(sQ, (t, ch), 2, 2), q2)
                    cute.autovec_copy(vec_at(sK, (t, ch), 2, 2), k2)
                    for v in cutlass.range_constexpr(2):
                        f = cute.math.exp2(cute.arch.fmin(gt[v] - g_a[v], _ANCHOR_CLAMP), fastmath=True)
                        if const_expr(self.any_gate):  # the exact path folded the factor in (_row_fold)
                            f = Float32(cutlass.select_(slow, Float32(1.0), f))
                        dqi = f * acc_q[nt][v + 2 * hh]
                        row = f * acc_l[nt][v + 2 * hh]
                        qv, kv = q2[v].to(Float32), k2[v].to(Float32)
                        dq[v] = dq[v] + dqi
                        dk[v] = dk[v] + bt * row
                        dg[v] = dg[v] + qv * dqi + kv * bt * row
                        dbp = dbp + row * kv
                        if const_expr(self.l2norm):
                            dq_fin[2 * nt + v] = dq[v]
                    if const_expr(not self.l2norm):
                        cute.autovec_copy(dq, vec_at(mDq2, (tok0 + t, hv, ch), 2, 2))
                    cute.autovec_copy(dk, vec_at(mDk2, (tok0 + t, hv, ch), 2, 2))
                    cute.autovec_copy(dg, vec_at(mDg2, (tok0 + t, hv, ch), 2, 2))
            # the row's sum over this half's channels: the quad's four lanes
            dbp = dbp + cute.arch.shuffle_sync_bfly(dbp, offset=1)
            dbp = dbp + cute.arch.shuffle_sync_bfly(dbp, offset=2)
            if c == 0:
                sDb[t, half] = dbp
            if const_expr(self.l2norm):
                self._l2norm_rows(dq_fin, sQ, sDot, mQRstd, mDqN, 0, tok0, t, h, valid, sub, half, lane)

    @cute.jit
    def _row_block(self, tiled, acc_q, acc_l, sAq, sAk, sK, sG, s_blk, sub, ch0, anchor, lane,
                   diag: cutlass.Constexpr[bool]):
        """Phase R's products of key block ``s_blk`` .. +15 into ``acc_q`` (dq_intra) and ``acc_l`` (row); the
        diagonal block (``diag``) masked to s <= t and in 3xTF32 (see the module docstring)."""
        g_, c = lane // 4, lane % 4
        parts = 2 if diag else 1
        fq = [cute.make_rmem_tensor(tiled.partition_shape_A((16, 8)), TFloat32) for _ in range(parts)]
        fl = [cute.make_rmem_tensor(tiled.partition_shape_A((16, 8)), TFloat32) for _ in range(parts)]
        for ks in cutlass.range_constexpr(2):
            s0 = s_blk + 8 * ks
            # A: (row g + 8 hh, k slot c | c + 4) <- token s0 + 2 c | s0 + 2 c + 1 (the contraction order is free;
            # the B operand below uses the same one)
            for hh in cutlass.range_constexpr(2):
                t_loc = g_ + 8 * hh
                two_q = cute.make_rmem_tensor(2, Float32)
                two_l = cute.make_rmem_tensor(2, Float32)
                cute.autovec_copy(vec_at(sAq, (16 * sub + t_loc, s0 + 2 * c), 2, 2), two_q)
                cute.autovec_copy(vec_at(sAk, (16 * sub + t_loc, s0 + 2 * c), 2, 2), two_l)
                for v in cutlass.range_constexpr(2):
                    keep = None
                    if const_expr(diag):
                        keep = 8 * ks + 2 * c + v <= t_loc
                    _tf32_operand(fq, hh + 2 * v, two_q[v], keep)
                    _tf32_operand(fl, hh + 2 * v, two_l[v], keep)
            # B, one n-tile at a time: (k slot c + 4 v <- token s0 + 2 c + v, column 8 nt + g) = k exp2(g_a - g_s)
            for nt in cutlass.range_constexpr(8):
                ch = ch0 + 8 * nt + g_
                fb = [cute.make_rmem_tensor(tiled.partition_shape_B((8, 8)), TFloat32) for _ in range(parts)]
                for v in cutlass.range_constexpr(2):
                    s = s0 + 2 * c + v
                    f = cute.math.exp2(cute.arch.fmin(sG[anchor, ch] - sG[s, ch], _ANCHOR_CLAMP), fastmath=True)
                    _tf32_operand(fb, v, sK[s, ch].to(Float32) * f)
                _tf32_gemm(tiled, acc_q[nt], fq, fb)
                _tf32_gemm(tiled, acc_l[nt], fl, fb)

    @cute.jit
    def _column_products(self, tiled, acc, sQ, sK, sG, sAq, sAk, sBeta, valid, sub, half, anchor, lane, slow=False):
        """Phase C's products for output rows 16 sub .. +15 and channels 64 half .. +63 (the rows and channels of
        phase R) into ``acc``; ``slow``: any_gate's exact path (the diagonal block element by element, folded in
        with the factor after the off-diagonal ones, ``_column_fold``, while the score gradients are still in
        shared memory)."""
        ch0 = half * 64
        # (slow is the Python False without any_gate: trace-time branches then)
        if slow:
            pass  # the diagonal block: _column_fold below
        else:
            self._column_block(tiled, acc, sQ, sK, sG, sAq, sAk, sBeta, 16 * sub, sub, ch0, anchor, lane, True)
        for i in cutlass.range(sub + 1, (valid + 15) // 16, unroll=1):
            self._column_block(tiled, acc, sQ, sK, sG, sAq, sAk, sBeta, 16 * i, sub, ch0, anchor, lane, False)
        if slow:
            self._column_fold(acc, sQ, sK, sG, sAq, sAk, sBeta, sub, ch0, anchor, lane)

    @cute.jit
    def _column_block(self, tiled, acc, sQ, sK, sG, sAq, sAk, sBeta, t_blk, sub, ch0, anchor, lane,
                   diag: cutlass.Constexpr[bool]):
        """Phase C's products of query block ``t_blk`` .. +15 into ``acc``; the diagonal block (``diag``) masked to
        t >= s and in 3xTF32."""
        g_, c = lane // 4, lane % 4
        parts = 2 if diag else 1
        fp = [cute.make_rmem_tensor(tiled.partition_shape_A((16, 8)), TFloat32) for _ in range(parts)]
        fc = [cute.make_rmem_tensor(tiled.partition_shape_A((16, 8)), TFloat32) for _ in range(parts)]
        for ks in cutlass.range_constexpr(2):
            t0 = t_blk + 8 * ks
            # A: (output row s = g + 8 hh, k slot c + 4 v <- query token t0 + 2 c + v) = dA[t, s], transposed
            for hh in cutlass.range_constexpr(2):
                s_loc = g_ + 8 * hh
                for v in cutlass.range_constexpr(2):
                    t = t0 + 2 * c + v
                    keep = None
                    if const_expr(diag):
                        keep = 8 * ks + 2 * c + v >= s_loc
                    _tf32_operand(fp, hh + 2 * v, sAq[t, 16 * sub + s_loc], keep)
                    _tf32_operand(fc, hh + 2 * v, sAk[t, 16 * sub + s_loc], keep)
            # B, one n-tile at a time: q_t exp2(g_t - g_a) and beta_t k_t exp2(g_t - g_a)
            bts = (sBeta[t0 + 2 * c], sBeta[t0 + 2 * c + 1])
            for nt in cutlass.range_constexpr(8):
                ch = ch0 + 8 * nt + g_
                fbq = [cute.make_rmem_tensor(tiled.partition_shape_B((8, 8)), TFloat32) for _ in range(parts)]
                fbk = [cute.make_rmem_tensor(tiled.partition_shape_B((8, 8)), TFloat32) for _ in range(parts)]
                for v in cutlass.range_constexpr(2):
                    t = t0 + 2 * c + v
                    f = cute.math.exp2(cute.arch.fmin(sG[t, ch] - sG[anchor, ch], _ANCHOR_CLAMP), fastmath=True)
                    _tf32_operand(fbq, v, sQ[t, ch].to(Float32) * f)
                    _tf32_operand(fbk, v, sK[t, ch].to(Float32) * (bts[v] * f))
                _tf32_gemm(tiled, acc[nt], fp, fbq)
                _tf32_gemm(tiled, acc[nt], fc, fbk)

    @cute.jit
    def _column_epilogue(self, acc, sK, sG, sDot, mDk2, mDg2, mKRstd, mDkN, sDG, tok0, h, hv, valid, sub, half,
                         anchor, lane, slow=False):  # fmt: skip
        """Phase C's epilogue: dk and dg of phase R completed in place (dg into ``sDG`` instead with
        ``reverse_cumsum``; with ``l2norm``, dk through the L2 norm's backward into ``mDkN``)."""
        g_, c = lane // 4, lane % 4
        ch0 = half * 64
        for hh in cutlass.range_constexpr(2):
            s = 16 * sub + g_ + 8 * hh
            dk_fin = cute.make_rmem_tensor(16, Float32)  # with l2norm: dk until the row's dot product is known
            if s < valid:
                # phase R's values, written by this thread, all read back before the first store (see phase R)
                grads = []
                for nt in cutlass.range_constexpr(8):
                    ch = cute.assume(ch0 + 8 * nt + 2 * c, divby=2)
                    dk, dg = cute.make_rmem_tensor(2, Float32), cute.make_rmem_tensor(2, Float32)
                    cute.autovec_copy(vec_at(mDk2, (tok0 + s, hv, ch), 2, 2), dk)
                    cute.autovec_copy(vec_at(mDg2, (tok0 + s, hv, ch), 2, 2), dg)
                    grads.append((dk, dg))
                for nt in cutlass.range_constexpr(8):
                    ch = cute.assume(ch0 + 8 * nt + 2 * c, divby=2)
                    dk, dg = grads[nt]
                    gs, g_a, k2 = (cute.make_rmem_tensor(2, x) for x in (Float32, Float32, self.dtype))
                    cute.autovec_copy(vec_at(sG, (s, ch), 2, 2), gs)
                    cute.autovec_copy(vec_at(sG, (anchor, ch), 2, 2), g_a)
                    cute.autovec_copy(vec_at(sK, (s, ch), 2, 2), k2)
                    for v in cutlass.range_constexpr(2):
                        f = cute.math.exp2(cute.arch.fmin(g_a[v] - gs[v], _ANCHOR_CLAMP), fastmath=True)
                        if const_expr(self.any_gate):  # the exact path folded the factor in (_column_fold)
                            f = Float32(cutlass.select_(slow, Float32(1.0), f))
                        col = f * acc[nt][v + 2 * hh]
                        dk[v] = dk[v] + col
                        dg[v] = dg[v] - k2[v].to(Float32) * col
                        if const_expr(self.l2norm):
                            dk_fin[2 * nt + v] = dk[v]
                    if const_expr(not self.l2norm):
                        cute.autovec_copy(dk, vec_at(mDk2, (tok0 + s, hv, ch), 2, 2))
                    if const_expr(self.reverse_cumsum):
                        cute.autovec_copy(dg, vec_at(sDG, (s, ch), 2, 2))
                    else:
                        cute.autovec_copy(dg, vec_at(mDg2, (tok0 + s, hv, ch), 2, 2))
            if const_expr(self.l2norm):
                self._l2norm_rows(dk_fin, sK, sDot, mKRstd, mDkN, 1, tok0, s, h, valid, sub, half, lane)

    @cute.jit
    def _steep_check(self, sG, sFlags, valid, tidx, warp_idx, lane):
        """any_gate: whether some valid g of a sub-chunk lies more than ``_ANCHOR_SPAN`` (base 2) from its anchor
        row's (the anchored products' factors would reach the clamp), voted per warp into ``sFlags``. Thread j:
        channel j % 128 of sub-chunks 2 (j // 128) and + 1."""
        ch = tidx % 128
        far = Int32(0)
        for u in cutlass.range_constexpr(2):
            sub = 2 * (tidx // 128) + u
            ga = sG[cutlass.max(cutlass.min(16 * sub + 8, valid - 1), 0), ch]
            for r in cutlass.range_constexpr(16):
                t = 16 * sub + r
                d = Float32(cutlass.select_(t < valid, sG[t, ch] - ga, Float32(0.0)))
                far = Int32(cutlass.select_(cute.arch.fmax(d, -d) > _ANCHOR_SPAN, 1, far))
        anyfar = cute.arch.vote_any_sync(far != 0)
        if lane == 0:
            sFlags[warp_idx] = Int32(cutlass.select_(anyfar, 1, 0))

    @cute.jit
    def _row_fold(self, acc_q, acc_l, sAq, sAk, sK, sG, sub, ch0, anchor, lane):
        """any_gate's exact path, phase R: ``acc <- exp2(g_t - g_a) acc + sum_{s in the sub-chunk, s <= t} dA[t, s]
        k_s exp2(g_t - g_s)`` for dAqk (dq_intra) and dAkk (row), every factor at most 1 (gates <= 0; exponents
        clamped at the rows past the sequence end, whose k is 0). The epilogue then takes the factor as 1."""
        g_, c = lane // 4, lane % 4
        for hh in cutlass.range_constexpr(2):
            t = 16 * sub + g_ + 8 * hh
            for nt in cutlass.range_constexpr(8):
                for v in cutlass.range_constexpr(2):
                    ch = ch0 + 8 * nt + 2 * c + v
                    gt = sG[t, ch]
                    f = cute.math.exp2(cute.arch.fmin(gt - sG[anchor, ch], _ANCHOR_CLAMP), fastmath=True)
                    dq_d, row_d = Float32(0.0), Float32(0.0)
                    for s in cutlass.range(16 * sub, t + 1, unroll=1):
                        e = cute.math.exp2(cute.arch.fmin(gt - sG[s, ch], _ANCHOR_CLAMP), fastmath=True)
                        ks = sK[s, ch].to(Float32) * e
                        dq_d = dq_d + sAq[t, s] * ks
                        row_d = row_d + sAk[t, s] * ks
                    acc_q[nt][v + 2 * hh] = f * acc_q[nt][v + 2 * hh] + dq_d
                    acc_l[nt][v + 2 * hh] = f * acc_l[nt][v + 2 * hh] + row_d

    @cute.jit
    def _column_fold(self, acc, sQ, sK, sG, sAq, sAk, sBeta, sub, ch0, anchor, lane):
        """any_gate's exact path, phase C: ``acc <- exp2(g_a - g_s) acc + sum_{t in the sub-chunk, t >= s}
        (dAqk[t, s] q_t + dAkk[t, s] beta_t k_t) exp2(g_t - g_s)``, every factor at most 1 (rows past the sequence
        end have q = k = 0). The epilogue then takes the factor as 1."""
        g_, c = lane // 4, lane % 4
        for hh in cutlass.range_constexpr(2):
            s = 16 * sub + g_ + 8 * hh
            for nt in cutlass.range_constexpr(8):
                for v in cutlass.range_constexpr(2):
                    ch = ch0 + 8 * nt + 2 * c + v
                    gs = sG[s, ch]
                    f = cute.math.exp2(cute.arch.fmin(sG[anchor, ch] - gs, _ANCHOR_CLAMP), fastmath=True)
                    col_d = Float32(0.0)
                    for t in cutlass.range(s, 16 * sub + 16, unroll=1):
                        e = cute.math.exp2(cute.arch.fmin(sG[t, ch] - gs, _ANCHOR_CLAMP), fastmath=True)
                        x = sAq[t, s] * sQ[t, ch].to(Float32) + sAk[t, s] * sBeta[t] * sK[t, ch].to(Float32)
                        col_d = col_d + x * e
                    acc[nt][v + 2 * hh] = f * acc[nt][v + 2 * hh] + col_d

    @cute.jit
    def _l2norm_rows(self, dy, sY, sDot, mRstd, mOut, which, tok0, t, h, valid, sub, half, lane):
        """FLA's ``l2norm_bwd`` for row t's 16 elements a thread (``dy``, this half's channels 8 nt + 2 c + v):
        ``dx = rstd (dy - (dy . y) y)``, the dot product over both halves (the warp pair of rows 16 sub .. +15 meets
        at a named barrier), dx in q's dtype to ``mOut``. ``which``: 0 for dq, 1 for dk (their slots in ``sDot``)."""
        c = lane % 4
        ch0 = half * 64
        dot = Float32(0.0)
        if t < valid:
            for nt in cutlass.range_constexpr(8):
                y2 = cute.make_rmem_tensor(2, self.dtype)
                cute.autovec_copy(vec_at(sY, (t, ch0 + 8 * nt + 2 * c), 2, 2), y2)
                for v in cutlass.range_constexpr(2):
                    dot = dot + dy[2 * nt + v] * y2[v].to(Float32)
        dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=1)
        dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=2)
        if c == 0:
            sDot[t, half, which] = dot
        cute.arch.barrier(barrier_id=Barrier.ROW_PAIR0 + sub, number_of_threads=64)
        if t < valid:
            dot = dot + sDot[t, 1 - half, which]
            rstd = mRstd[tok0 + t, h]
            for nt in cutlass.range_constexpr(8):
                ch = cute.assume(ch0 + 8 * nt + 2 * c, divby=2)
                y2, x2 = cute.make_rmem_tensor(2, self.dtype), cute.make_rmem_tensor(2, self.dtype)
                cute.autovec_copy(vec_at(sY, (t, ch), 2, 2), y2)
                for v in cutlass.range_constexpr(2):
                    x2[v] = ((dy[2 * nt + v] - dot * y2[v].to(Float32)) * rstd).to(self.dtype)
                cute.autovec_copy(x2, vec_at(mOut, (tok0 + t, h, ch), 2, 2))

    @cute.jit
    def _reverse_cumsum(self, sDG, sGate, mDg2, mGRaw, mALog, mDtBias, mDgRaw, lower_bound, tok0, hv, valid, tidx):
        """``dg[t] = sum_{t' >= t} dg[t']`` over the chunk's rows, per channel: thread j < 128 the rows 0..31 of
        channel j (after summing rows 32.., which thread j + 128 scans), coalesced stores a row at a time. With
        ``gate``, each sum through the gate's backward into ``mDgRaw``, the thread's partial sums of ddt_bias and
        dA_log to ``sGate``."""
        ch = tidx % self.dk
        r0 = 32 * (tidx // self.dk)
        run = Float32(0.0)
        if r0 == 0:
            for r in cutlass.range_constexpr(32, self.bt):
                if r < valid:
                    run = run + sDG[r, ch]
        if const_expr(self.gate is None):
            for j in cutlass.range_constexpr(32):
                r = r0 + 31 - j
                if r < valid:
                    run = run + sDG[r, ch]
                    mDg2[tok0 + r, hv, ch] = run
        else:
            a = Float32(1.0)
            if const_expr(self.has_a_log):
                a = cute.math.exp(mALog[hv].to(Float32), fastmath=False)
            elif const_expr(self.gate == "softplus"):
                a = Float32(math.e)  # FLA's softplus gate without A_log: exp(1)
            bias = Float32(0.0)
            if const_expr(self.has_dt_bias):
                bias = mDtBias[hv * self.dk + ch].to(Float32)
            # the raw gate's 32 rows, all loaded before the first store (which might alias them for the compiler)
            x = cute.make_rmem_tensor(32, Float32)
            for j in cutlass.range_constexpr(32):
                r = r0 + 31 - j
                x[j] = Float32(0.0)
                if r < valid:
                    x[j] = mGRaw[tok0 + r, hv, ch].to(Float32) + bias
            d_bias, d_a = Float32(0.0), Float32(0.0)
            for j in cutlass.range_constexpr(32):
                r = r0 + 31 - j
                if r < valid:
                    run = run + sDG[r, ch]
                    # softplus: y = -A softplus(x), dx = -A dy sigmoid(x), dA_log = dy y (softplus the identity past 20)
                    if const_expr(self.gate == "softplus"):
                        sig = 1.0 / (1.0 + cute.math.exp(-x[j], fastmath=False))
                        dgr = -a * (run * sig)
                    else:
                        sig = 1.0 / (1.0 + cute.math.exp(-(a * x[j]), fastmath=False))
                        dgr = run * (lower_bound * (sig * (1.0 - sig))) * a
                    mDgRaw[tok0 + r, hv, ch] = dgr.to(self.g_raw_dtype)
                    d_bias = d_bias + dgr
                    if const_expr(self.gate == "softplus"):
                        if const_expr(self.has_a_log):  # (no A_log: no dA_log, and no exp / log for it)
                            sp = cute.math.log(1.0 + cute.math.exp(x[j], fastmath=False), fastmath=False)
                            d_a = d_a + run * (-a * Float32(cutlass.select_(x[j] > 20.0, x[j], sp)))
                    else:
                        d_a = d_a + dgr * x[j]
            sGate[tidx] = d_bias
            # dA_log's sum over the warp's 32 lanes
            for off in cutlass.range_constexpr(5):
                d_a = d_a + cute.arch.shuffle_sync_bfly(d_a, offset=1 << off)
            if tidx % 32 == 0:
                sGate[2 * self.dk + tidx // 32] = d_a

    @cute.jit
    def _gate_partials(self, sGate, mDAPart, mDBiasPart, part_row, hv, tidx):
        """The chunk's partial sums of the gate's parameter gradients from ``sGate`` (after a CTA barrier): ddt_bias
        per channel (both row halves), dA_log (the eight warps) in a fixed order."""
        if const_expr(self.has_dt_bias):
            if tidx < self.dk:
                mDBiasPart[part_row, hv, tidx] = sGate[tidx] + sGate[tidx + self.dk]
        if const_expr(self.has_a_log):
            if tidx == 0:
                total = Float32(0.0)
                for w in cutlass.range_constexpr(8):
                    total = total + sGate[2 * self.dk + w]
                mDAPart[part_row, hv] = total

    @cute.jit
    def _zero_gate_partials(self, mDAPart, mDBiasPart, part_row, hv, tidx):
        if const_expr(self.has_dt_bias):
            if tidx < self.dk:
                mDBiasPart[part_row, hv, tidx] = Float32(0.0)
        if const_expr(self.has_a_log):
            if tidx == 0:
                mDAPart[part_row, hv] = Float32(0.0)


def _compile(dtype, beta_dtype, varlen, arch=(9, 0), extra_options="", reverse_cumsum=False, l2norm=False, gate=None,
             g_raw_dtype="Float32", has_a_log=True, has_dt_bias=True, any_gate=False, raw_qk=False):  # fmt: skip
    """Trace and compile one variant against fake tensors (no GPU needed). Returns the TVM-FFI callable."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    DK, BT = 128, 64
    dtype, beta_dtype, g_raw_dtype = dsl_type(dtype), dsl_type(beta_dtype), dsl_type(g_raw_dtype)
    kernel = ChunkKDABwdIntraSm90(
        dtype=dtype, beta_dtype=beta_dtype, varlen=varlen, reverse_cumsum=reverse_cumsum, l2norm=l2norm, gate=gate,
        g_raw_dtype=g_raw_dtype, has_a_log=has_a_log, has_dt_bias=has_dt_bias, any_gate=any_gate, raw_qk=raw_qk,
    )  # fmt: skip
    tt, h, hv = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()

    def tok(dt, heads, d):
        return make_fake_tensor(dt, (tt, heads, d), (cute.sym_int64(divisibility=d), d, 1), assumed_align=16)

    def per_head(dt, heads=hv, rows=tt):
        return make_fake_tensor(dt, (rows, heads), (cute.sym_int64(), 1), assumed_align=dt.width // 8)

    def flat(dt):
        return make_fake_compact_tensor(dt, (cute.sym_int32(),), stride_order=(0,), assumed_align=4)

    # the norms' rstd and each of the gate's partial sums have rows of their own: an output that is off is a
    # stand-in of another size (a (1, H) rstd, a per-token view of a scratch output)
    rstd_rows = cute.sym_int32()
    args = (
        tok(dtype, h, DK), tok(dtype, h, DK), tok(Float32, hv, DK), per_head(beta_dtype),
        tok(Float32, hv, BT), tok(Float32, hv, BT),
        tok(Float32, hv, DK), tok(Float32, hv, DK), tok(Float32, hv, DK), per_head(Float32),
        tok(Float32, hv, DK), tok(Float32, hv, DK), tok(Float32, hv, DK), per_head(Float32),
        flat(Int32), make_fake_tensor(Int32, (cute.sym_int32(), 2), (2, 1), assumed_align=8),
        per_head(Float32, h, rstd_rows), per_head(Float32, h, rstd_rows), tok(dtype, h, DK), tok(dtype, h, DK),
        tok(g_raw_dtype, hv, DK), flat(Float32), flat(Float32), tok(g_raw_dtype, hv, DK),
        make_fake_tensor(Float32, (cute.sym_int32(), hv), (cute.sym_int64(), 1), assumed_align=4),
        make_fake_tensor(Float32, (cute.sym_int32(), hv, DK), (cute.sym_int64(divisibility=DK), DK, 1),
                         assumed_align=16),
        Float32(0.0), Int32(1), Int32(1), Int32(1),
        make_fake_stream(use_tvm_ffi_env_stream=True),
    )  # fmt: skip
    return cute.compile(kernel, *args, options=compile_options(arch, extra_options))
