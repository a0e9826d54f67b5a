"""Byte-level BPE tokenizer, streaming detokenizer and chat template of a GGUF model.

The reference is llama.cpp (src/llama-vocab.cpp), not the HF tokenizer of the checkpoint:
* special tokens are cut out of the text first, longest text first over the whole text, then
  every remaining fragment is split by the pre-tokenizer regex and merged with BPE (no NFC
  normalization, no prefix space);
* CONTROL and UNKNOWN tokens are matched in text only with `parse_special`; USER_DEFINED tokens
  (e.g. `<think>`) always are; UNUSED tokens (`[PAD123]`) never are;
* a token prints as its bytes (NORMAL: GPT-2 byte-to-unicode decoded; CONTROL, UNKNOWN and
  USER_DEFINED: their text; UNUSED: nothing), and text is those bytes decoded as UTF-8 with
  invalid sequences replaced by U+FFFD.
"""

from __future__ import annotations

import codecs
import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from gguf import TokenType
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.gguf import GGUFFile

PRE_TOKENIZER_REGEX: dict[str, str] = {
    "qwen2": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
        r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    "qwen35": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
        r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+"
    ),
}
"""`tokenizer.ggml.pre` -> the regex llama.cpp uses for it (MODEL_SPEC §13)."""

UNICODE_16_LETTERS_MARKS_NUMBERS = (
    r"\x{897}\x{1C89}-\x{1C8A}\x{A7CB}-\x{A7CD}\x{A7DA}-\x{A7DC}\x{105C0}-\x{105F3}"
    r"\x{10D40}-\x{10D65}\x{10D69}-\x{10D6D}\x{10D6F}-\x{10D85}\x{10EC2}-\x{10EC4}\x{10EFC}"
    r"\x{11380}-\x{11389}\x{1138B}\x{1138E}\x{11390}-\x{113B5}\x{113B7}-\x{113C0}\x{113C2}"
    r"\x{113C5}\x{113C7}-\x{113CA}\x{113CC}-\x{113D3}\x{113E1}-\x{113E2}\x{116D0}-\x{116E3}"
    r"\x{11BC0}-\x{11BE0}\x{11BF0}-\x{11BF9}\x{11F5A}\x{13460}-\x{143FA}\x{16100}-\x{16139}"
    r"\x{16D40}-\x{16D6C}\x{16D70}-\x{16D79}\x{18CFF}\x{1CCF0}-\x{1CCF9}\x{1E5D0}-\x{1E5FA}"
)
"""Code points Unicode 16.0 made letters, marks or digits. llama.cpp's category tables
(unicode-data.cpp, as vendored by llama-cpp-python 0.3.36) stop at Unicode 15.1 and class them
as "other"; the oniguruma inside `tokenizers` knows 16.0. Excluding them from the L, M and N
classes makes both split text identically (checked over every code point)."""


def _as_llama_cpp_regex(regex: str) -> str:
    for category in ("L", "M", "N"):
        regex = regex.replace(
            rf"\p{{{category}}}", rf"[\p{{{category}}}&&[^{UNICODE_16_LETTERS_MARKS_NUMBERS}]]"
        )
    return regex


EOG_TEXTS = frozenset(
    {
        # llama.cpp's end-of-generation markers ...
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
        "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>",
        "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>",
        "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
        # ... and its FIM pad / repo / file-separator tokens, which also end generation.
        "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>",
        "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
    }
)  # fmt: skip
_EOG_ID_KEYS = ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")
_SPECIAL = frozenset({TokenType.CONTROL, TokenType.UNKNOWN})
"""Hidden by `skip_special`; matched in text only with `parse_special`."""
_WHOLE = _SPECIAL | {TokenType.USER_DEFINED}
"""Matched whole in text, never split by BPE; printed as their text."""


class TokenizerError(ValueError):
    """The tokenizer of a model cannot be built or used; the message names the file and key."""


class UnknownPreTokenizerError(TokenizerError):
    pass


class ChatTemplateError(TokenizerError):
    """The chat template does not compile or failed while rendering; the message says why."""


class MissingChatTemplateError(ChatTemplateError):
    pass


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable-character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


_BYTE_OF = _byte_decoder()
_TO_LATIN1 = str.maketrans({c: chr(b) for c, b in _BYTE_OF.items()})
_BYTE_LEVEL = re.compile("[" + re.escape("".join(_BYTE_OF)) + "]*")


def _whole_text(piece: bytes) -> str | None:
    """`piece` as text if it is complete, valid UTF-8 by itself; else None."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _piece(text: str, kind: TokenType) -> bytes:
    """What a token prints as in llama.cpp (`llama_token_to_piece` with `special=True`)."""
    if kind in _WHOLE:
        return text.encode()
    if kind == TokenType.BYTE:
        return bytes([int(text[3:5], 16)])  # "<0x0A>"
    if kind != TokenType.NORMAL:
        return b""  # UNUSED and undefined types print nothing
    if _BYTE_LEVEL.fullmatch(text):
        return text.translate(_TO_LATIN1).encode("latin-1")
    return text.encode()  # not byte-level text: its UTF-8, as the HF ByteLevel decoder does


class Tokenizer:
    """A model's vocabulary: `encode` text to token ids, `decode` ids to text, chat rendering.

    Nothing changes after construction; one instance serves every sequence.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        types: Sequence[int],
        merges: Sequence[str],
        pre: str,
        special_ids: Mapping[str, int],
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
        source: str = "<gguf>",
    ) -> None:
        """`special_ids` maps "bos", "eos", "padding", "eot", ... to ids, as the metadata keys
        `tokenizer.ggml.*_token_id` do."""
        self.source = source
        if pre not in PRE_TOKENIZER_REGEX:
            raise UnknownPreTokenizerError(
                f"{source}: tokenizer.ggml.pre = {pre!r} is not supported "
                f"(known: {', '.join(PRE_TOKENIZER_REGEX)})"
            )
        n = len(tokens)
        if len(types) < n:
            raise TokenizerError(f"{source}: tokenizer.ggml.token_type has {len(types)} < {n}")
        try:
            self._types = [TokenType(t) for t in types[:n]]
        except ValueError as e:
            raise TokenizerError(f"{source}: tokenizer.ggml.token_type: {e}") from None
        for key, i in special_ids.items():
            if not 0 <= i < n:
                raise TokenizerError(f"{source}: tokenizer.ggml.{key}_token_id {i} not in [0, {n})")
        for flag, key in ((add_bos, "bos"), (add_eos, "eos")):
            if flag and key not in special_ids:
                raise TokenizerError(
                    f"{source}: tokenizer.ggml.add_{key}_token is set but {key}_token_id is not"
                )
        vocab = {t or f"[EMPTY_{i}]": i for i, t in enumerate(tokens)}  # llama.cpp's renaming
        if len(vocab) != n:
            raise TokenizerError(f"{source}: tokenizer.ggml.tokens has duplicate entries")
        self._texts = list(vocab)
        # llama.cpp treats every end-of-generation marker as a control token.
        self._eog = frozenset(i for i, t in enumerate(self._texts) if t in EOG_TEXTS)
        for i in self._eog:
            self._types[i] = TokenType.CONTROL
        self._eog |= {special_ids[k] for k in _EOG_ID_KEYS if k in special_ids}
        self._special_ids = dict(special_ids)
        self._add_bos, self._add_eos = add_bos, add_eos
        self._chat_template_text = chat_template
        self._bpe = _build_bpe(vocab, merges, PRE_TOKENIZER_REGEX[pre], source)
        self._pieces = [_piece(t, kind) for t, kind in zip(self._texts, self._types, strict=True)]
        # Each piece as text where it is whole UTF-8 on its own: a detokenizer holding no
        # partial character emits it as is (the common case), without its byte decoder.
        self._piece_texts = [_whole_text(piece) for piece in self._pieces]
        self._hidden = frozenset(i for i, kind in enumerate(self._types) if kind in _SPECIAL)
        # llama.cpp cuts special tokens out longest (in bytes) first, over the whole text.
        self._in_text = sorted(
            (i for i, kind in enumerate(self._types) if kind in _WHOLE),
            key=lambda i: (-len(self._pieces[i]), i),
        )

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], source: str = "<gguf>") -> Tokenizer:
        """Build from GGUF metadata (`tokenizer.ggml.*` keys); `source` names it in errors."""

        def need(key: str) -> Any:
            if key not in metadata:
                raise TokenizerError(f"{source}: metadata key {key} missing")
            return metadata[key]

        model = need("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(
                f"{source}: tokenizer.ggml.model = {model!r}; only byte-level BPE ('gpt2') is "
                "supported"
            )
        tokens = need("tokenizer.ggml.tokens")
        return cls(
            tokens=tokens,
            types=metadata.get("tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens)),
            merges=need("tokenizer.ggml.merges"),
            pre=need("tokenizer.ggml.pre"),
            special_ids={
                key[len("tokenizer.ggml.") : -len("_token_id")]: value
                for key, value in metadata.items()
                if key.startswith("tokenizer.ggml.") and key.endswith("_token_id")
            },
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
            add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=metadata.get("tokenizer.chat_template"),
            source=source,
        )

    # -- vocabulary -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._texts)

    @property
    def bos_id(self) -> int | None:
        return self._special_ids.get("bos")

    @property
    def eos_id(self) -> int | None:
        return self._special_ids.get("eos")

    @property
    def pad_id(self) -> int | None:
        return self._special_ids.get("padding")

    @property
    def eog_ids(self) -> frozenset[int]:
        """Tokens that end generation, chosen as llama.cpp does: the eos/eot/eom/fim ids in the
        metadata and every token whose text is a known end marker (`<|im_end|>`, ...)."""
        return self._eog

    def token_type(self, token_id: int) -> TokenType:
        """The token's type; end-of-generation markers count as CONTROL, as in llama.cpp."""
        return self._types[self._check(token_id)]

    def token_piece(self, token_id: int) -> bytes:
        """The bytes the token stands for: may be part of a UTF-8 character, or empty."""
        return self._pieces[self._check(token_id)]

    def _check(self, token_id: int) -> int:
        if not 0 <= token_id < len(self._pieces):
            raise TokenizerError(
                f"{self.source}: token id {token_id} not in [0, {self.vocab_size})"
            )
        return token_id

    # -- text <-> ids -----------------------------------------------------------------------
    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        """Token ids of `text`, as llama.cpp's `llama_tokenize(add_special=True, parse_special)`.

        BOS / EOS are added only when the file sets `add_bos_token` / `add_eos_token` (Qwen
        files do not). Raises TokenizerError if `text` holds a lone surrogate.
        """
        ids = [self._special_ids["bos"]] if self._add_bos else []
        for fragment in self._split_special(text, parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
                continue
            try:
                ids += self._bpe.encode(fragment, add_special_tokens=False).ids
            except TypeError:  # the binding rejects strings that are not valid Unicode
                raise TokenizerError("cannot encode text holding a lone surrogate") from None
        if self._add_eos:
            ids.append(self._special_ids["eos"])
        return ids

    def _split_special(self, text: str, parse_special: bool) -> list[str | int]:
        """`text` cut into raw-text fragments and the ids of the special tokens inside it."""
        fragments: list[str | int] = [text] if text else []
        for i in self._in_text:
            special = self._texts[i]
            if (not parse_special and self._types[i] in _SPECIAL) or special not in text:
                continue
            cut: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or special not in fragment:
                    cut.append(fragment)
                    continue
                for k, part in enumerate(fragment.split(special)):
                    if k:
                        cut.append(i)
                    if part:
                        cut.append(part)
            fragments = cut
        return fragments

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`: their pieces joined, decoded as UTF-8 with U+FFFD for invalid bytes.

        `skip_special` drops CONTROL and UNKNOWN tokens (llama.cpp `special=False`).
        """
        if len(ids) and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            self._check(bad)
        hidden = self._hidden if skip_special else frozenset()
        data = b"".join(self._pieces[i] for i in ids if i not in hidden)
        return data.decode("utf-8", errors="replace")

    def detokenizer(self, skip_special: bool = False) -> IncrementalDetokenizer:
        """A fresh streaming decoder for one sequence (see IncrementalDetokenizer)."""
        return IncrementalDetokenizer(self, skip_special)

    # -- chat -------------------------------------------------------------------------------
    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages` from the file's Jinja chat template, rendered as HF
        `apply_chat_template` does (sandboxed). `kwargs` reach the template (`tools`,
        `enable_thinking`, ...). Raises ChatTemplateError with the template's message."""
        context: dict[str, Any] = {"tools": None, "documents": None}
        for name in ("bos", "eos"):
            if name in self._special_ids:
                context[f"{name}_token"] = self._texts[self._special_ids[name]]
        context.update(kwargs, messages=messages, add_generation_prompt=add_generation_prompt)
        template = self._chat_template
        try:
            return template.render(**context)
        except Exception as e:  # whatever a file's template raises on a caller's messages
            raise ChatTemplateError(f"{self.source}: tokenizer.chat_template: {e}") from e

    @functools.cached_property
    def _chat_template(self) -> jinja2.Template:
        if not self._chat_template_text:
            raise MissingChatTemplateError(
                f"{self.source}: metadata key tokenizer.chat_template missing"
            )
        try:
            return _JINJA.from_string(self._chat_template_text)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{self.source}: tokenizer.chat_template: {e}") from e


class IncrementalDetokenizer:
    """Turns one sequence's token ids into text as they arrive.

    `push` returns only complete characters: bytes of an unfinished UTF-8 character are held
    until it completes, and bytes that can no longer form one become U+FFFD as soon as that is
    certain. The concatenation of every `push` and the final `flush` equals
    `tokenizer.decode(ids, skip_special)`. Constant work per token.
    """

    __slots__ = ("_held", "_pieces", "_skip_special", "_texts", "_tokenizer")  # (read per token)

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._texts = tokenizer._piece_texts
        self._pieces = tokenizer._pieces
        # The bytes of an unfinished character: what `codecs`' incremental UTF-8 decoder
        # (errors="replace") buffers, kept here and decoded as it does (`_decode`), without
        # its two Python method calls per token.
        self._held = b""

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (often "", never a partial character)."""
        if self._skip_special and self._tokenizer.token_type(token_id) in _SPECIAL:
            return ""
        if not self._held and 0 <= token_id < len(self._texts):
            text = self._texts[token_id]
            if text is not None:
                return text
        return self._decode(self._tokenizer.token_piece(token_id))

    def push_all(self, token_ids: list[int], skip: AbstractSet[int] = frozenset()) -> str:
        """`push` each token not in `skip` (those print nothing); their text, joined."""
        if len(token_ids) != 1 or self._skip_special:
            return "".join([self.push(t) for t in token_ids if t not in skip])
        t = token_ids[0]  # one token per step: the common case, in one call
        if t in skip:
            return ""
        if t < 0:
            return self.push(t)  # (raises: not a token id)
        try:  # (the lists' own bounds check stands for the upper one)
            if not self._held:
                text = self._texts[t]
                if text is not None:
                    return text
            piece = self._pieces[t]
        except IndexError:
            return self.push(t)  # (raises: not a token id)
        return self._decode(piece)

    def flush(self) -> str:
        """End of sequence: the held-back bytes as U+FFFD (they never completed), or ""."""
        held, self._held = self._held, b""
        return _utf8_decode(held, "replace", True)[0] if held else ""

    def _decode(self, piece: bytes) -> str:
        # (codecs.BufferedIncrementalDecoder.decode, for UTF-8 with errors="replace")
        data = self._held + piece if self._held else piece
        text, used = _utf8_decode(data, "replace", False)
        self._held = data[used:]
        return text


_utf8_decode = codecs.utf_8_decode


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer stored in the GGUF file at `path`."""
    return Tokenizer.from_metadata(GGUFFile(path).metadata, source=str(path))


def _build_bpe(
    vocab: dict[str, int], merges: Sequence[str], regex: str, source: str
) -> HFTokenizer:
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, space, right = merge.partition(" ")
        if not space:
            raise TokenizerError(f"{source}: tokenizer.ggml.merges entry {merge!r} has no space")
        pairs.append((left, right))
    try:
        bpe = HFTokenizer(models.BPE(vocab=vocab, merges=pairs))
    except Exception as e:  # the Rust builder reports merges of tokens missing from the vocab
        raise TokenizerError(f"{source}: tokenizer.ggml.merges: {e}") from e
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_as_llama_cpp_regex(regex)), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return bpe


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's override of Jinja's filter: no HTML escaping, non-ASCII kept, key order kept.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_JINJA = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
)
_JINJA.filters["tojson"] = _tojson
_JINJA.globals["raise_exception"] = _raise_exception
_JINJA.globals["strftime_now"] = _strftime_now
