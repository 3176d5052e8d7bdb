"""Compile every listed kernel variant ahead of time into shared objects with a manifest (``cula/_prebuilt``).

    python scripts/build_wheel.py compile --scope wheel --out build/prebuilt [--jobs N]
    python scripts/build_wheel.py check build/prebuilt --scope wheel     # the manifest covers the list?
    python scripts/build_wheel.py check dist/cula-*.whl --scope smoke    # the same, inside a built wheel
    python scripts/build_wheel.py estimate --scope wheel [--per-family 4]  # the wheel's size and build time

``compile`` works on a CPU-only machine: each of ``--jobs`` worker processes lists the variants
(``cula.variants.planner_variants``), takes every N-th, compiles it for its target with ``cute.compile`` and
exports it (``cula.aot``) to ``<out>/objects/<stamp>/<digest>.o``; an object already there is kept, so an
interrupted build resumes (the stamp names what built it: the kernel sources, the DSL and its CUDA, TVM-FFI,
Python, the DSL's compile switches; a build of other sources or tools starts afresh beside it). A manifest of the
same stamp and scope that names every listed variant is up to date: nothing is done. Otherwise the objects of
each kernel family are linked into a few shared objects, and
``manifest.json`` maps every variant's key text to its library and symbol, with the kernel sources' digest and
the TVM-FFI version it was built for (``cula.cache`` checks both before it trusts the manifest).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OBJECTS_PER_LIBRARY = 256  # a few large libraries load faster than thousands of small ones, and link in seconds


def _variants(scope: str) -> dict:
    from cula import variants

    return variants.planner_variants(scope)


def _listed(scope: str, per_family: int = 0) -> list[tuple[tuple, object]]:
    """The scope's ``(key, build)`` pairs in key order; with ``per_family``, that many of each kernel family's,
    evenly spaced through its list (a sample for ``estimate``)."""
    from cula import cache

    items = sorted(_variants(scope).items(), key=lambda kv: cache.key_text(kv[0]))
    if not per_family:
        return items
    families: dict[object, list] = {}
    for item in items:
        families.setdefault(item[0][0], []).append(item)
    return [x for group in families.values() for x in group[:: max(1, len(group) // per_family)][:per_family]]


def _stamp() -> str:
    """What built an object: the disk cache's build tag (kernel sources, DSL, its CUDA flavours, TVM-FFI, Python,
    the DSL's compile switches) and the CUDA version the DSL compiles for."""
    from cutlass.base_dsl.version_info import CUDA_VERSION

    from cula import cache

    return f"{cache.build_tag()}-cuda{CUDA_VERSION.major}.{CUDA_VERSION.minor}"


def _objects(out: Path) -> Path:
    return out / "objects" / _stamp()


def _worker(scope: str, out: Path, index: int, jobs: int, per_family: int = 0) -> int:
    """Compile and export this worker's share of the variants; prints one line per variant."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from cula import aot, cache

    objects = _objects(out)
    failures = 0
    for i, (key, build) in enumerate(_listed(scope, per_family)):
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


def _run_workers(scope: str, out: Path, jobs: int, per_family: int = 0, capture: bool = False) -> tuple[int, list[str]]:
    """Compile the scope (or its sample) into ``out/objects`` over ``jobs`` processes: failed workers, and with
    ``capture`` the workers' printed lines (each worker's into its own ``out/worker-I.log``, never a pipe, which a
    reader drains one worker at a time while the others stall on it full); without, they print as they go."""
    _objects(out).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CULA_DISK_CACHE="0", CULA_PREBUILT="0", PYTHONPATH=str(REPO))
    cmd = [sys.executable, __file__, "_worker", scope, str(out)]
    logs = [out / f"worker-{i}.log" for i in range(jobs)] if capture else [None] * jobs
    workers = []
    for i, log in enumerate(logs):
        with open(log, "w") if log else contextlib.nullcontext() as f:
            workers.append(subprocess.Popen([*cmd, str(i), str(jobs), str(per_family)], env=env, stdout=f))
    failed = sum(1 for w in workers if w.wait() != 0)
    return failed, [line for log in logs if log for line in log.read_text().splitlines()]


def compile_all(scope: str, out: Path, jobs: int) -> None:
    from cula import aot, cache

    listed = _variants(scope)
    stamp, objects = _stamp(), _objects(out)
    if _up_to_date(out, scope, stamp, {cache.key_text(k) for k in listed}):
        print(f"{out / 'manifest.json'}: up to date ({len(listed)} variants of scope {scope!r})", flush=True)
        return
    print(f"{len(listed)} variants in scope {scope!r}, {jobs} workers", flush=True)
    start = time.perf_counter()
    failed, _ = _run_workers(scope, out, jobs)
    compiled = time.perf_counter() - start
    families: dict[str, list[tuple]] = {}
    for key in sorted(listed, key=cache.key_text):
        if (objects / f"{cache.key_digest(key)}.o").is_file():
            families.setdefault(str(key[0]).replace(".", "_"), []).append(key)
    (out / "manifest.json").unlink(missing_ok=True)
    for old in out.glob("libcula_*.so"):  # another build's libraries: the wheel takes every one it finds
        old.unlink()
    entries, start = {}, time.perf_counter()
    for family, keys in families.items():
        for part in range(0, len(keys), OBJECTS_PER_LIBRARY):
            chunk = keys[part : part + OBJECTS_PER_LIBRARY]
            library = f"libcula_{family}_{part // OBJECTS_PER_LIBRARY}.so"
            aot.link([objects / f"{cache.key_digest(k)}.o" for k in chunk], out / library)
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
        "stamp": stamp,
        "variants": entries,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=0, sort_keys=True))
    size = sum(p.stat().st_size for p in out.glob("*.so"))
    print(f"compiled {len(entries)} of {len(listed)} variants in {compiled:.0f} s ({jobs} workers), linked in "
          f"{linked:.1f} s: {size / 2**20:.1f} MiB in {len(list(out.glob('*.so')))} libraries", flush=True)  # fmt: skip
    if failed or len(entries) != len(listed):
        sys.exit(f"{len(listed) - len(entries)} variants missing ({failed} workers failed)")


def _up_to_date(out: Path, scope: str, stamp: str, listed: set[str]) -> bool:
    """Whether ``out`` holds this build already: a manifest of this stamp and scope naming every listed variant,
    and its libraries."""
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("stamp") != stamp or manifest.get("scope") != scope or set(manifest.get("variants", ())) != listed:
        return False
    return all((out / e["library"]).is_file() for e in manifest["variants"].values())


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
    if manifest.get("stamp") != _stamp():
        problems.append(f"the manifest was built by other tools (stamp {manifest.get('stamp')}, here {_stamp()})")
    if problems:
        sys.exit("manifest check failed: " + "; ".join(problems))
    print(f"manifest covers all {len(listed)} variants of scope {scope!r} ({len(manifest['variants'])} entries)")


def estimate(scope: str, per_family: int, jobs: int) -> None:
    """The scope's wheel size (its objects deflated, as a wheel's zip stores them) and compile time, from a sample
    of ``per_family`` variants of each kernel family scaled by the family's count."""
    from cula import cache

    counts: dict[str, int] = {}
    for key in _variants(scope):
        counts[str(key[0])] = counts.get(str(key[0]), 0) + 1
    with tempfile.TemporaryDirectory() as tmp:
        _, lines = _run_workers(scope, Path(tmp), jobs, per_family, capture=True)
        done = [ln.split(" ", 2) for ln in lines if ln.startswith("@@done ")]  # "@@done 1.2s KEY"
        seconds = {key: float(secs[:-1]) for _, secs, key in done}
        sizes: dict[str, list[tuple[int, int, float]]] = {}
        for key, _build in _listed(scope, per_family):
            path = _objects(Path(tmp)) / f"{cache.key_digest(key)}.o"
            if path.is_file():
                data = path.read_bytes()
                sample = (len(data), len(zlib.compress(data, 6)), seconds.get(cache.key_text(key), 0.0))
                sizes.setdefault(str(key[0]), []).append(sample)
    total = [0.0, 0.0, 0.0]
    print(f"\n{'family':24} {'variants':>8} {'object':>9} {'deflated':>9} {'all objects':>12} {'in a wheel':>11} "
          f"{'compile':>9}")  # fmt: skip
    for family, n in sorted(counts.items()):
        got = sizes.get(family)
        if not got:
            print(f"{family:24} {n:8d}  (no sample compiled)")
            continue
        raw, packed, secs = (sum(x[i] for x in got) / len(got) for i in range(3))
        total = [total[0] + n * raw, total[1] + n * packed, total[2] + n * secs]
        print(f"{family:24} {n:8d} {raw / 1e3:8.1f}K {packed / 1e3:8.1f}K {n * raw / 1e6:11.1f}M "
              f"{n * packed / 1e6:10.1f}M {n * secs / 3600:8.2f}h")  # fmt: skip
    print(f"scope {scope!r}: {sum(counts.values())} variants, about {total[1] / 1e6:.0f} MB in a wheel "
          f"({total[0] / 1e6:.0f} MB of objects installed) and {total[2] / 3600:.1f} core-hours to compile "
          f"(from {sum(len(v) for v in sizes.values())} sampled variants; each library adds the DSL's static runtime)")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        failures = _worker(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
        sys.exit(1 if failures else 0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile")
    c.add_argument("--scope", default="wheel", choices=("full", "wheel", "smoke"))
    c.add_argument("--out", type=Path, default=REPO / "build" / "prebuilt")
    c.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    k = sub.add_parser("check")
    k.add_argument("path", type=Path)
    k.add_argument("--scope", default="wheel", choices=("full", "wheel", "smoke"))
    e = sub.add_parser("estimate")
    e.add_argument("--scope", default="wheel", choices=("full", "wheel", "smoke"))
    e.add_argument("--per-family", type=int, default=4)
    e.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.command == "compile":
        compile_all(args.scope, args.out.resolve(), args.jobs)
    elif args.command == "estimate":
        estimate(args.scope, args.per_family, args.jobs)
    else:
        check(args.path, args.scope)


if __name__ == "__main__":
    main()
