"""PyTorch references for KDA (Kimi Delta Attention) and the gated linear recurrences built on it.

These functions are the CPU path of ``cula.kda.chunk_kda`` and the gold that the GPU kernels are tested
against, so they are written for clarity and exactness rather than speed: pure differentiable torch ops
(autograd works through every function), float64 when the inputs are float64, and one Python loop over
time steps (recurrent form) or chunks (chunk form), vectorised over sequences and heads.

The general recurrence, per value head, with state ``S`` in ``[K, V]`` orientation::

    S <- diag(exp(gk_t)) S diag(exp(gv_t))          # log-space decays on the K and/or V axis
    u_t = beta_t * (v_t - S^T k_t)   (delta rule)   or   u_t = v_t   (plain linear attention)
    S <- S + k_t u_t^T
    o_t = S^T (scale * q_t)

KDA is the delta rule with a per-key-channel decay ``gk = g``. Gated DeltaNet (scalar gate broadcast over
K), Simple GLA and Lightning attention (no delta rule, scalar or constant gate) are thin wrappers over
:func:`recurrent_linear_attention` and :func:`chunk_linear_attention` defined here
(``cula/gated_delta_rule/naive.py``, ``cula/simple_gla/naive.py``, ``cula/lightning/naive.py``).

Conventions shared by every function (they follow FLA 0.6.0):

* Inputs are time-major: q/k ``[B, T, H, K]``, v ``[B, T, HV, V]``, HV % H == 0 (GVA: value head ``hv``
  reads q/k head ``hv // (HV // H)``).
* Varlen: ``cu_seqlens [N+1]`` (any integer dtype) with B == 1 and packed inputs ``[1, sum(T), ...]``;
  sequences of length 0 or 1 are allowed. ``initial_state`` then has N rows.
* State: ``[N, HV, K, V]``, or ``[N, HV, V, K]`` when ``state_v_first=True`` (a pure layout choice).
* Computation dtype: ``torch.promote_types(q.dtype, torch.float32)`` unless ``compute_dtype`` is given.
  ``naive_*`` functions return ``o`` and the final state in the compute dtype; ``reference_*`` entry
  points return ``o`` in ``q.dtype`` and the final state in float32, like FLA.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from cula.backends import without_autocast

__all__ = [
    "beta_activation",
    "chunk_linear_attention",
    "kda_gate",
    "l2norm",
    "naive_chunk_kda",
    "naive_recurrent_kda",
    "recurrent_linear_attention",
    "reference_chunk_kda",
]


# ----------------------------------------------------------------------------------------------------
# Preprocessing (FLA's in-kernel activations, written as plain torch)
# ----------------------------------------------------------------------------------------------------


def _float_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """KDA forget-gate activation: raw logits -> log-space per-channel decay.

    Matches ``fla.ops.kda.gate.naive_kda_gate`` (``lower_bound=None``) and ``naive_kda_lowerbound_gate``::

        lower_bound is None:  -exp(A_log)[:, None] * softplus(g + dt_bias)        (A_log required)
        lower_bound set:      lower_bound * sigmoid(exp(A_log)[:, None] * (g + dt_bias))
                              lower_bound * sigmoid(g + dt_bias)                  (A_log is None)

    ``softplus`` is ``F.softplus`` (returns x for x > 20), the same threshold as FLA's Triton softplus.

    Args:
        g: ``[..., HV, K]`` raw gate logits, any float dtype.
        A_log: ``[HV]`` log decay rate per value head.
        dt_bias: optional ``[HV * K]`` (or ``[HV, K]``) bias added to ``g`` before the activation.
        lower_bound: selects the bounded sigmoid gate with range ``(lower_bound, 0)``.

    Returns:
        ``[..., HV, K]`` log-space gate (<= 0), float32, or float64 when ``g`` is float64.
    """
    HV, K = g.shape[-2:]
    dtype = _float_dtype(g)
    x = g.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).reshape(HV, K)
    if lower_bound is None:
        if A_log is None:
            raise ValueError("kda_gate: `A_log` is required unless `lower_bound` is set.")
        return -A_log.to(dtype).reshape(HV, 1).exp() * F.softplus(x)
    if A_log is not None:
        x = A_log.to(dtype).reshape(HV, 1).exp() * x
    return lower_bound * torch.sigmoid(x)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim: FLA's ``l2norm_fwd`` (eps inside the sqrt)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def beta_activation(beta: torch.Tensor, allow_neg_eigval: bool = False) -> torch.Tensor:
    """``sigmoid(beta)``, or ``2 * sigmoid(beta)`` (range ``(0, 2)``) with ``allow_neg_eigval``."""
    b = torch.sigmoid(beta)
    return 2.0 * b if allow_neg_eigval else b


# ----------------------------------------------------------------------------------------------------
# Varlen / reverse packing
# ----------------------------------------------------------------------------------------------------


class _Sequences:
    """Maps time-major ``[B, T, ...]`` inputs to a zero-padded dense batch ``[N, T_max, ...]`` and back.

    Trailing padding is harmless to both recurrences: a padded step has k = 0 and a log decay of 0, so it
    leaves the state unchanged, and its outputs are dropped. ``reverse`` flips each sequence in time.
    Indexing is by gather, so gradients flow back to the packed tensors.
    """

    def __init__(self, B: int, T: int, cu_seqlens: torch.Tensor | None, reverse: bool, device):
        self.cu_seqlens = cu_seqlens
        self.reverse = reverse
        if cu_seqlens is None:
            self.N, self.T_max = B, T
            return
        if B != 1:
            raise ValueError(
                f"The batch size is expected to be 1 rather than {B} when using `cu_seqlens`; "
                "flatten variable-length inputs to [1, sum(T), ...] first."
            )
        bounds = [int(x) for x in cu_seqlens.tolist()]
        if len(bounds) < 1 or bounds[0] != 0 or bounds[-1] != T:
            raise ValueError(f"cu_seqlens must start at 0 and end at T={T}, got {bounds}")
        lens = [e - s for s, e in itertools.pairwise(bounds)]
        if any(n < 0 for n in lens):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
        self.N = len(lens)
        self.T_max = max(lens, default=0)
        starts = torch.tensor(bounds[:-1], dtype=torch.long, device=device)
        lens_t = torch.tensor(lens, dtype=torch.long, device=device)
        j = torch.arange(self.T_max, dtype=torch.long, device=device)
        # padded[n, j] = packed[src[n, j]] for j < len[n]
        self.valid = j[None, :] < lens_t[:, None]
        offs = (lens_t[:, None] - 1 - j[None, :]) if reverse else j[None, :].expand(self.N, -1)
        self.src = torch.where(self.valid, starts[:, None] + offs, torch.zeros_like(offs))
        # packed[p] = padded[seq[p], pos[p]]
        self.seq = torch.repeat_interleave(torch.arange(self.N, device=device), lens_t)
        p = torch.arange(T, dtype=torch.long, device=device)
        local = p - starts[self.seq]
        self.pos = (lens_t[self.seq] - 1 - local) if reverse else local

    def pad(self, x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None:
            return None
        if self.cu_seqlens is None:
            return x.flip(1) if self.reverse else x
        y = x[0][self.src]
        mask = self.valid.reshape(*self.valid.shape, *([1] * (y.dim() - 2)))
        return torch.where(mask, y, torch.zeros((), dtype=y.dtype, device=y.device))

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        if self.cu_seqlens is None:
            return y.flip(1) if self.reverse else y
        return y[self.seq, self.pos][None]


# ----------------------------------------------------------------------------------------------------
# Cores: dense batch, head-expanded, compute dtype, state [B, HV, K, V]
# ----------------------------------------------------------------------------------------------------


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp with arguments below log(tiny) / 2 flushed to exactly 0.

    Strong decays otherwise make subnormal numbers, which slow CPU arithmetic down by orders of
    magnitude. A flushed term is below 1e-19 (float32) or 1e-154 (float64), far under the rounding of the
    O(1) terms it is added to (every row of the chunk form has a diagonal term with decay exp(0) = 1).
    """
    cutoff = 0.5 * math.log(torch.finfo(x.dtype).tiny)
    return x.masked_fill(x < cutoff, float("-inf")).exp()


def _expand_heads(x: torch.Tensor, HV: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, T, HV, D]: value head hv reads head hv // (HV // H)."""
    H = x.shape[2]
    return x if H == HV else x.repeat_interleave(HV // H, dim=2)


def _recurrent_core(q, k, v, gk, gv, beta, scale, h0, delta_rule):
    B, T, HV, V = v.shape
    K = q.shape[-1]
    q = _expand_heads(q, HV) * scale
    k = _expand_heads(k, HV)
    S = h0 if h0 is not None else q.new_zeros(B, HV, K, V)
    if beta is not None and beta.dim() == 3:
        beta = beta[..., None]
    outs = []
    for t in range(T):
        if gk is not None:
            S = S * _exp(gk[:, t])[..., :, None]
        if gv is not None:
            S = S * _exp(gv[:, t])[..., None, :]
        k_t = k[:, t]
        if delta_rule:
            u = beta[:, t] * (v[:, t] - (S.transpose(-1, -2) @ k_t[..., None])[..., 0])
        else:
            u = v[:, t]
        S = S + k_t[..., :, None] * u[..., None, :]
        outs.append((S.transpose(-1, -2) @ q[:, t][..., None])[..., 0])
    o = torch.stack(outs, dim=1) if outs else _no_tokens(v, q, k, gk, gv, beta)
    return o, S


def _chunk_step(q_n, k_n, v_n, G_n, b_n, S):
    """One chunk of :func:`_chunk_core` (``b_n`` None without the delta rule): its outputs and the next state."""
    C = q_n.shape[-2]
    incl = torch.ones(C, C, dtype=torch.bool, device=q_n.device).tril()
    diff = (G_n[..., :, None, :] - G_n[..., None, :, :]).masked_fill(~incl[..., None], 0.0)
    # DK[i, j, :] = exp(Gam_i - Gam_j) * k_j, contracted with q_i / k_i (no 5-D product temporaries)
    DK = _exp(diff) * k_n[..., None, :, :]  # [B, HV, C(i), C(j), K]
    Aqk = torch.einsum("bhijd,bhid->bhij", DK, q_n).masked_fill(~incl, 0.0)
    if b_n is not None:
        b_n = b_n[..., None]  # [B, HV, C, 1]
        Akk = torch.einsum("bhijd,bhid->bhij", DK, k_n).masked_fill(~incl.tril(-1), 0.0)
        eye = torch.eye(C, dtype=q_n.dtype, device=q_n.device)
        rhs = torch.cat([k_n * _exp(G_n), v_n], dim=-1) * b_n
        wu = torch.linalg.solve_triangular(eye + b_n * Akk, rhs, upper=False, unitriangular=True)
        w, u = wu.split([k_n.shape[-1], v_n.shape[-1]], dim=-1)
        v_new = u - w @ S
    else:
        v_new = v_n
    o_n = (q_n * _exp(G_n)) @ S + Aqk @ v_new
    G_C = G_n[..., -1:, :]  # [B, HV, 1, K]
    return o_n, S * _exp(G_C).transpose(-1, -2) + (k_n * _exp(G_C - G_n)).transpose(-1, -2) @ v_new


def _chunk_core(q, k, v, gk, beta, scale, h0, delta_rule, chunk_size):
    """Chunkwise (WY / UT-transform) form; equal to ``_recurrent_core`` up to rounding.

    Per chunk of C steps, with Gam the in-chunk inclusive cumsum of gk (one row per step):
      D[i, j]   = exp(Gam_i - Gam_j) (per channel), used only for j <= i, so it never overflows
      Akk[i, j] = sum_d k_i k_j D[i, j]  (j < i),   Aqk[i, j] = sum_d q_i k_j D[i, j]  (j <= i)
      (I + diag(beta) Akk) [w | u] = diag(beta) [k * exp(Gam) | v]
      v_new = u - w S;  o = (q * exp(Gam)) S + Aqk v_new
      S <- diag(exp(Gam_C)) S + (k * exp(Gam_C - Gam))^T v_new
    Without the delta rule w = 0 and u = v.
    """
    B, T, HV, V = v.shape
    K = q.shape[-1]
    C = chunk_size
    NT = -(-T // C)
    pad = NT * C - T
    q = _expand_heads(q, HV) * scale
    k = _expand_heads(k, HV)
    if gk is None:
        gk = q.new_zeros(B, T, HV, K)

    def chunked(x):
        # [B, T, HV, ...] -> [B, HV, NT, C, ...]; padded steps are zeros (no decay, no write)
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(B, NT, C, *x.shape[2:]).movedim(3, 1)

    qc, kc, vc, gc = (chunked(x) for x in (q, k, v, gk))
    bc = chunked(beta) if delta_rule else None  # [B, HV, NT, C]
    # A step's log decay below _exp's flush point decays everything before it to 0 all the same; clamped there,
    # a hard reset (-inf) or a huge decay in a chunk no longer cancels in Gam_i - Gam_j (NaN from -inf - -inf,
    # lost digits from -1e8 + 1e8). NaN stays NaN.
    Gam = gc.clamp_min(0.5 * math.log(torch.finfo(gc.dtype).tiny)).cumsum(-2)

    # under autograd each chunk's step is recomputed in the backward instead of saving its [C, C, K] temporaries:
    # float64 references of long many-head calls (FLA's 8192-token, 96-head test) would otherwise keep hundreds of GB
    step = _chunk_step
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, gk, beta, h0)):
        step = functools.partial(torch.utils.checkpoint.checkpoint, _chunk_step, use_reentrant=False)
    S = h0 if h0 is not None else q.new_zeros(B, HV, K, V)
    outs = []
    for n in range(NT):
        o_n, S = step(qc[:, :, n], kc[:, :, n], vc[:, :, n], Gam[:, :, n], bc[:, :, n] if delta_rule else None, S)
        outs.append(o_n)
    if outs:  # (row-major, as FLA's o: a transposed view would also keep the padded rows alive)
        o = torch.stack(outs, dim=2).reshape(B, HV, NT * C, V)[:, :, :T].transpose(1, 2).contiguous()
    else:
        o = _no_tokens(v, q, k, gk, beta)
    return o, S


def _no_tokens(v: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
    """The empty output of a call with no tokens, recorded by autograd on the token inputs as FLA's is (its gradients
    are empty tensors, and ``o.sum().backward()`` works)."""
    o = v * 0
    for t in inputs:
        if t is not None:
            o = o + t.sum() * 0
    return o


# ----------------------------------------------------------------------------------------------------
# General drivers (shared by KDA, GDN, Simple GLA, Lightning)
# ----------------------------------------------------------------------------------------------------


def _check_shapes(q, k, v, gk, gv, beta, initial_state, N, state_v_first):
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T) or v.shape[2] % H != 0:
        raise ValueError(f"v must be [B, T, HV, V] with HV % H == 0 (H={H}), got {tuple(v.shape)}")
    HV, V = v.shape[2:]
    if gk is not None and gk.shape != (B, T, HV, K):
        raise ValueError(f"key-axis gate must be [B, T, HV, K]={[B, T, HV, K]}, got {list(gk.shape)}")
    if gv is not None and gv.shape != (B, T, HV, V):
        raise ValueError(f"value-axis gate must be [B, T, HV, V]={[B, T, HV, V]}, got {list(gv.shape)}")
    if beta is not None and beta.shape not in ((B, T, HV), (B, T, HV, V)):
        raise ValueError(f"beta must be [B, T, HV] or [B, T, HV, V] (HV={HV}), got {list(beta.shape)}")
    if initial_state is not None:
        want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        if tuple(initial_state.shape) != want:
            layout = "[N, HV, V, K]" if state_v_first else "[N, HV, K, V]"
            raise ValueError(f"initial_state must be {layout}={list(want)}, got {list(initial_state.shape)}")


@without_autocast
def _run(
    form,
    q,
    k,
    v,
    gk,
    gv,
    beta,
    scale,
    initial_state,
    output_final_state,
    state_v_first,
    cu_seqlens,
    reverse,
    compute_dtype,
    delta_rule,
    chunk_size,
):
    B, T = q.shape[:2]
    seqs = _Sequences(B, T, cu_seqlens, reverse, q.device)
    _check_shapes(q, k, v, gk, gv, beta, initial_state, seqs.N, state_v_first)
    dtype = compute_dtype if compute_dtype is not None else _float_dtype(q)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    cast = [None if x is None else seqs.pad(x.to(dtype)) for x in (q, k, v, gk, gv, beta)]
    h0 = None
    if initial_state is not None:
        h0 = initial_state.to(dtype)
        if state_v_first:
            h0 = h0.transpose(-1, -2)
    if form == "recurrent":
        o, S = _recurrent_core(*cast, scale, h0, delta_rule)
    elif form == "chunk":
        if cast[4] is not None:
            raise ValueError("the chunk form supports key-axis gates only (no value-axis gate gv)")
        if delta_rule and cast[5].dim() != 3:
            raise ValueError("the chunk form supports head-wise beta [B, T, HV] only")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        o, S = _chunk_core(*cast[:4], cast[5], scale, h0, delta_rule, chunk_size)
    else:
        raise ValueError(f"form must be 'chunk' or 'recurrent', got {form!r}")
    o = seqs.unpad(o)
    if not output_final_state:
        return o, None
    return o, (S.transpose(-1, -2) if state_v_first else S)


def recurrent_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    reverse: bool = False,
    delta_rule: bool = True,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token gated linear attention / delta rule (the module docstring's recurrence).

    Args:
        q, k: ``[B, T, H, K]``.
        v: ``[B, T, HV, V]``.
        gk: optional ``[B, T, HV, K]`` log-space decay of the state's K axis.
        gv: optional ``[B, T, HV, V]`` log-space decay of the state's V axis.
        beta: ``[B, T, HV]`` or per-value ``[B, T, HV, V]`` (required when ``delta_rule``).
        scale: multiplies q; default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` if ``state_v_first``), any float dtype.
        output_final_state: return the final state (same layout), else None.
        cu_seqlens: ``[N+1]`` cumulative lengths for packed varlen input (B must be 1).
        reverse: run each sequence from its last token to its first.
        delta_rule: ``u = beta (v - S^T k)`` if True, ``u = v`` (plain linear attention) if False.
        compute_dtype: default ``promote_types(q.dtype, float32)``.

    Returns:
        ``(o [B, T, HV, V], final_state or None)``, both in the compute dtype.
    """
    if delta_rule and beta is None:
        raise ValueError("beta is required for the delta rule")
    return _run(
        "recurrent",
        q,
        k,
        v,
        gk,
        gv,
        beta if delta_rule else None,
        scale,
        initial_state,
        output_final_state,
        state_v_first,
        cu_seqlens,
        reverse,
        compute_dtype,
        delta_rule,
        0,
    )


def chunk_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    reverse: bool = False,
    delta_rule: bool = True,
    chunk_size: int = 64,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise form of :func:`recurrent_linear_attention` (key-axis gate, head-wise beta only).

    Any T (the last chunk is zero-padded), varlen, GVA, both state layouts. Arguments and returns as in
    :func:`recurrent_linear_attention`, plus ``chunk_size`` (any positive integer).
    """
    if delta_rule and beta is None:
        raise ValueError("beta is required for the delta rule")
    return _run(
        "chunk",
        q,
        k,
        v,
        gk,
        None,
        beta if delta_rule else None,
        scale,
        initial_state,
        output_final_state,
        state_v_first,
        cu_seqlens,
        reverse,
        compute_dtype,
        delta_rule,
        chunk_size,
    )


# ----------------------------------------------------------------------------------------------------
# KDA
# ----------------------------------------------------------------------------------------------------


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA: ``S <- diag(exp(g_t)) S; S <- S + beta_t k_t (v_t - S^T k_t)^T; o_t = S^T q_t``.

    Args:
        q, k: ``[B, T, H, K]`` (q is multiplied by ``scale``, default ``K ** -0.5``).
        v: ``[B, T, HV, V]``, HV % H == 0.
        g: ``[B, T, HV, K]`` log-space per-channel decay (already activated).
        beta: ``[B, T, HV]`` or per-value ``[B, T, HV, V]``, post-activation.
        initial_state: ``[N, HV, K, V]``, or ``[N, HV, V, K]`` if ``state_v_first``.
        cu_seqlens: ``[N+1]`` for packed varlen input ``[1, sum(T), ...]``.
        compute_dtype: default ``promote_types(q.dtype, float32)``.

    Returns:
        ``(o [B, T, HV, V], final_state or None)`` in the compute dtype.
    """
    args = dict(locals())  # all of it passes through: KDA is the delta rule with its gate on the key axis
    return recurrent_linear_attention(gk=args.pop("g"), **args)


def naive_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    *,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise KDA (WY / UT transform), any T, varlen, GVA; head-wise beta ``[B, T, HV]`` only.

    Same arguments and result as :func:`naive_recurrent_kda` (equal up to rounding), plus ``chunk_size``.
    """
    args = dict(locals())
    return chunk_linear_attention(gk=args.pop("g"), **args)


def _finish(o: torch.Tensor, S: torch.Tensor | None, out_dtype: torch.dtype):
    # the state row-major as FLA's kernels write it (the cores keep it [K, V] and a V-first one is its transpose)
    return o.to(out_dtype), (None if S is None else S.to(torch.float32).contiguous())


def _preprocess_qk_beta(
    q, k, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, dtype
):
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    q, k, beta = q.to(dtype), k.to(dtype), beta.to(dtype)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_beta_sigmoid_in_kernel:
        beta = beta_activation(beta, allow_neg_eigval)
    return q, k, beta


def reference_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    *,
    lower_bound: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    safe_gate: bool = False,
    chunk_size: int = 64,
    compute_dtype: torch.dtype | None = None,
    form: str = "chunk",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA ``chunk_kda`` semantics in plain torch: FLA's preprocessing, then the naive core.

    Preprocessing, in the compute dtype: ``l2norm`` of q and k (``use_qk_l2norm_in_kernel``); the gate
    :func:`kda_gate` on raw ``g`` (``use_gate_in_kernel``; the lower-bound gate whenever ``lower_bound`` is
    not None, as FLA's chunk path does); ``beta = sigmoid(beta)`` or ``2 * sigmoid(beta)``
    (``use_beta_sigmoid_in_kernel`` / ``allow_neg_eigval``).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``, HV % H == 0.
        g: ``[B, T, HV, K]``: log-space decay, or raw logits when ``use_gate_in_kernel``.
        beta: ``[B, T, HV]`` (``form="recurrent"`` also takes per-value ``[B, T, HV, V]``).
        scale: default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` if ``state_v_first``), float32 in FLA.
        A_log: ``[HV]``; dt_bias: ``[HV * K]``. Used only with ``use_gate_in_kernel``.
        cu_seqlens: ``[N+1]``, B must be 1.
        safe_gate: accepted for signature compatibility; a kernel-side promise that does not change the math.
        chunk_size: chunk length of the chunk form.
        compute_dtype: default ``promote_types(q.dtype, float32)``.
        form: ``"chunk"`` or ``"recurrent"``.

    Returns:
        ``(o [B, T, HV, V] in q.dtype (``form="recurrent"``: in v.dtype, as FLA's recurrent form allocates it, where
        q, k and v may differ), final_state float32 or None)``.
    """
    del safe_gate
    dtype = compute_dtype if compute_dtype is not None else _float_dtype(q)
    q2, k2, beta2 = _preprocess_qk_beta(
        q, k, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, dtype
    )
    g2 = g.to(dtype)
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise ValueError(
                "`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set."
            )
        g2 = kda_gate(g2, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound).to(dtype)
    if form not in ("chunk", "recurrent"):
        raise ValueError(f"form must be 'chunk' or 'recurrent', got {form!r}")
    run = naive_chunk_kda if form == "chunk" else naive_recurrent_kda
    kwargs = {"chunk_size": chunk_size} if form == "chunk" else {}
    o, S = run(
        q2,
        k2,
        v,
        g2,
        beta2,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        compute_dtype=dtype,
        **kwargs,
    )
    return _finish(o, S, v.dtype if form == "recurrent" else q.dtype)
