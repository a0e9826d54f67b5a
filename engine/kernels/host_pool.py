"""A step's token ids to the GPU and back through MLX's small-block pool
(SLOTSERVE_HOST_POOL: on by default since session 22; "0" for plain arrays).

MLX's CUDA backend keeps host-made arrays, and device arrays once the host has read them, in
managed memory, and its buffer cache hands a freed buffer to the next request of its size
whatever memory it is. A kernel that touches a page the host touched last waits for it to
move: in 8-row decode steps on the H200 the step's first kernel took 70-144 us (session 21).
With this path on, that wait was gone: no slow kernel, 1.69 against 1.79 ms of kernels and
3.09 against 3.44 ms a step (session 22, docs/PERFORMANCE.md; the cause remains a
hypothesis this agrees with). Arrays of 8 bytes or fewer come from a pool of their own that the
GPU maps where it lies and that never feeds the general cache; one row's ids (4 bytes)
never waited. So, with the switch on, both ways in 8-byte pieces:

* `ids(values)`, `array(values, dtype)`: the host's values (4-byte ints or floats) as
  arrays of two, joined on the device by one stack launch (`stack_cuda.stack`);
* `to_host(array)`: a 1-D array of 4-byte values copied by one kernel into arrays of two,
  which the host reads — the array itself is never read, so its buffer stays device memory.

Counts are rounded up to a power of two (a kernel per count: a few, not one per length);
up to `MAX_VALUES` values, longer ones (a prefill's tokens, a step of more rows) as plain
arrays: at 32 rows the pieces lost tokens/s to plain arrays in two rounds of two on the
H200 (9,571 vs 10,336 and 9,182 vs 11,922 tok/s; session 24, docs/PERFORMANCE.md), where at
8 rows they had won.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from engine.kernels import cuda, stack_cuda

ENV = "SLOTSERVE_HOST_POOL"
MAX_VALUES = 16


def enabled() -> bool:
    """Whether step ids go both ways in 8-byte pieces: on MLX's CUDA backend unless
    SLOTSERVE_HOST_POOL=0 (read at the call: tools and tests replace `cuda.available`)."""
    return cuda.env_flag(ENV, "1") and cuda.available()


def _pieces(n: int) -> int:
    """Arrays of two values for `n` values: a power of two (a kernel per count)."""
    return 1 << (-(-n // 2) - 1).bit_length()


def ids(values: list[int]) -> mx.array:
    """`mx.array(values, dtype=mx.int32)`, made from 8-byte pieces where `enabled()` (3 to
    `MAX_VALUES` values; fewer are 8 bytes already)."""
    return array(values, mx.int32)


def array(values: Sequence[float], dtype: mx.Dtype) -> mx.array:
    """`mx.array(values, dtype=dtype)` for a 4-byte `dtype` (int32, uint32, float32), made
    from 8-byte pieces as `ids` makes ids (a step's uniforms for its sampled rows, say)."""
    n = len(values)
    if not (2 < n <= MAX_VALUES and dtype.size == 4 and enabled()):
        return mx.array(list(values), dtype=dtype)
    padded = [*values, *[0] * (2 * _pieces(n) - n)]
    parts = [mx.array(padded[i : i + 2], dtype=dtype) for i in range(0, len(padded), 2)]
    return stack_cuda.stack(parts).reshape(-1)[:n]


# Thread i copies value i into its pair's array (a kernel's outputs are separate pointers).
_SPLIT = """
    const int i = threadIdx.x;
    if (i >= x_shape[0]) return;
    switch (i >> 1) {{
{cases}
    }}
"""


def _split_kernel(k: int) -> Any:
    """The kernel copying up to 2k values into k arrays of two (`cuda.cached_kernel`'s, so
    tools that replace kernels see it)."""
    return cuda.cached_kernel("host_pieces", str(k), ["x"], *_split_source(k))


@functools.cache
def _split_source(k: int) -> tuple[list[str], str]:
    """`_split_kernel`'s output names and source, made once a count, not at every read-back."""
    cases = "\n".join(f"        case {j}: o{j}[i & 1] = x[i]; break;" for j in range(k))
    return [f"o{j}" for j in range(k)], _SPLIT.format(cases=cases)


def to_host(array: mx.array) -> np.ndarray:
    """`np.array(array)`; where `enabled()`, a 1-D array of 3 to `MAX_VALUES` 4-byte values
    is read through 8-byte copies made by one kernel (the array's own buffer untouched by
    the host)."""
    n = array.size
    if not (array.ndim == 1 and array.itemsize == 4 and 2 < n <= MAX_VALUES and enabled()):
        return np.array(array)
    k = _pieces(n)
    parts = _split_kernel(k)(
        inputs=[array],
        template=[("T", array.dtype)],
        grid=(2 * k, 1, 1),
        threadgroup=(2 * k, 1, 1),
        output_shapes=[(2,)] * k,
        output_dtypes=[array.dtype] * k,
    )
    mx.eval(parts)
    return np.concatenate([np.array(p) for p in parts])[:n]
