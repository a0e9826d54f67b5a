"""The process's heaps: the Python collector settled after warm-up (`settle_collector`), and
the C heap's free pages handed back to the system now and then (glibc only).

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
import gc
import logging
from collections.abc import Callable

import anyio

log = logging.getLogger(__name__)

TRIM_INTERVAL_S = 30.0
YOUNG_THRESHOLD = 20_000
"""Net container allocations that start a young-generation collection (Python's default:
700). A decode step allocates thousands of short-lived containers per thousand rows (rows,
outputs, Deltas) and frees them within the step; at 700 that ran several young collections
per step and several full ones a second, ~1.1 µs of CPU per streamed token at 1024 rows
(PERFORMANCE.md, issue 6). Long-lived garbage still starts one after this many."""


def settle_collector() -> None:
    """Call once the process has warmed up. What exists then (model, tokenizer, pool,
    compiled graphs) lives as long as the process: collect, then freeze it, so that no
    full collection scans it again (~20% of the host's CPU per token at 1024 rows); and
    raise the young generation's threshold to `YOUNG_THRESHOLD`."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)


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
