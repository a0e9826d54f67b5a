"""How long the daemon's `precompile` takes: `ModelRunner.precompile_decode` on a pool of
`--slots` x `--context`, which compiles and pins the decode forward of every padded batch
width x past bucket before any request is served. Prints the shapes compiled, the seconds,
and the first decode step's time after it (at the widest shape; it should compile nothing).
`--verify K` also times `ModelRunner.precompile_verify` for draft depths 1..K (the daemon's
`precompile = "all"`), on a pool with room for K drafts; with `--mtp`, also the MTP head's
steady shapes (`MTPDrafter.precompile`: its catch-up and draft chains, uniform rounds).

    python bench/precompile_time.py --model MODEL.gguf --slots 64 --context 4096 [--verify 4 [--mtp]]
"""

from __future__ import annotations

import argparse
import json
import time

import harness  # noqa: F401  (puts the repository root on sys.path)
import mlx.core as mx

from engine.cache import SlotPool
from engine.models.qwen35 import load_model
from engine.runner import ModelRunner
from engine.spec.drafters import MTPDrafter

DTYPES = {"bf16": mx.bfloat16, "f16": mx.float16, "f32": mx.float32}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--verify", type=int, default=0, help="also verify shapes of 1..K drafts")
    p.add_argument("--mtp", action="store_true", help="also the MTP head's shapes (needs --verify)")
    p.add_argument("--json")
    args = p.parse_args()
    if args.mtp and not args.verify:
        p.error("--mtp needs --verify K (the draft depth)")
    t = time.perf_counter()
    model = load_model(args.model, DTYPES[args.dtype])
    load_s = time.perf_counter() - t
    pool = SlotPool(
        model.config, args.slots, args.context, kv_dtype=DTYPES[args.dtype], max_draft=args.verify
    )
    runner = ModelRunner(model, pool, compile=True)
    slots = [pool.allocate() for _ in range(args.slots)]
    t = time.perf_counter()
    made = runner.precompile_decode()
    took = time.perf_counter() - t
    t = time.perf_counter()
    verify = runner.precompile_verify(range(1, args.verify + 1)) if args.verify else 0
    verify_s = time.perf_counter() - t
    t = time.perf_counter()
    mtp = 0
    if args.mtp:
        runner.pad_widths = True  # uniform rounds, as a compiled runner on a GPU has them
        mtp = MTPDrafter(runner, uniform=True).precompile(args.verify)
    mtp_s = time.perf_counter() - t
    # one decode step at the widest width afterwards: it should meet a compiled shape
    cold = runner.cold_steps
    t = time.perf_counter()
    pending = runner.launch(slots, mx.zeros((len(slots),), dtype=mx.int32))
    mx.eval(pending.logits)
    step_s = time.perf_counter() - t
    r = {
        "model": args.model,
        "slots": args.slots,
        "context": args.context,
        "device": str(mx.default_device()),
        "load_s": load_s,
        "shapes": made,
        "precompile_s": took,
        "per_shape_ms": 1e3 * took / max(made, 1),
        "verify_depths": args.verify,
        "verify_shapes": verify,
        "verify_s": verify_s,
        "per_verify_shape_ms": 1e3 * verify_s / max(verify, 1),
        "mtp_shapes": mtp,
        "mtp_s": mtp_s,
        "per_mtp_shape_ms": 1e3 * mtp_s / max(mtp, 1),
        "first_step_after_ms": 1e3 * step_s,
        "cold_forwards_after": runner.cold_steps - cold,
    }
    print(json.dumps(r, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
