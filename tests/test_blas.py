"""The daemon's `blas` setting: a preloaded OpenBLAS decodes the same tokens as MLX's bundled
BLAS, and a library that is not there stops the daemon with an error saying what to do."""

from __future__ import annotations

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


@needs_openblas
def test_openblas_daemon_decodes_what_the_bundled_blas_daemon_decodes(
    model: Path, tmp_path: Path
) -> None:
    runs = {}
    for setting in (blas.BUNDLED, blas.OPENBLAS):
        endpoint = f"ipc://{tmp_path}/{setting}.sock"
        args = ["--model", str(model), "--endpoints", endpoint, "--context", "128"]
        args += ["--metrics-address", "", "--speculation", "off", "--blas", setting]
        with Supervised(args, endpoint) as daemon:
            assert daemon.proc is not None
            maps = daemon_maps(daemon.proc.pid)  # the same pid after the re-execution
            runs[setting] = anyio.run(greedy_tokens, endpoint)
        assert daemon.returncode == 0
        assert (str(blas.DEBIAN_OPENBLAS) in maps) == (setting == blas.OPENBLAS)
    assert runs[blas.OPENBLAS] == runs[blas.BUNDLED]
    assert all(len(t) == 24 for t in runs[blas.BUNDLED])


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
    assert "expected bundled, openblas or an absolute path" in capsys.readouterr().err
    assert cli.main(["serve", "--model", str(model), "--blas", "bundled", "--check"]) == 0


def test_a_library_that_cannot_be_preloaded_is_an_error_not_a_loop(
    model: Path, tmp_path: Path
) -> None:
    import subprocess
    import sys

    fake = tmp_path / "libblas.so.3"
    fake.write_text("not a shared library")
    cmd = [sys.executable, "-m", "transport.cli", "serve", "--model", str(model)]
    cmd += ["--blas", str(fake), "--metrics-address", ""]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert f"{fake} was preloaded but is not loaded" in res.stderr
