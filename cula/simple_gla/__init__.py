"""Simple GLA (scalar per-head decay), mirroring ``fla.ops.simple_gla``."""

from cula.backends import fla_reexports
from cula.simple_gla.chunk import chunk_simple_gla, fused_recurrent_simple_gla

# FLA's other Simple GLA functions, FLA's kernels as they are
_FLA_ONLY = ("fused_chunk_simple_gla", "parallel_simple_gla")
__getattr__ = fla_reexports(__name__, "fla.ops.simple_gla", _FLA_ONLY)

__all__ = ["chunk_simple_gla", "fused_recurrent_simple_gla", *_FLA_ONLY]
