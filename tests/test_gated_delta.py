"""Every path of the Gated DeltaNet recurrence against the one sequential reference."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest

from engine.gated_delta import gated_delta, gated_delta_chunked, gated_delta_reference
from engine.kernels import gated_delta_cuda
from engine.kernels.cuda import available


def inputs(B: int, T: int, Hk: int, Hv: int, dk: int, dv: int, seed: int = 0) -> list[mx.array]:
    rng = np.random.default_rng(seed)

    def unit(shape: tuple[int, ...]) -> np.ndarray:
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    arrays = [
        unit((B, T, Hk, dk)) / np.sqrt(dk),
        unit((B, T, Hk, dk)),
        rng.standard_normal((B, T, Hv, dv)),
        -rng.uniform(0.0, 2.0, (B, T, Hv)),
        rng.uniform(0.0, 1.0, (B, T, Hv)),
        rng.standard_normal((B, Hv, dv, dk)) * 0.1,
    ]
    return [mx.array(a.astype(np.float32)) for a in arrays]


SHAPES = [  # B, T, Hk, Hv, dk, dv
    (1, 1, 2, 4, 16, 16),
    (3, 5, 2, 6, 16, 8),
    (2, 7, 4, 4, 128, 128),
    (4, 1, 16, 32, 128, 128),
    (1, 33, 1, 3, 48, 48),
]


def check(capture: bool, tiled: bool, shape: tuple[int, ...]) -> None:
    q, k, v, g, beta, state = inputs(*shape)
    ref_o, ref_states = gated_delta_reference(q, k, v, g, beta, state, tiled)
    o, s = gated_delta(q, k, v, g, beta, state, tiled, capture=capture)
    scale = float(mx.abs(ref_o).max())
    assert float(mx.abs(o - ref_o).max()) <= 1e-5 * max(scale, 1.0)
    want = ref_states if capture else ref_states[:, -1]
    assert s.shape == want.shape
    assert float(mx.abs(s - want).max()) <= 1e-5 * max(float(mx.abs(want).max()), 1.0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("capture", [False, True])
def test_default_path_matches_reference(shape: tuple[int, ...], tiled: bool, capture: bool) -> None:
    check(capture, tiled, shape)


@pytest.mark.skipif(not available(), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("capture", [False, True])
def test_cuda_kernel_matches_reference(shape: tuple[int, ...], tiled: bool, capture: bool) -> None:
    q, k, v, g, beta, state = inputs(*shape, seed=1)
    o, s = gated_delta_cuda.gated_delta_cuda(q, k, v, g, beta, state, tiled, capture)
    with mx.stream(mx.cpu):
        ref_o, ref_states = gated_delta_reference(q, k, v, g, beta, state, tiled)
    want = ref_states if capture else ref_states[:, -1]
    assert float(mx.abs(o - ref_o).max()) <= 1e-5 * max(float(mx.abs(ref_o).max()), 1.0)
    assert float(mx.abs(s - want).max()) <= 1e-5 * max(float(mx.abs(want).max()), 1.0)


def test_padding_positions_leave_the_state_unchanged() -> None:
    q, k, v, g, beta, state = inputs(2, 4, 2, 4, 16, 16)
    g = mx.concatenate([g[:, :2], mx.zeros_like(g[:, 2:])], axis=1)
    beta = mx.concatenate([beta[:, :2], mx.zeros_like(beta[:, 2:])], axis=1)
    _, states = gated_delta_reference(q, k, v, g, beta, state, True)
    _, final = gated_delta(q, k, v, g, beta, state, True)
    assert mx.array_equal(states[:, 1], states[:, 3])
    assert float(mx.abs(final - states[:, 1]).max()) <= 1e-6


CHUNKED_SHAPES = [  # B, T, Hk, Hv, dk, dv: T below, at and across chunk boundaries
    (1, 1, 2, 4, 16, 16),
    (3, 5, 2, 6, 16, 8),
    (2, 64, 4, 4, 32, 32),
    (2, 130, 2, 4, 32, 32),
    (1, 200, 1, 3, 48, 48),
]


def relative_error(got: mx.array, want: mx.array) -> float:
    return float(mx.abs(got - want).max()) / max(float(mx.abs(want).max()), 1e-12)


@pytest.mark.parametrize("shape", CHUNKED_SHAPES)
@pytest.mark.parametrize("tiled", [True, False])
def test_chunked_form_matches_reference(shape: tuple[int, ...], tiled: bool) -> None:
    B, T, Hk, Hv, dk, dv = shape
    q, k, v, g, beta, state = inputs(B, T, Hk, Hv, dk, dv, seed=2)
    ref_o, ref_states = gated_delta_reference(q, k, v, g, beta, state, tiled)
    o, final = gated_delta_chunked(q, k, v, g, beta, state, tiled)
    assert o.shape == ref_o.shape and final.shape == ref_states[:, -1].shape
    assert relative_error(o, ref_o) <= 1e-4
    assert relative_error(final, ref_states[:, -1]) <= 1e-4


def test_chunked_form_is_stable_for_repeated_keys_without_decay() -> None:
    """One key repeated with beta = 1 and no decay: the worst case for the chunk's inverse
    (a Neumann series would sum entries of size C(63, 31) that cancel)."""
    q, k, v, g, beta, state = inputs(1, 150, 1, 2, 16, 16, seed=3)
    k = mx.broadcast_to(k[:, :1], k.shape)
    g, beta = mx.zeros_like(g), mx.ones_like(beta)
    ref_o, ref_states = gated_delta_reference(q, k, v, g, beta, state, True)
    o, final = gated_delta_chunked(q, k, v, g, beta, state, True)
    assert relative_error(o, ref_o) <= 1e-4
    assert relative_error(final, ref_states[:, -1]) <= 1e-4


def test_chunked_form_gradients_match_reference() -> None:
    q, k, v, g, beta, state = inputs(2, 70, 2, 4, 16, 16, seed=4)
    probe = mx.array(np.random.default_rng(5).standard_normal((2, 70, 4, 16)).astype(np.float32))

    def loss(path: Callable[..., tuple[mx.array, mx.array]], *xs: mx.array) -> mx.array:
        o, final = path(*xs, True)
        final = final[:, -1] if final.ndim == 5 else final
        return (o * probe).sum() + final.sum()

    args = (q, k, v, g, beta, state)
    want = mx.grad(lambda *xs: loss(gated_delta_reference, *xs), argnums=tuple(range(6)))(*args)
    got = mx.grad(lambda *xs: loss(gated_delta_chunked, *xs), argnums=tuple(range(6)))(*args)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), got, want, strict=True):
        assert relative_error(a, b) <= 1e-4, name
