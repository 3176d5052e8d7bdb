"""A_log and dt_bias in bf16 / fp16, as FLA's layers hand them in once a model is cast to bf16: FLA's kernels read
them as fp32, and so does cula (a differentiable cast where they come in). CPU: the reference backends."""

from __future__ import annotations

import pytest
import torch

B, T, H, D = 1, 20, 2, 16


def _x():
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=r(B, T, H, D), k=r(B, T, H, D), v=r(B, T, H, D), beta=r(B, T, H))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kda_gate_params_in_half_precision(dtype):
    from cula.kda import chunk_kda, fused_recurrent_kda

    x = _x()
    g = torch.randn(B, T, H, D)
    A_log = torch.randn(H).to(dtype).requires_grad_()
    dt_bias = torch.randn(H * D).to(dtype).requires_grad_()
    kw = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              output_final_state=True)  # fmt: skip
    for fn in (chunk_kda, fused_recurrent_kda):
        o, ht = fn(**x, g=g, A_log=A_log, dt_bias=dt_bias, **kw)
        a32, b32 = (t.detach().float().requires_grad_() for t in (A_log, dt_bias))
        o32, ht32 = fn(**x, g=g, A_log=a32, dt_bias=b32, **kw)
        assert torch.equal(o, o32) and torch.equal(ht, ht32)
        if fn is chunk_kda:  # the gradients reach the half-precision parameters, in their dtype
            (o.sum() + ht.sum()).backward()
            (o32.sum() + ht32.sum()).backward()
            assert A_log.grad.dtype == dtype and dt_bias.grad.dtype == dtype
            torch.testing.assert_close(A_log.grad, a32.grad.to(dtype))
            torch.testing.assert_close(dt_bias.grad, b32.grad.to(dtype))


def test_gdn_gate_params_in_bf16():
    from cula.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    x = _x()
    g = torch.randn(B, T, H)
    A_log, dt_bias = torch.randn(H).bfloat16(), torch.randn(H).bfloat16()
    kw = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              output_final_state=True)  # fmt: skip
    for fn in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
        o, ht = fn(**x, g=g, A_log=A_log, dt_bias=dt_bias, **kw)
        o32, ht32 = fn(**x, g=g, A_log=A_log.float(), dt_bias=dt_bias.float(), **kw)
        assert torch.equal(o, o32) and torch.equal(ht, ht32)


def test_float64_gate_params_are_still_judged_by_validation():
    from cula.kda import chunk_kda

    with pytest.raises(TypeError, match="A_log"):
        chunk_kda(**_x(), g=torch.randn(B, T, H, D), A_log=torch.randn(H).double(), use_gate_in_kernel=True)


def test_bf16_gate_params_compile_without_a_graph_break():
    """Under torch.compile the cast is traced (the fp32-copy cache's identity lookups would break the graph)."""
    import torch._dynamo

    from cula.kda import chunk_kda

    torch._dynamo.reset()
    x = _x()
    g, A_log, dt_bias = torch.randn(B, T, H, D), torch.randn(H).bfloat16(), torch.randn(H * D).bfloat16()

    def f(q, k, v, beta, g, A_log, dt_bias):
        return chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                         output_final_state=True)  # fmt: skip

    with torch.no_grad():
        eager = f(**x, g=g, A_log=A_log, dt_bias=dt_bias)
        compiled = torch.compile(f, fullgraph=True, backend="eager")(**x, g=g, A_log=A_log, dt_bias=dt_bias)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b)
