"""Host CPU per streamed token of the scheduler's step, by phase, on one thread.

`transport_overhead.py` measures the whole path with its threads, sockets and a client
process, on a machine whose load moves the numbers. This drives the same Scheduler,
synchronously, with the benchmark's `FixedCostRunner` (no sleep) and N greedy plain
decode requests, and times each phase of a step with `time.process_time`:

    plan     deadlines, reaping, admission, the step's plan (loop thread)
    run      Stepper.run: rows, the stand-in forward, finite check, sampling (step thread)
    commit   the step's tokens into each Sequence (loop thread)
    publish  text, Deltas, each request's event sink -> the wire Delta (loop thread)
    flush    one Deltas message per connection, encoded (the server's flusher)

No sockets, no event loop, no second thread: what is left is per-row Python. Best of
7 blocks. BENCHMARK ONLY: it calls the Scheduler's private phases itself.

    python bench/step_host_cost.py [--rows 64 256 1024] [--steps 20]
"""

from __future__ import annotations

import argparse
import time
from itertools import pairwise

import harness  # noqa: F401  (puts the repository root on sys.path)
import mlx.core as mx
from transport_overhead import PROMPT, FixedCostRunner, tiny_model

from engine.cache import SlotPool
from engine.gguf import GGUFFile
from engine.models.qwen35 import load_model
from engine.tokenizer import Tokenizer
from scheduler import Delta as SchedulerDelta
from scheduler import Finished, Scheduler, SchedulerConfig
from scheduler.loop import _State
from transport import mapping
from transport import protocol as p
from transport.daemon import heap

PHASES = ("plan", "run", "commit", "publish", "flush")
CONNECTIONS = 64


class Outbox:
    """One connection's step sink, as the server's: its requests' wire Deltas of a step."""

    def __init__(self) -> None:
        self.items: list[p.Delta] = []

    def deltas(self, items: list[tuple[int, SchedulerDelta]]) -> None:
        self.items += mapping.to_deltas(items)

    def end(self, key: int, event: Finished) -> None:
        pass


def measure(rows: int, steps: int, blocks: int = 7) -> dict[str, float]:
    """µs per token of each phase, at `rows` decoding requests."""
    path = tiny_model()
    model = load_model(path)
    tokenizer = Tokenizer.from_metadata(GGUFFile(path).metadata, str(path))
    max_tokens = 5 + steps * blocks + 8
    pool = SlotPool(model.config, rows, len(PROMPT) + max_tokens, kv_dtype=mx.float32)
    scheduler = Scheduler(
        FixedCostRunner(model, pool, 0.0),
        tokenizer,
        SchedulerConfig(max_queue=2 * rows, max_batch_tokens=max(512, 2 * rows)),
    )
    scheduler._state = _State.RUNNING  # driven by hand, phase by phase, not by running()
    outboxes = [Outbox() for _ in range(CONNECTIONS)]
    for i in range(rows):
        prompt, off = p.TokenPrompt(PROMPT), p.Speculation.OFF
        generate = p.Generate(i, prompt, max_tokens, 0.0, ignore_eos=True, speculation=off)
        request = mapping.to_request(generate, f"1/{i}")
        scheduler.submit(request, group=outboxes[i % CONNECTIONS], key=i)

    def step() -> list[float]:
        t = [time.process_time()]
        now = time.monotonic()
        scheduler._expire(now)
        scheduler._reap()
        plan = scheduler._plan(now)
        assert plan is not None
        t.append(time.process_time())
        result = scheduler._stepper.run(plan)
        t.append(time.process_time())
        scheduler._commit(result)
        t.append(time.process_time())
        scheduler._publish()
        t.append(time.process_time())
        for outbox in outboxes:
            if outbox.items:
                p.encode(p.Deltas(outbox.items))
                outbox.items = []
        t.append(time.process_time())
        return [b - a for a, b in pairwise(t)]

    for _ in range(5):  # prefill and first tokens
        step()
    heap.settle_collector()  # as the daemon does after warm-up
    best: list[float] | None = None
    for _ in range(blocks):
        total = [0.0] * len(PHASES)
        for _ in range(steps):
            total = [a + b for a, b in zip(total, step(), strict=True)]
        if best is None or sum(total) < sum(best):
            best = total
    assert best is not None
    return {k: 1e6 * v / steps / rows for k, v in zip(PHASES, best, strict=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--steps", type=int, default=20, help="steps per block (7 blocks)")
    args = ap.parse_args()
    print("host CPU us per token, by phase (FixedCostRunner, benchmark only; best of 7 blocks)")
    print(f"{'rows':>5} " + " ".join(f"{k:>8}" for k in PHASES) + f" {'total':>8}")
    for rows in args.rows:
        r = measure(rows, args.steps)
        cells = " ".join(f"{r[k]:>8.2f}" for k in PHASES)
        print(f"{rows:>5} {cells} {sum(r.values()):>8.2f}", flush=True)


if __name__ == "__main__":
    main()
