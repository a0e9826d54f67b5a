"""The daemon's settings: one table of keys read from a TOML file, `SLOTSERVE_*`
environment variables and command-line flags (flag > env > file > default).

Every key appears once in `KEYS`, which drives all three sources, the flags'
help and the validation; `load(...)` returns a frozen `DaemonConfig` or raises
`ConfigError` naming the key and where its bad value came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transport import blas, cpus

ENV_PREFIX = "SLOTSERVE_"
LOG_FORMATS = ("plain", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
SPECULATION = ("off", "auto")
PLACEMENTS = ("device", "host")  # scheduler.prefix_reuse.PLACEMENTS (no MLX import here)
WEIGHTS = ("stored", "dense")
DTYPES = ("auto", "float32", "bfloat16", "float16")
COMPILE = ("auto", "off", "on")
DECODE_AHEAD = ("auto", "off", "on")
PRECOMPILE = ("auto", "off", "on", "all")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


class ConfigError(ValueError):
    """A setting is missing, unknown or out of range; the message names the key."""


@dataclass(frozen=True)
class DaemonConfig:
    """What `slotserve serve` runs with; units are in the field names' comments."""

    model: Path
    endpoints: tuple[str, ...] = ("tcp://127.0.0.1:5555",)
    model_name: str = ""  # told to clients in Welcome; "" = the file's stem
    slots: int = 8
    context: int = 4096  # tokens per slot
    memory_budget: int | None = None  # bytes; None = what the pool holds for all slots
    mlx_cache_limit: int | None = None  # bytes of freed buffers MLX keeps; None = its default
    max_queue: int = 256
    speculation: str = "auto"  # "off": never draft; "auto": the cost controller decides
    draft_depth: int = 4  # the most draft tokens a slot verifies per step
    dflash: Path | None = None  # a DFlash block drafter GGUF made for `model`; None = none
    prefix_cache: int | None = 1 << 30  # bytes for cached prefixes; None = off
    prefix_cache_interval: int = 1024  # snapshot long prompts every this many tokens; 0 = never
    prefix_cache_placement: str = "device"  # where snapshots live: "device" or "host" memory
    log_format: str = "plain"
    log_level: str = "info"
    log_file: Path | None = None  # None = stderr
    metrics_address: str | None = "127.0.0.1:9464"  # host:port; None = no metrics server
    pid_file: Path | None = None
    drain_timeout: float = 30.0  # seconds in-flight requests may run after SIGTERM
    blas: str = "bundled"  # BLAS under MLX's CPU backend: bundled, openblas, numpy or a .so path
    weights: str = "stored"  # "stored": matrices as the file has them; "dense": dequantized
    dtype: str = "auto"  # compute dtype; "auto": bfloat16 on a GPU, float32 on the CPU
    compile: str = "auto"  # "on": mx.compile each recurring batch shape's step; "auto": on a GPU
    # queue the next decode step before reading this one; "auto": on a GPU
    decode_ahead: str = "auto"
    # compile every decode batch shape before serving (compiled runners); "auto": on a GPU;
    # "all": speculation's verify shapes too
    precompile: str = "auto"
    cpus: frozenset[int] | None = None  # CPUs the process runs on; None = wherever it may

    @property
    def max_draft(self) -> int:
        """The pool's and speculator's draft depth: 0 when speculation is off."""
        return self.draft_depth if self.speculation == "auto" else 0

    @property
    def metrics_host_port(self) -> tuple[str, int] | None:
        if self.metrics_address is None:
            return None
        host, _, port = self.metrics_address.rpartition(":")
        return host, int(port)


def _integer(least: int) -> Callable[[Any], int]:
    def parse(v: Any) -> int:
        n = v.strip() if isinstance(v, str) else v
        if isinstance(n, str) and n.isdigit():
            n = int(n)
        if not isinstance(n, int) or isinstance(n, bool) or n < least:
            raise ValueError(f"expected an integer >= {least}")
        return n

    return parse


_positive_int = _integer(1)
_count = _integer(0)


def _seconds(v: Any) -> float:
    x = v
    if isinstance(v, str):
        try:
            x = float(v)
        except ValueError:
            x = None
    if not isinstance(x, int | float) or isinstance(x, bool) or not 0 <= x < float("inf"):
        raise ValueError("expected a number of seconds >= 0")
    return float(x)


def _bytes(v: Any) -> int | None:
    """An integer of bytes or a size like "2GiB" / "512 MB"; "" or 0 means no budget."""
    if v in ("", 0):
        return None
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    m = _SIZE.match(v) if isinstance(v, str) else None
    if m is None:
        raise ValueError('expected bytes as an integer or a size like "2GiB"')
    return int(float(m[1]) * _UNITS[(m[2] or "").upper()])


def _endpoints(v: Any) -> tuple[str, ...]:
    items = v.split(",") if isinstance(v, str) else v
    if not isinstance(items, list | tuple) or not all(isinstance(e, str) for e in items):
        raise ValueError("expected a list of endpoints")
    out = tuple(e.strip() for e in items if e.strip())
    bad = [e for e in out if not e.startswith(("tcp://", "ipc://"))]
    if not out or bad:
        raise ValueError(f"expected tcp://host:port or ipc://path endpoints, got {v!r}")
    return out


def _optional_path(v: Any) -> Path | None:
    if not isinstance(v, str):
        raise ValueError("expected a path string")
    return Path(v) if v else None


def _optional_file(v: Any) -> Path | None:
    path = _optional_path(v)
    if path is not None and not path.is_file():
        raise ValueError("no such file")
    return path


def _model_path(v: Any) -> Path:
    path = _optional_file(v)
    if path is None:
        raise ValueError("no such file")
    return path


def _text(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("expected a string")
    return v


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(v: Any) -> str:
        if v not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return str(v)

    return parse


def _address(v: Any) -> str | None:
    if v == "":
        return None
    host, _, port = _text(v).rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError('expected "host:port" (or "" for no metrics server)')
    return str(v)


def _blas(v: Any) -> str:
    blas.library(_text(v))  # exists, on Linux, or a BlasError (a ValueError) saying what to do
    return str(v)


def _cpus(v: Any) -> frozenset[int] | None:
    chosen = cpus.parse(_text(v))  # a CpuError (a ValueError) says what is wrong
    return None if chosen is None else cpus.check(chosen)


@dataclass(frozen=True)
class Key:
    """One setting: how to parse it (from TOML values and from strings) and its help."""

    name: str
    parse: Callable[[Any], Any]
    help: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


KEYS = (
    Key("model", _model_path, "the GGUF model file (required)"),
    Key("model_name", _text, "the model name clients see (default: the file's stem)"),
    Key("endpoints", _endpoints, "ZeroMQ endpoints to bind, comma-separated"),
    Key("slots", _positive_int, "sequences decoded together (slots in the pool)"),
    Key("context", _positive_int, "tokens per slot: prompt plus generated"),
    Key("memory_budget", _bytes, 'admission budget, e.g. "2GiB" ("" = the whole pool)'),
    Key(
        "mlx_cache_limit",
        _bytes,
        'most bytes of freed buffers MLX keeps for reuse, e.g. "1GiB" ("" = MLX\'s default)',
    ),
    Key("max_queue", _positive_int, "requests waiting for a slot before submits are refused"),
    Key("speculation", _choice(SPECULATION), "speculative decoding: off or auto"),
    Key("draft_depth", _positive_int, "most draft tokens verified per slot and step"),
    Key("dflash", _optional_file, 'a DFlash block drafter GGUF made for the model ("" = none)'),
    Key("prefix_cache", _bytes, 'memory for the prefix cache, e.g. "1GiB" ("" = off)'),
    Key("prefix_cache_interval", _count, "snapshot long prompts every N tokens (0 = never)"),
    Key(
        "prefix_cache_placement",
        _choice(PLACEMENTS),
        "where snapshots live: device (GPU memory on a GPU) or host memory",
    ),
    Key("log_format", _choice(LOG_FORMATS), "plain text or JSON lines"),
    Key("log_level", _choice(LOG_LEVELS), "least severe level logged"),
    Key("log_file", _optional_path, "append logs here, reopened on SIGHUP (default: stderr)"),
    Key("metrics_address", _address, 'Prometheus endpoint host:port ("" = off)'),
    Key("pid_file", _optional_path, "write the process id here while running"),
    Key("drain_timeout", _seconds, "seconds in-flight requests may run after SIGTERM"),
    Key(
        "blas",
        _blas,
        "BLAS under MLX on a Linux CPU: bundled, openblas (Debian's), numpy (the OpenBLAS "
        "numpy bundles, through a shim built on first use), auto (the first of those two "
        "that can be had, else bundled) or a CBLAS .so path",
    ),
    Key(
        "weights",
        _choice(WEIGHTS),
        "quantized matrices: stored (as the file has them) or dense (floats at load)",
    ),
    Key("dtype", _choice(DTYPES), "compute dtype: auto (bfloat16 on a GPU, else float32) or one"),
    Key(
        "compile",
        _choice(COMPILE),
        "mx.compile each recurring batch shape's step: auto (on a GPU), off or on",
    ),
    Key(
        "decode_ahead",
        _choice(DECODE_AHEAD),
        "queue the next decode step while the host reads this one: auto (on a GPU), off or on",
    ),
    Key(
        "precompile",
        _choice(PRECOMPILE),
        "compile every decode batch shape before serving: auto (on a GPU), off, on, or all "
        "(speculation's verify shapes too)",
    ),
    Key(
        "cpus",
        _cpus,
        'CPUs the daemon runs on, a list like "0-7" as taskset -c takes ("" = any it may)',
    ),
)
_BY_NAME = {k.name: k for k in KEYS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per key, all defaulting to None so `load` sees which were given."""
    parser.add_argument("--config", help="TOML file of settings (keys as the flags, with _)")
    for key in KEYS:
        parser.add_argument(key.flag, dest=key.name, help=f"{key.help} [{key.env}]")


def load(
    config_file: Path | None, env: Mapping[str, str], flags: Mapping[str, str | None]
) -> DaemonConfig:
    """Merge the sources (flag > env > file > default), then validate the value that won
    for each key (an overridden bad value in the file is not an error).

    Raises `ConfigError` for an unreadable file, an unknown key, a bad value, a
    missing model or a drafter that cannot serve it, naming the key and its source.
    """
    given: dict[str, tuple[Any, str]] = {}
    if config_file is not None:
        for name, value in _read_toml(config_file).items():
            given[name] = value, str(config_file)
    for key in KEYS:
        if key.env in env:
            given[key.name] = env[key.env], f"environment {key.env}"
        if flags.get(key.name) is not None:
            given[key.name] = flags[key.name], f"flag {key.flag}"
    if "model" not in given:
        raise ConfigError("model: required; set it in the config file, SLOTSERVE_MODEL or --model")
    values = {name: _parse(name, value, source) for name, (value, source) in given.items()}
    config = dataclasses.replace(DaemonConfig(values.pop("model")), **values)
    if config.dflash is not None:
        _check_drafter(config.dflash, config, {name: source for name, (_, source) in given.items()})
    return config


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            table = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    for name in table:
        if name not in _BY_NAME:
            raise ConfigError(f"{name}: unknown key in {path}; known: {', '.join(_BY_NAME)}")
    return table


def _check_drafter(path: Path, config: DaemonConfig, sources: Mapping[str, str]) -> None:
    """Refuse a drafter that would never draft (speculation off) or does not fit the model:
    the checks `load_dflash` makes, on the files' metadata, before any weights load."""
    from engine.gguf import GGUFError, GGUFFile, TensorFile  # MLX: only when a drafter is set
    from engine.spec.dflash import check_target, read_config

    if config.speculation == "off":
        raise ConfigError(
            f"dflash: a drafter needs speculation = auto, but speculation is off (from "
            f"{sources['speculation']}); set speculation = auto or leave dflash empty"
        )
    try:
        target = GGUFFile(config.model).config
    except GGUFError as e:
        raise ConfigError(f"model: {e}") from None
    try:
        check_target(path, read_config(TensorFile(path)), config.model, target)
    except GGUFError as e:
        raise ConfigError(f"dflash: {e} (from {sources['dflash']})") from None


def _parse(name: str, value: Any, source: str) -> Any:
    try:
        return _BY_NAME[name].parse(value)
    except ValueError as e:
        raise ConfigError(f"{name}: {e} (got {value!r} from {source})") from None
