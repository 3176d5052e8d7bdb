"""Lightning's time-split combine, the scan kernel (cula/ops/lightning/sm90/segment_chain.py).

CPU: every variant traces and compiles for sm_90a with 16-byte accesses and no local memory; the host function
refuses bad tables before any launch. GPU: every start against a float64 scan (``time_parallel._scan_starts``),
starts poisoned first, over packs with empty, one-token and uncut sequences, strong decays and none.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from cula.lightning import time_parallel as tp
from cula.ops.lightning.sm90 import segment_chain
from cula.testing import poison_, rel_rmse

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("head_dim,has_h0", list(itertools.product((64, 128), (False, True))))
def test_compiles_for_sm90(head_dim, has_h0):
    fn = segment_chain.compiled_variant(head_dim, has_h0)
    assert fn is not None and segment_chain.compiled_variant(head_dim, has_h0) is fn


def test_ptx_moves_16_bytes_an_access():
    from cutlass import cute

    from cula.cache import compile_options
    from cula.ops.lightning.sm90 import segment_chain_kernel as k

    kernel = k.LightningSegmentChainSm90(128, True)
    args = k._fake_args(128, True)
    ptx = cute.compile(kernel, *args, options=compile_options((9, 0), "--keep-ptx")).__ptx__
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx and ".local" not in ptx


def _tables(lens, segment_len):
    plan = tp.split_plan(tuple(lens), segment_len)
    return plan, tuple(plan.bounds), (*plan.first_segment, plan.num_segments)


def test_host_refuses_bad_tables():
    E = torch.zeros(3, 2, 64, 64)
    ok = dict(ends=E, initial_state=None, starts=torch.zeros_like(E), bounds=torch.zeros(4, dtype=torch.int32),
              first_segment=torch.tensor([0, 3], dtype=torch.int32), decay=torch.zeros(2))  # fmt: skip
    bad = [
        ("ends", torch.zeros(3, 2, 64, 64, dtype=torch.float64), "ends"),
        ("starts", torch.zeros(3, 2, 64, 64).transpose(-1, -2), "starts"),
        ("initial_state", torch.zeros(2, 2, 64, 64), "initial_state"),
        ("bounds", torch.zeros(3, dtype=torch.int32), "bounds"),
        ("first_segment", torch.tensor([0, 3], dtype=torch.int64), "first_segment"),
        ("decay", torch.zeros(3), "decay"),
        ("ends", torch.zeros(3, 2, 32, 32), "ends"),
    ]
    for name, value, word in bad:
        with pytest.raises(ValueError, match=word):
            segment_chain.lightning_segment_chain_sm90(**dict(ok, **{name: value}))
    with pytest.raises(ValueError, match="head dimension"):
        E = torch.zeros(3, 2, 32, 32)
        segment_chain.lightning_segment_chain_sm90(**dict(ok, ends=E, starts=torch.zeros_like(E)))


CASES = [  # (lengths, segment length, heads, head dim, initial states, decay scale)
    ((16384,), 2048, 4, 128, False, 0.01),
    ((3000, 0, 1, 70, 9000), 1024, 3, 64, True, 0.5),
    ((5000, 64, 20000), 1024, 8, 128, True, 1e-4),
    ((131072,), 4096, 2, 128, True, 0.0),
    ((4096, 4096), 64, 1, 64, True, 30.0),  # 64 segments a sequence; a decay that underflows every factor
]


@gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{len(c[0])}-seg{c[1]}-HV{c[2]}-D{c[3]}-h0{c[4]:d}-{c[5]}")
def test_scan_matches_float64(case):
    lens, seg, HV, D, with_h0, scale = case
    plan, bounds, first = _tables(lens, seg)
    M, N, dev = plan.num_segments, len(lens), "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    E = torch.randn(M, HV, D, D, device=dev, generator=gen)
    h0 = torch.randn(N, HV, D, D, device=dev, generator=gen) if with_h0 else None
    decay = torch.rand(HV, device=dev, generator=gen) * scale
    starts = poison_(torch.empty_like(E))
    segment_chain.lightning_segment_chain_sm90(
        E, h0, starts, torch.tensor(bounds, dtype=torch.int32, device=dev),
        torch.tensor(first, dtype=torch.int32, device=dev), decay,
    )  # fmt: skip
    want = tp._scan_starts(E.double(), None if h0 is None else h0.double(), decay.double(), bounds, first)
    assert not starts.isnan().any()
    assert rel_rmse(want, starts) < 1e-6
