"""What a client asks for (`Request`) and its checked, tokenized form (`Prepared`).

`prepare` is the only place a request is validated: it turns the prompt (token
ids, text, or chat messages rendered with the model's template) into token ids,
checks every parameter and the context, and raises a specific `InvalidRequest`
subclass whose message names the field and the allowed range.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from engine.sampling import SamplingError, SamplingParams
from engine.tokenizer import Tokenizer, TokenizerError

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_REQUEST_ID_CHARS = 128

ChatMessage = Mapping[str, Any]
Prompt = str | Sequence[int] | Sequence[ChatMessage]


class Speculation(StrEnum):
    """Whether a request's decode rows may carry drafts (the Speculator decides K)."""

    OFF = "off"
    ON = "on"
    AUTO = "auto"  # the Speculator's cost controller decides per step


class InvalidRequest(ValueError):
    """The request is malformed; nothing was queued. The message names the field."""


class EmptyPrompt(InvalidRequest):
    pass


class PromptTooLong(InvalidRequest):
    """The prompt (plus `max_tokens`) does not fit the context of a slot."""


class ParameterOutOfRange(InvalidRequest):
    pass


class UnknownTokenId(InvalidRequest):
    pass


class DuplicateRequestId(InvalidRequest):
    pass


@dataclass(frozen=True)
class Request:
    """One generation request.

    `prompt`: token ids, text, or chat messages (`{"role": ..., "content": ...}`)
    rendered with the model's chat template. `max_tokens`: None runs to the end of the
    context. `stop`: strings that end generation; the text streamed never contains
    them, nor anything after them. `stop_token_ids`: tokens that end generation (as do
    the model's end-of-generation tokens unless `ignore_eos`). `priority`: higher runs
    earlier (under the priority policy). `deadline_s`: seconds after submission by which
    the request ends, finished or not. `request_id`: chosen by the caller or generated.
    `prefix_cache`: False keeps the request out of the prefix cache (no lookup, no
    snapshots of its prompt).
    """

    prompt: Prompt
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    priority: int = 0
    deadline_s: float | None = None
    speculation: Speculation = Speculation.AUTO
    request_id: str | None = None
    prefix_cache: bool = True


@dataclass(frozen=True)
class Prepared:
    """A validated request: its prompt as token ids and its resolved limits."""

    request: Request
    request_id: str
    prompt: list[int]
    max_tokens: int
    stop_ids: frozenset[int]


def prepare(
    request: Request, request_id: str, tokenizer: Tokenizer, vocab_size: int, max_context: int
) -> Prepared:
    """Validate `request` for a model of `vocab_size` tokens and slots of `max_context`.

    Raises an `InvalidRequest` subclass; never anything else for bad input.
    """
    if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ParameterOutOfRange(f"request_id must have 1..{MAX_REQUEST_ID_CHARS} characters")
    prompt = _prompt_ids(request.prompt, tokenizer, vocab_size)
    try:
        request.sampling.validate(vocab_size)
    except SamplingError as e:
        raise ParameterOutOfRange(f"sampling: {e}") from None
    _check_stops(request, vocab_size)
    if not isinstance(request.priority, int):
        raise ParameterOutOfRange("priority must be an integer")
    if request.deadline_s is not None and not (
        math.isfinite(request.deadline_s) and request.deadline_s > 0
    ):
        raise ParameterOutOfRange("deadline_s must be a positive number of seconds")
    try:
        Speculation(request.speculation)
    except ValueError:
        raise ParameterOutOfRange(
            f"speculation must be one of {[s.value for s in Speculation]}"
        ) from None

    room = max_context - len(prompt)
    if room < 1:
        raise PromptTooLong(
            f"prompt has {len(prompt)} tokens; the context holds {max_context}, "
            "so no token could be generated"
        )
    max_tokens = room if request.max_tokens is None else request.max_tokens
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ParameterOutOfRange("max_tokens must be an integer >= 1")
    if max_tokens > room:
        raise PromptTooLong(
            f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the context "
            f"of {max_context}; lower max_tokens to at most {room}"
        )
    stop_ids = frozenset(request.stop_token_ids)
    if not request.ignore_eos:
        stop_ids |= tokenizer.eog_ids
    return Prepared(request, request_id, prompt, max_tokens, stop_ids)


def _prompt_ids(prompt: Prompt, tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise EmptyPrompt("prompt text is empty")
        return _encode(prompt, tokenizer)
    if isinstance(prompt, bytes | bytearray) or not isinstance(prompt, Sequence):
        raise InvalidRequest("prompt must be text, a list of token ids or a list of messages")
    if not prompt:
        raise EmptyPrompt("prompt is empty")
    if all(isinstance(m, Mapping) for m in prompt):
        return _encode(_render(list(prompt), tokenizer), tokenizer)  # type: ignore[arg-type]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise InvalidRequest("prompt must be text, a list of token ids or a list of messages")
    ids = [int(t) for t in prompt]  # type: ignore[arg-type]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise UnknownTokenId(f"prompt token ids {bad[:5]} outside the vocabulary of {vocab_size}")
    return ids


def _render(messages: list[ChatMessage], tokenizer: Tokenizer) -> str:
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or "content" not in m:
            raise InvalidRequest(f"prompt message {i} needs a string 'role' and a 'content'")
    try:
        return tokenizer.render_chat([dict(m) for m in messages])
    except TokenizerError as e:
        raise InvalidRequest(f"prompt messages: {e}") from None


def _encode(text: str, tokenizer: Tokenizer) -> list[int]:
    try:
        ids = tokenizer.encode(text)
    except TokenizerError as e:
        raise InvalidRequest(f"prompt: {e}") from None
    if not ids:
        raise EmptyPrompt("prompt encodes to no tokens")
    return ids


def _check_stops(request: Request, vocab_size: int) -> None:
    if len(request.stop) > MAX_STOP_STRINGS:
        raise ParameterOutOfRange(f"stop: at most {MAX_STOP_STRINGS} strings")
    for s in request.stop:
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
            raise ParameterOutOfRange(f"stop strings must have 1..{MAX_STOP_CHARS} characters")
    bad = [t for t in request.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise UnknownTokenId(f"stop_token_ids {bad[:5]} outside the vocabulary of {vocab_size}")
