"""Every CUDA kernel the engine builds compiles (tools/nvrtc_check.py): NVRTC from NVIDIA's
pip wheels, no GPU needed — a kernel that does not compile is found here, not in a lease."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from engine.kernels import gdn_mixer_cuda

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import nvrtc_check  # noqa: E402

pytestmark = pytest.mark.skipif(
    nvrtc_check.installed() is None, reason="needs NVIDIA's NVRTC wheels (x86-64 Linux)"
)


def test_every_kernel_the_models_meet_compiles() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "nvrtc_check.py")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    compiled = [line for line in run.stdout.splitlines() if line.startswith("ok ")]
    families = {line.split()[1].rsplit("_", 1)[0] for line in compiled}
    # every kernel family the engine has, each met by the tiny models' steps
    want = {"add_rms_norm", "attention", "embed", "gdn_mixer", "gemv", "gemv_staged"}
    want |= {"stack", "swiglu", "take"}
    assert {f"slotserve_{f}" for f in want} <= families, families


def test_a_kernel_that_does_not_compile_is_reported_with_nvrtc_s_log() -> None:
    nvrtc = nvrtc_check.Nvrtc(nvrtc_check.installed())  # type: ignore[arg-type]
    good = "    out[0] = static_cast<T>(a[0]) + static_cast<T>(1.0f);"
    source = nvrtc_check.wrap(
        "k",
        good,
        ["a"],
        [mx.zeros((3,), mx.bfloat16)],
        ["out"],
        [mx.bfloat16],
        [("T", mx.bfloat16)],
    )
    assert nvrtc.compile("k", source) is None
    log = nvrtc.compile("k", source.replace("static_cast<T>(1.0f)", "undeclared_name"))
    assert log is not None and "undeclared_name" in log


def test_warps_a_block_by_the_launchs_size() -> None:
    """16 warps a block for a launch that leaves multiprocessors idle, 8 for a wide one,
    always a count that divides the head's rows (chosen on the host: checked here, where
    no GPU runs the CUDA tests)."""
    assert gdn_mixer_cuda.warps(16, 128) == 16  # N = 1 on the 0.8B shape
    assert gdn_mixer_cuda.warps(16 * 64, 128) == 8
    assert gdn_mixer_cuda.warps(16, 24) == 8  # 24 rows: 16 does not divide them
    assert gdn_mixer_cuda.warps(16, 5) == 1


@pytest.mark.parametrize("value", ["12", "32", "64", "eight", "-8"])
def test_a_warp_count_the_kernel_cannot_run_is_refused(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(gdn_mixer_cuda.WARPS_ENV, value)
    with pytest.raises(ValueError, match="SLOTSERVE_GDN_WARPS"):
        gdn_mixer_cuda.warps(16, 128)


@pytest.mark.parametrize("rows", [1, 8])
def test_every_norm_of_a_decode_step_runs_inside_a_product_kernel(
    make_model: Callable[..., Path], rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the fused paths on, a decode step's layers call no norm of their own: both
    add + norms of every layer — layer 0's first one too, its stream entering as zeros + the
    embedding — run in their product's kernel (kernels compiled by NVRTC, not run)."""
    from engine.cache import SlotPool
    from engine.kernels import gemv_cuda
    from engine.models import qwen35
    from engine.models.batch import Layout

    model = qwen35.load_model(make_model("tiny", quant="f32"), mx.bfloat16)
    pool = SlotPool(model.config, rows, 16, mx.bfloat16)
    slots = [pool.allocate() for _ in range(rows)]
    layout = Layout.build([1] * rows, [0] * rows, [False] * rows)
    calls = {"norm": 0, "fused": 0}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kw: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kw)

        return call

    monkeypatch.setattr(qwen35, "rms_norm", counted("norm", qwen35.rms_norm))
    monkeypatch.setattr(
        gemv_cuda, "add_norm_gemv_cuda", counted("fused", gemv_cuda.add_norm_gemv_cuda)
    )
    nvrtc = nvrtc_check.Nvrtc(nvrtc_check.installed())  # type: ignore[arg-type]
    with nvrtc_check.kernels_checked(nvrtc):
        states = SlotPool.split_states(model.config, pool.read(slots, 1))
        mx.eval(model(mx.array([3] * rows, dtype=mx.int32), layout, states)[0])
    assert calls == {"norm": 0, "fused": 2 * model.config.n_layer}
