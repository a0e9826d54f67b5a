"""Test-only fault injection for the daemon: `SLOTSERVE_TEST_FAULTS`, read once at start.

Off unless that environment variable is set in the daemon's own environment; nothing
a client sends can turn it on or change it (the wire only chooses request ids, and a
plan names the ids it faults). The soak and fault tests (tests/soak/) set it to prove
that a fault ends only the requests it touches and the daemon goes on serving.

The value is a comma-separated list of `KIND=REQUEST_ID` (`slow=REQUEST_ID:SECONDS`),
where REQUEST_ID is the id a client gave its Generate, on any connection:

    raise  an exception in every forward that holds the request: the runner's state
           for that forward is unknown, so all of the forward's requests fail (INTERNAL)
    row    the runner rejects the request's row before running anything (a `BatchError`):
           the step bisects to the row, so only that request fails (INTERNAL)
    nan    the request's row gets NaN logits: only that request fails (INTERNAL)
    slow   the first forward that holds the request sleeps SECONDS on the step thread
           (nothing fails; the event loop keeps answering Ping and Stats meanwhile)

e.g. `SLOTSERVE_TEST_FAULTS="row=900001,nan=900002,slow=900003:4"`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.runner import BatchError

log = logging.getLogger("slotserve.daemon")

ENV = "SLOTSERVE_TEST_FAULTS"
KINDS = ("raise", "row", "nan", "slow")


class FaultPlanError(ValueError):
    """The fault plan's text cannot be read."""


class InjectedFault(RuntimeError):
    """The exception a `raise` fault throws inside a step."""


@dataclass
class FaultPlan:
    """A `scheduler.step.FaultHook`: called on the step thread with the scheduler ids
    (`"SESSION/REQUEST_ID"`, see `transport.server`) of each forward."""

    raises: frozenset[int] = frozenset()
    rows: frozenset[int] = frozenset()
    nans: frozenset[int] = frozenset()
    slow: dict[int, float] = field(default_factory=dict)
    _slowed: set[str] = field(default_factory=set)  # scheduler ids already slowed once
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        plan: dict[str, dict[int, float]] = {kind: {} for kind in KINDS}
        for item in filter(None, (part.strip() for part in text.split(","))):
            kind, _, target = item.partition("=")
            rid, _, seconds = target.partition(":")
            if kind not in KINDS or not rid.isdigit() or (seconds != "") != (kind == "slow"):
                raise FaultPlanError(
                    f"{ENV}: cannot read {item!r}; expected KIND=REQUEST_ID with KIND one of "
                    f"{', '.join(KINDS)} (slow=REQUEST_ID:SECONDS)"
                )
            try:
                plan[kind][int(rid)] = float(seconds or 0)
            except ValueError:
                raise FaultPlanError(f"{ENV}: {item!r}: SECONDS must be a number") from None
        return cls(
            frozenset(plan["raise"]), frozenset(plan["row"]), frozenset(plan["nan"]), plan["slow"]
        )

    def __call__(self, ids: list[str]) -> list[str]:
        wire = {i: _wire_id(i) for i in ids}
        for i, rid in wire.items():
            seconds = self.slow.get(rid) if rid is not None else None
            if seconds is not None:
                with self._lock:
                    first = i not in self._slowed
                    self._slowed.add(i)
                if first:
                    time.sleep(seconds)
        hit = {rid for rid in wire.values() if rid is not None}
        if hit & self.raises:
            raise InjectedFault(f"injected fault: an exception in a step (ids {sorted(hit)})")
        if hit & self.rows:
            raise BatchError(f"injected fault: a bad row (ids {sorted(hit & self.rows)})")
        return [i for i, rid in wire.items() if rid in self.nans]


def _wire_id(scheduler_id: str) -> int | None:
    session, _, rid = scheduler_id.rpartition("/")
    return int(rid) if session and rid.isdigit() else None


def from_environment(env: Mapping[str, str]) -> FaultPlan | None:
    """The plan in `env[ENV]`, or None (the default: no fault injection)."""
    text = env.get(ENV, "").strip()
    if not text:
        return None
    plan = FaultPlan.parse(text)
    log.warning("fault injection is ON (%s=%s): for tests only", ENV, text)
    return plan
