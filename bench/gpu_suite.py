"""Scenario (b) of issue 9 on the GPU machine, in one call: aggregate decode, ours vs mlx-lm
(and llama.cpp's `llama-batched-bench` when a binary is given), on the same weights.

* the 0.8B-shaped model (`qwen3.5-0.8b-f16.gguf`), bf16 compute, at N = 1, 8, 32, 64;
* the 9B-shaped model in q8_0 (`qwen3.5-9b-q8_0.gguf`), bf16 scales, at N = 1, with its
  weight-streaming roofline.

Each model runs `bench/batched_decode.py` (its worker processes, alternating contenders):
ours = `ModelRunner(compile=True)`, bf16, bf16 KV; mlx-lm = its qwen3_5 model with the batch
caches of its BatchGenerator, on the GGUF converted by bench/to_mlx_lm.py (cached beside the
GGUF as `<stem>.mlx-lm-bfloat16/`). Greedy argmax on the device for both. Then, if
`--llama-batched-bench` names a binary: `-npp PROMPT -ntg STEPS -npl NS -ngl 99 -fa on` on the
same GGUF files.

Self-contained for a machine without a package index: if mlx-lm cannot be imported, the wheels
in `--wheels` (default out/gpu_wheels/, carried with the tree) are unpacked into `--site`
(default /tmp/site) and put on the path; mlx-lm's own dependencies (transformers, numpy,
jinja2) are the image's.

    python bench/gpu_suite.py --model-dir out/bench [--llama-batched-bench PATH]   # H200
    python bench/gpu_suite.py --small F.gguf --big G.gguf --dtype float32 --ns 1,2 --steps 4
                                                                                    # CPU check

Writes $OUT (or out/bench/gpu_suite/): batched_decode_<model>.json, llama_batched_<model>.txt,
gpu_suite.json and gpu_suite.md (the tables, with each target marked met / not met).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def ensure_mlx_lm(wheels: Path, site: Path) -> str:
    """Import mlx-lm, installing the carried wheels first if needed; its version."""
    try:
        import mlx_lm
    except ImportError:
        found = sorted(wheels.glob("*.whl"))
        if not found:
            raise SystemExit(f"mlx-lm is not installed and {wheels} has no wheels") from None
        for whl in found:  # pure-Python wheels: unpacking one is installing it (no pip needed)
            with zipfile.ZipFile(whl) as z:
                z.extractall(site)
        sys.path.insert(0, str(site))
        # spawned workers start from the environment
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(site), os.environ.get("PYTHONPATH")])
        )
        importlib.invalidate_caches()
        import mlx_lm
    from mlx_lm.generate import BatchGenerator  # noqa: F401  (fails early if transformers is off)

    return str(mlx_lm.__version__)


def run_ours_vs_mlx_lm(
    model: Path,
    ns: list[int],
    args: argparse.Namespace,
    out: Path,
    alone: bool = False,
    peers: bool = True,
) -> dict[str, Any]:
    """Ours beside mlx-lm (a worker process each, alternating); `alone`: ours' worker only,
    without decode-ahead; `peers=False`: ours (and ours-ahead) without mlx-lm."""
    import batched_decode

    suffix = "_alone" if alone else "" if peers else "_ours"
    argv = [
        "--model", str(model),
        "--ns", ",".join(map(str, ns)),
        "--prompt", str(args.prompt),
        "--steps", str(args.steps),
        "--reps", str(args.reps),
        "--warmup", "2",
        "--peers", "mlx-lm" if peers and not alone else ",",
        "--blas", "bundled",
        "--dtype", args.dtype,
        "--kv-dtype", args.dtype,
        "--retries", "0",
        "--out", str(out / f"batched_decode_{model.stem}{suffix}.json"),
    ]  # fmt: skip
    if args.compile:
        argv.append("--compile")
    if args.ahead and not alone:
        argv.append("--ahead")
    return batched_decode.main(argv)


def run_llama(
    binary: Path, model: Path, ns: list[int], args: argparse.Namespace, out: Path
) -> dict[int, float]:
    """llama-batched-bench's S_TG (aggregate decode tok/s) per N; its output kept as text."""
    ctx = (args.prompt + args.steps) * max(ns) + 256
    cmd = [
        str(binary), "-m", str(model), "-c", str(ctx), "-b", "2048", "-ub", "512",
        "-npp", str(args.prompt), "-ntg", str(args.steps), "-npl", ",".join(map(str, ns)),
        "-ngl", "99", "-fa", "on",
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.llama_timeout)
    (out / f"llama_batched_{model.stem}.txt").write_text(
        " ".join(cmd) + f"\nexit {res.returncode}\n" + res.stdout + res.stderr
    )
    return parse_batched_bench(res.stdout)


def parse_batched_bench(text: str) -> dict[int, float]:
    """{B: S_TG} from llama-batched-bench's markdown table."""
    rows: dict[int, float] = {}
    header: list[str] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "S_TG t/s" in cells:
            header = cells
        elif header and len(cells) == len(header) and re.fullmatch(r"\d+", cells[0]):
            rows[int(cells[header.index("B")])] = float(cells[header.index("S_TG t/s")])
    return rows


def roofline_tok_s(model: Path, bandwidth_tbs: float) -> float:
    """N = 1 weight-streaming roofline: every trunk weight byte of the file once per token."""
    from step_roofline import weight_bytes

    from engine.gguf import GGUFFile

    return bandwidth_tbs * 1e12 / weight_bytes(GGUFFile(model))


def summarize(results: dict[str, Any], ns_small: list[int]) -> str:
    """The tables of gpu_suite.md: tok/s per engine and N, ratios, targets."""
    lines = ["| engine, model | " + " | ".join(f"N={n}" for n in ns_small) + " |"]
    lines.append("|---|" + "---|" * len(ns_small))
    targets: list[str] = []
    for key, r in results["models"].items():
        tok = {int(s["n"]): s["tok_s"] for s in r["batched"]["summary"]}
        llama = r.get("llama", {})
        ours = [s for s in ("ours", "ours-ahead") if all(s in t for t in tok.values())]
        peer = ["mlx-lm"] if all("mlx-lm" in t for t in tok.values()) else []
        for side in (*ours, *peer):
            cells = [f"{tok[n][side]:.0f}" if n in tok else "—" for n in ns_small]
            lines.append(f"| {side}, {key} | " + " | ".join(cells) + " |")
        if "alone" in r:
            solo = {int(s["n"]): s["tok_s"]["ours"] for s in r["alone"]["summary"]}
            cells = [f"{solo[n]:.0f}" if n in solo else "—" for n in ns_small]
            lines.append(f"| ours alone (no mlx-lm worker), {key} | " + " | ".join(cells) + " |")
        if "mlx_lm_failed" in r:
            cells = ["failed"] * len(ns_small)
            lines.append(f"| mlx-lm, {key} ({r['mlx_lm_failed']}) | " + " | ".join(cells) + " |")
        if llama:
            cells = [f"{llama[n]:.0f}" if n in llama else "—" for n in ns_small]
            lines.append(f"| llama.cpp, {key} | " + " | ".join(cells) + " |")
        for side in ours:
            for n, t in sorted(tok.items()):
                if peer:
                    ratio = t[side] / t["mlx-lm"]
                    targets.append(
                        f"| {key} N={n}: {side} / mlx-lm >= 3 | {ratio:.2f} | {_met(ratio >= 3)} |"
                    )
                if n in llama:
                    want = 1.0 if n == 1 else 1.3
                    ratio = t[side] / llama[n]
                    targets.append(
                        f"| {key} N={n}: {side} / llama.cpp >= {want} | {ratio:.2f} "
                        f"| {_met(ratio >= want)} |"
                    )
            if 1 in tok and 8 in tok:
                s = tok[8][side] / tok[1][side]
                targets.append(
                    f"| {key}: {side} agg(N=8) / agg(N=1) >= 6 | {s:.2f} | {_met(s >= 6)} |"
                )
            if "roofline_tok_s" in r and 1 in tok:
                f = tok[1][side] / r["roofline_tok_s"]
                targets.append(
                    f"| {key} N=1: {side} >= 50% of roofline ({r['roofline_tok_s']:.0f} tok/s) "
                    f"| {f:.0%} | {_met(f >= 0.5)} |"
                )
    return "\n".join([*lines, "", "| target | measured | |", "|---|---|---|", *targets])


def _last_line(text: str) -> str:
    """A failure's last line (its exception), for the tables."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no message"


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def main() -> None:
    args = parse_args()
    t0 = time.monotonic()
    out = Path(os.environ.get("OUT") or ROOT / "out" / "bench" / "gpu_suite")
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "bench"))
    version = ensure_mlx_lm(args.wheels, args.site)
    import harness

    results: dict[str, Any] = {"machine": harness.machine(), "mlx_lm": version, "args": {k: str(v) for k, v in vars(args).items()}, "models": {}}  # fmt: skip
    results["machine"]["gpu"] = _gpu_name()
    plan = [("small", args.small, args.ns), ("big", args.big, [1])]
    for label, model, ns in plan:
        left = args.budget_s - (time.monotonic() - t0)
        if not model.exists():
            print(f"[gpu_suite] {model} missing: skipped", flush=True)
            continue
        if label == "big" and left < args.big_needs_s:
            print(f"[gpu_suite] {left:.0f} s left of the budget: {model.name} skipped", flush=True)
            results["models"][model.stem] = {"skipped": f"{left:.0f} s left"}
            continue
        print(f"[gpu_suite] {model.name} at N={ns} ({left:.0f} s of budget left)", flush=True)
        r: dict[str, Any] = {}
        try:
            r["batched"] = run_ours_vs_mlx_lm(model, ns, args, out)
        except RuntimeError as e:  # a peer's failure (8 x 4,096 tokens ran mlx-lm out of memory)
            r["mlx_lm_failed"] = _last_line(str(e))
            print(f"[gpu_suite] mlx-lm failed ({r['mlx_lm_failed']}): ours alone", flush=True)
            r["batched"] = run_ours_vs_mlx_lm(model, ns, args, out, peers=False)
        if args.alone:
            r["alone"] = run_ours_vs_mlx_lm(model, ns, args, out, alone=True)
        if label == "big":
            r["roofline_tok_s"] = roofline_tok_s(model, args.bandwidth_tbs)
        if args.llama_batched_bench:
            r["llama"] = run_llama(args.llama_batched_bench, model, ns, args, out)
        results["models"][model.stem] = r
        (out / "gpu_suite.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    done = {k: v for k, v in results["models"].items() if "batched" in v}
    md = summarize({"models": done}, args.ns)
    header = (
        f"gpu_suite {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {results['machine']['gpu']}, "
        f"mlx {results['machine']['mlx']}, mlx-lm {version}, commit {results['machine']['commit']}; "
        f"{args.prompt}-token prompts, {args.steps} decode steps, best of {args.reps}; "
        f"{time.monotonic() - t0:.0f} s\n\n"
    )
    (out / "gpu_suite.md").write_text(header + md + "\n")
    (out / "gpu_suite.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print("\n" + header + md)


def _gpu_name() -> str:
    try:
        q = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
        return subprocess.run(q, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "no nvidia-smi"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=ROOT / "out" / "bench")
    p.add_argument("--small", type=Path, help="default: MODEL_DIR/qwen3.5-0.8b-f16.gguf")
    p.add_argument("--big", type=Path, help="default: MODEL_DIR/qwen3.5-9b-q8_0.gguf")
    p.add_argument("--ns", default=[1, 8, 32, 64], type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per sample")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--alone",
        action="store_true",
        help="also time ours with no mlx-lm worker alive (the suite's figure for ours has been "
        "below step_roofline's on the GPU)",
    )
    p.add_argument(
        "--ahead",
        action="store_true",
        help="also time ours as ours-ahead (each step queued on the last one's argmax on the "
        "device before the host reads it: the scheduler's decode_ahead)",
    )
    p.add_argument("--llama-batched-bench", type=Path, help="llama.cpp's binary, built for CUDA")
    p.add_argument("--llama-timeout", type=float, default=120)
    p.add_argument("--wheels", type=Path, default=ROOT / "out" / "gpu_wheels")
    p.add_argument("--site", type=Path, default=Path("/tmp/site"), help="where wheels go")
    p.add_argument("--bandwidth-tbs", type=float, default=4.3)
    p.add_argument("--budget-s", type=float, default=500, help="skip the 9B part past this")
    p.add_argument("--big-needs-s", type=float, default=200, help="what the 9B part needs")
    args = p.parse_args()
    args.small = args.small or args.model_dir / "qwen3.5-0.8b-f16.gguf"
    args.big = args.big or args.model_dir / "qwen3.5-9b-q8_0.gguf"
    return args


if __name__ == "__main__":
    main()
