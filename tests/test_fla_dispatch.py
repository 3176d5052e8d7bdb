"""cula's backend in FLA 0.6.0's dispatch (``cula.fla_dispatch``, ``cula._fla_backend``).

On the CPU: registration on ``import cula`` in either import order (fresh interpreters), the priority against
FlashKDA, the ``FLA_CULA`` switch, the verifiers' reasons, and that FLA's calls reach cula's ``cula-sm90`` backend
(``pretend_sm90``, its kernels stubbed) or FLA's next backend (a stand-in registered after ours: FLA's Triton kernels
cannot run here), never both and never in a loop. On the GPU: FLA's ``KimiDeltaAttention`` layer, as
flash-linear-attention 0.6.0 ships it, forward and backward with cula registered against FLA alone, and FLA's
decode step.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import subprocess
import sys
import textwrap

import fla.backends as fla_backends
import fla.ops.kda as fla_kda
import pytest
import torch
from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_fused_recurrent_kda_fwd

import cula  # noqa: F401  (registers with FLA, whichever of the two comes first)
from cula import _fla_backend, fla_dispatch
from cula.backends import clear_plan_caches

HAS_CUDA = torch.cuda.is_available()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, T, H, D = 2, 16, 2, 128
# the flags FLA's KimiDeltaAttention layer passes
LAYER_FLAGS = {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True,
               "state_v_first": True}  # fmt: skip


def _chunk_registry():
    return fla_backends._function_registries[inspect.unwrap(fla_kda.chunk_kda)]


def _kda_registry():
    return fla_backends._operation_registries["kda"]


def _inputs(dtype=torch.bfloat16, K=D, device="cpu", requires_grad=False):
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(device, dt).requires_grad_(requires_grad)

    return {
        "q": rnd(B, T, H, K), "k": rnd(B, T, H, K), "v": rnd(B, T, H, D), "g": rnd(B, T, H, K), "beta": rnd(B, T, H),
        "A_log": rnd(H, dt=torch.float32), "dt_bias": rnd(H * K, dt=torch.float32),
    }  # fmt: skip


def _pool_call(dtype=torch.bfloat16, **over):
    """FLA's serving decode step: [N, 1] tokens, an fp32 state pool updated in place at int32 rows."""
    gen = torch.Generator().manual_seed(1)
    N, P = 3, 5

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(dt)

    call = {
        "q": rnd(N, 1, H, D), "k": rnd(N, 1, H, D), "v": rnd(N, 1, H, D), "g": rnd(N, 1, H, D), "beta": rnd(N, 1, H),
        "A_log": rnd(H, dt=torch.float32), "dt_bias": rnd(H * D, dt=torch.float32),
        "initial_state": rnd(P, H, D, D, dt=torch.float32),
        "ssm_state_indices": torch.tensor([4, 0, 2], dtype=torch.int32),
        "inplace_final_state": True, **LAYER_FLAGS,
    }  # fmt: skip
    call.update(over)
    return call


@pytest.fixture
def registered(monkeypatch):
    """cula's backend in FLA's chunk_kda registry, switched on (conftest switches it off for the other tests)."""
    assert fla_dispatch.registered(), fla_dispatch.status()
    monkeypatch.setenv("FLA_CULA", "1")
    return _chunk_registry()._backends["cula"]


@pytest.fixture
def sink():
    """A backend after ours in both of FLA's registries, standing in for FLA's next one: records what reaches it."""
    calls = []

    class Sink(fla_backends.BaseBackend):
        backend_type = "cula_test_sink"
        priority = 50

        def chunk_kda(self, *args, **kwargs):
            calls.append("chunk_kda")
            return "sink"

        def fused_recurrent_kda_fwd(self, *args, **kwargs):
            calls.append("fused_recurrent_kda_fwd")
            return "sink"

    registries = (_chunk_registry(), _kda_registry())
    for registry in registries:
        registry.register(Sink())
    yield calls
    for registry in registries:
        registry._backends.pop("cula_test_sink")


@pytest.fixture
def cula_kernels(pretend_sm90, monkeypatch):
    """cula's ``cula-sm90`` backends of chunk_kda and fused_recurrent_kda_fwd with their kernels stubbed: calls
    reaching them are recorded (op, dispatch arguments)."""
    from cula.kda.backends import chunk_kda_registry, fused_recurrent_kda_registry

    calls = []

    def stub(op):
        def run(**args):
            calls.append((op, args))
            return "cula"

        return run

    for registry, op in (
        (chunk_kda_registry, "chunk_kda"),
        (fused_recurrent_kda_registry, "fused_recurrent"),
    ):
        backends = [
            dataclasses.replace(b, run=stub(op), prepare=None) if b.name == "cula-sm90" else b
            for b in registry._backends
        ]
        monkeypatch.setattr(registry, "_backends", backends)
    clear_plan_caches()  # plans and verdicts made before the stubs
    yield calls
    clear_plan_caches()


_CHECK = """
import inspect, json, sys
import cula
import fla.backends as fb, fla.ops.kda as kda
from cula import fla_dispatch
chunk = fb._function_registries.get(inspect.unwrap(kda.chunk_kda))
op = fb._operation_registries.get("kda")
import fla.ops.gated_delta_rule
gdn = fb._operation_registries.get("gated_delta_rule")
print("@@" + json.dumps({
    "registered": fla_dispatch.registered(), "status": fla_dispatch.status(),
    "chunk": chunk and [(b.backend_type, b.priority) for b in chunk._get_sorted_backends()],
    "kda": op and [(b.backend_type, b.priority) for b in op._get_sorted_backends()],
    "gdn": gdn and [(b.backend_type, b.priority) for b in gdn._get_sorted_backends()],
    "hooks": [type(f).__name__ for f in sys.meta_path if "Register" in type(f).__name__],
}))
"""


def _fresh(prelude: str, **env) -> dict:
    import json

    full_env = dict(os.environ, **env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(prelude) + _CHECK], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("@@")[-1])


def test_import_cula_is_light_and_registers_when_fla_comes():
    """``import cula`` first: it loads neither FLA nor torch, and FLA's KDA ops, imported later, come registered."""
    seen = _fresh("""
        import sys
        import cula
        assert not {"fla", "torch", "triton", "cutlass"} & set(sys.modules), sorted(sys.modules)
    """)
    assert seen["registered"], seen["status"]
    assert seen["chunk"][0] == ["cula", fla_dispatch.PRIORITY]
    names = [name for name, _ in seen["chunk"]]
    assert names.index("cula") < names.index("flash_kda")
    kda = [name for name, _ in seen["kda"]]
    assert "cula" in kda and kda.index("cula") < kda.index("tilelang")
    # after FlashQLA's backend, whose published times beat cula's on the Gated DeltaNet anchors
    gdn = [name for name, _ in seen["gdn"]]
    assert ["cula", fla_dispatch.GDN_PRIORITY] in seen["gdn"] and gdn.index("flash_qla") < gdn.index("cula")
    assert seen["hooks"] == []  # the import hook is gone once it served


def test_import_cula_after_fla_registers():
    seen = _fresh("import fla.ops.kda\n")
    assert seen["registered"], seen["status"]
    assert [name for name, _ in seen["chunk"]][:2] == ["cula", "flash_kda"]


def test_dispatch_disabled_registers_nothing():
    """FLA_DISABLE_BACKEND_DISPATCH=1: FLA's functions are its undecorated ones, and cula leaves them alone."""
    seen = _fresh("", FLA_DISABLE_BACKEND_DISPATCH="1")
    assert not seen["registered"] and "FLA_DISABLE_BACKEND_DISPATCH" in seen["status"]
    assert seen["chunk"] is None


def test_priority_before_flash_kda(registered):
    from fla.ops.kda.backends.flash_kda import FlashKDABackend

    assert registered.priority == fla_dispatch.PRIORITY < FlashKDABackend.priority
    order = [b.backend_type for b in _chunk_registry()._get_sorted_backends()]
    assert order.index("cula") < order.index("flash_kda")
    assert registered.env_var == "FLA_CULA" and registered.default_enable


def test_fla_chunk_kda_runs_on_cula(registered, cula_kernels, sink):
    x = _inputs()
    assert fla_kda.chunk_kda(**x, **LAYER_FLAGS, output_final_state=True) == "cula"
    assert sink == [] and len(cula_kernels) == 1
    op, args = cula_kernels[0]
    assert (
        op == "chunk_kda"
        and args["A_log"] is x["A_log"]
        and args["state_v_first"]
        and args["output_final_state"]
    )
    assert args["scale"] == D**-0.5  # cula's validation resolved it
    # positional arguments bind as FLA's signature does
    assert (
        fla_kda.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, True, A_log=x["A_log"])
        == "cula"
    )
    assert cula_kernels[-1][1]["output_final_state"] and not cula_kernels[-1][1]["use_gate_in_kernel"]


def test_fla_training_call_runs_on_cula(registered, cula_kernels, sink):
    """FLA dispatches before its autograd Function, so a training call reaches cula's training path."""
    x = _inputs(requires_grad=True)
    assert fla_kda.chunk_kda(**x, **LAYER_FLAGS) == "cula" and sink == []


def test_packed_call_gets_the_host_bounds(registered, cula_kernels, sink):
    """A packed call without cu_seqlens_cpu: the verifier's host copy of the boundaries goes with the call."""
    x = {n: (t.flatten(0, 1)[None] if n not in ("A_log", "dt_bias") else t) for n, t in _inputs().items()}
    cu = torch.tensor([0, 5, 5, 32], dtype=torch.int32)
    assert fla_kda.chunk_kda(**x, **LAYER_FLAGS, cu_seqlens=cu) == "cula"
    args = cula_kernels[-1][1]
    assert args["cu_seqlens"] is cu and args["cu_seqlens_cpu"].tolist() == [0, 5, 5, 32]
    assert _fla_backend._host_bounds.get() is None  # handed over once, not kept
    # bad boundaries: cula declines, FLA's own path gets the call (and says what is wrong in its own words)
    assert fla_kda.chunk_kda(**x, **LAYER_FLAGS, cu_seqlens=torch.tensor([0, 5, 31])) == "sink"


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"dtype": torch.float32}, "dtype"),
        ({"K": 64}, "K=64"),
        ({"chunk_size": 32}, "chunk_size=32"),
        ({"return_intermediate_states": True}, "return_intermediate_states"),
        ({"cp_context": object()}, "cp_context"),
        ({"A_log": torch.zeros(H + 1)}, "A_log"),
        ({"bogus": 1}, "bogus"),
        # the chunked form keeps one dtype for q, k, v and no float64 (FLA's chunked kernels compute in theirs):
        # declined with cula's validation error as the reason, not raised
        ({"dtype": torch.float64}, "`q` must have dtype"),
        ({"v_dtype": torch.float32}, "`v` must have dtype bfloat16"),
    ],
)
def test_uncovered_calls_go_on_to_fla_with_a_reason(registered, cula_kernels, sink, caplog, change, reason):
    change = dict(change)
    v_dtype = change.pop("v_dtype", None)
    x = _inputs(dtype=change.pop("dtype", torch.bfloat16), K=change.pop("K", D))
    if v_dtype is not None:
        x["v"] = x["v"].to(v_dtype)
    call = {**x, **LAYER_FLAGS, **change}
    ok, why = registered.verify("chunk_kda", **call)
    assert not ok and reason in why, why
    with caplog.at_level(logging.INFO, logger="cula"):
        _fla_backend._noted.clear()
        assert fla_kda.chunk_kda(**call) == "sink"
    assert cula_kernels == [] and sink == ["chunk_kda"]
    assert any("not cula" in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_cpu_tensors_decline_with_a_reason(registered, sink):
    """Without a GPU (no pretend_sm90) cula's kernels are not available: FLA keeps the call."""
    ok, why = registered.verify("chunk_kda", **_inputs(), **LAYER_FLAGS)
    assert not ok and "CUDA" in why
    assert fla_kda.chunk_kda(**_inputs(), **LAYER_FLAGS) == "sink"


def test_fla_cula_switch(registered, cula_kernels, sink, monkeypatch):
    x = _inputs()
    monkeypatch.setenv("FLA_CULA", "0")
    assert fla_kda.chunk_kda(**x, **LAYER_FLAGS) == "sink"
    assert fla_fused_recurrent_kda_fwd(**_pool_call()) == "sink"
    monkeypatch.setenv("FLA_CULA", "1")
    assert fla_kda.chunk_kda(**x, **LAYER_FLAGS) == "cula"
    assert fla_fused_recurrent_kda_fwd(**_pool_call()) == "cula"
    assert [op for op, _ in cula_kernels] == ["chunk_kda", "fused_recurrent"]
    assert sink == ["chunk_kda", "fused_recurrent_kda_fwd"]


def test_cula_backend_forced_elsewhere_does_not_loop(registered, cula_kernels, sink, monkeypatch):
    """CULA_BACKEND=fla: cula's own fla backend calls FLA's dispatched chunk_kda, whose verifier must decline."""
    from cula.kda import chunk_kda

    monkeypatch.setenv("CULA_BACKEND", "fla")
    x = _inputs()
    ok, why = registered.verify("chunk_kda", **x, **LAYER_FLAGS)
    assert not ok and "CULA_BACKEND=fla" in why
    assert (
        chunk_kda(**x, **LAYER_FLAGS) == "sink"
    )  # cula -> FLA's dispatch -> past cula -> FLA's next backend
    assert cula_kernels == []


def test_nested_calls_are_not_dispatched_back(registered, pretend_sm90, sink, monkeypatch):
    """While cula runs a call FLA dispatched to it, a nested FLA call (as cula's own fla backend makes) skips cula."""
    from cula.kda.backends import chunk_kda_registry

    x = _inputs()
    nested = []

    def run(**args):
        nested.append(fla_kda.chunk_kda(**x, **LAYER_FLAGS))
        return "cula"

    backends = [dataclasses.replace(b, run=run, prepare=None) if b.name == "cula-sm90" else b
                for b in chunk_kda_registry._backends]  # fmt: skip
    monkeypatch.setattr(chunk_kda_registry, "_backends", backends)
    clear_plan_caches()
    try:
        assert fla_kda.chunk_kda(**x, **LAYER_FLAGS) == "cula"
    finally:
        clear_plan_caches()
    assert nested == ["sink"] and sink == ["chunk_kda"]
    assert not _fla_backend._inside.get()  # reset after the call


def test_fla_decode_step_runs_on_cula(registered, cula_kernels, sink, monkeypatch):
    from cula.kda import fused_recurrent as impl

    checks = []
    real = impl._checked
    monkeypatch.setattr(impl, "_checked", lambda call: checks.append(1) or real(call))
    call = _pool_call()
    for _ in range(3):
        assert fla_fused_recurrent_kda_fwd(**call) == "cula"
    assert sink == [] and len(cula_kernels) == 3
    assert cula_kernels[0][1]["ssm_state_indices"] is call["ssm_state_indices"]
    # validated once by the verifier and once by cula's own plan; repeats hit both caches
    assert len(checks) == 2


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"ssm_state_indices": None, "inplace_final_state": False, "output_final_state": True}, "in-place"),
        ({"dtype": torch.float32}, "dtype"),
        ({"ssm_state_indices": torch.tensor([4, 0, 2], dtype=torch.int64)}, "int32"),
        # a serving engine's bf16 / fp16 cache: FLA's kernel takes it (cula's validation too), cula's kernel does not
        ({"pool_dtype": torch.bfloat16}, "bfloat16 state pool"),
        ({"pool_dtype": torch.float16}, "float16 state pool"),
        # q, k, v of their own dtypes, or float64 (FLA's kernel reads each as fp32; its tests make such calls): cula's
        # validation takes them, its kernel does not (a reason of the backend's, not a validation error)
        ({"v_dtype": torch.float32}, "q / k / v dtypes torch.bfloat16 / torch.bfloat16 / torch.float32"),
        ({"k_dtype": torch.float16}, "q / k / v dtypes torch.bfloat16 / torch.float16 / torch.bfloat16"),
        ({"dtype": torch.float64, "A_log": torch.zeros(H, dtype=torch.float64)}, "q dtype torch.float64"),
    ],
)
def test_uncovered_decode_calls_go_on_to_fla(registered, cula_kernels, sink, change, reason):
    change = dict(change)
    pool_dtype = change.pop("pool_dtype", None)
    token_dtypes = {n: change.pop(f"{n}_dtype") for n in ("k", "v") if f"{n}_dtype" in change}
    call = _pool_call(dtype=change.pop("dtype", torch.bfloat16), **change)
    call.update({n: call[n].to(dt) for n, dt in token_dtypes.items()})
    if pool_dtype is not None:
        call["initial_state"] = call["initial_state"].to(pool_dtype)
    if call["ssm_state_indices"] is None:  # FLA's public fused_recurrent_kda: a state a sequence
        call["initial_state"] = call["initial_state"][:3].clone()
    ok, why = _kda_registry()._backends["cula"].verify("fused_recurrent_kda_fwd", **call)
    assert not ok and reason in why, why
    assert fla_fused_recurrent_kda_fwd(**call) == "sink" and cula_kernels == []


def test_decode_verifier_reads_like_the_function(registered, cula_kernels, sink, monkeypatch):
    """The serving verifier prepares a call as cula's function does: bf16 gate parameters read as fp32 (FLA's layers
    hand a bf16 model's in), transpose_state_layout ignored (as both functions do); and a packed [1, N] call is
    declined before any validation (no device-to-host read of its boundaries, a step and a layer at a time)."""
    from cula.kda import fused_recurrent as impl

    ours = _kda_registry()._backends["cula"]
    call = _pool_call(A_log=torch.zeros(H, dtype=torch.bfloat16), dt_bias=torch.zeros(H * D, dtype=torch.bfloat16))
    assert ours.verify("fused_recurrent_kda_fwd", **call) == (True, None)
    assert ours.verify("fused_recurrent_kda_fwd", **_pool_call(transpose_state_layout=True)) == (True, None)
    monkeypatch.setattr(impl, "_checked", lambda call: pytest.fail("validated a call cula declines anyway"))
    packed = {n: (t.transpose(0, 1) if n in ("q", "k", "v", "g", "beta") else t) for n, t in _pool_call().items()}
    ok, why = ours.verify("fused_recurrent_kda_fwd", **packed, cu_seqlens=torch.arange(4, dtype=torch.int32))
    assert not ok and "cu_seqlens" in why


def test_wy_dqkg_stage_without_a_binary_runs_flas_kernel(monkeypatch):
    """A stage-6 variant with no binary (a wheel without the DSL; the variant outside its manifest) is met when the
    stage runs, after the verifier said yes: FLA's kernel runs it at cula's launch instead of FLA's dispatch raising."""
    from cula.cache import VariantUnavailableError
    from cula.kda import fla_backward

    def stage(*args):
        if not fla_backward._FLA_STAGES_ONLY.get():
            raise VariantUnavailableError("no binary of this variant")
        return "fla's kernel"

    monkeypatch.setattr(fla_backward, "wy_dqkg_ours", stage)
    t = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16)
    assert _fla_backend._wy_dqkg(t, t, t, t, t.float(), t[..., 0], t[..., :64], t, t, t, t) == "fla's kernel"


def test_wy_dqkg_stage_verifier_reasons(registered):
    """The backward stage cula runs (its kernel, or FLA's at cula's launch): only on SM90 CUDA, bf16/fp16, K = V = 128;
    FLA's graph mode is no reason against it."""
    ours = _kda_registry()._backends["cula"]
    t = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16)
    stage = {"q": t, "k": t, "v": t, "v_new": t, "g": t.float(), "beta": t[..., 0], "A": t[..., :64], "h": t,
             "do": t, "dh": t, "dv": t, "scale": 1.0}  # fmt: skip
    for change, reason in (({}, "CUDA"), ({"use_graph": True}, "CUDA"), ({"q": t.float()}, "dtype"),
                           ({"bogus": 1}, "bogus")):  # fmt: skip
        ok, why = ours.verify("chunk_kda_bwd_wy_dqkg_fused", **{**stage, **change})
        assert not ok and reason in why, why


def test_other_kda_functions_stay_fla(registered):
    """FLA asks every backend of its 'kda' registry about each of its functions there: cula answers only for its
    own (no implementation for the rest, so FLA moves on)."""
    ours = _kda_registry()._backends["cula"]
    for name in ("kda_gate_fwd", "chunk_kda_fwd_intra", "chunk_kda_bwd_intra", "recompute_w_u_fwd"):
        assert ours.get_implementation(name) is None
    for name in ("chunk_kda", "fused_recurrent_kda_fwd", "chunk_kda_bwd_wy_dqkg_fused"):
        assert ours.get_implementation(name) is not None


def _gdn_registry():
    return fla_backends._operation_registries["gated_delta_rule"]


@pytest.fixture
def gdn(pretend_sm90, monkeypatch):
    """FLA's chunk_gated_delta_rule with cula's ``cula-sm90`` Gated DeltaNet backend stubbed (calls reaching it are
    recorded with their dispatch arguments) and a stand-in for FLA's next backend after ours (``"sink"``)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from cula.gated_delta_rule.backends import chunk_gdn_registry

    calls = []

    def run(**args):
        calls.append(("cula", args))
        return "cula"

    backends = [dataclasses.replace(b, run=run, prepare=None) if b.name == "cula-sm90" else b
                for b in chunk_gdn_registry._backends]  # fmt: skip
    monkeypatch.setattr(chunk_gdn_registry, "_backends", backends)

    class Sink(fla_backends.BaseBackend):
        backend_type = "cula_test_sink"
        priority = 50

        def chunk_gated_delta_rule(self, *args, **kwargs):
            calls.append(("sink", kwargs))
            return "sink"

    _gdn_registry().register(Sink())
    clear_plan_caches()
    yield chunk_gated_delta_rule, calls
    clear_plan_caches()
    _gdn_registry()._backends.pop("cula_test_sink")


def _gdn_inputs(requires_grad=False, packed=False):
    gen = torch.Generator().manual_seed(2)
    B_, T_ = (1, 2 * T) if packed else (B, T)

    def rnd(*shape, dt=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dt).requires_grad_(requires_grad)

    return {
        "q": rnd(B_, T_, H, D), "k": rnd(B_, T_, H, D), "v": rnd(B_, T_, 2 * H, D), "g": rnd(B_, T_, 2 * H),
        "beta": rnd(B_, T_, 2 * H), "A_log": rnd(2 * H, dt=torch.float32), "dt_bias": rnd(2 * H, dt=torch.float32),
    }  # fmt: skip


GDN_FLAGS = {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True,
             "output_final_state": True}  # fmt: skip


def test_fla_gated_delta_rule_runs_on_cula(registered, gdn, monkeypatch):
    """FLA's chunk_gated_delta_rule (its 'gated_delta_rule' registry) reaches cula's backend, inference where the
    GPU's entry puts it on cula and training, its arguments validated by cula (scale resolved, GVA, fused gate);
    FLA_CULA=0 sends it on to FLA's next backend."""
    from cula.gated_delta_rule.plan import GDN_TUNING

    fla_gdn, calls = gdn
    x = _gdn_inputs()
    with GDN_TUNING.override((9, 0), inference_chunk_on_cula=True):
        assert fla_gdn(**x, **GDN_FLAGS) == "cula"
    who, args = calls[-1]
    assert who == "cula" and args["A_log"] is x["A_log"] and args["use_gate_in_kernel"]
    assert args["scale"] == D**-0.5 and args["v"].shape[2] == 2 * H
    with GDN_TUNING.override((9, 0), inference_chunk_on_cula=False):
        ok, why = registered.verify("chunk_gated_delta_rule", **x, **GDN_FLAGS)
        assert not ok and "inference_chunk_on_cula" in why
        assert fla_gdn(**x, **GDN_FLAGS) == "sink"
        # a training call: cula's (FLA's own backward refuses Hopper with PyTorch's Triton)
        assert fla_gdn(**_gdn_inputs(requires_grad=True), **GDN_FLAGS) == "cula"
    monkeypatch.setenv("FLA_CULA", "0")
    assert fla_gdn(**_gdn_inputs(requires_grad=True), **GDN_FLAGS) == "sink"


def test_fla_gated_delta_rule_packed_and_uncovered_calls(registered, gdn):
    """A packed call without cu_seqlens_cpu takes the verifier's host copy of its boundaries; calls cula does not run
    (bad boundaries, context parallel, an unknown keyword, other head sizes) go on to FLA with the reason."""
    from cula.gated_delta_rule.plan import GDN_TUNING

    fla_gdn, calls = gdn
    x = _gdn_inputs(packed=True)
    cu = torch.tensor([0, 7, 7, 2 * T], dtype=torch.int32)
    with GDN_TUNING.override((9, 0), inference_chunk_on_cula=True):
        assert fla_gdn(**x, **GDN_FLAGS, cu_seqlens=cu) == "cula"
        args = calls[-1][1]
        assert args["cu_seqlens"] is cu and args["cu_seqlens_cpu"].tolist() == [0, 7, 7, 2 * T]
        assert _fla_backend._host_bounds.get() is None
        # packed training keeps no host copy: without one cula runs it in FLA's graph mode, eager or captured alike
        assert fla_gdn(**_gdn_inputs(requires_grad=True, packed=True), **GDN_FLAGS, cu_seqlens=cu) == "cula"
        args = calls[-1][1]
        assert args["cu_seqlens"] is cu and args["cu_seqlens_cpu"] is None
        for change, reason in (
            ({"cu_seqlens": torch.tensor([0, 7, 2 * T - 1], dtype=torch.int32)}, "cu_seqlens"),
            ({"cp_context": object()}, "cp_context"),
            ({"bogus": 1}, "bogus"),
        ):
            ok, why = registered.verify("chunk_gated_delta_rule", **x, **GDN_FLAGS, **change)
            assert not ok and reason in why, why
            assert fla_gdn(**x, **GDN_FLAGS, **change) == "sink"
        small = {n: (t[..., :64] if n in ("q", "k", "v") else t) for n, t in _gdn_inputs().items()}
        ok, why = registered.verify("chunk_gated_delta_rule", **small, **GDN_FLAGS)
        assert not ok and "K=64" in why, why
    # FLA's other Gated DeltaNet functions have no implementation of ours: FLA moves on to its own
    ours = _gdn_registry()._backends["cula"]
    assert ours.get_implementation("chunk_gated_delta_rule") is not None
    for name in ("chunk_gated_delta_rule_fwd_intra", "recompute_w_u_fwd"):
        assert ours.get_implementation(name) is None


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((1, 2, 3, 4, 5), {}),
        ((1, 2, 3, 4, 5, 0.5, None, True), {"A_log": 7, "chunk_size": 64}),
        ((), {"q": 1, "k": 2, "v": 3, "g": 4, "beta": 5, "cu_seqlens": 6, "transpose_state_layout": True}),
    ],
)
def test_bind_matches_inspect(args, kwargs):
    from cula.kda.chunk import chunk_kda

    bound = inspect.signature(chunk_kda).bind(*args, **kwargs)
    bound.apply_defaults()
    assert _fla_backend._bind(chunk_kda, args, kwargs) == dict(bound.arguments)


@pytest.mark.parametrize(
    "args, kwargs, error",
    [
        ((1, 2, 3, 4), {}, "missing"),
        ((1, 2, 3, 4, 5), {"q": 1}, "multiple values"),
        ((0,) * 30, {}, "positional"),
    ],
)
def test_bind_refuses_what_python_refuses(args, kwargs, error):
    from cula.kda.chunk import chunk_kda

    with pytest.raises(TypeError, match=error):
        _fla_backend._bind(chunk_kda, args, kwargs)


# ---------------------------------------------------------------------------------------------------------- GPU


def _kda_layer_class(monkeypatch):
    """FLA's KimiDeltaAttention from flash-linear-attention 0.6.0 (fla-core has no fla.layers). That package's
    ``__init__`` imports every layer, some of which need transformers; the KDA layer's module needs only
    ``fla.layers.utils`` and fla-core, so where the package cannot be imported whole (no transformers, or only those
    files shipped, as to the GPU machine) the layer's module is loaded, unchanged, under a bare ``fla.layers``."""
    import importlib
    import importlib.util

    spec = importlib.util.find_spec("fla.layers")
    if spec is None:
        pytest.skip(
            "flash-linear-attention 0.6.0 (fla.layers) is not installed: pip install 'cula[fla-layers]'"
        )
    try:
        return importlib.import_module("fla.layers.kda").KimiDeltaAttention
    except ModuleNotFoundError:
        pass
    monkeypatch.setitem(sys.modules, "fla.layers", importlib.util.module_from_spec(spec))
    return importlib.import_module("fla.layers.kda").KimiDeltaAttention


@pytest.fixture
def launches(monkeypatch):
    """Counts of cula's chunk forward (general and bound launches) and backward entries."""
    from cula.kda import fla_backward
    from cula.kda import forward as chunk_fwd

    count = {"forward": 0, "backward": 0}

    def counted(fn, what):
        def wrapper(*args, **kwargs):
            count[what] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(chunk_fwd, "chunk_kda_fwd_sm90", counted(chunk_fwd.chunk_kda_fwd_sm90, "forward"))
    monkeypatch.setattr(
        chunk_fwd, "prepare_chunk_kda_fwd_sm90", counted(chunk_fwd.prepare_chunk_kda_fwd_sm90, "forward")
    )
    monkeypatch.setattr(fla_backward, "chunk_kda_bwd", counted(fla_backward.chunk_kda_bwd, "backward"))
    clear_plan_caches()  # a cached plan would skip prepare_chunk_kda_fwd_sm90
    return count


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
def test_fla_kda_layer_on_cula_matches_fla(monkeypatch, launches, training):
    """FLA's KimiDeltaAttention layer, unchanged, bf16 (B=2, T=2048, 16 heads of 128): its chunk_kda calls run on
    cula's kernels through FLA's dispatch, and the output and gradients match FLA alone (``FLA_CULA=0``) within FLA's
    tolerances."""
    from cula.testing import assert_close

    KimiDeltaAttention = _kda_layer_class(monkeypatch)
    assert fla_dispatch.registered(), fla_dispatch.status()
    torch.manual_seed(0)
    Bl, Tl, Hl = 2, 2048, 16
    layer = KimiDeltaAttention(hidden_size=Hl * D, head_dim=D, num_heads=Hl, mode="chunk").to(
        "cuda", torch.bfloat16
    )
    # the gate parameters stay fp32, as mixed-precision training keeps them (and cula's kernels take them)
    layer.A_log = torch.nn.Parameter(layer.A_log.detach().float())
    layer.dt_bias = torch.nn.Parameter(layer.dt_bias.detach().float())
    layer.train(training)
    x = torch.randn(Bl, Tl, Hl * D, device="cuda", dtype=torch.bfloat16)
    do = torch.randn_like(x)

    def run(switch):
        monkeypatch.setenv("FLA_CULA", switch)
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(training)
        with torch.set_grad_enabled(training):
            o = layer(xi)[0]
        if not training:
            return o, {}
        (o * do).sum().backward()
        return o.detach(), {"x": xi.grad, "A_log": layer.A_log.grad, "dt_bias": layer.dt_bias.grad}

    o_fla, g_fla = run("0")
    assert launches == {"forward": 0, "backward": 0}
    o_cula, g_cula = run("1")
    assert launches["forward"] >= 1 and launches["backward"] == (1 if training else 0), launches
    assert_close("o", o_fla, o_cula, 5e-3)
    for name, tol in (("x", 8e-3), ("A_log", 2e-2), ("dt_bias", 2e-2)):
        if name in g_fla:
            assert_close(f"d{name}", g_fla[name], g_cula[name], tol)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_fla_own_backward_takes_culas_stage_launch(monkeypatch):
    """A training call FLA's own path keeps (here: cula's chunk verifier made to decline) still gets cula's side of
    the backward's heaviest stage (cula's kernel or FLA's at cula's launch) through FLA's 'kda' registry, with FLA's
    gradients."""
    from cula import _fla_backend
    from cula.kda import fla_backward
    from cula.testing import assert_close

    assert fla_dispatch.registered(), fla_dispatch.status()
    monkeypatch.setattr(_fla_backend, "_chunk_decision", lambda args, kwargs: (False, "declined by the test"))
    calls = []
    real = fla_backward.wy_dqkg_ours
    monkeypatch.setattr(fla_backward, "wy_dqkg_ours", lambda *a: calls.append(1) or real(*a))
    x = _inputs(device="cuda")
    do = torch.randn_like(x["v"])
    grads = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("FLA_CULA", switch)
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
        o, _ = fla_kda.chunk_kda(**leaves, **LAYER_FLAGS)
        (o.float() * do).sum().backward()
        grads[switch] = {n: t.grad for n, t in leaves.items()}
        assert len(calls) == (0 if switch == "0" else 1)
    for name in ("q", "k", "v"):
        assert_close(f"d{name}", grads["0"][name], grads["1"][name], 8e-3)
    for name in ("g", "beta", "A_log", "dt_bias"):
        assert_close(f"d{name}", grads["0"][name], grads["1"][name], 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_fla_decode_step_on_cula_matches_fla(monkeypatch):
    """FLA's fused_recurrent_kda_fwd in its serving form, through FLA's dispatch: cula's kda_decode against FLA's
    kernel, output and updated state pool."""
    from cula.backends import clear_plan_caches
    from cula.kda import decode
    from cula.testing import assert_close, assert_rows_rewritten

    assert fla_dispatch.registered(), fla_dispatch.status()
    calls = []
    real = decode._prepare_cula_sm90  # binds the kda_decode kernel for cula's serving plan
    monkeypatch.setattr(decode, "_prepare_cula_sm90", lambda **k: calls.append(1) or real(**k))
    clear_plan_caches()
    call = {n: (v.cuda() if isinstance(v, torch.Tensor) else v) for n, v in _pool_call().items()}
    results = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("FLA_CULA", switch)
        pool = call["initial_state"].clone()
        o, final = fla_fused_recurrent_kda_fwd(**dict(call, initial_state=pool))
        assert final is pool
        results[switch] = o, pool
    assert calls, "cula's decode kernel did not run"
    assert_close("o", results["0"][0], results["1"][0], 5e-3)
    assert_close("state pool", results["0"][1], results["1"][1], 5e-3)
    rows, before = call["ssm_state_indices"].long(), call["initial_state"]
    assert_rows_rewritten("state pool rows", results["1"][1], before, rows, ref=results["0"][1][rows],
                          others_untouched=True)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_fla_gated_delta_rule_on_cula_matches_fla(monkeypatch):
    """FLA's chunk_gated_delta_rule through FLA's dispatch, inference with GVA and the fused gate, fixed length and
    packed: cula's kernels against FLA's own, output and final state."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from cula.backends import clear_plan_caches
    from cula.gated_delta_rule.backends import chunk_gdn_registry
    from cula.gated_delta_rule.plan import GDN_TUNING
    from cula.testing import assert_close, poisoned_allocations

    assert fla_dispatch.registered(), fla_dispatch.status()
    ran = []

    def spied(b):  # cula-sm90's run and its plans' prepare, recorded
        prepare = None if b.prepare is None else (lambda **k: ran.append("prepare") or b.prepare(**k))
        return dataclasses.replace(b, run=lambda **k: ran.append("run") or b.run(**k), prepare=prepare)

    monkeypatch.setattr(chunk_gdn_registry, "_backends",
                        [spied(b) if b.name == "cula-sm90" else b for b in chunk_gdn_registry._backends])  # fmt: skip
    clear_plan_caches()
    for packed in (False, True):
        x = {n: t.cuda() for n, t in _gdn_inputs(packed=packed).items()}
        extra = {"cu_seqlens": torch.tensor([0, 7, 7, 2 * T], dtype=torch.int32, device="cuda")} if packed else {}
        results = {}
        for switch in ("0", "1"):
            monkeypatch.setenv("FLA_CULA", switch)
            with torch.inference_mode(), GDN_TUNING.override((9, 0), inference_chunk_on_cula=True), \
                    poisoned_allocations():  # (every output NaN until written)
                results[switch] = chunk_gated_delta_rule(**x, **GDN_FLAGS, **extra)
        assert not results["1"][0].isnan().any() and not results["1"][1].isnan().any()
        assert_close("o", results["0"][0], results["1"][0], 5e-3)
        assert_close("final state", results["0"][1], results["1"][1], 5e-3)
    clear_plan_caches()  # (plans bound to the spied backend)
    assert ran, "cula's Gated DeltaNet backend did not run"
