"""bench/input_faults.py: its ids made from 8-byte pieces are the ids, and a run on tiny
sizes times every way of making them (the GPU's figures are docs/PERFORMANCE.md's)."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from input_faults import MODES, measure, pieces


def test_ids_made_from_pieces_are_the_ids() -> None:
    for ids in ([5], [1, 2], [9, 8, 7], list(range(64))):
        made = pieces(ids)
        assert made.dtype == mx.int32 and made.tolist() == ids


def test_every_way_of_making_ids_is_timed() -> None:
    out = measure(rows=3, evals=4, vocab=64, hidden=16, side=16)
    for how in MODES:
        for key in (how, f"{how}_behind"):
            stats = out[key]
            assert isinstance(stats, dict) and stats["max_us"] >= stats["p50_us"]
