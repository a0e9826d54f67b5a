"""The cost controller: how many tokens each slot drafts this step (0 included).

It predicts a step's time and its committed tokens for each candidate depth and
picks the one with the least time per committed token — so speculation is judged
against plain decode at the current batch width by measured seconds, not by
acceptance rate alone.

* Time: a table of measured step cycles (plan → step → resolve, drafting
  included) per batch width B and step depth D — the deepest draft in the step.
  Depth, not the number of draft tokens, is what a step pays for first: rows are
  padded to the longest, verify rows take the stepwise recurrence, and each MTP
  depth is one more head forward for all slots together. Entries are
  exponentially weighted averages; a sample is clipped to `clip` (2) times the
  entry so one compile or page-fault stall does not swing them (a depth's first
  sample is taken as it is: what preceded it was a guess). A depth not
  measured yet at this width is interpolated linearly between measured depths;
  past the deepest one it is taken at the deepest's price. A width that
  has measured only plain decode borrows a nearby width's drafting costs (within
  a factor of two of it, the nearest), relative to that width's plain step: a
  batch that lost or gained a slot does not pay for probing again. With nothing
  to borrow, drafting is taken to cost nothing — so it gets tried.
* Probing: a width drafts at most one depth past the deepest it has measured
  (or borrowed; a doubted depth, below, does not count), so the first try of a
  drafter is its cheapest step (D = 1), not its most expensive — on a device
  where a draft of 4 costs five plain steps, a full-depth probe that does not
  pay costs two of those (the first, catching the drafter up, is not timed).
  Taking the next depth at the deepest's price walks a drafter whose round
  costs about the same at any depth (MTP's head on a small model: catch-up and
  chain are launches) up to the depth that pays, one probe at a time, where a
  line through the costs so far would have stopped at a draft of 1 that does
  not.
* Tokens: a slot drafting k commits 1 + a + a^2 + ... + a^k on average, where a is
  its per-token acceptance rate with that drafter: (accepted + 1) / (tried + 1)
  over exponentially decayed counts of its draft tokens — optimistic (1) while
  there is no evidence, so an untried drafter gets tried. A new request starts
  from what the drafter did for earlier ones (their pooled counts, worth at most
  `prior_weight` draft tokens), so a drafter that never pays is not re-tried in
  full by every request.
* Choice: every "auto" slot whose rate is at least `min_rate` drafts
  min(D, its cap); D is the depth with the most expected tokens per second. A
  width with no plain measurement runs plain first.
* Recovery: while a slot could draft but does not, its counts fade by `idle_decay`
  a step, so its rate drifts back up until drafting looks worth a try again. A
  width that has not run plain for `remeasure_every` steps runs plain once to
  re-measure. The first drafting depth past the deepest a width has in use (run
  twice in the last `remeasure_every` steps: a probe runs once), once not run for
  as many steps, is doubted: its excess over plain decode is halved (again each
  time as many steps pass without it), and its next sample replaces it instead of
  being averaged in; a sample dearer than the halved guess doubles the wait for
  its next doubt (up to 16x). One slow sample — a pause of the host, another
  process on the device; the speculator already leaves out a drafter's catch-up
  and a step that compiled a new batch shape — so does not bar a depth for good,
  while a dear depth is re-tried ever more rarely, and at its cheapest.
* Exploration credit: drafting that resumes after a plain stretch — a rate faded back
  up, a doubted depth re-tried — is what "auto" pays to find out whether drafting pays
  again, and where it does not it is all loss: on the H200 at N = 8 (MTP, demo model)
  every re-try cost 3-4 plain steps, its first step also catching the head up on the
  whole stretch (an untimed step of ~8 ms), and re-tries every few dozen steps left
  "auto" at 0.81x plain decode. So every step observed is charged its regret against a
  credit — a drafting step what it took beyond what plain decode would have taken for
  the tokens it committed (the width's plain step x (1 + accepted / width); negative
  where drafting paid), a plain step nothing — and every step earns `explore` (5%) of
  its time. A step may start drafting after a plain one only while the credit is not
  below zero; a step after a drafting one is not held back (the depths and rates judge
  it). The credit is held within +-`credit_steps` plain steps' earnings: a long run of
  paying drafts does not fund a long run of losing re-tries, nor one costly step bar
  drafting for longer than that. So where drafting never pays, re-tries lose at most
  about `explore` of the time; where it pays, the credit stays up and nothing waits.
  Steps with "on" slots drafting are not charged (their drafts are not a choice).
* Stalls: a sample over `stall` (4) times what was expected — the entry, the
  guess the depth was chosen by, or for a width's first plain step the nearest
  width's — is left out, unless the same width and depth stalls again at its
  next sample (then it is what the depth costs); a sample under a quarter of its
  entry replaces it. The controller's very first step, with nothing to judge it
  by, is followed by a plain one. On the H200 the warm-up steps after start fed the table
  plain steps of 3.9 s and drafts of 65 ms and 2.1 s where steady ones took
  2-6 ms (shapes precompiled and no forward cold: kernels the device built at
  first use, say); taken as they came, one barred MTP at N = 8 for good, another
  n-gram drafts of 4, and a plain step's made drafting look free until many
  re-measures had averaged it down.
  Until session 22 a stall was 8x and the clip 4x: on a shared 2-core CPU a plain step of
  147 ms among steps of 25-35 ms (N = 8, a pause of the host) passed as a sample and moved
  the plain entry to 50 ms, so drafts of 61-122 ms looked cheap beside it and paid off
  against the credit; MTP "auto" ran at 0.87x plain decode there. `bench/controller_sim.py`'s
  world of such pauses (one step in 50 five times as long, drafting never paying) ran
  1.22-1.27x plain decode's time per token with 8x / 4x, 1.004-1.006x with 4x / 2x, the
  other worlds as before. (A first probe dearer than 4x the depth below it, priced at
  that depth, is left out once and probed again: in the world where a draft of 1 costs
  5 plain steps, 1.005x either way. Left out at 8x only, a pause during a depth's first
  sample became its entry: with the pauses, one slot where depth 4 pays stopped drafting,
  1.20x the best depth's time per token.)
  (Forgetting a stale depth instead, as before session 15, made every re-try a
  full-depth probe: "auto" at N = 8 on the demo model ran at 0.51x plain decode on
  the H200, and its trace on a CPU showed such probes after every forgetting and
  at every new batch width.)

Modes per slot: "off" never drafts, "on" always drafts its full cap (so a seeded
request replays exactly), "auto" follows the controller.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from engine.cache import SlotId

MODES = ("off", "on", "auto")


class Offer(NamedTuple):
    """What one slot could draft this step: up to `cap` tokens from `drafter` ("" = none).
    (A NamedTuple: every decoding slot makes one per step.)"""

    slot: SlotId
    drafter: str
    cap: int
    mode: str = "auto"


@dataclass
class _Rate:
    """Decayed counts of accepted and tried draft tokens; a = (accepted + 1) / (tried + 1)."""

    accepted: float = 0.0
    tried: float = 0.0

    def update(self, drafted: int, accepted: int, decay: float) -> None:
        self.fade(decay)
        self.accepted += accepted
        self.tried += accepted + (1 if accepted < drafted else 0)

    def fade(self, decay: float) -> None:
        self.accepted *= decay
        self.tried *= decay

    def scaled(self, tried: float) -> _Rate:
        """The same rate from counts worth at most `tried` draft tokens."""
        s = min(1.0, tried / self.tried) if self.tried else 1.0
        return _Rate(self.accepted * s, self.tried * s)

    @property
    def value(self) -> float:
        return (self.accepted + 1.0) / (self.tried + 1.0)


@dataclass
class CostController:
    """Chooses per-slot draft depths from measured step times (see the module docstring).

    `smoothing`: weight of a new time sample; `decay`: per-round decay of acceptance counts
    (0.9 remembers about ten rounds: enough to ride out a few unlucky rejections); `stall`:
    how many times what was expected a step may take before it is taken for a stall; `clip`:
    how far above an entry one sample may pull it.
    """

    smoothing: float = 0.2
    decay: float = 0.9
    min_rate: float = 0.1
    prior_weight: float = 8.0
    idle_decay: float = 0.98
    remeasure_every: int = 64
    stall: float = 4.0  # a sample this many times what was expected is a stall, unless repeated
    clip: float = 2.0  # a sample moves an entry as if it were at most this many times it
    explore: float = 0.05  # share of every step's time earned as credit for re-tries
    credit_steps: float = 512.0  # the credit's bound: what this many plain steps earn
    credit: float = 0.0  # seconds re-tries may still lose (see the module docstring)
    held: int = 0  # steps kept plain for want of credit
    _accepted: int = 0  # draft tokens the rounds of the step chosen last accepted so far
    _drafting: bool = False  # the step chosen last drafted on an "auto" slot
    _charged: bool = True  # whether the step chosen last is charged (no "on" slot drafted)
    seconds: dict[int, dict[int, float]] = field(default_factory=dict)  # width -> depth -> s
    _rates: dict[tuple[SlotId, str], _Rate] = field(default_factory=dict)
    _pooled: dict[str, _Rate] = field(default_factory=dict)  # per drafter, all slots
    _steps: dict[int, int] = field(default_factory=dict)  # steps observed per width
    # (width, depth) -> the width's step count when that depth last ran
    _measured_at: dict[tuple[int, int], int] = field(default_factory=dict)
    _measured_before: dict[tuple[int, int], int] = field(default_factory=dict)  # the run before
    # (width, depth) -> the width's step count when it was halved, of depths not run since
    _doubted: dict[tuple[int, int], int] = field(default_factory=dict)
    _waits: dict[tuple[int, int], int] = field(default_factory=dict)  # (width, depth) -> steps
    stalls: int = 0  # samples left out as stalls
    _stalled: set[tuple[int, int]] = field(default_factory=set)  # (width, depth): last a stall

    def rate(self, slot: SlotId, drafter: str) -> float:
        """Estimated chance that the slot's next draft token from `drafter` is accepted."""
        return self._rate(slot, drafter).value

    def _rate(self, slot: SlotId, drafter: str) -> _Rate:
        key = (slot, drafter)
        if key not in self._rates:
            pooled = self._pooled.get(drafter)
            self._rates[key] = pooled.scaled(self.prior_weight) if pooled else _Rate()
        return self._rates[key]

    def predict(self, width: int, depth: int) -> float | None:
        """Seconds of a step of `width` slots whose deepest draft is `depth` (None: unknown)."""
        return self._predict(width, depth, self._source(width))

    def _predict(self, width: int, depth: int, source: int) -> float | None:
        """`predict`, from the drafting costs of width `source` (`_source`)."""
        table = self.seconds.get(width, {})
        if depth in table or 0 not in table:
            return table.get(depth)
        if source == width:
            return _interpolate(table, depth)
        other = self.seconds[source]  # a nearby width's costs, scaled by the plain steps
        return table[0] * _interpolate(other, depth) / other[0]

    def _source(self, width: int) -> int:
        """The width whose drafting costs a step of `width` is judged by: its own once it has
        measured plain decode and a drafting depth (or nothing: then nothing is predicted);
        with plain decode only, the nearest width within a factor of two that has both (the
        wider on a tie), else its own (drafting then looks free)."""
        if len(self.seconds.get(width, {})) != 1 or 0 not in self.seconds[width]:
            return width
        near = [
            w
            for w, t in self.seconds.items()
            if w != width and 0 in t and len(t) > 1 and w <= 2 * width and width <= 2 * w
        ]
        nearest = _nearest(width, near)
        return width if nearest is None else nearest

    def _reach(self, width: int, source: int) -> int:
        """The deepest draft a step of `width` may try: one past the deepest the width whose
        costs it goes by (`_source`) has measured (a doubted depth is a guess, not a
        measurement)."""
        known = [d for d in self.seconds.get(source, {}) if (source, d) not in self._doubted]
        return max(known, default=0) + 1

    def _doubt_stale(self, width: int) -> None:
        """Halve the excess over plain decode of the width's first drafting depth past the
        deepest it has in use (run twice within `remeasure_every` steps), once that depth
        has gone unrun (or unrun since it was last halved) for its wait, and let its next
        sample replace it (plain decode is re-measured on its own schedule)."""
        table = self.seconds.get(width, {})
        if 0 not in table:
            return
        now = self._steps.get(width, 0)

        def runs(d: int) -> bool:  # in use: run twice lately (a probe runs once)
            before = self._measured_before.get((width, d))
            return not d or (before is not None and now - before < self.remeasure_every)

        past = [d for d in table if d > max(filter(runs, table))]
        if not past:
            return
        d = min(past)
        since = max(self._measured_at.get((width, d), now), self._doubted.get((width, d), 0))
        if now - since >= self._wait(width, d):
            table[d] = table[0] + max(0.0, table[d] - table[0]) / 2
            self._doubted[width, d] = now

    def _wait(self, width: int, depth: int) -> int:
        """Steps a drafting depth goes unrun at a width before it is doubted."""
        return self._waits.get((width, depth), self.remeasure_every)

    def _age(self, width: int, depth: int) -> int:
        """Steps of `width` since one of depth `depth` ran (0 if none has)."""
        now = self._steps.get(width, 0)
        return now - self._measured_at.get((width, depth), now)

    def choose(self, offers: Sequence[Offer]) -> list[int]:
        """Draft depth per offer for a step whose batch width is `len(offers)`."""
        width = len(offers)
        self._doubt_stale(width)
        ks = [o.cap if o.mode == "on" else 0 for o in offers]
        auto = [i for i, o in enumerate(offers) if o.mode == "auto" and o.cap > 0]
        # the controller's very first step had nothing to judge it by (a stall?): plain again
        first = len(self._steps) == 1 and self._steps.get(width) == 1
        stale = (first or self._age(width, 0) >= self.remeasure_every) and not any(ks)
        self._accepted, self._charged = 0, not any(ks)
        if auto and 0 in self.seconds.get(width, {}) and not stale:
            if self._drafting or self.credit >= 0:
                ks = self._deepen(offers, ks, auto)
            else:  # a re-try after a plain stretch, with the credit spent: plain
                self.held += 1
        self._drafting = False
        for i in auto:
            if ks[i] == 0:
                self._rate(offers[i].slot, offers[i].drafter).fade(self.idle_decay)
            else:
                self._drafting = True
        return ks

    def _deepen(self, offers: Sequence[Offer], ks: list[int], auto: list[int]) -> list[int]:
        """The depths with the most expected tokens per predicted second. Per step: O(slots)
        to read the rates and tabulate each slot's tokens at every depth, then a vector sum a
        depth (Python per slot and depth cost ~4 ms a step at 1,024 slots)."""
        width = len(offers)
        rates = np.array([self.rate(o.slot, o.drafter) for o in offers])
        caps = np.array([o.cap for o in offers])
        joining = np.array([i for i in auto if rates[i] >= self.min_rate], dtype=np.int64)
        source = self._source(width)
        deepest = max(max(ks), min(int(caps[auto].max()), self._reach(width, source)))
        # committed[i, k]: slot i's expected tokens with k drafts, 1 + a + ... + a^k
        powers = rates[:, None] ** np.arange(deepest + 1)
        committed = np.cumsum(powers, axis=1)
        rows = np.arange(width)
        best, best_rate = np.array(ks), -1.0
        for depth in range(max(ks), deepest + 1):
            trial = np.array(ks)
            if depth:
                trial[joining] = np.minimum(depth, caps[joining])
            seconds = self._predict(width, int(trial.max()), source)
            assert seconds is not None  # plain decode is measured, so every depth predicts
            rate = float(committed[rows, trial].sum()) / max(seconds, 1e-9)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = trial, rate
        return [int(k) for k in best]

    def observe_step(self, width: int, depth: int, seconds: float) -> None:
        """A step of `width` decoding slots whose deepest draft was `depth` took `seconds`."""
        expected = self._expected(width, depth)
        stalled = expected is not None and seconds > self.stall * expected
        if stalled and (width, depth) not in self._stalled:  # a stall, not what it costs
            self._stalled.add((width, depth))
            self.stalls += 1
            return
        self.charge(width, depth, seconds)
        self._stalled.discard((width, depth))  # (twice in a row: what it costs)
        table = self.seconds.setdefault(width, {})
        old = table.get(depth)
        if old is not None and seconds < old / 4:  # the entry was a stall (or a guess): gone
            old = None
        if (width, depth) in self._doubted:  # an estimate, not a measurement: replaced
            del self._doubted[width, depth]
            # doubted in vain (dearer than the halved guess): doubted half as often from now on
            dear = seconds > table[depth]
            wait = 2 * self._wait(width, depth) if dear else self.remeasure_every
            self._waits[width, depth] = min(wait, 16 * self.remeasure_every)
            old = None
        if old is None:  # a first measurement (a guess preceded it: nothing to clip to)
            table[depth] = seconds
        else:  # one stall moves a measurement at most so far
            table[depth] = old + self.smoothing * (min(seconds, self.clip * old) - old)
        self._steps[width] = self._steps.get(width, 0) + 1
        if (width, depth) in self._measured_at:
            self._measured_before[width, depth] = self._measured_at[width, depth]
        self._measured_at[width, depth] = self._steps[width]

    def charge(self, width: int, depth: int, seconds: float) -> None:
        """Charge a step of `width` slots whose deepest draft was `depth` against the credit
        (`observe_step` does; the speculator calls it for a step it does not time because a
        drafter caught up on a backlog in it): a drafting step its regret, every step its
        earning. Unjudged without a plain step of the width to judge by."""
        plain = self.seconds.get(width, {}).get(0)
        if plain is None or not self._charged:
            return
        if depth:
            self.credit -= seconds - plain * (1 + self._accepted / width)
        bound = self.explore * self.credit_steps * plain
        self.credit = max(-bound, min(bound, self.credit + self.explore * seconds))

    def _expected(self, width: int, depth: int) -> float | None:
        """What a step of `width` at `depth` should take, by what is known before it ran: its
        entry, or the guess it was chosen by (`predict`); for a width's first plain step,
        the nearest width's plain step (scaled up by the widths' ratio, when wider)."""
        guess = self.predict(width, depth)
        if guess is not None or depth:
            return guess
        near = _nearest(width, [w for w, t in self.seconds.items() if 0 in t])
        return None if near is None else self.seconds[near][0] * max(1.0, width / near)

    def observe_round(self, slot: SlotId, drafter: str, drafted: int, accepted: int) -> None:
        """A verify round of the slot accepted `accepted` of `drafted` tokens from `drafter`."""
        self._rate(slot, drafter).update(drafted, accepted, self.decay)
        self._pooled.setdefault(drafter, _Rate()).update(drafted, accepted, self.decay)
        self._accepted += accepted

    def forget(self, slot: SlotId) -> None:
        """The slot's request ended: its acceptance history does not carry over."""
        for key in [k for k in self._rates if k[0] == slot]:
            del self._rates[key]


def _nearest(width: int, widths: Sequence[int]) -> int | None:
    """The width of `widths` nearest `width` (the wider on a tie); None if there is none."""
    return min(widths, key=lambda w: (abs(w - width), -w), default=None)


def _interpolate(table: dict[int, float], depth: int) -> float:
    """A depth's seconds from a width's table that holds plain decode (D = 0): between two
    measured depths on the line through them; past the deepest, the deepest's price (what a
    probe one depth deeper is taken at)."""
    if depth in table:
        return table[depth]
    below = max(d for d in table if d < depth)
    above = [d for d in table if d > depth]
    if not above:
        return table[below]
    hi = min(above)
    w = (depth - below) / (hi - below)
    return (1 - w) * table[below] + w * table[hi]
