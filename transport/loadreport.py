"""What a load test measured: a summary, its table, its JSON and its plots.

Latencies are client-side: time to first token (TTFT) from sending the Generate
to the first Delta, inter-token latency (ITL) between consecutive Deltas of a
request, end to end (e2e) from sending to the terminal message. Throughput
counts generated tokens and successful requests over the wall time of the run
(first send to last terminal message).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from transport.loadgen import LoadConfig, Record

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Latency:
    """Milliseconds; all NaN when there were no samples."""

    samples: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> Latency:
        if not seconds:
            return cls(0, *[float("nan")] * (1 + len(PERCENTILES)))
        ms = np.asarray(seconds) * 1000.0
        p50, p90, p99 = (float(x) for x in np.percentile(ms, PERCENTILES))
        return cls(len(ms), float(ms.mean()), p50, p90, p99)


@dataclass(frozen=True)
class Summary:
    mode: str  # "closed loop, concurrency 8" / "open loop, 20.0 req/s"
    wall_s: float
    requests: int
    ok: int
    rejected: int
    errors: int
    prompt_tokens: int
    output_tokens: int
    tokens_per_s: float
    requests_per_s: float
    ttft: Latency
    itl: Latency
    e2e: Latency


def summarize(config: LoadConfig, records: list[Record]) -> Summary:
    ok = [r for r in records if r.outcome == "ok"]
    ends = [r.end for r in records if r.end is not None]
    wall = max(ends) - min(r.start for r in records) if ends else 0.0
    tokens = sum(r.tokens for r in records)
    mode = (
        f"closed loop, concurrency {config.concurrency}"
        if config.concurrency is not None
        else f"open loop, {config.rate} req/s"
    )
    return Summary(
        mode=mode,
        wall_s=wall,
        requests=len(records),
        ok=len(ok),
        rejected=sum(r.outcome == "rejected" for r in records),
        errors=sum(r.outcome == "error" for r in records),
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        output_tokens=tokens,
        tokens_per_s=tokens / wall if wall else 0.0,
        requests_per_s=len(ok) / wall if wall else 0.0,
        ttft=Latency.of([t for r in ok if (t := r.ttft) is not None]),
        itl=Latency.of([g for r in ok for g in r.gaps]),
        e2e=Latency.of([t for r in ok if (t := r.e2e) is not None]),
    )


def table(s: Summary) -> str:
    """The report as aligned text, stable from run to run (for logs and docs)."""
    lines = [
        f"load: {s.mode}, {s.wall_s:.1f} s",
        f"requests   {s.requests:>8}  ok {s.ok}  rejected {s.rejected}  errors {s.errors}",
        f"throughput {s.tokens_per_s:>12,.1f} tokens/s  {s.requests_per_s:>8.2f} requests/s",
        f"tokens     {s.prompt_tokens:>8} prompt  {s.output_tokens} generated",
        "",
        f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'samples':>10}",
    ]
    for name, lat in (("TTFT", s.ttft), ("ITL", s.itl), ("end to end", s.e2e)):
        lines.append(
            f"{name:<14}{lat.mean:>10.2f}{lat.p50:>10.2f}{lat.p90:>10.2f}{lat.p99:>10.2f}"
            f"{lat.samples:>10}"
        )
    return "\n".join(lines)


def write_json(path: Path, summary: Summary, records: list[Record]) -> None:
    """The summary and every request (its outcome, times and Delta arrivals)."""
    doc: dict[str, Any] = {
        "summary": asdict(summary),
        "requests": [asdict(r) for r in records],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, allow_nan=True))


def plot(path: Path, summary: Summary, records: list[Record]) -> None:
    """Four panels in one PNG: generated tokens/s over time, and the distributions (CDFs)
    of TTFT, ITL and end-to-end latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.outcome == "ok"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    fig.suptitle(f"slotserve loadgen: {summary.mode}")

    times = [t for r in records for t, _ in r.deltas]
    weights = [n for r in records for _, n in r.deltas]
    ax = axes[0][0]
    if times:
        width = max(summary.wall_s / 40, 0.2)  # seconds per point
        bins = np.arange(0.0, max(times) + width, width)
        counts, edges = np.histogram(times, bins=bins, weights=weights)
        ax.plot(edges[:-1], counts / width)
    ax.set(title="throughput", xlabel="time (s)", ylabel="generated tokens/s")

    panels = (
        (axes[0][1], "time to first token", [t for r in ok if (t := r.ttft) is not None]),
        (axes[1][0], "inter-token latency", [g for r in ok for g in r.gaps]),
        (axes[1][1], "end to end", [t for r in ok if (t := r.e2e) is not None]),
    )
    for ax, title, seconds in panels:
        ms = np.sort(np.asarray(seconds)) * 1000.0
        if len(ms):
            ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms))
        ax.set(title=title, xlabel="ms", ylabel="fraction of samples <=")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
