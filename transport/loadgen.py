"""`slotserve loadgen`: drive a server with many concurrent requests and measure what it did.

Two arrival patterns:
- closed loop (`concurrency=N`): N workers, each sends its next request as soon as
  the last one ended — the load a fixed pool of callers makes;
- open loop (`rate=R`): requests arrive as a Poisson process of R per second,
  whatever the server's state — the load of independent users; past saturation
  the in-flight count grows and latency shows it.

The run ends after `duration_s` or after `requests` requests, whichever is set.
Requests are spread round-robin over `connections` client connections. Every
request leaves a `Record`; `transport.loadreport` turns records into a table,
JSON and plots.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import anyio

from transport import protocol as p
from transport.client import Client, ClientError, RequestError, to_prompt
from transport.sockets import CurveClient


class LoadgenError(ValueError):
    """A load generator setting or prompts file that cannot work."""


@dataclass(frozen=True)
class Workload:
    """One prompt and how much to generate for it."""

    prompt: p.Prompt
    max_tokens: int


@dataclass(frozen=True)
class LoadConfig:
    """`concurrency` (closed loop) or `rate` (open loop, requests/s): exactly one is set.
    `duration_s` or `requests`: at least one (the first reached ends the run)."""

    endpoint: str
    concurrency: int | None = None
    rate: float | None = None
    duration_s: float | None = None
    requests: int | None = None
    connections: int = 1
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float = 300.0  # per request
    seed: int = 0
    curve: CurveClient | None = None

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise LoadgenError("set exactly one of concurrency (closed loop) and rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise LoadgenError("concurrency must be >= 1")
        if self.rate is not None and self.rate <= 0:
            raise LoadgenError("rate must be > 0 requests/s")
        if self.duration_s is None and self.requests is None:
            raise LoadgenError("set duration_s or requests (or both)")
        if self.connections < 1:
            raise LoadgenError("connections must be >= 1")


@dataclass
class Record:
    """One request. Times are seconds from the start of the run. `outcome`: "ok",
    "rejected" (BUSY: the server said try later) or "error"."""

    start: float  # sent
    outcome: str = "ok"
    end: float | None = None  # its terminal message arrived
    deltas: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens)
    prompt_tokens: int = 0
    error: str = ""
    retry_after_s: float | None = None  # with "rejected", the server's hint

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.deltas)

    @property
    def ttft(self) -> float | None:
        return self.deltas[0][0] - self.start if self.deltas else None

    @property
    def e2e(self) -> float | None:
        return None if self.end is None or self.outcome != "ok" else self.end - self.start

    @property
    def gaps(self) -> list[float]:
        """Seconds between consecutive Deltas: the inter-token latency of this request."""
        return [b[0] - a[0] for a, b in zip(self.deltas, self.deltas[1:], strict=False)]


def synthetic_workloads(
    vocab_size: int, prompt_tokens: int, max_tokens: int, seed: int
) -> Iterator[Workload]:
    """Endless prompts of `prompt_tokens` random token ids (below 256 when the vocabulary
    allows, which avoids special tokens in byte-level vocabularies)."""
    rng = random.Random(seed)
    top = min(vocab_size, 256)
    while True:
        ids = [rng.randrange(top) for _ in range(prompt_tokens)]
        yield Workload(p.TokenPrompt(ids), max_tokens)


def jsonl_workloads(path: Path, default_max_tokens: int) -> list[Workload]:
    """Prompts from a JSON-lines file: one object per line with `"prompt"` (text), `"tokens"`
    (ids) or `"messages"` (chat), and optionally `"max_tokens"`."""
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise LoadgenError(f"{path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row: dict[str, Any] = json.loads(line)
            source = next(row[k] for k in ("prompt", "tokens", "messages") if k in row)
            out.append(Workload(to_prompt(source), int(row.get("max_tokens", default_max_tokens))))
        except (ValueError, TypeError, KeyError, StopIteration, AttributeError):
            raise LoadgenError(
                f"{path}:{n}: expected an object with 'prompt', 'tokens' or 'messages'"
            ) from None
    if not out:
        raise LoadgenError(f"{path}: no prompts")
    return out


class LoadGenerator:
    """Runs one load test: `records = await LoadGenerator(config, workloads).run()`."""

    def __init__(
        self, config: LoadConfig, workloads: Iterator[Workload], progress: TextIO | None = None
    ) -> None:
        self.config = config
        self.records: list[Record] = []
        self._workloads = workloads
        self._progress = progress
        self._sent = 0
        self._tokens = 0
        self._t0 = 0.0

    async def run(self) -> list[Record]:
        cfg = self.config
        async with _connections(cfg) as clients:
            self._t0 = time.monotonic()
            pick = itertools.cycle(clients)
            async with anyio.create_task_group() as tg:
                if self._progress is not None:
                    tg.start_soon(self._show_progress)
                if cfg.concurrency is not None:
                    async with anyio.create_task_group() as workers:
                        for _ in range(cfg.concurrency):
                            workers.start_soon(self._worker, pick)
                else:
                    await self._arrivals(pick)
                tg.cancel_scope.cancel()
            if self._progress is not None:
                self._show(final=True)
        return self.records

    def _next(self) -> Workload | None:
        """The next workload, or None when the run is over."""
        cfg = self.config
        if cfg.requests is not None and self._sent >= cfg.requests:
            return None
        if cfg.duration_s is not None and self._elapsed() >= cfg.duration_s:
            return None
        self._sent += 1
        return next(self._workloads)

    async def _worker(self, clients: Iterator[Client]) -> None:
        while (work := self._next()) is not None:
            record = await self._one(next(clients), work)
            if record.outcome == "rejected":  # back off as told, then go on
                await anyio.sleep(min(record.retry_after_s or 0.1, 1.0))

    async def _arrivals(self, clients: Iterator[Client]) -> None:
        assert self.config.rate is not None
        rng = random.Random(self.config.seed)
        due = self._elapsed()
        async with anyio.create_task_group() as tg:
            while (work := self._next()) is not None:
                tg.start_soon(self._one, next(clients), work)
                due += rng.expovariate(self.config.rate)
                await anyio.sleep(max(0.0, due - self._elapsed()))

    async def _one(self, client: Client, work: Workload) -> Record:
        cfg = self.config
        record = Record(start=self._elapsed())
        self.records.append(record)
        stream = client.generate(
            work.prompt,
            timeout_s=cfg.timeout_s,
            max_tokens=work.max_tokens,
            temperature=cfg.temperature,
            ignore_eos=cfg.ignore_eos,
        )
        try:
            async for delta in stream:
                record.deltas.append((self._elapsed(), len(delta.tokens)))
                self._tokens += len(delta.tokens)
            record.prompt_tokens = stream.prompt_tokens or 0
        except RequestError as e:
            record.outcome = "rejected" if e.code == p.ErrorCode.BUSY else "error"
            record.error = str(e)
            if e.retry_after_ms is not None:
                record.retry_after_s = e.retry_after_ms / 1000
        except (ClientError, TimeoutError) as e:
            record.outcome, record.error = "error", f"{type(e).__name__}: {e}"
        record.end = self._elapsed()
        return record

    def _elapsed(self) -> float:
        return time.monotonic() - self._t0

    async def _show_progress(self) -> None:
        while True:
            self._show()
            await anyio.sleep(0.5)

    def _show(self, final: bool = False) -> None:
        """One self-overwriting line: a bar when the run's length is known, then counts."""
        assert self._progress is not None
        cfg, t = self.config, max(self._elapsed(), 1e-9)
        done = sum(r.end is not None for r in self.records)
        fractions = []
        if cfg.duration_s is not None:
            fractions.append(t / cfg.duration_s)
        if cfg.requests is not None:
            fractions.append(done / cfg.requests)
        frac = min(1.0, max(fractions))
        bar = "#" * round(30 * frac) + "." * (30 - round(30 * frac))
        line = (
            f"\r[{bar}] {100 * frac:5.1f}%  {t:6.1f} s  {done} done  "
            f"{len(self.records) - done} in flight  {self._tokens / t:,.0f} tok/s"
        )
        self._progress.write(line + ("\n" if final else ""))
        self._progress.flush()


@asynccontextmanager
async def _connections(config: LoadConfig) -> AsyncIterator[list[Client]]:
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                Client.connect(config.endpoint, curve=config.curve, name=f"loadgen-{i}")
            )
            for i in range(config.connections)
        ]


async def welcome_of(endpoint: str, curve: CurveClient | None) -> p.Welcome:
    """The server's Welcome (model, vocabulary and limits), for synthetic prompts."""
    async with Client.connect(endpoint, curve=curve, name="loadgen-probe") as client:
        assert client.welcome is not None
        return client.welcome


async def run_load(
    config: LoadConfig,
    prompts: Path | None,
    prompt_tokens: int,
    max_tokens: int,
    progress: TextIO | None,
) -> list[Record]:
    """Run `config` with prompts from a JSON-lines file (cycled) or, without one, synthetic
    prompts of `prompt_tokens` ids; `max_tokens` where a prompt does not say."""
    workloads: Iterator[Workload]
    if prompts is not None:
        workloads = itertools.cycle(jsonl_workloads(prompts, max_tokens))
    else:
        welcome = await welcome_of(config.endpoint, config.curve)
        workloads = synthetic_workloads(welcome.vocab_size, prompt_tokens, max_tokens, config.seed)
    return await LoadGenerator(config, workloads, progress).run()
