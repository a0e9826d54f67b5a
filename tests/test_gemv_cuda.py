"""The decode-sized matmul kernel (`engine.kernels.gemv_cuda`) against f32 matmuls of the
dequantized (or float) weights, on MLX's CUDA backend only: the kernel alone over the
shapes a model meets, the routing in `matmul`, and a real quantized model through both
paths."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gpu_paths import assert_as_close_as, on_cpu, two_steps

from engine.gguf import QuantizedWeight
from engine.kernels import gemv_cuda
from engine.kernels.cuda import available
from engine.models.weights import matmul

pytestmark = pytest.mark.skipif(not available(), reason="needs MLX's CUDA backend")

SHAPES = [(1, 1024, 1000), (3, 4096, 4100), (8, 1024, 12288), (5, 12288, 64), (2, 64, 5)]


def _quantized(N: int, K: int, bits: int, dtype: mx.Dtype) -> QuantizedWeight:
    w = mx.random.normal((N, K), key=mx.random.key(N + K + bits)) / np.sqrt(K)
    q, s, b = mx.quantize(w, group_size=32, bits=bits)
    return QuantizedWeight(q, s.astype(dtype), b.astype(dtype), bits, 32, (N, K))


def _x(R: int, K: int, dtype: mx.Dtype) -> mx.array:
    return mx.random.normal((R, K), key=mx.random.key(R * K)).astype(dtype)


def _close(got: mx.array, want: np.ndarray, dtype: mx.Dtype) -> None:
    """Within the output's rounding (and f32 summation order) of the f32 product, relative
    to the product's scale: a wrong element, group or row is off by O(1)."""
    tol = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}[dtype]
    err = np.abs(np.array(got.astype(mx.float32)) - want).max()
    assert err <= tol * max(np.abs(want).max(), 1.0), err


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_quantized_model_through_the_kernel_matches_the_portable_path(
    make_model: Callable[..., Path], quant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """First in the file: the kernel tests below build a kernel variant each (NVRTC), and
    a time-limited GPU run should reach the model through both paths before them."""
    path = make_model("tiny", quant=quant)
    monkeypatch.setenv("SLOTSERVE_FUSED_GEMV", "0")
    portable = two_steps(path)
    monkeypatch.setenv("SLOTSERVE_FUSED_GEMV", "1")
    assert_as_close_as(two_steps(path), portable, on_cpu(path))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("R", "K", "N"), SHAPES)
def test_quantized_gemv_matches_the_dequantized_product(
    R: int, K: int, N: int, bits: int, dtype: mx.Dtype
) -> None:
    w, x = _quantized(N, K, bits, dtype), _x(R, K, dtype)
    assert gemv_cuda.fits(x, w)
    got = gemv_cuda.gemv_cuda(x, w)
    assert got.shape == (R, N) and got.dtype == dtype
    want = np.array(x.astype(mx.float32) @ w.dequantize().astype(mx.float32).T)
    _close(got, want, dtype)


@pytest.mark.parametrize(
    ("outs", "unroll", "split"), [(1, 1, 1), (2, 4, 2), (4, 2, 4), (8, 1, 3), (4, 1, 8)]
)
@pytest.mark.parametrize("bits", [8, 4, 16])
def test_every_tuning_of_the_kernel_computes_the_same_product(
    outs: int, unroll: int, split: int, bits: int
) -> None:
    """Rounds past K's end (3584 = 7 warp-rounds of 512 8-bit values, shared unevenly by a
    block's warps) and outputs past N's end."""
    R, K, N = 3, 3584, 4100
    x = _x(R, K, mx.bfloat16)
    if bits == 16:
        w: QuantizedWeight | mx.array = (mx.random.normal((N, K)) / np.sqrt(K)).astype(x.dtype)
        ref = w.astype(mx.float32)  # type: ignore[union-attr]
    else:
        w = _quantized(N, K, bits, mx.bfloat16)
        ref = w.dequantize().astype(mx.float32)
    got = gemv_cuda.gemv_cuda(x, w, outs, unroll, split)
    _close(got, np.array(x.astype(mx.float32) @ ref.T), mx.bfloat16)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize(("R", "K", "N"), SHAPES)
def test_float_gemv_matches_the_product(R: int, K: int, N: int, dtype: mx.Dtype) -> None:
    w = (mx.random.normal((N, K), key=mx.random.key(7)) / np.sqrt(K)).astype(dtype)
    x = _x(R, K, dtype)
    got = gemv_cuda.gemv_cuda(x, w)
    want = np.array(x.astype(mx.float32) @ w.astype(mx.float32).T)
    _close(got, want, dtype)


def test_leading_dims_are_kept_and_big_batches_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _quantized(300, 256, 8, mx.bfloat16)
    x = _x(6, 256, mx.bfloat16).reshape(2, 3, 256)
    got = matmul(x, w)
    assert got.shape == (2, 3, 300)
    assert bool(mx.array_equal(got, gemv_cuda.gemv_cuda(x.reshape(6, 256), w).reshape(2, 3, 300)))
    big = _x(gemv_cuda.MAX_ROWS + 1, 256, mx.bfloat16)
    assert not gemv_cuda.fits(big, w)
    ref = mx.quantized_matmul(big, w.weight, w.scales, w.biases, group_size=32, bits=8)
    assert bool(mx.array_equal(matmul(big, w), ref))
    # 8 rows of a matrix this wide: MLX's kernel is the faster one (measured), so it runs
    wide, eight = _quantized(16384, 256, 8, mx.bfloat16), _x(gemv_cuda.MAX_ROWS, 256, mx.bfloat16)
    assert gemv_cuda.fits(eight, wide) and not gemv_cuda.preferred(eight, wide)
    ref = mx.quantized_matmul(eight, wide.weight, wide.scales, wide.biases, group_size=32, bits=8)
    assert bool(mx.array_equal(matmul(eight, wide), ref))
    monkeypatch.setenv("SLOTSERVE_FUSED_GEMV", "0")
    ref = mx.quantized_matmul(x, w.weight, w.scales, w.biases, group_size=32, bits=8)
    assert bool(mx.array_equal(matmul(x, w), ref))


def test_layouts_the_kernel_cannot_read_are_refused() -> None:
    x = _x(1, 40, mx.float32)  # a float row needs whole 16-byte loads only: 40 f32 = 160 bytes
    w = mx.zeros((4, 40))
    assert gemv_cuda.fits(x, w)
    assert not gemv_cuda.fits(_x(1, 36, mx.bfloat16), mx.zeros((4, 36), dtype=mx.bfloat16))
    assert not gemv_cuda.fits(_x(1, 32, mx.float32), _quantized(4, 64, 8, mx.float32))  # K
    assert not gemv_cuda.fits(x, w.astype(mx.bfloat16))  # mixed dtypes
    with pytest.raises(ValueError, match="does not fit"):
        gemv_cuda.gemv_cuda(_x(9, 64, mx.float32), mx.zeros((4, 64)))


def test_float_products_take_the_kernel_as_the_dense_mode_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SLOTSERVE_FUSED_GEMV_DENSE: "0" (default) leaves float products to MLX, "rows" sends
    those of 2 to 8 rows here, "1" every one that fits; what `matmul` then returns is the
    kernel's product exactly."""
    w = (mx.random.normal((300, 256), key=mx.random.key(3)) / 16).astype(mx.bfloat16)
    one, four, nine = (_x(r, 256, mx.bfloat16) for r in (1, 4, gemv_cuda.MAX_ROWS + 1))
    monkeypatch.delenv(gemv_cuda.DENSE_ENV, raising=False)
    assert not any(gemv_cuda.dense_takes(x, w) for x in (one, four, nine))
    monkeypatch.setenv(gemv_cuda.DENSE_ENV, "rows")
    assert [gemv_cuda.dense_takes(x, w) for x in (one, four, nine)] == [False, True, False]
    assert bool(mx.array_equal(matmul(four, w), gemv_cuda.gemv_cuda(four, w)))
    monkeypatch.setenv(gemv_cuda.DENSE_ENV, "1")
    assert [gemv_cuda.dense_takes(x, w) for x in (one, four, nine)] == [True, True, False]
    assert bool(mx.array_equal(matmul(one, w), gemv_cuda.gemv_cuda(one, w)))
    monkeypatch.setenv(gemv_cuda.DENSE_ENV, "yes")
    with pytest.raises(ValueError, match="SLOTSERVE_FUSED_GEMV_DENSE"):
        gemv_cuda.dense_takes(four, w)
    monkeypatch.setenv("SLOTSERVE_FUSED_GEMV", "0")  # the kernel off: nothing takes it
    monkeypatch.setenv(gemv_cuda.DENSE_ENV, "1")
    assert not gemv_cuda.dense_takes(four, w)
