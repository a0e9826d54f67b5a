"""From logits to tokens, for a batch of rows with their own parameters.

Three steps, each batched over rows on the device:
1. `adjust_logits`: logit bias and repetition / presence / frequency penalties
   over each row's token history;
2. `distribution`: the row's sampling distribution p — temperature, top-k,
   top-p, min-p (greedy rows get a one-hot at the argmax);
3. `draw`: a token per row by inverse CDF, in vocabulary order, from a uniform
   that the request's own seeded generator supplies, so a request samples the
   same tokens whatever else shares its batch.

`sample` and `device_tokens` draw the token of 2 and 3 without the whole
distribution: one argmax for the greedy rows; for a sampled row the weights
exp(z - max z) of the tokens its truncation keeps, and the same inverse CDF over
them. A row whose top-k is at most `CANDIDATES` finds its kept tokens among its
`CANDIDATES` largest logits (a partition and a sort of those, not of the
vocabulary); on the CPU the host draws in numpy (MLX's CPU sort and exp are
several times slower there), widening its candidates until the truncation ends
inside them. The tokens are those of `draw(distribution(...))` up to float
rounding: they can differ only where a uniform falls within rounding of a step of
the CDF, or where logits tie at the edge of a top-k.

Speculative acceptance shapes its target and draft distributions with the same
`distribution`, so both see identical temperature and truncation.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import mlx.core as mx
import numpy as np

from engine.kernels import host_pool, topk_cuda
from engine.kernels.argmax_cuda import argmax_rows


class SamplingError(ValueError):
    """Sampling parameters out of range; the message names the parameter."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # llama.cpp / CTRL: divide positive logits, multiply negative
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    seed: int | None = None
    logprobs: int = 0  # top-n log-probabilities to report per token

    # Cached (read per row of every step): the fields are frozen.
    @functools.cached_property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @functools.cached_property
    def unadjusted(self) -> bool:
        """`adjust_logits` leaves the row as it is: no penalty, no logit bias."""
        return not self.penalized and not self.logit_bias

    @functools.cached_property
    def argmax_only(self) -> bool:
        """The token is the argmax of the model's own logits: greedy and `unadjusted`."""
        return self.greedy and self.unadjusted

    def validate(self, vocab_size: int) -> None:
        checks = [
            (0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 <= self.min_p < 1.0, "min_p must be in [0, 1)"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed must be in [0, 2**63)"),
        ]
        for ok, why in checks:
            if not ok:
                raise SamplingError(why)
        for tok, bias in self.logit_bias:
            if not 0 <= tok < vocab_size:
                raise SamplingError(
                    f"logit_bias token {tok} outside the vocabulary of {vocab_size}"
                )
            if not -100.0 <= bias <= 100.0:
                raise SamplingError(f"logit_bias for token {tok} must be in [-100, 100]")


class RequestRng:
    """A request's own stream of uniforms: seeded requests replay exactly.

    The generator is made at the first draw (greedy requests never draw, and making one
    costs more than the rest of a submit); an unseeded request's seed comes from the OS."""

    def __init__(self, seed: int | None) -> None:
        self.seed = secrets.randbits(63) if seed is None else seed
        self._gen: np.random.Generator | None = None
        self._next: float | None = None  # drawn by `peek`, not yet taken

    def uniform(self, n: int = 1) -> np.ndarray:
        if self._gen is None:
            self._gen = np.random.default_rng(self.seed)
        if self._next is None or n == 0:
            return self._gen.random(n)
        first, self._next = self._next, None
        return np.concatenate([[first], self._gen.random(n - 1)])

    def peek(self) -> float:
        """The uniform the next `uniform` call starts with, left in the stream (the
        scheduler's decode-ahead draws a token before the step that commits it)."""
        if self._next is None:
            self._next = float(self.uniform(1)[0])
        return self._next


def adjust_logits(
    logits: mx.array, params: Sequence[SamplingParams], histories: Sequence[Sequence[int]]
) -> mx.array:
    """Apply logit bias and penalties. logits `[N, V]` float32; `histories[i]` are the
    tokens row i has seen (prompt and output) for the penalties."""
    rows: list[Any] = []
    cols: list[Any] = []
    deltas: list[Any] = []
    scales: list[Any] = []
    for i, (p, hist) in enumerate(zip(params, histories, strict=True)):
        if p.unadjusted:
            continue
        tokens, row_scales, row_deltas = _row_adjustments(p, hist if p.penalized else ())
        rows.append([i] * len(tokens))
        cols.append(tokens)
        scales.append(row_scales)
        deltas.append(row_deltas)
    if not sum(map(len, rows)):
        return logits
    r = mx.array(np.concatenate(rows).astype(np.int32))
    c = mx.array(np.concatenate(cols).astype(np.int32))
    x = logits[r, c]
    scale = mx.array(np.concatenate(scales).astype(np.float32))
    x = mx.where(x > 0, x / scale, x * scale) + mx.array(np.concatenate(deltas).astype(np.float32))
    out = mx.array(logits)
    out[r, c] = x
    return out


def _row_adjustments(p: SamplingParams, history: Sequence[int]) -> tuple[Any, Any, Any]:
    """One row's adjusted tokens, each one's scale (the repetition penalty where seen) and
    delta (bias less the presence and frequency penalties), as lists or arrays. A long
    history is counted by numpy (a dict took milliseconds a row every step at thousands of
    tokens); a short one by a dict, which beats numpy's per-call cost there."""
    bias = dict(p.logit_bias)  # (the last value of a token given twice)
    if len(history) < 64:
        seen: dict[int, int] = {}
        for t in history:
            seen[t] = seen.get(t, 0) + 1
        tokens = sorted(seen.keys() | bias.keys())
        n = [seen.get(t, 0) for t in tokens]
        scale = [p.repetition_penalty if c else 1.0 for c in n]
        delta = [
            bias.get(t, 0.0) - (p.presence_penalty if c else 0.0) - p.frequency_penalty * c
            for t, c in zip(tokens, n, strict=True)
        ]
        return tokens, scale, delta
    ids, counts = np.unique(np.asarray(history, dtype=np.int64), return_counts=True)
    given = np.zeros(len(ids))
    if bias:
        biased = np.array(list(bias), dtype=np.int64)
        every = np.union1d(ids, biased)
        counted = np.zeros(len(every), np.int64)
        counted[np.searchsorted(every, ids)] = counts
        given = np.zeros(len(every))
        given[np.searchsorted(every, biased)] = list(bias.values())
        ids, counts = every, counted
    hit = counts > 0
    penalized = given - np.where(hit, p.presence_penalty, 0.0) - p.frequency_penalty * counts
    return ids, np.where(hit, p.repetition_penalty, 1.0), penalized


def _divisor(p: SamplingParams) -> float:
    """What a row's logits are divided by, after its largest is taken from them (so no
    quotient overflows): its temperature, at least float32's smallest normal — a valid
    temperature as small as 1e-39 is 0 or subnormal in float32, and drew garbage; there, as
    its limit, the largest logit (ties shared) — and 1 for a greedy row (not divided)."""
    return 1.0 if p.greedy else max(p.temperature, _FLOAT32_TINY)


_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def distribution(logits: mx.array, params: Sequence[SamplingParams]) -> mx.array:
    """Per-row sampling distribution `[N, V]` (float32, rows sum to 1)."""
    return Shaping.of(params)(logits)


@dataclass(frozen=True)
class Shaping:
    """What `distribution` does to each row, as device arrays: a compiled graph takes
    `arrays` as inputs and keys on `truncate` (its static part), so it shapes any rows'
    distributions without retracing (`ModelRunner.draft_chain`).

    `arrays`: greedy `[N, 1]` bool, temperature `[N, 1]`, and when `truncate` (some sampled
    row truncates) top_k, top_p and min_p `[N, 1]`. `greedy_only`: every row is greedy (a
    static part too: such rows' draws are their argmax, their q a point mass nobody needs).
    `candidates`: every sampled row's top-k is at most `CANDIDATES` (static: its kept
    tokens are found among that many largest logits, not by sorting the vocabulary);
    `topk_kernel`: found by `topk_cuda`'s radix select (SLOTSERVE_TOPK), not MLX's
    argpartition (static too: a graph traced one way is not reused the other).
    """

    truncate: bool
    arrays: tuple[mx.array, ...]
    greedy_only: bool = False
    candidates: bool = False
    topk_kernel: bool = False

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> Shaping:
        greedy = mx.array([p.greedy for p in params])[:, None]
        temp = mx.array([_divisor(p) for p in params])[:, None]
        if not any(p.top_k or p.top_p < 1.0 or p.min_p > 0.0 for p in params if not p.greedy):
            return cls(False, (greedy, temp), all(p.greedy for p in params))
        every = np.iinfo(np.int32).max  # top_k 0 (off) keeps every rank
        top_k = mx.array([p.top_k if p.top_k > 0 else every for p in params])[:, None]
        top_p = mx.array([p.top_p for p in params], dtype=mx.float32)[:, None]
        min_p = mx.array([p.min_p for p in params], dtype=mx.float32)[:, None]
        by_candidates = all(_by_candidates(p) for p in params if not p.greedy)
        arrays = (greedy, temp, top_k, top_p, min_p)
        topk_kernel = by_candidates and topk_cuda.enabled()
        return cls(True, arrays, candidates=by_candidates, topk_kernel=topk_kernel)

    @property
    def key(self) -> tuple[bool, bool, bool, bool]:
        """The static part a compiled graph keys on."""
        return self.truncate, self.greedy_only, self.candidates, self.topk_kernel

    def padded(self, n: int) -> Shaping:
        """The same rows and `n` more shaped as the first (rows padding a batch)."""
        return self.with_arrays(
            [mx.concatenate([a, mx.repeat(a[:1], n, axis=0)]) for a in self.arrays]
        )

    def with_arrays(self, arrays: Sequence[mx.array]) -> Shaping:
        """The same static shape over other arrays (as a compiled function receives them)."""
        return replace(self, arrays=tuple(arrays))

    def __call__(self, logits: mx.array) -> mx.array:
        """The distribution `[N, V]` of each row of logits `[N, V]`."""
        greedy, temp = self.arrays[:2]
        logits = logits.astype(mx.float32)
        V = logits.shape[-1]
        if self.candidates and V > CANDIDATES:
            k, top_p, min_p = self.arrays[2:]
            ids, w = _candidate_weights(logits, temp, k, top_p, min_p, self.topk_kernel)
            probs = mx.put_along_axis(
                mx.zeros_like(logits), ids, w / w.sum(axis=-1, keepdims=True), axis=-1
            )
        else:
            z = (logits - logits.max(axis=-1, keepdims=True)) / temp
            probs = mx.softmax(self._truncate(z) if self.truncate else z, axis=-1)
        one_hot = mx.arange(V)[None, :] == mx.argmax(logits, axis=-1, keepdims=True)
        return mx.where(greedy, one_hot.astype(mx.float32), probs)

    def _truncate(self, z: mx.array) -> mx.array:
        """Mask out (to -inf) what top-k, top-p and min-p exclude, per row."""
        return _truncated(z, *self.arrays[2:])


def _truncated(z: mx.array, k: mx.array, top_p: mx.array, min_p: mx.array) -> mx.array:
    """`z [N, V]` with what top-k, top-p and min-p exclude masked to -inf, per row."""
    order = mx.argsort(-z, axis=-1)
    zs = mx.take_along_axis(z, order, axis=-1)  # descending
    masked_sorted = mx.where(_kept_of_sorted(zs, k, top_p, min_p), zs, -mx.inf)
    # back to vocabulary order by a scatter (a second sort would cost as much as the first)
    return mx.put_along_axis(mx.zeros_like(z), order, masked_sorted, axis=-1)


def _kept_of_sorted(zs: mx.array, k: mx.array, top_p: mx.array, min_p: mx.array) -> mx.array:
    """Which of a row's tokens, its logits `zs [N, C]` in descending order (the whole
    vocabulary, or its C largest when top-k <= C), top-k, top-p and min-p keep: a prefix."""
    rank = mx.arange(zs.shape[-1])[None, :]
    keep = rank < k
    ps = mx.softmax(mx.where(keep, zs, -mx.inf), axis=-1)
    before = mx.cumsum(ps, axis=-1) - ps  # mass strictly before this token
    keep = keep & (before < top_p)
    keep = keep & (ps >= min_p * ps[:, :1])
    return keep | (rank == 0)  # the most likely token always survives


# `draw` over more tokens than this finds its block first (`draw_block`): a scan of a row of
# the whole vocabulary runs in one GPU block a row (120 us for 8 x 248,320 on the H200)
FLAT_DRAW_MAX = 4096
DRAW_BLOCK = 1024


@functools.cache
def draw_block(V: int) -> int:
    """Tokens a block of `draw` over `V` tokens: the divisor of V in [DRAW_BLOCK / 2,
    2 DRAW_BLOCK] nearest DRAW_BLOCK (the row is then blocked without a padded copy: 970 for
    Qwen3.5's 248,320, 1,187 for 151,936), else DRAW_BLOCK (the row padded with zeros)."""
    near = [L for L in range(DRAW_BLOCK // 2, 2 * DRAW_BLOCK + 1) if V % L == 0]
    return min(near, key=lambda L: abs(L - DRAW_BLOCK), default=DRAW_BLOCK)


def draw(probs: mx.array, uniforms: np.ndarray | mx.array) -> mx.array:
    """One token per row of weights `probs [N, V]` (>= 0, any positive total) by inverse CDF:
    the first token whose cumulative weight exceeds u times the row's total, `u [N]` in
    [0, 1). Never a token of weight 0 (where rounding of the scan would point at one, the
    next token of weight is drawn)."""
    u = mx.array(uniforms.astype(np.float32)) if isinstance(uniforms, np.ndarray) else uniforms
    N, V = probs.shape
    if V <= FLAT_DRAW_MAX:
        cdf = mx.cumsum(probs, axis=-1)
        return _weighted_at_or_after(probs, (cdf <= u[:, None] * cdf[:, -1:]).sum(axis=-1))
    # the block holding the draw, then the token inside it
    L = draw_block(V)
    B = -(-V // L)
    if B * L > V:
        probs = mx.concatenate([probs, mx.zeros((N, B * L - V), probs.dtype)], axis=-1)
    blocks = probs.reshape(N, B, L)
    sums = blocks.sum(axis=-1)
    cum = mx.cumsum(sums, axis=-1)
    target = u[:, None] * cum[:, -1:]
    b = _weighted_at_or_after(sums, (cum <= target).sum(axis=-1))
    at = mx.take_along_axis(cum, mx.maximum(b - 1, 0)[:, None], axis=-1)
    before = mx.where(b[:, None] > 0, at, 0.0)  # [N, 1]: the weight of the blocks before
    inside = mx.take_along_axis(blocks, b[:, None, None], axis=1).squeeze(1)  # [N, L]
    local = mx.cumsum(inside, axis=-1)
    j = _weighted_at_or_after(inside, (local <= target - before).sum(axis=-1))
    return (b * L + j).astype(mx.int32)


def _weighted_at_or_after(w: mx.array, i: mx.array) -> mx.array:
    """Per row, the first position at or after `i [N]` whose weight in `w [N, V]` is
    positive, else the row's last such: the draw of an inverse CDF whose scan rounding (a
    parallel scan need not be monotone over zeros) or a u near 1 sent past its last step."""
    pos = mx.arange(w.shape[-1])[None, :]
    weighted = w > 0
    last = mx.max(mx.where(weighted, pos, 0), axis=-1)
    first_after = mx.min(mx.where(weighted & (pos >= i[:, None]), pos, w.shape[-1]), axis=-1)
    return mx.minimum(first_after, last).astype(mx.int32)


def sample(
    logits: mx.array, params: Sequence[SamplingParams], rngs: Sequence[RequestRng]
) -> np.ndarray:
    """One token per row of (adjusted) logits `[N, V]`: the tokens of
    `draw(distribution(logits, params), u)` (to float rounding: the module's docstring),
    each sampled row's u from its request's generator — on the CPU drawn by the host
    (`host_tokens`), on a device by `device_tokens` and read back. Greedy rows draw no
    uniform: their token does not depend on it."""
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return greedy_tokens(logits)
    uniforms = [rngs[i].uniform(1)[0] for i in sampled]
    if on_host():
        return host_tokens(np.asarray(logits.astype(mx.float32)), params, uniforms)
    tokens = device_tokens(logits, params, uniforms)
    return host_pool.to_host(tokens)  # (as greedy tokens are read: `host_pool`)


def device_tokens(
    logits: mx.array, params: Sequence[SamplingParams], uniforms: Sequence[float]
) -> mx.array:
    """`sample`'s tokens as a device array, each sampled row's uniform given (in row order,
    one per sampled row), batched by kind: greedy rows by one argmax, the sampled rows by
    `_sampled_tokens` in at most two groups (top-k within `CANDIDATES`, or not)."""
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return argmax_rows(logits).astype(mx.int32)
    u = host_pool.array(uniforms, mx.float32)  # (host-made arrays of 8 bytes at most)
    # the sampled rows by how they truncate, so a row's kernels follow its own parameters
    # whatever shares its batch: (its place among the sampled rows, its row) a kind
    kinds = [
        [(j, i) for j, i in enumerate(sampled) if _by_candidates(params[i]) == c]
        for c in (True, False)
    ]
    groups = [g for g in kinds if g]
    if len(groups) == 1 and len(sampled) == len(params):
        return _sampled_tokens(logits, params, u)
    if len(sampled) < len(params):
        tokens = argmax_rows(logits).astype(mx.int32)
    else:
        tokens = mx.zeros((len(params),), dtype=mx.int32)
    for group in groups:
        at, rows = (list(x) for x in zip(*group, strict=True))
        ug = u if len(group) == len(sampled) else u[host_pool.ids(at)]
        picked = host_pool.ids(rows)
        tokens[picked] = _sampled_tokens(logits[picked], [params[i] for i in rows], ug)
    return tokens


def precompile_draws(vocab: int, rows: int) -> None:
    """Run each kind of device draw (temperature only, top-k's candidates, a sorted top-p)
    over zero logits of `vocab` tokens, and read its tokens back as `sample` does, at 1, 2,
    4, ... rows up to the first power of two >= `rows`: on a GPU the first draw of a kind
    compiles its fused kernels, and the host pool (`host_pool`) compiles a kernel for each
    power-of-two count of 8-byte pieces its uniforms and read-backs take — each would stall
    the first sampled step of a daemon to meet it (`ModelRunner.precompile_decode` calls
    this before serving, `rows` its slots)."""
    kinds = [SamplingParams(temperature=1.0), SamplingParams(top_k=40), SamplingParams(top_p=0.9)]
    n = 1
    while True:
        logits = mx.zeros((n, vocab), dtype=mx.float32)
        for p in kinds:
            host_pool.to_host(device_tokens(logits, [p] * n, [0.5] * n))
        if n >= rows:
            return
        n *= 2


# A sampled row whose top-k is at most this many finds its kept tokens among this many
# largest logits (`_sampled_tokens`)
CANDIDATES = 1024


def _by_candidates(p: SamplingParams) -> bool:
    return 0 < p.top_k <= CANDIDATES


def _sampled_tokens(logits: mx.array, params: Sequence[SamplingParams], u: mx.array) -> mx.array:
    """The token of `draw(distribution(logits, params), u)` for sampled rows `[N, V]` of one
    kind (every row's top-k at most `CANDIDATES`, or none's): the kept tokens' weights
    exp(z - max z) in vocabulary order, drawn from as `draw` does. One compiled function a
    kind (MLX fuses its element-wise steps: fewer launches on a GPU, where the host's
    launches bound a decode step)."""
    shaping = Shaping.of(params)
    _, temp, *truncation = shaping.arrays
    if not shaping.truncate:
        return _compiled("plain")(logits, temp, u)
    if shaping.candidates and logits.shape[-1] > CANDIDATES:
        draw_fn = _compiled("candidates", topk_kernel=shaping.topk_kernel)
        return draw_fn(logits, temp, u, *truncation)
    return _compiled("sorted")(logits, temp, u, *truncation)


@functools.cache
def _compiled(kind: str, **static: bool) -> Callable[..., mx.array]:
    """A kind's draw compiled, its static arguments bound (the candidates' `topk_kernel`):
    a compiled function for each, as MLX keys what it traced by the function."""
    return cast(Callable[..., mx.array], mx.compile(functools.partial(_DRAWS[kind], **static)))


def _plain_draw(logits: mx.array, temp: mx.array, u: mx.array) -> mx.array:
    x = logits.astype(mx.float32)
    return draw(mx.exp((x - x.max(axis=-1, keepdims=True)) / temp), u)


def _sorted_draw(
    logits: mx.array, temp: mx.array, u: mx.array, k: mx.array, top_p: mx.array, min_p: mx.array
) -> mx.array:
    x = logits.astype(mx.float32)
    return draw(mx.exp(_truncated((x - x.max(axis=-1, keepdims=True)) / temp, k, top_p, min_p)), u)


def _candidates_draw(
    logits: mx.array,
    temp: mx.array,
    u: mx.array,
    k: mx.array,
    top_p: mx.array,
    min_p: mx.array,
    topk_kernel: bool = False,
) -> mx.array:
    ids, w = _candidate_weights(logits, temp, k, top_p, min_p, topk_kernel)
    by_id = mx.argsort(ids, axis=-1)  # (the draw runs in vocabulary order)
    w, ids = mx.take_along_axis(w, by_id, axis=-1), mx.take_along_axis(ids, by_id, axis=-1)
    return mx.take_along_axis(ids, draw(w, u)[:, None], axis=-1).squeeze(-1).astype(mx.int32)


def _candidate_weights(
    logits: mx.array,
    temp: mx.array,
    k: mx.array,
    top_p: mx.array,
    min_p: mx.array,
    topk_kernel: bool = False,
) -> tuple[mx.array, mx.array]:
    """A row's `CANDIDATES` largest of z = logits / temp (`logits [N, V]`, `temp [N, 1]`), in
    descending order: their ids and weights exp(z - max z), 0 where top-k, top-p or min-p
    drops them (every row's top-k at most `CANDIDATES`, so nothing outside them is kept).
    The partition reads the logits as they are — z's order is theirs (temp > 0) — and only
    the candidates are divided: on the H200 the whole-vocabulary `-(logits / temp)` took
    145 us at 8 rows, more than the partition's sort (session 24's sampled timeline).
    `topk_kernel`: the candidates by `topk_cuda`'s radix select (one launch a step)."""
    V = logits.shape[-1]
    if topk_kernel:
        ids = topk_cuda.topk_ids(logits, CANDIDATES)
    else:
        ids = mx.argpartition(logits, V - CANDIDATES, axis=-1)[:, V - CANDIDATES :]
    xc = mx.take_along_axis(logits, ids, axis=-1).astype(mx.float32)
    zc = (xc - xc.max(axis=-1, keepdims=True)) / temp  # (the row's max is a candidate)
    order = mx.argsort(-zc, axis=-1)
    zs, ids = mx.take_along_axis(zc, order, axis=-1), mx.take_along_axis(ids, order, axis=-1)
    return ids, mx.where(_kept_of_sorted(zs, k, top_p, min_p), mx.exp(zs - zs[:, :1]), 0.0)


_DRAWS: dict[str, Callable[..., mx.array]] = {
    "plain": _plain_draw,
    "sorted": _sorted_draw,
    "candidates": _candidates_draw,
}


def on_host() -> bool:
    """MLX computes on the CPU: its arrays are host memory that numpy reads in place, and
    numpy's row reductions are several times faster there than MLX's own."""
    return bool(mx.default_device() == mx.cpu)


def greedy_tokens(logits: mx.array) -> np.ndarray:
    """Each row's argmax (the first on ties), on the host."""
    if on_host():
        return np.asarray(logits).argmax(axis=-1)
    return host_pool.to_host(argmax_rows(logits))


# The host's first guess of a row's kept tokens without a top-k (widened 8x until its
# truncation ends inside them)
HOST_CANDIDATES = 256


def host_tokens(
    logits: np.ndarray, params: Sequence[SamplingParams], uniforms: Sequence[float]
) -> np.ndarray:
    """`sample`'s tokens computed by the host from float32 logits `[N, V]` in host memory,
    each sampled row's uniform given (in row order): greedy rows their argmax, sampled
    rows as `_host_row` draws them."""
    tokens = logits.argmax(axis=-1)
    u = iter(uniforms)
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _host_row(logits[i], p, next(u))
    return tokens


def _host_row(logits: np.ndarray, p: SamplingParams, u: float) -> int:
    """One sampled row's token: `draw(distribution(...))`'s rule in numpy. The kept tokens
    are found among the row's largest logits — its top-k, or `HOST_CANDIDATES` widened
    until the kept prefix ends strictly above the smallest candidate (then no token outside
    could be kept, ties included) — and drawn from in vocabulary order, the CDF in float64."""
    with np.errstate(over="ignore"):  # (-inf past float32: a weight of 0, as intended)
        z = (logits - logits.max()) / np.float32(_divisor(p))
    V = z.size
    m = np.float32(0.0)
    if not (p.top_k or p.top_p < 1.0 or p.min_p > 0.0):
        return _host_draw(np.exp(z - m), u)
    k = p.top_k if 0 < p.top_k < V else V
    c = k if k < V else min(V, HOST_CANDIDATES)
    # top-p's mass: of the top k, or (no top-k) of the whole vocabulary, counted once
    total = None if k < V else np.exp(z - m).sum(dtype=np.float32)
    while True:
        ids = np.argpartition(-z, c - 1)[:c] if c < V else np.arange(V)
        ids.sort()  # (so the stable sort puts equal logits in vocabulary order)
        ids = ids[np.argsort(-z[ids], kind="stable")]
        zs = z[ids]
        e = np.exp(zs - m)
        ps = e / (e.sum() if total is None else total)
        keep = (np.cumsum(ps) - ps < p.top_p) & (ps >= p.min_p * ps[0])
        n = max(int(keep.argmin()) if not keep.all() else c, 1)  # (the first always stays)
        if k < V or c == V or (n < c and zs[n - 1] > zs[-1]):
            kept = np.sort(ids[:n])
            return int(kept[_host_draw(np.exp(z[kept] - m), u)])
        c = min(V, c * 8)


def _host_draw(w: np.ndarray, u: float) -> int:
    """`draw` over weights `w`: the index of the first whose cumulative weight exceeds u
    times the total, never one of weight 0."""
    cdf = np.cumsum(w, dtype=np.float64)
    j = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(w) - 1)
    if w[j] <= 0:
        weighted = np.flatnonzero(w)
        after = weighted[weighted >= j]
        j = int(after[0] if after.size else weighted[-1])
    return j


def token_logprobs(
    logits: mx.array, tokens: Sequence[int], n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Log-probabilities under the (adjusted) logits `[T, V]`, on the host: each row's token
    of `tokens` (one a row), and its `n` most likely tokens with theirs, most likely first
    — `(chosen [T], ids [T, n], values [T, n])`. The top n by a partition, not a sort of the
    vocabulary; on the CPU in numpy (MLX's CPU exp over a 248K vocabulary costs ~6 ms a
    row)."""
    if on_host():
        return _host_logprobs(np.asarray(logits.astype(mx.float32)), tokens, n)
    return _device_logprobs(logits, tokens, n)


def _host_logprobs(
    x: np.ndarray, tokens: Sequence[int], n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    T, V = x.shape
    m = x.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
    chosen = x[np.arange(T), list(tokens)] - lse[:, 0]
    if 0 < n < V:
        ids = np.argpartition(-x, n - 1, axis=-1)[:, :n]
    else:  # (every token, or none)
        ids = np.tile(np.arange(min(n, V)), (T, 1))
    ids = np.sort(ids, axis=-1)  # (so the stable sort lists equal values by id)
    top = np.take_along_axis(x, ids, axis=-1)
    order = np.argsort(-top, axis=-1, kind="stable")
    ids, top = np.take_along_axis(ids, order, -1), np.take_along_axis(top, order, -1)
    return chosen, ids, top - lse


def _device_logprobs(
    logits: mx.array, tokens: Sequence[int], n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = logits.astype(mx.float32)
    V = x.shape[-1]
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, mx.array(list(tokens), dtype=mx.int32)[:, None], axis=-1)
    ids = mx.argpartition(-lp, n - 1, axis=-1)[:, :n] if 0 < n < V else mx.arange(V)[None, :n]
    ids = mx.broadcast_to(ids, (x.shape[0], ids.shape[-1]))
    top = mx.take_along_axis(lp, ids, axis=-1)
    order = mx.argsort(-top, axis=-1)
    ids, top = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(top, order, axis=-1)
    return np.array(chosen[:, 0]), np.array(ids.astype(mx.int32)), np.array(top)
