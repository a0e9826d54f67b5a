"""A real server for transport tests: the real Scheduler over a tiny model, behind `Server`.

* `load_tiny(path) -> (Model, Tokenizer)`, cached per path.
* `serve(tiny, endpoints, n_slots=..., **server_config)`: async context manager yielding
  `(server, endpoints)` with a fresh scheduler running in the current event loop
  (`new_scheduler` + `serve_scheduler`, when the scheduler needs other settings).
* `ServerThread(...)`: the same in a background thread, for synchronous tests (hypothesis).
* `RawPeer(endpoint)`: a bare DEALER that sends and receives protocol messages by hand.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    ExitStack,
    asynccontextmanager,
)
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import mlx.core as mx
import zmq

from engine.cache import SlotPool
from engine.gguf import GGUFFile
from engine.models.qwen35 import Model, load_model
from engine.runner import ModelRunner
from engine.tokenizer import Tokenizer
from scheduler import Scheduler, SchedulerConfig
from transport import protocol as p
from transport.server import ModelInfo, Server, ServerConfig
from transport.sockets import AsyncSocket

Tiny = tuple[Model, Tokenizer]
CONTEXT = 160


@functools.cache
def load_tiny(path: Path) -> Tiny:
    return load_model(path), Tokenizer.from_metadata(GGUFFile(path).metadata)


def new_scheduler(
    tiny: Tiny, n_slots: int = 8, context: int = CONTEXT, config: SchedulerConfig | None = None
) -> Scheduler:
    """A Scheduler over a fresh pool. Make it on the thread that loaded the model: it
    evaluates the model's lazy weights, which MLX allows only there."""
    model, tokenizer = tiny
    pool = SlotPool(model.config, n_slots, context, kv_dtype=mx.float32)
    return Scheduler(ModelRunner(model, pool), tokenizer, config)


@asynccontextmanager
async def serve_scheduler(
    scheduler: Scheduler, endpoints: Sequence[str], **server_config: Any
) -> AsyncIterator[tuple[Server, list[str]]]:
    config = ServerConfig(endpoints=tuple(endpoints), **server_config)
    server = Server(scheduler, ModelInfo.of(scheduler, "tiny"), config)
    async with scheduler.running(), server.running() as bound:
        yield server, bound


def serve(
    tiny: Tiny, endpoints: Sequence[str], n_slots: int = 8, **server_config: Any
) -> AbstractAsyncContextManager[tuple[Server, list[str]]]:
    """`async with serve(...) as (server, endpoints)`: a fresh scheduler behind a server."""
    return serve_scheduler(new_scheduler(tiny, n_slots), endpoints, **server_config)


class ServerThread(AbstractContextManager["ServerThread"]):
    """`serve(...)` on an event loop of its own thread; `portal.call(fn)` runs there."""

    def __init__(self, tiny: Tiny, endpoints: Sequence[str], n_slots: int = 8, **kw: Any):
        scheduler = new_scheduler(tiny, n_slots)
        self._exit = ExitStack()
        try:
            self.portal = self._exit.enter_context(anyio.from_thread.start_blocking_portal())
            self.server, self.endpoints = self._exit.enter_context(
                self.portal.wrap_async_context_manager(serve_scheduler(scheduler, endpoints, **kw))
            )
        except BaseException:
            self._exit.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self._exit.close()


class RawPeer:
    """A bare DEALER speaking the protocol by hand (for what `Client` would not send)."""

    def __init__(self, endpoint: str, **sockopts: int) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        for name, value in sockopts.items():
            sock.setsockopt(getattr(zmq, name.upper()), value)
        sock.connect(endpoint)
        self.sock = AsyncSocket(sock)

    def send(self, *messages: p.ClientMessage) -> None:
        for msg in messages:
            self.sock.send([p.encode(msg)])

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.send(frames)

    async def recv(self, timeout: float = 5.0) -> p.ServerMessage:
        with anyio.fail_after(timeout):
            frames = await self.sock.recv_bytes()
        assert len(frames) == 1
        return p.decode_server(frames[0])

    async def hello(self) -> p.Welcome:
        self.send(p.Hello(p.PROTOCOL_MAJOR, p.PROTOCOL_MINOR, "raw"))
        welcome = await self.recv()
        assert isinstance(welcome, p.Welcome), welcome
        return welcome

    def close(self) -> None:
        self.sock.close()
