"""Between the wire and the scheduler: protocol structs <-> scheduler requests and events.

The scheduler has its own types (`scheduler.request`, `scheduler.outcome`); this
module is the only place that knows both sides, so either can change without
the other noticing.
"""

from __future__ import annotations

import scheduler as s
from transport import protocol as p

_SPECULATION = {
    p.Speculation.OFF: s.Speculation.OFF,
    p.Speculation.ON: s.Speculation.ON,
    p.Speculation.AUTO: s.Speculation.AUTO,
}

_FAILURES = {
    s.FinishReason.CANCELLED: p.ErrorCode.CANCELLED,
    s.FinishReason.DEADLINE: p.ErrorCode.DEADLINE_EXCEEDED,
    s.FinishReason.ERROR: p.ErrorCode.INTERNAL,
    s.FinishReason.SHUTDOWN: p.ErrorCode.SHUTTING_DOWN,
}

_REJECTS = {
    s.RejectReason.QUEUE_FULL: p.ErrorCode.BUSY,
    s.RejectReason.NEVER_FITS: p.ErrorCode.TOO_LONG,
    s.RejectReason.SHUTTING_DOWN: p.ErrorCode.SHUTTING_DOWN,
}


def to_request(msg: p.Generate, request_id: str) -> s.Request:
    """The scheduler request for a Generate; the scheduler validates the values."""
    prompt: str | list[int] | list[dict[str, str]]
    match msg.prompt:
        case p.TokenPrompt(tokens):
            prompt = tokens
        case p.TextPrompt(text):
            prompt = text
        case p.ChatPrompt(messages):
            prompt = [{"role": m.role, "content": m.content} for m in messages]
    sampling = s.SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        logit_bias=tuple(msg.logit_bias.items()),
        seed=msg.seed,
        logprobs=msg.logprobs,
    )
    return s.Request(
        prompt=prompt,
        sampling=sampling,
        max_tokens=msg.max_tokens,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        priority=msg.priority,
        deadline_s=None if msg.deadline_ms is None else msg.deadline_ms / 1000.0,
        speculation=_SPECULATION[msg.speculation],
        request_id=request_id,
        prefix_cache=msg.prefix_cache,
    )


def rejection(request_id: int, exc: s.InvalidRequest | s.Rejected) -> p.Error:
    """The terminal Error for a Generate the scheduler refused."""
    if isinstance(exc, s.Rejected):
        retry = None if exc.retry_after_s is None else round(exc.retry_after_s * 1000)
        return p.Error(_REJECTS[exc.reason], str(exc), request_id, retry)
    code = p.ErrorCode.TOO_LONG if isinstance(exc, s.PromptTooLong) else p.ErrorCode.INVALID_REQUEST
    return p.Error(code, str(exc), request_id)


def to_deltas(items: list[tuple[int, s.Delta]]) -> list[p.Delta]:
    """The wire Deltas of (request id, scheduler Delta) pairs: a step's, one connection's."""
    return [
        p.Delta(rid, list(d.token_ids), d.text) if not d.logprobs else _with_logprobs(rid, d)
        for rid, d in items
    ]


def _with_logprobs(request_id: int, event: s.Delta) -> p.Delta:
    logprobs = [p.Logprob(lp.logprob, list(lp.top)) for lp in event.logprobs]
    return p.Delta(request_id, list(event.token_ids), event.text, logprobs)


def to_terminal(request_id: int, event: s.Finished) -> p.Finished | p.Error:
    """Finished for a normal end (STOP, LENGTH); the matching Error for any other."""
    code = _FAILURES.get(event.reason)
    if code is not None:
        return p.Error(code, event.error or _failure_text(event.reason), request_id)
    t, s = event.timings, event.spec
    return p.Finished(
        request_id,
        p.FinishReason(int(event.reason)),
        p.Usage(
            event.usage.prompt_tokens, event.usage.completion_tokens, event.usage.cached_tokens
        ),
        p.Timings(
            t.queued_s * 1000.0,
            _ms(t.ttft_s),
            _ms(t.itl_mean_s),
            _ms(t.itl_max_s),
            t.total_s * 1000.0,
        ),
        p.SpeculationStats(s.drafted, s.accepted, s.verify_steps, s.decode_steps),
        event.matched_stop,
    )


def scheduler_counters(stats: s.SchedulerStats) -> dict[str, int]:
    """The scheduler's side of a Stats message, as its fields' keyword arguments."""
    finished = stats.finished
    return {
        "requests_waiting": stats.waiting,
        "requests_running": stats.running,
        "free_slots": stats.free_slots,
        "reserved_bytes": stats.reserved_bytes,
        "budget_bytes": stats.budget_bytes,
        "submitted": stats.submitted,
        "rejected": stats.rejected,
        "finished": sum(finished.get(r, 0) for r in _NORMAL_ENDS),
        "failed": sum(finished.get(r, 0) for r in _FAILURES),
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "steps": stats.times.steps,
        "prefix_lookups": stats.prefix_cache.lookups,
        "prefix_hits": stats.prefix_cache.hits,
        "prefix_tokens_saved": stats.prefix_cache.tokens_saved,
        "prefix_bytes": stats.prefix_cache.bytes_held,
        "prefix_evictions": stats.prefix_cache.evictions,
    }


_NORMAL_ENDS = (s.FinishReason.STOP, s.FinishReason.LENGTH)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _failure_text(reason: s.FinishReason) -> str:
    return {
        s.FinishReason.CANCELLED: "cancelled",
        s.FinishReason.DEADLINE: "the request's deadline passed",
        s.FinishReason.SHUTDOWN: "the server stopped before the request finished",
    }.get(reason, "internal error")
