"""`python -m tools.demo_model STEP ...`: the demo model's recipe, one subcommand per step.

    corpus -> vocab -> pack        (CPU machine; writes DATA/ids.npz, carry it to the GPU)
    train                          (GPU machine: numpy + mlx + this repository only)
    export -> report               (CPU machine, from the run directory train wrote)
    smoke                          (all of it, tiny, on CPU)
    dflash-train -> dflash-export  (a DFlash drafter for a trained model file, issue 10)

Heavier imports happen inside each step, so `train` never loads `gguf` or `tokenizers`.

The shipped model, step by step (defaults write under out/demo/):

    python -m tools.demo_model corpus && python -m tools.demo_model vocab
    python -m tools.demo_model pack                      # out/demo/data/ids.npz, ~6 MB
    # on the GPU machine, carrying out/demo/data/ids.npz:
    python3 -m tools.demo_model train --run $OUT/run --time-limit 300 --steps 100000
    # back here, with the run directory it wrote:
    python -m tools.demo_model export --run RUN --out MODEL.gguf
    python -m tools.demo_model report MODEL.gguf

The DFlash drafter of the shipped model (GPU machine; ~4 minutes):

    python3 -m tools.demo_model dflash-train --target models/slotserve-demo.gguf \
        --ids out/demo/data/ids.npz --run $OUT/dflash --time-limit 300 --no-compile
    python3 -m tools.demo_model dflash-export --run $OUT/dflash --out $OUT/dflash/drafter.gguf
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from tools.demo_model.config import RECIPES, Recipe
from tools.demo_model.dflash import DFLASH_RECIPES, DFlashRecipe
from tools.demo_model.train import RunOptions

DATA = Path("out/demo/data")
RUN = Path("out/demo/run")


def recipe_from(args: argparse.Namespace) -> Recipe:
    r = RECIPES[args.recipe]
    changes = {
        f: getattr(args, f)
        for f in ("seq_len", "batch", "steps", "lr", "warmup", "dtype", "seed")
        if getattr(args, f, None) is not None
    }
    return dataclasses.replace(r, **changes)


def add_run_options(parser: argparse.ArgumentParser, save_dtype: str) -> None:
    """The flags of `train.RunOptions`."""
    parser.add_argument("--time-limit", type=float, default=None, help="seconds, compile included")
    parser.add_argument("--checkpoint-s", type=float, default=60.0)
    parser.add_argument("--eval-s", type=float, default=30.0, help="held-out check period; 0: none")
    parser.add_argument("--save-dtype", choices=("float16", "float32"), default=save_dtype)
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="mx.compile the step (--no-compile on CUDA: its JIT took 337 s for step 1)",
    )


def run_options(args: argparse.Namespace) -> RunOptions:
    return RunOptions(args.time_limit, args.checkpoint_s, args.eval_s, args.save_dtype,
                      compile=args.compile)  # fmt: skip


def dflash_recipe_from(args: argparse.Namespace) -> DFlashRecipe:
    r = DFLASH_RECIPES[args.recipe]
    names = {"layers": "n_layer"}
    flags = ("seq_len", "batch", "steps", "lr", "warmup", "dtype", "seed", "anchors",
             "block_size", "layers")  # fmt: skip
    changes = {names.get(f, f): getattr(args, f) for f in flags if getattr(args, f) is not None}
    if args.target_layers:
        changes["target_layers"] = tuple(int(i) for i in args.target_layers.split(","))
    return dataclasses.replace(r, **changes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.demo_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("corpus", help="stdlib sources -> DATA/{train,heldout}.jsonl")
    c.add_argument("--data", type=Path, default=DATA)
    c.add_argument("--max-files", type=int, default=None, help="small subset (smoke)")

    v = sub.add_parser("vocab", help="train the byte-level BPE -> DATA/vocab.json")
    v.add_argument("--data", type=Path, default=DATA)
    v.add_argument("--recipe", choices=sorted(RECIPES), default="full")

    p = sub.add_parser("pack", help="encode the corpus -> DATA/ids.npz (uint16)")
    p.add_argument("--data", type=Path, default=DATA)

    t = sub.add_parser("train", help="train on DATA/ids.npz -> RUN/weights-*.npz, run.json")
    t.add_argument("--ids", type=Path, default=DATA / "ids.npz")
    t.add_argument("--run", type=Path, default=RUN)
    t.add_argument("--recipe", choices=sorted(RECIPES), default="full")
    add_run_options(t, save_dtype="float16")
    for flag, kind in (("--seq-len", int), ("--batch", int), ("--steps", int), ("--lr", float)):
        t.add_argument(flag, type=kind, default=None)
    t.add_argument("--warmup", type=int, default=None)
    t.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    t.add_argument("--seed", type=int, default=None)

    e = sub.add_parser("export", help="RUN/weights-*.npz -> GGUF with its tokenizer")
    e.add_argument("--run", type=Path, default=RUN)
    e.add_argument("--out", type=Path, default=None, help="default RUN/<name>.gguf")
    e.add_argument("--quant", default=None, help="override the recipe's (q8_0, f16, f32)")

    r = sub.add_parser("report", help="held-out perplexity, samples, MTP acceptance")
    r.add_argument("model", type=Path)
    r.add_argument("--data", type=Path, default=DATA)
    r.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    r.add_argument("--quick", action="store_true", help="few prompts and tokens (smoke)")

    s = sub.add_parser("smoke", help="every step, tiny, on CPU")
    s.add_argument("--dir", type=Path, default=Path("out/demo-smoke"))

    d = sub.add_parser("dflash-train", help="train a DFlash drafter for --target on DATA ids")
    d.add_argument("--target", type=Path, required=True, help="the model's GGUF file")
    d.add_argument("--ids", type=Path, default=DATA / "ids.npz")
    d.add_argument("--run", type=Path, default=Path("out/demo/dflash"))
    d.add_argument("--recipe", choices=sorted(DFLASH_RECIPES), default="full")
    add_run_options(d, save_dtype="float32")  # a drafter is small: keep what it learned
    for flag, kind in (("--seq-len", int), ("--batch", int), ("--steps", int), ("--lr", float),
                       ("--warmup", int), ("--seed", int), ("--anchors", int),
                       ("--block-size", int), ("--layers", int)):  # fmt: skip
        d.add_argument(flag, type=kind, default=None)
    d.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    d.add_argument("--target-layers", default=None, help="comma-separated trunk layers")

    x = sub.add_parser("dflash-export", help="RUN/weights-*.npz -> the drafter's GGUF")
    x.add_argument("--run", type=Path, default=Path("out/demo/dflash"))
    x.add_argument("--out", type=Path, default=None, help="default RUN/<name>.<quant>.gguf")

    args = ap.parse_args(argv)
    if args.cmd == "corpus":
        from tools.demo_model.data import write_corpus

        print(json.dumps(write_corpus(args.data, args.max_files)))
    elif args.cmd == "vocab":
        from tools.demo_model.data import write_vocab

        print(json.dumps(write_vocab(args.data, RECIPES[args.recipe].spec["vocab_size"])))
    elif args.cmd == "pack":
        from tools.demo_model.data import pack

        print(json.dumps(pack(args.data)))
    elif args.cmd == "train":
        from tools.demo_model.train import train

        train(recipe_from(args), args.ids, args.run, run_options(args))
    elif args.cmd == "export":
        from tools.demo_model.export import export

        print(json.dumps(export(args.run, args.out, args.quant)))
    elif args.cmd == "report":
        from tools.demo_model.report import report

        result = report(args.model, args.data, quick=args.quick)
        text = json.dumps(result, indent=1)
        if args.out:
            args.out.write_text(text)
        print(text)
    elif args.cmd == "dflash-train":
        from tools.demo_model.dflash_train import dflash_train

        dflash_train(dflash_recipe_from(args), args.target, args.ids, args.run, run_options(args))
    elif args.cmd == "dflash-export":
        from tools.demo_model.dflash_train import dflash_export

        print(json.dumps(dflash_export(args.run, args.out)))
    elif args.cmd == "smoke":
        from tools.demo_model.export import smoke

        print(json.dumps(smoke(args.dir), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
