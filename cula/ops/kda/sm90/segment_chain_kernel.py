"""KDA time-parallel forward, second pass on SM90: every segment's true start state from the segment summaries.

``segment_summary_kernel.py`` gives every segment its end state from a zero start, E, and its transition R (the
``K x K`` product of its chunks' ``diag(exp2 g_last) - kg^T w``), so that ``S_end = R S_start + E`` in the
``[K, V]`` state's terms (a ``[V, K]`` state is the transpose; the views below make both one case). Along each
sequence the segments chain: the first starts from the caller's initial state (or zero), segment ``j + 1`` from
segment ``j``'s end, and the last one's end is the final state. This kernel walks that chain for every (sequence,
value head, column block) at once, in fp32 (finer than the state kernels' bf16 copies of the state)::

    S = h0[n] (or 0)
    for each segment m of sequence n:   starts[m] = S;   S = R[m] S + E[m]
    final[n] = S

CTA ``(b, h, n)`` owns columns ``C b .. C b + C - 1`` (value channels; ``C`` = ``cols``, 16 or 8) of head h's
state of sequence n; thread t owns state row ``t % 128`` (key channel) of columns ``C / 2 (t // 128) ..`` of them.
The column block stays in shared memory (every thread reads every row of its half: a warp's reads broadcast). R
(64 KB) and the CTA's block of E are staged in shared memory by 16-byte ``cp.async``, two segments deep: segment
m + 1's copies are issued before segment m's products, so the chain waits on a copy only where a segment's 64 C
FMAs a thread take less time than its 64 KB take to arrive. R is copied as it lies in memory (a warp instruction
reads one 512-byte row); in the [K, V] layout a thread then reads its row of R four words at a time (rows padded to
132 words: a quarter-warp's 16-byte reads hit distinct banks), in the [V, K] layout (R^T in memory) its column a
word at a time (a warp's reads are 32 consecutive words). Two threads a row halve the CTAs that each read R against
one thread a row. Eight columns a CTA (``cols=8``) halve each step's products and double the CTAs, each reading all
of R: the host takes them where the doubled grid still fits one wave (few sequences and heads, the long chains of a
time split), 16 elsewhere.

Thread roles (256 threads, two warpgroups, all alike), per segment: issue the next segment's copies, write the
start, wait for this segment's copies, 128 x C / 2 FMAs, write the end.

Resources: (2 x 128 x 132 + 3 x 128 x C) fp32 = 156 KiB (C = 16) or 144 KiB (C = 8) of shared memory (one CTA an
SM); grid 128 / C x HV x N. The chain is the only sequential part of the time-parallel forward: a sequence of m
segments costs m steps of 64 C FMAs a thread, each behind the previous one's end state.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, Int32, const_expr, cute
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from cula.cache import compile_options
from cula.ops.cute_common import state_view, vec_at

__all__ = ["SegmentChainSm90"]


class SegmentChainSm90:
    """True start states (and final states) of every time segment from their summaries, sm_90a (see the module
    docstring).

    Static configuration: whether there are initial states to start from, whether final states are written, the
    state layout and the value columns a CTA (16 or 8). K = V = 128; the numbers of segments, sequences and heads are
    runtime values.
    """

    arch = 90
    d = 128  # K = V
    num_threads = 256
    pad = 4  # words after each staged row of R: rows stay 16-byte aligned, a quarter-warp's row reads conflict-free
    stages = 2  # segments staged at once: the next one's copies in flight during this one's products

    def __init__(self, has_h0: bool = False, has_ht: bool = False, state_v_first: bool = False, cols: int = 16):
        if cols not in (8, 16):
            raise ValueError(f"cols must be 8 or 16, got {cols}")
        self.has_h0 = has_h0
        self.has_ht = has_ht
        self.state_v_first = state_v_first
        self.cols = cols  # value columns a CTA
        self.thread_cols = cols // 2  # value columns a thread: two threads a key row

    @cute.jit
    def __call__(
        self,
        mSummary: cute.Tensor,  # (M, 2 HV, K, V) or (M, 2 HV, V, K) fp32: E of head h at h, R at HV + h
        mH0: cute.Tensor,  # (N, HV, K, V) or (N, HV, V, K) fp32; unread unless has_h0
        mStarts: cute.Tensor,  # (M, HV, K, V) or (M, HV, V, K) fp32, output
        mHt: cute.Tensor,  # (N, HV, K, V) or (N, HV, V, K) fp32, output; unwritten unless has_ht
        mFirst: cute.Tensor,  # (N + 1,) int32: sequence n's segments are first[n] .. first[n + 1] - 1
        num_seqs: Int32,
        stream: cuda.CUstream,
    ):
        # every state as (V, K, head, index): element (v, k) of the [K, V] state, whatever the layout
        sum_v, h0_v = state_view(mSummary, self.state_v_first), state_view(mH0, self.state_v_first)
        starts_v, ht_v = state_view(mStarts, self.state_v_first), state_view(mHt, self.state_v_first)
        D, C = self.d, self.cols

        @cute.struct
        class Storage:
            sR: cute.struct.Align[cute.struct.MemRange[Float32, self.stages * D * (D + self.pad)], 128]
            sS: cute.struct.Align[cute.struct.MemRange[Float32, D * C], 128]
            sE: cute.struct.Align[cute.struct.MemRange[Float32, self.stages * D * C], 128]

        self.storage = Storage
        HV = mStarts.shape[1]
        self.kernel(mSummary, sum_v, h0_v, starts_v, ht_v, mFirst, HV).launch(
            grid=(D // C, HV, num_seqs), block=(self.num_threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, mSummary: cute.Tensor, sum_v: cute.Tensor, h0_v: cute.Tensor, starts_v: cute.Tensor,
               ht_v: cute.Tensor, mFirst: cute.Tensor, HV: Int32):  # fmt: skip
        D, C, TC, P, S = self.d, self.cols, self.thread_cols, self.pad, self.stages
        t, _, _ = cute.arch.thread_idx()
        b, h, n = cute.arch.block_idx()
        # thread t: key row r, the CTA's columns tc .. tc + TC - 1 (a warp's threads share tc: its reads of S broadcast)
        r = t % D
        tc = cute.assume((t // D) * TC, divby=TC)
        c0 = b * C
        storage = SmemAllocator().allocate(self.storage)
        # sR[i, j, s]: row i of R as it lies in memory (R's row i in the [K, V] layout, R^T's in the [V, K] one);
        # sE[k, c, s] = E[k, c0 + c]; sS[j, c] = S[j, c0 + c]
        sR = storage.sR.get_tensor(cute.make_layout((D, D, S), stride=(D + P, 1, D * (D + P))))
        sE = storage.sE.get_tensor(cute.make_layout((D, C, S), stride=(C, 1, D * C)))
        sS = storage.sS.get_tensor(cute.make_layout((D, C), stride=(C, 1)))
        acc = cute.make_rmem_tensor(TC, Float32)
        first, last = mFirst[n], mFirst[n + 1]

        if first < last:
            self._stage_segment(mSummary, sum_v, sR, sE, t, r, tc, h, HV, c0, first, 0)
        cute.arch.cp_async_commit_group()
        for c in cutlass.range_constexpr(TC):
            if const_expr(self.has_h0):
                sS[r, tc + c] = h0_v[c0 + tc + c, r, h, n]
            else:
                sS[r, tc + c] = Float32(0.0)
        for m in cutlass.range(first, last, unroll=1):
            s = (m - first) % S
            if m + 1 < last:
                self._stage_segment(mSummary, sum_v, sR, sE, t, r, tc, h, HV, c0, m + 1, (m + 1 - first) % S)
            cute.arch.cp_async_commit_group()  # (empty past the last segment: the wait below counts groups)
            for c in cutlass.range_constexpr(TC):
                starts_v[c0 + tc + c, r, h, m] = sS[r, tc + c]
            cute.arch.cp_async_wait_group(S - 1)  # this thread's copies of segment m have landed
            cute.arch.barrier()  # everyone's copies of segment m landed, every row of S written
            for c in cutlass.range_constexpr(TC):
                acc[c] = sE[r, tc + c, s]
            self._transition_times_block(sR, sS, acc, r, tc, s)
            cute.arch.barrier()  # every read of S and of stage s done
            for c in cutlass.range_constexpr(TC):
                sS[r, tc + c] = acc[c]
        if const_expr(self.has_ht):
            for c in cutlass.range_constexpr(TC):
                ht_v[c0 + tc + c, r, h, n] = sS[r, tc + c]

    @cute.jit
    def _stage_segment(self, mSummary: cute.Tensor, sum_v: cute.Tensor, sR: cute.Tensor, sE: cute.Tensor, t: Int32,
                       r: Int32, tc: Int32, h: Int32, HV: Int32, c0: Int32, m: Int32, s: Int32):  # fmt: skip
        """Issue the copies of segment ``m``'s R (summary head ``HV + h``, as it lies in memory) and of the CTA's
        block of its E (head ``h``) into stage ``s``: thread t copies 16-byte unit ``t % 32`` of rows ``t // 32``,
        ``t // 32 + 8``, ..., and its own columns of E's row r."""
        D, TC = self.d, self.thread_cols
        rows_per_pass = self.num_threads // 32
        wide = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=128)
        col = cute.assume((t % 32) * 4, divby=4)
        for i in cutlass.range_constexpr(D // rows_per_pass):
            row = t // 32 + rows_per_pass * i
            cute.copy(wide, vec_at(mSummary, (m, HV + h, row, col), 4, 4), vec_at(sR, (row, col, s), 4, 4))
        if const_expr(self.state_v_first):  # E[r, c] is word r of memory row c: a word a copy
            narrow = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
            for c in cutlass.range_constexpr(TC):
                cute.copy(narrow, vec_at(sum_v, (c0 + tc + c, r, h, m), 1, 1), vec_at(sE, (r, tc + c, s), 1, 1))
        else:  # E[r, c0 + tc .. c0 + tc + TC - 1] is contiguous
            for c in cutlass.range_constexpr(0, TC, 4):
                cute.copy(wide, vec_at(sum_v, (c0 + tc + c, r, h, m), 4, 4), vec_at(sE, (r, tc + c, s), 4, 4))

    @cute.jit
    def _transition_times_block(self, sR: cute.Tensor, sS: cute.Tensor, acc: cute.Tensor, r: Int32, tc: Int32,
                                s: Int32):  # fmt: skip
        """``acc += R[r, :] S[:, tc .. tc + TC - 1]`` from stage ``s``: R's row r read four words at a time in the
        [K, V] layout, a word at a time (column r of R^T) in the [V, K] one; each row of S's columns as TC / 4 16-byte
        broadcasts."""
        D, TC = self.d, self.thread_cols
        rS = cute.make_rmem_tensor(TC, Float32)
        rR = cute.make_rmem_tensor(4, Float32)
        for j4 in cutlass.range(0, D, 4, unroll=2):
            if const_expr(self.state_v_first):
                for e in cutlass.range_constexpr(4):
                    rR[e] = sR[j4 + e, r, s]
            else:
                cute.autovec_copy(vec_at(sR, (r, j4, s), 4, 4), rR)
            for e in cutlass.range_constexpr(4):
                cute.autovec_copy(vec_at(sS, (j4 + e, tc), TC, TC), rS)
                for c in cutlass.range_constexpr(TC):
                    acc[c] = acc[c] + rR[e] * rS[c]


def _compile(has_h0, has_ht, state_v_first, cols=16, arch=(9, 0), extra_options=""):
    """Trace and compile one variant against fake tensors (no GPU needed). Returns the TVM-FFI callable."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    D = SegmentChainSm90.d
    kernel = SegmentChainSm90(has_h0=has_h0, has_ht=has_ht, state_v_first=state_v_first, cols=cols)

    def state():  # 64-bit outer stride: M * 2 HV * K * V may pass 2^31 elements
        return make_fake_tensor(
            Float32, (cute.sym_int32(), cute.sym_int32(), D, D),
            (cute.sym_int64(divisibility=D * D), D * D, D, 1), assumed_align=16,
        )  # fmt: skip

    first = make_fake_compact_tensor(Int32, (cute.sym_int32(),), stride_order=(0,), assumed_align=4)
    args = (state(), state(), state(), state(), first, Int32(1), make_fake_stream(use_tvm_ffi_env_stream=True))
    return cute.compile(kernel, *args, options=compile_options(arch, extra_options))
