"""Where one decode step of our engine spends its time, on the CPU backend.

For each model file (`--quants`), BLAS (`--blas`) and batch width N (`--ns`), in a worker
process of its own (OpenBLAS is preloaded there, as in the other benchmarks):

* step ms, eager and `mx.compile`d (`ModelRunner(compile=True)`), median of `--steps` decode
  steps after a `--prompt`-token prompt; host ms is `runner.last_host_s` (Python building the
  inputs and the lazy graph, before `mx.eval`);
* the MLX primitives in one eager step's graph (counted from `mx.export_to_dot`), by kind;
* an instrumented eager step: every call of the model's `matmul`, of `gated_delta` and of
  `mx.fast.scaled_dot_product_attention` is timed with its inputs evaluated first and its output
  evaluated after; "other" is the rest of the instrumented step (norms, rope, conv, gates,
  the pool's gather/scatter, the host's graph building);
* a matmul microbenchmark: GFLOP/s of `x[N, 512] @ W[1536, 512].T` per weight dtype.

This instruments the engine's internals (module globals of `engine.models.qwen35` and
`engine.models.weights`); it reads
them and restores them, and changes nothing on disk. Writes out/bench/profile_step.json.

    .venv/bin/python bench/profile_step.py            # f16 and q8_0, N = 1 and 8
    .venv/bin/python bench/profile_step.py --quick    # f16 only, N = 1, fewer steps
"""

from __future__ import annotations

import argparse
import collections
import functools
import io
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import harness
import numpy as np
from peers import MlxLm, Ours


class _Decoder:
    """N slots on a fresh pool, decoding one token per slot per step."""

    def __init__(self, c: Ours, n: int, context: int, compile: bool) -> None:
        from engine.cache import SlotPool
        from engine.runner import ModelRunner

        pool = SlotPool(c.model.config, n, context, kv_dtype=c.kv_dtype)
        self.runner = ModelRunner(c.model, pool, compile=compile)
        self.slots = [pool.allocate() for _ in range(n)]
        self.lengths = [0] * n

    def step(self, rows: list[list[int]]) -> list[int]:
        from engine.runner import Row

        batch = [Row(s, r, n) for s, r, n in zip(self.slots, rows, self.lengths, strict=True)]
        out = self.runner.step(batch)
        self.lengths = [n + len(r) for n, r in zip(self.lengths, rows, strict=True)]
        return [int(np.argmax(np.array(r.logits[-1]))) for r in out.rows]


def profile(c: Ours, n: int, prompt: int, steps: int, seed: int) -> dict[str, Any]:
    """Step times, op count and the instrumented split of one decode step (in the worker);
    `others`: cores other processes took meanwhile."""
    with harness.Meter() as m:
        res = _profile(c, n, prompt, steps, seed)
    return res | {"others": m.others}


def _profile(c: Ours, n: int, prompt: int, steps: int, seed: int) -> dict[str, Any]:
    import mlx.core as mx

    import engine.models.qwen35 as q35

    context = prompt + 4 * steps + 8
    prompts = [harness.prompt_tokens(prompt, seed + i) for i in range(n)]
    res: dict[str, Any] = {"n": n}
    for compile in (False, True):
        d = _Decoder(c, n, context, compile)
        toks = d.step(prompts)
        t0 = time.perf_counter()
        toks = d.step([[t] for t in toks])  # the first decode step compiles its graph
        first = time.perf_counter() - t0
        toks = d.step([[t] for t in toks])
        wall, host = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            toks = d.step([[t] for t in toks])
            wall.append(time.perf_counter() - t0)
            host.append(getattr(d.runner, "last_host_s", float("nan")))
        key = "compiled" if compile else "eager"
        res[f"{key}_ms"] = 1e3 * statistics.median(wall)
        res[f"{key}_host_ms"] = 1e3 * statistics.median(host)
        res[f"{key}_first_ms"] = 1e3 * first
        if compile:
            break
        with _capture_graph(mx) as graph:
            toks = d.step([[t] for t in toks])
        res["ops"] = sum(graph.values())
        res["ops_by_kind"] = dict(graph.most_common())
        parts: collections.defaultdict[str, float] = collections.defaultdict(float)
        calls: collections.Counter[str] = collections.Counter()
        totals = []
        with _timed(q35, mx, parts, calls):
            for _ in range(steps):
                t0 = time.perf_counter()
                toks = d.step([[t] for t in toks])
                totals.append(time.perf_counter() - t0)
        total = sum(totals)
        res["instrumented_ms"] = 1e3 * total / steps
        for part in ("matmul", "gated_delta", "attention"):
            res[f"{part}_ms"] = 1e3 * parts[part] / steps
            res[f"{part}_calls"] = calls[part] // steps
        res["other_ms"] = 1e3 * (total - sum(parts.values())) / steps
    return res


def profile_mlx_lm(c: MlxLm, n: int, prompt: int, steps: int, seed: int) -> dict[str, Any]:
    """mlx-lm's decode step on the same model: step time and the primitives of its graph
    (the logits and every cache array it writes), as `profile` counts ours."""
    import mlx.core as mx

    with harness.Meter() as m:
        c.start(n, prompt + steps + 8)
        toks = [int(t) for t in np.argmax(c.prefill([harness.prompt_tokens(prompt, seed + i) for i in range(n)]), -1)]  # fmt: skip
        toks = c.greedy(c.greedy(toks))
        wall = []
        for _ in range(steps):
            t0 = time.perf_counter()
            toks = c.greedy(toks)
            wall.append(time.perf_counter() - t0)
        with mx.stream(c.stream):
            logits = c._logits(toks)
        state = [a for cache in c.cache for a in _arrays(cache.state)]
        dot = io.StringIO()
        mx.export_to_dot(dot, logits, *state)
        kinds = collections.Counter(
            re.findall(r'label ="([^"]+)", shape=rectangle', dot.getvalue())
        )
        mx.eval(logits, *state)
    return {
        "n": n,
        "eager_ms": 1e3 * statistics.median(wall),
        "ops": sum(kinds.values()),
        "ops_by_kind": dict(kinds.most_common()),
        "others": m.others,
    }


def _arrays(x: Any) -> list[Any]:
    import mlx.core as mx

    if isinstance(x, mx.array):
        return [x]
    return [a for v in x or () for a in _arrays(v)] if isinstance(x, list | tuple) else []


@contextmanager
def _capture_graph(mx: Any) -> Iterator[collections.Counter[str]]:
    """Count the primitives of every graph handed to `mx.eval` in the block, by kind."""
    kinds: collections.Counter[str] = collections.Counter()
    real_eval = mx.eval

    def eval_(*outputs: Any) -> None:
        dot = io.StringIO()
        mx.export_to_dot(dot, *outputs)
        kinds.update(re.findall(r'label ="([^"]+)", shape=rectangle', dot.getvalue()))
        real_eval(*outputs)

    mx.eval = eval_
    try:
        yield kinds
    finally:
        mx.eval = real_eval


@contextmanager
def _timed(
    q35: Any, mx: Any, parts: dict[str, float], calls: collections.Counter[str]
) -> Iterator[None]:
    """Time every matmul, gated-delta and attention call of the model, synchronously."""

    def wrap(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kw: Any) -> Any:
            mx.eval([a for a in args if isinstance(a, mx.array)])  # pending work is "other"
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            mx.eval(out)
            parts[label] += time.perf_counter() - t0
            calls[label] += 1
            return out

        return timed

    import engine.models.weights as weights  # Projection's fused matmuls live there

    targets = [
        (q35, "matmul", "matmul"),
        (weights, "matmul", "matmul"),
        (q35, "gated_delta", "gated_delta"),
        (mx.fast, "scaled_dot_product_attention", "attention"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
    for owner, name, label in targets:
        setattr(owner, name, wrap(label, getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def pool_scaling(c: Ours, n: int, contexts: list[int], steps: int, seed: int) -> list[float]:
    """Median eager decode-step ms of N short sequences in pools of `contexts` tokens per slot.

    The sequences are the same at every size; only the pool's `max_context` changes.
    """
    out = []
    prompts = [harness.prompt_tokens(4, seed + i) for i in range(n)]
    for context in contexts:
        d = _Decoder(c, n, context, compile=False)
        toks = d.step(prompts)
        wall = []
        for _ in range(steps + 2):
            t0 = time.perf_counter()
            toks = d.step([[t] for t in toks])
            wall.append(time.perf_counter() - t0)
        out.append(1e3 * statistics.median(wall[2:]))
        del d
    return out


def matmul_rates(c: Ours, ns: list[int], reps: int) -> list[dict[str, Any]]:
    """GFLOP/s of x[N, 512] @ W[1536, 512].T (fastest call) for f32, f16 and bf16 weights and
    MLX's 8- and 4-bit affine quantization."""
    import mlx.core as mx

    O, I = 1536, 512
    w32 = mx.random.normal((O, I), key=mx.random.key(0)) * 0.02
    q8 = mx.quantize(w32, group_size=32, bits=8)
    q4 = mx.quantize(w32, group_size=32, bits=4)
    out = []
    for n in ns:
        x32 = mx.random.normal((n, I), key=mx.random.key(1))
        cases: dict[str, Callable[[], mx.array]] = {}
        for name, dt in (
            ("float32", mx.float32),
            ("float16", mx.float16),
            ("bfloat16", mx.bfloat16),
        ):
            w, x = w32.astype(dt), x32.astype(dt)
            mx.eval(w, x)
            cases[name] = functools.partial(mx.matmul, x, w.T)
        for name, (wq, s, b), bits in (("q8 (affine, g32)", q8, 8), ("q4 (affine, g32)", q4, 4)):
            cases[name] = functools.partial(
                mx.quantized_matmul, x32, wq, s, b, transpose=True, group_size=32, bits=bits
            )
        for name, fn in cases.items():
            mx.eval(fn())
            times = []
            for _ in range(max(5, reps * 64 // n)):
                t0 = time.perf_counter()
                mx.eval(fn())
                times.append(time.perf_counter() - t0)
            out.append({"n": n, "weights": name, "gflops": 2 * n * O * I / min(times) / 1e9})
    return out


def main() -> None:
    args = parse_args()
    prof_rows: list[list[object]] = []
    mm_rows: list[list[object]] = []
    pool_rows: list[list[object]] = []
    record: dict[str, Any] = {
        "benchmark": "profile_step",
        "command": "bench/profile_step.py " + " ".join(sys.argv[1:]),
        "machine": harness.machine(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "profiles": [],
        "pool_scaling": [],
        "matmul": [],
    }
    peers = ("mlx-lm",) if args.mlx_lm else ()
    sides = harness.sides_for(args.blas, False, args.threads, "float32", peers)
    for quant in args.quants:
        path = harness.bench_model(args.preset, quant)
        with harness.workers(sides, path) as ws:
            for w in ws:
                for n in args.ns:
                    kw = {"n": n, "prompt": args.prompt, "steps": args.steps, "seed": args.seed}
                    fn = profile if w.side.kind == "ours" else profile_mlx_lm
                    r = harness.measure(w, fn, args.quiet, args.retries, **kw)
                    r |= {"model": f"{args.preset} {quant}", "side": w.side.name}
                    record["profiles"].append(r)
                    print(
                        f"  {r['model']} {r['side']} N={n}: eager {r['eager_ms']:.1f} ms",
                        flush=True,
                    )
                    if w.side.kind != "ours":
                        blank = ["-"] * 4
                        row = [r["model"], r["side"], n, r["eager_ms"], "-", "-", "-", r["ops"]]
                        prof_rows.append([*row, "-", *blank, r["others"]])
                        continue
                    prof_rows.append(
                        [
                            r["model"],
                            r["side"],
                            n,
                            r["eager_ms"],
                            r["eager_host_ms"],
                            r["compiled_ms"],
                            r["compiled_first_ms"],
                            r["ops"],
                            r["instrumented_ms"],
                            f"{r['matmul_ms']:.1f} ({r['matmul_calls']})",
                            f"{r['gated_delta_ms']:.1f} ({r['gated_delta_calls']})",
                            f"{r['attention_ms']:.1f} ({r['attention_calls']})",
                            r["other_ms"],
                            r["others"],
                        ]
                    )
                if quant == args.quants[0] and w.side.kind == "ours":
                    ms = w.call(
                        pool_scaling,
                        n=args.pool_n,
                        contexts=args.pool_contexts,
                        steps=args.steps,
                        seed=args.seed,
                    )
                    record["pool_scaling"].append(
                        {
                            "side": w.side.name,
                            "n": args.pool_n,
                            "contexts": args.pool_contexts,
                            "step_ms": ms,
                        }
                    )
                    pool_rows.append([w.side.name, args.pool_n, *ms])
                    rates = w.call(matmul_rates, ns=args.mm_ns, reps=args.steps)
                    record["matmul"] += [{"side": w.side.name} | m for m in rates]
                    by_weights: dict[str, list[object]] = {}
                    for m in rates:
                        by_weights.setdefault(m["weights"], [w.side.name, m["weights"]])
                        by_weights[m["weights"]].append(m["gflops"])
                    mm_rows += by_weights.values()
    kinds: collections.Counter[str] = collections.Counter(record["profiles"][0]["ops_by_kind"])
    print()
    print(
        harness.markdown_table(
            [
                "model",
                "BLAS",
                "N",
                "eager ms",
                "host ms",
                "compiled ms",
                "1st compiled ms",
                "MLX ops",
                "instrumented ms",
                "matmul ms (calls)",
                "gated delta ms (calls)",
                "attention ms (calls)",
                "other ms",
                "others' cores",
            ],
            prof_rows,
        )
    )
    print(
        "\nops of one eager decode step, by kind (first row above): "
        + ", ".join(f"{k} {v}" for k, v in kinds.most_common(12))
    )
    for r in record["profiles"]:
        if r["side"].startswith("mlx-lm") and r is not record["profiles"][0]:
            top = collections.Counter(r["ops_by_kind"]).most_common(12)
            print(f"{r['side']} N={r['n']}: " + ", ".join(f"{k} {v}" for k, v in top))
            break
    print(f"\ndecode step ms of {args.pool_n} short sequences vs the pool's max_context per slot\n")
    print(
        harness.markdown_table(
            ["BLAS", "N", *[f"max_context {c}" for c in args.pool_contexts]], pool_rows
        )
    )
    print()
    print("matmul x[N, 512] @ W[1536, 512].T, GFLOP/s (fastest of >= 5 calls)\n")
    print(harness.markdown_table(["BLAS", "weights", *[f"N={n}" for n in args.mm_ns]], mm_rows))
    print(f"\n{harness.write_json('profile_step', record, args.out)}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--preset", default="bench-50m", help="engine.writer preset (default %(default)s)"
    )
    p.add_argument("--quants", default="f16,q8_0", type=lambda s: s.split(","))
    p.add_argument("--ns", default=[1, 8], type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--mm-ns", default=[1, 8, 512], type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--pool-n", type=int, default=8, help="sequences for the pool-size sweep")
    p.add_argument(
        "--pool-contexts",
        default=[256, 4096, 16384],
        type=lambda s: [int(x) for x in s.split(",")],
        help="pool max_context per slot for the sweep",
    )
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per measurement")
    p.add_argument(
        "--blas",
        type=lambda s: s.split(","),
        default=sorted({"bundled", harness.default_blas()}),
        help="bundled, openblas, numpy (default: bundled and, where one can be had, "
        "openblas or else numpy)",
    )
    p.add_argument("--threads", type=int, default=2, help="OpenBLAS threads")
    p.add_argument("--mlx-lm", action="store_true", help="also mlx-lm's step: time and ops")
    harness.add_noise_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON path")
    p.add_argument("--quick", action="store_true", help="f16 only, N = 1, 4 steps (< 1 min)")
    args = p.parse_args()
    if args.quick:
        args.retries = 0
        args.quants, args.ns, args.steps, args.prompt, args.mm_ns = ["f16"], [1], 4, 8, [1, 8]
        args.pool_contexts = [256, 4096]
    return args


if __name__ == "__main__":
    main()
