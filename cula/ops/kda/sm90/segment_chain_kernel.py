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

CTA ``(b, h, n)`` owns columns ``8 b .. 8 b + 7`` (value channels) of head h's state of sequence n; thread r owns
state row r (key channel). Per segment the CTA stages R (64 KB) in shared memory, read coalesced in either layout
and padded a word a row (thread r reads row r: no bank conflicts), and the column block stays in shared memory
(every thread reads every row of it: broadcasts).

Thread roles (128 threads, one warpgroup, all alike): stage R, write the start, 128 x 8 FMAs, write the end.

Resources: (128 x 129 + 128 x 8) fp32 = 70.1 KB of shared memory; grid 16 x HV x N. The chain is the only
sequential part of the time-parallel forward: a sequence of m segments costs m steps of one 64 KB read and 1,024
FMAs a thread.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, Int32, const_expr, cute
from cutlass.memory import SmemAllocator

from cula.cache import compile_options
from cula.ops.cute_common import state_view

__all__ = ["SegmentChainSm90"]


class SegmentChainSm90:
    """True start states (and final states) of every time segment from their summaries, sm_90a (see the module
    docstring).

    Static configuration: whether there are initial states to start from, whether final states are written, and the
    state layout. K = V = 128; the numbers of segments, sequences and heads are runtime values.
    """

    arch = 90
    d = 128  # K = V
    cols = 8  # value columns a CTA
    num_threads = 128  # one thread a key row

    def __init__(self, has_h0: bool = False, has_ht: bool = False, state_v_first: bool = False):
        self.has_h0 = has_h0
        self.has_ht = has_ht
        self.state_v_first = state_v_first

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
        D, C = self.d, self.cols
        # every state as (V, K, head, index): element (v, k) of the [K, V] state, whatever the layout
        sum_v, h0_v = state_view(mSummary, self.state_v_first), state_view(mH0, self.state_v_first)
        starts_v, ht_v = state_view(mStarts, self.state_v_first), state_view(mHt, self.state_v_first)

        @cute.struct
        class Storage:
            sR: cute.struct.Align[cute.struct.MemRange[Float32, D * (D + 1)], 128]
            sS: cute.struct.Align[cute.struct.MemRange[Float32, D * C], 128]

        self.storage = Storage
        HV = mStarts.shape[1]
        self.kernel(sum_v, h0_v, starts_v, ht_v, mFirst, HV).launch(
            grid=(D // C, HV, num_seqs), block=(self.num_threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, sum_v: cute.Tensor, h0_v: cute.Tensor, starts_v: cute.Tensor, ht_v: cute.Tensor,
               mFirst: cute.Tensor, HV: Int32):  # fmt: skip
        D, C = self.d, self.cols
        r, _, _ = cute.arch.thread_idx()
        b, h, n = cute.arch.block_idx()
        c0 = b * C
        storage = SmemAllocator().allocate(self.storage)
        # sR[k, j] = R[k, j] (the row a thread reads, padded); sS[j, c] = S[j, c0 + c]
        sR = storage.sR.get_tensor(cute.make_layout((D, D), stride=(D + 1, 1)))
        sS = storage.sS.get_tensor(cute.make_layout((D, C), stride=(C, 1)))
        acc = cute.make_rmem_tensor(C, Float32)

        for c in cutlass.range_constexpr(C):
            if const_expr(self.has_h0):
                sS[r, c] = h0_v[c0 + c, r, h, n]
            else:
                sS[r, c] = Float32(0.0)
        for m in cutlass.range(mFirst[n], mFirst[n + 1], unroll=1):
            self._stage_transition(sR, sum_v, r, HV + h, m)
            for c in cutlass.range_constexpr(C):
                starts_v[c0 + c, r, h, m] = sS[r, c]
                acc[c] = sum_v[c0 + c, r, h, m]  # E
            cute.arch.barrier()  # R staged, every row of S written
            for j in cutlass.range(D, unroll=8):
                rj = sR[r, j]
                for c in cutlass.range_constexpr(C):
                    acc[c] = acc[c] + rj * sS[j, c]
            cute.arch.barrier()  # every read of R and S done
            for c in cutlass.range_constexpr(C):
                sS[r, c] = acc[c]
        if const_expr(self.has_ht):
            for c in cutlass.range_constexpr(C):
                ht_v[c0 + c, r, h, n] = sS[r, c]

    @cute.jit
    def _stage_transition(self, sR: cute.Tensor, sum_v: cute.Tensor, t: Int32, slot: Int32, m: Int32):
        """R of segment ``m`` (summary head ``slot``) into ``sR``, each load instruction reading one contiguous row
        of its memory: element (v, k) of the view is R[k, v], and V is contiguous in the [K, V] layout, K in the
        [V, K] one."""
        for i in cutlass.range_constexpr(self.d):
            if const_expr(self.state_v_first):
                sR[t, i] = sum_v[i, t, slot, m]
            else:
                sR[i, t] = sum_v[t, i, slot, m]


def _compile(has_h0, has_ht, state_v_first, arch=(9, 0), extra_options=""):
    """Trace and compile one variant against fake tensors (no GPU needed). Returns the TVM-FFI callable."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    D = SegmentChainSm90.d
    kernel = SegmentChainSm90(has_h0=has_h0, has_ht=has_ht, state_v_first=state_v_first)

    def state():  # 64-bit outer stride: M * 2 HV * K * V may pass 2^31 elements
        return make_fake_tensor(
            Float32, (cute.sym_int32(), cute.sym_int32(), D, D),
            (cute.sym_int64(divisibility=D * D), D * D, D, 1), assumed_align=16,
        )  # fmt: skip

    first = make_fake_compact_tensor(Int32, (cute.sym_int32(),), stride_order=(0,), assumed_align=4)
    args = (state(), state(), state(), state(), first, Int32(1), make_fake_stream(use_tvm_ffi_env_stream=True))
    return cute.compile(kernel, *args, options=compile_options(arch, extra_options))
