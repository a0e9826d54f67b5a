"""Event sinks (`Scheduler.submit(request, sink=...)`) on a real tiny model: the same events
as a handle, in order, exactly one terminal, and a sink that fails costs only its request."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import anyio
import pytest
from serving import Tiny, load_tiny, new_scheduler

from engine.sampling import SamplingParams
from scheduler import (
    Delta,
    Event,
    Finished,
    FinishReason,
    Request,
    Scheduler,
    SchedulerConfig,
    StepSink,
)
from scheduler.publish_order import PROBE_EVERY

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=3, logprobs=2)


@pytest.fixture(scope="module")
def tiny(make_model: Callable[..., Path]) -> Tiny:
    return load_tiny(make_model("tiny"))


class Recorder:
    """A sink that keeps what it gets and notes the threads it is called on; it raises on
    its `fail_at`-th call (from 0), or on the Finished with `fail_on_end`."""

    def __init__(self, fail_at: int | None = None, fail_on_end: bool = False) -> None:
        self.events: list[Event] = []
        self.threads: set[int] = set()
        self.fail_at, self.fail_on_end = fail_at, fail_on_end
        self.calls = 0

    def __call__(self, event: Event) -> None:
        self.calls += 1
        self.threads.add(threading.get_ident())
        if self.calls - 1 == self.fail_at or (self.fail_on_end and isinstance(event, Finished)):
            raise RuntimeError("sink broke")
        self.events.append(event)

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events if isinstance(e, Delta) for t in e.token_ids]

    @property
    def terminals(self) -> list[Finished]:
        return [e for e in self.events if isinstance(e, Finished)]

    async def wait(self, timeout: float = 30.0) -> Finished:
        with anyio.fail_after(timeout):
            while not self.terminals:
                await anyio.sleep(0.005)
        return self.terminals[0]


def requests(n: int) -> list[Request]:
    return [
        Request(
            prompt=[5 + i, 17, 3 * i + 1, 9],
            sampling=SAMPLED if i % 2 else GREEDY,
            max_tokens=12 + i,
            ignore_eos=True,
            request_id=f"r{i}",
        )
        for i in range(n)
    ]


async def through_sinks(tiny: Tiny, reqs: list[Request], n_slots: int) -> list[Recorder]:
    """Each request with a sink of its own on a fresh scheduler, run to their ends."""
    scheduler = new_scheduler(tiny, n_slots=n_slots)
    sinks = [Recorder() for _ in reqs]
    async with scheduler.running():
        for r, rec in zip(reqs, sinks, strict=True):
            scheduler.submit(r, sink=rec)
        for rec in sinks:
            await rec.wait()
    return sinks


def well_formed(rec: Recorder) -> Finished:
    """Deltas, then exactly one Finished, last."""
    assert rec.events and isinstance(rec.events[-1], Finished)
    assert all(isinstance(e, Delta) for e in rec.events[:-1])
    return rec.events[-1]


async def test_a_sink_gets_the_handles_events_in_order_on_the_event_loop(tiny: Tiny) -> None:
    reqs = requests(6)
    scheduler = new_scheduler(tiny, n_slots=3)  # 6 requests on 3 slots: some wait
    async with scheduler.running():
        handles = [await scheduler.submit(r).collect() for r in reqs]  # one by one
    sinks = await through_sinks(tiny, reqs, n_slots=3)
    loop_thread = threading.get_ident()  # (the test runs on the event loop's thread)
    for rec, done in zip(sinks, handles, strict=True):
        final = well_formed(rec)
        assert rec.tokens == done.token_ids
        assert "".join(e.text for e in rec.events if isinstance(e, Delta)) == done.text
        lps = [lp for e in rec.events if isinstance(e, Delta) for lp in e.logprobs]
        assert [lp.token for lp in lps] == [lp.token for lp in done.logprobs]
        assert final.reason == done.finished.reason == FinishReason.LENGTH
        assert rec.threads == {loop_thread}
        assert len([e for e in rec.events if isinstance(e, Delta)]) > 1  # across steps


async def test_a_failing_sink_ends_only_its_request_with_one_error_terminal(tiny: Tiny) -> None:
    reqs = requests(4)
    scheduler = new_scheduler(tiny, n_slots=4)
    broken = Recorder(fail_at=2)  # raises on its third Delta
    others = [Recorder() for _ in reqs[1:]]
    async with scheduler.running():
        handle = scheduler.submit(reqs[0], sink=broken)
        for r, rec in zip(reqs[1:], others, strict=True):
            scheduler.submit(r, sink=rec)
        final = await broken.wait()
        for rec in others:
            await rec.wait()
        assert not handle.cancel()  # it has ended
        stats = scheduler.stats()
    assert well_formed(broken) is final and len(broken.terminals) == 1
    assert final.reason == FinishReason.ERROR and "sink broke" in (final.error or "")
    assert broken.calls == 4  # two Deltas, the failing one, the Finished; nothing after
    for r, rec in zip(reqs[1:], others, strict=True):
        assert well_formed(rec).reason == FinishReason.LENGTH
        assert len(rec.tokens) == r.max_tokens
    assert stats.finished[FinishReason.ERROR] == 1 and stats.running == 0


async def test_a_sink_that_fails_on_its_terminal_harms_nothing_else(tiny: Tiny) -> None:
    scheduler = new_scheduler(tiny, n_slots=2)
    reqs = requests(2)
    broken, fine = Recorder(fail_on_end=True), Recorder()
    async with scheduler.running():
        scheduler.submit(reqs[0], sink=broken)
        scheduler.submit(reqs[1], sink=fine)
        await fine.wait()
        with anyio.fail_after(10):
            while scheduler.stats().running:
                await anyio.sleep(0.005)
        stats = scheduler.stats()
        after = await scheduler.submit(reqs[1]).collect()  # the loop serves on
    assert len(broken.tokens) == reqs[0].max_tokens and not broken.terminals
    assert broken.calls == len(broken.events) + 1  # the Finished came, once, and raised
    assert stats.finished[FinishReason.LENGTH] == 2
    assert well_formed(fine).reason == FinishReason.LENGTH
    assert after.token_ids == fine.tokens


async def test_cancel_and_shutdown_give_each_sink_exactly_one_terminal(tiny: Tiny) -> None:
    scheduler = new_scheduler(tiny, 2, config=SchedulerConfig(shutdown_grace_s=0.0))
    sinks = [Recorder() for _ in range(5)]
    long = Request(prompt=[1, 2, 3], max_tokens=150, ignore_eos=True)
    async with scheduler.running():
        handles = [scheduler.submit(long, sink=rec) for rec in sinks]  # two run, three wait
        with anyio.fail_after(10):
            while not sinks[0].tokens:
                await anyio.sleep(0.005)
        assert handles[0].cancel() and handles[4].cancel()  # one running, one waiting
        assert not handles[0].cancel()
        with pytest.raises(RuntimeError, match="sink"):
            async for _ in handles[1]:
                pass
    reasons = [well_formed(rec).reason for rec in sinks]
    assert [len(rec.terminals) for rec in sinks] == [1] * 5
    assert reasons[0] == reasons[4] == FinishReason.CANCELLED
    assert reasons[1:4] == [FinishReason.SHUTDOWN] * 3


class GroupRecorder:
    """A `StepSink`: keeps each key's events and the size of each `deltas` call; raises on
    its `fail_at`-th `deltas` call (from 0)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.events: dict[int, list[Event]] = defaultdict(list)
        self.calls: list[list[int]] = []  # the keys of each `deltas` call
        self.fail_at = fail_at

    def deltas(self, items: list[tuple[int, Delta]]) -> None:
        self.calls.append([k for k, _ in items])
        if len(self.calls) - 1 == self.fail_at:
            raise RuntimeError("step sink broke")
        for key, delta in items:
            self.events[key].append(delta)

    def end(self, key: int, event: Finished) -> None:
        self.events[key].append(event)


async def through_group(scheduler: Scheduler, reqs: list[Request], group: StepSink) -> None:
    """All of `reqs` into one step sink (request i under key i), run until the scheduler
    has nothing left (inside its `running()`)."""
    for i, r in enumerate(reqs):
        scheduler.submit(r, group=group, key=i)
    with anyio.fail_after(60):
        while scheduler.stats().running or scheduler.stats().waiting:
            await anyio.sleep(0.005)


def mixed_requests(stop: str) -> list[Request]:
    """Greedy, sampled, log-probability, stop-string, stop-id and max-token requests."""
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=11)
    out = []
    for i in range(12):
        out.append(
            Request(
                prompt=[5 + i, 17, 3 * i + 1, 9],
                sampling=[GREEDY, SAMPLED, sampled][i % 3],
                max_tokens=[3, 9, 16, 1][i % 4],
                stop=(stop,) if i % 5 == 2 else (),
                stop_token_ids=(7,) if i % 6 == 1 else (),
                ignore_eos=i % 2 == 0,
                request_id=f"m{i}",
            )
        )
    s = Request(prompt=[5, 17, 1, 9], sampling=GREEDY, max_tokens=40, stop=(stop,), request_id="s")
    return [*out, s]


def as_seen(events: list[Event]) -> list[object]:
    """Events as comparable values (timings differ from run to run)."""
    return [
        (e.token_ids, e.text, e.logprobs)
        if isinstance(e, Delta)
        else (e.reason, e.usage, e.matched_stop, e.error)
        for e in events
    ]


async def test_a_step_sink_streams_exactly_what_per_request_sinks_do(tiny: Tiny) -> None:
    scheduler = new_scheduler(tiny, n_slots=5)
    async with scheduler.running():
        probe = Request(prompt=[5, 17, 1, 9], sampling=GREEDY, max_tokens=40, request_id="p")
        text = (await scheduler.submit(probe).collect()).text
    stop = text[len(text) // 3 : len(text) // 3 + 2]  # met by the "s" request, mid-stream
    reqs = mixed_requests(stop)
    alone = await through_sinks(tiny, reqs, n_slots=5)  # 13 requests on 5 slots: staggered
    scheduler = new_scheduler(tiny, n_slots=5)
    groups = [GroupRecorder(), GroupRecorder()]
    async with scheduler.running():
        for i, r in enumerate(reqs):
            scheduler.submit(r, group=groups[i % 2], key=i)
        with anyio.fail_after(30):
            while scheduler.stats().running or scheduler.stats().waiting:
                await anyio.sleep(0.005)
    assert well_formed(alone[-1]).matched_stop == stop  # the stop string was met
    for i, rec in enumerate(alone):
        events = groups[i % 2].events[i]
        assert isinstance(events[-1], Finished) and events[-1] is not events[0]
        assert all(isinstance(e, Delta) for e in events[:-1])
        assert as_seen(events) == as_seen(rec.events), reqs[i].request_id
    for group in groups:
        assert all(len(set(keys)) == len(keys) for keys in group.calls)
        assert max(map(len, group.calls)) > 1  # several requests' Deltas in one call


async def test_a_failing_step_sink_ends_each_of_its_requests_with_one_error(tiny: Tiny) -> None:
    reqs = requests(6)
    scheduler = new_scheduler(tiny, n_slots=6)
    broken, fine = GroupRecorder(fail_at=2), GroupRecorder()
    async with scheduler.running():
        for i, r in enumerate(reqs):
            scheduler.submit(r, group=broken if i < 3 else fine, key=i)
        with anyio.fail_after(30):
            while scheduler.stats().running or scheduler.stats().waiting:
                await anyio.sleep(0.005)
        stats = scheduler.stats()
    for i, r in enumerate(reqs):
        events = (broken if i < 3 else fine).events[i]
        finals = [e for e in events if isinstance(e, Finished)]
        assert len(finals) == 1 and events[-1] is finals[0]
        if i < 3:
            assert finals[0].reason == FinishReason.ERROR
            assert "step sink broke" in (finals[0].error or "")
        else:
            assert finals[0].reason == FinishReason.LENGTH
            assert len([t for e in events if isinstance(e, Delta) for t in e.token_ids]) == (
                r.max_tokens
            )
    assert len(broken.calls) == 3  # nothing after the failing call
    assert stats.finished[FinishReason.ERROR] == 3


async def test_on_published_follows_each_publishing_of_a_steps_deltas_and_ends(
    tiny: Tiny,
) -> None:
    """A server sends its connections' step batches from `on_published`: by then every
    Delta and Finished of the step must have reached the sinks, and each publishing gets
    its own call (so a sink never holds two steps' Deltas when it is called)."""
    scheduler = new_scheduler(tiny, n_slots=5)
    timeline: list[tuple[str, object]] = []

    class Timeline(GroupRecorder):
        def deltas(self, items: list[tuple[int, Delta]]) -> None:
            timeline.append(("deltas", [k for k, _ in items]))

        def end(self, key: int, event: Finished) -> None:
            timeline.append(("end", key))

    def broken() -> None:
        raise RuntimeError("callback broke")  # logged; the loop goes on

    scheduler.on_published(broken)
    scheduler.on_published(lambda: timeline.append(("published", None)))
    sink = Timeline()
    reqs = requests(8)  # 8 requests on 5 slots, max_tokens 12..19: they end on many steps
    async with scheduler.running():
        await through_group(scheduler, reqs, sink)
    assert timeline[-1] == ("published", None)  # nothing reached a sink after the last call
    window = 0  # publishings so far
    last_tokens: dict[int, int] = {}  # key -> the publishing of its last Deltas
    ended: dict[int, int] = {}  # key -> the publishing of its Finished
    batches: dict[int, int] = defaultdict(int)  # publishing -> its multi-request calls
    for kind, what in timeline:
        if kind == "published":
            window += 1
        elif kind == "deltas":
            assert isinstance(what, list)
            batches[window] += len(what) > 1
            last_tokens.update((key, window) for key in what)
        else:
            assert isinstance(what, int)
            ended[what] = window
    assert sorted(ended) == list(range(len(reqs)))
    # each request ran to max_tokens: its Finished came in the publishing of its last
    # tokens, before that publishing's call
    assert ended == last_tokens
    assert max(batches.values()) == 1  # one step's batch per publishing
    assert sum(batches.values()) > 10  # the steps were published one by one


class SlowGroup(GroupRecorder):
    """A step sink whose every call holds the GIL for `busy_s`: publishing that outlasts
    the tiny model's forwards."""

    def __init__(self, busy_s: float) -> None:
        super().__init__()
        self.busy_s = busy_s

    def deltas(self, items: list[tuple[int, Delta]]) -> None:
        end = time.perf_counter() + self.busy_s
        while time.perf_counter() < end:
            pass
        super().deltas(items)


async def test_publishing_that_outlasts_the_forwards_goes_first_and_streams_the_same(
    tiny: Tiny,
) -> None:
    """When a forward could hide little of publishing, the loop publishes each step before
    starting the next (`PublishOrder`); the requests stream what they stream otherwise."""
    reqs = [replace(r, max_tokens=48) for r in requests(6)]  # ~50 steps: probes come
    alone = await through_sinks(tiny, reqs, n_slots=6)
    # 80 ms of publishing a step: on this 2-core CPU the tiny model's forwards spend ~12 ms
    # a step off the step thread (MLX's CPU workers), so 20 ms of publishing put what a
    # forward could hide near `OVERLAP_ABOVE` and the rule went back to overlapping in one
    # run of a few (18 of 48 steps published first); at 80 ms it is ~0.15, far from 0.5.
    for busy_s, slow in ((0.0, False), (0.08, True)):
        scheduler = new_scheduler(tiny, n_slots=6)
        group = SlowGroup(busy_s)
        async with scheduler.running():
            await through_group(scheduler, reqs, group)
            times = scheduler.stats().times
        for i, rec in enumerate(alone):
            assert as_seen(group.events[i]) == as_seen(rec.events), reqs[i].request_id
        probes = times.steps // PROBE_EVERY
        assert times.steps > 2 * PROBE_EVERY
        if slow:  # after the first probe, every step
            assert times.published_first >= times.steps - PROBE_EVERY - 1
        else:  # only the probes
            assert times.published_first <= probes + 1
