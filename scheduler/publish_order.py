"""When the loop publishes a step: while the next step computes, or before it starts.

The loop publishes step N (detokenizing, Deltas, the server's sends) while step N+1's
forward runs on the step thread, so the host work hides behind the device. It hides only
as much as the forward lasts: publishing holds the GIL, and a step thread whose forward has
ended waits for it. When forwards are much shorter than publishing (many rows of a small
model; a host-bound benchmark), overlapping saves at most the short forward, while starting
the next step first puts the hand-off to the step thread — waking it, its Python before the
forward, the loop's wake-up after — in front of every token's publishing. Then publishing
first costs little throughput and takes the hand-off out of the tokens' latency.

`PublishOrder` decides from what a forward could hide: its time less the step thread's own
CPU time in it (the runner's Python holds the GIL as publishing does; what is left is the
device's, or MLX's worker threads', time). A forward that ran beside publishing may also
have waited for the GIL, so while overlapping, one step in every `PROBE_EVERY` is
published first, as a probe.
"""

from __future__ import annotations

FIRST_BELOW = 0.25  # publish first once what an unimpeded forward could hide is under this
OVERLAP_ABOVE = 0.5  # share of the publishing before it; overlap again above this share
PROBE_EVERY = 16  # while overlapping, steps between probes
SMOOTHING = 0.25  # while publishing first, the weight of each step in the running share


class PublishOrder:
    """`publish_first()` before each step's output is published: whether to publish it now,
    before the next step starts; then `observe` what the next step's forward took."""

    def __init__(self) -> None:
        self.first = False  # publishing first, not as a probe
        self._since_probe = 0
        self._share = 0.0  # while publishing first: the running share (see `observe`)

    def publish_first(self) -> bool:
        if self.first:
            return True
        self._since_probe += 1
        if self._since_probe < PROBE_EVERY:
            return False
        self._since_probe = 0
        return True

    def observe(self, forward_s: float, forward_cpu_s: float, publish_s: float) -> None:
        """A step whose forward (`forward_s`, `forward_cpu_s` of it the step thread's CPU)
        started after the previous step's output was published (`publish_s`, the server's
        sends included). A step that ran no forward (snapshots only) says nothing."""
        if publish_s <= 0.0 or forward_s <= 0.0:
            return
        share = (forward_s - forward_cpu_s) / publish_s
        if self.first:  # one slow step (a prefill, a busy machine) does not end it
            self._share += SMOOTHING * (share - self._share)
            self.first = self._share < OVERLAP_ABOVE
        else:  # a probe
            self._share = share
            self.first = share < FIRST_BELOW
