"""What one steady MTP draft round costs: `MTPDrafter.draft` for N slots at depth K, the
chain on the device (`ModelRunner.draft_chain`, the default) against the per-depth path
(`on_device=False`: a `ModelRunner.draft` and a host-side draw per depth), each against one
plain decode step of the same N slots. Prints a markdown table of median ms over `--reps`
rounds, the two paths alternating round by round.

    python bench/mtp_draft_cost.py --model models/slotserve-demo.gguf [--n 1,8] [--k 1,2,3,4]
                                   [--compile] [--dense] [--sampled]

A steady round catches the head up on one position (the token the trunk just committed)
and then drafts K tokens; each timed round starts from the same drafter state (`adopt`).
`--sampled` drafts for seeded requests at temperature 0.8, top-p 0.95 instead of greedy.
Run it with OpenBLAS preloaded (LD_PRELOAD) for the numbers of docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import harness  # (also puts the repository root on sys.path)
import mlx.core as mx

from engine.cache import SlotPool
from engine.models.qwen35 import Model, load_model
from engine.runner import ModelRunner, Row, RowOutput
from engine.sampling import RequestRng, SamplingParams
from engine.spec.drafters import DraftJob, MTPDrafter
from engine.spec.speculator import DecodingSlot

PROMPT = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", default="1,8", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--k", default="1,2,3,4", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--dense", action="store_true")
    ap.add_argument("--sampled", action="store_true")
    args = ap.parse_args()
    model = load_model(args.model, dense=args.dense)
    params = SamplingParams(temperature=0.8, top_p=0.95) if args.sampled else SamplingParams(0.0)
    print(
        f"{args.model} ({'dense' if args.dense else 'as stored'}, "
        f"{'compiled' if args.compile else 'eager'}, {'sampled' if args.sampled else 'greedy'}), "
        f"{mx.default_device()}; slots after {PROMPT}-token prompts; median ms of {args.reps} "
        "rounds\n"
    )
    print("| N | K | plain step | per-depth round | chain round | chain speed-up |")
    print("|---|---|---|---|---|---|")
    for n in args.n:
        Rounds(model, n, max(args.k), params, args.compile).report(args.k, args.reps)


class Rounds:
    """N slots in a steady state (caught up on a prompt, one decode token committed since),
    and the two drafters to time a round of from it."""

    def __init__(
        self, model: Model, n: int, max_k: int, params: SamplingParams, compile: bool
    ) -> None:
        self.pool = pool = SlotPool(model.config, n, PROMPT + 2 + max_k, max_draft=max_k)
        self.runner = runner = ModelRunner(model, pool, compile=compile)
        self.chain, self.per_depth = MTPDrafter(runner), MTPDrafter(runner, on_device=False)
        self.slots = slots = [pool.allocate() for _ in range(n)]
        prompts = [[1 + (i * 7 + j) % 200 for j in range(PROMPT)] for i in range(n)]
        rows = [
            Row(s, p, 0, want=range(PROMPT), want_hidden=True)
            for s, p in zip(slots, prompts, strict=True)
        ]
        for s in slots:
            self.chain.begin(s)
        self._observe(0, runner.step(rows).rows)
        first = [
            DecodingSlot(s, 5, [*p, 5], params, RequestRng(0))
            for s, p in zip(slots, prompts, strict=True)
        ]
        self.chain.draft([DraftJob(d, 1, PROMPT) for d in first])  # the prompt's catch-up
        self._observe(
            PROMPT, runner.step([Row(s, [5], PROMPT, want_hidden=True) for s in slots]).rows
        )
        self.states = [self.chain.export(s) for s in slots]
        self.decoding = [
            DecodingSlot(d.slot, 6, [*d.history, 6], params, RequestRng(1)) for d in first
        ]

    def _observe(self, start: int, outputs: list[RowOutput]) -> None:
        for s, o in zip(self.slots, outputs, strict=True):
            assert o.hidden is not None
            self.chain.observe(s, start, o.hidden, None)

    def plain(self) -> None:
        self.runner.step([Row(s, [6], PROMPT + 1) for s in self.slots])
        for s in self.slots:  # BENCHMARK ONLY: back to the same length (timing does not care)
            self.pool.lengths[s] = PROMPT + 1

    def round(self, drafter: MTPDrafter, k: int) -> None:
        for s, state in zip(self.slots, self.states, strict=True):
            assert state is not None
            drafter.adopt(s, state)
        drafts = drafter.draft([DraftJob(d, k, PROMPT + 1) for d in self.decoding])
        mx.eval([d.q for d in drafts if d.q is not None])

    def report(self, ks: list[int], reps: int) -> None:
        n = len(self.slots)
        step_ms = harness.median_ms(self.plain, reps, warmup=3)
        for k in ks:
            for _ in range(3):  # warm-up: compiles each shape
                self.round(self.per_depth, k)
                self.round(self.chain, k)
            times: dict[MTPDrafter, list[float]] = {self.per_depth: [], self.chain: []}
            for _ in range(reps):  # alternating, so a noisy neighbour hits both alike
                for drafter, ts in times.items():
                    t = time.perf_counter()
                    self.round(drafter, k)
                    mx.synchronize()
                    ts.append(1e3 * (time.perf_counter() - t))
            pd, ch = (statistics.median(ts) for ts in times.values())
            print(
                f"| {n} | {k} | {step_ms:.2f} | {pd:.2f} ({pd / step_ms:.2f} steps) | "
                f"{ch:.2f} ({ch / step_ms:.2f} steps) | {pd / ch:.2f}x |"
            )


if __name__ == "__main__":
    main()
