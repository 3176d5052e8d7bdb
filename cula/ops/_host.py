"""What the host side of a kernel module needs without the CuTe DSL: dtype names, the gate vocabulary, placeholders
for absent optional arguments, the launchers' shape checks, and lazy access to the kernel.

Each kernel lives in two modules: ``<name>_kernel.py`` (the CuTe DSL classes and ``_compile``, imported only to
compile a variant) and ``<name>.py`` (compile keys, variant choice, launchers), which never imports ``cutlass``,
so that a variant loaded from a prebuilt wheel or the disk cache runs in a process without the DSL (importing it
costs ~1 s, 2.6 s on the H200's host). ``<name>.py`` still answers for the kernel module's names
(``from ...intra import ChunkKDAIntraFwdSm90``), importing the DSL on first use.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any

import torch

# torch dtype -> the CuTe DSL numeric type's name, as compile keys spell it
TORCH_TO_DSL = {torch.bfloat16: "BFloat16", torch.float16: "Float16", torch.float32: "Float32"}

# The gate functions every KDA kernel knows, in FLA's terms: "none" (g is the log decay), "softplus"
# (-exp(A_log) softplus(g + dt_bias)), "lower_bound" (lower_bound sigmoid(exp(A_log) (g + dt_bias))).
GATES = ("none", "softplus", "lower_bound")
# Gated DeltaNet's per-token factors from the intra kernel to the state/output kernel (their row_factors variants):
# f_q = rstd_q exp2(g), f_k = rstd_k exp2(g_last - g), f_g = exp2(g) and an unused float, a 16-byte row (the least
# inner extent of a TMA box)
ROW_FACTORS = 4


# CUDA's limit on gridDim.y and .z, where the chunk kernels put sequences (or time segments): a call with more is
# declined by the backends' verdicts (FLA's kernels, which put sequences in grid x, take it)
GRID_YZ_MAX = 65535


def sequences_verdict(batch: int, cu_seqlens) -> tuple[bool, str | None]:
    """Whether a chunk call's sequences (``batch`` of them, or ``cu_seqlens``' count when packed) fit one launch of
    the chunk kernels (``GRID_YZ_MAX``), with the reason."""
    num_seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if num_seqs > GRID_YZ_MAX:
        return False, f"{num_seqs} sequences in one call (the kernels' grid holds at most {GRID_YZ_MAX})"
    return True, None


def int32_offsets_verdict(*shapes: tuple[int, ...]) -> tuple[bool, str | None]:
    """Whether every tensor of ``shapes`` has fewer than 2^31 elements: the decode kernels' activations are compiled
    with 32-bit strides (their offsets are 32-bit products)."""
    for shape in shapes:
        n = math.prod(shape)
        if n >= 2**31:
            return False, f"{n} elements in one activation tensor (the decode kernels index them with 32-bit offsets)"
    return True, None


def gate_kind(use_gate_in_kernel: bool, lower_bound: float | None) -> str:
    """The kernels' gate for FLA's flags (FLA applies ``lower_bound`` only through the fused gate)."""
    if not use_gate_in_kernel:
        return "none"
    return "softplus" if lower_bound is None else "lower_bound"


def check_tensors(specs, contiguous: bool = False) -> None:
    """Raise ``ValueError`` naming the first of ``specs`` (``(name, tensor, shape, dtype or None for any)``) whose
    shape or dtype differs, or (``contiguous``) that is not contiguous."""
    for name, t, shape, dtype in specs:
        if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
            raise ValueError(f"{name}: expected {shape} {dtype or ''}, got {tuple(t.shape)} {t.dtype}")
        if contiguous and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


_placeholders: dict[tuple, torch.Tensor] = {}


def check_chunk_operands(x: torch.Tensor, v: torch.Tensor, chunk_size: int, names: str) -> tuple[int, ...]:
    """The checks every chunk-recurrence kernel's host makes first: 64-token chunks, K = V = 128 (``x`` ``[B, T, H,
    K]``, ``v`` ``[..., V]``) and bf16 / fp16 operands (``names``: what the message calls them). Returns ``(B, T,
    H, K, V)``."""
    if chunk_size != 64:
        raise ValueError(f"chunk_size must be 64, got {chunk_size}")
    B, T, H, K = x.shape
    V = v.shape[-1]
    if (K, V) != (128, 128):
        raise ValueError(f"only K = V = 128 is supported, got K={K}, V={V}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{names} must be bf16 or fp16, got {x.dtype}")
    return B, T, H, K, V


def check_beta_and_heads(beta: torch.Tensor, H: int, HV: int) -> None:
    """The checks every backward stage's host makes of beta's dtype and the head counts (GVA: HV a multiple of H)."""
    if beta.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"beta must be fp32, bf16 or fp16, got {beta.dtype}")
    if H == 0 or HV % H:
        raise ValueError(f"the value heads ({HV}) must be a multiple of the q/k heads ({H})")


def placeholder(device: torch.device, dtype: torch.dtype, shape: tuple, value: float = 0.0) -> torch.Tensor:
    """A small constant tensor standing in for an absent optional argument (cached per device, dtype, shape, value).

    One made while a CUDA graph captures is not kept: its fill is a node of that graph, which runs only when the
    graph replays, so a later eager call reading it (the gate parameters' defaults) would read memory nothing had
    written yet."""
    key = (device, dtype, shape, value)
    t = _placeholders.get(key)
    if t is None:
        t = torch.full(shape, value, dtype=dtype, device=device)
        if not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
            _placeholders[key] = t
    return t


def dsl_name(dtype: Any) -> str:
    """The DSL type name of a torch dtype, a DSL numeric type (``cutlass.BFloat16``) or a name."""
    if isinstance(dtype, str):
        return dtype
    if isinstance(dtype, torch.dtype):
        return TORCH_TO_DSL[dtype]
    return dtype.__name__


def dsl_type(dtype: Any) -> Any:
    """The DSL numeric type itself (imports the DSL)."""
    import cutlass

    return getattr(cutlass, dsl_name(dtype))


def kernel_attr(host_module: str, name: str) -> Any:
    """``name`` from ``<host_module>_kernel``, for a host module's ``__getattr__``."""
    if name.startswith("__"):
        raise AttributeError(name)
    kernel = importlib.import_module(host_module + "_kernel")
    try:
        return getattr(kernel, name)
    except AttributeError:
        raise AttributeError(f"module {host_module!r} has no attribute {name!r}") from None


@functools.lru_cache(maxsize=16)
def sm_count(device_index: int) -> int:
    """The device's SM count (a persistent grid's size)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
