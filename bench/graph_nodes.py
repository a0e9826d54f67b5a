"""The graph a decode step builds on the CUDA path, counted on any machine.

On a GPU the host pays for a step twice per node: building (or, compiled, replaying) the
graph, and launching each kernel. This builds one decode step's graph of N rows (its
logits, new states and next starts) with every fused path on and each of our kernels
stood in for by zeros tied to its inputs (`mx.depends`), and counts the nodes by kind: our
kernels by family, MLX's own operations (cuBLAS products, gathers, copies, views) by
primitive. The stand-ins' own nodes (`Full`, `Broadcast`, `Depends`) are not counted. It
counts what the graph holds, not what any of it costs.

`--time K`: also the host's time to build that step's graph (inputs, every op and kernel
call, the stand-ins' own few ops included), K times unevaluated: median and best ms. On a
GPU the host builds the same graph before the kernels launch, so the same Python runs;
this machine's CPU sets the scale (the H200's host was ~8x faster, session 22).

    python bench/graph_nodes.py [--preset qwen3.5-0.8b] [--n 1,8] [--time 40] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import harness  # noqa: F401  (puts the repository root on sys.path)
import mlx.core as mx
from step_roofline import DTYPES, add_model_args, ensure_model

STAND_INS = {"Full", "Broadcast", "Depends"}


@contextmanager
def kernels_stood_in(calls: list[str]) -> Iterator[None]:
    """Every fused path on; each kernel launch appends its family to `calls` and returns
    zeros that depend on its inputs."""
    from engine.kernels import cuda

    def kernel(**kw: Any) -> Any:
        family = kw["name"].removeprefix("slotserve_").rsplit("_", 1)[0]

        def launch(
            *,
            inputs: Sequence[mx.array],
            output_shapes: Sequence[Sequence[int]],
            output_dtypes: Sequence[mx.Dtype],
            **_: Any,
        ) -> list[mx.array]:
            calls.append(family)
            outs = [
                mx.zeros(tuple(s), d) for s, d in zip(output_shapes, output_dtypes, strict=True)
            ]
            return mx.depends(outs, list(inputs))

        return launch

    with cuda.kernels_replaced(kernel):
        yield


def count(path: Path, dtype: mx.Dtype, n: int, times: int = 0) -> dict[str, Any]:
    """One decode step of `n` rows at start 0: our kernels by family, MLX's nodes by kind;
    with `times`, the host's ms to build it (median, best of that many builds)."""
    from engine.cache import SlotPool
    from engine.gguf import GGUFFile
    from engine.models.qwen35 import Model
    from engine.runner import ModelRunner

    calls: list[str] = []
    with kernels_stood_in(calls):
        model = Model(GGUFFile(path), dtype)
        pool = SlotPool(model.config, n, 64, dtype)
        runner = ModelRunner(model, pool, compile=False)
        slots = [pool.allocate() for _ in range(n)]
        mx.eval(pool.conv, pool.ssm)  # (the slots' zeroing: not the step's)
        tokens = mx.zeros((n,), mx.int32)
        _, (logits, _, new, _, _, after) = runner._decode_forward(slots, [0] * n, tokens)
        with tempfile.TemporaryDirectory() as tmp:
            dot = Path(tmp) / "step.dot"
            mx.export_to_dot(str(dot), logits, *new, after)
            labels = re.findall(r'label ?= ?"?([A-Za-z_]+)', dot.read_text())
        kernels = collections.Counter(calls)
        build_s = []
        for _ in range(times):
            t = time.perf_counter()
            runner._decode_forward(slots, [0] * n, tokens)
            build_s.append(time.perf_counter() - t)
    ops = collections.Counter(x for x in labels if x not in STAND_INS)
    timed = (
        {"build_ms": 1e3 * statistics.median(build_s), "build_ms_best": 1e3 * min(build_s)}
        if build_s
        else {}
    )
    return timed | {
        "n": n,
        "kernels": dict(kernels.most_common()),
        "mlx_ops": dict(ops.most_common()),
        "kernel_calls": kernels.total(),
        "mlx_nodes": sum(ops.values()),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p, n="1,8")
    p.add_argument("--json")
    p.add_argument("--time", type=int, default=0, metavar="K", help="builds to time a N")
    args = p.parse_args(argv)
    path = ensure_model(args.preset, args.quant, Path(args.model_dir))
    results = [count(path, DTYPES[args.dtype], n, args.time) for n in args.n]
    print(f"{path.name}, {args.dtype}, a decode step on the CUDA path (kernels stood in for)")
    print("| N | our kernels | MLX nodes | kernels by family | MLX nodes by kind |")
    print("|---|---|---|---|---|")
    for r in results:
        fams = ", ".join(f"{k} {v}" for k, v in r["kernels"].items())
        kinds = ", ".join(f"{k} {v}" for k, v in r["mlx_ops"].items())
        print(f"| {r['n']} | {r['kernel_calls']} | {r['mlx_nodes']} | {fams} | {kinds} |")
    if args.time:
        print(f"\nthe host's build of the step, ms ({args.time} builds a N, unevaluated):")
        print("| N | median | best |\n|---|---|---|")
        for r in results:
            print(f"| {r['n']} | {r['build_ms']:.3f} | {r['build_ms_best']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    sys.stdout.flush()
    return results


if __name__ == "__main__":
    main()
