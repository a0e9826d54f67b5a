"""The DFlash drafter model: its GGUF file, the trunk taps it reads, and its batched
forward against a one-slot reference written here in numpy from the file's tensors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFWriter

from engine.cache import SlotId, SlotPool
from engine.dflash_writer import DFlashSpec, write_dflash
from engine.gguf import (
    MissingMetadataError,
    NotGGUFError,
    TensorFile,
    UnsupportedArchitectureError,
)
from engine.models.qwen35 import Model, load_model, rms_norm
from engine.runner import ModelRunner, Row
from engine.spec.dflash import DFlashTargetMismatchError, load_dflash, read_config
from engine.spec.drafters import DFlashDrafter

TAPS = (1, 3)


@pytest.fixture(scope="module")
def target(make_model: Callable[..., Path]) -> Model:
    return load_model(make_model("tiny", quant="f32", tied_embeddings=True))


@pytest.fixture(scope="module")
def drafter_path(make_dflash: Callable[..., Path]) -> Path:
    return make_dflash("tiny", n_layer=2, target_layers=TAPS)


def test_the_file_carries_the_drafters_configuration(drafter_path: Path) -> None:
    cfg = read_config(TensorFile(drafter_path))
    spec = DFlashSpec(n_layer=2, target_layers=TAPS)
    assert (cfg.block_size, cfg.target_layers, cfg.n_layer) == (8, TAPS, 2)
    assert (cfg.n_embd, cfg.n_vocab, cfg.mask_token_id) == (64, 512, spec.mask_token_id)
    assert (cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff) == (4, 2, 16, 128)


def test_loading_names_what_is_wrong(
    tmp_path: Path, target: Model, make_model: Callable[..., Path], drafter_path: Path
) -> None:
    with pytest.raises(UnsupportedArchitectureError, match="not a DFlash drafter"):
        load_dflash(make_model("tiny", quant="f32", tied_embeddings=True), target)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"nope" * 10)
    with pytest.raises(NotGGUFError):
        load_dflash(junk, target)
    other = load_model(make_model("tiny", quant="f32", n_embd=32, ssm_state_size=8))
    with pytest.raises(DFlashTargetMismatchError, match="hidden size 64"):
        load_dflash(drafter_path, other)
    bare = tmp_path / "bare.gguf"
    w = GGUFWriter(bare, "dflash")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(MissingMetadataError, match=r"dflash\.embedding_length"):
        load_dflash(bare, target)


def test_taps_are_each_layers_output_whatever_shares_the_batch(target: Model) -> None:
    """The last layer's tap, normed, is the trunk's hidden state; taps are batch-invariant."""
    runner = ModelRunner(target, SlotPool(target.config, 3, 64, mx.float32))
    a, b, c = (runner.pool.allocate() for _ in range(3))
    last = target.config.n_layer - 1
    prompt = [5, 9, 200, 3, 77, 41]
    alone = runner.step([Row(a, prompt, 0, want=range(6), want_hidden=True, taps=(1, last))])
    out = alone.rows[0]
    assert out.taps is not None and out.hidden is not None
    assert out.taps.shape == (6, 2 * target.config.n_embd)
    normed = rms_norm(out.taps[:, 64:], target.output_norm, target.config.rms_eps)
    np.testing.assert_allclose(np.array(normed), np.array(out.hidden), rtol=1e-5, atol=1e-5)
    together = runner.step(
        [
            Row(b, [1, 2, 3], 0, taps=(last,)),
            Row(c, prompt, 0, want=range(6), taps=(1, last)),
        ]
    ).rows
    assert together[0].taps is not None and together[0].taps.shape == (1, 64)
    np.testing.assert_allclose(np.array(together[1].taps), np.array(out.taps), atol=1e-5)


def reference_logits(
    path: Path, target_path: Path, features: np.ndarray, pending: int
) -> np.ndarray:
    """Block logits `[B, V]` of one slot, float64, straight from the files' tensors."""
    f, t = TensorFile(path), TensorFile(target_path)
    cfg = read_config(f)
    H, Hkv, D, B = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.block_size

    def w(name: str) -> np.ndarray:
        return f.load_numpy(name).astype(np.float64)

    def rms(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_eps) * weight

    def rope(x: np.ndarray, pos: np.ndarray) -> np.ndarray:  # x [T, heads, D], NeoX halves
        half = cfg.rope_dim // 2
        angle = pos[:, None] * cfg.rope_base ** (-2.0 * np.arange(half) / cfg.rope_dim)
        cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
        x1, x2 = x[..., :half], x[..., half : 2 * half]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half :]], -1)

    n = features.shape[0]
    ctx = rms(features.astype(np.float64) @ w("fc.weight").T, w("hidden_norm.weight"))
    table = t.load_numpy("token_embd.weight").astype(np.float64)
    x = table[[pending] + [cfg.mask_token_id] * (B - 1)]
    ctx_pos, block_pos = np.arange(n), n + np.arange(B)
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        a = rms(x, w(p + "attn_norm.weight"))
        qn, kn = w(p + "attn_q_norm.weight"), w(p + "attn_k_norm.weight")
        wk, wv = w(p + "attn_k.weight"), w(p + "attn_v.weight")
        q = rope(rms((a @ w(p + "attn_q.weight").T).reshape(B, H, D), qn), block_pos)
        k = np.concatenate(
            [
                rope(rms((ctx @ wk.T).reshape(n, Hkv, D), kn), ctx_pos),
                rope(rms((a @ wk.T).reshape(B, Hkv, D), kn), block_pos),
            ]
        )
        v = np.concatenate([ctx @ wv.T, a @ wv.T]).reshape(n + B, Hkv, D)
        o = np.zeros((B, H, D))
        for h in range(H):
            g = h // (H // Hkv)
            s = q[:, h] @ k[:, g].T / np.sqrt(D)
            e = np.exp(s - s.max(-1, keepdims=True))
            o[:, h] = (e / e.sum(-1, keepdims=True)) @ v[:, g]
        x = x + o.reshape(B, H * D) @ w(p + "attn_output.weight").T
        m = rms(x, w(p + "post_attention_norm.weight"))
        gate, up = m @ w(p + "ffn_gate.weight").T, m @ w(p + "ffn_up.weight").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w(p + "ffn_down.weight").T
    return rms(x, w("output_norm.weight")) @ table.T


def test_batched_block_forward_matches_a_one_slot_reference(
    target: Model, drafter_path: Path, make_model: Callable[..., Path]
) -> None:
    """Three slots of different context lengths, their context fed in two rounds each
    (so each round only adds new positions), drafted in ONE forward: each slot's block
    logits equal the reference over its whole context within 1e-4 relative."""
    runner = ModelRunner(target, SlotPool(target.config, 4, 64, mx.float32, max_draft=4))
    drafter = DFlashDrafter(runner, load_dflash(drafter_path, target))
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(0, 500, n)] for n in (5, 13, 21)]
    slots = [runner.pool.allocate() for _ in prompts]
    runner.pool.allocate()  # a gap in the slot ids
    features: list[list[np.ndarray]] = [[] for _ in prompts]
    for cut in (slice(0, 3), slice(3, None)):
        rows = [
            Row(s, p[cut], cut.start, want=range(len(p[cut])), want_hidden=True, taps=TAPS)
            for s, p in zip(slots, prompts, strict=True)
        ]
        for s, out, feats in zip(slots, runner.step(rows).rows, features, strict=True):
            assert out.hidden is not None and out.taps is not None
            if cut.start == 0:
                drafter.begin(s)
            drafter.observe(s, cut.start, out.hidden, out.taps)
            feats.append(np.array(out.taps))
        drafter.catch_up(slots)
    assert drafter.pool.lengths[: len(slots)] == [len(p) for p in prompts]
    pending = [11, 300, 42]
    logits = drafter.model(
        mx.array(pending, dtype=mx.int32),
        mx.array([len(p) for p in prompts], dtype=mx.int32),
        drafter.pool.read(slots),
        mx.array([len(p) for p in prompts], dtype=mx.int32),
    )
    tied = make_model("tiny", quant="f32", tied_embeddings=True)
    for row, feats, tok in zip(np.array(logits), features, pending, strict=True):
        ref = reference_logits(drafter_path, tied, np.concatenate(feats), tok)
        assert np.abs(row - ref).max() <= 1e-4 * np.abs(ref).max()


def test_a_slot_it_did_not_follow_from_the_start_gets_no_drafts(
    target: Model, drafter_path: Path
) -> None:
    runner = ModelRunner(target, SlotPool(target.config, 1, 64, mx.float32, max_draft=4))
    drafter = DFlashDrafter(runner, load_dflash(drafter_path, target))
    slot = SlotId(runner.pool.allocate())
    drafter.begin(slot)
    out = runner.step([Row(slot, [1, 2, 3], 0, want=range(3), want_hidden=True, taps=TAPS)])
    hidden, taps = out.rows[0].hidden, out.rows[0].taps
    assert hidden is not None and taps is not None
    drafter.observe(slot, 1, hidden, taps)  # positions 1.. without 0: a gap
    assert not drafter.needs_hidden(slot)


def test_a_drafter_made_for_a_target_file_loads_with_it(
    tmp_path: Path, make_model: Callable[..., Path]
) -> None:
    path = make_model("tiny", quant="f32", n_layer=6, n_embd=32, ssm_state_size=8, vocab_size=300)
    spec = DFlashSpec.for_file(path, n_layer=2)
    assert spec.target_layers == (1, 2, 4, 5) and spec.n_embd == 32
    write_dflash(tmp_path / "d.gguf", spec)
    drafter = load_dflash(tmp_path / "d.gguf", load_model(path))
    assert drafter.config.target_layers == spec.target_layers
    assert drafter.config.n_vocab == 300 and drafter.config.mask_token_id == spec.mask_token_id
