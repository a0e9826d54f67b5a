"""The scheduler's step thread: where every step (and every other MLX call) of it runs.

The loop hands the thread one call at a time and, while it runs, publishes the last
step on the event loop. `anyio.to_thread` was the step thread before: handing a call to
its pool takes several turns of the event loop (a checkpoint, the capacity limiter,
starting a task), and the loop had to spin through them before it could publish; at 64
decode rows that hand-off cost more of the loop's CPU than publishing the step did.
Here the call is queued at once, the thread is woken through a pipe, and the call's end
wakes the loop through another.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

import anyio

T = TypeVar("T")


class Job(Generic[T]):
    """One call handed to the step thread; `started` is set once the thread has it."""

    __slots__ = ("call", "done", "error", "result", "started")

    def __init__(self, call: Callable[[], T]) -> None:
        self.call = call
        self.started = threading.Event()
        self.done = False
        self.result: T | None = None
        self.error: BaseException | None = None


class StepThread:
    """One thread that runs calls in the order they are started, for one event loop.

    `start(call)` queues `call` (the thread takes it at once, with no turn of the loop);
    `job.started.wait()` blocks, the GIL released, until the thread has it — so Python
    work the caller does next does not hold the call back; `await finish(job)` waits
    without blocking the loop and returns the call's result or raises its exception.
    Waiting is shielded from cancellation, as the call runs on regardless. `close()`
    ends the thread after the calls started so far.
    """

    def __init__(self, name: str = "slotserve-step") -> None:
        self._jobs: deque[Job[Any] | None] = deque()
        # A byte per call each way. The thread is woken by a write, which releases the GIL
        # (a lock's release, as queue.SimpleQueue.put does it, wakes the thread with the GIL
        # held: should the OS run the thread at once, the loop waits off-CPU holding the GIL
        # and neither runs — a quarter of the GIL samples at 64 rows, py-spy --gil).
        self._go_r, self._go_w = os.pipe()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def start(self, call: Callable[[], T]) -> Job[T]:
        job: Job[T] = Job(call)
        self._jobs.append(job)
        os.write(self._go_w, b"j")
        return job

    async def finish(self, job: Job[T]) -> T:
        with anyio.CancelScope(shield=True):
            while not job.done:  # (a byte may be left by a call nobody awaited)
                await anyio.wait_readable(self._wake_r)
                os.read(self._wake_r, 64)
        if job.error is not None:
            raise job.error
        return cast(T, job.result)  # (set: the call returned)

    async def run(self, call: Callable[[], T]) -> T:
        return await self.finish(self.start(call))

    def close(self) -> None:
        self._jobs.append(None)
        os.write(self._go_w, b"j")
        self._thread.join()
        for fd in (self._go_r, self._go_w, self._wake_r, self._wake_w):
            os.close(fd)

    def _work(self) -> None:
        while os.read(self._go_r, 1) and (job := self._jobs.popleft()) is not None:
            job.started.set()
            try:
                job.result = job.call()
            except BaseException as e:  # the caller's to handle, as if it had made the call
                job.error = e
            job.done = True
            os.write(self._wake_w, b"x")
