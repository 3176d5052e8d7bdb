"""Ahead-of-time export of compiled variants into shared objects that load without the CuTe DSL.

A variant compiled with ``--enable-tvm-ffi`` is exported as an object file holding its host launch code (the
function ``__tvm_ffi_<symbol>``) and its cubin. Linked with the DSL's static CUDA-dialect runtime, a few lines of C
for the two error helpers that otherwise live in the DSL's 43 MB ``libcute_dsl_runtime.so``, and ``libtvm_ffi``,
it is a shared object that ``tvm_ffi.load_module`` opens in a process with torch and apache-tvm-ffi alone (on the
H200 such a binary, made on a CPU-only machine, ran correctly at ~5 us a call). The CUDA runtime's own symbols are
left to bind, lazily, to the libcudart that torch loaded (``cula.cache`` makes it global first).

Used by ``cula.cache`` (one variant a file in the disk cache) and ``scripts/build_wheel.py`` (many a file). Needs
the DSL and a C compiler (``CC``, default ``cc``); never imported at run time when a binary already exists.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterable

from cula.cache import symbol_name

# CuteDSLRT_TVMFFISetRaisedCudaError: the exported host code reports a failed CUDA call through it. Its launch-error
# sibling is referenced only by kernels that check launch limits before launching; defined here too so that any
# variant links. Both turn the error into a Python RuntimeError through TVM-FFI's setter, which they are handed.
_SHIM_C = r"""
#include <stdint.h>
#include <stdio.h>
typedef void (*cula_set_error_fn)(const char *kind, const char **parts, int32_t num_parts);
extern const char *cudaGetErrorName(int);
extern const char *cudaGetErrorString(int);
static void cula_raise(cula_set_error_fn set_error, const char *text) {
  const char *parts[1] = {text};
  set_error("RuntimeError", parts, 1);
}
__attribute__((visibility("hidden"))) void CuteDSLRT_TVMFFISetRaisedCudaError(cula_set_error_fn set_error,
                                                                              int32_t code) {
  char text[256];
  snprintf(text, sizeof text, "CUDA error %d (%s): %s", code, cudaGetErrorName(code), cudaGetErrorString(code));
  cula_raise(set_error, text);
}
__attribute__((visibility("hidden"))) void CuteDSLRT_TVMFFISetRaisedCudaLaunchError(
    cula_set_error_fn set_error, int32_t gx, int32_t gy, int32_t gz, int32_t bx, int32_t by, int32_t bz,
    int32_t threads, int64_t smem, int32_t device, int32_t max_threads, int32_t mbx, int32_t mby, int32_t mbz,
    int32_t mgx, int32_t mgy, int32_t mgz, int32_t max_smem, int32_t max_smem_optin, const char *violation,
    const char *file, int32_t line, int32_t col, int32_t end_col) {
  char text[512];
  snprintf(text, sizeof text,
           "kernel launch refused on device %d: %s (grid %d x %d x %d, block %d x %d x %d, %lld bytes of shared "
           "memory; limits: %d threads, %d / %d bytes of shared memory) at %s:%d",
           device, violation ? violation : "?", gx, gy, gz, bx, by, bz, (long long)smem, max_threads, max_smem,
           max_smem_optin, file ? file : "?", line);
  cula_raise(set_error, text);
}
"""


def runtime_static_library() -> Path:
    """The DSL's static CUDA-dialect runtime for the CUDA flavour the DSL compiles against."""
    from cutlass.base_dsl.version_info import CUDA_VERSION
    from cutlass.cute.runtime import find_runtime_libraries

    for lib in find_runtime_libraries(enable_tvm_ffi=False):
        candidate = Path(lib).parent / "libcuda_dialect_runtime_static.a"
        if candidate.is_file() and candidate.parent.parent.name == f"cu{CUDA_VERSION.major}":
            return candidate
    raise FileNotFoundError(f"libcuda_dialect_runtime_static.a for CUDA {CUDA_VERSION.major} not found in the DSL")


def tvm_ffi_library_dir() -> Path:
    import tvm_ffi.libinfo

    return Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent


def export_object(fn: Any, key: tuple, path: Path) -> str:
    """Export compiled variant ``fn`` of ``key`` to the object file ``path``; returns its TVM-FFI symbol."""
    symbol = symbol_name(key)
    fn.export_to_c(str(path), symbol, export_only_tvm_ffi_symbols=True)
    return symbol


def link(objects: Iterable[Path], out: Path, workdir: Path | None = None) -> None:
    """Link exported objects into the shared object ``out``, written under a temporary name of its own, flushed to
    the disk and renamed into place (a reader never sees half a file, even after a crash; two processes linking
    the same file both produce whole ones; a failed link leaves nothing behind)."""
    out = Path(out)
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        shim = Path(tmp) / "cula_shim.c"
        shim.write_text(_SHIM_C)
        fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
        os.close(fd)
        partial = Path(name)
        try:
            cmd = [
                cc, "-shared", "-fPIC", "-O2", "-o", str(partial), *map(str, objects), str(shim),
                str(runtime_static_library()), f"-L{tvm_ffi_library_dir()}", "-ltvm_ffi",
                # the static runtime stays private to each object: several of them, and the DSL itself, may be loaded
                "-Wl,--exclude-libs,ALL", "-Wl,-Bsymbolic",
            ]  # fmt: skip
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"linking {out.name} failed: {result.stderr.strip()[-2000:]}")
            with open(partial, "rb+") as f:
                os.fsync(f.fileno())
            os.chmod(partial, 0o755)  # (mkstemp makes it private)
            os.replace(partial, out)
        finally:
            partial.unlink(missing_ok=True)  # (gone already once renamed into place)


def link_variants(out: Path, variants: list[tuple[tuple, Any]], workdir: Path | None = None) -> dict[str, str]:
    """Export each ``(key, compiled fn)`` and link them all into ``out``; returns ``key_text -> symbol``."""
    from cula.cache import key_text

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        objects, symbols = [], {}
        for i, (key, fn) in enumerate(variants):
            obj = Path(tmp) / f"v{i}.o"
            symbols[key_text(key)] = export_object(fn, key, obj)
            objects.append(obj)
        link(objects, out, workdir)
    return symbols
