"""One host call for a repeated fixed-length ``chunk_kda``: the intra kernel, then the state/output kernel.

``chunk_fwd.prepare_chunk_kda_fwd_sm90`` binds a call signature once; its launch used to make two TVM-FFI calls
(one per compiled kernel, ~7 us of host time each on the H200's host), flat ``[B T, heads, D]`` torch views of
every input (~1 us each) and one buffer per intermediate (~3 us each). ``ChunkKDAFwdSm90`` is one ``@cute.jit``
host function instead: it takes the call's tensors in their own shapes, flattens them as layouts, carves the
intermediates out of one workspace, and launches both kernels, so a call costs one TVM-FFI call, no views and
three allocations (the workspace, o, the final state). The kernels are the same objects as the two-call path's,
so their code, and the results, are the same bits.

Workspace: allocated as ``[B T HV, WORK_COLS]`` of q's dtype (its size: 1,664 bytes per token and value head),
used as consecutive row-major regions of ``B T HV`` rows each: w, u, qg, kg (128 elements a row), Aqk (64),
then g_cum (128 fp32). Every region starts at a multiple of 16 bytes, as the TMA descriptors need.

Gated DeltaNet (one gate per token and value head, the intra kernel's ``row_factors``): g ``(B, T, HV)`` and
dt_bias ``(HV,)``; the intra kernel writes per-token factor rows instead of qg, kg and g_cum, and the state/output
kernel applies them to the raw q and k (docs/kernels/kda-state-output.md). Its workspace is ``[B T HV,
ROW_WORK_COLS]``: w, u (128), Aqk (64), then the factors (``ROW_FACTORS`` fp32), 656 bytes per token and head.
With ``wy_in_recurrence`` as well (the intra kernel writes T diag(beta), the state/output kernel makes v_new from it
and the raw v), ``[B T HV, WY_WORK_COLS]``: T diag(beta) (64), Aqk (64), then the factors, 272 bytes.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
from cutlass import Float32, Int32, Int64, const_expr, cute

from cula.cache import compile_options
from cula.ops._host import ROW_FACTORS, dsl_type
from cula.ops.kda.sm90.delta_h_fwd_o_kernel import DeltaHFwdOFusedSm90
from cula.ops.kda.sm90.fwd_launch import BT, DK, DV, work_cols
from cula.ops.kda.sm90.intra_kernel import ChunkKDAIntraFwdSm90

__all__ = ["ChunkKDAFwdSm90", "ChunkKDAVarlenFwdSm90"]


class ChunkKDAFwdSm90:
    """``chunk_kda``'s forward for fixed-length inputs, both stages in one host function (sm_90a)."""

    def __init__(self, intra: ChunkKDAIntraFwdSm90, states: DeltaHFwdOFusedSm90):
        if intra.row_factors != states.row_factors or intra.wy_in_recurrence != states.wy_in_recurrence:
            raise ValueError("the intra and state/output kernels take row factors (and wy_in_recurrence) together "
                             "or not at all")
        self.intra, self.states = intra, states
        self.dtype = intra.dtype

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, T, H, K)  dtype
        mK: cute.Tensor,  # (B, T, H, K)  dtype
        mV: cute.Tensor,  # (B, T, HV, V) dtype
        mGin: cute.Tensor,  # (B, T, HV, K) raw gate; (B, T, HV) with row factors
        mBeta: cute.Tensor,  # (B, T, HV)
        mAlog: cute.Tensor,  # (HV,) fp32
        mBias: cute.Tensor,  # (HV * K,) fp32; (HV,) with row factors
        mWork: cute.Tensor,  # (B T HV, work_cols(intra options)) dtype, scratch
        mO: cute.Tensor,  # (B, T, HV, V) dtype, out
        mH0: cute.Tensor,  # (B, HV, K, V) or (B, HV, V, K) fp32; unread unless has_initial_state
        mHt: cute.Tensor,  # same layout; unwritten unless has_final_state
        mCu: cute.Tensor,  # (2,) int32 placeholder: both kernels take a cu_seqlens they do not read here
        scale: Float32,
        lower_bound: Float32,
        stream: cuda.CUstream,
    ):
        self._stages(mQ, mK, mV, mGin, mBeta, mAlog, mBias, mWork, mO, mH0, mHt, mCu, None, scale, lower_bound, stream)

    @cute.jit
    def _stages(
        self, mQ, mK, mV, mGin, mBeta, mAlog, mBias, mWork, mO, mH0, mHt, mCu, mCi, scale: Float32,
        lower_bound: Float32, stream: cuda.CUstream,
    ):  # fmt: skip
        """Both kernels on the call's tensors; ``mCi`` (the chunk indices) None for fixed-length inputs."""
        num_seqs, seqlen, hv = mQ.shape[0], mQ.shape[1], mV.shape[2]
        tokens = num_seqs * seqlen
        # contiguous inputs (the bound launch's condition): token b*T + t sits at b*T*stride_t + t*stride_t
        q, k, v, o = (self._flat(x, tokens) for x in (mQ, mK, mV, mO))
        beta = self._per_head(mBeta, tokens)
        if const_expr(mCi is None):  # the kernels' unread chunk indices
            mCi = cute.make_tensor(mCu.iterator, cute.make_layout((1, 2), stride=(2, 1)))
        rows = Int64(tokens) * Int64(hv)

        # fixed length: a grid of chunks x HV x B for intra, HV x B for the state kernel; packed sequences: one
        # intra CTA per chunk index row (x HV), HV x N state CTAs
        if const_expr(self.intra.varlen):
            num_chunks, intra_seqs, state_seqs = mCi.shape[0], 1, mCu.shape[0] - 1
        else:
            num_chunks, intra_seqs, state_seqs = (seqlen + (BT - 1)) // BT, num_seqs, num_seqs
        if const_expr(self.intra.row_factors):
            # the state/output kernel reads the raw q and k (H heads) with the factor rows in place of qg, kg, g_cum;
            # with wy_in_recurrence T diag(beta) in place of w and u, which it reads with the raw v
            w = u = t_beta = None
            if const_expr(self.intra.wy_in_recurrence):
                t_beta, col = self._region(mWork, rows, 0, tokens, hv, BT, self.dtype), BT
            else:
                w, col = self._region(mWork, rows, 0, tokens, hv, DK, self.dtype), 2 * DK
                u = self._region(mWork, rows, DK, tokens, hv, DV, self.dtype)
            aqk = self._region(mWork, rows, col, tokens, hv, BT, self.dtype)
            factors = self._region(mWork, rows, col + BT, tokens, hv, ROW_FACTORS, Float32)
            self.intra(
                q, k, v, self._per_head(mGin, tokens), beta, mAlog, mBias, w, u, factors, None, aqk, t_beta, None,
                None, mCu, mCi, seqlen, num_chunks, intra_seqs, scale, lower_bound, stream,
            )  # fmt: skip
            if const_expr(self.intra.wy_in_recurrence):
                w, u = t_beta, v
            self.states(w, u, k, q, factors, aqk, o, mH0, mHt, mCu, seqlen, state_seqs, scale, stream)
        else:
            w = self._region(mWork, rows, 0, tokens, hv, DK, self.dtype)
            u = self._region(mWork, rows, DK, tokens, hv, DV, self.dtype)
            qg = self._region(mWork, rows, 2 * DK, tokens, hv, DK, self.dtype)
            kg = self._region(mWork, rows, 3 * DK, tokens, hv, DK, self.dtype)
            aqk = self._region(mWork, rows, 4 * DK, tokens, hv, BT, self.dtype)
            g_cum = self._region(mWork, rows, 4 * DK + BT, tokens, hv, DK, Float32)
            bias = cute.make_tensor(mBias.iterator, cute.make_layout((hv, DK), stride=(DK, 1)))
            self.intra(
                q, k, v, self._flat(mGin, tokens), beta, mAlog, bias, w, u, qg, kg, aqk, None, g_cum, None, mCu,
                mCi, seqlen, num_chunks, intra_seqs, scale, lower_bound, stream,
            )  # fmt: skip
            self.states(w, u, kg, qg, g_cum, aqk, o, mH0, mHt, mCu, seqlen, state_seqs, scale, stream)

    @cute.jit
    def _flat(self, x: cute.Tensor, tokens: Int32) -> cute.Tensor:
        """(B, T, heads, D) -> (B T, heads, D), with T's stride as the token stride."""
        return cute.make_tensor(
            x.iterator, cute.make_layout((tokens, x.shape[2], x.shape[3]), stride=(x.stride[1], x.stride[2], 1))
        )

    @cute.jit
    def _per_head(self, x: cute.Tensor, tokens: Int32) -> cute.Tensor:
        """(B, T, HV) -> (B T, HV): beta, and Gated DeltaNet's gate."""
        return cute.make_tensor(x.iterator, cute.make_layout((tokens, x.shape[2]), stride=(x.stride[1], 1)))

    @cute.jit
    def _region(self, mWork: cute.Tensor, rows: Int64, col: int, tokens: Int32, hv: Int32, d: int, dtype):
        """The workspace region that starts at column ``col`` (in two-byte elements) as a (B T, HV, d) tensor of
        ``dtype``: rows x col elements in, row-major."""
        start = mWork.iterator.toint() + rows * Int64(col * 2)
        ptr = cute.make_ptr(dtype, start, cute.AddressSpace.gmem, assumed_align=16)
        stride = cute.assume(Int64(hv) * Int64(d), divby=d)
        return cute.make_tensor(ptr, cute.make_layout((tokens, hv, d), stride=(stride, d, 1)))


class ChunkKDAVarlenFwdSm90(ChunkKDAFwdSm90):
    """The same for packed sequences (B = 1, ``cu_seqlens``): intra CTAs per chunk of ``chunk_indices``, state
    CTAs per (value head, sequence)."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (1, T, H, K)  dtype
        mK: cute.Tensor,  # (1, T, H, K)  dtype
        mV: cute.Tensor,  # (1, T, HV, V) dtype
        mGin: cute.Tensor,  # (1, T, HV, K) raw gate; (1, T, HV) with row factors
        mBeta: cute.Tensor,  # (1, T, HV)
        mAlog: cute.Tensor,  # (HV,) fp32
        mBias: cute.Tensor,  # (HV * K,) fp32; (HV,) with row factors
        mWork: cute.Tensor,  # (T HV, work_cols(intra options)) dtype, scratch
        mO: cute.Tensor,  # (1, T, HV, V) dtype, out
        mH0: cute.Tensor,  # (N, HV, K, V) or (N, HV, V, K) fp32; unread unless has_initial_state
        mHt: cute.Tensor,  # same layout; unwritten unless has_final_state
        mCu: cute.Tensor,  # (N + 1,) int32 cu_seqlens
        mCi: cute.Tensor,  # (NT, 2) int32 (sequence, chunk within it) of every chunk
        scale: Float32,
        lower_bound: Float32,
        stream: cuda.CUstream,
    ):
        self._stages(mQ, mK, mV, mGin, mBeta, mAlog, mBias, mWork, mO, mH0, mHt, mCu, mCi, scale, lower_bound, stream)

def _compile(intra_options: dict, state_options: dict, arch=(9, 0), extra_options: str = "", varlen: bool = False):
    """Trace and compile one variant against fake tensors (no GPU needed). Returns the TVM-FFI callable.

    ``intra_options`` / ``state_options``: the keyword arguments of ``ChunkKDAIntraFwdSm90`` and
    ``DeltaHFwdOFusedSm90`` (dtype, has_initial_state, has_final_state, state_v_first, aqk_causal, row_factors) but
    varlen, which ``varlen`` sets for both (``ChunkKDAVarlenFwdSm90``)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    def typed(options):  # dtypes may come as names (the host side's spelling)
        return {k: dsl_type(v) if k.endswith("dtype") else v for k, v in options.items()}

    intra = ChunkKDAIntraFwdSm90(varlen=varlen, **typed(intra_options))
    states = DeltaHFwdOFusedSm90(
        head_k=DK, head_v=DV, chunk_size=BT, num_stages=3, varlen=varlen, **typed(state_options)
    )  # fmt: skip
    dt, g_dt, beta_dt = intra.dtype, intra.g_dtype, intra.beta_dtype
    b, t, h, hv = (cute.sym_int32() for _ in range(4))

    def tok(dtype, heads, d):
        # 64-bit batch / token strides: B T HV D may pass 2^31 elements
        return make_fake_tensor(
            dtype, (b, t, heads, d), (cute.sym_int64(divisibility=d), cute.sym_int64(divisibility=d), d, 1),
            assumed_align=16,
        )  # fmt: skip

    inner = (DV, DK) if states.state_v_first else (DK, DV)

    def state():
        # sizes of their own: without an initial / final state the launch passes a [1, 1, ...] placeholder
        return make_fake_tensor(
            Float32, (cute.sym_int32(), cute.sym_int32(), *inner),
            (cute.sym_int64(divisibility=DK * DV), DK * DV, inner[1], 1), assumed_align=16,
        )  # fmt: skip

    def per_head(dtype):
        return make_fake_tensor(dtype, (b, t, hv), (cute.sym_int64(), cute.sym_int64(), 1),
                                assumed_align=dtype.width // 8)

    cols = work_cols(intra_options)
    args = (
        tok(dt, h, DK), tok(dt, h, DK), tok(dt, hv, DV), per_head(g_dt) if intra.row_factors else tok(g_dt, hv, DK),
        per_head(beta_dt), make_fake_compact_tensor(Float32, (hv,), stride_order=(0,), assumed_align=4),
        make_fake_compact_tensor(Float32, (cute.sym_int32(),), stride_order=(0,), assumed_align=4 if intra.row_factors
                                 else 16),
        make_fake_tensor(dt, (cute.sym_int32(), cols), (cols, 1), assumed_align=16),
        tok(dt, hv, DV), state(), state(),
        make_fake_compact_tensor(Int32, (cute.sym_int32() if varlen else 2,), stride_order=(0,), assumed_align=4),
    )  # fmt: skip
    if varlen:  # the chunk indices
        args += (make_fake_tensor(Int32, (cute.sym_int32(), 2), (2, 1), assumed_align=8),)
    args += (Float32(1.0), Float32(-5.0), make_fake_stream(use_tvm_ffi_env_stream=True))
    launcher = (ChunkKDAVarlenFwdSm90 if varlen else ChunkKDAFwdSm90)(intra, states)
    return cute.compile(launcher, *args, options=compile_options(arch, extra_options))
