"""KDA backward stages 4 and 5 in one launch on SM90 (``cula/ops/kda/sm90/bwd_dhu.py``): FLA's ``chunk_kda_bwd_dAv``
then ``chunk_gated_delta_rule_bwd_dhu`` (dv and the state-gradient recurrence).

CPU: every variant traces and compiles for sm_90a with WGMMA, TMA and register reallocation, no WGMMA
serialisation; the launcher rejects bad shapes before any launch. GPU (``-m gpu``): ``dAqk``, ``dh``, ``dh0`` and
``dv2`` against FLA 0.6.0's two stages on the same inputs and against float64 (``_stage4_f64``, then
``cula.kda.naive_bwd.chunk_kda_bwd_dhu_reference``), fixed and packed (empty and length-1 sequences, odd lengths),
both state layouts, with and without ``dht``; NaN-poisoned outputs.
"""

from __future__ import annotations


import pytest
import torch
from cute_compile import assert_wgmma_kernel, compile_with_dumps, dump_script

from cula.testing import assert_close, make_cu_seqlens

_VARIANTS = [
    {"dtype": "BFloat16", "varlen": vl, "has_dht": d, "has_dh0": d, "state_v_first": vf}
    for vl in (False, True)
    for d in (False, True)
    for vf in (False, True)
] + [
    {"dtype": "Float16", "varlen": True, "has_dht": True, "has_dh0": False, "state_v_first": False},
    {"dtype": "Float16", "varlen": True, "has_dht": True, "has_dh0": True, "state_v_first": True},
]

_COMPILE_SCRIPT = dump_script(
    "from cula.ops.kda.sm90 import bwd_dhu_kernel as M",
    'M._compile(v["dtype"], v["varlen"], v["has_dht"], v["has_dh0"], v["state_v_first"], extra_options=opts)',
)


@pytest.fixture(scope="module")
def compiled_variants(tmp_path_factory):
    return compile_with_dumps(_COMPILE_SCRIPT, _VARIANTS, tmp_path_factory.mktemp("kda_bwd_dhu"))


@pytest.mark.parametrize("idx", range(len(_VARIANTS)), ids=["-".join(map(str, v.values())) for v in _VARIANTS])
def test_variant_compiles_sm90a(compiled_variants, idx):
    # stage 4's two products and their operands leave a few registers short in some variants (12 bytes with
    # varlen and [V, K] states)
    assert_wgmma_kernel(compiled_variants[idx], spill_bytes=16)


def test_launcher_validates_shapes():
    from cula.ops.kda.sm90.bwd_dhu import chunk_kda_bwd_dv_dhu_sm90 as run

    x, g = torch.zeros(1, 100, 2, 128, dtype=torch.bfloat16), torch.zeros(1, 100, 2, 128)
    aqk = torch.zeros(1, 100, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Aqk"):
        run(x, x, x, x, aqk.float(), x, g)
    with pytest.raises(ValueError, match="v_new"):
        run(x, x, x, x, aqk, x[:, :99], g)
    with pytest.raises(ValueError, match="dAqk"):
        run(x, x, x, x, aqk, x, g, dAqk=torch.zeros(1, 100, 2, 32))
    with pytest.raises(ValueError, match="gk"):
        run(x, x, x, x, aqk, x, g.bfloat16())
    with pytest.raises(ValueError, match="K = V = 128"):
        run(x[..., :64], x[..., :64], x[..., :64], x[..., :64], aqk, x[..., :64], g[..., :64])
    with pytest.raises(ValueError, match="dht"):
        run(x, x, x, x, aqk, x, g, dht=torch.zeros(2, 2, 128, 128))
    with pytest.raises(ValueError, match="batch size"):
        run(*(t.expand(2, 100, 2, t.shape[-1]).contiguous() for t in (x, x, x, x, aqk, x, g)),
            cu_seqlens=make_cu_seqlens([50, 50]))  # fmt: skip
    with pytest.raises(ValueError, match="chunk_size"):
        run(x, x, x, x, aqk, x, g, chunk_size=32)


def test_no_tokens_passes_dht_through():
    from cula.ops.kda.sm90.bwd_dhu import chunk_kda_bwd_dv_dhu_sm90 as run

    x, g = torch.zeros(1, 0, 2, 128, dtype=torch.bfloat16), torch.zeros(1, 0, 2, 128)
    aqk = torch.zeros(1, 0, 2, 64, dtype=torch.bfloat16)
    dht = torch.randn(2, 2, 128, 128)
    dA, dh, dh0, dv2 = run(x, x, x, x, aqk, x, g, h0=dht, dht=dht, cu_seqlens=make_cu_seqlens([0, 0]))
    assert dh.shape == (1, 0, 2, 128, 128) and dv2.shape == x.shape and torch.equal(dh0, dht)
    assert dA.shape == (1, 0, 2, 64)


def _case(lens, B, HV, state_v_first, with_dht, seed=0):
    """Stage 5's inputs on the GPU as chunk_kda_bwd makes them: qg, kg, w of unit-scale rows, a chunk-local log2
    gate cumsum restarting at every chunk and sequence, and do."""
    torch.manual_seed(seed)
    D = 128
    T = sum(lens) if lens is not None else 300
    cu = make_cu_seqlens(lens, device="cuda") if lens is not None else None
    r = lambda *s: (torch.randn(*s, device="cuda") / D**0.5).bfloat16()  # noqa: E731
    a = -0.2 * torch.rand(B, T, HV, D, device="cuda")
    gk = torch.empty_like(a)
    bounds = [0, T] if cu is None else cu.tolist()
    for bos, eos in zip(bounds[:-1], bounds[1:]):
        for c0 in range(bos, eos, 64):
            gk[:, c0 : min(c0 + 64, eos)] = a[:, c0 : min(c0 + 64, eos)].cumsum(1)
    N = B if cu is None else len(lens)
    shape = (N, HV, D, D)
    dht = torch.randn(shape, device="cuda") * 0.1 if with_dht else None
    do = torch.randn(B, T, HV, D, device="cuda").bfloat16()
    return dict(q=r(B, T, HV, D), k=r(B, T, HV, D), w=r(B, T, HV, D), do=do, gk=gk,
                h0=torch.zeros(shape, device="cuda"), dht=dht, scale=D**-0.5, state_v_first=state_v_first,
                cu_seqlens=cu)  # fmt: skip


def _stage4_case(case, seed=1):
    """Stage 4's inputs beside ``_case``'s: v_new, and the forward's Aqk as cula's intra kernel leaves it (scaled,
    zero above the diagonal of every chunk; rows past a sequence's end are the next sequence's)."""
    torch.manual_seed(seed)
    B, T, HV, D = case["do"].shape
    v_new = torch.randn(B, T, HV, D, device="cuda").bfloat16()
    aqk = torch.randn(B, T, HV, 64, device="cuda") * 0.1
    bounds = [0, T] if case["cu_seqlens"] is None else case["cu_seqlens"].tolist()
    col = torch.arange(64, device="cuda")
    for bos, eos in zip(bounds[:-1], bounds[1:]):
        for c0 in range(bos, eos, 64):
            row = torch.arange(c0, min(c0 + 64, eos), device="cuda") - c0
            aqk[:, c0 : c0 + len(row)] *= (col[None, :] <= row[:, None]).float()[None, :, None, :]
    return v_new, aqk.bfloat16()


def _stage4_f64(do, v_new, aqk, scale, bounds):
    """FLA's stage 4 in float64 on the CPU: ``(dAqk, dv)`` per chunk of every sequence."""
    do, v_new, aqk = (t.double().cpu() for t in (do, v_new, aqk))
    dA, dv = torch.zeros(*do.shape[:3], 64, dtype=torch.float64), torch.zeros_like(do)
    for bos, eos in zip(bounds[:-1], bounds[1:]):
        for c0 in range(bos, eos, 64):
            c1 = min(c0 + 64, eos)
            n = c1 - c0
            a = aqk[:, c0:c1, :, :n].permute(0, 2, 1, 3).tril()  # (B, HV, t, s), s <= t
            o, vn = do[:, c0:c1].permute(0, 2, 1, 3), v_new[:, c0:c1].permute(0, 2, 1, 3)
            dA[:, c0:c1, :, :n] = (scale * (o @ vn.transpose(-1, -2))).tril().permute(0, 2, 1, 3)
            dv[:, c0:c1] = (a.transpose(-1, -2) @ o).permute(0, 2, 1, 3)
    return dA, dv


@pytest.mark.gpu
@pytest.mark.parametrize("with_dht", [False, True], ids=["no-dht", "dht"])
@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("lens,B", [(None, 2), ([300, 0, 1, 129, 64, 7], 1)], ids=["fixed", "packed"])
def test_dv_dhu_vs_fla_and_f64_cuda(lens, B, state_v_first, with_dht):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv

    from cula.kda.naive_bwd import chunk_kda_bwd_dhu_reference
    from cula.ops.kda.sm90.bwd_dhu import chunk_kda_bwd_dv_dhu_sm90
    from cula.testing import poisoned_allocations

    case = _case(lens, B, 3, state_v_first, with_dht)
    v_new, aqk = _stage4_case(case)
    with poisoned_allocations():
        dA, dh, dh0, dv2 = chunk_kda_bwd_dv_dhu_sm90(do=case["do"], Aqk=aqk, v_new=v_new,
                                                     **{n: t for n, t in case.items() if n != "do"})  # fmt: skip
    fla_dA, fla_dv = chunk_kda_bwd_dAv(q=case["q"], k=case["k"], v=v_new, do=case["do"], A=aqk, scale=case["scale"],
                                       cu_seqlens=case["cu_seqlens"], chunk_size=64)  # fmt: skip
    fla = chunk_gated_delta_rule_bwd_dhu(**case, dv=fla_dv, chunk_size=64)
    torch.cuda.synchronize()
    T = case["do"].shape[1]
    bounds = [0, T] if case["cu_seqlens"] is None else case["cu_seqlens"].tolist()
    exact_dA, exact_dv = _stage4_f64(case["do"], v_new, aqk, case["scale"], bounds)
    cpu = {n: (t.cpu() if torch.is_tensor(t) else t) for n, t in case.items()}
    ref = chunk_kda_bwd_dhu_reference(**cpu, dv=exact_dv)
    for name, ours, theirs, exact in zip(("dAqk", "dh", "dh0", "dv2"), (dA, dh, dh0, dv2), (fla_dA, *fla),
                                         (exact_dA, *ref)):  # fmt: skip
        assert not ours.isnan().any(), name
        assert_close(f"{name} vs FLA", theirs.float().cpu(), ours.float().cpu(), 5e-3)
        assert_close(f"{name} vs f64", exact.float(), ours.float().cpu(), 8e-3)
