"""The scheduler's step thread (scheduler/step_thread.py): calls run in order on one thread
of their own, their results and exceptions come back to the awaiting task, a cancelled
waiter still waits for its call, and the thread ends on close."""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
import anyio.lowlevel
import pytest

from scheduler.step_thread import StepThread


async def test_calls_run_in_order_on_one_thread_that_is_not_the_loops() -> None:
    thread = StepThread()
    try:
        seen = [await thread.run(lambda i=i: (i, threading.get_ident())) for i in range(5)]
    finally:
        thread.close()
    assert [i for i, _ in seen] == list(range(5))
    (ident,) = {t for _, t in seen}
    assert ident != threading.get_ident()
    assert ident not in {t.ident for t in threading.enumerate()}  # closed: gone


async def test_a_call_that_raises_raises_in_the_awaiting_task_and_the_thread_goes_on() -> None:
    def fail() -> None:
        raise KeyError("boom")

    thread = StepThread()
    try:
        with pytest.raises(KeyError, match="boom"):
            await thread.run(fail)
        assert await thread.run(lambda: 7) == 7
    finally:
        thread.close()


async def test_a_call_nobody_awaited_does_not_answer_for_the_next() -> None:
    """A call left behind (its caller failed before awaiting it) leaves its wake-up; the
    next call's result is still its own."""
    thread = StepThread()
    try:
        thread.start(lambda: "left behind")
        slow = thread.start(lambda: time.sleep(0.05) or "its own")
        slow.wait_started()  # (the first call has ended, and handed its end to the loop)
        assert await thread.finish(slow) == "its own"
    finally:
        thread.close()


async def test_a_cancelled_waiter_still_waits_for_its_call_and_gets_its_result() -> None:
    result = None
    thread = StepThread()
    try:
        with anyio.move_on_after(0.01) as scope:
            result = await thread.run(lambda: time.sleep(0.1) or "done")
            await anyio.lowlevel.checkpoint()  # where the cancellation reaches it
            pytest.fail("cancelled, yet not at its next checkpoint")
        assert scope.cancelled_caught
        assert result == "done"
        assert await thread.run(lambda: "next") == "next"  # the thread is free again
    finally:
        thread.close()


async def test_waiting_for_a_call_registers_no_descriptor_with_the_event_loop() -> None:
    """A call's end comes to the loop as a callback: no file descriptor is added to the
    loop's selector (and removed again) for every call, as waiting on a pipe did."""
    loop = asyncio.get_running_loop()
    watched = loop._selector.get_map  # type: ignore[attr-defined]  # (asyncio's selector loop)
    before = set(watched())
    seen: set[int] = set()
    thread = StepThread()
    try:
        async with anyio.create_task_group() as tg:

            async def look() -> None:
                while True:
                    seen.update(watched())
                    await anyio.sleep(0.005)

            tg.start_soon(look)
            assert await thread.run(lambda: time.sleep(0.05) or "done") == "done"
            tg.cancel_scope.cancel()
    finally:
        thread.close()
    assert seen <= before


def test_a_step_thread_is_made_on_a_running_event_loop() -> None:
    with pytest.raises(RuntimeError, match="running asyncio event loop"):
        StepThread()
