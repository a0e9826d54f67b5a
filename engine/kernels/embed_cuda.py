"""A quantized embedding lookup as ONE CUDA kernel: gather the rows of the tokens and
dequantize them in the same pass.

Through MLX ops a lookup in an affine-quantized table is three gathers (the packed words,
the scales, the biases) and a dequantize: four launches before the first layer of every
step (a session 10 timeline put them at ~113 us of the 9B's ~4.5 ms one-row step; with
decode-ahead, replacing them changed the 9B's tokens/s by nothing measurable: 227 / 231
against 226, docs/PERFORMANCE.md session 14). Here each thread reads one packed word of
one token's row, the group's scale and bias, and writes the word's elements, computed as
MLX's dequantize computes them (`scale * T(q) + bias` in the scales' type), so the rows are
bit-identical to the portable ops'.
"""

from __future__ import annotations

import mlx.core as mx

from engine.gguf import QuantizedWeight
from engine.kernels.cuda import cached_kernel, switched_on

_SOURCE = """
    const long words = weight_shape[1];        // packed words in a row
    const long groups = scales_shape[1];       // groups in a row
    const long i = long(blockIdx.x) * blockDim.x + threadIdx.x;  // (token, word)
    if (i >= long(tokens_shape[0]) * words) return;
    const long n = i / words;
    const long w = i - n * words;
    const long row = long(tokens[n]);
    const uint32_t packed = weight[row * words + w];
    constexpr int per_word = 32 / BITS;
    const long first = w * per_word;           // the word's first element in its row
    const long g = first / GROUP;              // a word never spans two groups
    const T scale = scales[row * groups + g];
    const T bias = biases[row * groups + g];
    T* to = out + n * (words * per_word) + first;
    #pragma unroll
    for (int j = 0; j < per_word; ++j) {
        const uint32_t q = (packed >> (BITS * j)) & ((1u << BITS) - 1u);
        to[j] = scale * static_cast<T>(q) + bias;
    }
"""


def enabled() -> bool:
    """On MLX's CUDA backend, unless SLOTSERVE_FUSED_EMBED=0."""
    return switched_on("EMBED")


def supported(w: QuantizedWeight) -> bool:
    """Whether the kernel serves this table: bits that pack whole elements into a word
    (2, 4, 8; what our GGUF repacks make are 4 and 8) and groups of whole words."""
    per_word = 32 // w.bits if w.bits in (2, 4, 8) else 0
    return per_word > 0 and w.group_size % per_word == 0


def lookup(w: QuantizedWeight, tokens: mx.array) -> mx.array:
    """`mx.dequantize(w.weight[tokens], w.scales[tokens], w.biases[tokens], ...)` for
    `tokens` int32 `[N]`: the rows `[N, in]` in the scales' dtype. One launch on CUDA; there
    the token ids are not bounds-checked (neither are a gather's)."""
    if not enabled() or not supported(w) or tokens.ndim != 1 or tokens.size == 0:
        return mx.dequantize(
            w.weight[tokens],
            w.scales[tokens],
            w.biases[tokens],
            group_size=w.group_size,
            bits=w.bits,
        )
    # int32 always: MLX names a compiled kernel by its template arguments, not its inputs'
    # types, so a second index type would run the first one's code.
    tokens = tokens.astype(mx.int32)
    kernel = cached_kernel("embed", "", ["tokens", "weight", "scales", "biases"], ["out"], _SOURCE)
    N, words = tokens.shape[0], w.weight.shape[1]
    threads = N * words
    block = 256
    (out,) = kernel(
        inputs=[tokens, w.weight, w.scales, w.biases],
        template=[("T", w.scales.dtype), ("BITS", w.bits), ("GROUP", w.group_size)],
        grid=(-(-threads // block) * block, 1, 1),
        threadgroup=(block, 1, 1),
        output_shapes=[(N, words * (32 // w.bits))],
        output_dtypes=[w.scales.dtype],
    )
    return out
