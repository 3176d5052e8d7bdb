"""Gated DeltaNet, mirroring ``fla.ops.gated_delta_rule``."""

from cula.backends import fla_reexports
from cula.gated_delta_rule.chunk import chunk_gated_delta_rule
from cula.gated_delta_rule.decode import gdn_commit_accepted, gdn_decode, gdn_decode_step
from cula.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule

chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule

# FLA's float32 reference implementations, as they are
_FLA_ONLY = ("naive_chunk_gated_delta_rule", "naive_recurrent_gated_delta_rule")
__getattr__ = fla_reexports(__name__, "fla.ops.gated_delta_rule", _FLA_ONLY)

__all__ = [
    "chunk_gated_delta_rule", "chunk_gdn", "fused_recurrent_gated_delta_rule", "fused_recurrent_gdn",
    "gdn_commit_accepted", "gdn_decode", "gdn_decode_step", *_FLA_ONLY,
]  # fmt: skip
