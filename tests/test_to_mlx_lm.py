"""bench/to_mlx_lm.py: mlx-lm, run on the converted GGUF, computes the logits our engine does.

The benchmark's mlx-lm peer is only a fair comparison if it runs the same weights; these tests
run both engines through the benchmark's own contenders (bench/peers.py), two sequences in one
batch, prefill and greedy decode, and compare every step's logits.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mlx_lm", reason="mlx-lm is the bench extra: pip install -e '.[bench]'")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from peers import MlxLm, Ours
from to_mlx_lm import convert

CASES = {
    # tiny: Hk=2 < Hv=4, so the value heads are reordered; untied LM head
    "f32": {"quant": "f32"},
    "f32 tied": {"quant": "f32", "tied_embeddings": True},
    # dv=16 < the 32-wide quant group: ssm_out is dequantized, exactly
    "q8_0": {"quant": "q8_0"},
    # dv=32: ssm_out stays quantized, its input-column head blocks moved as packed words
    "q8_0 dv32": {"quant": "q8_0", "ssm_state_size": 32},
    # the 0.8B preset's layout: f16 file, padded vocabulary, tied head, 1 in 4 attention,
    # a quarter of each head rotated
    "0.8b-like": {
        "quant": "f16",
        "n_vocab": 1024,
        "tied_embeddings": True,
        "full_attention_interval": 4,
        "head_dim": 64,
        "rope_dim": 16,
        "ssm_group_count": 4,
    },
}


@pytest.mark.parametrize("case", CASES)
def test_mlx_lm_matches_ours_on_converted_weights(
    case: str, make_model: Callable[..., Path]
) -> None:
    path = make_model("tiny", **CASES[case])
    ours, theirs = Ours(path), MlxLm(path)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 500, 9)] for _ in range(2)]
    for c in (ours, theirs):
        c.start(2, 32)
    a, b = ours.prefill(prompts), theirs.prefill(prompts)
    assert_close(a, b)
    for _ in range(6):
        toks = [int(t) for t in np.argmax(a, axis=-1)]
        assert [int(t) for t in np.argmax(b, axis=-1)] == toks
        a, b = ours.decode(toks), theirs.decode(toks)
        assert_close(a, b)


def test_mlx_lm_prefills_in_pieces_as_at_once(
    make_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peer prefills a long prompt in pieces of `PREFILL_STEP` (8 prompts of 4,096 at
    once ran the H200 out of memory): the same logits as one forward, at a piece length
    that leaves a short last piece and at one that divides the prompt."""
    path = make_model("tiny", quant="f32")
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 500, 13)] for _ in range(2)]
    whole = MlxLm(path)
    whole.start(2, 32)
    want = whole.prefill(prompts)
    for step in (5, 4, 1):
        monkeypatch.setattr(MlxLm, "PREFILL_STEP", step)
        pieces = MlxLm(path)
        pieces.start(2, 32)
        np.testing.assert_allclose(pieces.prefill(prompts), want, rtol=1e-4, atol=1e-4)


def test_quantized_matrices_stay_quantized(make_model: Callable[..., Path], tmp_path: Path) -> None:
    import mlx.core as mx

    out = convert(make_model("tiny", quant="q8_0", ssm_state_size=32), tmp_path / "m")
    config: dict[str, Any] = json.loads((out / "config.json").read_text())
    weights = mx.load(str(out / "model.safetensors"))
    assert config["quantization"] == {"group_size": 32, "bits": 8}
    layer = "language_model.model.layers.0.linear_attn"
    assert weights[f"{layer}.out_proj.weight"].dtype == mx.uint32
    assert weights[f"{layer}.in_proj_qkv.scales"].shape[-1] == 64 // 32
    assert not any(k.startswith("language_model.mtp") or ".mtp." in k for k in weights)


def test_moe_file_is_refused(tiny_qwen35moe: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="only dense qwen35"):
        convert(tiny_qwen35moe, tmp_path / "m")


def assert_close(a: np.ndarray, b: np.ndarray) -> None:
    scale = float(np.max(np.abs(a)))
    assert float(np.max(np.abs(a - b))) <= 1e-4 * scale + 1e-5
