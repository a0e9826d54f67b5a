"""Faults inside the running daemon, and the daemon itself killed: what clients see.

Engine faults come from the daemon's test-only fault plan (`SLOTSERVE_TEST_FAULTS`,
transport/daemon/faults.py), set in the daemon's environment; the requests it faults
are named by the request ids the clients choose.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from peer import Outcome, Peer

from transport import protocol as p
from transport.client import Client, ConnectionLost
from transport.daemon.demo import Supervised
from transport.daemon.faults import ENV, FaultPlan, FaultPlanError

RAISE, ROW, NAN, SLOW = 900_001, 900_002, 900_003, 900_004
SLOW_S = 4.0  # longer than the heartbeat timeout (3 s): the loop must not be stuck
PLAN = f"raise={RAISE},row={ROW},nan={NAN},slow={SLOW}:{SLOW_S}"


@pytest.fixture(scope="module")
def model(make_model: Callable[..., Path]) -> Path:
    return make_model("tiny")


def daemon_args(model: Path, endpoint: str, context: int = 256) -> list[str]:
    args = ["--model", str(model), "--endpoints", endpoint, "--context", str(context)]
    return [*args, "--slots", "4", "--metrics-address", ""]


def prompt(i: int) -> p.TokenPrompt:
    return p.TokenPrompt([1 + i, 2, 3, 4, 5])


async def finish(*outcomes: Outcome) -> None:
    with anyio.fail_after(60):
        for o in outcomes:
            await o.done.wait()


async def idle_and_balanced(client: Client, slots: int) -> p.Stats:
    with anyio.fail_after(10):
        while True:
            s = await client.stats()
            if s.requests_running == 0 and s.requests_waiting == 0 and s.free_slots == slots:
                return s
            await anyio.sleep(0.05)


def test_the_fault_plan_reads_its_kinds_and_refuses_anything_else() -> None:
    plan = FaultPlan.parse(PLAN)
    assert (plan.raises, plan.rows, plan.nans, plan.slow) == (
        {RAISE},
        {ROW},
        {NAN},
        {SLOW: SLOW_S},
    )
    assert plan(["3/1", "4/2"]) == [] and plan(["3/1", f"7/{NAN}"]) == [f"7/{NAN}"]
    for bad in ("boom=1", "nan=x", "slow=5", "nan=5:1", "slow=5:soon"):
        with pytest.raises(FaultPlanError, match=ENV):
            FaultPlan.parse(bad)


def test_engine_faults_fail_only_their_requests_and_the_daemon_keeps_serving(
    model: Path, tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path}/d.sock"

    async def scenario() -> None:
        async with anyio.create_task_group() as tg, Client.connect(endpoint) as client:
            peer = Peer(endpoint)
            await peer.start(tg)

            # A NaN row and a bad row fail alone, among well-behaved neighbours.
            for fault in (NAN, ROW):
                good = [peer.generate("good", prompt(i), max_tokens=16) for i in range(3)]
                bad = peer.generate("bad", prompt(9), rid=fault, max_tokens=16)
                await finish(bad, *good)
                assert bad.terminals == ["INTERNAL"] and "fault" in bad.error
                assert [o.terminals for o in good] == [["finished"]] * 3

            # An exception in a step leaves that forward's slots in an unknown state: its
            # requests fail (those sharing the forward too), and only those.
            good = [peer.generate("good", prompt(i), max_tokens=16) for i in range(3)]
            bad = peer.generate("bad", prompt(9), rid=RAISE, max_tokens=16)
            await finish(bad, *good)
            assert bad.terminals == ["INTERNAL"] and "injected fault" in bad.error
            for o in good:
                assert o.terminals == ["finished"] or (
                    o.terminals == ["INTERNAL"] and "injected fault" in o.error
                )

            # A slow step: Ping and Stats are answered throughout, no session is lost,
            # the requests in the step finish, a deadline that passes meanwhile is kept.
            slow = peer.generate("slow", prompt(9), rid=SLOW, max_tokens=4)
            neighbour = client.generate([7, 8, 9], max_tokens=8, ignore_eos=True)
            await anyio.sleep(0.5)  # the slow step has begun
            late = peer.generate("late", prompt(5), max_tokens=8, deadline_ms=1000)
            pings = [await client.ping() for _ in range(int(SLOW_S / 0.25))]
            done = await neighbour.collect()
            await finish(slow, late)
            assert max(pings) < 1.0, pings  # a blocked loop would take the whole slow step
            assert slow.terminals == ["finished"] and len(done.tokens) == 8
            assert late.terminals == ["DEADLINE_EXCEEDED"]

            # Afterwards everything is served, and nothing is held.
            after = [peer.generate("after", prompt(i), max_tokens=8) for i in range(4)]
            await finish(*after)
            assert [o.terminals for o in after] == [["finished"]] * 4
            stats = await idle_and_balanced(client, 4)
            assert stats.submitted == stats.finished + stats.failed
            assert stats.reserved_bytes == 0
            assert not peer.connection_errors
            assert all(len(o.terminals) == 1 for o in peer.outcomes.values())
            peer.bye()

    with Supervised(daemon_args(model, endpoint), endpoint, env=os.environ | {ENV: PLAN}):
        anyio.run(scenario)


def test_kill_9_under_load_fails_every_stream_within_the_heartbeat_interval_and_a_restarted_daemon_serves(
    model: Path, tmp_path: Path
) -> None:
    """Also: without the environment variable no request id is faulted."""
    endpoint = f"ipc://{tmp_path}/d.sock"
    args = daemon_args(model, endpoint, context=4096)  # no request ends before the kill
    env = {k: v for k, v in os.environ.items() if k != ENV}
    first, second = Supervised(args, endpoint, env=env), Supervised(args, endpoint, env=env)

    async def scenario() -> None:
        async with Client.connect(endpoint) as client:
            assert client.welcome is not None
            interval = client.welcome.heartbeat_interval_ms / 1000
            lost_after: list[float] = []
            streams = [
                client.generate([i + 1, 2, 3], max_tokens=4000, ignore_eos=True) for i in range(6)
            ]
            killed = anyio.Event()
            t_kill = 0.0

            async def read(stream: object) -> None:
                try:
                    async for _ in stream:  # type: ignore[attr-defined]
                        await killed.wait()
                except ConnectionLost:
                    lost_after.append(time.monotonic() - t_kill)

            async with anyio.create_task_group() as tg:
                for stream in streams:
                    tg.start_soon(read, stream)
                await anyio.sleep(1.0)  # all six are streaming (4 slots, 2 waiting)
                assert first.proc is not None
                t_kill = time.monotonic()
                os.kill(first.proc.pid, signal.SIGKILL)
                killed.set()
            assert len(lost_after) == 6 and max(lost_after) < interval, lost_after

            await anyio.to_thread.run_sync(second.__enter__)  # restarted on the same endpoint
            with anyio.fail_after(30):
                while True:  # the client reconnects by itself
                    try:
                        done = await client.complete([5, 6, 7], max_tokens=8, ignore_eos=True)
                        break
                    except ConnectionLost:
                        await anyio.sleep(0.2)
            assert len(done.tokens) == 8

        async with anyio.create_task_group() as tg:  # no fault plan: ids are just ids
            peer = Peer(endpoint)
            await peer.start(tg)
            plain = [
                peer.generate("plain", prompt(i), rid=r, max_tokens=4)
                for i, r in enumerate((RAISE, ROW, NAN))
            ]
            await finish(*plain)
            assert [o.terminals for o in plain] == [["finished"]] * 3
            peer.bye()

    with first:
        try:
            anyio.run(scenario)
        finally:
            if second.proc is not None:
                second.stop()
    assert first.returncode == -signal.SIGKILL and second.returncode == 0
