"""One step on the step thread: every MLX call of the scheduler happens here.

`Stepper.run(plan)` frees and allocates slots, asks the Speculator for the decode
(and verify) rows, fills the rest of the token budget with prefill chunks, runs ONE
`runner.step` for all of them, resolves the decode rows, samples the first token of
every prompt that completed, and reads log-probabilities back to the host.

MLX evaluates a lazy graph only on the thread that built it ("There is no
Stream(cpu, 0) in current thread"). The Scheduler runs every step on its own step
thread (`scheduler.step_thread`), but the Stepper does not rely on that (benchmarks
drive it from their main thread; the Stepper is made on the event loop's): no MLX work
happens on the event loop, every step leaves the pool and the Speculator evaluated
(`_settle`), and the model's weights — which the loader builds lazily — are evaluated
once when the Stepper is made (`materialize`).

Faults: the runner raises `BatchError` / `PoolError` before changing anything, so on
those the rows are bisected and re-run to find the rows at fault; only their
requests fail. Any other exception leaves the state of the forward's slots unknown:
all its requests fail. A row whose logits are not finite (NaN or inf: a numerical
fault) fails its own request; the slot is reset when it is next allocated. Either
way the step returns normally and the loop goes on.

Decode-ahead (`SchedulerConfig.decode_ahead`): after a step of plain decode rows (beside
drafters: a step in which none drafted; the queued rows keep the hidden states the MTP head
follows), the next step is queued on the device (`ModelRunner.launch`, on this step's
tokens drawn there as the resolve will read them — `Speculator.draw_ahead`: penalties and
bias over each history, then the argmax or the request's next uniform, peeked; nothing
written) before this one is checked and resolved; the next `run` takes the queued rows its
plan matches exactly (`ModelRunner.adopt`) and drops the rest. Faults in taken rows end
their requests as in a forward of their own.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter, itemgetter
from typing import Any, cast

import mlx.core as mx
import numpy as np

from engine.cache import PoolError, SlotId
from engine.kernels import host_pool
from engine.runner import BatchError, ModelRunner, PendingStep, Row, RowOutput
from engine.sampling import on_host, token_logprobs
from engine.spec.controller import CostController
from engine.spec.speculator import (
    Committed,
    DecodingSlot,
    Drawn,
    PlainStep,
    SpecStats,
    Speculator,
    sample_rows,
)
from scheduler.outcome import TokenLogprob
from scheduler.prefix_reuse import SlotImage
from scheduler.sequence import Sequence as Seq
from scheduler.stats import AheadStats

FaultHook = Callable[[list[str]], Collection[str] | None]
"""Test-only: called on the step thread with the request ids of each forward before it
runs. What it raises is handled as a fault of that forward; the ids it returns get NaN
logits from the forward (a numerical fault in their rows). See the module docstring."""

Launch = Callable[[list[RowOutput], Sequence[mx.array]], None]
"""Decode-ahead's hook into a checked step: the rows' outputs and the (lazy) arrays the
host will read to check them."""

AHEAD_WINDOW = 8  # of the last this many queued steps (at least half of them seen) ...
AHEAD_PAUSE_STEPS = 32  # ... were half dropped: decode-ahead queues nothing for this many steps
"""Each dropped step was a wasted device step. Beside drafters a plan may draft right after
plain steps again and again (n-gram matches that come and go): rather than waste a step in
two or three, decode-ahead pauses, then tries again."""

UNCHANGED = (BatchError, PoolError)
"""Exceptions after which the runner guarantees the pool is unchanged."""


@dataclass
class Chunk:
    """Prompt tokens `seq.prompt[start : start + len(tokens)]` fed this step."""

    seq: Seq
    tokens: list[int]
    start: int

    @property
    def completes(self) -> bool:
        return self.start + len(self.tokens) == len(self.seq.prompt)


@dataclass
class StepPlan:
    """What the loop decided: slots to free, sequences to give a slot, who runs."""

    free: list[SlotId]
    admit: list[Seq]
    decoding: list[Seq]
    prefilling: list[Seq]  # in admission order: earlier ones get their chunks first
    token_budget: int
    max_chunk: int
    snapshot: list[tuple[Seq, SlotId]] = field(default_factory=list)  # before they are freed


@dataclass
class StepResult:
    chunks: list[Chunk] = field(default_factory=list)
    first: list[tuple[Seq, int, list[TokenLogprob]]] = field(default_factory=list)
    decoded: list[tuple[Seq, Committed, list[TokenLogprob]]] = field(default_factory=list)
    # A step without drafts decodes one token per sequence: `plain[i]` committed
    # `plain_tokens[i]` (and `plain_logprobs[i]` when any of them asked for log-probabilities),
    # with no object per sequence. A step has these or `decoded`, never both.
    plain: list[Seq] = field(default_factory=list)
    plain_tokens: list[int] = field(default_factory=list)
    plain_logprobs: list[list[TokenLogprob]] | None = None
    failed: list[tuple[Seq, str]] = field(default_factory=list)
    images: list[tuple[Seq, SlotImage]] = field(default_factory=list)  # at snapshot boundaries
    final_images: list[tuple[Seq, SlotImage]] = field(default_factory=list)  # of `plan.snapshot`
    draft_s: float = 0.0  # speculator.plan: drafting and row building
    forward_s: float = 0.0  # runner.step (bisection included)
    forward_cpu_s: float = 0.0  # of it, CPU time of the step thread (the rest: device, waits)
    sample_s: float = 0.0  # resolve, first tokens, log-probabilities


def prefill_chunks(prefilling: Sequence[Seq], budget: int, max_chunk: int) -> list[Chunk]:
    """Chunks for the prompts still prefilling, in order, at most `max_chunk` tokens each,
    `budget` tokens in all (several prompts share a step)."""
    chunks = []
    for seq in prefilling:
        n = min(seq.next_chunk_limit(), max_chunk, budget)
        if n <= 0:
            break
        chunks.append(Chunk(seq, seq.prompt[seq.prefilled : seq.prefilled + n], seq.prefilled))
        budget -= n
    return chunks


@dataclass
class Ahead:
    """The decode step queued past the last one (decode-ahead), not in the pool: `seqs`'
    rows in order, fed `tokens` (the last step's, drawn on the device)."""

    seqs: list[Seq]
    tokens: mx.array
    pending: PendingStep


HOST_ONLY = (int, float, str, bool, type(None), SpecStats, CostController)
"""Types that hold no MLX arrays: `materialize` does not look inside them (the per-slot
telemetry and the cost controller's estimates would cost a walk per step)."""


def materialize(obj: object, skip: object = None) -> None:
    """Evaluate every MLX array reachable from `obj` through attributes of engine objects,
    lists, tuples and dicts, not looking inside `skip` (see the module docstring)."""
    found: list[mx.array] = []
    seen: set[int] = {id(skip)}
    todo: list[Any] = [obj]
    while todo:
        x = todo.pop()
        if isinstance(x, HOST_ONLY) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, mx.array):
            found.append(x)
        elif isinstance(x, list | tuple):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif type(x).__module__.startswith("engine.") and hasattr(x, "__dict__"):
            todo.extend(vars(x).values())
    mx.eval(found)


class Stepper:
    """Runs `StepPlan`s on the step thread (one at a time)."""

    def __init__(
        self,
        runner: ModelRunner,
        speculator: Speculator,
        fault_hook: FaultHook | None = None,
        decode_ahead: bool = False,
        images_to_host: bool = False,
    ) -> None:
        if speculator.runner is not runner:
            raise ValueError("the Speculator must drive the scheduler's own runner")
        self.runner = runner
        self.speculator = speculator
        self.fault_hook = fault_hook
        self.images_to_host = images_to_host  # prefix-cache snapshots kept in host memory
        # Decode-ahead: after a step of plain decode rows, the next one is queued on the
        # device (on this step's tokens, drawn there, not yet read) while the host resolves
        # this one and the loop plans the next; that plan takes the queued rows it matches
        # exactly, the pool untouched until then (see `_adopted`). Beside drafters too: after
        # a step in which no slot drafted (the cost controller found drafting does not pay,
        # or nothing matched), the next is queued as plain decode, with the hidden states the
        # MTP head follows the trunk on; if the next plan drafts after all, the queued step
        # is dropped. Not beside a drafter conditioned on trunk layers (DFlash's taps).
        self.decode_ahead = decode_ahead and not speculator.layers
        self._ahead: Ahead | None = None
        # this step's tokens, drawn on the device before the next step was queued behind it
        # (`_launch_ahead`), for the resolve to read: (the rows' outputs, by identity; them)
        self._drawn: tuple[list[int], Drawn] | None = None
        self.ahead = AheadStats()  # queued steps taken (in part or whole) and dropped
        self._ahead_taken: collections.deque[bool] = collections.deque(maxlen=AHEAD_WINDOW)
        self._ahead_paused = 0  # steps left before decode-ahead queues again
        materialize(speculator)  # its runner's model and pool, its drafters

    def run(self, plan: StepPlan) -> StepResult:
        """Execute one step. Never raises: failures are reported per sequence."""
        result = StepResult()
        try:
            self._run(plan, result)
            self._settle()
        except Exception as e:  # a fault outside any forward: the step's requests fail
            self._ahead = None
            done = {id(s) for s, _ in result.failed}
            everyone = plan.admit + plan.decoding + plan.prefilling
            result.failed += [(s, _describe(e)) for s in everyone if id(s) not in done]
        if self.images_to_host:
            self._images_to_host(result)
        return result

    def release(self, slots: list[SlotId]) -> None:
        """Return slots to the pool and have the Speculator forget them."""
        for slot in slots:
            self.runner.pool.free(slot)
            self.speculator.release(slot)

    def _run(self, plan: StepPlan, result: StepResult) -> None:
        self._snapshot(plan.snapshot, result.final_images, result)
        self.release(plan.free)
        pool = self.runner.pool
        for seq in plan.admit:
            seq.slot = pool.allocate()
        prefilling = self._restore(plan, result)

        t0 = time.perf_counter()
        # In slot order: the pool reads and writes runs of consecutive slots as slices, and
        # (its lowest free slot taken first) slots in use sit mostly in one run. The runner's
        # `step` would order them itself, but then answers through a permutation (each row's
        # logits gathered, not one slice of the step's), and `launch` (decode-ahead) takes
        # its rows as given. (23 us at 1,024 rows already in order: bench/host_micro.py.)
        decoding = sorted(plan.decoding, key=_BY_SLOT)
        try:
            states = _decodings(decoding)
            rows = self.speculator.plan(states)
        except Exception as e:
            result.failed += [(s, _describe(e)) for s in decoding]
            decoding, states, rows = [], [], []
        budget = plan.token_budget - sum(map(len, map(_tokens_of, rows)))
        chunks = prefill_chunks(prefilling, budget, plan.max_chunk)
        # The step's rows, prefill chunks first: `seqs[i]` runs `batch[i]` (parallel lists,
        # not a pair per row: a step at 1,024 rows would build and walk a tuple for each).
        chunk_rows = [self._prefill_row(c) for c in chunks]
        seqs = [c.seq for c in chunks] + decoding if chunks else decoding
        batch = chunk_rows + rows if chunks else rows
        ahead, self._ahead, self._drawn = self._ahead, None, None
        if not seqs:
            return
        t1, c1 = time.perf_counter(), time.thread_time()
        base = len(chunks)
        adopted = None if ahead is None or not decoding else self._adopted(ahead, decoding, rows)
        if ahead is not None:
            self._count_ahead(adopted is not None, beside_prefill=base > 0)
        else:
            self._ahead_paused = max(0, self._ahead_paused - 1)
        launch = (
            partial(self._launch_ahead, decoding, states, any(map(_wants_hidden, rows)))
            if self.decode_ahead
            and not self._ahead_paused
            and not chunks
            and all(map(_plain_row, rows))
            else None
        )
        failed = len(result.failed)
        outputs: list[RowOutput | None]
        if adopted is not None:
            # The decode rows were computed ahead; new prompts' chunks (a request admitted
            # meanwhile) run in a forward of their own rather than waste them.
            outputs = self._forward(seqs[:base], chunk_rows, result) if base else []
            outputs = outputs + self._checked(decoding, adopted, result, launch, taken=True)
        else:
            outputs = self._forward(seqs, batch, result, launch=launch)
        every_row_ran = len(result.failed) == failed
        t2 = time.perf_counter()
        result.draft_s, result.forward_s = t1 - t0, t2 - t1
        result.forward_cpu_s = time.thread_time() - c1

        prefilled = zip(chunks, chunk_rows, outputs[:base], strict=True)
        ran = [(c, r, o) for c, r, o in prefilled if o is not None]
        result.chunks = [c for c, _, _ in ran]
        self._prefilled([(c.seq, r, o) for c, r, o in ran], result)
        at = [
            (c.seq, _slot(c.seq))
            for c in result.chunks
            if c.start + len(c.tokens) in c.seq.snapshot_at
        ]
        self._snapshot(at, result.images, result)
        done = [(c.seq, o) for c, _, o in ran if c.completes]
        decoded = outputs[base:] if base else outputs
        if every_row_ran:
            self._resolve(decoding, states, cast(list[RowOutput], decoded), result)
        else:
            ok = [i for i, o in enumerate(decoded) if o is not None]
            self._resolve(
                [decoding[i] for i in ok],
                [states[i] for i in ok],
                [o for o in decoded if o is not None],
                result,
            )
        self._sample_first(done, result)
        result.sample_s = time.perf_counter() - t2

    def _restore(self, plan: StepPlan, result: StepResult) -> list[Seq]:
        """Restore the cached prefixes of newly admitted sequences into their slots; the
        prefilling sequences whose slots are ready."""
        failed = set()
        for seq in plan.admit:
            if seq.restore is None:
                continue
            try:
                speculation = seq.prepared.request.speculation
                seq.restore.image.restore(
                    self.runner.pool, self.speculator, _slot(seq), speculation
                )
            except Exception as e:
                result.failed.append((seq, f"restoring a cached prefix: {_describe(e)}"))
                failed.add(id(seq))
        return [s for s in plan.prefilling if id(s) not in failed]

    def _snapshot(
        self, slots: list[tuple[Seq, SlotId]], into: list[tuple[Seq, SlotImage]], result: StepResult
    ) -> None:
        """Snapshots of these slots (for the prefix cache), copied on the device."""
        for seq, slot in slots:
            try:
                into.append((seq, SlotImage.capture(self.runner.pool, self.speculator, slot)))
            except Exception as e:
                result.failed.append((seq, f"snapshotting its slot: {_describe(e)}"))

    def _images_to_host(self, result: StepResult) -> None:
        """Move the step's snapshots to host memory, now that the step has waited for the
        device: the copies were queued before the step this one queued ahead (if any), so
        this waits for them only, not for that step. A snapshot that fails fails its
        request."""
        for images in (result.images, result.final_images):
            kept = []
            for seq, image in images:
                try:
                    image.settle()
                except Exception as e:
                    result.failed.append((seq, f"snapshotting its slot: {_describe(e)}"))
                else:
                    kept.append((seq, image))
            images[:] = kept

    def _prefill_row(self, chunk: Chunk) -> Row:
        """The chunk's row, as the Speculator shapes it (drafters with state, like the MTP
        head, may want every position's hidden state)."""
        speculation = chunk.seq.prepared.request.speculation
        return self.speculator.prefill_row(_slot(chunk.seq), chunk.tokens, chunk.start, speculation)

    def _prefilled(self, done: list[tuple[Seq, Row, RowOutput]], result: StepResult) -> None:
        """Report the prefill rows that ran to the Speculator."""
        for seq, row, output in done:
            try:
                self.speculator.prefilled(row, output)
            except Exception as e:
                result.failed.append((seq, _describe(e)))

    def _count_ahead(self, taken: bool, beside_prefill: bool) -> None:
        """A queued step was taken or dropped: count it, and pause decode-ahead when half of
        the recent ones were dropped (`AHEAD_WINDOW`)."""
        if taken:
            self.ahead.taken += 1
            self.ahead.beside_prefill += beside_prefill
        else:
            self.ahead.dropped += 1
        seen = self._ahead_taken
        seen.append(taken)
        dropped = len(seen) - sum(seen)
        if not taken and 2 * len(seen) >= AHEAD_WINDOW and 2 * dropped >= len(seen):
            seen.clear()
            self._ahead_paused = AHEAD_PAUSE_STEPS

    def _adopted(self, ahead: Ahead, seqs: list[Seq], rows: list[Row]) -> list[RowOutput] | None:
        """The queued step's outputs for `rows` (of `seqs`) — all plain decode rows — if each
        is a row it queued (same sequence, slot and start, one token: the one it was fed) and
        the runner takes them into the pool; else None, and the queued step is dropped."""
        at = {id(seq): i for i, seq in enumerate(ahead.seqs)}
        fed = [int(t) for t in host_pool.to_host(ahead.tokens)]  # (resolved last step: no wait)
        keep = []
        for seq, row in zip(seqs, rows, strict=True):
            i = at.get(id(seq))
            if (
                i is None
                or not _plain_row(row)
                or (row.want_hidden and ahead.pending.hidden is None)
                or row.slot != ahead.pending.slots[i]
                or row.start != ahead.pending.starts[i]
                or int(row.tokens[0]) != fed[i]
            ):
                return None
            keep.append(i)
        try:
            return self.runner.adopt(ahead.pending, keep).rows
        except UNCHANGED:
            return None

    def _launch_ahead(
        self,
        seqs: list[Seq],
        states: list[DecodingSlot],
        want_hidden: bool,
        rows: list[RowOutput],
        checks: Sequence[mx.array] = (),
    ) -> None:
        """Queue the next decode step on this step's tokens, drawn on the device as the
        resolve would draw them (`Speculator.draw_ahead`: penalties and bias over each
        request's history, then the argmax or the request's next uniform, peeked), when every
        row is a plain decode row; the rows of requests that end with this step's token, or
        whose context is full, are left out.
        `want_hidden`: the queued rows keep their hidden states (a drafter follows them).

        What the host reads of this step — the tokens (`_drawn`, which the resolve reads
        instead of drawing again) and `checks` (the finiteness sums) — is evaluated on its
        own before the next step is queued: computed after, on the one stream, it would be
        ready only once the next step is done, and the host would wait for the step it
        queued to hide."""
        if len(rows) != len(states):
            return
        pool = self.runner.pool
        go = [
            i
            for i, d in enumerate(states)
            if (d.remaining is None or d.remaining > 1) and pool.lengths[d.slot] < pool.max_context
        ]
        if not go:
            return
        try:
            drawn = self.speculator.draw_ahead(states, rows)
        except Exception:  # nothing queued: the resolve draws and reports it per request
            return
        tokens = drawn.tokens
        fed = tokens if len(go) == len(rows) else tokens[mx.array(go, dtype=mx.int32)]
        read = [drawn.adjusted] if any(d.params.logprobs for d in states) else []
        mx.async_eval(tokens, fed, *checks, *read)
        self._drawn = (list(map(id, rows)), drawn)
        try:
            pending = self.runner.launch([states[i].slot for i in go], fed, want_hidden)
        except UNCHANGED:
            return
        self._ahead = Ahead([seqs[i] for i in go], fed, pending)

    def _forward(
        self,
        seqs: list[Seq],
        batch: list[Row],
        result: StepResult,
        launch: Launch | None = None,
    ) -> list[RowOutput | None]:
        """`batch[i]`'s output, or None where it failed (`seqs[i]`'s failure is added to
        `result`). `launch` sees the rows' outputs before they are checked (decode-ahead)."""
        try:
            poisoned = None if self.fault_hook is None else self.fault_hook([s.id for s in seqs])
            out = self.runner.step(batch)
        except UNCHANGED as e:
            if len(seqs) == 1:
                result.failed.append((seqs[0], _describe(e)))
                return [None]
            half = len(seqs) // 2
            left = self._forward(seqs[:half], batch[:half], result)
            return left + self._forward(seqs[half:], batch[half:], result)
        except Exception as e:
            result.failed += [(s, _describe(e)) for s in seqs]
            return [None] * len(seqs)
        return self._checked(seqs, _poison(seqs, out.rows, poisoned), result, launch)

    def _checked(
        self,
        seqs: list[Seq],
        rows: list[RowOutput],
        result: StepResult,
        launch: Launch | None,
        taken: bool = False,
    ) -> list[RowOutput | None]:
        """`rows`, with None for those whose logits are not finite (`seqs[i]`'s request
        fails). `launch` first, so the next step computes while the host checks this one.
        `taken`: rows taken from the queued step, for which the fault hook (test-only) is
        heard here as `_forward` hears it for a forward: what it raises fails these rows'
        requests (their state was written), the rows it names get NaN logits."""
        if taken and self.fault_hook is not None:
            try:
                rows = _poison(seqs, rows, self.fault_hook([s.id for s in seqs]))
            except Exception as e:
                result.failed += [(s, _describe(e)) for s in seqs]
                return [None] * len(seqs)
        check = FiniteCheck(rows)
        if launch is not None:
            launch(rows, check.arrays)
        finite = check.read()
        if all(finite):
            return cast(list[RowOutput | None], rows)  # (the common case: no copy)
        outputs: list[RowOutput | None] = []
        for seq, o, ok in zip(seqs, rows, finite, strict=True):
            outputs.append(o if ok else None)
            if not ok:
                result.failed.append((seq, "numerical fault: the model gave non-finite logits"))
        return outputs

    def _resolve(
        self,
        seqs: list[Seq],
        states: list[DecodingSlot],
        outputs: list[RowOutput],
        result: StepResult,
    ) -> None:
        """The decode rows' tokens (`states[i]` is `seqs[i].decoding`) into `result`."""
        if not seqs:
            return
        drawn = None
        if self._drawn is not None and self._drawn[0] == list(map(id, outputs)):
            drawn = self._drawn[1]
        try:
            resolved = self.speculator.resolve_step(states, outputs, drawn)
            if isinstance(resolved, PlainStep):
                tokens, adjusted = resolved.tokens, resolved.adjusted
                logprobs: list[list[TokenLogprob]] | None = None
                if resolved.logprob_rows:
                    logprobs = [[] for _ in seqs]
                    for i in resolved.logprob_rows:
                        logprobs[i] = _logprobs([adjusted[i]], [tokens[i]], seqs[i])
                result.plain, result.plain_tokens, result.plain_logprobs = seqs, tokens, logprobs
                return
            for seq, c in zip(seqs, resolved, strict=True):
                # c.logits are there only when the request asked for log-probabilities
                result.decoded.append(
                    (seq, c, _logprobs(c.logits, c.tokens, seq) if c.logits else [])
                )
        except Exception as e:
            result.failed += [(s, _describe(e)) for s in seqs]

    def _sample_first(self, done: list[tuple[Seq, RowOutput]], result: StepResult) -> None:
        """The first token of each completed prompt, sampled from its last position."""
        if not done:
            return
        seqs = [s for s, _ in done]
        try:
            logits = mx.concatenate([o.logits[-1:] for _, o in done], axis=0)
            params = [s.prepared.request.sampling for s in seqs]
            tokens, adjusted = sample_rows(
                logits, params, [s.prompt for s in seqs], [s.rng for s in seqs]
            )
            for i, (seq, tok) in enumerate(zip(seqs, tokens, strict=True)):
                result.first.append((seq, tok, _logprobs([adjusted[i]], [tok], seq)))
        except Exception as e:
            result.failed += [(s, _describe(e)) for s in seqs]

    def _settle(self) -> None:
        """Leave nothing lazy: the pool (captures included) and the drafters' state may be
        evaluated on another thread next step. The weights were evaluated once."""
        materialize(self.speculator, skip=self.runner.model)


def _poison(
    seqs: list[Seq], rows: list[RowOutput], poisoned: Collection[str] | None
) -> list[RowOutput]:
    """The rows, with NaN logits for the requests the fault hook named (test-only)."""
    if not poisoned:
        return rows
    nan = mx.array(float("nan"))
    return [
        RowOutput(o.logits + nan, o.hidden) if s.id in poisoned else o
        for s, o in zip(seqs, rows, strict=True)
    ]


def _logprobs(logits: list[mx.array], tokens: list[int], seq: Seq) -> list[TokenLogprob]:
    n = seq.prepared.request.sampling.logprobs
    if n == 0:
        return []
    if len(logits) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens committed with {len(logits)} logit rows")
    chosen, top_ids, top_vals = token_logprobs(mx.stack(logits), tokens, n)
    return [
        TokenLogprob(
            t,
            float(chosen[j]),
            tuple(zip(top_ids[j].tolist(), top_vals[j].tolist(), strict=True)),
        )
        for j, t in enumerate(tokens)
    ]


class FiniteCheck:
    """Per row: are all its logits finite? (A sum is finite only when every term is.)

    Rows the runner made share one packed logits array: one reduction over it serves
    them all, without slicing each row out; a row made otherwise (a poisoned one) gets its
    own. `arrays` are the lazy reductions, for a caller to evaluate early; `read` evaluates
    them (one sync) and answers. On a device what the host reads is one flag an array, its
    whole sum finite or not, and the per-row sums only when one is not: read-backs of 8 bytes
    or fewer stay out of MLX's general buffer cache, as `host_pool`'s do (with which the
    H200's step lost its first kernel's wait, session 22: the likeliest cause, not proven,
    is a host-touched buffer handed back to the device; at 32 rows the flags would be 32
    bytes). On the CPU numpy checks the packed logits in place instead
    (several times faster than MLX's reductions there).
    """

    def __init__(self, rows: list[RowOutput]) -> None:
        self.rows = rows
        arrays = list(map(_first, filter(None, map(_packed_of, rows))))  # (C loops: per row)
        ids = list(map(id, arrays))
        if ids and ids.count(ids[0]) == len(ids):  # one array for all (a forward's rows)
            self.shared = {ids[0]: arrays[0]}  # (without a dict insert per row)
        else:
            self.shared = dict(zip(ids, arrays, strict=True))
        self.own = (
            []
            if len(arrays) == len(rows)
            else [mx.isfinite(o.logits.sum()) for o in rows if o.packed is None]
        )
        self.host = on_host()
        self.whole = [] if self.host else [mx.isfinite(a.sum()) for a in self.shared.values()]

    @property
    def arrays(self) -> list[mx.array]:
        return [*self.whole, *self.own]

    def read(self) -> list[bool]:
        rows, own = self.rows, self.own
        if not rows:
            return []
        sums: dict[int, Any]
        if self.host:
            host = [np.asarray(a) for a in self.shared.values()]
            if not own and all(np.isfinite(a).all() for a in host):
                return [True] * len(rows)  # (one reduction over each array, not one per row)
            sums = {key: np.isfinite(a).all(-1) for key, a in zip(self.shared, host, strict=True)}
        else:
            mx.eval(self.arrays)
            if not own and all(bool(ok) for ok in self.whole):
                return [True] * len(rows)  # (a flag an array read, no per-row sums made)
            sums = {key: mx.isfinite(a.sum(-1)) for key, a in self.shared.items()}
            mx.eval(*sums.values())
        if not own and not any(np.any(~np.asarray(ok)) for ok in sums.values()):
            return [True] * len(rows)  # the common case, with no walk over the rows
        # bad positions before each index: a row [at, at + n) is fine when none lie within it
        bad_before = {
            key: np.concatenate([[0], np.cumsum(~np.asarray(ok))]).tolist()
            for key, ok in sums.items()
        }
        own_ok = iter([bool(ok) for ok in own])
        out = []
        for o in rows:
            if o.packed is None:
                out.append(next(own_ok))
            else:
                logits, _, at, n = o.packed
                bad = bad_before[id(logits)]
                out.append(bad[at + n] == bad[at])
        return out


def _plain_row(row: Row) -> bool:
    """A plain decode row: one token, its logits, no capture, no trunk layers tapped."""
    want = row.want
    return (
        len(row.tokens) == 1
        and not row.capture
        and not row.taps
        and (want is None or (len(want) == 1 and want[0] == 0))
    )


_packed_of, _tokens_of = attrgetter("packed"), attrgetter("tokens")
_wants_hidden = attrgetter("want_hidden")
_first, _decoding_of = itemgetter(0), attrgetter("decoding")


def _decodings(seqs: list[Seq]) -> list[DecodingSlot]:
    states = list(map(_decoding_of, seqs))
    if None in states:
        missing = next(s.id for s in seqs if s.decoding is None)
        raise AssertionError(f"{missing} decodes without a decode state")
    return states  # (no None among them)


_BY_SLOT = attrgetter("slot")


def _slot(seq: Seq) -> SlotId:
    assert seq.slot is not None, f"{seq.id} runs without a slot"
    return seq.slot


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
