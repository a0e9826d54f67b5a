"""The scheduler end to end on a real tiny model: batching, admission, lifecycle, faults.

Each test runs a fresh Scheduler over a fresh pool; "solo" means the same request
through a one-slot scheduler on its own (N = 1 runs the same path as N > 1).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from threading import get_ident
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import mlx.core as mx
import pytest

from engine.cache import SlotPool
from engine.generate import greedy_tokens
from engine.gguf import GGUFFile
from engine.models.qwen35 import Model, load_model
from engine.runner import BatchError, ModelRunner, RowOutput
from engine.sampling import SamplingParams
from engine.spec.drafters import UNBOUNDED, Draft, Drafter, DraftJob
from engine.spec.speculator import Committed, DecodingSlot, PlainStep, Speculator
from engine.tokenizer import Tokenizer
from scheduler import (
    Completion,
    Delta,
    DuplicateRequestId,
    Event,
    Finished,
    FinishReason,
    Policy,
    PrefixCacheConfig,
    Rejected,
    RejectReason,
    Request,
    RequestHandle,
    Scheduler,
    SchedulerConfig,
    Speculation,
)
from scheduler.stats import ControllerStats

GREEDY = SamplingParams(temperature=0.0)
CONTEXT = 160
MAX_DRAFT = 2


@pytest.fixture(scope="module")
def model(make_model: Callable[..., Path]) -> Model:
    return load_model(make_model("tiny"))


@pytest.fixture(scope="module")
def tokenizer(make_model: Callable[..., Path]) -> Tokenizer:
    return Tokenizer.from_metadata(GGUFFile(make_model("tiny")).metadata)


@pytest.fixture
def new(model: Model, tokenizer: Tokenizer) -> Iterator[Callable[..., Scheduler]]:
    """`new(n_slots=4, speculate=False, compile=False, **config)`: a Scheduler over a fresh
    pool; every pool made must have all its slots free again when the test ends."""
    pools: list[SlotPool] = []

    def make(
        n_slots: int = 4, speculate: bool = False, compile: bool = False, **config: Any
    ) -> Scheduler:
        pool = SlotPool(model.config, n_slots, CONTEXT, kv_dtype=mx.float32, max_draft=MAX_DRAFT)
        pools.append(pool)
        runner = ModelRunner(model, pool, compile=compile)
        spec = Speculator(runner, MAX_DRAFT if speculate else 0)
        return Scheduler(runner, tokenizer, SchedulerConfig(**config), spec)

    yield make
    for pool in pools:
        assert pool.free_slots == pool.n_slots, "a slot was not freed"


async def events_of(handle: RequestHandle) -> list[Event]:
    """All events of a handle, checked: Deltas, then exactly one Finished, then the end."""
    events = [e async for e in handle]
    assert events and isinstance(events[-1], Finished), events[-1:]
    assert all(isinstance(e, Delta) for e in events[:-1])
    return events


def completion(events: list[Event]) -> Completion:
    deltas = [e for e in events if isinstance(e, Delta)]
    final = events[-1]
    assert isinstance(final, Finished)
    return Completion(
        [t for d in deltas for t in d.token_ids],
        "".join(d.text for d in deltas),
        [lp for d in deltas for lp in d.logprobs],
        final,
    )


_SOLO: dict[str, Completion] = {}  # plain solo runs by request, shared by the tests


async def alone(new: Callable[..., Scheduler], request: Request, **kw: Any) -> Completion:
    """The request through a one-slot scheduler on its own (plain runs are cached)."""
    key = None if kw else repr(request)
    if key in _SOLO:
        return _SOLO[key]
    scheduler = new(n_slots=1, **kw)
    async with scheduler.running():
        got = completion(await events_of(scheduler.submit(request)))
    if key is not None:
        _SOLO[key] = got
    return got


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 500) for _ in range(n)]


def same_output(a: Completion, b: Completion) -> None:
    assert a.token_ids == b.token_ids
    assert a.text == b.text
    assert a.finished.reason == b.finished.reason


# -- batching -----------------------------------------------------------------------------------


def mixed_requests(n: int, seed: int = 0) -> list[Request]:
    """Mixed lengths and parameters: greedy, penalized, biased, seeded sampling, stops."""
    rng = random.Random(seed)
    kinds = [
        GREEDY,
        SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0.0, logit_bias=((7, 5.0),), logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7),
        SamplingParams(temperature=1.2, top_k=20, min_p=0.05, seed=11),
    ]
    return [
        Request(
            prompt=prompt(rng, rng.randrange(3, 48)),
            sampling=kinds[i % len(kinds)],
            max_tokens=rng.randrange(4, 24),
            stop=("e",) if i % 7 == 3 else (),
            ignore_eos=i % 3 == 0,
            request_id=f"r{i}",
        )
        for i in range(n)
    ]


async def staggered(
    scheduler: Scheduler, requests: list[Request], gap: float
) -> dict[str, Completion]:
    """Submit request i at `i * gap` seconds on the running scheduler; completions by id."""
    results: dict[str, Completion] = {}

    async def one(request: Request, delay: float) -> None:
        await anyio.sleep(delay)
        results[request.request_id or ""] = completion(await events_of(scheduler.submit(request)))

    async with scheduler.running(), anyio.create_task_group() as tg:
        for i, request in enumerate(requests):
            tg.start_soon(one, request, gap * i)
    return results


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculating"])
async def test_32_staggered_requests_complete_and_each_matches_its_solo_run(
    new: Callable[..., Scheduler], speculate: bool
) -> None:
    """Solo runs decode plainly. Speculating, greedy outputs must still match them (exact
    acceptance); sampled ones use the random stream differently, so only plain runs
    compare those."""
    requests = mixed_requests(32)
    scheduler = new(n_slots=8, speculate=speculate, max_batch_tokens=96, max_prefill_chunk=32)
    results = await staggered(scheduler, requests, 0.004)
    stats = scheduler.stats()
    assert stats.finished.keys() <= {FinishReason.STOP, FinishReason.LENGTH}
    assert stats.generated_tokens == sum(len(r.token_ids) for r in results.values())
    assert stats.prompt_tokens == sum(r.finished.usage.prompt_tokens for r in results.values())

    for request in requests:
        got = results[request.request_id or ""]
        if not speculate or request.sampling.greedy:
            same_output(got, await alone(new, request))
        n = request.sampling.logprobs
        assert [x.token for x in got.logprobs] == (got.token_ids if n else [])
        assert all(len(x.top) == n and x.logprob <= x.top[0][1] + 1e-6 for x in got.logprobs)
    if speculate:
        assert sum(r.finished.spec.verify_steps for r in results.values()) > 0
    # the cost controller's state, as the daemon's metrics export it
    ctrl = scheduler._stepper.speculator.controller
    assert stats.controller == ControllerStats(ctrl.held, ctrl.stalls, ctrl.credit)
    assert ctrl.credit != 0.0  # every observed step earns it a share of its time


async def test_compiled_steps_serve_what_eager_steps_serve(new: Callable[..., Scheduler]) -> None:
    """The daemon's `compile = "on"`: staggered requests, chunked prefills beside decode and
    verify rows, speculation on, through compiled steps. Every request ends once; greedy
    outputs equal their eager solo runs (compiled steps agree with eager ones to ~1e-6)."""
    requests = mixed_requests(12, seed=5)
    scheduler = new(
        n_slots=4, speculate=True, compile=True, max_batch_tokens=64, max_prefill_chunk=16
    )
    results = await staggered(scheduler, requests, 0.003)
    assert scheduler.runner.cold_steps > 1
    assert len(results) == len(requests)
    assert sum(r.finished.spec.verify_steps for r in results.values()) > 0
    for request in requests:
        if request.sampling.greedy:
            same_output(results[request.request_id or ""], await alone(new, request))


def greedy_requests(n: int, seed: int) -> list[Request]:
    """Greedy requests only (decode-ahead's ground): some with log-probabilities, stop
    strings or eos, various lengths."""
    rng = random.Random(seed)
    return [
        Request(
            prompt=prompt(rng, rng.randrange(3, 40)),
            sampling=SamplingParams(temperature=0.0, logprobs=2 if i % 4 == 1 else 0),
            max_tokens=rng.randrange(1, 28),
            stop=("e",) if i % 5 == 3 else (),
            ignore_eos=i % 3 == 0,
            request_id=f"g{i}",
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
async def test_decode_ahead_serves_what_plain_steps_serve(
    new: Callable[..., Scheduler], compile: bool
) -> None:
    """With `decode_ahead`, a step of greedy decode rows queues the next before the host has
    its tokens; staggered arrivals, requests ending at every step (length, stop strings,
    eos), log-probabilities: every request streams what it streams on its own, the queued
    steps are taken (also when a prompt arrived meanwhile: its chunks run in a forward of
    their own), and every slot ends free."""
    requests = greedy_requests(16, seed=21)
    scheduler = new(
        n_slots=6, compile=compile, decode_ahead=True, max_batch_tokens=64, max_prefill_chunk=16
    )
    results = await staggered(scheduler, requests, 0.01)
    stepper = scheduler._stepper
    counted = scheduler.stats().decode_ahead  # (what the daemon's metrics export)
    assert counted == stepper.ahead and counted.taken > 10 and counted.beside_prefill > 0
    for request in requests:
        got = results[request.request_id or ""]
        same_output(got, await alone(new, request))
        assert [x.token for x in got.logprobs] == (
            got.token_ids if request.sampling.logprobs else []
        )


async def test_decode_ahead_draws_sampled_tokens_as_the_host_does(
    new: Callable[..., Scheduler],
) -> None:
    """Seeded sampled requests (temperature, top-k, top-p, min-p) beside greedy ones: the
    queued step draws each token on the device from the request's next uniform (peeked,
    left in its stream), so the steps are taken and every request streams what it streams
    on its own."""
    rng = random.Random(31)
    kinds = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=3),
        SamplingParams(temperature=1.2, top_k=20, min_p=0.05, seed=4),
        GREEDY,
        SamplingParams(temperature=0.6, seed=5, logprobs=2),
    ]
    requests = [
        Request(
            prompt=prompt(rng, rng.randrange(4, 30)),
            sampling=kinds[i % len(kinds)],
            max_tokens=rng.randrange(6, 26),
            ignore_eos=True,
            request_id=f"s{i}",
        )
        for i in range(8)
    ]
    scheduler = new(n_slots=4, decode_ahead=True, max_prefill_chunk=16)
    results = await staggered(scheduler, requests, 0.005)
    assert scheduler._stepper.ahead.taken > 10
    for request in requests:
        same_output(results[request.request_id or ""], await alone(new, request))


async def test_decode_ahead_beside_drafters_serves_what_plain_steps_serve(
    new: Callable[..., Scheduler],
) -> None:
    """Speculation on (n-gram and MTP drafters), requests in every mode, prompts that repeat
    a phrase (so n-gram drafts come and go): after a step in which no slot drafted, the next
    is queued as plain decode with the hidden states the MTP head follows; it is taken when
    the plan drafts nothing and dropped when it drafts. Greedy outputs equal plain solo
    runs, drafts were verified, and every slot ends free."""
    rng = random.Random(51)
    modes = [Speculation.AUTO, Speculation.OFF, Speculation.AUTO]
    requests = []
    for i in range(10):
        phrase = prompt(rng, rng.randrange(3, 7))
        requests.append(
            Request(
                prompt=phrase * 3 if i % 3 else prompt(rng, 12),
                sampling=GREEDY,
                max_tokens=rng.randrange(8, 26),
                ignore_eos=True,
                speculation=modes[i % len(modes)],
                request_id=f"d{i}",
            )
        )
    scheduler = new(n_slots=4, speculate=True, decode_ahead=True, max_prefill_chunk=16)
    # all at once, 4 slots for 10: later ones are admitted (and prefilled beside decoding
    # rows) as earlier ones finish. With arrivals 5 ms apart the queued steps taken hung on
    # timing: none in 2 of 7 runs on a loaded 2-core machine; all at once, 12-35 in 6 of 6
    # (session 14)
    results = await staggered(scheduler, requests, 0.0)
    stepper = scheduler._stepper
    assert stepper.decode_ahead and stepper.ahead.taken > 0 and stepper.ahead.dropped > 0
    assert sum(r.finished.spec.verify_steps for r in results.values()) > 0
    for request in requests:
        same_output(results[request.request_id or ""], await alone(new, request))


class EveryOtherPosition(Drafter):
    """Drafts one (likely wrong) token at every even position: a plan drafts right after
    each plain step, the worst case for decode-ahead beside a drafter."""

    name = "every-other"

    def available(self, d: DecodingSlot, length: int) -> int:
        return UNBOUNDED if length % 2 == 0 else 0

    def draft(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        return [Draft([7]) if j.k else Draft() for j in jobs]


async def test_decode_ahead_pauses_when_its_queued_steps_are_mostly_dropped(
    new: Callable[..., Scheduler], model: Model, tokenizer: Tokenizer
) -> None:
    """A drafter that drafts after every plain step makes each queued step a wasted one:
    decode-ahead pauses after a few (`AHEAD_WINDOW`) and tries again later, so most plain
    steps queue nothing; outputs stay those of plain decoding."""
    pool = SlotPool(model.config, 2, CONTEXT, kv_dtype=mx.float32, max_draft=MAX_DRAFT)
    runner = ModelRunner(model, pool)
    spec = Speculator(runner, MAX_DRAFT, [EveryOtherPosition()])
    config = SchedulerConfig(decode_ahead=True)
    scheduler = Scheduler(runner, tokenizer, config, spec)
    rng = random.Random(61)
    requests = [
        Request(
            prompt=prompt(rng, 9),
            sampling=GREEDY,
            max_tokens=60,
            ignore_eos=True,
            speculation=Speculation.ON,
            request_id=f"e{i}",
        )
        for i in range(2)
    ]
    async with scheduler.running():
        got = [completion(await events_of(scheduler.submit(r))) for r in requests]
    stepper = scheduler._stepper
    verify = sum(c.finished.spec.verify_steps for c in got)
    plain = sum(c.finished.spec.decode_steps for c in got) - verify
    assert verify > 20 and plain > 20
    # without the pause every plain step but the last queues a step the next plan drops
    assert 0 < stepper.ahead.dropped <= plain // 3
    assert pool.free_slots == pool.n_slots
    for request, out in zip(requests, got, strict=True):
        same_output(out, await alone(new, request))


async def test_a_failed_draw_ahead_queues_nothing_and_the_resolve_draws(
    new: Callable[..., Scheduler],
) -> None:
    """Should drawing a step's tokens on the device fail, no step is queued after it: the
    resolve draws them as ever (and would report its own failure per request), and every
    request streams what it streams alone."""
    requests = greedy_requests(6, seed=23)
    scheduler = new(n_slots=3, decode_ahead=True)
    draw_ahead = scheduler._stepper.speculator.draw_ahead
    calls = itertools.count()

    def flaky(*args: Any) -> Any:
        if next(calls) % 2 == 0:
            raise RuntimeError("injected: drawing ahead failed")
        return draw_ahead(*args)

    scheduler._stepper.speculator.draw_ahead = flaky  # type: ignore[method-assign]
    results = await staggered(scheduler, requests, 0.005)
    assert next(calls) > 4 and scheduler._stepper.ahead.taken > 0
    for request in requests:
        same_output(results[request.request_id or ""], await alone(new, request))


async def test_decode_ahead_applies_penalties_and_bias_as_the_host_does(
    new: Callable[..., Scheduler],
) -> None:
    """Requests with repetition, presence and frequency penalties or a logit bias (with
    log-probabilities), greedy and sampled, beside drafters or not: the queued step's tokens are
    drawn on the device from logits adjusted over each request's history as the host adjusts
    them, so steps are taken and every request streams what it streams on its own."""
    rng = random.Random(4)
    adjusted = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0.0, logit_bias=((7, 5.0),), logprobs=3),
        SamplingParams(temperature=0.9, frequency_penalty=0.7, seed=11),
    ]
    requests = [
        Request(
            prompt=prompt(rng, 10),
            sampling=adjusted[i % len(adjusted)],
            max_tokens=12,
            ignore_eos=True,
            # (a sampled request's tokens depend on the drafts it verified: not speculating,
            # it streams what it streams alone in a plain run, beside speculating ones)
            speculation=Speculation.OFF if i % len(adjusted) == 2 else Speculation.AUTO,
            request_id=f"p{i}",
        )
        for i in range(6)
    ]
    for speculate in (False, True):
        scheduler = new(n_slots=4, speculate=speculate, decode_ahead=True)
        async with scheduler.running():
            handles = [scheduler.submit(r) for r in requests]
            got = [completion(await events_of(h)) for h in handles]
        assert scheduler._stepper.ahead.taken > 0
        for request, out in zip(requests, got, strict=True):
            solo = await alone(new, request)
            same_output(out, solo)
            assert out.logprobs == solo.logprobs


async def test_decode_ahead_keeps_finished_snapshots_and_cancels_exact(
    new: Callable[..., Scheduler],
) -> None:
    """A request that ends on a stop token (unforeseeable, so its row was queued for the next
    step) leaves a prefix-cache snapshot of its own tokens only — taken before the next plan
    takes the queued rows; a follow-up reusing all of it streams what it streams uncached —
    and a request cancelled mid-decode frees its slot while the others go on to their solo
    outputs. (That a dropped row is never written: the runner's launch/adopt test.)"""
    rng = random.Random(9)
    base = Request(prompt=prompt(rng, 24), sampling=GREEDY, max_tokens=20, ignore_eos=True)
    stop = (await alone(new, base)).token_ids[6]
    first = dataclasses.replace(base, stop_token_ids=(stop,))
    others = [
        Request(prompt=prompt(rng, 12), sampling=GREEDY, max_tokens=30, ignore_eos=True)
        for _ in range(3)
    ]
    cache = PrefixCacheConfig(budget_bytes=64 << 20, interval=8, min_tokens=4)
    scheduler = new(n_slots=4, decode_ahead=True, prefix_cache=cache)
    async with scheduler.running():
        handles = [scheduler.submit(r) for r in [first, *others]]
        done = completion(await events_of(handles[0]))
        follow = Request(
            prompt=[*first.prompt, *done.token_ids, 5, 6, 7],
            sampling=GREEDY,
            max_tokens=8,
            ignore_eos=True,
        )
        again = completion(await events_of(scheduler.submit(follow)))
        victim = handles[1]
        async for event in victim:
            if isinstance(event, Delta) and event.token_ids:
                victim.cancel()
                break
        rest = [completion(await events_of(h)) for h in handles[2:]]
    assert done.finished.reason == FinishReason.STOP and len(done.token_ids) < 20
    # the whole of it was cached: prompt and output, but the stop token it never fed
    assert again.finished.usage.cached_tokens == len(first.prompt) + len(done.token_ids) - 1
    same_output(again, await alone(new, follow))
    same_output(done, await alone(new, first))
    for request, got in zip(others[1:], rest, strict=True):
        same_output(got, await alone(new, request))
    assert scheduler._stepper.ahead.taken > 0


class CommittedSpeculator(Speculator):
    """The general path for every step: `resolve_step` answers with a `Committed` per slot
    (as `resolve` does), never with a `PlainStep`."""

    def resolve_step(
        self,
        decoding: Sequence[DecodingSlot],
        outputs: Sequence[RowOutput],
        drawn: mx.array | None = None,
    ) -> PlainStep | list[Committed]:
        resolved = super().resolve_step(decoding, outputs, drawn)
        return resolved.committed() if isinstance(resolved, PlainStep) else resolved


async def test_plain_steps_stream_what_the_general_commit_path_streams(
    model: Model, tokenizer: Tokenizer
) -> None:
    """A plain step is committed from one list of tokens (`PlainStep`); the general path
    goes through a `Committed` per slot. The same mixed requests (greedy, penalized, biased
    with log-probabilities, seeded sampling, stop strings, max_tokens, eos) stream the same
    tokens, text and log-probabilities and end the same way either way."""
    requests = mixed_requests(24, seed=8)

    async def run(kind: type[Speculator]) -> list[Completion]:
        pool = SlotPool(model.config, 8, CONTEXT, kv_dtype=mx.float32)
        runner = ModelRunner(model, pool)
        config = SchedulerConfig(max_batch_tokens=96, max_prefill_chunk=32)
        scheduler = Scheduler(runner, tokenizer, config, kind(runner))
        async with scheduler.running():
            handles = [scheduler.submit(r) for r in requests]
            got = [completion(await events_of(h)) for h in handles]
        assert pool.free_slots == pool.n_slots
        return got

    fast, general = await run(Speculator), await run(CommittedSpeculator)
    for a, b in zip(fast, general, strict=True):
        assert (a.token_ids, a.text, a.logprobs) == (b.token_ids, b.text, b.logprobs)
        end_a, end_b = a.finished, b.finished
        assert (end_a.reason, end_a.matched_stop, end_a.usage, end_a.spec) == (
            end_b.reason,
            end_b.matched_stop,
            end_b.usage,
            end_b.spec,
        )
    assert {a.finished.reason for a in fast} == {FinishReason.STOP, FinishReason.LENGTH}
    assert any(a.logprobs for a in fast)


async def test_greedy_output_equals_plain_greedy_decoding(
    new: Callable[..., Scheduler], model: Model
) -> None:
    ids = prompt(random.Random(3), 20)
    got = await alone(new, Request(prompt=ids, sampling=GREEDY, max_tokens=12, ignore_eos=True))
    assert got.token_ids == greedy_tokens(model, ids, 12)


async def test_a_seeded_request_samples_the_same_tokens_whatever_else_runs(
    new: Callable[..., Scheduler],
) -> None:
    rng = random.Random(5)
    sampled = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    target = Request(prompt=prompt(rng, 10), sampling=sampled, max_tokens=16, ignore_eos=True)
    scheduler = new(n_slots=4)
    async with scheduler.running():
        others = [
            scheduler.submit(Request(prompt=prompt(rng, 30), sampling=SamplingParams(seed=i)))
            for i in range(3)
        ]
        crowded = completion(await events_of(scheduler.submit(target)))
        for h in others:
            h.cancel()
    same_output(crowded, await alone(new, target))


async def test_steps_run_on_one_thread_of_their_own_that_ends_with_the_scheduler(
    new: Callable[..., Scheduler],
) -> None:
    """Every step (the fault hook runs inside each) runs on the scheduler's step thread:
    not the event loop's, the same one each step, also while other work keeps anyio's
    worker threads busy; the thread is gone once the scheduler has stopped. Outputs,
    speculation and its rollbacks included, equal solo runs."""
    threads: set[int] = set()
    rng = random.Random(9)
    requests = [
        Request(
            prompt=prompt(rng, 5) * 3, sampling=GREEDY, max_tokens=16, speculation=Speculation.ON
        )
        for _ in range(3)
    ]
    scheduler = new(n_slots=3, speculate=True, fault_hook=lambda _: threads.add(get_ident()))

    async def busy() -> None:
        while True:
            await anyio.to_thread.run_sync(time.sleep, 0.0005)

    async with scheduler.running(), anyio.create_task_group() as tg:
        tg.start_soon(busy)
        handles = [scheduler.submit(r) for r in requests]
        results = [await h.collect() for h in handles]
        tg.cancel_scope.cancel()
    assert len(threads) == 1
    (step_thread,) = threads
    assert step_thread != get_ident()
    assert step_thread not in {t.ident for t in threading.enumerate()}
    for request, result in zip(requests, results, strict=True):
        same_output(result, await alone(new, request, speculate=True))


# -- cancellation -------------------------------------------------------------------------------


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculating"])
async def test_cancel_mid_prefill_frees_the_slot_and_leaves_others_unaffected(
    new: Callable[..., Scheduler], speculate: bool
) -> None:
    """Cancelled from inside a step (the fault hook as observer) while its prompt is
    still being fed in chunks."""
    mode = Speculation.ON if speculate else Speculation.OFF
    rng = random.Random(1)
    other = Request(prompt=prompt(rng, 12), sampling=GREEDY, max_tokens=16, speculation=mode)
    victim = Request(prompt=prompt(rng, 100), max_tokens=8, request_id="victim", speculation=mode)
    seen: list[tuple[list[str], int]] = []  # ids of each forward, requests holding slots
    scheduler: Scheduler
    loop = anyio.lowlevel.current_token()  # (the step thread is not one of anyio's)

    def observe(ids: list[str]) -> None:
        seen.append((ids, scheduler.stats().running))
        if sum("victim" in s for s, _ in seen) == 2:  # its second prefill chunk is running
            anyio.from_thread.run_sync(scheduler.cancel, "victim", token=loop)

    scheduler = new(n_slots=2, speculate=speculate, max_prefill_chunk=16, fault_hook=observe)
    async with scheduler.running():
        h_other, h_victim = scheduler.submit(other), scheduler.submit(victim)
        cancelled = completion(await events_of(h_victim))
        kept = completion(await events_of(h_other))
    assert cancelled.finished.reason == FinishReason.CANCELLED
    assert cancelled.token_ids == [] and cancelled.finished.usage.completion_tokens == 0
    at = [i for i, (ids, _) in enumerate(seen) if "victim" in ids]
    assert len(at) == 2  # never ran again after the cancel ...
    assert seen[at[-1] + 1][1] == 1  # ... and its slot was free by the next step
    same_output(kept, await alone(new, other, speculate=speculate))


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculating"])
async def test_cancel_mid_decode_or_verify_frees_the_slot_and_leaves_others_unaffected(
    new: Callable[..., Scheduler], speculate: bool
) -> None:
    """With speculation on, the victim's decode rows are verify rows whenever a
    drafter proposes; the prompt repeats itself so that prompt lookup does."""
    mode = Speculation.ON if speculate else Speculation.OFF
    rng = random.Random(2)
    others = [
        Request(prompt=prompt(rng, 8) * 3, sampling=GREEDY, max_tokens=20, speculation=mode)
        for _ in range(2)
    ]
    victim = Request(prompt=prompt(rng, 6) * 4, sampling=GREEDY, max_tokens=100, speculation=mode)
    scheduler = new(n_slots=3, speculate=speculate)
    async with scheduler.running():
        handles = [scheduler.submit(r) for r in others]
        h_victim = scheduler.submit(victim)
        got: list[int] = []
        async for event in h_victim:
            if isinstance(event, Delta):
                got += event.token_ids
                if len(got) >= 3 and len(got) - len(event.token_ids) < 3:
                    assert scheduler.cancel(h_victim.request_id)
            else:
                final = event
        kept = [completion(await events_of(h)) for h in handles]
    assert final.reason == FinishReason.CANCELLED
    assert 3 <= final.usage.completion_tokens < 100
    if speculate:
        assert final.spec.verify_steps > 0  # it was cancelled between verify rounds
    assert not scheduler.cancel(h_victim.request_id)  # already over
    for request, result in zip(others, kept, strict=True):
        same_output(result, await alone(new, request, speculate=speculate))


async def test_closing_a_handle_cancels_its_request(new: Callable[..., Scheduler]) -> None:
    scheduler = new(n_slots=1)
    async with scheduler.running():
        handle = scheduler.submit(Request(prompt=[1, 2, 3], max_tokens=100, ignore_eos=True))
        async for _ in handle:
            break
        await handle.aclose()
        nxt = await scheduler.submit(Request(prompt=[4, 5], max_tokens=2)).collect()
    assert scheduler.stats().finished.get(FinishReason.CANCELLED) == 1
    assert nxt.finished.reason in (FinishReason.LENGTH, FinishReason.STOP)


# -- admission ----------------------------------------------------------------------------------


async def test_a_full_queue_rejects_at_once_with_retry_after(
    new: Callable[..., Scheduler],
) -> None:
    scheduler = new(n_slots=1, max_queue=2)
    async with scheduler.running():
        queued = [scheduler.submit(Request(prompt=[1, 2], max_tokens=4)) for _ in range(2)]
        with pytest.raises(Rejected) as e:
            scheduler.submit(Request(prompt=[1, 2], max_tokens=4))
        assert e.value.reason == RejectReason.QUEUE_FULL and e.value.retry_after_s
        for h in queued:
            await h.collect()
        later = await scheduler.submit(Request(prompt=[1, 2], max_tokens=4)).collect()
        assert later.finished.reason in (FinishReason.LENGTH, FinishReason.STOP)
        with pytest.raises(DuplicateRequestId):
            scheduler.submit(Request(prompt=[1], request_id="x"))
            scheduler.submit(Request(prompt=[1], request_id="x"))
    assert scheduler.stats().rejected == 1
    with pytest.raises(Rejected) as e:
        scheduler.submit(Request(prompt=[1, 2]))
    assert e.value.reason == RejectReason.SHUTTING_DOWN


async def test_priority_requests_overtake_waiting_ones(new: Callable[..., Scheduler]) -> None:
    scheduler = new(n_slots=1, policy=Policy.PRIORITY, aging_per_s=0.0)
    order: list[str] = []

    async def run(request: Request) -> None:
        await scheduler.submit(request).collect()
        order.append(request.request_id or "")

    async with scheduler.running(), anyio.create_task_group() as tg:
        tg.start_soon(run, Request(prompt=[1] * 8, max_tokens=10, request_id="first"))
        while scheduler.stats().running == 0:  # "first" holds the only slot
            await anyio.sleep(0.001)
        for rid, prio in [("low-a", 0), ("low-b", 0), ("high", 5)]:
            tg.start_soon(run, Request(prompt=[2, 3], max_tokens=3, priority=prio, request_id=rid))
    assert order == ["first", "high", "low-a", "low-b"]


async def test_a_low_priority_request_completes_under_sustained_high_priority_load(
    new: Callable[..., Scheduler],
) -> None:
    """High-priority requests keep the queue full; aging lets the low one in anyway."""
    scheduler = new(n_slots=1, policy=Policy.PRIORITY, aging_per_s=100.0, max_queue=64)
    low_done = anyio.Event()
    admitted_highs: list[str] = []

    async def high(i: int) -> None:
        r = Request(prompt=[3, 4, 5], max_tokens=4, priority=10, request_id=f"high-{i}")
        await scheduler.submit(r).collect()
        admitted_highs.append(r.request_id or "")

    async def flood() -> None:
        with anyio.move_on_after(10.0):
            for i in itertools.count():
                if low_done.is_set():
                    return
                if scheduler.stats().waiting < 4:
                    tg.start_soon(high, i)
                await anyio.sleep(0.002)
        raise AssertionError("the low-priority request starved")

    async with scheduler.running(), anyio.create_task_group() as tg:
        tg.start_soon(flood)
        await anyio.sleep(0.05)
        low = await scheduler.submit(Request(prompt=[7, 8], max_tokens=4, priority=0)).collect()
        low_done.set()
    assert low.finished.reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert low.finished.timings.queued_s < 1.0  # 10 points at 100 points/s: ~0.1 s
    assert len(admitted_highs) >= 3  # the high-priority load really was there


async def test_memory_accounting_never_admits_beyond_the_budget(
    new: Callable[..., Scheduler],
) -> None:
    probe = new(n_slots=1)  # only to price requests with the real pool accounting
    price = probe._budget.price(10, 20, draft_depth=0)
    budget = 2 * price + price // 2  # room for two requests, not three
    widest: list[int] = []
    scheduler: Scheduler

    def observe(ids: list[str]) -> None:
        widest.append(len(ids))
        stats = scheduler.stats()
        assert stats.reserved_bytes <= budget and stats.running <= 2

    scheduler = new(n_slots=4, memory_bytes=budget, fault_hook=observe)
    rng = random.Random(4)
    async with scheduler.running():
        handles = [
            scheduler.submit(Request(prompt=prompt(rng, 10), max_tokens=20, ignore_eos=True))
            for _ in range(6)  # the Speculator drafts nothing here: no capture is priced
        ]
        with pytest.raises(Rejected) as e:
            scheduler.submit(Request(prompt=prompt(rng, 10), max_tokens=140))
        assert e.value.reason == RejectReason.NEVER_FITS and e.value.retry_after_s is None
        results = [await h.collect() for h in handles]
    assert max(widest) == 2
    assert all(r.finished.reason == FinishReason.LENGTH for r in results)
    assert scheduler.stats().reserved_bytes == 0


# -- stop strings -------------------------------------------------------------------------------


async def test_stop_strings_across_token_boundaries_are_cut_exactly_and_never_streamed(
    new: Callable[..., Scheduler], tokenizer: Tokenizer
) -> None:
    base = Request(prompt=prompt(random.Random(6), 16), sampling=GREEDY, max_tokens=40)
    full = await alone(new, dataclasses.replace(base, ignore_eos=True))
    detok = tokenizer.detokenizer()
    pieces = [detok.push(t) for t in full.token_ids]  # the text each token completed
    # A stop string from the last character of token i to the first of token i + 2.
    i = next(i for i in range(4, len(pieces) - 2) if all(pieces[i : i + 3]))
    stop = pieces[i][-1] + pieces[i + 1] + pieces[i + 2][0]
    expected = full.text[: full.text.find(stop)]

    request = dataclasses.replace(base, ignore_eos=True, stop=(stop,))
    scheduler = new(n_slots=1)
    async with scheduler.running():
        events = await events_of(scheduler.submit(request))
    streamed = ""
    for e in events:
        if isinstance(e, Delta):
            streamed += e.text
            assert stop not in streamed
            assert expected.startswith(streamed)
    final = events[-1]
    assert isinstance(final, Finished)
    assert streamed == expected
    assert final.reason == FinishReason.STOP and final.matched_stop == stop
    assert completion(events).token_ids == full.token_ids[: len(completion(events).token_ids)]


async def test_a_stop_token_id_ends_the_request_after_it(new: Callable[..., Scheduler]) -> None:
    base = Request(prompt=prompt(random.Random(7), 12), sampling=GREEDY, max_tokens=20)
    full = await alone(new, dataclasses.replace(base, ignore_eos=True))
    stop = full.token_ids[6]
    got = await alone(new, dataclasses.replace(base, ignore_eos=True, stop_token_ids=(stop,)))
    cut = full.token_ids.index(stop) + 1
    assert got.token_ids == full.token_ids[:cut]  # the stop token is reported, and nothing after
    assert got.finished.reason == FinishReason.STOP and got.finished.matched_stop == stop
    assert full.text.startswith(got.text)


# -- deadlines, faults, shutdown ----------------------------------------------------------------


async def test_a_deadline_ends_the_request_with_what_it_produced(
    new: Callable[..., Scheduler],
) -> None:
    scheduler = new(n_slots=1)
    async with scheduler.running():
        r = Request(prompt=[1, 2, 3], max_tokens=150, ignore_eos=True, deadline_s=0.2)
        got = await scheduler.submit(r).collect()
    assert got.finished.reason == FinishReason.DEADLINE
    assert len(got.token_ids) < 150
    assert 0.2 <= got.finished.timings.total_s < 2.0  # ends at the first step boundary after


async def test_a_row_fault_ends_only_its_request_and_serving_goes_on(
    new: Callable[..., Scheduler],
) -> None:
    """A BatchError leaves the pool unchanged: the rows are bisected to the faulty one."""

    def fault(ids: list[str]) -> None:
        if "bad" in ids:
            raise BatchError("injected fault in the row of 'bad'")

    rng = random.Random(8)
    good = [Request(prompt=prompt(rng, 9), sampling=GREEDY, max_tokens=10) for _ in range(3)]
    scheduler = new(n_slots=4, fault_hook=fault)
    async with scheduler.running():
        handles = [scheduler.submit(r) for r in good]
        bad = scheduler.submit(Request(prompt=prompt(rng, 9), max_tokens=10, request_id="bad"))
        failed = await bad.collect()
        results = [await h.collect() for h in handles]
        after = await scheduler.submit(good[0]).collect()
    assert failed.finished.reason == FinishReason.ERROR
    assert failed.finished.error is not None and "injected" in failed.finished.error
    for request, result in zip(good, results, strict=True):
        same_output(result, await alone(new, request))
    same_output(after, results[0])


async def test_a_step_fault_ends_the_requests_of_that_step_and_serving_goes_on(
    new: Callable[..., Scheduler],
) -> None:
    """Any other exception leaves the forward's slots in an unknown state: all its
    requests end with an error; requests after it are served normally."""
    armed = [True]

    def fault(ids: list[str]) -> None:
        if armed[0] and len(ids) == 2:
            armed[0] = False
            raise RuntimeError("injected device fault")

    scheduler = new(n_slots=2, fault_hook=fault)
    async with scheduler.running():
        first = [scheduler.submit(Request(prompt=[i, 2, 3], max_tokens=8)) for i in range(2)]
        failed = [await h.collect() for h in first]
        after = await scheduler.submit(Request(prompt=[4, 5, 6], max_tokens=8)).collect()
    assert [f.finished.reason for f in failed] == [FinishReason.ERROR] * 2
    assert all("injected device fault" in (f.finished.error or "") for f in failed)
    assert after.finished.reason in (FinishReason.LENGTH, FinishReason.STOP)


@pytest.mark.parametrize("speculate", [False, True])
@pytest.mark.parametrize("bad_prompt", [40, 9], ids=["in-prefill", "in-decode"])
async def test_nan_logits_in_one_row_end_only_that_request_and_its_slot_serves_again(
    new: Callable[..., Scheduler], speculate: bool, bad_prompt: int
) -> None:
    """A numerical fault (non-finite logits) in one row, while it prefills or decodes,
    fails that request alone; the others match their solo runs, and the slot it held
    gives correct output to the next request."""
    steps: dict[str, int] = {}

    def nan_on_third_forward(ids: list[str]) -> list[str]:
        steps.update({i: steps.get(i, 0) + 1 for i in ids})
        return [i for i in ids if i.startswith("bad") and steps[i] == 3]

    rng = random.Random(9)
    good = [Request(prompt=prompt(rng, 9), sampling=GREEDY, max_tokens=12) for _ in range(3)]
    bad = Request(prompt=prompt(rng, bad_prompt), max_tokens=12, request_id="bad")
    scheduler = new(
        n_slots=4, speculate=speculate, max_prefill_chunk=16, fault_hook=nan_on_third_forward
    )
    async with scheduler.running():
        handles = [scheduler.submit(r) for r in good]
        failed = await scheduler.submit(bad).collect()
        results = [await h.collect() for h in handles]
        reused = [await scheduler.submit(r).collect() for r in good]  # the bad slot too
    assert failed.finished.reason == FinishReason.ERROR
    assert "non-finite logits" in (failed.finished.error or "")
    for request, result, again in zip(good, results, reused, strict=True):
        solo = await alone(new, request)
        same_output(result, solo)
        same_output(again, solo)


@pytest.mark.parametrize("fault", ["nan", "batch-error"])
async def test_a_row_failing_mid_decode_leaves_each_other_row_its_own_tokens(
    new: Callable[..., Scheduler], fault: str
) -> None:
    """A decode row fails (non-finite logits, or a BatchError bisected down to it) in the
    middle of a step of mixed requests — greedy, penalized, biased with log-probabilities,
    seeded sampling: every other request still gets the tokens, text and log-probabilities
    of its solo run (each row's output is resolved with its own request's state)."""
    seen: dict[str, int] = {}

    def hook(ids: list[str]) -> list[str]:
        seen.update({i: seen.get(i, 0) + 1 for i in ids})
        if "bad" in ids and seen["bad"] >= 4:
            if fault == "nan":
                return ["bad"]
            raise BatchError("injected fault in the row of 'bad'")
        return []

    good = [
        dataclasses.replace(r, max_tokens=10, stop=(), ignore_eos=True)
        for r in mixed_requests(5, seed=4)
    ]
    bad = Request(prompt=[5, 6, 7], sampling=GREEDY, max_tokens=10, request_id="bad")
    scheduler = new(n_slots=6, fault_hook=hook)
    async with scheduler.running():
        handles = [scheduler.submit(r) for r in [*good[:2], bad, *good[2:]]]
        results = [await h.collect() for h in handles]
    failed = results.pop(2)
    assert failed.finished.reason == FinishReason.ERROR
    for request, result in zip(good, results, strict=True):
        solo = await alone(new, request)
        same_output(result, solo)
        assert result.logprobs == solo.logprobs


async def test_faults_in_steps_taken_from_decode_ahead_end_only_their_requests(
    new: Callable[..., Scheduler],
) -> None:
    """Decode-ahead on, all greedy: NaN logits in one row of a step taken from the queue
    fail that request alone; a fault raised on a later taken step fails that step's
    requests; every other request matches its solo run, and the slots serve correctly
    after."""
    seen: dict[str, int] = {}

    def hook(ids: list[str]) -> list[str]:
        seen.update({i: seen.get(i, 0) + 1 for i in ids})
        if seen.get("boom", 0) == 6 and "boom" in ids:
            raise RuntimeError("device fault (injected)")
        return [i for i in ids if i == "nan" and seen[i] == 5]

    rng = random.Random(12)
    good = [
        Request(prompt=prompt(rng, 7), sampling=GREEDY, max_tokens=20, ignore_eos=True)
        for _ in range(2)
    ]
    nan = Request(prompt=prompt(rng, 7), sampling=GREEDY, max_tokens=20, request_id="nan")
    scheduler = new(n_slots=3, decode_ahead=True, fault_hook=hook)
    async with scheduler.running():
        handles = [scheduler.submit(r) for r in [*good, nan]]
        results = [await h.collect() for h in handles]
        adopted = scheduler._stepper.ahead.taken
        boom = Request(prompt=prompt(rng, 5), sampling=GREEDY, max_tokens=20, request_id="boom")
        exploded = await scheduler.submit(boom).collect()
        reused = [await scheduler.submit(r).collect() for r in good]
    assert adopted > 0
    assert results[2].finished.reason == FinishReason.ERROR
    assert "non-finite logits" in (results[2].finished.error or "")
    assert exploded.finished.reason == FinishReason.ERROR
    assert "injected" in (exploded.finished.error or "")
    for request, result, again in zip(good, results[:2], reused, strict=True):
        solo = await alone(new, request)
        same_output(result, solo)
        same_output(again, solo)


async def test_shutdown_gives_every_request_exactly_one_terminal_outcome(
    new: Callable[..., Scheduler],
) -> None:
    scheduler = new(n_slots=2, shutdown_grace_s=0.05)
    outcomes: list[list[Event]] = []

    async def consume(handle: RequestHandle) -> None:
        outcomes.append(await events_of(handle))

    async with anyio.create_task_group() as tg, scheduler.running():
        for i in range(6):  # two run, four wait
            handle = scheduler.submit(Request(prompt=[i + 1, 2], max_tokens=150, ignore_eos=True))
            tg.start_soon(consume, handle)
        await anyio.sleep(0.02)
    reasons = sorted(e[-1].reason for e in outcomes if isinstance(e[-1], Finished))
    assert len(outcomes) == 6
    assert reasons == [FinishReason.SHUTDOWN] * 6
    assert scheduler.stats().running == 0 and scheduler.stats().waiting == 0
