"""Exact speculative acceptance, vectorised over the slots of a step.

One rule serves every request: a draft token x at depth j is accepted with
probability min(1, p_j(x) / q_j(x)); at the first rejection the slot's next
token is drawn from normalise(max(0, p_j - q_j)); when every draft is accepted
the bonus token is drawn from p_{K}. The committed tokens are then distributed
exactly as if drawn one by one from p (Leviathan et al. 2023, Chen et al. 2023).

Greedy requests need no separate path: `distribution` makes p one-hot at the
target's argmax, so a draft is accepted exactly when it equals that argmax and
the residual at the first mismatch is the argmax itself — the longest matching
prefix plus the target's own token (or the bonus token after full acceptance).
A drafter whose proposal is a deterministic function of its inputs (n-gram
lookup, a greedy drafter) has q = a point mass at its token, which this rule
also covers.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.sampling import draw


def accept(
    p: mx.array,
    q: mx.array,
    drafts: mx.array,
    depth: mx.array,
    u_accept: np.ndarray,
    u_draw: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Accept drafts for N slots at once.

    p `[N, K+1, V]`: target distribution at each verified position (rows past a slot's
    depth are ignored); q `[N, K, V]`: the drafter's distribution at each draft position;
    drafts `[N, K]` int32; depth `[N]` int32, each slot's real draft count k <= K;
    u_accept `[N, K]` and u_draw `[N]` uniforms in [0, 1) from each request's generator.
    Returns (accepted count n `[N]`, next token `[N]`): the slot commits drafts[:n] and then
    the next token. Pure; mutates nothing.
    """
    N, K1, V = p.shape
    K = K1 - 1
    if K == 0:
        return np.zeros(N, dtype=np.int64), np.array(draw(p[:, 0], u_draw))
    px = mx.take_along_axis(p[:, :K], drafts[..., None], axis=-1)[..., 0]
    qx = mx.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    drafted = mx.arange(K)[None, :] < depth[:, None]
    ok = drafted & (mx.array(u_accept.astype(np.float32)) * qx < px)
    n = mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1)
    rows = mx.arange(N)
    p_n = p[rows, n]
    q_n = mx.concatenate([q, mx.zeros((N, 1, V), dtype=q.dtype)], axis=1)[rows, n]
    residual = mx.maximum(p_n - q_n, 0.0)
    # p == q at the rejected position makes the residual empty; a rejection then has
    # probability zero, so p itself is a safe stand-in against rounding.
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p_n)
    rejected = (n < depth)[:, None]
    target = mx.where(rejected, residual, p_n)
    return np.array(n), np.array(draw(target, u_draw))


def accept_greedy(best: np.ndarray, drafts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """`accept` for slots whose every verified position is greedy (p one-hot at its
    argmax), from the argmaxes alone: whatever q is, a draft is accepted exactly when it
    equals the target's argmax there, and the next token is the argmax after the longest
    matching prefix (the residual at a mismatch, or the bonus token). `best`: the argmax
    of each verified position, slot after slot (`len(drafts[i]) + 1` each); `drafts[i]`:
    slot i's draft tokens. Returns (accepted count `[N]`, next token `[N]`) as `accept`
    does — without building p, q and the residual over the vocabulary."""
    n, nxt, at = [], [], 0
    for tokens in drafts:
        a = 0
        while a < len(tokens) and tokens[a] == best[at + a]:
            a += 1
        n.append(a)
        nxt.append(int(best[at + a]))
        at += len(tokens) + 1
    return np.array(n, dtype=np.int64), np.array(nxt, dtype=np.int64)
