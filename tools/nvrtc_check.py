"""Compile every CUDA kernel the engine would build, with NVRTC, on a machine without a GPU.

Our kernels are sources that MLX compiles on the GPU machine at their first launch, so a
typo in one is found only there, at the cost of a lease's minutes. This script runs the
real model (tiny presets: dense, MoE, quantized) on the CPU with every fused path switched
on; where a kernel would launch, it builds the source MLX would build (its wrapper: the
inputs as `const T*` with `_shape` / `_strides` / `_ndim` where the body names them, the
outputs, the template arguments as `constexpr` / `using`) and compiles it for sm_90 with
NVRTC, returning zeros of the output shapes so the forward goes on. It checks that the code
compiles, not what it computes: the GPU tests do that.

NVRTC and CUDA's headers come from NVIDIA's pip wheels (no GPU or driver needed), which the
dev extras install on x86-64 Linux; `make test` runs this (tests/test_nvrtc_check.py):

    python tools/nvrtc_check.py [--cuda path/to/nvidia]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import importlib.util
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

_TYPES = {
    mx.float32: "float",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.bool_: "bool",
}

# What MLX's device header gives a kernel body, reduced to what ours use.
_HEADER = """\
#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef int int32_t; typedef unsigned int uint32_t; typedef long long int64_t;
typedef unsigned char uint8_t; typedef unsigned long long uint64_t;
struct Shape { int32_t v[10]; __device__ int32_t operator[](int i) const { return v[i]; } };
struct Strides { int64_t v[10]; __device__ int64_t operator[](int i) const { return v[i]; } };
namespace mlx::core::cu {
"""


class Nvrtc:
    """The few NVRTC calls a compile needs, through ctypes."""

    def __init__(self, cuda: Path) -> None:
        self.lib = ctypes.CDLL(str(cuda / "cuda_nvrtc" / "lib" / "libnvrtc.so.12"))
        self.include = cuda / "cuda_runtime" / "include"

    def compile(self, name: str, source: str) -> str | None:
        """None if `source` compiles for sm_90, else NVRTC's log."""
        prog = ctypes.c_void_p()
        self._ok(
            self.lib.nvrtcCreateProgram(
                ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None
            )
        )
        options = [
            b"--gpu-architecture=compute_90",
            b"--std=c++17",
            b"-I" + str(self.include).encode(),
        ]
        array = (ctypes.c_char_p * len(options))(*options)
        status = self.lib.nvrtcCompileProgram(prog, len(options), array)
        log = None
        if status != 0:
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
        self.lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return log

    @staticmethod
    def _ok(status: int) -> None:
        if status != 0:
            raise RuntimeError(f"NVRTC call failed with status {status}")


def wrap(
    name: str,
    source: str,
    input_names: Sequence[str],
    inputs: Sequence[mx.array],
    output_names: Sequence[str],
    output_dtypes: Sequence[mx.Dtype],
    template: Sequence[tuple[str, Any]],
) -> str:
    """The translation unit MLX makes of a `cuda_kernel` body (mlx/backend/cuda/custom_kernel.cpp)."""
    params = []
    for n, a in zip(input_names, inputs, strict=True):
        params.append(f"const {_TYPES[a.dtype]}* {n}")
        if a.ndim > 0:
            params += [f"const __grid_constant__ Shape {n}_shape"] * (f"{n}_shape" in source)
            params += [f"const __grid_constant__ Strides {n}_strides"] * (f"{n}_strides" in source)
            params += [f"const __grid_constant__ int {n}_ndim"] * (f"{n}_ndim" in source)
    params += [f"{_TYPES[d]}* {n}" for n, d in zip(output_names, output_dtypes, strict=True)]
    consts = []
    for k, v in template:
        if isinstance(v, bool):
            consts.append(f"  constexpr bool {k} = {'true' if v else 'false'};")
        elif isinstance(v, int):
            consts.append(f"  constexpr int {k} = {v};")
        else:
            consts.append(f"  using {k} = {_TYPES[v]};")
    return (
        _HEADER
        + f"__global__ void {name}(\n    "
        + ",\n    ".join(params)
        + ") {\n"
        + "\n".join(consts)
        + "\n"
        + source
        + "\n}\n} // namespace mlx::core::cu\n"
    )


class Checked:
    """Stands in for an `mx.fast.cuda_kernel`: compiles each new source, returns zeros."""

    seen: ClassVar[dict[str, str | None]] = {}

    def __init__(self, nvrtc: Nvrtc, kw: dict[str, Any]) -> None:
        self.nvrtc, self.kw = nvrtc, kw

    def __call__(
        self,
        *,
        inputs: Sequence[mx.array],
        template: Sequence[tuple[str, Any]] = (),
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        **_: Any,
    ) -> list[mx.array]:
        kw = self.kw
        text = wrap(
            kw["name"],
            kw["source"],
            kw["input_names"],
            inputs,
            kw["output_names"],
            output_dtypes,
            template,
        )
        if text not in Checked.seen:
            Checked.seen[text] = self.nvrtc.compile(kw["name"], text)
            status = "ok" if Checked.seen[text] is None else "FAILED"
            args = ",".join(f"{k}={v}" for k, v in template)
            print(f"{status:6s} {kw['name']} <{args}>", flush=True)
        return [
            mx.zeros(tuple(s), dtype=d) for s, d in zip(output_shapes, output_dtypes, strict=True)
        ]


@contextmanager
def kernels_checked(nvrtc: Nvrtc) -> Iterator[None]:
    """Every fused path on, each kernel launch compiled instead of run."""
    from engine.kernels import cuda

    with cuda.kernels_replaced(lambda **kw: Checked(nvrtc, kw)):
        yield


def run_models(presets: Sequence[str], rows: Sequence[int]) -> None:
    """Each preset's model through steps of `rows` decode rows, a ragged prefill with capture
    and a rollback: the kernel variants a server meets."""
    from engine.cache import SlotPool
    from engine.models.qwen35 import load_model
    from engine.runner import ModelRunner, Row
    from engine.writer import preset, write_model

    with tempfile.TemporaryDirectory() as tmp:
        for spec in presets:
            name, _, quant = spec.partition(":")
            path = Path(tmp) / f"{name}-{quant}.gguf"
            write_model(path, dataclasses.replace(preset(name), quant=quant or "f32"))
            for dtype in (mx.bfloat16, mx.float32):
                model = load_model(path, dtype)
                n = max(rows)
                pool = SlotPool(model.config, n, 64, dtype, max_draft=4)
                runner = ModelRunner(model, pool)
                slots = [pool.allocate() for _ in range(n)]
                runner.step([Row(s, [1, 2, 3], 0) for s in slots])
                held = dict.fromkeys(slots, 3)
                for r in rows:
                    runner.step([Row(s, [4], held[s]) for s in slots[:r]])
                    runner.step([Row(s, [5, 6, 7], held[s] + 1, capture=True) for s in slots[:r]])
                    for s in slots[:r]:
                        pool.rollback(s, 1)
                        held[s] += 2


def installed() -> Path | None:
    """The `nvidia` folder of NVIDIA's pip wheels in this environment (the dev extras install
    them on x86-64 Linux), or None."""
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--cuda",
        type=Path,
        default=installed(),
        help="the nvidia/ folder of the wheels (default: where they are installed)",
    )
    p.add_argument("--presets", default="tiny:f32,tiny:q8_0,tiny:q4_0,tiny-moe:f32")
    p.add_argument("--rows", default="1,2,8")
    args = p.parse_args(argv)
    if args.cuda is None:
        p.error("no NVRTC: install nvidia-cuda-nvrtc-cu12 and nvidia-cuda-runtime-cu12, or --cuda")
    with kernels_checked(Nvrtc(args.cuda)):
        run_models(args.presets.split(","), [int(r) for r in args.rows.split(",")])
    failed = [t for t, log in Checked.seen.items() if log is not None]
    for text in failed:
        print("\n" + Checked.seen[text], file=sys.stderr)  # type: ignore[operator]
    print(f"{len(Checked.seen)} kernel sources compiled, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
