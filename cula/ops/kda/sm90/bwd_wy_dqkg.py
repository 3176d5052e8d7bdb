"""KDA chunk backward, the gradients through the state terms and the WY representation on SM90: the host side
(compile keys, launch).

The kernel, ``ChunkKDABwdWyDqkgSm90`` (FLA's ``chunk_kda_bwd_wy_dqkg_fused``, stage 6 of ``chunk_kda_bwd``, and with
its ``intra`` option stage 7 after it in the same launch), and its description are in ``bwd_wy_dqkg_kernel.py``,
imported (with the CuTe DSL) only to compile a variant; see ``cula.ops._host``.
"""

from __future__ import annotations

import torch

from cula.cache import compiled_kernel
from cula.ops._host import check_beta_and_heads, check_tensors, dsl_name, kernel_attr, placeholder, sm_count

__all__ = ["chunk_kda_bwd_wy_dqkg_sm90", "chunk_kda_bwd_wy_intra_sm90", "compiled", "compiled_variant", "variant_key"]

IO_DTYPES = (torch.bfloat16, torch.float16)


def __getattr__(name):
    return kernel_attr(__name__, name)


def variant_key(dtype="BFloat16", beta_dtype="Float32", state_v_first=False, varlen=False, intra=None,
                arch=(9, 0)) -> tuple:  # fmt: skip
    """The compile key of a variant; dtypes as DSL types, their names or torch dtypes. ``intra``: the fused stage
    7's options as a dict of ``ChunkKDABwdIntraSm90``'s keywords (``reverse_cumsum``, ``l2norm``, ``gate``,
    ``g_raw_dtype``, ``has_a_log``, ``has_dt_bias``), or None for stage 6 alone."""
    fused = None
    if intra is not None:
        gate = intra.get("gate")
        fused = (bool(intra.get("reverse_cumsum", False)), bool(intra.get("l2norm", False)), gate)
        if gate is not None:
            fused += (dsl_name(intra.get("g_raw_dtype", "Float32")), bool(intra.get("has_a_log", True)),
                      bool(intra.get("has_dt_bias", True)))  # fmt: skip
    return ("kda.bwd_wy_dqkg", "ChunkKDABwdWyDqkgSm90", dsl_name(dtype), dsl_name(beta_dtype), 128, 128, 64,
            bool(state_v_first), bool(varlen), fused, arch)  # fmt: skip


def compiled(key: tuple):
    """The compiled variant of ``key`` (see ``cula.cache.compiled_kernel``)."""
    dtype, beta_dtype, _K, _V, _BT, state_v_first, varlen, fused, arch = key[2:]
    intra = None
    if fused is not None:
        names = ("reverse_cumsum", "l2norm", "gate", "g_raw_dtype", "has_a_log", "has_dt_bias")
        intra = dict(zip(names, fused))
    return compiled_kernel(
        key, lambda: kernel_attr(__name__, "_compile")(dtype, beta_dtype, state_v_first, varlen, arch, intra=intra)
    )


def compiled_variant(**options):
    """``compiled(variant_key(**options))``."""
    return compiled(variant_key(**options))


def chunk_kda_bwd_wy_dqkg_sm90(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, v_new: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A: torch.Tensor, h: torch.Tensor, do: torch.Tensor, dh: torch.Tensor, dv: torch.Tensor, scale: float | None = None,
    state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64,
    chunk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """FLA's ``chunk_kda_bwd_wy_dqkg_fused(q, k, v, v_new, g, beta, A, h, do, dh, dv, ...)`` on SM90: the same
    arguments and returns ``(dq, dk, dv2, db, dg, dA)`` (dq, dk, dg ``[B, T, HV, 128]``, db ``[B, T, HV]``, dA
    ``[B, T, HV, 64]`` fp32; dv2 in v's dtype); contract: ``cula.kda.naive_bwd.chunk_kda_bwd_wy_dqkg_reference``.

    Args:
        q, k: ``[B, T, H, 128]`` (after the L2 norm).  v, v_new, do, dv: ``[B, T, HV, 128]``; dv is the gradient of
            v_new.  g: ``[B, T, HV, 128]`` fp32, the chunk-local log2 gate cumsum.  beta: ``[B, T, HV]`` fp32 / bf16 /
            fp16.  A: ``[B, T, HV, 64]``, the chunks' ``(I + L)^-1`` by rows.  h, dh: ``[B, NT, HV, 128, 128]`` per
            chunk (``[V, K]`` with ``state_v_first``; NT the chunk-list length when packed). q, k, v, v_new, do, dv,
            A, h and dh share one dtype, bf16 or fp16.
        scale: defaults to ``K ** -0.5``.  cu_seqlens: ``[N + 1]`` int32 / int64 with ``B == 1``; ``chunk_indices``:
            ``[NT, 2]`` (sequence, chunk) as FLA's ``prepare_chunk_indices`` (built from ``cu_seqlens`` when absent,
            a host sync).
    """
    run = _Launch(q, k, v, v_new, g, beta, A, h, do, dh, dv, scale, state_v_first, cu_seqlens, chunk_size,
                  chunk_indices)  # fmt: skip
    dA = torch.empty(run.B, run.T, run.HV, 64, dtype=torch.float32, device=q.device)
    if run.empty:
        return run.dq, run.dk, run.dv2, run.db, run.dg, dA
    stand_in = placeholder(q.device, torch.float32, (1,))
    run.launch(dA, (stand_in,) * 11 + (0.0,))
    return run.dq, run.dk, run.dv2, run.db, run.dg, dA


def chunk_kda_bwd_wy_intra_sm90(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, v_new: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A: torch.Tensor, h: torch.Tensor, do: torch.Tensor, dh: torch.Tensor, dv: torch.Tensor, dAqk: torch.Tensor,
    scale: float | None = None, state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64, chunk_indices: torch.Tensor | None = None, reverse_cumsum_dg: bool = False,
    qk_rstd: tuple[torch.Tensor, torch.Tensor] | None = None, gate: tuple | None = None,
) -> tuple[torch.Tensor, tuple]:  # fmt: skip
    """Stages 6 and 7 of FLA's ``chunk_kda_bwd`` in one launch: ``chunk_kda_bwd_wy_dqkg_sm90`` with these arguments,
    then ``chunk_kda_bwd_intra_sm90(q, k, g, beta, dAqk, dA, dq, dk, db, dg, cu_seqlens, chunk_indices,
    reverse_cumsum_dg=..., qk_rstd=..., gate=...)`` on its results, the same bits as the two launches (dA, stage 6's
    dAkk, stays on chip). Returns ``(dv2, stage 7's returns)``: ``(dq, dk, db, dg)``, or with ``gate`` ``(dq, dk,
    db, dg_raw, dA_log, ddt_bias)``. ``dAqk``: ``[B, T, HV, 64]`` fp32 (FLA's stage 4); the rest as the two
    functions take them."""
    from cula.ops.kda.sm90.bwd_intra import fused_inputs, gate_sums

    run = _Launch(q, k, v, v_new, g, beta, A, h, do, dh, dv, scale, state_v_first, cu_seqlens, chunk_size,
                  chunk_indices)  # fmt: skip
    B, T, HV = run.B, run.T, run.HV
    check_tensors((("dAqk", dAqk, (B, T, HV, 64), torch.float32),))
    fused = fused_inputs(q, g, qk_rstd, gate, reverse_cumsum_dg)
    # the outputs of stage 7's fused neighbours (an output that is off: a tensor of its shape the kernel does not
    # write); dq, dk, dg are stage 6's and stage 7 adds to them in place
    dq_n, dk_n = (torch.empty_like(q), torch.empty_like(k)) if qk_rstd is not None else (q, k)
    dg_raw = torch.empty_like(fused["g_raw"]) if gate is not None else fused["g_raw"]
    a_part, bias_part = run.db.view(B * T, HV), run.dg.view(B * T, HV, 128)
    if gate is not None:
        rows = run.num_chunks * run.num_seqs
        if gate[1] is not None:
            a_part = torch.empty(rows, HV, dtype=torch.float32, device=q.device)
        if gate[2] is not None:
            bias_part = torch.empty(rows, HV, 128, dtype=torch.float32, device=q.device)
    if not run.empty:
        dAqk = dAqk.contiguous()
        intra = dict(reverse_cumsum=reverse_cumsum_dg, l2norm=qk_rstd is not None,
                     gate=None if gate is None else "lower_bound", g_raw_dtype=dsl_name(fused["g_raw"].dtype),
                     has_a_log=gate is not None and gate[1] is not None,
                     has_dt_bias=gate is not None and gate[2] is not None)  # fmt: skip
        flat = run.flat
        # dA is not written: dAqk (same shape and dtype) stands in for it
        run.launch(dAqk, (
            flat(dAqk), fused["q_rstd"], fused["k_rstd"], flat(dq_n), flat(dk_n), flat(fused["g_raw"]),
            fused["A_log"], fused["dt_bias"], flat(dg_raw), a_part, bias_part, fused["lower_bound"],
        ), intra)  # fmt: skip
    dq = dq_n if qk_rstd is not None else run.dq
    dk = dk_n if qk_rstd is not None else run.dk
    if gate is None:
        return run.dv2, (dq, dk, run.db, run.dg)
    return run.dv2, (dq, dk, run.db, dg_raw, *gate_sums(gate, a_part, bias_part))


class _Launch:
    """One launch of the kernel: the stage-6 arguments checked and made contiguous, its outputs allocated
    (``dq, dk, dg, db`` fp32, ``dv2``), the grid; ``launch(dA, fused, intra)`` runs it."""

    def __init__(self, q, k, v, v_new, g, beta, A, h, do, dh, dv, scale, state_v_first, cu_seqlens, chunk_size,
                 chunk_indices):  # fmt: skip
        from cula.ops.kda.sm90.intra import per_chunk_grid

        if chunk_size != 64:
            raise ValueError(f"chunk_size must be 64, got {chunk_size}")
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[-1]
        if K != 128 or V != 128:
            raise ValueError(f"only K = V = 128 is supported, got K={K}, V={V}")
        if q.dtype not in IO_DTYPES:
            raise ValueError(f"q must be bf16 or fp16, got {q.dtype}")
        check_beta_and_heads(beta, H, HV)
        dev = q.device
        # the states' chunk count is the grid's
        cu32, ci, num_chunks, num_seqs = per_chunk_grid(B, T, cu_seqlens, chunk_indices, dev)
        io, f32 = q.dtype, torch.float32
        check_tensors((
            ("k", k, (B, T, H, K), io), ("v", v, (B, T, HV, V), io), ("v_new", v_new, (B, T, HV, V), io),
            ("g", g, (B, T, HV, K), f32), ("beta", beta, (B, T, HV), beta.dtype), ("A", A, (B, T, HV, 64), io),
            ("h", h, (B, num_chunks, HV, K, V), io), ("do", do, (B, T, HV, V), io),
            ("dh", dh, (B, num_chunks, HV, K, V), io), ("dv", dv, (B, T, HV, V), io),
        ))  # fmt: skip
        self.B, self.T, self.HV, self.num_chunks, self.num_seqs = B, T, HV, num_chunks, num_seqs
        self.scale = K**-0.5 if scale is None else float(scale)
        self.inputs = tuple(t.contiguous() for t in (q, k, v, v_new, g, beta, A, h, do, dh, dv))
        self.cu32, self.ci, self.state_v_first, self.varlen = cu32, ci, state_v_first, cu_seqlens is not None
        self.dq = torch.empty(B, T, HV, K, dtype=f32, device=dev)
        self.dk, self.dg = torch.empty_like(self.dq), torch.empty_like(self.dq)
        self.dv2 = torch.empty_like(v)
        self.db = torch.empty(B, T, HV, dtype=f32, device=dev)
        self.items = num_chunks * num_seqs * HV
        self.empty = self.items == 0  # no tokens: nothing to launch

    def flat(self, t):
        return t.view(t.shape[0] * t.shape[1], *t.shape[2:])

    def launch(self, dA, fused: tuple, intra: dict | None = None):
        q = self.inputs[0]
        beta = self.inputs[5]
        fn = compiled_variant(dtype=dsl_name(q.dtype), beta_dtype=dsl_name(beta.dtype),
                              state_v_first=self.state_v_first, varlen=self.varlen, intra=intra)  # fmt: skip
        dev = q.device
        # the kernel's persistent grid: one CTA an SM (its shared memory allows no more), or one per item
        num_ctas = min(self.items, sm_count(dev.index or 0)) if dev.type == "cuda" else self.items
        flat = self.flat
        fn(
            *(flat(t) for t in self.inputs), flat(self.dq), flat(self.dk), flat(self.dv2), flat(self.dg),
            flat(self.db), flat(dA), self.cu32, self.ci, self.scale, self.T, self.num_chunks, self.num_seqs,
            num_ctas, *fused,
        )  # fmt: skip
