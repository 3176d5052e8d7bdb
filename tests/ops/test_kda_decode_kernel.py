"""KDA decode kernel on SM90 (``cula/ops/kda/sm90/decode.py``): state pool, T = 1..8 tokens, step states.

CPU: every variant (gate kind x state layout x K x step_states, plus dtype/flag extras) traces and compiles
for sm_90a in one subprocess with ptxas remarks on, and ptxas reports no spills and at most 128 registers
(the kernel asks for 4 CTAs of 128 threads per SM). T, N, H, HV and the pool size are run-time values, so one
compiled variant serves T = 1 and T = 4 alike. GPU (``-m gpu`` on an H100/H200): outputs and states against a
float64 recurrence (relative RMSE < 5e-3), NaN-poisoned outputs, every element of the pool rows a sequence owns
rewritten (``assert_rows_rewritten``), padded slots and unreferenced pool rows untouched bit for bit, step_states
mode leaving the pool alone, GVA, both layouts, and 10,000 consecutive decode steps tracking the float64 recurrence.
Kernel times: ``benchmarks/kernel_report.py kda-decode``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cute_compile import compile_variants

from cula.testing import assert_close, assert_rows_rewritten

HAS_CUDA = torch.cuda.is_available()
RATIO = 5e-3

# ----------------------------------------------------------------------------------------------------
# CPU: compile every variant once, in a subprocess (ptxas remarks need the env var before cutlass import)
# ----------------------------------------------------------------------------------------------------

_BASE = {
    "io_dtype": "bfloat16",
    "g_dtype": "float32",
    "beta_dtype": "float32",
    "K": 128,
    "gate": "softplus",
    "has_a_log": True,
    "has_dt_bias": True,
    "use_qk_l2norm": True,
    "beta_sigmoid": True,
    "allow_neg_eigval": False,
    "state_v_first": False,
    "has_step_states": False,
}


def _variant(**kw):
    v = dict(_BASE)
    v.update(kw)
    if v["gate"] == "none":
        v.update(has_a_log=False, has_dt_bias=False)
    return v


_VARIANTS = [
    _variant(gate=gate, state_v_first=vf, K=K, has_step_states=st)
    for gate in ("softplus", "lower_bound", "none")
    for vf in (False, True)
    for K in (128, 64)
    for st in (False, True)
] + [
    _variant(io_dtype="float16"),
    _variant(g_dtype="bfloat16", beta_dtype="bfloat16"),
    _variant(gate="lower_bound", has_a_log=False, has_dt_bias=False),
    _variant(use_qk_l2norm=False, beta_sigmoid=False),
    _variant(allow_neg_eigval=True, beta_dtype="float16", state_v_first=True),
    _variant(gate="none", g_dtype="bfloat16", has_step_states=True, state_v_first=True),
    # the wide lane tile, [K, V] pools and [V, K] ones (Gated DeltaNet's serving layout and gate)
    _variant(gate="lower_bound", wide_kv=True),
    _variant(gate="softplus", has_step_states=True, wide_kv=True),
    _variant(gate="softplus", g_dtype="bfloat16", beta_dtype="bfloat16", state_v_first=True, per_head_gate=True,
             wide_kv=True),
    _variant(state_v_first=True, has_step_states=True, wide_kv=True),
    # single_token_cta: one token slot per warp, 20 or 24 warps per SM in CTAs of 4 or 1
    _variant(gate="lower_bound", g_dtype="bfloat16", beta_dtype="bfloat16", state_v_first=True, tokens_per_round=1,
             min_blocks_per_sm=5),
    _variant(gate="lower_bound", g_dtype="bfloat16", beta_dtype="bfloat16", state_v_first=True, tokens_per_round=1,
             min_blocks_per_sm=6),
    _variant(gate="softplus", K=64, tokens_per_round=1, min_blocks_per_sm=6),
    _variant(gate="lower_bound", g_dtype="bfloat16", beta_dtype="bfloat16", state_v_first=True, tokens_per_round=1,
             warps_per_cta=1, min_blocks_per_sm=20),
    _variant(gate="softplus", K=64, state_v_first=True, tokens_per_round=1, warps_per_cta=1, min_blocks_per_sm=20),
    _variant(gate="none", tokens_per_round=1, warps_per_cta=1, min_blocks_per_sm=20),
    # kv_tma: [K, V] pools through shared memory by TMA, 4 (kv_tma_min_blocks) or 5 CTAs per SM
    _variant(gate="softplus", tokens_per_round=1, min_blocks_per_sm=4, kv_tma=True),
    _variant(gate="softplus", tokens_per_round=1, min_blocks_per_sm=5, kv_tma=True),
    _variant(gate="lower_bound", g_dtype="bfloat16", beta_dtype="bfloat16", tokens_per_round=1, min_blocks_per_sm=5,
             kv_tma=True),
    # kv_cols: [K, V] boxes in shared memory, a state column a lane; 12 warps per SM, any T in rounds
    _variant(gate="lower_bound", g_dtype="bfloat16", beta_dtype="bfloat16", tokens_per_round=1, warps_per_cta=4,
             min_blocks_per_sm=3, kv_cols=True),
    _variant(gate="softplus", tokens_per_round=1, warps_per_cta=1, min_blocks_per_sm=12, kv_cols=True),
    _variant(gate="none", K=64, tokens_per_round=2, warps_per_cta=2, min_blocks_per_sm=6, kv_cols=True),
    # Gated DeltaNet's gate: one per token and value head (g [N, T, HV], dt_bias [HV])
    _variant(gate="softplus", state_v_first=True, per_head_gate=True),
    _variant(gate="softplus", g_dtype="bfloat16", state_v_first=True, tokens_per_round=1, warps_per_cta=1,
             min_blocks_per_sm=20, per_head_gate=True),
    _variant(gate="none", tokens_per_round=1, warps_per_cta=1, min_blocks_per_sm=12, kv_cols=True, per_head_gate=True),
]
# ptxas spills allowed where a variant asks for more registers than it is given (bytes): the wide tile parks one
# 8-byte value with step states; 20 and 24 resident warps per SM cap the kernel at 96 and 80 registers
_SPILL_ALLOWED = {"wide": 8, 20: 32, 24: 64}

@pytest.fixture(scope="module")
def compiled_variants():
    """{variant index: (registers, spill store bytes, compile seconds, cached)} from one compile run."""
    return compile_variants("cula.ops.kda.sm90.decode:compiled_variant", [dict(v, V=v["K"]) for v in _VARIANTS])


def _vid(v):
    return "-".join(
        [v["io_dtype"], "g" + v["g_dtype"], "b" + v["beta_dtype"], f"K{v['K']}", v["gate"]]
        + (["A"] if v["has_a_log"] else [])
        + (["dtb"] if v["has_dt_bias"] else [])
        + (["l2"] if v["use_qk_l2norm"] else [])
        + (["sig"] if v["beta_sigmoid"] else [])
        + (["neg"] if v["allow_neg_eigval"] else [])
        + (["vk"] if v["state_v_first"] else ["kv"])
        + (["steps"] if v["has_step_states"] else [])
        + (["wide"] if v.get("wide_kv") else [])
        + (["tma"] if v.get("kv_tma") else [])
        + (["cols"] if v.get("kv_cols") else [])
        + (["head-gate"] if v.get("per_head_gate") else [])
        + ([f"slots{v['tokens_per_round']}"] if "tokens_per_round" in v else [])
        + ([f"{v['warps_per_cta']}warps"] if "warps_per_cta" in v else [])
        + ([f"{v['min_blocks_per_sm']}ctas"] if v.get("min_blocks_per_sm") else [])
    )


@pytest.mark.parametrize("i", range(len(_VARIANTS)), ids=[_vid(v) for v in _VARIANTS])
def test_variant_compiles_without_spills(compiled_variants, i):
    regs, spill, _sec, cached = compiled_variants[i]
    v = _VARIANTS[i]
    wide = v.get("wide_kv", False)
    ctas = v.get("min_blocks_per_sm") or (3 if wide else 4)
    warps = ctas * v.get("warps_per_cta", 4)
    allowed = _SPILL_ALLOWED.get("wide" if wide else warps, 0)
    assert spill <= allowed, f"{_vid(v)}: {spill} bytes spilled"
    # 4 CTAs of 128 threads per SM by default; the wide_kv variant holds twice the state and runs 3
    cap = 65536 // (32 * warps)
    assert regs <= cap, f"{_vid(_VARIANTS[i])}: {regs} registers would cost occupancy"
    assert cached, "the second lookup of the same variant must hit cula.cache"


def test_config_rejects_unsupported():
    from cutlass import BFloat16, Float32

    from cula.ops.kda.sm90.decode import KdaDecodeBoxSm90, KdaDecodeSm90

    kw = {
        "io_dtype": BFloat16,
        "g_dtype": Float32,
        "beta_dtype": Float32,
        "V": 128,
        "gate": "softplus",
        "has_a_log": True,
        "has_dt_bias": False,
        "use_qk_l2norm": False,
        "beta_sigmoid": False,
        "allow_neg_eigval": False,
        "state_v_first": False,
        "has_step_states": False,
    }
    with pytest.raises(ValueError, match="K must be"):
        KdaDecodeSm90(K=96, **kw)
    with pytest.raises(ValueError, match="wide_kv is for"):
        KdaDecodeSm90(K=64, wide_kv=True, **kw)
    with pytest.raises(ValueError, match="softplus gate needs A_log"):
        KdaDecodeSm90(K=128, **dict(kw, has_a_log=False))
    with pytest.raises(ValueError, match="gate must be"):
        KdaDecodeSm90(K=128, **dict(kw, gate="sigmoid"))
    with pytest.raises(ValueError, match="V must be a multiple"):
        KdaDecodeSm90(K=64, **dict(kw, V=72))
    for bad in ({"has_step_states": True}, {"V": 96, "warps_per_cta": 2}, {"wide_kv": True},
                {"kv_tma": True, "tokens_per_round": 1}, {"state_v_first": True}):  # fmt: skip
        with pytest.raises(ValueError, match="kv_cols is for"):
            KdaDecodeBoxSm90(K=128, kv_cols=True, **dict(kw, **bad))
    cols = KdaDecodeBoxSm90(K=128, kv_cols=True, warps_per_cta=4, **kw)
    assert (cols.tile_v, cols.v_slices, cols.lanes_k, cols.min_blocks_per_sm) == (128, 4, 1, 3)


# ----------------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------------


def _reference(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    S0,
    *,
    scale,
    gate,
    lower_bound,
    use_qk_l2norm,
    beta_sigmoid,
    allow_neg_eigval,
    all_states=True,
):
    """float64 recurrence. S0 [N, HV, K, V]; returns o [N, T, HV, V] and the states [N, T, HV, K, V]
    (only the last one, [N, 1, HV, K, V], unless ``all_states``)."""
    N, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    q, k = (x.double().repeat_interleave(G, dim=2) for x in (q, k))
    v, g, beta = v.double(), g.double(), beta.double()
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * scale
    if gate != "none":
        x = g + (dt_bias.double().view(HV, K) if dt_bias is not None else 0.0)
        if gate == "softplus":
            g = -A_log.double().exp().view(HV, 1) * F.softplus(x)
        else:
            a = A_log.double().exp().view(HV, 1) if A_log is not None else 1.0
            g = lower_bound * torch.sigmoid(a * x)
    if beta_sigmoid:
        beta = torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)
    S = S0.double().clone()
    o = torch.empty(N, T, HV, V, dtype=torch.float64, device=q.device)
    states = torch.empty(N, T if all_states else 1, HV, K, V, dtype=torch.float64, device=q.device)
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("nhk,nhkv->nhv", k[:, t], S))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        o[:, t] = torch.einsum("nhk,nhkv->nhv", q[:, t], S)
        if all_states:
            states[:, t] = S
    if not all_states:
        states[:, 0] = S
    return o, states


def _inputs(
    N,
    T,
    H,
    HV,
    K,
    V,
    *,
    gate,
    dtype=torch.bfloat16,
    g_dtype=torch.float32,
    beta_dtype=torch.float32,
    has_a_log=True,
    has_dt_bias=True,
    use_qk_l2norm=True,
    beta_sigmoid=True,
    g_shift=0.0,
    seed=0,
):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q = rnd(N, T, H, K).to(dtype)
    k = rnd(N, T, H, K)
    if not use_qk_l2norm:  # keep the delta rule contractive: |k| ~ 1
        k = F.normalize(k, dim=-1)
    k = k.to(dtype)
    v = rnd(N, T, HV, V).to(dtype)
    if gate == "none":
        g = -F.softplus(rnd(N, T, HV, K) - 2.0)  # log-space decay in (-inf, 0)
    else:
        g = rnd(N, T, HV, K) * 2.0 + g_shift
    g = g.to(g_dtype)
    beta = rnd(N, T, HV)
    if not beta_sigmoid:
        beta = torch.sigmoid(beta)
    beta = beta.to(beta_dtype)
    A_log = (
        (torch.rand(HV, device="cuda", generator=gen) * 2.0 - 1.0) if has_a_log and gate != "none" else None
    )
    dt_bias = rnd(HV * K) * 0.5 if has_dt_bias and gate != "none" else None
    return q, k, v, g, beta, A_log, dt_bias


def _requires_sm90():
    if not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU (H100/H200)")


def _run_case(
    N,
    T,
    H,
    HV,
    K,
    V,
    *,
    gate="softplus",
    state_v_first=False,
    use_step_states=False,
    dtype=torch.bfloat16,
    g_dtype=torch.float32,
    beta_dtype=torch.float32,
    has_a_log=True,
    has_dt_bias=True,
    use_qk_l2norm=True,
    beta_sigmoid=True,
    allow_neg_eigval=False,
    pad=True,
    pool_slice=False,
):
    from cula.kda.plan import kda_decode_sm90

    _requires_sm90()
    q, k, v, g, beta, A_log, dt_bias = _inputs(
        N,
        T,
        H,
        HV,
        K,
        V,
        gate=gate,
        dtype=dtype,
        g_dtype=g_dtype,
        beta_dtype=beta_dtype,
        has_a_log=has_a_log,
        has_dt_bias=has_dt_bias,
        use_qk_l2norm=use_qk_l2norm,
        beta_sigmoid=beta_sigmoid,
    )
    P = N + 5
    inner = (V, K) if state_v_first else (K, V)
    if pool_slice:  # pool rows interleaved with another buffer: dim-0 stride 2 * HV * K * V
        big = torch.randn(P, 2, HV, *inner, device="cuda") * 0.3
        pool = big[:, 0]
        other_before = big[:, 1].clone()
    else:
        pool = torch.randn(P, HV, *inner, device="cuda") * 0.3
    perm = torch.randperm(P, device="cuda")[:N].to(torch.int32)
    if pad and N > 1:
        perm[1::3] = -1  # padded slots
    indices = perm.contiguous()
    pool_before = pool.clone()
    out = torch.full((N, T, HV, V), float("nan"), device="cuda", dtype=dtype)
    step = torch.full((N, T, HV, *inner), float("nan"), device="cuda") if use_step_states else None
    lower_bound = -5.0 if gate == "lower_bound" else None
    scale = K**-0.5

    kda_decode_sm90(
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        pool,
        indices,
        out,
        scale=scale,
        gate=gate,
        lower_bound=lower_bound,
        use_qk_l2norm=use_qk_l2norm,
        beta_sigmoid=beta_sigmoid,
        allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first,
        step_states=step,
    )
    torch.cuda.synchronize()

    active = indices >= 0
    rows = indices[active].long()
    S0 = pool_before[rows]
    if state_v_first:
        S0 = S0.transpose(-1, -2)
    sel = lambda x: x[active]
    ref_o, ref_states = _reference(
        sel(q),
        sel(k),
        sel(v),
        sel(g),
        sel(beta),
        A_log,
        dt_bias,
        S0,
        scale=scale,
        gate=gate,
        lower_bound=lower_bound,
        use_qk_l2norm=use_qk_l2norm,
        beta_sigmoid=beta_sigmoid,
        allow_neg_eigval=allow_neg_eigval,
    )
    if state_v_first:
        ref_states = ref_states.transpose(-1, -2)

    assert_close("o", ref_o, out[active], RATIO)
    if (~active).any():
        assert torch.equal(out[~active], torch.zeros_like(out[~active])), "padded output rows must be zero"
    untouched = torch.ones(P, dtype=torch.bool, device="cuda")
    if use_step_states:
        assert_close("step_states", ref_states, step[active], RATIO)
        assert torch.isnan(step[~active]).all(), "step_states of padded slots must be untouched"
        assert torch.equal(pool, pool_before), "step_states mode must not write the pool"
    else:
        assert_close("final state", ref_states[:, -1], pool[rows], RATIO)
        assert_rows_rewritten("final state", pool, pool_before, rows, ref=ref_states[:, -1])
        untouched[rows] = False
        assert torch.equal(pool[untouched], pool_before[untouched]), "unreferenced pool rows changed"
    if pool_slice:
        assert torch.equal(big[:, 1], other_before), "the rows between pool rows changed"


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["softplus", "lower_bound", "none"])
@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("K", [128, 64])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("use_step_states", [False, True], ids=["pool", "steps"])
def test_decode_matches_reference(gate, state_v_first, K, T, use_step_states):
    _run_case(13, T, 2, 4, K, K, gate=gate, state_v_first=state_v_first, use_step_states=use_step_states)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [
        {"N": 1, "T": 1, "H": 64, "HV": 64},  # serving N=1: 64 heads, no padding
        {"N": 7, "T": 8, "H": 2, "HV": 16},  # GVA 8, full MTP verify
        {"N": 5, "T": 3, "H": 4, "HV": 4, "state_v_first": True, "use_step_states": True},
        {"N": 9, "T": 2, "H": 1, "HV": 6, "pool_slice": True},  # GVA 6 (not a power of two), strided pool
        {"N": 4, "T": 11, "H": 2, "HV": 2},  # T above the 8 shared-memory slots: a second round
        {"N": 6, "T": 2, "H": 2, "HV": 4, "dtype": torch.float16, "beta_dtype": torch.float16},
        {
            "N": 6,
            "T": 2,
            "H": 2,
            "HV": 4,
            "g_dtype": torch.bfloat16,
            "beta_dtype": torch.bfloat16,
            "state_v_first": True,
        },
        {"N": 6, "T": 2, "H": 2, "HV": 4, "gate": "lower_bound", "has_a_log": False, "has_dt_bias": False},
        {"N": 6, "T": 2, "H": 2, "HV": 4, "use_qk_l2norm": False, "beta_sigmoid": False},
        {"N": 6, "T": 2, "H": 2, "HV": 4, "allow_neg_eigval": True},
        {
            "N": 6,
            "T": 1,
            "H": 2,
            "HV": 4,
            "K": 64,
            "V": 64,
            "gate": "none",
            "state_v_first": True,
            "use_step_states": True,
        },
    ],
    ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()),
)
def test_decode_cases(case):
    case = dict(case)
    K = case.pop("K", 128)
    V = case.pop("V", 128)
    _run_case(case.pop("N"), case.pop("T"), case.pop("H"), case.pop("HV"), K, V, **case)


@pytest.mark.gpu
@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
def test_long_decode_tracks_float64(state_v_first):
    """10,000 consecutive T=1 steps (H=HV=2) stay within 5e-3 of the float64 recurrence."""
    from cula.kda.plan import kda_decode_sm90

    _requires_sm90()
    steps, H, HV, K, V = 10_000, 2, 2, 128, 128
    # gates near 1 (softplus of ~ -6): a memory of hundreds of steps, so rounding errors could pile up
    q, k, v, g, beta, A_log, dt_bias = _inputs(steps, 1, H, HV, K, V, gate="softplus", g_shift=-6.0, seed=1)
    inner = (V, K) if state_v_first else (K, V)
    pool = torch.zeros(3, HV, *inner, device="cuda")
    indices = torch.tensor([1], dtype=torch.int32, device="cuda")
    outs = torch.full((steps, 1, HV, V), float("nan"), device="cuda", dtype=torch.bfloat16)
    flags = dict(gate="softplus", lower_bound=None, use_qk_l2norm=True, beta_sigmoid=True, allow_neg_eigval=False)
    before = pool.clone()
    for i in range(steps):
        kda_decode_sm90(
            q[i : i + 1],
            k[i : i + 1],
            v[i : i + 1],
            g[i : i + 1],
            beta[i : i + 1],
            A_log,
            dt_bias,
            pool,
            indices,
            outs[i : i + 1],
            scale=K**-0.5,
            state_v_first=state_v_first,
            **flags,
        )
        if i == 0:  # every element of the row moved (the later steps are checked through o and the last state)
            _, first = _reference(*(x[:1] for x in (q, k, v, g, beta)), A_log, dt_bias,
                                  torch.zeros(1, HV, K, V, device="cuda"), scale=K**-0.5, all_states=False,
                                  **flags)  # fmt: skip
            first = first[:, 0].transpose(-1, -2) if state_v_first else first[:, 0]
            assert_rows_rewritten("state after the first step", pool, before, [1], ref=first)
    torch.cuda.synchronize()
    # the whole run as one sequence of 10,000 tokens through the float64 recurrence
    seq = lambda x: x.transpose(0, 1)
    ref_o, ref_states = _reference(
        seq(q),
        seq(k),
        seq(v),
        seq(g),
        seq(beta),
        A_log,
        dt_bias,
        torch.zeros(1, HV, K, V, device="cuda", dtype=torch.float64),
        scale=K**-0.5,
        gate="softplus",
        lower_bound=None,
        use_qk_l2norm=True,
        beta_sigmoid=True,
        allow_neg_eigval=False,
        all_states=False,
    )
    final = pool[1].transpose(-1, -2) if state_v_first else pool[1]
    assert_close("outputs over 10k steps", seq(ref_o)[:, 0], outs[:, 0], RATIO)
    assert_close("state after 10k steps", ref_states[0, 0], final, RATIO)
    for i in range(0, steps, 1000):  # and no stretch of the run drifts
        assert_close(f"outputs {i}..{i + 999}", seq(ref_o)[i : i + 1000, 0], outs[i : i + 1000, 0], RATIO)
    assert torch.equal(pool[0], torch.zeros_like(pool[0])) and torch.equal(pool[2], torch.zeros_like(pool[2]))


def _assert_pool_rows_and_padding(pool0, pool, out, indices):
    """Pool rows outside the batch untouched bit for bit, padded slots' outputs zeroed; returns (live pool rows,
    padded mask)."""
    live = indices[indices >= 0].long()
    untouched = torch.ones(pool0.shape[0], dtype=torch.bool, device="cuda")
    untouched[live] = False
    assert torch.equal(pool[untouched].view(torch.int32), pool0[untouched].view(torch.int32))
    padded = indices < 0
    assert torch.equal(out[padded], torch.zeros_like(out[padded]))
    return live, padded


def _padded_pool_case(N, T, H, HV, K):
    """Inputs (lower_bound gate), a pool of N + 7 states and N random rows of it, every third one padded (-1)."""
    tensors = _inputs(N, T, H, HV, K, K, gate="lower_bound")
    pool0 = torch.randn(N + 7, HV, K, K, device="cuda") * 0.3
    indices = torch.randperm(N + 7, device="cuda")[:N].to(torch.int32)
    if N > 1:
        indices[1::3] = -1
    return tensors, pool0, indices


def _live_final_states(tensors, pool0, indices, state_v_first):
    """The live slots' pool rows and their float64 final states in the pool's layout, for a lower_bound-gate call
    on ``_padded_pool_case``'s inputs: the reference ``assert_rows_rewritten`` excuses rounding against (the runs
    these tests compare with each other could leave the same element unwritten)."""
    q, k, v, g, beta, A_log, dt_bias = tensors
    live = indices >= 0
    rows = indices[live].long()
    S0 = pool0[rows].transpose(-1, -2) if state_v_first else pool0[rows]
    _, states = _reference(
        *(x[live] for x in (q, k, v, g, beta)), A_log, dt_bias, S0, scale=q.shape[-1] ** -0.5, gate="lower_bound",
        lower_bound=-5.0, use_qk_l2norm=True, beta_sigmoid=True, allow_neg_eigval=False, all_states=False,
    )  # fmt: skip
    return rows, (states[:, 0].transpose(-1, -2) if state_v_first else states[:, 0])


def _t1_runs(settings, N, HV, V, state_v_first):
    """``_padded_pool_case`` at T=1 (H=4, K=128, the pool and v cut to V columns) run through ``kda_decode_sm90``
    once under each dict of ``KdaTuning`` fields in ``settings``, outputs NaN-poisoned first, and checks that each
    run rewrote every element of the live rows; returns (pool0, indices, [(out, pool) per setting])."""
    from cula.kda.plan import KDA_TUNING, kda_decode_sm90

    H, K = 4, 128
    (q, k, v, g, beta, A_log, dt_bias), pool0, indices = _padded_pool_case(N, 1, H, HV, K)
    v = v[..., :V].contiguous()
    pool0 = (pool0[:, :, :V] if state_v_first else pool0[..., :V]).contiguous()
    results = []
    for tuning in settings:
        pool = pool0.clone()
        out = torch.full((N, 1, HV, V), float("nan"), device="cuda", dtype=torch.bfloat16)
        with KDA_TUNING.override(**tuning):
            kda_decode_sm90(
                q, k, v, g, beta, A_log, dt_bias, pool, indices, out, scale=K**-0.5, gate="lower_bound",
                lower_bound=-5.0, use_qk_l2norm=True, beta_sigmoid=True, allow_neg_eigval=False,
                state_v_first=state_v_first,
            )  # fmt: skip
        torch.cuda.synchronize()
        results.append((out, pool))
    rows, ref = _live_final_states((q, k, v, g, beta, A_log, dt_bias), pool0, indices, state_v_first)
    for tuning, (_, pool) in zip(settings, results):
        assert_rows_rewritten(f"pool under {tuning}", pool, pool0, rows, ref=ref)
    return pool0, indices, results


def _assert_t1_runs_match(pool0, indices, results):
    """The second of two ``_t1_runs`` against the first: outputs and pool to fp32 summation order, every output
    written, padded slots zeroed, pool rows not in the batch untouched bit for bit."""
    (o0, p0), (o1, p1) = results
    assert not torch.isnan(o1).any()
    live, padded = _assert_pool_rows_and_padding(pool0, p1, o1, indices)
    assert_close("out", o0[~padded], o1[~padded], 2e-3)
    assert_close("pool", p0[live], p1[live], 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "N,T,K,steps,vf", [(1, 1, 128, False, False), (64, 1, 128, False, False), (300, 1, 128, False, False),
                       (64, 4, 128, True, False), (33, 3, 128, False, False), (2000, 1, 128, False, False),
                       (64, 1, 128, False, True), (64, 4, 128, False, True), (33, 3, 128, True, True)],
)  # fmt: skip
def test_wide_kv_matches(N, T, K, steps, vf):
    """The wide lane tile against the default tile on a [K, V] pool, or a [V, K] one (``vf``): the same results up
    to fp32 summation order (outputs, pool, step states), padded slots and rows of other sequences untouched bit for
    bit."""
    from cula.kda.plan import KDA_TUNING, kda_decode_sm90

    _requires_sm90()
    H, HV = 4, 16
    (q, k, v, g, beta, A_log, dt_bias), pool0, indices = _padded_pool_case(N, T, H, HV, K)
    results = []
    for wide in (False, True):
        pool = pool0.clone()
        out = torch.full((N, T, HV, K), float("nan"), device="cuda", dtype=torch.bfloat16)
        step = torch.full((N, T, HV, K, K), float("nan"), device="cuda") if steps else None
        # no TMA or column box: T=1 would take one either way, and MTP calls the column box
        with KDA_TUNING.override(kv_tma=False, kv_cols=None, multi_token_kv_cols=None, wide_kv=wide,
                                 wide_vk_min_tokens=1 if wide else None):  # fmt: skip
            kda_decode_sm90(
                q, k, v, g, beta, A_log, dt_bias, pool, indices, out, scale=K**-0.5, gate="lower_bound",
                lower_bound=-5.0, use_qk_l2norm=True, beta_sigmoid=True, allow_neg_eigval=False, state_v_first=vf,
                step_states=step,
            )  # fmt: skip
        torch.cuda.synchronize()
        results.append((out, pool, step))
    (o0, p0, s0), (o1, p1, s1) = results
    if not steps:  # (with step states the pool is left alone)
        rows, ref = _live_final_states((q, k, v, g, beta, A_log, dt_bias), pool0, indices, vf)
        assert_rows_rewritten("pool (default tile)", p0, pool0, rows, ref=ref)
        assert_rows_rewritten("pool (wide tile)", p1, pool0, rows, ref=ref)
    live, padded = _assert_pool_rows_and_padding(pool0, p1, o1, indices)
    assert_close("out", o0[~padded], o1[~padded], 2e-3)
    assert_close("pool", p0[live], p1[live], 1e-5)
    if steps:
        assert_close("step states", s0[~padded], s1[~padded], 1e-5)
        assert torch.isnan(s1[padded]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("N,HV,V", [(1, 16, 128), (64, 16, 128), (77, 8, 64), (1000, 4, 128)])
def test_kv_tma_matches(N, HV, V):
    """kv_tma ([K, V] pool boxes by TMA) at T=1 against the narrow tile (which the tests above hold to the
    float64 recurrence): outputs and pool to fp32 summation order, NaN-poisoned outputs all written, padded slots
    zeroed, pool rows not in the batch untouched bit for bit."""
    _requires_sm90()
    settings = [{"kv_tma": tma, "wide_kv": False, "kv_cols": None} for tma in (False, True)]
    _assert_t1_runs_match(*_t1_runs(settings, N, HV, V, state_v_first=False))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "N,HV,V,cols",
    [
        (N, HV, V, cols)
        for N, HV, V in [(1, 16, 128), (64, 16, 128), (77, 8, 64), (1000, 4, 128)]
        for cols in [(4, 3), (2, 6), (1, 12)]
        if V % (32 * cols[0]) == 0  # the box is 32 x warps columns wide
    ],
    ids=str,
)
def test_kv_cols_matches(N, HV, V, cols):
    """kv_cols ([K, V] boxes in shared memory, a state column a lane) at T=1 against the narrow tile: outputs and
    pool to fp32 summation order, NaN-poisoned outputs all written, padded slots zeroed, other pool rows untouched."""
    _requires_sm90()
    settings = [{"kv_tma": False, "wide_kv": False, "kv_cols": c, "kv_cols_min_states": 0} for c in (None, cols)]
    _assert_t1_runs_match(*_t1_runs(settings, N, HV, V, state_v_first=False))


@pytest.mark.gpu
@pytest.mark.parametrize("N,T,K,warps,slots", [(33, 3, 128, 2, 2), (64, 4, 128, 4, 4), (9, 5, 64, 1, 2),
                                               (64, 1, 128, 2, 1), (70, 4, 128, 2, 1)])  # fmt: skip
def test_kv_cols_tokens_match(N, T, K, warps, slots):
    """kv_cols with T tokens in rounds of ``slots`` against the narrow tile, through ``kda_decode_launcher``'s
    flags."""
    from cula.kda.plan import kda_decode_launcher

    _requires_sm90()
    H, HV = 4, 16
    (q, k, v, g, beta, A_log, dt_bias), pool0, indices = _padded_pool_case(N, T, H, HV, K)
    base = dict(io_dtype=q.dtype, g_dtype=g.dtype, beta_dtype=beta.dtype, K=K, V=K, gate="lower_bound",
                has_a_log=True, has_dt_bias=True, use_qk_l2norm=True, beta_sigmoid=True, allow_neg_eigval=False,
                state_v_first=False, has_step_states=False, wide_kv=False, tokens=T)  # fmt: skip
    results = []
    for extra in ({}, {"kv_cols": True, "warps_per_cta": warps, "tokens_per_round": slots,
                       "min_blocks_per_sm": 12 // warps}):  # fmt: skip
        pool = pool0.clone()
        out = torch.full((N, T, HV, K), float("nan"), device="cuda", dtype=torch.bfloat16)
        kda_decode_launcher(**base, **extra)(
            q, k, v, g, beta, A_log, dt_bias, pool, indices, out, None, K**-0.5, -5.0
        )
        torch.cuda.synchronize()
        results.append((out, pool))
    rows, ref = _live_final_states((q, k, v, g, beta, A_log, dt_bias), pool0, indices, False)
    for name, (_, pool) in zip(("narrow tile", "kv_cols"), results):
        assert_rows_rewritten(f"pool ({name})", pool, pool0, rows, ref=ref)
    _assert_t1_runs_match(pool0, indices, results)


@pytest.mark.gpu
@pytest.mark.parametrize("cta", [(4, 5), (4, 6), (1, 20), (1, 21)])
@pytest.mark.parametrize("N,state_v_first", [(1, True), (64, True), (300, True), (2000, True), (77, False)])
def test_single_token_occupancy_matches(N, state_v_first, cta):
    """single_token_cta (one token slot per warp; warps per CTA, CTAs per SM) against the 8-slot 4-warp variant at
    T=1: the same instructions on the same data, so the same bits (outputs and pool), padded slots zeroed and pool
    rows of other sequences untouched. [K, V] pools are checked with the narrow tile (the wide one is left alone)."""
    _requires_sm90()
    settings = [{"wide_kv": False, "kv_tma": False, "kv_cols": None, "single_token_cta": c} for c in (None, cta)]
    _pool0, _indices, results = _t1_runs(settings, N, 16, 128, state_v_first)
    (o0, p0), (o1, p1) = results
    # the bit comparisons below would match a NaN / Inf that both variants wrote
    assert torch.isfinite(o1).all() and torch.isfinite(p1).all()
    assert torch.equal(o0.view(torch.int16), o1.view(torch.int16))
    assert torch.equal(p0.view(torch.int32), p1.view(torch.int32))
