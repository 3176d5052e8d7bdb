"""Bit identity of the KDA intra kernel against an earlier version of ``cula/ops/kda/sm90/intra.py``.

    device run, carry [".device"]:  bash scripts/device/run.sh python scripts/device/bit_identity.py REF.py

REF.py is a copy of the earlier kernel module (``git show <commit>:cula/ops/kda/sm90/intra_kernel.py > REF.py``, or
``intra.py`` of a commit from before the kernel had a module of its own), untracked, in the working tree so it
travels to the device; a kernel module runs under today's host side (``intra.py``). Both versions run the intra GPU
tests' cases (every gate kind, fixed and varlen, partial chunks, GVA; plain and with the fused preprocessing) on the
same NaN-poisoned outputs, and every output must match bit for bit, the untouched rows past each sequence end
included. For rewrites that keep each element's arithmetic (store paths, addressing, loop structure): no switch or
second code path needed.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tests", "ops"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


_HOSTS = {"ChunkKDAIntraFwdSm90": "intra.py", "DeltaHFwdOFusedSm90": "delta_h_fwd_o.py"}


def load_ref(path: str):
    """A module copy under its own compile cache: a whole module of a commit from before the kernels had modules
    of their own, or a kernel module (``*_kernel.py``), run under today's host side of that kernel."""
    with open(path) as f:
        src = f.read()
    name = f"cula_ref_{len([m for m in sys.modules if m.startswith('cula_ref_')])}"
    if "def get_compiled" in src:  # host side and kernel in one module
        mod = _load(name, path)
    else:  # the kernel alone: today's host side finds it as its "<name>_kernel" (cula.ops._host.kernel_attr)
        host = next(h for cls, h in _HOSTS.items() if f"class {cls}" in src)
        _load(name + "_kernel", path)
        mod = _load(name, os.path.join(ROOT, "cula", "ops", "kda", "sm90", host))
    # its own compile cache: the key names the same class, so the shared cache would hand back today's kernel
    cache: dict = {}
    mod.compiled_kernel = lambda key, build: cache[key] if key in cache else cache.setdefault(key, build())
    return mod


def main() -> None:
    import test_kda_intra_kernel as T

    from cula.ops.kda.sm90 import intra as cur
    from cula.ops.kda.sm90.intra import prepare_chunk_indices_i32

    ref = load_ref(sys.argv[1])
    bad = 0
    for case in T.CASES:
        for fused in (False, True):
            q, k, v, g, beta, cu, A_log, dt_bias, lb = (T._raw_preproc if fused else T._setup)(case)
            extra = {"use_qk_l2norm": True, "beta_sigmoid": True} if fused else {}
            ci = prepare_chunk_indices_i32(cu) if cu is not None else None
            outs = [
                T._run_ours(q, k, v, g, beta, 128**-0.5, cu, ci, case[5], A_log, dt_bias, lb,
                            launcher=mod.chunk_kda_intra_sm90, **extra)  # fmt: skip
                for mod in (ref, cur)
            ]
            torch.cuda.synchronize()
            diff = [n for n, a, b in zip(("g_cum", "w", "u", "qg", "kg", "Aqk"), *outs)
                    if not torch.equal(a.view(torch.int8), b.view(torch.int8))]  # fmt: skip
            bad += bool(diff)
            verdict = "DIFFER " + " ".join(diff) if diff else "same bits"
            print(f"{T._case_id(case)} {'fused' if fused else 'plain'}: {verdict}")
    print(f"bit identity: {'FAILED' if bad else 'passed'} ({bad} of {2 * len(T.CASES)} differ)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
