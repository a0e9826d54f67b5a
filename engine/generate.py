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
from engine.sampling import RequestRng, SamplingParams
from engine.spec.speculator import sample_rows
from engine.tokenizer import Tokenizer


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
    """Stream the text of one continuation of `prompt` (greedy at temperature 0), sampled
    by the engine's own sampler so it matches a served request with the same seed."""
    f = GGUFFile(path)
    tok = Tokenizer.from_metadata(f.metadata, str(path))
    model = Model(f)
    text = tok.render_chat([{"role": "user", "content": prompt}]) if chat else prompt
    ids = tok.encode(text)
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    runner = single_slot_runner(model, len(ids) + max_tokens)
    slot = runner.pool.allocate()
    params = SamplingParams(temperature=temperature, seed=seed)
    params.validate(model.config.n_vocab)
    rng = RequestRng(seed)
    detok = tok.detokenizer()
    history = list(ids)
    logits = runner.step([Row(slot, ids, 0)]).rows[0].logits[-1:]
    for _ in range(max_tokens):
        (nxt,), _ = sample_rows(logits, [params], [history], [rng])
        if nxt in tok.eog_ids:
            break
        history.append(nxt)
        yield detok.push(nxt)
        logits = runner.step([Row(slot, [nxt], runner.pool.lengths[slot])]).rows[0].logits[-1:]
    yield detok.flush()
