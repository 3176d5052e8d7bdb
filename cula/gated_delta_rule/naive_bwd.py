"""A float64 reference of FLA 0.6.0's ``chunk_bwd_dqkwg`` (``fla/ops/common/chunk_o.py``): the stage of the Gated
DeltaNet and ``chunk_simple_gla`` backwards that turns the per-chunk states ``h`` and their gradients ``dh`` into
dq, dk, dw and dg. With a data-dependent gate FLA refuses to run it on Hopper with the Triton that PyTorch ships;
a replacement has to take and return exactly what FLA's stage does, so that FLA's other stages run on unchanged.
This pins the contract down in plain torch, checked against FLA's Triton kernel under Triton's CPU interpreter
(``tests/test_gdn_naive_bwd.py``).

FLA's conventions followed here: ``g`` ``[B, T, HV]`` is the chunk-local cumulative gate in log2 units (``2 ** g``
is the decay from the chunk start, restarting at every chunk and sequence start); ``h`` / ``dh`` hold one state a
chunk, ``[B, NT, HV, K, V]`` (``[.., V, K]`` with ``state_v_first``; for packed sequences ``[1, chunks, ...]`` in
``cu_seqlens`` order); the gate gradient comes back per token before FLA's reverse cumsum, in log2 units.
"""

from __future__ import annotations

import torch

__all__ = ["chunk_bwd_dqkwg_reference"]


def _chunk_rows(B: int, T: int, chunk_size: int, cu_seqlens: torch.Tensor | None):
    """(batch row, first token, end) of every chunk in the order FLA numbers them (the state index)."""
    if cu_seqlens is None:
        return [(b, c, min(c + chunk_size, T)) for b in range(B) for c in range(0, T, chunk_size)]
    bounds = cu_seqlens.tolist()
    return [(0, c, min(c + chunk_size, e)) for s, e in zip(bounds[:-1], bounds[1:]) for c in range(s, e, chunk_size)]


def chunk_bwd_dqkwg_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    w: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dq, dk, dw, dg)`` as FLA's ``chunk_bwd_dqkwg`` returns them: dq / dk ``[B, T, H, K]`` in q's / k's dtype
    (value heads of a GVA group summed), ``dw = -dv h^T`` in w's dtype (None without ``w``), dg ``[B, T, HV]`` fp32
    (None without ``g``). Per chunk, with ``ds = do v^T`` masked causal::

        dq = scale 2^g (do h^T) + scale (ds o 2^(g_i - g_j)) k
        dk = 2^(g_last - g) (v dh^T) + scale (ds o 2^(g_i - g_j))^T q
        dg = rowsum(dq o q) - rowsum(dk o k), the chunk's last row + 2^g_last <h, dh> + sum(dk o k)

    (``g_gamma``: the gate ``g_gamma (t + 1)`` of a constant decay; neither: no gate.)"""
    B, T, H, K = k.shape
    HV = v.shape[2]
    scale = K**-0.5 if scale is None else scale
    f64 = torch.float64
    group = HV // H
    qh, kh = (x.to(f64).repeat_interleave(group, dim=2) for x in (q, k))  # [B, T, HV, K]
    vv, dO = v.to(f64), do.to(f64)
    hs, dhs = (x.to(f64).reshape((-1, HV) + tuple(x.shape[-2:])) for x in (h, dh))
    if state_v_first:
        hs, dhs = hs.transpose(-1, -2), dhs.transpose(-1, -2)  # [chunks, HV, K, V]
    dq, dk = torch.zeros(B, T, HV, K, dtype=f64), torch.zeros(B, T, HV, K, dtype=f64)
    dw = torch.zeros(B, T, HV, K, dtype=f64) if w is not None else None
    dg = torch.zeros(B, T, HV, dtype=f64) if g is not None else None
    for i, (b, c0, c1) in enumerate(_chunk_rows(B, T, chunk_size, cu_seqlens)):
        r, L = slice(c0, c1), c1 - c0
        Hc, dHc = hs[i], dhs[i]
        q_c, k_c, v_c, do_c = qh[b, r], kh[b, r], vv[b, r], dO[b, r]
        ds = torch.einsum("lhv,shv->hls", do_c, v_c)
        dq_c = torch.einsum("lhv,hkv->lhk", do_c, Hc)
        dk_c = torch.einsum("lhv,hkv->lhk", v_c, dHc)
        if dw is not None:
            dw[b, r] = -torch.einsum("lhv,hkv->lhk", dv[b, r].to(f64), Hc)
        causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
        if g is not None or g_gamma is not None:
            if g is not None:
                g_c = g[b, r].to(f64).transpose(0, 1)  # [HV, L]
            else:
                g_c = g_gamma.to(f64)[:, None] * torch.arange(1, L + 1, dtype=f64)[None, :]
            g_last = g_c[:, -1]
            dq_c = dq_c * torch.exp2(g_c).transpose(0, 1)[..., None] * scale
            dk_c = dk_c * torch.exp2(g_last[:, None] - g_c).transpose(0, 1)[..., None]
            dg_last = (Hc * dHc).sum((-1, -2)) * torch.exp2(g_last) + (dk_c * k_c).sum((0, 2))
            ds = torch.where(causal, ds * torch.exp2(g_c[:, :, None] - g_c[:, None, :]), 0.0) * scale
            dq_c = dq_c + torch.einsum("hls,shk->lhk", ds, k_c)
            dk_c = dk_c + torch.einsum("hls,lhk->shk", ds, q_c)
            if dg is not None:
                dg_c = (dq_c * q_c).sum(-1) - (dk_c * k_c).sum(-1)  # [L, HV]
                dg_c[-1] += dg_last
                dg[b, r] = dg_c
        else:
            ds = torch.where(causal, ds, 0.0)
            dq_c = (dq_c + torch.einsum("hls,shk->lhk", ds, k_c)) * scale
            dk_c = dk_c + torch.einsum("hls,lhk->shk", ds, q_c) * scale
        dq[b, r], dk[b, r] = dq_c, dk_c
    if group > 1:
        dq, dk = (x.view(B, T, H, group, K).sum(3) for x in (dq, dk))
    return (
        dq.to(q.dtype), dk.to(k.dtype), None if dw is None else dw.to(w.dtype),
        None if dg is None else dg.to(torch.float32),
    )  # fmt: skip
