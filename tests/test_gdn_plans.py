"""chunk_gated_delta_rule's plan cache on the CPU: a repeated fixed-length signature is validated once and runs the
general path's numbers on each call's own inputs; what validation reads starts a new plan; bad input after a good
call still raises."""

from __future__ import annotations

import itertools

import pytest
import torch

import cula.gated_delta_rule.chunk as chunk_mod
from cula.gated_delta_rule import chunk_gated_delta_rule

B, T, H, HV, D = 2, 70, 2, 4, 32


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, D, generator=gen) for _ in range(2))
    v = torch.randn(B, T, HV, D, generator=gen)
    g, beta = torch.randn(B, T, HV, generator=gen), torch.randn(B, T, HV, generator=gen)
    h0 = 0.1 * torch.randn(B, HV, D, D, generator=gen)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, A_log=torch.rand(HV, generator=gen),
                dt_bias=torch.randn(HV, generator=gen))  # fmt: skip


FLAGS = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
             output_final_state=True)  # fmt: skip


@pytest.fixture
def counted(plan_counter):
    return plan_counter(chunk_mod)


def test_repeated_signature_is_validated_once(counted):
    for seed in range(3):
        x = _inputs(seed)
        o, s = chunk_gated_delta_rule(**x, **FLAGS)
        o_want, s_want = chunk_gated_delta_rule(**x, **FLAGS, chunk_size=64)  # (a keyword off the plan cache)
        assert torch.equal(o, o_want) and torch.equal(s, s_want)
    assert counted[0] == 1 + 3 and len(chunk_mod._plans) == 1


def test_what_validation_reads_starts_a_new_plan(counted):
    x = _inputs()
    chunk_gated_delta_rule(**x, **FLAGS)
    variants = [
        dict(FLAGS, scale=0.5), dict(FLAGS, scale=1), dict(FLAGS, output_final_state=False),
        dict(FLAGS, use_gate_in_kernel=False), dict(FLAGS, state_v_first=True), dict(FLAGS, allow_neg_eigval=True),
    ]  # fmt: skip
    for kw in variants:
        chunk_gated_delta_rule(**x, **kw)
    chunk_gated_delta_rule(**dict(x, initial_state=None), **FLAGS)
    chunk_gated_delta_rule(**dict(x, dt_bias=None), **FLAGS)
    chunk_gated_delta_rule(**dict(x, g=x["g"].double()), **FLAGS)
    assert counted[0] == 1 + len(variants) + 3
    with pytest.raises(ValueError, match="A_log"):
        chunk_gated_delta_rule(**dict(x, A_log=x["A_log"][:1]), **FLAGS)
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        chunk_gated_delta_rule(**x, **dict(FLAGS, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=True))
    with pytest.raises(ValueError):
        chunk_gated_delta_rule(**dict(x, beta=x["beta"][:, :5]), **FLAGS)


def test_gradients_through_a_planned_signature(counted):
    x = _inputs()
    leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
    grads = []
    for _ in range(2):
        o, s = chunk_gated_delta_rule(**dict(x, **leaves), **FLAGS)
        grads.append(torch.autograd.grad((o.sum() + s.sum()), list(leaves.values())))
    assert counted[0] == 1
    for a, b in zip(*grads):
        assert torch.equal(a, b) and torch.isfinite(a).all()


# ------------------------------------------------------------------ the cula-sm90 bound launch (KDA's fwd_launch)

HAS_CUDA = torch.cuda.is_available()
KB, KT, KH, KHV, KD = 2, 100, 2, 4, 128  # the kernels' head size; T not a multiple of the chunk


def _kernel_inputs(device="cpu", dtype=torch.bfloat16, seed=0, state_v_first=False, with_state=True):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, dt=dtype, s=1.0):
        return (s * torch.randn(*shape, generator=gen, device=device)).to(dt)

    h0 = rnd(KB, KHV, KD, KD, dt=torch.float32, s=0.1) if with_state else None
    return dict(q=rnd(KB, KT, KH, KD), k=rnd(KB, KT, KH, KD), v=rnd(KB, KT, KHV, KD), g=rnd(KB, KT, KHV),
                beta=rnd(KB, KT, KHV), initial_state=h0, A_log=rnd(KHV, dt=torch.float32, s=0.5),
                dt_bias=rnd(KHV, dt=torch.float32, s=0.5))  # fmt: skip


def _general_path(x, scale, flags):
    """What the cula-sm90 backend runs for an inference call without a plan (its general path)."""
    from cula.gated_delta_rule.plan import GDN_TUNING
    from cula.kda.forward import chunk_kda_fwd_sm90

    return chunk_kda_fwd_sm90(
        x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], flags["output_final_state"],
        flags.get("state_v_first", False), flags.get("cu_seqlens"), flags.get("cu_seqlens_cpu"),
        use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, row_factors=True,
        wy_in_recurrence=GDN_TUNING.for_device(x["q"].device).inference_wy_in_recurrence,
        time_split=GDN_TUNING.for_device(x["q"].device).time_split,
    )  # fmt: skip


@pytest.mark.parametrize("wy", [False, True], ids=["w-u", "wy-in-recurrence"])
@pytest.mark.parametrize("state_v_first,with_state", [(False, True), (True, True), (True, False)])
def test_bound_launch_passes_what_the_general_path_passes(counted, monkeypatch, pretend_sm90, gdn_tuning,
                                                          state_v_first, with_state, wy):  # fmt: skip
    """A repeated inference call runs KDA's one host call for both kernels with the factor rows (and ``wy``:
    ``GdnTuning.inference_wy_in_recurrence``): each kernel gets what the general path hands it (the kernels stubbed,
    fwd_launch emulated: tests/kda_launch_stubs.py)."""
    from kda_launch_stubs import assert_same_calls, stub_kernels

    gdn_tuning(inference_wy_in_recurrence=wy)
    calls = stub_kernels(monkeypatch)
    x = _kernel_inputs(state_v_first=state_v_first, with_state=with_state)
    flags = dict(FLAGS, state_v_first=state_v_first, output_final_state=with_state)
    with torch.no_grad():
        _general_path(x, 0.125, flags)
        general = list(calls)
        calls.clear()
        for _ in range(2):
            o, s = chunk_gated_delta_rule(**x, **flags, scale=0.125)
    assert counted[0] == 1 and len(chunk_mod._plans) == 1
    assert [c[0] for c in general] == ["intra", "state"] and [c[0] for c in calls] == ["intra", "state"] * 2
    assert general[0][1]["row_factors"] and general[1][1]["row_factors"]
    assert general[0][1].get("wy_in_recurrence", False) == general[1][1].get("wy_in_recurrence", False) == wy
    assert o.shape == (KB, KT, KHV, KD) and (s is not None) == with_state
    inputs = [t for t in x.values() if t is not None]
    for got in (calls[:2], calls[2:]):
        assert_same_calls(general, got, inputs)


def test_bound_launch_declines_what_the_general_path_runs_otherwise(counted, monkeypatch, pretend_sm90):
    """fp16 with the L2 norm (no factor rows there), training calls and inputs strided in time run the general
    path on every call."""
    from cula.ops.kda.sm90 import fwd_launch
    from kda_launch_stubs import stub_kernels

    calls = stub_kernels(monkeypatch)
    monkeypatch.setattr(fwd_launch, "compiled_variant", lambda *a, **kw: pytest.fail("bound launch taken"))
    half = _kernel_inputs(dtype=torch.float16)
    strided = _kernel_inputs()
    strided["q"] = torch.cat([strided["q"]] * 2, dim=1)[:, ::2]
    for x in (half, strided):
        for _ in range(2):
            with torch.no_grad():
                chunk_gated_delta_rule(**x, **FLAGS)
    assert [c[0] for c in calls] == ["intra", "state"] * 4


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (sm_90)")
@pytest.mark.parametrize("wy", [False, True], ids=["w-u", "wy-in-recurrence"])
@pytest.mark.parametrize("state_v_first,with_state", [(False, True), (True, True), (True, False)])
def test_bound_launch_bit_identical_cuda(counted, gdn_tuning, state_v_first, with_state, wy):
    """The bound launch (both kernels from one host call with the factor rows; ``wy``:
    ``GdnTuning.inference_wy_in_recurrence``) against the general path, bit for bit (every allocation poisoned, as
    in every GPU test)."""
    gdn_tuning(inference_wy_in_recurrence=wy)
    x = _kernel_inputs("cuda", state_v_first=state_v_first, with_state=with_state)
    flags = dict(FLAGS, state_v_first=state_v_first, output_final_state=with_state)
    with torch.inference_mode():
        ref_o, ref_s = _general_path(x, KD**-0.5, flags)
        for _ in range(3):
            o, s = chunk_gated_delta_rule(**x, **flags)
            torch.cuda.synchronize()
            assert torch.isfinite(o).all()
            assert torch.equal(o.view(torch.int16), ref_o.view(torch.int16))
            if with_state:
                assert torch.isfinite(s).all()  # equal bits of a state left poisoned by both paths would pass
                assert torch.equal(s.view(torch.int32), ref_s.view(torch.int32))
            else:
                assert s is None and ref_s is None
    assert counted[0] == 1


def test_intra_switch_starts_a_new_plan(counted, monkeypatch, pretend_sm90):
    """CULA_KDA_INTRA=0 (FLA's intra stages) reaches a signature planned before it was set: the plan key holds it,
    and back at its old value the old plan (cula's intra kernel, bound) serves again."""
    import cula.kda.forward as forward
    from kda_launch_stubs import stub_kernels

    calls = stub_kernels(monkeypatch)

    def fla_intra(*a, **kw):
        calls.append(("fla_intra",))
        raise RuntimeError("FLA's intra stage")

    monkeypatch.setattr(forward, "_intra_fla", fla_intra)
    x = _kernel_inputs()
    with torch.no_grad():
        chunk_gated_delta_rule(**x, **FLAGS)
        monkeypatch.setenv("CULA_KDA_INTRA", "0")
        with pytest.raises(RuntimeError, match="FLA's intra stage"):
            chunk_gated_delta_rule(**x, **FLAGS)
        monkeypatch.delenv("CULA_KDA_INTRA")
        chunk_gated_delta_rule(**x, **FLAGS)
    assert counted[0] == 2 and len(chunk_mod._plans) == 2
    assert [c[0] for c in calls] == ["intra", "state", "fla_intra", "intra", "state"]


# ------------------------------------------------------------------------------------- packed calls through plans


def _packed_inputs(lens, seed=0, cu_dtype=torch.int32, device="cpu", dtype=torch.bfloat16, D=KD):
    gen = torch.Generator(device=device).manual_seed(seed)
    T_, N = sum(lens), len(lens)

    def rnd(*shape, dt=dtype, s=1.0):
        return (s * torch.randn(*shape, generator=gen, device=device)).to(dt)

    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=cu_dtype)
    x = dict(q=rnd(1, T_, KH, D), k=rnd(1, T_, KH, D), v=rnd(1, T_, KHV, D), g=rnd(1, T_, KHV), beta=rnd(1, T_, KHV),
             initial_state=rnd(N, KHV, D, D, dt=torch.float32, s=0.1), A_log=rnd(KHV, dt=torch.float32, s=0.5),
             dt_bias=rnd(KHV, dt=torch.float32, s=0.5))  # fmt: skip
    return x, dict(cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)


def test_packed_signature_is_validated_once(counted):
    """Packed calls of new total lengths (an empty and a one-token sequence among them) reuse one plan and give the
    general path's numbers; a rewritten boundary buffer is read again each call."""
    for i, lens in enumerate(([40, 0, 33, 1], [3, 64, 20, 1], [0, 0, 0, 7])):
        x, cus = _packed_inputs(lens, seed=i, D=32)
        o, s = chunk_gated_delta_rule(**x, **FLAGS, **cus)
        o_want, s_want = chunk_gated_delta_rule(**x, **FLAGS, **cus, chunk_size=64)  # (off the plan cache)
        assert torch.equal(o, o_want) and torch.equal(s, s_want)
    assert counted[0] == 1 + 3 and len(chunk_mod._plans) == 1
    x, cus = _packed_inputs([10, 20, 30, 4], D=32)
    o = chunk_gated_delta_rule(**x, **FLAGS, **cus)[0]
    cus["cu_seqlens"][1:3] = torch.tensor([30, 40])  # an engine's static buffer, rewritten in place
    cus["cu_seqlens_cpu"] = cus["cu_seqlens"].clone()
    o2 = chunk_gated_delta_rule(**x, **FLAGS, **cus)[0]
    assert not torch.equal(o, o2)
    assert torch.equal(o2, chunk_gated_delta_rule(**x, **FLAGS, **cus, chunk_size=64)[0])


def test_packed_plan_checks_every_call(counted):
    """A planned packed signature still refuses bad boundaries (and a host copy that disagrees) before any launch."""
    x, cus = _packed_inputs([40, 0, 33, 1], D=32)
    chunk_gated_delta_rule(**x, **FLAGS, **cus)
    for bad in ([0, 40, 30, 73, 74], [1, 40, 40, 73, 74], [0, 40, 40, 73, 73]):
        cu = torch.tensor(bad, dtype=torch.int32)
        with pytest.raises(ValueError, match="cu_seqlens"):
            chunk_gated_delta_rule(**x, **FLAGS, cu_seqlens=cu, cu_seqlens_cpu=cu.clone())
    host = torch.tensor([0, 40, 41, 73, 74], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_cpu"):
        chunk_gated_delta_rule(**x, **FLAGS, cu_seqlens=cus["cu_seqlens"], cu_seqlens_cpu=host)
    assert counted[0] == 1


@pytest.mark.parametrize("wy", [False, True], ids=["w-u", "wy-in-recurrence"])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_packed_bound_launch_passes_what_the_general_path_passes(counted, monkeypatch, pretend_sm90, gdn_tuning,
                                                                 cu_dtype, wy):  # fmt: skip
    """Packed inference calls of new total lengths through one plan: each kernel gets what the general path hands it,
    the chunk indices included (``wy``: ``GdnTuning.inference_wy_in_recurrence``)."""
    from kda_launch_stubs import assert_same_calls, stub_kernels

    gdn_tuning(inference_wy_in_recurrence=wy)
    calls = stub_kernels(monkeypatch)
    for i, lens in enumerate(([40, 0, 130, 64], [3, 64, 200, 1], [0, 0, 0, 65])):
        x, cus = _packed_inputs(lens, seed=i, cu_dtype=cu_dtype)
        with torch.no_grad():
            calls.clear()
            _general_path(dict(x), 0.125, dict(FLAGS, **cus))
            general = list(calls)
            calls.clear()
            chunk_gated_delta_rule(**x, **FLAGS, **cus, scale=0.125)
        assert [c[0] for c in general] == [c[0] for c in calls] == ["intra", "state"]
        inputs = [t for t in x.values() if t is not None]
        assert_same_calls(general, calls, inputs)
    assert counted[0] == 1 and len(chunk_mod._plans) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (sm_90)")
@pytest.mark.parametrize("wy", [False, True], ids=["w-u", "wy-in-recurrence"])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_packed_bound_launch_bit_identical_cuda(counted, gdn_tuning, cu_dtype, wy):
    """Packed calls of three total lengths through one plan against the general path, bit for bit (empty and
    one-token sequences among them; ``wy``: ``GdnTuning.inference_wy_in_recurrence``)."""
    gdn_tuning(inference_wy_in_recurrence=wy)
    with torch.inference_mode():
        for i, lens in enumerate(([40, 0, 130, 64], [3, 64, 200, 1], [0, 0, 0, 65])):
            x, cus = _packed_inputs(lens, seed=i, cu_dtype=cu_dtype, device="cuda")
            ref_o, ref_s = _general_path(x, KD**-0.5, dict(FLAGS, **cus))
            o, s = chunk_gated_delta_rule(**x, **FLAGS, **cus)
            torch.cuda.synchronize()
            assert torch.isfinite(o).all() and torch.isfinite(s).all()
            assert torch.equal(o.view(torch.int16), ref_o.view(torch.int16))
            assert torch.equal(s.view(torch.int32), ref_s.view(torch.int32))
    assert counted[0] == 1


def test_one_token_packed_call_with_odd_strides_is_validated(counted):
    """A one-token packed call whose size-1 time dimension has an odd stride (is_contiguous ignores it) is validated
    in full each time, not handed to a plan whose launch reads that stride (as chunk_kda's short key refuses it)."""
    x, cus = _packed_inputs([40, 33], D=32)
    chunk_gated_delta_rule(**x, **FLAGS, **cus)
    one, cu1 = _packed_inputs([1, 0], seed=1, D=32)
    q = torch.empty_strided((1, 1, KH, 32), (999 * KH * 32, 999 * KH * 32, 32, 1), dtype=one["q"].dtype)
    q.copy_(one["q"])
    assert q.is_contiguous()
    for _ in range(2):
        o = chunk_gated_delta_rule(**dict(one, q=q), **FLAGS, **cu1)[0]
    assert counted[0] == 1 + 2
    assert torch.equal(o, chunk_gated_delta_rule(**one, **FLAGS, **cu1)[0])


@pytest.mark.parametrize("lengths, value_heads, cut", [
    ((32768,), 32, (8192, 4)),  # the anchor: four 8K segments (bench_gdn_prefill --split, 1.46 -> 1.16 ms)
    ((8192,), 32, (2048, 4)),
    ((32768,), 16, (4096, 8)),
    ((8192,) * 4, 32, None),  # 128 lanes fill the GPU
    ((32768,), 64, None),  # every cut measured slower at 64 value heads
    ((8192,), 64, None),
    ((4096,), 32, None),  # below min_seq_len
])  # fmt: skip
def test_time_split_entry_cuts_what_was_measured_faster(lengths, value_heads, cut):
    """The sm_90 entry's cut of Gated DeltaNet calls on 132 SMs (the H100 / H200): cut at 32 value heads a sequence,
    not at 64, segments in whole waves (``cula/gated_delta_rule/plan.py`` has the measurements)."""
    from cula.gated_delta_rule.plan import GDN_TUNING
    from cula.time_split import plan_time_split

    plan = plan_time_split(lengths, value_heads, 132, GDN_TUNING.get((9, 0)).time_split)
    assert (None if plan is None else (plan.segment_len, plan.num_segments)) == cut
