"""benchmarks/kernel_report.py's GDN decode sweep, planned and compiled on the CPU (its timing needs a GPU)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))
kr = importlib.import_module("kernel_report")


def test_gdn_decode_report_is_listed():
    assert "gdn-decode" in kr.REPORTS and "gdn-decode" in kr.__doc__


def test_gdn_decode_variants_plan_and_compile():
    """Every variant of every shape resolves to a decode kernel that builds for sm_90a; the MTP shapes keep their
    knobs (the T = 1 shapes may fold several variants into the planner's single-token CTA, which the report says)."""
    pytest.importorskip("cutlass")
    from cula.kda.plan import decode_variant
    from cula.ops.kda.sm90 import decode

    for N, T, h, hv, per_head in kr.GDN_DECODE_SHAPES:
        keys = {}
        for name, variant in kr.GDN_DECODE_VARIANTS.items():
            chosen = decode_variant(**kr.gdn_decode_flags(T, N * hv, per_head, **variant))
            assert chosen["per_head_gate"] is per_head
            if T > 1:
                for knob, value in variant.items():
                    assert chosen[knob] == value, (name, knob)
            keys.setdefault(decode.variant_key(**chosen), name)
        if T > 1:
            assert len(keys) == len(kr.GDN_DECODE_VARIANTS)
        for key in keys:
            assert callable(decode.compiled(key))
