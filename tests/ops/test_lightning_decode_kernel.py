"""Lightning decode kernel on SM90 (``cula/ops/lightning/sm90/decode.py``): state pool, T tokens per sequence.

CPU: every variant (state layout x head size, plus io dtype and cache-hint extras) traces and compiles for
sm_90a in one subprocess with ptxas remarks on; ptxas reports no spills and no more registers than the variant's
resident warps per SM leave (128 at the default 16). The lane maps of every configuration cover each state element
exactly once. GPU (``-m gpu`` on an H100/H200): outputs and states against a float64 recurrence (relative RMSE <
5e-3), NaN-poisoned outputs, every element of the pool rows a sequence owns rewritten, padded slots and unreferenced
pool rows untouched bit for bit, GVA, both layouts, D = 64 and 128, decay 0 and 5, the persistent grid walking many
units per warp, and 2,000 consecutive steps.
Kernel times: ``benchmarks/kernel_report.py lightning-decode``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from cute_compile import compile_variants

from cula.testing import assert_close, assert_rows_rewritten

HAS_CUDA = torch.cuda.is_available()
RATIO = 5e-3

# ----------------------------------------------------------------------------------------------------
# CPU: compile every variant once, in a subprocess (ptxas remarks need the env var before cutlass import)
# ----------------------------------------------------------------------------------------------------

_BASE = {
    "io_dtype": "bfloat16",
    "K": 128,
    "state_v_first": True,
    "load_hint": None,  # default_load_hint: none, or no_allocate for [K, V] pools with K=64
    "store_hint": "default",
}


def _variant(**kw):
    v = dict(_BASE)
    v.update(kw)
    return v


_VARIANTS = [_variant(state_v_first=vf, K=K) for vf in (True, False) for K in (128, 64)] + [
    _variant(io_dtype="float16"),
    _variant(io_dtype="float16", state_v_first=False, K=64),
    _variant(load_hint="no_allocate", store_hint="default"),
    _variant(load_hint="streaming", store_hint="streaming"),
    _variant(load_hint="no_allocate", store_hint="no_allocate"),
    _variant(state_v_first=False, load_hint="default", store_hint="streaming"),
    # one warp per CTA (each a work unit of its own): [V, K] pools and [K, V] ones with K=64
    _variant(warps_per_cta=1),
    _variant(K=64, warps_per_cta=1),
    _variant(state_v_first=False, K=64, warps_per_cta=1),
    # half the state a lane ([V, K] pools): single_token_tile (20 one-warp CTAs per SM); 24 fit without spills too
    _variant(warps_per_cta=1, state_regs=32, warps_per_sm=20),
    _variant(K=64, warps_per_cta=1, state_regs=32, warps_per_sm=20),
    _variant(warps_per_cta=1, state_regs=32, warps_per_sm=24),
    _variant(state_regs=32, warps_per_sm=20),
    # the column kernel for [K, V] pools (kv_cols): boxes of 4, 1 and 2 warps, 12 warps per SM
    _variant(state_v_first=False, cols=True, warps_per_cta=4, warps_per_sm=12),
    _variant(state_v_first=False, cols=True, warps_per_cta=1, warps_per_sm=12),
    _variant(state_v_first=False, K=64, cols=True, warps_per_cta=2, warps_per_sm=12),
]

@pytest.fixture(scope="module")
def compiled_variants():
    """{variant index: (registers, spill store bytes, compile seconds, cached)} from one compile run."""
    return compile_variants("cula.ops.lightning.sm90.decode:compiled_variant", [dict(v, V=v["K"]) for v in _VARIANTS])


def _vid(v):
    return "-".join(
        [v["io_dtype"], f"K{v['K']}", "vk" if v["state_v_first"] else "kv", f"ld_{v['load_hint']}",
         f"st_{v['store_hint']}"]
        + [f"{k}{v[k]}" for k in ("warps_per_cta", "state_regs", "warps_per_sm", "cols") if k in v]
    )


@pytest.mark.parametrize("i", range(len(_VARIANTS)), ids=[_vid(v) for v in _VARIANTS])
def test_variant_compiles_without_spills(compiled_variants, i):
    regs, spill, _sec, cached = compiled_variants[i]
    assert spill == 0, f"{_vid(_VARIANTS[i])}: {spill} bytes spilled ({regs} registers)"
    cap = 65536 // (32 * _VARIANTS[i].get("warps_per_sm", 16))
    assert regs <= cap, f"{_vid(_VARIANTS[i])}: {regs} registers would cost occupancy"
    assert cached, "the second lookup of the same variant must hit cula.cache"


def test_config_rejects_unsupported():
    from cutlass import BFloat16

    from cula.ops.lightning.sm90.decode import LightningDecodeSm90

    kw = {"io_dtype": BFloat16, "state_v_first": True}
    with pytest.raises(ValueError, match="K must be"):
        LightningDecodeSm90(K=96, V=128, **kw)
    with pytest.raises(ValueError, match="V must be a multiple of 64"):
        LightningDecodeSm90(K=128, V=96, **kw)
    with pytest.raises(ValueError, match="load_hint"):
        LightningDecodeSm90(K=128, V=128, load_hint="nc", **kw)
    with pytest.raises(ValueError, match="store_hint"):
        LightningDecodeSm90(K=128, V=128, store_hint="evict", **kw)
    with pytest.raises(ValueError, match="warps_per_sm"):
        LightningDecodeSm90(K=128, V=128, warps_per_sm=10, **kw)
    with pytest.raises(ValueError, match="warps_per_cta must be 1 or 4"):
        LightningDecodeSm90(K=128, V=128, warps_per_cta=2, **kw)
    with pytest.raises(ValueError, match="cols is for"):
        LightningDecodeSm90(K=128, V=128, cols=True, **kw)
    with pytest.raises(ValueError, match="cols is for"):
        LightningDecodeSm90(io_dtype=BFloat16, K=128, V=64, state_v_first=False, cols=True, warps_per_cta=4)
    box = LightningDecodeSm90(io_dtype=BFloat16, K=128, V=128, state_v_first=False, cols=True, warps_per_cta=4,
                              warps_per_sm=12)  # fmt: skip
    assert (box.tile_v, box.units_per_head, box.units_per_cta, box.min_blocks_per_sm) == (128, 1, 1, 3)
    assert box.ctas_needed(3, 5) == 15
    with pytest.raises(ValueError, match="state_regs must be 64, or 32"):
        LightningDecodeSm90(io_dtype=BFloat16, K=128, V=128, state_v_first=False, state_regs=32)
    with pytest.raises(ValueError, match="warps_per_cta must be 4"):
        LightningDecodeSm90(io_dtype=BFloat16, K=128, V=128, state_v_first=False, warps_per_cta=1)
    one = LightningDecodeSm90(K=128, V=128, warps_per_cta=1, **kw)
    assert one.min_blocks_per_sm == 16 and one.ctas_needed(1, 64) == 512


def _lane_elements(cfg, sub, warp, lane):
    """(row, inner) pool-tile coordinates of one lane's 64 state registers, as the kernel computes them."""
    l_in, l_out = lane % cfg.lanes_in, lane // cfg.lanes_in
    if cfg.state_v_first:
        row0 = sub * cfg.rows_per_unit + l_out * cfg.R
        inner0 = l_in * cfg.VEC
    else:
        row0 = (warp if cfg.warps_per_unit > 1 else 0) * cfg.lanes_out * cfg.R + l_out * cfg.R
        inner0 = sub * cfg.slice_v + l_in * cfg.VEC
    return [
        (row0 + r, inner0 + c + j * cfg.chunk_stride)
        for r in range(cfg.R)
        for j in range(cfg.C)
        for c in range(cfg.VEC)
    ]


@pytest.mark.parametrize(
    "state_v_first,state_regs", [(True, 64), (False, 64), (True, 32)], ids=["vk", "kv", "vk-32regs"]
)
@pytest.mark.parametrize("K", [128, 64])
def test_lane_maps_partition_the_tile(state_v_first, state_regs, K):
    """Each tile element belongs to one lane, loads cover whole lines, o reduces over the right lanes."""
    from cutlass import BFloat16

    from cula.ops.lightning.sm90.decode import LightningDecodeSm90

    V = K
    cfg = LightningDecodeSm90(io_dtype=BFloat16, K=K, V=V, state_v_first=state_v_first, state_regs=state_regs)
    rows, inner = (V, K) if state_v_first else (K, V)
    seen = torch.zeros(rows, inner, dtype=torch.int32)
    for sub in range(cfg.units_per_head):
        for warp in range(cfg.warps_per_unit):
            for lane in range(32):
                elems = _lane_elements(cfg, sub, warp, lane)
                assert len(elems) == cfg.state_regs
                for r, i in elems:
                    seen[r, i] += 1
                # each 4-vector is 16-byte aligned in the tile
                assert all(i % cfg.VEC == 0 for _, i in elems[:: cfg.VEC])
    assert torch.equal(seen, torch.ones_like(seen))
    # coalescing: one load instruction (fixed r, j) of a warp covers whole 128-byte segments of rows
    for warp in range(cfg.warps_per_unit):
        for r, j in itertools.product(range(cfg.R), range(cfg.C)):
            touched = {}
            for lane in range(32):
                row, i = _lane_elements(cfg, 0, warp, lane)[(r * cfg.C + j) * cfg.VEC]
                touched.setdefault(row, set()).add(i)
            for cols in touched.values():
                assert len(cols) * cfg.VEC * 4 >= 128 and min(cols) % 32 == 0
    # o: v-first reduces over the L_in lanes of a row group (xor of the low lane bits), [K, V] over the
    # L_out groups (xor of the high bits): lanes sharing an output column must differ only in those bits
    reduce_mask = (cfg.lanes_in - 1) if state_v_first else (31 & ~(cfg.lanes_in - 1))
    for lane in range(32):
        for other in range(32):
            a = _lane_elements(cfg, 0, 0, lane)
            b = _lane_elements(cfg, 0, 0, other)
            out_a = {x[0] for x in a} if state_v_first else {x[1] for x in a}
            out_b = {x[0] for x in b} if state_v_first else {x[1] for x in b}
            same_group = (lane & ~reduce_mask) == (other & ~reduce_mask)
            assert (out_a == out_b) == same_group


def test_default_tile(lightning_tuning):
    """single_token_tile for T=1 [V, K] calls, kv_cols for T=1 [K, V] calls with K=128 whose V its box divides
    and whose N x HV reach kv_cols_min_states, the 4-warp tile otherwise; the column kernel never runs the
    persistent grid."""
    from cula.lightning.plan import LIGHTNING_TUNING, default_tile

    tile = (4, 16, 64, False)
    assert default_tile(True, 1) == (*LIGHTNING_TUNING.get((9, 0)).single_token_tile, False)
    assert default_tile(True, 2) == tile
    t = lightning_tuning(kv_cols=(4, 3))
    many, few = t.kv_cols_min_states, t.kv_cols_min_states - 1
    assert default_tile(False, 1, 128) == default_tile(False, 1, 128, 128, many) == (4, 12, 64, True)
    assert default_tile(False, 1, 128, 128, few) == tile
    assert default_tile(False, 1, 128, 64, many) == tile
    assert default_tile(False, 1, 64) == default_tile(False, 2, 128) == tile
    lightning_tuning(kv_cols=None)
    assert default_tile(False, 1, 128, 128, many) == tile


def test_grid_sizes():
    from cutlass import BFloat16

    from cula.ops.lightning.sm90.decode import LightningDecodeSm90

    vk = LightningDecodeSm90(io_dtype=BFloat16, K=128, V=128, state_v_first=True)
    kv = LightningDecodeSm90(io_dtype=BFloat16, K=128, V=128, state_v_first=False)
    # N=1, HV=64: 512 warp units in 128 CTAs ([V, K]); 128 CTA units of 4 warps ([K, V])
    assert vk.units(1, 64) == 512 and vk.ctas_needed(1, 64) == 128
    assert kv.units(1, 64) == 128 and kv.ctas_needed(1, 64) == 128
    assert vk.min_blocks_per_sm == kv.min_blocks_per_sm == 4
    assert vk.ctas_needed(3, 5) == (3 * 5 * 8 + 3) // 4


# ----------------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------------


def _requires_sm90():
    if not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU (H100/H200)")


def _reference(q, k, v, decay, S0, scale):
    """float64 recurrence. S0 ``[N, HV, K, V]``; returns o ``[N, T, HV, V]`` and the final state."""
    G = v.shape[2] // q.shape[2]
    q, k = (x.double().repeat_interleave(G, dim=2) for x in (q, k))
    v = v.double()
    a = torch.exp(-decay.double())[None, :, None, None]
    S = S0.double().clone()
    o = torch.empty(v.shape, dtype=torch.float64, device=v.device)
    for t in range(q.shape[1]):
        S = a * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = scale * torch.einsum("nhk,nhkv->nhv", q[:, t], S)
    return o, S


def _decays(kind, HV, gen):
    if kind == "zero":
        return torch.zeros(HV, device="cuda")
    if kind == "five":
        return torch.full((HV,), 5.0, device="cuda")
    return torch.rand(HV, device="cuda", generator=gen) * 2.0  # "mixed": a different rate per head


def _run_case(
    N,
    T,
    H,
    HV,
    D,
    *,
    state_v_first=True,
    decay="mixed",
    dtype=torch.bfloat16,
    pad=True,
    pool_slice=False,
    all_padded=False,
    scale=None,
    **hints,
):
    from cula.lightning.plan import lightning_decode_sm90

    _requires_sm90()
    gen = torch.Generator(device="cuda").manual_seed(N * 1000 + T * 100 + HV)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q = rnd(N, T, H, D).to(dtype)
    k = (rnd(N, T, H, D) * D**-0.5).to(dtype)  # |k| ~ 1 keeps the state's scale steady over T
    v = rnd(N, T, HV, D).to(dtype)
    dec = _decays(decay, HV, gen)
    P = N + 5
    if pool_slice:  # pool rows interleaved with another buffer: dim-0 stride 2 * HV * D * D
        big = rnd(P, 2, HV, D, D)
        pool = big[:, 0]
        other_before = big[:, 1].clone()
    else:
        pool = rnd(P, HV, D, D)
    perm = torch.randperm(P, device="cuda", generator=gen)[:N].to(torch.int32)
    if pad and N > 1:
        perm[1::3] = -1  # padded slots
    if all_padded:
        perm[:] = -7
    indices = perm.contiguous()
    pool_before = pool.clone()
    out = torch.full((N, T, HV, D), float("nan"), device="cuda", dtype=dtype)
    scale = D**-0.5 if scale is None else scale

    lightning_decode_sm90(q, k, v, dec, pool, indices, out, scale=scale, state_v_first=state_v_first, **hints)
    torch.cuda.synchronize()

    active = indices >= 0
    rows = indices[active].long()
    untouched = torch.ones(P, dtype=torch.bool, device="cuda")
    untouched[rows] = False
    if active.any():
        S0 = pool_before[rows]
        if state_v_first:
            S0 = S0.transpose(-1, -2)
        ref_o, ref_S = _reference(q[active], k[active], v[active], dec, S0, scale)
        if state_v_first:
            ref_S = ref_S.transpose(-1, -2)
        assert_close("o", ref_o, out[active], RATIO)
        assert_close("final state", ref_S, pool[rows], RATIO)
        assert_rows_rewritten("final state", pool, pool_before, rows, ref=ref_S)
    if (~active).any():
        assert torch.equal(out[~active], torch.zeros_like(out[~active])), "padded output rows must be zero"
    assert torch.equal(pool[untouched], pool_before[untouched]), "padded or unreferenced pool rows changed"
    if pool_slice:
        assert torch.equal(big[:, 1], other_before), "the rows between pool rows changed"


@pytest.mark.gpu
@pytest.mark.parametrize("state_v_first", [True, False], ids=["vk", "kv"])
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("decay", ["zero", "five"])
@pytest.mark.parametrize("T", [1, 3])
def test_decode_matches_reference(state_v_first, D, decay, T):
    _run_case(13, T, 2, 4, D, state_v_first=state_v_first, decay=decay)


_CASES = [
    {"N": 1, "T": 1, "H": 64, "HV": 64, "D": 128},  # serving N=1: 64 heads, no padding
    {"N": 1, "T": 1, "H": 64, "HV": 64, "D": 128, "state_v_first": False},
    {"N": 7, "T": 8, "H": 2, "HV": 16, "D": 128},  # GVA 8, full MTP verify window
    {"N": 7, "T": 8, "H": 2, "HV": 16, "D": 64, "state_v_first": False},
    {"N": 9, "T": 2, "H": 1, "HV": 6, "D": 128, "pool_slice": True},  # GVA 6 (not a power of two)
    {"N": 9, "T": 2, "H": 1, "HV": 6, "D": 128, "pool_slice": True, "state_v_first": False},
    {"N": 5, "T": 1, "H": 1, "HV": 1, "D": 64},  # a single head
    {"N": 5, "T": 1, "H": 1, "HV": 1, "D": 128, "state_v_first": False},
    {"N": 4, "T": 12, "H": 2, "HV": 2, "D": 128},  # more tokens than the API allows: nothing breaks
    {"N": 6, "T": 2, "H": 2, "HV": 4, "D": 128, "dtype": torch.float16},
    {"N": 6, "T": 2, "H": 2, "HV": 4, "D": 64, "dtype": torch.float16, "state_v_first": False},
    {"N": 6, "T": 1, "H": 2, "HV": 4, "D": 128, "all_padded": True},
    {"N": 6, "T": 1, "H": 2, "HV": 4, "D": 128, "all_padded": True, "state_v_first": False},
    {"N": 6, "T": 2, "H": 2, "HV": 4, "D": 128, "scale": 1.0},
    # far more units than resident warps (132 SMs x 16), padded slots among them: the defaults (one CTA per unit
    # group at T=1, the persistent grid walking the units with a grid stride at T=2), then each case the other way
    {"N": 700, "T": 1, "H": 4, "HV": 16, "D": 128},
    {"N": 700, "T": 2, "H": 4, "HV": 16, "D": 128, "state_v_first": False},
    {"N": 700, "T": 1, "H": 4, "HV": 16, "D": 64},
    {"N": 700, "T": 1, "H": 4, "HV": 16, "D": 64, "state_v_first": False},
    {"N": 700, "T": 1, "H": 4, "HV": 16, "D": 128, "persistent": True},
    {"N": 700, "T": 2, "H": 4, "HV": 16, "D": 128, "state_v_first": False, "persistent": False},
    {"N": 700, "T": 1, "H": 4, "HV": 16, "D": 64, "persistent": True},
    {"N": 700, "T": 1, "H": 4, "HV": 16, "D": 64, "state_v_first": False, "persistent": True},
    # one-warp CTAs (SINGLE_WARP_CTAS), both grids
    {"N": 700, "T": 1, "H": 4, "HV": 16, "D": 128, "warps_per_cta": 1},
    {"N": 700, "T": 1, "H": 4, "HV": 16, "D": 64, "warps_per_cta": 1},
    {"N": 700, "T": 1, "H": 4, "HV": 16, "D": 64, "state_v_first": False, "warps_per_cta": 1},
    {"N": 700, "T": 2, "H": 4, "HV": 16, "D": 128, "warps_per_cta": 1},
    {"N": 1, "T": 1, "H": 64, "HV": 64, "D": 128, "warps_per_cta": 1},
    {"N": 700, "T": 1, "H": 4, "HV": 16, "D": 128, "warps_per_cta": 4},
    # 32 state values a lane ([V, K] pools), 24 warps per SM
    {"N": 700, "T": 1, "H": 4, "HV": 16, "D": 128, "warps_per_cta": 1, "state_regs": 32, "warps_per_sm": 24},
    {"N": 700, "T": 1, "H": 4, "HV": 16, "D": 64, "warps_per_cta": 1, "state_regs": 32, "warps_per_sm": 24},
    {"N": 700, "T": 2, "H": 4, "HV": 16, "D": 128, "warps_per_cta": 1, "state_regs": 32, "warps_per_sm": 24},
    {"N": 1, "T": 1, "H": 64, "HV": 64, "D": 128, "warps_per_cta": 1, "state_regs": 32, "warps_per_sm": 24},
    {"N": 9, "T": 3, "H": 1, "HV": 6, "D": 128, "pool_slice": True, "state_regs": 32, "warps_per_sm": 24},
    # the column kernel for [K, V] pools (kv_cols; one CTA a box, also at T > 1)
    *({"N": 700, "T": T, "H": 4, "HV": 16, "D": D, "state_v_first": False, "cols": True, "warps_per_cta": w,
       "warps_per_sm": 12} for T, D, w in ((1, 128, 4), (1, 128, 1), (3, 128, 2), (1, 64, 2), (2, 64, 1))),
    {"N": 1, "T": 1, "H": 64, "HV": 64, "D": 128, "state_v_first": False, "cols": True, "warps_per_cta": 4,
     "warps_per_sm": 12},
    {"N": 9, "T": 2, "H": 1, "HV": 6, "D": 128, "pool_slice": True, "state_v_first": False, "cols": True,
     "warps_per_cta": 4, "warps_per_sm": 12},
    {"N": 6, "T": 1, "H": 2, "HV": 4, "D": 128, "all_padded": True, "state_v_first": False, "cols": True,
     "warps_per_cta": 4, "warps_per_sm": 12},
    # cache hints change no result
    {"N": 33, "T": 2, "H": 2, "HV": 8, "D": 128, "load_hint": "default", "store_hint": "streaming"},
    {"N": 33, "T": 2, "H": 2, "HV": 8, "D": 128, "load_hint": "streaming", "store_hint": "no_allocate",
     "state_v_first": False},
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", _CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_decode_cases(case):
    case = dict(case)
    _run_case(case.pop("N"), case.pop("T"), case.pop("H"), case.pop("HV"), case.pop("D"), **case)


@pytest.mark.gpu
@pytest.mark.parametrize("state_v_first", [True, False], ids=["vk", "kv"])
def test_long_decode_tracks_float64(state_v_first):
    """2,000 consecutive T=1 steps (H=HV=2) stay within 5e-3 of the float64 recurrence."""
    from cula.lightning.plan import lightning_decode_sm90

    _requires_sm90()
    steps, H, HV, D = 2000, 2, 2, 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(steps, 1, H, D, device="cuda", generator=gen).to(torch.bfloat16)
    k = (torch.randn(steps, 1, H, D, device="cuda", generator=gen) * D**-0.5).to(torch.bfloat16)
    v = torch.randn(steps, 1, HV, D, device="cuda", generator=gen).to(torch.bfloat16)
    # slow decays (memories of ~100 and ~1000 steps) so rounding errors could pile up
    dec = torch.tensor([1e-2, 1e-3], device="cuda")
    pool = torch.zeros(3, HV, D, D, device="cuda")
    indices = torch.tensor([1], dtype=torch.int32, device="cuda")
    outs = torch.full((steps, 1, HV, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    before = pool.clone()
    for i in range(steps):
        lightning_decode_sm90(q[i : i + 1], k[i : i + 1], v[i : i + 1], dec, pool, indices, outs[i : i + 1],
                              scale=D**-0.5, state_v_first=state_v_first)
        if i == 0:  # every element of the row moved (the later steps are checked through o and the last state)
            _, first = _reference(q[:1], k[:1], v[:1], dec, torch.zeros(1, HV, D, D, device="cuda"), D**-0.5)
            first = first.transpose(-1, -2) if state_v_first else first
            assert_rows_rewritten("state after the first step", pool, before, [1], ref=first)
    torch.cuda.synchronize()
    seq = lambda x: x.transpose(0, 1)  # the whole run as one sequence of 2,000 tokens
    ref_o, ref_S = _reference(seq(q), seq(k), seq(v), dec,
                              torch.zeros(1, HV, D, D, device="cuda", dtype=torch.float64), D**-0.5)
    final = pool[1].transpose(-1, -2) if state_v_first else pool[1]
    assert_close("outputs over 2k steps", seq(ref_o)[:, 0], outs[:, 0], RATIO)
    assert_close("state after 2k steps", ref_S[0], final, RATIO)
    for i in range(0, steps, 500):  # and no stretch of the run drifts
        assert_close(f"outputs {i}..{i + 499}", seq(ref_o)[i : i + 500, 0], outs[i : i + 500, 0], RATIO)
    assert torch.equal(pool[0], torch.zeros_like(pool[0])) and torch.equal(pool[2], torch.zeros_like(pool[2]))
