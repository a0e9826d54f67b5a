"""The bounded wait queue: order of admission (FCFS, or priority with aging) and rejects.

Under the priority policy a waiting request's effective priority grows by
`aging_per_s` every second it waits, so a low-priority request overtakes any newer
high-priority one after a bounded wait: nothing starves. Because every entry ages at
the same rate, the order between two entries never changes, and one heap keyed by
`priority - aging_per_s * arrival` keeps it.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

T = TypeVar("T")

RETRY_AFTER_MIN_S = 0.05
RETRY_AFTER_MAX_S = 30.0
RETRY_AFTER_UNKNOWN_S = 1.0
"""Hint before any admission has been observed."""


class Policy(StrEnum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class RejectReason(StrEnum):
    QUEUE_FULL = "queue_full"  # try again after `retry_after_s`
    NEVER_FITS = "never_fits"  # its memory reservation exceeds the whole budget
    SHUTTING_DOWN = "shutting_down"  # the scheduler is not running or is stopping


class Rejected(Exception):
    """The request was not queued. `retry_after_s` is set when retrying can succeed."""

    def __init__(self, reason: RejectReason, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(order=True)
class _Entry(Generic[T]):
    key: tuple[float, int]
    item: T = field(compare=False)


class WaitQueue(Generic[T]):
    """Items waiting for admission, best first. Not thread-safe: one event loop owns it."""

    def __init__(self, capacity: int, policy: Policy, aging_per_s: float) -> None:
        if capacity < 1 or aging_per_s < 0:
            raise ValueError("WaitQueue needs capacity >= 1 and aging_per_s >= 0")
        self.capacity = capacity
        self.policy = policy
        self.aging_per_s = aging_per_s
        self._heap: list[_Entry[T]] = []
        self._order = itertools.count()
        self._last_admit: float | None = None
        self._admit_interval: float | None = None  # EWMA of seconds between admissions

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, item: T, priority: int, now: float) -> None:
        """Queue `item`, or raise Rejected(QUEUE_FULL) with a retry-after hint."""
        if len(self._heap) >= self.capacity:
            raise Rejected(
                RejectReason.QUEUE_FULL,
                f"the wait queue is full ({self.capacity} requests)",
                self.retry_after_s(),
            )
        rank = -(priority - self.aging_per_s * now) if self.policy == Policy.PRIORITY else 0.0
        heapq.heappush(self._heap, _Entry((rank, next(self._order)), item))

    def peek(self) -> T | None:
        return self._heap[0].item if self._heap else None

    def pop(self, now: float) -> T:
        """Remove the best item to admit it (feeds the retry-after estimate)."""
        item = heapq.heappop(self._heap).item
        if self._last_admit is not None:
            gap = now - self._last_admit
            prev = self._admit_interval
            self._admit_interval = gap if prev is None else 0.8 * prev + 0.2 * gap
        self._last_admit = now
        return item

    def remove(self, item: T) -> bool:
        """Drop `item` (cancelled or expired while waiting); False if it is not queued."""
        for i, e in enumerate(self._heap):
            if e.item is item:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def drain(self) -> list[T]:
        items = [e.item for e in sorted(self._heap)]
        self._heap.clear()
        return items

    def retry_after_s(self) -> float:
        """Seconds until a place in the queue is likely free: one admission interval."""
        if self._admit_interval is None:
            return RETRY_AFTER_UNKNOWN_S
        return min(max(self._admit_interval, RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)
