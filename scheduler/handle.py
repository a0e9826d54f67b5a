"""The caller's side of one submitted request: its events, by stream or by sink.

Three ways to receive them, chosen at `Scheduler.submit`:
- a `RequestHandle` to iterate (`async for event in handle`): each event waits in the
  handle's own memory stream for the consumer's task — simple, for in-process callers;
- an `EventSink`, a plain function the scheduler calls with each event as it
  publishes, on the event loop, with no task hop;
- a `StepSink` shared by many requests, each under a key of the caller's: the
  scheduler hands it a whole step's Deltas of all its requests in one call (the
  transport server has one per connection: a step costs it one call per connection,
  not one per request).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from scheduler.outcome import Delta, Event, Finished, TokenLogprob

log = logging.getLogger("slotserve.scheduler")

EventSink = Callable[[Event], None]
"""Called synchronously on the scheduler's event loop with each event of one request, in
order: zero or more `Delta`s, then exactly one `Finished`. It must not block. A sink that
raises on a Delta ends its request with FinishReason.ERROR (the Finished still comes to
it); nothing it raises reaches other requests or the loop."""


class StepSink(Protocol):
    """Takes the events of many requests, each known by the key given at `submit`. Called
    synchronously on the scheduler's event loop; must not block.

    `deltas`: once per step with the `(key, Delta)` of each of its requests that produced
    output in that step, in publishing order (occasionally more than once per step: a
    request's last text at its end comes on its own). `end`: once per request with its
    `Finished`, after all its Deltas. Should `deltas` raise, every request in that call
    ends with FinishReason.ERROR (their Finished still come to `end`); nothing it raises
    reaches other requests or the loop.
    """

    def deltas(self, items: list[tuple[Any, Delta]]) -> None: ...

    def end(self, key: Any, event: Finished) -> None: ...


@dataclass(frozen=True)
class Completion:
    """Everything one request produced, gathered from its events."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finished: Finished


class Outlet:
    """Where the scheduler puts one request's events: `emit` each (False once they can no
    longer be delivered), then `close`. `failure` says why a sink stopped taking them."""

    failure: str | None = None
    group: StepSink | None = None  # set when the scheduler may batch its Deltas (`GroupOutlet`)
    key: Any = None

    def emit(self, event: Event) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def failed(self, e: Exception) -> str:
        """Record that the sink raised `e` (the first failure is kept); why it stopped."""
        self.failure = self.failure or f"the event sink failed: {type(e).__name__}: {e}"
        return self.failure


class StreamOutlet(Outlet):
    """Into a memory stream without bound (the scheduler never waits for a consumer), read
    through a `RequestHandle`; False once the handle is closed."""

    def __init__(self) -> None:
        self.send, self.receive = anyio.create_memory_object_stream[Event](math.inf)

    def emit(self, event: Event) -> bool:
        try:
            self.send.send_nowait(event)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False
        return True

    def close(self) -> None:
        self.send.close()


class SinkOutlet(Outlet):
    """Into an `EventSink`, called at once; False (and `failure` set) once it has raised."""

    def __init__(self, request_id: str, sink: EventSink) -> None:
        self.request_id = request_id
        self.sink = sink

    def emit(self, event: Event) -> bool:
        if self.failure is not None and isinstance(event, Delta):
            return False
        try:
            self.sink(event)
        except Exception as e:
            log.exception("%s: the event sink failed on %s", self.request_id, type(event).__name__)
            self.failed(e)
            return False
        return True


class GroupOutlet(SinkOutlet):
    """Into a `StepSink` under `key`. The scheduler batches a step's Deltas of all requests
    sharing the sink into one `deltas` call itself (`Scheduler._publish`); `emit` delivers
    one event alone, as a `SinkOutlet` does."""

    group: StepSink  # (never None here)

    def __init__(self, request_id: str, group: StepSink, key: Any) -> None:
        super().__init__(request_id, self._to_group)
        self.group, self.key = group, key

    def _to_group(self, event: Event) -> None:
        if isinstance(event, Delta):
            self.group.deltas([(self.key, event)])
        else:
            self.group.end(self.key, event)


class RequestHandle:
    """`async for event in handle`: zero or more `Delta`s, then exactly one `Finished`.

    Events are buffered without bound, so the scheduler never waits for a consumer.
    Closing the handle (`aclose`) before the end cancels the request. A request
    submitted with a sink has a handle without events (`events` None): only its id,
    prompt length and `cancel`.
    """

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        events: MemoryObjectReceiveStream[Event] | None,
        cancel: Callable[[str], bool],
    ) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._events = events
        self._cancel = cancel

    async def __aiter__(self) -> AsyncIterator[Event]:
        if self._events is None:
            raise RuntimeError(f"{self.request_id}: submitted with a sink; its events go there")
        async for event in self._events:
            yield event

    def cancel(self) -> bool:
        """Cancel the request (it ends with FinishReason.CANCELLED); False if it had ended."""
        return self._cancel(self.request_id)

    async def aclose(self) -> None:
        if self._events is not None:
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
