"""Admission by memory and slots, priced with the slot pool's byte accounting.

Reservation: a request reserves, for its whole life, what its longest possible
sequence holds — `pool.bytes_for(prompt + max_tokens + K, K)`: full-attention KV
(and MTP KV) for every position it may write, the Gated DeltaNet state, and the
capture buffers for K drafts, where K is the Speculator's draft depth unless the
request turns speculation off (a verify row may write K positions past the last
committed token) — plus, when K > 0, what the drafters' own pools hold for it
(`drafter_bytes`: a DFlash drafter's context K/V). Nothing grows later, so there is no
preemption path: an admitted request always has the memory to finish.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.cache import SlotPool


class MemoryBudget:
    """Bytes and slots handed out to admitted requests; never more than the budget."""

    def __init__(
        self,
        pool: SlotPool,
        budget_bytes: int | None = None,
        drafter_bytes: Callable[[int], int] = lambda context_tokens: 0,
    ) -> None:
        """`budget_bytes`: None allows what the pool (and the drafters' pools) hold for all
        slots at full context and draft depth (the slots are then the only limit).
        `drafter_bytes(context_tokens)`: bytes a speculating sequence holds in the drafters'
        own pools (`Speculator.drafter_bytes`)."""
        self.pool = pool
        self.drafter_bytes = drafter_bytes
        full = pool.n_slots * self._bytes_for(pool.max_context, pool.max_draft)
        self.budget_bytes = full if budget_bytes is None else budget_bytes
        if self.budget_bytes <= 0:
            raise ValueError(f"memory budget must be positive, got {self.budget_bytes}")
        self.reserved_bytes = 0
        self.slots_in_use = 0

    def price(self, prompt_tokens: int, max_tokens: int, draft_depth: int) -> int:
        """Bytes a request reserves (see the module docstring)."""
        context = min(prompt_tokens + max_tokens + draft_depth, self.pool.max_context)
        return self._bytes_for(context, draft_depth)

    def _bytes_for(self, context_tokens: int, draft_depth: int) -> int:
        drafters = self.drafter_bytes(context_tokens) if draft_depth else 0
        return self.pool.bytes_for(context_tokens, draft_depth) + drafters

    def never_fits(self, nbytes: int) -> bool:
        return nbytes > self.budget_bytes

    def fits(self, nbytes: int) -> bool:
        return (
            self.slots_in_use < self.pool.n_slots
            and self.reserved_bytes + nbytes <= self.budget_bytes
        )

    def reserve(self, nbytes: int) -> None:
        if not self.fits(nbytes):
            raise RuntimeError("reserve() beyond the budget; call fits() first")
        self.reserved_bytes += nbytes
        self.slots_in_use += 1

    def release(self, nbytes: int) -> None:
        self.reserved_bytes -= nbytes
        self.slots_in_use -= 1
