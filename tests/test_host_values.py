"""bench/host_values.py (BENCHMARK ONLY): the PTX that makes int32 values from a kernel's
launch parameters, carried out here on the host as the GPU would (its text ran on the H200
in session 21, when it was the engine's: every count's values came back exactly)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import host_values


def run_ptx(
    *,
    name: str,
    compiled_source: bytes,
    inputs: list[mx.array],
    output_shapes: list[tuple[int, ...]],
    output_dtypes: list[mx.Dtype],
    scalars: list[Any],
    **_: Any,
) -> list[mx.array]:
    """`mx.fast.precompiled_cuda_kernel` for this PTX: its entry is the launch's name with a
    parameter for the output and each scalar (MLX passes outputs, then scalars), and each
    store puts the parameter it loaded at its byte offset."""
    text = compiled_source.decode()
    entry = re.search(r"\.entry (\w+)\(([^)]*)\)", text)
    assert entry is not None and entry[1] == name and not inputs
    assert entry[2].count(".param") == 1 + len(scalars)
    (shape,), (dtype,) = output_shapes, output_dtypes
    assert dtype == mx.int32
    out = np.full(shape, -1, dtype=np.int32)
    pairs = re.findall(r"ld\.param\.b32 %v, \[v(\d+)\];\s+st\.global\.b32 \[%rd1\+(\d+)\]", text)
    assert len(pairs) == len(scalars) == out.size
    for index, offset in pairs:
        out[int(offset) // 4] = scalars[int(index)]
    return [mx.array(out)]


def test_values_come_back_for_every_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", run_ptx)
    for n in (1, 2, 3, 4, 5, 8, 9, 64, 65, 255, 256):
        values = [7 * i - 300 for i in range(n)]
        made = host_values.int32_from_params(values)
        assert made.dtype == mx.int32 and made.tolist() == values
    for n in (0, 257):
        with pytest.raises(ValueError, match="int32_from_params"):
            host_values.int32_from_params(list(range(n)))


def test_a_kernel_per_power_of_two_named_for_its_code() -> None:
    names = {host_values.source(c)[0] for c in (4, 8, 16, 32, 64, 128, 256)}
    assert len(names) == 7
    name, ptx = host_values.source(8)
    assert name.startswith("slotserve_host_values_8_") and f".entry {name}(" in ptx.decode()
