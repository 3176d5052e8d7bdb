"""KDA chunk forward, inter-chunk stage on SM90: the host side (compile keys, launch).

The kernel, ``DeltaHFwdOFusedSm90`` (the gated delta-rule state recurrence fused with the output), and its
description are in ``delta_h_fwd_o_kernel.py``, imported (with the CuTe DSL) only to compile a variant; see
``cula.ops._host``.
"""

from __future__ import annotations

import torch

from cula.cache import compiled_kernel
from cula.ops._host import ROW_FACTORS, check_chunk_operands, check_tensors, dsl_name, kernel_attr, placeholder

__all__ = ["chunk_kda_delta_h_fwd_o_sm90", "compiled", "compiled_variant", "variant_key"]


def __getattr__(name):
    return kernel_attr(__name__, name)


def variant_key(dtype="BFloat16", num_stages=3, varlen=False, has_h0=False, has_ht=False, state_v_first=False,
                arch=(9, 0), aqk_causal=False, store_states=False, row_factors=False,
                wy_in_recurrence=False) -> tuple:  # fmt: skip
    """The compile key of a variant; ``dtype`` a DSL type, its name or a torch dtype. ``store_states``:
    ``DeltaHFwdOStatesSm90`` (also h and v_new); ``row_factors``: raw q / k and the intra kernel's factor rows;
    ``wy_in_recurrence``: v_new from T diag(beta) and the raw v."""
    name = "DeltaHFwdOStatesSm90" if store_states else "DeltaHFwdOFusedSm90"
    return ("kda.delta_h_fwd_o", name, dsl_name(dtype), 128, 128, 64, num_stages,
            varlen, has_h0, has_ht, state_v_first, arch, ("aqk_causal", aqk_causal),
            *((("row_factors", True),) if row_factors else ()),
            *((("wy_in_recurrence", True),) if wy_in_recurrence else ()))  # fmt: skip


def compiled(key: tuple):
    """The compiled variant of ``key`` (see ``cula.cache.compiled_kernel``)."""
    dtype, _K, _V, _BT, num_stages, varlen, has_h0, has_ht, state_v_first, arch, (_, aqk_causal) = key[2:13]
    return compiled_kernel(
        key,
        lambda: kernel_attr(__name__, "_compile")(
            dtype, num_stages, varlen, has_h0, has_ht, state_v_first, arch, aqk_causal=aqk_causal,
            store_states=key[1] == "DeltaHFwdOStatesSm90", **dict(key[13:]),
        ),
    )


def compiled_variant(**options):
    """``compiled(variant_key(**options))``."""
    return compiled(variant_key(**options))

def chunk_kda_delta_h_fwd_o_sm90(
    w: torch.Tensor,
    u: torch.Tensor,
    kg: torch.Tensor,
    qg: torch.Tensor,
    g: torch.Tensor,
    Aqk: torch.Tensor,
    o: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    final_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    *,
    scale: float,
    state_v_first: bool = False,
    chunk_size: int = 64,
    aqk_causal: bool = False,
    h: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    row_factors: bool = False,
    wy_in_recurrence: bool = False,
) -> None:
    """KDA inter-chunk forward on SM90: writes ``o`` (and ``final_state``, ``h``, ``v_new``) in place.

    Inputs are the outputs of FLA's ``chunk_local_cumsum`` + ``chunk_kda_fwd_intra(..., disable_recompute=True)``:

    Args:
        w: ``[B, T, HV, K]`` bf16/fp16, ``A_kk (beta k exp2(g))``.
        u: ``[B, T, HV, V]`` same dtype, ``A_kk (beta v)``.
        kg: ``[B, T, HV, K]`` same dtype, ``k exp2(g_last - g)``.
        qg: ``[B, T, HV, K]`` same dtype, ``q exp2(g)`` (not scaled).
        g: ``[B, T, HV, K]`` fp32, chunk-local cumsum of the log gate times 1/ln(2).
        Aqk: ``[B, T, HV, 64]`` same dtype, intra-chunk scores (scale included); only the lower triangle
            (with the diagonal) is read.
        o: ``[B, T, HV, V]`` same dtype, output (rows of every sequence are all written).
        initial_state: ``[N, HV, K, V]`` fp32 (``[N, HV, V, K]`` if ``state_v_first``) or None (zeros).
        final_state: same shape, fp32, written if not None.
        cu_seqlens: ``[N + 1]`` int32 (int64 is converted) with ``B == 1``, or None (then ``N == B``).
        scale: the factor FLA applies to ``qg @ S`` (Aqk already carries it).
        state_v_first: state layout ``[V, K]`` instead of ``[K, V]``.
        chunk_size: must be 64.
        aqk_causal: Aqk's upper triangle holds zeros (cula's intra kernel writes them), so the kernel need not
            mask it; with False (FLA's intra stage leaves it unspecified) the kernel zeroes it in shared memory.
        h, v_new: with ``aqk_causal``, also written (both or neither): FLA's ``chunk_gated_delta_rule_fwd_h``
            outputs, ``h`` ``[B, NT, HV, K, V]`` (``[B, NT, HV, V, K]`` if ``state_v_first``; NT the chunks of a
            sequence, or of all of them when packed) in w's dtype, the state before each chunk, and ``v_new``
            ``[B, T, HV, V]``, ``u - w h``.
        chunk_offsets: ``[N + 1]`` int32, each packed sequence's first chunk in ``h`` (FLA's
            ``prepare_chunk_offsets``); with ``h`` and ``cu_seqlens``.
        row_factors: one gate per token and value head (Gated DeltaNet, after cula's intra kernel wrote its
            ``row_factors``; needs ``aqk_causal``): ``kg`` and ``qg`` are then the raw k and q ``[B, T, H, K]`` (value
            head ``hv`` reads q / k head ``hv // (HV // H)``) and ``g`` the factor rows ``[B, T, HV, ROW_FACTORS]``
            fp32 that make qg and kg of them and hold the decay; not with ``h``.
        wy_in_recurrence: with ``row_factors``, ``w`` is the intra kernel's ``T diag(beta)`` ``[B, T, HV, 64]`` (its
            ``wy_in_recurrence`` output) and ``u`` the raw v: the kernel makes ``v_new = T diag(beta) (v - f_x k S)``
            itself.

    All of w/u/kg/qg/g/Aqk/o must be contiguous. K = V = 128.
    """
    B, T, HV, K, V = check_chunk_operands(u if wy_in_recurrence else w, u, chunk_size, "w/u/kg/qg/Aqk/o")
    H = qg.shape[2] if row_factors and qg.dim() == 4 else HV
    if row_factors and (H < 1 or HV % H or not aqk_causal or h is not None):
        raise ValueError("row_factors needs q / k heads dividing the value heads, aqk_causal and no h")
    if wy_in_recurrence and not row_factors:
        raise ValueError("wy_in_recurrence needs row_factors (the factor rows' f_x)")
    check_tensors((
        ("w", w, (B, T, HV, 64 if wy_in_recurrence else K), u.dtype),
        ("u", u, (B, T, HV, V), w.dtype), ("kg", kg, (B, T, H, K), w.dtype), ("qg", qg, (B, T, H, K), w.dtype),
        ("g", g, (B, T, HV, ROW_FACTORS if row_factors else K), torch.float32),
        ("Aqk", Aqk, (B, T, HV, 64), w.dtype), ("o", o, (B, T, HV, V), w.dtype),
    ), contiguous=True)  # fmt: skip
    varlen = cu_seqlens is not None
    if varlen:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (flatten the sequences), got {B}")
        if cu_seqlens.dtype != torch.int32:
            cu_seqlens = cu_seqlens.to(torch.int32)
        N = cu_seqlens.numel() - 1
    else:
        N = B
    state_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    for name, t in (("initial_state", initial_state), ("final_state", final_state)):
        if t is not None and (
            tuple(t.shape) != state_shape or t.dtype != torch.float32 or not t.is_contiguous()
        ):
            raise ValueError(
                f"{name}: expected contiguous {state_shape} float32, got {tuple(t.shape)} {t.dtype}"
            )
    store = h is not None
    if store:
        NT = h.shape[1]
        if v_new is None or not aqk_causal or (varlen and chunk_offsets is None):
            raise ValueError("h needs v_new, aqk_causal and, with cu_seqlens, chunk_offsets")
        if not varlen and NT != -(-T // 64):
            raise ValueError(f"h: expected {-(-T // 64)} chunks for {T} tokens, got {NT}")
        check_tensors((("h", h, (B, NT, HV) + state_shape[2:], w.dtype), ("v_new", v_new, (B, T, HV, V), w.dtype)),
                      contiguous=True)  # fmt: skip
    if N == 0 or HV == 0:
        return
    if B * T == 0:  # no tokens: TMA descriptors cannot describe an empty tensor; the state passes through
        if final_state is not None:
            if initial_state is not None:
                final_state.copy_(initial_state)
            else:
                final_state.zero_()
        return
    dev = w.device
    dummy_state = placeholder(dev, torch.float32, (1, 1) + state_shape[2:])
    fn = compiled_variant(
        dtype=dsl_name(w.dtype), varlen=varlen, has_h0=initial_state is not None,
        has_ht=final_state is not None, state_v_first=state_v_first, aqk_causal=aqk_causal,
        **({"store_states": True} if store else {}), **({"row_factors": True} if row_factors else {}),
        **({"wy_in_recurrence": True} if wy_in_recurrence else {}),
    )  # fmt: skip

    def flat(t):
        return t.view(B * T, t.shape[2], t.shape[-1])

    cu = cu_seqlens if varlen else placeholder(dev, torch.int32, (2,))
    stored = ()
    if store:
        offsets = chunk_offsets.to(torch.int32) if varlen else cu
        stored = (h.view(B * h.shape[1], HV, *state_shape[2:]), flat(v_new), offsets)
    fn(
        flat(w), flat(u), flat(kg), flat(qg), flat(g), flat(Aqk), flat(o),
        initial_state if initial_state is not None else dummy_state,
        final_state if final_state is not None else dummy_state,
        cu, *stored, T, N, float(scale),
    )  # fmt: skip
