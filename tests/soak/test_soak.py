"""Two minutes of every kind of traffic against the real daemon: nothing may be lost.

The same harness runs for 30 minutes from the command line (docs/RELIABILITY.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from soak import SoakConfig, run_soak

DURATION_S = 100.0  # plus start-up, settling and the idle checks: about two minutes
# Memory is compared with its level after this: the runner's cache of batch-shape
# forwards (256) fills in about a minute of this traffic, the allocator's with it.
WARMUP_S = 60.0


def test_two_minutes_of_mixed_traffic_and_abuse_lose_nothing_and_leak_nothing(
    make_model: Callable[..., Path], tmp_path: Path
) -> None:
    config = SoakConfig(model=make_model("tiny"), duration_s=DURATION_S, warmup_s=WARMUP_S)
    report = run_soak(config)
    (tmp_path / "soak.json").write_text(json.dumps(vars(report), default=str))
    print(report.table())
    assert report.problems() == []
    # The abuse really happened: each kind of traffic ran and got its kind of answer.
    kinds = report.by_kind
    assert kinds["normal"]["finished"] > 50 and kinds["spec"]["finished"] > 5
    assert kinds["chat"].get("finished", 0) > 5
    assert kinds["cancel"].get("CANCELLED", 0) > 0
    assert kinds["deadline"].get("DEADLINE_EXCEEDED", 0) > 0
    assert kinds["burst"].get("BUSY", 0) > 0  # twice the admission capacity is refused
    assert kinds["invalid"].get("INVALID_REQUEST", 0) + kinds["invalid"].get("TOO_LONG", 0) > 0
    assert kinds["fault-nan"].get("INTERNAL", 0) > 0 and kinds["fault-row"].get("INTERNAL", 0) > 0
    assert kinds["killed"].get("orphaned", 0) > 0 and kinds["slow"].get("finished", 0) > 0
    counts = report.counts
    assert counts["client processes killed (SIGKILL)"] >= 1
    assert counts["oversized frames sent"] >= 1
    assert counts["malformed answered"] == counts["malformed frames sent"] > 0
    assert report.stats["frames_rejected"] >= counts["malformed frames sent"]
    assert report.stats["dead_clients"] >= counts["connections killed"]
    assert report.ping_ms["n"] > DURATION_S  # two a second, all answered
