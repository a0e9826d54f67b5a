"""The prefix cache carries a DFlash drafter's per-slot state: a request resumed from a
snapshot drafts with DFlash as the request it was taken from would have, and the
snapshot's bytes count that state.

The drafter is random (conftest's `make_dflash`): its drafts are almost always rejected,
so greedy outputs must not change, and speculation "on" drafts at every step it can.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import test_scheduler
from test_prefix_cache import _entries, cache_config, conversations_of, run_conversations

from engine.cache import SlotId, SlotPool
from engine.models.qwen35 import Model
from engine.runner import ModelRunner
from engine.sampling import RequestRng
from engine.spec.dflash import DFlashModel, load_dflash
from engine.spec.drafters import DFlashDrafter, _HostContext
from engine.spec.speculator import DecodingSlot, Speculator
from engine.tokenizer import Tokenizer
from scheduler import Scheduler, SchedulerConfig, Speculation
from scheduler.prefix_reuse import SlotImage

model, tokenizer = test_scheduler.model, test_scheduler.tokenizer
GREEDY, CONTEXT, MAX_DRAFT = test_scheduler.GREEDY, test_scheduler.CONTEXT, test_scheduler.MAX_DRAFT


@pytest.fixture(scope="module")
def dflash(model: Model, make_dflash: Callable[..., Path]) -> DFlashModel:
    return load_dflash(make_dflash("tiny"), model)


def speculator(model: Model, dflash: DFlashModel, n_slots: int) -> Speculator:
    """A speculator whose only drafter is DFlash, over a fresh f32 pool."""
    pool = SlotPool(model.config, n_slots, CONTEXT, kv_dtype=mx.float32, max_draft=MAX_DRAFT)
    runner = ModelRunner(model, pool)
    return Speculator(runner, MAX_DRAFT, [DFlashDrafter(runner, dflash)])


@pytest.fixture
def new(
    model: Model, tokenizer: Tokenizer, dflash: DFlashModel
) -> Iterator[Callable[..., Scheduler]]:
    """`new(n_slots, **config)`: a Scheduler drafting with DFlash only; every slot freed."""
    pools: list[SlotPool] = []

    def make(n_slots: int = 2, **config: Any) -> Scheduler:
        spec = speculator(model, dflash, n_slots)
        pools.append(spec.runner.pool)
        return Scheduler(spec.runner, tokenizer, SchedulerConfig(**config), spec)

    yield make
    for pool in pools:
        assert pool.free_slots == pool.n_slots, "a slot was not freed"


async def test_a_turn_resumed_from_the_cache_drafts_with_dflash_and_keeps_its_tokens(
    new: Callable[..., Scheduler], tokenizer: Tokenizer
) -> None:
    """Later turns resume from the snapshot of the turn before (prompt + reply), or of a
    prompt boundary (every 16 tokens, chunks of 7), and draft at every step but the last."""
    convs = conversations_of(21, 2, 3, min(tokenizer.eog_ids))
    plain = new(max_prefill_chunk=7)
    want, _ = await run_conversations(plain, convs, max_tokens=10, speculation=Speculation.ON)
    cached = new(max_prefill_chunk=7, prefix_cache=cache_config())
    got, finished = await run_conversations(
        cached, convs, max_tokens=10, speculation=Speculation.ON
    )
    assert got == want
    resumed = [f for f in finished if f.usage.cached_tokens]
    assert len(resumed) == 4  # every later turn
    for f in resumed:
        assert f.spec.drafted > 0 and f.spec.verify_steps >= f.spec.decode_steps - 1


async def test_the_cache_counts_the_bytes_of_the_dflash_state_in_its_snapshots(
    new: Callable[..., Scheduler], tokenizer: Tokenizer, dflash: DFlashModel
) -> None:
    convs = conversations_of(22, 1, 2, min(tokenizer.eog_ids))
    cached = new(n_slots=1, max_prefill_chunk=7, prefix_cache=cache_config())
    await run_conversations(cached, convs, max_tokens=6, speculation=Speculation.ON)
    entries = _entries(cached)
    assert entries
    (drafter,) = cached._stepper.speculator.drafters
    assert isinstance(drafter, DFlashDrafter)
    features = len(dflash.config.target_layers) * dflash.config.n_embd * 4  # f32 rows
    for e in entries:
        state = e.image.drafters["dflash"]
        assert isinstance(state, _HostContext)
        kept, waiting = state.waiting.start, state.waiting.n
        assert kept + waiting == e.length  # exactly the positions the snapshot holds
        assert state.nbytes == drafter.pool.bytes_for(kept) + waiting * features
        assert e.nbytes == e.image.snapshot.nbytes + state.nbytes
    assert cached.stats().prefix_cache.bytes_held == sum(e.nbytes for e in entries)


def prefill(spec: Speculator, slot: SlotId, tokens: list[int], start: int = 0) -> int:
    """Prefill `tokens` of `slot` at `start` (speculation on); returns the greedy next token."""
    row = spec.prefill_row(slot, tokens, start, "on")
    out = spec.runner.step([row]).rows[0]
    spec.prefilled(row, out)
    return int(np.argmax(np.array(out.logits[-1])))


def block_logits(drafter: DFlashDrafter, slots: list[SlotId], pending: int) -> np.ndarray:
    """The drafter's next block logits `[N, block_size, V]` of `slots` (caught up first)."""
    drafter.catch_up(slots)
    lengths = [drafter.pool.lengths[s] for s in slots]
    return np.array(
        drafter.model(
            mx.array([pending] * len(slots), dtype=mx.int32),
            mx.array(lengths, dtype=mx.int32),
            drafter.pool.read(slots),
            mx.array(lengths, dtype=mx.int32),
        )
    )


def test_an_adopted_slot_drafts_the_block_of_the_slot_it_was_exported_from(
    model: Model, dflash: DFlashModel
) -> None:
    """The exported state holds context K/V (caught up after the first chunk) and waiting
    features (the second chunk): both come back in the other slot."""
    spec = speculator(model, dflash, 2)
    pool, (drafter,) = spec.runner.pool, spec.drafters
    assert isinstance(drafter, DFlashDrafter)
    prompt = [random.Random(4).randrange(0, 500) for _ in range(30)]
    a = pool.allocate()
    prefill(spec, a, prompt[:20])
    drafter.catch_up([a])
    pending = prefill(spec, a, prompt[20:], 20)
    image = SlotImage.capture(pool, spec, a)
    state = image.drafters["dflash"]
    assert isinstance(state, _HostContext)
    assert (state.waiting.start, state.waiting.n) == (20, 10)
    b = pool.allocate()
    image.restore(pool, spec, b, "on")
    logits = block_logits(drafter, [a, b], pending)
    np.testing.assert_allclose(logits[1], logits[0], atol=1e-6)
    slots = [
        DecodingSlot(s, pending, [*prompt, pending], GREEDY, RequestRng(0), "on") for s in (a, b)
    ]
    rows = spec.plan(slots)
    assert len(rows[0].tokens) == MAX_DRAFT + 1 and rows[0].tokens == rows[1].tokens
    committed = spec.resolve(slots, spec.runner.step(rows).rows)
    assert committed[0].tokens == committed[1].tokens


def test_an_export_holds_nothing_past_the_trunk_length(model: Model, dflash: DFlashModel) -> None:
    """A drafter ahead of its slot's trunk (here: the trunk's length cut back to 16 after
    30 positions, 24 of them caught up) exports the state of a slot that only ever held
    the first 16 positions."""
    spec = speculator(model, dflash, 2)
    pool, (drafter,) = spec.runner.pool, spec.drafters
    assert isinstance(drafter, DFlashDrafter)
    prompt = [random.Random(5).randrange(0, 500) for _ in range(30)]
    a, ref = pool.allocate(), pool.allocate()
    prefill(spec, a, prompt[:24])
    drafter.catch_up([a])
    prefill(spec, a, prompt[24:], 24)
    pool.lengths[a] = 16
    prefill(spec, ref, prompt[:16])
    got, want = drafter.export(a), drafter.export(ref)
    assert isinstance(got, _HostContext) and isinstance(want, _HostContext)
    assert (got.waiting.start, got.waiting.n, got.nbytes) == (16, 0, drafter.pool.bytes_for(16))
    assert want.waiting.start == 0 and want.waiting.n == 16
    drafter.adopt(ref, want)
    drafter.catch_up([ref])
    np.testing.assert_allclose(got.k, np.array(drafter.pool.k[:, ref, :16]), atol=1e-5)
    np.testing.assert_allclose(got.v, np.array(drafter.pool.v[:, ref, :16]), atol=1e-5)
    pool.lengths[a] = 20  # behind: positions 16..19 were never observed since
    drafter.adopt(a, got)
    assert drafter.export(a) is None
