"""The Scheduler: submit / cancel / stats for callers, and the loop that steps the model.

Each turn of the loop, at a step boundary (no step in flight):
1. end requests whose deadline passed; free the slots of ended ones;
2. admit waiting requests in queue order while a slot and their memory are free
   and the prompts already admitted leave room in the token budget;
3. run ONE step on the step thread (`scheduler.step_thread`): decode/verify rows
   of every decoding request, then prefill chunks (`scheduler.step`);
   meanwhile, on the loop, publish the previous step's tokens (detokenize, stop
   strings, deltas), so host work overlaps the forward;
4. commit the step's tokens (stop tokens, max_tokens) to decide who runs next —
   and publish them at once instead, before the next step starts, when forwards are
   much shorter than publishing (`scheduler.publish_order`).

Every accepted request ends with exactly one `Finished` — on completion, cancel,
deadline, fault, shutdown, or a crash of the loop itself. All methods are called from
the event loop that runs `running()`; none of them is thread-safe.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from enum import Enum, auto
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel

from engine.cache import SlotId
from engine.runner import ModelRunner
from engine.sampling import RequestRng
from engine.spec.speculator import DecodingSlot, Speculator
from engine.tokenizer import Tokenizer
from scheduler.admission import MemoryBudget
from scheduler.config import SchedulerConfig
from scheduler.handle import (
    EventSink,
    GroupOutlet,
    Outlet,
    RequestHandle,
    SinkOutlet,
    StepSink,
    StreamOutlet,
)
from scheduler.outcome import Delta, FinishReason, TokenLogprob
from scheduler.prefix_reuse import PrefixReuse
from scheduler.publish_order import PublishOrder
from scheduler.queue import Rejected, RejectReason, WaitQueue
from scheduler.request import DuplicateRequestId, Request, Speculation, prepare
from scheduler.sequence import Phase, Sequence, commit_plain_step
from scheduler.stats import ControllerStats, Counters, SchedulerStats
from scheduler.step import Stepper, StepPlan, StepResult
from scheduler.step_thread import StepThread

log = logging.getLogger("slotserve.scheduler")


class _State(Enum):
    NEW = auto()
    RUNNING = auto()
    STOPPING = auto()
    STOPPED = auto()


class Scheduler:
    """Admits requests into the slots of one runner and steps them together.

    `speculator`: the one that plans and resolves decode rows (default: a plain
    `Speculator` with the pool's draft depth). Use as
    `async with scheduler.running(): handle = scheduler.submit(request)`.
    """

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        config: SchedulerConfig | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config = config or SchedulerConfig()
        pool = runner.pool
        self._stepper = Stepper(
            runner,
            speculator or Speculator(runner, pool.max_draft),
            config.fault_hook,
            config.decode_ahead,
            config.prefix_cache is not None and config.prefix_cache.placement == "host",
        )
        self._queue: WaitQueue[Sequence] = WaitQueue(
            config.max_queue, config.policy, config.aging_per_s
        )
        self._budget = MemoryBudget(
            pool, config.memory_bytes, self._stepper.speculator.drafter_bytes
        )
        self._seqs: dict[str, Sequence] = {}  # every request not yet finished
        self._deadlines: dict[str, Sequence] = {}  # those of them with a deadline
        self._active: list[Sequence] = []  # admitted, holding a slot, in admission order
        self._to_free: list[SlotId] = []  # slots of ended requests, freed in the next step
        self._reuse = PrefixReuse(config.prefix_cache, tokenizer.eog_ids)
        self._to_snapshot: list[tuple[Sequence, SlotId]] = []  # finished, for the prefix cache
        self._unpublished: list[Sequence] = []  # committed tokens to publish
        self._published_hooks: list[Callable[[], None]] = []  # `on_published`
        self._order = PublishOrder()
        self._ids = itertools.count()
        self._counters = Counters()
        self._state = _State.NEW
        self._wakeup = anyio.Event()
        self._stopped = anyio.Event()
        self._grace_until = math.inf
        self._thread: StepThread  # the step thread, while `running()`

    # -- the caller's API ---------------------------------------------------------------------
    @asynccontextmanager
    async def running(self) -> AsyncIterator[Scheduler]:
        """Run the loop for the body of the `async with`; on exit, shut down gracefully
        (`shutdown`). A Scheduler runs once."""
        if self._state != _State.NEW:
            raise RuntimeError("this Scheduler has already run")
        self._state = _State.RUNNING
        self._thread = StepThread()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._serve)
            try:
                yield self
            finally:
                with anyio.CancelScope(shield=True):
                    await self.shutdown()

    def submit(
        self,
        request: Request,
        sink: EventSink | None = None,
        group: StepSink | None = None,
        key: Any = None,
    ) -> RequestHandle:
        """Validate and queue `request`; returns its handle at once. Its events come through
        the handle, or, when `sink` is given, are passed to it as they are published
        (`EventSink`), or, when `group` is given, to it under `key` with those of the other
        requests sharing it, a step's Deltas in one call (`StepSink`). With a sink or a group
        the handle only cancels.

        Raises `InvalidRequest` (a subclass names the problem) or `Rejected` (queue full
        with `retry_after_s`, never fits the memory budget, or shutting down).
        """
        if self._state != _State.RUNNING:
            self._counters.rejected += 1
            raise Rejected(RejectReason.SHUTTING_DOWN, "the scheduler is not accepting requests")
        rid = request.request_id if request.request_id is not None else f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise DuplicateRequestId(f"request_id {rid!r} is already in flight")
        pool = self.runner.pool
        prepared = prepare(request, rid, self.tokenizer, pool.config.n_vocab, pool.max_context)
        speculate = Speculation(request.speculation) != Speculation.OFF
        k = self._stepper.speculator.max_draft if speculate else 0
        nbytes = self._budget.price(len(prepared.prompt), prepared.max_tokens, k)
        if self._budget.never_fits(nbytes):
            self._counters.rejected += 1
            raise Rejected(
                RejectReason.NEVER_FITS,
                f"the request needs {nbytes} bytes; the whole budget is "
                f"{self._budget.budget_bytes} (lower max_tokens)",
            )
        if sink is not None and group is not None:
            raise ValueError("submit takes a sink or a group, not both")
        outlet: Outlet
        if group is not None:
            outlet = GroupOutlet(rid, group, key)
        else:
            outlet = StreamOutlet() if sink is None else SinkOutlet(rid, sink)
        seq = Sequence(
            prepared,
            outlet,
            self.tokenizer,
            submitted_at=time.monotonic(),
            reserved_bytes=nbytes,
            rng=RequestRng(request.sampling.seed),
        )
        try:
            self._queue.push(seq, request.priority, seq.submitted_at)
        except Rejected:
            self._counters.rejected += 1
            if isinstance(outlet, StreamOutlet):
                outlet.send.close()
                outlet.receive.close()
            raise
        self._seqs[rid] = seq
        if request.deadline_s is not None:
            self._deadlines[rid] = seq
        self._counters.submitted += 1
        self._wakeup.set()
        receive = outlet.receive if isinstance(outlet, StreamOutlet) else None
        return RequestHandle(rid, len(prepared.prompt), receive, self.cancel)

    def on_published(self, callback: Callable[[], None]) -> None:
        """Call `callback` on the loop after each publishing, once every Delta and Finished
        it produced has gone to its sink or handle: a server sends its connections' step
        batches then, with no turn of the event loop between the step and its messages.
        What `callback` raises is logged; the loop goes on."""
        self._published_hooks.append(callback)

    def cancel(self, request_id: str) -> bool:
        """End the request now with CANCELLED (its slot is freed at the next step
        boundary); False if no such request is in flight."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._finish(seq, FinishReason.CANCELLED)
        self._wakeup.set()
        return True

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Stop admitting; waiting requests end with SHUTDOWN at once, running ones may
        finish within `grace_s` (default: the config's) and end with SHUTDOWN after it.
        Returns when the loop has stopped."""
        if self._state == _State.NEW:
            self._state = _State.STOPPED
            return
        if self._state == _State.RUNNING:
            self._state = _State.STOPPING
            grace = self.config.shutdown_grace_s if grace_s is None else grace_s
            self._grace_until = time.monotonic() + grace
            for seq in self._queue.drain():
                self._finish(seq, FinishReason.SHUTDOWN)
            self._wakeup.set()
        await self._stopped.wait()

    @property
    def decode_ahead(self) -> bool:
        """Whether steps are queued ahead (`SchedulerConfig.decode_ahead`, and no drafter)."""
        return self._stepper.decode_ahead

    async def precompile(self, verify: bool = False) -> int:
        """Compile every decode batch shape the runner can meet (`ModelRunner.
        precompile_decode`) — and with `verify`, every verify step shape of the speculator's
        draft depths (`Speculator.precompile`) — on the step thread, where steps run: the
        number compiled. Only while running; meant for before requests come (a daemon's
        warm-up): it runs between steps, so a step waits for it."""
        if self._state != _State.RUNNING:
            raise RuntimeError("precompile needs a running Scheduler")
        spec = self._stepper.speculator
        return await self._thread.run(spec.precompile if verify else self.runner.precompile_decode)

    def stats(self) -> SchedulerStats:
        """A snapshot of the scheduler's state and counters since it started."""
        c, step = self._counters, self._stepper
        ctrl = step.speculator.controller
        return SchedulerStats(
            waiting=len(self._queue),
            running=len(self._active),
            free_slots=self.runner.pool.n_slots - self._budget.slots_in_use,
            reserved_bytes=self._budget.reserved_bytes,
            budget_bytes=self._budget.budget_bytes,
            submitted=c.submitted,
            rejected=c.rejected,
            finished=dict(c.finished),
            prompt_tokens=c.prompt_tokens,
            generated_tokens=c.generated_tokens,
            times=replace(c.times),
            prefix_cache=replace(self._reuse.stats()),
            decode_ahead=replace(step.ahead),
            controller=ControllerStats(ctrl.held, ctrl.stalls, ctrl.credit),
        )

    # -- the loop --------------------------------------------------------------------------------
    async def _serve(self) -> None:
        crash: str | None = None
        try:
            boundary = time.perf_counter()
            published_s: float | None = None  # the last step's publishing, if done before this one
            while True:
                now = time.monotonic()
                self._expire(now)
                self._reap()
                plan = self._plan(now)
                if plan is None:
                    self._publish()
                    if self._state == _State.STOPPING and not self._active:
                        break
                    await self._idle()
                    boundary, published_s = time.perf_counter(), None
                    continue
                t0 = time.perf_counter()
                result = await self._step(plan, publish=published_s is None)
                t1 = time.perf_counter()
                if published_s is not None:  # the forward had the GIL to itself
                    self._order.observe(result.forward_s, result.forward_cpu_s, published_s)
                self._commit(result)
                self._reuse.stepped(plan.admit, result.images)
                for seq, image in result.final_images:
                    self._reuse.finished(seq, image)
                t2 = time.perf_counter()
                if plan.decoding or plan.prefilling:  # not a step that only took snapshots
                    schedule_s = (t0 - boundary - (published_s or 0.0)) + (t2 - t1)
                    self._count(result, schedule_s=schedule_s, wall_s=t2 - boundary)
                boundary, published_s = t2, None
                if self._order.publish_first():
                    self._publish()
                    published_s = time.perf_counter() - t2
                    self._counters.times.published_first += 1
        except Exception as e:
            crash = f"the scheduler loop failed: {type(e).__name__}: {e}"
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await self._close(crash)

    async def _idle(self) -> None:
        """Nothing to run: wait for a submit, cancel or shutdown. No await lies between
        `_plan` and here, so no wake-up can be missed."""
        self._wakeup = anyio.Event()
        await self._wakeup.wait()

    async def _step(self, plan: StepPlan, publish: bool) -> StepResult:
        """Run `plan` on the step thread and, while it computes, publish the last step
        (unless `publish` is False: it was published before this one started)."""
        job = self._thread.start(partial(self._stepper.run, plan))
        try:
            if publish:
                # Publishing holds the GIL: start it once the step thread is computing.
                # Blocking on its start hands the GIL over.
                job.wait_started()
                self._publish()
        finally:
            result = await self._thread.finish(job)  # (even if publishing failed)
        return result

    async def _close(self, crash: str | None) -> None:
        """The loop ended: end everything (SHUTDOWN, or ERROR after a `crash`), free
        every slot."""
        self._state = _State.STOPPED
        reason = FinishReason.SHUTDOWN if crash is None else FinishReason.ERROR
        try:
            self._publish()
            for seq in list(self._seqs.values()):
                self._finish(seq, reason, crash)
            self._reap()
            slots, self._to_free = self._to_free, []
            await self._thread.run(partial(self._stepper.release, slots))
        finally:
            self._thread.close()
            self._stopped.set()

    def _expire(self, now: float) -> None:
        for seq in list(self._deadlines.values()):
            deadline = seq.prepared.request.deadline_s
            if deadline is not None and now - seq.submitted_at >= deadline:
                self._finish(seq, FinishReason.DEADLINE)
        if self._state == _State.STOPPING and now >= self._grace_until:
            for seq in list(self._seqs.values()):
                self._finish(seq, FinishReason.SHUTDOWN)

    def _reap(self) -> None:
        """Give back the slot and memory of every admitted request that has ended."""
        keep = []
        done = Phase.DONE  # (a local: an enum member read off its class costs ~70 ns in 3.11)
        for seq in self._active:
            if seq.ending is None and seq.phase is not done:  # seq.live, inlined
                keep.append(seq)
                continue
            self._budget.release(seq.reserved_bytes)
            if self._reuse.ended(seq, succeeded=seq.ending is not None):
                assert seq.slot is not None
                self._to_snapshot.append((seq, seq.slot))
            if seq.slot is not None:
                self._to_free.append(seq.slot)
        self._active = keep

    def _plan(self, now: float) -> StepPlan | None:
        decoding: list[Sequence] = []
        prefilling: list[Sequence] = []
        decode, prefill = Phase.DECODE, Phase.PREFILL  # (locals: see `_reap`)
        for s in self._active:
            if s.phase is decode:
                decoding.append(s)
            elif s.phase is prefill:
                prefilling.append(s)
        admitted = self._admit(now, sum(len(s.prompt) - s.prefilled for s in prefilling))
        prefilling += admitted  # (they join the end of `_active`, in order)
        if not decoding and not prefilling and not self._to_snapshot:
            return None  # (a finished request's snapshot is taken even when nothing runs)
        free, self._to_free = self._to_free, []
        snapshot, self._to_snapshot = self._to_snapshot, []
        cfg = self.config
        return StepPlan(
            free,
            admitted,
            decoding,
            prefilling,
            cfg.max_batch_tokens,
            cfg.max_prefill_chunk,
            snapshot,
        )

    def _admit(self, now: float, backlog: int) -> list[Sequence]:
        """Move waiting requests into slots, best first, while they fit and the prompt
        tokens still to prefill (`backlog`, the running prompts') leave room in the token
        budget. The head of the queue is never skipped for a smaller request behind it (no
        starvation)."""
        admitted: list[Sequence] = []
        while self._state == _State.RUNNING and backlog < self.config.max_batch_tokens:
            head = self._queue.peek()
            if head is None or not self._budget.fits(head.reserved_bytes):
                break
            self._queue.pop(now)
            self._budget.reserve(head.reserved_bytes)
            head.phase, head.admitted_at = Phase.PREFILL, now
            self._reuse.admit(head)
            self._active.append(head)
            admitted.append(head)
            backlog += len(head.prompt) - head.prefilled
        return admitted

    def _commit(self, result: StepResult) -> None:
        """Apply a step's outcome: failures end their requests; tokens are committed."""
        for seq, error in result.failed:
            self._finish(seq, FinishReason.ERROR, error)
        for chunk in result.chunks:
            if chunk.seq.live:
                chunk.seq.prefilled += len(chunk.tokens)
                self._counters.prompt_tokens += len(chunk.tokens)
        for seq, token, logprobs in result.first:
            if not seq.live:
                continue
            assert seq.slot is not None
            request = seq.prepared.request
            seq.phase = Phase.DECODE
            seq.decoding = DecodingSlot(
                seq.slot, token, list(seq.prompt), request.sampling, seq.rng, request.speculation
            )
            self._take(seq, [token], logprobs)
        unpublished = self._unpublished
        # a plain step: one token each, the common case
        commit_plain_step(result.plain, result.plain_tokens, result.plain_logprobs, unpublished)
        done = Phase.DONE  # (a local: see `_reap`)
        for seq, committed, logprobs in result.decoded:
            if seq.ending is None and seq.phase is not done:  # seq.live, inlined
                if committed.drafted:
                    seq.spec.record(committed.drafter, committed.drafted, committed.accepted)
                else:
                    seq.plain_steps += 1
                seq.commit(committed.tokens, logprobs)
                unpublished.append(seq)

    def _take(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob]) -> None:
        seq.commit(tokens, logprobs)
        self._unpublished.append(seq)

    def _publish(self) -> None:
        """Send the committed tokens of the last step as Deltas (and Finished where the
        tokens ended the request). The Deltas of requests that share a `StepSink` go to it
        in one call; every request's Finished follows all the step's Deltas; then the
        `on_published` callbacks run."""
        t0 = time.perf_counter()
        now = time.monotonic()
        todo, self._unpublished = self._unpublished, []
        generated = 0
        done = Phase.DONE  # (a local: see `_reap`)
        # each sink's (key, Delta) pairs; a Delta names its sequence (`_seqs`), should the
        # sink fail (a list of the sequences beside them cost an append per row)
        groups: dict[StepSink, list[tuple[Any, Delta]]] = {}
        ended: list[tuple[Sequence, FinishReason]] = []
        for seq in todo:
            if seq.phase is done:
                continue
            try:
                delta = seq.take_delta(now)
            except Exception as e:  # e.g. a token the tokenizer cannot print
                self._finish(seq, FinishReason.ERROR, f"{type(e).__name__}: {e}")
                continue
            if delta is not None:
                generated += len(delta.token_ids)  # (what `_deliver` counts, in one add)
                events = seq.events
                group = events.group
                if group is not None and events.failure is None:
                    items = groups.get(group)
                    if items is None:
                        groups[group] = items = []
                    items.append((events.key, delta))
                elif not events.emit(delta):
                    # The consumer closed its handle, or its sink failed.
                    failure = events.failure
                    reason = FinishReason.CANCELLED if failure is None else FinishReason.ERROR
                    self._finish(seq, reason, failure)
                    continue
            if seq.ending is not None:
                ended.append((seq, seq.ending))
        for group, items in groups.items():
            try:
                group.deltas(items)
            except Exception as e:  # the sink took none of them, or some: they all end
                first = items[0][1].request_id
                log.exception("the step sink failed on %d Deltas (%s, ...)", len(items), first)
                for _, delta in items:
                    owner = self._seqs.get(delta.request_id)  # (None: finished meanwhile)
                    if owner is not None:
                        self._finish(owner, FinishReason.ERROR, owner.events.failed(e))
        for seq, ending in ended:
            self._finish(seq, ending)  # (nothing, if a failed sink has ended it already)
        self._counters.generated_tokens += generated
        self._counters.times.publish_s += time.perf_counter() - t0
        for hook in self._published_hooks:
            try:
                hook()
            except Exception:
                log.exception("an on_published callback failed")

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Send the request's last text and its Finished; the slot is freed by `_reap`.
        Tokens that ended the request themselves (a stop, max_tokens) name the reason."""
        if seq.phase == Phase.DONE:
            return
        if seq.phase == Phase.WAITING:
            self._queue.remove(seq)
        now = time.monotonic()
        delta = seq.take_delta(now, final=True)
        if delta is not None:
            self._deliver(seq, delta)
        final = seq.finished(reason if seq.ending is None else seq.ending, now, error)
        seq.events.emit(final)
        seq.events.close()
        del self._seqs[seq.id]
        self._deadlines.pop(seq.id, None)
        self._counters.finished[final.reason] += 1

    def _deliver(self, seq: Sequence, delta: Delta) -> bool:
        """False when the consumer has closed its handle or its sink failed."""
        self._counters.generated_tokens += len(delta.token_ids)
        return seq.events.emit(delta)

    def _count(self, result: StepResult, schedule_s: float, wall_s: float) -> None:
        t = self._counters.times
        t.steps += 1
        t.wall_s += wall_s
        t.forward_s += result.forward_s
        t.draft_s += result.draft_s
        t.sample_s += result.sample_s
        t.schedule_s += schedule_s
