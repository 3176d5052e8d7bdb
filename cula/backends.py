"""Call-time backend selection.

Each op has one ``Registry``. A backend declares a priority (lower runs first), an availability
probe on the tensors' device (packages installed, compute capability) and a ``supports`` verifier
on the actual, already validated arguments returning ``(ok, reason)``. The first backend that is
available and supports the call runs; ``CULA_BACKEND=<name>`` forces one and raises if it cannot
run. The ``cula`` logger says at INFO, once per distinct case, which backend ran and why the
others declined.

Hot entry points (decode, called once per generated token) memoise the decision: ``Registry.plan``
returns a launch function for validated arguments, which a backend may specialise once (``prepare``:
resolve the compiled kernel, fix what depends only on shapes and strides); ``PlanCache`` keys those
launches on a call signature (``tensor_sig`` of every tensor plus the flags), so a repeated call skips
validation and selection. A signature holds everything validation and selection read.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import math
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from cula.cache import VariantUnavailableError, dsl_installed

logger = logging.getLogger("cula")

# os.environ.get encodes its key on every call (~1 us on the device host, a tenth of a decode step's host
# budget); plan keys read variables such as CULA_BACKEND through CPython's own bytes-keyed mirror of the
# environment, which os.environ's setters and deleters keep current.
_ENV_DATA = getattr(os.environ, "_data", None)


def env_reader(name: str) -> Callable[[], Any]:
    """A reader of environment variable ``name`` for plan keys: its value, undecoded (bytes on POSIX), or None."""
    if _ENV_DATA is None:
        return lambda: os.environ.get(name)
    key = os.environ.encodekey(name)
    return lambda: _ENV_DATA.get(key)


_read_backend = env_reader("CULA_BACKEND")


def forced_backend() -> Any:
    """``CULA_BACKEND`` for a plan key: its value, undecoded (bytes on POSIX), or None when unset."""
    return _read_backend()


Verdict = tuple[bool, "str | None"]


@dataclass(frozen=True)
class Backend:
    name: str
    priority: int
    run: Callable[..., Any]
    available: Callable[[torch.device], Verdict]
    supports: Callable[..., Verdict]
    # prepare(**args) -> launch(**args) specialised for calls with the same signature as args, or None
    prepare: Callable[..., Callable[..., Any] | None] | None = None


def always(*_args, **_kwargs) -> Verdict:
    return True, None


def cuda_only(device: torch.device) -> Verdict:
    return (True, None) if device.type == "cuda" else (False, f"needs a CUDA tensor, got {device.type}")


@functools.lru_cache(maxsize=None)
def has_package(package: str) -> bool:
    # find_spec costs tens of microseconds; installed packages do not change while a process runs.
    return importlib.util.find_spec(package) is not None


def package_on_cuda(package: str) -> Callable[[torch.device], Verdict]:
    """Availability probe for a backend that needs ``package`` installed and a CUDA tensor."""

    def probe(device: torch.device) -> Verdict:
        ok, why = cuda_only(device)
        if not ok:
            return ok, why
        if not has_package(package):
            return False, f"package {package!r} is not installed"
        return True, None

    return probe


class BackendUnavailableError(NotImplementedError):
    """No registered backend can run these arguments (or the forced one cannot)."""


class Registry:
    """The backends of one public function, tried in priority order."""

    def __init__(self, op: str):
        self.op = op
        self._backends: list[Backend] = []
        self._logged: set[tuple] = set()

    def register(
        self,
        name: str,
        priority: int,
        available: Callable[[torch.device], Verdict] = always,
        supports: Callable[..., Verdict] = always,
        prepare: Callable[..., Callable[..., Any] | None] | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            if any(b.name == name for b in self._backends):
                raise ValueError(f"{self.op}: backend {name!r} registered twice")
            self._backends.append(Backend(name, priority, fn, available, supports, prepare))
            self._backends.sort(key=lambda b: b.priority)
            return fn

        return wrap

    @property
    def names(self) -> list[str]:
        return [b.name for b in self._backends]

    def _verdict(self, backend: Backend, device: torch.device, args: dict[str, Any]) -> Verdict:
        ok, why = backend.available(device)
        if ok:
            ok, why = backend.supports(**args)
        return ok, why

    def availability(self, name: str, device: torch.device) -> Verdict:
        """Whether backend ``name`` can run anything on ``device`` (its availability probe alone)."""
        for backend in self._backends:
            if backend.name == name:
                return backend.available(device)
        return False, f"{self.op} has no backend {name!r}"

    def verdict(self, name: str, device: torch.device, args: dict[str, Any]) -> Verdict:
        """Whether backend ``name`` can run ``args`` (validated arguments) on ``device``, with the reason if not."""
        for backend in self._backends:
            if backend.name == name:
                return self._verdict(backend, device, args)
        return False, f"{self.op} has no backend {name!r}"

    def select(self, device: torch.device, args: dict[str, Any], skip: tuple = ()) -> Backend:
        """The backend that will run ``args`` (a dict of the public function's arguments); ``skip``: ``(name,
        reason)`` of backends that already failed to provide a kernel for them."""
        forced = os.environ.get("CULA_BACKEND")
        if forced:
            match = [b for b in self._backends if b.name == forced]
            if not match:
                raise BackendUnavailableError(
                    f"CULA_BACKEND={forced!r} is not a backend of {self.op}; known: {', '.join(self.names)}"
                )
            ok, why = self._verdict(match[0], device, args)
            ok, why = (False, dict(skip)[forced]) if forced in dict(skip) else (ok, why)
            if not ok:
                raise BackendUnavailableError(f"CULA_BACKEND={forced!r} cannot run {self.op}: {why}")
            self._log(match[0].name, (("forced by CULA_BACKEND", ""),))
            return match[0]
        declined, skipped = [], dict(skip)
        for backend in self._backends:
            if backend.name in skipped:
                ok, why = False, skipped[backend.name]
            else:
                ok, why = self._verdict(backend, device, args)
            if ok:
                self._log(backend.name, tuple(declined))
                return backend
            declined.append((backend.name, why or "declined"))
        table = "; ".join(f"{name}: {why}" for name, why in declined)
        raise BackendUnavailableError(f"no backend of {self.op} supports these arguments ({table})")

    def dispatch(self, device: torch.device, args: dict[str, Any]) -> Any:
        skip: tuple = ()
        while True:
            backend = self.select(device, args, skip) if skip else self.select(device, args)
            try:
                return backend.run(**args)
            except VariantUnavailableError as err:  # raised before any launch: the next backend runs the call
                skip += ((backend.name, str(err)),)

    def plan(
        self, device: torch.device, args: dict[str, Any], positional: tuple[str, ...] | None = None
    ) -> Callable[..., Any]:
        """A launch function for ``args`` and every later call with the same signature (see PlanCache).

        With ``positional`` (argument names), the launch takes those arguments' values in that order and the rest
        stays as in ``args``; a backend's ``prepare`` must then return a launch of that signature."""
        skip: tuple = ()
        while True:
            backend = self.select(device, args, skip) if skip else self.select(device, args)
            try:
                launch = backend.prepare(**args) if backend.prepare is not None else None
            except VariantUnavailableError as err:
                skip += ((backend.name, str(err)),)
                continue
            if launch is not None:
                if positional is not None and backend.name.startswith("cula"):
                    return self._prepared_falling_back(device, backend, launch, args, positional, skip)
                return launch
            break
        # cula's kernels may still meet a variant without a binary: then this plan moves to the next backend for good
        # (other backends' runs stay unwrapped: a frame less per call)
        run = self._falling_back(device, backend, skip) if backend.name.startswith("cula") else backend.run
        if positional is None:
            return run
        # the rest of this call's arguments; its positional tensors are not kept (the plan outlives the call)
        fixed = {name: value for name, value in args.items() if name not in positional}

        def launch(*values):
            return run(**fixed, **dict(zip(positional, values)))

        return launch

    def _prepared_falling_back(self, device: torch.device, backend: Backend, launch: Callable[..., Any],
                               args: dict[str, Any], positional: tuple[str, ...], skip: tuple) -> Callable[..., Any]:
        """``launch`` (``backend.prepare``'s, taking the ``positional`` arguments' values), and for a call in which
        it meets a variant without a binary, that call on the next backend: such a launch picks some paths per call
        (a packed call cut in time, by its lengths), whose kernels its first call did not need. The error is raised
        before any launch that writes an output."""
        fixed = {name: value for name, value in args.items() if name not in positional}

        def run(*values):
            try:
                return launch(*values)
            except VariantUnavailableError as err:
                call = dict(fixed, **dict(zip(positional, values)))
                return self.select(device, call, skip + ((backend.name, str(err)),)).run(**call)

        run.__dict__.update(launch.__dict__)  # checks_arguments and the like
        return run

    def _falling_back(self, device: torch.device, backend: Backend, skip: tuple) -> Callable[..., Any]:
        """``backend.run``, or from its first ``VariantUnavailableError`` on, the next backend's (chosen on that
        call's arguments: the plan keeps none of its first call's tensors)."""
        chosen = [backend.run]

        def run(**call):
            try:
                return chosen[0](**call)
            except VariantUnavailableError as err:
                if chosen[0] is not backend.run:
                    raise
                chosen[0] = self.select(device, call, skip + ((backend.name, str(err)),)).run
                return chosen[0](**call)

        return run

    def _log(self, chosen: str, declined: tuple) -> None:
        key = (chosen, declined)
        if key in self._logged:
            return
        self._logged.add(key)
        reasons = ", ".join(f"{name}: {why}" for name, why in declined)
        logger.info("%s -> %s%s", self.op, chosen, f" ({reasons})" if reasons else "")


def cula_kernels_on(arch: tuple[int, int], needs: tuple[str, ...] = ()) -> Callable[[torch.device], Verdict]:
    """Availability of our CuTe DSL kernels: a CUDA tensor on ``arch``, TVM-FFI and ``needs`` installed, and the
    DSL to compile them or a prebuilt wheel's binaries (a variant missing from those declines per call)."""

    def probe(device: torch.device) -> Verdict:
        from cula.arch import device_arch

        ok, why = cuda_only(device)
        if not ok:
            return ok, why
        found = device_arch(device)
        if found != arch:
            return False, f"kernels target sm_{arch[0]}{arch[1]}, device is sm_{found[0]}{found[1]}"
        for package in ("tvm_ffi", *needs):
            if not has_package(package):
                return False, f"package {package!r} is not installed"
        if not dsl_installed() and not _has_prebuilt(arch):
            return False, f"no prebuilt kernels for sm_{arch[0]}{arch[1]}a and nvidia-cutlass-dsl is not installed"
        return True, None

    return probe


@functools.lru_cache(maxsize=None)
def _has_prebuilt(arch: tuple[int, int]) -> bool:
    from cula.cache import has_prebuilt

    return has_prebuilt(arch)


def fla_reexports(package: str, fla_module: str, names: tuple[str, ...]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that hands out FLA's own functions for the names of ``fla_module`` cula does not
    accelerate, so that swapping ``fla.ops.X`` for ``cula.X`` in an import line keeps working for every name FLA
    exports. FLA is imported on first use (``import cula`` stays free of triton)."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(fla_module), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def needs_grad(*tensors) -> bool:
    """Whether autograd will record this call (our kernels are forward-only so far)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def tensor_sig(t: torch.Tensor | None) -> tuple | None:
    """What validation and backend selection read of a tensor: shape, strides, dtype, device, 16-byte alignment."""
    if t is None:
        return None
    try:  # attribute reads only, no isinstance: this runs for every tensor of every decode call
        return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15
    except (AttributeError, TypeError):
        return (type(t),)  # not a tensor: validation will say so


def token_sigs(q, k, v, g, beta) -> tuple:
    """``tensor_sig`` of the five token tensors of a call, written out in one frame (five calls of it cost a
    microsecond or two of a repeated call's host time); on anything that is not a tensor, the five ``tensor_sig``
    (validation will then say what is wrong)."""
    try:
        return (
            q.shape, q.stride(), q.dtype, q.device, q.data_ptr() & 15,
            k.shape, k.stride(), k.dtype, k.device, k.data_ptr() & 15,
            v.shape, v.stride(), v.dtype, v.device, v.data_ptr() & 15,
            g.shape, g.stride(), g.dtype, g.device, g.data_ptr() & 15,
            beta.shape, beta.stride(), beta.dtype, beta.device, beta.data_ptr() & 15,
        )  # fmt: skip
    except (AttributeError, TypeError):
        return (tensor_sig(q), tensor_sig(k), tensor_sig(v), tensor_sig(g), tensor_sig(beta))


def varlen_token_sigs(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu) -> tuple | None:
    """The plan-key part of a packed-sequence call's token tensors without their common length (which changes
    from call to call), or None (validate in full) unless all five are contiguous tensors of one length."""
    try:  # written out, no generator: this runs for every packed call
        qs, ks, vs, gs, bs = q.shape, k.shape, v.shape, g.shape, beta.shape
        T = qs[1]
        if (ks[1] != T or vs[1] != T or gs[1] != T or bs[1] != T or not q.is_contiguous() or not k.is_contiguous()
                or not v.is_contiguous() or not g.is_contiguous() or not beta.is_contiguous()):  # fmt: skip
            return None
        # one token: is_contiguous ignores the size-1 time dimension's stride, which the key then leaves out, while a
        # bound launch takes it as the token stride its TMA descriptors need aligned
        if T == 1:
            from cula._validate import is_row_major  # (cula._validate imports this module)

            if not all(map(is_row_major, (q, k, v, g, beta))):
                return None
        return (
            qs[0], qs[2:], q.dtype, q.device, q.data_ptr() & 15, ks[0], ks[2:], k.dtype, k.device, k.data_ptr() & 15,
            vs[0], vs[2:], v.dtype, v.device, v.data_ptr() & 15, gs[0], gs[2:], g.dtype, g.device, g.data_ptr() & 15,
            bs[0], bs[2:], beta.dtype, beta.device, beta.data_ptr() & 15,
            tensor_sig(cu_seqlens), cu_seqlens_cpu.shape, cu_seqlens_cpu.dtype, cu_seqlens_cpu.device,
        )  # fmt: skip
    except (AttributeError, IndexError, TypeError):
        return None  # not tensors of at least two dimensions: validation will say so
    except RuntimeError:
        return None  # tensors without storage (torch.func transforms): validated in full


# the argument types a plan key holds as they are (anything else is validated in full every call)
PLAIN_SCALARS = frozenset((type(None), bool, int, float, str))


def scalars_key(values: tuple) -> tuple | None:
    """A plan key's part for a call's scalar arguments: their types, their values and each float's sign (1, 1.0 and
    True are one dict key, and so are 0.0 and -0.0); None (validate the call in full) when one is not a plain Python
    value."""
    if any(type(x) not in PLAIN_SCALARS for x in values):
        return None
    return (*map(type, values), *values, *(math.copysign(1.0, x) for x in values if type(x) is float))


def call_signature(call: dict[str, Any], tensors: tuple[str, ...], scalars: tuple[str, ...], *extra) -> tuple | None:
    """A PlanCache key for ``call``: ``tensor_sig`` of the named tensors, the named scalars' values, ``CULA_BACKEND``
    and ``extra``; None (validate this call in full) when a scalar is not a plain Python value."""
    values = tuple(call[n] for n in scalars)
    if any(type(x) not in PLAIN_SCALARS for x in values):
        return None
    return (*(tensor_sig(call[n]) for n in tensors), *values, forced_backend(), *extra)


class PlanCache:
    """Launch functions by call signature, for entry points whose Python overhead matters (decode).

    The key must hold everything the validation and the backend choice depend on: every tensor's
    ``tensor_sig``, the None-ness and type of optional scalars, the flags, and ``CULA_BACKEND``. A call
    with a new signature is validated in full (and raises on bad input before anything is cached).
    """

    def __init__(self, maxsize: int = 1024):
        self.maxsize = maxsize
        self._plans: dict[tuple, Callable[..., Any]] = {}
        _PLAN_CACHES.add(self)

    def get(self, key: tuple) -> Callable[..., Any] | None:
        return self._plans.get(key)

    def lookup(self, key: tuple, plan: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        """The launch cached for ``key``, or ``plan()`` (full validation, may raise) cached under it."""
        launch = self._plans.get(key)
        if launch is None:
            launch = plan()
            self.put(key, launch)
        return launch

    def put(self, key: tuple, launch: Callable[..., Any]) -> None:
        if len(self._plans) >= self.maxsize:  # a serving loop sees a handful of signatures; never grow unbounded
            self._plans.clear()
        self._plans[key] = launch

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


class StepPlans:
    """The launches of a decode step closure (``kda_decode_step``, ``lightning_decode_step``): by the call's full
    signature, validated with its first call; and, where the launch's compiled TVM-FFI entry checks its own
    arguments before it launches (``launch.checks_arguments``: every dtype, the sizes the tensors share, strides,
    16-byte alignment, one device for all), also by the step's short key (the shapes and dtypes the launch choice
    reads), a few attribute reads a step instead of five per tensor. A call the entry refuses is validated in full,
    which raises cula's own error for bad input or plans the new signature."""

    def __init__(self, maxsize: int = 64):
        self.full = PlanCache(maxsize)
        self.short = PlanCache(maxsize)
        _STEP_PLANS.add(self)  # clear_plan_caches forgets the last launch too
        # the last short key run and its launch: a serving loop repeats one signature, and a step that compares
        # its key with this one skips the closures and lookups of ``run`` (the decode steps' fast path)
        self.last_key: tuple | None = None
        self.last_launch: Callable | None = None

    def run(self, key: tuple | None, call: Callable[[Callable], Any], full_key: Callable[[], tuple],
            plan: Callable[[], Callable]) -> Any:  # fmt: skip
        """``call(launch)`` with the launch for ``key`` (None: no short key, e.g. not tensors), else for
        ``full_key()`` (planned by ``plan()``, which validates and may raise)."""
        launch = None if key is None else self.short.get(key)
        if launch is not None:
            try:
                result = call(launch)
                self.last_key, self.last_launch = key, launch
                return result
            except Exception:  # noqa: BLE001  (refused before any launch: find out why by validating in full)
                pass
        launch = self.full.lookup(full_key(), plan)
        result = call(launch)
        if key is not None and getattr(launch, "checks_arguments", False):
            self.short.put(key, launch)
            self.last_key, self.last_launch = key, launch
        return result

    def clear(self) -> None:
        self.full.clear()
        self.short.clear()
        self.last_key = self.last_launch = None

    def __len__(self) -> int:
        """The validated signatures (the full cache)."""
        return len(self.full)


def without_autocast(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with torch.autocast off for the device of its first tensor argument (positional or keyword: FLA
    passes keywords), so that its matrix products stay in their inputs' dtype: cula's PyTorch maths (the reference
    backend, the torch stages FLA's dispatch hands cula) computes in the dtype it chose, as FLA's Triton kernels do
    whatever autocast says, and eager then agrees with a compiled call (whose op runs below autocast's dispatch key).
    Autocast's backward replays the forward's state, so one inside a training step's backward is switched off here
    too."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        device = next((a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        off = (torch.autocast(device.type, enabled=False) if device is not None and device.type in ("cpu", "cuda")
               else contextlib.nullcontext())  # fmt: skip
        with off:
            return fn(*args, **kwargs)

    return run


def capturing(t: torch.Tensor) -> bool:
    """Whether ``t`` is a CUDA tensor and the current stream is capturing a CUDA graph (False on the CPU, where
    torch's query would raise)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class ConstantTensors:
    """Small tensors that depend on nothing but a device and a tag (identity slots, a row of ones, a time split's
    combine weights without a decay), made once: a repeated call launches nothing for them. Never a value computed
    from a caller's tensor: a write through ``param.data`` changes a parameter without bumping its version counter,
    so no cache keyed on the tensor can see it (model loaders and RL weight syncs write so), and such values are made
    at each call. While a CUDA graph is captured the tensors are made inside the capture and never cached: the graph
    owns them, so no later eviction can free memory a graph reads."""

    def __init__(self, maxsize: int = 512):
        self.maxsize = maxsize
        self._entries: dict[tuple, Any] = {}

    def get(self, device: torch.device, tag: tuple, make: Callable[[], Any]) -> Any:
        """``make()``'s value for (``device``, ``tag``)."""
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return make()
        key = (device, tag)
        hit = self._entries.get(key)
        if hit is not None:
            return hit
        value = make()
        if len(self._entries) >= self.maxsize:
            del self._entries[next(iter(self._entries))]
        self._entries[key] = value
        return value

    def clear(self) -> None:
        self._entries.clear()


_PLAN_CACHES: weakref.WeakSet[PlanCache] = weakref.WeakSet()
_STEP_PLANS: weakref.WeakSet[StepPlans] = weakref.WeakSet()


def clear_plan_caches() -> None:
    """Forget every cached launch, so the next call of each signature is validated and dispatched again
    (what a caller that records the chosen backend, e.g. the benchmarks, needs)."""
    for cache in list(_PLAN_CACHES):
        cache.clear()
    for plans in list(_STEP_PLANS):
        plans.last_key = plans.last_launch = None
