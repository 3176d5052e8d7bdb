"""Lightning's time-parallel prefill, the combine on SM90: every segment's true start state from the segments' end
states, for a constant decay per head.

The first pass (``chunk_fwd_kernel.py``'s states-only variant) gives every segment that feeds a later one its end
state from a zero start, E. With ``lam = exp(-decay[h])`` the transition over a segment of ``L`` tokens is the
scalar ``lam^L``, so along each sequence the starts are a scan, element by element of the state (either layout)::

    S = h0[n] (or 0)
    for each segment m of sequence n:   starts[m] = S;   S = lam^(L_m) S + E[m]   (not after the last one)

``lam^L`` is ``exp2(-decay log2(e) L)`` of the segment's own length: a strong decay underflows to 0, never to
``inf * 0``. A sequence's last segment feeds nothing, so its E is never read (the first pass leaves it unwritten).

CTA ``(b, h, n)`` owns elements ``512 b .. 512 b + 511`` of head h's state of sequence n, thread t four of them (a
16-byte load or store each): ``D^2 / 512`` CTAs a (sequence, head), 128 threads, no shared memory. The scan is the
only sequential part; its loads are what it waits on, so the E of ``depth`` segments are loaded at once before
their updates, and a chain of m segments waits on about ``m / depth`` loads (E was just written: L2 mostly).

Thread roles: one, all alike (128 threads).
"""
from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, Int32, const_expr, cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from cula.cache import compile_options
from cula.ops.cute_common import vec_at

__all__ = ["LightningSegmentChainSm90"]

LOG2E = math.log2(math.e)


class LightningSegmentChainSm90:
    """True start states of every time segment of a scalar-decay split, sm_90a (see the module docstring).

    Static configuration: the head dimension (64 or 128) and whether there are initial states. The numbers of
    segments, sequences and heads are runtime values.
    """

    arch = 90
    num_threads = 128
    vec = 4  # fp32 elements a thread: one 16-byte access
    depth = 4  # segments whose E loads are issued together

    def __init__(self, head_dim: int, has_h0: bool):
        if head_dim not in (64, 128):
            raise ValueError(f"head_dim must be 64 or 128, got {head_dim}")
        self.d = head_dim
        self.has_h0 = has_h0
        self.block = self.num_threads * self.vec  # state elements a CTA

    @cute.jit
    def __call__(
        self,
        mE: cute.Tensor,  # (M, HV, D * D) fp32: segment m's end state from a zero start (feeding segments only)
        mH0: cute.Tensor,  # (N, HV, D * D) fp32, or None without initial states
        mStarts: cute.Tensor,  # (M, HV, D * D) fp32, output
        mBounds: cute.Tensor,  # (M + 1,) int32: segment m is tokens bounds[m] .. bounds[m + 1] - 1
        mFirst: cute.Tensor,  # (N + 1,) int32: sequence n's segments are first[n] .. first[n + 1] - 1
        mDecay: cute.Tensor,  # (HV,) fp32 >= 0: the per-token decay is exp(-decay)
        num_seqs: Int32,
        stream: cuda.CUstream,
    ):
        HV = mStarts.shape[1]
        self.kernel(mE, mH0, mStarts, mBounds, mFirst, mDecay).launch(
            grid=(self.d * self.d // self.block, HV, num_seqs), block=(self.num_threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, mE: cute.Tensor, mH0: cute.Tensor, mStarts: cute.Tensor, mBounds: cute.Tensor,
               mFirst: cute.Tensor, mDecay: cute.Tensor):  # fmt: skip
        V, P = self.vec, self.depth
        t, _, _ = cute.arch.thread_idx()
        b, h, n = cute.arch.block_idx()
        col = cute.assume(b * self.block + t * V, divby=V)
        first, last = mFirst[n], mFirst[n + 1]
        log2_lam = -mDecay[h] * LOG2E
        S = cute.make_rmem_tensor(V, Float32)
        if const_expr(self.has_h0):
            cute.autovec_copy(vec_at(mH0, (n, h, col), V, V), S)
        else:
            S.fill(0.0)
        rE = cute.make_rmem_tensor((V, P), Float32)
        for m0 in cutlass.range(first, last, P, unroll=1):
            # the E of the group's feeding segments (all but the sequence's last), loaded before any update
            for j in cutlass.range_constexpr(P):
                if m0 + j < last - 1:
                    cute.autovec_copy(vec_at(mE, (m0 + j, h, col), V, V), rE[None, j])
            for j in cutlass.range_constexpr(P):
                m = m0 + j
                if m < last:
                    cute.autovec_copy(S, vec_at(mStarts, (m, h, col), V, V))
                    if m < last - 1:
                        lam_L = cute.math.exp2(log2_lam * Float32(mBounds[m + 1] - mBounds[m]), fastmath=True)
                        for e in cutlass.range_constexpr(V):
                            S[e] = lam_L * S[e] + rE[e, j]


def _fake_args(head_dim: int, has_h0: bool) -> tuple:
    """The kernel's arguments as fake tensors (symbolic sizes), for ``cute.compile``."""
    DD = head_dim * head_dim

    def states():  # 64-bit outer stride: M * HV * D * D may pass 2^31 elements
        return make_fake_tensor(
            Float32, (cute.sym_int32(), cute.sym_int32(), DD), (cute.sym_int64(divisibility=DD), DD, 1),
            assumed_align=16,
        )  # fmt: skip

    def ints():
        return make_fake_compact_tensor(Int32, (cute.sym_int32(),), assumed_align=4)

    decay = make_fake_compact_tensor(Float32, (cute.sym_int32(),), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return states(), states() if has_h0 else None, states(), ints(), ints(), decay, Int32(1), stream


def _compile(head_dim: int, has_h0: bool, arch=(9, 0)):
    """Trace and compile one variant against fake tensors (no GPU needed). Returns the TVM-FFI callable
    ``fn(E, h0, starts, bounds, first, decay, num_seqs)`` taking torch tensors (``h0`` None unless ``has_h0``)."""
    kernel = LightningSegmentChainSm90(head_dim, has_h0)
    return cute.compile(kernel, *_fake_args(head_dim, has_h0), options=compile_options(arch))
