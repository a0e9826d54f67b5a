"""The slot pool: every piece of per-sequence state, indexed by `SlotId`.

Per slot: K and V of every full-attention layer, the conv and recurrent state
of every Gated DeltaNet layer, the MTP block's K and V, and the slot's length.
All slots live in a few preallocated arrays (`[n_slots, ...]` per layer), so a
step reads the rows of its slots with one gather per layer and writes them
back with one scatter; slots outside the step are never touched.

Rollback of speculative rows: a row run with capture leaves, per Gated
DeltaNet layer, its conv window and its recurrent state after every position;
`rollback(slot, keep)` keeps the first `keep` positions exactly.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

import mlx.core as mx
import numpy as np

from engine.gguf import ModelConfig
from engine.kernels import stack_cuda
from engine.models.batch import AttentionState, Layout, LinearCapture, LinearState

SlotId = NewType("SlotId", int)


class PoolError(RuntimeError):
    """A request on the pool that cannot be honoured; the pool is unchanged."""


class PoolExhaustedError(PoolError):
    pass


class ContextOverflowError(PoolError):
    pass


class SlotStateError(PoolError):
    pass


@dataclass
class SlotCapture:
    """What a capture row left for one slot: its start and length, and where its entries lie
    in its step's captures — per linear layer, the step's arrays whole, shared by all of the
    step's capture rows. (Committing a verify step used to take a view of each row's window
    and states out of each layer's capture, 3 graph nodes apiece: 864 for 8 rows of a
    0.8B-shaped model, host work that launched nothing; docs/PERFORMANCE.md, session 10.)"""

    start: int
    length: int
    row: int  # the slot's index among the step's capture rows
    captures: tuple[LinearCapture, ...]  # per linear layer, the step's


@dataclass
class SlotSnapshot:
    """A host copy of one slot: enough to restore it bit-exactly into any slot."""

    length: int
    mtp_length: int
    kv: list[tuple[np.ndarray, np.ndarray]]  # per attention layer, [length, Hkv, D]
    conv: list[np.ndarray]
    ssm: list[np.ndarray]
    mtp_kv: tuple[np.ndarray, np.ndarray] | None

    @property
    def nbytes(self) -> int:
        arrays = [a for pair in self.kv for a in pair] + self.conv + self.ssm
        arrays += list(self.mtp_kv or ())
        return sum(a.nbytes for a in arrays)


@dataclass
class SlotCopy:
    """A slot's state copied on the device, the copies queued but not waited for
    (`SlotPool.copy`): a snapshot before `to_host` moves it to host memory. Waiting for a
    copy waits for everything queued before it — with a decode step queued ahead, for that
    step — so a caller that will wait for the device anyway moves it to the host then."""

    length: int
    mtp_length: int
    parts: list[mx.array]  # k, v `[La, 1, length, Hkv, D]`, conv, ssm `[Ll, 1, ...]` (mtp k, v)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.parts)

    def to_host(self) -> SlotSnapshot:
        """The copy in host memory (waits for it); the per-layer arrays are views."""
        k, v, conv, ssm, *mtp = map(host_copy, self.parts)
        return SlotSnapshot(
            length=self.length,
            mtp_length=self.mtp_length,
            kv=list(zip(k[:, 0], v[:, 0], strict=True)),
            conv=list(conv[:, 0]),
            ssm=list(ssm[:, 0]),
            mtp_kv=(mtp[0][0], mtp[1][0]) if mtp else None,
        )


@dataclass
class SlotPool:
    """Fixed-size pool of sequence slots for one model (see module docstring)."""

    config: ModelConfig
    n_slots: int
    max_context: int
    kv_dtype: mx.Dtype = mx.float16
    max_draft: int = 0
    # Stacked over layers of a kind: k, v `[attention layers, slots, context, Hkv, D]`,
    # conv `[linear layers, slots, Kc-1, Cc]`, ssm `[linear layers, slots, Hv, dv, dk]`,
    # so a step reads and writes each with ONE gather and ONE scatter.
    k: mx.array = field(init=False)
    v: mx.array = field(init=False)
    conv: mx.array = field(init=False)
    ssm: mx.array = field(init=False)
    mtp_k: mx.array | None = field(init=False)
    mtp_v: mx.array | None = field(init=False)

    def __post_init__(self) -> None:
        cfg = self.config
        if self.n_slots < 1 or self.max_context < 1:
            raise ValueError(
                f"pool needs n_slots >= 1 and max_context >= 1, got {self.n_slots}, "
                f"{self.max_context}"
            )
        if cfg.n_attention_layers < 1 or cfg.n_linear_layers < 1:
            raise ValueError(
                f"{cfg.name}: a hybrid model needs both layer kinds, got "
                f"{cfg.n_attention_layers} attention and {cfg.n_linear_layers} linear layers"
            )
        kv_shape = (self.n_slots, self.max_context, cfg.n_head_kv, cfg.head_dim)
        La, Ll = cfg.n_attention_layers, cfg.n_linear_layers
        self.k = mx.zeros((La, *kv_shape), self.kv_dtype)
        self.v = mx.zeros((La, *kv_shape), self.kv_dtype)
        self.conv = mx.zeros((Ll, self.n_slots, cfg.conv_kernel - 1, cfg.conv_channels))
        self.ssm = mx.zeros((Ll, self.n_slots, cfg.ssm_hv, cfg.ssm_dv, cfg.ssm_dk))
        has_mtp = cfg.n_mtp > 0
        self.mtp_k = mx.zeros(kv_shape, self.kv_dtype) if has_mtp else None
        self.mtp_v = mx.zeros(kv_shape, self.kv_dtype) if has_mtp else None
        self._layer_ids = layer_ids(La)  # for `token_index`
        mx.eval(
            self.k,
            self.v,
            self.conv,
            self.ssm,
            *[a for a in (self.mtp_k, self.mtp_v) if a is not None],
        )
        self.lengths = [0] * self.n_slots
        self.mtp_lengths = [0] * self.n_slots
        # Free slots as a heap: the lowest is taken first, so slots in use stay packed at the
        # bottom and a batch of them in slot order is a few runs of consecutive slots, which
        # `read` and `write` take as slices (scattered ones are gathered and scattered: a
        # copy of every row's state each way, each step).
        self._free = list(range(self.n_slots))
        self._free_set = set(self._free)
        self._captures: dict[SlotId, SlotCapture] = {}

    # -- allocation ------------------------------------------------------------------------
    def allocate(self) -> SlotId:
        if not self._free:
            raise PoolExhaustedError(f"all {self.n_slots} slots are in use")
        slot = SlotId(heapq.heappop(self._free))
        self._free_set.discard(slot)
        self._reset_row(slot)
        return slot

    def free(self, slot: SlotId) -> None:
        self._check(slot)
        self._captures.pop(slot, None)
        heapq.heappush(self._free, slot)
        self._free_set.add(slot)

    def reset(self, slot: SlotId) -> None:
        """Empty a slot in use, as if just allocated."""
        self._check(slot)
        self._reset_row(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def in_use(self, slot: SlotId) -> bool:
        return 0 <= slot < self.n_slots and slot not in self._free_set

    def _check(self, slot: SlotId) -> None:
        if not self.in_use(slot):
            raise SlotStateError(f"slot {slot} is not allocated")

    def _reset_row(self, slot: SlotId) -> None:
        # KV beyond a slot's length is never read, so only the recurrent state needs zeroing.
        self.conv[:, slot] = 0
        self.ssm[:, slot] = 0
        self.lengths[slot] = 0
        self.mtp_lengths[slot] = 0
        self._captures.pop(slot, None)

    # -- accounting -------------------------------------------------------------------------
    @property
    def kv_element_bytes(self) -> int:
        return self.kv_dtype.size

    def bytes_for(self, context_tokens: int, draft_depth: int = 0) -> int:
        """Bytes one sequence of `context_tokens` holds, with capture for `draft_depth` drafts."""
        cfg = self.config
        kv = context_tokens * cfg.kv_bytes_per_token(
            self.kv_element_bytes, include_mtp=cfg.n_mtp > 0
        )
        state = cfg.linear_state_bytes()
        capture = 0
        if draft_depth > 0:
            T = draft_depth + 1
            conv = (cfg.conv_kernel - 1 + T) * cfg.conv_channels
            rec = (T + 1) * cfg.ssm_hv * cfg.ssm_dv * cfg.ssm_dk
            capture = 4 * cfg.n_linear_layers * (conv + rec)
        return kv + state + capture

    @property
    def total_bytes(self) -> int:
        """Bytes held by the pool's preallocated arrays (capture buffers are counted per use)."""
        arrays = [self.k, self.v, self.conv, self.ssm]
        arrays += [a for a in (self.mtp_k, self.mtp_v) if a is not None]
        return sum(a.nbytes for a in arrays)

    # -- the rows of a step --------------------------------------------------------------------
    # A step is checked on the host (`check_rows`), then gathers and scatters its rows with
    # pure functions of arrays (`gather`, `scatter`, so the runner can compile them with the
    # model), and finally commits lengths and captures on the host (`commit`).

    def check_rows(
        self, slots: list[SlotId], starts: list[int], lengths: list[int], capture: list[bool]
    ) -> None:
        """Raise, changing nothing, unless every row can run on its slot."""
        for slot, start, n, cap in zip(slots, starts, lengths, capture, strict=True):
            self._check(slot)
            if start != self.lengths[slot]:
                raise SlotStateError(
                    f"slot {slot}: row starts at {start} but the slot holds {self.lengths[slot]} tokens"
                )
            if start + n > self.max_context:
                raise ContextOverflowError(
                    f"slot {slot}: {start} + {n} tokens exceed the context of {self.max_context}"
                )
            if cap and n - 1 > self.max_draft:
                raise PoolError(
                    f"slot {slot}: a capture row of {n} tokens exceeds max_draft {self.max_draft} + 1"
                )

    MAX_RUNS = 2  # beyond this many runs of consecutive slots, rows are gathered

    def read(self, slots: list[SlotId], past: int) -> list[mx.array]:
        """Stacked state of the rows on `slots`: k, v (the first `past` entries), conv, ssm.

        Rows on consecutive slots are read as slices: a copy at memory speed, where
        MLX's general gather is several times slower on the large recurrent states.
        """
        return [
            take_slots(self.k[:, :, :past], slots, 1, self.MAX_RUNS),
            take_slots(self.v[:, :, :past], slots, 1, self.MAX_RUNS),
            take_slots(self.conv, slots, 1, self.MAX_RUNS),
            take_slots(self.ssm, slots, 1, self.MAX_RUNS),
        ]

    def write(
        self, slots: list[SlotId], tok_slot: mx.array, tok_pos: mx.array, new: list[mx.array]
    ) -> None:
        """Store a step's new state (as `stack_states` returns it) in place: each row's conv
        and ssm, and K/V of every packed token at `(tok_slot, tok_pos)`. The ssm comes
        stacked (one write) or a layer at a time (a write each)."""
        k, v, conv, *ssm = new
        at = token_index(self._layer_ids, tok_slot, tok_pos)
        self.k[at] = k.astype(self.kv_dtype)
        self.v[at] = v.astype(self.kv_dtype)
        put_slots(self.conv, slots, conv, self.MAX_RUNS)
        if len(ssm) == 1:
            put_slots(self.ssm, slots, ssm[0], self.MAX_RUNS)
        else:
            for layer, rows in enumerate(ssm):
                put_slots(self.ssm, slots, rows, self.MAX_RUNS, layer)

    @staticmethod
    def split_states(
        config: ModelConfig, stacked: list[mx.array]
    ) -> list[AttentionState | LinearState]:
        """Per trunk layer, views of the stacked state `read` returns, each with the stack's
        leading axis of 1 kept: split per state kind, a few nodes of a step's graph where a
        view per layer (a slice, then dropping the axis) was two — 96 of the 429 nodes of a
        0.8B decode step, each costing host time in every step. The fused
        kernels read these views as they are; the portable path drops the axis
        (`engine.models.batch.unstacked`)."""
        k, v, conv, ssm = stacked
        attn = _split(k), _split(v)
        lin = _split(conv), _split(ssm)
        states: list[AttentionState | LinearState] = []
        ai = li = 0
        for recurrent in config.recurrent:
            if recurrent:
                states.append(LinearState(lin[0][li], lin[1][li]))
                li += 1
            else:
                states.append(AttentionState(attn[0][ai], attn[1][ai]))
                ai += 1
        return states

    @staticmethod
    def stack_states(
        layout: Layout, new: list[AttentionState | LinearState], ssm_layers: bool = False
    ) -> list[mx.array]:
        """The layers' new state for `write`: K/V packed `[La, N, Hkv, D]`, conv `[Ll, N,
        ...]`, then the ssm stacked `[Ll, N, ...]` — or, with `ssm_layers`, each linear
        layer's on its own (`[1, N, ...]`, a view of what its mixer made). Stacking copies
        every row's recurrent state once more on the device (a wide batch's largest
        traffic: 64 rows of the 0.8B are 1.2 GB a step) to save the launches of a write per
        layer (`SSM_WRITE_ENV`)."""
        attn = [s for s in new if isinstance(s, AttentionState)]
        lin = [s for s in new if isinstance(s, LinearState)]
        packed = [s.packed or (layout.to_packed(s.k), layout.to_packed(s.v)) for s in attn]
        groups = [[k for k, _ in packed], [v for _, v in packed], [s.conv for s in lin]]
        stacked = [stack_cuda.stack(g) for g in groups]
        if ssm_layers:
            return [*stacked, *(s.ssm[None] for s in lin)]
        return [*stacked, stack_cuda.stack([s.ssm for s in lin])]

    def commit(
        self,
        slots: list[SlotId],
        starts: list[int],
        lengths: list[int],
        captures: list[LinearCapture | None],
    ) -> None:
        """After a step's write: advance lengths, keep what capture rows left for rollback."""
        for slot in slots:
            self._captures.pop(slot, None)  # a capture is only good until the slot's next step
        linear = tuple(c for c in captures if c is not None)
        if linear:
            for j, row in enumerate(linear[0].rows):
                self._captures[slots[row]] = SlotCapture(starts[row], lengths[row], j, linear)
        for slot, n in zip(slots, lengths, strict=True):
            self.lengths[slot] += n

    @staticmethod
    def token_coordinates(
        slots: list[SlotId], starts: list[int], lengths: list[int]
    ) -> tuple[mx.array, mx.array]:
        """Slot and position of every packed token of a batch."""
        tok_slot: list[int] = []
        tok_pos: list[int] = []
        for slot, start, n in zip(slots, starts, lengths, strict=True):
            tok_slot.extend([slot] * n)
            tok_pos.extend(range(start, start + n))
        return mx.array(tok_slot, dtype=mx.int32), mx.array(tok_pos, dtype=mx.int32)

    def read_mtp(
        self,
        slots: list[SlotId],
        starts: list[int],
        past: int | None = None,
        pads: Sequence[SlotId] = (),
    ) -> AttentionState:
        """The MTP block's K/V of the rows on `slots`, then of `pads` (rows whose outputs
        nobody keeps, padding a batch to a compiled width: read as they are, unchecked): the
        first `past` entries (default: the latest start; a caller may read more, to keep
        batch shapes few)."""
        if self.mtp_k is None or self.mtp_v is None:
            raise SlotStateError("this model has no MTP block")
        for slot, start in zip(slots, starts, strict=True):
            self._check(slot)
            if start > self.mtp_lengths[slot]:
                raise SlotStateError(
                    f"slot {slot}: MTP row starts at {start} past its {self.mtp_lengths[slot]} entries"
                )
        past = max(starts) if past is None else past
        return AttentionState(
            take_slots(self.mtp_k[:, :past], [*slots, *pads], 0, self.MAX_RUNS),
            take_slots(self.mtp_v[:, :past], [*slots, *pads], 0, self.MAX_RUNS),
        )

    def write_mtp(
        self,
        slots: list[SlotId],
        starts: list[int],
        lengths: list[int],
        layout: Layout,
        new: AttentionState,
    ) -> None:
        """Store the MTP block's new K/V at the rows' positions (its own lengths)."""
        assert self.mtp_k is not None and self.mtp_v is not None
        tok_slot, tok_pos = self.token_coordinates(slots, starts, lengths)
        self.mtp_k[tok_slot, tok_pos] = layout.to_packed(new.k).astype(self.kv_dtype)
        self.mtp_v[tok_slot, tok_pos] = layout.to_packed(new.v).astype(self.kv_dtype)
        for slot, start, n in zip(slots, starts, lengths, strict=True):
            self.mtp_lengths[slot] = start + n

    # -- rollback, fork, snapshot -----------------------------------------------------------
    def rollback(self, slot: SlotId, keep: int) -> None:
        """Keep only the first `keep` positions of the slot's last capture row."""
        self.rollback_many([(slot, keep)])

    def rollback_many(self, keeps: Sequence[tuple[SlotId, int]]) -> None:
        """`rollback` of several slots at once, as a step's verify rows are resolved together:
        the kept conv windows and states of every slot and layer are gathered in one take
        per kind (`stack_cuda.take`) and written with one update each, where a slot at a
        time made two stacks and two writes per slot (per layer, eagerly, on a GPU). Every
        slot is checked before any changes: an error leaves the pool as it was."""
        caps: list[SlotCapture] = []
        for slot, keep in keeps:
            self._check(slot)
            cap = self._captures.get(slot)
            if cap is None or self.lengths[slot] != cap.start + cap.length:
                raise SlotStateError(f"slot {slot}: no capture row to roll back")
            if not 0 <= keep <= cap.length:
                raise SlotStateError(f"slot {slot}: keep={keep} outside 0..{cap.length}")
            caps.append(cap)
        slots = [slot for slot, _ in keeps]
        if len(set(slots)) != len(slots):
            raise SlotStateError(f"a slot appears more than once in a rollback: {slots}")
        if not keeps:
            return
        steps: dict[int, list[int]] = {}  # the keeps by the step their captures came from
        for i, cap in enumerate(caps):
            steps.setdefault(id(cap.captures), []).append(i)
        for ids in steps.values():  # one, but for a caller mixing steps
            conv, ssm = self._kept_states([caps[i] for i in ids], [keeps[i][1] for i in ids])
            put_slots(self.conv, [slots[i] for i in ids], conv, self.MAX_RUNS)
            put_slots(self.ssm, [slots[i] for i in ids], ssm, self.MAX_RUNS)
        for (slot, keep), cap in zip(keeps, caps, strict=True):
            self.lengths[slot] = cap.start + keep
            self.mtp_lengths[slot] = min(self.mtp_lengths[slot], self.lengths[slot])
            del self._captures[slot]

    def _kept_states(self, caps: list[SlotCapture], keeps: list[int]) -> tuple[mx.array, mx.array]:
        """The conv windows `[L, R, Kc-1, Cc]` and recurrent states `[L, R, Hv, dv, dk]` that
        rows of one step's captures keep after `keeps` positions: Kc - 1 entries of the row's
        window, one entry of its states, gathered over all L layers in one take per kind —
        a handful of graph nodes where a slice per row and layer made 2LR (288 for 8 rows
        of an 18-linear-layer model, host time on the verify step's critical path)."""
        captures, Kc = caps[0].captures, self.config.conv_kernel
        _, W, Cc = captures[0].windows.shape  # W = Kc - 1 + T
        S = captures[0].states.shape[1]  # T + 1
        rows = [(cap.row, keep) for cap, keep in zip(caps, keeps, strict=True)]
        window_index = [r * W + keep + j for r, keep in rows for j in range(Kc - 1)]
        state_index = [r * S + keep for r, keep in rows]
        windows = [c.windows for c in captures]
        conv = stack_cuda.take(windows, mx.array(window_index, dtype=mx.int32))
        states = [c.states for c in captures]
        ssm = stack_cuda.take(states, mx.array(state_index, dtype=mx.int32))
        return conv.reshape(len(captures), len(rows), Kc - 1, Cc), ssm

    def truncate_mtp(self, slot: SlotId, length: int) -> None:
        self._check(slot)
        self.mtp_lengths[slot] = min(self.mtp_lengths[slot], length)

    def fork(self, src: SlotId, dst: SlotId) -> None:
        """Make `dst` an exact copy of `src` (both allocated)."""
        self._check(src)
        self._check(dst)
        n = self.lengths[src]
        for a in (self.k, self.v):
            a[:, dst, :n] = a[:, src, :n]
        for a in (self.conv, self.ssm):
            a[:, dst] = a[:, src]
        m = self.mtp_lengths[src]
        if self.mtp_k is not None and self.mtp_v is not None:
            self.mtp_k[dst, :m] = self.mtp_k[src, :m]
            self.mtp_v[dst, :m] = self.mtp_v[src, :m]
        self.lengths[dst], self.mtp_lengths[dst] = n, m
        self._captures.pop(dst, None)

    def snapshot(self, slot: SlotId) -> SlotSnapshot:
        """The slot copied to the host (`copy`, then `SlotCopy.to_host`)."""
        return self.copy(slot).to_host()

    def copy(self, slot: SlotId) -> SlotCopy:
        """The slot copied on the device: every state kind sliced for all layers at once, so
        moving it to the host is one wait for the device, not one per layer and kind (48
        for a 0.8B-shaped model). The copies are queued (`mx.async_eval`), not waited for.
        Each is a new buffer (`fresh_copy`): a slice would share the pool's buffer, and while
        anything shares it a write into the pool cannot reuse it and copies the whole array."""
        self._check(slot)
        n, m = self.lengths[slot], self.mtp_lengths[slot]
        copies = [fresh_copy(a[where]) for a, where in self._slot_parts(slot, n, m)]
        mx.async_eval(copies)
        return SlotCopy(n, m, copies)

    def _slot_parts(self, slot: SlotId, n: int, m: int) -> list[tuple[mx.array, tuple[slice, ...]]]:
        """Where a slot of `n` tokens (`m` in the MTP block) lies in the pool, as `SlotCopy`
        holds it: (pool array, index) for k, v, conv, ssm and the MTP block's k, v. Slices
        all: a view (an integer index would gather)."""
        every, at = slice(None), slice(int(slot), int(slot) + 1)
        parts: list[tuple[mx.array, tuple[slice, ...]]] = [
            (self.k, (every, at, slice(0, n))),
            (self.v, (every, at, slice(0, n))),
        ]
        parts += [(self.conv, (every, at)), (self.ssm, (every, at))]
        if self.mtp_k is not None and self.mtp_v is not None:
            parts += [(self.mtp_k, (at, slice(0, m))), (self.mtp_v, (at, slice(0, m)))]
        return parts

    def restore(self, snap: SlotSnapshot | SlotCopy, slot: SlotId) -> None:
        """Make the allocated `slot` exactly what the copied one was, from host memory
        (`SlotSnapshot`) or from a device copy (`SlotCopy`: no transfer, device copies)."""
        self._check(slot)
        if snap.length > self.max_context:
            raise ContextOverflowError(
                f"snapshot of {snap.length} tokens exceeds the context of {self.max_context}"
            )
        if isinstance(snap, SlotCopy):
            self._restore_copy(snap, slot)
            return
        n = snap.length
        if len(snap.kv) != self.k.shape[0] or len(snap.conv) != self.conv.shape[0]:
            raise SlotStateError("snapshot was taken from a pool of another model")
        dtype = self.kv_dtype
        if n:
            self.k[:, slot, :n] = mx.stack([device_copy(k, dtype) for k, _ in snap.kv])
            self.v[:, slot, :n] = mx.stack([device_copy(v, dtype) for _, v in snap.kv])
        self.conv[:, slot] = mx.array(np.stack(snap.conv))
        self.ssm[:, slot] = mx.array(np.stack(snap.ssm))
        if snap.mtp_kv is not None and self.mtp_k is not None and self.mtp_v is not None:
            self.mtp_k[slot, : snap.mtp_length] = device_copy(snap.mtp_kv[0], dtype)
            self.mtp_v[slot, : snap.mtp_length] = device_copy(snap.mtp_kv[1], dtype)
        self.lengths[slot], self.mtp_lengths[slot] = n, snap.mtp_length
        self._captures.pop(slot, None)

    def _restore_copy(self, copy: SlotCopy, slot: SlotId) -> None:
        into = self._slot_parts(slot, copy.length, copy.mtp_length)
        views = [a[where] for a, where in into]
        if [(v.shape, v.dtype) for v in views] != [(c.shape, c.dtype) for c in copy.parts]:
            raise SlotStateError("snapshot was taken from a pool of another model")
        for (a, where), part in zip(into, copy.parts, strict=True):
            if part.size:
                a[where] = part
        self.lengths[slot], self.mtp_lengths[slot] = copy.length, copy.mtp_length
        self._captures.pop(slot, None)


SPLIT_PARTS = 10  # MLX splits into at most this many parts by one node; more, by a slice each


def _split(a: mx.array) -> list[mx.array]:
    """`a`'s entries along its first axis as views `[1, ...]`, by as few split nodes as MLX
    allows (no copy): an 18-layer stack is 3 nodes (into [10, 8], then each), not 18."""
    n = a.shape[0]
    if n < 2:
        return [a]
    if n <= SPLIT_PARTS:
        parts = mx.split(a, n, axis=0)
        assert isinstance(parts, list)
        return parts
    size = max(SPLIT_PARTS, -(-n // SPLIT_PARTS))  # groups: as large as one split takes
    groups = mx.split(a, list(range(size, n, size)), axis=0)
    assert isinstance(groups, list)
    return [part for group in groups for part in _split(group)]


def layer_ids(layers: int) -> mx.array:
    """`[layers, 1]` int32 layer numbers for `token_index`, made and evaluated once per pool."""
    ids = mx.arange(layers, dtype=mx.int32)[:, None]
    mx.eval(ids)
    return ids


def token_index(
    ids: mx.array, tok_slot: mx.array, tok_pos: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """The index of every packed token's K/V entry in every layer of a pool stacked
    `[layers, slots, context, ...]`: `[layers, N]` broadcast views of the layer numbers
    (`layer_ids`) and of the coordinates. Written `k[:, tok_slot, tok_pos]`, MLX builds these
    for each store — an arange and three copies, four launches besides the scatter (each
    ~12 us of host time on the H200)."""
    shape = (ids.shape[0], tok_slot.shape[0])
    return (
        mx.broadcast_to(ids, shape),
        mx.broadcast_to(tok_slot[None], shape),
        mx.broadcast_to(tok_pos[None], shape),
    )


def take_slots(a: mx.array, slots: list[SlotId], axis: int, max_runs: int) -> mx.array:
    """`a`'s entries at `slots` along `axis` (slicing first keeps the gather to what is read:
    indexing first would copy each row's whole context). Rows on at most `max_runs` runs of
    consecutive slots are sliced, not gathered."""
    runs = _runs(slots)
    lead = (slice(None),) * axis
    if len(runs) > max_runs:
        return a[(*lead, mx.array(slots, dtype=mx.int32))]
    parts = [a[(*lead, slice(lo, hi))] for lo, hi in runs]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis)


def put_slots(
    a: mx.array, slots: list[SlotId], rows: mx.array, max_runs: int, layer: int | None = None
) -> None:
    """Write `rows` (in `slots` order along axis 1) into `a` in place at `slots` on axis 1:
    slices for rows on at most `max_runs` runs of consecutive slots, else one scatter.
    `layer`: `rows` `[1, N, ...]` go to that index of `a`'s first axis only."""
    lead = slice(None) if layer is None else slice(layer, layer + 1)
    runs = _runs(slots)
    if len(runs) > max_runs:
        a[lead, mx.array(slots, dtype=mx.int32)] = rows
        return
    at = 0
    for lo, hi in runs:
        a[lead, lo:hi] = rows[:, at : at + hi - lo]
        at += hi - lo


def _runs(slots: list[SlotId]) -> list[tuple[int, int]]:
    """`slots` as maximal runs of consecutive ids, in order: [3, 4, 0] -> [(3, 5), (0, 1)]."""
    runs: list[tuple[int, int]] = []
    for s in slots:
        if runs and runs[-1][1] == s:
            runs[-1] = (runs[-1][0], s + 1)
        else:
            runs.append((s, s + 1))
    return runs


def fresh_copy(a: mx.array) -> mx.array:
    """`a` in a buffer of its own, bit for bit: multiplied by 1 as unsigned integers of its
    width (a float product may flush subnormals to zero on a GPU; MLX's own copies of a
    contiguous view share the view's buffer)."""
    bits = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.itemsize]
    return (a.view(bits) * 1).view(a.dtype)


def host_copy(a: mx.array) -> np.ndarray:
    """A host copy; bfloat16, which numpy lacks, travels as its bits (uint16)."""
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def device_copy(x: np.ndarray, dtype: mx.Dtype) -> mx.array:
    """The inverse of `host_copy` for an array of `dtype`."""
    a = mx.array(x)
    return a.view(mx.bfloat16) if dtype == mx.bfloat16 and a.dtype == mx.uint16 else a
