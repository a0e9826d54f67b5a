"""Every CUDA kernel the engine builds compiles (tools/nvrtc_check.py): NVRTC from NVIDIA's
pip wheels, no GPU needed — a kernel that does not compile is found here, not in a lease."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from engine.gguf import QuantizedWeight
from engine.kernels import gdn_mixer_cuda

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import nvrtc_check  # noqa: E402

pytestmark = pytest.mark.skipif(
    nvrtc_check.installed() is None, reason="needs NVIDIA's NVRTC wheels (x86-64 Linux)"
)


# the switches whose other side builds other kernels (or other variants of one): those too
OTHER_SIDES = {
    "SLOTSERVE_ATTENTION_DECODE": "0",
    "SLOTSERVE_FUSED_GEMV_DENSE": "mma",
    "SLOTSERVE_GEMV_MMA_DIRECT": "0",
}


@pytest.mark.parametrize("switches", [{}, OTHER_SIDES], ids=["defaults", "other_sides"])
def test_every_kernel_the_models_meet_compiles(switches: dict[str, str]) -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "nvrtc_check.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **switches},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    compiled = [line for line in run.stdout.splitlines() if line.startswith("ok ")]
    families = {line.split()[1].rsplit("_", 1)[0] for line in compiled}
    # every kernel family the engine has, each met by the tiny models' steps
    want = {"add_rms_norm", "attention", "embed", "gdn_mixer", "gemv", "gemv_mma", "gemv_staged"}
    want |= {"stack", "swiglu", "take"}
    assert {f"slotserve_{f}" for f in want} <= families, families
    # each side's own variants were built: the decode attention kernel (rotation and keys a
    # block: ROPE_DIM and U) and tensor-core products that make x in the product (DIRECT=1)
    # on the defaults' side only
    decode = [x for x in compiled if "attention_" in x and "ROPE_DIM=" in x and ",U=" in x]
    direct = [x for x in compiled if "gemv_mma_" in x and "DIRECT=1" in x]
    assert bool(decode) != bool(switches) and bool(direct) != bool(switches)


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


def test_tensor_core_products_by_dtype_and_their_warps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged products take the tensor-core kernel for 16-bit float weights in x's dtype
    and K in rounds of 32; "auto" splits K until a product has ~1,024 warps, each left 8
    rounds at least (chosen on the host: checked here)."""
    from engine.kernels import gemv_cuda

    monkeypatch.delenv(gemv_cuda.MMA_ENV, raising=False)
    bf = mx.zeros((64, 1024), mx.bfloat16)
    assert gemv_cuda.mma_takes(8, 1024, mx.bfloat16, bf)
    assert gemv_cuda.mma_takes(1, 1024, mx.bfloat16, bf)
    assert not gemv_cuda.mma_takes(9, 1024, mx.bfloat16, bf)
    assert not gemv_cuda.mma_takes(8, 1024, mx.float16, bf)  # mixed dtypes
    assert not gemv_cuda.mma_takes(8, 1024, mx.float32, bf.astype(mx.float32))
    assert not gemv_cuda.mma_takes(8, 1000, mx.bfloat16, mx.zeros((64, 1000), mx.bfloat16))
    q, s, b = mx.quantize(mx.zeros((64, 1024)), group_size=32, bits=8)
    assert not gemv_cuda.mma_takes(
        8, 1024, mx.bfloat16, QuantizedWeight(q, s, b, 8, 32, (64, 1024))
    )
    monkeypatch.setenv(gemv_cuda.MMA_ENV, "0")
    assert not gemv_cuda.mma_takes(8, 1024, mx.bfloat16, bf)
    monkeypatch.setenv(gemv_cuda.MMA_ENV, "yes")
    with pytest.raises(ValueError, match="SLOTSERVE_GEMV_MMA"):
        gemv_cuda.mma_takes(8, 1024, mx.bfloat16, bf)
    assert gemv_cuda.mma_split(7168, 1024) == 4  # gate|up: 448 warps of 16 outputs -> 1,792
    assert gemv_cuda.mma_split(8224, 1024) == 2  # the GDN input: 514 -> 1,028
    assert gemv_cuda.mma_split(1024, 3584) == 8  # down: 64 -> 512 (8 at most)
    assert gemv_cuda.mma_split(1024, 1024) == 4  # 8 rounds of 32 each at most
    assert gemv_cuda.mma_split(40, 96) == 1


@pytest.mark.parametrize("value", ["12", "32", "64", "eight", "-8"])
def test_a_warp_count_the_kernel_cannot_run_is_refused(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(gdn_mixer_cuda.WARPS_ENV, value)
    with pytest.raises(ValueError, match="SLOTSERVE_GDN_WARPS"):
        gdn_mixer_cuda.warps(16, 128)


@pytest.mark.parametrize("rows", [1, 8, 16])  # (16: SLOTSERVE_GEMV_MMA_ROWS=16)
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

    if rows > gemv_cuda.MAX_ROWS:
        monkeypatch.setenv(gemv_cuda.MMA_ROWS_ENV, "16")

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


def test_blocks_share_k_of_a_narrow_direct_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """SLOTSERVE_GEMV_MMA_BLOCKS=auto: the 0.8B's down projection (1,024 x 3,584, 8 warps a
    column group) has its K shared by 2 blocks — chosen from the shape alone, the same at
    every row count — and that kernel compiles (the GPU test runs it: tests/
    test_gemv_prologue_cuda.py); wide products, and every product under "1", keep one block."""
    from engine.kernels import gemv_cuda

    monkeypatch.setenv(gemv_cuda.MMA_BLOCKS_ENV, "1")
    assert gemv_cuda.mma_blocks(1024, 3584, 8) == 1
    monkeypatch.delenv(gemv_cuda.MMA_BLOCKS_ENV)
    assert gemv_cuda.mma_blocks(1024, 3584, 8) == 2  # "auto", the default since session 22
    assert gemv_cuda.mma_blocks(7168, 1024, 4) == 1  # gate|up: 1,792 warps already
    assert gemv_cuda.mma_blocks(1024, 512, 2) == 2  # until a warp would keep < 4 rounds
    assert gemv_cuda.mma_blocks(256, 4096, 8) == 4
    monkeypatch.setenv(gemv_cuda.MMA_BLOCKS_ENV, "2")
    with pytest.raises(ValueError, match="SLOTSERVE_GEMV_MMA_BLOCKS"):
        gemv_cuda.mma_blocks(1024, 3584, 8)
    monkeypatch.setenv(gemv_cuda.MMA_BLOCKS_ENV, "auto")
    nvrtc_check.Checked.seen.clear()
    nvrtc = nvrtc_check.Nvrtc(nvrtc_check.installed())  # type: ignore[arg-type]
    with nvrtc_check.kernels_checked(nvrtc):
        for rows in (1, 8):
            gu = mx.zeros((rows, 2 * 3584), mx.bfloat16)
            out = gemv_cuda.swiglu_gemv_cuda(gu, mx.zeros((1024, 3584), mx.bfloat16))
            assert out.shape == (rows, 1024)
    built = {t: log for t, log in nvrtc_check.Checked.seen.items() if "int BS = 2;" in t}
    assert built and all(log is None for log in built.values()), built  # (R = 8; 1 row: CUDA cores)


def test_nine_to_sixteen_rows_take_tensor_cores_only_where_switched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SLOTSERVE_GEMV_MMA_ROWS=16: 9-16 rows of 16-bit float products fit the tensor-core
    kernel (and nothing else: not the CUDA-core kernels, whose sums are R x OUTS registers,
    nor a quantized matrix); "8", the default, none. The 0.8B's 16-row variants compile —
    warps sharing K (gate|up's add + norm, split 4), blocks sharing K (down, 2 blocks) —
    the GPU test runs them (tests/test_gemv_prologue_cuda.py)."""
    from engine.kernels import gemv_cuda

    bf = mx.zeros((7168, 1024), mx.bfloat16)
    q, sc, b = mx.quantize(mx.zeros((64, 1024)), group_size=32, bits=8)
    q8 = QuantizedWeight(q, sc, b, 8, 32, (64, 1024))
    x16 = mx.zeros((16, 1024), mx.bfloat16)
    nvrtc_check.Checked.seen.clear()
    nvrtc = nvrtc_check.Nvrtc(nvrtc_check.installed())  # type: ignore[arg-type]
    with nvrtc_check.kernels_checked(nvrtc):  # (the fused paths on, as on a GPU)
        monkeypatch.delenv(gemv_cuda.MMA_ROWS_ENV, raising=False)
        assert gemv_cuda.mma_rows() == 8 and not gemv_cuda.fits(x16, bf)
        assert not gemv_cuda.takes_prologue(16, 1024, mx.bfloat16, bf)
        monkeypatch.setenv(gemv_cuda.MMA_ROWS_ENV, "16")
        assert gemv_cuda.mma_takes(16, 1024, mx.bfloat16, bf)
        assert not gemv_cuda.mma_takes(17, 1024, mx.bfloat16, bf)
        assert gemv_cuda.fits(x16, bf) and gemv_cuda.takes_prologue(16, 1024, mx.bfloat16, bf)
        assert not gemv_cuda.fits(x16.astype(mx.float32), bf.astype(mx.float32))
        assert not gemv_cuda.fits(x16, q8)
        monkeypatch.setenv(gemv_cuda.DENSE_ENV, "rows")  # a plain product past 8 rows: not here
        assert not gemv_cuda.dense_takes(x16, bf)
        monkeypatch.delenv(gemv_cuda.DENSE_ENV)
        monkeypatch.setenv(gemv_cuda.MMA_ROWS_ENV, "12")
        with pytest.raises(ValueError, match="SLOTSERVE_GEMV_MMA_ROWS"):
            gemv_cuda.mma_rows()
        monkeypatch.setenv(gemv_cuda.MMA_ROWS_ENV, "16")
        for rows in (12, 16):
            x = mx.zeros((rows, 1024), mx.bfloat16)
            norm = mx.ones((1024,), mx.float32)
            h, out = gemv_cuda.add_norm_gemv_cuda(x, x, norm, 1e-6, bf)
            assert h.shape == (rows, 1024) and out.shape == (rows, 7168)
            gu = mx.zeros((rows, 2 * 3584), mx.bfloat16)
            out = gemv_cuda.swiglu_gemv_cuda(gu, mx.zeros((1024, 3584), mx.bfloat16))
            assert out.shape == (rows, 1024)
    built = {t: log for t, log in nvrtc_check.Checked.seen.items() if "slotserve_gemv_mma" in t}
    assert len(built) == 4 and all(log is None for log in built.values()), built
    assert any("int BS = 2;" in t for t in built)


def test_the_topk_kernel_compiles_and_a_sampled_top_k_row_takes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SLOTSERVE_TOPK=1: the radix select compiles for float32 and bf16 rows (the GPU test
    runs it: tests/test_topk_cuda.py), and a top-k row's draw finds its candidates through
    it (float16 logits: a variant only that draw builds); off, the draw builds none."""
    from engine import sampling
    from engine.kernels import topk_cuda

    params = [sampling.SamplingParams(temperature=0.7, top_k=20, top_p=0.8)] * 2
    logits = mx.zeros((2, 5000), mx.float16)
    nvrtc = nvrtc_check.Nvrtc(nvrtc_check.installed())  # type: ignore[arg-type]
    mx.disable_compile()  # (the draws eager: MLX's own compiles on this CPU take seconds)
    try:
        with nvrtc_check.kernels_checked(nvrtc):
            for on in ("0", "1"):
                monkeypatch.setenv(topk_cuda.ENV, on)
                nvrtc_check.Checked.seen.clear()
                sampling.device_tokens(logits, params, [0.5, 0.5])
                drawn = [t for t in nvrtc_check.Checked.seen if "slotserve_topk" in t]
                assert len(drawn) == int(on) and all("__half" in t for t in drawn), drawn
            for dtype in (mx.float32, mx.bfloat16):
                ids = topk_cuda.topk_ids(mx.zeros((8, 248_320), dtype), sampling.CANDIDATES)
                assert ids.shape == (8, sampling.CANDIDATES) and ids.dtype == mx.uint32
    finally:
        mx.enable_compile()
    built = {t: log for t, log in nvrtc_check.Checked.seen.items() if "slotserve_topk" in t}
    assert len(built) == 3 and all(log is None for log in built.values()), built
    with pytest.raises(ValueError, match="2000 of 1000"):
        topk_cuda.topk_ids(mx.zeros((1, 1000)), 2000)


def test_the_argmax_kernel_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """SLOTSERVE_ARGMAX=1: each row's argmax by many blocks a row compiles for every logits
    dtype (the GPU test compares it with MLX's: tests/test_argmax_cuda.py); off, MLX's."""
    from engine.kernels import argmax_cuda

    nvrtc = nvrtc_check.Nvrtc(nvrtc_check.installed())  # type: ignore[arg-type]
    for switch, kernels in (("0", 0), ("1", 3)):
        monkeypatch.setenv(argmax_cuda.ENV, switch)
        nvrtc_check.Checked.seen.clear()
        with nvrtc_check.kernels_checked(nvrtc):
            for dtype in (mx.bfloat16, mx.float16, mx.float32):
                ids = argmax_cuda.argmax_rows(mx.zeros((8, 248320), dtype))
                assert ids.shape == (8,) and ids.dtype == mx.uint32
        seen = nvrtc_check.Checked.seen.items()
        built = [log for text, log in seen if "slotserve_argmax" in text]
        assert len(built) == kernels and all(log is None for log in built), built


@pytest.mark.parametrize("chunk", ["0", "64"])
def test_decode_attention_with_keys_shared_by_blocks_compiles(
    chunk: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SLOTSERVE_ATTENTION_SPLIT=64: a decode row's keys shared by blocks of 64 (the 0.8B's
    heads, a past of 300: 5 blocks a row and head, from the shape alone) compiles; "0" builds
    the one-block kernel. (128, the default, is the same kernel with another chunk.) (The GPU tests compare both with the portable
    path: tests/test_attention_cuda.py.)"""
    from engine.kernels import attention_cuda

    monkeypatch.setenv(attention_cuda.SPLIT_ENV, chunk)
    H, Hkv, D, B, S = 8, 2, 256, 2, 300
    nvrtc_check.Checked.seen.clear()
    nvrtc = nvrtc_check.Nvrtc(nvrtc_check.installed())  # type: ignore[arg-type]
    with nvrtc_check.kernels_checked(nvrtc):
        idx = mx.array([[0], [1]], dtype=mx.int32)
        out, k, v = attention_cuda.attention_cuda(
            mx.zeros((B, H * 2 * D + 2 * Hkv * D), mx.bfloat16),
            idx,
            mx.array([0, 1], dtype=mx.int32),
            mx.array([299, 5], dtype=mx.int32),
            mx.array([1, 1], dtype=mx.int32),
            mx.zeros((B, S, Hkv, D), mx.bfloat16),
            mx.zeros((B, S, Hkv, D), mx.bfloat16),
            mx.ones((D,)),
            mx.ones((D,)),
            mx.ones((D // 4,)),
            n_heads=H,
            n_kv_heads=Hkv,
            rope_dim=D // 2,
            eps=1e-6,
        )
        assert out.shape == (B, H * D) and k.shape == v.shape == (B, Hkv, D)
    split = [log for t, log in nvrtc_check.Checked.seen.items() if "int SPLITS = 5;" in t]
    assert len(split) == (chunk != "0") and all(log is None for log in split), split
    assert all(log is None for log in nvrtc_check.Checked.seen.values())


def test_the_host_pool_kernels_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """SLOTSERVE_HOST_POOL=1: the kernels that copy a step's read-back ids into 8-byte
    arrays compile for every count of pieces (the GPU test reads values through them:
    tests/test_host_pool_cuda.py); off, nothing is built."""
    from engine.kernels import host_pool

    monkeypatch.setenv(host_pool.ENV, "1")
    nvrtc_check.Checked.seen.clear()
    nvrtc = nvrtc_check.Nvrtc(nvrtc_check.installed())  # type: ignore[arg-type]
    with nvrtc_check.kernels_checked(nvrtc):
        for n in (3, 5, 8, 9, 17, 33, 64):
            assert host_pool.to_host(mx.zeros((n,), mx.int32)).shape == (n,)
        assert host_pool.ids(list(range(8))).shape == (8,)
    built = [log for t, log in nvrtc_check.Checked.seen.items() if "slotserve_host_pieces" in t]
    counts = {host_pool._pieces(n) for n in (3, 5, 8, 9, 17, 33, 64) if n <= host_pool.MAX_VALUES}
    assert len(built) == len(counts) and all(log is None for log in built), built


def test_precompile_draws_builds_every_host_pool_kernel_a_sampled_step_meets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`precompile_draws` at 1, 2, 4, 8 rows (5 slots: up to the next power of two) builds
    the host pool's kernels for every piece count a sampled step of 1-5 rows then meets —
    the uniforms' stack and the tokens' read-back: on the H200 each took 1.3-1.8 s to build
    at its first use (session 24), a stall of the first step of its width. (MLX's own
    compiles are off here: eager draws, the same kernels of ours.)"""
    from engine import sampling
    from engine.kernels import host_pool

    monkeypatch.setenv(host_pool.ENV, "1")
    kinds = [
        sampling.SamplingParams(temperature=1.0),
        sampling.SamplingParams(top_k=40),
        sampling.SamplingParams(top_p=0.9),
    ]
    nvrtc_check.Checked.seen.clear()
    nvrtc = nvrtc_check.Nvrtc(nvrtc_check.installed())  # type: ignore[arg-type]
    mx.disable_compile()
    try:
        with nvrtc_check.kernels_checked(nvrtc):
            sampling.precompile_draws(3000, rows=5)
            built = set(nvrtc_check.Checked.seen)
            for n in range(1, 6):
                for p in kinds:
                    tokens = sampling.device_tokens(mx.zeros((n, 3000)), [p] * n, [0.5] * n)
                    assert host_pool.to_host(tokens).shape == (n,)
    finally:
        mx.enable_compile()
    assert set(nvrtc_check.Checked.seen) == built  # nothing new to build at any width
    pool = [t for t in built if "slotserve_host_pieces" in t or "slotserve_stack" in t]
    assert len(pool) == 4 and all(nvrtc_check.Checked.seen[t] is None for t in pool), pool
