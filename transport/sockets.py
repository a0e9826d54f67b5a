"""ZeroMQ sockets under anyio, endpoints and CurveZMQ: what the server and the clients share.

pyzmq's own async layer is asyncio-only; `AsyncSocket` drives a plain socket
from any anyio backend by waiting on the socket's file descriptor. That FD is
edge-triggered and only says "look at ZMQ_EVENTS": every send or receive may
consume the edge, so a send that finds input pending wakes the waiting
receiver itself (as zmq.asyncio does).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

DEFAULT_TCP_HOST = "127.0.0.1"

# A message is sent frame by frame with pyzmq's compiled `send` and plain int flags:
# `Socket.send_multipart` type-checks every frame in Python and combines flags through
# `enum.IntFlag.__or__` per frame, which cost ~3 us of a ~7 us send (2 frames, ipc).
_SEND_FRAME = zmq.backend.Socket.send
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_LAST = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)  # (an int: `&` with the IntFlag is Python code)


class EndpointError(ValueError):
    """An endpoint this transport cannot bind or connect."""


class AsyncSocket:
    """A zmq socket for one event loop: awaitable receives, sends that never block.

    One task at a time may await `recv_frames`/`recv_bytes`. `send` raises
    `zmq.Again` when the peer's pipe is at its high-water mark (the caller
    buffers) and `zmq.ZMQError(EHOSTUNREACH)` for an unknown ROUTER peer.
    """

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self.sock = sock
        self._fd = int(sock.getsockopt(zmq.FD))
        self._waiting: anyio.CancelScope | None = None
        self._batching = False

    async def recv_frames(self) -> list[zmq.Frame]:
        """The next multipart message as frames (their metadata, e.g. zmq.SRCFD, readable)."""
        while True:
            try:
                return self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                await self._wait_readable()

    async def recv_bytes(self) -> list[bytes]:
        """The next multipart message as bytes."""
        while True:
            try:
                return self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                await self._wait_readable()

    def send(self, frames: list[bytes]) -> None:
        """Send one multipart message (bytes frames) without blocking."""
        sock = self.sock
        for frame in frames[:-1]:
            _SEND_FRAME(sock, frame, _MORE)
        _SEND_FRAME(sock, frames[-1], _LAST)
        if not self._batching:
            self._wake_receiver()

    def send_to(self, identity: bytes, payload: bytes) -> None:
        """Send `payload` to the ROUTER peer `identity` without blocking: `send` of the two
        frames with no list to build and walk (a server sends one such message per
        connection per step)."""
        sock = self.sock
        _SEND_FRAME(sock, identity, _MORE)
        _SEND_FRAME(sock, payload, _LAST)
        if not self._batching:
            self._wake_receiver()

    @contextmanager
    def sending(self) -> Iterator[None]:
        """A burst of sends: the receiver is woken once, at the end, not after each."""
        self._batching = True
        try:
            yield
        finally:
            self._batching = False
            self._wake_receiver()

    async def _wait_readable(self) -> None:
        with anyio.CancelScope() as scope:
            self._waiting = scope
            try:
                await anyio.wait_readable(self._fd)
            finally:
                self._waiting = None

    def _wake_receiver(self) -> None:
        if self._waiting is not None and int(self.sock.getsockopt(zmq.EVENTS)) & _POLLIN:
            self._waiting.cancel()

    def close(self) -> None:
        self.sock.close(linger=0)


def resolve_endpoint(endpoint: str) -> str:
    """`tcp://:PORT` -> `tcp://127.0.0.1:PORT`; anything but tcp:// and ipc:// is refused."""
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if not sep or not port:
            raise EndpointError(f"{endpoint}: a tcp endpoint needs a port (tcp://HOST:PORT)")
        return f"tcp://{host or DEFAULT_TCP_HOST}:{port}"
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint
    raise EndpointError(f"{endpoint}: expected tcp://HOST:PORT or ipc://PATH")


def bind(sock: zmq.Socket[Any], endpoint: str) -> str:
    """Bind `endpoint` and return what was bound (the port chosen for `tcp://HOST:0`).

    An ipc socket file is created readable and writable by its owner only (0600):
    the umask covers the moment of creation, the chmod the final mode. Abstract
    Linux ipc names (`ipc://@name`) have no file.
    """
    endpoint = resolve_endpoint(endpoint)
    if endpoint.startswith("tcp://"):
        sock.bind(endpoint)
        return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    path = endpoint[len("ipc://") :]
    if path.startswith("@"):
        sock.bind(endpoint)
        return endpoint
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    old = os.umask(0o177)
    try:
        sock.bind(endpoint)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return endpoint


@dataclass(frozen=True)
class CurveServer:
    """The server's CURVE key pair and the allow-list of client public keys.

    `allowed_dir` holds one public certificate per allowed client, as written by
    `zmq.auth.create_certificates`; a client whose key is not there cannot connect.
    """

    secret_file: Path
    allowed_dir: Path

    def apply(self, ctx: zmq.Context[Any], sock: zmq.Socket[Any]) -> ThreadAuthenticator:
        """Make `sock` a CURVE server (call before binding); returns the running authenticator,
        which the caller stops when it closes the socket."""
        public, secret = _load_key_pair(self.secret_file)
        if not self.allowed_dir.is_dir():
            raise EndpointError(f"{self.allowed_dir}: CURVE allow-list directory not found")
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain="*", location=str(self.allowed_dir))
        sock.curve_server = True
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        return auth


@dataclass(frozen=True)
class CurveClient:
    """A client's CURVE key pair and the server's public key (all certificate files)."""

    secret_file: Path
    server_public_file: Path

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make `sock` a CURVE client (call before connecting)."""
        public, secret = _load_key_pair(self.secret_file)
        server_public = _load_certificate(self.server_public_file)[0]
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_serverkey = server_public


def _load_certificate(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise EndpointError(f"{path}: cannot read a CURVE certificate: {e}") from None


def _load_key_pair(path: Path) -> tuple[bytes, bytes]:
    public, secret = _load_certificate(path)
    if secret is None:
        raise EndpointError(f"{path}: no secret key in this certificate (use the .key_secret file)")
    return public, secret
