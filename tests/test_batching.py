"""Invariant 1: a slot's output does not depend on what else is in the batch.

Random mixes of requests with staggered arrivals, chunked prefills, staggered
finishes and slot reuse run through one batched step at a time; each request's
greedy tokens and logits must equal those of running it alone.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pool import snapshots_equal

from engine.cache import SlotId, SlotPool
from engine.models.batch import Layout
from engine.models.qwen35 import Model, load_model
from engine.runner import ModelRunner, Row

CONTEXT = 64


@dataclass
class Request:
    prompt: list[int]
    n_gen: int
    arrival: int
    chunk: int
    slot: SlotId | None = None
    fed: int = 0  # prompt tokens already fed
    out: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.out) >= self.n_gen


@pytest.fixture(scope="module")
def model(make_model: Callable[..., Path]) -> Model:
    return load_model(make_model("tiny", quant="f32"))


@pytest.fixture(scope="module")
def solo(model: Model) -> Callable[[list[int], int], tuple[list[int], list[np.ndarray]]]:
    cache: dict[tuple[tuple[int, ...], int], tuple[list[int], list[np.ndarray]]] = {}

    def run(prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
        key = (tuple(prompt), n)
        if key not in cache:
            r = Request(prompt, n, 0, len(prompt))
            simulate(model, [r], n_slots=1)
            cache[key] = (r.out, r.logits)
        return cache[key]

    return run


def simulate(model: Model, requests: list[Request], n_slots: int, pad: bool = False) -> None:
    """Admit by arrival into free slots; every step runs ONE batch over all active slots
    (`pad`: decode steps at a padded width, as a compiled runner on a GPU runs them)."""
    runner = ModelRunner(model, SlotPool(model.config, n_slots, CONTEXT, kv_dtype=mx.float32))
    runner.pad_widths = pad
    pool = runner.pool
    waiting = sorted(requests, key=lambda r: r.arrival)
    active: list[Request] = []
    step = 0
    while waiting or active:
        while waiting and waiting[0].arrival <= step and pool.free_slots:
            r = waiting.pop(0)
            r.slot = pool.allocate()
            active.append(r)
        rows = []
        for r in active:
            assert r.slot is not None
            piece = r.prompt[r.fed : r.fed + r.chunk] if r.fed < len(r.prompt) else [r.out[-1]]
            rows.append(Row(r.slot, piece, pool.lengths[r.slot]))
        if rows:
            out = runner.step(rows)
            for r, row, res in zip(active, rows, out.rows, strict=True):
                r.fed = min(len(r.prompt), r.fed + len(row.tokens))
                if r.fed == len(r.prompt):
                    logits = np.array(res.logits[-1])
                    r.logits.append(logits)
                    r.out.append(int(logits.argmax()))
            for r in [r for r in active if r.done]:
                assert r.slot is not None
                pool.free(r.slot)
                active.remove(r)
        step += 1


def assert_matches_solo(
    requests: list[Request], solo: Callable[[list[int], int], tuple[list[int], list[np.ndarray]]]
) -> None:
    for r in requests:
        tokens, logits = solo(r.prompt, r.n_gen)
        assert r.out == tokens
        for ours, ref in zip(r.logits, logits, strict=True):
            assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


request_st = st.builds(
    lambda n, gen, arrival, chunk, seed: Request(
        [int(t) for t in np.random.default_rng(seed).integers(0, 512, n)], gen, arrival, chunk
    ),
    n=st.integers(1, 24),
    gen=st.integers(1, 8),
    arrival=st.integers(0, 6),
    chunk=st.integers(1, 16),
    seed=st.integers(0, 10_000),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    requests=st.lists(request_st, min_size=1, max_size=8),
    n_slots=st.integers(1, 8),
    pad=st.booleans(),
)
def test_batched_greedy_equals_solo(
    model: Model,
    solo: Callable[[list[int], int], tuple[list[int], list[np.ndarray]]],
    requests: list[Request],
    n_slots: int,
    pad: bool,
) -> None:
    simulate(model, requests, n_slots, pad)
    assert_matches_solo(requests, solo)


def test_long_staggered_eviction_scenario_is_stable(
    model: Model, solo: Callable[[list[int], int], tuple[list[int], list[np.ndarray]]]
) -> None:
    """Twelve requests through four slots, slots reused as requests finish; 40 repetitions."""
    rng = np.random.default_rng(7)
    specs = [
        ([int(t) for t in rng.integers(0, 512, 3 + 2 * i)], 2 + i % 5, i, 1 + i % 6)
        for i in range(12)
    ]
    for i in range(40):
        requests = [Request(list(p), g, a, c) for p, g, a, c in specs]
        simulate(model, requests, n_slots=4, pad=i % 2 == 1)
        assert_matches_solo(requests, solo)


@pytest.mark.parametrize("pad", [False, True])
def test_slots_outside_the_batch_are_untouched(model: Model, pad: bool) -> None:
    """Padded (`pad`), a 3-row step also reads the fourth slot for its padding row: it still
    leaves it as it was, bit for bit."""
    runner = ModelRunner(model, SlotPool(model.config, 4, CONTEXT, kv_dtype=mx.float32))
    runner.pad_widths = pad
    pool = runner.pool
    slots = [pool.allocate() for _ in range(4)]
    runner.step([Row(s, [1 + s, 2, 3, 4 + s][: 2 + s], 0) for s in slots])
    for batch in ([slots[0]], [slots[1], slots[3]], [slots[2]], slots[:3], slots[1:]):
        before = {s: pool.snapshot(s) for s in slots if s not in batch}
        runner.step([Row(s, [5], pool.lengths[s]) for s in batch])
        for s, snap in before.items():
            after = pool.snapshot(s)
            assert after.length == snap.length
            for a, b in zip(
                [*after.kv, after.conv, after.ssm], [*snap.kv, snap.conv, snap.ssm], strict=True
            ):
                for x, y in zip(a, b, strict=True):
                    assert np.array_equal(x, y)
    assert any(key[:2] == (4, 1) for key in runner._compiled) == pad  # 3 rows ran as 4


def test_steps_returning_every_position_take_their_outputs_without_a_gather(
    model: Model, tmp_path: Path
) -> None:
    """Decode and verify steps return every position in order: the forward hands its hidden
    rows on as they are, its only gather the embedding lookup; a prefill returning its rows'
    last positions gathers them (on a GPU a gather is a launch)."""
    runner = ModelRunner(model, SlotPool(model.config, 2, CONTEXT, mx.float32, max_draft=2))
    pool = runner.pool
    slots = [pool.allocate() for _ in range(2)]
    runner.step([Row(s, [1, 2, 3], 0) for s in slots])
    runner.step([Row(s, [4], 3) for s in slots])
    runner.step([Row(s, [5, 6, 7], 4, capture=True, want=range(3)) for s in slots])
    assert [key[5] for key in runner._compiled] == [False, True, True]  # shape_key's `every`
    layout = Layout.build([1, 1], [7, 7], [False, False])
    for every, gathers in ((True, 1), (False, 2)):
        _, fn = runner._forward_fn(layout, 2, 8, (), every)
        inputs = [mx.array([8, 9], dtype=mx.int32), mx.arange(2, dtype=mx.int32)]
        _, hidden, *_ = fn([*inputs, *layout.arrays()], pool.read(slots, 8))
        mx.export_to_dot(str(tmp_path / "g.dot"), hidden)
        labels = re.findall(r'label ="([^"]*)"', (tmp_path / "g.dot").read_text())
        assert labels.count("Gather") == gathers


def test_a_padded_launch_equals_an_unpadded_step(model: Model) -> None:
    """A decode step queued ahead (`launch`, `adopt`) at a padded width gives the rows what an
    unpadded `step` gives them, and leaves the slot its padding row read as it was."""
    prompts = [[3, 1, 4, 1], [5, 9], [2, 6, 5, 3, 5], [8, 9, 7]]
    runs = []
    for pad in (False, True):
        runner = ModelRunner(model, SlotPool(model.config, 4, CONTEXT, kv_dtype=mx.float32))
        runner.pad_widths = pad
        pool = runner.pool
        slots = [pool.allocate() for _ in prompts]
        runner.step([Row(s, p, 0) for s, p in zip(slots, prompts, strict=True)])
        idle = pool.snapshot(slots[3])
        if pad:
            out = runner.adopt(runner.launch(slots[:3], mx.array([7, 8, 9])), range(3))
            assert any(key[:2] == (4, 1) for key in runner._compiled)  # 3 rows ran as 4
        else:
            out = runner.step(
                [Row(s, [t], pool.lengths[s]) for s, t in zip(slots[:3], [7, 8, 9], strict=True)]
            )
        assert snapshots_equal(pool.snapshot(slots[3]), idle)
        runs.append(([np.array(r.logits) for r in out.rows], [pool.snapshot(s) for s in slots]))
    (plain_logits, plain_slots), (padded_logits, padded_slots) = runs
    for a, b in zip(plain_logits, padded_logits, strict=True):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
    for a, b in zip(plain_slots, padded_slots, strict=True):
        assert snapshots_equal(a, b, atol=1e-5)


@pytest.mark.parametrize("compile", [False, True])
def test_the_runner_keeps_a_bounded_number_of_forwards_and_evicted_shapes_give_the_same_logits(
    model: Model, compile: bool
) -> None:
    """Every ragged prefill length is a new batch shape: a daemon that kept a forward
    for each one grew without bound. The least recently used ones go."""
    pool = SlotPool(model.config, 1, CONTEXT, kv_dtype=mx.float32)
    runner = ModelRunner(model, pool, compile=compile)
    runner.MAX_FORWARDS = 4
    slot = pool.allocate()

    def logits(n: int) -> np.ndarray:
        pool.reset(slot)
        return np.array(runner.step([Row(slot, list(range(1, n + 1)), 0)]).rows[0].logits)

    first = logits(3)
    for n in range(4, 12):
        logits(n)
        assert runner.cached_forwards <= 4
    np.testing.assert_array_equal(logits(3), first)  # rebuilt after eviction
    pool.free(slot)
