"""`ModelRunner.step(batch)`: one batched forward for every row of a step.

A batch is a list of `Row`s of ragged lengths — decode rows (1 token), verify
rows (K+1 tokens, with capture), prefill chunks (many tokens) — each on its own
slot. The runner packs them, reads their state from the pool, runs the model
once, writes the new state back, and returns the logits and hidden states the
caller asked for. It is the only entry the scheduler calls; N = 1 is the same
path as N > 1.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from engine.cache import SlotId, SlotPool
from engine.kernels import host_pool
from engine.models.batch import AttentionState, Layout, LinearCapture
from engine.models.qwen35 import Model, MTPHead
from engine.sampling import SamplingParams, Shaping, draw, precompile_draws


class BatchError(ValueError):
    """A malformed batch; nothing was run and the pool is unchanged."""


class Row(NamedTuple):
    """One slot's tokens for this step, starting at the slot's current length.

    `want`: indices within the row whose logits are returned (default: the last).
    `want_hidden`: also return the post-norm hidden states at `want` (the MTP drafter's input).
    `taps`: also return the outputs of these trunk layers at `want`, side by side (what a
    DFlash drafter is conditioned on).
    `capture`: keep the linear-layer state after every position, for `SlotPool.rollback`.

    A NamedTuple, not a frozen dataclass: a step builds one per decoding slot, and this
    makes them in a third of the time.
    """

    slot: SlotId
    tokens: Sequence[int]
    start: int
    capture: bool = False
    want: Sequence[int] | None = None
    want_hidden: bool = False
    taps: tuple[int, ...] = ()

    @property
    def wanted(self) -> list[int]:
        return [len(self.tokens) - 1] if self.want is None else list(self.want)


@dataclass(frozen=True)
class DraftRow:
    """One slot's MTP input: tokens x_{t+1} with the trunk's hidden h_t, at h_t's positions."""

    slot: SlotId
    tokens: Sequence[int]
    hidden: mx.array  # [len(tokens), E]
    start: int


@dataclass(frozen=True)
class ChainRow:
    """One slot's MTP draft chain: `depth` tokens, the first drawn from `logits` `[1, V]`
    (the head's prediction that came with its h' `hidden` `[1, E]`), each deeper one from
    the head fed back its own h' and the token before it, at `start`, `start + 1`, ...
    `uniforms` `[depth]`: the slot's uniform for each draw, in order."""

    slot: SlotId
    logits: mx.array
    hidden: mx.array
    start: int
    depth: int
    uniforms: np.ndarray


Packed = tuple[mx.array, "mx.array | None", int, int]
"""(the step's logits of all rows `[sum(len(want)), vocab]`, their hidden states or None,
where this row's begin, how many it has)."""


class RowOutput:
    """One row's outputs: `logits [len(want), vocab]` float32, `hidden [len(want), E]` and
    `taps [len(want), len(row.taps) * E]` when asked. The runner makes logits and hidden as
    views of the step's `packed` arrays, sliced only when read: a caller may take many
    neighbouring rows at once from `packed` instead."""

    __slots__ = ("_hidden", "_logits", "packed", "taps")

    def __init__(
        self,
        logits: mx.array | None = None,
        hidden: mx.array | None = None,
        packed: Packed | None = None,
        taps: mx.array | None = None,
    ) -> None:
        if logits is None and packed is None:
            raise ValueError("a RowOutput needs its logits or the packed arrays they lie in")
        self._logits, self._hidden, self.packed, self.taps = logits, hidden, packed, taps

    @property
    def logits(self) -> mx.array:
        if self._logits is None:
            assert self.packed is not None
            logits, _, at, n = self.packed
            self._logits = logits[at : at + n]
        return self._logits

    @property
    def positions(self) -> int:
        """How many positions the row has outputs for (without making the logits' slice)."""
        return self.packed[3] if self.packed is not None else self.logits.shape[0]

    @property
    def hidden(self) -> mx.array | None:
        if self._hidden is None and self.packed is not None:
            _, hidden, at, n = self.packed
            if hidden is not None:
                self._hidden = hidden[at : at + n]
        return self._hidden


@dataclass
class StepOutput:
    rows: list[RowOutput] = field(default_factory=list)


@dataclass
class PendingStep:
    """A decode step queued on the device and not in the pool (`ModelRunner.launch`): one
    token per row of `slots` at `starts`; `logits [N, V]`, the final hidden states `[N, E]`
    (when asked for) and the rows' new state (as `SlotPool.stack_states` makes it) are lazy
    until read."""

    slots: list[SlotId]
    starts: list[int]
    logits: mx.array
    new: list[mx.array]
    positions: mx.array  # [N] int32: the rows' starts, as the step read them
    hidden: mx.array | None = None


class ModelRunner:
    """Runs batches of rows of one model over one slot pool.

    Each distinct batch shape (rows, longest row, tokens, outputs, capture rows,
    bucketed past length) that recurs gets its own `mx.compile`d forward — the model
    and the LM head over the rows' stacked state — so a steady decode step is one
    compiled graph instead of a thousand separate ops (a shape's first step runs
    eagerly: `COMPILE_AFTER`); the pool is read before it and written after it with
    one gather and one scatter per state kind.
    `compile=False` runs the very same function eagerly. The `MAX_FORWARDS` most
    recently used shapes keep their forward: ragged prefills make new shapes for as
    long as the process runs, and an unbounded cache grew a daemon's memory forever.
    """

    PAST_BUCKET = 64  # past KV lengths are rounded up to a multiple of this ...
    PAST_LINEAR = 512  # ... up to this; beyond, compiled runners round up to a power of two
    MAX_FORWARDS = 256  # batch shapes whose forward is kept (least recently used go)
    # A compiled runner compiles a batch shape the `compile_after`-th time it runs it; before,
    # the step runs eagerly. Decode and verify shapes recur every step and are compiled at
    # once (`_forward_fn`); a ragged prefill's shape (its chunk lengths, the rows beside it)
    # rarely recurs, and compiling it would cost its request tens to hundreds of ms of
    # tracing for one step.
    COMPILE_AFTER = 2

    def __init__(self, model: Model, pool: SlotPool, compile: bool = False) -> None:
        if pool.config != model.config:
            raise ValueError("pool and model were built for different configs")
        self.model = model
        self.pool = pool
        self.compile = compile
        self._compiled: OrderedDict[tuple[object, ...], Callable[..., Any]] = OrderedDict()
        self._sightings: OrderedDict[tuple[object, ...], int] = OrderedDict()  # not yet compiled
        # forwards compiled ahead of use (`precompile_decode`): never evicted
        self._pinned: dict[tuple[object, ...], Callable[..., Any]] = {}
        self.compile_after = self.COMPILE_AFTER
        # Decode and verify steps run at a padded width (`padded_width`) where shapes are
        # uniform (`uniform_shapes`: a compiled runner on a GPU, where a batch of a width not
        # compiled yet costs tens of ms and a few more rows almost nothing).
        self.pad_widths = uniform_shapes(self)
        self.ssm_layers_from = ssm_layers_from()
        self.inputs = StepInputs(step_inputs_on_device())
        self.last_host_s = 0.0
        self.last_tokens = 0  # tokens of the last step, all rows together
        # Steps (and drafts) of a compiled runner that ran a batch shape not compiled yet —
        # eagerly, or tracing and compiling it (tens to hundreds of ms): their time says
        # nothing of a steady step. (0 in an eager runner: every step is alike.)
        self.cold_steps = 0

    def step(self, batch: Sequence[Row]) -> StepOutput:
        """Run the batch; its state goes into the pool, its outputs come back, in the
        batch's order. (A decode step on tokens still on the device, queued without
        waiting: `launch`, `adopt`.) The rows run in slot order: the pool reads and writes
        runs of consecutive slots as slices, where scattered ones are a gather and a
        scatter of every row's state."""
        slots = [r.slot for r in batch]
        ordered = sorted(slots)
        if slots == ordered or len(set(ordered)) != len(ordered):  # (a repeat: refused below)
            return self._step(batch)
        order = sorted(range(len(batch)), key=slots.__getitem__)
        out = self._step([batch[i] for i in order])
        rows: list[RowOutput] = [out.rows[0]] * len(batch)
        for j, i in enumerate(order):
            rows[i] = out.rows[j]
        return StepOutput(rows)

    def _step(self, batch: Sequence[Row]) -> StepOutput:
        t0 = time.perf_counter()
        slots = self._validate([r.slot for r in batch], [r.tokens for r in batch])
        for r in batch:
            bad = [i for i in r.wanted if not 0 <= i < len(r.tokens)]
            if bad:
                raise BatchError(f"slot {r.slot}: wanted positions {bad} outside the row")
        starts = [r.start for r in batch]
        lengths = [len(r.tokens) for r in batch]
        capture = [r.capture for r in batch]
        self.pool.check_rows(slots, starts, lengths, capture)
        self.last_tokens = sum(lengths)
        taps = self._taps(batch)

        past = self.past_for(max(starts))
        decode = max(lengths) == 1  # a token a row: its positions are its rows' starts
        offsets = itertools.accumulate(lengths, initial=0)
        picked = [o + i for o, r in zip(offsets, batch, strict=False) for i in r.wanted]
        tokens = [int(t) for r in batch for t in r.tokens]
        real = (len(batch), sum(lengths), len(picked))  # rows, tokens, outputs
        pads: list[SlotId] = []
        if self.pad_widths and self.recurs(min(lengths), max(lengths)) and len(set(capture)) == 1:
            pads = self._pad_slots(slots, self.padded_width(len(batch)))
        if pads:  # rows like the first on other slots: read, never written, outputs dropped
            first = batch[0]
            picked += [real[1] + j * lengths[0] + i for j in range(len(pads)) for i in first.wanted]
            tokens += [int(t) for t in first.tokens] * len(pads)
        extra = len(pads)
        all_starts = starts + starts[:1] * extra
        row_starts = self.inputs.starts(slots + pads, all_starts) if decode else None
        layout = Layout.build(
            lengths + lengths[:1] * extra,
            all_starts,
            capture + capture[:1] * extra,
            row_starts,
        )
        if decode:
            tok_slot = self.inputs.kept(slots)
            tok_pos = layout.row_starts[: len(slots)] if pads else layout.row_starts
        else:
            tok_slot, tok_pos = SlotPool.token_coordinates(slots, starts, lengths)
        inputs = [host_pool.ids(tokens), self.inputs.kept(picked)]
        # every position, in order (decode, verify): the forward takes them without a gather
        every = len(picked) == len(tokens) and picked == list(range(len(tokens)))
        _, fn = self._forward_fn(layout, len(picked), past, taps, every)
        # The pool is read and written outside the compiled graph: eager scatters update
        # it in place, while a compiled graph would copy every state array each step.
        logits, hidden, new, captures, tapped_list, after = fn(
            [*inputs, *layout.arrays()], self.pool.read(slots + pads, past)
        )
        if decode:
            self.inputs.ran(slots + pads, all_starts, after)
        if pads:
            logits, hidden, new, tapped_list = _real_rows(real, logits, hidden, new, tapped_list)
        self.last_host_s = time.perf_counter() - t0  # building inputs and the graph
        # Compute everything before touching the pool: a step that fails here (bad
        # input, device fault) leaves every slot exactly as it was.
        mx.eval(logits, hidden, new, captures, tapped_list)
        tapped = tapped_list[0] if tapped_list else None
        captured = _unflatten_captures(self.model, layout, captures, real[0])
        self._store(slots, starts, lengths, tok_slot, tok_pos, new, captured)

        out, at = StepOutput(), 0
        E = self.model.config.n_embd
        for r in batch:
            n = len(r.wanted)
            row_taps = None
            if r.taps and tapped is not None:
                row_taps = tapped[at : at + n]
                if r.taps != taps:  # this row's layers out of the batch's union
                    row_taps = mx.concatenate(
                        [row_taps[:, taps.index(i) * E : (taps.index(i) + 1) * E] for i in r.taps],
                        axis=-1,
                    )
            hid = hidden if r.want_hidden else None
            out.rows.append(RowOutput(packed=(logits, hid, at, n), taps=row_taps))
            at += n
        return out

    def precompile_decode(self) -> int:
        """Compile, ahead of any request, the decode forward of every batch width (padded:
        `padded_width`) and every past bucket (`past_for`) this pool can meet, and keep
        them for good (the least-recently-used cap does not evict them): on a GPU a shape
        compiled at its first step stalls that step (and every row in it) for tens of ms, and
        a pool of 64 slots and 4,096 positions meets 12 widths x 11 past buckets as its
        contexts grow. Each runs once as `launch` runs it, on the pool's state as it is, read
        only — nothing is written. Returns the number compiled now; 0 for an eager runner."""
        made = 0
        for width, _past, start in self._precompile_grid(1):
            slots = [SlotId(s) for s in range(width)]
            tokens = mx.zeros((width,), dtype=mx.int32)
            key, (logits, _, new, _, _, _) = self._decode_forward(slots, [start] * width, tokens)
            made += self._pin(key, logits, new)
        if made:  # and the sampled rows' draws, compiled once a kind (not counted: not steps)
            precompile_draws(self.model.config.n_vocab, self.pool.n_slots)
        return made

    def precompile_verify(self, depths: Sequence[int], taps: tuple[int, ...] = ()) -> int:
        """`precompile_decode` for speculative verify steps: every padded width x past bucket
        for rows of `depth` drafts + 1 tokens with capture, each depth of `depths` (a verify
        step's rows are padded to its deepest draft: `Speculator.uniform_verify`), returning
        the trunk layers `taps` (a drafter that follows them). 4 depths of a 64-slot, 4,096
        position pool are 528 shapes. Read only; 0 for an eager runner."""
        made = 0
        for depth in depths:
            if not 1 <= depth <= self.pool.max_draft:
                raise BatchError(f"verify depth {depth} outside 1..{self.pool.max_draft}")
            n = depth + 1
            for width, past, start in self._precompile_grid(n):
                slots = [SlotId(s) for s in range(width)]
                layout = Layout.build([n] * width, [start] * width, [True] * width)
                key, fn = self._forward_fn(layout, width * n, past, taps, every=True)
                inputs = [mx.zeros((width * n,), dtype=mx.int32), mx.arange(width * n)]
                logits, _, new, captures, _, _ = fn(
                    [*inputs, *layout.arrays()], self.pool.read(slots, past)
                )
                made += self._pin(key, logits, new, captures)
        return made

    def precompile_mtp(self, tokens: Sequence[int], depths: Sequence[int]) -> int:
        """`precompile_decode` for the MTP head's steady shapes (`MTPDrafter` with uniform
        rounds): its catch-up forward of rows `tokens` long (each of them; the last position's
        outputs), and its draft chain `depth` deep for each of `depths`, for greedy rows
        only, sampled ones, and truncating ones — every padded width and past bucket
        (`_mtp_pads`). Read only; 0 for an eager runner or one not padding widths."""
        self._mtp()
        if not self.pad_widths:
            return 0
        E, V = self.model.config.n_embd, self.model.config.n_vocab
        made = 0
        for n in sorted(set(tokens)):
            for width, past, start in self._precompile_grid(n):
                layout = Layout.build([n] * width, [start] * width)
                key = _draft_key(layout, past, last=True)
                state = self.pool.read_mtp([], [], past, [SlotId(s) for s in range(width)])
                inputs = [
                    mx.zeros((width * n,), dtype=mx.int32),
                    mx.zeros((width * n, E), dtype=self.model.dtype),
                    mx.arange(n - 1, width * n, n, dtype=mx.int32),  # each row's last
                    *layout.arrays(),
                ]
                out = self._draft_fn(key, layout, True, at_once=True)(inputs, [state.k, state.v])
                made += self._pin(key, *out)
        shapings = [  # greedy only; sampled; truncated by top-k (candidates), by top-p (a sort)
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=1.0),
            SamplingParams(top_k=40),
            SamplingParams(top_p=0.9),
        ]
        for depth in sorted(set(depths)):
            if not 1 <= depth <= max(1, self.pool.max_draft):
                raise BatchError(f"MTP chain depth {depth} outside 1..{self.pool.max_draft}")
            # the deepest forward reads up to start + depth - 2; a chain of 1 reads nothing
            if depth > 1:
                grid = self._precompile_grid(depth - 1, ahead=depth - 2)
            else:
                grid = [(w, 0, 0) for w in self._precompile_widths()]
            for width, past, start in grid:
                slots = [SlotId(s) for s in range(width)]
                layout = Layout.build([1] * width, [start] * width)
                kv = []
                if depth > 1:
                    state = self.pool.read_mtp([], [], past, slots)
                    kv = [state.k, state.v]
                for params in shapings:
                    shaping = Shaping.of([params] * width)
                    key = _chain_key(layout, depth, past, shaping)
                    inputs = [
                        mx.zeros((width, V), dtype=mx.float32),
                        mx.zeros((width, E), dtype=self.model.dtype),
                        mx.zeros((width, depth), dtype=mx.float32),
                        *layout.arrays(),
                        *shaping.arrays,
                    ]
                    out = self._chain_fn(key, layout, shaping, depth)(inputs, kv)
                    made += self._pin(key, *out)
        return made

    def _precompile_grid(self, tokens: int, ahead: int = 0) -> list[tuple[int, int, int]]:
        """(padded width, past bucket, a start in that bucket) of every step of `tokens`
        tokens a row this pool can meet, reading the past up to its start + `ahead`; none
        for an eager runner."""
        if not self.compile:
            return []
        widths = self._precompile_widths()
        last = self.pool.max_context - tokens  # the latest start a row of `tokens` can have
        latest: dict[int, int] = {}  # past bucket -> a start that reads it
        for start in range(last + 1):
            latest[self.past_for(start + ahead)] = start
        return [(w, past, latest[past]) for w in widths for past in sorted(latest)]

    def _precompile_widths(self) -> list[int]:
        """Every padded width (`padded_width`) a step of this pool can run at."""
        return sorted({self.padded_width(n) for n in range(1, self.pool.n_slots + 1)})

    def _pin(self, key: tuple[object, ...], *outputs: object) -> int:
        """Evaluate a forward just built for `key` and keep it for good: 1, or 0 if it was
        kept already."""
        if key in self._pinned:
            return 0
        mx.eval(*outputs)
        self._pinned[key] = self._compiled.pop(key)  # (compiled at once: it recurs)
        return 1

    def launch(
        self, slots: Sequence[SlotId], tokens: mx.array, want_hidden: bool = False
    ) -> PendingStep:
        """Queue a decode step — `tokens [N]` (a device array: say, the last step's argmax)
        at each slot's length — without touching the pool: `adopt` writes it, for all or
        some of its rows, once the caller knows it wants them; dropped, it changed nothing.
        A step planned on tokens the host has not read yet (the scheduler's decode-ahead).
        `want_hidden`: the rows' outputs carry their final hidden states (drafters follow
        the trunk on them)."""
        t0 = time.perf_counter()
        slots = self._validate(list(slots))
        starts = [self.pool.lengths[s] for s in slots]
        n = len(slots)
        if tokens.shape != (n,):
            raise BatchError(f"tokens of shape {tokens.shape} for {n} decode rows")
        self.pool.check_rows(slots, starts, [1] * n, [False] * n)
        pads = self._pad_slots(slots, self.padded_width(n))
        fed = tokens.astype(mx.int32)
        if pads:  # rows on other slots, read and never written; their outputs dropped
            fed = mx.pad(fed, [(0, len(pads))])
        all_slots, all_starts = slots + pads, starts + starts[:1] * len(pads)
        row_starts = self.inputs.starts(all_slots, all_starts)
        _, (logits, hidden, new, _, _, after) = self._decode_forward(
            all_slots, all_starts, fed, row_starts
        )
        self.inputs.ran(all_slots, all_starts, after)
        if pads:
            logits, hidden, new, _ = _real_rows((n, n, n), logits, hidden, new, [])
        self.last_host_s, self.last_tokens = time.perf_counter() - t0, n
        kept = hidden if want_hidden else None
        mx.async_eval(logits, new, *([] if kept is None else [kept]))
        positions = row_starts[:n] if pads else row_starts  # its tokens' positions: their starts
        return PendingStep(slots, starts, logits, new, positions, kept)

    def _decode_forward(
        self,
        slots: list[SlotId],
        starts: list[int],
        tokens: mx.array,
        row_starts: mx.array | None = None,
    ) -> tuple[tuple[object, ...], Any]:
        """One token a row on `slots` at `starts` (padding rows included; `row_starts`: the
        same as an array, if made already), through the forward kept for that decode shape,
        reading the pool: its key and its outputs (lazy). Each row's one output is its
        packed index, 0 .. width-1: the layout's kept array, no `arange` node or fresh
        buffer a step."""
        width = len(slots)
        layout = Layout.build([1] * width, starts, [False] * width, row_starts)
        past = self.past_for(max(starts))
        key, fn = self._forward_fn(layout, width, past, (), every=True)
        inputs = [tokens, layout.pack_index, *layout.arrays()]
        return key, fn(inputs, self.pool.read(slots, past))

    def adopt(self, pending: PendingStep, keep: Sequence[int]) -> StepOutput:
        """Write the rows `keep` (indices into `pending`'s, in the order wanted) of a
        launched step into the pool, as `step` would have, and return their outputs in that
        order. Raises `BatchError`, changing nothing, if a kept slot has moved since the
        launch (freed, reset, stepped)."""
        slots = [pending.slots[i] for i in keep]
        starts = [pending.starts[i] for i in keep]
        if len(set(slots)) != len(slots):
            raise BatchError(f"a pending row kept twice: {list(keep)}")
        moved = [s for s, n in zip(slots, starts, strict=True) if self.pool.lengths[s] != n]
        if moved or not slots:
            raise BatchError(
                f"slots {moved} moved since the step was launched" if moved else "no rows kept"
            )
        self.pool.check_rows(slots, starts, [1] * len(slots), [False] * len(slots))
        new, logits, hidden = pending.new, pending.logits, pending.hidden
        ones = [1] * len(slots)
        if list(keep) == list(range(len(pending.slots))):
            # the launch's arrays: nothing written by the host for the pool's scatter
            tok_slot, tok_pos = self.inputs.kept(slots), pending.positions
        else:  # rows are tokens: one index serves
            at = mx.array(list(keep), dtype=mx.int32)
            new = [a[:, at] for a in new]
            logits = logits[at]
            hidden = None if hidden is None else hidden[at]
            tok_slot, tok_pos = SlotPool.token_coordinates(slots, starts, ones)
        self._store(slots, starts, ones, tok_slot, tok_pos, new, [None] * len(self.model.layers))
        return StepOutput([RowOutput(packed=(logits, hidden, i, 1)) for i in range(len(slots))])

    def _store(
        self,
        slots: list[SlotId],
        starts: list[int],
        lengths: list[int],
        tok_slot: mx.array,
        tok_pos: mx.array,
        new: list[mx.array],
        captured: list[LinearCapture | None],
    ) -> None:
        """A step's new state into the pool, and its rows' lengths (and captures) committed.
        The write is queued, not waited for: whatever reads the pool next runs after it on
        the stream, and the caller's sampling need not wait for a round trip to the host."""
        self.pool.write(slots, tok_slot, tok_pos, new)
        mx.async_eval(self.pool.k, self.pool.v, self.pool.conv, self.pool.ssm)
        self.pool.commit(slots, starts, lengths, captured)

    def past_for(self, start: int) -> int:
        """How much past K/V a step whose latest row starts at `start` reads: `start` rounded
        up to a multiple of `PAST_BUCKET` — and, in a compiled runner past `PAST_LINEAR`, to a
        power of two, so a long context meets a new compiled shape each time it doubles
        rather than every 64 tokens (reading at most twice the past it needs)."""
        past = -(-start // self.PAST_BUCKET) * self.PAST_BUCKET
        if self.compile and past > self.PAST_LINEAR:
            past = 1 << (past - 1).bit_length()
        return min(self.pool.max_context, past)

    def ssm_layers(self, rows: int) -> bool:
        """Whether a step of `rows` rows hands the pool its recurrent states a layer at a
        time rather than stacked (`SlotPool.stack_states`; `SSM_WRITE_ENV`)."""
        return self.ssm_layers_from is not None and rows >= self.ssm_layers_from

    def recurs(self, shortest: int, longest: int) -> bool:
        """Whether rows of these lengths make a decode or verify step — one length, at most
        a draft's K + 1 tokens — whose shape recurs step after step (unlike a prefill's)."""
        return shortest == longest <= self.pool.max_draft + 1

    def padded_width(self, n: int) -> int:
        """The width a decode or verify step of `n` rows runs at: with `pad_widths`, `n`
        rounded up to 1, 2, 4, 8 or a multiple of 8 (at most the pool's slots), so a batch
        whose width drifts as requests come and go meets a few compiled shapes per past
        bucket, not one per width (64 slots: 11, not 64); else `n`."""
        if not self.pad_widths:
            return n
        width = 1 << (n - 1).bit_length() if n <= 8 else -(-n // 8) * 8
        return min(width, self.pool.n_slots)

    def _pad_slots(self, slots: list[SlotId], width: int) -> list[SlotId]:
        """`width - len(slots)` slots outside `slots` for padding rows — after the batch's
        last slot first, so the pool's read stays one run of slices where it was one."""
        need = width - len(slots)
        if need <= 0:
            return []
        taken, last = set(slots), slots[-1]
        order = itertools.chain(range(last + 1, self.pool.n_slots), range(last))
        return [SlotId(s) for s in itertools.islice((s for s in order if s not in taken), need)]

    def _taps(self, batch: Sequence[Row]) -> tuple[int, ...]:
        """The trunk layers any row taps, in order; raises on a layer the model lacks."""
        taps = tuple(sorted({i for r in batch for i in r.taps}))
        if taps and not 0 <= taps[0] <= taps[-1] < len(self.model.layers):
            raise BatchError(f"taps {taps} outside the trunk's {len(self.model.layers)} layers")
        return taps

    def _forward_fn(
        self, layout: Layout, outputs: int, past: int, taps: tuple[int, ...], every: bool
    ) -> tuple[tuple[object, ...], Callable[..., Any]]:
        """The trunk's forward for one batch shape (`shape_key`) and that key. `every`: the
        `outputs` are every packed position in order (decode and verify steps), taken as
        they are — where picking them (`picked`, then unread) would be a gather, a launch on
        a GPU."""
        key = shape_key(layout, outputs, past, taps, every)
        model, config = self.model, self.model.config
        derive = self.inputs.device

        def forward(
            inputs: list[mx.array], stacked: list[mx.array]
        ) -> tuple[mx.array, mx.array, list[mx.array], list[mx.array], list[mx.array], mx.array]:
            tokens, picked, *layout_arrays = inputs
            lay = layout.with_arrays(layout_arrays)
            states = SlotPool.split_states(config, stacked)
            hidden, new_states, captures, tapped = model(tokens, lay, states, taps)
            h = hidden if every else hidden[picked]
            flat = [a for c in captures if c is not None for a in (c.windows, c.states)]
            new = SlotPool.stack_states(lay, new_states, self.ssm_layers(layout.rows))
            t = [] if tapped is None else [tapped if every else tapped[picked]]  # (no None out)
            # each row's start once all its tokens are in: the next decode step's starts,
            # made on the device in this graph (`StepInputs`; without it, no kernel spent)
            after = lay.row_starts + lay.row_lengths if derive else lay.row_starts
            return model.logits(h).astype(mx.float32), h, new, flat, t, after

        # Compiled at once, a decode or verify shape skips an eager first step (on a GPU
        # tens of ms, one per width and past bucket); a ragged prefill waits for its shape to
        # come back.
        recurs = layout.uniform and self.recurs(layout.width, layout.width)
        return key, self._kept_or(key, forward, at_once=recurs)

    def _draft_fn(
        self, key: tuple[object, ...], layout: Layout, last: bool, at_once: bool
    ) -> Callable[..., Any]:
        """The MTP head's forward for one batch shape (`last`: outputs of one picked position a
        row), compiled like the trunk's: `at_once`, or at its `compile_after`-th sighting."""
        mtp = self._mtp()

        def draft(
            inputs: list[mx.array], kv: list[mx.array]
        ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
            tokens, hidden, picked, *layout_arrays = inputs
            lay = layout.with_arrays(layout_arrays)
            state = AttentionState(kv[0], kv[1])
            logits, h, new = mtp(tokens, hidden, lay, state, picked if last else None)
            return logits.astype(mx.float32), h, new.k, new.v

        return self._kept_or(key, draft, at_once=at_once)

    def _chain_fn(
        self, key: tuple[object, ...], layout: Layout, shaping: Shaping, depth: int
    ) -> Callable[..., Any]:
        """`depth` draws of the MTP head's draft chain and the `depth - 1` forwards between
        them, for one batch shape, compiled like the trunk's forward. Each forward's K/V
        goes into the past the next one reads, as the pool would hold it."""
        mtp = self._mtp()

        def chain(
            inputs: list[mx.array], kv: list[mx.array]
        ) -> tuple[mx.array, mx.array, list[mx.array], list[mx.array]]:
            logits, hidden, uniforms, *rest = inputs
            lay = layout.with_arrays(rest[:5])
            shape = shaping.with_arrays(rest[5:])

            def drawn(logits: mx.array, u: mx.array) -> mx.array:
                # all greedy: the argmax, which is what a draw from the one-hot q gives,
                # without the distribution's kernels over the vocabulary (nor q: a point mass)
                if shape.greedy_only:
                    return mx.argmax(logits, axis=-1).astype(mx.int32)
                q = shape(logits)
                qs.append(q)
                return draw(q, u)

            qs: list[mx.array] = []
            tokens, ks, vs = [drawn(logits, uniforms[:, 0])], [], []
            past = AttentionState(kv[0], kv[1]) if kv else None
            for d in range(1, depth):
                at = dataclasses.replace(lay, row_starts=lay.row_starts + (d - 1))
                assert past is not None
                logits, hidden, new = mtp(tokens[-1], hidden, at, past)
                ks.append(new.k)
                vs.append(new.v)
                past = _written(past, new, at.row_starts)
                tokens.append(drawn(logits.astype(mx.float32), uniforms[:, d]))
            q = mx.stack(qs, axis=1) if qs else uniforms[:, :0]  # (no q: an empty array)
            return mx.stack(tokens, axis=1), q, ks, vs

        return self._kept_or(key, chain, at_once=self.pad_widths)

    def _kept_or(
        self, key: tuple[object, ...], fn: Callable[..., Any], at_once: bool = False
    ) -> Callable[..., Any]:
        """The forward kept for this batch shape (now the most recently used); if none, `fn`,
        kept — in a compiled runner compiled, once the shape has come `compile_after` times
        (`at_once`: the first time; until then it runs eagerly, not kept); the least recently
        used go past `MAX_FORWARDS`."""
        pinned = self._pinned.get(key)
        if pinned is not None:
            return pinned
        kept = self._compiled.get(key)
        if kept is not None:
            self._compiled.move_to_end(key)
            return kept
        if self.compile:
            self.cold_steps += 1
            seen = self._sightings.pop(key, 0) + 1
            if seen < self.compile_after and not at_once:
                self._sightings[key] = seen
                if len(self._sightings) > 4 * self.MAX_FORWARDS:
                    self._sightings.popitem(last=False)
                return fn
            fn = mx.compile(fn)
        self._compiled[key] = fn
        if len(self._compiled) > self.MAX_FORWARDS:
            self._compiled.popitem(last=False)
        return fn

    def _mtp_pads(self, slots: list[SlotId], uniform: bool) -> list[SlotId]:
        """Slots for the rows that pad an MTP forward of uniform rows to the trunk's padded
        width (`padded_width`), so a compiled runner meets a few head shapes per past bucket
        however many slots draft — and can compile them all ahead (`precompile_mtp`). Their
        rows are read, never written; their outputs are dropped."""
        if not (self.pad_widths and uniform):
            return []
        return self._pad_slots(slots, self.padded_width(len(slots)))

    def _check_mtp_room(self, slot: SlotId, end: int) -> None:
        if end > self.pool.max_context:
            raise BatchError(f"slot {slot}: MTP row past the context of {self.pool.max_context}")

    def _write_mtp(
        self,
        slots: list[SlotId],
        starts: list[int],
        lengths: list[int],
        new: AttentionState,
        layout: Layout | None = None,
    ) -> None:
        """Write the rows' new MTP K/V into the pool at `starts`, queued (not waited for)."""
        layout = Layout.build(lengths, starts) if layout is None else layout
        self.pool.write_mtp(slots, starts, lengths, layout, new)
        assert self.pool.mtp_k is not None and self.pool.mtp_v is not None
        mx.async_eval(self.pool.mtp_k, self.pool.mtp_v)

    def _mtp(self) -> MTPHead:
        if self.model.mtp is None:
            raise BatchError(f"{self.model.path}: this model has no MTP head")
        return self.model.mtp

    @property
    def cached_forwards(self) -> int:
        """Batch shapes whose forward is kept now (at most `MAX_FORWARDS`)."""
        return len(self._compiled)

    def draft(
        self, batch: Sequence[DraftRow], ends: Sequence[int] | None = None
    ) -> list[tuple[mx.array, mx.array]]:
        """One batched MTP forward. Per row: (draft logits `[n, V]`, MTP hidden h' `[n, E]`) of
        its n tokens; with `ends`, of its token `ends[b] - 1` only (`[1, V]`, `[1, E]`: the
        tokens after it are filler, and a catch-up wants only its last prediction — the head's
        vocabulary product on one position a row, not on all). Every token's K/V is written."""
        self._mtp()
        slots = self._validate([r.slot for r in batch], [r.tokens for r in batch])
        starts = [r.start for r in batch]
        lengths = [len(r.tokens) for r in batch]
        if ends is not None and not all(1 <= e <= n for e, n in zip(ends, lengths, strict=True)):
            raise BatchError(f"draft ends {list(ends)} outside rows of {lengths} tokens")
        for slot, start, n in zip(slots, starts, lengths, strict=True):
            self._check_mtp_room(slot, start + n)
        past = self.past_for(max(starts))
        pads = self._mtp_pads(slots, len(set(lengths)) == 1)
        state = self.pool.read_mtp(slots, starts, past, pads)
        rows = [*batch, *[batch[0]] * len(pads)]  # pads: the first row again, on other slots
        layout = Layout.build([len(r.tokens) for r in rows], [r.start for r in rows])
        hidden = mx.concatenate([r.hidden for r in rows], axis=0)
        last = ends is not None
        key = _draft_key(layout, past, last)
        # a steady catch-up (uniform rows at a padded width, a verify row long) recurs every
        # round: compiled at once; a backlog's pieces, unless precompiled, the second time
        steady = self.pad_widths and layout.uniform and self.recurs(layout.width, layout.width)
        fn = self._draft_fn(key, layout, last, at_once=steady)
        picked = layout.pack_index  # (read only with `ends`: a kept array stands in)
        if ends is not None:
            offsets = itertools.accumulate([len(r.tokens) for r in rows], initial=0)
            row_ends = [*ends, *[ends[0]] * len(pads)]
            picked = self.inputs.kept([o + e - 1 for o, e in zip(offsets, row_ends, strict=False)])
        inputs = [_token_array(rows), hidden, picked, *layout.arrays()]
        logits, h, k, v = fn(inputs, [state.k, state.v])
        if pads:  # uniform rows: the real ones are the first, their outputs the first ones
            n = len(batch) if last else sum(lengths)
            logits, h, k, v = logits[:n], h[:n], k[: len(batch)], v[: len(batch)]
            layout = Layout.build(lengths, starts)
        new = AttentionState(k, v)
        # Queued, not waited for (unlike `step`): the head's K/V only ever makes drafts, which
        # the trunk verifies, so nothing a client sees depends on it; and the draft chain that
        # follows a catch-up is built on the host while the device runs it, where a wait here
        # left the device idle for that building, once a round.
        mx.async_eval(logits, h, new.k, new.v)
        self._write_mtp(slots, starts, lengths, new, layout)
        if last:
            return [(logits[b : b + 1], h[b : b + 1]) for b in range(len(batch))]
        out, at = [], 0
        for n in lengths:
            out.append((logits[at : at + n], h[at : at + n]))
            at += n
        return out

    def draft_chain(
        self, rows: Sequence[ChainRow], shaping: Shaping, depth: int | None = None
    ) -> list[tuple[list[int], mx.array | None]]:
        """Every row's MTP draft chain in one graph, evaluated once; `shaping` (one row per
        chain) makes each depth's distribution q. The head's K/V of the deeper forwards is
        written to the pool at `start ..` (provisional entries, as `draft` writes them).
        Per row: (its `depth` tokens, q `[depth, V]`, or None when every row is greedy:
        each token its argmax, a point mass). `depth`: how deep the graph draws
        (default: the deepest row) — a fixed depth keeps one compiled shape whatever the
        rows' depths; what a row draws past its own (a row of depth 0: all) is dropped."""
        self._mtp()
        slots = self._validate([r.slot for r in rows])
        starts = [r.start for r in rows]
        for r in rows:
            if not 0 <= r.depth <= len(r.uniforms):
                raise BatchError(f"slot {r.slot}: a chain of {r.depth} draws")
            if r.depth:
                self._check_mtp_room(r.slot, r.start + r.depth - 1)
        deepest = max(r.depth for r in rows)
        K = deepest if depth is None else depth
        if not 1 <= deepest <= K:
            raise BatchError(f"a chain {K} deep for rows up to {deepest} deep")
        pads = self._mtp_pads(slots, True)
        # pads: the first row again on other slots, drawing nothing, shaped as the first
        fed = [*rows, *[dataclasses.replace(rows[0], depth=0)] * len(pads)]
        if pads:
            shaping = shaping.padded(len(pads))
        layout = Layout.build([1] * len(fed), [r.start for r in fed])
        kv: list[mx.array] = []
        past = 0
        if K > 1:  # the deepest forward reads the entries up to its start
            past = self.past_for(max(starts) + K - 2)
            state = self.pool.read_mtp(slots, starts, past, pads)
            kv = [state.k, state.v]
        uniforms = np.zeros((len(fed), K), dtype=np.float32)
        for b, r in enumerate(rows):
            uniforms[b, : r.depth] = r.uniforms[: r.depth]
        key = _chain_key(layout, K, past, shaping)
        fn = self._chain_fn(key, layout, shaping, K)
        inputs = [
            mx.concatenate([r.logits for r in fed]),
            mx.concatenate([r.hidden for r in fed]),
            host_pool.array(uniforms.ravel().tolist(), mx.float32).reshape(uniforms.shape),
            *layout.arrays(),
            *shaping.arrays,
        ]
        tokens, q, ks, vs = fn(inputs, kv)
        mx.eval(tokens, q, ks, vs)  # before the pool changes, as in `step`
        deep = [b for b, r in enumerate(rows) if r.depth > 1]
        if deep:
            k = mx.concatenate(ks[: deepest - 1], axis=1)
            v = mx.concatenate(vs[: deepest - 1], axis=1)
            if len(deep) < len(rows):  # (an integer index is a gather: only when needed)
                at = mx.array(deep, dtype=mx.int32)
                k, v = k[at], v[at]
            elif pads:  # every real row: the first, a slice
                k, v = k[: len(rows)], v[: len(rows)]
            lengths = [rows[b].depth - 1 for b in deep]
            self._write_mtp(
                [slots[b] for b in deep], [starts[b] for b in deep], lengths, AttentionState(k, v)
            )
        drawn = np.array(tokens)
        return [
            (
                [int(t) for t in drawn[b, : r.depth]],
                None if shaping.greedy_only else q[b, : r.depth],
            )
            for b, r in enumerate(rows)
        ]

    def _validate(
        self, slots: list[SlotId], tokens: list[Sequence[int]] | None = None
    ) -> list[SlotId]:
        """The batch's slots, each once; each row's tokens (when given) in the vocabulary."""
        if not slots:
            raise BatchError("empty batch")
        if len(set(slots)) != len(slots):
            raise BatchError(f"a slot appears more than once in the batch: {slots}")
        if tokens is None:
            return list(slots)
        V = self.model.config.n_vocab
        for slot, toks in zip(slots, tokens, strict=True):
            if len(toks) == 0:
                raise BatchError(f"slot {slot}: empty row")
            bad = [t for t in toks if not 0 <= t < V]
            if bad:
                raise BatchError(f"slot {slot}: token ids {bad[:5]} outside the vocabulary of {V}")
        return list(slots)


def last_logits(outputs: Sequence[RowOutput]) -> mx.array:
    """`[N, V]`: each output's last logits row — one slice of the step's packed logits when
    the outputs lie there side by side with one row each (plain decode rows), else gathered."""
    first = outputs[0].packed
    if first is not None:
        packed, at = first[0], first[2]
        for i, o in enumerate(outputs, at):
            q = o.packed
            if q is None or q[0] is not packed or q[2] != i or q[3] != 1:
                break
        else:
            return packed[at : at + len(outputs)]
    return mx.concatenate([o.logits[-1:] for o in outputs])


def verified_logits(outputs: Sequence[RowOutput]) -> tuple[mx.array, list[int]] | None:
    """`(logits, firsts)`: one slice of the step's packed logits holding every output's rows,
    and where each output's first row is in it — when the outputs lie there side by side in
    order (as a verify step's rows do); else None. A verify step's acceptance reads them as
    one array instead of slicing each row and joining the slices (2N + 1 graph nodes, each
    a launch on a GPU, on every speculative step's critical path)."""
    first = outputs[0].packed if outputs else None
    if first is None:
        return None
    packed, at = first[0], first[2]
    firsts, end = [], at
    for o in outputs:
        q = o.packed
        if q is None or q[0] is not packed or q[2] != end:
            return None
        firsts.append(end - at)
        end += q[3]
    return packed[at:end], firsts


SSM_WRITE_ENV = "SLOTSERVE_POOL_SSM_WRITE"
STEP_INPUTS_ENV = "SLOTSERVE_STEP_INPUTS"
STEP_INPUTS = ("device", "host")


def ssm_layers_from() -> int | None:
    """From how many rows a step writes its recurrent states into the pool a layer at a time
    (SLOTSERVE_POOL_SSM_WRITE, read when a runner is made): "stacked" (the default, never:
    one stack and one write, two launches), "layers" (always: a write per linear layer, no
    stacked copy) or a row count. The stacked copy moves every row's state once more on the
    device — at 64 rows of the 0.8B, 1.2 GB read and written a step — while a write per
    layer costs 16 more launches, which bound a narrow step's time. For measuring: its test
    passes on the H200 (session 12); its speed there is not measured yet."""
    return parse_ssm_write(os.environ.get(SSM_WRITE_ENV, "stacked"))


def parse_ssm_write(mode: str) -> int | None:
    """SLOTSERVE_POOL_SSM_WRITE's value as `ssm_layers_from` returns it."""
    if mode == "stacked":
        return None
    if mode == "layers":
        return 1
    if not mode.isdigit() or int(mode) < 1:
        raise ValueError(f"{SSM_WRITE_ENV}={mode!r}: stacked, layers or a row count >= 1")
    return int(mode)


def step_inputs_on_device() -> bool:
    """Whether decode steps take their starts from the step before, on the device
    (`StepInputs`; SLOTSERVE_STEP_INPUTS, read when a runner is made): "device" (the
    default since session 20) or "host" (every step's starts written by the host): fewer
    host-written inputs. Session 12's tokens/s had "device" level with or ahead of "host"
    (+3.0% at 8 rows, +0.5% at 64); session 21's H200 timelines of decode-ahead at 8 rows
    had 2.14 ms a step with "device", 3.12 with "host" (one run each) and its tokens/s no
    difference beyond the host's two speeds (docs/PERFORMANCE.md). Session 20's 465 us K/V
    store, the reason it became the default, came back with neither."""
    return parse_step_inputs(os.environ.get(STEP_INPUTS_ENV, STEP_INPUTS[0]))


def parse_step_inputs(mode: str) -> bool:
    """SLOTSERVE_STEP_INPUTS's value as `step_inputs_on_device` returns it."""
    if mode not in STEP_INPUTS:
        raise ValueError(f"{STEP_INPUTS_ENV}={mode!r}: device or host")
    return mode == "device"


class StepInputs:
    """The small integer arrays a decode step reads besides its tokens — its rows' starts
    (rope offsets, masks, and the positions the pool's scatter writes K/V at), its rows'
    slots, its picked outputs — made so that a steady decode loop's kernels need not read
    memory the host has just written.

    On MLX's CUDA backend every array is managed memory, and a kernel reading an array the
    host wrote a moment before sometimes waits for its pages: on the H200 a gather with
    host-written indices took 69-276 us more at its 90th percentile than with kept ones
    (`bench/input_faults.py`, docs/PERFORMANCE.md, session 12). So every step's forward also
    returns its rows' starts after it (`after`: starts + lengths, computed in its compiled
    graph), and with `device` on a step on the same slots whose starts are exactly those
    takes that array as its starts: no host write, no extra launch. Any other step makes its
    starts from the host, as all do with `device` off. The values are the same either way
    (the pool has checked every start against the slot's length); only where they were made
    differs. Slot and output-index arrays are kept per tuple of values (the most recent
    `KEPT`), like a layout's length-derived arrays."""

    KEPT = 64

    def __init__(self, device: bool) -> None:
        self.device = device
        self._after: tuple[tuple[int, ...], tuple[int, ...], mx.array] | None = None
        self._kept: OrderedDict[tuple[int, ...], mx.array] = OrderedDict()
        self.derived = 0  # steps whose starts came from the step before (tests, benches)

    def starts(self, slots: Sequence[int], starts: list[int]) -> mx.array:
        """The starts of a step of one token a row: the last step's `after` if it was on
        these slots and ended at these starts; else made from the host."""
        after = self._after
        if after is not None and after[0] == tuple(slots) and after[1] == tuple(starts):
            self.derived += 1
            return after[2]
        return mx.array(starts, dtype=mx.int32)

    def ran(self, slots: Sequence[int], starts: Sequence[int], after: mx.array) -> None:
        """A step of one token a row on `slots` at `starts` was built; `after` (lazy) holds
        its rows' next starts."""
        if self.device:
            self._after = (tuple(slots), tuple(s + 1 for s in starts), after)

    def kept(self, values: list[int] | list[SlotId]) -> mx.array:
        """An int32 array of `values`, made once while recent (with `device` on)."""
        if not self.device:
            return mx.array(values, dtype=mx.int32)
        key = tuple(values)
        arr = self._kept.get(key)
        if arr is None:
            arr = self._kept[key] = mx.array(key, dtype=mx.int32)
            if len(self._kept) > self.KEPT:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(key)
        return arr


def uniform_shapes(runner: ModelRunner) -> bool:
    """Whether padding rows to one shape pays (`Speculator.uniform_verify`,
    `MTPDrafter.uniform`): in a compiled runner on a GPU, where a step of a new shape costs
    tens of ms and a few more tokens in a row almost nothing."""
    return runner.compile and mx.default_device() == mx.gpu


def _draft_key(layout: Layout, past: int, last: bool) -> tuple[object, ...]:
    """The MTP head's forward's batch shape (`ModelRunner.draft`, `precompile_mtp`)."""
    tokens = int(layout.pack_index.size)
    return ("mtp", layout.rows, layout.width, layout.uniform, tokens, past, last)


def _chain_key(layout: Layout, depth: int, past: int, shaping: Shaping) -> tuple[object, ...]:
    """The MTP draft chain's shape (`ModelRunner.draft_chain`, `precompile_mtp`)."""
    return ("mtp-chain", layout.rows, depth, past, *shaping.key)


def shape_key(
    layout: Layout, outputs: int, past: int, taps: tuple[int, ...], every: bool = False
) -> tuple[object, ...]:
    """What a trunk forward is compiled for: the batch's layout (rows, longest row, tokens,
    capture rows), the positions it returns (`every`: all, in order), the past it reads, the
    layers it taps."""
    tokens = int(layout.pack_index.shape[0])
    return (
        layout.rows,
        layout.width,
        layout.uniform,
        layout.capture,
        outputs,
        every,
        past,
        tokens,
        taps,
    )


def _written(past: AttentionState, new: AttentionState, at: mx.array) -> AttentionState:
    """`past` `[B, S, Hkv, D]` with each row's one new entry (`new`, `[B, 1, Hkv, D]`) at its
    position `at[b]` (none where that lies past S)."""
    hit = (mx.arange(past.k.shape[1])[None, :] == at[:, None])[:, :, None, None]
    return AttentionState(
        mx.where(hit, new.k.astype(past.k.dtype), past.k),
        mx.where(hit, new.v.astype(past.v.dtype), past.v),
    )


def _token_array(batch: Sequence[Row] | Sequence[DraftRow]) -> mx.array:
    """The batch's tokens packed row after row (any integer type, numpy's included)."""
    return mx.array([int(t) for r in batch for t in r.tokens], dtype=mx.int32)


def _real_rows(
    real: tuple[int, int, int],
    logits: mx.array,
    hidden: mx.array,
    new: list[mx.array],
    tapped: list[mx.array],
) -> tuple[mx.array, mx.array, list[mx.array], list[mx.array]]:
    """A padded step's outputs cut to its `real` (rows, tokens, outputs), the padding rows
    last in each: views, no copies."""
    rows, tokens, outputs = real
    k, v, *rest = new  # then conv and the ssm (stacked, or one a linear layer), rows on axis 1
    return (
        logits[:outputs],
        hidden[:outputs],
        [k[:, :tokens], v[:, :tokens], *(a[:, :rows] for a in rest)],
        [t[:outputs] for t in tapped],
    )


def _unflatten_captures(
    model: Model, layout: Layout, flat: list[mx.array], rows_kept: int | None = None
) -> list[LinearCapture | None]:
    """Per trunk layer, the capture of the batch's capture rows (linear layers only): of
    the first `rows_kept` rows only, when given (a padded step's real rows; the captures
    keep their padding rows' entries, after the real rows', unread)."""
    rows = tuple(r for r in layout.capture_rows if rows_kept is None or r < rows_kept)
    if not rows:
        return [None] * len(model.layers)
    out: list[LinearCapture | None] = []
    it = iter(flat)
    for recurrent in model.config.recurrent:
        out.append(LinearCapture(rows, next(it), next(it)) if recurrent else None)
    return out
