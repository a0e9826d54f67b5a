"""The daemon's heaps (transport/daemon/heap.py): the collector settled after warm-up, and
the periodic heap trim.

What the trim does for resident memory is measured by the soak (docs/RELIABILITY.md);
here: the daemon finds glibc's `malloc_trim` and can call it.
"""

from __future__ import annotations

import gc
import platform
import sys

import pytest

from transport.daemon.heap import YOUNG_THRESHOLD, malloc_trim, settle_collector


def test_settling_the_collector_freezes_what_exists_and_raises_the_young_threshold() -> None:
    before = gc.get_threshold()
    kept = [1, 2]  # what exists at warm-up: a container the collector tracks
    assert any(o is kept for o in gc.get_objects())
    try:
        settle_collector()
        # frozen: in the permanent generation, which no collection scans
        assert not any(o is kept for o in gc.get_objects())
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *before[1:])
        cycle: list[object] = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1  # garbage made afterwards is still collected
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


@pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_the_daemon_finds_and_calls_glibc_malloc_trim() -> None:
    trim = malloc_trim()
    assert trim is not None, "glibc has malloc_trim: the daemon must find it"
    assert trim() in (0, 1)  # glibc's contract: 1 when memory was released
