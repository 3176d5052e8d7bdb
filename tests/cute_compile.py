"""Compile CuTe DSL kernel variants for sm_90a without a GPU, as CI does for every kernel.

Each kernel module exposes a cached factory (``module:function``) that traces and compiles one
variant from keyword arguments. ``compile_variants`` calls it for every variant in a fresh
subprocess (so ``CUTE_DSL_ARCH`` is set before cutlass is imported, and ptxas remarks can be read
from its stderr), calls it a second time to check the compile cache, and returns what ptxas reported.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from typing import NamedTuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys, time
    import torch
    module, name = sys.argv[1].split(":")
    factory = getattr(importlib.import_module(module), name)
    for i, variant in enumerate(json.loads(sys.argv[2])):
        # JSON carries dtypes as names: "bfloat16" -> torch.bfloat16
        kwargs = {k: getattr(torch, v) if k.endswith("dtype") and isinstance(v, str) else v
                  for k, v in variant.items()}
        t0 = time.time()
        first = factory(**kwargs)
        again = factory(**kwargs)
        sys.stdout.flush()
        print(f"@@done {i} {time.time() - t0:.2f} cached={first is again}", flush=True)
    """
)


class CompiledVariant(NamedTuple):
    registers: int
    spill_store_bytes: int
    seconds: float
    cached: bool


def compile_variants(factory: str, variants: list[dict], timeout: float = 900) -> dict[int, CompiledVariant]:
    """Compile every variant of ``factory`` ("package.module:function") for sm_90a; index -> ptxas report."""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_COMPILER_OPT="remarks{ptx}")
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, factory, json.dumps(variants)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    # ptxas remarks go to stderr and the markers to stdout: pair them up by order.
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", proc.stderr)]
    spills = [int(m) for m in re.findall(r"(\d+) bytes spill stores", proc.stderr)]
    done = re.findall(r"@@done (\d+) ([\d.]+) cached=(\w+)", proc.stdout)
    assert len(done) == len(variants), text[-4000:]
    assert len(regs) == len(spills) == len(variants), text[-4000:]
    return {
        int(i): CompiledVariant(regs[j], spills[j], float(sec), cached == "True")
        for j, (i, sec, cached) in enumerate(done)
    }


def dump_script(imports: str, body: str) -> str:
    """A script for ``compile_with_dumps``: after ``imports``, ``body`` runs for every variant with ``v`` (the
    variant's dict), ``d`` (its dump directory) and ``opts`` (the compile options keeping its PTX and cubins
    there) bound, then the variant's marker is printed."""
    loop = textwrap.dedent(
        """
        import json, os, sys, time
        variants, root = json.loads(sys.argv[1]), sys.argv[2]
        for i, v in enumerate(variants):
            d = os.path.join(root, str(i))
            os.makedirs(d, exist_ok=True)
            opts = f"--keep-ptx --keep-cubin --dump-dir {d}"
            t0 = time.time()
        BODY
            sys.stderr.flush()
            print(f"@@done {i} {time.time() - t0:.2f}", file=sys.stderr, flush=True)
        """
    )
    body = textwrap.indent(textwrap.dedent(body).strip(), " " * 4)
    return textwrap.dedent(imports).strip() + "\n" + loop.replace("BODY", body)


def compile_with_dumps(script: str, variants: list[dict], dump_root, timeout: float = 1200) -> dict[int, dict]:
    """Run ``script`` (argv: variants as JSON, dump root) that compiles variant ``i`` with
    ``--keep-ptx --keep-cubin --dump-dir <root>/<i>`` and prints ``@@done <i> <seconds>`` to stderr after each.

    Returns, per variant index, its ptxas remarks (the output since the previous marker), compile
    seconds, the PTX text and the cubin paths, for checks on the generated code.
    """
    import glob
    import pathlib

    env = dict(os.environ, CUTE_DSL_COMPILER_OPT="remarks{ptx}", CUTE_DSL_ARCH="sm_90a", PYTHONPATH=REPO)
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(variants), str(dump_root)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
        check=False,
    )  # fmt: skip
    log = proc.stdout
    assert proc.returncode == 0, log[-6000:]
    # ptxas remarks arrive in compile order; split them at the per-variant markers.
    chunks = re.split(r"@@done (\d+) ([0-9.]+)", log)
    out = {}
    for j in range(1, len(chunks), 3):
        d = pathlib.Path(dump_root) / chunks[j]
        out[int(chunks[j])] = {
            "remarks": chunks[j - 1],
            "seconds": float(chunks[j + 1]),
            "ptx": "".join(pathlib.Path(p).read_text() for p in glob.glob(str(d / "*.ptx"))),
            "cubins": glob.glob(str(d / "*.cubin")),
        }
    return out


# ptxas remarks that a warp-specialized WGMMA kernel must not draw: setmaxnreg ignored, WGMMAs serialised or waited
WGMMA_REMARKS = ("C7508", "C7510", "C7517", "C7515")


def assert_wgmma_kernel(res: dict, spill_bytes: int = 0, setmaxnreg: bool = True,
                        remarks_absent: tuple[str, ...] = WGMMA_REMARKS) -> None:  # fmt: skip
    """One ``compile_with_dumps`` result is an sm_90a WGMMA + TMA kernel (with register reallocation unless not
    ``setmaxnreg``) whose ptxas report shows at most ``spill_bytes`` of spill stores and loads and none of
    ``remarks_absent``."""
    ptx, remarks = res["ptx"], res["remarks"]
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    if setmaxnreg:
        assert "setmaxnreg" in ptx
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", remarks)
    assert spills, remarks[-3000:]
    assert all(int(a) <= spill_bytes and int(b) <= spill_bytes for a, b in spills), spills
    for code in remarks_absent:
        assert code not in remarks, remarks[-3000:]


def assert_mma_sync_kernel(res: dict, max_spill_bytes: int = 0) -> None:
    """One ``compile_with_dumps`` result is an sm_90a kernel on tf32 ``mma.sync`` fed by ``cp.async``, spilling at
    most ``max_spill_bytes``."""
    ptx, remarks = res["ptx"], res["remarks"]
    assert ".target sm_90a" in ptx
    assert "mma.sync.aligned.m16n8k8" in ptx and ".tf32" in ptx and "cp.async" in ptx
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", remarks)
    assert spills, remarks[-3000:]
    assert all(int(a) <= max_spill_bytes and int(b) <= max_spill_bytes for a, b in spills), spills
