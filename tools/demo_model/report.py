"""What a trained file does, measured with our engine on held-out text: perplexity, greedy
samples, and MTP draft acceptance at K = 1 and 2, temperature 0 and 0.7, through the
engine's speculative path (engine/spec/offline.py), as the server would run it."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.cache import SlotPool
from engine.generate import prefill_logits
from engine.gguf import GGUFFile
from engine.models.qwen35 import Model
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.spec.drafters import MTPDrafter
from engine.spec.offline import Request, generate
from engine.spec.speculator import Speculator
from engine.tokenizer import Tokenizer
from tools.demo_model.data import file_vocab_digest, load_ids


def held_out_perplexity(model: Model, ids: np.ndarray, window: int, n_windows: int) -> float:
    """exp(mean next-token NLL) over `n_windows` windows spread evenly over the split (its
    first files alone are not typical: on the shipped model the first 16 windows gave a
    perplexity of 10.2, 32 spread windows 5.7)."""
    nll, count = 0.0, 0
    n = min(n_windows, ids.size // window)
    for w in range(n):
        start = w * (ids.size - window) // (n - 1) if n > 1 else 0
        tokens = ids[start : start + window].astype(np.int64)
        logits = mx.array(prefill_logits(model, tokens.tolist())[:-1])
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        target = mx.array(tokens[1:])[:, None]
        nll -= float(mx.take_along_axis(logp, target, axis=-1).sum())
        count += tokens.size - 1
    return math.exp(nll / count)


def prompts_from(ids: np.ndarray, n: int, length: int, eot: int) -> list[list[int]]:
    """`n` held-out prompts of `length` tokens spread over the split, none crossing a file
    end (a window that would starts again after the file's last token)."""
    out: list[list[int]] = []
    for i in range(n):
        start = i * (ids.size - length) // n
        while start + length <= ids.size:
            ends = np.flatnonzero(ids[start : start + length] == eot)
            if not ends.size:
                out.append([int(t) for t in ids[start : start + length]])
                break
            start += int(ends[-1]) + 1
    return out


def acceptance(
    model: Model, prompts: list[list[int]], k: int, temperature: float, gen: int
) -> dict[str, Any]:
    """MTP drafts of depth k on every step ("on"), all prompts batched; acceptance summed."""
    context = max(len(p) for p in prompts) + gen + k + 1
    runner = ModelRunner(model, SlotPool(model.config, len(prompts), context, max_draft=k))
    spec = Speculator(runner, k, [MTPDrafter(runner)])
    params = SamplingParams(temperature=temperature)
    reqs = [Request(p, gen, params, speculation="on", seed=i) for i, p in enumerate(prompts)]
    run = generate(spec, reqs)
    drafted = sum(s.drafted for s in run.stats)
    accepted = sum(s.accepted for s in run.stats)
    rounds = sum(s.verify_rounds for s in run.stats)
    return {
        "k": k,
        "temperature": temperature,
        "acceptance": accepted / drafted if drafted else None,
        "accepted_per_round": accepted / rounds if rounds else None,
        "tokens_per_step": sum(len(t) for t in run.tokens)
        / max(1, sum(s.steps for s in run.stats)),
        "tokens": run.tokens,
    }


def report(path: Path, data: Path, quick: bool = False) -> dict[str, Any]:
    """Measure the model file at `path` on the held-out split packed in `data/ids.npz`."""
    t0 = time.perf_counter()
    f = GGUFFile(path)
    tok = Tokenizer.from_metadata(f.metadata, str(path))
    _, heldout, digest = load_ids(data / "ids.npz")
    if file_vocab_digest(path) != digest:
        raise ValueError(f"{path}: its vocabulary is not the one {data}/ids.npz was packed with")
    model = Model(f)
    window, n_windows = (128, 2) if quick else (512, 32)
    n_prompts, prompt_len, gen = (2, 16, 8) if quick else (8, 64, 64)
    eot = tok.bos_id if tok.bos_id is not None else -1
    prompts = prompts_from(heldout, n_prompts, prompt_len, eot)
    out: dict[str, Any] = {
        "model": str(path),
        "bytes": path.stat().st_size,
        "heldout_tokens_scored": min(n_windows, heldout.size // window) * (window - 1),
        "heldout_ppl": held_out_perplexity(model, heldout, window, n_windows),
    }
    runs = [acceptance(model, prompts, k, t, gen) for k in (1, 2) for t in (0.0, 0.7)]
    greedy = runs[0]["tokens"]  # speculation leaves greedy output unchanged (tests/test_spec.py)
    out["samples"] = [
        {"prompt": tok.decode(p), "greedy": tok.decode(g)}
        for p, g in zip(prompts, greedy, strict=True)
    ]
    out["mtp"] = [{k: v for k, v in r.items() if k != "tokens"} for r in runs]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out
