"""Gated DeltaNet decode against a state pool: the serving form ``cula.kda.kda_decode`` gives KDA, for GDN's
scalar gate (FLA 0.6.0 has no pooled form of ``fused_recurrent_gated_delta_rule``).

GDN is KDA with one decay per token and value head, so every call runs ``kda_decode`` with that gate as it is
(g ``[N, T, HV]``, dt_bias ``[HV]``: its kernels activate one gate per token and head and apply it to every K
channel; its reference repeats it over K): its kernels on Hopper, its reference elsewhere, its pool, padding and
speculative-decoding semantics.
"""

from __future__ import annotations

import torch

from cula._validate import FLOAT_DTYPES, check_tensor, contiguous_reads
from cula.gated_delta_rule.chunk import check_gdn_activations
from cula.kda.decode import kda_commit_accepted, kda_decode, kda_decode_step

__all__ = ["gdn_commit_accepted", "gdn_decode", "gdn_decode_step"]


def gdn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    use_gate_in_kernel: bool = True,
    use_beta_sigmoid_in_kernel: bool = True,
    allow_neg_eigval: bool = False,
    state_v_first: bool = True,
    out: torch.Tensor | None = None,
    step_states: torch.Tensor | None = None,
    check_indices: bool = True,
) -> torch.Tensor:
    r"""Run T (1..8) Gated DeltaNet tokens for each of N sequences, reading and updating their pooled states.

    Same math and flags as :func:`cula.gated_delta_rule.fused_recurrent_gated_delta_rule` with a scalar gate
    ``g``; the pool, padding and ``step_states`` semantics of :func:`cula.kda.kda_decode`: the state of
    sequence ``n`` lives in ``state_pool[state_indices[n]]`` and is updated in place; a negative index marks a
    padded slot (its pool row untouched, its output rows zero). The defaults are the serving ones (Qwen3-Next
    style): the fused gate ``-exp(A_log) softplus(g + dt_bias)``, beta logits, q/k L2-normalised, ``[V, K]``
    states.

    Args:
        q, k: ``[N, T, H, K]`` bf16/fp16.  v: ``[N, T, HV, V]``.  g: ``[N, T, HV]`` log decay (raw logits with
            ``use_gate_in_kernel``).
        beta: ``[N, T, HV]`` fp32/bf16 (logits with ``use_beta_sigmoid_in_kernel``).
        state_pool: fp32 ``[P, HV, V, K]`` (``state_v_first=True``, the default here) or ``[P, HV, K, V]``.
        state_indices: int32 ``[N]`` pool rows (negative: padded), checked to be ``< P`` and distinct unless
            ``check_indices=False``.
        A_log, dt_bias: fp32 ``[HV]`` each (``use_gate_in_kernel`` only; ``dt_bias`` optional).
        out: optional ``[N, T, HV, V]`` output buffer in q's dtype.
        step_states: optional fp32 ``[N, T, HV, ...]``: receives the state after every token and leaves the
            pool untouched (speculative decoding: commit the accepted prefix with
            :func:`gdn_commit_accepted`).

    Returns:
        ``o`` ``[N, T, HV, V]`` in q's dtype.
    """
    # kda_decode validates the rest once per call signature (its plan's key): what is GDN's own is one gate per token
    # and head, and that the fused gate has its A_log (kda_decode would take a lower_bound gate instead)
    if getattr(g, "ndim", None) != 3:
        _check_tokens(q, v, g)
    if use_gate_in_kernel and A_log is None:
        check_gdn_activations(
            q, v, g, A_log, dt_bias, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval
        )
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    return kda_decode(
        q, k, v, g, beta, state_pool, state_indices, A_log=A_log, dt_bias=dt_bias, scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first, out=out, step_states=step_states, check_indices=check_indices,
    )  # fmt: skip


def gdn_decode_step(
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    use_gate_in_kernel: bool = True,
    use_beta_sigmoid_in_kernel: bool = True,
    allow_neg_eigval: bool = False,
    state_v_first: bool = True,
    check_indices: bool = True,
):
    r""":func:`gdn_decode` with the serving loop's fixed arguments bound once (as
    :func:`cula.kda.kda_decode_step`): returns ``step(q, k, v, g, beta, out=None, step_states=None) -> o``,
    the same call as ``gdn_decode(q, k, v, g, beta, state_pool, state_indices, ...)``.

    The bound tensors follow ``kda_decode_step``'s rules (validated with the first step of each token
    signature; values may change in place between steps).
    """
    steps: dict[int, object] = {}  # kda_decode_step closures by head size K

    def step(q, k, v, g, beta, out=None, step_states=None):
        # kda_decode_step validates every new token signature (g [N, T, HV] against q and v included); what is
        # GDN's own is that g has one gate per head, the one check of a repeated step
        try:
            inner = steps.get(q.shape[-1]) if g.ndim == 3 else None
        except AttributeError:
            inner = None  # not tensors: the checks below name them
        if inner is None:
            _check_tokens(q, v, g)
            K = q.shape[-1]
            inner = steps.get(K)
        if inner is None:
            # (on copies of the bound parameters where strided: kda_decode_step's plans copy them each step, as the
            # values may change in place between steps)
            check_gdn_activations(q, v, g, *contiguous_reads(A_log, dt_bias), use_gate_in_kernel,
                                  use_beta_sigmoid_in_kernel, allow_neg_eigval)  # fmt: skip
            a_log, bias = (A_log, dt_bias) if use_gate_in_kernel else (None, None)
            inner = steps[K] = kda_decode_step(
                state_pool, state_indices, A_log=a_log, dt_bias=bias, scale=scale,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                state_v_first=state_v_first, check_indices=check_indices,
            )  # fmt: skip
        return inner(q, k, v, g, beta, out=out, step_states=step_states)

    return step


def _check_tokens(q, v, g) -> None:
    """GDN's own checks of a call's tokens before kda_decode's: q and v 4-D, g ``[N, T, HV]`` (their
    strides are kda_decode's, which copies inputs strided in their last dimension)."""
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES, contiguous_last=False)
    check_tensor("v", v, ndim=4, dtypes=FLOAT_DTYPES, device=q.device, contiguous_last=False)
    check_tensor("g", g, shape=(q.shape[0], q.shape[1], v.shape[2]), dtypes=FLOAT_DTYPES, device=q.device,
                 contiguous_last=False)


# The pool commit after a verify call does not depend on the gate: KDA's, under GDN's name.
gdn_commit_accepted = kda_commit_accepted
