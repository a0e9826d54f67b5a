"""The soak's traffic: every kind of client at once, each request's outcome recorded.

Well-behaved: `normal` (token or text prompts, greedy or sampled, one request at a time
per connection), `spec` (speculation ON), `chat` (chat prompts through
`transport.client.Client`). Abuse, at random moments: `cancel` (Cancel after a random
wait), `deadline` (0..50 ms deadlines), `invalid` (bad values, unknown tokens, prompts
that never fit), `burst` (2x slots + queue Generates at once, so BUSY happens), `slow`
(a connection that stops reading for seconds), `killed` (a connection closed mid-stream
without a word), `crashed` (a client process killed with SIGKILL mid-stream), malformed
frames (garbage, truncated, wrong shapes, unknown tags, two frames) and oversized
frames (over the server's limit: it drops the connection), and `fault-*` (requests the
daemon's test-only fault plan fails: NaN logits, a bad row).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import anyio
import msgspec
from peer import Outcome, Peer

from transport import protocol as p
from transport.client import Client, ClientError, RequestError

NORMAL = {"finished", "BUSY"}
EXPECTED: dict[str, set[str]] = {
    "normal": NORMAL,
    "spec": NORMAL,
    "chat": NORMAL,
    "burst": NORMAL,
    "cancel": NORMAL | {"CANCELLED"},
    "slow": NORMAL | {"CANCELLED"},  # cancelled by the server if its buffer overflows
    "killed": NORMAL,  # ended before its connection was killed
    "deadline": NORMAL | {"DEADLINE_EXCEEDED"},
    "invalid": {"INVALID_REQUEST", "TOO_LONG"},
    "fault-nan": {"INTERNAL", "BUSY"},
    "fault-row": {"INTERNAL", "BUSY"},
}
FAULT_RIDS = {"fault-nan": 900_001, "fault-row": 900_002}
FAULT_PLAN = f"nan={FAULT_RIDS['fault-nan']},row={FAULT_RIDS['fault-row']}"
REQUEST_TIMEOUT_S = 120.0  # a request not ended by then counts as lost

# A client process with three streams open; killed with SIGKILL once it prints.
CRASHER = """
import sys
from transport.client import SyncClient
with SyncClient(sys.argv[1]) as client:
    streams = [client.generate([1, 2, 3 + i], max_tokens=150, ignore_eos=True) for i in range(3)]
    for s in streams:
        next(s)
    print("streaming", flush=True)
    for s in streams:
        for _ in s:
            pass
"""


class Traffic:
    """Drives one daemon; `run` for the duration, then `settle` waits for every request."""

    def __init__(
        self, endpoint: str, slots: int, max_queue: int, abuse: bool, faults: bool, seed: int = 0
    ) -> None:
        self.endpoint = endpoint
        self.slots = slots
        self.max_queue = max_queue
        self.abuse = abuse
        self.faults = faults
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.peers: list[Peer] = []
        self.chats: list[Outcome] = []
        self.vocab = 0
        self.context = 0
        self._tg: anyio.abc.TaskGroup | None = None  # the traffic's tasks
        self._peers_tg: anyio.abc.TaskGroup | None = None  # the peers' readers and pings
        self._faulting: set[str] = set()  # fault kinds with a request in flight

    def outcomes(self) -> list[Outcome]:
        return [o for peer in self.peers for o in peer.outcomes.values()] + self.chats

    def unexpected_connection_errors(self) -> list[str]:
        """Connection-level Errors other than the answers to our malformed frames."""
        errors = [e for peer in self.peers for e in peer.connection_errors]
        answers = [e for e in errors if e.startswith("INVALID_REQUEST")]
        self.counts["malformed answered"] = len(answers)
        return [e for e in errors if not e.startswith("INVALID_REQUEST")]

    async def run(self, duration_s: float, workers: int, settle_s: float = 120.0) -> None:
        """Send traffic for `duration_s`, then wait up to `settle_s` for every request owed
        a terminal to have one, and close every connection (Bye)."""
        async with anyio.create_task_group() as peers:
            self._peers_tg = peers
            await self._traffic(duration_s, workers)
            with anyio.move_on_after(settle_s):
                for o in self.outcomes():
                    await o.done.wait()
            for peer in self.peers:
                peer.bye()

    async def _traffic(self, duration_s: float, workers: int) -> None:
        stop_at = time.monotonic() + duration_s
        async with anyio.create_task_group() as tg:
            self._tg = tg
            probe = await self._peer()
            assert probe.welcome is not None
            self.vocab, self.context = probe.welcome.vocab_size, probe.welcome.context_length
            for _ in range(workers):
                tg.start_soon(self._normal_worker, stop_at)
            tg.start_soon(self._chat_worker, stop_at)
            abuse: list[tuple[float, Callable[[], Awaitable[None]]]] = [
                (1.0, self._cancel),
                (1.5, self._deadline),
                (3.0, self._malformed),
                (3.0, self._invalid),
                (4.0, self._killed),
                (15.0, self._burst),
                (20.0, self._slow),
                (30.0, self._oversized),
                (40.0, self._crashed),
            ]
            if self.faults:
                abuse += [(5.0, self._fault("fault-nan")), (5.0, self._fault("fault-row"))]
            for period, action in abuse if self.abuse else []:
                tg.start_soon(self._every, period, action, stop_at)
        self._tg = None

    # -- helpers --------------------------------------------------------------------------
    async def _peer(self, rcvhwm: int = 1000) -> Peer:
        assert self._peers_tg is not None
        peer = Peer(self.endpoint, rcvhwm)
        self.peers.append(peer)
        await peer.start(self._peers_tg)
        return peer

    def _prompt(self, n: int | None = None) -> p.Prompt:
        if self.rng.random() < 0.3:
            words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "slept"]
            return p.TextPrompt(" ".join(self.rng.choices(words, k=self.rng.randint(2, 12))))
        n = n if n is not None else self.rng.randint(2, 40)
        return p.TokenPrompt([self.rng.randrange(1, self.vocab) for _ in range(n)])

    def _sampling(self) -> dict[str, object]:
        """Greedy or seeded sampling (top-p alone: a sort of the vocabulary; or Qwen's
        top-k 20 with top-p: its candidates); a third of either with penalties and a logit
        bias (the host-side adjustments decode-ahead must apply on the device)."""
        fields: dict[str, object] = {"temperature": 0.0}
        if self.rng.random() >= 0.5:
            fields = {"temperature": 0.8, "top_p": 0.9, "seed": self.rng.randrange(1 << 30)}
            if self.rng.random() < 0.5:
                fields |= {"temperature": 0.7, "top_k": 20, "top_p": 0.8}
        if self.rng.random() < 1 / 3:
            fields |= {"repetition_penalty": 1.2, "presence_penalty": 0.4}
            fields |= {"frequency_penalty": 0.3, "logit_bias": {7: 2.0, 11: -3.0}}
        return fields

    async def _every(
        self, period: float, action: Callable[[], Awaitable[None]], stop_at: float
    ) -> None:
        """Run `action` at random moments, 0.5 to 1.5 `period`s apart, each in its own task
        (several may overlap)."""
        assert self._tg is not None
        while True:
            await anyio.sleep(self.rng.uniform(0.5, 1.5) * period)
            if time.monotonic() >= stop_at:
                return
            self._tg.start_soon(action)

    async def _wait(self, *outcomes: Outcome) -> None:
        with anyio.move_on_after(REQUEST_TIMEOUT_S):
            for o in outcomes:
                await o.done.wait()

    # -- well-behaved ---------------------------------------------------------------------
    async def _normal_worker(self, stop_at: float) -> None:
        peer = await self._peer()
        while time.monotonic() < stop_at:
            spec = self.rng.random() < 0.25
            o = peer.generate(
                "spec" if spec else "normal",
                self._prompt(),
                max_tokens=self.rng.randint(4, 24),
                ignore_eos=self.rng.random() < 0.7,
                speculation=p.Speculation.ON if spec else p.Speculation.AUTO,
                **self._sampling(),
            )
            await self._wait(o)
            if o.terminal == "BUSY":
                await anyio.sleep(0.05)

    async def _chat_worker(self, stop_at: float) -> None:
        """Chat prompts through our own Client: its streams must end too."""
        async with Client.connect(self.endpoint, name="soak-chat") as client:
            while time.monotonic() < stop_at:
                o = Outcome("chat", len(self.chats) + 1, time.monotonic(), accepted=1)
                self.chats.append(o)
                messages = [{"role": "user", "content": f"tell me about {self.rng.random()}"}]
                try:
                    with anyio.fail_after(REQUEST_TIMEOUT_S):
                        done = await client.complete(messages, max_tokens=12, **self._sampling())
                    o.tokens = len(done.tokens)
                    o.terminals.append("finished")
                except RequestError as e:
                    o.terminals.append(e.code.name)
                except (ClientError, TimeoutError) as e:
                    o.terminals.append(type(e).__name__)
                o.ended = time.monotonic()
                o.done.set()

    # -- abuse ----------------------------------------------------------------------------
    async def _cancel(self) -> None:
        peer = await self._peer()
        o = peer.generate("cancel", self._prompt(), max_tokens=64, ignore_eos=True)
        await anyio.sleep(self.rng.uniform(0, 0.5))
        peer.cancel(o)
        self.counts["cancels sent"] += 1
        await self._wait(o)
        peer.bye()

    async def _deadline(self) -> None:
        peer = await self._peer()
        deadline = self.rng.randint(1, 50)  # expired before it runs, or soon after
        o = peer.generate("deadline", self._prompt(), max_tokens=64, deadline_ms=deadline)
        await self._wait(o)
        peer.bye()

    async def _invalid(self) -> None:
        peer = await self._peer()
        bad: list[dict[str, object]] = [
            {"prompt": p.TokenPrompt([1, 2]), "temperature": -1.0},
            {"prompt": p.TokenPrompt([1, 2]), "top_p": 0.0},
            {"prompt": p.TokenPrompt([self.vocab + 5])},
            {"prompt": p.TokenPrompt([1] * (self.context + 10))},
            {"prompt": p.TokenPrompt([1, 2]), "max_tokens": self.context * 4},
            {"prompt": p.TokenPrompt([1, 2]), "logprobs": 999},
            {"prompt": p.TokenPrompt([1, 2]), "deadline_ms": 0},
        ]
        fields = self.rng.choice(bad)
        prompt = fields.pop("prompt")
        assert isinstance(prompt, p.TokenPrompt)
        o = peer.generate("invalid", prompt, **fields)  # type: ignore[arg-type]
        await self._wait(o)
        peer.bye()

    async def _malformed(self) -> None:
        peer = await self._peer()
        good = p.encode(p.Generate(1, p.TokenPrompt([1, 2, 3]), 4))
        frames: list[list[bytes]] = [
            [b""],
            [os.urandom(self.rng.randint(1, 64))],
            [good[: self.rng.randint(1, len(good) - 1)]],
            [msgspec.msgpack.encode([2, "not an id", 5])],
            [msgspec.msgpack.encode([99, 1])],
            [msgspec.msgpack.encode({"tag": 2})],
            [p.encode(p.Ping(1)), b"a second frame"],
        ]
        for frame in self.rng.sample(frames, 3):
            peer.send_frames(frame)
            self.counts["malformed frames sent"] += 1
        with anyio.move_on_after(10):  # each is answered with an Error; then leave
            while len(peer.connection_errors) < 3:
                await anyio.sleep(0.05)
        peer.bye()

    async def _oversized(self) -> None:
        peer = await self._peer()
        assert peer.welcome is not None
        peer.send_frames([b"\x92\x04" + b"\0" * (peer.welcome.max_message_bytes + 1)])
        self.counts["oversized frames sent"] += 1
        await anyio.sleep(1.0)  # the server drops the connection
        peer.kill()
        # ZeroMQ reconnected at once; the server rightly answers our pings NO_SESSION.
        self.counts["NO_SESSION after oversized"] += len(peer.connection_errors)
        peer.connection_errors.clear()

    async def _burst(self) -> None:
        peer = await self._peer()
        n = 2 * (self.slots + self.max_queue)
        sent = [
            peer.generate("burst", self._prompt(8), max_tokens=4, ignore_eos=True) for _ in range(n)
        ]
        self.counts["bursts"] += 1
        await self._wait(*sent)
        peer.bye()

    async def _slow(self) -> None:
        peer = await self._peer(rcvhwm=4)
        peer.reading = anyio.Event()  # stop reading
        sent = [
            peer.generate("slow", self._prompt(8), max_tokens=150, ignore_eos=True)
            for _ in range(3)
        ]
        self.counts["slow consumers"] += 1
        await anyio.sleep(self.rng.uniform(3, 10))
        peer.reading.set()
        await self._wait(*sent)
        peer.bye()

    async def _killed(self) -> None:
        peer = await self._peer()
        sent = [
            peer.generate("killed", self._prompt(), max_tokens=100, ignore_eos=True)
            for _ in range(3)
        ]
        await anyio.sleep(self.rng.uniform(0.05, 1.0))
        peer.kill()
        self.counts["connections killed"] += 1
        del sent

    async def _crashed(self) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-c", CRASHER, self.endpoint],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert proc.stdout is not None
        try:
            with anyio.move_on_after(60):
                line = await anyio.to_thread.run_sync(proc.stdout.readline, abandon_on_cancel=True)
                if line.strip() == b"streaming":
                    self.counts["client processes killed (SIGKILL)"] += 1
        finally:
            proc.send_signal(signal.SIGKILL)
            await anyio.to_thread.run_sync(proc.wait)
            proc.stdout.close()

    def _fault(self, kind: str) -> Callable[[], Awaitable[None]]:
        async def send() -> None:
            if kind in self._faulting:  # one at a time: its request id is fixed
                return
            self._faulting.add(kind)
            try:
                peer = await self._peer()
                o = peer.generate(kind, self._prompt(), rid=FAULT_RIDS[kind], max_tokens=8)
                await self._wait(o)
                peer.bye()
            finally:
                self._faulting.discard(kind)

        return send
