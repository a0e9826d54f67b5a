"""A DFlash block drafter (engine/spec/dflash.py, arXiv 2602.06036) as a trainable function of
its weights, conditioned on a frozen target read from its GGUF file.

Training windows `x [B, T]` go through the target (`model.Forward`, dequantized weights) once;
its layer outputs at `target_layers`, side by side, are the features `[B, T, L*E]`. For each of
A anchors `a` per window, the drafter sees the context features of positions `< a` and the block
`[x_a, MASK x (S-1)]` at positions `a .. a+S-1` (S = block size), exactly what the engine's
`DFlashDrafter` gives it when `x_a` is a slot's pending token. All A blocks of a window run in
one forward: block queries attend to the window's context keys before their anchor and to their
own block, never to another block (`block_mask`). The loss is the cross-entropy of block index
j >= 1 against `x_{a+j}`, weighted by exp(-(j-1)/decay) (early drafts decide acceptance), read
out through the drafter's `output_norm` and the target's LM head; embeddings are the target's.

Weights live in one dict keyed by the drafter file's tensor names (`engine/dflash_writer.py`),
so export hands them to `write_dflash` as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tools.demo_model.config import Schedule
from tools.demo_model.model import Forward, Hyper, Params, from_gguf_weights, plain_attention


@dataclass(frozen=True)
class DFlashRecipe(Schedule):
    """A drafter and how to train it: `seq_len`-token windows, `anchors` blocks in each.

    The drafter's shape fields are `engine.dflash_writer.DFlashSpec`'s; the target's own
    (hidden size, vocabulary, MASK token, norm epsilon) come from its file, and empty
    `target_layers` means DFlashSpec's default spread over the trunk.
    """

    n_layer: int = 2
    block_size: int = 8
    n_head: int = 6
    n_head_kv: int = 2
    head_dim: int = 64
    n_ff: int = 1024
    target_layers: tuple[int, ...] = ()
    quant: str = "f16"
    anchors: int = 64
    decay: float = 4.0  # loss weight of block index j: exp(-(j-1)/decay)

    def drafter_fields(self) -> dict[str, Any]:
        """The DFlashSpec fields this recipe sets."""
        fields: dict[str, Any] = {
            f: getattr(self, f)
            for f in ("n_layer", "block_size", "n_head", "n_head_kv", "head_dim", "n_ff")
        }
        fields |= {"quant": self.quant, "seed": self.seed}
        if self.target_layers:
            fields["target_layers"] = tuple(self.target_layers)
        return fields


DFLASH_RECIPES = {
    # the demo model's drafter: ~3.7M parameters, ~7.5 MB as f16
    "full": DFlashRecipe(
        seq_len=512, batch=32, steps=100_000, lr=1e-3, warmup=50, weight_decay=0.01
    ),
    # CPU: a few dozen steps of a one-layer drafter on short windows
    "smoke": DFlashRecipe(
        n_layer=1, n_head=4, n_head_kv=2, head_dim=32, n_ff=256, quant="f32",
        seq_len=96, batch=4, anchors=8, steps=40, lr=5e-3, warmup=5, weight_decay=0.01,
        dtype="float32",
    ),
}  # fmt: skip


def load_target(path: str | Path) -> tuple[Hyper, Params]:
    """The target's hyper-parameters and its trunk weights (dequantized, float32) from its
    GGUF file, in `model.Forward`'s names; the MTP block is left out."""
    from engine.gguf import GGUFFile

    f = GGUFFile(path)
    c = f.config
    if c.arch != "qwen35" or c.is_moe or len(c.rope_sections) != 4 or c.n_ff == 0:
        raise ValueError(f"{path}: the training forward reads dense qwen35 files only")
    interval = c.recurrent.index(False) + 1 if False in c.recurrent else c.n_layer + 1
    hyper = Hyper(
        n_layer=c.n_layer, n_embd=c.n_embd, n_head=c.n_head, n_head_kv=c.n_head_kv,
        head_dim=c.head_dim, rope_dim=c.rope_dim, rope_base=c.rope_base,
        rope_sections=(c.rope_sections[0], c.rope_sections[1], c.rope_sections[2],
                       c.rope_sections[3]),
        full_attention_interval=interval, ssm_group_count=c.ssm_hk,
        ssm_time_step_rank=c.ssm_hv, ssm_state_size=c.ssm_dk, conv_kernel=c.conv_kernel,
        n_ff=c.n_ff, vocab_size=c.n_vocab, rms_eps=c.rms_eps,
    )  # fmt: skip
    hyper.check()
    if tuple(hyper.is_recurrent(i) for i in range(c.n_layer)) != c.recurrent:
        raise ValueError(f"{path}: layer pattern {c.recurrent} has no fixed attention interval")
    trunk = [n for n in f.tensor_names if not n.startswith(f"blk.{c.n_layer}.")]
    params = from_gguf_weights({n: f.load_numpy(n) for n in trunk})
    params.setdefault("output.weight", params["token_embd.weight"])  # tied embeddings
    return hyper, {k: mx.array(w) for k, w in params.items()}


def init_drafter(spec: Any, target: Params, seed: int) -> Params:
    """Fresh drafter weights for a `DFlashSpec`: N(0, 1/fan_in) matrices, residual outputs
    scaled by 1/sqrt(2 * layers), unit norms; `output_norm` starts as the target's, so the
    untrained readout is the target's head on a normed state."""
    rng = np.random.default_rng(seed)
    E, H, Hkv, D, F = spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim, spec.n_ff
    residual = 1.0 / math.sqrt(2 * spec.n_layer)
    out: dict[str, np.ndarray] = {}

    def matrix(name: str, rows: int, cols: int, scale: float = 1.0) -> None:
        out[name] = rng.standard_normal((rows, cols)) * (scale / math.sqrt(cols))

    matrix("fc.weight", E, len(spec.target_layers) * E)
    out["hidden_norm.weight"] = np.ones(E)
    out["output_norm.weight"] = np.array(target["output_norm.weight"])
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        for norm, n in (("attn_norm", E), ("post_attention_norm", E)):
            out[p + f"{norm}.weight"] = np.ones(n)
        for norm in ("attn_q_norm", "attn_k_norm"):
            out[p + f"{norm}.weight"] = np.ones(D)
        matrix(p + "attn_q.weight", H * D, E)
        matrix(p + "attn_k.weight", Hkv * D, E)
        matrix(p + "attn_v.weight", Hkv * D, E)
        matrix(p + "attn_output.weight", E, H * D, residual)
        matrix(p + "ffn_gate.weight", F, E)
        matrix(p + "ffn_up.weight", F, E)
        matrix(p + "ffn_down.weight", E, F, residual)
    return {k: mx.array(v.astype(np.float32)) for k, v in out.items()}


def rope_at(x: mx.array, positions: mx.array, dims: int, base: float) -> mx.array:
    """NeoX rope (`mx.fast.rope`, traditional=False) of `x [..., T, D]` at `positions`
    broadcasting to `[..., T]`, in plain ops (differentiable on every backend)."""
    half = dims // 2
    inv = base ** (-mx.arange(half, dtype=mx.float32) * (2.0 / dims))
    angle = positions.astype(mx.float32)[..., None] * inv
    cos, sin = mx.cos(angle), mx.sin(angle)
    x1, x2 = x[..., :half], x[..., half:dims]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., dims:]], axis=-1)


def block_mask(anchors: mx.array, T: int, S: int) -> mx.array:
    """`[B, 1, A*S, T + A*S]`: block i's queries see context keys t < anchors[:, i] and the
    keys of block i itself (all of them: no causal mask inside a block)."""
    B, A = anchors.shape
    ctx = mx.arange(T)[None, None, :] < anchors[:, :, None]  # [B, A, T]
    ctx = mx.repeat(ctx, S, axis=1)  # [B, A*S, T], rows block-major
    own = mx.arange(A * S)[:, None] // S == mx.arange(A * S)[None, :] // S  # [A*S, A*S]
    own = mx.broadcast_to(own[None], (B, A * S, A * S))
    return mx.concatenate([ctx, own], axis=-1)[:, None]


class DraftForward:
    """The drafter's training forward over a frozen target (`fwd` with weights `target`).

    `spec` is the drafter's `DFlashSpec` (read as plain attributes); matmuls run in
    `fwd.dtype`, norms, rope and softmax in float32.
    """

    def __init__(self, spec: Any, fwd: Forward, target: Params, decay: float = 4.0) -> None:
        self.spec, self.fwd, self.target, self.decay = spec, fwd, target, decay
        S = spec.block_size
        w = np.exp(-np.arange(S - 1) / decay)
        self.weights = mx.array((w / w.sum()).astype(np.float32))  # per block index 1..S-1

    def features(self, tokens: mx.array) -> mx.array:
        """The target layers' outputs at every position of `tokens [B, T]`: `[B, T, L*E]`."""
        outs = self.fwd.layer_outputs(self.target, tokens, max(self.spec.target_layers))
        return mx.stop_gradient(mx.concatenate([outs[i] for i in self.spec.target_layers], -1))

    def context(self, p: Params, features: mx.array) -> mx.array:
        """Context features `rms_norm(features @ fc.T; hidden_norm)`."""
        return self.fwd.norm(self.fwd.linear(features, p["fc.weight"]), p["hidden_norm.weight"])

    def logits(
        self, p: Params, features: mx.array, tokens: mx.array, anchors: mx.array
    ) -> mx.array:
        """Block logits `[B, A, S, V]` (float32) of windows `tokens [B, T]` with their
        `features [B, T, L*E]`, one block at each of `anchors [B, A]` (1 <= a <= T - S)."""
        s, fwd = self.spec, self.fwd
        B, T = tokens.shape
        A, S = anchors.shape[1], s.block_size
        first = mx.take_along_axis(tokens, anchors, axis=1)  # [B, A]
        block = mx.concatenate([first[..., None], mx.full((B, A, S - 1), s.mask_token_id)], -1)
        x = self.target["token_embd.weight"][block.reshape(B, A * S)]
        block_pos = (anchors[:, :, None] + mx.arange(S)).reshape(B, 1, A * S)
        ctx_pos = mx.arange(T)[None, None, :]
        ctx = self.context(p, features)
        mask = block_mask(anchors, T, S)
        for i in range(s.n_layer):
            pre = f"blk.{i}."
            a = fwd.norm(x, p[pre + "attn_norm.weight"])
            x = x + self.attention(p, pre, a, ctx, block_pos, ctx_pos, mask)
            x = x + fwd.ffn(p, pre, fwd.norm(x, p[pre + "post_attention_norm.weight"]))
        h = fwd.norm(x, p["output_norm.weight"])
        return fwd.logits(self.target, h).reshape(B, A, S, -1)

    def attention(
        self,
        p: Params,
        pre: str,
        a: mx.array,
        ctx: mx.array,
        block_pos: mx.array,
        ctx_pos: mx.array,
        mask: mx.array,
    ) -> mx.array:
        """Block inputs `a [B, A*S, E]` (normed) attend over the context `ctx [B, T, E]`
        (K/V by this layer's own matrices, K normed and rotated at `ctx_pos`) followed by
        the blocks themselves, as `mask` allows -> `[B, A*S, E]`."""
        s, fwd = self.spec, self.fwd
        B, Q, _ = a.shape
        H, Hkv, D = s.n_head, s.n_head_kv, s.head_dim

        def heads(x: mx.array, w: str, n: int, norm: str | None, pos: mx.array) -> mx.array:
            y = fwd.linear(x, p[pre + w]).reshape(B, x.shape[1], n, D).transpose(0, 2, 1, 3)
            if norm is None:
                return y
            y = fwd.norm(y, p[pre + norm])
            return rope_at(y, pos, D, s.rope_base).astype(fwd.dtype)

        q = heads(a, "attn_q.weight", H, "attn_q_norm.weight", block_pos)
        k = mx.concatenate(
            [
                heads(ctx, "attn_k.weight", Hkv, "attn_k_norm.weight", ctx_pos),
                heads(a, "attn_k.weight", Hkv, "attn_k_norm.weight", block_pos),
            ],
            axis=2,
        )
        v = mx.concatenate(
            [
                heads(ctx, "attn_v.weight", Hkv, None, ctx_pos),
                heads(a, "attn_v.weight", Hkv, None, block_pos),
            ],
            axis=2,
        )
        o = plain_attention(q, k, v, 1.0 / math.sqrt(D), mask)
        return fwd.linear(
            o.transpose(0, 2, 1, 3).reshape(B, Q, H * D), p[pre + "attn_output.weight"]
        )

    def losses(
        self, p: Params, features: mx.array, tokens: mx.array, anchors: mx.array
    ) -> tuple[mx.array, mx.array]:
        """(weighted cross-entropy of the drafts, mean accepted length): the number of
        leading drafts (block indices 1..S-1, argmax) equal to the window's next tokens."""
        S = self.spec.block_size
        logits = self.logits(p, features, tokens, anchors)[:, :, 1:]
        labels = mx.take_along_axis(
            tokens[:, None, :], (anchors[:, :, None] + mx.arange(1, S)), axis=2
        )
        ce = nn.losses.cross_entropy(logits, labels, reduction="none")  # [B, A, S-1]
        loss = (ce * self.weights).sum(-1).mean()
        hits = (mx.argmax(logits, axis=-1) == labels).astype(mx.float32)
        accepted = mx.cumprod(hits, axis=-1).sum(-1).mean()
        return loss, accepted
