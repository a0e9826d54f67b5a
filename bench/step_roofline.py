"""Aggregate decode throughput of the batched runner against the memory roofline.

For each N: N sequences are prefilled together, then decode `--gen` steps with
all N rows in ONE runner step each. Reports aggregate tokens/s, step time, the
host share of the step (building inputs and the graph, before evaluation), and
the roofline: the bytes a decode step must read (all weights once, each row's
GDN state read and written, its KV read) over the device bandwidth.

Usage (GPU machine, MLX CUDA):
    python bench/step_roofline.py --preset qwen3.5-0.8b --quant f16 --dtype bf16 --n 1,8,32,64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.cache import SlotPool
from engine.gguf import GGUFFile
from engine.kernels import host_pool
from engine.kernels.argmax_cuda import argmax_rows
from engine.models.qwen35 import Model
from engine.runner import ModelRunner, Row
from engine.writer import preset, write_model

DTYPES = {"bf16": mx.bfloat16, "f16": mx.float16, "f32": mx.float32}


def ensure_model(name: str, quant: str, out_dir: Path) -> Path:
    path = out_dir / f"{name}-{quant}.gguf"
    if not path.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        write_model(path, dataclasses.replace(preset(name), quant=quant))
        print(f"wrote {path} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return path


def add_model_args(p: argparse.ArgumentParser, n: str = "1,8,32,64") -> None:
    """The model and batch-width options every H200 step benchmark takes."""
    p.add_argument("--preset", default="qwen3.5-0.8b")
    p.add_argument("--quant", default="f16")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--n", default=n, type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--model-dir", default="out/bench")


def weight_bytes(f: GGUFFile) -> int:
    """Bytes of every tensor a trunk decode step reads (MTP block excluded)."""
    L = f.config.n_layer
    total = 0
    for name in f.tensor_names:
        if name.startswith(f"blk.{L}.") and f.config.n_mtp:
            continue
        total += f.tensor_bytes(name)
    return total


def run(args: argparse.Namespace) -> list[dict[str, float]]:
    path = ensure_model(args.preset, args.quant, Path(args.model_dir))
    f = GGUFFile(path)
    model = Model(f, DTYPES[args.dtype])
    cfg = model.config
    wbytes = weight_bytes(f)
    rng = np.random.default_rng(0)
    results = []
    for n in args.n:
        ctx = args.prompt + args.gen + 8
        pool = SlotPool(cfg, 2 * n if args.scatter else n, ctx, kv_dtype=DTYPES[args.dtype])
        runner = ModelRunner(model, pool, compile=args.compile)
        slots = [pool.allocate() for _ in range(pool.n_slots)]
        if args.scatter:  # every other slot: N runs of one, read by a gather, written by a scatter
            for s in slots[1::2]:
                pool.free(s)
            slots = slots[::2]
        prompts = [
            [int(t) for t in rng.integers(0, min(32000, cfg.n_vocab), args.prompt)] for _ in slots
        ]
        prefill_s = 0.0
        for _ in range(2):  # the first prefill of a shape also compiles it
            for s in slots:
                pool.reset(s)
            t = time.perf_counter()
            out = runner.step([Row(s, p, 0) for s, p in zip(slots, prompts, strict=True)])
            prefill_s = time.perf_counter() - t
        toks = argmax_rows(mx.concatenate([r.logits for r in out.rows])).tolist()
        step_s, host_s = [], []
        tok, prev = mx.array(toks, dtype=mx.int32), None
        for i in range(args.gen + args.warmup):
            t0 = time.perf_counter()
            if args.overlap:  # step t+1 queued on step t's argmax before the host reads it
                out = runner.adopt(runner.launch(slots, tok), range(n))
                nxt = argmax_rows(mx.concatenate([r.logits for r in out.rows]))
                mx.async_eval(nxt)
                if prev is not None:  # (read as the engine reads: `host_pool.to_host`)
                    host_pool.to_host(prev).tolist()
                prev = tok = nxt
            else:
                rows = [Row(s, [t], pool.lengths[s]) for s, t in zip(slots, toks, strict=True)]
                out = runner.step(rows)
                ids = argmax_rows(mx.concatenate([r.logits for r in out.rows]))
                toks = host_pool.to_host(ids).tolist()
            t1 = time.perf_counter()
            if i >= args.warmup:
                step_s.append(t1 - t0)
                host_s.append(runner.last_host_s)
        step = float(np.median(step_s))
        kv = cfg.kv_bytes_per_token(DTYPES[args.dtype].size, include_mtp=False)
        mean_ctx = args.prompt + args.gen / 2
        state_bytes = n * (2 * cfg.linear_state_bytes() + mean_ctx * kv)
        roof_s = (wbytes + state_bytes) / (args.bandwidth_tbs * 1e12)
        r = {
            "n": n,
            "tok_s": n / step,
            "step_ms": step * 1e3,
            "host_ms": float(np.median(host_s)) * 1e3,
            "prefill_tok_s": n * args.prompt / prefill_s,
            "roofline_tok_s": n / roof_s,
            "roofline_frac": roof_s / step,
        }
        results.append(r)
        print(json.dumps(r), file=sys.stderr)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--overlap",
        action="store_true",
        help="queue each step on the previous one's argmax (ModelRunner.launch, adopt) and "
        "read a step's tokens only after queueing the next",
    )
    p.add_argument(
        "--scatter",
        action="store_true",
        help="the N rows on every other slot of a pool of 2N (as a churning daemon's were "
        "before session 11): the pool gathers and scatters their state each step",
    )
    p.add_argument("--bandwidth-tbs", type=float, default=4.3, help="device memory bandwidth, TB/s")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    results = run(args)
    dev = mx.default_device()
    print(
        f"\n{args.preset} {args.quant} compute={args.dtype} compile={args.compile} "
        f"overlap={args.overlap} scatter={args.scatter} device={dev}"
    )
    print(
        "| N | tok/s | step ms | host ms | host % | prefill tok/s | roofline tok/s | % roofline |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['n']} | {r['tok_s']:.0f} | {r['step_ms']:.2f} | {r['host_ms']:.2f} | "
            f"{100 * r['host_ms'] / r['step_ms']:.0f}% | {r['prefill_tok_s']:.0f} | "
            f"{r['roofline_tok_s']:.0f} | {100 * r['roofline_frac']:.0f}% |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args) | {"n": args.n}, "results": results})
        )


if __name__ == "__main__":
    main()
