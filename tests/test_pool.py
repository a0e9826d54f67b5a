"""The slot pool: capture and exact rollback, fork/snapshot/restore, accounting, and errors
that leave the pool unchanged."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import (
    ContextOverflowError,
    PoolError,
    PoolExhaustedError,
    SlotId,
    SlotPool,
    SlotSnapshot,
    SlotStateError,
)
from engine.models.qwen35 import Model, load_model
from engine.runner import BatchError, ModelRunner, Row

K = 4  # draft depth


@pytest.fixture(scope="module")
def model(make_model: Callable[..., Path]) -> Model:
    return load_model(make_model("tiny", quant="f32"))


def new_runner(model: Model, n_slots: int = 4, context: int = 64) -> ModelRunner:
    return ModelRunner(model, SlotPool(model.config, n_slots, context, mx.float32, max_draft=K))


def snapshots_equal(a: SlotSnapshot, b: SlotSnapshot, atol: float = 0.0) -> bool:
    if (a.length, a.mtp_length) != (b.length, b.mtp_length):
        return False
    pairs = [(x, y) for p, q in zip(a.kv, b.kv, strict=True) for x, y in zip(p, q, strict=True)]
    pairs += list(zip(a.conv + a.ssm, b.conv + b.ssm, strict=True))
    if (a.mtp_kv is None) != (b.mtp_kv is None):
        return False
    if a.mtp_kv is not None and b.mtp_kv is not None:
        pairs += list(zip(a.mtp_kv, b.mtp_kv, strict=True))
    return all(
        np.allclose(x, y, rtol=0, atol=atol) if atol else np.array_equal(x, y) for x, y in pairs
    )


def prefilled(model: Model) -> tuple[ModelRunner, SlotId]:
    """A fresh runner with one slot fed six tokens."""
    runner = new_runner(model)
    slot = runner.pool.allocate()
    runner.step([Row(slot, [4, 8, 15, 16, 23, 42], 0)])
    return runner, slot


def decode(runner: ModelRunner, slot: SlotId, first: int, n: int) -> list[int]:
    out, tok = [], first
    for _ in range(n):
        logits = runner.step([Row(slot, [tok], runner.pool.lengths[slot])]).rows[0].logits
        tok = int(mx.argmax(logits[-1]).item())
        out.append(tok)
    return out


@pytest.mark.parametrize("accepted", range(K + 1))
def test_rollback_equals_feeding_only_the_accepted_tokens(model: Model, accepted: int) -> None:
    prompt = [3, 17, 99, 250, 7, 11, 42]
    drafts = [5, 81, 300, 12]
    runner = new_runner(model)
    spec, ref = runner.pool.allocate(), runner.pool.allocate()
    # A verify row beside an ordinary prefill row in the same step, as in serving.
    runner.step([Row(spec, prompt[:-1], 0), Row(ref, prompt[:-1], 0)])
    runner.step([Row(spec, [prompt[-1], *drafts], len(prompt) - 1, capture=True)])
    runner.pool.rollback(spec, keep=1 + accepted)
    runner.step([Row(ref, [prompt[-1], *drafts[:accepted]], len(prompt) - 1)])

    assert snapshots_equal(runner.pool.snapshot(spec), runner.pool.snapshot(ref), atol=1e-5)
    nxt = 77
    assert decode(runner, spec, nxt, 6) == decode(runner, ref, nxt, 6)


def test_random_verify_rounds_track_a_replay_of_accepted_tokens(model: Model) -> None:
    rng = np.random.default_rng(0)
    runner = new_runner(model, n_slots=6, context=256)
    pool = runner.pool
    pairs = [(pool.allocate(), pool.allocate()) for _ in range(3)]
    for spec, ref in pairs:
        runner.step([Row(spec, [1, 2, 3], 0), Row(ref, [1, 2, 3], 0)])
    for _ in range(25):
        rows, accepts = [], []
        for spec, _ in pairs:
            k = int(rng.integers(0, K + 1))
            toks = [int(t) for t in rng.integers(0, 512, k + 1)]
            rows.append(Row(spec, toks, pool.lengths[spec], capture=True))
            accepts.append(int(rng.integers(1, k + 2)))
        runner.step(rows)
        replay = []
        for (spec, ref), row, keep in zip(pairs, rows, accepts, strict=True):
            pool.rollback(spec, keep)
            replay.append(Row(ref, list(row.tokens[:keep]), pool.lengths[ref]))
        runner.step(replay)
    for spec, ref in pairs:
        assert snapshots_equal(pool.snapshot(spec), pool.snapshot(ref), atol=1e-5)


def test_rollback_without_a_capture_row_is_refused(model: Model) -> None:
    runner = new_runner(model)
    slot = runner.pool.allocate()
    runner.step([Row(slot, [1, 2], 0)])
    with pytest.raises(SlotStateError):
        runner.pool.rollback(slot, 1)


def test_snapshot_restore_and_fork_round_trip_exactly(model: Model) -> None:
    runner = new_runner(model)
    pool = runner.pool
    a = pool.allocate()
    runner.step([Row(a, [4, 8, 15, 16, 23, 42], 0)])
    snap = pool.snapshot(a)
    b, c = pool.allocate(), pool.allocate()
    pool.restore(snap, b)
    pool.fork(a, c)
    assert snapshots_equal(pool.snapshot(b), snap)
    assert snapshots_equal(pool.snapshot(c), snap)
    assert decode(runner, a, 9, 5) == decode(runner, b, 9, 5) == decode(runner, c, 9, 5)


def test_a_device_copy_has_buffers_of_its_own_and_keeps_the_slot_as_it_was(
    model: Model,
) -> None:
    """`copy` queues copies and waits for nothing; what it copied is the slot at the time,
    whatever the pool does next. Its buffers are its own: MLX's own copy of a contiguous
    view (`mx.contiguous`) may share the pool's buffer, which would keep every later write
    into the pool from reusing it. (Whether it shares is MLX's call: an assertion that it
    did held alone and failed once in a full clean-clone run, session 11.)"""
    runner, a = prefilled(model)
    pool = runner.pool
    before = pool.snapshot(a)
    copy = pool.copy(a)
    mx.eval(copy.parts)
    wholes = [
        w for w in (pool.k, pool.v, pool.conv, pool.ssm, pool.mtp_k, pool.mtp_v) if w is not None
    ]
    for part in copy.parts:
        assert not any(np.shares_memory(np.asarray(part), np.asarray(w)) for w in wholes)
    decode(runner, a, 9, 3)  # the slot moves on
    after = copy.to_host()
    assert snapshots_equal(after, before) and after.nbytes == before.nbytes == copy.nbytes
    assert not snapshots_equal(pool.snapshot(a), before)


def test_a_device_copy_restores_exactly_and_one_of_another_layout_is_refused(
    model: Model,
) -> None:
    """The prefix cache keeps device copies and restores from them (no host transfer):
    exact, whatever the source slot did since, into a pool of another context length too;
    a copy whose arrays do not fit the pool (another K/V dtype) changes nothing."""
    runner, a = prefilled(model)
    pool = runner.pool
    want = pool.snapshot(a)
    copy = pool.copy(a)
    decode(runner, a, 9, 3)  # the source slot moves on
    b, c = pool.allocate(), pool.allocate()
    pool.restore(copy, b)
    pool.restore(want, c)
    assert snapshots_equal(pool.snapshot(b), want)
    assert decode(runner, b, 9, 5) == decode(runner, c, 9, 5)
    longer = new_runner(model, n_slots=2, context=96)
    d = longer.pool.allocate()
    longer.pool.restore(pool.copy(c), d)
    assert snapshots_equal(longer.pool.snapshot(d), pool.snapshot(c))

    half = ModelRunner(model, SlotPool(model.config, 2, 64, mx.float16, max_draft=K))
    e = half.pool.allocate()
    half.step([Row(e, [1, 2, 3], 0)])
    before = pool.snapshot(b)
    with pytest.raises(SlotStateError, match="another model"):
        pool.restore(half.pool.copy(e), b)
    assert snapshots_equal(pool.snapshot(b), before)


def test_a_bfloat16_pool_snapshots_and_restores_bit_exactly(model: Model) -> None:
    pool = SlotPool(model.config, 2, 64, mx.bfloat16, max_draft=K)
    runner = ModelRunner(model, pool)
    a = pool.allocate()
    runner.step([Row(a, [4, 8, 15, 16], 0)])
    snap = pool.snapshot(a)
    b = pool.allocate()
    pool.restore(snap, b)
    assert snapshots_equal(pool.snapshot(b), snap)
    assert mx.array_equal(pool.k[:, a, :4], pool.k[:, b, :4]).item()
    assert mx.array_equal(pool.v[:, a, :4], pool.v[:, b, :4]).item()


def test_pool_bytes_match_the_accounting(model: Model) -> None:
    pool = SlotPool(model.config, 3, 40, mx.float16, max_draft=K)
    assert pool.total_bytes == 3 * pool.bytes_for(40, 0)
    runner = ModelRunner(model, pool)
    slot = pool.allocate()
    runner.step([Row(slot, [1, 2, 3, 4, 5], 0, capture=True)])
    cap = pool._captures[slot]
    held = sum(c.windows.nbytes + c.states.nbytes for c in cap.captures)  # its one row
    assert held == pool.bytes_for(40, K) - pool.bytes_for(40, 0)


def test_exhausted_pool_raises_and_changes_nothing(model: Model) -> None:
    runner = new_runner(model, n_slots=2)
    pool = runner.pool
    a, b = pool.allocate(), pool.allocate()
    runner.step([Row(a, [1, 2, 3], 0), Row(b, [4], 0)])
    before = [pool.snapshot(s) for s in (a, b)]
    with pytest.raises(PoolExhaustedError):
        pool.allocate()
    assert pool.free_slots == 0
    assert all(snapshots_equal(pool.snapshot(s), x) for s, x in zip((a, b), before, strict=True))


@pytest.mark.parametrize(
    ("row", "error"),
    [
        (lambda s: Row(s, list(range(1, 40)), 3), ContextOverflowError),  # past max_context
        (lambda s: Row(s, [1], 0), SlotStateError),  # wrong start
        (lambda s: Row(s, [1] * (K + 2), 3, capture=True), PoolError),  # deeper than max_draft
        (lambda s: Row(s, [10**6], 3), BatchError),  # token outside the vocabulary
        (lambda s: Row(s, [], 3), BatchError),  # empty row
    ],
)
def test_bad_rows_raise_and_change_nothing(
    model: Model, row: Callable[[SlotId], Row], error: type[Exception]
) -> None:
    runner = new_runner(model, context=32)
    pool = runner.pool
    a, b = pool.allocate(), pool.allocate()
    runner.step([Row(a, [1, 2, 3], 0), Row(b, [5, 6, 7], 0)])
    before = [pool.snapshot(s) for s in (a, b)]
    with pytest.raises(error):
        runner.step([Row(b, [9], 3), row(a)])
    assert all(snapshots_equal(pool.snapshot(s), x) for s, x in zip((a, b), before, strict=True))


def test_a_slot_twice_in_one_batch_is_refused(model: Model) -> None:
    runner = new_runner(model)
    a = runner.pool.allocate()
    with pytest.raises(BatchError):
        runner.step([Row(a, [1], 0), Row(a, [2], 1)])


def test_numpy_integer_token_ids_run_like_python_ints(model: Model) -> None:
    ids = np.array([3, 17, 99], dtype=np.int64)
    runs = []
    for tokens in (list(ids), [int(t) for t in ids]):
        runner = new_runner(model)
        slot = runner.pool.allocate()
        runs.append(np.array(runner.step([Row(slot, tokens, 0)]).rows[0].logits))
    assert np.array_equal(runs[0], runs[1])


def test_rows_on_consecutive_slots_are_read_as_runs_in_batch_order() -> None:
    from engine.cache import _runs

    assert _runs([SlotId(3), SlotId(4), SlotId(0), SlotId(1), SlotId(7)]) == [
        (3, 5),
        (0, 2),
        (7, 8),
    ]
    assert _runs([SlotId(5)]) == [(5, 6)]
    assert _runs([SlotId(2), SlotId(1)]) == [(2, 3), (1, 2)]


@pytest.mark.parametrize("layers", [1, 2, 7, 10, 11, 18, 24, 48])
def test_a_stacked_state_is_split_into_every_layers_view_by_few_graph_nodes(
    layers: int, tmp_path: Path
) -> None:
    """Each layer's view equals its entry of the stack; a step's graph gets at most one split
    node per 10 layers (plus one) rather than a slice and a squeeze per layer: MLX splits
    into more than 10 parts by a slice each, so the split goes by groups."""
    from engine.cache import _split

    stacked = mx.arange(layers * 2 * 3).reshape(layers, 2, 3)
    mx.eval(stacked)
    views = _split(stacked)
    assert len(views) == layers
    for i, view in enumerate(views):
        assert view.shape == (1, 2, 3)
        assert bool(mx.array_equal(view[0], stacked[i]))
    dot = tmp_path / "split.dot"
    mx.export_to_dot(str(dot), *_split(stacked))
    nodes = dot.read_text().count("shape=rectangle")
    most = 0 if layers == 1 else 1 if layers <= 10 else 1 + -(-layers // 10)  # groups, each
    assert nodes <= most


def test_rolling_back_many_slots_at_once_equals_one_at_a_time(model: Model) -> None:
    """Five slots verify drafts in one step (four runs of slots: the pool is written by a
    scatter); `rollback_many` leaves every slot bit-identical to
    `rollback` slot by slot, and a bad entry anywhere changes nothing."""
    rng = np.random.default_rng(3)
    pools = []
    for together in (False, True):
        runner = new_runner(model, n_slots=8, context=64)
        pool = runner.pool
        slots = [pool.allocate() for _ in range(8)]
        runner.step([Row(s, [int(t) for t in rng.integers(0, 512, 4)], 0) for s in slots])
        chosen = [slots[i] for i in (0, 2, 3, 5, 7)]
        drafts = [[int(t) for t in rng.integers(0, 512, K + 1)] for _ in chosen]
        runner.step(
            [Row(s, d, pool.lengths[s], capture=True) for s, d in zip(chosen, drafts, strict=True)]
        )
        keeps = [(s, keep) for s, keep in zip(chosen, (1, 3, K + 1, 2, 4), strict=True)]
        if together:
            before = [pool.snapshot(s) for s in slots]
            with pytest.raises(SlotStateError, match="keep=9"):
                pool.rollback_many([*keeps[:2], (chosen[2], 9)])
            with pytest.raises(SlotStateError, match="more than once"):
                pool.rollback_many([keeps[0], keeps[0]])
            assert all(
                snapshots_equal(pool.snapshot(s), b) for s, b in zip(slots, before, strict=True)
            )
            pool.rollback_many(keeps)
        else:
            for s, keep in keeps:
                pool.rollback(s, keep)
        pools.append([pool.snapshot(s) for s in slots])
        rng = np.random.default_rng(3)  # the same tokens for the second pool
    assert all(snapshots_equal(a, b) for a, b in zip(*pools, strict=True))


def test_rolling_back_slots_captured_by_different_steps_equals_one_at_a_time(
    model: Model,
) -> None:
    """Slots whose capture rows ran in different steps (each step's captures gathered on
    their own) roll back together exactly as one at a time."""
    pools = []
    for together in (False, True):
        runner = new_runner(model)
        pool = runner.pool
        a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
        runner.step([Row(s, [3 + s, 9, 27], 0) for s in (a, b, c)])
        runner.step([Row(a, [5, 81, 300], 3, capture=True), Row(c, [2, 4, 6, 8], 3, capture=True)])
        runner.step([Row(b, [12, 7, 99, 1, 64], 3, capture=True)])
        keeps = [(b, 4), (a, 1), (c, 3)]
        if together:
            pool.rollback_many(keeps)
        else:
            for s, keep in keeps:
                pool.rollback(s, keep)
        pools.append([pool.snapshot(s) for s in (a, b, c)])
    assert all(snapshots_equal(x, y) for x, y in zip(*pools, strict=True))


@pytest.mark.parametrize("mode", ["layers", "3"])
def test_writing_recurrent_states_a_layer_at_a_time_stores_what_stacking_does(
    model: Model, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SLOTSERVE_POOL_SSM_WRITE: prefill, decode steps on consecutive and on scattered slots
    (slices and a scatter), a verify step and its rollback, and a decode-ahead step — the
    pool holds bit for bit what the stacked write leaves ("3": layer writes only for steps
    of 3 rows or more, so both paths meet in one runner)."""
    pools = []
    for write in ("stacked", mode):
        monkeypatch.setenv("SLOTSERVE_POOL_SSM_WRITE", write)
        rng = np.random.default_rng(11)
        runner = new_runner(model, n_slots=8, context=64)
        pool = runner.pool
        assert runner.ssm_layers(8) == (write != "stacked")
        slots = [pool.allocate() for _ in range(8)]
        runner.step([Row(s, [int(t) for t in rng.integers(0, 512, 5)], 0) for s in slots])
        for group in (slots, [slots[i] for i in (0, 2, 5, 7)], slots[3:5]):
            for _ in range(2):
                runner.step([Row(s, [int(rng.integers(0, 512))], pool.lengths[s]) for s in group])
        chosen = [slots[i] for i in (1, 4, 6)]
        drafts = [[int(t) for t in rng.integers(0, 512, K + 1)] for _ in chosen]
        runner.step(
            [Row(s, d, pool.lengths[s], capture=True) for s, d in zip(chosen, drafts, strict=True)]
        )
        pool.rollback_many([(s, keep) for s, keep in zip(chosen, (2, K + 1, 1), strict=True)])
        pending = runner.launch(slots, mx.array(rng.integers(0, 512, 8), dtype=mx.int32))
        runner.adopt(pending, range(8))
        pools.append([pool.snapshot(s) for s in slots])
    assert all(snapshots_equal(a, b) for a, b in zip(*pools, strict=True))


def test_a_steps_kv_store_is_one_scatter_per_pool_array(model: Model, tmp_path: Path) -> None:
    """Every packed token's K/V lands at its (slot, position) in every attention layer, by a
    graph of the scatter and views alone: no arange or copy of the index arrays (written
    `k[:, tok_slot, tok_pos]`, MLX made four such nodes a store, each a launch on a GPU)."""
    pool = SlotPool(model.config, 4, 16, mx.float32)
    slots = [pool.allocate() for _ in range(3)]
    lengths = [2, 1, 3]
    tok_slot, tok_pos = SlotPool.token_coordinates(slots, [0, 0, 0], lengths)
    La, _, _, Hkv, D = pool.k.shape
    k, v = (mx.random.normal((La, sum(lengths), Hkv, D), key=mx.random.key(i)) for i in (1, 2))
    _, _, conv, ssm = pool.read(slots, 1)
    want = np.array(pool.k)
    want[:, np.array(tok_slot), np.array(tok_pos)] = np.array(k)
    pool.write(slots, tok_slot, tok_pos, [k, v, conv + 1, ssm + 1])
    dot = tmp_path / "store.dot"
    mx.export_to_dot(str(dot), pool.k)
    labels = re.findall(r'label ="([^"]*)"', dot.read_text())
    assert labels.count("Scatter") == 1
    assert not {"Arange", "AsType", "Copy"} & set(labels)
    assert np.array_equal(np.array(pool.k), want)
    assert np.array_equal(np.array(pool.v)[:, np.array(tok_slot), np.array(tok_pos)], np.array(v))


def test_a_bad_ssm_write_mode_is_refused(model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTSERVE_POOL_SSM_WRITE", "wide")
    with pytest.raises(ValueError, match="SLOTSERVE_POOL_SSM_WRITE"):
        new_runner(model)


def test_the_lowest_free_slot_is_taken_first(model: Model) -> None:
    """Slots in use stay packed at the bottom of the pool (a batch of them in slot order is
    few runs of consecutive slots, which the pool reads as slices)."""
    pool = SlotPool(model.config, 6, 16, mx.float32)
    slots = [pool.allocate() for _ in range(5)]
    assert slots == [0, 1, 2, 3, 4]
    pool.free(SlotId(3))
    pool.free(SlotId(1))
    assert not pool.in_use(SlotId(1)) and pool.in_use(SlotId(2)) and pool.free_slots == 3
    assert [pool.allocate() for _ in range(3)] == [1, 3, 5]
    with pytest.raises(PoolExhaustedError):
        pool.allocate()


def test_a_batch_runs_in_slot_order_and_answers_in_its_own(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows given out of slot order run in slot order — the pool reads them as one run of
    consecutive slots, not a gather — and come back in the order given, each the output the
    same rows in slot order give, with the same pool state after."""
    from engine import cache

    runs: list[int] = []
    take = cache.take_slots

    def spy(a: mx.array, slots: list[SlotId], axis: int, max_runs: int) -> mx.array:
        runs.append(len(cache._runs(slots)))
        return take(a, slots, axis, max_runs)

    monkeypatch.setattr(cache, "take_slots", spy)
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(0, 512, n)] for n in (3, 7, 5, 2)]
    results = []
    for order in ((0, 1, 2, 3), (2, 0, 3, 1)):
        runner = new_runner(model, n_slots=4)
        slots = [runner.pool.allocate() for _ in prompts]
        runs.clear()
        out = runner.step([Row(slots[i], prompts[i], 0) for i in order])
        assert set(runs) == {1}  # every state kind read as one slice
        by_slot = {slots[i]: out.rows[j] for j, i in enumerate(order)}
        logits = [np.array(by_slot[s].logits) for s in slots]
        results.append((logits, [runner.pool.snapshot(s) for s in slots]))
    (a, pa), (b, pb) = results
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(snapshots_equal(x, y) for x, y in zip(pa, pb, strict=True))
