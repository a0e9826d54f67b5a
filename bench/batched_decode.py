"""Aggregate decode tokens/s with N sequences decoding together: our engine vs llama.cpp.

For each N in `--ns`, each contender starts N sequences, prefills their (different)
`--prompt`-token prompts in one untimed forward, then runs `--steps` timed decode steps; each
step is ONE forward for all N rows (ours: one `runner.step` with N one-token rows; llama.cpp:
one `llama_decode` of a batch with one token per `seq_id`, `n_seq_max = N`, per-sequence KV
streams). Greedy argmax on the host for both. Aggregate tok/s = N * steps / seconds.

Contenders alternate sample by sample (`--reps` after `--warmup`); the table shows the best
(`--stat`) aggregate tok/s of each, ours / llama.cpp, and each contender's scaling
aggregate(N=8) / aggregate(N=1). Checks: row 0 (the same prompt at every N) decodes the same
greedy tokens at every N, and ours with OpenBLAS decodes exactly what ours with the bundled
BLAS does. Writes
out/bench/batched_decode.json.

    .venv/bin/python bench/batched_decode.py            # N = 1..16, 32 steps, 3 reps
    .venv/bin/python bench/batched_decode.py --quick    # < 1 minute
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import harness
import numpy as np
from peers import Contender


def sample(c: Contender, n: int, prompt: int, steps: int, seed: int, vocab: int) -> dict[str, Any]:
    """N sequences, one untimed batched prefill, `steps` timed batched decode steps."""
    prompts = [harness.prompt_tokens(prompt, seed + i, vocab) for i in range(n)]
    c.start(n, prompt + steps)
    toks = [int(t) for t in np.argmax(c.prefill(prompts), axis=-1)]
    out: list[list[int]] = [[] for _ in range(n)]
    runner = getattr(c, "runner", None)  # ours: forwards of a shape not compiled yet
    cold = getattr(runner, "cold_steps", 0)
    with harness.Meter() as m:
        for _ in range(steps):
            for row, t in zip(out, toks, strict=True):
                row.append(t)
            toks = c.greedy(toks)
        if hasattr(c, "settle"):  # ours-ahead: the step queued past the last is timed too
            c.settle()
    res = {"decode_s": m.wall, "cores": m.cores, "others": m.others, "tokens": out}
    res["cold_forwards"] = getattr(runner, "cold_steps", 0) - cold
    if hasattr(c, "timings"):  # ours: where a step's wall time went (ms, medians)
        res["phases_ms"] = c.timings()
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    sides = harness.sides_for(
        args.blas,
        args.compile,
        args.threads,
        args.kv_dtype,
        args.peers,
        args.dtype,
        args.dense,
        args.ahead,
    )
    names = [s.name for s in sides]
    pairs = harness.ratios(sides)
    # the MLX sides compute in the same dtype on the same weights: they should agree exactly
    same_weights = [s.name for s in sides if s.kind != "llama"]
    path = args.model or harness.bench_model(args.preset, args.quant)
    model_name = path.name if args.model else f"{args.preset} {args.quant}"
    vocab = harness.prompt_vocab(path)
    samples: dict[tuple[int, str], list[dict[str, Any]]] = {
        (n, s): [] for n in args.ns for s in names
    }
    with harness.workers(sides, path) as ws:
        for i in range(args.warmup + args.reps):
            for n in args.ns:
                for w in ws:
                    kw = {"n": n, "prompt": args.prompt, "steps": args.steps, "seed": args.seed}
                    kw["vocab"] = vocab
                    res = harness.measure(w, sample, args.quiet, args.retries, **kw)
                    if i >= args.warmup:
                        samples[n, w.side.name].append(res)
                    phases = res.get("phases_ms")
                    print(
                        f"  N={n:<3} {w.side.name:<14} sample {i}: "
                        f"{n * args.steps / res['decode_s']:7.1f} tok/s, "
                        f"others {res['others']:.2f} cores"
                        + (
                            f"; per step {1e3 * res['decode_s'] / args.steps:.2f} ms, of it "
                            + ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
                            if phases
                            else ""
                        )
                        + (
                            f"; {res['cold_forwards']} cold forwards"
                            if res["cold_forwards"]
                            else ""
                        )
                        + (" (warm-up)" if i < args.warmup else ""),
                        flush=True,
                    )

    rates = {key: [key[0] * args.steps / s["decode_s"] for s in v] for key, v in samples.items()}
    med = {key: harness.STATS[args.stat](v) for key, v in rates.items()}
    rows: list[list[object]] = []
    summary = []
    for n in args.ns:
        rows.append([n, *[med[n, s] for s in names], *[med[n, a] / med[n, b] for a, b in pairs]])
        summary.append(
            {
                "n": n,
                "stat": args.stat,
                "tok_s": {s: med[n, s] for s in names},
                "tok_s_median": {s: harness.median(rates[n, s]) for s in names},
                "tok_s_best": {s: max(rates[n, s]) for s in names},
                "tok_s_all": {s: rates[n, s] for s in names},
                "cores_busy_median": {
                    s: harness.median([x["cores"] for x in samples[n, s]]) for s in names
                },
                "ratios": {f"{a} / {b}": med[n, a] / med[n, b] for a, b in pairs},
                "cold_forwards": {s: sum(x["cold_forwards"] for x in samples[n, s]) for s in names},
            }
        )
    scaling = {}
    if 1 in args.ns and 8 in args.ns:
        scaling = {s: med[8, s] / med[1, s] for s in names}
        rows.append(["N=8 / N=1", *[scaling[s] for s in names], *[""] * len(pairs)])

    checks = batch_checks(samples, args.ns, names)
    record: dict[str, Any] = {
        "benchmark": "batched_decode",
        "command": "bench/batched_decode.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": harness.machine(),
        "model": model_name,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "summary": summary,
        "scaling_n8_over_n1": scaling,
        "checks": checks,
        "samples": [{"n": n, "side": s} | x for (n, s), v in samples.items() for x in v],
    }
    header = ["N", *[f"{s} tok/s" for s in names], *[f"{a} / {b}" for a, b in pairs]]
    print(
        f"\n{model_name}, {args.prompt}-token prompts, {args.steps} decode steps; "
        f"tok/s: {args.stat} of {args.reps} samples\n"
    )
    print(harness.markdown_table(header, rows))
    print()
    print(
        harness.markdown_table(
            ["check", *[c["side"] for c in checks]],
            [["row 0 same tokens at every N"] + [c["row0_same_at_every_n"] for c in checks]],
        )
    )
    for other in same_weights[1:]:
        same = all_same(samples, args.ns, [same_weights[0], other])
        record["checks"].append({"side": other, f"same_tokens_as_{same_weights[0]}": same})
        print(f"\n{other} tokens == {same_weights[0]} tokens at every N and row: {same}")
    print(harness.noise_line(record["samples"]))
    cold = {s: sum(x["cold_forwards"] for n in args.ns for x in samples[n, s]) for s in names}
    if any(cold.values()):  # a compile (or an eager step) inside a timed window
        print("\ntimed samples met forwards of a shape not compiled yet: " + str(cold))
    print(f"\n{harness.write_json('batched_decode', record, args.out)}")
    return record


def batch_checks(
    samples: dict[tuple[int, str], list[dict[str, Any]]], ns: list[int], names: list[str]
) -> list[dict[str, Any]]:
    """Per contender: does row 0 (same prompt at every N) decode the same tokens at every N?"""
    out = []
    for s in names:
        ref = samples[ns[0], s][0]["tokens"][0]
        same = [harness.common_prefix(ref, samples[n, s][0]["tokens"][0]) == len(ref) for n in ns]
        out.append(
            {
                "side": s,
                "row0_same_at_every_n": all(same),
                "per_n": dict(zip(ns, same, strict=True)),
            }
        )
    return out


def all_same(
    samples: dict[tuple[int, str], list[dict[str, Any]]], ns: list[int], ours: list[str]
) -> bool:
    return all(
        samples[n, ours[0]][0]["tokens"] == samples[n, other][0]["tokens"]
        for n in ns
        for other in ours[1:]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--preset", default="bench-50m", help="engine.writer preset (default %(default)s)"
    )
    p.add_argument("--quant", default="f16", help="f16 | q8_0 | ... (default %(default)s)")
    p.add_argument("--model", type=Path, help="a GGUF file to use instead of --preset/--quant")
    p.add_argument(
        "--dense",
        action="store_true",
        help="ours dequantizes quantized matrices at load (the daemon's weights = dense)",
    )
    p.add_argument(
        "--ahead",
        action="store_true",
        help="also ours as ours-ahead: each step queued on the device on the previous step's "
        "argmax before the host reads it (the scheduler's decode_ahead); same tokens",
    )
    p.add_argument("--ns", default=[1, 2, 4, 8, 16], type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps")
    p.add_argument("--reps", type=int, default=3, help="timed samples per contender and N")
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed samples per contender and N (2: a compiled runner compiles a shape the "
        "second time it runs it, so one warm-up sample left the decode step at the prompt's "
        "past bucket to compile inside the first timed one)",
    )
    harness.add_contender_args(p)
    p.add_argument(
        "--quick",
        action="store_true",
        help="N = 1,2,4,8, 4-token prompts, 8 steps, 1 rep (< 1 min)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.retries = 0
        args.ns, args.prompt, args.steps, args.reps = [1, 2, 4, 8], 4, 8, 1
    return args


if __name__ == "__main__":
    main()
