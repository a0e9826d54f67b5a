"""The decode step's matrix products alone: `engine.kernels.gemv_cuda` against MLX's own
matmuls (`x @ W.T`, `mx.quantized_matmul`), over every matrix a model's trunk and LM head
multiply, at a few batch sizes.

For each model file (or, with `--synthetic`, random matrices of the shapes our loader makes
for a preset: no file to write) and each number of rows, every matrix is multiplied by its
own random input in one evaluation (independent products: the launches queue behind the
GPU's work, so a big model measures the kernels, a small one also their launch cost), best
of `--reps`; then per matrix shape alone. `--variants` times the kernel's tuning knobs
(outputs per warp x rounds in flight) side by side. Bandwidth counts the weight bytes read
(the quantized payload with its scales and biases).

    python bench/gemv_bench.py --model-dir MODELS --rows 1,4,8 --json OUT/gemv.json
    python bench/gemv_bench.py --synthetic 9b:8,0.8b:16 --rows 1,8 --variants 4x1x4,4x2x4,2x1x8
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.gguf import QuantizedWeight, Weight
from engine.kernels.cuda import available
from engine.kernels.gemv_cuda import gemv_cuda
from engine.models.qwen35 import load_model
from engine.models.weights import matmul


def matrices(model: object) -> list[Weight]:
    """Every weight the trunk and LM head multiply: fused projections as fused, in order."""
    out: list[Weight] = []
    seen: set[int] = set()

    def walk(obj: object, name: str) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, QuantizedWeight):
            out.append(obj)
        elif isinstance(obj, mx.array):
            if obj.ndim == 2 and min(obj.shape) >= 16 and "conv" not in name:
                out.append(obj)
        elif isinstance(obj, list | tuple):
            for i, x in enumerate(obj):
                walk(x, f"{name}.{i}")
        elif hasattr(obj, "__dict__"):
            for k, v in vars(obj).items():
                if k not in ("tok_embd", "mtp", "parts") or (k == "parts" and v):
                    walk(v, f"{name}.{k}")

    walk(model.layers, "layers")  # type: ignore[attr-defined]
    walk(model.output, "output")  # type: ignore[attr-defined]
    return out


# (out, in) and count of every product of a decode step, as `matrices` found them in our
# files of these presets (joined projections as joined; the LM head last).
SHAPES = {
    "0.8b": [((8224, 1024), 18), ((1024, 2048), 24), ((7168, 1024), 24), ((1024, 3584), 24),
             ((5120, 1024), 6), ((248320, 1024), 1)],
    "9b": [((12352, 4096), 24), ((4096, 4096), 32), ((24576, 4096), 32), ((4096, 12288), 32),
           ((10240, 4096), 8), ((248320, 4096), 1)],
}  # fmt: skip


def synthetic(name: str, bits: int) -> list[Weight]:
    """Random matrices of a preset's shapes: bf16, or quantized with groups of 32."""
    out: list[Weight] = []
    for (n, k), count in SHAPES[name]:
        for _ in range(count):
            w = (mx.random.normal((n, k)) / k**0.5).astype(mx.bfloat16)
            if bits < 16:
                q, s, b = mx.quantize(w, group_size=32, bits=bits)
                out.append(QuantizedWeight(q, s, b, bits, 32, (n, k)))
            else:
                out.append(w)
            mx.eval(out[-1])
    return out


def from_file(path: Path) -> list[Weight]:
    return matrices(load_model(path, mx.bfloat16))


def nbytes(w: Weight) -> int:
    if isinstance(w, QuantizedWeight):
        return w.weight.nbytes + w.scales.nbytes + w.biases.nbytes
    return w.nbytes


def shape(w: Weight) -> tuple[int, int]:
    return w.shape if isinstance(w, QuantizedWeight) else (w.shape[0], w.shape[1])


def timed(
    ws: list[Weight],
    xs: dict[int, mx.array],
    variant: tuple[int | None, ...] | None,
    reps: int,
) -> float:
    """Best seconds of one evaluation of every product of `ws`: MLX's (`variant` None) or
    the kernel's with (outputs per block, rounds in flight, warps per block). Eager: wrapping the products in
    `mx.compile` (the weights captured as constants) measured ~100 ms per evaluation for
    both kernels on the H200 (`bench/results/h200_v11/gemv_synth_v3.md`), the compile path's
    cost, not the kernels'."""
    os.environ["SLOTSERVE_FUSED_GEMV"] = "0"
    best = float("inf")
    for _ in range(reps + 1):  # the first run compiles the kernels
        t0 = time.perf_counter()
        if variant is None:
            mx.eval([matmul(xs[shape(w)[1]], w) for w in ws])
        else:
            mx.eval([gemv_cuda(xs[shape(w)[1]], w, *variant) for w in ws])
        best = min(best, time.perf_counter() - t0)
    return best


def variant_name(variant: tuple[int | None, ...]) -> str:
    return "auto" if None in variant else "x".join(map(str, variant))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, help="*.gguf files to read")
    ap.add_argument("--synthetic", help="PRESET:BITS,... (presets: 0.8b, 9b; bits 16, 8, 4)")
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument(
        "--variants",
        default="auto",
        help="OUTSxUxSPLIT,... of the kernel; auto: its defaults (4x1, split by split_for)",
    )
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not available():
        raise SystemExit("gemv_bench: the kernel needs MLX's CUDA backend")
    variants = [
        (4, 1, None) if t == "auto" else tuple(int(v) for v in t.split("x"))
        for t in args.variants.split(",")
    ]
    sets: list[tuple[str, Callable[[], list[Weight]]]] = []
    for path in sorted(args.model_dir.glob("*.gguf")) if args.model_dir else []:
        sets.append((path.name, functools.partial(from_file, path)))
    for item in args.synthetic.split(",") if args.synthetic else []:
        name, bits = item.split(":")
        sets.append((f"{name} random, {bits}-bit", functools.partial(synthetic, name, int(bits))))
    results = []
    for label_set, make in sets:
        ws = make()
        total = sum(nbytes(w) for w in ws)
        print(f"\n## {label_set}: {len(ws)} matrices, {total / 1e9:.3f} GB", flush=True)
        heads = " | ".join(f"{variant_name(v)} µs | GB/s" for v in variants)
        print(f"| rows | shapes | MLX µs | GB/s | {heads} |")
        print("|---|---|---|---|" + "---|---|" * len(variants))
        for R in [int(r) for r in args.rows.split(",")]:
            xs = {
                k: mx.random.normal((R, k)).astype(mx.bfloat16) for k in {shape(w)[1] for w in ws}
            }
            mx.eval(list(xs.values()))
            groups: dict[tuple[int, int], list[Weight]] = defaultdict(list)
            for w in ws:
                groups[shape(w)].append(w)
            for label, sel in [("all", ws)] + [(f"{n}x{k}", g) for (n, k), g in groups.items()]:
                b = sum(nbytes(w) for w in sel)
                mlx_s = timed(sel, xs, None, args.reps)
                ours = [timed(sel, xs, v, args.reps) for v in variants]  # type: ignore[arg-type]
                results.append(
                    {
                        "set": label_set,
                        "rows": R,
                        "shapes": label,
                        "matrices": len(sel),
                        "bytes": b,
                        "mlx_us": mlx_s * 1e6,
                        "ours_us": {
                            variant_name(v): t * 1e6 for v, t in zip(variants, ours, strict=True)
                        },
                    }
                )
                cells = " | ".join(f"{t * 1e6:.0f} | {b / t / 1e9:.0f}" for t in ours)
                print(
                    f"| {R} | {label} ({len(sel)}) | {mlx_s * 1e6:.0f} | {b / mlx_s / 1e9:.0f} "
                    f"| {cells} |",
                    flush=True,
                )
        del ws
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
