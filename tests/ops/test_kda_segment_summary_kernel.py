"""KDA time-parallel first pass on SM90 (``cula/ops/kda/sm90/segment_summary.py``): every segment's end state E and
transition R in one launch.

CPU: every variant traces and compiles for sm_90a with WGMMA, TMA and register reallocation, no spills and no WGMMA
serialisation; the launcher rejects bad shapes before any launch. GPU (``-m gpu``): E and R against a float64
recurrence over the same w / u / kg / g (the kernel's contract), for packed segments with a partial last chunk, an
empty segment, both state layouts; NaN-poisoned outputs.
"""

from __future__ import annotations


import pytest
import torch
from cute_compile import assert_wgmma_kernel, compile_with_dumps, dump_script

from cula.testing import assert_close, make_cu_seqlens

_VARIANTS = [{"dtype": "BFloat16", "state_v_first": vf} for vf in (False, True)] + [
    {"dtype": "Float16", "state_v_first": False},
    # the first halves' summaries too (KdaTuning.time_split_halves)
    {"dtype": "BFloat16", "state_v_first": True, "mid_states": True},
    # Gated DeltaNet's raw k and factor rows (GdnTuning.inference_row_factors)
    {"dtype": "BFloat16", "state_v_first": False, "row_factors": True},
    {"dtype": "BFloat16", "state_v_first": True, "mid_states": True, "row_factors": True},
    # ... with T diag(beta) and the raw v (GdnTuning.inference_wy_in_recurrence)
    {"dtype": "BFloat16", "state_v_first": True, "mid_states": True, "row_factors": True, "wy_in_recurrence": True},
]

_COMPILE_SCRIPT = dump_script(
    "from cula.ops.kda.sm90 import segment_summary_kernel as M",
    'M._compile(v["dtype"], v["state_v_first"], extra_options=opts, mid_states=v.get("mid_states", False),'
    ' row_factors=v.get("row_factors", False), wy_in_recurrence=v.get("wy_in_recurrence", False))',
)


@pytest.fixture(scope="module")
def compiled_variants(tmp_path_factory):
    return compile_with_dumps(_COMPILE_SCRIPT, _VARIANTS, tmp_path_factory.mktemp("kda_segment_summary"))


@pytest.mark.parametrize("idx", range(len(_VARIANTS)), ids=["-".join(map(str, v.values())) for v in _VARIANTS])
def test_variant_compiles_sm90a(compiled_variants, idx):
    assert_wgmma_kernel(compiled_variants[idx])


def test_launcher_validates_shapes():
    from cula.ops.kda.sm90.segment_summary import chunk_kda_segment_summary_sm90 as run

    T, HV = 200, 2
    w = torch.zeros(1, T, HV, 128, dtype=torch.bfloat16)
    g = torch.zeros(1, T, HV, 128)
    cu = make_cu_seqlens([128, 72])
    ends = torch.zeros(2, 2 * HV, 128, 128)
    with pytest.raises(ValueError, match="ends"):
        run(w, w, w, g, torch.zeros(2, HV, 128, 128), cu)
    with pytest.raises(ValueError, match="g:"):
        run(w, w, w, g.bfloat16(), ends, cu)
    with pytest.raises(ValueError, match="int32"):
        run(w, w, w, g, ends, cu.long())
    with pytest.raises(ValueError, match="packed"):
        run(w.view(2, 100, HV, 128), w, w, g, ends, cu)
    # row_factors: raw k of H heads dividing HV, the factor rows in g's place
    k = torch.zeros(1, T, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="g:"):
        run(w, w, k, g, ends, cu, row_factors=True)
    with pytest.raises(ValueError, match="divide"):
        run(w, w, torch.zeros(1, T, 3, 128, dtype=torch.bfloat16), torch.zeros(1, T, HV, 4), ends, cu,
            row_factors=True)  # fmt: skip
    # wy_in_recurrence: T diag(beta) [1, T, HV, 64] in w's place, with the factor rows only
    with pytest.raises(ValueError, match="w:"):
        run(w, w, k, torch.zeros(1, T, HV, 4), ends, cu, row_factors=True, wy_in_recurrence=True)
    with pytest.raises(ValueError, match="row_factors"):
        run(w[..., :64].contiguous(), w, w, g, ends, cu, wy_in_recurrence=True)


def _summary_f64(w, u, kg, g, cu, state_v_first):
    """E and R of every segment in float64, with the kernel's bf16 copies of the state for both products' sake
    left out (the comparison's tolerance covers them)."""
    W, U, KG, G = (t[0].double() for t in (w, u, kg, g))
    M, HV, D = cu.numel() - 1, w.shape[2], w.shape[3]
    E = torch.zeros(M, HV, D, D, dtype=torch.float64)
    R = torch.zeros(M, HV, D, D, dtype=torch.float64)
    bounds = cu.tolist()
    for n in range(M):
        S = torch.zeros(HV, D, D, dtype=torch.float64)
        P = torch.eye(D, dtype=torch.float64).expand(HV, D, D).clone()
        for c in range(bounds[n], bounds[n + 1], 64):
            r = slice(c, min(c + 64, bounds[n + 1]))
            decay = torch.exp2(G[r.stop - 1])[:, :, None]
            S = decay * S + torch.einsum("lhk,lhv->hkv", KG[r], U[r] - torch.einsum("lhk,hkv->lhv", W[r], S))
            P = decay * P - torch.einsum("lhk,lhv->hkv", KG[r], torch.einsum("lhk,hkv->lhv", W[r], P))
        E[n], R[n] = S, P
    if state_v_first:
        E, R = E.transpose(-1, -2), R.transpose(-1, -2)
    return E, R


@pytest.mark.gpu
@pytest.mark.parametrize("mid_states", [False, True], ids=["ends", "ends-and-mids"])
@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
def test_summary_vs_f64_cuda(state_v_first, mid_states):
    """E and R of every segment (and with ``mids`` of every segment's first half, ``half_bounds``: E = 0 and R = I
    for the empty first halves of the empty and one-token segments) against float64; poisoned outputs."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from cula.ops.kda.sm90.segment_summary import chunk_kda_segment_summary_sm90 as run
    from cula.time_split import half_bounds

    torch.manual_seed(0)
    lengths = [256, 64 * 3 + 17, 0, 1, 128]
    HV, D, T = 3, 128, sum(lengths)
    # w and kg small enough that the transitions stay well conditioned over a few chunks, as the intra stage's are
    w, kg = ((0.05 * torch.randn(1, T, HV, D, device="cuda")).bfloat16() for _ in range(2))
    u = torch.randn(1, T, HV, D, device="cuda").bfloat16()
    g = -0.3 * torch.rand(1, T, HV, D, device="cuda")  # chunk-local cumsum stand-in: any values <= 0 will do
    cu = make_cu_seqlens(lengths, device="cuda")
    M = len(lengths)
    out = torch.full((M, 2 * HV, D, D), float("nan"), device="cuda")
    mids = torch.full_like(out, float("nan")) if mid_states else None
    run(w, u, kg, g, out, cu, state_v_first=state_v_first, mids=mids)
    torch.cuda.synchronize()
    E, R = _summary_f64(w.cpu(), u.cpu(), kg.cpu(), g.cpu(), cu.cpu(), state_v_first)
    assert not out.isnan().any()
    assert_close("E", E.float(), out[:, :HV].cpu(), 5e-3)
    assert_close("R", R.float(), out[:, HV:].cpu(), 5e-3)
    if mid_states:
        halves = torch.tensor(half_bounds(cu.tolist()), dtype=torch.int32)
        E2, R2 = _summary_f64(w.cpu(), u.cpu(), kg.cpu(), g.cpu(), halves, state_v_first)
        assert not mids.isnan().any()
        assert_close("E of the first halves", E2[0::2].float(), mids[:, :HV].cpu(), 5e-3)
        assert_close("R of the first halves", R2[0::2].float(), mids[:, HV:].cpu(), 5e-3)


def test_no_tokens_gives_zero_and_identity():
    """Segments with no tokens at all (no TMA descriptor can describe them): E is zero, R the identity, with
    nothing launched."""
    from cula.ops.kda.sm90.segment_summary import chunk_kda_segment_summary_sm90 as run

    w, g = torch.zeros(1, 0, 2, 128, dtype=torch.bfloat16), torch.zeros(1, 0, 2, 128)
    out = torch.full((2, 4, 128, 128), float("nan"))
    run(w, w, w, g, out, make_cu_seqlens([0, 0]))
    assert not out[:, :2].any() and torch.equal(out[:, 2:], torch.eye(128).expand(2, 2, 128, 128))
