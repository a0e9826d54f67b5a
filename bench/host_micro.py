"""Host microseconds of two per-step pieces of Python the engine runs on every step.

* `Layout.build` of a decode step (N rows of one token each): what a step pays to describe
  its batch to the model.
* The stepper's ordering of N decoding sequences by slot (`scheduler.step._BY_SLOT`), for
  rows already in order (the steady state) and shuffled (after churn).

Best of `--repeat` timeit runs of `--number` calls each, this machine's CPU; run it with
another tree on PYTHONPATH to compare versions (the script imports only what both have).

    .venv/bin/python bench/host_micro.py [--n 1,8,64,1024]
"""

from __future__ import annotations

import argparse
import json
import random
import timeit
from operator import attrgetter

import harness  # noqa: F401  (puts the repository root on sys.path)

from engine.models.batch import Layout


class _Seq:
    __slots__ = ("slot",)

    def __init__(self, slot: int) -> None:
        self.slot = slot


def best_us(fn: object, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6  # type: ignore[arg-type]


def measure(n: int, number: int, repeat: int) -> dict[str, float]:
    lengths, starts, capture = [1] * n, list(range(100, 100 + n)), [False] * n
    seqs = [_Seq(i) for i in range(n)]
    shuffled = random.Random(n).sample(seqs, n)
    by_slot = attrgetter("slot")
    return {
        "n": n,
        "layout_build_us": best_us(lambda: Layout.build(lengths, starts, capture), number, repeat),
        "sort_in_order_us": best_us(lambda: sorted(seqs, key=by_slot), number, repeat),
        "sort_shuffled_us": best_us(lambda: sorted(shuffled, key=by_slot), number, repeat),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", default="1,8,64,1024", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--number", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    rows = [measure(n, args.number, args.repeat) for n in args.n]
    print("| N | Layout.build us | sort by slot, in order us | sort by slot, shuffled us |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['n']} | {r['layout_build_us']:.1f} | {r['sort_in_order_us']:.1f} "
            f"| {r['sort_shuffled_us']:.1f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
