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

import mlx.core as mx

from engine.kernels import gated_delta_cuda


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
    if gated_delta_cuda.available():
        return gated_delta_cuda.gated_delta_cuda(q, k, v, g, beta, state, tiled, capture)
    if capture:
        return gated_delta_reference(q, k, v, g, beta, state, tiled)
    Hv = v.shape[2]
    q, k = expand_heads(q, Hv, tiled), expand_heads(k, Hv, tiled)
    out, final = mx.fast.gated_delta_update(q, k, v, mx.exp(g), beta, state)
    return out, final
