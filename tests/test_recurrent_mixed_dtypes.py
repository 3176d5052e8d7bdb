"""q, k and v of their own float dtypes, float64 included, in the recurrent forms (FLA 0.6.0 parity).

FLA 0.6.0's recurrent kernels load every input with ``.to(tl.float32)``, compute in fp32 and allocate the output like
``v`` (KDA, Gated DeltaNet: ``torch.zeros_like(v)`` / ``torch.empty_like(v)``) or cast it to q's dtype (Simple GLA,
and Lightning through it), the final state fp32. Its own tests rely on that: ``test_gdn.py::test_fused_recurrent``
passes fp32 q / k with an fp16 v and beta, ``test_kda.py::_flash_kda_gold`` makes its gold call with every tensor in
float64. cula's ``fused_recurrent_kda`` / ``fused_recurrent_kda_fwd``, ``fused_recurrent_gated_delta_rule``,
``fused_recurrent_simple_gla`` and ``fused_recurrent_lightning_attn`` take them too:

- CPU (the reference backend): each form with mixed dtypes and all-float64, fixed and packed, gives outputs in FLA's
  dtypes whose values are the same call's on every input cast to fp32 (the reference computes in fp32 as FLA's
  kernel does, so the fp32 call's outputs rounded to the output dtype, bit for bit), and autograd gives each input's
  gradient in its own dtype;
- against FLA's own kernels under Triton's CPU interpreter (a subprocess): within a unit in the last place of the
  output's dtype, the final states within fp32 rounding;
- the CUDA path (``pretend_sm90``): cula's kernels take one bf16 / fp16 dtype for q, k and v, so their ``cula-sm90``
  backends decline such calls with the reason logged and FLA's kernel runs them;
- the chunked forms keep their rule (one dtype, no float64), as FLA's chunked kernels compute in the inputs' dtypes.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F

from cula.backends import clear_plan_caches
from cula.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from cula.kda import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_fwd
from cula.lightning import fused_recurrent_lightning_attn
from cula.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
from cula.testing import make_cu_seqlens
from fla_interpreter import fla_interpreter_results

H, HV, D = 1, 2, 16
LENS = [5, 0, 9]  # packed sequences, an empty one among them
F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64

# dtype schemes: a dtype a tensor name (the rest fp32)
SCHEMES = {
    "fp32 q k, fp16 v beta": dict(v=F16, beta=F16),  # FLA's test_gdn.py::test_fused_recurrent (its fp16 cases)
    "bf16 q, fp16 k, fp32 v, f64 state": dict(q=BF16, k=F16, g=BF16, initial_state=F64),
    "float64": "all",  # FLA's test_kda.py::_flash_kda_gold
}


def _tokens(form: str, varlen: bool, seed: int = 0) -> dict:
    """fp32 inputs of one call of ``form`` (fixed: B = 2 sequences of 6 tokens; packed: ``LENS``)."""
    gen = torch.Generator().manual_seed(seed)
    B, T, N = (1, sum(LENS), len(LENS)) if varlen else (2, 6, 2)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    # (FLA's Simple GLA has no GVA, its Lightning wrappers one decay a q/k head: 2 heads, one of them decaying)
    hq, hv = {"simple_gla": (H, H), "lightning": (2, 2)}.get(form, (H, HV))
    x = dict(q=rnd(B, T, hq, D), k=rnd(B, T, hq, D), v=rnd(B, T, hv, D), initial_state=rnd(N, hv, D, D) * 0.5)
    if form == "kda":
        x.update(g=rnd(B, T, HV, D), beta=rnd(B, T, HV), A_log=rnd(HV) * 0.5, dt_bias=rnd(HV * D) * 0.5)
    elif form == "gdn":
        x.update(g=rnd(B, T, HV), beta=rnd(B, T, HV), A_log=rnd(HV) * 0.5, dt_bias=rnd(HV) * 0.5)
    elif form == "simple_gla":
        x.update(g=F.logsigmoid(rnd(B, T, H) + 2))
    if varlen:
        x["cu_seqlens"] = make_cu_seqlens(LENS)
    return x


def _cast(x: dict, scheme: str) -> dict:
    dtypes = SCHEMES[scheme]
    return {
        n: t.to(F64 if dtypes == "all" else dtypes.get(n, F32)) if t.is_floating_point() else t for n, t in x.items()
    }


def _fp32(x: dict) -> dict:
    """The same values in fp32 (exact: every value of the other dtypes is an fp32 value, or rounds once to one as
    FLA's kernel reads it)."""
    return {n: t.float() if t.is_floating_point() else t for n, t in x.items()}


def _call(form: str, x: dict):
    """``(o, final_state)`` of ``form`` on ``x`` (FLA's keywords: the fused gates, l2norm, beta logits)."""
    if form == "kda":
        return fused_recurrent_kda(**x, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                   use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, output_final_state=True)
    if form == "kda_fwd":  # the serving form out of place (a state of each sequence's own, read only)
        return fused_recurrent_kda_fwd(**x, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                       use_beta_sigmoid_in_kernel=True, inplace_final_state=False,
                                       output_final_state=True, state_v_first=True)  # fmt: skip
    if form == "gdn":
        return fused_recurrent_gated_delta_rule(**x, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                                use_beta_sigmoid_in_kernel=True, output_final_state=True)
    if form == "simple_gla":
        return fused_recurrent_simple_gla(**x, output_final_state=True)
    return fused_recurrent_lightning_attn(**x, layer_idx=1, num_layers=4, output_final_state=True)


FORMS = ("kda", "kda_fwd", "gdn", "simple_gla", "lightning")


def _o_like(form: str) -> str:
    """The input whose dtype FLA's form gives the output: v (KDA, Gated DeltaNet: allocated like v) or q."""
    return "q" if form in ("simple_gla", "lightning") else "v"


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("form", FORMS)
def test_recurrent_forms_take_flas_dtypes(form, scheme, varlen):
    """FLA's output dtypes, and the values of the same call on every input cast to fp32, rounded to the output's
    dtype: the reference computes in fp32 as FLA's kernel does (inputs that are not fp32 are read as fp32 first),
    so the two agree bit for bit."""
    x = _cast(_tokens(form.removesuffix("_fwd"), varlen), scheme)
    if form == "kda_fwd":
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    x32 = _fp32(x)
    with torch.no_grad():
        o, ht = _call(form, x)
        o32, ht32 = _call(form, x32)
    assert o.dtype == x[_o_like(form)].dtype and ht.dtype == F32
    assert o.shape == o32.shape and ht.shape == ht32.shape
    assert not o.isnan().any() and not ht.isnan().any()
    assert torch.equal(o, o32.to(o.dtype)), (o.double() - o32.double()).abs().max().item()
    assert torch.equal(ht, ht32)


@pytest.mark.parametrize("form", ("kda", "gdn", "simple_gla"))
def test_gradients_come_back_in_each_inputs_dtype(form):
    """Autograd through the CPU reference: each input's gradient in its own dtype, the values the fp32 call's
    (rounded to that dtype; the fp32 call's output rounded as the mixed call's is, so that the gradient reaching it
    is rounded alike)."""
    x = _cast(_tokens(form, varlen=True, seed=3), "bf16 q, fp16 k, fp32 v, f64 state")
    x32 = _fp32(x)
    grads, o_dtype = [], x[_o_like(form)].dtype
    for call in (x, x32):
        leaves = {n: t.clone().requires_grad_() if t.is_floating_point() else t for n, t in call.items()}
        o, ht = _call(form, leaves)
        gen = torch.Generator().manual_seed(5)
        o = o.to(o_dtype).float()
        loss = (o * torch.randn(o.shape, generator=gen)).sum() + (ht * torch.randn(ht.shape, generator=gen)).sum()
        loss.backward()
        grads.append({n: t.grad for n, t in leaves.items() if t.is_floating_point()})
    got, want = grads
    for n, t in x.items():
        if not t.is_floating_point():
            continue
        assert got[n] is not None and got[n].dtype == t.dtype, (n, got[n])
        assert torch.equal(got[n], want[n].to(t.dtype)), (n, (got[n].double() - want[n].double()).abs().max().item())


def test_serving_pool_with_mixed_tokens():
    """The in-place pool form with mixed token dtypes: o in v's dtype, the fp32 pool's rows those of the fp32
    call."""
    x = _tokens("kda", varlen=False, seed=4)
    x32 = _fp32(_cast({n: (t[:, :1].contiguous() if n in ("q", "k", "v", "g", "beta") else t) for n, t in x.items()},
                      "fp32 q k, fp16 v beta"))  # fmt: skip
    pool = torch.randn(5, HV, D, D, generator=torch.Generator().manual_seed(6))
    idx = torch.tensor([3, 1], dtype=torch.int32)
    outs = []
    for scheme in ("fp32 q k, fp16 v beta", None):
        x = dict(x32 if scheme is None else _cast(x32, scheme), initial_state=pool.clone(), ssm_state_indices=idx)
        o, ht = fused_recurrent_kda_fwd(**x, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
        assert ht is x["initial_state"]
        outs.append((o, ht))
    (o, pool_mixed), (o32, pool32) = outs
    assert o.dtype == F16 and torch.equal(o, o32.to(F16)) and torch.equal(pool_mixed, pool32)
    out = torch.empty(o.shape, dtype=F16)
    o2, _ = fused_recurrent_kda_fwd(**dict(_cast(x32, "fp32 q k, fp16 v beta"), initial_state=pool.clone(),
                                           ssm_state_indices=idx), use_qk_l2norm_in_kernel=True,
                                    use_gate_in_kernel=True, out=out)  # fmt: skip
    assert o2 is out and torch.equal(out, o)
    with pytest.raises(TypeError, match="`out` must have dtype float16"):  # o's dtype: v's
        fused_recurrent_kda_fwd(**dict(_cast(x32, "fp32 q k, fp16 v beta"), initial_state=pool.clone(),
                                       ssm_state_indices=idx), out=torch.empty(o.shape))  # fmt: skip


def test_the_chunked_forms_keep_their_rule():
    """The chunked forms still take one dtype for q, k, v, and no float64 (FLA's chunked kernels compute in the
    inputs' dtypes; cula's and FLA's ``chunk_kda`` also take an fp32 state only)."""
    x = _tokens("kda", varlen=False)
    kda = dict(q=x["q"], k=x["k"], v=x["v"], g=F.logsigmoid(x["g"]), beta=x["beta"].sigmoid())
    with pytest.raises(TypeError, match="`v` must have dtype float32"):
        chunk_kda(**dict(kda, v=kda["v"].half()))
    with pytest.raises(TypeError, match="`q` must have dtype"):
        chunk_kda(**{n: t.double() for n, t in kda.items()})
    g = _tokens("gdn", varlen=False)
    with pytest.raises(TypeError, match="`k` must have dtype float32"):
        chunk_gated_delta_rule(g["q"], g["k"].half(), g["v"], F.logsigmoid(g["g"]), g["beta"].sigmoid())
    s = _tokens("simple_gla", varlen=False)
    with pytest.raises(TypeError, match="`q` must have dtype"):
        chunk_simple_gla(s["q"].double(), s["k"].double(), s["v"].double(), g=s["g"])


# ------------------------------------------------------------------------------------------------- the CUDA path


def _stub_fla(monkeypatch, registry, calls):
    """``registry``'s fla backend recording its calls and returning the reference's result (FLA's kernels cannot run
    on the CPU)."""

    def wrap(backend):
        if backend.name != "fla":
            return backend
        reference = next(b for b in registry._backends if b.name == "reference")

        def run(**args):
            calls.append(registry.op)
            return reference.run(**args)

        return dataclasses.replace(backend, run=run)

    monkeypatch.setattr(registry, "_backends", [wrap(b) for b in registry._backends])
    monkeypatch.setattr(registry, "_logged", set())


def _decode_tokens(N, dtype, per_head_gate=False, seed=0):
    """A decode call's tokens cula's kernels take: [N, 1], K = V = 64, one 16-bit dtype."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    g = rnd(N, 1, HV) if per_head_gate else rnd(N, 1, HV, 64)
    return dict(q=rnd(N, 1, H, 64).to(dtype), k=rnd(N, 1, H, 64).to(dtype), v=rnd(N, 1, HV, 64).to(dtype), g=g,
                beta=rnd(N, 1, HV))  # fmt: skip


MIXED = {  # label: (token dtype changes to a bf16 call, the reason cula-sm90 declines it)
    "fp32 v": (dict(v=F32), "q / k / v dtypes torch.bfloat16 / torch.bfloat16 / torch.float32"),
    "fp16 k": (dict(k=F16), "q / k / v dtypes torch.bfloat16 / torch.float16 / torch.bfloat16"),
    "fp32 q": (dict(q=F32), "q dtype torch.float32"),
    "float64": (dict(q=F64, k=F64, v=F64), "q dtype torch.float64"),
}


@pytest.mark.parametrize("case", list(MIXED))
def test_cula_sm90_declines_mixed_or_float64_tokens(case, pretend_sm90, monkeypatch, caplog):
    """On the CUDA path cula's kernels take one bf16 / fp16 dtype for q, k and v: the ``cula-sm90`` backends of the
    serving form of KDA, of Gated DeltaNet's recurrent form and of ``kda_decode`` decline the call (each checks k's
    and v's dtypes, not q's alone), the registry logs why, and FLA's kernel runs it (here a stand-in)."""
    from cula.gated_delta_rule.backends import fused_recurrent_gdn_registry
    from cula.kda.backends import fused_recurrent_kda_registry
    from cula.kda.decode import kda_decode_registry

    caplog.set_level(logging.INFO, logger="cula")
    clear_plan_caches()
    calls = []
    for registry in (fused_recurrent_kda_registry, fused_recurrent_gdn_registry):
        _stub_fla(monkeypatch, registry, calls)
    change, reason = MIXED[case]
    N, P = 3, 5
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)

    # KDA's serving form: the [N, 1] call on an fp32 pool is kda_decode's, in one bf16 dtype
    tokens = _decode_tokens(N, BF16)
    gate = dict(A_log=torch.zeros(HV), dt_bias=torch.zeros(HV * 64))
    args = dict(tokens, **gate, initial_state=torch.zeros(P, HV, 64, 64), scale=0.125, output_final_state=False,
                inplace_final_state=True, state_v_first=False, cu_seqlens=None, ssm_state_indices=idx,
                num_accepted_tokens=None, allow_neg_eigval=False, lower_bound=None, out=None, **flags)  # fmt: skip
    assert fused_recurrent_kda_registry.verdict("cula-sm90", tokens["q"].device, args) == (True, None)
    mixed = {n: t.to(change.get(n, t.dtype)) for n, t in tokens.items()}
    ok, why = fused_recurrent_kda_registry.verdict("cula-sm90", tokens["q"].device, dict(args, **mixed))
    assert not ok and reason in why, why
    pool = torch.zeros(P, HV, 64, 64)
    o, ht = fused_recurrent_kda_fwd(**mixed, **gate, initial_state=pool, ssm_state_indices=idx, **flags)
    assert ht is pool and o.dtype == mixed["v"].dtype and calls == ["kda.fused_recurrent_kda"]
    assert f"kda.fused_recurrent_kda -> fla (cula-sm90: {reason}" in caplog.text

    # kda_decode's own backend (cula's API validates one dtype; the backend checks all three all the same)
    decode = dict(tokens, state_pool=pool, state_v_first=False)
    assert kda_decode_registry.verdict("cula-sm90", tokens["q"].device, decode) == (True, None)
    ok, why = kda_decode_registry.verdict("cula-sm90", tokens["q"].device, dict(decode, **mixed))
    assert not ok and reason in why, why

    # Gated DeltaNet's recurrent form: decode calls on kda_decode's kernel with its per-head gate
    calls.clear()
    tokens = _decode_tokens(N, BF16, per_head_gate=True)
    h0 = torch.zeros(N, HV, 64, 64)
    args = dict(tokens, gk=None, gv=None, initial_state=h0, state_v_first=False, cu_seqlens=None, A_log=None,
                dt_bias=None)  # fmt: skip
    assert fused_recurrent_gdn_registry.verdict("cula-sm90", tokens["q"].device, args) == (True, None)
    mixed = {n: t.to(change.get(n, t.dtype)) for n, t in tokens.items()}
    ok, why = fused_recurrent_gdn_registry.verdict("cula-sm90", tokens["q"].device, dict(args, **mixed))
    assert not ok and reason in why, why
    o, ht = fused_recurrent_gated_delta_rule(**mixed, initial_state=h0, output_final_state=True)
    assert o.dtype == mixed["v"].dtype and ht.dtype == F32
    assert calls == ["gated_delta_rule.fused_recurrent_gated_delta_rule"]
    assert f"gated_delta_rule.fused_recurrent_gated_delta_rule -> fla (cula-sm90: {reason}" in caplog.text
    clear_plan_caches()


# --------------------------------------------------------------------------------------- FLA's kernels, interpreted


def _compare_with_fla() -> dict:
    """Run in the interpreter's subprocess: each form on FLA's kernel and on cula's reference backend, with mixed
    dtypes and all-float64, fixed and packed."""
    from triton.runtime.autotuner import Autotuner

    # one config a kernel: the interpreter has no driver to time configs with (FLA autotunes its Simple GLA and
    # Gated DeltaNet kernels)
    prune = Autotuner.prune_configs
    Autotuner.prune_configs = lambda self, *a, **k: prune(self, *a, **k)[:1]
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_gdn
    from fla.ops.kda import fused_recurrent_kda as fla_kda
    from fla.ops.lightning_attn import fused_recurrent_lightning_attn as fla_lightning
    from fla.ops.simple_gla import fused_recurrent_simple_gla as fla_simple_gla

    theirs = {"kda": fla_kda, "gdn": fla_gdn, "simple_gla": fla_simple_gla, "lightning": fla_lightning}
    ours = {"kda": fused_recurrent_kda, "gdn": fused_recurrent_gated_delta_rule,
            "simple_gla": fused_recurrent_simple_gla, "lightning": fused_recurrent_lightning_attn}  # fmt: skip
    results = {}
    for form in theirs:
        for scheme in SCHEMES:
            for varlen in (False, True):
                x = _cast(_tokens(form, varlen, seed=9), scheme)
                (o_f, ht_f), (o_c, ht_c) = (_call_with(table[form], form, x) for table in (theirs, ours))
                results[f"{form}: {scheme}: {'varlen' if varlen else 'fixed'}"] = {
                    "dtypes": [str(o_f.dtype), str(o_c.dtype), str(ht_f.dtype), str(ht_c.dtype)],
                    "o": ((o_f.double() - o_c.double()).abs() / o_c.double().abs().clamp(min=1e-2)).max().item(),
                    "state": ((ht_f.double() - ht_c.double()).abs() / ht_c.double().abs().clamp(min=1e-2))
                    .max().item(),
                }
    return results


def _call_with(fn, form: str, x: dict):
    """``_call``'s keywords on ``fn`` (FLA's function or cula's of the same name)."""
    if form == "kda":
        return fn(**x, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  lower_bound=-5.0, output_final_state=True)  # fmt: skip
    if form == "gdn":
        return fn(**x, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  output_final_state=True)  # fmt: skip
    if form == "simple_gla":
        return fn(**x, output_final_state=True)
    return fn(**x, layer_idx=1, num_layers=4, output_final_state=True)


def test_flas_kernels_under_the_interpreter_agree():
    """FLA 0.6.0's own Triton kernels (Triton's CPU interpreter) and cula's reference on the same mixed-dtype and
    float64 calls: the same output and state dtypes, outputs within a unit in the last place of their dtype (the
    interpreter truncates an fp32 -> 16-bit store where the GPU rounds to nearest even), fp32 / float64 outputs and
    the final states within fp32 rounding (the two sum in different orders)."""
    pytest.importorskip("fla")
    results = fla_interpreter_results("test_recurrent_mixed_dtypes")
    assert len(results) == 4 * len(SCHEMES) * 2
    # relative to each value (at least 1e-2): a unit in the last place of a 16-bit output, fp32 rounding otherwise
    ulp = {"torch.float32": 1e-4, "torch.float64": 1e-4, "torch.bfloat16": 2.0**-7, "torch.float16": 2.0**-10}
    for key, r in results.items():
        o_f, o_c, ht_f, ht_c = r["dtypes"]
        assert o_f == o_c and ht_f == ht_c == "torch.float32", (key, r)
        assert r["o"] <= ulp[o_c] * 1.01 + 1e-5, (key, r)
        assert r["state"] <= 1e-4, (key, r)
