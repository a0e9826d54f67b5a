"""BENCHMARK ONLY: int32 values from the host put on the GPU as a kernel's launch parameters,
for `gpu_timeline.py --inputs params` (the engine makes them with `mx.array`).

The question it serves (docs/PERFORMANCE.md, session 21): in an 8-row decode step on the
H200 the first kernel waits 70-144 us. MLX's CUDA allocator keeps host-made arrays, and
device arrays the host has read, in managed memory, and its buffer cache hands a freed
buffer of the right size to the next request whatever memory it is: a kernel that writes a
recycled managed buffer whose pages the host touched last waits for them to move, as one
that reads a host-written input does. Session 21 made the ids from launch parameters (no
host-written input) and the wait moved to that kernel's own 32-byte output — the size of
the step's 8 argmax ids the host had read. With the ids from parameters AND the read-back
arrays kept alive (`--pin-readbacks`: never recycled), no kernel of the step should touch
host-touched pages; if the wait is gone, that is the cause.

A kernel per count of values (a power of two from 4: an output of 8 bytes or fewer would
come from MLX's small-block pool), PTX made here: one thread stores each parameter in turn.
"""

from __future__ import annotations

import hashlib

import mlx.core as mx

MIN_VALUES = 4
MAX_VALUES = 256

_PTX = """\
.version 7.0
.target sm_75
.address_size 64

.visible .entry @NAME@(
\t.param .u64 out,
@PARAMS@
)
{
\t.reg .b32 %v;
\t.reg .b64 %rd<2>;
\tld.param.u64 %rd0, [out];
\tcvta.to.global.u64 %rd1, %rd0;
@STORES@\tret;
}
"""


def source(count: int) -> tuple[str, bytes]:
    """The kernel for `count` values: its entry name (with a hash of its code) and its PTX."""
    params = ",\n".join(f"\t.param .b32 v{i}" for i in range(count))
    stores = "".join(
        f"\tld.param.b32 %v, [v{i}];\n\tst.global.b32 [%rd1+{4 * i}], %v;\n" for i in range(count)
    )
    body = _PTX.replace("@PARAMS@", params).replace("@STORES@", stores)
    name = f"slotserve_host_values_{count}_{hashlib.sha256(body.encode()).hexdigest()[:16]}"
    return name, body.replace("@NAME@", name).encode()


def int32_from_params(values: list[int]) -> mx.array:
    """`mx.array(values, dtype=mx.int32)` (1 to `MAX_VALUES` values) made on the GPU from a
    kernel's launch parameters: a view of the first `len(values)` of its output."""
    n = len(values)
    if not 0 < n <= MAX_VALUES:
        raise ValueError(f"int32_from_params: {n} values (1 to {MAX_VALUES})")
    count = max(MIN_VALUES, 1 << (n - 1).bit_length())
    name, ptx = source(count)
    (out,) = mx.fast.precompiled_cuda_kernel(
        name=name,
        compiled_source=ptx,
        inputs=[],
        output_shapes=[(count,)],
        output_dtypes=[mx.int32],
        scalars=[int(v) for v in values] + [0] * (count - n),
        grid=(1, 1, 1),
        threadgroup=(1, 1, 1),
    )
    return out[:n]
