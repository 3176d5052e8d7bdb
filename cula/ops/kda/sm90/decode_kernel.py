"""KDA decode on Hopper: one to a few tokens per sequence against an fp32 state pool, at memory speed.

Per value head ``hv`` (q/k head ``h = hv // (HV // H)``) and token ``t``, with the state ``S`` in ``[K, V]``
orientation::

    S <- diag(exp(g_t)) S
    u  = beta_t * (v_t - S^T k_t)
    S <- S + k_t u^T
    o_t = S^T (scale * q_t)

Decode is bound by state traffic (``K * V * 4`` bytes read and written per sequence and value head), so the
kernel is plain SIMT fp32 work (no tensor cores) organised to keep enough bytes in flight:

* **Work unit = one warp** = one (sequence, value head, V slice) x all of K, where the slice is 8 wide for
  K=128 and 16 wide for K=64. The state tile is loaded once into registers with 16-byte vector loads, kept
  there across the T tokens and written once (or after every token into ``step_states``). Warps never talk
  to each other: no CTA barrier anywhere. N=1 with 64 value heads and K=V=128 is already 1,024 warps.
* **Lane tile**: ``LK = K/8`` lanes along K (16 or 8) and ``32/LK`` along V; lane = ``lk + LK * lv``. A lane
  owns the 8 x 4 block ``k = c + 4*lk + 4*LK*j`` (``c`` < 4, ``j`` < 2), ``v = v0 + 4*lv + r`` (``r`` < 4):
  32 fp32 state registers. Whatever the state layout, each ``4 x 4`` (c, r) block is four 16-byte vectors:
  along V for ``[K, V]`` pools, along K for ``[V, K]`` pools (``state_v_first``); a warp-wide access covers
  whole 32-byte sectors (32 B per row for ``[K, V]`` with K=128, 256 B per row for ``[V, K]``).
* **Reductions over K** (``S^T k`` and ``S^T q``) are 8 FMAs in the lane and a ``log2(LK)``-step butterfly.
* **Token preprocessing** (l2norm, gate activation, beta activation, scale) depends only on the token, so it runs while
  the state loads issued just before are in flight: each warp loads q/k/g of up to 8 tokens with one short vector per
  lane, computes the full-K norms with warp butterflies and one gate per lane and K element (``per_head_gate``, Gated
  DeltaNet's: one scalar gate per token and head, activated once), and parks the fp32 results (``q * scale / |q|``,
  ``k / |k|``, ``exp(g)``, the warp's v values and beta) in its own shared-memory slots (about 12.7 KB per warp for
  K=128). More than 8 tokens are processed in further rounds of 8 (the contract is T <= 8, but nothing breaks above
  it).
* **Occupancy**: 128-thread CTAs with ``min_blocks_per_mp=4`` cap ptxas at 128 registers (99-116 used, no
  spills): 16 warps and 64 KB of state loads in flight per SM. T=1 calls (``KdaTuning.single_token_cta``) keep one token
  slot per warp and run 20 one-warp CTAs per SM at 96 registers: each warp's registers come back the moment it
  ends, not when the slowest of four does.
* **wide_kv** (for ``[K, V]`` pools with K=128 with step states, or T > 1 calls kv_cols does not take; for ``[V, K]``
  pools with K=128 from ``KdaTuning.wide_vk_min_tokens`` tokens a call): ``LK = 8`` and 64 state registers per lane
  (``j`` < 4), so a warp's V slice is twice as wide (on ``[K, V]`` pools each row it reads too, 64 B): half the
  warps a head, each preparing the call's tokens; 3 CTAs per SM.
* **kv_tma** (``[K, V]`` pools with K=128 at T=1, fewer than ``KdaTuning.kv_cols_min_states`` states): the four warps of
  a CTA take four adjacent V slices of one (sequence, head); one TMA load brings their ``[128 K, 32 V]`` box (whole
  128-byte row pieces) into shared memory with the 128-byte swizzle, each lane reads its fragment (rows ``lk + 16 i``,
  conflict-free under the swizzle), runs the same token math and writes it back, and one TMA store returns the box.
* **kv_cols** (T=1 calls on ``[K, V]`` pools with K=128 without step states, from ``KdaTuning.kv_cols_min_states``
  states up, below that kv_tma, whose smaller boxes fill more SMs; MTP calls of 2 to
  ``KdaTuning.multi_token_max_tokens`` tokens there without step states, of any size): a CTA of W warps takes a
  ``[K, 32 W]`` box by one TMA load (W = 4 with V = 128: the whole state, contiguous in the pool) and keeps it in shared
  memory; lane j of warp w owns column ``32 w + j`` with all K rows, so ``S^T k`` and ``S^T q`` are in-lane sums over
  the column (two passes a token, its q / k / exp(g) broadcast from the warp's slot) and no shuffle runs; one TMA
  store returns the box.

Supported: q/k/v/out bf16 or fp16; g bf16 or fp32; beta fp32, bf16 or fp16; K in {64, 128}; V a multiple of
8 (K=128) or 16 (K=64), 64 and 128 tested; any GVA ratio; any H/HV/N/T/pool size at run time (one compile
per dtype/flag combination); the pool's dim-0 stride may be any multiple of 4 elements (a slice of a larger
buffer), the rest must be contiguous.
Padded slots (``indices[n] < 0``) leave the pool and ``step_states`` untouched and get **zeroed** output rows.
An index past the pool (``>= P``, which callers may leave unchecked) touches no memory outside it: the register
kernels skip it as a padded slot; the TMA box kernels' loads and stores are clipped to the pool by the TMA unit (the
output rows are then unspecified).
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor
from cutlass.memory import SmemAllocator

from cula.cache import compile_options
from cula.ops._host import dsl_type
from cula.ops._host import GATES
from cula.ops.kda.sm90.decode import KV_COLS_WARPS_PER_SM, WARPS_PER_SM, WIDE_WARPS_PER_SM
from cula.ops.cute_common import box_barrier_init, box_load, box_store, state_box_atoms

__all__ = ["KdaDecodeBoxSm90", "KdaDecodeSm90"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


class KdaDecodeSm90:
    """The KDA decode step with the state tile in registers, read from and written to the pool directly (the
    narrow tile, or ``wide_kv``); the static configuration and the token preparation shared with the box variants
    (``KdaDecodeBoxSm90``). See the module docstring.

    ==========  ==============================================================================================
    warps       role
    ==========  ==============================================================================================
    every warp  a work unit of its own: issue its state tile's loads, prepare the round's tokens into its slots
                (l2norm, gate, beta) while they fly, run the tokens on the tile, store it (or every step state)
    ==========  ==============================================================================================
    """

    arch = 90
    KV_COLS_UNROLL = 4  # kv_cols: rows of 4 per unrolled step of its column loops
    V_PER_LANE = 4  # one 16-byte fp32 vector
    kv_tma = kv_cols = False  # the box variants' (KdaDecodeBoxSm90), read by the shared token and tile code

    def __init__(
        self,
        *,
        io_dtype,
        g_dtype,
        beta_dtype,
        K: int,
        V: int,
        gate: str,
        has_a_log: bool,
        has_dt_bias: bool,
        use_qk_l2norm: bool,
        beta_sigmoid: bool,
        allow_neg_eigval: bool,
        state_v_first: bool,
        has_step_states: bool,
        warps_per_cta: int = 4,
        min_blocks_per_sm: int | None = None,
        wide_kv: bool = False,
        tokens_per_round: int = 8,
        per_head_gate: bool = False,
    ):
        if K not in (64, 128):
            raise ValueError(f"K must be 64 or 128, got {K}")
        if not 1 <= tokens_per_round <= 8:
            raise ValueError(f"tokens_per_round must be in 1..8, got {tokens_per_round}")
        # shared-memory token slots per warp (~1.6 KB each at K=128): the tokens of one round are prepared
        # before the state loop runs them; any T works, in rounds
        self.tokens_per_round = tokens_per_round
        # one gate per token and value head (Gated DeltaNet's: g [N, T, HV], dt_bias [HV]), activated once and
        # broadcast over the K channels of the token's slot
        self.per_head_gate = bool(per_head_gate)
        # K spread over K/8 lanes (16 for K=128, 8 for K=64): 32 fp32 state registers per lane, which
        # leaves room for 4+ CTAs of 4 warps per SM without spills. wide_kv (K=128): K over K/16
        # lanes, 64 state registers, so a warp's V slice is twice as wide: on [K, V] pools rows of 64 B instead of
        # 32 B, whole DRAM bursts rather than single 32-byte sectors 512 B apart; on either layout half the warps
        # a head, each preparing every token once
        if wide_kv and K != 128:
            # K=64 rows are already 64 B wide with the default tile
            raise ValueError("wide_kv is for K=128")
        self.wide_kv = wide_kv
        self.k_per_lane = 16 if wide_kv else 8  # 4 x 4 blocks of (k, v): 2 or 4
        self.lanes_k = K // self.k_per_lane
        self.lanes_v = 32 // self.lanes_k
        self.v_per_warp = self.lanes_v * self.V_PER_LANE  # 8 for K=128 (16 with wide_kv), 16 for K=64
        if self.kv_cols:  # one column of all K a lane
            self.k_per_lane, self.lanes_k, self.lanes_v, self.v_per_warp = K, 1, 32, 32
        if V % self.v_per_warp != 0:
            raise ValueError(f"V must be a multiple of {self.v_per_warp}, got {V}")
        if gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
        if gate == "softplus" and not has_a_log:
            raise ValueError("the softplus gate needs A_log")
        self.io_dtype = io_dtype
        self.g_dtype = g_dtype
        self.beta_dtype = beta_dtype
        self.K, self.V = K, V
        self.gate = gate
        self.has_a_log = has_a_log and gate != "none"
        self.has_dt_bias = has_dt_bias and gate != "none"
        self.use_qk_l2norm = use_qk_l2norm
        self.beta_sigmoid = beta_sigmoid
        self.allow_neg_eigval = allow_neg_eigval and beta_sigmoid  # FLA: only together with the sigmoid
        self.state_v_first = state_v_first
        self.has_step_states = has_step_states
        self.warps_per_cta = warps_per_cta
        per_sm = KV_COLS_WARPS_PER_SM if self.kv_cols else WIDE_WARPS_PER_SM if wide_kv else WARPS_PER_SM
        self.min_blocks_per_sm = min_blocks_per_sm or max(1, per_sm // warps_per_cta)
        self.tile_v = 32 * warps_per_cta if self.kv_cols else 32  # kv_tma / kv_cols: V columns per CTA

        self.k_blocks = self.k_per_lane // 4  # j extent
        self.k_stride_j = 4 * self.lanes_k  # k distance between a lane's consecutive 4-row blocks
        self.k_prep = K // 32  # K elements per lane during token preprocessing
        self.v_slices = V // self.v_per_warp
        # One token slot: q_hat[K], k_hat[K], exp(g)[K], v[16], beta, padded to 16 bytes.
        self.off_k = K
        self.off_eg = 2 * K
        self.off_v = 3 * K
        self.off_beta = 3 * K + self.v_per_warp
        self.slot_floats = 3 * K + self.v_per_warp + 4
        # the lane that parks beta: one that loads no v (lanes_v < 32), lane 0 with kv_cols (all 32 load one)
        self.beta_lane = self.lanes_v % 32

    # ------------------------------------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [N, T, H, K] io
        mK: cute.Tensor,  # [N, T, H, K] io
        mV: cute.Tensor,  # [N, T, HV, V] io
        mG: cute.Tensor,  # [N, T, HV, K] g_dtype, or [N, T, HV] with per_head_gate
        mBeta: cute.Tensor,  # [N, T, HV] beta_dtype
        mALog: cute.Tensor | None,  # [HV] fp32
        mDtBias: cute.Tensor | None,  # [HV * K] fp32, or [HV] with per_head_gate
        mState: cute.Tensor,  # [P, HV, K, V] or [P, HV, V, K] fp32
        mIdx: cute.Tensor,  # [N] int32
        mOut: cute.Tensor,  # [N, T, HV, V] io
        mStep: cute.Tensor | None,  # [N, T, HV, K, V] or [N, T, HV, V, K] fp32
        scale: Float32,
        lower_bound: Float32,
        stream,
    ):
        N = mQ.shape[0]
        HV = mV.shape[2]
        units = N * HV * self.v_slices
        grid = (units + self.warps_per_cta - 1) // self.warps_per_cta
        kernel = self._kernel(mQ, mK, mV, mG, mBeta, mALog, mDtBias, mState, mIdx, mOut, mStep, scale, lower_bound)
        kernel.launch(
            grid=[grid, 1, 1],
            block=[32 * self.warps_per_cta, 1, 1],
            min_blocks_per_mp=self.min_blocks_per_sm,
            # token slots live in shared memory; L1 only sees streaming state traffic
            preferred_smem_carveout=100,
            stream=stream,
        )

    def _kernel(self, mQ, mK, mV, mG, mBeta, mALog, mDtBias, mState, mIdx, mOut, mStep, scale, lower_bound):
        """This variant's kernel bound to the call's arguments (run while ``__call__`` traces): the register tile
        on the pool itself."""
        return self.kernel(mQ, mK, mV, mG, mBeta, mALog, mDtBias, mState, mIdx, mOut, mStep, scale, lower_bound)

    # ---------------------------------------------------------------------------------------------- device
    @cute.jit
    def _state_view(self, gS: cute.Tensor, lk, v0):
        """This lane's ((4, 2), 4) block of a [K, V] or [V, K] state tile, as a gmem view."""
        if cutlass.const_expr(self.state_v_first):
            off = cute.assume(v0 * self.K + 4 * lk, divby=4)
            layout = cute.make_layout(((4, self.k_blocks), 4), stride=((1, self.k_stride_j), self.K))
        else:
            off = cute.assume(4 * lk * self.V + v0, divby=4)
            layout = cute.make_layout(((4, self.k_blocks), 4), stride=((self.V, self.k_stride_j * self.V), 1))
        return cute.make_tensor(gS.iterator + off, layout)

    @cute.jit
    def _warp_sum(self, x):
        for i in cutlass.range_constexpr(5):
            x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << i)
        return x

    @cute.jit
    def _prep_token(
        self, mQ, mK, mV, mG, mBeta, mALog, mDtBias, sSlot, n, t, h, hv, vs, lane, scale, lower_bound
    ):
        """Write q_hat, k_hat, exp(g), v and beta of token t into this warp's shared slot."""
        KP = self.k_prep
        k0 = cute.assume(lane * KP, divby=KP)
        rq = cute.make_rmem_tensor(KP, self.io_dtype)
        rk = cute.make_rmem_tensor(KP, self.io_dtype)
        cute.autovec_copy(cute.make_tensor(mQ[n, t, h, None].iterator + k0, cute.make_layout(KP)), rq)
        cute.autovec_copy(cute.make_tensor(mK[n, t, h, None].iterator + k0, cute.make_layout(KP)), rk)
        if cutlass.const_expr(self.per_head_gate):
            g_head = Float32(mG[n, t, hv])
        else:
            rg = cute.make_rmem_tensor(KP, self.g_dtype)
            cute.autovec_copy(cute.make_tensor(mG[n, t, hv, None].iterator + k0, cute.make_layout(KP)), rg)
            g = rg.load().to(Float32)
        q = rq.load().to(Float32)
        k = rk.load().to(Float32)

        q_mul = scale
        k_mul = Float32(1.0)
        if cutlass.const_expr(self.use_qk_l2norm):
            sq = self._warp_sum((q * q).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
            sk = self._warp_sum((k * k).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
            q_mul = scale * cute.math.rsqrt(sq + 1e-6)
            k_mul = cute.math.rsqrt(sk + 1e-6)

        rout = cute.make_rmem_tensor(KP, Float32)
        rout.store(q * q_mul)
        cute.autovec_copy(rout, cute.make_tensor(sSlot.iterator + k0, cute.make_layout(KP)))
        rout.store(k * k_mul)
        cute.autovec_copy(rout, cute.make_tensor(sSlot.iterator + self.off_k + k0, cute.make_layout(KP)))

        # gate -> log-space decay gk -> exp(gk)
        a = self._gate_coef(mALog, hv)
        if cutlass.const_expr(self.per_head_gate):
            if cutlass.const_expr(self.has_dt_bias):
                g_head = g_head + Float32(mDtBias[hv])
            rout.fill(self._decay(g_head, a, lower_bound))
        else:
            if cutlass.const_expr(self.has_dt_bias):
                rb = cute.make_rmem_tensor(KP, Float32)
                cute.autovec_copy(
                    cute.make_tensor(
                        mDtBias.iterator + cute.assume(hv * self.K + k0, divby=KP), cute.make_layout(KP)
                    ),
                    rb,
                )
                g = g + rb.load()
            for i in cutlass.range_constexpr(KP):
                rout[i] = self._decay(g[i], a, lower_bound)
        cute.autovec_copy(rout, cute.make_tensor(sSlot.iterator + self.off_eg + k0, cute.make_layout(KP)))

        self._prep_v(mV, sSlot, n, t, hv, vs, lane)
        if lane == self.beta_lane:
            sSlot[self.off_beta] = self._beta(mBeta, n, t, hv)

    @cute.jit
    def _prep_round(self, mQ, mK, mV, mG, mBeta, mALog, mDtBias, sW, n, t0, nt, h, hv, vs, lane, scale, lower_bound):
        """Tokens t0 .. t0 + nt - 1 into the warp's slots ``sW[:, 0 .. nt - 1]``, visible to the whole warp after."""
        for tt in range(nt):
            self._prep_token(
                mQ, mK, mV, mG, mBeta, mALog, mDtBias, sW[None, tt], n, t0 + tt, h, hv, vs, lane, scale, lower_bound
            )
        cute.arch.sync_warp()

    @cute.jit
    def _gate_coef(self, mALog, hv):
        """The per-head factor of the gate: -exp(A_log) (softplus), exp(A_log) or 1 (lower_bound)."""
        a = Float32(1.0)
        if cutlass.const_expr(self.gate == "softplus"):
            a = -cute.math.exp(Float32(mALog[hv]), fastmath=True)
        elif cutlass.const_expr(self.gate == "lower_bound" and self.has_a_log):
            a = cute.math.exp(Float32(mALog[hv]), fastmath=True)
        return a

    @cute.jit
    def _decay(self, x, a, lower_bound):
        """exp(gk) of one raw gate value x (dt_bias added), for the configured gate."""
        r = Float32(0.0)
        if cutlass.const_expr(self.gate == "softplus"):
            sp = x
            if x <= 20.0:
                # accurate log1p: for x << 0 softplus ~ exp(x) and 1 + exp(x) would round it away
                sp = cute.math.log1p(cute.math.exp(x, fastmath=True))
            r = cute.math.exp2(a * sp * _LOG2E, fastmath=True)
        elif cutlass.const_expr(self.gate == "lower_bound"):
            sig = cute.arch.rcp_approx(1.0 + cute.math.exp2(-a * x * _LOG2E, fastmath=True))
            r = cute.math.exp2(lower_bound * sig * _LOG2E, fastmath=True)
        else:
            r = cute.math.exp2(x * _LOG2E, fastmath=True)
        return r

    @cute.jit
    def _beta(self, mBeta, n, t, hv):
        b = Float32(mBeta[n, t, hv])
        if cutlass.const_expr(self.beta_sigmoid):
            b = cute.arch.rcp_approx(1.0 + cute.math.exp2(-b * _LOG2E, fastmath=True))
            if cutlass.const_expr(self.allow_neg_eigval):
                b = b * 2.0
        return b

    @cute.jit
    def _prep_v(self, mV, sSlot, n, t, hv, vs, lane):
        """The warp's 8 or 16 values of v into its slot: the first 2 or 4 lanes load 4 each (kv_cols: its 32, one
        a lane)."""
        if const_expr(self.kv_cols):
            sSlot[self.off_v + lane] = Float32(mV[n, t, hv, vs * 32 + lane])
        elif lane < self.lanes_v:
            v_off = cute.assume(vs * self.v_per_warp + lane * self.V_PER_LANE, divby=self.V_PER_LANE)
            rv = cute.make_rmem_tensor(self.V_PER_LANE, self.io_dtype)
            cute.autovec_copy(
                cute.make_tensor(mV[n, t, hv, None].iterator + v_off, cute.make_layout(self.V_PER_LANE)), rv
            )
            rvf = cute.make_rmem_tensor(self.V_PER_LANE, Float32)
            rvf.store(rv.load().to(Float32))
            s_off = cute.assume(self.off_v + lane * self.V_PER_LANE, divby=self.V_PER_LANE)
            cute.autovec_copy(
                rvf, cute.make_tensor(sSlot.iterator + s_off, cute.make_layout(self.V_PER_LANE))
            )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mALog: cute.Tensor | None,
        mDtBias: cute.Tensor | None,
        mState: cute.Tensor,
        mIdx: cute.Tensor,
        mOut: cute.Tensor,
        mStep: cute.Tensor | None,
        scale: Float32,
        lower_bound: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        N = mQ.shape[0]
        T = mQ.shape[1]
        H = mQ.shape[2]
        HV = mV.shape[2]
        KB = self.k_blocks
        R = self.V_PER_LANE
        TR = self.tokens_per_round

        smem = SmemAllocator()
        sBuf = smem.allocate_tensor(
            Float32, cute.make_layout((self.slot_floats, TR, self.warps_per_cta)), byte_alignment=16
        )

        units = N * HV * self.v_slices
        lk = lane % self.lanes_k
        lv = lane // self.lanes_k
        sW = sBuf[None, None, warp]
        if cutlass.const_expr(self.state_v_first):
            frag_layout = cute.make_layout(((4, KB), R), stride=((1, 4), 4 * KB))
        else:
            frag_layout = cute.make_layout(((4, KB), R), stride=((R, 4 * R), 1))
        tS = cute.make_rmem_tensor(frag_layout, Float32)
        unit = bidx * self.warps_per_cta + warp
        if unit < units:
            n, h, hv, vs, v0 = self._unit_coords(unit, HV, H, lv)
            slot = mIdx[n]
            # a slot past the pool (an unchecked index) is skipped like a padded one: no access outside the pool
            if (slot >= 0) & (slot < mState.shape[0]):
                # state tile -> registers first, so the loads fly during token preprocessing
                gS = self._state_view(mState[slot, hv, None, None], lk, v0)
                cute.autovec_copy(gS, tS)
                self._run_unit(tS, gS, mQ, mK, mV, mG, mBeta, mALog, mDtBias, mOut, mStep, sW,
                               n, h, hv, vs, v0, lane, T, scale, lower_bound)  # fmt: skip
            else:
                self._zero_rows(mOut, n, hv, v0, lk, T)

    @cute.jit
    def _unit_coords(self, unit, HV, H, lv):
        """Unit -> (sequence n, q/k head h, value head hv, V slice vs, this lane's first v column v0)."""
        vs = unit % self.v_slices
        nh = unit // self.v_slices
        hv = nh % HV
        per_lane = 1 if const_expr(self.kv_cols) else self.V_PER_LANE
        return nh // HV, hv // (HV // H), hv, vs, vs * self.v_per_warp + lv * per_lane

    @cute.jit
    def _zero_rows(self, mOut, n, hv, v0, lk, T):
        """A padded slot's output rows: zeros (the pool is not touched)."""
        R = self.V_PER_LANE
        rzero = cute.make_rmem_tensor(R, self.io_dtype)
        rzero.fill(0.0)
        if lk == 0:
            for t in range(T):
                gO = mOut[n, t, hv, None]
                cute.autovec_copy(rzero, cute.make_tensor(gO.iterator + cute.assume(v0, divby=R), cute.make_layout(R)))

    @cute.jit
    def _run_unit(
        self, tS, gS, mQ, mK, mV, mG, mBeta, mALog, mDtBias, mOut, mStep, sW, n, h, hv, vs, v0, lane, T, scale,
        lower_bound, bar=None,
    ):  # fmt: skip
        """The T tokens of one unit on its state tile ``tS`` (in registers), then the tile back to ``gS``. With
        kv_tma, ``gS`` is the lane's fragment in shared memory, loaded into ``tS`` once ``bar`` says it landed."""
        KB = self.k_blocks
        KPT = self.k_per_lane
        LOG_LK = int(math.log2(self.lanes_k))
        R = self.V_PER_LANE
        TR = self.tokens_per_round
        lk = lane % self.lanes_k
        lv = lane // self.lanes_k
        # the lane's K elements of a token slot: k = 4 lk + c + k_stride_j j, or lk + 16 i with kv_tma
        kshape = (4, KB)
        lane_k = cute.make_layout(kshape, stride=(1, self.k_stride_j))
        kq = cute.assume(4 * lk, divby=4)
        if const_expr(self.kv_tma):
            kshape = KPT
            lane_k = cute.make_layout(KPT, stride=self.lanes_k)
            kq = lk
        rq = cute.make_rmem_tensor(cute.make_layout(kshape), Float32)
        rk = cute.make_rmem_tensor(cute.make_layout(kshape), Float32)
        reg = cute.make_rmem_tensor(cute.make_layout(kshape), Float32)
        rv = cute.make_rmem_tensor(R, Float32)
        ro = cute.make_rmem_tensor(R, self.io_dtype)

        for t0 in range(0, T, TR):
            nt = cutlass.min(T - t0, TR)
            self._prep_round(mQ, mK, mV, mG, mBeta, mALog, mDtBias, sW, n, t0, nt, h, hv, vs, lane, scale,
                             lower_bound)  # fmt: skip
            if const_expr(self.kv_tma):
                if t0 == 0:
                    cute.arch.mbarrier_wait(bar, 0)
                    cute.autovec_copy(gS, tS)

            for tt in range(nt):
                t = t0 + tt
                sSlot = sW[None, tt]
                cute.autovec_copy(cute.make_tensor(sSlot.iterator + self.off_eg + kq, lane_k), reg)
                cute.autovec_copy(cute.make_tensor(sSlot.iterator + self.off_k + kq, lane_k), rk)
                v_off = cute.assume(self.off_v + lv * R, divby=R)
                cute.autovec_copy(cute.make_tensor(sSlot.iterator + v_off, cute.make_layout(R)), rv)
                beta = sSlot[self.off_beta]

                # S <- diag(exp(g)) S ;  p = S^T k  (lane part)
                p = [Float32(0.0)] * R
                for i in cutlass.range_constexpr(KPT):
                    for r in cutlass.range_constexpr(R):
                        s = tS[i, r] * reg[i]
                        tS[i, r] = s
                        p[r] = p[r] + s * rk[i]
                # u = beta * (v - S^T k)
                u = [Float32(0.0)] * R
                for r in cutlass.range_constexpr(R):
                    x = p[r]
                    for b in cutlass.range_constexpr(LOG_LK):
                        x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << b)
                    u[r] = beta * (rv[r] - x)

                cute.autovec_copy(cute.make_tensor(sSlot.iterator + kq, lane_k), rq)
                # S <- S + k u^T ;  o = S^T q_hat
                o = [Float32(0.0)] * R
                for i in cutlass.range_constexpr(KPT):
                    for r in cutlass.range_constexpr(R):
                        s = tS[i, r] + rk[i] * u[r]
                        tS[i, r] = s
                        o[r] = o[r] + s * rq[i]
                for r in cutlass.range_constexpr(R):
                    x = o[r]
                    for b in cutlass.range_constexpr(LOG_LK):
                        x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << b)
                    ro[r] = x.to(self.io_dtype)
                if lk == 0:
                    gO = mOut[n, t, hv, None]
                    cute.autovec_copy(
                        ro,
                        cute.make_tensor(gO.iterator + cute.assume(v0, divby=R), cute.make_layout(R)),
                    )
                if cutlass.const_expr(self.has_step_states):
                    cute.autovec_copy(tS, self._state_view(mStep[n, t, hv, None, None], lk, v0))
            cute.arch.sync_warp()

        if cutlass.const_expr(not self.has_step_states):
            cute.autovec_copy(tS, gS)

# ---------------------------------------------------------------------------------------------------- host
class KdaDecodeBoxSm90(KdaDecodeSm90):
    """The variants that move each CTA's state box through shared memory by TMA ([K, V] pools with K=128, no step
    states; see the module docstring), one TMA load and one TMA store a box:

    * ``kv_tma``: the CTA's four warps own four adjacent 8-wide V slices of one (sequence, head), a ``[128, 32]``
      fp32 box of whole 128-byte row pieces (128-byte swizzle); each lane reads its fragment (rows ``lk + 16 i``,
      a conflict-free 16-byte read a row) and runs the register tile's token math (``_run_unit``) on it;
    * ``kv_cols``: a CTA of W warps takes a ``[K, 32 W]`` box (W = 4, V = 128: the whole 64 KB state, one
      contiguous piece of the pool); lane j of warp w owns column ``32 w + j``, all K of it, where the box lies in
      shared memory, so ``S^T k`` and ``S^T q`` are in-lane sums (``_run_columns``): no shuffles, and the token's
      q / k / exp(g) are broadcast reads of the warp's slot.

    ==========  ==============================================================================================
    warps       role
    ==========  ==============================================================================================
    0           arms the box's mbarrier, issues the TMA load, later the TMA store (after every warp's writes)
    all         prepare the round's tokens into their slots while the box lands, then the token math on the box
    ==========  ==============================================================================================
    """

    def __init__(self, *, kv_tma: bool = False, kv_cols: bool = False, **config):
        if not (kv_tma or kv_cols):
            raise ValueError("a box variant is kv_tma or kv_cols")
        K, V = config["K"], config["V"]
        warps, slots = config.get("warps_per_cta", 4), config.get("tokens_per_round", 8)
        if kv_tma and (config["state_v_first"] or K != 128 or config.get("wide_kv") or config["has_step_states"]
                       or warps != 4 or slots != 1 or V % 32 != 0):  # fmt: skip
            raise ValueError("kv_tma is for [K, V] pools with K=128, V % 32 == 0, no step states, 4 warps per CTA "
                             "and one token slot")
        if kv_cols and (config["state_v_first"] or config.get("wide_kv") or kv_tma or config["has_step_states"]
                        or V % (32 * warps) != 0):  # fmt: skip
            raise ValueError("kv_cols is for [K, V] pools without step states, V a multiple of 32 x warps_per_cta, "
                             "and neither wide_kv nor kv_tma")  # fmt: skip
        self.kv_tma, self.kv_cols = kv_tma, kv_cols  # read by the shared geometry in __init__
        super().__init__(**config)

    def _kernel(self, mQ, mK, mV, mG, mBeta, mALog, mDtBias, mState, mIdx, mOut, mStep, scale, lower_bound):
        """The box kernel with the TMA atoms of the pool's boxes."""
        box_l = cute.select(self._tile_layout(), mode=[0, 1])
        tma_ld, t_ld, tma_st, t_st = state_box_atoms(mState, box_l, self.tile_v, self.K)
        return self.kernel_box(
            mQ, mK, mV, mG, mBeta, mALog, mDtBias, tma_ld, t_ld, tma_st, t_st, mIdx, mOut, scale, lower_bound
        )

    def _tile_layout(self):
        """kv_tma's shared [32 V, 128 K] fp32 box (V contiguous), 128-byte swizzled: the 16-byte unit c of row k
        sits at unit c ^ (k % 8) (the DSL's swizzles act on byte offsets: 3 bits at 16 B, xor-ed from 128 B).
        kv_cols' [32 W V, K] box is not swizzled: its lanes read consecutive columns of one row."""
        bits = 0 if self.kv_cols else 3
        return cute.make_composed_layout(
            cute.make_swizzle(bits, 4, 3), 0, cute.make_layout((self.tile_v, self.K, 1), stride=(1, self.tile_v, 0))
        )

    @cute.kernel
    def kernel_box(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mALog: cute.Tensor | None,
        mDtBias: cute.Tensor | None,
        tma_ld: cute.CopyAtom,
        t_ld: cute.Tensor,
        tma_st: cute.CopyAtom,
        t_st: cute.Tensor,
        mIdx: cute.Tensor,
        mOut: cute.Tensor,
        scale: Float32,
        lower_bound: Float32,
    ):
        """The kv_tma and kv_cols variants: the CTA's state box of one (sequence, head) through shared memory by
        TMA. kv_tma runs the token math of ``_run_unit`` on a register fragment read from the box, kv_cols that of
        ``_run_columns`` on the box itself (see ``__init__``)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        H = mQ.shape[2]
        HV = mV.shape[2]
        T = mQ.shape[1]
        R = self.V_PER_LANE
        TV = self.tile_v

        smem = SmemAllocator()
        sRaw = smem.allocate_tensor(Float32, cute.make_layout(TV * self.K), byte_alignment=1024)
        sBuf = smem.allocate_tensor(Float32, cute.make_layout((self.slot_floats, self.tokens_per_round,
                                                               self.warps_per_cta)), byte_alignment=16)  # fmt: skip
        bar = smem.allocate_tensor(cutlass.Int64, cute.make_layout(1), byte_alignment=8).iterator
        tile_l = self._tile_layout()
        sTile = cute.make_tensor(cute.recast_ptr(sRaw.iterator, tile_l.inner, dtype=Float32), tile_l.outer)

        lk = lane % self.lanes_k
        lv = lane // self.lanes_k
        n, h, hv, vs, v0 = self._unit_coords(bidx * self.warps_per_cta + warp, HV, H, lv)
        vb = vs // self.warps_per_cta  # the CTA's box along V
        slot = mIdx[n]  # one (sequence, head) per CTA: the branch below is CTA-uniform
        box_barrier_init(bar, tidx)
        if slot >= 0:
            box_load(tma_ld, t_ld, sTile, hv, slot, vb, bar, warp, lane, self.tile_v, self.K)
            if const_expr(self.kv_cols):
                self._run_columns(sRaw, sBuf[None, None, warp], mQ, mK, mV, mG, mBeta, mALog, mDtBias, mOut, n, h, hv,
                                  vs, v0, lane, warp, T, scale, lower_bound, bar)  # fmt: skip
            else:
                # this lane's rows lk + 16 i and columns 8 (warp) + 4 lv + r: under the swizzle one 16-byte unit per
                # row, at the same unit for every i since (lk + 16 i) % 8 = lk % 8
                unit = (2 * warp + lv) ^ (lk % 8)
                off = cute.assume(lk * TV + unit * R, divby=R)
                gS = cute.make_tensor(sRaw.iterator + off, cute.make_layout((self.k_per_lane, R), stride=(16 * TV, 1)))
                tS = cute.make_rmem_tensor(cute.make_layout((self.k_per_lane, R), stride=(R, 1)), Float32)
                self._run_unit(tS, gS, mQ, mK, mV, mG, mBeta, mALog, mDtBias, mOut, None, sBuf[None, None, warp],
                               n, h, hv, vs, v0, lane, T, scale, lower_bound, bar)  # fmt: skip
            box_store(tma_st, t_st, sTile, hv, slot, vb, warp, self.tile_v, self.K)
        elif const_expr(self.kv_cols):
            zero = cute.make_rmem_tensor(1, self.io_dtype)
            zero.fill(0.0)
            for t in range(T):
                mOut[n, t, hv, v0] = zero[0]
        else:
            self._zero_rows(mOut, n, hv, v0, lk, T)

    @cute.jit
    def _run_columns(
        self, sRaw, sW, mQ, mK, mV, mG, mBeta, mALog, mDtBias, mOut, n, h, hv, vs, c, lane, warp, T, scale,
        lower_bound, bar,
    ):  # fmt: skip
        """kv_cols: the T tokens of this lane's state column ``c`` (all K rows, in the shared box), in rounds of
        ``tokens_per_round`` prepared tokens; the box's TMA load lands on ``bar`` while the first round is prepared."""
        K, TV, TR = self.K, self.tile_v, self.tokens_per_round
        # this lane's column, rows k of the box TV floats apart: it stays in shared memory (consecutive lanes,
        # consecutive words: no bank conflicts), since a column of 128 fp32 in registers spilled at any occupancy
        box_col = self.v_per_warp * warp + lane  # the lane's column within the box (c is its column of V)
        col = cute.make_tensor(sRaw.iterator + cute.assume(box_col, divby=1), cute.make_layout(K, stride=TV))
        r4 = cute.make_rmem_tensor(4, Float32)
        rb = cute.make_rmem_tensor(4, Float32)
        rq = cute.make_rmem_tensor(4, Float32)
        acc = cute.make_rmem_tensor(4, Float32)
        ro = cute.make_rmem_tensor(1, self.io_dtype)
        for t0 in range(0, T, TR):
            nt = cutlass.min(T - t0, TR)
            self._prep_round(mQ, mK, mV, mG, mBeta, mALog, mDtBias, sW, n, t0, nt, h, hv, vs, lane, scale,
                             lower_bound)  # fmt: skip
            if t0 == 0:
                cute.arch.mbarrier_wait(bar, 0)
            for tt in range(nt):
                sSlot = sW[None, tt]
                # p = (diag(exp(g)) S)^T k, four partial sums for the FMA latency. Runtime loops (unrolled
                # KV_COLS_UNROLL times): fully unrolled, the compiler hoisted every slot read (168-255 registers)
                acc.fill(0.0)
                for i in cutlass.range(K // 4, unroll=self.KV_COLS_UNROLL):
                    cute.autovec_copy(self._slot4(sSlot, self.off_eg + 4 * i), r4)
                    cute.autovec_copy(self._slot4(sSlot, self.off_k + 4 * i), rb)
                    for e in cutlass.range_constexpr(4):
                        acc[e] = acc[e] + col[4 * i + e] * r4[e] * rb[e]
                u = sSlot[self.off_beta] * (sSlot[self.off_v + lane] - ((acc[0] + acc[1]) + (acc[2] + acc[3])))
                # S <- diag(exp(g)) S + k u^T ;  o = S^T q_hat
                acc.fill(0.0)
                for i in cutlass.range(K // 4, unroll=self.KV_COLS_UNROLL):
                    cute.autovec_copy(self._slot4(sSlot, self.off_eg + 4 * i), r4)
                    cute.autovec_copy(self._slot4(sSlot, self.off_k + 4 * i), rb)
                    cute.autovec_copy(self._slot4(sSlot, 4 * i), rq)
                    for e in cutlass.range_constexpr(4):
                        x = col[4 * i + e] * r4[e] + rb[e] * u
                        col[4 * i + e] = x
                        acc[e] = acc[e] + x * rq[e]
                ro[0] = ((acc[0] + acc[1]) + (acc[2] + acc[3])).to(self.io_dtype)
                mOut[n, t0 + tt, hv, c] = ro[0]
            cute.arch.sync_warp()

    @cute.jit
    def _slot4(self, sSlot, off):
        """Four consecutive floats of a token slot (one 16-byte broadcast read)."""
        return cute.make_tensor(sSlot.iterator + cute.assume(off, divby=4), cute.make_layout(4))


def _compile(cfg: KdaDecodeSm90, arch: tuple[int, int]):
    """Trace and compile one variant against fake tensors with symbolic N, T, H, HV, P."""
    N, T, H, HV, P = (cute.sym_int32() for _ in range(5))
    HVK = cute.sym_int32()
    K, V = cfg.K, cfg.V
    row = lambda rank: tuple(range(rank - 1, -1, -1))
    # activations fit int32 offsets (N * T * HV * max(K, V) < 2**31); the pool and step_states may not
    mk = lambda dt, shape, align=16, i32=True: make_fake_compact_tensor(
        dt, shape, stride_order=row(len(shape)), assumed_align=align, use_32bit_stride=i32
    )
    q = mk(cfg.io_dtype, (N, T, H, K))
    k = mk(cfg.io_dtype, (N, T, H, K))
    v = mk(cfg.io_dtype, (N, T, HV, V))
    if cfg.per_head_gate:  # one gate (and dt_bias) per token and value head
        g = mk(cfg.g_dtype, (N, T, HV), align=cfg.g_dtype.width // 8)
        dt_bias = mk(Float32, (HV,), align=4) if cfg.has_dt_bias else None
    else:
        g = mk(cfg.g_dtype, (N, T, HV, K))
        dt_bias = mk(Float32, (HVK,)) if cfg.has_dt_bias else None
    beta = mk(cfg.beta_dtype, (N, T, HV), align=cfg.beta_dtype.width // 8)
    a_log = mk(Float32, (HV,), align=4) if cfg.has_a_log else None
    inner = (V, K) if cfg.state_v_first else (K, V)
    # dim-0 stride free (the pool may be a slice of a larger buffer) but 16-byte aligned
    pool_stride = cute.sym_int64(divisibility=4)
    state = make_fake_tensor(
        Float32, (P, HV, *inner), stride=(pool_stride, K * V, inner[1], 1), assumed_align=16
    )
    idx = mk(Int32, (N,), align=4)
    out = mk(cfg.io_dtype, (N, T, HV, V))
    step = mk(Float32, (N, T, HV, *inner), i32=False) if cfg.has_step_states else None
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        cfg,
        q,
        k,
        v,
        g,
        beta,
        a_log,
        dt_bias,
        state,
        idx,
        out,
        step,
        Float32(1.0),
        Float32(0.0),
        stream,
        options=compile_options(arch),
    )

def _build(key: tuple):
    flags = dict(key[1:])
    arch = flags.pop("arch")
    for name in ("io_dtype", "g_dtype", "beta_dtype"):
        flags[name] = dsl_type(flags[name])
    kernel = KdaDecodeBoxSm90 if flags.get("kv_tma") or flags.get("kv_cols") else KdaDecodeSm90
    if kernel is KdaDecodeSm90:
        flags.pop("kv_tma", None)
    return _compile(kernel(**flags), arch)
