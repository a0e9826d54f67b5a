"""Decode step time under different MLX CUDA runtime settings, one process each.

MLX's CUDA backend records the kernels of an evaluation into CUDA graphs of at
most `MLX_MAX_OPS_PER_BUFFER` nodes (default 20) and keeps
`MLX_CUDA_GRAPH_CACHE_SIZE` instantiated graphs (default 100). Both are read
once per process, so each setting runs `bench/step_roofline.py` in a fresh
process on the same model file; `SLOTSERVE_FUSED_GDN` switches our fused
Gated DeltaNet kernel. A setting's `ARGS` entry is not an environment variable but
arguments for step_roofline.py (`--setting overlap:ARGS=--overlap`). Prints one table
row per (setting, N).

Usage (GPU machine):
    python bench/mlx_env_sweep.py --preset qwen3.5-0.8b --quant f16 --n 1,8,32,64 \
        --setting default: --setting ops100:MLX_MAX_OPS_PER_BUFFER=100 ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_setting(text: str) -> tuple[str, dict[str, str]]:
    """`name:VAR=value,VAR=value` -> (name, env). A comma not followed by `VAR=` belongs to
    the value (`q:SLOTSERVE_GEMV_PROLOGUE_QUANTIZED=swiglu,add_norm`)."""
    name, _, rest = text.partition(":")
    env: dict[str, str] = {}
    last = None
    for piece in rest.split(","):
        key, eq, value = piece.partition("=")
        if eq and key.isidentifier():
            env[key] = value
            last = key
        elif last is not None and piece:
            env[last] += "," + piece
        elif piece:
            raise argparse.ArgumentTypeError(f"setting {text!r}: {piece!r} is not VAR=value")
    return name, env


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--setting", action="append", type=parse_setting, required=True)
    p.add_argument("--preset", default="qwen3.5-0.8b")
    p.add_argument("--quant", default="f16")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--n", default="1,8,32,64")
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--model-dir", default="out/bench")
    p.add_argument("--json", help="write every setting's results here")
    args = p.parse_args()
    rows, record = [], {}
    for name, env in args.setting:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [
                sys.executable,
                str(ROOT / "bench" / "step_roofline.py"),
                f"--preset={args.preset}",
                f"--quant={args.quant}",
                f"--dtype={args.dtype}",
                f"--n={args.n}",
                f"--gen={args.gen}",
                f"--model-dir={args.model_dir}",
                f"--json={f.name}",
                *env.get("ARGS", "").split(),
            ]
            environ = os.environ | {k: v for k, v in env.items() if k != "ARGS"}
            # the engine importable whatever PYTHONPATH the caller set (say, only /tmp/site)
            environ["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(ROOT), environ.get("PYTHONPATH")])
            )
            done = subprocess.run(cmd, env=environ, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"{name}: failed ({done.returncode})\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            results = json.loads(Path(f.name).read_text())["results"]
        record[name] = {"env": env, "results": results}
        for r in results:
            rows.append((name, r["n"], r["tok_s"], r["step_ms"], r["host_ms"], r["roofline_frac"]))
            # each row as it comes, and the JSON so far: a run cut short keeps what it measured
            print(f"{name}: " + _row(*rows[-1]), file=sys.stderr, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(record, indent=1))
    print(f"\n{args.preset} {args.quant} compute={args.dtype}")
    print("| setting | N | tok/s | step ms | host ms | % roofline |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(_row(*row))


def _row(name: str, n: int, tok_s: float, step_ms: float, host_ms: float, frac: float) -> str:
    return f"| {name} | {n} | {tok_s:.0f} | {step_ms:.2f} | {host_ms:.2f} | {100 * frac:.0f}% |"


if __name__ == "__main__":
    main()
