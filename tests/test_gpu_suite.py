"""bench/gpu_suite.py, run on the CPU with tiny models: the one call the lead makes on the GPU
machine must produce its JSON and tables, with ours and mlx-lm decoding the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm", reason="mlx-lm is the bench extra: pip install -e '.[bench]'")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from gpu_suite import parse_batched_bench  # noqa: E402


def test_suite_runs_both_models_and_writes_its_tables(
    make_model: Callable[..., Path], tmp_path: Path
) -> None:
    small = make_model("tiny", quant="f16", tied_embeddings=True)
    big = make_model("tiny", quant="q8_0", ssm_state_size=32)
    cmd = [sys.executable, "bench/gpu_suite.py", "--small", str(small), "--big", str(big)]
    cmd += ["--dtype", "float32", "--ns", "1,2", "--prompt", "6", "--steps", "3", "--reps", "1"]
    cmd += ["--alone", "--ahead"]
    env = os.environ | {"OUT": str(tmp_path)}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)

    record = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert set(record["models"]) == {small.stem, big.stem}
    for r in record["models"].values():
        checks = r["batched"]["checks"]
        assert {"side": "mlx-lm", "same_tokens_as_ours": True} in checks
        # decode-ahead (each step queued on the last one's argmax on the device) changes no token
        assert {"side": "ours-ahead", "same_tokens_as_ours": True} in checks
    assert [s["n"] for s in record["models"][small.stem]["batched"]["summary"]] == [1, 2]
    ahead = [
        x for x in record["models"][small.stem]["batched"]["samples"] if x["side"] == "ours-ahead"
    ]
    assert ahead and all(  # where decode-ahead's host time goes
        {"step", "host", "sample", "adopt", "argmax", "launch"} <= set(x["phases_ms"])
        for x in ahead
    )
    assert record["models"][big.stem]["roofline_tok_s"] > 0
    table = (tmp_path / "gpu_suite.md").read_text()
    assert f"| ours, {small.stem} |" in table and "ours / mlx-lm >= 3" in table
    assert f"| ours alone (no mlx-lm worker), {small.stem} |" in table
    assert f"| ours-ahead, {small.stem} |" in table and "ours-ahead / mlx-lm >= 3" in table
    assert [s["n"] for s in record["models"][small.stem]["alone"]["summary"]] == [1, 2]


def test_llama_batched_bench_table_is_parsed() -> None:
    out = """
main: n_kv_max = 16640, n_batch = 2048, n_ubatch = 512, flash_attn = 1, is_pp_shared = 0

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |     64 |    1 |    192 |    0.020 |  6400.00 |    0.132 |   484.85 |    0.152 |  1263.16 |
|   128 |     64 |    8 |   1536 |    0.090 | 11377.78 |    0.202 |  2534.65 |    0.292 |  5260.27 |
"""
    assert parse_batched_bench(out) == {1: 484.85, 8: 2534.65}


def test_a_peer_that_fails_leaves_ours_timed(tiny_qwen35moe: Path, tmp_path: Path) -> None:
    """mlx-lm refuses a MoE file (its converter: dense qwen35 only), as it ran out of memory
    on 8 prompts of 4,096 tokens on the H200: the suite records its failure and times ours
    (and ours-ahead) alone rather than losing the model's figures."""
    cmd = [sys.executable, "bench/gpu_suite.py", "--small", str(tiny_qwen35moe)]
    cmd += ["--big", str(tmp_path / "none.gguf"), "--dtype", "float32", "--ns", "1,2"]
    cmd += ["--prompt", "6", "--steps", "3", "--reps", "1", "--ahead"]
    env = os.environ | {"OUT": str(tmp_path)}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)

    r = json.loads((tmp_path / "gpu_suite.json").read_text())["models"][tiny_qwen35moe.stem]
    assert "only dense qwen35" in r["mlx_lm_failed"]
    sides = {side for s in r["batched"]["summary"] for side in s["tok_s"]}
    assert sides == {"ours", "ours-ahead"}
    table = (tmp_path / "gpu_suite.md").read_text()
    assert f"| mlx-lm, {tiny_qwen35moe.stem} (ValueError:" in table
    assert f"| ours-ahead, {tiny_qwen35moe.stem} |" in table and "/ mlx-lm" not in table
