"""What a speculative verify step costs beside a plain decode step, and where the host's part goes.

For each N: N slots are prefilled together, then each round runs one verify step (every row
K + 1 tokens with per-position capture, as `Speculator.plan` makes them with uniform rows)
followed by the pool's `rollback_many` to a random kept prefix, as `Speculator.resolve`
does; and, beside it, plain decode steps of the same N. Reports per step: the plain step,
the verify step, the host time of the pool's `commit` inside the verify step (keeping the
capture rows' per-position state for rollback) and of `rollback_many` (building its graph),
and the rollback's whole time to the device's finish. Medians over `--rounds`.

    python bench/verify_cost.py --preset qwen3.5-0.8b --quant f16 --dtype bf16 --n 1,8 --k 4   # H200
    python bench/verify_cost.py --model models/slotserve-demo.gguf --dtype f32 --n 1,8           # CPU
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import harness
import mlx.core as mx
import numpy as np
from step_roofline import DTYPES, add_model_args, ensure_model

from engine.cache import SlotId, SlotPool
from engine.gguf import GGUFFile
from engine.models.qwen35 import Model
from engine.runner import ModelRunner, Row


def measure(model: Model, n: int, args: argparse.Namespace) -> dict[str, float]:
    rng = np.random.default_rng(n)
    vocab = min(32000, model.config.n_vocab)
    ctx = args.prompt + args.rounds * 2 * (args.k + 1) + 64
    pool = SlotPool(model.config, n, ctx, DTYPES[args.dtype], max_draft=args.k)
    runner = ModelRunner(model, pool, compile=args.compile)
    slots = [pool.allocate() for _ in range(n)]
    runner.step([Row(s, list(rng.integers(0, vocab, args.prompt)), 0) for s in slots])
    spent: dict[str, float] = {}
    harness.time_calls(pool, "commit", spent, "commit")

    def tokens(m: int) -> list[int]:
        return [int(t) for t in rng.integers(0, vocab, m)]

    def plain() -> float:
        t = time.perf_counter()
        out = runner.step([Row(s, tokens(1), pool.lengths[s]) for s in slots])
        mx.eval(out.rows[0].logits)
        return time.perf_counter() - t

    def verify() -> tuple[float, float, float, float]:
        spent["commit"] = 0.0
        t = time.perf_counter()
        rows = [
            Row(s, tokens(args.k + 1), pool.lengths[s], capture=True, want=range(args.k + 1))
            for s in slots
        ]
        out = runner.step(rows)
        mx.eval(out.rows[0].logits)
        step = time.perf_counter() - t
        keeps = [(SlotId(s), int(rng.integers(1, args.k + 2))) for s in slots]
        t = time.perf_counter()
        pool.rollback_many(keeps)
        host = time.perf_counter() - t
        mx.eval(pool.conv, pool.ssm)
        return step, spent["commit"], host, time.perf_counter() - t

    for _ in range(args.warmup):  # kernel builds, compiles of both shapes
        plain()
        verify()
    plains, verifies = [], []
    for _ in range(args.rounds):
        plains.append(plain())
        verifies.append(verify())
    v = np.median(np.array(verifies), axis=0) * 1e3
    p = float(np.median(plains)) * 1e3
    return {
        "n": n,
        "plain_ms": p,
        "verify_ms": float(v[0]),
        "verify_over_plain": float(v[0]) / p,
        "commit_host_ms": float(v[1]),
        "rollback_host_ms": float(v[2]),
        "rollback_ms": float(v[3]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p, n="1,8")
    p.add_argument("--model", help="a GGUF file (default: the preset's, written if missing)")
    p.add_argument("--k", type=int, default=4, help="draft tokens a verify row carries")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json")
    args = p.parse_args()
    path = (
        Path(args.model)
        if args.model
        else ensure_model(args.preset, args.quant, Path(args.model_dir))
    )
    model = Model(GGUFFile(path), DTYPES[args.dtype])
    results = [measure(model, n, args) for n in args.n]
    print(f"{path.name}, K = {args.k}, {mx.default_device()}, compile={args.compile}")
    print(
        "| N | plain ms | verify ms | verify / plain | commit host ms | rollback host ms | rollback ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['n']} | {r['plain_ms']:.2f} | {r['verify_ms']:.2f} | {r['verify_over_plain']:.2f}"
            f" | {r['commit_host_ms']:.3f} | {r['rollback_host_ms']:.3f} | {r['rollback_ms']:.3f} |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"model": path.name, "k": args.k, "results": results})
        )


if __name__ == "__main__":
    main()
