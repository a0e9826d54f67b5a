"""One request's life inside the scheduler: slot, progress, output, text, timings.

A `Sequence` moves WAITING -> PREFILL -> DECODE and ends DONE. Tokens arrive in two
beats: `commit` (right after the step, on the token ids alone: stop tokens,
max_tokens) decides whether the sequence runs in the next step; `take_delta`
(possibly while the next step already runs) turns them into text, applies stop
strings and builds the `Delta`.

Threads: the step thread reads `prompt`, `prefilled` and `decoding`, draws from `rng`
and sets `slot` on admission; meanwhile the loop touches only what publishing needs
(the unpublished tokens, text state, `output`, timings, `ending`, `phase`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING

from engine.cache import SlotId
from engine.sampling import RequestRng
from engine.spec.speculator import DecodingSlot
from engine.spec.speculator import SpecStats as SpecRecord
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from scheduler.handle import Outlet
from scheduler.outcome import (
    Delta,
    Finished,
    FinishReason,
    SpecStats,
    Timings,
    TokenLogprob,
    Usage,
)
from scheduler.request import Prepared
from scheduler.stop import StopMatcher

_new_tuple = tuple.__new__

if TYPE_CHECKING:
    from scheduler.prefix_cache import CachedPrefix
    from scheduler.prefix_reuse import SlotImage


class Phase(Enum):
    WAITING = auto()
    PREFILL = auto()
    DECODE = auto()
    DONE = auto()


_DONE = Phase.DONE  # (read per row: an enum member off its class costs ~70 ns in 3.11)


@dataclass(eq=False, slots=True)  # (slots: a step reads a dozen attributes of every sequence)
class Sequence:
    prepared: Prepared
    events: Outlet  # where its Deltas and its Finished go
    tokenizer: Tokenizer
    submitted_at: float
    reserved_bytes: int
    rng: RequestRng
    phase: Phase = Phase.WAITING
    slot: SlotId | None = None
    prefilled: int = 0  # prompt tokens already in the slot
    decoding: DecodingSlot | None = None
    output: list[int] = field(default_factory=list)  # committed tokens, as published
    ending: FinishReason | None = None  # decided by the tokens; published after them
    matched_stop: str | int | None = None
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    itl_max_s: float = 0.0
    spec: SpecRecord = field(default_factory=SpecRecord)  # recorded from each step's Committed
    plain_steps: int = 0  # steps without drafts not yet in `spec` (counted there at the end)
    # Prefix reuse (`scheduler.prefix_reuse`): the cached prefix to restore on admission,
    # the prompt tokens it saved, where to snapshot the prompt, the snapshots taken so far.
    restore: CachedPrefix[SlotImage] | None = None
    cached_tokens: int = 0
    snapshot_at: tuple[int, ...] = ()
    images: list[SlotImage] = field(default_factory=list)
    _unpublished: list[int] = field(default_factory=list)
    _logprobs: list[TokenLogprob] = field(default_factory=list)
    # Set from the above when made (read per step: attributes of their own, not chains)
    id: str = field(init=False)
    stop_ids: frozenset[int] = field(init=False)
    detok: IncrementalDetokenizer = field(init=False)
    stops: StopMatcher = field(init=False)
    stop_strings: bool = field(init=False)  # there are stop strings to look for

    def __post_init__(self) -> None:
        self.id = self.prepared.request_id
        self.stop_ids = self.prepared.stop_ids
        self.detok = self.tokenizer.detokenizer()
        self.stops = StopMatcher(self.prepared.request.stop)
        self.stop_strings = self.stops.active

    @property
    def prompt(self) -> list[int]:
        return self.prepared.prompt

    @property
    def live(self) -> bool:
        """Still running: neither ended by its tokens nor finished."""
        return self.phase is not _DONE and self.ending is None

    def next_chunk_limit(self) -> int:
        """Prompt tokens the next prefill chunk may take: up to the next snapshot boundary."""
        end = len(self.prompt)
        return (
            min((b for b in self.snapshot_at if b > self.prefilled), default=end) - self.prefilled
        )

    def commit(self, tokens: list[int], logprobs: list[TokenLogprob]) -> None:
        """Take a step's tokens: stop at a stop token or at max_tokens (dropping the rest),
        and advance the decode state when the sequence goes on (`remaining` keeps the
        Speculator from drafting past max_tokens)."""
        room = max(0, self.prepared.max_tokens - len(self.output) - len(self._unpublished))
        kept = tokens[:room] if len(tokens) > room else tokens
        stop_ids = self.stop_ids
        if stop_ids and not stop_ids.isdisjoint(kept):
            for i, t in enumerate(kept):
                if t in stop_ids:
                    kept = kept[: i + 1]
                    self.ending, self.matched_stop = FinishReason.STOP, t
                    break
        if self.ending is None and len(kept) >= room:
            self.ending = FinishReason.LENGTH
        self._unpublished += kept
        if logprobs:
            self._logprobs += logprobs[: len(kept)]
        decoding = self.decoding
        if decoding is not None and self.ending is None:
            decoding.history += kept
            decoding.pending = kept[-1]
            decoding.remaining = room - len(kept)

    def take_delta(self, now: float, final: bool = False) -> Delta | None:
        """The committed, unpublished tokens as a Delta (None if there is nothing new).

        Stop tokens print nothing; a stop string that completes ends the sequence
        (`ending`) and drops the tokens after the one that completed it. When the
        sequence ends (`ending` set, or `final`) other than by a stop string, the
        held-back text is released.
        """
        tokens, lps = self._unpublished, self._logprobs
        if final or self.ending is not None or self.stop_strings:
            tokens, text = self._text_at_end_or_stops(tokens, final)
            lps = lps[: len(tokens)]
        elif tokens:  # the common case: the text is the tokens' text
            text = self.detok.push_all(tokens, self.stop_ids)
        else:
            return None
        self._unpublished = []
        if self._logprobs:
            self._logprobs = []
        if tokens:
            last = self.last_token_at
            if last is None:
                self.first_token_at = now
            elif now - last > self.itl_max_s:
                self.itl_max_s = now - last
            self.last_token_at = now
            self.output += tokens
        elif not text:
            return None
        # (the NamedTuple's own __new__ is Python code; this builds the same tuple in C)
        return _new_tuple(Delta, (self.id, tuple(tokens), text, tuple(lps) if lps else ()))

    def _text_at_end_or_stops(self, tokens: list[int], final: bool) -> tuple[list[int], str]:
        """`take_delta` with stop strings to look for, or at the end: (the tokens kept, text)."""
        stop_ids, push = self.stop_ids, self.detok.push
        text: list[str] = []
        n = len(tokens)
        if not self.stop_strings:
            text.append(self.detok.push_all(tokens, stop_ids))
        else:
            for i, t in enumerate(tokens):
                if t in stop_ids:
                    continue
                safe, stop = self.stops.push(push(t))
                text.append(safe)
                if stop is not None:
                    self.ending, self.matched_stop = FinishReason.STOP, stop
                    n = i + 1
                    break
        if (final or self.ending is not None) and not isinstance(self.matched_stop, str):
            safe, stop = self.stops.push(self.detok.flush())
            text.append(safe if stop is not None else safe + self.stops.flush())
            if stop is not None:
                self.ending, self.matched_stop = FinishReason.STOP, stop
        return tokens[:n] if n < len(tokens) else tokens, "".join(text)

    def finished(self, reason: FinishReason, now: float, error: str | None = None) -> Finished:
        """The terminal event; the sequence is DONE afterwards."""
        self.phase = Phase.DONE
        if self.plain_steps:
            self.spec.record_plain(self.plain_steps)
            self.plain_steps = 0
        first, last, n = self.first_token_at, self.last_token_at, len(self.output)
        t0 = self.submitted_at
        itl = (last - first) / (n - 1) if first is not None and last is not None and n > 1 else None
        return Finished(
            request_id=self.id,
            reason=reason,
            usage=Usage(len(self.prompt), n, self.cached_tokens),
            timings=Timings(
                queued_s=(self.admitted_at if self.admitted_at is not None else now) - t0,
                ttft_s=None if first is None else first - t0,
                itl_mean_s=itl,
                itl_max_s=self.itl_max_s if n > 1 else None,
                total_s=now - t0,
            ),
            spec=SpecStats.of(self.spec),
            matched_stop=self.matched_stop if reason == FinishReason.STOP else None,
            error=error,
        )


def commit_plain_step(
    seqs: list[Sequence],
    tokens: list[int],
    logprobs: list[list[TokenLogprob]] | None,
    committed: list[Sequence],
) -> None:
    """A step without drafts committed `tokens[i]` (and `logprobs[i]`) for `seqs[i]`: each
    sequence still live counts the plain step, `commit`s its token and joins `committed`.

    One call for the step, not one per sequence (a step at 1,024 rows): a token that
    neither stops the sequence nor fills its room, without log-probabilities, is taken here
    without `commit`'s general machinery, to the same effect."""
    if logprobs is not None:  # (some asked for log-probabilities: the general path for all)
        for seq, token, lps in zip(seqs, tokens, logprobs, strict=True):
            if seq.live:
                seq.plain_steps += 1
                seq.commit([token], lps)
                committed.append(seq)
        return
    for seq, token in zip(seqs, tokens, strict=True):
        if seq.ending is not None or seq.phase is _DONE:  # (not live)
            continue
        seq.plain_steps += 1
        decoding = seq.decoding
        # `room` as `commit` counts it (max_tokens less the tokens committed so far), which
        # the last commit left in `remaining`; None before the first commit
        room = None if decoding is None else decoding.remaining
        if room is None or room <= 1 or token in seq.stop_ids:
            seq.commit([token], [])
        else:
            assert decoding is not None  # (room is not None)
            seq._unpublished.append(token)
            decoding.history.append(token)
            decoding.pending = token
            decoding.remaining = room - 1
        committed.append(seq)
