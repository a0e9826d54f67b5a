"""Prompt-lookup drafts: the continuation of the latest, longest earlier match."""

from __future__ import annotations

from engine.spec.drafters import NgramDrafter


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
