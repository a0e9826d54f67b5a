"""The byte-level BPE vocabulary and chat template that our generated models carry.

The vocabulary is trained with the `tokenizers` library on a corpus every machine has offline:
the top-level modules of this interpreter's standard library, in sorted order, capped at
`CORPUS_BYTES`. The pre-tokenizer is llama.cpp's `qwen35` regex (MODEL_SPEC §13), so the merges
are the ones llama.cpp will apply. The result depends only on `vocab_size` and the Python
version's standard library sources, so it is identical across runs on one machine.

Token order follows the Qwen layout: the 256 byte tokens in GPT-2's byte-to-unicode order, one
token per merge in merge order, then the special tokens, then optional `[PAD{i}]` padding.
"""

from __future__ import annotations

import functools
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

CORPUS_BYTES = 3_000_000
"""Cap on the training corpus; keeps training a 32k vocabulary to a few seconds."""

QWEN35_PRETOKENIZER_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[tuple[str, int], ...] = (
    (ENDOFTEXT, TOKEN_CONTROL),
    (IM_START, TOKEN_CONTROL),
    (IM_END, TOKEN_CONTROL),
    ("<think>", TOKEN_USER_DEFINED),
    ("</think>", TOKEN_USER_DEFINED),
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
"""Qwen-style ChatML: `messages` (role/content dicts), `add_generation_prompt`, and the optional
`enable_thinking=False` switch that pre-fills an empty `<think>` block as Qwen3.5 does."""


@dataclass(frozen=True)
class Vocab:
    """A GGUF `gpt2` vocabulary: `tokens[i]` has type `token_types[i]`; `merges` in rank order."""

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_id: int
    eos_id: int
    pad_id: int
    im_start_id: int

    def __len__(self) -> int:
        return len(self.tokens)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, in GPT-2's token order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def corpus_text(limit: int = CORPUS_BYTES) -> str:
    """The training corpus: sorted top-level stdlib `*.py` files, concatenated up to `limit` bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        if total >= limit:
            break
        data = path.read_bytes()[: limit - total]
        parts.append(data.decode("utf-8", errors="ignore"))
        total += len(data)
    return "".join(parts)


@functools.cache
def _trained_merges(n_merges: int) -> tuple[str, ...]:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZER_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=256 + n_merges,
        min_frequency=0,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator([corpus_text()], trainer=trainer)
    raw = json.loads(tokenizer.to_str())["model"]["merges"]
    merges = tuple(m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in raw)
    if len(merges) < n_merges:
        raise ValueError(
            f"the {CORPUS_BYTES}-byte corpus yields only {len(merges)} merges; "
            f"vocab_size must be at most {256 + len(merges) + len(SPECIAL_TOKENS)}"
        )
    return merges


@functools.cache
def build_vocab(vocab_size: int, n_vocab: int | None = None) -> Vocab:
    """Train (or fetch from the in-process cache) a vocabulary of exactly `vocab_size` tokens.

    `vocab_size` counts the 256 byte tokens, the merges and the special tokens. When `n_vocab`
    is larger, the list is padded with `[PAD{i}]` tokens of type UNUSED, as the llama.cpp
    converter pads real Qwen vocabularies to 248320.
    """
    n_merges = vocab_size - 256 - len(SPECIAL_TOKENS)
    if n_merges < 0:
        raise ValueError(
            f"vocab_size {vocab_size} < {256 + len(SPECIAL_TOKENS)} (bytes + specials)"
        )
    total = vocab_size if n_vocab is None else n_vocab
    if total < vocab_size:
        raise ValueError(f"n_vocab {total} is smaller than vocab_size {vocab_size}")
    merges = _trained_merges(n_merges) if n_merges else ()
    tokens = list(byte_to_unicode().values())
    tokens += [m.replace(" ", "", 1) for m in merges]
    types = [TOKEN_NORMAL] * len(tokens)
    first_special = len(tokens)
    for text, kind in SPECIAL_TOKENS:
        tokens.append(text)
        types.append(kind)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), total)]
    types += [TOKEN_UNUSED] * (total - len(types))
    if len(set(tokens)) != len(tokens):
        raise RuntimeError(f"vocab_size {vocab_size}: trained merges produced a duplicate token")
    ids = {text: first_special + i for i, (text, _) in enumerate(SPECIAL_TOKENS)}
    return Vocab(
        tokens=tuple(tokens),
        token_types=tuple(types),
        merges=merges,
        bos_id=ids[ENDOFTEXT],
        eos_id=ids[IM_END],
        pad_id=ids[ENDOFTEXT],
        im_start_id=ids[IM_START],
    )
