"""The MTP draft chain on the device (`ModelRunner.draft_chain`) draws what the per-depth
path (`MTPDrafter(on_device=False)`: one `ModelRunner.draft` and one host-side draw per
depth) draws: the same tokens from the same q with the same uniforms, and leaves the same
MTP K/V in the pool — for greedy and seeded sampled slots of different depths in one step,
through eager and compiled runners, round after round of real verification.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import SlotId, SlotPool, SlotSnapshot
from engine.models.qwen35 import Model, load_model
from engine.runner import BatchError, ChainRow, DraftRow, ModelRunner
from engine.sampling import RequestRng, SamplingParams, Shaping
from engine.spec.drafters import Draft, DraftJob, MTPDrafter
from engine.spec.offline import GREEDY
from engine.spec.speculator import DecodingSlot, Speculator

K = 4
ROUNDS = 6
WARM = SamplingParams(temperature=1.3, seed=1)  # a flat q: sampled drafts differ from greedy
TRUNCATED = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=2)
PENALIZED = SamplingParams(temperature=0.0, repetition_penalty=1.3)
# Per slot: (sampling, draft depth cap); the depths differ so chains end at different depths.
SLOTS = [(GREEDY, 4), (WARM, 1), (TRUNCATED, 3), (GREEDY, 2), (WARM, 4)]
# Paths that batch other row counts run other product kernels: on this CPU they agree to
# 1e-6; on the H200 one probability of 1,536 differed by 1.1e-6 (session 13).
ATOL = 1e-6 if mx.default_device() == mx.cpu else 1e-5


@pytest.fixture(scope="module")
def model(make_model: Callable[..., Path]) -> Model:
    return load_model(make_model("tiny", quant="f32"))


class RecordingMTPDrafter(MTPDrafter):
    """The real drafter, keeping every draft it hands out and what each slot's MTP K/V in
    the pool was right after it (the drafts' provisional entries included)."""

    def __init__(self, runner: ModelRunner, on_device: bool, uniform: bool) -> None:
        super().__init__(runner, on_device=on_device, uniform=uniform)
        self.rounds: list[list[Draft]] = []
        self.kv: list[list[SlotSnapshot]] = []
        self.catch_ups: list[int] = []  # the longest row of each catch-up forward
        draft = runner.draft

        def recording(rows: Sequence[DraftRow], ends: Sequence[int] | None = None) -> object:
            if ends is not None:  # (the per-depth path's deeper forwards pass none)
                self.catch_ups.append(max(len(r.tokens) for r in rows))
            return draft(rows, ends)

        runner.draft = recording  # type: ignore[method-assign]

    def draft(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        out = super().draft(jobs)
        self.rounds.append(out)
        self.kv.append([self.runner.pool.snapshot(j.d.slot) for j in jobs])
        return out


def decode(
    model: Model,
    on_device: bool,
    compile: bool,
    slots: Sequence[tuple[SamplingParams, int]],
    uniform: bool = False,
    chunk: int | None = None,
) -> tuple[RecordingMTPDrafter, list[list[int]], list[SlotId], SlotPool]:
    """ROUNDS speculative steps of every slot ("on", capped at its depth) after a prefill
    of a prompt of its own; the drafter, each slot's tokens, the slots, the pool.
    `uniform`: the drafter's uniform rounds (`MTPDrafter.uniform`); `chunk`: its longest
    catch-up row (`MTPDrafter.CHUNK`)."""
    pool = SlotPool(model.config, len(slots), 96, mx.float32, max_draft=K)
    runner = ModelRunner(model, pool, compile=compile)
    runner.compile_after = 1  # compiled: every shape's first step too, not only recurring ones
    drafter = RecordingMTPDrafter(runner, on_device=on_device, uniform=uniform)
    if chunk is not None:
        drafter.CHUNK = chunk
    spec = Speculator(runner, K, [drafter])
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 512, 5 + 3 * i)] for i in range(len(slots))]
    ids = [pool.allocate() for _ in slots]
    rows = [spec.prefill_row(s, p, 0, "on") for s, p in zip(ids, prompts, strict=True)]
    for row, out in zip(rows, runner.step(rows).rows, strict=True):
        spec.prefilled(row, out)
    states = [
        DecodingSlot(s, 7 + i, [*p, 7 + i], params, RequestRng(params.seed), "on", max_draft=k)
        for i, (s, p, (params, k)) in enumerate(zip(ids, prompts, slots, strict=True))
    ]
    for _ in range(ROUNDS):
        committed = spec.resolve(states, runner.step(spec.plan(states)).rows)
        for d, c in zip(states, committed, strict=True):
            d.history += c.tokens
            d.pending = c.tokens[-1]
    return drafter, [d.history for d in states], ids, pool


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_the_chain_draws_the_per_depth_paths_drafts_and_q(model: Model, compile: bool) -> None:
    chained, per_depth = decode(model, True, compile, SLOTS), decode(model, False, compile, SLOTS)
    assert_same_rounds(SLOTS, chained, per_depth)


def test_a_uniform_chain_draws_what_the_per_depth_path_draws(model: Model) -> None:
    """Uniform rounds (a compiled runner's default on a GPU): catch-up rows padded to K + 1,
    one chain over every slot, as deep as the deepest draft's bucket, a slot that drafts
    nothing (a depth cap of 0) riding along. What the padding computes is read by nothing
    and takes no uniform: the same drafts, q, outputs and MTP K/V as the per-depth path."""
    slots = [*SLOTS, (WARM, 0)]
    uniform = decode(model, True, True, slots, uniform=True)
    assert_same_rounds(slots, uniform, decode(model, False, True, slots))


def test_a_backlog_longer_than_a_chunk_is_caught_up_in_pieces(model: Model) -> None:
    """Uniform rounds feed a catch-up longer than `CHUNK` tokens in pieces of `CHUNK` (the
    prompts here, 5 to 20 tokens, in pieces of 6, the rest in rows of K + 1 with filler):
    the same drafts, q, outputs and MTP K/V as one ragged forward over every token."""
    slots = [*SLOTS, (WARM, 0)]
    pieces = decode(model, True, True, slots, uniform=True, chunk=6)
    # the prompts' catch-up: 3 forwards of 6-token rows and one of K + 1 (the longest
    # prompt's last 2 tokens); then one of K + 1 a round
    assert pieces[0].catch_ups == [6] * 3 + [K + 1] * ROUNDS
    assert_same_rounds(slots, pieces, decode(model, False, True, slots))


def test_an_all_greedy_chain_draws_argmaxes_and_hands_out_point_masses(model: Model) -> None:
    """When every chained slot is greedy the chain takes each depth's argmax (no distribution
    over the vocabulary) and hands out no q — a point mass, which acceptance builds itself:
    the per-depth path's tokens (its q one-hot at them), the same committed tokens and MTP
    K/V."""
    slots = [(GREEDY, 4), (GREEDY, 2), (GREEDY, 3), (GREEDY, 0)]
    for uniform in (False, True):
        chained = decode(model, True, True, slots, uniform=uniform)
        per_depth = decode(model, False, True, slots)
        for a_round, b_round in zip(chained[0].rounds, per_depth[0].rounds, strict=True):
            for a, b in zip(a_round, b_round, strict=True):
                assert a.tokens == b.tokens
                assert a.q is None
                if b.tokens:
                    assert b.q is not None
                    assert np.argmax(np.array(b.q), axis=-1).tolist() == a.tokens
        assert [len(d.tokens) for d in chained[0].rounds[0]] == [k for _, k in slots]
        assert chained[1] == per_depth[1]
        assert_same_kv(chained, per_depth)


Decoded = tuple[RecordingMTPDrafter, list[list[int]], list[SlotId], SlotPool]


def assert_same_rounds(
    slots: Sequence[tuple[SamplingParams, int]], got: Decoded, want: Decoded
) -> None:
    """Two `decode`s of `slots` drafted alike round after round (each slot its cap deep at
    first; sampled slots really sampling), committed the same tokens and left the same MTP
    K/V in the pool after every round and at the end."""
    chain, chain_out, _, _ = got
    ref, ref_out, _, _ = want
    assert [len(d.tokens) for d in chain.rounds[0]] == [k for _, k in slots]
    assert len(chain.rounds) == len(ref.rounds) == ROUNDS
    for a_round, b_round in zip(chain.rounds, ref.rounds, strict=True):
        for a, b in zip(a_round, b_round, strict=True):
            assert a.tokens == b.tokens
            if not a.tokens:  # a slot that drafts nothing
                assert a.q is None and b.q is None
                continue
            assert a.q is not None and b.q is not None
            np.testing.assert_allclose(np.array(a.q), np.array(b.q), rtol=0, atol=ATOL)
    # Sampled slots really sampled: some draft is not the argmax of its q.
    sampled = [d for r in chain.rounds for d, (p, _) in zip(r, slots, strict=True) if not p.greedy]
    assert any(
        t != int(np.argmax(np.array(d.q)[i]))
        for d in sampled
        if d.q is not None
        for i, t in enumerate(d.tokens)
    )
    assert chain_out == ref_out  # the same uniforms went to drafting and to acceptance
    assert_same_kv(got, want)


def assert_same_kv(got: Decoded, want: Decoded) -> None:
    """The two `decode`s left the same MTP K/V in the pool after every round and at the end."""
    chain, _, chain_slots, chain_pool = got
    ref, _, ref_slots, ref_pool = want
    after_drafts = zip(
        [x for r in chain.kv for x in r], [x for r in ref.kv for x in r], strict=True
    )
    at_end = zip(
        [chain_pool.snapshot(s) for s in chain_slots],
        [ref_pool.snapshot(s) for s in ref_slots],
        strict=True,
    )
    for x_snap, y_snap in [*after_drafts, *at_end]:
        assert x_snap.mtp_length == y_snap.mtp_length
        assert x_snap.mtp_kv is not None and y_snap.mtp_kv is not None
        for x, y in zip(x_snap.mtp_kv, y_snap.mtp_kv, strict=True):
            np.testing.assert_allclose(x, y, rtol=0, atol=ATOL)


def test_penalized_slots_draw_on_the_host_beside_chained_ones(model: Model) -> None:
    """A penalty reads the history the draft grows: such a slot keeps the per-depth path
    while the others of its step chain, and every slot drafts as the per-depth path does."""
    slots = [(PENALIZED, 4), *SLOTS[:3]]
    chain, chain_out, _, _ = decode(model, True, False, slots)
    ref, ref_out, _, _ = decode(model, False, False, slots)
    for a_round, b_round in zip(chain.rounds, ref.rounds, strict=True):
        assert [d.tokens for d in a_round] == [d.tokens for d in b_round]
    assert chain_out == ref_out


def test_a_chain_past_the_context_or_naming_a_slot_twice_is_refused(model: Model) -> None:
    """Nothing runs and the pool is unchanged: the same limits as `ModelRunner.draft`."""
    pool = SlotPool(model.config, 2, 16, mx.float32, max_draft=K)
    runner = ModelRunner(model, pool)
    slot = pool.allocate()
    hidden = mx.zeros((12, model.config.n_embd))
    logits, h = runner.draft([DraftRow(slot, list(range(1, 13)), hidden, 0)])[0]
    kv = pool.snapshot(slot)

    def row(start: int, depth: int) -> ChainRow:
        return ChainRow(slot, logits[-1:], h[-1:], start, depth, np.full(depth, 0.5))

    shaping = Shaping.of([GREEDY])
    with pytest.raises(BatchError, match="past the context"):
        runner.draft_chain([row(12, 6)], shaping)  # its deepest row would sit at 17
    with pytest.raises(BatchError, match="more than once"):
        runner.draft_chain([row(12, 2), row(12, 2)], Shaping.of([GREEDY, GREEDY]))
    assert pool.mtp_lengths[slot] == 12
    after = pool.snapshot(slot)
    assert kv.mtp_kv is not None and after.mtp_kv is not None
    for x, y in zip(kv.mtp_kv, after.mtp_kv, strict=True):
        np.testing.assert_array_equal(x, y)
    assert [len(t) for t, _ in runner.draft_chain([row(12, 5)], shaping)] == [5]  # fits: 16
