"""What every benchmark script shares: model files, contender workers, the machine, the report.

Each contender lives in its own worker process (multiprocessing, spawn), so our
engine can run with and without a preloaded BLAS in the same run, llama.cpp's
threads never share a process with MLX, and the driver can alternate
contenders sample by sample. Only one worker computes at a time; the others
wait on their pipe. Timing happens inside the worker, around the work only.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from importlib import metadata
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "out" / "bench"

if str(ROOT) not in sys.path:  # `python bench/x.py` puts bench/, not the root, on the path
    sys.path.insert(0, str(ROOT))

from transport import blas as blas_setting  # noqa: E402  (the daemon's `blas` setting)


def bench_model(preset_name: str, quant: str, **overrides: Any) -> Path:
    """The GGUF of `preset_name` in `quant` (and other ModelSpec `overrides`), written once
    into out/bench/ (keyed by its spec)."""
    from engine.writer import preset, write_model

    spec = dataclasses.replace(preset(preset_name), quant=quant, **overrides)
    digest = hashlib.sha256(repr(spec).encode()).hexdigest()[:8]
    path = OUT_DIR / f"{preset_name}-{quant}-{digest}.gguf"
    if not path.exists():
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write_model(tmp, spec)
        tmp.replace(path)
    return path


# ----------------------------------------------------------------------------------------------
# Contender workers


@dataclass(frozen=True)
class Side:
    """One contender of a run: `kind` is "ours", "llama" or "mlx-lm"; `env` is set in its
    process; `blas` names the BLAS under MLX ("bundled", "openblas", "numpy"; "" for llama.cpp)."""

    name: str
    kind: str
    options: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    cores: int = 1  # how many cores it can keep busy: the rest are free for other processes
    blas: str = ""


PEERS = ("llama", "mlx-lm")
DTYPES = ["float32", "bfloat16", "float16"]


def blas_env(blas: str, n_threads: int) -> dict[str, str]:
    """The environment that puts `blas` (the daemon's `blas` setting: "bundled", "openblas",
    "numpy" or a library path) under MLX in a new process, as `slotserve serve --blas` does."""
    try:
        path = blas_setting.library(blas)
    except blas_setting.BlasError as e:
        raise SystemExit(f"--blas {blas}: {e}") from None
    if path is None:
        return {}
    return blas_setting.preload_env(path, {}, n_threads)


def run_on_blas(blas: str) -> None:
    """Re-execute this script (once) with `blas` preloaded, as `slotserve serve --blas` does
    for the daemon: for scripts that run our engine in their own process."""
    try:
        blas_setting.ensure_preloaded(blas, [sys.executable, *sys.orig_argv[1:]])
    except blas_setting.BlasError as e:
        raise SystemExit(f"--blas {blas}: {e}") from None


def default_blas() -> str:
    """An OpenBLAS where one can be had, else MLX's bundled BLAS (`blas.best`: what the
    daemon's `blas = auto` takes)."""
    return blas_setting.best()


def sides_for(
    blas: Sequence[str],
    compile: bool,
    n_threads: int,
    kv_dtype: str,
    peers: Sequence[str] = ("llama",),
    dtype: str = "float32",
    dense: bool = False,
    ahead: bool = False,
) -> list[Side]:
    """Our engine once per BLAS in `blas` ("bundled" | "openblas" | "numpy"), then mlx-lm once per BLAS
    (if in `peers`), then llama.cpp (if in `peers`). `dense`: ours dequantizes a quantized
    file's matrices at load (the daemon's `weights = "dense"`); the peers do not. `ahead`:
    ours once more per BLAS, as "ours-ahead", queueing each step on the previous one's tokens
    on the device (the scheduler's `decode_ahead`)."""
    sides = []
    kinds = ["ours"] + (["mlx-lm"] if "mlx-lm" in peers else [])
    for kind in kinds:
        for b in blas:
            env = blas_env(b, n_threads)
            name = kind if b == "bundled" else f"{kind}+{b}"
            opts = {"kv_dtype": kv_dtype, "compile": compile, "dtype": dtype}
            if kind == "ours" and dense:
                opts["dense"] = True
                name = name.replace("ours", "ours-dense", 1)
            # MLX's CPU backend runs its ops on one thread; only OpenBLAS brings threads of its own.
            cores = n_threads if env else 1
            sides.append(Side(name, kind, opts, env, cores=cores, blas=b))
            if kind == "ours" and ahead:
                ahead_name = name.replace("ours", "ours-ahead", 1)
                sides.append(Side(ahead_name, kind, opts | {"ahead": True}, env, cores, b))
    if "llama" in peers:
        llama_opts = {"n_threads": n_threads, "kv_dtype": kv_dtype}
        sides.append(Side("llama.cpp", "llama", llama_opts, cores=n_threads))
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise SystemExit(f"unknown peers {sorted(unknown)}; known: {', '.join(PEERS)}")
    return sides


def ratios(sides: Sequence[Side]) -> list[tuple[str, str]]:
    """(ours side, peer side) pairs each table reports as a ratio: every ours side against
    llama.cpp, and against mlx-lm under the same BLAS."""
    out = []
    for s in sides:
        if s.kind != "ours":
            continue
        for p in sides:
            if p.kind == "llama" or (p.kind == "mlx-lm" and p.blas == s.blas):
                out.append((s.name, p.name))
    return out


class Worker:
    """A process holding one contender on one model; `call(fn, **kw)` runs `fn(contender, **kw)`
    there and returns its result. `fn` must be a module-level function (it is pickled by name)."""

    def __init__(self, side: Side, model: Path) -> None:
        self.side = side
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        with _environment(side.env):  # a spawned child inherits os.environ as it is at start()
            self.proc = ctx.Process(
                target=_serve, args=(child, side, str(model)), name=side.name, daemon=True
            )
            self.proc.start()
        child.close()
        self._answer()  # the contender is loaded

    def call(self, fn: Callable[..., Any], **kw: Any) -> Any:
        self.conn.send((fn, kw))
        return self._answer()

    def _answer(self) -> Any:
        try:
            status, value = self.conn.recv()
        except EOFError:
            self.proc.join(timeout=5)
            raise RuntimeError(
                f"worker {self.side.name} died (exit {self.proc.exitcode})"
            ) from None
        if status != "ok":
            raise RuntimeError(f"worker {self.side.name} failed:\n{value}")
        return value

    def close(self) -> None:
        with suppress(OSError):  # it may have died already
            self.conn.send(None)
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.terminate()


@contextmanager
def workers(sides: Sequence[Side], model: Path) -> Iterator[list[Worker]]:
    started: list[Worker] = []
    try:
        for side in sides:
            started.append(Worker(side, model))
        yield started
    finally:
        for w in started:
            w.close()


@contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _serve(conn: Connection, side: Side, model: str) -> None:
    import peers

    try:
        cls = {"ours": peers.Ours, "llama": peers.LlamaCpp, "mlx-lm": peers.MlxLm}[side.kind]
        contender = cls(model, name=side.name, **side.options)
        conn.send(("ok", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while (msg := conn.recv()) is not None:
        fn, kw = msg
        try:
            conn.send(("ok", fn(contender, **kw)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


# ----------------------------------------------------------------------------------------------
# Measuring under interference


class Meter:
    """Times a block: wall seconds, this process's cores busy, and everyone else's.

    `others` is the machine's busy CPU time (/proc/stat) minus this process's, per wall
    second: how many cores other processes took while we measured. On a shared machine that
    is the noise; the driver re-runs samples that saw too much of it (`measure`).
    """

    wall: float
    cores: float
    others: float

    def __enter__(self) -> Meter:
        self._t, self._c, self._b = time.perf_counter(), time.process_time(), _busy_seconds()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t
        own = time.process_time() - self._c
        self.cores = own / self.wall
        self.others = max(0.0, _busy_seconds() - self._b - own) / self.wall


def _busy_seconds() -> float:
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, f.readline().split()[1:9]
        )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def add_contender_args(p: argparse.ArgumentParser) -> None:
    """Options every ours-vs-llama.cpp script shares: BLAS, threads, KV dtype, statistic,
    noise handling, seed and JSON path."""
    p.add_argument(
        "--blas",
        type=lambda s: s.split(","),
        default=sorted({"bundled", default_blas()}),
        help="our engine once per BLAS: bundled, openblas, numpy (default: bundled and, where "
        "one can be had, openblas or else numpy)",
    )
    p.add_argument(
        "--peers",
        type=lambda s: [x for x in s.split(",") if x],
        default=["llama", "mlx-lm"] if _version("mlx_lm") else ["llama"],
        help="peers beside our engine: llama, mlx-lm (default: both if mlx-lm is installed; "
        "pip install -e '.[bench]')",
    )
    p.add_argument("--compile", action="store_true", help="ours: ModelRunner(compile=True)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp and OpenBLAS threads")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="compute dtype of MLX sides")
    p.add_argument("--kv-dtype", default="float32", choices=DTYPES)
    p.add_argument("--stat", default="best", choices=sorted(STATS), help="per contender")
    add_noise_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON path")


def add_noise_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quiet",
        type=float,
        default=0.25,
        help="re-run a sample while other processes took more than this many cores beyond "
        "those the contender leaves free (default %(default)s)",
    )
    p.add_argument("--retries", type=int, default=3, help="re-runs per disturbed sample")


def measure(
    w: Worker, fn: Callable[..., dict[str, Any]], quiet: float, retries: int, **kw: Any
) -> dict[str, Any]:
    """`w.call(fn, **kw)`, re-run up to `retries` times while other processes took more than
    `quiet` cores beyond those the contender leaves free (`fn` returns its `others`); the
    least disturbed result is kept."""
    free = max(0, (os.cpu_count() or 1) - w.side.cores)
    best = w.call(fn, **kw)
    for _ in range(retries):
        if best["others"] <= free + quiet:
            break
        res = w.call(fn, **kw)
        if res["others"] < best["others"]:
            best = res
    return best


def noise_line(samples: Sequence[dict[str, Any]]) -> str:
    others = sorted(s["others"] for s in samples)
    return (
        f"\nother processes took {median(others):.2f} cores (median), {others[-1]:.2f} (max) "
        f"during the {len(others)} kept samples"
    )


# ----------------------------------------------------------------------------------------------
# Inputs and statistics


def prompt_tokens(n: int, seed: int, n_vocab: int = 32768) -> list[int]:
    """`n` reproducible token ids clear of the byte tokens and the specials at the top."""
    import numpy as np

    margin = min(300, n_vocab // 4)
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(margin, n_vocab - margin, size=n)]


def prompt_vocab(path: Path) -> int:
    """Token ids prompts draw from: the model's real tokens (the writer's large presets pad the
    vocabulary with unused rows past 32768)."""
    from engine.gguf import GGUFFile

    return min(GGUFFile(path).config.n_vocab, 32768)


def timing(
    f: Callable[..., Any],
    record: Callable[[float], object],
    counted: Callable[..., bool] = lambda *a, **kw: True,
) -> Callable[..., Any]:
    """BENCHMARK ONLY: `f`, each call that `counted(*args)` approves passing its wall seconds
    (any wait for the device it makes included) to `record`."""

    def timed(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*a, **kw)
        finally:
            if counted(*a, **kw):
                record(time.perf_counter() - t)

    return timed


def time_calls(
    owner: object,
    name: str,
    spent: dict[str, float],
    label: str,
    counted: Callable[..., bool] = lambda *a, **kw: True,
) -> None:
    """BENCHMARK ONLY: wrap `owner.name` so that each call `counted(*args)` approves adds its
    wall seconds to `spent[label]` (`timing`)."""

    def add(seconds: float) -> None:
        spent[label] = spent.get(label, 0.0) + seconds

    setattr(owner, name, timing(getattr(owner, name), add, counted))


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median milliseconds of `fn()` over `reps` calls after `warmup` untimed ones, each
    waited for on the device (`mx.synchronize`) so a GPU's queued work is counted."""
    import mlx.core as mx

    for _ in range(warmup):
        fn()
    mx.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        mx.synchronize()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


STATS: dict[str, Callable[[Sequence[float]], float]] = {"best": max, "median": median}
"""How the table sums up a contender's tok/s samples. "best": on a shared machine noise only
ever slows a run down, so the fastest sample is the least disturbed one."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ----------------------------------------------------------------------------------------------
# The machine and the report


def machine() -> dict[str, Any]:
    """What the numbers depend on: CPU, cores, memory, library versions, date, load."""
    cpu = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "flags") and key not in cpu:
                cpu[key] = value.strip()
    flags = set(cpu.pop("flags", "").split())
    simd = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    return {
        "cpu": cpu.get("model name", platform.processor()),
        "cpu_family_model": f"{cpu.get('cpu family')}/{cpu.get('model')}",
        "simd": simd,
        "cores": os.cpu_count(),
        # the CPUs this process may run on (`taskset`, the daemon's `cpus`): on the H200 VM
        # the host-bound figures moved with them (docs/PERFORMANCE.md, session 14)
        "cpus_allowed": _cpus_allowed(),
        "memory_gib": round(mem_kb / 2**20, 1),
        "python": platform.python_version(),
        "mlx": _version("mlx"),
        "llama_cpp_python": _version("llama_cpp_python"),
        "mlx_lm": _version("mlx_lm"),
        "numpy": _version("numpy"),
        "openblas": _dpkg_version("libopenblas0-pthread"),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "engine_dirty": bool(_git("status", "--porcelain", "engine")),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def _cpus_allowed() -> str | None:
    from transport import cpus

    try:
        return cpus.format_list(cpus.allowed())
    except cpus.CpuError:  # not Linux
        return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _dpkg_version(package: str) -> str | None:
    try:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status} ${Version}", package],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
    except FileNotFoundError:
        return None
    return out.split()[-1] if out.startswith("install ok installed") else None


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()
    except FileNotFoundError:
        return ""


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in header]] + [[_cell(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells[1:]:
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |")
    return "\n".join(lines)


def _cell(c: object) -> str:
    if isinstance(c, float):
        return f"{c:.3f}" if abs(c) < 10 else f"{c:.1f}"
    return str(c)


def write_json(name: str, record: dict[str, Any], out: Path | None = None) -> Path:
    path = out or OUT_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path
