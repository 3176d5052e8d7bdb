"""KDA chunk backward, the state-gradient recurrence on SM90: the host side (compile keys, launch).

The kernel, ``ChunkKDABwdDhuSm90`` (FLA's ``chunk_gated_delta_rule_bwd_dhu`` with the per-channel gate), and its
description are in ``bwd_dhu_kernel.py``, imported (with the CuTe DSL) only to compile a variant; see
``cula.ops._host``.
"""

from __future__ import annotations

import torch

from cula.cache import compiled_kernel
from cula.ops._host import check_chunk_operands, check_tensors, dsl_name, kernel_attr, placeholder
from cula.ops.kda.sm90.intra import chunk_offsets_i32

__all__ = ["chunk_kda_bwd_dhu_sm90", "chunk_kda_bwd_dv_dhu_sm90", "compiled", "compiled_variant", "variant_key"]

def __getattr__(name):
    return kernel_attr(__name__, name)


def variant_key(dtype="BFloat16", varlen=False, has_dht=False, has_dh0=False, state_v_first=False, dv_intra=False,
                arch=(9, 0)) -> tuple:  # fmt: skip
    """The compile key of a variant; ``dtype`` a DSL type, its name or a torch dtype."""
    return ("kda.bwd_dhu", "ChunkKDABwdDhuSm90", dsl_name(dtype), 128, 128, 64, varlen, has_dht, has_dh0,
            state_v_first, dv_intra, arch)  # fmt: skip


def compiled(key: tuple):
    """The compiled variant of ``key`` (see ``cula.cache.compiled_kernel``)."""
    dtype, _K, _V, _BT, varlen, has_dht, has_dh0, state_v_first, dv_intra, arch = key[2:]
    return compiled_kernel(key, lambda: kernel_attr(__name__, "_compile")(
        dtype, varlen, has_dht, has_dh0, state_v_first, arch, dv_intra=dv_intra))  # fmt: skip


def compiled_variant(**options):
    """``compiled(variant_key(**options))``."""
    return compiled(variant_key(**options))


def chunk_kda_bwd_dhu_sm90(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    do: torch.Tensor,
    dv: torch.Tensor,
    gk: torch.Tensor,
    h0: torch.Tensor | None = None,
    dht: torch.Tensor | None = None,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """FLA's ``chunk_gated_delta_rule_bwd_dhu(q, k, w, do, dv, gk=gk, h0=h0, dht=dht, ...)`` for KDA on SM90: the
    same arguments (as FLA's ``chunk_kda_bwd`` passes them: ``q = qg``, ``k = kg``, per value head), the same
    returns ``(dh, dh0, dv2)`` (contract: ``cula.kda.naive_bwd.chunk_kda_bwd_dhu_reference``).

    Args:
        q, k, w: ``[B, T, HV, 128]`` bf16/fp16.  do, dv: ``[B, T, HV, 128]``, the same dtype.
        gk: ``[B, T, HV, 128]`` fp32, the chunk-local log2 gate cumsum.
        h0: whether to return ``dh0`` (its shape: ``[N, HV, 128, 128]``); not read.
        dht: ``[N, HV, 128, 128]`` fp32 or None (zeros).
        scale: defaults to ``K ** -0.5``.
        state_v_first: ``dh``, ``dht``, ``dh0`` as ``[..., V, K]``.
        cu_seqlens: ``[N + 1]`` int32 / int64 with ``B == 1``; ``chunk_indices`` (FLA's) only sizes ``dh``
            (``len(chunk_indices)`` chunks), else the chunk count is read from ``cu_seqlens`` (a host sync).

    Returns:
        ``dh`` ``[B, NT, HV, K, V]`` (``[..., V, K]``) in q's dtype, ``dh0`` fp32 or None, ``dv2`` like ``dv``.
    """
    dh, dh0, dv2, _ = _launch(q, k, w, do, gk, h0, dht, scale, state_v_first, cu_seqlens, chunk_size, chunk_indices,
                              dv=dv)  # fmt: skip
    return dh, dh0, dv2


def chunk_kda_bwd_dv_dhu_sm90(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, do: torch.Tensor, Aqk: torch.Tensor, v_new: torch.Tensor,
    gk: torch.Tensor, h0: torch.Tensor | None = None, dht: torch.Tensor | None = None, scale: float | None = None,
    state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64,
    chunk_indices: torch.Tensor | None = None, dAqk: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:  # fmt: skip
    """Stages 4 and 5 of FLA's ``chunk_kda_bwd`` in one launch: ``chunk_kda_bwd_dAv(q, k, v_new, do, Aqk, scale)``
    then ``chunk_kda_bwd_dhu_sm90`` on its dv, without dv leaving the chip (added to stage 5's product in fp32, where
    FLA rounds it to bf16 first). ``Aqk``: ``[B, T, HV, 64]`` in q's dtype, the forward's (scaled, zero above the
    diagonal, as cula's intra kernel writes it); ``v_new`` like ``do``; the rest as ``chunk_kda_bwd_dhu_sm90``.
    Returns ``(dAqk, dh, dh0, dv2)``, ``dAqk`` ``[B, T, HV, 64]`` fp32 (zero above the diagonal; written into the
    given ``dAqk`` when one is)."""
    dh, dh0, dv2, dAqk = _launch(q, k, w, do, gk, h0, dht, scale, state_v_first, cu_seqlens, chunk_size,
                                 chunk_indices, Aqk=Aqk, v_new=v_new, dAqk=dAqk)  # fmt: skip
    return dAqk, dh, dh0, dv2


def _launch(q, k, w, do, gk, h0, dht, scale, state_v_first, cu_seqlens, chunk_size, chunk_indices, dv=None,
            Aqk=None, v_new=None, dAqk=None):  # fmt: skip
    """Both functions' checks and launch: with ``dv`` stage 5 alone, with ``Aqk`` and ``v_new`` stages 4 and 5.
    Returns ``(dh, dh0, dv2, dAqk or None)``."""
    B, T, HV, K, V = check_chunk_operands(q, do, chunk_size, "q/k/w/do/dv")
    dv_intra = dv is None
    tok, scores = (B, T, HV, K), (B, T, HV, 64)
    specs = [("k", k, tok, q.dtype), ("w", w, tok, q.dtype), ("do", do, tok, q.dtype), ("gk", gk, tok, torch.float32)]
    if dv_intra:
        specs += [("v_new", v_new, tok, q.dtype), ("Aqk", Aqk, scores, q.dtype)]
        specs += [] if dAqk is None else [("dAqk", dAqk, scores, torch.float32)]
    else:
        specs.append(("dv", dv, tok, q.dtype))
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
    if dv_intra and dAqk is None:  # every token's row is written (zero above the diagonal), as FLA's stage 4 does
        dAqk = torch.empty(scores, dtype=torch.float32, device=dev)
    if N == 0 or HV == 0 or B * T == 0:  # no tokens: nothing to launch (TMA describes no empty tensor)
        if dh0 is not None:
            dh0.copy_(dht) if dht is not None else dh0.zero_()
        return dh, dh0, dv2, dAqk
    fn = compiled_variant(dtype=dsl_name(q.dtype), varlen=varlen, has_dht=dht is not None, has_dh0=h0 is not None,
                          state_v_first=state_v_first, dv_intra=dv_intra)  # fmt: skip
    no_state = placeholder(dev, torch.float32, (1, 1, 128, 128))
    no_ints = placeholder(dev, torch.int32, (2,))
    no_scores = placeholder(dev, q.dtype, (1, 1, 64))

    def flat(t):
        return t.view(B * T, HV, t.shape[-1])

    fn(
        flat(q), flat(k), flat(w), flat(gk), flat(do), flat(do if dv_intra else dv),
        flat(Aqk) if dv_intra else no_scores, flat(v_new) if dv_intra else flat(do), flat(dv2),
        flat(dAqk) if dv_intra else placeholder(dev, torch.float32, (1, 1, 64)), dh.view((B * NT, HV) + state[2:]),
        dht if dht is not None else no_state, dh0 if dh0 is not None else no_state,
        cu32 if varlen else no_ints, offsets if varlen else no_ints, T, N, float(K**-0.5 if scale is None else scale),
    )  # fmt: skip
    return dh, dh0, dv2, dAqk
