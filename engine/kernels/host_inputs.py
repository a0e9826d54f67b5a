"""A step's small host-made inputs (token ids, positions, token coordinates, the chain's
uniforms) put on the GPU inside a kernel launch, so that no kernel reads memory the host wrote.

MLX's CUDA backend makes an array from host values in managed memory, and the first kernel
that reads it waits while its pages move to the GPU: an 8-row embedding gather of host-written
ids took 115-181 us in every H200 timeline since session 18 (3 us for one row, 2 us for ids
the device made), and the same ids made from 8-byte arrays (the allocator's small-block pool)
and joined by a stack kernel moved the wait into the stack (116 us, session 21) — the pool's
pages are managed memory too. What the host can hand a kernel without memory is its launch
parameters: here a kernel whose parameters are the values, one 4-byte parameter each, writes
them to an array the allocator places in device memory (outputs of over 8 bytes on a stream).

The kernel is PTX made here (`mx.fast.precompiled_cuda_kernel`; the values are its `scalars`,
appended after the output's pointer), one per count of values rounded up to a power of two
from `MIN_VALUES` to `MAX_VALUES`: a handful of kernels, not one per length. More values than
that (a prefill chunk's tokens) come as an array: a launch's parameters are capped (4 KB on
older drivers), and the wait is small beside such a step's work.
"""

from __future__ import annotations

import hashlib
from typing import Any

import mlx.core as mx
import numpy as np

from engine.kernels import cuda

PARAMS_ENV = "SLOTSERVE_HOST_PARAMS"
MIN_VALUES = 4  # 16 bytes: an output of 8 or fewer comes from the managed small-block pool
MAX_VALUES = 256  # 1 KB of parameters
_KINDS = {mx.int32: ("s32", int), mx.float32: ("f32", float)}

# One thread stores each parameter in turn (a kernel cannot index its parameters): at most
# 256 loads and stores, well under a launch's own cost.
_PTX = """\
.version 7.0
.target sm_75
.address_size 64

.visible .entry {name}(
\t.param .u64 out,
{params}
)
{{
\t.reg .b32 %v;
\t.reg .b64 %rd<2>;
\tld.param.u64 %rd0, [out];
\tcvta.to.global.u64 %rd1, %rd0;
{stores}\tret;
}}
"""


def _source(count: int) -> tuple[str, bytes]:
    """The kernel for `count` values: its entry name and its PTX. The name carries a hash of
    the code (as `cuda.kernel_name` does), so no other version's kernel is ever taken for it."""
    params = ",\n".join(f"\t.param .b32 v{i}" for i in range(count))
    stores = "".join(
        f"\tld.param.b32 %v, [v{i}];\n\tst.global.b32 [%rd1+{4 * i}], %v;\n" for i in range(count)
    )
    body = _PTX.format(name="@NAME@", params=params, stores=stores)
    name = f"slotserve_host_values_{count}_{hashlib.sha256(body.encode()).hexdigest()[:16]}"
    return name, body.replace("@NAME@", name).encode()


_sources: dict[int, tuple[str, bytes]] = {}


def params_on() -> bool:
    """Whether `from_host` passes values as launch parameters (SLOTSERVE_HOST_PARAMS: "0",
    the default until the H200 has timed it, or "1"); only where MLX computes on CUDA."""
    return cuda.env_flag(PARAMS_ENV) and cuda.available()


def from_host(
    values: list[Any] | tuple[Any, ...] | np.ndarray, dtype: mx.Dtype, params: bool | None = None
) -> mx.array:
    """`mx.array(values, dtype)` for a step's small 1-D input; with `params` (default
    `params_on()`) int32 or float32 values of 1 to `MAX_VALUES` come as a kernel's launch
    parameters, written by it to device memory (a view of the first `len(values)`). Lists
    are of numbers; an array of more dimensions is made as `mx.array` makes it."""
    n = len(values)
    kind = _KINDS.get(dtype)
    if not (
        kind is not None
        and 0 < n <= MAX_VALUES
        and (not isinstance(values, np.ndarray) or values.ndim == 1)
        and (params_on() if params is None else params)
    ):
        return mx.array(values, dtype=dtype)
    count = max(MIN_VALUES, 1 << (n - 1).bit_length())
    name, ptx = _sources.get(count) or _sources.setdefault(count, _source(count))
    cast = kind[1]
    listed = values.tolist() if isinstance(values, np.ndarray) else values
    scalars = [cast(v) for v in listed] + [cast(0)] * (count - n)
    (out,) = mx.fast.precompiled_cuda_kernel(
        name=name,
        compiled_source=ptx,
        inputs=[],
        output_shapes=[(count,)],
        output_dtypes=[dtype],
        scalars=scalars,
        grid=(1, 1, 1),
        threadgroup=(1, 1, 1),
    )
    return out[:n]
