"""Liveness: a killed client process, a silent client, a client that stops reading.

None of them may hold slots or stall the engine: their requests end and their slots free.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from anyio.abc import Process
from serving import RawPeer, Tiny, load_tiny, new_scheduler, serve, serve_scheduler

from scheduler import FinishReason
from transport import protocol as p
from transport.server import Server

HEARTBEAT_S = 1.0

# Four long greedy requests from one connection, read slowly; prints once all have started.
VICTIM = """
import sys, time
from transport.client import SyncClient
with SyncClient(sys.argv[1]) as client:
    streams = [client.generate([1, 2, 3 + i], max_tokens=400, ignore_eos=True) for i in range(4)]
    for s in streams:
        next(s)
    print("streaming", flush=True)
    for s in streams:
        for _ in s:
            time.sleep(0.01)
"""


@pytest.fixture(scope="module")
def tiny(make_model: Callable[..., Path]) -> Tiny:
    return load_tiny(make_model("tiny"))


async def until(condition: Callable[[], bool], timeout: float) -> float:
    """Poll `condition` every millisecond; seconds it took (fails after `timeout`)."""
    t0 = time.monotonic()
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.sleep(0.001)
    return time.monotonic() - t0


def idle(server: Server, n_slots: int) -> bool:
    s = server.stats()
    return s.requests_running == 0 and s.requests_waiting == 0 and s.free_slots == n_slots


@pytest.mark.parametrize("kind", ["ipc", "tcp"])
async def test_a_client_killed_mid_stream_has_its_requests_cancelled_and_slots_freed_within_one_heartbeat(
    tiny: Tiny, tmp_path: Path, kind: str
) -> None:
    address = f"ipc://{tmp_path}/s.sock" if kind == "ipc" else "tcp://127.0.0.1:0"
    scheduler = new_scheduler(tiny, n_slots=4, context=512)
    config = {"heartbeat_interval_s": HEARTBEAT_S, "heartbeat_timeout_s": 3 * HEARTBEAT_S}
    async with serve_scheduler(scheduler, [address], **config) as (server, (bound,)):
        victim: Process = await anyio.open_process(
            [sys.executable, "-c", VICTIM, bound], cwd=Path(__file__).parents[1]
        )
        async with victim:
            assert victim.stdout is not None
            with anyio.fail_after(30):
                assert b"streaming" in await victim.stdout.receive()
            assert server.stats().requests_running == 4
            victim.send_signal(signal.SIGKILL)
            freed_s = await until(lambda: idle(server, 4), timeout=5 * HEARTBEAT_S)
        stats = server.stats()
    assert freed_s < HEARTBEAT_S, f"slots freed after {freed_s:.3f} s"
    assert stats.dead_clients == 1 and stats.clients == 0
    assert scheduler.stats().finished == {FinishReason.CANCELLED: 4}


async def test_a_silent_client_is_dropped_after_the_heartbeat_timeout(
    tiny: Tiny, tmp_path: Path
) -> None:
    config = {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 0.3}
    async with serve(tiny, [f"ipc://{tmp_path}/s.sock"], **config) as (server, (address,)):
        silent = RawPeer(address)
        await silent.hello()
        silent.send(p.Generate(1, p.TokenPrompt([1, 2]), max_tokens=150, ignore_eos=True))
        assert isinstance(await silent.recv(), p.Accepted)
        t0 = time.monotonic()
        await until(lambda: idle(server, 8), timeout=2.0)
        dropped_s = time.monotonic() - t0
        stats = server.stats()
        silent.send(p.Ping(7))  # the session is gone
        while not isinstance(reply := await silent.recv(), p.Error):
            pass
        silent.close()
    assert 0.2 < dropped_s < 1.0  # the 0.3 s timeout, a check interval and slack
    assert stats.dead_clients == 1 and stats.failed == 1
    assert reply.code == p.ErrorCode.NO_SESSION


async def test_a_client_that_stops_reading_has_its_requests_cancelled_not_the_engine_stalled(
    tiny: Tiny,
) -> None:
    config = {"send_buffer": 4, "zmq_sndhwm": 4}
    async with serve(tiny, ["tcp://127.0.0.1:0"], **config) as (server, (address,)):
        reader = RawPeer(address, rcvhwm=1, rcvbuf=4096)
        await reader.hello()
        for rid in range(8):  # big Deltas: 20 log-probabilities per token
            prompt = p.TokenPrompt([rid + 1, 2])
            reader.send(p.Generate(rid, prompt, max_tokens=150, ignore_eos=True, logprobs=20))
        await until(lambda: server.stats().slow_consumers == 1, timeout=10)
        await until(lambda: idle(server, 8), timeout=2)
        stalled = server.stats()
        with anyio.fail_after(10):  # reading again: everything sent, then one error per request
            ends: dict[int, p.Finished | p.Error] = {}
            while len(ends) < 8:
                if isinstance(m := await reader.recv(), p.Finished | p.Error):
                    assert m.request_id is not None
                    ends[m.request_id] = m
            reader.send(p.Generate(99, p.TokenPrompt([1]), max_tokens=2))
            while not isinstance(m := await reader.recv(), p.Finished):
                pass
        reader.close()
    assert stalled.failed == 8 and stalled.generated_tokens < 8 * 150
    assert all(isinstance(e, p.Error) and e.code == p.ErrorCode.CANCELLED for e in ends.values())
    assert all("slow consumer" in e.message for e in ends.values() if isinstance(e, p.Error))
