"""The radix select (`topk_cuda.topk_ids`, SLOTSERVE_TOPK=1) against a stable sort's first
`C` ids, and the sampled tokens through it against those through MLX's argpartition; on
MLX's CUDA backend only."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.kernels import topk_cuda
from engine.kernels.cuda import available
from engine.sampling import CANDIDATES, SamplingParams, device_tokens

pytestmark = pytest.mark.skipif(not available(), reason="needs MLX's CUDA backend")


def stable_top(x: np.ndarray, C: int) -> np.ndarray:
    """Each row's C largest values' ids, ties taken first in the row, in id order."""
    return np.sort(np.argsort(-x, axis=-1, kind="stable")[:, :C], axis=-1)


@pytest.mark.parametrize("V", [CANDIDATES, 1500, 151_936, 248_320])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("R", [1, 8])
def test_the_ids_are_a_stable_sort_s_first(V: int, dtype: mx.Dtype, R: int) -> None:
    """bf16 logits (as the model's, in float32 or not) tie often: the ties at the C-th value
    are the first ones in the row."""
    x = mx.array(np.random.default_rng(V + R).normal(0, 3, (R, V)).astype(np.float32))
    x = x.astype(mx.bfloat16).astype(dtype)
    got = np.array(topk_cuda.topk_ids(x, CANDIDATES))
    assert got.dtype == np.uint32 and got.shape == (R, CANDIDATES)
    assert np.array_equal(got, stable_top(np.array(x.astype(mx.float32)), CANDIDATES))


def test_rows_of_ties_signs_and_infinities() -> None:
    """A row of one value (every value a tie: the first C), a row with a few values above a
    sea of ties, -0.0 and 0.0 (equal: ties), and infinities; a strided view of rows."""
    V = 5000
    rows = np.zeros((4, V), np.float32)
    rows[1, [7, 4000, 4999]] = 1.0
    rows[2, ::3] = -0.0
    rows[2, 1::3] = -1e-30
    rows[3, :] = -np.inf
    rows[3, [10, 20]] = np.inf
    x = mx.array(rows)
    want = stable_top(rows, CANDIDATES)
    assert np.array_equal(np.array(topk_cuda.topk_ids(x, CANDIDATES)), want)
    wide = mx.array(np.concatenate([rows, rows], axis=1))[:, :V]  # (rows not contiguous)
    assert np.array_equal(np.array(topk_cuda.topk_ids(wide, CANDIDATES)), want)


@pytest.mark.parametrize("V", [248_320, 2 * CANDIDATES + 1])
def test_sampled_tokens_are_the_same_through_it(V: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`device_tokens` of top-k rows (the candidates' path) draw the same tokens with the
    radix select as with MLX's argpartition (float32 logits: no ties, whose order among the
    candidates either way may keep another of equals at the top-k edge)."""
    rng = np.random.default_rng(V)
    logits = mx.array(rng.normal(0, 3, (16, V)).astype(np.float32))
    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.8)] * 8
    params += [SamplingParams(temperature=1.0, top_k=CANDIDATES)] * 8
    u = rng.random(16).tolist()
    monkeypatch.setenv(topk_cuda.ENV, "0")
    want = np.array(device_tokens(logits, params, u))
    monkeypatch.setenv(topk_cuda.ENV, "1")
    assert topk_cuda.enabled()
    assert np.array_equal(np.array(device_tokens(logits, params, u)), want)
