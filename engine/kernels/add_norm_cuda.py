"""Residual add and RMSNorm as ONE CUDA kernel: `h = x + m`, `a = rms_norm(h) * w`.

Every decoder layer adds its mixer's output to the residual stream and normalises the sum
for its FFN, and adds the FFN's output and normalises for the next layer (or the LM head):
two MLX operations each time, four per layer, each with a fixed launch cost that dwarfs
its work at small batch on MLX's CUDA backend. One block per row: the block writes the
sum in the stream's dtype, reduces the squares of those rounded values (what the portable
`h = x + m; mx.fast.rms_norm(h, w)` normalises) in f32 and writes the normalised row.
"""

from __future__ import annotations

import mlx.core as mx

from engine.kernels.cuda import cached_kernel, switched_on

_SOURCE = """
    constexpr int ITEMS = (E + BLOCK - 1) / BLOCK;
    const long row = blockIdx.x;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    __shared__ float partial[BLOCK / 32];
    // Every load before any store: the compiler cannot tell h or a from x, m or w, so a load
    // after a store waits for it — one memory round trip per item, ~13 us for a 4096-wide row.
    float xv[ITEMS], mv[ITEMS], wv[ITEMS];
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = tid + i * BLOCK;
        xv[i] = j < E ? static_cast<float>(x[row * E + j]) : 0.0f;
        mv[i] = j < E ? static_cast<float>(m[row * E + j]) : 0.0f;
        wv[i] = j < E ? static_cast<float>(w[j]) : 0.0f;
    }
    float hv[ITEMS];  // the row's sum stays in registers between the two passes
    float ss = 0.0f;
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = tid + i * BLOCK;
        hv[i] = 0.0f;
        if (j < E) {
            const T s = static_cast<T>(xv[i] + mv[i]);
            h[row * E + j] = s;
            hv[i] = static_cast<float>(s);
            ss += hv[i] * hv[i];
        }
    }
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, off);
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        ss = lane < BLOCK / 32 ? partial[lane] : 0.0f;
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, off);
        if (lane == 0) partial[0] = ss;
    }
    __syncthreads();
    const float inv = rsqrtf(partial[0] / E + EPS);
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = tid + i * BLOCK;
        if (j < E) a[row * E + j] = static_cast<T>(hv[i] * inv * wv[i]);
    }
"""


def enabled() -> bool:
    """On MLX's CUDA backend, unless SLOTSERVE_FUSED_ADD_NORM=0."""
    return switched_on("ADD_NORM")


def add_rms_norm_cuda(
    x: mx.array, m: mx.array, w: mx.array, eps: float
) -> tuple[mx.array, mx.array]:
    """`x`, `m` `[N, E]` of one dtype, `w` `[E]`: returns (`x + m`, its RMSNorm times `w`)."""
    N, E = x.shape
    if m.shape != x.shape or m.dtype != x.dtype or w.shape != (E,):
        raise ValueError(f"add_rms_norm_cuda: x {x.shape} {x.dtype}, m {m.shape} {m.dtype}")
    kernel = cached_kernel(
        "add_rms_norm",
        repr(eps),
        ["x", "m", "w"],
        ["h", "a"],
        f"    constexpr float EPS = {eps!r}f;\n" + _SOURCE,
    )
    block = 1024 if E >= 4096 else 256 if E >= 1024 else 128  # <= 4 items a thread at 4096
    h, a = kernel(
        inputs=[x, m, w.astype(mx.float32)],
        template=[("T", x.dtype), ("E", E), ("BLOCK", block)],
        grid=(N * block, 1, 1),
        threadgroup=(block, 1, 1),
        output_shapes=[(N, E), (N, E)],
        output_dtypes=[x.dtype, x.dtype],
    )
    return h, a
