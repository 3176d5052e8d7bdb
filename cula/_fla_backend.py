"""The FLA backend ``cula.fla_dispatch`` registers: verifiers and implementations for FLA 0.6.0's dispatched KDA
functions, its ``chunk_gated_delta_rule`` and its gated ``chunk_bwd_dqkwg`` (see that module). Imported on
registration, when FLA (hence torch) is loaded; cula's op modules are imported on the first call.
"""

from __future__ import annotations

import contextvars
import logging
import os

import torch

from cula.backends import PlanCache, call_signature, capturing
from cula.fla_dispatch import BACKEND_TYPE, CULA_BACKEND, ENV_VAR, GDN_PRIORITY, PRIORITY

logger = logging.getLogger("cula")

# set while a call FLA dispatched to cula runs: a nested FLA call (cula's own fla backend) must not come back
_inside = contextvars.ContextVar("cula_fla_dispatch_inside", default=False)
# (cu_seqlens, its host copy) the chunk verifier read for the call FLA is about to hand cula (see _chunk_decision)
_host_bounds = contextvars.ContextVar("cula_fla_dispatch_host_bounds", default=None)
_noted: set[tuple[str, str]] = set()


def _note(entry: str, reason: str | None) -> None:
    """Log at INFO, once per distinct case, where FLA's call of ``entry`` went and why."""
    key = (entry, reason or "")
    if key in _noted or len(_noted) > 1024:
        return
    _noted.add(key)
    if reason is None:
        logger.info("FLA dispatch: %s -> %s", entry, BACKEND_TYPE)
    else:
        logger.info(
            "FLA dispatch: %s -> not %s (%s); FLA's next backend runs it", entry, BACKEND_TYPE, reason
        )


_binders: dict = {}


def _bind(fn, args: tuple, kwargs: dict) -> dict:
    """``fn``'s parameters bound to a call's ``args`` and ``kwargs``, defaults filled in and keywords that are not
    parameters under ``"kwargs"`` (what ``fn``'s body sees as its locals): ``inspect.Signature.bind``'s result,
    at a fraction of its cost."""
    binder = _binders.get(fn)
    if binder is None:
        import inspect

        params = inspect.signature(fn).parameters.values()
        names = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
        defaults = {p.name: p.default for p in params if p.default is not p.empty}
        position = {name: i for i, name in enumerate(names)}
        binder = _binders[fn] = (names, position, defaults, tuple(n for n in names if n not in defaults))
    names, position, defaults, required = binder
    if len(args) > len(names):
        raise TypeError(f"{fn.__name__}() takes {len(names)} positional arguments but {len(args)} were given")
    scope = dict(defaults)
    scope.update(zip(names, args))
    extra = {}
    for name, value in kwargs.items():
        if name in position:
            if position[name] < len(args):
                raise TypeError(f"{fn.__name__}() got multiple values for argument {name!r}")
            scope[name] = value
        else:
            extra[name] = value
    missing = [n for n in required if n not in scope]
    if missing:
        raise TypeError(f"{fn.__name__}() missing required arguments: {', '.join(missing)}")
    scope["kwargs"] = extra
    return scope


def _forced_elsewhere() -> str | None:
    forced = os.environ.get("CULA_BACKEND")
    if forced and forced != CULA_BACKEND:
        return f"CULA_BACKEND={forced} sends cula's calls to {forced}"
    return None


def _verdict(entry: str, decide, args: tuple, kwargs: dict, guarded: bool = True):
    """``decide(args, kwargs)``'s ``(ok, reason)``, declining calls ``CULA_BACKEND`` sends elsewhere and, for
    ``guarded`` entries (those whose implementation calls cula's public function), nested calls; cula's validation
    errors become reasons (FLA's own path then raises its own)."""
    if guarded and _inside.get():
        ok, why = False, "a call made while cula runs a call FLA dispatched to it (recursion guard)"
    else:
        why = _forced_elsewhere()
        ok = why is None
        if ok:
            try:
                ok, why = decide(args, kwargs)
            except Exception as error:
                ok, why = False, f"cula's validation: {type(error).__name__}: {error}"
    _note(entry, why)
    return ok, why


def _run(fn, args: tuple, kwargs: dict):
    token = _inside.set(True)
    try:
        return fn(*args, **kwargs)
    finally:
        _inside.reset(token)


def _chunk_decision(args: tuple, kwargs: dict):
    """As ``cula.kda.chunk_kda`` validates and selects its call. A packed call without ``cu_seqlens_cpu`` has its
    boundaries copied to the host here, once: validation reads them, and the call FLA then hands cula gets the copy
    (``_chunk_kda``), which saves cula's own validation a second device-to-host copy and lets the call take cula's
    packed-call plans."""
    from cula._validate import gate_params_fp32
    from cula.kda import chunk as impl
    from cula.kda.backends import chunk_kda_registry

    _host_bounds.set(None)
    call = impl._full_call(_bind(impl.chunk_kda, args, kwargs))
    # what chunk_kda does first: bf16 / fp16 gate parameters (a model cast to bf16) read as fp32
    call["A_log"], call["dt_bias"] = gate_params_fp32(call["A_log"], call["dt_bias"])
    # (not in FLA's graph mode, whose chunk list cula builds on the device from cu_seqlens alone)
    ok, why, bounds = _available_with_host_bounds(chunk_kda_registry, call, call["use_graph"])
    if not ok:
        return ok, why
    call = impl._checked(call)
    return _verdict_keeping_bounds(chunk_kda_registry, call, bounds)


def _available_with_host_bounds(registry, call: dict, on_device: bool = False):
    """A chunk decision's first steps: decline where ``registry``'s cula-sm90 backend cannot run on q's device at all
    (before any host read), else give a packed call without ``cu_seqlens_cpu`` its host copy (in ``call``), unless
    ``on_device``: the call's path without the copy builds its chunk lists on the device, and must keep doing so.
    Returns ``(ok, why, bounds)``, ``bounds`` the ``(cu_seqlens, host copy)`` made here or None."""
    q = call["q"]
    if isinstance(q, torch.Tensor):
        ok, why = registry.availability(CULA_BACKEND, q.device)
        if not ok:
            return ok, why, None
    cu = call["cu_seqlens"]
    if not (isinstance(cu, torch.Tensor) and call["cu_seqlens_cpu"] is None and not on_device and not capturing(cu)):
        return True, None, None
    call["cu_seqlens_cpu"] = cu.detach().to("cpu")
    return True, None, (cu, call["cu_seqlens_cpu"])


def _verdict_keeping_bounds(registry, checked: dict, bounds):
    """cula-sm90's verdict on validated arguments; where it takes the call, the host copy of its boundaries made by
    ``_available_with_host_bounds`` waits for the implementation FLA calls next (``_with_host_bounds``)."""
    ok, why = registry.verdict(CULA_BACKEND, checked["q"].device, checked)
    if ok and bounds is not None:
        _host_bounds.set(bounds)
    return ok, why


def _gdn_chunk_decision(args: tuple, kwargs: dict):
    """As ``cula.gated_delta_rule.chunk_gated_delta_rule`` validates and selects its call; a packed call without
    ``cu_seqlens_cpu`` gets its host copy here, once, as ``_chunk_decision``'s (inference only: see below)."""
    from cula._validate import gate_kwargs_fp32, state_fp32
    from cula.backends import needs_grad
    from cula.gated_delta_rule import chunk as impl
    from cula.gated_delta_rule.backends import chunk_gdn_registry

    _host_bounds.set(None)
    call = _bind(impl.chunk_gated_delta_rule, args, kwargs)
    extra = call.pop("kwargs")
    if extra:  # what chunk_gated_delta_rule does first, as chunk_kda's decision
        extra = gate_kwargs_fp32(extra)
    initial_state = state_fp32(call["initial_state"])
    # packed training without cu_seqlens_cpu runs in FLA's graph mode (chunk lists built on the device, as its
    # captures need): the boundaries are not copied for it, so that eager and captured steps take the same path
    training = needs_grad(call["q"], call["k"], call["v"], call["g"], call["beta"], initial_state, extra.get("A_log"),
                          extra.get("dt_bias"))  # fmt: skip
    ok, why, bounds = _available_with_host_bounds(chunk_gdn_registry, call, on_device=training)
    if not ok:
        return ok, why
    checked = impl._checked(
        call["q"], call["k"], call["v"], call["g"], call["beta"], call["scale"], initial_state,
        call["output_final_state"], call["use_qk_l2norm_in_kernel"], call["use_beta_sigmoid_in_kernel"],
        call["allow_neg_eigval"], call["state_v_first"], call["cu_seqlens"], call["cu_seqlens_cpu"],
        call["chunk_indices"], call["cp_context"], dict(extra),
    )  # fmt: skip
    return _verdict_keeping_bounds(chunk_gdn_registry, checked, bounds)


_RECURRENT_FLAGS = (
    "output_final_state", "inplace_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
    "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
)  # fmt: skip
_recurrent_verdicts = PlanCache()  # cleared with cula's plans (cula.backends.clear_plan_caches)


def _recurrent_decision(args: tuple, kwargs: dict):
    """As ``cula.kda.fused_recurrent_kda_fwd`` builds, validates and selects its call; serving engines call FLA's
    function once per token, so a fixed-length call's verdict is kept under cula's own plan key for that function
    (``call_signature``: everything its validation and selection read)."""
    from cula._validate import take_extra_kwargs
    from cula.kda import fused_recurrent as impl
    from cula.kda.backends import fused_recurrent_kda_registry, serving_form_verdict

    call = _bind(impl.fused_recurrent_kda_fwd, args, kwargs)
    # (transpose_state_layout: ignored, as by FLA's function and cula's)
    take_extra_kwargs("fused_recurrent_kda_fwd", call.pop("kwargs"), ("transpose_state_layout",))
    for name in _RECURRENT_FLAGS:
        call[name] = bool(call[name])
    # (keyed on the gate parameters as given: a decode step's verdict then costs no cast of bf16 ones)
    key = (
        None if call["cu_seqlens"] is not None else call_signature(call, impl._TENSOR_ARGS, impl._SCALAR_ARGS)
    )
    if key is not None:
        verdict = _recurrent_verdicts.get(key)
        if verdict is not None:
            return verdict
    call["A_log"], call["dt_bias"] = impl._gate_params(
        call["A_log"], call["dt_bias"], call["v"], call["use_gate_in_kernel"], call["lower_bound"]
    )
    q = call["q"]
    if isinstance(q, torch.Tensor):  # what declines without validation (no host read for a packed call)
        ok, why = fused_recurrent_kda_registry.availability(CULA_BACKEND, q.device)
        if ok:
            ok, why = serving_form_verdict(q, call["cu_seqlens"], call["ssm_state_indices"],
                                           call["inplace_final_state"], call["num_accepted_tokens"])  # fmt: skip
        if not ok:
            return ok, why
    try:
        checked = impl._checked(call)
    except Exception as error:
        verdict = False, f"cula's validation: {type(error).__name__}: {error}"
    else:
        verdict = fused_recurrent_kda_registry.verdict(CULA_BACKEND, checked["q"].device, checked)
    if key is not None:
        _recurrent_verdicts.put(key, verdict)
    return verdict


def _wy_dqkg_decision(args: tuple, kwargs: dict):
    from cula.backends import cula_kernels_on
    from cula.kda import fla_backward

    call = _bind(_wy_dqkg_params, args, kwargs)
    if call["kwargs"]:
        return False, f"arguments FLA 0.6.0's stage does not take: {', '.join(call['kwargs'])}"
    ok, why = fla_backward.wy_dqkg_verdict(*(call[n] for n in ("q", "k", "v", "v_new", "A", "h", "do", "dh", "dv")),
                                           call["chunk_size"])  # fmt: skip
    if ok:  # (the DSL, or the wheel's binaries, to run cula's kernel with)
        ok, why = cula_kernels_on((9, 0))(call["q"].device)
    return ok, why


def _wy_dqkg_params(
    q, k, v, v_new, g, beta, A, h, do, dh, dv, scale=None, state_v_first=False, cu_seqlens=None, chunk_size=64,
    chunk_indices=None, chunk_offsets=None, use_graph=False,
):  # fmt: skip
    """The parameters of FLA 0.6.0's ``chunk_kda_bwd_wy_dqkg_fused``, for ``_bind``."""


def _wy_dqkg(*args, **kwargs):
    from cula.cache import VariantUnavailableError
    from cula.kda import fla_backward

    c = _bind(_wy_dqkg_params, args, kwargs)
    call = (
        c["q"], c["k"], c["v"], c["v_new"], c["g"], c["beta"], c["A"], c["h"], c["do"], c["dh"], c["dv"],
        c["scale"], c["state_v_first"], c["cu_seqlens"], c["chunk_size"], c["chunk_indices"], c["use_graph"],
    )  # fmt: skip
    try:
        return fla_backward.wy_dqkg_ours(*call)
    except VariantUnavailableError as err:  # raised before any launch: FLA's Triton kernel at cula's launch
        _note("chunk_kda_bwd_wy_dqkg_fused", f"{err}; FLA's kernel runs it")
        with fla_backward.fla_stages_only():
            return fla_backward.wy_dqkg_ours(*call)


def _dqkwg_decision(args: tuple, kwargs: dict):
    """The gated calls of FLA's ``chunk_bwd_dqkwg`` that FLA's own Triton kernel refuses (Hopper, Triton 3.4.0 to
    3.7.0, FLA issue #640) and no TileLang backend takes; everything else stays FLA's (faster there)."""
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    from cula.common.chunk_o import chunk_bwd_dqkwg

    call = _bind(chunk_bwd_dqkwg, args, kwargs)
    if call["kwargs"]:
        return False, f"arguments FLA 0.6.0's stage does not take: {', '.join(call['kwargs'])}"
    if call["g"] is None:
        return False, "ungated (no g): FLA's Triton kernel is correct there"
    if not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1):
        return False, "FLA's Triton kernel is correct on this GPU and Triton"
    if _tilelang_takes(args, kwargs):
        return False, "FLA's TileLang backend runs this call of the gated stage"
    return True, None


def _tilelang_takes(args: tuple, kwargs: dict) -> bool:
    """Whether FLA's registered TileLang backend of its common stages would run this ``chunk_bwd_dqkwg`` call (its
    verifier refuses some: Simple GLA's fp32 states with 16-bit q, for one)."""
    import fla.backends

    registry = getattr(fla.backends, "_operation_registries", {}).get("common")
    tilelang = None if registry is None else getattr(registry, "_backends", {}).get("tilelang")
    if tilelang is None or not (tilelang.is_available() and tilelang.is_enabled()):
        return False
    return bool(tilelang.verify("chunk_bwd_dqkwg", *args, **kwargs)[0])


def _chunk_bwd_dqkwg(*args, **kwargs):
    from cula.common.chunk_o import chunk_bwd_dqkwg

    return chunk_bwd_dqkwg(*args, **kwargs)


def _chunk_kda(*args, **kwargs):
    from cula.kda import chunk_kda

    return chunk_kda(*args, **_with_host_bounds(kwargs))


def _with_host_bounds(kwargs: dict) -> dict:
    """``kwargs`` with the host copy of its boundaries the verifier just made (FLA calls the verifier, then the
    implementation), handed over once."""
    bounds = _host_bounds.get()
    if bounds is not None:
        _host_bounds.set(None)
        if kwargs.get("cu_seqlens") is bounds[0] and "cu_seqlens_cpu" not in kwargs:
            kwargs["cu_seqlens_cpu"] = bounds[1]
    return kwargs


def _chunk_gated_delta_rule(*args, **kwargs):
    from cula.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(*args, **_with_host_bounds(kwargs))


def _fused_recurrent_kda_fwd(*args, **kwargs):
    from cula.kda import fused_recurrent_kda_fwd

    return fused_recurrent_kda_fwd(*args, **kwargs)


_classes: dict = {}


def backend_class(base: type) -> type:
    """cula's backend as a subclass of FLA's ``BaseBackend`` (defined on registration: FLA is not imported before)."""
    if base in _classes:
        return _classes[base]

    class CulaBackend(base):
        """cula's kernels (``cula.fla_dispatch``); off with ``FLA_CULA=0``. Methods are named after the FLA functions
        they stand in for, their verifiers ``<name>_verifier``."""

        backend_type = BACKEND_TYPE
        package_name = None
        env_var = ENV_VAR
        default_enable = True
        priority = PRIORITY

        def chunk_kda_verifier(self, *args, **kwargs):
            return _verdict("fla.ops.kda.chunk_kda", _chunk_decision, args, kwargs)

        def chunk_kda(self, *args, **kwargs):
            return _run(_chunk_kda, args, kwargs)

        def chunk_gated_delta_rule_verifier(self, *args, **kwargs):
            return _verdict("fla.ops.gated_delta_rule.chunk_gated_delta_rule", _gdn_chunk_decision, args, kwargs)

        def chunk_gated_delta_rule(self, *args, **kwargs):
            return _run(_chunk_gated_delta_rule, args, kwargs)

        def fused_recurrent_kda_fwd_verifier(self, *args, **kwargs):
            return _verdict("fla.ops.kda.fused_recurrent_kda_fwd", _recurrent_decision, args, kwargs)

        def fused_recurrent_kda_fwd(self, *args, **kwargs):
            return _run(_fused_recurrent_kda_fwd, args, kwargs)

        def chunk_kda_bwd_wy_dqkg_fused_verifier(self, *args, **kwargs):
            return _verdict(
                "fla.ops.kda.chunk_kda_bwd_wy_dqkg_fused", _wy_dqkg_decision, args, kwargs, guarded=False
            )

        def chunk_kda_bwd_wy_dqkg_fused(self, *args, **kwargs):
            # cula's kernel or FLA's Triton kernel at our launch: nothing dispatches back
            return _wy_dqkg(*args, **kwargs)

        def chunk_bwd_dqkwg_verifier(self, *args, **kwargs):
            return _verdict("fla.ops.common.chunk_bwd_dqkwg", _dqkwg_decision, args, kwargs, guarded=False)

        def chunk_bwd_dqkwg(self, *args, **kwargs):
            return _chunk_bwd_dqkwg(*args, **kwargs)  # torch's matrix products: nothing dispatches back

    CulaBackend.__qualname__ = CulaBackend.__name__
    _classes[base] = CulaBackend
    return CulaBackend


def gdn_backend_class(base: type) -> type:
    """cula's backend in FLA's ``'gated_delta_rule'`` registry: ``backend_class(base)`` after FlashQLA's
    (``GDN_PRIORITY``; see ``cula.fla_dispatch``)."""
    key = ("gated_delta_rule", base)
    if key not in _classes:
        _classes[key] = type("CulaGatedDeltaRuleBackend", (backend_class(base),), {"priority": GDN_PRIORITY})
    return _classes[key]
