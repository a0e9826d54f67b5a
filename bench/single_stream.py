"""Single-sequence prefill and decode tokens/s: our engine vs llama.cpp on the same GGUF file.

Per model file (one per `--quants`) and per sample, each contender, in turn:

* prefill: one forward over a fresh `--prefill`-token prompt (ours: one `runner.step` with one
  chunk; llama.cpp: one `llama_decode`); tok/s = prefill / seconds;
* decode: after a `--prompt`-token prompt, `--decode` greedy steps of one token each (argmax on
  the host for both); tok/s = decode / seconds.

Contenders alternate sample by sample (`--reps` samples after `--warmup` untimed ones); the
table shows the best (`--stat`) tok/s of each and their ratio. Ours computes in float32 (MLX's
CPU backend has no fast f16/bf16 matmul) with a float32 KV cache, as llama.cpp's here.
`--blas openblas` adds our engine with Debian's OpenBLAS preloaded over the reference BLAS
bundled in MLX's Linux wheel. The greedy tokens and the last prefill logits of every
contender are checked against the first's. Writes out/bench/single_stream.json.

    .venv/bin/python bench/single_stream.py            # full: 512 prefill, 128 decode, 3 reps
    .venv/bin/python bench/single_stream.py --quick    # < 1 minute
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import harness
import numpy as np
from peers import Contender


def sample(
    c: Contender, prefill: int, prompt: int, decode: int, seed: int, vocab: int
) -> dict[str, Any]:
    """One timed prefill and one timed greedy decode on `c` (runs in the contender's worker)."""
    tokens = harness.prompt_tokens(max(prefill, prompt), seed, vocab)
    c.start(1, prefill)
    with harness.Meter() as pre:
        logits = c.prefill([tokens[:prefill]])

    c.start(1, prompt + decode)
    tok = int(np.argmax(c.prefill([tokens[:prompt]])[0]))
    out = []
    with harness.Meter() as dec:
        for _ in range(decode):
            out.append(tok)
            tok = int(np.argmax(c.decode([tok])[0]))
    return {
        "prefill_s": pre.wall,
        "prefill_cores": pre.cores,
        "decode_s": dec.wall,
        "decode_cores": dec.cores,
        "others": max(pre.others, dec.others),
        "tokens": out,
        "prefill_logits": logits[0],
    }


def main() -> None:
    args = parse_args()
    sides = harness.sides_for(
        args.blas, args.compile, args.threads, args.kv_dtype, args.peers, args.dtype
    )
    pairs = harness.ratios(sides)
    record: dict[str, Any] = {
        "benchmark": "single_stream",
        "command": "bench/single_stream.py " + " ".join(args.argv),
        "machine": harness.machine(),
        "args": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "argv"
        },
        "samples": [],
        "summary": [],
        "checks": [],
    }
    rows, core_rows, check_rows = [], [], []
    for quant in args.quants:
        path = harness.bench_model(args.preset, quant)
        model = f"{args.preset} {quant}"
        kw = {"prefill": args.prefill, "prompt": args.prompt, "decode": args.decode}
        kw["vocab"] = harness.prompt_vocab(path)
        samples: dict[str, list[dict[str, Any]]] = {s.name: [] for s in sides}
        with harness.workers(sides, path) as ws:
            for i in range(args.warmup + args.reps):
                for w in ws:
                    res = harness.measure(w, sample, args.quiet, args.retries, seed=args.seed, **kw)
                    if i >= args.warmup:
                        samples[w.side.name].append(res)
                    print(
                        f"  {model} {w.side.name:<14} sample {i}: "
                        f"prefill {args.prefill / res['prefill_s']:7.1f} tok/s, "
                        f"decode {args.decode / res['decode_s']:6.1f} tok/s, "
                        f"others {res['others']:.2f} cores"
                        + (" (warm-up)" if i < args.warmup else ""),
                        flush=True,
                    )
        for phase, n in (("prefill", args.prefill), ("decode", args.decode)):
            rates = {k: [n / s[f"{phase}_s"] for s in v] for k, v in samples.items()}
            cores = {
                k: harness.median([s[f"{phase}_cores"] for s in v]) for k, v in samples.items()
            }
            med = {k: harness.STATS[args.stat](v) for k, v in rates.items()}
            rows.append(
                [model, f"{phase} {n}", *[med[s.name] for s in sides]]
                + [med[a] / med[b] for a, b in pairs]
            )
            core_rows.append([model, phase, *[cores[s.name] for s in sides]])
            record["summary"].append(
                {
                    "model": model,
                    "phase": phase,
                    "tokens": n,
                    "stat": args.stat,
                    "tok_s": med,
                    "tok_s_median": {k: harness.median(v) for k, v in rates.items()},
                    "tok_s_best": {k: max(v) for k, v in rates.items()},
                    "tok_s_all": rates,
                    "cores_busy_median": cores,
                    "ratios": {f"{a} / {b}": med[a] / med[b] for a, b in pairs},
                }
            )
        checks = token_checks(samples, [s.name for s in sides])
        for c in checks:
            d, scale = c["max_abs_dlogit"], c["max_abs_logit"]
            check_rows.append(
                [model, c["a"], c["b"], c["same_tokens"], f"{d:.1e} ({d / scale:.0e})"]
            )
            record["checks"].append({"model": model, **c})
        for name, v in samples.items():
            for s in v:
                record["samples"].append(
                    {"model": model, "side": name}
                    | {k: x for k, x in s.items() if k != "prefill_logits"}
                )

    header = ["model", "phase", *[f"{s.name} tok/s" for s in sides]]
    print(f"\ntok/s: {args.stat} of {args.reps} samples; ratios of those")
    header += [f"{a} / {b}" for a, b in pairs]
    print()
    print(harness.markdown_table(header, rows))
    print()
    print(
        harness.markdown_table(
            ["model", "phase", *[f"{s.name} cores busy" for s in sides]], core_rows
        )
    )
    print()
    print(
        harness.markdown_table(
            ["model", "a", "b", "same greedy tokens", "max abs Δ logit (rel. to max abs logit)"],
            check_rows,
        )
    )
    print(harness.noise_line(record["samples"]))
    print(f"\n{harness.write_json('single_stream', record, args.out)}")


def token_checks(
    samples: dict[str, list[dict[str, Any]]], names: list[str]
) -> list[dict[str, Any]]:
    """Each contender against the first: greedy decode tokens and last prefill logits."""
    first = samples[names[0]][0]
    out = []
    for name in names[1:]:
        other = samples[name][0]
        same = harness.common_prefix(first["tokens"], other["tokens"])
        out.append(
            {
                "a": names[0],
                "b": name,
                "same_tokens": f"{same}/{len(first['tokens'])}",
                "max_abs_dlogit": float(
                    np.max(np.abs(first["prefill_logits"] - other["prefill_logits"]))
                ),
                "max_abs_logit": float(np.max(np.abs(first["prefill_logits"]))),
            }
        )
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--preset", default="bench-50m", help="engine.writer preset (default %(default)s)"
    )
    p.add_argument("--quants", default="f16,q8_0", type=lambda s: s.split(","))
    p.add_argument("--prefill", type=int, default=512, help="prefill prompt tokens")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens before decoding")
    p.add_argument("--decode", type=int, default=128, help="decode steps (one token each)")
    p.add_argument("--reps", type=int, default=3, help="timed samples per contender")
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed samples per contender first (2: see batched_decode)",
    )
    harness.add_contender_args(p)
    p.add_argument(
        "--quick", action="store_true", help="64 prefill, 16 decode, 2 reps, no re-runs (< 1 min)"
    )
    args = p.parse_args()
    if args.quick:
        args.retries = 0
        args.prefill, args.prompt, args.decode, args.reps = 64, 16, 16, 2
    args.argv = sys.argv[1:]
    return args


if __name__ == "__main__":
    main()
