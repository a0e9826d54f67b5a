"""The two recipes: `full` (the shipped demo model) and `smoke` (the CPU test), and the
`Schedule` every training run here shares (the DFlash drafter's included).

A recipe is the model's `engine.writer.ModelSpec` fields (as a plain dict, so the GPU side
needs no `gguf`) plus the training settings. Every run writes the recipe it used next to its
weights, and export rebuilds the ModelSpec from that copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

_QWEN35_SMALL: dict[str, Any] = {
    "arch": "qwen35",
    "rope_sections": (11, 11, 10, 0),
    "rope_base": 10_000_000.0,
    "full_attention_interval": 4,
    "conv_kernel": 4,
    "mtp": True,
    "tied_embeddings": False,
    "rms_eps": 1e-6,
    "seed": 0,
}

FULL_SPEC: dict[str, Any] = {
    **_QWEN35_SMALL,
    "name": "slotserve-demo",
    "n_layer": 8,  # 6 Gated DeltaNet + 2 attention layers, then the MTP block
    "n_embd": 384,
    "n_head": 6,
    "n_head_kv": 2,
    "head_dim": 64,
    "rope_dim": 32,
    "ssm_group_count": 3,  # Hk
    "ssm_time_step_rank": 6,  # Hv
    "ssm_state_size": 64,
    "n_ff": 1024,
    "vocab_size": 4096,
    "quant": "q8_0",
    "context_length": 8192,
}

SMOKE_SPEC: dict[str, Any] = {
    **_QWEN35_SMALL,
    "name": "slotserve-demo-smoke",
    "n_layer": 4,
    "n_embd": 64,
    "n_head": 2,
    "n_head_kv": 1,
    "head_dim": 32,
    "rope_dim": 16,
    "ssm_group_count": 1,
    "ssm_time_step_rank": 2,
    "ssm_state_size": 16,
    "n_ff": 128,
    "vocab_size": 512,
    "quant": "f32",
    "context_length": 4096,
}


@dataclass(frozen=True)
class Schedule:
    """How a run fits its weights, whatever they are (`train.fit`): random windows of
    `seq_len` tokens, `batch` per step, AdamW at `lr` with decoupled `weight_decay`.

    The learning rate warms up linearly over `warmup` steps, then follows a cosine to
    `min_lr_ratio * lr` over the run's progress, which is the larger of steps done / `steps`
    and seconds spent / the time limit, so a run cut short by its time limit still anneals.
    """

    seq_len: int = 512
    batch: int = 32
    steps: int = 3000
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    dtype: str = "bfloat16"  # matmul dtype; weights, norms and the recurrence stay float32
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Recipe(Schedule):
    """What `train` needs: the model (`spec`) and how to fit it."""

    spec: dict[str, Any] = field(default_factory=lambda: dict(FULL_SPEC))
    mtp_weight: float = 0.3  # the MTP loss's share of the objective


RECIPES = {
    "full": Recipe(),
    "smoke": Recipe(
        spec=dict(SMOKE_SPEC),
        seq_len=128,
        batch=4,
        steps=30,
        lr=3e-3,
        warmup=5,
        dtype="float32",
    ),
}
