"""A step's small inputs as a kernel's launch parameters (`host_inputs`, SLOTSERVE_HOST_PARAMS=1)
on MLX's CUDA backend: the PTX loads and runs, every count gives back its values bit for bit,
and a model through them is where host-made arrays leave it (tests/test_step_inputs.py
carries the same PTX out on a CPU)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gpu_paths import two_steps

from engine.kernels import host_inputs
from engine.kernels.cuda import available

pytestmark = pytest.mark.skipif(not available(), reason="needs MLX's CUDA backend")


def test_every_count_of_values_comes_back_exactly() -> None:
    for n in (*range(1, 18), 31, 32, 33, 100, 128, 129, 255, 256):
        values = [9 * i - 1000 for i in range(n)]
        made = host_inputs.from_host(values, mx.int32, True)
        assert made.dtype == mx.int32 and made.tolist() == values
        uniforms = np.random.default_rng(n).random(n, dtype=np.float32)
        made = host_inputs.from_host(uniforms, mx.float32, True)
        assert np.array_equal(np.array(made), uniforms)
    # a made array is read by the next kernel as any array is
    ids = host_inputs.from_host([3, 1, 2], mx.int32, True)
    table = mx.arange(40, dtype=mx.float32).reshape(10, 4)
    assert table[ids].tolist() == table[mx.array([3, 1, 2])].tolist()


def test_a_model_through_launch_parameters(
    make_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_model("tiny", quant="f32")
    monkeypatch.setenv(host_inputs.PARAMS_ENV, "1")
    assert host_inputs.params_on()
    made = two_steps(path)
    monkeypatch.setenv(host_inputs.PARAMS_ENV, "0")
    for a, b in zip(made, two_steps(path), strict=True):
        assert np.array_equal(np.array(a), np.array(b))
