"""Fixed cost per MLX operation on this device, eager and under `mx.compile`.

A decode step of a small model is hundreds of small operations, so what one
operation costs regardless of its size decides the small-batch speed. This
chains K operations of one kind on tiny inputs and reports microseconds per
operation, for: elementwise ops (which compile fuses), row reductions (which
it cannot fuse), small matmuls, gathers and scatters, `mx.fast.rms_norm`, and
on MLX's CUDA backend one of our own `mx.fast.cuda_kernel`s (the residual
add + RMSNorm), which says what a custom kernel launch costs, and trivial custom kernels
of 1-8 inputs and 1-4 outputs (with and without `ensure_row_contiguous`), which say what
that cost grows with.

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

    def custom(n_in: int, n_out: int, contiguous: bool) -> Callable[..., mx.array]:
        def run(x: mx.array, *rest: mx.array) -> mx.array:
            kernel = _trivial_kernel(n_in, n_out, contiguous)  # (made on use: CUDA only)
            for _ in range(k):
                x = kernel(
                    inputs=[x, *rest],
                    grid=(1024, 1, 1),
                    threadgroup=(256, 1, 1),
                    output_shapes=[x.shape] * n_out,
                    output_dtypes=[x.dtype] * n_out,
                )[0]
            return x

        return run

    extra = [mx.random.normal((1024,)) for _ in range(7)]
    cases: dict[str, tuple[Callable[..., mx.array], list[mx.array]]] = {
        "custom kernel, 1 input, 1 output": (custom(1, 1, True), [x]),
        "custom kernel, 4 inputs, 1 output": (custom(4, 1, True), [x, *extra[:3]]),
        "custom kernel, 8 inputs, 1 output": (custom(8, 1, True), [x, *extra]),
        "custom kernel, 1 input, 4 outputs": (custom(1, 4, True), [x]),
        "custom kernel, 8 inputs, not ensure_row_contiguous": (custom(8, 1, False), [x, *extra]),
        "rms_norm": (rms_norm, [x, w]),
        "add_rms_norm_cuda (2 per call)": (add_rms_norm, [x, w]),
        "elementwise": (elementwise, [x]),
        "reduction": (reduction, [x]),
        "matmul_1x1024x1024": (matmul, [x, w]),
        "gather+scatter": (gather_scatter, [table, idx]),
    }
    return cases[kind]


def _trivial_kernel(n_in: int, n_out: int, contiguous: bool) -> Callable[..., list[mx.array]]:
    """A kernel doing next to nothing with `n_in` inputs and `n_out` outputs: what a launch
    of an `mx.fast.cuda_kernel` costs by its number of arrays (CUDA only)."""
    ins = [f"a{i}" for i in range(n_in)]
    outs = [f"o{i}" for i in range(n_out)]
    body = " + ".join(f"{a}[i % 1024]" for a in ins)
    source = "const int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
    source += "".join(f"{o}[i] = {body};\n" for o in outs)
    return mx.fast.cuda_kernel(  # type: ignore[no-any-return]
        name=f"op_overhead_{n_in}_{n_out}_{int(contiguous)}",
        input_names=ins,
        output_names=outs,
        source=source,
        ensure_row_contiguous=contiguous,
    )


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
        kinds += [
            "custom kernel, 1 input, 1 output",
            "custom kernel, 4 inputs, 1 output",
            "custom kernel, 8 inputs, 1 output",
            "custom kernel, 1 input, 4 outputs",
            "custom kernel, 8 inputs, not ensure_row_contiguous",
        ]
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
