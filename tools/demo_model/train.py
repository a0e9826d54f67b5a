"""Train the demo model on packed ids with MLX: one compiled step (forward, both losses,
backward, global-norm clipping, AdamW) per batch of random windows.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from tools.demo_model.config import Recipe
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
    main_loss: float = math.nan
    mtp_loss: float = math.nan


def learning_rate(r: Recipe, step: int, progress: float) -> float:
    """Linear warmup, then cosine from `lr` to `min_lr_ratio * lr` over `progress` in [0, 1]."""
    warm = min(1.0, (step + 1) / max(1, r.warmup))
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return r.lr * warm * (r.min_lr_ratio + (1.0 - r.min_lr_ratio) * cosine)


def make_step(fwd: Forward, r: Recipe, compile: bool = True) -> Callable[..., Any]:
    """The update: (params, m, v, t, lr, windows) -> (params, m, v, main loss, MTP loss).

    Gradients and the AdamW update are two compiled functions: compiled as one, MLX took
    ~100x longer to compile them (minutes on CPU) for no faster step. `compile=False` runs
    both eagerly: on MLX's CUDA backend the compiled gradient's first step took 337 s
    (its fused kernels are JIT-compiled one by one), more than a whole 300 s budget.
    """
    jit: Callable[[Any], Any] = mx.compile if compile else (lambda f: f)

    def objective(p: Params, window: mx.array) -> tuple[mx.array, tuple[mx.array, mx.array]]:
        main, mtp = fwd.losses(p, window)
        return main + r.mtp_weight * mtp, (main, mtp)

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
                update = update + r.weight_decay * w
            new_p[name] = w - lr * update
        return new_p, new_m, new_v

    def step(
        p: Params, m: Params, v: Params, t: mx.array, lr: mx.array, window: mx.array
    ) -> tuple[Params, Params, Params, mx.array, mx.array]:
        (_, (main, mtp)), grads = grad_fn(p, window)
        p, m, v = adamw(p, m, v, grads, t, lr)
        return p, m, v, main, mtp

    return step


def sample_windows(ids: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> mx.array:
    starts = rng.integers(0, ids.size - length, size=batch)
    return mx.array(ids[starts[:, None] + np.arange(length)].astype(np.int32))


class HeldOut:
    """Mean (main, MTP) loss over `EVAL_WINDOWS` fixed windows of the held-out ids."""

    def __init__(self, fwd: Forward, ids: np.ndarray, r: Recipe, compile: bool = True) -> None:
        length = min(r.seq_len, ids.size - 3) + 2
        rng = np.random.default_rng(1234)
        n = max(1, EVAL_WINDOWS // r.batch)
        self.batches = [
            sample_windows(ids, min(r.batch, EVAL_WINDOWS), length, rng) for _ in range(n)
        ]
        self.losses = mx.compile(fwd.losses) if compile else fwd.losses

    def __call__(self, p: Params) -> tuple[float, float]:
        total = [self.losses(p, w) for w in self.batches]
        n = len(total)
        return sum(float(a) for a, _ in total) / n, sum(float(b) for _, b in total) / n


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


def train(
    recipe: Recipe,
    ids_path: Path,
    out: Path,
    time_limit_s: float | None = None,
    checkpoint_s: float = 60.0,
    eval_s: float = 30.0,
    save_dtype: str = "float16",
    log_every: int = 10,
    compile: bool = True,
) -> Progress:
    """Train `recipe` on the packed ids at `ids_path`; write weights and logs under `out`.

    Every `eval_s` seconds (and at the end) the held-out loss is measured; the weights saved
    at the end are the best ones seen (the last ones when `eval_s` <= 0: no evaluation). A non-finite loss rolls back to the last good weights
    with half the learning rate (up to `MAX_ROLLBACKS` times).
    """
    t_start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    with np.load(ids_path) as z:
        train_ids, heldout_ids, digest = z["train"], z["heldout"], str(z["vocab_digest"])
    hyper = Hyper.from_spec(recipe.spec)
    if int(train_ids.max()) >= hyper.vocab_size:
        raise ValueError(f"{ids_path}: ids reach {train_ids.max()}, vocab is {hyper.vocab_size}")
    dtype = getattr(mx, recipe.dtype)
    fwd = Forward(hyper, dtype, fused_attention=fused_attention_trains(hyper, dtype))
    params = init_params(hyper, recipe.seed)
    m = {k: mx.zeros_like(w) for k, w in params.items()}
    v = {k: mx.zeros_like(w) for k, w in params.items()}
    step_fn = make_step(fwd, recipe, compile)
    held_out = HeldOut(fwd, heldout_ids, recipe, compile) if eval_s > 0 else None
    rng = np.random.default_rng(recipe.seed)
    prog = Progress()
    run: dict[str, Any] = {
        "recipe": recipe.to_json(),
        "vocab_digest": digest,
        "params": sum(w.size for w in params.values()),
        "device": str(mx.default_device()),
        "mlx": getattr(mx, "__version__", "?"),
        "fused_attention": fwd.fused_attention,
        "compiled": compile,
        "time_limit_s": time_limit_s,
        "evals": [],
        "rollbacks": 0,
    }
    print(f"train: {run['params'] / 1e6:.2f}M params, {train_ids.size} ids, {run['device']}")
    best: tuple[float, int, Params] = (math.inf, 0, params)
    good = (params, m, v)  # MLX arrays are immutable: keeping references copies nothing
    lr_scale, step_s = 1.0, 0.0
    last_ckpt = last_eval = time.perf_counter()

    def evaluate() -> None:
        nonlocal best, good, last_eval
        assert held_out is not None
        main_h, mtp_h = held_out(params)
        run["evals"].append(
            {"step": prog.step, "loss": round(main_h, 4), "mtp_loss": round(mtp_h, 4)}
        )
        print("train: held-out", json.dumps(run["evals"][-1]), flush=True)
        if main_h < best[0]:
            best = (main_h, prog.step, params)
        good, last_eval = (params, m, v), time.perf_counter()

    # `timeout` and job runners stop a run with SIGTERM: leave through `finally` (and save).
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        with open(out / "log.jsonl", "w") as log:
            while prog.step < recipe.steps:
                elapsed = time.perf_counter() - t_start
                # (the first step's time is mostly compilation: not a guide to the next one)
                next_s = 2.0 * step_s if prog.step > 1 else 0.0
                if time_limit_s is not None and elapsed + next_s + 5.0 > time_limit_s:
                    print(f"train: stopping at step {prog.step}: time limit {time_limit_s:.0f}s")
                    break
                by_time = elapsed / time_limit_s if time_limit_s else 0.0
                progress = max(prog.step / recipe.steps, by_time)
                lr = lr_scale * learning_rate(recipe, prog.step, progress)
                t0 = time.perf_counter()
                window = sample_windows(train_ids, recipe.batch, recipe.seq_len + 2, rng)
                t = mx.array(float(prog.step + 1))
                new = step_fn(params, m, v, t, mx.array(lr), window)
                mx.eval(new)
                if not math.isfinite(float(new[3])):
                    if run["rollbacks"] == MAX_ROLLBACKS:
                        print(f"train: loss not finite at step {prog.step + 1}; stopping")
                        break
                    run["rollbacks"] += 1
                    lr_scale *= 0.5
                    params, m, v = good
                    print(
                        f"train: loss not finite at step {prog.step + 1}; rolled back, lr x{lr_scale}"
                    )
                    continue
                params, m, v = new[0], new[1], new[2]
                step_s = time.perf_counter() - t0
                prog.step += 1
                prog.tokens += recipe.batch * recipe.seq_len
                prog.elapsed_s = time.perf_counter() - t_start
                prog.main_loss, prog.mtp_loss = float(new[3]), float(new[4])
                entry = {
                    "step": prog.step,
                    "lr": lr,
                    "loss": round(prog.main_loss, 4),
                    "mtp_loss": round(prog.mtp_loss, 4),
                    "step_s": round(step_s, 4),
                    "tok_s": round(recipe.batch * recipe.seq_len / step_s),
                    "elapsed_s": round(prog.elapsed_s, 1),
                }
                log.write(json.dumps(entry) + "\n")
                if prog.step % log_every == 0 or prog.step <= 3:
                    print("train:", json.dumps(entry), flush=True)
                    log.flush()
                if eval_s > 0 and time.perf_counter() - last_eval > eval_s:
                    evaluate()
                if time.perf_counter() - last_ckpt > checkpoint_s:
                    save_weights(params, out, save_dtype)
                    last_ckpt = time.perf_counter()
        if eval_s > 0:
            evaluate()
    finally:
        signal.signal(signal.SIGTERM, previous)
        loss, step, chosen = best if best[0] < math.inf else (math.nan, prog.step, params)
        save_weights(chosen, out, save_dtype)
        run["progress"] = vars(prog)
        run["saved"] = {"step": step, "heldout_loss": loss, "heldout_ppl": math.exp(loss)}
        run["total_s"] = round(time.perf_counter() - t_start, 1)
        (out / "run.json").write_text(json.dumps(run, indent=1))
    print("train: saved", json.dumps(run["saved"]), f"total {run['total_s']}s", flush=True)
    return prog
