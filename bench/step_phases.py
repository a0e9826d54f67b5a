"""Where a compiled decode step's wall time goes on the host, and how many graph nodes it has.

For each N: N rows are prefilled, then `--steps` greedy decode steps run through
`ModelRunner.step` exactly as `step_roofline.py` runs them, each phase timed:

    prepare   Python before the graph: validation, layout, the step's small input arrays
    graph     the call of the compiled forward (MLX rebuilds the step's graph from its tape)
    eval      evaluating it: every launch, then the wait for the GPU to finish
    write     the pool write and commit after it
    sample    argmax over the rows' logits and `tolist` (a second round trip)

Then the same steps once more with the host's work for step t+1 overlapped with the
device's work for step t: step t+1's tokens are step t's argmax still on the device
(`ModelRunner.launch` and `adopt`), and the host reads step t's tokens only after
queueing step t+1. The scheduler does not decode like this yet (it needs each step's tokens
on the host before it plans the next): the column says what it would gain. (Session 6's
readings of that column came from a first version of this loop that drove the runner's
internals itself: the same graph and pool write, without the step's checks.) The phase
timings wrap the runner's `_forward_fn` and the pool's `write`: BENCHMARK ONLY.

`--dot FILE` writes the N = first step's compiled graph (Graphviz) and prints its nodes by
primitive: each node costs host time twice a step (graph rebuild and evaluation), kernel or
view alike.

    python bench/step_phases.py --model-dir MODELS --n 1,8,32 --dot OUT/graph.dot
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness  # noqa: F401  (puts the repository root on sys.path)
import mlx.core as mx
import numpy as np
from step_roofline import DTYPES, add_model_args, ensure_model

from engine.cache import SlotPool
from engine.gguf import GGUFFile
from engine.models.batch import Layout
from engine.models.qwen35 import Model
from engine.runner import ModelRunner, Row

PHASES = ("prepare", "graph", "eval", "write", "sample")


class Timed:
    """Wraps the runner's and the pool's phase entry points to time them, for one N."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.times = runner, collections.defaultdict(list)
        self._forward_fn = runner._forward_fn
        runner._forward_fn = self._timed_forward_fn  # type: ignore[method-assign]
        self._write = runner.pool.write
        runner.pool.write = self._wrap(self._write, "write")  # type: ignore[method-assign]

    def _wrap(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            t = time.perf_counter()
            out = fn(*args)
            self.times[phase].append(time.perf_counter() - t)
            return out

        return timed

    def _timed_forward_fn(self, *args: Any, **kw: Any) -> tuple[object, Callable[..., Any]]:
        key, fn = self._forward_fn(*args, **kw)
        return key, self._wrap(fn, "graph")

    def close(self) -> None:
        self.runner._forward_fn = self._forward_fn  # type: ignore[method-assign]
        self.runner.pool.write = self._write  # type: ignore[method-assign]


def overlapped(runner: ModelRunner, slots: list[int], tokens: list[int], steps: int) -> float:
    """Median seconds of a decode step whose host work overlaps the previous step's device
    work: `ModelRunner.launch(slots, <step t's argmax on the device>)`, adopted whole, the
    host reading step t's tokens after queueing step t+1 (as `step_roofline.py --overlap`)."""
    tok = mx.array(tokens, dtype=mx.int32)
    prev: mx.array | None = None
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = runner.adopt(runner.launch(slots, tok), range(len(slots)))
        nxt = mx.argmax(mx.concatenate([r.logits for r in out.rows]), axis=-1)
        mx.async_eval(nxt)
        if prev is not None:
            prev.tolist()  # step t's tokens, read while step t+1 is queued behind it
        prev = tok = nxt
        times.append(time.perf_counter() - t0)
    return float(np.median(times[3:]))


def graph_nodes(runner: ModelRunner, slots: list[int], dot: Path) -> collections.Counter[str]:
    """The next decode step's compiled graph, written to `dot`; its nodes by primitive."""
    pool, n = runner.pool, len(slots)
    starts = [pool.lengths[s] for s in slots]
    layout = Layout.build([1] * n, starts, [False] * n)
    past = runner.past_for(max(starts))
    _, fn = runner._forward_fn(layout, n, past, (), every=True)
    tokens = mx.zeros((n,), dtype=mx.int32)
    logits, hidden, new, captures, taps, _ = fn(
        [tokens, mx.arange(n, dtype=mx.int32), *layout.arrays()], pool.read(slots, past)
    )
    mx.export_to_dot(str(dot), logits, hidden, *new, *captures, *taps)
    labels = re.findall(r'label ="([^"]*)"', dot.read_text())
    return collections.Counter(label.split()[0][:48] for label in labels)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    path = ensure_model(args.preset, args.quant, Path(args.model_dir))
    model = Model(GGUFFile(path), DTYPES[args.dtype])
    vocab = min(32000, model.config.n_vocab)
    rng = np.random.default_rng(0)
    results = []
    for n in args.n:
        pool = SlotPool(model.config, n, args.prompt + 2 * args.steps + 16, DTYPES[args.dtype])
        runner = ModelRunner(model, pool, compile=True)
        slots = [pool.allocate() for _ in range(n)]
        prompts = [[int(t) for t in rng.integers(0, vocab, args.prompt)] for _ in slots]
        out = runner.step([Row(s, p, 0) for s, p in zip(slots, prompts, strict=True)])
        tokens = [5] * n
        timed = Timed(runner)
        steps, prepare, sample = [], [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            out = runner.step(
                [Row(s, [t], pool.lengths[s]) for s, t in zip(slots, tokens, strict=True)]
            )
            t1 = time.perf_counter()
            logits = mx.concatenate([r.logits for r in out.rows])
            tokens = [t % vocab for t in mx.argmax(logits, axis=-1).tolist()]
            steps.append(time.perf_counter() - t0)
            prepare.append(runner.last_host_s - timed.times["graph"][-1])
            sample.append(time.perf_counter() - t1)
        timed.close()
        skip = 3  # the first steps run eagerly, then compile
        ms = {p: float(np.median(v[skip:])) * 1e3 for p, v in timed.times.items()}
        ms["prepare"] = float(np.median(prepare[skip:])) * 1e3
        ms["sample"] = float(np.median(sample[skip:])) * 1e3
        step = float(np.median(steps[skip:])) * 1e3
        ms["eval"] = step - ms["sample"] - ms["prepare"] - ms["graph"] - ms["write"]
        over = overlapped(runner, slots, tokens, args.steps) * 1e3
        row: dict[str, Any] = {"n": n, "step_ms": step, **ms, "overlapped_ms": over}
        if args.dot and n == args.n[0]:
            nodes = graph_nodes(runner, slots, Path(args.dot))
            row["nodes"] = sum(nodes.values())
            row["nodes_by_primitive"] = dict(nodes.most_common())
        results.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p, n="1,8,32")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--dot", help="write the first N's decode graph here and count its nodes")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    results = run(args)
    print(f"\n{args.preset} {args.quant} compute={args.dtype} device={mx.default_device()}")
    print("| N | step ms | " + " | ".join(PHASES) + " | overlapped step ms | step / overlapped |")
    print("|---|---|" + "---|" * len(PHASES) + "---|---|")
    for r in results:
        cells = " | ".join(f"{r[p]:.3f}" for p in PHASES)
        print(
            f"| {r['n']} | {r['step_ms']:.3f} | {cells} | {r['overlapped_ms']:.3f} | "
            f"{r['step_ms'] / r['overlapped_ms']:.2f} |"
        )
    for r in results:
        if "nodes" in r:
            print(f"\ngraph of N={r['n']}: {r['nodes']} nodes; {r['nodes_by_primitive']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
