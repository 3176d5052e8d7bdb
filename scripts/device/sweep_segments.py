"""chunk_kda at B=1 under each time-segment setting of ``cula.ops.kda.sm90.chunk_fwd`` (one process).

    device run, carry [".device"]:  bash scripts/device/run.sh python scripts/device/sweep_segments.py

B=1 fixed-length calls run in time segments (``OVERLAP_STATE_MIN_TOKENS``, ``_SEGMENT_TOKENS``,
``_MAX_SEGMENTS``, ``_LAST_SEGMENT_TOKENS``, ``_SEGMENT_GROWTH``): the intra kernel of segment i + 1 beside the
recurrence of segment i. When either kernel changes speed the best schedule moves; this prints the median call time
(CUDA events, the kda_prefill suite's inputs and rotation) of each setting at the suite's B=1 shapes, settings
taking turns.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_split import bench, suite_calls  # noqa: E402 - the suite's configs and input rotation

# name -> (OVERLAP_STATE_MIN_TOKENS, _SEGMENT_TOKENS, _MAX_SEGMENTS, _LAST_SEGMENT_TOKENS, _SEGMENT_GROWTH)
SETTINGS = {
    "seg4096x8": (4096, 4096, 8, 512, None),
    "geo512x4": (4096, 4096, 8, 512, 4),
    "geo1024x3": (4096, 4096, 8, 1024, 3),
    "geo1024x4": (4096, 4096, 8, 1024, 4),
    "geo1024x6": (4096, 4096, 8, 1024, 6),
    "geo1536x4": (4096, 4096, 8, 1536, 4),
    "geo768x3": (4096, 4096, 8, 768, 3),
}
REPEATS = 5
NAMES = ["B1-T4096", "B1-T8192", "B1-T16384"]


def main() -> None:
    from cula.backends import clear_plan_caches
    from cula.ops.kda.sm90 import chunk_fwd

    with torch.inference_mode():
        for name in NAMES:
            fns = suite_calls(name)
            times: dict[str, list[float]] = {k: [] for k in SETTINGS}
            for _ in range(REPEATS):
                for key, (min_tokens, seg, most, last, growth) in SETTINGS.items():
                    chunk_fwd.OVERLAP_STATE_MIN_TOKENS = min_tokens
                    chunk_fwd._SEGMENT_TOKENS, chunk_fwd._MAX_SEGMENTS = seg, most
                    chunk_fwd._LAST_SEGMENT_TOKENS, chunk_fwd._SEGMENT_GROWTH = last, growth
                    clear_plan_caches()
                    times[key].append(bench(fns, iters=15, warmup=3).median_ms * 1e3)
            print(f"{name}: " + ", ".join(f"{k} {statistics.median(v):.1f} us" for k, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
