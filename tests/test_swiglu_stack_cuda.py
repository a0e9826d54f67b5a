"""The SwiGLU and state-stacking CUDA kernels against the portable ops, on MLX's CUDA
backend only: each kernel alone, and the real model through both paths."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gpu_paths import assert_as_close_as, on_cpu, two_steps

from engine.kernels import stack_cuda, swiglu_cuda
from engine.kernels.cuda import available

pytestmark = pytest.mark.skipif(not available(), reason="needs MLX's CUDA backend")


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("shape", [(1, 128), (7, 7168), (33, 1000)])
def test_swiglu_kernel_matches_silu_times_up(shape: tuple[int, int], dtype: mx.Dtype) -> None:
    gu = (3 * mx.random.normal(shape, key=mx.random.key(1))).astype(dtype)
    out = swiglu_cuda.swiglu_cuda(gu)
    F = shape[1] // 2
    g, u = gu[:, :F].astype(mx.float32), gu[:, F:].astype(mx.float32)
    want = np.array(nn.silu(g) * u)
    assert out.dtype == dtype and out.shape == (shape[0], F)
    ulp = {mx.float32: 1e-6, mx.bfloat16: 2**-8, mx.float16: 2**-11}[dtype]
    got = np.array(out.astype(mx.float32))
    assert np.all(np.abs(got - want) <= ulp * np.abs(want) + 1e-6)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(
    ("k", "shape"),
    [(2, (1, 3)), (6, (8, 2, 256)), (18, (3, 16, 128, 128)), (300, (2, 5)), (3, (5, 24))],
)
@pytest.mark.parametrize("offset", [0, 1])  # 1: views one element into a larger array
def test_stack_kernel_equals_mx_stack(
    k: int, shape: tuple[int, ...], dtype: mx.Dtype, offset: int
) -> None:
    """Whole 16-byte pieces a thread where the inputs allow (every shape but (1, 3) and
    (2, 5)), element by element where an input's start is not aligned (`offset`)."""
    keys = mx.random.split(mx.random.key(2), k)
    size = int(np.prod(shape))
    arrays = [
        mx.random.normal((size + offset,), key=keys[i]).astype(dtype)[offset:].reshape(shape)
        for i in range(k)
    ]
    got = stack_cuda.stack(arrays)
    assert got.shape == (k, *shape) and got.dtype == dtype
    assert bool(mx.array_equal(got, mx.stack(arrays)))


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_fused_swiglu_and_stack_match_the_portable_path(
    make_model: Callable[..., Path], preset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_model(preset, quant="f32")
    monkeypatch.setenv("SLOTSERVE_FUSED_SWIGLU", "0")
    monkeypatch.setenv("SLOTSERVE_FUSED_STACK", "0")
    portable = two_steps(path)
    monkeypatch.setenv("SLOTSERVE_FUSED_SWIGLU", "1")
    monkeypatch.setenv("SLOTSERVE_FUSED_STACK", "1")
    assert_as_close_as(two_steps(path), portable, on_cpu(path))
