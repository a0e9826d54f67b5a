"""Transport + scheduler overhead: streamed tokens/s and added latency for 64 clients.

The model is replaced by `FixedCostRunner`, which exists only in this benchmark:
it runs no model, waits a fixed time per step (sleeping, so it holds the GIL no
more than MLX does while it computes) and returns logits whose argmax is the
step's number modulo the vocabulary. So every streamed token names the step that
made it, and the clients, in another process on the same machine, measure

    added latency = arrival of the Delta at the client - end of the step that made it

on the machine's monotonic clock. That covers sampling, commit, detokenizing,
publishing, the server's flush, ZeroMQ over ipc and the client's decoding: the
whole path between a forward and a client. Everything else is the real thing —
Scheduler, Server, SlotPool, the protocol over a real socket.

Clients are bare DEALER sockets in one process, or spread over `--client-procs`
processes (a closed loop: each keeps R requests in flight, replacing each as it
ends), lean so that the server is what is measured. One process reads its sockets
one after another, so the last socket's Delta of a step is timed after the client
has decoded all the others: with many connections per process that is part of the
measured latency.

    python bench/transport_overhead.py [--clients 64] [--per-client 1 4 16] [--step-ms 0.5 2]
                                       [--client-procs 1] [--transport-only] [--no-gc-freeze]

`--transport-only` also replaces the scheduler, by `StubScheduler` (benchmark only):
what remains is the server, the protocol and the socket — the transport's ceiling.

Prints a table; writes JSON to out/bench/transport_overhead.json (or transport_only.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import harness
import mlx.core as mx
import numpy as np
import zmq

from engine.cache import SlotPool
from engine.gguf import GGUFFile
from engine.models.qwen35 import Model, load_model
from engine.runner import ModelRunner, Row, RowOutput, StepOutput
from engine.tokenizer import Tokenizer
from engine.writer import preset, write_model
from scheduler import (
    Delta,
    Finished,
    FinishReason,
    Request,
    RequestHandle,
    Scheduler,
    SchedulerConfig,
    SchedulerStats,
    SpecStats,
    StepSink,
    StepTimes,
    Timings,
    Usage,
)
from transport import protocol as p
from transport.daemon import heap
from transport.server import ModelInfo, Server, ServerConfig

OUT_DIR = harness.OUT_DIR  # importing harness also puts the repository root on sys.path

PROMPT = [1, 2, 3, 4]
WARMUP_S = 1.0


class FixedCostRunner(ModelRunner):
    """BENCHMARK ONLY — not a model runner. Runs no forward: advances the pool's lengths,
    waits `step_s`, and returns logits that are one-hot at token `step % vocab` for every
    wanted position. `step_ends[s]` is when step s finished (time.monotonic)."""

    def __init__(self, model: Model, pool: SlotPool, step_s: float) -> None:
        super().__init__(model, pool)
        self.step_s = step_s
        self.step_ends: list[float] = []
        self._vocab = pool.config.n_vocab

    def step(self, batch: Sequence[Row]) -> StepOutput:
        t0 = time.perf_counter()
        for row in batch:
            self.pool.lengths[row.slot] = row.start + len(row.tokens)
        self.last_tokens = sum(len(r.tokens) for r in batch)
        wanted = [len(r.wanted) for r in batch]
        token = len(self.step_ends) % self._vocab
        logits = (mx.arange(self._vocab) == token).astype(mx.float32)
        logits = mx.broadcast_to(logits, (sum(wanted), self._vocab))
        mx.eval(logits)
        rest = self.step_s - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)
        self.step_ends.append(time.monotonic())
        out, at = StepOutput(), 0
        for n in wanted:
            out.rows.append(RowOutput(packed=(logits, None, at, n)))
            at += n
        return out


def tiny_model() -> Path:
    path = OUT_DIR / "transport-overhead-tiny.gguf"
    if not path.exists():
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        write_model(path, preset("tiny"))
    return path


class StubScheduler:
    """BENCHMARK ONLY — not a scheduler (`--transport-only`). Has the Scheduler's surface
    the Server uses; every `step_s` it passes each live request a one-token Delta naming
    the step (then its Finished at max_tokens) to the request's step sink, with no
    sampling, detokenizing or batching work: what is left is the transport's cost. Like
    the Scheduler, it calls its `on_published` callbacks after each step's events."""

    def __init__(self, step_s: float, vocab: int) -> None:
        self.step_s = step_s
        self.vocab = vocab
        self.step_ends: list[float] = []
        self._live: dict[str, tuple[StepSink, Any, list[int]]] = {}
        self._published: list[Callable[[], None]] = []

    def submit(self, request: Request, *, group: StepSink, key: Any) -> RequestHandle:
        """`Serves.submit`: what the Server calls."""
        assert request.request_id is not None and request.max_tokens is not None
        self._live[request.request_id] = (group, key, [0, request.max_tokens])
        return RequestHandle(request.request_id, len(PROMPT), None, self.cancel)

    def cancel(self, request_id: str) -> bool:
        live = self._live.pop(request_id, None)
        if live is not None:
            self._end(live[0], live[1], request_id, FinishReason.CANCELLED, live[2][0])
        return live is not None

    def stats(self) -> SchedulerStats:
        return SchedulerStats(0, len(self._live), 0, 0, 1, 0, 0, {}, 0, 0, StepTimes())

    def on_published(self, callback: Callable[[], None]) -> None:
        self._published.append(callback)

    async def run(self) -> None:
        while True:
            await anyio.sleep(self.step_s)
            token = (len(self.step_ends) % self.vocab,)
            self.step_ends.append(time.monotonic())
            batches: dict[StepSink, list[tuple[Any, Delta]]] = {}
            ended = []
            for rid, (group, key, progress) in list(self._live.items()):
                progress[0] += 1
                batches.setdefault(group, []).append((key, Delta(rid, token, "x")))
                if progress[0] == progress[1]:
                    del self._live[rid]
                    ended.append((group, key, rid, progress[0]))
            for group, items in batches.items():
                group.deltas(items)
            for group, key, rid, n in ended:
                self._end(group, key, rid, FinishReason.LENGTH, n)
            for callback in self._published:
                callback()

    @staticmethod
    def _end(group: StepSink, key: Any, rid: str, why: FinishReason, n: int) -> None:
        timings = Timings(0.0, None, None, None, 0.0)
        group.end(key, Finished(rid, why, Usage(len(PROMPT), n), timings, SpecStats()))


async def serve_and_load(
    args: argparse.Namespace, per_client: int, step_ms: float
) -> dict[str, Any]:
    """One configuration: a server in this process, the clients in a child process."""
    path = tiny_model()
    model = load_model(path)
    tokenizer = Tokenizer.from_metadata(GGUFFile(path).metadata, str(path))
    n = args.clients * per_client
    pool = SlotPool(model.config, n, len(PROMPT) + args.max_tokens + 8, kv_dtype=mx.float32)
    runner = FixedCostRunner(model, pool, step_ms / 1000)
    scheduler = Scheduler(
        runner, tokenizer, SchedulerConfig(max_queue=2 * n, max_batch_tokens=max(512, 2 * n))
    )
    stub = StubScheduler(step_ms / 1000, pool.config.n_vocab)  # Server(stub) checks it is a Serves
    info = ModelInfo.of(scheduler, "tiny")
    with tempfile.TemporaryDirectory() as tmp:
        config = ServerConfig(endpoints=(f"ipc://{tmp}/s.sock",), max_outstanding=per_client)
        async with AsyncExitStack() as stack:
            if args.transport_only:
                server = Server(stub, info, config)
                tg = await stack.enter_async_context(anyio.create_task_group())
                tg.start_soon(stub.run)
                stack.callback(tg.cancel_scope.cancel)
            else:
                server = Server(scheduler, info, config)
                await stack.enter_async_context(scheduler.running())
            (endpoint,) = await stack.enter_async_context(server.running())
            if not args.no_gc_freeze:  # as the daemon does once it has warmed up
                heap.settle_collector()
            files = [Path(tmp) / f"clients-{i}.npz" for i in range(args.client_procs)]
            cpu0, waited0 = time.process_time(), runqueue_wait_s()
            async with anyio.create_task_group() as procs:
                for i, result_file in enumerate(files):
                    n_clients = len(range(i, args.clients, args.client_procs))
                    cmd = [sys.executable, __file__, "--role-clients", endpoint, str(result_file)]
                    cmd += ["--clients", str(n_clients), "--per-client", str(per_client)]
                    cmd += ["--max-tokens", str(args.max_tokens), "--seconds", str(args.seconds)]
                    procs.start_soon(partial(anyio.run_process, cmd, stdout=None, stderr=None))
            server_cpu = time.process_time() - cpu0
            waited = {k: v - waited0.get(k, 0.0) for k, v in runqueue_wait_s().items()}
            received = merge_clients([dict(np.load(f)) for f in files])
    step_ends = stub.step_ends if args.transport_only else runner.step_ends
    times = scheduler.stats().times
    steps = max(times.steps, 1)
    result = measure(received, np.asarray(step_ends), pool.config.n_vocab, n)
    # A token names its step modulo the vocabulary: latencies past vocab steps alias.
    alias_ms = 1000 * pool.config.n_vocab * args.seconds / len(step_ends)
    if result["added_ms_max"] > alias_ms / 2:
        print(f"warning: latencies near {alias_ms:.0f} ms alias; use a longer --step-ms")
    tokens = max(int(received["count"].sum()), 1)  # over the whole run, warm-up included
    return result | {
        "server_cpu_us_per_token": 1e6 * server_cpu / tokens,
        "client_cpu_us_per_token": 1e6 * float(received["cpu_s"]) / tokens,
        "path": "transport only" if args.transport_only else "scheduler + transport",
        "clients": args.clients,
        "client_procs": args.client_procs,
        "per_client": per_client,
        "step_ms": step_ms,
        "steps_per_s": len(step_ends) / args.seconds,
        # seconds the server's threads were ready to run but waited for a core, per step
        "runqueue_us_per_step": {k: 1e6 * v / max(len(step_ends), 1) for k, v in waited.items()},
        "scheduler_ms_per_step": {
            k: 1000 * getattr(times, k) / steps
            for k in ("wall_s", "forward_s", "draft_s", "sample_s", "schedule_s", "publish_s")
        },
    }


def runqueue_wait_s() -> dict[str, float]:
    """Seconds this process's threads have spent ready to run but waiting for a CPU (Linux
    schedstat, second field), for the event loop's thread (the main one) and for all; empty
    where the kernel does not say. On two cores shared by the loop, the step thread, ZeroMQ's
    I/O thread and the clients, this is the wait the added latency's tail may be made of."""
    pid, waits = os.getpid(), {"loop": 0.0, "all": 0.0}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                waited = int(f.read().split()[1]) / 1e9
            waits["all"] += waited
            if int(tid) == pid:
                waits["loop"] = waited
    except (OSError, IndexError, ValueError):
        return {}
    return waits


def measure(received: Any, step_ends: np.ndarray, vocab: int, slots: int) -> dict[str, Any]:
    """Tokens/s and added latency over the window after the warm-up."""
    at, token, count = received["at"], received["token"], received["count"]
    start = received["start"] + WARMUP_S
    keep = at >= start
    at, token, count = at[keep], token[keep], count[keep]
    window = at.max() - start
    last = np.searchsorted(step_ends, at, side="right") - 1  # last step ended before arrival
    step = last - (last - token) % vocab  # ... whose number the token names
    ok = step >= 0
    added = (at[ok] - step_ends[step[ok]]) * 1000.0
    weights = count[ok]
    return {
        "slots": slots,
        "tokens_per_s": float(count.sum() / window),
        "added_ms_p50": _weighted_percentile(added, weights, 50),
        "added_ms_p99": _weighted_percentile(added, weights, 99),
        "added_ms_max": float(added.max()),
        "deltas_per_message": float(received["items"] / max(received["messages"], 1)),
    }


def merge_clients(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The records of several client processes as one; the window starts with the last."""
    merged = {k: np.concatenate([part[k] for part in parts]) for k in ("at", "token", "count")}
    merged["start"] = max(float(part["start"]) for part in parts)
    for k in ("messages", "items", "cpu_s"):
        merged[k] = sum(part[k] for part in parts)
    return merged


def _weighted_percentile(x: np.ndarray, w: np.ndarray, q: float) -> float:
    order = np.argsort(x)
    cum = np.cumsum(w[order])
    return float(x[order][np.searchsorted(cum, q / 100 * cum[-1])])


def run_clients(
    endpoint: str, out: Path, clients: int, per_client: int, max_tokens: int, seconds: float
) -> None:
    """The client process: `clients` DEALERs, each keeping `per_client` greedy requests in
    flight; records (arrival, first token, tokens) of every Delta."""
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.DEALER) for _ in range(clients)]
    poller = zmq.Poller()
    for sock in socks:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send(p.encode(p.Hello(p.PROTOCOL_MAJOR, p.PROTOCOL_MINOR, "bench")))
        assert isinstance(p.decode_server(sock.recv()), p.Welcome)
        poller.register(sock, zmq.POLLIN)
    ids = iter(range(1 << 62))

    def generate() -> bytes:
        prompt = p.TokenPrompt(PROMPT)
        return p.encode(
            p.Generate(
                next(ids), prompt, max_tokens, 0.0, ignore_eos=True, speculation=p.Speculation.OFF
            )
        )

    at: list[float] = []
    token: list[int] = []
    count: list[int] = []
    messages = items = errors = 0
    start, cpu0 = time.monotonic(), time.process_time()
    for sock in socks:
        for _ in range(per_client):
            sock.send(generate())
    while (now := time.monotonic()) < start + seconds:
        # One message from each socket that has any, then poll again: a socket holds one
        # Deltas per step, and draining each until recv raises zmq.Again cost ~3.4 µs per
        # socket per round (the exception), a third of this process's CPU per token at 64
        # slots, on a machine whose other core the server needs.
        for sock, _ in poller.poll(100):
            frame = sock.recv(zmq.NOBLOCK)  # (it has one: poll said so)
            now = time.monotonic()
            msg = p.decode_server(frame)
            if isinstance(msg, p.Deltas):
                messages += 1
                for d in msg.items:
                    items += 1
                    at.append(now)
                    token.append(d.tokens[0])
                    count.append(len(d.tokens))
            elif isinstance(msg, p.Finished):
                sock.send(generate())
            elif isinstance(msg, p.Error):
                errors += 1
    cpu_s = time.process_time() - cpu0
    for sock in socks:
        sock.send(p.encode(p.Bye()))
        sock.close()
    ctx.term()
    if errors:
        print(f"clients: {errors} errors", file=sys.stderr)
    np.savez(
        out, at=np.asarray(at), token=np.asarray(token), count=np.asarray(count),
        start=start, messages=messages, items=items, cpu_s=cpu_s,
    )  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    """One line per configuration; `sample ms` is the scheduler's sampling time per step;
    `procs`: client processes; `srv` / `cli cpu us/tok`: CPU time of the server / the
    client processes together per streamed token
    (all threads), which a machine shared with other work inflates far less than wall time;
    `runq us/step`: time the event loop's thread / all the server's threads were ready to
    run but waited for a core, per step."""
    head = (
        f"{'path':<21} {'clients':>7} {'procs':>5} {'req/cl':>6} {'slots':>5} {'step ms':>7} "
        f"{'steps/s':>7} {'tokens/s':>9} {'added p50 ms':>12} {'added p99 ms':>12} "
        f"{'sample ms':>9} {'items/msg':>9} {'srv cpu us/tok':>14} {'cli cpu us/tok':>14} "
        f"{'loop runq us/step':>17} {'srv runq us/step':>16}"
    )
    lines = ["model replaced by FixedCostRunner (benchmark only); clients over ipc", head]
    for r in rows:
        sample = r["scheduler_ms_per_step"]["sample_s"]
        lines.append(
            f"{r['path']:<21} {r['clients']:>7} {r.get('client_procs', 1):>5} "
            f"{r['per_client']:>6} {r['slots']:>5} "
            f"{r['step_ms']:>7.1f} {r['steps_per_s']:>7.0f} {r['tokens_per_s']:>9,.0f} "
            f"{r['added_ms_p50']:>12.3f} {r['added_ms_p99']:>12.3f} {sample:>9.2f} "
            f"{r['deltas_per_message']:>9.2f} {r['server_cpu_us_per_token']:>14.2f} "
            f"{r['client_cpu_us_per_token']:>14.2f} "
            f"{r['runqueue_us_per_step'].get('loop', float('nan')):>17.1f} "
            f"{r['runqueue_us_per_step'].get('all', float('nan')):>16.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--per-client", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--step-ms", type=float, nargs="+", default=[0.5, 2.0])
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="processes the clients are spread over (one process reads its sockets one by one)",
    )
    ap.add_argument("--seconds", type=float, default=5.0, help="per configuration")
    ap.add_argument(
        "--transport-only", action="store_true", help="replace the scheduler by StubScheduler"
    )
    ap.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="skip the daemon's heap.settle_collector() after setup (gc.freeze, young threshold)",
    )
    ap.add_argument("--role-clients", nargs=2, metavar=("ENDPOINT", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role_clients:
        endpoint, out = args.role_clients
        run_clients(
            endpoint, Path(out), args.clients, args.per_client[0], args.max_tokens, args.seconds
        )
        return
    rows = []
    for per_client in args.per_client:
        for step_ms in args.step_ms:
            rows.append(anyio.run(serve_and_load, args, per_client, step_ms))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    record = {"machine": {"cores": os.cpu_count(), "loadavg": os.getloadavg()}, "rows": rows}
    name = "transport_only" if args.transport_only else "transport_overhead"
    (OUT_DIR / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
