"""Gated DeltaNet, mirroring ``fla.ops.gated_delta_rule``."""

from cula.gated_delta_rule.chunk import chunk_gated_delta_rule
from cula.gated_delta_rule.decode import gdn_commit_accepted, gdn_decode, gdn_decode_step
from cula.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule

chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule

__all__ = [
    "chunk_gated_delta_rule", "chunk_gdn", "fused_recurrent_gated_delta_rule", "fused_recurrent_gdn",
    "gdn_commit_accepted", "gdn_decode", "gdn_decode_step",
]  # fmt: skip
