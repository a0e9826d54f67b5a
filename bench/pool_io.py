"""What moving a step's rows in and out of the slot pool costs: MLX's gather and scatter
against the slice reads and writes `SlotPool.read/write` use for consecutive slots.

For N rows on slots 0..N-1 of a 64-slot pool (256-token context, 128 tokens filled),
median ms of each, evaluated and synchronised (ssm and conv state; reads include K/V).

    python bench/pool_io.py --preset qwen3.5-0.8b --quant f16 --dtype bf16 --n 1,8,64
"""

from __future__ import annotations

import argparse
from pathlib import Path

import harness
import mlx.core as mx
from step_roofline import DTYPES, add_model_args, ensure_model

from engine.cache import SlotPool
from engine.gguf import GGUFFile
from engine.models.qwen35 import Model
from engine.runner import ModelRunner, Row


def row_io(model: Model, n: int, dtype: mx.Dtype) -> list[float]:
    """(gather, slice read, scatter, slice write) ms for rows on slots 0..n-1."""
    pool = SlotPool(model.config, 64, 256, kv_dtype=dtype)
    slots = [pool.allocate() for _ in range(n)]
    ModelRunner(model, pool).step([Row(s, list(range(1, 129)), 0) for s in slots])
    idx = mx.array(slots, dtype=mx.int32)
    conv, ssm = mx.array(pool.conv[:, :n]), mx.array(pool.ssm[:, :n])
    mx.eval(conv, ssm)

    def gather() -> None:
        mx.eval(pool.k[:, :, :192][:, idx], pool.v[:, :, :192][:, idx])
        mx.eval(pool.conv[:, idx], pool.ssm[:, idx])

    def scatter() -> None:
        pool.conv[:, idx] = conv
        pool.ssm[:, idx] = ssm
        mx.eval(pool.conv, pool.ssm)

    def slice_write() -> None:  # what `SlotPool.write` does for rows on one run of slots
        pool.conv[:, :n] = conv
        pool.ssm[:, :n] = ssm
        mx.eval(pool.conv, pool.ssm)

    def slice_read() -> None:
        mx.eval(pool.read(slots, 192))

    return [harness.median_ms(f, 10) for f in (gather, slice_read, scatter, slice_write)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p, n="1,8,64")
    args = p.parse_args()
    dtype = DTYPES[args.dtype]
    model = Model(GGUFFile(ensure_model(args.preset, args.quant, Path(args.model_dir))), dtype)
    print("| N | gather ms | slice read ms | scatter ms | slice write ms |")
    print("|---|---|---|---|---|")
    for n in args.n:
        cells = " | ".join(f"{ms:.2f}" for ms in row_io(model, n, dtype))
        print(f"| {n} | {cells} |")


if __name__ == "__main__":
    main()
