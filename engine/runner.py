"""`ModelRunner.step(batch)`: one batched forward for every row of a step.

A batch is a list of `Row`s of ragged lengths — decode rows (1 token), verify
rows (K+1 tokens, with capture), prefill chunks (many tokens) — each on its own
slot. The runner packs them, reads their state from the pool, runs the model
once, writes the new state back, and returns the logits and hidden states the
caller asked for. It is the only entry the scheduler calls; N = 1 is the same
path as N > 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from engine.cache import SlotId, SlotPool
from engine.models.qwen35 import Layout, Model


class BatchError(ValueError):
    """A malformed batch; nothing was run and the pool is unchanged."""


@dataclass(frozen=True)
class Row:
    """One slot's tokens for this step, starting at the slot's current length.

    `want`: indices within the row whose logits are returned (default: the last).
    `want_hidden`: also return the post-norm hidden states at `want` (the MTP drafter's input).
    `capture`: keep the linear-layer state after every position, for `SlotPool.rollback`.
    """

    slot: SlotId
    tokens: Sequence[int]
    start: int
    capture: bool = False
    want: Sequence[int] | None = None
    want_hidden: bool = False

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


@dataclass
class RowOutput:
    logits: mx.array  # [len(want), vocab] float32
    hidden: mx.array | None = None  # [len(want), E] when asked


@dataclass
class StepOutput:
    rows: list[RowOutput] = field(default_factory=list)


class ModelRunner:
    """Runs batches of rows of one model over one slot pool."""

    def __init__(self, model: Model, pool: SlotPool) -> None:
        if pool.config != model.config:
            raise ValueError("pool and model were built for different configs")
        self.model = model
        self.pool = pool

    def step(self, batch: Sequence[Row]) -> StepOutput:
        slots = self._validate([r.slot for r in batch], [r.tokens for r in batch])
        for r in batch:
            bad = [i for i in r.wanted if not 0 <= i < len(r.tokens)]
            if bad:
                raise BatchError(f"slot {r.slot}: wanted positions {bad} outside the row")
        layout = Layout.build(
            [len(r.tokens) for r in batch], [r.start for r in batch], [r.capture for r in batch]
        )
        states = self.pool.read(slots, layout)
        tokens = mx.array([t for r in batch for t in r.tokens], dtype=mx.int32)
        hidden, new_states, captures = self.model(tokens, layout, states)

        offsets, at = [], 0
        for r in batch:
            offsets.append(at)
            at += len(r.tokens)
        picked = mx.array(
            [o + i for o, r in zip(offsets, batch, strict=True) for i in r.wanted], dtype=mx.int32
        )
        h = hidden[picked]
        logits = self.model.logits(h).astype(mx.float32)
        self.pool.write(slots, layout, new_states, captures)
        mx.eval(logits, h, self.pool.k, self.pool.v, self.pool.conv, self.pool.ssm)

        out, at = StepOutput(), 0
        for r in batch:
            n = len(r.wanted)
            out.rows.append(
                RowOutput(logits[at : at + n], h[at : at + n] if r.want_hidden else None)
            )
            at += n
        return out

    def draft(self, batch: Sequence[DraftRow]) -> list[tuple[mx.array, mx.array]]:
        """One batched MTP forward. Per row: (draft logits `[n, V]`, MTP hidden h' `[n, E]`)."""
        mtp = self.model.mtp
        if mtp is None:
            raise BatchError(f"{self.model.path}: this model has no MTP head")
        slots = self._validate([r.slot for r in batch], [r.tokens for r in batch])
        layout = Layout.build([len(r.tokens) for r in batch], [r.start for r in batch])
        state = self.pool.read_mtp(slots, layout)
        tokens = mx.array([t for r in batch for t in r.tokens], dtype=mx.int32)
        hidden = mx.concatenate([r.hidden for r in batch], axis=0)
        logits, h, new = mtp(tokens, hidden, layout, state)
        self.pool.write_mtp(slots, layout, new)
        logits = logits.astype(mx.float32)
        assert self.pool.mtp_k is not None and self.pool.mtp_v is not None
        mx.eval(logits, h, self.pool.mtp_k, self.pool.mtp_v)
        out, at = [], 0
        for r in batch:
            n = len(r.tokens)
            out.append((logits[at : at + n], h[at : at + n]))
            at += n
        return out

    def _validate(self, slots: list[SlotId], tokens: list[Sequence[int]]) -> list[SlotId]:
        if not slots:
            raise BatchError("empty batch")
        if len(set(slots)) != len(slots):
            raise BatchError(f"a slot appears more than once in the batch: {slots}")
        V = self.model.config.n_vocab
        for slot, toks in zip(slots, tokens, strict=True):
            if len(toks) == 0:
                raise BatchError(f"slot {slot}: empty row")
            bad = [t for t in toks if not 0 <= t < V]
            if bad:
                raise BatchError(f"slot {slot}: token ids {bad[:5]} outside the vocabulary of {V}")
        return list(slots)
