"""The prefix cache over the wire: cached_tokens in Finished, the opt-out, the counters in
Stats, and nothing of protocol 1.1 sent to a 1.0 client."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import zmq
from serving import RawPeer, Tiny, load_tiny, new_scheduler, serve_scheduler

from scheduler import PrefixCacheConfig, SchedulerConfig
from transport import protocol as p
from transport.client import Client, ClientError
from transport.sockets import AsyncSocket

CACHE = SchedulerConfig(prefix_cache=PrefixCacheConfig(budget_bytes=16 << 20, min_tokens=4))


@pytest.fixture(scope="module")
def tiny(make_model: Callable[..., Path]) -> Tiny:
    return load_tiny(make_model("tiny"))


def conversation(tiny: Tiny, turns: int) -> list[dict[str, str]]:
    messages = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i}: how do slots work?"})
        messages.append({"role": "assistant", "content": f"answer {i}: one forward per step."})
    return messages


async def test_a_later_turn_reports_its_cached_tokens_and_stats_count_the_hits(
    tiny: Tiny, tmp_path: Path
) -> None:
    scheduler = new_scheduler(tiny, n_slots=2, config=CACHE)
    async with (
        serve_scheduler(scheduler, [f"ipc://{tmp_path}/s.sock"]) as (_, (address,)),
        Client.connect(address) as client,
    ):
        first = await client.complete(conversation(tiny, 1)[:1], max_tokens=3, temperature=0.0)
        assert first.finished.usage.cached_tokens == 0
        second = await client.complete(conversation(tiny, 2)[:3], max_tokens=3, temperature=0.0)
        usage = second.finished.usage
        assert 0 < usage.cached_tokens < usage.prompt_tokens
        opted_out = await client.complete(
            conversation(tiny, 2)[:3], max_tokens=3, temperature=0.0, prefix_cache=False
        )
        assert opted_out.finished.usage.cached_tokens == 0
        assert opted_out.tokens == second.tokens
        stats = await client.stats()
    assert stats.prefix_lookups == 2 and stats.prefix_hits == 1
    assert stats.prefix_tokens_saved == usage.cached_tokens and stats.prefix_bytes > 0


async def test_a_client_of_protocol_1_0_gets_usage_as_1_0_wrote_it(
    tiny: Tiny, tmp_path: Path
) -> None:
    scheduler = new_scheduler(tiny, n_slots=2, config=CACHE)
    async with serve_scheduler(scheduler, [f"ipc://{tmp_path}/s.sock"]) as (_, (address,)):
        peer = RawPeer(address)
        try:
            peer.send(p.Hello(p.PROTOCOL_MAJOR, 0, "old"))
            assert isinstance(await peer.recv(), p.Welcome)
            for rid in (1, 2):  # the second hits the first's prompt end
                prompt = p.TokenPrompt(list(range(1, 40)) + ([7, 8] if rid == 2 else []))
                peer.send_frames([msgspec.msgpack.encode([2, rid, prompt, 2, 0.0])])
                frames = []
                while True:
                    frame = (await peer.sock.recv_bytes())[0]
                    frames.append(msgspec.msgpack.decode(frame))
                    if frames[-1][0] == 19:  # Finished
                        break
                assert len(frames[-1][3]) == 2  # usage: prompt and completion tokens only
            peer.send(p.GetStats())
            stats = msgspec.msgpack.decode((await peer.sock.recv_bytes())[0])
            assert len(stats) == 19  # the tag and the 18 fields of 1.0
        finally:
            peer.close()
    assert scheduler.stats().prefix_cache.hits == 1


async def test_a_client_leaves_out_the_opt_out_for_a_server_of_protocol_1_0(
    tmp_path: Path,
) -> None:
    """A hand-made 1.0 server (a bare ROUTER): the client's Generate carries the 19 fields of
    1.0, and asking it to opt out of a cache that server cannot have is an error."""
    address = f"ipc://{tmp_path}/old.sock"
    ctx: zmq.Context[Any] = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    old = AsyncSocket(router)
    welcome = p.Welcome(1, 0, "old", "tiny", 160, 512, [1], 8, 1 << 20, 1000, 10_000)
    generates: list[list[object]] = []

    async def old_server() -> None:
        identity, hello = await old.recv_bytes()
        assert isinstance(p.decode_client(hello), p.Hello)
        old.send([identity, p.encode(welcome)])
        while not generates:  # (Pings may come first)
            _, frame = await old.recv_bytes()
            message = msgspec.msgpack.decode(frame)
            if message[0] == 2:
                generates.append(message)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(old_server)
            async with Client.connect(address) as client:
                with pytest.raises(ClientError, match=r"needs protocol 1\.1"):
                    await client.complete([1, 2, 3], max_tokens=2, prefix_cache=False)
                async with client.generate([1, 2, 3]) as stream:
                    with anyio.move_on_after(2):
                        await stream.next_delta()
        assert len(generates[0]) == 20  # the tag and the 19 fields of 1.0
    finally:
        router.close()
