"""The one cache of compiled CuTe DSL kernels: in memory, in a prebuilt wheel, on disk, or compiled now.

``cute.compile`` never caches, and tracing costs 0.5-6 s a variant (plus ~1 s, 2.6 s on the H200's host, to import
the DSL at all), so every launcher goes through ``compiled_kernel(key, build)``. The key must hold everything that
changes the trace: the kernel class, dtypes, static head sizes, feature flags, and the target architecture. Sizes
that vary per call (batch, T, number of sequences) are symbolic in the fake tensors and stay out of the key.

On an in-process miss a variant is looked up, in order:

1. in the wheel's prebuilt manifest (``cula/_prebuilt/manifest.json``: key -> shared object + symbol, written by
   ``scripts/build_wheel.sh``), loaded with ``tvm_ffi.load_module``: no DSL needed, well under a millisecond;
2. in the on-disk cache (``CULA_CACHE_DIR``, default ``~/.cache/cula``), where every variant JIT-compiled by an
   earlier process was exported and linked, under a directory named by everything that can make an old binary
   wrong (the kernel sources, DSL, TVM-FFI and Python versions, the CUDA flavours of the DSL's runtime); a hit
   neither imports nor runs the DSL;
3. compiled now by ``build()`` (needs ``nvidia-cutlass-dsl``, the ``cula[jit]`` extra), then stored on disk.

Without the DSL and without a prebuilt entry it raises ``VariantUnavailableError``; the backend registries turn that
into a decline with the reason logged, so the call runs on the next backend (FLA's kernels).

``CULA_PREBUILT=0`` ignores the manifest, ``CULA_DISK_CACHE=0`` the disk cache (the test suite sets both, so
that its stubbed compiles never meet a real binary).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from cula.arch import compile_target

logger = logging.getLogger("cula")

_CACHE: dict[tuple, Any] = {}
_COMPILE_SECONDS: dict[tuple, float] = {}
_ORIGINS: dict[tuple, str] = {}
_MODULES: list[Any] = []  # loaded shared objects and compiled wrappers, kept alive with the functions they hold
_LOCK = threading.RLock()
_PACKAGE = Path(__file__).resolve().parent
PREBUILT_DIR = _PACKAGE / "_prebuilt"
MANIFEST_NAME = "manifest.json"
# while recording (see ``recording``), in this thread or task only: the build function of every variant looked up,
# by key, and the launch callback (None: none), called with each launch of a recorded stub as ``(key, args)``
_RECORDING: contextvars.ContextVar[tuple[dict[tuple, Callable[[], Any]], Callable | None] | None] = (
    contextvars.ContextVar("cula_cache_recording", default=None)
)


class VariantUnavailableError(RuntimeError):
    """No prebuilt binary of a kernel variant and no CuTe DSL to compile it: the backend declines the call."""


def compile_options(arch: tuple[int, int], extra: str = "") -> str:
    """cute.compile options: explicit target (so a GPU-less machine compiles for it) and TVM-FFI."""
    return f"--gpu-arch {compile_target(arch)} --enable-tvm-ffi {extra}".strip()


def key_text(key: tuple) -> str:
    """The key as stable text (``repr``: strings, numbers, booleans, None, tuples and torch dtypes print the same
    in every process), the manifest's and the disk cache's name for a variant."""
    return repr(key)


def key_digest(key: tuple) -> str:
    return hashlib.sha256(key_text(key).encode()).hexdigest()[:24]


def symbol_name(key: tuple) -> str:
    """The exported TVM-FFI function's name (``__tvm_ffi_<name>`` in the object file)."""
    return "cula_" + key_digest(key)


def compiled_kernel(key: tuple, build: Callable[[], Any]) -> Any:
    """Return the compiled kernel for ``key``: from memory, the prebuilt manifest, the disk cache, or ``build()``
    (which runs cute.compile) once per process."""
    rec = _RECORDING.get()
    if rec is not None:
        rec[0].setdefault(key, build)
        return functools.partial(_recorded_stub, key, rec[1])
    fn = _CACHE.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _CACHE.get(key)
        if fn is None:
            start = time.perf_counter()
            fn, origin = _obtain(key, build)
            _COMPILE_SECONDS[key] = time.perf_counter() - start
            _ORIGINS[key] = origin
            _CACHE[key] = fn
    return fn


def _recorded_stub(key: tuple, on_launch: Callable | None, *args, **kwargs) -> None:
    """What a launcher gets while recording: a kernel that does nothing (and notes its arguments when asked to).
    Like the bare TVM-FFI entry a launcher calls (``positional_entry``), it takes no keyword arguments."""
    if kwargs:
        raise TypeError(f"compiled kernel {key_text(key)} called with keyword arguments {sorted(kwargs)}")
    if on_launch is not None:
        on_launch(key, args)


@contextlib.contextmanager
def recording(on_launch: Callable[[tuple, tuple], None] | None = None) -> Iterator[dict[tuple, Callable[[], Any]]]:
    """Within the block, ``compiled_kernel`` compiles and loads nothing: it records each key with its build
    function and hands back a no-op kernel. ``cula.variants`` drives the launchers this way to list the variants
    they select. With ``on_launch``, each call of such a kernel calls ``on_launch(key, args)``, for checking the
    arguments against the variant's compiled signature (``cula.testing.check_launch``) without a GPU. Other
    threads look their kernels up as usual meanwhile."""
    seen: dict[tuple, Callable[[], Any]] = {}
    token = _RECORDING.set((seen, on_launch))
    try:
        yield seen
    finally:
        _RECORDING.reset(token)


def recorded_build(key: tuple) -> Callable[[], Any]:
    """Within ``recording``: the build function recorded for ``key``."""
    rec = _RECORDING.get()
    if rec is None:
        raise RuntimeError("recorded_build is only meaningful inside cula.cache.recording()")
    return rec[0][key]


def _obtain(key: tuple, build: Callable[[], Any]) -> tuple[Any, str]:
    fn = _prebuilt_function(key)
    if fn is not None:
        return fn, "prebuilt"
    disk = disk_cache_dir()
    if disk is not None:
        fn = _load_from_disk(disk, key)
        if fn is not None:
            return fn, "disk"
    if not dsl_installed():
        raise VariantUnavailableError(
            f"kernel variant {key_text(key)} is not in cula's prebuilt manifest "
            f"({prebuilt_status()}) and nvidia-cutlass-dsl is not installed to compile it (pip install 'cula[jit]')"
        )
    try:
        fn = build()
    except ImportError as err:  # a DSL installed but broken, or shadowed: the next backend runs the call
        raise VariantUnavailableError(f"kernel variant {key_text(key)} could not be compiled: {err}") from err
    if disk is not None:
        _store_on_disk(disk, key, fn)
    return positional_entry(fn), "jit"


def positional_entry(fn: Any) -> Any:
    """The bare TVM-FFI function under a freshly compiled ``fn``: what a prebuilt or disk-cached variant already is.
    The DSL wraps every compiled entry with positional parameters in a Python keyword-argument layer (a method call
    and a generated forwarding function, ~0.3 us a launch on the CI machine's CPU); cula's launchers pass every
    argument positionally and no pointer-address argument, so they call the function beneath, and a variant runs
    the same way whichever of the three places it came from. Anything else (a test's stub, a DSL without the
    accessor, a function compiled where no GPU is present, which has no loaded entry) is returned as it is."""
    unwrap = getattr(fn, "__tvm_ffi_object__", None)
    if unwrap is None or getattr(getattr(fn, "execution_args", None), "has_pointer_address_arg_specs", True):
        return fn
    # (an entry with defaults or keyword-only parameters needs the wrapper to fill them: none of cula's has any)
    forward = getattr(fn, "_kwargs_wrapper", None)
    if getattr(forward, "__defaults__", None) or getattr(forward, "__kwdefaults__", None):
        return fn
    bare = unwrap()
    if bare is None:
        return fn
    _MODULES.append(fn)  # its CUDA libraries are unloaded when it is collected
    return bare


def compile_seconds() -> dict[tuple, float]:
    """Seconds each variant took to obtain in this process (compile, or load) (for benchmarks)."""
    return dict(_COMPILE_SECONDS)


def origins() -> dict[tuple, str]:
    """Where each variant of this process came from: ``prebuilt``, ``disk`` or ``jit``."""
    return dict(_ORIGINS)


def clear() -> None:
    with _LOCK:
        _CACHE.clear()
        _COMPILE_SECONDS.clear()
        _ORIGINS.clear()


@functools.cache
def dsl_installed() -> bool:
    """Whether the CuTe DSL is installed (its distribution, or the libraries' one that holds its code; not merely some
    top-level ``cutlass`` module: other packages have taken that name). Read from the metadata: finding
    ``cutlass.cute`` would import the DSL."""
    return _version("nvidia-cutlass-dsl") is not None or _version("nvidia-cutlass-dsl-libs-base") is not None


def _switch_on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


# ------------------------------------------------------------------------------------------------ fingerprints
@functools.cache
def source_digest() -> str:
    """Digest of everything a compiled variant's bits depend on inside cula: the kernel sources (``cula/ops``),
    the arch table and the compile options. Any edit there invalidates the disk cache and a stale manifest."""
    h = hashlib.sha256()
    files = sorted((_PACKAGE / "ops").rglob("*.py")) + [_PACKAGE / "arch.py"]
    for path in files:
        h.update(path.relative_to(_PACKAGE).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    h.update(compile_options((9, 0)).encode())
    return h.hexdigest()[:24]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _dsl_cuda_flavours() -> tuple[str, ...]:
    """The CUDA flavours of the DSL's runtime libraries installed (``cu12``, ``cu13``): an exported object embeds
    the CUDA runtime version it was built for, which decides what it loads against."""
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None or not spec.submodule_search_locations:
        return ()
    found = set()
    for root in spec.submodule_search_locations:
        found.update(p.name for p in Path(root).glob("cu[0-9]*") if any((p / "lib").glob("libcute_dsl_runtime*")))
    return tuple(sorted(found))


# the CuTe DSL's environment variables that change the code it makes (of those base_dsl/env_manager.py marks as
# affecting compilation; not ARCH, which cula's explicit --gpu-arch overrides, nor those that only stop, cache or warn)
_DSL_COMPILE_ENV = tuple(f"CUTE_DSL_{name}" for name in (
    "COMPILER_BACKEND", "COMPILER_OPT", "DEBUG", "ENABLE_ASSERTIONS", "ENABLE_PYIR", "ENABLE_TVM_FFI", "LINEINFO",
    "LOC_TRACEBACKS",
))  # fmt: skip


@functools.cache
def build_tag() -> str:
    """The disk cache's directory name: a variant stored under it loads correctly in any process whose tag is the
    same (the key, within the directory, names the variant and its architecture)."""
    parts = {
        "sources": source_digest(),
        "dsl": _version("nvidia-cutlass-dsl"),
        "dsl_cuda": _dsl_cuda_flavours(),
        "tvm_ffi": _version("apache-tvm-ffi"),
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        # the DSL's switches that change what it compiles (line info, assertions, debug, optimisation level, ...)
        "dsl_env": {name: os.environ[name] for name in _DSL_COMPILE_ENV if name in os.environ},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


# ----------------------------------------------------------------------------------------------------- loading
_cudart_ready = False


def _expose_cudart() -> None:
    """Make the CUDA runtime's symbols global before the first load: an exported kernel's host code calls
    ``cudaLaunchKernelEx`` and friends, which torch's CUDA build loaded privately (RTLD_LOCAL). Nothing to do on
    a machine without CUDA: the symbols bind lazily, so a binary still loads there (it cannot run anyway)."""
    global _cudart_ready
    if _cudart_ready:
        return
    _cudart_ready = True
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        paths = set()
    for path in sorted(paths):
        with contextlib.suppress(OSError):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def _check_whole(library: Path) -> None:
    """Raise unless ``library`` is an ELF64 file holding every segment and section its headers name: the loader
    maps a truncated one and the process dies of SIGBUS on the first page past its end (an interrupted copy or
    write leaves such files)."""
    import struct

    size = library.stat().st_size
    with open(library, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:5] != b"\x7fELF\x02" or head[5] != 1:
            raise ValueError("not a little-endian ELF64 file")
        phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
        ends = [phoff + phentsize * phnum, shoff + shentsize * shnum]
        if max(ends) > size:
            raise ValueError(f"truncated: its headers end at byte {max(ends)}, the file has {size}")
        f.seek(phoff)
        for _ in range(phnum):  # (p_type, p_flags, p_offset, p_vaddr, p_paddr, p_filesz, ...)
            _, _, offset, _, _, filesz = struct.unpack("<IIQQQQ", f.read(phentsize)[:40])
            ends.append(offset + filesz)
        f.seek(shoff)
        for _ in range(shnum):  # (sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, ...); type 8: no bits
            _, kind, _, _, offset, length = struct.unpack("<IIQQQQ", f.read(shentsize)[:40])
            ends.append(offset + (0 if kind == 8 else length))
    if max(ends) > size:
        raise ValueError(f"truncated: its contents end at byte {max(ends)}, the file has {size}")


def _load_function(library: Path, symbol: str) -> Any:
    import tvm_ffi

    _check_whole(library)  # (before the loader maps it)
    _expose_cudart()
    module = tvm_ffi.load_module(str(library))
    _MODULES.append(module)
    return module[symbol]


# ---------------------------------------------------------------------------------------------- the manifest
@functools.cache
def _manifest() -> tuple[dict | None, str]:
    """(the prebuilt manifest, or None, and why not)."""
    if not _switch_on("CULA_PREBUILT"):
        return None, "CULA_PREBUILT=0"
    path = prebuilt_dir() / MANIFEST_NAME
    if not path.is_file():
        return None, "no prebuilt kernels in this installation"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:  # a damaged installation: the disk cache or a compile serves instead
        logger.warning("cula: prebuilt kernels ignored: %s is unreadable (%s)", path, err)
        return None, f"unreadable prebuilt manifest ({err})"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("variants"), dict):
        logger.warning("cula: prebuilt kernels ignored: %s holds no variant table", path)
        return None, "prebuilt manifest without a variant table"
    if manifest.get("sources") != source_digest():
        # an edited checkout, or a manifest from other sources: its binaries are not these kernels
        logger.warning("cula: prebuilt kernels ignored: built from other kernel sources than these")
        return None, "prebuilt kernels built from other sources"
    tvm = _version("apache-tvm-ffi")
    if manifest.get("tvm_ffi") != tvm:
        logger.warning("cula: prebuilt kernels ignored: built for apache-tvm-ffi %s, %s installed",
                       manifest.get("tvm_ffi"), tvm)  # fmt: skip
        return None, f"prebuilt kernels built for apache-tvm-ffi {manifest.get('tvm_ffi')}, {tvm} installed"
    built, running = str(manifest.get("cuda", "")).split(".")[0], _torch_cuda_major()
    if built and running and built != running:
        # the objects embed the CUDA runtime version they were built for; another major one refuses them
        logger.warning("cula: prebuilt kernels ignored: built for CUDA %s, torch runs CUDA %s", built, running)
        return None, f"prebuilt kernels built for CUDA {built}, torch runs CUDA {running}"
    return manifest, "ok"


def _torch_cuda_major() -> str | None:
    import torch

    return torch.version.cuda.split(".")[0] if torch.version.cuda else None


def prebuilt_dir() -> Path:
    """The wheel's ``cula/_prebuilt``, or ``CULA_PREBUILT_DIR`` (a build's output, for tests)."""
    return Path(os.environ.get("CULA_PREBUILT_DIR") or PREBUILT_DIR)


def prebuilt_status() -> str:
    manifest, why = _manifest()
    return f"{len(manifest['variants'])} prebuilt variants" if manifest is not None else why


def prebuilt_keys() -> set[str]:
    """``key_text`` of every variant in the manifest (empty without one)."""
    manifest, _ = _manifest()
    return set(manifest["variants"]) if manifest is not None else set()


def has_prebuilt(arch: tuple[int, int]) -> bool:
    """Whether the manifest holds any variant for ``arch`` (the backends' availability probe asks)."""
    manifest, _ = _manifest()
    return manifest is not None and compile_target(arch) in manifest.get("targets", ())


def _prebuilt_function(key: tuple) -> Any:
    manifest, _ = _manifest()
    if manifest is None:
        return None
    entry = manifest["variants"].get(key_text(key))
    if entry is None:
        return None
    try:
        return _load_function(prebuilt_dir() / entry["library"], entry["symbol"])
    except Exception as err:  # a damaged installation: the disk cache or a compile serves instead
        logger.warning("cula: prebuilt kernel %s did not load (%s)", key_text(key), err)
        return None


# ------------------------------------------------------------------------------------------------ disk cache
def disk_cache_dir() -> Path | None:
    """This process's disk cache directory (``CULA_CACHE_DIR``/<build_tag>), or None when off."""
    if not _switch_on("CULA_DISK_CACHE"):
        return None
    root = os.environ.get("CULA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cula")
    return Path(root) / build_tag()


def _load_from_disk(directory: Path, key: tuple) -> Any:
    library = directory / f"{key_digest(key)}.so"
    if not library.is_file():
        return None
    try:
        return _load_function(library, symbol_name(key))
    except Exception as err:  # a truncated or foreign file: compile instead, and replace it
        logger.warning("cula: cached kernel %s did not load (%s); compiling it again", library, err)
        return None


def _store_on_disk(directory: Path, key: tuple, fn: Any) -> None:
    """Export and link ``fn`` into ``directory`` for later processes. A failure costs only the next process's
    compile, so it is logged, never raised."""
    if not hasattr(fn, "export_to_c"):  # a test's stub, not a compiled kernel
        return
    try:
        from cula import aot

        directory.mkdir(parents=True, exist_ok=True)
        aot.link_variants(directory / f"{key_digest(key)}.so", [(key, fn)], directory)
    except Exception as err:
        logger.warning("cula: could not store kernel %s in the disk cache %s: %s", key_text(key), directory, err)
