"""Scenario (e) of issue 9: what the scheduler and the daemon (protocol, ZeroMQ, a second
process for the clients) cost over the bare engine, on the same model, BLAS and workload.

Workload: rounds of N requests of `--prompt` random tokens, `--tokens` greedy tokens each
(no EOS stop, speculation off), all N arriving together. Three ways, `--rounds` timed rounds
each after `--warmup-rounds` untimed ones (default 2: a compiled runner compiles a batch
shape the second time it comes — `ModelRunner.COMPILE_AFTER` — so with one warm-up round
the first timed round paid the compile of the N-prompt prefill; on a fresh H200 that was a
5.3 s stall of every request's first token in the scheduler row, session 9):

* engine: `ModelRunner` alone (bench/peers.py `Ours`): per round one batched prefill of the
  N prompts, then `tokens - 1` batched decode steps, argmax on the device;
* scheduler: the real `Scheduler` in this process (no sockets), N requests submitted in one
  tick per round and collected; with `--sampling KIND ...`, again for each kind of sampled
  request (seeded: "temperature" 0.8; "qwen", Qwen's recommended 0.7 with top-k 20 and
  top-p 0.8; "top-p" 0.9 at 1.0) — what sampling costs a step over greedy decoding;
* daemon: `slotserve serve` as a subprocess on an ipc socket, driven by `slotserve loadgen`'s
  closed loop (concurrency N, N x rounds requests) from this process; then again with the
  daemon's prefix cache off (`--no-no-cache-row` skips it): the scheduler row has no cache.

tokens/s = generated tokens / wall seconds of the timed rounds; each row's ratio to the
engine row; TTFT p50 / p95 where there are requests. The script re-executes itself with the
`--blas` library preloaded (the daemon does the same), so all three run on one BLAS.

    .venv/bin/python bench/end_to_end.py [--preset bench-50m --quant f16] [--n 8] [--blas openblas]

Prints a table; writes out/bench/end_to_end.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import harness
import mlx.core as mx
import numpy as np
from peers import Ours
from scheduler_overhead import GREEDY, Bench, percentile

from engine.sampling import SamplingParams
from transport import loadgen, loadreport
from transport.daemon import compute_dtype, kv_dtype_for, on_a_gpu_if_auto
from transport.daemon.demo import Supervised
from transport.metrics import free_port, scrape


def engine_rounds(path: Path, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    dtype, kv = _dtypes(args)
    names = [str(d).rsplit(".", 1)[-1] for d in (dtype, kv)]
    ours = Ours(path, dtype=names[0], kv_dtype=names[1], compile=on_a_gpu_if_auto(args.compile))
    walls = []
    for r in range(args.warmup_rounds + args.rounds):
        prompts = [harness.prompt_tokens(args.prompt, 1000 * r + i, vocab) for i in range(args.n)]
        t0 = time.perf_counter()
        ours.start(args.n, args.prompt + args.tokens)
        toks = [int(t) for t in np.argmax(ours.prefill(prompts), axis=-1)]
        for _ in range(args.tokens - 1):
            toks = ours.greedy(toks)  # argmax on the device, as the scheduler's
        if r >= args.warmup_rounds:
            walls.append(time.perf_counter() - t0)
    return {"tokens": args.n * args.tokens * args.rounds, "wall_s": sum(walls)}


SAMPLING = {
    "greedy": GREEDY,
    "temperature": SamplingParams(temperature=0.8, seed=1),
    "qwen": SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=1),
    "top-p": SamplingParams(temperature=1.0, top_p=0.9, seed=1),
}


async def scheduler_rounds(
    path: Path, args: argparse.Namespace, sampling: str = "greedy"
) -> dict[str, Any]:
    dtype, kv = _dtypes(args)
    context = args.prompt + args.tokens + 8
    ahead = on_a_gpu_if_auto(args.decode_ahead)
    bench = Bench(path, dtype, args.n, context, on_a_gpu_if_auto(args.compile), kv, ahead)
    scheduler = bench.scheduler()
    ttft: list[float] = []
    tokens, wall = 0, 0.0
    async with scheduler.running():
        for r in range(args.warmup_rounds + args.rounds):
            t0 = time.perf_counter()
            handles = [
                scheduler.submit(bench.request(args.prompt, args.tokens, SAMPLING[sampling]))
                for _ in range(args.n)
            ]
            results = [await h.collect() for h in handles]
            if r >= args.warmup_rounds:
                wall += time.perf_counter() - t0
                tokens += sum(len(x.token_ids) for x in results)
                ttft += [x.finished.timings.ttft_s or 0.0 for x in results]
    return {"tokens": tokens, "wall_s": wall, "ttft_s": ttft}


def daemon_rounds(
    path: Path, args: argparse.Namespace, tmp: Path, prefix_cache: bool = True
) -> dict[str, Any]:
    endpoint, port = f"ipc://{tmp}/end_to_end.sock", free_port()
    serve = ["--model", str(path), "--endpoints", endpoint, "--slots", str(args.n)]
    if not prefix_cache:
        serve += ["--prefix-cache", ""]
    serve += ["--context", str(args.prompt + args.tokens + 8), "--speculation", "off"]
    serve += ["--metrics-address", f"127.0.0.1:{port}", "--blas", args.blas]
    serve += ["--log-level", "warning"]
    serve += ["--dtype", args.dtype, "--compile", args.compile, "--decode-ahead", args.decode_ahead]

    def config(requests: int) -> loadgen.LoadConfig:
        return loadgen.LoadConfig(endpoint=endpoint, concurrency=args.n, requests=requests)

    def load(c: loadgen.LoadConfig) -> list[loadgen.Record]:
        return anyio.run(loadgen.run_load, c, None, args.prompt, args.tokens, None)

    timed = config(args.n * args.rounds)
    with Supervised(serve, endpoint):
        for _ in range(args.warmup_rounds):
            load(config(args.n))
        before = scrape(port)
        records = load(timed)
        time.sleep(0.6)  # the daemon's metrics snapshot its scheduler every 0.5 s
        after = scrape(port)
    s = loadreport.summarize(timed, records)
    ttft = [t for r in records if (t := r.ttft) is not None]
    steps = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in DAEMON_COUNTERS}
    return {
        "tokens": s.output_tokens,
        "wall_s": s.wall_s,
        "ttft_s": ttft,
        "errors": s.errors,
        "daemon_counters": steps,
    }


# The daemon's own account of the timed rounds (its metrics, after minus before): how many
# steps, their wall time and the part inside the forward, and decode-ahead's steps.
DAEMON_COUNTERS = (
    "slotserve_step_seconds_count",
    "slotserve_step_seconds_sum",
    "slotserve_forward_seconds_sum",
    "slotserve_host_overhead_seconds_sum",
    "slotserve_decode_ahead_taken_total",
    "slotserve_decode_ahead_dropped_total",
)


def _dtypes(args: argparse.Namespace) -> tuple[mx.Dtype, mx.Dtype]:
    """Compute and K/V dtypes as the daemon picks them for its `dtype` setting."""
    dtype = compute_dtype(args.dtype)
    return dtype, kv_dtype_for(dtype)


def main() -> None:
    args = parse_args()
    harness.run_on_blas(args.blas)
    path = args.model or harness.bench_model(args.preset, args.quant)
    vocab = harness.prompt_vocab(path)
    record: dict[str, Any] = {
        "benchmark": "end_to_end",
        "command": "bench/end_to_end.py " + " ".join(sys.argv[1:]),
        "machine": harness.machine(),
        "model": path.name,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": {},
    }
    tmp = harness.OUT_DIR / "end_to_end_tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    rows = record["rows"]
    rows["engine"] = engine_rounds(path, args, vocab)
    rows["scheduler"] = anyio.run(scheduler_rounds, path, args)
    for kind in args.sampling:
        rows[f"scheduler, {kind} sampling"] = anyio.run(scheduler_rounds, path, args, kind)
    if args.daemon:
        rows["daemon + loadgen"] = daemon_rounds(path, args, tmp)
    if args.daemon and args.no_cache_row:
        rows["daemon, no prefix cache"] = daemon_rounds(path, args, tmp, prefix_cache=False)
    base = rows["engine"]["tokens"] / rows["engine"]["wall_s"]
    table = []
    for name, r in rows.items():
        r["tok_s"] = r["tokens"] / r["wall_s"]
        r["ratio_to_engine"] = r["tok_s"] / base
        if ttft := r.get("ttft_s"):
            r["ttft_p50_ms"] = 1e3 * percentile(ttft, 50)
            r["ttft_p95_ms"] = 1e3 * percentile(ttft, 95)
        latency = [r.get("ttft_p50_ms", "-"), r.get("ttft_p95_ms", "-")]
        table.append([name, r["tokens"], r["tok_s"], r["ratio_to_engine"], *latency])
    print(
        f"\n{path.name} on {mx.default_device()}, {_dtypes(args)[0]}, compiled steps "
        f"{on_a_gpu_if_auto(args.compile)}, blas {args.blas}, N = {args.n}, {args.prompt}-token prompts, "
        f"{args.tokens} tokens each, {args.rounds} rounds after {args.warmup_rounds} untimed, decode-ahead {args.decode_ahead}\n"
    )
    header = ["path", "tokens", "tok/s", "/ engine", "TTFT p50 ms", "TTFT p95 ms"]
    print(harness.markdown_table(header, table))
    for name, r in rows.items():
        c = r.get("daemon_counters")
        if c and c["slotserve_step_seconds_count"]:
            n = c["slotserve_step_seconds_count"]
            print(
                f"{name}: {n:.0f} steps of {1e3 * c['slotserve_step_seconds_sum'] / n:.2f} ms "
                f"(forward {1e3 * c['slotserve_forward_seconds_sum'] / n:.2f}, host "
                f"{1e3 * c['slotserve_host_overhead_seconds_sum'] / n:.2f}); decode-ahead "
                f"taken {c['slotserve_decode_ahead_taken_total']:.0f}, dropped "
                f"{c['slotserve_decode_ahead_dropped_total']:.0f}"
            )
    print(f"\n{harness.write_json('end_to_end', record, args.out)}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="bench-50m", help="engine.writer preset")
    p.add_argument("--quant", default="f16")
    p.add_argument("--model", type=Path, help="a GGUF file instead of --preset/--quant")
    p.add_argument("--n", type=int, default=8, help="requests together (and daemon slots)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of N requests")
    p.add_argument("--warmup-rounds", type=int, default=2, help="untimed rounds before them")
    p.add_argument(
        "--blas", default=harness.default_blas(), help="bundled | openblas | numpy | a path"
    )
    p.add_argument("--dtype", default="auto", help="the daemon's dtype setting, for all three")
    p.add_argument("--compile", default="auto", help="the daemon's compile setting, for all three")
    p.add_argument(
        "--decode-ahead",
        default="auto",
        choices=["auto", "off", "on"],
        help="the daemon's decode_ahead setting, for the scheduler and daemon paths",
    )
    p.add_argument(
        "--no-cache-row",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the daemon with its prefix cache off (it snapshots every prompt and every "
        "finished request to host memory on the step thread; the scheduler row has none)",
    )
    p.add_argument(
        "--sampling",
        nargs="*",
        default=[],
        choices=[k for k in SAMPLING if k != "greedy"],
        help="also the scheduler with sampled requests of these kinds",
    )
    p.add_argument(
        "--daemon",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the daemon rows (--no-daemon: the engine and scheduler rows only)",
    )
    p.add_argument("--out", type=Path, help="JSON path")
    return p.parse_args()


if __name__ == "__main__":
    main()
