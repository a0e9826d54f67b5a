"""What a GGUF model is and what one slot of it costs: the `slotserve inspect` report.

`describe(path)` renders a fixed-width text table: identity, every `ModelConfig`
hyper-parameter, the layer pattern, tensors grouped by ggml type, the parameter
count, and the per-slot state bytes that admission budgets against (KV cache per
token of the full-attention layers, Gated DeltaNet conv + recurrent state per slot;
MODEL_SPEC §11).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from engine.gguf import GGUFFile, ModelConfig

WIDTH = 24  # label column
KV_ELEMENT_BYTES = (("f16", 2), ("f32", 4))
LEGEND = "L = Gated DeltaNet, A = full attention, M = MTP block"


def describe(path: str | os.PathLike[str]) -> str:
    """The inspect report of the GGUF at `path`; raises `GGUFError` for an unusable file."""
    f = GGUFFile(path)
    cfg = f.config
    sections = [
        _section("model", [("file", str(f.path)), ("architecture", cfg.arch), ("name", cfg.name)]),
        _section("hyper-parameters", _hyper_parameters(cfg)),
        _section("layers", [("pattern", layer_pattern(cfg)), ("legend", LEGEND)]),
        _tensor_table(f),
        _state_table(cfg),
    ]
    return "\n\n".join(sections)


def layer_pattern(cfg: ModelConfig) -> str:
    """Trunk layers as `L` (Gated DeltaNet) / `A` (full attention), a space after each `A`,
    then `M` per MTP block: `LLLA LLLA M`."""
    groups, run = [], ""
    for recurrent in cfg.recurrent:
        run += "L" if recurrent else "A"
        if not recurrent:
            groups.append(run)
            run = ""
    if run:
        groups.append(run)
    groups += ["M"] * cfg.n_mtp
    return " ".join(groups)


def _hyper_parameters(cfg: ModelConfig) -> list[tuple[str, str]]:
    rows = [
        (field.name, _value(getattr(cfg, field.name)))
        for field in dataclasses.fields(cfg)
        if field.name not in ("arch", "name", "recurrent")
    ]
    rows += [
        ("n_linear_layers", _value(cfg.n_linear_layers)),
        ("n_attention_layers", _value(cfg.n_attention_layers)),
        ("conv_channels", _value(cfg.conv_channels)),
        ("is_moe", _value(cfg.is_moe)),
    ]
    return rows


def _tensor_table(f: GGUFFile) -> str:
    count: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    params = 0
    for name in f.tensor_names:
        kind = f.tensor_type(name).name
        count[kind] = count.get(kind, 0) + 1
        nbytes[kind] = nbytes.get(kind, 0) + f.tensor_bytes(name)
        params += int(np.prod(f.tensor_shape(name), dtype=np.int64))
    lines = [f"{'tensors':<{WIDTH}}{'count':>8}{'bytes':>16}"]
    for kind in sorted(count, key=lambda k: -nbytes[k]):
        lines.append(
            f"  {kind:<{WIDTH - 2}}{count[kind]:>8,}{nbytes[kind]:>16,}  ({_human(nbytes[kind])})"
        )
    total = sum(nbytes.values())
    lines.append(
        f"  {'total':<{WIDTH - 2}}{sum(count.values()):>8,}{total:>16,}  ({_human(total)})"
    )
    lines.append(f"  {'parameters':<{WIDTH - 2}}{params:>24,}  ({_human(params, binary=False)})")
    return "\n".join(lines)


def _state_table(cfg: ModelConfig) -> str:
    header = "".join(f"{f'{kind} KV':>16}" for kind, _ in KV_ELEMENT_BYTES)
    lines = [f"{'per-slot state (bytes)':<{WIDTH}}{header}"]
    for label, mtp in (("KV / token", False), ("KV / token with MTP", True)):
        cells = "".join(
            f"{cfg.kv_bytes_per_token(size, include_mtp=mtp):>16,}" for _, size in KV_ELEMENT_BYTES
        )
        lines.append(f"  {label:<{WIDTH - 2}}{cells}")
    linear = cfg.linear_state_bytes()
    lines.append(f"  {'GDN state / slot':<{WIDTH - 2}}{linear:>16,}  (f32, {_human(linear)})")
    full = "".join(
        f"{cfg.kv_bytes_per_token(size) * cfg.context_length + linear:>16,}"
        for _, size in KV_ELEMENT_BYTES
    )
    at = f"at {cfg.context_length:,} tokens"
    lines.append(f"  {'one slot, full context':<{WIDTH - 2}}{full}  ({at}, with MTP)")
    return "\n".join(lines)


def _section(title: str, rows: Iterable[tuple[str, str]]) -> str:
    return "\n".join([title, *(f"  {k:<{WIDTH - 2}}{v}" for k, v in rows)])


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]" if v else "-"
    return str(v)


def _human(n: int, binary: bool = True) -> str:
    """`n` bytes as `1.3 MiB`, or a count as `1.34 M`."""
    base, units = (1024.0, _BYTE_UNITS) if binary else (1000.0, _COUNT_UNITS)
    x, i = float(n), 0
    while abs(x) >= base and i < len(units) - 1:
        x, i = x / base, i + 1
    text = f"{x:.0f}" if i == 0 else f"{x:.{1 if binary else 2}f}"
    return f"{text} {units[i]}".rstrip()


_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
_COUNT_UNITS = ("", "K", "M", "B", "T")
