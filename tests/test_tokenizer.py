"""The tokenizer: token-for-token parity with llama.cpp, streaming detokenization, chat prompts."""

from __future__ import annotations

import codecs
import ctypes
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from gguf import TokenType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.gguf import GGUFFile
from engine.tokenizer import (
    ChatTemplateError,
    MissingChatTemplateError,
    Tokenizer,
    TokenizerError,
    UnknownPreTokenizerError,
    load_tokenizer,
)

VOCAB_SIZE = 4096  # enough merges for real multi-byte tokens (the longest is 64 bytes)
N_VOCAB = 4200  # padded with [PAD4096] .. [PAD4199], type UNUSED, as real Qwen files are

CORPUS = {
    "prose": 'The quick brown fox jumps over the lazy dog. It was 5 o\'clock -- "quite" late!',
    "code": (
        'def fib(n: int) -> int:\n    """The n-th Fibonacci number."""\n    if n < 2:\n'
        "        return n\n    return fib(n - 1) + fib(n - 2)  # recurse\n\n\nprint({'a': [1]})\n"
    ),
    "cjk": "你好，世界！こんにちは、世界。안녕하세요 세계",
    "emoji": "I ❤️ 🦀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ok",
    "combining": "e\u0301 cafe\u0301 \u0301x नमस्ते दुनिया שָׁלוֹם עוֹלָם",
    "digits": "1234567890 3.14159 -42 1e-9 ٣٤٥ ²",
    "whitespace": " a  b\t\tc\n\n\nd\r\ne \r\n\r\n  \u3000f\u00a0g\x85h   ",
    "contractions": "I'LL don't we'RE they've she'd it's I'm 'tis",
    "chat": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello",
    "specials_glued": "a<|im_end|><|im_end|>b<|endoftext|><|im_sta [PAD4100]</think",
    "unicode_16": "\U00010d4a's x    \U00016d70y \U0001e5d0\U0001e5ee\u0897",
    "empty": "",
}
SPECIAL_SNIPPETS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "[PAD4100]", "'ll"]
texts = st.lists(st.one_of(st.text(max_size=12), st.sampled_from(SPECIAL_SNIPPETS)), max_size=6)


@pytest.fixture(scope="module", params=["qwen35", "qwen2"])
def model(request: pytest.FixtureRequest, make_model: Callable[..., Path]) -> Path:
    """A model of each pre-tokenizer: `tiny` (qwen35) and `tiny-next` (Qwen3-Next, qwen2)."""
    name = {"qwen35": "tiny", "qwen2": "tiny-next"}[request.param]
    return make_model(name, vocab_size=VOCAB_SIZE, n_vocab=N_VOCAB)


@pytest.fixture(scope="module")
def tok(model: Path) -> Tokenizer:
    return load_tokenizer(model)


@pytest.fixture(scope="module")
def file_metadata(model: Path) -> dict[str, Any]:
    return GGUFFile(model).metadata


@pytest.fixture
def metadata(file_metadata: dict[str, Any]) -> dict[str, Any]:
    """A copy of the model's metadata for a test to edit."""
    return dict(file_metadata)


@pytest.fixture(scope="module")
def byte_token(tok: Tokenizer) -> dict[int, int]:
    """Byte value -> id of its single-byte token (the first 256 tokens)."""
    return {tok.token_piece(i)[0]: i for i in range(256)}


@pytest.fixture(scope="module")
def llm(model: Path) -> Any:
    from conftest import llama_cpp_model

    return llama_cpp_model(model, vocab_only=True)


def llama_detokenize(llm: Any, ids: list[int], special: bool) -> str:
    """llama.cpp's `llama_detokenize`, as text. (`Llama.detokenize` copies each piece through a
    32-byte buffer and silently drops longer pieces, so it cannot be the oracle here.)"""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    array = (llama_cpp.llama_token * len(ids))(*ids)
    n = -1
    while n < 0:  # a negative result is the size it needs
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_detokenize(vocab, array, len(ids), buf, len(buf), False, special)
    return buf.raw[:n].decode("utf-8", errors="replace")


def llama_tokenize(llm: Any, text: str, special: bool) -> list[int]:
    return list(llm.tokenize(text.encode(), add_bos=False, special=special))


# -- parity with llama.cpp --------------------------------------------------------------------


@pytest.mark.llama
@pytest.mark.parametrize("parse_special", [True, False])
@pytest.mark.parametrize("name", list(CORPUS))
def test_encode_matches_llama_cpp(tok: Tokenizer, llm: Any, name: str, parse_special: bool) -> None:
    text = CORPUS[name]
    assert tok.encode(text, parse_special) == llama_tokenize(llm, text, parse_special)


@pytest.mark.llama
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=texts)
def test_encode_matches_llama_cpp_on_random_text(
    tok: Tokenizer, llm: Any, parts: list[str]
) -> None:
    text = "".join(parts)
    for parse_special in (True, False):
        assert tok.encode(text, parse_special) == llama_tokenize(llm, text, parse_special)


@pytest.mark.llama
@pytest.mark.parametrize("skip_special", [False, True])
def test_decode_matches_llama_cpp(tok: Tokenizer, llm: Any, skip_special: bool) -> None:
    every_token = list(range(tok.vocab_size))
    assert tok.decode(every_token, skip_special) == llama_detokenize(
        llm, every_token, special=not skip_special
    )
    for text in CORPUS.values():
        ids = llama_tokenize(llm, text, special=True)
        assert tok.decode(ids, skip_special) == llama_detokenize(llm, ids, not skip_special)


@pytest.mark.llama
def test_end_of_generation_tokens_match_llama_cpp(tok: Tokenizer, llm: Any) -> None:
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    expected = {i for i in range(tok.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert tok.eog_ids == expected


# -- encoding and decoding --------------------------------------------------------------------


def test_end_of_generation_tokens_are_the_chatml_end_markers(tok: Tokenizer) -> None:
    endoftext, im_end = tok.encode("<|endoftext|><|im_end|>")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (endoftext, im_end, endoftext)
    assert tok.eog_ids == {endoftext, im_end}


@settings(max_examples=200, deadline=None)
@given(parts=texts)
def test_decode_inverts_encode(tok: Tokenizer, parts: list[str]) -> None:
    text = "".join(parts)
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, parse_special=False)) == text


def test_control_tokens_are_matched_whole_only_with_parse_special(tok: Tokenizer) -> None:
    (im_start,) = tok.encode("<|im_start|>")
    assert tok.token_type(im_start) == TokenType.CONTROL
    assert tok.encode("<|im_start|>user<|im_end|>")[0] == im_start
    assert im_start not in tok.encode("<|im_start|>user", parse_special=False)


def test_user_defined_tokens_are_always_matched_and_unused_never(tok: Tokenizer) -> None:
    # llama.cpp (like HF) matches added non-special tokens even without parse_special.
    (think,) = tok.encode("<think>")
    assert tok.token_type(think) == TokenType.USER_DEFINED
    assert tok.encode("<think>", parse_special=False) == [think]
    pad = tok.vocab_size - 1
    assert tok.token_type(pad) == TokenType.UNUSED
    assert pad not in tok.encode(f"[PAD{pad}]")
    assert tok.token_piece(pad) == b""


def test_no_bos_is_added_unless_the_file_asks(metadata: dict[str, Any]) -> None:
    plain = Tokenizer.from_metadata(metadata)
    assert plain.bos_id is not None and plain.bos_id not in plain.encode("hi")
    with_bos = Tokenizer.from_metadata(metadata | {"tokenizer.ggml.add_bos_token": True})
    assert with_bos.encode("hi") == [plain.bos_id, *plain.encode("hi")]


def test_skip_special_drops_control_tokens_only(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\n<think>hi</think><|im_end|>")
    assert tok.decode(ids) == "<|im_start|>user\n<think>hi</think><|im_end|>"
    assert tok.decode(ids, skip_special=True) == "user\n<think>hi</think>"


def test_bad_token_ids_raise(tok: Tokenizer) -> None:
    for bad in (-1, tok.vocab_size):
        with pytest.raises(TokenizerError, match=f"token id {bad} not in"):
            tok.decode([1, bad])
        with pytest.raises(TokenizerError):
            tok.detokenizer().push(bad)
        with pytest.raises(TokenizerError):
            tok.detokenizer().push_all([bad])  # (its one-token path indexes a list)


def test_lone_surrogates_are_rejected(tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="lone surrogate"):
        tok.encode("a\ud800b")


# -- streaming detokenization ------------------------------------------------------------------


def test_detokenizer_holds_back_partial_characters(
    tok: Tokenizer, byte_token: dict[int, int]
) -> None:
    ids = [byte_token[b] for b in "é😀".encode()]
    stream = tok.detokenizer()
    assert [stream.push(i) for i in ids] == ["", "é", "", "", "", "😀"]
    assert stream.flush() == ""


def test_detokenizer_replaces_bytes_that_cannot_complete(
    tok: Tokenizer, byte_token: dict[int, int]
) -> None:
    stream = tok.detokenizer()
    assert stream.push(byte_token[0xFF]) == "\ufffd"  # never valid in UTF-8
    assert stream.push(byte_token[0xF0]) == ""  # could still start a 4-byte character
    assert stream.push(byte_token[ord("a")]) == "\ufffda"
    assert stream.push(byte_token[0xE4]) == ""
    assert stream.flush() == "\ufffd"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_detokenizer_concatenation_equals_decode(tok: Tokenizer, data: st.DataObject) -> None:
    token = st.one_of(st.integers(0, 255), st.integers(0, tok.vocab_size - 1))  # bytes split chars
    ids = data.draw(st.lists(token, max_size=40))
    skip_special = data.draw(st.booleans())
    final = tok.decode(ids, skip_special)
    stream = tok.detokenizer(skip_special)
    text = ""
    for i in ids:
        piece = stream.push(i)
        piece.encode("utf-8")  # raises on a lone surrogate
        text += piece
        assert final.startswith(text)  # nothing emitted early that the full decode disagrees with
    assert text + stream.flush() == final


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_detokenizer_push_all_equals_pushing_each(tok: Tokenizer, data: st.DataObject) -> None:
    """`push_all` (its one-token fast path included) gives what `push` gives token by token,
    skipping the tokens it is told to."""
    token = st.one_of(st.integers(0, 255), st.integers(0, tok.vocab_size - 1))
    groups = data.draw(st.lists(st.lists(token, max_size=3), max_size=20))
    skip = frozenset(data.draw(st.lists(token, max_size=3)))
    skip_special = data.draw(st.booleans())
    one, each = tok.detokenizer(skip_special), tok.detokenizer(skip_special)
    for group in groups:
        assert one.push_all(group, skip) == "".join(each.push(t) for t in group if t not in skip)
    assert one.flush() == each.flush()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_detokenizer_emits_what_the_incremental_utf8_decoder_emits(
    tok: Tokenizer, data: st.DataObject
) -> None:
    """Token by token (`push`, and `push_all` of one or several), the text is what Python's
    incremental UTF-8 decoder (errors="replace") gives for the tokens' bytes: a partial
    character is held exactly as long, and bytes that cannot complete one are replaced
    exactly as soon."""
    token = st.one_of(st.integers(0, 255), st.integers(0, tok.vocab_size - 1))
    groups = data.draw(st.lists(st.lists(token, min_size=1, max_size=3), max_size=30))
    stream = tok.detokenizer()
    reference = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for group in groups:
        pieces = b"".join(tok.token_piece(t) for t in group)
        if len(group) == 1 and data.draw(st.booleans()):
            assert stream.push(group[0]) == reference.decode(pieces)
        else:
            assert stream.push_all(group) == reference.decode(pieces)
    assert stream.flush() == reference.decode(b"", final=True)


# -- chat template -----------------------------------------------------------------------------


def test_chat_renders_chatml(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
    ]
    assert tok.render_chat(messages) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.render_chat(messages[:2], add_generation_prompt=False).endswith("<|im_end|>\n")
    assert tok.render_chat(messages[:2], enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_chat_template_has_the_hf_helpers(metadata: dict[str, Any]) -> None:
    template = (
        "{{ messages | tojson }}|{% for m in messages %}{% if loop.index > 1 %}{% break %}"
        "{% endif %}{{ m.role }}{% endfor %}|{{ bos_token }}{{ eos_token }}|{{ strftime_now('%Y') }}"
    )
    tok = Tokenizer.from_metadata(metadata | {"tokenizer.chat_template": template})
    messages = [{"role": "user", "content": "héllo <b>"}, {"role": "assistant", "content": ""}]
    assert tok.render_chat(messages) == (
        '[{"role": "user", "content": "héllo <b>"}, {"role": "assistant", "content": ""}]'
        f"|user|<|endoftext|><|im_end|>|{datetime.now().year}"
    )


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ raise_exception('no system role') }}", "no system role"),
        ("{% for m in messages %}", "Unexpected end of template"),
        ("{{ messages.append(1) }}", "unsafe"),
        ("{{ messages[0]['content'] + 1 }}", "str"),
    ],
)
def test_chat_template_errors_are_reported(
    metadata: dict[str, Any], template: str, message: str
) -> None:
    tok = Tokenizer.from_metadata(metadata | {"tokenizer.chat_template": template}, "m.gguf")
    with pytest.raises(ChatTemplateError, match=f"m.gguf: tokenizer.chat_template: .*{message}"):
        tok.render_chat([{"role": "user", "content": "hi"}])


def test_missing_chat_template_is_reported(metadata: dict[str, Any]) -> None:
    del metadata["tokenizer.chat_template"]
    tok = Tokenizer.from_metadata(metadata, "m.gguf")
    with pytest.raises(MissingChatTemplateError, match=r"m\.gguf: .*tokenizer\.chat_template"):
        tok.render_chat([{"role": "user", "content": "hi"}])


# -- bad files ---------------------------------------------------------------------------------


def test_unknown_pre_tokenizer_is_reported(metadata: dict[str, Any]) -> None:
    with pytest.raises(
        UnknownPreTokenizerError, match=r"m\.gguf: tokenizer\.ggml\.pre = 'llama-bpe'"
    ):
        Tokenizer.from_metadata(metadata | {"tokenizer.ggml.pre": "llama-bpe"}, "m.gguf")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.model = 'llama'"),
        ({"tokenizer.ggml.merges": ["a b", "ab"]}, "merges entry 'ab'"),
        ({"tokenizer.ggml.eos_token_id": 10**6}, "eos_token_id 1000000 not in"),
    ],
)
def test_bad_tokenizer_metadata_is_reported(
    metadata: dict[str, Any], change: dict[str, Any], message: str
) -> None:
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_metadata(metadata | change, "m.gguf")


def test_missing_vocabulary_is_reported(metadata: dict[str, Any]) -> None:
    del metadata["tokenizer.ggml.tokens"]
    with pytest.raises(
        TokenizerError, match=r"m\.gguf: metadata key tokenizer\.ggml\.tokens missing"
    ):
        Tokenizer.from_metadata(metadata, "m.gguf")
