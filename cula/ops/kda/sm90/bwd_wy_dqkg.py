"""KDA chunk backward, the gradients through the state terms and the WY representation on SM90: the host side
(compile keys, launch).

The kernel, ``ChunkKDABwdWyDqkgSm90`` (FLA's ``chunk_kda_bwd_wy_dqkg_fused``, stage 6 of ``chunk_kda_bwd``), and its
description are in ``bwd_wy_dqkg_kernel.py``, imported (with the CuTe DSL) only to compile a variant; see
``cula.ops._host``.
"""

from __future__ import annotations

import torch

from cula.cache import compiled_kernel
from cula.ops._host import check_beta_and_heads, check_tensors, dsl_name, kernel_attr, sm_count

__all__ = ["chunk_kda_bwd_wy_dqkg_sm90", "compiled", "compiled_variant", "variant_key"]

IO_DTYPES = (torch.bfloat16, torch.float16)


def __getattr__(name):
    return kernel_attr(__name__, name)


def variant_key(dtype="BFloat16", beta_dtype="Float32", state_v_first=False, varlen=False, arch=(9, 0),
                raw_qk=False) -> tuple:  # fmt: skip
    """The compile key of a variant; dtypes as DSL types, their names or torch dtypes. ``raw_qk`` is in the key only
    when on (the other keys stay)."""
    return ("kda.bwd_wy_dqkg", "ChunkKDABwdWyDqkgSm90", dsl_name(dtype), dsl_name(beta_dtype), 128, 128, 64,
            bool(state_v_first), bool(varlen), arch, *(("raw_qk",) if raw_qk else ()))  # fmt: skip


def compiled(key: tuple):
    """The compiled variant of ``key`` (see ``cula.cache.compiled_kernel``)."""
    dtype, beta_dtype, _K, _V, _BT, state_v_first, varlen, arch = key[2:10]
    return compiled_kernel(
        key, lambda: kernel_attr(__name__, "_compile")(dtype, beta_dtype, state_v_first, varlen, arch,
                                                        raw_qk="raw_qk" in key[10:])  # fmt: skip
    )


def compiled_variant(**options):
    """``compiled(variant_key(**options))``."""
    return compiled(variant_key(**options))


def chunk_kda_bwd_wy_dqkg_sm90(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, v_new: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A: torch.Tensor, h: torch.Tensor, do: torch.Tensor, dh: torch.Tensor, dv: torch.Tensor, scale: float | None = None,
    state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64,
    chunk_indices: torch.Tensor | None = None, qk_rstd: tuple[torch.Tensor, torch.Tensor] | None = None,
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
        qk_rstd: ``(q_rstd, k_rstd)``, each row's ``1 / sqrt(sum x^2 + 1e-6)`` (``[B, T, H]`` or flat, fp32), with q
            and k the raw ones (before the L2 norm): the kernel normalises what it reads, ``x rstd`` rounded to q's
            dtype as FLA's ``l2norm_fwd`` rounds it. None: q and k as given.
    """
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
    varlen, dev = cu_seqlens is not None, q.device
    # the states' chunk count is the grid's
    cu32, ci, num_chunks, num_seqs = per_chunk_grid(B, T, cu_seqlens, chunk_indices, dev)
    io, f32 = q.dtype, torch.float32
    check_tensors((
        ("k", k, (B, T, H, K), io), ("v", v, (B, T, HV, V), io), ("v_new", v_new, (B, T, HV, V), io),
        ("g", g, (B, T, HV, K), f32), ("beta", beta, (B, T, HV), beta.dtype), ("A", A, (B, T, HV, 64), io),
        ("h", h, (B, num_chunks, HV, K, V), io), ("do", do, (B, T, HV, V), io),
        ("dh", dh, (B, num_chunks, HV, K, V), io), ("dv", dv, (B, T, HV, V), io),
    ))  # fmt: skip
    scale = K**-0.5 if scale is None else float(scale)
    q, k, v, v_new, g, beta, A, h, do, dh, dv = (
        t.contiguous() for t in (q, k, v, v_new, g, beta, A, h, do, dh, dv)
    )  # fmt: skip
    dq = torch.empty(B, T, HV, K, dtype=f32, device=dev)
    dk, dg = torch.empty_like(dq), torch.empty_like(dq)
    dv2 = torch.empty_like(v)
    db = torch.empty(B, T, HV, dtype=f32, device=dev)
    dA = torch.empty(B, T, HV, 64, dtype=f32, device=dev)
    if num_chunks * num_seqs * HV == 0:  # no tokens: nothing to launch
        return dq, dk, dv2, db, dg, dA
    rstd = (None, None)
    if qk_rstd is not None:
        for name, r in zip(("q_rstd", "k_rstd"), qk_rstd):
            if r.dtype != f32 or r.numel() != B * T * H or not r.is_contiguous():
                raise ValueError(f"{name} must be a contiguous fp32 tensor of B*T*H = {B * T * H} elements, got "
                                 f"{tuple(r.shape)} {r.dtype}")  # fmt: skip
        rstd = tuple(r.view(B * T, H) for r in qk_rstd)
    fn = compiled_variant(dtype=dsl_name(io), beta_dtype=dsl_name(beta.dtype), state_v_first=state_v_first,
                          varlen=varlen, raw_qk=qk_rstd is not None)  # fmt: skip

    def flat(t):
        return t.view(B * t.shape[1], *t.shape[2:])

    # the kernel's persistent grid: one CTA an SM (its shared memory allows no more), or one per item
    items = num_chunks * num_seqs * HV
    num_ctas = min(items, sm_count(dev.index or 0)) if dev.type == "cuda" else items
    fn(
        flat(q), flat(k), flat(v), flat(v_new), flat(g), flat(beta), flat(A), flat(h), flat(do), flat(dh),
        flat(dv), flat(dq), flat(dk), flat(dv2), flat(dg), flat(db), flat(dA), cu32, ci, *rstd, scale, T, num_chunks,
        num_seqs, num_ctas,
    )  # fmt: skip
    return dq, dk, dv2, db, dg, dA
