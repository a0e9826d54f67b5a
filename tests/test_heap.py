"""The daemon's periodic heap trim (transport/daemon/heap.py)."""

from __future__ import annotations

import platform
import sys

import pytest

from transport.daemon.heap import malloc_trim


@pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_glibc_trim_returns_freed_pages_to_the_system() -> None:
    trim = malloc_trim()
    assert trim is not None
    junk = [bytearray(4096) for _ in range(20_000)]  # ~80 MB in small blocks
    del junk
    assert trim() in (0, 1)  # 1: some memory was released
