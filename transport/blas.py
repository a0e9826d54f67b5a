"""Which BLAS MLX's CPU backend runs on: the daemon's `blas` setting.

MLX's Linux wheel links the reference (netlib) BLAS it bundles: single-threaded, about
2.5 GFLOP/s on one core whatever the shape, so on a Linux CPU every float matmul is slow
and batching buys nothing. MLX calls `cblas_sgemm`, so an optimized CBLAS preloaded into
the process replaces it without rebuilding anything: Debian's OpenBLAS (package
`libopenblas0-pthread`) decodes the same tokens 2-5x faster (docs/PERFORMANCE.md).

A preload only takes effect when the process starts, so `ensure_preloaded` re-executes
the process (same pid, same arguments) with `LD_PRELOAD` set, once; afterwards it checks
that the library is really mapped. Without the Debian package, `numpy` uses the OpenBLAS
that numpy's Linux wheel already bundles, through a three-function CBLAS shim built on
first use (`cblas_shim.c`; a C compiler needed then): on this project's 2-core VM our
batched decode ran 6x faster at 8 rows than on the bundled BLAS (docs/PERFORMANCE.md).
Only float32 matmuls go through BLAS (quantized matmuls are MLX's own code); GPU backends do
not use it. `auto` takes the first of these that the host can have (`best`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

BUNDLED = "bundled"
OPENBLAS = "openblas"
NUMPY = "numpy"
AUTO = "auto"
DEBIAN_OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
"""`openblas` means this file: Debian/Ubuntu's `libopenblas0-pthread` on x86-64."""
REEXEC_MARK = "SLOTSERVE_BLAS_PRELOADED"
SHIM_SOURCE = Path(__file__).with_name("cblas_shim.c")
SHIM_NEEDS = ("scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_", "scipy_cblas_cgemm64_")


class BlasError(ValueError):
    """The BLAS setting cannot be honoured on this machine; the message says what to do."""


def on_linux() -> bool:
    """Where a preloaded BLAS applies."""
    return sys.platform.startswith("linux")


def numpy_openblas() -> Path:
    """The OpenBLAS numpy's Linux wheel bundles (`numpy.libs/libscipy_openblas64_*.so`),
    checked to export what the shim calls. Raises `BlasError` naming what is missing."""
    import numpy

    libs = Path(numpy.__file__).resolve().parent.parent / "numpy.libs"
    found = sorted(libs.glob("libscipy_openblas64_*.so*")) if libs.is_dir() else []
    if not found:
        raise BlasError(
            f"numpy {numpy.__version__} here bundles no OpenBLAS (no {libs}/"
            f"libscipy_openblas64_*.so: not a PyPI Linux wheel?); use {OPENBLAS} or {BUNDLED}"
        )
    lib = ctypes.CDLL(str(found[0]))
    missing = [name for name in SHIM_NEEDS if not hasattr(lib, name)]
    if missing:
        raise BlasError(f"{found[0]} lacks {', '.join(missing)}; use {OPENBLAS} or {BUNDLED}")
    return found[0]


def cache_dir() -> Path:
    """Where built shims are kept: $XDG_CACHE_HOME/slotserve (or ~/.cache/slotserve)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "slotserve"


def numpy_shim(cache: Path | None = None) -> Path:
    """The CBLAS shim over numpy's OpenBLAS (`cblas_shim.c`), built with the C compiler
    (`$CC`, else `cc`) the first time and kept under `cache` (default `cache_dir()`), one
    build per OpenBLAS file and shim source. Raises `BlasError` saying what is missing."""
    target = numpy_openblas()
    source = SHIM_SOURCE.read_bytes()
    key = hashlib.sha256(source + str(target).encode()).hexdigest()[:16]
    out = (cache or cache_dir()) / f"libslotserve_cblas-{key}.so"
    if out.is_file():
        return out
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise BlasError(
            f"blas = {NUMPY} builds a small shim over numpy's OpenBLAS and needs a C "
            f"compiler ({cc!r} not found: install gcc, or set CC); or use {OPENBLAS} or {BUNDLED}"
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    except OSError as e:
        raise BlasError(
            f"cannot build the numpy OpenBLAS shim in {out.parent} ({e.strerror}): set "
            "XDG_CACHE_HOME to a directory the daemon can write"
        ) from None
    os.close(fd)
    cmd = [cc, "-O2", "-shared", "-fPIC", str(SHIM_SOURCE), "-o", tmp, f"-L{target.parent}"]
    cmd += [f"-l:{target.name}", f"-Wl,-rpath,{target.parent}"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise BlasError(f"building the numpy OpenBLAS shim failed: {res.stderr.strip()[-500:]}")
        os.replace(tmp, out)  # (atomic: two daemons building at once each get a whole file)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def best() -> str:
    """The setting `auto` stands for on this host: the first of openblas and numpy that can
    be had (its library there, or its shim buildable), else bundled."""
    for choice in (OPENBLAS, NUMPY):
        try:
            library(choice)
        except BlasError:
            continue
        return choice
    return BUNDLED


def library(setting: str) -> Path | None:
    """The shared library that `setting` ("bundled", "openblas", "numpy", "auto" or a path
    to a CBLAS library) preloads; None for MLX's bundled BLAS. Raises `BlasError` if it is
    missing (for "numpy": if numpy bundles no OpenBLAS, or the shim cannot be built).
    "auto": the first of openblas and numpy that can be had, else bundled (never raises)."""
    if setting == BUNDLED:
        return None
    if setting == AUTO:
        return library(best())
    if not on_linux():
        raise BlasError(f"a preloaded BLAS is for Linux; on {sys.platform} use {BUNDLED}")
    if setting == NUMPY:
        return numpy_shim()
    if setting == OPENBLAS:
        path = DEBIAN_OPENBLAS
        hint = "install it with `apt-get install libopenblas0-pthread`, or give the path of "
        hint += f"another CBLAS library, or use {BUNDLED}"
    elif os.path.isabs(setting):
        path, hint = Path(setting), f"give an existing CBLAS library, or use {BUNDLED}"
    else:
        raise BlasError(
            f"expected {BUNDLED}, {OPENBLAS}, {NUMPY}, {AUTO} or an absolute path to a CBLAS "
            "library"
        )
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
