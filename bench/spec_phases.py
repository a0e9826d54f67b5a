"""Where a speculative decode step's time goes: planning (drafting included), the forward,
the resolve (acceptance and commit) and, inside it, the rollback; inside the plan, the MTP
head's catch-up and draft chain — per configuration, at N
rows, through the same `Speculator` and offline loop `spec_decode.py` measures.

A verify step costs more than a plain one on the GPU (session 8: 4.9 against 2.0 ms at
N = 8 on the demo model); this splits it before anything is changed for it. Timings wrap
the Speculator's `plan` / `resolve`, the runner's `step` (decode steps only: rows of at
most K + 1 tokens) and the pool's `rollback_many`: BENCHMARK ONLY. Each phase's time
includes any wait for the device it makes (the resolve's first read of the logits waits
for the forward and the LM head). `new shapes`: forwards (trunk and MTP head) of a batch shape
the compiled runner had not compiled before the timed run — each ran eagerly or was compiled
there, and on a GPU costs tens to thousands of ms. `--warmup` runs come first (default 2: a
compiled runner compiles a shape the second time it comes, so after one warm-up run every
shape met once is compiled inside the timed run — session 9's MTP plan of 249-328 ms a step
on the H200 was mostly that). `--uniform` forces uniform rows (the default of a compiled
runner on a GPU) on any device. `--rounds R` times every configuration R times in turn, each
engine kept warm, and adds each configuration's median: the H200's host changed speed between
runs of one process (session 16: plain decode at N = 8 read 1.17 and 1.75 ms a step), so
configurations compared should alternate. `--host-parts` adds the speculator's host work by
part (session 16: what "auto", the daemon's default, costs a step where nothing drafts).

    python bench/spec_phases.py --model models/slotserve-demo.gguf [--ids IDS] --n 8 --compile
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import mlx.core as mx
from spec_decode import (
    add_engine_args,
    held_out_prompts,
    load_engine_model,
    speculator,
    synthetic_prompts,
)

import engine.runner
from engine.spec.controller import CostController
from engine.spec.offline import Request, generate

CONFIGS = [("plain", "off"), ("ngram", "on"), ("ngram", "auto"), ("mtp", "on"), ("mtp", "auto")]
PHASES = ("plan", "catch-up", "chain", "chain wait", "step", "resolve", "rollback")
# `--host-parts`: inside the plan, the offers, the controller's choice and the drafters'
# calls; inside the resolve, sampling and the drafters' commits
HOST_PARTS = ("offers", "choose", "drafters", "sample", "commits")


def _phases(args: Any) -> tuple[str, ...]:
    return PHASES + HOST_PARTS if args.host_parts else PHASES


class _EvalTimed:
    """BENCHMARK ONLY: `mlx.core` as `engine.runner` sees it for the length of one call
    (`_waits_timed`), its `eval` timed into `spent[label]`."""

    def __init__(self, spent: dict[str, float], label: str) -> None:
        self.spent, self.label = spent, label

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)

    def eval(self, *arrays: Any) -> None:
        t = time.perf_counter()
        mx.eval(*arrays)
        self.spent[self.label] = self.spent.get(self.label, 0.0) + time.perf_counter() - t


def _waits_timed(f: Any, spent: dict[str, float], label: str) -> Any:
    """`f`, the evaluations `engine.runner` makes inside each call timed into `spent[label]`."""
    proxy = _EvalTimed(spent, label)

    def timed(*args: Any, **kwargs: Any) -> Any:
        engine.runner.mx = proxy  # type: ignore[assignment]
        try:
            return f(*args, **kwargs)
        finally:
            engine.runner.mx = mx  # type: ignore[assignment]

    return timed


def _trace(ctrl: CostController, log: list[list[object]]) -> None:
    """BENCHMARK ONLY: log the controller's choices (`["choose", width, deepest depth, the
    widest cap]`) and the step times it is fed (`["step", width, depth, ms]`) in order."""
    choose, observe = ctrl.choose, ctrl.observe_step

    def chosen(offers: Any) -> list[int]:
        ks = choose(offers)
        log.append(["choose", len(offers), max(ks), max(o.cap for o in offers)])
        return ks

    def observed(width: int, depth: int, seconds: float) -> None:
        log.append(["step", width, depth, round(1000 * seconds, 3)])
        observe(width, depth, seconds)

    ctrl.choose = chosen  # type: ignore[method-assign]
    ctrl.observe_step = observed  # type: ignore[method-assign]


@dataclass
class _Engine:
    """One configuration's engine, warmed up, its timing hooks in place (kept across rounds)."""

    spec: Any
    requests: list[Request]
    spent: dict[str, float]
    trace: list[list[object]]


def _engine(
    model: Any, prompts: list[list[int]], drafter: str, mode: str, args: Any, credit: str = ""
) -> _Engine:
    """Build one configuration's engine, run its `args.warmup` untimed runs, hook its phases.
    `credit`: "free", the controller's credit for re-tries never runs out (as before session
    17); "held", it is always spent, so "auto" drafts nothing after its first plain step —
    what its host work costs on the steps where nothing drafts."""
    K = args.k
    spec = speculator(model, drafter, prompts, args, None)  # (spec_decode's engine)
    if credit == "free":  # BENCHMARK ONLY: an infinite earning keeps the credit infinite
        spec.controller.explore = math.inf
    elif credit == "held":  # BENCHMARK ONLY: spent for good (nothing charged, nothing earned)
        spec.controller.credit = -math.inf
        spec.controller.charge = lambda *a: None  # type: ignore[method-assign]
    runner, pool = spec.runner, spec.runner.pool
    if args.uniform:  # a GPU's default row shapes, on any device
        spec.use_uniform_shapes(True)
    requests = [Request(p, args.gen, speculation=mode) for p in prompts]
    for _ in range(args.warmup):  # kernel builds, compiled shapes, the controller
        generate(spec, requests)
    spent: dict[str, float] = {}

    def decode_step(batch: Any) -> bool:  # rows of at most K + 1 tokens: not a prefill
        return max(len(r.tokens) for r in batch) <= K + 1

    harness.time_calls(spec, "plan", spent, "plan")
    # inside the plan: the MTP head's catch-up (queued, so its device time lands in what
    # waits next) and its draft chain (which waits for its tokens)
    harness.time_calls(runner, "draft", spent, "catch-up")
    harness.time_calls(runner, "draft_chain", spent, "chain")
    harness.time_calls(runner, "step", spent, "step", decode_step)
    # inside the chain: its wait for the device (the catch-up's work and the chain's own),
    # the rest being the host's building of both
    runner.draft_chain = _waits_timed(runner.draft_chain, spent, "chain wait")
    harness.time_calls(spec, "resolve", spent, "resolve")
    harness.time_calls(pool, "rollback_many", spent, "rollback")
    if args.host_parts:  # (a wrapper per slot per step: it costs the steps some time)
        for owner, name, label in [
            (spec, "_offer", "offers"),
            (spec.controller, "choose", "choose"),
            *[(d, "draft", "drafters") for d in spec.drafters],
            (spec, "_plain", "sample"),
            (spec, "_commit", "commits"),
        ]:
            harness.time_calls(owner, name, spent, label)
    trace: list[list[object]] = []
    if args.trace:
        _trace(spec.controller, trace)
    return _Engine(spec, requests, spent, trace)


def phases(e: _Engine, config: str, args: Any) -> dict:
    """ms per decode step by phase for one timed run of a configuration's engine."""
    e.spent.clear()
    e.trace.clear()
    runner, ctrl = e.spec.runner, e.spec.controller
    cold, held = runner.cold_steps, ctrl.held
    run = generate(e.spec, e.requests)
    steps = max(run.steps, 1)
    drafter, mode, *_ = config.split(":")
    return {
        "config": config,
        "drafter": drafter,
        "mode": mode,
        "held": ctrl.held - held,  # steps the spent credit kept plain
        "credit_ms": 1000 * ctrl.credit,  # after the run
        "steps": run.steps,
        "decode_ms": 1000 * run.decode_s,
        # while every slot decoded (before the first request finished): a server's steady
        # rate, which a fixed batch's makespan hides behind its slowest request
        "busy_tok_s": run.busy_tokens / run.busy_s if run.busy_s else None,
        "new_shapes": runner.cold_steps - cold,
        "ms_per_step": {k: 1000 * e.spent.get(k, 0.0) / steps for k in _phases(args)},
        "controller": {
            str(w): {str(d): 1000 * s for d, s in t.items()}
            for w, t in e.spec.controller.seconds.items()
        },
        "trace": list(e.trace),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument(
        "--ids",
        type=Path,
        help="packed ids (ids.npz): held-out prompts (default: spec_decode's synthetic 'fresh' ones)",
    )
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    p.add_argument("--uniform", action="store_true", help="uniform rows (a GPU's default)")
    p.add_argument(
        "--precompile",
        action="store_true",
        help="with --compile: every steady shape compiled first (the daemon's precompile = all)",
    )
    p.add_argument(
        "--configs",
        default=",".join(f"{d}:{m}" for d, m in CONFIGS),
        help="drafter:mode[:free|:held], comma-separated; 'free': the controller's credit for "
        "re-tries never runs out (the controller as before session 17); 'held': it is always "
        "spent (what 'auto' costs the host where nothing drafts)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="timed runs of every configuration, in turn (engines kept warm): the host's speed "
        "drifts between runs on the H200, so compare configurations alternated",
    )
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--trace", action="store_true", help="the controller's choices and samples, into --json"
    )
    p.add_argument(
        "--host-parts",
        action="store_true",
        help="the speculator's host work by part too (offers, choice, drafters, sampling, "
        "commits): what 'auto' adds to a step where nothing drafts shows against plain:off",
    )
    add_engine_args(p)
    args = p.parse_args()
    model = load_engine_model(args.model, args)
    if args.ids is not None:
        prompts = held_out_prompts(model, args.ids, args.n, args.prompt_len)["heldout"]
    else:
        prompts = synthetic_prompts(model, args.n)
    rows = []
    print(
        f"{args.model.name}, N = {args.n}, K = {args.k}, {args.gen} tokens, {mx.default_device()}, "
        f"{args.dtype}{', dense' if args.dense else ''}"
    )
    print(
        "| drafter | mode | steps | new shapes | decode ms | "
        + " | ".join(f"{k} ms/step" for k in _phases(args))
        + " |"
    )
    print("|---|---|---|---|---|" + "---|" * len(_phases(args)))
    engines: dict[str, _Engine] = {}
    for _ in range(args.rounds):  # each round runs every configuration once, in order
        for config in args.configs.split(","):
            drafter, mode, *opts = config.split(":")
            if opts not in ([], ["free"], ["held"]):
                p.error(f"{config}: a configuration is drafter:mode[:free|:held]")
            if config not in engines:
                engines[config] = _engine(model, prompts, drafter, mode, args, "".join(opts))
            r = phases(engines[config], config, args)
            rows.append(r)
            cells = " | ".join(f"{r['ms_per_step'][k]:.2f}" for k in _phases(args))
            mode = ", ".join([mode, *opts])
            head = f"| {drafter} | {mode} | {r['steps']} | {r['new_shapes']} | {r['decode_ms']:.1f}"
            print(f"{head} | {cells} |", flush=True)
    if args.rounds > 1:
        _summary(rows)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"command": vars(args) | {"model": str(args.model)}, "rows": rows}, default=str
            )
        )


def _summary(rows: list[dict]) -> None:
    """Per configuration: its runs' decode ms, median, and the median against plain decode's;
    the same for the rate while every slot decoded (`busy_tok_s`)."""
    by: dict[str, list[float]] = {}
    busy: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r["config"], []).append(r["decode_ms"])
        if r.get("busy_tok_s"):
            busy.setdefault(r["config"], []).append(r["busy_tok_s"])
    plain = statistics.median(by["plain:off"]) if "plain:off" in by else None
    plain_busy = statistics.median(busy["plain:off"]) if "plain:off" in busy else None
    print(
        "\n| configuration | decode ms, each round | median | vs plain (medians) "
        "| busy tok/s, each round | busy vs plain (medians) |"
    )
    print("|---|---|---|---|---|---|")
    for config, ms in by.items():
        m = statistics.median(ms)
        ratio = f"{plain / m:.2f}x" if plain else ""
        b = busy.get(config, [])
        b_ratio = f"{statistics.median(b) / plain_busy:.2f}x" if b and plain_busy else ""
        print(
            f"| {config} | {', '.join(f'{x:.1f}' for x in ms)} | {m:.1f} | {ratio} "
            f"| {', '.join(f'{x:.0f}' for x in b)} | {b_ratio} |"
        )


if __name__ == "__main__":
    main()
