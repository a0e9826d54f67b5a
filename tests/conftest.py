"""Shared fixtures: random-weight GGUF models made by our writer, and llama.cpp as the oracle.

* `make_model(preset="tiny", **overrides) -> Path` (session fixture): writes the preset with
  `ModelSpec` field overrides into a session tmp dir, once per distinct spec.
* `make_dflash(preset="tiny", **overrides) -> Path` (session fixture): a random DFlash
  drafter (`engine.dflash_writer.DFLASH_PRESETS`, `DFlashSpec` overrides), once per distinct spec.
* `tiny_qwen35`, `tiny_qwen35moe`, `tiny_qwen3next`: paths of the three tiny presets.
* `demo_f32`: the shipped, trained demo model (models/slotserve-demo.gguf) as an f32 copy.
* `llama_cpp_model(path, **kw)`: a `llama_cpp.Llama` loaded the way our parity tests need it
  (import it with `from conftest import llama_cpp_model`).
* Tests marked `@pytest.mark.llama` are skipped when llama-cpp-python is not installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

# On MLX's CUDA backend float32 matmuls run on TF32 tensor cores unless this is off: rows
# of different lengths then round differently, and the 1e-5 equalities of the float32 tests
# (rollback against a replay, tests/test_pool.py) failed on the H200 with it on and passed
# with it off (session 4). Set before MLX's first GPU use; no effect on the CPU.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

from engine.dflash_writer import DFLASH_PRESETS, DFlashSpec, write_dflash
from engine.writer import ModelSpec, preset, write_dequantized, write_model
from transport.daemon.demo import DEMO_MODEL

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_LLAMA_CPP:
        return
    skip = pytest.mark.skip(reason="llama-cpp-python is not installed (pip install '.[dev]')")
    for item in items:
        if "llama" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def make_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory `make_model(preset="tiny", **overrides) -> Path`, cached per resulting spec."""
    root = tmp_path_factory.mktemp("models")
    made: dict[ModelSpec, Path] = {}

    def make(preset_name: str = "tiny", /, **overrides: Any) -> Path:
        name = overrides.pop("preset", preset_name)
        spec = dataclasses.replace(preset(name), **overrides)
        if spec not in made:
            path = root / f"{spec.name}-{len(made)}-{spec.quant}.gguf"
            write_model(path, spec)
            made[spec] = path
        return made[spec]

    return make


@pytest.fixture(scope="session")
def make_dflash(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory `make_dflash(preset="tiny", **overrides) -> Path`, cached per resulting spec."""
    root = tmp_path_factory.mktemp("drafters")
    made: dict[DFlashSpec, Path] = {}

    def make(preset_name: str = "tiny", /, **overrides: Any) -> Path:
        spec = dataclasses.replace(DFLASH_PRESETS[preset_name], **overrides)
        if spec not in made:
            path = root / f"{spec.name}-{len(made)}-{spec.quant}.gguf"
            write_dflash(path, spec)
            made[spec] = path
        return made[spec]

    return make


@pytest.fixture(scope="session")
def tiny_qwen35(make_model: Callable[..., Path]) -> Path:
    return make_model("tiny")


@pytest.fixture(scope="session")
def tiny_qwen35moe(make_model: Callable[..., Path]) -> Path:
    return make_model("tiny-moe")


@pytest.fixture(scope="session")
def tiny_qwen3next(make_model: Callable[..., Path]) -> Path:
    return make_model("tiny-next")


@pytest.fixture(scope="session")
def demo_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained demo model with its q8_0 tensors dequantized to f32, for tight parity."""
    path = tmp_path_factory.mktemp("demo") / "slotserve-demo-f32.gguf"
    write_dequantized(DEMO_MODEL, path)
    return path


@contextlib.contextmanager
def _model_params(fields: Mapping[str, Any]) -> Iterator[None]:
    # `Llama` exposes no argument for `use_extra_bufts` (or `load_mtp`): its __init__ takes
    # `llama_model_default_params()` and loads at once. So wrap that function while loading.
    from llama_cpp import llama_cpp as capi

    default = capi.llama_model_default_params

    def params() -> Any:
        p = default()
        for key, value in fields.items():
            setattr(p, key, value)
        return p

    capi.llama_model_default_params = params
    try:
        yield
    finally:
        capi.llama_model_default_params = default


def llama_cpp_model(
    path: str | Path, *, model_params: Mapping[str, Any] | None = None, **kw: Any
) -> Any:
    """Load `path` with llama-cpp-python for parity checks and return the `llama_cpp.Llama`.

    Always sets the model parameter `use_extra_bufts = False`: on CPUs reporting AMX, llama.cpp
    otherwise repacks quantized weights into an AMX buffer that dies with SIGILL in our sandbox
    (MODEL_SPEC §16). `model_params` sets further `llama_model_params` fields (e.g.
    `{"load_mtp": True}`). `kw` goes to `Llama`; the defaults here are a 512-token context,
    logits for every position (`llama.scores`), an F32 KV cache (`type_k = type_v = 0`; the F16
    default costs ~2.5e-4 relative, §16.4) and no log output.
    """
    import llama_cpp

    kw = {"n_ctx": 512, "logits_all": True, "type_k": 0, "type_v": 0, "verbose": False} | kw
    with _model_params({"use_extra_bufts": False, **(model_params or {})}):
        return llama_cpp.Llama(str(path), **kw)
