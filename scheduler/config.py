"""The scheduler's knobs, with defaults that suit a small model on one device."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.prefix_reuse import PrefixCacheConfig
from scheduler.queue import Policy
from scheduler.step import FaultHook


@dataclass(frozen=True)
class SchedulerConfig:
    """`max_queue`: requests waiting for a slot before submits are rejected.
    `policy` / `aging_per_s`: admission order; under PRIORITY a waiting request gains
    `aging_per_s` priority points per second. `max_batch_tokens`: tokens in one step
    (decode and verify rows first, prefill chunks fill the rest). `max_prefill_chunk`:
    prompt tokens of one request per step. `memory_bytes`: the admission budget (None:
    what the pool holds for all slots). `shutdown_grace_s`: how long running requests
    may go on after shutdown begins. `fault_hook`: test-only (see `scheduler.step`).
    `prefix_cache`: exact reuse of cached prompt prefixes (None: off; see
    `scheduler.prefix_reuse`). `decode_ahead`: while the host resolves a step of plain
    decode rows (beside drafters, a step in which none drafted), the
    next is already computing on the device (`scheduler.step`; the same tokens either way;
    the daemon turns it on on a GPU).
    """

    max_queue: int = 256
    policy: Policy = Policy.PRIORITY
    aging_per_s: float = 1.0
    max_batch_tokens: int = 512
    max_prefill_chunk: int = 256
    memory_bytes: int | None = None
    shutdown_grace_s: float = 10.0
    fault_hook: FaultHook | None = None
    prefix_cache: PrefixCacheConfig | None = None
    decode_ahead: bool = False

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        if self.max_batch_tokens < 1 or self.max_prefill_chunk < 1:
            raise ValueError("max_batch_tokens and max_prefill_chunk must be >= 1")
        if self.aging_per_s < 0 or self.shutdown_grace_s < 0:
            raise ValueError("aging_per_s and shutdown_grace_s must be >= 0")
