"""KDA chunk backward, the gradients through the intra-chunk scores on SM90: the host side (compile keys, launch).

The kernel, ``ChunkKDABwdIntraSm90`` (FLA's ``chunk_kda_bwd_intra``, stage 7 of ``chunk_kda_bwd``), and its
description are in ``bwd_intra_kernel.py``, imported (with the CuTe DSL) only to compile a variant; see
``cula.ops._host``.
"""

from __future__ import annotations

import torch

from cula.cache import compiled_kernel
from cula.ops._host import check_beta_and_heads, check_tensors, dsl_name, kernel_attr, placeholder

__all__ = ["chunk_kda_bwd_intra_sm90", "compiled", "compiled_variant", "variant_key"]

IO_DTYPES = (torch.bfloat16, torch.float16)


def __getattr__(name):
    return kernel_attr(__name__, name)


def variant_key(dtype="BFloat16", beta_dtype="Float32", varlen=False, reverse_cumsum=False, l2norm=False, gate=None,
                g_raw_dtype="Float32", has_a_log=True, has_dt_bias=True, any_gate=False, raw_qk=False,
                arch=(9, 0)) -> tuple:  # fmt: skip
    """The compile key of a variant; dtypes as DSL types, their names or torch dtypes. The gate's options are
    normalised away without ``gate``; ``any_gate`` and ``raw_qk`` are in the key only when on (the other keys
    stay)."""
    fused = (bool(l2norm), gate) + ((dsl_name(g_raw_dtype), bool(has_a_log), bool(has_dt_bias)) if gate else ())
    return ("kda.bwd_intra", "ChunkKDABwdIntraSm90", dsl_name(dtype), dsl_name(beta_dtype), 128, 64, bool(varlen),
            bool(reverse_cumsum), fused, arch, *(("any_gate",) if any_gate else ()),
            *(("raw_qk",) if raw_qk else ()))  # fmt: skip


def compiled(key: tuple):
    """The compiled variant of ``key`` (see ``cula.cache.compiled_kernel``)."""
    dtype, beta_dtype, _K, _BT, varlen, reverse_cumsum, fused, arch = key[2:10]
    l2norm, gate = fused[:2]
    gate_options = dict(zip(("g_raw_dtype", "has_a_log", "has_dt_bias"), fused[2:]))
    return compiled_kernel(
        key, lambda: kernel_attr(__name__, "_compile")(
            dtype, beta_dtype, varlen, arch, reverse_cumsum=reverse_cumsum, l2norm=l2norm, gate=gate,
            any_gate="any_gate" in key[10:], raw_qk="raw_qk" in key[10:], **gate_options,
        ),
    )  # fmt: skip


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
    qk_rstd: tuple[torch.Tensor, torch.Tensor] | None = None,
    gate: tuple | None = None,
    in_place: bool = False,
    any_gate: bool = False,
    raw_qk: bool = False,
) -> tuple[torch.Tensor, ...]:
    """FLA's ``chunk_kda_bwd_intra(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, ...)`` on SM90: the same arguments
    and returns ``(dq, dk, db, dg)``, new fp32 tensors (contract: ``cula.kda.naive_bwd.chunk_kda_bwd_intra_reference``;
    exact while no 8 steps of one channel's gate decay by more than 2^100, see the kernel's docstring). With
    ``reverse_cumsum_dg`` dg comes back as FLA's next stage makes it, ``chunk_local_cumsum(dg, reverse=True)``.
    ``any_gate``: exact for any gate (the kernel's any_gate variant: a tile whose gates break that bound makes its
    diagonal blocks element by element).

    Two later stages of FLA's backward can run in the same launch (see the kernel's docstring):

    - ``qk_rstd = (q_rstd, k_rstd)``: FLA's ``l2norm_bwd(q, q_rstd, dq)`` and ``l2norm_bwd(k, k_rstd, dk)`` (q and k
      are then the normalised ones, the rstd ``[B, T, H]`` or flat fp32 as ``l2norm_fwd`` returns them): dq and dk
      come back as the raw q's and k's gradients, in q's dtype. Needs ``HV == H``. With ``raw_qk`` q and k are the
      raw ones (before the norm): the kernel normalises each row as it loads it, ``x q_rstd`` rounded to q's dtype as
      ``l2norm_fwd`` rounds it, so that no ``l2norm_fwd`` runs before.
    - ``gate = (g_raw, A_log, dt_bias, lower_bound)``: FLA's ``kda_gate_bwd(g_raw, A_log, dt_bias, dyg,
      lower_bound)`` after the reverse cumsum (so it needs ``reverse_cumsum_dg``), the sigmoid gate with a lower
      bound, or with ``lower_bound`` None the softplus gate; ``g_raw`` ``[B, T, HV, 128]`` fp32 / bf16 / fp16,
      ``A_log`` ``[HV]`` and ``dt_bias`` ``[HV * 128]`` fp32 or None. Returns ``(dq, dk, db, dg_raw, dA_log,
      ddt_bias)`` then: dg_raw in g_raw's dtype, dA_log / ddt_bias as FLA's (summed over the chunks in a fixed
      order; None where the parameter is).

    Args:
        q, k: ``[B, T, H, 128]`` bf16 / fp16 (after the L2 norm).  g: ``[B, T, HV, 128]`` fp32, the chunk-local log2
            gate cumsum.  beta: ``[B, T, HV]`` fp32 / bf16 / fp16.
        dAqk, dAkk: ``[B, T, HV, 64]`` fp32.  dq, dk, dg: ``[B, T, HV, 128]`` fp32; db: ``[B, T, HV]`` fp32: the
            accumulations to add to (not modified, unless ``in_place``).
        in_place: the sums go into dq, dk, dg and db themselves, which come back as outputs; where a fused
            neighbour returns its own (``qk_rstd``: dq and dk in q's dtype; ``gate``: dg_raw), dq is left as it was
            and dk / dg are overwritten as scratch. Four fewer output buffers, for a caller that drops the inputs
            (the training backward: at B = 2, T = 16384, H = 64 they were 2 GiB of its peak).
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
    check_beta_and_heads(beta, H, HV)
    f32 = torch.float32
    check_tensors((
        ("k", k, (B, T, H, K), q.dtype), ("g", g, (B, T, HV, K), f32), ("beta", beta, (B, T, HV), beta.dtype),
        ("dAqk", dAqk, (B, T, HV, 64), f32), ("dAkk", dAkk, (B, T, HV, 64), f32), ("dq", dq, (B, T, HV, K), f32),
        ("dk", dk, (B, T, HV, K), f32), ("dg", dg, (B, T, HV, K), f32), ("db", db, (B, T, HV), f32),
    ))  # fmt: skip
    q, k, g, beta, dAqk, dAkk, dq, dk, db, dg = (
        t.contiguous() for t in (q, k, g, beta, dAqk, dAkk, dq, dk, db, dg)
    )  # fmt: skip
    if raw_qk and qk_rstd is None:
        raise ValueError("raw_qk normalises q and k with qk_rstd: pass it")
    fused = _fused_inputs(q, g, qk_rstd, gate, reverse_cumsum_dg)
    # with the L2 norm's backward the kernel writes dq only in q's dtype (dq_n below): dq stands in for its fp32 output.
    # In place, each thread reads an element of dq / dk / dg / db before it writes that element and no other thread
    # reads it (phase D's dg stores come after a CTA barrier), so the outputs can be the inputs
    dq2 = torch.empty_like(dq) if qk_rstd is None and not in_place else dq
    dk2, dg2, db2 = (dk, dg, db) if in_place else (torch.empty_like(dk), torch.empty_like(dg), torch.empty_like(db))
    varlen = cu_seqlens is not None
    cu32, ci, num_chunks, num_seqs = per_chunk_grid(B, T, cu_seqlens, chunk_indices, q.device)
    # the outputs of the fused stages: dq / dk in q's dtype, dg_raw and the per-chunk partial sums of the gate's
    # parameters (a row per grid chunk: padding rows of a packed list write zeros)
    # (an output that is off is a tensor of its shape and dtype that the kernel does not write)
    dq_n, dk_n = (torch.empty_like(q), torch.empty_like(k)) if qk_rstd is not None else (q, k)
    dg_raw = torch.empty_like(fused["g_raw"]) if gate is not None else fused["g_raw"]
    a_part, bias_part = db2.view(B * T, HV), dg2.view(B * T, HV, K)
    if gate is not None:
        rows = num_chunks * num_seqs
        if gate[1] is not None:
            a_part = torch.empty(rows, HV, dtype=torch.float32, device=q.device)
        if gate[2] is not None:
            bias_part = torch.empty(rows, HV, K, dtype=torch.float32, device=q.device)
    if num_chunks * num_seqs * HV > 0:
        fn = compiled_variant(
            dtype=dsl_name(q.dtype), beta_dtype=dsl_name(beta.dtype), varlen=varlen, reverse_cumsum=reverse_cumsum_dg,
            l2norm=qk_rstd is not None, gate=None if gate is None else fused["gate"],
            g_raw_dtype=dsl_name(fused["g_raw"].dtype), has_a_log=gate is not None and gate[1] is not None,
            has_dt_bias=gate is not None and gate[2] is not None, any_gate=any_gate, raw_qk=raw_qk,
        )  # fmt: skip

        def flat(t):
            return t.view(B * T, *t.shape[2:])

        fn(
            flat(q), flat(k), flat(g), flat(beta), flat(dAqk), flat(dAkk), flat(dq), flat(dk), flat(dg), flat(db),
            flat(dq2), flat(dk2), flat(dg2), flat(db2), cu32, ci, fused["q_rstd"], fused["k_rstd"], flat(dq_n),
            flat(dk_n), flat(fused["g_raw"]), fused["A_log"], fused["dt_bias"], flat(dg_raw), a_part, bias_part,
            fused["lower_bound"], T, num_chunks, num_seqs,
        )  # fmt: skip
    if qk_rstd is not None:
        dq2, dk2 = dq_n, dk_n
    if gate is None:
        return dq2, dk2, db2, dg2
    # FLA's kda_gate_bwd sums its per-block partials the same way (in the parameters' dtypes)
    _, A_log, dt_bias, _ = gate
    dA = a_part.sum(0).view_as(A_log).type_as(A_log) if A_log is not None else None
    dbias = bias_part.sum(0).view(-1).to(dt_bias) if dt_bias is not None else None
    return dq2, dk2, db2, dg_raw, dA, dbias


def _fused_inputs(q, g, qk_rstd, gate, reverse_cumsum_dg) -> dict:
    """The fused stages' inputs, checked, as the kernel takes them (flat rstd; placeholders for what is off)."""
    B, T, H, K = q.shape
    HV = g.shape[2]
    f32 = torch.float32
    stand_in = placeholder(q.device, f32, (1,))
    out = {"q_rstd": placeholder(q.device, f32, (1, H)), "k_rstd": placeholder(q.device, f32, (1, H)), "g_raw": g,
           "A_log": stand_in, "dt_bias": stand_in, "lower_bound": 0.0}  # fmt: skip
    if qk_rstd is not None:
        if HV != H:
            raise ValueError(f"the L2 norm's backward in the kernel needs HV == H (got HV={HV}, H={H}): with GVA the "
                             "value heads' dq / dk are summed first")  # fmt: skip
        for name, r in zip(("q_rstd", "k_rstd"), qk_rstd):
            if r.dtype != f32 or r.numel() != B * T * H or not r.is_contiguous():
                raise ValueError(f"{name} must be a contiguous fp32 tensor of B*T*H = {B * T * H} elements, got "
                                 f"{tuple(r.shape)} {r.dtype}")  # fmt: skip
            out[name] = r.view(B * T, H)
    if gate is not None:
        g_raw, A_log, dt_bias, lower_bound = gate
        if not reverse_cumsum_dg:
            raise ValueError("the gate's backward runs after dg's reverse cumsum: gate needs reverse_cumsum_dg=True")
        if g_raw.dtype not in (f32, torch.bfloat16, torch.float16):
            raise ValueError(f"g_raw must be fp32, bf16 or fp16, got {g_raw.dtype}")
        check_tensors((("g_raw", g_raw, (B, T, HV, K), g_raw.dtype),))
        out["g_raw"], out["lower_bound"] = g_raw.contiguous(), 0.0 if lower_bound is None else float(lower_bound)
        out["gate"] = "softplus" if lower_bound is None else "lower_bound"
        for name, p, n in (("A_log", A_log, HV), ("dt_bias", dt_bias, HV * K)):
            if p is None:
                continue
            if p.dtype != f32 or p.numel() != n:
                raise ValueError(f"{name} must be fp32 with {n} elements, got {tuple(p.shape)} {p.dtype}")
            out[name] = p.contiguous().view(n)
    return out
