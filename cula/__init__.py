"""cula: CUDA Linear Attention.

FLA-compatible linear-attention entry points (``cula.kda``, ``cula.gated_delta_rule``,
``cula.lightning``, ``cula.simple_gla``) that pick, per call, our CuTe DSL kernels on Hopper,
FLA's Triton kernels where ours do not cover the arguments yet, or a PyTorch reference on the CPU.
"""

import importlib

from cula import fla_dispatch as _fla_dispatch

__version__ = "0.1.0"

_SUBPACKAGES = ("kda", "gated_delta_rule", "lightning", "simple_gla", "common")


def __getattr__(name):
    # Lazy so that `import cula` stays cheap and never imports triton or the CuTe DSL.
    if name in _SUBPACKAGES:
        return importlib.import_module(f"cula.{name}")
    raise AttributeError(f"module 'cula' has no attribute {name!r}")


# FLA's own calls (fla.ops.kda.chunk_kda, ...) run cula's kernels where they cover them; FLA_CULA=0 turns that off.
_fla_dispatch.install()
