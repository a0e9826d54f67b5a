"""The DFlash drafter's training recipe (tools/demo_model/dflash*.py) on a tiny target made by our
writer: train a few steps, export with our writer, load with the engine, and hold the engine's
drafter forward to the training forward. That equality is what makes a trained drafter draft
in serving what it learned in training."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import SlotPool
from engine.models.qwen35 import load_model
from engine.runner import ModelRunner, Row
from engine.spec.dflash import load_dflash
from engine.spec.drafters import DFlashDrafter
from tools.demo_model.data import file_vocab_digest
from tools.demo_model.dflash import DFLASH_RECIPES, DraftForward, block_mask, load_target
from tools.demo_model.dflash_train import dflash_export, dflash_train
from tools.demo_model.model import Forward
from tools.demo_model.train import RunOptions, load_weights

TOL = 1e-4
RECIPE = DFLASH_RECIPES["smoke"]


def phrase_ids(n: int, rng: np.random.Generator, phrases: list[np.ndarray]) -> np.ndarray:
    """`n` ids of random phrases one after another: after a phrase's first token the rest is
    predictable, so a drafter has something to learn in a few steps."""
    out: list[np.ndarray] = []
    while sum(p.size for p in out) < n:
        out.append(phrases[rng.integers(len(phrases))])
    return np.concatenate(out)[:n].astype(np.uint16)


@pytest.fixture(scope="module")
def run(
    tmp_path_factory: pytest.TempPathFactory, make_model: Callable[..., Path]
) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("dflash-train")
    target = make_model("tiny", quant="f32")
    rng = np.random.default_rng(0)
    phrases = [rng.integers(0, 500, rng.integers(5, 12)) for _ in range(24)]
    np.savez(
        root / "ids.npz",
        train=phrase_ids(20_000, rng, phrases),
        heldout=phrase_ids(2_000, rng, phrases),
        vocab_digest=np.array(file_vocab_digest(target)),
    )
    # eval_s ~0: the held-out score after every step, however fast the machine
    opts = RunOptions(eval_s=1e-9, save_dtype="float32", log_every=100, compile=False)
    prog = dflash_train(RECIPE, target, root / "ids.npz", root / "run", opts)
    return {
        "root": root,
        "target": target,
        "steps": prog.step,
        "export": dflash_export(root / "run", root / "drafter.gguf"),
    }


def test_training_lowers_the_draft_loss(run: dict[str, Any]) -> None:
    log = [json.loads(line) for line in (run["root"] / "run" / "log.jsonl").open()]
    assert len(log) == run["steps"] == RECIPE.steps
    assert log[-1]["loss"] < log[0]["loss"] - 1.0
    evals = json.loads((run["root"] / "run" / "run.json").read_text())["evals"]
    assert len(evals) >= RECIPE.steps and evals[-1]["loss"] < evals[0]["loss"]


def test_blocks_see_their_own_context_and_block_only() -> None:
    mask = np.array(block_mask(mx.array([[1, 3]]), 5, 2))[0, 0]
    assert mask.tolist() == [
        [True, False, False, False, False, True, True, False, False],
        [True, False, False, False, False, True, True, False, False],
        [True, True, True, False, False, False, False, True, True],
        [True, True, True, False, False, False, False, True, True],
    ]


def test_engine_draft_logits_equal_the_training_forward(run: dict[str, Any]) -> None:
    """Three anchors in one training forward against the engine's drafter, each anchor a
    slot whose context is the window before it, all drafted in one batched forward."""
    model = load_model(run["target"])
    dflash = load_dflash(run["export"]["path"], model)
    cfg = dflash.config
    S = cfg.block_size
    tokens = [int(t) for t in np.load(run["root"] / "ids.npz")["heldout"][: 40 + S]]
    anchors = [2, 17, 40]

    hyper, target = load_target(run["target"])
    draft = DraftForward(cfg, Forward(hyper), target, RECIPE.decay)
    window = mx.array([tokens])
    want = np.array(
        draft.logits(
            load_weights(run["root"] / "run"),
            draft.features(window),
            window,
            mx.array([anchors]),
        )[0]
    )

    runner = ModelRunner(model, SlotPool(model.config, 3, 64, mx.float32, max_draft=S - 1))
    drafter = DFlashDrafter(runner, dflash)
    slots = [runner.pool.allocate() for _ in anchors]
    rows = [
        Row(s, tokens[:a], 0, want=range(a), want_hidden=True, taps=cfg.target_layers)
        for s, a in zip(slots, anchors, strict=True)
    ]
    for s, out in zip(slots, runner.step(rows).rows, strict=True):
        assert out.hidden is not None and out.taps is not None
        drafter.begin(s)
        drafter.observe(s, 0, out.hidden, out.taps)
    drafter.catch_up(slots)
    starts = mx.array(anchors, dtype=mx.int32)
    got = np.array(
        dflash(
            mx.array([tokens[a] for a in anchors], dtype=mx.int32),
            starts,
            drafter.pool.read(slots),
            starts,
        )
    )
    assert got.shape == want.shape == (3, S, cfg.n_vocab)
    for g, w in zip(got, want, strict=True):
        assert np.abs(g - w).max() <= TOL * np.abs(w).max()
