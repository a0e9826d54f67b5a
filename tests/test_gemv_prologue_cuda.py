"""Products that make their own input (`gemv_cuda.add_norm_gemv_cuda`,
`gemv_cuda.swiglu_gemv_cuda`) against the separate kernels they replace, and a real model
through both paths; on MLX's CUDA backend only."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pytest
from gpu_paths import PROMPTS, assert_as_close_as, on_cpu, two_steps

from engine.gguf import QuantizedWeight, Weight
from engine.kernels import add_norm_cuda, gemv_cuda, swiglu_cuda
from engine.kernels.cuda import available

pytestmark = pytest.mark.skipif(not available(), reason="needs MLX's CUDA backend")


ONE = [[3, 9, 27, 81, 243]]  # one sequence: its decode steps are the one-row products


@pytest.mark.parametrize("staged", ["0", "1", "rows", "rows/auto"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-next"])
def test_a_model_through_the_prologues_matches_the_portable_path(
    make_model: Callable[..., Path], preset: str, staged: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Float matrices: where the prologues run — one row ("0"; "1": staged, every product of
    the model they fit) or three (the default "rows": staged at 2-8 rows; "rows/auto": with
    SLOTSERVE_GEMV_STAGED_SPLIT=auto, warps sharing K). First in the file: a time-limited GPU
    run reaches the model before the kernel variants below are built."""
    path = make_model(preset, quant="f32")
    mode, _, split = staged.partition("/")
    prompts = PROMPTS if mode == "rows" else ONE
    monkeypatch.setenv("SLOTSERVE_FUSED_GEMV_PROLOGUE", "0")
    portable = two_steps(path, prompts=prompts)
    monkeypatch.setenv("SLOTSERVE_FUSED_GEMV_PROLOGUE", "1")
    monkeypatch.setenv(gemv_cuda.STAGED_ENV, mode)
    monkeypatch.setenv(gemv_cuda.STAGED_SPLIT_ENV, split or "1")
    assert_as_close_as(two_steps(path, prompts=prompts), portable, on_cpu(path, prompts=prompts))


def test_a_bf16_model_through_the_tensor_core_products(
    make_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 model's staged products at 2-8 rows on tensor cores (SLOTSERVE_GEMV_MMA=1, the
    default; its plain products there too) stay as close to the float32 CPU result as with
    the CUDA-core kernel they replace: bf16's rounding is the noise, a wrong fragment or row
    is off by O(1). (Against the bf16 portable path a fused one cannot be held so: that path
    and the CPU's round at the same places and agree to the bit where the fused ones do not.)"""
    path = make_model("tiny", quant="f32")
    monkeypatch.setenv(gemv_cuda.MMA_ENV, "0")
    cuda_cores = two_steps(path, dtype=mx.bfloat16)
    monkeypatch.setenv(gemv_cuda.MMA_ENV, "1")
    monkeypatch.setenv(gemv_cuda.DENSE_ENV, "mma")
    tensor_cores = two_steps(path, dtype=mx.bfloat16)
    assert_as_close_as(tensor_cores, cuda_cores, on_cpu(path))


SIXTEEN = [[3 + i, 5 * i + 1][: 1 + i % 2] for i in range(16)]  # 16 rows: ragged, then decode


def test_a_bf16_model_at_sixteen_rows_through_the_tensor_core_products(
    make_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With SLOTSERVE_GEMV_MMA_ROWS=16 a step of 9-16 rows takes the fused products and
    prologues too (a second fragment of x a warp): as close to the float32 CPU result as
    the separate kernels and MLX's GEMMs it replaces."""
    path = make_model("tiny", quant="f32")
    separate = two_steps(path, prompts=SIXTEEN, dtype=mx.bfloat16)
    monkeypatch.setenv(gemv_cuda.MMA_ROWS_ENV, "16")
    fused = two_steps(path, prompts=SIXTEEN, dtype=mx.bfloat16)
    assert_as_close_as(fused, separate, on_cpu(path, prompts=SIXTEEN))


def _weight(kind: str, N: int, K: int, dtype: mx.Dtype) -> Weight:
    w = mx.random.normal((N, K), key=mx.random.key(N + 3 * K)) / np.sqrt(K)
    if kind == "float":
        return w.astype(dtype)
    bits = {"q8": 8, "q4": 4}[kind]
    q, s, b = mx.quantize(w, group_size=32, bits=bits)
    return QuantizedWeight(q, s.astype(dtype), b.astype(dtype), bits, 32, (N, K))


def _rows(R: int, K: int, dtype: mx.Dtype, seed: int, scale: float = 1.0) -> mx.array:
    return (scale * mx.random.normal((R, K), key=mx.random.key(seed))).astype(dtype)


class Case(NamedTuple):
    """A product's shape and tuning: R rows of width K by N outputs; `outs`, `unroll`, `split`
    as `gemv_cuda.gemv_cuda` takes them."""

    R: int
    K: int
    N: int
    outs: int
    unroll: int
    split: int | None


# the default tuning on shapes a model meets, then other tunings (warps sharing K unevenly,
# outputs past N's end) on one shape
CASES = [
    Case(1, 1024, 8224, 4, 1, None),
    Case(3, 4096, 1000, 4, 1, None),
    Case(8, 512, 96, 4, 1, None),
    Case(8, 3584, 1000, 4, 1, None),  # the 0.8B's 8-row SwiGLU input: staged in two chunks
    Case(3, 4096, 1000, 1, 1, 1),
    Case(3, 4096, 1000, 8, 1, 3),
    Case(2, 1024, 1001, 2, 2, 4),
]
KINDS = [("float", mx.bfloat16), ("float", mx.float32), ("q8", mx.bfloat16), ("q4", mx.bfloat16)]


@pytest.fixture(params=["0", "1"], ids=["unstaged", "staged"])
def staged(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both prologue kernels: the one that makes x per weight load, and the staged one (its
    rows made once per block in shared memory; groups of outputs per block)."""
    monkeypatch.setenv(gemv_cuda.STAGED_ENV, request.param)
    monkeypatch.setenv(gemv_cuda.MMA_ENV, "0")  # its tensor-core form: tests of their own
    return bool(request.param == "1")


@pytest.mark.parametrize(("kind", "dtype"), KINDS)
@pytest.mark.parametrize("case", CASES)
def test_swiglu_prologue_is_the_two_kernels_exactly(
    case: Case, dtype: mx.Dtype, kind: str, staged: bool
) -> None:
    """Same roundings, same accumulation order: only where x comes from changed (the staged
    kernel splits K as the plain one does for the same `split`: one warp when None)."""
    R, K, N, outs, unroll, split = case
    if staged:
        split = 1 if split is None else split
    w = _weight(kind, N, K, dtype)
    gu = _rows(R, 2 * K, dtype, R + K, scale=3.0)
    got = gemv_cuda.swiglu_gemv_cuda(gu, w, outs, unroll, split)
    want = gemv_cuda.gemv_cuda(swiglu_cuda.swiglu_cuda(gu), w, outs, unroll, split)
    assert got.shape == (R, N) and got.dtype == dtype
    assert bool(mx.array_equal(got, want))


@pytest.mark.parametrize(("kind", "dtype"), KINDS)
@pytest.mark.parametrize("case", CASES)
def test_add_norm_prologue_matches_the_two_kernels(
    case: Case, dtype: mx.Dtype, kind: str, staged: bool
) -> None:
    """The residual sum is the separate kernel's exactly (every element, written by one
    block of many); the product differs only by the norm's summation order."""
    R, K, N, outs, unroll, split = case
    w = _weight(kind, N, K, dtype)
    x, m = _rows(R, K, dtype, 1, scale=4.0), _rows(R, K, dtype, 2)
    norm = 1 + 0.1 * mx.random.normal((K,), key=mx.random.key(3))
    h, got = gemv_cuda.add_norm_gemv_cuda(x, m, norm, 1e-6, w, outs, unroll, split)
    ref_h, a = add_norm_cuda.add_rms_norm_cuda(x, m, norm, 1e-6)
    assert h.dtype == got.dtype == dtype and got.shape == (R, N)
    assert bool(mx.array_equal(h, ref_h))
    want = np.array(gemv_cuda.gemv_cuda(a, w, outs, unroll, split).astype(mx.float32))
    # a normalised value may round to the neighbouring half-precision number: one such
    # input moves an output by ~|w| * ulp; a wrong row or scale moves it by O(1)
    tol = {mx.float32: 1e-5, mx.bfloat16: 2e-2}[dtype]
    err = np.abs(np.array(got.astype(mx.float32)) - want).max()
    assert err <= tol * max(np.abs(want).max(), 1.0), err


@pytest.mark.parametrize(("kind", "dtype"), KINDS)
@pytest.mark.parametrize(("R", "K", "N"), [(8, 1024, 7168), (8, 3584, 1024), (3, 4096, 1000)])
def test_rows_loaded_ahead_and_unrolled_weight_loads_change_no_value(
    R: int, K: int, N: int, dtype: mx.Dtype, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SLOTSERVE_GEMV_STAGE_AHEAD=rows and SLOTSERVE_GEMV_STAGED_UNROLL=2, 4 move loads
    earlier, not sums: every output and residual equal to the default staged kernel's (the
    0.8B's 8-row input and down products, chunked; a 3-row one)."""
    monkeypatch.setenv(gemv_cuda.STAGED_ENV, "1")
    monkeypatch.setenv(gemv_cuda.MMA_ENV, "0")
    w = _weight(kind, N, K, dtype)
    x, m = _rows(R, K, dtype, 1, scale=4.0), _rows(R, K, dtype, 2)
    gu = _rows(R, 2 * K, dtype, R + K, scale=3.0)
    norm = 1 + 0.1 * mx.random.normal((K,), key=mx.random.key(3))

    whole = R * K * dtype.size <= gemv_cuda.STAGE_MAX_BYTES  # add + RMSNorm stages whole rows

    def both() -> list[mx.array]:
        out = [gemv_cuda.swiglu_gemv_cuda(gu, w)]
        return [*out, *gemv_cuda.add_norm_gemv_cuda(x, m, norm, 1e-6, w)] if whole else out

    want = both()
    for ahead, unroll in [("rows", "1"), ("1", "2"), ("rows", "4")]:
        monkeypatch.setenv(gemv_cuda.STAGE_AHEAD_ENV, ahead)
        monkeypatch.setenv(gemv_cuda.STAGED_UNROLL_ENV, unroll)
        for g, wt in zip(both(), want, strict=True):
            assert bool(mx.array_equal(g, wt)), (ahead, unroll)


# the 0.8B's 8-row products (gate|up, GDN input, down: chunked), spare outputs, few rows
MMA_CASES = [(8, 1024, 7168), (8, 1024, 8224), (8, 3584, 1024), (3, 1024, 1000), (2, 96, 40)]
# past 8 rows (SLOTSERVE_GEMV_MMA_ROWS=16): the 0.8B's shapes at 16 rows, ragged counts
MMA_WIDE_CASES = [(16, 1024, 7168), (16, 3584, 1024), (12, 1024, 1000), (9, 96, 40)]


def _prologue_inputs(R: int, K: int, dtype: mx.Dtype) -> dict[str, mx.array]:
    return {
        "x": _rows(R, K, dtype, 1, scale=4.0),
        "m": _rows(R, K, dtype, 2),
        "norm": 1 + 0.1 * mx.random.normal((K,), key=mx.random.key(3)),
        "gu": _rows(R, 2 * K, dtype, R + K, scale=3.0),
    }


def _both_products(w: Weight, a: dict[str, mx.array], whole: bool = True) -> list[mx.array]:
    """The plain product (staged, as SLOTSERVE_FUSED_GEMV_DENSE=mma sends it), the SwiGLU
    one and (where its rows fit the stage whole) the add + RMSNorm one's residual and
    product."""
    out = [gemv_cuda.gemv_cuda(a["x"], w, staged=True), gemv_cuda.swiglu_gemv_cuda(a["gu"], w)]
    if whole:
        out += gemv_cuda.add_norm_gemv_cuda(a["x"], a["m"], a["norm"], 1e-6, w)
    return out


@pytest.mark.parametrize(
    ("R", "K", "N", "dtype"),
    [(*case, mx.bfloat16) for case in MMA_CASES + MMA_WIDE_CASES]
    + [(*case, mx.float16) for case in (MMA_CASES[0], MMA_CASES[3], MMA_WIDE_CASES[2])],
)
@pytest.mark.parametrize("blocks", ["1", "auto"])  # SLOTSERVE_GEMV_MMA_BLOCKS
def test_tensor_core_products_match_float32(
    R: int, K: int, N: int, dtype: mx.Dtype, blocks: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against the prologue's rows (the separate kernels') times the weights in float32:
    the products are exact in the fragments and summed in float32, so the outputs are off
    by their own rounding to 16 bits and the order of the sums (a wrong fragment, row or
    output is off by O(1)). With blocks sharing K (where the shape asks for it), each block's
    sums meet in float32 too. Past 8 rows, with SLOTSERVE_GEMV_MMA_ROWS=16."""
    monkeypatch.setenv(gemv_cuda.STAGED_ENV, "1")
    monkeypatch.setenv(gemv_cuda.MMA_BLOCKS_ENV, blocks)
    monkeypatch.setenv(gemv_cuda.MMA_ROWS_ENV, "16" if R > gemv_cuda.MAX_ROWS else "8")
    assert gemv_cuda.mma_takes(R, K, dtype, mx.zeros((N, K), dtype))
    w = _weight("float", N, K, dtype)
    a = _prologue_inputs(R, K, dtype)
    whole = R * K * dtype.size <= gemv_cuda.STAGE_MAX_BYTES
    got = _both_products(w, a, whole)
    w32 = np.array(w.astype(mx.float32))
    made = [a["x"], swiglu_cuda.swiglu_cuda(a["gu"])]
    if whole:
        ref_h, normed = add_norm_cuda.add_rms_norm_cuda(a["x"], a["m"], a["norm"], 1e-6)
        assert bool(mx.array_equal(got[2], ref_h))
        made.append(normed)
    for out, rows in zip([*got[:2], *got[3:]], made, strict=True):
        want = np.array(rows.astype(mx.float32)) @ w32.T
        err = np.abs(np.array(out.astype(mx.float32)) - want).max()
        # add + RMSNorm: a normalised value may round to its neighbour (as above)
        assert out.shape == (R, N) and err <= 2e-2 * max(np.abs(want).max(), 1.0), err


@pytest.mark.parametrize("rows", [8, 16])  # (16: SLOTSERVE_GEMV_MMA_ROWS=16)
@pytest.mark.parametrize(("K", "N"), [(1024, 1000), (3584, 1024)])
@pytest.mark.parametrize("blocks", ["1", "auto"])  # (3584, 1024) with "auto": 2 blocks
def test_a_tensor_core_row_is_the_same_whatever_rows_share_its_launch(
    K: int, N: int, blocks: str, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An output is one weight row against one column of x: a row's result is bit for bit
    the same alone, among 2, 5 or 8 rows (and 9 or 12 of 16), and beside other rows' values
    — batch invariance at decode sizes, across the second fragment of x past 8 rows too;
    with blocks sharing K, whichever block finishes last, launch after launch (each leaves
    its arrival counts at zero for the next)."""
    monkeypatch.setenv(gemv_cuda.STAGED_ENV, "1")
    monkeypatch.setenv(gemv_cuda.MMA_BLOCKS_ENV, blocks)
    monkeypatch.setenv(gemv_cuda.MMA_ROWS_ENV, str(rows))
    dtype = mx.bfloat16
    w = _weight("float", N, K, dtype)
    a8 = _prologue_inputs(rows, K, dtype)
    whole = rows * K * dtype.size <= gemv_cuda.STAGE_MAX_BYTES
    want = _both_products(w, a8, whole)
    other = {k: v + 1 for k, v in _prologue_inputs(rows, K, dtype).items()}
    for R in (1, 2, 5) if rows == 8 else (1, 5, 8, 9, 12):
        first = {k: v if k == "norm" else v[:R] for k, v in a8.items()}
        for got, full in zip(_both_products(w, first, whole), want, strict=True):
            assert bool(mx.array_equal(got, full[:R])), R
        mixed = {
            k: v if k == "norm" else mx.concatenate([a8[k][:R], other[k][R:]])
            for k, v in a8.items()
        }
        for got, full in zip(_both_products(w, mixed, whole), want, strict=True):
            assert bool(mx.array_equal(got[:R], full[:R])), R


def test_tensor_core_loads_ahead_change_no_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """SLOTSERVE_GEMV_MMA_UNROLL, SLOTSERVE_GEMV_STAGE_AHEAD and SLOTSERVE_GEMV_MMA_DIRECT
    move loads (and where x is made), not sums — in one block a column group: blocks
    sharing K (SLOTSERVE_GEMV_MMA_BLOCKS, "auto") split the direct product's sums where the
    staged one (SLOTSERVE_GEMV_MMA_DIRECT=0) keeps them whole (their own test is against
    float32: `test_tensor_core_products_match_float32`)."""
    monkeypatch.setenv(gemv_cuda.STAGED_ENV, "1")
    monkeypatch.setenv(gemv_cuda.MMA_BLOCKS_ENV, "1")
    w = _weight("float", 1000, 3584, mx.bfloat16)
    a = _prologue_inputs(8, 3584, mx.bfloat16)
    want = _both_products(w, a, whole=False)
    for ahead, unroll, direct in [
        ("rows", "4", "0"),
        ("1", "1", "1"),
        ("1", "2", "0"),
        ("rows", "8", "1"),
    ]:
        monkeypatch.setenv(gemv_cuda.STAGE_AHEAD_ENV, ahead)
        monkeypatch.setenv(gemv_cuda.MMA_UNROLL_ENV, unroll)
        monkeypatch.setenv(gemv_cuda.MMA_DIRECT_ENV, direct)  # x staged (in chunks) or not
        for g, wt in zip(_both_products(w, a, whole=False), want, strict=True):
            assert bool(mx.array_equal(g, wt)), (ahead, unroll, direct)


def test_routing_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only where it measured faster: one row of a small float matrix, and (staged, the
    default "rows") float matrices at 2 to 8 rows."""
    monkeypatch.delenv(gemv_cuda.STAGED_ENV, raising=False)
    w = _weight("float", 300, 256, mx.bfloat16)
    assert gemv_cuda.takes_prologue(1, 256, mx.bfloat16, w)
    assert gemv_cuda.takes_prologue(2, 256, mx.bfloat16, w)
    assert gemv_cuda.takes_prologue(8, 256, mx.bfloat16, w)
    assert not gemv_cuda.takes_prologue(9, 256, mx.bfloat16, w)  # past the kernel's rows
    assert not gemv_cuda.takes_prologue(8, 256, mx.bfloat16, _weight("q8", 300, 256, mx.bfloat16))
    wide32 = _weight("float", 64, 4096, mx.float32)
    assert gemv_cuda.takes_prologue(2, 4096, mx.float32, wide32)  # 32 KiB of rows
    assert not gemv_cuda.takes_prologue(3, 4096, mx.float32, wide32)  # 48: past the stage
    monkeypatch.setenv(gemv_cuda.STAGED_ENV, "0")
    assert not gemv_cuda.takes_prologue(2, 256, mx.bfloat16, w)
    monkeypatch.setenv(gemv_cuda.STAGED_ENV, "2")
    with pytest.raises(ValueError, match="SLOTSERVE_GEMV_STAGED"):
        gemv_cuda.takes_prologue(2, 256, mx.bfloat16, w)
    monkeypatch.delenv(gemv_cuda.STAGED_ENV)
    assert not gemv_cuda.takes_prologue(1, 256, mx.bfloat16, _weight("q8", 300, 256, mx.bfloat16))
    big = mx.zeros((4096, 4096), dtype=mx.bfloat16)  # 32 MiB: its read outweighs a launch
    assert not gemv_cuda.takes_prologue(1, 4096, mx.bfloat16, big)
    assert not gemv_cuda.takes_prologue(1, 256, mx.float16, w)  # mixed dtypes
    q8 = _weight("q8", 300, 256, mx.bfloat16)
    monkeypatch.setenv("SLOTSERVE_GEMV_PROLOGUE_QUANTIZED", "swiglu")  # for measuring only
    assert gemv_cuda.takes_prologue(1, 256, mx.bfloat16, q8, "swiglu")
    assert not gemv_cuda.takes_prologue(1, 256, mx.bfloat16, q8, "add_norm")
    assert not gemv_cuda.takes_prologue(2, 256, mx.bfloat16, q8, "swiglu")
    with pytest.raises(ValueError, match="no prologue"):
        gemv_cuda.takes_prologue(1, 256, mx.bfloat16, w, "gelu")
    monkeypatch.setenv(gemv_cuda.STAGED_ENV, "1")  # staged: any rows whose rows fit the stage
    assert gemv_cuda.takes_prologue(8, 256, mx.bfloat16, w)
    assert gemv_cuda.takes_prologue(1, 4096, mx.bfloat16, big)
    assert gemv_cuda.takes_prologue(8, 256, mx.bfloat16, q8, "add_norm")
    wide = _weight("float", 64, 4096, mx.float32)
    assert gemv_cuda.takes_prologue(2, 4096, mx.float32, wide)  # 32 KiB of rows
    assert not gemv_cuda.takes_prologue(3, 4096, mx.float32, wide)  # 48: past the stage
    down = _weight("float", 64, 3584, mx.bfloat16)  # the 0.8B's 8-row SwiGLU input: 56 KiB
    assert gemv_cuda.stage_chunk(8, 3584, mx.bfloat16, down) == 2816  # staged in two chunks
    assert gemv_cuda.stage_chunk(8, 3584, mx.bfloat16, down, "swiglu", split=4) == 2048
    assert gemv_cuda.stage_chunk(2, 3584, mx.bfloat16, down) == 3584  # whole: it fits
    assert gemv_cuda.takes_prologue(8, 3584, mx.bfloat16, down, "swiglu")
    assert not gemv_cuda.takes_prologue(8, 3584, mx.bfloat16, down, "add_norm")  # norm: whole rows
    monkeypatch.delenv(gemv_cuda.STAGED_SPLIT_ENV, raising=False)
    assert gemv_cuda.staged_split(1024, 4) == 4  # the default, "auto": 32 blocks were too few
    monkeypatch.setenv(gemv_cuda.STAGED_SPLIT_ENV, "1")
    assert gemv_cuda.staged_split(1024, 4) == 1  # one warp a group
    monkeypatch.setenv(gemv_cuda.STAGED_SPLIT_ENV, "auto")
    assert gemv_cuda.staged_split(1024, 4) == 4
    assert gemv_cuda.staged_split(7168, 4) == 1  # 224 blocks
    q4 = _weight("q4", 64, 3584, mx.bfloat16)  # 4 warps' round of 4-bit loads: 4096 values
    assert gemv_cuda.stage_chunk(8, 3584, mx.bfloat16, q4, "swiglu", split=4) == 0
    gu = _rows(8, 2 * 3584, mx.bfloat16, 9, scale=3.0)  # so "auto" falls back to one warp
    want = gemv_cuda.gemv_cuda(swiglu_cuda.swiglu_cuda(gu), q4, split=1)
    assert bool(mx.array_equal(gemv_cuda.swiglu_gemv_cuda(gu, q4), want))
    monkeypatch.setenv(gemv_cuda.STAGED_SPLIT_ENV, "3")
    with pytest.raises(ValueError, match="SLOTSERVE_GEMV_STAGED_SPLIT"):
        gemv_cuda.staged_split(1024, 4)
    monkeypatch.delenv(gemv_cuda.STAGED_SPLIT_ENV)
    monkeypatch.setenv("SLOTSERVE_FUSED_GEMV_PROLOGUE", "0")
    assert not gemv_cuda.takes_prologue(1, 256, mx.bfloat16, w)
    assert not gemv_cuda.takes_prologue(1, 256, mx.bfloat16, q8, "swiglu")
    x = _rows(2, 256, mx.bfloat16, 5)
    with pytest.raises(ValueError, match="add_norm_gemv_cuda"):
        gemv_cuda.add_norm_gemv_cuda(x, x[:1], mx.ones((256,)), 1e-6, w)
    with pytest.raises(ValueError, match="swiglu_gemv_cuda"):
        gemv_cuda.swiglu_gemv_cuda(_rows(2, 300, mx.bfloat16, 6), w)
