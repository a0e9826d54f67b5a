"""A step's ids both ways in 8-byte pieces (`host_pool`, SLOTSERVE_HOST_POOL=1) on MLX's
CUDA backend: every count's values exactly, and a model through them where plain arrays
leave it (tests/test_step_inputs.py holds the ids' side on a CPU)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gpu_paths import two_steps

from engine.kernels import host_pool
from engine.kernels.cuda import available

pytestmark = pytest.mark.skipif(not available(), reason="needs MLX's CUDA backend")


def test_values_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(host_pool.ENV, "1")
    assert host_pool.enabled()
    for n in (*range(1, 20), 31, 32, 33, 63, 64, 65):
        values = [9 * i - 500 for i in range(n)]
        assert host_pool.ids(values).tolist() == values
        floats = [0.25 * i - 3.0 for i in range(n)]  # (exact in float32)
        assert host_pool.array(floats, mx.float32).tolist() == floats
        for dtype in (mx.int32, mx.uint32, mx.float32):
            made = (mx.arange(n) * 3 + 1).astype(dtype)
            got = host_pool.to_host(made)
            assert got.dtype == np.array(made).dtype and np.array_equal(got, np.array(made))


def test_a_model_through_pieces(
    make_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_model("tiny", quant="f32")
    monkeypatch.setenv(host_pool.ENV, "1")
    made = two_steps(path)
    monkeypatch.setenv(host_pool.ENV, "0")
    for a, b in zip(made, two_steps(path), strict=True):
        assert np.array_equal(np.array(a), np.array(b))
