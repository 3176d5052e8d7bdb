"""chunk_kda's one host call for both stages (``cula/ops/kda/sm90/fwd_launch.py``), on the CPU.

The launcher only composes the intra kernel and the state/output kernel; it must not change either. Each
variant is compiled for sm_90a three times, as the launcher and as the two kernels alone (what the general path
runs), and the two kernels' SASS must match instruction for instruction, up to branch labels and the offsets of
kernel parameters. The GPU side (the bound launch against the general path, bit for bit) is
``tests/test_chunk_plans.py::test_bound_launch_bit_identical_cuda``.
"""

from __future__ import annotations

import re
import subprocess

import pytest
from cute_compile import compile_with_dumps, dump_script

from cula.testing import find_nvdisasm

# the benchmarks' call (sigmoid gate, fused norms, bf16 g and beta, both states) and a plain one (log-space fp32
# gate, fp32 beta, fp16, no states, [K, V] state layout)
_VARIANTS = [
    {"dtype": "BFloat16", "g_dtype": "BFloat16", "beta_dtype": "BFloat16", "gate": "lower_bound", "l2norm_qk": True,
     "beta_act": "sigmoid", "h0": True, "ht": True, "state_v_first": True},
    {"dtype": "Float16", "g_dtype": "Float32", "beta_dtype": "Float32", "gate": "none", "l2norm_qk": False,
     "beta_act": "none", "h0": False, "ht": False, "state_v_first": False},
    # packed sequences (ChunkKDAVarlenFwdSm90): the kernels' varlen variants
    {"dtype": "BFloat16", "g_dtype": "BFloat16", "beta_dtype": "BFloat16", "gate": "lower_bound", "l2norm_qk": True,
     "beta_act": "sigmoid", "h0": True, "ht": True, "state_v_first": True, "varlen": True},
    # Gated DeltaNet's inference call (one gate per token and head, the factor rows), fixed and packed
    {"dtype": "BFloat16", "g_dtype": "BFloat16", "beta_dtype": "BFloat16", "gate": "softplus", "l2norm_qk": True,
     "beta_act": "sigmoid", "h0": True, "ht": True, "state_v_first": True, "row_factors": True},
    {"dtype": "BFloat16", "g_dtype": "Float32", "beta_dtype": "Float32", "gate": "none", "l2norm_qk": False,
     "beta_act": "none", "h0": False, "ht": True, "state_v_first": False, "row_factors": True, "varlen": True},
    # ... with T diag(beta) in place of w and u (GdnTuning.inference_wy_in_recurrence)
    {"dtype": "BFloat16", "g_dtype": "Float32", "beta_dtype": "BFloat16", "gate": "softplus", "l2norm_qk": True,
     "beta_act": "sigmoid", "h0": True, "ht": True, "state_v_first": True, "row_factors": True, "wy": True},
    {"dtype": "BFloat16", "g_dtype": "BFloat16", "beta_dtype": "Float32", "gate": "none", "l2norm_qk": False,
     "beta_act": "none", "h0": True, "ht": False, "state_v_first": False, "row_factors": True, "wy": True,
     "varlen": True},
]  # fmt: skip

_COMPILE_SCRIPT = dump_script(
    "import cutlass\nfrom cula.ops.kda.sm90 import delta_h_fwd_o, fwd_launch, intra",
    """
    dt, g_dt, b_dt = (getattr(cutlass, v[n]) for n in ("dtype", "g_dtype", "beta_dtype"))
    rows = {"scalar_gate": True, "row_factors": True} if v.get("row_factors") else {}
    wy = {"wy_in_recurrence": True} if v.get("wy") else {}
    # (as the general path compiles each: with row factors the intra kernel writes no g_cum)
    io = dict(dtype=dt, g_dtype=g_dt, beta_dtype=b_dt, gate=v["gate"], l2norm_qk=v["l2norm_qk"],
              beta_act=v["beta_act"], g_cum_last_only=not rows, **rows, **wy)
    so = dict(dtype=dt, has_initial_state=v["h0"], has_final_state=v["ht"], state_v_first=v["state_v_first"],
              aqk_causal=True, **({"row_factors": True} if rows else {}), **wy)
    for part in ("both", "intra", "state"):  # each in a directory of its own
        os.makedirs(os.path.join(d, part), exist_ok=True)
        opts = f"--keep-ptx --keep-cubin --dump-dir {os.path.join(d, part)}"
        vl = v.get("varlen", False)
        if part == "both":
            fwd_launch._compile(io, so, extra_options=opts, varlen=vl)
        elif part == "intra":
            intra._compile(dt, g_dt, b_dt, v["gate"], vl, extra_options=opts, l2norm_qk=v["l2norm_qk"],
                           beta_act=v["beta_act"], g_cum_last_only=not rows, **rows, **wy)
        else:
            delta_h_fwd_o._compile(dt, 3, vl, v["h0"], v["ht"], v["state_v_first"], extra_options=opts,
                                   aqk_causal=True, row_factors=bool(rows), **wy)
    """,
)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("kda_fwd_launch")
    compile_with_dumps(_COMPILE_SCRIPT, _VARIANTS, root)
    return root


def _kernels(nvdisasm: str, cubin: str) -> dict[str, list[str]]:
    """SASS per kernel of a cubin (keyed by which stage it is), labels and parameter offsets masked."""
    sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    out, cur = {}, None
    for line in sass.splitlines():
        m = re.search(r"\.section\s+\.text\.(\S+?),", line)
        if m:
            name = m.group(1)
            cur = "intra" if "ChunkKDAIntraFwdSm90" in name else "state" if "DeltaHFwdOFusedSm90" in name else name
            out[cur] = []
            continue
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(.*?);", line)
        if m and cur is not None:
            # (an indirect branch's target list is the cubin's metadata, not the instruction: the same BRX was seen
            # annotated with three and with four targets in the two builds of one kernel)
            ins = re.sub(r"\.L_x_\d+", "L", re.sub(r"\s*\(\*\"BRANCH_TARGETS[^*]*\*\)", "", m.group(1)))
            out[cur].append(re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[param]", ins))
    return out


@pytest.mark.parametrize(
    "idx", range(len(_VARIANTS)),
    ids=lambda i: _VARIANTS[i]["gate"] + ("-rows" if _VARIANTS[i].get("row_factors") else "")
    + ("-wy" if _VARIANTS[i].get("wy") else "")
    + ("-varlen" if _VARIANTS[i].get("varlen") else ""),
)  # fmt: skip
def test_both_stages_compile_to_the_kernels_alone(dumps, idx):
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        pytest.skip("nvdisasm not found: the launcher compiled, its SASS not compared")
    cubin = {part: next((dumps / str(idx) / part).glob("*.cubin")) for part in ("both", "intra", "state")}
    both = _kernels(nvdisasm, str(cubin["both"]))
    assert sorted(both) == ["intra", "state"]
    for part in ("intra", "state"):
        alone = _kernels(nvdisasm, str(cubin[part]))[part]
        assert len(both[part]) == len(alone) > 1000
        diff = [(a, b) for a, b in zip(both[part], alone) if a != b]
        assert not diff, (part, diff[:5])
