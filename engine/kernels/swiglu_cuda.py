"""SwiGLU's `silu(gate) * up` from the joined gate|up projection as ONE CUDA kernel.

The FFN runs its gate and up projections as one matmul `[N, 2F]`, whose halves are strided
views. MLX's fused elementwise kernel keeps that stride in its output, and the down
projection's matmul then copies it contiguous: two launches per layer, where this kernel
writes the contiguous product in one. f32 arithmetic, one rounding to the model's dtype
(the portable ops round after the SiLU too); tests compare the two.
"""

from __future__ import annotations

import mlx.core as mx

from engine.kernels.cuda import cached_kernel, switched_on

_SOURCE = """
    const long i = long(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= long(gu_shape[0]) * F) return;
    const long n = i / F, j = i % F;
    const float g = static_cast<float>(gu[n * 2 * F + j]);
    const float u = static_cast<float>(gu[n * 2 * F + F + j]);
    out[i] = static_cast<T>(g / (1.0f + expf(-g)) * u);
"""


def enabled() -> bool:
    """On MLX's CUDA backend, unless SLOTSERVE_FUSED_SWIGLU=0."""
    return switched_on("SWIGLU")


def swiglu_cuda(gu: mx.array) -> mx.array:
    """`gu` `[N, 2F]` (gate, then up): returns `silu(gate) * up` `[N, F]` in `gu`'s dtype."""
    N, F2 = gu.shape
    if F2 % 2:
        raise ValueError(f"swiglu_cuda: odd joined width {F2}")
    F = F2 // 2
    kernel = cached_kernel("swiglu", "", ["gu"], ["out"], _SOURCE)
    block = 256
    (out,) = kernel(
        inputs=[gu],
        template=[("T", gu.dtype), ("F", F)],
        grid=(-(-(N * F) // block) * block, 1, 1),
        threadgroup=(block, 1, 1),
        output_shapes=[(N, F)],
        output_dtypes=[gu.dtype],
    )
    return out
