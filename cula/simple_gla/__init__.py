"""Simple GLA (scalar per-head decay), mirroring ``fla.ops.simple_gla``."""

from cula.simple_gla.chunk import chunk_simple_gla, fused_recurrent_simple_gla

__all__ = ["chunk_simple_gla", "fused_recurrent_simple_gla"]
