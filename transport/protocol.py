"""The wire contract: every message a client and the server exchange, as msgspec Structs.

One ZeroMQ frame carries one message, msgpack-encoded. Every struct is
`array_like`: it travels as a msgpack array whose first element is the
message's integer tag and whose remaining elements are its fields in
declaration order. Senders write every field; receivers take missing trailing
fields as their defaults and ignore extra trailing elements, which is what
lets a minor version append fields. Nested structs (`Usage`, `Delta`, ...) are arrays too, with
no tag unless they take part in a union (`TokenPrompt`, `TextPrompt`,
`ChatPrompt`). docs/PROTOCOL.md is the prose version of this file; a change
here is a change there, and any change follows its versioning rules.

Decoding is the validation: `decode_client` / `decode_server` raise
`msgspec.DecodeError` (a `msgspec.ValidationError` for wrong shapes or
values) and never return a half-checked message. Value ranges of sampling
parameters are the scheduler's to check; the types here bound only what the
wire itself must (ids are unsigned 63-bit, counts are not negative).
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

PROTOCOL_MAJOR = 1  # incompatible changes
PROTOCOL_MINOR = 1  # additions: trailing fields with defaults, new message tags, new enum values

Uint = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
RequestId = Uint  # chosen by the client, unique among its connection's outstanding requests


class _Message(msgspec.Struct, array_like=True, gc=False):
    """Base of every wire struct (vLLM V1's engine messages are the model)."""


# -- enums --------------------------------------------------------------------------------


class Speculation(enum.IntEnum):
    """Speculative decoding for one request: never, always, or as the server's controller sees fit."""

    OFF = 0
    ON = 1
    AUTO = 2


class FinishReason(enum.IntEnum):
    """Why a request ended normally (abnormal ends are an `Error`)."""

    STOP = 0  # an end-of-generation token, a stop token id or a stop string (see Finished.stop)
    LENGTH = 1  # max_tokens reached, or the context is full


class ErrorCode(enum.IntEnum):
    INVALID_REQUEST = 1  # malformed frame, bad parameters, duplicate request id, bad version
    TOO_LONG = 2  # the prompt (plus max_tokens) can never fit the context or the memory budget
    BUSY = 3  # queue or outstanding limit full; retry after retry_after_ms
    CANCELLED = 4  # by the client's Cancel, or by the server (slow consumer: see the message)
    DEADLINE_EXCEEDED = 5  # the request's deadline passed before it finished
    SHUTTING_DOWN = 6  # the server is draining or stopping
    INTERNAL = 7  # a fault inside the server; other requests are unaffected
    NO_SESSION = 8  # no Hello on this connection (or the server forgot it): send Hello again


class ServerState(enum.IntEnum):
    STARTING = 0  # loading or warming up: Generate is answered with BUSY
    READY = 1
    DRAINING = 2  # finishing in-flight work: Generate is answered with SHUTTING_DOWN


# -- client -> server ---------------------------------------------------------------------


class Hello(_Message, tag=1):
    """First message on a connection. The server answers Welcome, or Error(INVALID_REQUEST) when
    `major` differs from its own. Sending Hello again starts a new session: the connection's
    outstanding requests are cancelled (without further messages)."""

    major: Uint
    minor: Uint
    client: str = ""  # free text for the server's logs


class TokenPrompt(_Message, tag=0):
    tokens: list[Uint]


class TextPrompt(_Message, tag=1):
    """Encoded with the model's tokenizer, special tokens written in the text included."""

    text: str


class ChatMessage(_Message):
    role: str
    content: str


class ChatPrompt(_Message, tag=2):
    """Rendered with the model's chat template (generation prompt added), then encoded."""

    messages: list[ChatMessage]


Prompt = TokenPrompt | TextPrompt | ChatPrompt


class Generate(_Message, tag=2):
    """Start a request. Answered with Accepted, then Deltas, then exactly one terminal message
    (Finished or Error with this request_id) — or at once with that one terminal Error."""

    request_id: RequestId
    prompt: Prompt
    max_tokens: Uint | None = None  # None: until the context is full
    temperature: float = 1.0  # 0: greedy
    top_k: Uint = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[Uint, float] = {}
    seed: Uint | None = None  # None: the server draws one
    stop: list[str] = []  # stop strings; the match is not streamed
    stop_token_ids: list[Uint] = []
    ignore_eos: bool = False
    logprobs: Uint = 0  # top-n log-probabilities per generated token
    priority: int = 0  # higher runs first
    deadline_ms: Uint | None = None  # after the server receives the request
    speculation: Speculation = Speculation.AUTO
    prefix_cache: bool = True  # 1.1: False keeps the request out of the prefix cache


class Cancel(_Message, tag=3):
    """End a request early. Its terminal message is Error(CANCELLED), or its Finished if that
    was already on its way. Cancelling an unknown or ended request does nothing."""

    request_id: RequestId


class Ping(_Message, tag=4):
    """Liveness in both directions: the server answers Pong; any client message counts as a
    heartbeat."""

    nonce: Uint = 0


class GetStats(_Message, tag=5):
    """Ask for a Stats snapshot."""


class Bye(_Message, tag=6):
    """End the session: outstanding requests are cancelled without further messages."""


ClientMessage = Hello | Generate | Cancel | Ping | GetStats | Bye


# -- server -> client ---------------------------------------------------------------------


class Welcome(_Message, tag=16):
    major: Uint
    minor: Uint
    server: str  # software and version
    model: str
    context_length: Uint  # tokens per sequence, prompt and output together
    vocab_size: Uint
    eos_token_ids: list[Uint]
    max_outstanding: Uint  # requests in flight per connection; more are answered BUSY
    max_message_bytes: Uint  # larger frames close the connection
    heartbeat_interval_ms: Uint  # send something (Ping will do) at least this often
    heartbeat_timeout_ms: Uint  # silent this long: the server cancels your requests


class Accepted(_Message, tag=17):
    request_id: RequestId
    prompt_tokens: Uint  # after rendering and encoding


class Logprob(_Message):
    """One generated token's log-probability and the top-n `(token id, logprob)` alternatives,
    best first; from the logits after bias and penalties, before temperature and truncation."""

    logprob: float
    top: list[tuple[Uint, float]] = []


class Delta(_Message):
    """One request's output of one step: new token ids, the text they complete and, when asked,
    one Logprob per token. `text` may lag `tokens` (incomplete UTF-8, a possible stop string)."""

    request_id: RequestId
    tokens: list[Uint]
    text: str = ""
    logprobs: list[Logprob] = []


class Deltas(_Message, tag=18):
    """Everything one step produced for one connection: one Delta per request that advanced."""

    items: list[Delta]


class Usage(_Message):
    prompt_tokens: Uint
    completion_tokens: Uint
    cached_tokens: Uint = 0  # 1.1: prompt tokens restored from the prefix cache, not prefilled


class Timings(_Message):
    """Milliseconds on the server's clock from the moment it received the Generate. The
    first-token and inter-token fields are None when no token was produced."""

    queued_ms: float  # until the request got a slot
    first_token_ms: float | None  # until its first token was sampled
    itl_mean_ms: float | None  # first to last token, spread over the tokens between
    itl_max_ms: float | None  # the longest wait between two steps that brought tokens
    total_ms: float  # until it finished


class SpeculationStats(_Message):
    drafted: Uint = 0  # draft tokens proposed
    accepted: Uint = 0  # of which the model accepted
    verify_steps: Uint = 0  # steps whose row carried drafts
    decode_steps: Uint = 0  # steps with a decode or verify row


class Finished(_Message, tag=19):
    request_id: RequestId
    reason: FinishReason
    usage: Usage
    timings: Timings
    speculation: SpeculationStats = msgspec.field(default_factory=SpeculationStats)
    stop: int | str | None = None  # with STOP: the stop token id or stop string; None for eos


class Error(_Message, tag=20):
    """A request's terminal failure (request_id set) or a connection-level complaint (None)."""

    code: ErrorCode
    message: str
    request_id: RequestId | None = None
    retry_after_ms: Uint | None = None  # with BUSY


class Pong(_Message, tag=21):
    nonce: Uint
    state: ServerState = ServerState.READY


class Stats(_Message, tag=22):
    """A snapshot of the server. Counters run since the server started."""

    state: ServerState
    clients: Uint  # connections with a session
    requests_waiting: Uint  # queued for a slot
    requests_running: Uint  # holding a slot
    free_slots: Uint
    reserved_bytes: Uint  # slot memory reserved by admitted requests
    budget_bytes: Uint  # the admission budget
    submitted: Uint
    rejected: Uint
    finished: Uint  # ended with Finished
    failed: Uint  # ended with an Error after being accepted (cancelled ones included)
    prompt_tokens: Uint  # prefilled
    generated_tokens: Uint
    steps: Uint  # batched forwards
    frames_received: Uint
    frames_rejected: Uint  # malformed frames and messages a server never takes
    slow_consumers: Uint  # connections whose requests were cancelled for a full send buffer
    dead_clients: Uint  # connections dropped on a disconnect or heartbeat silence
    # 1.1: the prefix cache (all 0 when it is off)
    prefix_lookups: Uint = 0  # prompts looked up
    prefix_hits: Uint = 0  # of which resumed from a cached prefix
    prefix_tokens_saved: Uint = 0  # prompt tokens not prefilled thanks to hits
    prefix_bytes: Uint = 0  # memory held by cached prefixes (device or host: the placement)
    prefix_evictions: Uint = 0


ServerMessage = Welcome | Accepted | Deltas | Finished | Error | Pong | Stats

_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_server_decoder = msgspec.msgpack.Decoder(ServerMessage)


# Trailing fields each minor version appended, by struct: a peer that announced an older
# minor never receives them (see `encode`).
_APPENDED_IN_1: dict[type[_Message], int] = {Generate: 1, Usage: 1, Stats: 5}


def encode(message: ClientMessage | ServerMessage, minor: int = PROTOCOL_MINOR) -> bytes:
    """The frame for `message`, written for a peer of protocol minor version `minor`:
    fields newer than that minor are left out (the peer takes the rest as before)."""
    if minor >= 1:
        return _encoder.encode(message)
    return _encoder.encode(_as_minor_0(message))


def _as_minor_0(message: _Message) -> list[object]:
    values = [
        _as_minor_0(v) if type(v) in _APPENDED_IN_1 else v for v in msgspec.structs.astuple(message)
    ]
    tag = message.__struct_config__.tag
    kept = values[: len(values) - _APPENDED_IN_1.get(type(message), 0)]
    return kept if tag is None else [tag, *kept]


def decode_client(frame: bytes | memoryview) -> ClientMessage:
    """One client frame -> its message; raises `msgspec.DecodeError` on anything else."""
    return _client_decoder.decode(frame)


def decode_server(frame: bytes | memoryview) -> ServerMessage:
    """One server frame -> its message; raises `msgspec.DecodeError` on anything else."""
    return _server_decoder.decode(frame)
