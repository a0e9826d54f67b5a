"""Which BLAS MLX's CPU backend runs on: the daemon's `blas` setting.

MLX's Linux wheel links the reference (netlib) BLAS it bundles: single-threaded, about
2.5 GFLOP/s on one core whatever the shape, so on a Linux CPU every float matmul is slow
and batching buys nothing. MLX calls `cblas_sgemm`, so an optimized CBLAS preloaded into
the process replaces it without rebuilding anything: Debian's OpenBLAS (package
`libopenblas0-pthread`) decodes the same tokens 2-5x faster (docs/PERFORMANCE.md).

A preload only takes effect when the process starts, so `ensure_preloaded` re-executes
the process (same pid, same arguments) with `LD_PRELOAD` set, once; afterwards it checks
that the library is really mapped. Only float32 matmuls go through BLAS (quantized
matmuls are MLX's own code); GPU backends do not use it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

BUNDLED = "bundled"
OPENBLAS = "openblas"
DEBIAN_OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
"""`openblas` means this file: Debian/Ubuntu's `libopenblas0-pthread` on x86-64."""
REEXEC_MARK = "SLOTSERVE_BLAS_PRELOADED"


class BlasError(ValueError):
    """The BLAS setting cannot be honoured on this machine; the message says what to do."""


def library(setting: str) -> Path | None:
    """The shared library that `setting` ("bundled", "openblas" or a path to a CBLAS
    library) preloads; None for MLX's bundled BLAS. Raises `BlasError` if it is missing."""
    if setting == BUNDLED:
        return None
    if not sys.platform.startswith("linux"):
        raise BlasError(f"a preloaded BLAS is for Linux; on {sys.platform} use {BUNDLED}")
    if setting == OPENBLAS:
        path = DEBIAN_OPENBLAS
        hint = "install it with `apt-get install libopenblas0-pthread`, or give the path of "
        hint += f"another CBLAS library, or use {BUNDLED}"
    elif os.path.isabs(setting):
        path, hint = Path(setting), f"give an existing CBLAS library, or use {BUNDLED}"
    else:
        raise BlasError(f"expected {BUNDLED}, {OPENBLAS} or an absolute path to a CBLAS library")
    if not path.is_file():
        raise BlasError(f"{path} does not exist: {hint}")
    return path


def preload_env(path: Path, env: Mapping[str, str], threads: int | None = None) -> dict[str, str]:
    """`env` with `path` first in LD_PRELOAD (and OPENBLAS_NUM_THREADS=`threads` if given)."""
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p != str(path)]
    out = dict(env) | {"LD_PRELOAD": ":".join([str(path), *preload])}
    if threads is not None:
        out["OPENBLAS_NUM_THREADS"] = str(threads)
    return out


def is_mapped(path: Path) -> bool:
    """Whether `path` is loaded into this process (Linux: /proc/self/maps)."""
    target = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return any(
            line.rstrip().endswith(target) or line.rstrip().endswith(str(path)) for line in f
        )


def ensure_preloaded(setting: str, command: Sequence[str]) -> None:
    """Make this process run on the BLAS `setting` names: for a library that is not yet
    mapped, re-execute `command` (this process's own, e.g. `python -m transport.cli serve ...`)
    with it preloaded (does not return); after that, raise `BlasError` if it still is not
    mapped."""
    path = library(setting)
    if path is None or is_mapped(path):
        return
    if os.environ.get(REEXEC_MARK) == str(path):
        raise BlasError(f"{path} was preloaded but is not loaded: is it a shared library?")
    env = preload_env(path, os.environ) | {REEXEC_MARK: str(path)}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], list(command), env)
