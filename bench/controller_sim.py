"""The speculation cost controller against simulated step times: how often it drafts, and what
its choices cost per token against plain decode and against the best fixed depth.

Each world gives a step's time from its drafts (a fixed cost per drafting round, one per depth
of the deepest) and accepts each draft token with a fixed chance, drawn at random; the controller
(`engine.spec.controller.CostController`) sees only those times and acceptances, as the
speculator feeds it. No model runs: this measures the controller's policy, not the engine —
and, first, the host time one `choose` takes (it runs once a step while anything may draft).
Run it from another tree (`cd OTHER && python /path/to/bench/controller_sim.py`) to compare
versions; it imports the controller of the tree it is run from.

    .venv/bin/python bench/controller_sim.py
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import timeit
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

if __name__ == "__main__":  # the tree run from, ahead of an installed one
    sys.path.insert(0, str(Path.cwd()))

from engine.cache import SlotId
from engine.spec.controller import CostController, Offer

CAP = 4  # each slot's draft cap


@dataclass
class World:
    """Step ms = base + per_depth x deepest draft + per_token x draft tokens, + per_round
    when anything drafts; each draft token is accepted with `alpha`. (Also the world of
    `tests/test_spec_controller.py`.)"""

    alpha: float
    base: float = 10.0
    per_depth: float = 0.5
    per_token: float = 0.0
    per_round: float = 0.0
    # ms a step of backlog costs the first drafting step after more than CAP + 1 steps
    # without one (the MTP head catching up; the speculator does not time that step, only
    # charges it to the controller's credit)
    catch_up: float = 0.0
    prompt: int = 0  # the backlog before the first step (a prompt the head has not seen)

    def step_ms(self, ks: np.ndarray) -> float:
        deepest = float(ks.max(initial=0))
        fixed = self.per_round if deepest else 0.0
        return self.base + fixed + self.per_depth * deepest + self.per_token * float(ks.sum())


def _step(world: World, ks: np.ndarray, gap: int) -> tuple[float, bool, int]:
    """One step's ms, whether the speculator times it (not a drafting step that catches up
    more than CAP + 1 steps of backlog), and the steps since the last drafting step after
    it (`gap`: before it)."""
    ms = world.step_ms(ks)
    if not ks.max(initial=0):
        return ms, True, gap + 1
    if gap > CAP + 1 and world.catch_up:
        return ms + world.catch_up * gap, False, 1
    return ms, True, 1


@dataclass
class Stalling(World):
    """A world whose first step at depth `at` (the deepest draft; 0: plain) stalls for
    `stall_ms` more — a warm-up step on the H200, where the device builds a kernel at its
    first use (drafts of 65 ms and 2.1 s, a plain step of 3.9 s, where 2-6 ms was steady)."""

    at: int = CAP
    stall_ms: float = 2000.0
    stalled: bool = False

    def step_ms(self, ks: np.ndarray) -> float:
        ms = super().step_ms(ks)
        if not self.stalled and ks.max(initial=0) == self.at:
            self.stalled = True
            return ms + self.stall_ms
        return ms


@dataclass
class Noisy(World):
    """A world where any step, one in `every` at random, takes `factor` times as long — a
    pause of a shared host (session 22's CPU trace at N = 8: a plain step of 147 ms among
    steps of 25-35 ms moved the controller's plain entry to 50 ms, so drafts of 61-122 ms
    looked cheap beside it)."""

    every: int = 50
    factor: float = 5.0
    seed: int = 0
    rng: Any = None

    def step_ms(self, ks: np.ndarray) -> float:
        if self.rng is None:
            self.rng = np.random.default_rng(self.seed)
        ms = super().step_ms(ks)
        return ms * self.factor if self.rng.random() < 1 / self.every else ms


def run(ctrl: CostController, world: World, width: int, steps: int, seed: int = 0) -> np.ndarray:
    """Drive the controller for `steps` steps of `width` slots, each offering `CAP` drafts,
    as the speculator feeds it; returns the chosen depths `[steps, width]`."""
    rng = np.random.default_rng(seed)
    slots = [SlotId(i) for i in range(width)]
    chosen: list[np.ndarray] = []
    gap = world.prompt
    charge = getattr(ctrl, "charge", None)  # (a tree from before the credit has none)
    for _ in range(steps):
        ks = np.array(ctrl.choose([Offer(s, "mtp", CAP) for s in slots]))
        for s, k in zip(slots, ks, strict=True):
            if k:
                accepted = int(np.cumprod(rng.random(k) < world.alpha).sum())
                ctrl.observe_round(s, "mtp", int(k), accepted)
        ms, timed, gap = _step(world, ks, gap)
        if timed:
            ctrl.observe_step(width, int(ks.max()), ms / 1e3)
        elif charge is not None:
            charge(width, int(ks.max()), ms / 1e3)
        chosen.append(ks)
    return np.array(chosen)


def time_per_token(world: World, ks: np.ndarray, gap: int = 0) -> float:
    """Expected ms per committed token of a run's choices `[steps, width]` in `world`, judged
    by its steady steps (a `Stalling` world's stall left out); `gap`: the backlog before the
    first (`world.prompt` for a whole run)."""
    steady = World(**{f.name: getattr(world, f.name) for f in fields(World)})
    a = world.alpha
    tokens = sum(1 + sum(a**d for d in range(1, int(k) + 1)) for k in ks.ravel())
    total = 0.0
    for row in ks:
        ms, _, gap = _step(steady, row, gap)
        total += ms
    return total / tokens


FIXED = World(0.7, base=1.44, per_depth=0.1, per_round=1.5)
# session 16's traces: plain 1.4 ms a step, a draft of 1 3.25 ms, of 4 5.5 ms; "on" committed
# 2.25 tokens a slot a round at K = 4 (a ~ 0.6); two untimed catch-ups of ~80 steps' backlog
# seemed to cost ~10 ms each (by subtraction: a guess)
MTP8 = World(0.6, base=1.4, per_depth=0.75, per_round=1.1)
# (name, world, width, steps); a run of at most SHORT steps is judged whole (no --skip), its
# first drafting step catching up on the world's prompt
SHORT = 256
SCENARIOS: list[tuple[str, Callable[[], World], int, int]] = [
    (
        "dear: a draft of 1 costs 5 plain steps, of 4 17",
        lambda: World(0.6, per_depth=40.0),
        8,
        2000,
    ),
    ("mid: a draft of 1 costs 1.9 plain steps", lambda: World(0.6, per_depth=9.0), 8, 2000),
    ("fixed: a round adds 1.04 plain steps, depth 4 pays", lambda: FIXED, 8, 600),
    ("fixed, one slot", lambda: FIXED, 1, 600),
    (
        "fixed, its first draft of 4 stalls 2 s",
        lambda: Stalling(**asdict(FIXED), at=CAP),  # (made afresh for each run: it stalls once)
        8,
        600,
    ),
    ("dear, its first step stalls 2 s", lambda: Stalling(0.6, per_depth=40.0, at=0), 8, 2000),
    ("MTP at N = 8 on the H200 (session 16)", lambda: MTP8, 8, 2000),
    (
        "the same, catching up 0.1 ms a step of backlog",
        lambda: replace(MTP8, catch_up=0.1),
        8,
        2000,
    ),
    (
        "the same, 128 steps after a 64-token prompt (spec_phases' runs)",
        lambda: replace(MTP8, catch_up=0.1, prompt=64),
        8,
        128,
    ),
    (
        "CPU at N = 8 (session 22: draft of 1 2.2 plain steps), a 5x pause in 50 steps",
        lambda: Noisy(0.6, base=27.0, per_depth=30.0, per_round=5.0),
        8,
        2000,
    ),
    (
        "fixed, one slot, a 5x pause in 50 steps",
        lambda: Noisy(**asdict(FIXED)),
        1,
        2000,
    ),
    (
        "fixed, one slot, 128 steps after a 64-token prompt",
        lambda: replace(FIXED, catch_up=0.02, prompt=64),
        1,
        128,
    ),
]


def choose_us(width: int, module: Any = None, reps: int = 5) -> float:
    """Microseconds of one `choose` for `width` "auto" slots, the per-step host cost of the
    controller: every narrower width has measured plain decode and a draft of 1, this one
    plain decode only (it borrows a neighbour's costs), and the credit for re-tries is not
    spent. `module`: the controller's module (default: this tree's)."""
    m = module or sys.modules[CostController.__module__]
    ctrl = m.CostController()
    for w in range(1, width):
        ctrl.observe_step(w, 0, 0.010)
        ctrl.observe_step(w, 1, 0.030)
    ctrl.observe_step(width, 0, 0.010)
    ctrl.credit = 0.0  # (the drafts above spent it: a step after a plain one would skip)
    offers = [m.Offer(SlotId(i), "mtp", CAP) for i in range(width)]
    number = max(10, 2000 // width)
    times = timeit.repeat(lambda: ctrl.choose(offers), number=number, repeat=reps)
    return 1e6 * min(times) / number


def other_controller(tree: Path) -> Any:
    """`engine/spec/controller.py` of another tree, loaded beside this tree's."""
    spec = importlib.util.spec_from_file_location(
        "_other_controller", tree / "engine" / "spec" / "controller.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--skip", type=int, default=100, help="first steps left out of the ratios")
    p.add_argument("--choose-widths", default="8,64,1024", help="widths `choose` is timed at")
    p.add_argument(
        "--compare",
        type=Path,
        help="another tree: its controller's `choose` timed too, the two alternating 7 times",
    )
    args = p.parse_args()
    if args.compare is None:
        print("| width | choose, us (best of 5) |\n|---|---|")
        for width in map(int, args.choose_widths.split(",")):
            print(f"| {width} | {choose_us(width):.0f} |")
    else:
        other = other_controller(args.compare)
        print(f"| width | choose, us: {args.compare} | this tree (best of 7 x 3, alternating) |")
        print("|---|---|---|")
        for width in map(int, args.choose_widths.split(",")):
            them, us = [], []
            for _ in range(7):
                them.append(choose_us(width, other, reps=3))
                us.append(choose_us(width, reps=3))
            print(f"| {width} | {min(them):.0f} | {min(us):.0f} |")
    print()
    print("| world | width | steps that draft (by depth 1-4) | ms/token vs plain | vs best depth |")
    print("|---|---|---|---|---|")
    for name, make, width, steps in SCENARIOS:
        w = make()
        plain = time_per_token(w, np.zeros((1, width), dtype=int))
        best = min(time_per_token(w, np.full((1, width), k)) for k in range(CAP + 1))
        drafts, vs_plain, vs_best = [], [], []
        skip = 0 if steps <= SHORT else args.skip
        for seed in range(args.seeds):
            w = make()
            ks = run(CostController(), w, width, steps, seed)
            deepest = ks.max(axis=1)
            drafts.append("/".join(str(int((deepest == d).sum())) for d in range(1, CAP + 1)))
            mine = time_per_token(w, ks[skip:], w.prompt if not skip else 0)
            vs_plain.append(mine / plain)
            vs_best.append(mine / best)
        print(
            f"| {name} | {width} | {', '.join(drafts)} | "
            f"{', '.join(f'{r:.3f}' for r in vs_plain)} | {', '.join(f'{r:.3f}' for r in vs_best)} |"
        )


if __name__ == "__main__":
    main()
