"""The `slotserve` command line: one entry point, one subcommand per job.

Each subcommand parses its flags here and calls into the package that owns the
work; nothing else lives in this file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transport.sockets import CurveClient


def _cmd_make_model(args: argparse.Namespace) -> int:
    from engine import writer

    spec = writer.spec_from_cli(args)
    writer.write_model(args.out, spec)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _cmd_make_dflash(args: argparse.Namespace) -> int:
    from engine import dflash_writer

    dflash_writer.write_dflash(args.out, dflash_writer.dflash_spec_from_cli(args))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from engine import inspect as inspect_mod

    print(inspect_mod.describe(args.model))
    return 0


def _cmd_logits(args: argparse.Namespace) -> int:
    import numpy as np

    from engine.generate import prefill_logits
    from engine.models.qwen35 import load_model

    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    logits = prefill_logits(load_model(args.model), tokens)
    np.save(args.out, logits)
    print(f"wrote {args.out} {logits.shape}", file=sys.stderr)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine.generate import generate_text

    for piece in generate_text(
        args.model,
        args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        chat=args.chat,
    ):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _curve_client(args: argparse.Namespace) -> CurveClient | None:
    from transport.sockets import CurveClient

    if (args.curve_secret is None) != (args.server_key is None):
        raise ValueError("CURVE needs both --curve-secret and --server-key")
    if args.curve_secret is None:
        return None
    return CurveClient(Path(args.curve_secret), Path(args.server_key))


def _add_connection_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("endpoint", help="the server, e.g. tcp://127.0.0.1:5555 or ipc:///run/s.sock")
    p.add_argument("--curve-secret", help="this client's CURVE certificate (.key_secret)")
    p.add_argument("--server-key", help="the server's CURVE public certificate (.key)")


def _cmd_client(args: argparse.Namespace) -> int:
    from transport.client import ClientError, SyncClient

    prompt: str | list[dict[str, str]] = args.prompt
    if args.chat:
        prompt = [{"role": "user", "content": args.prompt}]
    try:
        with SyncClient(args.endpoint, curve=_curve_client(args)) as client:
            for delta in client.generate(
                prompt, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
            ):
                sys.stdout.write(delta.text)
                sys.stdout.flush()
    except ClientError as e:
        print(f"slotserve client: {e}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    return 0


def _cmd_loadgen(args: argparse.Namespace) -> int:
    import anyio

    from transport import loadgen, loadreport
    from transport.client import ClientError

    if args.duration is None and args.requests is None:
        args.duration = 10.0
    config = loadgen.LoadConfig(
        endpoint=args.endpoint,
        concurrency=args.concurrency,
        rate=args.rate,
        duration_s=args.duration,
        requests=args.requests,
        connections=args.connections,
        temperature=args.temperature,
        ignore_eos=not args.stop_at_eos,
        seed=args.seed,
        curve=_curve_client(args),
    )
    progress = None if args.quiet else sys.stderr
    prompts = None if args.prompts is None else Path(args.prompts)
    try:
        records = anyio.run(
            loadgen.run_load, config, prompts, args.prompt_tokens, args.max_tokens, progress
        )
    except ClientError as e:
        print(f"slotserve loadgen: {e}", file=sys.stderr)
        return 1
    summary = loadreport.summarize(config, records)
    print(loadreport.table(summary))
    if args.json:
        loadreport.write_json(Path(args.json), summary, records)
    if args.plot:
        loadreport.plot(Path(args.plot), summary, records)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import os

    from transport import blas, config, cpus

    flags = {key.name: getattr(args, key.name) for key in config.KEYS}
    file = None if args.config is None else Path(args.config)
    try:
        settings = config.load(file, os.environ, flags)
        if not args.check:  # before the model loads: a preload re-executes the process
            command = [sys.executable, "-m", "transport.cli", *args.argv]
            blas.ensure_preloaded(settings.blas, command)
            if settings.cpus is not None:  # before the threads of MLX, ZeroMQ and ours start
                cpus.pin(settings.cpus)
    except (config.ConfigError, blas.BlasError, cpus.CpuError) as e:
        print(f"slotserve serve: config error: {e}", file=sys.stderr)
        return 2
    if not _engine_switches_ok(os.environ):
        return 2
    if args.check:
        print(f"slotserve serve: settings are valid: {settings}", file=sys.stderr)
        return 0
    from transport import daemon

    return daemon.run(settings)


def _engine_switches_ok(env: Mapping[str, str]) -> bool:
    """The engine's SLOTSERVE_* switches in `env`: every bad value named as a config error
    (False: do not serve); names nothing reads, warned about."""
    from engine import switches
    from transport import blas, config
    from transport.daemon import faults

    bad = switches.problems(env)
    for line in bad:
        print(f"slotserve serve: config error: {line}", file=sys.stderr)
    ours = {key.env for key in config.KEYS} | {blas.REEXEC_MARK, faults.ENV}
    for name in switches.unknown(env, ours):
        print(f"slotserve serve: warning: {name} is set but nothing reads it", file=sys.stderr)
    return not bad


def _cmd_demo(args: argparse.Namespace) -> int:
    from transport.daemon.demo import run_demo

    return run_demo(Path(args.model), args.duration, args.concurrency, args.max_tokens, args.slots)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slotserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {}

    p = sub.add_parser("make-model", help="write a deterministic random-weight GGUF model")
    p.add_argument("out", help="output .gguf path")
    from engine.writer import add_cli_arguments

    add_cli_arguments(p)
    commands["make-model"] = _cmd_make_model

    p = sub.add_parser("make-dflash", help="write a random-weight DFlash drafter for a preset")
    p.add_argument("out", help="output .gguf path")
    from engine.dflash_writer import add_dflash_cli_arguments

    add_dflash_cli_arguments(p)
    commands["make-dflash"] = _cmd_make_dflash

    p = sub.add_parser("inspect", help="architecture, tensors and per-slot state bytes of a GGUF")
    p.add_argument("model")
    commands["inspect"] = _cmd_inspect

    p = sub.add_parser("logits", help="float32 logits [T, vocab] of one prefill, as .npy")
    p.add_argument("model")
    p.add_argument("--tokens", required=True, help="comma-separated token ids")
    p.add_argument("--out", required=True, help="output .npy path")
    commands["logits"] = _cmd_logits

    p = sub.add_parser("generate", help="stream one continuation to stdout")
    p.add_argument("model")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    commands["generate"] = _cmd_generate

    p = sub.add_parser("client", help="send one prompt to a server and stream the text")
    _add_connection_arguments(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="send it as a user chat message")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    commands["client"] = _cmd_client

    p = sub.add_parser("loadgen", help="load a server and report throughput and latency")
    _add_connection_arguments(p)
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--concurrency", type=int, help="closed loop: requests kept in flight")
    load.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    p.add_argument("--duration", type=float, help="seconds of arrivals (default 10)")
    p.add_argument("--requests", type=int, help="requests to send (with --duration: first wins)")
    p.add_argument("--connections", type=int, default=4, help="client connections to spread over")
    p.add_argument("--prompts", help="JSON lines: {'prompt'|'tokens'|'messages', 'max_tokens'?}")
    p.add_argument("--prompt-tokens", type=int, default=32, help="synthetic prompt length")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--stop-at-eos", action="store_true", help="end requests at EOS tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the summary and every request here")
    p.add_argument("--plot", help="write a PNG of throughput and latency distributions here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    commands["loadgen"] = _cmd_loadgen

    p = sub.add_parser("serve", help="run the daemon: settings from --config, SLOTSERVE_*, flags")
    from transport.config import add_arguments

    add_arguments(p)
    p.add_argument("--check", action="store_true", help="validate the settings and exit")
    commands["serve"] = _cmd_serve

    p = sub.add_parser("demo", help="a daemon on the demo model under load, then a clean stop")
    from transport.daemon.demo import DEMO_MODEL

    p.add_argument("--model", default=str(DEMO_MODEL), help="the trained demo model by default")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=8, help="requests kept in flight")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--slots", type=int, default=8)
    commands["demo"] = _cmd_demo

    parser.set_defaults(_commands=commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to re-execute with (`serve`)
    try:
        return args._commands[args.command](args)
    except (ValueError, OSError) as e:
        # Bad input, not a bug: an unusable model file (GGUFError), token ids outside the
        # vocabulary, an unwritable output path. Say what is wrong; no traceback.
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
