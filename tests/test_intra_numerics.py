"""The score factoring of cula's intra kernel (``ChunkKDAIntraFwdSm90``) and its ``any_gate`` variant, modelled in
fp32 on the CPU: which gates each path is exact for, and that the variant's steepness check sends a tile to the
exact path exactly where the anchored factors would reach the clamp.

Per chunk of 64 rows with the log2 gate cumsum ``gc`` and 16-row sub-chunks i, the kernel makes the scores
``A[t, s] = sum_c x_tc k_sc exp2(gc_tc - gc_sc)`` (s <= t) as products of factored operands: anchored at a row p of
the output sub-chunk, ``(x_t exp2(gc_t - gc_p)) . (k_s exp2(gc_p - gc_s))``, every exponent clamped at 100 and
every fp32 value below 2^-126 flushed to zero (``ex2.approx.ftz``). The plain kernel anchors at the sub-chunk's
middle row; the any_gate variant's exact path at its first row for the blocks before it and element by element on
the diagonal block. The GPU tests check the kernels' indexing; this checks the arithmetic they implement.
"""

from __future__ import annotations

import torch

CLAMP = 100.0  # the kernels' _ANCHOR_CLAMP
SPAN = 96.0  # the any_gate check's _ANCHOR_SPAN
TINY = 2.0**-126


def _ftz(x: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(x.abs() < TINY, 0.0)


def _exp2(x: torch.Tensor) -> torch.Tensor:
    """``ex2.approx.ftz`` of a clamped exponent, in fp32."""
    return _ftz(torch.exp2(torch.clamp(x, max=CLAMP).float()))


def _scores_f64(x, k, gc):
    d = gc[:, None, :].double() - gc[None, :, :].double()  # [t, s, c]
    e = torch.exp2(d.masked_fill(~torch.ones(64, 64, dtype=torch.bool).tril()[..., None], float("-inf")))
    return torch.einsum("tc,sc,tsc->ts", x.double(), k.double(), e)


def _scores_anchored(x, k, gc, first_row: bool):
    """The kernel's products, all 16 x 16 blocks (j <= i) anchored at row 16 i (+ 8 unless ``first_row``)."""
    out = torch.zeros(64, 64)
    for i in range(4):
        p = 16 * i + (0 if first_row else 8)
        rows = slice(16 * i, 16 * i + 16)
        xq = _ftz(x[rows] * _exp2(gc[rows] - gc[p]))
        for j in range(i + 1):
            cols = slice(16 * j, 16 * j + 16)
            kk = _ftz(k[cols] * _exp2(gc[p] - gc[cols]))
            out[rows, cols] = xq @ kk.T
    return out.tril()


def _scores_exact_path(x, k, gc):
    """The any_gate variant's exact path: first-row anchors before the diagonal, the diagonal element by element."""
    out = _scores_anchored(x, k, gc, first_row=True)
    for i in range(4):
        for t in range(16 * i, 16 * i + 16):
            for s in range(16 * i, t + 1):
                out[t, s] = (x[t] * k[s] * _exp2(gc[t] - gc[s])).sum()
    return out


def _steep(gc) -> bool:
    """The any_gate check: some g_cum of a sub-chunk differs from its middle row's by more than SPAN."""
    return any(
        (gc[16 * i : 16 * i + 16] - gc[16 * i + 8]).abs().max() > SPAN for i in range(4)
    )  # fmt: skip


def _chunk(step_nats: torch.Tensor, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.normalize(torch.randn(64, 128, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(64, 128, generator=gen), dim=-1)
    gc = (step_nats / torch.log(torch.tensor(2.0))).cumsum(0).float()
    return x, k, gc


def _rel(ref, x):
    return ((ref - x.double()).norm() / ref.norm()).item()


def test_anchored_path_is_exact_within_the_bound():
    """Gates within the bound (-5 nats a step, FLA's safe range; and -8 near the kernel's -8.6 limit): the middle
    anchor's products match float64, and the check leaves the tile on that path."""
    for seed, lo in enumerate((-5.0, -8.0)):
        gen = torch.Generator().manual_seed(100 + seed)
        x, k, gc = _chunk(lo * torch.rand(64, 128, generator=gen), seed)
        assert not _steep(gc)
        assert _rel(_scores_f64(x, k, gc), _scores_anchored(x, k, gc, first_row=False)) < 1e-5


def test_steep_gates_need_the_exact_path():
    """Steps of -80 nats on a few channels: the middle anchor's factors reach the clamp (or flush) and its scores
    are wrong; the check flags the tile and the exact path matches float64, as first-row anchors alone do not."""
    gen = torch.Generator().manual_seed(7)
    steps = -torch.rand(64, 128, generator=gen)
    steps[torch.rand(64, 128, generator=gen) < 0.03] = -80.0
    x, k, gc = _chunk(steps, 7)
    ref = _scores_f64(x, k, gc)
    assert _steep(gc)
    assert _rel(ref, _scores_anchored(x, k, gc, first_row=False)) > 1e-2
    assert _rel(ref, _scores_anchored(x, k, gc, first_row=True)) > 1e-2  # the diagonal blocks' key factors
    assert _rel(ref, _scores_exact_path(x, k, gc)) < 1e-5


def test_exact_path_holds_for_any_gate():
    """The exact path on gates of every strength, down to -1000 nats a step and up to exactly 0."""
    for seed, scale in enumerate((0.0, 1e-3, 1.0, 30.0, 1000.0)):
        gen = torch.Generator().manual_seed(200 + seed)
        x, k, gc = _chunk(-scale * torch.rand(64, 128, generator=gen), seed)
        assert _rel(_scores_f64(x, k, gc), _scores_exact_path(x, k, gc)) < 1e-5, scale


def test_stage7_exact_path_row_and_column_products():
    """Stage 7's any_gate exact path (``ChunkKDABwdIntraSm90``): the row products ``sum_{s <= t} dA[t, s] k_s E_ts``
    anchored at the output sub-chunk's first row and the column products ``sum_{t >= s} dA[t, s] x_t E_ts`` at its
    last row before the diagonal block, the diagonal block element by element and folded in with the factor: both
    match float64 on steep gates."""
    gen = torch.Generator().manual_seed(9)
    steps = -torch.rand(64, 128, generator=gen)
    steps[torch.rand(64, 128, generator=gen) < 0.03] = -80.0
    x, k, gc = _chunk(steps, 9)
    dA = torch.randn(64, 64, generator=gen).tril()
    d = gc[:, None, :].double() - gc[None, :, :].double()
    e = torch.exp2(d.masked_fill(~torch.ones(64, 64, dtype=torch.bool).tril()[..., None], float("-inf")))
    row_ref = torch.einsum("ts,sc,tsc->tc", dA.double(), k.double(), e)
    col_ref = torch.einsum("ts,tc,tsc->sc", dA.double(), x.double(), e)
    row, col = torch.zeros(64, 128), torch.zeros(64, 128)
    for i in range(4):
        blk = slice(16 * i, 16 * i + 16)
        a = 16 * i  # rows: the first row
        acc = torch.zeros(16, 128)
        for j in range(i):
            cols = slice(16 * j, 16 * j + 16)
            acc += dA[blk, cols] @ _ftz(k[cols] * _exp2(gc[a] - gc[cols]))
        acc = acc * _exp2(gc[blk] - gc[a])
        for t in range(16):
            for s in range(t + 1):
                acc[t] += dA[16 * i + t, 16 * i + s] * k[16 * i + s] * _exp2(gc[16 * i + t] - gc[16 * i + s])
        row[blk] = acc
        a = 16 * i + 15  # columns: the last row
        acc = torch.zeros(16, 128)
        for j in range(i + 1, 4):
            rows = slice(16 * j, 16 * j + 16)
            acc += dA[rows, blk].T @ _ftz(x[rows] * _exp2(gc[rows] - gc[a]))
        acc = acc * _exp2(gc[a] - gc[blk])
        for s in range(16):
            for t in range(s, 16):
                acc[s] += dA[16 * i + t, 16 * i + s] * x[16 * i + t] * _exp2(gc[16 * i + t] - gc[16 * i + s])
        col[blk] = acc
    assert _rel(row_ref, row) < 1e-5 and _rel(col_ref, col) < 1e-5
