"""`Layout.build`: the packed/padded index arrays of a batch, the length-derived ones kept
and shared between builds of the same row lengths."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from engine.models import batch
from engine.models.batch import Layout

LENGTHS = st.lists(st.integers(1, 9), min_size=1, max_size=12)


def _reference(lengths: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pad index, pack index, valid mask of rows of `lengths`, from their definitions."""
    B, T = len(lengths), max(lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    t = np.arange(T)[None, :]
    valid = t < np.array(lengths)[:, None]
    pad = np.where(valid, offsets[:, None] + t, 0)
    pack = np.array([b * T + j for b in range(B) for j in range(lengths[b])])
    return pad, pack, valid


@given(LENGTHS, st.data())
def test_arrays_match_their_definitions_and_starts_are_each_builds_own(
    lengths: list[int], data: st.DataObject
) -> None:
    starts = data.draw(st.lists(st.integers(0, 100), min_size=len(lengths), max_size=len(lengths)))
    first = Layout.build(lengths, starts)
    again = Layout.build(lengths, [s + 1 for s in starts])
    pad, pack, valid = _reference(lengths)
    for lay, at in ((first, starts), (again, [s + 1 for s in starts])):
        assert (lay.rows, lay.width, lay.uniform) == (
            len(lengths),
            max(lengths),
            min(lengths) == max(lengths),
        )
        assert np.array_equal(np.array(lay.pad_index), pad)
        assert np.array_equal(np.array(lay.pack_index), pack)
        assert np.array_equal(np.array(lay.valid), valid)
        assert np.array_equal(np.array(lay.row_lengths), lengths)
        assert np.array_equal(np.array(lay.row_starts), at)
    # the length-derived arrays are the same objects: made once for these lengths
    assert again.pad_index is first.pad_index and again.valid is first.valid
    assert again.row_starts is not first.row_starts


def test_only_the_most_recent_length_tuples_are_kept() -> None:
    first = Layout.build([1, 1, 1], [0, 0, 0])
    for n in range(1, batch._LENGTHS_KEPT + 1):  # as many others: the first goes
        Layout.build([n + 20], [0])
    assert len(batch._by_lengths_kept) <= batch._LENGTHS_KEPT
    later = Layout.build([1, 1, 1], [5, 5, 5])
    assert later.pad_index is not first.pad_index  # made again, equal
    assert bool(mx.array_equal(later.pad_index, first.pad_index))
