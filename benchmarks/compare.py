"""Two runs of the same benchmark suites side by side: cula's and FLA's median per config, after / before.

    python benchmarks/compare.py BEFORE AFTER [--suite kda_prefill ...] [--out FILE.md]

BEFORE and AFTER are directories holding ``<suite>.json`` files as the ``bench_*.py`` scripts write them (a GPU's
directory under a results root, e.g. ``benchmarks/results/nvidia-h200``). Every suite present in both is compared
on the configs both timed. FLA's column is the control: FLA's code is the same on both sides, so where FLA's ratio
moves as far as cula's, the run's host or GPU moved, not cula (eager rows of a few tens of microseconds are
host-bound and follow the CPU). Prints markdown; ``--out`` also writes it.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def _rows(path: Path) -> dict[str, dict]:
    return {row["config"]: row for row in json.loads(path.read_text())["rows"]}


def _ms(row: dict, key: str) -> float | None:
    x = row.get(key)
    return float(x) if isinstance(x, (int, float)) and x > 0 else None


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def compare_suite(name: str, before: dict[str, dict], after: dict[str, dict]) -> tuple[list[str], dict]:
    """Markdown lines of one suite's table and its summary ``{"configs", "cula_geomean", "fla_geomean", ...}``."""
    lines = [
        f"### {name}", "",
        "| config | cula before ms | cula after ms | cula after/before | FLA after/before |",
        "|---|---|---|---|---|",
    ]  # fmt: skip
    cula_ratios, fla_ratios, untimed = [], [], []
    for config, b in before.items():
        a = after.get(config)
        if a is None:
            untimed.append(f"{config} (after: no row)")
            continue
        cb, ca = _ms(b, "cula_ms"), _ms(a, "cula_ms")
        fb, fa = _ms(b, "fla_ms"), _ms(a, "fla_ms")
        fla = f"{fa / fb:.3f}" if fb and fa else "-"
        if cb and ca:
            cula_ratios.append(ca / cb)
            if fb and fa:  # the control over the same configs as cula's ratios
                fla_ratios.append(fa / fb)
            lines.append(f"| {config} | {cb:.4f} | {ca:.4f} | {ca / cb:.3f} | {fla} |")
        else:
            untimed.append(f"{config} (cula {'before' if not cb else 'after'}: not timed)")
            lines.append(f"| {config} | {cb or '-'} | {ca or '-'} | - | {fla} |")
    untimed += [f"{config} (before: no row)" for config in after if config not in before]
    summary = {
        "configs": len(cula_ratios),
        "cula_geomean": _geomean(cula_ratios),
        "cula_range": (min(cula_ratios), max(cula_ratios)) if cula_ratios else None,
        "fla_geomean": _geomean(fla_ratios),
        "missing": untimed,
    }
    rng = summary["cula_range"]
    lines += ["", f"cula after / before: geomean {summary['cula_geomean']:.3f} over {summary['configs']} configs"
              + (f" ({rng[0]:.3f} .. {rng[1]:.3f})" if rng else "")
              + f"; FLA's over the same configs: geomean {summary['fla_geomean']:.3f}"]  # fmt: skip
    if untimed:
        lines.append(f"missing from the comparison: {', '.join(untimed)}")
    return lines + [""], summary


def compare(before: Path, after: Path, suites: list[str] | None = None) -> tuple[str, dict[str, dict]]:
    """The markdown of every suite in ``suites`` (default: each in both folders) and their summaries. Raises
    ``SystemExit`` when there is nothing to compare (a folder without results, no suite in both)."""
    one_sided = sorted({p.name for p in before.glob("*.json")} ^ {p.name for p in after.glob("*.json")})
    names = suites or sorted(p.stem for p in before.glob("*.json") if (after / p.name).exists())
    if not names:
        raise SystemExit(f"no suite in both {before} and {after}")
    lines = [f"# {before} -> {after}", ""]
    if one_sided and not suites:
        lines += [f"in one folder only (not compared): {', '.join(one_sided)}", ""]
    summaries = {}
    for name in names:
        b, a = before / f"{name}.json", after / f"{name}.json"
        if not (b.exists() and a.exists()):
            raise SystemExit(f"{name}.json is missing from {b.parent if not b.exists() else a.parent}")
        table, summaries[name] = compare_suite(name, _rows(b), _rows(a))
        lines += table
    return "\n".join(lines), summaries


def main(argv: list[str] | None = None) -> dict[str, dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--suite", action="append", help="a suite name (default: every one in both directories)")
    p.add_argument("--out", type=Path, help="also write the markdown here")
    args = p.parse_args(argv)
    text, summaries = compare(args.before, args.after, args.suite)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return summaries


if __name__ == "__main__":
    main()
