"""Export a training run as a GGUF file (our writer, the vocabulary inside), and the smoke
run that drives every step of the recipe end to end on CPU."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from engine.corpus import build_vocab
from engine.writer import ModelSpec, write_model
from tools.demo_model.config import RECIPES
from tools.demo_model.data import pack, vocab_digest, write_corpus, write_vocab
from tools.demo_model.model import to_gguf_weights
from tools.demo_model.train import RunOptions, read_weights, train

MAX_FILE_BYTES = 25_000_000


def spec_of_run(run: Path, quant: str | None = None) -> ModelSpec:
    """The ModelSpec a run trained (from its `run.json`), optionally with another quant."""
    spec = dict(json.loads((run / "run.json").read_text())["recipe"]["spec"])
    spec["rope_sections"] = tuple(spec["rope_sections"])
    if quant is not None:
        spec["quant"] = quant
    return ModelSpec(**spec)


def export(run: Path, out: Path | None = None, quant: str | None = None) -> dict[str, Any]:
    """Write `run`'s weights as a GGUF file; checks the vocabulary is the one ids were packed
    with and the file is at most `MAX_FILE_BYTES`."""
    info = json.loads((run / "run.json").read_text())
    spec = spec_of_run(run, quant)
    vocab = build_vocab(spec.vocab_size, spec.n_vocab)
    if vocab_digest(vocab.tokens, vocab.merges) != info["vocab_digest"]:
        raise ValueError(
            f"{run}: the vocabulary build_vocab({spec.vocab_size}) gives here is not the one "
            "the training ids were packed with (another Python stdlib or tokenizers version?)"
        )
    weights = to_gguf_weights(read_weights(run))
    path = out or run / f"{spec.name}.{spec.quant}.gguf"
    write_model(path, spec, weights)
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ValueError(f"{path}: {size} bytes > {MAX_FILE_BYTES}; use a smaller quant")
    return {"path": str(path), "bytes": size, "quant": spec.quant}


def smoke(root: Path) -> dict[str, Any]:
    """Every step on a small corpus subset with the `smoke` recipe; returns what each gave."""
    from tools.demo_model.report import report

    recipe = RECIPES["smoke"]
    data, run = root / "data", root / "run"
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "corpus": write_corpus(data, max_files=40),
        "vocab": write_vocab(data, recipe.spec["vocab_size"]),
        "pack": pack(data),
    }
    prog = train(recipe, data / "ids.npz", run, RunOptions(time_limit_s=120.0))
    result["train"] = dataclasses.asdict(prog)
    result["export"] = export(run)
    result["report"] = report(Path(result["export"]["path"]), data, quick=True)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result
