"""The quantized embedding lookup kernel against the portable ops (three gathers and a
dequantize), on MLX's CUDA backend only: the kernel alone, bit for bit, and a real
quantized model through both paths."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gpu_paths import two_steps

from engine.gguf import QuantizedWeight
from engine.kernels import embed_cuda
from engine.kernels.cuda import available

pytestmark = pytest.mark.skipif(not available(), reason="needs MLX's CUDA backend")


def _table(V: int, E: int, bits: int, dtype: mx.Dtype) -> QuantizedWeight:
    w = mx.random.normal((V, E), key=mx.random.key(V + E + bits))
    q, s, b = mx.quantize(w, group_size=32, bits=bits)
    return QuantizedWeight(q, s.astype(dtype), b.astype(dtype), bits, 32, (V, E))


def _portable(w: QuantizedWeight, tokens: mx.array) -> mx.array:
    return mx.dequantize(
        w.weight[tokens], w.scales[tokens], w.biases[tokens], group_size=32, bits=w.bits
    )


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("V", "E", "N"), [(1000, 64, 1), (5003, 4096, 8), (77, 32, 70)])
def test_lookup_is_bit_identical_to_gathers_and_a_dequantize(
    V: int, E: int, N: int, bits: int, dtype: mx.Dtype
) -> None:
    w = _table(V, E, bits, dtype)
    # Repeats, both ends of the table, and an order that is not the table's.
    ids = np.random.default_rng(V + N).integers(0, V, N)
    ids[0], ids[-1] = V - 1, 0
    tokens = mx.array(ids.astype(np.int32))
    got = embed_cuda.lookup(w, tokens)
    want = _portable(w, tokens)
    assert got.shape == (N, E) and got.dtype == dtype
    assert bool(mx.array_equal(got, want))
    # The same rows gathered from a uint32 id array and inside a compiled graph.
    compiled = mx.compile(lambda t: embed_cuda.lookup(w, t))
    assert bool(mx.array_equal(compiled(tokens.astype(mx.uint32)), want))


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_quantized_model_with_the_lookup_kernel_equals_the_portable_path(
    make_model: Callable[..., Path], quant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows are bit-identical, so every logit and every byte of the pool is too."""
    path = make_model("tiny", quant=quant)
    monkeypatch.setenv("SLOTSERVE_FUSED_EMBED", "0")
    portable = two_steps(path)
    monkeypatch.setenv("SLOTSERVE_FUSED_EMBED", "1")
    fused = two_steps(path)
    for f, p in zip(fused, portable, strict=True):
        assert np.array_equal(f, p)
