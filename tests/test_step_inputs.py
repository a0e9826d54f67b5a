"""SLOTSERVE_STEP_INPUTS=device: a decode step takes its rows' starts from the step before,
made on the device, and kept slot / output-index arrays (`engine.runner.StepInputs`); and
SLOTSERVE_HOST_POOL=1: a step's ids made from 8-byte pieces (`host_pool.ids`; forced here,
where the stack falls back to `mx.stack`). Only where the arrays are made may change: every
output and every byte of the pool must be what host-made arrays give."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import SlotPool
from engine.kernels import host_pool
from engine.models.qwen35 import Model, load_model
from engine.runner import ModelRunner, Row, StepInputs

K = 3  # draft depth


@pytest.fixture(scope="module")
def model(make_model: Callable[..., Path]) -> Model:
    return load_model(make_model("tiny", quant="f32"))


def run_mixed_workload(
    model: Model, compiled: bool, padded: bool
) -> tuple[list[np.ndarray], list[list[np.ndarray]], int]:
    """Prefill, plain decode steps on one group of slots then another, a verify step with
    rollback, decode-ahead steps (launch / adopt, all rows and then some), decode again;
    every step's logits, every slot's state at the end, and the steps whose starts were
    derived."""
    rng = np.random.default_rng(5)
    pool = SlotPool(model.config, 6, 48, mx.float32, max_draft=K)
    runner = ModelRunner(model, pool, compile=compiled)
    runner.pad_widths = padded  # on the CPU only a GPU turns it on: pads rows to 1, 2, 4, 8
    slots = [pool.allocate() for _ in range(5)]
    out: list[np.ndarray] = []

    def step(rows: list[Row]) -> None:
        res = runner.step(rows)
        out.extend(np.array(r.logits) for r in res.rows)

    step([Row(s, [int(t) for t in rng.integers(0, 512, 3 + s)], 0) for s in slots])
    for group in (slots, slots[:3], slots[:3], slots, slots[1:4]):
        for _ in range(3):
            step([Row(s, [int(rng.integers(0, 512))], pool.lengths[s]) for s in group])
    chosen = slots[1:3]
    drafts = [[int(t) for t in rng.integers(0, 512, K + 1)] for _ in chosen]
    step([Row(s, d, pool.lengths[s], capture=True) for s, d in zip(chosen, drafts, strict=True)])
    pool.rollback_many([(chosen[0], 2), (chosen[1], 1)])
    tokens = mx.array(rng.integers(0, 512, len(slots)), dtype=mx.int32)
    for _ in range(4):  # decode-ahead: each step on the last one's argmax, on the device
        pending = runner.launch(slots, tokens)
        res = runner.adopt(pending, range(len(slots)))
        logits = mx.concatenate([r.logits for r in res.rows])
        out.append(np.array(logits))
        tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
    pending = runner.launch(slots, tokens)
    res = runner.adopt(pending, [3, 0])  # only some rows kept: the others not written
    out.extend(np.array(r.logits) for r in res.rows)
    for _ in range(2):
        step([Row(s, [int(rng.integers(0, 512))], pool.lengths[s]) for s in (slots[0], slots[3])])
    snaps = [pool.snapshot(s) for s in slots]
    state = [[*x.conv, *x.ssm, *(a for kv in x.kv for a in kv)] for x in snaps]
    return out, state, runner.inputs.derived


@pytest.mark.parametrize(("compiled", "padded"), [(False, False), (True, False), (True, True)])
def test_starts_made_on_the_device_change_no_output_and_no_state(
    model: Model, compiled: bool, padded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLOTSERVE_STEP_INPUTS", "host")
    host_logits, host_state, host_derived = run_mixed_workload(model, compiled, padded)
    monkeypatch.setenv("SLOTSERVE_STEP_INPUTS", "device")
    dev_logits, dev_state, derived = run_mixed_workload(model, compiled, padded)
    assert host_derived == 0
    # the steady steps: 2 of each group's 3 plain steps (all 3 for the group that repeats
    # the one before), 3 of the 4 decode-ahead steps after the first launch, the partial
    # launch after them, and the last plain step of 2 rows
    assert derived == 5 * 2 + 1 + 3 + 1 + 1
    assert_same_run(host_logits, host_state, dev_logits, dev_state)


def assert_same_run(
    logits: list[np.ndarray],
    state: list[list[np.ndarray]],
    other_logits: list[np.ndarray],
    other_state: list[list[np.ndarray]],
) -> None:
    """Two runs of `run_mixed_workload` gave every output and every state byte alike."""
    assert len(logits) == len(other_logits)
    for a, b in zip(logits, other_logits, strict=True):
        assert np.array_equal(a, b)
    for a, b in zip(state, other_state, strict=True):
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_derived_start_is_used_only_for_the_same_slots_one_token_on() -> None:
    inputs = StepInputs(device=True)
    after = mx.array([8, 11], dtype=mx.int32)
    inputs.ran([0, 1], [7, 10], after)
    for slots, starts in (
        ([0, 1], [7, 10]),  # the same step again: not one token on
        ([1, 0], [11, 8]),  # other slots (the same ones reordered)
        ([0, 1], [8, 12]),  # a row that moved otherwise (a verify)
    ):
        made = inputs.starts(slots, starts)
        assert made is not after and made.tolist() == starts  # made from the host
    assert inputs.starts([0, 1], [8, 11]) is after
    assert inputs.derived == 1
    off = StepInputs(device=False)
    off.ran([0, 1], [7, 10], after)
    assert off.starts([0, 1], [8, 11]) is not after
    assert off.kept([1, 2]) is not off.kept([1, 2])
    assert inputs.kept([1, 2]) is inputs.kept([1, 2])


def test_a_bad_step_inputs_mode_is_refused(model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTSERVE_STEP_INPUTS", "gpu")
    with pytest.raises(ValueError, match="SLOTSERVE_STEP_INPUTS"):
        ModelRunner(model, SlotPool(model.config, 2, 16, mx.float32))


@pytest.mark.parametrize("compiled", [False, True])
def test_ids_made_from_pieces_change_no_output_and_no_state(
    model: Model, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain_logits, plain_state, _ = run_mixed_workload(model, compiled, True)
    monkeypatch.setattr(host_pool, "enabled", lambda: True)
    logits, state, _ = run_mixed_workload(model, compiled, True)
    assert_same_run(plain_logits, plain_state, logits, state)


def test_ids_from_pieces_are_the_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_pool, "enabled", lambda: True)
    for n in (0, 1, 2, 3, 4, 5, 8, 9, 33, 64, 65, 300):
        values = [7 * i - 100 for i in range(n)]
        made = host_pool.ids(values)
        assert made.dtype == mx.int32 and made.tolist() == values
        floats = [float(np.float32(0.37 * i - 1.5)) for i in range(n)]  # (exact in float32)
        made = host_pool.array(floats, mx.float32)
        assert made.dtype == mx.float32 and made.tolist() == floats


def test_sampled_tokens_with_pieces_are_those_without(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's uniforms and sampled rows' index made from 8-byte pieces (`host_pool.array`,
    `device_tokens`): the same tokens, greedy and sampled rows mixed or all sampled."""
    from engine.sampling import SamplingParams, device_tokens

    rng = np.random.default_rng(3)
    logits = mx.array(rng.normal(size=(6, 50)).astype(np.float32) * 3)
    hot, greedy = SamplingParams(temperature=0.8, top_k=20), SamplingParams(temperature=0.0)
    for params in ([hot, greedy, hot, hot, greedy, hot], [hot] * 6):
        uniforms = [float(u) for u in rng.random(sum(not p.greedy for p in params))]
        want = device_tokens(logits, params, uniforms).tolist()
        with monkeypatch.context() as m:
            m.setattr(host_pool, "enabled", lambda: True)
            assert device_tokens(logits, params, uniforms).tolist() == want
