"""Train the demo model on packed ids with MLX: one compiled step (forward, both losses,
backward, global-norm clipping, AdamW) per batch of random windows. `fit` is that loop for
any weights and objective (the DFlash drafter's trainer, `dflash_train.py`, uses it too).

Needs only numpy, mlx and this repository, so it runs unchanged on the GPU machine. The run
stops at `steps` or before its time limit, whichever comes first, and always leaves
`weights-*.npz` (float16 shards of <= 15 MiB, checkpointed every `checkpoint_s` seconds and
at the end), `run.json` (the recipe, the vocabulary digest, progress, held-out losses) and
`log.jsonl` in its directory, also when stopped by SIGTERM.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from tools.demo_model.config import Recipe, Schedule
from tools.demo_model.data import load_ids
from tools.demo_model.model import Forward, Hyper, Params, fused_attention_trains, init_params

BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8
CLIP_NORM = 1.0
EVAL_WINDOWS = 64
MAX_ROLLBACKS = 3
SHARD_BYTES = 15 << 20


@dataclass
class Progress:
    step: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0
    losses: dict[str, float] = field(default_factory=dict)


Objective = Callable[[Params, Any], tuple[mx.array, tuple[mx.array, ...]]]
Update = Callable[..., tuple[Any, ...]]


def learning_rate(r: Schedule, step: int, progress: float) -> float:
    """Linear warmup, then cosine from `lr` to `min_lr_ratio * lr` over `progress` in [0, 1]."""
    warm = min(1.0, (step + 1) / max(1, r.warmup))
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return r.lr * warm * (r.min_lr_ratio + (1.0 - r.min_lr_ratio) * cosine)


def make_update(objective: Objective, weight_decay: float, compile: bool = True) -> Update:
    """The update: (params, m, v, t, lr, windows) -> (params, m, v, *reported losses) for
    an `objective(params, windows) -> (minimised loss, reported losses)`.

    Gradients and the AdamW update are two compiled functions: compiled as one, MLX took
    ~100x longer to compile them (minutes on CPU) for no faster step. `compile=False` runs
    both eagerly: on MLX's CUDA backend the compiled gradient's first step took 337 s
    (its fused kernels are JIT-compiled one by one), more than a whole 300 s budget.
    """
    jit: Callable[[Any], Any] = mx.compile if compile else (lambda f: f)
    grad_fn = jit(mx.value_and_grad(objective))

    @jit
    def adamw(
        p: Params, m: Params, v: Params, grads: Params, t: mx.array, lr: mx.array
    ) -> tuple[Params, Params, Params]:
        norm = mx.sqrt(
            sum(((g.astype(mx.float32) ** 2).sum() for g in grads.values()), mx.array(0.0))
        )
        scale = mx.minimum(1.0, CLIP_NORM / (norm + 1e-6))
        b1, b2 = BETAS
        c1, c2 = 1.0 - b1**t, 1.0 - b2**t
        new_p, new_m, new_v = {}, {}, {}
        for name, w in p.items():
            g = grads[name] * scale
            new_m[name] = b1 * m[name] + (1.0 - b1) * g
            new_v[name] = b2 * v[name] + (1.0 - b2) * g * g
            update = (new_m[name] / c1) / (mx.sqrt(new_v[name] / c2) + ADAM_EPS)
            if w.ndim == 2:  # decoupled weight decay on matrices only, never on norms/decays
                update = update + weight_decay * w
            new_p[name] = w - lr * update
        return new_p, new_m, new_v

    def step(
        p: Params, m: Params, v: Params, t: mx.array, lr: mx.array, batch: Any
    ) -> tuple[Any, ...]:
        (_, reported), grads = grad_fn(p, batch)
        p, m, v = adamw(p, m, v, grads, t, lr)
        return (p, m, v, *reported)

    return step


def make_step(fwd: Forward, r: Recipe, compile: bool = True) -> Update:
    """The demo model's update: (params, m, v, t, lr, windows) -> (params, m, v, main loss,
    MTP loss), minimising main + `mtp_weight` * MTP."""

    def objective(p: Params, window: mx.array) -> tuple[mx.array, tuple[mx.array, ...]]:
        main, mtp = fwd.losses(p, window)
        return main + r.mtp_weight * mtp, (main, mtp)

    return make_update(objective, r.weight_decay, compile)


def sample_windows(ids: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> mx.array:
    starts = rng.integers(0, ids.size - length, size=batch)
    return mx.array(ids[starts[:, None] + np.arange(length)].astype(np.int32))


def held_out_windows(
    ids: np.ndarray, r: Schedule, length: int, count: int = EVAL_WINDOWS
) -> list[mx.array]:
    """`count` fixed windows of `length` tokens of the held-out ids, in batches."""
    length = min(length, ids.size - 1)
    rng = np.random.default_rng(1234)
    n = max(1, count // r.batch)
    return [sample_windows(ids, min(r.batch, count), length, rng) for _ in range(n)]


class HeldOut:
    """Mean main and MTP loss (and the main perplexity) over fixed held-out windows."""

    def __init__(self, fwd: Forward, ids: np.ndarray, r: Recipe, compile: bool = True) -> None:
        self.batches = held_out_windows(ids, r, min(r.seq_len, ids.size - 3) + 2)
        self.losses = mx.compile(fwd.losses) if compile else fwd.losses

    def __call__(self, p: Params) -> tuple[float, dict[str, float]]:
        total = [self.losses(p, w) for w in self.batches]
        n = len(total)
        main = sum(float(a) for a, _ in total) / n
        mtp = sum(float(b) for _, b in total) / n
        return main, {"loss": main, "mtp_loss": mtp, "ppl": math.exp(main)}


def save_weights(p: Params, out: Path, dtype: str) -> None:
    """`out/weights-{i}.npz` shards of at most `SHARD_BYTES` each (what a GPU job may hand
    back per file); earlier shards there are replaced."""
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name in sorted(p):
        w = np.array(p[name].astype(mx.float32)).astype(dtype)
        if shards[-1] and size + w.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = w
        size += w.nbytes
    for old in out.glob("weights-*.npz"):
        old.unlink()
    for i, arrays in enumerate(shards):
        tmp = out / f"weights-{i}.tmp.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, out / f"weights-{i}.npz")


def read_weights(run: Path) -> dict[str, np.ndarray]:
    """Every tensor of the `weights-*.npz` shards in `run`, as float32."""
    out: dict[str, np.ndarray] = {}
    for shard in sorted(run.glob("weights-*.npz")):
        with np.load(shard) as z:
            out.update({k: z[k].astype(np.float32) for k in z.files})
    if not out:
        raise FileNotFoundError(f"{run}: no weights-*.npz")
    return out


def load_weights(run: Path) -> Params:
    return {k: mx.array(w) for k, w in read_weights(run).items()}


@dataclass
class Job:
    """One training run for `fit`, whatever it trains.

    `update` is a `make_update` step over `params`, reporting the losses `loss_names`
    (the first one is checked for being finite); `sample(train ids, rng)` draws what it
    trains on in a step (windows of `schedule.seq_len` tokens, and what goes with them).
    `held_out(params) -> (score, metrics)`: the weights with the lowest score are saved.
    `run` starts the run's `run.json` (the recipe, the data's digest, ...).
    """

    schedule: Schedule
    params: Params
    update: Update
    loss_names: tuple[str, ...]
    sample: Callable[[np.ndarray, np.random.Generator], Any]
    held_out: Callable[[Params], tuple[float, dict[str, float]]] | None
    run: dict[str, Any]
    name: str = "train"


@dataclass(frozen=True)
class RunOptions:
    """How a run is driven, whatever it trains: it stops before `time_limit_s` (compile
    included), saves `save_dtype` weights every `checkpoint_s`, checks the held-out score
    every `eval_s` (<= 0: never) and prints every `log_every` steps; `compile`: see
    `make_update`."""

    time_limit_s: float | None = None
    checkpoint_s: float = 60.0
    eval_s: float = 30.0
    save_dtype: str = "float16"
    log_every: int = 10
    compile: bool = True


def fit(job: Job, train_ids: np.ndarray, out: Path, opts: RunOptions) -> Progress:
    """Train `job` on `train_ids`; write weights and logs under `out`.

    Every `opts.eval_s` seconds (and at the end) the held-out score is measured; the weights
    saved at the end are the best ones seen (the last ones when there is no held-out check).
    A non-finite loss rolls back to the last good weights with half the learning rate (up to
    `MAX_ROLLBACKS` times).
    """
    time_limit_s, checkpoint_s, eval_s = opts.time_limit_s, opts.checkpoint_s, opts.eval_s
    save_dtype, log_every, compile = opts.save_dtype, opts.log_every, opts.compile
    t_start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    r, name, params = job.schedule, job.name, job.params
    m = {k: mx.zeros_like(w) for k, w in params.items()}
    v = {k: mx.zeros_like(w) for k, w in params.items()}
    held_out = job.held_out if eval_s > 0 else None
    rng = np.random.default_rng(r.seed)
    prog = Progress()
    run: dict[str, Any] = {
        **job.run,
        "params": sum(w.size for w in params.values()),
        "device": str(mx.default_device()),
        "mlx": getattr(mx, "__version__", "?"),
        "compiled": compile,
        "time_limit_s": time_limit_s,
        "evals": [],
        "rollbacks": 0,
    }
    print(f"{name}: {run['params'] / 1e6:.2f}M params, {train_ids.size} ids, {run['device']}")
    best: tuple[float, int, Params, dict[str, float]] = (math.inf, 0, params, {})
    good = (params, m, v)  # MLX arrays are immutable: keeping references copies nothing
    lr_scale, step_s = 1.0, 0.0
    last_ckpt = last_eval = time.perf_counter()

    def evaluate() -> None:
        nonlocal best, good, last_eval
        assert held_out is not None
        score, metrics = held_out(params)
        run["evals"].append({"step": prog.step, **{k: round(x, 4) for k, x in metrics.items()}})
        print(f"{name}: held-out", json.dumps(run["evals"][-1]), flush=True)
        if score < best[0]:
            best = (score, prog.step, params, metrics)
        good, last_eval = (params, m, v), time.perf_counter()

    # `timeout` and job runners stop a run with SIGTERM: leave through `finally` (and save).
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        with open(out / "log.jsonl", "w") as log:
            while prog.step < r.steps:
                elapsed = time.perf_counter() - t_start
                # (the first step's time is mostly compilation: not a guide to the next one)
                next_s = 2.0 * step_s if prog.step > 1 else 0.0
                if time_limit_s is not None and elapsed + next_s + 5.0 > time_limit_s:
                    print(f"{name}: stopping at step {prog.step}: time limit {time_limit_s:.0f}s")
                    break
                by_time = elapsed / time_limit_s if time_limit_s else 0.0
                progress = max(prog.step / r.steps, by_time)
                lr = lr_scale * learning_rate(r, prog.step, progress)
                t0 = time.perf_counter()
                batch = job.sample(train_ids, rng)
                t = mx.array(float(prog.step + 1))
                new = job.update(params, m, v, t, mx.array(lr), batch)
                mx.eval(new)
                if not math.isfinite(float(new[3])):
                    if run["rollbacks"] == MAX_ROLLBACKS:
                        print(f"{name}: loss not finite at step {prog.step + 1}; stopping")
                        break
                    run["rollbacks"] += 1
                    lr_scale *= 0.5
                    params, m, v = good
                    print(
                        f"{name}: loss not finite at step {prog.step + 1}; "
                        f"rolled back, lr x{lr_scale}"
                    )
                    continue
                params, m, v = new[0], new[1], new[2]
                step_s = time.perf_counter() - t0
                prog.step += 1
                prog.tokens += r.batch * r.seq_len
                prog.elapsed_s = time.perf_counter() - t_start
                prog.losses = {k: float(x) for k, x in zip(job.loss_names, new[3:], strict=True)}
                entry = {
                    "step": prog.step,
                    "lr": lr,
                    **{k: round(x, 4) for k, x in prog.losses.items()},
                    "step_s": round(step_s, 4),
                    "tok_s": round(r.batch * r.seq_len / step_s),
                    "elapsed_s": round(prog.elapsed_s, 1),
                }
                log.write(json.dumps(entry) + "\n")
                if prog.step % log_every == 0 or prog.step <= 3:
                    print(f"{name}:", json.dumps(entry), flush=True)
                    log.flush()
                if held_out is not None and time.perf_counter() - last_eval > eval_s:
                    evaluate()
                if time.perf_counter() - last_ckpt > checkpoint_s:
                    save_weights(params, out, save_dtype)
                    last_ckpt = time.perf_counter()
        if held_out is not None:
            evaluate()
    finally:
        signal.signal(signal.SIGTERM, previous)
        _, step, chosen, metrics = best if best[0] < math.inf else (0.0, prog.step, params, {})
        save_weights(chosen, out, save_dtype)
        run["progress"] = vars(prog)
        run["saved"] = {"step": step, **{f"heldout_{k}": x for k, x in metrics.items()}}
        run["total_s"] = round(time.perf_counter() - t_start, 1)
        (out / "run.json").write_text(json.dumps(run, indent=1))
    print(f"{name}: saved", json.dumps(run["saved"]), f"total {run['total_s']}s", flush=True)
    return prog


def train(recipe: Recipe, ids_path: Path, out: Path, opts: RunOptions) -> Progress:
    """Train the demo model `recipe` on the packed ids at `ids_path` (`fit`, selecting the
    weights by held-out loss); write weights and logs under `out`."""
    train_ids, heldout_ids, digest = load_ids(ids_path)
    hyper = Hyper.from_spec(recipe.spec)
    if int(train_ids.max()) >= hyper.vocab_size:
        raise ValueError(f"{ids_path}: ids reach {train_ids.max()}, vocab is {hyper.vocab_size}")
    dtype = getattr(mx, recipe.dtype)
    fwd = Forward(hyper, dtype, fused_attention=fused_attention_trains(hyper, dtype))
    job = Job(
        schedule=recipe,
        params=init_params(hyper, recipe.seed),
        update=make_step(fwd, recipe, opts.compile),
        loss_names=("loss", "mtp_loss"),
        sample=lambda ids, rng: sample_windows(ids, recipe.batch, recipe.seq_len + 2, rng),
        held_out=HeldOut(fwd, heldout_ids, recipe, opts.compile),
        run={
            "recipe": recipe.to_json(),
            "vocab_digest": digest,
            "fused_attention": fwd.fused_attention,
        },
    )
    return fit(job, train_ids, out, opts)
