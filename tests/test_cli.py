"""The `slotserve` console script, run as a real subprocess."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.dflash_writer import DFLASH_PRESETS, DFlashSpec, write_dflash
from engine.generate import generate_text, prefill_logits
from engine.gguf import GGUFFile
from engine.models.qwen35 import load_model
from engine.writer import parameter_count, preset, write_model

REPO = Path(__file__).resolve().parent.parent


def _slotserve() -> list[str]:
    """The installed console script next to this interpreter, else the module."""
    script = Path(sys.executable).parent / "slotserve"
    if script.exists():
        return [str(script)]
    found = shutil.which("slotserve")
    return [found] if found else [sys.executable, "-m", "transport.cli"]


def slotserve(*args: str | Path, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_slotserve(), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_make_model_writes_the_spec_it_names(tmp_path: Path) -> None:
    out = tmp_path / "made.gguf"
    run = slotserve("make-model", out, "--preset", "tiny-moe", "--layers", "2", "--seed", "3")
    assert run.returncode == 0, run.stderr
    expected = tmp_path / "expected.gguf"
    write_model(expected, dataclasses.replace(preset("tiny-moe"), n_layer=2, seed=3))
    assert out.read_bytes() == expected.read_bytes()


def test_make_dflash_writes_the_drafter_it_names(tmp_path: Path) -> None:
    out = tmp_path / "drafter.gguf"
    run = slotserve("make-dflash", out, "--preset", "tiny", "--target-layers", "0,2")
    assert run.returncode == 0, run.stderr
    expected = tmp_path / "expected.gguf"
    write_dflash(expected, dataclasses.replace(DFLASH_PRESETS["tiny"], target_layers=(0, 2)))
    assert out.read_bytes() == expected.read_bytes()


def test_make_dflash_reads_its_target_from_a_model_file(tmp_path: Path, tiny_qwen35: Path) -> None:
    out = tmp_path / "drafter.gguf"
    run = slotserve("make-dflash", out, "--target", tiny_qwen35, "--block-size", "4")
    assert run.returncode == 0, run.stderr
    expected = tmp_path / "expected.gguf"
    write_dflash(expected, DFlashSpec.for_file(tiny_qwen35, block_size=4))
    assert out.read_bytes() == expected.read_bytes()


def test_inspect_prints_architecture_and_state_bytes(tiny_qwen35: Path) -> None:
    run = slotserve("inspect", tiny_qwen35)
    assert run.returncode == 0, run.stderr
    cfg = GGUFFile(tiny_qwen35).config
    # Table rows: a label, then cells, separated by two or more spaces.
    lines = (re.split(r"\s{2,}", line.strip()) for line in run.stdout.splitlines())
    rows = {cells[0]: cells[1:] for cells in lines}
    assert rows["architecture"] == ["qwen35"]
    assert rows["pattern"] == ["LA LA M"]
    assert rows["n_layer"] == ["4"]
    assert rows["parameters"][0] == f"{parameter_count(preset('tiny')):,}"
    assert rows["KV / token"] == [
        f"{cfg.kv_bytes_per_token(n, include_mtp=False):,}" for n in (2, 4)
    ]
    assert rows["KV / token with MTP"] == [f"{cfg.kv_bytes_per_token(n):,}" for n in (2, 4)]
    assert rows["GDN state / slot"][0] == f"{cfg.linear_state_bytes():,}"


def test_logits_writes_prefill_logits_as_npy(tiny_qwen35: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.npy"
    run = slotserve("logits", tiny_qwen35, "--tokens", "1,2,3", "--out", out)
    assert run.returncode == 0, run.stderr
    logits = np.load(out)
    assert logits.dtype == np.float32
    assert logits.shape == (3, GGUFFile(tiny_qwen35).config.n_vocab)
    np.testing.assert_allclose(
        logits, prefill_logits(load_model(tiny_qwen35), [1, 2, 3]), rtol=1e-6, atol=1e-6
    )


def test_generate_streams_the_greedy_continuation(tiny_qwen35: Path) -> None:
    prompt = "The quick brown fox"
    run = slotserve("generate", tiny_qwen35, "--prompt", prompt, "--max-tokens", "8")
    assert run.returncode == 0, run.stderr
    expected = "".join(generate_text(tiny_qwen35, prompt, max_tokens=8))
    assert expected  # the random model does not stop at once, so text must come
    assert run.stdout == expected + "\n"


@pytest.mark.parametrize("command", [["inspect"], ["logits", "--tokens", "1", "--out", "x.npy"]])
@pytest.mark.parametrize(
    ("content", "says"),
    [(None, "no such file"), (b"just some text\n", "not a GGUF file")],
    ids=["missing", "text-file"],
)
def test_bad_model_path_exits_2_with_a_message(
    tmp_path: Path, command: list[str], content: bytes | None, says: str
) -> None:
    model = tmp_path / "model.gguf"
    if content is not None:
        model.write_bytes(content)
    run = slotserve(command[0], model, *command[1:], cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.startswith(f"slotserve: error: {model}: {says}")
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "x.npy").exists()


def test_token_outside_the_vocabulary_exits_2(tiny_qwen35: Path, tmp_path: Path) -> None:
    run = slotserve("logits", tiny_qwen35, "--tokens", "1,99999", "--out", tmp_path / "x.npy")
    assert run.returncode == 2
    assert run.stderr.startswith("slotserve: error:") and "99999" in run.stderr
    assert "Traceback" not in run.stderr


def test_demo_serves_the_trained_model_and_prints_three_completions(tmp_path: Path) -> None:
    """`slotserve demo`'s defaults: the committed model, load, sampled completions, exit 0."""
    r = slotserve(
        "demo", "--duration", "2", "--concurrency", "2", "--max-tokens", "24", cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "requests" in r.stdout and "errors 0" in r.stdout
    samples = r.stdout.split("--- temperature 0.7, seed ")[1:]
    assert len(samples) == 3
    # each sample is its prompt and then some generated text
    assert all(len(s.split("\n", 1)[1].strip()) > 40 for s in samples)


def test_demo_names_a_missing_model(tmp_path: Path) -> None:
    r = slotserve("demo", "--duration", "1", "--model", tmp_path / "none.gguf", cwd=tmp_path)
    assert r.returncode != 0
    assert "none.gguf: the demo model is missing" in r.stderr
