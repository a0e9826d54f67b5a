"""The daemon's periodic heap trim (transport/daemon/heap.py).

What the trim does for resident memory is measured by the soak (docs/RELIABILITY.md);
here: the daemon finds glibc's `malloc_trim` and can call it.
"""

from __future__ import annotations

import platform
import sys

import pytest

from transport.daemon.heap import malloc_trim


@pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_the_daemon_finds_and_calls_glibc_malloc_trim() -> None:
    trim = malloc_trim()
    assert trim is not None, "glibc has malloc_trim: the daemon must find it"
    assert trim() in (0, 1)  # glibc's contract: 1 when memory was released
