"""Comparing a fused GPU path with the portable one, through the real model.

On the GPU even the portable path differed from the CPU backend by ~5e-4 relative
(f32 matmuls there ran on TF32 tensor cores; conftest.py turns TF32 off since) and may
still differ by reduction order: more than any fixed bound two GPU paths could be held
to between themselves. So a fused path is held to the CPU
result as closely as the portable path is (a real kernel fault is off by O(1)).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.cache import SlotPool
from engine.models.qwen35 import load_model
from engine.runner import ModelRunner, Row

PROMPTS = [[3, 9, 27, 81, 243], [5], [7, 11, 13]]


def two_steps(
    path: Path,
    capture: bool = False,
    prompts: list[list[int]] = PROMPTS,
    dtype: mx.Dtype = mx.float32,
) -> list[np.ndarray]:
    """On the default device: a first step of two tokens per row, a ragged second step
    (rows of `prompts`, by default of 5, 1 and 3 tokens, optionally as capture rows), then
    two decode steps, the model computing in `dtype`. Returns every step's logits and the
    pool's state after the last."""
    model = load_model(path, dtype)
    pool = SlotPool(model.config, len(prompts), 32, mx.float32, max_draft=4)
    runner = ModelRunner(model, pool)
    slots = [pool.allocate() for _ in prompts]
    outs = [runner.step([Row(s, [1, 2], 0) for s in slots])]
    outs.append(
        runner.step(
            [
                Row(s, p, 2, capture=capture, want=range(len(p)))
                for s, p in zip(slots, prompts, strict=True)
            ]
        )
    )
    for tok in (17, 19):
        outs.append(runner.step([Row(s, [tok], pool.lengths[s]) for s in slots]))
    logits = [np.concatenate([np.array(r.logits.astype(mx.float32)) for r in o.rows]) for o in outs]
    state = [np.array(a) for a in (pool.k, pool.v, *pool.ssm, *pool.conv)]
    return logits + state


def on_cpu(
    path: Path, prompts: list[list[int]] = PROMPTS, dtype: mx.Dtype = mx.float32
) -> list[np.ndarray]:
    try:
        mx.set_default_device(mx.cpu)
        return two_steps(path, prompts=prompts, dtype=dtype)
    finally:
        mx.set_default_device(mx.gpu)


def assert_as_close_as(
    fused: list[np.ndarray], portable: list[np.ndarray], cpu: list[np.ndarray]
) -> None:
    for f, p, c in zip(fused, portable, cpu, strict=True):
        noise = max(np.abs(p - c).max(), 1e-5 * max(np.abs(c).max(), 1.0))
        assert np.abs(f - c).max() <= 2 * noise, (np.abs(f - c).max(), noise)
