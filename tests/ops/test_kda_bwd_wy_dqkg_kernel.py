"""KDA backward through the state terms and the WY form on SM90 (``cula/ops/kda/sm90/bwd_wy_dqkg.py``), stage 6 of
FLA's ``chunk_kda_bwd``.

CPU: every variant traces and compiles for sm_90a (bf16 / fp16 ``mma.sync`` m16n8k16, bulk row copies, no spills); the
launcher rejects bad shapes before any launch. GPU (``-m gpu``): ``dq``, ``dk``, ``dv2``, ``db``, ``dg``, ``dA``
against FLA 0.6.0's ``chunk_kda_bwd_wy_dqkg_fused`` on the same bf16 inputs and against the float64 contract
(``cula.kda.naive_bwd.chunk_kda_bwd_wy_dqkg_reference``): fixed and packed (length-1 and partial chunks, odd
lengths), GVA, both state layouts, bf16 beta; NaN-poisoned outputs.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch
from cute_compile import compile_with_dumps, dump_script

from cula.testing import make_cu_seqlens, rel_rmse

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from test_naive_bwd import _wy_case  # noqa: E402

_VARIANTS = [
    {"dtype": "BFloat16", "beta_dtype": "Float32", "state_v_first": False, "varlen": False},
    {"dtype": "BFloat16", "beta_dtype": "Float32", "state_v_first": True, "varlen": True},
    {"dtype": "BFloat16", "beta_dtype": "BFloat16", "state_v_first": False, "varlen": True},
    {"dtype": "Float16", "beta_dtype": "Float16", "state_v_first": True, "varlen": False},
    # raw q / k normalised as the epilogues read them (KdaTuning.bwd_norm_on_load)
    {"dtype": "BFloat16", "beta_dtype": "Float32", "state_v_first": False, "varlen": True, "raw_qk": True},
]

_COMPILE_SCRIPT = dump_script(
    "from cula.ops.kda.sm90 import bwd_wy_dqkg_kernel as M",
    'M._compile(v["dtype"], v["beta_dtype"], v["state_v_first"], v["varlen"], extra_options=opts, '
    'raw_qk=v.get("raw_qk", False))',
)


@pytest.fixture(scope="module")
def compiled_variants(tmp_path_factory):
    return compile_with_dumps(_COMPILE_SCRIPT, _VARIANTS, tmp_path_factory.mktemp("kda_bwd_wy_dqkg"))


@pytest.mark.parametrize("idx", range(len(_VARIANTS)), ids=["-".join(map(str, v.values())) for v in _VARIANTS])
def test_variant_compiles_sm90a(compiled_variants, idx):
    res = compiled_variants[idx]
    ptx, remarks = res["ptx"], res["remarks"]
    dt = "bf16" if _VARIANTS[idx]["dtype"] == "BFloat16" else "f16"
    assert ".target sm_90a" in ptx and f"mma.sync.aligned.m16n8k16.row.col.f32.{dt}.{dt}.f32" in ptx
    # every tile row by one bulk copy on its group's mbarrier, no 16-byte cp.async left
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    assert "cp.async.cg.shared.global" not in ptx and "cp.async.ca.shared.global" not in ptx
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", remarks)
    assert spills and all(int(a) == 0 and int(b) == 0 for a, b in spills), spills


def _zeros(B=1, T=100, H=1, HV=2, D=128, NT=None):
    NT = -(-T // 64) if NT is None else NT
    x, xv = torch.zeros(B, T, H, D, dtype=torch.bfloat16), torch.zeros(B, T, HV, D, dtype=torch.bfloat16)
    s = torch.zeros(B, NT, HV, D, D, dtype=torch.bfloat16)
    return dict(q=x, k=x, v=xv, v_new=xv, g=torch.zeros(B, T, HV, D), beta=torch.zeros(B, T, HV),
                A=torch.zeros(B, T, HV, 64, dtype=torch.bfloat16), h=s, do=xv, dh=s, dv=xv)  # fmt: skip


def test_launcher_validates_shapes():
    from cula.ops.kda.sm90.bwd_wy_dqkg import chunk_kda_bwd_wy_dqkg_sm90 as run

    x = _zeros()
    with pytest.raises(ValueError, match="K = V = 128"):
        run(**dict(x, v=x["v"][..., :64]))
    with pytest.raises(ValueError, match="q must be"):
        run(**dict(x, q=x["q"].float()))
    with pytest.raises(ValueError, match="A:"):
        run(**dict(x, A=x["A"].float()))
    with pytest.raises(ValueError, match="h:"):
        run(**dict(x, h=x["h"][:, :1]))
    with pytest.raises(ValueError, match="g:"):
        run(**dict(x, g=x["g"].bfloat16()))
    with pytest.raises(ValueError, match="multiple"):
        run(**_zeros(H=2, HV=3))
    with pytest.raises(ValueError, match="batch size"):
        run(**_zeros(B=2), cu_seqlens=make_cu_seqlens([50, 50]))
    with pytest.raises(ValueError, match="chunk_size"):
        run(**x, chunk_size=32)


def test_no_tokens_launches_nothing():
    from cula.ops.kda.sm90.bwd_wy_dqkg import chunk_kda_bwd_wy_dqkg_sm90 as run

    dq, dk, dv2, db, dg, dA = run(**_zeros(T=0, NT=0), cu_seqlens=make_cu_seqlens([0, 0]),
                                  chunk_indices=torch.zeros(0, 2, dtype=torch.int32))  # fmt: skip
    assert dq.shape == dk.shape == dg.shape == (1, 0, 2, 128) and db.shape == (1, 0, 2) and dA.shape == (1, 0, 2, 64)
    assert dv2.shape == (1, 0, 2, 128) and dv2.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize(
    "args,beta_dtype",
    [((2, 300, 2, 4, 128, 128, None, True), torch.float32),
     ((1, 1000, 2, 2, 128, 128, [1, 63, 64, 65, 807], False), torch.float32),
     ((1, 200, 1, 1, 128, 128, [130, 0, 70], True), torch.bfloat16),
     ((1, 64, 1, 1, 128, 128, None, False), torch.float32),
     # more items than SMs: each persistent CTA walks several, its loads of the next overlapping the current
     ((2, 4100, 2, 4, 128, 128, None, True), torch.float32),
     ((1, 8500, 2, 2, 128, 128, [1, 4000, 63, 0, 4306, 130], False), torch.float32)],
    ids=["gva-odd-v-first", "varlen", "varlen-empty-bf16-beta", "one-chunk", "many-items-v-first",
         "many-items-varlen"],
)  # fmt: skip
def test_bwd_wy_dqkg_vs_fla_and_f64_cuda(args, beta_dtype):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_wy_dqkg_fused

    from cula.kda.naive_bwd import chunk_kda_bwd_wy_dqkg_reference
    from cula.ops.kda.sm90.bwd_wy_dqkg import chunk_kda_bwd_wy_dqkg_sm90

    case, _ = _wy_case(*args)
    low = ("q", "k", "v", "v_new", "A", "h", "do", "dh", "dv")
    case["beta"] = case["beta"].to(beta_dtype)
    case = {n: (x.cuda().bfloat16() if n in low else x.cuda()) if torch.is_tensor(x) else x for n, x in case.items()}
    ours = chunk_kda_bwd_wy_dqkg_sm90(**case, chunk_size=64)
    fla = chunk_kda_bwd_wy_dqkg_fused(**case, chunk_size=64)
    torch.cuda.synchronize()
    ref = chunk_kda_bwd_wy_dqkg_reference(**{n: x.cpu() if torch.is_tensor(x) else x for n, x in case.items()})
    for name, o, f, r in zip(("dq", "dk", "dv", "db", "dg", "dA"), ours, fla, ref):
        assert o.shape == f.shape and o.dtype == f.dtype, name
        assert not o.isnan().any(), name
        tol = 2e-2 if name in ("db", "dg") else 8e-3
        vs_ref, vs_fla = rel_rmse(r.double(), o.cpu().double()), rel_rmse(f.double(), o.double())
        # FLA's bf16 rounding points (-dw, k G, dAm, M1) are ours too: against the float64 contract, within FLA's
        # tolerance or no further off than FLA's own kernel
        fla_vs_ref = rel_rmse(r.double(), f.cpu().double())
        assert vs_fla < tol and vs_ref < max(tol, 1.25 * fla_vs_ref), (name, vs_ref, vs_fla, fla_vs_ref)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "args", [(2, 300, 2, 2, 128, 128, None, True), (1, 8500, 2, 2, 128, 128, [1, 4000, 63, 0, 4306, 130], False)],
    ids=["fixed-v-first", "many-items-varlen"],
)  # fmt: skip
def test_bwd_wy_dqkg_raw_qk_cuda(args):
    """``qk_rstd`` (KdaTuning.bwd_norm_on_load): raw q / k with their 1 / norms give the bits of the same call on
    ``bf16(x rstd)``, the normalised rows as FLA's l2norm_fwd rounds them."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from cula.ops.kda.sm90.bwd_wy_dqkg import chunk_kda_bwd_wy_dqkg_sm90 as run

    case, _ = _wy_case(*args)
    low = ("q", "k", "v", "v_new", "A", "h", "do", "dh", "dv")
    case = {n: (x.cuda().bfloat16() if n in low else x.cuda()) if torch.is_tensor(x) else x for n, x in case.items()}
    gen = torch.Generator("cuda").manual_seed(5)
    raw = {n: (case[n].float() * (0.1 + 4 * torch.rand(*case[n].shape[:-1], 1, generator=gen, device="cuda")))
           .bfloat16() for n in ("q", "k")}  # fmt: skip
    rstd = [torch.rsqrt(raw[n].float().pow(2).sum(-1) + 1e-6) for n in ("q", "k")]
    normed = {n: (raw[n].float() * r[..., None]).bfloat16() for n, r in zip(("q", "k"), rstd)}
    plain = run(**dict(case, **normed))
    again = run(**dict(case, **raw), qk_rstd=tuple(rstd))
    for name, a, b in zip(("dq", "dk", "dv", "db", "dg", "dA"), plain, again):
        assert not b.isnan().any() and torch.equal(a, b), name


@pytest.mark.gpu
def test_bwd_wy_dqkg_padded_chunk_list_cuda():
    """Padding rows in the chunk list (``(n, c)`` with ``64 c >=`` the length of sequence n, as a list built on the
    device ends with), among more items than SMs, change no output: the same bits as the unpadded list."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from cula.ops.kda.sm90.bwd_wy_dqkg import chunk_kda_bwd_wy_dqkg_sm90 as run
    from cula.ops.kda.sm90.intra import prepare_chunk_indices_i32

    case, _ = _wy_case(1, 8500, 2, 2, 128, 128, [1, 4000, 63, 0, 4306, 130], True)
    low = ("q", "k", "v", "v_new", "A", "h", "do", "dh", "dv")
    case = {n: (x.cuda().bfloat16() if n in low else x.cuda()) if torch.is_tensor(x) else x for n, x in case.items()}
    ci = prepare_chunk_indices_i32(case["cu_seqlens"])
    pad = torch.tensor([[5, 50]] * 40, dtype=torch.int32, device="cuda")
    ci_padded = torch.cat([ci[:70], pad[:20], ci[70:], pad[20:]])
    # each state row follows its chunk-list row; the padding rows' states are never read
    extra = torch.full_like(case["h"][:, :20], float("nan"))
    h, dh = case["h"], case["dh"]
    padded = dict(case, h=torch.cat([h[:, :70], extra, h[:, 70:], extra], 1),
                  dh=torch.cat([dh[:, :70], extra, dh[:, 70:], extra], 1))  # fmt: skip
    ours = run(**case, chunk_indices=ci)
    again = run(**padded, chunk_indices=ci_padded)
    for name, a, b in zip(("dq", "dk", "dv", "db", "dg", "dA"), ours, again):
        assert not a.isnan().any() and torch.equal(a, b), name
