"""The engine's SLOTSERVE_* switches (engine/switches.py): every one the engine reads is
checked, with its reader's own rule, and the values the readers take pass."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine import runner, switches
from engine.kernels import gdn_mixer_cuda, gemv_cuda

ROOT = Path(__file__).resolve().parent.parent


def test_every_switch_the_engine_mentions_is_checked() -> None:
    mentioned = set()
    for path in (ROOT / "engine").rglob("*.py"):
        mentioned |= set(re.findall(r"SLOTSERVE_[A-Z_]*[A-Z]", path.read_text()))
    mentioned.discard("SLOTSERVE_FUSED")  # the prefix of `cuda.switched_on`'s names
    assert mentioned <= set(switches.CHECKS), mentioned - set(switches.CHECKS)


def test_good_values_pass_and_each_bad_one_is_named() -> None:
    good = {name: values[-1] for name, values in gemv_cuda.SWITCHES.items()}
    good |= {"SLOTSERVE_POOL_SSM_WRITE": "32", "SLOTSERVE_GDN_WARPS": "4"}
    good |= {"SLOTSERVE_GEMV_PROLOGUE_QUANTIZED": "swiglu,add_norm", "SLOTSERVE_FUSED_GDN": "0"}
    good |= {"PATH": "/bin", "SLOTSERVE_STEP_INPUTS": "device"}
    assert switches.problems(good) == []
    bad = {
        "SLOTSERVE_GEMV_STAGED_SPLIT": "3",
        "SLOTSERVE_POOL_SSM_WRITE": "0",
        "SLOTSERVE_GEMV_PROLOGUE_QUANTIZED": "swiglu,gelu",
        "SLOTSERVE_ATTENTION_DECODE": "on",
    }
    found = switches.problems(bad)
    assert len(found) == 4
    assert any(line.startswith("SLOTSERVE_GEMV_STAGED_SPLIT='3': one of auto") for line in found)
    assert any("stacked, layers or a row count" in line for line in found)
    assert any("comma-separated of add_norm, swiglu" in line for line in found)


@pytest.mark.parametrize("name", sorted(gemv_cuda.SWITCHES))
def test_the_readers_take_every_value_the_check_passes(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One list of values per switch: what the check passes, the kernel module reads (its
    first is the default when unset)."""
    values = gemv_cuda.SWITCHES[name]
    monkeypatch.delenv(name, raising=False)
    assert gemv_cuda._switch(name) == values[0]
    for value in values:
        monkeypatch.setenv(name, value)
        assert gemv_cuda._switch(name) == value
    monkeypatch.setenv(name, "nonsense")
    with pytest.raises(ValueError, match=name):
        gemv_cuda._switch(name)


def test_the_special_readers_are_the_checks() -> None:
    """Switches with their own rules are checked by the functions that read them."""
    assert switches.CHECKS[runner.SSM_WRITE_ENV] is runner.parse_ssm_write
    assert switches.CHECKS[runner.STEP_INPUTS_ENV] is runner.parse_step_inputs
    assert runner.parse_step_inputs("device") and not runner.parse_step_inputs("host")
    assert switches.CHECKS[gdn_mixer_cuda.WARPS_ENV] is gdn_mixer_cuda.fixed_warps
    assert switches.CHECKS[gemv_cuda.PROLOGUE_QUANTIZED_ENV] is gemv_cuda.prologue_quantized
    assert runner.parse_ssm_write("layers") == 1 and runner.parse_ssm_write("stacked") is None
    assert gdn_mixer_cuda.fixed_warps("") is None and gdn_mixer_cuda.fixed_warps("8") == 8
    assert gemv_cuda.prologue_quantized("") == []


def test_unknown_names_are_the_prefixed_ones_nothing_reads() -> None:
    env = {
        "SLOTSERVE_GEMV_MAM": "0",
        "SLOTSERVE_GEMV_MMA": "0",
        "SLOTSERVE_SLOTS": "4",
        "HOME": "/",
    }
    assert switches.unknown(env, {"SLOTSERVE_SLOTS"}) == ["SLOTSERVE_GEMV_MAM"]


def test_the_tensor_core_kernel_takes_at_most_8_warps_a_split(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SLOTSERVE_GEMV_STAGED_SPLIT=16 made the tensor-core kernel a block of 512 threads of
    ~165 registers, which the H200 refused to launch (session 20): it takes 8 there, and
    the CUDA-core kernel (a few dozen registers a thread) still 16."""
    monkeypatch.setenv(gemv_cuda.STAGED_SPLIT_ENV, "16")
    assert gemv_cuda.staged_split(1024, gemv_cuda.MMA_OUTS, 3584, mma=True) == 8
    assert gemv_cuda.staged_split(1024, 4) == 16
    monkeypatch.setenv(gemv_cuda.STAGED_SPLIT_ENV, "4")
    assert gemv_cuda.staged_split(1024, gemv_cuda.MMA_OUTS, 3584, mma=True) == 4


def test_the_fast_environment_read_sees_every_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """`cuda.env` (what the kernels' switches read, ~500 times a step) answers as
    `os.environ.get` does after each way a test or tool changes the environment."""
    import os

    from engine.kernels import cuda

    name = "SLOTSERVE_TEST_FAST_ENV"
    monkeypatch.delenv(name, raising=False)
    assert cuda.env(name, "dflt") == "dflt"
    monkeypatch.setenv(name, "auto")
    assert cuda.env(name, "dflt") == "auto"
    os.environ[name] = "é, not ascii"
    assert cuda.env(name, "dflt") == os.environ.get(name) == "é, not ascii"
    os.environ.update({name: "2"})
    assert cuda.env(name, "dflt") == "2"
    del os.environ[name]
    assert cuda.env(name, "dflt") == "dflt"
    monkeypatch.setenv(name, "")
    assert cuda.env(name, "dflt") == ""
