"""The wire contract as docs/PROTOCOL.md states it: encodings, defaults, compatibility rules."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from transport import protocol as p

DOC = Path(__file__).parents[1] / "docs" / "PROTOCOL.md"
GENERATE = msgspec.msgpack.decode(p.encode(p.Generate(1, p.TokenPrompt([1]))))  # every field


def doc_examples() -> list[tuple[str, str, str]]:
    """(message, JSON, hex) rows of the Examples table."""
    rows = re.findall(r"^\| (.+?) \| `(\[.*?\])` \| `([0-9a-f ]+)` \|$", DOC.read_text(), re.M)
    assert len(rows) >= 7
    return rows


@pytest.mark.parametrize(("name", "json", "hex_bytes"), doc_examples())
def test_the_documented_examples_are_what_the_structs_encode(
    name: str, json: str, hex_bytes: str
) -> None:
    frame = bytes.fromhex(hex_bytes.replace(" ", ""))
    value = msgspec.msgpack.decode(frame)
    assert msgspec.json.encode(value).decode() == json
    decode = p.decode_client if value[0] < 16 else p.decode_server  # tags: client 1.., server 16..
    assert p.encode(decode(frame)) == frame


def test_every_message_survives_a_round_trip() -> None:
    messages: list[p.ClientMessage | p.ServerMessage] = [
        p.Hello(1, 0, "me"),
        p.Generate(1, p.ChatPrompt([p.ChatMessage("user", "hi")]), 8, 0.5, stop=["x"], seed=3),
        p.Cancel(1),
        p.Ping(2),
        p.GetStats(),
        p.Bye(),
        p.Deltas([p.Delta(1, [5, 6], "ab", [p.Logprob(-0.5, [(5, -0.5)])] * 2)]),
        p.Finished(1, p.FinishReason.STOP, p.Usage(3, 2), p.Timings(1, 2, 3, 4, 5), stop="x"),
        p.Error(p.ErrorCode.BUSY, "full", 4, 250),
        p.Pong(2, p.ServerState.DRAINING),
    ]
    for msg in messages:
        decode = p.decode_client if isinstance(msg, p.ClientMessage) else p.decode_server
        assert decode(p.encode(msg)) == msg


def test_missing_trailing_fields_take_their_defaults_and_extra_ones_are_ignored() -> None:
    short = msgspec.msgpack.encode([2, 7, [0, [1, 2, 3]], 4, 0.0])
    assert p.decode_client(short) == p.Generate(7, p.TokenPrompt([1, 2, 3]), 4, 0.0)
    longer = msgspec.msgpack.encode([3, 7, "a field from a later minor version"])
    assert p.decode_client(longer) == p.Cancel(7)


@pytest.mark.parametrize(
    "value",
    [
        [2, -1, [0, [1]]],  # negative request id
        [2, 1, [0, [1]], "8"],  # max_tokens of the wrong type
        [2, 1, [9, "x"]],  # unknown prompt kind
        [2, 1, [0, [1]], None, 1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, {"7": 1.0}],  # string bias key
        [*GENERATE[:-1], 3],  # unknown speculation mode
        [99],  # unknown tag
        [2, 1],  # too short
        {"request_id": 1},  # a map, not an array
    ],
)
def test_malformed_client_messages_fail_to_decode(value: object) -> None:
    with pytest.raises(msgspec.DecodeError):
        p.decode_client(msgspec.msgpack.encode(value))


def test_server_messages_do_not_decode_as_client_messages() -> None:
    with pytest.raises(msgspec.DecodeError):
        p.decode_client(p.encode(p.Pong(1)))


def test_a_peer_of_minor_version_0_never_receives_the_fields_of_1_1() -> None:
    finished = p.Finished(
        1, p.FinishReason.STOP, p.Usage(30, 2, cached_tokens=24), p.Timings(1, 2, 3, 4, 5)
    )
    old = msgspec.msgpack.decode(p.encode(finished, minor=0))
    assert old[3] == [30, 2]  # usage as 1.0 wrote it
    assert msgspec.msgpack.decode(p.encode(finished))[3] == [30, 2, 24]
    assert p.decode_server(p.encode(finished, minor=0)).usage == p.Usage(30, 2)
    generate = p.Generate(1, p.TokenPrompt([1]), prefix_cache=False)
    assert msgspec.msgpack.decode(p.encode(generate, minor=0)) == GENERATE[:-1]
    assert p.decode_client(p.encode(generate)).prefix_cache is False
    stats = msgspec.msgpack.decode(p.encode(p.Stats(*range(18), prefix_hits=3), minor=0))
    assert stats == [22, *range(18)]
