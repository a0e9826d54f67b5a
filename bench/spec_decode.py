"""Speculative over plain decoding: aggregate decode tokens/s at N = 1, 4, 8 slots.

For each N and each configuration, N requests are prefilled together and decode
`--gen` greedy tokens each through `Speculator.plan` / `ModelRunner.step` /
`Speculator.resolve` (engine.spec.offline), one batched step per decode step.
Configurations: plain (speculation "off"), prompt lookup ("ngram") and the MTP
head ("mtp"), each with the cost controller ("auto") and at a fixed depth K
("on"). Each configuration keeps one engine (pool, runner, speculator and its
cost controller) across its runs, as a server would; after two warm-up runs of
each, the median of `--repeats` runs, configurations interleaved, is reported. `tok/s` is the batch's tokens over its
decode time (it waits for its slowest request); `busy tok/s` counts only the
steps while all N requests were decoding — the rate of N concurrent streams,
which is what a serving scheduler that refills slots sees.

Text: `--ids ids.npz` (the demo model's packed ids, tools/demo_model) takes `heldout`
prompts of `--prompt-len` tokens spread over the held-out split — what a trained model
should be measured on. Without it: random-weight models do not copy their prompts, so the only repetitive
text they produce is their own greedy loops. The tiny preset with tied
embeddings loops often; `loops` are prompts (a random phrase said three times)
whose plain greedy continuation repeats itself, screened by running it; `fresh`
are such prompts taken as they come. MTP acceptance on random weights means
nothing (the head never learned to predict its trunk); it is measured anyway.

    python bench/spec_decode.py [--preset tiny | --model FILE.gguf] [--n 1,8] [--gen 64]
                                [--repeats 3] [--device cpu|gpu] [--compile]
                                [--dflash FILE.gguf | random] [--ids IDS.npz]
                                [--configs plain,ngram,mtp,dflash] [--json OUT.json]

The demo model with its trained drafter (issue 10), held-out prompts, N = 1 and 8:

    python bench/spec_decode.py --model models/slotserve-demo.gguf --dflash DRAFTER.gguf \
        --ids IDS.npz --k 7 --n 1,8

`--dflash FILE.gguf` adds a DFlash drafter made for the model ("dflash" auto and on;
`--dflash random` writes a random one, which only shows what drafting costs); give it
`--k` up to its block size - 1.

`--model` takes any qwen35 GGUF with an MTP block (the trained demo model of issue 8);
the table ends with issue 9's targets (auto mode: >= 1.6x plain at N = 1, >= 1.25x at
N = 8), each met or not. `accepted/round` is the acceptance length: draft tokens accepted
per verify round (the bonus token not counted); `--configs` keeps only the named drafters.

Prints a markdown table; writes `--json` or out/bench/spec_decode[_<device>][_compiled].json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
from importlib import metadata
from pathlib import Path

import harness
import mlx.core as mx
import numpy as np
from step_roofline import DTYPES

from engine.cache import SlotPool
from engine.dflash_writer import DFlashSpec, write_dflash
from engine.generate import greedy_tokens
from engine.gguf import TensorFile
from engine.models.qwen35 import Model, load_model
from engine.runner import ModelRunner
from engine.spec.dflash import DFlashModel, load_dflash
from engine.spec.drafters import DFlashDrafter, Drafter, MTPDrafter, NgramDrafter
from engine.spec.offline import Request, Run, generate
from engine.spec.speculator import Speculator
from engine.writer import preset
from transport.daemon import kv_dtype_for

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "out" / "bench"
CONFIGS = [("plain", "off"), ("ngram", "auto"), ("ngram", "on"), ("mtp", "auto"), ("mtp", "on")]


def repeats_itself(tokens: list[int], share: float = 0.5) -> bool:
    """Whether most tokens continue an earlier bigram as it continued before."""
    hits = sum(
        any(tokens[j : j + 3] == tokens[i - 2 : i + 1] for j in range(i - 2))
        for i in range(2, len(tokens))
    )
    return hits >= share * len(tokens)


def synthetic_prompts(model: Model, count: int) -> list[list[int]]:
    """The synthetic prompts in order: a random phrase of 3-6 tokens said three times."""
    rng = np.random.default_rng(0)
    return [
        [int(t) for t in rng.integers(0, model.config.n_vocab, 3 + i % 4)] * 3 for i in range(count)
    ]


def prompt_sets(model: Model, n: int, gen: int) -> dict[str, list[list[int]]]:
    """`fresh`: the first n prompts; `loops`: the first n whose greedy continuation loops."""
    fresh = synthetic_prompts(model, n)
    loops: list[list[int]] = []
    for prompt in synthetic_prompts(model, 100 * n):
        if len(loops) < n and repeats_itself(greedy_tokens(model, prompt, gen)):
            loops.append(prompt)
        if len(loops) == n:
            return {"loops": loops, "fresh": fresh}
    raise SystemExit(f"{n} looping prompts not found in {100 * n}; try the tied tiny preset")


def held_out_prompts(model: Model, ids: Path, n: int, length: int) -> dict[str, list[list[int]]]:
    """`heldout`: n prompts of `length` tokens spread over the held-out split of `ids`."""
    from tools.demo_model.data import load_ids
    from tools.demo_model.report import prompts_from

    _, heldout, _ = load_ids(ids)
    eot = TensorFile(model.path).get("tokenizer.ggml.bos_token_id", -1)  # the file separator
    prompts = prompts_from(heldout, n, length, int(eot))
    if len(prompts) < n:
        raise SystemExit(f"{ids}: only {len(prompts)} held-out prompts of {length} tokens")
    return {"heldout": prompts}


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """How the model computes: `--dtype` (float32 by default, as every run before session 19;
    the daemon's on a GPU is bf16, and its pool's K/V dtype follows, `speculator`) and
    `--dense` (quantized matrices dequantized at load: the daemon's weights = "dense")."""
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f32", help="compute dtype")
    ap.add_argument("--dense", action="store_true", help="quantized matrices served dense")


def load_engine_model(path: Path, args: argparse.Namespace) -> Model:
    return load_model(path, DTYPES[args.dtype], dense=args.dense)


def speculator(
    model: Model,
    drafter: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
    dflash: DFlashModel | None,
) -> Speculator:
    """One engine per configuration, kept across its runs as a server keeps it."""
    n = len(prompts)
    context = max(len(p) for p in prompts) + args.gen + args.k + 1
    # float32 K/V beside float32 compute, as every earlier run; else the daemon's choice
    kv = mx.float32 if model.dtype == mx.float32 else kv_dtype_for(model.dtype)
    pool = SlotPool(model.config, n, context, kv, max_draft=args.k)
    runner = ModelRunner(model, pool, compile=args.compile)
    drafters: list[Drafter] = []
    if drafter == "ngram":
        drafters.append(NgramDrafter())
    elif drafter == "mtp":
        drafters.append(MTPDrafter(runner))
    elif drafter == "dflash" and dflash is not None:
        drafters.append(DFlashDrafter(runner, dflash))
    spec = Speculator(runner, args.k, drafters)
    if args.uniform:  # a GPU's batch shapes (verify rows, MTP rounds, padded widths)
        spec.use_uniform_shapes(True)
    if args.precompile:  # the daemon's precompile = "all": no steady shape compiles later
        spec.precompile()
    return spec


def measure(
    model: Model,
    text: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
    dflash: DFlashModel | None = None,
) -> list[dict[str, object]]:
    configs = CONFIGS + ([("dflash", "auto"), ("dflash", "on")] if dflash else [])
    configs = [c for c in configs if c[0] in args.configs.split(",")]
    specs = {c: speculator(model, c[0], prompts, args, dflash) for c in configs}
    requests = {c: [Request(p, args.gen, speculation=c[1]) for p in prompts] for c in configs}
    runs: dict[tuple[str, str], list[Run]] = {c: [] for c in configs}
    # Warm-up: kernel builds, allocations and the controller's first steps; twice, since a
    # compiled runner compiles a shape the second time it meets it (`COMPILE_AFTER`): with
    # one warm-up run, every shape a run meets once was compiled inside the first timed run.
    for _ in range(2):
        for c in configs:
            generate(specs[c], requests[c])
    # forwards of a shape not compiled yet (compiled runner: eager, or compiling) in timed runs
    cold = {c: -specs[c].runner.cold_steps for c in configs}
    for _ in range(args.repeats):
        for c in configs:
            runs[c].append(generate(specs[c], requests[c]))
    cold = {c: specs[c].runner.cold_steps + v for c, v in cold.items()}
    plain = statistics.median(r.decode_s for r in runs[("plain", "off")])
    plain_busy = statistics.median(r.busy_tokens / r.busy_s for r in runs[("plain", "off")])
    rows = []
    for (drafter, mode), rs in runs.items():
        seconds = statistics.median(r.decode_s for r in rs)
        busy = statistics.median(r.busy_tokens / r.busy_s for r in rs)
        stats = [s for r in rs for s in r.stats]
        drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
        rounds, steps = sum(s.verify_rounds for s in stats), sum(s.steps for s in stats)
        rows.append(
            {
                "N": len(prompts),
                "text": text,
                "drafter": drafter,
                "mode": mode,
                "tok_s": len(prompts) * args.gen / seconds,
                "speedup": plain / seconds,
                "busy_tok_s": busy,
                "busy_speedup": busy / plain_busy,
                "acceptance": accepted / drafted if drafted else None,
                "accepted_per_round": accepted / rounds if rounds else None,
                "mean_k": drafted / steps if steps else 0.0,
                "verify_share": rounds / steps if steps else 0.0,
                "steps": statistics.median(r.steps for r in rs),
                "cold_per_run": cold[drafter, mode] / len(rs),
            }
        )
    return rows


def table(rows: list[dict[str, object]]) -> str:
    def fmt(x: object, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    out = [
        "| N | text | drafter | mode | tok/s | speed-up | busy tok/s | busy speed-up "
        "| acceptance | accepted/round | mean K | verify share | steps | cold forwards |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['N']} | {r['text']} | {r['drafter']} | {r['mode']} | {fmt(r['tok_s'], '.0f')} "
            f"| {fmt(r['speedup'], '.2f')}x | {fmt(r['busy_tok_s'], '.0f')} "
            f"| {fmt(r['busy_speedup'], '.2f')}x | {fmt(r['acceptance'], '.2f')} "
            f"| {fmt(r['accepted_per_round'], '.2f')} | {fmt(r['mean_k'], '.2f')} "
            f"| {fmt(r['verify_share'], '.2f')} | {fmt(r['steps'], '.0f')} "
            f"| {fmt(r['cold_per_run'], '.1f')} |"
        )
    return "\n".join(out)


TARGETS = {1: 1.6, 8: 1.25}  # issue 9: speculation over plain decode, by N


def targets(rows: list[dict[str, object]]) -> str:
    """Issue 9's speculation targets against the measured speed-ups (auto mode)."""
    out = ["| target | text | measured | |", "|---|---|---|---|"]
    for r in rows:
        want = TARGETS.get(int(str(r["N"])))
        if want is None or r["mode"] != "auto":
            continue
        got = float(str(r["speedup"]))
        out.append(
            f"| {r['drafter']} auto >= {want}x plain at N = {r['N']} | {r['text']} "
            f"| {got:.2f}x | {'met' if got >= want else 'not met'} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--untied", action="store_true", help="keep the preset's own LM head")
    ap.add_argument("--model", type=Path, help="a GGUF file instead of --preset")
    ap.add_argument("--n", default="1,8")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="draft depth cap")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", choices=["default", "cpu", "gpu"], default="default")
    ap.add_argument("--compile", action="store_true", help="mx.compile the runner's step")
    ap.add_argument("--dflash", help="a DFlash drafter GGUF for the model, or 'random'")
    ap.add_argument("--ids", type=Path, help="packed ids (ids.npz): held-out prompts")
    ap.add_argument("--prompt-len", type=int, default=64, help="tokens per held-out prompt")
    ap.add_argument("--configs", default="plain,ngram,mtp,dflash", help="drafters to run")
    ap.add_argument("--json", type=Path, help="where the report goes")
    ap.add_argument("--uniform", action="store_true", help="a GPU's row shapes on any device")
    ap.add_argument(
        "--precompile",
        action="store_true",
        help="with --compile: every decode and verify shape, and the MTP head's steady ones, "
        "compiled before the runs (the daemon's precompile = all)",
    )
    add_engine_args(ap)
    args = ap.parse_args()
    if "plain" not in args.configs.split(","):
        ap.error("--configs needs plain: speed-ups are against it")
    if args.device != "default":
        mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)
    path = args.model or harness.bench_model(
        args.preset, preset(args.preset).quant, tied_embeddings=not args.untied
    )
    model = load_engine_model(path, args)
    dflash = None
    if args.dflash == "random":
        OUT.mkdir(parents=True, exist_ok=True)
        write_dflash(OUT / "dflash-random.gguf", DFlashSpec.for_file(path, block_size=args.k + 1))
        dflash = load_dflash(OUT / "dflash-random.gguf", model)
    elif args.dflash:
        dflash = load_dflash(args.dflash, model)
    ns = [int(x) for x in args.n.split(",")]
    if args.ids:
        sets = held_out_prompts(model, args.ids, max(ns), args.prompt_len)
    else:
        sets = prompt_sets(model, max(ns), args.gen)
    rows = [
        r
        for n in ns
        for text, prompts in sets.items()
        for r in measure(model, text, prompts[:n], args, dflash)
    ]
    print(table(rows))
    print("\n" + targets(rows))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    report = {
        "bench": "spec_decode",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": harness.machine(),
        "device": str(mx.default_device()),
        "mlx": metadata.version("mlx"),
        "model": path.name,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": rows,
    }
    suffix = ("" if args.device == "default" else f"_{args.device}") + (
        "_compiled" if args.compile else ""
    )
    path = args.json or OUT / f"spec_decode{suffix}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
