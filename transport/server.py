"""The server side of docs/PROTOCOL.md: one ROUTER socket in the scheduler's event loop.

Per connection (a ZeroMQ routing id that said Hello) the server keeps a session:
its outstanding requests, an outbox for messages the peer's pipe could not take,
and the deltas of the current step. Each accepted request is submitted into its
session's step sink (`_SessionSink`, a `scheduler.StepSink`), which the scheduler
hands a step's Deltas of all the session's requests in one call as it publishes, so
a step's events are gathered per session with no task and no call per request. When
the scheduler has published the step (`Scheduler.on_published`) the server sends, per
connection, ONE Deltas message with everything the step produced, then any terminal
messages — in the same turn of the event loop, so no other task runs between a step
and its messages. Events outside a step (a cancel, a dropped connection) are sent at
the loop's next turn.

Nothing a client sends can crash the server: frames are decoded by type, a bad
one gets an Error (or is dropped when even that cannot be sent) and is counted.
A connection is dropped, and its requests cancelled, when its socket closes
(seen at once through the socket monitor), when it stays silent past the
heartbeat timeout, or when it says Bye or Hello again. A connection whose
outbox overflows (a slow consumer) has its requests cancelled with an error, so
the scheduler never waits for a reader.

The monitor names a connection only by its file descriptor, which the OS hands to
the next connection as soon as it is closed; so every accepted connection gets a
number of its own, and a session belongs to that number, never to the bare fd. A
late disconnect of a connection that said Bye therefore cannot end the session of
the connection that took its fd next.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

import scheduler as s
from transport import mapping
from transport import protocol as p
from transport.sockets import AsyncSocket, CurveServer, bind

log = logging.getLogger("slotserve.transport")

SERVER_NAME = "slotserve/0.1"
RESEND_INTERVAL_S = 0.01  # how often full outboxes are retried


@dataclass(frozen=True)
class ServerConfig:
    """`max_outstanding`: requests in flight per connection. `send_buffer`: messages held for
    one connection beyond ZeroMQ's own pipe (`zmq_sndhwm` messages) before its requests are
    cancelled. `heartbeat_timeout_s`: silence after which a connection is dropped."""

    endpoints: tuple[str, ...] = ("tcp://127.0.0.1:5555",)
    max_outstanding: int = 64
    send_buffer: int = 256
    zmq_sndhwm: int = 1000
    max_message_bytes: int = 4 << 20
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 3.0
    curve: CurveServer | None = None

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("ServerConfig needs at least one endpoint")
        if min(self.max_outstanding, self.send_buffer, self.zmq_sndhwm) < 1:
            raise ValueError("max_outstanding, send_buffer and zmq_sndhwm must be >= 1")
        if self.max_message_bytes < 1024:
            raise ValueError("max_message_bytes must be >= 1024")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_timeout_s")


class Serves(Protocol):
    """What the server needs of a scheduler (`scheduler.Scheduler` is the one): requests
    submitted into a connection's step sink."""

    def submit(self, request: s.Request, *, group: s.StepSink, key: Any) -> s.RequestHandle: ...

    def cancel(self, request_id: str) -> bool: ...

    def stats(self) -> s.SchedulerStats: ...

    def on_published(self, callback: Callable[[], None]) -> None: ...


@dataclass(frozen=True)
class ModelInfo:
    """What Welcome tells a client about the model."""

    name: str
    context_length: int
    vocab_size: int  # prompt token ids must lie in [0, vocab_size)
    eos_token_ids: tuple[int, ...]

    @classmethod
    def of(cls, scheduler: s.Scheduler, name: str) -> ModelInfo:
        pool = scheduler.runner.pool
        eos = tuple(sorted(scheduler.tokenizer.eog_ids))
        return cls(name, pool.max_context, pool.config.n_vocab, eos)


@dataclass(eq=False, slots=True)  # (slots: each of its requests' Deltas reads it)
class _Session:
    identity: bytes
    number: int  # unique per session: scheduler request ids are "number/request_id"
    connection: int  # the accepted connection it came on (`Server._open`), to match its end
    last_seen: float
    requests: dict[int, s.RequestHandle] = field(default_factory=dict)
    outbox: deque[bytes] = field(default_factory=deque)
    deltas: list[p.Delta] = field(default_factory=list)  # this step's, not yet sent
    terminals: list[p.Finished | p.Error] = field(default_factory=list)  # sent after deltas
    closed: bool = False  # dropped: nothing more is sent
    cancel_note: str | None = None  # why the server cancelled this session's requests
    minor: int = p.PROTOCOL_MINOR  # the client's protocol minor: nothing newer is sent
    sink: _SessionSink = field(init=False)  # where its requests' events come (set at once)


class _SessionSink:
    """A session's `scheduler.StepSink`: its requests' events, keyed by their wire ids."""

    __slots__ = ("server", "session")

    def __init__(self, server: Server, session: _Session) -> None:
        self.server, self.session = server, session

    def deltas(self, items: list[tuple[int, s.Delta]]) -> None:
        """A step's Deltas of the session's requests into its step batch. Should this raise,
        the scheduler ends those requests with an error, whose terminals come to `end`
        (and go out as INTERNAL Errors)."""
        server, session = self.server, self.session
        if server.observer is not None:
            for rid, event in items:
                server._observe(session, rid, event)
        if session.closed:
            return
        if not session.deltas and not session.terminals:  # else marked already
            server._mark(session)
        session.deltas += mapping.to_deltas(items)

    def end(self, key: int, event: s.Finished) -> None:
        self.server._relay_end(self.session, key, event)


class Server:
    """Serves one Scheduler over ZeroMQ; `async with server.running() as endpoints:`.

    Runs in the scheduler's event loop (anyio's asyncio backend) and calls it directly
    (submit, cancel, stats); the scheduler calls back once it has published a step. `state` is what Pong and Stats report; STARTING answers Generate with
    BUSY, DRAINING with SHUTTING_DOWN. `observer`, if given, sees every event of
    every request as it is relayed (metrics).
    """

    def __init__(
        self,
        scheduler: Serves,
        model: ModelInfo,
        config: ServerConfig,
        observer: Callable[[s.Event], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.model = model
        self.config = config
        self.observer = observer
        self.state = p.ServerState.READY
        self._close_linger_ms = 0  # raised by `drain` so the last messages leave
        self.frames_received = 0
        self.frames_rejected = 0
        self.slow_consumers = 0
        self.dead_clients = 0
        self._sessions: dict[bytes, _Session] = {}
        self._accepted = 0  # connections accepted so far; each is numbered by the count
        self._open: dict[int, int] = {}  # fd -> number of the connection open on it now
        self._by_connection: dict[int, _Session] = {}
        self._numbers = 0
        self._dirty: dict[_Session, None] = {}  # sessions with something to flush, in order
        self._serving = False  # the socket is open (`running`)
        self._loop: asyncio.AbstractEventLoop | None = None  # `running`'s
        scheduler.on_published(self._flush)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[list[str]]:
        """Bind, serve for the body of the `async with`, then cancel what is left and close.
        Yields the bound endpoints (tcp port 0 resolved)."""
        cfg = self.config
        ctx: zmq.Context[Any] = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        monitor: zmq.Socket[Any] | None = None
        auth = None
        try:
            auth = cfg.curve.apply(ctx, sock) if cfg.curve else None
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
            sock.setsockopt(zmq.SNDHWM, cfg.zmq_sndhwm)
            sock.setsockopt(zmq.LINGER, 0)
            # ZMTP pings drop dead tcp peers; the disconnect then reaches the monitor.
            sock.setsockopt(zmq.HEARTBEAT_IVL, round(cfg.heartbeat_interval_s * 1000))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, round(cfg.heartbeat_timeout_s * 1000))
            monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
            endpoints = [bind(sock, e) for e in cfg.endpoints]
            self._sock, self._monitor = AsyncSocket(sock), AsyncSocket(monitor)
            self._loop, self._serving = asyncio.get_running_loop(), True
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._receive_loop)
                tg.start_soon(self._watch_disconnects)
                tg.start_soon(self._housekeeping)
                try:
                    yield endpoints
                finally:
                    for session in list(self._sessions.values()):
                        self._drop(session)
                    tg.cancel_scope.cancel()
        finally:
            self._serving = False
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=self._close_linger_ms)
            if auth is not None:
                auth.stop()
            ctx.term()

    # -- receiving ----------------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        while True:
            for _ in range(64):  # then let the other tasks run, even under a flood
                frames = await self._sock.recv_frames()
                try:
                    self._on_frames(frames)
                except Exception:  # a bug must not take the server down with it
                    log.exception("unexpected failure handling a frame")
            await anyio.lowlevel.checkpoint()

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        self.frames_received += 1
        identity = frames[0].bytes
        session = self._sessions.get(identity)
        if session is not None:
            session.last_seen = time.monotonic()
        if len(frames) != 2:
            self._reject_frame(identity, session, f"expected 1 frame, got {len(frames) - 1}")
            return
        try:
            msg = p.decode_client(frames[1].buffer)
        except msgspec.DecodeError as e:
            self._reject_frame(identity, session, f"malformed message: {e}")
            return
        if isinstance(msg, p.Hello):
            self._hello(identity, msg, frames[1])
        elif session is None:
            rid = msg.request_id if isinstance(msg, p.Generate) else None
            self._reply(identity, p.Error(p.ErrorCode.NO_SESSION, "send Hello first", rid))
        elif isinstance(msg, p.Generate):
            self._generate(session, msg)
        elif isinstance(msg, p.Cancel):
            handle = session.requests.get(msg.request_id)
            if handle is not None:
                handle.cancel()
        elif isinstance(msg, p.Ping):
            self._send(session, p.encode(p.Pong(msg.nonce, self.state), session.minor))
        elif isinstance(msg, p.GetStats):
            self._send(session, p.encode(self.stats(), session.minor))
        else:  # Bye
            self._drop(session)

    def _reject_frame(self, identity: bytes, session: _Session | None, why: str) -> None:
        self.frames_rejected += 1
        error = p.Error(p.ErrorCode.INVALID_REQUEST, why)
        if session is not None:
            self._send(session, p.encode(error, session.minor))
        else:
            self._reply(identity, error)

    def _hello(self, identity: bytes, msg: p.Hello, frame: zmq.Frame) -> None:
        if msg.major != p.PROTOCOL_MAJOR:
            why = f"protocol {msg.major}.x is not served; this server speaks {p.PROTOCOL_MAJOR}.x"
            self._reply(identity, p.Error(p.ErrorCode.INVALID_REQUEST, why))
            return
        old = self._sessions.get(identity)
        if old is not None:
            self._drop(old)
        # libzmq queues a connection's ACCEPTED before it reads from it, and its DISCONNECTED
        # before it closes the fd: every event of the connection this Hello came on, and of
        # all earlier ones on the same fd number, is in the monitor now. Read them all; then
        # the fd names this message's connection, or none if it has closed already.
        self._drain_monitor()
        connection = self._open.get(int(frame.get(zmq.SRCFD)))
        if connection is None:
            log.info("a Hello from a connection that has closed already: no session")
            return
        earlier = self._by_connection.get(connection)
        if earlier is not None:
            # One connection has one routing id: that session's Hello was still queued when
            # its own connection closed and this one took the fd. Its peer is gone.
            self._drop(earlier, dead=True)
        self._numbers += 1
        session = _Session(identity, self._numbers, connection, time.monotonic())
        session.minor = min(msg.minor, p.PROTOCOL_MINOR)
        session.sink = _SessionSink(self, session)
        self._sessions[identity] = self._by_connection[connection] = session
        cfg, model = self.config, self.model
        welcome = p.Welcome(
            p.PROTOCOL_MAJOR,
            p.PROTOCOL_MINOR,
            SERVER_NAME,
            model.name,
            model.context_length,
            model.vocab_size,
            list(model.eos_token_ids),
            cfg.max_outstanding,
            cfg.max_message_bytes,
            round(cfg.heartbeat_interval_s * 1000),
            round(cfg.heartbeat_timeout_s * 1000),
        )
        self._send(session, p.encode(welcome, session.minor))

    def _generate(self, session: _Session, msg: p.Generate) -> None:
        rid = msg.request_id
        error: p.Error | None = None
        if self.state == p.ServerState.STARTING:
            error = p.Error(p.ErrorCode.BUSY, "the server is starting", rid, 1000)
        elif self.state == p.ServerState.DRAINING:
            error = p.Error(p.ErrorCode.SHUTTING_DOWN, "the server is draining", rid)
        elif session.cancel_note is not None:
            error = p.Error(p.ErrorCode.BUSY, session.cancel_note, rid)
        elif rid in session.requests:
            # Not this request's terminal message: the one in flight goes on.
            error = p.Error(p.ErrorCode.INVALID_REQUEST, f"request_id {rid} is already in flight")
        elif len(session.requests) >= self.config.max_outstanding:
            why = f"{self.config.max_outstanding} requests outstanding; wait for one to end"
            error = p.Error(p.ErrorCode.BUSY, why, rid)
        if error is not None:
            self._send(session, p.encode(error, session.minor))
            return
        request = mapping.to_request(msg, f"{session.number}/{rid}")
        try:
            handle = self.scheduler.submit(request, group=session.sink, key=rid)
        except (s.InvalidRequest, s.Rejected) as e:
            self._send(session, p.encode(mapping.rejection(rid, e), session.minor))
            return
        session.requests[rid] = handle
        self._send(session, p.encode(p.Accepted(rid, handle.prompt_tokens), session.minor))

    async def drain(self, timeout_s: float, linger_s: float = 2.0) -> bool:
        """Wait until every accepted request's terminal message has been handed to ZeroMQ
        (call after the scheduler has shut down, with `state` DRAINING); closing then
        lingers up to `linger_s` so queued messages reach their peers. False if
        something was still unsent after `timeout_s`."""
        self._close_linger_ms = round(linger_s * 1000)
        with anyio.move_on_after(timeout_s):
            while self._dirty or any(
                session.requests or session.outbox for session in self._sessions.values()
            ):
                await anyio.sleep(RESEND_INTERVAL_S)
            return True
        return False

    # -- streaming ----------------------------------------------------------------------------
    def _relay_end(self, session: _Session, rid: int, event: s.Finished) -> None:
        """A request's end: its terminal after the session's Deltas."""
        self._observe(session, rid, event)
        try:
            terminal = mapping.to_terminal(rid, event)
        except Exception:  # a bug here must cost this request, not its terminal
            log.exception("session %d request %d: relaying its end failed", session.number, rid)
            why = "the server failed to relay this request's output"
            terminal = p.Error(p.ErrorCode.INTERNAL, why, rid)
        self._end(session, rid, terminal)

    def _observe(self, session: _Session, rid: int, event: s.Event) -> None:
        if self.observer is not None:
            try:
                self.observer(event)
            except Exception:  # metrics must not cost the request
                log.exception("session %d request %d: the observer failed", session.number, rid)

    def _end(self, session: _Session, rid: int, terminal: p.Finished | p.Error) -> None:
        session.requests.pop(rid, None)
        if session.closed:
            return
        if (
            session.cancel_note is not None
            and isinstance(terminal, p.Error)
            and terminal.code == p.ErrorCode.CANCELLED
        ):
            terminal = p.Error(p.ErrorCode.CANCELLED, session.cancel_note, rid)
        session.terminals.append(terminal)
        self._mark(session)

    def _mark(self, session: _Session) -> None:
        """Have `_flush` send what the session's requests produced: when the scheduler has
        published the step, or for events outside a step, at the loop's next turn."""
        if session not in self._dirty:
            if not self._dirty and self._loop is not None:
                self._loop.call_soon(self._flush)  # (finds nothing after a step's flush)
            self._dirty[session] = None

    def _flush(self) -> None:
        """Send each marked session ONE Deltas message with all its Deltas, then its
        terminals; the scheduler calls this once it has published a whole step."""
        if not self._dirty or not self._serving:
            return
        dirty, self._dirty = self._dirty, {}
        with self._sock.sending():
            for session in dirty:
                if session.deltas:
                    self._send(session, p.encode(p.Deltas(session.deltas), session.minor))
                    session.deltas = []
                terminals, session.terminals = session.terminals, []
                for terminal in terminals:
                    self._send(session, p.encode(terminal, session.minor))

    # -- sending ------------------------------------------------------------------------------
    def _send(self, session: _Session, payload: bytes) -> None:
        """Send in order; what the peer's pipe cannot take waits in its outbox. An outbox
        past `send_buffer` marks a slow consumer."""
        if session.closed:
            return
        if not session.outbox and self._try_send(session, payload):
            return
        session.outbox.append(payload)
        if len(session.outbox) > self.config.send_buffer and session.cancel_note is None:
            self.slow_consumers += 1
            session.cancel_note = (
                f"slow consumer: {self.config.send_buffer} messages waiting to be read"
            )
            for handle in list(session.requests.values()):
                handle.cancel()

    def _try_send(self, session: _Session, payload: bytes) -> bool:
        try:
            self._sock.send_to(session.identity, payload)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                log.error("session %d: send failed (%s); dropping it", session.number, e)
            self._drop(session, dead=True)  # disconnected; the outbox goes with it
        return True

    def _resend(self, session: _Session) -> None:
        """Send what the outbox holds; once it is empty, a slow consumer is served again."""
        while session.outbox and not session.closed:
            if not self._try_send(session, session.outbox[0]):
                return
            if session.outbox:
                session.outbox.popleft()
        session.cancel_note = None

    def _reply(self, identity: bytes, message: p.Error) -> None:
        """Best effort to a peer without a session: dropped if it cannot be sent now."""
        with suppress(zmq.ZMQError):
            self._sock.send_to(identity, p.encode(message))

    # -- liveness -----------------------------------------------------------------------------
    async def _housekeeping(self) -> None:
        """Retry outboxes; drop sessions silent past the heartbeat timeout."""
        tick = self.config.heartbeat_interval_s / 4
        while True:
            backlog = any(session.outbox for session in self._sessions.values())
            await anyio.sleep(RESEND_INTERVAL_S if backlog else tick)
            deadline = time.monotonic() - self.config.heartbeat_timeout_s
            for session in list(self._sessions.values()):
                if session.last_seen < deadline:
                    log.info("session %d: silent past the heartbeat timeout", session.number)
                    self._drop(session, dead=True)
                else:
                    self._resend(session)

    async def _watch_disconnects(self) -> None:
        while True:
            self._on_monitor_event(await self._monitor.recv_bytes())

    def _drain_monitor(self) -> None:
        while True:
            try:
                frames = self._monitor.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_monitor_event(frames)

    def _on_monitor_event(self, frames: list[bytes]) -> None:
        """Number each accepted connection by its fd; a disconnect ends the session of the
        connection open on that fd, which events read in order always identify."""
        event = parse_monitor_message(frames)
        fd = int(event["value"])
        if event["event"] == zmq.EVENT_ACCEPTED:
            self._accepted += 1
            closed = self._open.get(fd)  # not reported closed, yet its fd is reused
            self._open[fd] = self._accepted
            if closed is not None:
                self._connection_closed(closed)
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            closed = self._open.pop(fd, None)
            if closed is not None:
                self._connection_closed(closed)

    def _connection_closed(self, connection: int) -> None:
        session = self._by_connection.pop(connection, None)
        if session is not None:
            self._drop(session, dead=True)

    def _drop(self, session: _Session, dead: bool = False) -> None:
        """Forget a session and cancel its requests; nothing more is sent to it."""
        if session.closed:
            return
        session.closed = True
        session.outbox.clear()
        self.dead_clients += dead
        if self._sessions.get(session.identity) is session:
            del self._sessions[session.identity]
        if self._by_connection.get(session.connection) is session:
            del self._by_connection[session.connection]
        for handle in list(session.requests.values()):
            handle.cancel()

    def stats(self) -> p.Stats:
        return p.Stats(
            state=self.state,
            clients=len(self._sessions),
            frames_received=self.frames_received,
            frames_rejected=self.frames_rejected,
            slow_consumers=self.slow_consumers,
            dead_clients=self.dead_clients,
            **mapping.scheduler_counters(self.scheduler.stats()),
        )
