"""The DFlash block drafter (arXiv 2602.06036): its file, its math and its per-slot KV.

A small stack of decoder layers drafts a whole block in ONE non-causal forward,
conditioned on the target's own hidden states:

    features  = outputs of the target layers `target_layers` at each committed
                position, side by side                       [n, T*E]
    context   = rms_norm(features @ fc.T; hidden_norm)       [n, E]
    block     = [last committed token, MASK x (block_size-1)] at the next positions,
                embedded with the target's table
    per layer: queries from the block; keys and values from the context (projected by
               the layer's own K/V matrices, K normed and rotated at the context's
               positions) followed by the block's own; no causal mask
    readout   = target LM head(rms_norm(h; output_norm))     block positions 1.. = drafts

The context part of each layer's K/V depends on the context features only, so it is
computed once per committed position and kept per slot in a `DFlashPool`; a round adds
only the newly committed positions. The block's own K/V is never stored.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.cache import (
    ContextOverflowError,
    SlotId,
    SlotPool,
    SlotStateError,
    device_copy,
    host_copy,
    layer_ids,
    token_index,
)
from engine.gguf import (
    GGUFError,
    MissingMetadataError,
    ModelConfig,
    TensorFile,
    UnsupportedArchitectureError,
)
from engine.models import weights
from engine.models.qwen35 import DenseFFN, Model, _arrays, rms_norm
from engine.models.weights import Loader, matmul

ARCH = "dflash"


class DFlashTargetMismatchError(GGUFError):
    """The drafter file was made for another target model (hidden size, vocabulary, layers)."""


@dataclass(frozen=True)
class DFlashConfig:
    """Hyper-parameters of a DFlash drafter, read from its GGUF metadata (`dflash.*`)."""

    name: str
    n_layer: int
    n_embd: int  # = the target's hidden size
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rope_dim: int
    rope_base: float
    rms_eps: float
    block_size: int
    mask_token_id: int
    target_layers: tuple[int, ...]
    n_vocab: int  # rows of the target's embedding table the drafter was made for

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        return 2 * self.n_layer * self.n_head_kv * self.head_dim * bytes_per_element


def read_config(f: TensorFile) -> DFlashConfig:
    """The drafter's config from `f`'s metadata; specific errors for other files."""
    arch = f.get("general.architecture")
    if arch != ARCH:
        raise UnsupportedArchitectureError(
            f"{f.path}: architecture {arch!r} is not a DFlash drafter (expected {ARCH!r}; "
            "write one with engine.dflash_writer.write_dflash)"
        )

    def key(name: str) -> Any:
        full = f"{ARCH}.{name}"
        if full not in f.metadata:
            raise MissingMetadataError(f"{f.path}: metadata key {full} missing")
        return f.metadata[full]

    cfg = DFlashConfig(
        name=str(f.get("general.name", f.path.stem)),
        n_layer=int(key("block_count")),
        n_embd=int(key("embedding_length")),
        n_head=int(key("attention.head_count")),
        n_head_kv=int(key("attention.head_count_kv")),
        head_dim=int(key("attention.key_length")),
        n_ff=int(key("feed_forward_length")),
        rope_dim=int(key("rope.dimension_count")),
        rope_base=float(key("rope.freq_base")),
        rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        block_size=int(key("block_size")),
        mask_token_id=int(key("mask_token_id")),
        target_layers=tuple(int(i) for i in key("target_layers")),
        n_vocab=int(key("vocab_size")),
    )
    if cfg.block_size < 2 or not cfg.target_layers or cfg.n_layer < 1:
        raise GGUFError(
            f"{f.path}: a DFlash drafter needs block_size >= 2, target layers and a layer; got "
            f"block_size={cfg.block_size}, target_layers={cfg.target_layers}, n_layer={cfg.n_layer}"
        )
    return cfg


def check_target(path: Path, cfg: DFlashConfig, target_path: Path, t: ModelConfig) -> None:
    """Raise `DFlashTargetMismatchError` unless the drafter at `path` fits the target model
    whose file `target_path` has config `t` (metadata only: no weights need loading)."""
    problems = []
    if cfg.n_embd != t.n_embd:
        problems.append(f"hidden size {cfg.n_embd} != the target's {t.n_embd}")
    if cfg.n_vocab != t.n_vocab:
        problems.append(f"vocabulary of {cfg.n_vocab} != the target's {t.n_vocab}")
    if not all(0 <= i < t.n_layer for i in cfg.target_layers):
        problems.append(f"target layers {cfg.target_layers} outside the trunk's {t.n_layer}")
    if not 0 <= cfg.mask_token_id < t.n_vocab:
        problems.append(f"mask token {cfg.mask_token_id} outside the vocabulary")
    if problems:
        raise DFlashTargetMismatchError(
            f"{path}: drafter does not fit target {target_path}: " + "; ".join(problems)
        )


class BlockAttention:
    """Attention of one drafter layer: block queries over [context K/V, block K/V]."""

    def __init__(self, ld: Loader, prefix: str, cfg: DFlashConfig) -> None:
        E, H, Hkv, D = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim
        self.cfg = cfg
        self.wq = ld.matrix(f"{prefix}.attn_q.weight", (H * D, E))
        self.wk = ld.matrix(f"{prefix}.attn_k.weight", (Hkv * D, E))
        self.wv = ld.matrix(f"{prefix}.attn_v.weight", (Hkv * D, E))
        self.wo = ld.matrix(f"{prefix}.attn_output.weight", (E, H * D))
        self.q_norm = ld.dense(f"{prefix}.attn_q_norm.weight", (D,))
        self.k_norm = ld.dense(f"{prefix}.attn_k_norm.weight", (D,))

    def rope(self, x: mx.array, offset: mx.array) -> mx.array:
        """NeoX rope on `[B, H, T, D]`, row b starting at position `offset[b]`."""
        c = self.cfg
        return mx.fast.rope(
            x, c.rope_dim, traditional=False, base=c.rope_base, scale=1.0, offset=offset
        )

    def keys_values(self, x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array]:
        """K (normed, rotated) and V `[n, Hkv, D]` of inputs `x [n, E]` at `positions [n]`."""
        Hkv, D = self.cfg.n_head_kv, self.cfg.head_dim
        k = rms_norm(matmul(x, self.wk).reshape(-1, Hkv, 1, D), self.k_norm, self.cfg.rms_eps)
        k = self.rope(k, positions)[:, :, 0]
        return k, matmul(x, self.wv).reshape(-1, Hkv, D)

    def __call__(
        self, a: mx.array, starts: mx.array, past_k: mx.array, past_v: mx.array, past: mx.array
    ) -> mx.array:
        """a `[N, B, E]` (normed block inputs, row n at positions `starts[n]..`); past K/V
        `[N, S, Hkv, D]` of which row n's first `past[n]` are its context. -> `[N, B, E]`."""
        cfg = self.cfg
        N, B, _ = a.shape
        H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        q = rms_norm(matmul(a, self.wq).reshape(N, B, H, D), self.q_norm, cfg.rms_eps)
        q = self.rope(q.transpose(0, 2, 1, 3), starts)
        k = rms_norm(matmul(a, self.wk).reshape(N, B, Hkv, D), self.k_norm, cfg.rms_eps)
        k = self.rope(k.transpose(0, 2, 1, 3), starts)
        v = matmul(a, self.wv).reshape(N, B, Hkv, D).transpose(0, 2, 1, 3)
        S = past_k.shape[1]
        if S:
            k = mx.concatenate([past_k.transpose(0, 2, 1, 3).astype(k.dtype), k], axis=2)
            v = mx.concatenate([past_v.transpose(0, 2, 1, 3).astype(v.dtype), v], axis=2)
        key = mx.arange(S + B)[None, :]
        mask = (key >= S) | (key < past[:, None])  # [N, S+B]: the row's context, whole block
        out = mx.fast.scaled_dot_product_attention(
            q, k, v, scale=1.0 / math.sqrt(D), mask=mask[:, None, None, :]
        )
        return matmul(out.transpose(0, 2, 1, 3).reshape(N, B, H * D), self.wo)


class DrafterLayer:
    def __init__(self, ld: Loader, i: int, cfg: DFlashConfig) -> None:
        prefix = f"blk.{i}"
        self.eps = cfg.rms_eps
        self.attn_norm = ld.dense(f"{prefix}.attn_norm.weight", (cfg.n_embd,))
        self.post_norm = ld.dense(f"{prefix}.post_attention_norm.weight", (cfg.n_embd,))
        self.attn = BlockAttention(ld, prefix, cfg)
        self.ffn = DenseFFN(ld, prefix, cfg.n_embd, cfg.n_ff)

    def __call__(
        self, x: mx.array, starts: mx.array, past_k: mx.array, past_v: mx.array, past: mx.array
    ) -> mx.array:
        h = x + self.attn(rms_norm(x, self.attn_norm, self.eps), starts, past_k, past_v, past)
        return h + self.ffn(rms_norm(h, self.post_norm, self.eps))


class DFlashModel:
    """A DFlash drafter bound to its target (embeddings and LM head are the target's)."""

    def __init__(self, f: TensorFile, target: Model) -> None:
        cfg = self.config = read_config(f)
        check_target(f.path, cfg, target.path, target.config)
        self.path, self.target = f.path, target
        ld = Loader(f, target.dtype)
        E = cfg.n_embd
        self.fc = ld.matrix("fc.weight", (E, len(cfg.target_layers) * E))
        self.hidden_norm = ld.dense("hidden_norm.weight", (E,))
        self.output_norm = ld.dense("output_norm.weight", (E,))
        self.layers = [DrafterLayer(ld, i, cfg) for i in range(cfg.n_layer)]
        # Load eagerly, as the trunk does: MLX evaluates a graph only on the thread that built it.
        mx.eval(_arrays([self.fc, self.hidden_norm, self.output_norm, self.layers]))
        weights.prepare(_arrays([self.fc, self.layers]))

    def context(self, features: mx.array, positions: mx.array) -> list[tuple[mx.array, mx.array]]:
        """Per drafter layer, the context K and V `[n, Hkv, D]` of committed positions
        `positions [n]` from their target features `[n, T*E]`."""
        c = rms_norm(matmul(features, self.fc), self.hidden_norm, self.config.rms_eps)
        return [layer.attn.keys_values(c, positions) for layer in self.layers]

    def __call__(
        self,
        pending: mx.array,
        starts: mx.array,
        past: list[tuple[mx.array, mx.array]],
        lengths: mx.array,
    ) -> mx.array:
        """Draft logits `[N, block_size, V]` float32 for N slots at once.

        pending `[N]`: each slot's last committed token, at position `starts[n]`;
        past: per layer, context K/V `[N, S, Hkv, D]` of which row n's first
        `lengths[n]` are valid. Row n's logits at block index j predict position
        `starts[n] + j` (j >= 1 are the drafts).
        """
        cfg = self.config
        N, B = pending.shape[0], cfg.block_size
        tokens = mx.concatenate(
            [pending[:, None], mx.full((N, B - 1), cfg.mask_token_id, dtype=mx.int32)], axis=1
        )
        x = self.target.embed_tokens(tokens.reshape(-1)).reshape(N, B, cfg.n_embd)
        for layer, (k, v) in zip(self.layers, past, strict=True):
            x = layer(x, starts, k, v, lengths)
        h = rms_norm(x, self.output_norm, cfg.rms_eps)
        return self.target.logits(h).astype(mx.float32)


def load_dflash(path: str | os.PathLike[str], target: Model) -> DFlashModel:
    """Load a DFlash drafter GGUF for `target`; raises a `GGUFError` subclass naming the
    problem (not a GGUF, not a drafter, missing key or tensor, made for another target)."""
    return DFlashModel(TensorFile(path), target)


class DFlashPool:
    """Per-slot context K/V of a drafter's layers, indexed by the trunk's `SlotId`s.

    k, v `[layers, slots, context, Hkv, D]`; `lengths[slot]` committed positions are
    valid. Only committed positions are ever written, so rolling back a verify round
    needs nothing here; `truncate` serves a slot whose trunk went back further.
    `snapshot` and `restore` copy a slot's context to host memory and back (the prefix
    cache).
    """

    def __init__(
        self, config: DFlashConfig, n_slots: int, max_context: int, kv_dtype: mx.Dtype
    ) -> None:
        self.config, self.n_slots, self.max_context = config, n_slots, max_context
        self.kv_dtype = kv_dtype
        shape = (config.n_layer, n_slots, max_context, config.n_head_kv, config.head_dim)
        self.k = mx.zeros(shape, kv_dtype)
        self.v = mx.zeros(shape, kv_dtype)
        mx.eval(self.k, self.v)
        self._layer_ids = layer_ids(config.n_layer)
        self.lengths = [0] * n_slots

    @classmethod
    def like(cls, config: DFlashConfig, pool: SlotPool) -> DFlashPool:
        """A pool for the same slots, context and KV dtype as the trunk's `pool`."""
        return cls(config, pool.n_slots, pool.max_context, pool.kv_dtype)

    def bytes_for(self, context_tokens: int) -> int:
        """Bytes one sequence of `context_tokens` holds here."""
        return context_tokens * self.config.kv_bytes_per_token(self.kv_dtype.size)

    @property
    def total_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def truncate(self, slot: SlotId, length: int) -> None:
        self.lengths[slot] = min(self.lengths[slot], length)

    def write(
        self,
        slots: list[SlotId],
        starts: list[int],
        counts: list[int],
        kv: list[tuple[mx.array, mx.array]],
    ) -> None:
        """Store per layer the packed K/V `[sum(counts), Hkv, D]` of each slot's new
        positions `starts[i] ..`; each must continue its slot's context."""
        for slot, start, n in zip(slots, starts, counts, strict=True):
            if start != self.lengths[slot]:
                raise SlotStateError(
                    f"slot {slot}: DFlash context write at {start} but it holds {self.lengths[slot]}"
                )
            if start + n > self.max_context:
                raise ContextOverflowError(
                    f"slot {slot}: DFlash context {start} + {n} exceeds {self.max_context}"
                )
        at = token_index(self._layer_ids, *SlotPool.token_coordinates(slots, starts, counts))
        self.k[at] = mx.stack([k for k, _ in kv]).astype(self.kv_dtype)
        self.v[at] = mx.stack([v for _, v in kv]).astype(self.kv_dtype)
        mx.eval(self.k, self.v)
        for slot, start, n in zip(slots, starts, counts, strict=True):
            self.lengths[slot] = start + n

    def snapshot(self, slot: SlotId, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of K and V `[layers, length, Hkv, D]`: the slot's first `length`
        context positions, as `SlotPool.snapshot` copies the trunk's KV."""
        if length > self.lengths[slot]:
            raise SlotStateError(
                f"slot {slot}: DFlash snapshot of {length} positions but it holds "
                f"{self.lengths[slot]}"
            )
        return host_copy(self.k[:, slot, :length]), host_copy(self.v[:, slot, :length])

    def restore(self, slot: SlotId, k: np.ndarray, v: np.ndarray) -> None:
        """Make `slot`'s context the K/V a `snapshot` of a like pool returned."""
        n = k.shape[1]
        if n > self.max_context:
            raise ContextOverflowError(
                f"DFlash snapshot of {n} positions exceeds the context of {self.max_context}"
            )
        if n:
            self.k[:, slot, :n] = device_copy(k, self.kv_dtype)
            self.v[:, slot, :n] = device_copy(v, self.kv_dtype)
            mx.eval(self.k, self.v)
        self.lengths[slot] = n

    def read(self, slots: list[SlotId]) -> list[tuple[mx.array, mx.array]]:
        """Per layer, K/V `[N, S, Hkv, D]` of `slots` (S: their longest context)."""
        past = max(self.lengths[s] for s in slots)
        idx = mx.array(slots, dtype=mx.int32)
        k, v = self.k[:, :, :past][:, idx], self.v[:, :, :past][:, idx]
        return [(k[i], v[i]) for i in range(self.config.n_layer)]
