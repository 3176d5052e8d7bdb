"""A kernel rewrite against the version before it: every output bit for bit, and each side's time.

    device run, carry [".device"]:  bash scripts/device/run.sh python scripts/device/kernel_ab.py REV [CASE ...]

For a change that keeps each element's arithmetic (docs/testing.md: such a rewrite is checked bit for bit, not
against a tolerance). The working tree's launcher runs as cula calls it; REV's host module and its ``_kernel``
module (``git show REV:...``, so REV must be in the device's copy of ``.git``, which can lag the checkout; or,
where REV names a directory of the working tree, its copies of those files at their repository paths, e.g.
``git show main:cula/ops/kda/sm90/bwd_dhu_kernel.py > ab_base/cula/ops/kda/sm90/bwd_dhu_kernel.py``, left
untracked so that they travel with the tree) are loaded beside it under other names, compiled outside cula's
caches (same compile key, other code), and called with the same arguments. Each case prints, per side, the
median of ``--iters`` timed calls (CUDA events; the inputs are far larger than L2) and whether every output equals
the working tree's bit for bit (where not, the largest relative RMSE between the two sides' outputs) and is free of
NaN. No CASE: all of them (``--list``). Exit status 1 when any output differs.
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from common import bench  # noqa: E402  (the benchmarks' timing: CUDA events, the median)

from cula.testing import chunk_local_gate, rel_rmse  # noqa: E402


def load_rev(rev: str, host: str) -> types.ModuleType:
    """``host`` (a dotted module name) and its ``_kernel`` module as they were at ``rev``, compiled outside cula's
    caches. The DSL reads a kernel's source, so the two are written to files (under the temporary directory) and
    imported from there."""
    import importlib.util
    import tempfile

    alias = f"_kernel_ab_{Path(rev).name}_{host.rsplit('.', 1)[-1]}"
    where = Path(tempfile.gettempdir()) / "kernel_ab"
    where.mkdir(exist_ok=True)
    tree = REPO / rev if (REPO / rev).is_dir() else None  # a directory of the files as they were, or a commit
    for suffix in ("", "_kernel"):
        path = host.replace(".", "/") + suffix + ".py"
        if tree is not None:
            (where / f"{alias}{suffix}.py").write_text((tree / path).read_text())
            continue
        text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, text=True)
        if text.returncode:
            sys.exit(f"git show {rev}:{path} failed (is {rev} in this checkout's .git?): {text.stderr.strip()}")
        (where / f"{alias}{suffix}.py").write_text(text.stdout)
    sys.path.insert(0, str(where))
    module = importlib.import_module(alias)  # its kernel_attr imports <alias>_kernel from the same directory
    built: dict = {}
    module.compiled_kernel = lambda key, build: built[key] if key in built else built.setdefault(key, build())
    return module


# ------------------------------------------------------------------------------------------------------- cases
def _randn(gen: torch.Generator, *shape, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``scale`` times standard normal draws from ``gen`` on the GPU, as ``dtype``: the cases' random inputs."""
    return (scale * torch.randn(*shape, device="cuda", generator=gen)).to(dtype)


def _wy_inputs(B: int, T: int, HV: int, state_v_first: bool, lens: list[int] | None = None, pad_rows: int = 0):
    """Stage 6's inputs (``chunk_kda_bwd_wy_dqkg_sm90``), random but finite; packed with ``lens``, its chunk list
    then ending with ``pad_rows`` padding rows, as a list built on the device does."""
    from cula.ops.kda.sm90.intra import prepare_chunk_indices_i32
    from cula.testing import make_cu_seqlens

    gen = torch.Generator(device="cuda").manual_seed(0)
    rnd = functools.partial(_randn, gen)

    extra, states = {}, (B, -(-T // 64), HV, 128, 128)  # a state per chunk, per sequence or per chunk-list row
    if lens is not None:
        cu = make_cu_seqlens(lens, device="cuda")
        ci = prepare_chunk_indices_i32(cu)
        ci = torch.cat([ci, torch.tensor([[len(lens) - 1, 10**6]] * pad_rows, dtype=torch.int32, device="cuda")])
        extra, states = dict(cu_seqlens=cu, chunk_indices=ci), (1, ci.shape[0], HV, 128, 128)
    g = chunk_local_gate(B, T, HV, 128, generator=gen)
    return dict(
        q=rnd(B, T, HV, 128), k=rnd(B, T, HV, 128), v=rnd(B, T, HV, 128), v_new=rnd(B, T, HV, 128), g=g,
        beta=torch.rand(B, T, HV, device="cuda", generator=gen), A=rnd(B, T, HV, 64, scale=0.1),
        h=rnd(*states, scale=0.1), do=rnd(B, T, HV, 128), dh=rnd(*states, scale=0.1), dv=rnd(B, T, HV, 128),
        state_v_first=state_v_first, **extra,
    )  # fmt: skip


def _intra_inputs(B: int, T: int, H: int, HV: int, lens: list[int] | None = None, fused: bool = True):
    """Stage 7's inputs (``chunk_kda_bwd_intra_sm90``), random but finite, with stage 8 on chip and, with ``fused``,
    stage 9 (the gate's backward) and, without GVA, the L2 norm's."""
    wy = _wy_inputs(B, T, HV, False, lens)
    gen = torch.Generator(device="cuda").manual_seed(1)
    rnd = functools.partial(_randn, gen, dtype=torch.float32)

    q, k = (rnd(B, T, H, 128).bfloat16() for _ in range(2))
    extra = {n: wy[n] for n in ("cu_seqlens", "chunk_indices") if n in wy}
    if fused:
        extra["gate"] = (rnd(B, T, HV, 128), rnd(HV), rnd(HV * 128), -5.0)
        if H == HV:
            extra["qk_rstd"] = tuple(0.5 + torch.rand(B * T * H, device="cuda", generator=gen) for _ in range(2))
    return dict(
        q=q, k=k, g=wy["g"], beta=wy["beta"], dAqk=rnd(B, T, HV, 64, scale=0.1), dAkk=rnd(B, T, HV, 64, scale=0.1),
        dq=rnd(B, T, HV, 128), dk=rnd(B, T, HV, 128), db=rnd(B, T, HV), dg=rnd(B, T, HV, 128),
        reverse_cumsum_dg=True, **extra,
    )  # fmt: skip


def _dhu_inputs(B: int, T: int, HV: int, state_v_first: bool, lens: list[int] | None = None):
    """Stages 4 and 5's inputs (``chunk_kda_bwd_dv_dhu_sm90``), random but finite (Aqk zero above each chunk's
    diagonal as cula's intra kernel writes it), with dht in and dh0 out."""
    wy = _wy_inputs(B, T, HV, state_v_first, lens)
    N = B if lens is None else len(lens)
    dht = 0.1 * torch.randn(N, HV, 128, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    extra = {n: wy[n] for n in ("cu_seqlens", "chunk_indices") if n in wy}
    # qg, kg and w small enough that the recurrence stays bounded over 256 chunks
    return dict(q=wy["q"] * 0.02, k=wy["k"] * 0.02, w=wy["v"] * 0.02, do=wy["do"], Aqk=_causal(wy["A"]),
                v_new=wy["v_new"], gk=wy["g"], h0=dht, dht=dht, scale=0.088, state_v_first=state_v_first,
                **extra)  # fmt: skip


def _causal(a: torch.Tensor) -> torch.Tensor:
    """``a`` ``[B, T, HV, 64]`` with each 64-token chunk's entries above the diagonal zeroed (rows by token)."""
    t = torch.arange(a.shape[1], device=a.device)
    keep = (t % 64)[:, None] >= torch.arange(64, device=a.device)[None, :]
    return a * keep[None, :, None, :].to(a.dtype)


def _states_inputs(B: int, T: int, HV: int):
    """The forward state kernel's inputs (``chunk_kda_delta_h_fwd_o_sm90``; T a multiple of 64, Aqk zero above each
    chunk's diagonal as cula's intra kernel writes it), its outputs o and the final state written in place (``OUT``:
    fresh ones for each side)."""
    wy = _wy_inputs(B, T, HV, True)
    h0 = 0.1 * torch.randn(B, HV, 128, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    aqk = _causal(wy["A"])
    # w and kg small enough that the recurrence stays bounded over 256 chunks
    return dict(w=wy["q"] * 0.02, u=wy["v"], kg=wy["k"] * 0.02, qg=wy["v_new"], g=wy["g"], Aqk=aqk,
                o=torch.empty_like(wy["v"]), initial_state=h0, final_state=torch.empty_like(h0), scale=0.088,
                state_v_first=True, aqk_causal=True, OUT=("o", "final_state"))  # fmt: skip


def _states_packed_inputs(HV: int, lens: list[int]):
    """``_states_inputs`` of packed sequences (an empty one, partial last chunks); Aqk zero above the diagonal of
    each 64 tokens of the pack, not of each sequence's chunks: any operands will do for a bit-for-bit comparison."""
    T = sum(lens)
    x = _states_inputs(1, T, HV)
    wy = _wy_inputs(1, T, HV, True, lens)
    gen = torch.Generator(device="cuda").manual_seed(3)
    h0 = 0.1 * torch.randn(len(lens), HV, 128, 128, device="cuda", generator=gen)
    return dict(x, initial_state=h0, final_state=torch.empty_like(h0), cu_seqlens=wy["cu_seqlens"])


def _states_rows_inputs(B: int, T: int, H: int, HV: int):
    """The state kernel's Gated DeltaNet variant (``row_factors``): raw q / k of H heads and per-token factor rows
    (f_q, f_k, f_g, unused), the decay f_g = exp2 of a chunk-local cumsum."""
    x = _states_inputs(B, T, HV)
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k = (_randn(gen, B, T, H, 128) for _ in range(2))
    g = chunk_local_gate(B, T, HV, generator=gen)
    rows = torch.stack([0.088 * torch.rand(B, T, HV, device="cuda", generator=gen),
                        0.02 * torch.rand(B, T, HV, device="cuda", generator=gen), torch.exp2(g),
                        torch.zeros(B, T, HV, device="cuda")], dim=-1).contiguous()  # fmt: skip
    return dict(x, kg=k, qg=q, g=rows, row_factors=True)


def _intra_fwd_inputs(B: int, T: int, H: int, HV: int, lens: list[int] | None = None):
    """The forward intra kernel's inputs (``chunk_kda_intra_sm90``: raw q / k normalised in the kernel, the
    lower-bound gate and the beta sigmoid fused, as the benchmarks' flags), its outputs written in place (``OUT``:
    fresh ones for each side; every row is written, g_cum's included)."""
    from cula.testing import make_cu_seqlens

    gen = torch.Generator(device="cuda").manual_seed(4)
    rnd = functools.partial(_randn, gen)

    extra = {} if lens is None else dict(cu_seqlens=make_cu_seqlens(lens, device="cuda"))
    def out(width, dtype=torch.bfloat16):  # shapes only: each side gets fresh ones (OUT)
        return torch.empty(B, T, HV, width, dtype=dtype, device="cuda")

    return dict(
        q=rnd(B, T, H, 128), k=rnd(B, T, H, 128), v=rnd(B, T, HV, 128), g=rnd(B, T, HV, 128), beta=rnd(B, T, HV),
        scale=0.088, w=out(128), u=out(128), qg=out(128), kg=out(128), Aqk=out(64), g_cum=out(128, torch.float32),
        gate="lower_bound",
        A_log=rnd(HV, dtype=torch.float32), dt_bias=rnd(HV * 128, dtype=torch.float32), lower_bound=-5.0,
        use_qk_l2norm=True, beta_sigmoid=True, OUT=("w", "u", "qg", "kg", "Aqk", "g_cum"), **extra,
    )  # fmt: skip


def _intra_gdn_inputs(B: int, T: int, H: int, HV: int, lens: list[int] | None = None):
    """The intra kernel as Gated DeltaNet's inference calls it (``scalar_gate``: g ``[B, T, HV]``, the fused
    softplus gate, the L2 norm and beta sigmoid in the kernel, the per-token factor rows in place of qg, kg and
    g_cum): ``_intra_fwd_inputs`` with one gate a head, its outputs written in place (``OUT``)."""
    from cula.ops._host import ROW_FACTORS

    x = _intra_fwd_inputs(B, T, H, HV, lens)
    del x["lower_bound"]
    return {**x, "g": x["g"][..., 0].contiguous(), "dt_bias": x["dt_bias"][:HV].contiguous(), "gate": "softplus",
            "qg": None, "kg": None, "g_cum": None, "OUT": ("w", "u", "Aqk", "row_factors"),
            "row_factors": torch.empty(B, T, HV, ROW_FACTORS, dtype=torch.float32, device="cuda")}  # fmt: skip


def _intra_gdn_wy_inputs(B: int, T: int, H: int, HV: int):
    """``_intra_gdn_inputs`` for the ``wy_in_recurrence`` variant: T diag(beta) in place of w and u."""
    x = _intra_gdn_inputs(B, T, H, HV)
    return {**x, "w": None, "u": None, "OUT": ("Aqk", "row_factors", "t_beta"),
            "t_beta": torch.empty(B, T, HV, 64, dtype=torch.bfloat16, device="cuda")}  # fmt: skip


def _chain_inputs(HV: int, segments: list[int], state_v_first: bool):
    """The time-parallel chain's inputs (``chunk_kda_segment_chain_sm90``): ``segments[n]`` segments for sequence n,
    random summaries whose transitions keep the chain bounded, initial states; the starts and final states written
    in place (``OUT``: fresh ones for each side)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    M, N = sum(segments), len(segments)
    summary = torch.randn(M, 2 * HV, 128, 128, device="cuda", generator=gen)
    summary[:, HV:] *= 0.9 / 128**0.5  # the transitions: spectral radius about 0.9
    first = torch.tensor([0, *torch.tensor(segments).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    h0 = torch.randn(N, HV, 128, 128, device="cuda", generator=gen)
    return dict(summary=summary, initial_state=h0, starts=torch.empty(M, HV, 128, 128, device="cuda"),
                final_state=torch.empty_like(h0), first_segment=first, state_v_first=state_v_first,
                OUT=("starts", "final_state"))  # fmt: skip


def _summary_inputs(HV: int, T: int, segments: int, mids: bool = False, row_factors: bool = False):
    """The time-parallel first pass's inputs (``chunk_kda_segment_summary_sm90``): one sequence of T tokens cut into
    ``segments`` equal segments (the H200 plan of 4 heads x 64K: 16), the state kernel's operands; E and R (and with
    ``mids`` the first halves') written in place (``OUT``: fresh ones for each side)."""
    x = _states_rows_inputs(1, T, HV, HV) if row_factors else _states_inputs(1, T, HV)
    bounds = torch.linspace(0, T, segments + 1, dtype=torch.int64).div(64, rounding_mode="floor") * 64
    bounds[-1] = T
    ends = torch.empty(segments, 2 * HV, 128, 128, device="cuda")
    out = dict(w=x["w"], u=x["u"], kg=x["kg"], g=x["g"], ends=ends, segments=bounds.to("cuda", torch.int32),
               state_v_first=True, row_factors=row_factors, OUT=("ends", "mids") if mids else ("ends",))  # fmt: skip
    if mids:
        out["mids"] = torch.empty_like(ends)
    return out


def _lightning_inputs(B: int, T: int, HV: int, lens: list[int] | None = None):
    """The Lightning prefill kernel's inputs (``lightning_fwd_sm90``: q / k / v bf16, a decay per head from none to
    strong, initial states in the [V, K] layout), o and the final states written in place (``OUT``: fresh ones for
    each side)."""
    from cula.testing import make_cu_seqlens

    gen = torch.Generator(device="cuda").manual_seed(6)
    rnd = functools.partial(_randn, gen)
    N = B if lens is None else len(lens)
    h0 = 0.1 * torch.randn(N, HV, 128, 128, device="cuda", generator=gen)
    decay = torch.linspace(0.0, 2.0, HV, device="cuda")
    return dict(q=rnd(B, T, HV, 128), k=rnd(B, T, HV, 128), v=rnd(B, T, HV, 128), decay=decay,
                o=torch.empty(B, T, HV, 128, dtype=torch.bfloat16, device="cuda"), initial_state=h0,
                final_state=torch.empty_like(h0), cu_seqlens=None if lens is None else make_cu_seqlens(lens, "cuda"),
                scale=0.088, state_v_first=True, OUT=("o", "final_state"))  # fmt: skip


def _lightning_states_inputs(B: int, T: int, HV: int):
    """The Lightning kernel's states-only variant (``lightning_states_sm90``, the time split's first pass): k / v
    and decays as ``_lightning_inputs``, the final states written in place."""
    x = _lightning_inputs(B, T, HV)
    return dict(k=x["k"], v=x["v"], decay=x["decay"], initial_state=x["initial_state"], final_state=x["final_state"],
                cu_seqlens=None, state_v_first=True, OUT=("final_state",))  # fmt: skip


_CHAIN = ("cula.ops.kda.sm90.segment_chain", "chunk_kda_segment_chain_sm90")
_SUMMARY = ("cula.ops.kda.sm90.segment_summary", "chunk_kda_segment_summary_sm90")
_INTRA_FWD = ("cula.ops.kda.sm90.intra", "chunk_kda_intra_sm90")
_STATES = ("cula.ops.kda.sm90.delta_h_fwd_o", "chunk_kda_delta_h_fwd_o_sm90")
_DHU = ("cula.ops.kda.sm90.bwd_dhu", "chunk_kda_bwd_dv_dhu_sm90")
_WY = ("cula.ops.kda.sm90.bwd_wy_dqkg", "chunk_kda_bwd_wy_dqkg_sm90")
_INTRA = ("cula.ops.kda.sm90.bwd_intra", "chunk_kda_bwd_intra_sm90")
_LIGHTNING = ("cula.ops.lightning.sm90.chunk_fwd", "lightning_fwd_sm90")
_LIGHTNING_STATES = ("cula.ops.lightning.sm90.chunk_fwd", "lightning_states_sm90")
CASES: dict[str, tuple[tuple[str, str], Callable[[], dict]]] = {
    # the Lightning prefill kernel: the benchmark's largest fixed shape (byte-bound), few lanes (8 heads x 2 V slices
    # walking 512 chunks: chain-bound, as a time split's segments), and packed (an empty sequence, partial chunks)
    "lightning-B2-T16384-H64": (_LIGHTNING, lambda: _lightning_inputs(2, 16384, 64)),
    "lightning-B1-T32768-H8": (_LIGHTNING, lambda: _lightning_inputs(1, 32768, 8)),
    "lightning-packed": (_LIGHTNING, lambda: _lightning_inputs(1, 20000, 8, [1, 8000, 63, 0, 11806, 130])),
    # its states-only variant (the time split's first pass), chain-bound as there
    "lightning-states-B1-T32768-H8": (_LIGHTNING_STATES, lambda: _lightning_states_inputs(1, 32768, 8)),
    # the forward's intra kernel (fused norm, gate and beta sigmoid), fixed and packed (empty and partial sequences)
    "intra-B2-T16384": (_INTRA_FWD, lambda: _intra_fwd_inputs(2, 16384, 64, 64)),
    "intra-packed-gva": (_INTRA_FWD, lambda: _intra_fwd_inputs(1, 20000, 4, 8, [1, 8000, 63, 0, 11806, 130])),
    # ... as Gated DeltaNet's inference runs it (scalar gate, factor rows) at its H200 anchors' shapes, and packed
    "intra-gdn-T32768-H16-HV32": (_INTRA_FWD, lambda: _intra_gdn_inputs(1, 32768, 16, 32)),
    "intra-gdn-B4-T8192-H16-HV64": (_INTRA_FWD, lambda: _intra_gdn_inputs(4, 8192, 16, 64)),
    "intra-gdn-packed": (_INTRA_FWD, lambda: _intra_gdn_inputs(1, 20000, 4, 8, [1, 8000, 63, 0, 11806, 130])),
    # ... writing T diag(beta) for the recurrence instead of w and u (GdnTuning.inference_wy_in_recurrence)
    "intra-gdn-wy-T32768-H16-HV32": (_INTRA_FWD, lambda: _intra_gdn_wy_inputs(1, 32768, 16, 32)),
    "intra-gdn-wy-B4-T8192-H16-HV64": (_INTRA_FWD, lambda: _intra_gdn_wy_inputs(4, 8192, 16, 64)),
    # the time-parallel chain: the H200 plans of 4 heads x 64K (16 segments), 8 x 64K (8), 16 x 64K (4), and 16 heads x
    # two sequences
    "segment_chain-H4-M16-vk": (_CHAIN, lambda: _chain_inputs(4, [16], True)),
    "segment_chain-H16-N2-kv": (_CHAIN, lambda: _chain_inputs(16, [4, 6], False)),
    "segment_chain-H8-M8-vk": (_CHAIN, lambda: _chain_inputs(8, [8], True)),
    "segment_chain-H16-M4-kv": (_CHAIN, lambda: _chain_inputs(16, [4], False)),
    # the time-parallel first pass: E and R of 4 heads x 64K in 16 segments (as planned on the H200), with the first
    # halves' too, and Gated DeltaNet's row factors at 32 value heads x 32K in 4 segments
    "summary-H4-T65536-M16": (_SUMMARY, lambda: _summary_inputs(4, 65536, 16)),
    "summary-mids-H4-T65536-M16": (_SUMMARY, lambda: _summary_inputs(4, 65536, 16, mids=True)),
    "summary-rows-HV32-T32768-M4": (_SUMMARY, lambda: _summary_inputs(32, 32768, 4, row_factors=True)),
    # the forward's state / output kernel (cula's causal Aqk: o by TMA), fixed at the benchmark's shape
    "states-B2-T16384": (_STATES, lambda: _states_inputs(2, 16384, 64)),
    # few lanes (4 CTAs walking 512 chunks: the chain-bound case), packed (an empty sequence, partial last chunks),
    # and Gated DeltaNet's row-factor variant at its H200 anchor's shape (one 32K sequence, 32 value heads)
    "states-B1-T32768-H4": (_STATES, lambda: _states_inputs(1, 32768, 4)),
    "states-packed": (_STATES, lambda: _states_packed_inputs(8, [1, 8000, 63, 0, 11806, 130])),
    "states-rows-T32768-H16-HV32": (_STATES, lambda: _states_rows_inputs(1, 32768, 16, 32)),
    # stages 4 and 5 at the training benchmark's largest shape, and packed (empty, length-1 and partial sequences)
    "bwd_dhu-B2-T16384-vk": (_DHU, lambda: _dhu_inputs(2, 16384, 64, True)),
    "bwd_dhu-packed-kv": (_DHU, lambda: _dhu_inputs(1, 20000, 8, False, [1, 8000, 63, 0, 11806, 130])),
    # stage 6 at the training benchmark's largest shape, both state layouts
    "bwd_wy_dqkg-B2-T16384-vk": (_WY, lambda: _wy_inputs(2, 16384, 64, True)),
    "bwd_wy_dqkg-B2-T16384-kv": (_WY, lambda: _wy_inputs(2, 16384, 64, False)),
    # packed: empty, length-1 and partial sequences, more items than SMs, padding rows at the list's end
    "bwd_wy_dqkg-packed": (_WY, lambda: _wy_inputs(1, 20000, 8, True, [1, 8000, 63, 0, 11806, 130], 40)),
    # stage 7 with stages 8, 9 and the L2 norm's backward (the H200 entry's), and packed with GVA (no norm)
    "bwd_intra-B2-T16384-fused": (_INTRA, lambda: _intra_inputs(2, 16384, 64, 64)),
    "bwd_intra-packed-gva": (_INTRA, lambda: _intra_inputs(1, 20000, 4, 8, [1, 8000, 63, 0, 11806, 130])),
}


def _returning(fn: Callable, inputs: dict) -> Callable:
    """``fn``, or for a function that writes the inputs named in ``inputs["OUT"]`` in place, a call of it on fresh
    copies of those that returns them (each side its own outputs)."""
    out = inputs.get("OUT")
    if not out:
        return fn

    def call(**kw):
        fresh = {n: torch.empty_like(kw[n]) for n in out}
        fn(**{**kw, **fresh})
        return tuple(fresh[n] for n in out)

    return call


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("rev", nargs="?", help="the commit to compare against")
    ap.add_argument("cases", nargs="*")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args()
    if a.list or a.rev is None:
        print("\n".join(CASES))
        return 0
    import importlib

    same = True
    old_hosts: dict[str, types.ModuleType] = {}
    for name in a.cases or list(CASES):
        (host, fn_name), make = CASES[name]
        new_fn = getattr(importlib.import_module(host), fn_name)
        if host not in old_hosts:
            old_hosts[host] = load_rev(a.rev, host)
        old_fn = getattr(old_hosts[host], fn_name)
        inputs = make()
        new_fn, old_fn = _returning(new_fn, inputs), _returning(old_fn, inputs)
        inputs = {n: t for n, t in inputs.items() if n != "OUT"}
        new, old = new_fn(**inputs), old_fn(**inputs)
        torch.cuda.synchronize()
        outs_new = new if isinstance(new, tuple) else (new,)
        outs_old = old if isinstance(old, tuple) else (old,)
        equal = all(torch.equal(x, y) for x, y in zip(outs_new, outs_old)) and len(outs_new) == len(outs_old)
        nan = any(x.is_floating_point() and x.isnan().any().item() for x in outs_new)
        same &= equal and not nan
        t_new = bench(lambda f=new_fn, x=inputs: f(**x), iters=a.iters, warmup=1).median_ms
        t_old = bench(lambda f=old_fn, x=inputs: f(**x), iters=a.iters, warmup=1).median_ms
        # a rewrite that changes a summation order is not bit for bit: how far it moved, for the tests to judge
        moved = "" if equal or len(outs_new) != len(outs_old) else "; largest relative RMSE against it: " + (
            f"{max(rel_rmse(y, x) for x, y in zip(outs_new, outs_old) if x.is_floating_point()):.2e}")
        print(f"{name}: working tree {t_new:.3f} ms, {a.rev} {t_old:.3f} ms ({t_old / t_new:.2f}x); "
              f"outputs bit for bit equal: {equal}{moved}; NaN in the working tree's: {nan}", flush=True)  # fmt: skip
        inputs = new = old = outs_new = outs_old = None  # free this case's tensors before the next one's
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
