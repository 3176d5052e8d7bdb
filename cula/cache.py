"""The one compile cache for CuTe DSL kernels.

``cute.compile`` never caches, and tracing costs 0.5-3 s, so every launcher goes through
``compiled_kernel(key, build)``. The key must hold everything that changes the trace: the kernel
class, dtypes, static head sizes, feature flags, and the target architecture. Sizes that vary per
call (batch, T, number of sequences) are symbolic in the fake tensors and stay out of the key.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from cula.arch import compile_target

_CACHE: dict[tuple, Any] = {}
_COMPILE_SECONDS: dict[tuple, float] = {}
_LOCK = threading.Lock()


def compile_options(arch: tuple[int, int], extra: str = "") -> str:
    """cute.compile options: explicit target (so a GPU-less machine compiles for it) and TVM-FFI."""
    return f"--gpu-arch {compile_target(arch)} --enable-tvm-ffi {extra}".strip()


def compiled_kernel(key: tuple, build: Callable[[], Any]) -> Any:
    """Return the compiled kernel for ``key``, calling ``build()`` (which runs cute.compile) once."""
    fn = _CACHE.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _CACHE.get(key)
        if fn is None:
            start = time.perf_counter()
            fn = build()
            _COMPILE_SECONDS[key] = time.perf_counter() - start
            _CACHE[key] = fn
    return fn


def compile_seconds() -> dict[tuple, float]:
    """First-call compile time of every variant compiled in this process (for benchmarks)."""
    return dict(_COMPILE_SECONDS)


def clear() -> None:
    with _LOCK:
        _CACHE.clear()
        _COMPILE_SECONDS.clear()
