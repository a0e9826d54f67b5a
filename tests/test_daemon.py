"""`slotserve serve` as operators run it: a real subprocess, real sockets, real signals."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from transport import protocol as p
from transport.client import Client, ConnectionLost, RequestError
from transport.daemon.demo import Supervised


@pytest.fixture(scope="module")
def model(make_model: Callable[..., Path]) -> Path:
    return make_model("tiny")


def serve_args(model: Path, endpoint: str, *extra: str) -> list[str]:
    return ["--model", str(model), "--endpoints", endpoint, "--context", "256", *extra]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def run_requests(
    endpoint: str, n: int, max_tokens: int, on_all_started: Callable[[], None]
) -> tuple[dict[int, str], p.ErrorCode | None]:
    """`n` greedy requests on one connection; once each has a first token, call
    `on_all_started`, wait for the server to say DRAINING and try one more request.
    Returns each request's terminal ("finished" or an error code's name) and the code
    the late request got."""
    outcomes: dict[int, str] = {}
    started: set[int] = set()
    all_started = anyio.Event()

    async def one(client: Client, i: int) -> None:
        stream = client.generate([1 + i, 2, 3], max_tokens=max_tokens, ignore_eos=True)
        try:
            async for _ in stream:
                started.add(i)
                if len(started) == n:
                    all_started.set()
            outcomes[i] = "finished" if stream.finished is not None else "none"
        except RequestError as e:
            outcomes[i] = e.code.name
        except ConnectionLost:
            outcomes[i] = "lost"

    async with Client.connect(endpoint) as client, anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, client, i)
        with anyio.fail_after(30):
            await all_started.wait()
        on_all_started()
        with anyio.fail_after(10):
            while (await client.stats()).state != p.ServerState.DRAINING:
                await anyio.sleep(0.01)
        late: p.ErrorCode | None = None
        try:
            await client.complete("too late", max_tokens=2)
        except RequestError as e:
            late = e.code
    return outcomes, late


def test_sigterm_lets_all_20_running_requests_finish_and_exits_0(
    model: Path, tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path}/d.sock"
    args = serve_args(model, endpoint, "--slots", "20", "--metrics-address", "")
    with Supervised(args, endpoint) as daemon:
        outcomes, late = anyio.run(
            run_requests, endpoint, 20, 200, lambda: daemon.signal(signal.SIGTERM)
        )
        status = daemon.wait()
    assert outcomes == {i: "finished" for i in range(20)}
    assert late == p.ErrorCode.SHUTTING_DOWN
    assert status == 0


def test_requests_still_running_past_the_drain_timeout_end_with_shutting_down(
    model: Path, tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path}/d.sock"
    args = ["--model", str(model), "--endpoints", endpoint, "--context", "4096"]
    args += ["--slots", "4", "--metrics-address", "", "--drain-timeout", "0.2"]
    with Supervised(args, endpoint) as daemon:
        outcomes, _ = anyio.run(
            run_requests, endpoint, 4, 4000, lambda: daemon.signal(signal.SIGTERM)
        )
        status = daemon.wait()
    assert outcomes == {i: "SHUTTING_DOWN" for i in range(4)}
    assert status == 0


def test_a_second_signal_exits_at_once(model: Path, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/d.sock"
    args = ["--model", str(model), "--endpoints", endpoint, "--context", "4096"]
    args += ["--slots", "2", "--metrics-address", "", "--drain-timeout", "600"]

    async def signal_twice_while_draining(daemon: Supervised) -> float:
        async with Client.connect(endpoint) as client:
            streams = [client.generate([i + 1, 2], max_tokens=4000) for i in range(2)]
            for stream in streams:
                await stream.next_delta()
            daemon.signal(signal.SIGTERM)
            while (await client.stats()).state != p.ServerState.DRAINING:
                await anyio.sleep(0.01)
            daemon.signal(signal.SIGINT)
            t0 = time.monotonic()
            assert daemon.proc is not None
            await anyio.to_thread.run_sync(daemon.proc.wait, 10)
            return time.monotonic() - t0

    with Supervised(args, endpoint) as daemon:
        elapsed = anyio.run(signal_twice_while_draining, daemon)
        status = daemon.wait()
    assert status == 1 and elapsed < 5
