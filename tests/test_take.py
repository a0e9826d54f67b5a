"""`stack_cuda.take` against numpy, on whichever path this backend runs (the portable ops on
the CPU, the kernel on MLX's CUDA backend): every layer's entries at one index, stacked."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.kernels import stack_cuda


@pytest.mark.parametrize("layers", [1, 3, 18])
@pytest.mark.parametrize("shape", [(8, 8, 96), (8, 6, 4, 8, 8), (3, 5)])
def test_take_gathers_entries_over_the_first_two_axes_of_every_array(
    layers: int, shape: tuple[int, ...]
) -> None:
    rng = np.random.default_rng(layers)
    arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(layers)]
    n = shape[0] * shape[1]
    # out of order, with repeats
    index = np.array([n - 1, 0, 7 % n, 7 % n, 2, n // 2, 1, 0], dtype=np.int32)
    got = stack_cuda.take([mx.array(a) for a in arrays], mx.array(index))
    want = np.stack([a.reshape(n, *shape[2:])[index] for a in arrays])
    assert got.shape == (layers, len(index), *shape[2:]) and got.dtype == mx.float32
    assert np.array_equal(np.array(got), want)
