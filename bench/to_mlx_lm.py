"""Convert a dense qwen35 GGUF (ours or llama.cpp's) into the directory mlx-lm's `qwen3_5` loads.

The benchmark's mlx-lm peer must run on the same weights as our engine, so this undoes what
llama.cpp's converter did to the Hugging Face checkpoint (shared/MODEL_SPEC.md §4):

* value heads back from the GGUF's tiled order to HF's grouped order (§4.6): the v rows of
  `attn_qkv`, the rows of `attn_gate`, `ssm_beta`, `ssm_alpha`, `ssm_dt.bias`, `ssm_a`, the
  v channels of `ssm_conv1d` and the input columns of `ssm_out`;
* `A_log = log(-ssm_a)`; conv taps `(C, K)` -> MLX's `(C, K, 1)`.

RMSNorm weights keep the GGUF's `1 + w`: mlx-lm's `sanitize` adds the 1 only to checkpoints
whose conv weights are still in HF's layout, which ours are not. Q8_0 / Q4_0 / Q4_1 matrices
stay quantized, repacked exactly into MLX's affine layout (group 32) by `engine.gguf`, as our
engine loads them; a quantized matrix whose head blocks are narrower than a group (tiny test
models) is dequantized instead, exactly. The MTP block is dropped (mlx-lm has none).

    python bench/to_mlx_lm.py model.gguf out_dir [--dtype bfloat16]

Writes `out_dir/config.json` and `out_dir/model.safetensors`; `mlx_lm.utils.load_model(out_dir)`
loads it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

if __package__ in (None, ""):  # `python bench/to_mlx_lm.py`: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.gguf import GGUFFile, ModelConfig, QuantizedWeight

GROUP_SIZE = 32
PREFIX = "language_model.model"


def mlx_lm_config(cfg: ModelConfig) -> dict[str, Any]:
    """mlx-lm's config.json for `cfg` (model_type qwen3_5, its text_config)."""
    if cfg.is_moe or cfg.arch != "qwen35":
        raise ValueError(f"{cfg.name}: only dense qwen35 files convert (this one is {cfg.arch})")
    attn = [i for i, r in enumerate(cfg.recurrent) if not r]
    interval = attn[0] + 1 if attn else cfg.n_layer + 1
    if cfg.recurrent != tuple((i + 1) % interval != 0 for i in range(cfg.n_layer)):
        raise ValueError(f"{cfg.name}: layer pattern is not every {interval}th full attention")
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.n_ff,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_head_kv,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_eps,
        "vocab_size": cfg.n_vocab,
        "max_position_embeddings": cfg.context_length,
        "linear_num_value_heads": cfg.ssm_hv,
        "linear_num_key_heads": cfg.ssm_hk,
        "linear_key_head_dim": cfg.ssm_dk,
        "linear_value_head_dim": cfg.ssm_dv,
        "linear_conv_kernel_dim": cfg.conv_kernel,
        "full_attention_interval": interval,
        "tie_word_embeddings": False,  # set by `convert` from the file
        "rope_parameters": {
            "type": "default",
            "rope_theta": cfg.rope_base,
            "partial_rotary_factor": cfg.rope_dim / cfg.head_dim,
        },
    }
    return {"model_type": "qwen3_5", "text_config": text}


def head_order(cfg: ModelConfig) -> np.ndarray | None:
    """For each grouped (HF) value head, the tiled (GGUF) head it comes from; None if equal."""
    if not cfg.v_heads_tiled or cfg.ssm_hk == cfg.ssm_hv:
        return None
    r, hk = cfg.ssm_hv // cfg.ssm_hk, cfg.ssm_hk
    # grouped j = k * r + p  <-  tiled p * hk + k
    return np.arange(cfg.ssm_hv).reshape(r, hk).T.reshape(-1)


def channel_order(heads: np.ndarray, width: int, offset: int = 0, total: int = 0) -> np.ndarray:
    """Index over `total` channels (default: the heads' own) that reorders the `width`-wide head
    blocks starting at `offset` by `heads` and keeps every other channel in place."""
    block = (heads[:, None] * width + np.arange(width)[None, :]).reshape(-1) + offset
    total = total or offset + block.size
    return np.concatenate([np.arange(offset), block, np.arange(offset + block.size, total)])


class Converter:
    def __init__(self, path: Path, dtype: mx.Dtype) -> None:
        self.f = GGUFFile(path)
        self.cfg = self.f.config
        self.dtype = dtype
        self.weights: dict[str, mx.array] = {}
        self.quantized: set[str] = set()

    def matrix(
        self,
        name: str,
        key: str,
        rows: np.ndarray | None = None,
        cols: np.ndarray | None = None,
        col_block: int = 0,
    ) -> None:
        """GGUF matrix `name` -> `key`.weight (+ .scales/.biases when quantized), its rows and
        its input columns permuted by `rows` / `cols` (`cols` moves blocks of `col_block`)."""
        w = self.f.load(name, dtype=self.dtype)
        if isinstance(w, QuantizedWeight) and cols is not None and col_block % w.group_size:
            w = w.dequantize().astype(self.dtype)  # head blocks split groups: exact, unpacked
        if isinstance(w, QuantizedWeight):
            parts = {"weight": w.weight, "scales": w.scales, "biases": w.biases}
            per = {"weight": 32 // w.bits, "scales": w.group_size, "biases": w.group_size}
            for part, a in parts.items():
                if rows is not None:
                    a = a[mx.array(rows)]
                if cols is not None:
                    a = _take_column_blocks(a, cols, col_block, col_block // per[part])
                self.weights[f"{key}.{part}"] = a
            self.quantized.add(key)
            return
        if rows is not None:
            w = w[mx.array(rows)]
        if cols is not None:
            w = _take_column_blocks(w, cols, col_block, col_block)
        self.weights[f"{key}.weight"] = w

    def vector(self, name: str, key: str, order: np.ndarray | None = None) -> mx.array:
        v = mx.array(self.f.load_numpy(name))
        if order is not None:
            v = v[mx.array(order)]
        self.weights[key] = v.astype(self.dtype)
        return v

    def convert(self) -> dict[str, Any]:
        cfg = self.cfg
        config = mlx_lm_config(cfg)
        tied = not self.f.has("output.weight")
        config["text_config"]["tie_word_embeddings"] = tied
        self.matrix("token_embd.weight", f"{PREFIX}.embed_tokens")
        if not tied:
            self.matrix("output.weight", "language_model.lm_head")
        self.vector("output_norm.weight", f"{PREFIX}.norm.weight")
        heads = head_order(cfg)
        for i in range(cfg.n_layer):
            self.layer(i, heads)
        if self.quantized:
            config["quantization"] = {"group_size": GROUP_SIZE, "bits": 8}
        return config

    def layer(self, i: int, heads: np.ndarray | None) -> None:
        cfg, g, p = self.cfg, f"blk.{i}", f"{PREFIX}.layers.{i}"
        self.vector(f"{g}.attn_norm.weight", f"{p}.input_layernorm.weight")
        self.vector(f"{g}.post_attention_norm.weight", f"{p}.post_attention_layernorm.weight")
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            self.matrix(f"{g}.ffn_{ours}.weight", f"{p}.mlp.{theirs}")
        if not cfg.recurrent[i]:
            a = f"{p}.self_attn"
            for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
                self.matrix(f"{g}.attn_{ours}.weight", f"{a}.{theirs}")
            self.matrix(f"{g}.attn_output.weight", f"{a}.o_proj")
            self.vector(f"{g}.attn_q_norm.weight", f"{a}.q_norm.weight")
            self.vector(f"{g}.attn_k_norm.weight", f"{a}.k_norm.weight")
            return
        la, dv, cq = f"{p}.linear_attn", cfg.ssm_dv, cfg.ssm_hk * cfg.ssm_dk
        v_rows = None if heads is None else channel_order(heads, dv, offset=2 * cq)
        z_rows = None if heads is None else channel_order(heads, dv)
        self.matrix(f"{g}.attn_qkv.weight", f"{la}.in_proj_qkv", rows=v_rows)
        self.matrix(f"{g}.attn_gate.weight", f"{la}.in_proj_z", rows=z_rows)
        self.matrix(f"{g}.ssm_beta.weight", f"{la}.in_proj_b", rows=heads)
        self.matrix(f"{g}.ssm_alpha.weight", f"{la}.in_proj_a", rows=heads)
        self.matrix(f"{g}.ssm_out.weight", f"{la}.out_proj", cols=heads, col_block=dv)
        conv = mx.array(self.f.load_numpy(f"{g}.ssm_conv1d.weight"))  # (C, K)
        if v_rows is not None:
            conv = conv[mx.array(v_rows)]
        self.weights[f"{la}.conv1d.weight"] = conv[:, :, None].astype(self.dtype)
        self.vector(f"{g}.ssm_dt.bias", f"{la}.dt_bias", heads)
        ssm_a = mx.array(self.f.load_numpy(f"{g}.ssm_a"))
        if heads is not None:
            ssm_a = ssm_a[mx.array(heads)]
        self.weights[f"{la}.A_log"] = mx.log(-ssm_a)  # float32, as mlx-lm keeps it
        self.vector(f"{g}.ssm_norm.weight", f"{la}.norm.weight")


def _take_column_blocks(a: mx.array, order: np.ndarray, block: int, width: int) -> mx.array:
    """Columns of `a` regrouped: logical block j (of `block` input channels, `width` stored
    columns) of the result is block `order[j]` of `a`."""
    rows = a.shape[0]
    blocks = a.reshape(rows, -1, width)
    assert blocks.shape[1] == order.size, (a.shape, block, width, order.size)
    return blocks[:, mx.array(order)].reshape(rows, -1)


def convert(gguf: str | Path, out_dir: str | Path, dtype: mx.Dtype = mx.float32) -> Path:
    """Write mlx-lm's `config.json` + `model.safetensors` for `gguf` into `out_dir`."""
    out = Path(out_dir)
    conv = Converter(Path(gguf), dtype)
    config = conv.convert()
    out.mkdir(parents=True, exist_ok=True)
    mx.eval(list(conv.weights.values()))
    mx.save_safetensors(str(out / "model.safetensors"), conv.weights, {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("gguf")
    p.add_argument("out_dir")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args()
    print(convert(args.gguf, args.out_dir, getattr(mx, args.dtype)))


if __name__ == "__main__":
    main()
