"""The fused CUDA mixer core against the portable path, on MLX's CUDA backend only.

Capture rows always take the portable path, so running the same rows with and
without capture compares the two paths end to end, through the real model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import SlotPool
from engine.kernels import gdn_mixer_cuda
from engine.models.qwen35 import load_model
from engine.runner import ModelRunner, Row

pytestmark = pytest.mark.skipif(not gdn_mixer_cuda.available(), reason="needs MLX's CUDA backend")


@pytest.mark.parametrize("overrides", [{}, {"ssm_state_size": 128}, {"preset": "tiny-next"}])
def test_fused_mixer_matches_the_portable_path(
    make_model: Callable[..., Path], overrides: dict[str, object]
) -> None:
    model = load_model(make_model("tiny", quant="f32", **overrides))
    prompts = [[3, 9, 27, 81, 243], [5], [7, 11, 13]]
    results = []
    for capture in (False, True):
        pool = SlotPool(model.config, 3, 32, mx.float32, max_draft=4)
        runner = ModelRunner(model, pool)
        slots = [pool.allocate() for _ in prompts]
        runner.step([Row(s, [1, 2], 0) for s in slots])  # a non-zero state to start from
        out = runner.step(
            [
                Row(s, p, 2, capture=capture, want=range(len(p)))
                for s, p in zip(slots, prompts, strict=True)
            ]
        )
        logits = np.concatenate([np.array(r.logits) for r in out.rows])
        results.append((logits, [np.array(a) for a in pool.ssm]))
    (fused, fused_ssm), (portable, portable_ssm) = results
    assert np.abs(fused - portable).max() <= 1e-4 * np.abs(portable).max()
    for a, b in zip(fused_ssm, portable_ssm, strict=True):
        assert np.abs(a - b).max() <= 1e-4 * max(np.abs(b).max(), 1.0)
