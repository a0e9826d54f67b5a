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
  slots through `ModelRunner.draft`, chained up to K by feeding its own h' back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx
import numpy as np

from engine.cache import SlotId
from engine.runner import DraftRow, ModelRunner
from engine.sampling import adjust_logits, distribution, draw

if TYPE_CHECKING:
    from engine.spec.speculator import DecodingSlot

UNBOUNDED = 1 << 30  # `available` of a drafter that can extend a draft indefinitely


@dataclass(frozen=True)
class DraftJob:
    """One slot of a step for a drafter: draft `k` tokens (0: none) after `d.pending`.

    `length` is the slot's trunk length; `d.pending` will sit at that position.
    """

    d: DecodingSlot
    k: int
    length: int


@dataclass
class Draft:
    """Proposed tokens and, per token, the distribution it was drawn from (`[k, V]`)."""

    tokens: list[int] = field(default_factory=list)
    q: mx.array | None = None  # None: each token is a point mass


class DrafterState(Protocol):
    """A drafter's state for one slot, as `Drafter.export` returns it."""

    @property
    def nbytes(self) -> int: ...


class Drafter:
    """Base of all drafters; stateless drafters keep the no-op hooks."""

    name = ""

    def available(self, d: DecodingSlot, length: int) -> int:
        raise NotImplementedError

    def draft(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        raise NotImplementedError

    def begin(self, slot: SlotId) -> None:
        """A new sequence starts in `slot` (its first prefill chunk is about to run)."""

    def needs_hidden(self, slot: SlotId) -> bool:
        """Whether the slot's rows must return the trunk's hidden states for `observe`."""
        return False

    def observe(self, slot: SlotId, start: int, hidden: mx.array) -> None:
        """The trunk committed positions `start ..` of `slot` with these hidden states."""

    def release(self, slot: SlotId) -> None:
        """The slot's sequence ended; forget it."""

    def export(self, slot: SlotId) -> DrafterState | None:
        """What the drafter keeps for `slot`, to `adopt` in a slot restored from the same
        pool snapshot (None: nothing)."""
        return None

    def adopt(self, slot: SlotId, state: DrafterState) -> None:
        """Follow `slot` from a state `export` returned (its pool state was restored)."""


class NgramDrafter(Drafter):
    """Prompt lookup: continue the latest earlier occurrence of the history's last n tokens.

    The longest n in `max_ngram .. min_ngram` with a match wins. The continuation runs on
    through the draft itself, so a history ending in a loop drafts the loop for any K.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def available(self, d: DecodingSlot, length: int) -> int:
        return UNBOUNDED if self.continuation(d.history) is not None else 0

    def draft(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        return [Draft(self.propose(j.d.history, j.k)) if j.k else Draft() for j in jobs]

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
        at = self.continuation(history)
        if at is None:
            return []
        run = list(history[at:])
        for j in range(k):
            run.append(run[j])
        return run[len(history) - at :]


@dataclass
class _Tail:
    """Trunk hidden states of one slot not yet fed to the MTP head.

    The slot's MTP entries `0 .. start-1` are true — entry t is (x_{t+1}, h_t) of the
    committed sequence; `hidden` holds h_start, h_start+1, ... in order.
    """

    start: int
    hidden: list[mx.array] = field(default_factory=list)
    n: int = 0


@dataclass(frozen=True)
class _HostTail:
    """A `_Tail` copied to host memory (`MTPDrafter.export`): hidden states `[n, E]`."""

    start: int
    n: int
    hidden: np.ndarray | None = None
    dtype: mx.Dtype = mx.float32

    @property
    def nbytes(self) -> int:
        return 0 if self.hidden is None else self.hidden.nbytes


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
    """

    name = "mtp"

    def __init__(self, runner: ModelRunner, max_backlog: int = 256) -> None:
        if runner.model.mtp is None:
            raise ValueError(f"{runner.model.path}: this model has no MTP head to draft with")
        self.runner = runner
        self.max_backlog = max_backlog
        self._tails: dict[SlotId, _Tail] = {}

    def available(self, d: DecodingSlot, length: int) -> int:
        t = self._tails.get(d.slot)
        ok = t is not None and t.n > 0 and t.start + t.n == length == len(d.history) - 1
        return UNBOUNDED if ok else 0

    def needs_hidden(self, slot: SlotId) -> bool:
        return slot in self._tails

    def begin(self, slot: SlotId) -> None:
        self._tails[slot] = _Tail(0)

    def observe(self, slot: SlotId, start: int, hidden: mx.array) -> None:
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
        if t is None:
            return None
        if not t.hidden:
            return _HostTail(t.start, t.n)
        hidden = mx.concatenate(t.hidden, axis=0)
        # To host memory; float32 holds every float16 / bfloat16 value exactly.
        return _HostTail(t.start, t.n, np.array(hidden.astype(mx.float32)), hidden.dtype)

    def adopt(self, slot: SlotId, state: DrafterState) -> None:
        if not isinstance(state, _HostTail):
            raise TypeError(f"slot {slot}: not an MTP drafter state: {type(state).__name__}")
        hidden = [] if state.hidden is None else [mx.array(state.hidden).astype(state.dtype)]
        self._tails[slot] = _Tail(state.start, hidden, state.n)

    def draft(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        out = [Draft() for _ in jobs]
        live = [i for i, j in enumerate(jobs) if self.available(j.d, j.length)]
        backlog = any(self._tails[jobs[i].d.slot].n >= self.max_backlog for i in live)
        if not any(jobs[i].k for i in live) and not backlog:
            return out
        rows = []
        for i in live:
            j = jobs[i]
            t = self._tails[j.d.slot]
            tokens = j.d.history[t.start + 1 : j.length + 1]
            rows.append(DraftRow(j.d.slot, tokens, mx.concatenate(t.hidden, axis=0), t.start))
            self._tails[j.d.slot] = _Tail(j.length)
        chains = [
            _Chain(jobs[i], out[i], logits[-1:], hidden[-1:])
            for i, (logits, hidden) in zip(live, self.runner.draft(rows), strict=True)
            if jobs[i].k
        ]
        for depth in range(max((c.job.k for c in chains), default=0)):
            going = [c for c in chains if c.job.k > depth]
            if depth:  # feed back the head's own h' and token, one position further on
                rows = [
                    DraftRow(c.job.d.slot, c.draft.tokens[-1:], c.hidden, c.job.length + depth - 1)
                    for c in going
                ]
                for c, (logits, hidden) in zip(going, self.runner.draft(rows), strict=True):
                    c.logits, c.hidden = logits, hidden
            _sample(going)
        for c in chains:
            c.draft.q = mx.stack(c.qs)
        return out


@dataclass
class _Chain:
    """One slot's draft in the making: the head's latest logits `[1, V]` and h' `[1, E]`."""

    job: DraftJob
    draft: Draft
    logits: mx.array
    hidden: mx.array
    qs: list[mx.array] = field(default_factory=list)


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
