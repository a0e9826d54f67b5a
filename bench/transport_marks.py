"""Where `transport_overhead.py`'s added latency goes: marks on each step, and each thread's
CPU and run-queue wait.

Runs one configuration of `transport_overhead.py` (its stand-in runner, server and client
process, unchanged) with time marks (monotonic clock) added by wrapping the Scheduler's
and the Server's phases — BENCHMARK ONLY: it reaches into their private methods. For every
step, in ms after the end of the stand-in's forward (the zero of the added latency):

    resolved      the step thread has checked and resolved the step (`Stepper.run` returned)
    loop woke     the event loop has taken the result (commit starts)
    next started  the next step has been handed to the step thread and it took it
    published     the step's Deltas and Finished have reached the server's sinks
    sent          the server has handed every connection's message to ZeroMQ
    first / last  the first and the last of the step's tokens read by the clients

Each row's p50 / p90 / p99 is its own percentile over the steps; `slowest 1%` is the mean
over the steps whose last token arrived latest. Then, per thread of the server and of the
client process (Linux schedstat, read 1.5 s and `--seconds` - 0.5 s into the clients' run):
CPU, time ready to run but waiting for a core, and times it was switched in, per step.

    python bench/transport_marks.py [--per-client 1] [--step-ms 0.5] [--seconds 5]
"""

from __future__ import annotations

import argparse
import functools
import os
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import harness  # noqa: F401  (puts the repository root on sys.path)
import numpy as np
import transport_overhead as bench

from scheduler import loop, step, step_thread
from transport import server

MARKS = ("resolved", "loop woke", "next started", "published", "sent")


class Marks:
    """Times of each mark, in the order they happened, and the clients' records."""

    def __init__(self) -> None:
        self.at: dict[str, list[float]] = {name: [] for name in MARKS}
        self.runner: bench.FixedCostRunner | None = None
        self.received: dict[str, Any] = {}
        self.threads: list[tuple[int, dict[str, tuple[float, float, int]]]] = []  # (steps, ...)

    def after(self, cls: type, name: str, mark: str, before: bool = False) -> None:
        """Mark `mark` when `cls.name` returns (or, with `before`, when it is called)."""
        call = getattr(cls, name)
        at = self.at[mark]

        @functools.wraps(call)
        def marked(*args: Any, **kwargs: Any) -> Any:
            if before:
                at.append(time.monotonic())
            out = call(*args, **kwargs)
            if not before:
                at.append(time.monotonic())
            return out

        setattr(cls, name, marked)


def install(marks: Marks) -> None:
    marks.after(step.Stepper, "run", "resolved")
    marks.after(loop.Scheduler, "_commit", "loop woke", before=True)
    marks.after(step_thread.Job, "wait_started", "next started")
    marks.after(server.Server, "_flush", "sent")
    publish = loop.Scheduler._publish

    def _publish(self: loop.Scheduler) -> None:  # `published`: before the server's flush
        hooks, self._published_hooks = self._published_hooks, []
        try:
            publish(self)
        finally:
            self._published_hooks = hooks
        marks.at["published"].append(time.monotonic())
        for hook in hooks:
            hook()

    loop.Scheduler._publish = _publish  # type: ignore[method-assign]
    made = bench.FixedCostRunner.__init__

    def runner_init(self: bench.FixedCostRunner, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        marks.runner = self

    bench.FixedCostRunner.__init__ = runner_init  # type: ignore[method-assign]
    merge = bench.merge_clients

    def merge_clients(parts: list[dict[str, Any]]) -> dict[str, Any]:
        marks.received = merge(parts)
        return marks.received

    bench.merge_clients = merge_clients


def thread_times() -> dict[str, tuple[float, float, int]]:
    """(on-CPU s, run-queue wait s, times switched in) of each thread of this process and
    its children, by name: `loop`, `step`, the server's and the clients' ZeroMQ threads."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    names[os.getpid()] = "loop"
    out: dict[str, tuple[float, float, int]] = {}
    pids = [(os.getpid(), "server")]
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        children = Path(f"/proc/{os.getpid()}/task/{tid}/children").read_text().split()
        pids += [(int(c), "client") for c in children]
    for pid, side in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                run, wait, slices = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
                comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            except (OSError, ValueError):
                continue
            name = names.get(int(tid), comm) if side == "server" else comm
            name = {"slotserve-step": "step"}.get(name, name)
            key = f"{side} {'main' if side == 'client' and int(tid) == pid else name}"
            old = out.get(key, (0.0, 0.0, 0))
            out[key] = (old[0] + int(run) / 1e9, old[1] + int(wait) / 1e9, old[2] + int(slices))
    return out


def sample_threads(marks: Marks, seconds: float) -> None:
    """Read every thread's schedstat 1.5 s and `seconds` - 0.5 s after the clients start,
    with the number of steps run by then."""
    for wait in (1.5, seconds - 2.0):
        time.sleep(wait)
        assert marks.runner is not None
        marks.threads.append((len(marks.runner.step_ends), thread_times()))


def first_after(times: np.ndarray, after: np.ndarray) -> np.ndarray:
    """For each time in `after`, the first of `times` at or past it (nan when none)."""
    i = np.searchsorted(times, after)
    return np.where(i < len(times), times[np.minimum(i, len(times) - 1)], np.nan)


def report(marks: Marks, vocab: int) -> None:
    assert marks.runner is not None
    ends = np.asarray(marks.runner.step_ends)
    got = marks.received
    keep = got["at"] >= got["start"] + bench.WARMUP_S
    arrived, token = got["at"][keep], got["token"][keep]
    last = np.searchsorted(ends, arrived, side="right") - 1
    made = last - (last - token) % vocab  # the step each token names (as `bench.measure`)
    ok = made >= 0
    arrived, made = arrived[ok], made[ok]
    steps = np.unique(made)
    first = np.full(len(ends), np.nan)
    latest = np.full(len(ends), np.nan)
    np.fmin.at(first, made, arrived)
    np.fmax.at(latest, made, arrived)
    at = {name: np.asarray(marks.at[name]) for name in MARKS}
    rows: dict[str, np.ndarray] = {}
    rows["resolved"] = first_after(at["resolved"], ends[steps])
    rows["loop woke"] = first_after(at["loop woke"], rows["resolved"])
    rows["next started"] = first_after(at["next started"], rows["loop woke"])
    rows["published"] = first_after(at["published"], rows["next started"])
    rows["sent"] = first_after(at["sent"], rows["published"])
    rows["first token read"] = first[steps]
    rows["last token read"] = latest[steps]
    since = {k: 1000 * (v - ends[steps]) for k, v in rows.items()}
    slow = since["last token read"] >= np.nanpercentile(since["last token read"], 99)
    print(f"{'ms after the step ended':<24} {'p50':>7} {'p90':>7} {'p99':>7} {'slowest 1%':>10}")
    for name, ms in since.items():
        p50, p90, p99 = np.nanpercentile(ms, [50, 90, 99])
        print(f"{name:<24} {p50:>7.3f} {p90:>7.3f} {p99:>7.3f} {np.nanmean(ms[slow]):>10.3f}")
    if len(marks.threads) != 2:
        return
    (n0, t0), (n1, t1) = marks.threads
    n = max(n1 - n0, 1)
    print(
        f"\n{'per step (' + str(n) + ' steps)':<28} {'cpu us':>8} {'runq wait us':>12} {'switched in':>11}"
    )
    for key in sorted(t1, key=lambda k: t0.get(k, (0.0, 0.0, 0))[0] - t1[k][0]):
        run0, wait0, in0 = t0.get(key, (0.0, 0.0, 0))
        run1, wait1, in1 = t1[key]
        if run1 - run0 < 1e-3:
            continue
        print(
            f"{key:<28} {1e6 * (run1 - run0) / n:>8.1f} {1e6 * (wait1 - wait0) / n:>12.1f} "
            f"{(in1 - in0) / n:>11.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-client", type=int, default=1)
    ap.add_argument("--step-ms", type=float, default=0.5)
    ap.add_argument("--seconds", type=float, default=5.0)
    a = ap.parse_args()
    marks = Marks()
    install(marks)
    settle = bench.heap.settle_collector

    def settle_collector() -> None:  # called once the server is up, as the clients start
        settle()
        sample = functools.partial(sample_threads, marks, a.seconds)
        threading.Thread(target=sample, name="marks-sampler", daemon=True).start()

    bench.heap.settle_collector = settle_collector
    args = argparse.Namespace(
        clients=64, per_client=[a.per_client], step_ms=[a.step_ms], max_tokens=200,
        client_procs=1, seconds=a.seconds, transport_only=False, no_gc_freeze=False,
    )  # fmt: skip
    row = anyio.run(bench.serve_and_load, args, a.per_client, a.step_ms)
    print(bench.table([row]))
    print()
    assert marks.runner is not None
    report(marks, marks.runner.pool.config.n_vocab)


if __name__ == "__main__":
    main()
