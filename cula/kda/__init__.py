"""Kimi Delta Attention, mirroring ``fla.ops.kda``: ``from cula.kda import chunk_kda``."""

from cula.kda.chunk import chunk_kda
from cula.kda.decode import kda_commit_accepted, kda_decode, kda_decode_step
from cula.kda.fused_recurrent import fused_recurrent_kda, fused_recurrent_kda_fwd

__all__ = [
    "chunk_kda", "kda_commit_accepted", "kda_decode", "kda_decode_step", "fused_recurrent_kda",
    "fused_recurrent_kda_fwd",
]
