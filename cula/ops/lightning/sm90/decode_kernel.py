"""Lightning attention decode on Hopper: a few tokens per sequence against an fp32 state pool, at copy speed.

Per value head ``hv`` (q/k head ``h = hv // (HV // H)``) and token ``t``, with the state ``S`` in ``[K, V]``
orientation and ``a = exp(-decay[hv])``::

    S  <- a * S + k_t v_t^T
    o_t = scale * S^T q_t

Without a delta rule there is nothing to compute but a scaled rank-1 update and one reduction, so the kernel
is a copy of the state (``K * V * 4`` bytes read and written per sequence and value head) with three FP32
operations per element on the way. Everything below is about keeping enough bytes in flight.

**Why a decode kernel stops short of copy bandwidth and what this one does** (``docs/kernels/lightning-decode.md``).
Little's law: at 4.27 TB/s over 132 SMs each SM moves ~16 GB/s each way, which at the 1-2 us latency of a loaded HBM3e
read needs 16-32 KB of reads in flight per SM *on average*. The KDA kernel has 16 warps x 4 KB = 64 KB per SM at best,
but each warp spends part of its short life with nothing in flight: it first loads its pool index (one dependent round
trip), then its state, then computes and stores, then the CTA retires and a new one launches. Averaged over a warp's
life well under half of the nominal 64 KB is in flight, which is right at the edge. Here:

* **Twice the state per thread**: each lane holds 64 fp32 (sixteen 16-byte loads, all issued back to back before the
  first use, together with the token's q/k/v and the decay), so 16 warps per SM (ptxas cap 128 registers) put 128 KB of
  state loads in flight. T=1 calls on ``[V, K]`` pools (``LightningTuning.single_token_tile``) turn this around: 32
  values a lane in one-warp CTAs, 20 warps per SM, which measured 2 points of copy faster: a one-warp CTA gives its
  registers back when its own state is stored, not when the slowest of four is.
* **Persistent warps with the next pool index prefetched, for T >= 2**: the grid is ``#SMs x CTAs per SM``;
  each warp (or CTA, see below) walks work units with a grid stride and loads the pool index of its *next*
  unit while the current one is in flight, so the dependent index round trip and the CTA launch are off the
  critical path. At T=1 the same kernel runs one round on a grid of one CTA per unit group instead
  (``LightningTuning.persistent_min_tokens``): there the hardware's CTA scheduler, which hands work to whichever
  SM frees up, beat the static grid stride by 4% (N=64) and 5% (N=256) on the H200.
* **Whole 128-byte lines per warp instruction** in both layouts (the KDA ``[K, V]`` path touches 32 bytes per
  row per instruction and reached 2.39 TB/s). The state loads and stores take no cache hint: on the H200 that ran
  3-5% faster than ``L1::no_allocate`` loads in both layouts, although the state is read only once.
* **[K, V] pools by column** (``cols``; ``LightningTuning.kv_cols`` for T=1 calls with K=128 and ``kv_cols_min_states``
  states or more): one CTA per ``[K, 32 W]`` box of one (sequence, head), loaded by one TMA into shared memory and kept
  there; lane j of warp w owns column ``32 w + j`` with all K rows, so a token is one pass over the column and ``o`` an
  in-lane sum (``kernel_cols``).

**Work split.** A lane's state fragment is ``R`` rows x ``C`` chunks of 4 contiguous fp32 (``R * C * 4 = 64``,
or 32 with ``R = 4`` for ``[V, K]`` pools)
along the contiguous ("inner") dimension of the pool tile; ``L_in`` lanes cover the inner dimension of one
row per chunk, ``L_out = 32 / L_in`` lane groups cover ``L_out`` rows per load instruction.

* ``state_v_first`` (pool ``[V, K]``, the default): inner = K, reduction over K inside the warp.
  ``C = 2``, ``R = 8``, ``L_in = K / 8``: lane ``(l_in, l_out)`` holds ``k = 4 l_in + c + 4 L_in j`` of rows
  ``v = v0 + 8 l_out + r``. One instruction covers ``L_out`` rows x ``K * 4`` bytes. A warp owns
  ``8 L_out`` rows of V x all of K (16 rows for K=128, 32 for K=64) and is a work unit on its own (no
  barrier); ``o`` is an in-lane sum over 8 k plus a ``log2(L_in)``-step butterfly, stored as one 16-byte
  vector per row group.
* ``[K, V]`` pools: inner = V, reduction over K across lane groups and warps. ``L_in = 8`` (128 bytes of a row
  per chunk), ``L_out = 4``. K=128: ``R = 8``, ``C = 2`` (a 64-wide V slice), a warp covers 32 rows of K and
  the CTA's 4 warps together one (sequence, head, V slice) unit; partial ``o`` meet in shared memory (double
  buffered, one CTA barrier per token). K=64: ``R = 16``, ``C = 1`` (a 32-wide V slice), one warp covers all
  64 rows and is a unit on its own.

N=1 with HV=64 and K=V=128 is 512 warp units (``[V, K]``) or 128 CTA units (``[K, V]``): one wave.

Supported: q/k/v/out bf16 or fp16; K in {64, 128}; V a multiple of 64; any H, HV (HV % H == 0), N, T (T
tokens run one after the other with the state kept in registers; written back once) and pool size at run
time; the pool's dim-0 stride may be any multiple of 4 elements, the inner dims must be contiguous.
Padded slots (``indices[n] < 0``) leave the pool untouched and get **zeroed** output rows.
An index past the pool (``>= P``, which callers may leave unchecked) touches no memory outside it: the register
kernels skip it as a padded slot; the TMA box kernels' loads and stores are clipped to the pool by the TMA unit (the
output rows are then unspecified).
"""
from __future__ import annotations

import math

import cutlass
from cutlass import Float32, Int32, cute
from cutlass.cute.nvgpu import CacheEvictionPriority, CopyG2ROp, CopyR2GOp, LoadCacheMode, StoreCacheMode
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor
from cutlass.memory import SmemAllocator

from cula.cache import compile_options
from cula.ops._host import dsl_type
from cula.ops.lightning.sm90.decode import LightningDecodeTile
from cula.ops.cute_common import box_barrier_init, box_load, box_store, state_box_atoms

__all__ = ["LOAD_HINTS", "STORE_HINTS", "LightningDecodeSm90"]

# Cache hints for the state traffic (the only bytes that matter); speed-report knobs, not correctness ones.
LOAD_HINTS = {
    "default": (CacheEvictionPriority.EVICT_NORMAL, LoadCacheMode.ALWAYS),
    "no_allocate": (CacheEvictionPriority.NO_ALLOCATE, LoadCacheMode.ALWAYS),
    "streaming": (CacheEvictionPriority.EVICT_NORMAL, LoadCacheMode.STREAMING),
}
STORE_HINTS = {
    "default": (CacheEvictionPriority.EVICT_NORMAL, StoreCacheMode.WRITE_BACK),
    "no_allocate": (CacheEvictionPriority.NO_ALLOCATE, StoreCacheMode.WRITE_BACK),
    "streaming": (CacheEvictionPriority.EVICT_NORMAL, StoreCacheMode.STREAMING),
}

class LightningDecodeSm90(LightningDecodeTile):
    """Static configuration and CuTe kernel for the Lightning decode step (see the module docstring)."""

    # ------------------------------------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [N, T, H, K] io
        mK: cute.Tensor,  # [N, T, H, K] io
        mV: cute.Tensor,  # [N, T, HV, V] io
        mDecay: cute.Tensor,  # [HV] fp32, >= 0
        mState: cute.Tensor,  # [P, HV, V, K] (state_v_first) or [P, HV, K, V] fp32
        mIdx: cute.Tensor,  # [N] int32, < 0: padded slot
        mOut: cute.Tensor,  # [N, T, HV, V] io
        scale: Float32,
        num_ctas: Int32,  # persistent grid: min(units needed, #SMs x CTAs per SM), from the host
        stream,
    ):
        # shared memory (only the [K, V] K=128 path, 2 KB per CTA) is tiny: give L1 the rest, it serves the
        # q/k rows that the warps of a head share
        carveout = 0
        if cutlass.const_expr(self.warps_per_unit > 1):
            carveout = 10
        kernel = None
        if cutlass.const_expr(self.cols):
            carveout = 100  # the state box
            box_l = cute.make_layout((self.tile_v, self.K), stride=(1, self.tile_v))
            tma_ld, t_ld, tma_st, t_st = state_box_atoms(mState, box_l, self.tile_v, self.K)
            kernel = self.kernel_cols(mQ, mK, mV, mDecay, tma_ld, t_ld, tma_st, t_st, mIdx, mOut, scale)
        else:
            kernel = self.kernel(mQ, mK, mV, mDecay, mState, mIdx, mOut, scale)
        kernel.launch(
            grid=[num_ctas, 1, 1],
            block=[32 * self.warps_per_cta, 1, 1],
            min_blocks_per_mp=self.min_blocks_per_sm,
            preferred_smem_carveout=carveout,
            stream=stream,
        )

    # ---------------------------------------------------------------------------------------------- device
    @cute.jit
    def _lane_tile(self, base, row0, inner0, row_stride):
        """(VEC, (C, R)) view of this lane's fragment: VEC contiguous values, C chunks, R rows."""
        off = cute.assume(row0 * row_stride + inner0, divby=self.VEC)
        layout = cute.make_layout(
            (self.VEC, (self.C, self.R)), stride=(1, (self.chunk_stride, row_stride))
        )
        return cute.make_tensor(base + off, layout)

    @cute.jit
    def _load_vec(self, ptr, n: int, dst_f32, mul):
        """``dst_f32[i] = mul * ptr[i]`` for ``n`` contiguous io values (one 8- or 16-byte load)."""
        r = cute.make_rmem_tensor(n, self.io_dtype)
        cute.autovec_copy(cute.make_tensor(ptr, cute.make_layout(n)), r)
        dst_f32.store(r.load().to(Float32) * mul)

    @cute.jit
    def _load_chunks(self, ptr, dst_f32, mul):
        """``dst_f32[c, j] = mul * ptr[c + chunk_stride * j]``: the lane's inner values of a token vector."""
        r = cute.make_rmem_tensor(cute.make_layout((self.VEC, self.C)), self.io_dtype)
        cute.autovec_copy(
            cute.make_tensor(ptr, cute.make_layout((self.VEC, self.C), stride=(1, self.chunk_stride))), r
        )
        dst_f32.store(r.load().to(Float32) * mul)

    @cute.jit
    def _store_vec(self, ptr, src_io, n: int):
        cute.autovec_copy(src_io, cute.make_tensor(ptr, cute.make_layout(n)))

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mDecay: cute.Tensor,
        mState: cute.Tensor,
        mIdx: cute.Tensor,
        mOut: cute.Tensor,
        scale: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        N = mQ.shape[0]
        T = mQ.shape[1]
        H = mQ.shape[2]
        HV = mV.shape[2]
        R, C, VEC = self.R, self.C, self.VEC
        L_in = self.lanes_in
        UPH = self.units_per_head
        l_in = lane % L_in
        l_out = lane // L_in

        ld_evict, ld_mode = LOAD_HINTS[self.load_hint]
        st_evict, st_mode = STORE_HINTS[self.store_hint]
        ld_atom = cute.make_copy_atom(
            CopyG2ROp(), Float32, num_bits_per_copy=128, l1c_evict_priority=ld_evict, load_cache_mode=ld_mode
        )
        st_atom = cute.make_copy_atom(
            CopyR2GOp(), Float32, num_bits_per_copy=128, l1c_evict_priority=st_evict, store_cache_mode=st_mode
        )

        # this warp's units: warp-sized units stride over all warps, CTA-sized units over all CTAs
        unit0 = bidx
        unit_stride = gdim
        if cutlass.const_expr(self.warps_per_unit == 1):
            unit0 = bidx * self.warps_per_cta + warp
            unit_stride = gdim * self.warps_per_cta
        total = N * HV * UPH

        sRed = None
        if cutlass.const_expr(self.warps_per_unit > 1):
            smem = SmemAllocator()
            # partial o of each warp, double buffered so one barrier per token suffices
            sRed = smem.allocate_tensor(
                Float32, cute.make_layout((self.slice_v, self.warps_per_cta, 2)), byte_alignment=16
            )

        frag_layout = cute.make_layout((VEC, (C, R)), stride=(1, (VEC, VEC * C)))
        tS = cute.make_rmem_tensor(frag_layout, Float32)
        rin_q = cute.make_rmem_tensor(cute.make_layout((VEC, C)), Float32)
        rin = cute.make_rmem_tensor(cute.make_layout((VEC, C)), Float32)  # k (v-first) or v (k-first)
        rout_q = cute.make_rmem_tensor(R, Float32)
        rout = cute.make_rmem_tensor(R, Float32)  # v (v-first) or k (k-first)
        ro_io = cute.make_rmem_tensor(cute.make_layout((VEC, C)), self.io_dtype)
        ro8 = cute.make_rmem_tensor(R, self.io_dtype)
        zero_io = cute.make_rmem_tensor(R, self.io_dtype)
        zero_io.fill(0.0)
        acc = cute.make_rmem_tensor(cute.make_layout((VEC, C)), Float32)
        # loop-carried scalars: the pool row of the current unit (prefetched one unit ahead), the
        # shared-memory buffer parity
        rslot = cute.make_rmem_tensor(1, Int32)
        rpar = cute.make_rmem_tensor(1, Int32)
        rpar[0] = 0
        rslot[0] = -1
        if unit0 < total:
            rslot[0] = mIdx[unit0 // UPH // HV]

        for unit in range(unit0, total, unit_stride):
            slot = rslot[0]
            sub = unit % UPH
            nh = unit // UPH
            hv = nh % HV
            n = nh // HV
            h = hv // (HV // H)
            nxt = unit + unit_stride

            if cutlass.const_expr(self.state_v_first):
                row0 = sub * self.rows_per_unit + l_out * R  # first V row of this lane
                inner0 = l_in * VEC  # first k of this lane
                row_stride = self.K
            else:
                row0 = warp * (self.lanes_out * R) + l_out * R  # first K row of this lane
                if cutlass.const_expr(self.warps_per_unit == 1):
                    row0 = l_out * R
                inner0 = sub * self.slice_v + l_in * VEC  # first v of this lane
                row_stride = self.V

            # a slot past the pool (an unchecked index) is skipped like a padded one: no access outside the pool
            if (slot >= 0) & (slot < mState.shape[0]):
                # 1) every load of the unit, state first, before any of them is used
                gS = self._lane_tile(mState[slot, hv, None, None].iterator, row0, inner0, row_stride)
                cute.copy(ld_atom, gS, tS)
                # accurate exp (once per unit): a ulp of bias here compounds over a long decode
                a = cute.math.exp(-Float32(mDecay[hv]), fastmath=False)
                # 2) the next unit's pool row, so its dependent load never waits for this one
                if nxt < total:
                    rslot[0] = mIdx[nxt // UPH // HV]

                for t in range(T):
                    gO = mOut[n, t, hv, None].iterator
                    pq = mQ[n, t, h, None].iterator
                    pk = mK[n, t, h, None].iterator
                    pv = mV[n, t, hv, None].iterator
                    if cutlass.const_expr(self.state_v_first):
                        self._token_v_first(tS, a, pq, pk, pv, gO, rin_q, rin, rout, ro8, scale, row0, inner0, l_in)
                    else:
                        self._token_k_first(
                            tS, a, pq, pk, pv, gO, rout_q, rout, rin, acc, ro_io, sRed, rpar, scale, row0, inner0,
                            l_in, l_out, warp, tidx, sub,
                        )  # fmt: skip

                cute.copy(st_atom, tS, gS)
            else:
                if nxt < total:
                    rslot[0] = mIdx[nxt // UPH // HV]
                # padded slot: zero output rows, pool row untouched
                for t in range(T):
                    self._zero_token(mOut[n, t, hv, None].iterator, zero_io, ro_io, row0, inner0, l_in, l_out, tidx,
                                     sub)  # fmt: skip

    @cute.jit
    def _token_v_first(self, tS, a, pq, pk, pv, gO, rin_q, rin, rout, ro8, scale, row0, inner0, l_in):
        """One token on a [V, K] state tile (inner = k, rows = v): ``S[v, k] <- a S[v, k] + k_k v_v``, ``o_v =
        sum_k q_k S[v, k]``, each row's dot product summed over the lanes that share it."""
        R, C, VEC = self.R, self.C, self.VEC
        LOG_L_IN = int(math.log2(self.lanes_in))
        self._load_chunks(pq + cute.assume(inner0, divby=VEC), rin_q, scale)
        self._load_chunks(pk + cute.assume(inner0, divby=VEC), rin, Float32(1.0))
        self._load_vec(pv + cute.assume(row0, divby=R), R, rout, Float32(1.0))
        for r in cutlass.range_constexpr(R):
            vr = rout[r]
            o = Float32(0.0)
            for j in cutlass.range_constexpr(C):
                for c in cutlass.range_constexpr(VEC):
                    s = tS[c, (j, r)] * a + rin[c, j] * vr
                    tS[c, (j, r)] = s
                    o = o + rin_q[c, j] * s
            for b in cutlass.range_constexpr(LOG_L_IN):
                o = o + cute.arch.shuffle_sync_bfly(o, offset=1 << b)
            ro8[r] = o.to(self.io_dtype)
        if l_in == 0:
            self._store_vec(gO + cute.assume(row0, divby=R), ro8, R)

    @cute.jit
    def _token_k_first(
        self, tS, a, pq, pk, pv, gO, rout_q, rout, rin, acc, ro_io, sRed, rpar, scale, row0, inner0, l_in, l_out,
        warp, tidx, sub,
    ):  # fmt: skip
        """One token on a [K, V] state tile (inner = v, rows = k): ``S[k, v] <- a S[k, v] + k_k v_v``, ``o_v =
        sum_k q_k S[k, v]`` summed over the lanes of a column, then (units wider than a warp) over the warps
        through the double-buffered shared ``sRed``."""
        R, C, VEC = self.R, self.C, self.VEC
        L_in = self.lanes_in
        LOG_L_OUT = int(math.log2(self.lanes_out))
        self._load_vec(pq + cute.assume(row0, divby=R), R, rout_q, scale)
        self._load_vec(pk + cute.assume(row0, divby=R), R, rout, Float32(1.0))
        self._load_chunks(pv + cute.assume(inner0, divby=VEC), rin, Float32(1.0))
        acc.fill(0.0)
        for r in cutlass.range_constexpr(R):
            kr = rout[r]
            qr = rout_q[r]
            for j in cutlass.range_constexpr(C):
                for c in cutlass.range_constexpr(VEC):
                    s = tS[c, (j, r)] * a + kr * rin[c, j]
                    tS[c, (j, r)] = s
                    acc[c, j] = acc[c, j] + qr * s
        for j in cutlass.range_constexpr(C):
            for c in cutlass.range_constexpr(VEC):
                x = acc[c, j]
                for b in cutlass.range_constexpr(LOG_L_OUT):
                    x = x + cute.arch.shuffle_sync_bfly(x, offset=L_in << b)
                acc[c, j] = x
        if cutlass.const_expr(self.warps_per_unit == 1):
            if l_out == 0:
                ro_io.store(acc.load().to(self.io_dtype))
                self._store_chunks(gO + cute.assume(inner0, divby=VEC), ro_io)
        else:
            par = rpar[0]
            if l_out == 0:
                for j in cutlass.range_constexpr(C):
                    dst = cute.make_tensor(
                        sRed[None, warp, par].iterator + cute.assume(l_in * VEC + j * self.chunk_stride, divby=VEC),
                        cute.make_layout(VEC),
                    )
                    cute.autovec_copy(acc[None, j], dst)
            cute.arch.sync_threads()
            # 16 threads finish 4 values of the 64-wide slice each
            if tidx < self.slice_v // VEC:
                tot = cute.make_rmem_tensor(VEC, Float32)
                tot.fill(0.0)
                part = cute.make_rmem_tensor(VEC, Float32)
                for w in cutlass.range_constexpr(self.warps_per_cta):
                    src = cute.make_tensor(
                        sRed[None, w, par].iterator + cute.assume(tidx * VEC, divby=VEC), cute.make_layout(VEC)
                    )
                    cute.autovec_copy(src, part)
                    tot.store(tot.load() + part.load())
                ro4 = cute.make_rmem_tensor(VEC, self.io_dtype)
                ro4.store(tot.load().to(self.io_dtype))
                self._store_vec(gO + cute.assume(sub * self.slice_v + tidx * VEC, divby=VEC), ro4, VEC)
            rpar[0] = 1 - par

    @cute.jit
    def _zero_token(self, gO, zero_io, ro_io, row0, inner0, l_in, l_out, tidx, sub):
        """A padded slot's token: this lane's part of the output row zeroed (the pool row is not touched)."""
        R, VEC = self.R, self.VEC
        if cutlass.const_expr(self.state_v_first):
            if l_in == 0:
                self._store_vec(gO + cute.assume(row0, divby=R), zero_io, R)
        elif cutlass.const_expr(self.warps_per_unit == 1):
            if l_out == 0:
                ro_io.fill(0.0)
                self._store_chunks(gO + cute.assume(inner0, divby=VEC), ro_io)
        else:
            if tidx < self.slice_v // R:
                off = cute.assume(sub * self.slice_v + tidx * R, divby=R)
                self._store_vec(gO + off, zero_io, R)

    @cute.kernel
    def kernel_cols(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mDecay: cute.Tensor,
        tma_ld: cute.CopyAtom,
        t_ld: cute.Tensor,
        tma_st: cute.CopyAtom,
        t_st: cute.Tensor,
        mIdx: cute.Tensor,
        mOut: cute.Tensor,
        scale: Float32,
    ):
        """cols: one [K, 32 W] state box per CTA (one CTA per box, no grid stride), a column per lane (see __init__).
        Per token and lane: ``S[k, c] <- a S[k, c] + k_k v_c`` and ``o_c = sum_k S[k, c] q_k`` over the column in
        shared memory, q (scaled) and k broadcast from the warp's slot."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        T = mQ.shape[1]
        H = mQ.shape[2]
        HV = mV.shape[2]
        K, TV, W, UPH = self.K, self.tile_v, self.warps_per_cta, self.units_per_head
        KP = K // 32

        smem = SmemAllocator()
        sRaw = smem.allocate_tensor(Float32, cute.make_layout(TV * K), byte_alignment=1024)
        sQK = smem.allocate_tensor(Float32, cute.make_layout((2 * K, W)), byte_alignment=16)  # q * scale, k
        bar = smem.allocate_tensor(cutlass.Int64, cute.make_layout(1), byte_alignment=8).iterator
        sTile = cute.make_tensor(sRaw.iterator, cute.make_layout((TV, K, 1), stride=(1, TV, 0)))

        vb = bidx % UPH
        nh = bidx // UPH
        hv = nh % HV
        n = nh // HV
        h = hv // (HV // H)
        c = vb * TV + 32 * warp + lane  # this lane's column of the state
        slot = mIdx[n]  # one (sequence, head) per CTA: the branch below is CTA-uniform
        box_barrier_init(bar, tidx)
        if slot >= 0:
            box_load(tma_ld, t_ld, sTile, hv, slot, vb, bar, warp, lane, TV, K)
            # accurate exp (once per unit): a ulp of bias here compounds over a long decode
            a = cute.math.exp(-Float32(mDecay[hv]), fastmath=False)
            col = cute.make_tensor(
                sRaw.iterator + cute.assume(32 * warp + lane, divby=1), cute.make_layout(K, stride=TV)
            )
            sW = sQK[None, warp]
            rq = cute.make_rmem_tensor(KP, Float32)
            rk = cute.make_rmem_tensor(KP, Float32)
            q4 = cute.make_rmem_tensor(4, Float32)
            k4 = cute.make_rmem_tensor(4, Float32)
            acc = cute.make_rmem_tensor(4, Float32)
            ro = cute.make_rmem_tensor(1, self.io_dtype)
            k0 = cute.assume(lane * KP, divby=KP)
            for t in range(T):
                # this lane's K / 32 elements of q (scaled) and k into the warp's slot
                self._load_vec(mQ[n, t, h, None].iterator + k0, KP, rq, scale)
                self._load_vec(mK[n, t, h, None].iterator + k0, KP, rk, Float32(1.0))
                cute.autovec_copy(rq, cute.make_tensor(sW.iterator + k0, cute.make_layout(KP)))
                cute.autovec_copy(rk, cute.make_tensor(sW.iterator + K + k0, cute.make_layout(KP)))
                vr = Float32(mV[n, t, hv, c])
                cute.arch.sync_warp()
                if t == 0:
                    cute.arch.mbarrier_wait(bar, 0)
                acc.fill(0.0)
                # runtime loop unrolled by 4: fully unrolled, the slot reads would all be hoisted into registers
                for i in cutlass.range(K // 4, unroll=4):
                    cute.autovec_copy(cute.make_tensor(sW.iterator + cute.assume(4 * i, divby=4), cute.make_layout(4)),
                                      q4)  # fmt: skip
                    cute.autovec_copy(
                        cute.make_tensor(sW.iterator + cute.assume(K + 4 * i, divby=4), cute.make_layout(4)), k4
                    )
                    for e in cutlass.range_constexpr(4):
                        x = col[4 * i + e] * a + k4[e] * vr
                        col[4 * i + e] = x
                        acc[e] = acc[e] + x * q4[e]
                ro[0] = ((acc[0] + acc[1]) + (acc[2] + acc[3])).to(self.io_dtype)
                mOut[n, t, hv, c] = ro[0]
                cute.arch.sync_warp()  # the slot is rewritten by the next token
            box_store(tma_st, t_st, sTile, hv, slot, vb, warp, TV, K)
        else:
            zero = cute.make_rmem_tensor(1, self.io_dtype)
            zero.fill(0.0)
            for t in range(T):
                mOut[n, t, hv, c] = zero[0]

    @cute.jit
    def _store_chunks(self, ptr, src_io):
        """``ptr[c + chunk_stride * j] = src_io[c, j]``: the lane's inner values of one output row."""
        cute.autovec_copy(
            src_io, cute.make_tensor(ptr, cute.make_layout((self.VEC, self.C), stride=(1, self.chunk_stride)))
        )

# ---------------------------------------------------------------------------------------------------- host
def _compile(cfg: LightningDecodeSm90, arch: tuple[int, int]):
    """Trace and compile one variant against fake tensors with symbolic N, T, H, HV, P."""
    N, T, H, HV, P = (cute.sym_int32() for _ in range(5))
    K, V = cfg.K, cfg.V
    row = lambda rank: tuple(range(rank - 1, -1, -1))
    # activations fit int32 offsets (N * T * HV * max(K, V) < 2**31); the pool may not
    mk = lambda dt, shape, align=16: make_fake_compact_tensor(
        dt, shape, stride_order=row(len(shape)), assumed_align=align, use_32bit_stride=True
    )
    q = mk(cfg.io_dtype, (N, T, H, K))
    k = mk(cfg.io_dtype, (N, T, H, K))
    v = mk(cfg.io_dtype, (N, T, HV, V))
    decay = mk(Float32, (HV,), align=4)
    inner = (V, K) if cfg.state_v_first else (K, V)
    # dim-0 stride free (the pool may be a slice of a larger buffer) but 16-byte aligned
    pool_stride = cute.sym_int64(divisibility=4)
    state = make_fake_tensor(
        Float32, (P, HV, *inner), stride=(pool_stride, K * V, inner[1], 1), assumed_align=16
    )
    idx = mk(Int32, (N,), align=4)
    out = mk(cfg.io_dtype, (N, T, HV, V))
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        cfg, q, k, v, decay, state, idx, out, Float32(1.0), Int32(1), stream, options=compile_options(arch)
    )

def _config(key: tuple) -> LightningDecodeSm90:
    (_, io_dtype, K, V, state_v_first, load_hint, store_hint, warps_per_sm, warps_per_cta, state_regs, cols,
     _arch) = key  # fmt: skip
    return LightningDecodeSm90(
        io_dtype=dsl_type(io_dtype),
        K=K,
        V=V,
        state_v_first=state_v_first,
        load_hint=load_hint,
        store_hint=store_hint,
        warps_per_sm=warps_per_sm,
        warps_per_cta=warps_per_cta,
        state_regs=state_regs,
        cols=cols,
    )
