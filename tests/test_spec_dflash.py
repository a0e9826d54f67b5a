"""DFlash drafts through the `Speculator`: verified in the same step as MTP and n-gram
drafts, greedy output unchanged, exact rollback of its context, exact sampling, and the
cost controller turning it off and on.

The drafter is random (no trained one exists yet), so at temperature 0 its drafts are
almost always rejected; forced verify rounds and high temperatures exercise acceptance.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_pool import snapshots_equal
from test_spec import MODES, N_GEN, K, forced_rounds, prompts
from test_spec_acceptance import DRAWS, assert_follows, first_tokens, verify

from engine.cache import SlotId, SlotPool
from engine.generate import greedy_tokens
from engine.models.qwen35 import Model, load_model
from engine.runner import ModelRunner, Row
from engine.sampling import RequestRng, SamplingParams, distribution
from engine.spec.controller import CostController
from engine.spec.dflash import DFlashModel, load_dflash
from engine.spec.drafters import DFlashDrafter, Draft, Drafter, DraftJob, MTPDrafter, NgramDrafter
from engine.spec.offline import GREEDY, Request, generate
from engine.spec.speculator import DecodingSlot, Speculator
from scheduler.admission import MemoryBudget


@pytest.fixture(scope="module")
def model(make_model: Callable[..., Path]) -> Model:
    return load_model(make_model("tiny", quant="f32", tied_embeddings=True))


@pytest.fixture(scope="module")
def dflash(model: Model, make_dflash: Callable[..., Path]) -> DFlashModel:
    return load_dflash(make_dflash("tiny"), model)


def speculator(
    model: Model,
    dflash: DFlashModel,
    drafters: str,
    n_slots: int,
    context: int = 128,
    max_draft: int = K,
    controller: CostController | None = None,
) -> Speculator:
    pool = SlotPool(model.config, n_slots, context, mx.float32, max_draft=max_draft)
    runner = ModelRunner(model, pool)
    chosen: list[Drafter] = []
    if "ngram" in drafters:
        chosen.append(NgramDrafter())
    if "mtp" in drafters:
        chosen.append(MTPDrafter(runner))
    chosen.append(DFlashDrafter(runner, dflash))
    return Speculator(runner, max_draft, chosen, controller)


@pytest.mark.parametrize("n", [1, 8])
def test_greedy_output_is_unchanged_with_dflash_among_the_drafters(
    model: Model, dflash: DFlashModel, n: int
) -> None:
    """N = 8 mixes DFlash rounds with MTP and n-gram rounds and plain rows in each step."""
    spec = speculator(model, dflash, "ngram+mtp", n)
    chosen = prompts(8) if n > 1 else prompts(8)[2:3]
    modes = MODES if n > 1 else ["on"]
    requests = [Request(p, N_GEN, speculation=m) for p, m in zip(chosen, modes, strict=True)]
    run = generate(spec, requests)
    for r, tokens in zip(requests, run.tokens, strict=True):
        assert tokens == greedy_tokens(model, r.prompt, N_GEN)
    used = {d for s in run.stats for d in s.rounds_by_drafter}
    assert "dflash" in used and (n == 1 or used == {"ngram", "mtp", "dflash"})
    assert all(s.drafted == 0 for s, m in zip(run.stats, modes, strict=True) if m == "off")


def test_dflash_alone_keeps_greedy_output_and_reuses_slots(
    model: Model, dflash: DFlashModel
) -> None:
    spec = speculator(model, dflash, "", 3)
    for seed in (1, 2):
        requests = [Request(p, N_GEN, speculation="on") for p in prompts(3, seed)]
        run = generate(spec, requests)
        assert run.tokens == [greedy_tokens(model, r.prompt, N_GEN) for r in requests]
        assert all(s.rounds_by_drafter.get("dflash", 0) > 0 for s in run.stats)


def test_admission_prices_the_dflash_context_a_speculating_request_holds(
    model: Model, dflash: DFlashModel
) -> None:
    """A speculating request reserves its DFlash context K/V too, one without speculation
    does not; the whole default budget then covers exactly both pools' per-slot bytes."""
    spec = speculator(model, dflash, "", 3)
    pool, (drafter,) = spec.runner.pool, spec.drafters
    assert isinstance(drafter, DFlashDrafter)
    budget = MemoryBudget(pool, None, spec.drafter_bytes)
    context = 10 + 20 + K
    assert budget.price(10, 20, K) == pool.bytes_for(context, K) + drafter.pool.bytes_for(context)
    assert budget.price(10, 20, 0) == pool.bytes_for(10 + 20, 0)
    plain = pool.n_slots * pool.bytes_for(pool.max_context, K)
    assert budget.budget_bytes - plain == drafter.pool.total_bytes > 0


def test_rejected_drafts_leave_the_context_as_if_only_accepted_tokens_were_fed(
    model: Model, dflash: DFlashModel
) -> None:
    """400 verify rounds (4 slots x 100 steps) with forced random accept counts and ragged K.

    A reference slot per speculating slot is fed only the accepted tokens; at the end the
    speculating slot's DFlash context K/V (all positions, caught up) must equal the
    drafter's projection of the reference's target features, and its trunk state the
    reference's.
    """
    rng = np.random.default_rng(0)
    S, steps = 4, 100
    spec = speculator(model, dflash, "", 2 * S, context=8 + steps * (K + 1))
    pool = spec.runner.pool
    drafter = spec.drafters[0]
    assert isinstance(drafter, DFlashDrafter)
    slots = [pool.allocate() for _ in range(S)]
    refs = [pool.allocate() for _ in range(S)]
    _, replays = forced_rounds(spec, slots, refs, prompts(S, 9), steps, rng, drafter.layers)
    features = [[o.taps for o in outs if o.taps is not None] for outs in replays]
    drafter.catch_up(slots)
    for s, ref, feats in zip(slots, refs, features, strict=True):
        n = pool.lengths[s]
        assert drafter.pool.lengths[s] == n == pool.lengths[ref]
        assert snapshots_equal(pool.snapshot(s), pool.snapshot(ref), atol=1e-5)
        want = dflash.context(mx.concatenate(feats), mx.arange(n))
        for layer, (k, v) in enumerate(want):
            np.testing.assert_allclose(
                np.array(drafter.pool.k[layer, s, :n]), np.array(k), atol=1e-4
            )
            np.testing.assert_allclose(
                np.array(drafter.pool.v[layer, s, :n]), np.array(v), atol=1e-4
            )


@pytest.mark.parametrize("max_backlog", [4, 256])
def test_a_full_backlog_is_caught_up_in_a_step_that_does_not_draft(
    model: Model, dflash: DFlashModel, max_backlog: int
) -> None:
    spec = speculator(model, dflash, "", 1)
    drafter = spec.drafters[0]
    assert isinstance(drafter, DFlashDrafter)
    drafter.max_backlog = max_backlog
    slot = spec.runner.pool.allocate()
    prompt = prompts(1, 5)[0]
    row = spec.prefill_row(slot, prompt, 0, "on")
    spec.prefilled(row, spec.runner.step([row]).rows[0])
    d = DecodingSlot(slot, 7, [*prompt, 7], GREEDY, RequestRng(0), "on", max_draft=0)
    rows = spec.plan([d])
    assert rows[0].tokens == [7] and rows[0].taps == drafter.layers
    caught_up = len(prompt) if len(prompt) >= max_backlog else 0
    assert drafter.pool.lengths[slot] == caught_up
    committed = spec.resolve([d], spec.runner.step(rows).rows)[0]
    d.history += committed.tokens
    d.pending = committed.tokens[-1]
    assert drafter.available(d, len(prompt) + 1) == dflash.config.block_size - 1  # in step


@pytest.fixture(scope="module")
def dflash_q(model: Model, dflash: DFlashModel) -> tuple[mx.array, mx.array, SamplingParams]:
    """(target p `[3, V]`, the DFlash drafter's own q `[2, V]` of its first two drafts,
    params) after a fixed context, at a temperature where the random drafter's q overlaps p."""
    params = SamplingParams(temperature=12.0)
    spec = speculator(model, dflash, "", 1)
    runner = spec.runner
    slot = runner.pool.allocate()
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 512, 12)]
    row = spec.prefill_row(slot, prompt, 0, "on")
    out = runner.step([row]).rows[0]
    spec.prefilled(row, out)
    pending = int(mx.argmax(out.logits[-1]).item())
    d = DecodingSlot(slot, pending, [*prompt, pending], params, RequestRng(0), "on")
    draft: Draft = spec.drafters[0].draft([DraftJob(d, 2, len(prompt))])[0]
    assert draft.q is not None and len(draft.tokens) == 2
    verified = runner.step([Row(slot, [pending, *draft.tokens], len(prompt), want=range(3))])
    p = distribution(verified.rows[0].logits, [params] * 3)
    return p, draft.q, params


def test_sampled_first_token_follows_p_with_dflash_drafts(
    dflash_q: tuple[mx.array, mx.array, SamplingParams],
) -> None:
    p, q, _ = dflash_q
    p0, q0 = np.array(p[0]), np.array(q[0])
    assert 0.2 < np.abs(p0 - q0).sum() < 1.5  # q differs from p, yet drafts get accepted
    assert_follows(first_tokens(*verify(p, q, None, np.random.default_rng(1))), p0)


def test_bonus_token_after_full_dflash_acceptance_follows_p(
    dflash_q: tuple[mx.array, mx.array, SamplingParams],
) -> None:
    p, q, _ = dflash_q
    _, n, nxt = verify(p, q, None, np.random.default_rng(3))
    assert (n == 2).sum() > DRAWS // 10
    assert_follows(nxt[n == 2], np.array(p[2]))


def test_the_controller_turns_dflash_off_where_it_does_not_pay_and_on_where_it_does(
    model: Model, dflash: DFlashModel
) -> None:
    """The real step clock decides. The "pays" case is honest: at temperature 100 the
    target's p and the random drafter's q are both nearly uniform, so exact acceptance
    keeps about 95% of draft tokens (the sum of min(p, q)) and a 7-token block commits
    ~6 tokens for one step that costs a few plain ones. At temperature 0 the same
    drafter's argmax almost never matches the target's: drafting only costs, and the
    controller stops. Turning back on takes a long request: the slot's rate starts
    from the drafter's poor record and must fade back up before it is tried again;
    after that success, the next requests start from the better record.
    """

    def scenario() -> tuple[float, float, CostController]:
        """Share of verify steps of a greedy batch after a greedy one, and of a hot batch
        after a long hot one, with a fresh controller."""
        ctrl = CostController()
        spec = speculator(model, dflash, "", 4, context=1024, max_draft=7, controller=ctrl)

        def share(params: SamplingParams, tokens: int, seed: int) -> float:
            """Share of the steps of 4 requests that verified DFlash drafts."""
            requests = [
                Request(p, tokens, params, speculation="auto", seed=seed) for p in prompts(4, seed)
            ]
            stats = generate(spec, requests).stats
            return sum(s.verify_rounds for s in stats) / sum(s.steps for s in stats)

        hot = SamplingParams(temperature=100.0)
        share(GREEDY, 128, 10)
        off = share(GREEDY, 128, 11)
        share(hot, 640, 12)
        return off, share(hot, 192, 13), ctrl

    # The clock is real, and this machine is shared: a noisy sample of a drafting step can
    # keep drafting off for a while (about one run in ten of this file, more late in the
    # whole suite). So the scenario may run twice and must pass once: a controller that
    # never turns off, or never back on, fails both.
    for _ in range(2):
        off, on, ctrl = scenario()
        if off < 0.1 and on > 0.6:
            break
    assert off < 0.1, off  # off where it does not pay
    assert on > 0.6, on  # and on where it does
    assert ctrl.rate(SlotId(0), "dflash") > 0.8
