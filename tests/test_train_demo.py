"""The demo model's training recipe, end to end in its smoke mode (tools/demo_model):
corpus subset -> vocabulary -> packed ids -> MLX training -> GGUF export -> report.

The exported file is the check on the training math: our engine and llama.cpp read it and
must compute what the training forward computed.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from conftest import llama_cpp_model

from engine.generate import greedy_tokens, prefill_logits, single_slot_runner
from engine.models.qwen35 import load_model
from engine.runner import DraftRow, Row
from tools.demo_model.data import load_ids
from tools.demo_model.export import export, smoke
from tools.demo_model.model import Forward, Hyper, causal_attention, plain_causal_attention
from tools.demo_model.train import load_weights

TOL = 1e-4


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("demo-smoke")
    result = smoke(root)
    result["root"] = root
    return result


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def held_out_window(run: dict[str, Any], n: int = 96) -> list[int]:
    _, heldout, _ = load_ids(run["root"] / "data" / "ids.npz")
    return [int(t) for t in heldout[:n]]


def training_forward(run: dict[str, Any]) -> tuple[Forward, dict[str, mx.array]]:
    info = json.loads((run["root"] / "run" / "run.json").read_text())
    fwd = Forward(Hyper.from_spec(info["recipe"]["spec"]))
    return fwd, load_weights(run["root"] / "run")


def test_smoke_training_lowers_the_loss(run: dict[str, Any]) -> None:
    log = [json.loads(line) for line in (run["root"] / "run" / "log.jsonl").open()]
    assert len(log) == run["train"]["step"] > 10
    first, last = log[0], log[-1]
    assert last["loss"] < first["loss"] - 0.5
    assert last["mtp_loss"] < first["mtp_loss"] - 0.5


def test_engine_logits_equal_the_training_forward(run: dict[str, Any]) -> None:
    tokens = held_out_window(run)
    fwd, p = training_forward(run)
    hidden = fwd.trunk(p, mx.array([tokens]))
    want = np.array(fwd.logits(p, hidden)[0])
    model = load_model(run["export"]["path"])
    assert rel_err(prefill_logits(model, tokens), want) <= TOL


def test_engine_mtp_draft_logits_equal_the_training_forward(run: dict[str, Any]) -> None:
    """The MTP head as trained (token t+1 with hidden t at position t) is the engine's."""
    tokens = held_out_window(run)
    fwd, p = training_forward(run)
    hidden = fwd.trunk(p, mx.array([tokens]))
    want = np.array(fwd.logits(p, fwd.mtp(p, hidden[:, :-1], mx.array([tokens[1:]])))[0])
    runner = single_slot_runner(load_model(run["export"]["path"]), len(tokens))
    slot = runner.pool.allocate()
    trunk = runner.step([Row(slot, tokens, 0, want=range(len(tokens)), want_hidden=True)])
    ours_hidden = trunk.rows[0].hidden
    assert ours_hidden is not None
    draft, _ = runner.draft([DraftRow(slot, tokens[1:], ours_hidden[:-1], 0)])[0]
    assert rel_err(np.array(draft), want) <= TOL


@pytest.mark.llama
def test_llama_cpp_reads_the_exported_file_as_our_engine_does(run: dict[str, Any]) -> None:
    tokens = held_out_window(run, 64)
    path = run["export"]["path"]
    llm = llama_cpp_model(path)
    llm.eval(tokens)
    ref = np.array(llm.scores[: len(tokens)])
    model = load_model(path)
    assert rel_err(prefill_logits(model, tokens), ref) <= TOL
    ours = greedy_tokens(model, tokens, 8)
    llm.reset()
    theirs = [t for _, t in zip(range(8), llm.generate(tokens, temp=0.0), strict=False)]
    assert ours == theirs


def test_report_measures_perplexity_and_mtp_acceptance(run: dict[str, Any]) -> None:
    rep = run["report"]
    vocab = run["vocab"]["vocab_size"]
    assert 1.0 < rep["heldout_ppl"] < vocab  # better than a uniform guess
    assert {(m["k"], m["temperature"]) for m in rep["mtp"]} == {
        (1, 0.0),
        (1, 0.7),
        (2, 0.0),
        (2, 0.7),
    }
    for m in rep["mtp"]:
        assert m["acceptance"] is not None and 0.0 <= m["acceptance"] <= 1.0
        assert math.isfinite(m["tokens_per_step"]) and m["tokens_per_step"] >= 1.0
    assert all(s["prompt"] and s["greedy"] for s in rep["samples"])


def test_export_refuses_weights_packed_with_another_vocabulary(
    run: dict[str, Any], tmp_path: Path
) -> None:
    other = tmp_path / "run"
    shutil.copytree(run["root"] / "run", other)
    info = json.loads((other / "run.json").read_text())
    info["vocab_digest"] = "0" * 64
    (other / "run.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match="vocabulary"):
        export(other, tmp_path / "x.gguf")


def test_plain_attention_fallback_equals_the_fused_kernel() -> None:
    """What `train` falls back to where the fused kernel cannot be differentiated."""
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal((2, 4, 20, 16)).astype(np.float32))
    k = mx.array(rng.standard_normal((2, 2, 20, 16)).astype(np.float32))
    v = mx.array(rng.standard_normal((2, 2, 20, 16)).astype(np.float32))
    fused = np.array(causal_attention(q, k, v, 0.25))
    assert rel_err(np.array(plain_causal_attention(q, k, v, 0.25)), fused) <= 1e-5


def test_the_eager_step_is_the_compiled_step(run: dict[str, Any]) -> None:
    """`--no-compile` (what the CUDA backend needs: its JIT of the compiled gradient took
    longer than the whole time budget) trains the same math."""
    from tools.demo_model.config import RECIPES
    from tools.demo_model.train import make_step

    fwd, params = training_forward(run)
    window = mx.array([held_out_window(run, 34)])
    zeros = {k: mx.zeros_like(w) for k, w in params.items()}
    t, lr = mx.array(1.0), mx.array(1e-3)
    outs = [
        make_step(fwd, RECIPES["smoke"], compile)(params, zeros, zeros, t, lr, window)
        for compile in (True, False)
    ]
    (p1, _, _, main1, mtp1), (p2, _, _, main2, mtp2) = outs
    assert abs(float(main1) - float(main2)) <= 1e-5 * abs(float(main2))
    assert abs(float(mtp1) - float(mtp2)) <= 1e-5 * abs(float(mtp2))
    for name, w in p2.items():
        assert float(mx.abs(p1[name] - w).max()) <= 1e-5 * max(float(mx.abs(w).max()), 1.0)
