"""Our forward against llama.cpp's on the same f32 files: every position, prefill and decode.

llama.cpp runs with an F32 KV cache so the comparison is tight (MODEL_SPEC §16.4).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import llama_cpp_model

from engine.cache import SlotPool
from engine.generate import greedy_tokens, prefill_logits
from engine.models.qwen35 import load_model
from engine.runner import ModelRunner, Row

pytestmark = pytest.mark.llama

TOL = 1e-4

# (preset, overrides): qwen35 with Hk != Hv and GQA; MoE; Qwen3-Next's grouped heads and
# fused ssm_ba; an IM-RoPE section layout that leaves some rotary pairs unrotated (§16.1);
# and the shipped demo model, trained (as an f32 copy: `demo_f32`).
CASES = {
    "qwen35": ("tiny", {}),
    "qwen35moe": ("tiny-moe", {}),
    "qwen3next": ("tiny-next", {}),
    "qwen35-partial-mrope": ("tiny", {"rope_sections": (1, 1, 1, 1)}),
    "demo-trained": ("", {}),
}


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def prompt(n: int, vocab: int, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


@pytest.fixture(scope="module", params=list(CASES))
def model_path(request: pytest.FixtureRequest, make_model: Callable[..., Path]) -> Path:
    if request.param == "demo-trained":
        path: Path = request.getfixturevalue("demo_f32")
        return path
    name, overrides = CASES[request.param]
    return make_model(name, quant="f32", **overrides)


def llama_logits(path: Path, tokens: list[int]) -> np.ndarray:
    llm = llama_cpp_model(path)
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)])


def test_prefill_logits_match_llama_cpp_at_every_position(model_path: Path) -> None:
    model = load_model(model_path)
    tokens = prompt(48, model.config.n_vocab)
    ours = prefill_logits(model, tokens)
    ref = llama_logits(model_path, tokens)
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) <= TOL


def test_chunked_prefill_then_decode_match_llama_cpp(model_path: Path) -> None:
    """Prefill in uneven chunks, then one token per step: same logits as one llama.cpp prefill."""
    model = load_model(model_path)
    tokens = prompt(40, model.config.n_vocab, seed=2)
    runner = ModelRunner(model, SlotPool(model.config, 1, 64, kv_dtype=mx.float32))
    slot = runner.pool.allocate()
    pieces = [tokens[:13], tokens[13:20], *[[t] for t in tokens[20:]]]
    ours, at = [], 0
    for piece in pieces:
        out = runner.step([Row(slot, piece, at, want=range(len(piece)))])
        ours.append(np.array(out.rows[0].logits))
        at += len(piece)
    assert rel_err(np.concatenate(ours), llama_logits(model_path, tokens)) <= TOL


def test_greedy_continuation_equals_llama_cpp(model_path: Path) -> None:
    model = load_model(model_path)
    tokens = prompt(16, model.config.n_vocab, seed=3)
    ours = greedy_tokens(model, tokens, 64)
    llm = llama_cpp_model(model_path, logits_all=False)
    ref: list[int] = []
    for tok in llm.generate(tokens, temp=0.0, top_k=1, reset=True):
        ref.append(int(tok))
        if len(ref) == 64:
            break
    assert ours == ref
