"""Which CPUs the daemon runs on: the `cpus` setting.

On a GPU a decode step is bound by the host as much as by the device: building the step's
graph and launching its ~150 kernels is Python and driver work on one core. On the H200
machine (16 vCPUs, one NUMA node as reported) the same benchmark process landed in one of
two modes, ~10,500 or ~7,200 tokens/s at 32 rows, the slow one with its graph building
~1.7x slower (0.58 against 0.34 ms a step); pinned to CPUs 0-7 it ran fast in every run
(docs/PERFORMANCE.md, H200 section, session 14). A VM need not report where its vCPUs sit
relative to the GPU, so this is an operator's setting, not something the daemon guesses.

The affinity is set on every thread the process has when the model starts loading and on
the calling thread, whose threads (MLX's, ZeroMQ's, the step thread) inherit it.
"""

from __future__ import annotations

import contextlib
import os
import re

_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


class CpuError(ValueError):
    """A CPU list that cannot be parsed or honoured; the message says which CPUs and why."""


def parse(text: str) -> frozenset[int] | None:
    """A Linux CPU list ("0-7", "0,2,4-5"; as `taskset -c` takes) as a set of CPU numbers;
    "" means no pinning (None)."""
    if not text.strip():
        return None
    cpus: set[int] = set()
    for piece in text.split(","):
        m = _RANGE.match(piece)
        if m is None:
            raise CpuError(f'expected a CPU list like "0-7" or "0,2,4-5", got {text!r}')
        first, last = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if last < first:
            raise CpuError(f"the range {piece.strip()!r} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def allowed() -> frozenset[int]:
    """The CPUs this process may run on now (Linux); raises `CpuError` where the platform
    cannot pin a process."""
    if not hasattr(os, "sched_getaffinity"):
        raise CpuError("pinning to CPUs needs Linux (os.sched_setaffinity); leave cpus empty")
    return frozenset(os.sched_getaffinity(0))


def check(cpus: frozenset[int]) -> frozenset[int]:
    """`cpus` if this process may run on all of them, else a `CpuError` naming the others."""
    may = allowed()
    if not cpus <= may:
        raise CpuError(
            f"CPUs {format_list(cpus - may)} are not available to this process "
            f"(it may run on {format_list(may)})"
        )
    return cpus


def pin(cpus: frozenset[int]) -> None:
    """Keep the whole process to `cpus`: every thread it has (an import may have started
    some: numpy's OpenBLAS starts its pool when it loads) and, through the calling
    thread's affinity, every thread started from now on."""
    check(cpus)
    for task in os.listdir("/proc/self/task"):  # Linux takes a thread id for a pid
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(int(task), cpus)
    os.sched_setaffinity(0, cpus)


def format_list(cpus: frozenset[int] | set[int]) -> str:
    """`cpus` as a CPU list, runs joined: {0, 1, 2, 5} -> "0-2,5"."""
    runs: list[list[int]] = []  # [first, last] of each run
    for c in sorted(cpus):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
