"""What one more token in a row costs: a runner step of one slot with a row of T tokens,
with and without per-position capture (what a verify row of K drafts asks for, T = K + 1),
against a 1-token decode row. Prints a markdown table (median ms of `--reps` steps, and the
ratio to T = 1).

    python bench/row_cost.py --model models/slotserve-demo.gguf [--dense] [--t 2,3,5]

`--dense` dequantizes a quantized file's matrices at load (the daemon's weights = dense);
run it with OpenBLAS preloaded (LD_PRELOAD) to see a BLAS serve the extra tokens.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import harness  # (also puts the repository root on sys.path)

from engine.cache import SlotPool
from engine.models.qwen35 import load_model
from engine.runner import ModelRunner, Row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dense", action="store_true")
    ap.add_argument("--t", default="2,3,5", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    model = load_model(args.model, dense=args.dense)
    pool = SlotPool(model.config, 1, args.prompt + 2 * max(args.t), max_draft=max(args.t) - 1)
    runner = ModelRunner(model, pool)
    slot = pool.allocate()
    runner.step([Row(slot, [1 + i % 200 for i in range(args.prompt)], 0)])
    at = pool.lengths[slot]

    def step(t: int, capture: bool) -> Callable[[], None]:
        def run() -> None:
            runner.step([Row(slot, [5] * t, at, capture=capture, want=range(t))])
            if capture:
                pool.rollback(slot, 0)  # exactly as before the row
            else:  # BENCHMARK ONLY: back to the same length (the state moved on; timing does not care)
                pool.lengths[slot] = at

        return run

    one = harness.median_ms(step(1, False), args.reps, warmup=3)
    print(
        f"{args.model} ({'dense' if args.dense else 'as stored'}), one slot after "
        f"{args.prompt} tokens; median of {args.reps} steps\n"
    )
    print("| row | ms | vs a 1-token row |\n|---|---|---|")
    print(f"| 1 token | {one:.2f} | 1.00x |")
    for t in args.t:
        for capture in (False, True):
            ms = harness.median_ms(step(t, capture), args.reps, warmup=3)
            kind = "verify (capture)" if capture else "plain"
            print(f"| {t} tokens, {kind} | {ms:.2f} | {ms / one:.2f}x |")


if __name__ == "__main__":
    main()
