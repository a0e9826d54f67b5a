"""Security: CurveZMQ allow-list, private ipc socket files, loopback-only tcp by default."""

from __future__ import annotations

import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq
import zmq.auth
from serving import RawPeer, Tiny, load_tiny, serve

from transport import protocol as p
from transport.client import Client, HandshakeFailed
from transport.sockets import CurveClient, CurveServer, bind, resolve_endpoint


@pytest.fixture(scope="module")
def tiny(make_model: Callable[..., Path]) -> Tiny:
    return load_tiny(make_model("tiny"))


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """Certificates for the server, an allowed client and a stranger; the allow-list holds
    only the allowed client's public key."""
    made = {}
    (tmp_path / "certs").mkdir()
    for name in ("server", "allowed", "stranger"):
        made[name], made[f"{name}_secret"] = map(
            Path, zmq.auth.create_certificates(tmp_path / "certs", name)
        )
    allow = tmp_path / "allow"
    allow.mkdir()
    (allow / "allowed.key").write_bytes(made["allowed"].read_bytes())
    made["allow_dir"] = allow
    return made


async def test_curve_lets_an_allowed_key_generate_and_keeps_an_unknown_key_out(
    tiny: Tiny, keys: dict[str, Path]
) -> None:
    curve = CurveServer(keys["server_secret"], keys["allow_dir"])
    async with serve(tiny, ["tcp://127.0.0.1:0"], curve=curve) as (server, (address,)):
        allowed = CurveClient(keys["allowed_secret"], keys["server"])
        async with Client.connect(address, curve=allowed) as client:
            done = await client.complete([1, 2, 3], max_tokens=3)
        assert done.finished.usage.completion_tokens == 3

        stranger = CurveClient(keys["stranger_secret"], keys["server"])
        with pytest.raises(HandshakeFailed):
            async with Client.connect(address, curve=stranger, timeout_s=0.5):
                pass

        before = server.stats()
        plain = RawPeer(address)  # no CURVE at all
        plain.send(p.Hello(1, 0), p.Generate(1, p.TokenPrompt([1, 2])))
        with pytest.raises(TimeoutError):
            await plain.recv(timeout=0.3)
        plain.close()
        after = server.stats()
    assert after.frames_received == before.frames_received
    assert after.submitted == before.submitted == 1


def test_an_ipc_socket_file_is_readable_and_writable_by_its_owner_only(tmp_path: Path) -> None:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        bind(sock, f"ipc://{tmp_path}/run/s.sock")
        mode = (tmp_path / "run" / "s.sock").stat().st_mode
    finally:
        sock.close(linger=0)
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_a_tcp_endpoint_without_a_host_listens_on_loopback_only() -> None:
    assert resolve_endpoint("tcp://:5555") == "tcp://127.0.0.1:5555"
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        bound = bind(sock, "tcp://:0")
    finally:
        sock.close(linger=0)
    assert bound.startswith("tcp://127.0.0.1:")
