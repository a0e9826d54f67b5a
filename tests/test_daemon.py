"""`slotserve serve` as operators run it: a real subprocess, real sockets, real signals."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from transport import cpus
from transport import protocol as p
from transport.client import Client, Completion, ConnectionLost, RequestError
from transport.daemon.demo import Supervised
from transport.metrics import free_port, scrape


@pytest.fixture(scope="module")
def model(make_model: Callable[..., Path]) -> Path:
    return make_model("tiny")


def serve_args(model: Path, endpoint: str, *extra: str) -> list[str]:
    return ["--model", str(model), "--endpoints", endpoint, "--context", "256", *extra]


async def run_requests(
    endpoint: str, n: int, max_tokens: int, on_all_started: Callable[[], None]
) -> tuple[dict[int, str], p.ErrorCode | None]:
    """`n` greedy requests on one connection; once each has a first token, call
    `on_all_started`, wait for the server to say DRAINING and try one more request.
    Returns each request's terminal ("finished" or an error code's name) and the code
    the late request got."""
    outcomes: dict[int, str] = {}
    started: set[int] = set()
    all_started = anyio.Event()

    async def one(client: Client, i: int) -> None:
        stream = client.generate([1 + i, 2, 3], max_tokens=max_tokens, ignore_eos=True)
        try:
            async for _ in stream:
                started.add(i)
                if len(started) == n:
                    all_started.set()
            outcomes[i] = "finished" if stream.finished is not None else "none"
        except RequestError as e:
            outcomes[i] = e.code.name
        except ConnectionLost:
            outcomes[i] = "lost"

    async with Client.connect(endpoint) as client, anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, client, i)
        with anyio.fail_after(30):
            await all_started.wait()
        on_all_started()
        with anyio.fail_after(10):
            while (await client.stats()).state != p.ServerState.DRAINING:
                await anyio.sleep(0.01)
        late: p.ErrorCode | None = None
        try:
            await client.complete("too late", max_tokens=2)
        except RequestError as e:
            late = e.code
    return outcomes, late


def test_sigterm_lets_all_20_running_requests_finish_and_exits_0(
    model: Path, tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path}/d.sock"
    args = serve_args(model, endpoint, "--slots", "20", "--metrics-address", "")
    with Supervised(args, endpoint) as daemon:
        outcomes, late = anyio.run(
            run_requests, endpoint, 20, 200, lambda: daemon.signal(signal.SIGTERM)
        )
        status = daemon.wait()
    assert outcomes == {i: "finished" for i in range(20)}
    assert late == p.ErrorCode.SHUTTING_DOWN
    assert status == 0


def test_requests_still_running_past_the_drain_timeout_end_with_shutting_down(
    model: Path, tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path}/d.sock"
    args = ["--model", str(model), "--endpoints", endpoint, "--context", "4096"]
    args += ["--slots", "4", "--metrics-address", "", "--drain-timeout", "0.2"]
    with Supervised(args, endpoint) as daemon:
        outcomes, _ = anyio.run(
            run_requests, endpoint, 4, 4000, lambda: daemon.signal(signal.SIGTERM)
        )
        status = daemon.wait()
    assert outcomes == {i: "SHUTTING_DOWN" for i in range(4)}
    assert status == 0


def test_a_second_signal_exits_at_once(model: Path, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/d.sock"
    args = ["--model", str(model), "--endpoints", endpoint, "--context", "4096"]
    args += ["--slots", "2", "--metrics-address", "", "--drain-timeout", "600"]

    async def signal_twice_while_draining(daemon: Supervised) -> float:
        async with Client.connect(endpoint) as client:
            streams = [client.generate([i + 1, 2], max_tokens=4000) for i in range(2)]
            for stream in streams:
                await stream.next_delta()
            daemon.signal(signal.SIGTERM)
            while (await client.stats()).state != p.ServerState.DRAINING:
                await anyio.sleep(0.01)
            daemon.signal(signal.SIGINT)
            t0 = time.monotonic()
            assert daemon.proc is not None
            await anyio.to_thread.run_sync(daemon.proc.wait, 10)
            return time.monotonic() - t0

    with Supervised(args, endpoint) as daemon:
        elapsed = anyio.run(signal_twice_while_draining, daemon)
        status = daemon.wait()
    assert status == 1 and elapsed < 5


def test_the_metrics_endpoint_counts_the_traffic(model: Path, tmp_path: Path) -> None:
    endpoint, port = f"ipc://{tmp_path}/d.sock", free_port()
    args = serve_args(model, endpoint, "--metrics-address", f"127.0.0.1:{port}")

    async def three_requests() -> None:
        async with Client.connect(endpoint) as client:
            for i in range(3):
                await client.complete([i + 1, 2, 3, 4], max_tokens=8, ignore_eos=True)

    with Supervised(args, endpoint):
        before = scrape(port)
        anyio.run(three_requests)
        deadline = time.monotonic() + 5
        after = scrape(port)
        while (
            after["slotserve_generated_tokens_total"]
            < before["slotserve_generated_tokens_total"] + 24
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
            after = scrape(port)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert moved("slotserve_generated_tokens_total") == 24
    assert moved("slotserve_prompt_tokens_total") == 12
    assert moved("slotserve_requests_total{outcome=length}") == 3
    assert moved("slotserve_requests_submitted_total") == 3
    assert moved("slotserve_ttft_seconds_count") == 3
    assert moved("slotserve_itl_seconds_count") == 3 * 7
    assert moved("slotserve_step_seconds_count") >= 8
    assert moved("slotserve_prefix_cache_lookups_total") == 3  # on by default; prompts too short
    # MLX's memory: the weights and the pool are live arrays; the peak holds at least them
    assert after["slotserve_mlx_active_bytes"] > 0
    assert after["slotserve_mlx_peak_bytes"] >= after["slotserve_mlx_active_bytes"]
    assert "slotserve_mlx_cache_bytes" in after
    assert after["slotserve_prefix_cache_budget_bytes"] == 1 << 30
    depth_steps = [k for k in after if k.startswith("slotserve_spec_depth_steps_total")]
    # 7 decode tokens each; a step that accepts drafts commits more than one of them
    accepted = moved("slotserve_spec_accepted_tokens_total")
    assert sum(moved(k) for k in depth_steps) == 3 * 7 - accepted
    # the cost controller's state is exported (its values: test_scheduler's staggered test)
    for name in ("held_steps_total", "stalls_total", "credit_seconds"):
        assert f"slotserve_spec_{name}" in after
    assert after["slotserve_active_slots"] == 0 and after["slotserve_queue_depth"] == 0


def test_decode_ahead_steps_are_counted_in_the_metrics(model: Path, tmp_path: Path) -> None:
    """`decode_ahead = "on"` ("auto" is off on a CPU), speculation off, one request at a
    time: from a request's second decode step on, each step was queued during the one before
    and taken — none dropped (a request's last step queues nothing) — and the metrics say so."""
    endpoint, port = f"ipc://{tmp_path}/d.sock", free_port()
    args = serve_args(model, endpoint, "--metrics-address", f"127.0.0.1:{port}")
    args += ["--decode-ahead", "on", "--speculation", "off"]

    async def two_requests() -> None:
        async with Client.connect(endpoint) as client:
            for i in range(2):
                await client.complete([i + 1, 2, 3, 4], max_tokens=8, ignore_eos=True)

    with Supervised(args, endpoint):
        anyio.run(two_requests)
        deadline = time.monotonic() + 5
        while (got := scrape(port))["slotserve_generated_tokens_total"] < 16:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    # 8 tokens: the prefill's, then 7 decode steps, of which the last 6 were queued ahead
    assert got["slotserve_decode_ahead_taken_total"] == 2 * 6
    assert got["slotserve_decode_ahead_dropped_total"] == 0


def test_a_dflash_drafter_drafts_at_every_step_and_leaves_greedy_output_unchanged(
    make_model: Callable[..., Path], make_dflash: Callable[..., Path], tmp_path: Path
) -> None:
    """Each prompt runs with speculation on (a random drafter's drafts are rejected, so
    `auto` would soon stop drafting) and off, at once. With no MTP head, and prompts
    that repeat no token (no n-gram match), the drafts are the DFlash drafter's; a step
    may draft while two or more tokens remain."""
    model = make_model("tiny", mtp=False)
    endpoint, log = f"ipc://{tmp_path}/d.sock", tmp_path / "slotserve.log"
    args = serve_args(model, endpoint, "--slots", "6", "--metrics-address", "")
    args += ["--dflash", str(make_dflash("tiny")), "--log-file", str(log)]
    prompts = [[10 * i + j for j in range(1, 8)] for i in range(1, 4)]
    n = 12

    async def each_prompt_on_and_off() -> dict[p.Speculation, dict[int, Completion]]:
        out: dict[p.Speculation, dict[int, Completion]] = {p.Speculation.ON: {}}
        out[p.Speculation.OFF] = {}

        async def one(client: Client, i: int, mode: p.Speculation) -> None:
            out[mode][i] = await client.complete(
                prompts[i], max_tokens=n, temperature=0.0, ignore_eos=True, speculation=mode
            )

        async with Client.connect(endpoint) as client, anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                for mode in out:
                    tg.start_soon(one, client, i, mode)
        return out

    with Supervised(args, endpoint):
        runs = anyio.run(each_prompt_on_and_off)
    on, off = runs[p.Speculation.ON], runs[p.Speculation.OFF]
    assert {i: c.tokens for i, c in on.items()} == {i: c.tokens for i, c in off.items()}
    for c in on.values():
        spec = c.finished.speculation
        assert spec.drafted > 0 and spec.verify_steps >= spec.decode_steps - 1
    assert all(c.finished.speculation.drafted == 0 for c in off.values())
    assert "DFlash drafter" in log.read_text()


def test_dense_weights_serve_what_the_stored_quantized_ones_do(
    make_model: Callable[..., Path], tmp_path: Path
) -> None:
    """`weights = "dense"` dequantizes a q8_0 file's matrices at load: a daemon so started
    says so and serves the greedy tokens of one that keeps them quantized."""
    model = make_model("tiny", quant="q8_0")
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44], [9]]

    async def greedy(endpoint: str) -> list[list[int]]:
        async with Client.connect(endpoint) as client:
            return [
                (await client.complete(pr, max_tokens=12, temperature=0.0, ignore_eos=True)).tokens
                for pr in prompts
            ]

    tokens = {}
    for weights in ("stored", "dense"):
        endpoint, log = f"ipc://{tmp_path}/{weights}.sock", tmp_path / f"{weights}.log"
        args = serve_args(model, endpoint, "--metrics-address", "", "--weights", weights)
        with Supervised([*args, "--log-file", str(log)], endpoint):
            tokens[weights] = anyio.run(greedy, endpoint)
        assert f"{weights} weights" in log.read_text()
    assert tokens["dense"] == tokens["stored"]


def test_sighup_reopens_the_log_file_and_the_pid_file_lives_as_long_as_the_process(
    model: Path, tmp_path: Path
) -> None:
    endpoint, log = f"ipc://{tmp_path}/d.sock", tmp_path / "slotserve.log"
    pid_file = tmp_path / "slotserve.pid"
    args = serve_args(model, endpoint, "--metrics-address", "", "--log-format", "json")
    args += ["--log-file", str(log), "--pid-file", str(pid_file)]
    with Supervised(args, endpoint) as daemon:
        assert daemon.proc is not None
        assert pid_file.read_text() == f"{daemon.proc.pid}\n"
        log.rename(tmp_path / "slotserve.log.1")
        daemon.signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while not (log.exists() and "reopened" in log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert daemon.returncode == 0 and not pid_file.exists()
    rotated = [json.loads(line) for line in (tmp_path / "slotserve.log.1").read_text().splitlines()]
    assert any(entry["msg"].startswith("ready") for entry in rotated)
    fresh = [json.loads(line)["msg"] for line in log.read_text().splitlines()]
    assert fresh[0].startswith("SIGHUP: reopened") and fresh[-1] == "stopped"


def test_cpus_pin_every_thread_of_the_daemon(model: Path, tmp_path: Path) -> None:
    """The affinity is set before MLX's, ZeroMQ's and the step thread start, so every thread
    of the serving process keeps to the set, not only the main one."""
    endpoint, cpu = f"ipc://{tmp_path}/d.sock", max(cpus.allowed())
    args = serve_args(model, endpoint, "--metrics-address", "", "--cpus", str(cpu))

    async def one_request() -> None:
        async with Client.connect(endpoint) as client:
            await client.complete([1, 2, 3], max_tokens=4, ignore_eos=True)

    with Supervised(args, endpoint) as daemon:
        anyio.run(one_request)  # the step thread and the rest are running now
        assert daemon.proc is not None
        tasks = list(Path(f"/proc/{daemon.proc.pid}/task").iterdir())
        lists = [
            line.split(":")[1].strip()
            for t in tasks
            for line in (t / "status").read_text().splitlines()
            if line.startswith("Cpus_allowed_list:")
        ]
    assert len(tasks) >= 3 and lists == [str(cpu)] * len(tasks)


def test_a_bad_config_file_exits_2_naming_the_key(model: Path, tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(f'model = "{model}"\nslots = 0\n')
    done = subprocess.run(
        [sys.executable, "-m", "transport.cli", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "slots: expected an integer >= 1" in done.stderr and str(config) in done.stderr


SYSTEMD_UNIT = Path(__file__).parent.parent / "deploy" / "slotserve.service"


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)
def test_the_systemd_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """The unit as shipped, with ExecStart pointed at this checkout's `slotserve` (verify
    checks that the command exists; the shipped path is the install location)."""
    slotserve = Path(sys.executable).parent / "slotserve"
    unit = tmp_path / "slotserve.service"
    unit.write_text(
        SYSTEMD_UNIT.read_text().replace("/opt/slotserve/.venv/bin/slotserve", str(slotserve))
    )
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
