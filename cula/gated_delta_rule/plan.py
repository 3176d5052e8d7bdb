"""Gated DeltaNet's planner table: where cula's path (the KDA kernels, the scalar gate repeated over K) runs a call.

Training always takes cula's path on SM90 (FLA 0.6.0's own gated backward refuses the Triton that PyTorch ships on
Hopper). For inference FLA's Gated DeltaNet kernels (cheaper than KDA's: one gate per head, no per-channel
exponentials) may be the faster ones, so cula's path takes inference calls only where the GPU's entry says it
measured faster (``benchmarks/bench_gdn_prefill.py``; decode: ``inference_decode_on_cula``).
"""

from __future__ import annotations

import dataclasses

from cula.tuning import TuningTable

__all__ = ["GDN_TUNING", "GdnTuning"]


@dataclasses.dataclass(frozen=True)
class GdnTuning:
    """Which Gated DeltaNet inference calls run on cula's KDA kernels on one GPU."""

    inference_chunk_on_cula: bool = False  # chunk_gated_delta_rule without autograd
    inference_decode_on_cula: bool = False  # fused_recurrent_gated_delta_rule's decode-sized calls


# Not measured yet on the H200: FLA's kernels keep inference until bench_gdn_prefill.py has run.
GDN_TUNING: TuningTable[GdnTuning] = TuningTable("gated_delta_rule", {(9, 0): GdnTuning()}, fallback=GdnTuning())
