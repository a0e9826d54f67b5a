"""Drafters: what proposes the K tokens a slot verifies in a step.

A drafter answers two questions per step. `available(d, length)`: how many draft
tokens it could offer the slot now (0: none), cheaply, before the controller
chooses K. `draft(jobs)`: the tokens for every slot of the step at once, with the
distribution q each was drawn from (`None`: a point mass at the token).
`observe` and `release` follow a slot's trunk so a drafter with state of its own
(the MTP head's KV) stays consistent with the committed tokens.

* `NgramDrafter` — prompt lookup: the slot's last n tokens matched against its
  prompt and output so far; the tokens that followed the latest match are the
  draft. Model-free, no state.
* `MTPDrafter` — the model's nextn block (MODEL_SPEC §10, §16.2), batched across
  slots through `ModelRunner.draft`, chained up to K by feeding its own h' back (on the
  device in one graph, `ModelRunner.draft_chain`).
* `DFlashDrafter` — a block drafter (`engine/spec/dflash.py`): one non-causal forward
  for all its slots drafts up to block_size - 1 tokens each, conditioned on the
  outputs of some trunk layers (`layers`) at every committed position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol, cast

import mlx.core as mx
import numpy as np

from engine.cache import SlotId
from engine.runner import ChainRow, DraftRow, ModelRunner, uniform_shapes
from engine.sampling import Shaping, adjust_logits, distribution, draw
from engine.spec.dflash import DFlashModel, DFlashPool

if TYPE_CHECKING:
    from engine.spec.speculator import DecodingSlot

UNBOUNDED = 1 << 30  # `available` of a drafter that can extend a draft indefinitely


class DraftJob(NamedTuple):
    """One slot of a step for a drafter: draft `k` tokens (0: none) after `d.pending`.

    `length` is the slot's trunk length; `d.pending` will sit at that position. (A
    NamedTuple: every decoding slot makes one per drafter per step.)
    """

    d: DecodingSlot
    k: int
    length: int


@dataclass
class Draft:
    """Proposed tokens and, per token, the distribution it was drawn from (`[k, V]`)."""

    tokens: list[int] = field(default_factory=list)
    q: mx.array | None = None  # None: each token is a point mass


NO_DRAFT = Draft()  # what a drafter hands out for a slot it does not draft for; never changed


class DrafterState(Protocol):
    """A drafter's state for one slot, as `Drafter.export` returns it: it may hold device
    copies until `settle` moves them to host memory (on the step thread, once the step has
    waited for the device anyway)."""

    @property
    def nbytes(self) -> int: ...

    def settle(self) -> None: ...


class Drafter:
    """Base of all drafters; stateless drafters keep the no-op hooks."""

    name = ""
    layers: tuple[int, ...] = ()  # trunk layers whose outputs `observe` needs as `taps`
    caught_up = 0  # the most positions one slot fed the drafter's own model in the last `draft`

    def available(self, d: DecodingSlot, length: int) -> int:
        raise NotImplementedError

    def draft(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        raise NotImplementedError

    def begin(self, slot: SlotId) -> None:
        """A new sequence starts in `slot` (its first prefill chunk is about to run)."""

    def needs_hidden(self, slot: SlotId) -> bool:
        """Whether the slot's rows must return the trunk's hidden states for `observe`."""
        return False

    def observe(self, slot: SlotId, start: int, hidden: mx.array, taps: mx.array | None) -> None:
        """The trunk committed positions `start ..` of `slot` with these hidden states
        (and the outputs of the trunk layers `layers`, side by side, when it has any)."""

    def release(self, slot: SlotId) -> None:
        """The slot's sequence ended; forget it."""

    def export(self, slot: SlotId) -> DrafterState | None:
        """What the drafter keeps for `slot`, to `adopt` in a slot restored from the same
        pool snapshot (None: nothing)."""
        return None

    def adopt(self, slot: SlotId, state: DrafterState) -> None:
        """Follow `slot` from a state `export` returned (its pool state was restored)."""

    def bytes_for(self, context_tokens: int) -> int:
        """Bytes a speculating sequence of `context_tokens` holds in this drafter's own
        pool (0: none; the MTP head's KV is in the trunk's `SlotPool`, which counts it)."""
        return 0

    def precompile(self, max_draft: int) -> int:
        """Compile and keep the drafter's own forwards of every steady batch shape, drafts
        up to `max_draft` deep (`Speculator.precompile`): the number compiled (0: none)."""
        return 0


class NgramDrafter(Drafter):
    """Prompt lookup: continue the latest earlier occurrence of the history's last n tokens.

    The longest n in `max_ngram .. min_ngram` with a match wins. The continuation runs on
    through the draft itself, so a history ending in a loop drafts the loop for any K.
    `continuation` and `propose` are the rule as pure functions of a history; a speculating
    slot is served by an index of its history's n-grams (`_NgramIndex`) that grows with it,
    so a step looks up a few keys where the rule scans the whole history: at N = 8 on this
    repository's CPU the scans were most of a speculative step's 0.87 ms of planning.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._indexes: dict[SlotId, _NgramIndex] = {}

    def available(self, d: DecodingSlot, length: int) -> int:
        return UNBOUNDED if self._at(d) is not None else 0

    def draft(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        return [
            Draft(_continued(j.d.history, self._at(j.d), j.k)) if j.k else NO_DRAFT for j in jobs
        ]

    def begin(self, slot: SlotId) -> None:
        self._indexes.pop(slot, None)

    def release(self, slot: SlotId) -> None:
        self._indexes.pop(slot, None)

    def _at(self, d: DecodingSlot) -> int | None:
        """`continuation(d.history)`, from the slot's index (made or grown as needed)."""
        index = self._indexes.get(d.slot)
        if index is None or not index.follows(d.history):
            index = self._indexes[d.slot] = _NgramIndex(d.history, self.min_ngram, self.max_ngram)
        return index.continuation()

    def continuation(self, history: Sequence[int]) -> int | None:
        """Index in `history` where the continuation of the latest match starts, if any."""
        h = np.asarray(history)
        for n in range(min(self.max_ngram, len(h) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)
            hits = np.flatnonzero((windows == h[-n:]).all(axis=1))
            if hits.size:
                return int(hits[-1]) + n
        return None

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        return _continued(history, self.continuation(history), k)


def _continued(history: Sequence[int], at: int | None, k: int) -> list[int]:
    """The k tokens that continue `history` from index `at` on, through themselves."""
    if at is None:
        return []
    run = list(history[at:])
    for j in range(k):
        run.append(run[j])
    return run[len(history) - at :]


class _NgramIndex:
    """Every n-gram (`lo <= n <= hi`) of one growing history but its last position, mapped
    to where it last began: what `NgramDrafter.continuation` finds by a scan, by lookups.
    Built with C loops (`zip` of slices into `dict.update`) and extended by the positions a
    step appends; the history is append-only while a request decodes (a list that changed
    otherwise, or another list, is indexed anew)."""

    FEW = 8  # new windows indexed one by one; more in C loops (a prompt's, say)

    def __init__(self, history: Sequence[int], lo: int, hi: int) -> None:
        self.history = history
        self.lo, self.hi = lo, hi
        self.starts: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(lo, hi + 1)}
        self._longest_first = [(n, self.starts[n]) for n in range(hi, lo - 1, -1)]
        self.length = 0  # the history's length when last indexed: n's windows [0, length - n)
        self.last: object = None
        self.found: int | None = None  # the continuation at `length` (a step asks twice:
        # `available`, then `draft`)

    def follows(self, history: Sequence[int]) -> bool:
        """Whether `history` is the one indexed, grown by appends only (as far as a check of
        its length and the last token indexed can tell)."""
        n = self.length
        return (
            history is self.history
            and len(history) >= n
            and (n == 0 or history[n - 1] == self.last)
        )

    def continuation(self) -> int | None:
        h = self.history
        L = len(h)
        if L and self.length == L:
            return self.found
        if self.length == L - 1 and self.length > self.hi:
            # a decode step's one token: each n's one new window, no ranges or bounds
            for n, starts in self._longest_first:
                starts[tuple(h[L - 1 - n : L - 1])] = L - 1 - n
        else:
            self._index(h, L)
        self.length, self.last, self.found = L, (h[L - 1] if L else None), None
        for n, starts in self._longest_first:  # the longest n-gram that matched wins
            if n < L:
                at = starts.get(tuple(h[L - n :]))
                if at is not None:
                    self.found = at + n
                    break
        return self.found

    def _index(self, h: Sequence[int], L: int) -> None:
        """Every n's windows that end before position L - 1 and are not indexed yet."""
        for n, starts in self._longest_first:
            start, stop = max(0, self.length - n), L - n
            if stop - start > self.FEW:
                windows = zip(*(h[start + j : stop + j] for j in range(n)), strict=True)
                starts.update(zip(windows, range(start, stop), strict=True))
            else:  # a few new windows: slices of them, without zip's machinery
                for i in range(start, stop):
                    starts[tuple(h[i : i + n])] = i


@dataclass
class _Tail:
    """Trunk hidden states of one slot not yet fed to the MTP head.

    The slot's MTP entries `0 .. start-1` are true — entry t is (x_{t+1}, h_t) of the
    committed sequence; `hidden` holds h_start, h_start+1, ... in order.
    """

    start: int
    hidden: list[mx.array] = field(default_factory=list)
    n: int = 0


@dataclass
class _HostTail:
    """A slot's per-position arrays from `start` on, not yet fed to a drafter's model,
    for host memory: an MTP `_Tail`'s hidden states `[n, E]`, a DFlash `_Context`'s
    features `[n, T*E]`. Made as one device array, queued, not waited for (making it a
    host copy at once would wait for all the device has queued, a decode step queued
    ahead included); `settle` moves it to the host."""

    start: int
    n: int
    rows: np.ndarray | mx.array | None = None
    dtype: mx.Dtype = mx.float32

    @classmethod
    def of(cls, start: int, arrays: Sequence[mx.array]) -> _HostTail:
        if not arrays:
            return cls(start, 0)
        rows = mx.concatenate(list(arrays), axis=0)
        # float32 holds every float16 / bfloat16 value exactly.
        kept = rows.astype(mx.float32)
        mx.async_eval(kept)
        return cls(start, rows.shape[0], kept, rows.dtype)

    def settle(self) -> None:
        if isinstance(self.rows, mx.array):
            self.rows = np.array(self.rows)

    def arrays(self) -> list[mx.array]:
        """The rows back on the device, in their own dtype (as one array; none if n = 0)."""
        return [] if self.rows is None else [mx.array(self.rows).astype(self.dtype)]

    @property
    def nbytes(self) -> int:
        return 0 if self.rows is None else self.rows.nbytes


class MTPDrafter(Drafter):
    """Drafts with the model's MTP head, all slots of a step in one `runner.draft` per depth.

    Per slot it follows the trunk's post-norm hidden states (`observe`) from the first
    prefill chunk on (`begin`); a slot it has not followed from there gets no drafts.
    A step's first draft call catches the MTP KV up — one row per slot with tokens
    x_{t+1} and hiddens h_t for every position not fed yet, at position t — and its last
    row predicts the first draft token. Deeper drafts feed the head its own h' and token
    at the next position; those entries are provisional and are overwritten by the next
    catch-up, so the pool's MTP length never counts them past a step (`observe`
    truncates). Slots that do not draft this step ride along in the catch-up call when
    one runs anyway, or when one's backlog reaches `max_backlog` positions: that bounds
    the hidden states held per slot and the latency of a later catch-up, at the cost of
    one head forward over the backlog (about 1/n_layer of the trunk's work on it).

    After the catch-up, the draws and the deeper forwards of all slots run as one graph
    (`ModelRunner.draft_chain`): one evaluation and one trip to the host per step, not one
    per depth. Slots with penalties (which read the history the draft grows) or a logit
    bias instead draw depth by depth through `_sample`, as every slot does with
    `on_device=False`; both paths draw the same tokens from the same q and the same uniforms.
    """

    name = "mtp"

    def __init__(
        self,
        runner: ModelRunner,
        max_backlog: int = 256,
        on_device: bool = True,
        uniform: bool | None = None,
    ) -> None:
        if runner.model.mtp is None:
            raise ValueError(f"{runner.model.path}: this model has no MTP head to draft with")
        self.runner = runner
        self.max_backlog = max_backlog
        self.on_device = on_device
        # uniform shapes (default: a compiled runner on a GPU), so a round meets the same two
        # compiled shapes step after step (per batch width and past bucket), where ragged rows,
        # the widest backlog (what the slots accepted) and the deepest draft made new ones
        # nearly every step: every catch-up row as long as `width` of the longest (filler rolled
        # back), and the draft chain `depth` deep with every live slot a row (the draws past a
        # slot's depth, and those of a slot not drafting, read by nothing)
        self.uniform = uniform_shapes(runner) if uniform is None else uniform
        self._tails: dict[SlotId, _Tail] = {}

    def available(self, d: DecodingSlot, length: int) -> int:
        t = self._tails.get(d.slot)
        ok = t is not None and t.n > 0 and t.start + t.n == length == len(d.history) - 1
        return UNBOUNDED if ok else 0

    def needs_hidden(self, slot: SlotId) -> bool:
        return slot in self._tails

    def begin(self, slot: SlotId) -> None:
        self._tails[slot] = _Tail(0)

    def observe(self, slot: SlotId, start: int, hidden: mx.array, taps: mx.array | None) -> None:
        t = self._tails.get(slot)
        if t is None:
            return
        if t.start + t.n != start:  # a gap the head can never catch up over
            del self._tails[slot]
            return
        t.hidden.append(hidden)
        t.n += hidden.shape[0]
        self.runner.pool.truncate_mtp(slot, t.start)

    def release(self, slot: SlotId) -> None:
        self._tails.pop(slot, None)

    def export(self, slot: SlotId) -> DrafterState | None:
        t = self._tails.get(slot)
        return None if t is None else _HostTail.of(t.start, t.hidden)

    def adopt(self, slot: SlotId, state: DrafterState) -> None:
        if not isinstance(state, _HostTail):
            raise TypeError(f"slot {slot}: not an MTP drafter state: {type(state).__name__}")
        self._tails[slot] = _Tail(state.start, state.arrays(), state.n)

    def draft(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        self.caught_up = 0
        if not any(j.k for j in jobs) and not any(  # (checked first: the common step)
            t.n >= self.max_backlog for t in self._tails.values()
        ):
            return [NO_DRAFT] * len(jobs)
        live = [i for i, j in enumerate(jobs) if self.available(j.d, j.length)]
        backlog = any(self._tails[jobs[i].d.slot].n >= self.max_backlog for i in live)
        if not any(jobs[i].k for i in live) and not backlog:
            return [NO_DRAFT] * len(jobs)
        out = [Draft() for _ in jobs]
        rows = []
        for i in live:
            j = jobs[i]
            t = self._tails[j.d.slot]
            tokens = j.d.history[t.start + 1 : j.length + 1]
            rows.append(DraftRow(j.d.slot, tokens, mx.concatenate(t.hidden, axis=0), t.start))
            self._tails[j.d.slot] = _Tail(j.length)
        self.caught_up = max(len(r.tokens) for r in rows)
        drafted = self._catch_up(rows)
        caught = [
            _Chain(jobs[i], out[i], logits, hidden)
            for i, (logits, hidden) in zip(live, drafted, strict=True)
        ]
        chains = [c for c in caught if c.job.k]
        if self.on_device:
            self._chain([c for c in (caught if self.uniform else chains) if _drawn_on_device(c)])
            chains = [c for c in chains if not _drawn_on_device(c)]
        for depth in range(max((c.job.k for c in chains), default=0)):
            going = [c for c in chains if c.job.k > depth]
            if depth:  # feed back the head's own h' and token, one position further on
                rows = []
                for c in going:
                    assert c.hidden is not None
                    at = c.job.length + depth - 1
                    rows.append(DraftRow(c.job.d.slot, c.draft.tokens[-1:], c.hidden, at))
                for c, (logits, hidden) in zip(going, self.runner.draft(rows), strict=True):
                    c.logits, c.hidden = logits, hidden
            _sample(going)
        for c in chains:
            c.draft.q = mx.stack(c.qs)
        return out

    def precompile(self, max_draft: int) -> int:
        """With uniform rounds, the catch-up's two row lengths (`width`: a verify step's
        tokens, and `CHUNK`) and the draft chain of every depth `depth` makes, at every
        padded width and past bucket (`ModelRunner.precompile_mtp`)."""
        if not self.uniform or not max_draft:
            return 0
        depths = {self.depth(k) for k in range(1, max_draft + 1)}
        return self.runner.precompile_mtp([self.width(1), self.CHUNK], sorted(depths))

    def _catch_up(self, rows: list[DraftRow]) -> list[tuple[mx.array, mx.array]]:
        """Feed the head every row's tokens; per row its last position's (logits `[1, V]`,
        h' `[1, E]`). Uniform rounds run rows `width` long, filler after the real tokens
        (its entries truncated after), and a backlog longer than `CHUNK` in pieces of
        `CHUNK` (of `width(1)` where a chunk would pass the context): every catch-up has
        one of two row lengths, both precompiled. (One forward as long as the longest
        backlog — a prompt's, or what built up while "auto" drafted nothing — met a shape
        not compiled yet at nearly every occasion: on the H200, seconds each.)"""
        runner, context = self.runner, self.runner.pool.max_context
        if not self.uniform:
            return runner.draft(rows, [len(r.tokens) for r in rows])
        out: list[tuple[mx.array, mx.array] | None] = [None] * len(rows)
        done = [0] * len(rows)  # tokens of each row fed so far
        while True:
            left = [i for i, r in enumerate(rows) if done[i] < len(r.tokens)]
            if not left:
                break
            width = self.width(max(len(rows[i].tokens) - done[i] for i in left))
            if any(rows[i].start + done[i] + width > context for i in left):
                width = self.width(1)  # a chunk past the context: verify-sized pieces
            pieces, ends = [], []
            for i in left:
                r, at = rows[i], done[i]
                n = min(width, len(r.tokens) - at)
                pieces.append(
                    DraftRow(r.slot, r.tokens[at : at + n], r.hidden[at : at + n], r.start + at)
                )
                ends.append(n)
            padded = _padded(pieces, width, context)
            for i, piece, n, res in zip(
                left, padded, ends, runner.draft(padded, ends), strict=True
            ):
                if len(piece.tokens) > n:  # the filler's entries are not the head's to keep
                    runner.pool.truncate_mtp(piece.slot, piece.start + n)
                done[i] += n
                out[i] = res
        if None in out:  # (a row with no tokens: dropping it would misalign the rest)
            raise ValueError("MTP catch-up: a row with no tokens to feed")
        return cast(list[tuple[mx.array, mx.array]], out)

    CHUNK = 64  # the longest uniform catch-up row: a longer backlog is fed in pieces

    def width(self, n: int) -> int:
        """How long uniform catch-up rows are when the longest needs `n`: one verify step's
        most (the pool's capture depth + 1), else `CHUNK` (a backlog, in pieces)."""
        steady = self.runner.pool.max_draft + 1
        return steady if n <= steady else self.CHUNK

    def depth(self, k: int) -> int:
        """How deep a uniform draft chain draws when the deepest draft is `k`: the next power
        of two, at most the pool's capture depth — a few shapes, where a fixed depth would
        make a round of k = 1 pay for every depth (on a GPU, ~2 plain steps at K = 4)."""
        return min(1 << (k - 1).bit_length(), max(k, self.runner.pool.max_draft))

    def _chain(self, chains: list[_Chain]) -> None:
        """Draw every chain's whole draft in one `draft_chain`, each slot's k uniforms
        taken up front (the ones `_sample` would take depth by depth). A chain of k = 0
        (a uniform round's rider) draws nothing."""
        if not any(c.job.k for c in chains):
            return
        rows = []
        for c in chains:
            assert c.hidden is not None
            j = c.job
            u = j.d.rng.uniform(j.k) if j.k else np.zeros(0)
            rows.append(ChainRow(j.d.slot, c.logits, c.hidden, j.length, j.k, u))
        shaping = Shaping.of([c.job.d.params for c in chains])
        depth = self.depth(max(r.depth for r in rows)) if self.uniform else None
        drawn = self.runner.draft_chain(rows, shaping, depth)
        for c, (tokens, q) in zip(chains, drawn, strict=True):
            if c.job.k:
                c.draft.tokens, c.draft.q = tokens, q


def _padded(rows: list[DraftRow], width: int, context: int) -> list[DraftRow]:
    """Catch-up rows made `width` long (as far as the context has room): the last token and
    hidden state repeated. What the head computes for the filler is read by nothing."""
    out = []
    for r in rows:
        n = len(r.tokens)
        pad = max(0, min(width, context - r.start) - n)
        if pad:
            filler = mx.repeat(r.hidden[-1:], pad, axis=0)
            tokens = [*r.tokens, *[r.tokens[-1]] * pad]
            r = DraftRow(r.slot, tokens, mx.concatenate([r.hidden, filler], axis=0), r.start)
        out.append(r)
    return out


@dataclass
class _Context:
    """Target features of one slot not yet in the DFlash pool: the pool holds the context
    K/V of positions `0 .. start-1`; `features` the taps of `start`, `start+1`, ... in order."""

    start: int
    features: list[mx.array] = field(default_factory=list)
    n: int = 0


@dataclass(frozen=True)
class _HostContext:
    """A DFlash slot copied to host memory (`DFlashDrafter.export`): its context K and V
    `[layers, waiting.start, Hkv, D]` (`DFlashPool.snapshot`) and its waiting features."""

    k: np.ndarray
    v: np.ndarray
    waiting: _HostTail

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.waiting.nbytes

    def settle(self) -> None:
        self.waiting.settle()


class DFlashDrafter(Drafter):
    """Drafts a block per slot with a DFlash model, all slots of a step in one forward.

    Per slot it follows the trunk from the first prefill chunk on (`begin`): the outputs
    of the model's target layers at each committed position arrive through `observe` and
    wait there; a step that drafts first moves every followed slot's waiting features into
    its context K/V in the drafter's own pool (one batched projection), then runs the
    block `[pending, MASK, ...]` of every drafting slot in one forward. Drafts are drawn
    position by position from the block's logits, shaped like the target's p (penalties
    see the drafts before them), so exact acceptance applies as for the other drafters.
    Only committed positions ever reach the pool: a rejected draft leaves nothing to
    roll back. As for MTP, a slot's backlog of `max_backlog` positions is caught up even
    in steps that do not draft. `export` and `adopt` carry a slot's context K/V and
    waiting features through a prefix-cache snapshot.
    """

    name = "dflash"

    def __init__(self, runner: ModelRunner, model: DFlashModel, max_backlog: int = 256) -> None:
        if model.target is not runner.model:
            raise ValueError(f"{model.path}: the DFlash model was loaded for another target")
        self.runner, self.model, self.max_backlog = runner, model, max_backlog
        self.layers = model.config.target_layers
        self.pool = DFlashPool.like(model.config, runner.pool)
        self._contexts: dict[SlotId, _Context] = {}

    def available(self, d: DecodingSlot, length: int) -> int:
        c = self._contexts.get(d.slot)
        ok = c is not None and 0 < c.start + c.n == length == len(d.history) - 1
        return self.model.config.block_size - 1 if ok else 0

    def needs_hidden(self, slot: SlotId) -> bool:
        return slot in self._contexts

    def begin(self, slot: SlotId) -> None:
        self._contexts[slot] = _Context(0)
        self.pool.truncate(slot, 0)

    def observe(self, slot: SlotId, start: int, hidden: mx.array, taps: mx.array | None) -> None:
        c = self._contexts.get(slot)
        if c is None:
            return
        if taps is None or c.start + c.n != start:  # a gap: this slot can no longer draft
            del self._contexts[slot]
            return
        c.features.append(taps)
        c.n += taps.shape[0]

    def release(self, slot: SlotId) -> None:
        self._contexts.pop(slot, None)
        self.pool.truncate(slot, 0)

    def export(self, slot: SlotId) -> DrafterState | None:
        """The slot's state at the trunk's length (that of the pool snapshot taken with it):
        the context K/V of the positions before it the pool holds, the waiting features of
        the others; nothing of a position at or past it. None if the drafter does not
        follow the slot up to there."""
        c = self._contexts.get(slot)
        length = self.runner.pool.lengths[slot]
        if c is None or c.start + c.n < length:
            return None
        kept = min(c.start, length)
        k, v = self.pool.snapshot(slot, kept)
        waiting = [mx.concatenate(c.features)[: length - kept]] if length > kept else []
        return _HostContext(k, v, _HostTail.of(kept, waiting))

    def adopt(self, slot: SlotId, state: DrafterState) -> None:
        if not isinstance(state, _HostContext):
            raise TypeError(f"slot {slot}: not a DFlash drafter state: {type(state).__name__}")
        self.pool.restore(slot, state.k, state.v)
        w = state.waiting
        self._contexts[slot] = _Context(w.start, w.arrays(), w.n)

    def bytes_for(self, context_tokens: int) -> int:
        return self.pool.bytes_for(context_tokens)

    def draft(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        out = [Draft() for _ in jobs]
        self.caught_up = 0
        live = [(i, j) for i, j in enumerate(jobs) if self.available(j.d, j.length)]
        drafting = [(i, j) for i, j in live if j.k]
        backlog = any(self._contexts[j.d.slot].n >= self.max_backlog for _, j in live)
        if drafting or backlog:
            self.catch_up([j.d.slot for _, j in live])
        if not drafting:
            return out
        slots = [j.d.slot for _, j in drafting]
        logits = self.model(
            mx.array([j.d.pending for _, j in drafting], dtype=mx.int32),
            mx.array([j.length for _, j in drafting], dtype=mx.int32),
            self.pool.read(slots),
            mx.array([self.pool.lengths[s] for s in slots], dtype=mx.int32),
        )
        chains = [_Chain(j, out[i], logits[n, 1:2]) for n, (i, j) in enumerate(drafting)]
        for depth in range(max(j.k for _, j in drafting)):
            going = [(n, c) for n, c in enumerate(chains) if c.job.k > depth]
            for n, c in going:
                c.logits = logits[n, depth + 1 : depth + 2]
            _sample([c for _, c in going])
        for c in chains:
            c.draft.q = mx.stack(c.qs)
        return out

    def catch_up(self, slots: Sequence[SlotId]) -> None:
        """Move the waiting features of `slots` into their context K/V, in one projection."""
        waiting = [(s, self._contexts[s]) for s in slots if self._contexts[s].n]
        if not waiting:
            return
        self.caught_up = max(c.n for _, c in waiting)
        features = mx.concatenate([f for _, c in waiting for f in c.features], axis=0)
        positions = mx.concatenate([mx.arange(c.start, c.start + c.n) for _, c in waiting])
        self.pool.write(
            [s for s, _ in waiting],
            [c.start for _, c in waiting],
            [c.n for _, c in waiting],
            self.model.context(features, positions),
        )
        for s, c in waiting:
            self._contexts[s] = _Context(c.start + c.n)


@dataclass
class _Chain:
    """One slot's draft in the making: the drafter's logits for the next token `[1, V]`
    (and for MTP its h' `[1, E]`)."""

    job: DraftJob
    draft: Draft
    logits: mx.array
    hidden: mx.array | None = None
    qs: list[mx.array] = field(default_factory=list)


def _drawn_on_device(c: _Chain) -> bool:
    """Whether `Shaping` makes the chain's q: its logits are not adjusted (a penalty reads
    the history the draft grows; `Shaping` does not carry a logit bias)."""
    return c.job.d.params.unadjusted


def _sample(chains: list[_Chain]) -> None:
    """Draw each chain's next draft token from q, shaped exactly as the target's p will be."""
    ds = [c.job.d for c in chains]
    params = [d.params for d in ds]
    history = [
        d.history + c.draft.tokens if d.params.penalized else []
        for d, c in zip(ds, chains, strict=True)
    ]
    logits = adjust_logits(mx.concatenate([c.logits for c in chains]), params, history)
    q = distribution(logits, params)
    tokens = np.array(draw(q, np.array([d.rng.uniform(1)[0] for d in ds])))
    for row, c in enumerate(chains):
        c.draft.tokens.append(int(tokens[row]))
        c.qs.append(q[row])
