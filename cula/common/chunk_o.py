"""The dq / dk / dw / dg stage of the chunked delta-rule and Simple GLA backwards (FLA 0.6.0's
``fla.ops.common.chunk_o.chunk_bwd_dqkwg``), for the gated case FLA refuses on Hopper.

FLA's Gated DeltaNet, Simple GLA (data-dependent ``g``), Comba and preconditioned Gated DeltaNet backwards
turn the per-chunk states ``h`` and their gradients ``dh`` into dq, dk, dw and dg with this stage. With a
gate, FLA 0.6.0 raises on Hopper under Triton 3.4.0 to 3.7.0 (its Triton kernel gives wrong results there, FLA
issue #640), which is the Triton PyTorch 2.11 ships, unless TileLang is installed. ``chunk_bwd_dqkwg`` here
takes and returns exactly what FLA's does (the contract:
``cula.gated_delta_rule.naive_bwd.chunk_bwd_dqkwg_reference``, itself checked against FLA's kernel under
Triton's interpreter), so FLA's other stages run on unchanged; ``cula.fla_dispatch`` hands it the calls FLA's
Triton kernel would refuse.

It is batched matrix products in fp32 over every (chunk, value head), no custom kernel: per chunk of ``BT``
rows, with ``ds = do v^T`` masked causal and the chunk-local base-2 gate ``g``::

    dq = scale 2^g (do h^T) + scale (ds o 2^(g_i - g_j)) k
    dk = 2^(g_last - g) (v dh^T) + scale (ds o 2^(g_i - g_j))^T q
    dw = -dv h^T
    dg = rowsum(dq o q) - rowsum(dk o k),
         the chunk's last row + 2^g_last <h, dh> + sum(2^(g_last - g) (v dh^T) o k)

Chunks are gathered from their sequences (fixed length or ``cu_seqlens``) into ``[chunks, BT]`` rows on the
device, no host read of the boundaries beyond FLA's own chunk list, and worked through in slices that bound
the fp32 temporaries to about a gigabyte.
"""

from __future__ import annotations

import numbers

import torch

from cula._validate import INDEX_DTYPES, check_qkv, check_scale, check_tensor
from cula.backends import without_autocast

__all__ = ["chunk_bwd_dqkwg"]

# (chunk, value head) pairs a slice works on: its fp32 temporaries are a few [pairs, BT, 128] and
# [pairs, 128, 128]
_PAIRS_PER_SLICE = 4096


# (fp32 products whatever autocast says: FLA's backwards re-enter the forward's autocast state)
@without_autocast
def chunk_bwd_dqkwg(
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
    cu_seqlens: torch.LongTensor | None = None,
    chunk_size: int = 64,
    chunk_indices: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dq, dk, dw, dg)`` as FLA 0.6.0's ``chunk_bwd_dqkwg`` returns them, same arguments.

    Args:
        q, k: ``[B, T, H, K]``. v, do: ``[B, T, HV, V]`` (``HV % H == 0``: GVA).
        h, dh: the state before each chunk and its gradient, ``[B, NT, HV, K, V]`` (``[.., V, K]`` with
            ``state_v_first``; packed: ``[1, chunks, ...]`` in ``cu_seqlens`` order).
        w, dv: ``[B, T, HV, K]`` / ``[B, T, HV, V]``: with ``w``, ``dw = -dv h^T`` is returned in w's dtype.
        g: ``[B, T, HV]`` chunk-local cumulative gate, base 2. g_gamma: ``[HV]`` constant decay (the gate
            ``g_gamma (t + 1)``); neither: no gate.
        cu_seqlens / chunk_indices: packed sequences (B = 1) and FLA's ``[chunks, 2]`` (sequence, chunk) list.

    Returns:
        dq, dk ``[B, T, H, K]`` in q's / k's dtype (a GVA group's value heads summed); dw ``[B, T, HV, K]`` or
        None; dg ``[B, T, HV]`` fp32 (per token, before FLA's reverse cumsum) or None without ``g``.
    """
    B, T, H, K, HV, V = _check_args(q, k, v, do, h, dh, w, g, g_gamma, dv, state_v_first, cu_seqlens, chunk_size,
                                    chunk_indices)
    # (FLA's backwards hand a Python float; a NumPy scalar as FLA's float() took it)
    scale = check_scale(float(scale) if isinstance(scale, numbers.Real) else scale, K)
    dev, BT, group = q.device, chunk_size, HV // H
    pos, valid, last = _chunk_rows(B, T, BT, cu_seqlens, chunk_indices, dev)
    states = h.reshape(-1, HV, *h.shape[-2:])
    if states.shape[0] != pos.shape[0]:
        raise ValueError(f"h holds {states.shape[0]} chunk states, the sequences have {pos.shape[0]} chunks")
    dstates = dh.reshape(states.shape)
    flat = lambda x: None if x is None else x.reshape(B * T, *x.shape[2:])  # noqa: E731
    qf, kf, vf, dof, dvf, gf = flat(q), flat(k), flat(v), flat(do), flat(dv), flat(g)

    dq = torch.zeros(B * T, HV, K, dtype=torch.float32, device=dev)
    dk = torch.zeros_like(dq)
    dw = torch.zeros(B * T, HV, K, dtype=w.dtype, device=dev) if w is not None else None
    dg = torch.zeros(B * T, HV, dtype=torch.float32, device=dev) if g is not None else None
    gamma = None if g_gamma is None else g_gamma.float().to(dev)
    step = max(1, _PAIRS_PER_SLICE // HV)
    for lo in range(0, pos.shape[0], step):
        rows, ok, end = pos[lo : lo + step], valid[lo : lo + step], last[lo : lo + step]
        S = states[lo : lo + step].float()
        dS = dstates[lo : lo + step].float()
        if not state_v_first:
            S, dS = S.transpose(-1, -2), dS.transpose(-1, -2)  # [n, HV, V, K]

        def take(x, heads):  # [n, heads, BT, D] fp32 rows of x, zero past a sequence's end
            t = x[rows].float()
            return torch.where(ok[:, :, None, None], t, 0.0).repeat_interleave(heads, dim=2).transpose(1, 2)

        qc, kc, vc, doc = take(qf, group), take(kf, group), take(vf, 1), take(dof, 1)
        dqc = doc @ S  # do h^T, [n, HV, BT, K]
        dkc = vc @ dS  # v dh^T
        ds = (doc @ vc.transpose(-1, -2)).tril()  # [n, HV, BT(i), BT(j)], j <= i
        if dw is not None:
            dwc = -(take(dvf, 1) @ S)
            _scatter(dw, rows, ok, dwc.transpose(1, 2))
        if g is not None or gamma is not None:
            if g is not None:
                gc = torch.where(ok[:, :, None], gf[rows].float(), 0.0).transpose(1, 2)  # [n, HV, BT]
                g_last = gf[end].float()  # [n, HV]
            else:
                gc = gamma[None, :, None] * torch.arange(1, BT + 1, device=dev, dtype=torch.float32)
                gc = gc.expand(rows.shape[0], HV, BT)
                g_last = gamma[None, :] * ok.sum(1, keepdim=True).float()
            dqc = dqc * (torch.exp2(gc)[..., None] * scale)
            dkc = dkc * torch.exp2(g_last[..., None] - gc)[..., None]
            dkc = torch.where(ok[:, None, :, None], dkc, 0.0)
            # 2^(g_i - g_j) only where j <= i and both rows are in the sequence: elsewhere the exponent is
            # unbounded (a padded row's g is 0, far above a strong gate's cumsum) and 0 * inf would be NaN
            causal = torch.ones(BT, BT, dtype=torch.bool, device=dev).tril()
            pair = causal & ok[:, None, :, None] & ok[:, None, None, :]
            diff = torch.where(pair, gc[..., :, None] - gc[..., None, :], 0.0)
            ds = torch.where(pair, ds * torch.exp2(diff), 0.0) * scale
            if dg is not None:
                dg_last = (S * dS).sum((-1, -2)) * torch.exp2(g_last) + (dkc * kc).sum((-1, -2))
            dqc = dqc + ds @ kc
            dkc = dkc + ds.transpose(-1, -2) @ qc
            if dg is not None:
                dgc = (dqc * qc).sum(-1) - (dkc * kc).sum(-1)  # [n, HV, BT]
                dgc = dgc.transpose(1, 2).contiguous()  # [n, BT, HV]
                dgc[torch.arange(rows.shape[0], device=dev), ok.sum(1) - 1] += dg_last
                _scatter(dg, rows, ok, dgc)
        else:
            dqc = (dqc + ds @ kc) * scale
            dkc = dkc + (ds.transpose(-1, -2) @ qc) * scale
        _scatter(dq, rows, ok, dqc.transpose(1, 2))
        _scatter(dk, rows, ok, dkc.transpose(1, 2))
    dq, dk = dq.view(B, T, H, group, K).sum(3), dk.view(B, T, H, group, K).sum(3)
    return (
        dq.to(q.dtype), dk.to(k.dtype), None if dw is None else dw.view(B, T, HV, K),
        None if dg is None else dg.view(B, T, HV),
    )  # fmt: skip


def _check_args(q, k, v, do, h, dh, w, g, g_gamma, dv, state_v_first, cu_seqlens, chunk_size, chunk_indices):
    """Shapes, dtypes and devices of the arguments, named, before any work (FLA's kernel trusts its callers; this
    stage is also public). Boundary values are FLA's chunk list's to be right: reading them would cost a host
    sync a call."""
    B, T, H, K, HV, V = check_qkv(q, k, v, head_limit=None, mixed=True)
    dev = q.device
    check_tensor("do", do, shape=(B, T, HV, V), device=dev)
    if w is not None:
        if dv is None:
            raise ValueError("`w` needs `dv` (dw = -dv h^T)")
        check_tensor("w", w, shape=(B, T, HV, K), device=dev)
    if dv is not None:
        check_tensor("dv", dv, shape=(B, T, HV, V), device=dev)
    if g is not None:
        check_tensor("g", g, shape=(B, T, HV), device=dev)
    if g_gamma is not None:
        check_tensor("g_gamma", g_gamma, shape=(HV,))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"`chunk_size` must be a positive int, got {chunk_size!r}")
    box = (V, K) if state_v_first else (K, V)
    check_tensor("h", h, ndim=5, device=dev, contiguous_last=False)
    if tuple(h.shape[2:]) != (HV, *box) or (cu_seqlens is None and h.shape[0] != B):
        layout = "[B, NT, HV, V, K] (state_v_first=True)" if state_v_first else "[B, NT, HV, K, V]"
        raise ValueError(f"`h` must have shape {layout} with B={B}, HV={HV}, K={K}, V={V}, got {list(h.shape)}")
    check_tensor("dh", dh, shape=tuple(h.shape), device=dev, contiguous_last=False)
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=INDEX_DTYPES, device=dev)
        if B != 1:
            raise ValueError(f"packed sequences (`cu_seqlens`) need B = 1, got B={B}")
        if cu_seqlens.numel() < 2:
            raise ValueError(f"`cu_seqlens` needs at least 2 entries ([0, T]), got {cu_seqlens.numel()}")
    if chunk_indices is not None:
        if cu_seqlens is None:
            raise ValueError("`chunk_indices` was given without `cu_seqlens`")
        check_tensor("chunk_indices", chunk_indices, shape=(None, 2), dtypes=INDEX_DTYPES, contiguous_last=False)
    return B, T, H, K, HV, V


def _chunk_rows(B, T, BT, cu_seqlens, chunk_indices, dev):
    """Token rows of every chunk in FLA's state order: ``pos`` ``[chunks, BT]`` (flat token index, 0 where
    past the sequence's end), ``valid`` ``[chunks, BT]`` and ``last`` ``[chunks]`` (the chunk's last
    token)."""
    if cu_seqlens is None:
        nt = -(-T // BT)
        seq = torch.arange(B, device=dev).repeat_interleave(nt)
        chunk = torch.arange(nt, device=dev).repeat(B)
        start, end = seq * T + chunk * BT, seq * T + T
    else:
        if chunk_indices is None:
            from fla.ops.utils.index import prepare_chunk_indices

            chunk_indices = prepare_chunk_indices(cu_seqlens, BT)
        cu = cu_seqlens.to(device=dev, dtype=torch.long)
        seq, chunk = chunk_indices.to(dev).long().unbind(-1)
        start, end = cu[seq] + chunk * BT, cu[seq + 1]
    pos = start[:, None] + torch.arange(BT, device=dev)
    valid = pos < end[:, None]
    last = torch.minimum(start + BT, end) - 1
    return torch.where(valid, pos, 0), valid, last


def _scatter(out: torch.Tensor, rows: torch.Tensor, ok: torch.Tensor, values: torch.Tensor) -> None:
    """``out[rows] = values`` for the valid rows (``values`` ``[n, BT, ...]``)."""
    out[rows[ok]] = values[ok].to(out.dtype)
