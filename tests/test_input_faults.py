"""bench/input_faults.py: a run on tiny sizes times every way of making its ids (the GPU's
figures are docs/PERFORMANCE.md's)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from input_faults import MODES, measure


def test_every_way_of_making_ids_is_timed() -> None:
    out = measure(rows=3, evals=4, vocab=64, hidden=16, side=16)
    for how in MODES:
        for key in (how, f"{how}_behind"):
            stats = out[key]
            assert isinstance(stats, dict) and set(stats) == {"p50_us", "p90_us", "max_us"}
        # alone, each evaluation takes time (behind a product the product's median is
        # subtracted, so those may read below zero)
        assert 0 < out[how]["p50_us"] < float("inf")
