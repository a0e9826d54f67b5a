"""The cost controller against a simulated clock: it drafts where drafts pay, backs off
where they do not (judged per batch width), and recovers when they start paying again."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from controller_sim import CAP, Noisy, Stalling, World, run, time_per_token

from engine.cache import SlotId
from engine.spec.controller import CostController, Offer


def test_drafts_deep_when_drafts_are_cheap_and_accepted() -> None:
    ks = run(CostController(), World(alpha=0.8), width=1, steps=200)
    assert ks[-100:].mean() >= CAP - 0.5


def test_backs_off_when_drafts_cost_more_than_they_commit() -> None:
    world = World(alpha=0.1, per_depth=3.0)
    ks = run(CostController(), world, width=2, steps=300)
    assert (ks[-200:] > 0).mean() < 0.15  # only the occasional retry
    # per token: a plain step of 2 slots commits 2 (the bound was `base`, twice plain's)
    assert time_per_token(world, ks[-200:]) < 1.05 * world.base / 2


def test_the_same_acceptance_pays_at_width_1_but_not_at_width_8() -> None:
    ctrl = CostController()
    narrow = World(alpha=0.6, base=10.0, per_depth=0.5, per_token=0.1)  # latency-bound
    wide = World(alpha=0.6, base=12.0, per_depth=2.0, per_token=1.0)  # compute-bound
    for seed in range(6):
        a = run(ctrl, narrow, width=1, steps=50, seed=seed)
        b = run(ctrl, wide, width=8, steps=50, seed=seed)
    assert a[-30:].mean() >= 2
    assert b[-30:].mean() < 0.2
    assert time_per_token(narrow, a[-30:]) < 0.8 * narrow.base
    # per token, within 8% of plain decode (a plain step of 8 slots commits 8; the bound was
    # `base`, 8x plain's): the occasional re-try, where drafting 1 every step costs 15% more
    assert time_per_token(wide, b[-30:]) <= 1.08 * wide.base / 8


@pytest.mark.parametrize("per_depth", [2.0, 5.0])  # 5: a draft of 4 triples the step, as on CPU
def test_recovers_when_acceptance_comes_back(per_depth: float) -> None:
    ctrl = CostController()
    world = World(alpha=0.02, per_depth=per_depth)
    assert (run(ctrl, world, width=1, steps=200)[-100:] > 0).mean() < 0.15
    world.alpha = 1.0  # e.g. the text fell into a loop that prompt lookup drafts exactly
    ks = run(ctrl, world, width=1, steps=200, seed=1)
    assert ks[-100:].mean() >= CAP - 0.5


def test_comes_close_to_the_best_fixed_depth_in_a_middling_world() -> None:
    world = World(alpha=0.5, per_depth=1.5)  # best fixed K is 2: 7.43 ms/token; K = 4: 8.26
    best = min(time_per_token(world, np.full((1, 1), k)) for k in range(CAP + 1))
    for seed in range(3):
        auto = run(CostController(), world, width=1, steps=300, seed=seed)[-200:]
        assert time_per_token(world, auto) <= 1.05 * best


def test_modes_off_and_on_bypass_the_controller() -> None:
    ctrl = CostController()
    offers = [Offer(SlotId(0), "ngram", 3, "off"), Offer(SlotId(1), "ngram", 3, "on")]
    for _ in range(5):
        assert ctrl.choose(offers) == [0, 3]
        ctrl.observe_round(SlotId(1), "ngram", 3, 0)
        ctrl.observe_step(2, 3, 0.05)


def test_a_new_width_measures_plain_decode_first() -> None:
    ctrl = CostController()
    assert ctrl.choose([Offer(SlotId(0), "mtp", CAP)]) == [0]
    ctrl.observe_step(1, 0, 0.01)
    # the very first step, with nothing to judge it by (a stall?), is followed by another
    assert ctrl.choose([Offer(SlotId(0), "mtp", CAP)]) == [0]
    ctrl.observe_step(1, 0, 0.01)
    # untried: taken to cost nothing, but probed at its cheapest depth first
    assert ctrl.choose([Offer(SlotId(0), "mtp", CAP)]) == [1]


def test_unmeasured_depths_are_interpolated_from_measured_ones() -> None:
    ctrl = CostController()
    ctrl.observe_step(3, 0, 0.010)
    assert ctrl.predict(3, 2) == 0.010  # only plain known: deeper steps look free (try them)
    ctrl.observe_step(3, 4, 0.018)
    # between: on the line; past the deepest: its price (what a probe one deeper is taken at)
    assert [round(ctrl.predict(3, d) or 0, 6) for d in (2, 6)] == [0.014, 0.018]
    assert ctrl.predict(5, 1) is None


def test_a_new_request_starts_from_the_drafters_record() -> None:
    ctrl = CostController()
    run(ctrl, World(alpha=0.0, per_depth=2.0), width=1, steps=100)
    ctrl.forget(SlotId(0))
    assert ctrl.choose([Offer(SlotId(1), "mtp", CAP)]) == [0]  # not re-tried in full
    ctrl = CostController()
    run(ctrl, World(alpha=0.95, per_depth=2.0), width=1, steps=100)
    ctrl.forget(SlotId(0))
    assert ctrl.choose([Offer(SlotId(1), "mtp", CAP)]) == [CAP]


def test_one_slow_sample_does_not_bar_a_depth_for_good() -> None:
    """One step four times as slow as it should be (a host pause, say) must not keep drafting
    that pays from ever running again (the speculator already keeps catch-up and compiling
    steps from the controller; what is left is noise)."""
    ctrl = CostController()
    slot = SlotId(0)
    ctrl.observe_step(1, 0, 0.016)
    ctrl.observe_step(1, 0, 0.016)
    assert ctrl.choose([Offer(slot, "mtp", 1)]) == [1]
    ctrl.observe_round(slot, "mtp", 1, 0)  # rejected, and 4x a plain step
    ctrl.observe_step(1, 1, 0.064)
    world = World(alpha=0.8, base=16.0, per_depth=8.0)  # depth 1: 1.8 tokens for 1.5x the time
    ks = run(ctrl, world, width=1, steps=300)
    assert (ks[:40] == 0).all()  # the slow sample holds for a while ...
    assert ks[-100:].mean() >= 0.9  # ... then drafting is measured again, and pays


def test_a_dear_drafter_is_probed_at_depth_1_and_ever_more_rarely() -> None:
    """Where a draft of 1 costs five plain steps and a draft of 4 seventeen (the demo model
    at N = 8 on the H200 costs ~2x and ~4.5x), "auto" must stay close to plain decode: no
    full-depth probes, and re-tries that thin out (forgetting the dear depth every
    `remeasure_every` steps re-probed it at full depth each time, in pairs: session 15
    measured "auto" at half plain decode's speed)."""
    world = World(alpha=0.6, base=10.0, per_depth=40.0)
    ks = run(CostController(), world, width=8, steps=2000)
    drafting = np.flatnonzero(ks.max(axis=1))
    assert ks.max() == 1
    assert len(drafting) <= 6
    gaps = np.diff(drafting)
    assert (gaps[1:] >= gaps[:-1]).all()  # each re-try waits at least as long as the last
    assert time_per_token(world, ks[100:]) <= 1.01 * world.base / 8


def test_a_width_borrows_a_neighbours_drafting_costs() -> None:
    """A batch that loses a slot (8 -> 7) measures its plain step once and then decides
    from width 8's drafting costs, scaled: no probe where drafting does not pay, drafting
    at full depth where it does."""
    dear = World(alpha=0.5, base=10.0, per_depth=12.0)
    ctrl = CostController()
    run(ctrl, dear, width=8, steps=300)
    ks = run(ctrl, dear, width=7, steps=10)
    assert (ks == 0).all()  # plain first, then no probe (until the rates drift back up)
    cheap = World(alpha=0.9, base=10.0, per_depth=3.0)
    ctrl = CostController()
    run(ctrl, cheap, width=8, steps=300)
    assert run(ctrl, cheap, width=7, steps=1).max() == 0
    assert ctrl.predict(7, 2) == pytest.approx(
        ctrl.seconds[7][0] * ctrl.predict(8, 2) / ctrl.seconds[8][0], rel=1e-9
    )
    assert ctrl.choose([Offer(SlotId(i), "mtp", CAP) for i in range(7)]) == [CAP] * 7
    ctrl.observe_step(3, 0, 0.01)  # 8 is too far from 3 to borrow from: taken to cost nothing
    assert ctrl.predict(3, 2) == 0.01


def test_a_round_of_mostly_fixed_cost_is_walked_up_to_the_depth_that_pays() -> None:
    """MTP on the H200 at N = 1: a round's head catch-up and chain cost about as much as the
    verify step whatever the depth, so a draft of 1 does not pay and a draft of 4 does.
    Probing one depth at a time must still get there (each depth past the deepest measured
    is taken at the deepest's price)."""
    world = World(alpha=0.7, base=10.0, per_depth=0.7, per_round=10.0)
    per_token = [time_per_token(world, np.full((1, 8), k)) for k in range(CAP + 1)]
    assert per_token[1] > per_token[0] > per_token[CAP]  # (the world is as described)
    ks = run(CostController(), world, width=8, steps=400)
    assert (ks[-200:] == CAP).mean() >= 0.9


def test_re_measuring_a_doubted_depth_does_not_set_off_the_doubt_of_the_next() -> None:
    """A doubt's re-try runs a depth once; that must not count as the depth being in use,
    or the depth past it is doubted (and probed) straight after, and so on down the line
    (traced on a CPU at N = 1: depths 1, 2, 3 re-tried on consecutive rounds)."""
    ctrl = CostController(remeasure_every=4)
    offers = [Offer(SlotId(i), "mtp", CAP) for i in range(8)]
    # (a first draft of 1 at 5x plain decode, its guess, is a stall until it repeats)
    for depth, seconds in [(0, 0.010), (1, 0.050), (1, 0.050), (2, 0.090)]:
        ctrl.observe_step(8, depth, seconds)
    for _ in range(8):
        ctrl.observe_step(8, 0, 0.010)
    ctrl.choose(offers)
    assert ctrl.seconds[8][1] == pytest.approx(0.030)  # doubted: the excess halved
    ctrl.observe_step(8, 1, 0.050)  # the re-try: as dear as before
    for _ in range(3):
        ctrl.choose(offers)
        ctrl.observe_step(8, 0, 0.010)
    assert ctrl.seconds[8] == {0: pytest.approx(0.010), 1: 0.050, 2: 0.090}
    for _ in range(4):  # depth 1 in use now (its drafts came to pay): depth 2 may be doubted
        ctrl.observe_step(8, 1, 0.050)
    ctrl.choose(offers)
    assert ctrl.seconds[8][2] == pytest.approx(0.050)


def test_a_stall_is_left_out_unless_it_repeats() -> None:
    """A step 30x what its depth was expected to cost (a kernel the device builds at first
    use, on the H200: drafts of 65 ms where they took 4) says nothing of the depth; the
    same at the depth's next sample is what it costs."""
    ctrl = CostController()
    offers = [Offer(SlotId(i), "mtp", CAP) for i in range(8)]
    ctrl.observe_step(8, 0, 0.002)
    ctrl.observe_step(8, 0, 0.002)
    assert max(ctrl.choose(offers)) == 1  # a first probe, priced as plain decode
    ctrl.observe_step(8, 1, 0.065)
    assert ctrl.stalls == 1 and 1 not in ctrl.seconds[8]
    assert max(ctrl.choose(offers)) == 1  # so it is tried again
    ctrl.observe_step(8, 1, 0.004)
    assert ctrl.seconds[8][1] == 0.004
    ctrl.observe_step(8, 2, 0.300)
    ctrl.observe_step(8, 2, 0.300)  # twice in a row: the depth costs that
    assert ctrl.stalls == 2 and ctrl.seconds[8][2] == 0.300


def test_a_widths_first_plain_step_is_judged_by_its_neighbours() -> None:
    """A batch that lost three slots (8 -> 5) and whose first plain step stalled (3.9 s on
    the H200, where 2 ms was steady) must not take plain decode to cost that — drafting
    would look free beside it; and an entry a stall made gives way to the next sample."""
    ctrl = CostController()
    ctrl.observe_step(8, 0, 0.002)
    ctrl.observe_step(5, 0, 3.9)
    assert 5 not in ctrl.seconds
    ctrl.observe_step(5, 0, 0.0021)
    assert ctrl.seconds[5][0] == 0.0021
    ctrl = CostController()
    ctrl.observe_step(1, 0, 3.9)  # nothing to judge the very first step by: taken
    ctrl.observe_step(1, 0, 0.002)  # under a quarter of it: the entry was a stall
    assert ctrl.seconds[1][0] == 0.002


@pytest.mark.parametrize("at", [1, CAP])
def test_one_stall_while_warming_up_does_not_steer_the_run(at: int) -> None:
    """N-gram drafting at N = 8 on the H200, where a draft of 4 pays: a 2 s step at depth 4
    while warming up kept it at depths 1-3 (a stalled draft of 1 bars drafting as badly);
    the run must end at depth 4 as it does without the stall."""
    world = Stalling(alpha=0.7, base=10.0, per_depth=0.7, per_round=10.0, at=at)
    ks = run(CostController(), world, width=8, steps=400)
    assert world.stalled
    assert (ks[-200:] == CAP).mean() >= 0.9


def test_a_stalled_first_step_does_not_make_drafting_look_free() -> None:
    """The very first step stalls (nothing to judge it by: taken) where drafting does not
    pay: the next plain step must replace it, not be averaged in over many re-measures
    while the controller drafts at a loss."""
    world = Stalling(alpha=0.6, base=10.0, per_depth=40.0, at=0)
    ks = run(CostController(), world, width=8, steps=400)
    assert world.stalled
    assert (ks[-300:] > 0).mean() < 0.05


def test_pauses_of_the_host_do_not_make_drafting_look_cheap() -> None:
    """A shared CPU at N = 8 (session 22): a draft of 1 costs 2.2 plain steps, no depth pays,
    and one step in 50 takes five (or three) times as long. Taken as samples, the pauses
    lifted the plain entry until drafts looked cheap beside it (1.22-1.27x plain decode's
    time per token with a stall at 8x and a clip at 4x); the controller must stay within
    3% of plain decode."""
    for factor in (5.0, 3.0):
        world = Noisy(alpha=0.6, base=27.0, per_depth=30.0, per_round=5.0, factor=factor)
        ks = run(CostController(), world, width=8, steps=2000)
        plain = time_per_token(world, np.zeros((1, 8), dtype=int))
        assert time_per_token(world, ks[100:]) < 1.03 * plain, factor


def test_re_tries_after_plain_stretches_are_paid_for_by_the_credit() -> None:
    """MTP at N = 8 on the H200 (session 16): no depth pays, and a re-try's first step also
    catches the head up on the whole plain stretch (untimed, charged). Slots' rates fade back
    up every few dozen steps; each re-try must wait until the credit (5% of the time) has
    paid for the last: before the credit, 24-28 drafting steps in 1,000 and 1.165x plain
    decode's time per token."""
    world = World(alpha=0.6, base=1.4, per_depth=0.75, per_round=1.1, catch_up=0.2)
    plain = time_per_token(world, np.zeros((1, 8), dtype=int))
    for seed in range(3):
        ctrl = CostController()
        ks = run(ctrl, world, width=8, steps=1000, seed=seed)
        assert (ks.max(axis=1) > 0).sum() <= 12
        assert time_per_token(world, ks) < 1.15 * plain
        assert ctrl.held > 900 and ctrl.credit < 0


def test_the_credit_holds_back_nothing_where_drafting_pays() -> None:
    """A round that pays at depth 4 earns credit: the run drafts exactly as without it."""
    world = World(alpha=0.7, base=1.44, per_depth=0.1, per_round=1.5)
    ctrl = CostController()
    ks = run(ctrl, world, width=8, steps=600)
    assert ctrl.held == 0 and ctrl.credit > 0
    assert (ks.max(axis=1) == CAP).sum() == 586  # as before the credit (plain: re-measures)


def test_a_step_after_a_plain_one_drafts_only_on_credit() -> None:
    """Spent credit keeps a step after a plain one plain; a step after a drafting one goes
    by the depths and rates alone; "on" slots draft whatever the credit, and their rounds
    are not charged."""
    offers = [Offer(SlotId(i), "mtp", CAP) for i in range(2)]
    ctrl = CostController()
    ctrl.observe_step(2, 0, 0.010)
    ctrl.observe_step(2, 0, 0.010)  # the first step's plain follow-up
    ctrl.credit = -1e-3
    assert ctrl.choose(offers) == [0, 0] and ctrl.held == 1
    ctrl.credit = 0.0
    assert max(ctrl.choose(offers)) == 1  # a probe, priced as plain decode
    ctrl.observe_round(SlotId(0), "mtp", 1, 0)
    ctrl.observe_round(SlotId(1), "mtp", 1, 1)  # 3 tokens, where plain commits 2 a step
    ctrl.observe_step(2, 1, 0.020)
    # regret: 20 ms against 10 x 1.5; earned: 5% of 20 ms
    assert ctrl.credit == pytest.approx(-(0.020 - 0.015) + 0.05 * 0.020)
    assert max(ctrl.choose(offers)) >= 1 and ctrl.held == 1  # drafting goes on
    ctrl.observe_step(2, 1, 0.012)
    ctrl.credit = -1e-3
    on = [Offer(SlotId(0), "mtp", CAP, "on"), Offer(SlotId(1), "mtp", CAP)]
    ctrl._drafting = False
    assert ctrl.choose(on) == [CAP, 0]  # the "auto" slot waits; the "on" slot drafts
    ctrl.observe_round(SlotId(0), "mtp", CAP, 0)
    ctrl.observe_step(2, CAP, 0.050)
    assert ctrl.credit == -1e-3  # not charged
