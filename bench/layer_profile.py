"""Time the parts of one decode step separately, each compiled on its own.

A compiled decode step is one graph, so the device time of its parts is not
visible from outside. This times each part as its own compiled function (50
calls, evaluated each time): one Gated DeltaNet decoder layer, one attention
decoder layer, the recurrence alone, the LM head, the MTP head — and the whole
runner step. `parts x counts` against the whole step shows how much the glue
(gather/scatter of slot state, embedding, sampling inputs) costs.

    python bench/layer_profile.py --preset qwen3.5-0.8b --quant f16 --dtype bf16 --n 1,8,64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from step_roofline import DTYPES, add_model_args, ensure_model

from engine.cache import SlotPool
from engine.gated_delta import gated_delta
from engine.gguf import GGUFFile
from engine.models.batch import AttentionState, Layout, LinearState
from engine.models.qwen35 import Model
from engine.runner import ModelRunner, Row


def timed(fn: Callable[..., Any], *args: Any, reps: int = 50) -> float:
    """Median seconds of `fn(*args)` evaluated, after two warm-up calls."""
    for _ in range(2):
        mx.eval(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def profile(model: Model, n: int, past: int, dtype: mx.Dtype) -> dict[str, float]:
    cfg = model.config
    E = cfg.n_embd
    layout = Layout.build([1] * n, [past] * n)
    arrays = layout.arrays()
    x = mx.random.normal((n, E)).astype(dtype)
    lin = next(layer for layer, r in zip(model.layers, cfg.recurrent, strict=True) if r)
    att = next(layer for layer, r in zip(model.layers, cfg.recurrent, strict=True) if not r)
    conv = mx.zeros((n, cfg.conv_kernel - 1, cfg.conv_channels))
    ssm = mx.zeros((n, cfg.ssm_hv, cfg.ssm_dv, cfg.ssm_dk))
    kv = mx.zeros((n, past, cfg.n_head_kv, cfg.head_dim), dtype=dtype)

    def lin_layer(x: mx.array, a: list[mx.array], c: mx.array, s: mx.array) -> mx.array:
        h, y, new, _ = lin(x, layout.with_arrays(a), LinearState(c, s))
        assert isinstance(new, LinearState)
        return mx.concatenate([(h + y).reshape(-1), new.ssm.reshape(-1)[:1]])

    def att_layer(x: mx.array, a: list[mx.array], k: mx.array, v: mx.array) -> mx.array:
        h, y, new, _ = att(x, layout.with_arrays(a), AttentionState(k, v))
        assert isinstance(new, AttentionState)
        return mx.concatenate([(h + y).reshape(-1), new.k.reshape(-1)[:1].astype(y.dtype)])

    q = mx.random.normal((n, 1, cfg.ssm_hk, cfg.ssm_dk))
    v = mx.random.normal((n, 1, cfg.ssm_hv, cfg.ssm_dv))
    g = -mx.random.uniform(shape=(n, 1, cfg.ssm_hv))

    def recurrence(q: mx.array, v: mx.array, g: mx.array, s: mx.array) -> mx.array:
        o, st = gated_delta(q, q, v, g, -g, s, cfg.v_heads_tiled)
        return mx.concatenate([o.reshape(-1), st.reshape(-1)[:1]])

    out = {
        "linear_layer_ms": timed(mx.compile(lin_layer), x, arrays, conv, ssm),
        "attention_layer_ms": timed(mx.compile(att_layer), x, arrays, kv, kv),
        "recurrence_ms": timed(mx.compile(recurrence), q, v, g, ssm),
        "lm_head_ms": timed(mx.compile(model.logits), x),
    }
    pool = SlotPool(cfg, n, past + 64, kv_dtype=dtype)
    runner = ModelRunner(model, pool, compile=True)
    slots = [pool.allocate() for _ in range(n)]
    runner.step([Row(s, [1] * past, 0) for s in slots])
    steps = []
    for i in range(40):
        t = time.perf_counter()
        runner.step([Row(s, [2], pool.lengths[s]) for s in slots])
        if i >= 3:
            steps.append(time.perf_counter() - t)
    out["step_ms"] = float(np.median(steps))
    out["host_ms"] = runner.last_host_s
    out = {k: v * 1e3 for k, v in out.items()}
    n_lin, n_att = cfg.n_linear_layers, cfg.n_attention_layers
    out["parts_sum_ms"] = (
        n_lin * out["linear_layer_ms"] + n_att * out["attention_layer_ms"] + out["lm_head_ms"]
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p, n="1,8,64")
    p.add_argument("--past", type=int, default=128)
    p.add_argument("--json")
    args = p.parse_args()
    model = Model(
        GGUFFile(ensure_model(args.preset, args.quant, Path(args.model_dir))), DTYPES[args.dtype]
    )
    cfg = model.config
    rows = []
    for n in args.n:
        r = {"n": n, **profile(model, n, args.past, DTYPES[args.dtype])}
        rows.append(r)
        print(json.dumps(r), file=sys.stderr)
    print(
        f"\n{args.preset} {args.quant} compute={args.dtype} device={mx.default_device()} "
        f"({cfg.n_linear_layers} linear + {cfg.n_attention_layers} attention layers)"
    )
    cols = [
        "linear_layer_ms",
        "attention_layer_ms",
        "recurrence_ms",
        "lm_head_ms",
        "parts_sum_ms",
        "step_ms",
        "host_ms",
    ]
    print("| N | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for r in rows:
        print(f"| {r['n']} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
