"""Each row's argmax by many blocks a row (`argmax_cuda`, SLOTSERVE_ARGMAX=1) against MLX's,
on MLX's CUDA backend only: every row count and dtype, ties (the first index), rows of
-inf, NaN (the first wins, as in MLX's), widths that leave a last block part-filled, launch after launch (each leaves its
arrival counts at zero for the next)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.kernels import argmax_cuda
from engine.kernels.cuda import available

pytestmark = pytest.mark.skipif(not available(), reason="needs MLX's CUDA backend")


@pytest.fixture(autouse=True)
def switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(argmax_cuda.ENV, "1")
    assert argmax_cuda.enabled()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("V", [248320, 32000, 4097, 100])
def test_argmax_rows_is_mlx_s(dtype: mx.Dtype, V: int) -> None:
    rng = np.random.default_rng(V)
    for R in (1, 3, 8, 64, 1, 8):  # (again: the counts were left at zero)
        x = rng.normal(size=(R, V)).astype(np.float32)
        x[:, rng.integers(0, V, 3)] = 9.0  # ties between blocks and within one
        x[0, :] = -np.inf if R > 2 else x[0, :]
        logits = mx.array(x).astype(dtype)
        got = argmax_cuda.argmax_rows(logits)
        assert got.dtype == mx.uint32 and got.shape == (R,)
        assert got.tolist() == mx.argmax(logits, axis=-1).tolist(), (R, V)


def test_the_first_nan_is_the_argmax_as_with_mlx() -> None:
    x = np.zeros((6, 9000), dtype=np.float32)
    x[0, :5] = np.nan  # NaNs at the start: the first
    x[1, 7000] = 1.0
    x[1, 100] = np.nan  # a NaN below a greater value's index
    x[2, :] = np.nan
    x[3, 3] = np.inf
    x[3, 8000] = np.nan  # NaN above +inf, in a later block
    x[4, :] = -np.inf
    x[4, 6000] = np.nan
    x[5, 10] = 5.0
    x[5, 4099] = x[5, 4100] = np.nan  # two NaNs in two blocks: the first
    want = [0, 100, 0, 8000, 6000, 4099]
    assert np.argmax(x, axis=-1).tolist() == want
    for dtype in (mx.float32, mx.bfloat16, mx.float16):
        logits = mx.array(x).astype(dtype)
        assert mx.argmax(logits, axis=-1).tolist() == want
        assert argmax_cuda.argmax_rows(logits).tolist() == want, dtype
