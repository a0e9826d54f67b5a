"""bench/gpu_timeline.py's trace analysis, on a hand-made trace: steps are its annotations,
a kernel counts in the step it starts in, busy time is the union of kernel intervals."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from gpu_timeline import STEP, busy_us, main, short_name, summarize_trace  # noqa: E402


def _x(cat: str, name: str, ts: float, dur: float) -> dict[str, object]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_busy_time_is_the_union_of_overlapping_intervals() -> None:
    assert busy_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert busy_us([]) == 0


def test_kernel_names_group_without_templates_or_namespaces() -> None:
    assert short_name("void mlx::core::cu::gemv<float, 8>(float const*)") == "gemv"
    assert short_name("custom_kernel_slotserve_gdn_mixer_0_float_16") == (
        "custom_kernel_slotserve_gdn_mixer_0_float_16"
    )


def test_steps_count_their_own_kernels_gaps_and_launches() -> None:
    events = [
        _x("user_annotation", STEP, 0, 100),
        _x("user_annotation", STEP, 100, 50),
        _x("cuda_runtime", "cudaGraphLaunch", 5, 2),
        _x("kernel", "void a::gemv<1>()", 10, 20),
        _x("kernel", "void a::gemv<1>()", 25, 20),  # overlaps the first: busy 35, not 40
        {**_x("kernel", "norm", 60, 10), "args": {"grid": [8, 1, 1], "block": [256, 1, 1]}},
        _x("cuda_driver", "cuLaunchKernel", 101, 1),
        _x("cuda_driver", "cuLaunchKernel", 104, 1),
        _x("cuda_driver", "cuLaunchKernel", 111, 2),
        _x("cuda_runtime", "cudaEventRecord", 120, 4),
        {
            **_x("kernel", "norm", 110, 30),
            "args": {
                "grid": [8, 1, 1],
                "block": [256, 1, 1],
                "registers per thread": 96,
                "shared memory": 16384,
                "est. achieved occupancy %": 12,
            },
        },
        _x("kernel", "outside", 200, 5),
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 12},
    ]
    s = summarize_trace(events)
    assert s["steps"] == 2
    # medians over two steps take the larger of the two (index len // 2)
    assert s["wall_us"] == 100
    assert s["kernels"] == 3
    assert s["busy_us"] == 45
    assert s["idle_us"] == 55
    assert s["first_kernel_us"] == 10
    # step 2 launched three times: gaps 3 and 7, median (upper) 7; its API time 1 + 1 + 2 + 4
    assert s["graph_launches"] == 1 and s["kernel_launches"] == 3
    assert s["launch_gap_us"] == 7 and s["api_us"] == 8
    calls = {c["call"]: c for c in s["api"]}
    assert (
        calls["cuLaunchKernel"]["per_step"] == 1.5 and calls["cuLaunchKernel"]["us_per_step"] == 2
    )
    assert calls["cudaEventRecord"]["us_per_step"] == 2
    assert [k["kernel"] for k in s["last_step"]] == ["norm"]
    assert s["last_step"][0]["grid"] == "[8,1,1]x[256,1,1]"
    # what a launch holds on a multiprocessor, where CUPTI's args say it
    assert (s["last_step"][0]["regs"], s["last_step"][0]["smem"]) == (96, 16384)
    assert s["last_step"][0]["occupancy"] == 12
    top = {t["kernel"]: t for t in s["top"]}
    assert set(top) == {"gemv", "norm"}
    assert top["gemv"]["per_step"] == 1.0 and top["gemv"]["us_each"] == 20
    assert top["norm"]["us_per_step"] == 20 and top["norm"]["us_each"] == 20
    assert top["norm"]["grid"] == "[8,1,1]x[256,1,1]" and top["gemv"]["grid"] == "?x?"
    assert top["gemv"]["regs"] is None  # (its events have no args)
    assert top["norm"]["regs"] == 96 and top["norm"]["occupancy"] == 12


def test_decode_ahead_is_plain_decode_only() -> None:
    """--ahead times the scheduler's decode-ahead loop, which verify steps do not take."""
    with pytest.raises(SystemExit):
        main(["--ahead", "--verify", "2", "--n", "1"])
    with pytest.raises(SystemExit):  # --sampled draws in the plain loop only
        main(["--sampled", "--ahead", "--n", "1"])


def _stand_in_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's profiler, standing in for the real one (not installed here; on the GPU machine
    CUPTI records the kernels): it records nothing and exports an empty trace."""
    import contextlib
    import json
    import types

    torch = types.ModuleType("torch")
    torch.zeros = lambda *a, **k: None  # type: ignore[attr-defined]
    profiler = types.ModuleType("torch.profiler")

    class Profile:
        def __init__(self, **kwargs: object) -> None:
            pass

        def __enter__(self) -> Profile:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def export_chrome_trace(self, path: str) -> None:
            Path(path).write_text(json.dumps({"traceEvents": []}))

    profiler.profile = Profile  # type: ignore[attr-defined]
    profiler.record_function = lambda name: contextlib.nullcontext()  # type: ignore[attr-defined]
    profiler.ProfilerActivity = types.SimpleNamespace(CPU=0, CUDA=1)  # type: ignore[attr-defined]
    torch.profiler = profiler  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.profiler", profiler)


@pytest.mark.parametrize(
    "mode",
    [[], ["--ahead"], ["--verify", "2"], ["--sampled"]],
    ids=["plain", "ahead", "verify", "sampled"],
)
def test_its_step_loops_run_on_a_tiny_model(
    mode: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loops the profiler wraps (plain steps, the decode-ahead loop, verify steps with
    rollback) run on this CPU's tiny model — what a lease would otherwise find broken."""
    _stand_in_torch(monkeypatch)
    args = ["--preset", "tiny", "--quant", "f32", "--dtype", "f32", "--model-dir", str(tmp_path)]
    args += ["--n", "1,3", "--steps", "2", "--warmup", "1", "--prompt", "8"]
    result = main([*args, "--trace-dir", str(tmp_path / "trace"), *mode])
    assert set(result["by_n"]) == {"1", "3"}
    assert all(s["unprofiled_step_ms"] > 0 for s in result["by_n"].values())
