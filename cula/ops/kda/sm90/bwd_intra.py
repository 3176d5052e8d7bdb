"""KDA chunk backward, the gradients through the intra-chunk scores on SM90: the host side (compile keys, launch).

The kernel, ``ChunkKDABwdIntraSm90`` (FLA's ``chunk_kda_bwd_intra``, stage 7 of ``chunk_kda_bwd``), and its
description are in ``bwd_intra_kernel.py``, imported (with the CuTe DSL) only to compile a variant; see
``cula.ops._host``.
"""

from __future__ import annotations

import torch

from cula.cache import compiled_kernel
from cula.ops._host import check_tensors, dsl_name, kernel_attr

__all__ = ["chunk_kda_bwd_intra_sm90", "compiled", "compiled_variant", "variant_key"]

IO_DTYPES = (torch.bfloat16, torch.float16)
BETA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def __getattr__(name):
    return kernel_attr(__name__, name)


def variant_key(dtype="BFloat16", beta_dtype="Float32", varlen=False, reverse_cumsum=False, arch=(9, 0)) -> tuple:
    """The compile key of a variant; dtypes as DSL types, their names or torch dtypes."""
    return ("kda.bwd_intra", "ChunkKDABwdIntraSm90", dsl_name(dtype), dsl_name(beta_dtype), 128, 64, bool(varlen),
            bool(reverse_cumsum), arch)  # fmt: skip


def compiled(key: tuple):
    """The compiled variant of ``key`` (see ``cula.cache.compiled_kernel``)."""
    dtype, beta_dtype, _K, _BT, varlen, reverse_cumsum, arch = key[2:]
    return compiled_kernel(
        key, lambda: kernel_attr(__name__, "_compile")(dtype, beta_dtype, varlen, arch, reverse_cumsum=reverse_cumsum)
    )


def compiled_variant(**options):
    """``compiled(variant_key(**options))``."""
    return compiled(variant_key(**options))


def chunk_kda_bwd_intra_sm90(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    dAqk: torch.Tensor,
    dAkk: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    db: torch.Tensor,
    dg: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_size: int = 64,
    reverse_cumsum_dg: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FLA's ``chunk_kda_bwd_intra(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, ...)`` on SM90: the same arguments
    and returns ``(dq, dk, db, dg)``, new fp32 tensors (contract: ``cula.kda.naive_bwd.chunk_kda_bwd_intra_reference``;
    exact while no 8 steps of one channel's gate decay by more than 2^100, see the kernel's docstring). With
    ``reverse_cumsum_dg`` dg comes back as FLA's next stage makes it, ``chunk_local_cumsum(dg, reverse=True)``.

    Args:
        q, k: ``[B, T, H, 128]`` bf16 / fp16 (after the L2 norm).  g: ``[B, T, HV, 128]`` fp32, the chunk-local log2
            gate cumsum.  beta: ``[B, T, HV]`` fp32 / bf16 / fp16.
        dAqk, dAkk: ``[B, T, HV, 64]`` fp32.  dq, dk, dg: ``[B, T, HV, 128]`` fp32; db: ``[B, T, HV]`` fp32: the
            accumulations to add to (not modified).
        cu_seqlens: ``[N + 1]`` int32 / int64 with ``B == 1``; ``chunk_indices``: ``[NT, 2]`` (sequence, chunk) as
            FLA's ``prepare_chunk_indices`` (any int dtype; built from ``cu_seqlens`` when absent, a host sync).
    """
    from cula.ops.kda.sm90.intra import per_chunk_grid

    if chunk_size != 64:
        raise ValueError(f"chunk_size must be 64, got {chunk_size}")
    B, T, H, K = q.shape
    HV = g.shape[2]
    if K != 128:
        raise ValueError(f"only K = 128 is supported, got K={K}")
    if q.dtype not in IO_DTYPES or k.dtype != q.dtype:
        raise ValueError(f"q and k must both be bf16 or fp16, got {q.dtype} and {k.dtype}")
    if beta.dtype not in BETA_DTYPES:
        raise ValueError(f"beta must be fp32, bf16 or fp16, got {beta.dtype}")
    if H == 0 or HV % H:
        raise ValueError(f"the value heads ({HV}) must be a multiple of the q/k heads ({H})")
    f32 = torch.float32
    check_tensors((
        ("k", k, (B, T, H, K), q.dtype), ("g", g, (B, T, HV, K), f32), ("beta", beta, (B, T, HV), beta.dtype),
        ("dAqk", dAqk, (B, T, HV, 64), f32), ("dAkk", dAkk, (B, T, HV, 64), f32), ("dq", dq, (B, T, HV, K), f32),
        ("dk", dk, (B, T, HV, K), f32), ("dg", dg, (B, T, HV, K), f32), ("db", db, (B, T, HV), f32),
    ))  # fmt: skip
    q, k, g, beta, dAqk, dAkk, dq, dk, db, dg = (
        t.contiguous() for t in (q, k, g, beta, dAqk, dAkk, dq, dk, db, dg)
    )  # fmt: skip
    dq2, dk2, dg2, db2 = torch.empty_like(dq), torch.empty_like(dk), torch.empty_like(dg), torch.empty_like(db)
    varlen = cu_seqlens is not None
    cu32, ci, num_chunks, num_seqs = per_chunk_grid(B, T, cu_seqlens, chunk_indices, q.device)
    if num_chunks * num_seqs * HV == 0:  # no tokens: nothing to launch
        return dq2, dk2, db2, dg2
    fn = compiled_variant(dtype=dsl_name(q.dtype), beta_dtype=dsl_name(beta.dtype), varlen=varlen,
                          reverse_cumsum=reverse_cumsum_dg)  # fmt: skip

    def flat(t):
        return t.view(B * T, *t.shape[2:])

    fn(
        flat(q), flat(k), flat(g), flat(beta), flat(dAqk), flat(dAkk), flat(dq), flat(dk), flat(dg), flat(db),
        flat(dq2), flat(dk2), flat(dg2), flat(db2), cu32, ci, T, num_chunks, num_seqs,
    )  # fmt: skip
    return dq2, dk2, db2, dg2
