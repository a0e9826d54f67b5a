"""Milliseconds to sample one token per row from a vocabulary's logits, by sampling kind.

For each vocabulary size V, row count N and kind of `SamplingParams`:

* `sample`: what the scheduler's plain decode calls — on the CPU the host's numpy path
  (`engine.sampling.host_tokens`), on a GPU `device_tokens` and the read-back;
* `device_tokens`: the tokens as MLX computes them (what decode-ahead queues), evaluated;
* `draw(distribution)`: the whole distribution and a draw from it — the peer in the same
  run (what `sample` computed before session 23, less a second sort: `git log` of
  engine/sampling.py);
* `adjust_logits`: the penalties' step work over histories of `--history` tokens, under the
  kind "presence 1.5 + repetition 1.05" (Qwen's advice against repetition, beside its
  sampling settings);
* `logprobs`: a logprobs request's per-step work (the chosen token's and the top 5's
  log-probabilities on the host), under the kind "logprobs 5" (`token_logprobs`, or before
  it `top_logprobs` and the reads the stepper made).

Logits are bf16 values of N(0, 3) (bf16 ties, as a model's) in float32 (the runner's
logits), one set per (V, N). Best of `--repeat` timings of `--number` calls each. To time
another version, copy this script into that tree's bench/ (beside its harness.py) and run
it there: it falls back to what older trees have.

`--cold` instead times a fresh process's first `device_tokens` of each kind (8 rows): what
a daemon's first sampled step waits while the draws' fused kernels compile, with
`precompile_draws` run first (as `ModelRunner.precompile_decode` does) and without (then
first the host pool's own first calls, a kernel per count of pieces).

    .venv/bin/python bench/sampling_speed.py [--vocab 151936,248320] [--n 1,8,32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable

import harness  # noqa: F401  (puts the repository root on sys.path)
import mlx.core as mx
import numpy as np

from engine import sampling
from engine.kernels import host_pool
from engine.sampling import RequestRng, SamplingParams, distribution, draw, sample

KINDS = {
    "temperature 0.8": SamplingParams(temperature=0.8),
    "top-k 20, top-p 0.8 (Qwen's)": SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
    "top-p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "min-p 0.05": SamplingParams(temperature=1.0, min_p=0.05),
    "logprobs 5": SamplingParams(temperature=0.0, logprobs=5),
    "presence 1.5 + repetition 1.05": SamplingParams(
        temperature=0.7, top_k=20, top_p=0.8, presence_penalty=1.5, repetition_penalty=1.05
    ),
}


def best_ms(fn: Callable[[], object], number: int, repeat: int) -> float:
    fn()  # (warm-up: kernels and caches)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t) / number * 1e3)
    return min(times)


def measure(
    V: int, N: int, p: SamplingParams, number: int, repeat: int, history: int = 4096
) -> dict[str, float]:
    rng = np.random.default_rng(V + N)
    # bf16 values in float32, as the runner hands logits over
    logits = mx.array(rng.normal(0, 3, (N, V)).astype(np.float32)).astype(mx.bfloat16)
    logits = logits.astype(mx.float32)
    mx.eval(logits)
    params, rngs = [p] * N, [RequestRng(i) for i in range(N)]
    u = np.random.default_rng(1).random(N)
    out = {"sample": best_ms(lambda: sample(logits, params, rngs), number, repeat)}
    device_tokens = getattr(sampling, "device_tokens", None)
    if device_tokens is not None:
        out["device_tokens"] = best_ms(
            lambda: mx.eval(device_tokens(logits, params, u.tolist())), number, repeat
        )
    if p.penalized:
        histories = [rng.integers(0, V, history).tolist() for _ in range(N)]
        out["adjust_logits"] = best_ms(
            lambda: mx.eval(sampling.adjust_logits(logits, params, histories)), number, repeat
        )
        return out
    if p.logprobs:
        out["logprobs"] = best_ms(lambda: logprobs(logits, p.logprobs), number, repeat)
        return out
    out["draw(distribution)"] = best_ms(
        lambda: mx.eval(draw(distribution(logits, params), u)), number, repeat
    )
    return out


def logprobs(logits: mx.array, n: int) -> object:
    tokens = list(range(logits.shape[0]))
    if hasattr(sampling, "token_logprobs"):
        return sampling.token_logprobs(logits, tokens, n)
    lp, ids, vals = sampling.top_logprobs(logits, n)  # (before session 23)
    return np.array(lp[mx.arange(len(tokens)), mx.array(tokens)]), np.array(ids), np.array(vals)


def cold(V: int, precompile: bool) -> dict[str, float]:
    """In this (fresh) process: ms of each kind's first and second `device_tokens` (8 rows),
    after `precompile_draws` when asked; the ms it took in "precompile"."""
    out = {}
    if precompile:
        t = time.perf_counter()
        sampling.precompile_draws(V, 8)
        out["precompile"] = (time.perf_counter() - t) * 1e3
    else:  # the host pool's kernels alone first (a kernel per count of 8-byte pieces)
        for n in (4, 8, 16, 32, 64):
            for call in ("first", "second"):
                t = time.perf_counter()
                mx.eval(host_pool.array([0.5] * n, mx.float32))
                out[f"host_pool.array({n} floats): {call}"] = (time.perf_counter() - t) * 1e3
                t = time.perf_counter()
                host_pool.to_host(mx.arange(n, dtype=mx.int32))
                out[f"host_pool.to_host({n} ids): {call}"] = (time.perf_counter() - t) * 1e3
    logits = mx.array(np.random.default_rng(V).normal(0, 3, (8, V)).astype(np.float32))
    mx.eval(logits)
    for name, p in KINDS.items():
        if p.greedy or p.penalized:
            continue
        for call in ("first", "second"):
            t = time.perf_counter()
            mx.eval(sampling.device_tokens(logits, [p] * 8, [0.5] * 8))
            out[f"{name}: {call}"] = (time.perf_counter() - t) * 1e3
    return out


def cold_table(V: int) -> list[dict[str, object]]:
    rows = []
    for precompile in (False, True):
        child = [sys.executable, __file__, "--vocab", str(V), "--cold-child"]
        child += ["--precompile"] if precompile else []
        r = json.loads(subprocess.run(child, capture_output=True, check=True, text=True).stdout)
        rows.append({"V": V, "precompiled": precompile, **r})
        for key, ms in r.items():
            print(f"| {V} | {'yes' if precompile else 'no'} | {key} | {ms:.1f} |", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", default="151936,248320")
    ap.add_argument("--n", default="1,8,32")
    ap.add_argument("--number", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--history", type=int, default=4096, help="tokens a penalized row has seen")
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument("--cold", action="store_true", help="first calls in fresh processes")
    ap.add_argument("--cold-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--precompile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cold_child:
        print(json.dumps(cold(int(args.vocab), args.precompile)))
        return
    print(f"mlx {mx.__version__} on {mx.default_device()}")
    if args.cold:
        print("| V | precompile_draws | call (8 rows) | ms |\n|---|---|---|---|")
        rows = [r for V in map(int, args.vocab.split(",")) for r in cold_table(V)]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    columns = ("sample", "device_tokens", "draw(distribution)", "adjust_logits", "logprobs")
    print("| V | N | kind | " + " | ".join(f"{c} ms" for c in columns) + " |")
    print("|---|---|---|" + "---|" * len(columns))
    rows = []
    for V in map(int, args.vocab.split(",")):
        for N in map(int, args.n.split(",")):
            for name, p in KINDS.items():
                r = measure(V, N, p, args.number, args.repeat, args.history)
                rows.append({"V": V, "N": N, "kind": name, **r})
                cells = [f"{r[k]:.2f}" if k in r else "-" for k in columns]
                print(f"| {V} | {N} | {name} | " + " | ".join(cells) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
