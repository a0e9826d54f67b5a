"""Hand the C heap's free pages back to the system now and then (glibc only).

A long-running daemon frees as much as it allocates, but glibc's malloc keeps freed
pages in its arenas (one per thread that allocated: the event loop, the step thread,
MLX's workers), so resident memory creeps up with no live object behind it: the 30-minute
soak measured +7% with flat Python-object, MLX and malloc in-use counts
(docs/RELIABILITY.md). `malloc_trim(0)` returns those pages; it costs a few milliseconds
and runs on the event loop between steps, every `TRIM_INTERVAL_S`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

import anyio

log = logging.getLogger(__name__)

TRIM_INTERVAL_S = 30.0


def malloc_trim() -> Callable[[], int] | None:
    """glibc's `malloc_trim(0)` as a callable, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # musl, macOS: no such function
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: int(fn(0))


async def trim_forever(interval_s: float = TRIM_INTERVAL_S) -> None:
    trim = malloc_trim()
    if trim is None:
        log.info("no malloc_trim in this C library: freed heap pages stay with the process")
        return
    while True:
        await anyio.sleep(interval_s)
        trim()
