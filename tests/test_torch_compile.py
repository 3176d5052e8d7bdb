"""``torch.compile(fullgraph=True)`` through every public entry point (``cula._custom_ops``).

Each case compiles a function calling cula with ``fullgraph=True`` (so any graph break fails it) and compares the
compiled call with the eager one bit for bit: outputs, states updated in place and, for the chunked ops, every input
gradient of ``loss.backward()`` (each input used once, so autograd sums no gradient in a different order). Dynamic
cases mark the length (and the packed total and sequence count) with ``torch._dynamo.mark_dynamic`` and count the
compiled graphs across two lengths. ``torch.library.opcheck`` checks every op's schema, fake and autograd.

CPU: the reference backends, compiled with the ``eager`` and ``aot_eager`` backends (inductor once, for the KDA
training step). GPU (``-m gpu``, SM90): cula's kernels and FLA's under ``aot_eager`` and inductor against eager.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

from cula import gated_delta_rule, kda, lightning, simple_gla
from cula.testing import assert_close, make_cu_seqlens

gpu = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compile(fn, backend: str, dynamic=None):
    """``fn`` compiled with fullgraph=True, and the counter of the graphs it compiled."""
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    return torch.compile(fn, backend=counter, fullgraph=True, dynamic=dynamic), counter


def _cula_ops(counter) -> set[str]:
    """The cula ops in the graphs Dynamo handed the backend."""
    return {
        str(node.target).split(".")[1]
        for gm in counter.graphs
        for node in gm.graph.nodes
        if node.op == "call_function" and str(node.target).startswith("cula.")
    }


def _leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]


def _grads(outputs, weights, leaves):
    """The gradients of ``sum(output * weight)`` (outputs that are None skipped) of each leaf (None if it has none)."""
    loss = sum((o.float() * w).sum() for o, w in zip(outputs, weights) if o is not None)
    found = torch.autograd.grad(loss, [t for t in leaves if t is not None], allow_unused=True)
    it = iter(found)
    return [None if t is None else next(it) for t in leaves]


def _assert_same(name, eager, compiled, eager_again=None):
    """Bit for bit, but for tensors a second eager run (``eager_again``) did not repeat either: a GPU kernel that
    accumulates with atomics varies from run to run, and is held to that variation's scale instead."""
    assert len(eager) == len(compiled), name
    for i, (a, b) in enumerate(zip(eager, compiled)):
        if a is None or b is None:
            assert a is None and b is None, f"{name}[{i}]: {a is None} vs {b is None}"
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, f"{name}[{i}]: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        if eager_again is not None and not torch.equal(a, eager_again[i]):
            assert_close(f"{name}[{i}] (not reproducible in eager)", a, b, 1e-3)
            continue
        assert not a.isnan().any() and not b.isnan().any(), f"{name}[{i}]: NaN"
        assert torch.equal(a, b), f"{name}[{i}]: max |diff| {(a.double() - b.double()).abs().max().item()}"


def _check_training(fn, inputs, backend, ops, *, weights_seed=1):
    """Run ``fn(*leaves)`` eagerly and compiled (a graph holding the cula ``ops``); the outputs and every leaf's
    gradient must be identical."""
    eager_in, compiled_in = _leaves(*inputs), _leaves(*inputs)
    out_e = fn(*eager_in)
    gen = torch.Generator().manual_seed(weights_seed)
    weights = [None if o is None else torch.randn(o.shape, generator=gen).to(o.device) for o in out_e]
    eager = [*out_e, *_grads(out_e, weights, eager_in)]
    cfn, counter = _compile(fn, backend)
    out_c = cfn(*compiled_in)
    again = None
    if inputs[0].is_cuda:
        again_in = _leaves(*inputs)
        out_a = fn(*again_in)
        again = [*out_a, *_grads(out_a, weights, again_in)]
    _assert_same("outputs and grads", eager, [*out_c, *_grads(out_c, weights, compiled_in)], again)
    assert counter.frame_count == 1 and _cula_ops(counter) == set(ops)
    return counter


# ------------------------------------------------------------------------------------------------------------- KDA


def _kda_inputs(B=2, T=19, H=2, HV=4, K=16, V=16, N=None, dtype=torch.float32, device="cpu", gate=False):
    gen = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = rnd(B, T, H, K), rnd(B, T, H, K)
    v = rnd(B, T, HV, V)
    g = rnd(B, T, HV, K) if gate else -torch.rand(B, T, HV, K, generator=gen)
    beta = rnd(B, T, HV) if gate else torch.rand(B, T, HV, generator=gen)
    h0 = rnd(B if N is None else N, HV, K, V)
    A_log, dt_bias = rnd(HV), rnd(HV * K)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    return [t.to(device) for t in (q, k, v, g, beta, h0, A_log, dt_bias)]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_chunk_kda_training(backend):
    def step(q, k, v, g, beta, h0, A_log, dt_bias):
        return kda.chunk_kda(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
        )  # fmt: skip

    _check_training(step, _kda_inputs(gate=True), backend, ["chunk_kda"])


def test_chunk_kda_training_inductor():
    def step(q, k, v, g, beta, h0):
        o, ht = kda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, state_v_first=True)
        return o, ht

    q, k, v, g, beta, h0, *_ = _kda_inputs(HV=2)
    _check_training(step, [q, k, v, g, beta, h0.transpose(-1, -2).contiguous()], "inductor", ["chunk_kda"])


def test_chunk_kda_varlen_dynamic_no_recompile():
    """Packed sequences with a symbolic total length and sequence count: a second batch of another total and count
    runs the same graph, forward and backward."""

    def step(q, k, v, g, beta, h0, cu, cu_cpu):
        return kda.chunk_kda(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu
        )

    cfn, counter = _compile(step, "aot_eager")
    for lens in ((5, 0, 9), (7, 20, 1, 3)):
        cu = make_cu_seqlens(list(lens))
        inputs = _kda_inputs(B=1, T=sum(lens), N=len(lens))[:6]
        eager_in, compiled_in = _leaves(*inputs), _leaves(*inputs)
        for t in compiled_in[:5]:
            torch._dynamo.mark_dynamic(t, 1)
        torch._dynamo.mark_dynamic(compiled_in[5], 0)
        cu_c, cu_cpu_c = cu.clone(), cu.clone()
        torch._dynamo.mark_dynamic(cu_c, 0)
        torch._dynamo.mark_dynamic(cu_cpu_c, 0)
        out_e = step(*eager_in, cu, cu)
        out_c = cfn(*compiled_in, cu_c, cu_cpu_c)
        _assert_same(f"outputs {lens}", out_e, out_c)
        weights = [torch.randn_like(o) for o in out_e]
        _assert_same(f"grads {lens}", _grads(out_e, weights, eager_in), _grads(out_c, weights, compiled_in))
    assert counter.frame_count == 1


def test_chunk_kda_inference_dynamic_length():
    def fwd(q, k, v, g, beta):
        return kda.chunk_kda(q, k, v, g, beta, output_final_state=True, safe_gate=True, lower_bound=-5.0)[0] * 2

    cfn, counter = _compile(fwd, "eager")
    with torch.no_grad():
        for T in (17, 40):
            inputs = _kda_inputs(T=T)[:5]
            for t in inputs:
                torch._dynamo.mark_dynamic(t, 1)
            _assert_same(f"T={T}", [fwd(*inputs)], [cfn(*inputs)])
    assert counter.frame_count == 1


def test_chunk_kda_eager_fallback_names_bad_keywords():
    """Forms the op does not take run the eager function (a graph break): its errors as eager raises them."""
    q, k, v, g, beta, *_ = _kda_inputs()
    cfn = torch.compile(lambda *a: kda.chunk_kda(*a, not_an_argument=1), backend="eager")
    with pytest.raises(TypeError, match="not_an_argument"):
        cfn(q, k, v, g, beta)


def test_bad_token_shapes_fail_to_compile():
    """The fakes check the token tensors' metadata with eager's rules: a wrong shape fails at trace time, named."""
    q, k, v, g, beta, *_ = _kda_inputs()
    cfn, _ = _compile(kda.chunk_kda, "eager")
    with pytest.raises(Exception, match="`k` must have shape"):
        cfn(q, k[:, :-1], v, g, beta)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fused_recurrent_kda(backend):
    q, k, v, g, beta, h0, A_log, dt_bias = _kda_inputs(T=5)

    def run(q, k, v, g, beta, h0, pool):
        o1, ht = kda.fused_recurrent_kda(
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True,
            use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        # FLA's serving form: the pool updated in place and returned
        o2, pool_out = kda.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, inplace_final_state=True)
        # FLA's deprecated layout alias, honoured by this form (FLA's low-level one ignores it)
        o3, ht3 = kda.fused_recurrent_kda(
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0.transpose(-1, -2).contiguous(),
            output_final_state=True, use_gate_in_kernel=True, transpose_state_layout=True,
        )  # fmt: skip
        return o1, ht, o2, pool_out, o3, ht3.transpose(-1, -2)

    pool_e, pool_c = h0.clone() * 0.5, h0.clone() * 0.5
    with torch.no_grad():
        out_e = run(q, k, v, g, beta, h0, pool_e)
        cfn, counter = _compile(run, backend)
        out_c = cfn(q, k, v, g, beta, h0, pool_c)
    assert out_c[3] is pool_c
    _assert_same("fused_recurrent", out_e, out_c)
    assert counter.frame_count == 1 and _cula_ops(counter) == {"fused_recurrent_kda", "fused_recurrent_kda_pool"}


def test_serving_forms_with_grad_inputs():
    """The in-place forms have no autograd (an op that mutates cannot): inputs that require gradients (a model's
    activations outside ``no_grad``) compile all the same, as constants of the step."""
    q, k, v, g, beta, h0, A_log, dt_bias = _leaves(*_kda_inputs(T=1))

    def run(q, k, v, g, beta, pool):
        o, _ = kda.fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=A_log, initial_state=pool, use_gate_in_kernel=True)
        return o

    pool_e, pool_c = h0.detach().clone(), h0.detach().clone()
    out_e = run(q, k, v, g, beta, pool_e)
    cfn, counter = _compile(run, "aot_eager")
    out_c = cfn(q, k, v, g, beta, pool_c)
    _assert_same("pool", [out_e.detach(), pool_e], [out_c, pool_c])
    assert not out_c.requires_grad and counter.frame_count == 1


def _decode_inputs(N=5, T=2, H=2, HV=4, K=16, P=9, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = rnd(N, T, H, K).to(dtype), rnd(N, T, H, K).to(dtype), rnd(N, T, HV, K).to(dtype)
    g, beta = rnd(N, T, HV, K), rnd(N, T, HV)
    pool = rnd(P, HV, K, K)
    idx = torch.randperm(P, generator=gen)[:N].to(torch.int32)
    idx[1] = -1
    return q, k, v, g, beta, pool, idx, rnd(HV), rnd(HV * K)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_kda_decode_and_step(backend):
    """The pool updated in place (``mutates_args``), ``out`` and ``step_states`` written, ``kda_decode_step``'s
    closure traced as the ``kda_decode`` call it stands for, and ``kda_commit_accepted``."""
    q, k, v, g, beta, pool, idx, A_log, dt_bias = _decode_inputs()
    N, T = q.shape[:2]
    accepted = torch.tensor([2, 0, 1, 2, 1], dtype=torch.int32)

    def run(q, k, v, g, beta, pool, pool2, steps, out):
        o1 = kda.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log, dt_bias=dt_bias, state_v_first=False)
        step = kda.kda_decode_step(pool2, idx, A_log=A_log, dt_bias=dt_bias, state_v_first=False)
        o2 = step(q, k, v, g, beta, out=out, step_states=steps)
        kda.kda_commit_accepted(steps, pool2, idx, accepted)
        return o1, o2

    def fresh():
        return pool.clone(), pool.clone(), torch.zeros(N, T, *pool.shape[1:]), torch.full_like(v, float("nan"))

    eager_bufs, compiled_bufs = fresh(), fresh()
    out_e = run(q, k, v, g, beta, *eager_bufs)
    cfn, counter = _compile(run, backend)
    out_c = cfn(q, k, v, g, beta, *compiled_bufs)
    _assert_same("decode", [*out_e, *eager_bufs], [*out_c, *compiled_bufs])
    assert counter.frame_count == 1 and _cula_ops(counter) == {"kda_decode", "kda_commit_accepted"}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_gdn_decode(backend):
    """GDN's pooled decode and its bound step trace as the ``kda_decode`` op they make (the gate repeated over K in
    the graph), the pool updated in place, then ``gdn_commit_accepted``."""
    q, k, v, _, beta, pool, idx, A_log, _ = _decode_inputs()
    N, T, HV = v.shape[:3]
    g = torch.randn(N, T, HV, generator=torch.Generator().manual_seed(1))
    dt_bias = torch.randn(HV, generator=torch.Generator().manual_seed(2))
    accepted = torch.tensor([2, 0, 1, 2, 1], dtype=torch.int32)

    def run(q, k, v, g, beta, pool, pool2, steps):
        o = gated_delta_rule.gdn_decode(q, k, v, g, beta, pool, idx, A_log=A_log, dt_bias=dt_bias)
        step = gated_delta_rule.gdn_decode_step(pool2, idx, A_log=A_log, dt_bias=dt_bias)
        step(q, k, v, g, beta, step_states=steps)
        gated_delta_rule.gdn_commit_accepted(steps, pool2, idx, accepted)
        return o

    def fresh():
        return pool.clone(), pool.clone(), torch.zeros(N, T, *pool.shape[1:])

    eager_bufs, compiled_bufs = fresh(), fresh()
    out_e = run(q, k, v, g, beta, *eager_bufs)
    cfn, counter = _compile(run, backend)
    out_c = cfn(q, k, v, g, beta, *compiled_bufs)
    _assert_same("gdn decode", [out_e, *eager_bufs], [out_c, *compiled_bufs])
    assert counter.frame_count == 1 and _cula_ops(counter) == {"kda_decode", "kda_commit_accepted"}


def test_kda_decode_dynamic_batch():
    q, k, v, g, beta, pool, idx, A_log, dt_bias = _decode_inputs(N=6, T=1)

    def run(q, k, v, g, beta, pool, idx):
        return kda.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log, dt_bias=dt_bias)

    cfn, counter = _compile(run, "aot_eager")
    pool_vk = pool.transpose(-1, -2).contiguous()
    for n in (6, 3):
        args = [t[:n].clone() for t in (q, k, v, g, beta)]
        for t in args:
            torch._dynamo.mark_dynamic(t, 0)
        idx_n = idx[:n].clone()
        torch._dynamo.mark_dynamic(idx_n, 0)
        pool_e, pool_c = pool_vk.clone(), pool_vk.clone()
        _assert_same(f"N={n}", [run(*args, pool_e, idx_n), pool_e], [cfn(*args, pool_c, idx_n), pool_c])
    assert counter.frame_count == 1


# ------------------------------------------------------------------------------------------ Lightning, Simple GLA


def _gla_inputs(B=2, T=21, H=2, HV=2, D=16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = rnd(B, T, H, D).to(dtype), rnd(B, T, H, D).to(dtype), rnd(B, T, HV, D).to(dtype)
    return q, k, v, torch.rand(HV, generator=gen), rnd(B, HV, D, D), -torch.rand(B, T, HV, generator=gen)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_lightning_training(backend):
    """``lightning_attn_fwd`` and ``chunk_lightning_attn`` (Python around the ``chunk_simple_gla`` op, which Dynamo
    traces) and ``chunk_simple_gla`` with a data-dependent gate."""
    q, k, v, decay, h0, g = _gla_inputs()

    def step(q, k, v, h0, q2, k2, v2, h02, q3, k3, v3, g):
        o1, s1 = lightning.lightning_attn_fwd(q, k, v, decay, initial_state=h0, output_final_state=True)
        o2, s2 = lightning.chunk_lightning_attn(q2, k2, v2, 1, 4, initial_state=h02, output_final_state=True)
        o3, _ = simple_gla.chunk_simple_gla(q3, k3, v3, g=g)
        return o1, s1, o2, s2, o3

    _check_training(step, [q, k, v, h0, q * 2, k * 2, v * 2, h0 * 2, -q, -k, -v, g], backend, ["chunk_simple_gla"])


def test_lightning_dynamic_length():
    q, k, v, decay, h0, _ = _gla_inputs(T=40)

    def fwd(q, k, v, h0):
        return lightning.lightning_attn_fwd(q, k, v, decay, initial_state=h0, output_final_state=True)

    cfn, counter = _compile(fwd, "aot_eager")
    for T in (40, 13):
        args = _leaves(q[:, :T], k[:, :T], v[:, :T], h0)
        for t in args[:3]:
            torch._dynamo.mark_dynamic(t, 1)
        eager_args = _leaves(*args)
        out_e, out_c = fwd(*eager_args), cfn(*args)
        _assert_same(f"T={T}", out_e, out_c)
        w = [torch.ones_like(o) for o in out_e]
        _assert_same(f"grads T={T}", _grads(out_e, w, eager_args), _grads(out_c, w, args))
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_lightning_decode_and_step(backend):
    q, k, v, decay, _, _ = _gla_inputs(B=5, T=2, H=2, HV=4)
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(9, 4, 16, 16, generator=gen)
    idx = torch.tensor([3, -1, 0, 8, 5], dtype=torch.int32)

    def run(q, k, v, pool, pool2):
        o1 = lightning.lightning_decode(q, k, v, decay, pool, idx)
        o2 = lightning.lightning_decode_step(decay, pool2, idx, state_v_first=False)(q, k, v)
        return o1, o2

    bufs_e, bufs_c = (pool.clone(), pool.clone()), (pool.clone(), pool.clone())
    out_e = run(q, k, v, *bufs_e)
    cfn, counter = _compile(run, backend)
    out_c = cfn(q, k, v, *bufs_c)
    _assert_same("lightning_decode", [*out_e, *bufs_e], [*out_c, *bufs_c])
    assert counter.frame_count == 1 and _cula_ops(counter) == {"lightning_decode"}


# ------------------------------------------------------------------------------------------------------------ GDN


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_chunk_gated_delta_rule_training(backend):
    q, k, v, _, h0, g = _gla_inputs(HV=4)
    beta = torch.rand(g.shape)

    def step(q, k, v, g, beta, h0, A_log):
        return gated_delta_rule.chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, A_log=A_log,
        )  # fmt: skip

    _check_training(step, [q, k, v, g, beta, h0, torch.randn(4)], backend, ["chunk_gated_delta_rule"])


def test_recurrent_forms_training():
    """The token-by-token forms: ``fused_recurrent_simple_gla`` (and through it ``fused_recurrent_lightning_attn``),
    ``fused_recurrent_gated_delta_rule`` and ``fused_recurrent_kda`` (differentiable on the reference backend; where
    FLA's backward raises, the compiled backward raises it too)."""
    q, k, v, _, h0, g = _gla_inputs(T=9)
    beta = torch.rand(g.shape)
    kq, kk, kv, kg, kbeta, kh0, *_ = _kda_inputs(T=9, HV=2)

    def step(q, k, v, g, q2, k2, v2, h0, q3, k3, v3, beta, kq, kk, kv, kg, kbeta, kh0):
        o1, s1 = simple_gla.fused_recurrent_simple_gla(q, k, v, g=g, output_final_state=True, reverse=True)
        o2, _ = lightning.fused_recurrent_lightning_attn(q2, k2, v2, 0, 2, initial_state=h0)
        o3, s3 = gated_delta_rule.fused_recurrent_gated_delta_rule(q3, k3, v3, beta=beta, output_final_state=True)
        o4, s4 = kda.fused_recurrent_kda(kq, kk, kv, kg, kbeta, initial_state=kh0, output_final_state=True)
        return o1, s1, o2, o3, s3, o4, s4

    ops = ["fused_recurrent_simple_gla", "fused_recurrent_gated_delta_rule", "fused_recurrent_kda"]
    inputs = [q, k, v, g, q * 2, k * 2, v * 2, h0, -q, -k, -v, beta, kq, kk, kv, kg, kbeta, kh0]
    _check_training(step, inputs, "aot_eager", ops)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_recurrent_forms_mixed_dtypes(backend):
    """q, k and v of their own dtypes, float64 included, as FLA's recurrent kernels take them (each read as fp32):
    the compiled calls give eager's outputs in eager's dtypes (o in v's dtype for KDA and Gated DeltaNet, q's for
    Simple GLA; the final states fp32) and eager's gradients, each in its input's dtype; the in-place serving form
    too (the ops' fake implementations follow eager's dtypes)."""
    q, k, v, _, h0, g = _gla_inputs(T=9)
    beta = torch.rand(g.shape)
    kq, kk, kv, kg, kbeta, kh0, A_log, dt_bias = _kda_inputs(T=9, HV=2)

    def step(q, k, v, g, h0, q2, k2, v2, g2, beta, h02, kq, kk, kv, kg, kbeta, kh0):
        o1, s1 = simple_gla.fused_recurrent_simple_gla(q, k, v, g=g, initial_state=h0, output_final_state=True)
        o2, s2 = gated_delta_rule.fused_recurrent_gated_delta_rule(
            q2, k2, v2, g=g2, beta=beta, initial_state=h02, output_final_state=True
        )
        o3, s3 = kda.fused_recurrent_kda(kq, kk, kv, kg, kbeta, initial_state=kh0, output_final_state=True)
        return o1, s1, o2, s2, o3, s3

    ops = ["fused_recurrent_simple_gla", "fused_recurrent_gated_delta_rule", "fused_recurrent_kda"]
    inputs = [q.bfloat16(), k.half(), v, g, h0.double(), q * 2, k * 2, v.half() * 2, g * 2, beta.half(), h0 * 2,
              *(t.double() for t in (kq, kk, kv, kg, kbeta, kh0))]  # fmt: skip
    _check_training(step, inputs, backend, ops)

    def serve(q, k, v, g, beta, pool):
        o, _ = kda.fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=A_log.double(), dt_bias=dt_bias.double(),
                                           initial_state=pool, use_gate_in_kernel=True)  # fmt: skip
        return o

    tokens = [kq[:, :1].float(), kk[:, :1].half(), kv[:, :1].bfloat16(), kg[:, :1], kbeta[:, :1]]
    pool_e, pool_c = kh0.clone(), kh0.clone()
    with torch.no_grad():
        out_e = serve(*tokens, pool_e)
        cfn, counter = _compile(serve, backend)
        out_c = cfn(*tokens, pool_c)
    assert out_e.dtype == torch.bfloat16
    _assert_same("pool", [out_e, pool_e], [out_c, pool_c])
    assert counter.frame_count == 1 and _cula_ops(counter) == {"fused_recurrent_kda_pool"}


# -------------------------------------------------------------------------- inputs strided in their last dimension


def _strided_last(t):
    """``t``'s values in a view whose last dimension has stride 2 (e.g. heads split off a ``[B, D, T]`` conv1d
    output), which FLA's wrappers copy."""
    view = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])[..., ::2]
    view.copy_(t)
    return view


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_inputs_strided_in_their_last_dimension(backend):
    """The compiled calls copy what an op only reads where it is strided in its last dimension, as eager does (the
    copies are graph nodes: the ops take row-major tensors, and gradients reach the strided leaves); a chunked and a
    recurrent form in training, and the decode forms with their pools updated in place."""

    def step(q, k, v, g, beta, h0, A_log, dt_bias, q2, k2, v2, g2, beta2):
        o1, s1 = kda.chunk_kda(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
        )  # fmt: skip
        o2, s2 = gated_delta_rule.fused_recurrent_gated_delta_rule(q2, k2, v2, g=g2, beta=beta2,
                                                                   output_final_state=True)  # fmt: skip
        return o1, s1, o2, s2

    q, k, v, g, beta, h0, A_log, dt_bias = _kda_inputs(gate=True)
    q2, k2, v2, _, _, g2 = _gla_inputs(T=9)
    inputs = [q, k, v, g, beta, h0, A_log, dt_bias, q2, k2, v2, g2, torch.rand(g2.shape)]
    contiguous = _leaves(*inputs)
    strided = [_strided_last(t).requires_grad_() for t in inputs]  # (not _leaves: a clone would be row-major)
    out_e = step(*contiguous)
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(o.shape, generator=gen) for o in out_e]
    cfn, counter = _compile(step, backend)
    out_c = cfn(*strided)
    _assert_same("outputs and grads", [*out_e, *_grads(out_e, weights, contiguous)],
                 [*out_c, *_grads(out_c, weights, strided)])  # fmt: skip
    assert counter.frame_count == 1 and _cula_ops(counter) == {"chunk_kda", "fused_recurrent_gated_delta_rule"}

    q, k, v, g, beta, pool, idx, A_log, dt_bias = _decode_inputs()
    decay = torch.rand(v.shape[2])

    def run(q, k, v, g, beta, idx, A_log, dt_bias, decay, pool, pool2):
        o1 = kda.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log, dt_bias=dt_bias, state_v_first=False)
        o2 = lightning.lightning_decode(q, k, v, decay, pool2, idx, state_v_first=False)
        return o1, o2

    reads = (q, k, v, g, beta, idx, A_log, dt_bias, decay)
    bufs_e, bufs_c = (pool.clone(), pool.clone()), (pool.clone(), pool.clone())
    out_e = run(*reads, *bufs_e)  # the contiguous call
    cfn, counter = _compile(run, backend)
    out_c = cfn(*(_strided_last(t) for t in reads), *bufs_c)
    _assert_same("decode", [*out_e, *bufs_e], [*out_c, *bufs_c])
    assert counter.frame_count == 1 and _cula_ops(counter) == {"kda_decode", "lightning_decode"}


# ----------------------------------------------------------------------------------------------------- opcheck


def _opcheck_samples():
    """``(op, args, kwargs)``: a small CPU call of every op, its differentiable inputs requiring gradients."""
    rg = lambda *ts: [t.clone().requires_grad_() for t in ts]  # noqa: E731

    q, k, v, g, beta, h0, A_log, dt_bias = _kda_inputs(T=7)
    flags = dict(
        scale=None, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False, safe_gate=False, lower_bound=None,
        disable_recompute=False, state_v_first=False, chunk_size=64, max_num_seqs=None, use_graph=False,
    )  # fmt: skip
    yield "chunk_kda", (*rg(q, k, v, g, beta, A_log, dt_bias, h0), None, None), dict(flags, training=True)
    grads_in = (torch.randn(v.shape), torch.randn(h0.shape), q.new_empty(0), q.new_empty(0), [True] * 8)
    yield "chunk_kda_bwd", (*grads_in, q, k, v, g, beta, A_log, dt_bias, h0, None, None), flags
    flags = dict(
        scale=None, output_final_state=True, state_v_first=False, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
    )  # fmt: skip
    yield "fused_recurrent_kda", (*rg(q, k, v, g, beta, A_log, dt_bias, h0), None), flags
    grads_in = (torch.randn(v.shape), torch.randn(h0.shape), [True] * 8)
    yield "fused_recurrent_kda_bwd", (*grads_in, q, k, v, g, beta, A_log, dt_bias, h0, None), flags
    yield "fused_recurrent_kda_pool", (q, k, v, g, beta, A_log, dt_bias, h0.clone(), None, None, None, None), flags

    q, k, v, g, beta, pool, idx, A_log, dt_bias = _decode_inputs(T=2)
    flags = dict(
        scale=None, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=False, lower_bound=None, state_v_first=False, check_indices=True,
    )  # fmt: skip
    steps = torch.zeros(5, 2, *pool.shape[1:])
    yield "kda_decode", (q, k, v, g, beta, pool.clone(), idx, A_log, dt_bias, torch.empty_like(v), steps), flags
    yield "kda_commit_accepted", (steps, pool.clone(), idx, torch.tensor([2, 0, 1, 2, 1])), {}
    q, k, v, decay, *_ = _gla_inputs(B=5, T=2, HV=4)
    flags = dict(scale=None, state_v_first=True, check_indices=True)
    yield "lightning_decode", (q, k, v, decay, torch.randn(9, 4, 16, 16), idx, torch.empty_like(v)), flags

    q, k, v, _, h0, g = _gla_inputs()
    beta, g_gamma = torch.rand(g.shape), -torch.rand(2)
    flags = dict(scale=None, output_final_state=True, state_v_first=False, chunk_size=None)
    yield "chunk_simple_gla", (*rg(q, k, v, g), None, *rg(h0), None, None), flags
    grads_in = (torch.randn(v.shape), torch.randn(h0.shape), [True, True, True, True, False, True])
    yield "chunk_simple_gla_bwd", (*grads_in, q, k, v, g, None, h0, None, None), flags
    flags = dict(
        scale=None, output_final_state=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=False,
        allow_neg_eigval=False, state_v_first=False, use_gate_in_kernel=False, chunk_size=64,
    )  # fmt: skip
    yield "chunk_gated_delta_rule", (*rg(q, k, v, g, beta), None, None, *rg(h0), None, None, None), flags
    grads_in = (torch.randn(v.shape), None, [True, True, True, True, True, False, False, True])
    yield "chunk_gated_delta_rule_bwd", (*grads_in, q, k, v, g, beta, None, None, h0, None, None, None), flags
    flags = dict(
        scale=None, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
    )  # fmt: skip
    yield "fused_recurrent_gated_delta_rule", (*rg(q, k, v, g), None, None, *rg(beta), None, None, *rg(h0), None), flags
    grads_in = (torch.randn(v.shape), torch.randn(h0.shape), [True] * 4 + [False] * 2 + [True] + [False] * 2 + [True])
    yield "fused_recurrent_gated_delta_rule_bwd", (*grads_in, q, k, v, g, None, None, beta, None, None, h0, None), flags
    flags = dict(scale=None, output_final_state=True, reverse=True, state_v_first=True)
    yield "fused_recurrent_simple_gla", (*rg(q, k, v), None, *rg(g_gamma, h0), None), flags
    grads_in = (torch.randn(v.shape), None, [True, True, True, False, True, True])
    yield "fused_recurrent_simple_gla_bwd", (*grads_in, q, k, v, None, g_gamma, h0, None), flags
    # the recurrent ops with q, k, v of their own dtypes (o in v's dtype, or q's for Simple GLA)
    yield "fused_recurrent_simple_gla", (*rg(q.bfloat16(), k.double(), v), None, *rg(g_gamma, h0), None), flags
    flags = dict(
        scale=None, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
    )  # fmt: skip
    yield "fused_recurrent_gated_delta_rule", (*rg(q.double(), k, v.half(), g), None, None, *rg(beta), None, None,
                                               *rg(h0), None), flags  # fmt: skip
    q, k, v, g, beta, h0, A_log, dt_bias = _kda_inputs(T=7)
    flags = dict(
        scale=None, output_final_state=True, state_v_first=False, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
    )  # fmt: skip
    mixed = (q.bfloat16(), k.half(), v.double())
    yield "fused_recurrent_kda", (*rg(*mixed, g, beta, A_log, dt_bias, h0), None), flags
    grads_in = (torch.randn(v.shape, dtype=torch.float64), torch.randn(h0.shape), [True] * 8)
    yield "fused_recurrent_kda_bwd", (*grads_in, *mixed, g, beta, A_log, dt_bias, h0, None), flags
    yield "fused_recurrent_kda_pool", (*mixed, g, beta, A_log, dt_bias, h0.clone(), None, None, None, None), flags


def test_every_op_has_a_sample():
    defined = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("cula::")}
    assert {name for name, *_ in _opcheck_samples()} == defined


@pytest.mark.parametrize("sample", list(_opcheck_samples()), ids=lambda s: s[0])
def test_opcheck(sample):
    name, args, kwargs = sample
    torch.library.opcheck(getattr(torch.ops.cula, name).default, args, kwargs)


# --------------------------------------------------------------------------------------------------------- GPU


def _cuda(tensors, dtype=None):
    return [None if t is None else t.to("cuda", dtype if dtype and t.dtype == torch.float32 else t.dtype)
            for t in tensors]  # fmt: skip


@gpu
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "packed"])
def test_chunk_kda_training_cuda(backend, varlen):
    """cula's forward kernels and FLA's backward (``_ChunkKDATraining``, its Aqk and Akk handed from the forward op
    to the backward op) under compile, bit for bit against eager."""
    lens = (100, 0, 37, 64)
    B, T, N = (1, sum(lens), len(lens)) if varlen else (2, 150, None)
    q, k, v, g, beta, h0, A_log, dt_bias = _kda_inputs(B=B, T=T, H=2, HV=4, K=128, V=128, N=N, gate=True)
    q, k, v = _cuda((q, k, v), torch.bfloat16)
    g, beta, h0, A_log, dt_bias = _cuda((g, beta, h0, A_log, dt_bias))
    cu = make_cu_seqlens(list(lens), device="cuda") if varlen else None
    cu_cpu = cu.cpu() if varlen else None

    def step(q, k, v, g, beta, h0, A_log, dt_bias):
        return kda.chunk_kda(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=A_log,
            dt_bias=dt_bias, state_v_first=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
        )  # fmt: skip

    from cula.kda.backends import chunk_kda_registry

    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, A_log=A_log, dt_bias=dt_bias, chunk_size=64)
    assert chunk_kda_registry.select(q.device, args).name == "cula-sm90"
    _check_training(step, [q, k, v, g, beta, h0.transpose(-1, -2).contiguous(), A_log, dt_bias], backend, ["chunk_kda"])


@gpu
def test_chunk_kda_inference_dynamic_cuda():
    def fwd(q, k, v, g, beta, cu, cu_cpu):
        # normalized keys: raw N(0, 1) keys of K=128 make the delta rule diverge to inf within a few hundred tokens
        return kda.chunk_kda(
            q, k, v, g, beta, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    cfn, counter = _compile(fwd, "inductor")
    with torch.no_grad():
        for lens in ((100, 0, 37), (64, 200, 3, 9)):
            q, k, v, g, beta, *_ = _kda_inputs(B=1, T=sum(lens), H=2, HV=4, K=128, V=128)
            q, k, v = _cuda((q, k, v), torch.bfloat16)
            g, beta = _cuda((g, beta))
            cu = make_cu_seqlens(list(lens), device="cuda")
            cu_cpu = cu.cpu()
            for t in (q, k, v, g, beta):
                torch._dynamo.mark_dynamic(t, 1)
            torch._dynamo.mark_dynamic(cu, 0)
            torch._dynamo.mark_dynamic(cu_cpu, 0)
            _assert_same(f"{lens}", fwd(q, k, v, g, beta, cu, cu_cpu), cfn(q, k, v, g, beta, cu, cu_cpu))
    assert counter.frame_count == 1


@gpu
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_decode_cuda(backend):
    """The decode kernels through ``kda_decode``, ``fused_recurrent_kda_fwd``'s pool form and ``lightning_decode``,
    their pools updated in place."""
    q, k, v, g, beta, pool, idx, A_log, dt_bias = _decode_inputs(N=6, T=1, H=2, HV=4, K=128, P=11)
    q, k, v = _cuda((q, k, v), torch.bfloat16)
    g, beta, pool, idx, A_log, dt_bias = _cuda((g, beta, pool, idx, A_log, dt_bias))
    decay = torch.rand(4, device="cuda")

    def run(q, k, v, g, beta, pool, pool2, pool3):
        o1 = kda.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log, dt_bias=dt_bias, check_indices=False)
        o2, _ = kda.fused_recurrent_kda_fwd(
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool2, ssm_state_indices=idx,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            state_v_first=True,
        )  # fmt: skip
        o3 = lightning.lightning_decode(q, k, v, decay, pool3, idx)
        return o1, o2, o3

    bufs_e = [pool.transpose(-1, -2).contiguous() for _ in range(3)]
    bufs_c = [b.clone() for b in bufs_e]
    out_e = run(q, k, v, g, beta, *bufs_e)
    cfn, counter = _compile(run, backend)
    out_c = cfn(q, k, v, g, beta, *bufs_c)
    _assert_same("decode", [*out_e, *bufs_e], [*out_c, *bufs_c])
    assert counter.frame_count == 1
    assert _cula_ops(counter) == {"kda_decode", "fused_recurrent_kda_pool", "lightning_decode"}


@gpu
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_lightning_training_and_gdn_inference_cuda(backend):
    """Lightning on cula's kernel with FLA's backward (``lightning_backward``), and Gated DeltaNet's forward on FLA's
    kernels (its backward is FLA's gated ``chunk_bwd_dqkwg``, which FLA 0.6.0 refuses to run on Hopper with the
    Triton PyTorch ships)."""
    q, k, v, decay, h0, g = _gla_inputs(T=150, H=2, HV=4, D=128)
    q, k, v = _cuda((q, k, v), torch.bfloat16)
    decay, h0, g = _cuda((decay, h0, g))
    beta = torch.rand(g.shape, device="cuda")

    def step(q, k, v, h0, q2, k2, v2, g, beta):
        o1, s1 = lightning.lightning_attn_fwd(q, k, v, decay, initial_state=h0, output_final_state=True)
        with torch.no_grad():
            o2, s2 = gated_delta_rule.chunk_gated_delta_rule(
                q2, k2, v2, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True
            )
        return o1, s1, o2, s2

    ops = ["chunk_simple_gla", "chunk_gated_delta_rule"]
    _check_training(step, [q, k, v, h0, q.clone(), k.clone(), v.clone(), g, beta], backend, ops)


def test_compiled_backward_leaves_unused_gate_parameters_without_gradients():
    """A_log / dt_bias handed to a call without the fused gate: eager autograd leaves their .grad None (the call
    never reads them), and so must the compiled op (zeros would let AdamW decay a parameter eager leaves alone)."""
    from cula.kda import chunk_kda

    gen = torch.Generator().manual_seed(0)
    B, T, H, K = 1, 11, 2, 64
    x = [torch.randn(B, T, H, K, generator=gen) for _ in range(3)]
    g, beta = -torch.rand(B, T, H, K, generator=gen), torch.rand(B, T, H, generator=gen)
    A_log, dt_bias = torch.nn.Parameter(torch.randn(H)), torch.nn.Parameter(torch.randn(H * K))

    def step(q, k, v, g, beta):
        o, _ = chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=False)
        return o.sum()

    torch._dynamo.reset()
    q = x[0].clone().requires_grad_()
    torch.compile(step, backend="aot_eager", fullgraph=True)(q, x[1], x[2], g, beta).backward()
    assert q.grad is not None and A_log.grad is None and dt_bias.grad is None
