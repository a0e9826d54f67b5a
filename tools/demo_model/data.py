"""Corpus, vocabulary and packed token ids (run on the CPU machine; GPU training reads only
the packed ids).

* corpus: every `*.py` file of this interpreter's standard library (site-packages excluded),
  in sorted relative-path order; a file is held out when crc32(path) % 50 == 0 (~2%).
* vocabulary: `engine.corpus.build_vocab`, the byte-level BPE our generated models carry
  (trained with `tokenizers` under llama.cpp's `qwen35` pre-tokenizer), so the ids packed
  here are the ids the exported file's tokenizer and llama.cpp produce.
* packed ids: each file's tokens followed by `<|endoftext|>`, as uint16 in a compressed npz.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

HELD_OUT_MODULUS = 50
SPLITS = ("train", "heldout")


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative path, path) of every stdlib `*.py` outside site-packages, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if "site-packages" not in rel.parts and path.is_file():
            found.append((rel.as_posix(), path))
    return sorted(found)


def split_of(rel: str) -> str:
    return "heldout" if zlib.crc32(rel.encode()) % HELD_OUT_MODULUS == 0 else "train"


def write_corpus(out: Path, max_files: int | None = None) -> dict[str, Any]:
    """Write `train.jsonl` and `heldout.jsonl` ({"path", "text"} per file) under `out`.

    `max_files` keeps the first that many training files and a tenth as many held-out
    files (at least one), for a quick smoke run. Files that are not UTF-8 are skipped.
    """
    out.mkdir(parents=True, exist_ok=True)
    docs: dict[str, list[tuple[str, str]]] = {s: [] for s in SPLITS}
    skipped = 0
    for rel, path in stdlib_files():
        try:
            docs[split_of(rel)].append((rel, path.read_bytes().decode("utf-8")))
        except UnicodeDecodeError:
            skipped += 1
    if max_files is not None:
        docs["train"] = docs["train"][:max_files]
        docs["heldout"] = docs["heldout"][: max(1, max_files // 10)]
    manifest: dict[str, Any] = {
        "python": sys.version.split()[0],
        "stdlib": sysconfig.get_paths()["stdlib"],
        "skipped_not_utf8": skipped,
    }
    for split, items in docs.items():
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for rel, text in items:
                f.write(json.dumps({"path": rel, "text": text}) + "\n")
        manifest[split] = {
            "files": len(items),
            "bytes": sum(len(t.encode()) for _, t in items),
        }
    (out / "corpus.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def read_corpus(out: Path, split: str) -> Iterator[tuple[str, str]]:
    with open(out / f"{split}.jsonl", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)
            yield doc["path"], doc["text"]


def write_vocab(out: Path, vocab_size: int) -> dict[str, Any]:
    """Train the vocabulary (engine.corpus.build_vocab) and save it as `vocab.json`."""
    from engine.corpus import build_vocab

    vocab = build_vocab(vocab_size)
    data = {
        "tokens": list(vocab.tokens),
        "token_types": list(vocab.token_types),
        "merges": list(vocab.merges),
        "bos_id": vocab.bos_id,
        "eos_id": vocab.eos_id,
        "pad_id": vocab.pad_id,
    }
    text = json.dumps(data)
    (out / "vocab.json").write_text(text)
    return {"vocab_size": len(vocab), "sha256": hashlib.sha256(text.encode()).hexdigest()}


def vocab_digest(tokens: list[str] | tuple[str, ...], merges: list[str] | tuple[str, ...]) -> str:
    """Fingerprint of a vocabulary: export checks the file it writes holds the packed one."""
    return hashlib.sha256(json.dumps([list(tokens), list(merges)]).encode()).hexdigest()


def pack(out: Path) -> dict[str, Any]:
    """Encode both splits with the saved vocabulary into `ids.npz` (uint16, compressed)."""
    from engine.tokenizer import Tokenizer

    v = json.loads((out / "vocab.json").read_text())
    tok = Tokenizer(
        v["tokens"],
        v["token_types"],
        v["merges"],
        pre="qwen35",
        special_ids={"bos": v["bos_id"], "eos": v["eos_id"], "padding": v["pad_id"]},
    )
    if len(v["tokens"]) > 65536:
        raise ValueError(f"{len(v['tokens'])} tokens do not fit uint16 ids")
    arrays: dict[str, Any] = {}
    stats: dict[str, Any] = {}
    t0 = time.perf_counter()
    for split in SPLITS:
        parts: list[np.ndarray] = []
        n_bytes = 0
        for _, text in read_corpus(out, split):
            ids = tok.encode(text, parse_special=False)
            parts.append(np.array([*ids, v["bos_id"]], dtype=np.uint16))  # <|endoftext|>
            n_bytes += len(text.encode())
        arrays[split] = np.concatenate(parts) if parts else np.zeros(0, np.uint16)
        n = int(arrays[split].size)
        stats[split] = {"tokens": n, "bytes_per_token": round(n_bytes / max(n, 1), 3)}
    digest = vocab_digest(v["tokens"], v["merges"])
    np.savez_compressed(out / "ids.npz", **arrays, vocab_digest=np.array(digest))
    stats["seconds"] = round(time.perf_counter() - t0, 1)
    stats["file_bytes"] = (out / "ids.npz").stat().st_size
    stats["vocab_digest"] = digest
    return stats


def file_vocab_digest(path: Path) -> str:
    """`vocab_digest` of the vocabulary in the GGUF file at `path`."""
    from engine.gguf import TensorFile

    md = TensorFile(path).metadata
    return vocab_digest(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.merges"])


def load_ids(path: Path) -> tuple[np.ndarray, np.ndarray, str]:
    """(train ids, held-out ids, vocabulary digest) from a packed `ids.npz`."""
    with np.load(path) as z:
        return z["train"], z["heldout"], str(z["vocab_digest"])
