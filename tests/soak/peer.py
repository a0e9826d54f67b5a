"""A raw protocol peer that records, per request, every message the server sent for it.

`transport.client.Client` hides what the soak must see (a second terminal message, a
Delta after the terminal, a request that never ended), so the soak speaks the
protocol itself over a bare DEALER: `Peer.generate(kind, ...)` sends a Generate and
returns its `Outcome`, which the peer's reader fills in as messages arrive. A peer
pings the server every heartbeat interval while it is open, also while it does not
read (a slow consumer is alive, only slow). `kill()` closes the socket without a Bye,
as a crashed client would.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import zmq

from transport import protocol as p
from transport.sockets import AsyncSocket


@dataclass
class Outcome:
    """One Generate as the client saw it; times are `time.monotonic()`."""

    kind: str  # the traffic kind that sent it (see soak.KINDS)
    rid: int
    sent: float
    accepted: int = 0  # Accepted messages
    tokens: int = 0
    deltas_after_end: int = 0  # Deltas that came after a terminal message (a bug)
    terminals: list[str] = field(default_factory=list)  # "finished" or the error code's name
    error: str = ""  # the first terminal Error's message
    first_token: float | None = None
    ended: float | None = None
    orphaned: bool = False  # its connection was killed on purpose: no terminal is owed
    done: anyio.Event = field(default_factory=anyio.Event, repr=False)

    @property
    def terminal(self) -> str | None:
        return self.terminals[0] if self.terminals else None

    def to_json(self) -> dict[str, Any]:
        keys = ("kind", "rid", "sent", "accepted", "tokens", "terminals", "error", "first_token")
        keys += ("ended",)
        return {k: getattr(self, k) for k in keys} | {"orphaned": self.orphaned}


class Peer:
    """`async with Peer.open(endpoint, tg) as peer:` a DEALER with a session."""

    def __init__(self, endpoint: str, rcvhwm: int = 1000) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.connect(endpoint)
        self.sock = AsyncSocket(sock)
        self.outcomes: dict[int, Outcome] = {}
        self.connection_errors: list[str] = []  # Errors without a request_id
        self.reading = anyio.Event()  # cleared: the peer does not read (slow consumer)
        self.reading.set()
        self.welcome: p.Welcome | None = None
        self.closed = False
        self._ids = itertools.count(1)
        self._scope = anyio.CancelScope()
        self._serving = False  # `_serve` runs: it closes the socket when it ends

    async def start(self, tg: anyio.abc.TaskGroup, timeout_s: float = 10.0) -> p.Welcome:
        """Say Hello, wait for the Welcome, then read and ping in `tg` until closed."""
        self.send(p.Hello(p.PROTOCOL_MAJOR, p.PROTOCOL_MINOR, "soak"))
        with anyio.fail_after(timeout_s):
            while not isinstance(msg := await self._recv(), p.Welcome):
                pass
        self.welcome = msg
        tg.start_soon(self._serve)
        return msg

    def send(self, msg: p.ClientMessage) -> None:
        self.send_frames([p.encode(msg)])

    def send_frames(self, frames: list[bytes]) -> None:
        """Send unless closed; raises `zmq.Again` when the pipe to the server is full."""
        if not self.closed:
            self.sock.send(frames)

    def generate(
        self, kind: str, prompt: p.Prompt, rid: int | None = None, **fields: Any
    ) -> Outcome:
        rid = next(self._ids) if rid is None else rid
        outcome = self.outcomes[rid] = Outcome(kind, rid, time.monotonic())
        self.send(p.Generate(rid, prompt, **fields))
        return outcome

    def cancel(self, outcome: Outcome) -> None:
        self.send(p.Cancel(outcome.rid))

    def open_requests(self) -> list[Outcome]:
        return [o for o in self.outcomes.values() if not o.terminals and not o.orphaned]

    def kill(self) -> None:
        """Close without a Bye, like a process that died: what was open is owed nothing."""
        for outcome in self.open_requests():
            outcome.orphaned = True
            outcome.done.set()
        self.close()

    def bye(self) -> None:
        """End the session politely; what is still open is owed nothing either."""
        if not self.closed:
            self.send(p.Bye())
        self.kill()

    def close(self) -> None:
        """Stop reading and pinging, then close the socket: at once, or once the reader has
        stopped waiting on the socket's fd (a new socket may get the same fd number)."""
        if not self.closed:
            self.closed = True
            self._scope.cancel()
            if not self._serving:
                self.sock.close()

    async def _serve(self) -> None:
        assert self.welcome is not None
        interval = self.welcome.heartbeat_interval_ms / 1000 / 2
        self._serving = True
        try:
            with self._scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._read)
                    while True:
                        with contextlib.suppress(zmq.Again):  # a heartbeat may be skipped
                            self.send(p.Ping(0))
                        await anyio.sleep(interval)
        finally:
            self.sock.close()

    async def _read(self) -> None:
        while True:
            await self.reading.wait()
            msg = await self._recv()
            if msg is not None:
                self._record(msg, time.monotonic())

    async def _recv(self) -> p.ServerMessage | None:
        frames = await self.sock.recv_bytes()
        try:
            return p.decode_server(frames[0]) if len(frames) == 1 else None
        except msgspec.DecodeError:
            self.connection_errors.append("undecodable server frame")
            return None

    def _record(self, msg: p.ServerMessage, now: float) -> None:
        if isinstance(msg, p.Deltas):
            for delta in msg.items:
                o = self.outcomes.get(delta.request_id)
                if o is None:
                    self.connection_errors.append(f"Delta for unknown request {delta.request_id}")
                elif o.terminals:
                    o.deltas_after_end += 1
                else:
                    o.tokens += len(delta.tokens)
                    if o.first_token is None and delta.tokens:
                        o.first_token = now
        elif isinstance(msg, p.Accepted):
            o = self.outcomes.get(msg.request_id)
            if o is not None:
                o.accepted += 1
        elif isinstance(msg, p.Finished) or (
            isinstance(msg, p.Error) and msg.request_id is not None
        ):
            assert msg.request_id is not None
            o = self.outcomes.get(msg.request_id)
            if o is None:
                self.connection_errors.append(f"terminal for unknown request {msg.request_id}")
                return
            o.terminals.append("finished" if isinstance(msg, p.Finished) else msg.code.name)
            if isinstance(msg, p.Error) and not o.error:
                o.error = msg.message
            if o.ended is None:
                o.ended = now
            o.done.set()
        elif isinstance(msg, p.Error):
            self.connection_errors.append(f"{msg.code.name}: {msg.message}")
