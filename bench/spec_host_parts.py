"""The speculator's host work per decode step, by part: offers, the cost controller's choice,
the drafters' calls, the rest of planning; sampling and the drafters' commits inside the
resolve — per drafter in "auto" (or "off" with no drafter: `plain`), at N rows, through the
offline loop `spec_decode.py` measures, uniform shapes, one untimed run first. The timings
wrap `Speculator.plan` / `_offer` / `_plain` / `_commit` / `resolve_step`,
`CostController.choose` and each drafter's `draft`: BENCHMARK ONLY. What the speculator adds
to a step in "auto" (the daemon's default) where nothing drafts shows against `plain`. Run
from another tree (`cd OTHER && python /path/to/bench/spec_host_parts.py ...`) to compare
versions: it imports the engine of the tree it is run from.

    .venv/bin/python bench/spec_host_parts.py --model models/slotserve-demo.gguf --n 64 \\
        --drafters plain,mtp,ngram
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __name__ == "__main__":  # the tree run from, ahead of an installed one
    sys.path.insert(0, str(Path.cwd()))
    sys.path.insert(0, str(Path.cwd() / "bench"))

import harness
from spec_decode import speculator, synthetic_prompts

from engine.models.qwen35 import load_model
from engine.spec.offline import Request, generate

PARTS = ("plan", "offers", "choose", "draft", "resolve", "sample", "commits")


def parts(model: object, prompts: list[list[int]], drafter: str, args: argparse.Namespace) -> dict:
    """ms a step by part for one drafter (`plain`: none, speculation off)."""
    ns = argparse.Namespace(k=args.k, gen=args.gen, compile=False, uniform=True, precompile=False)
    spec = speculator(model, "" if drafter == "plain" else drafter, prompts, ns, None)
    spec.use_uniform_shapes(True)
    mode = "off" if drafter == "plain" else "auto"
    requests = [Request(p, args.gen, speculation=mode) for p in prompts]
    generate(spec, requests)  # untimed: kernels, the controller's first steps
    spent: dict[str, float] = {}
    for owner, name, label in [
        (spec, "plan", "plan"),
        (spec, "resolve_step", "resolve"),
        (spec, "_offer", "offers"),
        (spec.controller, "choose", "choose"),
        (spec, "_commit", "commits"),
        (spec, "_plain", "sample"),
        *[(d, "draft", "draft") for d in spec.drafters],
    ]:
        harness.time_calls(owner, name, spent, label)
    run = generate(spec, requests)
    steps = max(run.steps, 1)
    return {"drafter": drafter, "steps": run.steps} | {
        k: 1000 * spent.get(k, 0.0) / steps for k in PARTS
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--gen", type=int, default=16)
    p.add_argument("--drafters", default="plain,mtp,ngram")
    args = p.parse_args()
    model = load_model(args.model)
    prompts = synthetic_prompts(model, args.n)
    print(f"{args.model.name}, N = {args.n}, {args.gen} tokens; ms a step")
    print("| drafter | steps | " + " | ".join(PARTS) + " |")
    print("|---|---|" + "---|" * len(PARTS))
    for drafter in args.drafters.split(","):
        r = parts(model, prompts, drafter, args)
        print(f"| {drafter} | {r['steps']} | " + " | ".join(f"{r[k]:.2f}" for k in PARTS) + " |")


if __name__ == "__main__":
    main()
