"""Float64 references of the stages of FLA 0.6.0's chunked KDA backward (``fla.ops.kda.chunk_bwd.chunk_kda_bwd``).

cula's training path runs FLA's backward whole (``cula.kda.backends._ChunkKDATraining``). A backward of our own
replaces its stages one at a time (``docs/kernels/kda-backward.md``), and each replacement has to take and return
exactly what FLA's stage does, so that the rest of FLA's pipeline runs on unchanged. These functions pin those
contracts down in plain torch: the same arguments, shapes and units as FLA's stage, written from the math, and
checked against FLA's Triton kernel itself (run by Triton's interpreter on the CPU, ``tests/test_naive_bwd.py``).

Conventions of FLA's backward that these follow:

* ``g`` is the chunk-local cumulative gate in log2 units (FLA's ``g_cum``: ``2 ** g`` is the decay), restarting
  at every chunk of ``chunk_size`` tokens and at every sequence start of ``cu_seqlens``.
* Gate gradients are returned with respect to the natural-log gate ``G = g * ln 2``, i.e. ``(d loss / d g) / ln 2``;
  FLA's next stages (the reverse cumsum and the gate backward) take them in those units.
"""

from __future__ import annotations

import torch

from cula.kda.naive import kda_gate

__all__ = [
    "chunk_kda_bwd_dhu_reference", "chunk_kda_bwd_gate_reference", "chunk_kda_bwd_intra_reference",
    "chunk_kda_bwd_wy_dqkg_reference",
]


def _chunks(T: int, chunk_size: int, cu_seqlens: torch.Tensor | None):
    """(batch rows, first token, end) of every chunk: all rows of a fixed batch, or row 0 of a packed one whose
    sequences (``cu_seqlens``) restart the chunking."""
    if cu_seqlens is None:
        return [(slice(None), c, min(c + chunk_size, T)) for c in range(0, T, chunk_size)]
    bounds = [int(x) for x in cu_seqlens.tolist()]
    return [(slice(0, 1), c, min(c + chunk_size, eos)) for bos, eos in zip(bounds[:-1], bounds[1:])
            for c in range(bos, eos, chunk_size)]  # fmt: skip


def chunk_kda_bwd_dhu_reference(
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
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    r"""FLA's ``chunk_gated_delta_rule_bwd_dhu`` with KDA's per-channel gate ``gk`` (stage 5 of
    ``chunk_kda_bwd``): the state gradients chunk by chunk, last to first, and ``dv`` completed with the state term.

    Per sequence and value head, with ``dS`` the gradient of the state leaving chunk ``c`` (``dht`` or zero at the
    end) and ``gamma = 2 ** gk[last row]``, FLA's rounding points kept (``dS`` rounded to ``q``'s dtype for the
    ``k`` product and for ``dh``, ``dv2`` to ``dv``'s dtype for the ``w`` product)::

        dh[c] = dS
        dv2   = k @ dS + dv                                    # rows of chunk c
        dS    = gamma * dS + scale * q^T @ do - w^T @ dv2      # gamma scales dS's K rows

    Args:
        q, k: ``[B, T, HV, K]`` (FLA passes ``qg = q 2^gk`` and ``kg = k 2^(gk_last - gk)``).  w: ``[B, T, HV, K]``.
        do, dv: ``[B, T, HV, V]``.  gk: ``[B, T, HV, K]`` chunk-local log2 cumsum.
        h0: only whether there is one (then ``dh0`` is returned).  dht: ``[N, HV, K, V]`` or None.
        state_v_first: ``dh``, ``dht`` and ``dh0`` as ``[..., V, K]``.

    Returns:
        ``(dh [B, NT, HV, K, V] in q's dtype, dh0 float or None, dv2 in dv's dtype)``, as FLA's.
    """
    B, T, HV, K = q.shape
    V = do.shape[-1]
    scale = K**-0.5 if scale is None else scale
    f64 = torch.float64
    # (batch rows, first token, end, first chunk in dh, state rows) of every sequence
    if cu_seqlens is None:
        seqs = [(slice(None), 0, T, 0, slice(None))]
        NT = -(-T // chunk_size)
    else:
        bounds = [int(x) for x in cu_seqlens.tolist()]
        counts = [-(-(e - b) // chunk_size) for b, e in zip(bounds[:-1], bounds[1:])]
        seqs = [(slice(0, 1), b, e, sum(counts[:s]), slice(s, s + 1))
                for s, (b, e) in enumerate(zip(bounds[:-1], bounds[1:]))]  # fmt: skip
        NT = sum(counts)
    N = B if cu_seqlens is None else len(seqs)
    dh = torch.zeros(B, NT, HV, K, V, dtype=f64)
    dv2 = torch.zeros(B, T, HV, V, dtype=f64)
    dh0 = torch.zeros(N, HV, K, V, dtype=f64)
    for rows, bos, eos, first, srows in seqs:
        dS = torch.zeros_like(dh0[srows])
        if dht is not None:
            dS = dht[srows].to(f64).transpose(-1, -2) if state_v_first else dht[srows].to(f64)
        starts = list(range(bos, eos, chunk_size))
        for ci in range(len(starts) - 1, -1, -1):
            c0, c1 = starts[ci], min(starts[ci] + chunk_size, eos)
            dh[rows, first + ci] = dS
            dSr = dS.to(q.dtype).to(f64)
            kc, qc, wc = (x[rows, c0:c1].to(f64) for x in (k, q, w))  # [b, n, HV, K]
            dvn = torch.einsum("bnhk,bhkv->bnhv", kc, dSr) + dv[rows, c0:c1].to(f64)
            dv2[rows, c0:c1] = dvn
            dvr = dvn.to(dv.dtype).to(f64)
            gamma = torch.exp2(gk[rows, c1 - 1].to(f64))  # [b, HV, K]
            qdo = torch.einsum("bnhk,bnhv->bhkv", qc, do[rows, c0:c1].to(f64))
            dS = gamma[..., None] * dS + scale * qdo - torch.einsum("bnhk,bnhv->bhkv", wc, dvr)
        dh0[srows] = dS
    if state_v_first:
        dh, dh0 = dh.transpose(-1, -2), dh0.transpose(-1, -2)
    out = torch.promote_types(torch.float32, q.dtype)
    return dh.to(q.dtype), dh0.to(out) if h0 is not None else None, dv2.to(dv.dtype)


def chunk_kda_bwd_wy_dqkg_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    v_new: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A: torch.Tensor,
    h: torch.Tensor,
    do: torch.Tensor,
    dh: torch.Tensor,
    dv: torch.Tensor,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, ...]:
    r"""FLA's ``chunk_kda_bwd_wy_dqkg_fused`` (stage 6 of ``chunk_kda_bwd``): the gradients through a chunk's
    state terms and its WY representation.

    Per chunk and value head, with ``S = h[c]`` (the state entering the chunk, ``[K, V]``), ``dS = dh[c]`` (the
    gradient of the state leaving it), ``G = 2 ** g``, ``gamma = G[last row]`` and ``T = A`` (the chunk's
    ``(I + L)^-1``), the forward terms differentiated are::

        o_inter = scale * (q * G) @ S                         # against do
        S_next  = gamma * S + (k * gamma / G)^T @ v_new       # against dS (v_new held fixed: its gradient is dv)
        v_new   = T @ (beta * v) - T @ (beta * k * G) @ S     # against dv (the full gradient of v_new)

    and the returned ``dA`` is the gradient of ``L`` (strictly below the diagonal, through ``T = (I + L)^-1``),
    the input of stage 7's ``dAkk``. S, v_new and the score terms (stages 3, 4, 7) are someone else's.

    Args:
        q, k: ``[B, T, H, K]`` (after the l2 norm).  v, v_new, do, dv: ``[B, T, HV, V]``.
        g: ``[B, T, HV, K]`` fp32, chunk-local cumsum in log2 units.  beta: ``[B, T, HV]``.
        A: ``[B, T, HV, chunk_size]``: row ``t`` holds row ``t`` of its chunk's ``T`` by column offset.
        h, dh: ``[B, NT, HV, K, V]`` (``[B, NT, HV, V, K]`` with ``state_v_first``) per chunk; a packed batch
            (``cu_seqlens``, ``B == 1``) numbers its chunks across the sequences, in order.
        scale: defaults to ``K ** -0.5``.  cu_seqlens, chunk_size: as :func:`chunk_kda_bwd_intra_reference`.

    Returns:
        ``(dq, dk, dv, db, dg, dA)`` in FLA's order and shapes (``dq`` / ``dk`` per value head, ``[B, T, HV, K]``;
        ``dA`` zero on and above the diagonal and past a chunk's end), all in float32 (float64 for float64 inputs;
        FLA returns ``dv`` in ``v``'s dtype), ``dg`` in natural-log units.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[-1]
    group = HV // H
    scale = K**-0.5 if scale is None else scale
    f64 = torch.float64
    out = torch.promote_types(torch.float32, q.dtype)
    dq_o, dk_o, dg_o = (torch.zeros(B, T, HV, K, dtype=f64, device=q.device) for _ in range(3))
    dv_o = torch.zeros(B, T, HV, V, dtype=f64, device=q.device)
    db_o = torch.zeros(B, T, HV, dtype=f64, device=q.device)
    dA_o = torch.zeros(B, T, HV, chunk_size, dtype=f64, device=q.device)
    for c, (rows, c0, c1) in enumerate(_chunks(T, chunk_size, cu_seqlens)):
        n = c1 - c0
        strict = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)
        S, dS = (x[rows, c].to(f64) for x in (h, dh))  # [b, HV, K, V] (or V, K)
        if state_v_first:
            S, dS = S.transpose(-1, -2), dS.transpose(-1, -2)
        for hv in range(HV):
            qc, kc = (x[rows, c0:c1, hv // group].to(f64) for x in (q, k))  # [b, n, K]
            vc, vn, doc, du = (x[rows, c0:c1, hv].to(f64) for x in (v, v_new, do, dv))  # [b, n, V]
            gc, bc = g[rows, c0:c1, hv].to(f64), beta[rows, c0:c1, hv].to(f64)[..., None]
            Tm = A[rows, c0:c1, hv, :n].to(f64)  # [b, n, n]
            Sh, dSh = S[:, hv], dS[:, hv]  # [b, K, V]
            G, last = torch.exp2(gc), gc[:, -1:]
            kG = kc * G
            dq = scale * (doc @ Sh.transpose(-1, -2)) * G
            dk_kg = (vn @ dSh.transpose(-1, -2)) * torch.exp2(last - gc)  # through k * gamma / G
            dw = -(du @ Sh.transpose(-1, -2))  # d v_new / d w = -S
            dvb, dkgb = Tm.transpose(-1, -2) @ du, Tm.transpose(-1, -2) @ dw  # T^T du, T^T dw
            dT = (du @ vc.transpose(-1, -2) + dw @ kG.transpose(-1, -2)) * bc.transpose(-1, -2)  # beta by column
            dT = dT * strict  # T's diagonal is 1 and its upper part 0: no gradient flows there
            dL = -(Tm.transpose(-1, -2) @ dT @ Tm.transpose(-1, -2)) * strict
            dg = qc * dq - kc * dk_kg + kG * dkgb * bc
            # gamma = G[last] decays S into S_next and scales every k * gamma / G
            dg[:, -1] += torch.exp2(last[:, 0]) * (Sh * dSh).sum(-1) + (kc * dk_kg).sum(1)
            dq_o[rows, c0:c1, hv] = dq
            dk_o[rows, c0:c1, hv] = dk_kg + dkgb * G * bc
            dv_o[rows, c0:c1, hv] = dvb * bc
            db_o[rows, c0:c1, hv] = (dvb * vc).sum(-1) + (dkgb * kG).sum(-1)
            dg_o[rows, c0:c1, hv] = dg
            dA_o[rows, c0:c1, hv, :n] = dL
    return tuple(x.to(out) for x in (dq_o, dk_o, dv_o, db_o, dg_o, dA_o))


def chunk_kda_bwd_intra_reference(
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
    safe_gate: bool = False,
    lower_bound: float | None = None,
    use_graph: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""FLA's ``chunk_kda_bwd_intra`` (stage 7 of ``chunk_kda_bwd``): the gradients through the intra-chunk scores.

    Within a chunk, per value head and key channel ``i`` (``E[t, s, i] = 2 ** (g[t, i] - g[s, i])``, ``s <= t``)::

        P[t, s] = sum_i q[t, i] k[s, i] E[t, s, i]             # Aqk before its scale
        L[t, s] = beta[t] sum_i k[t, i] k[s, i] E[t, s, i]      # the WY system's matrix (Akk)

    and ``dAqk`` / ``dAkk`` are the loss gradients with respect to ``P`` and ``L`` on and below the diagonal
    (FLA's kernel reads the diagonal of ``dAkk`` too: it changes ``dk`` and ``db``, not ``dg``; entries above the
    diagonal are ignored). Returns ``dq + dP/dq``, ``dk + ...``, ``db + ...`` and ``dg + ...`` for the incoming
    accumulations (stage 6's), the gate part in natural-log units (see the module docstring).

    Args:
        q, k: ``[B, T, H, K]`` (after the l2 norm).  g: ``[B, T, HV, K]`` fp32, chunk-local cumsum in log2 units.
        beta: ``[B, T, HV]``.  dAqk, dAkk: ``[B, T, HV, chunk_size]``: row ``t`` holds ``d/dP[t, s]`` for the
            tokens ``s`` of its chunk, by their offset in it.
        dq, dk, dg: ``[B, T, HV, K]``; db: ``[B, T, HV]``: the accumulations to add to (not modified).
        cu_seqlens: ``[N + 1]`` sequence boundaries of a packed batch (``B == 1``), or None.
        chunk_indices, safe_gate, lower_bound, use_graph: FLA's, taken in its order and not read: the chunks come
            from ``cu_seqlens``, and the other three choose how FLA's kernel computes the same numbers.
        chunk_size: FLA's ``BT`` (64).

    Returns:
        ``(dq, dk, db, dg)`` in the accumulations' dtypes and shapes; ``dq`` / ``dk`` per value head (FLA sums
        them over the GVA group after this stage).
    """
    B, T, H, K = q.shape
    HV = g.shape[2]
    group = HV // H
    f64 = torch.float64
    out_q, out_k, out_b, out_g = (x.to(f64).clone() for x in (dq, dk, db, dg))
    for rows, c0, c1 in _chunks(T, chunk_size, cu_seqlens):
        n = c1 - c0
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        for hv in range(HV):
            h = hv // group
            qc, kc = q[rows, c0:c1, h].to(f64), k[rows, c0:c1, h].to(f64)  # [b, n, K]
            gc, bc = g[rows, c0:c1, hv].to(f64), beta[rows, c0:c1, hv].to(f64)
            diff = gc[:, :, None, :] - gc[:, None, :, :]  # [b, t, s, K]
            E = torch.exp2(diff.masked_fill(~causal[None, :, :, None], float("-inf")))  # 0 above the diagonal
            dP = dAqk[rows, c0:c1, hv, :n].to(f64) * causal
            dL = dAkk[rows, c0:c1, hv, :n].to(f64) * causal
            dq_intra = torch.einsum("bts,btsi,bsi->bti", dP, E, kc)
            dk_p = torch.einsum("bts,btsi,bti->bsi", dP, E, qc)  # k as the score's column
            row_l = torch.einsum("bts,btsi,bsi->bti", dL, E, kc)  # sum_s dL[t, s] k[s] E[t, s], before beta[t]
            col_l = torch.einsum("bts,bt,btsi,bti->bsi", dL, bc, E, kc)
            out_q[rows, c0:c1, hv] += dq_intra
            out_k[rows, c0:c1, hv] += bc[..., None] * row_l + dk_p + col_l
            out_b[rows, c0:c1, hv] += (row_l * kc).sum(-1)
            out_g[rows, c0:c1, hv] += qc * dq_intra - kc * dk_p + kc * (bc[..., None] * row_l - col_l)
    return out_q.to(dq.dtype), out_k.to(dk.dtype), out_b.to(db.dtype), out_g.to(dg.dtype)


def chunk_kda_bwd_gate_reference(
    dg: torch.Tensor,
    g_raw: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    r"""The last two stages of FLA's ``chunk_kda_bwd`` with the gate in the kernel: ``chunk_local_cumsum(dg,
    reverse=True)`` (the gradient of the chunk-local cumsum: ``da[t] = sum of dg[t']`` over the chunk's
    ``t' >= t``) and ``kda_gate_bwd`` (through the activation of :func:`cula.kda.naive.kda_gate`).

    Args:
        dg: ``[B, T, HV, K]`` gradient for the cumulative natural-log gate (stage 7's output).
        g_raw: ``[B, T, HV, K]`` raw gate logits.  A_log: ``[HV]``.  dt_bias: ``[HV * K]``.
        lower_bound: the sigmoid gate's bound, or None for the softplus gate (as :func:`kda_gate`).
        cu_seqlens, chunk_size: as :func:`chunk_kda_bwd_intra_reference`.

    Returns:
        ``(dg_raw, dA_log, ddt_bias)``: ``dg_raw`` in ``g_raw``'s dtype and shape, ``dA_log`` / ``ddt_bias`` in
        their parameters' dtypes (None where the parameter is None).
    """
    f64 = torch.float64
    da = torch.zeros_like(dg, dtype=f64)
    for rows, c0, c1 in _chunks(dg.shape[1], chunk_size, cu_seqlens):
        da[rows, c0:c1] = dg[rows, c0:c1].to(f64).flip(1).cumsum(1).flip(1)
    x = g_raw.detach().to(f64).requires_grad_()
    params = [p.detach().to(f64).requires_grad_() if p is not None else None for p in (A_log, dt_bias)]
    a = kda_gate(x, params[0], params[1], lower_bound)
    grads = torch.autograd.grad(a, [x, *(p for p in params if p is not None)], da)
    dx, rest = grads[0], list(grads[1:])
    dparams = [rest.pop(0).to(p.dtype) if p is not None else None for p in (A_log, dt_bias)]
    return dx.to(g_raw.dtype), dparams[0], dparams[1]
