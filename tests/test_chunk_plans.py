"""chunk_kda's call-signature cache (cula.backends.PlanCache) and the cula-sm90 bound launch, on the CPU.

A repeated fixed-length ``chunk_kda`` call skips validation and backend selection, and on the cula-sm90 backend
calls the two compiled kernels directly (``prepare_chunk_kda_fwd_sm90``). These tests check that the cache never
lets through a call that full validation would refuse, that everything selection reads starts a new plan, and
that the bound launch hands the kernels exactly what the general path does (kernels stubbed here; the GPU test
at the end compares the outputs bit for bit).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import cula.kda.chunk as chunk_mod
from cula.backends import PlanCache
from cula.kda import chunk_kda
from cula.testing import make_cu_seqlens
from kda_launch_stubs import assert_same_calls, stub_kernels

HAS_CUDA = torch.cuda.is_available()
B, T, H, HV, D = 2, 100, 2, 4, 128  # T not a multiple of the chunk


def _inputs(device="cpu", dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, dt=dtype, s=1.0):
        return (s * torch.randn(*shape, generator=gen, device=device)).to(dt)

    return {
        "q": rnd(B, T, H, D), "k": rnd(B, T, H, D), "v": rnd(B, T, HV, D), "g": rnd(B, T, HV, D),
        "beta": rnd(B, T, HV), "initial_state": rnd(B, HV, D, D, dt=torch.float32, s=0.1),
        "A_log": rnd(HV, dt=torch.float32, s=0.5), "dt_bias": rnd(HV * D, dt=torch.float32, s=0.5),
    }  # fmt: skip


FLAGS = {"output_final_state": True, "use_gate_in_kernel": True, "use_qk_l2norm_in_kernel": True,
         "use_beta_sigmoid_in_kernel": True, "safe_gate": True, "lower_bound": -5.0, "state_v_first": True}  # fmt: skip


@pytest.fixture
def counted(monkeypatch):
    """Fresh chunk_kda plan caches (the short keys' too: an earlier test's plan would skip validation) and a count
    of full validations."""
    count = [0]
    monkeypatch.setattr(chunk_mod, "_plans", PlanCache())
    monkeypatch.setattr(chunk_mod, "_short_plans", PlanCache())
    real = chunk_mod._checked

    def checked(call):
        count[0] += 1
        return real(call)

    monkeypatch.setattr(chunk_mod, "_checked", checked)
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.delenv("CULA_KDA_INTRA", raising=False)
    return count


def test_constant_tensors_are_made_once_per_device_and_tag():
    """``cula.backends.ConstantTensors``: one value per (device, tag); a full cache drops its oldest entry."""
    from cula.backends import ConstantTensors

    made = []
    cache = ConstantTensors(maxsize=2)
    cpu = torch.device("cpu")

    def get(tag):
        return cache.get(cpu, tag, lambda: made.append(1) or torch.zeros(1))

    assert get(("a",)) is get(("a",)) and len(made) == 1
    get(("b",)), get(("c",))
    get(("a",))  # evicted by the two newer entries
    assert len(made) == 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gate_parameters_written_through_data_are_read_anew(dtype):
    """A bf16 / fp16 A_log or dt_bias (cast to fp32) or one of another shape (read flat) is read from its current
    values at every call: ``param.data.copy_`` (weight loaders, RL weight syncs) bumps no version counter, and
    ``param.data = new`` keeps the object, so a cache keyed on either would keep the old values."""
    import cula.gated_delta_rule as cg
    import cula.kda as ck

    torch.manual_seed(0)
    B, T, H, K = 1, 20, 2, 16
    q, k, v = (torch.randn(B, T, H, K) for _ in range(3))
    g, beta = torch.randn(B, T, H, K), torch.rand(B, T, H)
    A_log = torch.nn.Parameter(torch.randn(1, 1, H, 1).to(dtype))
    dt_bias = torch.nn.Parameter(torch.randn(H * K).to(dtype))
    calls = {
        "chunk_kda": lambda a, d: ck.chunk_kda(q, k, v, g, beta, A_log=a, dt_bias=d, use_gate_in_kernel=True)[0],
        "fused_recurrent_kda": lambda a, d: ck.fused_recurrent_kda(
            q, k, v, g, beta, A_log=a, dt_bias=d, use_gate_in_kernel=True
        )[0],
        "chunk_gated_delta_rule": lambda a, d: cg.chunk_gated_delta_rule(
            q, k, v, g[..., 0], beta, use_gate_in_kernel=True, A_log=a, dt_bias=d[:H]
        )[0],
    }  # fmt: skip
    with torch.no_grad():
        for name, call in calls.items():
            first = call(A_log, dt_bias)
            A_log.data.copy_(A_log.data * 0.5 - 1)
            dt_bias.data.copy_(dt_bias.data + 1)
            second = call(A_log, dt_bias)
            assert not torch.equal(first, second), name
            assert torch.equal(second, call(A_log.clone(), dt_bias.clone())), name  # tensors never seen before
            A_log.data = A_log.data + 1
            third = call(A_log, dt_bias)
            assert torch.equal(third, call(A_log.clone(), dt_bias.clone())), name


def test_public_args_are_the_signature():
    """chunk_kda builds its dispatch dict from its locals by these names: they must be its parameters."""
    import inspect

    names = tuple(inspect.signature(chunk_kda).parameters)
    assert names[:-1] == chunk_mod._PUBLIC_ARGS and names[-1] == "kwargs"


def test_repeats_skip_validation_and_match(counted):
    x = _inputs(dtype=torch.float32)
    flags = dict(FLAGS, state_v_first=False)
    with torch.no_grad():
        outs = [chunk_kda(**x, **flags) for _ in range(3)]  # reference backend on the CPU
    assert counted[0] == 1
    for o, s in outs[1:]:
        torch.testing.assert_close(o, outs[0][0], rtol=0, atol=0)
        torch.testing.assert_close(s, outs[0][1], rtol=0, atol=0)


def test_plans_keep_no_call_tensors(counted):
    """A cached plan outlives its first call: it must not hold that call's tensors (activations, with autograd
    graphs when training) alive."""
    import gc
    import weakref

    x = _inputs(dtype=torch.float32)
    refs = [weakref.ref(t) for t in x.values()]
    with torch.no_grad():
        chunk_kda(**x, **FLAGS)
    del x
    gc.collect()
    assert len(chunk_mod._plans) == 1 and all(r() is None for r in refs)


def test_new_signatures_and_bad_input_are_validated(counted, monkeypatch):
    x = _inputs(dtype=torch.float32)
    with torch.no_grad():
        chunk_kda(**x, **FLAGS)
        chunk_kda(**x, **dict(FLAGS, lower_bound=-4.0))  # a scalar value
        chunk_kda(**dict(x, q=x["q"][:, :50].contiguous(), k=x["k"][:, :50].contiguous(), v=x["v"][:, :50],
                         g=x["g"][:, :50], beta=x["beta"][:, :50]), **FLAGS)  # shapes and strides  # fmt: skip
        assert counted[0] == 3
        monkeypatch.setenv("CULA_KDA_INTRA", "0")  # anything selection reads
        chunk_kda(**x, **FLAGS)
        assert counted[0] == 4
        with pytest.raises(ValueError, match="safe range"):
            chunk_kda(**x, **dict(FLAGS, lower_bound=-6.0))
        with pytest.raises(ValueError):
            chunk_kda(**dict(x, beta=x["beta"][..., :1]), **FLAGS)
        with pytest.raises(TypeError, match="scale"):  # a scale of an unusual type is never planned
            chunk_kda(**x, **FLAGS, scale=torch.tensor(0.1))
    with pytest.raises(TypeError):
        chunk_kda(**x, **FLAGS, not_an_argument=1)
    # varlen calls are validated every time (cu_seqlens values are checked)
    xv = {n: (t[:1] if t is not None and t.dim() > 1 and t.shape[0] == B else t) for n, t in x.items()}
    cu = torch.tensor([0, 30, T], dtype=torch.int32)
    xv["initial_state"] = x["initial_state"]
    before = counted[0]
    with torch.no_grad():
        for _ in range(2):
            chunk_kda(**xv, **FLAGS, cu_seqlens=cu)
    assert counted[0] == before + 2
    # training: a new signature (requires_grad), then the same
    xt = {n: t.clone().requires_grad_(t.dtype == torch.float32 and n in ("q", "k", "v")) for n, t in x.items()}
    before = counted[0]
    for _ in range(2):
        o, _s = chunk_kda(**xt, **FLAGS)
    assert counted[0] == before + 1 and o.requires_grad


@pytest.fixture
def fake_sm90(monkeypatch, pretend_sm90):
    """CPU tensors that look like an SM90 device with the DSL installed; the two kernels record their arguments
    (the bound launch's one host call for both, ``fwd_launch``, as the two calls it makes)."""
    return stub_kernels(monkeypatch)


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_bound_launch_passes_what_the_general_path_passes(counted, fake_sm90, state_v_first, with_state):
    from cula.kda.forward import chunk_kda_fwd_sm90

    x = _inputs()
    if not with_state:
        x["initial_state"] = None
    elif state_v_first:
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    flags = dict(FLAGS, state_v_first=state_v_first, output_final_state=with_state)
    with torch.no_grad():
        chunk_kda_fwd_sm90(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.125, x["initial_state"],
                           flags["output_final_state"], state_v_first, **{n: flags[n] for n in (
                               "use_gate_in_kernel", "lower_bound", "safe_gate", "use_qk_l2norm_in_kernel",
                               "use_beta_sigmoid_in_kernel")}, A_log=x["A_log"], dt_bias=x["dt_bias"])  # fmt: skip
        general = list(fake_sm90)
        fake_sm90.clear()
        for _ in range(2):
            o, s = chunk_kda(**x, **flags, scale=0.125)
    assert counted[0] == 1
    assert [c[0] for c in general] == ["intra", "state"] and [c[0] for c in fake_sm90] == ["intra", "state"] * 2
    assert o.shape == (B, T, HV, D) and (s is not None) == with_state
    inputs = [t for t in x.values() if t is not None]
    for got in (fake_sm90[:2], fake_sm90[2:]):
        assert_same_calls(general, got, inputs)
    assert len(chunk_mod._plans) == 1


@pytest.mark.parametrize("variant", ["kda", "gdn", "gdn_wy"])
@pytest.mark.parametrize("halves", [False, True])
@pytest.mark.parametrize("state_v_first,with_state", [(False, True), (True, False)])
def test_cut_launch_passes_what_the_general_path_passes(fake_sm90, monkeypatch, kda_tuning, variant, halves,
                                                        state_v_first, with_state):  # fmt: skip
    """A fixed-length call the time split cuts: the bound cut launch hands the intra, segment summary, chain and
    state/output kernels what the general path hands them (KDA, and Gated DeltaNet's factor rows with and without
    T diag(beta) in the recurrence; with the output pass over the segments' halves too), the segment tables by
    value."""
    from cula.kda.forward import chunk_kda_fwd_sm90, prepare_chunk_kda_fwd_sm90
    from cula.ops.kda.sm90 import segment_chain, segment_summary
    from cula.time_split import SplitThresholds

    for name, module in (("summary", segment_summary), ("chain", segment_chain)):
        monkeypatch.setattr(module, "compiled_variant",
                            lambda name=name, **kw: lambda *a: fake_sm90.append((name, kw, a)))  # fmt: skip
    # every sequence cut into 64-token segments (B = 2, T = 100: two segments each, the second partial)
    kda_tuning(time_split=SplitThresholds(items_per_sm=1e9, busy_items_per_sm=1e9, min_segment=64, min_seq_len=0),
               time_split_halves=halves)  # fmt: skip
    x = _inputs()
    if variant != "kda":  # one gate per token and value head, dt_bias per head
        x["g"], x["dt_bias"] = x["g"][..., 0].contiguous(), x["dt_bias"][:HV].contiguous()
    if not with_state:
        x["initial_state"] = None
    flags = {n: FLAGS[n] for n in ("use_gate_in_kernel", "lower_bound", "safe_gate", "use_qk_l2norm_in_kernel",
                                   "use_beta_sigmoid_in_kernel")}  # fmt: skip
    rows = dict(row_factors=variant != "kda", wy_in_recurrence=variant == "gdn_wy")
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.125, x["initial_state"], with_state, state_v_first)
    with torch.no_grad():
        o_want, s_want = chunk_kda_fwd_sm90(*args, **flags, **rows, A_log=x["A_log"], dt_bias=x["dt_bias"])
        general = list(fake_sm90)
        fake_sm90.clear()
        launch = prepare_chunk_kda_fwd_sm90(*args, **flags, **rows, A_log=x["A_log"], dt_bias=x["dt_bias"])
        o, s = launch(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], x["A_log"], x["dt_bias"], 0.125)
    kinds = ["intra", "summary", "chain", "chain", "state"] if halves else ["intra", "summary", "chain", "state"]
    assert [c[0] for c in general] == kinds
    assert_same_calls(general, list(fake_sm90), [t for t in x.values() if t is not None])
    for (_, _, a), (_, _, b) in zip(general, fake_sm90):  # the segment tables by value
        for t, u in zip(a, b):
            if isinstance(t, torch.Tensor) and t.dtype == torch.int32:
                assert torch.equal(t, u)
    assert (o.shape, o.dtype) == (o_want.shape, o_want.dtype) and (s is None) == (s_want is None) == (not with_state)


def _general_path(x: dict, output_final_state: bool, state_v_first: bool) -> tuple:
    """``chunk_kda_fwd_sm90`` on ``x`` with FLAGS' gate, norm and beta flags: the general path a plan is held to."""
    from cula.kda.forward import chunk_kda_fwd_sm90

    return chunk_kda_fwd_sm90(
        x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, x["initial_state"], output_final_state, state_v_first,
        use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=True, use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (sm_90)")
@pytest.mark.parametrize("state_v_first,with_state", [(False, True), (True, True), (True, False)])
def test_bound_launch_bit_identical_cuda(counted, state_v_first, with_state):
    """The bound launch (both kernels from one host call, fwd_launch) against the general path, bit for bit."""
    x = _inputs("cuda")
    if not with_state:
        x["initial_state"] = None
    elif state_v_first:
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    flags = dict(FLAGS, state_v_first=state_v_first, output_final_state=with_state)
    with torch.inference_mode():
        ref_o, ref_s = _general_path(x, with_state, state_v_first)
        for _ in range(3):
            o, s = chunk_kda(**x, **flags)
            torch.cuda.synchronize()
            assert not torch.isnan(o).any()
            assert torch.equal(o.view(torch.int16), ref_o.view(torch.int16))
            if with_state:
                assert not torch.isnan(s).any()  # equal bits of a state left poisoned by both paths would pass
                assert torch.equal(s.view(torch.int32), ref_s.view(torch.int32))
            else:
                assert s is None and ref_s is None
    assert counted[0] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (sm_90)")
@pytest.mark.parametrize("halves", [False, True])
def test_cut_launch_bit_identical_cuda(counted, kda_tuning, halves):
    """Repeated calls the time split cuts (the bound cut launch: intra, summary, chain and output kernels) against
    the general path's cut, bit for bit, outputs poisoned first."""
    from cula.kda.plan import parallel_segments
    from cula.testing import poisoned_allocations

    kda_tuning(time_split_halves=halves)
    Bc, Tc, Hc = 1, 40000, 4
    assert parallel_segments(Bc, Tc, Hc, None, None, torch.device("cuda")) is not None
    for seed in range(2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = {n: torch.randn(*shape, generator=gen, device="cuda").to(dt) for n, shape, dt in (
            ("q", (Bc, Tc, Hc, D), torch.bfloat16), ("k", (Bc, Tc, Hc, D), torch.bfloat16),
            ("v", (Bc, Tc, Hc, D), torch.bfloat16), ("g", (Bc, Tc, Hc, D), torch.bfloat16),
            ("beta", (Bc, Tc, Hc), torch.bfloat16), ("initial_state", (Bc, Hc, D, D), torch.float32))}  # fmt: skip
        x["g"] -= 8  # slow gates: the start states carry across the segments
        x["A_log"], x["dt_bias"] = torch.zeros(Hc, device="cuda"), torch.zeros(Hc * D, device="cuda")
        with torch.inference_mode():
            ref_o, ref_s = _general_path(x, True, True)
            with poisoned_allocations():
                o, s = chunk_kda(**x, **FLAGS)
        assert not torch.isnan(o).any() and not torch.isnan(s).any()
        assert torch.equal(o, ref_o) and torch.equal(s, ref_s)
    assert counted[0] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (sm_90)")
def test_bound_launch_in_cuda_graph(counted):
    """The one-call bound launch (fwd_launch) under CUDA-graph capture: its workspace comes from the graph's
    pool, and a replay returns the eager call's bits."""
    x = _inputs("cuda")
    with torch.inference_mode():
        o_eager, s_eager = chunk_kda(**x, **FLAGS)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_graph, s_graph = chunk_kda(**x, **FLAGS)
        o_graph.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
    assert counted[0] == 1
    assert not o_eager.isnan().any() and not s_eager.isnan().any()  # else poisoned bits in both would match
    assert torch.equal(o_graph.view(torch.int16), o_eager.view(torch.int16))
    assert torch.equal(s_graph.view(torch.int32), s_eager.view(torch.int32))


def _varlen_inputs(lens, seed=0, cu_dtype=torch.int32):
    x = _inputs(seed=seed)
    T_ = sum(lens)
    gen = torch.Generator().manual_seed(seed)
    for n in ("q", "k", "v", "g", "beta"):
        x[n] = torch.randn((1, T_) + tuple(x[n].shape[2:]), generator=gen).to(x[n].dtype)
    x["initial_state"] = 0.1 * torch.randn(len(lens), HV, D, D, generator=gen)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=cu_dtype)
    return x, dict(cu_seqlens=cu, cu_seqlens_cpu=cu.clone())


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_varlen_plan_passes_what_the_general_path_passes(counted, fake_sm90, monkeypatch, cu_dtype):
    """Packed sequences of new total lengths reuse one plan (validated once), and each call hands
    the kernels what the general path hands them, chunk indices included (a zero-length sequence among them)."""
    from cula.kda.forward import chunk_kda_fwd_sm90

    for i, lens in enumerate(([40, 0, 130, 64], [3, 64, 200, 1], [0, 0, 0, 65])):
        x, cus = _varlen_inputs(lens, seed=i, cu_dtype=cu_dtype)
        with torch.no_grad():
            fake_sm90.clear()
            fused = ("use_gate_in_kernel", "lower_bound", "safe_gate", "use_qk_l2norm_in_kernel",
                     "use_beta_sigmoid_in_kernel")  # fmt: skip
            chunk_kda_fwd_sm90(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.125, x["initial_state"], True, True,
                               **cus, **{n: FLAGS[n] for n in fused}, A_log=x["A_log"], dt_bias=x["dt_bias"])
            general = list(fake_sm90)
            fake_sm90.clear()
            chunk_kda(**x, **FLAGS, **cus, scale=0.125)
        assert [c[0] for c in general] == [c[0] for c in fake_sm90] == ["intra", "state"]
        inputs = [t for t in x.values() if t is not None]
        assert_same_calls(general, fake_sm90, inputs)
        chunk_indices = (general[0][2][15], fake_sm90[0][2][15])
        assert chunk_indices[1].dtype == torch.int32 and torch.equal(*chunk_indices)
        assert torch.equal(general[1][2][9], fake_sm90[1][2][9])  # cu_seqlens as int32
    assert counted[0] == 1 and len(chunk_mod._plans) == 1


def test_varlen_plan_checks_every_call(counted, fake_sm90, monkeypatch):
    """A cached varlen plan still refuses bad boundaries, before any kernel runs; other changes to what validation
    reads (lengths that differ between tensors, non-contiguous inputs) take the general path and its errors."""
    x, cus = _varlen_inputs([40, 0, 130, 64])
    with torch.no_grad():
        chunk_kda(**x, **FLAGS, **cus)
        fake_sm90.clear()
        for bad in ([0, 40, 30, 170, 234], [1, 40, 40, 170, 234], [0, 40, 40, 170, 233]):
            cu = torch.tensor(bad, dtype=torch.int32)
            with pytest.raises(ValueError, match="cu_seqlens"):
                chunk_kda(**x, **FLAGS, cu_seqlens=cu, cu_seqlens_cpu=cu.clone())
        short = dict(x, beta=x["beta"][:, :-1])
        with pytest.raises(ValueError, match="beta"):
            chunk_kda(**short, **FLAGS, **cus)
    assert fake_sm90 == [] and counted[0] == 2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (sm_90)")
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_varlen_plan_bit_identical_cuda(counted, monkeypatch, cu_dtype):
    """Packed calls of three total lengths through one plan (both kernels from one host call, the chunk indices from
    cu_seqlens_cpu) against the general path (no host copy of the boundaries), bit for bit, zero-length sequences
    included."""
    from cula.backends import clear_plan_caches

    clear_plan_caches()
    with torch.inference_mode():
        for i, lens in enumerate(([40, 0, 130, 64], [3, 64, 200, 1], [0, 0, 0, 65])):
            x, cus = _varlen_inputs(lens, seed=i, cu_dtype=cu_dtype)
            x = {n: t.cuda() for n, t in x.items()}
            cus["cu_seqlens"] = cus["cu_seqlens"].cuda()
            outs = []
            for host_copy in (False, True):  # the general path, then the plan
                outs.append(chunk_kda(**x, **FLAGS, **dict(cus, cu_seqlens_cpu=cus["cu_seqlens_cpu"] if host_copy
                                                            else None)))  # fmt: skip
            torch.cuda.synchronize()
            (o0, s0), (o1, s1) = outs
            assert not torch.isnan(o1).any() and not torch.isnan(s1).any()
            assert torch.equal(o0.view(torch.int16), o1.view(torch.int16))
            assert torch.equal(s0.view(torch.int32), s1.view(torch.int32))
    assert len(chunk_mod._plans) == 1  # the three lengths shared one varlen plan


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (sm_90)")
@pytest.mark.parametrize("varlen", [False, True])
def test_planned_call_does_not_wait_for_the_gpu(varlen):
    """A planned call queues its work and returns while the GPU is still busy with earlier work: nothing in it
    waits for the stream (the varlen plan's chunk indices once did, through a copy from pageable memory, which
    made host and GPU time add up on every call)."""
    from cula.backends import clear_plan_caches

    clear_plan_caches()
    if varlen:
        x, cus = _varlen_inputs([40, 0, 130, 64])
        cus["cu_seqlens"] = cus["cu_seqlens"].cuda()
    else:
        x, cus = _inputs(), {}
    x = {n: t.cuda() for n, t in x.items()}
    with torch.inference_mode():
        chunk_kda(**x, **FLAGS, **cus)  # builds the plan
        torch.cuda.synchronize()
        busy = torch.cuda.Event()
        torch.cuda._sleep(2 * 10**8)  # ~0.1 s of GPU time at 1.98 GHz, far more than a call's host time
        busy.record()
        o, _ = chunk_kda(**x, **FLAGS, **cus)
        returned_while_busy = not busy.query()
        torch.cuda.synchronize()
    assert returned_while_busy
    assert not torch.isnan(o).any()


def test_training_calls_run_through_autograd(counted, fake_sm90, monkeypatch):
    """With autograd on, a repeated call keeps its plan but runs our forward inside ``_ChunkKDATraining`` (FLA's
    backward behind it), never the forward-only bound launch."""
    import cula.kda.backends as kb

    seen = []
    forward = kb._ChunkKDATraining.forward
    monkeypatch.setattr(kb._ChunkKDATraining, "forward", staticmethod(lambda *a: seen.append(1) or forward(*a)))
    x = {n: t.requires_grad_() for n, t in _inputs().items()}
    for _ in range(2):
        o, ht = chunk_kda(**x, **FLAGS)
        assert type(o.grad_fn).__name__ == "_ChunkKDATrainingBackward" and ht.grad_fn is o.grad_fn
    assert seen == [1, 1] and counted[0] == 1
    assert [c[0] for c in fake_sm90] == ["intra", "state"] * 2


def test_inputs_needing_a_copy_take_the_general_path(counted, fake_sm90):
    x = _inputs()
    x["q"] = torch.randn(B, T, 2 * H, D).to(torch.bfloat16)[:, :, :H]  # strided heads
    with torch.no_grad():
        for _ in range(2):
            chunk_kda(**x, **FLAGS)
    assert counted[0] == 1 and [c[0] for c in fake_sm90] == ["intra", "state"] * 2
    q_seen = fake_sm90[0][2][0]
    assert q_seen.is_contiguous() and q_seen.data_ptr() != x["q"].data_ptr()


@pytest.mark.parametrize("growth", [None, 4])
@pytest.mark.parametrize("T_", [128, 1100, 2048, 4133, 16384, 100_000])
def test_segment_bounds_cover_whole_chunks(T_, growth):
    from cula.kda.plan import KdaTuning, segment_bounds

    tuning = KdaTuning(segment_growth=growth)
    bounds = segment_bounds(T_, tuning)
    last = tuning.last_segment_tokens
    if growth is not None and T_ >= 2 * last:
        assert last <= bounds[-1][1] - bounds[-1][0] < last + 64
    assert bounds[0][0] == 0 and bounds[-1][1] == T_
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert all((t1 - t0) % 64 == 0 and t1 > t0 for t0, t1 in bounds[:-1]) and bounds[-1][1] > bounds[-1][0]
    assert 2 <= len(bounds) <= tuning.max_segments


def _b1_inputs(T_: int, seed: int) -> dict:
    """One CUDA sequence of T_ tokens (module sizes H, HV, D), with an initial state."""
    x = _inputs("cuda", seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for n in ("q", "k", "v", "g", "beta"):
        shape = (1, T_) + tuple(x[n].shape[2:])
        x[n] = torch.randn(shape, generator=gen, device="cuda").to(x[n].dtype)
    x["initial_state"] = x["initial_state"][:1].contiguous()
    return x


@pytest.mark.parametrize("with_h0", [False, True])
def test_segmented_launch_plumbing(counted, fake_sm90, monkeypatch, kda_tuning, with_h0):
    """Time segments (overlap_state_min_tokens) on the CPU with the kernels and CUDA streams stubbed: each segment's
    intra on the caller's stream, then its state kernel on the side stream after an event, the state handed from one
    segment's ht to the next one's h0, the caller's initial and final state at the ends."""
    import contextlib

    import cula.kda.forward as cf

    class Stream:
        def __init__(self, name="side", **_):
            self.name = name

        def wait_stream(self, other):
            fake_sm90.append(("wait_stream", self.name, other.name))

        def wait_event(self, ev):
            fake_sm90.append(("wait_event", self.name))

    class Event:
        def record(self, stream):
            fake_sm90.append(("record", stream.name))

    @contextlib.contextmanager
    def on(stream):
        fake_sm90.append(("enter", stream.name))
        yield
        fake_sm90.append(("exit", stream.name))

    main = Stream("main")
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cf, "_side_streams", {})
    kda_tuning(overlap_state_min_tokens=64)
    x = {n: (t[:1] if t is not None and t.dim() > 1 else t) for n, t in _inputs().items()}
    if not with_h0:
        x["initial_state"] = None
    with torch.no_grad():
        chunk_kda(**x, **FLAGS)
        fake_sm90.clear()
        o, s = chunk_kda(**x, **FLAGS)
    kinds = [c[0] for c in fake_sm90]
    assert kinds == ["wait_stream", "intra", "record", "wait_event", "enter", "state", "exit",
                     "intra", "record", "wait_event", "enter", "state", "exit", "wait_stream"]  # fmt: skip
    assert fake_sm90[0][1:] == ("side", "main") and fake_sm90[-1][1:] == ("main", "side")
    intras = [c[2] for c in fake_sm90 if c[0] == "intra"]
    states = [c for c in fake_sm90 if c[0] == "state"]
    assert [a[17] for a in intras] == [64, T - 64]  # tokens of each segment (T = 100)
    assert intras[1][0].data_ptr() == x["q"].data_ptr() + 64 * H * D * 2
    (kw0, a0), (kw1, a1) = ((c[1], c[2]) for c in states)
    assert kw0["has_h0"] == with_h0 and kw0["has_ht"] and kw1["has_h0"] and kw1["has_ht"]
    if with_h0:
        assert a0[7].data_ptr() == x["initial_state"].data_ptr()
    assert a1[7].data_ptr() == a0[8].data_ptr() and a1[8].data_ptr() == s.data_ptr()
    assert a0[6].data_ptr() == o.data_ptr() and a1[6].data_ptr() == o.data_ptr() + 64 * HV * D * 2
    assert (a0[10], a1[10]) == (64, T - 64) and a0[11] == a1[11] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (sm_90)")
@pytest.mark.parametrize("T_,with_h0,with_ht", [(1100, True, True), (4133, False, True), (2048, True, False)])
def test_segmented_launch_bit_identical_cuda(counted, T_, with_h0, with_ht):
    """overlap_state_min_tokens: a B=1 call in time segments (intra on the caller's stream, the recurrence of each
    segment on a side stream, the state handed on in fp32) returns the same bits as the one-piece bound launch."""
    from cula.kda.plan import KDA_TUNING

    x = _b1_inputs(T_, seed=T_)
    if not with_h0:
        x["initial_state"] = None
    flags = dict(FLAGS, output_final_state=with_ht)
    outs = []
    with torch.inference_mode():
        for min_tokens in (None, 1024):
            with KDA_TUNING.override(overlap_state_min_tokens=min_tokens):
                for _ in range(2):  # the general path plans, the second call runs the bound launch
                    o, s = chunk_kda(**x, **flags)
            torch.cuda.synchronize()
            outs.append((o, s))
    (o0, s0), (o1, s1) = outs
    assert not torch.isnan(o1).any()
    assert torch.equal(o0.view(torch.int16), o1.view(torch.int16))
    if with_ht:
        assert not torch.isnan(s1).any()  # equal bits of a state left poisoned by both launches would pass
        assert torch.equal(s0.view(torch.int32), s1.view(torch.int32))
    else:
        assert s0 is None and s1 is None


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (sm_90)")
def test_segmented_launch_in_cuda_graph(counted, kda_tuning):
    """The segmented launch's side stream forks from and joins the capturing stream, so a CUDA graph of the call
    replays the same bits."""
    kda_tuning(overlap_state_min_tokens=1024)
    x = _b1_inputs(3000, seed=7)
    with torch.inference_mode():
        for _ in range(2):
            o_eager, s_eager = chunk_kda(**x, **FLAGS)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_graph, s_graph = chunk_kda(**x, **FLAGS)
        graph.replay()
        torch.cuda.synchronize()
    assert not o_eager.isnan().any() and not s_eager.isnan().any()  # else poisoned bits in both would match
    assert torch.equal(o_graph.view(torch.int16), o_eager.view(torch.int16))
    assert torch.equal(s_graph.view(torch.int32), s_eager.view(torch.int32))


@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "packed"])
def test_forward_keeps_the_prefix_states(fake_sm90, monkeypatch, packed):
    """``chunk_kda_fwd_sm90(keep_prefix=True)`` (FLA's ``disable_recompute``): the state kernel's states-writing
    variant gets room for h (FLA's layout: one row a chunk, or with FLA's graph mode the rows of its fixed-size
    list) and v_new, and the prefix returns them beside the intra kernel's tensors."""
    from cula.kda.forward import chunk_kda_fwd_sm90

    x = _inputs()
    lens = [37, 0, 130, 1]
    kw = dict(scale=0.1, initial_state=None, output_final_state=True, keep_scores=True, keep_prefix=True,
              safe_gate=True, use_gate_in_kernel=True, lower_bound=-5.0, A_log=x["A_log"], dt_bias=x["dt_bias"])
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    if packed:  # the batch's rows as one pack of sum(lens) <= B T tokens
        q, k, v, g, beta = (t.reshape(1, B * T, *t.shape[2:])[:, :sum(lens)] for t in (q, k, v, g, beta))
        kw["cu_seqlens"] = kw["cu_seqlens_cpu"] = make_cu_seqlens(lens)
    Bx, Tx = q.shape[:2]
    for graph in (False, True) if packed else (False,):
        fake_sm90.clear()
        o, ht, Aqk, Akk, kept = chunk_kda_fwd_sm90(q, k, v, g, beta, use_graph=graph, **kw)
        state = [c for c in fake_sm90 if c[0] == "state"]
        assert len(state) == 1 and state[0][1].get("store_states") is True
        rows = (-(-Tx // 64) + len(lens) - 1) if graph else (sum(-(-n // 64) for n in lens) if packed else -(-Tx // 64))
        assert set(kept) == {"g", "w", "u", "qg", "kg", "h", "v_new"} and kept["h"].shape == (Bx, rows, HV, D, D)
        assert kept["v_new"].shape == v.shape and kept["v_new"].dtype == v.dtype


@pytest.mark.parametrize("gates", ["log", "softplus", "lower_bound"])
def test_unbounded_gates_take_the_any_gate_variant(counted, fake_sm90, kda_tuning, gates):
    """Gates no bound is known of (a log-space gate without safe_gate, the fused softplus gate) take the intra
    kernel's any_gate variant where the tuning entry says so (``KdaTuning.intra_any_gate``), in the bound launch and
    the general path alike; the fused lower-bound gate is bounded and takes the plain variant either way; with the
    entry off the unbounded ones leave cula's intra kernel (FLA's stages)."""
    from cula.kda.forward import chunk_kda_fwd_sm90
    from cula.kda.plan import gates_bounded, intra_any_gate, use_cula_intra

    x = _inputs()
    flags = dict(FLAGS, safe_gate=False)
    if gates == "log":
        flags.update(use_gate_in_kernel=False, lower_bound=None)
        x.update(A_log=None, dt_bias=None, g=torch.nn.functional.logsigmoid(x["g"].float()).to(x["g"].dtype))
    elif gates == "softplus":
        flags.update(lower_bound=None)
    bounded = gates == "lower_bound"
    fused, lb = flags["use_gate_in_kernel"], flags["lower_bound"]
    assert gates_bounded(False, fused, lb) == bounded and intra_any_gate(False, fused, lb) == (not bounded)
    q = x["q"]
    kda_tuning(intra_any_gate=False)
    assert use_cula_intra(q, x["v"], False, fused, lb) == bounded
    kda_tuning(intra_any_gate=True)
    assert use_cula_intra(q, x["v"], False, fused, lb)
    with torch.no_grad():
        chunk_kda_fwd_sm90(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.125, x["initial_state"], True, True,
                           use_gate_in_kernel=fused, lower_bound=lb, safe_gate=False, use_qk_l2norm_in_kernel=True,
                           use_beta_sigmoid_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"])  # fmt: skip
        general = list(fake_sm90)
        fake_sm90.clear()
        chunk_kda(**x, **flags, scale=0.125)
    for calls in (general, fake_sm90):
        intra_kw = [kw for name, kw, _ in calls if name == "intra"]
        assert intra_kw and all(kw.get("any_gate", False) == (not bounded) for kw in intra_kw)


def test_fixed_length_short_key_holds_the_device():
    """The fixed-length launch allocates its outputs on the device it was planned for: the same shapes on another
    device must not find it (it would be refused by the entry and re-planned on every call, its buffers made on the
    other GPU)."""
    keys = []
    for device in ("cpu", "meta"):
        q = torch.zeros(2, 64, 1, 128, device=device, dtype=torch.bfloat16)
        g = torch.zeros(2, 64, 1, 128, device=device)
        beta = torch.zeros(2, 64, 1, device=device)
        keys.append(chunk_mod._short_key(q, q, q, g, beta, None, None, None, None, None, (), False, True))
    assert None not in keys and keys[0] != keys[1]


def test_short_keys_need_what_the_bound_launches_take():
    """The bound launches take contiguous token tensors and a contiguous initial state (prepare_chunk_kda_fwd_sm90):
    a call strided in time (packed too) or with a state strided in dim 0 has no short key, so it never reaches a
    launch a contiguous call planned (validation decides where it runs)."""
    bf = torch.bfloat16
    q = torch.zeros(1, 64, 2, 128, dtype=bf)
    g, beta = torch.zeros(1, 64, 2, 128), torch.zeros(1, 64, 2)
    h0 = torch.zeros(2, 2, 128, 128)
    cu = torch.tensor([0, 30, 64], dtype=torch.int32)
    in_time = torch.zeros(1, 128, 2, 128, dtype=bf)[:, ::2]
    odd_h0 = torch.zeros(4, 2, 128, 128)[::2]
    for cus in ((None, None), (cu, cu.clone())):
        key = lambda q_, h0_: chunk_mod._short_key(q_, q, q, g, beta, h0_, None, None, *cus, (), False, True)  # noqa: E731
        assert key(q, h0) is not None
        assert key(in_time, h0) is None and key(q, odd_h0) is None


@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "packed"])
def test_intermediate_states_plumbing(counted, fake_sm90, kda_tuning, packed):
    """return_intermediate_states on cula's kernels (KdaTuning.intermediate_states): the intra kernel, then the
    state kernel's storing variant with h in FLA's shape ([B, NT, HV, K, V]; packed, a row per chunk of each
    sequence) and dtype (v's), returned third; every call validated (no plan)."""
    kda_tuning(intermediate_states=True)
    x = _inputs()
    lens = [37, 0, 130, 33] if packed else None
    if packed:
        x = {n: (t.reshape(1, B * T, *t.shape[2:]) if n in ("q", "k", "v", "g", "beta") else t) for n, t in x.items()}
        x["initial_state"] = torch.randn(len(lens), HV, D, D) * 0.1
    cu = make_cu_seqlens(lens) if packed else None
    with torch.inference_mode():
        for _ in range(2):
            o, s, h = chunk_kda(**x, **FLAGS, cu_seqlens=cu, return_intermediate_states=True)
    assert counted[0] == 2
    assert [c[0] for c in fake_sm90] == ["intra", "state"] * 2
    assert fake_sm90[1][1].get("store_states") is True
    NT = 1 + 0 + 3 + 1 if packed else -(-T // 64)
    assert h.shape == ((1 if packed else B), NT, HV, D, D) and h.dtype == x["v"].dtype
    assert o.shape == x["v"].shape and s.shape == x["initial_state"].shape
