"""How many batch shapes a compiled runner meets under daemon-like traffic, and of what kind.

A compiled runner keeps one compiled forward per batch shape (`engine.runner.shape_key`,
the MTP head's own keys beside it) and compiles a shape the second time it comes
(`ModelRunner.COMPILE_AFTER`); until then the step runs eagerly. On the H200 an eager step
of a 0.8B-shaped model costs tens of ms where a compiled one costs a few, and compiling a
new shape hundreds of ms to seconds (NVRTC) — so the share of forwards that meet a shape not
compiled yet, and which kinds of shape they are, say what mixed traffic costs there. This
runs the real Scheduler with a compiled runner on the current device (the row shapes of a
GPU forced with `--uniform`) under a closed loop of requests of random prompt lengths and
output lengths, half of them repetitive (n-gram drafts), most speculating; it counts every
forward by kind:

    decode          one-token rows only
    verify          rows with capture (speculative verify; with uniform rows all as deep)
    prefill/mixed   anything else: prompt chunks, alone or beside decode rows
    mtp / mtp-chain the MTP head's catch-up and draft-chain forwards

    python bench/shape_census.py --requests 150 --uniform
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import harness
import mlx.core as mx

from engine.cache import SlotPool
from engine.gguf import GGUFFile
from engine.models.qwen35 import load_model
from engine.runner import ModelRunner
from engine.spec.speculator import Speculator, default_drafters
from engine.tokenizer import Tokenizer
from scheduler import Request, Scheduler, SchedulerConfig, Speculation

KINDS = ("decode", "verify", "prefill/mixed", "mtp", "mtp-chain")


def kind_of(key: tuple[object, ...]) -> str:
    """The kind of forward a runner cache key stands for (see the module docstring)."""
    if isinstance(key[0], str):
        return str(key[0])
    width, capture = key[1], key[3]
    if width == 1:
        return "decode"
    captured = any(capture) if isinstance(capture, tuple) else bool(capture)
    return "verify" if captured else "prefill/mixed"


def census(args: argparse.Namespace) -> dict[str, Any]:
    path = args.model or harness.bench_model(args.preset, args.quant)
    model = load_model(path)
    tokenizer = Tokenizer.from_metadata(GGUFFile(path).metadata, str(path))
    pool = SlotPool(model.config, args.slots, args.context, mx.float32, max_draft=args.k)
    runner = ModelRunner(model, pool, compile=True)
    spec = Speculator(runner, args.k, drafters=default_drafters(runner))
    if args.uniform:  # a GPU's default row shapes, on any device
        spec.use_uniform_shapes(True)
        runner.pad_widths = not args.no_pad  # (what it measured before widths were padded)
    seen: collections.Counter[tuple[object, ...]] = collections.Counter()
    cold: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    kept_or = runner._kept_or  # BENCHMARK ONLY: count what the runner is asked for

    def counting(key: tuple[object, ...], fn: Any, at_once: bool = False) -> Any:
        kind = kind_of(key)
        calls[kind] += 1
        if key not in runner._compiled:
            cold[kind] += 1
        seen[key] += 1
        return kept_or(key, fn, at_once)

    runner._kept_or = counting  # type: ignore[method-assign]
    config = SchedulerConfig(max_batch_tokens=args.batch_tokens, max_prefill_chunk=args.chunk)
    scheduler = Scheduler(runner, tokenizer, config, spec)
    rng = random.Random(args.seed)
    vocab = min(model.config.n_vocab, 4096)

    def request() -> Request:
        n = rng.randrange(8, args.max_prompt)
        ids = [rng.randrange(0, vocab) for _ in range(n)]
        if rng.random() < 0.5:  # repetitive text: the n-gram drafter finds drafts
            ids = (ids[:20] * (n // 20 + 1))[:n]
        mode = Speculation.AUTO if rng.random() < 0.7 else Speculation.OFF
        return Request(
            prompt=ids, max_tokens=rng.randrange(4, 120), ignore_eos=True, speculation=mode
        )

    async def run() -> float:
        t0 = time.perf_counter()
        limit = anyio.Semaphore(args.concurrency)

        async def one(r: Request) -> None:
            async with limit:
                await scheduler.submit(r).collect()

        async with scheduler.running(), anyio.create_task_group() as tg:
            for _ in range(args.requests):
                tg.start_soon(one, request())
        return time.perf_counter() - t0

    wall = anyio.run(run)
    by_kind = {
        k: {
            "shapes": sum(1 for key in seen if kind_of(key) == k),
            "forwards": calls[k],
            "cold": cold[k],
        }
        for k in KINDS
    }
    return {
        "model": path.name,
        "device": str(mx.default_device()),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "wall_s": wall,
        "shapes": len(seen),
        "forwards": sum(calls.values()),
        "cold": sum(cold.values()),
        "kept": runner.cached_forwards,
        "by_kind": by_kind,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--quant", default="f32")
    p.add_argument("--model", type=Path, help="a GGUF file instead of --preset/--quant")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--k", type=int, default=4, help="draft depth")
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--max-prompt", type=int, default=400)
    p.add_argument("--batch-tokens", type=int, default=512)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--uniform", action="store_true", help="a GPU's row shapes on any device")
    p.add_argument(
        "--no-pad", action="store_true", help="with --uniform: decode and verify widths unpadded"
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    r = census(args)
    print(
        f"{r['model']} on {r['device']}, {args.slots} slots, {args.requests} requests, "
        f"{r['wall_s']:.0f} s: {r['forwards']} forwards, {r['shapes']} shapes, "
        f"{r['cold']} cold ({100 * r['cold'] / max(r['forwards'], 1):.1f}%), {r['kept']} kept"
    )
    rows = [[k, v["shapes"], v["forwards"], v["cold"]] for k, v in r["by_kind"].items()]
    print(harness.markdown_table(["kind", "shapes", "forwards", "cold forwards"], rows))
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
