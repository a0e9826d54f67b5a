"""The scheduler's step thread: where every step (and every other MLX call) of it runs.

The loop hands the thread one call at a time and, while it runs, publishes the last
step on the event loop. `anyio.to_thread` was the step thread before: handing a call to
its pool takes several turns of the event loop (a checkpoint, the capacity limiter,
starting a task), and the loop had to spin through them before it could publish; at 64
decode rows that hand-off cost more of the loop's CPU than publishing the step did.
Here the call is queued at once and the thread is woken through a pipe; the call's end
is handed to the loop as a callback (`call_soon_threadsafe`), which resolves the call's
future. Waiting on the pipe back instead (`anyio.wait_readable`) registered and removed
the descriptor with epoll for every call: 50-55 µs of the loop's CPU per call against
32-35 (a call of 0.5 ms, 3,000 calls, 3 runs each).

The thread needs an asyncio event loop (anyio's asyncio backend, the one slotserve runs).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from typing import Any, Generic, TypeVar, cast

import anyio

T = TypeVar("T")


class Job(Generic[T]):
    """One call handed to the step thread; `done` resolves (on the loop) once it has run."""

    __slots__ = ("_started", "call", "done", "error", "result")

    def __init__(self, call: Callable[[], T], done: asyncio.Future[None]) -> None:
        self.call = call
        self.done = done
        # held until the thread takes the call (a bare lock: a threading.Event is a
        # Condition and two locks, made for every step)
        self._started = threading.Lock()
        self._started.acquire()
        self.result: T | None = None
        self.error: BaseException | None = None

    def wait_started(self) -> None:
        """Block, the GIL released, until the thread has taken the call."""
        self._started.acquire()
        self._started.release()


class StepThread:
    """One thread that runs calls in the order they are started, for one event loop (made
    on it).

    `start(call)` queues `call` (the thread takes it at once, with no turn of the loop);
    `job.wait_started()` blocks, the GIL released, until the thread has it — so Python
    work the caller does next does not hold the call back; `await finish(job)` waits
    without blocking the loop and returns the call's result or raises its exception.
    Waiting is shielded from cancellation, as the call runs on regardless. `close()`
    ends the thread after the calls started so far.
    """

    def __init__(self, name: str = "slotserve-step") -> None:
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("a StepThread is made on a running asyncio event loop") from None
        self._jobs: deque[Job[Any] | None] = deque()
        # The thread is woken by a byte through a pipe, whose write releases the GIL (a
        # lock's release, as queue.SimpleQueue.put does it, wakes the thread with the GIL
        # held: should the OS run the thread at once, the loop waits off-CPU holding the GIL
        # and neither runs — a quarter of the GIL samples at 64 rows, py-spy --gil).
        self._go_r, self._go_w = os.pipe()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def start(self, call: Callable[[], T]) -> Job[T]:
        job: Job[T] = Job(call, self._loop.create_future())
        self._jobs.append(job)
        os.write(self._go_w, b"j")
        return job

    async def finish(self, job: Job[T]) -> T:
        with anyio.CancelScope(shield=True):
            await job.done
        if job.error is not None:
            raise job.error
        return cast(T, job.result)  # (set: the call returned)

    async def run(self, call: Callable[[], T]) -> T:
        return await self.finish(self.start(call))

    def close(self) -> None:
        self._jobs.append(None)
        os.write(self._go_w, b"j")
        self._thread.join()
        for fd in (self._go_r, self._go_w):
            os.close(fd)

    def _work(self) -> None:
        while os.read(self._go_r, 1) and (job := self._jobs.popleft()) is not None:
            job._started.release()
            try:
                job.result = job.call()
            except BaseException as e:  # the caller's to handle, as if it had made the call
                job.error = e
            with suppress(RuntimeError):  # (the loop has closed: nobody is waiting)
                self._loop.call_soon_threadsafe(_resolve, job.done)


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():  # (cancelled: its waiter is gone)
        done.set_result(None)
