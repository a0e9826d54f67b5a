"""Soak: the real daemon under every kind of traffic at once, then proof that nothing was lost.

`run_soak(config)` starts `slotserve serve` on a tiny model (a subprocess, as operators
run it) and, for `duration_s`, drives it over real ZeroMQ connections with the mix in
`traffic.py`: well-behaved streaming requests (token, text, chat through
`transport.client.Client`, speculative), random cancels, clients killed mid-stream
(sockets closed without a word, and client processes killed with SIGKILL), clients
that stop reading, malformed, truncated, multi-frame and oversized frames, invalid
requests, expired deadlines, bursts at twice the admission capacity, and, with
`faults`, requests that hit the engine's test-only fault hook (NaN logits, a bad row).
Meanwhile a monitor pings the daemon, asks for its Stats and samples its resident
memory. At the end it waits for every request to end, checks the daemon is idle, and
returns a `Report`; `Report.problems()` lists every broken promise (empty = passed).

    .venv/bin/python tests/soak/soak.py --duration 1800 --json out/soak/soak-30min.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from traffic import EXPECTED, FAULT_PLAN, Traffic

from transport import protocol as p
from transport.client import Client
from transport.daemon.demo import Supervised, ensure_model
from transport.metrics import free_port, scrape


@dataclass(frozen=True)
class SoakConfig:
    model: Path
    duration_s: float = 120.0
    slots: int = 4
    max_queue: int = 8
    context: int = 256
    normal_workers: int = 3  # well-behaved raw connections, each one request at a time
    warmup_s: float | None = None  # memory baseline after this; default min(60, duration / 4)
    faults: bool = True  # start the daemon with the test-only fault plan
    abuse: bool = True  # False: well-behaved traffic only (a baseline for the latencies)
    seed: int = 0
    daemon_log: Path | None = None  # keep the daemon's log here (default: discarded)
    # Small enough to fill during warm-up, so the run exercises eviction and the memory
    # check sees the cache at its bound ("" = off).
    prefix_cache: str = "8MiB"

    @property
    def warmup(self) -> float:
        return min(60.0, self.duration_s / 4) if self.warmup_s is None else self.warmup_s


@dataclass
class Report:
    config: dict[str, Any]
    wall_s: float
    outcomes: list[dict[str, Any]]  # every Generate, as the client saw it
    counts: dict[str, int]  # actions that are not requests: kills, frames, ...
    by_kind: dict[str, dict[str, int]]  # kind -> terminal -> requests
    lost: int  # accepted or sent, owed a terminal, got none
    duplicate_terminals: int
    deltas_after_end: int
    unexpected: list[str]  # requests whose terminal their kind must not get
    connection_errors: list[str]  # unexpected connection-level messages
    rss_mib: dict[str, float]  # at the end of warm-up, at the end, the largest
    rss_growth: float  # end / end of warm-up - 1, both less the prefix cache's bytes
    ping_ms: dict[str, float]
    monitor_failures: list[str]
    latency_ms: dict[str, float]  # well-behaved requests: p50/p99/max of TTFT and total
    stats: dict[str, Any]  # the daemon's Stats once idle
    metrics: dict[str, float]  # slot gauges scraped once idle
    daemon_exit: int | None = None

    def problems(self) -> list[str]:
        """Every promise the run broke; empty when it passed."""
        out = []
        if self.lost:
            out.append(f"{self.lost} requests never got a terminal message")
        if self.duplicate_terminals:
            out.append(f"{self.duplicate_terminals} requests got more than one terminal")
        if self.deltas_after_end:
            out.append(f"{self.deltas_after_end} Deltas arrived after their terminal")
        out += [f"unexpected terminal: {u}" for u in self.unexpected[:20]]
        out += [f"connection error: {e}" for e in self.connection_errors[:20]]
        if self.rss_growth > 0.05:
            out.append(f"resident memory grew {self.rss_growth:.1%} after warm-up (> 5%)")
        out += [f"monitor: {f}" for f in self.monitor_failures[:20]]
        s = self.stats
        slots = self.config["slots"]
        if (s["requests_running"], s["requests_waiting"], s["free_slots"]) != (0, 0, slots):
            out.append(f"not idle at the end: {s}")
        if s["reserved_bytes"] != 0:
            out.append(f"{s['reserved_bytes']} bytes of slot memory still reserved when idle")
        if s["submitted"] != s["finished"] + s["failed"]:
            out.append(f"submitted {s['submitted']} != finished + failed ({s})")
        if self.metrics.get("slotserve_active_slots", 0) != 0:
            out.append(f"metrics still show active slots: {self.metrics}")
        if self.daemon_exit not in (None, 0):
            out.append(f"the daemon exited with status {self.daemon_exit}")
        return out

    def table(self) -> str:
        kinds = sorted(self.by_kind)
        terminals = sorted({t for k in kinds for t in self.by_kind[k]})
        lines = [f"{'kind':<12}" + "".join(f"{t:>18}" for t in terminals)]
        for k in kinds:
            lines.append(
                f"{k:<12}" + "".join(f"{self.by_kind[k].get(t, 0):>18}" for t in terminals)
            )
        lines.append("")
        lines += [f"{k:<28}{v}" for k, v in sorted(self.counts.items())]
        lines.append(f"{'requests':<28}{len(self.outcomes)}")
        lines.append(f"{'lost':<28}{self.lost}")
        lines.append(f"{'duplicate terminals':<28}{self.duplicate_terminals}")
        rss = self.rss_mib
        lines.append(
            f"{'RSS MiB warm/end/max':<28}{rss['warm']:.1f} / {rss['end']:.1f} / {rss['max']:.1f}"
            f"  (prefix + MLX caches {rss.get('cache_warm', 0):.1f} / {rss.get('cache_end', 0):.1f})"
            f"  growth less cache {self.rss_growth:+.2%}"
        )
        ping = self.ping_ms
        lines.append(
            f"{'ping ms p50/p99/max':<28}{ping['p50']:.1f} / {ping['p99']:.1f} / {ping['max']:.1f}"
            f"  ({int(ping['n'])} pings)"
        )
        lat = self.latency_ms
        lines.append(
            f"{'well-behaved TTFT ms':<28}p50 {lat['ttft_p50']:.0f}  p99 {lat['ttft_p99']:.0f}"
            f"  max {lat['ttft_max']:.0f}"
        )
        lines.append(
            f"{'well-behaved total ms':<28}p50 {lat['total_p50']:.0f}  p99 {lat['total_p99']:.0f}"
            f"  max {lat['total_max']:.0f}  ({int(lat['n'])} requests)"
        )
        stats = self.stats
        lines.append(
            f"{'daemon Stats':<28}submitted {stats['submitted']} finished {stats['finished']}"
            f" failed {stats['failed']} rejected {stats['rejected']} frames_rejected"
            f" {stats['frames_rejected']} slow_consumers {stats['slow_consumers']}"
            f" dead_clients {stats['dead_clients']} steps {stats['steps']}"
        )
        problems = self.problems()
        lines.append("PASSED" if not problems else "FAILED:\n  " + "\n  ".join(problems))
        return "\n".join(lines)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Monitor:
    """Pings every 0.5 s, asks for Stats every 2 s, samples the daemon's RSS every second.

    Each RSS sample carries the memory the daemon's caches last said they held — the prefix
    cache (Stats) and MLX's cache of freed buffers (the `slotserve_mlx_cache_bytes` metric):
    both are memory kept for reuse, not leaked, so the growth check leaves them out. Live
    arrays (`slotserve_mlx_active_bytes`) stay in: a leak of arrays still counts.
    """

    endpoint: str
    pid: int
    metrics_port: int | None = None
    pings: list[float] = field(default_factory=list)
    rss: list[tuple[float, float, float]] = field(
        default_factory=list
    )  # (monotonic, MiB, cache MiB)
    failures: list[str] = field(default_factory=list)
    cache_mib: float = 0.0

    async def run(self) -> None:
        async with Client.connect(self.endpoint, name="soak-monitor") as client:
            n = 0
            while True:
                try:
                    self.pings.append(await client.ping())
                    if n % 4 == 0:
                        stats = await client.stats()
                        mlx = 0.0
                        if self.metrics_port is not None:
                            got = await anyio.to_thread.run_sync(scrape, self.metrics_port)
                            mlx = got.get("slotserve_mlx_cache_bytes", 0.0)
                        self.cache_mib = (stats.prefix_bytes + mlx) / 2**20
                        if stats.state != p.ServerState.READY:
                            self.failures.append(f"Stats said {stats.state.name}")
                except Exception as e:
                    self.failures.append(f"{type(e).__name__}: {e}")
                if n % 2 == 0:
                    self.rss.append((time.monotonic(), rss_mib(self.pid), self.cache_mib))
                n += 1
                await anyio.sleep(0.5)


async def _drive(
    config: SoakConfig, endpoint: str, pid: int, metrics_port: int
) -> tuple[Traffic, Monitor, float]:
    monitor = Monitor(endpoint, pid, metrics_port)
    traffic = Traffic(
        endpoint, config.slots, config.max_queue, config.abuse, config.faults, config.seed
    )
    t0 = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(monitor.run)
        await traffic.run(config.duration_s, config.normal_workers)
        await _until_idle(endpoint, config.slots)
        await anyio.sleep(3.0)  # a few more memory samples at rest
        tg.cancel_scope.cancel()
    return traffic, monitor, t0


async def _until_idle(endpoint: str, slots: int, timeout_s: float = 30.0) -> None:
    async with Client.connect(endpoint, name="soak-idle") as client:
        with anyio.move_on_after(timeout_s):
            while True:
                s = await client.stats()
                if s.requests_running == 0 and s.requests_waiting == 0 and s.free_slots == slots:
                    return
                await anyio.sleep(0.2)


async def _final_stats(endpoint: str) -> p.Stats:
    async with Client.connect(endpoint, name="soak-stats") as client:
        return await client.stats()


def run_soak(config: SoakConfig) -> Report:
    """Start the daemon, run the traffic, stop the daemon (SIGTERM), report."""
    with tempfile.TemporaryDirectory(prefix="slotserve-soak-") as tmp:
        endpoint, port = f"ipc://{tmp}/soak.sock", free_port()
        args = ["--model", str(config.model), "--endpoints", endpoint, "--slots", str(config.slots)]
        args += ["--context", str(config.context), "--max-queue", str(config.max_queue)]
        args += ["--metrics-address", f"127.0.0.1:{port}", "--drain-timeout", "5"]
        args += ["--prefix-cache", config.prefix_cache]
        args += ["--log-file", str(config.daemon_log or f"{tmp}/daemon.log")]
        env = dict(os.environ)
        if config.faults:
            env["SLOTSERVE_TEST_FAULTS"] = FAULT_PLAN
        with Supervised(args, endpoint, env=env) as daemon:
            assert daemon.proc is not None
            traffic, monitor, t0 = anyio.run(_drive, config, endpoint, daemon.proc.pid, port)
            stats = anyio.run(_final_stats, endpoint)
            time.sleep(1.0)  # the metrics gauges refresh every 0.5 s
            metrics = {
                k: v
                for k, v in scrape(port).items()
                if k in ("slotserve_active_slots", "slotserve_slot_memory_bytes")
            }
        return _report(config, traffic, monitor, t0, stats, metrics, daemon.returncode)


def _report(
    config: SoakConfig,
    traffic: Traffic,
    monitor: Monitor,
    t0: float,
    stats: p.Stats,
    metrics: dict[str, float],
    daemon_exit: int | None,
) -> Report:
    outcomes = traffic.outcomes()
    connection_errors = traffic.unexpected_connection_errors()  # counts the expected ones
    by_kind: dict[str, dict[str, int]] = {}
    lost = duplicates = after = 0
    unexpected = []
    for o in outcomes:
        terminal = o.terminal or ("orphaned" if o.orphaned else "LOST")
        row = by_kind.setdefault(o.kind, {})
        row[terminal] = row.get(terminal, 0) + 1
        lost += not o.terminals and not o.orphaned
        duplicates += len(o.terminals) > 1
        after += o.deltas_after_end
        if o.terminal is not None and o.terminal not in EXPECTED[o.kind]:
            unexpected.append(f"{o.kind} request {o.rid} ended with {o.terminal}")
    warm_at = t0 + config.warmup
    warm = [s for s in monitor.rss if s[0] >= warm_at][:5] or monitor.rss[-5:]
    end = monitor.rss[-3:]
    rss = {
        "warm": statistics.median(m for _, m, _ in warm),
        "end": statistics.median(m for _, m, _ in end),
        "cache_warm": statistics.median(c for _, _, c in warm),
        "cache_end": statistics.median(c for _, _, c in end),
    }
    rss["max"] = max(m for t, m, _ in monitor.rss if t >= warm_at) if monitor.rss else float("nan")
    pings = [1000 * x for x in monitor.pings]
    good = [o for o in outcomes if o.kind in ("normal", "spec") and o.terminal == "finished"]
    ttft = [1000 * (o.first_token - o.sent) for o in good if o.first_token is not None]
    total = [1000 * (o.ended - o.sent) for o in good if o.ended is not None]
    latency = {"n": float(len(total))}
    for name, values in (("ttft", ttft), ("total", total)):
        latency |= {
            f"{name}_p50": percentile(values, 0.5),
            f"{name}_p99": percentile(values, 0.99),
            f"{name}_max": max(values, default=float("nan")),
        }
    return Report(
        config={k: str(v) if isinstance(v, Path) else v for k, v in vars(config).items()},
        wall_s=time.monotonic() - t0,
        outcomes=[o.to_json() for o in outcomes],
        counts=dict(traffic.counts),
        by_kind=by_kind,
        lost=lost,
        duplicate_terminals=duplicates,
        deltas_after_end=after,
        unexpected=unexpected,
        connection_errors=connection_errors,
        rss_mib=rss,
        rss_growth=(rss["end"] - rss["cache_end"]) / (rss["warm"] - rss["cache_warm"]) - 1,
        ping_ms={
            "n": float(len(pings)),
            "p50": percentile(pings, 0.5),
            "p99": percentile(pings, 0.99),
            "max": max(pings, default=float("nan")),
        },
        monitor_failures=monitor.failures,
        latency_ms=latency,
        stats={f: getattr(stats, f) for f in stats.__struct_fields__},
        metrics=metrics,
        daemon_exit=daemon_exit,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of traffic")
    parser.add_argument("--model", default="out/soak/tiny-qwen35.gguf", help="made if missing")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--max-queue", type=int, default=8)
    parser.add_argument("--workers", type=int, default=3, help="well-behaved connections")
    parser.add_argument("--no-faults", action="store_true", help="no fault-injection traffic")
    parser.add_argument("--calm", action="store_true", help="well-behaved traffic only")
    parser.add_argument("--daemon-log", help="keep the daemon's log here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=float, help="seconds before the memory baseline")
    parser.add_argument("--json", help="write the report (every request included) here")
    parser.add_argument("--prefix-cache", default="8MiB", help='the daemon\'s budget ("" = off)')
    args = parser.parse_args(argv)
    config = SoakConfig(
        model=ensure_model(Path(args.model), "tiny"),
        duration_s=args.duration,
        slots=args.slots,
        max_queue=args.max_queue,
        normal_workers=args.workers,
        faults=not args.no_faults and not args.calm,
        abuse=not args.calm,
        seed=args.seed,
        warmup_s=args.warmup,
        daemon_log=None if args.daemon_log is None else Path(args.daemon_log).resolve(),
        prefix_cache=args.prefix_cache,
    )
    report = run_soak(config)
    print(report.table())
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(vars(report), indent=1, default=str))
    return 0 if not report.problems() else 1


if __name__ == "__main__":
    sys.exit(main())
