"""KDA chunk recurrence storing the states, on SM90 (``cula/ops/kda/sm90/delta_h_states.py``): FLA's
``chunk_gated_delta_rule_fwd_h`` for the training backward's recompute.

CPU: every variant traces and compiles for sm_90a (WGMMA, TMA loads and stores, register reallocation, no spills, no
WGMMA serialisation; the stores by stmatrix); the launcher rejects bad shapes before any launch. GPU (``-m gpu``): h,
v_new and the final state against FLA 0.6.0's ``chunk_gated_delta_rule_fwd_h`` on FLA's intermediates (fixed and
packed with empty, one-token and partial chunks, GVA, both state layouts, with and without initial / final state,
NaN-poisoned outputs), bit for bit the h and v_new ``DeltaHFwdOStatesSm90`` writes beside o, and FLA's graph-mode
chunk list (h's rows past the real chunks untouched).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from cute_compile import assert_wgmma_kernel, compile_with_dumps, dump_script

from cula.testing import find_nvdisasm

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_kda_delta_h_kernel import CASES, RATIO, _case_id, _fla_intra, _setup  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

_VARIANTS = [
    {"dtype": "BFloat16", "varlen": vl, "has_h0": h0, "has_ht": ht, "state_v_first": vf}
    for vl, h0, ht, vf in ((False, True, False, False), (True, True, False, True), (True, False, True, False),
                           (False, False, True, True))
] + [{"dtype": "Float16", "varlen": True, "has_h0": True, "has_ht": False, "state_v_first": False}]  # fmt: skip

_COMPILE_SCRIPT = dump_script(
    "import cutlass\nfrom cula.ops.kda.sm90 import delta_h_states as M",
    """
    M._compile(getattr(cutlass, v["dtype"]), 3, v["varlen"], v["has_h0"], v["has_ht"], v["state_v_first"],
               extra_options=opts)
    """,
)


@pytest.fixture(scope="module")
def compiled_variants(tmp_path_factory):
    return compile_with_dumps(_COMPILE_SCRIPT, _VARIANTS, tmp_path_factory.mktemp("kda_delta_h_states"))


@pytest.mark.parametrize("idx", range(len(_VARIANTS)), ids=["-".join(map(str, v.values())) for v in _VARIANTS])
def test_variant_compiles_sm90a(compiled_variants, idx):
    res = compiled_variants[idx]
    assert_wgmma_kernel(res)
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        pytest.skip("nvdisasm not found: PTX checked, SASS not")
    sass = subprocess.run([nvdisasm, "-c", res["cubins"][0]], capture_output=True, text=True, check=True).stdout
    assert sass.count("HGMMA.64x64x16.F32") == 8  # GEMM1 (8 k-steps)
    assert sass.count("HGMMA.64x128x16.F32") == 4  # GEMM4, kg read MN-major
    # h (64 x 128 a warpgroup: 8 x4 stmatrix a thread) and a full chunk's v_new (64 x 64: 4), then TMA stores
    assert len(re.findall(r"\bSTSM\.16\.", sass)) == 12 and "UTMASTG" in sass and "UTMALDG" in sass
    assert not re.search(r"\b(LDL|STL)\b", sass), "local-memory traffic (spills)"
    regs = max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)) + 1
    assert regs <= 232, regs  # the consumer budget after setmaxnreg


def test_launcher_validates_shapes():
    from cula.ops.kda.sm90.delta_h_states import chunk_kda_fwd_h_sm90 as run

    x = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    g = torch.zeros(1, 8, 2, 128)
    with pytest.raises(ValueError, match="K = V = 128"):
        run(x[..., :64], x[..., :64], x[..., :64], g[..., :64])
    with pytest.raises(ValueError, match="bf16 or fp16"):
        run(x.float(), x.float(), x.float(), g)
    with pytest.raises(ValueError, match="gk"):
        run(x, x, x, g.bfloat16())
    with pytest.raises(ValueError, match="w"):
        run(x, x[:, :4], x, g)
    with pytest.raises(ValueError, match="initial_state"):
        run(x, x, x, g, initial_state=torch.zeros(1, 2, 128, 64))
    with pytest.raises(ValueError, match="batch size"):
        run(*(t.expand(2, -1, -1, -1).contiguous() for t in (x, x, x, g)),
            cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))  # fmt: skip
    with pytest.raises(ValueError, match="chunk_size"):
        run(x, x, x, g, chunk_size=32)


def test_no_tokens_passes_the_state_through():
    from cula.ops.kda.sm90.delta_h_states import chunk_kda_fwd_h_sm90 as run

    x = torch.zeros(1, 0, 2, 128, dtype=torch.bfloat16)
    h0 = torch.randn(2, 2, 128, 128)
    cu = torch.tensor([0, 0, 0], dtype=torch.int32)
    h, v_new, ht = run(x, x, x, x.float(), initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert h.shape == (1, 0, 2, 128, 128) and v_new.shape == x.shape and torch.equal(ht, h0)


# ----------------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------------


# every other case also returns the final state (each variant is compiled on the device the first time)
STATE_CASES = [(c, i % 2 == 1) for i, c in enumerate(CASES)]


@pytest.mark.parametrize("case,with_ht", STATE_CASES,
                         ids=[_case_id(c) + ("-ht" if ht else "") for c, ht in STATE_CASES])  # fmt: skip
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (sm_90)")
def test_states_vs_fla_and_the_output_kernel(case, with_ht):
    """h, v_new (and the final state) against FLA's chunk_gated_delta_rule_fwd_h on FLA's intermediates, NaN-poisoned
    outputs; h and v_new the bits DeltaHFwdOStatesSm90 writes beside o (the same products and rounding points)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

    from cula.kda.forward import _state_outputs
    from cula.ops.kda.sm90.delta_h_fwd_o import chunk_kda_delta_h_fwd_o_sm90
    from cula.ops.kda.sm90.delta_h_states import chunk_kda_fwd_h_sm90
    from cula.testing import assert_close, poisoned_allocations

    q, k, v, g, beta, h0, cu, vf = _setup(case)
    ci, cul, g_cum, w, u, qg, kg, Aqk = _fla_intra(q, k, v, g, beta, cu)
    args = dict(k=kg, w=w, u=u, gk=g_cum, initial_state=h0, output_final_state=with_ht, chunk_size=64,
                state_v_first=vf, cu_seqlens=cul, chunk_indices=ci)  # fmt: skip
    h_ref, vn_ref, ht_ref = chunk_gated_delta_rule_fwd_h(**args)
    with poisoned_allocations():
        h, v_new, ht = chunk_kda_fwd_h_sm90(**args)
        # the output kernel's states variant on the same inputs (Aqk's upper triangle zero, as it requires)
        stored = _state_outputs(u, cu, ci)
        o = torch.empty_like(u)
    lower = torch.tril(torch.ones(64, 64, dtype=torch.bool, device="cuda"))
    pos = torch.arange(Aqk.shape[1], device="cuda")
    if cu is not None:
        pos = pos - cu[:-1].long().repeat_interleave((cu[1:] - cu[:-1]).long())
    A_causal = Aqk.masked_fill(~lower[pos % 64][None, :, None, :], 0.0)
    chunk_kda_delta_h_fwd_o_sm90(
        w, u, kg, qg, g_cum, A_causal, o, h0, None, cu, scale=128**-0.5, state_v_first=vf, aqk_causal=True,
        h=stored["h"], v_new=stored["v_new"], chunk_offsets=stored["offsets"],
    )  # fmt: skip
    torch.cuda.synchronize()
    assert h.shape == h_ref.shape and h.dtype == h_ref.dtype and v_new.shape == vn_ref.shape
    assert not torch.isnan(h).any() and not torch.isnan(v_new).any(), "left unwritten"
    assert_close("h vs fla", h_ref.float(), h.float(), RATIO)
    assert_close("v_new vs fla", vn_ref.float(), v_new.float(), RATIO)
    assert torch.equal(h.view(torch.int16), stored["h"].view(torch.int16)), "h vs DeltaHFwdOStatesSm90"
    assert torch.equal(v_new.view(torch.int16), stored["v_new"].view(torch.int16)), "v_new vs DeltaHFwdOStatesSm90"
    assert (ht is None) == (not with_ht)
    if with_ht:
        assert_close("final_state vs fla", ht_ref, ht, RATIO)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (sm_90)")
def test_states_on_flas_graph_mode_chunk_list():
    """FLA's graph mode: the static chunk list (rows past the real chunks are sentinels) and its chunk offsets, with
    cu_seqlens padded by empty sequences: h's real rows as FLA's, the rows no sequence owns not written."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.utils.index import prepare_chunk_indices_static

    from cula.ops.kda.sm90.delta_h_states import chunk_kda_fwd_h_sm90
    from cula.testing import assert_close, make_cu_seqlens, poisoned_allocations

    lens = [70, 0, 65, 1, 0, 0]
    q, k, v, g, beta, h0, _, vf = _setup((1, 0, 2, 2, lens, True, False))
    cu = make_cu_seqlens(lens, device="cuda")
    ci, cul, g_cum, w, u, qg, kg, Aqk = _fla_intra(q, k, v, g, beta, cu)
    static, offsets = prepare_chunk_indices_static(cu_seqlens=cul, chunk_size=64, nt_max=-(-136 // 64) + len(lens) - 1)
    args = dict(k=kg, w=w, u=u, gk=g_cum, initial_state=h0, chunk_size=64, state_v_first=vf, cu_seqlens=cul)
    h_ref, vn_ref, _ = chunk_gated_delta_rule_fwd_h(**args, chunk_indices=ci)
    with poisoned_allocations():
        h, v_new, _ = chunk_kda_fwd_h_sm90(**args, chunk_indices=static, chunk_offsets=offsets)
    torch.cuda.synchronize()
    real = ci.shape[0]
    assert h.shape[1] == static.shape[0] and torch.isnan(h[:, real:]).all(), "rows no sequence owns are untouched"
    assert_close("h vs fla", h_ref.float(), h[:, :real].float(), RATIO)
    assert_close("v_new vs fla", vn_ref.float(), v_new.float(), RATIO)
