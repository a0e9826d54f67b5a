"""The engine's own `SLOTSERVE_*` environment switches, checked together before a daemon serves.

Each switch is read where it acts — a kernel module, the runner — and some only when their
kernel first launches on a GPU: a value none of them takes would then fail every step that
reaches it, long after the daemon said it was serving. `problems(env)` checks every switch's
value at once, for `slotserve serve` to refuse to start with each bad one named; `unknown`
lists the `SLOTSERVE_*` names that nothing reads (a misspelt switch is otherwise ignored).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from engine import runner
from engine.kernels import (
    argmax_cuda,
    attention_cuda,
    cuda,
    gdn_mixer_cuda,
    gemv_cuda,
    host_pool,
    topk_cuda,
)

PREFIX = "SLOTSERVE_"


def _one_of(name: str, values: tuple[str, ...]) -> Callable[[str], None]:
    def check(value: str) -> None:
        if value not in values:
            raise ValueError(f"{name}={value!r}: one of {', '.join(values)}")

    return check


# name -> a check of its value that raises ValueError with the reader's own message
CHECKS: dict[str, Callable[[str], object]] = {
    **{f"SLOTSERVE_FUSED_{n}": _one_of(f"SLOTSERVE_FUSED_{n}", cuda.ON_OFF) for n in cuda.FUSED},
    **{name: _one_of(name, values) for name, values in gemv_cuda.SWITCHES.items()},
    gemv_cuda.PROLOGUE_QUANTIZED_ENV: gemv_cuda.prologue_quantized,
    gdn_mixer_cuda.WARPS_ENV: gdn_mixer_cuda.fixed_warps,
    attention_cuda.DECODE_ENV: _one_of(attention_cuda.DECODE_ENV, cuda.ON_OFF),
    attention_cuda.SPLIT_ENV: _one_of(attention_cuda.SPLIT_ENV, attention_cuda.SPLIT_CHUNKS),
    argmax_cuda.ENV: _one_of(argmax_cuda.ENV, cuda.ON_OFF),
    host_pool.ENV: _one_of(host_pool.ENV, cuda.ON_OFF),
    topk_cuda.ENV: _one_of(topk_cuda.ENV, cuda.ON_OFF),
    runner.SSM_WRITE_ENV: runner.parse_ssm_write,
    runner.STEP_INPUTS_ENV: runner.parse_step_inputs,
}


def problems(env: Mapping[str, str]) -> list[str]:
    """What is wrong with the engine switches `env` sets, one line each (empty: nothing)."""
    found = []
    for name in sorted(set(CHECKS) & set(env)):
        try:
            CHECKS[name](env[name])
        except ValueError as e:
            found.append(str(e))
    return found


def unknown(env: Mapping[str, str], others: Iterable[str] = ()) -> list[str]:
    """The `SLOTSERVE_*` names in `env` that are neither engine switches nor `others` (the
    caller's own: the daemon's settings, its test hooks)."""
    known = set(CHECKS) | set(others)
    return sorted(name for name in env if name.startswith(PREFIX) and name not in known)
