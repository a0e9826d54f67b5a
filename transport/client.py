"""Clients of docs/PROTOCOL.md: `Client` (anyio) and `SyncClient` (blocking, for scripts).

    async with Client.connect("tcp://127.0.0.1:5555") as client:
        async for delta in client.generate("Once upon", max_tokens=32, temperature=0):
            print(delta.text, end="")

One DEALER socket carries any number of concurrent requests. A background task
reads it and routes each message to its request's `Stream`; another pings the
server. When the connection closes (the server process died: seen at once through
a socket monitor), the server falls silent past its heartbeat timeout (a host or
network gone without a word), or it says it has no session for us (it
restarted), every open stream fails with `ConnectionLost` and the client
connects afresh on its own. A stream is
cancelled on the server when its consumer is cancelled, times out, closes it,
or drops it. Imports nothing of the scheduler or the engine.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread
import msgspec
import zmq

from transport import protocol as p
from transport.sockets import AsyncSocket, CurveClient, resolve_endpoint

log = logging.getLogger("slotserve.client")

PromptLike = str | Sequence[int] | Sequence[Mapping[str, str]] | p.Prompt


class ClientError(Exception):
    """Base of everything this client raises about the server."""


class HandshakeFailed(ClientError):
    """No Welcome: the server is down, speaks another major version, or refused our key."""


class ConnectionLost(ClientError):
    """The session ended under a request (server silent or restarted); its fate is unknown."""


class RequestError(ClientError):
    """The server ended a request with an Error; `code` says which (see ErrorCode)."""

    def __init__(self, error: p.Error) -> None:
        super().__init__(f"{error.code.name.lower()}: {error.message}")
        self.code = error.code
        self.request_id = error.request_id
        self.retry_after_ms = error.retry_after_ms


_Item = p.Delta | p.Accepted | p.Finished | p.Error | ConnectionLost
"""What a Stream receives: its messages, or the end of the session."""


@dataclass(frozen=True)
class Completion:
    """A whole response: every token, the text, the log-probabilities and the Finished."""

    tokens: list[int]
    text: str
    logprobs: list[p.Logprob]
    finished: p.Finished


def to_prompt(prompt: PromptLike) -> p.Prompt:
    """Text, token ids, or chat messages (`{"role", "content"}` mappings) as a wire prompt."""
    if isinstance(prompt, p.TokenPrompt | p.TextPrompt | p.ChatPrompt):
        return prompt
    if isinstance(prompt, str):
        return p.TextPrompt(prompt)
    items = list(prompt)
    messages = [m for m in items if isinstance(m, Mapping)]
    if items and len(messages) == len(items):
        return p.ChatPrompt([p.ChatMessage(m["role"], m["content"]) for m in messages])
    tokens = [t for t in items if isinstance(t, int)]
    if len(tokens) != len(items):
        raise TypeError("a prompt is text, a list of token ids or a list of chat messages")
    return p.TokenPrompt(tokens)


class Stream:
    """One request's output: `async for delta in stream` yields `protocol.Delta`s; at the end
    `finished` holds the Finished. An Error from the server raises `RequestError`.

    The Generate is sent on the first iteration. `timeout_s` bounds the whole request on
    the client side (then: Cancel sent, `TimeoutError`). Cancelling the consuming task,
    `aclose()`, leaving `async with stream`, or dropping the last reference to an
    unfinished stream cancels it on the server.
    """

    def __init__(self, client: Client, generate: p.Generate, timeout_s: float | None) -> None:
        self.request_id = generate.request_id
        self.prompt_tokens: int | None = None  # from Accepted
        self.finished: p.Finished | None = None
        self._client = client
        self._generate: p.Generate | None = generate
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._items: deque[_Item] = deque()
        self._arrived = anyio.Event()
        self._ended = False

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> p.Delta:
        delta = await self.next_delta()
        if delta is None:
            raise StopAsyncIteration
        return delta

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def next_delta(self) -> p.Delta | None:
        """The next Delta, or None after the Finished."""
        if self._ended:
            return None
        try:
            with anyio.fail_after(
                None if self._deadline is None else self._deadline - time.monotonic()
            ):
                if self._generate is not None:
                    generate, self._generate = self._generate, None
                    await self._client._start(self, generate)
                while True:
                    while not self._items:
                        self._arrived = anyio.Event()
                        await self._arrived.wait()
                    item = self._items.popleft()
                    if isinstance(item, p.Delta):
                        return item
                    if isinstance(item, p.Accepted):
                        self.prompt_tokens = item.prompt_tokens
                        continue
                    self._ended = True
                    if isinstance(item, p.Finished):
                        self.finished = item
                        return None
                    if isinstance(item, p.Error):
                        raise RequestError(item)
                    raise item
        except BaseException:
            await self.aclose()
            raise

    async def collect(self) -> Completion:
        """Read the stream to its end and return everything it produced."""
        tokens: list[int] = []
        text: list[str] = []
        logprobs: list[p.Logprob] = []
        async for delta in self:
            tokens += delta.tokens
            text.append(delta.text)
            logprobs += delta.logprobs
        assert self.finished is not None
        return Completion(tokens, "".join(text), logprobs, self.finished)

    async def aclose(self) -> None:
        """Cancel the request on the server unless it has ended. Idempotent."""
        if not self._ended:
            self._ended = True
            self._client._abandon(self.request_id, sent=self._generate is None)

    def _put(self, item: _Item) -> None:
        self._items.append(item)
        self._arrived.set()


class Client:
    """An open session with a server; make one with `async with Client.connect(...)`."""

    def __init__(self, endpoint: str, curve: CurveClient | None, name: str, timeout_s: float):
        self.endpoint = resolve_endpoint(endpoint)
        self.welcome: p.Welcome | None = None
        self._curve = curve
        self._name = name
        self._timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._streams: dict[int, weakref.ref[Stream]] = {}
        self._pongs: dict[int, anyio.Event] = {}
        self._stats: deque[tuple[anyio.Event, list[p.Stats]]] = deque()
        self._ready = anyio.Event()
        self._last_heard = time.monotonic()
        self._sock: AsyncSocket | None = None
        self._monitor: AsyncSocket | None = None  # the socket's disconnects

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        endpoint: str,
        *,
        curve: CurveClient | None = None,
        name: str = "slotserve-client",
        timeout_s: float = 5.0,
    ) -> AsyncIterator[Client]:
        """Connect and say Hello; raises `HandshakeFailed` when no Welcome comes within
        `timeout_s`. Reconnects by itself for as long as the context is open."""
        client = cls(endpoint, curve, name, timeout_s)
        await client._handshake()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(client._run)
                try:
                    yield client
                finally:
                    client._bye()
                    tg.cancel_scope.cancel()
        finally:
            client._close_socket()

    def generate(
        self, prompt: PromptLike, *, timeout_s: float | None = None, **params: Any
    ) -> Stream:
        """A stream for one request; `params` are fields of `protocol.Generate` (max_tokens,
        temperature, stop, logprobs, ...). Nothing is sent until the stream is iterated."""
        generate = p.Generate(next(self._ids), to_prompt(prompt), **params)
        return Stream(self, generate, timeout_s)

    async def complete(
        self, prompt: PromptLike, *, timeout_s: float | None = None, **params: Any
    ) -> Completion:
        """Generate and wait for the whole response."""
        async with self.generate(prompt, timeout_s=timeout_s, **params) as stream:
            return await stream.collect()

    async def ping(self) -> float:
        """Round trip to the server, in seconds."""
        await self._ready.wait()
        nonce = next(self._ids)
        done = self._pongs[nonce] = anyio.Event()
        t0 = time.perf_counter()
        self._send_or_raise(p.Ping(nonce))
        with anyio.fail_after(self._timeout_s):
            await done.wait()
        return time.perf_counter() - t0

    async def stats(self) -> p.Stats:
        await self._ready.wait()
        box: list[p.Stats] = []
        done = anyio.Event()
        self._stats.append((done, box))
        self._send_or_raise(p.GetStats())
        with anyio.fail_after(self._timeout_s):
            await done.wait()
        return box[0]

    # -- the session ----------------------------------------------------------------------------
    async def _handshake(self) -> None:
        ctx: zmq.Context[Any] = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            self._curve.apply(sock)
        self._monitor = AsyncSocket(sock.get_monitor_socket(zmq.EVENT_DISCONNECTED))
        sock.connect(self.endpoint)
        self._sock = AsyncSocket(sock)
        hello = p.Hello(p.PROTOCOL_MAJOR, p.PROTOCOL_MINOR, self._name)
        try:
            with anyio.move_on_after(self._timeout_s):
                while not self._send(hello):  # no pipe to the server yet
                    await anyio.sleep(0.01)
                while True:
                    reply = self._decode(await self._sock.recv_bytes())
                    if isinstance(reply, p.Welcome):
                        self.welcome = reply
                        self._last_heard = time.monotonic()
                        self._ready.set()
                        return
                    if isinstance(reply, p.Error):
                        raise HandshakeFailed(f"{self.endpoint}: {reply.message}")
            raise HandshakeFailed(
                f"{self.endpoint}: no Welcome within {self._timeout_s} s "
                "(server down, or its CURVE key / our key not accepted)"
            )
        except BaseException:
            self._close_socket()
            raise

    async def _run(self) -> None:
        """Serve the session; when it is lost, fail what was in flight and connect again."""
        while True:
            await self._serve_session()
            self._ready = anyio.Event()
            self._lose("the connection closed, or the server went silent or forgot this session")
            self._close_socket()
            while True:
                try:
                    await self._handshake()
                    break
                except HandshakeFailed:
                    await anyio.sleep(min(1.0, self._timeout_s))

    async def _serve_session(self) -> None:
        """Read and ping until the connection closes or the server is silent past its
        heartbeat timeout."""
        assert self.welcome is not None and self._sock is not None and self._monitor is not None
        interval = self.welcome.heartbeat_interval_ms / 1000
        timeout = self.welcome.heartbeat_timeout_ms / 1000
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._read, self._sock, tg.cancel_scope)  # cancels all on NO_SESSION
            tg.start_soon(self._watch_disconnect, self._monitor, tg.cancel_scope)
            while time.monotonic() - self._last_heard < timeout:
                self._send(p.Ping(0))
                await anyio.sleep(interval)
            tg.cancel_scope.cancel()

    async def _read(self, sock: AsyncSocket, session: anyio.CancelScope) -> None:
        while True:
            msg = self._decode(await sock.recv_bytes())
            self._last_heard = time.monotonic()
            if isinstance(msg, p.Error) and msg.code == p.ErrorCode.NO_SESSION:
                session.cancel()
                return
            self._dispatch(msg)

    @staticmethod
    async def _watch_disconnect(monitor: AsyncSocket, session: anyio.CancelScope) -> None:
        """End the session when its connection closes: a dead server's requests must fail
        now, not a heartbeat timeout later. (ZeroMQ reconnects by itself; the server would
        not know the new connection.)"""
        await monitor.recv_bytes()  # the only event subscribed to is EVENT_DISCONNECTED
        session.cancel()

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.sock.disable_monitor()
            self._sock.close()
            self._sock = None
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None

    def _dispatch(self, msg: p.ServerMessage | None) -> None:
        if isinstance(msg, p.Deltas):
            for delta in msg.items:
                self._route(delta.request_id, delta)
        elif isinstance(msg, p.Accepted | p.Finished) or (
            isinstance(msg, p.Error) and msg.request_id is not None
        ):
            assert msg.request_id is not None
            self._route(msg.request_id, msg)
        elif isinstance(msg, p.Pong):
            done = self._pongs.pop(msg.nonce, None)
            if done is not None:
                done.set()
        elif isinstance(msg, p.Stats) and self._stats:
            done, box = self._stats.popleft()
            box.append(msg)
            done.set()
        elif isinstance(msg, p.Error):  # about the connection, not a request
            log.warning("%s: %s: %s", self.endpoint, msg.code.name, msg.message)

    def _route(self, request_id: int, msg: p.Delta | p.Accepted | p.Finished | p.Error) -> None:
        ref = self._streams.get(request_id)
        stream = None if ref is None else ref()
        if stream is None:
            if ref is not None:  # dropped without aclose: cancel it now
                self._abandon(request_id, sent=True)
            return
        stream._put(msg)
        if isinstance(msg, p.Finished | p.Error):
            del self._streams[request_id]

    async def _start(self, stream: Stream, generate: p.Generate) -> None:
        await self._ready.wait()
        assert self.welcome is not None
        if not generate.prefix_cache and self.welcome.minor < 1:
            raise ClientError(
                f"{self.endpoint}: prefix_cache=False needs protocol 1.1; the server speaks "
                f"1.{self.welcome.minor}, which has no prefix cache to opt out of"
            )
        self._streams[generate.request_id] = weakref.ref(stream)
        self._send_or_raise(generate)

    def _abandon(self, request_id: int, sent: bool) -> None:
        if self._streams.pop(request_id, None) is not None and sent and self._ready.is_set():
            self._send(p.Cancel(request_id))

    def _lose(self, why: str) -> None:
        streams, self._streams = self._streams, {}
        for ref in streams.values():
            stream = ref()
            if stream is not None:
                stream._put(ConnectionLost(why))

    def _bye(self) -> None:
        if self._ready.is_set():
            self._send(p.Bye())
        self._lose("the client closed")

    def _send(self, msg: p.ClientMessage) -> bool:
        """Queue `msg` for the server; False when ZeroMQ cannot take it now (no connection
        yet, or the queue to the server is full). Pings, Cancels and Bye are best effort."""
        assert self._sock is not None
        try:
            minor = p.PROTOCOL_MINOR if self.welcome is None else self.welcome.minor
            self._sock.send([p.encode(msg, minor)])
        except zmq.Again:
            return False
        return True

    def _send_or_raise(self, msg: p.ClientMessage) -> None:
        if not self._send(msg):
            raise ClientError(f"{self.endpoint}: cannot send now (the queue to the server is full)")

    @staticmethod
    def _decode(frames: list[bytes]) -> p.ServerMessage | None:
        if len(frames) != 1:
            return None
        try:
            return p.decode_server(frames[0])
        except msgspec.DecodeError:
            return None


class SyncClient:
    """`Client` for code without an event loop: runs one in a background thread.

    with SyncClient("ipc:///tmp/slotserve.sock") as client:
        print(client.complete("Hello", max_tokens=8, temperature=0).text)
    """

    def __init__(self, endpoint: str, **connect: Any) -> None:
        self._exit = ExitStack()
        try:
            self._portal = self._exit.enter_context(anyio.from_thread.start_blocking_portal())
            self._client: Client = self._exit.enter_context(
                self._portal.wrap_async_context_manager(Client.connect(endpoint, **connect))
            )
        except BaseException:
            self._exit.close()
            raise

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._exit.close()

    def generate(
        self, prompt: PromptLike, *, timeout_s: float | None = None, **params: Any
    ) -> Iterator[p.Delta]:
        """Deltas as they come; leaving the loop early cancels the request."""
        start = functools.partial(self._client.generate, prompt, timeout_s=timeout_s, **params)
        stream = self._portal.call(start)
        try:
            while (delta := self._portal.call(stream.next_delta)) is not None:
                yield delta
        finally:
            self._portal.call(stream.aclose)

    def complete(
        self, prompt: PromptLike, *, timeout_s: float | None = None, **params: Any
    ) -> Completion:
        run = functools.partial(self._client.complete, prompt, timeout_s=timeout_s, **params)
        return self._portal.call(run)

    def stats(self) -> p.Stats:
        return self._portal.call(self._client.stats)

    def ping(self) -> float:
        return self._portal.call(self._client.ping)
