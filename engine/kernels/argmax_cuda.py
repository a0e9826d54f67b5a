"""Each row's argmax of a step's logits `[R, V]` as ONE CUDA kernel of many blocks a row.

MLX's argmax reduces a row in one block: on the H200 a 0.8B decode step's (V = 248,320)
took 24.7 us at one row and 27.7 at eight, one multiprocessor of 132 reading the row
(session 20-21 timelines) — 1-2% of a step, on the path from the LM head to the next
step's first kernel under decode-ahead. Here `CH` values of a row go to each block (60-odd
blocks a row); each block writes its best (value, index) to `part`, and the last block of
a row to arrive (an arrival count a row, `cuda.arrival_counts`, reset by it) combines the
row's in block order.

MLX's argmax exactly (its CUDA and CPU backends, as numpy's): NaN ranks above every number,
so a row's first NaN is its argmax; otherwise the greatest value, the first index of equals;
a row of -inf gives 0. (Session 21 had it that NaN never wins; on the H200 MLX's first NaN
won, session 22.)
"""

from __future__ import annotations

import mlx.core as mx

from engine.kernels import cuda

ENV = "SLOTSERVE_ARGMAX"
CH = 4096  # values of a row a block takes
NT = 256  # threads a block

# (best, at) against (v, i): whether (v, i) wins — NaN above every number, then greater,
# then equal at a smaller index
_SOURCE = (
    """
    const long V = x_shape[1];
    const int r = blockIdx.y, nb = gridDim.x;
    const long lo = long(blockIdx.x) * CH;
    const long hi = lo + CH < V ? lo + CH : V;
    auto wins = [](float v, unsigned i, float best, unsigned at) {
        if (isnan(best)) return isnan(v) && i < at;
        return isnan(v) || v > best || (v == best && i < at);
    };
    const float NEG_INF = __int_as_float(0xff800000);
    float best = NEG_INF;
    unsigned at = unsigned(lo);
    for (long i = lo + threadIdx.x; i < hi; i += NT) {  // in order: the first of equals kept
        const float v = static_cast<float>(x[long(r) * V + i]);
        if (wins(v, unsigned(i), best, at)) { best = v; at = unsigned(i); }
    }
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float v = __shfl_down_sync(0xffffffff, best, off);
        const unsigned i = __shfl_down_sync(0xffffffff, at, off);
        if (wins(v, i, best, at)) { best = v; at = i; }
    }
    __shared__ float wv[NT / 32];
    __shared__ unsigned wi[NT / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { wv[warp] = best; wi[warp] = at; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < NT / 32; ++w)
            if (wins(wv[w], wi[w], best, at)) { best = wv[w]; at = wi[w]; }
        part[long(r) * nb + blockIdx.x] = best;
        part_at[long(r) * nb + blockIdx.x] = at;
    }
"""
    + cuda.arrival("r", "nb")
    + """\
    if (threadIdx.x == 0) {  // the row's last block: the blocks' bests, in block order
        best = NEG_INF;
        at = 0;
        for (int b = 0; b < nb; ++b) {
            const float v = __ldcg(part + long(r) * nb + b);
            const unsigned i = __ldcg(part_at + long(r) * nb + b);
            if (wins(v, i, best, at)) { best = v; at = i; }
        }
        out[r] = at;
    }
"""
)


def enabled() -> bool:
    """On MLX's CUDA backend with SLOTSERVE_ARGMAX=1 ("0", the default, until its NaN fix has
    passed on a GPU: MLX's own argmax)."""
    return cuda.env_flag(ENV) and cuda.available()  # (read at the call: tools replace it)


def argmax_rows(logits: mx.array) -> mx.array:
    """`mx.argmax(logits, axis=-1)` (uint32, as MLX's); for 2-D float logits in one launch of
    many blocks a row where `enabled()`."""
    floats = (mx.bfloat16, mx.float16, mx.float32)
    if not (enabled() and logits.ndim == 2 and logits.dtype in floats):
        return mx.argmax(logits, axis=-1)
    R, V = logits.shape
    blocks = -(-V // CH)
    kernel = cuda.cached_kernel("argmax", "", ["x", "counts"], ["out", "part", "part_at"], _SOURCE)
    out, _, _ = kernel(
        inputs=[logits, cuda.arrival_counts(R)],
        template=[("T", logits.dtype), ("CH", CH), ("NT", NT)],
        grid=(blocks * NT, R, 1),
        threadgroup=(NT, 1, 1),
        output_shapes=[(R,), (R, blocks), (R, blocks)],
        output_dtypes=[mx.uint32, mx.float32, mx.uint32],
    )
    return out
