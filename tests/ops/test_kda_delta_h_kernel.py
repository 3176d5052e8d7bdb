"""KDA inter-chunk kernel on SM90 (``cula/ops/kda/sm90/delta_h_fwd_o.py``) and its forward wrapper.

CPU: every kernel variant traces and compiles for sm_90a; the PTX/SASS has WGMMA, TMA and register
reallocation, and ptxas reports no spills and no WGMMA serialisation. GPU (``-m gpu`` on an H100/H200): the
kernel against FLA 0.6.0's two Triton stages it replaces, and ``chunk_kda_fwd_sm90`` against FLA's
``chunk_kda``, both also against a float64 token-by-token recurrence (FLA's 5e-3, which FLA must meet too).
Timing at the benchmark's shape: ``benchmarks/kernel_report.py kda-states``.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch
from cute_compile import assert_wgmma_kernel, compile_with_dumps, dump_script

from cula.testing import find_nvdisasm

os.environ.setdefault("FLA_FLASH_KDA", "0")  # compare against FLA's own Triton path, not a backend

HAS_CUDA = torch.cuda.is_available()
RATIO = 5e-3

# ----------------------------------------------------------------------------------------------------
# CPU: compile every variant once, in a subprocess (ptxas remarks need the env var before cutlass import)
# ----------------------------------------------------------------------------------------------------

# The initial/final-state flags only add a prologue/epilogue, so they vary together here (the mixed
# combinations are exercised by the GPU tests); varlen and the state layout change the main loop's indexing.
_VARIANTS = [
    {"dtype": "BFloat16", "varlen": vl, "has_h0": hs, "has_ht": hs, "state_v_first": vf}
    for vl in (False, True)
    for hs in (False, True)
    for vf in (False, True)
] + [{"dtype": "Float16", "varlen": True, "has_h0": True, "has_ht": True, "state_v_first": False}]
# cula's intra kernel writes Aqk's upper triangle as zeros: no mask, no barrier between the consumer warpgroups
_VARIANTS += [
    {"dtype": "BFloat16", "varlen": vl, "has_h0": True, "has_ht": True, "state_v_first": True, "aqk_causal": True}
    for vl in (False, True)
]
# the training forward under disable_recompute=True: also h and v_new (DeltaHFwdOStatesSm90)
_VARIANTS += [
    {"dtype": "BFloat16", "varlen": vl, "has_h0": True, "has_ht": True, "state_v_first": vf, "aqk_causal": True,
     "store_states": True}
    for vl in (False, True) for vf in (False, True)
]  # fmt: skip
# Gated DeltaNet's inference after the intra kernel's factor rows: raw q / k of H heads, the factors applied
_VARIANTS += [
    {"dtype": "BFloat16", "varlen": vl, "has_h0": vl, "has_ht": True, "state_v_first": not vl, "aqk_causal": True,
     "row_factors": True}
    for vl in (False, True)
]  # fmt: skip
# ... with v_new made of the intra kernel's T diag(beta) and the raw v (GdnTuning.inference_wy_in_recurrence)
_VARIANTS += [
    {"dtype": "BFloat16", "varlen": vl, "has_h0": True, "has_ht": vl, "state_v_first": vl, "aqk_causal": True,
     "row_factors": True, "wy_in_recurrence": True}
    for vl in (False, True)
]  # fmt: skip

_COMPILE_SCRIPT = dump_script(
    "import cutlass\nfrom cula.ops.kda.sm90 import delta_h_fwd_o as M",
    """
    M._compile(getattr(cutlass, v["dtype"]), 3, v["varlen"], v["has_h0"], v["has_ht"], v["state_v_first"],
               extra_options=opts, aqk_causal=v.get("aqk_causal", False), store_states=v.get("store_states", False),
               row_factors=v.get("row_factors", False), wy_in_recurrence=v.get("wy_in_recurrence", False))
    """,
)


@pytest.fixture(scope="module")
def compiled_variants(tmp_path_factory):
    return compile_with_dumps(_COMPILE_SCRIPT, _VARIANTS, tmp_path_factory.mktemp("kda_delta_h"))


def _vid(v):
    return "-".join(
        [v["dtype"], "varlen" if v["varlen"] else "fixed", "h0" if v["has_h0"] else "noh0",
         "ht" if v["has_ht"] else "noht", "vfirst" if v["state_v_first"] else "kfirst"]
        + (["causal"] if v.get("aqk_causal") else []) + (["states"] if v.get("store_states") else [])
        + (["row_factors"] if v.get("row_factors") else []) + (["wy"] if v.get("wy_in_recurrence") else [])
    )  # fmt: skip


@pytest.mark.parametrize("idx", range(len(_VARIANTS)), ids=[_vid(v) for v in _VARIANTS])
def test_variant_compiles_sm90a(compiled_variants, idx):
    res = compiled_variants[idx]
    states = _VARIANTS[idx].get("store_states", False)
    # the packed store_states variants spill a little (DeltaHFwdOStatesSm90's docstring)
    assert_wgmma_kernel(res, spill_bytes=32 if states else 0)
    assert res["cubins"]
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        pytest.skip("nvdisasm not found: PTX checked, SASS not")
    sass = subprocess.run(
        [nvdisasm, "-c", res["cubins"][0]], capture_output=True, text=True, check=True
    ).stdout
    # GEMM1, GEMM2 (8 k-steps each), GEMM3 (4; twice in the loop that issues it behind the next chunk's top, and in
    # that loop's drain: the o_tma variants without store_states), wy_in_recurrence's T diag(beta) product (4)
    o_behind = _VARIANTS[idx].get("aqk_causal") and not states
    wy = _VARIANTS[idx].get("wy_in_recurrence", False)
    assert sass.count("HGMMA.64x64x16.F32") == (24 if o_behind else 20) + 4 * wy
    assert sass.count("HGMMA.64x128x16.F32") == 4  # GEMM4, kg read MN-major
    assert ".tnspB" in sass
    assert "UTMALDG" in sass and "USETMAXREG" in sass
    if _VARIANTS[idx].get("aqk_causal"):  # full chunks' o: transposed stmatrix + TMA store
        assert "UTMASTG" in sass and "STSM.16.MT88.4" in sass
    assert states or not re.search(r"\b(LDL|STL)\b", sass), "local-memory traffic (spills)"
    regs = max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)) + 1
    assert regs <= 232, regs  # the consumer budget after setmaxnreg


def test_launcher_validates_shapes():
    from cula.ops.kda.sm90.delta_h_fwd_o import chunk_kda_delta_h_fwd_o_sm90

    B, T, HV = 1, 8, 2
    bf = torch.bfloat16
    w = torch.zeros(B, T, HV, 64, dtype=bf)
    with pytest.raises(ValueError, match="K = V = 128"):
        chunk_kda_delta_h_fwd_o_sm90(w, w, w, w, w.float(), w, w, scale=1.0)
    w = torch.zeros(B, T, HV, 128, dtype=bf)
    with pytest.raises(ValueError, match="Aqk"):
        chunk_kda_delta_h_fwd_o_sm90(w, w, w, w, w.float(), w, w, scale=1.0)
    a = torch.zeros(B, T, HV, 64, dtype=bf)
    with pytest.raises(ValueError, match="batch size must be 1"):
        w2 = torch.zeros(2, T, HV, 128, dtype=bf)
        a2 = torch.zeros(2, T, HV, 64, dtype=bf)
        chunk_kda_delta_h_fwd_o_sm90(w2, w2, w2, w2, w2.float(), a2, w2, scale=1.0,
                                     cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))  # fmt: skip
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda_delta_h_fwd_o_sm90(w, w, w, w, w.float(), a, w, torch.zeros(1, HV, 128, 64), scale=1.0)
    # row_factors: raw q / k of H heads, the factor rows in g's place, only after cula's intra kernel
    qk = torch.zeros(B, T, 1, 128, dtype=bf)
    with pytest.raises(ValueError, match="g: expected"):
        chunk_kda_delta_h_fwd_o_sm90(w, w, qk, qk, w.float(), a, w, scale=1.0, aqk_causal=True, row_factors=True)
    with pytest.raises(ValueError, match="aqk_causal"):
        chunk_kda_delta_h_fwd_o_sm90(w, w, qk, qk, torch.zeros(B, T, HV, 4), a, w, scale=1.0, row_factors=True)
    with pytest.raises(ValueError, match="kg: expected"):  # q and k of different head counts
        chunk_kda_delta_h_fwd_o_sm90(w, w, qk, w, torch.zeros(B, T, HV, 4), a, w, scale=1.0, aqk_causal=True,
                                     row_factors=True)  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------------


def _inputs(B, T, H, HV, seed=0, device="cuda", dtype=torch.bfloat16):
    torch.manual_seed(seed)
    K = V = 128
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=device, dtype=torch.float32), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=device, dtype=torch.float32), dim=-1)
    v = torch.randn(B, T, HV, V, device=device, dtype=torch.float32)
    # per-token log decays in about [-1, 0): strong enough to exercise the gates, mild enough for bf16
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, K, device=device) + 3.0)
    beta = torch.sigmoid(torch.randn(B, T, HV, device=device))
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype)


def _reference_f64(q, k, v, g, beta, scale, h0, cu_seqlens):
    """Token-by-token KDA in float64. Returns o [B, T, HV, V] and the final state [N, HV, K, V]."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    rep = HV // H
    q, k = q.double().repeat_interleave(rep, 2), k.double().repeat_interleave(rep, 2)
    v, g, beta = v.double(), g.double(), beta.double()
    bounds = (
        [(b, 0, T) for b in range(B)]
        if cu_seqlens is None
        else [(0, int(cu_seqlens[i]), int(cu_seqlens[i + 1])) for i in range(cu_seqlens.numel() - 1)]
    )
    o = torch.zeros(B, T, HV, V, dtype=torch.float64, device=q.device)
    finals = []
    for n, (b, s, e) in enumerate(bounds):
        S = (
            torch.zeros(HV, K, V, dtype=torch.float64, device=q.device)
            if h0 is None
            else h0[n].double().clone()
        )
        for t in range(s, e):
            S = S * g[b, t].exp()[:, :, None]
            kt = k[b, t]
            resid = v[b, t] - torch.einsum("hk,hkv->hv", kt, S)
            S = S + torch.einsum("hk,hv->hkv", kt, beta[b, t][:, None] * resid)
            o[b, t] = torch.einsum("hk,hkv->hv", q[b, t] * scale, S)
        finals.append(S)
    return o, torch.stack(finals)


def _to_kv(state, state_v_first):
    return state.transpose(-1, -2) if state_v_first else state


_F64 = {}


def _reference_for(case):
    """``(o, final state)`` of ``_setup(case)``'s inputs by the float64 recurrence, the state in the case's layout;
    computed once per case (the inputs are seeded)."""
    key = _case_id(case)
    if key not in _F64:
        q, k, v, g, beta, h0, cu, vf = _setup(case)
        o64, ht64 = _reference_f64(q, k, v, g, beta, 128**-0.5, _to_kv(h0, vf) if h0 is not None else None, cu)
        _F64[key] = (o64, _to_kv(ht64, vf))
    return _F64[key]


# Few distinct (H, HV, varlen) combinations: FLA autotunes its Triton stages once per combination, and
# that dominates the run time on a fresh GPU machine.
CASES = [
    # (B, T, H, HV, lens, with_h0, state_v_first)
    (2, 64, 2, 2, None, False, False),
    (2, 63, 2, 2, None, True, False),
    (1, 100, 2, 4, None, True, True),
    (2, 1000, 2, 2, None, True, False),
    (1, 0, 2, 2, [0, 1, 63, 300, 64], True, False),
    (1, 0, 2, 2, [0, 1, 63, 300, 64], False, True),
]


def _case_id(c):
    B, T, H, HV, lens, h0, vf = c
    shape = f"lens{'-'.join(map(str, lens))}" if lens else f"B{B}-T{T}"
    return f"{shape}-H{H}-HV{HV}-{'h0' if h0 else 'noh0'}-{'vfirst' if vf else 'kfirst'}"


def _setup(case):
    B, T, H, HV, lens, with_h0, vf = case
    cu = None
    if lens is not None:
        from cula.testing import make_cu_seqlens

        cu = make_cu_seqlens(lens, device="cuda")
        T = int(cu[-1])
    q, k, v, g, beta = _inputs(B, T, H, HV)
    N = B if cu is None else cu.numel() - 1
    h0 = None
    if with_h0:
        h0 = 0.1 * torch.randn(N, HV, 128, 128, device="cuda")
        if vf:
            h0 = h0.transpose(-1, -2).contiguous()
    return q, k, v, g, beta, h0, cu, vf


def _fla_intra(q, k, v, g, beta, cu, scale=128**-0.5):
    """FLA's chunk indices, gate cumsum and intra stage (disable_recompute) on a case's inputs: ``(chunk indices,
    int64 cu_seqlens, g_cum, w, u, qg, kg, Aqk)``."""
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.index import prepare_chunk_indices

    ci = prepare_chunk_indices(cu.long(), 64) if cu is not None else None
    cul = cu.long() if cu is not None else None
    g_cum = chunk_local_cumsum(g, chunk_size=64, scale=1.4426950408889634, cu_seqlens=cul, chunk_indices=ci)
    w, u, qg, kg, Aqk, _ = chunk_kda_fwd_intra(
        q=q, k=k, v=v, gk=g_cum, beta=beta, scale=scale, cu_seqlens=cul, chunk_size=64, chunk_indices=ci,
        disable_recompute=True,
    )  # fmt: skip
    return ci, cul, g_cum, w, u, qg, kg, Aqk


@pytest.mark.parametrize("aqk_causal", [False, True], ids=["masked", "causal"])
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (sm_90)")
def test_kernel_vs_fla_stages(case, aqk_causal):
    """The fused kernel against FLA's chunk_gated_delta_rule_fwd_h + chunk_gla_fwd_o_gk on identical inputs (FLA's
    intra stage's), and against the float64 recurrence of the inputs those came from, with NaN-poisoned outputs
    and a NaN-poisoned upper triangle of Aqk (the kernel must not read it), or with ``aqk_causal`` that triangle
    zeroed, as cula's intra kernel writes it (the kernel must not mask it)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk

    from cula.ops.kda.sm90.delta_h_fwd_o import chunk_kda_delta_h_fwd_o_sm90
    from cula.testing import assert_close, poison_

    q, k, v, g, beta, h0, cu, vf = _setup(case)
    scale = 128**-0.5
    ci, cul, g_cum, w, u, qg, kg, Aqk = _fla_intra(q, k, v, g, beta, cu, scale)
    h, v_new, ht_ref = chunk_gated_delta_rule_fwd_h(
        k=kg, w=w, u=u, gk=g_cum, initial_state=h0, output_final_state=True, cu_seqlens=cul, chunk_indices=ci,
        chunk_size=64, state_v_first=vf,
    )  # fmt: skip
    o_ref = chunk_gla_fwd_o_gk(
        q=q, v=v_new, g=g_cum, A=Aqk, h=h, scale=scale, cu_seqlens=cul, chunk_size=64, chunk_indices=ci,
        state_v_first=vf,
    )  # fmt: skip

    upper = torch.triu(torch.ones(64, 64, dtype=torch.bool, device="cuda"), 1)
    A_poisoned = Aqk.clone()
    pos = torch.arange(Aqk.shape[1], device="cuda")
    if cu is not None:  # position inside the sequence's own chunk grid
        starts = cu[:-1].long().repeat_interleave((cu[1:] - cu[:-1]).long())
        pos = pos - starts
    rows = upper[pos % 64]  # [T, 64]: columns above the diagonal of each token's row
    A_poisoned.masked_fill_(rows[None, :, None, :], 0.0 if aqk_causal else float("nan"))

    o = poison_(torch.empty_like(o_ref))
    ht = poison_(torch.empty_like(ht_ref))
    stored = {}
    if aqk_causal:  # and the states FLA's backward reads (DeltaHFwdOStatesSm90), as chunk_kda_fwd_sm90 asks
        from cula.kda.forward import _state_outputs

        stored = _state_outputs(u, cu, ci)
        stored = dict(h=poison_(stored["h"]), v_new=poison_(stored["v_new"]), chunk_offsets=stored["offsets"])
    chunk_kda_delta_h_fwd_o_sm90(
        w, u, kg, qg, g_cum, A_poisoned, o, h0, ht, cu, scale=scale, state_v_first=vf, aqk_causal=aqk_causal,
        **stored,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert_close("o vs fla", o_ref, o, RATIO)
    assert_close("final_state vs fla", ht_ref, ht, RATIO)
    if stored:
        assert stored["h"].shape == h.shape
        assert_close("h vs fla", h.float(), stored["h"].float(), RATIO)
        assert_close("v_new vs fla", v_new.float(), stored["v_new"].float(), RATIO)
    o64, ht64 = _reference_for(case)
    assert_close("o vs float64", o64, o, RATIO)
    assert_close("final_state vs float64", ht64, ht, RATIO)
    if aqk_causal:
        # without h the kernel runs its other chunk loop (_chunks_o_behind: o behind the next chunk's GEMM1), whose
        # every product and rounding is the states variant's: bit for bit
        o2, ht2 = poison_(torch.empty_like(o)), poison_(torch.empty_like(ht))
        chunk_kda_delta_h_fwd_o_sm90(w, u, kg, qg, g_cum, A_poisoned, o2, h0, ht2, cu, scale=scale,
                                     state_v_first=vf, aqk_causal=True)  # fmt: skip
        torch.cuda.synchronize()
        assert torch.equal(o2, o) and torch.equal(ht2, ht)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (sm_90)")
def test_chunk_kda_fwd_sm90_vs_fla_and_f64(case):
    from fla.ops.kda import chunk_kda

    from cula.kda.forward import chunk_kda_fwd_sm90
    from cula.testing import assert_close

    q, k, v, g, beta, h0, cu, vf = _setup(case)
    scale = 128**-0.5
    o, ht = chunk_kda_fwd_sm90(
        q, k, v, g, beta, scale, h0, True, state_v_first=vf, cu_seqlens=cu,
        cu_seqlens_cpu=cu.cpu() if cu is not None else None,
    )  # fmt: skip
    o_fla, ht_fla = chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True, state_v_first=vf,
        cu_seqlens=cu.long() if cu is not None else None,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert_close("o vs fla", o_fla, o, RATIO)
    assert_close("final_state vs fla", ht_fla, ht, RATIO)

    # FLA's own tolerance against the exact result, for both: bf16 inputs and intermediates fit in it
    o64, ht64 = _reference_for(case)
    for who, (o_x, ht_x) in (("cula", (o, ht)), ("fla", (o_fla, ht_fla))):
        assert_close(f"{who} o vs float64", o64, o_x, RATIO)
        assert_close(f"{who} final_state vs float64", ht64, ht_x, RATIO)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (sm_90)")
def test_no_initial_no_final_state():
    from cula.kda.forward import chunk_kda_fwd_sm90
    from cula.testing import assert_close

    case = (1, 130, 2, 2, None, False, False)
    q, k, v, g, beta, _, _, _ = _setup(case)
    o, ht = chunk_kda_fwd_sm90(q, k, v, g, beta, 128**-0.5, None, False)
    assert ht is None
    assert_close("o vs float64", _reference_for(case)[0], o, RATIO)
