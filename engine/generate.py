"""One sequence, start to end: the `logits` and `generate` commands and the parity tests.

Runs on the same pool and runner as the batched engine (N = 1 is not a
separate path), with a one-slot pool sized for the request.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.cache import SlotPool
from engine.gguf import GGUFFile
from engine.models.qwen35 import Model
from engine.runner import ModelRunner, Row


def single_slot_runner(model: Model, context: int, kv_dtype: mx.Dtype = mx.float32) -> ModelRunner:
    return ModelRunner(model, SlotPool(model.config, 1, context, kv_dtype=kv_dtype))


def prefill_logits(model: Model, tokens: Sequence[int], chunk: int = 512) -> np.ndarray:
    """float32 logits `[T, vocab]` at every position of one prefill (in chunks of `chunk`)."""
    runner = single_slot_runner(model, len(tokens))
    slot = runner.pool.allocate()
    out = []
    for at in range(0, len(tokens), chunk):
        part = list(tokens[at : at + chunk])
        res = runner.step([Row(slot, part, at, want=range(len(part)))])
        out.append(np.array(res.rows[0].logits))
    return np.concatenate(out, axis=0)


def greedy_tokens(model: Model, prompt: Sequence[int], n: int) -> list[int]:
    """n greedy tokens after one prefill of `prompt`, decoding one token per step."""
    runner = single_slot_runner(model, len(prompt) + n)
    slot = runner.pool.allocate()
    logits = runner.step([Row(slot, list(prompt), 0)]).rows[0].logits
    out: list[int] = []
    for _ in range(n):
        tok = int(np.argmax(np.array(logits[-1])))
        out.append(tok)
        logits = runner.step([Row(slot, [tok], runner.pool.lengths[slot])]).rows[0].logits
    return out


def generate_text(
    path: str | Path,
    prompt: str,
    max_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    chat: bool = False,
) -> Iterator[str]:
    """Stream the text of one continuation of `prompt` (greedy at temperature 0)."""
    f = GGUFFile(path)
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(f.metadata, str(path))
    model = Model(f)
    text = tok.render_chat([{"role": "user", "content": prompt}]) if chat else prompt
    ids = tok.encode(text)
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    runner = single_slot_runner(model, len(ids) + max_tokens)
    slot = runner.pool.allocate()
    rng = np.random.default_rng(seed)
    detok = tok.detokenizer()
    logits = runner.step([Row(slot, ids, 0)]).rows[0].logits[-1]
    for _ in range(max_tokens):
        nxt = _sample(np.array(logits), temperature, rng)
        if nxt in tok.eog_ids:
            break
        yield detok.push(nxt)
        logits = runner.step([Row(slot, [nxt], runner.pool.lengths[slot])]).rows[0].logits[-1]
    yield detok.flush()


def _sample(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return int(rng.choice(len(p), p=p / p.sum()))
