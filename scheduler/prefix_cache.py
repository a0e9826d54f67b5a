"""The prefix cache's bookkeeping: a token radix tree of cached prefixes within a byte budget.

A cached prefix is a token sequence and an opaque image of a slot that has consumed
exactly those tokens (see `scheduler.prefix_reuse` for what the image holds and when it
is taken). The Gated DeltaNet state cannot be cut back, so an image is only good for
prompts that extend its tokens; `longest` finds the longest such image for a prompt.

Memory: every image held — published in the tree, or pending (taken for a request that
has not finished yet) — counts against `budget_bytes`. Making room evicts published
images, cheapest first by a GreedyDual priority: an image's priority is the clock at
its last use plus the tokens it saves, and each eviction advances the clock to the
evicted priority — least recently used, weighted by tokens saved. An image pinned by a
restore in progress is never evicted. All methods run on the scheduler's event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


I = TypeVar("I", bound=Sized)


@dataclass(eq=False)
class CachedPrefix(Generic[I]):
    """A published image for `tokens`; `pins` > 0 while restores of it are in progress."""

    tokens: tuple[int, ...]
    image: I
    priority: float = 0.0
    pins: int = 0

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.image.nbytes


@dataclass(eq=False)
class _Node(Generic[I]):
    """A radix tree node: the edge from its parent is `edge`; children keyed by first token."""

    edge: tuple[int, ...] = ()
    parent: _Node[I] | None = None
    children: dict[int, _Node[I]] = field(default_factory=dict)
    entry: CachedPrefix[I] | None = None


@dataclass
class PrefixCacheStats:
    lookups: int = 0  # prompts looked up
    hits: int = 0  # of which restored a cached prefix
    tokens_saved: int = 0  # prompt tokens not prefilled thanks to hits
    entries: int = 0  # images published now
    bytes_held: int = 0  # published and pending images
    budget_bytes: int = 0
    published: int = 0  # images published since start
    evictions: int = 0
    dropped: int = 0  # images given up for want of room

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class PrefixCache(Generic[I]):
    """Cached prefixes by token radix tree, within `budget_bytes` (see the module docstring)."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._root: _Node[I] = _Node()
        self._entries: dict[tuple[int, ...], _Node[I]] = {}
        self._clock = 0.0
        self._pending = 0
        self._held = 0
        self.counts = PrefixCacheStats(budget_bytes=budget_bytes)

    # -- lookup ---------------------------------------------------------------------------
    def longest(self, prompt: Sequence[int], limit: int) -> CachedPrefix[I] | None:
        """Pin and return the longest cached prefix of `prompt` of at most `limit` tokens
        (None on a miss; counts the lookup). Call `unpin` when its restore is done."""
        self.counts.lookups += 1
        best: CachedPrefix[I] | None = None
        node, at = self._root, 0
        while True:
            if node.entry is not None and at <= limit:
                best = node.entry
            if at >= len(prompt) or at >= limit:
                break
            child = node.children.get(prompt[at])
            if child is None or tuple(prompt[at : at + len(child.edge)]) != child.edge:
                break
            node, at = child, at + len(child.edge)
        if best is None:
            return None
        self.counts.hits += 1
        self.counts.tokens_saved += best.length
        best.priority = self._clock + best.length
        best.pins += 1
        return best

    def unpin(self, entry: CachedPrefix[I]) -> None:
        if entry.pins <= 0:
            raise RuntimeError("unpin() of a prefix that is not pinned")
        entry.pins -= 1

    def __contains__(self, tokens: Sequence[int]) -> bool:
        return tuple(tokens) in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    # -- memory ---------------------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        return self._held + self._pending

    def reserve(self, nbytes: int) -> bool:
        """Count a pending image of `nbytes` (evicting to make room); False: no room, the
        caller drops the image."""
        room = self._make_room(nbytes)
        if room:
            self._pending += nbytes
        else:
            self.counts.dropped += 1
        self._sync()
        return room

    def cancel(self, nbytes: int) -> None:
        """A pending image is given up (its request did not finish successfully)."""
        self._pending -= nbytes
        self._sync()

    def publish(self, tokens: Sequence[int], image: I) -> bool:
        """Move a reserved pending image into the tree. An image for the same tokens that is
        already there stays (and is refreshed); the new one is released. True if stored."""
        self._pending -= image.nbytes
        key = tuple(tokens)
        node = self._entries.get(key)
        if node is not None:
            assert node.entry is not None
            node.entry.priority = max(node.entry.priority, self._clock + len(key))
            self._sync()
            return False
        node = self._insert(key)
        node.entry = CachedPrefix(key, image, self._clock + len(key))
        self._entries[key] = node
        self._held += image.nbytes
        self.counts.published += 1
        self._sync()
        return True

    def _make_room(self, nbytes: int) -> bool:
        if nbytes > self.budget_bytes:
            return False
        while self.held_bytes + nbytes > self.budget_bytes:
            victims = [n for n in self._entries.values() if n.entry and n.entry.pins == 0]
            if not victims:
                return False
            victim = min(victims, key=lambda n: n.entry.priority if n.entry else 0.0)
            assert victim.entry is not None
            self._clock = victim.entry.priority
            self._evict(victim)
        return True

    def _evict(self, node: _Node[I]) -> None:
        assert node.entry is not None
        self._held -= node.entry.nbytes
        del self._entries[node.entry.tokens]
        node.entry = None
        self.counts.evictions += 1
        # Prune the branch that holds nothing any more; merge a lone child into its parent.
        while node.parent is not None and node.entry is None and not node.children:
            del node.parent.children[node.edge[0]]
            node = node.parent
        up = node.parent
        if up is not None and node.entry is None and len(node.children) == 1:
            (child,) = node.children.values()
            child.edge = node.edge + child.edge
            child.parent = up
            up.children[node.edge[0]] = child

    def _sync(self) -> None:
        self.counts.entries = len(self._entries)
        self.counts.bytes_held = self.held_bytes

    # -- the tree ---------------------------------------------------------------------------
    def _insert(self, key: tuple[int, ...]) -> _Node[I]:
        """The node for `key`, made (splitting an edge where needed)."""
        node, at = self._root, 0
        while at < len(key):
            child = node.children.get(key[at])
            if child is None:
                leaf: _Node[I] = _Node(key[at:], node)
                node.children[key[at]] = leaf
                return leaf
            common = _common(child.edge, key[at:])
            if common < len(child.edge):  # split the edge at the first difference
                mid: _Node[I] = _Node(child.edge[:common], node)
                node.children[key[at]] = mid
                child.edge = child.edge[common:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                child = mid
            node, at = child, at + common
        return node


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
