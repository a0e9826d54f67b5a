"""Decode rows for a step: plain or speculative, planned and resolved in one place.

The scheduler puts every decoding slot of a step through a `Speculator`:

    rows = speculator.plan(decoding)                  # decode rows and verify rows
    out = runner.step(prefill_rows + rows)            # ONE forward for the whole batch
    committed = speculator.resolve(decoding, out.rows[len(prefill_rows):])

`plan` lets the cost controller choose each slot's draft depth K (0 = plain
decode), has the drafters propose the drafts of all speculating slots batched,
and builds each slot's row: `[pending, *drafts]` with capture when K > 0.
`resolve` accepts drafts exactly (`acceptance.accept`), rolls rejected positions
back in the pool, and returns the tokens each slot committed this step (at least
one each). Slots with different K share the step; the scheduler never samples
decode tokens itself. `resolve_step` is the same with a cheaper answer for a step
without drafts: a `PlainStep` (one token per slot, no per-slot objects).

Around that, three hooks keep drafters with state (the MTP head's KV) in step
with the trunk: run prefill chunks as `prefill_row(...)` and report them with
`prefilled(row, output)`, and call `release(slot)` when the slot's request ends
(it returns the request's `SpecStats`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from typing import NamedTuple, cast

import mlx.core as mx
import numpy as np

from engine.cache import SlotId
from engine.runner import (
    ModelRunner,
    Row,
    RowOutput,
    last_logits,
    uniform_shapes,
    verified_logits,
)
from engine.sampling import (
    RequestRng,
    SamplingParams,
    adjust_logits,
    device_tokens,
    distribution,
    greedy_tokens,
    sample,
)
from engine.spec.acceptance import accept, accept_greedy
from engine.spec.controller import MODES, CostController, Offer
from engine.spec.dflash import DFlashModel
from engine.spec.drafters import (
    NO_DRAFT,
    DFlashDrafter,
    Draft,
    Drafter,
    DrafterState,
    DraftJob,
    MTPDrafter,
    NgramDrafter,
)


class SpecError(ValueError):
    """The speculator was driven out of order (e.g. resolve without plan); nothing changed."""


# A slot's live state: equal only to itself (cheap to look for); slots: read per step
@dataclass(eq=False, slots=True)
class DecodingSlot:
    """One slot that decodes this step.

    `pending` is the last committed token, not yet fed to the model; `history`
    is every token the sequence has (prompt and output, `pending` included).
    `max_draft` caps the request's draft depth; `remaining` is how many tokens it may
    still commit (drafting past it would be wasted).
    """

    slot: SlotId
    pending: int
    history: list[int]
    params: SamplingParams
    rng: RequestRng
    speculation: str = "auto"  # "off" | "on" | "auto"
    max_draft: int | None = None
    remaining: int | None = None


class Drawn(NamedTuple):
    """A step's tokens drawn on the device ahead of its resolve (`Speculator.draw_ahead`):
    `tokens [N]`, lazy, and the adjusted logits `[N, V]` they were drawn from."""

    tokens: mx.array
    adjusted: mx.array


class PlainStep(NamedTuple):
    """A resolved step without drafts: one token per decoding slot, in order. `adjusted`
    `[N, V]`: the logits the sampler saw; `logprob_rows`: the rows whose request asks
    for log-probabilities (the only ones whose `adjusted` row is read)."""

    tokens: list[int]
    adjusted: mx.array
    logprob_rows: list[int]

    def committed(self) -> list[Committed]:
        """The same step as `resolve` gives it: a `Committed` per slot."""
        wanted = set(self.logprob_rows)
        return [
            Committed([t], [self.adjusted[i]] if i in wanted else [])
            for i, t in enumerate(self.tokens)
        ]


class Committed(NamedTuple):
    """What one slot committed in a step, with what the sampler saw for each token.
    (A NamedTuple: every decoding slot makes one per step.)"""

    tokens: list[int]
    # adjusted logits per token, [V] each; only when the request asks for log-probabilities
    logits: list[mx.array]
    drafted: int = 0
    accepted: int = 0
    drafter: str = ""  # "" when the slot did not draft


@dataclass
class SpecStats:
    """One request's speculation telemetry, summed over its decode steps."""

    steps: int = 0
    verify_rounds: int = 0  # steps with at least one draft token
    drafted: int = 0
    accepted: int = 0
    accepted_at_depth: list[int] = field(default_factory=list)  # [d-1]: rounds accepting depth d
    choices: dict[int, int] = field(default_factory=dict)  # draft depth -> steps it was chosen
    rounds_by_drafter: dict[str, int] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def record_plain(self, steps: int = 1) -> None:
        """`record("", 0, 0)`, `steps` times: steps without drafts."""
        self.steps += steps
        self.choices[0] = self.choices.get(0, 0) + steps

    def record(self, drafter: str, drafted: int, accepted: int) -> None:
        if not drafted:
            self.record_plain()
            return
        self.steps += 1
        self.choices[drafted] = self.choices.get(drafted, 0) + 1
        self.verify_rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rounds_by_drafter[drafter] = self.rounds_by_drafter.get(drafter, 0) + 1
        self.accepted_at_depth += [0] * (accepted - len(self.accepted_at_depth))
        for d in range(accepted):
            self.accepted_at_depth[d] += 1


@dataclass(eq=False)  # (compared by identity: `None in plans` stays a scan in C)
class _Plan:
    drafter: str
    draft: Draft
    length: int  # the slot's trunk length when planned


_PLAIN = _Plan("", NO_DRAFT, -1)  # every slot's plan in a step without drafters
_UNDRAFTED = ("", NO_DRAFT)  # (drafter, draft) of a slot no drafter drafted for this step
_slot_of = attrgetter("slot")  # (C calls per slot)
_ARGMAX_ONLY = attrgetter("argmax_only")
_params_of, _logprobs_of = attrgetter("params"), attrgetter("logprobs")
_new_tuple = tuple.__new__  # (a NamedTuple's own __new__ is Python code; this is C)
_ROW_DEFAULTS = Row(SlotId(0), (), 0)[3:]  # a plain decode row's fields after (slot, tokens, start)


def default_drafters(runner: ModelRunner, dflash: DFlashModel | None = None) -> list[Drafter]:
    """Prompt lookup first (free when it matches), then the MTP head if the model has one,
    then the DFlash drafter `dflash` when one is given."""
    drafters: list[Drafter] = [NgramDrafter()]
    if runner.model.mtp is not None:
        drafters.append(MTPDrafter(runner))
    if dflash is not None:
        drafters.append(DFlashDrafter(runner, dflash))
    return drafters


def sample_rows(
    logits: mx.array,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    rngs: Sequence[RequestRng],
) -> tuple[list[int], mx.array]:
    """Sample one token per row of `logits [N, V]`; returns (tokens, adjusted logits). A
    step whose every row is `argmax_only` (the common one) is one argmax."""
    if all(map(_ARGMAX_ONLY, params)):
        return greedy_tokens(logits).tolist(), logits
    adjusted = adjust_logits(logits, params, histories)
    return sample(adjusted, params, rngs).tolist(), adjusted


class Speculator:
    """Plans and resolves the decode rows of every step (see the module docstring).

    `max_draft` bounds K for every slot (0: plain decode only) and may not exceed the
    pool's capture depth. `drafters` in order of preference (default: `default_drafters`);
    each slot drafts with the available one whose acceptance estimate is highest.
    """

    def __init__(
        self,
        runner: ModelRunner,
        max_draft: int = 0,
        drafters: Sequence[Drafter] | None = None,
        controller: CostController | None = None,
        uniform_verify: bool | None = None,
    ) -> None:
        if not 0 <= max_draft <= runner.pool.max_draft:
            raise ValueError(
                f"max_draft {max_draft} outside 0..{runner.pool.max_draft} (the pool's capture "
                "depth; build the SlotPool with a larger max_draft)"
            )
        self.runner = runner
        self.max_draft = max_draft
        if drafters is None:
            drafters = default_drafters(runner) if max_draft else []
        self.drafters = list(drafters)
        taps = {d.layers for d in self.drafters if d.layers}
        if len(taps) > 1:
            raise ValueError(f"drafters tap different trunk layers {sorted(taps)}; use one")
        self.layers: tuple[int, ...] = taps.pop() if taps else ()
        self.controller = controller if controller is not None else CostController()
        # Uniform verify steps (default: a compiled runner on a GPU): in a step where any
        # slot drafts, every row feeds as many tokens as the deepest draft plus one — a
        # shorter draft (or none) padded with filler tokens whose positions are rolled back
        # unread — and keeps its state after each position. Rows then differ in nothing the
        # compiled forward is keyed on, so a verify step's shape is (rows, depth, past), not
        # one of the many mixes of per-slot depths and capture flags that drafts make: with
        # ragged rows nearly every verify step met a shape not compiled yet (run eagerly, or
        # traced). On a CPU the filler costs what real tokens do (n-gram "on", N = 8,
        # compiled: 0.66x -> 0.33x of plain there), so it is off there.
        if uniform_verify is None:
            uniform_verify = uniform_shapes(runner)
        self.uniform_verify = uniform_verify
        self._plans: dict[SlotId, _Plan] = {}
        # A plan without drafters (every slot's plan `_PLAIN`), not yet resolved: its slots
        # in order, kept as the list the rows were built from instead of an entry per slot in
        # `_plans` (`_spill` moves them there when a step goes otherwise), and as a set once
        # a slot is released meanwhile.
        self._plain_slots: list[SlotId] | None = None
        self._plain_set: set[SlotId] | None = None
        # start, row tokens, depth, and whether it is timed (else only charged)
        self._cycle: tuple[float, int, int, bool] | None = None
        self._cold_at_plan = 0  # the runner's `cold_steps` when the cycle was planned

    # -- a slot's life -------------------------------------------------------------------
    def prefill_row(
        self, slot: SlotId, tokens: Sequence[int], start: int, speculation: str = "auto"
    ) -> Row:
        """The row to run for a prefill chunk; `start == 0` begins a new sequence in `slot`.

        The row may ask for the logits and hidden states of every position (drafters
        that follow the trunk need them); the next-token logits are always `logits[-1]`.
        """
        if start == 0:
            self.release(slot)
            if speculation != "off" and self.max_draft:
                for d in self.drafters:
                    d.begin(slot)
        hidden = self._needs_hidden(slot)
        return Row(
            slot,
            tokens,
            start,
            want=range(len(tokens)) if hidden else None,
            want_hidden=hidden,
            taps=self._taps(slot),
        )

    def prefilled(self, row: Row, output: RowOutput) -> None:
        """Report the output of a row built by `prefill_row` once the step has run."""
        if output.hidden is not None:
            for d in self.drafters:
                if d.needs_hidden(row.slot):
                    d.observe(row.slot, row.start, output.hidden, output.taps)

    def use_uniform_shapes(self, on: bool) -> None:
        """Uniform verify rows, uniform rounds for its MTP drafters (catch-up rows and draft
        chains) and the runner's padded widths, on or off together: a compiled runner on a
        GPU has them on by default; benchmarks and tests turn them on on any device to meet
        a GPU's batch shapes."""
        self.uniform_verify = on
        self.runner.pad_widths = on
        for d in self.drafters:
            if isinstance(d, MTPDrafter):
                d.uniform = on

    def release(self, slot: SlotId) -> None:
        """Forget the slot's request (call when it ends). Its telemetry is the caller's, from
        each step's `Committed` (`SpecStats.record`)."""
        if self._plain_slots is not None:  # (admissions release their new slots mid-step)
            if self._plain_set is None:
                self._plain_set = set(self._plain_slots)
            if slot in self._plain_set:
                self._spill()
        self._plans.pop(slot, None)
        for d in self.drafters:
            d.release(slot)
        self.controller.forget(slot)

    def export(self, slot: SlotId) -> dict[str, DrafterState]:
        """The drafters' state for `slot`, by drafter name (for a snapshot of the slot)."""
        states = {d.name: d.export(slot) for d in self.drafters}
        return {name: s for name, s in states.items() if s is not None}

    def adopt(
        self, slot: SlotId, states: dict[str, DrafterState], speculation: str = "auto"
    ) -> None:
        """`slot` now holds a restored snapshot: start a new sequence there whose drafters
        follow from `states` (an `export` of the snapshot's slot); its prefill goes on at
        the snapshot's length."""
        self.release(slot)
        if speculation != "off" and self.max_draft:
            for d in self.drafters:
                if d.name in states:
                    d.adopt(slot, states[d.name])

    def precompile(self) -> int:
        """Compile and keep, before any request, the shape of every plain decode step
        (`ModelRunner.precompile_decode`) and, with drafters, of every verify step at each
        draft depth up to `max_draft` (`precompile_verify`; with the layers a drafter follows
        tapped, and without), and the drafters' own steady shapes (`Drafter.precompile`:
        the MTP head's catch-up and draft chains): the number compiled."""
        made = self.runner.precompile_decode()
        if self.max_draft and self.drafters:
            depths = range(1, self.max_draft + 1)
            for taps in {(), self.layers}:
                made += self.runner.precompile_verify(depths, taps)
            made += sum(d.precompile(self.max_draft) for d in self.drafters)
        return made

    def drafter_bytes(self, context_tokens: int) -> int:
        """Bytes a speculating sequence of `context_tokens` holds in the drafters' own pools
        (on top of `SlotPool.bytes_for`; a sequence with speculation off holds none)."""
        return sum(d.bytes_for(context_tokens) for d in self.drafters) if self.max_draft else 0

    # -- a step ---------------------------------------------------------------------------
    def plan(self, decoding: Sequence[DecodingSlot]) -> list[Row]:
        """One row per decoding slot, in order: `[pending, *drafts]` at the slot's length."""
        start = time.perf_counter()
        self._cold_at_plan = self.runner.cold_steps
        self._spill()  # (an earlier plan never resolved)
        pool_lengths = self.runner.pool.lengths
        if not self.max_draft:  # nothing may draft (and no drafter has begun a slot)
            # built column by column in C calls: a step at 1,024 rows makes 1,024 of them
            slots = list(map(_slot_of, decoding))
            starts = list(map(pool_lengths.__getitem__, slots))
            fed = [[d.pending] for d in decoding]
            fields = zip(slots, fed, starts, *map(repeat, _ROW_DEFAULTS), strict=False)
            rows = list(map(_new_tuple, repeat(Row), fields))  # (the defaults repeat forever)
            if self.drafters:  # they may follow the trunk from each plan's length
                for r in rows:
                    self._plans[r.slot] = _Plan("", NO_DRAFT, r.start)
            else:  # no one reads a plain plan's length: one plan serves every slot
                self._plain_slots = slots
            self._cycle = (start, len(rows), 0, True)
            return rows
        lengths = [pool_lengths[d.slot] for d in decoding]
        offers = [self._offer(d, n) for d, n in zip(decoding, lengths, strict=True)]
        depths = self.controller.choose(offers)
        drafts: dict[SlotId, tuple[str, Draft]] = {}
        for drafter in self.drafters:
            jobs = [
                DraftJob(d, k if o.drafter == drafter.name else 0, n)
                for d, o, k, n in zip(decoding, offers, depths, lengths, strict=True)
            ]
            for job, draft in zip(jobs, drafter.draft(jobs), strict=True):
                if draft.tokens:
                    drafts[job.d.slot] = (drafter.name, draft)
        rows = []
        deepest = max((len(x.tokens) for _, x in drafts.values()), default=0)
        room = self.runner.pool.max_context
        for d, n in zip(decoding, lengths, strict=True):
            name, draft = drafts.get(d.slot, _UNDRAFTED)
            k = len(draft.tokens)
            tokens = [d.pending, *draft.tokens]
            if self.uniform_verify and deepest:
                # filler: the row's last token again (read by nothing: rolled back)
                tokens += tokens[-1:] * max(0, min(deepest - k, room - n - k - 1))
            self._plans[d.slot] = _Plan(name, draft, n)
            rows.append(
                Row(
                    d.slot,
                    tokens,
                    n,
                    capture=len(tokens) > 1,
                    want=range(len(tokens)),
                    want_hidden=self._needs_hidden(d.slot),
                    taps=self._taps(d.slot),
                )
            )
        depth = max((len(r.tokens) - 1 for r in rows), default=0)
        # A drafter that fed its model a long backlog this step (its first round after a
        # plain stretch catches up on every position since) made a step that says nothing
        # of what drafting at this depth costs: it is not timed, only charged to the
        # controller's credit for re-tries.
        steady = max((d.caught_up for d in self.drafters), default=0) <= self.max_draft + 1
        self._cycle = (start, sum(len(r.tokens) for r in rows), depth, steady)
        return rows

    def resolve(
        self, decoding: Sequence[DecodingSlot], outputs: Sequence[RowOutput]
    ) -> list[Committed]:
        """Accept, roll back and commit: per slot, in order, the tokens of this step."""
        resolved = self.resolve_step(decoding, outputs)
        return resolved.committed() if isinstance(resolved, PlainStep) else resolved

    def draw_ahead(self, decoding: Sequence[DecodingSlot], outputs: Sequence[RowOutput]) -> Drawn:
        """The tokens `resolve_step` would draw for a step without drafts, drawn on the
        device from these outputs (lazy): each row's logits adjusted for its penalties and
        bias over its history, each sampled row drawn with its request's next uniform, peeked
        — left in its stream until `resolve_step(drawn=)` uses it up. (The scheduler draws
        a step's tokens so before it queues the next step behind it: drawn after, on the one
        stream, they would wait for that step.)"""
        params = list(map(_params_of, decoding))
        adjusted = adjust_logits(last_logits(outputs), params, [d.history for d in decoding])
        uniforms = [d.rng.peek() for d in decoding if not d.params.greedy]
        return Drawn(device_tokens(adjusted, params, uniforms), adjusted)

    def resolve_step(
        self,
        decoding: Sequence[DecodingSlot],
        outputs: Sequence[RowOutput],
        drawn: Drawn | None = None,
    ) -> PlainStep | list[Committed]:
        """`resolve`, but a step in which no slot drafted comes back as a `PlainStep`: its
        tokens in one list, with no object per slot (the scheduler's common step).

        `drawn`: the step's tokens as `draw_ahead` drew them from these outputs, for a step
        with no drafts; they are read instead of drawn again, and each sampled row's uniform
        is used up as drawing would."""
        if len(outputs) != len(decoding):
            raise SpecError(f"{len(outputs)} outputs for {len(decoding)} decoding slots")
        slots = list(map(_slot_of, decoding))
        if decoding and slots == self._plain_slots:  # the plan without drafters, as planned
            self._plain_slots = self._plain_set = None
            if self._plans:  # older plans of these slots, never resolved: resolved now too
                for slot in slots:
                    self._plans.pop(slot, None)
            resolved: PlainStep | list[Committed] = self._plain(decoding, outputs, drawn)
            self._observe_cycle(len(decoding))
            return resolved
        self._spill()
        found = list(map(self._plans.get, slots))
        if None in found:  # (identity checks: plans compare by identity)
            missing = [s for s, p in zip(slots, found, strict=True) if p is None]
            raise SpecError(f"slots {missing} were not planned for this step")
        if not decoding:
            return []
        plans = cast(list[_Plan], found)
        if len(self._plans) == len(slots) == len(set(slots)):
            self._plans.clear()  # (they are all this step's: one call, not one per slot)
        else:
            for slot in slots:
                del self._plans[slot]
        ks = [len(p.draft.tokens) for p in plans] if self.max_draft else []
        if any(ks):
            if drawn is not None:
                raise SpecError("tokens drawn ahead for a step that verifies drafts")
            resolved = self._accept(decoding, plans, outputs, ks)
        else:
            resolved = self._plain(decoding, outputs, drawn)
            if self.drafters:  # they follow the trunk
                for slot, plan, out in zip(slots, plans, outputs, strict=True):
                    self._commit(slot, plan, out, 0, 0)
        self._observe_cycle(len(decoding))
        return resolved

    # -- internals -------------------------------------------------------------------------
    def _spill(self) -> None:
        """The pending plan without drafters into `_plans`, an entry per slot (the general
        form: a step resolved in part, a slot released, a plan never resolved)."""
        if self._plain_slots is not None:
            self._plans.update(zip(self._plain_slots, repeat(_PLAIN)))
            self._plain_slots = self._plain_set = None

    def _plain(
        self,
        decoding: Sequence[DecodingSlot],
        outputs: Sequence[RowOutput],
        drawn: Drawn | None = None,
    ) -> PlainStep:
        """A step without drafts: one token per slot, sampled (`sample`) with no acceptance.
        The same tokens `_accept` would give for K = 0, at a fraction of its cost. (The
        drafters are told by the caller.)"""
        params = list(map(_params_of, decoding))
        if drawn is None:
            logits = last_logits(outputs)
            if all(map(_ARGMAX_ONLY, params)):  # (no history or generator is read)
                tokens, adjusted = sample_rows(logits, params, (), ())
            else:
                histories = [d.history for d in decoding]
                tokens, adjusted = sample_rows(logits, params, histories, [d.rng for d in decoding])
        else:
            if drawn.tokens.shape != (len(decoding),):
                raise SpecError(
                    f"tokens drawn ahead of shape {drawn.tokens.shape} for {len(decoding)} rows"
                )
            for d in decoding:
                if not d.params.greedy:
                    d.rng.uniform(1)  # the uniform `drawn` peeked, used up as `sample` would
            tokens, adjusted = cast(list[int], drawn.tokens.tolist()), drawn.adjusted
        logprob_rows = (
            [i for i, p in enumerate(params) if p.logprobs]
            if any(map(_logprobs_of, params))
            else []
        )
        return PlainStep(tokens, adjusted, logprob_rows)

    def _accept(
        self,
        decoding: Sequence[DecodingSlot],
        plans: list[_Plan],
        outputs: Sequence[RowOutput],
        ks: list[int],
    ) -> list[Committed]:
        """A step where some slots verify drafts: exact acceptance over all of them."""
        uniforms = [d.rng.uniform(k + 1) for d, k in zip(decoding, ks, strict=True)]
        drafts = [plan.draft.tokens for plan in plans]
        packed = verified_logits(outputs) if all(d.params.argmax_only for d in decoding) else None
        if packed is not None:
            # every slot takes the argmax of the model's own logits, its rows side by side in
            # the step's packed logits: one argmax over them all, each slot's verified
            # positions picked on the host (not a slice per row, joined, then adjusted)
            seen, firsts = packed
            everywhere = greedy_tokens(seen)
            best = np.concatenate(
                [everywhere[f : f + k + 1] for f, k in zip(firsts, ks, strict=True)]
            )
            n, nxt = accept_greedy(best, drafts)
        else:
            params = [d.params for d, k in zip(decoding, ks, strict=True) for _ in range(k + 1)]
            histories = [  # what the penalties count at each verified position
                d.history + p.draft.tokens[:j] if d.params.penalized else []
                for d, p, k in zip(decoding, plans, ks, strict=True)
                for j in range(k + 1)
            ]
            logits = mx.concatenate([o.logits[: k + 1] for o, k in zip(outputs, ks, strict=True)])
            seen = adjust_logits(logits, params, histories)
            firsts = list(itertools.accumulate([k + 1 for k in ks[:-1]], initial=0))
            if all(p.greedy for p in params):
                # p is one-hot at each argmax: one argmax decides (`accept_greedy`), where the
                # general rule builds p, q and the residual over the vocabulary (a dozen
                # device ops of [N, K+1, V] each, every verify step)
                n, nxt = accept_greedy(greedy_tokens(seen), drafts)
            else:
                p = _per_slot(distribution(seen, params), ks)
                K = max(ks)
                u_accept = np.ones((len(ks), K))
                drafted = np.zeros((len(ks), K), dtype=np.int32)
                for i, (u, tokens) in enumerate(zip(uniforms, drafts, strict=True)):
                    u_accept[i, : ks[i]] = u[:-1]
                    drafted[i, : ks[i]] = tokens
                n, nxt = accept(
                    p,
                    _draft_distributions(plans, K, p.shape[-1]),
                    mx.array(drafted),
                    mx.array(ks, dtype=mx.int32),
                    u_accept,
                    np.array([u[-1] for u in uniforms]),
                )
        # Rejected drafts (and filler: a row's outputs are all the positions it fed): every
        # such slot rolls back in one pool update per state kind.
        rejected = [
            (d.slot, int(a) + 1)
            for d, o, a in zip(decoding, outputs, n, strict=True)
            if a + 1 < o.positions
        ]
        if rejected:
            self.runner.pool.rollback_many(rejected)
        committed = []
        for d, plan, out, k, a, tok, f in zip(
            decoding, plans, outputs, ks, n, nxt, firsts, strict=True
        ):
            a = int(a)
            self._commit(d.slot, plan, out, k, a)
            # what the sampler saw at each kept position: the adjusted logits (= the model's
            # own where every slot takes the argmax)
            wanted = [seen[f + j] for j in range(a + 1)] if d.params.logprobs else []
            committed.append(
                Committed([*plan.draft.tokens[:a], int(tok)], wanted, k, a, plan.drafter)
            )
        return committed

    # -- internals -------------------------------------------------------------------------
    def _offer(self, d: DecodingSlot, length: int) -> Offer:
        """What the slot could draft this step. (Once per decoding slot per step, so it
        compares in place of building lists: "auto"'s host work where nothing drafts.)"""
        mode = d.speculation
        if mode not in MODES:
            raise SpecError(f"slot {d.slot}: speculation must be one of {MODES}, not {mode!r}")
        cap = min(self.max_draft, self.runner.pool.max_context - length - 1)
        if d.max_draft is not None and d.max_draft < cap:
            cap = d.max_draft
        if d.remaining is not None and d.remaining - 1 < cap:
            cap = d.remaining - 1
        if cap <= 0 or mode == "off":
            return Offer(d.slot, "", 0, mode)
        best, depth, rate = "", 0, -1.0
        for x in self.drafters:
            k = min(cap, x.available(d, length))
            if k > 0:
                r = self.controller.rate(d.slot, x.name) if len(self.drafters) > 1 else 0.0
                if r > rate:  # the drafter it has done best with (the first on a tie)
                    best, depth, rate = x.name, k, r
        return Offer(d.slot, best, depth, mode)

    def _needs_hidden(self, slot: SlotId) -> bool:
        return any(d.needs_hidden(slot) for d in self.drafters)

    def _taps(self, slot: SlotId) -> tuple[int, ...]:
        """The trunk layers the slot's rows return: those of a drafter that follows it."""
        return self.layers if any(d.layers and d.needs_hidden(slot) for d in self.drafters) else ()

    def _commit(self, slot: SlotId, plan: _Plan, out: RowOutput, k: int, accepted: int) -> None:
        """Tell the drafters and the cost controller what the slot kept (its rollback, if any,
        is done)."""
        hidden = out.hidden
        if hidden is not None:
            if hidden.shape[0] > accepted + 1:  # (a slice only where some are dropped)
                hidden = hidden[: accepted + 1]
            taps = out.taps
            if taps is not None and taps.shape[0] > accepted + 1:
                taps = taps[: accepted + 1]
            for d in self.drafters:
                if d.needs_hidden(slot):
                    d.observe(slot, plan.length, hidden, taps)
        if k:
            self.controller.observe_round(slot, plan.drafter, k, accepted)

    def _observe_cycle(self, width: int) -> None:
        """Time plan -> step -> resolve, unless other rows (prefill) shared the step."""
        if self._cycle is None:
            return
        start, tokens, depth, steady = self._cycle
        self._cycle = None
        # A cycle that compiled a new batch shape (its drafts' or its step's) timed MLX's
        # compiler, not the step: not observed.
        if self.runner.last_tokens == tokens and self.runner.cold_steps == self._cold_at_plan:
            seconds = time.perf_counter() - start
            if steady:
                self.controller.observe_step(width, depth, seconds)
            else:
                self.controller.charge(width, depth, seconds)


def _per_slot(rows: mx.array, ks: list[int]) -> mx.array:
    """Packed rows `[sum(k+1), V]` -> `[N, K+1, V]`, a slot's last row repeated as padding."""
    K, index, offset = max(ks), [], 0
    for k in ks:
        index += [offset + min(j, k) for j in range(K + 1)]
        offset += k + 1
    return rows[mx.array(index, dtype=mx.int32)].reshape(len(ks), K + 1, rows.shape[-1])


def _draft_distributions(plans: list[_Plan], K: int, V: int) -> mx.array:
    """q `[N, K, V]`: each draft's distribution (one-hot for point-mass drafts), zero padding."""
    parts = []
    for p in plans:
        if p.draft.q is not None:
            parts.append(p.draft.q)
        elif p.draft.tokens:
            tokens = mx.array(p.draft.tokens, dtype=mx.int32)
            parts.append((mx.arange(V)[None, :] == tokens[:, None]).astype(mx.float32))
    flat = mx.concatenate([*parts, mx.zeros((1, V))])
    zero, index, offset = flat.shape[0] - 1, [], 0
    for p in plans:
        k = len(p.draft.tokens)
        index += [offset + j if j < k else zero for j in range(K)]
        offset += k
    return flat[mx.array(index, dtype=mx.int32)].reshape(len(plans), K, V)
