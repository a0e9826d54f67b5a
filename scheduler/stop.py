"""Stop strings over streamed text: cut exactly, hold back what might become one."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Finds the first stop string to complete in a stream of text pieces.

    The stop that ends first in the text wins (ties: the longer one), so the result does
    not depend on how the text was cut into pieces. `push` returns the text that is safe
    to emit: everything before that stop string once it completes, or else everything
    except the longest tail that is a proper prefix of some stop string (held back until
    the next piece resolves it). The emitted text never contains a stop string or any
    part of one that completes.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._held = ""
        # There are stop strings to look for (else `push` passes every piece through).
        self.active = bool(self._stops)

    def push(self, piece: str) -> tuple[str, str | None]:
        """Add `piece`; return (text safe to emit, the stop string that completed or None).

        After a match the matcher is spent: the text after the stop string is dropped.
        """
        if not self._stops:
            return piece, None
        text = self._held + piece
        found: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            at = text.find(stop)
            if at >= 0 and (found is None or (at + len(stop), at) < found[:2]):
                found = (at + len(stop), at, stop)
        if found is not None:
            self._held = ""
            return text[: found[1]], found[2]
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], None

    def flush(self) -> str:
        """The stream ended without a match: release the held-back text."""
        held, self._held = self._held, ""
        return held

    def _partial_tail(self, text: str) -> int:
        """Length of the longest tail of `text` that a stop string starts with (shorter than it)."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
