"""How a batch of ragged rows sits in the model, and the per-row state crossing its boundary.

Rows travel packed (all tokens in one `[N, ...]` matrix); mixers view them padded
(`[B, T, ...]`) through `Layout`. The state types are what the caller (the slot pool)
owns and hands in and out of every layer: nothing per-sequence lives on the model.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class Layout:
    """Where each packed token sits in the padded `[B, T]` view of the batch.

    Row b has `row_lengths[b]` tokens starting at absolute position
    `row_starts[b]` (the row's cached length). The model reads only the arrays
    and the static shape fields, so one compiled forward serves every batch of
    the same shape. Built once per step; shared by every layer.
    """

    rows: int
    width: int  # T, the longest row
    uniform: bool  # all rows equally long: packed and padded views are one reshape apart
    capture: tuple[bool, ...]  # rows whose linear-layer state is kept after every position
    pad_index: mx.array  # [B, T] int32: packed index of (b, t); 0 where t >= length
    pack_index: mx.array  # [N] int32: b * T + t of each packed token
    valid: mx.array  # [B, T] bool
    row_starts: mx.array  # [B] int32
    row_lengths: mx.array  # [B] int32

    @staticmethod
    def build(
        lengths: list[int] | tuple[int, ...],
        starts: list[int] | tuple[int, ...],
        capture: list[bool] | tuple[bool, ...] | None = None,
        row_starts: mx.array | None = None,
    ) -> Layout:
        """The layout of rows of `lengths` tokens at `starts`; `row_starts`: the starts as an
        array already made (say, on the device from the step before), else one is made."""
        capture = tuple(capture) if capture is not None else (False,) * len(lengths)
        if not lengths or min(lengths) < 1 or not len(lengths) == len(starts) == len(capture):
            raise ValueError(f"bad batch layout: lengths={lengths} starts={starts}")
        width = max(lengths)
        pad_index, pack_index, valid, row_lengths = _by_lengths(tuple(lengths))
        return Layout(
            rows=len(lengths),
            width=width,
            uniform=min(lengths) == width,
            capture=capture,
            pad_index=pad_index,
            pack_index=pack_index,
            valid=valid,
            row_starts=mx.array(list(starts), dtype=mx.int32) if row_starts is None else row_starts,
            row_lengths=row_lengths,
        )

    @property
    def capture_rows(self) -> tuple[int, ...]:
        """The rows whose linear-layer state is kept after every position, in order."""
        return tuple(b for b, c in enumerate(self.capture) if c)

    def arrays(self) -> list[mx.array]:
        return [
            self.pad_index,
            self.pack_index,
            self.valid,
            self.row_starts,
            self.row_lengths,
        ]

    def with_arrays(self, arrays: list[mx.array]) -> Layout:
        """The same static shape over other arrays (as a compiled function receives them)."""
        pad, pack, valid, starts, lengths = arrays
        return Layout(
            self.rows,
            self.width,
            self.uniform,
            self.capture,
            pad,
            pack,
            valid,
            starts,
            lengths,
        )

    def to_padded(self, x: mx.array) -> mx.array:
        """Packed `[N, ...]` -> padded `[B, T, ...]`."""
        if self.uniform:
            return x.reshape(self.rows, self.width, *x.shape[1:])
        return x[self.pad_index]

    def to_packed(self, x: mx.array) -> mx.array:
        """Padded `[B, T, ...]` -> packed `[N, ...]`."""
        flat = x.reshape(self.rows * self.width, *x.shape[2:])
        return flat if self.uniform else flat[self.pack_index]


_LENGTHS_KEPT = 64  # row-length tuples whose arrays are kept (a decode width is one each)
_by_lengths_kept: OrderedDict[tuple[int, ...], tuple[mx.array, ...]] = OrderedDict()
_by_lengths_lock = threading.Lock()


def _by_lengths(lengths: tuple[int, ...]) -> tuple[mx.array, ...]:
    """A layout's arrays that depend only on its rows' lengths — pad index, pack index,
    valid mask, lengths — made once per length tuple and kept (the most recent
    `_LENGTHS_KEPT`): a decode step of a width it met before builds only its starts. Made
    anew each step, they were host time on every step, and on MLX's CUDA backend (managed
    memory) fresh host-written buffers each step for the GPU to read. Arrays are immutable,
    so sharing them between steps and runners is safe."""
    with _by_lengths_lock:
        kept = _by_lengths_kept.get(lengths)
        if kept is not None:
            _by_lengths_kept.move_to_end(lengths)
            return kept
    width = max(lengths)
    pad: list[list[int]] = []
    valid: list[list[bool]] = []
    pack: list[int] = []
    offset = 0
    for b, n in enumerate(lengths):
        pad.append([offset + t if t < n else 0 for t in range(width)])
        valid.append([t < n for t in range(width)])
        pack.extend(b * width + t for t in range(n))
        offset += n
    made = (
        mx.array(pad, dtype=mx.int32),
        mx.array(pack, dtype=mx.int32),
        mx.array(valid),
        mx.array(list(lengths), dtype=mx.int32),
    )
    with _by_lengths_lock:
        _by_lengths_kept[lengths] = made
        if len(_by_lengths_kept) > _LENGTHS_KEPT:
            _by_lengths_kept.popitem(last=False)
    return made


def unstacked(a: mx.array, ndim: int) -> mx.array:
    """`a` without the leading axis of 1 that a state read from the pool keeps (the pool's
    layer axis: `SlotPool.split_states`), as the portable path wants it; a view."""
    return a.reshape(a.shape[-ndim:]) if a.ndim > ndim else a


@dataclass
class AttentionState:
    """Past keys and values of one attention layer for the rows of a batch.

    `k`, `v`: `[B, S, Hkv, D]` — or `[1, B, S, Hkv, D]` as the pool hands them to a
    forward (`unstacked` drops the axis); row b's first `Layout.row_starts[b]` entries are
    valid. The forward returns the new entries (`[B, T, Hkv, D]`, post-norm, post-rope).
    """

    k: mx.array
    v: mx.array
    # New entries as the fused kernel made them, packed `[N, Hkv, D]` (a forward's result
    # only): what the pool stores, without a round trip through the padded view.
    packed: tuple[mx.array, mx.array] | None = None


@dataclass
class LinearState:
    """Gated DeltaNet state of one layer for the rows of a batch.

    `conv`: `[B, Kc-1, Cc]` last conv inputs; `ssm`: `[B, Hv, dv, dk]` f32, in the
    file's head order. As the pool hands them to a forward, each has a leading axis of 1
    (`unstacked` drops it); the forward returns them without.
    """

    conv: mx.array
    ssm: mx.array


@dataclass
class LinearCapture:
    """Per-position state of the capture rows of one linear layer, for rollback.

    `windows[j]`: conv inputs `[Kc-1+T, Cc]` of capture row `rows[j]` (the conv state
    after keeping p positions is `window[p : p+Kc-1]`); `states[j]`: `[T+1, Hv, dv, dk]`,
    the recurrent state before the row and after each of its positions.
    """

    rows: tuple[int, ...]
    windows: mx.array
    states: mx.array


LayerState = AttentionState | LinearState
