"""DRAM bytes and time of the decode kernels at N=64 against an in-place update of the same bytes, under ncu.

    device run, carry [".device"]:  bash scripts/device/run.sh python scripts/device/decode_dram.py

Both decode kernels stop at ~91% of copy bandwidth at N=64 (HV=64, K=V=128: 268 MB read and written), while
``x.mul_(c)`` over one contiguous buffer of the same size reaches ~97%. This asks the hardware counters whether
the decode moves more DRAM bytes than the state (extra reads of q/k/v/g, write-allocate reads, partial lines) or
the same bytes less efficiently. Writes the ncu table to $OUT/decode_dram.txt and prints it.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import torch

N, P, H, D = 64, 128, 64, 128
METRICS = ",".join([
    "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed", "lts__t_sector_hit_rate.pct",
    "lts__t_sectors_srcunit_tex_op_read.sum", "lts__t_sectors_srcunit_tex_op_write.sum",
    "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__grid_size", "launch__registers_per_thread",
])  # fmt: skip


def target() -> None:
    from profile_kda import decode_inputs

    from cula.kda import kda_decode
    from cula.lightning import lightning_decode

    x = decode_inputs(N, P)
    q, k, v, g, beta, pool, idx = (x[n] for n in ("q", "k", "v", "g", "beta", "pool", "idx"))
    A_log, decay = x["A_log"], x["decay"]
    flat = torch.randn(N * H * D * D, device="cuda")  # the same bytes as the touched states, contiguous
    for _ in range(2):  # the table lists both launches of each kernel: the second ones are warm
        flat.mul_(1.0001)
        kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log, lower_bound=-5.0, check_indices=False)
        lightning_decode(q, k, v, decay, pool, idx, check_indices=False)
        kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log, lower_bound=-5.0, check_indices=False,
                   state_v_first=False)  # the [K, V] TMA box kernel on the same bytes
    torch.cuda.synchronize()


def main() -> None:
    cmd = ["ncu", "--clock-control", "none", "--metrics", METRICS, "--csv", sys.executable, __file__, "--target"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    text = proc.stdout + ("\n" + proc.stderr[-3000:] if proc.returncode else "")
    rows = [line for line in text.splitlines() if line.startswith('"')]
    table = {}
    for r in csv.reader(rows):
        if len(r) < 15 or r[0] == "ID":
            continue
        kid, name, metric, value = r[0], r[4], r[-3], r[-1]
        table.setdefault((int(kid), name[:60]), {})[metric] = value
    lines = []
    for (kid, name), m in sorted(table.items()):
        lines.append(f"[{kid}] {name}")
        for key in METRICS.split(","):
            lines.append(f"    {key:55s} {m.get(key, '-')}")
    report = "\n".join(lines) if lines else text[-6000:]
    print(report)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "decode_dram.txt"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    target() if "--target" in sys.argv else main()
