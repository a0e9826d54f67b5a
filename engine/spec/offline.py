"""Offline batched generation through a `Speculator`: what tests and benchmarks drive.

It plays the scheduler's part for a fixed set of requests admitted together: one
prefill step for every prompt, then one batched step per decode step — `plan`,
`ModelRunner.step`, `resolve` — until each request has its tokens. The serving
scheduler (scheduler/) does the same with arrivals, stops and streaming.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from engine.sampling import RequestRng, SamplingParams
from engine.spec.speculator import DecodingSlot, SpecStats, Speculator, sample_rows

GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int
    params: SamplingParams = GREEDY
    speculation: str = "auto"
    seed: int | None = 0


@dataclass
class Run:
    """Per request its tokens and telemetry; wall-clock seconds of prefill and of decoding.

    `busy_s` and `busy_tokens` cover the decode steps before the first request finished,
    while every slot was decoding: the aggregate rate of N concurrent streams, which a
    fixed batch's total time hides (it waits for its slowest request alone).
    """

    tokens: list[list[int]] = field(default_factory=list)
    stats: list[SpecStats] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    busy_s: float = 0.0
    busy_tokens: int = 0


def generate(speculator: Speculator, requests: Sequence[Request]) -> Run:
    """Run `requests` together, each in a slot of the speculator's pool (freed at the end)."""
    runner, pool = speculator.runner, speculator.runner.pool
    t0 = time.perf_counter()
    slots = [pool.allocate() for _ in requests]
    rows = [
        speculator.prefill_row(s, r.prompt, 0, r.speculation)
        for s, r in zip(slots, requests, strict=True)
    ]
    outputs = runner.step(rows).rows
    for row, out in zip(rows, outputs, strict=True):
        speculator.prefilled(row, out)
    rngs = [RequestRng(r.seed) for r in requests]
    first, _ = sample_rows(
        mx.concatenate([o.logits[-1:] for o in outputs]),
        [r.params for r in requests],
        [r.prompt for r in requests],
        rngs,
    )
    run = Run(tokens=[[t] for t in first], stats=[SpecStats() for _ in requests])
    states = [
        DecodingSlot(s, t, [*r.prompt, t], r.params, rng, r.speculation)
        for s, t, r, rng in zip(slots, first, requests, rngs, strict=True)
    ]
    t1 = time.perf_counter()
    run.prefill_s = t1 - t0
    active = [i for i, r in enumerate(requests) if r.max_tokens > 1]
    while active:
        decoding = [states[i] for i in active]
        for i, d in zip(active, decoding, strict=True):
            d.remaining = requests[i].max_tokens - len(run.tokens[i])
        t = time.perf_counter()
        committed = speculator.resolve(decoding, runner.step(speculator.plan(decoding)).rows)
        run.steps += 1
        if len(active) == len(requests):
            run.busy_s += time.perf_counter() - t
            run.busy_tokens += sum(
                len(c.tokens[: d.remaining]) for d, c in zip(decoding, committed, strict=True)
            )
        for i, d, c in zip(active, decoding, committed, strict=True):
            run.stats[i].record(c.drafter, c.drafted, c.accepted)
            run.tokens[i] += c.tokens[: d.remaining]
            d.history += c.tokens
            d.pending = c.tokens[-1]
        for i in [i for i in active if len(run.tokens[i]) >= requests[i].max_tokens]:
            active.remove(i)
            speculator.release(slots[i])
    run.decode_s = time.perf_counter() - t1
    for s in slots:
        pool.free(s)
    return run
