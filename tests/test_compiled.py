"""`ModelRunner(compile=True)` — what every GPU benchmark runs — against the eager runner:
the same rows through both give the same logits, hidden states, pool state after capture and
rollback, and MTP drafts (CPU, f32; mx.compile fuses elementwise chains, so within 1e-5)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_pool import snapshots_equal

from engine.cache import PoolError, SlotPool
from engine.models.qwen35 import Model, load_model
from engine.runner import BatchError, DraftRow, ModelRunner, Row, StepOutput


@pytest.fixture(scope="module")
def model(make_model: Callable[..., Path]) -> Model:
    return load_model(make_model("tiny", quant="f32"))


def _close(a: mx.array, b: mx.array) -> bool:
    x, y = np.array(a), np.array(b)
    return x.shape == y.shape and bool(np.allclose(x, y, rtol=1e-5, atol=1e-5))


def _same_outputs(a: StepOutput, b: StepOutput) -> bool:
    for ra, rb in zip(a.rows, b.rows, strict=True):
        if not _close(ra.logits, rb.logits):
            return False
        if (ra.hidden is None) != (rb.hidden is None):
            return False
        if ra.hidden is not None and rb.hidden is not None and not _close(ra.hidden, rb.hidden):
            return False
    return True


def test_compiled_steps_verify_rollback_and_drafts_equal_eager(model: Model) -> None:
    runners = [
        ModelRunner(model, SlotPool(model.config, 3, 160, mx.float32, max_draft=4), compile=c)
        for c in (False, True)
    ]
    runners[1].compile_after = 1  # every shape below compiled at its first step
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(0, 512, n)] for n in (9, 3, 70)]
    slots = [[r.pool.allocate() for _ in prompts] for r in runners]

    def both(rows: Callable[[ModelRunner, list[int]], list[Row]]) -> list[StepOutput]:
        outs = [r.step(rows(r, s)) for r, s in zip(runners, slots, strict=True)]
        assert _same_outputs(*outs)
        return outs

    # Ragged prefill (the 70-token prompt crosses a past bucket later), hidden wanted.
    both(lambda r, s: [Row(x, p, 0, want_hidden=True) for x, p in zip(s, prompts, strict=True)])
    for step in range(3):  # decode; the second slot sits out one step
        both(
            lambda r, s, step=step: [
                Row(x, [11 + step], r.pool.lengths[x]) for i, x in enumerate(s) if i != step
            ]
        )
    # A verify row with capture beside a decode row, then rollback to two kept positions.
    both(
        lambda r, s: [
            Row(s[0], [5, 6, 7, 8], r.pool.lengths[s[0]], capture=True, want=range(4)),
            Row(s[2], [9], r.pool.lengths[s[2]], want_hidden=True),
        ]
    )
    for r, s in zip(runners, slots, strict=True):
        r.pool.rollback(s[0], keep=2)
    both(lambda r, s: [Row(x, [3], r.pool.lengths[x]) for x in s])
    for i in range(3):
        assert snapshots_equal(
            runners[0].pool.snapshot(slots[0][i]), runners[1].pool.snapshot(slots[1][i]), 1e-5
        )

    # MTP drafts: a catch-up row over a prompt, then chained one-token rows (two shapes).
    hidden = mx.array(rng.normal(size=(8, model.config.n_embd)).astype(np.float32))
    drafts = [
        r.draft([DraftRow(s[2], prompts[2][1:9], hidden, 0)])
        for r, s in zip(runners, slots, strict=True)
    ]
    for k in range(3):
        for (lg, h), (lg2, h2) in zip(drafts[0], drafts[1], strict=True):
            assert _close(lg, lg2) and _close(h, h2)
        drafts = [
            r.draft([DraftRow(s[2], [4 + k], d[0][1][-1:], 8 + k)])
            for r, s, d in zip(runners, slots, drafts, strict=True)
        ]
    assert runners[1].cached_forwards > 0


def test_compiled_runners_read_long_pasts_in_doubling_bands(model: Model) -> None:
    """Multiples of 64 up to 512 for every runner; beyond, a compiled runner rounds to a power
    of two (a long context meets a new compiled shape each time it doubles, not every 64
    tokens); never past the pool's context."""
    pool = SlotPool(model.config, 1, 3000, mx.float32)
    eager, compiled = ModelRunner(model, pool), ModelRunner(model, pool, compile=True)
    for start, want_eager, want_compiled in [
        (0, 0, 0),
        (1, 64, 64),
        (500, 512, 512),
        (513, 576, 1024),
        (1500, 1536, 2048),
        (2900, 2944, 3000),
    ]:
        assert eager.past_for(start) == want_eager
        assert compiled.past_for(start) == want_compiled
    shapes = {compiled.past_for(s) for s in range(3000)}
    assert len(shapes) == 1 + 8 + 3  # 0; 64 .. 512 by 64; then 1024, 2048, 3000


def test_a_batch_shape_is_compiled_when_it_comes_back(model: Model) -> None:
    """A compiled runner runs a shape's first step eagerly and keeps nothing (a ragged
    prefill's shape seldom recurs: compiling it would cost its request the tracing); the
    second time it compiles and keeps it; the third time it only runs it. Every step counts
    in `cold_steps` until the shape is compiled. The outputs agree throughout."""
    pool = SlotPool(model.config, 1, 64, mx.float32)
    runner = ModelRunner(model, pool, compile=True)
    slot = pool.allocate()

    def prefill(n: int) -> np.ndarray:
        pool.reset(slot)
        return np.array(runner.step([Row(slot, list(range(1, n + 1)), 0)]).rows[0].logits)

    first = prefill(5)
    assert (runner.cold_steps, runner.cached_forwards) == (1, 0)
    second = prefill(5)
    assert (runner.cold_steps, runner.cached_forwards) == (2, 1)
    third = prefill(5)
    assert (runner.cold_steps, runner.cached_forwards) == (2, 1)
    np.testing.assert_allclose(second, first, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(third, first, rtol=1e-5, atol=1e-5)
    prefill(6)  # another shape: eager again, nothing more kept
    assert (runner.cold_steps, runner.cached_forwards) == (3, 1)


def test_decode_and_verify_shapes_are_compiled_at_once(model: Model) -> None:
    """A decode step's shape (and a verify step's: rows of at most K + 1 tokens, one length)
    recurs step after step: it is compiled the first time, with no eager step before."""
    pool = SlotPool(model.config, 2, 64, mx.float32, max_draft=3)
    runner = ModelRunner(model, pool, compile=True)
    slots = [pool.allocate() for _ in range(2)]
    runner.step([Row(s, [1, 2, 3, 4, 5, 6], 0) for s in slots])  # 6 > K + 1: a prefill
    assert (runner.cold_steps, runner.cached_forwards) == (1, 0)
    runner.step([Row(s, [7], 6) for s in slots])
    assert (runner.cold_steps, runner.cached_forwards) == (2, 1)
    runner.step([Row(s, [8, 9, 10, 11], 7, capture=True) for s in slots])
    assert (runner.cold_steps, runner.cached_forwards) == (3, 2)
    pool.rollback_many([(s, 1) for s in slots])
    runner.step([Row(s, [12], 8) for s in slots])
    assert (runner.cold_steps, runner.cached_forwards) == (3, 2)


@pytest.mark.parametrize("compile", [False, True])
def test_decoding_on_device_tokens_without_waiting_equals_the_plain_loop(
    model: Model, compile: bool
) -> None:
    """Each step launched on the previous step's argmax as a device array and adopted whole
    at once (`launch`, `adopt`: queued, not waited for), the host reading a step's tokens
    only after queueing the next — the loop `step_roofline.py --overlap` runs: the same
    tokens, logits and slot state as feeding host tokens and waiting, for rows of different
    lengths."""
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7]]
    runs = []
    for overlap in (False, True):
        pool = SlotPool(model.config, 3, 64, mx.float32)
        runner = ModelRunner(model, pool, compile=compile)
        slots = [pool.allocate() for _ in prompts]
        out = runner.step([Row(s, p, 0) for s, p in zip(slots, prompts, strict=True)])
        logits = mx.concatenate([r.logits for r in out.rows])
        tokens: list[list[int]] = [[] for _ in slots]
        steps: list[np.ndarray] = []
        if overlap:
            tok = mx.argmax(logits, axis=-1)
            for _ in range(6):
                out = runner.adopt(runner.launch(slots, tok), range(len(slots)))
                logits = mx.concatenate([r.logits for r in out.rows])
                nxt = mx.argmax(logits, axis=-1)
                mx.async_eval(nxt)
                for row, t in zip(tokens, tok.tolist(), strict=True):
                    row.append(t)
                steps.append(np.array(logits))
                tok = nxt
        else:
            for _ in range(6):
                toks = mx.argmax(logits, axis=-1).tolist()
                for row, t in zip(tokens, toks, strict=True):
                    row.append(t)
                rows = [Row(s, [t], pool.lengths[s]) for s, t in zip(slots, toks, strict=True)]
                out = runner.step(rows)
                logits = mx.concatenate([r.logits for r in out.rows])
                steps.append(np.array(logits))
        runs.append((tokens, steps, [pool.snapshot(s) for s in slots]))
    (tokens_a, steps_a, snaps_a), (tokens_b, steps_b, snaps_b) = runs
    assert tokens_a == tokens_b
    assert all(
        np.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(steps_a, steps_b, strict=True)
    )
    assert all(snapshots_equal(a, b, atol=1e-5) for a, b in zip(snaps_a, snaps_b, strict=True))


def test_a_launch_that_cannot_run_is_refused_and_changes_nothing(model: Model) -> None:
    """Tokens of the wrong shape, a slot twice, a full context: `BatchError` / `PoolError`
    before anything is queued, every slot as it was."""
    pool = SlotPool(model.config, 2, 4, mx.float32)
    runner = ModelRunner(model, pool)
    a, b = pool.allocate(), pool.allocate()
    runner.step([Row(a, [1, 2, 3, 4], 0), Row(b, [3], 0)])  # slot a's context is full
    before = [pool.snapshot(s) for s in (a, b)]
    with pytest.raises(BatchError, match="tokens of shape"):
        runner.launch([b], mx.array([5, 6]))
    with pytest.raises(BatchError, match="more than once"):
        runner.launch([b, b], mx.array([5, 6]))
    with pytest.raises(PoolError):
        runner.launch([a, b], mx.array([5, 6]))
    assert all(snapshots_equal(x, pool.snapshot(s)) for x, s in zip(before, (a, b), strict=True))


def test_a_launched_step_changes_nothing_until_adopted_and_then_only_its_kept_rows(
    model: Model,
) -> None:
    """`launch` queues a decode step without touching the pool; `adopt` writes the rows kept
    (in the order asked) exactly as a step of those rows alone would — their logits and, when
    asked for, hidden states — and leaves the others' slots as they were. A slot that moved
    since the launch is refused."""
    prompts = [[3, 1, 4], [1, 5, 9, 2], [6, 5]]
    pools = [SlotPool(model.config, 3, 32, mx.float32) for _ in range(2)]
    runners = [ModelRunner(model, pool) for pool in pools]
    slots = [[pool.allocate() for _ in prompts] for pool in pools]
    for runner, ss in zip(runners, slots, strict=True):
        runner.step([Row(s, p, 0) for s, p in zip(ss, prompts, strict=True)])
    tokens = [7, 8, 9]
    runner, pool, ss = runners[0], pools[0], slots[0]
    before = [pool.snapshot(s) for s in ss]
    pending = runner.launch(ss, mx.array(tokens), want_hidden=True)
    mx.eval(pending.logits)
    assert all(snapshots_equal(b, pool.snapshot(s)) for b, s in zip(before, ss, strict=True))
    out = runner.adopt(pending, [2, 0])  # rows 2 and 0, in that order; row 1 dropped
    want = runners[1].step(
        [Row(slots[1][2], [9], 2, want_hidden=True), Row(slots[1][0], [7], 3, want_hidden=True)]
    )
    for got, ref in zip(out.rows, want.rows, strict=True):
        assert _close(got.logits, ref.logits)
        assert got.hidden is not None and ref.hidden is not None  # (what a drafter follows)
        assert _close(got.hidden, ref.hidden)
    for a, b in [(ss[0], slots[1][0]), (ss[2], slots[1][2])]:
        assert snapshots_equal(pool.snapshot(a), pools[1].snapshot(b), atol=1e-6)
    assert snapshots_equal(before[1], pool.snapshot(ss[1]))
    pending = runner.launch(ss[:2], mx.array([1, 2]))
    runner.step([Row(ss[0], [4], pool.lengths[ss[0]])])  # slot 0 moves on
    kept = pool.snapshot(ss[1])
    with pytest.raises(BatchError, match="moved"):
        runner.adopt(pending, [1, 0])
    assert snapshots_equal(kept, pool.snapshot(ss[1]))


def test_precompiled_verify_shapes_serve_speculation_without_a_cold_step(model: Model) -> None:
    """`precompile_verify` compiles the verify step of every padded width, past bucket and
    draft depth without touching the pool; a speculator with uniform verify steps (as on a
    GPU) then decodes with n-gram drafts at several depths and widths compiling nothing
    but its prompts' prefill, with the tokens of an eager runner."""
    from engine.spec.drafters import NgramDrafter
    from engine.spec.offline import Request, generate
    from engine.spec.speculator import Speculator

    depth = 3
    runs = []
    for compiled in (False, True):
        pool = SlotPool(model.config, 3, 130, mx.float32, max_draft=depth)
        runner = ModelRunner(model, pool, compile=compiled)
        runner.pad_widths = compiled  # as on a GPU: widths padded to 1, 2, 4, 8, ...
        if compiled:
            with pytest.raises(BatchError, match="verify depth 4"):
                runner.precompile_verify([depth + 1])
            slot = pool.allocate()
            runner.step([Row(slot, [5, 6, 7], 0)])
            before = pool.snapshot(slot)
            assert runner.precompile_decode() == 3 * 4  # widths 1, 2, 3 x pasts 0-130
            # each depth's rows fit at most 128 positions before: pasts 0, 64, 128
            assert runner.precompile_verify(range(1, depth + 1)) == depth * 3 * 3
            assert runner.precompile_verify([2]) == 0
            assert snapshots_equal(pool.snapshot(slot), before)
            pool.free(slot)
        spec = Speculator(runner, depth, [NgramDrafter()], uniform_verify=True)
        loop = [7, 8, 9, 10, 11, 12] * 4  # n-gram drafts find the loop again and again
        requests = [
            Request(loop[:17], 90, speculation="on"),
            Request([*loop[2:12], 3, 4], 40, speculation="on"),
            Request([1, 2, 3] * 5, 60, speculation="on"),
        ]
        cold = runner.cold_steps
        run = generate(spec, requests)
        depths = {k for st in run.stats for k, n in st.choices.items() if k and n}
        runs.append((run.tokens, runner.cold_steps - cold, depths))
    (eager_tokens, _, _), (tokens, cold_steps, depths) = runs
    assert tokens == eager_tokens
    assert len(depths) > 1  # verify steps of more than one depth were met
    assert cold_steps == 1  # the prefill of the three prompts, run eagerly


def test_precompiled_decode_shapes_meet_no_cold_step_and_change_nothing(model: Model) -> None:
    """`precompile_decode` compiles every decode width and past bucket the pool can meet
    without touching it; decode steps afterwards — through `step` and through `launch` /
    `adopt`, at every width, across past buckets — compile nothing, and give the logits an
    eager runner gives."""
    eager = ModelRunner(model, SlotPool(model.config, 3, 130, mx.float32))
    runner = ModelRunner(model, SlotPool(model.config, 3, 130, mx.float32), compile=True)
    assert eager.precompile_decode() == 0  # nothing to compile in an eager runner
    slot = runner.pool.allocate()
    runner.step([Row(slot, [5, 6, 7], 0)])
    before = runner.pool.snapshot(slot)
    made = runner.precompile_decode()
    assert made == 3 * 4  # widths 1-3 x pasts 0, 64, 128, 130
    assert snapshots_equal(runner.pool.snapshot(slot), before)
    assert runner.precompile_decode() == 0
    runner.pool.free(slot)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, 512, 60)] for _ in range(3)]
    for r in (eager, runner):  # prefills: their shapes are not decode shapes
        for s, p in zip([r.pool.allocate() for _ in prompts], prompts, strict=True):
            r.step([Row(s, p, 0)])
    cold = runner.cold_steps
    tok = 9
    for n in range(70):  # lengths 60 .. 129: past buckets 64 and 128 and 130, all widths
        width = 1 + n % 3
        outs = []
        for r in (eager, runner):
            rows = [Row(s, [tok], r.pool.lengths[s]) for s in range(width)]
            if r is runner and n % 2:
                pending = r.launch(list(range(width)), mx.array([tok] * width, dtype=mx.int32))
                outs.append(r.adopt(pending, range(width)))
            else:
                outs.append(r.step(rows))
        assert _same_outputs(*outs)
        if width < 3:  # keep every slot's length within the context
            for r in (eager, runner):
                for s in range(width, 3):
                    r.step([Row(s, [tok], r.pool.lengths[s])])
        tok = int(mx.argmax(outs[0].rows[0].logits[-1]))
    assert runner.cold_steps - cold == 0
