"""The `slotserve` command line: one entry point, one subcommand per job.

Each subcommand parses its flags here and calls into the package that owns the
work; nothing else lives in this file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _cmd_make_model(args: argparse.Namespace) -> int:
    from engine import writer

    spec = writer.spec_from_cli(args)
    writer.write_model(args.out, spec)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slotserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {}

    p = sub.add_parser("make-model", help="write a deterministic random-weight GGUF model")
    p.add_argument("out", help="output .gguf path")
    from engine.writer import add_cli_arguments

    add_cli_arguments(p)
    commands["make-model"] = _cmd_make_model

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

    parser.set_defaults(_commands=commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args._commands[args.command](args)
    except (ValueError, OSError) as e:
        # Bad input, not a bug: an unusable model file (GGUFError), token ids outside the
        # vocabulary, an unwritable output path. Say what is wrong; no traceback.
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
