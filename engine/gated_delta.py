"""The Gated DeltaNet recurrence (MODEL_SPEC §6.6), for a batch of rows.

Shapes: q, k `[B, T, Hk, dk]` (q L2-normalised and scaled by 1/sqrt(dk), k
L2-normalised), v `[B, T, Hv, dv]`, g (log-decay, <= 0) and beta `[B, T, Hv]`,
state `[B, Hv, dv, dk]` (f32). Value head j reads key head j % Hk when `tiled`
(qwen35* files), j // (Hv/Hk) otherwise. Positions a row does not use carry
g = 0 and beta = 0, which leaves its state unchanged, so padded rows need no
other care.

`gated_delta_reference` is the one reference every faster path is tested
against; `gated_delta` picks the path: the fused CUDA kernel on MLX's CUDA
backend, MLX's built-in op elsewhere (stepwise when capturing).
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from engine.kernels import gated_delta_cuda
from engine.kernels.cuda import available


def l2_normalize(x: mx.array, eps: float) -> mx.array:
    """llama.cpp's `x / max(||x||, eps)` over the last axis: the q/k norm of the
    recurrence's inputs (MODEL_SPEC §6.4)."""
    return x / mx.maximum(mx.sqrt((x * x).sum(-1, keepdims=True)), eps)


def expand_heads(x: mx.array, n_heads: int, tiled: bool) -> mx.array:
    """`[B, T, Hk, d]` -> `[B, T, Hv, d]`, one key head per value head."""
    r = n_heads // x.shape[2]
    if r == 1:
        return x
    return mx.tile(x, (1, 1, r, 1)) if tiled else mx.repeat(x, r, axis=2)


def gated_delta_step(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """One position, heads already expanded: `[B, Hv, d]` / `[B, Hv]` -> (o `[B, Hv, dv]`, state)."""
    state = state * mx.exp(g)[..., None, None]
    retrieved = (state * k[..., None, :]).sum(-1)  # S·k, from the already-decayed state
    delta = beta[..., None] * (v - retrieved)
    state = state + delta[..., :, None] * k[..., None, :]
    out = (state * q[..., None, :]).sum(-1)
    return out, state


def gated_delta_reference(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    tiled: bool,
) -> tuple[mx.array, mx.array]:
    """Sequential reference: (o `[B, T, Hv, dv]`, states after every position `[B, T, Hv, dv, dk]`)."""
    Hv = v.shape[2]
    q, k = expand_heads(q, Hv, tiled), expand_heads(k, Hv, tiled)
    outs, states = [], []
    for t in range(q.shape[1]):
        o, state = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(o)
        states.append(state)
    return mx.stack(outs, axis=1), mx.stack(states, axis=1)


def gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    tiled: bool,
    capture: bool = False,
) -> tuple[mx.array, mx.array]:
    """Run the recurrence. Returns (o, final state `[B, Hv, dv, dk]`), or with `capture`
    (o, states after every position `[B, T, Hv, dv, dk]`) so a row can be rolled back."""
    if available():
        return gated_delta_cuda.gated_delta_cuda(q, k, v, g, beta, state, tiled, capture)
    if capture:
        return gated_delta_reference(q, k, v, g, beta, state, tiled)
    Hv = v.shape[2]
    q, k = expand_heads(q, Hv, tiled), expand_heads(k, Hv, tiled)
    out, final = mx.fast.gated_delta_update(q, k, v, mx.exp(g), beta, state)
    return out, final


CHUNK = 64
"""Tokens per chunk of the chunked form: the intra-chunk work is `CHUNK x CHUNK` matmuls."""


@functools.cache
def _doubling_masks(C: int) -> tuple[mx.array, ...]:
    """Per level s = 1, 2, 4, ...: 1.0 on the lower-left s-block of each 2s-block."""
    i, j = np.arange(C)[:, None], np.arange(C)[None, :]
    masks = []
    s = 1
    while s < C:
        block = ((i // s) % 2 == 1) & ((j // s) % 2 == 0) & (i // (2 * s) == j // (2 * s))
        masks.append(mx.array(block.astype(np.float32)))
        s *= 2
    return tuple(masks)


def unit_lower_inverse(a: mx.array) -> mx.array:
    """`(I + A)^-1` for strictly lower-triangular `a [..., C, C]`, C a power of two.

    Recursive doubling: with W the inverse of every diagonal s-block of `I + A`, the inverse
    of every 2s-block is `W - W E W`, E the parts of A in the lower-left s-block of each
    2s-block (E W E = 0). Each level is two dense matmuls, so this differentiates and runs on
    any device, and every intermediate is a true sub-inverse (no large cancelling powers of A
    as in a Neumann product).
    """
    C = a.shape[-1]
    if C & (C - 1):
        raise ValueError(f"chunk size {C} is not a power of two")
    w = mx.eye(C, dtype=a.dtype)
    for block in _doubling_masks(C):
        w = w - w @ (a * block) @ w
    return w


def gated_delta_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    tiled: bool,
    chunk: int = CHUNK,
) -> tuple[mx.array, mx.array]:
    """The recurrence in chunked (WY / UT-transform) form: (o `[B, T, Hv, dv]`, final state).

    Same inputs and results as `gated_delta` without capture (MODEL_SPEC §16, "Chunked form"),
    but built from matrix products over chunks of `chunk` tokens, so it is fast for long rows
    and differentiable with plain MLX ops (training, prefill). Computes in float32. T need not
    be a multiple of `chunk`: the tail is padded with g = 0, beta = 0, which leaves the state
    unchanged.
    """
    B, T, Hv, dv = v.shape
    f32 = mx.float32
    q, k = expand_heads(q, Hv, tiled).astype(f32), expand_heads(k, Hv, tiled).astype(f32)
    v, g, beta = v.astype(f32), g.astype(f32), beta.astype(f32)
    C = chunk
    pad = -T % C
    if pad:
        widths = [(0, 0), (0, pad), (0, 0)]
        q, k, v = (mx.pad(x, [*widths, (0, 0)]) for x in (q, k, v))
        g, beta = mx.pad(g, widths), mx.pad(beta, widths)
    N = (T + pad) // C

    def chunks(x: mx.array) -> mx.array:  # [B, T', Hv, ...] -> [B, Hv, N, C, ...]
        x = x.reshape(B, N, C, Hv, *x.shape[3:])
        return x.transpose(0, 3, 1, 2, *range(4, x.ndim))

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    G = mx.cumsum(g, axis=-1)  # log-decay from the chunk start to each token
    causal = mx.arange(C)[:, None] >= mx.arange(C)[None, :]
    diff = G[..., :, None] - G[..., None, :]
    decay = mx.exp(mx.where(causal, diff, -mx.inf))  # D_ij = exp(G_i - G_j), i >= j
    kb = k * beta[..., None]
    strict = causal & ~mx.eye(C, dtype=mx.bool_)
    w = unit_lower_inverse(mx.where(strict, (kb @ k.swapaxes(-1, -2)) * decay, 0.0))
    u = w @ (v * beta[..., None])  # [B, Hv, N, C, dv]
    p = w @ (kb * mx.exp(G)[..., None])  # [B, Hv, N, C, dk]
    qg = q * mx.exp(G)[..., None]
    inner = (q @ k.swapaxes(-1, -2)) * decay  # lower triangle incl. diagonal (decay is 0 above)
    G_last = G[..., -1:]
    kd = k * mx.exp(G_last - G)[..., None]
    chunk_decay = mx.exp(G_last)[..., None]  # [B, Hv, N, 1, 1]
    S = state.astype(f32).swapaxes(-1, -2)[:, :, None]  # [B, Hv, 1, dk, dv], as a chunk
    outs = []
    # One split per operand, not a slice per chunk: the gradient is one concatenation.
    per_chunk = zip(
        *(mx.split(x, N, axis=2) for x in (u, p, qg, inner, kd.swapaxes(-1, -2), chunk_decay)),
        strict=True,
    )
    for u_n, p_n, qg_n, inner_n, kd_t, decay_n in per_chunk:
        v_eff = u_n - p_n @ S
        outs.append(qg_n @ S + inner_n @ v_eff)
        S = decay_n * S + kd_t @ v_eff
    o = mx.concatenate(outs, axis=2).reshape(B, Hv, N * C, dv)[:, :, :T].transpose(0, 2, 1, 3)
    return o, S[:, :, 0].swapaxes(-1, -2)
