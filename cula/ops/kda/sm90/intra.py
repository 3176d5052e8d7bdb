"""KDA chunk forward, intra-chunk stage on SM90: the host side (compile keys, launch).

The kernel, ``ChunkKDAIntraFwdSm90``, and its description are in ``intra_kernel.py``, imported (with the CuTe DSL)
only to compile a variant; see ``cula.ops._host``.
"""

from __future__ import annotations

import torch

from cula.cache import compiled_kernel
from cula.ops._host import GATES, ROW_FACTORS, TORCH_TO_DSL, check_tensors, dsl_name, kernel_attr, placeholder

__all__ = [
    "BETA_ACTS", "GATES", "chunk_kda_intra_sm90", "chunk_offsets_i32", "compiled", "compiled_variant", "kernel_options",
    "prepare_chunk_indices_i32", "variant_key",
]  # fmt: skip

BETA_ACTS = ("none", "sigmoid", "sigmoid2")  # sigmoid2 = 2 sigmoid (FLA's allow_neg_eigval)


def __getattr__(name):
    return kernel_attr(__name__, name)


def variant_key(
    dtype="BFloat16", g_dtype="Float32", beta_dtype="BFloat16", gate="none", varlen=False, arch=(9, 0), **options
) -> tuple:  # fmt: skip
    """The compile key of a variant; ``options`` as ``_compile``'s; dtypes as DSL types, their names or torch
    dtypes."""
    return ("kda.intra", "ChunkKDAIntraFwdSm90", dsl_name(dtype), dsl_name(g_dtype), dsl_name(beta_dtype), gate,
            varlen, arch, *sorted(options.items()))  # fmt: skip


def compiled(key: tuple):
    """The compiled variant of ``key`` (see ``cula.cache.compiled_kernel``)."""
    dtype, g_dtype, beta_dtype, gate, varlen, arch = key[2:8]
    options = dict(key[8:])
    return compiled_kernel(
        key, lambda: kernel_attr(__name__, "_compile")(dtype, g_dtype, beta_dtype, gate, varlen, arch, **options)
    )


def compiled_variant(**options):
    """``compiled(variant_key(**options))``."""
    return compiled(variant_key(**options))


def beta_act_for(beta_sigmoid: bool, allow_neg_eigval: bool) -> str:
    """The kernel's beta activation for FLA's flags (``2 sigmoid`` with ``allow_neg_eigval``)."""
    return ("sigmoid2" if allow_neg_eigval else "sigmoid") if beta_sigmoid else "none"


def gate_params(
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, gate: str, HV: int, K: int, device: torch.device,
    *, per_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A_log [HV], dt_bias [HV, K])`` fp32 as the kernel reads them, FLA's defaults where absent (``per_head``:
    one gate per token and head, dt_bias ``[HV]``)."""
    if A_log is None:
        # FLA: softplus uses exp(1) when A_log is absent, sigmoid uses 1 = exp(0)
        A_log = placeholder(device, torch.float32, (HV,), 1.0 if gate == "softplus" else 0.0)
    bias_shape = (HV,) if per_head else (HV, K)
    if dt_bias is None:
        dt_bias = placeholder(device, torch.float32, bias_shape)
    A_log = A_log.reshape(HV).to(torch.float32).contiguous()
    return A_log, dt_bias.reshape(bias_shape).to(torch.float32).contiguous()


def gate_params_binder(
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, gate: str, HV: int, K: int, device: torch.device,
    *, flat_bias: bool = False, per_head: bool = False,
):
    """``gate_params`` for every later call whose A_log / dt_bias have these shapes, strides and dtypes, as a
    function ``(A_log, dt_bias) -> (A_log [HV], dt_bias [HV, K])`` (``[HV * K]`` with ``flat_bias``, as
    ``fwd_launch`` takes it; ``[HV]`` with ``per_head``): absent ones are bound to their placeholders once,
    contiguous fp32 ones pass through (as they are where their shape is already the kernel's, else as one view)
    instead of three conversions each."""
    bias_shape = (HV,) if per_head else (HV * K,) if flat_bias else (HV, K)
    fp32_dense = lambda t: t.dtype == torch.float32 and t.is_contiguous()  # noqa: E731
    if (A_log is not None and not fp32_dense(A_log)) or (dt_bias is not None and not fp32_dense(dt_bias)):

        def converted(a, b):
            a, b = gate_params(a, b, gate, HV, K, device, per_head=per_head)
            return a, b.view(bias_shape)

        return converted
    # the placeholders where absent
    a_fixed, b_fixed = gate_params(A_log, dt_bias, gate, HV, K, device, per_head=per_head)
    b_fixed = b_fixed.view(bias_shape)
    a_as_is = A_log is None or tuple(A_log.shape) == (HV,)
    b_as_is = dt_bias is None or tuple(dt_bias.shape) == bias_shape
    take_a = (lambda a: a_fixed) if A_log is None else (lambda a: a) if a_as_is else (lambda a: a.view(HV))
    take_b = (lambda b: b_fixed) if dt_bias is None else (lambda b: b) if b_as_is else (lambda b: b.view(bias_shape))
    return lambda a, b: (take_a(a), take_b(b))


def kernel_options(
    dtype: torch.dtype, g_dtype: torch.dtype, beta_dtype: torch.dtype, gate: str, use_qk_l2norm: bool, beta_act: str,
    *, g_cum_last_only: bool = False, write_akk: bool = False, scalar_gate: bool = False, given_t: bool = False,
    any_gate: bool = False, write_rstd: bool = False, row_factors: bool = False, wy_in_recurrence: bool = False,
) -> dict:  # fmt: skip
    """``ChunkKDAIntraFwdSm90``'s options but varlen for torch dtypes and the launch flags (``compiled_variant``,
    ``fwd_launch`` and ``chunk_fwd``'s time-segmented launch take them). ``any_gate`` is dropped where the kernel
    makes no per-channel scores (``given_t`` reads T, ``scalar_gate`` is exact for any gate): the variant a call with
    any gate then takes."""
    return dict(
        dtype=TORCH_TO_DSL[dtype], g_dtype=TORCH_TO_DSL[g_dtype], beta_dtype=TORCH_TO_DSL[beta_dtype],
        gate=gate, l2norm_qk=bool(use_qk_l2norm), beta_act=beta_act, g_cum_last_only=bool(g_cum_last_only),
        # absent when off: the compile keys of the other variants stay
        **({"write_akk": True} if write_akk else {}), **({"scalar_gate": True} if scalar_gate else {}),
        **({"given_t": True} if given_t else {}), **({"write_rstd": True} if write_rstd else {}),
        **({"row_factors": True} if row_factors else {}),
        **({"wy_in_recurrence": True} if wy_in_recurrence else {}),
        **({"any_gate": True} if any_gate and not (given_t or scalar_gate) else {}),
    )  # fmt: skip


def prepare_chunk_indices_i32(
    cu_seqlens: torch.Tensor, chunk_size: int = 64, cu_seqlens_cpu: torch.Tensor | None = None
) -> torch.Tensor:
    """``[NT, 2]`` int32 (sequence id, chunk id within the sequence), FLA's ``prepare_chunk_indices`` order, on
    ``cu_seqlens``' device.

    Reads the lengths from ``cu_seqlens_cpu`` when given (then nothing waits for the GPU), else from ``cu_seqlens``
    (one device sync)."""
    host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()
    bounds = host.tolist()
    # From pinned memory the copy to the GPU is queued like a kernel. From pageable memory torch waits for the
    # stream to drain first, so every packed call through a plan would have waited for the previous call's kernels
    # (H200, kda_prefill's varlen rows: +6-12%, host and GPU time adding up instead of overlapping).
    pin = cu_seqlens.is_cuda
    if bounds[-1] // chunk_size + len(bounds) <= 2048:
        # a Python list for the calls whose host time shows (torch's CPU ops cost ~10 us each on the device host)
        flat = []
        for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
            for c in range(-(-(end - start) // chunk_size)):
                flat += (n, c)
        rows = torch.tensor(flat, dtype=torch.int32, pin_memory=pin).view(-1, 2)
    else:  # torch's CPU ops, whose cost does not grow with the chunk count
        counts = (host[1:].long() - host[:-1].long() + (chunk_size - 1)) // chunk_size
        seq = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        rows = torch.stack([seq, torch.arange(seq.numel()) - first], 1).to(torch.int32)
        rows = rows.pin_memory() if pin else rows
    return rows.to(cu_seqlens.device, non_blocking=True)


def chunk_offsets_i32(cu32: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
    """``[N + 1]`` int32 on ``cu32``'s device: each packed sequence's first chunk in a list of every sequence's
    chunks (FLA's ``prepare_chunk_offsets``), the last entry their total; no host read."""
    counts = (cu32[1:] - cu32[:-1] + (chunk_size - 1)) // chunk_size
    return torch.cat([cu32.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


def per_chunk_grid(B: int, T: int, cu_seqlens: torch.Tensor | None, chunk_indices: torch.Tensor | None,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:  # fmt: skip
    """``(cu_seqlens int32, chunk list int32 [NT, 2], grid x, grid z)`` of a kernel with one CTA per 64-token chunk:
    packed, the chunk list (built from ``cu_seqlens`` when not given, a host sync) and ``(NT, 1)``; fixed-length,
    placeholders the kernel does not read and ``(chunks per sequence, B)``."""
    if cu_seqlens is None:
        return placeholder(device, torch.int32, (2,)), placeholder(device, torch.int32, (1, 2)), -(-T // 64), B
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1, got {B}")
    cu32 = cu_seqlens.to(torch.int32).contiguous()
    if chunk_indices is None:
        chunk_indices = prepare_chunk_indices_i32(cu32)
    ci = chunk_indices.to(torch.int32).contiguous()
    return cu32, ci, ci.shape[0], 1


def chunk_kda_intra_sm90(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    w: torch.Tensor,
    u: torch.Tensor,
    qg: torch.Tensor | None,
    kg: torch.Tensor | None,
    Aqk: torch.Tensor | None,
    g_cum: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    *,
    gate: str,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    chunk_size: int = 64,
    use_qk_l2norm: bool = False,
    beta_sigmoid: bool = False,
    allow_neg_eigval: bool = False,
    g_cum_last_only: bool = False,
    Akk: torch.Tensor | None = None,
    given_akk: torch.Tensor | None = None,
    any_gate: bool = False,
    qk_rstd: torch.Tensor | None = None,
    row_factors: torch.Tensor | None = None,
    t_beta: torch.Tensor | None = None,
) -> None:
    """KDA intra-chunk forward on SM90; writes ``w, u, qg, kg, Aqk, g_cum`` (and ``Akk``; or ``t_beta``) in place.

    Args:
        q, k: ``[B, T, H, K]`` bf16/fp16, L2-normalised, or raw with ``use_qk_l2norm``.
        v: ``[B, T, HV, V]`` same dtype; HV a multiple of H.
        g: ``[B, T, HV, K]`` fp32/bf16/fp16: log-space gate (``gate="none"``) or the raw gate logits; ``[B, T,
            HV]``: one gate per token and head (Gated DeltaNet), exact for any gate (the kernel's scalar_gate).
        beta: ``[B, T, HV]`` bf16/fp16/fp32, post-sigmoid, or logits with ``beta_sigmoid``.
        scale: query scale; folded into Aqk (not into qg), as in FLA.
        w, qg, kg: ``[B, T, HV, K]`` q's dtype, out: ``(I + Akk)^-1 bf16(beta k exp2(g_cum))``,
            ``q exp2(g_cum)``, ``k exp2(g_cum[last] - g_cum)``.
        u: ``[B, T, HV, V]`` q's dtype, out: ``(I + Akk)^-1 bf16(beta v)``.
        Aqk: ``[B, T, HV, 64]`` q's dtype, out: ``scale (q k^T o exp2(g_t - g_s))`` for ``s <= t`` of the
            token's own chunk, 0 above the diagonal.
        g_cum: ``[B, T, HV, K]`` fp32, out: chunk-local inclusive cumsum of the activated gate times 1/ln 2.
        cu_seqlens: ``[N + 1]`` int32 (int64 is converted) with ``B == 1``, or None.
        chunk_indices: ``[NT, 2]`` (sequence, chunk) as FLA's ``prepare_chunk_indices`` (any int dtype);
            computed here (one host sync) when None and ``cu_seqlens`` is given.
        gate: ``"none"`` (g is already log space), ``"softplus"`` (``-exp(A_log) softplus(g + dt_bias)``) or
            ``"lower_bound"`` (``lower_bound sigmoid(exp(A_log) (g + dt_bias))``), FLA's ``kda_gate_chunk_cumsum``.
        A_log: ``[HV]`` (None: FLA's defaults, coefficient e for softplus and 1 for sigmoid).
        dt_bias: ``[HV * K]`` or ``[HV, K]`` (``[HV]`` with a per-head g) or None.
        lower_bound: required for ``gate="lower_bound"``.
        use_qk_l2norm: normalise each q and k row in fp32 as FLA's ``l2norm_fwd`` (``x / sqrt(sum x^2 + 1e-6)``),
            rounded to q's dtype, before any use.
        beta_sigmoid: beta holds logits; the kernel uses ``sigmoid(beta)`` (fp32), ``2 sigmoid(beta)`` with
            ``allow_neg_eigval`` (which needs ``beta_sigmoid``, as in FLA).
        g_cum_last_only: write g_cum at the last valid row of each chunk only (what the state/output kernel
            reads); its other rows are left as they were.
        Akk: ``[B, T, HV, 64]`` q's dtype or None, out: ``(I + Akk)^-1`` of the token's chunk rounded to q's dtype
            (the unit lower-triangular matrix that w and u are made with; zeros above the diagonal), FLA's
            ``chunk_kda_fwd_intra``'s Akk, which its backward takes.
        given_akk: ``[B, T, HV, 64]`` q's dtype or None: an ``Akk`` a call on the same inputs wrote, read instead
            of computed (the training backward's recompute of w, u, qg, kg and g_cum): no scores and no solve, so
            ``Aqk`` is not written (pass None) and ``Akk`` must be None. w and u are then the bits that call wrote.
        any_gate: exact for any per-channel gate (the kernel's any_gate variant: a tile whose gates break the
            anchored factoring's bound, no channel moving more than 2^96 from a sub-chunk's middle row, makes its
            diagonal score blocks element by element); without it the scores need gates of at least about -8.6 a
            step. Not with a per-head g (exact anyway) or ``given_akk`` (no scores).
        qk_rstd: ``[2, B, T, H]`` fp32 or None, out, only with ``use_qk_l2norm``: q's (index 0) and k's (index 1)
            ``1 / sqrt(sum x^2 + 1e-6)`` per row, as FLA's ``l2norm_fwd`` returns it (to fp32 summation order).
        row_factors: ``[B, T, HV, ROW_FACTORS]`` fp32 or None, out, only with a per-head g and neither ``Akk`` nor
            ``given_akk``: per token and value head ``(rstd_q exp2(g_cum), rstd_k exp2(g_cum[last] - g_cum),
            exp2(g_cum), rstd_k exp2(g_cum))`` (rstd 1 without ``use_qk_l2norm``) in place of qg, kg and g_cum,
            which must then be None: what the state/output kernel's ``row_factors`` variant applies to the raw q and k.
        t_beta: ``[B, T, HV, 64]`` q's dtype or None, out, only with ``row_factors``: ``bf16((I + Akk)^-1
            diag(beta))`` of the token's chunk (zeros above the diagonal) in place of w and u, which must then be
            None (the kernel's ``wy_in_recurrence``: v is not read); what the state/output kernel's
            ``wy_in_recurrence`` variant makes v_new of, with the raw v and k and the factor rows.

    K = V = 128, chunk size 64. All tensors contiguous. Rows past each sequence end are not written.
    """
    if chunk_size != 64:
        raise ValueError(f"chunk_size must be 64, got {chunk_size}")
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    if gate == "lower_bound" and lower_bound is None:
        raise ValueError('gate="lower_bound" needs lower_bound')
    if allow_neg_eigval and not beta_sigmoid:
        raise ValueError("allow_neg_eigval needs beta_sigmoid")
    beta_act = beta_act_for(beta_sigmoid, allow_neg_eigval)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if (K, V) != (128, 128):
        raise ValueError(f"only K = V = 128 is supported, got K={K}, V={V}")
    if HV % H != 0:
        raise ValueError(f"value heads ({HV}) must be a multiple of query/key heads ({H})")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q/k/v must be bf16 or fp16, got {q.dtype}")
    dt = q.dtype
    if given_akk is not None and Akk is not None:
        raise ValueError("given_akk is read and Akk written: pass one of them")
    if (Aqk is None) != (given_akk is not None):
        raise ValueError("Aqk is written unless given_akk is passed (then it must be None)")
    if qk_rstd is not None and not use_qk_l2norm:
        raise ValueError("qk_rstd holds the L2 norm's 1 / norms: it needs use_qk_l2norm")
    scalar_gate = g.dim() == 3
    g_shape = (B, T, HV) if scalar_gate else (B, T, HV, K)
    factors = row_factors is not None
    if factors and (not scalar_gate or Akk is not None or given_akk is not None):
        raise ValueError("row_factors needs a per-head g, and neither Akk nor given_akk")
    if factors != (qg is None) or qg is None and (kg is not None or g_cum is not None):
        raise ValueError("pass qg, kg and g_cum, or row_factors in their place")
    wy = t_beta is not None
    if wy and not factors or wy != (w is None) or wy != (u is None):
        raise ValueError("t_beta comes with row_factors, in place of w and u (then both None)")
    rows = ((("row_factors", row_factors, (B, T, HV, ROW_FACTORS), torch.float32),) if factors else (
        ("qg", qg, (B, T, HV, K), dt), ("kg", kg, (B, T, HV, K), dt), ("g_cum", g_cum, (B, T, HV, K), torch.float32)))
    rows += (("t_beta", t_beta, (B, T, HV, 64), dt),) if wy else (
        ("w", w, (B, T, HV, K), dt), ("u", u, (B, T, HV, V), dt))
    check_tensors((
        ("k", k, (B, T, H, K), dt), ("v", v, (B, T, HV, V), dt), ("g", g, g_shape, None),
        ("beta", beta, (B, T, HV), None), *rows,
        *((("Aqk", Aqk, (B, T, HV, 64), dt),) if Aqk is not None else ()),
        *((("Akk", Akk, (B, T, HV, 64), dt),) if Akk is not None else ()),
        *((("given_akk", given_akk, (B, T, HV, 64), dt),) if given_akk is not None else ()),
        *((("qk_rstd", qk_rstd, (2, B, T, H), torch.float32),) if qk_rstd is not None else ()),
    ), contiguous=True)  # fmt: skip
    if g.dtype not in TORCH_TO_DSL or beta.dtype not in TORCH_TO_DSL:
        raise ValueError(f"g and beta must be fp32/bf16/fp16, got {g.dtype}, {beta.dtype}")
    varlen = cu_seqlens is not None
    if varlen:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (flatten the sequences), got {B}")
        if cu_seqlens.dtype != torch.int32:
            cu_seqlens = cu_seqlens.to(torch.int32)
        if chunk_indices is None:
            chunk_indices = prepare_chunk_indices_i32(cu_seqlens)
        elif chunk_indices.dtype != torch.int32 or not chunk_indices.is_contiguous():
            chunk_indices = chunk_indices.to(torch.int32).contiguous()
        num_chunks, num_seqs = chunk_indices.shape[0], 1
    else:
        num_chunks, num_seqs = (T + 63) // 64, B
    if B * T == 0 or HV == 0 or num_chunks == 0:
        return
    dev = q.device
    A_log, dt_bias = gate_params(A_log, dt_bias, gate, HV, K, dev, per_head=scalar_gate)
    fn = compiled_variant(
        varlen=varlen,
        **kernel_options(
            dt, g.dtype, beta.dtype, gate, use_qk_l2norm, beta_act, g_cum_last_only=g_cum_last_only,
            write_akk=Akk is not None, scalar_gate=scalar_gate, given_t=given_akk is not None,
            any_gate=any_gate, write_rstd=qk_rstd is not None, row_factors=factors, wy_in_recurrence=wy,
        ),
    )  # fmt: skip

    def flat(t):
        return t.view(B * T, t.shape[2], t.shape[-1])

    fn(
        flat(q), flat(k), flat(v), g.view(B * T, HV) if scalar_gate else flat(g), beta.view(B * T, HV), A_log,
        dt_bias,
        *((None, None) if wy else (flat(w), flat(u))),
        *((flat(row_factors), None) if factors else (flat(qg), flat(kg))),
        None if Aqk is None else flat(Aqk),
        flat(Akk) if Akk is not None else flat(given_akk) if given_akk is not None else flat(t_beta) if wy else None,
        None if factors else flat(g_cum),
        None if qk_rstd is None else qk_rstd.view(2, B * T, H),
        cu_seqlens if varlen else placeholder(dev, torch.int32, (2,)),
        chunk_indices if varlen else placeholder(dev, torch.int32, (1, 2)),
        T, num_chunks, num_seqs, float(scale), float(lower_bound if lower_bound is not None else 0.0),
    )  # fmt: skip
