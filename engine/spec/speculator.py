"""Decode rows for a step: plain or speculative, planned and resolved in one place.

The scheduler puts every decoding slot of a step through a `Speculator`:

    rows = speculator.plan(decoding)                  # decode rows (and, later, verify rows)
    out = runner.step(prefill_rows + rows)            # ONE forward for the whole batch
    committed = speculator.resolve(decoding, out.rows[len(prefill_rows):])

`plan` decides each slot's draft depth K (0 = plain decode) and builds its row;
`resolve` samples / accepts, rolls rejected positions back in the pool, and
returns the tokens each slot committed this step (at least one each). So the
scheduler never samples decode tokens itself, and speculation changes nothing
in its loop.

This version decodes without drafts (K = 0 for every slot); drafters, exact
acceptance and the cost controller plug into `plan` and `resolve`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from engine.cache import SlotId
from engine.runner import ModelRunner, Row, RowOutput
from engine.sampling import RequestRng, SamplingParams, adjust_logits, distribution, draw


@dataclass
class DecodingSlot:
    """One slot that decodes this step.

    `pending` is the last committed token, not yet fed to the model; `history`
    is every token the sequence has (prompt and output, `pending` included).
    """

    slot: SlotId
    pending: int
    history: list[int]
    params: SamplingParams
    rng: RequestRng
    speculation: str = "auto"  # "off" | "on" | "auto"


@dataclass
class Committed:
    """What one slot committed in a step, with what the sampler saw for each token."""

    tokens: list[int]
    logits: list[mx.array] = field(default_factory=list)  # adjusted logits per token, [V]
    drafted: int = 0
    accepted: int = 0


def sample_rows(
    logits: mx.array,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    rngs: Sequence[RequestRng],
) -> tuple[list[int], mx.array]:
    """Sample one token per row of `logits [N, V]`; returns (tokens, adjusted logits)."""
    adjusted = adjust_logits(logits, params, histories)
    probs = distribution(adjusted, params)
    uniforms = np.array([rng.uniform(1)[0] for rng in rngs])
    return [int(t) for t in np.array(draw(probs, uniforms))], adjusted


class Speculator:
    """Plans and resolves the decode rows of every step (see the module docstring)."""

    def __init__(self, runner: ModelRunner, max_draft: int = 0) -> None:
        self.runner = runner
        self.max_draft = max_draft

    def plan(self, decoding: Sequence[DecodingSlot]) -> list[Row]:
        pool = self.runner.pool
        return [Row(d.slot, [d.pending], pool.lengths[d.slot]) for d in decoding]

    def resolve(
        self, decoding: Sequence[DecodingSlot], outputs: Sequence[RowOutput]
    ) -> list[Committed]:
        if not decoding:
            return []
        logits = mx.concatenate([o.logits[-1:] for o in outputs], axis=0)
        tokens, adjusted = sample_rows(
            logits,
            [d.params for d in decoding],
            [d.history for d in decoding],
            [d.rng for d in decoding],
        )
        return [Committed([t], [adjusted[i]]) for i, t in enumerate(tokens)]
