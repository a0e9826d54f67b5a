"""The exact prefix cache: the radix tree and budget alone, then the scheduler end to end.

Exactness is the point: a conversation replayed with the cache gives the tokens it gives
without it (greedy), whatever else runs, with speculation, with cancellations.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import pytest
import test_scheduler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.cache import SlotCopy, SlotPool, SlotSnapshot
from engine.models.qwen35 import Model
from engine.runner import ModelRunner
from engine.sampling import RequestRng
from engine.spec.drafters import MTPDrafter, _HostTail
from engine.spec.speculator import DecodingSlot, Speculator
from engine.tokenizer import Tokenizer
from scheduler import (
    Delta,
    Finished,
    FinishReason,
    PrefixCacheConfig,
    Request,
    Scheduler,
    Speculation,
)
from scheduler.prefix_cache import PrefixCache
from scheduler.prefix_reuse import PLACEMENTS, SlotImage

# The scheduler fixtures of test_scheduler: `new(n_slots, speculate, **config)` over a fresh
# pool of the tiny model (contexts of 160 tokens), checking every slot is freed.
model, tokenizer, new = test_scheduler.model, test_scheduler.tokenizer, test_scheduler.new
GREEDY = test_scheduler.GREEDY


@dataclass
class Blob:
    nbytes: int


# -- the tree and the budget ----------------------------------------------------------------


def test_longest_finds_the_longest_cached_prefix_within_the_limit() -> None:
    cache: PrefixCache[Blob] = PrefixCache(1000)
    for tokens in ([1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 9]):
        assert cache.reserve(10)
        cache.publish(tokens, Blob(10))
    hit = cache.longest([1, 2, 3, 4, 5, 7], limit=5)
    assert hit is not None and hit.tokens == (1, 2, 3, 4)
    cache.unpin(hit)
    hit = cache.longest([1, 2, 3, 4, 5, 6, 7], limit=6)
    assert hit is not None and hit.tokens == (1, 2, 3, 4, 5, 6)
    cache.unpin(hit)
    assert cache.longest([1, 2, 3, 4, 5, 6], limit=5) is not None  # (1, 2, 3, 4), pinned
    assert cache.longest([2, 1], limit=1) is None
    assert cache.counts.lookups == 4 and cache.counts.hits == 3


def test_a_pinned_prefix_is_never_evicted_and_room_is_refused_instead() -> None:
    cache: PrefixCache[Blob] = PrefixCache(100)
    assert cache.reserve(60)
    cache.publish([1, 2, 3], Blob(60))
    pinned = cache.longest([1, 2, 3, 4], limit=3)
    assert pinned is not None
    assert not cache.reserve(60)  # only the pinned one could make room
    assert [1, 2, 3] in cache and cache.counts.dropped == 1
    cache.unpin(pinned)
    assert cache.reserve(60)  # now it goes
    assert [1, 2, 3] not in cache and cache.counts.evictions == 1


def test_eviction_prefers_prefixes_that_save_few_tokens_and_were_used_long_ago() -> None:
    cache: PrefixCache[Blob] = PrefixCache(30)
    for tokens in ([1] * 50, [2] * 5, [3] * 20):
        assert cache.reserve(10)
        cache.publish(tokens, Blob(10))
    assert cache.reserve(10)  # evicts the 5-token prefix
    assert [2] * 5 not in cache and [1] * 50 in cache and [3] * 20 in cache


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["publish", "lookup", "unpin", "pending"]),
            st.lists(st.integers(0, 3), min_size=1, max_size=8),
            st.integers(1, 40),
        ),
        max_size=60,
    )
)
def test_random_use_keeps_the_budget_the_pins_and_the_longest_match(
    ops: list[tuple[str, list[int], int]],
) -> None:
    budget = 100
    cache: PrefixCache[Blob] = PrefixCache(budget)
    pins: list[Any] = []
    pending = 0
    for op, tokens, size in ops:
        if op == "publish" and cache.reserve(size):
            cache.publish(tokens, Blob(size))
        elif op == "pending" and cache.reserve(size):
            pending += size
        elif op == "lookup":
            limit = len(tokens) - 1
            expect = max(
                (
                    len(k)
                    for k in cache._entries
                    if len(k) <= limit and tuple(tokens[: len(k)]) == k
                ),
                default=None,
            )
            hit = cache.longest(tokens, limit)
            assert (hit and hit.length) == expect
            if hit is not None:
                pins.append(hit)
        elif op == "unpin" and pins:
            cache.unpin(pins.pop(0))
        assert cache.held_bytes <= budget
        assert all(p.tokens in cache for p in pins)
        assert (
            cache.counts.bytes_held
            == sum(b.entry.nbytes for b in cache._entries.values() if b.entry) + pending
        )


# -- the scheduler ------------------------------------------------------------------------------


def message(rng: random.Random, end: int, n: int) -> list[int]:
    """A user message: random tokens ending in the end-of-message token."""
    return [rng.randrange(0, 500) for _ in range(n)] + [end]


Conversation = list[list[int]]  # the user messages of one conversation


async def run_conversations(
    scheduler: Scheduler,
    conversations: list[Conversation],
    max_tokens: int,
    cancel_every: int = 0,
    prefix_cache: bool = True,
    speculation: Speculation = Speculation.AUTO,
) -> tuple[list[list[list[int]]], list[Finished]]:
    """Each conversation turn by turn (prompt = history + next message), all conversations
    at once. Returns each turn's output tokens, and every Finished. With `cancel_every`,
    every so many turns a copy of the turn's prompt also runs and is cancelled early."""
    outputs: list[list[list[int]]] = [[] for _ in conversations]
    finished: list[Finished] = []
    turn_no = iter(range(10**6))

    async def collect(request: Request, cancel: bool) -> list[int]:
        handle = scheduler.submit(request)
        tokens: list[int] = []
        if cancel:
            handle.cancel()
        async for e in handle:
            if isinstance(e, Delta):
                tokens += e.token_ids
            else:
                assert isinstance(e, Finished)
                finished.append(e)
        return tokens

    async def converse(i: int, turns: Conversation) -> None:
        history: list[int] = []
        for msg in turns:
            history = history + msg
            n = next(turn_no)
            request = Request(
                prompt=history,
                sampling=GREEDY,
                max_tokens=max_tokens,
                prefix_cache=prefix_cache,
                speculation=speculation,
            )
            if cancel_every and n % cancel_every == 0:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(collect, request, True)
                    out = await collect(request, False)
            else:
                out = await collect(request, False)
            outputs[i].append(out)
            history = history + out

    async with scheduler.running(), anyio.create_task_group() as tg:
        for i, turns in enumerate(conversations):
            tg.start_soon(converse, i, turns)
    return outputs, finished


def conversations_of(seed: int, n: int, turns: int, end: int) -> list[Conversation]:
    rng = random.Random(seed)
    return [[message(rng, end, rng.randrange(3, 17)) for _ in range(turns)] for _ in range(n)]


def cache_config(**kw: Any) -> PrefixCacheConfig:
    return PrefixCacheConfig(**{"budget_bytes": 64 << 20, "interval": 16, "min_tokens": 4} | kw)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 10**6),
    n_convs=st.integers(1, 3),
    speculate=st.booleans(),
    chunk=st.sampled_from([7, 32, 256]),
    placement=st.sampled_from(PLACEMENTS),
)
def test_conversations_with_the_cache_give_the_tokens_they_give_without_it(
    new: Callable[..., Scheduler],
    tokenizer: Tokenizer,
    seed: int,
    n_convs: int,
    speculate: bool,
    chunk: int,
    placement: str,
) -> None:
    end = min(tokenizer.eog_ids)
    convs = conversations_of(seed, n_convs, 4, end)

    async def both() -> None:
        plain = new(n_slots=2, speculate=speculate, max_prefill_chunk=chunk)
        want, _ = await run_conversations(plain, convs, max_tokens=12)
        config = cache_config(placement=placement)
        cached = new(n_slots=2, speculate=speculate, max_prefill_chunk=chunk, prefix_cache=config)
        got, finished = await run_conversations(cached, convs, max_tokens=12)
        assert got == want
        stats = cached.stats().prefix_cache
        assert stats.hits >= n_convs * 3  # every later turn extends a cached prefix
        assert sum(f.usage.cached_tokens for f in finished) == stats.tokens_saved > 0
        assert all(f.usage.cached_tokens < f.usage.prompt_tokens for f in finished)
        assert cached.stats().prompt_tokens + stats.tokens_saved == sum(
            f.usage.prompt_tokens for f in finished
        )

    anyio.run(both)


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_hits_restored_while_other_slots_decode_and_cancelled_requests_stay_exact(
    new: Callable[..., Scheduler], tokenizer: Tokenizer, placement: str
) -> None:
    end = min(tokenizer.eog_ids)
    convs = conversations_of(7, 3, 4, end)
    plain = new(n_slots=4, speculate=True, max_prefill_chunk=16)
    want, _ = await run_conversations(plain, convs, max_tokens=16)
    config = cache_config(interval=8, placement=placement)
    cached = new(n_slots=4, speculate=True, max_prefill_chunk=16, prefix_cache=config)
    got, finished = await run_conversations(cached, convs, max_tokens=16, cancel_every=2)
    assert got == want
    assert sum(f.reason == FinishReason.CANCELLED for f in finished) > 0
    assert cached.stats().prefix_cache.hits > 0
    assert all(e.pins == 0 for e in _entries(cached))
    # taken as device copies; published as they are ("device") or in host memory ("host")
    kind, rows = (SlotCopy, mx.array) if placement == "device" else (SlotSnapshot, np.ndarray)
    assert all(isinstance(e.image.snapshot, kind) for e in _entries(cached))
    tails = [s for e in _entries(cached) for s in e.image.drafters.values()]
    assert tails and all(isinstance(t, _HostTail) and t.n for t in tails)
    assert all(isinstance(t.rows, rows) for t in tails)  # the MTP head's hidden rows


def test_an_unknown_placement_is_refused() -> None:
    with pytest.raises(ValueError, match="placement must be one of device, host"):
        cache_config(placement="disk")


async def test_the_budget_holds_under_pressure_and_evicts(
    new: Callable[..., Scheduler], tokenizer: Tokenizer
) -> None:
    end = min(tokenizer.eog_ids)
    convs = conversations_of(11, 3, 5, end)
    plain = new(n_slots=3)
    want, _ = await run_conversations(plain, convs, max_tokens=8)
    pool = plain.runner.pool
    budget = 3 * pool.bytes_for(120)  # room for a few snapshots only
    cached = new(n_slots=3, prefix_cache=cache_config(budget_bytes=budget, interval=8))
    seen: list[int] = []

    async def watch() -> None:
        while True:
            seen.append(cached.stats().prefix_cache.bytes_held)
            await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        got, _ = await run_conversations(cached, convs, max_tokens=8)
        tg.cancel_scope.cancel()
    assert got == want
    stats = cached.stats().prefix_cache
    assert stats.evictions > 0 and stats.hits > 0
    assert max(seen) <= budget and stats.bytes_held <= budget
    assert sum(e.nbytes for e in _entries(cached)) <= budget


async def test_a_request_may_opt_out_and_a_scheduler_may_run_without_the_cache(
    new: Callable[..., Scheduler], tokenizer: Tokenizer
) -> None:
    end = min(tokenizer.eog_ids)
    convs = conversations_of(3, 1, 3, end)
    cached = new(n_slots=1, prefix_cache=cache_config())
    _, finished = await run_conversations(cached, convs, max_tokens=6, prefix_cache=False)
    assert cached.stats().prefix_cache.lookups == 0 and not _entries(cached)
    assert all(f.usage.cached_tokens == 0 for f in finished)
    off = new(n_slots=1)
    _, finished = await run_conversations(off, convs, max_tokens=6)
    assert off.stats().prefix_cache.lookups == 0
    assert all(f.usage.cached_tokens == 0 for f in finished)


async def test_a_request_that_fails_publishes_nothing(
    new: Callable[..., Scheduler], tokenizer: Tokenizer
) -> None:
    calls = []

    def fail(ids: list[str]) -> None:  # after two prompt chunks, each ending at a snapshot
        calls.append(ids)
        if len(calls) == 3:
            raise RuntimeError("injected")

    cached = new(n_slots=1, prefix_cache=cache_config(), fault_hook=fail)
    ids = message(random.Random(1), min(tokenizer.eog_ids), 40)
    async with cached.running():
        got = await cached.submit(Request(prompt=ids, max_tokens=4, request_id="bad")).collect()
    assert got.finished.reason == FinishReason.ERROR
    assert got.finished.usage.cached_tokens == 0
    stats = cached.stats().prefix_cache
    assert stats.published == 0 and stats.bytes_held == 0 and not _entries(cached)


def _entries(scheduler: Scheduler) -> list[Any]:
    cache = scheduler._reuse.cache
    return [n.entry for n in cache._entries.values() if n.entry is not None]


async def test_the_next_turn_resumes_after_the_previous_reply_when_it_sends_it_back(
    new: Callable[..., Scheduler], tokenizer: Tokenizer
) -> None:
    """The finished request's slot holds prompt + reply (but the last reply token): the next
    turn, which sends the reply back, prefills only from there."""
    end = min(tokenizer.eog_ids)
    convs = conversations_of(5, 1, 2, end)
    cached = new(n_slots=1, prefix_cache=cache_config())
    (outputs,), finished = await run_conversations(cached, convs, max_tokens=10)
    first_prompt = len(convs[0][0])
    assert finished[1].usage.cached_tokens == first_prompt + len(outputs[0]) - 1


async def test_several_hits_restored_in_one_step_each_give_their_own_tokens(
    new: Callable[..., Scheduler], tokenizer: Tokenizer
) -> None:
    rng = random.Random(9)
    end = min(tokenizer.eog_ids)
    shared = message(rng, end, 40)
    prompts = [shared + message(rng, end, rng.randrange(2, 12)) for _ in range(3)]
    requests = [Request(prompt=p, sampling=GREEDY, max_tokens=8) for p in prompts]
    plain = new(n_slots=3)
    async with plain.running():
        want = [(await plain.submit(r).collect()).token_ids for r in requests]
    cached = new(n_slots=3, prefix_cache=cache_config())
    async with cached.running():
        await cached.submit(Request(prompt=shared, max_tokens=2)).collect()
        handles = [cached.submit(r) for r in requests]  # admitted together, in one step
        got = [await h.collect() for h in handles]
    assert [g.token_ids for g in got] == want
    assert [g.finished.usage.cached_tokens for g in got] == [len(shared)] * 3


def test_a_restored_slot_drafts_with_the_mtp_head_as_the_slot_it_was_taken_from(
    model: Model,
) -> None:
    pool = SlotPool(model.config, 2, 160, kv_dtype=mx.float32, max_draft=2)
    runner = ModelRunner(model, pool)
    spec = Speculator(runner, 2, drafters=[MTPDrafter(runner)])
    prompt = [random.Random(4).randrange(0, 500) for _ in range(30)]
    a = pool.allocate()
    row = spec.prefill_row(a, prompt, 0, "on")
    out = runner.step([row]).rows[0]
    spec.prefilled(row, out)
    image = SlotImage.capture(pool, spec, a)
    assert image.drafters and image.nbytes > image.snapshot.nbytes
    b = pool.allocate()
    image.restore(pool, spec, b, "on")
    first = int(np.argmax(np.array(out.logits[-1])))
    slots = [DecodingSlot(s, first, [*prompt, first], GREEDY, RequestRng(0), "on") for s in (a, b)]
    rows = spec.plan(slots)
    assert len(rows[0].tokens) == 3 and rows[0].tokens == rows[1].tokens  # both drafted K = 2
    committed = spec.resolve(slots, runner.step(rows).rows)
    assert committed[0].tokens == committed[1].tokens
    assert pool.lengths[a] == pool.lengths[b]


async def test_a_cold_prompt_of_many_messages_is_snapshotted_only_at_its_last_boundaries(
    new: Callable[..., Scheduler], tokenizer: Tokenizer
) -> None:
    rng = random.Random(2)
    end = min(tokenizer.eog_ids)
    prompt = [t for _ in range(10) for t in message(rng, end, 8)]
    ends = [i + 1 for i, t in enumerate(prompt) if t == end]
    cached = new(n_slots=1, prefix_cache=cache_config(interval=0, per_prompt=3, finished=False))
    async with cached.running():
        await cached.submit(Request(prompt=prompt, max_tokens=2)).collect()
    assert sorted(e.length for e in _entries(cached)) == ends[-3:]


async def test_a_prompt_that_leaves_an_earlier_one_midway_resumes_from_its_last_boundary(
    new: Callable[..., Scheduler],
) -> None:
    """Snapshots every 16 tokens of a 50-token prompt; a prompt sharing its first 40 tokens
    resumes at 32, the last boundary before they part."""
    rng = random.Random(6)
    first = [rng.randrange(0, 500) for _ in range(50)]
    branch = first[:40] + [rng.randrange(0, 500) for _ in range(12)]
    request = Request(prompt=branch, sampling=GREEDY, max_tokens=8)
    plain = new(n_slots=1)
    async with plain.running():
        want = await plain.submit(request).collect()
    cached = new(n_slots=1, prefix_cache=cache_config(interval=16))
    async with cached.running():
        await cached.submit(Request(prompt=first, max_tokens=2)).collect()
        got = await cached.submit(request).collect()
    assert got.finished.usage.cached_tokens == 32
    assert got.token_ids == want.token_ids
