"""The scheduler process's core: admission, continuous batching, the request lifecycle.

Public API (what the transport layer uses):

    scheduler = Scheduler(runner, tokenizer, SchedulerConfig(...))
    async with scheduler.running():
        handle = scheduler.submit(Request(prompt="...", max_tokens=64))  # or raises
        async for event in handle:          # Delta ..., then one Finished
            ...
        scheduler.submit(request, sink=on_event)  # or: on_event(event) for each, no task hop
        scheduler.submit(request, group=step_sink, key=k)  # or: a step's Deltas of many at once
        scheduler.cancel(handle.request_id)
        scheduler.stats()

`submit` raises `InvalidRequest` (subclasses: EmptyPrompt, PromptTooLong,
ParameterOutOfRange, UnknownTokenId, DuplicateRequestId) or `Rejected` (reason
QUEUE_FULL with `retry_after_s`, NEVER_FITS, SHUTTING_DOWN).

Reading order: request.py (what is asked) -> queue.py, admission.py (who gets a slot)
-> loop.py (the loop) -> step.py (one batched step), step_thread.py (where it runs)
-> sequence.py, stop.py (tokens to text) -> outcome.py, handle.py (what the caller
receives).
"""

# A request's sampling parameters are part of the scheduler's API: the layer above names
# them through it, never through the engine.
from engine.sampling import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.handle import Completion, EventSink, RequestHandle, StepSink
from scheduler.loop import Scheduler
from scheduler.outcome import (
    Delta,
    Event,
    Finished,
    FinishReason,
    SpecStats,
    Timings,
    TokenLogprob,
    Usage,
)
from scheduler.prefix_cache import PrefixCacheStats
from scheduler.prefix_reuse import PrefixCacheConfig
from scheduler.queue import Policy, Rejected, RejectReason
from scheduler.request import (
    DuplicateRequestId,
    EmptyPrompt,
    InvalidRequest,
    ParameterOutOfRange,
    PromptTooLong,
    Request,
    Speculation,
    UnknownTokenId,
)
from scheduler.stats import AheadStats, SchedulerStats, StepTimes

__all__ = [
    "AheadStats",
    "Completion",
    "Delta",
    "DuplicateRequestId",
    "EmptyPrompt",
    "Event",
    "EventSink",
    "FinishReason",
    "Finished",
    "InvalidRequest",
    "ParameterOutOfRange",
    "Policy",
    "PrefixCacheConfig",
    "PrefixCacheStats",
    "PromptTooLong",
    "RejectReason",
    "Rejected",
    "Request",
    "RequestHandle",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "SpecStats",
    "Speculation",
    "StepSink",
    "StepTimes",
    "Timings",
    "TokenLogprob",
    "UnknownTokenId",
    "Usage",
]
