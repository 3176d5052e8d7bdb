"""A_log and dt_bias in bf16 / fp16, as FLA's layers hand them in once a model is cast to bf16: FLA's kernels read
them as fp32, and so does cula (a differentiable cast where they come in); and in any shape of their size, as FLA's
kernels index them flat (FLA's own KDA tests make A_log ``[1, 1, H, 1]``). CPU: the reference backends."""

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


@pytest.mark.parametrize("varlen", [False, True])
def test_gate_params_of_any_shape_of_their_size(varlen):
    from cula.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from cula.kda import chunk_kda, fused_recurrent_kda

    x = _x()
    cu = torch.tensor([0, 7, T]) if varlen else None
    kw = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, output_final_state=True, cu_seqlens=cu)
    A4 = torch.randn(1, 1, H, 1, requires_grad=True)
    A1 = A4.detach().flatten().requires_grad_()
    g = torch.randn(B, T, H, D)
    for fn in (chunk_kda, fused_recurrent_kda):
        dt = torch.randn(H, D)  # FLA takes dt_bias of H * D elements in any shape too
        o4, ht4 = fn(**x, g=g, A_log=A4, dt_bias=dt, **kw)
        o1, ht1 = fn(**x, g=g, A_log=A1, dt_bias=dt.flatten(), **kw)
        assert torch.equal(o4, o1) and torch.equal(ht4, ht1)
        o4.sum().backward()
        o1.sum().backward()
        assert A4.grad.shape == A4.shape  # the gradient in the parameter's own shape, as autograd gives FLA's
        torch.testing.assert_close(A4.grad.flatten(), A1.grad)
        A4.grad = A1.grad = None
    gh = torch.randn(B, T, H)
    for fn in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
        o4, ht4 = fn(**x, g=gh, A_log=A4.detach(), dt_bias=torch.randn(1, H), **kw)
        assert o4.shape == (B, T, H, D) and ht4.shape == (len(cu) - 1 if varlen else B, H, D, D)
    with pytest.raises(ValueError, match="A_log"):  # the size is still checked
        chunk_kda(**x, g=g, A_log=torch.randn(1, H + 1), use_gate_in_kernel=True)


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
