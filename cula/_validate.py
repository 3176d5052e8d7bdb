"""Argument checks shared by the public functions.

Every check runs before any kernel launch and names the argument, what was expected and what was
given. Checks that need values of ``cu_seqlens`` read ``cu_seqlens_cpu`` when the caller passes it
and otherwise cost one device-to-host copy (FLA pays the same to build its chunk indices); they are
skipped while a CUDA graph is being captured, where a copy is not allowed.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Iterable

import torch

from cula.backends import capturing

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
QKV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# q, k, v of the recurrent forms (fused_recurrent_kda / _fwd, fused_recurrent_gated_delta_rule,
# fused_recurrent_simple_gla): FLA 0.6.0's kernels load each with `.to(tl.float32)`, so any float dtype, one apiece
# (its GDN tests pass fp32 q / k with an fp16 v, its KDA tests a float64 gold call); cula's own kernels decline such
# calls (one 16-bit dtype for all three) and FLA's kernel or the reference runs them
MIXED_QKV_DTYPES = FLOAT_DTYPES
# the states FLA 0.6.0's serving form (fused_recurrent_kda_fwd) updates in place: a pool (or a state of its own) in
# fp32, or bf16 / fp16 as serving engines keep their caches; its kernel reads a state as fp32, computes in fp32 and
# stores the new one in the state's dtype (cula's own decode kernels take fp32 pools)
INPLACE_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in dtypes)


def take_extra_kwargs(fn: str, kwargs: dict[str, Any], allowed: Iterable[str]) -> dict[str, Any]:
    """FLA passes a few arguments through ``**kwargs``; anything else is a typo and must not vanish."""
    allowed = set(allowed)
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        hint = f" (accepted through **kwargs: {', '.join(sorted(allowed))})" if allowed else ""
        raise TypeError(f"{fn}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}{hint}")
    return dict(kwargs)


class HeadFirstRemovedError(DeprecationWarning, ValueError):
    """``head_first`` passed to a chunked form that no longer takes it. FLA 0.6.0 raises ``DeprecationWarning`` as an
    exception there; this is one too, and a ``ValueError`` as cula's other argument errors are."""


def check_head_first(extra: dict[str, Any]) -> None:
    """FLA's refusal of its removed ``head_first`` keyword (``extra``: the call's accepted ``**kwargs``)."""
    if "head_first" in extra:
        raise HeadFirstRemovedError("`head_first` has been removed (as in FLA): pass inputs as [B, T, H, ...]")


def resolve_state_layout(fn: str, state_v_first: bool, extra: dict[str, Any]) -> bool:
    """Accept FLA's deprecated ``transpose_state_layout`` as an alias of ``state_v_first``."""
    if "transpose_state_layout" not in extra:
        return bool(state_v_first)
    legacy = extra.pop("transpose_state_layout")
    if state_v_first:
        raise ValueError(
            f"{fn}: pass either `state_v_first` or the deprecated `transpose_state_layout`, not both"
        )
    warnings.warn(
        "`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
        DeprecationWarning,
        stacklevel=3,
    )
    return bool(legacy)


def check_tensor(
    name: str,
    t: Any,
    *,
    shape: tuple | None = None,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = FLOAT_DTYPES,
    device: torch.device | None = None,
    contiguous_last: bool = True,
) -> torch.Tensor:
    """Check a tensor argument. ``shape`` entries may be None (any size).

    Written for the decode hot path: the common, passing case costs a few attribute reads.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    size = t.shape
    if shape is not None:
        wrong = (
            size != shape
            if None not in shape
            else (len(size) != len(shape) or any(e is not None and e != s for e, s in zip(shape, size)))
        )
        if wrong:
            if len(size) != len(shape):
                raise ValueError(f"`{name}` must have {len(shape)} dimensions, got shape {list(size)}")
            expect = ", ".join("*" if e is None else str(e) for e in shape)
            raise ValueError(f"`{name}` must have shape [{expect}], got {list(size)}")
    elif ndim is not None and len(size) != ndim:
        raise ValueError(f"`{name}` must have {ndim} dimensions, got shape {list(size)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"`{name}` must have dtype {_dtype_names(dtypes)}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"`{name}` is on {t.device} but the inputs are on {device}")
    if contiguous_last and size and size[-1] > 1 and t.stride(-1) != 1:
        # (the entry points copy such an input where the call only reads it: contiguous_reads)
        raise ValueError(f"`{name}` must be contiguous in its last dimension (stride {t.stride(-1)})")
    return t


def contiguous_reads(*tensors: Any) -> tuple:
    """``tensors``, arguments a call only reads, with a row-major copy in place of each one strided in its last
    dimension; anything else (None, a non-tensor, which validation then names) as given.

    FLA 0.6.0's public functions make every tensor argument contiguous (``input_guard``), so such a view (heads split
    off the ``[B, D, T]`` output of a causal conv1d, a transposed projection) is valid input there, while cula's
    kernels and ``check_tensor`` take unit stride along the last dimension. The copy is autograd's, so gradients reach
    the caller's tensor. Never for a tensor the call writes (a pool, ``out``): a write into a copy would be lost, so
    ``check_tensor`` refuses those. Entry points call this on their validated path only, so the common row-major call
    pays nothing: their plans are keyed on strides (or refuse other strides at launch, a short key's), so a strided
    call never meets a plan made for row-major tensors, and one made from the copies copies again at each call.
    """
    out = None  # (paths validated every call run this: is_contiguous() first, one C call a tensor, and no list
    # made unless something is copied)
    for i, t in enumerate(tensors):
        # (an empty tensor is contiguous to torch whatever its strides, but not to check_tensor: copied too)
        if (isinstance(t, torch.Tensor) and (not t.is_contiguous() or not t.numel()) and t.dim() and t.shape[-1] > 1
                and t.stride(-1) != 1):  # fmt: skip
            out = out or list(tensors)
            out[i] = t.clone(memory_format=torch.contiguous_format)
    return tensors if out is None else tuple(out)


def copying_reads(launch: Callable[..., Any]) -> Callable[..., Any]:
    """``launch``, a plan made from the row-major copies ``contiguous_reads`` gave validation, behind the same copies
    at each call. Every argument goes through them: the plan's key holds the strides, so the calls that reach it are
    laid out as the first, whose written tensors (a pool, ``out``) validation refused if strided in their last
    dimension; only the read ones are copied."""

    def run(*args, **kwargs):
        return launch(*contiguous_reads(*args), **dict(zip(kwargs, contiguous_reads(*kwargs.values()))))

    return run


def check_scale(scale: Any, head_dim: int) -> float:
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, torch.Tensor) or not isinstance(scale, (int, float)):
        raise TypeError(f"`scale` must be a Python float, got {type(scale).__name__}")
    if not math.isfinite(scale):  # a host value: free to check, and every output would be NaN
        raise ValueError(f"`scale` must be finite, got {scale}")
    return float(scale)


def check_lower_bound(lower_bound: Any) -> None:
    """``lower_bound`` of the fused KDA gate: None or a finite Python number (the kernels take it as an fp32
    scalar; its range is the caller's rule, e.g. ``safe_gate``'s [-5, 0))."""
    if lower_bound is None:
        return
    if isinstance(lower_bound, (bool, torch.Tensor)) or not isinstance(lower_bound, (int, float)):
        raise TypeError(f"`lower_bound` must be a Python float, got {type(lower_bound).__name__}")
    if not math.isfinite(lower_bound):
        raise ValueError(f"`lower_bound` must be finite, got {lower_bound}")


def check_cu_seqlens(
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_cpu: torch.Tensor | None,
    *,
    batch: int,
    total: int,
    device: torch.device,
    partial: bool = False,
) -> int:
    """Validate packed varlen boundaries; return the number of sequences N (B when not varlen). ``partial``: the
    sequences may end before ``total`` (FLA's graph mode, whose static buffers are filled only in part)."""
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise ValueError("`cu_seqlens_cpu` was given without `cu_seqlens`")
        return batch
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if cu_seqlens.numel() < 2:
        raise ValueError(f"`cu_seqlens` needs at least 2 entries ([0, T]), got {cu_seqlens.numel()}")
    if batch != 1:
        raise ValueError(
            f"The batch size is expected to be 1 rather than {batch} when using `cu_seqlens`; "
            "flatten variable-length inputs to [1, sum(T), ...] first"
        )
    if cu_seqlens_cpu is not None:
        # (any strides: every reader takes its values on the host)
        check_tensor("cu_seqlens_cpu", cu_seqlens_cpu, shape=tuple(cu_seqlens.shape), dtypes=INDEX_DTYPES,
                     contiguous_last=False)
        if cu_seqlens_cpu.device.type != "cpu" and cu_seqlens_cpu.device != device:  # its values are read here
            raise ValueError(
                "`cu_seqlens_cpu` must be the host copy of `cu_seqlens`, a CPU tensor; got one on "
                f"{cu_seqlens_cpu.device}"
            )
        values = cu_seqlens_cpu
    elif capturing(cu_seqlens):
        values = None
    else:
        values = cu_seqlens.detach().to("cpu")
    if values is not None:
        check_cu_seqlens_values(values.tolist(), total, partial)
    if cu_seqlens_cpu is not None:
        check_host_copy(cu_seqlens, cu_seqlens_cpu)
    return cu_seqlens.numel() - 1


def check_host_copy(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor) -> None:
    """Where ``cu_seqlens`` is itself on the host, its host copy must hold the same values (free to compare there;
    on a GPU it would cost the sync the copy saves, and the copy is the caller's word)."""
    if cu_seqlens.device.type == "cpu" and not torch.equal(cu_seqlens, cu_seqlens_cpu.to(cu_seqlens.dtype)):
        raise ValueError(
            f"`cu_seqlens_cpu` must equal `cu_seqlens`, got {cu_seqlens_cpu.tolist()[:16]} and "
            f"{cu_seqlens.tolist()[:16]}"
        )


def check_planned_boundaries(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor, total: int) -> None:
    """What a planned packed call checks every time, before any launch (its plan key holds neither the boundaries'
    values nor the total length): the host copy's values (``check_cu_seqlens_values``) and, where ``cu_seqlens`` is
    itself on the host, that the copy holds them (``check_host_copy``)."""
    check_cu_seqlens_values(cu_seqlens_cpu.tolist(), total)
    check_host_copy(cu_seqlens, cu_seqlens_cpu)


def check_cu_seqlens_values(bounds: list[int], total: int, partial: bool = False) -> None:
    """The values of packed varlen boundaries (``cu_seqlens`` as a host list): 0 first, non-decreasing, ``total``
    last (at most ``total`` when ``partial``)."""
    if bounds[0] != 0:
        raise ValueError(f"`cu_seqlens` must start at 0, got {bounds[0]}")
    if bounds != sorted(bounds):  # non-decreasing; sorted() of a sorted list is one C-level pass, every packed call
        raise ValueError(f"`cu_seqlens` must be non-decreasing, got {bounds[:16]}")
    if bounds[-1] > total or (bounds[-1] != total and not partial):
        raise ValueError(f"`cu_seqlens` must end at the total number of tokens {total}, got {bounds[-1]}")


def check_state(
    name: str,
    state: torch.Tensor | None,
    *,
    n: int,
    heads: int,
    k: int,
    v: int,
    state_v_first: bool,
    device: torch.device,
    dtypes: tuple[torch.dtype, ...] = (torch.float32,),
) -> None:
    """States are fp32 ``[N, HV, K, V]``, or ``[N, HV, V, K]`` with ``state_v_first`` (``dtypes``: those taken)."""
    if state is None:
        return
    expect = (n, heads, v, k) if state_v_first else (n, heads, k, v)
    layout = "[N, HV, V, K] (state_v_first=True)" if state_v_first else "[N, HV, K, V]"
    if not isinstance(state, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(state).__name__}")
    if tuple(state.shape) != expect:
        raise ValueError(f"`{name}` must have shape {list(expect)} {layout}, got {list(state.shape)}")
    check_tensor(name, state, dtypes=dtypes, device=device)


def check_head_dim(name: str, size: int, limit: int | None = 256, arg: str = "q") -> None:
    if size < 1 or (limit is not None and size > limit):
        raise ValueError(f"unsupported head size of `{arg}`: {name}={size} (supported: 1..{limit or 'any'})")


def check_qkv(q, k, v, head_limit: int | None = 256, mixed: bool = False) -> tuple[int, int, int, int, int, int]:
    """q, k ``[B, T, H, K]`` and v ``[B, T, HV, V]`` of one dtype and device, the key head size up to ``head_limit``
    (FLA's chunked delta-rule kernels assert K <= 256; None: any, as its recurrent kernels), any value head size (FLA
    blocks V; its default Gated DeltaNet layer has K = 256, V = 512); return (B, T, H, K, HV, V). ``mixed``: each of
    q, k, v any float dtype, float64 included (``MIXED_QKV_DTYPES``), as FLA 0.6.0's recurrent kernels take them
    (each read as fp32)."""
    dtypes = MIXED_QKV_DTYPES if mixed else QKV_DTYPES
    check_tensor("q", q, ndim=4, dtypes=dtypes)
    B, T, H, K = q.shape
    check_tensor("k", k, shape=(B, T, H, K), dtypes=dtypes if mixed else (q.dtype,), device=q.device)
    check_tensor("v", v, ndim=4, dtypes=dtypes if mixed else (q.dtype,), device=q.device)
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"`v` must have shape [B, T, HV, V] with B={B}, T={T}, got {list(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    check_head_dim("K", K, limit=head_limit)
    check_head_dim("V", V, limit=None, arg="v")
    if H == 0 or HV % H != 0:
        raise ValueError(f"GVA needs the value heads of `v` (HV={HV}) to be a multiple of the q/k heads (H={H})")
    return B, T, H, K, HV, V


def check_state_pool(
    state_pool: Any,
    state_indices: Any,
    *,
    n: int,
    heads: int,
    k: int,
    v: int,
    state_v_first: bool,
    device: torch.device,
) -> None:
    """A serving state pool: fp32 ``[P, HV, V, K]`` (``state_v_first``) or ``[P, HV, K, V]``, and int32
    ``[N]`` row indices (negative: padded slot). Their range is ``check_pool_indices``' (a host read)."""
    check_pool_rows("state_pool", state_pool, heads=heads, k=k, v=v, state_v_first=state_v_first, device=device)
    check_tensor("state_indices", state_indices, shape=(n,), dtypes=(torch.int32,), device=device)


def check_pool_rows(name: str, pool: Any, *, heads: int, k: int, v: int, state_v_first: bool, device: torch.device,
                    what: str = "", dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:  # fmt: skip
    """A state pool ``name`` (``what``: how a message names it beyond that): fp32 ``[P, HV, V, K]`` rows
    (``state_v_first``) or ``[P, HV, K, V]`` (``dtypes``: the dtypes taken, fp32 for cula's decode kernels)."""
    row = (heads, v, k) if state_v_first else (heads, k, v)
    check_tensor(name, pool, ndim=4, dtypes=dtypes, device=device)
    if tuple(pool.shape[1:]) != row:
        layout = "[P, HV, V, K]" if state_v_first else "[P, HV, K, V]"
        raise ValueError(f"`{name}`{what} must have shape {layout} = [P, {', '.join(map(str, row))}], "
                         f"got {list(pool.shape)}")  # fmt: skip


def check_pool_indices(state_indices: torch.Tensor, pool_rows: int, *, distinct: bool = True) -> list[int] | None:
    """``state_indices < pool_rows`` and, with ``distinct``, no pool row named twice (two sequences on one row would
    race, each reading the old state, the last write kept; negative indices, padded slots, may repeat): one copy of
    the indices to the host, checked in Python (a few torch ops on the host would cost more than the copy). Returns
    the indices as a list, or None where nothing was read (no index, or a CUDA graph capturing)."""
    if not state_indices.numel() or capturing(state_indices):
        return None
    rows = state_indices.detach().reshape(-1).tolist()
    top = max(rows)
    if top >= pool_rows:
        raise ValueError(f"`state_indices` has {top}, out of range for a pool of {pool_rows} rows")
    if distinct:
        refuse_repeated_rows(rows)
    return rows


def refuse_repeated_rows(rows: Iterable[int]) -> None:
    """Raise if a non-negative pool row comes twice in ``rows`` (see ``check_pool_indices``)."""
    seen: set[int] = set()
    for row in rows:
        if row >= 0:
            if row in seen:
                raise ValueError(
                    f"`state_indices` names pool row {row} more than once: two sequences would update one state at "
                    "once (pad unused slots with negative indices)"
                )
            seen.add(row)


_HALF_FLOATS = (torch.bfloat16, torch.float16)


def gate_params_fp32(A_log, dt_bias, cast: tuple[torch.dtype, ...] = _HALF_FLOATS):
    """``(A_log, dt_bias)`` as flat fp32 vectors where they come in a dtype of ``cast`` (bf16 / fp16; the recurrent
    forms' also float64, ``READ_AS_FP32``) or with more dimensions (anything else as given, for validation to
    judge). FLA's kernels read both as fp32 whatever their dtype, and FLA's layers
    hand their parameters straight in, bf16 once a model is cast to it; they index both as flat vectors, so any
    shape of the right size passes there (FLA's own tests make A_log ``[1, 1, H, 1]``). The cast and view are made
    at each call (differentiable where autograd tracks the parameter: its gradient comes back in its own shape and
    dtype), never cached: a weight update written through ``param.data`` leaves no trace a cache could check."""
    if isinstance(A_log, torch.Tensor) and (A_log.dtype in cast or A_log.dim() != 1):
        A_log = _flat_fp32(A_log, cast)
    if isinstance(dt_bias, torch.Tensor) and (dt_bias.dtype in cast or dt_bias.dim() != 1):
        dt_bias = _flat_fp32(dt_bias, cast)
    return A_log, dt_bias


def _flat_fp32(t: torch.Tensor, cast: tuple[torch.dtype, ...]) -> torch.Tensor:
    # (a dtype outside ``cast`` kept: validation names it)
    return (t.float() if t.dtype in cast else t).reshape(-1)


def state_fp32(state):
    """A bf16 / fp16 / float64 ``initial_state`` as fp32 (anything else as given, for validation to judge): FLA
    0.6.0's Gated DeltaNet, Simple GLA and Lightning forms and KDA's recurrent one read the state as fp32 whatever its
    dtype (its chunked KDA alone asserts fp32). A differentiable cast, so its gradient comes back in the state's
    dtype, as FLA's does."""
    if isinstance(state, torch.Tensor) and state.dtype in READ_AS_FP32:
        return state.float()
    return state


# what FLA 0.6.0's recurrent kernels read as fp32 besides fp32 (states; the recurrent forms' A_log / dt_bias)
READ_AS_FP32 = (torch.bfloat16, torch.float16, torch.float64)


def gate_kwargs_fp32(kwargs: dict) -> dict:
    """``kwargs`` with ``gate_params_fp32`` applied to its ``A_log`` / ``dt_bias`` (a copy only where one is cast)."""
    A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
    cast = gate_params_fp32(A_log, dt_bias)
    if cast[0] is A_log and cast[1] is dt_bias:
        return kwargs
    out = dict(kwargs)
    for name, t in zip(("A_log", "dt_bias"), cast):
        if name in kwargs:
            out[name] = t
    return out


def is_row_major(t: torch.Tensor) -> bool:
    """Strides exactly row-major, size-1 dims included.

    ``is_contiguous()`` ignores the strides of size-1 dims (e.g. ``x.transpose(0, 1)`` of a ``[1, B, ...]``
    tensor), and so does TVM-FFI's check of an argument against its fake tensor; but a kernel that flattens
    ``(B, T, ...)`` into tokens steps them by dim 1's stride whatever T is, so such a stride would be misread.
    """
    expect = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride())):
        if stride != expect:
            return False
        expect *= size
    return True


def is_dense(t: torch.Tensor) -> bool:
    """Exactly row-major and 16-byte aligned: the layout the kernels' compact fake tensors describe (TVM-FFI itself
    checks only their static strides, each symbolic one's divisibility and the alignment)."""
    return is_row_major(t) and t.data_ptr() % 16 == 0


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is exactly row-major and 16-byte aligned, else such a copy."""
    return t if is_dense(t) else t.clone(memory_format=torch.contiguous_format)


def pool_layout_verdict(
    state_pool: torch.Tensor, k: int, v: int, state_v_first: bool
) -> tuple[bool, str | None]:
    """Whether a decode kernel can address the pool in place: rows contiguous, each 16-byte aligned."""
    inner = (v, k) if state_v_first else (k, v)
    if state_pool.stride()[1:] != (k * v, inner[1], 1) and state_pool.shape[1] > 1:
        return False, f"state_pool dims 1.. are not contiguous (strides {state_pool.stride()})"
    if state_pool.stride(-1) != 1 or state_pool.stride(-2) != inner[1]:
        return False, f"state_pool rows are not contiguous (strides {state_pool.stride()})"
    if state_pool.stride(0) % 4 or state_pool.data_ptr() % 16:
        return False, "state_pool rows are not 16-byte aligned (dim-0 stride or base pointer)"
    return True, None


DECODE_MAX_TOKENS = 8  # per sequence and call: one decode token or a speculative (MTP) verify window


def check_decode_tokens(fn: str, tokens: int) -> None:
    if not 1 <= tokens <= DECODE_MAX_TOKENS:
        raise ValueError(f"{fn} takes 1..{DECODE_MAX_TOKENS} tokens per sequence, got T={tokens}")
