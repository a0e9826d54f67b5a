"""The MTP draft head matches llama.cpp's (MODEL_SPEC §10, §16.2) on f32 tiny models.

One scenario per preset, run once on both sides: prefill a prompt of T tokens with every
position's post-norm hidden h_t; run the MTP head on (x_{t+1}, h_t) at positions
t = 0..T-2; then chain a few draft steps that feed the head its own h' and its argmax token
at the next position, as a drafter does. llama.cpp is driven through `llama_mtp.LlamaMTP`.

Errors are relative per position: max |ours - ref| / max |ref| over the row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.generate import single_slot_runner
from engine.models.qwen35 import load_model
from engine.runner import DraftRow, Row

pytestmark = pytest.mark.llama

PROMPT = [int(t) for t in np.random.default_rng(35).integers(0, 512, size=24)]
CHAIN = 3  # chained draft steps after the prompt's rows
DRAFT_TOL = 1e-4
HIDDEN_TOL = 1e-5  # the trunk alone already matches to ~5e-7


@dataclass
class Side:
    """One implementation's outputs for the scenario."""

    hidden: np.ndarray  # [T, E] trunk post-norm hidden
    draft_logits: np.ndarray  # [T-1, V] MTP logits for rows (x_{t+1}, h_t) at t
    draft_hidden: np.ndarray  # [T-1, E] MTP h' of those rows
    chain_logits: list[np.ndarray] = field(default_factory=list)  # CHAIN x [V]
    chain_hidden: list[np.ndarray] = field(default_factory=list)  # CHAIN x [E]


def worst_rel(ours: np.ndarray, ref: np.ndarray) -> float:
    """Largest per-row max |ours - ref| / max |ref|."""
    ours, ref = np.atleast_2d(ours), np.atleast_2d(ref)
    return float((np.abs(ours - ref).max(-1) / np.abs(ref).max(-1)).max())


def chain_tokens(side: Side) -> list[int]:
    """The token each chained step feeds: the argmax of the step before it."""
    steps = [side.draft_logits[-1], *side.chain_logits[:-1]]
    return [int(np.argmax(s)) for s in steps]


def run_llama(path: Path) -> Side:
    from llama_mtp import LlamaMTP

    T = len(PROMPT)
    with LlamaMTP(path) as llama:
        _, hidden = llama.prefill(PROMPT)
        d_logits, d_hidden = llama.draft(PROMPT[1:], hidden[:-1], 0)
        side = Side(hidden, d_logits, d_hidden)
        prev, h = d_logits[-1], d_hidden[-1:]
        for k in range(CHAIN):
            lg, h = llama.draft([int(np.argmax(prev))], h, T - 1 + k)
            prev = lg[0]
            side.chain_logits.append(lg[0])
            side.chain_hidden.append(h[0])
    return side


def run_ours(path: Path, tokens: list[int]) -> Side:
    """Our engine on the same scenario, fed the chained tokens llama.cpp chose (`tokens`)."""
    T = len(PROMPT)
    runner = single_slot_runner(load_model(path), T + CHAIN)
    slot = runner.pool.allocate()
    trunk = runner.step([Row(slot, PROMPT, 0, want=range(T), want_hidden=True)]).rows[0]
    assert trunk.hidden is not None
    d_logits, d_hidden = runner.draft([DraftRow(slot, PROMPT[1:], trunk.hidden[:-1], 0)])[0]
    side = Side(np.array(trunk.hidden), np.array(d_logits), np.array(d_hidden))
    h: mx.array = d_hidden[-1:]
    for k, token in enumerate(tokens):
        lg, h = runner.draft([DraftRow(slot, [token], h, T - 1 + k)])[0]
        side.chain_logits.append(np.array(lg[0]))
        side.chain_hidden.append(np.array(h[0]))
    return side


@pytest.fixture(scope="module", params=["tiny", "tiny-moe", "demo-trained"])
def sides(request: pytest.FixtureRequest, make_model: Callable[..., Path]) -> tuple[Side, Side]:
    """(ours, llama.cpp) for one f32 preset, or the trained demo model as f32."""
    if request.param == "demo-trained":
        path: Path = request.getfixturevalue("demo_f32")
    else:
        path = make_model(request.param, quant="f32")
    ref = run_llama(path)
    return run_ours(path, chain_tokens(ref)), ref


def test_trunk_hidden_matches_llama_nextn_embeddings(sides: tuple[Side, Side]) -> None:
    ours, ref = sides
    assert worst_rel(ours.hidden, ref.hidden) <= HIDDEN_TOL


def test_draft_logits_match_llama_mtp_head_at_every_position(sides: tuple[Side, Side]) -> None:
    ours, ref = sides
    assert ours.draft_logits.shape == ref.draft_logits.shape
    assert worst_rel(ours.draft_logits, ref.draft_logits) <= DRAFT_TOL


def test_draft_hidden_matches_llama_mtp_hidden(sides: tuple[Side, Side]) -> None:
    ours, ref = sides
    assert worst_rel(ours.draft_hidden, ref.draft_hidden) <= DRAFT_TOL


def test_chained_drafts_match_llama(sides: tuple[Side, Side]) -> None:
    """Steps that feed h' back at the next position, on top of the rows already cached."""
    ours, ref = sides
    assert chain_tokens(ours) == chain_tokens(ref)
    for k in range(CHAIN):
        assert worst_rel(ours.chain_logits[k], ref.chain_logits[k]) <= DRAFT_TOL, f"step {k}"
        assert worst_rel(ours.chain_hidden[k], ref.chain_hidden[k]) <= DRAFT_TOL, f"step {k}"
