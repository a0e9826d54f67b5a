"""A model file's weights as compute needs them: loading, and the matmuls over them.

Float matrices stay in the model's dtype, Q4_0/Q4_1/Q8_0 stay quantized in MLX's own
layout (`mx.quantized_matmul`); `Projection` fuses matrices applied to the same input
into one matmul.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import mlx.core as mx

from engine.gguf import QuantizedWeight, TensorFile, Weight
from engine.kernels import gemv_cuda


class Loader:
    """Loads a file's tensors for compute: matrices in the model's dtype (quantized ones
    stay quantized), vectors in that dtype or, with `exact`, in float32 (decay
    parameters, conv taps, router: small tensors where rounding shows)."""

    def __init__(self, f: TensorFile, dtype: mx.Dtype) -> None:
        self.file, self.dtype = f, dtype

    def has(self, name: str) -> bool:
        return self.file.has(name)

    def matrix(self, name: str, shape: tuple[int, ...]) -> Weight:
        return self.file.load(name, shape, dtype=self.dtype)

    def dense(
        self, name: str, shape: tuple[int, ...] | None = None, exact: bool = False
    ) -> mx.array:
        w = self.file.load(name, shape, dtype=mx.float32 if exact else self.dtype, quantized=False)
        assert isinstance(w, mx.array)
        return w


# id(matrix) -> (a weak reference to it, its transposed view, evaluated): see `prepare`.
_transposed: dict[int, tuple[weakref.ref[mx.array], mx.array]] = {}


def prepare(arrays: Iterable[mx.array]) -> None:
    """Make and evaluate, once, the transposed view `W.T` of every float matrix among
    `arrays`, which `matmul` then multiplies by. A view made inside a step is one more node
    of the step's graph — a Transpose per product, 97 of the 429 nodes of a 0.8B decode step
    on the H200 — and each node costs host time when a compiled step's graph is rebuilt and
    again when it is evaluated. A view shares its matrix's memory; the entry goes when the
    matrix does."""
    made = []
    for w in arrays:
        key = id(w)
        if w.ndim != 2 or key in _transposed:
            continue
        gone = weakref.ref(w, lambda _, key=key: _transposed.pop(key, None))  # type: ignore[misc]
        _transposed[key] = (gone, w.T)
        made.append(_transposed[key][1])
    mx.eval(made)


def transposed(w: mx.array) -> mx.array:
    """`w.T`: the view `prepare` made if there is one, else a new one."""
    kept = _transposed.get(id(w))
    return kept[1] if kept is not None and kept[0]() is w else w.T


def matmul(x: mx.array, w: Weight) -> mx.array:
    """`x @ W.T` for a float or quantized `(out, in)` matrix; a decode-sized x on MLX's CUDA
    backend through `engine.kernels.gemv_cuda`, which reads quantized weights faster."""
    if isinstance(w, QuantizedWeight):
        if gemv_cuda.enabled() and gemv_cuda.fits(x, w) and gemv_cuda.preferred(x, w):
            return gemv_cuda.gemv_cuda(x, w)
        return mx.quantized_matmul(
            x, w.weight, w.scales, w.biases, transpose=True, group_size=w.group_size, bits=w.bits
        )
    if gemv_cuda.dense_takes(x, w):
        return gemv_cuda.gemv_cuda(x, w)
    return x @ transposed(w)


class Projection:
    """Matrices applied to the same input, as ONE matmul when their storage allows it
    (all float, or all quantized alike): fewer, larger kernels per step."""

    def __init__(self, ld: Loader, parts: list[tuple[str, tuple[int, int]]]) -> None:
        weights = [ld.matrix(name, shape) for name, shape in parts]
        self.sizes = [shape[0] for _, shape in parts]
        self.fused = _concat_rows(weights)
        self.parts = weights if self.fused is None else []

    def joined(self, x: mx.array) -> mx.array:
        """The outputs side by side in one `[N, sum(sizes)]` array."""
        if self.fused is None:
            return mx.concatenate([matmul(x, w) for w in self.parts], axis=-1)
        return matmul(x, self.fused)

    def split(self, y: mx.array) -> list[mx.array]:
        """The matrices' outputs, each on its own, from `joined`'s array."""
        bounds = [sum(self.sizes[: i + 1]) for i in range(len(self.sizes) - 1)]
        return list(mx.split(y, bounds, axis=-1))


def _concat_rows(ws: list[Weight]) -> Weight | None:
    if all(isinstance(w, mx.array) for w in ws):
        return mx.concatenate(ws, axis=0)  # type: ignore[arg-type]
    qs = [w for w in ws if isinstance(w, QuantizedWeight)]
    if len(qs) != len(ws) or len({(q.bits, q.group_size, q.shape[1]) for q in qs}) != 1:
        return None
    q0 = qs[0]
    return QuantizedWeight(
        weight=mx.concatenate([q.weight for q in qs], axis=0),
        scales=mx.concatenate([q.scales for q in qs], axis=0),
        biases=mx.concatenate([q.biases for q in qs], axis=0),
        bits=q0.bits,
        group_size=q0.group_size,
        shape=(sum(q.shape[0] for q in qs), q0.shape[1]),
    )


def expert_matmul(x: mx.array, w: Weight, idx: mx.array) -> mx.array:
    """Per-token expert matmul: x `[N, 1, 1, in]`, w `(n_exp, out, in)`, idx `[N, k]` -> `[N, k, 1, out]`."""
    if isinstance(w, QuantizedWeight):
        return mx.gather_qmm(
            x,
            w.weight,
            w.scales,
            w.biases,
            rhs_indices=idx,
            transpose=True,
            group_size=w.group_size,
            bits=w.bits,
        )
    return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=idx)
