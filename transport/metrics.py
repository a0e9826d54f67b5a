"""Prometheus metrics of one daemon, served over HTTP by prometheus-client.

Two sources, both read on the event loop so nothing touches the scheduler from
the HTTP thread:

* `refresh()` snapshots `Scheduler.stats()` (a frozen value); the registry's
  collector turns the latest snapshot into counters and gauges at scrape time:
  requests by outcome, tokens in and out, queue depth, active slots, slot memory,
  the prefix cache (lookups, hits, hit ratio, tokens saved, bytes, evictions),
  step time and host overhead (as summaries: `_count` steps, `_sum` seconds), and MLX's
  own memory: bytes of live arrays, of freed buffers it keeps for reuse, and the peak.
* `observe(event)` sees every request event the server relays: TTFT (from the
  Finished timings), inter-token latency (gaps between a request's Deltas, split
  evenly over the tokens of each Delta), speculation drafted / accepted and the
  controller's choices (decode steps per draft depth).
"""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

import anyio
import mlx.core as mx
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

import scheduler as s
from transport.server import Serves

PREFIX = "slotserve"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REFRESH_INTERVAL_S = 0.5


class _SnapshotCollector(Collector):
    """Counters and gauges of the latest scheduler snapshot."""

    def __init__(self, stats: s.SchedulerStats) -> None:
        self.stats = stats
        self.mlx_bytes = (0, 0, 0)  # active, cache, peak

    def collect(self) -> Iterator[Metric]:
        st = self.stats
        outcomes = CounterMetricFamily(
            f"{PREFIX}_requests", "Requests ended, by outcome", labels=["outcome"]
        )
        for reason in s.FinishReason:
            outcomes.add_metric([reason.name.lower()], st.finished.get(reason, 0))
        outcomes.add_metric(["rejected"], st.rejected)
        yield outcomes
        yield CounterMetricFamily(
            f"{PREFIX}_requests_submitted", "Requests accepted by the scheduler", st.submitted
        )
        yield CounterMetricFamily(
            f"{PREFIX}_prompt_tokens", "Prompt tokens prefilled", st.prompt_tokens
        )
        yield CounterMetricFamily(
            f"{PREFIX}_generated_tokens", "Tokens delivered to requests", st.generated_tokens
        )
        yield GaugeMetricFamily(f"{PREFIX}_queue_depth", "Requests waiting for a slot", st.waiting)
        yield GaugeMetricFamily(f"{PREFIX}_active_slots", "Requests holding a slot", st.running)
        yield GaugeMetricFamily(f"{PREFIX}_free_slots", "Slots free", st.free_slots)
        yield GaugeMetricFamily(
            f"{PREFIX}_slot_memory_bytes",
            "Slot memory reserved by admitted requests",
            st.reserved_bytes,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_slot_memory_budget_bytes", "The admission budget", st.budget_bytes
        )
        for name, text, nbytes in zip(
            ("active", "cache", "peak"),
            (
                "Bytes of live MLX arrays: weights, slot pool, snapshots, a step's buffers",
                "Bytes of freed buffers MLX keeps for reuse (bounded by mlx_cache_limit)",
                "The most bytes of live MLX arrays at once since start",
            ),
            self.mlx_bytes,
            strict=True,
        ):
            yield GaugeMetricFamily(f"{PREFIX}_mlx_{name}_bytes", text, nbytes)
        pc = st.prefix_cache
        for family, name, text, value in (
            (CounterMetricFamily, "lookups", "Prompts looked up in the cache", pc.lookups),
            (CounterMetricFamily, "hits", "Prompts resumed from a cached prefix", pc.hits),
            (GaugeMetricFamily, "hit_ratio", "Hits per lookup since start", pc.hit_rate),
            (CounterMetricFamily, "tokens_saved", "Prompt tokens not prefilled", pc.tokens_saved),
            (GaugeMetricFamily, "bytes", "Memory held by snapshots", pc.bytes_held),
            (GaugeMetricFamily, "budget_bytes", "The cache's memory budget", pc.budget_bytes),
            (CounterMetricFamily, "evictions", "Snapshots evicted", pc.evictions),
        ):
            yield family(f"{PREFIX}_prefix_cache_{name}", text, value)
        ahead = st.decode_ahead
        for name, text, value in (
            ("taken", "Decode steps queued ahead and taken", ahead.taken),
            ("dropped", "Decode steps queued ahead and dropped (wasted)", ahead.dropped),
        ):
            yield CounterMetricFamily(f"{PREFIX}_decode_ahead_{name}", text, value)
        ctrl = st.controller
        for family, name, text, value in (
            (CounterMetricFamily, "held_steps", "Steps kept plain: the credit for re-tries was spent", ctrl.held),
            (CounterMetricFamily, "stalls", "Step times the cost controller left out as stalls", ctrl.stalls),
            (GaugeMetricFamily, "credit_seconds", "What drafting may still lose before a re-try waits", ctrl.credit_s),
        ):  # fmt: skip
            yield family(f"{PREFIX}_spec_{name}", text, value)
        t = st.times
        yield SummaryMetricFamily(
            f"{PREFIX}_step_seconds", "Wall time per batched step", t.steps, t.wall_s
        )
        yield SummaryMetricFamily(
            f"{PREFIX}_forward_seconds",
            "Time inside the model forward per step",
            t.steps,
            t.forward_s,
        )
        yield SummaryMetricFamily(
            f"{PREFIX}_host_overhead_seconds",
            "Step wall time outside the forward (scheduling, sampling, publishing)",
            t.steps,
            max(0.0, t.wall_s - t.forward_s),
        )


class Metrics:
    """The daemon's registry. Call `observe` and `refresh` on the event loop; `serve`
    starts the HTTP endpoint on a thread of prometheus-client's own."""

    def __init__(self, scheduler: Serves) -> None:
        self.scheduler = scheduler
        self.registry = CollectorRegistry()
        self._snapshot = _SnapshotCollector(scheduler.stats())
        self.registry.register(self._snapshot)
        self.ttft = Histogram(
            f"{PREFIX}_ttft_seconds",
            "Time from submit to the first token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            f"{PREFIX}_itl_seconds",
            "Time between a request's tokens",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.drafted = Counter(
            f"{PREFIX}_spec_drafted_tokens", "Draft tokens proposed", registry=self.registry
        )
        self.accepted = Counter(
            f"{PREFIX}_spec_accepted_tokens", "Draft tokens accepted", registry=self.registry
        )
        self.depth_steps = Counter(
            f"{PREFIX}_spec_depth_steps",
            "Decode steps of finished requests by the draft depth the controller chose (0: plain)",
            ["depth"],
            registry=self.registry,
        )
        self._last_delta: dict[str, float] = {}  # request id -> when its last Delta came

    def observe(self, event: s.Event) -> None:
        """Account one event of a request (the server calls this for every one)."""
        now = time.monotonic()
        rid = event.request_id
        if isinstance(event, s.Delta):
            last = self._last_delta.get(rid)
            self._last_delta[rid] = now
            if last is not None and event.token_ids:
                gap = (now - last) / len(event.token_ids)
                for _ in event.token_ids:
                    self.itl.observe(gap)
            return
        self._last_delta.pop(rid, None)
        if event.timings.ttft_s is not None:
            self.ttft.observe(event.timings.ttft_s)
        self.drafted.inc(event.spec.drafted)
        self.accepted.inc(event.spec.accepted)
        for depth, steps in event.spec.depth_choices:
            self.depth_steps.labels(str(depth)).inc(steps)

    def refresh(self) -> None:
        self._snapshot.stats = self.scheduler.stats()
        self._snapshot.mlx_bytes = (
            mx.get_active_memory(),
            mx.get_cache_memory(),
            mx.get_peak_memory(),
        )

    async def refresh_forever(self) -> None:
        while True:
            self.refresh()
            await anyio.sleep(REFRESH_INTERVAL_S)

    def serve(self, host: str, port: int) -> WSGIServer:
        """Start the HTTP endpoint (`/metrics`); `.shutdown()` the result to stop it.
        Port 0 binds a free port (`result.server_port`)."""
        server, _ = start_http_server(port, host, registry=self.registry)
        return server


def scrape(port: int, host: str = "127.0.0.1") -> dict[str, float]:
    """Every sample a metrics endpoint serves now, keyed by name and labels
    (`name{label=value,...}`, labels sorted): what tests, the soak and benchmarks read."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, for a metrics endpoint a test or benchmark starts a
    daemon with and then scrapes."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
