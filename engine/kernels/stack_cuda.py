"""`mx.stack` of a step's per-layer states, and a gather from each of them, as ONE CUDA kernel.

A step returns every layer's new state stacked per kind (K, V, conv, ssm) for the pool to
store in one write each. MLX stacks with one copy kernel per input: 48 launches a step on a
24-layer model, each costing more to launch than to run at small batch. This kernel copies
all K inputs, one grid row (`blockIdx.y`) per input.

A rollback keeps some entries of every linear layer's captures (`take`): per layer a
reshape, a gather and then a stack would be 2L + 1 graph nodes, each costing the host
microseconds on the verify step's critical path; the kernel is one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from engine.kernels.cuda import cached_kernel, switched_on

_PICK = """    const int k = blockIdx.y;
    const T* src = nullptr;
    switch (k) {{
{cases}
    }}
"""  # `src`: input `a{k}` of this grid row (a switch: a kernel's inputs are separate pointers)

# Each thread copies V consecutive elements (V = 16 bytes' worth where an input holds whole
# 16-byte pieces, else 1), as one 16-byte load and store where both ends are aligned. (One
# element a thread moved the 0.8B's 8-row recurrent states, 151 MB each way, in 165 us on
# the H200, ~1.8 TB/s: the largest kernel of a wide step after the products, session 18.)
_SOURCE = """
    long M = 1;  // elements per input, from its shape: one kernel serves every batch size
    for (int d = 0; d < a0_ndim; ++d) M *= a0_shape[d];
    const long i = (long(blockIdx.x) * blockDim.x + threadIdx.x) * V;  // this thread's first
    if (i >= M) return;
{pick}    const T* from = src + i;
    T* to = out + long(k) * M + i;
    if (V * sizeof(T) == 16 && (reinterpret_cast<unsigned long long>(from)
            | reinterpret_cast<unsigned long long>(to)) % 16 == 0) {{
        *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
    }} else {{
        #pragma unroll
        for (int j = 0; j < V; ++j) to[j] = from[j];
    }}
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
    kernel = _kernel("stack", K, _SOURCE)
    M = first.size
    V = 16 // first.itemsize if M * first.itemsize % 16 == 0 else 1
    block = 256
    (out,) = kernel(
        inputs=arrays,
        template=[("T", first.dtype), ("V", V)],
        grid=(-(-M // V // block) * block, K, 1),
        threadgroup=(block, 1, 1),
        output_shapes=[(K, *first.shape)],
        output_dtypes=[first.dtype],
    )
    return out


# Each thread copies V consecutive elements of one entry (V = 16 bytes' worth where an entry
# holds whole 16-byte pieces, else 1): one 16-byte load and store where both ends are
# aligned, and one division per V elements. (One element a thread and a 64-bit division per
# element moved the 0.8B's kept states of 8 rows, ~150 MB each way, at under 1 TB/s on the
# H200: 375 us for a verify step's two launches, session 11.)
_TAKE_SOURCE = """
    long E = 1;  // elements per entry: the product of the axes after the first two
    for (int d = 2; d < a0_ndim; ++d) E *= a0_shape[d];
    const long n = long(index_shape[0]) * E;  // elements taken from each input
    const long i = (long(blockIdx.x) * blockDim.x + threadIdx.x) * V;  // this thread's first
    if (i >= n) return;
{pick}    const long e = i / E;
    const T* from = src + long(index[e]) * E + (i - e * E);
    T* to = out + long(k) * n + i;
    if (V * sizeof(T) == 16 && (reinterpret_cast<unsigned long long>(from)
            | reinterpret_cast<unsigned long long>(to)) % 16 == 0) {{
        *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
    }} else {{
        #pragma unroll
        for (int j = 0; j < V; ++j) to[j] = from[j];
    }}
"""


def take(arrays: list[mx.array], index: mx.array) -> mx.array:
    """`mx.stack([a.reshape(-1, *rest)[index] for a in arrays])`: for L arrays of one shape
    `[E0, E1, *rest]` and dtype and `index` int32 `[M]` of entry numbers over the first two
    axes flattened (entry e is `a.reshape(E0 * E1, *rest)[e]`), `[L, M, *rest]`. One launch
    on CUDA (a launch per `MAX_INPUTS` inputs, and a join, for longer lists); there the
    entries are not bounds-checked."""
    L = len(arrays)
    first = arrays[0]
    rest = first.shape[2:]
    if (
        not enabled()
        or index.size == 0
        or first.size == 0
        or any(a.shape != first.shape or a.dtype != first.dtype for a in arrays)
    ):
        return mx.stack([mx.take(a.reshape(-1, *rest), index, axis=0) for a in arrays])
    if L > MAX_INPUTS:
        chunks = [arrays[i : i + MAX_INPUTS] for i in range(0, L, MAX_INPUTS)]
        return mx.concatenate([take(c, index) for c in chunks], axis=0)
    # int32 always: MLX names a compiled kernel by its template arguments, not its inputs'
    # types, so a second index type would run the first one's code.
    index = index.astype(mx.int32)
    kernel = _kernel("take", L, _TAKE_SOURCE, ["index"])
    M = index.shape[0]
    E = first.size // (first.shape[0] * first.shape[1])
    V = 16 // first.itemsize if E * first.itemsize % 16 == 0 else 1
    threads = M * E // V
    block = 256
    (out,) = kernel(
        inputs=[*arrays, index],
        template=[("T", first.dtype), ("V", V)],
        grid=(-(-threads // block) * block, L, 1),
        threadgroup=(block, 1, 1),
        output_shapes=[(L, M, *rest)],
        output_dtypes=[first.dtype],
    )
    return out


def _kernel(family: str, K: int, source: str, extra: Sequence[str] = ()) -> Any:
    """`family`'s kernel for K inputs `a0`..`a{K-1}` (then `extra`), `source`'s `{pick}`
    made the switch that points `src` at the grid row's input."""
    cases = "\n".join(f"        case {k}: src = a{k}; break;" for k in range(K))
    names = [*(f"a{k}" for k in range(K)), *extra]
    return cached_kernel(
        family, str(K), names, ["out"], source.format(pick=_PICK.format(cases=cases))
    )
