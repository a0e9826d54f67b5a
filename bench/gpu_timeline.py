"""Where a decode step's time goes on the GPU: a kernel timeline through CUPTI.

Runs the decode loop of `step_roofline.py` (N rows in one runner step, the argmax on the
device, the tokens to the host) under `torch.profiler`, whose CUPTI tracing records every
CUDA kernel of the process — MLX's too — with its start and duration, and the CUDA API
calls that launched them. Per N it reports, per step: wall time, kernels, the sum of their
durations, the time the GPU was busy (the union of the kernels' intervals) and idle, the
delay from the step's start to its first kernel, graph launches, the kernels that take
the most time, grouped by name, with their commonest grid x block, and the host's side: the
time spent inside CUDA's API calls by call, and the median time from one launch call to the
next (what the host pays a kernel). The JSON also lists the last step's kernels in order.
Needs torch with CUDA beside MLX's CUDA backend.

    python bench/gpu_timeline.py --preset qwen3.5-0.8b --quant f16 --dtype bf16 --n 1,8 \
        --model-dir MODELS --json OUT.json --trace-dir OUT/

`--verify K` times speculative verify steps instead (rows of K + 1 tokens with per-position
capture, then the pool's rollback to one kept token), to set beside the plain step.
`--ahead` runs plain steps as the scheduler's decode-ahead does (step t + 1 launched on step
t's argmax on the device, then step t's tokens read): a step's window is then one turn of
that loop, and its idle time is where the GPU waited for the host in serving.
`--inputs params` makes each step's token ids from a kernel's launch parameters
(`host_values.py`, bench only) and `--pin-readbacks` keeps every array the host reads (the
argmax ids) alive, so MLX's buffer cache never hands its host-touched managed buffer to a
later kernel: both together test whether the first kernel's wait (below) is managed pages
the host touched — host-made inputs read, or recycled host-read buffers written. The
engine's SLOTSERVE_HOST_POOL=1 (`engine/kernels/host_pool.py`) is the fix it would suggest:
ids both ways as arrays of 8 bytes, in MLX's small-block pool.
`--wake` queues a one-element kernel as each step's host work begins, before its graph is
built: in session 21's timelines the step's first kernel took 70-144 us whatever it read
(a gather of 8 ids, a kernel reading only its launch parameters) after the GPU had idled
~0.9 ms for the host. If the wait is the idle GPU's, it moves to the wake kernel, off the
step's path; if it is the step's own first launch, it stays. (Session 22: it stayed; with
the host pool the step had no slow kernel.)
`--sampled` draws the plain loop's rows at temperature 0.8 after the scheduler's finite
check, as sampling requests are served: their uniforms are host-made arrays each step
(through `host_pool.array` since session 22; SLOTSERVE_HOST_POOL=0 for plain ones).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

STEP = "slotserve_step"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of `(start, end)` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def short_name(name: str) -> str:
    """A kernel's name without template arguments and namespaces, for grouping."""
    base = re.sub(r"<.*", "", name)
    base = re.sub(r"\(.*", "", base)
    return base.split("::")[-1][:60] or name[:60]


def summarize_trace(events: list[dict[str, Any]], top: int = 12) -> dict[str, Any]:
    """Per-step figures from a Chrome trace's events (`torch.profiler`'s export).

    Steps are the `STEP` annotations; a kernel belongs to the step its start falls in.
    Returns medians over the steps, and the top kernels by time per step.
    """
    steps = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("name") == STEP and e.get("ph") == "X" and e.get("cat") == "user_annotation"
    )
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    launches = [
        e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and "Launch" in e.get("name", "")
        and e.get("ph") == "X"
    ]
    api = [
        e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("ph") == "X"
    ]
    per_step: list[dict[str, float]] = []
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    shapes: dict[str, collections.Counter[str]] = defaultdict(collections.Counter)
    resources: dict[str, dict[str, float | None]] = {}
    by_call: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    ks: list[dict[str, Any]] = []
    for a, b in steps:
        ks = [k for k in kernels if a <= k["ts"] < b]
        ls = [e for e in launches if a <= e["ts"] < b]
        calls = [e for e in api if a <= e["ts"] < b]
        starts = sorted(e["ts"] for e in ls)
        gaps = sorted(y - x for x, y in itertools.pairwise(starts))
        iv = [(k["ts"], k["ts"] + k["dur"]) for k in ks]
        busy = busy_us(iv)
        per_step.append(
            {
                "wall_us": b - a,
                "kernels": len(ks),
                "kernel_sum_us": sum(k["dur"] for k in ks),
                "busy_us": busy,
                "idle_us": (b - a) - busy,
                "first_kernel_us": (min(x for x, _ in iv) - a) if iv else 0.0,
                "graph_launches": sum("Graph" in e["name"] for e in ls),
                "kernel_launches": sum("Graph" not in e["name"] for e in ls),
                # the host: time inside CUDA's API, and from one launch call to the next
                "api_us": sum(e["dur"] for e in calls),
                "launch_gap_us": gaps[len(gaps) // 2] if gaps else 0.0,
            }
        )
        for k in ks:
            name = short_name(k["name"])
            entry = by_name[name]
            entry[0] += 1
            entry[1] += k["dur"]
            shapes[name][launch_shape(k)] += 1
            if resources.get(name, {}).get("regs") is None:  # (the first that says)
                resources[name] = launch_resources(k)
        for e in calls:
            call = by_call[e["name"]]
            call[0] += 1
            call[1] += e["dur"]
    n = max(len(steps), 1)

    def median(key: str) -> float:
        vals = sorted(s[key] for s in per_step)
        return vals[len(vals) // 2] if vals else 0.0

    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "steps": len(steps),
        **{k: median(k) for k in (per_step[0] if per_step else {})},
        "top": [
            {
                "kernel": name,
                "per_step": c / n,
                "us_per_step": t / n,
                "us_each": t / max(c, 1),
                "grid": shapes[name].most_common(1)[0][0],
                **resources[name],
            }
            for name, (c, t) in ranked
        ],
        "api": [
            {"call": name, "per_step": c / n, "us_per_step": t / n}
            for name, (c, t) in sorted(by_call.items(), key=lambda kv: -kv[1][1])[:top]
        ],
        # every kernel of the last step in order: what a name hides
        "last_step": [
            {
                "kernel": short_name(k["name"]),
                "us": k["dur"],
                "grid": launch_shape(k),
                **launch_resources(k),
            }
            for k in sorted(ks, key=lambda k: k["ts"])
        ],
    }


def launch_resources(kernel: dict[str, Any]) -> dict[str, float | None]:
    """What a launch holds on a multiprocessor (CUPTI's args, where the trace has them):
    registers a thread, shared memory a block (bytes), the estimated achieved occupancy (%)
    — whether a kernel's warps can be many enough to keep loads in flight."""
    args = kernel.get("args", {})
    return {
        "regs": args.get("registers per thread"),
        "smem": args.get("shared memory"),
        "occupancy": args.get("est. achieved occupancy %"),
    }


def launch_shape(kernel: dict[str, Any]) -> str:
    """`grid x block` of a kernel event (CUPTI's args), e.g. `[8, 1, 1]x[256, 1, 1]`."""
    args = kernel.get("args", {})
    return f"{args.get('grid', '?')}x{args.get('block', '?')}".replace(" ", "")


def profile(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np
    import torch
    from step_roofline import DTYPES, ensure_model
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    from engine.cache import SlotId, SlotPool
    from engine.gguf import GGUFFile
    from engine.kernels import host_pool
    from engine.kernels.argmax_cuda import argmax_rows
    from engine.models.qwen35 import Model
    from engine.runner import ModelRunner, Row, last_logits
    from engine.sampling import RequestRng, SamplingParams, sample
    from scheduler.step import FiniteCheck

    if args.inputs == "params":  # (bench only: the engine makes its ids with host_pool.ids)
        from host_values import MAX_VALUES, int32_from_params

        made = host_pool.ids

        host_pool.ids = lambda values: (
            int32_from_params(values) if len(values) <= MAX_VALUES else made(values)
        )

    pinned: list[Any] = []  # --pin-readbacks: every array the host read, alive to the end

    torch.zeros(1, device="cuda")  # CUPTI needs the CUDA context up
    path = ensure_model(args.preset, args.quant, Path(args.model_dir))
    model = Model(GGUFFile(path), DTYPES[args.dtype])
    rng = np.random.default_rng(0)
    out_all: dict[str, Any] = {"model": path.name, "dtype": args.dtype, "by_n": {}}
    K = args.verify
    for n in args.n:
        context = args.prompt + args.warmup + 2 * args.steps + args.verify + 8
        pool = SlotPool(model.config, n, context, DTYPES[args.dtype], max_draft=args.verify)
        runner = ModelRunner(model, pool, compile=not args.no_compile)
        slots = [pool.allocate() for _ in range(n)]
        vocab = min(32000, model.config.n_vocab)
        prompts = [[int(t) for t in rng.integers(0, vocab, args.prompt)] for _ in slots]
        out = runner.step([Row(s, p, 0) for s, p in zip(slots, prompts, strict=True)])
        toks = argmax_rows(last_logits(out.rows)).tolist()

        # the state a step passes on: its tokens (host ints), or with --ahead its argmax on
        # the device, which the next step launches on before the host reads it
        state: Any = mx.array(toks, dtype=mx.int32) if args.ahead else toks

        wake = mx.zeros((1,), dtype=mx.float32)
        mx.eval(wake)
        # --sampled: every row drawn at temperature 0.8 from its own stream, as the scheduler
        # draws a sampling request's tokens, after the scheduler's finite check
        params = [SamplingParams(temperature=0.8, top_k=40)] * n
        rngs = [RequestRng(seed) for seed in range(n)]

        def step(
            runner: ModelRunner,
            slots: list[SlotId],
            toks: Any,
            params: list[SamplingParams] = params,
            rngs: list[RequestRng] = rngs,
        ) -> Any:
            nonlocal wake
            if args.wake:  # a kernel now, while the host builds the step (no step reads it)
                wake = wake + 1
                mx.async_eval(wake)
            lengths = runner.pool.lengths
            if args.ahead:  # as the scheduler's decode-ahead
                out = runner.adopt(runner.launch(slots, toks), range(len(slots)))
                nxt = argmax_rows(last_logits(out.rows))
                mx.async_eval(nxt)
                host_pool.to_host(toks)  # step t's tokens to the host while step t + 1 runs
                if args.pin_readbacks:
                    pinned.append(toks)
                return nxt
            if not K:
                rows = [Row(s, [t], lengths[s]) for s, t in zip(slots, toks, strict=True)]
                out = runner.step(rows)
                if args.sampled:
                    assert all(FiniteCheck(out.rows).read())
                    return [int(t) for t in sample(last_logits(out.rows), params, rngs)]
                ids = argmax_rows(last_logits(out.rows))
                if args.pin_readbacks:
                    pinned.append(ids)
                return [int(t) for t in host_pool.to_host(ids)]  # (as the engine reads)
            # a verify step: K drafts (the token repeated) with capture, none accepted
            rows = [
                Row(s, [t] * (K + 1), lengths[s], capture=True, want=[0])
                for s, t in zip(slots, toks, strict=True)
            ]
            out = runner.step(rows)
            nxt = [int(t) for t in argmax_rows(last_logits(out.rows)).tolist()]
            runner.pool.rollback_many([(s, 1) for s in slots])
            return nxt

        for _ in range(args.warmup):
            state = step(runner, slots, state)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            state = step(runner, slots, state)
        plain_ms = (time.perf_counter() - t0) / args.steps * 1e3
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                with record_function(STEP):
                    state = step(runner, slots, state)
        trace = Path(args.trace_dir) / f"timeline_n{n}.json"
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
        summary = summarize_trace(events)
        summary["unprofiled_step_ms"] = plain_ms
        out_all["by_n"][str(n)] = summary
        print(format_summary(n, summary), file=sys.stderr)
    return out_all


def _or_dash(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def format_summary(n: int, s: dict[str, Any]) -> str:
    lines = [
        f"N={n}: step {s.get('wall_us', 0) / 1e3:.2f} ms under the profiler "
        f"({s['unprofiled_step_ms']:.2f} ms without), {s.get('kernels', 0):.0f} kernels, "
        f"kernel sum {s.get('kernel_sum_us', 0) / 1e3:.2f} ms, GPU busy "
        f"{s.get('busy_us', 0) / 1e3:.2f} ms, idle {s.get('idle_us', 0) / 1e3:.2f} ms, first "
        f"kernel after {s.get('first_kernel_us', 0) / 1e3:.2f} ms, "
        f"{s.get('graph_launches', 0):.0f} graph launches, "
        f"{s.get('kernel_launches', 0):.0f} direct launches; host: {s.get('api_us', 0) / 1e3:.2f} "
        f"ms in CUDA's API, {s.get('launch_gap_us', 0):.1f} us from launch to launch",
        f"  {'kernel':60s} {'per step':>8s} {'us/step':>9s} {'us each':>8s}  grid x block"
        "  regs occupancy",
    ]
    for t in s["top"]:
        lines.append(
            f"  {t['kernel']:60s} {t['per_step']:8.1f} {t['us_per_step']:9.1f} {t['us_each']:8.2f}"
            f"  {t['grid']}  {_or_dash(t.get('regs'))} {_or_dash(t.get('occupancy'))}"
        )
    lines.append(f"  {'CUDA API call':60s} {'per step':>8s} {'us/step':>9s}")
    for c in s.get("api", []):
        lines.append(f"  {c['call'][:60]:60s} {c['per_step']:8.1f} {c['us_per_step']:9.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from step_roofline import add_model_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p, n="1,8")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument(
        "--ahead",
        action="store_true",
        help="decode-ahead, as the scheduler runs: where the GPU waits for the host then",
    )
    p.add_argument(
        "--verify",
        type=int,
        default=0,
        help="time verify steps instead: K drafts a row with capture, rolled back to one token",
    )
    p.add_argument(
        "--inputs",
        choices=("arrays", "params"),
        default="arrays",
        help="each step's token ids as the engine makes them or from launch parameters",
    )
    p.add_argument(
        "--pin-readbacks",
        action="store_true",
        help="keep every array the host reads alive (its buffer never recycled)",
    )
    p.add_argument(
        "--wake",
        action="store_true",
        help="a one-element kernel queued as each step's host work begins (see above)",
    )
    p.add_argument(
        "--sampled",
        action="store_true",
        help="the plain loop's rows drawn at temperature 0.8 after the finite check, as the "
        "scheduler serves sampling requests (their uniforms are host-made arrays)",
    )
    p.add_argument("--trace-dir", default="out/timeline")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.ahead and args.verify:
        p.error("--ahead runs plain decode steps: not with --verify")
    if args.sampled and (args.ahead or args.verify):
        p.error("--sampled runs the plain loop: not with --ahead or --verify")
    result = profile(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
