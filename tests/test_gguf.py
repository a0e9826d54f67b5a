"""The GGUF reader: malformed files, config parsing (llama.cpp and Ollama layouts), exact repack."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from engine.generate import prefill_logits
from engine.gguf import (
    GGUFError,
    GGUFFile,
    MissingMetadataError,
    MissingTensorError,
    ModelConfig,
    NotGGUFError,
    QuantizedWeight,
    TensorShapeError,
    TruncatedGGUFError,
    UnsupportedArchitectureError,
)
from engine.models.qwen35 import load_model
from engine.writer import ModelSpec, preset

MakeModel = Callable[..., Path]
PROMPT = [5, 77, 300, 12, 9, 411, 256, 3, 100, 42, 7, 480]


# --- copying a GGUF with edits (the way third-party producers differ from llama.cpp) ----------


@dataclass
class Contents:
    """Everything in a GGUF file, editable: metadata as (value, type, array item type)."""

    arch: str
    metadata: dict[str, tuple[Any, VT, VT | None]]
    tensors: dict[str, tuple[np.ndarray, QT]]  # raw data as the reader shows it, ggml type

    @staticmethod
    def read(path: Path) -> Contents:
        reader = gguf.GGUFReader(path)
        metadata = {}
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            item = field.types[-1] if field.types[0] == VT.ARRAY else None
            metadata[name] = (field.contents(), field.types[0], item)
        arch = reader.fields["general.architecture"].contents()
        tensors = {t.name: (np.array(t.data), t.tensor_type) for t in reader.tensors}
        return Contents(str(arch), metadata, tensors)

    def write(self, path: Path) -> Path:
        w = gguf.GGUFWriter(path, self.arch)
        for key, (value, vtype, item) in self.metadata.items():
            w.add_key_value(key, value, vtype, item)
        for name, (data, qtype) in self.tensors.items():
            w.add_tensor(name, data, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    def set(self, key: str, value: Any, vtype: VT, item: VT | None = None) -> Contents:
        self.metadata[key] = (value, vtype, item)
        return self


def _edited(tmp_path: Path, src: Path, edit: Callable[[Contents], object]) -> Path:
    contents = Contents.read(src)
    edit(contents)
    return contents.write(tmp_path / "edited.gguf")


# --- malformed files ----------------------------------------------------------------------------


def says(path: Path, what: str) -> str:
    """`pytest.raises` pattern: the message starts with the file's path, then `what`."""
    return "^" + re.escape(f"{path}: {what}")


def test_missing_file_is_a_gguf_error_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.gguf"
    with pytest.raises(GGUFError, match=says(path, "no such file")):
        GGUFFile(path)


@pytest.mark.parametrize(
    "content",
    [
        np.random.default_rng(0).bytes(4096),
        b"Hello, this is a text file.\nNot a model at all.\n",
        b"",
        b"GGU",
    ],
    ids=["random-bytes", "text", "empty", "three-bytes"],
)
def test_not_a_gguf(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(NotGGUFError, match=says(path, "not a GGUF file")):
        GGUFFile(path)


def _truncation_points(path: Path) -> dict[str, int]:
    """Cut offsets inside each region of `path`: header, metadata, tensor infos, tensor data."""
    reader = gguf.GGUFReader(path)
    infos = reader.tensors[0].field.offset
    last_info = reader.tensors[-1].field.offset
    data_end = max(t.data_offset + t.n_bytes for t in reader.tensors)  # the file pads after
    return {
        "in-version": 6,
        "in-counts": 20,
        "in-metadata": infos // 2,
        "in-first-tensor-info": infos + 5,
        "in-last-tensor-info": last_info + 3,
        "before-data": reader.data_offset,
        "in-first-tensor": reader.data_offset + 10,
        "in-middle-tensor": (reader.data_offset + data_end) // 2,
        "in-last-tensor": data_end - 1,
    }


@pytest.mark.parametrize(
    "where",
    [
        "in-version",
        "in-counts",
        "in-metadata",
        "in-first-tensor-info",
        "in-last-tensor-info",
        "before-data",
        "in-first-tensor",
        "in-middle-tensor",
        "in-last-tensor",
    ],
)
def test_truncated_file(tiny_qwen35: Path, tmp_path: Path, where: str) -> None:
    cut = _truncation_points(tiny_qwen35)[where]
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_qwen35.read_bytes()[:cut])
    with pytest.raises(TruncatedGGUFError, match=says(path, "truncated")):
        GGUFFile(path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match=says(path, "architecture 'llama'")):
        GGUFFile(path)


def test_missing_architecture_key(tmp_path: Path) -> None:
    path = tmp_path / "noarch.gguf"
    w = gguf.GGUFWriter(path, "qwen35")
    del w.kv_data[0]["general.architecture"]  # the writer always adds it; a broken file may not
    w.add_block_count(5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(MissingMetadataError, match=says(path, "metadata key general.architecture")):
        GGUFFile(path)


@pytest.mark.parametrize(
    "key",
    [
        "qwen35.block_count",
        "qwen35.embedding_length",
        "qwen35.attention.head_count",
        "qwen35.ssm.state_size",
        "qwen35.ssm.group_count",
        "qwen35.ssm.time_step_rank",
        "qwen35.ssm.inner_size",
        "qwen35.ssm.conv_kernel",
    ],
)
def test_missing_metadata_key(tiny_qwen35: Path, tmp_path: Path, key: str) -> None:
    path = _edited(tmp_path, tiny_qwen35, lambda c: c.metadata.pop(key))
    with pytest.raises(MissingMetadataError, match=says(path, f"metadata key {key} missing")):
        GGUFFile(path)


@pytest.mark.parametrize(
    "name",
    ["blk.0.ssm_a", "blk.1.attn_k.weight", "output_norm.weight", "blk.4.nextn.eh_proj.weight"],
)
def test_missing_tensor(tiny_qwen35: Path, tmp_path: Path, name: str) -> None:
    path = _edited(tmp_path, tiny_qwen35, lambda c: c.tensors.pop(name))
    with pytest.raises(MissingTensorError, match=says(path, f"tensor {name} missing")):
        load_model(path)


def test_absent_output_weight_means_tied_embeddings(tiny_qwen35: Path, tmp_path: Path) -> None:
    path = _edited(tmp_path, tiny_qwen35, lambda c: c.tensors.pop("output.weight"))
    model = load_model(path)
    assert model.output is model.tok_embd


@pytest.mark.parametrize(
    ("name", "reshape"),
    [
        ("blk.0.ssm_a", lambda a: np.concatenate([a, a[:1]])),  # Hv + 1 heads
        ("blk.0.attn_qkv.weight", lambda a: np.ascontiguousarray(a.T)),  # (E, Cc), not (Cc, E)
        ("blk.1.attn_k.weight", lambda a: a[:-8]),  # a KV row short
    ],
    ids=["vector-too-long", "matrix-transposed", "matrix-rows-short"],
)
def test_wrong_tensor_shape(
    tiny_qwen35: Path, tmp_path: Path, name: str, reshape: Callable[[np.ndarray], np.ndarray]
) -> None:
    def edit(c: Contents) -> None:
        data, qtype = c.tensors[name]
        c.tensors[name] = (reshape(data), qtype)

    path = _edited(tmp_path, tiny_qwen35, edit)
    with pytest.raises(TensorShapeError, match=says(path, f"tensor {name} has shape")):
        load_model(path)


# --- config parsing -----------------------------------------------------------------------------


def _expected_config(spec: ModelSpec) -> ModelConfig:
    """What the reader must make of a file `write_model` wrote from `spec`."""
    return ModelConfig(
        arch=spec.arch,
        name=spec.name,
        n_vocab=spec.n_tokens,
        n_embd=spec.n_embd,
        n_layer=spec.n_layer,
        n_mtp=int(spec.mtp),
        n_head=spec.n_head,
        n_head_kv=spec.n_head_kv,
        head_dim=spec.head_dim,
        rope_dim=spec.rope_dim,
        rope_base=spec.rope_base,
        rope_sections=() if spec.arch == "qwen3next" else tuple(spec.rope_sections),
        recurrent=tuple(spec.is_recurrent(i) for i in range(spec.n_layer)),
        rms_eps=float(np.float32(spec.rms_eps)),  # stored as f32
        conv_kernel=spec.conv_kernel,
        ssm_dk=spec.ssm_state_size,
        ssm_dv=spec.ssm_state_size,
        ssm_hk=spec.ssm_group_count,
        ssm_hv=spec.ssm_time_step_rank,
        v_heads_tiled=spec.arch != "qwen3next",
        n_ff=0 if spec.is_moe else spec.n_ff,
        n_expert=spec.n_expert,
        n_expert_used=spec.n_expert_used,
        n_ff_exp=spec.n_ff_exp,
        n_ff_shexp=spec.n_ff_shexp,
        context_length=spec.context_length,
    )


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("tiny", {}),
        ("tiny-moe", {}),
        ("tiny-next", {}),
        ("tiny", {"n_layer": 8, "full_attention_interval": 4, "mtp": False}),
        ("tiny", {"n_vocab": 640, "context_length": 262144, "rms_eps": 1e-5}),
    ],
    ids=["tiny", "tiny-moe", "tiny-next", "interval-4-no-mtp", "padded-vocab"],
)
def test_config_matches_the_spec_that_wrote_the_file(
    make_model: MakeModel, name: str, overrides: dict[str, Any]
) -> None:
    spec = dataclasses.replace(preset(name), **overrides)
    assert GGUFFile(make_model(name, **overrides)).config == _expected_config(spec)


def test_recurrent_layers_key_overrides_the_interval(tiny_qwen35: Path, tmp_path: Path) -> None:
    pattern = [True, True, True, False, False]  # trunk + MTP block, as llama.cpp reads it
    path = _edited(
        tmp_path,
        tiny_qwen35,
        lambda c: c.set("qwen35.attention.recurrent_layers", pattern, VT.ARRAY, VT.BOOL),
    )
    assert GGUFFile(path).config.recurrent == (True, True, True, False)


def _same_logits_as(original: Path, variant: Path) -> None:
    np.testing.assert_array_equal(
        prefill_logits(load_model(variant), PROMPT), prefill_logits(load_model(original), PROMPT)
    )


def test_ollama_per_layer_head_count_kv(tiny_qwen35: Path, tmp_path: Path) -> None:
    per_layer = [0, 2, 0, 2, 2]  # zero for linear-attention layers
    path = _edited(
        tmp_path,
        tiny_qwen35,
        lambda c: c.set("qwen35.attention.head_count_kv", per_layer, VT.ARRAY, VT.UINT32),
    )
    assert GGUFFile(path).config.n_head_kv == 2
    _same_logits_as(tiny_qwen35, path)


def test_ollama_v_head_reordered_true_is_the_llama_cpp_layout(
    tiny_qwen35: Path, tmp_path: Path
) -> None:
    path = _edited(
        tmp_path, tiny_qwen35, lambda c: c.set("qwen35.ssm.v_head_reordered", True, VT.BOOL)
    )
    assert GGUFFile(path).config.v_heads_tiled
    _same_logits_as(tiny_qwen35, path)


def test_ollama_v_head_reordered_false_means_grouped_heads(
    tiny_qwen35: Path, tmp_path: Path
) -> None:
    path = _edited(
        tmp_path, tiny_qwen35, lambda c: c.set("qwen35.ssm.v_head_reordered", False, VT.BOOL)
    )
    assert not GGUFFile(path).config.v_heads_tiled
    grouped = prefill_logits(load_model(path), PROMPT)  # Hk = 2, Hv = 4: the order matters
    assert not np.allclose(grouped, prefill_logits(load_model(tiny_qwen35), PROMPT), atol=1e-2)


def test_ollama_dt_bias_without_suffix(tiny_qwen35: Path, tmp_path: Path) -> None:
    def rename(c: Contents) -> None:
        c.tensors = {n.removesuffix(".bias") if n.endswith("ssm_dt.bias") else n: t
                     for n, t in c.tensors.items()}  # fmt: skip

    path = _edited(tmp_path, tiny_qwen35, rename)
    names = GGUFFile(path).tensor_names
    assert "blk.0.ssm_dt" in names and "blk.0.ssm_dt.bias" not in names
    _same_logits_as(tiny_qwen35, path)


# --- exact repack of Q8_0 / Q4_0 / Q4_1 into MLX's affine layout ----------------------------------


def _test_matrices() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    wide = rng.standard_normal((6, 256)) * np.exp(rng.uniform(-9, 9, (6, 1)))  # 1e-4 .. 1e4
    edges = rng.standard_normal((5, 64))
    edges[0] = 0.0  # zero scale
    edges[1] = 2.5  # constant block (Q4_1: zero range)
    edges[2, :32] = -1.0
    edges[3, 32:] = np.linspace(-1, 1, 32)
    return {
        "normal": rng.standard_normal((48, 96)),
        "wide-range": wide,
        "edge-blocks": edges,
    }


QUANT_TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1]


@pytest.fixture(scope="module")
def quantized_file(tiny_qwen35: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's metadata (so the reader accepts it) and only the test matrices."""
    contents = Contents.read(tiny_qwen35)
    contents.tensors = {
        f"{qtype.name}.{label}": (gguf.quants.quantize(x.astype(np.float32), qtype), qtype)
        for qtype in QUANT_TYPES
        for label, x in _test_matrices().items()
    }
    return contents.write(tmp_path_factory.mktemp("repack") / "quantized.gguf")


def _reference(path: Path, name: str) -> np.ndarray:
    (t,) = (t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return gguf.quants.dequantize(t.data, t.tensor_type)


@pytest.mark.parametrize("label", list(_test_matrices()))
@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_repack_dequantizes_exactly(quantized_file: Path, qtype: QT, label: str) -> None:
    name = f"{qtype.name}.{label}"
    w = GGUFFile(quantized_file).load(name)
    assert isinstance(w, QuantizedWeight)
    assert (w.bits, w.group_size) == (8 if qtype == QT.Q8_0 else 4, 32)
    ours = np.array(w.dequantize())
    ref = _reference(quantized_file, name)
    assert ours.dtype == ref.dtype == np.float32
    assert ours.shape == ref.shape == w.shape
    # Bit-identical up to the sign of zero: Q4_0's negative scales make gguf-py's d*(q-8)
    # a -0.0 where MLX's d*q + (-8d) gives +0.0. Adding +0.0 maps -0.0 to +0.0 and no
    # other value changes.
    np.testing.assert_array_equal((ours + 0.0).view(np.uint32), (ref + 0.0).view(np.uint32))


@pytest.mark.parametrize("label", list(_test_matrices()))
@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_quantized_matmul_matches_dequantized_product(
    quantized_file: Path, qtype: QT, label: str
) -> None:
    name = f"{qtype.name}.{label}"
    w = GGUFFile(quantized_file).load(name)
    assert isinstance(w, QuantizedWeight)
    ref = _reference(quantized_file, name).astype(np.float64)
    x = np.random.default_rng(2).standard_normal((7, ref.shape[1])).astype(np.float32)
    y = mx.quantized_matmul(
        mx.array(x), w.weight, w.scales, w.biases, transpose=True, group_size=32, bits=w.bits
    )
    expected = x.astype(np.float64) @ ref.T
    # Relative to each output's magnitude: the wide-range rows span eight orders.
    scale = np.maximum(np.abs(expected).max(axis=0), 1e-30)
    assert (np.abs(np.array(y) - expected) / scale).max() < 1e-5


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_unquantized_file_loads_the_same_values_as_float(quantized_file: Path, qtype: QT) -> None:
    name = f"{qtype.name}.normal"
    w = GGUFFile(quantized_file, quantized=False).load(name)
    assert isinstance(w, mx.array) and w.dtype == mx.float32
    np.testing.assert_array_equal(np.array(w), _reference(quantized_file, name))
