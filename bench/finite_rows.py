"""Cost of the scheduler's per-step check that every row's logits are finite.

Compares checking each row on its own (a slice and a sum per row, as first written)
with `scheduler.step.FiniteCheck` (one reduction over the runner's packed logits, then
O(1) host work per row), for N one-position rows of a 512-token vocabulary, CPU.

    .venv/bin/python bench/finite_rows.py
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from engine.runner import RowOutput
from scheduler.step import FiniteCheck


def per_row(rows: list[RowOutput]) -> list[bool]:
    sums = mx.stack([mx.sum(o.logits) for o in rows])
    return [bool(x) for x in np.array(mx.isfinite(sums))]


def packed(rows: list[RowOutput]) -> list[bool]:
    return FiniteCheck(rows).read()


def main() -> None:
    print("| N rows | per row ms | packed ms |")
    print("|---|---|---|")
    for n in (64, 256, 1024):
        logits = mx.random.normal((n, 512))
        mx.eval(logits)
        ms = []
        for fn in (per_row, packed):
            times = []
            for _ in range(20):
                rows = [RowOutput(packed=(logits, None, i, 1)) for i in range(n)]
                t = time.perf_counter()
                fn(rows)
                times.append(time.perf_counter() - t)
            ms.append(1e3 * float(np.median(times)))
        print(f"| {n} | {ms[0]:.2f} | {ms[1]:.2f} |")


if __name__ == "__main__":
    main()
