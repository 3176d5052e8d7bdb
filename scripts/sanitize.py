"""compute-sanitizer's four tools over every kernel variant the dispatch can select; writes a markdown report.

    python scripts/sanitize.py [--out DIR] [--report PATH] [--tools memcheck,racecheck,...] [CASE_SUBSTRING ...]

On the H200 through the device tool (the payload carried), as two calls (all four tools no longer fit one):
    bash scripts/device/run.sh timeout 590 python scripts/sanitize.py --deadline 530 --out /tmp/san \
        --tools memcheck,racecheck,synccheck --report $OUT/sanitizer.md
    bash scripts/device/run.sh timeout 590 python scripts/sanitize.py --deadline 530 --out /tmp/san \
        --tools initcheck --report $OUT/sanitizer_initcheck.md

The cases are ``scripts/sanitize_cases.py`` (small calls through the public API). Each tool runs them in its own
process, all tools at once (racecheck, the slowest, split over several processes), with only cula's CuTe DSL kernels
instrumented (``--kernel-name kns=kernel_cutlass``: FLA's Triton kernels, which some paths call, are not ours to
check), line info compiled in (so a finding names its source line), and the caching allocator off (see the cases'
module docstring). A finding is attributed to the case whose markers surround it. Exit status: 0 only when every
tool finished with 0 errors and 0 hazards and every case ran.

Before the tools, the cases run once without a sanitizer (``--no-warm`` skips it), shared over ``--warm-procs``
processes: FLA's Triton kernels autotune on their first call per shape, and under initcheck (which instruments every
kernel) each training case's autotuning took minutes; warmed, the tools find the winners in Triton's cache, and the
DSL's compiles (the bulk of the plain run) in cula's disk cache.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
# processes per tool, each running every N-th case: on the H200 one memcheck or synccheck process did 15 of 16 cases
# in 360 s (the training cases are the slow ones), three initcheck processes (it instruments PyTorch's and FLA's
# kernels too) 12 of 15; over the 52 cases of 2026-12 (an H100) memcheck + racecheck + synccheck at 3 each took 443 s
# of one device call, and initcheck at 5 did not finish in 400 s after the warm run: it gets a call of its own, with
# the 16 cores shared by 12 processes
SPLIT = {"memcheck": 3, "racecheck": 3, "synccheck": 3, "initcheck": 12}
OURS = "kernel_cutlass"  # CuTe DSL kernel names start with it
_FINDING = re.compile(r"^========= (Error|Warning|Invalid|Uninitialized|Race|Barrier|Potential|Program hit)")


def _run(tool: str, group: str, names: list[str], out: str, limit: int, print_limit: int) -> subprocess.Popen:
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", CUTE_DSL_LINEINFO="1", PYTHONUNBUFFERED="1")
    # no host backtraces: a report names its kernel and source line without one, the case markers say which call,
    # and unwinding the Python stack for each of initcheck's ~2,000 reports about FLA's Triton kernels in one
    # packed FLA-intra case took longer than a device call may run
    cmd = ["timeout", str(limit), "compute-sanitizer", f"--tool={tool}", "--target-processes", "all",
           "--print-limit", str(print_limit), "--show-backtrace", "device"]
    if tool != "initcheck":
        # initcheck must see every kernel's writes: with the filter, memory that PyTorch's kernels wrote counts as
        # never written and every read of an input is reported
        cmd += ["--kernel-name", "kns=kernel_cutlass"]
    if tool == "racecheck":
        cmd += ["--racecheck-report", "analysis"]
    cmd += [sys.executable, os.path.join(REPO, "scripts", "sanitize_cases.py"), "--group", group]
    log = open(os.path.join(out, f"{tool}-{group.replace('/', 'of')}.log"), "w")
    return subprocess.Popen(cmd + names, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _parse(text: str) -> dict:
    """Counts and per-case findings of one log."""
    cases, failed, findings, variants, foreign = [], [], {}, [], 0
    current = None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("@@case "):
            current = line.split()[1]
            cases.append(current)
        elif line.startswith("@@failed "):
            failed.append(line[len("@@failed ") :])
        elif line.startswith("@@variants "):
            variants = __import__("json").loads(line[len("@@variants ") :])
        elif _FINDING.match(line):
            # the kernel is named on the report's first line (racecheck) or the next one ("at KERNEL+0x...")
            named = line + (lines[i + 1] if i + 1 < len(lines) else "")
            if OURS not in named:
                foreign += 1  # FLA's Triton or PyTorch's kernels (initcheck instruments every kernel)
                continue
            findings.setdefault(current or "(outside a case)", []).append(
                line[len("========= ") :].strip() + _where(lines[i + 1 : i + 4])
            )
    errors = [int(m) for m in re.findall(r"ERROR SUMMARY: (\d+) errors?\s*$", text, flags=re.M)]
    hazards = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
    seconds = {m[0]: float(m[1]) for m in re.findall(r"^@@done (\S+) ([\d.]+)s", text, flags=re.M)}
    return {
        "cases": cases, "done": len(seconds), "seconds": seconds, "failed": failed, "findings": findings,
        "variants": variants,
        "errors": sum(errors) if errors else None, "summary_seen": bool(errors or hazards), "foreign": foreign,
        "ours": sum(len(v) for v in findings.values()),
        "hazards": sum(int(h[0]) for h in hazards), "race_errors": sum(int(h[1]) for h in hazards),
        "race_warnings": sum(int(h[2]) for h in hazards),
    }  # fmt: skip


def _where(block: list[str]) -> str:
    """`` at FILE:LINE (KERNEL)`` from a report's next lines (line info on: the kernel's source line), so that the
    report names the place even when the tools' logs stay on the device."""
    for line in block:
        m = re.search(r"\bat (\S+?)(?:\+0x[0-9a-f]+)? in (\S+:\d+)", line)
        if m:
            kernel = re.sub(r"^kernel_cutlass_", "", m.group(1))[:60]
            return f" at {os.path.basename(m.group(2))} ({kernel})"
    return ""


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "cula", "scripts"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def kernel_digest() -> str:
    """sha256 (first 16 hex digits) of every source file under cula/ops: the report names the kernels it checked,
    whatever the device's copy of .git says (it can lag the working tree)."""
    import hashlib

    h = hashlib.sha256()
    ops = os.path.join(REPO, "cula", "ops")
    for root, _dirs, files in sorted(os.walk(ops)):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, REPO).encode() + b"\0")
            h.update(open(path, "rb").read() + b"\0")
    return h.hexdigest()[:16]


def _version() -> str:
    try:
        out = subprocess.run(["compute-sanitizer", "--version"], capture_output=True, text=True).stdout
        return out.strip().splitlines()[-1]
    except (OSError, IndexError):
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", help="only the cases whose name contains one of these")
    ap.add_argument("--out", default=os.path.join(REPO, "tmp", "sanitize"))
    ap.add_argument("--report", default=None, help="markdown report path (default: OUT/sanitizer.md)")
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--limit", type=int, default=540, help="seconds each process may run")
    ap.add_argument("--deadline", type=int, default=0,
                    help="seconds the whole run may take (0: none): the warm run's limit is cut to half of it and "
                         "the tools' --limit to what the warm run left, less 30 s for the report, so that a report is "
                         "written inside an outer timeout (which also counts run.sh's setup: leave it ~60 s)")
    ap.add_argument("--print-limit", type=int, default=1000000, help="reports each process prints at most")
    ap.add_argument("--split", default=",".join(f"{t}={n}" for t, n in SPLIT.items()),
                    help="processes per tool, as tool=N,...")
    ap.add_argument("--digest", action="store_true", help="print the kernel sources' digest and exit")
    ap.add_argument("--no-warm", action="store_true", help="skip the cases' plain run (FLA's autotuning) first")
    ap.add_argument("--warm-procs", type=int, default=12, help="processes sharing the plain run's cases")
    ap.add_argument("--warm-limit", type=int, default=300, help="seconds each plain-run process may run")
    a = ap.parse_args()
    if a.digest:
        print(kernel_digest())
        return 0
    os.makedirs(a.out, exist_ok=True)
    tools = a.tools.split(",")
    split = {t: int(n) for t, n in (x.split("=") for x in a.split.split(","))}
    t0 = time.time()
    if not a.no_warm:
        # the warm run is mostly the DSL compiling each case's variants (CPU-bound, ~4 s a variant): several
        # processes share it out, and leave the variants in cula's disk cache for the tools' processes to load
        # (line info on, as the tools' processes compile: the disk cache's key does not tell them apart)
        cases = os.path.join(REPO, "scripts", "sanitize_cases.py")
        n = a.warm_procs
        warm, env = [], dict(os.environ, CUTE_DSL_LINEINFO="1")
        if a.deadline:  # half of it at most, so that the tools run whatever the warm run's cases cost
            a.warm_limit = max(1, min(a.warm_limit, a.deadline // 2))
        for i in range(1, n + 1):
            log = open(os.path.join(a.out, f"warm-{i}of{n}.log"), "w")
            cmd = ["timeout", str(a.warm_limit), sys.executable, cases, "--group", f"{i}/{n}", *a.names]
            warm.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [p.wait() for p in warm]
        print(f"[sanitize] cases warmed in {time.time() - t0:.0f} s (exit codes {codes})", file=sys.stderr, flush=True)
    if a.deadline:
        a.limit = max(1, min(a.limit, int(a.deadline - (time.time() - t0)) - 30))
        print(f"[sanitize] tools limited to {a.limit} s each (--deadline {a.deadline})", file=sys.stderr, flush=True)
    procs = {}
    for tool in tools:
        n = split.get(tool, 1)
        for i in range(1, n + 1):
            procs[(tool, f"{i}/{n}")] = _run(tool, f"{i}/{n}", a.names, a.out, a.limit, a.print_limit)
    for p in procs.values():
        p.wait()
    wall = time.time() - t0

    rows, details, clean, variants, all_cases, slowest = [], [], True, set(), set(), []
    for tool in tools:
        parts = [
            _parse(open(os.path.join(a.out, f"{tool}-{g.replace('/', 'of')}.log")).read())
            for (t, g) in procs if t == tool
        ]  # fmt: skip
        cases = [c for p in parts for c in p["cases"]]
        all_cases.update(cases)
        done = sum(p["done"] for p in parts)
        failed = [f for p in parts for f in p["failed"]]
        for p in parts:
            variants.update(p["variants"])
        complete = all(p["summary_seen"] for p in parts) and done == len(cases) and not failed
        # reports about other kernels are counted apart: the verdict is about cula's kernels
        foreign = sum(p["foreign"] for p in parts)
        errors = sum(p["ours"] for p in parts) if tool != "racecheck" else sum(p["errors"] or 0 for p in parts)
        if tool != "racecheck" and sum(p["errors"] or 0 for p in parts) > errors + foreign:
            complete = False  # more reports than printed: raise --print-limit
            details.append(f"- {tool}: reports past --print-limit {a.print_limit}, not all attributed")
        if foreign:
            details.append(f"- {tool}: {foreign} reports about kernels that are not cula's (FLA, PyTorch), not counted")
        hazards = sum(p["hazards"] for p in parts)
        ok = complete and errors == 0 and hazards == 0
        clean &= ok
        race = f"{hazards} ({sum(p['race_errors'] for p in parts)} errors, " \
               f"{sum(p['race_warnings'] for p in parts)} warnings)" if tool == "racecheck" else "-"  # fmt: skip
        verdict = "clean" if ok else "FINDINGS" if errors or hazards or failed else "incomplete"
        rows.append(f"| {tool} | {done}/{len(cases)} | {errors} | {race} | {verdict} |")
        # where a tool's time goes (its processes take every N-th case: a slow one sets the wall time)
        seconds = sorted(((t, c) for p in parts for c, t in p["seconds"].items()), reverse=True)
        if seconds:
            slowest.append(f"- {tool}: " + ", ".join(f"`{c}` {t:.0f} s" for t, c in seconds[:6]))
        for p in parts:
            for name, lines in p["findings"].items():
                uniq = sorted(set(lines))
                details.append(f"- {tool}, `{name}`: {len(lines)} report lines, {len(uniq)} distinct")
                details += [f"  - `{u[:300]}`" for u in uniq[:12]]
        details += [f"- {tool}: case failed: `{f}`" for f in failed]
        if not complete:
            details.append(f"- {tool}: did not finish every case (time limit {a.limit} s, or a crash): see its log")
            for (t, g), p in zip([k for k in procs if k[0] == tool], parts):
                if not p["summary_seen"] and p["cases"]:
                    details.append(f"  - process {g}: {p['done']} of its cases done, last started `{p['cases'][-1]}`")

    report = [
        "# compute-sanitizer over every cula kernel variant",
        "",
        f"Commit `{_commit()}`, kernel sources `cula/ops` sha256 `{kernel_digest()}` "
        f"(`python scripts/sanitize.py --digest`), {datetime.date.today().isoformat()}, "
        f"{_device()}, {_version()}; {wall:.0f} s wall (tools in parallel).",
        "Produced by `python scripts/sanitize.py` (cases: `scripts/sanitize_cases.py`, small calls through the public"
        " API; only cula's CuTe DSL kernels instrumented; line info on; PyTorch's caching allocator off).",
        "",
        "| tool | cases run | errors | racecheck hazards | verdict |",
        "| --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"Cases ({len(all_cases)}): " + ", ".join(f"`{c}`" for c in sorted(all_cases)),
        "",
        "Slowest cases under each tool (seconds in its process):",
        "",
        *(slowest or ["- none finished"]),
        "",
        f"Compiled variants exercised ({len(variants)}):",
        "",
        *(f"- `{v}`" for v in sorted(variants)),
        "",
        "## Findings",
        "",
        *(details or ["None."]),
        "",
    ]
    path = a.report or os.path.join(a.out, "sanitizer.md")
    with open(path, "w") as f:
        f.write("\n".join(report))
    print("\n".join(report[:12 + len(rows)]))
    print("\n".join(details[:80]))
    return 0 if clean else 1


def _device() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - the report still gets written
        return "unknown GPU"


if __name__ == "__main__":
    sys.exit(main())
