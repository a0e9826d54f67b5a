"""Fixed cost per MLX operation on this device, eager and under `mx.compile`.

A decode step of a small model is hundreds of small operations, so what one
operation costs regardless of its size decides the small-batch speed. This
chains K operations of one kind on tiny inputs and reports microseconds per
operation, for: elementwise ops (which compile fuses), row reductions (which
it cannot fuse), small matmuls, gathers and scatters, `mx.fast.rms_norm`, and
on MLX's CUDA backend one of our own `mx.fast.cuda_kernel`s (the residual
add + RMSNorm), which says what a custom kernel launch costs.

    python bench/op_overhead.py --k 200
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from layer_profile import timed


def chain(kind: str, k: int) -> tuple[Callable[..., mx.array], list[mx.array]]:
    x = mx.random.normal((1, 1024))
    w = mx.random.normal((1024, 1024)) * 0.03
    idx = mx.array([3, 1])
    table = mx.random.normal((16, 1024))

    def elementwise(x: mx.array) -> mx.array:
        for _ in range(k):
            x = x * 0.999 + 0.001
        return x

    def reduction(x: mx.array) -> mx.array:
        for _ in range(k):
            x = x - x.mean(axis=-1, keepdims=True)
        return x

    def matmul(x: mx.array, w: mx.array) -> mx.array:
        for _ in range(k):
            x = x @ w.T
        return x

    def gather_scatter(table: mx.array, idx: mx.array) -> mx.array:
        for _ in range(k // 2):
            rows = table[idx] * 0.5
            table[idx] = rows
        return table

    def rms_norm(x: mx.array, w: mx.array) -> mx.array:
        for _ in range(k):
            x = mx.fast.rms_norm(x, w[0], 1e-6)
        return x

    def add_rms_norm(x: mx.array, w: mx.array) -> mx.array:
        from engine.kernels.add_norm_cuda import add_rms_norm_cuda

        h = x
        for _ in range(k // 2):
            h, x = add_rms_norm_cuda(h, x, w[0], 1e-6)
        return x

    cases: dict[str, tuple[Callable[..., mx.array], list[mx.array]]] = {
        "rms_norm": (rms_norm, [x, w]),
        "add_rms_norm_cuda (2 per call)": (add_rms_norm, [x, w]),
        "elementwise": (elementwise, [x]),
        "reduction": (reduction, [x]),
        "matmul_1x1024x1024": (matmul, [x, w]),
        "gather+scatter": (gather_scatter, [table, idx]),
    }
    return cases[kind]


def per_op_us(fn: Callable[..., mx.array], args: list[mx.array], k: int, reps: int) -> float:
    return timed(fn, *args, reps=reps) / k * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--k", type=int, default=200, help="operations per chain")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    from engine.kernels.cuda import available

    kinds = ["elementwise", "reduction", "matmul_1x1024x1024", "gather+scatter", "rms_norm"]
    if available():
        kinds.append("add_rms_norm_cuda (2 per call)")
    for kind in kinds:
        fn, inputs = chain(kind, args.k)
        eager = per_op_us(fn, inputs, args.k, args.reps)
        compiled = per_op_us(mx.compile(fn), inputs, args.k, args.reps)
        rows.append({"op": kind, "eager_us": eager, "compiled_us": compiled})
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(f"\nper-operation cost, chains of {args.k}, device={mx.default_device()}")
    print("| op | eager µs/op | compiled µs/op |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['eager_us']:.2f} | {r['compiled_us']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
