"""KDA backward through the intra-chunk scores on SM90 (``cula/ops/kda/sm90/bwd_intra.py``), stage 7 of FLA's
``chunk_kda_bwd``.

CPU: every variant traces and compiles for sm_90a (tf32 ``mma.sync``, ``cp.async``, at most 16 bytes of spills);
the launcher rejects bad shapes before any launch. GPU (``-m gpu``): ``dq``, ``dk``, ``db``, ``dg`` against FLA 0.6.0's
``chunk_kda_bwd_intra`` on the same inputs and against the float64 contract
(``cula.kda.naive_bwd.chunk_kda_bwd_intra_reference``), both on the outputs and on the increments over the
incoming accumulations: fixed and packed (empty and length-1 sequences, odd lengths), GVA, fp32 and bf16 beta,
gates near 0 and at FLA's safe-gate bound; with stage 8 (dg's reverse chunk cumsum) on chip too; NaN-poisoned
outputs.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from cute_compile import assert_mma_sync_kernel, compile_with_dumps, dump_script

from cula.testing import assert_close, make_cu_seqlens, rel_rmse

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from test_naive_bwd import _chunk_bounds, _intra_case  # noqa: E402

_VARIANTS = [
    {"dtype": "BFloat16", "beta_dtype": "Float32", "varlen": False, "reverse_cumsum": False},
    {"dtype": "BFloat16", "beta_dtype": "Float32", "varlen": True, "reverse_cumsum": True},
    {"dtype": "BFloat16", "beta_dtype": "BFloat16", "varlen": False, "reverse_cumsum": True},
    {"dtype": "Float16", "beta_dtype": "Float16", "varlen": True, "reverse_cumsum": False},
    # the fused neighbours: the L2 norm's and the gate's backward
    {"dtype": "BFloat16", "beta_dtype": "Float32", "varlen": False, "reverse_cumsum": True, "l2norm": True,
     "gate": "lower_bound", "g_raw_dtype": "Float32"},
    {"dtype": "BFloat16", "beta_dtype": "Float32", "varlen": True, "reverse_cumsum": True, "l2norm": False,
     "gate": "lower_bound", "g_raw_dtype": "BFloat16", "has_a_log": False, "has_dt_bias": False},
    {"dtype": "Float16", "beta_dtype": "Float32", "varlen": True, "reverse_cumsum": False, "l2norm": True},
    # any_gate (exact for any gate): the training defaults of a softplus or log gate (the gate's backward is FLA's)
    {"dtype": "BFloat16", "beta_dtype": "Float32", "varlen": False, "reverse_cumsum": True, "l2norm": True,
     "any_gate": True},
    {"dtype": "BFloat16", "beta_dtype": "Float32", "varlen": True, "reverse_cumsum": True, "any_gate": True},
    # the softplus gate's backward (KdaTuning.bwd_intra_softplus_gate), A_log absent
    {"dtype": "BFloat16", "beta_dtype": "Float32", "varlen": True, "reverse_cumsum": True, "l2norm": True,
     "gate": "softplus", "g_raw_dtype": "Float32", "has_a_log": False, "any_gate": True},
    # raw q / k normalised as they load, with the L2 norm's rstd (KdaTuning.bwd_norm_on_load)
    {"dtype": "BFloat16", "beta_dtype": "Float32", "varlen": True, "reverse_cumsum": True, "l2norm": True,
     "gate": "lower_bound", "g_raw_dtype": "BFloat16", "raw_qk": True},
]

_COMPILE_SCRIPT = dump_script(
    "from cula.ops.kda.sm90 import bwd_intra_kernel as M",
    'M._compile(extra_options=opts, **v)',
)


@pytest.fixture(scope="module")
def compiled_variants(tmp_path_factory):
    return compile_with_dumps(_COMPILE_SCRIPT, _VARIANTS, tmp_path_factory.mktemp("kda_bwd_intra"))


@pytest.mark.parametrize("idx", range(len(_VARIANTS)), ids=["-".join(map(str, v.values())) for v in _VARIANTS])
def test_variant_compiles_sm90a(compiled_variants, idx):
    # the epilogues' batched gradient loads spill 16 bytes and measured faster than every spill-free batching; the
    # any_gate variants (the exact path's folds beside both products' accumulators) 16-32 bytes of stores, 48-80 of
    # reloads
    assert_mma_sync_kernel(compiled_variants[idx], max_spill_bytes=80 if _VARIANTS[idx].get("any_gate") else 16)


def _zeros(B=1, T=100, H=1, HV=2, K=128):
    x = torch.zeros(B, T, H, K, dtype=torch.bfloat16)
    f = torch.zeros(B, T, HV, K)
    return dict(q=x, k=x, g=f, beta=torch.zeros(B, T, HV), dAqk=torch.zeros(B, T, HV, 64),
                dAkk=torch.zeros(B, T, HV, 64), dq=f, dk=f, db=torch.zeros(B, T, HV), dg=f)  # fmt: skip


def test_launcher_validates_shapes():
    from cula.ops.kda.sm90.bwd_intra import chunk_kda_bwd_intra_sm90 as run

    x = _zeros()
    with pytest.raises(ValueError, match="K = 128"):
        run(**{n: (t[..., :64] if t.dim() == 4 and t.shape[-1] == 128 else t) for n, t in x.items()})
    with pytest.raises(ValueError, match="q and k"):
        run(**dict(x, q=x["q"].float()))
    with pytest.raises(ValueError, match="dAkk"):
        run(**dict(x, dAkk=x["dAkk"][..., :32]))
    with pytest.raises(ValueError, match="dg"):
        run(**dict(x, dg=x["dg"].bfloat16()))
    with pytest.raises(ValueError, match="multiple"):
        run(**dict(_zeros(H=2, HV=3)))
    with pytest.raises(ValueError, match="batch size"):
        run(**_zeros(B=2), cu_seqlens=make_cu_seqlens([50, 50]))
    with pytest.raises(ValueError, match="chunk_size"):
        run(**x, chunk_size=32)


def test_no_tokens_launches_nothing():
    from cula.ops.kda.sm90.bwd_intra import chunk_kda_bwd_intra_sm90 as run

    dq, dk, db, dg = run(**_zeros(T=0), cu_seqlens=make_cu_seqlens([0, 0]))
    assert dq.shape == dk.shape == dg.shape == (1, 0, 2, 128) and db.shape == (1, 0, 2)


def _gpu_case(B, T, H, HV, lens, gate, beta_dtype, seed):
    case = _intra_case(B, T, H, HV, 128, lens=lens, seed=seed)
    if gate != "mild":  # the chunk-local cumsum of another per-step decay
        gen = torch.Generator().manual_seed(seed + 1)
        step = -5.0 / math.log(2) if gate == "bound" else -1e-3  # FLA's safe-gate bound (-5 nats a step), near 0
        a = step * torch.rand(case["g"].shape, generator=gen)
        for c0, c1 in _chunk_bounds(T, case["cu_seqlens"]):
            case["g"][:, c0:c1] = a[:, c0:c1].cumsum(1)
    case["q"], case["k"] = case["q"].bfloat16(), case["k"].bfloat16()
    case["beta"] = case["beta"].to(beta_dtype)
    return case


def _assert_outputs(case, ours, fla, ref):
    """dq, dk, db, dg (fp32, no NaN) against the float64 contract and FLA's kernel, whole and as increments over the
    incoming accumulations (which would hide an error in the increments)."""
    incoming = (case["dq"], case["dk"], case["db"], case["dg"])
    for name, o, f, r, acc in zip(("dq", "dk", "db", "dg"), ours, fla, ref, incoming):
        assert o.dtype == torch.float32 and o.shape == acc.shape, name
        assert not o.isnan().any(), name
        o, f = o.cpu(), f.float().cpu()
        tol = 2e-2 if name in ("db", "dg") else 8e-3
        assert_close(f"{name} vs f64", r.float(), o, 5e-3)
        assert_close(f"{name} increment vs f64", (r - acc).float(), o - acc, tol)
        assert_close(f"{name} increment vs FLA", f - acc, o - acc, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["mild", "bound", "near0"])
@pytest.mark.parametrize(
    "B,T,H,HV,lens,beta_dtype",
    [(2, 300, 1, 2, None, torch.float32), (1, 501, 2, 2, [300, 0, 1, 129, 64, 7], torch.float32),
     (1, 63, 1, 1, None, torch.bfloat16)],
    ids=["fixed-gva", "packed", "short-bf16-beta"],
)  # fmt: skip
def test_bwd_intra_vs_fla_and_f64_cuda(B, T, H, HV, lens, beta_dtype, gate):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra

    from cula.kda.naive_bwd import chunk_kda_bwd_intra_reference
    from cula.ops.kda.sm90.bwd_intra import chunk_kda_bwd_intra_sm90

    case = _gpu_case(B, T, H, HV, lens, gate, beta_dtype, seed=7)
    ref = chunk_kda_bwd_intra_reference(**case)
    gpu = {n: (t.cuda() if torch.is_tensor(t) else t) for n, t in case.items()}
    ours = chunk_kda_bwd_intra_sm90(**gpu)
    fla = chunk_kda_bwd_intra(**gpu, safe_gate=gate == "bound", lower_bound=-5.0 if gate == "bound" else None)
    torch.cuda.synchronize()
    _assert_outputs(case, ours, fla, ref)
    # with stage 8 on chip: dg as FLA's chunk_local_cumsum(dg, reverse=True) leaves it, the rest bit for bit
    fused = chunk_kda_bwd_intra_sm90(**gpu, reverse_cumsum_dg=True)
    torch.cuda.synchronize()
    for name, o, x in zip(("dq", "dk", "db"), ours, fused):
        assert torch.equal(o, x), name
    # in place (the training backward's call): the same bits, in the incoming accumulations' own buffers
    for cumsum, want in ((False, ours), (True, fused)):
        acc = {n: gpu[n].clone() for n in ("dq", "dk", "db", "dg")}
        out = chunk_kda_bwd_intra_sm90(**{**gpu, **acc}, reverse_cumsum_dg=cumsum, in_place=True)
        for name, o, w in zip(("dq", "dk", "db", "dg"), out, want):
            assert o.data_ptr() == acc[name].data_ptr() and torch.equal(o, w), (name, cumsum)
    def suffix(x):  # FLA's chunk_local_cumsum(x, reverse=True), in float64
        x = x.double().clone()
        for c0, c1 in _chunk_bounds(T, case["cu_seqlens"]):
            x[:, c0:c1] = x[:, c0:c1].flip(1).cumsum(1).flip(1)
        return x

    assert not fused[3].isnan().any()
    assert_close("dg reverse cumsum", suffix(ours[3].cpu()).float(), fused[3].cpu(), 1e-5)
    # the suffix sums cancel most of dg's q dq - k dk terms pairwise, so what rounding leaves of them adds up over
    # a chunk's rows (a training step's ddt_bias sums it over all tokens): no worse than FLA's against float64
    exact = suffix(ref[3] - case["dg"])
    ours_err = rel_rmse(exact, suffix(ours[3].cpu() - case["dg"]))
    fla_err = rel_rmse(exact, suffix(fla[3].float().cpu() - case["dg"]))
    assert ours_err <= max(1.5 * fla_err, 1e-3), f"dg suffix sums vs f64: ours {ours_err:.2e}, FLA {fla_err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "B,T,H,HV,lens", [(2, 300, 1, 2, None), (1, 501, 2, 2, [300, 0, 1, 129, 64, 7])], ids=["fixed-gva", "packed"]
)  # fmt: skip
def test_any_gate_vs_fla_and_f64_cuda(B, T, H, HV, lens):
    """The any_gate variant on steep gates (a chunk-local cumsum of steps of -0.7 nats on average with one step in
    30 of -80 nats: tiles past the anchored bound beside tiles within it): every output and increment against the
    float64 contract and FLA's (non-safe) kernel, with stage 8 on chip too; on mild gates the plain variant's bits."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra

    from cula.kda.naive_bwd import chunk_kda_bwd_intra_reference
    from cula.ops.kda.sm90.bwd_intra import chunk_kda_bwd_intra_sm90

    case = _gpu_case(B, T, H, HV, lens, "mild", torch.float32, seed=11)
    gpu = {n: (t.cuda() if torch.is_tensor(t) else t) for n, t in case.items()}
    mild = chunk_kda_bwd_intra_sm90(**gpu)
    mild_any = chunk_kda_bwd_intra_sm90(**gpu, any_gate=True)
    torch.cuda.synchronize()
    for name, x, y in zip(("dq", "dk", "db", "dg"), mild, mild_any):
        assert torch.equal(x, y), name
    gen = torch.Generator().manual_seed(12)
    a = -1.0 * torch.rand(case["g"].shape, generator=gen)
    a = a.masked_fill(torch.rand(case["g"].shape, generator=gen) < 1 / 30, -80.0) / math.log(2)
    for c0, c1 in _chunk_bounds(T, case["cu_seqlens"]):
        case["g"][:, c0:c1] = a[:, c0:c1].cumsum(1)
    gpu["g"] = case["g"].cuda()
    ref = chunk_kda_bwd_intra_reference(**case)
    ours = chunk_kda_bwd_intra_sm90(**gpu, any_gate=True)
    fused = chunk_kda_bwd_intra_sm90(**gpu, any_gate=True, reverse_cumsum_dg=True)
    fla = chunk_kda_bwd_intra(**gpu, safe_gate=False, lower_bound=None)
    torch.cuda.synchronize()
    _assert_outputs(case, ours, fla, ref)
    for name, o, x in zip(("dq", "dk", "db"), ours, fused):
        assert torch.equal(o, x), name
    assert not fused[3].isnan().any()


def test_launcher_validates_the_fused_neighbours():
    from cula.ops.kda.sm90.bwd_intra import chunk_kda_bwd_intra_sm90 as run

    x, x1 = _zeros(), _zeros(HV=1)
    g_raw = torch.zeros(1, 100, 1, 128)
    with pytest.raises(ValueError, match="HV == H"):
        run(**x, qk_rstd=(torch.ones(100), torch.ones(100)))
    with pytest.raises(ValueError, match="k_rstd"):
        run(**x1, qk_rstd=(torch.ones(100), torch.ones(99)))
    with pytest.raises(ValueError, match="reverse_cumsum_dg"):
        run(**x1, gate=(g_raw, None, None, -5.0))
    with pytest.raises(ValueError, match="A_log"):
        run(**x1, gate=(g_raw, torch.zeros(2), None, -5.0), reverse_cumsum_dg=True)
    with pytest.raises(ValueError, match="dt_bias"):
        run(**x1, gate=(g_raw, None, torch.zeros(128, dtype=torch.bfloat16), -5.0), reverse_cumsum_dg=True)
    with pytest.raises(ValueError, match="g_raw"):
        run(**x1, gate=(g_raw[:, :50], None, None, -5.0), reverse_cumsum_dg=True)


@pytest.mark.gpu
@pytest.mark.parametrize("lb", [-5.0, None], ids=["lower-bound", "softplus"])
@pytest.mark.parametrize("g_raw_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "B,T,H,HV,lens,params",
    [(2, 300, 2, 2, None, "both"), (1, 501, 2, 2, [300, 0, 1, 129, 64, 7], "both"),
     (1, 200, 1, 2, None, "A_log"), (1, 130, 1, 1, [1, 129], "none")],
    ids=["fixed", "packed", "gva-gate-only", "packed-no-params"],
)  # fmt: skip
def test_fused_l2norm_and_gate_vs_fla_and_f64_cuda(B, T, H, HV, lens, params, g_raw_dtype, lb):
    """Stages 9 (the gate's backward: the lower-bound sigmoid gate, or with ``lb`` None the softplus gate) and G1
    (the L2 norm's backward of dq and dk, without GVA) in the stage-7 kernel: against FLA's kda_gate_bwd and
    l2norm_bwd applied to the unfused kernel's outputs, and against the float64 contracts; the other outputs bit for
    bit the unfused kernel's; no NaN."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd
    from fla.ops.kda.gate import kda_gate_bwd

    from cula.kda.naive_bwd import chunk_kda_bwd_gate_reference, chunk_kda_bwd_intra_reference
    from cula.ops.kda.sm90.bwd_intra import chunk_kda_bwd_intra_sm90

    case = _gpu_case(B, T, H, HV, lens, "bound", torch.float32, seed=11)
    gen = torch.Generator().manual_seed(12)
    q_raw, k_raw = (torch.randn(B, T, H, 128, generator=gen).bfloat16().cuda() for _ in range(2))
    (q_n, q_rstd), (k_n, k_rstd) = l2norm_fwd(q_raw), l2norm_fwd(k_raw)
    case["q"], case["k"] = q_n.cpu(), k_n.cpu()
    g_raw = torch.randn(B, T, HV, 128, generator=gen).to(g_raw_dtype)
    A_log = torch.rand(HV, generator=gen) if params in ("both", "A_log") else None
    dt_bias = torch.randn(HV * 128, generator=gen) if params == "both" else None
    gpu = {n: (t.cuda() if torch.is_tensor(t) else t) for n, t in case.items()}
    gate = tuple(t.cuda() if t is not None else None for t in (g_raw, A_log, dt_bias)) + (lb,)
    l2 = H == HV
    # the softplus gate as training runs it: the any_gate variant (no bound known), both calls alike
    ag = lb is None
    plain = chunk_kda_bwd_intra_sm90(**gpu, reverse_cumsum_dg=True, any_gate=ag)
    fused = chunk_kda_bwd_intra_sm90(**gpu, reverse_cumsum_dg=True, gate=gate,
                                     qk_rstd=(q_rstd, k_rstd) if l2 else None, any_gate=ag)  # fmt: skip
    dg_f, dA_f, dbias_f = kda_gate_bwd(g=gate[0], A_log=gate[1], dt_bias=gate[2], dyg=plain[3], lower_bound=lb)
    torch.cuda.synchronize()
    assert len(fused) == 6
    for t in fused:
        assert t is None or not t.isnan().any()
    assert torch.equal(fused[2], plain[2])  # db
    assert fused[3].dtype == g_raw_dtype and fused[3].shape == g_raw.shape
    assert_close("dg_raw vs FLA's kda_gate_bwd", dg_f.float(), fused[3].float(), 2e-2)
    for name, f, o in (("dA_log", dA_f, fused[4]), ("ddt_bias", dbias_f, fused[5])):
        assert (f is None) == (o is None), name
        if o is not None:
            assert o.dtype == torch.float32 and o.shape == f.shape, name
            assert_close(f"{name} vs FLA", f, o, 2e-2)
    # float64: the gate's contract on the intra contract's dg
    ref = chunk_kda_bwd_intra_reference(**case)
    r_dg, r_dA, r_dbias = chunk_kda_bwd_gate_reference(
        # (the softplus gate without A_log is FLA's exp(1) coefficient: A_log = 1)
        ref[3], g_raw, (None if lb is not None else torch.ones(HV, dtype=torch.float64)) if A_log is None
        else A_log.double(), None if dt_bias is None else dt_bias.double(), lb,
        cu_seqlens=case["cu_seqlens"],
    )  # fmt: skip
    assert_close("dg_raw vs f64", r_dg.float(), fused[3].float().cpu(), 2e-2)
    for name, r, o in (("dA_log", r_dA, fused[4]), ("ddt_bias", r_dbias, fused[5])):
        if o is not None:
            assert_close(f"{name} vs f64", r.float(), o.cpu(), 2e-2)
    acc = {n: gpu[n].clone() for n in ("dq", "dk", "db", "dg")}
    in_place = chunk_kda_bwd_intra_sm90(**{**gpu, **acc}, reverse_cumsum_dg=True, gate=gate,
                                        qk_rstd=(q_rstd, k_rstd) if l2 else None, in_place=True,
                                        any_gate=ag)  # fmt: skip
    assert in_place[2].data_ptr() == acc["db"].data_ptr()
    for i, (a, b) in enumerate(zip(fused, in_place)):
        assert (a is None and b is None) or torch.equal(a, b), i
    if not l2:
        assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
        return
    for name, y, rstd, o, p, r in (("dq", q_n, q_rstd, fused[0], plain[0], ref[0]),
                                   ("dk", k_n, k_rstd, fused[1], plain[1], ref[1])):  # fmt: skip
        assert o.dtype == y.dtype and o.shape == y.shape, name
        assert_close(f"{name} vs FLA's l2norm_bwd", l2norm_bwd(y, rstd, p).float(), o.float(), 8e-3)
        y64, r64 = y.double().cpu(), rstd.double().cpu().view(B, T, H, 1)
        want = r64 * (r.double() - (r.double() * y64).sum(-1, keepdim=True) * y64)
        assert_close(f"{name} vs f64", want.float(), o.float().cpu(), 8e-3)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "B,T,H,lens,gated", [(2, 300, 2, None, True), (1, 501, 2, [300, 0, 1, 129, 64, 7], False)],
    ids=["fixed-gate", "packed"],
)  # fmt: skip
def test_raw_qk_is_the_normalised_call_cuda(B, T, H, lens, gated):
    """``raw_qk`` (KdaTuning.bwd_norm_on_load): the raw q / k with FLA's l2norm_fwd rstd give the bits of the same
    call on l2norm_fwd's normalised rows (the kernel rounds ``x rstd`` to q's dtype as l2norm_fwd does)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from fla.modules.norm.l2norm import l2norm_fwd

    from cula.ops.kda.sm90.bwd_intra import chunk_kda_bwd_intra_sm90

    case = _gpu_case(B, T, H, H, lens, "bound", torch.float32, seed=21)
    gen = torch.Generator().manual_seed(22)
    q_raw, k_raw = ((torch.randn(B, T, H, 128, generator=gen) * (0.1 + 4 * torch.rand(B, T, H, 1, generator=gen)))
                    .bfloat16().cuda() for _ in range(2))  # fmt: skip
    (q_n, q_rstd), (k_n, k_rstd) = l2norm_fwd(q_raw), l2norm_fwd(k_raw)
    gpu = {n: (t.cuda() if torch.is_tensor(t) else t) for n, t in case.items()}
    gate = None
    if gated:
        g_raw = torch.randn(B, T, H, 128, generator=gen).bfloat16().cuda()
        gate = (g_raw, torch.rand(H, generator=gen).cuda(), torch.randn(H * 128, generator=gen).cuda(), -5.0)
    kw = dict(reverse_cumsum_dg=True, gate=gate, qk_rstd=(q_rstd, k_rstd))
    plain = chunk_kda_bwd_intra_sm90(**dict(gpu, q=q_n, k=k_n), **kw)
    raw = chunk_kda_bwd_intra_sm90(**dict(gpu, q=q_raw, k=k_raw), **kw, raw_qk=True)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(plain, raw)):
        assert (a is None and b is None) or (not b.isnan().any() and torch.equal(a, b)), i
