"""Uniform shapes (a compiled runner's default on a GPU): once warmed up, a steady batch of
speculating slots compiles nothing new, step after step — not the trunk's verify forward,
not the MTP head's catch-up, not its draft chain — whatever each slot accepted and drafted.

On a GPU a forward of a batch shape not compiled yet costs tens to thousands of ms (MLX
traces and compiles it, the backend JIT-builds its kernels); an MTP round whose catch-up
width (the most any slot accepted), chain rows (which slots draft with the head) or chain
depth (the deepest draft) came straight from the step's drafts met a new shape nearly
every step. The model is the tiny preset with tied embeddings, whose greedy continuations
loop: prompt lookup gets accepted at ragged depths, and the slots it leaves to the MTP
head change from step to step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from test_spec import prompts

from engine.cache import SlotPool
from engine.generate import greedy_tokens
from engine.models.qwen35 import Model, load_model
from engine.runner import ModelRunner
from engine.sampling import RequestRng, SamplingParams
from engine.spec.drafters import Drafter, MTPDrafter, NgramDrafter
from engine.spec.offline import GREEDY, Request, generate
from engine.spec.speculator import DecodingSlot, Speculator

K = 4
N = 8
STEPS = 8  # (the longest slot stays within 64 positions: one past bucket)
HOT = SamplingParams(temperature=3.0)  # p and the random head's q both flat: ragged acceptance


@pytest.fixture(scope="module")
def model(make_model: Callable[..., Path]) -> Model:
    return load_model(make_model("tiny", quant="f32", tied_embeddings=True))


class Counted:
    """A speculator over a compiled runner with uniform shapes forced on (as on a GPU),
    counting the head's forwards of a shape not compiled yet (`ModelRunner.cold_steps`
    made inside `draft` and `draft_chain`)."""

    def __init__(self, model: Model, drafters: str = "ngram+mtp") -> None:
        pool = SlotPool(model.config, N, 192, mx.float32, max_draft=K)
        self.runner = runner = ModelRunner(model, pool, compile=True)
        runner.compile_after = 1  # every shape compiled at once: a miss is a new shape
        chosen: list[Drafter] = [NgramDrafter()] if "ngram" in drafters else []
        chosen.append(MTPDrafter(runner))
        self.spec = Speculator(runner, K, chosen)
        self.spec.use_uniform_shapes(True)  # as on a GPU
        self.mtp_cold = 0
        for name in ("draft", "draft_chain"):
            setattr(runner, name, self._counted(getattr(runner, name)))

    def _counted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            before = self.runner.cold_steps
            out = fn(*args, **kwargs)
            self.mtp_cold += self.runner.cold_steps - before
            return out

        return run

    def decode(self, seed: int) -> tuple[int, int, int]:
        """N slots prefilled together, then STEPS steps with all N speculating ("on"):
        (forwards of a new shape in the decode steps, of them the MTP head's, MTP drafts)."""
        spec, runner, pool = self.spec, self.runner, self.runner.pool
        chosen = prompts(N, seed)
        slots = [pool.allocate() for _ in chosen]
        rows = [spec.prefill_row(s, p, 0, "on") for s, p in zip(slots, chosen, strict=True)]
        states: list[DecodingSlot] = []
        for row, out, p in zip(rows, runner.step(rows).rows, chosen, strict=True):
            spec.prefilled(row, out)
            first = int(np.argmax(np.array(out.logits[-1])))
            params = HOT if len(states) % 2 else GREEDY
            rng = RequestRng(seed * N + len(states))
            states.append(DecodingSlot(row.slot, first, [*p, first], params, rng, "on"))
        cold, mtp_cold, mtp_drafts = runner.cold_steps, self.mtp_cold, 0
        for _ in range(STEPS):
            committed = spec.resolve(states, runner.step(spec.plan(states)).rows)
            for d, c in zip(states, committed, strict=True):
                d.history += c.tokens
                d.pending = c.tokens[-1]
                mtp_drafts += c.drafter == "mtp"
        for s in slots:
            spec.release(s)
            pool.free(s)
        return runner.cold_steps - cold, self.mtp_cold - mtp_cold, mtp_drafts


def test_a_warm_steady_batch_meets_no_new_compiled_shape(model: Model) -> None:
    """Runs of N slots on other prompts (other acceptances at every step) compile nothing
    new after the first: the MTP head meets three shapes in all — the prompts' catch-up,
    then every step one catch-up of K + 1 positions a row and one chain over every slot."""
    counted = Counted(model)
    cold, mtp_cold, mtp_drafts = counted.decode(0)
    assert mtp_cold == 3 and mtp_drafts > 0
    for seed in range(1, 8):
        cold, mtp_cold, mtp_drafts = counted.decode(seed)
        assert mtp_drafts > 0  # the head drafted in this run, beside prompt lookup
        assert (cold, mtp_cold) == (0, 0)


def test_uniform_mtp_rounds_keep_greedy_output(model: Model) -> None:
    """The catch-up filler and the chain's extra draws and riders are read by nothing:
    requests of every mode, some ending early (their chains shallower), decode what plain
    decoding does."""
    modes = ["on", "auto", "off", "on", "auto", "on", "off", "on"]
    requests = [
        Request(p, 12 + 3 * i, speculation=m)
        for i, (p, m) in enumerate(zip(prompts(N, 4), modes, strict=True))
    ]
    counted = Counted(model, drafters="mtp")
    run = generate(counted.spec, requests)
    assert run.tokens == [greedy_tokens(model, r.prompt, r.max_tokens) for r in requests]
    assert sum(s.verify_rounds for s in run.stats) > 0


class ColdDrafts:
    """Counts the MTP head's forwards (catch-ups and draft chains) of a shape not compiled
    yet, and the row counts its forwards met."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.cold, self.rows = runner, 0, set[int]()
        for name in ("draft", "draft_chain"):
            setattr(runner, name, self._counted(getattr(runner, name)))

    def _counted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(rows: Any, *args: Any) -> Any:
            before = self.runner.cold_steps
            out = fn(rows, *args)
            self.cold += self.runner.cold_steps - before
            self.rows.add(len(rows))
            return out

        return run


def test_precompiled_mtp_shapes_serve_a_drifting_batch_without_a_cold_draft(model: Model) -> None:
    """`Speculator.precompile` with an MTP drafter compiles the head's steady shapes too —
    its catch-up and its draft chains at every padded width, depth and past bucket — so
    requests that end one after another (4, 3, 2, 1 slots drafting: their rows padded to
    4, 4, 2, 1) across past buckets meet no head shape not compiled yet, their prompts'
    catch-ups included (rows of 64 tokens); greedy requests decode what plain decoding
    does. Without the precompile the same run meets cold head shapes."""
    slots, context = 4, 128
    # "on": every width drafts, whatever the cost controller would make of it on this CPU
    # (since session 15 a width that lost a slot borrows the wider one's costs instead of
    # probing, so under "auto" a width may run plain throughout)
    requests = [
        Request(
            p,
            n,
            params=GREEDY if i != 2 else SamplingParams(temperature=0.8, top_k=5),
            speculation="on",
        )
        for i, (p, n) in enumerate(zip(prompts(slots, 9), (100, 70, 40, 15), strict=True))
    ]
    cold_by_precompile = []
    for precompiled in (True, False):
        pool = SlotPool(model.config, slots, context, mx.float32, max_draft=K)
        runner = ModelRunner(model, pool, compile=True)
        spec = Speculator(runner, K, [MTPDrafter(runner)])
        spec.use_uniform_shapes(True)  # as on a GPU
        if precompiled:
            # widths 1, 2, 4 x past buckets 0, 64, 128: decode; verify at depths 1-4; the
            # catch-up of K + 1 tokens a row; of 64 (pasts 0, 64 only); chains 1 deep (no
            # past), 2 deep, 4 deep (pasts 64, 128), each greedy only, sampled, truncating
            # by top-k (candidates) and by top-p (a sort)
            mtp = 3 * 3 + 3 * 2 + (3 + 3 * 3 + 3 * 2) * 4
            assert spec.precompile() == 3 * 3 + K * 3 * 3 + mtp
            assert spec.precompile() == 0
        drafts = ColdDrafts(runner)
        run = generate(spec, requests)
        for r, tokens in zip(requests, run.tokens, strict=True):
            if r.params is GREEDY:
                assert tokens == greedy_tokens(model, r.prompt, r.max_tokens)
        assert {1, 2, 3, 4} <= drafts.rows  # the batch drifted through every width
        cold_by_precompile.append(drafts.cold)
    assert cold_by_precompile[0] == 0
    assert cold_by_precompile[1] > 0
