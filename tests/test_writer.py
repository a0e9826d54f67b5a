"""The random-weight GGUF writer: layout per MODEL_SPEC, determinism, quantization, llama.cpp."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jinja2
import numpy as np
import pytest
from conftest import llama_cpp_model
from gguf import GGMLQuantizationType, GGUFReader, quants
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from engine.corpus import CHAT_TEMPLATE, QWEN35_PRETOKENIZER_REGEX, byte_to_unicode
from engine.writer import (
    ModelSpec,
    add_cli_arguments,
    build_vocab,
    parameter_count,
    preset,
    quantize_q4_k,
    spec_from_cli,
    write_model,
)

MakeModel = Callable[..., Path]
MIXED_TEXT = "def f(x):\n\treturn x**2  # héllo wörld, 日本語 123456 🙂\r\n\n  end"


def _field(reader: GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


def _tensors(path: Path) -> dict[str, object]:
    return {t.name: t for t in GGUFReader(path).tensors}


def _weights(path: Path, name: str) -> np.ndarray:
    (t,) = (t for t in GGUFReader(path).tensors if t.name == name)
    return quants.dequantize(t.data, t.tensor_type)


# --- determinism and vocabulary ---------------------------------------------------------------


def test_same_spec_writes_identical_bytes(tmp_path: Path) -> None:
    spec = preset("tiny-moe")
    write_model(tmp_path / "a.gguf", spec)
    write_model(tmp_path / "b.gguf", spec)
    write_model(tmp_path / "c.gguf", dataclasses.replace(spec, seed=1))
    a, b, c = ((tmp_path / f"{n}.gguf").read_bytes() for n in "abc")
    assert a == b
    assert a != c


def test_vocab_training_is_deterministic_across_processes() -> None:
    code = (
        "import hashlib; from engine.corpus import build_vocab; v = build_vocab(512); "
        "print(hashlib.sha256('\\n'.join(v.tokens + v.merges).encode()).hexdigest())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    vocab = build_vocab(512)
    assert out == hashlib.sha256("\n".join(vocab.tokens + vocab.merges).encode()).hexdigest()


def test_vocab_layout_is_bytes_then_merges_then_specials_then_padding() -> None:
    vocab = build_vocab(512, 600)
    assert len(vocab) == 600
    assert vocab.tokens[:256] == tuple(byte_to_unicode().values())
    n_merges = 512 - 256 - 5
    assert len(vocab.merges) == n_merges
    assert vocab.tokens[256] == vocab.merges[0].replace(" ", "")
    assert vocab.tokens[vocab.bos_id] == "<|endoftext|>" == vocab.tokens[vocab.pad_id]
    assert vocab.tokens[vocab.eos_id] == "<|im_end|>"
    assert vocab.tokens[vocab.im_start_id] == "<|im_start|>"
    assert set(vocab.token_types[:512]) == {1, 3, 4}
    assert vocab.tokens[512] == "[PAD512]" and set(vocab.token_types[512:]) == {5}


def test_chat_template_renders_chatml() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    text = jinja2.Template(CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=True, enable_thinking=False
    )
    assert text == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


# --- layout per MODEL_SPEC §2, §3, §12 --------------------------------------------------------


def test_qwen35_metadata_follows_model_spec(tiny_qwen35: Path) -> None:
    spec, r = preset("tiny"), GGUFReader(tiny_qwen35)
    assert _field(r, "general.architecture") == "qwen35"
    assert _field(r, "qwen35.block_count") == spec.n_layer + 1
    assert _field(r, "qwen35.nextn_predict_layers") == 1
    assert _field(r, "qwen35.rope.dimension_sections") == list(spec.rope_sections)
    assert _field(r, "qwen35.ssm.group_count") == spec.ssm_group_count
    assert _field(r, "qwen35.ssm.time_step_rank") == spec.ssm_time_step_rank
    assert _field(r, "qwen35.ssm.inner_size") == spec.ssm_time_step_rank * spec.ssm_state_size
    assert _field(r, "qwen35.attention.key_length") == spec.head_dim
    assert _field(r, "tokenizer.ggml.pre") == "qwen35"
    assert _field(r, "tokenizer.ggml.add_bos_token") is False
    assert len(_field(r, "tokenizer.ggml.tokens")) == spec.vocab_size  # type: ignore[arg-type]


def test_qwen35_tensors_have_spec_shapes(tiny_qwen35: Path) -> None:
    s, t = preset("tiny"), _tensors(tiny_qwen35)
    E, Cq, Cv = (
        s.n_embd,
        s.ssm_group_count * s.ssm_state_size,
        s.ssm_time_step_rank * s.ssm_state_size,
    )
    expected = {
        "token_embd.weight": (s.vocab_size, E),
        "blk.0.attn_qkv.weight": (2 * Cq + Cv, E),
        "blk.0.ssm_conv1d.weight": (2 * Cq + Cv, s.conv_kernel),
        "blk.0.ssm_alpha.weight": (s.ssm_time_step_rank, E),
        "blk.0.ssm_a": (s.ssm_time_step_rank,),
        "blk.0.ssm_dt.bias": (s.ssm_time_step_rank,),
        "blk.0.ssm_norm.weight": (s.ssm_state_size,),
        "blk.0.ssm_out.weight": (E, Cv),
        "blk.1.attn_q.weight": (2 * s.n_head * s.head_dim, E),
        "blk.1.attn_k.weight": (s.n_head_kv * s.head_dim, E),
        "blk.1.attn_output.weight": (E, s.n_head * s.head_dim),
        "blk.3.ffn_down.weight": (E, s.n_ff),
        "blk.4.attn_q.weight": (2 * s.n_head * s.head_dim, E),
        "blk.4.nextn.eh_proj.weight": (E, 2 * E),
        "blk.4.nextn.shared_head_norm.weight": (E,),
    }
    for name, shape in expected.items():
        assert tuple(reversed(t[name].shape.tolist())) == shape, name  # type: ignore[attr-defined]
    assert "blk.1.attn_qkv.weight" not in t and "blk.0.attn_q.weight" not in t
    assert "blk.4.ssm_a" not in t


def test_quantized_file_keeps_norms_conv_decay_and_router_in_f32(make_model: MakeModel) -> None:
    types = {n: t.tensor_type for n, t in _tensors(make_model("tiny-moe", quant="q8_0")).items()}  # type: ignore[attr-defined]
    f32 = GGMLQuantizationType.F32
    for name in (
        "output_norm.weight",
        "blk.0.attn_norm.weight",
        "blk.0.ssm_a",
        "blk.0.ssm_dt.bias",
        "blk.0.ssm_conv1d.weight",
        "blk.0.ssm_norm.weight",
        "blk.0.ffn_gate_inp.weight",
        "blk.0.ffn_gate_inp_shexp.weight",
        "blk.1.attn_q_norm.weight",
    ):
        assert types[name] == f32, name
    for name in ("token_embd.weight", "blk.0.attn_qkv.weight", "blk.0.ffn_up_exps.weight"):
        assert types[name] == GGMLQuantizationType.Q8_0, name


def test_moe_file_has_experts_and_shared_expert(tiny_qwen35moe: Path) -> None:
    s, t = preset("tiny-moe"), _tensors(tiny_qwen35moe)
    assert GGUFReader(tiny_qwen35moe).fields["qwen35moe.expert_used_count"].contents() == 2
    shape = tuple(reversed(t["blk.4.ffn_down_exps.weight"].shape.tolist()))  # type: ignore[attr-defined]
    assert shape == (s.n_expert, s.n_embd, s.n_ff_exp)
    assert {"blk.0.ffn_gate_shexp.weight", "blk.4.nextn.enorm.weight"} <= t.keys()
    assert "blk.0.ffn_gate.weight" not in t


def test_qwen3next_file_uses_ssm_ba_and_no_mtp_or_sections(tiny_qwen3next: Path) -> None:
    r, t = GGUFReader(tiny_qwen3next), _tensors(tiny_qwen3next)
    assert "blk.0.ssm_ba.weight" in t and "blk.0.ssm_beta.weight" not in t
    assert not any("nextn" in name for name in t)
    assert "qwen3next.rope.dimension_sections" not in r.fields
    assert "qwen3next.nextn_predict_layers" not in r.fields
    assert _field(r, "tokenizer.ggml.pre") == "qwen2"


def test_padding_tokens_are_unused_with_zero_rows(make_model: MakeModel) -> None:
    path = make_model("tiny", n_vocab=576)
    r = GGUFReader(path)
    assert _field(r, "tokenizer.ggml.tokens")[-1] == "[PAD575]"  # type: ignore[index]
    embd = _weights(path, "token_embd.weight")
    assert embd.shape == (576, 64)
    assert not embd[512:].any() and np.abs(embd[:512]).min(axis=1).all()


# --- quantization ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("quant", "qtype", "tolerance"),
    [
        ("f16", GGMLQuantizationType.F16, 1e-3),
        ("bf16", GGMLQuantizationType.BF16, 5e-3),
        ("q8_0", GGMLQuantizationType.Q8_0, 1e-2),
        ("q4_0", GGMLQuantizationType.Q4_0, 0.12),
        ("q4_k", GGMLQuantizationType.Q4_K, 0.12),
    ],
)
def test_quantized_weights_dequantize_close_to_float_weights(
    make_model: MakeModel, quant: str, qtype: GGMLQuantizationType, tolerance: float
) -> None:
    shape = {"n_embd": 256, "n_ff": 256}  # q4_k rows must be multiples of 256
    exact, coded = make_model("tiny", **shape), make_model("tiny", quant=quant, **shape)
    name = "blk.0.ffn_up.weight"
    assert _tensors(coded)[name].tensor_type == qtype  # type: ignore[attr-defined]
    w, q = _weights(exact, name), _weights(coded, name)
    assert q.shape == w.shape
    assert np.sqrt(np.mean((q - w) ** 2) / np.mean(w**2)) < tolerance


def test_q4_k_quantizer_round_trips_through_gguf_dequantize() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 512)).astype(np.float32)
    x[1] += 3.0  # all-positive: the zero minimum Q4_K requires
    x[2] = 0.0
    x[3, :32] *= 1e-3  # a sub-block far below its super-block's scale
    y = quants.dequantize(quantize_q4_k(x), GGMLQuantizationType.Q4_K)
    assert y.shape == x.shape
    assert not y[2].any()
    sub = x.reshape(6, 2, 8, 32)
    lift = np.maximum(-sub.min(axis=-1), 0)
    step = (sub.max(axis=-1) + lift) / 15
    d, dmin = step.max(axis=-1, keepdims=True) / 63, lift.max(axis=-1, keepdims=True) / 63
    bound = (step + dmin / 15 + d) / 2 * 1.01 + 1e-7
    assert (np.abs(y - x).reshape(6, 2, 8, 32).max(axis=-1) <= bound).all()


# --- presets and command line ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [
        ("demo", 10e6, 20e6),
        ("bench-50m", 40e6, 60e6),
        ("qwen3.5-0.8b", 0.7e9, 0.9e9),
        ("qwen3.5-9b", 8.5e9, 9.7e9),
    ],
)
def test_preset_sizes(name: str, low: float, high: float) -> None:
    assert low <= parameter_count(preset(name)) <= high


def test_invalid_specs_are_rejected_with_the_reason() -> None:
    with pytest.raises(ValueError, match="multiple of ssm_group_count"):
        ModelSpec(ssm_group_count=3, ssm_time_step_rank=4)
    with pytest.raises(ValueError, match="no MTP"):
        dataclasses.replace(preset("tiny-next"), mtp=True)
    with pytest.raises(KeyError, match="known"):
        preset("nope")


def test_cli_overrides_apply_on_top_of_the_preset() -> None:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    args = parser.parse_args(
        ["--preset", "tiny-moe", "--layers", "2", "--no-mtp", "--quant", "q8_0"]
    )
    spec = spec_from_cli(args)
    assert spec == dataclasses.replace(preset("tiny-moe"), n_layer=2, mtp=False, quant="q8_0")
    assert spec_from_cli(parser.parse_args([])) == preset("tiny")


# --- llama.cpp loads and runs the files -------------------------------------------------------


def _logits(path: Path, tokens: list[int]) -> np.ndarray:
    llm = llama_cpp_model(path, n_threads=2)
    assert llm.n_vocab() == len(_field(GGUFReader(path), "tokenizer.ggml.tokens"))  # type: ignore[arg-type]
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)])


@pytest.mark.llama
@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-next"])
def test_llama_cpp_runs_each_tiny_preset(make_model: MakeModel, name: str) -> None:
    logits = _logits(make_model(name), list(range(100, 132)))
    assert np.isfinite(logits).all()
    assert 3.0 < logits.std(axis=-1).mean() < 12.0  # clear spread, not saturated


@pytest.mark.llama
@pytest.mark.parametrize("quant", ["f16", "bf16", "q8_0", "q4_0", "q4_k"])
def test_llama_cpp_runs_each_quant_type(make_model: MakeModel, quant: str) -> None:
    exact = _logits(make_model("tiny", n_embd=256, n_ff=256), list(range(100, 116)))
    coded = _logits(make_model("tiny", quant=quant, n_embd=256, n_ff=256), list(range(100, 116)))
    assert np.isfinite(coded).all()
    correlation = [np.corrcoef(e, c)[0, 1] for e, c in zip(exact, coded, strict=True)]
    assert min(correlation) > 0.9  # the same model, up to quantization noise


@pytest.mark.llama
def test_llama_cpp_tokenizer_matches_trained_bpe_and_round_trips(tiny_qwen35: Path) -> None:
    vocab = build_vocab(preset("tiny").vocab_size)
    reference = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(vocab.tokens)},
            merges=[(a, b) for a, _, b in (m.partition(" ") for m in vocab.merges)],
        )
    )
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZER_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    reference.decoder = decoders.ByteLevel()
    llm = llama_cpp_model(tiny_qwen35, vocab_only=True)
    ids = llm.tokenize(MIXED_TEXT.encode(), add_bos=False, special=False)
    assert ids == reference.encode(MIXED_TEXT).ids
    assert llm.detokenize(ids).decode() == MIXED_TEXT
    chat = llm.tokenize(b"<|im_start|>user<|im_end|>", add_bos=False, special=True)
    assert chat[0] == vocab.im_start_id and chat[-1] == vocab.eos_id
