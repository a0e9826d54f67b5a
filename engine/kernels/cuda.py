"""What every CUDA kernel module here shares: where the kernels can run, the switch that
turns one off, and one cache of compiled kernels keyed by family and source variant."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np

_kernels: dict[tuple[str, str], Any] = {}

# MLX's CUDA backend records an evaluation's kernels into CUDA graphs by default; it reads
# MLX_USE_CUDA_GRAPHS once, at its first use, so this must run before any evaluation (the
# model's module imports this one). Launching directly made our decode steps faster in every
# same-run A/B on the H200 (0.8B shape, bf16, compiled; graphs on -> off: N=1 3.43 -> 2.62 ms,
# N=8 5.62 -> 3.32 ms, N=64 7.71 -> 5.96 ms; docs/PERFORMANCE.md, "Session 4"). An operator's
# own setting wins.
os.environ.setdefault("MLX_USE_CUDA_GRAPHS", "0")


def available() -> bool:
    """True where the kernels can run: MLX's CUDA backend on the default GPU device."""
    return bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu


FUSED = ("GDN", "ATTENTION", "ADD_NORM", "SWIGLU", "STACK", "EMBED", "GEMV", "GEMV_PROLOGUE")
"""The fused paths `SLOTSERVE_FUSED_<name>=0` switches off (each "1" by default)."""
_FUSED_ENV = {name: f"SLOTSERVE_FUSED_{name}" for name in FUSED}


ON_OFF = ("1", "0")

# The bytes-keyed dict os.environ keeps current (CPython on POSIX: every os.environ write,
# monkeypatch's included, goes through it), or None where there is none.
_ENVIRON = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENV_KEYS: dict[str, bytes] = {}


def env(name: str, default: str) -> str:
    """`os.environ.get(name, default)`, as current, at a thirtieth of its cost: a decode step
    reads its switches ~500 times (every product, norm and mixer asks at its call, so tests
    and tools may flip them between calls), ~1 us each through `os.environ`'s mapping layer."""
    if _ENVIRON is None:
        return os.environ.get(name, default)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.fsencode(name)
    value = _ENVIRON.get(key)
    return default if value is None else os.fsdecode(value)


def env_flag(name: str, default: str = "0") -> bool:
    """A switch that is on where the environment sets it to "1", off where "0", `default`
    where unset; anything else raises, naming it."""
    value = env(name, default)
    if value not in ON_OFF:
        raise ValueError(f"{name}={value!r}: one of {', '.join(ON_OFF)}")
    return value == "1"


def switched_on(name: str) -> bool:
    """Whether a fused path runs: on MLX's CUDA backend, unless `SLOTSERVE_FUSED_<name>=0`
    asks for the portable ops (read at each call: tests flip it between models)."""
    return available() and env(_FUSED_ENV[name], "1") != "0"


def kernel_name(family: str, inputs: list[str], outputs: list[str], source: str) -> str:
    """The kernel's name, from everything that goes into its code. MLX keeps each compiled
    kernel on disk under its name (plus its template arguments), across processes and across
    versions of this code (`MLX_PTX_CACHE_DIR`, by default the temp directory): a name that
    said only the family and the order of creation (as it once did) let a process load
    another kernel's code made by an earlier process — one with another eps baked in, a
    capture variant with other parameters, or last version's source."""
    text = "\0".join([family, *inputs, "->", *outputs, source])
    return f"slotserve_{family}_{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def cached_kernel(
    family: str,
    variant: str,
    inputs: list[str],
    outputs: list[str],
    source: str,
    contiguous: bool = True,
    shared_memory: int = 0,
) -> Any:
    """The `mx.fast.cuda_kernel` of `family` for `variant` (a source variant: floats such as
    eps are baked into the source, as template arguments are integers and types only),
    made once per process. `contiguous`: MLX copies every input that is not row-contiguous
    before the launch (a kernel that reads its inputs' strides says False).
    `shared_memory`: dynamic shared memory in bytes (a variant must say it: it is fixed per
    kernel object). MLX keys the code it compiles by the kernel's name and its template
    arguments, not by its inputs' types: a type the code depends on (a `sizeof`, a load's
    width) must be a template argument, or a launch with other types runs the first code."""
    key = (family, variant)
    kernel = _kernels.get(key)
    if kernel is None:
        kernel = _kernels[key] = mx.fast.cuda_kernel(
            name=kernel_name(family, inputs, outputs, source),
            input_names=inputs,
            output_names=outputs,
            source=source,
            ensure_row_contiguous=contiguous,
            shared_memory=shared_memory,
        )
    return kernel


def arrival(index: str, expected: str) -> str:
    """CUDA source for kernels whose blocks share a result, after a block has written its
    share: the block counts its arrival in `counts[index]` (an input, `arrival_counts`) and
    returns unless it is the last of `expected` blocks to arrive; the last goes on to combine
    the shares, with the count left at zero for the next launch. Every thread of the block
    must reach it."""
    return f"""\
    __threadfence();  // this block's share visible to every block before its count says so
    __syncthreads();
    __shared__ int is_last;
    if (threadIdx.x == 0) {{
        int* count = const_cast<int*>(reinterpret_cast<const int*>(counts)) + ({index});
        is_last = atomicAdd(count, 1) == ({expected}) - 1;
        if (is_last) *count = 0;  // every block has arrived: ready for the next launch
    }}
    __syncthreads();
    if (!is_last) return;
    __threadfence();
"""


_counts: dict[int, mx.array] = {}


def arrival_counts(n: int) -> mx.array:
    """Arrival counts for kernels whose blocks share a result (the last block of a group to
    arrive finishes it: `gemv_cuda`'s blocks sharing K, `argmax_cuda`): at least `n` int32
    zeros, which such a kernel writes though MLX sees an input, and leaves at zero again
    (each launch's last block resets its group's). One array per thread: launches on one
    thread's stream run in order, so none shares a count with a launch in flight; replaced
    by a larger array of zeros for a launch with more groups."""
    key = threading.get_ident()
    counts = _counts.get(key)
    if counts is None or counts.size < n:
        size = max(4096, 1 << (n - 1).bit_length())
        # (made from numpy: already data, nothing to evaluate — it may be made while a
        # compiled function is traced, which captures it as it does the weights)
        counts = _counts[key] = mx.array(np.zeros(size, dtype=np.int32))
    return counts


@contextmanager
def kernels_replaced(make: Callable[..., Any]) -> Iterator[None]:
    """For tools on a machine without a GPU (tools/nvrtc_check.py, bench/graph_nodes.py):
    every fused path on, and each kernel MLX would build made by `make(**kw)` instead (kw:
    `mx.fast.cuda_kernel`'s arguments); the cache of built kernels emptied before and
    restored after."""
    global available
    saved = (mx.fast.cuda_kernel, available, dict(_kernels))
    mx.fast.cuda_kernel = make
    available = lambda: True  # noqa: E731
    _kernels.clear()
    try:
        yield
    finally:
        mx.fast.cuda_kernel, available = saved[0], saved[1]
        _kernels.clear()
        _kernels.update(saved[2])
