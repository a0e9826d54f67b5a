"""The demo model as a trainable function of its weights: the `qwen35` forward of
engine/models/qwen35.py (MODEL_SPEC §5-§10) over full `[B, T]` windows from position 0.

Weights live in one dict keyed by their GGUF tensor names, in numpy order, so export is a
rename-free hand-over to the writer. One exception: the GDN decay rate is trained as
`blk.i.ssm_a_log` (A_log) and exported as `ssm_a = -exp(A_log)`, which keeps it negative.

Only mlx, numpy and engine.gated_delta are imported, so the GPU machine needs neither `gguf`
nor `tokenizers`. The engine reading the exported file is the check that this math is the
engine's (tests/test_train_demo.py compares their logits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.gated_delta import gated_delta_chunked, l2_normalize

Params = dict[str, mx.array]


@dataclass(frozen=True)
class Hyper:
    """The `engine.writer.ModelSpec` fields the forward reads (same names and meanings)."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_dim: int
    rope_base: float
    rope_sections: tuple[int, int, int, int]
    full_attention_interval: int
    ssm_group_count: int
    ssm_time_step_rank: int
    ssm_state_size: int
    conv_kernel: int
    n_ff: int
    vocab_size: int
    rms_eps: float

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> Hyper:
        """From a dict of ModelSpec fields (extra fields such as `quant` are ignored)."""
        picked = {f.name: spec[f.name] for f in fields(cls)}
        picked["rope_sections"] = tuple(picked["rope_sections"])
        hyper = cls(**picked)
        hyper.check()
        return hyper

    def check(self) -> None:
        if self.vocab_size > 65536:
            raise ValueError("token ids are packed as uint16: vocab_size must be < 65536")
        s, half = self.rope_sections, self.rope_dim // 2
        total = sum(s)
        for i in range(half):  # IM-RoPE equals plain NeoX only if every pair rotates (§16.1)
            sector = i % total
            if sector >= 3 * s[sector % 3]:
                raise ValueError(f"rope_sections {s} leave rotary pair {i} unrotated")

    def is_recurrent(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval != 0


def init_params(h: Hyper, seed: int) -> Params:
    """Fresh weights: N(0, 1/fan_in) matrices, residual outputs scaled by 1/sqrt(2L), unit
    norms, Mamba-style decay rates (dt log-uniform in [1e-3, 1e-1], A in [1, 16])."""
    rng = np.random.default_rng(seed)
    E, V, L, F = h.n_embd, h.vocab_size, h.n_layer, h.n_ff
    Hk, Hv, d, Kc = h.ssm_group_count, h.ssm_time_step_rank, h.ssm_state_size, h.conv_kernel
    Cc, Cv = 2 * Hk * d + Hv * d, Hv * d
    H, Hkv, D = h.n_head, h.n_head_kv, h.head_dim
    out: dict[str, np.ndarray] = {}

    def matrix(name: str, rows: int, cols: int, scale: float = 1.0) -> None:
        out[name] = rng.standard_normal((rows, cols)) * (scale / math.sqrt(cols))

    def ones(name: str, n: int) -> None:
        out[name] = np.ones(n)

    residual = 1.0 / math.sqrt(2 * (L + 1))
    out["token_embd.weight"] = rng.standard_normal((V, E))
    ones("output_norm.weight", E)
    matrix("output.weight", V, E)
    for i in range(L + 1):  # trunk layers, then the MTP block
        p = f"blk.{i}."
        ones(p + "attn_norm.weight", E)
        ones(p + "post_attention_norm.weight", E)
        if i < L and h.is_recurrent(i):
            matrix(p + "attn_qkv.weight", Cc, E)
            matrix(p + "attn_gate.weight", Cv, E)
            matrix(p + "ssm_beta.weight", Hv, E)
            matrix(p + "ssm_alpha.weight", Hv, E)
            out[p + "ssm_conv1d.weight"] = rng.uniform(-1, 1, (Cc, Kc)) / math.sqrt(Kc)
            dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), Hv))
            out[p + "ssm_dt.bias"] = np.log(np.expm1(dt))
            out[p + "ssm_a_log"] = rng.uniform(0.0, math.log(16.0), Hv)
            ones(p + "ssm_norm.weight", d)
            matrix(p + "ssm_out.weight", E, Cv, residual)
        else:
            matrix(p + "attn_q.weight", 2 * H * D, E)
            matrix(p + "attn_k.weight", Hkv * D, E)
            matrix(p + "attn_v.weight", Hkv * D, E)
            ones(p + "attn_q_norm.weight", D)
            ones(p + "attn_k_norm.weight", D)
            matrix(p + "attn_output.weight", E, H * D, residual)
        matrix(p + "ffn_gate.weight", F, E)
        matrix(p + "ffn_up.weight", F, E)
        matrix(p + "ffn_down.weight", E, F, residual)
        if i == L:
            matrix(p + "nextn.eh_proj.weight", E, 2 * E)
            for norm in ("enorm", "hnorm", "shared_head_norm"):
                ones(p + f"nextn.{norm}.weight", E)
    return {k: mx.array(v.astype(np.float32)) for k, v in out.items()}


def to_gguf_weights(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Trained weights -> the file's tensors (`ssm_a_log` becomes `ssm_a = -exp(A_log)`)."""
    out = {}
    for name, w in params.items():
        if name.endswith(".ssm_a_log"):
            out[name[: -len("_log")]] = -np.exp(w.astype(np.float32))
        else:
            out[name] = w
    return out


def from_gguf_weights(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A file's tensors -> trainable weights (`ssm_a` becomes `ssm_a_log = log(-ssm_a)`)."""
    out = {}
    for name, w in tensors.items():
        if name.endswith(".ssm_a"):
            out[name + "_log"] = np.log(-w.astype(np.float32))
        else:
            out[name] = w
    return out


# ----------------------------------------------------------------------------------------------
# Forward


class Forward:
    """The forward over `[B, T]` token windows, matmuls in `dtype`, everything else float32.

    `fused_attention` uses `mx.fast.scaled_dot_product_attention`; without it, attention is
    spelled out in plain ops (same math), for a backend that cannot differentiate the fused
    kernel (`train` checks at start).
    """

    def __init__(
        self, h: Hyper, dtype: mx.Dtype = mx.float32, fused_attention: bool = True
    ) -> None:
        self.h, self.dtype, self.fused_attention = h, dtype, fused_attention

    def linear(self, x: mx.array, w: mx.array) -> mx.array:
        return x.astype(self.dtype) @ w.astype(self.dtype).T

    def norm(self, x: mx.array, w: mx.array) -> mx.array:
        return mx.fast.rms_norm(x.astype(mx.float32), w, self.h.rms_eps)

    def trunk(self, p: Params, tokens: mx.array) -> mx.array:
        """Post-`output_norm` hidden states `[B, T, E]` (what both heads read)."""
        return self.norm(self.layer_outputs(p, tokens)[-1], p["output_norm.weight"])

    def layer_outputs(self, p: Params, tokens: mx.array, last: int | None = None) -> list[mx.array]:
        """The outputs `[B, T, E]` of trunk layers 0..`last` (default: all), before any norm:
        what the engine's runner taps for a DFlash drafter (`Row.taps`)."""
        x = p["token_embd.weight"][tokens]
        out = []
        for i in range(self.h.n_layer if last is None else last + 1):
            x = self.layer(p, f"blk.{i}.", x, self.h.is_recurrent(i))
            out.append(x)
        return out

    def layer(self, p: Params, pre: str, x: mx.array, recurrent: bool) -> mx.array:
        a = self.norm(x, p[pre + "attn_norm.weight"])
        x = x + (self.gated_delta_net(p, pre, a) if recurrent else self.attention(p, pre, a))
        return x + self.ffn(p, pre, self.norm(x, p[pre + "post_attention_norm.weight"]))

    def ffn(self, p: Params, pre: str, f: mx.array) -> mx.array:
        """The dense SwiGLU FFN of layer `pre` on normed inputs `f`."""
        gate, up = (
            self.linear(f, p[pre + "ffn_gate.weight"]),
            self.linear(f, p[pre + "ffn_up.weight"]),
        )
        return self.linear(nn.silu(gate) * up, p[pre + "ffn_down.weight"])

    def attention(self, p: Params, pre: str, a: mx.array) -> mx.array:
        h = self.h
        B, T, _ = a.shape
        H, Hkv, D = h.n_head, h.n_head_kv, h.head_dim
        qg = self.linear(a, p[pre + "attn_q.weight"]).reshape(B, T, H, 2, D)
        q, gate = qg[..., 0, :], qg[..., 1, :]
        k = self.linear(a, p[pre + "attn_k.weight"]).reshape(B, T, Hkv, D)
        v = self.linear(a, p[pre + "attn_v.weight"]).reshape(B, T, Hkv, D)

        def rope(x: mx.array) -> mx.array:
            x = x.transpose(0, 2, 1, 3)
            return mx.fast.rope(
                x, h.rope_dim, traditional=False, base=h.rope_base, scale=1.0, offset=0
            )

        q = rope(self.norm(q, p[pre + "attn_q_norm.weight"])).astype(self.dtype)
        k = rope(self.norm(k, p[pre + "attn_k_norm.weight"])).astype(self.dtype)
        attend = causal_attention if self.fused_attention else plain_causal_attention
        o = attend(q, k, v.transpose(0, 2, 1, 3), 1.0 / math.sqrt(D))
        o = o.transpose(0, 2, 1, 3) * mx.sigmoid(gate)
        return self.linear(o.reshape(B, T, H * D), p[pre + "attn_output.weight"])

    def gated_delta_net(self, p: Params, pre: str, a: mx.array) -> mx.array:
        h = self.h
        B, T, _ = a.shape
        Hk, Hv, d, Kc = h.ssm_group_count, h.ssm_time_step_rank, h.ssm_state_size, h.conv_kernel
        Cq = Hk * d
        mixed = self.linear(a, p[pre + "attn_qkv.weight"]).astype(mx.float32)
        z = self.linear(a, p[pre + "attn_gate.weight"]).reshape(B, T, Hv, d)
        beta = mx.sigmoid(self.linear(a, p[pre + "ssm_beta.weight"]).astype(mx.float32))
        alpha = self.linear(a, p[pre + "ssm_alpha.weight"]).astype(mx.float32)
        g = -mx.exp(p[pre + "ssm_a_log"]) * nn.softplus(alpha + p[pre + "ssm_dt.bias"])
        window = mx.pad(mixed, [(0, 0), (Kc - 1, 0), (0, 0)])  # zero conv state at position 0
        w = p[pre + "ssm_conv1d.weight"]
        c = nn.silu(sum(window[:, i : i + T] * w[:, i] for i in range(Kc)))
        q = l2_normalize(c[..., :Cq].reshape(B, T, Hk, d), h.rms_eps) * (1.0 / math.sqrt(d))
        k = l2_normalize(c[..., Cq : 2 * Cq].reshape(B, T, Hk, d), h.rms_eps)
        v = c[..., 2 * Cq :].reshape(B, T, Hv, d)
        state = mx.zeros((B, Hv, d, d), dtype=mx.float32)
        o, _ = gated_delta_chunked(q, k, v, g, beta, state, tiled=True)
        y = mx.fast.rms_norm(o, p[pre + "ssm_norm.weight"], h.rms_eps) * nn.silu(
            z.astype(mx.float32)
        )
        return self.linear(y.reshape(B, T, Hv * d), p[pre + "ssm_out.weight"])

    def mtp(self, p: Params, hidden: mx.array, next_tokens: mx.array) -> mx.array:
        """The NextN block: hidden `h_t` `[B, T, E]` with token `x_{t+1}` at position t ->
        its post-norm hidden `[B, T, E]`, whose logits predict `x_{t+2}` (§10, §16.2)."""
        pre = f"blk.{self.h.n_layer}."
        e = p["token_embd.weight"][next_tokens]
        u = mx.concatenate(
            [
                self.norm(e, p[pre + "nextn.enorm.weight"]),
                self.norm(hidden, p[pre + "nextn.hnorm.weight"]),
            ],
            axis=-1,
        )
        u = self.layer(p, pre, self.linear(u, p[pre + "nextn.eh_proj.weight"]), recurrent=False)
        return self.norm(u, p[pre + "nextn.shared_head_norm.weight"])

    def logits(self, p: Params, hidden: mx.array) -> mx.array:
        return self.linear(hidden, p["output.weight"]).astype(mx.float32)

    def losses(self, p: Params, window: mx.array) -> tuple[mx.array, mx.array]:
        """Mean next-token and MTP (token two ahead) cross-entropies over `window [B, T+2]`."""
        tokens, targets, after = window[:, :-2], window[:, 1:-1], window[:, 2:]
        hidden = self.trunk(p, tokens)
        main = nn.losses.cross_entropy(self.logits(p, hidden), targets, reduction="mean")
        draft = self.mtp(p, hidden, targets)
        mtp = nn.losses.cross_entropy(self.logits(p, draft), after, reduction="mean")
        return main, mtp


def causal_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """q `[B, H, T, D]`, k and v `[B, Hkv, T, D]` -> `[B, H, T, D]`."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")


def plain_causal_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """`causal_attention` in plain ops (softmax in float32)."""
    T = q.shape[2]
    return plain_attention(q, k, v, scale, mx.arange(T)[:, None] >= mx.arange(T)[None, :])


def plain_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array
) -> mx.array:
    """q `[B, H, Tq, D]`, k and v `[B, Hkv, Tk, D]`, boolean `mask` broadcasting to
    `[B, H, Tq, Tk]` (True: attend) -> `[B, H, Tq, D]`, in plain ops (softmax in float32);
    every query must see at least one key."""
    r = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, r, axis=1), mx.repeat(v, r, axis=1)  # query head h reads KV head h // r
    scores = (q @ k.swapaxes(-1, -2)).astype(mx.float32) * scale
    weights = mx.softmax(mx.where(mask, scores, -mx.inf), axis=-1)
    return weights.astype(v.dtype) @ v


def fused_attention_trains(h: Hyper, dtype: mx.Dtype) -> bool:
    """Whether this backend differentiates the fused attention kernel at these shapes."""
    q = mx.random.normal((1, h.n_head, 128, h.head_dim)).astype(dtype)
    kv = mx.random.normal((1, h.n_head_kv, 128, h.head_dim)).astype(dtype)
    try:
        grad = mx.grad(lambda q: causal_attention(q, kv, kv, 0.125).astype(mx.float32).sum())
        mx.eval(grad(q))
    except Exception as e:  # any failure: fall back to the plain form
        print(f"train: fused attention cannot train here ({type(e).__name__}: {e}); plain ops")
        return False
    return True
