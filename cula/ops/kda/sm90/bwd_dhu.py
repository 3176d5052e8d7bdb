"""KDA chunk backward, dv and the state-gradient recurrence on SM90: the host side (compile keys, launch).

The kernel, ``ChunkKDABwdDhuSm90`` (FLA's ``chunk_kda_bwd_dAv`` and ``chunk_gated_delta_rule_bwd_dhu`` with the
per-channel gate in one launch), and its description are in ``bwd_dhu_kernel.py``, imported (with the CuTe DSL)
only to compile a variant; see ``cula.ops._host``.
"""

from __future__ import annotations

import torch

from cula.cache import compiled_kernel
from cula.ops._host import check_chunk_operands, check_tensors, dsl_name, kernel_attr, placeholder
from cula.ops.kda.sm90.intra import chunk_offsets_i32

__all__ = ["chunk_kda_bwd_dv_dhu_sm90", "compiled", "compiled_variant", "variant_key"]


def __getattr__(name):
    return kernel_attr(__name__, name)


def variant_key(dtype="BFloat16", varlen=False, has_dht=False, has_dh0=False, state_v_first=False,
                arch=(9, 0)) -> tuple:  # fmt: skip
    """The compile key of a variant; ``dtype`` a DSL type, its name or a torch dtype."""
    return ("kda.bwd_dhu", "ChunkKDABwdDhuSm90", dsl_name(dtype), 128, 128, 64, varlen, has_dht, has_dh0,
            state_v_first, arch)  # fmt: skip


def compiled(key: tuple):
    """The compiled variant of ``key`` (see ``cula.cache.compiled_kernel``)."""
    dtype, _K, _V, _BT, varlen, has_dht, has_dh0, state_v_first, arch = key[2:]
    return compiled_kernel(key, lambda: kernel_attr(__name__, "_compile")(
        dtype, varlen, has_dht, has_dh0, state_v_first, arch))  # fmt: skip


def compiled_variant(**options):
    """``compiled(variant_key(**options))``."""
    return compiled(variant_key(**options))


def chunk_kda_bwd_dv_dhu_sm90(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, do: torch.Tensor, Aqk: torch.Tensor, v_new: torch.Tensor,
    gk: torch.Tensor, h0: torch.Tensor | None = None, dht: torch.Tensor | None = None, scale: float | None = None,
    state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64,
    chunk_indices: torch.Tensor | None = None, dAqk: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:  # fmt: skip
    """Stages 4 and 5 of FLA's ``chunk_kda_bwd`` in one launch on SM90: ``chunk_kda_bwd_dAv(q, k, v_new, do, Aqk,
    scale)`` then ``chunk_gated_delta_rule_bwd_dhu(q, k, w, do, dv, gk=gk, h0=h0, dht=dht, ...)`` on its dv, without
    dv leaving the chip (added to stage 5's product in fp32, where FLA rounds it to bf16 first). Contract:
    ``cula.kda.naive_bwd.chunk_kda_bwd_dhu_reference`` on ``dv = Aqk^T do`` (causal with the diagonal per chunk),
    ``dAqk = scale * tril(do v_new^T)``.

    Args:
        q, k, w: ``[B, T, HV, 128]`` bf16/fp16 as FLA's ``chunk_kda_bwd`` passes them to stage 5 (``q = qg``,
            ``k = kg``, per value head).  do, v_new: ``[B, T, HV, 128]``, the same dtype.
        Aqk: ``[B, T, HV, 64]`` in q's dtype, the forward's (scaled, zero above the diagonal, as cula's intra kernel
            writes it).
        gk: ``[B, T, HV, 128]`` fp32, the chunk-local log2 gate cumsum.
        h0: whether to return ``dh0`` (its shape: ``[N, HV, 128, 128]``); not read.
        dht: ``[N, HV, 128, 128]`` fp32 or None (zeros).
        scale: defaults to ``K ** -0.5``.
        state_v_first: ``dh``, ``dht``, ``dh0`` as ``[..., V, K]``.
        cu_seqlens: ``[N + 1]`` int32 / int64 with ``B == 1``; ``chunk_indices`` (FLA's) only sizes ``dh``
            (``len(chunk_indices)`` chunks), else the chunk count is read from ``cu_seqlens`` (a host sync).
        dAqk: ``[B, T, HV, 64]`` fp32 to write into, or None (allocated).

    Returns:
        ``(dAqk, dh, dh0, dv2)``: ``dAqk`` fp32 (zero above the diagonal), ``dh`` ``[B, NT, HV, K, V]``
        (``[..., V, K]``) in q's dtype, ``dh0`` fp32 or None, ``dv2`` like ``do``.
    """
    B, T, HV, K, V = check_chunk_operands(q, do, chunk_size, "q/k/w/do/v_new")
    tok, scores = (B, T, HV, K), (B, T, HV, 64)
    specs = [("k", k, tok, q.dtype), ("w", w, tok, q.dtype), ("do", do, tok, q.dtype), ("gk", gk, tok, torch.float32),
             ("v_new", v_new, tok, q.dtype), ("Aqk", Aqk, scores, q.dtype)]  # fmt: skip
    specs += [] if dAqk is None else [("dAqk", dAqk, scores, torch.float32)]
    check_tensors(specs, contiguous=True)
    varlen = cu_seqlens is not None
    if varlen:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1, got {B}")
        N = cu_seqlens.numel() - 1
        cu32 = cu_seqlens.to(torch.int32)
        bounds = chunk_offsets_i32(cu32)
        offsets = bounds[:-1]  # each sequence's first chunk
        NT = len(chunk_indices) if chunk_indices is not None else int(bounds[-1])
    else:
        N, NT = B, -(-T // 64)
    state = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    if dht is not None:
        check_tensors((("dht", dht, state, torch.float32),), contiguous=True)
    dev = q.device
    dh = q.new_empty((B, NT, HV) + state[2:])
    dh0 = torch.empty(state, dtype=torch.float32, device=dev) if h0 is not None else None
    dv2 = torch.empty_like(do)
    if dAqk is None:  # every token's row is written (zero above the diagonal), as FLA's stage 4 does
        dAqk = torch.empty(scores, dtype=torch.float32, device=dev)
    if N == 0 or HV == 0 or B * T == 0:  # no tokens: nothing to launch (TMA describes no empty tensor)
        if dh0 is not None:
            dh0.copy_(dht) if dht is not None else dh0.zero_()
        return dAqk, dh, dh0, dv2
    fn = compiled_variant(dtype=dsl_name(q.dtype), varlen=varlen, has_dht=dht is not None, has_dh0=h0 is not None,
                          state_v_first=state_v_first)  # fmt: skip
    no_state = placeholder(dev, torch.float32, (1, 1, 128, 128))
    no_ints = placeholder(dev, torch.int32, (2,))

    def flat(t):
        return t.view(B * T, HV, t.shape[-1])

    fn(
        flat(q), flat(k), flat(w), flat(gk), flat(do), flat(Aqk), flat(v_new), flat(dv2), flat(dAqk),
        dh.view((B * NT, HV) + state[2:]), dht if dht is not None else no_state, dh0 if dh0 is not None else no_state,
        cu32 if varlen else no_ints, offsets if varlen else no_ints, T, N, float(K**-0.5 if scale is None else scale),
    )  # fmt: skip
    return dAqk, dh, dh0, dv2
