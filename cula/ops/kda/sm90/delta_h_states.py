"""KDA chunk recurrence on SM90, the states alone: the host side (compile keys, launch).

The kernel, ``DeltaHStatesSm90`` (FLA's ``chunk_gated_delta_rule_fwd_h`` for KDA: every chunk's state and v_new), and
its description are in ``delta_h_states_kernel.py``, imported (with the CuTe DSL) only to compile a variant; see
``cula.ops._host``.
"""

from __future__ import annotations

import torch

from cula.cache import compiled_kernel
from cula.ops._host import check_chunk_operands, check_tensors, dsl_name, kernel_attr, placeholder

__all__ = ["chunk_kda_fwd_h_sm90", "compiled", "compiled_variant", "variant_key"]


def __getattr__(name):
    return kernel_attr(__name__, name)


def variant_key(dtype="BFloat16", num_stages=3, varlen=False, has_h0=False, has_ht=False, state_v_first=False,
                arch=(9, 0)) -> tuple:  # fmt: skip
    """The compile key of a variant; ``dtype`` a DSL type, its name or a torch dtype."""
    return ("kda.delta_h_states", "DeltaHStatesSm90", dsl_name(dtype), 128, 128, 64, num_stages, bool(varlen),
            bool(has_h0), bool(has_ht), bool(state_v_first), arch)  # fmt: skip


def compiled(key: tuple):
    """The compiled variant of ``key`` (see ``cula.cache.compiled_kernel``)."""
    dtype, _K, _V, _BT, num_stages, varlen, has_h0, has_ht, state_v_first, arch = key[2:]
    return compiled_kernel(
        key, lambda: kernel_attr(__name__, "_compile")(dtype, num_stages, varlen, has_h0, has_ht, state_v_first, arch)
    )


def compiled_variant(**options):
    """``compiled(variant_key(**options))``."""
    return compiled(variant_key(**options))


def chunk_kda_fwd_h_sm90(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    gk: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """FLA's ``chunk_gated_delta_rule_fwd_h(k, w, u, gk=gk, ...)`` as KDA's backward calls it, on SM90: ``(h, v_new,
    final_state)`` with FLA's shapes and dtypes. Per chunk c, with S the state before it: ``h[c] = S`` in k's dtype,
    ``v_new = u - w bf16(S)`` (rows of each sequence), ``S <- diag(exp2(gk[last])) S + k^T bf16(v_new)``.

    Args:
        k: ``[B, T, HV, 128]`` bf16 / fp16, KDA's ``kg`` (``k exp2(g_last - g)``, 0 past each sequence end).
        w, u: ``[B, T, HV, 128]`` k's dtype.  gk: ``[B, T, HV, 128]`` fp32, the chunk-local log2 gate cumsum (only
            each chunk's last valid row is read).
        initial_state: ``[N, HV, 128, 128]`` fp32 or None (zeros); ``output_final_state``: also the last state.
        state_v_first: states ``[V, K]`` instead of ``[K, V]`` (h, the initial and the final state).
        cu_seqlens: ``[N + 1]`` int32 / int64 with ``B == 1``; ``chunk_indices`` ``[NT, 2]`` (its length is h's
            chunk count, FLA's: in FLA's graph mode the static list's) and ``chunk_offsets`` ``[N + 1]`` (each
            sequence's first chunk in h), built from ``cu_seqlens`` when absent (a host sync).

    Returns:
        h ``[B, NT, HV, 128, 128]`` in k's dtype (chunk rows no sequence owns left unwritten), v_new like u, and the
        final state (fp32) or None.
    """
    B, T, HV, K, V = check_chunk_operands(k, u, chunk_size, "k/w/u")
    check_tensors((("k", k, (B, T, HV, K), k.dtype), ("w", w, (B, T, HV, K), k.dtype),
                   ("u", u, (B, T, HV, V), k.dtype), ("gk", gk, (B, T, HV, K), torch.float32)),
                  contiguous=True)  # fmt: skip
    varlen, dev = cu_seqlens is not None, k.device
    if varlen:
        from cula.ops.kda.sm90.intra import chunk_offsets_i32, prepare_chunk_indices_i32

        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (flatten the sequences), got {B}")
        cu32 = cu_seqlens.to(torch.int32).contiguous()
        N = cu32.numel() - 1
        NT = (prepare_chunk_indices_i32(cu32) if chunk_indices is None else chunk_indices).shape[0]
        offsets = (chunk_offsets_i32(cu32) if chunk_offsets is None else chunk_offsets).to(torch.int32).contiguous()
    else:
        N, NT = B, -(-T // 64)
        cu32 = offsets = placeholder(dev, torch.int32, (2,))
    inner = (V, K) if state_v_first else (K, V)
    if initial_state is not None:
        check_tensors((("initial_state", initial_state, (N, HV, *inner), torch.float32),), contiguous=True)
    h = k.new_empty(B, NT, HV, *inner)
    v_new = torch.empty_like(u)
    final_state = torch.empty(N, HV, *inner, dtype=torch.float32, device=dev) if output_final_state else None
    if N == 0 or HV == 0:
        return h, v_new, final_state
    if B * T == 0:  # no tokens: TMA descriptors cannot describe an empty tensor; the state passes through
        if final_state is not None and initial_state is not None:
            final_state.copy_(initial_state)
        elif final_state is not None:
            final_state.zero_()
        return h, v_new, final_state
    fn = compiled_variant(dtype=dsl_name(k.dtype), varlen=varlen, has_h0=initial_state is not None,
                          has_ht=output_final_state, state_v_first=state_v_first)  # fmt: skip

    def flat(t):
        return t.view(B * T, HV, t.shape[-1])

    dummy = placeholder(dev, torch.float32, (1, 1, *inner))
    fn(
        flat(w), flat(u), flat(k), flat(gk), dummy if initial_state is None else initial_state,
        dummy if final_state is None else final_state, h.view(B * NT, HV, *inner), flat(v_new), cu32, offsets, T, N,
    )  # fmt: skip
    return h, v_new, final_state
