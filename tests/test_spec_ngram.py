"""Prompt-lookup drafts: the continuation of the latest, longest earlier match."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache import SlotId
from engine.sampling import RequestRng
from engine.spec.drafters import UNBOUNDED, NgramDrafter
from engine.spec.offline import GREEDY
from engine.spec.speculator import DecodingSlot


def test_drafts_what_followed_the_latest_match() -> None:
    history = [1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]
    assert NgramDrafter(max_ngram=3).propose(history, 2) == [8, 5]


def test_the_longest_matching_ngram_wins() -> None:
    # [2, 3] last followed by 7, but [1, 2, 3] only ever by 4.
    history = [1, 2, 3, 4, 0, 2, 3, 7, 6, 1, 2, 3]
    assert NgramDrafter(max_ngram=3).propose(history, 1) == [4]
    assert NgramDrafter(max_ngram=2).propose(history, 1) == [7]


def test_a_loop_is_drafted_for_any_depth() -> None:
    history = [5, 6, 7, 6, 7, 6, 7]
    assert NgramDrafter().propose(history, 5) == [6, 7, 6, 7, 6]
    assert NgramDrafter(min_ngram=1).propose([4, 4], 3) == [4, 4, 4]


def test_no_match_no_draft() -> None:
    drafter = NgramDrafter(min_ngram=2)
    assert drafter.continuation([1, 2, 3, 4, 1]) is None  # only a unigram repeats
    assert drafter.propose([1, 2, 3, 4, 1], 3) == []
    assert drafter.continuation([7]) is None


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    steps=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=5), max_size=12),
    lo=st.integers(1, 3),
    extra=st.integers(0, 2),
)
def test_a_slots_index_finds_what_the_scan_finds_as_its_history_grows(
    prompt: list[int], steps: list[list[int]], lo: int, extra: int
) -> None:
    """The index a speculating slot drafts from answers what `continuation`'s scan of the
    whole history answers, after every append; a new request in the slot (another list, or
    the same list shortened) is indexed anew."""
    drafter = NgramDrafter(max_ngram=lo + extra, min_ngram=lo)
    d = DecodingSlot(SlotId(0), prompt[-1], list(prompt), GREEDY, RequestRng(0))
    for tokens in steps:
        assert drafter._at(d) == drafter.continuation(d.history)
        assert drafter.available(d, len(d.history) - 1) == (
            UNBOUNDED if drafter.continuation(d.history) is not None else 0
        )
        d.history += tokens
    assert drafter._at(d) == drafter.continuation(d.history)
    del d.history[len(prompt) :]  # shortened in place
    assert drafter._at(d) == drafter.continuation(d.history)
    other = DecodingSlot(SlotId(0), 1, [*prompt, *prompt], GREEDY, RequestRng(0))
    assert drafter._at(other) == drafter.continuation(other.history)
