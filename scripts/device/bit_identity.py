"""Bit identity of the KDA intra kernel against an earlier version of ``cula/ops/kda/sm90/intra.py``.

    device run, carry [".device"]:  bash scripts/device/run.sh python scripts/device/bit_identity.py REF.py

REF.py is a copy of the earlier module (``git show <commit>:cula/ops/kda/sm90/intra.py > REF.py``, untracked, in
the working tree so it travels to the device). Both versions run the intra GPU tests' cases (every gate kind,
fixed and varlen, partial chunks, GVA; plain and with the fused preprocessing) on the same NaN-poisoned outputs,
and every output must match bit for bit, the untouched rows past each sequence end included. For rewrites that
keep each element's arithmetic (store paths, addressing, loop structure): no switch or second code path needed.
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


def load_ref(path: str):
    spec = importlib.util.spec_from_file_location("cula_intra_ref", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
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
