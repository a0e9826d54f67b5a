"""bench/graph_nodes.py on the tiny model: a decode step's graph on the CUDA path counted on
this CPU, every kernel family the step launches there met, the stand-ins not counted, and
the pool's own state left as it was."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from graph_nodes import STAND_INS, count

from engine.kernels import cuda


def test_a_decode_step_is_counted_by_kernel_family_and_mlx_node(
    make_model: Callable[..., Path],
) -> None:
    path = make_model("tiny", quant="f16")
    one, eight = count(path, mx.bfloat16, 1), count(path, mx.bfloat16, 8)
    for r in (one, eight):
        assert {"gdn_mixer", "attention", "stack"} <= set(r["kernels"])
        assert r["kernel_calls"] == sum(r["kernels"].values())
        assert not STAND_INS & set(r["mlx_ops"]) and r["mlx_ops"]["Matmul"] >= 1
    assert "gemv" in one["kernels"] and "gemv_mma" in eight["kernels"]  # one row vs 2-8
    timed = count(path, mx.bfloat16, 8, times=3)  # --time: the host's build, unevaluated
    assert 0 < timed["build_ms_best"] <= timed["build_ms"]
    assert {k: v for k, v in timed.items() if not k.startswith("build")} == eight
    assert not cuda.available()  # the stand-ins are gone afterwards
