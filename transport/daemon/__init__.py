"""`slotserve serve`: the scheduler and the ZeroMQ server as a long-running service.

Life of the process (`run`):
1. settings are validated before anything else (`transport.config`; exit 2);
2. logging goes to stderr or the log file; the pid file is written;
3. the model (and the DFlash drafter, if set) loads eagerly and the slot pool is
   allocated (logged with timings);
4. the server binds in state STARTING (Ping and Stats answer, Generate gets BUSY),
   every decode batch shape is compiled (`precompile`; on a GPU by default), one
   request is run through the whole path as a warm-up, the state turns READY and
   "ready" is logged;
5. SIGTERM or SIGINT starts the drain: the server answers new Generates with
   SHUTTING_DOWN, the scheduler lets running requests finish for up to
   `drain_timeout` seconds (then ends them with SHUTTING_DOWN), every terminal
   message is sent, and the process exits 0. A second SIGTERM/SIGINT exits at
   once with status 1. SIGHUP reopens the log file. A signal before the
   signal handlers are in place (while the model loads) has its default effect.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

import anyio
import mlx.core as mx

import scheduler as s
from engine.cache import SlotPool
from engine.gguf import GGUFFile
from engine.models.qwen35 import load_model
from engine.runner import ModelRunner
from engine.spec.dflash import load_dflash
from engine.spec.drafters import DFlashDrafter
from engine.spec.speculator import Speculator, default_drafters
from engine.tokenizer import Tokenizer
from transport import blas, cpus
from transport import protocol as p
from transport.config import DaemonConfig
from transport.daemon import faults, heap, logs
from transport.metrics import Metrics
from transport.server import ModelInfo, Server, ServerConfig

log = logging.getLogger("slotserve.daemon")

EXIT_AT_ONCE = 1  # the status of a second stop signal
SEND_GRACE_S = 5.0  # after the drain, how long terminal messages may take to leave


def run(config: DaemonConfig) -> NoReturn:
    """Serve until stopped by a signal, then end the process: status 0 after a clean
    drain, 1 on a second signal or an error.

    The process ends with `os._exit` once logs are flushed and the pid file removed:
    native teardown of MLX's per-thread streams at interpreter exit intermittently
    aborts ("terminate called without an active exception", status -6), which would
    turn a clean drain into a crash for the service manager.
    """
    status = 1
    reopen = logs.configure(config.log_format, config.log_level, config.log_file)
    if config.pid_file is not None:
        config.pid_file.write_text(f"{os.getpid()}\n")
    try:
        anyio.run(_serve, config, reopen)
        status = 0
    except Exception:
        log.exception("the daemon failed")
    finally:
        if config.pid_file is not None:
            config.pid_file.unlink(missing_ok=True)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def build_scheduler(config: DaemonConfig) -> tuple[s.Scheduler, ModelInfo]:
    """Load the model (and the drafter) and allocate the pools. Call on the thread that
    runs the scheduler's event loop: MLX evaluates a graph only on the thread that built it."""
    path = config.model
    if config.mlx_cache_limit is not None:  # freed buffers kept for reuse; MLX's default: all
        mx.set_cache_limit(config.mlx_cache_limit)
        log.info("MLX buffer cache limited to %.1f MiB", config.mlx_cache_limit / 2**20)
    if config.cpus is not None:  # pinned by the CLI before any thread started
        log.info("running on CPUs %s", cpus.format_list(cpus.allowed()))
    log.info("loading model %s (%.1f MiB)", path, path.stat().st_size / 2**20)
    t0 = time.perf_counter()
    # "dense": quantized matrices dequantized to floats at load — on a CPU MLX's quantized
    # matmul costs the same per token however many rows share a step, a BLAS GEMM does not
    dtype = compute_dtype(config.dtype)
    model = load_model(path, dtype, dense=config.weights == "dense")
    tokenizer = Tokenizer.from_metadata(GGUFFile(path).metadata)
    cfg = model.config
    log.info(
        "model loaded in %.1f s on %s: %s, %d layers, vocab %d, %s weights, %s compute, "
        "compiled steps %s",
        time.perf_counter() - t0,
        mx.default_device(),
        cfg.name,
        cfg.n_layer,
        cfg.n_vocab,
        config.weights,
        dtype,
        "on" if on_a_gpu_if_auto(config.compile) else "off",
    )
    if mx.default_device() == mx.cpu and blas.on_linux() and blas.library(config.blas) is None:
        log.info(
            "float products run on MLX's bundled reference BLAS, one thread; blas = numpy "
            "(a C compiler needed once) or openblas decodes 8 rows ~6x faster (docs/OPERATIONS.md)"
        )
    t0 = time.perf_counter()
    kv_dtype = kv_dtype_for(dtype)
    pool = SlotPool(cfg, config.slots, config.context, kv_dtype, max_draft=config.max_draft)
    log.info(
        "slot pool: %d slots x %d tokens, draft depth %d, allocated in %.1f s",
        config.slots,
        config.context,
        config.max_draft,
        time.perf_counter() - t0,
    )
    sched_config = s.SchedulerConfig(
        max_queue=config.max_queue,
        memory_bytes=config.memory_budget,
        shutdown_grace_s=config.drain_timeout,
        prefix_cache=None
        if config.prefix_cache is None
        else s.PrefixCacheConfig(
            config.prefix_cache,
            config.prefix_cache_interval,
            placement=config.prefix_cache_placement,
        ),
        fault_hook=faults.from_environment(os.environ),  # test-only; None unless set
        decode_ahead=on_a_gpu_if_auto(config.decode_ahead),
    )
    if config.prefix_cache is not None:
        log.info(
            "prefix cache: %.0f MiB of %s memory; a snapshot of %d tokens takes %.1f MiB",
            config.prefix_cache / 2**20,
            config.prefix_cache_placement,
            config.context,
            pool.bytes_for(config.context) / 2**20,
        )
    runner = ModelRunner(model, pool, compile=on_a_gpu_if_auto(config.compile))
    speculator = None if config.dflash is None else _dflash_speculator(runner, config.dflash)
    scheduler = s.Scheduler(runner, tokenizer, sched_config, speculator)
    if config.decode_ahead == "on" and not scheduler.decode_ahead:
        log.warning("decode_ahead is on but does nothing beside a DFlash drafter")
    return scheduler, ModelInfo.of(scheduler, config.model_name or path.stem)


def compute_dtype(setting: str) -> mx.Dtype:
    """The `dtype` setting as an MLX dtype: "auto" is bfloat16 on a GPU (what the kernels and
    benchmarks there run; half the bytes of float32 per weight read), float32 on the CPU
    (MLX's CPU backend computes bfloat16 slowly, and f32 is what the parity tests hold)."""
    if setting == "auto":
        return mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    return getattr(mx, setting)


def kv_dtype_for(dtype: mx.Dtype) -> mx.Dtype:
    """The pool's K/V dtype beside a compute dtype: bfloat16 beside bfloat16, else float16."""
    return mx.bfloat16 if dtype == mx.bfloat16 else mx.float16


def on_a_gpu_if_auto(setting: str) -> bool:
    """An "auto" / "on" / "off" setting: "auto" is on where MLX computes on a GPU. So are
    `compile` (a step of hundreds of eager operations pays MLX's launch cost for each there;
    on the CPU the parity tests hold the eager path) and `decode_ahead` (a GPU's decode step
    at small N is bound by the host's launches — H200, the bare engine queueing each step on
    the last one's tokens: 1.09-1.29x the tokens/s at N = 1, 8, 32 on the 0.8B shape,
    1.14-1.27x on the 9B — where on the CPU the step's compute leaves nothing to hide)."""
    if setting == "auto":
        return mx.default_device() == mx.gpu
    return setting == "on"


def _dflash_speculator(runner: ModelRunner, path: Path) -> Speculator:
    """The default drafters and the DFlash drafter at `path` (its context pool allocated)."""
    t0 = time.perf_counter()
    drafters = default_drafters(runner, load_dflash(path, runner.model))
    dflash = next(d for d in drafters if isinstance(d, DFlashDrafter))
    cfg = dflash.model.config
    log.info(
        "DFlash drafter %s (%.1f MiB): block %d, so up to %d drafts a step at draft depth %d; "
        "%d layer(s) reading target layers %s; context pool %.1f MiB; loaded in %.1f s",
        path,
        path.stat().st_size / 2**20,
        cfg.block_size,
        min(cfg.block_size - 1, runner.pool.max_draft),
        runner.pool.max_draft,
        cfg.n_layer,
        list(cfg.target_layers),
        dflash.pool.total_bytes / 2**20,
        time.perf_counter() - t0,
    )
    return Speculator(runner, runner.pool.max_draft, drafters)


async def precompile(scheduler: s.Scheduler, setting: str) -> int:
    """With `precompile` on (`on_a_gpu_if_auto`) or "all", compile every decode batch shape
    the scheduler's runner can meet before serving — with "all", every speculative verify
    shape too (`Scheduler.precompile`); the number compiled, logged with the time it took."""
    every = setting == "all"
    if not (every or on_a_gpu_if_auto(setting)):
        return 0
    if not scheduler.runner.compile:
        if setting != "auto":
            log.warning("precompile is %s but compile is off: there is nothing to compile", setting)
        return 0
    t0 = time.perf_counter()
    made = await scheduler.precompile(verify=every)
    what = "decode and verify" if every else "decode"
    log.info("precompiled %d %s step shapes in %.1f s", made, what, time.perf_counter() - t0)
    return made


async def warm_up(scheduler: s.Scheduler) -> float:
    """Run one short request through prefill and decode; returns its seconds."""
    t0 = time.perf_counter()
    request = s.Request(prompt=[1, 2, 3, 4], max_tokens=2, ignore_eos=True, request_id="warm-up")
    await scheduler.submit(request).collect()
    return time.perf_counter() - t0


async def _serve(config: DaemonConfig, reopen: logs.ReopenableFileHandler | None) -> None:
    scheduler, info = build_scheduler(config)
    metrics = Metrics(scheduler)
    server = Server(
        scheduler, info, ServerConfig(endpoints=config.endpoints), observer=metrics.observe
    )
    server.state = p.ServerState.STARTING
    address = config.metrics_host_port
    http = metrics.serve(*address) if address is not None else None
    stop = anyio.Event()
    try:
        # Signals are watched until the very end, so a second one always exits at once.
        async with anyio.create_task_group() as signals:
            signals.start_soon(_handle_signals, stop, reopen, config.pid_file)
            async with (
                scheduler.running(),
                server.running() as endpoints,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(metrics.refresh_forever)
                tg.start_soon(heap.trim_forever)
                await precompile(scheduler, config.precompile)
                log.info("warming up")
                log.info("warm-up step took %.2f s", await warm_up(scheduler))
                heap.settle_collector()
                metrics.refresh()  # counters start from the warmed-up state
                server.state = p.ServerState.READY
                where = f"; metrics on http://{config.metrics_address}/metrics" if http else ""
                log.info("ready: serving %s on %s%s", info.name, ", ".join(endpoints), where)
                await stop.wait()
                await _drain(scheduler, server, config.drain_timeout)
                tg.cancel_scope.cancel()
            signals.cancel_scope.cancel()
    finally:
        if http is not None:
            http.shutdown()
    log.info("stopped")


async def _drain(scheduler: s.Scheduler, server: Server, timeout_s: float) -> None:
    """Refuse new requests, let running ones finish within `timeout_s`, send every
    terminal message."""
    server.state = p.ServerState.DRAINING
    st = scheduler.stats()
    log.info("draining: %d running, %d waiting; up to %.1f s", st.running, st.waiting, timeout_s)
    await scheduler.shutdown(timeout_s)
    if not await server.drain(SEND_GRACE_S):
        log.warning("some terminal messages were still unsent at exit")


async def _handle_signals(
    stop: anyio.Event, reopen: logs.ReopenableFileHandler | None, pid_file: Path | None
) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if signum == signal.SIGHUP:
                if reopen is not None:
                    reopen.reopen()
                    log.info("SIGHUP: reopened the log file %s", reopen.baseFilename)
            elif not stop.is_set():
                log.info("%s: stopping; a second signal exits at once", name)
                stop.set()
            else:
                log.warning("%s again: exiting at once", name)
                if pid_file is not None:
                    pid_file.unlink(missing_ok=True)
                logging.shutdown()
                os._exit(EXIT_AT_ONCE)
