"""bench/mlx_env_sweep.py's settings: a value may hold commas (a list the engine reads)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from mlx_env_sweep import parse_setting


def test_settings_parse_into_a_name_and_an_environment() -> None:
    assert parse_setting("off:") == ("off", {})
    assert parse_setting("o:ARGS=--overlap,SLOTSERVE_GEMV_STAGED=1") == (
        "o",
        {"ARGS": "--overlap", "SLOTSERVE_GEMV_STAGED": "1"},
    )
    assert parse_setting("q:SLOTSERVE_GEMV_PROLOGUE_QUANTIZED=swiglu,add_norm,X=1") == (
        "q",
        {"SLOTSERVE_GEMV_PROLOGUE_QUANTIZED": "swiglu,add_norm", "X": "1"},
    )


def test_a_setting_that_is_not_var_equals_value_is_refused() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not VAR=value"):
        parse_setting("bad:overlap")
