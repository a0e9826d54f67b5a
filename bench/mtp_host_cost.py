"""Host milliseconds of the MTP head's catch-up (`ModelRunner.draft`), piece by piece.

On a GPU a speculative MTP round is host-bound on a small model: the catch-up and the draft
chain are built on the host while the device waits. This runs `spec_phases.py`'s MTP
configuration and times, per catch-up call, its host work alone — the call's queued
evaluation is held back (the chain that follows evaluates it), so the device's time is not
in it — and inside it the compiled head forward's call; and the pool's MTP read and write
(over the catch-up's calls and the chain's). Medians over the run.

    .venv/bin/python bench/mtp_host_cost.py --model models/slotserve-demo.gguf --n 1,8
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import mlx.core as mx
import numpy as np
import spec_phases

from engine.cache import SlotPool
from engine.runner import ModelRunner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--n", default="1,8")
    p.add_argument("--gen", type=int, default=48)
    args = p.parse_args()
    spent: dict[str, list[float]] = {}

    def timed(label: str, f: Callable[..., Any]) -> Callable[..., Any]:
        return harness.timing(f, lambda s: spent.setdefault(label, []).append(s))

    draft, draft_fn = timed("catch-up, host", ModelRunner.draft), ModelRunner._draft_fn
    queue = mx.async_eval

    def host_only(self: ModelRunner, *a: Any, **k: Any) -> Any:
        mx.async_eval = lambda *arrays: None  # the chain's evaluation runs it instead
        try:
            return draft(self, *a, **k)
        finally:
            mx.async_eval = queue

    ModelRunner.draft = host_only  # type: ignore[method-assign]
    ModelRunner._draft_fn = lambda self, *a, **k: timed(  # type: ignore[method-assign]
        "  compiled head call", draft_fn(self, *a, **k)
    )
    SlotPool.read_mtp = timed("  pool read", SlotPool.read_mtp)  # type: ignore[method-assign]
    SlotPool.write_mtp = timed("  pool write", SlotPool.write_mtp)  # type: ignore[method-assign]
    for n in args.n.split(","):
        spent.clear()
        sys.argv = [sys.argv[0], "--model", str(args.model), "--n", n, "--gen", str(args.gen)]
        sys.argv += ["--configs", "mtp:on", "--uniform", "--compile", "--precompile"]
        sys.argv += ["--warmup", "1"]
        spec_phases.main()
        print(f"\n| N = {n} | calls | median ms |\n|---|---|---|")
        for name, v in spent.items():
            print(f"| {name} | {len(v)} | {1e3 * float(np.median(v)):.3f} |")


if __name__ == "__main__":
    main()
