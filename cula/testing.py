"""Comparison helpers shared by tests and benchmarks.

``assert_close`` follows FLA's rule (relative RMSE of the difference over the RMS of the reference,
passing outright when the largest absolute difference is tiny) but never lets NaN or Inf through:
a poisoned output element that a kernel forgot to write fails the check. A state pool that a decode updates in
place cannot be poisoned: ``assert_rows_rewritten`` checks that every element of the rows it owns moved instead.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import shutil
from collections.abc import Iterator

import torch


# elements a float64 comparison pass converts at once: a comparison of outputs of any size needs ~0.5 GiB beside
# them (whole-tensor float64 copies of a 4 GiB bf16 output took 60 GiB and ran a benchmark out of memory)
_COMPARE_CHUNK = 1 << 25


def _float64_chunks(ref: torch.Tensor, out: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    if ref.shape != out.shape:  # (as the whole-tensor difference broadcast them)
        ref, out = torch.broadcast_tensors(ref, out)
    r, o = ref.detach().reshape(-1), out.detach().reshape(-1)
    for i in range(0, r.numel(), _COMPARE_CHUNK):
        yield r[i : i + _COMPARE_CHUNK].double(), o[i : i + _COMPARE_CHUNK].double()


def rel_rmse(ref: torch.Tensor, out: torch.Tensor) -> float:
    """sqrt(mean((out - ref)^2)) / sqrt(mean(ref^2)), computed in float64 (NaN for empty tensors)."""
    if ref.numel() == 0 or out.numel() == 0:
        return float("nan")
    diff2 = torch.zeros((), dtype=torch.float64, device=ref.device)
    ref2 = torch.zeros((), dtype=torch.float64, device=ref.device)
    for r, o in _float64_chunks(ref, out):
        diff2 += (o - r).pow(2).sum()
        ref2 += r.pow(2).sum()
    return (diff2.sqrt() / ref2.sqrt().clamp_min(1e-30)).item()


def max_abs_diff(ref: torch.Tensor, out: torch.Tensor) -> float:
    """The largest ``|out - ref|``, in float64 (0 for empty tensors)."""
    worst = torch.zeros((), dtype=torch.float64, device=ref.device)
    for r, o in _float64_chunks(ref, out):
        worst = torch.maximum(worst, (o - r).abs().max())
    return worst.item()


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, ratio: float, atol: float = 1e-6) -> None:
    """Fail unless ``out`` matches ``ref`` within relative RMSE ``ratio`` (FLA's tolerance rule)."""
    if ref.shape != out.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    bad = (~torch.isfinite(out)).sum().item()
    if bad:
        raise AssertionError(f"{name}: {bad} non-finite elements (NaN/Inf) of {out.numel()}")
    if not torch.isfinite(ref).all():
        raise AssertionError(f"{name}: the reference itself has non-finite elements")
    max_abs = max_abs_diff(ref, out)
    if max_abs <= atol:
        return
    err = rel_rmse(ref, out)
    if not err < ratio:
        raise AssertionError(f"{name}: relative RMSE {err:.3e} >= {ratio:.1e} (max abs diff {max_abs:.3e})")


def assert_rows_rewritten(
    name: str,
    after: torch.Tensor,
    before: torch.Tensor,
    rows,
    ref: torch.Tensor | None = None,
    rtol: float = 1e-4,
    others_untouched: bool = False,
) -> None:
    """Fail unless every element of the state-pool rows ``rows`` (distinct, non-negative indices into dim 0) is
    finite in ``after`` and differs from ``before``.

    An in-place decode reads the pool, so it cannot be poisoned, and ``assert_close`` over the pool (or a bit-for-bit
    match of two runs) passes a few elements a kernel left at their old values. With random inputs every element
    of a row a sequence owns moves (the state decays by a factor below 1 and takes a random rank-one update), so
    an unchanged one is an unwritten one, with one exception: fp32 rounding gives the old value back where the
    true change is below half an ulp: in random fp32 states, about one element in 10^8, one in 10^5 with no decay.
    ``ref`` (the expected ``after[rows]``, any precision and device) excuses those: an element may keep its value
    where the reference moves it by at most ``rtol`` times the reference's RMS, far above any rounding of an fp32
    pool and far below a random update. Without ``ref`` no element is excused: only for inputs and sizes where
    none can round back. ``others_untouched``: every other row (no sequence's, or a padded slot's) must also keep
    its bits.
    """
    rows = torch.as_tensor(rows, device=after.device).long().flatten()
    if (rows < 0).any():
        raise ValueError(f"{name}: rows must be non-negative pool rows (a padded slot's -1 selects the last row)")
    new, old = after[rows], before[rows].to(after.device)
    if others_untouched:
        others = torch.ones(after.shape[0], dtype=torch.bool, device=after.device)
        others[rows] = False
        assert torch.equal(after[others], before[others].to(after.device)), f"{name}: a row no sequence owns changed"
    if not new.numel():
        return
    bad = (~torch.isfinite(new)).sum().item()
    if bad:
        raise AssertionError(f"{name}: {bad} non-finite elements (NaN/Inf) of {new.numel()} in the updated rows")
    kept = new == old
    if ref is not None:
        ref64 = ref.detach().to(after.device, torch.float64)
        if ref64.shape != new.shape:
            raise AssertionError(f"{name}: reference shape {tuple(ref64.shape)} != the rows' {tuple(new.shape)}")
        if not torch.isfinite(ref64).all():
            raise AssertionError(f"{name}: the reference itself has non-finite elements")
        kept &= (ref64 - old.double()).abs() > rtol * ref64.pow(2).mean().sqrt()
    count = kept.sum().item()
    if count:
        first = kept.nonzero()[:4].tolist()
        where = ", ".join(str((rows[i[0]].item(), *i[1:])) for i in first)
        raise AssertionError(f"{name}: {count} of {new.numel()} elements of the updated rows kept their old value "
                             f"(never written?), first at {where}")  # fmt: skip


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (floating, complex) or the dtype's largest value (integer; True for bool), as
    ``poisoned_allocations`` fills fresh memory, so an unwritten element fails a check."""
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(torch.iinfo(t.dtype).max)


def make_cu_seqlens(lengths: list[int], device="cpu", dtype=torch.int32) -> torch.Tensor:
    """[N+1] cumulative lengths, starting at 0, for packed varlen inputs."""
    out = torch.zeros(len(lengths) + 1, dtype=dtype)
    out[1:] = torch.tensor(lengths, dtype=dtype).cumsum(0)
    return out.to(device)


def chunk_local_gate(B: int, T: int, *heads: int, device="cuda", generator=None, step: float = 0.1) -> torch.Tensor:
    """A random log2 gate cumsum ``[B, T, *heads]`` fp32, local to each 64 tokens (steps in ``(-step, 0]``): the
    chunk-local g_cum the chunk kernels read, for test and device-script inputs (packed calls take the 64-token blocks
    of the whole call, not each sequence's chunks: any finite cumsum will do)."""
    Tp = -(-T // 64) * 64
    steps = -step * torch.rand(B, Tp // 64, 64, *heads, device=device, generator=generator)
    return steps.cumsum(2).view(B, Tp, *heads)[:, :T].contiguous()


def small_batch(varlen: bool, fixed_t: int, lens: tuple[int, ...] = (5, 0, 9)):
    """The token layout of a small test call: ``(B, T, N, cu_seqlens)``, either B = 2 sequences of ``fixed_t``
    tokens or ``lens`` packed into B = 1 (a zero-length sequence among them)."""
    if not varlen:
        return 2, fixed_t, 2, None
    return 1, sum(lens), len(lens), make_cu_seqlens(list(lens))


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Within the block every ``torch.empty`` / ``empty_like`` / ``new_empty`` / ``empty_strided`` (and the
    grown part of a ``resize_``) starts as NaN (floating dtypes) or the dtype's largest value (integers), on the
    CPU and the GPU alike, whatever the size.

    The kernels' outputs, workspaces and temporaries come from those calls, so an element that a kernel forgets
    to write reaches ``assert_close`` as NaN instead of whatever the allocator handed out (which passes by luck
    when it happens to be a stale copy of the right answer). This is PyTorch's own fill: deterministic mode with
    ``torch.utils.deterministic.fill_uninitialized_memory``. ``warn_only`` keeps the ops without a deterministic
    implementation running (with a warning) instead of raising; Triton and CuTe kernels are not affected.
    What it cannot reach: memory allocated once and reused across calls (a cached placeholder or workspace); fill
    such buffers with :func:`poison_` where a test reuses them.
    """
    import torch.utils.deterministic as det

    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        det.fill_uninitialized_memory = was_fill
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)


def find_nvdisasm() -> str | None:
    """Path of an ``nvdisasm`` (PATH, the nvidia-cuda-nvdisasm wheel, or triton's copy), for SASS checks."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    for mod in ("nvidia", "triton"):
        spec = importlib.util.find_spec(mod)
        if spec is None or not spec.submodule_search_locations:
            continue
        for base in spec.submodule_search_locations:
            for pat in ("cu13/bin/nvdisasm", "cuda_nvdisasm/bin/nvdisasm", "backends/nvidia/bin/nvdisasm"):
                hits = glob.glob(os.path.join(base, pat))
                if hits:
                    return hits[0]
    return None


def fake_arguments(build) -> tuple:
    """The fake arguments a variant's build function (``cula.cache.compiled_kernel``'s ``build``) traces its kernel
    against, without tracing or compiling: ``cute.compile`` is intercepted for the call."""
    import cutlass.cute as cute

    seen: list[tuple] = []

    def intercept(kernel, *args, **kwargs):
        seen.append(args)

    real = cute.compile
    cute.compile = intercept
    try:
        build()
    finally:
        cute.compile = real
    if len(seen) != 1:
        raise AssertionError(f"the build function called cute.compile {len(seen)} times, expected once")
    return seen[0]


def check_launch(fake: tuple, args: tuple, name: str = "kernel") -> None:
    """Fail unless ``args`` (a host's launch arguments: torch tensors and Python scalars, the stream left to the
    environment) satisfy the compiled signature ``fake`` (``fake_arguments``) as TVM-FFI checks it at the call,
    and the contracts it leaves to the kernel: dtype, rank, every static size and stride, one value per size or
    stride symbol across all arguments, symbols' divisibility, 32-bit symbols and ``Int32`` scalars in range, the
    assumed alignment of each tensor's data. Runs on the CPU: a host whose stand-in for an unused input has the
    wrong shape fails here instead of at its first launch on a GPU."""
    from cutlass.base_dsl.typing import Float, Integer, Numeric
    from cutlass.cute.typing import SymInt

    from cula.ops._host import TORCH_TO_DSL, dsl_name

    names = {**TORCH_TO_DSL, torch.int32: "Int32", torch.int64: "Int64", torch.uint8: "Uint8", torch.int8: "Int8",
             torch.bool: "Boolean"}  # fmt: skip
    fake = tuple(f for f in fake if type(f).__name__ != "_FakeStream")
    if len(fake) != len(args):
        raise AssertionError(f"{name}: {len(args)} arguments launched, the signature has {len(fake)}")
    bound: dict[int, tuple[int, str]] = {}

    def value(sym_or_int, real: int, where: str) -> None:
        if isinstance(sym_or_int, int):
            if real != sym_or_int:
                raise AssertionError(f"{name}: {where} is {real}, the signature fixes {sym_or_int}")
            return
        if not isinstance(sym_or_int, SymInt):
            raise AssertionError(f"{name}: {where}: unexpected signature entry {sym_or_int!r}")
        div = sym_or_int.divisibility or 1
        if real % div:
            raise AssertionError(f"{name}: {where} is {real}, not a multiple of {div}")
        if sym_or_int.width == 32 and not -(2**31) <= real < 2**31:
            raise AssertionError(f"{name}: {where} is {real}, past a 32-bit symbol's range")
        first = bound.setdefault(id(sym_or_int), (real, where))
        if first[0] != real:
            raise AssertionError(f"{name}: {where} is {real}, but {first[1]} is {first[0]} (the same symbol)")

    for i, (f, a) in enumerate(zip(fake, args)):
        if f is None or a is None:  # an absent optional input: None in the signature and at the call
            if f is not a:
                raise AssertionError(f"{name}: argument #{i} is {type(a).__name__}, the signature has "
                                     f"{type(f).__name__}")  # fmt: skip
            continue
        if isinstance(f, Numeric):
            if isinstance(a, torch.Tensor) or not isinstance(a, (int, float)):
                raise AssertionError(f"{name}: argument #{i} must be a Python number ({type(f).__name__}), got "
                                     f"{type(a).__name__}")  # fmt: skip
            if isinstance(f, Integer):
                if not isinstance(a, int):
                    raise AssertionError(f"{name}: argument #{i} must be an int ({type(f).__name__}), got {a!r}")
                if f.width == 32 and not -(2**31) <= a < 2**31:
                    raise AssertionError(f"{name}: argument #{i} is {a}, past Int32's range")
            elif not isinstance(f, Float):
                raise AssertionError(f"{name}: argument #{i}: unexpected signature entry {f!r}")
            continue
        if not isinstance(a, torch.Tensor):
            raise AssertionError(f"{name}: argument #{i} must be a tensor, got {type(a).__name__}")
        if names.get(a.dtype) != dsl_name(f.element_type):
            raise AssertionError(f"{name}: argument #{i} is {a.dtype}, the signature takes {dsl_name(f.element_type)}")
        if a.dim() != len(f.shape):
            raise AssertionError(f"{name}: argument #{i} has rank {a.dim()} {tuple(a.shape)}, the signature "
                                 f"{len(f.shape)}")  # fmt: skip
        for d, s in enumerate(f.shape):
            value(s, a.shape[d], f"argument #{i} shape[{d}]")
        for d, st in enumerate(f.stride):
            value(st, a.stride(d), f"argument #{i} stride[{d}]")
        align = getattr(f, "_assumed_align", None) or 1
        if a.numel() and a.data_ptr() % align:
            raise AssertionError(f"{name}: argument #{i}'s data is not {align}-byte aligned")
