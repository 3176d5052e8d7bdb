"""What the host side of a kernel module needs without the CuTe DSL: dtype names and lazy access to the kernel.

Each kernel lives in two modules: ``<name>_kernel.py`` (the CuTe DSL classes and ``_compile``, imported only to
compile a variant) and ``<name>.py`` (compile keys, variant choice, launchers), which never imports ``cutlass``,
so that a variant loaded from a prebuilt wheel or the disk cache runs in a process without the DSL (importing it
costs ~1 s, 2.6 s on the H200's host). ``<name>.py`` still answers for the kernel module's names
(``from ...intra import ChunkKDAIntraFwdSm90``), importing the DSL on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

# torch dtype -> the CuTe DSL numeric type's name, as compile keys spell it
TORCH_TO_DSL = {torch.bfloat16: "BFloat16", torch.float16: "Float16", torch.float32: "Float32"}


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
