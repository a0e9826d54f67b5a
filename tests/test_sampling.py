"""Sampling: each transformation does what it says, draws follow p, seeds replay."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats

from engine.sampling import (
    CANDIDATES,
    DRAW_BLOCK,
    HOST_CANDIDATES,
    RequestRng,
    SamplingError,
    SamplingParams,
    Shaping,
    _device_logprobs,
    _host_logprobs,
    _weighted_at_or_after,
    adjust_logits,
    device_tokens,
    distribution,
    draw,
    draw_block,
    host_tokens,
    sample,
)

V = 50


def logits(n: int = 1, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).normal(0, 2, (n, V)).astype(np.float32))


def test_greedy_is_one_hot_at_the_argmax() -> None:
    x = logits()
    p = np.array(distribution(x, [SamplingParams(temperature=0.0)]))
    assert p[0].argmax() == int(mx.argmax(x[0]).item()) and p[0].max() == 1.0 and p.sum() == 1.0


def test_temperature_scales_logits() -> None:
    x = logits()
    p = np.array(distribution(x, [SamplingParams(temperature=0.5)]))[0]
    want = np.exp(np.array(x[0]) / 0.5)
    np.testing.assert_allclose(p, want / want.sum(), rtol=1e-5)


def test_top_k_keeps_exactly_k_tokens() -> None:
    x = logits()
    p = np.array(distribution(x, [SamplingParams(top_k=7)]))[0]
    assert (p > 0).sum() == 7
    assert set(np.flatnonzero(p)) == set(np.argsort(-np.array(x[0]))[:7])


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    x = logits()
    p_full = np.array(distribution(x, [SamplingParams()]))[0]
    p = np.array(distribution(x, [SamplingParams(top_p=0.6)]))[0]
    kept = np.sort(p_full[p > 0])[::-1]
    assert kept.sum() >= 0.6 and kept[:-1].sum() < 0.6


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    x = logits()
    p_full = np.array(distribution(x, [SamplingParams()]))[0]
    p = np.array(distribution(x, [SamplingParams(min_p=0.2)]))[0]
    assert set(np.flatnonzero(p)) == set(np.flatnonzero(p_full >= 0.2 * p_full.max()))


def test_rows_use_their_own_parameters() -> None:
    x = mx.concatenate([logits(seed=1)] * 3)
    params = [SamplingParams(top_k=3), SamplingParams(temperature=0.0), SamplingParams()]
    p = np.array(distribution(x, params))
    assert (p[0] > 0).sum() == 3 and p[1].max() == 1.0 and (p[2] > 0).sum() == V


def test_penalties_and_bias_follow_llama_cpp_formulas() -> None:
    x = mx.array([[2.0, -2.0, 1.0, 0.5]])
    params = SamplingParams(
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logit_bias=((3, 5.0),),
    )
    out = np.array(adjust_logits(x, [params], [[0, 1, 1]]))[0]
    np.testing.assert_allclose(out, [2.0 / 2 - 0.5 - 0.25, -2.0 * 2 - 0.5 - 0.5, 1.0, 5.5])


def test_penalties_and_bias_over_long_histories_match_the_formulas_row_by_row() -> None:
    """Rows with penalties only, a bias only, both (biased tokens seen and unseen, one given
    twice), none, and an empty history: each logit as the formulas give it, counted by hand."""
    rng = np.random.default_rng(6)
    x = rng.normal(0, 2, (5, V)).astype(np.float32)
    histories = [rng.integers(0, V, 3000).tolist() for _ in range(4)] + [[]]
    pen = {"repetition_penalty": 1.3, "presence_penalty": 0.7, "frequency_penalty": 0.05}
    bias = ((3, 4.0), (int(histories[2][0]), -2.5), (3, 1.5))
    params = [
        SamplingParams(**pen),
        SamplingParams(logit_bias=bias),
        SamplingParams(logit_bias=bias, **pen),
        SamplingParams(),
        SamplingParams(logit_bias=bias, **pen),
    ]
    got = np.array(adjust_logits(mx.array(x), params, histories))
    want = x.astype(np.float64)
    for i, (p, hist) in enumerate(zip(params, histories, strict=True)):
        counts = np.bincount(hist, minlength=V) if p.penalized else np.zeros(V, int)
        b = np.zeros(V)
        for t, v in dict(p.logit_bias).items():
            b[t] = v
        seen = counts > 0
        scale = np.where(seen, p.repetition_penalty, 1.0)
        row = np.where(want[i] > 0, want[i] / scale, want[i] * scale)
        want[i] = row + b - np.where(seen, p.presence_penalty, 0.0) - p.frequency_penalty * counts
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


def test_draws_follow_the_distribution() -> None:
    x = logits(seed=3)
    p = np.array(distribution(x, [SamplingParams(temperature=0.8, top_k=10)]))[0]
    rng = RequestRng(1)
    n = 20_000
    probs = mx.broadcast_to(mx.array(p)[None], (n, V))
    toks = np.array(draw(probs, rng.uniform(n)))
    support = np.flatnonzero(p)
    assert set(np.unique(toks)) <= set(support)
    counts = np.bincount(toks, minlength=V)[support]
    expected = p[support].astype(np.float64) / p[support].sum() * n
    assert stats.chisquare(counts, expected * counts.sum() / expected.sum()).pvalue > 0.01


def test_a_seed_replays_the_same_uniforms() -> None:
    assert np.array_equal(RequestRng(42).uniform(5), RequestRng(42).uniform(5))
    assert RequestRng(None).seed != RequestRng(None).seed


MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.3, top_k=5, min_p=0.02),
    SamplingParams(temperature=0.7),
]


@pytest.mark.parametrize(
    "params", [MIXED * 3, [SamplingParams(temperature=0.0)] * 7, MIXED[3:] * 4], ids=str
)
def test_sample_gives_the_tokens_of_distribution_and_draw(params: list[SamplingParams]) -> None:
    """The batched-by-kind path draws exactly what the general one does; greedy rows take
    no uniform from their generator."""
    x = logits(len(params), seed=9)
    got = sample(x, params, [RequestRng(i) for i in range(len(params))])
    rngs = [RequestRng(i) for i in range(len(params))]
    u = np.array([0.5 if p.greedy else rngs[i].uniform(1)[0] for i, p in enumerate(params)])
    want = np.array(draw(distribution(x, params), u))
    assert got.tolist() == want.tolist()
    argmax = np.array(mx.argmax(x, axis=-1))
    assert all(got[i] == argmax[i] for i, p in enumerate(params) if p.greedy)


def test_a_peeked_uniform_stays_first_in_the_stream() -> None:
    """`peek` leaves the stream as it was: the draws after it are those without it, in any
    sizes (a verify round takes several at once)."""
    plain, peeking = RequestRng(11), RequestRng(11)
    first = peeking.peek()
    assert peeking.peek() == first  # (peeking twice takes nothing)
    got = np.concatenate([peeking.uniform(0), peeking.uniform(3), peeking.uniform(1)])
    assert got[0] == first and np.array_equal(got, plain.uniform(4))
    assert peeking.uniform(2).tolist() == plain.uniform(2).tolist()


@pytest.mark.parametrize("params", [MIXED * 2, [SamplingParams(temperature=0.0)] * 3, MIXED[3:]])
def test_device_tokens_are_the_tokens_sample_draws(params: list[SamplingParams]) -> None:
    """Given each sampled row's next uniform (peeked), `device_tokens` gives on the device
    the tokens `sample` then draws from the same generators."""
    x = logits(len(params), seed=21)
    rngs = [RequestRng(50 + i) for i in range(len(params))]
    uniforms = [rngs[i].peek() for i, p in enumerate(params) if not p.greedy]
    ahead = device_tokens(x, params, uniforms)
    assert np.array(ahead).tolist() == sample(x, params, rngs).tolist()


def test_a_sampled_row_draws_the_same_token_whatever_shares_its_batch() -> None:
    x = logits(len(MIXED), seed=4)
    for i, p in enumerate(MIXED):
        alone = sample(x[i : i + 1], [p], [RequestRng(100 + i)])
        batch = sample(x, MIXED, [RequestRng(100 + j) for j in range(len(MIXED))])
        assert alone[0] == batch[i]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=-1.0),
        SamplingParams(top_p=0.0),
        SamplingParams(min_p=1.0),
        SamplingParams(top_k=-1),
        SamplingParams(logit_bias=((V, 1.0),)),
        SamplingParams(logprobs=21),
    ],
)
def test_out_of_range_parameters_are_rejected(params: SamplingParams) -> None:
    with pytest.raises(SamplingError):
        params.validate(V)


# A vocabulary past `draw`'s flat scan and `CANDIDATES` (and not a multiple of `DRAW_BLOCK`)
BIG_V = 20_011
KINDS = [
    SamplingParams(temperature=0.9),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.8),  # Qwen's recommended settings
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=1.2, top_k=CANDIDATES),  # the candidates' largest top-k
    SamplingParams(temperature=1.2, top_k=CANDIDATES + 1, top_p=0.95),  # past them
]


def reference_tokens(
    z32: np.ndarray, p: SamplingParams, us: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The rule in float64 from one row's logits (distinct values): the token of each u, and
    how far u is from the nearest step of the CDF (relative to the total)."""
    z = z32.astype(np.float64) / p.temperature
    order = np.argsort(-z, kind="stable")
    zs = z[order]
    k = p.top_k if p.top_k else z.size
    e = np.exp(zs - zs[0]) * (np.arange(z.size) < k)
    ps = e / e.sum()
    keep = (np.arange(z.size) < k) & (np.cumsum(ps) - ps < p.top_p) & (ps >= p.min_p * ps[0])
    keep[0] = True
    w = np.zeros(z.size)
    w[order[keep]] = np.exp(zs[keep] - zs[0])
    cdf = np.cumsum(w) / w.sum()
    tokens = np.searchsorted(cdf, us, side="right")
    steps = np.concatenate([[0.0], cdf[w > 0]])
    margin = np.abs(us[:, None] - steps[None, :]).min(axis=1)
    return tokens, margin


@pytest.mark.parametrize("V_", [BIG_V, 21 * 970], ids=["padded", "divided"])
@pytest.mark.parametrize("p", KINDS, ids=str)
def test_every_path_draws_the_reference_token_from_a_large_vocabulary(
    p: SamplingParams, V_: int
) -> None:
    """`sample` (the host's numpy), `device_tokens` (partitioned candidates, blocked draw:
    a prime vocabulary padded to blocks of 1,024, or one blocked by a divisor) and
    `draw(distribution(...))` give the float64 rule's token for each uniform, except where
    u lies within rounding of a step of the CDF."""
    row = np.random.default_rng(7).normal(0, 3, V_).astype(np.float32)
    us = np.random.default_rng(8).random(48)
    want, margin = reference_tokens(row, p, us)
    x = mx.array(np.broadcast_to(row, (us.size, V_)).copy())
    params = [p] * us.size
    clear = margin > 1e-5
    assert clear.sum() >= 0.9 * us.size
    paths = {
        "sample": host_tokens(np.array(x), params, us.tolist()),
        "device_tokens": np.array(device_tokens(x, params, us.tolist())),
        "draw(distribution)": np.array(draw(distribution(x, params), us)),
    }
    for name, got in paths.items():
        assert got[clear].tolist() == want[clear].tolist(), name


@pytest.mark.parametrize("p", [KINDS[1], KINDS[4]], ids=["qwen", "top_k_1024"])
def test_a_top_k_distribution_from_candidates_is_the_sorted_one(p: SamplingParams) -> None:
    """`distribution` of rows whose top-k is at most `CANDIDATES` (a partition, no sort of
    the vocabulary) has the support and, to float rounding, the values of the whole sort's,
    a greedy row beside them still its one-hot."""
    params = [p, SamplingParams(temperature=0.0), p]
    x = mx.array(np.random.default_rng(5).normal(0, 3, (3, BIG_V)).astype(np.float32))
    shaping = Shaping.of(params)
    assert shaping.candidates
    got = np.array(shaping(x))
    want = np.array(replace(shaping, candidates=False)(x))
    assert np.array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)
    assert got[1].max() == 1.0 and got[1].argmax() == np.array(x[1]).argmax()


@pytest.mark.parametrize("V", [100, 3 * DRAW_BLOCK + 5, 5 * 970])
def test_draw_never_picks_a_token_of_weight_zero(V: int) -> None:
    """Whatever u, a draw lands on weight — the first weighted token at u = 0, the last at
    the largest u below 1 — flat or blocked (weight on both sides of a block's edge)."""
    w = np.zeros(V, dtype=np.float32)
    L = draw_block(V)
    weighted = [3, V // 2, V - 7] if V < DRAW_BLOCK else [3, L - 1, L, V - 7]
    w[weighted] = [0.5, 1.0, 2.0, 0.5][: len(weighted)]
    us = np.array([0.0, 1e-12, 0.3, 0.7, 1 - 1e-7, np.nextafter(np.float32(1), 0)])
    got = np.array(draw(mx.array(np.broadcast_to(w, (us.size, V)).copy()), us)).tolist()
    assert set(got) <= set(weighted)
    assert got[0] == weighted[0] and got[-1] == weighted[-1]


def test_a_draw_sent_to_weight_zero_by_rounding_moves_to_the_next_weighted_token() -> None:
    """Where a scan's rounding (a GPU's parallel scan need not be monotone over zeros) or a
    u near 1 points a draw at weight 0 or past the row, it takes the next weighted token,
    else the last."""
    w = mx.array([[0.0, 0.0, 1.0, 0.0, 2.0, 0.0]] * 5)
    i = mx.array([0, 3, 4, 5, 6])
    assert np.array(_weighted_at_or_after(w, i)).tolist() == [2, 4, 4, 4, 4]


def test_a_sampled_row_on_the_device_draws_the_same_token_whatever_shares_its_batch() -> None:
    """`device_tokens` runs a row by the kind of its own truncation (candidates or the whole
    vocabulary), so a row alone and the same row among others of every kind draw alike."""
    rng = np.random.default_rng(12)
    params = [*KINDS, SamplingParams(temperature=0.0), *KINDS[:2]]
    x = mx.array(rng.normal(0, 3, (len(params), 3000)).astype(np.float32))
    u = rng.random(len(params))
    batch = np.array(device_tokens(x, params, [u[i] for i, p in enumerate(params) if not p.greedy]))
    for i, p in enumerate(params):
        alone = device_tokens(x[i : i + 1], [p], [] if p.greedy else [u[i]])
        assert int(alone[0]) == batch[i]


def test_the_host_keeps_tied_logits_in_vocabulary_order_as_a_full_sort_would() -> None:
    """More tied logits than `HOST_CANDIDATES` at the edge of a nucleus: the host widens its
    candidates until none outside could be kept, so exactly the lowest-numbered ties are."""
    V, ties = 4000, HOST_CANDIDATES + 100
    z = np.full(V, -5.0, dtype=np.float32)
    at = np.random.default_rng(3).choice(V, ties, replace=False)
    z[at] = 2.0  # each tie ~1/ties of the mass: a top-p of 0.1 keeps ~ties/10 of them
    p = SamplingParams(temperature=1.0, top_p=0.1)
    us = np.linspace(0.0, 0.999, 400)
    got = {
        int(t)
        for t in host_tokens(np.broadcast_to(z, (us.size, V)).copy(), [p] * us.size, us.tolist())
    }
    want, _ = reference_tokens(z, p, us)
    assert got == set(want.tolist()) and got <= set(np.sort(at)[: ties // 5].tolist())


@pytest.mark.parametrize("V_", [V, BIG_V])
def test_token_logprobs_are_the_log_softmax_and_its_top_n_in_order(V_: int) -> None:
    """The chosen tokens' and the top n's log-probabilities are log-softmax values (float64
    reference), the top n the n largest, most likely first; by the host and on the device
    (there equal values may come in any order: the ties are checked by value)."""
    rng = np.random.default_rng(2)
    x = rng.normal(0, 3, (3, V_)).astype(np.float32)
    x[1, :7] = x[1].max() + 1.0  # ties at the top: listed by id
    tokens = [5, 0, V_ - 1]
    ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum(-1, keepdims=True))
    host = _host_logprobs(x, tokens, 5)
    assert host[1][1].tolist() == [0, 1, 2, 3, 4]  # (the host lists equal values by id)
    for chosen, ids, top in (host, _device_logprobs(mx.array(x), tokens, 5)):
        np.testing.assert_allclose(chosen, ref[np.arange(3), tokens], atol=1e-4)
        np.testing.assert_allclose(top, np.take_along_axis(ref, ids, -1), atol=1e-4)
        assert ids.shape == (3, 5) and np.all(np.diff(top, axis=-1) <= 0)
        assert set(ids[1].tolist()) <= set(range(7))
        want = np.sort(ref, axis=-1)[:, ::-1][:, :5]
        np.testing.assert_allclose(top, want, atol=1e-4)


def test_a_vocabulary_is_blocked_by_a_divisor_where_it_has_one() -> None:
    assert draw_block(248_320) == 970 and draw_block(151_936) == 1187
    assert draw_block(BIG_V) == DRAW_BLOCK  # (a prime: padded)


@pytest.mark.parametrize("temperature", [1e-45, 1e-39, 1e-30])
@pytest.mark.parametrize(
    "truncation", [{}, {"top_k": 20, "top_p": 0.8}, {"top_p": 0.9}], ids=["none", "qwen", "top_p"]
)
def test_a_temperature_too_small_for_float32_draws_its_limit_the_argmax(
    temperature: float, truncation: dict[str, Any]
) -> None:
    """A valid temperature that is 0 or subnormal in float32 (or whose quotients would
    overflow) draws the largest logit on every path, whatever u — it drew token 0 or the
    vocabulary's last before the logits' largest was taken from them first."""
    x = mx.array(np.random.default_rng(9).normal(0, 30, (3, BIG_V)).astype(np.float32))
    params = [SamplingParams(temperature=temperature, **truncation)] * 3
    us = [0.001, 0.5, 0.999]
    want = np.array(x).argmax(axis=-1).tolist()
    assert host_tokens(np.array(x), params, us).tolist() == want
    assert np.array(device_tokens(x, params, us)).tolist() == want
    assert np.array(draw(distribution(x, params), np.array(us))).tolist() == want
