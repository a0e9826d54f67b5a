"""Speculative decoding end to end: greedy output is unchanged, rollback is exact, seeds replay.

The model is the tiny preset with tied embeddings: its greedy continuations fall into
loops, so prompt-lookup drafts really get accepted. (A random-weight MTP head almost
never agrees with its trunk; the random verify rounds force acceptances instead.)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_pool import snapshots_equal

from engine.cache import SlotId, SlotPool, SlotSnapshot
from engine.generate import greedy_tokens
from engine.models.qwen35 import Model, load_model
from engine.runner import DraftRow, ModelRunner, Row, RowOutput, verified_logits
from engine.sampling import RequestRng, SamplingParams
from engine.spec.drafters import Drafter, MTPDrafter, NgramDrafter
from engine.spec.offline import GREEDY, Request, generate
from engine.spec.speculator import (
    Committed,
    DecodingSlot,
    Drawn,
    PlainStep,
    SpecError,
    Speculator,
    sample_rows,
)

K = 4
N_GEN = 24
MODES = ["off", "on", "auto", "on", "on", "off", "auto", "off"]  # prompts 1, 4, 6, 7 loop


@pytest.fixture(scope="module")
def model(make_model: Callable[..., Path]) -> Model:
    return load_model(make_model("tiny", quant="f32", tied_embeddings=True))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Repetitive prompts: a short random phrase said three times."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 512, 3 + i % 4)] * 3 for i in range(n)]


def speculator(
    model: Model, drafters: str, n_slots: int, context: int = 128, compile: bool = False
) -> Speculator:
    pool = SlotPool(model.config, n_slots, context, mx.float32, max_draft=K)
    runner = ModelRunner(model, pool, compile=compile)
    chosen: list[Drafter] = []
    if "ngram" in drafters:
        chosen.append(NgramDrafter())
    if "mtp" in drafters:
        chosen.append(MTPDrafter(runner))
    return Speculator(runner, K, chosen)


@pytest.fixture(scope="module")
def solo(model: Model) -> Callable[[list[int]], list[int]]:
    cache: dict[tuple[int, ...], list[int]] = {}

    def run(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in cache:
            cache[tuple(prompt)] = greedy_tokens(model, prompt, N_GEN)
        return cache[tuple(prompt)]

    return run


@pytest.mark.parametrize("n", [1, 8])
@pytest.mark.parametrize("drafters", ["ngram", "mtp"])
def test_greedy_speculation_is_token_identical_to_plain_decoding(
    model: Model, solo: Callable[[list[int]], list[int]], drafters: str, n: int
) -> None:
    """N = 8 mixes speculating slots ("on", "auto") with plain ones ("off") in every step."""
    spec = speculator(model, drafters, n)
    chosen = prompts(8) if n > 1 else prompts(8)[1:2]
    modes = MODES if n > 1 else ["on"]
    requests = [Request(p, N_GEN, speculation=m) for p, m in zip(chosen, modes, strict=True)]
    run = generate(spec, requests)
    for r, tokens in zip(requests, run.tokens, strict=True):
        assert tokens == solo(r.prompt)
    by_mode = {m: [s for s, x in zip(run.stats, modes, strict=True) if x == m] for m in modes}
    assert all(s.drafted == 0 for s in by_mode.get("off", []))
    assert all(s.verify_rounds > 0 for s in by_mode["on"])
    if drafters == "ngram":
        assert sum(s.accepted for s in by_mode["on"]) >= N_GEN // 2


Layout = tuple[tuple[int, ...], tuple[bool, ...]]  # a step's row lengths and capture flags


def run_recording_layouts(
    spec: Speculator, requests: list[Request]
) -> tuple[list[list[int]], list[Layout], list[tuple[int, ...]]]:
    """`generate`, recording each verify step's layout and each MTP catch-up's row lengths."""
    verify: list[Layout] = []
    catch_up: list[tuple[int, ...]] = []
    step, draft = spec.runner.step, spec.runner.draft

    def recording(batch: list[Row]) -> object:
        if any(r.capture for r in batch):
            verify.append((tuple(len(r.tokens) for r in batch), tuple(r.capture for r in batch)))
        return step(batch)

    def drafting(rows: list[DraftRow], ends: list[int] | None = None) -> object:
        catch_up.append(tuple(len(r.tokens) for r in rows))
        return draft(rows, ends)

    spec.runner.step = recording  # type: ignore[method-assign]
    spec.runner.draft = drafting  # type: ignore[method-assign]
    run = generate(spec, requests)
    assert sum(s.accepted for s in run.stats) > 0 and any(s.drafted == 0 for s in run.stats)
    return run.tokens, verify, catch_up


@pytest.mark.parametrize("drafters", ["ngram", "ngram+mtp"])
def test_uniform_verify_rows_keep_greedy_output_and_make_every_layout_uniform(
    model: Model, solo: Callable[[list[int]], list[int]], drafters: str
) -> None:
    """`uniform_verify` (a compiled runner's default): in a step where any slot drafts, every
    row feeds 1 + the deepest draft tokens — shorter drafts and plain rows padded with filler
    that is rolled back unread — and captures; the MTP head's catch-up rows are padded alike.
    So a verify step's layout is its rows and depth only (what a compiled forward is keyed
    on), where the same run with ragged rows mixes lengths and capture flags; outputs stay
    those of plain decoding either way."""
    requests = [Request(p, N_GEN, speculation=m) for p, m in zip(prompts(8), MODES, strict=True)]
    for uniform in (True, False):
        spec = speculator(model, drafters, 8)
        spec.use_uniform_shapes(uniform)  # its MTP head's catch-up rows too
        tokens, verify, catch_up = run_recording_layouts(spec, requests)
        assert tokens == [solo(r.prompt) for r in requests]
        assert verify and ("mtp" in drafters) == bool(catch_up)
        alike = [len(set(lengths)) == 1 and all(flags) for lengths, flags in verify]
        # (a row may fall short of the others only where its slot's context has no room)
        assert all(alike) if uniform else not any(alike)
        if "mtp" in drafters:
            same = [len(set(lengths)) == 1 for lengths in catch_up]
            assert all(same) if uniform else not all(same)


def test_both_drafters_together_and_slot_reuse_keep_greedy_output(
    model: Model, solo: Callable[[list[int]], list[int]]
) -> None:
    spec = speculator(model, "ngram+mtp", 4)
    for seed in (1, 2):  # the second run reuses the first run's slots
        requests = [Request(p, N_GEN, speculation="on") for p in prompts(4, seed)]
        run = generate(spec, requests)
        assert run.tokens == [solo(r.prompt) for r in requests]
        assert {d for s in run.stats for d in s.rounds_by_drafter} == {"ngram", "mtp"}


def test_seeded_sampling_replays_whatever_else_shares_the_batch(model: Model) -> None:
    params = SamplingParams(temperature=0.9, top_k=50)
    mine = Request(prompts(1, 5)[0], N_GEN, params, speculation="on", seed=1234)
    others = [
        Request(p, N_GEN, params, speculation=m, seed=i)
        for i, (p, m) in enumerate(zip(prompts(5, 6), MODES, strict=False))
    ]
    alone = generate(speculator(model, "ngram+mtp", 1), [mine]).tokens[0]
    again = generate(speculator(model, "ngram+mtp", 1), [mine]).tokens[0]
    batched = generate(speculator(model, "ngram+mtp", 6), [*others, mine]).tokens[-1]
    assert alone == again == batched


def test_telemetry_adds_up(model: Model) -> None:
    run = generate(
        speculator(model, "ngram+mtp", 4),
        [Request(p, N_GEN, speculation="auto") for p in prompts(4, 3)],
    )
    for s in run.stats:
        assert s.steps == sum(s.choices.values())
        assert s.drafted == sum(k * n for k, n in s.choices.items())
        assert (
            s.verify_rounds
            == sum(n for k, n in s.choices.items() if k)
            == sum(s.rounds_by_drafter.values())
        )
        assert s.accepted == sum(s.accepted_at_depth) <= s.drafted
        assert all(
            a >= b for a, b in zip(s.accepted_at_depth, s.accepted_at_depth[1:], strict=False)
        )


def forced_logits(drafts: list[int], accept: int, rng: np.random.Generator) -> mx.array:
    """Greedy target logits `[k+1, V]` that accept exactly `accept` of `drafts`."""
    out = np.zeros((len(drafts) + 1, 512), dtype=np.float32)
    for j, t in enumerate(drafts[:accept]):
        out[j, t] = 10.0
    choices = [t for t in range(512) if accept == len(drafts) or t != drafts[accept]]
    out[accept, int(rng.choice(choices))] = 10.0
    return mx.array(out)


def forced_rounds(
    spec: Speculator,
    slots: list[SlotId],
    refs: list[SlotId],
    starts: list[list[int]],
    steps: int,
    rng: np.random.Generator,
    taps: tuple[int, ...] = (),
) -> tuple[list[DecodingSlot], list[list[RowOutput]]]:
    """Prefill `starts` into `slots` (speculating, mode "on") and `refs`, then run `steps`
    verify rounds with random ragged K and forced random accept counts; each reference slot
    is fed only the accepted tokens. Returns the decoding slots and, per reference slot, the
    outputs of all its rows (hidden states at every position, and `taps`)."""
    runner, pool, S = spec.runner, spec.runner.pool, len(slots)
    rows = [spec.prefill_row(s, p, 0, "on") for s, p in zip(slots, starts, strict=True)]
    out = runner.step(
        rows
        + [
            Row(r, p, 0, want=range(len(p)), want_hidden=True, taps=taps)
            for r, p in zip(refs, starts, strict=True)
        ]
    ).rows
    for row, o in zip(rows, out[:S], strict=True):
        spec.prefilled(row, o)
    replays = [[o] for o in out[S:]]
    states = [
        DecodingSlot(s, 7, [*p, 7], GREEDY, RequestRng(i), "on")
        for i, (s, p) in enumerate(zip(slots, starts, strict=True))
    ]
    for _ in range(steps):
        for d in states:
            d.max_draft = int(rng.integers(0, K + 1))
        rows = spec.plan(states)
        real = runner.step(rows).rows
        accepts = [int(rng.integers(0, len(r.tokens))) for r in rows]
        forced = [
            RowOutput(forced_logits(list(r.tokens[1:]), a, rng), o.hidden, taps=o.taps)
            for r, a, o in zip(rows, accepts, real, strict=True)
        ]
        committed = spec.resolve(states, forced)
        assert [c.accepted for c in committed] == accepts
        replay = [
            Row(
                ref,
                list(r.tokens[: a + 1]),
                pool.lengths[ref],
                want=range(a + 1),
                want_hidden=True,
                taps=taps,
            )
            for ref, r, a in zip(refs, rows, accepts, strict=True)
        ]
        for outs, o in zip(replays, runner.step(replay).rows, strict=True):
            outs.append(o)
        for d, c in zip(states, committed, strict=True):
            d.history += c.tokens
            d.pending = c.tokens[-1]
    return states, replays


def test_random_verify_rounds_track_a_replay_of_accepted_tokens(model: Model) -> None:
    """1,000 verify rounds (8 slots x 125 steps), ragged K, forced random accept counts.

    Each speculating slot has a reference slot that is fed only the accepted tokens; at
    the end their trunk state must match, and the speculating slot's MTP KV must equal
    the head run afresh over (x_{t+1}, h_t) of the reference's committed sequence.
    """
    rng = np.random.default_rng(0)
    S, steps = 8, 125
    spec = speculator(model, "mtp", 2 * S, context=8 + steps * (K + 1))
    runner, pool = spec.runner, spec.runner.pool
    starts = prompts(S, 9)
    slots = [pool.allocate() for _ in range(S)]
    refs = [pool.allocate() for _ in range(S)]
    states, replays = forced_rounds(spec, slots, refs, starts, steps, rng)
    ref_hidden = [[o.hidden for o in outs if o.hidden is not None] for outs in replays]
    m = [pool.mtp_lengths[s] for s in slots]
    runner.draft(
        [
            DraftRow(ref, d.history[1 : n + 1], mx.concatenate(h)[:n], 0)
            for ref, d, h, n in zip(refs, states, ref_hidden, m, strict=True)
        ]
    )
    for s, ref, n in zip(slots, refs, m, strict=True):
        assert pool.lengths[s] - K - 1 <= n < pool.lengths[s]
        a, b = pool.snapshot(s), pool.snapshot(ref)
        assert snapshots_equal(a, b, atol=1e-5)
        assert a.mtp_kv is not None and b.mtp_kv is not None
        for x, y in zip(a.mtp_kv, b.mtp_kv, strict=True):
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-4)


def test_mtp_drafts_are_the_heads_greedy_chain(model: Model) -> None:
    """Catch-up over the prompt at (x_{t+1}, h_t) then h' fed back one position further on,
    as `test_mtp_parity` checks against llama.cpp."""
    prompt, pending = prompts(2, 4)[1], 7
    spec = speculator(model, "mtp", 1)
    slot = spec.runner.pool.allocate()
    row = spec.prefill_row(slot, prompt, 0, "on")
    spec.prefilled(row, spec.runner.step([row]).rows[0])
    d = DecodingSlot(slot, pending, [*prompt, pending], GREEDY, RequestRng(0), "on")
    drafted = list(spec.plan([d])[0].tokens[1:])

    ref = speculator(model, "", 1).runner
    s = ref.pool.allocate()
    out = ref.step([Row(s, prompt, 0, want=range(len(prompt)), want_hidden=True)]).rows[0]
    assert out.hidden is not None
    logits, h = ref.draft([DraftRow(s, [*prompt[1:], pending], out.hidden, 0)])[0]
    chain = [int(mx.argmax(logits[-1]).item())]
    h = h[-1:]
    for k in range(1, K):
        logits, h = ref.draft([DraftRow(s, chain[-1:], h, len(prompt) + k - 1)])[0]
        chain.append(int(mx.argmax(logits[-1]).item()))
    assert drafted == chain


def test_penalties_see_each_verified_positions_own_history(model: Model) -> None:
    """Penalised greedy decoding: drafts change what each later position has seen."""
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    chosen = prompts(8)[:5]

    def run(mode: str) -> list[list[int]]:
        requests = [Request(p, N_GEN, params, speculation=mode) for p in chosen]
        result = generate(speculator(model, "ngram+mtp", 5), requests)
        if mode == "on":
            assert sum(s.accepted for s in result.stats) > 0
        return result.tokens

    assert run("on") == run("off")


def test_a_drafter_catching_up_on_its_backlog_is_not_timed(model: Model) -> None:
    """The first MTP round feeds the head the whole prompt: that step says nothing of what
    drafting costs, so the controller's table must not see it (its credit for re-tries
    must); the steady rounds after it, it must."""
    spec = speculator(model, "mtp", 1)
    timed: list[int] = []
    charged: list[int] = []
    observe, charge = spec.controller.observe_step, spec.controller.charge
    spec.controller.observe_step = lambda w, depth, s: (timed.append(depth), observe(w, depth, s))  # type: ignore[method-assign]
    spec.controller.charge = lambda w, depth, s: (charged.append(depth), charge(w, depth, s))  # type: ignore[method-assign]
    prompt = list(range(1, 21))  # 20 tokens: far more than a steady round's K + 1
    run = generate(spec, [Request(prompt, 8, GREEDY, speculation="on")])
    steps = run.stats[0].steps
    assert steps >= 3
    # every step drafts ("on") until the last, which has no room left; the first one
    # caught up on the prompt and is the one not timed — but charged to the credit for
    # re-tries (as every timed step is, through `observe_step`)
    assert len(timed) == steps - 1 and timed[0] > 0 and timed[-1] == 0
    assert len(charged) == steps and charged[0] > 0


def test_a_cycle_that_compiled_a_new_batch_shape_is_not_timed(model: Model) -> None:
    """With compiled steps, a batch shape's first step runs eagerly and its second traces
    and compiles it (the verify width, the MTP row's): such a cycle times the eager path or
    the compiler, so the controller must not see it; once every shape of the request is
    compiled (the third run of the same request: its prompt's shape came once per run), no
    step meets a new one and every steady cycle is timed."""
    spec = speculator(model, "mtp", 1, compile=True)
    timed: list[int] = []
    observe = spec.controller.observe_step
    spec.controller.observe_step = lambda w, depth, s: (timed.append(depth), observe(w, depth, s))  # type: ignore[method-assign]
    prompt = list(range(1, 21))
    first = generate(spec, [Request(prompt, 8, GREEDY, speculation="on")])
    untimed_first = first.stats[0].steps - len(timed)
    generate(spec, [Request(prompt, 8, GREEDY, speculation="on")])
    made = spec.runner.cold_steps
    timed.clear()
    third = generate(spec, [Request(prompt, 8, GREEDY, speculation="on")])
    assert third.tokens == first.tokens
    assert spec.runner.cold_steps == made  # no new shapes the third time
    # the third run leaves out only the catch-up step; the first also its new shapes' steps
    assert len(timed) == third.stats[0].steps - 1
    assert untimed_first > 1


def plain_speculator(model: Model, n_slots: int) -> Speculator:
    """A Speculator that never drafts, over `n_slots` allocated slots 0, 1, ..."""
    pool = SlotPool(model.config, n_slots, 128, mx.float32)
    for _ in range(n_slots):
        pool.allocate()
    return Speculator(ModelRunner(model, pool))


PLAIN_MIXES = {
    "argmax only": [SamplingParams(temperature=0.0)] * 5,
    "greedy, one biased": [GREEDY] * 3 + [SamplingParams(temperature=0.0, logit_bias=((7, 50.0),))],
    "greedy, one penalized": [GREEDY, SamplingParams(temperature=0.0, frequency_penalty=2.0)],
    "greedy, one with logprobs": [GREEDY, SamplingParams(temperature=0.0, logprobs=4), GREEDY],
    "mixed": [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2),
        SamplingParams(temperature=0.0, logit_bias=((7, 50.0),)),
        SamplingParams(temperature=1.1, top_k=20, logprobs=3),
    ],
}


@pytest.mark.parametrize("mix", PLAIN_MIXES.values(), ids=PLAIN_MIXES.keys())
def test_a_plain_step_samples_every_row_as_sample_rows_does(
    model: Model, mix: list[SamplingParams]
) -> None:
    """A step without drafts resolves to a `PlainStep`: per row the token `sample_rows`
    gives (penalties over the row's history, its own generator), the adjusted logits of
    the rows that want log-probabilities, and the same step as `Committed`s."""
    spec, chosen = plain_speculator(model, len(mix)), prompts(len(mix), 4)
    runner, slots = spec.runner, list(range(len(mix)))
    runner.step([Row(SlotId(i), p[:-1], 0) for i, p in zip(slots, chosen, strict=True)])
    # Histories that penalize most of the vocabulary, unevenly: a penalty moves the argmax.
    histories = [[*p, *(t for t in range(512) for _ in range(t % 5))] for p in chosen]
    states = [
        DecodingSlot(SlotId(i), p[-1], h, params, RequestRng(50 + i))
        for i, p, h, params in zip(slots, chosen, histories, mix, strict=True)
    ]
    outputs = runner.step(spec.plan(states)).rows
    resolved = spec.resolve_step(states, outputs)

    assert isinstance(resolved, PlainStep)
    logits = mx.concatenate([o.logits[-1:] for o in outputs])
    rngs = [RequestRng(50 + i) for i in range(len(mix))]
    tokens, adjusted = sample_rows(logits, mix, histories, rngs)
    assert resolved.tokens == tokens
    assert resolved.logprob_rows == [i for i, p in enumerate(mix) if p.logprobs]
    for i in resolved.logprob_rows:
        assert mx.allclose(resolved.adjusted[i], adjusted[i]).item()
    committed = resolved.committed()
    assert [c.tokens for c in committed] == [[t] for t in tokens]
    assert [bool(c.logits) for c in committed] == [p.logprobs > 0 for p in mix]
    assert {(c.drafted, c.accepted, c.drafter) for c in committed} == {(0, 0, "")}


@pytest.mark.parametrize("mix", PLAIN_MIXES.values(), ids=PLAIN_MIXES.keys())
def test_tokens_drawn_ahead_are_the_ones_the_resolve_draws(
    model: Model, mix: list[SamplingParams]
) -> None:
    """`draw_ahead` (decode-ahead draws a step's tokens on the device before it queues the
    next step) gives per row the token `sample_rows` gives — penalties over the row's
    history, logit bias, its own generator's next uniform — without using that uniform up;
    `resolve_step(..., drawn)` then commits those tokens, the adjusted logits of the rows
    that want log-probabilities, and leaves every generator where drawing leaves it."""
    spec, chosen = plain_speculator(model, len(mix)), prompts(len(mix), 4)
    runner = spec.runner
    runner.step([Row(SlotId(i), p[:-1], 0) for i, p in enumerate(chosen)])
    histories = [[*p, *(t for t in range(512) for _ in range(t % 5))] for p in chosen]
    states = [
        DecodingSlot(SlotId(i), p[-1], h, params, RequestRng(70 + i))
        for i, (p, h, params) in enumerate(zip(chosen, histories, mix, strict=True))
    ]
    outputs = runner.step(spec.plan(states)).rows
    drawn = spec.draw_ahead(states, outputs)
    twins = [RequestRng(70 + i) for i in range(len(mix))]
    logits = mx.concatenate([o.logits[-1:] for o in outputs])
    tokens, adjusted = sample_rows(logits, mix, histories, twins)
    assert drawn.tokens.tolist() == tokens
    resolved = spec.resolve_step(states, outputs, drawn)

    assert isinstance(resolved, PlainStep) and resolved.tokens == tokens
    for i in resolved.logprob_rows:
        assert mx.allclose(resolved.adjusted[i], adjusted[i]).item()
    assert [s.rng.uniform(1).tolist() for s in states] == [t.uniform(1).tolist() for t in twins]


def test_tokens_drawn_ahead_are_read_not_drawn_again(model: Model) -> None:
    """`resolve_step(..., drawn)` commits the tokens it is given — here deliberately not the
    ones drawing would give — and still uses up each sampled row's uniform."""
    mix = [GREEDY, SamplingParams(temperature=0.9, top_k=30)]
    spec, chosen = plain_speculator(model, len(mix)), prompts(len(mix), 4)
    spec.runner.step([Row(SlotId(i), p[:-1], 0) for i, p in enumerate(chosen)])
    states = [
        DecodingSlot(SlotId(i), p[-1], list(p), params, RequestRng(80 + i))
        for i, (p, params) in enumerate(zip(chosen, mix, strict=True))
    ]
    outputs = spec.runner.step(spec.plan(states)).rows
    logits = mx.concatenate([o.logits[-1:] for o in outputs])
    resolved = spec.resolve_step(states, outputs, Drawn(mx.array([3, 1]), logits))
    assert isinstance(resolved, PlainStep) and resolved.tokens == [3, 1]
    twin = RequestRng(81)
    twin.uniform(1)
    assert states[1].rng.uniform(1).tolist() == twin.uniform(1).tolist()


def test_resolving_a_slot_that_was_not_planned_changes_nothing(model: Model) -> None:
    spec = plain_speculator(model, 2)
    states = [DecodingSlot(SlotId(i), 5, [1, 5], GREEDY, RequestRng(i)) for i in range(2)]
    spec.runner.step([Row(SlotId(i), [1], 0) for i in range(2)])
    outputs = spec.runner.step(spec.plan(states[:1])).rows
    with pytest.raises(SpecError, match=r"slots \[1\] were not planned"):
        spec.resolve_step(states[1:], outputs)
    assert isinstance(spec.resolve_step(states[:1], outputs), PlainStep)  # its plan is still there


def test_a_slot_released_after_the_plan_is_no_longer_planned(model: Model) -> None:
    """A planned slot released before the resolve (its request ended) resolves as a slot
    never planned; the plan's other slots resolve, and releasing a slot the plan does not
    hold (an admitted request's, as its first prefill row does) leaves the plan whole."""
    spec = plain_speculator(model, 3)
    states = [DecodingSlot(SlotId(i), 5, [1, 5], GREEDY, RequestRng(i)) for i in range(2)]
    spec.runner.step([Row(SlotId(i), [1], 0) for i in range(2)])
    outputs = spec.runner.step(spec.plan(states)).rows
    spec.release(SlotId(2))
    spec.release(SlotId(1))
    with pytest.raises(SpecError, match=r"slots \[1\] were not planned"):
        spec.resolve_step(states, outputs)
    assert isinstance(spec.resolve_step(states[:1], outputs[:1]), PlainStep)


def test_a_plan_never_resolved_stays_planned_beside_the_next(model: Model) -> None:
    """A step whose resolve never came (all its rows failed) leaves its slots planned: the
    next plan, of some of them, resolves; so do the others, until planned again."""
    spec = plain_speculator(model, 2)
    states = [DecodingSlot(SlotId(i), 5, [1, 5], GREEDY, RequestRng(i)) for i in range(2)]
    spec.runner.step([Row(SlotId(i), [1], 0) for i in range(2)])
    spec.plan(states)
    outputs = spec.runner.step(spec.plan(states[:1])).rows
    assert isinstance(spec.resolve_step(states[:1], outputs), PlainStep)
    assert isinstance(spec.resolve_step(states[1:], outputs), PlainStep)
    with pytest.raises(SpecError, match=r"slots \[0\] were not planned"):
        spec.resolve_step(states[:1], outputs)


@pytest.mark.parametrize("uniform", [True, False])
def test_argmax_only_acceptance_reads_the_packed_logits_as_the_general_path_would(
    model: Model, monkeypatch: pytest.MonkeyPatch, uniform: bool
) -> None:
    """Greedy, unpenalized slots accept from one argmax over the step's packed logits
    (`runner.verified_logits`): the same tokens, acceptances, logprobs rows and pool as the
    general path (slices joined, adjusted, argmax) — both drafters, ragged and uniform rows,
    every slot asking for logprobs so each kept position's row is compared."""
    params = SamplingParams(temperature=0.0, logprobs=2)

    def run(fast: bool) -> tuple[list[list[Committed]], list[SlotSnapshot], int]:
        spec = speculator(model, "ngram+mtp", 4)
        spec.use_uniform_shapes(uniform)
        used = 0

        def counted(outputs: list[RowOutput]) -> tuple[mx.array, list[int]] | None:
            nonlocal used
            found = verified_logits(outputs) if fast else None
            used += found is not None
            return found

        monkeypatch.setattr("engine.spec.speculator.verified_logits", counted)
        pool, runner = spec.runner.pool, spec.runner
        slots = [pool.allocate() for _ in range(4)]
        chosen = prompts(4, 7)
        rows = [spec.prefill_row(s, p, 0, "on") for s, p in zip(slots, chosen, strict=True)]
        for row, out in zip(rows, runner.step(rows).rows, strict=True):
            spec.prefilled(row, out)
        first = [p[-1] for p in chosen]
        decoding = [
            DecodingSlot(s, t, [*p, t], params, RequestRng(None), "on")
            for s, t, p in zip(slots, first, chosen, strict=True)
        ]
        steps = []
        for _ in range(10):
            committed = spec.resolve(decoding, runner.step(spec.plan(decoding)).rows)
            steps.append(committed)
            for d, c in zip(decoding, committed, strict=True):
                d.history += c.tokens
                d.pending = c.tokens[-1]
        monkeypatch.undo()
        return steps, [pool.snapshot(s) for s in slots], used

    fast, fast_pool, used = run(True)
    general, general_pool, unused = run(False)
    assert used > 0 and unused == 0
    for a, b in zip(fast, general, strict=True):
        assert [(c.tokens, c.drafted, c.accepted) for c in a] == [
            (c.tokens, c.drafted, c.accepted) for c in b
        ]
        for c, d in zip(a, b, strict=True):
            assert len(c.logits) == len(d.logits) == len(c.tokens)
            assert all(np.array_equal(x, y) for x, y in zip(c.logits, d.logits, strict=True))
    assert sum(c.accepted for step in fast for c in step) > 0
    assert all(snapshots_equal(x, y) for x, y in zip(fast_pool, general_pool, strict=True))
