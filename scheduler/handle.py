"""The caller's side of one submitted request: its stream of events."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from anyio.streams.memory import MemoryObjectReceiveStream

from scheduler.outcome import Delta, Event, Finished, TokenLogprob


@dataclass(frozen=True)
class Completion:
    """Everything one request produced, gathered from its events."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finished: Finished


class RequestHandle:
    """`async for event in handle`: zero or more `Delta`s, then exactly one `Finished`.

    Events are buffered without bound, so the scheduler never waits for a consumer.
    Closing the handle (`aclose`) before the end cancels the request.
    """

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        events: MemoryObjectReceiveStream[Event],
        cancel: Callable[[str], bool],
    ) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._events = events
        self._cancel = cancel

    async def __aiter__(self) -> AsyncIterator[Event]:
        async for event in self._events:
            yield event

    def cancel(self) -> bool:
        """Cancel the request (it ends with FinishReason.CANCELLED); False if it had ended."""
        return self._cancel(self.request_id)

    async def aclose(self) -> None:
        await self._events.aclose()

    async def collect(self) -> Completion:
        """Wait for the end and return the whole output."""
        tokens: list[int] = []
        text: list[str] = []
        logprobs: list[TokenLogprob] = []
        async for event in self:
            if isinstance(event, Delta):
                tokens += event.token_ids
                text.append(event.text)
                logprobs += event.logprobs
            else:
                return Completion(tokens, "".join(text), logprobs, event)
        raise RuntimeError(f"{self.request_id}: event stream ended without Finished")
