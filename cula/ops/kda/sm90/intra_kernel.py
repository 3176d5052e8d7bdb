"""KDA chunk forward, intra-chunk stage on SM90: gate + chunk cumsum, the WY factors and the masked scores.

Replaces FLA 0.6.0's ``kda_gate_chunk_cumsum`` / ``chunk_local_cumsum`` + ``chunk_kda_fwd_intra(...,
disable_recompute=True)`` (``fla/ops/kda/gate.py``, ``fla/ops/utils/cumsum.py``, ``fla/ops/kda/chunk_intra.py``,
``chunk_intra_token_parallel.py``, ``wy_fast.py``) with one CuTe DSL kernel. One CTA per (chunk of BT = 64
tokens, value head); per chunk, with rows t, s in [0, 64), ``gc = g_cum`` and ``gl = gc[last valid row]``::

    q, k   = bf16(x / sqrt(sum_k x^2 + 1e-6))          # only with l2norm_qk (FLA's l2norm_fwd), per row
    beta   = act_b(beta)                              # beta_act "none": beta; "sigmoid"; "sigmoid2": 2 sigmoid
    a      = act(g)                                   # "none": g; "softplus": -exp(A_log) softplus(g + dt_bias);
                                                      # "lower_bound": lower_bound sigmoid(exp(A_log) (g + dt_bias))
    gc     = cumsum_t(a) / ln 2                       # fp32, written for the valid rows
    qg     = q exp2(gc),  kg = k exp2(gl - gc)        # bf16
    Aqk    = scale (q k^T o exp2(gc_t - gc_s))  s <= t, 0 above the diagonal   # bf16 [.., 64]
    Akk    = beta_t (k k^T o exp2(gc_t - gc_s)) s <  t, 0 elsewhere            # fp32, stays on chip
    T      = (I + Akk)^-1                             # fp32 on chip (off-diagonal 16x16 blocks from tf32 products,
                                                      # as FLA's solve_tril), rounded to bf16 like FLA's Akk
    w      = T bf16(bf16(beta k) exp2(gc)),  u = T bf16(beta v)               # bf16

exactly the tensors ``chunk_kda_delta_h_fwd_o_sm90`` consumes (FLA's layouts; Aqk's upper triangle is written as zeros,
FLA leaves it unspecified). Rows past the end of a sequence are never written, and a chunk-index row (n, c) with
``64 c >=`` the length of sequence n (the padding of indices built on the device) writes nothing. With ``write_akk``
(chunk_kda's training forward) bf16 T goes to global memory as well, FLA's saved Akk (128 B more per token and value
head).

Numerics of the scores. ``exp2(gc_t - gc_s)`` is factored per 16-row sub-chunk i around an anchor row
``p_i = 16 i + 8``: ``exp2(gc_t - gc_p) * exp2(gc_p - gc_s)``; the query factor multiplies q (and k for Akk) of
the 16 rows of sub-chunk i, the key factor multiplies k of the rows s < 16 (i + 1). Off-diagonal blocks
(s before the sub-chunk) have a key factor <= 1; the query factor and the in-block key factors span at most 8
gate steps. Exponents are clamped at 100 (base 2), so every operand stays finite; the result is exact while
no 8-step window of one channel decays by more than 2^100 (69 nats, i.e. a mean log gate >= -8.6 per step;
``gate="lower_bound"`` with ``lower_bound >= -8.6`` always satisfies it; FLA's non-safe path has no such limit, its
safe path has a similar one). ``any_gate`` makes the kernel exact for any gate: P1 checks every channel's g_cum
against its sub-chunk's anchor row's, and a tile where one differs from it by more than 96 (a factor past 2^96)
takes the exact path: the anchor moves to each sub-chunk's first row, so every factor of an off-diagonal block is
<= 1 (gates <= 0), and the four diagonal 16 x 16 blocks are made element by element before P2
(``sum_c x_tc k_sc exp2(gc_tc - gc_sc)``, every factor <= 1), replacing their products after P3. Tiles within the
bound do the anchored path's arithmetic, bit for bit. The products run on tensor cores as tf32 ``mma.sync`` (fp32
accumulation), the
operands rounded to nearest first, like FLA's tf32 dots (the DSL has no tf32 WGMMA). The warp-level MMA also
lets each warp take one (key block, anchor) pair, so the blocks above the diagonal cost nothing.

``scalar_gate`` (Gated DeltaNet: one gate per token and value head, g ``(T, HV)``, dt_bias ``(HV,)``): the
gate is the same on every channel, so it factors out of the dot products. The scores are the plain ``q k^T`` and
``k k^T``, two SS WGMMAs straight from the q / k tiles after P1 (the tiles' MN-major B layout read as (token,
feature) is the K-major operand layout; bf16 and fp16 products are exact in fp32), and their epilogue multiplies
each score by ``exp2(gc_t - gc_s)``, at most 1 where it is kept: exact for any gate, however steep. P2 then
builds no score operands. P0's first 64 threads copy the chunk's 64 raw gates to shared memory (arriving on the
gate's mbarrier in place of the TMA tile); P1's warp 0 activates them and sums them by two 32-lane scans into
channel 0 of g_cum (the only channel read after it), and P2 writes each row's g_cum broadcast over the channels,
so the outputs and the state/output kernel are KDA's. With ``row_factors`` P2 writes a 16-byte row of factors per
token instead of qg, kg and g_cum. With ``wy_in_recurrence`` as well the kernel stops after the solve: neither w nor
u, no v load, no k'; P2 is one thread a row writing its factors, and P6 writes ``bf16(T diag(beta))`` (the
identity ``u - w S = T diag(beta) (v - diag(exp2 gc) k S)``, which the state/output kernel's ``wy_in_recurrence``
variant evaluates per chunk), 128 bytes a token and value head where w and u are 512.

Phases (256 threads = 2 warpgroups, one CTA per (chunk, value head), ``__syncthreads`` between phases). Each
phase is short and latency-bound, so the kernel is laid out for two CTAs per SM, whose phases interleave: ~97 KB
of shared memory (q/k tiles, g_cum, one 32 KB region reused phase by phase; k' replaces q in P2, v lands in k's
tile after P3) and at most 128 registers per thread. With a scalar gate g_cum is one row of 64 floats, and the
``wy_in_recurrence`` variant (~61 KB) runs three CTAs an SM in 80 registers (1.14x on the H100 against two).

=====  ==========================================================================================================
phase  work
=====  ==========================================================================================================
P0     warp 0: mbarrier + three TMA tile loads (q, k [64 x 128] of head hv // (HV/H); raw g of head hv);
       act_b(beta) row to smem (0 past the sequence end); wait
P1     WG0: gate activation + cumsum, one channel per thread (scalar_gate: warp 0's two scans, channel 0 only),
       g_cum to smem (any_gate: and whether a channel strays past the bound from a sub-chunk's anchor row, voted
       per warp into smem).  WG1, one thread per q / k row (scalar_gate: both warpgroups, two lanes a row):
       rows past the sequence end zeroed, the others normalised in place (l2norm_qk; with write_rstd the row's
       1 / norm to gmem from the first value head of its q / k head's group)
P1x    any_gate's exact path only: the diagonal blocks' 544 (t, s <= t) score pairs, a thread a pair, to smem
P2     round r, sub-chunks (0, 1) then (2, 3), all threads, 8 channels per access: their g_cum, qg, kg rows to
       gmem, their score B operands (query factor * q | k, tf32-rounded fp32) to smem, k' = bf16(bf16(beta k)
       exp2(gc)) over the q row just read
P3     (scalar_gate: before P2, WG0 q k^T and WG1 k k^T on WGMMA, each into Aqk / Akk whole.) Otherwise
       round r: warps 0-2, then 0-6, each take one (key block kb <= anchor) pair of the round's two anchors
       (1 + 2, then 3 + 4 blocks): A operand (key factor * k) built in registers per k-step, 16x32x128 tf32
       mma.sync.  After both rounds: TMA of v into k's tile; Aqk rows to gmem (staged), Akk rows to smem (fp32);
       warps 5-7 zero the blocks above the diagonal (any_gate's exact path: then P1x's pairs over the diagonal
       blocks' entries)
P4     threads 0-63: inverse of the four 16x16 unit-lower diagonal blocks (forward substitution, fp32, in place)
P5     warps 0-5: the six off-diagonal blocks of T, one per warp, on tf32 mma.sync (3 steps, in place)
P6     bf16(T) to smem (WGMMA A layout); wait for v; v <- bf16(beta v)
P7     WG0: w = T k' ; WG1: u = T v' (SS WGMMA 64x128x64), stored bf16 through the k' / v tiles (stmatrix and
       a TMA store for a full chunk, row-predicated copies for a partial one)
=====  ==========================================================================================================

``given_t`` (the training backward's recompute of w, u, qg, kg and g_cum from the forward's saved T): P2 writes its
rows and k' but no score operands, P3-P5 and Aqk are skipped, and P6 loads T's rows from ``mAkk`` instead of
rounding the solve's; w and u are then the bits the forward's ``write_akk`` call made.

Synchronisation: phases hand shared memory on through CTA-wide barriers (barrier 0); the only named barriers are
P7's, one per warpgroup, after the last CTA-wide one. P4 used a named barrier of the four inverting warps, and with
it compute-sanitizer's racecheck matched the later barrier-0 instances of warps 0-3 with the wrong ones of warps 4-7
and reported every later cross-half hand-over as a race; a CTA-wide barrier there costs nothing (warps 4-7 are
idle in P4) and leaves racecheck clean. In P7 each warpgroup waits for all four warps' share of its WGMMA before
any warp rewrites the B tile with the result (a warp's ``wgmma.wait_group`` covers its own share only).

Memory floor (bf16 q/k/v, fp32 g, H = HV): it reads q, k, v (3 x 256 B per token and head), g (512 B) and beta,
writes w, u, qg, kg (4 x 256 B), Aqk (128 B) and g_cum (512 B): 1,282 B read, 1,664 B written, 2,946 B per
token and head, about 2.3x its inputs.

The fused q/k L2 norm is rounded back to q's dtype in place, exactly what FLA's ``l2norm_fwd`` hands its intra
stage: the tiles stay the bf16 operands they were, and the comparison with FLA isolates the intra math.
With GVA each of the HV/H value-head CTAs sharing a q/k head normalises its own copy.

Supported: K = V = 128, BT = 64, bf16/fp16 q/k/v, g in fp32/bf16/fp16, beta in bf16/fp16/fp32, GVA
(HV a multiple of H), varlen (``cu_seqlens`` int32 + ``chunk_indices`` int32 ``[NT, 2]`` of (sequence, chunk)).
"""
from __future__ import annotations

import enum

import cuda.bindings.driver as cuda
import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float16, Float32, Int32, TFloat32, const_expr, cute
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warp, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from cula.cache import compile_options
from cula.ops._host import GATES, ROW_FACTORS, dsl_type
from cula.ops.cute_common import FIRST_NAMED_BARRIER, chunk_rows, gemm_k_blocks, round_tf32, token_major, vec_at
from cula.ops.kda.sm90.intra import BETA_ACTS

__all__ = ["ChunkKDAIntraFwdSm90"]

L2NORM_EPS = 1e-6  # FLA's l2norm_fwd: x / sqrt(sum x^2 + eps)
RCP_LN2 = 1.4426950408889634
LN2 = 0.6931471805599453
_ANCHOR_CLAMP = 100.0  # base-2 exponent cap of the score factors (see the module docstring)
# any_gate: the anchor factoring is taken where no g_cum of a sub-chunk lies further than this (base 2) from its
# anchor row's, so that no factor reaches the clamp (a margin for the fp32 rounding of the check)
_ANCHOR_SPAN = 96.0
DIAG_PAIRS = 4 * 136  # (t, s <= t) pairs of the four diagonal 16 x 16 blocks
# Shared-memory loops that read, compute and write back (P1's gate cumsum and row norms, P2, P6's v')
# issue the next step's loads before this step's stores: ptxas never moves a load above a store it cannot prove
# disjoint, so a plain loop runs one full latency chain per step (the gate cumsum: ~110 cycles x 64). P0 loads the
# raw gate first, on its own mbarrier, so the gate cumsum need not wait for q and k (bit-identical to the plain
# loops, 6% faster on the H200).
# P7 of a full chunk moves w / u to global memory by stmatrix into the k / v tile and one TMA store per
# warpgroup; 64 scalar shared stores (each with its swizzle arithmetic), a barrier and eight 16-byte row copies per
# thread, kept for partial chunks, were a tenth of the kernel's time.
# P5 runs on tf32 mma.sync (FLA's solve_tril precision for these blocks): one warp per block of T and three
# barriers, where fp32 SIMT over shared memory took six and ~4.8 K warp instructions a tile.
# P2's operand stores index no register array at run time (that would put them in local memory), and P1's g_cum
# stores carry no per-store swizzle arithmetic or select.
# P2 builds k' from qg's exp2(gc) rather than recomputing it, the rows past the sequence end are zeroed once in P1
# instead of masked per element in P2 and P3, P2's score operands are stored without a data select, and bf16
# operands are widened from their 32-bit pairs (``_widen``).


class Barrier(enum.IntEnum):
    """Named barriers (0 is the CTA-wide one)."""

    # one per warpgroup (128 threads): its w / u product has read the B tile, or its output tile is staged
    WARPGROUP0 = FIRST_NAMED_BARRIER
    WARPGROUP1 = FIRST_NAMED_BARRIER + 1


class ChunkKDAIntraFwdSm90:
    """KDA intra-chunk forward (gate cumsum + Aqk + (I + Akk)^-1 + w, u, qg, kg), sm_90a.

    Static configuration: dtype of q/k/v and of the bf16 outputs, dtype of the raw gate and of beta, the gate
    activation, varlen, the fused q/k L2 norm (``l2norm_qk``) and the beta activation (``beta_act``). Token
    counts, heads and sequences are runtime values.
    """

    arch = 90

    def __init__(
        self, dtype=BFloat16, g_dtype=Float32, beta_dtype=BFloat16, gate: str = "none", varlen=False,
        l2norm_qk: bool = False, beta_act: str = "none", g_cum_last_only: bool = False, write_akk: bool = False,
        scalar_gate: bool = False, given_t: bool = False, any_gate: bool = False, write_rstd: bool = False,
        row_factors: bool = False, wy_in_recurrence: bool = False,
    ):  # fmt: skip
        # g_cum only at each chunk's last valid row: all the state/output kernel reads of it
        self.g_cum_last_only = bool(g_cum_last_only)
        # bf16 T = (I + Akk)^-1 to global memory too (FLA's saved Akk, for the training path's backward); without
        # it the kernel's mAkk argument is None
        self.write_akk = bool(write_akk)
        # T = (I + Akk)^-1 read from mAkk (bf16, as write_akk stored it) instead of computed: the training backward's
        # recompute of w, u, qg, kg and g_cum, with no scores (Aqk is not written, mAqk is None) and no solve
        self.given_t = bool(given_t)
        if self.given_t and self.write_akk:
            raise ValueError("given_t reads Akk: it cannot write it too (write_akk)")
        # one gate per (token, value head), Gated DeltaNet's: raw g (T, HV), dt_bias (HV,); the scores are the
        # plain products times exp2(gc_t - gc_s), exact for any gate (see the module docstring)
        self.scalar_gate = bool(scalar_gate)
        # exact for any gate: a tile whose gates break the anchor factoring's bound takes the exact path (see the
        # module docstring); for gates no bound is known of (a log-space gate without safe_gate, the softplus gate)
        self.any_gate = bool(any_gate)
        if self.any_gate and (self.scalar_gate or self.given_t):
            raise ValueError("any_gate is for the per-channel scores: scalar_gate is exact already, given_t has none")
        if gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
        if beta_act not in BETA_ACTS:
            raise ValueError(f"beta_act must be one of {BETA_ACTS}, got {beta_act!r}")
        self.l2norm_qk, self.beta_act = bool(l2norm_qk), beta_act
        # each q and k row's 1 / norm to global memory as well, from the first value head of each q / k head's group
        # (one float a row-norm thread): the training backward's stages 6 and 7 normalise the raw rows as they load
        # them with it, so FLA's two l2norm_fwd launches drop out of the step
        self.write_rstd = bool(write_rstd)
        if self.write_rstd and not self.l2norm_qk:
            raise ValueError("write_rstd writes the L2 norm's 1 / norms: it needs l2norm_qk")
        # scalar_gate only: instead of qg, kg and g_cum, each row's factors f_q = rstd_q exp2(gc), f_k = rstd_k
        # exp2(gl - gc), f_g = exp2(gc), f_x = rstd_k exp2(gc) in mQg (T_total, HV, ROW_FACTORS) fp32, 16 bytes a
        # row where qg and kg are 512: the state/output kernel's row_factors variant applies them to the raw q and k
        self.row_factors = bool(row_factors)
        if self.row_factors and not (self.scalar_gate and not self.given_t and not self.write_akk):
            raise ValueError("row_factors is for scalar_gate inference calls (no given_t, no write_akk)")
        # row_factors only: neither w nor u, and no v read; bf16 T diag(beta) to mAkk instead (128 bytes a row where
        # w and u are 512), from which the state/output kernel's wy_in_recurrence variant makes v_new itself, with
        # the raw v and k (the factor rows' fourth entry, f_x = rstd_k exp2(gc), scales its k S)
        self.wy_in_recurrence = bool(wy_in_recurrence)
        if self.wy_in_recurrence and not self.row_factors:
            raise ValueError("wy_in_recurrence writes the factor rows' T diag(beta) for the recurrence: it needs "
                             "row_factors")
        # CTAs an SM, whose latency-bound phases interleave: the wy variant (no w / u tiles in flight, g_cum one row,
        # ~61 KB of shared memory) fits three in 80 registers; the others two (~97 KB, 128 registers)
        self.ctas_per_sm = 3 if self.wy_in_recurrence else 2
        if dtype not in (BFloat16, Float16):
            raise ValueError(f"dtype must be BFloat16 or Float16, got {dtype}")
        self.dtype, self.g_dtype, self.beta_dtype = dtype, g_dtype, beta_dtype
        self.gate, self.varlen = gate, varlen
        self.bt, self.dk, self.dv = 64, 128, 128
        self.num_threads = 256
        # score B operands of the 2 anchors of one round: 2 x [32 rows (16 q | 16 k), K] fp32 (tf32-rounded)
        self.sb_bytes = 2 * 32 * self.dk * 4
        self.gin_bytes = 0 if self.scalar_gate else self.dk * self.bt * (g_dtype.width // 8)
        self.x_bytes = self.bt * self.dk * (dtype.width // 8)
        # The region holds raw g (P0-P1), the score B operands (P2-P3), then: Akk, inverted in place into T
        # (fp32 [BT, a_ld], P3 epilogue-P6); Aqk staged as bf16 [BT, BT + 8] (rows 144 B apart: 16-byte
        # aligned, banks staggered; P3 epilogue); P5's scratch block of T (off_y, 16 rows of 20 floats); bf16 T
        # as the WGMMA A operand (1024-aligned for its swizzle; P6-P7, after Aqk is stored)
        self.off_akk, self.off_aqk, self.aqk_ld, self.off_t, self.off_y = 0, 17408, self.bt + 8, 17408, 26624
        # Akk / T rows of 68 floats: 16-byte rows for P6's vector reads, and the P3 epilogue's column writes and
        # P5's fragment reads free of bank conflicts
        self.a_ld = self.bt + 4
        operands = 0 if self.scalar_gate else self.sb_bytes  # (its scores are WGMMAs of the q / k tiles)
        self.region_bytes = max(operands, self.gin_bytes, self.off_y + 16 * 20 * 4)
        assert self.off_akk + self.bt * self.a_ld * 4 <= min(self.off_aqk, self.off_t)
        assert self.off_aqk + self.bt * self.aqk_ld * 2 <= self.off_y
        assert self.off_t + self.bt * self.bt * 2 <= self.off_y

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (T_total, H, K)   dtype
        mK: cute.Tensor,  # (T_total, H, K)   dtype
        mV: cute.Tensor,  # (T_total, HV, V)  dtype
        mGin: cute.Tensor,  # (T_total, HV, K) g_dtype, raw gate (log space when gate == "none");
        #                    (T_total, HV) with scalar_gate
        mBeta: cute.Tensor,  # (T_total, HV) beta_dtype
        mAlog: cute.Tensor,  # (HV,) fp32
        mBias: cute.Tensor,  # (HV, K) fp32; (HV,) with scalar_gate
        mW: cute.Tensor | None,  # (T_total, HV, K)  dtype, out; None with wy_in_recurrence
        mU: cute.Tensor | None,  # (T_total, HV, V)  dtype, out; None with wy_in_recurrence
        mQg: cute.Tensor,  # (T_total, HV, K) dtype, out; row_factors: (T_total, HV, ROW_FACTORS) fp32, out
        mKg: cute.Tensor | None,  # (T_total, HV, K) dtype, out; None with row_factors
        mAqk: cute.Tensor | None,  # (T_total, HV, BT) dtype, out; None with given_t
        mAkk: cute.Tensor | None,  # (T_total, HV, BT) dtype: bf16 (I + Akk)^-1, out (write_akk) or in (given_t);
        #                            wy_in_recurrence: bf16 T diag(beta), out
        mG: cute.Tensor | None,  # (T_total, HV, K) fp32, out; None with row_factors
        mRstd: cute.Tensor | None,  # (2, T_total, H) fp32, out: q's and k's 1 / norms (write_rstd; else None)
        mCu: cute.Tensor,  # (N + 1,) int32, unread unless varlen
        mCi: cute.Tensor,  # (NT, 2) int32 (sequence, chunk), unread unless varlen
        seqlen: Int32,  # tokens per sequence when not varlen
        num_chunks: Int32,  # grid x: chunks per sequence, or NT when varlen
        num_seqs: Int32,  # grid z: B, or 1 when varlen
        scale: Float32,
        lower_bound: Float32,
        stream: cuda.CUstream,
    ):
        dt, BT, DK = self.dtype, self.bt, self.dk
        q_v = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[2, 0, 1]))  # (K, T, H)
        k_v = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[2, 0, 1]))  # (K, T, H)
        v_v = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[2, 0, 1]))  # (V, T, HV)

        # q/k/v tiles are stored as the MN-major B operand of w = T k', u = T v' (feature x token).
        sX_l = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (BT, DK, BT), dt, 1)  # (K, BT, 1)
        sGin_l = cute.make_layout((DK, BT, 1), stride=(1, DK, DK * BT))
        sT_l = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BT, DK, BT), dt, 1)  # (BT, BT, 1)

        mma_wu = sm90_utils.make_trivial_tiled_mma(
            dt, dt, OperandMajorMode.K, OperandMajorMode.MN, Float32, (1, 1, 1), tiler_mn=(BT, DK)
        )
        # scalar_gate's scores q k^T and k k^T (64 x 64 x 128): both operands the (token, feature) view of the q / k
        # tiles, K-major (the tiles' MN-major B layout read transposed is the K-major one, byte for byte)
        mma_s = sm90_utils.make_trivial_tiled_mma(
            dt, dt, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1), tiler_mn=(BT, BT)
        )

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tq = cpasync.make_tiled_tma_atom(g2s, q_v, cute.select(sX_l, mode=[0, 1]), (DK, BT))
        tma_k, tk = cpasync.make_tiled_tma_atom(g2s, k_v, cute.select(sX_l, mode=[0, 1]), (DK, BT))
        tma_v = tv = None  # wy_in_recurrence: v is the recurrence's to read
        if const_expr(not self.wy_in_recurrence):
            tma_v, tv = cpasync.make_tiled_tma_atom(g2s, v_v, cute.select(sX_l, mode=[0, 1]), (DK, BT))
        tma_g, tg = None, mGin  # scalar_gate: P0 copies the chunk's 64 gates from global memory
        if const_expr(not self.scalar_gate):
            g_v = cute.make_tensor(mGin.iterator, cute.select(mGin.layout, mode=[2, 0, 1]))  # (K, T, HV)
            tma_g, tg = cpasync.make_tiled_tma_atom(g2s, g_v, cute.select(sGin_l, mode=[0, 1]), (DK, BT))
        # w / u leave from the k / v tiles they are staged in, whose layout is the loads' (feature, token) one
        tma_w = tw = tma_u = tu = None  # (wy_in_recurrence: no w, u; mW and mU are None)
        if const_expr(not self.wy_in_recurrence):
            s2g = cpasync.CopyBulkTensorTileS2GOp()
            w_v = cute.make_tensor(mW.iterator, cute.select(mW.layout, mode=[2, 0, 1]))  # (K, T, HV)
            u_v = cute.make_tensor(mU.iterator, cute.select(mU.layout, mode=[2, 0, 1]))  # (V, T, HV)
            tma_w, tw = cpasync.make_tiled_tma_atom(s2g, w_v, cute.select(sX_l, mode=[0, 1]), (DK, BT))
            tma_u, tu = cpasync.make_tiled_tma_atom(s2g, u_v, cute.select(sX_l, mode=[0, 1]), (DK, BT))

        # ~97 KB, so that two CTAs share an SM (the wy variant: ~61 KB, three; see the module docstring)
        @cute.struct
        class Storage:
            # q tile (v's once P2 is done with q), k tile
            sQK: cute.struct.Align[cute.struct.MemRange[dt, 2 * cute.cosize(sX_l)], 1024]
            # g_cum: one row of BT floats with scalar_gate (its only channel), so that the wy variant fits 3 CTAs
            sG: cute.struct.Align[cute.struct.MemRange[Float32, BT * (1 if self.scalar_gate else DK)], 1024]
            region: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.region_bytes], 1024]
            sBeta: cute.struct.Align[cute.struct.MemRange[Float32, BT], 16]
            mbar: cute.struct.MemRange[cutlass.Int64, 2]  # q, k (then v); raw g
            # any_gate (empty otherwise): WG0's warps, whether a channel of theirs breaks the anchor factoring's
            # bound in some sub-chunk; the exact path's diagonal-block sums (Aqk's and Akk's, unscaled) by pair
            flags: cute.struct.Align[cute.struct.MemRange[Int32, 4 if self.any_gate else 0], 16]
            diag: cute.struct.Align[cute.struct.MemRange[Float32, 2 * DIAG_PAIRS if self.any_gate else 0], 16]
            # row_factors with l2norm_qk: the q rows' 1 / norms, then the k rows' (P1 -> P2)
            sRstd: cute.struct.Align[cute.struct.MemRange[Float32, 2 * BT if self.row_factors else 0], 16]

        self.storage = Storage
        self.kernel(
            tma_q, tq, tma_k, tk, tma_v, tv, tma_g, tg, tma_w, tw, tma_u, tu,
            mBeta, mAlog, mBias, mW, mU, mQg, mKg, mAqk, mAkk, mG, mRstd, mCu, mCi, seqlen, scale, lower_bound,
            mma_wu, mma_s, sX_l, sGin_l, sT_l,
        ).launch(
            grid=(num_chunks, mBeta.shape[1], num_seqs), block=(self.num_threads, 1, 1), stream=stream,
            # ctas_per_sm CTAs an SM: ptxas keeps to 128 (three: 80) registers; the carveout is the most shared
            # memory (%)
            min_blocks_per_mp=self.ctas_per_sm, max_number_threads=[self.num_threads, 1, 1],
            preferred_smem_carveout=100,
        )  # fmt: skip

    @cute.jit
    def _act(self, x: Float32, coef: Float32, bias: Float32, lower_bound: Float32) -> Float32:
        """The per-element gate activation (FLA ``kda_gate_chunk_cumsum_vector_kernel``)."""
        a = x
        if const_expr(self.gate == "softplus"):
            z = x + bias
            # softplus with FLA's threshold 20 (identity above it)
            sp = cute.math.log2(1.0 + cute.math.exp2(z * RCP_LN2, fastmath=True), fastmath=True) * LN2
            a = -coef * Float32(cutlass.select_(z > 20.0, z, sp))
        if const_expr(self.gate == "lower_bound"):
            z = coef * (x + bias)
            # rcp.approx (<= 1 ulp) instead of an IEEE divide: its slow-path branch kept the cumsum loop from
            # overlapping iterations
            a = lower_bound * cute.arch.rcp_approx(1.0 + cute.math.exp2(-z * RCP_LN2, fastmath=True))
        return a

    @cute.jit
    def _raw_gate(self, sGin0: cute.Tensor, region, ch, t: int) -> Float32:
        """Raw gate of channel ``ch`` at chunk row ``t``: from the TMA tile, or with ``scalar_gate`` the row's
        one gate, P0's fp32 copy at the region's start (every thread of a warp reads the same word: a
        broadcast)."""
        if const_expr(not self.scalar_gate):
            return sGin0[ch, t].to(Float32)
        return cute.make_tensor(cute.recast_ptr(region, dtype=Float32), cute.make_layout(self.bt))[t]

    @cute.jit
    def _act_beta(self, x: Float32) -> Float32:
        """beta as the delta rule uses it (FLA ``fused_beta_sigmoid``: ``scale sigmoid(x)`` in fp32)."""
        b = x
        if const_expr(self.beta_act != "none"):
            s = 2.0 if const_expr(self.beta_act == "sigmoid2") else 1.0
            # exp2 overflows to inf for very negative x, giving exactly 0, as sigmoid should
            b = Float32(s) / (1.0 + cute.math.exp2(-x * RCP_LN2, fastmath=True))
        return b

    @cute.jit
    def _widen(self, r: cute.Tensor) -> list:
        """The elements of a register tensor of q's dtype as fp32. For bf16 from the 32-bit pairs: ``w << 16`` and
        ``w & 0xffff0000``, one instruction each, where the element-wise conversion spends two on every odd
        element (a byte permute, then the shift). Exact either way."""
        n = cute.size(r)
        if const_expr(self.dtype != BFloat16):
            return [r[e].to(Float32) for e in range(n)]
        w = cute.recast_tensor(r, Int32)
        out = []
        for i in cutlass.range_constexpr(n // 2):
            out.append((w[i] << 16).bitcast(Float32))
            out.append((w[i] & Int32(-65536)).bitcast(Float32))
        return out

    @cute.jit
    def _scale_rows_vec(self, sX0, sBeta, tidx):
        """v' = bf16(v beta_t) in place on a (V, BT) smem tile, 8 channels per access (all threads)."""
        c8 = cute.assume((tidx % 16) * 8, divby=8)
        rows = self.num_threads // 16
        steps = self.bt // rows

        def load(m):
            rv = cute.make_rmem_tensor(8, self.dtype)
            cute.autovec_copy(vec_at(sX0, (c8, tidx // 16 + rows * m)), rv)
            return rv

        nxt = load(0)
        for m in cutlass.range_constexpr(steps):
            t = tidx // 16 + rows * m
            rv = nxt
            if const_expr(m + 1 < steps):
                nxt = load(m + 1)
            b = sBeta[t]
            xv = self._widen(rv)
            for e in cutlass.range_constexpr(8):
                rv[e] = (xv[e] * b).to(self.dtype)
            cute.autovec_copy(rv, vec_at(sX0, (c8, t)))

    @cute.jit
    def _qg_kg_score_operands_vec(
        self, sQ0, sK0, sG, sB, sBeta, mQg, mKg, mG, tok0, hv, valid, tidx, subchunks, anchor_row=8, sRstd=None,
    ):  # fmt: skip
        """P2 of one round: g_cum, qg, kg rows to gmem, k' over the q rows in smem and the score B operands of
        the two sub-chunks j in ``subchunks`` (into B slots 0 and 1 of ``sB``, a flat fp32 tensor, see
        ``_b_unit``), their query factors taken at row ``16 j + anchor_row``. Thread (r, c) takes rows 16 j + r and
        the 8 channels 8 c..8 c + 7, so every access moves 8 channels."""
        BT, dt, V8 = self.bt, self.dtype, 8
        r = tidx // 16
        c8 = cute.assume((tidx % 16) * V8, divby=V8)
        vec = cute.make_layout(V8)
        at = vec_at

        rgl = cute.make_rmem_tensor(V8, Float32)
        if const_expr(self.scalar_gate):  # one g_cum a row, in channel 0 (_scalar_gate_scan)
            rgl.fill(sG[0, BT - 1])
        else:
            cute.autovec_copy(at(sG, (c8, BT - 1), 4), rgl)  # sG's 8-float units stay whole under its swizzle

        def load(slot):
            j = subchunks[slot]
            rq = cute.make_rmem_tensor(V8, dt)
            rk = cute.make_rmem_tensor(V8, dt)
            rg = cute.make_rmem_tensor(V8, Float32)
            rga = cute.make_rmem_tensor(V8, Float32)
            cute.autovec_copy(at(sQ0, (c8, 16 * j + r)), rq)
            cute.autovec_copy(at(sK0, (c8, 16 * j + r)), rk)
            if const_expr(self.scalar_gate):
                rg.fill(sG[0, 16 * j + r])
            else:
                cute.autovec_copy(at(sG, (c8, 16 * j + r), 4), rg)
            if const_expr(not self.scalar_gate and not self.given_t):  # the anchor's g_cum, for the score operands
                cute.autovec_copy(at(sG, (c8, 16 * j + anchor_row), 4), rga)
            return rq, rk, rg, rga

        # the second sub-chunk's rows are read before the first one's stores
        ahead = [load(0), load(1)]
        for slot in cutlass.range_constexpr(2):
            j = subchunks[slot]
            t = 16 * j + r
            live = t < valid
            rq, rk, rg, rga = ahead[slot]
            rqg = cute.make_rmem_tensor(V8, dt)
            rkg = cute.make_rmem_tensor(V8, dt)
            rkp = cute.make_rmem_tensor(V8, dt)
            bq = cute.make_rmem_tensor(V8, Float32)
            bk = cute.make_rmem_tensor(V8, Float32)
            b = sBeta[t]
            qf, kf = self._widen(rq), self._widen(rk)
            for e in cutlass.range_constexpr(V8):
                gc = rg[e]
                qv, kv = qf[e], kf[e]
                eg = cute.math.exp2(gc, fastmath=True)
                rqg[e] = (qv * eg).to(dt)
                # P7's B operand k' = bf16(bf16(beta k) exp2(gc)) (FLA's double rounding), from qg's factor
                rkp[e] = ((kv * b).to(dt).to(Float32) * eg).to(dt)
                rkg[e] = (kv * cute.math.exp2(rgl[e] - gc, fastmath=True)).to(dt)
                # rows past the sequence end have q = k = 0 (P1), so their operands are 0 as well
                if const_expr(not (self.given_t or self.scalar_gate)):
                    f = cute.math.exp2(cute.arch.fmin(gc - rga[e], _ANCHOR_CLAMP), fastmath=True)
                    bq[e] = round_tf32(qv * f)
                    bk[e] = round_tf32(kv * f)
            # q's row is read: k' takes its place (P7 reads it there)
            cute.autovec_copy(rkp, at(sQ0, (c8, t)))
            # two 16-byte units per row, units c4 and c4 + 1 (unit bit 3 = (tidx >> 2) & 1, see _b_unit)
            c4 = cute.assume((tidx % 16) * 2, divby=2)
            u8 = (tidx >> 2) & 1
            for h in cutlass.range_constexpr(0 if self.given_t or self.scalar_gate else 2):
                for which, src in ((0, bq), (1, bk)):
                    part = cute.make_rmem_tensor(4, Float32)
                    for e in cutlass.range_constexpr(4):
                        part[e] = src[4 * h + e]
                    cute.autovec_copy(part, self._b_unit(sB, slot, r + 16 * which, c4 + h, u8))
            if const_expr(self.row_factors):
                # one thread a row (channel 0's unit): its factors, 16 bytes, in place of qg, kg and g_cum
                if live & (c8 == 0):
                    self._store_factor_row(sRstd, mQg, tok0, hv, t, rg[0], rgl[0])
            elif const_expr(self.g_cum_last_only):  # noqa: SIM102 - a trace-time condition around a run-time one
                if t == valid - 1:
                    cute.autovec_copy(rg, cute.make_tensor(mG[tok0 + t, hv, None].iterator + c8, vec))
            if const_expr(not self.row_factors):
                if live:
                    if const_expr(not self.g_cum_last_only):
                        cute.autovec_copy(rg, cute.make_tensor(mG[tok0 + t, hv, None].iterator + c8, vec))
                    cute.autovec_copy(rqg, cute.make_tensor(mQg[tok0 + t, hv, None].iterator + c8, vec))
                    cute.autovec_copy(rkg, cute.make_tensor(mKg[tok0 + t, hv, None].iterator + c8, vec))

    @cute.jit
    def _store_factor_row(self, sRstd, mF, tok0, hv, t, gc: Float32, gl: Float32):
        """Row t's factors (``row_factors``), 16 bytes: f_q = rstd_q exp2(gc), f_k = rstd_k exp2(gl - gc), f_g =
        exp2(gc), f_x = rstd_k exp2(gc) (the 1 / norms 1 without l2norm_qk; f_x is read by the wy_in_recurrence
        variants only)."""
        nq, nk = Float32(1.0), Float32(1.0)
        if const_expr(self.l2norm_qk):
            nq, nk = sRstd[t], sRstd[self.bt + t]
        eg = cute.math.exp2(gc, fastmath=True)
        rf = cute.make_rmem_tensor(ROW_FACTORS, Float32)
        rf[0] = nq * eg
        rf[1] = nk * cute.math.exp2(gl - gc, fastmath=True)
        rf[2] = eg
        rf[3] = nk * eg
        cute.autovec_copy(rf, mF[tok0 + t, hv, None])

    def _row_units(self, tidx):
        """This thread's 8-column units of a [BT, BT] tile, all threads in turn: ``(row, first column)`` pairs (plain
        Python, traced inline)."""
        for j in range(self.bt * self.bt // 8 // self.num_threads):
            item = tidx + j * self.num_threads
            yield item // 8, cute.assume((item % 8) * 8, divby=8)

    @cute.jit
    def _store_t_beta(self, sA, sBeta, mTb, tok0, hv, valid, tidx):
        """wy_in_recurrence's P6: the valid rows of bf16(T diag(beta)) (T in ``sA``, fp32, zeros above the diagonal;
        beta 0 past the sequence end) to ``mTb``, 8 columns a store."""
        dt = self.dtype
        for t, s0 in self._row_units(tidx):
            if t < valid:
                rt = cute.make_rmem_tensor(8, dt)
                for h4 in cutlass.range_constexpr(2):
                    ra = self._a_row4(sA, t, s0 + 4 * h4)
                    for e in cutlass.range_constexpr(4):
                        rt[4 * h4 + e] = (ra[e] * sBeta[s0 + 4 * h4 + e]).to(dt)
                cute.autovec_copy(rt, cute.make_tensor(mTb[tok0 + t, hv, None].iterator + s0, cute.make_layout(8)))

    @cute.jit
    def _store_rows_vec(self, sX0, mOut, tok0, hv, valid, tid):
        """Rows of a (K, BT) feature-major smem tile to ``mOut[tok0 + t, hv, :]``, 8 channels per store; the
        128 threads of one warpgroup, row t = tid // 16 + 8 m, channels 8 (tid % 16)..+7."""
        V8 = 8
        c8 = cute.assume((tid % 16) * V8, divby=V8)
        vec = cute.make_layout(V8)
        for m in cutlass.range_constexpr(self.bt // 8):
            t = tid // 16 + 8 * m
            if t < valid:
                r = cute.make_rmem_tensor(V8, self.dtype)
                cute.autovec_copy(vec_at(sX0, (c8, t)), r)
                cute.autovec_copy(r, cute.make_tensor(mOut[tok0 + t, hv, None].iterator + c8, vec))

    @cute.jit
    def _l2norm_rows(self, sX0: cute.Tensor, t: Int32) -> Float32:
        """Normalise token row t of a (K, BT) smem tile in place, one thread per row, 8 channels per access;
        returns the row's 1 / norm.
        Threads t..t+7 read the same 16-byte column of 8 consecutive rows, which the 128-byte swizzle spreads
        over all 32 banks; no shuffles, so the 128 rows of q and k are normalised side by side."""
        V8, dt = 8, self.dtype
        ss = cute.make_rmem_tensor(V8, Float32)  # 8 partial sums: short dependent chains
        ss.fill(0.0)
        for c in cutlass.range_constexpr(self.dk // V8):
            rx = cute.make_rmem_tensor(V8, dt)
            cute.autovec_copy(vec_at(sX0, (c * V8, t)), rx)
            xf = self._widen(rx)
            for e in cutlass.range_constexpr(V8):
                ss[e] = ss[e] + xf[e] * xf[e]
        tot = ((ss[0] + ss[1]) + (ss[2] + ss[3])) + ((ss[4] + ss[5]) + (ss[6] + ss[7]))
        # FLA: 1 / sqrt(sum + eps); correctly rounded sqrt and divide, not rsqrt.approx, so the bf16 result
        # differs from FLA's only by the summation order
        r = Float32(1.0) / cute.math.sqrt(tot + L2NORM_EPS)
        steps = self.dk // V8

        def load(c):
            rx = cute.make_rmem_tensor(V8, dt)
            cute.autovec_copy(vec_at(sX0, (c * V8, t)), rx)
            return rx

        nxt = load(0)
        for c in cutlass.range_constexpr(steps):
            rx = nxt
            if const_expr(c + 1 < steps):
                nxt = load(c + 1)
            xf = self._widen(rx)
            for e in cutlass.range_constexpr(V8):
                rx[e] = (xf[e] * r).to(dt)
            cute.autovec_copy(rx, vec_at(sX0, (c * V8, t)))
        return r

    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom, tq: cute.Tensor,
        tma_k: cute.CopyAtom, tk: cute.Tensor,
        tma_v: cute.CopyAtom, tv: cute.Tensor,
        tma_g: cute.CopyAtom, tg: cute.Tensor,
        tma_w: cute.CopyAtom, tw: cute.Tensor,
        tma_u: cute.CopyAtom, tu: cute.Tensor,
        mBeta: cute.Tensor, mAlog: cute.Tensor, mBias: cute.Tensor,
        mW: cute.Tensor, mU: cute.Tensor, mQg: cute.Tensor, mKg: cute.Tensor, mAqk: cute.Tensor | None,
        mAkk: cute.Tensor | None, mG: cute.Tensor, mRstd: cute.Tensor | None, mCu: cute.Tensor, mCi: cute.Tensor,
        seqlen: Int32, scale: Float32, lower_bound: Float32,
        mma_wu: cute.TiledMma, mma_s: cute.TiledMma, sX_l: cute.ComposedLayout, sGin_l: cute.Layout,
        sT_l: cute.ComposedLayout,
    ):  # fmt: skip
        BT, DK = self.bt, self.dk
        dt = self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        bx, hv, bz = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // 128)
        tid = tidx % 128
        HV = mBeta.shape[1]
        group = HV // tq.shape[2]
        h = hv // group

        tok0, valid = chunk_rows(self.varlen, mCu, mCi, bx, bz, seqlen, BT)

        storage = SmemAllocator().allocate(self.storage)
        bar = storage.mbar.data_ptr()
        bar_g = bar + 1
        # k's tile right after q's (a multiple of the swizzle period), so one thread's row can be in either
        x_elems = cute.cosize(sX_l)
        sQ = cute.make_tensor(cute.recast_ptr(storage.sQK.data_ptr(), sX_l.inner, dtype=dt), sX_l.outer)
        sK = cute.make_tensor(cute.recast_ptr(storage.sQK.data_ptr() + x_elems, sX_l.inner, dtype=dt), sX_l.outer)
        # P2 overwrites q's tile with k' (P7's B operand of w) row by row as it reads q; v is loaded into k's
        # tile once P3 has read k
        sKp, sV = sQ, sK
        # g_cum (k, t): rows of 128 floats, the 8-float units XOR-swizzled by t % 8, so that the score A build's
        # (8 rows x 8 floats) reads and the 8-channel row reads are both free of bank conflicts
        # (scalar_gate: the one row, indexed (0, t) like channel 0)
        if const_expr(self.scalar_gate):
            sG = cute.make_tensor(storage.sG.data_ptr(), cute.make_layout((1, BT), stride=(0, 1)))
        else:
            sG = cute.make_tensor(
                storage.sG.data_ptr(),
                cute.make_composed_layout(cute.make_swizzle(3, 3, 4), 0, cute.make_layout((DK, BT), stride=(1, DK))),
            )
        sBeta = storage.sBeta.get_tensor(cute.make_layout(BT))
        base = storage.region.data_ptr()
        sGin = cute.make_tensor(cute.recast_ptr(base, dtype=self.g_dtype), sGin_l)
        # Akk, then (I + Akk)^-1 in place (t, s)
        sA = cute.make_tensor(
            cute.recast_ptr(base + self.off_akk, dtype=Float32), cute.make_layout((BT, BT), stride=(self.a_ld, 1))
        )
        sT = cute.make_tensor(cute.recast_ptr(base + self.off_t, sT_l.inner, dtype=dt), sT_l.outer)
        sAqk = cute.make_tensor(
            cute.recast_ptr(base + self.off_aqk, dtype=dt), cute.make_layout((BT, BT), stride=(self.aqk_ld, 1))
        )  # (t, s)

        sQ0, sK0, sV0, sGin0 = sQ[None, None, 0], sK[None, None, 0], sV[None, None, 0], sGin[None, None, 0]

        # ---------------- P0: loads of q, k, raw g (phase 0 of the barrier; v is phase 1) ----------------
        coef, bias = self._load_chunk(
            tma_q, tq, tma_k, tk, tma_g, tg, mBeta, mAlog, mBias, sQ, sK, sGin, sBeta, base, bar, bar_g, h, hv, tok0,
            valid, tidx, tid, warp_idx,
        )  # fmt: skip
        # ---------------- P1: gate cumsum (WG0) | q, k row norms (WG1) ----------------
        sFlags = storage.flags.get_tensor(cute.make_layout(4)) if const_expr(self.any_gate) else None
        sRstd = None
        if const_expr(self.row_factors and self.l2norm_qk):
            sRstd = storage.sRstd.get_tensor(cute.make_layout(2 * BT))
        self._gate_cumsum_and_norms(
            sQ0, sGin0, sG, storage.sG.data_ptr(), base, bar, bar_g, coef, bias, lower_bound, valid, wg, tid, x_elems,
            sFlags, warp_idx, mRstd, tok0, h, hv % group == 0, sRstd,
        )  # fmt: skip
        if const_expr(self.scalar_gate and not self.given_t):
            cute.arch.fence_view_async_shared()  # P1's normalised rows, read next by WGMMA (the async proxy)
        cute.arch.barrier()
        # the anchor row of each sub-chunk's score factors: its middle row; any_gate's exact path takes its first
        # row (every factor of an off-diagonal block then <= 1) and makes the diagonal blocks element by element
        anchor_row = 8
        slow = False
        if const_expr(self.any_gate):
            sDiag = storage.diag.get_tensor(cute.make_layout(2 * DIAG_PAIRS))
            slow = (sFlags[0] | sFlags[1] | sFlags[2] | sFlags[3]) != 0
            anchor_row = Int32(cutlass.select_(slow, 0, 8))
            if slow:  # the same for every thread of the CTA
                self._exact_diagonal(sQ0, sK0, sG, sDiag, tidx)
                cute.arch.barrier()  # q's rows are read: P2 writes k' over them

        # ---------------- P2 + P3, two rounds: score operands of two sub-chunks, then their scores ----------------
        if const_expr(self.given_t or self.scalar_gate):
            # P2's rows alone (no score operands), then v into k's tile; scalar_gate's scores first, on WGMMA from
            # the q / k tiles P1 left (P2 then writes k' over q)
            if const_expr(self.scalar_gate and not self.given_t):
                self._scalar_scores(mma_s, sQ, sK, sG, sA, sAqk, sBeta, scale, wg, tid)
                cute.arch.barrier()
            if const_expr(self.wy_in_recurrence):  # the factor rows alone: no k', no v
                if tidx < BT:
                    if tidx < valid:
                        self._store_factor_row(sRstd, mQg, tok0, hv, tidx, sG[0, tidx], sG[0, BT - 1])
            else:
                sB = cute.make_tensor(cute.recast_ptr(base, dtype=Float32), cute.make_layout(2 * 32 * DK))
                for rnd in cutlass.range_constexpr(2):
                    self._qg_kg_score_operands_vec(
                        sQ0, sK0, sG, sB, sBeta, mQg, mKg, mG, tok0, hv, valid, tidx, ((0, 1), (2, 3))[rnd], 8, sRstd
                    )  # fmt: skip
                cute.arch.barrier()
                self._load_v_after_scores(tma_v, tv, hv, sV, tok0, bar, tidx, warp_idx)
        else:
            self._scores(
                sQ0, sK0, sV, sG, base, sA, sAqk, sBeta, mQg, mKg, mG, tma_v, tv, bar, tok0, hv, valid, scale, tidx,
                warp_idx, anchor_row, sRstd,
            )  # fmt: skip
        cute.arch.barrier()
        if const_expr(self.any_gate):
            if slow:  # the exact diagonal blocks replace the products'
                self._exact_diagonal_scores(sAqk, sA, sDiag, sBeta, scale, tidx)
                cute.arch.barrier()
        if const_expr(not self.given_t):  # the scores' Aqk out, then the solve (P4, P5)
            self._store_aqk(sAqk, mAqk, tok0, hv, valid, tidx)
            self._solve(sA, base, tidx, warp_idx)

        if const_expr(self.wy_in_recurrence):
            # ---------------- P6 alone: bf16(T diag(beta)) to global memory ----------------
            self._store_t_beta(sA, sBeta, mAkk, tok0, hv, valid, tidx)
        else:
            # ---------------- P6: bf16(T) and v' = bf16(beta v) as WGMMA operands (k' is P2's) ----------------
            self._wy_operands(sT, sA, sV0, sBeta, mAkk, bar, tok0, hv, valid, tidx)

            # ---------------- P7: w = T k' (WG0), u = T v' (WG1) ----------------
            self._wy_products(mma_wu, sT, sKp, sV, sV0, tma_w, tw, tma_u, tu, mW, mU, tok0, hv, valid, wg, tid)

    @cute.jit
    def _load_chunk(
        self, tma_q, tq, tma_k, tk, tma_g, tg, mBeta, mAlog, mBias, sQ, sK, sGin, sBeta, base, bar, bar_g, h, hv,
        tok0, valid, tidx, tid, warp_idx,
    ):  # fmt: skip
        """P0: the mbarriers, the TMA loads of q, k and the raw gate (warp 0; with ``scalar_gate`` 64 threads copy
        the chunk's gates instead), act_b(beta) into shared memory; returns the gate activation's coefficient and
        this thread's channel bias."""
        BT = self.bt
        # raw g first, on its own barrier, so the gate cumsum starts before q and k have landed
        if tidx == 0:
            cute.arch.mbarrier_init(bar, 1)
            # scalar_gate: the 64 threads that store the chunk's gates arrive instead of a TMA
            cute.arch.mbarrier_init(bar_g, BT if self.scalar_gate else 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        if warp_idx == 0:
            if tidx == 0:
                if const_expr(not self.scalar_gate):
                    cute.arch.mbarrier_arrive_and_expect_tx(bar_g, self.gin_bytes)
                cute.arch.mbarrier_arrive_and_expect_tx(bar, 2 * self.x_bytes)
            if const_expr(not self.scalar_gate):
                self._load_tile(tma_g, tg, hv, sGin, tok0, bar_g)
            for atom, tsrc, head, sdst in ((tma_q, tq, h, sQ), (tma_k, tk, h, sK)):
                self._load_tile(atom, tsrc, head, sdst, tok0, bar)
        if tidx < BT:
            b = Float32(0.0)
            if tidx < valid:
                b = self._act_beta(mBeta[tok0 + tidx, hv].to(Float32))
            sBeta[tidx] = b
            if const_expr(self.scalar_gate):
                # the chunk's raw gates in the region's first 64 floats, where the TMA tile would go (0 past the
                # sequence end, whose g_cum P1 overwrites); P1 waits for all 64 on bar_g
                x = Float32(0.0)
                if tidx < valid:
                    x = tg[tok0 + tidx, hv].to(Float32)
                sGin_flat = cute.make_tensor(cute.recast_ptr(base, dtype=Float32), cute.make_layout(BT))
                sGin_flat[tidx] = x
                cute.arch.mbarrier_arrive(bar_g)
        coef = Float32(1.0)
        bias = Float32(0.0)
        if const_expr(self.gate != "none"):
            coef = cute.math.exp(mAlog[hv].to(Float32), fastmath=True)
            if const_expr(self.scalar_gate):
                bias = mBias[hv].to(Float32)
            else:
                bias = mBias[hv, tid].to(Float32)
        return coef, bias

    @cute.jit
    def _gate_cumsum_and_norms(
        self, sQ0, sGin0, sG, sG_ptr, base, bar, bar_g, coef, bias, lower_bound, valid, wg, tid, x_elems, sFlags,
        warp_idx, mRstd, tok0, h, head_first, sRstd=None,
    ):  # fmt: skip
        """P1: the gate activation and its chunk cumsum (warpgroup 0, a channel a thread, g_cum into shared
        memory), the q and k rows past the sequence end zeroed and the others L2-normalised (warpgroup 1, a row a
        thread; with a scalar gate both warpgroups, ``_row_norms_paired``; with ``write_rstd`` the first value head
        of the q / k head's group, ``head_first``, also stores the row's 1 / norm in ``mRstd``). With ``any_gate``
        warpgroup 0 also records per warp in ``sFlags`` whether a channel's g_cum in some sub-chunk lies more than
        ``_ANCHOR_SPAN`` (base 2) from the anchor row's, rows past the sequence end taken as the products read them
        (the last valid row's g_cum)."""
        BT, DK, dt = self.bt, self.dk, self.dtype
        if const_expr(self.scalar_gate):  # warp 0 scans the gates, then all 256 threads take the rows, two a row
            if wg == 0:
                self._scalar_gate_scan(sGin0, sG, base, bar_g, coef, bias, lower_bound, valid, tid)
            cute.arch.mbarrier_wait(bar, 0)
            self._row_norms_paired(sQ0, valid, wg * 128 + tid, x_elems, mRstd, tok0, h, head_first, sRstd)
        elif wg == 0:
            self._channel_gate_cumsum(sGin0, sG, sG_ptr, base, bar_g, coef, bias, lower_bound, valid, tid, sFlags,
                                      warp_idx)  # fmt: skip
            cute.arch.mbarrier_wait(bar, 0)  # q and k, read by everyone from P2 on
        else:
            cute.arch.mbarrier_wait(bar, 0)
            # nothing reads q or k before P2; thread tid owns row tid % 64 of q (tid < 64) or of k. Rows past the
            # sequence end (the next sequence's tokens, or TMA's zero fill) become zeros, so that P2 and P3 need
            # no row mask: their score operands there are 0 either way
            off = cute.assume(Int32(cutlass.select_(tid < BT, 0, x_elems)), divby=x_elems)
            sX0 = cute.make_tensor(sQ0.iterator + off, sQ0.layout)
            if tid % BT >= valid:
                zero = cute.make_rmem_tensor(8, dt)
                zero.fill(0.0)
                for c in cutlass.range_constexpr(DK // 8):
                    cute.autovec_copy(zero, vec_at(sX0, (8 * c, tid % BT)))
            else:
                if const_expr(self.l2norm_qk):
                    r = self._l2norm_rows(sX0, tid % BT)
                    if const_expr(self.write_rstd):
                        if head_first:
                            mRstd[tid // BT, tok0 + tid % BT, h] = r
                    if const_expr(self.row_factors):  # for P2's factor rows
                        sRstd[tid] = r

    @cute.jit
    def _channel_gate_cumsum(self, sGin0, sG, sG_ptr, base, bar_g, coef, bias, lower_bound, valid, tid, sFlags,
                             warp_idx):  # fmt: skip
        """P1's gate with one gate a channel: thread ``tid`` of warpgroup 0 activates and sums channel ``tid`` down
        the chunk into g_cum (and, with ``any_gate``, votes whether it strays from an anchor row)."""
        BT, DK = self.bt, self.dk
        # g_cum reaches global memory in P2, 8 channels per store, not from this dependent chain
        acc = Float32(0.0)
        cute.arch.mbarrier_wait(bar_g, 0)
        # blocks of 8 steps, the next block's raw gates loaded before this block's g_cum stores
        GB = 8
        # sG's swizzle moves channel tid of row t to tid ^ 8 (t % 8): the 8 column offsets are computed once
        # (the layout's own arithmetic cannot know tid < 128 and redid it for each of the 64 stores)
        sG_flat = cute.make_tensor(sG_ptr, cute.make_layout(BT * DK))
        cols = [Int32(tid) ^ Int32(8 * j) for j in range(GB)]
        nxt = [self._raw_gate(sGin0, base, tid, e) for e in range(GB)]
        far = Int32(0)  # any_gate: a sub-chunk's g_cum strays too far from its anchor row's
        hi, lo, mid, lastv = acc, acc, acc, acc
        for blk in cutlass.range_constexpr(BT // GB):
            cur = nxt
            if const_expr(blk + 1 < BT // GB):
                nxt = [self._raw_gate(sGin0, base, tid, GB * (blk + 1) + e) for e in range(GB)]
            for e in cutlass.range_constexpr(GB):
                t = GB * blk + e
                acc = acc + self._act(cur[e], coef, bias, lower_bound)
                gc = acc * RCP_LN2
                sG_flat[t * DK + cols[e]] = gc
                if const_expr(self.any_gate):
                    # the row's g_cum as the products read it: past the sequence end the last valid row's
                    # (overwritten below)
                    gv = Float32(cutlass.select_(t < valid, gc, lastv))
                    lastv = gv
                    if const_expr(t % 16 == 0):
                        hi, lo = gv, gv
                    else:
                        hi, lo = cute.arch.fmax(hi, gv), cute.arch.fmin(lo, gv)
                    if const_expr(t % 16 == 8):
                        mid = gv
                    if const_expr(t % 16 == 15):
                        span = cute.arch.fmax(hi - mid, mid - lo)
                        far = Int32(cutlass.select_(span > _ANCHOR_SPAN, 1, far))
        if const_expr(self.any_gate):
            anyfar = cute.arch.vote_any_sync(far != 0)
            if tid % 32 == 0:
                sFlags[warp_idx] = Int32(cutlass.select_(anyfar, 1, 0))
        # rows past the sequence end hold the last valid row's g_cum (so gc[63] is that row's, which kg uses),
        # overwriting whatever the raw gate there summed to
        # valid <= 0: a padding row of chunk indices built on the device (a no-op CTA that writes nothing)
        if (valid < BT) & (valid > 0):
            last = sG[tid, valid - 1]
            for t in cutlass.range(valid, BT, unroll=1):
                sG[tid, t] = last

    @cute.jit
    def _row_norms_paired(self, sQ0, valid, tidx, x_elems, mRstd, tok0, h, head_first, sRstd):
        """scalar_gate's P1 rows, where warpgroup 0 has no 64-step gate chain to walk: the 128 q / k rows over all
        256 threads, lanes 2 r and 2 r + 1 taking row r's two channel halves (one 128-byte swizzle row each) and
        meeting their sums of squares by a shuffle, half the per-thread chain of a row a thread. Rows past the
        sequence end become zeros, as ``_gate_cumsum_and_norms``'s."""
        BT, DK, dt, V8 = self.bt, self.dk, self.dtype, 8
        row = tidx // 2  # q's rows, then k's
        t = row % BT
        c0 = (tidx % 2) * (DK // 2)
        off = cute.assume(Int32(cutlass.select_(row < BT, 0, x_elems)), divby=x_elems)
        sX0 = cute.make_tensor(sQ0.iterator + off, sQ0.layout)
        units = DK // 2 // V8
        # the odd lane walks its units in another order (XOR 4): a quarter warp's 16-byte accesses (4 rows x 2
        # halves, the halves 8 KB apart under one swizzle key) then fall on 8 distinct units, all 32 banks
        flip = (tidx % 2) * 4
        cols = [c0 + V8 * (Int32(c) ^ flip) for c in range(units)]
        live = t < valid
        if const_expr(not self.l2norm_qk):
            if not live:
                zero = cute.make_rmem_tensor(V8, dt)
                zero.fill(0.0)
                for c in cutlass.range_constexpr(units):
                    cute.autovec_copy(zero, vec_at(sX0, (cols[c], t)))
        else:
            rx = []  # the half row stays in registers between the sum and the scaling
            for c in cutlass.range_constexpr(units):
                rx.append(cute.make_rmem_tensor(V8, dt))
                cute.autovec_copy(vec_at(sX0, (cols[c], t)), rx[c])
            ss = cute.make_rmem_tensor(V8, Float32)  # 8 partial sums: short dependent chains
            ss.fill(0.0)
            for c in cutlass.range_constexpr(units):
                xf = self._widen(rx[c])
                for e in cutlass.range_constexpr(V8):
                    ss[e] = ss[e] + xf[e] * xf[e]
            part = ((ss[0] + ss[1]) + (ss[2] + ss[3])) + ((ss[4] + ss[5]) + (ss[6] + ss[7]))
            # every lane shuffles (rows past the end too: the pair's lanes always share a row, so a row's branch
            # below is the pair's)
            tot = part + cute.arch.shuffle_sync_bfly(part, 1)
            r = Float32(1.0) / cute.math.sqrt(tot + L2NORM_EPS)  # FLA's 1 / sqrt(sum + eps), correctly rounded
            for c in cutlass.range_constexpr(units):
                xf = self._widen(rx[c])
                for e in cutlass.range_constexpr(V8):
                    # rows past the end: zeros, not x * 0 (the next sequence's tokens may hold anything)
                    rx[c][e] = Float32(cutlass.select_(live, xf[e] * r, Float32(0.0))).to(dt)
                cute.autovec_copy(rx[c], vec_at(sX0, (cols[c], t)))
            if live & (tidx % 2 == 0):
                if const_expr(self.write_rstd):
                    if head_first:
                        mRstd[row // BT, tok0 + t, h] = r
                if const_expr(self.row_factors):  # for P2's factor rows
                    sRstd[row] = r

    @cute.jit
    def _scalar_gate_scan(self, sGin0, sG, base, bar_g, coef, bias, lower_bound, valid, tid):
        """scalar_gate's P1 gate: one gate a row, so warp 0 activates the chunk's 64 gates (rows lane and lane + 32)
        and sums them by two 32-lane inclusive scans, the second offset by the first's total, into channel 0 of
        g_cum (the only channel P2 and the scores read with a scalar gate), where the per-channel kernel's 128
        threads each walk the 64-step chain. Rows past the sequence end hold the last valid row's g_cum, as the
        state/output kernel reads it."""
        if tid < 32:
            cute.arch.mbarrier_wait(bar_g, 0)
            sums = []
            for half in cutlass.range_constexpr(2):
                t = tid + 32 * half
                a = self._act(self._raw_gate(sGin0, base, 0, t), coef, bias, lower_bound)
                a = Float32(cutlass.select_(t < valid, a, Float32(0.0)))
                for d in cutlass.range_constexpr(5):
                    up = cute.arch.shuffle_sync_up(a, 1 << d)
                    a = Float32(cutlass.select_(tid >= (1 << d), a + up, a))
                sums.append(a)
            lo, hi = sums[0], sums[1] + cute.arch.shuffle_sync(sums[0], 31)
            # a scan's zeros regroup its additions, so the rows past the end take the last valid row's sum itself
            # (kg's and the state kernel's decay row then agree with g_cum's bit for bit)
            lastrow = cutlass.max(valid - 1, 0)
            last = cute.arch.shuffle_sync(Float32(cutlass.select_(lastrow < 32, lo, hi)), lastrow % 32)
            sG[0, tid] = Float32(cutlass.select_(tid < valid, lo, last)) * RCP_LN2
            sG[0, tid + 32] = Float32(cutlass.select_(tid + 32 < valid, hi, last)) * RCP_LN2

    @cute.jit
    def _store_aqk(self, sAqk, mAqk, tok0, hv, valid, tidx):
        """The scores' Aqk rows staged in shared memory to global memory, 16 bytes a store (valid rows only)."""
        dt = self.dtype
        for t, s0 in self._row_units(tidx):
            if t < valid:
                ra = cute.make_rmem_tensor(8, dt)
                cute.autovec_copy(vec_at(sAqk, (t, s0)), ra)
                dst = cute.make_tensor(mAqk[tok0 + t, hv, None].iterator + s0, cute.make_layout(8))
                cute.autovec_copy(ra, dst)

    @cute.jit
    def _solve(self, sA, base, tidx, warp_idx):
        """P4 and P5: T = (I + Akk)^-1 in place, the diagonal blocks by forward substitution, then the
        off-diagonal ones on tf32 mma.sync."""
        # ---------------- P4: inverses of the diagonal blocks, in place ----------------
        # (the blocks above the diagonal are already the zeros T has there)
        # one block per warp (lanes 0-15), so a warp's broadcast reads stay in one block: rows 16 apart are
        # 16 * 68 floats apart, the same banks
        col = tidx % 32
        o = 16 * (tidx // 32)
        inverts = (tidx < 4 * 32) & (col < 16)
        rX = cute.make_rmem_tensor(16, Float32)
        if inverts:
            self._diag_inverse_column(sA, o, col, rX)
        # the blocks are read before they are rewritten. A CTA-wide barrier, not a named one of the four warps
        # that invert: after a named barrier that part of the CTA joins, compute-sanitizer's racecheck paired the
        # later phases' barrier-0 instances wrongly between the two halves of the CTA and reported their (ordered)
        # accesses as races; the other four warps only wait here instead of at the next barrier
        cute.arch.barrier()
        if inverts:
            for r in cutlass.range_constexpr(16):
                sA[o + r, o + col] = rX[r]
        cute.arch.barrier()

        # ---------------- P5: off-diagonal blocks of T on tf32 mma.sync ----------------
        self._inverse_blocks_mma(sA, base, warp_idx, tidx % 32)

    @cute.jit
    def _wy_operands(self, sT, sA, sV0, sBeta, mAkk, bar, tok0, hv, valid, tidx):
        """P6: bf16(T) (rounded from the solve, or with ``given_t`` the stored rows) into the WGMMA A tile, with
        ``write_akk`` to global memory too; v' = bf16(beta v) in v's tile once v has landed."""
        dt = self.dtype
        sT0 = sT[None, None, 0]
        # 8 columns of a row per item: two 16-byte reads, one 16-byte store into the swizzled T tile
        for t, s0 in self._row_units(tidx):
            rt = cute.make_rmem_tensor(8, dt)
            if const_expr(self.given_t):
                # the stored T's rows; zeros past the sequence end (those rows of w and u are never stored)
                rt.fill(0.0)
                if t < valid:
                    cute.autovec_copy(cute.make_tensor(mAkk[tok0 + t, hv, None].iterator + s0, cute.make_layout(8)), rt)
            else:
                for h4 in cutlass.range_constexpr(2):
                    ra = self._a_row4(sA, t, s0 + 4 * h4)
                    for e in cutlass.range_constexpr(4):
                        rt[4 * h4 + e] = ra[e].to(dt)
            cute.autovec_copy(rt, vec_at(sT0, (t, s0)))
            if const_expr(self.write_akk):
                if t < valid:
                    cute.autovec_copy(rt, cute.make_tensor(mAkk[tok0 + t, hv, None].iterator + s0, cute.make_layout(8)))
        cute.arch.mbarrier_wait(bar, 1)
        self._scale_rows_vec(sV0, sBeta, tidx)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier()

    @cute.jit
    def _wy_products(self, mma_wu, sT, sKp, sV, sV0, tma_w, tw, tma_u, tu, mW, mU, tok0, hv, valid, wg, tid):
        """P7: w = T k' (warpgroup 0) and u = T v' (warpgroup 1) on SS WGMMA, out through their own B tiles."""
        BT, DK = self.bt, self.dk
        thr_wu = mma_wu.get_slice(tid)
        wg_wu = mma_wu.get_slice(0)
        tTr = wg_wu.make_fragment_A(wg_wu.partition_A(sT))
        tKr = wg_wu.make_fragment_B(wg_wu.partition_B(sKp))
        tVr = wg_wu.make_fragment_B(wg_wu.partition_B(sV))
        accW = cute.make_rmem_tensor(wg_wu.partition_shape_C((BT, DK)), Float32)
        tWc = thr_wu.partition_C(cute.make_identity_tensor((BT, DK)))
        for which in cutlass.range_constexpr(2):
            if wg == which:
                tBx = tKr if which == 0 else tVr
                mOut = mW if which == 0 else mU
                warpgroup.fence()
                gemm_k_blocks(mma_wu, accW, tTr, tBx, False, 0, 0)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                # a warp's wait covers its own share of the product; the B tile is rewritten below, so every warp
                # of the warpgroup must be done reading it
                cute.arch.barrier(barrier_id=Barrier.WARPGROUP0 + which, number_of_threads=128)
                # through this warpgroup's own B tile (sKp / sV, no longer read by anyone)
                if valid == BT:
                    self._store_wu_tma(
                        mma_wu, accW, sKp if which == 0 else sV, tma_w if which == 0 else tma_u,
                        tw if which == 0 else tu, hv, tok0, tid, which,
                    )  # fmt: skip
                else:
                    sOut = sKp[None, None, 0] if which == 0 else sV0
                    self._store_wu_rows(accW, tWc, sOut, mOut, tok0, hv, valid, tid, which)

    @cute.jit
    def _store_wu_rows(self, accW, tWc, sOut, mOut, tok0, hv, valid, tid, which):
        """w or u of a chunk to global memory: scalar shared stores into ``sOut`` (feature, token), a warpgroup
        barrier, then 16-byte rows (row-predicated, so a partial chunk writes its valid rows only)."""
        for e in cutlass.range_constexpr(cute.size(accW)):
            sOut[tWc[e][1], tWc[e][0]] = accW[e].to(self.dtype)
        cute.arch.barrier(barrier_id=Barrier.WARPGROUP0 + which, number_of_threads=128)
        self._store_rows_vec(sOut, mOut, tok0, hv, valid, tid)

    @cute.jit
    def _store_wu_tma(self, mma_wu, accW, sOut, tma_out, t_out, hv, tok0, tid, which):
        """w or u of a full chunk: bf16 accumulator -> ``sOut`` by stmatrix (8 consecutive features of a token
        row are one 16-byte unit of the swizzled (feature, token) tile), then one TMA store of the tile, issued
        by the warpgroup's first thread, which also waits for its read of shared memory before the CTA exits."""
        dt = self.dtype
        st = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), dt), mma_wu
        )
        thr_st = st.get_slice(tid)
        # the tile indexed (token, feature) like the accumulator
        sMN = cute.make_tensor(sOut.iterator, cute.select(sOut.layout, mode=[1, 0, 2]))
        r16 = cute.make_rmem_tensor(accW.layout, dt)
        r16.store(accW.load().to(dt))
        cute.copy(st, thr_st.retile(r16), thr_st.partition_D(sMN)[None, None, None, 0])
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=Barrier.WARPGROUP0 + which, number_of_threads=128)
        if tid == 0:
            gdst = cute.local_tile(
                cute.domain_offset((0, tok0), t_out[None, None, hv]), (self.dk, self.bt), (0, None)
            )
            ts, tgm = cpasync.tma_partition(
                tma_out, 0, cute.make_layout(1), cute.group_modes(sOut, 0, 2), cute.group_modes(gdst, 0, 2)
            )
            cute.copy(tma_out, ts[None, 0], tgm[None, 0])
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    # ---- P5 on tf32 mma.sync: 16x16 blocks, m16n8k8 atoms. A warp's k slots c and c + 4 (lane (g, c)) hold
    # physical k = 2 c and 2 c + 1 of each 8-wide k-step, for A and B alike (the contraction order is free): then an
    # accumulator (lane (g, c) holds columns 2 c, 2 c + 1) is already the A fragment of the next product, and the A
    # rows from shared memory are 8-byte reads.

    @cute.jit
    def _frag_a_smem(self, tiled, sX, r0, k0, lane):
        """A fragment (rows r0..r0+15, k-step k0..k0+7) from an fp32 (row, col) tensor, tf32-rounded."""
        g, c2 = lane // 4, (lane % 4) * 2
        fa = cute.make_rmem_tensor(tiled.partition_shape_A((16, 8)), TFloat32)
        for h in cutlass.range_constexpr(2):
            two = cute.make_rmem_tensor(2, Float32)
            cute.autovec_copy(vec_at(sX, (r0 + g + 8 * h, k0 + c2), 2, 2), two)
            fa[h] = round_tf32(two[0]).to(TFloat32)
            fa[2 + h] = round_tf32(two[1]).to(TFloat32)
        return fa

    @cute.jit
    def _mma_block(self, tiled, acc, frags_a, sB, r0, c0, lane):
        """acc (16x16) += A . B[r0 .. r0+15, c0 .. c0+15] for the two k-step A fragments ``frags_a``, B fp32 in
        shared memory (tf32-rounded as read)."""
        g, c2 = lane // 4, (lane % 4) * 2
        for ks in cutlass.range_constexpr(2):
            fb = cute.make_rmem_tensor(tiled.partition_shape_B((16, 8)), TFloat32)
            for nt in cutlass.range_constexpr(2):
                for v in cutlass.range_constexpr(2):
                    fb[2 * nt + v] = round_tf32(sB[r0 + 8 * ks + c2 + v, c0 + 8 * nt + g]).to(TFloat32)
            cute.gemm(tiled, acc, frags_a[ks], fb, acc)

    @cute.jit
    def _store_block(self, sX, r0, c0, acc, lane):
        """A 16x16 accumulator to sX[r0.., c0..] (fp32, two 8-byte stores per n-tile)."""
        g, c2 = lane // 4, (lane % 4) * 2
        for nt in cutlass.range_constexpr(2):
            for h in cutlass.range_constexpr(2):
                two = cute.make_rmem_tensor(2, Float32)
                two[0] = acc[2 * h + 4 * nt]
                two[1] = acc[2 * h + 1 + 4 * nt]
                cute.autovec_copy(two, vec_at(sX, (r0 + g + 8 * h, c0 + 8 * nt + c2), 2, 2))

    @cute.jit
    def _da_at(self, tiled, fd, sA, r0, c0, lane):
        """D A as a 16x16 accumulator: D's A fragments ``fd``, A the Akk block at (r0, c0), still in sA."""
        x = cute.make_rmem_tensor(tiled.partition_shape_C((16, 16)), Float32)
        x.fill(0.0)
        self._mma_block(tiled, x, fd, sA, r0, c0, lane)
        return x

    @cute.jit
    def _d_frags_at(self, tiled, sA, r0, lane):
        """The two k-step A fragments of the diagonal block of T at (r0, r0)."""
        return [self._frag_a_smem(tiled, sA, r0, r0 + 8 * ks, lane) for ks in range(2)]

    @cute.jit
    def _neg_a(self, tiled, x):
        """N = -x as the two k-step A fragments of the next product (x: a 16x16 accumulator such as D_i A_ij),
        tf32-rounded: slots (g, c), (g + 8, c), (g, c + 4), (g + 8, c + 4) are x's (g, 2c), (g + 8, 2c), (g, 2c + 1),
        (g + 8, 2c + 1)."""
        frags = []
        for ks in cutlass.range_constexpr(2):
            fa = cute.make_rmem_tensor(tiled.partition_shape_A((16, 8)), TFloat32)
            for slot, v in ((0, 0), (1, 2), (2, 1), (3, 3)):
                fa[slot] = round_tf32(-x[v + 4 * ks]).to(TFloat32)
            frags.append(fa)
        return frags

    @staticmethod
    @cute.jit
    def _copy_acc(dst, src):
        for e in cutlass.range_constexpr(cute.size(dst)):
            dst[e] = src[e]

    @cute.jit
    def _inverse_blocks_mma(self, sA, region, warp_idx, lane):
        """The six off-diagonal blocks of T = (I + Akk)^-1 in place in sA, given its diagonal blocks D_i (P4):
        with N_ij = -D_i A_ij, T_ij = sum_{m = j..i-1} N_im T_mj (T_mm = D_m), one warp per block:

        ====  ===================================  =======================  =====================
        warp  before barrier 1                      before barrier 2         before barrier 3
        ====  ===================================  =======================  =====================
        0     T10 = N10 D0, stored                  .                        .
        1     T21 = N21 D1, to scratch              T21 stored               .
        2     T32 = N32 D2                          T32 stored               .
        3     N20 D0 (N21 kept)                     + N21 T10, T20 stored    .
        4     N31 D1 (N32 kept)                     + N32 T21, T31 stored    .
        5     N30 D0 (N31, N32 kept)                + N31 T10                + N32 T20, T30 stored
        ====  ===================================  =======================  =====================

        Each block of A is read in the first step only and overwritten only after barrier 1, except A10 (read by
        warp 0 alone), so the blocks are computed in place. FLA computes the same blocks with tf32 dots
        (``solve_tril``'s precision); the products of one block are summed in fp32 in the accumulator."""
        tiled = cute.make_tiled_mma(warp.MmaTF32Op((16, 8, 8)))
        sS = cute.make_tensor(
            cute.recast_ptr(region + self.off_y, dtype=Float32), cute.make_layout((16, 16), stride=(20, 1))
        )  # T21 for warp 4 (rows 20 floats apart: the B reads are free of bank conflicts)
        shape_c = tiled.partition_shape_C((16, 16))
        acc = cute.make_rmem_tensor(shape_c, Float32)  # the warp's block of T
        acc.fill(0.0)
        # N blocks kept across the barriers as accumulators (8 registers each, shared by the warps' roles)
        keep1 = cute.make_rmem_tensor(shape_c, Float32)
        keep2 = cute.make_rmem_tensor(shape_c, Float32)
        keep1.fill(0.0)
        keep2.fill(0.0)

        # warps 0-2: T_{j+1, j} = N_{j+1, j} D_j
        if warp_idx < 3:
            j = warp_idx
            fd = self._d_frags_at(tiled, sA, 16 * (j + 1), lane)
            self._mma_block(tiled, acc, self._neg_a(tiled, self._da_at(tiled, fd, sA, 16 * (j + 1), 16 * j, lane)),
                            sA, 16 * j, 16 * j, lane)  # fmt: skip
            if warp_idx == 0:
                cute.arch.sync_warp()  # A10 (read by this warp alone) is overwritten in place
                self._store_block(sA, 16, 0, acc, lane)
            if warp_idx == 1:
                self._store_block(sS, 0, 0, acc, lane)
        elif warp_idx == 3:
            fd = self._d_frags_at(tiled, sA, 32, lane)
            self._copy_acc(keep1, self._da_at(tiled, fd, sA, 32, 16, lane))  # D2 A21
            self._mma_block(tiled, acc, self._neg_a(tiled, self._da_at(tiled, fd, sA, 32, 0, lane)), sA, 0, 0, lane)
        elif warp_idx == 4:
            fd = self._d_frags_at(tiled, sA, 48, lane)
            self._copy_acc(keep1, self._da_at(tiled, fd, sA, 48, 32, lane))  # D3 A32
            self._mma_block(tiled, acc, self._neg_a(tiled, self._da_at(tiled, fd, sA, 48, 16, lane)), sA, 16, 16, lane)
        elif warp_idx == 5:
            fd = self._d_frags_at(tiled, sA, 48, lane)
            self._copy_acc(keep1, self._da_at(tiled, fd, sA, 48, 16, lane))  # D3 A31
            self._copy_acc(keep2, self._da_at(tiled, fd, sA, 48, 32, lane))  # D3 A32
            self._mma_block(tiled, acc, self._neg_a(tiled, self._da_at(tiled, fd, sA, 48, 0, lane)), sA, 0, 0, lane)
        cute.arch.barrier()
        if warp_idx == 1:
            self._store_block(sA, 32, 16, acc, lane)
        elif warp_idx == 2:
            self._store_block(sA, 48, 32, acc, lane)
        elif warp_idx == 3:
            self._mma_block(tiled, acc, self._neg_a(tiled, keep1), sA, 16, 0, lane)  # + N21 T10
            self._store_block(sA, 32, 0, acc, lane)
        elif warp_idx == 4:
            self._mma_block(tiled, acc, self._neg_a(tiled, keep1), sS, 0, 0, lane)  # + N32 T21
            self._store_block(sA, 48, 16, acc, lane)
        elif warp_idx == 5:
            self._mma_block(tiled, acc, self._neg_a(tiled, keep1), sA, 16, 0, lane)  # + N31 T10
        cute.arch.barrier()
        if warp_idx == 5:
            self._mma_block(tiled, acc, self._neg_a(tiled, keep2), sA, 32, 0, lane)  # + N32 T20
            self._store_block(sA, 48, 0, acc, lane)
        cute.arch.barrier()

    @cute.jit
    def _diag_inverse_column(self, sA, o, col, rX):
        """Column ``col`` of the inverse of the unit lower-triangular 16x16 block at (o, o) of I + Akk, by forward
        substitution into ``rX`` (reads the block's strict lower part)."""
        for r in cutlass.range_constexpr(16):
            y = Float32(cutlass.select_(col == r, Float32(1.0), Float32(0.0)))
            for m in cutlass.range_constexpr(r):
                y = y - sA[o + r, o + m] * rX[m]
            rX[r] = y

    @cute.jit
    def _a_row4(self, sA, t, s0):
        """sA[t, s0 .. s0 + 3] in registers (one 16-byte read: rows of 68 floats, s0 a multiple of 4)."""
        ra = cute.make_rmem_tensor(4, Float32)
        cute.autovec_copy(vec_at(sA, (t, s0), 4, 4), ra)
        return ra

    @cute.jit
    def _load_v_after_scores(self, tma_v, tv, hv, sV, tok0, bar, tidx, warp_idx):
        """k is read (after P3): v's tile goes into k's, landing while the P3 epilogue and the inverse run (phase
        1 of the barrier)."""
        if warp_idx == 0:
            if tidx == 0:
                cute.arch.fence_view_async_shared()
                cute.arch.mbarrier_arrive_and_expect_tx(bar, self.x_bytes)
            self._load_tile(tma_v, tv, hv, sV, tok0, bar)

    @cute.jit
    def _scalar_scores(self, mma_s, sQ, sK, sG, sA, sAqk, sBeta, scale, wg, tid):
        """scalar_gate's P3, before P2: warpgroup 0 makes ``q k^T``, warpgroup 1 ``k k^T`` (SS WGMMA 64 x 64 x 128,
        the bf16 / fp16 products exact, fp32 sums, as the tf32 ``mma.sync`` path's), and each score is multiplied
        by ``exp2(gc_t - gc_s)`` (at most 1 where kept) into Aqk (staged, scaled, zero for s > t) or Akk (times
        beta_t, zero for s >= t). Every (t, s) is written, so no block needs zeroing apart."""
        BT = self.bt
        # (token, feature) views of the (feature, token) tiles: WG w's A operand is tile w (q, then k, x_elems on)
        sQt, sKt = token_major(sQ), token_major(sK)
        wg_s = mma_s.get_slice(0)
        tAq = wg_s.make_fragment_A(wg_s.partition_A(sQt))
        tAk = wg_s.make_fragment_A(wg_s.partition_A(sKt))
        tBk = wg_s.make_fragment_B(wg_s.partition_B(sKt))
        acc = cute.make_rmem_tensor(wg_s.partition_shape_C((BT, BT)), Float32)
        tSc = mma_s.get_slice(tid).partition_C(cute.make_identity_tensor((BT, BT)))
        for which in cutlass.range_constexpr(2):
            if wg == which:
                tA = tAq if which == 0 else tAk
                warpgroup.fence()
                gemm_k_blocks(mma_s, acc, tA, tBk, False, 0, 0)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                # every value before any store: ptxas cannot tell the Akk stores from beta's row and would reload it
                for e in cutlass.range_constexpr(cute.size(acc)):
                    t, s_ = tSc[e]
                    # one g_cum a row (channel 0); the masked entries' factors are unused
                    d = sG[0, t] - sG[0, s_]
                    x = acc[e] * cute.math.exp2(cute.arch.fmin(d, _ANCHOR_CLAMP), fastmath=True)
                    if const_expr(which == 0):
                        acc[e] = Float32(cutlass.select_(s_ <= t, x * scale, Float32(0.0)))
                    else:
                        acc[e] = Float32(cutlass.select_(s_ < t, x * sBeta[t], Float32(0.0)))
                for e in cutlass.range_constexpr(cute.size(acc)):
                    t, s_ = tSc[e]
                    if const_expr(which == 0):
                        sAqk[t, s_] = acc[e].to(self.dtype)
                    else:
                        sA[t, s_] = acc[e]

    @cute.jit
    def _scores(
        self, sQ0, sK0, sV, sG, region, sA, sAqk, sBeta, mQg, mKg, mG, tma_v, tv, bar, tok0, hv, valid, scale,
        tidx, warp_idx, anchor_row=8, sRstd=None,
    ):  # fmt: skip
        """P2 + P3: per round, P2 builds the fp32 B operands of two anchors, then one warp per (key block kb <=
        anchor) pair multiplies it on tf32 mma.sync; after both rounds v's load is issued, the accumulators become
        Aqk (staged bf16) and Akk rows, and warps 5-7 write the blocks above the diagonal as zeros.

        Rounds take anchors (0, 1), then (2, 3): 3, then 7 (key block, anchor) pairs on warps 0-2, then 0-6.
        Warp w runs on SM sub-partition w % 4, where a pair's operand build is issue- and MUFU-bound, so a round
        lasts about as long as its busiest sub-partition's pairs: 1 + 2 here, 2 + 2 with rounds (0, 3), (1, 2) of
        5 pairs each (warps 0 and 4 on one sub-partition). Measured: -1.6% of the kernel (H200, B2-T16384).
        Key blocks wholly past the sequence end are not multiplied (their zero accumulators are still written)."""
        dt = self.dtype
        lane = tidx % 32
        sB = cute.make_tensor(cute.recast_ptr(region, dtype=Float32), cute.make_layout(2 * 32 * self.dk))
        tiled_tf = cute.make_tiled_mma(warp.MmaTF32Op((16, 8, 8)))
        rounds = ((0, 1), (2, 3))
        blocks = []  # per round: this warp's accumulator, key block and anchor
        for rnd in cutlass.range_constexpr(2):
            a0, a1 = rounds[rnd]
            self._qg_kg_score_operands_vec(
                sQ0, sK0, sG, sB, sBeta, mQg, mKg, mG, tok0, hv, valid, tidx, rounds[rnd], anchor_row, sRstd
            )  # fmt: skip
            cute.arch.barrier()
            acc = cute.make_rmem_tensor(tiled_tf.partition_shape_C((16, 32)), Float32)
            acc.fill(0.0)
            kb, anc, slot = _block_of(warp_idx, a0, a1)
            if (warp_idx < a0 + a1 + 2) & (16 * kb < valid):
                self._score_block(tiled_tf, acc, sK0, sG, sB, kb, anc, slot, lane, anchor_row)
            blocks.append((acc, kb, anc))
            cute.arch.barrier()  # every score product has read sB: the next round rewrites it, then it is scratch
        self._load_v_after_scores(tma_v, tv, hv, sV, tok0, bar, tidx, warp_idx)

        # accumulator (v, nt) of lane (g, c): key row s = 16 kb + row(g) (+ 8 for v >= 2), B row n = 8 nt + 2 c
        # (+ 1 for odd v): query row 16 anc + n of Aqk (n < 16) or key row 16 anc + n - 16 of Akk
        g_ = lane // 4
        c = lane % 4
        for rnd in cutlass.range_constexpr(2):
            a0, a1 = rounds[rnd]
            if warp_idx < a0 + a1 + 2:
                acc, kb, anc = blocks[rnd]
                for nt in cutlass.range_constexpr(4):
                    for v in cutlass.range_constexpr(4):
                        s = 16 * kb + _tf32_row(g_) + 8 * (v // 2)
                        t = 16 * anc + (8 * nt + 2 * c + v % 2) % 16
                        x = acc[v + 4 * nt]
                        if const_expr(nt < 2):  # Aqk, staged; stored as 16-byte rows by the caller
                            sAqk[t, s] = Float32(cutlass.select_(s <= t, x * scale, Float32(0.0))).to(dt)
                        else:  # Akk: every (t, s) is written, zero for s >= t
                            sA[t, s] = Float32(cutlass.select_(s < t, x * sBeta[t], Float32(0.0)))
        if warp_idx >= 5:
            # the six blocks above the diagonal, (anchor a, key block kb > a): one column of one block per thread
            j = tidx - 5 * 32
            b = j // 16
            past3 = Int32(cutlass.select_(b >= 3, 1, 0))
            past5 = Int32(cutlass.select_(b >= 5, 1, 0))
            a = past3 + past5
            kb = b + 1 - 2 * past3 - past5
            s = 16 * kb + j % 16
            for r in cutlass.range_constexpr(16):
                sAqk[16 * a + r, s] = Float32(0.0).to(dt)
                sA[16 * a + r, s] = Float32(0.0)

    @cute.jit
    def _diag_pair(self, item):
        """(row t, key row s) in the chunk of pair ``item`` of the diagonal 16 x 16 blocks: block item // 136, in it
        the pairs s <= t in row order (item 136 a + t' (t' + 1) / 2 + s')."""
        a = item // 136
        r = item - 136 * a
        tl = ((cute.math.sqrt(Float32(8 * r + 1)) - 1.0) * 0.5).to(Int32)  # exact: 8 r + 1 < 2^24
        return 16 * a + tl, 16 * a + r - (tl * (tl + 1)) // 2

    @cute.jit
    def _exact_diagonal(self, sQ0, sK0, sG, sDiag, tidx):
        """any_gate's exact path, between P1 and P2 (q still in its tile): the diagonal blocks' scores element by
        element, ``sum_c x_tc k_sc exp2(gc_tc - gc_sc)`` for x = q (Aqk's) and x = k (Akk's), s <= t, unscaled into
        ``sDiag``; every factor is at most 1 for gates <= 0, so nothing overflows or is clamped. A thread a pair,
        8 channels an access."""
        dt = self.dtype
        # a loop, not unrolled: the exact path is the rare one, its code need not triple
        for m in cutlass.range((DIAG_PAIRS + self.num_threads - 1) // self.num_threads, unroll=1):
            item = tidx + m * self.num_threads
            if item < DIAG_PAIRS:
                t, s = self._diag_pair(item)
                aq = cute.make_rmem_tensor(8, Float32)  # 8 partial sums each: short dependent chains
                ak = cute.make_rmem_tensor(8, Float32)
                aq.fill(0.0)
                ak.fill(0.0)
                for c in cutlass.range_constexpr(self.dk // 8):
                    rows = []
                    for src, row in ((sQ0, t), (sK0, t), (sK0, s)):
                        rx = cute.make_rmem_tensor(8, dt)
                        cute.autovec_copy(vec_at(src, (8 * c, row)), rx)
                        rows.append(self._widen(rx))
                    rgt = cute.make_rmem_tensor(8, Float32)
                    rgs = cute.make_rmem_tensor(8, Float32)
                    cute.autovec_copy(vec_at(sG, (8 * c, t), 4), rgt)
                    cute.autovec_copy(vec_at(sG, (8 * c, s), 4), rgs)
                    qt, kt, ks = rows
                    for e in cutlass.range_constexpr(8):
                        kse = ks[e] * cute.math.exp2(rgt[e] - rgs[e], fastmath=True)
                        aq[e] = aq[e] + qt[e] * kse
                        ak[e] = ak[e] + kt[e] * kse
                sDiag[2 * item] = ((aq[0] + aq[1]) + (aq[2] + aq[3])) + ((aq[4] + aq[5]) + (aq[6] + aq[7]))
                sDiag[2 * item + 1] = ((ak[0] + ak[1]) + (ak[2] + ak[3])) + ((ak[4] + ak[5]) + (ak[6] + ak[7]))

    @cute.jit
    def _exact_diagonal_scores(self, sAqk, sA, sDiag, sBeta, scale, tidx):
        """any_gate's exact path, after the P3 epilogue: the diagonal blocks' Aqk (staged) and Akk entries from
        ``_exact_diagonal``'s sums, over what the products left there (the epilogue's masks: Aqk for s <= t, Akk for
        s < t, its zero diagonal kept)."""
        for m in cutlass.range_constexpr((DIAG_PAIRS + self.num_threads - 1) // self.num_threads):
            item = tidx + m * self.num_threads
            if item < DIAG_PAIRS:
                t, s = self._diag_pair(item)
                sAqk[t, s] = (sDiag[2 * item] * scale).to(self.dtype)
                if s < t:
                    sA[t, s] = sDiag[2 * item + 1] * sBeta[t]

    @cute.jit
    def _b_unit(self, sB, slot, n, u, u8):
        """16-byte unit u (k = 4 u .. 4 u + 3) of row n (16 q rows, then 16 k rows) of B slot ``slot`` in the
        tf32 score operands: fp32 rows of K floats. The unit index is XOR 4 on odd rows, so that a quarter warp's
        two rows (mma.sync B fragments: rows g, g + 1 at the same k) fall on disjoint banks, and XOR 1 where unit
        bit 3 (``u8``, given by the caller, who knows it without arithmetic) is set, so that P2's quarter warp
        storing units 2 i + h (i < 8) covers all 32 banks without reordering its data."""
        off = (slot * 32 + n) * self.dk + ((u ^ ((n % 2) * 4) ^ u8) * 4)
        return cute.make_tensor(sB.iterator + cute.assume(off, divby=4), cute.make_layout(4))

    @cute.jit
    def _score_block(self, tiled_tf, acc, sK0, sG, sB, kb, anc, slot, lane, anchor_row=8):
        """One warp's block of the scores on tf32 mma.sync: key rows 16 kb..16 kb + 15 against the 32 B rows of
        sub-chunk ``anc`` (in B slot ``slot``): ``acc[s, n] = sum_k A[s, k] B[n, k]``, A = k_s exp2(gc_p - gc_s)
        with p = 16 anc + anchor_row (0 past the sequence end), both tf32-rounded.

        The contraction order is free, so lane (g, c) takes k = 16 m + 4 c .. + 3 for k-steps 2 m and 2 m + 1:
        16-byte g_cum and B reads, 8-byte k reads. Rows are free as well: fragment row g is key row ``_tf32_row``
        (g), which puts a quarter warp's two rows two apart, on disjoint banks of the swizzled k and g_cum tiles.
        """
        g_ = lane // 4
        c4 = cute.assume((lane % 4) * 4, divby=4)
        rows = (16 * kb + _tf32_row(g_), 16 * kb + _tf32_row(g_) + 8)
        fa = cute.make_rmem_tensor(tiled_tf.partition_shape_A((16, 8)), TFloat32)
        fb = cute.make_rmem_tensor(tiled_tf.partition_shape_B((32, 8)), TFloat32)
        for m in cutlass.range_constexpr(self.dk // 16):
            kk = 16 * m + c4
            x = cute.make_rmem_tensor(8, Float32)  # (row i, k 4 m + e) at 4 i + e
            rga = cute.make_rmem_tensor(4, Float32)
            cute.autovec_copy(vec_at(sG, (kk, 16 * anc + anchor_row), 4, 4), rga)
            for i in cutlass.range_constexpr(2):
                s = rows[i]
                rk = cute.make_rmem_tensor(4, self.dtype)
                rgs = cute.make_rmem_tensor(4, Float32)
                cute.autovec_copy(vec_at(sK0, (kk, s), 4, 4), rk)
                cute.autovec_copy(vec_at(sG, (kk, s), 4, 4), rgs)
                kf = self._widen(rk)
                for e in cutlass.range_constexpr(4):
                    f = cute.math.exp2(cute.arch.fmin(rga[e] - rgs[e], _ANCHOR_CLAMP), fastmath=True)
                    x[4 * i + e] = round_tf32(kf[e] * f)  # k = 0 past the sequence end (P1)
            rb = []  # n-tile nt's 4 k values
            for nt in cutlass.range_constexpr(4):
                rb.append(cute.make_rmem_tensor(4, Float32))
                cute.autovec_copy(self._b_unit(sB, slot, 8 * nt + g_, 4 * m + lane % 4, (m >> 1) & 1), rb[nt])
            for step in cutlass.range_constexpr(2):
                # A values (g, c), (g + 8, c), (g, c + 4), (g + 8, c + 4); B values (k c, n g), (k c + 4, n g)
                for v in cutlass.range_constexpr(4):
                    fa[v] = x[4 * (v % 2) + 2 * step + v // 2].to(TFloat32)
                for nt in cutlass.range_constexpr(4):
                    for v in cutlass.range_constexpr(2):
                        fb[2 * nt + v] = rb[nt][2 * step + v].to(TFloat32)
                cute.gemm(tiled_tf, acc, fa, fb, acc)

    @cute.jit
    def _load_tile(self, atom, tsrc, head, sdst, tok0, bar):
        """TMA of the (DK, BT) tile of ``head`` starting at token tok0 into ``sdst``, completing on ``bar``."""
        gsrc = cute.local_tile(cute.domain_offset((0, tok0), tsrc[None, None, head]), (self.dk, self.bt), (0, None))
        ts, tgm = cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(sdst, 0, 2), cute.group_modes(gsrc, 0, 2)
        )
        cute.copy(atom, tgm[None, 0], ts[None, 0], tma_bar_ptr=bar)

def _block_of(warp_idx, a0: int, a1: int):
    """(key block kb, anchor, B slot) of warp ``warp_idx`` in a P3 round with anchors (a0, a1): warps 0..a0 take
    anchor a0's key blocks, the next a1 + 1 warps anchor a1's."""
    first = warp_idx <= a0
    kb = Int32(cutlass.select_(first, warp_idx, warp_idx - a0 - 1))
    return kb, Int32(cutlass.select_(first, a0, a1)), Int32(cutlass.select_(first, 0, 1))


def _tf32_row(g):
    """Key row (within a 16-row block) of mma.sync fragment row g < 8: 0, 2, 4, 6, 1, 3, 5, 7 (see
    ``_score_block``); fragment row g + 8 is that row + 8."""
    return (g % 4) * 2 + g // 4


def _compile(dtype, g_dtype, beta_dtype, gate, varlen, arch=(9, 0), extra_options="", **options):
    """Trace and compile one variant against fake tensors (no GPU needed). Returns the TVM-FFI callable.
    ``options``: the keyword options of ``ChunkKDAIntraFwdSm90`` (l2norm_qk, beta_act, ...)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    DK, BT = 128, 64
    dtype, g_dtype, beta_dtype = dsl_type(dtype), dsl_type(g_dtype), dsl_type(beta_dtype)
    kernel = ChunkKDAIntraFwdSm90(
        dtype=dtype, g_dtype=g_dtype, beta_dtype=beta_dtype, gate=gate, varlen=varlen, **options
    )
    tt, h, hv = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()

    def tok(dt, heads, d):
        return make_fake_tensor(dt, (tt, heads, d), (cute.sym_int64(divisibility=d), d, 1), assumed_align=16)

    def per_head(dt):  # (T, HV): beta, and Gated DeltaNet's gate
        return make_fake_tensor(dt, (tt, hv), (cute.sym_int64(), 1), assumed_align=dt.width // 8)

    args = (
        tok(dtype, h, DK), tok(dtype, h, DK), tok(dtype, hv, DK),
        per_head(g_dtype) if kernel.scalar_gate else tok(g_dtype, hv, DK), per_head(beta_dtype),
        make_fake_compact_tensor(Float32, (hv,), stride_order=(0,), assumed_align=4),
        make_fake_compact_tensor(Float32, (hv,), stride_order=(0,), assumed_align=4) if kernel.scalar_gate
        else make_fake_tensor(Float32, (hv, DK), (DK, 1), assumed_align=16),
        *((None, None) if kernel.wy_in_recurrence else (tok(dtype, hv, DK), tok(dtype, hv, DK))),
        # qg and kg, or the factor rows
        *((tok(Float32, hv, ROW_FACTORS), None) if kernel.row_factors else (tok(dtype, hv, DK), tok(dtype, hv, DK))),
        None if kernel.given_t else tok(dtype, hv, BT),
        tok(dtype, hv, BT) if kernel.write_akk or kernel.given_t or kernel.wy_in_recurrence else None,
        None if kernel.row_factors else tok(Float32, hv, DK),
        make_fake_tensor(Float32, (2, tt, h), (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
        if kernel.write_rstd else None,
        make_fake_compact_tensor(Int32, (cute.sym_int32(),), stride_order=(0,), assumed_align=4),
        make_fake_tensor(Int32, (cute.sym_int32(), 2), (2, 1), assumed_align=8),
        Int32(1), Int32(1), Int32(1), Float32(1.0), Float32(-5.0),
        make_fake_stream(use_tvm_ffi_env_stream=True),
    )  # fmt: skip
    return cute.compile(kernel, *args, options=compile_options(arch, extra_options))
