"""`stack_cuda.take` against numpy, on whichever path this backend runs (the portable ops on
the CPU; on MLX's CUDA backend the kernel, in chunks past `MAX_INPUTS` arrays): every
array's entries at one index over its first two axes, stacked — exactly (a gather copies)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.kernels import stack_cuda


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("layers", [1, 18, stack_cuda.MAX_INPUTS + 44])
@pytest.mark.parametrize("shape", [(8, 8, 96), (8, 6, 4, 8, 8), (3, 5)])  # windows, states
def test_take_gathers_entries_over_the_first_two_axes_of_every_array(
    layers: int, shape: tuple[int, ...], dtype: mx.Dtype, offset: int
) -> None:
    """`offset`: every array a view one element into a larger one, so the kernel's 16-byte
    copies meet ends that are not 16-byte aligned (and copy element by element there)."""
    rng = np.random.default_rng(layers)
    size = int(np.prod(shape))
    arrays = [
        mx.array(rng.standard_normal(size + offset).astype(np.float32))
        .astype(dtype)[offset:]
        .reshape(shape)
        for _ in range(layers)
    ]
    n = shape[0] * shape[1]
    index = np.array([n - 1, 0, 7 % n, 7 % n, 2, n // 2, 1, 0], dtype=np.int32)  # repeats
    got = stack_cuda.take(arrays, mx.array(index))
    assert got.shape == (layers, len(index), *shape[2:]) and got.dtype == dtype
    want = np.stack([np.array(a.astype(mx.float32)).reshape(n, *shape[2:])[index] for a in arrays])
    assert np.array_equal(np.array(got.astype(mx.float32)), want)
