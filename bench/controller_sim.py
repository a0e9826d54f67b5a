"""The speculation cost controller against simulated step times: how often it drafts, and what
its choices cost per token against plain decode and against the best fixed depth.

Each world gives a step's time from its deepest draft (a fixed cost per drafting round, one
per depth) and accepts each draft token with a fixed chance, drawn at random; the controller
(`engine.spec.controller.CostController`) sees only those times and acceptances, as the
speculator feeds it. No model runs: this measures the controller's policy, not the engine.
Run it from another tree (`cd OTHER && python /path/to/bench/controller_sim.py`) to compare
versions; it imports the controller of the tree it is run from.

    .venv/bin/python bench/controller_sim.py
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path.cwd()))  # the tree run from, ahead of an installed one

from engine.cache import SlotId
from engine.spec.controller import CostController, Offer

CAP = 4


@dataclass(frozen=True)
class World:
    """Step ms = base, + per_round + per_depth x the deepest draft when anything drafts."""

    name: str
    width: int
    alpha: float
    base: float
    per_round: float
    per_depth: float
    steps: int

    def step_ms(self, depth: int) -> float:
        return self.base + (self.per_round + self.per_depth * depth if depth else 0.0)

    def ms_per_token(self, ks: np.ndarray) -> float:
        """Expected ms per committed token of choices `[steps, width]`."""
        a = self.alpha
        tokens = sum(1 + sum(a**d for d in range(1, int(k) + 1)) for k in ks.ravel())
        return sum(self.step_ms(int(row.max())) for row in ks) / tokens


WORLDS = [
    World("dear: a draft of 1 costs 5 plain steps, of 4 17", 8, 0.6, 10.0, 0.0, 40.0, 2000),
    World("mid: a draft of 1 costs 1.9 plain steps", 8, 0.6, 10.0, 0.0, 9.0, 2000),
    World("fixed: a round adds 1.04 plain steps, depth 4 pays", 8, 0.7, 1.44, 1.5, 0.1, 600),
    World("fixed, one slot", 1, 0.7, 1.44, 1.5, 0.1, 600),
]


def run(world: World, seed: int) -> np.ndarray:
    """The controller's depths `[steps, width]` over the world's steps."""
    rng = np.random.default_rng(seed)
    ctrl = CostController()
    slots = [SlotId(i) for i in range(world.width)]
    chosen = []
    for _ in range(world.steps):
        ks = np.array(ctrl.choose([Offer(s, "mtp", CAP) for s in slots]))
        for s, k in zip(slots, ks, strict=True):
            if k:
                accepted = int(np.cumprod(rng.random(k) < world.alpha).sum())
                ctrl.observe_round(s, "mtp", int(k), accepted)
        ctrl.observe_step(world.width, int(ks.max()), world.step_ms(int(ks.max())) / 1e3)
        chosen.append(ks)
    return np.array(chosen)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--skip", type=int, default=100, help="first steps left out of the ratios")
    args = p.parse_args()
    print("| world | width | steps that draft (by depth 1-4) | ms/token vs plain | vs best depth |")
    print("|---|---|---|---|---|")
    for w in WORLDS:
        plain = w.ms_per_token(np.zeros((1, w.width), dtype=int))
        best = min(w.ms_per_token(np.full((1, w.width), k)) for k in range(CAP + 1))
        drafts, vs_plain, vs_best = [], [], []
        for seed in range(args.seeds):
            ks = run(w, seed)
            deepest = ks.max(axis=1)
            drafts.append("/".join(str(int((deepest == d).sum())) for d in range(1, CAP + 1)))
            vs_plain.append(w.ms_per_token(ks[args.skip :]) / plain)
            vs_best.append(w.ms_per_token(ks[args.skip :]) / best)
        print(
            f"| {w.name} | {w.width} | {', '.join(drafts)} | "
            f"{', '.join(f'{r:.3f}' for r in vs_plain)} | {', '.join(f'{r:.3f}' for r in vs_best)} |"
        )


if __name__ == "__main__":
    main()
