"""The daemon's `blas` setting: a preloaded OpenBLAS (Debian's, or numpy's through the shim
built on first use) decodes the same tokens as MLX's bundled BLAS, and a library that is
not there stops the daemon with an error saying what to do."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from transport import blas, cli
from transport.client import Client
from transport.daemon.demo import Supervised

needs_openblas = pytest.mark.skipif(
    not blas.DEBIAN_OPENBLAS.is_file(), reason="apt-get install libopenblas0-pthread"
)


def _numpy_shim_buildable() -> bool:
    try:
        blas.numpy_openblas()
    except blas.BlasError:
        return False
    return shutil.which(os.environ.get("CC") or "cc") is not None


needs_numpy_shim = pytest.mark.skipif(
    not _numpy_shim_buildable(), reason="numpy bundles no OpenBLAS here, or no C compiler"
)


@pytest.fixture(scope="module")
def model(make_model: Callable[..., Path]) -> Path:
    # wide enough that the matmuls are real BLAS work
    return make_model("tiny", n_embd=256, n_ff=512, quant="f32")


async def greedy_tokens(endpoint: str) -> list[list[int]]:
    async with Client.connect(endpoint) as client:
        return [
            (
                await client.complete(
                    [i, 7, 11, 13], max_tokens=24, ignore_eos=True, temperature=0.0
                )
            ).tokens
            for i in (1, 2)
        ]


def daemon_maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize(
    "setting",
    [
        pytest.param(blas.OPENBLAS, marks=needs_openblas),
        pytest.param(blas.NUMPY, marks=needs_numpy_shim),
        pytest.param(blas.AUTO, marks=needs_numpy_shim),  # (Debian's where installed)
    ],
)
def test_a_preloaded_blas_daemon_decodes_what_the_bundled_blas_daemon_decodes(
    model: Path, tmp_path: Path, setting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the shim's build, if any
    runs = {}
    for s in (blas.BUNDLED, setting):
        endpoint = f"ipc://{tmp_path}/{s}.sock"
        args = ["--model", str(model), "--endpoints", endpoint, "--context", "128"]
        args += ["--metrics-address", "", "--speculation", "off", "--blas", s]
        with Supervised(args, endpoint) as daemon:
            assert daemon.proc is not None
            maps = daemon_maps(daemon.proc.pid)  # the same pid after the re-execution
            runs[s] = anyio.run(greedy_tokens, endpoint)
        assert daemon.returncode == 0
        library = blas.library(setting)
        assert library is not None and (str(library) in maps) == (s == setting)
    assert runs[setting] == runs[blas.BUNDLED]
    assert all(len(t) == 24 for t in runs[blas.BUNDLED])


@needs_numpy_shim
def test_the_numpy_shim_is_built_once_and_runs_mlx_products(tmp_path: Path) -> None:
    """Built into the cache on first use, the same file afterwards; preloaded, the process's
    `cblas_sgemm` — the symbol MLX's products call — is the shim's, and MLX's float32
    products (8 rows, as a batched step's) are numpy's to float32 rounding."""
    shim = blas.numpy_shim(tmp_path)
    built = shim.stat().st_mtime_ns
    assert blas.numpy_shim(tmp_path) == shim and shim.stat().st_mtime_ns == built
    code = (
        "import mlx.core as mx, numpy as np\n"
        "mx.set_default_device(mx.cpu)\n"
        "a = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)\n"
        "w = np.random.default_rng(1).standard_normal((384, 512)).astype(np.float32)\n"
        "got = np.array(mx.array(a) @ mx.array(w).T)\n"
        "assert np.allclose(got, a @ w.T, rtol=1e-4, atol=1e-3), abs(got - a @ w.T).max()\n"
        "import ctypes\n"
        "at = lambda lib: ctypes.cast(lib.cblas_sgemm, ctypes.c_void_p).value\n"
        f"assert at(ctypes.CDLL(None)) == at(ctypes.CDLL({str(shim)!r}))\n"
        "print(open('/proc/self/maps').read())\n"
    )
    env = blas.preload_env(shim, os.environ, threads=2)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert str(shim) in res.stdout and str(blas.numpy_openblas()) in res.stdout


def test_the_numpy_shim_without_a_compiler_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        blas.numpy_openblas()
    except blas.BlasError as e:  # (a numpy without OpenBLAS: that is the error then)
        assert "bundles no OpenBLAS" in str(e) or "lacks" in str(e)
        return
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(blas.BlasError, match="needs a C compiler"):
        blas.numpy_shim(tmp_path)
    assert not list(tmp_path.glob("*.so"))
    monkeypatch.delenv("CC")
    blocked = tmp_path / "file"
    blocked.write_text("")  # (a file where the cache's folder would be)
    with pytest.raises(blas.BlasError, match="set XDG_CACHE_HOME to a directory"):
        blas.numpy_shim(blocked / "cache")


def test_a_missing_blas_library_stops_serve_with_what_to_do(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "libblas.so.3"
    status = cli.main(["serve", "--model", str(model), "--blas", str(missing)])
    err = capsys.readouterr().err
    assert status == 2
    assert f"blas: {missing} does not exist" in err and "use bundled" in err


def test_openblas_names_the_debian_package_when_it_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(blas, "DEBIAN_OPENBLAS", tmp_path / "absent" / "libblas.so.3")
    with pytest.raises(blas.BlasError, match="apt-get install libopenblas0-pthread"):
        blas.library(blas.OPENBLAS)


def test_blas_takes_bundled_openblas_or_a_library_path(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve", "--model", str(model), "--blas", "mkl", "--check"]) == 2
    assert "expected bundled, openblas, numpy, auto or an absolute path" in capsys.readouterr().err
    assert cli.main(["serve", "--model", str(model), "--blas", "bundled", "--check"]) == 0


def test_a_library_that_cannot_be_preloaded_is_an_error_not_a_loop(
    model: Path, tmp_path: Path
) -> None:
    fake = tmp_path / "libblas.so.3"
    fake.write_text("not a shared library")
    cmd = [sys.executable, "-m", "transport.cli", "serve", "--model", str(model)]
    cmd += ["--blas", str(fake), "--metrics-address", ""]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert f"{fake} was preloaded but is not loaded" in res.stderr


def test_auto_takes_the_first_blas_it_can_have_and_never_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(blas, "DEBIAN_OPENBLAS", tmp_path / "absent" / "libblas.so.3")
    if _numpy_shim_buildable():
        assert blas.library(blas.AUTO) == blas.numpy_shim()
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other"))  # (no shim built there)
    assert blas.library(blas.AUTO) is None  # bundled
    debian = tmp_path / "libblas.so.3"
    debian.write_bytes(b"")
    monkeypatch.setattr(blas, "DEBIAN_OPENBLAS", debian)
    assert blas.library(blas.AUTO) == debian
