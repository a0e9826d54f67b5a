"""DFlash drafter GGUF files (architecture `dflash`), written like the models of `engine.writer`.

`write_dflash(path, spec)` writes a drafter for the target a `DFlashSpec` describes (build one
with `DFlashSpec.for_target(model_spec)` or `DFlashSpec.for_file(model.gguf)`): deterministic
random weights, or a trained drafter's via `weights`. `engine/spec/dflash.py` reads it.

Metadata: the usual `dflash.block_count`, `embedding_length`, `feed_forward_length`,
`attention.*`, `rope.*` keys for its layers, plus `dflash.block_size`, `dflash.mask_token_id`,
`dflash.target_layers` (trunk layers whose outputs condition it) and `dflash.vocab_size` (the
target's token rows). Tensors: `fc.weight` `[E, T*E]`, `hidden_norm.weight`,
`output_norm.weight`, and per layer `blk.i.` attention (ungated: `attn_q` is `[H*D, E]`), its
q/k norms, the two layer norms and a dense SwiGLU FFN.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFWriter

from engine.corpus import build_vocab
from engine.writer import (
    PRESETS,
    ModelSpec,
    _add_layer_metadata,
    _dense_ffn_tensors,
    _Tensor,
    _write,
    preset,
)


@dataclass(frozen=True)
class DFlashSpec:
    """A DFlash drafter. The first fields describe its target — hidden size, token rows,
    trunk layers, norm epsilon — and must match it (`for_target`, `for_file`);
    `target_layers` are trunk layers of it, `mask_token_id` a token of its vocabulary
    (a random target has no MASK token: its end-of-text token stands in)."""

    n_embd: int = 64
    n_vocab: int = 512
    target_n_layer: int = 4
    rms_eps: float = 1e-6
    mask_token_id: int = 507
    target_layers: tuple[int, ...] = (1, 2, 3)
    n_layer: int = 1
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 128
    rope_base: float = 1_000_000.0
    block_size: int = 8
    quant: str = "f32"
    seed: int = 0
    name: str = "tiny-dflash"

    def __post_init__(self) -> None:
        ok = (
            self.block_size >= 2
            and self.n_layer >= 1
            and self.n_head % self.n_head_kv == 0
            and bool(self.target_layers)
            and all(0 <= i < self.target_n_layer for i in self.target_layers)
            and 0 <= self.mask_token_id < self.n_vocab
        )
        if not ok:
            raise ValueError(
                f"DFlashSpec {self.name!r}: need block_size >= 2, a layer, n_head a multiple "
                f"of n_head_kv, target layers within the target's {self.target_n_layer} and a "
                f"mask token within its {self.n_vocab} tokens"
            )

    @classmethod
    def for_target(cls, target: ModelSpec, **fields: Any) -> DFlashSpec:
        """A drafter for the model `target` describes (its end-of-text token as MASK)."""
        vocab = build_vocab(target.vocab_size, target.n_vocab)
        shape: dict[str, Any] = dict(
            n_embd=target.n_embd,
            n_vocab=target.n_tokens,
            target_n_layer=target.n_layer,
            rms_eps=target.rms_eps,
            mask_token_id=vocab.pad_id,
            target_layers=_spread(target.n_layer),
            name=f"{target.name}-dflash",
        )
        return cls(**(shape | fields))

    @classmethod
    def for_file(cls, path: str | os.PathLike[str], **fields: Any) -> DFlashSpec:
        """A drafter for the model in the GGUF file at `path` (a trained one included)."""
        from engine.gguf import GGUFFile

        f = GGUFFile(path)
        c = f.config
        mask = f.get("tokenizer.ggml.padding_token_id", f.get("tokenizer.ggml.eos_token_id"))
        shape: dict[str, Any] = dict(
            n_embd=c.n_embd,
            n_vocab=c.n_vocab,
            target_n_layer=c.n_layer,
            rms_eps=c.rms_eps,
            mask_token_id=int(mask) if mask is not None else c.n_vocab - 1,
            target_layers=_spread(c.n_layer),
            name=f"{c.name}-dflash",
        )
        return cls(**(shape | fields))

    @property
    def vocab_size(self) -> int:
        return self.n_vocab

    @property
    def tied_embeddings(self) -> bool:
        return False


def _spread(n_layer: int, count: int = 4) -> tuple[int, ...]:
    """Up to `count` trunk layers from the second to the last, evenly spread: shallow to
    deep features, as the DFlash paper conditions on."""
    lo, hi = min(1, n_layer - 1), n_layer - 1
    return tuple(sorted({round(lo + (hi - lo) * i / max(1, count - 1)) for i in range(count)}))


DFLASH_PRESETS: dict[str, DFlashSpec] = {"tiny": DFlashSpec()}


def _dflash_plan(spec: DFlashSpec) -> list[_Tensor]:
    E, H, Hkv, D = spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim
    plan = [
        _Tensor("fc.weight", (E, len(spec.target_layers) * E), "matrix"),
        _Tensor("hidden_norm.weight", (E,), "norm"),
        _Tensor("output_norm.weight", (E,), "norm"),
    ]
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        plan += [
            _Tensor(p + "attn_norm.weight", (E,), "norm"),
            _Tensor(p + "attn_q.weight", (H * D, E), "matrix"),
            _Tensor(p + "attn_k.weight", (Hkv * D, E), "matrix"),
            _Tensor(p + "attn_v.weight", (Hkv * D, E), "matrix"),
            _Tensor(p + "attn_q_norm.weight", (D,), "norm"),
            _Tensor(p + "attn_k_norm.weight", (D,), "norm"),
            _Tensor(p + "attn_output.weight", (E, H * D), "out"),
            _Tensor(p + "post_attention_norm.weight", (E,), "norm"),
            *_dense_ffn_tensors(p, E, spec.n_ff),
        ]
    return plan


def write_dflash(
    path: str | os.PathLike[str],
    spec: DFlashSpec,
    weights: Mapping[str, np.ndarray] | None = None,
) -> None:
    """Write `spec` as a DFlash drafter GGUF (architecture `dflash`) at `path`.

    Metadata `dflash.*`: the layer dimensions, `block_size`, `mask_token_id`,
    `target_layers` and the target's `vocab_size`. `weights` replaces the random
    initialisation (a trained drafter), as for `write_model`.
    """

    def metadata(w: GGUFWriter) -> None:
        _add_layer_metadata(w, spec, spec.n_layer, spec.rms_eps, spec.head_dim)
        w.add_uint32("dflash.block_size", spec.block_size)
        w.add_uint32("dflash.mask_token_id", spec.mask_token_id)
        w.add_array("dflash.target_layers", list(spec.target_layers))
        w.add_uint32("dflash.vocab_size", spec.n_vocab)

    _write(path, "dflash", spec, _dflash_plan(spec), weights, metadata)


def add_dflash_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """The target (`--target MODEL.gguf` or `--preset NAME` of a model) and a few overrides."""
    parser.add_argument("--target", help="the target model's GGUF file (else --preset)")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="target spec")
    parser.add_argument("--layers", dest="n_layer", type=int, help="drafter layers")
    parser.add_argument("--block-size", dest="block_size", type=int, help="tokens per block")
    parser.add_argument(
        "--target-layers", help="comma-separated trunk layers whose outputs condition it"
    )
    parser.add_argument("--seed", type=int, help="weight seed")


def dflash_spec_from_cli(args: argparse.Namespace) -> DFlashSpec:
    fields: dict[str, Any] = {
        f: getattr(args, f) for f in ("n_layer", "block_size", "seed") if getattr(args, f)
    }
    if args.target_layers:
        fields["target_layers"] = tuple(int(i) for i in args.target_layers.split(","))
    if args.target:
        return DFlashSpec.for_file(args.target, **fields)
    return DFlashSpec.for_target(preset(args.preset), **fields)
