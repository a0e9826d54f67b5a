"""Read Qwen3.5 / Qwen3.6 / Qwen3-Next GGUF files: metadata, a frozen config, lazy tensors.

Tensors are read one at a time from a memory map, so peak memory stays near the
model's own size. Float tensors load as they are; Q4_0, Q4_1 and Q8_0 are
repacked, without loss, into MLX's affine layout for `mx.quantized_matmul`;
every other type gguf-py understands is dequantized at load.

Shapes follow numpy order (the reverse of ggml's `ne`), so a matrix is
`(out, in)` and applies as `x @ W.T` (MODEL_SPEC §0).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT

SUPPORTED_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
GROUP_SIZE = 32  # block size of Q4_0 / Q4_1 / Q8_0, used as MLX's group size


class GGUFError(ValueError):
    """A model file cannot be used. The message names the file and what is wrong."""


class NotGGUFError(GGUFError):
    pass


class TruncatedGGUFError(GGUFError):
    pass


class UnsupportedArchitectureError(GGUFError):
    pass


class MissingMetadataError(GGUFError):
    pass


class MissingTensorError(GGUFError):
    pass


class TensorShapeError(GGUFError):
    pass


class UnsupportedTensorTypeError(GGUFError):
    pass


@dataclass(frozen=True)
class QuantizedWeight:
    """A matrix in MLX's affine quantized layout: `w ≈ scales * q + biases` per group."""

    weight: mx.array  # uint32, (out, in * bits / 32)
    scales: mx.array  # (out, in / group_size)
    biases: mx.array  # (out, in / group_size)
    bits: int
    group_size: int
    shape: tuple[int, int]  # logical (out, in)

    def dequantize(self) -> mx.array:
        return mx.dequantize(
            self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits
        )


Weight = mx.array | QuantizedWeight


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Qwen3.5-family hybrid model, read from GGUF metadata (MODEL_SPEC §2)."""

    arch: str
    name: str
    n_vocab: int
    n_embd: int
    n_layer: int  # trunk layers, without MTP blocks
    n_mtp: int  # MTP (nextn) blocks after the trunk: 0 or 1
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_dim: int
    rope_base: float
    rope_sections: tuple[int, ...]  # empty for plain NeoX (qwen3next)
    recurrent: tuple[bool, ...]  # per trunk layer: True = Gated DeltaNet, False = attention
    rms_eps: float
    conv_kernel: int
    ssm_dk: int  # key head dim (= value head dim)
    ssm_dv: int
    ssm_hk: int  # key heads
    ssm_hv: int  # value heads
    v_heads_tiled: bool  # qwen35*: value head j reads key head j % Hk; else j // (Hv/Hk)
    n_ff: int  # dense FFN width (0 for MoE)
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    context_length: int

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @property
    def conv_channels(self) -> int:
        return 2 * self.ssm_hk * self.ssm_dk + self.ssm_hv * self.ssm_dv

    @property
    def n_linear_layers(self) -> int:
        return sum(self.recurrent)

    @property
    def n_attention_layers(self) -> int:
        """Full-attention trunk layers (the MTP block's attention is counted apart)."""
        return self.n_layer - self.n_linear_layers

    def kv_bytes_per_token(self, bytes_per_element: int, include_mtp: bool = True) -> int:
        layers = self.n_attention_layers + (self.n_mtp if include_mtp else 0)
        return 2 * layers * self.n_head_kv * self.head_dim * bytes_per_element

    def linear_state_bytes(self) -> int:
        """f32 conv + recurrent state of all Gated DeltaNet layers for one sequence."""
        conv = (self.conv_kernel - 1) * self.conv_channels
        rec = self.ssm_hv * self.ssm_dv * self.ssm_dk
        return 4 * self.n_linear_layers * (conv + rec)


class TensorFile:
    """An open GGUF file of any architecture: `metadata` and tensors loaded on demand.

    `quantized=False` makes every `load` dequantize to float, so a model built on the file
    runs its float forward over exactly the weights the quantized one sees (the reference
    for quantized-kernel tests).
    """

    def __init__(self, path: str | os.PathLike[str], *, quantized: bool = True) -> None:
        self.path = Path(path)
        self.quantized = quantized
        self._reader = _open_reader(self.path)
        self.metadata: dict[str, Any] = {
            name: _field_value(field)
            for name, field in self._reader.fields.items()
            if not name.startswith("GGUF.")
        }
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._check_bounds()

    # -- metadata ---------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    # -- tensors ----------------------------------------------------------------------------
    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor_type(self, name: str) -> QT:
        return self._info(name).tensor_type

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Logical numpy-order shape (reversed ggml `ne`)."""
        return tuple(int(d) for d in reversed(self._info(name).shape.tolist()))

    def tensor_bytes(self, name: str) -> int:
        return int(self._info(name).n_bytes)

    def load_numpy(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor as float32 numpy (dequantized if needed), checked against `shape`."""
        info = self._info(name)
        logical = self.tensor_shape(name)
        _check_shape(self.path, name, logical, shape)
        if info.tensor_type in (QT.F32, QT.F16, QT.BF16, QT.F64):
            if info.tensor_type == QT.BF16:
                return gguf.quants.dequantize(info.data, QT.BF16).reshape(logical)
            return np.asarray(info.data, dtype=np.float32).reshape(logical)
        try:
            out = gguf.quants.dequantize(info.data, info.tensor_type)
        except NotImplementedError as e:
            raise UnsupportedTensorTypeError(
                f"{self.path}: tensor {name} has type {info.tensor_type.name}, "
                "which gguf-py cannot dequantize"
            ) from e
        return np.asarray(out, dtype=np.float32).reshape(logical)

    def load(
        self,
        name: str,
        shape: tuple[int, ...] | None = None,
        dtype: mx.Dtype = mx.float32,
        quantized: bool = True,
    ) -> Weight:
        """Load one tensor for compute.

        Q4_0 / Q4_1 / Q8_0 matrices come back as `QuantizedWeight` (exact repack) when
        `quantized` here and on the file; everything else as an `mx.array` of `dtype`.
        """
        info = self._info(name)
        logical = self.tensor_shape(name)
        _check_shape(self.path, name, logical, shape)
        if quantized and self.quantized and info.tensor_type in _REPACKERS and len(logical) == 2:
            return _REPACKERS[info.tensor_type](np.asarray(info.data), logical, dtype)
        return mx.array(self.load_numpy(name)).astype(dtype)

    def _info(self, name: str) -> gguf.ReaderTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise MissingTensorError(
                f"{self.path}: tensor {name} missing; is this a {self.get('general.architecture')} "
                "file written by llama.cpp's converter?"
            ) from None

    def _check_bounds(self) -> None:
        size = self.path.stat().st_size
        for t in self._tensors.values():
            if t.data_offset + t.n_bytes > size:
                raise TruncatedGGUFError(
                    f"{self.path}: truncated: tensor {t.name} needs bytes up to "
                    f"{t.data_offset + t.n_bytes} but the file has {size}"
                )


class GGUFFile(TensorFile):
    """An open Qwen3.5-family model file: a `TensorFile` with its frozen `config`."""

    def __init__(self, path: str | os.PathLike[str], *, quantized: bool = True) -> None:
        super().__init__(path, quantized=quantized)
        self.config = _read_config(self.path, self.metadata)


def _open_reader(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise NotGGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, OverflowError, UnicodeDecodeError, KeyError) as e:
        # The reader indexes a memory map; running off its end means a cut-off header.
        raise TruncatedGGUFError(f"{path}: truncated or corrupt GGUF header ({e})") from e


def _field_value(field: gguf.ReaderField) -> Any:
    if not field.types:
        return None
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return field.contents()
        return [v.item() if hasattr(v, "item") else v for v in field.contents()]
    value = field.contents()
    return value.item() if hasattr(value, "item") else value


def _check_shape(
    path: Path, name: str, actual: tuple[int, ...], expected: tuple[int, ...] | None
) -> None:
    if expected is None:
        return
    squeezed_equal = tuple(d for d in actual if d != 1) == tuple(d for d in expected if d != 1)
    if actual != tuple(expected) and not squeezed_equal:
        raise TensorShapeError(
            f"{path}: tensor {name} has shape {actual}, expected {tuple(expected)} "
            "from the file's hyper-parameters"
        )


def _read_config(path: Path, md: dict[str, Any]) -> ModelConfig:
    arch = md.get("general.architecture")
    if arch is None:
        raise MissingMetadataError(f"{path}: metadata key general.architecture missing")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedArchitectureError(
            f"{path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"
        )

    def key(name: str, default: Any = ...) -> Any:
        full = f"{arch}.{name}"
        if full in md:
            return md[full]
        if default is ...:
            raise MissingMetadataError(f"{path}: metadata key {full} missing")
        return default

    block_count = int(key("block_count"))
    n_mtp = int(key("nextn_predict_layers", 0))
    if not 0 <= n_mtp < block_count:
        raise GGUFError(f"{path}: {arch}.nextn_predict_layers={n_mtp} out of range")
    n_layer = block_count - n_mtp
    n_embd = int(key("embedding_length"))
    n_head = _layer_value(key("attention.head_count"))
    head_kv = key("attention.head_count_kv", n_head)
    recurrent_override = key("attention.recurrent_layers", None)
    if recurrent_override is not None:
        recurrent = tuple(bool(x) for x in list(recurrent_override)[:n_layer])
    else:
        interval = int(key("full_attention_interval", 4))
        recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))
    if isinstance(head_kv, list):  # Ollama writes a per-layer array; take an attention layer's
        attn_layers = [i for i, r in enumerate(recurrent) if not r]
        head_kv = head_kv[attn_layers[0]] if attn_layers else max(head_kv)
    head_dim = int(key("attention.key_length", n_embd // n_head))
    ssm_dk = int(key("ssm.state_size"))
    ssm_hv = int(key("ssm.time_step_rank"))
    ssm_hk = int(key("ssm.group_count"))
    inner = int(key("ssm.inner_size"))
    if inner % ssm_hv:
        raise GGUFError(f"{path}: ssm.inner_size={inner} not divisible by time_step_rank={ssm_hv}")
    tiled_default = arch in ("qwen35", "qwen35moe")
    sections = tuple(int(s) for s in key("rope.dimension_sections", [])) if tiled_default else ()
    tokens = md.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens) if tokens is not None else int(key("vocab_size"))
    n_expert = int(key("expert_count", 0))
    n_ff = int(key("feed_forward_length", 0)) if n_expert == 0 else 0
    n_expert_used = int(key("expert_used_count", 0))
    return ModelConfig(
        arch=arch,
        name=str(md.get("general.name", path.stem)),
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=n_layer,
        n_mtp=n_mtp,
        n_head=n_head,
        n_head_kv=int(head_kv),
        head_dim=head_dim,
        rope_dim=int(key("rope.dimension_count", head_dim)),
        rope_base=float(key("rope.freq_base", 10000.0)),
        rope_sections=sections,
        recurrent=recurrent,
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        conv_kernel=int(key("ssm.conv_kernel")),
        ssm_dk=ssm_dk,
        ssm_dv=inner // ssm_hv,
        ssm_hk=ssm_hk,
        ssm_hv=ssm_hv,
        v_heads_tiled=bool(key("ssm.v_head_reordered", tiled_default)),
        n_ff=n_ff,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_ff_exp=int(key("expert_feed_forward_length", 0)),
        n_ff_shexp=int(key("expert_shared_feed_forward_length", 0)),
        context_length=int(key("context_length", 4096)),
    )


def _layer_value(v: Any) -> int:
    return int(max(v)) if isinstance(v, list) else int(v)


# -- exact repack of llama.cpp's simple block quants into MLX's affine layout -------------------


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ints (out, in) into uint32 words, element j at bit bits*(j % per_word)."""
    if bits == 8 and sys.byteorder == "little":  # the bytes already are the words (9B: minutes)
        return np.ascontiguousarray(q, dtype=np.uint8).view(np.uint32)
    per_word = 32 // bits
    rows, cols = q.shape
    q = q.astype(np.uint32).reshape(rows, cols // per_word, per_word)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)[None, None, :]
    return np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)


def _blocks(raw: np.ndarray, shape: tuple[int, int], block_bytes: int) -> np.ndarray:
    out_dim, in_dim = shape
    return raw.reshape(out_dim, in_dim // GROUP_SIZE, block_bytes)


def _scale(b: np.ndarray, at: int) -> np.ndarray:
    return b[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _quantized(
    q: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    bits: int,
    shape: tuple[int, int],
    dtype: mx.Dtype,
) -> QuantizedWeight:
    # Scales and biases are f16 in the file; f32 holds them (and bias = -8d, -128d) exactly.
    sdtype = mx.float32 if dtype == mx.float32 else dtype
    return QuantizedWeight(
        weight=mx.array(_pack(q.reshape(shape), bits)),
        scales=mx.array(scales).astype(sdtype),
        biases=mx.array(biases).astype(sdtype),
        bits=bits,
        group_size=GROUP_SIZE,
        shape=shape,
    )


def _repack_q8_0(raw: np.ndarray, shape: tuple[int, int], dtype: mx.Dtype) -> QuantizedWeight:
    b = _blocks(raw, shape, 2 + GROUP_SIZE)  # f16 d, int8 q[32]: w = d * q
    d = _scale(b, 0)
    q = b[..., 2:] ^ np.uint8(0x80)  # int8 q + 128 as uint8
    return _quantized(q, d, -128.0 * d, 8, shape, dtype)


def _repack_q4_0(raw: np.ndarray, shape: tuple[int, int], dtype: mx.Dtype) -> QuantizedWeight:
    b = _blocks(raw, shape, 2 + GROUP_SIZE // 2)  # f16 d, nibbles: w = d * (q - 8)
    d = _scale(b, 0)
    nib = b[..., 2:]
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1)  # low nibbles are elements 0..15
    return _quantized(q, d, -8.0 * d, 4, shape, dtype)


def _repack_q4_1(raw: np.ndarray, shape: tuple[int, int], dtype: mx.Dtype) -> QuantizedWeight:
    b = _blocks(raw, shape, 4 + GROUP_SIZE // 2)  # f16 d, f16 m, nibbles: w = d * q + m
    d, m = _scale(b, 0), _scale(b, 2)
    nib = b[..., 4:]
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1)
    return _quantized(q, d, m, 4, shape, dtype)


_REPACKERS = {QT.Q8_0: _repack_q8_0, QT.Q4_0: _repack_q4_0, QT.Q4_1: _repack_q4_1}
