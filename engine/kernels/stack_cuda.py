"""`mx.stack` of a step's per-layer states as ONE CUDA kernel.

A step returns every layer's new state stacked per kind (K, V, conv, ssm) for the pool to
store in one write each. MLX stacks with one copy kernel per input: 48 launches a step on a
24-layer model, each costing more to launch than to run at small batch. This kernel copies
all K inputs, one grid row (`blockIdx.y`) per input.
"""

from __future__ import annotations

import mlx.core as mx

from engine.kernels.cuda import cached_kernel, switched_on

_SOURCE = """
    long M = 1;  // elements per input, from its shape: one kernel serves every batch size
    for (int d = 0; d < a0_ndim; ++d) M *= a0_shape[d];
    const long i = long(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= M) return;
    const int k = blockIdx.y;
    const T* src = nullptr;
    switch (k) {{
{cases}
    }}
    out[long(k) * M + i] = src[i];
"""


def enabled() -> bool:
    """On MLX's CUDA backend, unless SLOTSERVE_FUSED_STACK=0."""
    return switched_on("STACK")


MAX_INPUTS = 256
"""Inputs one launch takes (a pointer each in the kernel's parameters, which CUDA caps at
32 KB); longer lists are stacked in chunks and joined."""


def stack(arrays: list[mx.array]) -> mx.array:
    """`mx.stack(arrays)`: one launch on CUDA for inputs of one shape and dtype (a launch per
    `MAX_INPUTS` of them, and a join, for longer lists)."""
    K = len(arrays)
    first = arrays[0]
    if (
        K < 2
        or not enabled()
        or any(a.shape != first.shape or a.dtype != first.dtype for a in arrays)
    ):
        return mx.stack(arrays)
    if K > MAX_INPUTS:
        chunks = [arrays[i : i + MAX_INPUTS] for i in range(0, K, MAX_INPUTS)]
        return mx.concatenate([stack(c) for c in chunks], axis=0)
    cases = "\n".join(f"        case {k}: src = a{k}; break;" for k in range(K))
    names = [f"a{k}" for k in range(K)]
    kernel = cached_kernel("stack", str(K), names, ["out"], _SOURCE.format(cases=cases))
    M = first.size
    block = 256
    (out,) = kernel(
        inputs=arrays,
        template=[("T", first.dtype)],
        grid=(-(-M // block) * block, K, 1),
        threadgroup=(block, 1, 1),
        output_shapes=[(K, *first.shape)],
        output_dtypes=[first.dtype],
    )
    return out
