"""Train a DFlash drafter for a target GGUF on packed ids (`train.fit`), and export it with our
writer (`engine.dflash_writer.write_dflash`).

A step draws `batch` random training windows, runs the frozen target over them once for the
features (eagerly, or compiled), puts `anchors` blocks in each window at distinct random
positions and updates the drafter on their weighted draft cross-entropy (`dflash.DraftForward`).
The held-out check reports that loss and the mean accepted length (leading argmax drafts
equal to the text, out of block_size - 1) on fixed held-out windows and anchors; the weights
with the longest accepted length are saved. The run directory gets `weights-*.npz`,
`run.json` (the recipe, the drafter's DFlashSpec fields, the target) and `log.jsonl`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from tools.demo_model.data import file_vocab_digest, load_ids
from tools.demo_model.dflash import DFlashRecipe, DraftForward, init_drafter, load_target
from tools.demo_model.model import Forward, Params
from tools.demo_model.train import (
    Job,
    Progress,
    RunOptions,
    fit,
    held_out_windows,
    make_update,
    read_weights,
    sample_windows,
)

MAX_FILE_BYTES = 15 << 20  # what a GPU job may hand back per file
EVAL_WINDOWS = 16  # held-out windows; each holds `anchors` blocks


def sample_anchors(batch: int, length: int, r: DFlashRecipe, rng: np.random.Generator) -> mx.array:
    """`[batch, anchors]` distinct block starts per window, sorted, in 1 .. length - block_size
    (each block has context before it and its whole block of labels inside the window)."""
    starts = np.arange(1, length - r.block_size + 1)
    if r.anchors > starts.size:
        raise ValueError(f"{r.anchors} anchors do not fit windows of {length} tokens")
    rows = [np.sort(rng.choice(starts, r.anchors, replace=False)) for _ in range(batch)]
    return mx.array(np.stack(rows).astype(np.int32))


class Batches:
    """Training batches `(features, tokens, anchors)`; the target runs here, not under grad."""

    def __init__(self, draft: DraftForward, r: DFlashRecipe, compile: bool) -> None:
        self.r = r
        self.features = mx.compile(draft.features) if compile else draft.features

    def __call__(self, ids: np.ndarray, rng: np.random.Generator) -> tuple[mx.array, ...]:
        tokens = sample_windows(ids, self.r.batch, self.r.seq_len, rng)
        anchors = sample_anchors(self.r.batch, self.r.seq_len, self.r, rng)
        features = self.features(tokens)
        mx.eval(features)
        return features, tokens, anchors


class HeldOut:
    """(score, {loss, accept_len}) over fixed held-out windows and anchors."""

    def __init__(
        self, draft: DraftForward, ids: np.ndarray, r: DFlashRecipe, compile: bool
    ) -> None:
        rng = np.random.default_rng(4321)
        self.batches = []
        for tokens in held_out_windows(ids, r, r.seq_len, EVAL_WINDOWS):
            B, T = tokens.shape
            features = draft.features(tokens)
            mx.eval(features)
            self.batches.append((features, tokens, sample_anchors(B, T, r, rng)))
        self.losses = mx.compile(draft.losses) if compile else draft.losses

    def __call__(self, p: Params) -> tuple[float, dict[str, float]]:
        results = [self.losses(p, *b) for b in self.batches]
        loss = sum(float(a) for a, _ in results) / len(results)
        accepted = sum(float(b) for _, b in results) / len(results)
        # longest accepted length first; between equal ones (1/1024 steps), the lower loss
        return -accepted + 1e-4 * loss, {"loss": loss, "accept_len": accepted}


def drafter_spec(target: Path, r: DFlashRecipe, train_ids: np.ndarray) -> Any:
    """The `DFlashSpec` this recipe trains for the model file `target`. Its MASK token is the
    last token of the vocabulary that `train_ids` never use (a real token would tell the
    drafter something); the file's default (its padding token) when every token is used."""
    from engine.dflash_writer import DFlashSpec

    spec = DFlashSpec.for_file(target, **r.drafter_fields())
    unused = np.flatnonzero(np.bincount(train_ids, minlength=spec.n_vocab)[: spec.n_vocab] == 0)
    return dataclasses.replace(spec, mask_token_id=int(unused[-1])) if unused.size else spec


def dflash_train(
    recipe: DFlashRecipe, target: Path, ids_path: Path, out: Path, opts: RunOptions
) -> Progress:
    """Train `recipe`'s drafter for the model file `target` on the ids at `ids_path` (packed
    with the target's vocabulary); weights and logs go under `out`."""
    train_ids, heldout_ids, digest = load_ids(ids_path)
    if file_vocab_digest(target) != digest:
        raise ValueError(f"{ids_path}: not packed with the vocabulary of {target}")
    spec = drafter_spec(target, recipe, train_ids)
    hyper, target_params = load_target(target)
    dtype = getattr(mx, recipe.dtype)
    draft = DraftForward(spec, Forward(hyper, dtype), target_params, recipe.decay)

    def objective(p: Params, batch: tuple[mx.array, ...]) -> tuple[mx.array, tuple[mx.array, ...]]:
        loss, accepted = draft.losses(p, *batch)
        return loss, (loss, accepted)

    job = Job(
        schedule=recipe,
        params=init_drafter(spec, target_params, recipe.seed),
        update=make_update(objective, recipe.weight_decay, opts.compile),
        loss_names=("loss", "accept_len"),
        sample=Batches(draft, recipe, opts.compile),
        held_out=HeldOut(draft, heldout_ids, recipe, opts.compile) if opts.eval_s > 0 else None,
        run={
            "recipe": recipe.to_json(),
            "spec": dataclasses.asdict(spec),
            "target": str(target),
            "vocab_digest": digest,
        },
        name="dflash-train",
    )
    return fit(job, train_ids, out, opts)


def dflash_export(run: Path, out: Path | None = None) -> dict[str, Any]:
    """Write `run`'s drafter as a GGUF file (at most `MAX_FILE_BYTES`)."""
    from engine.dflash_writer import DFlashSpec, write_dflash

    info = json.loads((run / "run.json").read_text())
    fields = dict(info["spec"])
    fields["target_layers"] = tuple(fields["target_layers"])
    spec = DFlashSpec(**fields)
    path = out or run / f"{spec.name}.{spec.quant}.gguf"
    write_dflash(path, spec, read_weights(run))
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ValueError(f"{path}: {size} bytes > {MAX_FILE_BYTES}; use fewer layers or q8_0")
    return {"path": str(path), "bytes": size, "quant": spec.quant, "saved": info.get("saved")}
