"""The decode entry points' call-signature cache (cula.backends.PlanCache), on the CPU.

A repeated ``kda_decode`` / ``lightning_decode`` call skips validation and backend selection; these tests check
that the cache never lets a call through that full validation would refuse, that the index check still runs,
that anything selection reads (dtypes, strides, alignment, CULA_BACKEND) starts a new plan, and that the
``cula-sm90`` fast launch passes the kernel exactly what the general path does. The kernels are stubbed here;
their numbers are tested on the GPU (tests/test_gpu_api.py, tests/ops/).
"""

from __future__ import annotations

import pytest
import torch

import cula.kda.decode as kd
import cula.lightning.decode as ld
from cula._validate import is_dense
from cula.backends import PlanCache, StepPlans, tensor_sig

N, H, HV, D, P = 3, 2, 4, 64, 6


def _kda_inputs(dtype=torch.float32, D=D):
    torch.manual_seed(0)
    q = torch.randn(N, 1, H, D, dtype=dtype)
    k = torch.randn(N, 1, H, D, dtype=dtype)
    v = torch.randn(N, 1, HV, D, dtype=dtype)
    g = torch.randn(N, 1, HV, D)
    beta = torch.randn(N, 1, HV)
    pool = torch.randn(P, HV, D, D) * 0.1
    idx = torch.tensor([4, -1, 0], dtype=torch.int32)
    return q, k, v, g, beta, pool, idx


def _lightning_inputs(dtype=torch.float32):
    torch.manual_seed(1)
    q = torch.randn(N, 1, H, D, dtype=dtype)
    k = torch.randn(N, 1, H, D, dtype=dtype)
    v = torch.randn(N, 1, HV, D, dtype=dtype)
    decay = torch.rand(HV)
    pool = torch.randn(P, HV, D, D) * 0.1
    idx = torch.tensor([2, 5, -1], dtype=torch.int32)
    return q, k, v, decay, pool, idx


@pytest.fixture
def counted_plans(monkeypatch):
    """Fresh plan caches and a count of full validations per module."""
    counts = {"kda": 0, "lightning": 0}
    for name, mod in (("kda", kd), ("lightning", ld)):
        monkeypatch.setattr(mod, "_plans", StepPlans())
        real = mod._plan

        def counted(*a, _real=real, _name=name, **kw):
            counts[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(mod, "_plan", counted)
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    return counts


def test_tensor_sig_reads_what_validation_reads():
    t = torch.zeros(2, 3, dtype=torch.float32)
    assert tensor_sig(t) == tensor_sig(torch.ones(2, 3))  # values do not matter
    assert tensor_sig(t) != tensor_sig(t.t().contiguous().t())  # strides do
    assert tensor_sig(t) != tensor_sig(t.to(torch.float64))
    assert tensor_sig(torch.zeros(16)[1:]) != tensor_sig(torch.zeros(15))  # 16-byte alignment does
    assert tensor_sig(t) != tensor_sig(torch.empty(2, 3, device="meta"))  # and the device, meta included
    assert tensor_sig(None) is None and tensor_sig([1, 2]) == (list,)
    cache = PlanCache(maxsize=2)
    for i in range(3):
        cache.put((i,), lambda i=i: i)
    assert len(cache) == 1 and cache.get((2,)) is not None  # cleared when full, never unbounded


def test_kda_decode_repeats_skip_validation_and_match_the_reference(counted_plans):
    q, k, v, g, beta, pool, idx = _kda_inputs()
    A_log = torch.randn(HV)
    ref_pool = pool.clone()
    outs = []
    for _ in range(3):  # three decode steps on the same signature
        outs.append(kd.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log))
    assert counted_plans["kda"] == 1
    for step in range(3):  # the same steps one by one through a fresh cache each time
        kd._plans.clear()
        o = kd.kda_decode(q, k, v, g, beta, ref_pool, idx, A_log=A_log)
        torch.testing.assert_close(o, outs[step], rtol=0, atol=0)
    torch.testing.assert_close(pool, ref_pool, rtol=0, atol=0)


def test_kda_decode_new_signatures_are_validated(counted_plans):
    q, k, v, g, beta, pool, idx = _kda_inputs()
    A_log = torch.randn(HV)
    kd.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log)
    with pytest.raises(ValueError, match="`g` must have shape"):
        kd.kda_decode(q, k, v, g[:, :, :2], beta, pool, idx, A_log=A_log)
    with pytest.raises(TypeError, match="`beta` must have dtype"):
        kd.kda_decode(q, k, v, g, beta.double(), pool, idx, A_log=A_log)
    with pytest.raises(ValueError, match="A_log"):  # None-ness of an optional tensor is in the signature
        kd.kda_decode(q, k, v, g, beta, pool, idx)
    with pytest.raises(TypeError, match="scale"):
        kd.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log, scale=torch.tensor(0.1))
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        kd.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log, allow_neg_eigval=True,
                      use_beta_sigmoid_in_kernel=False)  # fmt: skip
    # the host-side index check runs on every call, cached signature or not
    with pytest.raises(ValueError, match="out of range"):
        kd.kda_decode(q, k, v, g, beta, pool, torch.tensor([4, -1, P], dtype=torch.int32), A_log=A_log)
    kd.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log, check_indices=False, state_v_first=True, scale=0.5)
    assert len(kd._plans) == 2  # refused calls cache nothing


def test_kda_decode_backend_override_starts_a_new_plan(counted_plans, monkeypatch):
    from cula.backends import BackendUnavailableError

    q, k, v, g, beta, pool, idx = _kda_inputs()
    A_log = torch.randn(HV)
    kd.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log)
    monkeypatch.setenv("CULA_BACKEND", "cula-sm90")
    with pytest.raises(BackendUnavailableError):
        kd.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log)
    monkeypatch.setenv("CULA_BACKEND", "reference")
    kd.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log)
    assert counted_plans["kda"] == 3
    # the benchmarks record the backend a call takes: they forget the cached plans first
    from cula.backends import clear_plan_caches

    clear_plan_caches()
    assert len(kd._plans) == 0
    kd.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log)
    assert counted_plans["kda"] == 4


def test_forced_backend_follows_the_environment(monkeypatch):
    """Plan keys read CULA_BACKEND through CPython's mirror of the environment, which setting and deleting
    through os.environ (and monkeypatch) keep current."""
    from cula.backends import forced_backend

    monkeypatch.delenv("CULA_BACKEND", raising=False)
    assert forced_backend() is None
    monkeypatch.setenv("CULA_BACKEND", "reference")
    first = forced_backend()
    assert first is not None and first in (b"reference", "reference")
    monkeypatch.setenv("CULA_BACKEND", "fla")
    assert forced_backend() not in (None, first)
    monkeypatch.delenv("CULA_BACKEND")
    assert forced_backend() is None


@pytest.fixture
def fake_sm90(monkeypatch, pretend_sm90):
    """Make CPU tensors look like an SM90 device with the DSL installed; kernels record their arguments."""
    import cula.kda.plan as kplan
    import cula.lightning.plan as lplan
    import cula.ops.kda.sm90.decode as kops

    calls = []

    def entry(tokens: int):
        """A stand-in for a compiled entry: its first ``tokens`` arguments (the token tensors) with exact row-major
        strides (size-1 dims included), or refused before launching, as TVM-FFI refuses them."""

        def launch(*args):
            if not all(is_dense(a) for a in args[:tokens]):
                raise TypeError("Mismatched strides")
            calls.append(("launch", args))

        return launch

    def variant(**kw):
        calls.append(("variant", kw))
        return entry(5)  # q, k, v, g, beta

    monkeypatch.setattr(kops, "compiled_variant", variant)
    monkeypatch.setattr(kplan, "kda_decode_sm90", lambda *a, **kw: calls.append(("general", a, kw)))
    monkeypatch.setattr(lplan, "lightning_decode_launcher",
                        lambda q, v, **kw: (calls.append(("variant", kw)), entry(3))[1])  # fmt: skip
    monkeypatch.setattr(lplan, "lightning_decode_sm90", lambda *a, **kw: calls.append(("general", a, kw)))
    return calls


def test_kda_decode_fast_launch_passes_what_the_kernel_takes(counted_plans, fake_sm90):
    q, k, v, g, beta, pool, idx = _kda_inputs(torch.bfloat16)
    pool = pool.transpose(-1, -2).contiguous()  # [P, HV, V, K]
    A_log, dt_bias = torch.randn(HV), torch.randn(HV * D)
    for _ in range(2):
        kd.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, scale=0.25)
    assert counted_plans["kda"] == 1
    kinds = [c[0] for c in fake_sm90]
    assert kinds == ["variant", "launch", "launch"]
    kw = fake_sm90[0][1]
    assert kw["gate"] == "lower_bound" and kw["has_a_log"] and kw["has_dt_bias"] and kw["state_v_first"]
    args = fake_sm90[2][1]
    assert args[0] is q and args[5] is A_log and args[6] is dt_bias and args[7] is pool and args[8] is idx
    assert args[10] is None and args[11] == 0.25 and args[12] == -5.0
    # precomputed gate: the kernel gets no A_log / dt_bias, lower_bound 0.0 stands for None
    fake_sm90.clear()
    kd.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=False)
    args = fake_sm90[-1][1]
    assert fake_sm90[0][1]["gate"] == "none" and args[5] is None and args[6] is None and args[12] == 0.0
    assert args[11] == D**-0.5
    # an input that needs a dense copy takes the general path (which copies) on every call
    fake_sm90.clear()
    q_odd = torch.randn(N, 2, H, D, dtype=torch.bfloat16)[:, :1]
    for _ in range(2):
        kd.kda_decode(q_odd, k, v, g, beta, pool, idx, A_log=A_log)
    assert [c[0] for c in fake_sm90] == ["general", "general"]
    assert fake_sm90[0][1][0].is_contiguous() and fake_sm90[0][1][0] is not q_odd


def test_kda_decode_keys_on_shapes_where_the_kernel_entry_checks_the_rest(counted_plans, fake_sm90, monkeypatch):
    """A repeated kda_decode call on cula-sm90 reads only its short key (shapes, dtypes, flags), no tensor's full
    signature; a call with that key the entry refuses is validated in full (cula's error, nothing launched); the
    per-call checks (indices, scale) still run on the short path."""
    q, k, v, g, beta, pool, idx = _kda_inputs(torch.bfloat16)
    pool = pool.transpose(-1, -2).contiguous()
    A_log = torch.randn(HV)
    sigs = []
    real_sig = kd.tensor_sig
    monkeypatch.setattr(kd, "tensor_sig", lambda t: sigs.append(1) or real_sig(t))
    for _ in range(3):
        kd.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log)
    assert len(sigs) == 11 and counted_plans["kda"] == 1  # the first call's full key only
    assert [c[0] for c in fake_sm90].count("launch") == 3
    fake_sm90.clear()
    with pytest.raises(ValueError, match="out of range"):
        kd.kda_decode(q, k, v, g, beta, pool, torch.tensor([0, P, -1], dtype=torch.int32), A_log=A_log)
    with pytest.raises(ValueError, match="scale"):
        kd.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log, scale=float("nan"))
    k_odd = torch.randn(k.shape[0], 2, *k.shape[2:], dtype=k.dtype)[:, :1]  # same short key, refused by the entry
    kd.kda_decode(q, k_odd, v, g, beta, pool, idx, A_log=A_log)
    assert [c[0] for c in fake_sm90] == ["general"]


def test_decode_short_keys_hold_the_pool_strides(counted_plans, fake_sm90):
    """The compiled entries check no stride of a size-1 dim, so a one-row pool whose row stride changes (one a TMA
    descriptor could not take, 12 bytes) must not reuse the launch a contiguous one-row pool planned: kda_decode and
    lightning_decode plan it anew (and validation decides where it runs)."""
    q, k, v, g, beta, pool, _ = _kda_inputs(torch.bfloat16)
    pool = pool[:1].transpose(-1, -2).contiguous()  # one row, [1, HV, V, K]
    one = torch.tensor([0, -1, -1], dtype=torch.int32)
    odd = torch.empty(3 + pool.numel(), dtype=pool.dtype).as_strided(pool.shape, (3, *pool.stride()[1:]))
    A_log = torch.randn(HV)
    for p_ in (pool, pool, odd):
        kd.kda_decode(q, k, v, g, beta, p_, one, A_log=A_log)
    assert counted_plans["kda"] == 2
    lq, lk, lv, decay, lpool, _ = _lightning_inputs(torch.bfloat16)
    lpool = lpool[:1].contiguous()
    lodd = torch.empty(3 + lpool.numel(), dtype=lpool.dtype).as_strided(lpool.shape, (3, *lpool.stride()[1:]))
    for p_ in (lpool, lpool, lodd):
        ld.lightning_decode(lq, lk, lv, decay, p_, one)
    assert counted_plans["lightning"] == 2


def test_a_pool_row_named_twice_is_refused_where_checked(counted_plans, fake_sm90):
    """Two sequences on one pool row would race (each reads the old state, the last write is kept): on cula's path,
    with the indices checked (the default), a call whose indices name a row twice raises naming it before any launch,
    on a cached plan and on a bound step's fast path too (an engine rewrites the bound indices in place);
    check_indices=False leaves it to the caller (it launches); negative indices (padded slots) may repeat."""
    from cula.gated_delta_rule import gdn_decode, gdn_decode_step
    from cula.lightning import lightning_decode_step

    q, k, v, g, beta, pool, _ = _kda_inputs(torch.bfloat16)
    pool = pool.transpose(-1, -2).contiguous()
    lq, lk, lv, decay, lpool, _ = _lightning_inputs(torch.bfloat16)
    twice, padded = (torch.tensor(x, dtype=torch.int32) for x in ([3, -1, 3], [3, -1, -1]))
    A_log = torch.randn(HV)

    def bound(step, *tokens):
        return lambda: step(*tokens)

    makers = {  # each makes a call with the given indices (a step binds them once)
        "kda_decode": lambda idx, **kw: lambda: kd.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log, **kw),
        "kda_decode_step": lambda idx, **kw: bound(kd.kda_decode_step(pool, idx, A_log=A_log, **kw), q, k, v, g, beta),
        "gdn_decode": lambda idx, **kw: lambda: gdn_decode(q, k, v, g[..., 0], beta, pool, idx, A_log=A_log, **kw),
        "gdn_decode_step": lambda idx, **kw: bound(gdn_decode_step(pool, idx, A_log=A_log, **kw), q, k, v,
                                                   g[..., 0], beta),  # fmt: skip
        "lightning_decode": lambda idx, **kw: lambda: ld.lightning_decode(lq, lk, lv, decay, lpool, idx, **kw),
        "lightning_decode_step": lambda idx, **kw: bound(lightning_decode_step(decay, lpool, idx, **kw), lq, lk, lv),
    }
    for name, make in makers.items():
        idx = padded.clone()
        call = make(idx)
        call()
        call()  # the plan (or the step's last launch) in place
        idx.copy_(twice)
        fake_sm90.clear()
        with pytest.raises(ValueError, match="pool row 3 more than once"):
            call()
        assert "launch" not in [c[0] for c in fake_sm90], name
        unchecked = make(twice.clone(), check_indices=False)
        for _ in range(2):
            fake_sm90.clear()
            unchecked()
            assert [c[0] for c in fake_sm90][-1:] == ["launch"], name


def test_commit_refuses_two_writes_to_one_row():
    """kda_commit_accepted writes each sequence with accepted tokens to its row: two writers of one row raise, a
    repeated row with one writer (or none) does not."""
    steps = torch.randn(3, 2, HV, D, D)
    pool = torch.zeros(P, HV, D, D)
    idx = torch.tensor([3, 3, -1], dtype=torch.int32)
    with pytest.raises(ValueError, match="pool row 3 more than once"):
        kd.kda_commit_accepted(steps, pool, idx, torch.tensor([1, 2, 0], dtype=torch.int32))
    kd.kda_commit_accepted(steps, pool, idx, torch.tensor([0, 2, 1], dtype=torch.int32))
    assert torch.equal(pool[3], steps[1, 1])


def _assert_same_launch(a_args, b_args, out_at):
    """Two kernel launches got the same arguments: the same tensors, equal scalars, and at ``out_at`` a fresh output
    of the same shape each."""
    for i, (a, b) in enumerate(zip(a_args, b_args, strict=True)):
        if i == out_at:
            assert a.shape == b.shape and a is not b
        elif isinstance(a, torch.Tensor):
            assert a is b
        else:
            assert a == b


def test_kda_decode_step_matches_kda_decode(counted_plans):
    """``kda_decode_step``: the pool, indices, gate parameters and flags bound once; each step equals the
    ``kda_decode`` call with the same arguments (reference backend here), the slot indices may change in place
    between steps, and a new token signature is validated (refused before anything runs) like kda_decode's."""
    q, k, v, g, beta, pool, idx = _kda_inputs()
    A_log, dt_bias = torch.randn(HV), torch.randn(HV * D)
    ref_pool = pool.clone()
    step = kd.kda_decode_step(pool, idx, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, scale=0.3)
    for i in range(3):
        if i == 2:
            idx[0] = 3  # the engine moves a sequence to another slot in place
        o = step(q, k, v, g, beta)
        before = counted_plans["kda"]
        ref = kd.kda_decode(q, k, v, g, beta, ref_pool, idx, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, scale=0.3)
        torch.testing.assert_close(o, ref, rtol=0, atol=0)
        torch.testing.assert_close(pool, ref_pool, rtol=0, atol=0)
        counted_plans["kda"] = before  # count the step's validations only
    assert counted_plans["kda"] == 1  # one token signature: validated on the first step only
    out = torch.full_like(v, float("nan"))
    assert step(q, k, v, g, beta, out=out) is out and not out.isnan().any()
    with pytest.raises(ValueError, match="`g` must have shape"):
        step(q, k, v, g[:, :, :2], beta)
    with pytest.raises(ValueError, match="out of range"):  # the index check runs on every step
        idx[0] = P
        step(q, k, v, g, beta)
    idx[0] = 4
    with pytest.raises(ValueError, match="A_log"):  # a bound argument is validated with the first step
        kd.kda_decode_step(pool, idx, lower_bound=None)(q, k, v, g, beta)


def test_kda_decode_step_fast_launch(counted_plans, fake_sm90):
    """On cula-sm90 a step calls the compiled kernel with what kda_decode passes it."""
    q, k, v, g, beta, pool, idx = _kda_inputs(torch.bfloat16)
    pool = pool.transpose(-1, -2).contiguous()  # [P, HV, V, K]
    A_log, dt_bias = torch.randn(HV), torch.randn(HV * D)
    step = kd.kda_decode_step(pool, idx, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, scale=0.25,
                              check_indices=False)  # fmt: skip
    for _ in range(2):
        step(q, k, v, g, beta)
    kd.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, scale=0.25)
    launches = [c[1] for c in fake_sm90 if c[0] == "launch"]
    assert [c[0] for c in fake_sm90].count("variant") == 2 and len(launches) == 3
    _assert_same_launch(launches[0], launches[2], out_at=9)
    # with step states (their own token signature and variant): the same launch as kda_decode's
    fake_sm90.clear()
    states = torch.empty(q.shape[0], 1, *pool.shape[1:])
    step(q, k, v, g, beta, step_states=states)
    kd.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, scale=0.25,
                  step_states=states)  # fmt: skip
    variants = [c[1] for c in fake_sm90 if c[0] == "variant"]
    launches = [c[1] for c in fake_sm90 if c[0] == "launch"]
    assert len(launches) == 2 and launches[0][10] is states and all(v["has_step_states"] for v in variants)
    _assert_same_launch(*launches, out_at=9)


def test_step_keys_on_shapes_where_the_kernel_entry_checks_the_rest(counted_plans, fake_sm90, monkeypatch):
    """A repeated step reads only its short key (shapes and dtypes) when the launch's compiled entry checks its
    own arguments; a call that entry refuses is validated in full (cula's error, nothing launched) and a good call
    with the same short key runs again; the reference backend's launches (no entry checks) keep the full key."""
    q, k, v, g, beta, pool, idx = _kda_inputs(torch.bfloat16)
    pool = pool.transpose(-1, -2).contiguous()
    A_log, dt_bias = torch.randn(HV), torch.randn(HV * D)
    sigs = []
    real_sigs = kd.token_sigs
    monkeypatch.setattr(kd, "token_sigs", lambda *a: sigs.append(1) or real_sigs(*a))
    step = kd.kda_decode_step(pool, idx, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, check_indices=False)
    for _ in range(3):
        step(q, k, v, g, beta)
    assert len(sigs) == 1 and [c[0] for c in fake_sm90].count("launch") == 3
    # the entry refuses (a TVM-FFI check; here a stand-in refusing any other k): validated in full
    import cula.ops.kda.sm90.decode as kops

    def refusing(**kw):
        def launch(*args):
            if args[1] is not k:
                raise TypeError("Mismatched k.dtype")  # what TVM-FFI raises for an argument it refuses
            fake_sm90.append(("launch", args))

        return launch

    monkeypatch.setattr(kops, "compiled_variant", refusing)
    step = kd.kda_decode_step(pool, idx, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, check_indices=False)
    step(q, k, v, g, beta)
    fake_sm90.clear()
    with pytest.raises(TypeError, match="`k` must have dtype"):
        step(q, k.half(), v, g, beta)  # the short key's shapes and dtypes, a k cula refuses
    assert not fake_sm90
    step(q, k, v, g, beta)
    assert [c[0] for c in fake_sm90] == ["launch"]


def test_lightning_decode_step_matches_lightning_decode(counted_plans, fake_sm90):
    """``lightning_decode_step``: each step equals the ``lightning_decode`` call (reference backend), validated once
    per token signature, the index check on every step; on cula-sm90 it launches the kernel with what
    lightning_decode passes it."""
    q, k, v, decay, pool, idx = _lightning_inputs()
    ref_pool = pool.clone()
    step = ld.lightning_decode_step(decay, pool, idx, scale=0.5)
    for _ in range(2):
        o = step(q, k, v)
        before = counted_plans["lightning"]
        ref = ld.lightning_decode(q, k, v, decay, ref_pool, idx, scale=0.5)
        counted_plans["lightning"] = before  # count the step's validations only
        torch.testing.assert_close(o, ref, rtol=0, atol=0)
        torch.testing.assert_close(pool, ref_pool, rtol=0, atol=0)
    assert counted_plans["lightning"] == 1
    with pytest.raises(ValueError, match="out of range"):
        idx[0] = P
        step(q, k, v)
    idx[0] = 2
    # bf16 on the pretended SM90: the bound launch, with lightning_decode's arguments
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    step_b = ld.lightning_decode_step(decay, pool, idx, check_indices=False)
    step_b(qb, kb, vb)
    ld.lightning_decode(qb, kb, vb, decay, pool, idx, check_indices=False)
    launches = [c[1] for c in fake_sm90 if c[0] == "launch"]
    assert len(launches) == 2
    _assert_same_launch(*launches, out_at=6)


def test_lightning_decode_step_binds_the_real_launcher(counted_plans, pretend_sm90, monkeypatch):
    """The real lightning_decode_launcher with only the compile stubbed: the step's bound launch (``bind``, the
    kernel called directly) passes the kernel what lightning_decode's launch does, grid size included."""
    import cula.ops.lightning.sm90.decode as lops

    calls = []
    monkeypatch.setattr(lops, "compiled_kernel", lambda key, build: lambda *args: calls.append(args))
    q, k, v, decay, pool, idx = _lightning_inputs(torch.bfloat16)
    step = ld.lightning_decode_step(decay, pool, idx, scale=0.5, check_indices=False)
    for _ in range(2):
        step(q, k, v)
    ld.lightning_decode(q, k, v, decay, pool, idx, scale=0.5, check_indices=False)
    assert len(calls) == 3 and len(calls[0]) == 9
    _assert_same_launch(calls[0], calls[1], out_at=6)
    _assert_same_launch(calls[1], calls[2], out_at=6)


def test_single_token_cta_picks_the_one_slot_variant(counted_plans, fake_sm90, kda_tuning):
    """single_token_cta applies to T=1 calls only (a one-slot variant would run T>1 in rounds of one)."""
    kda_tuning(single_token_cta=(1, 20))
    q, k, v, g, beta, pool, idx = _kda_inputs(torch.bfloat16)
    pool = pool.transpose(-1, -2).contiguous()
    A_log = torch.randn(HV)
    kd.kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log, lower_bound=-5.0)
    two = [torch.cat([t, t], dim=1) for t in (q, k, v, g, beta)]
    kd.kda_decode(*two, pool, idx, A_log=A_log, lower_bound=-5.0)
    variants = [c[1] for c in fake_sm90 if c[0] == "variant"]
    assert variants[0]["tokens_per_round"] == 1 and variants[0]["min_blocks_per_sm"] == 20
    assert variants[0]["warps_per_cta"] == 1
    assert not {"tokens_per_round", "min_blocks_per_sm", "warps_per_cta"} & set(variants[1])


def test_kv_cols_switch_picks_the_column_variant(counted_plans, fake_sm90, kda_tuning):
    """kv_cols takes T=1 calls on [K, V] pools with K=128 (ahead of kv_tma) from kv_cols_min_states states (N x HV)
    up; not T>1 calls, [V, K] pools, K=64 or smaller calls (kv_tma). multi_token_kv_cols is off here: the T>1
    box has its own test."""
    kda_tuning(kv_cols=(2, 6), multi_token_kv_cols=None, kv_cols_min_states=N * HV)
    q, k, v, g, beta, pool, idx = _kda_inputs(torch.bfloat16, D=128)
    A_log = torch.randn(HV)
    kv = dict(A_log=A_log, lower_bound=-5.0, state_v_first=False)
    kd.kda_decode(q, k, v, g, beta, pool, idx, **kv)
    two = [torch.cat([t, t], dim=1) for t in (q, k, v, g, beta)]
    kd.kda_decode(*two, pool, idx, **kv)
    kd.kda_decode(q, k, v, g, beta, pool.transpose(-1, -2).contiguous(), idx, A_log=A_log, lower_bound=-5.0)
    kd.kda_decode(*(t[:-1] for t in (q, k, v, g, beta)), pool, idx[:-1], **kv)  # N x HV below the threshold
    kd.kda_decode(*_kda_inputs(torch.bfloat16)[:6], idx, **kv)  # K=64
    first, multi, vk, small, k64 = [c[1] for c in fake_sm90 if c[0] == "variant"]
    assert first["kv_cols"] and first["warps_per_cta"] == 2 and first["min_blocks_per_sm"] == 6
    assert first["tokens_per_round"] == 1 and not first["wide_kv"]
    assert not any(c.get("kv_cols") for c in (multi, vk, small, k64))
    assert small["kv_tma"] and not k64.get("kv_tma")


def _mtp_switch_variants(fake_sm90, state_v_first):
    """The variants of four kda_decode calls on a K=128 pool: 2 tokens, 2 with step states, 3, then 1."""
    q, k, v, g, beta, pool, idx = _kda_inputs(torch.bfloat16, D=128)
    flags = dict(A_log=torch.randn(HV), lower_bound=-5.0, state_v_first=state_v_first)
    two, three = ([torch.cat([t] * n, dim=1) for t in (q, k, v, g, beta)] for n in (2, 3))
    kd.kda_decode(*two, pool, idx, **flags)
    kd.kda_decode(*two, pool, idx, step_states=torch.empty(N, 2, HV, 128, 128), **flags)
    kd.kda_decode(*three, pool, idx, **flags)
    kd.kda_decode(q, k, v, g, beta, pool, idx, **flags)
    return [c[1] for c in fake_sm90 if c[0] == "variant"]


def test_multi_token_kv_cols_switch(counted_plans, fake_sm90, kda_tuning):
    """multi_token_kv_cols takes calls of 2 to multi_token_max_tokens tokens on [K, V] pools with K=128 and
    no step states, with its warps, token slots and CTAs per SM; longer calls and step states keep the wide tile, T=1
    calls kv_cols / kv_tma."""
    kda_tuning(multi_token_kv_cols=(2, 4, 5), multi_token_max_tokens=2)
    multi, stepped, longer, single = _mtp_switch_variants(fake_sm90, state_v_first=False)
    assert multi["kv_cols"] and not multi["wide_kv"]
    assert (multi["warps_per_cta"], multi["tokens_per_round"], multi["min_blocks_per_sm"]) == (2, 4, 5)
    for wide in (stepped, longer):
        assert not wide.get("kv_cols") and wide["wide_kv"]
    assert single.get("kv_tma") and not single.get("kv_cols")  # 12 states: below kv_cols_min_states


def test_multi_token_vk_switch(counted_plans, fake_sm90, kda_tuning):
    """multi_token_vk takes calls of 2 to multi_token_max_tokens tokens on [V, K] pools with K=128 and no step
    states to its token slots and CTAs per SM on the narrow tile, ahead of wide_vk_min_tokens; longer calls and step
    states keep what they had, T=1 calls single_token_cta."""
    kda_tuning(multi_token_vk=(2, 7), multi_token_max_tokens=2, wide_vk_min_tokens=2)
    two, stepped, three, single = _mtp_switch_variants(fake_sm90, state_v_first=True)
    assert not two["wide_kv"] and (two["tokens_per_round"], two["min_blocks_per_sm"]) == (2, 7)
    assert "warps_per_cta" not in two and not two.get("kv_cols")
    for wide in (stepped, three):
        assert wide["wide_kv"] and wide.get("min_blocks_per_sm") != 7
    assert single["tokens_per_round"] == 1 and single.get("min_blocks_per_sm") != 7
    fake_sm90.clear()
    kda_tuning(multi_token_vk=(2, 7), multi_token_max_tokens=2, wide_vk_min_tokens=None)
    kv = _mtp_switch_variants(fake_sm90, state_v_first=False)  # [K, V] pools: multi_token_kv_cols, not this
    assert not any(v.get("min_blocks_per_sm") == 7 for v in kv)


def test_wide_vk_switch(counted_plans, fake_sm90, kda_tuning):
    """wide_vk_min_tokens takes [V, K] pools with K=128 to the wide lane tile from that many tokens a call (step
    states too); fewer tokens keep the narrow tile; None never takes it."""
    kda_tuning(wide_vk_min_tokens=2, multi_token_kv_cols=None, multi_token_vk=None)
    two, stepped, three, single = _mtp_switch_variants(fake_sm90, state_v_first=True)
    for wide in (two, stepped, three):
        assert wide["wide_kv"] and wide["state_v_first"]
    assert not single["wide_kv"]
    fake_sm90.clear()
    kda_tuning(wide_vk_min_tokens=None, multi_token_kv_cols=None)
    narrow = _mtp_switch_variants(fake_sm90, state_v_first=True)
    assert len(narrow) == 4 and not any(v["wide_kv"] for v in narrow)


def test_lightning_decode_plans(counted_plans, fake_sm90):
    q, k, v, decay, pool, idx = _lightning_inputs()
    kd_pool = pool.clone()
    outs = [ld.lightning_decode(q, k, v, decay, pool, idx) for _ in range(2)]  # reference backend (fp32)
    assert counted_plans["lightning"] == 1
    for step in range(2):
        ld._plans.clear()
        o = ld.lightning_decode(q, k, v, decay, kd_pool, idx)
        torch.testing.assert_close(o, outs[step], rtol=0, atol=0)
    with pytest.raises(ValueError, match="`decay` must have shape"):
        ld.lightning_decode(q, k, v, decay[:2], pool, idx)
    with pytest.raises(ValueError, match="out of range"):
        ld.lightning_decode(q, k, v, decay, pool, torch.tensor([2, P, -1], dtype=torch.int32))
    # bf16 on the (fake) SM90: bound once, then launched with the call's tensors
    fake_sm90.clear()
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    out = torch.empty_like(vb)
    sigs = []
    real_sig = ld.tensor_sig
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ld, "tensor_sig", lambda t: sigs.append(1) or real_sig(t))
        for _ in range(3):  # repeats key on shapes, dtypes and flags (the entry checks the rest)
            ld.lightning_decode(qb, kb, vb, decay, pool, idx, out=out, scale=0.5, state_v_first=False)
    assert len(sigs) == 7 and [c[0] for c in fake_sm90] == ["variant", "launch", "launch", "launch"]
    assert fake_sm90[0][1]["state_v_first"] is False
    args = fake_sm90[-1][1]
    assert args[0] is qb and args[4] is pool and args[5] is idx and args[6] is out and args[7] == 0.5


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["kda", "lightning"])
def test_fast_launch_matches_the_general_path_on_sm90(op, monkeypatch):
    """On the H200: repeated public calls (the bound launch) give bit-identical results to the launcher, and the
    first call rewrites every element of the pool rows it owns (both paths could leave the same one unwritten)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from cula.kda.plan import kda_decode_sm90
    from cula.lightning.plan import lightning_decode_sm90
    from cula.testing import assert_rows_rewritten

    torch.manual_seed(2)
    n, h, hv, d, p = 16, 4, 8, 128, 40
    q, k = (torch.randn(n, 1, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(n, 1, hv, d, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(p, hv, d, d, device="cuda") * 0.1
    idx = torch.randperm(p, device="cuda")[:n].to(torch.int32)
    idx[3] = -1
    before, ref_pool = pool.clone(), pool.clone()
    if op == "kda":
        g = torch.randn(n, 1, hv, d, device="cuda")
        beta = torch.randn(n, 1, hv, device="cuda")
        A_log = torch.randn(hv, device="cuda")
        public = lambda state: kd.kda_decode(q, k, v, g, beta, state, idx, A_log=A_log, lower_bound=-5.0)

        def launcher(state, o):
            kda_decode_sm90(q, k, v, g, beta, A_log, None, state, idx, o, scale=d**-0.5, gate="lower_bound",
                            lower_bound=-5.0, use_qk_l2norm=True, beta_sigmoid=True, allow_neg_eigval=False,
                            state_v_first=True)  # fmt: skip
    else:
        decay = torch.rand(hv, device="cuda")
        public = lambda state: ld.lightning_decode(q, k, v, decay, state, idx)

        def launcher(state, o):
            lightning_decode_sm90(q, k, v, decay, state, idx, o, scale=d**-0.5, state_v_first=True)

    outs = [public(pool)]
    first = pool.clone()
    outs += [public(pool) for _ in range(2)]
    for step in range(3):
        o = torch.empty_like(v)
        launcher(ref_pool, o)
        assert torch.equal(o, outs[step])
    assert torch.equal(pool, ref_pool)
    # the reference backend's first step (fp32 torch) tells which elements may round back to their old values
    monkeypatch.setenv("CULA_BACKEND", "reference")
    expected = before.clone()
    public(expected)
    rows = idx[idx >= 0].long()
    assert_rows_rewritten("pool rows after the first call", first, before, rows, ref=expected[rows])


def test_fused_recurrent_kda_pool_form_runs_the_decode_kernel(counted_plans, fake_sm90):
    """FLA's serving call with [N, 1] tokens and an in-place pool is one kda_decode step on the (fake) SM90."""
    import cula.kda as ck
    from cula.kda.backends import _cula_recurrent_supports

    q, k, v, g, beta, pool, idx = _kda_inputs(torch.bfloat16)
    A_log = torch.randn(HV)
    kw = dict(A_log=A_log, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=-5.0, ssm_state_indices=idx, inplace_final_state=True)  # fmt: skip
    import cula.kda.fused_recurrent as fr

    fr._plans.clear()
    for _ in range(2):
        o, ht = ck.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, **kw)
        assert ht is pool and o.shape == v.shape
    # bound once under the call's own plan; kda_decode's validation and plan cache are not walked on the way
    assert [c[0] for c in fake_sm90] == ["variant", "launch", "launch"] and counted_plans["kda"] == 0
    assert fake_sm90[0][1]["gate"] == "lower_bound" and fake_sm90[0][1]["state_v_first"] is False
    args = fake_sm90[2][1]
    assert args[0] is q and args[7] is pool and args[8] is idx and args[11] == D**-0.5
    with pytest.raises(ValueError, match="the state pool"):  # the pool's shape, checked before any plan
        ck.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool[:, :1].clone(), **kw)
    # what the kernel does not cover goes to FLA, with the reason
    base = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=None, initial_state=pool,
                inplace_final_state=True, cu_seqlens=None, ssm_state_indices=idx, num_accepted_tokens=None,
                use_gate_in_kernel=True, lower_bound=-5.0, state_v_first=False)  # fmt: skip
    assert _cula_recurrent_supports(**base) == (True, None)
    for over, why in (
        ({"cu_seqlens": torch.tensor([0, 1, 2, 3])}, "cu_seqlens"),
        ({"num_accepted_tokens": torch.ones(N, dtype=torch.int32)}, "num_accepted_tokens"),
        ({"ssm_state_indices": None}, "state-pool"),
        ({"inplace_final_state": False}, "state-pool"),
        ({"ssm_state_indices": idx.long()}, "int32"),
        ({"beta": torch.randn(N, 1, HV, D)}, "per-channel beta"),
        ({"initial_state": pool.to(torch.bfloat16)}, "fp32"),
    ):
        ok, reason = _cula_recurrent_supports(**dict(base, **over))
        assert not ok and why in reason, (over, reason)


def test_fused_recurrent_kda_kv_pools_run_on_cula():
    """[K, V] pools (FLA's default layout) with K = 128 run on cula's wide lane tile at any size: on the H200 it
    matched FLA at N=64 and beat it at N=1 and N=256."""
    import cula.kda.backends as kb

    n, hv, d = 16, 64, 128
    q = torch.zeros(n, 1, 16, d, dtype=torch.bfloat16)
    v = torch.zeros(n, 1, hv, d, dtype=torch.bfloat16)
    base = {"q": q, "k": q, "v": v, "g": torch.zeros(n, 1, hv, d), "beta": torch.zeros(n, 1, hv),
            "A_log": torch.zeros(hv), "dt_bias": None, "initial_state": torch.zeros(2 * n, hv, d, d),
            "inplace_final_state": True, "cu_seqlens": None, "ssm_state_indices": torch.arange(n, dtype=torch.int32),
            "num_accepted_tokens": None, "use_gate_in_kernel": True, "lower_bound": -5.0}
    for state_v_first in (False, True):
        assert kb._cula_recurrent_supports(**base, state_v_first=state_v_first) == (True, None)


def test_fused_recurrent_kda_fwd_repeats_skip_validation(monkeypatch):
    """FLA's serving entry point, called once per token by engines: validated once per signature."""
    import cula.kda.fused_recurrent as fr
    from cula.kda import fused_recurrent_kda_fwd

    count = [0]
    monkeypatch.setattr(fr, "_plans", PlanCache())
    real = fr._checked
    monkeypatch.setattr(fr, "_checked", lambda call: (count.__setitem__(0, count[0] + 1), real(call))[1])
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    q, k, v, g, beta, _pool, _idx = _kda_inputs()
    A_log = torch.randn(HV)
    h0 = torch.randn(N, HV, D, D) * 0.1  # a plain initial state (no pool)
    kw = {"A_log": A_log, "initial_state": h0, "inplace_final_state": False, "output_final_state": True,
          "use_gate_in_kernel": True}  # fmt: skip
    outs = [fused_recurrent_kda_fwd(q, k, v, g, beta, **kw) for _ in range(3)]
    assert count[0] == 1
    fr._plans.clear()
    o, fin = fused_recurrent_kda_fwd(q, k, v, g, beta, **kw)  # validated in full again: the same numbers
    assert count[0] == 2
    for o2, fin2 in outs:
        torch.testing.assert_close(o2, o, rtol=0, atol=0)
        torch.testing.assert_close(fin2, fin, rtol=0, atol=0)
    with pytest.raises(ValueError):  # a new signature: validated
        fused_recurrent_kda_fwd(q, k, v, g[..., :2], beta, **kw)
    with pytest.raises(ValueError, match="A_log"):
        fused_recurrent_kda_fwd(q, k, v, g, beta, **dict(kw, A_log=torch.zeros(HV + 1)))


def test_clear_plan_caches_forgets_a_steps_last_launch():
    """A decode step's last-launch fast path is part of the plan caches: a tuning override or a benchmark's
    clear_plan_caches must reach it, or the step keeps running the launch planned under the old numbers."""
    from cula.backends import clear_plan_caches

    plans = StepPlans()
    plans.run(("k",), lambda launch: launch(), lambda: ("full",), lambda: _checking(lambda: 1))
    assert plans.last_key == ("k",) and plans.last_launch is not None
    clear_plan_caches()
    assert plans.last_key is None and plans.last_launch is None and len(plans) == 0


def _checking(fn):
    fn.checks_arguments = True
    return fn


@pytest.mark.parametrize("inplace", [False, True])
def test_fla_serving_form_gets_row_major_tensors(monkeypatch, inplace):
    """FLA's low-level fused_recurrent_kda_fwd (which, unlike its public form, copies nothing) gets row-major token
    tensors and state rows; a strided out or in-place state is written through a copy and holds the result."""
    import fla.ops.kda.fused_recurrent as fla_recurrent

    from cula.kda import backends

    def fla_kernel(**args):  # FLA's kernel addresses these as row-major (a state of its own too, whatever its
        # dim-0 stride): the reference stands in for it
        for name, t in args.items():
            if isinstance(t, torch.Tensor):
                assert t.is_contiguous(), name
        return backends._fused_recurrent_kda_reference(**args)

    monkeypatch.setattr(fla_recurrent, "fused_recurrent_kda_fwd", fla_kernel)
    q, k, v, g, beta, _, _ = _kda_inputs()
    wide = lambda t: torch.cat([t, t], -1)[..., : t.shape[-1]]  # noqa: E731  (a view every other row of)
    state = torch.randn(N, HV, D, D) * 0.1
    call = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=None, dt_bias=None, scale=D**-0.5, output_final_state=True,
                inplace_final_state=inplace, state_v_first=False, cu_seqlens=None, ssm_state_indices=None,
                num_accepted_tokens=None, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False,
                use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False, lower_bound=None)  # fmt: skip
    want_o, want_state = backends._fused_recurrent_kda_reference(**dict(call, initial_state=state.clone(), out=None))
    transposed = lambda: state.clone().transpose(-1, -2).contiguous().transpose(-1, -2)  # noqa: E731
    every_other_row = lambda: torch.stack([state, torch.zeros_like(state)], 1).flatten(0, 1)[::2]  # noqa: E731
    for make_state in (transposed, every_other_row):
        strided = dict(call, q=wide(q), k=wide(k), v=wide(v), g=wide(g), initial_state=make_state(),
                       out=wide(torch.zeros_like(v)))  # fmt: skip
        assert not strided["initial_state"].is_contiguous()
        o, final = backends._fused_recurrent_kda_fla(**strided)
        assert o is strided["out"] and torch.allclose(o, want_o, atol=1e-6)
        assert torch.allclose(final, want_state, atol=1e-6)
        if inplace:
            assert final is strided["initial_state"]
