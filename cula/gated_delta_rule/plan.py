"""Gated DeltaNet's planner table: where cula's path (the KDA kernels; the gate per head, or
repeated over K in training) runs a call.

Training always takes cula's path on SM90 (FLA 0.6.0's own gated backward refuses the Triton that PyTorch ships on
Hopper). For inference FLA's Gated DeltaNet kernels (cheaper than KDA's: one gate per head, no per-channel
exponentials) may be the faster ones, so cula's path takes inference calls only where the GPU's entry says it
measured faster (``benchmarks/bench_gdn_prefill.py``; decode: ``inference_decode_max_tokens``,
``benchmarks/bench_gdn_decode.py``).
"""

from __future__ import annotations

import dataclasses

from cula.time_split import SplitThresholds
from cula.tuning import TuningTable

__all__ = ["GDN_TUNING", "GdnTuning"]


@dataclasses.dataclass(frozen=True)
class GdnTuning:
    """Which Gated DeltaNet inference calls run on cula's KDA kernels on one GPU."""

    inference_chunk_on_cula: bool = False  # chunk_gated_delta_rule without autograd
    # training's forward on the intra kernel's per-head-gate variant (exact for any gate; Akk kept for the backward)
    # instead of KDA's with the gate repeated over K; so does the backward's recompute where it runs on the intra
    # kernel, FLA's stages then taking the per-channel cumsum and the gate's backward running per head after them
    training_per_head_gate: bool = False
    # inference on cula's path: the intra kernel writes per-token factors instead of qg, kg and g_cum and the
    # state/output kernel (and a time split's segment summary) applies them to the raw q and k (cula.kda.forward's
    # row_factors)
    inference_row_factors: bool = False
    # with the factor rows: the intra kernel writes T diag(beta) instead of w and u, and the state/output kernel (and
    # a time split's segment summary) makes v_new of it and the raw v and k (cula.kda.forward's wy_in_recurrence)
    inference_wy_in_recurrence: bool = False
    # inference on cula's path: when long sequences with few heads are cut into segments that run at once (exact:
    # cula.kda.forward's parallel segments); None: never
    time_split: SplitThresholds | None = None
    # fused_recurrent_gated_delta_rule's decode calls of up to this many tokens a sequence (0: none)
    inference_decode_max_tokens: int = 0


# The H200: bench_gdn_prefill.py measured cula's path (the intra kernel's per-head gate, then KDA's state/output
# kernel) at 1.2-4.6x FLA's Gated DeltaNet kernels on its quick suite (GVA rows included); with the factor rows
# (gdn_prefill_subset.md, then gdn_prefill_rowfactors_subset.md: two runs) 4 x 8K with 64 value heads
# 2.42 -> 2.06 ms, 2 x 8K with 64 heads 1.23 -> 1.14, one 32K sequence with 32 value heads 1.734 -> 1.733.
# bench_gdn_decode.py measured one token a sequence at 1.35-4.4x FLA's (1 to 64 sequences), 0.95-0.96x from 128 on
# (FLA's states gathered contiguous beforehand, outside its time), 4 tokens (MTP) at 0.77x.
# inference_wy_in_recurrence: bench_gdn_prefill.py --cuda-graph on an H100, wy against the factor rows' w and u in
# one session: one 32K sequence with 32 value heads 1.517 against 1.561 ms, 4 x 8K with 64 value heads 1.422 against
# 1.931 ms. training_per_head_gate is off until it has run on the H200.
# time_split: bench_gdn_prefill.py --cuda-graph --split on an H100 (132 SMs, as the H200), wy on, serial against cut
# in one session: one 32K sequence with 32 value heads 1.460 ms serial, 1.292 cut at 16K, 1.164 at 8K, 1.211 at 4K;
# one 8K sequence with 32 value heads 0.363 serial, 0.345 at 4K, 0.331 at 2K; with 64 value heads every cut lost
# (32K: 1.931 serial, 2.267 at 16K, 2.317 at 8K; 8K: 0.446 serial, 0.575 at 4K; H = HV = 64 at 8K: 0.464, 0.649
# at 4K; 4 x 8K: 1.309, 2.196 at 4K). So: cut below 0.4 lanes an SM (32 value heads, not 64), into about one
# (segment, value head) item an SM in whole waves (four segments at 32 value heads), 2K tokens at the least. KDA's
# entry cuts less (its intra kernel is the larger share and already fills the GPU).
GDN_TUNING: TuningTable[GdnTuning] = TuningTable(
    "gated_delta_rule",
    {(9, 0): GdnTuning(inference_chunk_on_cula=True, inference_decode_max_tokens=1, inference_row_factors=True,
                       inference_wy_in_recurrence=True,
                       time_split=SplitThresholds(items_per_sm=1.0, busy_items_per_sm=0.4, min_segment=2048,
                                                  min_seq_len=8192, wave_ctas=2))},
    fallback=GdnTuning(),
)
