"""Deterministic random-weight GGUF models for Qwen3.5 (`qwen35`, `qwen35moe`) and Qwen3-Next.

`write_model(path, spec)` writes a file with the metadata keys, tensor names, shapes and dtypes
llama.cpp's converter produces (MODEL_SPEC §2, §3, §12, §13), so llama.cpp loads it and our
engine can be checked against it. Every tensor draws from its own generator seeded with
`(spec.seed, crc32(name))`, so the same spec gives identical bytes, and a float and a quantized
file of one spec hold the same underlying weights.

Initialisation keeps a random model numerically healthy through all layers: matrices are
N(0, 1/fan_in) (unit-variance outputs for unit-variance inputs) except the projections back into
the residual stream (scaled down by √(2·n_layer); FFN ones scaled up again in tied models),
norms 1 + small noise, GDN decays exp(g) with median ~0.96 per token (5%-95%: 0.45-0.998), and
logits of standard deviation `LOGIT_STD`, decisive enough that greedy decoding rarely meets
near-ties. Quantization noise then moves the logits little (q8_0: correlation > 0.99 with f32).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType, quants
from gguf.constants import GGML_QUANT_SIZES

from engine.corpus import CHAT_TEMPLATE, Vocab, build_vocab

ARCHS = ("qwen35", "qwen35moe", "qwen3next")
QUANT_TYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_k": (GGMLQuantizationType.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
}
LOGIT_STD = 6.0
"""Standard deviation of the logits of a random model (LM head rows ~ N(0, LOGIT_STD²/E))."""
NORM_NOISE = 0.1
CHUNK_ELEMENTS = 1 << 24
"""Tensors are generated and encoded this many elements at a time to bound memory."""


@dataclass(frozen=True)
class ModelSpec:
    """Hyper-parameters of a generated model; the defaults are the `tiny` preset.

    `n_layer` counts trunk layers; `mtp` adds one NextN block after them. `vocab_size` is the
    number of real tokens (bytes + merges + specials); `n_vocab`, when set, pads the token list
    and the embedding rows to that size with `[PAD{i}]` tokens (their rows are zero).
    `rope_sections` is not written for `qwen3next`. Expert fields are used by MoE archs only.
    `quant` is the type of every quantizable matrix (§12); a matrix whose rows are not a
    multiple of that type's block size is written as q8_0 (rows % 32 == 0) or f16 instead,
    as llama.cpp's quantizer falls back.
    """

    arch: str = "qwen35"
    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    rope_dim: int = 16
    rope_sections: tuple[int, int, int, int] = (11, 11, 10, 0)
    rope_base: float = 10_000_000.0
    full_attention_interval: int = 2
    ssm_group_count: int = 2
    ssm_time_step_rank: int = 4
    ssm_state_size: int = 16
    conv_kernel: int = 4
    n_ff: int = 128
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    mtp: bool = True
    tied_embeddings: bool = False
    vocab_size: int = 512
    n_vocab: int | None = None
    quant: str = "f32"
    seed: int = 0
    rms_eps: float = 1e-6
    context_length: int = 4096
    name: str = "tiny"

    def __post_init__(self) -> None:
        def need(ok: bool, why: str) -> None:
            if not ok:
                raise ValueError(f"ModelSpec {self.name!r}: {why}")

        need(self.arch in ARCHS, f"arch {self.arch!r} not in {ARCHS}")
        need(self.quant in QUANT_TYPES, f"quant {self.quant!r} not in {tuple(QUANT_TYPES)}")
        need(self.n_layer >= 1 and self.full_attention_interval >= 1, "need layers and interval")
        need(self.n_head % self.n_head_kv == 0, "n_head must be a multiple of n_head_kv")
        need(
            self.ssm_time_step_rank % self.ssm_group_count == 0,
            "ssm_time_step_rank (Hv) must be a multiple of ssm_group_count (Hk)",
        )
        need(self.rope_dim % 2 == 0 and self.rope_dim <= self.head_dim, "rope_dim even, <= D")
        if self.arch != "qwen3next":
            need(len(self.rope_sections) == 4, "rope_sections needs 4 entries")
            need(sum(self.rope_sections) <= self.head_dim, "sum(rope_sections) must be <= D")
            need(any(s > 0 for s in self.rope_sections[:3]), "a first-three section must be > 0")
        need(not (self.mtp and self.arch == "qwen3next"), "qwen3next files carry no MTP block")
        if self.is_moe:
            need(0 < self.n_expert_used <= self.n_expert, "need 0 < n_expert_used <= n_expert")
            need(self.n_ff_exp > 0 and self.n_ff_shexp > 0, "MoE needs n_ff_exp and n_ff_shexp")
        need(self.n_vocab is None or self.n_vocab >= self.vocab_size, "n_vocab < vocab_size")

    @property
    def is_moe(self) -> bool:
        return self.arch != "qwen35"

    @property
    def n_tokens(self) -> int:
        """Rows of the embedding / LM head = length of the token list (padding included)."""
        return self.vocab_size if self.n_vocab is None else self.n_vocab

    @property
    def n_layer_all(self) -> int:
        """`block_count`: trunk layers plus the MTP block."""
        return self.n_layer + int(self.mtp)

    def is_recurrent(self, layer: int) -> bool:
        """Whether trunk layer `layer` is a Gated DeltaNet layer (MODEL_SPEC §1)."""
        return layer < self.n_layer and (layer + 1) % self.full_attention_interval != 0


_TINY = ModelSpec()
_MOE = dataclasses.replace(_TINY, n_expert=4, n_expert_used=2, n_ff_exp=64, n_ff_shexp=64)
_REAL = dataclasses.replace(  # what the released Qwen3.5 files share
    _TINY,
    head_dim=256,
    rope_dim=64,
    full_attention_interval=4,
    ssm_state_size=128,
    vocab_size=32768,
    n_vocab=248320,
    context_length=262144,
)
# fmt: off
PRESETS: dict[str, ModelSpec] = {
    "tiny": _TINY,
    "tiny-moe": dataclasses.replace(_MOE, name="tiny-moe", arch="qwen35moe"),
    "tiny-next": dataclasses.replace(
        _MOE, name="tiny-next", arch="qwen3next", mtp=False, rope_sections=(0, 0, 0, 0)),
    "demo": dataclasses.replace(
        _TINY, name="demo", n_layer=8, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
        rope_dim=32, full_attention_interval=4, ssm_group_count=2, ssm_time_step_rank=4,
        ssm_state_size=64, n_ff=768, vocab_size=8192, context_length=32768),
    "bench-50m": dataclasses.replace(
        _TINY, name="bench-50m", n_layer=8, n_embd=512, n_head=8, n_head_kv=2, head_dim=64,
        rope_dim=32, full_attention_interval=4, ssm_group_count=4, ssm_time_step_rank=8,
        ssm_state_size=64, n_ff=1536, vocab_size=32768, tied_embeddings=True,
        context_length=32768),
    "qwen3.5-0.8b": dataclasses.replace(
        _REAL, name="qwen3.5-0.8b", n_layer=24, n_embd=1024, n_head=8, n_head_kv=2,
        ssm_group_count=16, ssm_time_step_rank=16, n_ff=3584, tied_embeddings=True,
        quant="q8_0"),
    "qwen3.5-9b": dataclasses.replace(
        _REAL, name="qwen3.5-9b", n_layer=32, n_embd=4096, n_head=16, n_head_kv=4,
        ssm_group_count=16, ssm_time_step_rank=32, n_ff=12288, quant="q4_k"),
}
# fmt: on


def preset(name: str) -> ModelSpec:
    """The named preset; raises KeyError listing the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None


# ------------------------------------------------------------------------------------------
# Tensor plan: (name, numpy shape, initialiser, stays-f32) for every tensor, in file order.


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]
    init: str  # "matrix" | "embed" | "head" | "norm" | "conv" | "ssm_a" | "dt_bias"
    keep_f32: bool = False


def _plan(spec: ModelSpec) -> list[_Tensor]:
    E, V = spec.n_embd, spec.n_tokens
    plan = [
        _Tensor("token_embd.weight", (V, E), "embed"),
        _Tensor("output_norm.weight", (E,), "norm"),
    ]
    if not spec.tied_embeddings:
        plan.append(_Tensor("output.weight", (V, E), "head"))
    for i in range(spec.n_layer_all):
        p = f"blk.{i}."
        plan += [_Tensor(p + "attn_norm.weight", (E,), "norm")]
        plan += _gdn_tensors(spec, p) if spec.is_recurrent(i) else _attention_tensors(spec, p)
        plan += [_Tensor(p + "post_attention_norm.weight", (E,), "norm")]
        plan += _ffn_tensors(spec, p)
        if i >= spec.n_layer:
            plan += [
                _Tensor(p + "nextn.eh_proj.weight", (E, 2 * E), "matrix"),
                _Tensor(p + "nextn.enorm.weight", (E,), "norm"),
                _Tensor(p + "nextn.hnorm.weight", (E,), "norm"),
                _Tensor(p + "nextn.shared_head_norm.weight", (E,), "norm"),
            ]
    return plan


def _gdn_tensors(spec: ModelSpec, p: str) -> list[_Tensor]:
    E, Hv = spec.n_embd, spec.ssm_time_step_rank
    Cq = spec.ssm_group_count * spec.ssm_state_size
    Cv = Hv * spec.ssm_state_size
    if spec.arch == "qwen3next":
        ba = [_Tensor(p + "ssm_ba.weight", (2 * Hv, E), "matrix")]
    else:
        ba = [
            _Tensor(p + "ssm_beta.weight", (Hv, E), "matrix"),
            _Tensor(p + "ssm_alpha.weight", (Hv, E), "matrix"),
        ]
    return [
        _Tensor(p + "attn_qkv.weight", (2 * Cq + Cv, E), "matrix"),
        _Tensor(p + "attn_gate.weight", (Cv, E), "matrix"),
        *ba,
        _Tensor(p + "ssm_conv1d.weight", (2 * Cq + Cv, spec.conv_kernel), "conv", keep_f32=True),
        _Tensor(p + "ssm_dt.bias", (Hv,), "dt_bias"),
        _Tensor(p + "ssm_a", (Hv,), "ssm_a"),
        _Tensor(p + "ssm_norm.weight", (spec.ssm_state_size,), "norm"),
        _Tensor(p + "ssm_out.weight", (E, Cv), "out"),
    ]


def _attention_tensors(spec: ModelSpec, p: str) -> list[_Tensor]:
    E, D = spec.n_embd, spec.head_dim
    return [
        _Tensor(p + "attn_q.weight", (2 * spec.n_head * D, E), "matrix"),
        _Tensor(p + "attn_k.weight", (spec.n_head_kv * D, E), "matrix"),
        _Tensor(p + "attn_v.weight", (spec.n_head_kv * D, E), "matrix"),
        _Tensor(p + "attn_q_norm.weight", (D,), "norm"),
        _Tensor(p + "attn_k_norm.weight", (D,), "norm"),
        _Tensor(p + "attn_output.weight", (E, spec.n_head * D), "out"),
    ]


def _dense_ffn_tensors(p: str, E: int, n_ff: int) -> list[_Tensor]:
    return [
        _Tensor(p + "ffn_gate.weight", (n_ff, E), "matrix"),
        _Tensor(p + "ffn_up.weight", (n_ff, E), "matrix"),
        _Tensor(p + "ffn_down.weight", (E, n_ff), "ffn_out"),
    ]


def _ffn_tensors(spec: ModelSpec, p: str) -> list[_Tensor]:
    E = spec.n_embd
    if not spec.is_moe:
        return _dense_ffn_tensors(p, E, spec.n_ff)
    X, F, S = spec.n_expert, spec.n_ff_exp, spec.n_ff_shexp
    return [
        _Tensor(p + "ffn_gate_inp.weight", (X, E), "matrix", keep_f32=True),
        _Tensor(p + "ffn_gate_exps.weight", (X, F, E), "matrix"),
        _Tensor(p + "ffn_up_exps.weight", (X, F, E), "matrix"),
        _Tensor(p + "ffn_down_exps.weight", (X, E, F), "ffn_out"),
        _Tensor(p + "ffn_gate_inp_shexp.weight", (E,), "matrix"),
        _Tensor(p + "ffn_gate_shexp.weight", (S, E), "matrix"),
        _Tensor(p + "ffn_up_shexp.weight", (S, E), "matrix"),
        _Tensor(p + "ffn_down_shexp.weight", (E, S), "ffn_out"),
    ]


def parameter_count(spec: ModelSpec) -> int:
    """Number of weights in the file, padded vocabulary rows included."""
    return sum(int(np.prod(t.shape)) for t in _plan(spec))


# ------------------------------------------------------------------------------------------
# Values and encodings.


class _Weights(Protocol):
    """What drawing and encoding a file's tensors read from its spec (model or drafter)."""

    @property
    def seed(self) -> int: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def tied_embeddings(self) -> bool: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def quant(self) -> str: ...


def _ggml_type(spec: _Weights, t: _Tensor) -> GGMLQuantizationType:
    """§12: 1-D tensors, norms, conv taps and the router stay F32; matrices take `spec.quant`."""
    if t.keep_f32 or len(t.shape) == 1:
        return GGMLQuantizationType.F32
    qtype = QUANT_TYPES[spec.quant][0]
    row = t.shape[-1]
    if row % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    return GGMLQuantizationType.Q8_0 if row % 32 == 0 else GGMLQuantizationType.F16


def _values(
    spec: _Weights, t: _Tensor, weights: Mapping[str, np.ndarray] | None = None
) -> Iterator[np.ndarray]:
    """The float32 weights of `t`, in chunks along axis 0 (one generator stream per tensor);
    `weights[t.name]` instead when `weights` is given (a trained model)."""
    if weights is not None:
        w = np.asarray(weights[t.name], dtype=np.float32)
        if w.shape != t.shape:
            raise ValueError(f"{t.name}: weights have shape {w.shape}, the file needs {t.shape}")
        yield w
        return
    rng = np.random.default_rng([spec.seed, zlib.crc32(t.name.encode())])
    fan_in = t.shape[-1]
    if t.init == "ssm_a":  # −exp(A_log), A_log ~ U[log 1, log 16)
        yield -np.exp(rng.uniform(0.0, np.log(16.0), t.shape)).astype(np.float32)
        return
    if t.init == "dt_bias":  # softplus⁻¹(dt) for dt log-uniform in [1e-3, 1e-1] (Mamba init)
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), t.shape))
        yield np.log(np.expm1(dt)).astype(np.float32)
        return
    std = {
        "matrix": 1.0 / np.sqrt(fan_in),
        # GPT-2's scaled init: 2·n_layer residual branches add up to about the embedding's
        # variance, which keeps the random model far from chaotic (quantization noise stays
        # small in the logits) while context still matters.
        "out": 1.0 / np.sqrt(fan_in * 2 * spec.n_layer),
        # A tied head scores each token's own embedding ~LOGIT_STD standard deviations above
        # the rest (it is in the residual stream) unless something larger drowns it there.
        # Loud FFNs do, with per-token features: copies of the input token stay rare (<5%).
        "ffn_out": (2 * LOGIT_STD if spec.tied_embeddings else 1.0)
        / np.sqrt(fan_in * 2 * spec.n_layer),
        "conv": 1.0 / np.sqrt(fan_in),
        "head": LOGIT_STD / np.sqrt(fan_in),
        # A tied embedding doubles as the LM head, so it takes the head's scale.
        "embed": LOGIT_STD / np.sqrt(fan_in) if spec.tied_embeddings else 1.0,
        "norm": NORM_NOISE,
    }[t.init]
    rows_per_chunk = max(1, CHUNK_ELEMENTS // int(np.prod(t.shape[1:], dtype=np.int64)))
    for start in range(0, t.shape[0], rows_per_chunk):
        rows = min(rows_per_chunk, t.shape[0] - start)
        w = rng.standard_normal((rows, *t.shape[1:]), dtype=np.float32) * np.float32(std)
        if t.init == "norm":
            w += np.float32(1.0)
        elif t.init in ("embed", "head") and start + rows > spec.vocab_size:
            w[max(0, spec.vocab_size - start) :] = 0.0  # padding tokens score 0: never the top
        yield w


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K-encode float rows (last dim a multiple of 256) into ggml's 144-byte super-blocks.

    gguf-py 0.19.0 only dequantizes Q4_K. Each 32-value sub-block j decodes as
    x ≈ d·sc_j·q − dmin·m_j with 6-bit sc_j, m_j and 4-bit q. Here m_j and sc_j are rounded
    up (and the f16 `d`, `dmin` too), so the offset lifts the whole sub-block to ≥ 0 and the
    step covers its range: nothing clips, and every value lands within half a step
    (≤ (range_j + dmin)/30 + d/2). Returns uint8 of shape (..., row/256·144), the layout
    `gguf.quants.dequantize` reads.
    """
    if x.shape[-1] % 256:
        raise ValueError(f"Q4_K rows must be a multiple of 256, got {x.shape[-1]}")
    blocks = x.astype(np.float32).reshape(-1, 8, 32)
    lift = np.maximum(-blocks.min(axis=-1), 0.0)
    dmin = _f16_at_least(lift.max(axis=-1) / 63.0)
    m = _levels(lift, dmin[:, None], np.ceil, 63)
    offset = dmin[:, None] * m
    scale = (blocks.max(axis=-1) + offset) / 15.0
    d = _f16_at_least(scale.max(axis=-1) / 63.0)
    sc = _levels(scale, d[:, None], np.ceil, 63)
    q = _levels(blocks + offset[..., None], (d[:, None] * sc)[..., None], np.rint, 15)
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    packed_scales = np.concatenate(
        [
            (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
            (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4),
        ],
        axis=-1,
    )
    out = np.concatenate(
        [
            d.astype(np.float16).reshape(-1, 1).view(np.uint8),
            dmin.astype(np.float16).reshape(-1, 1).view(np.uint8),
            packed_scales,
            (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128),
        ],
        axis=-1,
    )
    return out.reshape(*x.shape[:-1], x.shape[-1] // 256 * 144)


def _f16_at_least(v: np.ndarray) -> np.ndarray:
    """The smallest float16 ≥ `v`, as float32."""
    h = v.astype(np.float16)
    h = np.where(h.astype(np.float32) < v, np.nextafter(h, np.float16(np.inf)), h)
    return h.astype(np.float32)


def _levels(num: np.ndarray, den: np.ndarray, rounding: Any, top: int) -> np.ndarray:
    """`rounding(num / den)` clipped to 0..top, and 0 where `den` is 0 (an all-zero block)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.clip(np.where(den > 0, rounding(num / den), 0.0), 0, top)


def _encode(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == GGMLQuantizationType.Q4_K:
        return quantize_q4_k(w)
    return quants.quantize(w, qtype)


def _nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape, dtype=np.int64)) // block * size


# ------------------------------------------------------------------------------------------
# The file.


class _Layers(Protocol):
    """The layer dimensions a model's and a DFlash drafter's metadata share."""

    @property
    def name(self) -> str: ...
    @property
    def quant(self) -> str: ...
    @property
    def n_embd(self) -> int: ...
    @property
    def n_ff(self) -> int: ...
    @property
    def n_head(self) -> int: ...
    @property
    def n_head_kv(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def rope_base(self) -> float: ...


def _add_layer_metadata(
    w: GGUFWriter, spec: _Layers, n_blocks: int, rms_eps: float, rope_dim: int
) -> None:
    """Name, file type and the attention / FFN dimensions a model and a drafter share."""
    w.add_name(spec.name)
    w.add_file_type(QUANT_TYPES[spec.quant][1])
    if spec.quant not in ("f32", "f16", "bf16"):
        w.add_quantization_version(2)
    w.add_block_count(n_blocks)
    w.add_embedding_length(spec.n_embd)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_rope_freq_base(spec.rope_base)
    w.add_rope_dimension_count(rope_dim)


def _add_metadata(w: GGUFWriter, spec: ModelSpec, vocab: Vocab) -> None:
    Hv, dk = spec.ssm_time_step_rank, spec.ssm_state_size
    _add_layer_metadata(w, spec, spec.n_layer_all, spec.rms_eps, spec.rope_dim)
    if spec.mtp:
        w.add_nextn_predict_layers(1)
    w.add_context_length(spec.context_length)
    if spec.arch != "qwen3next":
        w.add_rope_dimension_sections(list(spec.rope_sections))
    w.add_full_attention_interval(spec.full_attention_interval)
    w.add_ssm_conv_kernel(spec.conv_kernel)
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(spec.ssm_group_count)
    w.add_ssm_time_step_rank(Hv)
    w.add_ssm_inner_size(Hv * dk)
    if spec.is_moe:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)
        w.add_expert_feed_forward_length(spec.n_ff_exp)
        w.add_expert_shared_feed_forward_length(spec.n_ff_shexp)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if spec.arch == "qwen3next" else "qwen35")
    w.add_token_list(list(vocab.tokens))
    w.add_token_types(list(vocab.token_types))
    w.add_token_merges(list(vocab.merges))
    w.add_bos_token_id(vocab.bos_id)
    w.add_eos_token_id(vocab.eos_id)
    w.add_pad_token_id(vocab.pad_id)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def write_model(
    path: str | os.PathLike[str],
    spec: ModelSpec,
    weights: Mapping[str, np.ndarray] | None = None,
) -> None:
    """Write `spec` as a GGUF file at `path` (overwritten). Same spec ⇒ identical bytes.

    `weights` (tensor name -> float array in numpy order, every tensor of the file) replaces
    the random initialisation, for exporting a trained model. Tensors are streamed one at a
    time, so memory stays near the largest encoded tensor.
    """
    vocab = build_vocab(spec.vocab_size, spec.n_vocab)
    _write(path, spec.arch, spec, _plan(spec), weights, lambda w: _add_metadata(w, spec, vocab))


def _write(
    path: str | os.PathLike[str],
    arch: str,
    spec: _Weights,
    tensors: list[_Tensor],
    weights: Mapping[str, np.ndarray] | None,
    add_metadata: Callable[[GGUFWriter], None],
) -> None:
    """Stream a GGUF file: metadata, then each tensor of `tensors` (drawn or from `weights`)."""
    missing = sorted({t.name for t in tensors} - set(weights or ())) if weights else []
    if missing:
        raise KeyError(f"weights lack {len(missing)} tensors of the file: {', '.join(missing[:5])}")
    plan = [(t, _ggml_type(spec, t)) for t in tensors]
    writer = GGUFWriter(path, arch)
    try:
        add_metadata(writer)
        for t, qtype in plan:
            writer.add_tensor_info(
                t.name, t.shape, np.dtype(np.float32), _nbytes(t.shape, qtype), raw_dtype=qtype
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t, qtype in plan:
            data = np.concatenate([_encode(chunk, qtype) for chunk in _values(spec, t, weights)])
            writer.write_tensor_data(data)
    finally:
        writer.close()


def write_dequantized(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Copy the GGUF file `src` to `dst` with every tensor stored as f32 and the metadata
    unchanged but `general.file_type`. A quantized file is held to llama.cpp through such a
    copy: llama.cpp's CPU matmuls quantize the activations of quantized weights too, which
    moves its logits away from the exact product (docs/PERFORMANCE.md, "Engine on CPU": up
    to 1.1 on the bench-50m q8_0 file)."""
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    try:
        for field in reader.fields.values():
            if field.name == "general.architecture" or field.name.startswith("GGUF."):
                continue  # the writer's own
            kind = field.types[0]
            sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
            value = LlamaFileType.ALL_F32 if field.name == "general.file_type" else field.contents()
            writer.add_key_value(field.name, value, kind, sub_type=sub)
        for t in reader.tensors:
            writer.add_tensor(t.name, quants.dequantize(t.data, t.tensor_type).astype(np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


# ------------------------------------------------------------------------------------------
# Command line (wired by transport/cli.py as `slotserve make-model OUT ...`).

_CLI_OVERRIDES: tuple[tuple[str, str, type, str], ...] = (
    ("--arch", "arch", str, "qwen35 | qwen35moe | qwen3next"),
    ("--layers", "n_layer", int, "trunk layers (MTP block not counted)"),
    ("--hidden", "n_embd", int, "hidden size E"),
    ("--heads", "n_head", int, "full-attention query heads"),
    ("--kv-heads", "n_head_kv", int, "full-attention KV heads"),
    ("--head-dim", "head_dim", int, "full-attention head dim D"),
    ("--ssm-k-heads", "ssm_group_count", int, "GDN key heads Hk"),
    ("--ssm-v-heads", "ssm_time_step_rank", int, "GDN value heads Hv"),
    ("--ssm-state", "ssm_state_size", int, "GDN head dim dk = dv"),
    ("--experts", "n_expert", int, "routed experts"),
    ("--experts-used", "n_expert_used", int, "experts per token"),
    ("--expert-ff", "n_ff_exp", int, "per-expert FFN width"),
    ("--ff", "n_ff", int, "dense FFN width"),
    ("--vocab", "vocab_size", int, "real tokens (bytes + merges + specials)"),
    ("--quant", "quant", str, " | ".join(QUANT_TYPES)),
    ("--seed", "seed", int, "weight seed"),
)


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--preset NAME` and the optional per-field overrides to `parser`."""
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="base spec")
    for flag, field, kind, text in _CLI_OVERRIDES:
        parser.add_argument(flag, dest=field, type=kind, default=None, help=text)
    parser.add_argument(
        "--mtp", action=argparse.BooleanOptionalAction, default=None, help="one NextN block"
    )


def spec_from_cli(args: argparse.Namespace) -> ModelSpec:
    """The preset named by `args.preset` with every override that was given applied."""
    fields = [field for _, field, _, _ in _CLI_OVERRIDES] + ["mtp"]
    overrides = {f: getattr(args, f) for f in fields if getattr(args, f) is not None}
    return dataclasses.replace(preset(args.preset), **overrides)
