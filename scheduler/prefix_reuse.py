"""Exact prompt reuse: what the scheduler snapshots, when it publishes, how a hit resumes.

A slot's Gated DeltaNet state cannot be cut back to an earlier position, so reuse is
exact only from a snapshot taken exactly at a token boundary. Snapshots (`SlotImage`:
the pool's `SlotSnapshot` — attention KV prefix, conv and recurrent state, MTP KV —
plus the drafters' state: the MTP head's unfed hidden states, the DFlash drafter's
context K/V and waiting target features) are taken

* at the end of every prompt (the next turn of a conversation extends it),
* every `interval` tokens of a long prompt,
* after every end-of-message token in a prompt (`<|im_end|>` in ChatML: the earlier
  messages of a conversation render to the same tokens in every later turn),
* when a request finishes, over prompt + output (an agent that sends the model's own
  reply back hits it) — if the slot holds no token beyond the published output.

Prefill chunks end at the snapshot boundaries, so each is taken on the step thread right
after the chunk that reaches it: copied on the device there (`SlotPool.copy`, queued). By
default (`placement="device"`) the copy is what the cache keeps, in the memory MLX computes
in, and a hit is restored by device copies. On an H200, moving a 0.8B-shaped slot's ~19 MB
to host memory cost the step thread ~8 ms per snapshot — half a daemon's throughput at
N = 32 (docs/PERFORMANCE.md) — so host memory (`placement="host"`) is for a GPU whose memory
is scarce: the copy then moves to the host at the end of the step, when the step thread has
waited for the device anyway (moving it at once would wait for all the device has queued, a
decode step queued ahead included). On the CPU backend both are host memory. A request's
snapshots stay pending (counted against the budget) until it completes successfully (STOP
or LENGTH); only then are they published in the `PrefixCache`. On admission the longest cached prefix of the prompt — at most
all tokens but the last, whose logits the first token is sampled from — is pinned,
restored into the new slot on the step thread, and only the rest is prefilled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.cache import SlotCopy, SlotId, SlotPool, SlotSnapshot
from engine.spec.drafters import DrafterState
from engine.spec.speculator import Speculator
from scheduler.prefix_cache import PrefixCache, PrefixCacheStats
from scheduler.sequence import Sequence

PLACEMENTS = ("device", "host")


@dataclass(frozen=True)
class PrefixCacheConfig:
    """`budget_bytes`: memory for snapshots, published and pending (0: cache off), in
    `placement`: "device" (the memory MLX computes in: GPU memory on a GPU) or "host".
    `interval`: snapshot every this many prompt tokens (0: only at other boundaries).
    `message_ends`: snapshot after every end-of-message token of a prompt. `min_tokens`:
    the shortest prefix worth a snapshot. `per_prompt`: the most snapshots of one prompt
    (the prompt end and the latest other boundaries: a cold conversation of many messages
    would otherwise copy its whole history once per message). `finished`: snapshot a
    request's prompt and output when it completes."""

    budget_bytes: int = 1 << 30
    interval: int = 1024
    message_ends: bool = True
    min_tokens: int = 32
    per_prompt: int = 4
    finished: bool = True
    placement: str = "device"

    def __post_init__(self) -> None:
        if self.budget_bytes < 0 or self.interval < 0:
            raise ValueError("prefix cache: budget_bytes and interval must be >= 0")
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"prefix cache: placement must be one of {', '.join(PLACEMENTS)}, "
                f"got {self.placement!r}"
            )
        if self.min_tokens < 1 or self.per_prompt < 1:
            raise ValueError("prefix cache: min_tokens and per_prompt must be >= 1")


@dataclass
class SlotImage:
    """A slot's state at a token boundary: pool snapshot and drafter states. Captured as a
    device copy (`SlotPool.copy`); for a cache in host memory, moved there by `settle` when
    the step has waited for the device anyway."""

    snapshot: SlotSnapshot | SlotCopy
    drafters: dict[str, DrafterState] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.snapshot.length

    @property
    def nbytes(self) -> int:
        return self.snapshot.nbytes + sum(s.nbytes for s in self.drafters.values())

    @classmethod
    def capture(cls, pool: SlotPool, speculator: Speculator, slot: SlotId) -> SlotImage:
        """Copy `slot` on the device, queued (step thread)."""
        return cls(pool.copy(slot), speculator.export(slot))

    def settle(self) -> None:
        """Move the pool's part and the drafters' to host memory (step thread; waits for
        their copies)."""
        if isinstance(self.snapshot, SlotCopy):
            self.snapshot = self.snapshot.to_host()
        for state in self.drafters.values():
            state.settle()

    def restore(
        self, pool: SlotPool, speculator: Speculator, slot: SlotId, speculation: str
    ) -> None:
        """Make the allocated `slot` what the captured one was (step thread)."""
        pool.restore(self.snapshot, slot)
        speculator.adopt(slot, self.drafters, speculation)


class PrefixReuse:
    """The scheduler's side of the prefix cache; every method runs on the event loop.

    `config=None` turns reuse off: nothing is looked up or snapshotted.
    """

    def __init__(self, config: PrefixCacheConfig | None, message_ends: frozenset[int]) -> None:
        self.config = config if config is not None and config.budget_bytes > 0 else None
        self.cache: PrefixCache[SlotImage] = PrefixCache(
            0 if config is None else config.budget_bytes
        )
        self._message_ends = message_ends

    def stats(self) -> PrefixCacheStats:
        return self.cache.counts

    def admit(self, seq: Sequence) -> None:
        """On admission: pin the longest cached prefix of the prompt (the step restores it
        and prefills the rest) and choose the positions to snapshot."""
        cfg = self.config
        if cfg is None or not seq.prepared.request.prefix_cache:
            return
        prompt = seq.prompt
        hit = self.cache.longest(prompt, len(prompt) - 1)
        if hit is not None:
            seq.restore = hit
            seq.prefilled = seq.cached_tokens = hit.length
        points = {len(prompt)}
        if cfg.interval:
            points.update(range(cfg.interval, len(prompt), cfg.interval))
        if cfg.message_ends:
            points.update(i + 1 for i, t in enumerate(prompt) if t in self._message_ends)
        wanted = sorted(
            b
            for b in points
            if b > seq.prefilled and b >= cfg.min_tokens and prompt[:b] not in self.cache
        )
        seq.snapshot_at = tuple(wanted[-cfg.per_prompt :])

    def stepped(self, admitted: list[Sequence], images: list[tuple[Sequence, SlotImage]]) -> None:
        """After a step: release the step's restores, account the snapshots it took."""
        for seq in admitted:
            if seq.restore is not None:
                self.cache.unpin(seq.restore)
                seq.restore = None
        for seq, image in images:
            if self.cache.reserve(image.nbytes):
                seq.images.append(image)

    def ended(self, seq: Sequence, succeeded: bool) -> bool:
        """A request has ended: publish its snapshots if it succeeded, else give them up.
        True when its slot should be snapshotted before it is freed (then call `finished`
        with that image)."""
        images, seq.images = seq.images, []
        if not succeeded:
            for image in images:
                self.cache.cancel(image.nbytes)
            return False
        for image in images:
            self.cache.publish(seq.prompt[: image.length], image)
        cfg = self.config
        return (
            cfg is not None
            and cfg.finished
            and seq.prepared.request.prefix_cache
            and seq.slot is not None
            and len(seq.prompt) + len(seq.output) - 1 >= cfg.min_tokens
        )

    def finished(self, seq: Sequence, image: SlotImage) -> None:
        """The snapshot of a successfully finished request's slot: published if the slot
        holds nothing beyond its prompt and published output."""
        tokens = [*seq.prompt, *seq.output]
        n = image.length
        if n > len(tokens) or n < len(seq.prompt) or tokens[:n] in self.cache:
            return
        if self.cache.reserve(image.nbytes):
            self.cache.publish(tokens[:n], image)
