"""Compile every listed kernel variant ahead of time into shared objects with a manifest (``cula/_prebuilt``).

    python scripts/build_wheel.py compile --scope wheel --out build/prebuilt [--jobs N]
    python scripts/build_wheel.py check build/prebuilt --scope wheel     # the manifest covers the list?
    python scripts/build_wheel.py check dist/cula-*.whl --scope smoke    # the same, inside a built wheel

``compile`` works on a CPU-only machine: each of ``--jobs`` worker processes lists the variants
(``cula.variants.planner_variants``), takes every N-th, compiles it for its target with ``cute.compile`` and
exports it (``cula.aot``) to ``<out>/objects/<digest>.o``; an object already there is kept, so an interrupted
build resumes. Then the objects of each kernel family are linked into a few shared objects, and
``manifest.json`` maps every variant's key text to its library and symbol, with the kernel sources' digest and
the TVM-FFI version it was built for (``cula.cache`` checks both before it trusts the manifest).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OBJECTS_PER_LIBRARY = 256  # a few large libraries load faster than thousands of small ones, and link in seconds


def _variants(scope: str) -> dict:
    from cula import variants

    return variants.planner_variants(scope)


def _worker(scope: str, out: Path, index: int, jobs: int) -> int:
    """Compile and export this worker's share of the variants; prints one line per variant."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from cula import aot, cache

    objects = out / "objects"
    failures = 0
    for i, (key, build) in enumerate(sorted(_variants(scope).items(), key=lambda kv: cache.key_text(kv[0]))):
        if i % jobs != index:
            continue
        target = objects / f"{cache.key_digest(key)}.o"
        if target.is_file():
            continue
        start = time.perf_counter()
        try:
            fn = build()
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            aot.export_object(fn, key, partial)
            os.replace(partial, target)
        except Exception as err:  # reported and counted; the check step then names the variant as missing
            failures += 1
            print(f"@@failed {cache.key_text(key)}: {type(err).__name__}: {err}", flush=True)
            continue
        print(f"@@done {time.perf_counter() - start:.2f}s {cache.key_text(key)}", flush=True)
    return failures


def compile_all(scope: str, out: Path, jobs: int) -> None:
    from cula import aot, cache

    (out / "objects").mkdir(parents=True, exist_ok=True)
    listed = _variants(scope)
    print(f"{len(listed)} variants in scope {scope!r}, {jobs} workers", flush=True)
    start = time.perf_counter()
    env = dict(os.environ, CULA_DISK_CACHE="0", CULA_PREBUILT="0", PYTHONPATH=str(REPO))
    workers = [
        subprocess.Popen([sys.executable, __file__, "_worker", scope, str(out), str(i), str(jobs)], env=env)
        for i in range(jobs)
    ]
    failed = sum(1 for w in workers if w.wait() != 0)
    compiled = time.perf_counter() - start
    families: dict[str, list[tuple]] = {}
    for key in sorted(listed, key=cache.key_text):
        if (out / "objects" / f"{cache.key_digest(key)}.o").is_file():
            families.setdefault(str(key[0]).replace(".", "_"), []).append(key)
    entries, start = {}, time.perf_counter()
    for family, keys in families.items():
        for part in range(0, len(keys), OBJECTS_PER_LIBRARY):
            chunk = keys[part : part + OBJECTS_PER_LIBRARY]
            library = f"libcula_{family}_{part // OBJECTS_PER_LIBRARY}.so"
            aot.link([out / "objects" / f"{cache.key_digest(k)}.o" for k in chunk], out / library)
            for k in chunk:
                entries[cache.key_text(k)] = {"library": library, "symbol": cache.symbol_name(k)}
    linked = time.perf_counter() - start
    from cutlass.base_dsl.version_info import CUDA_VERSION

    manifest = {
        "sources": cache.source_digest(),
        "tvm_ffi": cache._version("apache-tvm-ffi"),
        "dsl": cache._version("nvidia-cutlass-dsl"),
        "cuda": f"{CUDA_VERSION.major}.{CUDA_VERSION.minor}",
        "targets": ["sm_90a"],
        "scope": scope,
        "variants": entries,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=0, sort_keys=True))
    size = sum(p.stat().st_size for p in out.glob("*.so"))
    print(f"compiled {len(entries)} of {len(listed)} variants in {compiled:.0f} s ({jobs} workers), linked in "
          f"{linked:.1f} s: {size / 2**20:.1f} MiB in {len(list(out.glob('*.so')))} libraries", flush=True)  # fmt: skip
    if failed or len(entries) != len(listed):
        sys.exit(f"{len(listed) - len(entries)} variants missing ({failed} workers failed)")


def check(path: Path, scope: str) -> None:
    """Exit non-zero unless the manifest at ``path`` (a prebuilt directory or a wheel) covers ``scope``'s list."""
    from cula import cache, variants

    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as whl:
            manifest = json.loads(whl.read("cula/_prebuilt/manifest.json"))
            names = set(whl.namelist())
        libraries_present = {Path(n).name for n in names if n.startswith("cula/_prebuilt/")}
    else:
        manifest = json.loads((path / "manifest.json").read_text())
        libraries_present = {p.name for p in path.iterdir()}
    listed = variants.variant_texts(scope)
    missing = sorted(listed - set(manifest["variants"]))
    absent = {e["library"] for e in manifest["variants"].values()} - libraries_present
    problems = []
    if missing:
        problems.append(f"{len(missing)} of {len(listed)} listed variants are not in the manifest, e.g. {missing[0]}")
    if absent:
        problems.append(f"libraries named in the manifest but not shipped: {sorted(absent)}")
    if manifest["sources"] != cache.source_digest():
        problems.append("the manifest was built from other kernel sources than this checkout's")
    if problems:
        sys.exit("manifest check failed: " + "; ".join(problems))
    print(f"manifest covers all {len(listed)} variants of scope {scope!r} ({len(manifest['variants'])} entries)")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        sys.exit(1 if _worker(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])) else 0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile")
    c.add_argument("--scope", default="wheel", choices=("full", "wheel", "smoke"))
    c.add_argument("--out", type=Path, default=REPO / "build" / "prebuilt")
    c.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    k = sub.add_parser("check")
    k.add_argument("path", type=Path)
    k.add_argument("--scope", default="wheel", choices=("full", "wheel", "smoke"))
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.command == "compile":
        compile_all(args.scope, args.out.resolve(), args.jobs)
    else:
        check(args.path, args.scope)


if __name__ == "__main__":
    main()
