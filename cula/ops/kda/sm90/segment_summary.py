"""KDA time-parallel forward, first pass on SM90: the host side (compile keys, launch).

The kernel, ``SegmentSummarySm90`` (every segment's end state and transition in one launch), and its description
are in ``segment_summary_kernel.py``, imported (with the CuTe DSL) only to compile a variant; see
``cula.ops._host``.
"""

from __future__ import annotations

import torch

from cula.cache import compiled_kernel
from cula.ops._host import ROW_FACTORS, check_tensors, dsl_name, kernel_attr

__all__ = ["chunk_kda_segment_summary_sm90", "compiled", "compiled_variant", "variant_key"]

IO_DTYPES = (torch.bfloat16, torch.float16)


def __getattr__(name):
    return kernel_attr(__name__, name)


def variant_key(dtype="BFloat16", state_v_first=False, arch=(9, 0), mid_states=False, row_factors=False,
                wy_in_recurrence=False) -> tuple:  # fmt: skip
    """The compile key of a variant; ``dtype`` a DSL type, its name or a torch dtype. ``mid_states``,
    ``row_factors`` and ``wy_in_recurrence`` are in the key only when on (the other variants' keys stay)."""
    key = ("kda.segment_summary", "SegmentSummarySm90", dsl_name(dtype), 128, 128, 64, state_v_first, arch)
    return (*key, *(("mid_states",) if mid_states else ()), *(("row_factors",) if row_factors else ()),
            *(("wy_in_recurrence",) if wy_in_recurrence else ()))


def compiled(key: tuple):
    """The compiled variant of ``key`` (see ``cula.cache.compiled_kernel``)."""
    dtype, _K, _V, _BT, state_v_first, arch = key[2:8]
    flags = {flag: True for flag in key[8:]}  # mid_states, row_factors, wy_in_recurrence
    return compiled_kernel(key, lambda: kernel_attr(__name__, "_compile")(dtype, state_v_first, arch, **flags))


def compiled_variant(**options):
    """``compiled(variant_key(**options))``."""
    return compiled(variant_key(**options))


def chunk_kda_segment_summary_sm90(
    w: torch.Tensor,
    u: torch.Tensor,
    kg: torch.Tensor,
    g: torch.Tensor,
    ends: torch.Tensor,
    segments: torch.Tensor,
    *,
    state_v_first: bool = False,
    mids: torch.Tensor | None = None,
    row_factors: bool = False,
    wy_in_recurrence: bool = False,
) -> None:
    """Every segment's end state E and transition R (``segment_summary_kernel.py``), written into ``ends``.

    Args:
        w, u, kg: ``[1, T, HV, 128]`` bf16/fp16, the intra stage's (as for ``chunk_kda_delta_h_fwd_o_sm90``).
        g: ``[1, T, HV, 128]`` fp32, the chunk-local cumsum of the log2 gate.
        ends: ``[M, 2 HV, K, V]`` fp32 (``[M, 2 HV, V, K]`` if ``state_v_first``): E (the end from a zero start) of
            head h at h, R at ``HV + h``.
        segments: ``[M + 1]`` int32, the segments' token bounds (each a whole number of 64-token chunks but the
            last of a sequence).
        mids: shaped as ``ends`` or None: also written, E and R of each segment's first ``ceil(len / 64) // 2``
            chunks (E = 0 and R = I for a segment of at most one chunk).
        row_factors: Gated DeltaNet after the intra kernel's factor rows: ``kg`` is then the raw k ``[1, T, H,
            128]`` (H dividing HV) and ``g`` the factor rows ``[1, T, HV, ROW_FACTORS]`` fp32.
        wy_in_recurrence: with ``row_factors``, ``w`` is the intra kernel's T diag(beta) ``[1, T, HV, 64]`` and ``u``
            the raw v (see ``chunk_kda_delta_h_fwd_o_sm90``).
    """
    B, T, HV, K = u.shape
    if B != 1 or K != 128 or w.shape[0] != 1:
        raise ValueError(f"expected packed [1, T, HV, 128] operands, got w {tuple(w.shape)}, u {tuple(u.shape)}")
    if u.dtype not in IO_DTYPES:
        raise ValueError(f"w/u/kg must be bf16 or fp16, got {u.dtype}")
    H = kg.shape[2] if row_factors and kg.dim() == 4 else HV
    if row_factors and (H < 1 or HV % H):
        raise ValueError(f"row_factors: k's heads ({H}) must divide the value heads ({HV})")
    if wy_in_recurrence and not row_factors:
        raise ValueError("wy_in_recurrence needs row_factors (the factor rows' f_x)")
    check_tensors((
        ("w", w, (1, T, HV, 64 if wy_in_recurrence else K), u.dtype),
        ("kg", kg, (1, T, H, K), u.dtype),
        ("g", g, (1, T, HV, ROW_FACTORS if row_factors else K), torch.float32), ("u", u, (1, T, HV, K), u.dtype),
    ), contiguous=True)  # fmt: skip
    if segments.dtype != torch.int32:
        raise ValueError(f"segments must be int32, got {segments.dtype}")
    M = segments.numel() - 1
    for name, t in (("ends", ends), ("mids", mids)):
        if t is not None and (tuple(t.shape) != (M, 2 * HV, K, K) or t.dtype != torch.float32
                              or not t.is_contiguous()):  # fmt: skip
            raise ValueError(f"{name}: expected contiguous {(M, 2 * HV, K, K)} float32, got {tuple(t.shape)} "
                             f"{t.dtype}")  # fmt: skip
    if M == 0 or HV == 0:
        return
    if T == 0:  # every segment empty (no TMA descriptor describes an empty tensor): E is zero, R the identity
        for t in (ends, mids) if mids is not None else (ends,):
            t[:, :HV].zero_()
            t[:, HV:].copy_(torch.eye(K, dtype=torch.float32, device=ends.device).expand(M, HV, K, K))
        return
    fn = compiled_variant(dtype=dsl_name(w.dtype), state_v_first=state_v_first, mid_states=mids is not None,
                          row_factors=row_factors, wy_in_recurrence=wy_in_recurrence)  # fmt: skip

    def flat(t):
        return t.view(T, t.shape[2], t.shape[3])

    fn(flat(w), flat(u), flat(kg), flat(g), ends, mids, segments, M)
