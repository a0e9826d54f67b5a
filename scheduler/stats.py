"""Counters the scheduler keeps, and the snapshot `Scheduler.stats()` returns."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from scheduler.outcome import FinishReason
from scheduler.prefix_cache import PrefixCacheStats


@dataclass
class StepTimes:
    """Seconds summed over steps. `wall_s` runs from one step boundary to the next;
    `forward_s` is inside `runner.step`. Host overhead is the rest of the wall time."""

    steps: int = 0
    wall_s: float = 0.0
    forward_s: float = 0.0
    draft_s: float = 0.0  # speculator.plan
    sample_s: float = 0.0  # resolve, first tokens, logprobs (step thread)
    schedule_s: float = 0.0  # deadlines, reaping, admission, plan, commit (event loop)
    publish_s: float = 0.0  # detokenize, stop strings, deltas (overlaps the next forward)
    published_first: int = 0  # steps published before the next started (`PublishOrder`)


@dataclass
class AheadStats:
    """Decode-ahead (`SchedulerConfig.decode_ahead`): steps queued ahead that a plan took
    (`taken`; of them `beside_prefill` while new prompts' chunks ran in a forward of their
    own) and that it dropped (a wasted device step each: the plan drafted, a request ended
    or was cancelled, ...)."""

    taken: int = 0
    dropped: int = 0
    beside_prefill: int = 0


@dataclass(frozen=True)
class ControllerStats:
    """The speculation cost controller's state (`engine.spec.controller.CostController`):
    steps it kept plain because its credit for re-tries was spent (`held`), step times it
    left out as stalls (`stalls`), and the credit now (`credit_s`, seconds drafting may
    still lose before a re-try waits)."""

    held: int = 0
    stalls: int = 0
    credit_s: float = 0.0


@dataclass(frozen=True)
class SchedulerStats:
    waiting: int
    running: int
    free_slots: int
    reserved_bytes: int
    budget_bytes: int
    submitted: int
    rejected: int
    finished: dict[FinishReason, int]
    prompt_tokens: int  # prompt tokens prefilled
    generated_tokens: int  # tokens delivered to requests (in Deltas)
    times: StepTimes = field(default_factory=StepTimes)
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    decode_ahead: AheadStats = field(default_factory=AheadStats)
    controller: ControllerStats = field(default_factory=ControllerStats)


@dataclass
class Counters:
    submitted: int = 0
    rejected: int = 0
    finished: Counter[FinishReason] = field(default_factory=Counter)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    times: StepTimes = field(default_factory=StepTimes)
