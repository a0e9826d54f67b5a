"""`slotserve demo`: a daemon on the demo model, the load generator against it, a few
completions printed as text, a clean stop.

`Supervised` (a `slotserve serve` subprocess that is ready once its Stats say
READY) is also what the daemon's tests start.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import anyio
import zmq

from transport import blas, loadgen, loadreport
from transport import protocol as p
from transport.client import SyncClient
from transport.sockets import resolve_endpoint

# trained by tools/demo_model (docs/MODEL.md), committed in the repository
DEMO_MODEL = Path(__file__).resolve().parents[2] / "models" / "slotserve-demo.gguf"

# Beginnings of Python source, what the demo model was trained on: the load cycles through
# them and the first few are completed and printed at the end.
DEMO_PROMPTS = (
    "def read_config(path):\n",
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
    "import os\nimport sys\n\n\ndef main(argv=None):\n",
    "    def __repr__(self):\n",
    "try:\n    import threading\nexcept ImportError:\n",
    'def _is_valid_name(name):\n    """',
    "for i, line in enumerate(lines):\n",
    "with open(filename, 'rb') as f:\n",
)


class DaemonFailed(RuntimeError):
    """The daemon exited, or did not become ready in time."""


class Supervised:
    """`with Supervised(serve_args) as daemon:` runs `slotserve serve *serve_args` and waits
    until it is READY; leaving the block stops it with SIGTERM (killing it if it does not
    exit within `stop_timeout_s`). `returncode` holds its exit status afterwards. `env`:
    the daemon's environment (default: this process's)."""

    def __init__(
        self,
        serve_args: Sequence[str],
        endpoint: str,
        ready_timeout_s: float = 120.0,
        stop_timeout_s: float = 60.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.env = env
        self.argv = [sys.executable, "-m", "transport.cli", "serve", *serve_args]
        self.endpoint = endpoint
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._probe: zmq.Socket[bytes] | None = None

    def __enter__(self) -> Supervised:
        self.proc = subprocess.Popen(self.argv, env=self.env)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def stop(self) -> int:
        """SIGTERM (unless it already exited) and wait; returns the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait()

    def wait(self) -> int:
        """Wait for the exit (killing it past `stop_timeout_s`); returns the exit status."""
        assert self.proc is not None
        try:
            self.returncode = self.proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.returncode = self.proc.wait()
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        if not self._context.closed:
            self._context.term()
        return self.returncode

    def _wait_ready(self) -> None:
        """Ask for Stats over one raw connection until they say READY.

        The connection stays open while the daemon runs: the server tells sessions apart
        by socket fd, and a probe that disconnected just before the caller connects can
        have its late disconnect event taken for the caller's (same, reused) fd.
        """
        assert self.proc is not None
        self._probe = probe = self._context.socket(zmq.DEALER)
        probe.setsockopt(zmq.LINGER, 0)
        probe.connect(resolve_endpoint(self.endpoint))
        probe.send(p.encode(p.Hello(p.PROTOCOL_MAJOR, p.PROTOCOL_MINOR, "supervisor")))
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DaemonFailed(f"the daemon exited with status {self.proc.returncode}")
            if probe.poll(200):
                msg = p.decode_server(probe.recv())
                if isinstance(msg, p.Stats) and msg.state == p.ServerState.READY:
                    return
                if not isinstance(msg, p.Welcome | p.Stats):
                    raise DaemonFailed(f"the daemon answered the probe with {msg}")
                time.sleep(0.05)
                probe.send(p.encode(p.GetStats()))
        raise DaemonFailed(f"the daemon was not ready within {self.ready_timeout_s:.0f} s")


def ensure_model(path: Path, preset_name: str = "demo") -> Path:
    """The model at `path`, written from the writer's preset if it is missing (random
    weights, for tests and benchmarks)."""
    if not path.exists():
        from engine.writer import preset, write_model

        print(f"writing the {preset_name} model to {path}", file=sys.stderr)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_model(path, preset(preset_name))
    return path


def run_demo(model: Path, duration_s: float, concurrency: int, max_tokens: int, slots: int) -> int:
    """Start a daemon on `model`, load it for `duration_s` with `DEMO_PROMPTS`, print the
    load report and a few sampled completions, stop it. Returns 0 when the daemon drained
    and exited cleanly."""
    if not model.exists():
        fix = "`git checkout models/` restores it, " if model == DEMO_MODEL else ""
        raise FileNotFoundError(
            f"{model}: the demo model is missing ({fix}docs/MODEL.md says how it is made)"
        )
    with tempfile.TemporaryDirectory(prefix="slotserve-demo-") as tmp:
        endpoint = f"ipc://{tmp}/demo.sock"
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in DEMO_PROMPTS))
        args = ["--model", str(model), "--endpoints", endpoint, "--slots", str(slots)]
        args += ["--context", "1024", "--metrics-address", "", "--drain-timeout", "10"]
        args += fast_cpu_settings()
        print(f"slotserve demo: serve {' '.join(args)}", file=sys.stderr)
        with Supervised(args, endpoint) as daemon:
            config = loadgen.LoadConfig(
                endpoint, concurrency=concurrency, duration_s=duration_s, connections=2
            )
            records = anyio.run(loadgen.run_load, config, prompts, 32, max_tokens, sys.stderr)
            print(loadreport.table(loadreport.summarize(config, records)))
            print_samples(endpoint, DEMO_PROMPTS[:3], max_tokens)
        status = daemon.returncode
    print(f"daemon stopped with status {status}", file=sys.stderr)
    return 0 if status == 0 else 1


def fast_cpu_settings() -> list[str]:
    """The demo model is small enough to serve dense (f32) and on OpenBLAS — Debian's where
    installed, else numpy's through its shim where one can be built: a one-token step 1.6x
    faster than the stored q8_0 on MLX's bundled BLAS and a second token in a row 6% more
    instead of 85% (`bench/row_cost.py`, docs/PERFORMANCE.md); on a GPU neither matters."""
    args = ["--weights", "dense"]
    choice = blas.best()  # (named, not "auto": the printed arguments say which)
    return args if choice == blas.BUNDLED else [*args, "--blas", choice]


def print_samples(endpoint: str, prompts: Sequence[str], max_tokens: int) -> None:
    """Completions of `prompts` streamed to stdout as the daemon sends them: sampled at
    temperature 0.7 with fixed seeds (a 19M-parameter model's greedy text soon repeats)."""
    with SyncClient(endpoint, name="demo-samples") as client:
        for seed, prompt in enumerate(prompts):
            print(f"\n--- temperature 0.7, seed {seed}, {max_tokens} tokens at most ---")
            print(prompt, end="")
            for delta in client.generate(prompt, max_tokens=max_tokens, temperature=0.7, seed=seed):
                print(delta.text, end="", flush=True)
            print()
