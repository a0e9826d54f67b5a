"""Sessions across connections: a connection's end must never end another one's session.

The server learns that a connection closed from the socket monitor, which names it by
its file descriptor; the OS hands that number to the next connection at once. A client
that says Bye and closes, followed straight away by a new client, is the case where the
old connection's disconnect can reach the server after the new one has taken its
descriptor. The server runs on a thread of its own, as it does in the daemon, so its
event loop races the client's the way a real one does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from serving import ServerThread, Tiny, load_tiny

from transport.client import SyncClient

CYCLES = 200


@pytest.fixture(scope="module")
def tiny(make_model: Callable[..., Path]) -> Tiny:
    return load_tiny(make_model("tiny"))


@pytest.mark.parametrize("kind", ["ipc", "tcp"])
def test_clients_that_connect_complete_and_say_bye_in_turn_never_lose_their_session(
    tiny: Tiny, tmp_path: Path, kind: str
) -> None:
    address = f"ipc://{tmp_path}/s.sock" if kind == "ipc" else "tcp://127.0.0.1:0"
    with ServerThread(tiny, [address]) as served:
        (bound,) = served.endpoints
        for i in range(CYCLES):
            with SyncClient(bound) as client:
                completion = client.complete([1, 2, 3 + i], max_tokens=2, ignore_eos=True)
                assert len(completion.tokens) == 2, f"cycle {i}"
                assert client.stats().clients == 1, f"cycle {i}"  # the same session, still
        final = served.portal.call(served.server.stats)
    # No request was cancelled under its client. (Not `dead_clients == 0`: a client's Bye
    # may be discarded by its close, or read after its disconnect; both are fine.)
    assert final.failed == 0 and final.finished >= CYCLES
