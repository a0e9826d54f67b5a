"""The load generator against a real server: closed and open loop, the report, the CLI."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from serving import Tiny, load_tiny, new_scheduler, serve, serve_scheduler

from scheduler import SchedulerConfig
from transport import cli, loadgen, loadreport


@pytest.fixture(scope="module")
def tiny(make_model: Callable[..., Path]) -> Tiny:
    return load_tiny(make_model("tiny"))


async def test_the_loadgen_command_reports_a_closed_loop_run_as_table_json_and_plot(
    tiny: Tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    async with serve(tiny, [f"ipc://{tmp_path}/s.sock"]) as (_, (address,)):
        argv = ["loadgen", address, "--concurrency", "6", "--requests", "24", "--max-tokens", "8"]
        argv += ["--prompt-tokens", "5", "--json", f"{out}/run.json", "--plot", f"{out}/run.png"]
        code = await anyio.to_thread.run_sync(cli.main, argv)
    assert code == 0
    printed = capsys.readouterr()
    assert "load: closed loop, concurrency 6" in printed.out
    assert "requests         24  ok 24  rejected 0  errors 0" in printed.out
    for row in ("TTFT", "ITL", "end to end"):
        assert row in printed.out
    assert "100.0%" in printed.err  # the progress bar ran to its end
    doc = json.loads((out / "run.json").read_text())
    assert doc["summary"]["ok"] == 24 and doc["summary"]["output_tokens"] == 24 * 8
    assert len(doc["requests"]) == 24 and all(r["prompt_tokens"] == 5 for r in doc["requests"])
    assert (out / "run.png").read_bytes()[:4] == b"\x89PNG"


async def test_an_open_loop_past_saturation_counts_rejects_apart_from_errors(
    tiny: Tiny, tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    lines = ['{"prompt": "the cat"}', '{"tokens": [1, 2, 3], "max_tokens": 4}', ""]
    lines.append('{"messages": [{"role": "user", "content": "hi"}]}')
    prompts.write_text("\n".join(lines))
    scheduler = new_scheduler(tiny, n_slots=1, config=SchedulerConfig(max_queue=1))
    async with serve_scheduler(scheduler, [f"ipc://{tmp_path}/s.sock"]) as (_, (address,)):
        config = loadgen.LoadConfig(address, rate=200.0, requests=30, connections=2)
        records = await loadgen.run_load(config, prompts, 0, 12, progress=None)
    summary = loadreport.summarize(config, records)
    assert summary.requests == 30 and summary.errors == 0
    assert summary.rejected > 0 and summary.ok + summary.rejected == 30
    assert {r.tokens for r in records if r.outcome == "ok"} <= {4, 12}
    assert summary.ttft.samples == summary.ok and summary.e2e.p99 >= summary.e2e.p50


def test_a_prompts_file_without_prompts_is_refused_with_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    with pytest.raises(loadgen.LoadgenError, match=r"bad\.jsonl:2"):
        loadgen.jsonl_workloads(bad, 8)
