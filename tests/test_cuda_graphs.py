"""Every call form in a CUDA graph, replayed on new input values.

Each GPU test warms the call up on a side stream (PyTorch's recipe), captures it with ``torch.cuda.graph``, then,
for a few new draws of the inputs copied into the captured (static) tensors, poisons the graph's outputs, replays
and compares the replay bit for bit with an eager call on the same values; in-place state pools are reset to the
same start before both. Packed ``chunk_kda`` / Lightning calls also change their boundaries between replays (same
sequence count and total length): the graph makes the chunk indices on the device from ``cu_seqlens``, for a
fixed number of rows bounded by the shapes (``cula.kda.forward.device_chunk_indices``), while the eager call builds the
exact ones on the host.

Warm-up: a call's first run in a process compiles and loads its kernels (and FLA's Triton autotuner times its
configurations), which capture does not allow; PyTorch asks for warm-up calls before capture anyway. What may
happen first inside a capture is the first call of a signature whose kernels are loaded: the plan (validation,
backend choice, bound launch) is made there (``test_first_call_of_a_signature_inside_capture``).

On the CPU: ``device_chunk_indices`` against FLA's and cula's host-side chunk indices, and the wiring that hands it
to the kernels while a capture is under way (kernels stubbed).
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from cula.kda import chunk_kda
from cula.testing import make_cu_seqlens, poison_

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda"
D = 128
gpu = pytest.mark.gpu


# ---------------------------------------------------------------------------------------------------------------
# device_chunk_indices on the CPU


def _host_rows(lens, chunk_size=64):
    """(sequence, chunk) rows in FLA's order, written out in Python."""
    return [[n, c] for n, length in enumerate(lens) for c in range(-(-length // chunk_size))]


LENS = [[1], [64], [65], [5, 0, 9], [37, 0, 130, 64, 1], [0, 0, 0, 65], [0, 3, 0], [64, 64, 128], [200, 0],
        [1, 1, 1, 1, 228], [0, 0, 232, 0, 0]]  # fmt: skip


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("lens", LENS, ids=lambda x: "-".join(map(str, x)))
def test_device_chunk_indices_match_the_host_ones(lens, cu_dtype):
    """The first rows are FLA's ``prepare_chunk_indices`` and cula's ``prepare_chunk_indices_i32``; the padding
    rows up to the shapes' bound name the last sequence at chunks past its end."""
    from fla.ops.utils.index import prepare_chunk_indices

    from cula.kda.forward import chunk_rows_bound, device_chunk_indices
    from cula.ops.kda.sm90.intra import prepare_chunk_indices_i32

    cu = make_cu_seqlens(lens, dtype=cu_dtype)
    exact = _host_rows(lens)
    bound = chunk_rows_bound(sum(lens), len(lens))
    assert len(exact) <= bound
    rows = device_chunk_indices(cu, bound)
    assert rows.dtype == torch.int32 and rows.shape == (bound, 2) and rows.is_contiguous()
    assert rows[: len(exact)].tolist() == exact
    assert prepare_chunk_indices(cu, 64).tolist() == exact
    assert prepare_chunk_indices_i32(cu, 64, cu.clone()).tolist() == exact
    last = len(lens) - 1
    for n, c in rows[len(exact) :].tolist():
        assert n == last and c * 64 >= lens[last]
    assert device_chunk_indices(cu, len(exact)).tolist() == exact  # sized to the exact count: no padding


def test_int64_boundaries_as_int32_are_remembered_by_value():
    """int64 boundaries reach the kernels as an int32 copy made once per boundary list (no cast kernel a call),
    int32 ones as themselves; a buffer rewritten in place gets the new values."""
    from cula.kda.forward import host_boundaries

    cu = make_cu_seqlens([70, 0, 130], dtype=torch.int64)
    first, rows = host_boundaries(cu, cu)
    assert first.dtype == torch.int32 and first.tolist() == [0, 70, 70, 200]
    assert rows.tolist() == _host_rows([70, 0, 130])
    assert host_boundaries(cu.clone(), None)[0] is first
    cu32 = cu.to(torch.int32)
    assert host_boundaries(cu32, cu32)[0] is cu32 and host_boundaries(cu32, cu32)[1] is rows
    other = make_cu_seqlens([3, 4])  # int32 first, then the same values as int64: the copy is made then
    assert host_boundaries(other, other)[0] is other
    wide = other.long()
    assert host_boundaries(wide, wide)[0].dtype == torch.int32 and host_boundaries(wide, wide)[0].tolist() == [0, 3, 7]
    cu[1:] = torch.tensor([5, 200, 200])
    assert host_boundaries(cu, cu)[0].tolist() == [0, 5, 200, 200]


def test_boundaries_made_in_inference_mode_serve_training_calls():
    """A batch's first call under torch.inference_mode builds the remembered int32 boundaries and chunk rows; a later
    training call of the same batch gets those tensors, so they are made as normal tensors (an inference tensor
    could not be saved for a backward)."""
    from cula.kda.forward import host_boundaries

    cu = make_cu_seqlens([33, 0, 91, 7], dtype=torch.int64)
    with torch.inference_mode():
        made = host_boundaries(cu, cu)
    assert not any(t.is_inference() for t in made)
    assert all(a is b for a, b in zip(host_boundaries(cu, cu), made))


def test_host_chunk_indices_are_remembered_by_value():
    """A packed batch's chunk indices are built once for its boundaries (every layer and the backward reuse them),
    and a boundary buffer rewritten in place gets the new boundaries' rows, never the remembered ones."""
    from cula.kda.forward import CHUNK_INDICES_KEPT
    from cula.kda.forward import host_chunk_indices as rows_of

    host = make_cu_seqlens([70, 0, 130])
    first = rows_of(host, host)
    assert first.tolist() == _host_rows([70, 0, 130])
    assert rows_of(host.clone(), host.clone()) is first  # same values, other tensors
    assert rows_of(host, None) is first  # the boundaries read from cu_seqlens itself
    assert rows_of(host, host, 32).tolist() == _host_rows([70, 0, 130], 32)
    host[1:] = torch.tensor([5, 200, 200], dtype=host.dtype)  # rewritten in place: the same tensor, new values
    assert rows_of(host, host).tolist() == _host_rows([5, 195, 0])
    for n in range(1, CHUNK_INDICES_KEPT + 2):  # bounded: the oldest boundaries are forgotten
        rows_of(make_cu_seqlens([n]), None)
    assert rows_of(make_cu_seqlens([70, 0, 130]), None) is not first


def test_chunk_rows_bound_holds_and_is_reached():
    from cula.kda.forward import chunk_rows_bound, device_chunk_indices

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        chunk = rng.choice((32, 64))
        lens = [rng.choice((0, 1, chunk - 1, chunk, chunk + 1, rng.randint(0, 5 * chunk))) for _ in range(n)]
        exact = _host_rows(lens, chunk)
        bound = chunk_rows_bound(sum(lens), n, chunk)
        assert len(exact) <= bound
        rows = device_chunk_indices(make_cu_seqlens(lens, dtype=torch.int64), bound, chunk)
        assert rows[: len(exact)].tolist() == exact
        assert all(r == [n - 1, r[1]] and r[1] * chunk >= lens[-1] for r in rows[len(exact) :].tolist())
    for lens in ([1, 65, 129], [1], [64 * 3 + 1, 1]):  # every sequence one token into its last chunk
        assert len(_host_rows(lens)) == chunk_rows_bound(sum(lens), len(lens))


@pytest.fixture
def stubbed_kernels(monkeypatch, pretend_sm90):
    """CPU tensors through the cula-sm90 chunk_kda path, each launch recording its chunk indices instead of running
    (the bound launch's one host call, fwd_launch, and the general path's intra kernel)."""
    import cula.kda.chunk as chunk_mod
    from cula.backends import PlanCache
    from cula.ops.kda.sm90 import delta_h_fwd_o, fwd_launch, intra, segment_chain

    seen = []
    monkeypatch.setattr(chunk_mod, "_plans", PlanCache())
    monkeypatch.delenv("CULA_KDA_INTRA", raising=False)
    monkeypatch.setattr(intra, "compiled_variant", lambda **kw: lambda *a: seen.append(("general", a[16])))
    monkeypatch.setattr(delta_h_fwd_o, "compiled_variant", lambda **kw: lambda *a: None)
    monkeypatch.setattr(segment_chain, "compiled_variant", lambda **kw: lambda *a: None)
    monkeypatch.setattr(
        fwd_launch, "compiled_variant", lambda io, so, varlen=False: lambda *a: seen.append(("plan", a[12]))
    )
    return seen


def test_fixed_calls_key_on_shapes_where_the_launch_checks_the_rest(stubbed_kernels, monkeypatch):
    """A repeated fixed-length call of the one-call launch reads only its short key (shapes, the variant's dtypes,
    flags); a call that launch's compiled entry refuses is validated in full (cula's error, nothing launched)."""
    import cula.kda.chunk as chunk_mod
    from cula.ops.kda.sm90 import fwd_launch

    sigs = []
    real_sigs = chunk_mod.token_sigs
    monkeypatch.setattr(chunk_mod, "token_sigs", lambda *a: sigs.append(1) or real_sigs(*a))
    monkeypatch.setattr(chunk_mod, "_short_plans", chunk_mod.PlanCache())
    x = _kda_inputs(1, 128, 2, 4, 1, torch.Generator().manual_seed(0), device="cpu")

    def entry(io, so, varlen=False):  # a stand-in for the TVM-FFI entry's checks: k must be bf16 and dense
        def launch(*a):
            if a[1].dtype != torch.bfloat16 or not a[1].is_contiguous():
                raise TypeError("Mismatched k")
            stubbed_kernels.append(("plan", a[12]))

        return launch

    monkeypatch.setattr(fwd_launch, "compiled_variant", entry)
    with torch.no_grad():
        for _ in range(3):
            chunk_kda(**x, **SAFE_GATE)
        assert len(sigs) == 1 and len(stubbed_kernels) == 3
        stubbed_kernels.clear()
        with pytest.raises(TypeError, match="`k` must have dtype"):
            chunk_kda(**dict(x, k=x["k"].half()), **SAFE_GATE)
        assert not stubbed_kernels
        chunk_kda(**x, **SAFE_GATE)
        assert len(stubbed_kernels) == 1


def test_packed_plan_cuts_only_long_packs(stubbed_kernels, monkeypatch, kda_tuning):
    """A packed signature keeps its one-call launch while the time split (``KdaTuning.time_split``) would not cut
    the call's lengths, and takes the cut general path, the segment summary first, for a call it would cut; a
    fixed-length signature that is cut plans the cut path."""
    from cula.ops.kda.sm90 import segment_summary
    from cula.time_split import SplitThresholds

    summaries = []
    monkeypatch.setattr(segment_summary, "compiled_variant", lambda **kw: lambda *a: summaries.append(a[-1]))
    kda_tuning(time_split=SplitThresholds(items_per_sm=1.0, busy_items_per_sm=1.0, min_segment=64, min_seq_len=256))
    for lens, cut in (([100, 10], False), ([300, 10], True), ([120, 30], False)):
        x = _kda_inputs(1, sum(lens), 2, 4, len(lens), torch.Generator().manual_seed(0), device="cpu")
        cu = make_cu_seqlens(lens)
        stubbed_kernels.clear()
        summaries.clear()
        with torch.no_grad():
            chunk_kda(**x, **SAFE_GATE, cu_seqlens=cu, cu_seqlens_cpu=cu.clone())
        assert [path for path, _ in stubbed_kernels] == ["general" if cut else "plan"], lens
        assert summaries == ([6] if cut else []), lens  # 300 tokens in 5 segments of up to 64, the short one whole
    # a fixed-length signature that is cut: its plan is the cut general path, the first call and the next alike
    x = _kda_inputs(1, 300, 2, 4, 1, torch.Generator().manual_seed(1), device="cpu")
    stubbed_kernels.clear()
    summaries.clear()
    with torch.no_grad():
        for _ in range(2):
            chunk_kda(**x, **SAFE_GATE)
    assert [path for path, _ in stubbed_kernels] == ["general", "general"] and summaries == [5, 5]


def test_a_captured_long_pack_is_cut_on_segment_tables_made_on_the_device(stubbed_kernels, monkeypatch, kda_tuning):
    """While capturing (simulated), a packed call with ``cu_seqlens_cpu`` that the time split cuts still runs cut:
    its segment tables are made on the device from ``cu_seqlens`` by the capture's rule, as many segments as any
    boundaries of its shapes need (``cula.time_split.replay_segments``), never copied from the host, so a replay on
    new boundaries is cut right."""
    import cula.kda.forward as cf
    import cula.time_split as ts
    from cula.ops.kda.sm90 import segment_summary
    from cula.time_split import SplitThresholds

    bounds = []
    monkeypatch.setattr(segment_summary, "compiled_variant", lambda **kw: lambda *a: bounds.append(a[-2].tolist()))
    kda_tuning(time_split=SplitThresholds(items_per_sm=1.0, busy_items_per_sm=1.0, min_segment=64, min_seq_len=256))
    lens = [300, 10]
    x = _kda_inputs(1, sum(lens), 2, 4, len(lens), torch.Generator().manual_seed(0), device="cpu")
    cu = make_cu_seqlens(lens)
    with torch.no_grad():
        chunk_kda(**x, **SAFE_GATE, cu_seqlens=cu, cu_seqlens_cpu=cu.clone())  # eager: the host's tables
        for mod in (cf, ts):
            monkeypatch.setattr(mod, "capturing", lambda t: True)
        monkeypatch.setattr(ts, "on_device", lambda *a: pytest.fail("host-built segment tables"))
        chunk_kda(**x, **SAFE_GATE, cu_seqlens=cu, cu_seqlens_cpu=cu.clone())
    assert [path for path, _ in stubbed_kernels] == ["general", "general"]
    eager, captured = bounds
    assert eager == [0, 64, 128, 192, 256, 300, 310]
    # ceil(310 / 64) + 2 = 7 segments: the spare one empty, at the end
    assert captured == [0, 64, 128, 192, 256, 300, 310, 310]


@pytest.mark.parametrize("host_copy", [True, False], ids=["cu_seqlens_cpu", "device_only"])
def test_capture_takes_the_device_chunk_indices(stubbed_kernels, monkeypatch, host_copy):
    """While capturing (simulated), the plan (with ``cu_seqlens_cpu``) and the general path (without) make their chunk
    indices on the device, with the shapes' bound of rows, and never build them on the host."""
    import cula.kda.forward as cf
    from cula.ops.kda.sm90 import intra

    lens = [37, 0, 130, 64, 1]
    x = _kda_inputs(1, sum(lens), 2, 4, len(lens), torch.Generator().manual_seed(0), device="cpu")
    cu = make_cu_seqlens(lens)
    cus = dict(cu_seqlens=cu, cu_seqlens_cpu=cu.clone() if host_copy else None)
    with torch.no_grad():
        chunk_kda(**x, **SAFE_GATE, **cus)  # outside capture: the host-built rows
        monkeypatch.setattr(cf, "capturing", lambda t: True)
        monkeypatch.setattr(
            intra, "prepare_chunk_indices_i32", lambda *a: pytest.fail("host-built chunk indices")
        )
        chunk_kda(**x, **SAFE_GATE, **cus)
    (path0, eager), (path1, captured) = stubbed_kernels
    assert path0 == path1 == ("plan" if host_copy else "general")
    assert eager.tolist() == _host_rows(lens)
    assert captured.dtype == torch.int32 and captured.shape == (cf.chunk_rows_bound(sum(lens), len(lens)), 2)
    assert captured[: len(eager)].tolist() == eager.tolist()


# ---------------------------------------------------------------------------------------------------------------
# GPU: capture and replay


def _kda_inputs(B, T, H, HV, N, gen, device=DEV) -> dict:
    """chunk_kda's tensors: bf16 q / k / v / beta logits, fp32 gate logits, an fp32 initial state of N rows."""

    def rnd(*shape, dtype=torch.bfloat16, s=1.0):
        return (s * torch.randn(*shape, generator=gen, device=device)).to(dtype)

    return {
        "q": rnd(B, T, H, D), "k": rnd(B, T, H, D), "v": rnd(B, T, HV, D), "g": rnd(B, T, HV, D, dtype=torch.float32),
        "beta": rnd(B, T, HV), "initial_state": rnd(N, HV, D, D, dtype=torch.float32, s=0.1),
        "A_log": rnd(HV, dtype=torch.float32, s=0.5), "dt_bias": rnd(HV * D, dtype=torch.float32, s=0.5),
    }  # fmt: skip


# cula's intra kernel (safe gate, the lower-bound sigmoid gate); the softplus gate without safe_gate (no bound
# known) on its any_gate variant (KdaTuning.intra_any_gate), or on FLA's intra stages (CULA_KDA_INTRA=0, see
# _intra_mode); cula's state/output kernel in every case
SAFE_GATE = {"output_final_state": True, "use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True,
             "use_beta_sigmoid_in_kernel": True, "safe_gate": True, "lower_bound": -5.0}  # fmt: skip
UNBOUNDED = dict(SAFE_GATE, safe_gate=False, lower_bound=None)
GATES = {"cula_intra": SAFE_GATE, "any_gate": UNBOUNDED, "fla_intra": UNBOUNDED}


def _intra_mode(monkeypatch, gate: str) -> None:
    """The "fla_intra" cases send the call to FLA's intra stages (read per call, part of the plan key)."""
    if gate == "fla_intra":
        monkeypatch.setenv("CULA_KDA_INTRA", "0")


def _redraw(statics: dict, names, gen) -> dict:
    """New random values for the named static tensors (same shapes and dtypes)."""
    out = {}
    for name in names:
        t = statics[name]
        scale = 0.1 if name in ("initial_state", "state_pool") else 1.0
        out[name] = (scale * torch.randn(t.shape, generator=gen, device=t.device)).to(t.dtype)
    return out


def _tensors(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor)]


def _same_bits(name: str, ref: torch.Tensor, out: torch.Tensor) -> None:
    assert (out.shape, out.dtype) == (ref.shape, ref.dtype), name
    if out.is_floating_point():
        assert torch.isfinite(out).all(), f"{name}: non-finite elements (unwritten, poisoned)"
    assert torch.equal(ref.contiguous().view(torch.uint8), out.contiguous().view(torch.uint8)), (
        f"{name}: bits differ"
    )


def _capture(fn, warmup: int):
    """``fn()`` captured in a CUDA graph after ``warmup`` calls on a side stream: ``(graph, fn's outputs)``."""
    if warmup:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _replays_match_eager(
    fn, statics: dict, draws: list, pools=(), warmup: int = 2, graph_and_out=None
) -> None:
    """Capture ``fn`` (which reads ``statics`` and updates ``pools`` in place), then per draw: copy it into the
    statics, poison the graph's outputs, reset the pools, replay; reset the pools, call ``fn`` eagerly; the
    outputs and pools must agree bit for bit."""
    starts = [p.clone() for p in pools]
    with torch.no_grad():
        graph, captured = graph_and_out or _capture(fn, warmup)
        for i, draw in enumerate(draws):
            for name, value in draw.items():
                statics[name].copy_(value)
            for t in _tensors(captured):
                poison_(t)
            for p, s in zip(pools, starts):
                p.copy_(s)
            graph.replay()
            replayed = [t.clone() for t in _tensors(captured)] + [p.clone() for p in pools]
            for p, s in zip(pools, starts):
                p.copy_(s)
            eager = [t.clone() for t in _tensors(fn())] + [p.clone() for p in pools]
            torch.cuda.synchronize()
            assert len(replayed) == len(eager)
            for j, (r, e) in enumerate(zip(replayed, eager)):
                _same_bits(f"draw {i}, tensor {j}", e, r)


TOKENS = ("q", "k", "v", "g", "beta")


@gpu
@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("gate", GATES)
def test_chunk_kda_fixed(monkeypatch, gate, state_v_first):
    _intra_mode(monkeypatch, gate)
    gen = torch.Generator(DEV).manual_seed(1)
    x = _kda_inputs(2, 200, 2, 4, 2, gen)
    flags = dict(GATES[gate], state_v_first=state_v_first)
    draws = [_redraw(x, TOKENS + ("initial_state",), gen) for _ in range(2)]
    _replays_match_eager(lambda: chunk_kda(**x, **flags), x, draws)


PACKED = [37, 0, 130, 64, 1]
# new boundaries of the same count and total: chunk counts 6, 8 (the shapes' bound), 4; empty sequences first,
# in the middle and last
REPACKED = ([64, 1, 0, 100, 67], [1, 1, 1, 1, 228], [0, 0, 232, 0, 0])


def _packed_draws(statics: dict, names, gen, cu_dtype, host_copy: bool) -> list:
    draws = []
    for lens in REPACKED:
        draw = _redraw(statics, names, gen)
        draw["cu_seqlens"] = make_cu_seqlens(lens, device=DEV, dtype=cu_dtype)
        if host_copy:
            draw["cu_seqlens_cpu"] = make_cu_seqlens(lens, dtype=cu_dtype)
        draws.append(draw)
    return draws


@gpu
@pytest.mark.parametrize(
    "gate,host_copy,cu_dtype",
    [("cula_intra", True, torch.int32), ("cula_intra", False, torch.int32), ("cula_intra", False, torch.int64),
     ("cula_intra", True, torch.int64), ("any_gate", True, torch.int32), ("any_gate", False, torch.int64),
     ("fla_intra", True, torch.int32), ("fla_intra", False, torch.int32)],
)  # fmt: skip
def test_chunk_kda_packed(monkeypatch, gate, host_copy, cu_dtype):
    """Packed sequences, an empty one among them, with ``cu_seqlens_cpu`` (the plan's one-call launch with cula's
    intra kernel) or without it (the general path); the any_gate variant, and FLA's intra stages, whose kernels get
    the padding rows."""
    _intra_mode(monkeypatch, gate)
    gen = torch.Generator(DEV).manual_seed(2)
    x = _kda_inputs(1, sum(PACKED), 2, 4, len(PACKED), gen)
    x["cu_seqlens"] = make_cu_seqlens(PACKED, device=DEV, dtype=cu_dtype)
    x["cu_seqlens_cpu"] = make_cu_seqlens(PACKED, dtype=cu_dtype) if host_copy else None
    flags = dict(GATES[gate], state_v_first=True)
    draws = _packed_draws(x, TOKENS + ("initial_state",), gen, cu_dtype, host_copy)
    _replays_match_eager(lambda: chunk_kda(**x, **flags), x, draws)


def _pool_inputs(N, T, H, HV, P, gen) -> dict:
    """Decode tensors: bf16 q / k / v, fp32 gate and beta logits, an fp32 pool of P rows, int32 slots with a
    padded one (-1), the gate parameters."""
    x = _kda_inputs(N, T, H, HV, P, gen)
    x["g"], x["beta"] = x["g"].float(), x["beta"].float()
    x["state_pool"] = x.pop("initial_state")
    x["state_indices"] = torch.tensor([5, 0, -1, 2][:N], dtype=torch.int32, device=DEV)
    return x


DECODE_FLAGS = {"lower_bound": -5.0, "check_indices": False}


@gpu
@pytest.mark.parametrize("form", ["rows", "packed"])
def test_fused_recurrent_kda_fwd(form):
    """FLA's serving form with a state pool: ``[N, 1]`` tokens (cula's decode kernel; a padded slot) and the packed
    ``[1, N]`` form with ``cu_seqlens`` (FLA's kernel)."""
    from cula.kda import fused_recurrent_kda_fwd

    gen = torch.Generator(DEV).manual_seed(3)
    N, P = 4, 8
    x = _pool_inputs(N, 1, 2, 4, P, gen)
    pool, idx = x.pop("state_pool"), x.pop("state_indices")
    extra = {}
    if form == "packed":
        for name in TOKENS:
            x[name] = x[name].transpose(0, 1).contiguous()  # [1, N, ...]
        extra["cu_seqlens"] = torch.arange(N + 1, dtype=torch.int32, device=DEV)
        idx = torch.tensor([5, 0, 7, 2], dtype=torch.int32, device=DEV)  # FLA's kernel has no padded slots
    kw = dict(initial_state=pool, ssm_state_indices=idx, inplace_final_state=True, use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, **extra)  # fmt: skip
    draws = [_redraw(x, TOKENS, gen) for _ in range(2)]
    _replays_match_eager(lambda: fused_recurrent_kda_fwd(**x, **kw), x, draws, pools=(pool,))


@gpu
@pytest.mark.parametrize("out", [False, True], ids=["fresh_out", "out"])
@pytest.mark.parametrize("state_v_first", [True, False], ids=["vk", "kv"])
def test_kda_decode(state_v_first, out):
    from cula.kda import kda_decode

    gen = torch.Generator(DEV).manual_seed(4)
    x = _pool_inputs(4, 1, 2, 4, 8, gen)
    pool = x["state_pool"]
    kw = dict(DECODE_FLAGS, state_v_first=state_v_first)
    if out:
        kw["out"] = poison_(torch.empty_like(x["v"]))
    draws = [_redraw(x, TOKENS, gen) for _ in range(2)]
    _replays_match_eager(lambda: kda_decode(**x, **kw), x, draws, pools=(pool,))


@gpu
def test_kda_decode_step():
    from cula.kda import kda_decode_step

    gen = torch.Generator(DEV).manual_seed(5)
    x = _pool_inputs(4, 1, 2, 4, 8, gen)
    pool = x["state_pool"]
    step = kda_decode_step(pool, x["state_indices"], A_log=x["A_log"], dt_bias=x["dt_bias"], **DECODE_FLAGS)
    tokens = {n: x[n] for n in TOKENS}
    draws = [dict(_redraw(x, TOKENS, gen), state_indices=torch.tensor([1, -1, 6, 3], dtype=torch.int32,
                                                                      device=DEV))]  # fmt: skip
    draws.append(_redraw(x, TOKENS, gen))  # the slots rewritten in place, as an engine does
    _replays_match_eager(lambda: step(**tokens), x, draws, pools=(pool,))


@gpu
@pytest.mark.parametrize("state_v_first,T,with_steps", [(True, 4, True), (False, 4, True), (False, 3, False),
                                                        (True, 3, False)])  # fmt: skip
def test_mtp_verify(state_v_first, T, with_steps):
    """Speculative verify: T tokens a sequence, each token's state into ``step_states`` (the pool untouched), or the
    pool updated after the last token."""
    from cula.kda import kda_decode

    gen = torch.Generator(DEV).manual_seed(6)
    x = _pool_inputs(4, T, 2, 4, 8, gen)
    pool = x["state_pool"]
    kw = dict(DECODE_FLAGS, state_v_first=state_v_first)
    pools = (pool,)
    if with_steps:
        # reset like the pool before each run, not poisoned: a padded slot's rows are left as they were by contract
        kw["step_states"] = torch.randn((4, T) + tuple(pool.shape[1:]), device=DEV, generator=gen)
        pools = (pool, kw["step_states"])
    draws = [_redraw(x, TOKENS, gen) for _ in range(2)]
    _replays_match_eager(lambda: kda_decode(**x, **kw), x, draws, pools=pools)


def _lightning_inputs(B, T, H, HV, N, gen) -> dict:
    return {
        "q": torch.randn(B, T, H, D, generator=gen, device=DEV).bfloat16(),
        "k": (torch.randn(B, T, H, D, generator=gen, device=DEV) * D**-0.5).bfloat16(),
        "v": torch.randn(B, T, HV, D, generator=gen, device=DEV).bfloat16(),
        "decay": torch.rand(HV, generator=gen, device=DEV) * 0.5,
        "initial_state": 0.1 * torch.randn(N, HV, D, D, generator=gen, device=DEV),
    }


@gpu
@pytest.mark.parametrize("form", ["fixed", "packed", "packed_host_copy", "chunk_lightning_attn"])
def test_lightning_prefill(form):
    from cula.lightning import chunk_lightning_attn, lightning_attn_fwd

    gen = torch.Generator(DEV).manual_seed(7)
    packed = form.startswith("packed")
    B, T, N = (1, sum(PACKED), len(PACKED)) if packed else (2, 200, 2)
    H, HV = (4, 4) if form == "chunk_lightning_attn" else (2, 4)
    x = _lightning_inputs(B, T, H, HV, N, gen)
    names = ("q", "k", "v", "initial_state")
    if form == "chunk_lightning_attn":
        del x["decay"]

        def fn():
            return chunk_lightning_attn(**x, layer_idx=1, num_layers=4, output_final_state=True)

        draws = [_redraw(x, names, gen) for _ in range(2)]
    else:
        if packed:
            x["cu_seqlens"] = make_cu_seqlens(PACKED, device=DEV)
            x["cu_seqlens_cpu"] = make_cu_seqlens(PACKED) if form == "packed_host_copy" else None
            draws = _packed_draws(x, names, gen, torch.int32, form == "packed_host_copy")
        else:
            draws = [_redraw(x, names, gen) for _ in range(2)]
        for d in draws:
            d["decay"] = torch.rand(HV, generator=gen, device=DEV)

        def fn():
            return lightning_attn_fwd(**x, output_final_state=True, state_v_first=True)

    _replays_match_eager(fn, x, draws)


def _lightning_pool_inputs(N, T, H, HV, P, gen) -> dict:
    x = _lightning_inputs(N, T, H, HV, P, gen)
    x["state_pool"] = x.pop("initial_state")
    x["state_indices"] = torch.tensor([5, 0, -1, 2][:N], dtype=torch.int32, device=DEV)
    return x


@gpu
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("state_v_first", [True, False], ids=["vk", "kv"])
def test_lightning_decode(state_v_first, T):
    from cula.lightning import lightning_decode

    gen = torch.Generator(DEV).manual_seed(8)
    x = _lightning_pool_inputs(4, T, 2, 4, 8, gen)
    draws = [_redraw(x, ("q", "k", "v"), gen) for _ in range(2)]
    kw = dict(state_v_first=state_v_first, check_indices=False)
    _replays_match_eager(lambda: lightning_decode(**x, **kw), x, draws, pools=(x["state_pool"],))


@gpu
def test_lightning_decode_step():
    from cula.lightning import lightning_decode_step

    gen = torch.Generator(DEV).manual_seed(9)
    x = _lightning_pool_inputs(4, 1, 2, 4, 8, gen)
    step = lightning_decode_step(x["decay"], x["state_pool"], x["state_indices"], check_indices=False)
    out = poison_(torch.empty_like(x["v"]))
    draws = [_redraw(x, ("q", "k", "v"), gen) for _ in range(2)]
    draws[1]["state_indices"] = torch.tensor([-1, 7, 6, 3], dtype=torch.int32, device=DEV)
    _replays_match_eager(lambda: step(x["q"], x["k"], x["v"], out=out), x, draws, pools=(x["state_pool"],))


@gpu
@pytest.mark.parametrize("form", ["chunk_kda", "chunk_kda_packed", "kda_decode", "kda_decode_step",
                                  "lightning_decode", "lightning_decode_step"])  # fmt: skip
def test_first_call_of_a_signature_inside_capture(form, monkeypatch):
    """The first call of a signature may happen inside the capture once its kernels are loaded (one call of the
    same variant earlier in the process): no warm-up, the plan made while capturing. chunk_kda's plan binds
    placeholders for the absent gate parameters (A_log and dt_bias None here), which the graph fills, so it is
    not kept: an eager call right after the capture, before any replay, still gets the eager result."""
    import cula.kda.chunk as chunk_mod
    from cula.backends import PlanCache, clear_plan_caches
    from cula.kda import kda_decode, kda_decode_step
    from cula.lightning import lightning_decode, lightning_decode_step
    from cula.ops import _host

    gen = torch.Generator(DEV).manual_seed(10)
    pools = ()
    if form.startswith("chunk_kda"):
        packed = form == "chunk_kda_packed"
        x = (
            _kda_inputs(1, sum(PACKED), 2, 4, len(PACKED), gen)
            if packed
            else _kda_inputs(2, 200, 2, 4, 2, gen)
        )
        x["A_log"] = x["dt_bias"] = None
        if packed:
            x["cu_seqlens"] = make_cu_seqlens(PACKED, device=DEV)
            x["cu_seqlens_cpu"] = make_cu_seqlens(PACKED)
        names = TOKENS + ("initial_state",)
        fn = functools.partial(chunk_kda, **x, **SAFE_GATE)
    elif form.startswith("kda_decode"):
        x = _pool_inputs(4, 1, 2, 4, 8, gen)
        pools, names = (x["state_pool"],), TOKENS
        if form == "kda_decode":
            fn = functools.partial(kda_decode, **x, **DECODE_FLAGS)
        else:
            step = kda_decode_step(x["state_pool"], x["state_indices"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                                   **DECODE_FLAGS)  # fmt: skip
            fn = functools.partial(step, **{n: x[n] for n in TOKENS})
    else:
        x = _lightning_pool_inputs(4, 1, 2, 4, 8, gen)
        pools, names = (x["state_pool"],), ("q", "k", "v")
        if form == "lightning_decode":
            fn = functools.partial(lightning_decode, **x, check_indices=False)
        else:
            step = lightning_decode_step(x["decay"], x["state_pool"], x["state_indices"], check_indices=False)
            fn = functools.partial(step, x["q"], x["k"], x["v"])
    start = [p.clone() for p in pools]
    with torch.no_grad():
        before = [t.clone() for t in _tensors(fn())]  # compiles and loads the kernels, makes the plan
        torch.cuda.synchronize()
        clear_plan_caches()
        monkeypatch.setattr(chunk_mod, "_plans", PlanCache())
        monkeypatch.setattr(_host, "_placeholders", {})
        graph_and_out = _capture(fn, warmup=0)
        if form.startswith("chunk_kda"):
            assert len(chunk_mod._plans) == 0  # made for the capture only
        for p, s in zip(pools, start):
            p.copy_(s)
        after = _tensors(fn())  # eager, before any replay
        torch.cuda.synchronize()
        for j, (b, a) in enumerate(zip(before, after)):
            _same_bits(f"eager call after the capture, tensor {j}", b, a)
    draws = [_redraw(x, names, gen) for _ in range(2)]
    _replays_match_eager(fn, x, draws, pools=pools, graph_and_out=graph_and_out)


# ---------------------------------------------------------------------------------------------------------------
# FLA's graph mode (use_graph / max_num_seqs): packed sequences padded with empty ones to a fixed count


def test_graph_mode_rules():
    """FLA's rules: ``cu_seqlens`` holds exactly ``max_num_seqs`` sequences, no ``disable_recompute``; the
    sequences may end before the last token (checked before any backend runs)."""
    x = _kda_inputs(1, 70, 1, 1, 3, torch.Generator().manual_seed(0), device="cpu")
    cu = make_cu_seqlens([30, 0, 40])
    with pytest.raises(ValueError, match="max_num_seqs"):
        chunk_kda(**x, cu_seqlens=cu, use_graph=True, max_num_seqs=4)
    with pytest.raises(TypeError, match="max_num_seqs"):
        chunk_kda(**x, cu_seqlens=cu, use_graph=True, max_num_seqs=3.0)
    with pytest.raises(ValueError, match="disable_recompute"):
        chunk_kda(**x, cu_seqlens=cu, use_graph=True, disable_recompute=True)
    short = make_cu_seqlens([30, 0, 30])
    with pytest.raises(ValueError, match="end at the total"):
        chunk_kda(**x, cu_seqlens=short)
    # on the CPU the reference runs graph mode: the sequences' rows as without it, the rows past them zero
    o, _ = chunk_kda(**x, cu_seqlens=short, use_graph=True, max_num_seqs=3)
    part = {n: t[:, :60] if n in ("q", "k", "v", "g", "beta") else t for n, t in x.items()}
    assert torch.equal(o[:, :60], chunk_kda(**part, cu_seqlens=short)[0]) and not o[:, 60:].any()


def test_graph_mode_backward_chunks():
    """The backward's chunk list: FLA's static one in graph mode (sentinel rows past the real chunks), the exact
    host one otherwise."""
    from cula.kda.backends import _backward_chunks

    cu = make_cu_seqlens([30, 0, 70])
    ci, offsets = _backward_chunks(cu, None, 128, graph=True)
    assert ci.shape == (2 + 3 - 1, 2) and offsets is not None  # ceil(128 / 64) + N - 1 rows
    assert ci[:3].tolist() == [[0, 0], [2, 0], [2, 1]] and (ci[3:, 0] < 0).all()
    ci, offsets = _backward_chunks(cu, cu, 100, graph=False)
    assert ci.tolist() == [[0, 0], [2, 0], [2, 1]] and offsets is None
    assert _backward_chunks(None, None, 100, graph=True) == (None, None)


GRAPH_LENS = [37, 0, 130, 1]  # padded to max_num_seqs = 5 with an empty sequence; 232 of 240 tokens used
GRAPH_REPACKED = ([64, 1, 100, 60, 0], [200, 0, 0, 0, 1], [1, 1, 1, 1, 228])


@gpu
def test_graph_mode_training_step():
    """A training step (forward and backward of packed chunk_kda in FLA's graph mode) captured once and replayed
    for new inputs and new boundaries, against eager steps on the same values: outputs, final states and every
    gradient bit for bit on the tokens the boundaries cover."""
    gen = torch.Generator(DEV).manual_seed(7)
    T, N = 240, len(GRAPH_LENS) + 1
    x = _kda_inputs(1, T, 2, 4, N, gen)
    leaves = ("q", "k", "v", "g", "beta", "initial_state")
    for name in leaves:
        x[name].requires_grad_(True)
    x["cu_seqlens"] = make_cu_seqlens(GRAPH_LENS + [0], device=DEV)
    flags = dict(SAFE_GATE, use_graph=True, max_num_seqs=N)
    do = torch.randn(1, T, 4, D, generator=gen, device=DEV).to(torch.bfloat16)
    dht = torch.randn(N, 4, D, D, generator=gen, device=DEV)

    def step():
        for name in leaves:
            x[name].grad = None
        o, ht = chunk_kda(**x, **flags)
        torch.autograd.backward((o, ht), (do, dht))
        return [o, ht] + [x[name].grad for name in leaves]

    graph, outs = _capture(step, warmup=2)  # step() drops the gradients first: the capture allocates them
    for lens in GRAPH_REPACKED:
        with torch.no_grad():
            for name, value in _redraw(x, leaves, gen).items():
                x[name].copy_(value)
            x["cu_seqlens"].copy_(make_cu_seqlens(lens, device=DEV))
        graph.replay()
        replayed = [t.detach().clone() for t in outs]
        eager = [t.detach().clone() for t in step()]
        torch.cuda.synchronize()
        used = sum(lens)  # rows past the last sequence are left undefined in graph mode (as in FLA)
        for i, (r, e) in enumerate(zip(replayed, eager)):
            if tuple(r.shape[:2]) == (1, T):  # o and the token tensors' gradients
                r, e = r[:, :used], e[:, :used]
            _same_bits(f"{lens} tensor {i}", e, r)


@gpu
@pytest.mark.parametrize("HV", [2, 4], ids=["mha", "gva"])
def test_graph_mode_step_matches_the_plain_step(monkeypatch, HV):
    """Eagerly, a packed training step in FLA's graph mode (FLA's fixed-size chunk list, whose sentinel rows cula's
    backward kernels get as padding rows) against the same step without it: o, the final states and every gradient
    within FLA's tolerances (the gate parameters' sums may add in another order), none NaN; cula's stage-6 and
    stage-7 kernels and the intra kernel's recompute run in both."""
    from cula.kda import fla_backward
    from cula.ops.kda.sm90 import bwd_intra, bwd_wy_dqkg
    from cula.testing import assert_close

    ran = []
    for module, name in ((bwd_intra, "chunk_kda_bwd_intra_sm90"), (bwd_wy_dqkg, "chunk_kda_bwd_wy_dqkg_sm90")):
        monkeypatch.setattr(module, name, functools.partial(_count, ran, name, getattr(module, name)))
    monkeypatch.setattr(fla_backward, "recompute_prefix",
                        functools.partial(_count, ran, "recompute_prefix", fla_backward.recompute_prefix))
    gen = torch.Generator(DEV).manual_seed(9)
    lens = [37, 0, 130, 1, 72, 0]  # ends at the total, so the plain call takes the same boundaries
    T, N = sum(lens), len(lens)
    x = _kda_inputs(1, T, 2, HV, N, gen)
    x["cu_seqlens"] = make_cu_seqlens(lens, device=DEV)
    do = torch.randn(1, T, HV, D, generator=gen, device=DEV).to(torch.bfloat16)
    dht = torch.randn(N, HV, D, D, generator=gen, device=DEV)
    leaves = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
    steps = []
    for graph in (False, True):
        ran.clear()
        y = {n: t.detach().clone().requires_grad_(n in leaves) for n, t in x.items()}
        flags = dict(SAFE_GATE, use_graph=True, max_num_seqs=N) if graph else SAFE_GATE
        o, ht = chunk_kda(**y, **flags)
        torch.autograd.backward((o, ht), (do, dht))
        steps.append({"o": o.detach(), "ht": ht.detach(), **{f"d{n}": y[n].grad for n in leaves}})
        assert {"chunk_kda_bwd_intra_sm90", "chunk_kda_bwd_wy_dqkg_sm90", "recompute_prefix"} <= set(ran), ran
    tol = {"dg": 2e-2, "dbeta": 2e-2, "dA_log": 2e-2, "ddt_bias": 2e-2, "o": 5e-3, "ht": 5e-3}
    for name, plain in steps[0].items():
        assert not steps[1][name].isnan().any(), name
        assert_close(name, plain.float(), steps[1][name].float(), tol.get(name, 8e-3))


def _count(ran: list, name: str, fn, *args, **kwargs):
    ran.append(name)
    return fn(*args, **kwargs)


@gpu
def test_graph_mode_serving_loop():
    """A packed prefill (graph mode, the pool rows as its initial and final states) followed by decode steps on the
    same pool, captured as one graph and replayed for new prompts and boundaries, against the same loop run
    eagerly."""
    from cula.kda import kda_decode

    gen = torch.Generator(DEV).manual_seed(8)
    T, N, steps = 240, len(GRAPH_LENS) + 1, 3
    x = _kda_inputs(1, T, 2, 4, N, gen)
    x["cu_seqlens"] = make_cu_seqlens(GRAPH_LENS + [0], device=DEV)
    flags = dict(SAFE_GATE, use_graph=True, max_num_seqs=N)
    tokens = _pool_inputs(N, 1, 2, 4, N, gen)
    slots = torch.arange(N, dtype=torch.int32, device=DEV)

    def loop():
        o, ht = chunk_kda(**x, **flags)
        outs = [o]
        for _ in range(steps):
            outs.append(kda_decode(tokens["q"], tokens["k"], tokens["v"], tokens["g"], tokens["beta"], ht, slots,
                                   A_log=tokens["A_log"], dt_bias=tokens["dt_bias"], state_v_first=False,
                                   **DECODE_FLAGS))  # fmt: skip
        return outs + [ht]

    with torch.inference_mode():
        graph, outs = _capture(loop, warmup=2)
        for lens in GRAPH_REPACKED:
            for name, value in _redraw(x, TOKENS + ("initial_state",), gen).items():
                x[name].copy_(value)
            x["cu_seqlens"].copy_(make_cu_seqlens(lens, device=DEV))
            graph.replay()
            replayed = [t.clone() for t in outs]
            eager = [t.clone() for t in loop()]
            torch.cuda.synchronize()
            used = sum(lens)
            for i, (r, e) in enumerate(zip(replayed, eager)):
                if i == 0:
                    r, e = r[:, :used], e[:, :used]
                _same_bits(f"{lens} tensor {i}", e, r)
