"""The fused residual-add + RMSNorm kernel against the portable ops, on MLX's CUDA backend only."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gpu_paths import assert_as_close_as, on_cpu, two_steps

from engine.kernels import add_norm_cuda
from engine.kernels.cuda import available
from engine.models.qwen35 import rms_norm

pytestmark = pytest.mark.skipif(not available(), reason="needs MLX's CUDA backend")


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("shape", [(1, 64), (3, 1024), (17, 4096), (5, 1000)])
def test_kernel_matches_add_then_rms_norm(shape: tuple[int, int], dtype: mx.Dtype) -> None:
    k = mx.random.split(mx.random.key(0), 3)
    x = (4 * mx.random.normal(shape, key=k[0])).astype(dtype)
    m = mx.random.normal(shape, key=k[1]).astype(dtype)
    w = (1 + 0.1 * mx.random.normal(shape[-1:], key=k[2])).astype(dtype)
    h, a = add_norm_cuda.add_rms_norm_cuda(x, m, w, 1e-6)
    ref_h = x + m
    ref_a = rms_norm(ref_h, w, 1e-6)
    assert h.dtype == a.dtype == dtype
    # the sum is rounded once either way (to within one unit of the last place); the norm
    # differs by summation order and where the weight is applied
    ulp = {mx.float32: 2**-23, mx.bfloat16: 2**-7, mx.float16: 2**-10}[dtype]
    got_h, want_h = np.array(h.astype(mx.float32)), np.array(ref_h.astype(mx.float32))
    assert np.all(np.abs(got_h - want_h) <= ulp * np.abs(want_h))
    tol = {mx.float32: 1e-5, mx.bfloat16: 2e-2, mx.float16: 2e-3}[dtype]
    got, ref = np.array(a.astype(mx.float32)), np.array(ref_a.astype(mx.float32))
    assert np.abs(got - ref).max() <= tol * np.abs(ref).max()


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe", "tiny-next"])
def test_fused_add_norm_matches_the_portable_path(
    make_model: Callable[..., Path], preset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_model(preset, quant="f32")
    monkeypatch.setenv("SLOTSERVE_FUSED_ADD_NORM", "0")
    portable = two_steps(path)
    monkeypatch.setenv("SLOTSERVE_FUSED_ADD_NORM", "1")
    assert_as_close_as(two_steps(path), portable, on_cpu(path))
