"""The tests' NaN poisoning (the ``poisoned`` fixture of tests/conftest.py) catches an output element that no kernel
wrote, whatever the allocation's size.

CPU: under the fixture every kind of uninitialised allocation starts as NaN (integers: their largest value), and
``assert_close`` fails on a single element left unwritten; a state pool updated in place (which cannot be poisoned)
fails ``assert_rows_rewritten`` on one element of an owned row left at its old value. GPU: the same for CUDA
allocations on both sides of the caching allocator's 1 MiB small-block pool (which the old 1 GiB NaN block never
reached), and a deliberately short launch of one of our kernels, one token short of its output, fails the comparison
with the float64 reference.
"""

from __future__ import annotations

import pytest
import torch

from cula.testing import assert_close, assert_rows_rewritten, make_cu_seqlens


def _allocations(device):
    """One tensor from each way of allocating without initialising, as kernels' wrappers do."""
    dense = torch.zeros(8, 3, device=device, dtype=torch.bfloat16)
    return {
        "empty": torch.empty(3, 5, device=device),
        "empty_like": torch.empty_like(dense),
        "new_empty": dense.new_empty(4, 2, dtype=torch.float16),
        "empty_strided": torch.empty_strided((4, 3), (1, 4), device=device),
        # chunk_fwd carves four intermediates out of one allocation this way
        "unbind": torch.empty(4, 6, 2, device=device, dtype=torch.bfloat16).unbind(0)[3],
        "resize_": torch.zeros(2, device=device).resize_(9)[2:],
        "float64": torch.empty(7, device=device, dtype=torch.float64),
    }


def test_uninitialised_allocations_start_as_nan(poisoned):
    for name, t in _allocations("cpu").items():
        assert torch.isnan(t).all(), name
    assert (torch.empty(5, dtype=torch.int32) == torch.iinfo(torch.int32).max).all()


def test_poison_fills_as_fresh_allocations_start(poisoned):
    """poison_ (for buffers reused across calls) fills every dtype as the fixture fills fresh memory."""
    from cula.testing import poison_

    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        fresh, reused = torch.empty(3, dtype=dtype), poison_(torch.zeros(3, dtype=dtype))
        assert torch.equal(fresh, reused) or (torch.isnan(fresh).all() and torch.isnan(reused).all()), dtype


def test_one_unwritten_element_fails_the_comparison(poisoned):
    ref = torch.randn(4, 3, 64, dtype=torch.float64)
    out = torch.empty(4, 3, 64, dtype=torch.bfloat16)
    out.view(-1)[:-1] = ref.view(-1)[:-1]  # every element but the last one
    with pytest.raises(AssertionError, match=r"1 non-finite elements \(NaN/Inf\) of 768"):
        assert_close("o", ref, out, 5e-3)
    out.view(-1)[-1] = ref.view(-1)[-1]
    assert_close("o", ref, out, 5e-3)


def test_a_pool_row_element_left_unwritten_fails():
    """``assert_rows_rewritten``: an in-place pool update whose rows all move passes; one element of an updated row
    left at its old value fails, so does a NaN, while the rows no sequence owns are not its business."""
    before = torch.randn(5, 2, 8, 8)
    rows = torch.tensor([3, 0], dtype=torch.int32)
    after = before.clone()
    after[rows.long()] = 0.9 * before[rows.long()] + 0.1 * torch.randn(2, 2, 8, 8)
    ref = after[rows.long()].double()
    assert_rows_rewritten("pool", after, before, rows)
    assert_rows_rewritten("pool", after, before, rows, ref=ref)
    stale = after.clone()
    stale[0, 1, 2, 5] = before[0, 1, 2, 5]
    with pytest.raises(AssertionError, match=r"1 of 256 elements .* kept their old value .* first at \(0, 1, 2, 5\)"):
        assert_rows_rewritten("pool", stale, before, rows)
    with pytest.raises(AssertionError, match="1 of 256 elements"):
        assert_rows_rewritten("pool", stale, before, rows, ref=ref)
    nan = after.clone()
    nan[3, 0, 7, 7] = float("nan")
    with pytest.raises(AssertionError, match=r"1 non-finite elements \(NaN/Inf\) of 256"):
        assert_rows_rewritten("pool", nan, before, rows, ref=ref)
    # an element whose reference moves it by less than rtol x RMS may round back to its old value
    ref[1, 1, 2, 5] = before[0, 1, 2, 5] + 1e-9
    assert_rows_rewritten("pool", stale, before, rows, ref=ref)
    with pytest.raises(ValueError, match="non-negative"):
        assert_rows_rewritten("pool", after, before, torch.tensor([3, -1]))
    assert_rows_rewritten("pool", after, before, rows, others_untouched=True)
    moved = after.clone()
    moved[4, 0, 0, 0] += 1.0
    with pytest.raises(AssertionError, match="a row no sequence owns changed"):
        assert_rows_rewritten("pool", moved, before, rows, others_untouched=True)


def test_cpu_tests_are_not_poisoned():
    # Only GPU tests (and tests asking for ``poisoned``) run in deterministic mode: the CPU suite keeps torch's
    # defaults, so it behaves as it does for users.
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.gpu
def test_gpu_tests_are_poisoned_at_every_size():
    assert torch.are_deterministic_algorithms_enabled()
    for name, t in _allocations("cuda").items():
        assert torch.isnan(t).all(), name
    # around the caching allocator's 1 MiB boundary between its small and large pools, and well above it
    for nbytes in (2, 512, 2**20 - 2, 2**20 + 2, 64 * 2**20):
        t = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        assert torch.isnan(t).all(), nbytes
        del t  # the next allocation may reuse this block: it must be poisoned again
    assert (torch.empty(3, device="cuda", dtype=torch.int64) == torch.iinfo(torch.int64).max).all()


@pytest.mark.gpu
def test_short_launch_is_caught():
    """Lightning prefill told its last sequence is one token shorter than its output: the token it skips is all
    NaN and fails ``assert_close`` against the float64 reference, while everything it wrote passes."""
    from cula.ops.lightning.sm90.chunk_fwd import lightning_fwd_sm90
    from cula.simple_gla.naive import naive_recurrent_simple_gla

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU (H100/H200)")
    lens, D = [5, 130, 64], 64
    T = sum(lens)
    q, k, v = (torch.randn(1, T, 1, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    decay = torch.tensor([0.1], device="cuda")
    o = torch.empty(1, T, 1, D, device="cuda", dtype=torch.bfloat16)  # no explicit poison: the harness's NaN
    short = make_cu_seqlens([5, 130, 63], device="cuda")
    lightning_fwd_sm90(q, k, v, decay, o, None, None, short, scale=D**-0.5, state_v_first=False)
    torch.cuda.synchronize()
    ref, _ = naive_recurrent_simple_gla(q.double(), k.double(), v.double(), g_gamma=-decay.double(),
                                        scale=D**-0.5, cu_seqlens=make_cu_seqlens(lens, device="cuda"))  # fmt: skip
    with pytest.raises(AssertionError, match=rf"\b{D} non-finite elements"):
        assert_close("o", ref, o, 5e-3)
    assert torch.isnan(o[:, -1]).all()
    assert_close("o without its last token", ref[:, :-1], o[:, :-1], 5e-3)
