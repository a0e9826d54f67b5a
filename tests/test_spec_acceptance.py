"""Exact speculative acceptance: greedy is the longest matching prefix, sampling follows p.

The distribution tests run the acceptance function itself on 20,000 slots at once: the
first committed token after a fixed context, with drafts drawn from a q that differs
from p, must be distributed as p (chi-square).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats

from engine.cache import SlotPool
from engine.models.qwen35 import load_model
from engine.runner import DraftRow, ModelRunner, Row
from engine.sampling import RequestRng, SamplingParams, distribution
from engine.spec.acceptance import accept, accept_greedy

DRAWS = 20_000
CHUNK = 5_000  # slots per call, to bound memory
V = 8


def one_hot(tokens: list[list[int]], vocab: int = V) -> mx.array:
    return mx.array(np.eye(vocab, dtype=np.float32)[np.array(tokens)])


def test_greedy_accepts_the_longest_matching_prefix_then_the_target_token() -> None:
    target = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 0], [3, 3, 3, 3]]  # argmax per position
    drafts = [[1, 2, 0], [1, 2, 3], [6, 6, 7], [3, 3, 0]]
    depth = [3, 3, 3, 1]
    p, q = one_hot(target), one_hot(drafts)
    n, nxt = accept(
        p,
        q,
        mx.array(drafts, dtype=mx.int32),
        mx.array(depth, dtype=mx.int32),
        np.full((4, 3), 0.999),
        np.full(4, 0.5),
    )
    assert n.tolist() == [2, 3, 0, 1]
    assert nxt.tolist() == [3, 4, 5, 3]  # mismatch: target's token; all accepted: bonus token


@pytest.mark.parametrize("seed", range(20))
def test_the_greedy_shortcut_is_the_general_rule_for_greedy_targets(seed: int) -> None:
    """`accept_greedy` (what a verify step of greedy requests runs) against `accept` on
    one-hot p, for drafts that match a random prefix of the argmaxes, point-mass and dense
    q, ragged depths (0 included) and ties among the logits."""
    rng = np.random.default_rng(seed)
    N, K, vocab = 16, 4, 12
    logits = rng.integers(0, 5, (N, K + 1, vocab)).astype(np.float32)  # ties: first max wins
    best = logits.argmax(axis=-1)
    ks = rng.integers(0, K + 1, N)
    drafts = []
    for i, k in enumerate(ks):
        keep = int(rng.integers(0, k + 1))  # a matching prefix, then anything
        drafts.append(
            [int(best[i, j]) if j < keep else int(rng.integers(0, vocab)) for j in range(k)]
        )
    greedy = [SamplingParams(temperature=0.0)] * (N * (K + 1))
    p = distribution(mx.array(logits.reshape(-1, vocab)), greedy).reshape(N, K + 1, vocab)
    dense = rng.random((N, K, vocab)).astype(np.float32)
    q = (
        mx.array(dense / dense.sum(-1, keepdims=True))
        if seed % 2
        else one_hot([d + [0] * (K - len(d)) for d in drafts], vocab)
    )
    padded = mx.array([d + [0] * (K - len(d)) for d in drafts], dtype=mx.int32)
    want_n, want_next = accept(
        p, q, padded, mx.array(ks, dtype=mx.int32), rng.random((N, K)), rng.random(N)
    )
    packed = np.concatenate([best[i, : k + 1] for i, k in enumerate(ks)])
    got_n, got_next = accept_greedy(packed, drafts)
    assert got_n.tolist() == want_n.tolist() and got_next.tolist() == want_next.tolist()


def test_without_drafts_the_token_is_drawn_from_p() -> None:
    p = mx.array([[[0.1, 0.2, 0.7, 0, 0, 0, 0, 0]]], dtype=mx.float32)
    for u, want in ((0.05, 0), (0.25, 1), (0.95, 2)):
        n, nxt = accept(
            p,
            mx.zeros((1, 0, V)),
            mx.zeros((1, 0), mx.int32),
            mx.array([0]),
            np.ones((1, 0)),
            np.array([u]),
        )
        assert (n[0], nxt[0]) == (0, want)


@pytest.fixture(scope="module")
def context_logits(make_model: Callable[..., Path]) -> tuple[mx.array, mx.array]:
    """(target logits `[3, V]`, drafter logits `[2, V]`) of the tiny model after a fixed context.

    A random-weight MTP head shares almost no mass with its trunk, so every draft would be
    rejected and the test would only see the residual. The drafter here adds half the MTP
    head's logits to the target's: it agrees about 70% of the time, like a useful drafter.
    """
    model = load_model(make_model("tiny", quant="f32"))
    runner = ModelRunner(model, SlotPool(model.config, 1, 64, mx.float32))
    slot = runner.pool.allocate()
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 512, 12)]
    out = runner.step([Row(slot, prompt, 0, want=range(len(prompt)), want_hidden=True)]).rows[0]
    assert out.hidden is not None
    draft, _ = runner.draft([DraftRow(slot, prompt[1:], out.hidden[:-1], 0)])[0]
    return out.logits[-3:], out.logits[-3:-1] + 0.5 * draft[-2:]


def verify(
    p: mx.array, q: mx.array | None, point_mass: int | None, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DRAWS slots with K = 2 drafts each through `accept`: (drafts, accepted n, next token)."""
    K, vocab = 2, p.shape[-1]
    out: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for _ in range(DRAWS // CHUNK):
        if q is None:
            assert point_mass is not None
            drafts = np.full((CHUNK, K), point_mass, dtype=np.int32)
            qs = mx.broadcast_to(one_hot([[point_mass] * K], vocab), (CHUNK, K, vocab))
        else:
            qn = np.array(q, dtype=np.float64)
            drafts = np.stack(
                [rng.choice(vocab, CHUNK, p=qn[j] / qn[j].sum()) for j in range(K)], axis=1
            ).astype(np.int32)
            qs = mx.broadcast_to(q[None], (CHUNK, K, vocab))
        n, nxt = accept(
            mx.broadcast_to(p[None], (CHUNK, K + 1, vocab)),
            qs,
            mx.array(drafts),
            mx.full((CHUNK,), K, dtype=mx.int32),
            rng.random((CHUNK, K)),
            rng.random(CHUNK),
        )
        out.append((drafts, n, nxt))
    drafts, n, nxt = (np.concatenate([o[i] for o in out]) for i in range(3))
    return drafts, n, nxt


def first_tokens(drafts: np.ndarray, n: np.ndarray, nxt: np.ndarray) -> np.ndarray:
    return np.where(n > 0, drafts[:, 0], nxt)


def assert_follows(tokens: np.ndarray, p: np.ndarray) -> None:
    """Chi-square goodness of fit, tokens with expected count < 5 pooled into one bin."""
    assert set(np.unique(tokens)) <= set(np.flatnonzero(p))
    counts = np.bincount(tokens, minlength=len(p)).astype(np.float64)
    expected = p.astype(np.float64) / p.sum() * len(tokens)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    result = stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum())
    assert result.pvalue > 0.01, result


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=2.5),
        SamplingParams(temperature=3.0, top_k=40, top_p=0.95, min_p=0.01),
    ],
)
def test_sampled_first_token_follows_p_with_drafts_from_q(
    context_logits: tuple[mx.array, mx.array], params: SamplingParams
) -> None:
    target, draft = context_logits
    p = distribution(target, [params] * 3)
    q = distribution(draft, [params] * 2)
    p0, q0 = np.array(p[0]), np.array(q[0])
    assert 0.2 < np.abs(p0 - q0).sum() < 1.0  # q differs from p, yet drafts get accepted
    assert_follows(first_tokens(*verify(p, q, None, np.random.default_rng(1))), p0)


def test_bonus_token_after_full_acceptance_follows_p(
    context_logits: tuple[mx.array, mx.array],
) -> None:
    params = SamplingParams(temperature=2.5)
    p = distribution(context_logits[0], [params] * 3)
    q = distribution(context_logits[1], [params] * 2)
    _, n, nxt = verify(p, q, None, np.random.default_rng(3))
    assert (n == 2).sum() > DRAWS // 4
    assert_follows(nxt[n == 2], np.array(p[2]))


def test_sampled_first_token_follows_p_with_point_mass_drafts(
    context_logits: tuple[mx.array, mx.array],
) -> None:
    params = SamplingParams(temperature=2.0, top_k=30)
    p = distribution(context_logits[0], [params] * 3)
    p0 = np.array(p[0])
    second = int(np.argsort(-p0)[1])  # a plausible but not the likeliest token
    assert_follows(first_tokens(*verify(p, None, second, np.random.default_rng(2))), p0)


def test_seeded_uniforms_replay_the_same_acceptance(
    context_logits: tuple[mx.array, mx.array],
) -> None:
    params = SamplingParams(temperature=1.0, seed=9)
    p = distribution(context_logits[0], [params] * 3)[None]
    q = distribution(context_logits[1], [params] * 2)[None]
    drafts = mx.array([[int(mx.argmax(q[0, 0]).item()), int(mx.argmax(q[0, 1]).item())]])

    def once() -> tuple[int, int]:
        rng = RequestRng(9)
        u = rng.uniform(3)
        n, nxt = accept(p, q, drafts, mx.array([2]), u[None, :2], u[2:])
        return int(n[0]), int(nxt[0])

    assert once() == once()
