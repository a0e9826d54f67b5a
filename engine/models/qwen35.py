"""Qwen3.5 / Qwen3.6 / Qwen3-Next hybrid model in MLX (math: MODEL_SPEC §5-§10).

The model is pure math over a batch of rows. A row is one sequence's tokens for
this step (a decode token, a verify run, a prefill chunk); rows are ragged and
travel *packed* — all tokens of the batch in one `[N, E]` matrix — so every
projection and FFN is one matmul for the whole batch. Only the mixers need
per-row structure: they view the packed tokens as padded `[B, T]` through
`Layout`, and read and return per-row state (KV, conv, recurrent) that the
caller owns. Nothing per-sequence is ever stored on the model.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from engine.gated_delta import gated_delta, l2_normalize
from engine.gguf import GGUFFile, ModelConfig, QuantizedWeight, Weight
from engine.kernels import (
    add_norm_cuda,
    attention_cuda,
    embed_cuda,
    gdn_mixer_cuda,
    gemv_cuda,
    swiglu_cuda,
)
from engine.models import weights
from engine.models.batch import (
    AttentionState,
    LayerState,
    Layout,
    LinearCapture,
    LinearState,
    unstacked,
)
from engine.models.weights import Loader, Projection, expert_matmul, matmul


def rms_norm(x: mx.array, w: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, w, eps)


def add_rms_norm(
    x: mx.array, m: mx.array | None, w: mx.array, eps: float, w32: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """The residual stream `h = x + m` (`x` alone when `m` is None) and `rms_norm(h) * w`:
    one kernel on MLX's CUDA backend (`engine.kernels.add_norm_cuda`), two ops elsewhere.
    `w32`: `w` as float32, made once at load, which the kernel reads (converting `w` in
    the call would add an op to every step)."""
    if m is None:
        return x, rms_norm(x, w, eps)
    if add_norm_cuda.enabled() and x.ndim == 2 and m.dtype == x.dtype:
        return add_norm_cuda.add_rms_norm_cuda(x, m, w if w32 is None else w32, eps)
    h = x + m
    return h, rms_norm(h, w, eps)


def add_norm_project(
    x: mx.array, m: mx.array | None, w: mx.array, w32: mx.array, eps: float, proj: Projection
) -> tuple[mx.array, mx.array]:
    """`add_rms_norm(x, m, w, eps)`, then the normalised rows through `proj` (joined): the
    residual stream `h` and the product. A decode-sized product on MLX's CUDA backend takes
    the add and the norm into its own kernel (`gemv_cuda.add_norm_gemv_cuda`): one launch
    where there were two, and the normalised rows are never stored."""
    W = proj.fused
    if m is None or m.dtype != x.dtype or not takes_add_norm(x, proj):
        h, a = add_rms_norm(x, m, w, eps, w32)
        return h, proj.joined(a)
    assert W is not None  # (takes_add_norm)
    return gemv_cuda.add_norm_gemv_cuda(x, m, w32, eps, W)


def takes_add_norm(x: mx.array, proj: Projection) -> bool:
    """Whether `add_norm_project` runs the add + norm of rows like `x` inside `proj`'s
    product kernel."""
    W = proj.fused
    return (
        W is not None
        and x.ndim == 2
        and gemv_cuda.takes_prologue(x.shape[0], x.shape[1], x.dtype, W)
    )


def rope_frequencies(cfg: ModelConfig) -> mx.array:
    """Angular frequency of each rotary pair; 0 for pairs IM-RoPE leaves unrotated (§16.1)."""
    half = cfg.rope_dim // 2
    freqs = [cfg.rope_base ** (-2.0 * i / cfg.rope_dim) for i in range(half)]
    if cfg.rope_sections:
        s = cfg.rope_sections
        total = sum(s)
        for i in range(half):
            sector = i % total
            m = sector % 3
            if not (
                (m == 0 and sector < 3 * s[0])
                or (m == 1 and sector < 3 * s[1])
                or (m == 2 and sector < 3 * s[2])
            ):
                freqs[i] = 0.0
    return mx.array(freqs, dtype=mx.float32)


# ----------------------------------------------------------------------------------------------
# Layers


class Attention:
    """Gated full attention with q/k norms and partial rope (MODEL_SPEC §7)."""

    def __init__(self, ld: Loader, prefix: str, cfg: ModelConfig, freqs: mx.array) -> None:
        E, H, Hkv, D = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim
        self.cfg = cfg
        self.omega = freqs
        # mx.fast.rope takes wavelengths 1/omega; unrotated pairs (omega = 0) get infinity
        self.wavelengths = mx.where(freqs > 0, 1.0 / freqs, mx.inf)
        self.in_proj = Projection(
            ld,
            [
                (f"{prefix}.attn_q.weight", (2 * H * D, E)),
                (f"{prefix}.attn_k.weight", (Hkv * D, E)),
                (f"{prefix}.attn_v.weight", (Hkv * D, E)),
            ],
        )
        self.wo = ld.matrix(f"{prefix}.attn_output.weight", (E, H * D))
        self.q_norm = ld.dense(f"{prefix}.attn_q_norm.weight", (D,))
        self.k_norm = ld.dense(f"{prefix}.attn_k_norm.weight", (D,))
        # float32 copies for the fused kernels (a conversion per call is an op per step)
        self.q_norm32, self.k_norm32 = (
            self.q_norm.astype(mx.float32),
            self.k_norm.astype(mx.float32),
        )

    def rope(self, x: mx.array, layout: Layout) -> mx.array:
        """NeoX rope on `[B, H, T, D]`, row b starting at position `row_starts[b]`."""
        return mx.fast.rope(
            x,
            self.cfg.rope_dim,
            traditional=False,
            base=None,
            scale=1.0,
            offset=layout.row_starts,
            freqs=self.wavelengths,
        )

    def __call__(
        self, qkv: mx.array, layout: Layout, state: AttentionState
    ) -> tuple[mx.array, AttentionState]:
        """`qkv`: the layer's normalised rows through `self.in_proj`, joined (gated q, k, v)."""
        cfg = self.cfg
        H, Hkv, D, eps = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rms_eps
        if attention_cuda.enabled() and D % 32 == 0:
            past_k, past_v = state.k, state.v  # (the pool's views, read as they are)
            if not past_k.shape[-3]:  # the kernel reads no past here, but takes no empty array
                past_k = past_v = mx.zeros((layout.rows, 1, Hkv, D), dtype=state.k.dtype)
            out, k_new, v_new = attention_cuda.attention_cuda(
                qkv,
                layout.pad_index,
                layout.pack_index,
                layout.row_starts,
                layout.row_lengths,
                past_k,
                past_v,
                self.q_norm32,
                self.k_norm32,
                self.omega,
                n_heads=H,
                n_kv_heads=Hkv,
                rope_dim=cfg.rope_dim,
                eps=eps,
            )
            new = AttentionState(
                layout.to_padded(k_new), layout.to_padded(v_new), packed=(k_new, v_new)
            )
            return matmul(out, self.wo), new
        state = AttentionState(unstacked(state.k, 4), unstacked(state.v, 4))
        qg, k, v = (layout.to_padded(y) for y in self.in_proj.split(qkv))
        B, T, _ = qg.shape
        qg = qg.reshape(B, T, H, 2, D)
        q, gate = qg[..., 0, :], qg[..., 1, :]
        k, v = k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D)
        q = self.rope(rms_norm(q, self.q_norm, eps).transpose(0, 2, 1, 3), layout)
        k = self.rope(rms_norm(k, self.k_norm, eps).transpose(0, 2, 1, 3), layout)
        k = k.transpose(0, 2, 1, 3)  # [B, T, Hkv, D] as the pool stores it

        # Attend to exactly what the pool will store, so chunking never changes the result.
        k, v = k.astype(state.k.dtype), v.astype(state.v.dtype)
        S = state.k.shape[1]
        keys, values = k, v
        if S:  # no zero-sized arrays: MLX's compiled CUDA graphs do not survive them
            keys = mx.concatenate([state.k, k], axis=1)
            values = mx.concatenate([state.v, v], axis=1)
        keys = keys.transpose(0, 2, 1, 3).astype(q.dtype)
        values = values.transpose(0, 2, 1, 3).astype(q.dtype)
        out = mx.fast.scaled_dot_product_attention(
            q,
            keys,
            values,
            scale=1.0 / math.sqrt(D),
            mask=attention_mask(layout, S),
        )
        out = out.transpose(0, 2, 1, 3) * mx.sigmoid(gate)
        out = layout.to_packed(out.reshape(B, T, H * D))
        return matmul(out, self.wo), AttentionState(k, v)


def attention_mask(layout: Layout, past: int) -> mx.array:
    """Boolean `[B, 1, T, S+T]`: past slots below each row's start, then causal new tokens."""
    key = mx.arange(past + layout.width)[None, None, :]
    query = mx.arange(layout.width)[None, :, None]
    start = layout.row_starts[:, None, None]
    return mx.where(key < past, key < start, key - past <= query)[:, None]


class GatedDeltaNet:
    """Linear-attention mixer (MODEL_SPEC §6); qwen3next reads a fused `ssm_ba`."""

    def __init__(self, ld: Loader, prefix: str, cfg: ModelConfig) -> None:
        E, Hv, Kc = cfg.n_embd, cfg.ssm_hv, cfg.conv_kernel
        Cc, Cv = cfg.conv_channels, cfg.ssm_hv * cfg.ssm_dv
        self.cfg = cfg
        ba = (
            [(f"{prefix}.ssm_ba.weight", (2 * Hv, E))]
            if ld.has(f"{prefix}.ssm_ba.weight")
            else [(f"{prefix}.ssm_beta.weight", (Hv, E)), (f"{prefix}.ssm_alpha.weight", (Hv, E))]
        )
        self.fused_ba = len(ba) == 1
        self.in_proj = Projection(
            ld,
            [(f"{prefix}.attn_qkv.weight", (Cc, E)), (f"{prefix}.attn_gate.weight", (Cv, E)), *ba],
        )
        self.conv_w = ld.dense(f"{prefix}.ssm_conv1d.weight", (Cc, Kc), exact=True)
        dt = f"{prefix}.ssm_dt.bias" if ld.has(f"{prefix}.ssm_dt.bias") else f"{prefix}.ssm_dt"
        self.dt_bias = ld.dense(dt, (Hv,), exact=True)
        self.ssm_a = ld.dense(f"{prefix}.ssm_a", (Hv,), exact=True)
        self.norm = ld.dense(f"{prefix}.ssm_norm.weight", (cfg.ssm_dv,), exact=True)
        self.w_out = ld.matrix(f"{prefix}.ssm_out.weight", (E, Cv))

    def _beta_alpha(self, ba: list[mx.array]) -> tuple[mx.array, mx.array]:
        if not self.fused_ba:
            return ba[0], ba[1]
        cfg = self.cfg
        r = cfg.ssm_hv // cfg.ssm_hk
        fused = ba[0].reshape(-1, cfg.ssm_hk, 2 * r)  # per key head: [b x r, a x r]
        return fused[..., :r].reshape(-1, cfg.ssm_hv), fused[..., r:].reshape(-1, cfg.ssm_hv)

    def __call__(
        self, proj: mx.array, layout: Layout, state: LinearState
    ) -> tuple[mx.array, LinearState, LinearCapture | None]:
        """`proj`: the layer's normalised rows through `self.in_proj`, joined (qkv, z, b/a)."""
        cfg = self.cfg
        if gdn_mixer_cuda.enabled():
            cap_rows = layout.capture_rows
            y, ssm, conv, kept = gdn_mixer_cuda.gdn_mixer_cuda(
                proj,
                layout.pad_index,
                layout.row_lengths,
                state.conv,
                state.ssm,
                self.conv_w,
                self.dt_bias,
                self.ssm_a,
                self.norm,
                n_key_heads=cfg.ssm_hk,
                tiled=cfg.v_heads_tiled,
                fused_ba=self.fused_ba,
                eps=cfg.rms_eps,
                capture_rows=cap_rows,
            )
            capture = None if kept is None else LinearCapture(cap_rows, *kept)
            return matmul(y, self.w_out), LinearState(conv, ssm), capture
        state = LinearState(unstacked(state.conv, 3), unstacked(state.ssm, 4))
        Hk, Hv, dk, dv, Kc = cfg.ssm_hk, cfg.ssm_hv, cfg.ssm_dk, cfg.ssm_dv, cfg.conv_kernel
        Cq = Hk * dk
        p_raw, z_raw, *ba = self.in_proj.split(proj)
        b_raw, a_raw = self._beta_alpha(ba)
        p = layout.to_padded(p_raw)  # [B, T, Cc]
        z = layout.to_padded(z_raw)
        B, T, _ = p.shape
        z = z.reshape(B, T, Hv, dv)
        window = mx.concatenate([state.conv, p.astype(mx.float32)], axis=1)  # [B, Kc-1+T, Cc]
        valid = layout.valid[..., None]
        beta = mx.where(valid, mx.sigmoid(layout.to_padded(b_raw).astype(mx.float32)), 0.0)
        g = self.ssm_a * nn.softplus(layout.to_padded(a_raw).astype(mx.float32) + self.dt_bias)
        g = mx.where(valid, g, 0.0)  # padding: decay 1 and no update keep the state as is
        c = nn.silu(sum(window[:, i : i + T] * self.conv_w[:, i] for i in range(Kc)))
        q = l2_normalize(c[..., :Cq].reshape(B, T, Hk, dk), cfg.rms_eps)
        k = l2_normalize(c[..., Cq : 2 * Cq].reshape(B, T, Hk, dk), cfg.rms_eps)
        v = c[..., 2 * Cq :].reshape(B, T, Hv, dv)
        q = q * (1.0 / math.sqrt(dk))
        o, ssm, capture = recurrence(q, k, v, g, beta, state.ssm, window, layout, cfg.v_heads_tiled)
        y = rms_norm(o, self.norm, cfg.rms_eps) * nn.silu(z.astype(mx.float32))
        out = matmul(layout.to_packed(y.astype(proj.dtype).reshape(B, T, Hv * dv)), self.w_out)
        return out, LinearState(conv_tail(window, layout, Kc), ssm), capture


def recurrence(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    ssm: mx.array,
    window: mx.array,
    layout: Layout,
    tiled: bool,
) -> tuple[mx.array, mx.array, LinearCapture | None]:
    """Run the batch's recurrence; capture rows keep their state after every position.

    Capture rows (short verify runs) take the stepwise path; the others the fast path.
    """
    cap_rows = layout.capture_rows
    if not cap_rows:
        o, final = gated_delta(q, k, v, g, beta, ssm, tiled)
        return o, final, None
    rest = tuple(b for b, c in enumerate(layout.capture) if not c)
    ci = mx.array(cap_rows, dtype=mx.int32)
    o_c, states = gated_delta(q[ci], k[ci], v[ci], g[ci], beta[ci], ssm[ci], tiled, capture=True)
    states = mx.concatenate([ssm[ci][:, None], states], axis=1)
    capture = LinearCapture(cap_rows, window[ci], states)
    if not rest:
        return o_c, states[:, -1], capture
    ri = mx.array(rest, dtype=mx.int32)
    o_r, final_r = gated_delta(q[ri], k[ri], v[ri], g[ri], beta[ri], ssm[ri], tiled)
    order = mx.argsort(mx.array(cap_rows + rest, dtype=mx.int32))
    o = mx.concatenate([o_c, o_r], axis=0)[order]
    final = mx.concatenate([states[:, -1], final_r], axis=0)[order]
    return o, final, capture


def conv_tail(window: mx.array, layout: Layout, Kc: int) -> mx.array:
    """The last Kc-1 real inputs of each row: `window[b, n_b : n_b + Kc - 1]`."""
    if layout.uniform:
        return window[:, layout.width :]
    idx = layout.row_lengths[:, None] + mx.arange(Kc - 1)[None, :]
    return mx.take_along_axis(window, idx[..., None], axis=1)


class DenseFFN:
    def __init__(self, ld: Loader, prefix: str, n_embd: int, n_ff: int, suffix: str = "") -> None:
        self.gate_up = Projection(
            ld,
            [
                (f"{prefix}.ffn_gate{suffix}.weight", (n_ff, n_embd)),
                (f"{prefix}.ffn_up{suffix}.weight", (n_ff, n_embd)),
            ],
        )
        self.down = ld.matrix(f"{prefix}.ffn_down{suffix}.weight", (n_embd, n_ff))

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_of(self.gate_up.joined(x))

    def down_of(self, gu: mx.array) -> mx.array:
        """The FFN's output from its joined gate|up projection `gu`: `silu(gate) * up` through
        the down projection, in one kernel for a decode-sized product on MLX's CUDA backend
        (`gemv_cuda.swiglu_gemv_cuda`), else the SwiGLU's own kernel or ops, then the matmul."""
        F = gu.shape[-1] // 2
        if gu.ndim == 2 and gemv_cuda.takes_prologue(gu.shape[0], F, gu.dtype, self.down, "swiglu"):
            return gemv_cuda.swiglu_gemv_cuda(gu, self.down)
        if swiglu_cuda.enabled():
            return matmul(swiglu_cuda.swiglu_cuda(gu), self.down)
        gate, up = gu[..., :F], gu[..., F:]
        return matmul(nn.silu(gate) * up, self.down)


class MoEFFN:
    """Softmax router, top-k renormalised experts, sigmoid-gated shared expert (MODEL_SPEC §9)."""

    def __init__(self, ld: Loader, prefix: str, cfg: ModelConfig) -> None:
        E, n_exp, F = cfg.n_embd, cfg.n_expert, cfg.n_ff_exp
        self.k = cfg.n_expert_used
        self.router = ld.dense(f"{prefix}.ffn_gate_inp.weight", (n_exp, E), exact=True)
        if ld.has(f"{prefix}.ffn_gate_up_exps.weight"):
            fused = ld.dense(f"{prefix}.ffn_gate_up_exps.weight", (n_exp, 2 * F, E))
            self.gate: Weight = fused[:, :F]
            self.up: Weight = fused[:, F:]
        else:
            self.gate = ld.matrix(f"{prefix}.ffn_gate_exps.weight", (n_exp, F, E))
            self.up = ld.matrix(f"{prefix}.ffn_up_exps.weight", (n_exp, F, E))
        self.down = ld.matrix(f"{prefix}.ffn_down_exps.weight", (n_exp, E, F))
        self.shared = DenseFFN(ld, prefix, E, cfg.n_ff_shexp, suffix="_shexp")
        self.shared_gate = ld.dense(f"{prefix}.ffn_gate_inp_shexp.weight", exact=True)

    def __call__(self, x: mx.array) -> mx.array:
        assert isinstance(self.router, mx.array) and isinstance(self.shared_gate, mx.array)
        probs = mx.softmax(matmul(x.astype(mx.float32), self.router), axis=-1)
        idx = mx.stop_gradient(mx.argpartition(-probs, kth=self.k - 1, axis=-1)[:, : self.k])
        w = mx.take_along_axis(probs, idx, axis=-1)
        w = w / mx.maximum(w.sum(-1, keepdims=True), 6.103515625e-5)
        xe = x[:, None, None, :]
        h = nn.silu(expert_matmul(xe, self.gate, idx)) * expert_matmul(xe, self.up, idx)
        y = expert_matmul(h, self.down, idx).squeeze(-2)  # [N, k, E]
        y = (y * w[..., None].astype(y.dtype)).sum(axis=1)
        gamma = mx.sigmoid(x @ self.shared_gate.reshape(-1, 1))
        return y + gamma * self.shared(x)


class DecoderLayer:
    def __init__(self, ld: Loader, i: int, cfg: ModelConfig, freqs: mx.array, linear: bool):
        prefix = f"blk.{i}"
        self.eps = cfg.rms_eps
        self.attn_norm = ld.dense(f"{prefix}.attn_norm.weight", (cfg.n_embd,))
        self.post_norm = ld.dense(f"{prefix}.post_attention_norm.weight", (cfg.n_embd,))
        self.attn_norm32 = self.attn_norm.astype(mx.float32)  # what add_rms_norm's kernel reads
        self.post_norm32 = self.post_norm.astype(mx.float32)
        self.mixer: GatedDeltaNet | Attention = (
            GatedDeltaNet(ld, prefix, cfg) if linear else Attention(ld, prefix, cfg, freqs)
        )
        self.ffn: MoEFFN | DenseFFN = (
            MoEFFN(ld, prefix, cfg) if cfg.is_moe else DenseFFN(ld, prefix, cfg.n_embd, cfg.n_ff)
        )

    def __call__(
        self, x: mx.array, layout: Layout, state: LayerState, pending: mx.array | None = None
    ) -> tuple[mx.array, mx.array, LayerState, LinearCapture | None]:
        """The layer on the residual stream `x + pending` (`x` alone when `pending` is None).
        Returns `(h, f, new state, capture)`: the layer's output is `h + f`, left unadded
        so the next residual add folds into the next norm (`add_rms_norm`)."""
        eps, proj = self.eps, self.mixer.in_proj
        h, p = add_norm_project(x, pending, self.attn_norm, self.attn_norm32, eps, proj)
        capture = None
        new: LayerState
        if isinstance(self.mixer, GatedDeltaNet):
            assert isinstance(state, LinearState)
            m, new, capture = self.mixer(p, layout, state)
        else:
            assert isinstance(state, AttentionState)
            m, new = self.mixer(p, layout, state)
        if isinstance(self.ffn, DenseFFN):
            h, gu = add_norm_project(h, m, self.post_norm, self.post_norm32, eps, self.ffn.gate_up)
            return h, self.ffn.down_of(gu), new, capture
        h, a = add_rms_norm(h, m, self.post_norm, eps, self.post_norm32)
        return h, self.ffn(a), new, capture


class MTPHead:
    """The nextn block: `(token x_{t+1}, post-norm hidden h_t) -> (draft logits, h')` (§10, §16.2)."""

    def __init__(self, ld: Loader, cfg: ModelConfig, freqs: mx.array, model: Model) -> None:
        L, E = cfg.n_layer, cfg.n_embd
        p = f"blk.{L}.nextn"
        self.eps, self.model = cfg.rms_eps, model
        self.embed = (
            ld.matrix(f"{p}.embed_tokens.weight", (cfg.n_vocab, E))
            if ld.has(f"{p}.embed_tokens.weight")
            else None
        )
        self.enorm = ld.dense(f"{p}.enorm.weight", (E,))
        self.hnorm = ld.dense(f"{p}.hnorm.weight", (E,))
        self.eh_proj = ld.matrix(f"{p}.eh_proj.weight", (E, 2 * E))
        self.norm = (
            ld.dense(f"{p}.shared_head_norm.weight", (E,))
            if ld.has(f"{p}.shared_head_norm.weight")
            else model.output_norm
        )
        self.norm32 = self.norm.astype(mx.float32)
        self.head = (
            ld.matrix(f"{p}.shared_head_head.weight", (cfg.n_vocab, E))
            if ld.has(f"{p}.shared_head_head.weight")
            else model.output
        )
        self.block = DecoderLayer(ld, L, cfg, freqs, linear=False)

    def __call__(
        self,
        tokens: mx.array,
        hidden: mx.array,
        layout: Layout,
        state: AttentionState,
        picked: mx.array | None = None,
    ) -> tuple[mx.array, mx.array, AttentionState]:
        """tokens `[N]`, hidden `[N, E]` packed like the trunk's rows, at the hidden's positions:
        (logits, h') of every position, or of the packed positions `picked` only (the K/V
        of every position either way)."""
        e = self.model.embed_tokens(tokens, self.embed)
        u = mx.concatenate(
            [rms_norm(e, self.enorm, self.eps), rms_norm(hidden, self.hnorm, self.eps)], axis=-1
        )
        u, f, new, _ = self.block(matmul(u, self.eh_proj), layout, state)
        assert isinstance(new, AttentionState)
        if picked is not None:
            u, f = u[picked], f[picked]
        _, h = add_rms_norm(u, f, self.norm, self.eps, self.norm32)
        return matmul(h, self.head), h, new


class Model:
    """The hybrid trunk + optional MTP head, loaded from a GGUF file."""

    def __init__(self, f: GGUFFile, dtype: mx.Dtype = mx.float32) -> None:
        cfg = self.config = f.config
        ld = Loader(f, dtype)
        self.dtype = dtype
        E, V = cfg.n_embd, cfg.n_vocab
        self.path = f.path
        freqs = rope_frequencies(cfg)
        self.tok_embd = ld.matrix("token_embd.weight", (V, E))
        self.output_norm = ld.dense("output_norm.weight", (E,))
        self.output_norm32 = self.output_norm.astype(mx.float32)
        self.output = (
            ld.matrix("output.weight", (V, E)) if ld.has("output.weight") else self.tok_embd
        )
        self.layers = [
            DecoderLayer(ld, i, cfg, freqs, cfg.recurrent[i]) for i in range(cfg.n_layer)
        ]
        self.mtp = MTPHead(ld, cfg, freqs, self) if cfg.n_mtp > 0 else None
        # Load eagerly: lazy weights would be evaluated by whichever thread runs the first
        # step, and MLX evaluates a graph only on the thread that built it.
        mx.eval(_arrays(self))
        weights.prepare(_arrays(self))
        # the residual stream's first value where layer 0's norm joins its product's kernel
        # (a prologue takes at most MMA_MAX_ROWS rows)
        self.zero_rows = mx.zeros((gemv_cuda.MMA_MAX_ROWS, E), dtype)
        mx.eval(self.zero_rows)

    def embed_tokens(self, tokens: mx.array, table: Weight | None = None) -> mx.array:
        w = self.tok_embd if table is None else table
        if isinstance(w, QuantizedWeight):
            return embed_cuda.lookup(w, tokens).astype(self.dtype)
        return w[tokens]

    def __call__(
        self,
        tokens: mx.array,
        layout: Layout,
        states: list[LayerState],
        taps: tuple[int, ...] = (),
    ) -> tuple[mx.array, list[LayerState], list[LinearCapture | None], mx.array | None]:
        """Trunk forward over packed `tokens [N]`.

        Returns the post-`output_norm` hidden states `[N, E]` (what the LM head and
        the MTP head read), per layer the new state of the batch's rows and the capture
        of its capture rows (linear layers only), and — when `taps` names trunk layers —
        their outputs (the residual stream after each, pre-norm) side by side
        `[N, len(taps) * E]`, what a DFlash drafter is conditioned on (else None).
        """
        x, pending = self.embed_tokens(tokens), None  # the residual stream is x + pending
        if takes_add_norm(x, self.layers[0].mixer.in_proj):
            # layer 0's norm inside its first product's kernel too, as every later add +
            # norm: the stream enters as zeros + the embedding (h = 0 + e, exactly) — one
            # launch where the norm alone was one more (~12 us of host time on the H200)
            x, pending = self.zero_rows[: x.shape[0]], x
        new_states: list[LayerState] = []
        captures: list[LinearCapture | None] = []
        tapped: dict[int, mx.array] = {}
        for i, (layer, state) in enumerate(zip(self.layers, states, strict=True)):
            x, pending, new, capture = layer(x, layout, state, pending)
            new_states.append(new)
            captures.append(capture)
            if i in taps:
                tapped[i] = x + pending
        _, hidden = add_rms_norm(
            x, pending, self.output_norm, self.config.rms_eps, self.output_norm32
        )
        out = mx.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
        return hidden, new_states, captures, out

    def logits(self, hidden: mx.array) -> mx.array:
        return matmul(hidden, self.output)


def _arrays(obj: object, seen: set[int] | None = None) -> list[mx.array]:
    """Every array reachable from a layer object (weights of every kind)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, mx.array):
        return [obj]
    if isinstance(obj, QuantizedWeight):
        return [obj.weight, obj.scales, obj.biases]
    if isinstance(obj, list | tuple):
        return [a for x in obj for a in _arrays(x, seen)]
    if hasattr(obj, "__dict__"):
        return [a for x in vars(obj).values() for a in _arrays(x, seen)]
    return []


def load_model(path: str | Path, dtype: mx.Dtype = mx.float32, dense: bool = False) -> Model:
    """The model in the GGUF file at `path`; `dense`: quantized matrices dequantized at load
    (the daemon's `weights = "dense"`)."""
    return Model(GGUFFile(path, quantized=not dense), dtype)
