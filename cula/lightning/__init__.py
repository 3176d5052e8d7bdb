"""Lightning attention, mirroring ``fla.ops.lightning_attn`` plus ``lightning_attn_fwd``."""

from cula.lightning.chunk import (
    chunk_lightning_attn,
    fused_recurrent_lightning_attn,
    lightning_attn_fwd,
    lightning_g_gamma,
)
from cula.lightning.decode import lightning_decode, lightning_decode_step

__all__ = [
    "chunk_lightning_attn",
    "fused_recurrent_lightning_attn",
    "lightning_attn_fwd",
    "lightning_decode",
    "lightning_decode_step",
    "lightning_g_gamma",
]
