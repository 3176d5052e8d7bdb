"""The one-launch tables of captured packed calls (``cula/ops/device_tables.py``): the intra kernel's chunk list and
the time split's segment tables, against their torch forms (``cula.kda.forward.device_chunk_indices``,
``cula.time_split.device_segment_tables``), value for value.

CPU: every variant compiled for sm_90; the Triton kernels under Triton's interpreter (in a subprocess: the
interpreter is chosen when the kernels are defined); ``import cula`` imports no Triton; the gate sends CPU tensors,
and a first use inside a capture, to the torch forms. GPU (``-m gpu``): the same comparisons on the device.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

LENGTHS = [
    [37, 0, 130, 1, 72],
    [5000],
    [0],
    [64, 64, 64],
    [70000, 1024, 0, 1024, 1024, 1024, 1024],
    [1] * 3000 + [9000],  # more sequences than a block of the program: the carry between blocks
    [0, 0, 65, 0],
]
RULES = [(128, 0), (2048, 4096), (64, 10**9)]  # (segment length, shortest cut sequence)


def compare(device: str, lengths=LENGTHS, rules=RULES) -> int:
    """Both tables against the torch forms for every boundary list, rule and halves flag; returns the checks run."""
    import cula.time_split as ts
    from cula.kda.forward import chunk_rows_bound, device_chunk_indices
    from cula.ops import device_tables

    checks = 0
    for lens in lengths:
        for dtype in (torch.int32, torch.int64):
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=dtype, device=device)
            T, N = int(cu[-1]), len(lens)
            rows = chunk_rows_bound(T, N)
            want = device_chunk_indices(cu.cpu(), rows)
            got = device_tables.chunk_rows(cu, rows).cpu()
            assert torch.equal(want, got), (lens[:5], dtype, (want != got).nonzero()[:5].tolist())
            checks += 1
            for seg, shortest in rules:
                plan = ts.split_plan(tuple(lens), seg, shortest)
                if plan is None:
                    continue
                M = ts.replay_segments(plan, T)
                for halves in (False, True):
                    w = ts.device_segment_tables(plan, cu.cpu(), M, halves)
                    b, f, h = (None if t is None else t.cpu() for t in device_tables.segment_tables(
                        cu, seg, shortest, M, halves, ts.SEGMENT_ALIGN))  # fmt: skip
                    assert torch.equal(w.bounds, b), (lens[:5], seg, halves, w.bounds.tolist()[:8], b.tolist()[:8])
                    assert torch.equal(w.first, f), (lens[:5], seg, halves)
                    assert (h is None) == (w.halves is None) and (h is None or torch.equal(w.halves, h))
                    checks += 1
                    if not halves:
                        checks += _compare_combine(w, cu, device)
    return checks


def _compare_combine(tables, cu, device) -> int:
    """Lightning's captured-cut tables (``combine_tables``) against ``_device_feed_bounds``: the clamped bounds and
    the last segments, exactly."""
    from cula.lightning import time_parallel as tp
    from cula.ops import device_tables

    want_feed, want_last = tp._device_feed_bounds(tables.bounds, tables.first)
    feed, last = device_tables.combine_tables(tables.bounds.to(device), tables.first.to(device))
    assert torch.equal(feed.cpu(), want_feed) and torch.equal(last.cpu(), want_last)
    return 1


def test_triton_tables_match_the_torch_forms_interpreted():
    pytest.importorskip("triton")
    script = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, sys.argv[1])
        from test_device_tables import compare
        print(compare("cpu"))
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", script, os.path.dirname(__file__)], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) >= 40


# every variant the launches compile: (kernel, pointer dtypes by argument, constexprs, warps), each for int32 and
# int64 boundaries ("cu"); the other integers are unspecialized 32-bit values
_VARIANTS = [
    ("_chunk_ends_kernel", {"ends": "*i64"}, {"BLOCK": "_BLOCK"}, "_WARPS"),
    ("_chunk_rows_kernel", {"ends": "*i64", "out": "*i32"}, {"BLOCK": "_BLOCK"}, "_WARPS"),
    ("_segment_tables_kernel", {"ends": "*i64", "bounds": "*i32", "first": "*i32",
                                "halves": "*i32"}, {"ALIGN": 64, "BLOCK": "_BLOCK"}, "_WARPS"),
    ("_combine_tables_kernel", {"bounds": "*i32", "first": "*i32", "clamped": "*i32", "last": "*i64"},
     {"BLOCK": "_BLOCK"}, "_WARPS"),
]  # fmt: skip


def test_triton_tables_compile_for_sm90():
    """Every variant ``device_tables.preload`` loads compiles to a cubin for sm_90 on this machine (no GPU needed):
    CI's counterpart of the CuTe DSL kernels' compile for sm_90a."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import cula.time_split as ts
    from cula.ops import _device_tables_triton as kernels

    assert ts.SEGMENT_ALIGN == 64  # the ALIGN the launches pass
    resolve = lambda v: getattr(kernels, v) if isinstance(v, str) else v  # noqa: E731
    built = 0
    for name, pointers, constexprs, warps in _VARIANTS:
        fn = getattr(kernels, name)
        for cu in ("*i32", "*i64"):
            consts = {n: resolve(v) for n, v in constexprs.items()}
            sig = {a: "constexpr" if a in consts else {**pointers, "cu": cu}.get(a, "i32") for a in fn.arg_names}
            source = ASTSource(fn=fn, signature=sig, constexprs=consts)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": resolve(warps)})
            assert compiled.asm["cubin"], name
            built += 1
    assert built == 8


def test_import_cula_imports_no_triton():
    done = subprocess.run([sys.executable, "-c", "import sys, cula, cula.kda, cula.lightning, cula.time_split; "
                           "print('triton' in sys.modules)"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False"


def test_gate_keeps_the_torch_forms_off_the_device_and_inside_a_first_capture(monkeypatch):
    from cula.ops import device_tables

    assert not device_tables.usable(torch.device("cpu"))
    device_tables.preload(torch.device("cpu"))  # nothing to load
    assert not device_tables._LOADED
    # a CUDA device whose kernels have not run yet, while a capture is under way: not loaded there (loading a
    # module would invalidate the capture), so the caller takes the torch forms
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(device_tables, "_LOADED", set())
    ran = []
    monkeypatch.setattr(device_tables, "chunk_rows", lambda *a: ran.append(a))
    assert not device_tables.usable(torch.device("cuda", 0))
    device_tables.preload(torch.device("cuda", 0))
    assert not ran
    # once loaded, a capture takes them
    device_tables._LOADED.add(0)
    assert device_tables.usable(torch.device("cuda", 0))


@pytest.mark.gpu
def test_triton_tables_match_the_torch_forms_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert compare("cuda") >= 40


@pytest.mark.gpu
def test_captures_after_preload_need_no_new_variant_cuda():
    """After ``preload``, captures of other boundary counts, lengths, dtypes and both ``halves`` launch only variants
    already loaded (a new one would load its module inside the capture and invalidate it); the replays equal the
    torch forms on the boundaries the buffers then hold."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import cula.time_split as ts
    from cula.kda.forward import device_chunk_indices
    from cula.ops import device_tables

    device_tables.preload(torch.device("cuda"))
    for dtype, lens, halves in ((torch.int64, [1], False), (torch.int32, [5000, 0, 17], True),
                                (torch.int64, [64] * 33, True), (torch.int32, [2], False)):  # fmt: skip
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=dtype, device="cuda")
        plan = ts.split_plan(tuple(lens), 64, 0)
        M = ts.replay_segments(plan, sum(lens)) if plan is not None else 2 * len(lens) + 1
        rows = sum(lens) // 64 + len(lens)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got_rows = device_tables.chunk_rows(cu, rows)
            got = device_tables.segment_tables(cu, 64, 0, M, halves, ts.SEGMENT_ALIGN)
        new = list(reversed(lens))  # other boundaries, the same count and total
        cu.copy_(torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got_rows.cpu(), device_chunk_indices(cu.cpu(), rows))
        if plan is not None:
            want = ts.device_segment_tables(plan, cu.cpu(), M, halves)
            assert torch.equal(got[0].cpu(), want.bounds) and torch.equal(got[1].cpu(), want.first)
