"""How scattered the pool's slots are in the scheduler's steps under churn.

The pool reads and writes a step's rows as slices where their slots form at most
`SlotPool.MAX_RUNS` runs of consecutive slots, and one run is read without a copy; more
runs are a gather and a scatter of every row's recurrent state (on an H200, 64 rows of the
0.8B shape: 1.2 GB each way a step). This drives the real scheduler (real runner, the given
model, speculation off) with requests of random prompt and output lengths arriving at random
times, and counts the runs of the slots each step reads (the K read, once a step), as the
pool sees them: a histogram, and the share of steps with one run and with more than
`MAX_RUNS`. CPU-only is fine: it counts, it does not time.

    .venv/bin/python bench/slot_runs.py --model MODEL.gguf [--slots 16 --requests 120]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
from pathlib import Path
from typing import Any

import anyio
import harness  # noqa: F401  (puts the repository root on sys.path)
import mlx.core as mx

from engine import cache
from scheduler import Request
from transport.config import KEYS, load
from transport.daemon import build_scheduler


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--gap-ms", type=float, default=20.0, help="most time between arrivals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)

    counts: collections.Counter[int] = collections.Counter()
    take = cache.take_slots

    def spy(a: mx.array, slots: list[cache.SlotId], axis: int, max_runs: int) -> mx.array:
        if a.ndim == 5 and axis == 1 and a.shape[2] > 1:  # the K read: once a step
            counts[len(cache._runs(slots))] += 1  # (BENCHMARK ONLY: wraps the pool's read)
        return take(a, slots, axis, max_runs)

    cache.take_slots = spy

    async def drive() -> None:
        flags: dict[str, str | None] = {k.name: None for k in KEYS}
        flags |= {"model": args.model, "slots": str(args.slots), "context": str(args.context)}
        env = {"SLOTSERVE_PREFIX_CACHE": "", "SLOTSERVE_SPECULATION": "off"}
        scheduler, _ = build_scheduler(load(None, env, flags))
        rng = random.Random(args.seed)
        async with scheduler.running(), anyio.create_task_group() as tg:
            for i in range(args.requests):
                prompt = [1 + rng.randrange(200) for _ in range(rng.randrange(4, 30))]
                request = Request(
                    prompt=prompt,
                    max_tokens=rng.randrange(4, 40),
                    ignore_eos=True,
                    request_id=f"r{i}",
                )
                tg.start_soon(scheduler.submit(request).collect)
                await anyio.sleep(rng.random() * args.gap_ms / 1e3)

    anyio.run(drive)
    steps = sum(counts.values())
    result = {
        "model": Path(args.model).name,
        "args": vars(args),
        "steps": steps,
        "runs": dict(sorted(counts.items())),
        "one_run": counts[1] / steps,
        "gathered": sum(v for k, v in counts.items() if k > cache.SlotPool.MAX_RUNS) / steps,
    }
    print(
        f"{steps} steps; runs of consecutive slots per step: {result['runs']}; one run "
        f"{result['one_run']:.0%}, more than {cache.SlotPool.MAX_RUNS} (gathered) "
        f"{result['gathered']:.0%}",
        file=sys.stderr,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
