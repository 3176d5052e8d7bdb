"""Split an Nsight Compute per-SASS source export into the kernel's barrier-separated phases.

    python scripts/device/ncu_phases.py ncu_intra_source.csv   # written by profile_kda.py --ncu-source

Runs here, on the CSV the device run brought back. A phase ends at each BAR.SYNC, WARPGROUP.ARRIVE / DEPBAR or
mbarrier wait (SYNCS), which in cula's kernels are the phase boundaries; for each phase with at least 1% of the
warp stall samples it prints the share of samples, the executed warp instructions, the opcodes holding the most
samples and the top stall reasons.
"""

from __future__ import annotations

import collections
import csv
import sys


def phases(path: str, min_share: float = 0.01) -> None:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    hdr = next(r for r in rows if r and r[0] == "Address")
    data = rows[rows.index(hdr) + 1 :]
    ix = {h: i for i, h in enumerate(hdr)}
    samples, executed = ix["Warp Stall Sampling (All Samples)"], ix["Instructions Executed"]
    stall_cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(int(r[samples]) for r in data) or 1

    def new(start):
        return {"start": start, "samples": 0, "exe": 0, "ops": collections.Counter(), "stalls": collections.Counter()}

    segs, cur = [], new(0)
    for k, r in enumerate(data):
        words = r[ix["Source"]].split()
        op = (words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else ""))
        cur["samples"] += int(r[samples])
        cur["exe"] += int(r[executed] or 0)
        cur["ops"][op.split(".")[0]] += int(r[samples])
        for h in stall_cols:
            cur["stalls"][h[6:]] += int(r[ix[h]])
        if op.startswith(("BAR", "WARPGROUP", "SYNCS")):
            cur["end"], cur["last"] = k, " ".join(words)[:40]
            segs.append(cur)
            cur = new(k + 1)
    segs.append(cur)
    print(f"{total} samples over {len(data)} SASS instructions")
    for s in segs:
        if s["samples"] >= min_share * total:
            stalls = ", ".join(f"{a} {100 * b / total:.1f}%" for a, b in s["stalls"].most_common(3))
            ops = ", ".join(f"{a} {b}" for a, b in s["ops"].most_common(5))
            print(f"[{s['start']:5d}-{s.get('end', len(data) - 1):5d}] {100 * s['samples'] / total:5.1f}%  "
                  f"exec {s['exe']:>10d}  ends {s.get('last', '(kernel end)')!r}\n      ops: {ops}\n      stalls: {stalls}")


if __name__ == "__main__":
    phases(sys.argv[1])
