"""The transport end to end: real clients, real ipc and tcp sockets, the real scheduler.

"Solo run" is plain greedy decoding of the same prompt on a one-slot pool
(`engine.generate.greedy_tokens`), which the scheduler's own tests tie to a
one-slot scheduler run.
"""

from __future__ import annotations

import functools
import gc
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from serving import RawPeer, Tiny, load_tiny, new_scheduler, serve

from engine.generate import greedy_tokens
from transport import protocol as p
from transport.client import Client, ConnectionLost, RequestError, SyncClient
from transport.server import ModelInfo, Server, ServerConfig


@pytest.fixture(scope="module")
def tiny(make_model: Callable[..., Path]) -> Tiny:
    return load_tiny(make_model("tiny"))


def endpoint(kind: str, tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/s.sock" if kind == "ipc" else "tcp://127.0.0.1:0"


@asynccontextmanager
async def connected(tiny: Tiny, tmp_path: Path) -> AsyncIterator[tuple[Server, Client]]:
    """A server on ipc and one client connected to it."""
    async with (
        serve(tiny, [endpoint("ipc", tmp_path)]) as (server, (address,)),
        Client.connect(address) as client,
    ):
        yield server, client


@functools.cache
def solo(tiny: Tiny, prompt: tuple[int, ...], n: int) -> list[int]:
    return greedy_tokens(tiny[0], prompt, n)


def prompts(tiny: Tiny, n: int, seed: int = 0) -> list[tuple[p.Prompt, list[int]]]:
    """`n` prompts of mixed kinds (tokens, text, chat) with their token ids."""
    rng = random.Random(seed)
    tokenizer = tiny[1]
    out: list[tuple[p.Prompt, list[int]]] = []
    for i in range(n):
        if i % 3 == 0:
            text = " ".join(rng.choice(["cat", "dog", "one", "two", "the"]) for _ in range(6))
            out.append((p.TextPrompt(text), tokenizer.encode(text)))
        elif i % 3 == 1 and i % 2 == 0:
            msg = {"role": "user", "content": f"question {i}"}
            ids = tokenizer.encode(tokenizer.render_chat([msg]))
            out.append((p.ChatPrompt([p.ChatMessage(msg["role"], msg["content"])]), ids))
        else:
            ids = [rng.randrange(0, 500) for _ in range(rng.randrange(3, 40))]
            out.append((p.TokenPrompt(ids), ids))
    return out


@pytest.mark.parametrize("kind", ["ipc", "tcp"])
async def test_16_clients_with_4_requests_each_stream_their_solo_greedy_outputs(
    tiny: Tiny, tmp_path: Path, kind: str
) -> None:
    cases = prompts(tiny, 64)
    lengths = [4 + i % 13 for i in range(64)]
    got: dict[int, tuple[list[int], str, int | None, p.Finished | None]] = {}

    async def one(client: Client, i: int) -> None:
        tokens: list[int] = []
        text = ""
        stream = client.generate(cases[i][0], max_tokens=lengths[i], temperature=0, ignore_eos=True)
        async for delta in stream:
            assert delta.request_id == stream.request_id
            tokens += delta.tokens
            text += delta.text
        got[i] = (tokens, text, stream.prompt_tokens, stream.finished)

    async def client(c: int, address: str) -> None:
        async with Client.connect(address) as cl, anyio.create_task_group() as tg:
            for r in range(4):
                tg.start_soon(one, cl, 4 * c + r)

    async with serve(tiny, [endpoint(kind, tmp_path)]) as (server, (address,)):
        async with anyio.create_task_group() as tg:
            for c in range(16):
                tg.start_soon(client, c, address)
        stats = server.stats()
    assert stats.finished == 64 and stats.failed == 0 and stats.rejected == 0
    for i, (prompt, ids) in enumerate(cases):
        tokens, text, prompt_tokens, finished = got[i]
        assert tokens == solo(tiny, tuple(ids), lengths[i]), f"request {i} ({prompt})"
        assert text == tiny[1].decode(tokens)
        assert prompt_tokens == len(ids)
        assert finished is not None and finished.reason == p.FinishReason.LENGTH
        assert finished.usage == p.Usage(len(ids), lengths[i])


async def greedy_by_hand(address: str, n: int, max_tokens: int) -> list[p.ServerMessage]:
    """`n` greedy requests (prompts `[i + 1, 2, 3]`) from a bare peer: every message the
    server sent until each had its terminal."""
    raw = RawPeer(address)
    await raw.hello()
    for rid in range(n):
        prompt = p.TokenPrompt([rid + 1, 2, 3])
        raw.send(p.Generate(rid, prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True))
    messages: list[p.ServerMessage] = []
    while sum(isinstance(m, p.Finished | p.Error) for m in messages) < n:
        messages.append(await raw.recv())
    raw.close()
    return messages


async def test_one_steps_tokens_for_a_connection_travel_in_one_deltas_message(
    tiny: Tiny, tmp_path: Path
) -> None:
    """Every step makes tokens here (3-token prompts prefill in one step and sample their
    first token), so there is one Deltas message per step, whenever each request started."""
    async with serve(tiny, [endpoint("ipc", tmp_path)]) as (server, (address,)):
        messages = await greedy_by_hand(address, 4, 12)
        steps = server.stats().steps
    batches = [[d.request_id for d in m.items] for m in messages if isinstance(m, p.Deltas)]
    assert sum(len(b) for b in batches) == 4 * 12
    assert all(len(set(b)) == len(b) for b in batches)
    assert len(batches) == steps < 2 * 12


async def test_an_observer_that_raises_costs_no_request_its_tokens_or_its_terminal(
    tiny: Tiny, tmp_path: Path
) -> None:
    """The server relays events from the scheduler's publishing (an event sink per
    request); a failure of the metrics observer there must not reach the requests."""

    def observer(event: object) -> None:
        raise RuntimeError("metrics broke")

    scheduler = new_scheduler(tiny)
    config = ServerConfig(endpoints=(endpoint("ipc", tmp_path),))
    server = Server(scheduler, ModelInfo.of(scheduler, "tiny"), config, observer=observer)
    async with scheduler.running(), server.running() as (address,):
        messages = await greedy_by_hand(address, 3, 6)
    for rid in range(3):
        tokens = [
            t
            for m in messages
            if isinstance(m, p.Deltas)
            for d in m.items
            for t in d.tokens
            if d.request_id == rid
        ]
        ends = [m for m in messages if isinstance(m, p.Finished) and m.request_id == rid]
        assert tokens == solo(tiny, (rid + 1, 2, 3), 6)
        assert len(ends) == 1 and ends[0].reason == p.FinishReason.LENGTH
    assert not any(isinstance(m, p.Error) for m in messages)


async def test_bad_requests_get_specific_errors_and_the_connection_goes_on(
    tiny: Tiny, tmp_path: Path
) -> None:
    async with serve(tiny, [endpoint("ipc", tmp_path)], max_outstanding=2) as (_, (address,)):
        raw = RawPeer(address)
        await raw.hello()
        bad = {
            1: p.Generate(1, p.TokenPrompt([1, 2]), top_p=2.0),
            2: p.Generate(2, p.TokenPrompt([1] * 200)),
            3: p.Generate(3, p.TokenPrompt([1, 10**6])),
            4: p.Generate(4, p.TextPrompt("")),
        }
        raw.send(*bad.values())
        errors = [await raw.recv() for _ in bad]
        assert [(e.request_id, e.code) for e in errors if isinstance(e, p.Error)] == [
            (1, p.ErrorCode.INVALID_REQUEST),
            (2, p.ErrorCode.TOO_LONG),
            (3, p.ErrorCode.INVALID_REQUEST),
            (4, p.ErrorCode.INVALID_REQUEST),
        ]
        assert "top_p" in errors[0].message  # type: ignore[union-attr]

        long = p.TokenPrompt([5, 6, 7])
        raw.send(p.Generate(10, long, max_tokens=100), p.Generate(11, long, max_tokens=100))
        raw.send(p.Generate(10, long), p.Generate(12, long))
        replies = [await raw.recv() for _ in range(4)]
        assert [type(m) for m in replies] == [p.Accepted, p.Accepted, p.Error, p.Error]
        dup, busy = replies[2], replies[3]
        assert isinstance(dup, p.Error) and dup.request_id is None and "10" in dup.message
        assert isinstance(busy, p.Error) and (busy.request_id, busy.code) == (12, p.ErrorCode.BUSY)
        raw.send(p.Cancel(10), p.Cancel(11), p.Cancel(99))
        ends = []
        while len(ends) < 2:
            if isinstance(m := await raw.recv(), p.Error):
                ends.append((m.request_id, m.code))
        assert sorted(ends) == [(10, p.ErrorCode.CANCELLED), (11, p.ErrorCode.CANCELLED)]
        raw.close()


async def test_a_connection_without_hello_or_with_another_major_version_is_refused(
    tiny: Tiny, tmp_path: Path
) -> None:
    async with serve(tiny, [endpoint("tcp", tmp_path)]) as (server, (address,)):
        raw = RawPeer(address)
        raw.send(p.Generate(5, p.TokenPrompt([1])))
        reply = await raw.recv()
        assert isinstance(reply, p.Error) and (reply.code, reply.request_id) == (
            p.ErrorCode.NO_SESSION,
            5,
        )
        raw.send(p.Hello(p.PROTOCOL_MAJOR + 1, 0))
        reply = await raw.recv()
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.INVALID_REQUEST
        assert server.stats().clients == 0 and server.scheduler.stats().submitted == 0
        raw.close()


async def test_deadlines_end_requests_with_deadline_exceeded(tiny: Tiny, tmp_path: Path) -> None:
    async with connected(tiny, tmp_path) as (_, client):
        with pytest.raises(RequestError) as e:
            await client.complete([1, 2, 3], max_tokens=150, ignore_eos=True, deadline_ms=30)
    assert e.value.code == p.ErrorCode.DEADLINE_EXCEEDED


async def wait_idle(server_stats: Callable[[], p.Stats], timeout: float = 2.0) -> p.Stats:
    """Poll until nothing runs or waits; the last snapshot."""
    with anyio.fail_after(timeout):
        while (s := server_stats()).requests_running or s.requests_waiting:
            await anyio.sleep(0.005)
    return s


async def test_cancelling_the_consuming_task_cancels_the_request(
    tiny: Tiny, tmp_path: Path
) -> None:
    async with connected(tiny, tmp_path) as (server, client):
        with anyio.move_on_after(0.2):
            async for _ in client.generate([1, 2, 3], max_tokens=150, ignore_eos=True):
                pass
        stats = await wait_idle(server.stats)
    assert stats.failed == 1 and stats.finished == 0


async def test_a_client_timeout_cancels_the_request_and_raises(tiny: Tiny, tmp_path: Path) -> None:
    async with connected(tiny, tmp_path) as (server, client):
        with pytest.raises(TimeoutError):
            await client.complete([1, 2], max_tokens=150, ignore_eos=True, timeout_s=0.2)
        stats = await wait_idle(server.stats)
    assert stats.failed == 1


async def test_dropping_an_unfinished_stream_cancels_its_request(
    tiny: Tiny, tmp_path: Path
) -> None:
    async with connected(tiny, tmp_path) as (server, client):
        async for _ in client.generate([4, 5], max_tokens=150, ignore_eos=True):
            break
        gc.collect()
        stats = await wait_idle(server.stats)
        assert (await client.complete([4, 5], max_tokens=3)).finished.usage.completion_tokens
    assert stats.failed == 1


async def test_the_sync_client_streams_completes_and_reports(tiny: Tiny, tmp_path: Path) -> None:
    def use(address: str) -> tuple[list[int], list[int], p.Stats, float]:
        with SyncClient(address) as client:
            streamed = [
                t for d in client.generate([7, 8], max_tokens=6, temperature=0) for t in d.tokens
            ]
            whole = client.complete([7, 8], max_tokens=6, temperature=0).tokens
            return streamed, whole, client.stats(), client.ping()

    async with serve(tiny, [endpoint("tcp", tmp_path)]) as (_, (address,)):
        streamed, whole, stats, rtt = await anyio.to_thread.run_sync(use, address)
    assert streamed == whole and len(whole) == 6
    assert stats.finished == 2 and stats.clients == 1 and 0 < rtt < 1


async def test_a_client_reconnects_after_the_server_restarts(tiny: Tiny, tmp_path: Path) -> None:
    address = endpoint("ipc", tmp_path)
    fast = {"heartbeat_interval_s": 0.05, "heartbeat_timeout_s": 0.3}
    async with anyio.create_task_group() as tg:
        first_up, first_down, second_up = anyio.Event(), anyio.Event(), anyio.Event()

        async def servers() -> None:
            async with serve(tiny, [address], **fast):
                first_up.set()
                await first_down.wait()
            async with serve(tiny, [address], **fast):
                second_up.set()
                await anyio.sleep_forever()

        tg.start_soon(servers)
        await first_up.wait()
        async with Client.connect(address) as client:
            stream = client.generate([1, 2, 3], max_tokens=150, ignore_eos=True)
            await stream.next_delta()
            first_down.set()
            with pytest.raises(ConnectionLost):
                async for _ in stream:
                    pass
            await second_up.wait()
            with anyio.fail_after(5):
                done = await client.complete([1, 2, 3], max_tokens=4, temperature=0)
        tg.cancel_scope.cancel()
    assert done.finished.usage.completion_tokens == 4
