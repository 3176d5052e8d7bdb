"""cula.kda.fla_backward on the CPU: FLA's chunk_kda_bwd body with only stages 6 and 7 rebound, FLA's module
untouched, the launch plumbing (grid, chunk indices, outputs) against FLA's own wrappers and the float64 reference
under Triton's interpreter, and the routing back to FLA's wrappers where a launch configuration does not apply; on
the GPU, stage 6's launch against FLA's wrapper."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from cula.kda import fla_backward

chunk_bwd = pytest.importorskip("fla.ops.kda.chunk_bwd")
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_naive_bwd import _interpreted  # noqa: E402


def test_rebound_backward_is_flas_body_with_our_stages():
    fn = fla_backward._fla_chunk_kda_bwd()
    assert fn.__code__ is chunk_bwd.chunk_kda_bwd.__code__
    assert fn.__defaults__ == chunk_bwd.chunk_kda_bwd.__defaults__
    scope = fn.__globals__
    ours = {"chunk_kda_bwd_wy_dqkg_fused": fla_backward._wy_dqkg_fused,
            "chunk_gated_delta_rule_bwd_dhu": fla_backward._bwd_dhu}  # fmt: skip
    assert all(scope[n] is f for n, f in ours.items())
    # stage 7's, told whether cula's kernel takes the call and does stage 8 (dg's reverse cumsum), skipped then
    for on, fused in ((False, False), (True, False), (True, True)):
        rebound = fla_backward._fla_chunk_kda_bwd(on, fused).__globals__
        intra = rebound["chunk_kda_bwd_intra"]
        assert intra.func is fla_backward._bwd_intra and intra.keywords == {"ours": on, "cumsum": fused}
        skip = rebound["chunk_local_cumsum"] is fla_backward._reverse_cumsum_done
        assert skip is fused and (fused or rebound["chunk_local_cumsum"] is chunk_bwd.chunk_local_cumsum)
    ours["chunk_kda_bwd_intra"] = None
    assert all(scope[n] is v for n, v in vars(chunk_bwd).items() if n not in ours)
    # FLA's own module (and so FLA's own backward) keeps its stages
    for n, f in ours.items():
        assert getattr(chunk_bwd, n) is not f and chunk_bwd.chunk_kda_bwd.__globals__[n] is getattr(chunk_bwd, n)
    assert scope["chunk_kda_bwd_intra"] is not chunk_bwd.chunk_kda_bwd_intra


@pytest.mark.parametrize("launch,ours", [((32, 64, 8, 1), True), (None, False)])
def test_stage6_off_the_gpu_is_flas_wrapper(monkeypatch, kda_tuning, launch, ours):
    """CPU tensors (whatever the tuning entry says of cula's kernel and of wy_dqkg_launch) take FLA's wrapper with
    every argument passed on."""
    seen = []
    monkeypatch.setattr(chunk_bwd, "chunk_kda_bwd_wy_dqkg_fused", lambda **kw: seen.append(kw) or "fla")
    kda_tuning(wy_dqkg_launch=launch, bwd_wy_dqkg=ours)
    t = torch.zeros(1, 64, 1, 128)
    args = dict(q=t, k=t, v=t, v_new=t, g=t, beta=t[..., 0], A=t[..., :64], h=t, do=t, dh=t, dv=t, scale=0.5,
                state_v_first=True, cu_seqlens=None, chunk_size=64, chunk_indices=None, chunk_offsets=None,
                use_graph=False)  # fmt: skip
    assert fla_backward._wy_dqkg_fused(**args) == "fla"
    assert seen == [args]


@pytest.mark.parametrize("lanes", [(1, 1 << 30), None])
def test_stage5_after_flas_stage4_is_flas_function(monkeypatch, kda_tuning, lanes):
    """Stage 5 with FLA's stage-4 dv (whatever the tuning entry says) takes FLA's chunk_gated_delta_rule_bwd_dhu
    with every argument passed on."""
    from fla.ops.common import chunk_delta_h

    seen = []
    monkeypatch.setattr(chunk_delta_h, "chunk_gated_delta_rule_bwd_dhu", lambda **kw: seen.append(kw) or "fla")
    kda_tuning(bwd_dv_dhu_lanes=lanes)
    t = torch.zeros(1, 64, 1, 128)
    args = dict(q=t, k=t, w=t, do=t, dv=t, g=None, gk=t, h0=None, dht=None, scale=0.5, state_v_first=True,
                cu_seqlens=None, chunk_size=64, chunk_indices=None, chunk_offsets=None, use_graph=False)  # fmt: skip
    assert fla_backward._bwd_dhu(**args) == "fla"
    assert seen == [args]


def test_stage4_left_to_stage5(monkeypatch, kda_tuning):
    """``KdaTuning.bwd_dv_dhu_lanes``: the rebound body's stage 4 hands its call on as dv (``_Stage4Left``) with
    a dAqk buffer; a stage 5 that does not take the call (here: CPU tensors) runs FLA's stage 4 first, fills that
    buffer and passes FLA's dv on. chunk_kda_bwd leaves stage 4 to stage 5 only on the GPU, within the entry's lane
    counts (sequences x value heads, packed or not), for gates cula's intra kernel takes (its Aqk is zero above
    the diagonal)."""
    from fla.ops.common import chunk_delta_h

    from cula.kda.plan import KDA_TUNING

    rebound = fla_backward._fla_chunk_kda_bwd(False, False, False, True).__globals__
    assert rebound["chunk_kda_bwd_dAv"] is fla_backward._bwd_dAv
    assert fla_backward._fla_chunk_kda_bwd().__globals__["chunk_kda_bwd_dAv"] is chunk_bwd.chunk_kda_bwd_dAv
    t = torch.zeros(1, 64, 2, 128)
    stage4 = dict(q=t, k=t, v=t, do=t, A=t[..., :64], scale=0.5, cu_seqlens=None, chunk_size=64, chunk_indices=None,
                  use_graph=False)  # fmt: skip
    dAqk, left = fla_backward._bwd_dAv(**stage4)
    assert isinstance(left, fla_backward._Stage4Left) and dAqk.shape == (1, 64, 2, 64) and left.dAqk is dAqk
    seen = []
    ones = torch.ones(1, 64, 2, 64)
    monkeypatch.setattr(chunk_bwd, "chunk_kda_bwd_dAv", lambda **kw: seen.append(kw) or (ones, "dv"))
    monkeypatch.setattr(chunk_delta_h, "chunk_gated_delta_rule_bwd_dhu", lambda **kw: kw["dv"])
    kda_tuning(bwd_dv_dhu_lanes=(1, 1 << 30))
    assert fla_backward._bwd_dhu(q=t, k=t, w=t, do=t, dv=left, gk=t) == "dv"
    assert seen == [stage4] and torch.equal(dAqk, ones)
    q = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    gate = dict(safe_gate=True, use_gate_in_kernel=True, lower_bound=-5.0)
    assert not fla_backward._stage4_fused(dict(q=q, v=q, Aqk=q[..., :64], **gate))  # CPU tensors
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(KDA_TUNING, "for_device", lambda device: KDA_TUNING.get((9, 0)))
    kda_tuning(bwd_dv_dhu_lanes=(4, 8))
    assert not fla_backward._stage4_fused(dict(q=q, v=q, Aqk=q[..., :64], **gate))  # 1 x 2 lanes
    wide = torch.zeros(2, 64, 2, 128, dtype=torch.bfloat16)  # 2 x 2
    assert fla_backward._stage4_fused(dict(q=wide, v=wide, Aqk=wide[..., :64], **gate))
    cu = torch.tensor([0, 10, 20, 30, 64])  # 4 sequences x 2
    assert fla_backward._stage4_fused(dict(q=q, v=q, Aqk=q[..., :64], cu_seqlens=cu, **gate))
    cu = torch.tensor([0, 10, 20, 30, 40, 64])  # 5 sequences x 2: past the most
    assert not fla_backward._stage4_fused(dict(q=q, v=q, Aqk=q[..., :64], cu_seqlens=cu, **gate))
    kda_tuning(bwd_dv_dhu_lanes=(1, 1 << 30), intra_any_gate=False)
    assert fla_backward._stage4_fused(dict(q=q, v=q, Aqk=q[..., :64], **gate))
    assert not fla_backward._stage4_fused(dict(q=q, v=q, Aqk=q[..., :64], **gate, use_graph=True))
    assert not fla_backward._stage4_fused(dict(q=q, v=q, Aqk=q[..., :64].float(), **gate))
    unbounded = dict(q=q, v=q, Aqk=q[..., :64], **dict(gate, lower_bound=None))  # FLA's intra stages made Aqk
    assert not fla_backward._stage4_fused(unbounded)
    kda_tuning(intra_any_gate=True)  # ... unless the intra kernel's any_gate variant did
    assert fla_backward._stage4_fused(unbounded)
    kda_tuning(bwd_dv_dhu_lanes=None)
    assert not fla_backward._stage4_fused(dict(q=q, v=q, Aqk=q[..., :64], **gate))


def test_stage7_not_ours_is_flas_function(monkeypatch):
    """Stage 7 not on cula's kernel takes FLA's chunk_kda_bwd_intra with every argument passed on."""
    from fla.ops.kda import chunk_intra

    seen = []
    monkeypatch.setattr(chunk_intra, "chunk_kda_bwd_intra", lambda **kw: seen.append(kw) or "fla")
    t = torch.zeros(1, 64, 1, 128)
    args = dict(q=t, k=t, g=t, beta=t[..., 0], dAqk=t[..., :64], dAkk=t[..., :64], dq=t, dk=t, db=t[..., 0], dg=t,
                cu_seqlens=None, chunk_indices=None, chunk_size=64, safe_gate=True, lower_bound=None,
                use_graph=False)  # fmt: skip
    assert fla_backward._bwd_intra(**args, ours=False) == "fla"
    assert seen == [args]


@pytest.mark.parametrize("on", [True, False])
def test_stage7_follows_the_tuning_and_the_forward_intra_kernel(monkeypatch, kda_tuning, on):
    """chunk_kda_bwd puts stage 7 on cula's kernel (with stage 8, as the entry says) exactly where the tuning entry
    says so, the tensors are on an SM90 GPU and the forward's intra kernel takes the call's gates; CPU tensors
    never."""
    calls = []
    monkeypatch.setattr(fla_backward, "_fla_chunk_kda_bwd",
                        lambda *flags: lambda **kw: calls.append(flags) or (None,) * 8)  # fmt: skip
    kda_tuning(bwd_intra=on, bwd_intra_cumsum=True, intra_any_gate=False)
    q = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16)
    gates = (
        (dict(safe_gate=True, use_gate_in_kernel=True, lower_bound=-5.0), True),
        (dict(safe_gate=True, use_gate_in_kernel=True, lower_bound=None), False),  # unbounded softplus gate
        (dict(safe_gate=False, use_gate_in_kernel=False, lower_bound=None), False),
        (dict(safe_gate=True, use_gate_in_kernel=False, lower_bound=None), True),
        # the fused lower-bound gate lies in [lower_bound, 0) whatever safe_gate says
        (dict(safe_gate=False, use_gate_in_kernel=True, lower_bound=-5.0), True),
        (dict(safe_gate=False, use_gate_in_kernel=True, lower_bound=-6.0), False),
    )
    for kw, exact in gates:
        fla_backward.chunk_kda_bwd(q=q, v=q, **kw)
        assert calls[-1] == (False, False, False, False), kw  # CPU tensors
    from cula.kda.plan import KDA_TUNING

    # as if on an SM90 GPU: the device's entry is the H200's, and a stage is on where it says so
    monkeypatch.setattr(KDA_TUNING, "for_device", lambda device: KDA_TUNING.get((9, 0)))
    monkeypatch.setattr(fla_backward, "_stage_on", lambda flag, *a: getattr(KDA_TUNING.get((9, 0)), flag))
    for kw, exact in gates:
        fla_backward.chunk_kda_bwd(q=q, v=q, **kw)
        assert calls[-1] == (on and exact, on and exact, False, False), kw  # stage 4: FLA's off the GPU
    # with the intra kernel's any_gate variant on, the unbounded gates take stage 7's any_gate variant
    kda_tuning(intra_any_gate=True)
    for kw, exact in gates:
        fla_backward.chunk_kda_bwd(q=q, v=q, **kw)
        assert calls[-1] == (on, on, False, False), kw
        flags, call = fla_backward._stage7_plan(dict(kw, q=q, v=q), None)
        assert flags[0] == on and call.any_gate == (on and not exact), kw


def test_stage7_fuses_the_gate_and_the_l2_norm_where_the_tuning_says(monkeypatch, kda_tuning):
    """Stage 9 (the gate's backward) joins stages 7 and 8 on cula's kernel for the lower-bound gate with fp32 (or
    absent) parameters where KdaTuning.bwd_intra_gate says so; the L2 norm's backward where
    KdaTuning.bwd_intra_l2norm says so, rstd given and no GVA. Otherwise the wrapper applies FLA's l2norm_bwd."""
    import fla.ops.kda.chunk as fla_chunk

    from cula.kda.plan import KDA_TUNING

    seen = []
    monkeypatch.setattr(fla_backward, "_fla_chunk_kda_bwd", lambda *flags: lambda **kw: seen.append(
        (flags, fla_backward._BACKWARD_CALL.get())) or ("dq", "dk", *(None,) * 6))  # fmt: skip
    monkeypatch.setattr(fla_chunk, "l2norm_bwd", lambda y, rstd, dy: ("l2", dy))
    monkeypatch.setattr(KDA_TUNING, "for_device", lambda device: KDA_TUNING.get((9, 0)))
    monkeypatch.setattr(fla_backward, "_stage_on", lambda flag, *a: getattr(KDA_TUNING.get((9, 0)), flag))
    q = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    g_raw, a_log, bias = torch.zeros(1, 64, 2, 128), torch.zeros(2), torch.zeros(256)
    rstd = (torch.ones(128), torch.ones(128))
    gate = dict(safe_gate=True, use_gate_in_kernel=True, lower_bound=-5.0, g_org=g_raw, A_log=a_log, dt_bias=bias)
    for (fuse_gate, fuse_l2), kw, v, want in (
        ((True, True), gate, q, ((True, True, True), True, True)),
        ((False, True), gate, q, ((True, True, False), False, True)),
        ((True, False), gate, q, ((True, True, True), True, False)),
        ((True, True), dict(gate, A_log=a_log.double()), q, ((True, True, False), False, True)),
        ((True, True), dict(gate, dt_bias=None), q, ((True, True, True), True, True)),
        ((True, True), gate, q.repeat(1, 1, 2, 1), ((True, True, True), True, False)),  # GVA: no L2 norm on chip
        ((True, True), dict(safe_gate=True, use_gate_in_kernel=False, lower_bound=None), q,
         ((True, True, False), False, True)),
        # the softplus gate (no lower bound): on chip only where bwd_intra_softplus_gate says so (below)
        ((True, True), dict(gate, lower_bound=None), q, ((True, True, False), False, True)),
    ):  # fmt: skip
        kda_tuning(bwd_intra=True, bwd_intra_cumsum=True, bwd_intra_gate=fuse_gate, bwd_intra_l2norm=fuse_l2,
                   bwd_intra_softplus_gate=False, intra_any_gate=True)  # fmt: skip
        dq, dk, *_ = fla_backward.chunk_kda_bwd(qk_rstd=rstd, q=q, k=q, v=v, **kw)
        flags, call = seen[-1]
        assert (flags[:3], call.gate is not None, call.qk_rstd is not None) == want, (fuse_gate, fuse_l2, kw.keys())
        assert flags[3] is False  # stage 4 stays FLA's off the GPU
        assert (dq, dk) == (("dq", "dk") if want[2] else (("l2", "dq"), ("l2", "dk")))
    kda_tuning(bwd_intra_gate=True, bwd_intra_softplus_gate=True)
    fla_backward.chunk_kda_bwd(qk_rstd=rstd, q=q, k=q, v=q, **dict(gate, lower_bound=None))
    flags, call = seen[-1]
    assert flags[:3] == (True, True, True) and call.gate is not None and call.gate[3] is None and call.any_gate
    assert fla_backward._BACKWARD_CALL.get() is None


_LAUNCH_SCRIPT = textwrap.dedent(
    """
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_wy_dqkg_fused
    from cula.kda.fla_backward import launch_wy_dqkg
    from cula.kda.plan import KDA_TUNING
    from cula.kda.naive_bwd import chunk_kda_bwd_wy_dqkg_reference
    from test_naive_bwd import _wy_case
    out = {}
    for name, args in json.loads(sys.argv[1]):
        case, _ = _wy_case(*args)
        fla = chunk_kda_bwd_wy_dqkg_fused(**case, chunk_size=64)
        ours = launch_wy_dqkg(**case, chunk_size=64, chunk_indices=None, launch=KDA_TUNING.get((9, 0)).wy_dqkg_launch)
        ref = chunk_kda_bwd_wy_dqkg_reference(**case, chunk_size=64)
        rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())
        out[name] = [[rel(o, f), rel(o, r)] for o, f, r in zip(ours, fla, ref)]
    print("@@" + json.dumps(out))
    """
)


def test_stage6_launch_matches_flas_wrapper_interpreted():
    """launch_wy_dqkg at the H200's wy_dqkg_launch (its block sizes; the interpreter ignores warps)
    against FLA's autotuned wrapper and the float64 reference: GVA with an odd T, [V, K] states, a packed batch
    with a length-1 sequence (its chunk indices made here). fp32 inputs: see test_naive_bwd."""
    cases = [("gva-odd-v-first", [2, 100, 1, 2, 64, 64, None, True]),
             ("varlen", [1, 150, 1, 1, 64, 64, [37, 1, 112], False])]  # fmt: skip
    for name, errs in _interpreted(_LAUNCH_SCRIPT, json.dumps(cases)).items():
        for what, (vs_fla, vs_ref) in zip(("dq", "dk", "dv", "db", "dg", "dA"), errs):
            assert vs_fla < 1e-5 and vs_ref < 1e-5, (name, what, vs_fla, vs_ref)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "args",
    [(2, 300, 2, 4, 128, 128, None, True), (1, 1000, 2, 2, 128, 128, [1, 63, 64, 65, 807], False),
     (1, 64, 1, 1, 128, 128, None, False)],
    ids=["gva-odd-v-first", "varlen", "one-chunk"],
)  # fmt: skip
def test_stage6_launch_matches_flas_wrapper_gpu(args):
    """On the GPU, bf16 as FLA's backward holds them: the wy_dqkg_launch launch against FLA's autotuned wrapper
    (the same kernel: dq, dk, dv and dA to fp32 noise, db and dg to a different K-block summation order) and both
    against the float64 reference; outputs start as NaN (poisoned allocator), so an unwritten element fails."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from test_naive_bwd import _wy_case

    from cula.kda.naive_bwd import chunk_kda_bwd_wy_dqkg_reference
    from cula.testing import rel_rmse

    case, _ = _wy_case(*args)
    low = ("q", "k", "v", "v_new", "A", "h", "do", "dh", "dv")
    case = {n: (x.cuda().bfloat16() if n in low else x.cuda()) if torch.is_tensor(x) else x for n, x in case.items()}
    fla = chunk_bwd.chunk_kda_bwd_wy_dqkg_fused(**case, chunk_size=64)
    launch = fla_backward.wy_dqkg_launch(torch.device("cuda"))
    ours = fla_backward.launch_wy_dqkg(**case, chunk_size=64, chunk_indices=None, launch=launch)
    torch.cuda.synchronize()
    ref = chunk_kda_bwd_wy_dqkg_reference(**{n: x.cpu() if torch.is_tensor(x) else x for n, x in case.items()})
    for name, o, f, r in zip(("dq", "dk", "dv", "db", "dg", "dA"), ours, fla, ref):
        assert o.dtype == f.dtype and o.shape == f.shape, name
        assert not torch.isnan(o).any(), name
        vs_fla, vs_ref = rel_rmse(f, o), rel_rmse(r, o.cpu())
        assert vs_fla < (1e-4 if name in ("db", "dg") else 1e-5) and vs_ref < 1e-2, (name, vs_fla, vs_ref)


# a chunk_kda training step as the benchmark's calls make it: the fused lower-bound gate at FLA's safe bound, L2 norm,
# beta sigmoid, states in and out
_STEP_FLAGS = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                   use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0)  # fmt: skip
_GRAD_TOL = {"g": 2e-2, "beta": 2e-2, "A_log": 2e-2, "dt_bias": 2e-2}  # FLA's; 8e-3 for the rest
# the H200 entry without its fused stages (the gate's and the L2 norm's backward in stage 7, the recompute prefix on
# cula's intra kernel): FLA's prefix, gate and norm backward around cula's stages 6-8, kept under test beside the entry
_UNFUSED_STAGES = dict(bwd_intra_gate=False, bwd_intra_l2norm=False, bwd_recompute_intra=False)


def _step_inputs(B, T, H, HV, N, D=128):
    """Random leaves (on the CPU, fp32) and output gradients (on the GPU) of a training step."""
    leaves = dict(
        q=torch.randn(B, T, H, D), k=torch.randn(B, T, H, D), v=torch.randn(B, T, HV, D), g=torch.randn(B, T, HV, D),
        beta=torch.randn(B, T, HV), initial_state=0.1 * torch.randn(N, HV, D, D), A_log=0.5 * torch.randn(HV),
        dt_bias=0.5 * torch.randn(HV * D),
    )  # fmt: skip
    return leaves, (torch.randn(B, T, HV, D, device="cuda").bfloat16(), torch.randn(N, HV, D, D, device="cuda"))


def _step(fn, leaves, cotangents, **kw):
    """``fn(**leaves, **kw)`` on the GPU (q, k, v, g, beta in bf16) pulled back along ``cotangents``: ``(o, ht,
    {leaf: gradient})``."""
    x = {n: (t.cuda().bfloat16() if n in ("q", "k", "v", "g", "beta") else t.cuda()).requires_grad_()
         for n, t in leaves.items()}  # fmt: skip
    o, ht = fn(**x, **kw)
    if ht is None:  # no final state: o's gradient alone
        torch.autograd.backward(o, cotangents[0])
    else:
        torch.autograd.backward((o, ht), cotangents)
    return o.detach(), None if ht is None else ht.detach(), {n: t.grad for n, t in x.items()}


@pytest.mark.gpu
@pytest.mark.parametrize(
    "stage", ["bwd_dv_dhu_lanes", "bwd_intra", "bwd_intra_cumsum", "bwd_intra_gate", "bwd_intra_l2norm",
              "bwd_wy_dqkg", "bwd_recompute_intra", "bwd_norm_on_load", "bwd_recompute_states"],
)
@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "packed"])
def test_training_with_our_stage_gpu(kda_tuning, packed, stage):
    """A chunk_kda training step (the fused lower-bound gate, L2 norm, beta sigmoid, states in and out) with one
    ``KdaTuning`` stage flag off and on (the rest as the H200's entry has them): stages 4 and 5 in one launch
    (``bwd_dv_dhu_lanes``: None, then every count), 6 (``bwd_wy_dqkg``) or 7 (``bwd_intra``) on cula's kernel, or
    stage 8, 9 or the L2 norm's backward fused into stage 7's (``bwd_intra_cumsum``, ``bwd_intra_gate``,
    ``bwd_intra_l2norm``), or the recompute prefix on cula's intra kernel (``bwd_recompute_intra``), or no l2norm_fwd
    (``bwd_norm_on_load``: stages 6 and 7 normalise the raw q / k), or the recompute's h and v_new on cula's states
    kernel (``bwd_recompute_states``): every gradient within FLA's tolerances of the other, none NaN."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from cula.kda import chunk_kda
    from cula.testing import assert_close

    torch.manual_seed(0)
    B, T, N = (1, 501, 4) if packed else (2, 300, 2)
    leaves, cotangents = _step_inputs(B, T, 2, 2, N)
    kw = dict(_STEP_FLAGS)
    if packed:
        cu = torch.tensor([0, 300, 301, 301, 501], dtype=torch.int32, device="cuda")
        kw.update(cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
    grads = {}
    values = (None, (1, 1 << 30)) if stage == "bwd_dv_dhu_lanes" else (False, True)
    for on, value in zip((False, True), values):
        kda_tuning(**{stage: value})
        grads[on] = _step(chunk_kda, leaves, cotangents, **kw)[2]
    for n in leaves:
        assert not grads[True][n].isnan().any(), n
        tol = _GRAD_TOL.get(n, 8e-3)
        assert_close(f"d{n}", grads[False][n].float(), grads[True][n].float(), tol)


def test_recompute_on_cula_follows_the_tuning(monkeypatch, kda_tuning):
    """The recompute prefix runs on cula's intra kernel only where the tuning entry says so, on CUDA tensors, and
    for gates cula's intra kernel takes (FLA's graph mode too: the kernel gets its chunk list through
    ``cula_chunk_rows``)."""
    from cula.kda.plan import KDA_TUNING

    q = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16)
    p = dict(safe_gate=True, use_gate_in_kernel=True, lower_bound=-5.0, use_graph=False)
    kda_tuning(bwd_recompute_intra=True, intra_any_gate=False)
    assert not fla_backward.recompute_on_cula(q, q, p)  # CPU tensors
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(KDA_TUNING, "for_device", lambda device: KDA_TUNING.get((9, 0)))
    assert fla_backward.recompute_on_cula(q, q, p)
    assert fla_backward.recompute_on_cula(q, q, dict(p, use_graph=True))
    assert not fla_backward.recompute_on_cula(q, q, dict(p, lower_bound=None))  # the unbounded softplus gate
    assert not fla_backward.recompute_on_cula(q, q, dict(p, safe_gate=False, use_gate_in_kernel=False))
    kda_tuning(intra_any_gate=True)  # unbounded gates on the intra kernel's any_gate variant
    assert fla_backward.recompute_on_cula(q, q, dict(p, lower_bound=None))
    assert fla_backward.recompute_on_cula(q, q, dict(p, safe_gate=False, use_gate_in_kernel=False))
    kda_tuning(bwd_recompute_intra=False)
    assert not fla_backward.recompute_on_cula(q, q, p)


def test_norm_on_load_follows_the_tuning(monkeypatch, kda_tuning):
    """The backward skips l2norm_fwd (stages 6 and 7 normalise raw q / k) only where KdaTuning.bwd_norm_on_load says
    so, the call has the L2 norm, no GVA, do in q's dtype, and the recompute, stage 6 and stage 7 with the L2 norm's
    backward all run on cula's kernels; CPU tensors never."""
    from cula.kda.plan import KDA_TUNING

    q = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    p = dict(safe_gate=True, use_gate_in_kernel=True, lower_bound=-5.0, use_graph=False, use_qk_l2norm_in_kernel=True)
    kda_tuning(bwd_norm_on_load=True, bwd_recompute_intra=True, bwd_wy_dqkg=True, bwd_intra=True,
               bwd_intra_l2norm=True, intra_any_gate=False)  # fmt: skip
    assert not fla_backward.norm_on_load(q, q, q, p)  # CPU tensors
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(KDA_TUNING, "for_device", lambda device: KDA_TUNING.get((9, 0)))
    assert fla_backward.norm_on_load(q, q, q, p)
    assert not fla_backward.norm_on_load(q, q, q, dict(p, use_qk_l2norm_in_kernel=False))
    assert not fla_backward.norm_on_load(q, q.repeat(1, 1, 2, 1), q, p)  # GVA: the L2 norm's backward after the sum
    assert not fla_backward.norm_on_load(q, q, q.half(), p)
    assert not fla_backward.norm_on_load(q, q, q, dict(p, lower_bound=None))  # the unbounded softplus gate
    for flag in ("bwd_norm_on_load", "bwd_recompute_intra", "bwd_wy_dqkg", "bwd_intra", "bwd_intra_l2norm"):
        with KDA_TUNING.override((9, 0), **{flag: False}):
            assert not fla_backward.norm_on_load(q, q, q, p), flag


def test_another_flas_backward_gets_normalised_qk(monkeypatch):
    """Where FLA's backward does not name the stages cula rebinds (another FLA version), it runs as it is: stage 7's
    L2-norm backward is FLA's l2norm_bwd here, and raw q / k (norm_on_load) are refused rather than handed to it."""
    import fla.ops.kda.chunk as fla_chunk
    from fla.ops.kda import chunk_bwd

    monkeypatch.setattr(fla_backward, "_fla_chunk_kda_bwd", lambda *flags: chunk_bwd.chunk_kda_bwd)
    monkeypatch.setattr(chunk_bwd, "chunk_kda_bwd", lambda **kw: ("dq", "dk", *(None,) * 6))
    monkeypatch.setattr(fla_chunk, "l2norm_bwd", lambda y, rstd, dy: ("l2", dy))
    monkeypatch.setattr(fla_backward, "_stage7_plan", lambda kw, rstd: ((True,) * 3, fla_backward._BackwardCall(
        qk_rstd=rstd)))  # fmt: skip
    q, rstd = torch.zeros(1, 64, 2, 128), (torch.ones(64), torch.ones(64))
    assert fla_backward.chunk_kda_bwd(qk_rstd=rstd, q=q, k=q, v=q)[:2] == (("l2", "dq"), ("l2", "dk"))
    with pytest.raises(ValueError, match="raw_qk"):
        fla_backward.chunk_kda_bwd(qk_rstd=rstd, raw_qk=True, q=q, k=q, v=q)


def test_norm_on_load_hands_the_stages_raw_qk(monkeypatch):
    """Where norm_on_load says so, no l2norm_fwd runs: the recompute prefix writes the 1 / norms, and chunk_kda_bwd
    gets the raw q and k, those norms as qk_rstd and raw_qk=True; stage 6 and 7 then hand both to cula's kernels."""
    from cula.kda import backends as kb

    B, T, H, D = 1, 70, 2, 128
    x = {n: torch.randn(B, T, H, D).bfloat16() for n in ("q", "k", "v")}
    g, beta = torch.randn(B, T, H, D), torch.randn(B, T, H)
    rstd = torch.rand(2, B, T, H)
    seen, chunk_kda_bwd = {}, fla_backward.chunk_kda_bwd

    def prefix(q, k, *args, Akk=None, qk_rstd=False):
        assert qk_rstd
        made = {n: torch.full((1,), float(i)) for i, n in enumerate(("g", "w", "u", "qg", "kg", "v_new", "h"))}
        return dict(made, qk_rstd=rstd)

    def bwd(qk_rstd=None, raw_qk=False, **kw):
        seen.update(kw, qk_rstd=qk_rstd, raw_qk=raw_qk)
        return (kw["q"].float(), kw["k"].float(), kw["v"].float(), kw["beta"].float(), g.clone(), None, None, None)

    import fla.ops.kda.chunk as fc

    monkeypatch.setattr(fc, "l2norm_fwd", lambda t: pytest.fail("l2norm_fwd ran"))
    monkeypatch.setattr(fc, "fused_beta_sigmoid", lambda x, scale: x.float() * scale)
    monkeypatch.setattr(fc, "fused_beta_sigmoid_bwd", lambda x, dy, scale: dy * scale)
    monkeypatch.setattr(fla_backward, "norm_on_load", lambda q, v, do, p: True)
    monkeypatch.setattr(fla_backward, "recompute_on_cula", lambda q, v, p: True)
    monkeypatch.setattr(fla_backward, "recompute_prefix", prefix)
    monkeypatch.setattr(fla_backward, "chunk_kda_bwd", bwd)
    p = dict(use_gate_in_kernel=True, allow_neg_eigval=False, use_qk_l2norm_in_kernel=True,
             use_beta_sigmoid_in_kernel=True, use_graph=False, scale=D**-0.5, state_v_first=False, safe_gate=True,
             lower_bound=-5.0)  # fmt: skip
    saved = (x["q"], x["k"], x["v"], g, beta, torch.zeros(H), torch.zeros(H * D), None, None, None,
             torch.zeros(B, T, H, 64), torch.zeros(B, T, H, 64))  # fmt: skip
    kb._training_backward(saved, p, torch.randn(B, T, H, D).bfloat16(), None)
    assert seen["raw_qk"] is True and seen["q"] is x["q"] and seen["k"] is x["k"]
    assert torch.equal(seen["qk_rstd"][0], rstd[0]) and torch.equal(seen["qk_rstd"][1], rstd[1])

    # the stages: raw q / k and the norms reach cula's stage-6 and stage-7 kernels
    from cula.ops.kda.sm90 import bwd_intra, bwd_wy_dqkg

    got = {}
    monkeypatch.setattr(fla_backward, "_wy_dqkg_kernel_on", lambda *a: True)
    monkeypatch.setattr(fla_backward, "wy_dqkg_verdict", lambda *a: (True, None))
    monkeypatch.setattr(bwd_wy_dqkg, "chunk_kda_bwd_wy_dqkg_sm90",
                        lambda q, k, *a, qk_rstd=None, **kw: got.update(wy=(q, k, qk_rstd)) or "wy")  # fmt: skip
    monkeypatch.setattr(bwd_intra, "chunk_kda_bwd_intra_sm90",
                        lambda q, k, *a, raw_qk=False, qk_rstd=None, **kw: got.update(intra=(q, k, raw_qk, qk_rstd))
                        or (None,) * 4)  # fmt: skip
    t = torch.zeros(1, 64, 1, 128)
    norms = (rstd[0], rstd[1])
    token = fla_backward._BACKWARD_CALL.set(fla_backward._BackwardCall(qk_rstd=norms, raw_qk=True))
    try:
        assert fla_backward._wy_dqkg_fused(t, t, t, t, t, t[..., 0], t[..., :64], t, t, t, t) == "wy"
        fla_backward._bwd_intra(t, t, t, t[..., 0], t, t, t, t, t[..., 0], t, ours=True)
    finally:
        fla_backward._BACKWARD_CALL.reset(token)
    assert got["wy"] == (t, t, norms) and got["intra"] == (t, t, True, norms)
    # raw q / k with stage 7 not taking the L2 norm's backward is refused before anything runs
    with pytest.raises(ValueError, match="raw_qk"):
        chunk_kda_bwd(qk_rstd=norms, raw_qk=True, q=t, k=t, v=t, safe_gate=True)


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_cula_chunk_rows_turn_sentinels_into_padding(cu_dtype):
    """FLA's graph-mode chunk list for cula's kernels: the real rows as they are (so each row still indexes h / dh),
    the sentinel rows (sequence -1) padding rows of the last sequence with a chunk at or past its end, int32;
    outside graph mode (or for fixed lengths) the list as given."""
    from fla.ops.utils.index import prepare_chunk_indices_static

    from cula.testing import make_cu_seqlens

    for lens in ([30, 0, 70], [130, 1, 0], [64, 64], [200]):
        cu = make_cu_seqlens(lens).to(cu_dtype)
        T = sum(lens) + 5  # graph mode: the sequences may end before the last token
        ci, _ = prepare_chunk_indices_static(cu_seqlens=cu, chunk_size=64, nt_max=-(-T // 64) + len(lens) - 1)
        rows = fla_backward.cula_chunk_rows(ci, cu, use_graph=True)
        real = int((ci[:, 0] >= 0).sum())
        assert rows.dtype == torch.int32 and rows.shape == ci.shape
        assert torch.equal(rows[:real], ci[:real].to(torch.int32))
        assert (rows[real:, 0] == len(lens) - 1).all() and (64 * rows[real:, 1] >= lens[-1]).all(), lens
        assert fla_backward.cula_chunk_rows(ci, cu, use_graph=False) is ci
    assert fla_backward.cula_chunk_rows(None, None, use_graph=True) is None


@pytest.mark.parametrize("fused_gate", [True, False])
def test_recompute_prefix_feeds_flas_backward_without_recompute(monkeypatch, fused_gate):
    """With the prefix on cula's intra kernel, FLA's chunk_kda_bwd gets disable_recompute=True, the prefix's w, u,
    qg, kg, v_new, h and its gate cumsum as g (the raw gate as g_org with the fused gate); the prefix gets the raw
    (unnormalised) q and k and the forward's Akk."""
    from cula.kda import backends as kb

    B, T, H, D = 1, 70, 2, 128
    x = {n: torch.randn(B, T, H, D).bfloat16() for n in ("q", "k", "v")}
    g, beta = torch.randn(B, T, H, D), torch.randn(B, T, H)
    made = {n: torch.full((1,), float(i)) for i, n in enumerate(("g", "w", "u", "qg", "kg", "v_new", "h"))}
    seen = {}

    def prefix(q, k, *args, Akk=None, states=None, qk_rstd=False):
        assert not qk_rstd  # CPU tensors: never norm_on_load
        seen["prefix_q"], seen["prefix_akk"] = (q, k), Akk
        assert states is None  # nothing kept by this forward
        return dict(made)

    def bwd(qk_rstd=None, **kw):
        seen["bwd"] = kw
        return (kw["q"].float(), kw["k"].float(), kw["v"].float(), kw["beta"].float(), g.clone(), None, None, None)

    import fla.ops.kda.chunk as fc

    monkeypatch.setattr(fc, "l2norm_fwd", lambda t: ((t * 0.5).to(t.dtype), t.float().pow(2).sum(-1)))
    monkeypatch.setattr(fc, "fused_beta_sigmoid", lambda x, scale: x.float() * scale)
    monkeypatch.setattr(fc, "fused_beta_sigmoid_bwd", lambda x, dy, scale: dy * scale)
    monkeypatch.setattr(fla_backward, "recompute_on_cula", lambda q, v, p: True)
    monkeypatch.setattr(fla_backward, "recompute_prefix", prefix)
    monkeypatch.setattr(fla_backward, "chunk_kda_bwd", bwd)
    p = dict(use_gate_in_kernel=fused_gate, allow_neg_eigval=False, use_qk_l2norm_in_kernel=True,
             use_beta_sigmoid_in_kernel=True, use_graph=False, scale=D**-0.5, state_v_first=False, safe_gate=True,
             lower_bound=-5.0 if fused_gate else None)  # fmt: skip
    A_log, dt_bias = torch.zeros(H), torch.zeros(H * D)
    saved = (x["q"], x["k"], x["v"], g, beta, A_log, dt_bias, None, None, None, torch.zeros(B, T, H, 64),
             torch.zeros(B, T, H, 64))  # fmt: skip
    kb._training_backward(saved, p, torch.randn(B, T, H, D).bfloat16(), None)
    kw = seen["bwd"]
    assert kw["disable_recompute"] is True and kw["g"] is made["g"]
    assert all(kw[n] is made[n] for n in ("w", "u", "qg", "kg", "v_new", "h"))
    assert (kw["g_org"] is not None) == fused_gate
    assert seen["prefix_q"][0] is x["q"] and seen["prefix_q"][1] is x["k"]  # raw, not the normalised copies
    assert seen["prefix_akk"] is saved[-1]  # the forward's T, read instead of recomputed
    assert not torch.equal(kw["q"], x["q"])  # FLA's stages get the normalised q


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["entry", "unfused"])
def test_training_step_is_deterministic_gpu(kda_tuning, fused):
    """The same training step twice (packed, GVA, the fused lower-bound gate, L2 norm, beta sigmoid, states in and
    out): every gradient bit for bit the same, with the H200 entry's backward stages and with its fused stages off
    (no atomics in cula's kernels; the gate's partial sums are added in a fixed order)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from cula.kda import chunk_kda

    if not fused:
        kda_tuning(**_UNFUSED_STAGES)
    torch.manual_seed(1)
    cu = torch.tensor([0, 300, 301, 301, 701], dtype=torch.int32, device="cuda")
    leaves, cotangents = _step_inputs(1, 701, 2, 4, 4)
    runs = [_step(chunk_kda, leaves, cotangents, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(), **_STEP_FLAGS)[2]
            for _ in range(2)]  # fmt: skip
    for n in leaves:
        assert not runs[0][n].isnan().any(), n
        assert torch.equal(runs[0][n], runs[1][n]), f"d{n} differs between two identical steps"


def _step_f64(leaves, cotangents, **kw):
    """The float64 reference's step (``reference_chunk_kda``, chunk form) from the bf16-rounded inputs the GPU
    steps see: ``(o, ht, {leaf: gradient})``."""
    from cula.kda.naive import reference_chunk_kda

    x = {n: (t.cuda().bfloat16() if n in ("q", "k", "v", "g", "beta") else t.cuda()).double().requires_grad_()
         for n, t in leaves.items()}  # fmt: skip
    kw = {n: v for n, v in kw.items() if n != "cu_seqlens_cpu"}
    o, ht = reference_chunk_kda(**x, **kw, compute_dtype=torch.float64)
    if ht is None:
        torch.autograd.backward(o, cotangents[0].double())
    else:
        torch.autograd.backward((o, ht), tuple(c.double() for c in cotangents))
    return o.detach(), None if ht is None else ht.detach(), {n: t.grad for n, t in x.items()}


# Sums over every token of a head (dA_log; ddt_bias per channel) cancel: at T = 63 with one head the terms of
# dA_log add up to a twenty-third of their absolute sum, and FLA's own dA_log is 9.2e-2 off float64 (ours 1.1e-1,
# 1.4e-2 from FLA's: an error both GPU steps share). Where FLA misses the tolerance against float64, ours may miss it
# by as much as FLA times this, and must still agree with FLA's within the tolerance.
_SUMS, _SUM_SLACK = ("dA_log", "ddt_bias"), 1.5


def _judge_step(ours, fla, ref, tighter: dict | None = None) -> None:
    """Ours against the float64 reference and against FLA's step within FLA's tolerances (o and the final state
    5e-3, ``_GRAD_TOL`` for the gradients, ``tighter`` by output name where given; ``_SUMS`` against float64 as
    above), none NaN; on failure the message has every output's errors, FLA's own against float64 beside them."""
    from cula.testing import rel_rmse

    def outputs(step):
        o, ht, grads = step
        return {"o": o, "ht": ht, **{f"d{n}": g for n, g in grads.items()}}

    rows, bad = [], []
    mine_all, theirs_all = outputs(ours), outputs(fla)
    for name, exact in outputs(ref).items():
        if exact is None:
            continue
        mine, theirs = mine_all[name], theirs_all[name]
        tol = (tighter or {}).get(name, 5e-3 if name in ("o", "ht") else _GRAD_TOL.get(name[1:], 8e-3))
        errs = (rel_rmse(exact, mine.float()), rel_rmse(theirs.float(), mine.float()), rel_rmse(exact, theirs.float()))
        rows.append(f"{name}: ours-f64 {errs[0]:.2e}, ours-fla {errs[1]:.2e}, fla-f64 {errs[2]:.2e} (tol {tol:.0e})")
        to_exact = max(tol, _SUM_SLACK * errs[2]) if name in _SUMS else tol
        if mine.isnan().any() or not (errs[0] < to_exact and errs[1] < tol):
            bad.append(name)
    assert not bad, f"{bad} out of tolerance:\n" + "\n".join(rows)


@pytest.mark.gpu
def test_training_at_64k_tokens_matches_fla_gpu():
    """One 65,536-token sequence (the fused lower-bound gate at FLA's safe bound, L2 norm, beta sigmoid, states in
    and out) with the H200 entry's backward stages (the fused ones included): o, the final state and every
    gradient within FLA's tolerances of the float64 reference and of FLA 0.6.0's own training step, none NaN."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    from cula.kda import chunk_kda

    torch.manual_seed(2)
    leaves, cotangents = _step_inputs(1, 65536, 2, 2, 1)
    ours = _step(chunk_kda, leaves, cotangents, **_STEP_FLAGS)
    fla = _step(fla_chunk_kda, leaves, cotangents, **_STEP_FLAGS)
    _judge_step(ours, fla, _step_f64(leaves, cotangents, **_STEP_FLAGS))


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["entry", "unfused"])
@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
def test_training_int64_bounds_no_final_state_matches_fla_gpu(kda_tuning, state_v_first, fused):
    """A packed training step with int64 cu_seqlens (empty, one-token and partial sequences), GVA, no final state
    (so no final-state gradient), both state layouts, with the H200 entry's backward stages and with its fused
    stages off: every gradient within FLA's tolerances of the float64 reference and of FLA 0.6.0's own step, none
    NaN."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    from cula.kda import chunk_kda

    if not fused:
        kda_tuning(**_UNFUSED_STAGES)
    torch.manual_seed(3)
    cu = torch.tensor([0, 0, 1, 130, 330], dtype=torch.int64, device="cuda")
    leaves, (do, _) = _step_inputs(1, 330, 2, 4, 4)
    kw = dict(_STEP_FLAGS, output_final_state=False, state_v_first=state_v_first, cu_seqlens=cu,
              cu_seqlens_cpu=cu.cpu())  # fmt: skip
    ours = _step(chunk_kda, leaves, (do, None), **kw)
    fla = _step(fla_chunk_kda, leaves, (do, None), **kw)
    _judge_step(ours, fla, _step_f64(leaves, (do, None), **kw))


def _kept_case(packed: bool, state_v_first: bool, seed: int):
    """Leaves, cotangents and keywords of the kept-intermediates steps: GVA, fixed (B=2) or packed with an empty and
    a one-token sequence."""
    torch.manual_seed(seed)
    B, T, N = (1, 330, 4) if packed else (2, 200, 2)
    leaves, cotangents = _step_inputs(B, T, 2, 4, N)
    kw = dict(_STEP_FLAGS, state_v_first=state_v_first)
    if packed:
        cu = torch.tensor([0, 0, 1, 130, 330], dtype=torch.int32, device="cuda")
        kw.update(cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
    return leaves, cotangents, kw


def _gradients_close(recomputed, kept) -> None:
    """Every leaf's gradient of a step that kept intermediates within FLA's tolerance of the recomputing step's."""
    from cula.testing import assert_close

    for n, grad in recomputed[2].items():
        assert_close(f"d{n}", grad.float(), kept[2][n].float(), _GRAD_TOL.get(n, 8e-3))


@pytest.mark.gpu
@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "packed"])
def test_disable_recompute_keeps_the_prefix_gpu(kda_tuning, packed, state_v_first):
    """``disable_recompute=True`` (the forward keeps g_cum, w, u, qg, kg, h and v_new; FLA's backward takes them):
    the step's outputs and gradients within FLA's tolerances of the recomputing step's, of FLA 0.6.0's own
    ``disable_recompute=True`` step and of the float64 reference; GVA, packed with an empty and a one-token
    sequence, both state layouts, none NaN."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    from cula.kda import chunk_kda
    from cula.testing import poisoned_allocations

    leaves, cotangents, kw = _kept_case(packed, state_v_first, seed=4)
    with poisoned_allocations():
        kept = _step(chunk_kda, leaves, cotangents, disable_recompute=True, **kw)
    again = _step(chunk_kda, leaves, cotangents, **kw)
    _gradients_close(again, kept)
    fla = _step(fla_chunk_kda, leaves, cotangents, disable_recompute=True, **kw)
    _judge_step(kept, fla, _step_f64(leaves, cotangents, **kw))
