"""The fused CUDA attention kernels against the portable path, on MLX's CUDA backend only."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from gpu_paths import assert_as_close_as, on_cpu, two_steps

from engine.kernels.cuda import available

pytestmark = pytest.mark.skipif(not available(), reason="needs MLX's CUDA backend")


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # D 32, rope over half of it, GQA 2
        {
            "head_dim": 64,
            "rope_dim": 64,
            "n_head": 8,
            "n_head_kv": 2,
        },
        {"head_dim": 256, "rope_dim": 64},
        {"preset": "tiny-moe"},
    ],
)
def test_fused_attention_matches_the_portable_path(
    make_model: Callable[..., Path], overrides: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_model("tiny", quant="f32", **overrides)
    monkeypatch.setenv("SLOTSERVE_FUSED_ATTENTION", "0")
    portable = two_steps(path)
    monkeypatch.setenv("SLOTSERVE_FUSED_ATTENTION", "1")
    assert_as_close_as(two_steps(path), portable, on_cpu(path))
