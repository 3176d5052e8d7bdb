"""What the decode kernels' memory traffic can reach at best on this GPU: the ceiling under the 95% target.

    device run, carry [".device"]:  bash scripts/device/run.sh python scripts/device/decode_ceiling.py

Decode reads each touched fp32 state (64 KB at K=V=128) from a pool and writes it back in place. The benchmarks
score that traffic against ``dst.copy_(src)`` over 1 GiB. This script times, in TB/s of read plus write:
- that copy at 1 GiB and at the decode sizes (N * HV states of 64 KB);
- an in-place elementwise update of one contiguous buffer (read and write of the same addresses);
- a Triton kernel that does only the decode's memory traffic: each program scales one state of the pool, picked
  by an index as in serving (rows of a random permutation of 2N slots), in place, for several tile sizes; and the
  same from a persistent grid (a few programs per SM looping over the tiles).
If the last one tops out near the decode kernels' 3.5-3.7 TB/s, the gap to 95% of the copy is the access pattern
(in place, 64 KB pieces at random pool rows), not the kernels' arithmetic. The part-major rows order the programs as
the decode kernels order their CTAs, with and without the index load and with a decode CTA's token loads and
reduction in front of its stores. Prints a table, writes
$OUT/decode_ceiling.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from common import bench  # the benchmarks' helpers live beside their scripts

HV, D = 64, 128


@triton.jit
def _scale_states(pool, idx, n_heads: tl.constexpr, state: tl.constexpr, block: tl.constexpr):
    pid = tl.program_id(0)
    part = tl.program_id(1)
    row = tl.load(idx + pid // n_heads).to(tl.int64)
    base = pool + (row * n_heads + pid % n_heads) * state + part * block
    offs = tl.arange(0, block)
    x = tl.load(base + offs)
    tl.store(base + offs, x * 1.0001)


@triton.jit
def _scale_states_part_major(pool, idx, n_heads: tl.constexpr, state: tl.constexpr, block: tl.constexpr,
                             indexed: tl.constexpr):
    """As _scale_states, with the parts of one state on consecutive programs (as the decode kernels order their
    CTAs: a state's pieces, then the next head's state of the same pool row); ``indexed`` False: pool row = the
    sequence number, no index load in front of the state's."""
    parts: tl.constexpr = state // block
    pid = tl.program_id(0) // parts
    part = tl.program_id(0) % parts
    if indexed:
        row = tl.load(idx + pid // n_heads).to(tl.int64)
    else:
        row = (pid // n_heads).to(tl.int64)
    base = pool + (row * n_heads + pid % n_heads) * state + part * block
    offs = tl.arange(0, block)
    x = tl.load(base + offs)
    tl.store(base + offs, x * 1.0001)


@triton.jit
def _scale_states_with_tokens(pool, idx, tok, out, n_heads: tl.constexpr, state: tl.constexpr, block: tl.constexpr,
                              tok_elems: tl.constexpr):
    """_scale_states_part_major (indexed) plus what a decode CTA does besides its state traffic: load its (sequence,
    head)'s token vector (``tok_elems`` bf16, the same for every piece of a state, so L2 hits after the first), reduce
    it, and make the state store and a small output store depend on that reduction."""
    parts: tl.constexpr = state // block
    pid = tl.program_id(0) // parts
    part = tl.program_id(0) % parts
    row = tl.load(idx + pid // n_heads).to(tl.int64)
    base = pool + (row * n_heads + pid % n_heads) * state + part * block
    offs = tl.arange(0, block)
    x = tl.load(base + offs)
    t = tl.load(tok + pid * tok_elems + tl.arange(0, tok_elems)).to(tl.float32)
    s = tl.sum(t * t, axis=0)
    tl.store(base + offs, x * 1.0001 + s * 1e-20)
    tl.store(out + tl.program_id(0), s)


@triton.jit
def _scale_states_persistent(pool, idx, n_items, n_heads: tl.constexpr, state: tl.constexpr, block: tl.constexpr):
    """The same traffic from a fixed grid: program p takes items p, p + grid, ... (item = (state, block))."""
    parts: tl.constexpr = state // block
    offs = tl.arange(0, block)
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        pid = item // parts
        row = tl.load(idx + pid // n_heads).to(tl.int64)
        base = pool + (row * n_heads + pid % n_heads) * state + (item % parts) * block
        x = tl.load(base + offs)
        tl.store(base + offs, x * 1.0001)


def tbps(fn, nbytes: float) -> float:
    """Read plus write TB/s from the benchmarks' median GPU time per call (every buffer here is over 4x L2)."""
    return nbytes / (bench(fn, iters=50, warmup=3).median_ms * 1e-3) / 1e12


def main() -> None:
    torch.manual_seed(0)
    rows = {}
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    rows["copy_ 1 GiB"] = tbps(lambda dst=dst, src=src: dst.copy_(src), 2 * src.numel())
    del src, dst
    state = D * D
    for n in (64, 256):
        nbytes = n * HV * state * 4
        a = torch.randn(nbytes // 4, device="cuda")
        b = torch.empty_like(a)
        rows[f"copy_ {nbytes >> 20} MiB (N={n})"] = tbps(lambda a=a, b=b: b.copy_(a), 2 * nbytes)
        rows[f"in-place mul_ {nbytes >> 20} MiB (N={n})"] = tbps(lambda a=a: a.mul_(1.0001), 2 * nbytes)
        del a, b
        pool = torch.randn(2 * n, HV, state, device="cuda")
        idx = torch.randperm(2 * n, device="cuda")[:n].to(torch.int32)
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8):
                def run(block=block, warps=warps, pool=pool, idx=idx, n=n):
                    _scale_states[(n * HV, state // block)](pool, idx, HV, state, block, num_warps=warps)

                rows[f"indexed in-place N={n} block={block} warps={warps}"] = tbps(run, 2 * nbytes)
        # a persistent grid (as Lightning decode's): whether launching ~65 K small CTAs is what costs the last 9%
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for block, warps, per_sm in ((1024, 4, 8), (1024, 4, 16), (4096, 4, 4), (4096, 8, 4)):
            items = n * HV * (state // block)

            def run_p(block=block, warps=warps, per_sm=per_sm, pool=pool, idx=idx, items=items, sms=sms):
                _scale_states_persistent[(sms * per_sm,)](pool, idx, items, HV, state, block, num_warps=warps)

            rows[f"indexed in-place persistent N={n} block={block} warps={warps} {per_sm}/SM"] = tbps(run_p, 2 * nbytes)
        # the same kernel over other index sets: whether the random placement of the 64 KB pieces is what costs
        # the gap to the contiguous in-place rate (identity: pool rows 0..N-1 in order; sorted: the random set
        # in ascending order)
        for name, order in (("identity", torch.arange(n, device="cuda", dtype=torch.int32)),
                            ("sorted", torch.sort(idx).values)):
            for block in (1024, 4096):
                def run_o(block=block, pool=pool, order=order, n=n):
                    _scale_states[(n * HV, state // block)](pool, order, HV, state, block, num_warps=4)

                rows[f"{name} in-place N={n} block={block} warps=4"] = tbps(run_o, 2 * nbytes)
        # the decode kernels' CTA order (a state's pieces on consecutive programs), with and without the index load
        # in front of the state load: whether that dependent round trip is what separates 91% from mul_'s 97%
        ident = torch.arange(n, device="cuda", dtype=torch.int32)
        for indexed, order, name in ((True, idx, "random"), (True, ident, "identity"), (False, ident, "no index")):
            for block in (1024, 2048, 4096):
                def run_pm(block=block, pool=pool, order=order, n=n, indexed=indexed):
                    _scale_states_part_major[(n * HV * (state // block),)](pool, order, HV, state, block, indexed,
                                                                           num_warps=4)

                rows[f"part-major {name} N={n} block={block} warps=4"] = tbps(run_pm, 2 * nbytes)
        # the same with a decode CTA's other work: a token vector per (sequence, head) from L2 (q + k: 256 bf16 =
        # 512 B; q + k + g: 1 KB), reduced, the stores waiting for it. Whether that, not the state traffic's
        # shape, is what holds the decode kernels at 91% (N=64) where this kernel without it reaches 94.5%
        for tok_elems in (256, 512):
            tok = torch.randn(n * HV, tok_elems, device="cuda").to(torch.bfloat16)
            for block in (1024, 4096):
                out = torch.empty(n * HV * (state // block), device="cuda")

                def run_t(block=block, pool=pool, idx=idx, n=n, tok=tok, out=out, tok_elems=tok_elems):
                    _scale_states_with_tokens[(n * HV * (state // block),)](pool, idx, tok, out, HV, state, block,
                                                                            tok_elems, num_warps=4)

                name = f"part-major random + {2 * tok_elems} B tokens N={n} block={block} warps=4"
                rows[name] = tbps(run_t, 2 * nbytes)
        del pool
    width = max(map(len, rows))
    for k, v in rows.items():
        print(f"{k:<{width}} : {v:6.3f} TB/s ({100 * v / rows['copy_ 1 GiB']:5.1f}% of the 1 GiB copy)", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "decode_ceiling.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "tbps": rows}, f, indent=1)


if __name__ == "__main__":
    main()
