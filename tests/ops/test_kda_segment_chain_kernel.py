"""KDA time-parallel second pass on SM90 (``cula/ops/kda/sm90/segment_chain.py``): every segment's true start state
and every sequence's final state from the segment summaries, in one launch.

CPU: every variant traces and compiles for sm_90a without spills; the launcher rejects bad shapes before any
launch and takes 8 value columns a CTA only where the grid that makes still fits one wave. GPU (``-m gpu``): starts
and final states against the float64 chain (``chain_model`` of ``tests/test_kda_time_parallel.py``, the kernel's
contract) for a ragged layout (one segment, many, an empty sequence's single empty segment), with and without
initial and final states, both state layouts, 16 and 8 columns a CTA; NaN-poisoned outputs.
"""

from __future__ import annotations

import re

import pytest
import torch
from cute_compile import compile_with_dumps, dump_script
from test_kda_time_parallel import chain_model

from cula.testing import assert_close

_VARIANTS = [
    {"has_h0": h0, "has_ht": ht, "state_v_first": vf, "cols": cols}
    for h0 in (False, True)
    for ht in (False, True)
    for vf in (False, True)
    for cols in (16, 8)
]

_COMPILE_SCRIPT = dump_script(
    "from cula.ops.kda.sm90 import segment_chain_kernel as M",
    'M._compile(v["has_h0"], v["has_ht"], v["state_v_first"], v["cols"], extra_options=opts)',
)


@pytest.fixture(scope="module")
def compiled_variants(tmp_path_factory):
    return compile_with_dumps(_COMPILE_SCRIPT, _VARIANTS, tmp_path_factory.mktemp("kda_segment_chain"))


@pytest.mark.parametrize("idx", range(len(_VARIANTS)), ids=["-".join(map(str, v.values())) for v in _VARIANTS])
def test_variant_compiles_sm90a(compiled_variants, idx):
    res = compiled_variants[idx]
    assert ".target sm_90a" in res["ptx"] and "bar.sync" in res["ptx"]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res["remarks"])
    assert spills and all(a == b == "0" for a, b in spills), spills


def test_launcher_validates_shapes():
    from cula.ops.kda.sm90.segment_chain import chunk_kda_segment_chain_sm90 as run

    HV, D = 2, 128
    summary, starts = torch.zeros(3, 2 * HV, D, D), torch.zeros(3, HV, D, D)
    first = torch.tensor([0, 2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="summary"):
        run(summary[..., :64], None, starts, None, first)
    with pytest.raises(ValueError, match="int32"):
        run(summary, None, starts, None, first.long())
    with pytest.raises(ValueError, match="starts"):
        run(summary, None, starts[:2], None, first)
    with pytest.raises(ValueError, match="initial_state"):
        run(summary, torch.zeros(3, HV, D, D), starts, None, first)
    with pytest.raises(ValueError, match="final_state"):
        run(summary, None, starts, torch.zeros(2, HV, D, D).double(), first)
    # states may be views whose rows are whole states a multiple apart (the time-parallel halves' interleaved starts),
    # not ones whose rows overlap or whose states are not contiguous, nor a strided summary
    from cula.ops.kda.sm90.segment_chain import _whole_rows

    both = torch.zeros(3, 2, HV, D, D)
    assert _whole_rows(both[:, 0]) and _whole_rows(both[:, 1]) and _whole_rows(starts)
    assert not _whole_rows(torch.zeros(3, 3 * HV * D * D + 1)[:, : HV * D * D].view(3, HV, D, D))
    assert not _whole_rows(starts.transpose(-1, -2)) and not _whole_rows(torch.zeros(3, 1, D, D).expand(3, HV, D, D))
    with pytest.raises(ValueError, match="starts: .* rows of whole states"):
        run(summary, None, starts.transpose(-1, -2), None, first)
    with pytest.raises(ValueError, match="summary: .* contiguous"):
        run(torch.zeros(3, 2, 2 * HV, D, D)[:, 0], None, starts, None, first)


def test_column_block_narrows_only_within_one_wave(pretend_sm90):
    from cula.ops.kda.sm90 import segment_chain

    # 4 and 8 lanes (the time split's 4 and 8 heads of one sequence): 64 and 128 CTAs of 8 columns, one wave of 132
    assert [segment_chain.column_block(n, torch.device("cpu")) for n in (1, 4, 8, 9, 16)] == [8, 8, 8, 16, 16]


@pytest.mark.gpu
@pytest.mark.parametrize("cols", [16, 8])
@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("with_h0,with_ht", [(True, True), (False, True), (True, False), (False, False)])
def test_chain_vs_f64_cuda(state_v_first, with_h0, with_ht, cols, monkeypatch):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from cula.ops.kda.sm90 import segment_chain
    from cula.ops.kda.sm90.segment_chain import chunk_kda_segment_chain_sm90 as run

    monkeypatch.setattr(segment_chain, "column_block", lambda lanes, device: cols)

    torch.manual_seed(0)
    HV, D = 3, 128
    first = [0, 5, 6, 7, 10]  # five segments, one, one (an empty sequence's), three
    M, N = first[-1], len(first) - 1
    E = torch.randn(M, HV, D, D, device="cuda")
    # transitions near a contraction, as the decays make them, with a low-rank part that mixes the rows
    R = 0.9 * torch.eye(D, device="cuda") + 0.3 * torch.randn(M, HV, D, 4, device="cuda") @ torch.randn(
        M, HV, 4, D, device="cuda"
    ) / D  # fmt: skip
    summary = torch.cat((E, R), dim=1).contiguous()
    h0 = torch.randn(N, HV, D, D, device="cuda") if with_h0 else None
    starts = torch.full((M, HV, D, D), float("nan"), device="cuda")
    ht = torch.full((N, HV, D, D), float("nan"), device="cuda") if with_ht else None
    first_t = torch.tensor(first, dtype=torch.int32, device="cuda")
    run(summary, h0, starts, ht, first_t, state_v_first=state_v_first)
    torch.cuda.synchronize()
    ref_starts = torch.empty(M, HV, D, D, dtype=torch.float64)
    ref_ht = torch.empty(N, HV, D, D, dtype=torch.float64)
    chain_model(summary.cpu(), None if h0 is None else h0.cpu(), ref_starts, ref_ht, first_t.cpu(),
                state_v_first=state_v_first)  # fmt: skip
    assert not starts.isnan().any()
    assert_close("starts", ref_starts.float(), starts.cpu(), 1e-5)
    if with_ht:
        assert not ht.isnan().any()
        assert_close("final states", ref_ht.float(), ht.cpu(), 1e-5)
