"""What a request's handle yields: `Delta`s per step, then exactly one `Finished`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from engine.spec import speculator


class FinishReason(IntEnum):
    STOP = 0  # an end-of-generation token, a stop token id or a stop string
    LENGTH = 1  # max_tokens (or the end of the context) reached
    CANCELLED = 2  # `Scheduler.cancel`, or the consumer closed its handle
    DEADLINE = 3  # deadline_s passed
    ERROR = 4  # a fault in a step that involved this request; see `Finished.error`
    SHUTDOWN = 5  # the scheduler stopped before the request could finish


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability of a sampled token and the `n` most likely alternatives.

    Taken from the logits after logit bias and penalties, before temperature and
    truncation (the model's view, not the sampler's).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class Delta(NamedTuple):
    """A request's new output in one step.

    `token_ids`: tokens committed this step (a final stop token included; tokens
    after a stop string dropped). `text`: the text that became safe to show — bytes
    of an unfinished character and a possible beginning of a stop string are held
    back until resolved. `logprobs`: one per token when the request asked for them.
    (A NamedTuple: one is made per request per step, in a third of a frozen dataclass's time.)
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    """`cached_tokens`: prompt tokens restored from the prefix cache, not prefilled."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Timings:
    """Seconds, measured on the scheduler's clock from submission.

    `ttft_s`, `itl_*` are None when no token was produced. `itl_mean_s` spreads the
    time from first to last token over the tokens between; `itl_max_s` is the longest
    wait between two steps that brought tokens.
    """

    queued_s: float
    ttft_s: float | None
    itl_mean_s: float | None
    itl_max_s: float | None
    total_s: float


@dataclass(frozen=True, slots=True)
class SpecStats:
    """A request's speculation telemetry (the Speculator's, summed over its decode steps)."""

    drafted: int = 0  # draft tokens proposed for this request
    accepted: int = 0  # of which the target accepted
    verify_steps: int = 0  # steps whose row carried drafts
    decode_steps: int = 0  # steps with a decode or verify row
    accepted_at_depth: tuple[int, ...] = ()  # [d-1]: verify rounds that accepted d drafts or more
    depth_choices: tuple[tuple[int, int], ...] = ()  # (draft depth K, steps it was chosen)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @classmethod
    def of(cls, s: speculator.SpecStats) -> SpecStats:
        return cls(
            s.drafted,
            s.accepted,
            s.verify_rounds,
            s.steps,
            tuple(s.accepted_at_depth),
            tuple(sorted(s.choices.items())),
        )


@dataclass(frozen=True, slots=True)
class Finished:
    """The terminal event. `matched_stop`: the stop string or token id that ended the
    request (reason STOP). `error`: what went wrong (reason ERROR)."""

    request_id: str
    reason: FinishReason
    usage: Usage
    timings: Timings
    spec: SpecStats
    matched_stop: str | int | None = None
    error: str | None = None


Event = Delta | Finished
