"""Scheduler host overhead and time to first token, through the real Scheduler.

1. Overhead: N requests (default 32) arrive together; once all have their first
   token, the decode steps are measured. Per step: wall time (boundary to boundary),
   time inside `runner.step`, and the host phases around it — speculator planning,
   sampling (step thread), scheduling + commit and publishing (event loop; publishing
   overlaps the next forward). Host overhead = 1 - forward / wall.
2. TTFT: a lone request vs 8 arriving in the same event-loop tick, `--rounds` times
   each; p50 / p95 over all requests, and the burst's aggregate tokens/s.

    python bench/scheduler_overhead.py [--preset demo | --model FILE.gguf] [--n 32] [--compile]
                                       [--blas openblas] [--ragged] [--ttft-only]
                                       [--decode-ahead]

Prints a markdown table; writes JSON to out/bench/scheduler_overhead.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
import harness
import mlx.core as mx

from engine.cache import SlotPool
from engine.gguf import GGUFFile
from engine.models.qwen35 import load_model
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer
from scheduler import (
    Delta,
    Request,
    RequestHandle,
    Scheduler,
    SchedulerConfig,
    Speculation,
    StepTimes,
)

OUT_DIR = harness.OUT_DIR  # importing harness also puts the repository root on sys.path

GREEDY = SamplingParams(temperature=0.0)


class Bench:
    def __init__(
        self,
        path: Path,
        dtype: mx.Dtype,
        n_slots: int,
        context: int,
        compile: bool,
        kv_dtype: mx.Dtype = mx.float16,
        decode_ahead: bool = False,
    ) -> None:
        self.model = load_model(path, dtype)
        self.decode_ahead = decode_ahead
        self.tokenizer = Tokenizer.from_metadata(GGUFFile(path).metadata, str(path))
        self.n_slots, self.context, self.compile = n_slots, context, compile
        self.kv_dtype = kv_dtype
        self.rng = random.Random(0)

    def scheduler(self) -> Scheduler:
        pool = SlotPool(self.model.config, self.n_slots, self.context, self.kv_dtype)
        runner = ModelRunner(self.model, pool, compile=self.compile)
        config = SchedulerConfig(
            max_batch_tokens=4096, max_prefill_chunk=512, decode_ahead=self.decode_ahead
        )
        return Scheduler(runner, self.tokenizer, config)

    def request(
        self, prompt_len: int, max_tokens: int, sampling: SamplingParams = GREEDY
    ) -> Request:
        vocab = self.model.config.n_vocab
        ids = [self.rng.randrange(0, vocab - 16) for _ in range(prompt_len)]
        return Request(
            prompt=ids,
            sampling=sampling,
            max_tokens=max_tokens,
            ignore_eos=True,
            speculation=Speculation.OFF,
        )

    async def overhead(self, n: int, prompt_len: int, max_tokens: int) -> dict[str, Any]:
        """Per-step times of the decode phase of n requests that arrive together."""
        scheduler = self.scheduler()
        marks: list[StepTimes] = []
        firsts = 0

        async def consume(handle: RequestHandle) -> None:
            nonlocal firsts
            counted = False
            async for event in handle:
                if not counted and isinstance(event, Delta) and event.token_ids:
                    counted, firsts = True, firsts + 1
                    if firsts == n:  # every request decodes from here on
                        marks.append(scheduler.stats().times)

        async with scheduler.running():
            await self._warm(scheduler, n, prompt_len, max_tokens)
            handles = [scheduler.submit(self.request(prompt_len, max_tokens)) for _ in range(n)]
            async with anyio.create_task_group() as tg:
                for h in handles:
                    tg.start_soon(consume, h)
            marks.append(scheduler.stats().times)
        return _per_step(marks[0], marks[1])

    async def _warm(self, scheduler: Scheduler, n: int, prompt_len: int, tokens: int) -> None:
        """Two rounds of the same shape first, so that compiled step shapes are cached: a
        compiled runner compiles a prefill's shape the second time it meets it, so with one
        round the first timed one paid the compile (in its TTFT)."""
        for _ in range(2):
            handles = [scheduler.submit(self.request(prompt_len, tokens)) for _ in range(n)]
            for h in handles:
                await h.collect()

    async def ttft(
        self, rounds: int, burst: int, prompt_len: int, max_tokens: int, ragged: bool = False
    ) -> dict[str, float]:
        """TTFT of a lone request and of `burst` requests submitted in one tick; `ragged`:
        each timed request's prompt length drawn from prompt_len/2 .. 3*prompt_len/2, as a
        service sees them (with compiled steps, prefill shapes the warm-up did not meet)."""
        scheduler = self.scheduler()

        def length() -> int:
            return self.rng.randint(prompt_len // 2, prompt_len * 3 // 2) if ragged else prompt_len

        lone: list[float] = []
        crowd: list[float] = []
        rates: list[float] = []
        async with scheduler.running():
            await self._warm(scheduler, burst, prompt_len, max_tokens)
            await self._warm(scheduler, 1, prompt_len, max_tokens)
            for _ in range(rounds):
                done = await scheduler.submit(self.request(length(), max_tokens)).collect()
                lone.append(_ttft(done.finished.timings.ttft_s))
                t0 = time.perf_counter()
                handles = [
                    scheduler.submit(self.request(length(), max_tokens)) for _ in range(burst)
                ]
                results = [await h.collect() for h in handles]
                wall = time.perf_counter() - t0
                crowd += [_ttft(r.finished.timings.ttft_s) for r in results]
                rates.append(sum(len(r.token_ids) for r in results) / wall)
        return {
            "lone_p50_ms": percentile(lone, 50) * 1e3,
            "lone_p95_ms": percentile(lone, 95) * 1e3,
            "burst_p50_ms": percentile(crowd, 50) * 1e3,
            "burst_p95_ms": percentile(crowd, 95) * 1e3,
            "burst_p95_over_lone_p50": percentile(crowd, 95) / percentile(lone, 50),
            "burst_tokens_per_s": statistics.median(rates),
        }


def _per_step(a: StepTimes, b: StepTimes) -> dict[str, Any]:
    """Milliseconds per step between two snapshots, and the host share of the wall."""
    d = {f.name: getattr(b, f.name) - getattr(a, f.name) for f in dataclasses.fields(StepTimes)}
    steps = max(int(d.pop("steps")), 1)
    per_step = {k.replace("_s", "_ms"): v / steps * 1e3 for k, v in d.items()}
    wall = d["wall_s"]
    return {
        "steps": steps,
        **per_step,
        "host_share": 1 - d["forward_s"] / wall if wall else 0.0,
    }


def _ttft(x: float | None) -> float:
    assert x is not None, "a request produced no token"
    return x


def percentile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, round(q / 100 * (len(ys) - 1)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="demo")
    p.add_argument("--quant", default="f32")
    p.add_argument("--model", type=Path, help="a GGUF file instead of --preset/--quant")
    p.add_argument("--n", type=int, default=32, help="requests decoding together")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--burst", type=int, default=8, help="simultaneous arrivals for TTFT")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--compile", action="store_true", help="mx.compile the step per shape")
    p.add_argument(
        "--ragged", action="store_true", help="TTFT prompts of random lengths (new shapes)"
    )
    p.add_argument("--ttft-only", action="store_true", help="skip the decode-overhead part")
    p.add_argument(
        "--decode-ahead",
        action="store_true",
        help="SchedulerConfig.decode_ahead (its requests are greedy)",
    )
    p.add_argument("--blas", default="bundled", help="bundled | openblas | numpy | a CBLAS path")
    p.add_argument("--json", default=str(OUT_DIR / "scheduler_overhead.json"))
    args = p.parse_args()
    harness.run_on_blas(args.blas)

    path = args.model or harness.bench_model(args.preset, args.quant)
    dtype = getattr(mx, args.dtype)
    context = max(args.prompt + args.tokens, args.prompt * 3 + 16) + 8  # ragged: up to 3x
    bench = Bench(
        path, dtype, max(args.n, args.burst), context, args.compile, decode_ahead=args.decode_ahead
    )
    over = {} if args.ttft_only else anyio.run(bench.overhead, args.n, args.prompt, args.tokens)
    ttft = anyio.run(bench.ttft, args.rounds, args.burst, args.prompt * 2, 16, args.ragged)
    report = {
        "bench": "scheduler_overhead",
        "model": path.name,
        "device": str(mx.default_device()),
        "machine": harness.machine(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "overhead": over,
        "ttft": ttft,
    }
    print(table(report))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")


def table(r: dict[str, Any]) -> str:
    o, t, a = r["overhead"], r["ttft"], r["args"]
    lines = [f"model {r['model']} ({a['dtype']}) on {r['device']}, compile={a['compile']}"]
    if o:
        lines += [
            "",
            f"| N = {a['n']} decode step | ms / step | share of wall |",
            "|---|---:|---:|",
        ]
        for key, label in [
            ("wall_ms", "wall (boundary to boundary)"),
            ("forward_ms", "runner.step (forward)"),
            ("draft_ms", "speculator.plan"),
            ("sample_ms", "resolve + sampling + logprobs"),
            ("schedule_ms", "scheduling + commit"),
            ("publish_ms", "detokenize + stops + publish (overlapped)"),
        ]:
            lines.append(f"| {label} | {o[key]:.3f} | {o[key] / o['wall_ms']:.1%} |")
        lines.append(f"| **host overhead** (wall - forward) | | **{o['host_share']:.1%}** |")
    prompts = f"{a['prompt']}-{a['prompt'] * 3}" if a["ragged"] else f"{a['prompt'] * 2}"
    lines += [
        "",
        f"| TTFT ({prompts}-token prompts) | p50 ms | p95 ms |",
        "|---|---:|---:|",
        f"| one alone | {t['lone_p50_ms']:.1f} | {t['lone_p95_ms']:.1f} |",
        f"| {a['burst']} at once | {t['burst_p50_ms']:.1f} | {t['burst_p95_ms']:.1f} |",
        "",
        f"burst p95 / lone p50 = {t['burst_p95_over_lone_p50']:.2f} (target <= 1.5); "
        f"burst throughput {t['burst_tokens_per_s']:.0f} tokens/s",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
